"""Throughput benchmark: the paged engine vs transformers' generate and continuous batching.

One seeded heterogeneous workload runs (``--workload``: ``realistic``, the headline and the default
with a real model: English chat prompts of ShareGPT-like lengths, 50-1,500 tokens, outputs 30-400,
sampled at temperature 0.8, top_p 0.95, throughput/realistic.py; or ``random``, the second line and
the only one for ``--random-model-config``: random token-id prompts avoiding special ids, greedy;
both ``ignore_eos``), in this process and this run, through the engine and the baselines
(``--baselines``, each on the same seeded subset of ``--baseline-requests`` requests; see
hf_baselines.py; the random workload only):

- ``engine``: ``compute_service.LLM``, its pool sized by ``--kv-cache-bytes`` (512 MiB), driven step
  by step so that the scheduler state can be sampled after every step;
- ``hf_static_best`` (default): ``generate`` on static batches without a memory cap, left padding,
  the best of ``--static-batch-sizes`` (8, 16, 32); useful tokens only;
- ``hf_cb_default`` (default): transformers' continuous batching with its own defaults;
- ``hf_static``: static batches of as many requests as fit the KV budget when each pre-allocates
  the model's maximum length (the source document's contiguous allocation);
- ``hf_cb``: transformers' continuous batching with the same KV budget and page size;
- ``--peer vllm``: vLLM's CPU build on the whole workload, after the engine (throughput/peer.py),
  at each of ``--vllm-dtypes`` (default: our dtype; ``bfloat16,float32`` for both, the best
  reported); the KV budget defaults to 1 GiB then (vLLM takes whole GiB) and the HF baselines to none.

Metrics: tokens/s = generated tokens / wall seconds (model loading excluded, every system warmed up
by one tiny request); the engine's peak concurrent sequences; KV utilisation = live tokens stored /
token capacity of the whole pool, averaged over the steps after which requests were waiting (the
pool is the bottleneck); fragmentation = unused slots in allocated blocks / slots of allocated
blocks, averaged over steps; preemptions and the tokens they made the engine recompute.
``--profile`` adds the per-component time of a decode and a prefill step (step_profile.py).
Prints a table, then as its last line one JSON object.

From the repository root (``python benchmarks/bench_throughput.py ...`` also works where the
package is installed, e.g. ``pip install -e .``):

    python -m benchmarks.bench_throughput --num-requests 48 [--dtype bfloat16] [--profile]
    python -m benchmarks.bench_throughput --workload random --quick [--profile] [--threads 1]
    python -m benchmarks.bench_throughput --workload random [--kv-cache-bytes 512MiB] [--baseline-requests 32]
    python -m benchmarks.bench_throughput --peer vllm --num-requests 48 --vllm-dtypes bfloat16,float32
    python -m benchmarks.bench_throughput --workload random --peer vllm --num-requests 48 [--vllm-budgets 256:2048:2]
    python -m benchmarks.bench_throughput --random-model-config 1b --device cuda --kv-cache-bytes 8GiB
"""

from __future__ import annotations

if __name__ == "__main__":
    # The engine runs in this process: give it what a compute service gets (tcmalloc + Intel OpenMP
    # when installed, pagedserve/cpu_preload.py), before torch is imported below.
    from pagedserve import cpu_preload

    cpu_preload.maybe_reexec("benchmarks.bench_throughput")

import argparse
import gc
import json
import logging
import os
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

import pagedserve_kernels as kernels
from benchmarks.throughput import hf_baselines, peer, realistic
from benchmarks.throughput import step_profile
from benchmarks.throughput.workload import (
    Request, RunResult, kv_bytes_per_token, make_workload, seeded_subset, warmup_prompt,
)
from compute_service import LLM, SamplingParams
from compute_service.engine.outputs import RequestOutput, collect
from compute_service.model.model_config import ModelConfig
from compute_service.model.model_loader import ensure_float_weights, load_tokenizer, resolve_model
from pagedserve.dtypes import AUTO, DTYPES, resolve_auto
from pagedserve.log import configure_logging

_BASELINES = ("hf_static_best", "hf_cb_default", "hf_static", "hf_cb")
# Random-weight Llama shapes (no tokenizer: prompts are token ids). "1b" is Llama-3.2-1B's shape
# with an 8k context; "tiny" checks the plumbing on a CPU in seconds.
_RANDOM_SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=8192,
               rope_theta=500000.0, tie_word_embeddings=True),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=4096, max_position_embeddings=2048,
                 tie_word_embeddings=True),
}


