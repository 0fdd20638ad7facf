"""llama.cpp as the serving benchmark's peer, without llama.cpp: the arguments, llama-server's command
line, its start and stop (a stand-in script that speaks /health and /v1/models), the ratios' keys."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks import bench_serving
from benchmarks.serving import vllm_bench
from benchmarks.serving.llama_server import BINARY_ENV, LlamaServer

# A stand-in llama-server: writes its argv beside itself, answers /health 503 twice (the model
# "loading") then 200, lists one model, and ignores SIGTERM when told to (so stop must SIGKILL).
FAKE_SERVER = textwrap.dedent("""\
    import json, signal, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    from pathlib import Path

    argv = sys.argv[1:]
    Path(__file__).with_suffix(".argv").write_text(json.dumps(argv))
    if "--ignore-sigterm" in argv:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    health = [503, 503]

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/health":
                code, body = (health.pop() if health else 200), b"{}"
            else:
                code, body = 200, json.dumps({"object": "list", "data": [{"id": "tiny.gguf"}]}).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    HTTPServer(("127.0.0.1", int(argv[argv.index("--port") + 1])), Handler).serve_forever()
""")


@pytest.fixture
def fake_binary(tmp_path: Path) -> Path:
    script = tmp_path / "fake_llama_server.py"
    script.write_text(FAKE_SERVER)
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!/bin/sh\nexec {sys.executable} {script} \"$@\"\n")
    binary.chmod(0o755)
    return binary


@pytest.fixture
def gguf(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.gguf"
    path.write_bytes(b"GGUF")
    return path


def _error(capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    with pytest.raises(SystemExit):
        bench_serving.parse_args(argv)
    return capsys.readouterr().err


def test_llamacpp_peer_arguments(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, fake_binary: Path,
                                 gguf: Path) -> None:
    monkeypatch.setenv(BINARY_ENV, str(fake_binary))
    bench = ["--client", "vllm-bench", "--peer", "llamacpp"]
    args = bench_serving.parse_args([*bench, "--model", str(gguf)])
    assert (args.llama_server, args.llama_gguf, args.llama_slots, args.llama_ctx, args.llama_args) == (
        str(fake_binary), str(gguf), 16, 2048, [])
    assert args.vllm_dtype is None and args.kv_cache_bytes == 1 << 30  # vLLM's settings stay unresolved
    args = bench_serving.parse_args([*bench, "--llama-gguf", str(gguf), "--max-num-seqs", "8",
                                     "--llama-args", "--no-repack -fa on", "--llama-ctx", "4096"])
    assert (args.llama_slots, args.llama_ctx, args.llama_args) == (8, 4096, ["--no-repack", "-fa", "on"])
    assert bench_serving.parse_args([*bench, "--model", str(gguf), "--llama-slots", "4"]).llama_slots == 4
    assert bench_serving.parse_args([*bench, "--model", str(gguf), "--llama-args=--no-repack"]).llama_args == [
        "--no-repack"]

    assert "--client vllm-bench only" in _error(capsys, ["--peer", "llamacpp", "--model", str(gguf)])
    assert "--llama-gguf FILE, or a .gguf --model" in _error(capsys, bench)  # --model default: no file
    assert "--llama-gguf: no file at" in _error(capsys, [*bench, "--llama-gguf", str(gguf.with_name("gone.gguf"))])
    assert "--llama-slots must be >= 1, got 0" in _error(capsys, [*bench, "--model", str(gguf), "--llama-slots", "0"])
    missing = str(fake_binary.with_name("missing"))
    assert f"--llama-server: no executable file at {missing!r}" in _error(
        capsys, [*bench, "--model", str(gguf), "--llama-server", missing])
    monkeypatch.delenv(BINARY_ENV)
    assert f"--llama-server PATH or ${BINARY_ENV}" in _error(capsys, [*bench, "--model", str(gguf)])


def test_quantization_reaches_the_compute_service(capsys: pytest.CaptureFixture) -> None:
    compute = bench_serving.stack_config(bench_serving.parse_args(["--quantization", "int4"]), True) \
        .stack_config(http_port=1).compute_args
    assert compute[compute.index("--quantization") + 1] == "int4"
    default = bench_serving.stack_config(bench_serving.parse_args([]), True).stack_config(http_port=1).compute_args
    assert "--quantization" not in default  # the service's own default
    assert "invalid choice: 'int3'" in _error(capsys, ["--quantization", "int3"])


def test_llama_server_command_line() -> None:
    server = LlamaServer(Path("/bin/llama-server"), Path("/m/model.gguf"), num_slots=16, ctx_per_slot=2048,
                         extra_args=("--no-repack",))
    assert server.command(8080) == [
        "/bin/llama-server", "-m", "/m/model.gguf", "-t", "2", "-tb", "2", "-np", "16", "-c", "32768",
        "--cont-batching", "--host", "127.0.0.1", "--port", "8080", "--no-webui", "--no-repack"]
    for bad in ({"threads": 0}, {"num_slots": 0}, {"ctx_per_slot": -1}):
        with pytest.raises(ValueError, match=f"{next(iter(bad))} must be >= 1"):
            LlamaServer(Path("b"), Path("g"), **bad)


@pytest.mark.parametrize("ignore_sigterm", [False, True])
def test_llama_server_starts_when_healthy_and_stops_its_group(tmp_path: Path, fake_binary: Path, gguf: Path,
                                                              ignore_sigterm: bool) -> None:
    extra = ("--ignore-sigterm",) if ignore_sigterm else ()
    server = LlamaServer(fake_binary, gguf, num_slots=4, extra_args=extra, log_file=tmp_path / "log",
                         ready_timeout_s=30)
    with server:
        argv = json.loads((tmp_path / "fake_llama_server.argv").read_text())
        assert argv == server.command(server.port)[1:]
        assert server.served_model == "tiny.gguf"
        pid = server._proc.pid
        status = server.stop(timeout_s=0.5)
    assert status == (-9 if ignore_sigterm else -15)
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)  # its whole group is gone


def test_llama_server_missing_binary_fails_before_starting(tmp_path: Path, gguf: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no llama-server binary at"):
        LlamaServer(tmp_path / "none", gguf).start()


def test_compare_names_the_llamacpp_ratios_and_goals() -> None:
    def phase(out_tok_s: float, ttft_s: float, tpot_s: float) -> dict:
        return {"out_tok_s": out_tok_s, "ttft_s": {"p50": ttft_s, "p99": ttft_s}, "tpot_s": {"p50": tpot_s}}

    ours = {"phases": {"one_at_a_time": phase(20.0, 0.1, 0.05), "rate-inf": phase(300.0, 2.0, 0.1)}}
    theirs = {"phases": {"one_at_a_time": phase(25.0, 0.2, 0.04), "rate-inf": phase(200.0, 4.0, 0.125)}}
    comparison = vllm_bench.compare(ours, theirs, "llamacpp")
    assert set(comparison) == {"vs_llamacpp", "goals_vs_llamacpp"}
    assert comparison["vs_llamacpp"]["rate-inf"] == {"out_tok_s_ratio": 1.5, "ttft_p50_ratio": 0.5,
                                                     "ttft_p99_ratio": 0.5, "tpot_p50_ratio": 0.8}
    assert comparison["vs_llamacpp"]["one_at_a_time"]["tpot_p50_ratio"] == 1.25
    assert comparison["goals_vs_llamacpp"] == {"saturation_ratio": 1.5, "saturation_goal_met": False,  # 2x asked
                                               "one_at_a_time_tpot_no_worse": False,
                                               "one_at_a_time_tpot_goal_met": False,
                                               "one_at_a_time_ttft_no_worse": True}
    assert set(vllm_bench.compare(ours, theirs)) == {"vs_vllm", "goals"}  # vLLM's keys as before
