"""One step's token masks for the constrained sequences of a batch.

Per step, each constrained sequence gets one bitmask row (bit j = token j allowed), all rows filled
by one batched xgrammar call (no Python call per sequence), then applied to a copy of the logits:
the raw logits stay untouched because logprobs are the log-softmax of the model's raw logits. A
batch without a constrained sequence skips all of it. Rows of unconstrained sequences are neither
filled nor applied (``indices``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import xgrammar as xgr


class LogitsMasker:
    """Reusable bitmask buffer and batch matcher of one engine (engine thread only).

    Args:
        vocab_size: width of the logits (the model's vocabulary).
        num_threads: threads xgrammar may use to fill a batch's rows.
    """

    def __init__(self, vocab_size: int, num_threads: int = 1) -> None:
        self.vocab_size = vocab_size
        self._batch = xgr.BatchGrammarMatcher(max_threads=num_threads)
        self._bitmask = xgr.allocate_token_bitmask(8, vocab_size)  # (rows, ceil(V / 32)) int32, grown on demand
        # What masking has cost so far (benchmarks read them): steps with a constrained row, wall
        # seconds, and this process's CPU seconds (which other processes on the machine do not inflate).
        self.num_masked_steps = 0
        self.seconds = 0.0
        self.cpu_seconds = 0.0

    def apply(self, logits: torch.Tensor, matchers: Sequence[xgr.GrammarMatcher | None]) -> torch.Tensor:
        """Logits with each constrained row's disallowed tokens at -inf.

        Args:
            logits: (B, V) raw logits, one row per entry of ``matchers``.
            matchers: each row's matcher, None for an unconstrained row.
        Returns:
            ``logits`` itself when no row is constrained, else a masked copy (B, V).
        """
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return logits
        start, start_cpu = time.perf_counter(), time.process_time()
        if self._bitmask.shape[0] < len(matchers):
            self._bitmask = xgr.allocate_token_bitmask(max(len(matchers), 2 * self._bitmask.shape[0]), self.vocab_size)
        bitmask = self._bitmask[: len(matchers)]
        self._batch.batch_fill_next_token_bitmask([matchers[i] for i in rows], bitmask, indices=rows)
        masked = logits.clone()
        xgr.apply_token_bitmask_inplace(masked, bitmask.to(masked.device, non_blocking=True),
                                        vocab_size=self.vocab_size, indices=rows)
        self.num_masked_steps += 1
        self.seconds += time.perf_counter() - start
        self.cpu_seconds += time.process_time() - start_cpu
        return masked
