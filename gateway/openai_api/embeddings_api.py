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

The answer's size: each float is charged as the answer writes it (``BYTES_PER_FLOAT``: JSON's ~24
characters, base64's 16/3), not the gRPC wire's 4 bytes, against the gateway's ``max_message_bytes``;
when the backend reported its hidden size, a list whose embeddings cannot fit is a 400 naming
``input`` before any work (a 429 would be retried by the SDKs, as if waiting could help). The JSON
is built off the event loop.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from gateway.core.service import GatewayCore, RequestRecord
from gateway.core.streaming import BYTES_PER_FLOAT, ReplyBudget
from gateway.core.types import GenerateRequest, Reply, SamplingOptions
from gateway.openai_api import convert
from gateway.openai_api.edge import Front
from gateway.openai_api.errors import ParamError, renamed_param
from gateway.openai_api.handler import admitted, answered, rendered, request_id_of
from gateway.openai_api.schema import Body
from gateway.openai_api.transport import whole_answers
from gateway.tenants import Admission, Tenant
from pagedserve.errors import UnavailableError, echo


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


def encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector


def check_answer_fits(num_inputs: int, hidden_size: int, encoding_format: str, max_bytes: int) -> None:
    """Before any work: ``num_inputs`` embeddings of ``hidden_size`` floats, as ``encoding_format``
    writes them, must fit in one answer (``hidden_size`` 0: not known, checked as they arrive).

    Raises:
        ParamError: naming ``input``, with how many inputs would fit.
    """
    per_input = BYTES_PER_FLOAT[encoding_format] * hidden_size
    if hidden_size and num_inputs * per_input > max_bytes:
        other = ", or encoding_format base64 (a quarter of the size)" if encoding_format == "float" else ""
        raise ParamError("input", f"input: {num_inputs} embeddings of {hidden_size} floats as {encoding_format} take "
                                  f"about {num_inputs * per_input:.0f} bytes, more than the {max_bytes} one answer "
                                  f"may carry (max_message_bytes); send at most {int(max_bytes // per_input)} inputs "
                                  f"per request{other}")


def embeddings_body(replies: list[Reply], encoding_format: str, model_name: str) -> dict:
    """The answer's JSON (a list of ``hidden_size`` floats or a base64 string per input)."""
    data = [{"object": "embedding", "index": i, "embedding": encoded(r.embedding, encoding_format)}  # type: ignore
            for i, r in enumerate(replies)]
    num_tokens = sum(r.usage.prompt_tokens for r in replies)
    return {"object": "list", "data": data, "model": model_name,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}


def check_embeddings(replies: list[Reply]) -> None:
    """Every input has its embedding.

    Raises:
        UnavailableError: one has none (the backend dropped the request: it restarted, or the
        gateway is shutting down), never an empty vector in a 200.
    """
    for i, reply in enumerate(replies):
        if not reply.embedding:
            reason = reply.choices[0].finish_reason if reply.choices else None
            raise UnavailableError(f"input[{i}]: the backend answered no embedding (finish_reason "
                                   f"{echo(reason)}: it dropped the request); retry")


async def create_embeddings(front: Front, request: Request) -> Response:
    """The endpoint (a function of the front: it holds no state of its own)."""
    return await answered(lambda _: _create(front, request), lambda error: renamed_param(error, {"prompt": "input"}))


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
    inputs = convert.prompt_list(body.input)
    limit = core.config.max_prompts_per_request
    if not inputs or len(inputs) > limit:
        raise ParamError("input", f"input: 1 to {limit} inputs per request (max_prompts_per_request), "
                                  f"got {len(inputs)}")
    check_answer_fits(len(inputs), core.require_model().info.hidden_size, encoding_format,
                      core.config.max_message_bytes)
    request_id = request_id_of(request, "embd")
    return await admitted(core, tenant, RequestRecord(METHOD, request_id), body.priority or 0, len(inputs),
                          lambda admissions: _run(core, request, body, inputs, encoding_format, request_id,
                                                  model_name, tenant, admissions))


async def _run(core: GatewayCore, request: Request, body: EmbeddingRequest, inputs: Sequence[str | list[int]],
               encoding_format: str, request_id: str, model_name: str, tenant: Tenant,
               admissions: list[Admission]) -> Response:
    """The admitted inputs: each a prefill-only request with pooling, answered whole."""
    reply = ReplyBudget(core.config.max_message_bytes, hint="send fewer inputs per request",
                        bytes_per_float=BYTES_PER_FLOAT[encoding_format])
    streams = []
    for i, one in enumerate(inputs):
        options = SamplingOptions(max_tokens=0, pooling=core.config.embedding_pooling)
        generate = convert.with_prompt(GenerateRequest(options=options, request_id=f"{request_id}-{i}",
                                                       priority=body.priority or 0, cache_salt=body.cache_salt or ""),
                                       one)
        record = RequestRecord(METHOD, generate.request_id)
        streams.append((generate.request_id, core.run(generate, record, tenant, None, admission=admissions[i],
                                                      reply=reply, num_prompts=len(inputs))))
    replies = await whole_answers(request.receive, streams)
    check_embeddings(replies)
    return await rendered(lambda: embeddings_body(replies, encoding_format, model_name))
