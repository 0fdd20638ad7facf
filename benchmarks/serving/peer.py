"""``bench_serving --peer vllm``: the same requests, baseline and rates against vLLM's OpenAI server,
after our stack has stopped, and the side-by-side figures.

The requests are the very same texts (made from our tokenizer's tokens per word, same seed), sent
with the same Poisson arrival times. The comparison, per rate, puts ours over vLLM's: TPOT p50 and
TTFT p99 (below 1 is better for us), output tokens/s (above 1 is better), and checks the serving
goal: at every rate TPOT p50 and TTFT p99 no worse than vLLM's, saturation throughput >= 1.5x (issue 39).
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from benchmarks import vllm_peer
from benchmarks.serving import vllm_bench, vllm_client
from benchmarks.serving import report as report
from benchmarks.serving.workload import RequestSpec, poisson_arrivals
from benchmarks.serving.vllm_server import VllmServer

SATURATION_GOAL = vllm_bench.SATURATION_GOAL["vllm"]  # our saturation output tokens/s over vLLM's (issue 39)


async def sweep(base_url: str, model: str, specs: list[RequestSpec], args: argparse.Namespace, say) -> dict:
    """Warm-up, the unloaded baseline and every rate, with the arrival seeds bench_serving uses."""
    warmup = RequestSpec("Hello, how are you today?", 4)
    # The cache salts are bench_serving's own for each phase, so that neither side reuses a prompt
    # another phase computed (the rates send the same texts).
    await vllm_client.run_one_at_a_time(base_url, model, [warmup], "warmup", args.timeout_s)
    baseline = await vllm_client.run_one_at_a_time(base_url, model, specs[: args.baseline_requests], "baseline",
                                                   args.timeout_s)
    say(f"vllm unloaded baseline: {len(baseline)} requests done")
    runs = []
    for i, rate in enumerate(args.rates):
        arrivals = poisson_arrivals(len(specs), rate, args.seed + 1 + i)
        results = await vllm_client.run_arrivals(base_url, model, specs, arrivals, f"rate-{report.rate_label(rate)}",
                                                 args.timeout_s)
        runs.append((rate, results))
        say(f"vllm rate {report.rate_label(rate)}: {sum(r.ok for r in results)}/{len(results)} ok")
    summary_baseline = report.summarise(baseline)
    summary_runs = [report.summarise(res, rate) for rate, res in runs]
    headline = report.analyse(summary_baseline, summary_runs, args.ttft_bound_s)
    return {**headline, "baseline": summary_baseline, "rates": summary_runs}


def run_vllm(model_dir: Path, specs: list[RequestSpec], args: argparse.Namespace, log_file: Path, say) -> dict:
    """Start vLLM's server, run the sweep of ``specs`` (the requests our side was sent), stop it;
    returns its summary (bench_serving's shape)."""
    server = VllmServer(model_dir, args.kv_cache_bytes, args.max_num_seqs, args.max_num_batched_tokens,
                        ngram_k=args.vllm_ngram, log_file=log_file, dtype=args.vllm_dtype)
    say(f"vllm {args.vllm_dtype}: starting its OpenAI server (compiles its model, ~1-2 min, not timed)")
    with server:
        summary = asyncio.run(sweep(server.base_url, server.served_model, specs, args, say))
    summary["exit_status"] = server.stop()
    summary["env"] = server.settings
    summary["ngram_k"] = args.vllm_ngram
    summary["dtype"] = args.vllm_dtype
    return summary


def _get(run: dict, metric: str, q: str) -> float | None:
    return (run.get(metric) or {}).get(q)


def compare(ours: dict, theirs: dict) -> dict:
    """Ours over vLLM's, per rate and at saturation, and whether the serving goal is met.

    Args:
        ours, theirs: bench_serving summaries (``rates``: per rate, ``saturation_out_tok_s``).
    """
    theirs_by_rate = {run["rate"]: run for run in theirs["rates"]}
    per_rate = []
    for run in ours["rates"]:
        peer = theirs_by_rate.get(run["rate"])
        if peer is None:
            continue
        row = {"rate": run["rate"],
               "tpot_p50_ratio": vllm_peer.ratio(_get(run, "tpot_s", "p50"), _get(peer, "tpot_s", "p50")),
               "ttft_p99_ratio": vllm_peer.ratio(_get(run, "ttft_s", "p99"), _get(peer, "ttft_s", "p99")),
               "out_tok_s_ratio": vllm_peer.ratio(run["out_tok_s"], peer["out_tok_s"]),
               "vllm_tpot_p50_s": _get(peer, "tpot_s", "p50"), "vllm_ttft_p99_s": _get(peer, "ttft_s", "p99"),
               "vllm_out_tok_s": peer["out_tok_s"], "vllm_num_ok": peer["num_ok"]}
        row["no_worse"] = all(row[k] is not None and row[k] <= 1.0 for k in ("tpot_p50_ratio", "ttft_p99_ratio"))
        per_rate.append(row)
    saturation = vllm_peer.ratio(ours["saturation_out_tok_s"], theirs["saturation_out_tok_s"])
    return {
        "vllm_saturation_out_tok_s": theirs["saturation_out_tok_s"],
        "saturation_ratio_vs_vllm": saturation,
        "vs_vllm": per_rate,
        "goal_latency_no_worse_every_rate": bool(per_rate) and all(r["no_worse"] for r in per_rate),
        "goal_saturation_met": saturation is not None and saturation >= SATURATION_GOAL,
    }


def print_comparison(comparison: dict) -> None:
    print(f"\n{'rate':>9}{'TPOT p50 x':>12}{'TTFT p99 x':>12}{'tok/s x':>10}{'vLLM TPOT ms':>14}"
          f"{'vLLM TTFT99 ms':>16}{'vLLM tok/s':>12}  (ours / vLLM)")
    for row in comparison["vs_vllm"]:
        cells = [row["tpot_p50_ratio"], row["ttft_p99_ratio"], row["out_tok_s_ratio"]]
        tpot, ttft = row["vllm_tpot_p50_s"], row["vllm_ttft_p99_s"]
        print(f"{row['rate']:>9}" + "".join(f"{'-' if c is None else f'{c:.2f}':>{w}}"
                                            for c, w in zip(cells, (12, 12, 10)))
              + f"{'-' if tpot is None else f'{tpot * 1e3:.0f}':>14}{'-' if ttft is None else f'{ttft * 1e3:.0f}':>16}"
              f"{row['vllm_out_tok_s']:>12.1f}")
    print(f"saturation: {comparison['saturation_ratio_vs_vllm']}x vLLM's {comparison['vllm_saturation_out_tok_s']} "
          f"out tok/s (goal >= {SATURATION_GOAL}: {comparison['goal_saturation_met']}); latency no worse at every "
          f"rate: {comparison['goal_latency_no_worse_every_rate']}")

