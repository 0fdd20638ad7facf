"""``bench_serving --client vllm-bench``: the realistic workload through ``vllm bench serve``, vLLM's
own serving client, against our gateway's OpenAI-compatible HTTP front and then, after ours has
stopped, against a peer: vLLM's OpenAI server (``--peer vllm``) or llama.cpp's ``llama-server`` on a
GGUF file (``--peer llamacpp``, serving/llama_server.py): one client, both servers, the same requests.
The client's tokenizer (chat template, prompt lengths) is ours for both: ``--model``'s directory, for
a GGUF file the directory it was converted to.

The client runs in vLLM's venv (serving/vllm_bench_serve.py) with ``--backend openai --endpoint
/v1/completions --dataset-name custom``: a JSONL file of ``{"prompt", "output_tokens"}``, the user
turns of the realistic workload (benchmarks/throughput/realistic.py: English text, prompts ~50-1,500
tokens once the client applies the model's chat template, outputs 30-400), sent with
``--ignore-eos`` (each request generates exactly its ``output_tokens``), ``--temperature 0.8
--top-p 0.95`` and no seed (vLLM 0.32's CPU build fails on per-request seeds). Phases, each with
prompts of its own (a seed per phase), so that no phase finds another's prompts in a prefix cache:

- ``one_at_a_time``: ``--baseline-requests`` prompts, ``--max-concurrency 1``;
- ``rate-R`` for each ``--rates`` value: ``--num-requests`` prompts, Poisson arrivals at R req/s
  (``inf``: all at once, the saturation figure), arrival times seeded alike for both servers.

Figures are vLLM's client's own (TTFT, TPOT, ITL, E2E latency at p50/p90/p99, output tokens/s); its
result block is printed as it printed it, for both servers, then the ratios ours / the peer's (JSON key
``vs_vllm`` or ``vs_llamacpp``; the goals against vLLM under ``goals``, against llama.cpp under
``goals_vs_llamacpp``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks import vllm_peer
from benchmarks.serving import report
from benchmarks.throughput import realistic
from pagedserve import cpu_preload

RUNNER = Path(__file__).with_name("vllm_bench_serve.py")
ONE_AT_A_TIME = "one_at_a_time"
# The goals of issues 39 (against vLLM at its best dtype) and 40 (against llama.cpp on the same GGUF):
# realistic saturation output tokens/s at least this many times the peer's; one request at a time, TPOT
# p50 at most this share of the peer's (and TTFT p50 no worse than the peer's, both).
SATURATION_GOAL = {"vllm": 1.5, "llamacpp": 2.0}
ONE_AT_A_TIME_TPOT_GOAL = {"vllm": 0.7, "llamacpp": 1.0}
METRICS = ("ttft", "tpot", "itl", "e2el")
QUANTILES = ("50", "90", "99")
PEER_NAMES = {"vllm": "vLLM", "llamacpp": "llama.cpp"}  # --peer: how the report names it


@dataclass(frozen=True)
class Phase:
    """One ``vllm bench serve`` run: how many prompts, how they arrive, which prompts (``seed``)."""

    label: str
    num_prompts: int
    rate: float  # Poisson requests/s; inf: all at once
    max_concurrency: int | None
    seed: int


def phases(args: argparse.Namespace) -> list[Phase]:
    """The one-at-a-time phase, then each rate, with bench_serving's seeds (seed, seed + 1 + i)."""
    runs = [Phase(ONE_AT_A_TIME, args.baseline_requests, math.inf, 1, args.seed)]
    for i, rate in enumerate(args.rates):
        runs.append(Phase(f"rate-{report.rate_label(rate)}", args.num_requests, rate, None, args.seed + 1 + i))
    return runs


def write_dataset(tokenizer, phase: Phase, path: Path) -> Path:
    """The phase's realistic turns as vLLM's custom dataset (one JSON object a line)."""
    turns = realistic.make_realistic_turns(tokenizer, phase.num_prompts, phase.seed)
    path.write_text("".join(json.dumps({"prompt": t.content, "output_tokens": t.max_tokens}) + "\n" for t in turns))
    return path


