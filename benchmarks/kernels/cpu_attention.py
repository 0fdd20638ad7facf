"""CPU attention of the fused path on the default model's shapes (`bench_kernels --cpu`).

SmolLM2-135M, float32 or bfloat16 (`--dtype`): 9 query heads, 3 KV heads, head dim 64, block size 16;
`--shape qwen2.5-1.5b`: the 1.5B GGUF's 12 query heads, 2 KV heads (groups of 6), head dim 128; the
`gqa*` shapes: 32 query heads in groups of 4 or 8.
Each case cycles through enough per-layer pools (3x this CPU's L3, read from sysfs) that K/V come
from memory, not the cache, as in a real step (30 layers, each read once). Per case, in the same
run: the fused path's `write_and_attend` (K/V write + `paged_attention`), the portable kernel on the
same data (`vs_portable`: its time over the fused path's), and for fresh prompts PyTorch's causal
SDPA as the path used it before (K/V expanded per query head, per-prompt transposed copies;
`vs_sdpa`). Figures: best ms per layer call (on a
shared machine the best is what the code can do; the median also counts time slices other
processes took), effective GB/s (K/V bytes the call must read / best time), GFLOP/s of the causal
attention for prompts; `read_gbps` is torch's sum over 512 MiB in the same run, the bandwidth bound.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedserve_kernels.cpu_attention import CpuAttentionPlan

BLOCK_SIZE = 16


@dataclass(frozen=True)
class Shape:
    """A model's attention heads: query heads, KV heads (num_q_heads / num_kv_heads to a group), head dim."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5


# The two models we serve, and groups of 4 and 8 (Llama-3-8B-like, 70B-like) for where the decode tiles pay.
SHAPES = {"smollm2": Shape(9, 3, 64), "qwen2.5-1.5b": Shape(12, 2, 128), "gqa4-d64": Shape(32, 8, 64),
          "gqa4-d128": Shape(32, 8, 128), "gqa8-d128": Shape(32, 4, 128)}


