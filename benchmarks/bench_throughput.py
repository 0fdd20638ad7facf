"""Throughput benchmark: the paged engine vs transformers static batching vs transformers continuous batching.

One seeded heterogeneous workload (random token-id prompts avoiding special ids, ``ignore_eos``,
greedy) runs, in this process and this run, through three systems that get the same KV byte budget:

1. the engine (``compute_service.LLM``), its pool sized by ``--kv-cache-bytes``, driven step by step
   so that the scheduler state can be sampled after every step;
2. ``transformers`` ``generate`` on static batches (left padding, attention mask, greedy,
   ``min_new_tokens = max_new_tokens``), as many requests per batch as fit the budget when each
   pre-allocates the model's maximum length (the source document's contiguous allocation):
   ``naive_concurrent_seqs = max(1, budget // (max_position * bytes_per_token))``;
3. ``transformers`` continuous batching (the manager behind ``model.generate_batch``), its paged
   cache holding ``num_blocks * page_size`` tokens = the same budget.

Metrics: tokens/s = generated tokens / wall seconds (model loading excluded, every system warmed up
by one tiny request); the engine's peak concurrent sequences; KV utilisation = live tokens stored /
token capacity of the whole pool, averaged over the steps after which requests were waiting (the
pool is the bottleneck); fragmentation = unused slots in allocated blocks / slots of allocated
blocks, averaged over steps. Prints a table, then as its last line one JSON object.

From the repository root (``python benchmarks/bench_throughput.py ...`` also works where the
package is installed, e.g. ``pip install -e .``):

    python -m benchmarks.bench_throughput --quick [--threads 1]
    python -m benchmarks.bench_throughput [--kv-cache-bytes 512MiB] [--baseline-requests 16]
    python -m benchmarks.bench_throughput --random-model-config 1b --device cuda --kv-cache-bytes 8GiB
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from compute_service import LLM, SamplingParams
from compute_service.model_config import ModelConfig
from compute_service.model_loader import load_tokenizer, resolve_model
from pagedserve.dtypes import DTYPES
from pagedserve.log import configure_logging

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


# --- workload ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    prompt_token_ids: list[int]
    max_tokens: int  # generated exactly (ignore_eos)


def make_workload(num_requests: int, prompt_lens: tuple[int, int], output_lens: tuple[int, int],
                  vocab_size: int, special_ids: set[int], seed: int) -> list[Request]:
    """Uniform prompt and output lengths (inclusive ranges); prompt tokens avoid ``special_ids``."""
    rng = random.Random(seed)
    allowed = [t for t in range(vocab_size) if t not in special_ids]
    return [
        Request([rng.choice(allowed) for _ in range(rng.randint(*prompt_lens))], rng.randint(*output_lens))
        for _ in range(num_requests)
    ]


def seeded_subset(workload: list[Request], num: int | None, seed: int) -> list[Request]:
    """A seeded sample of ``num`` requests (all when None), in arrival order."""
    if num is None or num >= len(workload):
        return list(workload)
    keep = sorted(random.Random(seed + 1).sample(range(len(workload)), num))
    return [workload[i] for i in keep]


def warmup_prompt(workload: list[Request]) -> list[int]:
    """8 copies of one token: warms a system up without sharing a prefix with any request."""
    return [workload[0].prompt_token_ids[0]] * 8


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """K and V of one token in every layer."""
    return config.num_layers * 2 * config.num_kv_heads * config.head_dim * dtype.itemsize


@dataclass
class RunResult:
    """One system's run: ``outputs[i]`` are the tokens generated for its i-th request."""

    name: str
    num_requests: int
    generated_tokens: int
    wall_s: float
    outputs: list[list[int]]
    extra: dict = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return self.generated_tokens / self.wall_s


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