def client_args(base_url: str, model_dir: Path, served_model: str, dataset: Path, phase: Phase) -> list[str]:
    """``vllm bench serve``'s command line for one phase against the server at ``base_url``."""
    args = ["--backend", "openai", "--endpoint", "/v1/completions", "--base-url", base_url,
            # --model names the tokenizer (the chat template, the prompt lengths); the API's model name apart
            "--model", str(model_dir), "--served-model-name", served_model,
            "--dataset-name", "custom", "--dataset-path", str(dataset), "--custom-output-len", "-1",
            "--num-prompts", str(phase.num_prompts),
            "--request-rate", "inf" if math.isinf(phase.rate) else str(phase.rate),
            "--seed", str(phase.seed), "--ignore-eos",
            "--temperature", str(realistic.TEMPERATURE), "--top-p", str(realistic.TOP_P),
            "--percentile-metrics", ",".join(METRICS), "--metric-percentiles", ",".join(QUANTILES), "--disable-tqdm"]
    if phase.max_concurrency is not None:
        args += ["--max-concurrency", str(phase.max_concurrency)]
    return args


def result_block(stdout: str) -> str:
    """The result block ``vllm bench serve`` prints (its ``= Serving Benchmark Result =`` banner to
    the closing rule), or "" when it printed none."""
    lines = stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if "Serving Benchmark Result" in line), None)
    if start is None:
        return ""
    end = next((i for i in range(start + 1, len(lines)) if set(lines[i].strip()) == {"="}), len(lines) - 1)
    return "\n".join(lines[start:end + 1])


def summarise(result: dict) -> dict:
    """The figures kept from one run's result (times in seconds, as bench_serving reports them)."""
    out = {"completed": result.get("completed"), "failed": result.get("failed"),
           "duration_s": round(result["duration"], 2), "req_s": round(result["request_throughput"], 4),
           "out_tok_s": round(result["output_throughput"], 2), "output_tokens": result.get("total_output_tokens"),
           "input_tokens": result.get("total_input_tokens"), "first_errors": result.get("first_errors") or []}
    for metric in METRICS:
        out[f"{metric}_s"] = {f"p{q}": _seconds(result.get(f"p{q}_{metric}_ms")) for q in QUANTILES}
        out[f"{metric}_s"]["mean"] = _seconds(result.get(f"mean_{metric}_ms"))
    return out


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else round(ms / 1000, 4)


def client_env() -> dict[str, str]:
    """The client's environment: no PYTHONPATH (ours ships a package named ``kernels``) and none of
    our engine's preloads."""
    env = cpu_preload.strip_env(dict(os.environ))
    env.pop("PYTHONPATH", None)
    return env | {"VLLM_NO_USAGE_STATS": "1", "TOKENIZERS_PARALLELISM": "false"}


def run_phase(python: Path, args: list[str], work: Path, timeout_s: float) -> tuple[dict, str]:
    """One ``vllm bench serve`` run; returns its result and its printed result block."""
    out = work / "result.json"
    out.unlink(missing_ok=True)
    done = subprocess.run([str(python), str(RUNNER), str(out), *args], env=client_env(), cwd=work,
                          capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"vllm bench serve exited with {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}")
    return json.loads(out.read_text()), result_block(done.stdout)


def served_model(base_url: str) -> str:
    """The first model ``GET /v1/models`` lists."""
    models = httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"]
    if not models:
        raise RuntimeError(f"the server at {base_url} lists no model")
    return models[0]["id"]


