"""Serving benchmark through the gateway: Poisson arrivals at several request rates, streaming clients.

The workload (``--workload``): ``realistic``, the headline and the default with a model that has a
chat template: English chat turns, prompts ~50-1,500 tokens, outputs 30-400, sampled at temperature
0.8, top_p 0.95 (benchmarks/throughput/realistic.py); or ``random``, the second line: prompts of
common words (``--prompt-len``), greedy. Every request sets ``ignore_eos`` (exact output lengths).

``--client vllm-bench`` measures with vLLM's own client instead (``vllm bench serve --dataset-name
custom`` from vLLM's venv, the realistic workload, serving/vllm_bench.py): one request at a time,
then each rate (default 0.5 and inf, 64 requests), against our gateway's HTTP front and, with
``--peer vllm``, vLLM's OpenAI server, both result blocks printed and the ratios computed:

    python -m benchmarks.bench_serving --client vllm-bench --peer vllm [--vllm-dtype bfloat16]

``--peer llamacpp`` (with ``--client vllm-bench`` only) puts llama.cpp's ``llama-server`` in vLLM's
place (serving/llama_server.py): ``--llama-server`` (default ``$PAGEDSERVE_LLAMA_SERVER``) on
``--llama-gguf`` (default: ``--model`` when it is a .gguf file), ``--llama-slots`` slots of
``--llama-ctx`` tokens each, ``--llama-args="..."`` appended (``--no-repack``, ``-fa on``); ours serves the
same file at ``--quantization`` (default: the compute service's, auto: the file's own quantization):

    python -m benchmarks.bench_serving --client vllm-bench --peer llamacpp --model model.gguf [--llama-args=--no-repack]

Otherwise it starts memory, compute and gateway as real processes (benchmarks/serving/stack.py), or
targets a running gateway (``--gateway ADDR``; ``--memory ADDR`` adds the KV usage samples). In order:

1. an unloaded baseline: the workload's requests one at a time (nothing else in the engine);
2. the rate sweep: the same requests again at each ``--rates`` value (requests/s, Poisson
   arrivals, ``inf`` = all at once), each rate under its own cache salt so that no rate reuses
   another's cached prompts;
3. a shared-prefix workload: a long common system prompt plus short distinct questions, one at a
   time, TTFT with the prefix cache against without it. Without it means a second stack whose
   memory service runs with ``--enable-prefix-caching false`` (with ``--gateway``: a distinct
   cache salt per request, so nothing is shared).

The memory service's pool usage is sampled throughout (serving_client.KvSampler). Per rate it
reports requests/s, output tokens/s, TTFT, TPOT and end-to-end latency (p50/p90/p99; definitions
in serving_client.py), errors by status code; then the highest rate whose p99 TTFT stays under
``--ttft-bound-s`` and the source document's claim (serving_report.py says which latency and why).
Prints a table, then as its last line one JSON object. ``--plot-dir`` writes the two figures.

    python -m benchmarks.bench_serving [--rates 0.25 0.5 1 1.5 inf] [--plot-dir docs]
    python -m benchmarks.bench_serving --gateway 127.0.0.1:50051 [--memory unix:/run/.../memory.sock]
    python -m benchmarks.bench_serving --api openai [--gateway http://127.0.0.1:8000]

``--api openai`` sends the same workload as streamed ``/v1/completions`` through the gateway's
OpenAI-compatible HTTP front (or any OpenAI-compatible server: ``vllm serve``), so the figures
compare with other servers' and, at the same rates, with the gRPC API's (the HTTP front's cost).

``--peer vllm`` then runs the same requests (baseline and rates) against vLLM's OpenAI server, after
our stack has stopped (serving/peer.py), and adds both sides' figures and ours/vLLM ratios per rate;
the KV budget defaults to 1 GiB then (vLLM takes whole GiB). ``--skip-prefix`` leaves out phase 3.

    python -m benchmarks.bench_serving --peer vllm --skip-prefix --rates 0.5 1 2 inf --num-requests 32

vLLM runs at ``--vllm-dtype`` (default: our compute service's dtype, bfloat16 on a CPU with native
bf16); ours at ``--dtype`` (default auto).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.serving import report as report
from benchmarks.serving.client import (
    KvSampler, RequestResult, Target, describe_target, run_arrivals, run_one_at_a_time,
)
from benchmarks.serving.llama_server import BINARY_ENV as LLAMA_SERVER_ENV
from benchmarks.serving.stack import StackConfig, start_stacks
from benchmarks.serving.workload import (
    RequestSpec, make_realistic_requests, make_requests, make_shared_prefix, make_text, poisson_arrivals,
)
from pagedserve.dtypes import QUANTIZATIONS

WARMUP = RequestSpec("Hello, how are you today?", 4)


def make_specs(args: argparse.Namespace, tokens_per_word: float) -> list[RequestSpec]:
    """The sweep's requests: the realistic mix (chat-templated by ``--model``'s tokenizer), or the
    random-word mix sized through the target's tokens per word."""
    if args.workload == "realistic":
        from compute_service.model.model_loader import load_tokenizer, resolve_model

        return make_realistic_requests(load_tokenizer(resolve_model(args.model).path), args.num_requests, args.seed)
    return make_requests(args.num_requests, args.prompt_len, args.output_len, tokens_per_word, args.seed)