def run_engine(model: str, workload: list[Request], args: argparse.Namespace) -> RunResult:
    llm = LLM(model=model, kv_cache_bytes=args.kv_cache_bytes, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
              device=args.device, dtype=args.dtype)
    try:
        engine = llm.engine
        llm.generate([warmup_prompt(workload)], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        sampler = PoolSampler(engine.memory.num_blocks, engine.memory.block_size)
        preemptions_before = engine.scheduler.num_preemptions
        outputs: dict[str, list[int]] = {}
        num_steps = 0
        started = time.perf_counter()
        for i, req in enumerate(workload):
            params = SamplingParams(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True)
            engine.add_request(f"bench-{i}", req.prompt_token_ids, params)
        while engine.has_unfinished():
            finished = [out for out in engine.step() if out.finished]
            num_steps += 1
            for out in finished:
                outputs[out.request_id] = out.token_ids
            sampler.sample(engine.scheduler, len(finished))
        wall = time.perf_counter() - started - sampler.seconds
        tokens = [outputs[f"bench-{i}"] for i in range(len(workload))]
        waiting = sampler.utilization_waiting
        return RunResult("engine", len(workload), sum(map(len, tokens)), wall, tokens, {
            "peak_concurrent_seqs": sampler.peak_concurrent_seqs,
            # None: requests never waited, so the pool was not the bottleneck.
            "kv_utilization": round(statistics.fmean(waiting), 4) if waiting else None,
            "fragmentation": round(statistics.fmean(sampler.fragmentation), 4) if sampler.fragmentation else 0.0,
            "engine_steps": num_steps,
            "engine_waiting_steps": len(waiting),
            "preemptions": engine.scheduler.num_preemptions - preemptions_before,
            "pool_tokens": engine.memory.num_blocks * engine.memory.block_size,
        })
    finally:
        llm.close()


# --- 2. transformers, static batches ---------------------------------------------------------------


def run_hf_static(model, workload: list[Request], batch_size: int, eos_ids: list[int], pad_id: int) -> RunResult:
    """Batches in arrival order; each runs until its longest output (min_new_tokens = max_new_tokens
    keeps EOS away, like ignore_eos); only each request's own tokens count as generated."""
    from transformers import GenerationConfig

    def generate(batch: list[Request]) -> list[list[int]]:
        width = max(len(r.prompt_token_ids) for r in batch)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)  # (B, L), left padded
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)  # (B, L)
        for row, req in enumerate(batch):
            input_ids[row, width - len(req.prompt_token_ids):] = torch.tensor(req.prompt_token_ids)
            attention_mask[row, width - len(req.prompt_token_ids):] = 1
        steps = max(r.max_tokens for r in batch)
        config = GenerationConfig(max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                                  eos_token_id=eos_ids or None, pad_token_id=pad_id)
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids.to(model.device), attention_mask=attention_mask.to(model.device),
                                 generation_config=config)  # (B, L + steps)
        return [out[row, width:width + req.max_tokens].tolist() for row, req in enumerate(batch)]

    generate([Request(warmup_prompt(workload), 2)])
    started = time.perf_counter()
    outputs: list[list[int]] = []
    for first in range(0, len(workload), batch_size):
        outputs += generate(workload[first:first + batch_size])
    wall = time.perf_counter() - started
    return RunResult("hf_static", len(workload), sum(map(len, outputs)), wall, outputs)


# --- 3. transformers, continuous batching ----------------------------------------------------------


