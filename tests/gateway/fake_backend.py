"""A fake compute side for ``GatewayCore``: the ``Backends`` port answering from a script, and the
``Tokenizer`` port over UTF-8 bytes, so the core runs in a unit test with no process and no model.

Why a tokenizer of its own: the gateway gets its tokenizer from a backend, so it belongs to the fake
backend; the real one (``gateway.backend.tokenizer.ModelTokenizer``) needs ``transformers``, seconds
to import, and has its own tests (``tests/gateway/test_tokenizer.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.core.ports import Route
from gateway.core.types import BackendRequest, Delta, ModelInfo

if TYPE_CHECKING:
    from pagedserve.tracing import Span

# A script item: the stream waits there until it is closed or cancelled (a backend still generating).
HOLD = "hold"
FAKE_ADDRESS = "fake:1"


@dataclass
class Call:
    """One request a ``FakeBackends`` received."""

    request: BackendRequest
    model_name: str
    timeout_s: float | None


class FakeBackends:
    """The ``Backends`` port: records each request and answers every one with ``script``.

    Args:
        script: the deltas to yield in order; an exception in it is raised there, ``HOLD`` waits.
        num_backends: backends configured.
        num_in_rotation: backends healthy now.
    """

    def __init__(self, script: Sequence[Delta | Exception | str] = (), num_backends: int = 1,
                 num_in_rotation: int = 1) -> None:
        self.script = list(script)
        self.calls: list[Call] = []
        self.num_closed = 0  # streams ended, however (the core must close every one it opened)
        self.num_cancelled = 0  # Route.cancel calls that reached a running call
        self._num_backends = num_backends
        self._num_in_rotation = num_in_rotation

    def num_backends(self) -> int:
        return self._num_backends

    def num_in_rotation(self, model_name: str) -> int:
        return self._num_in_rotation

    async def run(self, request: BackendRequest, model_name: str, route: Route,
                  timeout_s: float | None, span: Span | None = None) -> AsyncIterator[Delta]:
        self.calls.append(Call(request, model_name, timeout_s))
        route.backend, route.num_attempts = FAKE_ADDRESS, 1
        route.canceller = self._cancel
        try:
            for item in self.script:
                if isinstance(item, Exception):
                    raise item
                if item == HOLD:
                    await asyncio.get_running_loop().create_future()  # never set: until cancelled
                yield item
        finally:
            route.canceller = None
            self.num_closed += 1

    def _cancel(self) -> None:
        self.num_cancelled += 1


class ByteTokenizer:
    """The ``Tokenizer`` port over UTF-8 bytes: token id = byte (0-255); a chat renders each message
    as ``role: content\\n`` and the generation prompt as ``assistant: ``."""

    def __init__(self, info: ModelInfo) -> None:
        self.info = info

    renders_tools = False
    chat_template_text = ""
    has_chat_template = True

    def encode_prompt(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return list(prompt.encode())

    def encode_chat(self, messages: Sequence[dict[str, Any]], add_special_tokens: bool = False,
                    tools: list[dict] | None = None, add_generation_prompt: bool = True) -> list[int]:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return list((text + ("assistant: " if add_generation_prompt else "")).encode())

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(token_ids).decode(errors="replace")

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id])

    def tokens(self, token_ids: Sequence[int]) -> list[str]:
        return [self.token_text(t) for t in token_ids]

    def tokenizer_info(self) -> dict:
        return {"tokenizer_class": type(self).__name__}