@dataclass
class SweepResults:
    specs: list[RequestSpec]
    baseline: list[RequestResult]
    runs: list[tuple[float, list[RequestResult]]]
    prefix_cached: list[RequestResult]
    sampler: KvSampler | None
    tokens_per_word: float
    served_model: str
    block_size: int


async def _phase(sampler: KvSampler | None, label: str, work) -> list[RequestResult]:
    """Run ``work`` (a coroutine) and mark its span on the KV usage timeline."""
    start = sampler.now() if sampler else 0.0
    results = await work
    if sampler:
        sampler.marks.append((label, start, sampler.now()))
    return results


async def sweep(target: Target, memory_address: str | None, args: argparse.Namespace) -> SweepResults:
    """Baseline, every rate and the cached shared-prefix run, against one gateway."""
    target, model_name, block_size, tpw = await describe_target(target, make_text(random.Random(args.seed), 200))
    specs = make_specs(args, tpw)
    sampler = KvSampler(memory_address, args.kv_sample_interval_s) if memory_address else None
    stop = asyncio.Event()
    sampling = asyncio.create_task(sampler.run(stop)) if sampler else None
    try:
        await run_one_at_a_time(target, [WARMUP], ["warmup"], args.timeout_s)
        baseline = await _phase(sampler, "unloaded", run_one_at_a_time(
            target, specs[: args.baseline_requests], ["baseline"] * args.baseline_requests, args.timeout_s))
        say(f"unloaded baseline: {len(baseline)} requests done")
        runs = []
        for i, rate in enumerate(args.rates):
            label = report.rate_label(rate)
            arrivals = poisson_arrivals(len(specs), rate, args.seed + 1 + i)
            results = await _phase(sampler, label, run_arrivals(target, specs, arrivals, f"rate-{label}",
                                                                 args.timeout_s))
            runs.append((rate, results))
            say(f"rate {label}: {sum(r.ok for r in results)}/{len(results)} ok")
        cached = []
        if not args.skip_prefix:
            prefix = make_shared_prefix(args.prefix_requests + 1, args.prefix_tokens, args.question_tokens,
                                        args.prefix_max_tokens, tpw, args.seed)
            # The first request fills the cache; the others find the system prompt there.
            cached = (await _phase(sampler, "prefix", run_one_at_a_time(
                target, prefix, ["prefix"] * len(prefix), args.timeout_s)))[1:]
    finally:
        stop.set()
        if sampling:
            await sampling
    return SweepResults(specs, baseline, runs, cached, sampler, tpw, model_name, block_size or args.block_size)


