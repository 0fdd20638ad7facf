"""bench_serving end to end on a tiny random-weight Llama (byte-level tokenizer): it starts its own
two stacks (memory, compute, gateway), streams every request through the gateway at two rates, and
leaves no process, socket, directory or shared-memory segment behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from pagedserve_testing.tiny_model import build_service_model
from pagedserve.stack import shm_segments

ROOT = Path(__file__).resolve().parents[2]
NUM_REQUESTS = 6


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_tiny_run_reports_every_rate_prefix_caching_and_cleans_up(tmp_path: Path) -> None:
    model = build_service_model(tmp_path / "model")
    plots = tmp_path / "plots"
    cmd = [sys.executable, "-m", "benchmarks.bench_serving", "--workload", "random", "--model", str(model.path),
           "--rates", "4", "inf",
           "--num-requests", str(NUM_REQUESTS), "--prompt-len", "16", "64", "--output-len", "8", "24",
           "--prefix-tokens", "200", "--question-tokens", "8", "--prefix-requests", "3", "--block-size", "4",
           "--kv-cache-bytes", str(4 << 20), "--kv-sample-interval-s", "0.01", "--plot-dir", str(plots),
           "--report-stack"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])

    assert summary["block_size"] == 4 and summary["model"]  # as the gateway reports them
    assert [run["rate"] for run in summary["rates"]] == ["4", "inf"]
    for run in [summary["baseline"], *summary["rates"]]:
        assert run["num_requests"] == run["num_ok"] == NUM_REQUESTS and run["errors"] == {}
        # ignore_eos: every request streams exactly max_tokens, and the replies' usage agrees.
        assert run["output_tokens"] == run["expected_output_tokens"] == run["usage_completion_tokens"]
        assert run["req_s"] > 0 and run["out_tok_s"] > 0
        for metric in ("ttft_s", "tpot_s", "e2e_s"):
            p50, p90, p99 = (run[metric][q] for q in ("p50", "p90", "p99"))
            assert 0 < p50 <= p90 <= p99
        # Each request's TTFT is at most its e2e latency, so every order statistic is too.
        assert all(run["ttft_s"][q] <= run["e2e_s"][q] for q in ("p50", "p90", "p99"))
    for run in summary["rates"]:
        assert run["throughput_gain"] > 0 and run["p99_e2e_ratio"] > 0
    assert summary["ttft_bound_s"] == 2.0
    assert summary["max_rate_ttft_p99_under_bound"] in (None, "4", "inf")
    assert summary["claim_holds_up_to_rate"] in (None, "4", "inf")

    prefix = summary["prefix"]
    assert prefix["num_ok"] == 2 * 3
    # With the cache, the shared system prompt's full blocks come from it; without, nothing does.
    assert prefix["cached_tokens_mean"] >= 200 - 8 and prefix["uncached_cached_tokens_max"] == 0
    assert prefix["uncached_mode"] == "memory service --enable-prefix-caching false"
    assert summary["prefix_ttft_speedup"] == prefix["ttft_speedup"] > 0

    assert summary["kv_num_samples"] > 0 and 0 < summary["kv_peak_used_fraction"] <= 1
    # The 4 MiB pool (2,048 blocks of 4 tokens) holds all the run writes (under 1,000 blocks): no
    # cached block had to be evicted, and the count says so.
    assert summary["kv_evictions"] == 0
    assert sorted(Path(p).name for p in summary["plots"]) == ["serving_kv_usage.png", "serving_latency.png"]
    for path in summary["plots"]:
        assert 0 < Path(path).stat().st_size < 200_000

    stack = summary["stack"]
    assert stack["exit_statuses"] == [{"gateway": 0, "compute_service": 0, "memory_service": 0}] * 2
    assert len(stack["pids"]) == 6 and not any(_is_alive(pid) for pid in stack["pids"])
    assert not any(Path(d).exists() for d in stack["runtime_dirs"])  # sockets and logs with them
    memory_pids = stack["pids"][0::3]
    assert not [p for pid in memory_pids for p in shm_segments(pid)]


def test_tiny_run_through_the_openai_http_front(tmp_path: Path) -> None:
    """``--api openai``: the same workload as streamed /v1/completions through the gateway's HTTP front."""
    model = build_service_model(tmp_path / "model")
    cmd = [sys.executable, "-m", "benchmarks.bench_serving", "--workload", "random", "--api", "openai",
           "--model", str(model.path),
           "--rates", "inf", "--num-requests", "4", "--prompt-len", "16", "32", "--output-len", "8", "16",
           "--prefix-tokens", "100", "--question-tokens", "8", "--prefix-requests", "2", "--block-size", "4",
           "--kv-cache-bytes", str(4 << 20), "--kv-sample-interval-s", "0.05", "--report-stack"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["api"] == "openai" and summary["model"]
    for run in [summary["baseline"], *summary["rates"]]:
        assert run["num_requests"] == run["num_ok"] == 4 and run["errors"] == {}
        assert run["output_tokens"] == run["expected_output_tokens"] == run["usage_completion_tokens"]
        assert 0 < run["ttft_s"]["p50"] <= run["e2e_s"]["p50"]
    # cached_tokens come back through usage.prompt_tokens_details as the gRPC usage carries them.
    assert summary["prefix"]["cached_tokens_mean"] >= 100 - 8 and summary["prefix"]["uncached_cached_tokens_max"] == 0
    assert summary["stack"]["exit_statuses"] == [{"gateway": 0, "compute_service": 0, "memory_service": 0}] * 2
