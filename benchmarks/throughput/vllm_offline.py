"""The offline throughput peer: vLLM's ``LLM.generate`` on our seeded workload (token-id prompts).

Run by vLLM's own venv python (benchmarks/vllm_peer.py), never imported by ours: it reads only the
standard library and vLLM. Input: a JSON file ``{"model": DIR, "dtype": ..., "seed": ...,
"engine_args": {...}, "requests": [[prompt_token_ids, max_tokens, temperature, top_p], ...]}``;
output: a JSON file ``{"wall_s", "generated_tokens", "outputs", "startup_s", "engine_args",
"dtype", "vllm_version"}``.

Each request as on our side: ``ignore_eos``, exactly ``max_tokens``, greedy (temperature 0) or
sampled with its temperature and top_p, without a per-request seed (vLLM 0.32's CPU build fails
on them: "CPU Generator does not use offset"). Startup (vLLM compiles its model) and one warm-up
request stay outside the timed region.

    .venv-vllm/bin/python benchmarks/throughput/vllm_offline.py IN.json OUT.json
"""

from __future__ import annotations

import json
import sys
import time


def main(in_path: str, out_path: str) -> None:
    with open(in_path) as f:
        job = json.load(f)
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    llm = LLM(model=job["model"], dtype=job["dtype"], seed=job["seed"], **job["engine_args"])
    requests = job["requests"]
    warmup = TokensPrompt(prompt_token_ids=[requests[0][0][0]] * 8)
    llm.generate([warmup], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), use_tqdm=False)
    startup_s = time.perf_counter() - started
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids, *_ in requests]
    params = [SamplingParams(max_tokens=n, temperature=temperature, top_p=top_p, ignore_eos=True)
              for _, n, temperature, top_p in requests]
    started = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    wall_s = time.perf_counter() - started
    outputs = [list(r.outputs[0].token_ids) for r in results]
    with open(out_path, "w") as f:
        json.dump({"wall_s": wall_s, "generated_tokens": sum(map(len, outputs)), "outputs": outputs,
                   "startup_s": round(startup_s, 1), "engine_args": job["engine_args"],
                   "dtype": job["dtype"], "vllm_version": vllm.__version__}, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
