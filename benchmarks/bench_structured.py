"""Per-step cost of structured outputs: the token masks of 1, 8 and 32 constrained sequences
against an unconstrained decode step of the same batch.

    python -m benchmarks.bench_structured [--model default] [--batch-sizes 1,8,32] [--steps 16]

For each batch size B the same B prompts decode twice through the in-process engine: once free
(``ignore_eos``), once under a JSON schema whose output cannot end within ``--steps`` tokens (an
array of strings), so every timed step holds B constrained sequences. Only steps where all B
sequences decode are timed. ``mask_ms`` is the engine's own count of the time spent filling the
B bitmask rows (one batched xgrammar call) and applying them to a copy of the logits
(``LogitsMasker``); the constrained step also pays one ``accept_token`` per sequence. Prints a
table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from benchmarks.cpu_info import cpu_name
from compute_service import LLM, Constraint, SamplingParams

SCHEMA = {"type": "object", "required": ["notes"],
          "properties": {"notes": {"type": "array", "items": {"type": "string"}, "minItems": 64}}}
PROMPT = "Write a JSON object with a list of notes about the sea: "


def _decode_steps(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[tuple[float, float]]:
    """(wall, process CPU) seconds of each step in which every one of the prompts' sequences decoded."""
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"bench-{i}", prompt, params)
    times = []
    while engine.has_unfinished():
        full = len(engine.scheduler.running) == len(prompts) and all(
            s.num_output_tokens >= 1 for s in engine.scheduler.running)
        start, start_cpu = time.perf_counter(), time.process_time()
        engine.step()
        if full:
            times.append((time.perf_counter() - start, time.process_time() - start_cpu))
    return times


def measure(llm: LLM, batch_size: int, steps: int) -> dict:
    tokenizer = llm.tokenizer
    # Only decode steps are timed, so the second run's prefix-cache hits on these prompts do not count.
    prompts = [tokenizer.encode(f"{PROMPT}{i}") for i in range(batch_size)]
    plain = _decode_steps(llm, prompts, SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True))
    masker = llm.engine.masker
    num_before, seconds_before, cpu_before = masker.num_masked_steps, masker.seconds, masker.cpu_seconds
    constrained = _decode_steps(llm, prompts, SamplingParams(max_tokens=steps + 1, temperature=0.0,
                                                             constraint=Constraint.json_schema(SCHEMA)))
    num_masked = masker.num_masked_steps - num_before
    mask_ms = (masker.seconds - seconds_before) / max(num_masked, 1) * 1e3
    mask_cpu_ms = (masker.cpu_seconds - cpu_before) / max(num_masked, 1) * 1e3

    def median_ms(times: list[tuple[float, float]], i: int) -> float:
        return round(statistics.median(t[i] for t in times) * 1e3, 3)

    plain_cpu_ms = median_ms(plain, 1)
    return {
        "batch_size": batch_size,
        "step_ms_unconstrained": median_ms(plain, 0),
        "step_ms_constrained": median_ms(constrained, 0),
        "step_cpu_ms_unconstrained": plain_cpu_ms,
        "step_cpu_ms_constrained": median_ms(constrained, 1),
        "mask_ms": round(mask_ms, 3),
        "mask_cpu_ms": round(mask_cpu_ms, 3),
        "mask_cpu_share_of_step": round(mask_cpu_ms / plain_cpu_ms, 4) if plain_cpu_ms else None,
        "num_steps_timed": min(len(plain), len(constrained)),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_structured", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="'default' or a local Hugging Face Llama-family directory")
    p.add_argument("--batch-sizes", default="1,8,32", help="constrained sequences per step, comma-separated")
    p.add_argument("--steps", type=int, default=16, help="decode steps per run")
    args = p.parse_args(argv)
    try:
        sizes = [int(s) for s in args.batch_sizes.split(",")]
    except ValueError:
        p.error(f"--batch-sizes must be comma-separated integers, got {args.batch_sizes!r}")
    if not sizes or min(sizes) < 1 or args.steps < 2:
        p.error("--batch-sizes must be >= 1 and --steps >= 2")
    with LLM(args.model, max_num_seqs=max(sizes)) as llm:
        rows = [measure(llm, b, args.steps) for b in sizes]
        vocab_size = llm.model_config.vocab_size
    print("CPU ms are this process's CPU time (robust to other load); wall ms as the clock saw them.")
    print(f"{'batch':>5} {'step CPU ms free':>17} {'step CPU ms JSON':>17} {'mask CPU ms':>12} {'mask/step':>10} "
          f"{'step ms free':>13} {'mask ms':>8}")
    for r in rows:
        share = r["mask_cpu_share_of_step"]
        print(f"{r['batch_size']:>5} {r['step_cpu_ms_unconstrained']:>17.2f} {r['step_cpu_ms_constrained']:>17.2f} "
              f"{r['mask_cpu_ms']:>12.3f} {'-' if share is None else f'{share:.2%}':>10} "
              f"{r['step_ms_unconstrained']:>13.2f} {r['mask_ms']:>8.3f}")
    print(json.dumps({"model": args.model, "vocab_size": vocab_size, "cpu": cpu_name(), "steps": args.steps,
                      "results": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
