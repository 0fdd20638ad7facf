"""What the tier costs when nothing is reused (the goal: "within 3% of off; the write-back must not
slow the engine"): the realistic workload offline, through ``LLM``, the tier on against off.

The workload is bench_throughput's realistic one (benchmarks/throughput/realistic.py: English chat
prompts with a ShareGPT-like length mix, outputs sampled at temperature 0.8 and run to their drawn
length), with bench_throughput's engine settings (a 512 MiB pool, 256 sequences, 2,048 tokens a
step). Every run draws new prompts (seed + pair), so nothing but the chat template's first block or
two is shared and the tier is written and never read: each pair runs one workload on both engines,
which live side by side (two LLMs, two memory services, one with ``kv_disk_dir``), the order
alternating between pairs (tier first, then the plain engine first), because a shared machine's
load drifts more than the 3% asked of them. The ratio is of the total tokens per second of each.

The tier's writer yields the cores to the engine (SCHED_IDLE, ``memory_service/tier/worker.py``): what
it has not written when a run ends, it writes before the next run starts (``wait_for_writer``), so
the plain engine's run never pays for the tier's. Under saturation the writer falls behind and some
blocks are evicted before it reaches them: ``tier_blocks_missed`` counts them (a block recomputed
after a preemption and missed again counts twice), and ``tier_written_share`` is the share of the
tier runs' full blocks (their prompt and output tokens with K/V, by 16) that reached the disk.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from compute_service import LLM
from compute_service.engine.outputs import RequestOutput, collect
from compute_service.engine.sampling_params import SamplingParams
from memory_service.manager.block_types import TierStats

from benchmarks.throughput.realistic import make_realistic_workload
from benchmarks.throughput.workload import Request

BLOCK_SIZE = 16


@dataclass(frozen=True)
class NoReuseSizes:
    """Args:
        num_requests: prompts of each run.
        num_pairs: runs of each engine (>= 2: the order alternates).
        max_prompt_tokens, max_output_tokens: caps on the drawn lengths (None: the workload's own).
        kv_cache_bytes: each engine's pool.
    """

    num_requests: int = 128
    num_pairs: int = 2
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None
    kv_cache_bytes: int = 512 << 20

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.num_pairs < 2:
            raise ValueError(f"no-reuse sizes out of range: {self}")


QUICK_NO_REUSE = NoReuseSizes(num_requests=4, num_pairs=2, max_prompt_tokens=96, max_output_tokens=8,
                              kv_cache_bytes=64 << 20)


def workload(llm: LLM, sizes: NoReuseSizes, seed: int) -> list[Request]:
    """The realistic requests of one pair, cut to the caps (and to the model's context)."""
    requests = make_realistic_workload(llm.tokenizer, sizes.num_requests, seed)
    max_output = min(sizes.max_output_tokens or 1 << 30, llm.model_config.max_position // 2)
    max_prompt = min(sizes.max_prompt_tokens or 1 << 30, llm.model_config.max_position - max_output)
    return [replace(r, prompt_token_ids=r.prompt_token_ids[:max_prompt], max_tokens=min(r.max_tokens, max_output))
            for r in requests]


def run_workload(llm: LLM, requests: list[Request], name: str, gap_s: float = 0.0) -> tuple[int, float, float]:
    """Adds ``requests[i]`` at ``i * gap_s`` seconds (0: all at once) and steps while anything is
    unfinished: (tokens generated, seconds spent in steps, seconds in all)."""
    engine = llm.engine
    results: dict[str, RequestOutput] = {}
    started = time.perf_counter()
    num_added, busy_s = 0, 0.0
    while num_added < len(requests) or engine.has_unfinished():
        while num_added < len(requests) and time.perf_counter() - started >= num_added * gap_s:
            r = requests[num_added]
            engine.add_request(f"{name}-{num_added}", r.prompt_token_ids, SamplingParams(
                max_tokens=r.max_tokens, temperature=r.temperature, top_p=r.top_p, ignore_eos=True))
            num_added += 1
        if engine.has_unfinished():
            step_started = time.perf_counter()
            collect(results, engine.step())
            busy_s += time.perf_counter() - step_started
        else:
            time.sleep(0.002)
    return sum(len(out.token_ids) for out in results.values()), busy_s, time.perf_counter() - started


def engine_settings(kv_cache_bytes: int, dtype: str | None) -> dict[str, Any]:
    """bench_throughput's engine settings, with this pool."""
    return {"kv_cache_bytes": kv_cache_bytes, "max_num_seqs": 256, "max_num_batched_tokens": 2048,
            "block_size": BLOCK_SIZE, **({"dtype": dtype} if dtype else {})}


def warm_up(llm: LLM, requests: list[Request]) -> None:
    """The first steps load kernels: not part of any run. Its prompt shares no block with a request."""
    llm.generate([[requests[0].prompt_token_ids[0]] * 8], max_tokens=2, temperature=0.0, ignore_eos=True)


def full_blocks(requests: list[Request]) -> int:
    """The full blocks of ``requests``: their prompt and output tokens with K/V (all but the last)."""
    return sum((len(r.prompt_token_ids) + r.max_tokens - 1) // BLOCK_SIZE for r in requests)


def disk_tier_stats(llm: LLM) -> TierStats:
    return next(t for t in llm.memory_stats().tiers if t.kind == "disk")


def blocks_written(disk: TierStats) -> int:
    """Blocks the disk tier wrote: every file is one block's, header and payload."""
    return disk.num_bytes_written // (disk.num_bytes // disk.num_blocks) if disk.num_blocks else 0


def wait_for_writer(llm: LLM, timeout_s: float = 60.0) -> None:
    """Until the tier's writer has written what the run committed: its counters still for a while."""
    def counters() -> tuple[int, int]:
        disk = disk_tier_stats(llm)
        return disk.num_bytes_written, disk.num_blocks_missed
    deadline = time.monotonic() + timeout_s
    last = counters()
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = counters()
        if now == last:
            return
        last = now


def run_no_reuse(model: str, dtype: str | None, root: Path, sizes: NoReuseSizes, seed: int) -> dict[str, Any]:
    """The alternating pairs (module docstring); returns the ``no_reuse`` section of the JSON."""
    common = engine_settings(sizes.kv_cache_bytes, dtype)
    runs: list[dict[str, Any]] = []
    with LLM(model, kv_disk_dir=str(root / "no-reuse-tier"), **common) as tier_llm, LLM(model, **common) as plain:
        llms = {"tier": tier_llm, "no_tier": plain}
        pairs = [workload(plain, sizes, seed + pair) for pair in range(sizes.num_pairs)]
        for llm in llms.values():
            warm_up(llm, pairs[0])
        for pair, requests in enumerate(pairs):
            for label in (["tier", "no_tier"] if pair % 2 == 0 else ["no_tier", "tier"]):
                tokens, _, seconds = run_workload(llms[label], requests, f"pair{pair}")
                runs.append({"pair": pair, "engine": label, "tokens": tokens, "seconds": seconds})
                if label == "tier":
                    wait_for_writer(tier_llm)
        tier = disk_tier_stats(tier_llm)

    result: dict[str, Any] = {"requests": sizes.num_requests, "pairs": sizes.num_pairs}
    by_engine = {label: [r for r in runs if r["engine"] == label] for label in llms}
    for label, mine in by_engine.items():
        result[f"{label}_tok_s"] = round(sum(r["tokens"] for r in mine) / sum(r["seconds"] for r in mine), 2)
    result["tier_vs_no_tier"] = round(result["tier_tok_s"] / result["no_tier_tok_s"], 3)
    result["pair_ratios"] = [round((t["tokens"] / t["seconds"]) / (p["tokens"] / p["seconds"]), 3)
                             for t, p in zip(by_engine["tier"], by_engine["no_tier"])]
    num_written, num_full = blocks_written(tier), sum(full_blocks(requests) for requests in pairs)
    result |= {"tier_bytes_written": tier.num_bytes_written, "tier_blocks_written": num_written,
               "tier_blocks_missed": tier.num_blocks_missed,
               "tier_full_blocks": num_full, "tier_written_share": round(num_written / max(1, num_full), 3),
               "tier_write_errors": tier.num_write_errors, "tier_loads": tier.num_loads, "tier_hits": tier.num_hits,
               "runs": [{**r, "seconds": round(r["seconds"], 2), "tok_s": round(r["tokens"] / r["seconds"], 2)}
                        for r in runs]}
    return {"no_reuse": result}


@dataclass(frozen=True)
class WriteShareSizes:
    """Args:
        num_requests: realistic prompts of each paced run.
        gaps_s: the seconds between arrivals, one run each (0: all at once, the no-reuse saturation).
        kv_cache_bytes: the pool (small, so that blocks are evicted within a run).
        max_prompt_tokens, max_output_tokens: caps on the drawn lengths (None: the workload's own).
    """

    num_requests: int = 24
    gaps_s: tuple[float, ...] = (0.0, 1.0, 3.0)
    kv_cache_bytes: int = 128 << 20
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None


QUICK_WRITE_SHARE = WriteShareSizes(num_requests=3, gaps_s=(0.1,), kv_cache_bytes=64 << 20,
                                    max_prompt_tokens=96, max_output_tokens=8)


def run_write_share(model: str, dtype: str | None, root: Path, sizes: WriteShareSizes, seed: int) -> dict[str, Any]:
    """How much of what the pool commits reaches the disk as load falls: the realistic requests arrive
    ``gap_s`` apart (a new tier directory and new prompts each run), the engine steps whenever it has
    work, and the tier's counters are read once its writer is done. The writer takes only the time the
    engine leaves (SCHED_IDLE), so the share grows with the engine's idle time; ``engine_busy_share`` is
    the share of the run's wall time spent in steps."""
    caps = NoReuseSizes(num_requests=sizes.num_requests, max_prompt_tokens=sizes.max_prompt_tokens,
                        max_output_tokens=sizes.max_output_tokens)
    runs = []
    for run, gap_s in enumerate(sizes.gaps_s):
        with LLM(model, kv_disk_dir=str(root / f"write-share-{run}"),
                 **engine_settings(sizes.kv_cache_bytes, dtype)) as llm:
            requests = workload(llm, caps, seed + 100 + run)
            warm_up(llm, requests)
            _, busy_s, wall_s = run_workload(llm, requests, "paced", gap_s)
            wait_for_writer(llm)
            disk = disk_tier_stats(llm)
        num_written, num_full = blocks_written(disk), full_blocks(requests)
        runs.append({"gap_s": gap_s, "engine_busy_share": round(busy_s / wall_s, 3), "full_blocks": num_full,
                     "blocks_written": num_written, "blocks_missed": disk.num_blocks_missed,
                     "written_share": round(num_written / max(1, num_full), 3)})
    return {"write_share": {"requests": sizes.num_requests, "runs": runs}}
