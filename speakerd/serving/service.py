"""The `speakerd.v1.SpeakerEmbedding` gRPC service on grpc.aio.

Embed requests reach the handlers as raw bytes (see `register`) and are parsed without
copying their tensors (request_wire.py); each is validated off the event loop (a 32-chunk
fbank is 10 MB to check for NaN), queued in the batcher as chunks, and answered with its
own rows in its own order.
Every failure maps to one gRPC code and one `speakerd_requests_rejected_total` reason, with a
message naming the field and what was expected (SPEC 5), and is logged with the request id
(the `x-request-id` metadata, else the request's `request_id`, else a generated one).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import metadata

import grpc
import numpy as np

from speakerd.engine.base import Engine
from speakerd.model.architecture import (
    CHUNK_SAMPLES,
    EMBEDDING_DIM,
    FRAMES,
    MASK_FRAMES,
    MAX_SPEAKERS,
    MEL_BINS,
)
from speakerd.model.inputs import InputError, check_fbank, check_masks, check_waveform
from speakerd.model.numerics import active_frames, pad_speakers
from speakerd.serving.batcher import Batcher, DeadlinePassed, Draining, EngineFailed, QueueFull
from speakerd.serving.metrics import Metrics
from speakerd.serving.wire import WireError, WireRequest, parse_request
from speakerd.v1 import speakerd_pb2 as pb
from speakerd.v1.tensors import TensorError, from_tensor, to_tensor

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["SpeakerEmbedding"].full_name
REQUEST_ID_KEY = "x-request-id"
#: Threads decoding and validating requests: NumPy releases the GIL in isfinite and casts,
#: so a few threads keep up with a GPU doing ~8,000 chunks/s without blocking the event loop.
DECODE_THREADS = 4
#: Requests of one stream in flight at once: enough to keep a b32 plan busy from a single
#: stream of small requests; gRPC flow control holds the client back beyond it.
STREAM_WINDOW = 16


def package_version() -> str:
    try:
        return metadata.version("speakerd")
    except metadata.PackageNotFoundError:
        return "0+unknown"


class Rejection(Exception):
    """A call answered with a gRPC error: code, metrics reason and a message for the client."""

    def __init__(self, code: grpc.StatusCode, reason: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.request_id = ""  # set once the request's id is known


@dataclass(frozen=True)
class Prepared:
    """A validated request: what the batcher needs plus what the response echoes."""

    fbank: np.ndarray  # [n, 998, 80] float32
    masks: np.ndarray  # [n, 3, F] float32, speakers padded
    speakers: int
    active: np.ndarray  # [n, s] int32


def _waveform_fbank() -> object | None:
    """A1's fbank when it is installed; waveform requests need it."""
    try:
        from speakerd.model.fbank import fbank
    except ImportError:
        return None
    return fbank


def prepare(request: WireRequest, max_chunks: int, waveform_fbank: object | None) -> Prepared:
    """Decode and validate; InputError naming the field and the expected shape otherwise."""
    try:
        kind = request.features
        if kind is None:
            raise InputError(
                "features", f"set fbank [n, {FRAMES}, {MEL_BINS}] or waveform [n, {CHUNK_SAMPLES}]"
            )
        if kind == "waveform":
            if waveform_fbank is None:
                raise InputError(
                    "waveform", "this server takes fbank only (speakerd.model.fbank is not installed)"
                )
            waveform = check_waveform(from_tensor(request.waveform, "waveform"))
            fbank = waveform_fbank(waveform)  # type: ignore[operator]
        else:
            fbank = check_fbank(from_tensor(request.fbank, "fbank"))
        if request.masks is None:
            raise InputError(
                "masks", f"missing; expected [{fbank.shape[0]}, s, F] with s in 1..{MAX_SPEAKERS}"
            )
        masks = check_masks(from_tensor(request.masks, "masks"), fbank.shape[0])
    except TensorError as error:
        raise InputError(error.field, error.message) from error
    if fbank.shape[0] > max_chunks:
        raise InputError(
            kind, f"{fbank.shape[0]} chunks exceed the server's queue of {max_chunks}; split the request"
        )
    return Prepared(fbank, pad_speakers(masks), int(masks.shape[1]), active_frames(masks))


