"""The small-batch linear's three paths on the default model's shapes, bf16, rows 1-32.

For each projection of SmolLM2-135M (qkv 960 x 576, o 576 x 576, gate_up 3072 x 576, down 576 x 1536,
30 layers' worth of copies so the weights come from memory, as in a decode step) and its LM head
(49152 x 576): oneDNN's packed matmul (bf16 outputs), the AVX512-BF16 dot-product kernel on the plain
weight and, where the CPU has AMX, the tiles (ATen's brgemm on the weight packed by `brgemm_pack`),
both with float32 outputs (kernels/pagedserve_kernels/cpu_linear.py). Figures: the best of
`--repeats` calls' thread CPU time in ms (one thread by default: a shared machine's other processes
then cost the figure little), and the weight's GB/s at that time.

    python -m benchmarks.throughput.linear_paths [--rows 1 2 4 8 16 32] [--threads 1]

The last line is one JSON object: {"cpu": ..., "amx": ..., "<shape>_m<rows>": {"onednn_ms": ...,
"dot_ms": ..., "tiles_ms": ..., "tiles_vs_onednn": ...}, ...}.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

import pagedserve_kernels as kernels
from benchmarks.cpu_info import cpu_name
from pagedserve_kernels import cpu_linear, cpu_ops

SHAPES = {"qkv": (960, 576, 30), "o": (576, 576, 30), "gate_up": (3072, 576, 30), "down": (576, 1536, 30),
          "lm_head": (49152, 576, 1)}  # (out, in, copies)


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    return min(times) * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    ops = cpu_ops.load()
    if ops is None or ops.small_linear_rows() == 0:
        raise SystemExit("linear_paths: needs the fused CPU kernels built with AVX512-BF16")
    tiles_here = cpu_linear.amx() and ops.brgemm_linear_available()
    summary: dict = {"cpu": cpu_name(), "amx": tiles_here, "threads": args.threads}
    generator = torch.Generator().manual_seed(0)
    print(f"{'shape':<8} {'rows':>4} {'onednn':>9} {'dot':>9} {'tiles':>9}   ms (weight GB/s)")
    for name, (out, inputs, copies) in SHAPES.items():
        weights = [(torch.randn(out, inputs, generator=generator) / inputs**0.5).bfloat16() for _ in range(copies)]
        packed = [kernels.prepack(w) for w in weights]
        tiles = [ops.brgemm_pack(w) for w in weights] if tiles_here else []
        gigabytes = copies * out * inputs * 2 / 1e9
        for rows in args.rows:
            x = torch.randn(rows, inputs, generator=generator).bfloat16()
            paths = {"onednn_ms": [(kernels.linear, w, p) for w, p in zip(weights, packed)],
                     "dot_ms": [(ops.small_linear_float, w, None) for w in weights]}
            if tiles:
                paths["tiles_ms"] = [(ops.small_linear_float, t, None) for t in tiles]
            row = {key: best_ms(lambda calls=calls, x=x: [fn(x, w, p) for fn, w, p in calls], args.repeats)
                   for key, calls in paths.items()}
            if tiles:
                row["tiles_vs_onednn"] = round(row["onednn_ms"] / row["tiles_ms"], 2)
            cells = [f"{row[k]:6.2f} ({gigabytes / row[k] * 1e3:4.1f})" if k in row else "-"
                     for k in ("onednn_ms", "dot_ms", "tiles_ms")]
            print(f"{name:<8} {rows:>4} " + " ".join(f"{c:>9}" for c in cells))
            summary[f"{name}_m{rows}"] = {k: round(v, 3) for k, v in row.items()}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
