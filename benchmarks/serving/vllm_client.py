"""Streaming clients of vLLM's ``/v1/completions`` (``bench_serving --peer vllm``), timed exactly as
client.py times our gateway's GenerateStream: TTFT at the first chunk carrying tokens, TPOT over the
tokens after it, end-to-end at the last chunk. Unlike openai_client.py (any OpenAI-compatible server,
tokens counted from the final usage), this one counts each chunk's tokens from vLLM's own extension.

Tokens are counted from each chunk's ``token_ids`` (vLLM's ``return_token_ids``), not from text, so
that a chunk whose text the detokenizer holds back still counts its token; usage comes from the
final chunk (``stream_options.include_usage``).
"""

from __future__ import annotations

import json
import time

import httpx

from benchmarks.serving.client import RequestResult, send_at
from benchmarks.serving.workload import RequestSpec


def completion_body(model: str, spec: RequestSpec, cache_salt: str) -> dict:
    """``ignore_eos``, streamed: every request generates exactly ``max_tokens`` tokens, greedy or
    sampled as ``spec`` says (never seeded: vLLM 0.32's CPU build fails on per-request seeds).

    ``cache_salt`` (vLLM's prefix-cache namespace, as our gateway's) is the one our side sends for
    the same phase: the rates send the same prompts, and without it vLLM would find each rate's
    prompts cached by the phases before it while ours computes them afresh.
    """
    return {"model": model, "prompt": spec.prompt, "max_tokens": spec.max_tokens, "temperature": spec.temperature,
            "top_p": spec.top_p,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True, "cache_salt": cache_salt}


def parse_event(line: str) -> dict | None:
    """One server-sent event line -> its JSON object; None for blank lines, comments and ``[DONE]``."""
    if not line.startswith("data:"):
        return None
    data = line[len("data:"):].strip()
    return None if data == "[DONE]" else json.loads(data)


async def stream_one(client: httpx.AsyncClient, model: str, spec: RequestSpec, cache_salt: str,
                     timeout_s: float) -> RequestResult:
    """Send one streamed completion and time its chunks; an HTTP error is recorded, not raised."""
    result = RequestResult(spec.max_tokens)
    first = last = None
    result.sent_at = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=completion_body(model, spec, cache_salt),
                                 timeout=timeout_s) as response:
            if response.status_code != 200:
                await response.aread()
                result.status = f"HTTP_{response.status_code}"
            else:
                async for line in response.aiter_lines():
                    event = parse_event(line)
                    if event is None:
                        continue
                    now = time.perf_counter()
                    num = sum(len(c.get("token_ids") or ()) for c in event.get("choices") or ())
                    if num:
                        first = now if first is None else first
                        last = now
                        result.output_tokens += num
                    usage = event.get("usage")
                    if usage:
                        result.prompt_tokens = usage.get("prompt_tokens", 0)
                        result.usage_tokens = usage.get("completion_tokens", 0)
                        result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    except httpx.HTTPError as exc:
        result.status = type(exc).__name__
    result.finished_at = time.perf_counter()
    if first is not None:
        result.ttft_s = first - result.sent_at
        if result.output_tokens > 1:
            result.tpot_s = (last - first) / (result.output_tokens - 1)
    return result


def _client(base_url: str) -> httpx.AsyncClient:
    # One connection per in-flight request, as many clients would open; no pool limit to queue behind.
    return httpx.AsyncClient(base_url=base_url, limits=httpx.Limits(max_connections=None,
                                                                    max_keepalive_connections=None))


async def run_arrivals(base_url: str, model: str, specs: list[RequestSpec], arrivals: list[float],
                       cache_salt: str, timeout_s: float) -> list[RequestResult]:
    """Send ``specs[i]`` at ``arrivals[i]`` seconds from now, each as its own task, and wait for all."""
    async with _client(base_url) as client:
        return await send_at(arrivals, [lambda spec=spec: stream_one(client, model, spec, cache_salt, timeout_s)
                                        for spec in specs])


async def run_one_at_a_time(base_url: str, model: str, specs: list[RequestSpec], cache_salt: str,
                            timeout_s: float) -> list[RequestResult]:
    """Each request sent after the previous one finished (the unloaded baseline)."""
    async with _client(base_url) as client:
        return [await stream_one(client, model, spec, cache_salt, timeout_s) for spec in specs]
