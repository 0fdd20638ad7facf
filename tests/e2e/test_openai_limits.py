"""The HTTP front's limits that the gateway core now holds for both fronts:
a prompt list capped and admitted before it is converted, the unary reply cap, and the write-stall
timeout of SSE streams. One gateway with tenants, a small reply cap (64 KiB) and a 1 s stall
timeout, in front of one of the session's engines."""

from __future__ import annotations

import json
import re
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pagedserve.process import wait_until
from pagedserve.sockets import free_port
from tests.e2e.conftest import Engine, Gateway, start_gateway

KEY_SMALL, KEY_BIG = "small-tenant-key-5d1e", "big-tenant-key-9a7c"
TENANTS = {"tenants": {"small": {"keys": [KEY_SMALL], "max_concurrent": 2}, "big": {"keys": [KEY_BIG]}}}
REPLY_CAP = 65536
MAX_PROMPTS = 8


class Front:
    def __init__(self, gateway: Gateway, http_port: int) -> None:
        self.gateway, self.port = gateway, http_port
        self.url = f"http://127.0.0.1:{http_port}"

    def post(self, path: str, body: dict, key: str = KEY_BIG) -> httpx.Response:
        return httpx.post(self.url + path, json=body, headers={"authorization": f"Bearer {key}"}, timeout=120)

    def metric(self, name: str, labels: str = "") -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.gateway.metrics_port}/metrics", timeout=10).read()
        match = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text.decode(), re.MULTILINE)
        return float(match.group(1)) if match else 0.0

    def requests(self, method: str) -> dict[str, float]:
        """The requests counter of one method, by status."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.gateway.metrics_port}/metrics", timeout=10).read()
        pattern = rf'^pagedserve_gateway_requests_total{{method="{re.escape(method)}",status="(\w+)"}} (\S+)$'
        return {status: float(v) for status, v in re.findall(pattern, text.decode(), re.MULTILINE)}


@pytest.fixture(scope="module")
def front(engines: list[Engine], run_dir: Path) -> Iterator[Front]:
    keys, config = run_dir / "limits-tenants.json", run_dir / "limits-gateway.json"
    keys.write_text(json.dumps(TENANTS))
    config.write_text(json.dumps({"max_message_bytes": REPLY_CAP}))
    port = free_port()
    gateway = start_gateway([engines[0].address], run_dir, "--config", str(config), "--http-port", str(port),
                            "--api-keys-file", str(keys), "--write-stall-timeout-s", "1",
                            "--max-prompts-per-request", str(MAX_PROMPTS))
    yield Front(gateway, port)
    assert gateway.stop() == 0


def _idle(front: Front, engine: Engine) -> None:
    wait_until(lambda: front.metric("pagedserve_gateway_queue_length") == 0, what="every slot released")
    wait_until(lambda: engine.load().num_running == 0, what="nothing left running on the engine")


def test_prompt_lists_are_capped_and_admitted_before_conversion(front: Front, engines: list[Engine]) -> None:
    """Item 2: 200k prompts from a tenant with 2 slots were converted (a proto and a task each) for
    26 s before the 429. Now a list is counted first: beyond the flag a 400, beyond the tenant's
    free slots one 429 and nothing else (no request started, converted or logged besides it)."""
    body = {"model": None, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    over = front.post("/v1/completions", {**body, "prompt": ["a"] * (MAX_PROMPTS + 1)})
    assert over.status_code == 400 and over.json()["error"]["param"] == "prompt"
    assert f"at most {MAX_PROMPTS} prompts" in over.json()["error"]["message"]
    before = front.requests("OpenAI.Completions")
    refused = front.post("/v1/completions", {**body, "prompt": ["a"] * 5}, key=KEY_SMALL)
    assert refused.status_code == 429 and "max_concurrent (2)" in refused.json()["error"]["message"]
    after = front.requests("OpenAI.Completions")
    changed = {status: after[status] - before.get(status, 0) for status in after if after[status] != before.get(status)}
    assert changed == {"RESOURCE_EXHAUSTED": 1}  # one refusal; no prompt of it ever ran
    assert front.metric("pagedserve_gateway_tenant_requests", '{tenant="small"}') == 0
    within = front.post("/v1/completions", {**body, "prompt": ["a", "b"]}, key=KEY_SMALL)
    assert within.status_code == 200 and [c["index"] for c in within.json()["choices"]] == [0, 1]
    _idle(front, engines[0])


def test_unary_http_answers_have_the_grpc_reply_cap(front: Front, engines: list[Engine]) -> None:
    """Item 5: HTTP answered 19.3 MB where gRPC refused the same request. One cap, one measure: a
    reply that cannot fit is refused up front (400), one that outgrows it is ended (429) and its
    request aborted; streamed, the same request is served."""
    body = {"prompt": "x", "temperature": 1.0, "seed": 5, "ignore_eos": True, "logprobs": 20}
    up_front = front.post("/v1/completions", {**body, "n": 4, "max_tokens": 900})
    assert up_front.status_code == 400, up_front.text
    assert up_front.json()["error"]["param"] == "n" and "use stream: true" in up_front.json()["error"]["message"]
    # 600 tokens x at least 114 bytes each (an id, its logprob entry with 20 alternatives) > 64 KiB,
    # though the up-front bound (107 bytes a token: 64,200) lets it start.
    grown = front.post("/v1/completions", {**body, "max_tokens": 600})
    assert grown.status_code == 429, grown.text
    assert f"past the {REPLY_CAP} bytes" in grown.json()["error"]["message"]
    _idle(front, engines[0])
    with httpx.stream("POST", front.url + "/v1/completions", json={**body, "max_tokens": 600, "stream": True},
                      headers={"authorization": f"Bearer {KEY_BIG}"}, timeout=120) as streamed:
        assert streamed.status_code == 200
        events = [line for line in streamed.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert sum(len(json.loads(e[6:])["choices"][0]["logprobs"]["tokens"]) for e in events[:-1]) == 600


def test_prompt_scores_count_as_often_as_the_answer_repeats_them(front: Front, engines: list[Engine]) -> None:
    """A 1,315-token prompt's top-20 scores, counted once, came back in each of 64
    choices, twice with echo: a 200 with a 162.6 MB body. Now each copy counts, and a prompt whose
    copies cannot fit is refused before it is scored."""
    body = {"prompt": "The quick brown fox jumps over the lazy dog. " * 2, "max_tokens": 1, "temperature": 0,
            "echo": True, "logprobs": 20, "prompt_logprobs": 20}
    once = front.post("/v1/completions", body)
    assert once.status_code == 200, once.text
    [choice] = once.json()["choices"]
    assert len(choice["prompt_logprobs"]) > 80  # ~90 tokens, each scored twice in the answer: fits 64 KiB
    many = front.post("/v1/completions", {**body, "n": 4})  # 8 copies of ~90 x 107 bytes at least
    assert many.status_code == 400, many.text
    error = many.json()["error"]
    assert error["param"] == "prompt_logprobs" and "8 time(s) in the answer" in error["message"]
    assert "use stream: true" in error["message"]
    _idle(front, engines[0])


def test_an_sse_stream_whose_client_reads_nothing_is_ended(front: Front, engines: list[Engine]) -> None:
    """Item 4: two never-read streams held their tenant's slots for 55 s and write_stalls stayed 0.
    A client with a small receive buffer reads the headers, then nothing: the stream ends after the
    gateway's write-stall timeout, its requests aborted, its slots freed, the stall counted."""
    stalls = front.metric("pagedserve_gateway_write_stalls_total")
    # ~13 MB of events (16 completions of 1,000 tokens with 20 alternatives each, in waves as the
    # engine's blocks allow), well beyond what the kernel's socket buffers take (up to 4 MiB each way).
    body = json.dumps({"prompt": ["x"] * MAX_PROMPTS, "max_tokens": 1000, "n": 2, "temperature": 1.0, "seed": 7,
                       "ignore_eos": True, "logprobs": 20, "stream": True}).encode()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
    try:
        sock.connect(("127.0.0.1", front.port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEY_BIG.encode() + b"\r\nX-Request-Id: stalled-sse\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert sock.recv(1024).startswith(b"HTTP/1.1 200")
        wait_until(lambda: front.metric("pagedserve_gateway_write_stalls_total") == stalls + 1, timeout_s=60,
                   what="the stalled stream ended")
        wait_until(lambda: front.metric("pagedserve_gateway_tenant_requests", '{tenant="big"}') == 0,
                   what="its slot released")
        wait_until(lambda: engines[0].load().num_running == 0, what="its backend request aborted")
    finally:
        sock.close()
    lines = [json.loads(line) for line in front.gateway.log_file.read_text().splitlines()
             if '"stalled-sse-' in line and '"event": "request"' in line]
    assert [line["status"] for line in lines] == ["DEADLINE_EXCEEDED"] * MAX_PROMPTS
    assert sum(line["completion_tokens"] for line in lines) < MAX_PROMPTS * 2 * 1000
