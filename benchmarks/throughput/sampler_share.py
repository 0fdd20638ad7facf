"""The sampler's share of a decode step at 1, 8 and 32 sequences (realistic sampling: T 0.8, top_p 0.95).

Runs the default model's engine on the realistic workload's prompts (throughput/realistic.py) and,
over ``--steps`` decode steps per batch size, times the model's forward (`ModelRunner.run`) and the
sampler (`sampler.sample`), and on the same logits the per-row sorted reference every earlier version
ran (`sampler._sample_row`, whose tokens are not used). Prints one JSON line per batch size: median
milliseconds of the forward, of the sampler, of the sorted reference, and the sampler's share of the
step (forward + sampler) before and after. Seeds: none (``--seeded`` draws through torch.multinomial
over the whole vocabulary, as a seeded request does).

    python -m benchmarks.throughput.sampler_share [--dtype bfloat16] [--sizes 1 8 32] [--steps 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from benchmarks.throughput.realistic import TEMPERATURE, TOP_P, make_realistic_workload
from compute_service import LLM, SamplingParams
from compute_service.engine import sampler
from compute_service.engine import token_chooser as chooser_module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seeded", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM("default", dtype=args.dtype, max_num_seqs=max(args.sizes), kv_cache_bytes=256 << 20)
    engine = llm.engine
    timings: dict[str, list[float]] = {"forward": [], "sample": [], "sorted": []}
    run, sample = engine.runner.run, chooser_module.sample

    def timed_run(scheduled):
        started = time.perf_counter()
        out = run(scheduled)
        timings["forward"].append(time.perf_counter() - started)
        return out

    def timed_sample(logits, seqs, eos):
        started = time.perf_counter()
        tokens = sample(logits, seqs, eos)
        timings["sample"].append(time.perf_counter() - started)
        started = time.perf_counter()
        for row, seq in zip(logits, seqs):
            sampler._sample_row(row.clone(), seq)
        timings["sorted"].append(time.perf_counter() - started)
        return tokens

    engine.runner.run, chooser_module.sample = timed_run, timed_sample
    workload = make_realistic_workload(llm.tokenizer, max(args.sizes), seed=0)
    try:
        for size in args.sizes:
            for i, req in enumerate(workload[:size]):
                params = SamplingParams(max_tokens=args.steps + 2, temperature=TEMPERATURE, top_p=TOP_P,
                                        ignore_eos=True, seed=i if args.seeded else None)
                engine.add_request(f"{size}-{i}", req.prompt_token_ids, params)
            while any(r.num_output_tokens == 0 for r in engine.scheduler.running) or engine.scheduler.waiting:
                engine.step()  # prefills
            for values in timings.values():
                values.clear()
            while engine.has_unfinished():
                engine.step()
            ms = {k: statistics.median(v) * 1e3 for k, v in timings.items() if v}
            print(json.dumps({"seqs": size, "dtype": str(engine.runner.model.dtype), "steps": len(timings["sample"]),
                              "forward_ms": round(ms["forward"], 2), "sample_ms": round(ms["sample"], 2),
                              "sorted_reference_ms": round(ms["sorted"], 2),
                              "share_before": round(ms["sorted"] / (ms["forward"] + ms["sorted"]), 3),
                              "share_after": round(ms["sample"] / (ms["forward"] + ms["sample"]), 3),
                              "seeded": args.seeded}), flush=True)
    finally:
        llm.close()


if __name__ == "__main__":
    main()
