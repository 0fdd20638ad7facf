"""CPU attention of the fused path on the default model's shapes (`bench_kernels --cpu`).

SmolLM2-135M float32: 9 query heads, 3 KV heads, head dim 64, block size 16. Each case cycles
through enough per-layer pools that K/V come from memory, not the 32 MiB L3, as in a real step
(30 layers, each read once). Figures: best and median ms per layer call, effective GB/s (K/V bytes
the call must read / best time), and for fresh prompts ms per layer (x30) and GFLOP/s of the causal
attention (the FLOPs of the unmasked half of QK^T and PV).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from kernels.cpu_attention import CpuAttentionPlan

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
MIN_POOL_BYTES = 96 << 20  # K + V of all layer copies together: 3x the L3


def _time_ms(fn: Callable[[int], object], copies: int, iters: int) -> tuple[float, float]:
    """(median, best) ms of fn over iters calls. On a shared machine the best is what the code can
    do; the median also counts the time slices other processes took from its threads."""
    fn(0)
    times = []
    for i in range(iters):
        start = time.perf_counter()
        fn(i % copies)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), min(times)


def _paged_case(ctx_lens: list[int], q_lens: list[int], gen: torch.Generator):
    """Pools (as many copies as MIN_POOL_BYTES needs) and one plan over shuffled block tables."""
    blocks = [-(-s // BLOCK_SIZE) for s in ctx_lens]
    num_blocks = sum(blocks)
    block_bytes = 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 4
    copies = max(1, -(-MIN_POOL_BYTES // (num_blocks * block_bytes)))
    order = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    tables = torch.zeros(len(ctx_lens), max(blocks), dtype=torch.int32)
    start = 0
    for b, n in enumerate(blocks):
        tables[b, :n] = order[start:start + n]
        start += n
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    pools = [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)) for _ in range(copies)]
    num_tokens = sum(q_lens)
    slots = []
    for b, (s, q) in enumerate(zip(ctx_lens, q_lens)):
        slots += [int(tables[b, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in range(s - q, s)]
    cu = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    plan = CpuAttentionPlan.build(torch.tensor(slots), tables, torch.tensor(ctx_lens, dtype=torch.int32), cu,
                                  dtype=torch.float32, head_dim=HEAD_DIM)
    qkv = torch.randn(num_tokens, (NUM_Q_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, generator=gen)
    q, k, v = qkv.split([NUM_Q_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM], dim=-1)
    views = (q.view(num_tokens, NUM_Q_HEADS, HEAD_DIM), k.view(num_tokens, NUM_KV_HEADS, HEAD_DIM),
             v.view(num_tokens, NUM_KV_HEADS, HEAD_DIM))
    return plan, pools, views, copies


def bench_paged(ctx_lens: list[int], q_lens: list[int], gen: torch.Generator, iters: int) -> dict:
    plan, pools, (q, k, v), copies = _paged_case(ctx_lens, q_lens, gen)
    median, best = _time_ms(lambda i: plan.write_and_attend(q, k, v, *pools[i], HEAD_DIM**-0.5), copies, iters)
    kv_bytes = 2 * sum(ctx_lens) * NUM_KV_HEADS * HEAD_DIM * 4
    return {"ms": round(best, 4), "median_ms": round(median, 4), "gbps": round(kv_bytes / best / 1e6, 1)}


def bench_fresh(prompt_lens: list[int], gen: torch.Generator, iters: int) -> dict:
    """Fresh prompts (no cached context): one layer's write_and_attend."""
    plan, pools, (q, k, v), copies = _paged_case(prompt_lens, prompt_lens, gen)
    median, best = _time_ms(lambda i: plan.write_and_attend(q, k, v, *pools[i], HEAD_DIM**-0.5), copies, iters)
    causal_flops = sum(4 * NUM_Q_HEADS * HEAD_DIM * n * (n + 1) / 2 for n in prompt_lens)
    return {"ms": round(best, 3), "median_ms": round(median, 3), "ms_30_layers": round(30 * best, 1),
            "gflops": round(causal_flops / best / 1e6, 1)}


def run(quick: bool) -> dict:
    """All CPU cases; returns the summary (printed as the JSON line by bench_kernels)."""
    gen = torch.Generator().manual_seed(0)
    iters = 10 if quick else 30
    summary: dict = {"threads": torch.get_num_threads()}
    decode = [(8, 256), (48, 217), (64, 128), (8, 1024)] if quick else \
        [(8, 128), (8, 256), (8, 1024), (48, 217), (64, 128), (64, 512), (64, 1024), (1, 1024)]
    for batch, ctx in decode:
        lens = torch.randint(ctx // 2, 3 * ctx // 2 + 1, (batch,), generator=gen).tolist()  # mean ~ctx
        summary[f"decode_b{batch}_ctx{ctx}"] = bench_paged(lens, [1] * batch, gen, iters)
    summary["chunk_2x256_on_512_plus_16_decodes"] = bench_paged([768, 768] + [300] * 16, [256, 256] + [1] * 16,
                                                                gen, iters)
    mixed = [16, 512, 300, 64, 200, 480, 128, 348]  # 2048 tokens, as bench_throughput's prompts
    summary["fresh_8_prompts_2048_tokens"] = bench_fresh(mixed, gen, max(3, iters // 3))
    summary["fresh_1x2048"] = bench_fresh([2048], gen, max(3, iters // 5))
    summary["fresh_16x16"] = bench_fresh([16] * 16, gen, iters)
    return summary
