"""Resident memory of the whole stack against what it serves: the model file plus the KV pool.

Starts memory, compute and gateway as real processes (benchmarks/serving/stack.py, as ``pagedserve
up`` does), reads each one's proportional set size (``/proc/PID/smaps_rollup``: a page shared by
two processes counts half in each, so the KV pool both map counts once), then sends ``--requests``
prompts at once of about ``--prompt-tokens`` tokens of English text, ``--max-tokens`` tokens each,
and reads them again, right after the requests and after ``--idle-s`` seconds idle (when the compute
service has handed its steps' memory back). The goal it checks (issue 40): the stack's resident size
within 15% of the file's size plus the KV pool.

    python -m benchmarks.bench_resident --model path/to/model.gguf [--kv-cache-bytes 2147483648]

Per service and moment: PSS and its anonymous, file and shared-memory parts (MiB). The file's size is
the GGUF's (or a directory's weight files). Prints a table, then as its last line one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

from benchmarks.serving.client import run_arrivals
from benchmarks.serving.stack import StackConfig, start_stacks
from benchmarks.serving.workload import RequestSpec
from benchmarks.throughput.realistic import english_text
from pagedserve.stack import shm_segments

MIB = 1 << 20
# smaps_rollup fields read, in kB.
_FIELDS = {"Pss": "pss", "Pss_Anon": "anon", "Pss_File": "file", "Pss_Shmem": "shmem"}
GOAL_RATIO = 1.15


def pss(pid: int) -> dict[str, float]:
    """The process's PSS and its parts, MiB."""
    found: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in _FIELDS:
            found[_FIELDS[key]] = round(int(rest.split()[0]) / 1024, 1)
    return found


def model_bytes(model: str) -> int:
    """The size of what is served: the GGUF file, or a directory's weight files."""
    path = Path(model).expanduser()
    if path.is_file():
        return path.stat().st_size
    if model == "default":
        from compute_service.model.model_loader import default_gguf_path

        return default_gguf_path().stat().st_size
    files = sorted(path.glob("*.safetensors")) or sorted(path.glob("pytorch_model*.bin"))
    return sum(f.stat().st_size for f in files)


def prompts(num: int, num_tokens: int, max_tokens: int) -> list[RequestSpec]:
    """``num`` distinct stretches of English text of about ``num_tokens`` tokens (4 characters a token):
    no two share a prefix, so each takes blocks of its own."""
    text = english_text()
    chars = num_tokens * 4
    return [RequestSpec(prompt=text[i * chars:(i + 1) * chars], max_tokens=max_tokens) for i in range(num)]


def snapshot(services: dict[str, int]) -> dict[str, dict[str, float]]:
    """Each service's `pss`, by role."""
    return {role: pss(pid) for role, pid in services.items()}


def table(moments: dict[str, dict[str, dict[str, float]]]) -> str:
    """The readings as a table: a row per moment and service, and each moment's total."""
    lines = [f"{'moment':<14} {'service':<9} {'PSS':>8} {'anon':>8} {'file':>8} {'shmem':>8}"]
    for moment, by_service in moments.items():
        for role, parts in by_service.items():
            lines.append(f"{moment:<14} {role:<9} {parts['pss']:>8.1f} {parts['anon']:>8.1f} {parts['file']:>8.1f} "
                         f"{parts['shmem']:>8.1f}")
        lines.append(f"{moment:<14} {'total':<9} {sum(p['pss'] for p in by_service.values()):>8.1f}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict:
    config = StackConfig(model=args.model, kv_cache_bytes=args.kv_cache_bytes, quantization=args.quantization,
                         max_num_seqs=max(args.requests, 1))
    started = time.perf_counter()
    [stack] = start_stacks([config])
    try:
        load_s = time.perf_counter() - started
        services = {"memory": stack.stack.memory.pid, "compute": stack.stack.compute.pid,
                    "gateway": stack.stack.gateway.pid}
        pool_bytes = sum(p.stat().st_size for p in shm_segments(services["memory"]))
        moments = {"loaded": snapshot(services)}
        specs = prompts(args.requests, args.prompt_tokens, args.max_tokens)
        results = asyncio.run(run_arrivals(stack.target("grpc"), specs, [0.0] * len(specs), "resident",
                                           timeout_s=args.timeout_s))
        failed = [r.status for r in results if not r.ok]
        if failed:
            raise RuntimeError(f"{len(failed)} of {len(results)} requests failed: {sorted(set(failed))}")
        moments["after_requests"] = snapshot(services)
        # The compute service hands its steps' free memory back after a whole idle ping interval
        # (1 s by default: compute_service/service/engine_loop.py).
        time.sleep(args.idle_s)
        moments["idle"] = snapshot(services)
    finally:
        exit_statuses = stack.stop()
    file_mib = model_bytes(args.model) / MIB
    pool_mib = pool_bytes / MIB
    total = sum(p["pss"] for p in moments["after_requests"].values())
    idle = sum(p["pss"] for p in moments["idle"].values())
    print(table(moments))
    return {
        "model": Path(args.model).name, "file_mib": round(file_mib, 1), "kv_pool_mib": round(pool_mib, 1),
        "quantization": args.quantization or "auto", "requests": args.requests,
        "prompt_tokens_mean": round(sum(r.prompt_tokens for r in results) / len(results), 1),
        "max_tokens": args.max_tokens, "load_s": round(load_s, 1),
        "pss_mib": {moment: {role: parts["pss"] for role, parts in by_service.items()}
                    for moment, by_service in moments.items()},
        "anon_mib": {role: parts["anon"] for role, parts in moments["after_requests"].items()},
        "shmem_mib": {role: parts["shmem"] for role, parts in moments["after_requests"].items()},
        "total_pss_mib": round(total, 1),
        "ratio_to_file_plus_pool": round(total / (file_mib + pool_mib), 3),
        "idle_total_pss_mib": round(idle, 1), "idle_ratio_to_file_plus_pool": round(idle / (file_mib + pool_mib), 3),
        "goal_ratio": GOAL_RATIO,
        "load_avg": round(os.getloadavg()[0], 2),
        "pids": services, "exit_statuses": exit_statuses,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default", help='"default", a GGUF file or a Hugging Face directory')
    p.add_argument("--kv-cache-bytes", type=int, default=2 << 30, help="the KV pool (default 2 GiB)")
    p.add_argument("--quantization", default=None, help="the compute service's --quantization (default: its own)")
    p.add_argument("--requests", type=int, default=8, help="prompts sent at once (default 8)")
    p.add_argument("--prompt-tokens", type=int, default=1100, help="about this many tokens each (default 1100)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request (default 32)")
    p.add_argument("--idle-s", type=float, default=3.0, help="then idle this long before the last reading")
    p.add_argument("--timeout-s", type=float, default=1800.0)
    args = p.parse_args()
    print(json.dumps(run(args)))


if __name__ == "__main__":
    main()
