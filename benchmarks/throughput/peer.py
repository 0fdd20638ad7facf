"""``bench_throughput --peer vllm``: vLLM's CPU build on the same seeded workload, after our engine.

Each setting of ``--vllm-budgets`` (``max_num_seqs:max_num_batched_tokens[:ngram_k]``; default:
our budgets, with and without vLLM's n-gram speculative decoding, since ours drafts too) is one
vLLM process (benchmarks/throughput/vllm_offline.py in vLLM's venv), started after our engine has
finished and been closed, so that the two never share the CPUs. The best setting is the peer's
figure; every one is reported.

``ngram_k`` > 0 runs vLLM with ``speculative_config={"method": "ngram", "num_speculative_tokens":
ngram_k, "prompt_lookup_min": 1, "prompt_lookup_max": 4}``, the same n-gram sizes as our proposer.
"""

from __future__ import annotations

import json
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


def run_vllm(model_dir: Path, workload: list[Request], kv_cache_bytes: int, dtype: str, seed: int,
             budgets: list[Budget], say=print) -> RunResult:
    """vLLM on ``workload`` once per budget; returns the fastest run, with every run in ``extra``."""
    python = vllm_peer.vllm_python()
    env, settings = vllm_peer.vllm_env(python, kv_cache_bytes)
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        for budget in budgets:
            job = {"model": str(model_dir), "dtype": dtype, "seed": seed, "engine_args": engine_args(budget),
                   "requests": [[r.prompt_token_ids, r.max_tokens] for r in workload]}
            in_path, out_path, log_path = (Path(tmp) / n for n in ("in.json", "out.json", "vllm.log"))
            in_path.write_text(json.dumps(job))
            say(f"vllm: {job['engine_args']} (startup, compile included, ~1-2 min, is not timed)")
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
            runs.append(result)
            say(f"vllm: {result['generated_tokens']} tokens in {result['wall_s']:.1f} s = "
                f"{result['generated_tokens'] / result['wall_s']:.2f} tok/s")
    best = min(runs, key=lambda r: r["wall_s"] / r["generated_tokens"])
    return RunResult("vllm", len(workload), best["generated_tokens"], best["wall_s"], best["outputs"], {
        "vllm_version": best["vllm_version"],
        "vllm_best_engine_args": best["engine_args"],
        "vllm_runs": [{**r["engine_args"], "tok_s": round(r["generated_tokens"] / r["wall_s"], 2),
                       "startup_s": r["startup_s"]} for r in runs],
        "vllm_env": settings,
    })