async def run_uncached_prefix(target: Target, args: argparse.Namespace, tpw: float, distinct_salts: bool
                              ) -> list[RequestResult]:
    """The shared-prefix requests (first one excluded, as in the cached run) without prefix reuse."""
    prefix = make_shared_prefix(args.prefix_requests + 1, args.prefix_tokens, args.question_tokens,
                                args.prefix_max_tokens, tpw, args.seed)
    salts = [f"nocache-{i}" if distinct_salts else "prefix" for i in range(len(prefix))]
    target, *_ = await describe_target(target, "name the model")
    await run_one_at_a_time(target, [WARMUP], ["warmup"], args.timeout_s)
    return (await run_one_at_a_time(target, prefix, salts, args.timeout_s))[1:]


def stack_config(args: argparse.Namespace, enable_prefix_caching: bool) -> StackConfig:
    return StackConfig(model=args.model, kv_cache_bytes=args.kv_cache_bytes, block_size=args.block_size,
                       enable_prefix_caching=enable_prefix_caching, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens,
                       num_speculative_tokens=args.num_speculative_tokens, dtype=args.dtype,
                       quantization=args.quantization, kv_events_endpoint=args.kv_events_endpoint)


def start_http_stack(args: argparse.Namespace):
    """One stack with prefix caching (``--client vllm-bench``'s server): the stack and its HTTP front's URL."""
    started = time.perf_counter()
    stack = start_stacks([stack_config(args, True)])[0]
    say(f"stack up in {time.perf_counter() - started:.0f} s")
    return stack, stack.target("openai").address


def run(args: argparse.Namespace) -> dict:
    """Everything, stacks started and stopped here when no --gateway is given."""
    if args.client == "vllm-bench":
        from benchmarks.serving import vllm_bench

        return vllm_bench.run(args, lambda: start_http_stack(args), say)
    load_start = os.getloadavg()[0]
    stack_info: dict = {}
    uncached = None
    if args.gateway:
        target = Target(args.gateway, args.api)
        results = asyncio.run(sweep(target, args.memory, args))
        if not args.skip_prefix:
            uncached = asyncio.run(run_uncached_prefix(target, args, results.tokens_per_word, True))
        mode = "distinct cache_salt per request"
    else:
        started = time.perf_counter()
        # The stack without a prefix cache starts now too (the model loads overlap) and idles
        # through the sweep: an idle engine pings its memory service once a second, nothing more.
        stacks = start_stacks([stack_config(args, True)] + ([] if args.skip_prefix else [stack_config(args, False)]))
        try:
            say(f"stacks up in {time.perf_counter() - started:.0f} s")
            stack_info |= {"pids": [s.pid for st in stacks for s in st.services],
                           "runtime_dirs": [str(st.directory) for st in stacks]}
            results = asyncio.run(sweep(stacks[0].target(args.api), stacks[0].memory_address, args))
            if not args.skip_prefix:
                uncached = asyncio.run(run_uncached_prefix(stacks[1].target(args.api), args,
                                                           results.tokens_per_word, False))
        finally:
            stack_info["exit_statuses"] = [st.stop() for st in stacks]
        mode = "memory service --enable-prefix-caching false"
    baseline = report.summarise(results.baseline)
    runs = [report.summarise(res, rate) for rate, res in results.runs]
    headline = report.analyse(baseline, runs, args.ttft_bound_s)
    prefix = None if uncached is None else report.prefix_summary(results.prefix_cached, uncached, mode)
    summary = {**headline, "prefix_ttft_speedup": prefix and prefix["ttft_speedup"], "baseline": baseline,
               "rates": runs, "prefix": prefix}
    sampler = results.sampler
    if sampler and sampler.samples:
        summary["kv_peak_used_fraction"] = round(max(s.used_blocks / s.total_blocks for s in sampler.samples), 4)
        summary["kv_total_blocks"] = sampler.samples[0].total_blocks
        summary["kv_num_samples"] = len(sampler.samples)
        summary["kv_evictions"] = sampler.samples[-1].num_evictions - sampler.samples[0].num_evictions
    summary |= {
        "api": args.api, "model": results.served_model, "workload": args.workload, "num_requests": args.num_requests,
        "prompt_len": [min(len(s.prompt) for s in results.specs), max(len(s.prompt) for s in results.specs)]
        if args.workload == "realistic" else list(args.prompt_len),  # realistic: characters, the texts sent
        "output_len": [min(s.max_tokens for s in results.specs), max(s.max_tokens for s in results.specs)],
        "tokens_per_word": round(results.tokens_per_word, 3), "dtype": args.dtype,
        "quantization": args.quantization,
        "block_size": results.block_size, "seed": args.seed,
        # What this benchmark started; unknown for a gateway it did not start.
        "kv_cache_bytes": None if args.gateway else args.kv_cache_bytes,
        "max_num_batched_tokens": None if args.gateway else args.max_num_batched_tokens,
        "num_speculative_tokens": None if args.gateway else args.num_speculative_tokens,  # None: the engine's
        "load_avg_start": round(load_start, 2), "load_avg_end": round(os.getloadavg()[0], 2),
    }
    if args.report_stack and stack_info:
        summary["stack"] = stack_info
    if args.plot_dir:
        summary["plots"] = write_plots(args, baseline, runs, sampler)
    report.print_table(baseline, runs)
    report.print_headline(headline, prefix)
    if args.peer == "vllm":
        run_peer(args, results.specs, summary)
    return summary


