"""Figures of the serving benchmark from the clients' per-request results: percentiles per run, the
highest rate under a TTFT bound, and the source document's throughput-vs-latency claim.

The claim ("the throughput gain while P99 latency stays within 120% of the unloaded baseline")
is tested on p99 *end-to-end* latency: the source speaks of request latency, and every rate and
the unloaded baseline run the very same requests (same prompts, same output lengths), so the raw
p99 compares like with like. TTFT alone would hide the slower decode of a full batch, TPOT alone
the time spent queueing; both ratios are reported beside it. "Throughput gain" is output tokens/s
at a rate over that of the baseline, which serves the same requests one at a time; the source's
figure is a 95% gain (1.95x).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Callable

from benchmarks.serving.client import RequestResult

CLAIM_LATENCY_LIMIT = 1.2  # p99 latency at most 120% of the unloaded baseline's
CLAIM_THROUGHPUT_GAIN = 1.95  # "95% throughput gain"
PERCENTILES = (50, 90, 99)


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50/p90/p99 (linear interpolation between order statistics); None without values."""
    if not values:
        return {f"p{q}": None for q in PERCENTILES}
    if len(values) == 1:
        return {f"p{q}": round(values[0], 4) for q in PERCENTILES}
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {f"p{q}": round(cuts[q - 1], 4) for q in PERCENTILES}


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def summarise(results: list[RequestResult], rate: float | None = None) -> dict:
    """One run's figures. Throughput counts the tokens of finished requests over the run's span,
    from the first request sent to the last one finished."""
    ok = [r for r in results if r.ok]
    span = max(r.finished_at for r in results) - min(r.sent_at for r in results)
    output_tokens = sum(r.output_tokens for r in ok)
    summary: dict = {} if rate is None else {"rate": rate_label(rate)}
    summary |= {
        "num_requests": len(results),
        "num_ok": len(ok),
        "errors": dict(Counter(r.status for r in results if not r.ok)),
        "duration_s": round(span, 2),
        "req_s": round(len(ok) / span, 4),
        "out_tok_s": round(output_tokens / span, 2),
        "output_tokens": output_tokens,
        "expected_output_tokens": sum(r.max_tokens for r in results),
        "usage_completion_tokens": sum(r.usage_tokens for r in ok),  # the replies' own count
        "prompt_tokens_mean": round(statistics.fmean(r.prompt_tokens for r in ok), 1) if ok else None,
        # Prompt tokens the server found in its prefix cache (its usage's cached-token count): each
        # phase has its own cache salt, so this stays ~0 unless prompts repeat within the phase.
        "cached_prompt_tokens": sum(r.cached_tokens for r in ok),
        "ttft_s": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_s": percentiles([r.tpot_s for r in ok if r.tpot_s is not None]),
        "e2e_s": percentiles([r.e2e_s for r in ok]),
    }
    return summary


def _highest_rate(runs: list[dict], passes: Callable[[dict], bool]) -> str | None:
    """The highest rate up to which every run passes (runs in increasing rate order), else None."""
    best = None
    for run in runs:
        if not passes(run):
            break
        best = run["rate"]
    return best


def _all_ok(run: dict) -> bool:
    return run["num_ok"] == run["num_requests"] and run["e2e_s"]["p99"] is not None


def analyse(baseline: dict, runs: list[dict], ttft_bound_s: float) -> dict:
    """Adds each run's ratios to the baseline (in place) and returns the headline figures."""
    for run in runs:
        run["throughput_gain"] = round(run["out_tok_s"] / baseline["out_tok_s"], 3)
        for metric in ("e2e_s", "tpot_s", "ttft_s"):
            loaded, unloaded = run[metric]["p99"], baseline[metric]["p99"]
            run[f"p99_{metric[:-2]}_ratio"] = round(loaded / unloaded, 3) if loaded and unloaded else None
    holds_up_to = _highest_rate(runs, lambda r: _all_ok(r) and r["p99_e2e_ratio"] <= CLAIM_LATENCY_LIMIT)
    at = next((r for r in runs if r["rate"] == holds_up_to), None)
    return {
        "ttft_bound_s": ttft_bound_s,
        "max_rate_ttft_p99_under_bound": _highest_rate(runs, lambda r: _all_ok(r)
                                                       and r["ttft_s"]["p99"] <= ttft_bound_s),
        "claim_latency": "p99 end-to-end latency, same requests as the unloaded baseline",
        "claim_latency_limit": CLAIM_LATENCY_LIMIT,
        "claim_holds_up_to_rate": holds_up_to,
        "throughput_gain_at_that_rate": at["throughput_gain"] if at else None,
        "claim_95pct_gain_met": bool(at and at["throughput_gain"] >= CLAIM_THROUGHPUT_GAIN),
        "max_throughput_gain": max(r["throughput_gain"] for r in runs),
        "saturation_out_tok_s": max(r["out_tok_s"] for r in runs),
    }


