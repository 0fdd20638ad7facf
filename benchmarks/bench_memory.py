"""Memory-service benchmark: in-process block manager throughput and batched-step RPC latency.

Prints a table, then as its last line one JSON object with ``alloc_free_blocks_per_s``,
``rpc_step_p50_us``, ``rpc_step_p99_us``, ``noop_rpc_p50_us`` and ``step_vs_noop_p50``.

    python -m benchmarks.bench_memory [--num-sequences 20000] [--num-seqs 64] [--iters 2000]

(from the repository root). The numbers are noisy on a shared machine: compare runs of one machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from benchmarks.block_manager_bench import run_inprocess_benchmark
from memory_service.api import AllocateOp, AppendOp, FreeOp, KvLayout, MemoryClient
from pagedserve.process import ServiceProcess


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bench_rpc(num_seqs: int, iters: int) -> dict[str, float]:
    socket = os.path.join(tempfile.mkdtemp(prefix="psbench-"), "memory.sock")
    args = ["--socket", socket, "--block-size", "16", "--max-num-blocks", "65536", "--log-level", "warning"]
    with ServiceProcess.launch("memory_service", args, address=f"unix:{socket}", ready_timeout_s=60):
        layout = KvLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_size=16)
        with MemoryClient(f"unix:{socket}", layout, "bench") as client:
            client.step([AllocateOp(f"s{i}", list(range(100 + i)), 1 << 20) for i in range(num_seqs)])
            step_us, noop_us = [], []
            for it in range(iters + 100):
                ops = [AppendOp(f"s{i}", [it % 1000]) for i in range(num_seqs)]
                t0 = time.perf_counter()
                client.step(ops)
                t1 = time.perf_counter()
                client.ping()
                t2 = time.perf_counter()
                if it >= 100:  # warm-up
                    step_us.append((t1 - t0) * 1e6)
                    noop_us.append((t2 - t1) * 1e6)
            client.step([FreeOp(f"s{i}") for i in range(num_seqs)])
    return {
        "rpc_step_p50_us": statistics.median(step_us),
        "rpc_step_p99_us": percentile(step_us, 0.99),
        "noop_rpc_p50_us": statistics.median(noop_us),
        "noop_rpc_p99_us": percentile(noop_us, 0.99),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-sequences", type=int, default=20_000, help="requests of the in-process run")
    parser.add_argument("--num-seqs", type=int, default=64, help="sequences grown per step RPC")
    parser.add_argument("--iters", type=int, default=2000, help="step RPCs timed")
    args = parser.parse_args()
    blocks_per_s = run_inprocess_benchmark(num_sequences=args.num_sequences)
    rpc = bench_rpc(args.num_seqs, args.iters)
    result = {
        "alloc_free_blocks_per_s": round(blocks_per_s),
        **{k: round(v, 1) for k, v in rpc.items()},
        "step_vs_noop_p50": round(rpc["rpc_step_p50_us"] / rpc["noop_rpc_p50_us"], 3),
        "num_seqs": args.num_seqs,
    }
    print(f"{'metric':<28}{'value':>14}")
    for key, value in result.items():
        print(f"{key:<28}{value:>14}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