def run_peer(args: argparse.Namespace, specs: list[RequestSpec], summary: dict) -> None:
    """vLLM on the same requests, after our stack stopped; its figures and the ratios join ``summary``."""
    from benchmarks.serving import peer
    from compute_service.model.model_loader import ensure_float_weights, resolve_model

    source = resolve_model(args.model)
    ensure_float_weights(source)  # vLLM reads the directory as a float checkpoint
    with tempfile.TemporaryDirectory(prefix="bench-serving-vllm-") as tmp:
        theirs = peer.run_vllm(source.path, specs, args, Path(tmp) / "vllm.log", say)
    report.print_table(theirs["baseline"], theirs["rates"])
    comparison = peer.compare(summary, theirs)
    peer.print_comparison(comparison)
    summary |= {"vllm": theirs, **comparison, "load_avg_end": round(os.getloadavg()[0], 2)}


def write_plots(args: argparse.Namespace, baseline: dict, runs: list[dict], sampler: KvSampler | None) -> list[str]:
    from benchmarks.serving import plots as serving_plots

    directory = Path(args.plot_dir)
    directory.mkdir(parents=True, exist_ok=True)
    title = (f"{Path(args.model).name}: {args.num_requests} requests per rate, prompts {args.prompt_len[0]}-"
             f"{args.prompt_len[1]}, outputs {args.output_len[0]}-{args.output_len[1]} tokens")
    paths = [directory / "serving_latency.png"]
    serving_plots.plot_latency(baseline, runs, args.ttft_bound_s, paths[0], title)
    if sampler and sampler.samples:
        paths.append(directory / "serving_kv_usage.png")
        serving_plots.plot_kv_usage(sampler, paths[1], f"KV pool usage during the sweep ({title})")
    return [str(p) for p in paths]


