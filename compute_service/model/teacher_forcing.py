"""Teacher forcing: a model's logits after every position of a token sequence, outside the engine (a
scratch KV pool of its own): for the int8-activation check at load (activation_check.py), agreement
checks (tests/e2e/test_gguf_real.py) and the accuracy benchmark (benchmarks/throughput/quant_agreement.py)."""

from __future__ import annotations

import torch

from compute_service.model.forward_batch import ForwardBatch

BLOCK_SIZE = 16


def window_logits(model, ids: list[int], step: int = 0) -> torch.Tensor:
    """Logits after every position of `ids`: (T, vocab) float32, from one prefill, or with `step` from
    consecutive steps of `step` tokens over the same pool (each linear then multiplies `step` rows, as a
    decode batch of that many sequences does)."""
    num_blocks = -(-len(ids) // BLOCK_SIZE)
    pool = torch.zeros(model.config.kv_pool_shape(num_blocks, BLOCK_SIZE), dtype=model.dtype)
    step = step or len(ids)
    logits = []
    with torch.inference_mode():
        for start in range(0, len(ids), step):
            chunk = ids[start:start + step]
            batch = ForwardBatch.build([chunk], [start], [list(range(num_blocks))], BLOCK_SIZE, device=model.device)
            logits.append(model(batch, pool, logits_rows=torch.arange(len(chunk))).float())
    return torch.cat(logits)
