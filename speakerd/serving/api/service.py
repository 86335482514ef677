"""The `speakerd.v1.SpeakerEmbedding` gRPC service on grpc.aio.

Embed requests reach the handlers as raw bytes (see `register`); each is parsed without
copying its tensors (wire.py) and validated in a decode thread, never on the event loop
(a 32-chunk fbank is 10 MB to check for NaN, and a hostile message of tiny fields is
thousands of Python steps), then queued in the batcher as chunks and answered with its
own rows in its own order. Bytes being decoded at once are bounded (budget.py).

Every failure maps to one gRPC code and one `speakerd_requests_rejected_total` reason,
with a message naming the field and what was expected and, for INVALID_ARGUMENT, a
`google.rpc.BadRequest` detail saying the same (errors.py); an unexpected exception is
INTERNAL, never UNKNOWN. A call is logged and counted in the latency histogram under the
code it was answered with, with its request id: the `x-request-id` metadata, else the
request's `request_id`, else a generated one (request_ids.py says which ids are accepted).

Which code for which failure:
- INVALID_ARGUMENT: malformed bytes, shape, dtype, byte length, NaN/Inf, an fbank beyond
  MAX_FBANK_MAGNITUDE (no real front-end makes one, and the trunk would overflow), a bad
  request id, and a request of more chunks than the queue holds (it can never be served,
  so it gets a code clients do not retry; the message names the limit and the size).
- RESOURCE_EXHAUSTED: the queue or the decode budget is full now; retrying can succeed.
- INTERNAL: the engine failed, or returned a non-finite embedding for inputs within range.
- DEADLINE_EXCEEDED, UNAVAILABLE (draining, warming up), CANCELLED as their names say.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING

import grpc
import numpy as np

from speakerd.engine.base import DeviceFbank, Engine
from speakerd.engine.segmenter import Segmenter
from speakerd.model.architecture import (
    CHUNK_SAMPLES,
    EMBEDDING_DIM,
    FRAMES,
    MASK_FRAMES,
    MAX_SPEAKERS,
    MEL_BINS,
)
from speakerd.model.inputs import (
    InputError,
    check_fbank,
    check_fbank_magnitude,
    check_masks,
    check_waveform,
)
from speakerd.model.numerics import active_frames, pad_speakers
from speakerd.model.segmentation.architecture import CLASSES as POWERSET_CLASSES
from speakerd.model.segmentation.architecture import OUTPUT_FRAMES as SEGMENTATION_FRAMES
from speakerd.model.segmentation.architecture import SPEAKERS as SEGMENTATION_SPEAKERS
from speakerd.model.source import ModelSource, ResolvedPlda
from speakerd.serving.api.errors import Rejection, abort, batcher_rejection, cancellation, decode_message
from speakerd.serving.api.recording import RecordingService
from speakerd.serving.api.request_ids import RequestIdError, check_request_id, fresh_request_id
from speakerd.serving.api.wire import WireError, WireRequest, parse_request
from speakerd.serving.batching.batcher import Batcher, BatcherError
from speakerd.serving.memory import heap
from speakerd.serving.memory.budget import ByteBudget
from speakerd.serving.memory.recording_budget import RecordingBudget
from speakerd.serving.observability.metrics import Metrics
from speakerd.v1 import speakerd_pb2 as pb
from speakerd.v1.tensors import TensorError, from_tensor, to_tensor

if TYPE_CHECKING:  # a type only: the diarization package (SciPy) stays out of receiver processes
    from speakerd.model.diarization.plda import Plda

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["SpeakerEmbedding"].full_name
REQUEST_ID_KEY = "x-request-id"
#: Threads decoding and validating requests: NumPy releases the GIL in isfinite and casts,
#: so a few threads keep up with a GPU doing ~8,000 chunks/s without blocking the event loop.
DECODE_THREADS = 4
#: The decode byte budget in largest messages: as many as the decode threads work on at
#: once; a message beyond those would only wait in memory for a thread.
DECODE_BUDGET_MESSAGES = DECODE_THREADS
#: Requests of one stream in flight at once: enough to keep a b32 plan busy from a single
#: stream of small requests; gRPC flow control holds the client back beyond it.
STREAM_WINDOW = 16
#: Seconds without a call in progress after which the memory calls freed is given back to
#: the system (heap.give_back): long enough that steady load, whose calls overlap, keeps
#: its buffers (heap.py says why that matters), short enough that a burst's memory does
#: not outlive it by much.
IDLE_TRIM_S = 1.0
#: Value for the server option `grpc.max_concurrent_streams`: calls open at once on one
#: connection. gRPC receives a call's whole message before the handler runs, so this times
#: the message limit bounds what one connection can make the server hold (32 x 64 MiB);
#: 32 one-chunk calls fill a b32 batch, and EmbedChunksStream carries more per call.
MAX_CONCURRENT_STREAMS = 32


def package_version() -> str:
    try:
        return metadata.version("speakerd")
    except metadata.PackageNotFoundError:
        return "0+unknown"


#: The engine's waveform -> fbank rows (Engine.waveform_fbank), run on a decode thread.
WaveformFbank = Callable[[np.ndarray], "np.ndarray | DeviceFbank"]


@dataclass(frozen=True)
class Prepared:
    """A validated request: what the batcher needs plus what the response echoes."""

    fbank: np.ndarray | DeviceFbank  # [n, 998, 80] float32, or rows the GPU computes when staged
    masks: np.ndarray  # [n, 3, F] float32, speakers padded
    speakers: int
    active: np.ndarray  # [n, s] int32


@dataclass(frozen=True)
class Decoded:
    """A parsed and validated request with its own (checked) request_id, "" when none."""

    request_id: str
    prepared: Prepared


def prepare(request: WireRequest, max_chunks: int, waveform_fbank: WaveformFbank) -> Prepared:
    """Decode and validate; InputError naming the field and the expected shape otherwise."""
    try:
        kind = request.features
        if kind is None:
            raise InputError(
                "features", f"set fbank [n, {FRAMES}, {MEL_BINS}] or waveform [n, {CHUNK_SAMPLES}]"
            )
        if kind == "waveform":
            # the engine's: NumPy on the host (CPU engine), or rows the GPU computes when staged
            fbank = waveform_fbank(check_waveform(from_tensor(request.waveform, "waveform")))
        else:
            fbank = check_fbank_magnitude(check_fbank(from_tensor(request.fbank, "fbank")))
        if request.masks is None:
            raise InputError(
                "masks", f"missing; expected [{fbank.shape[0]}, s, F] with s in 1..{MAX_SPEAKERS}"
            )
        masks = check_masks(from_tensor(request.masks, "masks"), fbank.shape[0])
    except TensorError as error:
        raise InputError(error.field, error.message) from error
    if fbank.shape[0] > max_chunks:
        raise InputError(
            kind,
            f"{fbank.shape[0]} chunks, expected at most {max_chunks} (this server's queue, "
            "--queue-chunks): a larger request can never be served; split it",
        )
    return Prepared(fbank, pad_speakers(masks), int(masks.shape[1]), active_frames(masks))


def decode(raw: bytes, max_chunks: int, waveform_fbank: WaveformFbank) -> Decoded:
    """Decode thread: parse, check the request id, validate. Rejection (INVALID_ARGUMENT)
    otherwise, carrying the request's own id once it was read."""
    try:
        request = parse_request(raw)
    except WireError as error:
        raise Rejection.undecodable(error.field, error.message) from error
    try:
        request_id = check_request_id(request.request_id, "request_id")
    except RequestIdError as error:
        raise Rejection.invalid(error.field, error.message) from error
    try:
        return Decoded(request_id, prepare(request, max_chunks, waveform_fbank))
    except InputError as error:
        rejection = Rejection.invalid(error.field, error.message)
        rejection.given_id = request_id
        raise rejection from error


