"""One step's token masks for the constrained sequences of a batch.

Per step, each constrained sequence gets one bitmask row (bit j = token j allowed), all rows filled
by one batched xgrammar call (no Python call per sequence), then applied to a copy of the logits:
the raw logits stay untouched when a sequence asks for logprobs (the log-softmax of the model's
raw logits), else the rows (already the engine's own copy) are masked in place. A batch without a
constrained sequence skips all of it. Rows of unconstrained sequences are neither
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
        # seconds, and the calling thread's CPU seconds (neither other processes nor torch's spinning OpenMP
        # workers inflate them; xgrammar fills the rows in this thread with max_threads=1).
        self.num_masked_steps = 0
        self._copy: torch.Tensor | None = None  # (rows, V) buffer of masked copies, grown on demand
        self.seconds = 0.0
        self.cpu_seconds = 0.0

    def apply(self, logits: torch.Tensor, matchers: Sequence[xgr.GrammarMatcher | None], *,
              keep_raw: bool = True) -> torch.Tensor:
        """Logits with each constrained row's disallowed tokens at -inf.

        Args:
            logits: (B, V) raw logits, one row per entry of ``matchers``.
            matchers: each row's matcher, None for an unconstrained row.
            keep_raw: leave ``logits`` untouched (the caller still needs them: logprobs) and mask a
                copy in a buffer kept across steps; False masks ``logits`` in place.
        Returns:
            ``logits`` itself when no row is constrained or ``keep_raw`` is False, else the masked
            copy (B, V), valid until the next call.
        """
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return logits
        start, start_cpu = time.perf_counter(), time.thread_time()
        num_rows = len(matchers)
        if self._bitmask.shape[0] < num_rows:
            self._bitmask = xgr.allocate_token_bitmask(max(num_rows, 2 * self._bitmask.shape[0]), self.vocab_size)
        bitmask = self._bitmask[:num_rows]
        self._batch.batch_fill_next_token_bitmask([matchers[i] for i in rows], bitmask, indices=rows)
        masked = logits
        if keep_raw:
            # A buffer reused across steps: a fresh (32, 49152) float32 copy per step costs more in
            # page faults than filling and applying the masks (docs/benchmarks.md, structured outputs).
            if self._copy is None or self._copy.shape[0] < num_rows or self._copy.shape[1:] != logits.shape[1:] \
                    or self._copy.dtype != logits.dtype or self._copy.device != logits.device:
                self._copy = torch.empty((max(num_rows, 8), *logits.shape[1:]), dtype=logits.dtype,
                                         device=logits.device)
            masked = self._copy[:num_rows]
            masked.copy_(logits)
        xgr.apply_token_bitmask_inplace(masked, bitmask.to(masked.device, non_blocking=True),
                                        vocab_size=self.vocab_size, indices=rows)
        self.num_masked_steps += 1
        self.seconds += time.perf_counter() - start
        self.cpu_seconds += time.thread_time() - start_cpu
        return masked
