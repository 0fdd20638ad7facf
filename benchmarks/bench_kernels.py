"""Benchmark of the Triton paged-attention kernels (needs CUDA; exits with status 2 elsewhere).

Decode at batch 1, 8, 64, 256 x context 512, 2k, 8k and chunked-prefill cases, bf16, 32 query
heads, 8 KV heads (GQA 4), head dim 128, block size 16 and 32, block tables shuffled. For each:
median kernel time (CUDA events, L2 flushed before every run), bytes of K/V read, achieved GB/s,
its fraction of the device-to-device copy bandwidth measured in the same run, and the speed ratio
to torch SDPA on the same data laid out contiguously (>1: paged attention is faster).

Prints a table, then as its last line one JSON object:
  decode_b64_ctx2k_gbps, decode_b64_ctx2k_frac_of_copy_bw, decode_b64_ctx2k_vs_sdpa (block size 16),
  block16_vs_block32 (GB/s at block 16 over GB/s at block 32, decode b64 ctx2k), copy_gbps, ...

With --cpu it benchmarks the fused CPU attention instead (benchmarks/kernels/cpu_attention.py: the
default model's shapes, float32 or --dtype bfloat16; decode GB/s and its share of the machine's read
bandwidth, chunked prefill, fresh prompts) and prints its JSON line.

Usage, from the repository root (``python benchmarks/bench_kernels.py`` where the package is
installed):
  python -m benchmarks.bench_kernels [--quick] [--cpu [--threads N] [--dtype bfloat16] [--shape qwen2.5-1.5b]]
"""

import argparse
import functools
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE = torch.bfloat16
BYTES = 2  # bf16


@dataclass
class Result:
    name: str
    block_size: int
    ms: float
    kv_bytes: int
    sdpa_ms: float | None

    @property
    def gbps(self) -> float:
        return self.kv_bytes / self.ms / 1e6


def time_ms(fn: Callable[[], object], flush: torch.Tensor, warmup: int = 3, iters: int = 20) -> float:
    """Median time of fn in ms from CUDA events; the L2 cache is flushed before each run."""
    for _ in range(warmup):
        fn()
    events = []
    for _ in range(iters):
        flush.zero_()  # also keeps the GPU busy while the host launches fn
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def copy_bandwidth_gbps(flush: torch.Tensor) -> float:
    """Device-to-device copy bandwidth (bytes read + bytes written per second) of a 1 GiB buffer."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), flush)
    return 2 * src.numel() / ms / 1e6


def paged_inputs(ctx_lens: list[int], q_lens: list[int], block_size: int, gen: torch.Generator):
    """A pool holding exactly these sequences, blocks assigned in a random order.

    Returns (query (T, H_q, D), k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q).
    """
    blocks_per_seq = [-(-s // block_size) for s in ctx_lens]
    num_blocks = sum(blocks_per_seq)
    order = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32)
    block_tables = torch.zeros(len(ctx_lens), max(blocks_per_seq), dtype=torch.int32, device="cuda")
    start = 0
    for b, n in enumerate(blocks_per_seq):
        block_tables[b, :n] = order[start:start + n]
        start += n
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, dtype=DTYPE, device="cuda", generator=gen)
    v_cache = torch.randn(shape, dtype=DTYPE, device="cuda", generator=gen)
    query = torch.randn(sum(q_lens), NUM_Q_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda", generator=gen)
    seq_lens = torch.tensor(ctx_lens, dtype=torch.int32, device="cuda")
    cu = torch.tensor([0] + q_lens, dtype=torch.int32, device="cuda").cumsum(0).to(torch.int32)
    return query, k_cache, v_cache, block_tables, seq_lens, cu


def contiguous_kv(cache: torch.Tensor, block_tables: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The same K (or V) laid out contiguously: (B, H_kv, S, D)."""
    gathered = cache[block_tables.long()]  # (B, nb, bs, H_kv, D)
    return gathered.flatten(1, 2)[:, :seq_len].transpose(1, 2).contiguous()


def fits(batch: int, ctx: int, free_bytes: int) -> bool:
    """Paged K/V + a contiguous copy for SDPA + headroom must fit in free memory."""
    kv = 2 * batch * ctx * NUM_KV_HEADS * HEAD_DIM * BYTES
    return 2.2 * kv < 0.8 * free_bytes


