"""``pagedserve generate`` and ``pagedserve chat`` against a live gateway: plain gRPC clients that
print the same text the API returns."""

from __future__ import annotations

import subprocess
import sys

from pagedserve.gateway.v1 import gateway_pb2
from tests.e2e.conftest import Gateway

CLI = [sys.executable, "-m", "pagedserve.cli"]


def _expected(gateway: Gateway, messages: list[tuple[str, str]], max_tokens: int) -> str:
    reply = gateway.stub.Generate(gateway_pb2.GenerateRequest(
        messages=[gateway_pb2.ChatMessage(role=r, content=c) for r, c in messages],
        params=gateway_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0)), timeout=60)
    return reply.choices[0].text


def test_generate_streams_and_unary_print_the_completion(gateway: Gateway) -> None:
    expected = _expected(gateway, [("user", "hello")], 12)
    for extra in ([], ["--no-stream"]):
        out = subprocess.run([*CLI, "generate", "hello", "--address", gateway.address, "--max-tokens", "12", *extra],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout == expected + "\n"
        assert "prompt tokens" in out.stderr and "12 generated" in out.stderr or "finish_reason=eos" in out.stderr


def test_chat_keeps_the_history(gateway: Gateway) -> None:
    first = _expected(gateway, [("user", "hi")], 8)
    second = _expected(gateway, [("user", "hi"), ("assistant", first), ("user", "more")], 8)
    out = subprocess.run([*CLI, "chat", "--address", gateway.address, "--max-tokens", "8"], input="hi\nmore\n",
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"you> assistant> {first}\nyou> assistant> {second}\nyou> \n"