# --- 1. the engine -------------------------------------------------------------------------------


@dataclass
class PoolSampler:
    """Reads the scheduler after each step: live tokens and allocated slots of the whole pool.

    Live tokens are the K/V actually stored (``num_computed_tokens``) of running sequences; a block
    shared by several sequences (prefix cache, forks) counts once, as full as its fullest user.
    """

    num_blocks: int
    block_size: int
    utilization_waiting: list[float] = field(default_factory=list)  # steps after which requests wait
    fragmentation: list[float] = field(default_factory=list)  # steps with any block allocated
    peak_concurrent_seqs: int = 0
    seconds: float = 0.0  # spent sampling, taken out of the engine's wall time

    def sample(self, scheduler, num_finished_this_step: int) -> None:
        started = time.perf_counter()
        filled: dict[int, int] = {}
        for seq in scheduler.running:
            for i, block_id in enumerate(seq.block_table):
                used = min(self.block_size, max(0, seq.num_computed_tokens - i * self.block_size))
                filled[block_id] = max(filled.get(block_id, 0), used)
        stored, allocated = sum(filled.values()), len(filled) * self.block_size
        if scheduler.waiting:
            self.utilization_waiting.append(stored / (self.num_blocks * self.block_size))
        if allocated:
            self.fragmentation.append((allocated - stored) / allocated)
        # Sequences that finished this step have already left `running` but did run in it.
        self.peak_concurrent_seqs = max(self.peak_concurrent_seqs, len(scheduler.running) + num_finished_this_step)
        self.seconds += time.perf_counter() - started


def count_computed_tokens(engine) -> list[int]:
    """From now on, count the tokens the engine's model runs (a one-element list, updated in place)."""
    counter = [0]
    run = engine.runner.run

    def counting_run(scheduled):
        counter[0] += sum(item.num_new_tokens for item in scheduled)
        return run(scheduled)

    engine.runner.run = counting_run
    return counter


def watermark_kwargs(args: argparse.Namespace) -> dict:
    """The engine's admission watermark and speculative drafts, when the command line sets them
    (else their defaults)."""
    kwargs = {} if args.admission_watermark is None else {"admission_watermark": args.admission_watermark}
    if args.num_speculative_tokens is not None:
        kwargs["num_speculative_tokens"] = args.num_speculative_tokens
    return kwargs


