"""bench_throughput end to end on a tiny random-weight Llama: its JSON line carries the engine, the
two strongest transformers baselines (same greedy tokens) and the per-component step profile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_run_reports_baselines_profile_and_recompute() -> None:
    cmd = [sys.executable, "-m", "benchmarks.bench_throughput", "--random-model-config", "tiny", "--threads", "1",
           "--num-requests", "6", "--prompt-len", "8", "24", "--output-len", "4", "8", "--baseline-requests", "4",
           "--static-batch-sizes", "2", "4", "--kv-cache-bytes", "4MiB", "--profile", "--profile-seqs", "3",
           "--profile-steps", "1", "--dtype", "float32"]  # token agreement with the baselines: float32
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    for name in ("engine", "hf_static_best", "hf_cb_default"):
        assert summary[f"{name}_tok_s"] > 0
    assert summary["hf_static_best_batch_size"] in (2, 4)
    assert set(summary["hf_static_tok_s_by_batch_size"]) == {"2", "4"}
    assert summary["hf_static_best_token_agreement"] == summary["hf_cb_default_token_agreement"] == 1.0
    assert summary["hf_cb_default_page_size"] == 256  # transformers' own default
    # Each needed K/V comes from the model or the prefix cache; only a preemption makes one twice.
    assert summary["preemptions"] > 0 or summary["recomputed_tokens"] == 0
    assert summary["computed_tokens"] > 0 and summary["prefix_cached_tokens"] >= 0
    for step in ("decode", "prefill"):
        profile = summary["profile"][step]
        # Every labelled part of the model was recorded (a label the profiler missed reads 0 ms).
        assert profile["step_ms"] > 0 and all(profile["ms"][part] > 0 for part in ("attention", "qkv_proj", "mlp_down"))
    assert summary["profile"]["decode"]["seqs"] == 3
