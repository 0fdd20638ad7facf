"""``bench_throughput --peer vllm``: vLLM's CPU build on the same seeded workload, after our engine.

Each dtype of ``--vllm-dtypes`` (default: ours) and each setting of ``--vllm-budgets``
(``max_num_seqs:max_num_batched_tokens[:ngram_k]``; default: our budgets, and for a greedy workload
also with vLLM's n-gram speculative decoding, since ours drafts greedy requests too) is one vLLM
process (benchmarks/throughput/vllm_offline.py in vLLM's venv), started after our engine has
finished and been closed, so that the two never share the CPUs. The best run is the peer's
figure; every one is reported, and the best of each dtype.

``ngram_k`` > 0 runs vLLM with ``speculative_config={"method": "ngram", "num_speculative_tokens":
ngram_k, "prompt_lookup_min": 1, "prompt_lookup_max": 4}``, the same n-gram sizes as our proposer.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks import vllm_peer
from benchmarks.throughput.workload import Request, RunResult

OFFLINE_SCRIPT = Path(__file__).with_name("vllm_offline.py")


Budget = tuple[int, int, int]  # max_num_seqs, max_num_batched_tokens, n-gram drafts (0 = none)


def parse_budgets(text: str) -> list[Budget]:
    """``"256:2048,256:2048:2"`` -> [(256, 2048, 0), (256, 2048, 2)]: vLLM's max_num_seqs,
    max_num_batched_tokens and n-gram speculative tokens (optional, 0 = off), one run each."""
    budgets = []
    for item in text.split(","):
        fields = item.strip().split(":")
        try:
            if len(fields) not in (2, 3):
                raise ValueError
            budget = (int(fields[0]), int(fields[1]), int(fields[2]) if len(fields) == 3 else 0)
        except ValueError:
            raise ValueError(f"a vLLM budget is MAX_NUM_SEQS:MAX_NUM_BATCHED_TOKENS[:NGRAM_K], got {item!r}") from None
        if min(budget[:2]) <= 0 or budget[2] < 0:
            raise ValueError(f"vLLM budgets must be positive (NGRAM_K >= 0), got {item!r}")
        budgets.append(budget)
    if not budgets:
        raise ValueError("no vLLM budget given")
    return budgets


def ngram_config(k: int) -> dict:
    """vLLM's speculative_config for ``k`` n-gram drafts, with our proposer's n-gram sizes (1-4)."""
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 4}


def engine_args(budget: Budget) -> dict:
    """vLLM's LLM keyword arguments for one budget."""
    max_num_seqs, max_num_batched_tokens, ngram_k = budget
    args: dict = {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens}
    if ngram_k:
        args["speculative_config"] = ngram_config(ngram_k)
    return args


def offline_job(model_dir: Path, workload: list[Request], dtype: str, seed: int, budget: Budget) -> dict:
    """vllm_offline.py's input: each request with its own sampling (greedy or temperature/top_p)."""
    return {"model": str(model_dir), "dtype": dtype, "seed": seed, "engine_args": engine_args(budget),
            "requests": [[r.prompt_token_ids, r.max_tokens, r.temperature, r.top_p] for r in workload]}


def run_vllm(model_dir: Path, workload: list[Request], kv_cache_bytes: int, dtypes: list[str], seed: int,
             budgets: list[Budget], say=print) -> RunResult:
    """vLLM on ``workload`` once per dtype and budget; returns the fastest run, with every run and
    each dtype's best in ``extra``."""
    python = vllm_peer.vllm_python()
    env, settings = vllm_peer.vllm_env(python, kv_cache_bytes)
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        for dtype, budget in ((d, b) for d in dtypes for b in budgets):
            job = offline_job(model_dir, workload, dtype, seed, budget)
            in_path, out_path, log_path = (Path(tmp) / n for n in ("in.json", "out.json", "vllm.log"))
            in_path.write_text(json.dumps(job))
            say(f"vllm {dtype}: {job['engine_args']} (startup, compile included, ~1-2 min, is not timed)")
            started = time.perf_counter()
            kmp_before = vllm_peer.kmp_files()
            with open(log_path, "w") as log:
                proc = subprocess.run([str(python), str(OFFLINE_SCRIPT), str(in_path), str(out_path)], env=env,
                                      stdout=log, stderr=subprocess.STDOUT, cwd=tmp)
            vllm_peer.remove_stale_kmp_files(kmp_before)
            if proc.returncode != 0:
                tail = log_path.read_text()[-3000:]
                raise RuntimeError(f"vLLM exited with {proc.returncode}; its log ends:\n{tail}")
            result = json.loads(out_path.read_text())
            result["process_s"] = round(time.perf_counter() - started, 1)
            result["load_avg"] = round(os.getloadavg()[0], 2)
            runs.append(result)
            say(f"vllm {dtype}: {result['generated_tokens']} tokens in {result['wall_s']:.1f} s = "
                f"{result['generated_tokens'] / result['wall_s']:.2f} tok/s")
    def tok_s(run: dict) -> float:
        return run["generated_tokens"] / run["wall_s"]

    best = max(runs, key=tok_s)
    return RunResult("vllm", len(workload), best["generated_tokens"], best["wall_s"], best["outputs"], {
        "vllm_version": best["vllm_version"],
        "vllm_best_dtype": best["dtype"],
        "vllm_best_engine_args": best["engine_args"],
        # Each dtype's best run: vLLM at bf16 and at float32 side by side (bf16 ~2x here).
        **{f"vllm_{d}_tok_s": round(max(tok_s(r) for r in runs if r["dtype"] == d), 2) for d in dtypes},
        "vllm_runs": [{"dtype": r["dtype"], **r["engine_args"], "tok_s": round(tok_s(r), 2),
                       "startup_s": r["startup_s"], "load_avg": r["load_avg"]} for r in runs],
        "vllm_env": settings,
    })
