"""bench_kv_tier at toy sizes on a tiny random-weight Llama: every scenario reports its figures, the
tier's answers are the recomputed ones, and its temporary directories are removed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_kv_tier_reports_every_scenario(make_tiny_model, tmp_path: Path) -> None:
    tiny = make_tiny_model("llama")  # vocabulary 128, 256 positions
    cmd = [sys.executable, "-m", "benchmarks.bench_kv_tier", "--model", str(tiny.path), "--vocab", "128",
           "--prompt-tokens", "96", "--pool-extra-tokens", "64", "--docs", "4", "--doc-tokens", "64",
           "--requests", "6", "--no-reuse-prompts", "2", "--no-reuse-rounds", "2", "--no-reuse-tokens", "64",
           "--probe-mb", "4", "--dir", str(tmp_path)]
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    returning, restart = summary["returning"], summary["warm_restart"]
    assert returning["same_tokens"] and restart["same_tokens"]
    assert returning["cached_share"] == 0.833 and returning["tier_loads"] >= 1  # 80 of 96 tokens: 5 blocks
    assert restart["cached_share"] == 0.833
    assert summary["working_set"]["tier"]["hit_rate"] >= summary["working_set"]["no_tier"]["hit_rate"]
    assert summary["working_set"]["tier"]["tier_loads"] >= 0 and "tier_loads" not in summary["working_set"]["no_tier"]
    assert summary["no_reuse"]["tier_tok_s"] > 0 and summary["disk"]["cold_read_mb_s"] > 0
    assert list(tmp_path.iterdir()) == []


def test_bench_kv_tier_returning_host_scenario(make_tiny_model, tmp_path: Path) -> None:
    """``--scenarios returning_host``: the returning prompt from the host tier and from the disk, each
    with the recomputed tokens and the cached share of the disk's."""
    tiny = make_tiny_model("llama")
    cmd = [sys.executable, "-m", "benchmarks.bench_kv_tier", "--model", str(tiny.path), "--vocab", "128",
           "--prompt-tokens", "96", "--pool-extra-tokens", "64", "--probe-mb", "4", "--dir", str(tmp_path),
           "--scenarios", "returning_host", "--host-bytes", str(8 << 20)]
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])["returning_host"]
    assert figures["host_same_tokens"] and figures["disk_same_tokens"]
    assert figures["host_cached_share"] == figures["disk_cached_share"] == 0.833  # 80 of 96 tokens: 5 blocks
    assert figures["host_loads"] >= 1 and figures["disk_loads"] >= 1
    assert figures["host_speedup"] > 0 and figures["disk_speedup"] > 0
    assert list(tmp_path.iterdir()) == []
