"""KV tier benchmark: what the memory service's disk tier (--kv-disk-dir) buys and costs.

Prints a table, then as its last line one JSON object:

- ``returning``: a long prompt (``--prompt-tokens``, 4,000 by default), then other prompts that evict
  it from a small pool, then the same prompt again: TTFT computed from scratch (``recompute_ttft_s``,
  its first time, nothing cached) against TTFT served from the tier (``tier_ttft_s``), their ratio
  (goal >= 5) and the share of its tokens counted as cached (goal >= 0.95).
- ``warm_restart``: the engine and its memory service stopped, a new pair started on the same
  directory: the prompt's TTFT against a cold pair on an empty directory (goal >= 5x), and whether the
  greedy tokens are the same.
- ``working_set``: ``--docs`` documents of ``--doc-tokens`` tokens asked about (a document and a short
  question) in a skewed (Zipf) order, the pool a tenth of the documents: prefix hit rate and mean
  TTFT with and without the tier.
- ``no_reuse``: the realistic workload (bench_throughput's), new prompts every run, so the tier is
  written and never read: tokens per second with the tier on against off, alternating pairs of runs
  (goal: within 3%; the write-behind must not slow the engine). ``benchmarks/kv_tier/no_reuse.py``.
- ``faults``: real memory and compute service processes (``pagedserve.stack``), greedy: the memory
  service SIGKILLed mid-write, a flipped and a truncated block file, a full disk (a tmpfs): per
  scenario the same tokens as cold or not, files removed, write errors, the log lines.
  ``benchmarks/kv_tier/faults.py``.
- ``returning_host`` (``--scenarios returning_host``): the returning prompt again, with the host-RAM
  tier alone (``--kv-host-bytes``, ``--host-bytes``) and with the disk tier alone, each a pair of
  its own: TTFT recomputed, from RAM and from disk, and each tier's speedup over recomputing.
- ``write_share`` (``--scenarios write_share``): the realistic requests arriving 0, 1 and 3 s apart
  into a small pool, a tier each: the share of the full blocks the writer (which takes only the time
  the engine leaves) wrote, beside the share of the time the engine was stepping.
  ``benchmarks/kv_tier/no_reuse.py``.
- ``disk``: the tier directory's read bandwidth, measured on a file dropped from the page cache
  (``cold_read_mb_s``) and read again from it (``cached_read_mb_s``). Block files are written with
  O_DIRECT, past the page cache: a load reads the device the first time.

Each scenario runs ``LLM`` (the engine in this process, its memory service a process of its own, as
in ``pagedserve up`` minus the gateway), the default model unless ``--model``. The machine is shared:
compare runs of one machine, and read the CPU and the disk figures with them.

    python -m benchmarks.bench_kv_tier [--model default] [--prompt-tokens 4000] [--docs 12] [--doc-tokens 512]
                                       [--requests 24] [--no-reuse-requests 128] [--no-reuse-pairs 2]
                                       [--fault-prompt-blocks 64] [--vocab 40000] [--dir DIR]
                                       [--scenarios returning,working_set,no_reuse,faults,returning_host,write_share]
                                       [--host-bytes N]
    python -m benchmarks.bench_kv_tier --scenarios no_reuse,faults --quick   # a smoke run of those two
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from compute_service import LLM
from compute_service.engine.sampling_params import SamplingParams
from pagedserve.log import configure_logging

from benchmarks.kv_tier.faults import QUICK_FAULTS, FaultSizes, run_faults
from benchmarks.kv_tier.no_reuse import (QUICK_NO_REUSE, QUICK_WRITE_SHARE, NoReuseSizes, WriteShareSizes,
                                         run_no_reuse, run_write_share)

BLOCK_SIZE = 16
FIRST_TOKEN = 100  # prompts are random ids in [FIRST_TOKEN, --vocab): no special tokens


def ttft_and_tokens(llm: LLM, prompt: list[int], max_tokens: int, request_id: str) -> tuple[float, list[int], int]:
    """Runs one greedy request alone: (seconds to its first token, its tokens, its cached prompt tokens)."""
    engine = llm.engine
    start = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    ttft, tokens, num_cached = None, [], 0
    while True:
        for delta in engine.step():
            if delta.request_id != request_id:
                continue
            tokens += delta.completions[0].token_ids if delta.completions else []
            num_cached = delta.num_cached_tokens
            if ttft is None and tokens:
                ttft = time.perf_counter() - start
            if delta.finished:
                engine.step()  # frees its blocks now
                return ttft, tokens, num_cached


# The warm-up prompt's tokens: its full blocks reach the tier too, so a wait for a prompt's blocks counts them.
WARM_UP_TOKENS = 64


def wait_for_tier(llm: LLM, num_blocks: int, timeout_s: float = 300.0) -> None:
    """Until the write-behind has written ``num_blocks`` blocks (or the timeout: measured all the same)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        tiers = llm.memory_stats().tiers
        if tiers and tiers[0].num_blocks >= num_blocks:
            return
        time.sleep(0.1)