class SpeakerEmbeddingService:
    """Serves the engine attached by `attach`; UNAVAILABLE before that and while draining.
    Its methods are the generated servicer's, registered by `register` (embed requests as
    bytes)."""

    def __init__(self, metrics: Metrics, max_message_bytes: int) -> None:
        self.metrics = metrics
        self.max_message_bytes = max_message_bytes
        self.engine: Engine | None = None
        self.batcher: Batcher | None = None
        self.draining = False
        self._waveform_fbank = _waveform_fbank()
        self._decoder = ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="decode")
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def attach(self, engine: Engine, batcher: Batcher) -> None:
        self.engine, self.batcher = engine, batcher

    def begin_drain(self) -> None:
        """New calls get UNAVAILABLE from now on; calls already in progress finish."""
        self.draining = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait for in-progress calls to finish; False when they did not within timeout_s."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def close(self) -> None:
        self._decoder.shutdown(wait=False, cancel_futures=True)

    # --- calls -------------------------------------------------------------------------

    async def EmbedChunks(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
        """`raw`: the serialized EmbedRequest (see `register`)."""
        return await self._observed("EmbedChunks", raw, context, lambda given: _request_id(context, given))

    async def EmbedChunksStream(
        self, raw_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.EmbedResponse]:
        """Answers in request order; up to STREAM_WINDOW requests are batched concurrently."""
        stream_id = _request_id(context, "")
        window: asyncio.Queue[asyncio.Task[pb.EmbedResponse] | None] = asyncio.Queue(STREAM_WINDOW)

        async def read() -> None:
            index = 0
            try:
                async for raw in raw_iterator:
                    own = f"{stream_id}/{index}"
                    call = self._observed("EmbedChunksStream", raw, context, lambda given, f=own: given or f)
                    await window.put(asyncio.ensure_future(call))
                    index += 1
            finally:
                await window.put(None)

        reader = asyncio.ensure_future(read())
        index = 0
        try:
            while (task := await window.get()) is not None:
                try:
                    response = await task
                except Rejection as error:
                    where = f"request {index} (id {error.request_id})"
                    await context.abort(error.code, f"{where}: {error.message}")
                yield response
                index += 1
        finally:
            reader.cancel()
            while not window.empty():
                task = window.get_nowait()
                if task is not None:
                    task.cancel()

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        engine = self.engine
        if engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is still warming up")
        assert engine is not None
        return pb.ModelInfo(
            model_id=engine.model_id,
            engine=engine.name,
            precision=str(engine.math),
            plan_sizes=list(engine.plan_sizes),
            max_batch=engine.max_batch,
            fbank_frames=FRAMES,
            mel_bins=MEL_BINS,
            chunk_samples=CHUNK_SAMPLES,
            max_speakers=MAX_SPEAKERS,
            embedding_dim=EMBEDDING_DIM,
            mask_frames=MASK_FRAMES,
            version=package_version(),
            waveform_supported=self._waveform_fbank is not None,
            max_message_bytes=self.max_message_bytes,
        )

    # --- one request -------------------------------------------------------------------

    async def _observed(
        self,
        method: str,
        raw: bytes,
        context: grpc.aio.ServicerContext,
        name: Callable[[str], str],
    ) -> pb.EmbedResponse:
        """Serve one serialized request with its metrics and log line; `name` turns the
        request's own request_id into the id it is logged and answered under. Unary calls
        abort on Rejection; stream calls re-raise it for the stream to abort."""
        started = time.perf_counter()
        code = grpc.StatusCode.OK
        request_id = name("")
        self._enter()
        try:
            try:  # a few microseconds: tensors stay views into `raw`
                request = parse_request(raw)
            except WireError as error:
                raise Rejection(grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument", str(error)) from error
            request_id = name(request.request_id)
            response = await self._embed(request, context, request_id)
            log.debug("%s %s: %d chunks in %.1f ms", method, request_id, response.embeddings.shape[0],
                      1e3 * (time.perf_counter() - started))  # fmt: skip
            return response
        except Rejection as error:
            code = error.code
            error.request_id = request_id
            self.metrics.rejected.labels(reason=error.reason).inc()
            level = logging.ERROR if code == grpc.StatusCode.INTERNAL else logging.INFO
            log.log(level, "%s %s: %s %s", method, request_id, code.name, error.message)
            if method == "EmbedChunks":
                await context.abort(code, error.message)
            raise
        except asyncio.CancelledError:
            remaining = context.time_remaining()
            expired = remaining is not None and remaining <= 0
            code = grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
            self.metrics.rejected.labels(reason="deadline_exceeded" if expired else "cancelled").inc()
            log.info(
                "%s %s: %s by the client", method, request_id, "deadline passed" if expired else "cancelled"
            )
            raise
        finally:
            self.metrics.request_duration.labels(method=method, code=code.name).observe(
                time.perf_counter() - started
            )
            self._leave()

    def _enter(self) -> None:
        self._inflight += 1
        self._idle.clear()
        self.metrics.inflight.inc()

    def _leave(self) -> None:
        self._inflight -= 1
        self.metrics.inflight.dec()
        if self._inflight == 0:
            self._idle.set()

    async def _embed(
        self, request: WireRequest, context: grpc.aio.ServicerContext, request_id: str
    ) -> pb.EmbedResponse:
        engine, batcher = self.engine, self.batcher
        if self.draining:
            raise Rejection(
                grpc.StatusCode.UNAVAILABLE, "draining", "the server is draining; retry elsewhere"
            )
        if engine is None or batcher is None:
            raise Rejection(grpc.StatusCode.UNAVAILABLE, "not_ready", "the engine is still warming up")
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        if remaining is not None and remaining <= 0:
            raise Rejection(
                grpc.StatusCode.DEADLINE_EXCEEDED, "deadline_exceeded", "deadline passed on arrival"
            )
        loop = asyncio.get_running_loop()
        try:
            prepared = await loop.run_in_executor(
                self._decoder, prepare, request, batcher.queue_chunks, self._waveform_fbank
            )
        except InputError as error:
            raise Rejection(grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument", str(error)) from error
        try:
            result = await batcher.submit(prepared.fbank, prepared.masks, deadline)
        except QueueFull as error:
            raise Rejection(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue_full", str(error)) from error
        except DeadlinePassed as error:
            raise Rejection(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline_exceeded", str(error)) from error
        except Draining as error:
            raise Rejection(grpc.StatusCode.UNAVAILABLE, "draining", str(error)) from error
        except EngineFailed as error:
            raise Rejection(grpc.StatusCode.INTERNAL, "internal", str(error)) from error
        embeddings = result.embeddings[:, : prepared.speakers]
        return pb.EmbedResponse(
            embeddings=to_tensor(embeddings),
            empty=(prepared.active == 0).ravel().tolist(),
            active_frames=prepared.active.ravel().tolist(),
            model_id=engine.model_id,
            precision=str(engine.math),
            plans=sorted(set(result.plans)),
            request_id=request_id,
            fp16_fallbacks=result.fp16_fallbacks,
        )


def _request_id(context: grpc.aio.ServicerContext, given: str) -> str:
    """x-request-id metadata, else the request's own id, else a fresh one (16 hex digits)."""
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_KEY and value:
            return str(value)
    return given or uuid.uuid4().hex[:16]


def register(service: SpeakerEmbeddingService, server: grpc.aio.Server) -> None:
    """Add `service` to `server` as the generated add_SpeakerEmbeddingServicer_to_server
    would, except that the embed methods get their requests as raw bytes (no request
    deserializer), for request_wire.parse_request to read without copying the tensors."""
    handlers = {
        "EmbedChunks": grpc.unary_unary_rpc_method_handler(
            service.EmbedChunks, response_serializer=pb.EmbedResponse.SerializeToString
        ),
        "EmbedChunksStream": grpc.stream_stream_rpc_method_handler(
            service.EmbedChunksStream, response_serializer=pb.EmbedResponse.SerializeToString
        ),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            service.GetModelInfo,
            request_deserializer=pb.GetModelInfoRequest.FromString,
            response_serializer=pb.ModelInfo.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)  # the generated code's fast path
