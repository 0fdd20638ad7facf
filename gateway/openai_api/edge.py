"""What an endpoint module of the HTTP front asks of the front (``app.OpenAIFront``): the core, who the
key says the client is, the body read under the front's limits, and the served model's name. A
Protocol, so the endpoint modules (``responses_api``, ``embeddings_api``) need not import the app
that imports them."""

from __future__ import annotations

from typing import Any, Protocol

from pydantic import BaseModel
from starlette.requests import Request

from gateway.core.service import GatewayCore
from gateway.tenants import Tenant


class Front(Protocol):
    core: GatewayCore

    def tenant_of(self, request: Request) -> Tenant:
        """The tenant the request's key names (HttpError 401 without one)."""

    def served_model(self, name: str | None) -> str:
        """The served model's name; HttpError 404 naming ``model`` when ``name`` is another."""

    async def read_body(self, request: Request, schema: type[BaseModel]) -> Any:
        """The body parsed as ``schema``, read up to the gateway's ``max_message_bytes``."""
