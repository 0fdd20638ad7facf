"""The core's ports: what ``GatewayCore`` needs from the world outside it, and nothing more.

The core decides (admission, validation, tools, accounting) and the adapters reach things (the
compute services over gRPC, a tokenizer fetched from one of them). Each Protocol here names exactly
what the core and the fronts standing on it call, so the core imports no adapter: the composition
root (``gateway.server``) builds ``gateway.backend``'s implementations and hands them in, and a test
hands in a fake instead (``tests/gateway/fake_backend.py``) to run the core without a process.

``Route`` lives here rather than with the dispatcher because both sides touch it: the backend fills
it and owns how a call is cancelled; the core and the fronts read it and call ``cancel``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from gateway.core.types import BackendRequest, Delta, ModelInfo

if TYPE_CHECKING:
    from pagedserve.tracing import Span


@dataclass
class Route:
    """Where a request runs: the access log reads it, and ``cancel`` ends it from outside.

    grpc.aio cancels a handler task when its client goes away, and that unwinds the generators
    below; but a cancellation that lands while grpc itself is writing a message does not pass
    through them, so the servicer also calls ``cancel`` from the RPC's done callback.
    """

    backend: str = ""
    num_attempts: int = 0
    # Set by the backend while its call runs: cancels that call (a no-op once it has ended).
    canceller: Callable[[], None] | None = None

    def cancel(self) -> None:
        """Cancels the backend call (which aborts the request there) if it is still running."""
        if self.canceller is not None:
            self.canceller()


class Backends(Protocol):
    """The compute services behind the gateway (``gateway.backend.dispatch.Dispatcher``)."""

    def run(self, request: BackendRequest, model_name: str, route: Route,
            timeout_s: float | None, span: Span | None = None) -> AsyncIterator[Delta]:
        """Streams one backend's answer to ``request`` as deltas.

        Args:
            request: validated and tokenized; max_tokens and n resolved, the client's other unset
                fields still unset (the compute service resolves them).
            model_name: only backends serving this model may run it.
            route: filled with the backend used; its ``cancel`` ends the call.
            timeout_s: the client's remaining time (None = no deadline).
            span: the request's trace span, when traces are on.
        Raises:
            ``pagedserve.errors`` types only: the core records their status and the front answers it.
        """
        ...

    def num_backends(self) -> int:
        """Every backend configured, healthy or not."""
        ...

    def num_in_rotation(self, model_name: str) -> int:
        """The healthy backends that serve ``model_name`` now."""
        ...


class Tokenizer(Protocol):
    """The model's tokenizer and chat template (``gateway.backend.tokenizer.ModelTokenizer``).

    The core encodes, decodes and names tokens; the fronts read ``tokens``, ``tokenizer_info`` and
    ``has_chat_template`` through ``GatewayCore.model`` for their tokenizer endpoints.
    """

    info: ModelInfo

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template renders tools and tool calls itself."""
        ...

    @property
    def chat_template_text(self) -> str:
        """The chat template's source ("" without one)."""
        ...

    @property
    def has_chat_template(self) -> bool: ...

    def encode_prompt(self, prompt: str, add_special_tokens: bool = True) -> list[int]: ...

    def encode_chat(self, messages: Sequence[dict[str, Any]], add_special_tokens: bool = False,
                    tools: list[dict] | None = None, add_generation_prompt: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def token_text(self, token_id: int) -> str:
        """One token's text alone (a logprob's or a tool call's name for it)."""
        ...

    def tokens(self, token_ids: Sequence[int]) -> list[str]: ...

    def tokenizer_info(self) -> dict: ...
