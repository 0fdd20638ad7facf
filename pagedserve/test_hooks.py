"""Test hooks: the one entry through which process tests reach inside a running service.

Some behaviour can only be proven on a real service process, where nothing can be patched from
outside: a request whose own detokenization fails must end alone (compute service), calls must be
answered while a big pool is created (memory service). Those tests set ``PAGEDSERVE_TEST_HOOKS`` to a
JSON object in the service's environment; each service's ``__main__`` reads it once, at start, and
hands what it found to the code that acts on it as an ordinary argument. Nothing else reads it:
never the engine, the block manager or the servicers, never at import. Unset (always, outside
tests) no hook exists and nobody pays for one. In-process tests pass the same arguments directly.

Keys (any subset):

- ``detokenize_fault``: compute service; a list such as ``[{"prompt_suffix": [70, 65], "after_tokens":
  2}]``: a request whose prompt ends with an entry's ids gets a detokenizer that raises once it is
  handed more than ``after_tokens`` tokens (compute_service/engine/faults.py).
- ``pool_creation_delay_s``: memory service; seconds the pool's creation takes at least once its
  segment exists, as if allocating and mapping it took that long (memory_service/service/servicer.py).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

TEST_HOOKS_ENV = "PAGEDSERVE_TEST_HOOKS"


@dataclass(frozen=True)
class ServiceHooks:
    """The hooks a test asked for (see the module docstring); the default is none."""

    detokenize_fault: list[dict[str, Any]] = field(default_factory=list)
    pool_creation_delay_s: float = 0.0

    def __post_init__(self) -> None:
        if type(self.detokenize_fault) is not list:
            raise ValueError(f"{TEST_HOOKS_ENV}: detokenize_fault must be a list, got {self.detokenize_fault!r}")
        if not (isinstance(self.pool_creation_delay_s, int | float) and math.isfinite(self.pool_creation_delay_s)
                and self.pool_creation_delay_s >= 0):
            raise ValueError(f"{TEST_HOOKS_ENV}: pool_creation_delay_s must be a number >= 0, "
                             f"got {self.pool_creation_delay_s!r}")


def read_test_hooks(environ: Mapping[str, str] = os.environ) -> ServiceHooks:
    """The hooks in ``PAGEDSERVE_TEST_HOOKS`` (none when unset); a service's ``__main__`` calls this once.

    Raises:
        ValueError: not a JSON object, an unknown key, or a bad value (named).
    """
    text = environ.get(TEST_HOOKS_ENV)
    if not text:
        return ServiceHooks()
    try:
        values = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{TEST_HOOKS_ENV} is not JSON: {exc}") from None
    if not isinstance(values, dict):
        raise ValueError(f"{TEST_HOOKS_ENV} must be a JSON object, got {text!r}")
    known = set(ServiceHooks.__dataclass_fields__)
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{TEST_HOOKS_ENV}: unknown key(s) {unknown}; known: {sorted(known)}")
    return ServiceHooks(**values)


def encode_test_hooks(**hooks: Any) -> str:
    """The value of ``PAGEDSERVE_TEST_HOOKS`` that asks a service for ``hooks`` (tests that start one)."""
    return json.dumps(hooks)
