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
        """Compute the scheduled tokens; returns (B, vocab) float32 logits of each last token."""
        batch = ForwardBatch.build(
            new_token_ids=[s.seq.tokens_to_compute(s.num_new_tokens) for s in scheduled],
            num_computed_tokens=[s.seq.num_computed_tokens for s in scheduled],
            block_tables=[s.seq.block_table for s in scheduled],
            block_size=self.block_size,
            device=self.model.device,
        )
        return self.model(batch, self.kv_pool).cpu()  # already float32