def sweep(python: Path, base_url: str, model_dir: Path, datasets: dict[str, Path], runs: list[Phase],
          work: Path, timeout_s: float, say) -> dict:
    """Every phase against one server: ``{label: summary}`` and ``blocks``, its printed results."""
    name = served_model(base_url)
    summaries, blocks = {}, {}
    for phase in runs:
        load = round(os.getloadavg()[0], 2)
        args = client_args(base_url, model_dir, name, datasets[phase.label], phase)
        result, blocks[phase.label] = run_phase(python, args, work, timeout_s)
        summaries[phase.label] = summarise(result) | {"load_avg_start": load,
                                                      "load_avg_end": round(os.getloadavg()[0], 2)}
        s = summaries[phase.label]
        say(f"{base_url} {phase.label}: {s['completed']}/{phase.num_prompts} ok, {s['out_tok_s']} out tok/s, "
            f"TTFT p50 {s['ttft_s']['p50']} s p99 {s['ttft_s']['p99']} s, TPOT p50 {s['tpot_s']['p50']} s")
    return {"phases": summaries, "blocks": blocks}


def compare(ours: dict, theirs: dict, peer: str = "vllm") -> dict:
    """Ours over the peer's per phase (TTFT p50/p99, TPOT p50: below 1 is better for us; output
    tokens/s: above 1), and the serving goals where the phases measure them.

    Returns:
        ``{"vs_<peer>": {label: ratios}, goals_key(peer): goals}``.
    """
    ratios = {}
    for label, mine in ours["phases"].items():
        other = theirs["phases"].get(label)
        if other is None:
            continue
        ratios[label] = {
            "out_tok_s_ratio": vllm_peer.ratio(mine["out_tok_s"], other["out_tok_s"]),
            "ttft_p50_ratio": vllm_peer.ratio(mine["ttft_s"]["p50"], other["ttft_s"]["p50"]),
            "ttft_p99_ratio": vllm_peer.ratio(mine["ttft_s"]["p99"], other["ttft_s"]["p99"]),
            "tpot_p50_ratio": vllm_peer.ratio(mine["tpot_s"]["p50"], other["tpot_s"]["p50"]),
        }
    goals: dict = {}
    if "rate-inf" in ratios:
        goals["saturation_ratio"] = ratios["rate-inf"]["out_tok_s_ratio"]
        goals["saturation_goal_met"] = (goals["saturation_ratio"] or 0) >= SATURATION_GOAL.get(peer, 1.0)
    for label, r in ratios.items():
        if label.startswith("rate-") and label != "rate-inf":
            goals[f"{label}_latency_no_worse"] = all(r[k] is not None and r[k] <= 1.0
                                                     for k in ("ttft_p99_ratio", "tpot_p50_ratio"))
    if ONE_AT_A_TIME in ratios:
        tpot, ttft = ratios[ONE_AT_A_TIME]["tpot_p50_ratio"], ratios[ONE_AT_A_TIME]["ttft_p50_ratio"]
        goals["one_at_a_time_tpot_no_worse"] = tpot is not None and tpot <= 1.0
        goals["one_at_a_time_tpot_goal_met"] = tpot is not None and tpot <= ONE_AT_A_TIME_TPOT_GOAL.get(peer, 1.0)
        goals["one_at_a_time_ttft_no_worse"] = ttft is not None and ttft <= 1.0
    return {f"vs_{peer}": ratios, goals_key(peer): goals}


def goals_key(peer: str) -> str:
    """Where ``compare`` puts the goals: ``goals`` for vLLM (as it always was: earlier runs and the
    docs read it), ``goals_vs_<peer>`` for another peer."""
    return "goals" if peer == "vllm" else f"goals_vs_{peer}"


def print_blocks(side: str, blocks: dict[str, str]) -> None:
    for label, block in blocks.items():
        print(f"\n[{side}, {label}]\n{block}")


def print_comparison(comparison: dict, peer: str = "vllm") -> None:
    print(f"\n{'phase':<16}{'tok/s x':>10}{'TTFT p50 x':>12}{'TTFT p99 x':>12}{'TPOT p50 x':>12}  "
          f"(ours / {PEER_NAMES[peer]})")
    for label, r in comparison[f"vs_{peer}"].items():
        cells = (r["out_tok_s_ratio"], r["ttft_p50_ratio"], r["ttft_p99_ratio"], r["tpot_p50_ratio"])
        print(f"{label:<16}" + "".join(f"{'-' if c is None else f'{c:.2f}':>{w}}"
                                       for c, w in zip(cells, (10, 12, 12, 12))))
    print(f"goals: {comparison[goals_key(peer)]}")