def run_engine(model: str, workload: list[Request], args: argparse.Namespace) -> RunResult:
    llm = LLM(model=model, kv_cache_bytes=args.kv_cache_bytes, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
              device=args.device, dtype=args.dtype, **watermark_kwargs(args))
    try:
        engine = llm.engine
        llm.generate([warmup_prompt(workload)], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        sampler = PoolSampler(engine.memory.num_blocks, engine.memory.block_size)
        preemptions_before = engine.scheduler.num_preemptions
        computed = count_computed_tokens(engine)
        cached_before = engine.num_prompt_tokens_cached
        results: dict[str, RequestOutput] = {}
        num_steps = 0
        started = time.perf_counter()
        for i, req in enumerate(workload):
            params = SamplingParams(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                                    ignore_eos=True)
            engine.add_request(f"bench-{i}", req.prompt_token_ids, params)
        while engine.has_unfinished():
            finished = collect(results, engine.step())
            num_steps += 1
            sampler.sample(engine.scheduler, len(finished))
        wall = time.perf_counter() - started - sampler.seconds
        tokens = [results[f"bench-{i}"].token_ids for i in range(len(workload))]
        waiting = sampler.utilization_waiting
        return RunResult("engine", len(workload), sum(map(len, tokens)), wall, tokens, {
            "peak_concurrent_seqs": sampler.peak_concurrent_seqs,
            # None: requests never waited, so the pool was not the bottleneck.
            "kv_utilization": round(statistics.fmean(waiting), 4) if waiting else None,
            "fragmentation": round(statistics.fmean(sampler.fragmentation), 4) if sampler.fragmentation else 0.0,
            "engine_steps": num_steps,
            "engine_waiting_steps": len(waiting),
            "admission_watermark": engine.config.admission_watermark,
            "num_speculative_tokens": engine.config.num_speculative_tokens,
            "draft_tokens": engine.num_draft_tokens,
            "accepted_draft_tokens": engine.num_accepted_draft_tokens,
            "preemptions": engine.scheduler.num_preemptions - preemptions_before,
            # Every request needs the K/V of its prompt + output - 1 tokens (the last output token is
            # never fed back). Each comes from the model (accepted drafts were computed as drafts, not
            # counted as new tokens; rejected ones are not here) or from the prefix cache at admission.
            "computed_tokens": computed[0] + engine.num_accepted_draft_tokens,
            "prefix_cached_tokens": engine.num_prompt_tokens_cached - cached_before,
            # K/V produced more than once: what preemption cost (recomputed, or found in the cache
            # again at readmission); 0 without preemption.
            "recomputed_tokens": computed[0] + engine.num_accepted_draft_tokens
            + engine.num_prompt_tokens_cached - cached_before
            - sum(len(r.prompt_token_ids) + r.max_tokens - 1 for r in workload),
            "pool_tokens": engine.memory.num_blocks * engine.memory.block_size,
        })
    finally:
        llm.close()


# --- main ------------------------------------------------------------------------------------------


def build_random_model(shape: str, dtype: torch.dtype, directory: str) -> Path:
    """Save a random-weight Llama of ``shape`` (no tokenizer) under ``directory``; returns its path."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**_RANDOM_SHAPES[shape], bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its final dtype: half the peak memory of a float32 build
    try:
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    path = Path(directory) / f"random-llama-{shape}"
    model.save_pretrained(path)
    return path


def parse_bytes(text: str) -> int:
    """"512MiB", "8GiB", "64M" or a plain number of bytes."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    lower = text.strip().lower()
    for suffix in sorted(units, key=len, reverse=True):
        if lower.endswith(suffix):
            return int(float(lower[: -len(suffix)]) * units[suffix])
    return int(lower)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a run under two minutes on a 2-core CPU")
    parser.add_argument("--model", default="default", help='"default" or a local Hugging Face directory')
    parser.add_argument("--random-model-config", choices=sorted(_RANDOM_SHAPES),
                        help="use a random-weight Llama of this shape (built in a temp dir) for all three systems")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--workload", choices=["realistic", "random"], default=None,
                        help="realistic: English chat prompts, sampled (default); random: random token ids, greedy "
                             "(the default with --random-model-config, which has no tokenizer)")
    parser.add_argument("--dtype", choices=[AUTO, *sorted(DTYPES)], default=AUTO,
                        help="default auto, as the engine's: bfloat16 on CUDA and on CPUs with native bf16, "
                             "else float32")
    parser.add_argument("--kv-cache-bytes", type=parse_bytes, default=None,
                        help="KV budget of every system, e.g. 512MiB (default 512MiB; --quick 48MiB; --peer 1GiB)")
    parser.add_argument("--num-requests", type=int, default=None, help="default 128 (--quick 32)")
    parser.add_argument("--prompt-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                        help="default 16 512 (--quick 16 128)")
    parser.add_argument("--output-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                        help="default 16 256 (--quick 16 64)")
    parser.add_argument("--peer", choices=["vllm"], help="also run vLLM's CPU build on the whole workload")
    parser.add_argument("--vllm-dtypes", default=None,
                        help="with --peer vllm: comma-separated dtypes vLLM runs at, one run each, the best reported "
                             "(default: the engine's dtype; bfloat16,float32 compares with vLLM at its best)")
    parser.add_argument("--vllm-budgets", type=peer.parse_budgets, default=None,
                        help="with --peer vllm: MAX_NUM_SEQS:MAX_NUM_BATCHED_TOKENS[:NGRAM_K][,...], one vLLM run "
                             "each, the best reported; NGRAM_K > 0 = its n-gram speculative decoding (default: "
                             "the engine's --max-num-seqs:--max-num-batched-tokens, with NGRAM_K 0, and 2 for the "
                             "greedy random workload)")
    parser.add_argument("--baselines", default=None,
                        help="comma-separated, of: hf_static_best (generate, static batches without a memory cap, "
                             "best of --static-batch-sizes), hf_cb_default (transformers CB, its own defaults), "
                             "hf_static (static batches that fit the KV budget), hf_cb (CB with the KV budget); "
                             "'none' for the engine alone (default: the first two; none with --peer)")
    parser.add_argument("--baseline-requests", type=int, default=None,
                        help="run the baselines on a seeded subset of this many requests (default 32; --quick 16)")
    parser.add_argument("--static-batch-sizes", type=int, nargs="+", default=[8, 16, 32],
                        help="batch sizes hf_static_best tries (default 8 16 32)")
    parser.add_argument("--profile", action="store_true",
                        help="also time one prefill and a few decode steps of the engine by component")
    parser.add_argument("--profile-only", action="store_true", help="--profile without the throughput runs")
    parser.add_argument("--profile-seqs", type=int, default=48, help="at most this many decoding sequences")
    parser.add_argument("--profile-steps", type=int, default=3, help="decode steps timed by --profile")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="engine max_num_seqs, HF CB max requests")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step of both")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--admission-watermark", type=float, default=None,
                        help="share of the pool kept free when admitting (default: EngineConfig's)")
    parser.add_argument("--num-speculative-tokens", type=int, default=None,
                        help="engine n-gram drafts per greedy sequence and step, at most (0 = off)")
    parser.add_argument("--hf-cb-page-size", type=int, default=None, help="default: --block-size")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: every CPU this process may run on)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    quick = args.quick
    args.workload = args.workload or ("random" if args.random_model_config else "realistic")
    if args.workload == "realistic" and args.random_model_config:
        parser.error("--workload realistic needs the model's tokenizer: a --random-model-config has none")
    args.kv_cache_bytes = args.kv_cache_bytes or (1 << 30 if args.peer else 48 << 20 if quick else 512 << 20)
    if args.peer:
        try:
            peer.vllm_peer.kv_space_gib(args.kv_cache_bytes)
        except ValueError as exc:
            parser.error(f"--kv-cache-bytes: {exc}")
        # vLLM with and without its n-gram drafts (2 measured best of 2 and 4 here), as ours drafts;
        # drafts are for greedy requests (ours makes none for sampled ones), so not on the realistic mix.
        ngram_ks = (0, 2) if args.workload == "random" else (0,)
        args.vllm_budgets = args.vllm_budgets or [(args.max_num_seqs, args.max_num_batched_tokens, k)
                                                  for k in ngram_ks]
    args.num_requests = args.num_requests or (32 if quick else 128)
    args.prompt_len = tuple(args.prompt_len or ((16, 128) if quick else (16, 512)))
    args.output_len = tuple(args.output_len or ((16, 64) if quick else (16, 256)))
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.dtype == AUTO:  # the engine's default, resolved here: the baselines need a dtype too
        args.dtype = resolve_auto(args.device)[0]
    args.vllm_dtypes = args.vllm_dtypes.split(",") if args.vllm_dtypes else [args.dtype]
    if set(args.vllm_dtypes) - set(DTYPES):
        parser.error(f"--vllm-dtypes: choose among {sorted(DTYPES)}, got {args.vllm_dtypes}")
    if args.peer and args.device != "cpu":
        parser.error("--peer vllm runs vLLM's CPU build: use --device cpu")
    args.threads = args.threads or len(os.sched_getaffinity(0))
    args.baseline_requests = args.baseline_requests or (16 if quick else 32)
    if args.workload == "realistic" and args.baselines not in (None, "none"):
        parser.error("--workload realistic samples: the transformers baselines run the greedy random workload only")
    args.baselines = args.baselines or ("none" if args.peer or args.workload == "realistic"
                                        else "hf_static_best,hf_cb_default")
    args.baselines = [] if args.baselines == "none" else args.baselines.split(",")
    unknown = set(args.baselines) - set(_BASELINES)
    if unknown:
        parser.error(f"unknown baselines {sorted(unknown)}; choose from {list(_BASELINES)}")
    return args