def _source(source: ModelSource) -> pb.ModelSource:
    return pb.ModelSource(
        repo_id=source.repo_id, revision=source.revision, filename=source.filename, sha256=source.sha256,
        synthetic=source.synthetic,
    )  # fmt: skip


class SpeakerEmbeddingService:
    """Serves the engine attached by `attach`; UNAVAILABLE before that and while draining.
    Its methods are the generated servicer's, registered by `register` (embed requests as
    bytes)."""

    def __init__(
        self,
        metrics: Metrics,
        max_message_bytes: int,
        recording_budget: RecordingBudget | None = None,
        plda: tuple[ResolvedPlda, Plda] | None = None,
    ) -> None:
        self.metrics = metrics
        #: --plda (Diarize's VBx), for GetModelInfo; None: none loaded
        self.plda = plda
        self.max_message_bytes = max_message_bytes
        self.engine: Engine | None = None
        self.batcher: Batcher | None = None
        self.model_source = ModelSource()
        self.segmenter: Segmenter | None = None  # EmbedRecording's header.segment
        self.segmentation_source = ModelSource()
        self.draining = False
        self._decoder = ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="decode")
        self._budget = ByteBudget(DECODE_BUDGET_MESSAGES * max_message_bytes)
        self._inflight = 0
        self._trim: asyncio.TimerHandle | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        # EmbedRecording (speakerd.serving.api.recording)
        self.recordings = RecordingService(self, budget=recording_budget)

    def attach(
        self,
        engine: Engine,
        batcher: Batcher,
        source: ModelSource | None = None,
        segmenter: Segmenter | None = None,
        segmentation_source: ModelSource | None = None,
    ) -> None:
        """Serve with `engine` through `batcher`, and `segmenter` for the recordings that
        ask the server to segment; the sources are where their weights came from."""
        self.segmenter = segmenter  # before the engine: a call that sees the engine sees it too
        self.segmentation_source = segmentation_source or ModelSource()
        self.engine, self.batcher = engine, batcher
        self.model_source = source or ModelSource()

    @property
    def inflight(self) -> int:
        """Calls in progress now (embed calls and recordings)."""
        return self._inflight

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
        self.recordings.close()

    # --- calls -------------------------------------------------------------------------

    async def EmbedChunks(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
        """`raw`: the serialized EmbedRequest (see `register`)."""
        try:
            return await self._observed(
                "EmbedChunks", raw, context, lambda given: _request_id(context, given)
            )
        except Rejection as error:
            del raw  # not kept alive by the abort's reference cycle (errors.abort)
            await abort(context, error)
            raise  # not reached: abort raises

    async def EmbedChunksStream(
        self, raw_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.EmbedResponse]:
        """Answers in request order; up to STREAM_WINDOW requests are in flight at once.

        A request reaches the batcher only after every earlier one on the stream passed
        validation, and once one fails no later request is started (those in flight are
        cancelled): the stream ends with the first failure's status, so nothing sent after
        it may cost engine work. A request is read into the window only when there is room,
        so a stream cancelled while its window is full leaves no request behind.
        """
        try:
            stream_id = _request_id(context, "")
        except Rejection as error:
            self.metrics.rejected.labels(reason=error.reason).inc()
            log.info("EmbedChunksStream: %s %s", error.code.name, error.message)
            await abort(context, error)
            return  # not reached: abort raises
        loop = asyncio.get_running_loop()
        room = asyncio.Semaphore(STREAM_WINDOW)
        window: asyncio.Queue[asyncio.Task[pb.EmbedResponse] | None] = asyncio.Queue()
        pending: dict[int, asyncio.Task[pb.EmbedResponse]] = {}
        failed = False

        def settle(index: int, task: asyncio.Task[pb.EmbedResponse]) -> None:
            """A request failed: cancel every later one, and read no more."""
            nonlocal failed
            if task.cancelled() or task.exception() is None:
                return
            failed = True
            for later, other in pending.items():
                if later > index:
                    other.cancel()

        async def read() -> None:
            index, after = 0, None
            try:
                while True:
                    # room first, then read: a full window holds the client back by flow
                    # control, and a stream cancelled while waiting leaves no request behind
                    await room.acquire()
                    if failed:
                        break
                    try:
                        raw = await anext(raw_iterator)
                    except StopAsyncIteration:
                        break
                    if failed:
                        break
                    validated: asyncio.Future[bool] = loop.create_future()
                    own = f"{stream_id}/{index}"
                    call = self._observed(
                        "EmbedChunksStream", raw, context, lambda given, f=own: given or f, after, validated
                    )
                    task = asyncio.ensure_future(call)
                    pending[index] = task
                    task.add_done_callback(functools.partial(settle, index))
                    window.put_nowait(task)
                    index, after = index + 1, validated
            finally:
                window.put_nowait(None)

        reader = asyncio.ensure_future(read())
        index = 0
        try:
            while (task := await window.get()) is not None:
                try:
                    response = await task
                except Rejection as error:
                    await abort(context, error, f"request {index} (id {error.request_id}): ")
                del pending[index]
                room.release()
                yield response
                index += 1
        finally:
            reader.cancel()
            for task in pending.values():
                task.cancel()

    async def GetModelInfo(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        """`raw`: the serialized GetModelInfoRequest (see `register`): bytes that are not one
        are INVALID_ARGUMENT, not the UNKNOWN gRPC's own deserializer answers."""
        try:
            decode_message(pb.GetModelInfoRequest, raw)
        except Rejection as error:
            self.metrics.rejected.labels(reason=error.reason).inc()
            log.log(error.level, "GetModelInfo: %s %s", error.code.name, error.message)
            await abort(context, error)
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
            waveform_supported=True,
            max_message_bytes=self.max_message_bytes,
            source=_source(self.model_source),
            segmentation=self._segmentation_info(),
            plda=self._plda_info(),
        )

    def _segmentation_info(self) -> pb.SegmentationModelInfo | None:
        segmenter = self.segmenter
        if segmenter is None:
            return None
        return pb.SegmentationModelInfo(
            model_id=segmenter.model_id,
            engine=segmenter.name,
            frames=SEGMENTATION_FRAMES,
            speakers=SEGMENTATION_SPEAKERS,
            classes=POWERSET_CLASSES,
            source=_source(self.segmentation_source),
        )

    def _plda_info(self) -> pb.PldaInfo | None:
        if self.plda is None:
            return None
        resolved, plda = self.plda
        return pb.PldaInfo(
            plda_id=resolved.plda_id,
            source=_source(resolved.source),
            embedding_dim=plda.embedding_dimension,
            dimension=plda.lda_dimension,
        )

    # --- one request -------------------------------------------------------------------

    async def _observed(
        self,
        method: str,
        raw: bytes,
        context: grpc.aio.ServicerContext,
        name: Callable[[str], str],
        after: asyncio.Future[bool] | None = None,
        validated: asyncio.Future[bool] | None = None,
    ) -> pb.EmbedResponse:
        """Serve one serialized request with its metrics and log line; `name` turns the
        request's own request_id into the id it is logged and answered under. Failures
        raise Rejection (the caller aborts the call with it).

        Streams order submission: `after` resolves True once every earlier request of the
        stream passed validation (False when one failed); `validated` is resolved likewise
        for this request and those before it."""
        started = time.perf_counter()
        budget = context.time_remaining()  # the deadline's share of it decides a cancellation's reason
        code = grpc.StatusCode.OK
        request_id = fresh_request_id()
        self._enter()
        try:
            request_id = name("")
            decoded = await self._decode(raw, context)
            request_id = name(decoded.request_id)
            # shielded: this call being cancelled must not cancel the previous one's future
            if after is not None and not await asyncio.shield(after):
                raise asyncio.CancelledError  # an earlier request failed: the stream ends there
            if validated is not None and not validated.done():
                validated.set_result(True)
            response = await self._embed(decoded, context, request_id)
            log.debug("%s %s: %d chunks in %.1f ms", method, request_id, decoded.prepared.fbank.shape[0],
                      1e3 * (time.perf_counter() - started))  # fmt: skip
            return response
        except Rejection as error:
            code = error.code
            if error.given_id:
                request_id = _or_fresh(name, error.given_id)
            error.request_id = request_id
            self.metrics.rejected.labels(reason=error.reason).inc()
            log.log(error.level, "%s %s: %s %s", method, request_id, code.name, error.message)
            raise
        except asyncio.CancelledError:
            code, reason = cancellation(context, budget)
            self.metrics.rejected.labels(reason=reason).inc()
            log.info("%s %s: %s", method, request_id, reason.replace("_", " "))
            raise
        except Exception as error:  # a bug here, not the caller's: INTERNAL, never UNKNOWN
            code = grpc.StatusCode.INTERNAL
            self.metrics.rejected.labels(reason="internal").inc()
            log.exception("%s %s: INTERNAL unexpected %s", method, request_id, type(error).__name__)
            internal = Rejection(
                code, "internal", f"internal error ({type(error).__name__}); see the server log"
            )
            internal.request_id = request_id
            raise internal from error
        finally:
            if validated is not None and not validated.done():
                validated.set_result(False)
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
            if self._trim is not None:
                self._trim.cancel()
            self._trim = asyncio.get_running_loop().call_later(IDLE_TRIM_S, self._give_back)

    def _give_back(self) -> None:
        """Still idle IDLE_TRIM_S after the last call: collect the calls' garbage (a failed
        call's request bytes can sit in a reference cycle, through its exception's
        traceback, until a full collection), then return freed memory, off the loop."""
        self._trim = None
        if self._inflight == 0:
            gc.collect()
            with contextlib.suppress(RuntimeError):  # the executor is shut down: stopping
                self._decoder.submit(heap.give_back)

    def _ready(self) -> Batcher:
        """The batcher when calls are taken; Rejection (UNAVAILABLE) while warming or draining."""
        if self.draining:
            raise Rejection(
                grpc.StatusCode.UNAVAILABLE, "draining", "the server is draining; retry elsewhere"
            )
        if self.engine is None or self.batcher is None:
            raise Rejection(grpc.StatusCode.UNAVAILABLE, "not_ready", "the engine is still warming up")
        return self.batcher

    async def _decode(self, raw: bytes, context: grpc.aio.ServicerContext) -> Decoded:
        """Parse and validate in a decode thread, within the byte budget."""
        batcher = self._ready()
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            raise Rejection(
                grpc.StatusCode.DEADLINE_EXCEEDED, "deadline_exceeded", "deadline passed on arrival"
            )
        size = len(raw)
        if not self._budget.take(size):
            raise Rejection(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "decode_budget",
                f"request: {size} bytes do not fit the decode budget now ({self._budget.used_bytes} of "
                f"{self._budget.limit_bytes} bytes in use by other requests); retry with backoff",
            )
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(
                self._decoder, decode, raw, batcher.queue_chunks, self.engine.waveform_fbank
            )
        finally:
            self._budget.give(size)

    async def _embed(
        self, decoded: Decoded, context: grpc.aio.ServicerContext, request_id: str
    ) -> pb.EmbedResponse:
        batcher, engine = self.batcher, self.engine  # checked by _decode: a call begun is served
        assert batcher is not None and engine is not None
        prepared = decoded.prepared
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        try:
            result = await batcher.submit(prepared.fbank, prepared.masks, deadline)
        except BatcherError as error:
            raise batcher_rejection(error) from error
        embeddings = result.embeddings[:, : prepared.speakers]
        finite = np.isfinite(embeddings)
        if not finite.all():  # inputs were finite and in range: the fault is the server's
            raise Rejection(
                grpc.StatusCode.INTERNAL,
                "internal",
                f"embeddings: the engine returned {finite.size - int(finite.sum())} non-finite values "
                "for finite inputs within range; a server fault, reported in its log",
            )
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
    """x-request-id metadata, else the request's own id (checked already), else a fresh
    one; Rejection (INVALID_ARGUMENT) for metadata that is no usable id."""
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_KEY and value:
            try:
                return check_request_id(str(value), REQUEST_ID_KEY)
            except RequestIdError as error:
                raise Rejection.invalid(error.field, error.message) from error
    return given or fresh_request_id()


def _or_fresh(name: Callable[[str], str], given: str) -> str:
    """`name(given)`, or a fresh id when even the metadata id is unusable."""
    try:
        return name(given)
    except Rejection:
        return fresh_request_id()


def register(service: SpeakerEmbeddingService, server: grpc.aio.Server) -> None:
    """Add `service` to `server` as the generated add_SpeakerEmbeddingServicer_to_server
    would, except that every method gets its requests as raw bytes (no request
    deserializer): the embed methods for wire.parse_request to read without copying the
    tensors, the others to answer undecodable bytes as INVALID_ARGUMENT (decode_message)."""
    handlers = {
        "EmbedChunks": grpc.unary_unary_rpc_method_handler(
            service.EmbedChunks, response_serializer=pb.EmbedResponse.SerializeToString
        ),
        "EmbedChunksStream": grpc.stream_stream_rpc_method_handler(
            service.EmbedChunksStream, response_serializer=pb.EmbedResponse.SerializeToString
        ),
        # raw bytes too, decoded by the handlers (errors.decode_message says why)
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            service.GetModelInfo, response_serializer=pb.ModelInfo.SerializeToString
        ),
        "EmbedRecording": grpc.stream_stream_rpc_method_handler(
            service.recordings.EmbedRecording, response_serializer=pb.EmbedRecordingResponse.SerializeToString
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)  # the generated code's fast path
