"""In-process throughput of the block manager on a realistic mix (no gRPC, no pool bytes).

``benchmarks/bench_memory.py`` calls ``run_inprocess_benchmark``; ``python -m
benchmarks.memory.block_manager_bench`` (from the repository root) prints the figures by itself.

The mix is what a compute service sends: one ``apply`` per scheduler step holding the AllocateOps
of newly admitted requests (prompts of 4-32 blocks, half of them opening with one of 8 shared
system prompts, so the prefix cache hits and, once the pool fills, evicts), one AppendOp of 1 to
block_size tokens per running sequence (1-4 of them per sequence: decode steps that cross block
boundaries now and then) and a FreeOp for each finished one. The ops are built before the clock
starts, and frozen out of the garbage collector's sight, so only the block manager is timed.

The headline figure divides by the process's CPU time, not the wall clock: the manager is
single-threaded and never waits, so the two agree on an idle machine, and on a shared one the CPU
time still measures the manager rather than its neighbours. Both are reported.
"""

from __future__ import annotations

import gc
import random
import time
from dataclasses import dataclass

from memory_service.manager.block_manager import AllocateOp, AppendOp, BlockManager, BlockManagerConfig, FreeOp, Op


@dataclass(frozen=True)
class BenchmarkResult:
    """Figures of one run.

    Args:
        alloc_free_blocks_per_s: blocks newly taken (free or evicted) and later freed, per CPU second.
        alloc_free_blocks_per_wall_s: the same per wall-clock second.
        ops_per_s: ops applied per CPU second.
        num_blocks_allocated: blocks newly taken over the run (cache hits not counted).
        num_ops: ops applied.
        cpu_s: CPU time spent in ``apply``.
        wall_s: wall-clock time spent in ``apply``.
        prefix_cache_hit_rate: prompt tokens served from the cache / prompt tokens.
        num_evictions: cached blocks evicted.
    """

    alloc_free_blocks_per_s: float
    alloc_free_blocks_per_wall_s: float
    ops_per_s: float
    num_blocks_allocated: int
    num_ops: int
    cpu_s: float
    wall_s: float
    prefix_cache_hit_rate: float
    num_evictions: int


def _build_steps(
    num_sequences: int, block_size: int, max_live_sequences: int, min_blocks: int, max_blocks: int, seed: int
) -> list[list[Op]]:
    """Schedules the whole run ahead: one op batch per step."""
    rng = random.Random(seed)
    system_prompts = [[rng.randrange(32000) for _ in range(rng.randint(1, 8) * block_size)] for _ in range(8)]
    steps: list[list[Op]] = []
    live: dict[str, int] = {}  # seq_id -> appends left
    next_seq = 0
    while next_seq < num_sequences or live:
        ops: list[Op] = []
        for seq_id in list(live):
            if live[seq_id] == 0:
                ops.append(FreeOp(seq_id))
                del live[seq_id]
            else:
                ops.append(AppendOp(seq_id, [rng.randrange(32000) for _ in range(rng.randint(1, block_size))]))
                live[seq_id] -= 1
        while next_seq < num_sequences and len(live) < max_live_sequences:
            num_tokens = rng.randint(min_blocks, max_blocks) * block_size - rng.randrange(block_size)
            prompt = list(rng.choice(system_prompts)) if rng.random() < 0.5 else []
            prompt = (prompt + [rng.randrange(32000) for _ in range(num_tokens)])[:num_tokens]
            seq_id = f"s{next_seq}"
            ops.append(AllocateOp(seq_id, prompt, max_num_new_tokens=num_tokens))
            live[seq_id] = rng.randint(1, 4)
            next_seq += 1
        steps.append(ops)
    return steps