def run(args: argparse.Namespace, start_ours, say) -> dict:
    """Ours (``start_ours()``: a started stack and its HTTP base URL, or ``args.gateway``), then the
    ``--peer`` (vllm or llamacpp); returns the summary bench_serving prints as its JSON line."""
    from compute_service.model.model_loader import ensure_float_weights, load_tokenizer, resolve_model
    from benchmarks.serving.vllm_server import VllmServer
    from benchmarks.serving.llama_server import LlamaServer

    source = resolve_model(args.model)
    model_dir = source.path
    tokenizer = load_tokenizer(model_dir)
    python = vllm_peer.vllm_python()
    runs = phases(args)
    summary: dict = {"client": "vllm bench serve", "workload": "realistic", "phases": [p.__dict__ | {
        "rate": report.rate_label(p.rate)} for p in runs], "load_avg_start": round(os.getloadavg()[0], 2)}
    with tempfile.TemporaryDirectory(prefix="bench-serving-vllm-bench-") as tmp:
        work = Path(tmp)
        datasets = {p.label: write_dataset(tokenizer, p, work / f"{p.label}.jsonl") for p in runs}
        if args.gateway:
            ours = sweep(python, args.gateway.rstrip("/"), model_dir, datasets, runs, work, args.timeout_s, say)
        else:
            stack, base_url = start_ours()
            try:
                ours = sweep(python, base_url, model_dir, datasets, runs, work, args.timeout_s, say)
            finally:
                summary["exit_statuses"] = stack.stop()
        print_blocks("ours", ours["blocks"])
        summary["ours"] = ours["phases"]
        summary["ours_dtype"] = args.dtype or "auto"
        summary["ours_quantization"] = args.quantization or "auto"
        if args.peer == "vllm":
            ensure_float_weights(source)  # vLLM reads the directory as a float checkpoint
            server = VllmServer(model_dir, args.kv_cache_bytes, args.max_num_seqs, args.max_num_batched_tokens,
                                ngram_k=args.vllm_ngram, log_file=work / "vllm.log", dtype=args.vllm_dtype)
            say(f"vllm {args.vllm_dtype}: starting its OpenAI server (compiles its model, ~1-2 min, not timed)")
            with server:
                theirs = sweep(python, server.base_url, model_dir, datasets, runs, work, args.timeout_s, say)
            summary["vllm"] = theirs["phases"] | {"dtype": args.vllm_dtype, "env": server.settings,
                                                  "exit_status": server.stop()}
            print_blocks(f"vLLM {args.vllm_dtype}", theirs["blocks"])
        elif args.peer == "llamacpp":
            server = LlamaServer(Path(args.llama_server), Path(args.llama_gguf), num_slots=args.llama_slots,
                                 ctx_per_slot=args.llama_ctx, extra_args=tuple(args.llama_args),
                                 log_file=work / "llama-server.log")
            say(f"llama.cpp: starting llama-server on {args.llama_gguf} ({args.llama_slots} slots, not timed)")
            with server:
                command = server.command(server.port)
                theirs = sweep(python, server.base_url, model_dir, datasets, runs, work, args.timeout_s, say)
            summary["llamacpp"] = theirs["phases"] | {
                "binary": str(server.binary), "gguf": str(server.gguf), "slots": server.num_slots,
                "ctx_per_slot": server.ctx_per_slot, "threads": server.threads, "args": list(server.extra_args),
                "command": command, "exit_status": server.stop()}
            print_blocks("llama.cpp", theirs["blocks"])
        if args.peer:
            comparison = compare(ours, theirs, args.peer)
            print_comparison(comparison, args.peer)
            summary |= comparison
    summary["load_avg_end"] = round(os.getloadavg()[0], 2)
    return summary
