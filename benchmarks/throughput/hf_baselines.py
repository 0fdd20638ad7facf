"""The transformers baselines of bench_throughput.py, on the same seeded workload as the engine.

- `run_hf_static`: `generate` on static batches of a given size (left padding, greedy,
  ``min_new_tokens = max_new_tokens`` like ignore_eos; only each request's own tokens count).
  `run_hf_static_best` tries several sizes without a memory cap and keeps the fastest.
- `run_hf_cb`: transformers' continuous batching (the manager behind ``generate_batch``), either
  with our KV budget and page size (``budget=True``) or with its own defaults.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from benchmarks.throughput.workload import Request, RunResult, warmup_prompt

# --- static batches ------------------------------------------------------------------------------


def run_hf_static(model, workload: list[Request], batch_size: int, eos_ids: list[int], pad_id: int) -> RunResult:
    """Batches in arrival order; each runs until its longest output (min_new_tokens = max_new_tokens
    keeps EOS away, like ignore_eos); only each request's own tokens count as generated."""
    from transformers import GenerationConfig

    def generate(batch: list[Request]) -> list[list[int]]:
        width = max(len(r.prompt_token_ids) for r in batch)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)  # (B, L), left padded
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)  # (B, L)
        for row, req in enumerate(batch):
            input_ids[row, width - len(req.prompt_token_ids):] = torch.tensor(req.prompt_token_ids)
            attention_mask[row, width - len(req.prompt_token_ids):] = 1
        steps = max(r.max_tokens for r in batch)
        config = GenerationConfig(max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                                  eos_token_id=eos_ids or None, pad_token_id=pad_id)
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids.to(model.device), attention_mask=attention_mask.to(model.device),
                                 generation_config=config)  # (B, L + steps)
        return [out[row, width:width + req.max_tokens].tolist() for row, req in enumerate(batch)]

    generate([Request(warmup_prompt(workload), 2)])
    started = time.perf_counter()
    outputs: list[list[int]] = []
    for first in range(0, len(workload), batch_size):
        outputs += generate(workload[first:first + batch_size])
    wall = time.perf_counter() - started
    return RunResult("hf_static", len(workload), sum(map(len, outputs)), wall, outputs)


def run_hf_static_best(model, workload: list[Request], batch_sizes: list[int], eos_ids: list[int], pad_id: int,
                       log) -> RunResult:
    """`run_hf_static` at each batch size (no memory cap: the whole batch's cache grows as needed);
    returns the fastest, named ``hf_static_best``, with every size's tok/s in ``extra``."""
    runs = []
    for batch_size in batch_sizes:
        run = run_hf_static(model, workload, batch_size, eos_ids, pad_id)
        log(f"hf_static batch {batch_size}: {run.tok_s:.2f} tok/s")
        runs.append((batch_size, run))
    best_size, best = max(runs, key=lambda item: item[1].tok_s)
    extra = {"hf_static_best_batch_size": best_size,
             "hf_static_tok_s_by_batch_size": {str(size): round(run.tok_s, 2) for size, run in runs}}
    return RunResult("hf_static_best", best.num_requests, best.generated_tokens, best.wall_s, best.outputs, extra)


# --- continuous batching -------------------------------------------------------------------------


def run_hf_cb(model, workload: list[Request], args: argparse.Namespace, bytes_per_token: int, *,
              budget: bool) -> RunResult:
    """The continuous-batching manager that ``model.generate_batch`` wraps. generate_batch takes one
    ``max_new_tokens`` for all prompts, so each request is added with its own to the same manager
    (exactly what generate_batch does otherwise); EOS id -1 disables stopping (ignore_eos).

    ``budget=True`` (``hf_cb``): our KV byte budget, page size and batch budgets. ``budget=False``
    (``hf_cb_default``): transformers' own defaults (page size 256, its batch-token and request
    budgets, its scheduler) except the cache size: by default it takes 90% of free host memory
    (~20 GB here, on a machine that others share), so it gets instead room for every request of the
    workload at once, i.e. no memory cap either, like ``hf_static_best``.
    """
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    _ensure_cpu_memory_probe()
    max_new = max(r.max_tokens for r in workload)
    if budget:
        page_size = args.hf_cb_page_size or args.block_size
        num_blocks = args.kv_cache_bytes // (page_size * bytes_per_token)  # num_blocks * page_size tokens = budget
        cb_config = ContinuousBatchingConfig(page_size=page_size, num_blocks=num_blocks,
                                             max_batch_tokens=args.max_num_batched_tokens,
                                             max_requests_per_batch=args.max_num_seqs)
    else:
        page_size = ContinuousBatchingConfig().page_size
        # One page per request more than its tokens need (pages are per request, partly filled).
        num_blocks = sum(-(-(len(r.prompt_token_ids) + r.max_tokens) // page_size) + 1 for r in workload)
        cb_config = ContinuousBatchingConfig(num_blocks=num_blocks)
    gen_config = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=max_new)
    hints = WorkloadHints(max_prompt_length=max(len(r.prompt_token_ids) for r in workload),
                          max_generated_length=max_new, num_requests=len(workload))
    outputs: dict[str, list[int]] = {}
    with model.continuous_batching_context_manager(generation_config=gen_config, continuous_batching_config=cb_config,
                                                   block=True, timeout=30, warmup=model.device.type == "cuda",
                                                   workload_hints=hints) as manager:
        def drain(request_ids: set[str]) -> None:
            while not request_ids <= outputs.keys():
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    if result.error is not None:
                        raise RuntimeError(f"transformers CB request {result.request_id} failed: {result.error}")
                    outputs[result.request_id] = list(result.generated_tokens)
                elif result is None and not manager.is_running():
                    raise RuntimeError("the transformers CB generation thread died")

        manager.add_request(warmup_prompt(workload), "warmup", max_new_tokens=2, eos_token_id=-1)
        drain({"warmup"})
        cache_tokens = manager.batch_processor.cache.num_blocks * page_size  # exists once a batch ran
        started = time.perf_counter()
        ids = [manager.add_request(r.prompt_token_ids, f"cb-{i}", max_new_tokens=r.max_tokens, eos_token_id=-1)
               for i, r in enumerate(workload)]
        drain(set(ids))
        wall = time.perf_counter() - started
    tokens = [outputs[i] for i in ids]
    name = "hf_cb" if budget else "hf_cb_default"
    return RunResult(name, len(workload), sum(map(len, tokens)), wall, tokens,
                     {f"{name}_page_size": page_size, f"{name}_cache_tokens": cache_tokens})


def _ensure_cpu_memory_probe() -> None:
    """transformers CB checks its cache footprint against free memory, which on a CPU it reads with
    psutil (not a dependency of ours); without it it sees 0 bytes and refuses to start. Give it the
    same numbers from /proc."""
    try:
        import psutil  # noqa: F401
        return
    except ImportError:
        pass
    from transformers.generation.continuous_batching import cache as cb_cache

    original = cb_cache.get_device_and_memory_breakdown

    def breakdown() -> tuple[torch.device, int, int, int]:
        device, total, reserved, allocated = original()
        if device.type != "cpu" or total:
            return device, total, reserved, allocated
        meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        total = int(meminfo["MemTotal"].split()[0]) * 1024
        rss = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return device, total, rss, rss

    cb_cache.get_device_and_memory_breakdown = breakdown
