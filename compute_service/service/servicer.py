"""``pagedserve.compute.v1.Compute``: thin asyncio handlers over the engine loop.

Each handler converts at the edge (``convert``), calls the core, converts back. Errors are raised,
never turned into status codes here: the server's interceptor maps InvalidArgument to
INVALID_ARGUMENT, AlreadyExistsError, ResourceExhaustedError and UnavailableError to theirs,
anything else to INTERNAL.

A Generate stream is an asyncio task reading its own bounded StreamBuffer, which the engine thread
fills (each step's news only); a full buffer pauses the request in the engine. When the stream ends
early (the client cancels, disconnects or its deadline passes: grpc.aio cancels the task; or the
client stops reading for ``write_stall_timeout_s``) the ``finally`` aborts the request, so its
blocks are freed by the engine's next step. A request that fails on its own ends INTERNAL with a
message while nothing was streamed yet, else with a last message whose finish_reason is "error".
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import grpc

from pagedserve.compute.v1 import compute_pb2 as pb
from pagedserve.compute.v1 import compute_pb2_grpc
from pagedserve.errors import (
    AlreadyExistsError, RequestFailedError, ResourceExhaustedError, StreamStalledError, UnavailableError, echo,
)
from pagedserve.log import get_logger
from pagedserve.trace_context import traceparent_of

from compute_service.service import convert
from compute_service.engine.config import EngineConfig
from compute_service.service.config import ComputeServiceConfig
from compute_service.engine.engine import Engine
from compute_service.service.engine_loop import AddCommand, EngineLoop
from compute_service.model.model_info import ModelInfo
from compute_service.engine.outputs import RequestDelta
from compute_service.engine.request import GenerateInput
from compute_service.service.stream_buffer import StreamBuffer
from compute_service.structured.grammar_compiler import GrammarCompiler

log = get_logger("compute_service")


# Prompts longer than this are converted and checked in a worker thread.
_OFF_LOOP_PROMPT_TOKENS = 1 << 14


class ComputeServicer(compute_pb2_grpc.ComputeServicer):
    """Serves before the model is loaded (Generate, Info: UNAVAILABLE) so that health answers.

    Args:
        config, engine_config: limits and the engine's block size (reported before attaching).
    """

    def __init__(self, config: ComputeServiceConfig, engine_config: EngineConfig) -> None:
        self._loop: EngineLoop | None = None
        self._info: ModelInfo | None = None
        self._grammars: GrammarCompiler | None = None
        self._config = config
        self._engine_config = engine_config
        # Open Generate streams by request id, each with its buffer of outputs (event loop only).
        self._streams: dict[str, StreamBuffer] = {}
        self._num_streams_by_tenant: dict[str, int] = {}  # the same streams per tenant (its queue share)
        self.num_stalled_streams = 0  # aborted because their client stopped reading (metrics)
        self.is_ready = False  # model loaded and memory service attached (set by the server)
        self.is_draining = False  # SIGTERM: no new requests

    def start(self, loop: EngineLoop, info: ModelInfo, grammars: GrammarCompiler | None = None) -> None:
        """The model is loaded: serve it through ``loop`` (once its memory service is attached);
        ``grammars`` compiles structured-output constraints (None: the model has no tokenizer)."""
        self._loop = loop
        self._info = info
        self._grammars = grammars

    def _started(self) -> tuple[EngineLoop, ModelInfo]:
        if self._loop is None or self._info is None:
            raise UnavailableError("the compute service is still loading its model")
        return self._loop, self._info

    @property
    def info(self) -> ModelInfo | None:
        """The served model's description (Info), once it is loaded."""
        return self._info

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    def buffer_stats(self) -> tuple[int, int]:
        """(outputs waiting in all stream buffers, streams whose buffer is full: paused), for metrics."""
        buffers = list(self._streams.values())  # read from the metrics thread: a snapshot
        return sum(b.num_items for b in buffers), sum(b.is_full for b in buffers)

    def _accepting_engine(self) -> Engine:
        """The attached engine, if new requests are welcome (read-only use: ``check_request``)."""
        if self.is_draining:
            raise UnavailableError("the compute service is shutting down")
        loop, _ = self._started()
        engine = loop.engine
        if not self.is_ready or engine is None:
            raise UnavailableError("the compute service is not attached to its memory service")
        return engine

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        engine = self._accepting_engine()
        _, info = self._started()
        if len(request.prompt_token_ids) > _OFF_LOOP_PROMPT_TOKENS:
            # Converting and checking a long prompt takes milliseconds: off the event loop, which
            # serves every other stream (the length itself is checked first, in the thread too).
            req = await asyncio.to_thread(self._checked_request, engine, request, info.max_model_len)
        else:
            req = self._checked_request(engine, request, info.max_model_len)
        if req.request_id in self._streams:
            raise AlreadyExistsError(f"request_id {echo(req.request_id)} is already running")
        if len(self._streams) >= self._config.max_queued_requests:
            raise ResourceExhaustedError(
                f"{len(self._streams)} requests in flight: the limit (max_queued_requests) is reached; retry later"
            )
        num_held = self._num_streams_by_tenant.get(req.tenant, 0)
        if num_held >= self._config.max_queued_per_tenant:
            # One tenant's backlog must not fill the queue: the rest is kept for the others.
            raise ResourceExhaustedError(f"tenant {echo(req.tenant)} holds {num_held} requests in flight, its share "
                                         "(max_queued_per_tenant); retry later")
        grammar = None
        if req.params.constraint is not None and self._grammars is not None:
            # Compiled in the compiler's worker processes (the loop awaits; the engine thread never
            # waits): an invalid or too costly constraint is refused here, before any engine work.
            # The compile quota is the tenant's (else its cache namespace; neither: no quota).
            owner = req.tenant or req.cache_salt or None
            grammar = await self._grammars.compile_async(req.params.constraint, owner=owner)
            if req.request_id in self._streams:  # the same id arrived while this one compiled
                raise AlreadyExistsError(f"request_id {echo(req.request_id)} is already running")
        loop = self._loop
        buffer: StreamBuffer[RequestDelta | Exception] = StreamBuffer(
            asyncio.get_running_loop(), self._config.max_stream_buffer, lambda: loop.resume(req.request_id))
        self._streams[req.request_id] = buffer
        self._num_streams_by_tenant[req.tenant] = self._num_streams_by_tenant.get(req.tenant, 0) + 1
        finished = False
        has_streamed = False
        try:
            traceparent = traceparent_of(context.invocation_metadata()) if loop.request_spans is not None else None
            loop.submit(AddCommand(req, buffer.put, grammar, traceparent=traceparent))
            while not finished:
                item = await buffer.get()
                if isinstance(item, Exception):
                    finished = True  # the engine already dropped the request
                    raise item
                finished = item.finished
                if item.error is not None and not has_streamed:
                    # Nothing reached the client yet: a plain error status (the engine dropped it).
                    raise RequestFailedError(f"request {echo(req.request_id)} failed: {item.error}")
                for message in convert.responses_to_pb(item):
                    await self._write(context, message, req.request_id)
                    has_streamed = True
        finally:
            del self._streams[req.request_id]
            self._num_streams_by_tenant[req.tenant] -= 1
            if not self._num_streams_by_tenant[req.tenant]:
                del self._num_streams_by_tenant[req.tenant]
            if not finished:
                loop.abort(req.request_id)  # cancelled, disconnected, stalled or past its deadline

    async def _write(self, context: grpc.aio.ServicerContext, message: pb.GenerateResponse, request_id: str) -> None:
        """Send one message; a client that takes none for ``write_stall_timeout_s`` is given up on.

        The write blocks while the client does not read (gRPC's flow control). Without a bound the
        request would hold its blocks, and its paused place in the engine, for as long as the
        client keeps the connection open.
        """
        timeout_s = self._config.write_stall_timeout_s
        try:
            async with asyncio.timeout(timeout_s):  # no task per message (wait_for makes one on 3.11)
                await context.write(message)
        except TimeoutError:
            self.num_stalled_streams += 1
            log.warning("stream_stalled", request_id=request_id, write_stall_timeout_s=timeout_s)
            raise StreamStalledError(
                f"the client did not read its stream for {timeout_s:g} s: request aborted") from None

    @staticmethod
    def _checked_request(engine: Engine, request: pb.GenerateRequest, max_model_len: int) -> GenerateInput:
        """The request in core types, every field checked: sizes first, then each id (InvalidArgument)."""
        req = convert.generate_from_pb(request, default_request_id=f"cmpl-{uuid.uuid4().hex}",
                                       max_model_len=max_model_len)
        engine.check_request(req)
        return req

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        found = request.request_id in self._streams
        if found and self._loop is not None:
            self._loop.abort(request.request_id)  # its stream ends with finish_reason "abort"
        return pb.AbortResponse(found=found)

    async def Load(self, request: pb.LoadRequest, context: grpc.aio.ServicerContext) -> pb.LoadResponse:
        loop, _ = self._started()
        lease = loop.lease
        return convert.load_to_pb(loop.load, self._config.max_queued_requests,
                                  lease.memory_service_id if lease is not None else "",
                                  lease.memory_service_epoch if lease is not None else "")

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        loop, info = self._started()
        lease = loop.lease
        if lease is None:  # not attached (yet, or again): no pool to describe
            return convert.info_to_pb(info, block_size=self._engine_config.block_size, num_kv_blocks=0)
        pool = lease.pool  # (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        return convert.info_to_pb(info, block_size=lease.block_size, num_kv_blocks=lease.num_blocks,
                                  memory_service_id=lease.memory_service_id,
                                  memory_service_epoch=lease.memory_service_epoch, kv_tiers=lease.tiers,
                                  bytes_per_block=pool.numel() * pool.element_size() // lease.num_blocks)

    async def GetTokenizer(self, request: pb.GetTokenizerRequest,
                           context: grpc.aio.ServicerContext) -> AsyncIterator[pb.TokenizerChunk]:
        _, info = self._started()
        for file in info.tokenizer_files:
            chunks = list(file.chunks())
            for i, (offset, data) in enumerate(chunks):
                last = i == len(chunks) - 1
                yield pb.TokenizerChunk(name=file.name, offset=offset, data=data, sha256=file.sha256 if last else "")
