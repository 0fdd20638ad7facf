"""The HTTP front against hostile clients, on a real gateway process.

One gateway with its HTTP front, a cap of 20 connections and a 1 s read deadline, started under a
soft descriptor limit of 512: it runs with its hard limit, closes idle half-sent connections, and
both fronts keep answering while they are open and after.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pagedserve.gateway.v1 import gateway_pb2
from pagedserve.process import wait_until
from pagedserve.sockets import free_port
from pagedserve_testing.stack import Gateway, start_gateway
from tests.e2e.conftest import Engine
from tests.processes import lowered_open_files_limit, open_files_limits

HALF_SENT = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"  # the headers never end
PROBE = Path(__file__).resolve().parents[2] / "helm" / "pagedserve" / "files" / "health_probe.py"
NUM_IDLE, MAX_CONNECTIONS = 30, 20
RESET = b"<reset>"


class Front:
    def __init__(self, gateway: Gateway, http_port: int) -> None:
        self.gateway, self.port = gateway, http_port
        self.base_url = f"http://127.0.0.1:{http_port}"

    def metric(self, name: str, labels: str = "") -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.gateway.metrics_port}/metrics", timeout=10).read()
        match = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text.decode(), re.MULTILINE)
        return float(match.group(1)) if match else 0.0


@pytest.fixture(scope="module")
def front(engines: list[Engine], run_dir: Path) -> Iterator[Front]:
    port = free_port()
    with lowered_open_files_limit(512):
        gateway = start_gateway([engines[0].address], run_dir, "--http-port", str(port), "--http-max-connections",
                                str(MAX_CONNECTIONS), "--http-read-timeout-s", "1")
    wait_until(lambda: gateway.num_healthy_backends() == 1, what="the backend in rotation")
    yield Front(gateway, port)
    assert gateway.stop() == 0


def _generate(front: Front) -> gateway_pb2.GenerateResponse:
    return front.gateway.stub.Generate(gateway_pb2.GenerateRequest(
        prompt="hello", params=gateway_pb2.SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)), timeout=60)


def _until_closed(conn: socket.socket) -> bytes:
    """What the server sent until it closed the connection (30 s socket timeout: never reached)."""
    data = b""
    try:
        while chunk := conn.recv(4096):
            data += chunk
    except ConnectionResetError:
        return RESET
    return data


def test_the_gateway_runs_with_its_hard_descriptor_limit(front: Front) -> None:
    soft, hard = open_files_limits(front.gateway.process.pid)
    assert soft == hard and hard > 512


def test_idle_half_sent_connections_are_closed_and_both_fronts_answer(front: Front) -> None:
    idle = [socket.create_connection(("127.0.0.1", front.port), timeout=30) for _ in range(NUM_IDLE)]
    try:
        for conn in idle:
            conn.sendall(HALF_SENT)
        # Both fronts answer while the idle connections are held (the cap keeps room for them).
        assert len(_generate(front).choices[0].token_ids) == 2
        answers = [_until_closed(conn) for conn in idle]
    finally:
        for conn in idle:
            conn.close()
    # Each one closed by the server with nothing to answer: at its deadline, or, beyond the cap, when a
    # newer connection took the place of the one waiting longest for its headers (or a
    # reset when the request reached it as it closed). None is refused: none carries a request.
    assert all(a in (b"", RESET) for a in answers), answers
    closed = {reason: front.metric("pagedserve_gateway_http_connections_closed_total", f'{{reason="{reason}"}}')
              for reason in ("headers_timeout", "evicted_waiting_for_headers", "over_capacity")}
    assert closed["headers_timeout"] + closed["evicted_waiting_for_headers"] == NUM_IDLE
    assert closed["evicted_waiting_for_headers"] >= NUM_IDLE - MAX_CONNECTIONS and closed["over_capacity"] == 0
    assert httpx.get(f"{front.base_url}/health", timeout=30).status_code == 200
    assert len(_generate(front).choices[0].token_ids) == 2


def test_a_body_that_stops_coming_is_408_and_no_internal_error(front: Front) -> None:
    conn = socket.create_connection(("127.0.0.1", front.port), timeout=30)
    try:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        answer = _until_closed(conn)
    finally:
        conn.close()
    assert answer.startswith(b"HTTP/1.1 408 ") and b"did not arrive" in answer
    assert front.metric("pagedserve_gateway_http_connections_closed_total", '{reason="body_timeout"}') == 1
    assert httpx.get(f"{front.base_url}/health", timeout=30).status_code == 200
    # The handler saw its client gone, not a bug (no error line with a traceback).
    assert front.gateway.log_file is not None and "openai_internal_error" not in front.gateway.log_file.read_text()


def test_the_liveness_probe_notices_a_stuck_gateway_that_tcp_does_not(front: Front) -> None:
    """The chart's liveness probe (health_probe.py --alive --http-port): passes while both fronts
    answer, fails while the gateway is stopped (SIGSTOP), when a TCP connect still succeeds."""
    probe = [sys.executable, str(PROBE), "--alive", "--http-port", str(front.port), front.gateway.address,
             "pagedserve.gateway.v1.Gateway"]
    alive = subprocess.run(probe, capture_output=True, text=True, timeout=60)
    assert alive.returncode == 0 and alive.stdout.split() == ["SERVING", "HTTP", "200"], alive
    front.gateway.process.send_signal(signal.SIGSTOP)
    try:
        socket.create_connection(("127.0.0.1", front.port), timeout=10).close()  # the kernel's backlog answers
        stuck = subprocess.run(probe, capture_output=True, text=True, timeout=60)
    finally:
        front.gateway.process.send_signal(signal.SIGCONT)
    assert stuck.returncode == 1 and "failed" in stuck.stderr
    assert subprocess.run(probe, capture_output=True, timeout=60).returncode == 0


def test_a_keyless_gateway_answers_loopback_hosts_and_json_bodies_only(front: Front) -> None:
    """A page using DNS rebinding (Host: evil.example) or a blind form POST gets an
    OpenAI error; a loopback name with a JSON body is answered."""
    url = f"{front.base_url}/v1/completions"
    body = b'{"prompt": "hi", "max_tokens": 1}'
    with httpx.Client(timeout=30) as client:
        rebound = client.post(url, content=body, headers={"host": "evil.example:8000",
                                                          "content-type": "application/json"})
        untyped = client.post(url, content=body, headers={"host": "localhost"})
        plain = client.post(url, content=body, headers={"content-type": "text/plain"})
        fine = client.post(url, content=body, headers={"host": f"localhost:{front.port}",
                                                       "content-type": "application/json"})
    assert (rebound.status_code, untyped.status_code, plain.status_code, fine.status_code) == (421, 415, 415, 200)
    assert rebound.json()["error"]["code"] == "host_not_allowed"
    assert untyped.json()["error"]["message"] == "Content-Type must be application/json, got none"


def test_errors_and_log_lines_stay_short_whatever_the_body(front: Front) -> None:
    """A 4300-digit seed is a short 400; 20,000 unknown fields are one
    short log line (a count and five names), not every name."""
    url = f"{front.base_url}/v1/completions"
    with httpx.Client(timeout=60) as client:
        seed = client.post(url, content=b'{"prompt": "hi", "max_tokens": 1, "seed": ' + b"9" * 4300 + b"}",
                           headers={"content-type": "application/json"})
        fields = ", ".join(f'"unknown_{i}": 0' for i in range(20_000))
        client_body = client.post(url, content=f'{{"prompt": "hi", "max_tokens": 1, {fields}}}'.encode(),
                                  headers={"content-type": "application/json"})
    assert seed.status_code == 400 and seed.json()["error"]["param"] == "seed" and len(seed.content) < 400
    assert client_body.status_code == 200
    assert front.gateway.log_file is not None
    wait_until(lambda: '"openai_unknown_fields"' in front.gateway.log_file.read_text(), what="the log line")
    [line] = [json.loads(x) for x in front.gateway.log_file.read_text().splitlines() if "openai_unknown_fields" in x]
    assert line["num_fields"] == 20_000 and line["fields"] == [f"unknown_{i}" for i in range(5)]
    assert len(json.dumps(line)) < 1000