def run_hf_cb(model, workload: list[Request], args: argparse.Namespace, bytes_per_token: int) -> RunResult:
    """The continuous-batching manager that ``model.generate_batch`` wraps. generate_batch takes one
    ``max_new_tokens`` for all prompts, so each request is added with its own to the same manager
    (exactly what generate_batch does otherwise); EOS id -1 disables stopping (ignore_eos)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    _ensure_cpu_memory_probe()
    page_size = args.hf_cb_page_size or args.block_size
    num_blocks = args.kv_cache_bytes // (page_size * bytes_per_token)  # num_blocks * page_size tokens = budget
    cb_config = ContinuousBatchingConfig(page_size=page_size, num_blocks=num_blocks,
                                         max_batch_tokens=args.max_num_batched_tokens,
                                         max_requests_per_batch=args.max_num_seqs)
    max_new = max(r.max_tokens for r in workload)
    gen_config = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=max_new)
    hints = WorkloadHints(max_prompt_length=max(len(r.prompt_token_ids) for r in workload),
                          max_generated_length=max_new, num_requests=len(workload))
    outputs: dict[str, list[int]] = {}
    with model.continuous_batching_context_manager(generation_config=gen_config, continuous_batching_config=cb_config,
                                                   block=True, timeout=30, warmup=model.device.type == "cuda",
                                                   workload_hints=hints) as manager:
        def drain(request_ids: set[str]) -> None:
            while not request_ids <= outputs.keys():
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    if result.error is not None:
                        raise RuntimeError(f"transformers CB request {result.request_id} failed: {result.error}")
                    outputs[result.request_id] = list(result.generated_tokens)
                elif result is None and not manager.is_running():
                    raise RuntimeError("the transformers CB generation thread died")

        manager.add_request(warmup_prompt(workload), "warmup", max_new_tokens=2, eos_token_id=-1)
        drain({"warmup"})
        cache_tokens = manager.batch_processor.cache.num_blocks * page_size  # exists once a batch ran
        started = time.perf_counter()
        ids = [manager.add_request(r.prompt_token_ids, f"cb-{i}", max_new_tokens=r.max_tokens, eos_token_id=-1)
               for i, r in enumerate(workload)]
        drain(set(ids))
        wall = time.perf_counter() - started
    tokens = [outputs[i] for i in ids]
    return RunResult("hf_cb", len(workload), sum(map(len, tokens)), wall, tokens,
                     {"hf_cb_page_size": page_size, "hf_cb_cache_tokens": cache_tokens})


def _ensure_cpu_memory_probe() -> None:
    """transformers CB checks its cache footprint against free memory, which on a CPU it reads with
    psutil (not a dependency of ours); without it it sees 0 bytes and refuses to start. Give it the
    same numbers from /proc."""
    try:
        import psutil  # noqa: F401
        return
    except ImportError:
        pass
    from transformers.generation.continuous_batching import cache as cb_cache

    original = cb_cache.get_device_and_memory_breakdown

    def breakdown() -> tuple[torch.device, int, int, int]:
        device, total, reserved, allocated = original()
        if device.type != "cpu" or total:
            return device, total, reserved, allocated
        meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        total = int(meminfo["MemTotal"].split()[0]) * 1024
        rss = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return device, total, rss, rss

    cb_cache.get_device_and_memory_breakdown = breakdown


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


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a run under two minutes on a 2-core CPU")
    parser.add_argument("--model", default="default", help='"default" or a local Hugging Face directory')
    parser.add_argument("--random-model-config", choices=sorted(_RANDOM_SHAPES),
                        help="use a random-weight Llama of this shape (built in a temp dir) for all three systems")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--kv-cache-bytes", type=parse_bytes, default=None,
                        help="KV budget of every system, e.g. 512MiB (default 512MiB; --quick 48MiB)")
    parser.add_argument("--num-requests", type=int, default=None, help="default 128 (--quick 32)")
    parser.add_argument("--prompt-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                        help="default 16 512 (--quick 16 128)")
    parser.add_argument("--output-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                        help="default 16 256 (--quick 16 64)")
    parser.add_argument("--baseline-requests", type=int, default=None,
                        help="run the transformers static baseline on a seeded subset of this many requests "
                             "(default: max(16, 2 batches); --quick max(4, 1 batch))")
    parser.add_argument("--cb-baseline-requests", type=int, default=None,
                        help="the same for the transformers continuous-batching baseline (default: all)")
    parser.add_argument("--skip-hf-static", action="store_true")
    parser.add_argument("--skip-hf-cb", action="store_true")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="engine max_num_seqs, HF CB max requests")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step of both")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--hf-cb-page-size", type=int, default=None, help="default: --block-size")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: every CPU this process may run on)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    quick = args.quick
    args.kv_cache_bytes = args.kv_cache_bytes or (48 << 20 if quick else 512 << 20)
    args.num_requests = args.num_requests or (32 if quick else 128)
    args.prompt_len = tuple(args.prompt_len or ((16, 128) if quick else (16, 512)))
    args.output_len = tuple(args.output_len or ((16, 64) if quick else (16, 256)))
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    args.threads = args.threads or len(os.sched_getaffinity(0))
    return args


def main() -> None:
    args = parse_args()
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
            model_arg, model_dir = args.model, resolve_model(args.model).path
        config = ModelConfig.from_dir(model_dir, name=model_dir.name)
        special = {*config.eos_token_ids, *([config.bos_token_id] if config.bos_token_id is not None else [])}
        special |= set(getattr(load_tokenizer(model_dir), "all_special_ids", None) or [])
        workload = make_workload(args.num_requests, args.prompt_len, args.output_len, config.vocab_size, special,
                                 args.seed)
        bytes_per_token = kv_bytes_per_token(config, dtype)
        naive_seqs = max(1, args.kv_cache_bytes // (config.max_position * bytes_per_token))
        if args.baseline_requests is None:
            args.baseline_requests = max(4, naive_seqs) if args.quick else max(16, 2 * naive_seqs)

        results = [progress(run_engine(model_arg, workload, args))]
        gc.collect()
        if not (args.skip_hf_static and args.skip_hf_cb):
            from transformers import AutoModelForCausalLM

            hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa",
                                                            local_files_only=True).to(args.device).eval()
            if not args.skip_hf_static:
                subset = seeded_subset(workload, args.baseline_requests, args.seed)
                pad_id = config.eos_token_ids[0] if config.eos_token_ids else 0
                results.append(progress(run_hf_static(hf_model, subset, naive_seqs, list(config.eos_token_ids),
                                                      pad_id)))
            if not args.skip_hf_cb:
                subset = seeded_subset(workload, args.cb_baseline_requests, args.seed)
                results.append(progress(run_hf_cb(hf_model, subset, args, bytes_per_token)))
            del hf_model
            gc.collect()
    report(args, workload, results, naive_seqs, bytes_per_token, config)


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
           bytes_per_token: int, config: ModelConfig) -> None:
    engine, by_name = results[0], {r.name: r for r in results}
    subsets = {"hf_static": args.baseline_requests, "hf_cb": args.cb_baseline_requests}
    summary: dict = {"engine_tok_s": round(engine.tok_s, 2)}
    for name in subsets:
        summary[f"{name}_tok_s"] = round(by_name[name].tok_s, 2) if name in by_name else None
    for name in subsets:
        summary[f"ratio_vs_{name}"] = round(engine.tok_s / by_name[name].tok_s, 3) if name in by_name else None
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
            subset = seeded_subset(workload, subsets[r.name], args.seed)
            summary[f"{r.name}_token_agreement"] = round(agreement(engine, r, workload, subset), 3)
    peak_rss = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    summary |= {
        "kv_cache_bytes": args.kv_cache_bytes, "kv_bytes_per_token": bytes_per_token,
        "max_position": config.max_position, "model": config.name, "device": args.device, "dtype": args.dtype,
        "threads": args.threads, "quick": args.quick, "seed": args.seed,
        "peak_rss_mib": round(peak_rss / 1024),  # largest single process (ru_maxrss is in KiB on Linux)
    }

    print(f"workload: {len(workload)} requests, prompts {args.prompt_len[0]}-{args.prompt_len[1]} tokens "
          f"({sum(len(r.prompt_token_ids) for r in workload)} in all), outputs {args.output_len[0]}-"
          f"{args.output_len[1]} ({sum(r.max_tokens for r in workload)} in all), ignore_eos, greedy, seed {args.seed}")
    print(f"model {config.name} on {args.device} in {args.dtype}, {args.threads} torch thread(s)")
    print(f"KV budget {args.kv_cache_bytes / 2**20:.0f} MiB = {args.kv_cache_bytes // bytes_per_token} tokens at "
          f"{bytes_per_token} B/token; pre-allocating {config.max_position} tokens per request fits {naive_seqs}")
    if any(r.num_requests < len(workload) for r in results):
        print("baselines on a seeded subset of the requests: "
              + ", ".join(f"{r.name} {r.num_requests}" for r in results[1:]))
    print(f"\n{'system':<12}{'requests':>10}{'gen tokens':>12}{'wall s':>10}{'tok/s':>10}{'engine x':>10}")
    for r in results:
        print(f"{r.name:<12}{r.num_requests:>10}{r.generated_tokens:>12}{r.wall_s:>10.2f}{r.tok_s:>10.2f}"
              f"{engine.tok_s / r.tok_s:>10.2f}")
    print(f"\n{'engine metric':<28}{'value':>12}")
    for key in ("peak_concurrent_seqs", "naive_concurrent_seqs", "kv_utilization", "fragmentation", "preemptions",
                "engine_steps", "engine_waiting_steps", "pool_tokens"):
        print(f"{key:<28}{str(summary[key]):>12}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
