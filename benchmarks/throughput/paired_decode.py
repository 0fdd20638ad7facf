"""Paired decode-step timing of two process environments, interleaved burst by burst.

On a shared machine whole-run A/B timings drift with the other jobs' load. Here two long-lived
worker processes (the same engine and model, environments A and B: e.g. with and without an
``LD_PRELOAD``) each prepare ``B`` decoding sequences, then take turns: A runs ``--steps`` decode
steps, then B does, then B, A, ... (the order alternates). Each pair sees the same moment's load;
the ratio A/B is taken pair by pair and its median reported, with each side's median step time.
A pause of ``--gap-s`` separates the bursts: Intel OpenMP keeps its threads spinning for 200 ms
(KMP_BLOCKTIME) after a region, which would otherwise take the cores from the other side's burst.

    python -m benchmarks.throughput.paired_decode --batch-size 8 \\
        --a 'LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:.venv/lib/libiomp5.so' --b ''

``--a``/``--b`` are space-separated ``NAME=VALUE`` settings added to this process's environment
(``PAGEDSERVE_CPU_PRELOAD=0`` is set for both unless given: the comparison is of exactly what is
written; ``PYTHONPATH=<checkout>`` on each side compares two versions of the code). ``--clock cpu``
times each step by the worker's CPU time instead of the wall clock: on a machine whose load is
several times its cores a step's wall time is mostly waiting for a core (steps 10x their CPU time
were seen), and the pair's ratio then measures the scheduler; with one thread a side
(``OMP_NUM_THREADS=1``) CPU time is the work itself. ``--sampled`` decodes at temperature 0.8,
top_p 0.95 (the realistic workload's sampling) instead of greedily, so the step includes the sampler.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time


def worker(batch_size: int, steps: int, context: int, kv_cache_bytes: int, clock: str = "wall",
           sampled: bool = False) -> None:
    """Prepare ``batch_size`` decoding sequences; per line on stdin, time ``steps`` decode steps and
    print their median in ms (``clock``: "wall" or "cpu", this process's CPU time)."""
    from compute_service import LLM, SamplingParams
    from pagedserve.log import configure_logging

    configure_logging("warning")
    llm = LLM(model="default", max_num_seqs=max(64, batch_size), kv_cache_bytes=kv_cache_bytes)
    engine, rng = llm.engine, random.Random(0)
    vocab = llm.model_config.vocab_size
    params = SamplingParams(max_tokens=llm.model_config.max_position - context, ignore_eos=True,
                            **(dict(temperature=0.8, top_p=0.95) if sampled else dict(temperature=0.0)))
    now = time.process_time if clock == "cpu" else time.perf_counter
    for i in range(batch_size):
        engine.add_request(f"r{i}", [rng.randrange(100, vocab) for _ in range(context)], params)
    while engine.scheduler.waiting or any(not s.output_token_ids for s in engine.scheduler.running):
        engine.step()
    print("ready", flush=True)
    for _ in sys.stdin:
        times = []
        for _ in range(steps):
            started = now()
            engine.step()
            times.append(now() - started)
        print(f"{statistics.median(times) * 1000:.3f}", flush=True)
    llm.close()


def parse_env(text: str) -> dict[str, str]:
    """``"A=1 B=x"`` -> {"A": "1", "B": "x"}."""
    pairs = {}
    for item in text.split():
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"an environment setting is NAME=VALUE, got {item!r}")
        pairs[name] = value
    return pairs


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--a", type=parse_env, default={}, help="environment of side A (NAME=VALUE ...)")
    p.add_argument("--b", type=parse_env, default={}, help="environment of side B")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=5, help="decode steps per burst")
    p.add_argument("--pairs", type=int, default=16)
    p.add_argument("--gap-s", type=float, default=0.3, help="pause between bursts (longer than KMP_BLOCKTIME)")
    p.add_argument("--context", type=int, default=256, help="prompt tokens of each sequence")
    p.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="what times a step (see above)")
    p.add_argument("--sampled", action="store_true", help="T 0.8, top_p 0.95 instead of greedy")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.batch_size, args.steps, args.context, args.kv_cache_bytes, args.clock, args.sampled)
        return
    cmd = [sys.executable, "-m", "benchmarks.throughput.paired_decode", "--worker", "--batch-size",
           str(args.batch_size), "--steps", str(args.steps), "--context", str(args.context), "--kv-cache-bytes",
           str(args.kv_cache_bytes), "--clock", args.clock, *(["--sampled"] if args.sampled else [])]
    sides = {}
    for name, extra in (("a", args.a), ("b", args.b)):
        env = {**os.environ, "PAGEDSERVE_CPU_PRELOAD": "0", **extra}
        # `python -m` puts the working directory before PYTHONPATH: a side given a checkout runs in it.
        cwd = extra["PYTHONPATH"].split(os.pathsep)[0] if extra.get("PYTHONPATH") else None
        sides[name] = subprocess.Popen(cmd, env=env, cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       text=True)
    try:
        for proc in sides.values():
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError("a worker failed to start")
        times: dict[str, list[float]] = {"a": [], "b": []}
        for i in range(args.pairs):
            for name in ("a", "b") if i % 2 == 0 else ("b", "a"):
                time.sleep(args.gap_s)
                sides[name].stdin.write("go\n")
                sides[name].stdin.flush()
                times[name].append(float(sides[name].stdout.readline()))
    finally:
        for proc in sides.values():
            proc.stdin.close()
            proc.wait(timeout=120)
    ratios = [a / b for a, b in zip(times["a"], times["b"])]
    print(json.dumps({"batch_size": args.batch_size, "a_step_ms": round(statistics.median(times["a"]), 2),
                      "b_step_ms": round(statistics.median(times["b"]), 2),
                      "a_over_b": round(statistics.median(ratios), 3), "pairs": args.pairs,
                      "clock": args.clock, "sampled": args.sampled, "context": args.context,
                      "a_env": args.a, "b_env": args.b, "load_avg": round(os.getloadavg()[0], 2)}))


if __name__ == "__main__":
    main()
