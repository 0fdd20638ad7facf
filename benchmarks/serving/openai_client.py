"""The serving benchmark's client of an OpenAI-compatible HTTP API (``--api openai``): ours, or any
other server's (``vllm serve``), so the same workload can be compared across servers.

Each request is one streamed ``POST /v1/completions`` (``stream_options.include_usage``), all over
one pooled ``httpx.AsyncClient``. The times mean what they mean for the gRPC client
(``benchmarks.serving.client``), with one difference forced by the protocol: SSE chunks carry text,
not token ids, so the output token count is the final usage's ``completion_tokens``, TTFT is the
first chunk with text, and TPOT spreads the time to the last text chunk over those tokens.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from benchmarks.serving.client import RequestResult
from benchmarks.serving.workload import RequestSpec


def completion_body(model: str, spec: RequestSpec, cache_salt: str) -> dict:
    """``ignore_eos`` (a vLLM extension ours shares): exactly ``max_tokens`` tokens each; greedy or
    sampled as ``spec`` says."""
    return {"model": model, "prompt": spec.prompt, "max_tokens": spec.max_tokens, "temperature": spec.temperature,
            "top_p": spec.top_p,
            "ignore_eos": True, "cache_salt": cache_salt, "stream": True, "stream_options": {"include_usage": True}}


class OpenAISession:
    """One pooled HTTP client of the server at ``base_url`` (``http://host:port``)."""

    def __init__(self, base_url: str, model: str) -> None:
        self.model = model
        # No pool limit: at rate inf every request is in flight at once, as with the gRPC channel.
        self.client = httpx.AsyncClient(base_url=base_url, timeout=None,
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))

    async def close(self) -> None:
        await self.client.aclose()

    async def stream_one(self, spec: RequestSpec, cache_salt: str, timeout_s: float) -> RequestResult:
        """Send one streamed completion and time its chunks; a failure is recorded, not raised."""
        result = RequestResult(spec.max_tokens)
        first = last = None
        result.sent_at = time.perf_counter()
        try:
            async with asyncio.timeout(timeout_s):
                async with self.client.stream("POST", "/v1/completions",
                                              json=completion_body(self.model, spec, cache_salt)) as response:
                    if response.status_code != 200:
                        result.status = f"HTTP_{response.status_code}"
                    else:
                        async for line in response.aiter_lines():
                            if not line.startswith("data: "):
                                continue
                            if line == "data: [DONE]":
                                break
                            chunk = json.loads(line[len("data: "):])
                            if "error" in chunk:
                                result.status = "STREAM_ERROR"
                                break
                            if chunk["choices"] and chunk["choices"][0].get("text"):
                                last = time.perf_counter()
                                first = first or last
                            if chunk.get("usage"):
                                usage = chunk["usage"]
                                result.prompt_tokens = usage["prompt_tokens"]
                                result.usage_tokens = usage["completion_tokens"]
                                details = usage.get("prompt_tokens_details") or {}
                                result.cached_tokens = details.get("cached_tokens") or 0
        except TimeoutError:
            result.status = "DEADLINE_EXCEEDED"
        except httpx.TransportError as exc:
            result.status = f"UNAVAILABLE ({type(exc).__name__})"
        result.finished_at = time.perf_counter()
        result.output_tokens = result.usage_tokens
        if first is not None:
            result.ttft_s = first - result.sent_at
            if result.output_tokens > 1 and last is not None:
                result.tpot_s = (last - first) / (result.output_tokens - 1)
        return result


async def describe_server(base_url: str, text: str) -> tuple[str, float]:
    """The served model's name (``/v1/models``), and its tokens per word on ``text`` (the prompt
    tokens a one-token completion of it reports)."""
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        models = (await client.get("/v1/models")).json()["data"]
        if not models:
            raise RuntimeError(f"the server at {base_url} lists no model")
        model = models[0]["id"]
        reply = await client.post("/v1/completions", json={"model": model, "prompt": text, "max_tokens": 1})
        reply.raise_for_status()
    return model, reply.json()["usage"]["prompt_tokens"] / len(text.split())