def bench_decode(batch: int, ctx: int, block_size: int, flush: torch.Tensor, gen: torch.Generator) -> Result:
    from pagedserve_kernels import paged_attention

    args = paged_inputs([ctx] * batch, [1] * batch, block_size, gen)
    query, k_cache, v_cache, block_tables = args[:4]
    ms = time_ms(functools.partial(paged_attention, *args), flush)  # bound now: `args` is deleted below
    k = contiguous_kv(k_cache, block_tables, ctx)  # (B, H_kv, S, D)
    v = contiguous_kv(v_cache, block_tables, ctx)
    del k_cache, v_cache, args
    q = query.view(batch, NUM_KV_HEADS, NUM_Q_HEADS // NUM_KV_HEADS, HEAD_DIM)  # (B, H_kv, G, D): no K/V copies
    sdpa_ms = time_ms(lambda: F.scaled_dot_product_attention(q, k, v), flush)
    kv_bytes = 2 * batch * ctx * NUM_KV_HEADS * HEAD_DIM * BYTES
    return Result(f"decode b{batch} ctx{ctx}", block_size, ms, kv_bytes, sdpa_ms)


def bench_chunked_prefill(num_seqs: int, cached: int, chunk: int, num_decodes: int, block_size: int,
                          flush: torch.Tensor, gen: torch.Generator) -> Result:
    """num_seqs chunks of `chunk` new tokens on `cached` tokens, plus num_decodes decodes at `cached`."""
    from torch.nn.attention.bias import causal_lower_right

    from pagedserve_kernels import paged_attention

    ctx_lens = [cached + chunk] * num_seqs + [cached] * num_decodes
    q_lens = [chunk] * num_seqs + [1] * num_decodes
    args = paged_inputs(ctx_lens, q_lens, block_size, gen)
    query, k_cache, v_cache, block_tables = args[:4]
    ms = time_ms(functools.partial(paged_attention, *args), flush)  # bound now: `args` is deleted below
    sdpa_ms = None
    if num_decodes == 0:  # SDPA on contiguous tensors only for the uniform batch
        k = contiguous_kv(k_cache, block_tables, cached + chunk)  # (B, H_kv, S, D)
        v = contiguous_kv(v_cache, block_tables, cached + chunk)
        q = query.view(num_seqs, chunk, NUM_Q_HEADS, HEAD_DIM).transpose(1, 2)  # (B, H_q, chunk, D)
        mask = causal_lower_right(chunk, cached + chunk)
        try:
            sdpa_ms = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True), flush)
        except RuntimeError as error:  # no fused GQA kernel for this bias: give SDPA expanded K/V instead
            print(f"SDPA with GQA and a lower-right causal bias failed ({error}); timing it on expanded K/V")
            group = NUM_Q_HEADS // NUM_KV_HEADS
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            sdpa_ms = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), flush)
    kv_bytes = 2 * sum(ctx_lens) * NUM_KV_HEADS * HEAD_DIM * BYTES
    name = f"prefill {num_seqs}x{chunk} on ctx{cached}" + (f" + {num_decodes} decodes" if num_decodes else "")
    return Result(name, block_size, ms, kv_bytes, sdpa_ms)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="only batch 64 at context 2k, and one prefill case")
    parser.add_argument("--cpu", action="store_true", help="the fused CPU attention (default model's shapes)")
    parser.add_argument("--threads", type=int, help="with --cpu: torch threads (default: torch's)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="with --cpu: the K/V, query and output dtype")
    parser.add_argument("--shape", choices=("smollm2", "qwen2.5-1.5b", "gqa4-d64", "gqa4-d128", "gqa8-d128"),
                        default="smollm2",
                        help="with --cpu: the model's heads (default: the default model's)")
    options = parser.parse_args()
    if options.cpu:
        from benchmarks.kernels import cpu_attention

        if options.threads:
            torch.set_num_threads(options.threads)

        print(json.dumps(cpu_attention.run(options.quick, getattr(torch, options.dtype), options.shape)))
        return 0
    if not torch.cuda.is_available():
        print("bench_kernels: needs a CUDA device (the Triton kernels do not run on CPU); refusing.",
              file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cuda").manual_seed(0)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # larger than any L2
    copy_gbps = copy_bandwidth_gbps(flush)
    batches, contexts = ([64], [2048]) if options.quick else ([1, 8, 64, 256], [512, 2048, 8192])
    results: list[Result] = []
    skipped: list[str] = []
    for block_size in (16, 32):
        for batch in batches:
            for ctx in contexts:
                if not fits(batch, ctx, torch.cuda.mem_get_info()[0]):
                    skipped.append(f"decode b{batch} ctx{ctx} bs{block_size}")
                    continue
                results.append(bench_decode(batch, ctx, block_size, flush, gen))
                torch.cuda.empty_cache()
        results.append(bench_chunked_prefill(4, 2048, 512, 0, block_size, flush, gen))
        if not options.quick:
            results.append(bench_chunked_prefill(1, 2048, 512, 63, block_size, flush, gen))
        torch.cuda.empty_cache()

    print(f"{torch.cuda.get_device_name()}: device-to-device copy {copy_gbps:.0f} GB/s (read + write)")
    print(f"bf16, H_q={NUM_Q_HEADS}, H_kv={NUM_KV_HEADS}, D={HEAD_DIM}; vs SDPA = SDPA time / paged time")
    header = f"{'case':<36} {'block':>5} {'ms':>9} {'KV MB':>9} {'GB/s':>8} {'of copy':>8} {'vs SDPA':>8}"
    print(header)
    print("-" * len(header))
    for r in results:
        vs_sdpa = f"{r.sdpa_ms / r.ms:8.2f}" if r.sdpa_ms else f"{'-':>8}"
        print(f"{r.name:<36} {r.block_size:>5} {r.ms:9.4f} {r.kv_bytes / 1e6:9.1f} {r.gbps:8.0f} "
              f"{r.gbps / copy_gbps:8.2f} {vs_sdpa}")
    for name in skipped:
        print(f"skipped (does not fit in free memory): {name}")

    by_key = {(r.name, r.block_size): r for r in results}
    main16, main32 = by_key.get(("decode b64 ctx2048", 16)), by_key.get(("decode b64 ctx2048", 32))
    prefill16 = by_key.get(("prefill 4x512 on ctx2048", 16))
    summary = {  # null where the configuration was skipped
        "decode_b64_ctx2k_gbps": round(main16.gbps, 1) if main16 else None,
        "decode_b64_ctx2k_frac_of_copy_bw": round(main16.gbps / copy_gbps, 3) if main16 else None,
        "decode_b64_ctx2k_vs_sdpa": round(main16.sdpa_ms / main16.ms, 3) if main16 else None,
        "block16_vs_block32": round(main16.gbps / main32.gbps, 3) if main16 and main32 else None,
        "copy_gbps": round(copy_gbps, 1),
        "decode_b64_ctx2k_block32_gbps": round(main32.gbps, 1) if main32 else None,
        "prefill_4x512_ctx2k_block16_vs_sdpa": round(prefill16.sdpa_ms / prefill16.ms, 3) if prefill16 else None,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
