"""Follows the README with the real default model at the default dtype: ``pagedserve up``, the README's
``pagedserve generate``, ``grpcurl`` and ``curl`` lines answering its question, then Ctrl-C leaves nothing.

One ``pagedserve up`` serves the whole module (the model loads once); the last test interrupts it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from pagedserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from pagedserve.process import wait_until
from pagedserve.sockets import free_port
from pagedserve.stack import shm_segments
from tests.processes import child_pids

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
QUESTION = "What is the capital of France?"

# The real model on a busy 2-core machine can take far longer than the 600 s default.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def _readme_lines(prefix: str) -> list[str]:
    """Command lines of the README's first code block that start with ``prefix``."""
    block = re.search(r"```\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.startswith(prefix)]


def _command(name: str) -> list[str]:
    """The installed console script, as the README runs it (``python -m`` when not installed)."""
    script = BIN / name
    return [str(script)] if script.exists() else [sys.executable, "-m", "pagedserve.cli"]


@dataclass
class Up:
    proc: subprocess.Popen
    address: str
    http_port: int
    output: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def up() -> Iterator[Up]:
    # The README's first command is `bash scripts/up.sh`: install, then `pagedserve up`. The
    # install already happened (this test runs from it), so run what it ends with.
    assert _readme_lines("bash scripts/up.sh"), "the README's first command is no longer scripts/up.sh"
    assert "exec pagedserve up" in (ROOT / "scripts" / "up.sh").read_text()
    port, http_port = free_port(), free_port()  # not the default 8000: other runs may hold it
    # The default dtype, as the README runs it (auto: bf16 on a CPU with native bf16): its own question
    # must be answered right there (a plain bf16 forward answered "L'Étoile, ...").
    proc = subprocess.Popen([*_command("pagedserve"), "up", "--port", str(port), "--http-port", str(http_port)],
                            stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            start_new_session=True)  # its own process group, like a job in a terminal
    started = Up(proc, f"127.0.0.1:{port}", http_port)
    reader = threading.Thread(target=lambda: started.output.extend(proc.stdout), daemon=True)
    reader.start()

    def is_up() -> bool:
        assert proc.poll() is None, "".join(started.output)
        return any("pagedserve is up" in line for line in started.output)

    # A first run converts the default model (~20 s on 2 cores).
    wait_until(is_up, 300, "pagedserve up's ready line", interval_s=0.2)
    yield started
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)


def test_up_prints_the_address_and_a_grpcurl_command_that_works(up: Up) -> None:
    text = "".join(up.output)
    assert f"gateway on {up.address}" in text
    [hint] = [line.strip() for line in up.output if line.strip().startswith("grpcurl ")]
    argv = shlex.split(hint)
    out = subprocess.run([str(BIN / "grpcurl"), *argv[1:]], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


def test_up_prints_a_curl_command_for_the_http_api_that_works(up: Up) -> None:
    [hint] = [line.strip() for line in up.output if line.strip().startswith("curl ")]
    assert f"http://127.0.0.1:{up.http_port}/v1/chat/completions" in hint
    # The README's curl line is the same command on the default port.
    [readme] = _readme_lines("curl ")
    assert readme == hint.replace(f":{up.http_port}/", ":8000/")
    out = subprocess.run(shlex.split(hint), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    reply = json.loads(out.stdout)
    assert reply["object"] == "chat.completion" and "Paris" in reply["choices"][0]["message"]["content"]


def test_up_logs_are_json_lines_when_not_on_a_terminal(up: Up) -> None:
    # up's stderr is a pipe here, so its services log JSON (on a terminal: one readable line each).
    events = [json.loads(line) for line in up.output if line.startswith("{")]
    assert {e.get("component") for e in events} >= {"gateway", "memory_service", "compute_service"}
    assert not [line for line in up.output if line.startswith("20") and "[info" in line]  # no console lines


def test_readme_generate_line(up: Up) -> None:
    [line] = _readme_lines(".venv/bin/pagedserve generate")
    argv = shlex.split(line)[2:]  # after ".venv/bin/pagedserve generate"
    out = subprocess.run([*_command("pagedserve"), "generate", "--address", up.address, *argv],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout and "finish_reason=" in out.stderr


def test_the_readme_question_at_the_default_dtype_through_grpc_and_http(up: Up) -> None:
    """Token for token against transformers is pinned at float32 (tests/compute_service/
    test_engine_default_model.py); here the default dtype answers right on both fronts, alike."""
    from transformers import AutoTokenizer

    from compute_service.model.model_loader import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("default").path)  # the converted copy `up` loaded
    messages = [{"role": "user", "content": QUESTION}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    with grpc.insecure_channel(up.address) as channel:
        reply = gateway_pb2_grpc.GatewayStub(channel).Generate(gateway_pb2.GenerateRequest(
            messages=[gateway_pb2.ChatMessage(**m) for m in messages],
            params=gateway_pb2.SamplingParams(max_tokens=20, temperature=0.0)), timeout=120)
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.choices[0].text.startswith("The capital of France is Paris"), reply.choices[0].text
    # The same chat through the OpenAI-compatible HTTP front, with the official SDK.
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{up.http_port}/v1", api_key="unused", max_retries=0)
    [model] = client.models.list().data
    chat = client.chat.completions.create(model=model.id, messages=messages, max_tokens=20, temperature=0,
                                          logprobs=True)
    assert chat.choices[0].message.content == reply.choices[0].text
    assert len(chat.choices[0].logprobs.content) == len(reply.choices[0].token_ids)
    assert chat.usage.prompt_tokens == len(ids)


def test_ctrl_c_stops_everything_and_leaves_nothing(up: Up) -> None:
    children = child_pids(up.proc.pid)
    assert len(children) == 3  # memory, compute, gateway
    runtime = re.search(r"unix:(\S+)/memory\.sock", "".join(up.output)).group(1)
    assert Path(runtime).is_dir() and (Path(runtime).stat().st_mode & 0o777) == 0o700
    # Ctrl-C in a terminal: SIGINT to the whole foreground process group, children included.
    os.killpg(up.proc.pid, signal.SIGINT)
    assert up.proc.wait(timeout=60) == 0
    # Nothing of the group runs on: the three services and their helpers (the memory service's
    # shared-memory resource tracker may linger a moment as a zombie until init reaps it).
    group = subprocess.run(["ps", "-o", "pid,stat,args", "--no-headers", "-g", str(up.proc.pid)],
                           capture_output=True, text=True).stdout.splitlines()
    assert not [line for line in group if line.split()[1][0] != "Z"], group
    assert not Path(runtime).exists()
    assert not [name for pid in children for name in shm_segments(pid)]
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", int(up.address.rsplit(":", 1)[1])), timeout=2).close()