def l3_bytes() -> int:
    """This CPU's last-level cache (sysfs; 32 MiB where it does not say)."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        sizes.append(int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size))
    return max(sizes, default=32 << 20)


def _time_ms(fn: Callable[[int], object], copies: int, iters: int) -> tuple[float, float]:
    """(best, median) ms of fn(i) over iters calls, i cycling through the pool copies."""
    fn(0)
    times = []
    for i in range(iters):
        start = time.perf_counter()
        fn(i % copies)
        times.append((time.perf_counter() - start) * 1e3)
    return min(times), statistics.median(times)


def read_gbps() -> float:
    x = torch.ones(128 << 20)  # 512 MiB
    best, _ = _time_ms(lambda i: x.sum(), 1, 5)
    return x.numel() * 4 / best / 1e6


class Case:
    """Pools (as many copies as 3x the L3 needs), shuffled block tables, the step's QKV."""

    def __init__(self, ctx_lens: list[int], q_lens: list[int], gen: torch.Generator,
                 dtype: torch.dtype = torch.float32, shape: Shape = SHAPES["smollm2"]) -> None:
        self.shape = shape
        blocks = [-(-s // BLOCK_SIZE) for s in ctx_lens]
        num_blocks = sum(blocks)
        self.itemsize = dtype.itemsize
        block_bytes = 2 * BLOCK_SIZE * shape.num_kv_heads * shape.head_dim * self.itemsize
        self.copies = max(1, -(-3 * l3_bytes() // (num_blocks * block_bytes)))
        order = torch.randperm(num_blocks, generator=gen).to(torch.int32)
        tables = torch.zeros(len(ctx_lens), max(blocks), dtype=torch.int32)
        start = 0
        for b, n in enumerate(blocks):
            tables[b, :n] = order[start:start + n]
            start += n
        dims = (num_blocks, BLOCK_SIZE, shape.num_kv_heads, shape.head_dim)
        self.pools = [(torch.randn(dims, generator=gen).to(dtype), torch.randn(dims, generator=gen).to(dtype))
                      for _ in range(self.copies)]
        slots = [int(tables[b, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
                 for b, (s, q) in enumerate(zip(ctx_lens, q_lens)) for p in range(s - q, s)]
        cu = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
        self.plan = CpuAttentionPlan.build(torch.tensor(slots), tables, torch.tensor(ctx_lens, dtype=torch.int32),
                                           cu, dtype=dtype, head_dim=shape.head_dim)
        if self.plan is None:
            raise RuntimeError("the fused CPU kernels are unavailable here")
        num_tokens = sum(q_lens)
        hq, hkv, d = shape.num_q_heads, shape.num_kv_heads, shape.head_dim
        qkv = torch.randn(num_tokens, (hq + 2 * hkv) * d, generator=gen).to(dtype)
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        self.q = q.view(num_tokens, hq, d)
        self.k = k.view(num_tokens, hkv, d)
        self.v = v.view(num_tokens, hkv, d)
        self.ctx_lens, self.q_lens = ctx_lens, q_lens

    def fused(self, i: int) -> torch.Tensor:
        return self.plan.write_and_attend(self.q, self.k, self.v, *self.pools[i], self.shape.scale)

    def portable(self, i: int) -> torch.Tensor:
        out = torch.empty(self.q.shape, dtype=self.q.dtype)
        plan = self.plan
        plan.ops.paged_attention_portable(out, self.q.contiguous(), *self.pools[i], plan.block_tables, plan.seq_lens,
                                          plan.cu_seqlens_q, plan.seq_ids, self.shape.scale)
        return out

    def sdpa(self, i: int) -> torch.Tensor:
        """Fresh prompts as the fused path attended to them before: SDPA per prompt on expanded K/V."""
        group = self.shape.num_q_heads // self.shape.num_kv_heads
        out = torch.empty(self.q.shape, dtype=self.q.dtype)
        start = 0
        for n in self.q_lens:
            rows = slice(start, start + n)
            q = self.q[rows].transpose(0, 1).contiguous()[None]
            k = self.k[rows].repeat_interleave(group, dim=1).transpose(0, 1).contiguous()[None]
            v = self.v[rows].repeat_interleave(group, dim=1).transpose(0, 1).contiguous()[None]
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.shape.scale)
            out[rows] = attended[0].transpose(0, 1)
            start += n
        return out

    def measure(self, iters: int, fresh: bool = False) -> dict:
        best, median = _time_ms(self.fused, self.copies, iters)
        portable, _ = _time_ms(self.portable, self.copies, iters)
        kv_bytes = 2 * sum(self.ctx_lens) * self.shape.num_kv_heads * self.shape.head_dim * self.itemsize
        result = {"ms": round(best, 4), "median_ms": round(median, 4), "gbps": round(kv_bytes / best / 1e6, 1),
                  "vs_portable": round(portable / best, 2)}
        if fresh:
            sdpa, _ = _time_ms(self.sdpa, self.copies, iters)
            flops = sum(4 * self.shape.num_q_heads * self.shape.head_dim * n * (n + 1) / 2 for n in self.q_lens)
            result.update(ms_30_layers=round(30 * best, 1), gflops=round(flops / best / 1e6, 1),
                          vs_sdpa=round(sdpa / best, 2))
            del result["gbps"]
        return result


def run(quick: bool, dtype: torch.dtype = torch.float32, shape_name: str = "smollm2") -> dict:
    """All CPU cases; returns the summary (printed as the JSON line by bench_kernels).

    `decode_b32_ctx600` is the decode-attention goal's case: its `read_share` is its effective
    GB/s over the machine's read bandwidth measured in the same run.
    """
    shape = SHAPES[shape_name]
    gen = torch.Generator().manual_seed(0)
    iters = 10 if quick else 30
    bandwidth = read_gbps()
    summary: dict = {"threads": torch.get_num_threads(), "dtype": str(dtype).removeprefix("torch."),
                     "shape": shape_name, "l3_mib": l3_bytes() >> 20, "read_gbps": round(bandwidth, 1)}
    decode = [(8, 256), (16, 600), (32, 600), (48, 217), (64, 1024)] if quick else \
        [(1, 1024), (8, 128), (8, 256), (8, 1024), (16, 600), (32, 600), (48, 217), (64, 128), (64, 512), (64, 1024)]
    for batch, ctx in decode:
        lens = torch.randint(ctx // 2, 3 * ctx // 2 + 1, (batch,), generator=gen).tolist()  # mean ~ctx
        summary[f"decode_b{batch}_ctx{ctx}"] = Case(lens, [1] * batch, gen, dtype, shape).measure(iters)
    summary["decode_b32_ctx600"]["read_share"] = round(summary["decode_b32_ctx600"]["gbps"] / bandwidth, 3)
    lens = torch.randint(108, 326, (48,), generator=gen).tolist()  # speculative verification: 4 positions each
    summary["verify_q4_b48_ctx217"] = Case(lens, [4] * 48, gen, dtype, shape).measure(iters)
    # 2 chunks over 512 cached tokens, and 16 decodes
    chunk = Case([768, 768] + [300] * 16, [256, 256] + [1] * 16, gen, dtype, shape)
    summary["chunks_2x256_on_512_and_16_decodes"] = chunk.measure(iters)
    mixed = [16, 512, 300, 64, 200, 480, 128, 348]  # 2048 tokens, as bench_throughput's prompts (16-512)
    summary["fresh_8_prompts_2048_tokens"] = Case(mixed, mixed, gen, dtype, shape).measure(max(3, iters // 3),
                                                                                          fresh=True)
    summary["fresh_1x2048"] = Case([2048], [2048], gen, dtype, shape).measure(max(3, iters // 5), fresh=True)
    summary["fresh_16x16"] = Case([16] * 16, [16] * 16, gen, dtype, shape).measure(iters, fresh=True)
    return summary