def _cell(values: dict[str, float | None], scale: float = 1.0) -> str:
    return "/".join("-" if v is None else f"{v * scale:.0f}" for v in values.values())


def print_table(baseline: dict, runs: list[dict]) -> None:
    """One row per run: throughput, then p50/p90/p99 of TTFT, TPOT and e2e latency in ms."""
    print(f"\n{'rate':>9}{'ok/n':>8}{'req/s':>8}{'tok/s':>8}{'TTFT ms p50/90/99':>21}{'TPOT ms p50/90/99':>19}"
          f"{'e2e ms p50/90/99':>22}{'gain':>7}{'p99e2e x':>9}  errors")
    for run in [baseline, *runs]:
        print(f"{run.get('rate', 'unloaded'):>9}{run['num_ok']:>5}/{run['num_requests']:<2}{run['req_s']:>8.3f}"
              f"{run['out_tok_s']:>8.1f}{_cell(run['ttft_s'], 1e3):>21}{_cell(run['tpot_s'], 1e3):>19}"
              f"{_cell(run['e2e_s'], 1e3):>22}{run.get('throughput_gain', 1.0):>7.2f}"
              f"{run.get('p99_e2e_ratio', 1.0) or 0:>9.2f}  {run['errors'] or ''}")


def print_headline(headline: dict, prefix: dict | None) -> None:
    print(f"\nhighest rate with p99 TTFT <= {headline['ttft_bound_s']} s (--ttft-bound-s): "
          f"{headline['max_rate_ttft_p99_under_bound']} req/s")
    print(f"source claim, p99 latency within {CLAIM_LATENCY_LIMIT:.0%} of unloaded ({headline['claim_latency']}): "
          f"holds up to {headline['claim_holds_up_to_rate']} req/s, throughput gain there "
          f"{headline['throughput_gain_at_that_rate']}x (source: {CLAIM_THROUGHPUT_GAIN}x; met: "
          f"{headline['claim_95pct_gain_met']}); best gain at any rate {headline['max_throughput_gain']}x")
    if prefix is not None:
        print(f"shared prefix ({prefix['prompt_tokens_mean']:.0f}-token prompts, {prefix['num_requests']} one at a "
              f"time): TTFT p50 {prefix['cached_ttft_p50_s'] * 1e3:.0f} ms with prefix caching "
              f"({prefix['cached_tokens_mean']:.0f} cached tokens), {prefix['uncached_ttft_p50_s'] * 1e3:.0f} ms "
              f"without ({prefix['uncached_mode']}): {prefix['ttft_speedup']}x")


def prefix_summary(cached: list[RequestResult], uncached: list[RequestResult], uncached_mode: str) -> dict:
    """TTFT of the shared-prefix requests with the prefix cache against without it (p50 and mean)."""
    def ttfts(results: list[RequestResult]) -> list[float]:
        return [r.ttft_s for r in results if r.ok and r.ttft_s is not None]

    with_cache, without = ttfts(cached), ttfts(uncached)
    return {
        "num_requests": len(cached),
        "num_ok": sum(r.ok for r in cached) + sum(r.ok for r in uncached),
        "prompt_tokens_mean": statistics.fmean(r.prompt_tokens for r in cached),
        "cached_tokens_mean": statistics.fmean(r.cached_tokens for r in cached),
        "uncached_cached_tokens_max": max(r.cached_tokens for r in uncached),
        "cached_ttft_p50_s": round(statistics.median(with_cache), 4),
        "uncached_ttft_p50_s": round(statistics.median(without), 4),
        "cached_ttft_mean_s": round(statistics.fmean(with_cache), 4),
        "uncached_ttft_mean_s": round(statistics.fmean(without), 4),
        "ttft_speedup": round(statistics.median(without) / statistics.median(with_cache), 2),
        "uncached_mode": uncached_mode,
    }
