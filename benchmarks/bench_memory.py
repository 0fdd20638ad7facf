"""Memory-service benchmark: in-process block manager throughput and batched-step RPC latency.

Prints a table, then as its last line one JSON object with ``alloc_free_blocks_per_s``,
``rpc_step_p50_us``, ``rpc_step_p99_us``, ``noop_rpc_p50_us`` and ``step_vs_noop_p50``.

    python -m benchmarks.bench_memory [--num-sequences 20000] [--num-seqs 64] [--iters 2000]
                                      [--step-batch-sizes 8,32,64,128,256]

(from the repository root). The numbers are noisy on a shared machine: compare runs of one machine.

``--step-batch-sizes`` adds ``step_share``: per batch size, the step RPC of that many one-token
AppendOps (``rpc_step_p50_us``, as above) and a decode step of the default model at that batch
(``decode_step_ms``, from ``decode_step_timing``, with the RPC time the engine itself spent a step:
``engine_rpc_us``, and how many of its steps sent one: ``engine_rpcs_per_step``, below 1 since
decodes within their blocks send none), and the RPC's share of the step both ways (``rpc_share``:
had every step sent one, ``engine_rpc_share``: as the engine sends them). It loads the model: a minute or two on a CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from benchmarks.memory.block_manager_bench import run_inprocess_benchmark
from memory_service.api import AllocateOp, AppendOp, FreeOp, KvLayout, MemoryClient
from pagedserve.log import configure_logging
from pagedserve.process import ServiceProcess


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def parse_batch_sizes(text: str) -> list[int]:
    """``"8,32,64"`` -> ``[8, 32, 64]``; each >= 1 (argparse type)."""
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not sizes or any(size < 1 for size in sizes):
        raise argparse.ArgumentTypeError(f"batch sizes must be >= 1, got {text!r}")
    return sizes


def step_share(batch_sizes: list[int], iters: int, model: str = "default") -> list[dict[str, float]]:
    """The step RPC at each batch size against a decode step of a model at that batch.

    Args:
        batch_sizes: sequences per step.
        iters: step RPCs timed per batch size.
        model: the model of the decode steps ("default" or a local directory).

    Returns:
        One row per batch size (see the module docstring).
    """
    from benchmarks.throughput.decode_step_timing import time_decode_steps  # loads torch and the model

    rpc_p50_us = [bench_rpc(num_seqs, iters)["rpc_step_p50_us"] for num_seqs in batch_sizes]
    rows = []
    for rpc_us, timing in zip(rpc_p50_us, time_decode_steps(batch_sizes, model), strict=True):
        rows.append({
            "num_seqs": timing.num_seqs,
            "rpc_step_p50_us": round(rpc_us, 1),
            "engine_rpc_us": round(timing.engine_rpc_us, 1),
            "engine_rpcs_per_step": round(timing.rpcs_per_step, 3),
            "decode_step_ms": round(timing.decode_step_ms, 2),
            "rpc_share": round(rpc_us / (timing.decode_step_ms * 1000), 5),
            "engine_rpc_share": round(timing.engine_rpc_share, 5),
        })
    return rows


def bench_rpc(num_seqs: int, iters: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="psbench-") as directory:  # removed afterwards, socket and all
        return _bench_rpc(os.path.join(directory, "memory.sock"), num_seqs, iters)


def _bench_rpc(socket: str, num_seqs: int, iters: int) -> dict[str, float]:
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


def main(argv: list[str] | None = None) -> None:
    """Run with ``argv`` (default: the command line's arguments)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_memory", description=__doc__.splitlines()[0])
    parser.add_argument("--num-sequences", type=int, default=20_000, help="requests of the in-process run")
    parser.add_argument("--num-seqs", type=int, default=64, help="sequences grown per step RPC")
    parser.add_argument("--iters", type=int, default=2000, help="step RPCs timed")
    parser.add_argument("--step-batch-sizes", type=parse_batch_sizes, default=None,
                        help="comma-separated batch sizes: compare the step RPC with a decode step at each")
    parser.add_argument("--model", default="default", help="model of the decode steps: 'default' or a local directory")
    parser.add_argument("--skip-inprocess", action="store_true", help="leave out the in-process alloc+free run")
    args = parser.parse_args(argv)
    configure_logging("warning")  # the engine logs every finished request at "info"
    result: dict[str, object] = {}
    if not args.skip_inprocess:
        result["alloc_free_blocks_per_s"] = round(run_inprocess_benchmark(num_sequences=args.num_sequences))
    rpc = bench_rpc(args.num_seqs, args.iters)
    result |= {
        **{k: round(v, 1) for k, v in rpc.items()},
        "step_vs_noop_p50": round(rpc["rpc_step_p50_us"] / rpc["noop_rpc_p50_us"], 3),
        "num_seqs": args.num_seqs,
    }
    print(f"{'metric':<28}{'value':>14}")
    for key, value in result.items():
        print(f"{key:<28}{value:>14}")
    if args.step_batch_sizes:
        result["step_share"] = rows = step_share(args.step_batch_sizes, max(50, args.iters // 10), args.model)
        print(f"\n{'num_seqs':>9}{'rpc p50 us':>12}{'engine rpc us':>15}{'decode ms':>11}{'rpc share':>11}"
              f"{'engine share':>14}")
        for row in rows:
            print(f"{row['num_seqs']:>9}{row['rpc_step_p50_us']:>12}{row['engine_rpc_us']:>15}{row['decode_step_ms']:>11}"
                  f"{row['rpc_share']:>11.2%}{row['engine_rpc_share']:>14.2%}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
