"""The weight-read floor of one decode step: the bytes of weights a step must read, over the
machine's memory read bandwidth.

At one sequence a decode step reads every projection weight once (and the embedding matrix again as
the tied lm_head; the embedding lookup itself reads one row) and does little else, so no engine can
make a step faster than ``weight bytes / read bandwidth``: the TPOT floor the serving goal is set
against ("within 2x of the bf16 weight-read floor").

Read bandwidth: ``torch.sum`` over blocks of a float32 tensor (default 1 GiB), each block 4x the
last-level cache, the fastest block of ``--repeats`` passes (read_gbps), at each thread count of
``--threads``; a copy (read and write) is reported beside it. Weight bytes: the model's tensors as
stored in its safetensors files, at ``--dtype``'s width (the embedding counted once, as the lm_head
read, when tied).

    python -m benchmarks.throughput.weight_floor [--model default] [--dtype bfloat16] [--gib 1]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from compute_service.model.model_loader import resolve_model
from pagedserve.dtypes import DTYPES

BLOCK_BYTES = 128 << 20


def read_gbps(num_bytes: int, threads: int, repeats: int) -> dict:
    """Best read (sum) and copy bandwidth, GB/s (10^9 bytes): each pass over a tensor of
    ``num_bytes`` one block of ``BLOCK_BYTES`` at a time (4x this machine's 32 MiB L3), each block
    timed alone and the fastest kept, so that a block that ran while another process held the CPU
    (the machine is shared) does not count."""
    torch.set_num_threads(threads)
    x = torch.ones(max(num_bytes, BLOCK_BYTES) // 4, dtype=torch.float32)
    y = torch.empty_like(x)
    blocks = list(zip(x.split(BLOCK_BYTES // 4), y.split(BLOCK_BYTES // 4)))
    best_sum = best_copy = float("inf")
    for _ in range(repeats):
        for src, dst in blocks:
            started = time.perf_counter()
            src.sum()
            best_sum = min(best_sum, time.perf_counter() - started)
            started = time.perf_counter()
            dst.copy_(src)
            best_copy = min(best_copy, time.perf_counter() - started)
    return {"threads": threads, "read_gbps": round(BLOCK_BYTES / best_sum / 1e9, 1),
            "copy_gbps": round(2 * BLOCK_BYTES / best_copy / 1e9, 1)}  # copy: read + write


def weight_bytes(model_dir, itemsize: int) -> dict:
    """Parameters a decode step reads (and all of them), from the safetensors headers: a converted
    GGUF's quantized matrices from their integers' shapes (one integer a weight)."""
    from safetensors import safe_open

    from compute_service.model.gguf_file import QUANTIZED_FILE

    shapes = {}
    for path in sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob(QUANTIZED_FILE)):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                if path.name != QUANTIZED_FILE:
                    shapes[name] = f.get_slice(name).get_shape()
                elif name.endswith(".q"):
                    shapes[name.removesuffix(".q")] = f.get_slice(name).get_shape()
    numel = {name: int(torch.Size(shape).numel()) for name, shape in shapes.items()}
    total = sum(numel.values())
    tied = not any(name.endswith("lm_head.weight") for name in numel)
    # Untied: the step reads lm_head, and only one row of the embedding; tied: the embedding once, as lm_head.
    read = total - (0 if tied else sum(n for name, n in numel.items() if name.endswith("embed_tokens.weight")))
    return {"params": total, "params_read_per_step": read, "tied_embeddings": tied,
            "bytes_read_per_step": read * itemsize}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--gib", type=float, default=1.0, help="tensor size for the bandwidth pass")
    parser.add_argument("--threads", type=int, nargs="+", default=None, help="default: 1 and every CPU")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    cpus = len(os.sched_getaffinity(0))
    threads = args.threads or sorted({1, cpus})
    load = round(os.getloadavg()[0], 2)
    bandwidth = [read_gbps(int(args.gib * (1 << 30)), t, args.repeats) for t in threads]
    source = resolve_model(args.model)
    weights = weight_bytes(source.path, DTYPES[args.dtype].itemsize)
    best = max(b["read_gbps"] for b in bandwidth)
    floor_ms = weights["bytes_read_per_step"] / (best * 1e9) * 1e3
    summary = {"model": source.path.name, "dtype": args.dtype, **weights,
               "bandwidth": bandwidth, "best_read_gbps": best, "tpot_floor_ms": round(floor_ms, 2),
               "tpot_2x_floor_ms": round(2 * floor_ms, 2), "load_avg_start": load,
               "load_avg_end": round(os.getloadavg()[0], 2)}
    for b in bandwidth:
        print(f"{b['threads']} thread(s): read {b['read_gbps']} GB/s, copy {b['copy_gbps']} GB/s")
    print(f"{summary['model']} in {args.dtype}: {weights['bytes_read_per_step'] / 1e6:.1f} MB read per decode step; "
          f"floor {floor_ms:.2f} ms per token at {best} GB/s")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
