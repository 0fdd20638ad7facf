"""Entry points answer --help and reject bad flags clearly; the client commands say when nothing is
listening; ``pagedserve up`` stops everything when a service fails to start.

(``up`` serving the default model end to end is tests/e2e/test_readme.py; the client commands
against a live gateway are tests/e2e/test_cli_client.py.)
"""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedserve.sockets import free_port

CLI = [sys.executable, "-m", "pagedserve.cli"]


@pytest.mark.parametrize("cmd", [["-m", "memory_service"], ["-m", "gateway"], ["-m", "pagedserve.cli"],
                                 ["-m", "pagedserve.cli", "up"], ["-m", "pagedserve.cli", "generate"],
                                 ["-m", "pagedserve.cli", "chat"]])
def test_help(cmd: list[str]) -> None:
    out = subprocess.run([sys.executable, *cmd, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout


@pytest.mark.parametrize(("cmd", "named"), [
    (["-m", "memory_service", "--block-size", "0"], "block_size"),
    (["-m", "gateway"], "backends"),
    (["-m", "gateway", "--backend", "nohost"], "backend 'nohost'"),
    (["-m", "gateway", "--backend", "h:1", "--max-queued-requests", "0"], "max_queued_requests"),
    (["-m", "gateway", "--backend", "h:1", "--api-keys-file", "/nonexistent/keys"], "api_keys_file"),
    (["-m", "pagedserve.cli", "up", "--port", "70000"], "port"),
    (["-m", "pagedserve.cli", "up", "--http-port", "-1"], "http_port"),
    (["-m", "pagedserve.cli", "up", "--dtype", "int8"], "--dtype"),
    (["-m", "compute_service", "--dtype", "int8"], "dtype must be 'auto' or one of"),
    (["-m", "gateway", "--backend", "h:1", "--http-port", "70000"], "http_port"),
    (["-m", "gateway", "--backend", "h:1", "--listen", "127.0.0.1:0", "--http-port", "1", "--http-host", "192.0.2.1"],
     "http: cannot bind"),
    (["-m", "gateway", "--backend", "h:1", "--listen", "192.0.2.1:50051"], "listen: cannot bind"),
])
def test_bad_flag_value_is_a_clear_error(cmd: list[str], named: str) -> None:
    out = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and named in out.stderr, out.stderr


@pytest.mark.parametrize("command", [["generate", "hi"], ["chat"]])
def test_client_commands_say_when_nothing_is_listening(command: list[str]) -> None:
    address = f"127.0.0.1:{free_port()}"
    out = subprocess.run([*CLI, *command, "--address", address, "--connect-timeout", "1"],
                         capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert out.returncode == 1
    assert f"no gateway is listening at {address}" in out.stderr and "pagedserve up" in out.stderr


def test_up_stops_everything_when_a_service_fails_to_start(tmp_path: Path) -> None:
    out = subprocess.run([*CLI, "up", "--model", str(tmp_path / "no-such-model"), "--port", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "compute_service exited with status" in out.stderr and "stopped" in out.stderr
    runtime = re.search(r"unix:(\S+)/memory\.sock", out.stderr).group(1)
    assert not Path(runtime).exists()  # sockets and the private directory are gone


def _on_a_terminal(argv: list[str], timeout_s: float = 120) -> str:
    """Runs ``argv`` with a pseudo-terminal as its stdout and stderr (as from a shell); its output."""
    import os
    import pty
    import select

    leader, follower = pty.openpty()
    proc = subprocess.Popen(argv, stdout=follower, stderr=follower, stdin=subprocess.DEVNULL)
    os.close(follower)
    output = b""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], 0.5)
        if ready:
            try:
                data = os.read(leader, 65536)
            except OSError:  # the terminal closed: every writer exited
                break
            if not data:
                break
            output += data
        elif proc.poll() is not None:
            break
    proc.wait(timeout=30)
    os.close(leader)
    return re.sub(r"\x1b\[[0-9;]*m", "", output.decode(errors="replace"))  # colours off


def test_up_on_a_terminal_shows_readable_one_line_logs(tmp_path: Path) -> None:
    text = _on_a_terminal([*CLI, "up", "--model", str(tmp_path / "no-such-model"), "--port", "0", "--http-port", "0"])
    [started] = [line for line in text.splitlines() if "memory_service_started" in line]
    assert not started.lstrip().startswith("{") and "[info" in started and "component=memory_service" in started


@pytest.mark.parametrize("log_format", ["json", "console"])
def test_log_format_flag_of_every_service(log_format: str) -> None:
    for module in ("memory_service", "compute_service", "gateway"):
        help_text = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True,
                                   timeout=60).stdout
        assert "--log-format {json,console}" in help_text
    gateway = subprocess.Popen([sys.executable, "-m", "gateway", "--backend", f"127.0.0.1:{free_port()}", "--listen",
                                f"127.0.0.1:{free_port()}", "--log-format", log_format],
                               stderr=subprocess.PIPE, text=True)
    try:
        line = gateway.stderr.readline()
    finally:
        gateway.terminate()
        gateway.wait(timeout=30)
        gateway.stderr.close()
    assert "gateway_listening" in line
    if log_format == "json":
        assert json.loads(line)["event"] == "gateway_listening"
    else:
        assert not line.startswith("{") and "[info" in line


def test_api_key_from_a_file_and_a_warning_for_one_on_the_command_line(tmp_path: Path, monkeypatch, capsys) -> None:
    """--api-key puts the key in ps and the shell history; --api-key-file does not."""
    from pagedserve_cli.cli import api_key, build_parser, main

    monkeypatch.delenv("PAGEDSERVE_API_KEY", raising=False)
    key_file = tmp_path / "key"
    key_file.write_text("file-key-123\n")
    assert api_key(build_parser().parse_args(["generate", "hi", "--api-key-file", str(key_file)])) == "file-key-123"
    assert capsys.readouterr().err == ""
    assert api_key(build_parser().parse_args(["generate", "hi", "--api-key", "argv-key"])) == "argv-key"
    assert "--api-key-file" in capsys.readouterr().err  # warned
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "env-key")
    assert api_key(build_parser().parse_args(["chat"])) == "env-key" and capsys.readouterr().err == ""
    (tmp_path / "empty").write_text("\n")
    for flags, named in ((["--api-key-file", str(tmp_path / "empty")], "is empty"),
                         (["--api-key-file", str(tmp_path / "none")], "No such file"),
                         (["--api-key-file", str(key_file), "--api-key", "k"], "not both")):
        assert main(["generate", "hi", "--address", "127.0.0.1:1", *flags]) == 2
        assert named in capsys.readouterr().err


@pytest.mark.unit
def test_up_passes_the_service_flags_it_is_given_and_no_others() -> None:
    from pagedserve_cli.up import UpConfig, stack_config

    config = UpConfig(service_flags={"dtype": "float32", "kv_cache_bytes": 1 << 20})
    stack = stack_config(config, "json", 8000)
    assert stack.compute_args[:2] == ("--dtype", "float32")
    assert stack.memory_args[:2] == ("--kv-cache-bytes", str(1 << 20))
    # Not given: not passed, so the service's default (or a --config file's value) holds.
    assert "--dtype" not in stack_config(UpConfig(), "json", 8000).compute_args
    assert "--kv-cache-bytes" not in stack_config(UpConfig(service_flags={"dtype": None}), "json", 8000).memory_args
    with pytest.raises(ValueError, match="--dtype: dtype must be 'auto' or one of"):
        UpConfig(service_flags={"dtype": "int8"})
    with pytest.raises(ValueError, match="--kv-cache-bytes: kv_cache_bytes must be >= 1"):
        UpConfig(service_flags={"kv_cache_bytes": 0})
    with pytest.raises(ValueError, match=r"\['max_num_seqs'\] are not passed through"):
        UpConfig(service_flags={"max_num_seqs": 4})
    # The gateway's flag too (how tool_choice auto reads the model's calls).
    gateway = stack_config(UpConfig(service_flags={"tool_call_parser": "llama3_json"}), "json", 8000).gateway_args
    assert gateway[-2:] == ("--tool-call-parser", "llama3_json")
    with pytest.raises(ValueError, match="--tool-call-parser: tool_call_parser must be one of auto, hermes"):
        UpConfig(service_flags={"tool_call_parser": "mistral"})


@pytest.mark.unit
def test_up_flags_are_derived_from_the_services_configs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each pass-through flag takes the service's name, type, help and default; adding one is one line."""
    import compute_service.__main__ as compute_main
    import memory_service.__main__ as memory_main
    from pagedserve_cli import up
    from pagedserve_cli.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["up", "--kv-cache-bytes", "4096", "--dtype", "bfloat16"])
    assert (args.kv_cache_bytes, args.dtype) == (4096, "bfloat16")
    assert (parser.parse_args(["up"]).kv_cache_bytes, parser.parse_args(["up"]).dtype) == (None, None)
    up_help = build_parser()._subparsers._group_actions[0].choices["up"].format_help()
    assert memory_main.FLAGS["kv_cache_bytes"] in up_help and "(default auto)" in up_help
    assert compute_main.ENGINE_FLAGS["dtype"].split(" (")[0] in up_help
    monkeypatch.setenv("PAGEDSERVE_KV_CACHE_BYTES", "8192")
    assert build_parser().parse_args(["up"]).kv_cache_bytes == 8192  # typed by the flag
    # A new pass-through (a KV-tier flag next): one entry, and the flag, its type and its value follow.
    monkeypatch.setattr(up, "PASS_THROUGH", (*up.PASS_THROUGH, up.PassThrough("memory", "enable_prefix_caching")))
    args = build_parser().parse_args(["up", "--enable-prefix-caching", "false"])
    assert args.enable_prefix_caching is False
    config = up.UpConfig(service_flags={"enable_prefix_caching": False})
    assert up.stack_config(config, "json", 8000).memory_args[:2] == ("--enable-prefix-caching", "false")


