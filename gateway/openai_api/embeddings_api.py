"""OpenAI's embeddings endpoint on the HTTP front: ``POST /v1/embeddings``.

Each input is one request through ``GatewayCore.run`` as a completion's prompt is (admission of the
whole list at once, the tenant's limits, validation, routing, the reply cap, metrics and the access
line, method ``OpenAI.Embeddings``), with ``max_tokens`` 0 and ``pooling``: the compute service
computes the prompt beside the other requests' steps and answers the pooled final hidden states,
L2-normalized (``SamplingParams.pooling``; the gateway's ``--embedding-pooling``, "last" by default
as vLLM's pooler for decoder models). Nothing is generated, so ``usage`` has prompt tokens only.

``encoding_format`` "base64" is the float32 little-endian bytes, base64 (what the openai SDK asks
for by default and decodes); ``dimensions`` is refused: the size is the model's hidden size, and
cutting a vector that was not trained for it (Matryoshka) would give a worse one silently.
"""

from __future__ import annotations

import base64
import uuid

import numpy as np
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from gateway.core.service import RequestRecord
from gateway.core.streaming import ReplyBudget
from gateway.core.types import GenerateRequest, SamplingOptions
from gateway.openai_api.edge import Front
from gateway.openai_api.errors import ParamError, as_http_error, error_body, renamed_param
from gateway.openai_api.schema import Body
from gateway.openai_api.transport import ClientGone, whole_answers
from pagedserve.errors import echo


METHOD = "OpenAI.Embeddings"
ENCODINGS = ("float", "base64")


class EmbeddingRequest(Body):
    """``POST /v1/embeddings``: one text, texts, token ids, or lists of token ids."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: str | None = None  # None: "float"
    dimensions: int | None = None
    user: str | None = None
    priority: int | None = None
    cache_salt: str | None = None


def inputs_of(given: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """The inputs, one per embedding (a flat list of ints is one input's token ids)."""
    if isinstance(given, str) or (given and isinstance(given[0], int)):
        return [given]  # type: ignore[list-item]
    return list(given)  # type: ignore[arg-type]


def encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector


async def create_embeddings(front: Front, request: Request) -> Response:
    """The endpoint (a function of the front: it holds no state of its own)."""
    try:
        return await _create(front, request)
    except (ClientGone, ClientDisconnect):  # nobody reads it; the access lines say CANCELLED
        return Response(status_code=499)
    except Exception as exc:  # every failure becomes an OpenAI error object
        error = renamed_param(as_http_error(exc), {"prompt": "input"})
        return JSONResponse(error_body(error.status, error.message, error.param), status_code=error.status)


async def _create(front: Front, request: Request) -> Response:
    core = front.core
    tenant = front.tenant_of(request)
    body: EmbeddingRequest = await front.read_body(request, EmbeddingRequest)
    model_name = front.served_model(body.model)
    if body.dimensions is not None:
        raise ParamError("dimensions", "dimensions is not supported: embeddings have the model's hidden size")
    encoding_format = body.encoding_format or "float"
    if encoding_format not in ENCODINGS:
        raise ParamError("encoding_format", f"encoding_format must be float or base64, got {echo(encoding_format)}")
    # Counted before any is converted, as completions' prompt lists.
    inputs = inputs_of(body.input)
    limit = core.config.max_prompts_per_request
    if not inputs or len(inputs) > limit:
        raise ParamError("input", f"input: 1 to {limit} inputs per request (max_prompts_per_request), "
                                  f"got {len(inputs)}")
    request_id = f"embd-{uuid.uuid4().hex}"
    admissions = core.admit(tenant, RequestRecord(METHOD, request_id), body.priority or 0, len(inputs))
    try:
        reply = ReplyBudget(core.config.max_message_bytes, hint="send fewer inputs per request")
        streams = []
        for i, one in enumerate(inputs):
            options = SamplingOptions(max_tokens=0, pooling=core.config.embedding_pooling)
            generate = GenerateRequest(options=options, request_id=f"{request_id}-{i}", priority=body.priority or 0,
                                       cache_salt=body.cache_salt or "")
            if isinstance(one, str):
                generate.prompt = one
            else:
                generate.prompt_token_ids = list(one)
            record = RequestRecord(METHOD, generate.request_id)
            streams.append((generate.request_id, core.run(generate, record, tenant, None, admission=admissions[i],
                                                          reply=reply, num_prompts=len(inputs))))
        replies = await whole_answers(request.receive, streams)
    finally:
        core.release(admissions)  # idempotent: the runs released theirs
    data = [{"object": "embedding", "index": i, "embedding": encoded(r.embedding or [], encoding_format)}
            for i, r in enumerate(replies)]
    num_tokens = sum(r.usage.prompt_tokens for r in replies)
    return JSONResponse({"object": "list", "data": data, "model": model_name,
                         "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})
