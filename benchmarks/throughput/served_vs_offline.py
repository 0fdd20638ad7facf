"""One request at a time: the time between streamed tokens through the whole stack against the
engine's own decode step in this process, alternated, so the machine's drift moves both.

The served side is a real stack (memory, compute and gateway processes, as ``pagedserve up``
starts them) and one streaming ``/v1/completions`` client here; the offline side is the same
model in an ``LLM`` in this process (given the compute service's preload: tcmalloc and Intel
OpenMP where installed), each ``Engine.step`` timed. Each round streams ``--tokens`` sampled
tokens (T 0.8, top_p 0.95, EOS ignored) one way, then the other; the ratio of the medians says
what serving adds to a token: on a machine with few cores the gateway's, the compute service's
event loop's and the client's work for every token wakes while the model's threads hold every
core.

    python -m benchmarks.throughput.served_vs_offline [--model FILE.gguf] [--rounds 4] [--tokens 200]

Prints a line per round, then one JSON object.
"""

from __future__ import annotations

if __name__ == "__main__":
    from pagedserve import cpu_preload

    cpu_preload.maybe_reexec("benchmarks.throughput.served_vs_offline")

import argparse
import json
import os
import statistics
import time

import httpx

from benchmarks.cpu_info import cpu_name
from benchmarks.serving.stack import StackConfig, start_stacks
from compute_service import LLM, SamplingParams
from pagedserve import cpu_preload

TEMPERATURE, TOP_P = 0.8, 0.95


def prompt(round_index: int) -> str:
    """A prompt no earlier round shares (no prefix-cache hit past its first words)."""
    return f"Story {round_index}: write a long story about a robot who learns to paint. " * 8


def served_gaps(base_url: str, model: str, text: str, tokens: int) -> list[float]:
    """Seconds between the streamed chunks of one completion."""
    body = {"model": model, "prompt": text, "max_tokens": tokens, "temperature": TEMPERATURE, "top_p": TOP_P,
            "ignore_eos": True, "stream": True}
    times = []
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=600) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.perf_counter())
    return [b - a for a, b in zip(times, times[1:])]


def offline_steps(llm: LLM, text: str, tokens: int) -> list[float]:
    """Seconds of each engine step of one generation (the first, its prompt, and the last, which
    only hands the finished sequence's blocks back, left out)."""
    engine = llm.engine
    steps: list[float] = []
    original = engine.step

    def timed():
        started = time.perf_counter()
        out = original()
        steps.append(time.perf_counter() - started)
        return out

    engine.step = timed
    try:
        llm.generate([text], SamplingParams(max_tokens=tokens, temperature=TEMPERATURE, top_p=TOP_P, ignore_eos=True))
    finally:
        del engine.step
    return steps[1:-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help='"default", a GGUF file or a Hugging Face directory')
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    args = parser.parse_args()
    if args.rounds < 1 or args.tokens < 3:
        parser.error("--rounds must be at least 1 and --tokens at least 3")
    [stack] = start_stacks([StackConfig(model=args.model, kv_cache_bytes=args.kv_cache_bytes)])
    rounds = []
    try:
        base_url = stack.target("openai").address
        served_model = httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"][0]["id"]
        with LLM(model=args.model, kv_cache_bytes=args.kv_cache_bytes) as llm:
            served_gaps(base_url, served_model, prompt(-1), 8)  # both warm
            offline_steps(llm, prompt(-2), 8)
            for r in range(args.rounds):
                served = statistics.median(served_gaps(base_url, served_model, prompt(2 * r), args.tokens)) * 1000
                offline = statistics.median(offline_steps(llm, prompt(2 * r + 1), args.tokens)) * 1000
                rounds.append({"served_gap_ms": round(served, 2), "offline_step_ms": round(offline, 2),
                               "ratio": round(served / offline, 3)})
                print(f"round {r}: served {served:.2f} ms between tokens, offline step {offline:.2f} ms, "
                      f"ratio {served / offline:.3f}", flush=True)
    finally:
        stack.stop()
    ratios = [r["ratio"] for r in rounds]
    print(json.dumps({"cpu": cpu_name(), "model": os.path.basename(args.model), "tokens": args.tokens,
                      "preloaded": cpu_preload.is_preloaded(), "rounds": rounds,
                      "median_ratio": round(statistics.median(ratios), 3), "load_avg": round(os.getloadavg()[0], 2)}))


if __name__ == "__main__":
    main()