def test_up_passes_the_kv_tier_flags_to_the_memory_service(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``up --kv-disk-dir DIR --kv-disk-bytes N`` reaches the memory service (DIR made
    absolute: the tier outlives the run), and the service it starts runs that tier."""
    import grpc

    from memory_service.api import KvLayout
    from memory_service.convert import layout_to_pb
    from pagedserve_cli.cli import build_parser
    from pagedserve.memory.v1 import memory_pb2, memory_pb2_grpc
    from pagedserve.stack import memory_process, ready
    from pagedserve_cli.up import UpConfig, stack_config

    args = build_parser().parse_args(["up", "--kv-disk-dir", "tier", "--kv-disk-bytes", "1048576"])
    assert (args.kv_disk_dir, args.kv_disk_bytes) == ("tier", 1 << 20)
    monkeypatch.chdir(tmp_path)
    stack = stack_config(UpConfig(service_flags={"kv_disk_dir": "tier", "kv_disk_bytes": 1 << 20}), "json", 8000)
    assert stack.memory_args[:4] == ("--kv-disk-dir", str(tmp_path / "tier"), "--kv-disk-bytes", str(1 << 20))
    assert "--kv-disk-dir" not in stack.compute_args
    with pytest.raises(ValueError, match="--kv-disk-bytes: kv_disk_bytes needs kv_disk_dir"):
        UpConfig(service_flags={"kv_disk_bytes": 1 << 20})
    with pytest.raises(ValueError, match="--kv-disk-bytes: kv_disk_bytes must be >= 1"):
        UpConfig(service_flags={"kv_disk_dir": "tier", "kv_disk_bytes": 0})

    socket = tmp_path / "run" / "memory.sock"
    service = ready(memory_process(socket, [*stack.memory_args[:4], "--log-level", "warning"]), 60)
    try:
        with grpc.insecure_channel(f"unix:{socket}") as channel:
            layout = KvLayout(num_layers=1, num_kv_heads=1, head_dim=4, dtype="float32", block_size=16)
            reply = memory_pb2_grpc.MemoryManagerStub(channel).Attach(
                memory_pb2.AttachRequest(client_name="t", layout=layout_to_pb(layout)), timeout=30)
        assert [(t.kind, t.capacity_bytes) for t in reply.tiers] == [("disk", 1 << 20)]
        assert (tmp_path / "tier" / "memory-service-id").read_text().strip() == reply.memory_service_id
    finally:
        assert service.stop() == 0


def test_up_passes_the_host_tier_flag_to_the_memory_service() -> None:
    """``up --kv-host-bytes N`` reaches the memory service (with or without a disk tier); a bad value
    is refused naming the flag."""
    from pagedserve_cli.cli import build_parser
    from pagedserve_cli.up import UpConfig, stack_config

    assert build_parser().parse_args(["up", "--kv-host-bytes", "4096"]).kv_host_bytes == 4096
    stack = stack_config(UpConfig(service_flags={"kv_host_bytes": 4096}), "json", 8000)
    assert stack.memory_args[:2] == ("--kv-host-bytes", "4096")
    assert "--kv-host-bytes" not in stack.compute_args
    with pytest.raises(ValueError, match="--kv-host-bytes: kv_host_bytes must be an integer >= 1, got 0"):
        UpConfig(service_flags={"kv_host_bytes": 0})


def test_ctrl_c_drains_up_in_order_and_leaves_nothing(service_model) -> None:
    """Ctrl-C (SIGINT to the terminal's whole process group) while a stream is in
    flight. The services run in process groups of their own, so only ``up`` gets it and drains them in
    order, gateway, compute, memory, each once the one in front has exited: the stream completes
    through all three, a new request is refused, ``up`` exits 0 within the sum of the three bounds, and
    nothing is left (processes, the runtime directory and its sockets, shared memory)."""
    import os
    import signal
    import threading

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from pagedserve.compute.v1.compute_pb2 import LoadRequest
    from pagedserve.compute.v1.compute_pb2_grpc import ComputeStub
    from pagedserve.drain import stop_bound_s
    from pagedserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc
    from pagedserve.stack import shm_segments
    from tests.processes import child_pids, is_gone

    drain_s = 20
    proc = subprocess.Popen([*CLI, "up", "--model", str(service_model.path), "--port", "0", "--http-port", "0",
                             "--drain-timeout-s", str(drain_s), "--log-format", "json"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL,
                            start_new_session=True)  # its own process group, like a job in a terminal
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        def is_up() -> bool:
            assert proc.poll() is None, "".join(output)
            return any("pagedserve is up" in line for line in output)

        from pagedserve.process import wait_until

        wait_until(is_up, 180, "pagedserve up's ready line", interval_s=0.1)
        text = "".join(output)
        address = re.search(r"gateway on (\S+),", text).group(1)
        runtime = Path(re.search(r"unix:(\S+)/memory\.sock", text).group(1))
        services = child_pids(proc.pid)
        assert len(services) == 3
        assert all(os.getpgid(pid) == pid for pid in services)  # each its own group
        channel = grpc.insecure_channel(address)
        stream = gateway_pb2_grpc.GatewayStub(channel).GenerateStream(gateway_pb2.GenerateRequest(
            prompt="a tiny", params=gateway_pb2.SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)),
            timeout=120)
        read = [next(stream)]
        # Still generating in the engine when Ctrl-C comes (its Unix socket in up's runtime directory).
        with grpc.insecure_channel(f"unix:{runtime}/compute.sock") as compute:
            assert ComputeStub(compute).Load(LoadRequest(), timeout=10).num_running == 1
        signal_at = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C
        read += list(stream)  # the stream in flight completes through all three services

        # up passes Ctrl-C to the gateway first; on a loaded machine the stream's last token can come
        # before the gateway has it. Once it drains (NOT_SERVING, or gone), a late request is refused
        # (up's gateway has no drain delay, during which NOT_SERVING would still take requests).
        def draining() -> bool:
            try:
                return health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=5).status != health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError:
                return True

        wait_until(draining, 30, "the gateway draining", interval_s=0.05)
        with grpc.insecure_channel(address) as late, pytest.raises(grpc.RpcError) as refused:
            gateway_pb2_grpc.GatewayStub(late).Generate(gateway_pb2.GenerateRequest(
                prompt="a tiny", params=gateway_pb2.SamplingParams(max_tokens=2)), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        channel.close()
        bound_s = sum(stop_bound_s(m, drain_s) for m in ("gateway", "compute_service", "memory_service"))
        assert proc.wait(timeout=bound_s + 30) == 0
        exited_s = time.monotonic() - signal_at
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=10)
    text = "".join(output)
    assert sum(len(m.token_ids) for m in read) == 400
    assert [m.finish_reason for m in read if m.finish_reason] == ["length"]
    stopped = [line.split("pagedserve: ")[1].split(" stopped")[0] for line in text.splitlines()
               if re.match(r"pagedserve: \S+ stopped \(", line)]
    assert stopped == ["gateway", "compute_service", "memory_service"], text[-3000:]
    print(f"up drain: exited {exited_s:.2f} s after Ctrl-C (bound {bound_s} s); "
          + "; ".join(line for line in text.splitlines() if re.match(r"pagedserve: \S+ stopped \(", line)))
    assert exited_s <= bound_s
    assert all(is_gone(pid) for pid in services)
    assert not runtime.exists()
    assert not [name for pid in services for name in shm_segments(pid)]


def test_a_second_ctrl_c_kills_without_draining_and_leaves_nothing(service_model) -> None:
    """A stream whose client reads nothing holds the gateway's drain up to its timeout (60 s here).
    A second Ctrl-C does not wait for it: every service is killed at once, and the memory service's
    shared-memory pool, which a killed service cannot remove, is removed by ``up``."""
    import os
    import signal
    import threading

    import grpc

    from pagedserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc
    from pagedserve.process import wait_until
    from pagedserve.stack import shm_segments
    from tests.processes import child_pids, is_gone

    proc = subprocess.Popen([*CLI, "up", "--model", str(service_model.path), "--port", "0", "--http-port", "0",
                             "--drain-timeout-s", "60", "--log-format", "json"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        wait_until(lambda: proc.poll() is None and any("pagedserve is up" in line for line in output), 180,
                   "pagedserve up's ready line", interval_s=0.1)
        text = "".join(output)
        address = re.search(r"gateway on (\S+),", text).group(1)
        runtime = Path(re.search(r"unix:(\S+)/memory\.sock", text).group(1))
        services = child_pids(proc.pid)
        segments = [name for pid in services for name in shm_segments(pid)]
        channel = grpc.insecure_channel(address)
        stream = gateway_pb2_grpc.GatewayStub(channel).GenerateStream(gateway_pb2.GenerateRequest(
            prompt="a tiny", params=gateway_pb2.SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)),
            timeout=120)
        next(stream)  # then never read again
        os.killpg(proc.pid, signal.SIGINT)
        wait_until(lambda: any("gateway_stopping" in line or "draining" in line for line in output), 30,
                   "the drain under way", interval_s=0.05)
        signal_at = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # the second Ctrl-C
        assert proc.wait(timeout=30) == 0
        killed_s = time.monotonic() - signal_at
        channel.close()
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=10)
    assert "killing the services without draining them" in "".join(output)
    assert killed_s < 10, killed_s
    assert segments and all(is_gone(pid) for pid in services)
    assert not runtime.exists()
    assert not [name for pid in services for name in shm_segments(pid)]
