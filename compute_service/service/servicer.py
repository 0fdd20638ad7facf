"""``pagedserve.compute.v1.Compute``: thin asyncio handlers over the engine loop.

Each handler converts at the edge (``convert``), calls the core, converts back. Errors are raised,
never turned into status codes here: the server's interceptor maps InvalidArgument to
INVALID_ARGUMENT, AlreadyExistsError, ResourceExhaustedError and UnavailableError to theirs,
anything else to INTERNAL.

A Generate stream is an asyncio task waiting on its own asyncio.Queue; the engine thread feeds
that queue through ``call_soon_threadsafe``. When the stream ends early (the client cancels,
disconnects or its deadline passes: grpc.aio cancels the task) the ``finally`` aborts the request,
so its blocks are freed by the engine's next step.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import grpc

from pagedserve.compute.v1 import compute_pb2 as pb
from pagedserve.compute.v1 import compute_pb2_grpc
from pagedserve.errors import AlreadyExistsError, ResourceExhaustedError, UnavailableError, echo

from compute_service.service import convert
from compute_service.engine.config import EngineConfig
from compute_service.service.config import ComputeServiceConfig
from compute_service.engine.engine import Engine
from compute_service.service.engine_loop import AddCommand, EngineLoop
from compute_service.model.model_info import ModelInfo
from compute_service.engine.outputs import RequestOutput


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
        self._config = config
        self._engine_config = engine_config
        self._streams: set[str] = set()  # request ids of open Generate streams (event loop only)
        self.is_ready = False  # model loaded and memory service attached (set by the server)
        self.is_draining = False  # SIGTERM: no new requests

    def start(self, loop: EngineLoop, info: ModelInfo) -> None:
        """The model is loaded: serve it through ``loop`` (once its memory service is attached)."""
        self._loop = loop
        self._info = info

    def _started(self) -> tuple[EngineLoop, ModelInfo]:
        if self._loop is None or self._info is None:
            raise UnavailableError("the compute service is still loading its model")
        return self._loop, self._info

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    def _accepting_engine(self) -> Engine:
        """The attached engine, if new requests are welcome (read-only use: ``check_request``)."""
        if self.is_draining:
            raise UnavailableError("the compute service is shutting down")
        loop, _ = self._started()
        engine = loop.engine
        if not self.is_ready or engine is None:
            raise UnavailableError("the compute service is not attached to its memory service")
        return engine

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
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
        outputs: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        event_loop = asyncio.get_running_loop()

        def sink(item: RequestOutput | Exception) -> None:  # runs in the engine thread
            try:
                event_loop.call_soon_threadsafe(outputs.put_nowait, item)
            except RuntimeError:
                pass  # the event loop is closed (process exit): no stream is left to tell

        self._streams.add(req.request_id)
        finished = False
        try:
            self._loop.submit(AddCommand(req.request_id, req.prompt_token_ids, req.params, req.priority,
                                         req.cache_salt, sink))
            while not finished:
                item = await outputs.get()
                if isinstance(item, Exception):
                    finished = True  # the engine already dropped the request
                    raise item
                for message in convert.responses_to_pb(item):
                    yield message
                finished = item.finished
        finally:
            self._streams.discard(req.request_id)
            if not finished:
                self._loop.abort(req.request_id)  # cancelled, disconnected or past its deadline

    @staticmethod
    def _checked_request(engine: Engine, request: pb.GenerateRequest, max_model_len: int) -> convert.GenerateInput:
        """The request in core types, every field checked: sizes first, then each id (InvalidArgument)."""
        req = convert.generate_from_pb(request, default_request_id=f"cmpl-{uuid.uuid4().hex}",
                                       max_model_len=max_model_len)
        engine.check_request(req.prompt_token_ids, req.params, request_id=req.request_id, cache_salt=req.cache_salt)
        return req

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        found = request.request_id in self._streams
        if found and self._loop is not None:
            self._loop.abort(request.request_id)  # its stream ends with finish_reason "abort"
        return pb.AbortResponse(found=found)

    async def Load(self, request: pb.LoadRequest, context: grpc.aio.ServicerContext) -> pb.LoadResponse:
        loop, _ = self._started()
        return convert.load_to_pb(loop.load, self._config.max_queued_requests)

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        loop, info = self._started()
        engine = loop.engine
        block_size = engine.memory.block_size if engine is not None else self._engine_config.block_size
        num_blocks = engine.memory.num_blocks if engine is not None else 0
        return convert.info_to_pb(info, block_size=block_size, num_kv_blocks=num_blocks)

    async def GetTokenizer(self, request: pb.GetTokenizerRequest,
                           context: grpc.aio.ServicerContext) -> AsyncIterator[pb.TokenizerChunk]:
        _, info = self._started()
        for file in info.tokenizer_files:
            chunks = list(file.chunks())
            for i, (offset, data) in enumerate(chunks):
                last = i == len(chunks) - 1
                yield pb.TokenizerChunk(name=file.name, offset=offset, data=data, sha256=file.sha256 if last else "")
