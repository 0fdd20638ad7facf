"""Tensors for one step: pack the scheduled sequences, run the model over the shared KV pool."""

from __future__ import annotations

from typing import NamedTuple

import torch

from compute_service.model.forward_batch import ForwardBatch
from compute_service.model.model import CausalLM
from compute_service.engine.sampler import TokenLogprobs, prompt_token_logprobs
from compute_service.engine.scheduler import ScheduledSeq
from pagedserve_kernels import cpu_ops

# Prompt positions scored per LM-head call: (rows, vocab) float32 logits and their log-softmax at
# once (256 x 49152 x 4 bytes = 48 MiB each for the default model), whatever the chunk's length.
PROMPT_LOGPROBS_ROWS = 256


class StepLogits(NamedTuple):
    """What one step's model run gives the engine.

    Attributes:
        logits: (B + D, vocab) float32: row b after scheduled sequence b's last token, then one row
            after each of the D drafts, sequence after sequence, in order.
        prompt_logprobs: by scheduled index, the prompt tokens this step scored
            (``Sequence.prompt_logprob_targets``), in order; only sequences that asked for them.
        pooled: by scheduled index, the (hidden,) float32 sum of the final normed hidden states at
            the positions ``Sequence.pooling_targets`` names, and that range; only embedding requests.
    """

    logits: torch.Tensor
    prompt_logprobs: dict[int, list[TokenLogprobs]]
    pooled: dict[int, tuple[torch.Tensor, range]]


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

    def run(self, scheduled: list[ScheduledSeq]) -> StepLogits:
        """Compute the scheduled tokens (and speculative drafts after them), and score the prompt
        tokens of the sequences that asked for prompt logprobs."""
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
        # Per scoring sequence: its scheduled index, the prompt tokens it scores, and the first of
        # its rows in the hidden states returned (token t is scored at position t - 1).
        targets = [(i, s.seq.prompt_logprob_targets(s.num_new_tokens)) for i, s in enumerate(scheduled)]
        targets = [(i, t) for i, t in targets if t]
        # Per embedding request: its scheduled index and the prompt positions it pools this step.
        pools = [(i, s.seq.pooling_targets(s.num_new_tokens)) for i, s in enumerate(scheduled)]
        pools = [(i, t) for i, t in pools if t]
        if not targets and not pools:
            return StepLogits(self.model(batch, self.kv_pool, logits_rows).cpu(), {}, {})  # already float32
        starts = batch.cu_seqlens_q[:-1].tolist()
        rows = [starts[i] + (t.start - 1 - scheduled[i].seq.num_computed_tokens) for i, t in targets]
        rows += [starts[i] + (t.start - scheduled[i].seq.num_computed_tokens) for i, t in pools]
        hidden_rows = torch.cat([torch.arange(first, first + len(t)) for first, (_, t) in zip(rows, targets + pools)])
        logits, hidden = self.model(batch, self.kv_pool, logits_rows, hidden_rows.to(self.model.device))
        num_scored = sum(len(t) for _, t in targets)
        return StepLogits(logits.cpu(), self._score_prompts(scheduled, targets, hidden[:num_scored]),
                          self._pool(pools, hidden[num_scored:]))

    @staticmethod
    def _pool(pools: list[tuple[int, range]], hidden: torch.Tensor) -> dict[int, tuple[torch.Tensor, range]]:
        """Each embedding request's rows of ``hidden`` (P, hidden), summed in float32."""
        out, first = {}, 0
        for i, target in pools:
            out[i] = (hidden[first : first + len(target)].float().sum(dim=0).cpu(), target)
            first += len(target)
        return out

    @torch.inference_mode()
    def _score_prompts(self, scheduled: list[ScheduledSeq], targets: list[tuple[int, range]],
                       hidden: torch.Tensor) -> dict[int, list[TokenLogprobs]]:
        """The prompt tokens' logprobs from the (P, hidden) states at their positions, the LM head
        run ``PROMPT_LOGPROBS_ROWS`` rows at a time."""
        out: dict[int, list[TokenLogprobs]] = {}
        first = 0
        for i, target in targets:
            seq = scheduled[i].seq
            token_ids = seq.prompt_token_ids[target.start : target.stop]
            scored: list[TokenLogprobs] = []
            for start in range(0, len(token_ids), PROMPT_LOGPROBS_ROWS):
                end = min(start + PROMPT_LOGPROBS_ROWS, len(token_ids))
                logits = self.model.compute_logits(hidden[first + start : first + end]).cpu()
                scored += prompt_token_logprobs(logits, token_ids[start:end], seq.params.prompt_logprobs or 0)
            out[i] = scored
            first += len(token_ids)
        return out
