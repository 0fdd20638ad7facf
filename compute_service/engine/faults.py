"""Test-only fault injection: one request's detokenization fails, inside a real service process.

Why it exists: a failure tied to one request (its sampling, detokenizing, stop checks) must end that
request alone, and the tests prove it on a real compute service, where nothing can be patched from
outside. With ``PAGEDSERVE_TEST_FAULT_DETOKENIZE`` set to a JSON object such as
``{"prompt_suffix": [70, 65, 85, 76, 84], "after_tokens": 2}``, every request whose prompt ends with
those token ids gets a detokenizer that raises once it is handed more than ``after_tokens`` tokens
(0: at the first one, before anything streamed). Read when an Engine is built, never at import;
unset (always, outside tests) nothing changes and no request pays for it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from compute_service.engine.detokenizer import IncrementalDetokenizer, StopMatch

FAULT_ENV = "PAGEDSERVE_TEST_FAULT_DETOKENIZE"


class InjectedFault(RuntimeError):
    """The failure the hook injects (a bug as far as the engine can tell)."""


class _FailingDetokenizer(IncrementalDetokenizer):
    def __init__(self, tokenizer: Any | None, stop: Sequence[str], after_tokens: int) -> None:
        super().__init__(tokenizer, stop)
        self._after_tokens = after_tokens

    def add_tokens(self, token_ids: Sequence[int], *, check_stop: bool = True) -> StopMatch | None:
        if len(self.token_ids) + len(token_ids) > self._after_tokens:
            raise InjectedFault(f"injected detokenizer failure ({FAULT_ENV})")
        return super().add_tokens(token_ids, check_stop=check_stop)


@dataclass(frozen=True)
class DetokenizeFault:
    """Which requests fail (prompt ends with ``prompt_suffix``) and after how many tokens."""

    prompt_suffix: tuple[int, ...]
    after_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.prompt_suffix or self.after_tokens < 0:
            raise ValueError(f"{FAULT_ENV}: prompt_suffix must be non-empty and after_tokens >= 0")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> DetokenizeFault | None:
        text = environ.get(FAULT_ENV)
        if not text:
            return None
        spec = json.loads(text)
        return cls(tuple(int(t) for t in spec["prompt_suffix"]), int(spec.get("after_tokens", 0)))

    def detokenizer_for(self, prompt_token_ids: Sequence[int], tokenizer: Any | None,
                        stop: Sequence[str]) -> IncrementalDetokenizer | None:
        """A failing detokenizer for a matching prompt; None (the normal one) otherwise."""
        n = len(self.prompt_suffix)
        if tuple(prompt_token_ids[-n:]) != self.prompt_suffix:
            return None
        return _FailingDetokenizer(tokenizer, stop, self.after_tokens)