def main() -> None:
    args = parse_args()
    args.load_avg_start = round(os.getloadavg()[0], 2)
    torch.set_num_threads(args.threads)
    if args.device == "cpu" and args.threads > 1 and os.getloadavg()[0] >= args.threads:
        # Seen on a shared 2-CPU machine: 2 threads ran up to 10x slower than 1 while tests ran beside.
        say(f"load average {os.getloadavg()[0]:.1f} at start: other processes share these CPUs, and "
            f"{args.threads} torch threads may stall on each other; --threads 1 gives steadier figures")
    configure_logging("warning")  # the engine's per-request events (info) would bury the table
    logging.getLogger("transformers").setLevel(logging.ERROR)
    dtype = DTYPES[args.dtype]
    with tempfile.TemporaryDirectory(prefix="bench-throughput-") as tmp:
        if args.random_model_config:
            model_dir = build_random_model(args.random_model_config, dtype, tmp)
            model_arg = str(model_dir)
        else:
            source = resolve_model(args.model)
            model_arg, model_dir = args.model, source.path
            if args.baselines or args.peer == "vllm":  # they read the directory as a float checkpoint
                ensure_float_weights(source)
        config = ModelConfig.from_dir(model_dir, name=model_dir.name)
        special = {*config.eos_token_ids, *([config.bos_token_id] if config.bos_token_id is not None else [])}
        special |= set(getattr(load_tokenizer(model_dir), "all_special_ids", None) or [])
        if args.workload == "realistic":
            workload = realistic.make_realistic_workload(load_tokenizer(model_dir), args.num_requests, args.seed)
        else:
            workload = make_workload(args.num_requests, args.prompt_len, args.output_len, config.vocab_size,
                                     special, args.seed)
        bytes_per_token = kv_bytes_per_token(config, dtype)
        naive_seqs = max(1, args.kv_cache_bytes // (config.max_position * bytes_per_token))

        profile = (step_profile.profile_steps(model_arg, workload, args, **watermark_kwargs(args))
                   if args.profile or args.profile_only else None)
        if args.profile_only:
            step_profile.print_profile(profile)
            print(json.dumps({"profile": profile, "model": config.name, "threads": args.threads}))
            return
        results = [progress(run_engine(model_arg, workload, args))]
        gc.collect()
        if args.baselines:
            from transformers import AutoModelForCausalLM

            hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa",
                                                            local_files_only=True).to(args.device).eval()
            subset = seeded_subset(workload, args.baseline_requests, args.seed)
            eos_ids, pad_id = list(config.eos_token_ids), (config.eos_token_ids[0] if config.eos_token_ids else 0)
            for name in args.baselines:
                if name == "hf_static_best":
                    result = hf_baselines.run_hf_static_best(hf_model, subset, args.static_batch_sizes, eos_ids,
                                                             pad_id, say)
                elif name == "hf_static":
                    result = hf_baselines.run_hf_static(hf_model, subset, naive_seqs, eos_ids, pad_id)
                else:
                    result = hf_baselines.run_hf_cb(hf_model, subset, args, bytes_per_token, budget=name == "hf_cb")
                results.append(progress(result))
                gc.collect()
            del hf_model
            gc.collect()
        if args.peer == "vllm":
            results.append(progress(peer.run_vllm(model_dir, workload, args.kv_cache_bytes, args.vllm_dtypes,
                                                  args.seed, args.vllm_budgets, say)))
    report(args, workload, results, naive_seqs, bytes_per_token, config, profile)


