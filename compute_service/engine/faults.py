"""Test-only fault injection: one request's detokenization fails.

Why it exists: a failure tied to one request (its sampling, detokenizing, stop checks) must end that
request alone, and the tests prove it in process and on a real compute service, where nothing can
be patched from outside. A ``DetokenizeFault`` given to the ``Engine`` (``detokenize_fault=``; the
compute service's ``__main__`` builds it from the test hooks, pagedserve/test_hooks.py) makes every
request whose prompt ends with one entry's token ids get a detokenizer that raises once it is handed
more than that entry's ``after_tokens`` tokens (0: at the first one, before anything streamed).
Without one (always, outside tests) nothing changes and no request pays for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from compute_service.engine.detokenizer import IncrementalDetokenizer, StopMatch

class InjectedFault(RuntimeError):
    """The failure the hook injects (a bug as far as the engine can tell)."""


class _FailingDetokenizer(IncrementalDetokenizer):
    def __init__(self, tokenizer: Any | None, stop: Sequence[str], after_tokens: int) -> None:
        super().__init__(tokenizer, stop)
        self._after_tokens = after_tokens

    def add_tokens(self, token_ids: Sequence[int], *, check_stop: bool = True) -> StopMatch | None:
        if len(self.token_ids) + len(token_ids) > self._after_tokens:
            raise InjectedFault("injected detokenizer failure (test hook detokenize_fault)")
        return super().add_tokens(token_ids, check_stop=check_stop)


@dataclass(frozen=True)
class DetokenizeFault:
    """Which requests fail (prompt ends with a suffix) and after how many tokens (by suffix)."""

    after_tokens_by_suffix: dict[tuple[int, ...], int]

    @classmethod
    def from_entries(cls, entries: Sequence[dict[str, Any]]) -> DetokenizeFault | None:
        """From the test hook's list (``[{"prompt_suffix": [...], "after_tokens": N}, ...]``); None when empty.

        Raises:
            ValueError: an empty suffix or a negative ``after_tokens``.
        """
        if not entries:
            return None
        faults = {tuple(int(t) for t in f["prompt_suffix"]): int(f.get("after_tokens", 0)) for f in entries}
        if not all(faults) or min(faults.values()) < 0:
            raise ValueError("detokenize_fault: each prompt_suffix must be non-empty and after_tokens >= 0")
        return cls(faults)

    def detokenizer_for(self, prompt_token_ids: Sequence[int], tokenizer: Any | None,
                        stop: Sequence[str]) -> IncrementalDetokenizer | None:
        """A failing detokenizer for a matching prompt; None (the normal one) otherwise."""
        for suffix, after_tokens in self.after_tokens_by_suffix.items():
            if tuple(prompt_token_ids[-len(suffix):]) == suffix:
                return _FailingDetokenizer(tokenizer, stop, after_tokens)
        return None
