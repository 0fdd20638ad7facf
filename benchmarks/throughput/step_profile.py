"""``bench_throughput.py --profile``: where the time of one decode step and one prefill step goes.

The model labels its parts (`compute_service.model.layers.profile_scope`) while a profiler
records, so each part of the model's forward is a named `torch.profiler` range (qkv_proj, rotary,
attention, o_proj, norm, mlp_gate_up, silu_mul, mlp_down, lm_head); "other" is the rest of
``Engine.step`` (scheduling, the memory-service RPC, packing the batch, sampling). Times are
inclusive CPU milliseconds of each range, summed over the profiled steps and divided by their number.

- prefill: fresh prompts of the workload, in order, filling one step's token budget;
- decode: as many of the workload's requests as fit in 80% of the pool (at most ``--profile-seqs``)
  are prefilled first, then ``--profile-steps`` steps in which every one of them decodes are timed,
  each sampled as the workload asks (the realistic workload: temperature 0.8, top_p 0.95, so the
  sampler's cost is in "other"; the random one greedy, with the engine's drafts).
"""

from __future__ import annotations

import argparse
import time

import torch

from compute_service import LLM, SamplingParams

from benchmarks.throughput.workload import Request, warmup_prompt

COMPONENTS = ("qkv_proj", "rotary", "attention", "o_proj", "norm", "mlp_gate_up", "silu_mul", "mlp_down", "lm_head")


def _profile(engine, num_steps: int) -> dict:
    wall = 0.0
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(num_steps):
            started = time.perf_counter()
            engine.step()
            wall += time.perf_counter() - started
    totals = {event.key: event.cpu_time_total / 1000 for event in prof.key_averages() if event.key in COMPONENTS}
    step_ms = wall * 1000 / num_steps
    parts = {name: round(totals.get(name, 0.0) / num_steps, 2) for name in COMPONENTS}
    parts["other"] = round(max(0.0, step_ms - sum(parts.values())), 2)
    return {"step_ms": round(step_ms, 2), "ms": parts,
            "share": {name: round(ms / step_ms, 3) for name, ms in parts.items()}}


def profile_steps(model: str, workload: list[Request], args: argparse.Namespace, **engine_config) -> dict:
    """One prefill step and ``args.profile_steps`` decode steps of the engine, by component
    (``engine_config``: more EngineConfig fields, as the throughput run gets them)."""
    llm = LLM(model=model, kv_cache_bytes=args.kv_cache_bytes, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
              device=args.device, dtype=args.dtype, **engine_config)
    try:
        engine = llm.engine
        llm.generate([warmup_prompt(workload)], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        # Prefill: prompts (one token out, so they finish) until the step's token budget is full.
        budget, num_prefill_tokens = args.max_num_batched_tokens, 0
        for i, req in enumerate(workload):
            if num_prefill_tokens >= budget:
                break
            engine.add_request(f"prefill-{i}", req.prompt_token_ids, SamplingParams(max_tokens=1, temperature=0.0))
            num_prefill_tokens += len(req.prompt_token_ids)
        prefill = _profile(engine, 1) | {"tokens": min(num_prefill_tokens, budget)}
        while engine.has_unfinished():
            engine.step()
        # Decode: fill 80% of the pool, prefill everything, then time steps where all decode.
        pool_tokens = engine.memory.num_blocks * engine.memory.block_size
        num_decode_steps = args.profile_steps
        seqs, used = 0, 0
        # Sequences prefilled early decode while later ones prefill: room for 32 tokens of that.
        max_tokens = num_decode_steps + 32
        for i, req in enumerate(workload):
            need = len(req.prompt_token_ids) + max_tokens
            if seqs >= args.profile_seqs or used + need > 0.8 * pool_tokens:
                break
            params = SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                                    ignore_eos=True)
            engine.add_request(f"decode-{i}", req.prompt_token_ids, params)
            seqs, used = seqs + 1, used + need
        while engine.scheduler.waiting or any(not s.output_token_ids for s in engine.scheduler.running):
            engine.step()
        context = sum(s.num_tokens for s in engine.scheduler.running) / max(1, len(engine.scheduler.running))
        decode = _profile(engine, num_decode_steps) | {"seqs": len(engine.scheduler.running),
                                                       "mean_context": round(context)}
        return {"decode": decode, "prefill": prefill}
    finally:
        llm.close()


def print_profile(profile: dict) -> None:
    """A table of both steps' components (ms and share)."""
    decode, prefill = profile["decode"], profile["prefill"]
    print(f"\nper-step profile: decode of {decode['seqs']} sequences (mean context {decode['mean_context']}), "
          f"prefill of {prefill['tokens']} prompt tokens")
    print(f"{'component':<14}{'decode ms':>12}{'share':>8}{'prefill ms':>13}{'share':>8}")
    for name in (*COMPONENTS, "other"):
        print(f"{name:<14}{decode['ms'][name]:>12.2f}{decode['share'][name]:>8.1%}"
              f"{prefill['ms'][name]:>13.2f}{prefill['share'][name]:>8.1%}")
    print(f"{'step':<14}{decode['step_ms']:>12.2f}{'':>8}{prefill['step_ms']:>13.2f}")