def run_benchmark(
    num_sequences: int = 20_000,
    num_blocks: int = 16_384,
    block_size: int = 16,
    enable_prefix_caching: bool = True,
    max_live_sequences: int = 256,
    min_blocks: int = 4,
    max_blocks: int = 32,
    seed: int = 0,
    repeats: int = 1,
) -> BenchmarkResult:
    """Runs the mix ``repeats`` times, each on a fresh manager, and returns the fastest run.

    Args:
        num_sequences: requests in the run.
        num_blocks: pool size; large enough that no allocation fails (checked).
        block_size: tokens per block.
        enable_prefix_caching: the manager's setting.
        max_live_sequences: running sequences at a time (the scheduler's batch).
        min_blocks: smallest prompt, in blocks.
        max_blocks: largest prompt, in blocks.
        seed: seed of the workload.
        repeats: runs of the same workload.

    Returns:
        The figures of the fastest run (by CPU time).
    """
    steps = _build_steps(num_sequences, block_size, max_live_sequences, min_blocks, max_blocks, seed)
    config = BlockManagerConfig(
        num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=enable_prefix_caching
    )
    runs = [_run_once(config, steps) for _ in range(repeats)]
    return min(runs, key=lambda run: run.cpu_s)


def _run_once(config: BlockManagerConfig, steps: list[list[Op]]) -> BenchmarkResult:
    manager = BlockManager(config)
    manager.add_client("bench")
    apply = manager.apply
    clock = time.process_time
    gc.collect()
    gc.freeze()  # the pre-built ops are not the manager's garbage to scan
    # Only apply() is timed; each step's results are counted and dropped between the timed calls,
    # as the service drops them once answered (keeping 20,000 steps' results made the collector
    # rescan them all, a cost of the benchmark, not of the manager).
    cpu_s = 0.0
    num_blocks_allocated = num_ops = 0
    start_wall = time.perf_counter()
    for ops in steps:
        started = clock()
        results = apply("bench", ops)
        cpu_s += clock() - started
        for op, result in zip(ops, results, strict=True):
            if not result.ok:
                raise RuntimeError(f"{op} ran out of blocks: raise num_blocks for this workload")
            if type(op) is AllocateOp:
                num_blocks_allocated += len(result.block_ids) - result.num_cached_tokens // config.block_size
            elif type(op) is AppendOp:
                num_blocks_allocated += len(result.block_ids) + len(result.copies)
        num_ops += len(ops)
    wall_s = time.perf_counter() - start_wall
    gc.unfreeze()
    manager.check_integrity()
    stats = manager.stats()
    if stats.num_sequences != 0 or stats.general.num_used_blocks != 0:
        raise RuntimeError("the workload left sequences behind")
    return BenchmarkResult(
        alloc_free_blocks_per_s=num_blocks_allocated / cpu_s,
        alloc_free_blocks_per_wall_s=num_blocks_allocated / wall_s,
        ops_per_s=num_ops / cpu_s,
        num_blocks_allocated=num_blocks_allocated,
        num_ops=num_ops,
        cpu_s=cpu_s,
        wall_s=wall_s,
        prefix_cache_hit_rate=stats.prefix_cache_hit_rate,
        num_evictions=stats.num_evictions,
    )


def run_inprocess_benchmark(
    num_sequences: int = 20_000,
    block_size: int = 16,
    enable_prefix_caching: bool = True,
    repeats: int = 3,
    seed: int = 0,
) -> float:
    """Blocks allocated and freed per CPU second by the block manager in-process (see the module docstring).

    Args:
        num_sequences: requests per run (20,000: about a second per run, plus a few to build the ops).
        block_size: tokens per block.
        enable_prefix_caching: the manager's setting.
        repeats: runs; the fastest counts.
        seed: seed of the workload.

    Returns:
        alloc_free_blocks_per_s.
    """
    result = run_benchmark(
        num_sequences=num_sequences,
        block_size=block_size,
        enable_prefix_caching=enable_prefix_caching,
        repeats=repeats,
        seed=seed,
    )
    return result.alloc_free_blocks_per_s


if __name__ == "__main__":
    for caching in (True, False):
        print(f"enable_prefix_caching={caching}")
        for name, value in vars(run_benchmark(enable_prefix_caching=caching, repeats=3)).items():
            print(f"  {name:>28}  {value:,.3f}" if isinstance(value, float) else f"  {name:>28}  {value:,}")