def cpu_preload_active() -> bool:
    from pagedserve import cpu_preload

    return cpu_preload.is_preloaded()


def say(message: str) -> None:
    print(f"[bench_throughput] {message}", file=sys.stderr, flush=True)


def progress(result: RunResult) -> RunResult:
    say(f"{result.name}: {result.num_requests} requests, {result.generated_tokens} tokens in {result.wall_s:.1f} s "
        f"= {result.tok_s:.2f} tok/s")
    return result


def agreement(engine: RunResult, other: RunResult, workload: list[Request], subset: list[Request]) -> float:
    """Share of ``other``'s requests whose greedy tokens equal the engine's: a check that both did the
    same work (rounding may flip a near-tie now and then, more so in half precision)."""
    engine_tokens = {id(r): out for r, out in zip(workload, engine.outputs)}
    return sum(engine_tokens[id(r)] == out for r, out in zip(subset, other.outputs)) / len(subset)


def report(args: argparse.Namespace, workload: list[Request], results: list[RunResult], naive_seqs: int,
           bytes_per_token: int, config: ModelConfig, profile: dict | None) -> None:
    engine, baselines = results[0], results[1:]
    summary: dict = {"engine_tok_s": round(engine.tok_s, 2)}
    for r in baselines:
        summary[f"{r.name}_tok_s"] = round(r.tok_s, 2)
    for r in baselines:
        summary[f"ratio_vs_{r.name}"] = round(engine.tok_s / r.tok_s, 3)
    summary |= {
        "peak_concurrent_seqs": engine.extra["peak_concurrent_seqs"],
        "naive_concurrent_seqs": naive_seqs,
        "kv_utilization": engine.extra["kv_utilization"],
        "fragmentation": engine.extra["fragmentation"],
        "num_requests": len(workload),
        **{k: v for k, v in engine.extra.items() if k not in ("peak_concurrent_seqs", "kv_utilization",
                                                                "fragmentation")},
    }
    for r in results:
        summary |= {f"{r.name}_wall_s": round(r.wall_s, 2), f"{r.name}_requests": r.num_requests,
                    f"{r.name}_generated_tokens": r.generated_tokens}
        if r is not engine:
            summary |= r.extra
            subset = workload if r.num_requests == len(workload) else seeded_subset(
                workload, args.baseline_requests, args.seed)
            # Sampled outputs (the realistic workload, unseeded) differ by design: no agreement then.
            greedy = all(req.temperature == 0.0 for req in subset)
            summary[f"{r.name}_token_agreement"] = round(agreement(engine, r, workload, subset), 3) if greedy else None
    peak_rss = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    summary |= {
        "kv_cache_bytes": args.kv_cache_bytes, "kv_bytes_per_token": bytes_per_token,
        "max_position": config.max_position, "model": config.name, "device": args.device, "dtype": args.dtype,
        "threads": args.threads, "quick": args.quick, "seed": args.seed, "workload": args.workload,
        "load_avg_start": args.load_avg_start, "load_avg_end": round(os.getloadavg()[0], 2),
        "peak_rss_mib": round(peak_rss / 1024),  # largest single process (ru_maxrss is in KiB on Linux)
        "cpu_preload": os.environ.get("LD_PRELOAD", "") if cpu_preload_active() else None,
        # What ran: the code each kernel takes on this CPU (the compute service's Info.kernel_paths).
        "kernel_paths": kernels.kernel_paths(torch.device(args.device), DTYPES[args.dtype], config.head_dim,
                                             group=config.num_q_heads // config.num_kv_heads),
    }

    prompt_lens, output_lens = [len(r.prompt_token_ids) for r in workload], [r.max_tokens for r in workload]
    sampling = ("greedy" if workload[0].temperature == 0.0
                else f"temperature {workload[0].temperature}, top_p {workload[0].top_p}, unseeded")
    print(f"{args.workload} workload: {len(workload)} requests, prompts {min(prompt_lens)}-{max(prompt_lens)} tokens "
          f"({sum(prompt_lens)} in all), outputs {min(output_lens)}-{max(output_lens)} ({sum(output_lens)} in all), "
          f"ignore_eos, {sampling}, seed {args.seed}")
    print(f"model {config.name} on {args.device} in {args.dtype}, {args.threads} torch thread(s)")
    print(f"KV budget {args.kv_cache_bytes / 2**20:.0f} MiB = {args.kv_cache_bytes // bytes_per_token} tokens at "
          f"{bytes_per_token} B/token; pre-allocating {config.max_position} tokens per request fits {naive_seqs}")
    if any(r.num_requests < len(workload) for r in results):
        print("baselines on a seeded subset of the requests: "
              + ", ".join(f"{r.name} {r.num_requests}" for r in results[1:]))
    print(f"\n{'system':<16}{'requests':>10}{'gen tokens':>12}{'wall s':>10}{'tok/s':>10}{'engine x':>10}")
    for r in results:
        print(f"{r.name:<16}{r.num_requests:>10}{r.generated_tokens:>12}{r.wall_s:>10.2f}{r.tok_s:>10.2f}"
              f"{engine.tok_s / r.tok_s:>10.2f}")
    print(f"\n{'engine metric':<28}{'value':>12}")
    for key in ("peak_concurrent_seqs", "naive_concurrent_seqs", "kv_utilization", "fragmentation", "preemptions",
                "recomputed_tokens", "engine_steps", "engine_waiting_steps", "pool_tokens"):
        print(f"{key:<28}{str(summary[key]):>12}")
    if profile is not None:
        step_profile.print_profile(profile)
        summary["profile"] = profile
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
