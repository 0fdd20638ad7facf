"""The HTTP front's Host and Content-Type rules, in process: a keyless gateway
answers loopback Host names only (unless told more), and a body must be JSON."""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from gateway.openai_api.guard import LOOPBACK_HOSTS, RequestGuard, allowed_hosts, host_name


async def _ok(request: Request) -> JSONResponse:
    return JSONResponse({"size": len(await request.body())})


APP = Starlette(routes=[Route("/health", _ok, methods=["GET"]), Route("/v1/completions", _ok, methods=["POST"])])


def _client(allowed: frozenset[str] | None) -> TestClient:
    return TestClient(RequestGuard(APP, allowed), base_url="http://localhost:8000")


def test_host_names() -> None:
    assert [host_name(h) for h in ("localhost:8000", "LOCALHOST", "127.0.0.1:1", "[::1]:8000", "[::1]", "a.b.",
                                   "a.b.:80", "")] == ["localhost", "localhost", "127.0.0.1", "[::1]", "[::1]",
                                                       "a.b", "a.b", ""]
    assert allowed_hosts((), requires_key=False) == LOOPBACK_HOSTS
    assert allowed_hosts((), requires_key=True) is None
    assert allowed_hosts(("Gw.Example:443",), requires_key=True) == LOOPBACK_HOSTS | {"gw.example"}
    assert allowed_hosts(("x", "*"), requires_key=False) is None


@pytest.mark.parametrize("host", ["localhost:8000", "127.0.0.1:8000", "[::1]:8000", "localhost", "127.0.0.2",
                                  "192.168.1.5:8000", "[fe80::1]:80"])
def test_loopback_names_and_addresses_are_answered(host: str) -> None:
    """A rebinding page needs a name of its own; an address is same-origin only with itself."""
    client = _client(LOOPBACK_HOSTS)
    assert client.get("/health", headers={"host": host}).status_code == 200
    assert client.post("/v1/completions", json={"prompt": "a"}, headers={"host": host}).status_code == 200


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "localhost.evil.example", "127.0.0.1.nip.io",
                                  "[evil]", "1.2.3.4.5", ""])
def test_other_hosts_are_421_with_an_openai_error(host: str) -> None:
    reply = _client(LOOPBACK_HOSTS).post("/v1/completions", json={"prompt": "a"}, headers={"host": host})
    assert reply.status_code == 421
    assert reply.json()["error"]["code"] == "host_not_allowed"
    assert reply.json()["error"]["type"] == "invalid_request_error"
    assert _client(None).post("/v1/completions", json={"prompt": "a"}, headers={"host": host}).status_code == 200


def test_a_long_host_is_echoed_short() -> None:
    reply = _client(LOOPBACK_HOSTS).get("/health", headers={"host": "h" * 5000})
    assert reply.status_code == 421 and len(reply.content) < 400


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x"])
def test_a_body_must_be_json(content_type: str | None) -> None:
    headers = {"content-type": content_type} if content_type else {}
    reply = _client(None).post("/v1/completions", content=b'{"prompt": "a"}', headers=headers)
    assert reply.status_code == 415 and reply.json()["error"]["message"].startswith("Content-Type must be")


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "application/vnd.api+json"])
def test_json_bodies_pass_and_gets_need_no_type(content_type: str) -> None:
    client = _client(None)
    assert client.post("/v1/completions", content=b"{}", headers={"content-type": content_type}).status_code == 200
    assert client.get("/health").status_code == 200  # no body, no Content-Type
