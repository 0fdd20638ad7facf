"""Checks on every HTTP request before its route: the ``Host`` it names and the type of its body.

Both close the ways a web page in the user's browser can use a gateway that has no API keys (the
local ``pagedserve up`` kind), which answers anyone who reaches it:

- DNS rebinding: a page on ``evil.example`` gets the name re-pointed to 127.0.0.1, and the browser,
  taking the local server for ``evil.example``, lets the page read its answers. The browser still
  sends ``Host: evil.example``: a keyless gateway answers only ``localhost``, IP addresses (a page
  can be same-origin with an address only by being served from it, so rebinding needs a name) and
  the names ``--http-allowed-hosts`` lists; anything else reads a 421. With keys, the key is the
  defence (the page cannot know it) and any ``Host`` is accepted unless the flag lists names.
- Blind cross-site requests: a page may POST to any address without asking first only with a
  "simple" content type (``text/plain``, forms). A body is accepted only as ``application/json``
  (or ``+json``), which a browser sends cross-site only after a CORS preflight the gateway never
  grants. Requests without a body (GET) need no type.
"""

from __future__ import annotations

import ipaddress
import json

from starlette.types import ASGIApp, Receive, Scope, Send

# Host names of this machine as seen from itself (a port, if any, is not part of the name).
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "[::1]"})
_METHODS_WITH_BODY = frozenset({"POST", "PUT", "PATCH"})
# The part of a hostile Host or Content-Type value an error repeats.
_ECHO_CHARS = 64


def host_name(host: str) -> str:
    """The name part of a ``Host`` value, lower case: ``[::1]:8000`` -> ``[::1]``, ``Foo.:80`` -> ``foo``."""
    host = host.strip().lower()
    if host.startswith("["):  # an IPv6 literal, bracketed, maybe with a port after it
        return host[:host.find("]") + 1] if "]" in host else host
    return host.rpartition(":")[0].rstrip(".") if ":" in host else host.rstrip(".")


def is_json(content_type: str) -> bool:
    media_type = content_type.split(";")[0].strip().lower()
    return media_type == "application/json" or (media_type.startswith("application/") and media_type.endswith("+json"))


class RequestGuard:
    """ASGI middleware: the ``Host`` and ``Content-Type`` rules of the module docstring.

    Args:
        app: the application behind it.
        allowed_hosts: host names answered besides IP addresses (lower case, no port; see
            ``host_name``); None: any.
    """

    def __init__(self, app: ASGIApp, allowed_hosts: frozenset[str] | None) -> None:
        self.app = app
        self.allowed_hosts = allowed_hosts

    def is_allowed(self, name: str) -> bool:
        """Whether a ``Host`` name (``host_name``'s) is answered: listed, or an IP address."""
        if self.allowed_hosts is None or name in self.allowed_hosts:
            return True
        try:
            ipaddress.ip_address(name[1:-1] if name.startswith("[") and name.endswith("]") else name)
        except ValueError:
            return False
        return True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k: v for k, v in scope["headers"] if k in (b"host", b"content-type")}
        host = headers.get(b"host", b"").decode("latin-1")
        if not self.is_allowed(host_name(host)):
            await _refuse(send, 421, f"Host {_echo(host)} is not served here: a gateway without API keys answers "
                                     "localhost and IP addresses only (more with --http-allowed-hosts)",
                          "host_not_allowed")
            return
        content_type = headers.get(b"content-type", b"").decode("latin-1")
        if scope["method"] in _METHODS_WITH_BODY and not is_json(content_type):
            got = _echo(content_type) if content_type else "none"
            await _refuse(send, 415, f"Content-Type must be application/json, got {got}", None)
            return
        await self.app(scope, receive, send)


def _echo(value: str) -> str:
    return repr(value[:_ECHO_CHARS]) + ("..." if len(value) > _ECHO_CHARS else "")


async def _refuse(send: Send, status: int, message: str, code: str | None) -> None:
    """Answers with an OpenAI error object (the shape of ``errors.error_body``) without reading the body."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def allowed_hosts(configured: tuple[str, ...], requires_key: bool) -> frozenset[str] | None:
    """The host names a gateway answers (None: any).

    ``*`` among ``configured``: any. Other names: those and the loopback ones (a rebinding page can
    never make the browser send a loopback name, and this machine's probes use them). None given:
    the loopback names without keys, any with keys. IP addresses are always answered (``is_allowed``).
    """
    if "*" in configured:
        return None
    if configured:
        return LOOPBACK_HOSTS | {host_name(h) for h in configured}
    return None if requires_key else LOOPBACK_HOSTS
