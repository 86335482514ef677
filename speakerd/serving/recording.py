"""`EmbedRecording`: a whole recording in, its windows' embeddings out as they are computed.

The client streams a header, PCM pieces and then the masks of every window
(speakerd.proto). Each piece is decoded, downmixed, resampled and turned into log-mel
frames as it arrives (speakerd.model.recording, off the event loop), so the call holds the
recording's frames (115 MB an hour) but never its PCM. Once the masks of `max_batch`
windows are in, those windows' fbank is sliced from the frames and submitted to the shared
batcher like any EmbedChunks request; at most BATCHES_IN_FLIGHT such batches wait at once,
which bounds the call's memory and holds the client back through gRPC flow control.
Responses leave in window order as their batches finish.

A client that goes away cancels the handler: its queued batches leave the batcher before
reaching the engine (Batcher.submit's cancellation) and no further windows are computed.
Bad input is INVALID_ARGUMENT naming the field and what was expected.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import grpc
import numpy as np

from speakerd.engine.base import Engine
from speakerd.model.architecture import CHUNK_SAMPLES, MAX_SPEAKERS, SAMPLE_RATE
from speakerd.model.inputs import InputError, check_masks
from speakerd.model.numerics import active_frames, pad_speakers
from speakerd.model.recording import (
    Encoding,
    FbankSource,
    RecordingDecoder,
    SharedFrames,
    exclude_overlap,
    step_samples,
    window_starts_s,
)
from speakerd.serving.batcher import PIPELINE_DEPTH, Batcher, BatcherError
from speakerd.serving.errors import Rejection, abort, batcher_rejection, cancellation
from speakerd.serving.metrics import Metrics
from speakerd.serving.request_ids import RequestIdError, check_request_id, fresh_request_id
from speakerd.v1 import speakerd_pb2 as pb
from speakerd.v1.tensors import TensorError, from_tensor, to_tensor

log = logging.getLogger(__name__)

METHOD = "EmbedRecording"
REQUEST_ID_KEY = "x-request-id"
#: Longest recording one call may send: its frames take 32 KB per second (345 MB for 3 h).
MAX_RECORDING_S = 3 * 3600.0
#: Batches of one call submitted and not yet answered: one per engine worker plus one being
#: prepared keeps the engine busy; more would only hold fbank (10 MB per b32 batch) longer.
#: With `serve --devices` every device has PIPELINE_DEPTH workers (`batches_in_flight`).
BATCHES_IN_FLIGHT = PIPELINE_DEPTH + 1


def batches_in_flight(devices: int) -> int:
    """BATCHES_IN_FLIGHT for an engine of `devices` devices: one call can keep all busy."""
    return PIPELINE_DEPTH * devices + 1


#: Threads decoding PCM and slicing fbank for all recording calls (NumPy releases the GIL).
DECODE_THREADS = 2
#: pyannote's Inference window; the model's chunk admits no other.
WINDOW_S = CHUNK_SAMPLES / SAMPLE_RATE
DEFAULT_STEP_S = 1.0
ENCODINGS = {pb.AUDIO_ENCODING_PCM_S16LE: Encoding.S16, pb.AUDIO_ENCODING_PCM_F32LE: Encoding.F32}


class Host(Protocol):
    """What the call needs of SpeakerEmbeddingService: its engine, batcher, metrics, and its
    in-flight accounting (so that a drain waits for recordings too)."""

    engine: Engine | None
    batcher: Batcher | None
    draining: bool
    metrics: Metrics

    def _enter(self) -> None: ...

    def _leave(self) -> None: ...


def _invalid(error: InputError | TensorError | RequestIdError) -> Rejection:
    """INVALID_ARGUMENT with a BadRequest violation for the error's field."""
    return Rejection.invalid(error.field, str(error).removeprefix(f"{error.field}: "))


