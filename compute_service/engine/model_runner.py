"""Tensors for one step: pack the scheduled sequences, run the model over the shared KV pool."""

from __future__ import annotations

import torch

from compute_service.model.forward_batch import ForwardBatch
from compute_service.model.model import CausalLM
from compute_service.engine.scheduler import ScheduledSeq
from kernels import cpu_ops


class ModelRunner:
    """Runs ``model`` on packed variable-length batches whose K/V lives in ``kv_pool``.

    Args:
        model: our Llama-family model.
        kv_pool: (num_layers, 2, num_blocks, block_size, H_kv, D), the memory service's pool mapped
            into this process; the runner never allocates KV memory of its own.
        block_size: tokens per block.
    """

    def __init__(self, model: CausalLM, kv_pool: torch.Tensor, block_size: int) -> None:
        model.check_kv_pool(kv_pool)
        if kv_pool.device.type == "cpu":
            # Build (first run on a machine, ~1 min) or load the fused CPU kernels now, while the
            # service is still starting, rather than inside the first request's step.
            cpu_ops.load()
        self.model = model
        self.kv_pool = kv_pool
        self.block_size = block_size

    def run(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        """Compute the scheduled tokens (and speculative drafts after them).

        Returns:
            (B + D, vocab) float32 logits: row b after sequence b's last scheduled token, then one
            row after each of the D drafts, sequence after sequence, in order.
        """
        batch = ForwardBatch.build(
            new_token_ids=[s.seq.tokens_to_compute(s.num_new_tokens) + s.draft_token_ids for s in scheduled],
            num_computed_tokens=[s.seq.num_computed_tokens for s in scheduled],
            block_tables=[s.seq.block_table for s in scheduled],
            block_size=self.block_size,
            device=self.model.device,
        )
        logits_rows = None
        if any(s.draft_token_ids for s in scheduled):
            ends = batch.cu_seqlens_q[1:].tolist()
            last = [end - 1 - len(s.draft_token_ids) for s, end in zip(scheduled, ends)]
            drafts = [row for s, first in zip(scheduled, last)
                      for row in range(first + 1, first + 1 + len(s.draft_token_ids))]
            logits_rows = torch.tensor(last + drafts, dtype=torch.int64, device=self.model.device)
        return self.model(batch, self.kv_pool, logits_rows).cpu()  # already float32