def parse_rate(text: str) -> float:
    rate = float(text)  # "inf" included
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"a rate must be > 0 (or inf), got {text!r}")
    return rate


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--api", choices=("grpc", "openai"), default="grpc",
                   help="send through the gateway's gRPC API (default) or its OpenAI-compatible HTTP API")
    p.add_argument("--gateway", help="a running gateway's host:port (default: start a stack); with --api openai, "
                                     "any OpenAI-compatible server's base URL, http://host:port")
    p.add_argument("--memory", help="with --gateway: its memory service's address (unix:PATH), for KV usage")
    p.add_argument("--model", default="default", help='"default" or a local Hugging Face directory')
    p.add_argument("--workload", choices=("realistic", "random"), default="realistic",
                   help="realistic: English chat turns, sampled (default); random: common words, greedy "
                        "(--prompt-len, --output-len)")
    p.add_argument("--client", choices=("ours", "vllm-bench"), default="ours",
                   help="ours: this benchmark's streaming clients (default); vllm-bench: vLLM's `vllm bench serve` "
                        "on the realistic workload (from vLLM's venv)")
    p.add_argument("--dtype", default=None, help="the compute service's --dtype (default: its own, auto)")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                   help="the compute service's --quantization (default: its own, auto)")
    p.add_argument("--vllm-dtype", default=None,
                   help="with --peer vllm: vLLM's --dtype (default: ours, resolved: bfloat16 on a CPU with "
                        "native bf16)")
    p.add_argument("--rates", type=parse_rate, nargs="+", default=None,
                   help="request rates (req/s, Poisson arrivals; inf = all at once), increasing (default "
                        "0.25 0.5 0.75 1 1.5 inf; --client vllm-bench 0.5 inf)")
    p.add_argument("--num-requests", type=int, default=None,
                   help="requests per rate (default 24; --client vllm-bench 64)")
    p.add_argument("--baseline-requests", type=int, default=None,
                   help="of them, one at a time (default: all; --client vllm-bench 8)")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(32, 384), metavar=("MIN", "MAX"),
                   help="prompt tokens, about (default 32 384)")
    p.add_argument("--output-len", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"),
                   help="output tokens, exact (default 16 128)")
    p.add_argument("--ttft-bound-s", type=float, default=2.0,
                   help="p99 TTFT bound for the highest rate served under it (default 2 s)")
    p.add_argument("--prefix-tokens", type=int, default=512, help="shared system prompt, tokens (default 512)")
    p.add_argument("--question-tokens", type=int, default=16, help="each distinct question, tokens (default 16)")
    p.add_argument("--prefix-requests", type=int, default=12, help="shared-prefix requests timed (default 12)")
    p.add_argument("--prefix-max-tokens", type=int, default=8, help="their output tokens (default 8)")
    p.add_argument("--kv-events-endpoint", default=None,
                   help="turn the memory service's KV events on, published here (e.g. tcp://127.0.0.1:5557): "
                        "their cost, against a run without")
    p.add_argument("--kv-cache-bytes", type=int, default=None,
                   help="KV pool of a started stack, bytes (512 MiB; with --peer 1 GiB; with --peer vllm whole GiB "
                        "only)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=None, help="engine max_num_seqs (default: the engine's)")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="engine n-gram drafts per greedy sequence and step, at most (0 = off; default: the engine's)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="engine tokens per step, prompt chunks included (default: the engine's, 2048)")
    p.add_argument("--kv-sample-interval-s", type=float, default=0.5)
    p.add_argument("--timeout-s", type=float, default=600.0, help="deadline of each request")
    p.add_argument("--plot-dir", help="write serving_latency.png and serving_kv_usage.png here")
    p.add_argument("--report-stack", action="store_true",
                   help="add the started services' pids, exit statuses and directories to the JSON (for tests)")
    p.add_argument("--peer", choices=["vllm", "llamacpp"],
                   help="then run the same requests against vLLM's OpenAI server or (with --client vllm-bench) "
                        "llama.cpp's llama-server")
    p.add_argument("--llama-server", default=os.environ.get(LLAMA_SERVER_ENV), metavar="PATH",
                   help=f"with --peer llamacpp: the llama-server binary (default: ${LLAMA_SERVER_ENV})")
    p.add_argument("--llama-gguf", default=None, metavar="FILE",
                   help="with --peer llamacpp: the GGUF file it serves (default: --model, when a .gguf file)")
    p.add_argument("--llama-slots", type=int, default=None, metavar="N",
                   help="with --peer llamacpp: its parallel slots, -np (default: --max-num-seqs, else 16)")
    p.add_argument("--llama-ctx", type=int, default=2048, metavar="N",
                   help="with --peer llamacpp: context tokens per slot (default 2048; -c is slots x this)")
    p.add_argument("--llama-args", type=shlex.split, default=[], metavar='"ARGS"',
                   help='with --peer llamacpp: more llama-server flags, one string after "=" (argparse takes a '
                        'lone "--flag" for an option of ours): --llama-args="--no-repack -fa on"')
    p.add_argument("--vllm-ngram", type=int, default=0, metavar="K",
                   help="vLLM's n-gram speculative drafts (our engine drafts too; default 0: on a quiet machine "
                        "here K=2 made vLLM slower, 178 against 261 out tok/s at saturation)")
    p.add_argument("--skip-prefix", action="store_true", help="leave out the shared-prefix phase (and its stack)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    bench = args.client == "vllm-bench"
    args.rates = args.rates or ([0.5, float("inf")] if bench else [0.25, 0.5, 0.75, 1.0, 1.5, float("inf")])
    args.num_requests = args.num_requests or (64 if bench else 24)
    args.baseline_requests = args.baseline_requests or (min(8, args.num_requests) if bench else None)
    if bench and (args.workload != "realistic" or args.api != "grpc" or args.memory or args.plot_dir):
        p.error("--client vllm-bench sends the realistic workload to the HTTP front: no --workload random, --api, "
                "--memory or --plot-dir")
    if args.dtype is not None:
        from pagedserve.dtypes import AUTO, DTYPES

        if args.dtype not in (AUTO, *DTYPES):
            p.error(f"--dtype: choose among {[AUTO, *sorted(DTYPES)]}, got {args.dtype!r}")
    if args.peer == "llamacpp":
        check_llama_args(p, args)
    if args.peer == "vllm":
        from pagedserve.dtypes import AUTO, DTYPES, resolve_auto

        ours = resolve_auto("cpu")[0] if args.dtype in (None, AUTO) else args.dtype
        args.vllm_dtype = args.vllm_dtype or ours
        if args.vllm_dtype not in DTYPES:
            p.error(f"--vllm-dtype: choose among {sorted(DTYPES)}, got {args.vllm_dtype!r}")
    args.kv_cache_bytes = args.kv_cache_bytes or (1 << 30 if args.peer else 512 << 20)
    if args.peer == "vllm":
        from benchmarks import vllm_peer

        try:
            vllm_peer.kv_space_gib(args.kv_cache_bytes)
        except ValueError as exc:
            p.error(f"--kv-cache-bytes: {exc}")
    if args.rates != sorted(args.rates):
        p.error("--rates must be increasing")
    if args.memory and not args.gateway:
        p.error("--memory goes with --gateway")
    args.baseline_requests = args.baseline_requests or args.num_requests
    if not 1 <= args.baseline_requests <= args.num_requests:
        p.error("--baseline-requests must be in [1, --num-requests]")
    return args


def check_llama_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--peer llamacpp``'s arguments, defaults filled in; ``p.error`` names what is wrong."""
    if args.client != "vllm-bench":
        p.error("--peer llamacpp runs with --client vllm-bench only")
    if not args.llama_server:
        p.error(f"--peer llamacpp needs llama-server: --llama-server PATH or ${LLAMA_SERVER_ENV}")
    if not (Path(args.llama_server).is_file() and os.access(args.llama_server, os.X_OK)):
        p.error(f"--llama-server: no executable file at {args.llama_server!r}")
    if args.llama_gguf is None and args.model.endswith(".gguf"):
        args.llama_gguf = args.model
    if args.llama_gguf is None:
        p.error("--peer llamacpp needs a GGUF file: --llama-gguf FILE, or a .gguf --model")
    if not Path(args.llama_gguf).is_file():
        p.error(f"--llama-gguf: no file at {args.llama_gguf!r}")
    if args.llama_slots is None:
        args.llama_slots = args.max_num_seqs or 16
    for flag, value in (("--llama-slots", args.llama_slots), ("--llama-ctx", args.llama_ctx)):
        if value < 1:
            p.error(f"{flag} must be >= 1, got {value}")


def say(message: str) -> None:
    print(f"[bench_serving] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    summary = run(args)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
