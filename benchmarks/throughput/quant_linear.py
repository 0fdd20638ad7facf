"""The quantized linear (csrc/quant_linear.h) against the bf16 paths, on a 1.5B model's shapes.

Qwen2.5-1.5B's projections (qkv 2048 x 1536, o 1536 x 1536, gate_up 17920 x 1536, down 1536 x 8960),
`--layers` layers' worth of copies so the weights come from memory as in a decode step, at each
`--rows`: bf16 through the model's own path (`cpu_linear.linear`: the small-batch kernel up to 16 rows,
on AMX tiles where the CPU has them, oneDNN past them), int8 (groups of 128, as quantized at load), int4
(groups of 32 with mins), and the K-quants' forms: Q4_K's (4-bit, groups of 32 with mins, each scale and
min a multiple of a float16 per 256 inputs) with float16 scales ("q4k") and compact ("q4k_compact"),
Q6_K's (6-bit, a scale per 16) at 6 bits with float16 scales ("q6"), compact ("q6_compact") and as int8
("q6_as8", how it was held before), each on AMX tiles where the CPU has them and with AVX512-BF16 dot
products (or, from 3 rows on without AMX, int8 activations on VNNI: `PAGEDSERVE_CPU_QUANT_VNNI=0` for
the bf16 paths and oneDNN, as an A/B). Figures:
the best of `--repeats` passes over all copies, wall ms per layer (all threads), and the weights'
GB/s at that time.

    python -m benchmarks.throughput.quant_linear [--rows 1 4 16 64 512] [--layers 4]

The last line is one JSON object: {"cpu": ..., "threads": ..., "m<rows>": {"bf16_ms": ..., "int8_ms":
..., "int4_ms": ..., "int8_dots_ms": ..., "int4_dots_ms": ..., "q6_dots_ms": ..., "*_gbps": ...}, ...}.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

import pagedserve_kernels as kernels
from benchmarks.cpu_info import cpu_name
from pagedserve_kernels import cpu_linear, quant

SHAPES = {"qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (17920, 1536), "down": (1536, 8960)}
SCHEMES = ("int8", "int4", "q4k", "q4k_compact", "q6", "q6_compact", "q6_as8")


def k_quant_form(weight: torch.Tensor, bits: int, compact: bool, as_bits: int | None = None) -> quant.QuantizedWeight:
    """`weight` as a K-quant holds one: per 256 inputs a float16 d (and dmin), per group (Q6_K: 16, no
    min, q in -32..31, sc in -128..127; Q4_K: 32, q in 0..15, sc and m in 0..63) scale d * sc and min
    -dmin * m; packed at `as_bits` (default `bits`), compact or with float16 scales."""
    out, inputs = weight.shape
    group, top = (16, 127) if bits == 6 else (32, 63)
    groups = weight.view(out, inputs // group, group)
    per = quant.SUPERBLOCK // group
    if bits == 6:
        wanted, minimum, dmin = groups.abs().amax(dim=-1) / 31, None, None
    else:
        low = groups.amin(dim=-1).clamp(max=0)
        wanted = (groups.amax(dim=-1) - low) / 15
        dmin = ((-low).view(out, -1, per).amax(dim=-1) / top).half().float().clamp_min(2.0**-14)
        minimum = -torch.round(-low / dmin.repeat_interleave(per, 1)) * dmin.repeat_interleave(per, 1)
    d = (wanted.view(out, -1, per).amax(dim=-1) / top).half().float().clamp_min(2.0**-14)
    scale = torch.round(wanted / d.repeat_interleave(per, 1)).clamp_(1, top) * d.repeat_interleave(per, 1)
    offset = 0.0 if minimum is None else minimum[..., None]
    q = torch.round((groups - offset) / scale[..., None])
    q = (q.clamp_(-32, 31) if bits == 6 else q.clamp_(0, 15)).view(out, inputs)
    factors = (d, None if dmin is None else -dmin) if compact else (None, None)
    return quant.pack(q, scale, minimum, as_bits or bits, *factors)


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 512])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    generator = torch.Generator().manual_seed(0)
    small_rows = kernels.small_rows(torch.bfloat16)
    layers = []
    for _ in range(args.layers):
        layer = {}
        for name, (out, inputs) in SHAPES.items():
            weight = torch.randn(out, inputs, generator=generator) / inputs**0.5
            bf16 = weight.bfloat16()
            layer[name] = {"bf16": (kernels.small_weight(bf16), kernels.prepack(bf16)),
                           "int8": quant.quantize(weight, "int8"), "int4": quant.quantize(weight, "int4"),
                           "q4k": k_quant_form(weight, 4, False), "q4k_compact": k_quant_form(weight, 4, True),
                           "q6": k_quant_form(weight, 6, False), "q6_compact": k_quant_form(weight, 6, True),
                           "q6_as8": k_quant_form(weight, 6, False, 8)}
        layers.append(layer)
    bytes_per_layer = {"bf16": sum(2 * o * i for o, i in SHAPES.values()),
                       **{scheme: sum(w[scheme].nbytes for w in layers[0].values()) for scheme in SCHEMES}}
    tiles = quant.tiles()
    summary: dict = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "amx_tiles": tiles,
                     "layers": args.layers, "bytes_per_layer": bytes_per_layer}
    ops = torch.ops.pagedserve_cpu
    suffixes = ("", "_dots") if tiles else ("_dots",)
    columns = ["bf16"] + [f"{scheme}{suffix}" for suffix in suffixes for scheme in SCHEMES]
    print(f"{'rows':>5} " + " ".join(f"{c.replace('_dots', ' dots'):>14}" for c in columns) + "   ms/layer (GB/s)")
    for rows in args.rows:
        xs = {name: torch.randn(rows, inputs, generator=generator).bfloat16() for name, (_, inputs) in SHAPES.items()}

        def bf16_pass(xs: dict = xs) -> None:
            for layer in layers:
                for name, entry in layer.items():
                    small, packed = entry["bf16"]
                    cpu_linear.linear(xs[name], small, packed, None, small_rows)

        def quant_pass(scheme: str, on_tiles: bool, xs: dict = xs) -> Callable[[], None]:
            def run() -> None:
                for layer in layers:
                    for name, entry in layer.items():
                        w = entry[scheme]
                        ops.quant_linear(xs[name], w.q, w.scales, w.mins, None, w.bits, w.group, w.out_features,
                                         on_tiles, False)
            return run

        row: dict = {"bf16_ms": best_ms(bf16_pass, args.repeats) / args.layers}
        for scheme in SCHEMES:
            if tiles:
                row[f"{scheme}_ms"] = best_ms(quant_pass(scheme, True), args.repeats) / args.layers
            row[f"{scheme}_dots_ms"] = best_ms(quant_pass(scheme, False), args.repeats) / args.layers
        for key in list(row):
            scheme = key.removesuffix("_ms").removesuffix("_dots")
            row[key] = round(row[key], 3)
            row[key.replace("_ms", "_gbps")] = round(bytes_per_layer[scheme] / row[key] / 1e6, 2)
        summary[f"m{rows}"] = row
        cells = [f"{row.get(k + '_ms', float('nan')):7.2f} ({row.get(k + '_gbps', float('nan')):5.1f})"
                 for k in columns]
        print(f"{rows:>5} " + " ".join(f"{c:>14}" for c in cells))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