def read_bandwidth(directory: Path, num_bytes: int = 256 << 20) -> dict[str, float]:
    """MB/s reading a file of the tier's file system, out of the page cache and then from it."""
    path = directory / ".bandwidth-probe"
    with open(path, "wb") as f:
        f.write(os.urandom(1 << 20) * (num_bytes >> 20))
        f.flush()
        os.fsync(f.fileno())
    figures = {}
    try:
        for name in ("cold_read_mb_s", "cached_read_mb_s"):
            fd = os.open(path, os.O_RDONLY)
            try:
                if name == "cold_read_mb_s":
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                start = time.perf_counter()
                while os.read(fd, 8 << 20):
                    pass
                figures[name] = round(num_bytes / (time.perf_counter() - start) / 1e6, 1)
            finally:
                os.close(fd)
    finally:
        path.unlink()
    return figures


def returning_and_restart(args: argparse.Namespace, root: Path, rng: random.Random) -> dict[str, Any]:
    """The returning long prompt, then the warm restart against a cold pair."""
    prompt = [rng.randrange(FIRST_TOKEN, args.vocab) for _ in range(args.prompt_tokens)]
    pool_tokens = args.prompt_tokens + args.pool_extra_tokens
    num_blocks = -(-pool_tokens // BLOCK_SIZE)
    evictor_tokens = min(args.prompt_tokens, pool_tokens // 2)  # enough of them to push every block out
    evictors = [[rng.randrange(FIRST_TOKEN, args.vocab) for _ in range(evictor_tokens)]
                for _ in range(pool_tokens // evictor_tokens + 1)]
    tier_dir = root / "returning"
    common = {"max_num_blocks": num_blocks, "block_size": BLOCK_SIZE, "max_num_batched_tokens": 2048}
    with LLM(args.model, kv_disk_dir=str(tier_dir), **common) as llm:
        ttft_and_tokens(llm, [rng.randrange(FIRST_TOKEN, args.vocab) for _ in range(WARM_UP_TOKENS)], 1, "warm-up")
        recompute_s, first_tokens, _ = ttft_and_tokens(llm, prompt, args.max_tokens, "first")
        wait_for_tier(llm, WARM_UP_TOKENS // BLOCK_SIZE + args.prompt_tokens // BLOCK_SIZE - 1)
        for i, evictor in enumerate(evictors):
            ttft_and_tokens(llm, evictor, 1, f"evict-{i}")
        tier_s, again_tokens, num_cached = ttft_and_tokens(llm, prompt, args.max_tokens, "again")
        tier_stats = llm.memory_stats().tiers[0]
    returning = {
        "prompt_tokens": args.prompt_tokens, "pool_blocks": num_blocks, "recompute_ttft_s": round(recompute_s, 3),
        "tier_ttft_s": round(tier_s, 3), "speedup": round(recompute_s / tier_s, 2),
        "cached_share": round(num_cached / args.prompt_tokens, 3), "same_tokens": again_tokens == first_tokens,
        "tier_loads": tier_stats.num_loads, "tier_bytes_read": tier_stats.num_bytes_read,
    }
    with LLM(args.model, kv_disk_dir=str(tier_dir), **common) as llm:  # a new pair on the same directory
        ttft_and_tokens(llm, [rng.randrange(FIRST_TOKEN, args.vocab) for _ in range(WARM_UP_TOKENS)], 1, "warm-up")
        warm_s, warm_tokens, warm_cached = ttft_and_tokens(llm, prompt, args.max_tokens, "warm")
    with LLM(args.model, kv_disk_dir=str(root / "cold"), **common) as llm:  # a cold pair: empty directory
        ttft_and_tokens(llm, [rng.randrange(FIRST_TOKEN, args.vocab) for _ in range(WARM_UP_TOKENS)], 1, "warm-up")
        cold_s, cold_tokens, _ = ttft_and_tokens(llm, prompt, args.max_tokens, "cold")
    restart = {
        "warm_ttft_s": round(warm_s, 3), "cold_ttft_s": round(cold_s, 3), "speedup": round(cold_s / warm_s, 2),
        "cached_share": round(warm_cached / args.prompt_tokens, 3),
        "same_tokens": warm_tokens == cold_tokens == first_tokens,
    }
    return {"returning": returning, "warm_restart": restart}


def returning_per_tier(args: argparse.Namespace, root: Path, rng: random.Random) -> dict[str, Any]:
    """The returning long prompt with the host tier alone, then with the disk tier alone: TTFT
    recomputed (its first time) against loaded from RAM and from disk."""
    prompt = [rng.randrange(FIRST_TOKEN, args.vocab) for _ in range(args.prompt_tokens)]
    pool_tokens = args.prompt_tokens + args.pool_extra_tokens
    evictor_tokens = min(args.prompt_tokens, pool_tokens // 2)
    evictors = [[rng.randrange(FIRST_TOKEN, args.vocab) for _ in range(evictor_tokens)]
                for _ in range(pool_tokens // evictor_tokens + 1)]
    common = {"max_num_blocks": -(-pool_tokens // BLOCK_SIZE), "block_size": BLOCK_SIZE,
              "max_num_batched_tokens": 2048}
    figures: dict[str, Any] = {"prompt_tokens": args.prompt_tokens, "host_bytes": args.host_bytes}
    recompute, first_tokens = [], None
    for kind, tier in (("host", {"kv_host_bytes": args.host_bytes}), ("disk", {"kv_disk_dir": str(root / "per-tier")})):
        with LLM(args.model, **tier, **common) as llm:
            ttft_and_tokens(llm, [rng.randrange(FIRST_TOKEN, args.vocab) for _ in range(WARM_UP_TOKENS)], 1, "warm-up")
            recompute_s, tokens, _ = ttft_and_tokens(llm, prompt, args.max_tokens, "first")
            recompute.append(recompute_s)
            first_tokens = first_tokens or tokens
            wait_for_tier(llm, WARM_UP_TOKENS // BLOCK_SIZE + args.prompt_tokens // BLOCK_SIZE - 1)
            for i, evictor in enumerate(evictors):
                ttft_and_tokens(llm, evictor, 1, f"evict-{i}")
            tier_s, again_tokens, num_cached = ttft_and_tokens(llm, prompt, args.max_tokens, "again")
            t = llm.memory_stats().tiers[0]
        figures[f"{kind}_ttft_s"] = round(tier_s, 3)
        figures[f"{kind}_cached_share"] = round(num_cached / args.prompt_tokens, 3)
        figures[f"{kind}_same_tokens"] = again_tokens == tokens == first_tokens
        figures[f"{kind}_loads"], figures[f"{kind}_bytes_read"] = t.num_loads, t.num_bytes_read
    figures["recompute_ttft_s"] = round(statistics.mean(recompute), 3)
    for kind in ("host", "disk"):
        figures[f"{kind}_speedup"] = round(figures["recompute_ttft_s"] / figures[f"{kind}_ttft_s"], 2)
    return {"returning_host": figures}


def working_set(args: argparse.Namespace, root: Path, rng: random.Random) -> dict[str, Any]:
    """The skewed working set 10x the pool, with the tier and without."""
    docs = [[rng.randrange(FIRST_TOKEN, args.vocab) for _ in range(args.doc_tokens)] for _ in range(args.docs)]
    weights = [1 / (rank + 1) ** 1.1 for rank in range(args.docs)]  # Zipf
    order = rng.choices(range(args.docs), weights, k=args.requests)
    questions = [[rng.randrange(FIRST_TOKEN, args.vocab) for _ in range(16)] for _ in order]
    # A tenth of the documents, but room for one request.
    num_blocks = max(-(-args.docs * args.doc_tokens // (10 * BLOCK_SIZE)), -(-(args.doc_tokens + 64) // BLOCK_SIZE))
    results: dict[str, Any] = {"working_set": {"docs": args.docs, "doc_tokens": args.doc_tokens,
                                               "requests": args.requests, "pool_blocks": num_blocks}}
    common = {"max_num_blocks": num_blocks, "block_size": BLOCK_SIZE, "max_num_batched_tokens": 2048}
    with LLM(args.model, kv_disk_dir=str(root / "ws-tier"), **common) as tier_llm, LLM(args.model, **common) as plain:
        llms = {"tier": tier_llm, "no_tier": plain}
        for label, llm in llms.items():
            ttft_and_tokens(llm, [rng.randrange(FIRST_TOKEN, args.vocab) for _ in range(WARM_UP_TOKENS)], 1, "warm-up")
            ttfts, num_cached, num_prompt = [], 0, 0
            for i, (doc, question) in enumerate(zip(order, questions)):
                ttft, _, cached = ttft_and_tokens(llm, docs[doc] + question, 1, f"ws-{i}")
                ttfts.append(ttft)
                num_cached += cached
                num_prompt += args.doc_tokens + len(question)
            results["working_set"][label] = {"hit_rate": round(num_cached / num_prompt, 3),
                                             "mean_ttft_s": round(statistics.mean(ttfts), 3)}
            if llm is tier_llm:  # why a block was not a hit: never written, or a load skipped
                t = llm.memory_stats().tiers[0]
                results["working_set"][label] |= {"tier_hits_blocks": t.num_hits, "tier_misses": t.num_misses,
                                                  "tier_loads": t.num_loads, "tier_loads_skipped": t.num_loads_skipped}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--prompt-tokens", type=int, default=4000)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--pool-extra-tokens", type=int, default=1024,
                        help="the returning scenario's pool: the prompt and this many tokens")
    parser.add_argument("--docs", type=int, default=12)
    parser.add_argument("--doc-tokens", type=int, default=512)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--no-reuse-requests", type=int, default=None,
                        help=f"realistic requests of each no-reuse run (default {NoReuseSizes.num_requests})")
    parser.add_argument("--no-reuse-pairs", type=int, default=None,
                        help=f"no-reuse runs of each engine, alternating (default {NoReuseSizes.num_pairs})")
    parser.add_argument("--fault-prompt-blocks", type=int, default=None,
                        help=f"full blocks of each faults prompt (default {FaultSizes.prompt_blocks})")
    parser.add_argument("--quick", action="store_true",
                        help="the no_reuse and faults scenarios at smoke-test size (a few short prompts)")
    parser.add_argument("--dtype", default=None, help="the engines' dtype (default: theirs, auto)")
    parser.add_argument("--fault-dtype", default="float32",
                        help="the faults scenario's dtype (default float32: benchmarks/kv_tier/faults.py says why)")
    parser.add_argument("--scenarios", default="returning,working_set,no_reuse,faults",
                        help="which to run, comma-separated: returning (with the warm restart), working_set, "
                             "no_reuse, faults, returning_host (the returning prompt from the host tier and from "
                             "the disk), write_share (the share of the blocks written as the arrival rate falls)")
    parser.add_argument("--host-bytes", type=int, default=2 << 30, help="the host tier's budget (returning_host)")
    parser.add_argument("--dir", default=None, help="where the tier directories go (default: a temporary one)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab", type=int, default=40000, help="prompts draw ids below this (within the model's)")
    parser.add_argument("--probe-mb", type=int, default=256, help="size of the disk read bandwidth probe")
    args = parser.parse_args()
    scenarios = args.scenarios.split(",")
    unknown = set(scenarios) - {"returning", "working_set", "no_reuse", "faults", "returning_host", "write_share"}
    if unknown:
        parser.error(f"--scenarios: unknown {sorted(unknown)}")
    no_reuse = QUICK_NO_REUSE if args.quick else NoReuseSizes()
    no_reuse = dataclasses.replace(no_reuse, num_requests=args.no_reuse_requests or no_reuse.num_requests,
                                   num_pairs=args.no_reuse_pairs or no_reuse.num_pairs)
    write_share = QUICK_WRITE_SHARE if args.quick else WriteShareSizes()
    faults = QUICK_FAULTS if args.quick else FaultSizes()
    faults = dataclasses.replace(faults, prompt_blocks=args.fault_prompt_blocks or faults.prompt_blocks)
    configure_logging("warning")
    root = Path(tempfile.mkdtemp(prefix="bench-kv-tier-", dir=args.dir))
    rng = random.Random(args.seed)
    try:
        result: dict[str, Any] = {"machine": {"cpu": platform.processor() or platform.machine(),
                                              "cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]},
                                  "disk": read_bandwidth(root, args.probe_mb << 20)}
        if "returning" in scenarios:
            result |= returning_and_restart(args, root, rng)
        if "working_set" in scenarios:
            result |= working_set(args, root, rng)
        if "no_reuse" in scenarios:
            result |= run_no_reuse(args.model, args.dtype, root, no_reuse, args.seed)
        if "faults" in scenarios:
            result |= run_faults(args.model, args.fault_dtype, root, faults, args.vocab, FIRST_TOKEN, args.seed)
        if "returning_host" in scenarios:
            result |= returning_per_tier(args, root, rng)
        if "write_share" in scenarios:
            result |= run_write_share(args.model, args.dtype, root, write_share, args.seed)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{'figure':<40} value")
    for section, figures in result.items():
        for name, value in figures.items():
            if isinstance(value, dict):
                for sub, v in value.items():
                    print(f"{section}.{name}.{sub:<24} {v}")
            else:
                print(f"{section}.{name:<32} {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
