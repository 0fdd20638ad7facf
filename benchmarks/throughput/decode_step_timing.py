"""Decode-step time of the engine at a given batch size, and the part of it spent in the step RPC.

``bench_memory.py --step-batch-sizes`` compares the memory service's step RPC with the decode step
it serves. Per batch size ``B``: ``B`` requests with distinct seeded prompts of ``context_tokens``
tokens are added to an engine on the default model, stepped until every one of them decodes, then
``num_steps`` steps in which all ``B`` decode are timed (wall clock); the engine's own
``MemoryClient.step_with_counts`` calls in those steps are timed too (the RPC as the engine sends
it: its real AppendOps, packing and unpacking included). Most decode steps send none (scheduler.py
rule 7: a decode within its last block waits for the next append), so the RPC time is given per
decode step on average, with how many steps sent one. The requests are then aborted.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

from compute_service import LLM, SamplingParams


@dataclass(frozen=True)
class DecodeStepTiming:
    """Mean figures of the timed decode steps at one batch size.

    Args:
        num_seqs: sequences decoding in each timed step.
        decode_step_ms: wall-clock time of one ``Engine.step``.
        engine_rpc_us: memory-service RPC time a step, measured inside the engine (the RPCs' total
            over the timed steps, whether each sent one or not).
        rpcs_per_step: RPCs the timed steps sent, per step (1.0 before rule 7).
    """

    num_seqs: int
    decode_step_ms: float
    engine_rpc_us: float
    rpcs_per_step: float

    @property
    def engine_rpc_share(self) -> float:
        """The step's RPC over the whole step."""
        return self.engine_rpc_us / (self.decode_step_ms * 1000)


def time_decode_steps(
    batch_sizes: list[int], model: str = "default", context_tokens: int = 64, num_steps: int = 5, seed: int = 0
) -> list[DecodeStepTiming]:
    """Times decode steps of a model at each batch size (see the module docstring).

    Args:
        batch_sizes: sequences per decode step, one measurement each.
        model: "default" or a local model directory (tests use a tiny one).
        context_tokens: prompt length of every request.
        num_steps: decode steps timed per batch size.
        seed: seed of the prompts.

    Returns:
        One timing per batch size, in order.
    """
    largest = max(batch_sizes)
    # Room for every sequence of the largest batch: its prompt, the tokens decoded while the
    # others prefill, and the timed steps (float32 K/V of the default model: ~46 KiB per token).
    max_tokens = num_steps + 2 + -(-largest * context_tokens // 2048)
    num_pool_tokens = 2 * largest * (context_tokens + max_tokens)
    llm = LLM(model=model, max_num_seqs=largest, max_num_batched_tokens=2048, max_num_blocks=-(-num_pool_tokens // 16))
    rng = random.Random(seed)
    timings = []
    try:
        engine = llm.engine
        vocab = llm.model_config.vocab_size
        llm.generate([[rng.randrange(vocab) for _ in range(context_tokens)]], max_tokens=2, ignore_eos=True)  # warm-up
        rpc_s: list[float] = []
        step_with_counts = engine.memory.step_with_counts

        def timed_step_with_counts(ops, prefill_tokens_per_s=0.0):  # the engine's one RPC per step, timed
            started = time.perf_counter()
            reply = step_with_counts(ops, prefill_tokens_per_s)
            rpc_s.append(time.perf_counter() - started)
            return reply

        engine.memory.step_with_counts = timed_step_with_counts
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for num_seqs in batch_sizes:
            request_ids = [f"b{num_seqs}-{i}" for i in range(num_seqs)]
            for request_id in request_ids:
                engine.add_request(request_id, [rng.randrange(vocab) for _ in range(context_tokens)], params)
            while engine.scheduler.waiting or any(not s.output_token_ids for s in engine.scheduler.running):
                engine.step()
            if len(engine.scheduler.running) != num_seqs:
                raise RuntimeError(f"{len(engine.scheduler.running)} sequences decode, expected {num_seqs}")
            step_s = []
            rpc_s.clear()
            for _ in range(num_steps):
                started = time.perf_counter()
                engine.step()
                step_s.append(time.perf_counter() - started)
            timings.append(DecodeStepTiming(num_seqs, statistics.fmean(step_s) * 1000,
                                            sum(rpc_s) / num_steps * 1e6, len(rpc_s) / num_steps))
            for request_id in request_ids:
                engine.abort(request_id)
            while engine.has_unfinished():
                engine.step()
    finally:
        llm.close()
    return timings