class RecordingService:
    """The EmbedRecording method of `host` (registered by speakerd.serving.service.register)."""

    def __init__(
        self,
        host: Host,
        max_seconds: float = MAX_RECORDING_S,
        fbank_source: Callable[[int], FbankSource] | None = None,
    ) -> None:
        """`fbank_source(step samples)` makes each call's FbankSource; by default the
        serving engine's own (`Engine.fbank_source`: on the device for the GPU engine, the
        host's shared frames for the CPU engine), asked per call since the engine is built
        after the server starts listening."""
        self.host = host
        self.max_seconds = max_seconds
        self.fbank_source = fbank_source
        self.pool = ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="recording")

    def source_for(self, step: int) -> FbankSource:
        if self.fbank_source is not None:
            return self.fbank_source(step)
        engine = self.host.engine
        return engine.fbank_source(step) if engine is not None else SharedFrames(step)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def EmbedRecording(
        self, requests: AsyncIterator[pb.EmbedRecordingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.EmbedRecordingResponse]:
        host, started, code = self.host, time.perf_counter(), grpc.StatusCode.OK
        call = _Call(self, context)
        host._enter()
        try:
            async for response in call.run(requests):
                yield response
            log.debug("%s %s: %d windows in %.1f s", METHOD, call.request_id, call.windows or 0,
                      time.perf_counter() - started)  # fmt: skip
        except Rejection as error:
            code = error.code
            host.metrics.rejected.labels(reason=error.reason).inc()
            level = logging.ERROR if code == grpc.StatusCode.INTERNAL else logging.INFO
            log.log(level, "%s %s: %s %s", METHOD, call.request_id, code.name, error.message)
            await abort(context, error)
        except asyncio.CancelledError:
            code, reason = cancellation(context)
            host.metrics.rejected.labels(reason=reason).inc()
            log.info("%s %s: %s after %d windows sent", METHOD, call.request_id,
                     "deadline passed" if reason != "cancelled" else "cancelled", call.sent)  # fmt: skip
            raise
        except grpc.aio.AbortError:
            raise
        except Exception as error:  # a server bug: INTERNAL, not an UNKNOWN status
            code = grpc.StatusCode.INTERNAL
            host.metrics.rejected.labels(reason="internal").inc()
            log.exception("%s %s: failed", METHOD, call.request_id)
            await abort(context, Rejection(code, "internal", f"server error: {error}"))
        finally:
            host.metrics.request_duration.labels(method=METHOD, code=code.name).observe(
                time.perf_counter() - started
            )
            host._leave()


class _Call:
    """One EmbedRecording call: a reader task consuming the client's messages and submitting
    batches, and `run` answering them in order."""

    def __init__(self, service: RecordingService, context: grpc.aio.ServicerContext) -> None:
        self.service = service
        self.host = service.host
        self.context = context
        self.request_id = fresh_request_id()  # until the metadata or header give one
        remaining = context.time_remaining()
        self.deadline = None if remaining is None else time.monotonic() + remaining
        self.decoder: RecordingDecoder | None = None
        self.step = 0
        self.exclude_overlap = False
        self.windows: int | None = None  # known once the first masks message arrives
        self.speakers = self.mask_frames = 0
        self.received = 0  # mask rows received
        self.submitted = 0  # windows submitted to the batcher
        self.sent = 0  # windows answered
        self.pending: list[np.ndarray] = []  # mask rows not submitted yet
        self.failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        devices = service.host.engine.device_count if service.host.engine is not None else 1
        self.batches: asyncio.Queue[asyncio.Task[pb.EmbedRecordingResponse] | None] = asyncio.Queue(
            batches_in_flight(devices)
        )
        self.tasks: list[asyncio.Task[pb.EmbedRecordingResponse]] = []

    async def run(
        self, requests: AsyncIterator[pb.EmbedRecordingRequest]
    ) -> AsyncIterator[pb.EmbedRecordingResponse]:
        reader = asyncio.ensure_future(self._read(requests))
        try:
            while True:
                item = await self._unless_failed(asyncio.ensure_future(self.batches.get()))
                if item is None:
                    return
                response = await self._unless_failed(item)
                self.sent += len(response.starts)
                yield response
        finally:
            reader.cancel()
            for task in self.tasks:
                task.cancel()  # their batcher jobs leave the queue before any engine work
                if task.done() and not task.cancelled():
                    task.exception()  # retrieved: a failure after the call ended is not logged twice

    async def _unless_failed(self, awaitable: asyncio.Future):  # type: ignore[type-arg]
        """The awaitable's result, unless the reader failed first: then its Rejection."""
        await asyncio.wait({awaitable, self.failed}, return_when=asyncio.FIRST_COMPLETED)
        if self.failed.done():
            awaitable.cancel()
            self.failed.result()
        return awaitable.result()

    def _fail(self, error: Rejection) -> None:
        if not self.failed.done():
            self.failed.set_exception(error)

    async def _read(self, requests: AsyncIterator[pb.EmbedRecordingRequest]) -> None:
        try:
            async for message in requests:
                part = message.WhichOneof("part")
                if part != "header" and self.decoder is None:
                    raise InputError(
                        "header", f"the first message must be the header, got {part or 'nothing'}"
                    )
                if part == "header":
                    self._header(message.header)
                elif part == "audio":
                    await self._audio(message.audio)
                elif part == "masks":
                    await self._masks(message.masks)
                else:
                    raise InputError("part", "an empty message; set header, audio or masks")
            await self._end()
        except (InputError, TensorError, RequestIdError) as error:
            self._fail(_invalid(error))
        except Rejection as error:
            self._fail(error)
        except Exception as error:
            log.exception("%s %s: reading the call failed", METHOD, self.request_id)
            self._fail(Rejection(grpc.StatusCode.INTERNAL, "internal", f"server error: {error}"))

    def _header(self, header: pb.RecordingHeader) -> None:
        if self.decoder is not None:
            raise InputError("header", "sent twice; one header, then audio pieces, then masks")
        if self.host.draining:
            raise Rejection(
                grpc.StatusCode.UNAVAILABLE, "draining", "the server is draining; retry elsewhere"
            )
        if self.host.engine is None or self.host.batcher is None:
            raise Rejection(grpc.StatusCode.UNAVAILABLE, "not_ready", "the engine is still warming up")
        given = _metadata_id(self.context) or check_request_id(header.request_id, "header.request_id")
        self.request_id = given or self.request_id
        if header.encoding not in ENCODINGS:
            known = header.encoding in pb.AudioEncoding.values()
            name = pb.AudioEncoding.Name(header.encoding) if known else str(header.encoding)
            raise InputError(
                "header.encoding", f"{name}, expected AUDIO_ENCODING_PCM_S16LE or AUDIO_ENCODING_PCM_F32LE"
            )
        if header.window_s not in (0.0, WINDOW_S):
            raise InputError("header.window_s", f"{header.window_s} s, expected {WINDOW_S:g} (or 0 for it)")
        self.step = step_samples(header.step_s or DEFAULT_STEP_S)
        self.exclude_overlap = header.exclude_overlap
        self.decoder = RecordingDecoder(
            header.sample_rate,
            header.channels,
            ENCODINGS[header.encoding],
            source=self.service.source_for(self.step),
            step=self.step,
            max_seconds=self.service.max_seconds,
        )

    async def _audio(self, data: bytes) -> None:
        if self.windows is not None:
            raise InputError(
                "audio", "a piece after the masks; send every audio piece before the first masks"
            )
        assert self.decoder is not None
        await asyncio.get_running_loop().run_in_executor(self.service.pool, self.decoder.push, data)

    async def _finish_audio(self) -> int:
        if self.windows is None:
            assert self.decoder is not None
            loop = asyncio.get_running_loop()
            self.windows = await loop.run_in_executor(self.service.pool, self.decoder.finish)
        return self.windows

    async def _masks(self, message: pb.RecordingMasks) -> None:
        windows = await self._finish_audio()
        if message.windows != windows:
            assert self.decoder is not None
            raise InputError(
                "masks.windows",
                f"{message.windows}, but the {self.decoder.seconds:.3f} s of audio received make "
                f"{windows} windows of {WINDOW_S:g} s every {self.step / SAMPLE_RATE:g} s",
            )
        if not message.HasField("masks"):
            raise InputError("masks.masks", f"missing; expected [k, s, F] rows of the {windows} windows")
        masks = from_tensor(message.masks, "masks.masks")
        left = windows - self.received
        if masks.ndim != 3 or not 1 <= masks.shape[0] <= left:
            raise InputError(
                "masks.masks",
                f"shape {list(masks.shape)}, expected [k, s, F] with 1 <= k <= {left} "
                f"({self.received} of {windows} windows' rows received)",
            )
        masks = check_masks(masks, masks.shape[0], "masks.masks")
        if self.received and masks.shape[1:] != (self.speakers, self.mask_frames):
            raise InputError(
                "masks.masks",
                f"shape {list(masks.shape)}, expected [k, {self.speakers}, {self.mask_frames}] "
                "as in the first masks message",
            )
        self.speakers, self.mask_frames = int(masks.shape[1]), int(masks.shape[2])
        self.received += masks.shape[0]
        self.pending.append(masks)
        await self._submit(final=False)

    async def _end(self) -> None:
        if self.decoder is None:
            raise InputError("header", "the call ended before its header")
        windows = await self._finish_audio()
        if self.received != windows:
            raise InputError(
                "masks",
                f"the call ended after {self.received} mask rows, expected {windows} "
                f"([{windows}, s, F], one row per window)",
            )
        await self._submit(final=True)
        await self.batches.put(None)

    async def _submit(self, final: bool) -> None:
        """Submit every full batch of pending rows (and, when final, the rest)."""
        assert self.host.batcher is not None
        size = self.host.batcher.engine.max_batch
        rows = np.concatenate(self.pending) if self.pending else np.zeros((0, MAX_SPEAKERS, 1), np.float32)
        at = 0
        while rows.shape[0] - at >= size or (final and rows.shape[0] > at):
            count = min(size, rows.shape[0] - at)
            task = asyncio.ensure_future(self._embed(self.submitted, rows[at : at + count]))
            self.tasks.append(task)
            self.submitted += count
            at += count
            await self.batches.put(task)  # blocks while BATCHES_IN_FLIGHT are unanswered
        self.pending = [rows[at:]] if rows.shape[0] > at else []

    def _prepare(self, first: int, masks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Worker thread: the windows' fbank, the masks pooled under, and their active frames."""
        assert self.decoder is not None
        fbank = self.decoder.source.windows(first, first + masks.shape[0])
        used = exclude_overlap(masks) if self.exclude_overlap else masks
        return fbank, pad_speakers(used), active_frames(used)

    async def _embed(self, first: int, masks: np.ndarray) -> pb.EmbedRecordingResponse:
        engine, batcher = self.host.engine, self.host.batcher
        assert engine is not None and batcher is not None
        loop = asyncio.get_running_loop()
        fbank, padded, active = await loop.run_in_executor(self.service.pool, self._prepare, first, masks)
        try:
            result = await batcher.submit(fbank, padded, self.deadline)
        except BatcherError as error:
            raise batcher_rejection(error, f"windows {first}..{first + masks.shape[0] - 1}: ") from error
        count = masks.shape[0]
        starts = window_starts_s(first, first + count, self.step)
        return pb.EmbedRecordingResponse(
            embeddings=to_tensor(result.embeddings[:, : self.speakers]),
            first_window=first,
            starts=starts.tolist(),
            empty=(active == 0).ravel().tolist(),
            active_frames=active.ravel().tolist(),
            windows=self.windows or 0,
            model_id=engine.model_id,
            precision=str(engine.math),
            request_id=self.request_id,
            plans=sorted(set(result.plans)),
            fp16_fallbacks=result.fp16_fallbacks,
        )


def _metadata_id(context: grpc.aio.ServicerContext) -> str:
    """The x-request-id metadata ("" when absent); RequestIdError when unusable."""
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_KEY and value:
            return check_request_id(str(value), REQUEST_ID_KEY)
    return ""
