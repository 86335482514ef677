"""`EmbedRecording`: a whole recording in, its windows' embeddings out as they are computed.

The client streams a header, then PCM pieces and the masks of every window in any
interleaving (speakerd.proto); its side's close ends the audio. Each piece is decoded,
downmixed, resampled and turned into log-mel frames as it arrives (speakerd.model.recording,
on the GPU for the GPU engine, off the event loop), so the call holds the recording's frames
(115 MB an hour) but never its PCM. A window is submitted once its mask rows are in and its
audio is complete (`FbankSource.ready`): `max_batch` windows at a time to the shared batcher,
like any EmbedChunks request. A client that sends the masks first therefore has its
embeddings computed while the rest of its audio is still on the wire. Two tasks: the reader
takes every message as fast as it comes (the audio turns into frames at once, so the upload
is never paced by the engine: on the H200, with the upload paced, an hour of 16 kHz audio
sent masks first took 943 ms against 838 ms with the masks last), and the submitter hands
ready windows to the batcher, at most BATCHES_IN_FLIGHT batches waiting at once so that one
call cannot crowd the queue; a batch that finds the queue full (many recordings at once)
waits for room up to the call's deadline rather than failing the recording. Responses leave
in window order as batches finish.

Silent windows (every speaker mask empty, after `exclude_overlap` when asked) cost no engine
work: the batcher answers them with the model's empty-mask rows (batcher.py). So that the
engine still gets full batches, a submission holds `max_batch` windows that are not silent,
the silent ones between them riding along, up to SUBMIT_WINDOWS_FACTOR x `max_batch` windows
in all (a long silence is answered without waiting for the speech after it, and a submission
never holds more than that many windows' fbank).

The window count is checked against the masks' declared `windows` as early as it can be:
against `header.frames` on the first masks message when the header gives it, as soon as
the audio received makes more windows than declared, and at the end of the audio.

With `header.segment` the server finds the masks itself: the decoded 16 kHz samples are kept
for the windows not yet segmented (speakerd.model.segmentation.samples), a third task hands
each group of complete windows to the segmentation engine (engine/segmenter.py) on its own
threads, and the multilabel segmentation it returns takes the place of the masks messages
(the same checks, exclude_overlap and silent-window path follow); every response carries its
windows' segmentation. The reader waits while more than MAX_KEPT_WINDOW_GROUPS groups of
windows' samples wait for the segmenter, so a fast upload never piles audio up in memory.
A call without `segment` runs none of this.

Admission: a call reserves the memory it will hold (its frames and mask rows, from
`header.frames`, else for the longest recording the server takes) in the server's recording
budget (speakerd/serving/memory/recording_budget.py) when its header arrives; one that does
not fit waits behind earlier ones up to its deadline, and only a full wait queue refuses it
at once.

A client that goes away cancels the handler: its queued batches leave the batcher before
reaching the engine (Batcher.submit's cancellation) and no further windows are computed.
Bad input is INVALID_ARGUMENT naming the field and what was expected.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import grpc
import numpy as np

from speakerd.engine.base import Engine
from speakerd.engine.segmenter import Segmenter
from speakerd.model.architecture import CHUNK_SAMPLES, MASK_FRAMES, MAX_SPEAKERS, MEL_BINS, SAMPLE_RATE
from speakerd.model.inputs import InputError, check_masks
from speakerd.model.numerics import active_frames, pad_speakers
from speakerd.model.recording import (
    Encoding,
    FbankSource,
    RecordingDecoder,
    SharedFrames,
    check_format,
    exclude_overlap,
    step_samples,
    window_count,
    window_starts_s,
)
from speakerd.model.resample import output_length
from speakerd.model.segmentation.samples import Segmentable, SegmentingSource
from speakerd.serving.api.errors import Rejection, abort, batcher_rejection, cancellation, decode_stream
from speakerd.serving.api.request_ids import RequestIdError, check_request_id, fresh_request_id
from speakerd.serving.batching.batcher import PIPELINE_DEPTH, Batcher, BatcherError, silent_windows
from speakerd.serving.memory.recording_budget import (
    DEFAULT_RECORDING_MEMORY_MB,
    DEFAULT_RECORDING_QUEUE,
    QueueFull,
    RecordingBudget,
    Reservation,
    TooLarge,
)
from speakerd.serving.observability.metrics import Metrics
from speakerd.v1 import speakerd_pb2 as pb
from speakerd.v1.tensors import TensorError, from_tensor, to_tensor

log = logging.getLogger(__name__)

METHOD = "EmbedRecording"
REQUEST_ID_KEY = "x-request-id"
#: Longest recording one call may send: its frames take 32 KB per second (345 MB for 3 h).
MAX_RECORDING_S = 3 * 3600.0
#: A second of audio's log-mel frames as the call keeps them: 100 frames of 80 float32.
FRAME_BYTES_PER_S = 100 * MEL_BINS * 4
#: Mask bytes a window is reserved before its first masks message says more: pyannote's
#: float32 row [3, 589] (uint8 masks, what the client library sends, take a quarter).
ASSUMED_ROW_BYTES = MAX_SPEAKERS * MASK_FRAMES * 4
#: Batches of one call submitted and not yet answered: one per engine worker plus one being
#: prepared keeps the engine busy; more would only hold fbank (10 MB per b32 batch) longer.
#: With `serve --devices` every device has PIPELINE_DEPTH workers (`batches_in_flight`).
BATCHES_IN_FLIGHT = PIPELINE_DEPTH + 1


def batches_in_flight(devices: int) -> int:
    """BATCHES_IN_FLIGHT for an engine of `devices` devices: one call can keep all busy."""
    return PIPELINE_DEPTH * devices + 1


#: Most windows one submission holds, in units of `max_batch`: `max_batch` windows to run
#: plus silent ones, so full batches up to 75% silence; a submission of 4 x 32 windows holds
#: 41 MB of fbank on the CPU engine (the GPU engine's rows stay on the device).
SUBMIT_WINDOWS_FACTOR = 4


#: Threads decoding PCM and slicing fbank for all recording calls (NumPy releases the GIL).
DECODE_THREADS = 2
#: Threads running the segmentation engine for all segmenting calls: on the CPU segmenter
#: each call is compute-bound (its matmuls use every core through BLAS), so two calls at once
#: keep the cores busy through each other's single-threaded NumPy steps.
SEGMENT_THREADS = 2
#: Groups of windows (the segmenter's `max_windows` each) whose samples a segmenting call may
#: hold before its reader waits for the segmenter: the group being segmented and the next one
#: arriving, so the segmenter never waits for audio that is on the wire while a fast upload
#: holds at most two groups' span (a window plus 64 s of audio, 4.1 MB, for the CPU
#: segmenter's 32 windows at the default step) instead of the whole recording.
MAX_KEPT_WINDOW_GROUPS = 2
#: pyannote's Inference window; the model's chunk admits no other.
WINDOW_S = CHUNK_SAMPLES / SAMPLE_RATE
DEFAULT_STEP_S = 1.0
ENCODINGS = {pb.AUDIO_ENCODING_PCM_S16LE: Encoding.S16, pb.AUDIO_ENCODING_PCM_F32LE: Encoding.F32}


class Host(Protocol):
    """What the call needs of SpeakerEmbeddingService: its engine, batcher, metrics, and its
    in-flight accounting (so that a drain waits for recordings too)."""

    engine: Engine | None
    segmenter: Segmenter | None
    batcher: Batcher | None
    draining: bool
    metrics: Metrics

    def _enter(self) -> None: ...

    def _leave(self) -> None: ...


def _invalid(error: InputError | TensorError | RequestIdError) -> Rejection:
    """INVALID_ARGUMENT with a BadRequest violation for the error's field."""
    return Rejection.invalid(error.field, str(error).removeprefix(f"{error.field}: "))


async def reserve(
    budget: RecordingBudget,
    need: int,
    deadline: float | None,
    too_large: Callable[[], Exception],
    queue: str,
    what: str,
    report: Callable[[int], None],
) -> Reservation:
    """`need` bytes of `budget`, waiting in arrival order up to `deadline` (time.monotonic(),
    None: no deadline). `queue` full is RESOURCE_EXHAUSTED; more than the whole budget raises
    `too_large()`; the deadline passing is DEADLINE_EXCEEDED naming the `what` budget.
    `report(waiting)` updates the budget's metrics before and after (1 while this call waits)."""
    waited = time.monotonic()
    try:
        admitting = budget.admit(need)
        report(1)
        if deadline is None:
            return await admitting
        return await asyncio.wait_for(admitting, max(0.0, deadline - time.monotonic()))
    except QueueFull as error:
        raise Rejection(
            grpc.StatusCode.RESOURCE_EXHAUSTED, "queue_full", f"{queue}: {error}; retry with backoff"
        ) from error
    except TooLarge as error:
        raise too_large() from error
    except TimeoutError as error:
        raise Rejection(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            "deadline_exceeded",
            f"the deadline passed after {time.monotonic() - waited:.1f} s waiting for room in the "
            f"server's {what} budget",
        ) from error
    finally:
        report(0)


class RecordingService:
    """The EmbedRecording method of `host` (registered by speakerd.serving.api.service.register)."""

    def __init__(
        self,
        host: Host,
        max_seconds: float = MAX_RECORDING_S,
        fbank_source: Callable[[int], FbankSource] | None = None,
        budget: RecordingBudget | None = None,
    ) -> None:
        """`fbank_source(step samples)` makes each call's FbankSource; by default the
        serving engine's own (`Engine.fbank_source`: on the device for the GPU engine, the
        host's shared frames for the CPU engine), asked per call since the engine is built
        after the server starts listening."""
        self.host = host
        self.max_seconds = max_seconds
        self.fbank_source = fbank_source
        self.pool = ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="recording")
        self.segment_pool = ThreadPoolExecutor(SEGMENT_THREADS, thread_name_prefix="segment")
        self.budget = budget or RecordingBudget(DEFAULT_RECORDING_MEMORY_MB << 20, DEFAULT_RECORDING_QUEUE)

    def source_for(self, step: int) -> FbankSource:
        if self.fbank_source is not None:
            return self.fbank_source(step)
        engine = self.host.engine
        return engine.fbank_source(step) if engine is not None else SharedFrames(step)

    def segmenting_source_for(self, step: int) -> Segmentable | None:
        """The engine's own source for a recording it segments (Engine.segmenting_source:
        `serve --devices` keeps its samples in a device worker); None: a SegmentingSource
        keeps them here."""
        engine = self.host.engine
        if self.fbank_source is not None or engine is None:
            return None
        return engine.segmenting_source(step)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.segment_pool.shutdown(wait=False, cancel_futures=True)

    def windows(
        self,
        requests: AsyncIterator[pb.EmbedRecordingRequest],
        context: grpc.aio.ServicerContext,
        masks_of: Callable[[np.ndarray], np.ndarray] | None = None,
        kept_row_bytes: int = 0,
        held: list[Reservation] | None = None,
    ) -> AsyncIterator[pb.EmbedRecordingResponse]:
        """A call's responses without EmbedRecording's metrics and log line: for methods
        built on the recording path (voiceprints, Diarize), which decode their own calls and
        account for them themselves. Failures raise Rejection. With `header.segment`,
        `masks_of` turns the segmentation [k, 589, 3] into the masks pooled under (default:
        its speakers, [k, 3, 589]). `kept_row_bytes`: what the caller keeps of each window's
        answer, reserved with the recording; `held`: when given, the call's reservation is
        appended to it at the end instead of released, for a caller whose work goes on with
        what it kept (Diarize's clustering), which then releases it."""
        return _Call(self, context, masks_of, kept_row_bytes, held).run(requests)

    async def EmbedRecording(
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.EmbedRecordingResponse]:
        """`requests`: the serialized EmbedRecordingRequests (service.register), decoded here
        (errors.decode_stream: undecodable bytes are INVALID_ARGUMENT)."""
        host, started, code = self.host, time.perf_counter(), grpc.StatusCode.OK
        call = _Call(self, context)
        host._enter()
        try:
            # closed at once when the handler ends, however it ends: its finally cancels the
            # call's batches (not left to the event loop's async-generator finalizer)
            async with contextlib.aclosing(
                call.run(decode_stream(pb.EmbedRecordingRequest, requests))
            ) as responses:
                async for response in responses:
                    yield response
            log.debug("%s %s: %d windows (%d silent, not run) in %.1f s", METHOD, call.request_id,
                      call.windows or 0, call.silent, time.perf_counter() - started)  # fmt: skip
        except Rejection as error:
            code = error.code
            host.metrics.rejected.labels(reason=error.reason).inc()
            log.log(error.level, "%s %s: %s %s", METHOD, call.request_id, code.name, error.message)
            del call  # its frames and rows are not kept alive by the abort's cycle (errors.abort)
            await abort(context, error)
        except (asyncio.CancelledError, GeneratorExit):
            # CancelledError: the client went away while this handler awaited something;
            # GeneratorExit: while a response was being written (gRPC closes the generator)
            code, reason = cancellation(context, call.budget)
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

    def __init__(
        self,
        service: RecordingService,
        context: grpc.aio.ServicerContext,
        masks_of: Callable[[np.ndarray], np.ndarray] | None = None,
        kept_row_bytes: int = 0,
        held: list[Reservation] | None = None,
    ) -> None:
        self.service = service
        self.kept_row_bytes = kept_row_bytes
        self.held = held
        self.host = service.host
        self.context = context
        self.request_id = fresh_request_id()  # until the metadata or header give one
        remaining = self.budget = context.time_remaining()
        self.deadline = None if remaining is None else time.monotonic() + remaining
        self.decoder: RecordingDecoder | None = None
        self.step = 0
        self.exclude_overlap = False
        self.announced = 0  # header.frames (0: not said)
        self.expected: int | None = None  # windows header.frames makes, when it gives them
        self.declared: int | None = None  # masks.windows, from the first masks message
        self.windows: int | None = None  # known once the audio has ended
        self.speakers = self.mask_frames = 0
        self.received = 0  # mask rows received
        #: voiced[i]: windows among the first i mask rows that are not silent (run by the engine)
        self.voiced = [0]
        self.submitted = 0  # windows submitted to the batcher
        self.sent = 0  # windows answered
        self.pending = MaskRows()  # mask rows not submitted yet
        self.failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        devices = service.host.engine.device_count if service.host.engine is not None else 1
        self.batches: asyncio.Queue[asyncio.Task[pb.EmbedRecordingResponse] | None] = asyncio.Queue(
            batches_in_flight(devices)
        )
        self.tasks: list[asyncio.Task[pb.EmbedRecordingResponse]] = []
        self.progress = asyncio.Event()  # set by the reader when windows may have become ready
        self.ended = False  # the audio has ended and every check passed: submit the rest
        # header.segment: the server's segmentation gives the mask rows
        self.segmenting = False
        self.masks_of = masks_of or speaker_masks
        self.segmentations = MaskRows()  # [k, 589, 3] uint8 rows not submitted yet
        self.audio_ended = False
        self.audio_progress = asyncio.Event()  # set by the reader for the segmenter task
        self.segment_progress = asyncio.Event()  # set by the segmenter for a waiting reader
        self.reservation: Reservation | None = None  # the call's bytes in the recording budget

    async def run(
        self, requests: AsyncIterator[pb.EmbedRecordingRequest]
    ) -> AsyncIterator[pb.EmbedRecordingResponse]:
        reader = asyncio.ensure_future(self._guarded(self._read(requests)))
        submitter = asyncio.ensure_future(self._guarded(self._submit_windows()))
        segmenter = asyncio.ensure_future(self._guarded(self._segment_windows()))
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
            submitter.cancel()
            segmenter.cancel()
            if self.reservation is not None and self.held is not None:
                self.held.append(self.reservation)  # the caller's to release
            elif self.reservation is not None:
                self.reservation.release()
                self._report_budget()
            for task in self.tasks:
                task.cancel()  # their batcher jobs leave the queue before any engine work
                if task.done() and not task.cancelled():
                    task.exception()  # retrieved: a failure after the call ended is not logged twice
            self._close_source()

    def _close_source(self) -> None:
        """Let the call's FbankSource go: one that holds its audio in a device worker
        (serve --devices) drops it there now, not whenever it is collected."""
        close = getattr(self.decoder.source, "close", None) if self.decoder is not None else None
        if callable(close):
            close()

    @property
    def silent(self) -> int:
        """Windows received so far whose every mask is empty (answered without the engine)."""
        return self.received - self.voiced[-1]

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

    async def _guarded(self, work: Awaitable[None]) -> None:
        """Run the reader or the submitter; any failure becomes the call's Rejection."""
        try:
            await work
        except (InputError, TensorError, RequestIdError) as error:
            self._fail(_invalid(error))
        except Rejection as error:
            self._fail(error)
        except BatcherError as error:  # e.g. serve --devices: the recording's device was lost
            self._fail(batcher_rejection(error))
        except Exception as error:
            log.exception("%s %s: handling the call failed", METHOD, self.request_id)
            self._fail(Rejection(grpc.StatusCode.INTERNAL, "internal", f"server error: {error}"))

    async def _read(self, requests: AsyncIterator[pb.EmbedRecordingRequest]) -> None:
        """Every message as fast as it arrives: the upload is never paced by the engine (the
        audio becomes frames at once, so nothing waits in host memory), and the submitter
        is told after each one."""
        async for message in requests:
            part = message.WhichOneof("part")
            if part != "header" and self.decoder is None:
                raise InputError("header", f"the first message must be the header, got {part or 'nothing'}")
            if part == "header":
                await self._header(message.header)
            elif part == "audio":
                await self._audio(message.audio)
            elif part == "masks":
                await self._masks(message.masks)
            else:
                raise InputError("part", "an empty message; set header, audio or masks")
            self.progress.set()
            self.audio_progress.set()
        await self._end()
        self.audio_ended = True
        self.audio_progress.set()
        if not self.segmenting:  # else the segmenter ends the call's windows
            self.ended = True
            self.progress.set()

    async def _submit_windows(self) -> None:
        """Submit windows to the batcher as their rows and audio come in, BATCHES_IN_FLIGHT
        at a time (their answers leave in order from `run`), then the end marker."""
        while True:
            await self.progress.wait()
            self.progress.clear()
            final = self.ended
            await self._submit(final)
            if final:
                await self.batches.put(None)
                return

    async def _header(self, header: pb.RecordingHeader) -> None:
        if self.decoder is not None:
            raise InputError("header", "sent twice; one header, then audio pieces, then masks")
        if self.host.draining:
            raise Rejection(
                grpc.StatusCode.UNAVAILABLE, "draining", "the server is draining; retry elsewhere"
            )
        if self.host.engine is None or self.host.batcher is None:
            raise Rejection(grpc.StatusCode.UNAVAILABLE, "not_ready", "the engine is still warming up")
        given = metadata_request_id(self.context) or check_request_id(header.request_id, "header.request_id")
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
        if header.frames < 0:
            raise InputError("header.frames", f"{header.frames}, expected the PCM frames to send or 0")
        check_format(header.sample_rate, header.channels)  # before any device work
        self.segmenting = header.segment
        await self._admit(header)
        if self.segmenting and self.host.segmenter is None:  # built with the engine
            raise Rejection(grpc.StatusCode.UNAVAILABLE, "not_ready", "the engine is still warming up")

        def source() -> FbankSource:
            if not self.segmenting:
                return self.service.source_for(self.step)
            kept = self.service.segmenting_source_for(self.step)  # where the engine segments
            if kept is not None:
                return kept
            return SegmentingSource(self.service.source_for(self.step), self.step)

        # the source and decoder allocate device buffers: off the event loop
        self.decoder = await asyncio.get_running_loop().run_in_executor(
            self.service.pool,
            lambda: RecordingDecoder(
                header.sample_rate,
                header.channels,
                ENCODINGS[header.encoding],
                source=source(),
                step=self.step,
                max_seconds=self.service.max_seconds,
            ),
        )
        if header.frames:
            limit = self.decoder.max_frames
            if limit is not None and header.frames > limit:
                raise InputError(
                    "header.frames",
                    f"{header.frames} frames ({header.frames / header.sample_rate:.0f} s), "
                    f"the server's limit is {self.service.max_seconds:.0f} s",
                )
            self.announced = header.frames
            samples = output_length(header.frames, header.sample_rate, SAMPLE_RATE)
            self.expected = window_count(samples, self.step)
            if self.segmenting:  # no masks message will declare them
                self._declare(self.expected)

    async def _admit(self, header: pb.RecordingHeader) -> None:
        """Reserve what the call will hold (module doc), waiting for room up to its deadline."""
        seconds = header.frames / header.sample_rate if header.frames > 0 else self.service.max_seconds
        windows = window_count(math.ceil(min(seconds, self.service.max_seconds) * SAMPLE_RATE), self.step)
        if self.segmenting:  # the segmentation rows and masks as uint8, and the samples kept for them
            segmenter = self.host.segmenter
            kept = (
                CHUNK_SAMPLES
                + MAX_KEPT_WINDOW_GROUPS * (segmenter.max_windows if segmenter else 0) * self.step
            )
            row_bytes, extra = 2 * MAX_SPEAKERS * MASK_FRAMES, 4 * kept
        else:
            row_bytes, extra = ASSUMED_ROW_BYTES, 0
        self.row_bytes, self.reserved_windows = row_bytes, windows
        need = math.ceil(seconds * FRAME_BYTES_PER_S) + windows * (row_bytes + self.kept_row_bytes) + extra
        budget = self.service.budget

        def too_large() -> InputError:
            field = "header.frames" if header.frames else "header"
            said = (
                f"{header.frames} frames"
                if header.frames
                else "a recording of unknown length (no header.frames)"
            )
            return InputError(
                field,
                f"{said} need {need / 2**20:.0f} MiB, more than the server's whole recording budget "
                f"({budget.limit_bytes / 2**20:.0f} MiB): send a shorter recording"
                + ("" if header.frames else ", or set header.frames"),
            )

        self.reservation = await reserve(
            budget, need, self.deadline, too_large, "recordings", "recording", self._report_budget
        )

    def _report_budget(self, waiting: int = 0) -> None:
        metrics = self.host.metrics
        self.service.budget.report(metrics.recordings_waiting, metrics.recording_bytes_held, waiting)

    def _resize_rows(self, masks: np.ndarray) -> None:
        """The first masks message tells the rows' real size: give back what the call
        reserved too much, or hold more if it fits now (never waiting: see the budget)."""
        assert self.reservation is not None
        row_bytes = int(masks[0].nbytes) if masks.shape[0] else self.row_bytes
        delta = self.reserved_windows * (row_bytes - self.row_bytes)
        if delta < 0:
            self.reservation.shrink(-delta)
        elif delta > 0 and not self.reservation.grow(delta):
            raise Rejection(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "queue_full",
                f"masks: rows of {row_bytes} bytes need {delta / 2**20:.0f} MiB more than reserved and the "
                "server's recording budget is full; send uint8 masks, or retry with backoff",
            )
        self.row_bytes = row_bytes
        self._report_budget()

    async def _audio(self, data: bytes) -> None:
        decoder = self.decoder
        assert decoder is not None
        await asyncio.get_running_loop().run_in_executor(self.service.pool, decoder.push, data)
        if self.announced and decoder.frames_in > self.announced:
            raise InputError("audio", f"more than the {self.announced} frames header.frames announced")
        if self.declared is not None:
            self._check_audio_fits(self.declared)
        if self.segmenting:
            await self._wait_for_segmenter()

    @property
    def _layout(self) -> str:
        return f"{WINDOW_S:g} s windows every {self.step / SAMPLE_RATE:g} s"

    def _check_audio_fits(self, windows: int) -> None:
        """InputError unless the audio so far makes at most `windows` windows (its complete
        windows are windows of the final recording, whatever follows)."""
        assert self.decoder is not None
        known = self.decoder.ready()
        if known > windows:
            raise InputError(
                "masks.windows",
                f"{windows}, but the {self.decoder.seconds:.3f} s of audio received so far already "
                f"make {known} {self._layout}",
            )

    async def _masks(self, message: pb.RecordingMasks) -> None:
        if self.segmenting:
            raise InputError(
                "masks", "not with header.segment: the server segments the recording; send the audio alone"
            )
        self._declare(message.windows)
        declared = message.windows
        if not message.HasField("masks"):
            raise InputError("masks.masks", f"missing; expected [k, s, F] rows of the {declared} windows")
        masks = from_tensor(message.masks, "masks.masks")
        left = declared - self.received
        if masks.ndim != 3 or not 1 <= masks.shape[0] <= left:
            raise InputError(
                "masks.masks",
                f"shape {list(masks.shape)}, expected [k, s, F] with 1 <= k <= {left} "
                f"({self.received} of {declared} windows' rows received)",
            )
        checked = check_masks(masks, masks.shape[0], "masks.masks")
        if self.received and masks.shape[1:] != (self.speakers, self.mask_frames):
            raise InputError(
                "masks.masks",
                f"shape {list(masks.shape)}, expected [k, {self.speakers}, {self.mask_frames}] "
                "as in the first masks message",
            )
        kept = masks if masks.dtype == np.uint8 else checked  # binary uint8 rows stay uint8: a quarter
        if not self.received:
            self._resize_rows(kept)
        self.speakers, self.mask_frames = int(masks.shape[1]), int(masks.shape[2])
        await self._accept(kept)

    async def _accept(self, masks: np.ndarray) -> None:
        """The next windows' mask rows [k, s, F], checked, whoever made them."""
        # off the event loop: an hour of masks in one message takes ~0.1 s with exclude_overlap
        silent = await asyncio.get_running_loop().run_in_executor(self.service.pool, self._silent, masks)
        self.voiced += (self.voiced[-1] + np.cumsum(~silent)).tolist()
        self.received += masks.shape[0]
        self.pending.append(masks)

    async def _segment_windows(self) -> None:
        """With header.segment: segment each group of windows as soon as its audio is in
        (the last, shorter group once the audio has ended); the rows become the call's masks."""
        await self.audio_progress.wait()
        if not self.segmenting:
            return
        segmenter = self.host.segmenter
        source = self.decoder.source if self.decoder is not None else None
        assert segmenter is not None and isinstance(source, Segmentable)
        loop = asyncio.get_running_loop()
        metrics = self.host.metrics
        while True:
            self.audio_progress.clear()
            ended = self.audio_ended
            while (left := source.segmentable() - self.received) >= segmenter.max_windows or (ended and left):
                count = min(left, segmenter.max_windows)
                first, samples, starts = await loop.run_in_executor(self.service.pool, source.take, count)
                assert first == self.received, (first, self.received)
                done = await loop.run_in_executor(
                    self.service.segment_pool, segmenter.segment, samples, starts
                )
                metrics.segmentation_compute.observe(done.compute_s)
                metrics.windows_segmented.inc(count)
                masks = self.masks_of(done.multilabel)
                self.speakers, self.mask_frames = int(masks.shape[1]), int(masks.shape[2])
                self.segmentations.append(done.multilabel)
                await self._accept(masks)
                self.segment_progress.set()
                self.progress.set()
            if ended:
                self.ended = True
                self.progress.set()
                return
            await self.audio_progress.wait()

    async def _wait_for_segmenter(self) -> None:
        """Back-pressure: hold the reader while more than MAX_KEPT_WINDOW_GROUPS groups of
        windows' samples wait for the segmenter (it takes them as fast as it can)."""
        source, segmenter = self.decoder.source if self.decoder else None, self.host.segmenter
        assert isinstance(source, Segmentable) and segmenter is not None
        bound = CHUNK_SAMPLES + MAX_KEPT_WINDOW_GROUPS * segmenter.max_windows * self.step
        while source.kept_samples > bound:
            self.segment_progress.clear()
            self.audio_progress.set()
            await self.segment_progress.wait()

    def _declare(self, windows: int) -> None:
        """Check masks.windows against the first message's, header.frames' and the audio's."""
        if self.declared is not None:
            if windows != self.declared:
                raise InputError(
                    "masks.windows", f"{windows}, but the first masks message said {self.declared}"
                )
            return
        if self.expected is not None and windows != self.expected:
            raise InputError(
                "masks.windows",
                f"{windows}, but header.frames = {self.announced} make {self.expected} {self._layout}",
            )
        limit = window_count(int(self.service.max_seconds * SAMPLE_RATE), self.step)
        if not 1 <= windows <= limit:
            raise InputError(
                "masks.windows",
                f"{windows}, expected 1..{limit} ({self._layout} in the server's "
                f"{self.service.max_seconds:.0f} s limit)",
            )
        self._check_audio_fits(windows)
        self.declared = windows

    async def _end(self) -> None:
        decoder = self.decoder
        if decoder is None:
            raise InputError("header", "the call ended before its header")
        if self.announced and decoder.frames_in != self.announced:
            raise InputError(
                "audio",
                f"the call ended after {decoder.frames_in} frames, header.frames announced {self.announced}",
            )
        loop = asyncio.get_running_loop()
        windows = self.windows = await loop.run_in_executor(self.service.pool, decoder.finish)
        if self.declared is not None and self.declared != windows:
            raise InputError(
                "masks.windows",
                f"{self.declared}, but the {decoder.seconds:.3f} s of audio received make "
                f"{windows} {self._layout}",
            )
        if self.received != windows and not self.segmenting:
            raise InputError(
                "masks",
                f"the call ended after {self.received} mask rows, expected {windows} "
                f"([{windows}, s, F], one row per window)",
            )

    def _silent(self, masks: np.ndarray) -> np.ndarray:
        """Worker thread: [k] bool, the rows whose masks, as pooled, are all empty."""
        return silent_windows(exclude_overlap(masks) if self.exclude_overlap else masks)

    def _next_count(self, available: int, final: bool) -> int:
        """Windows of the next submission (0: none yet): from the first not submitted, up to
        and including the `max_batch`-th one that is not silent, at most SUBMIT_WINDOWS_FACTOR
        x `max_batch`; fewer only once that many are in or the audio has ended."""
        assert self.host.batcher is not None
        size = self.host.batcher.engine.max_batch
        first, left = self.submitted, available - self.submitted
        limit = SUBMIT_WINDOWS_FACTOR * size
        target = self.voiced[first] + size
        if left > 0 and self.voiced[available] >= target:
            return min(limit, bisect.bisect_left(self.voiced, target) - first)
        if left >= limit or (final and left > 0):
            return min(limit, left)
        return 0

    async def _submit(self, final: bool) -> None:
        """Submit every full batch of windows whose rows and audio are in (and, when
        final, the rest)."""
        assert self.host.batcher is not None and self.decoder is not None
        available = min(self.received, self.decoder.ready())
        while count := self._next_count(available, final):
            segmentation = self.segmentations.take(count) if self.segmenting else None
            task = asyncio.ensure_future(self._embed(self.submitted, self.pending.take(count), segmentation))
            self.tasks.append(task)
            self.submitted += count
            await self.batches.put(task)  # blocks while BATCHES_IN_FLIGHT are unanswered

    def _prepare(self, first: int, masks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Worker thread: the windows' fbank, the masks pooled under, and their active frames."""
        assert self.decoder is not None
        fbank = self.decoder.source.windows(first, first + masks.shape[0])
        masks = masks.astype(np.float32, copy=False)
        used = exclude_overlap(masks) if self.exclude_overlap else masks
        return fbank, pad_speakers(used), active_frames(used)

    async def _embed(
        self, first: int, masks: np.ndarray, segmentation: np.ndarray | None = None
    ) -> pb.EmbedRecordingResponse:
        engine, batcher = self.host.engine, self.host.batcher
        assert engine is not None and batcher is not None
        loop = asyncio.get_running_loop()
        fbank, padded, active = await loop.run_in_executor(self.service.pool, self._prepare, first, masks)
        try:
            result = await batcher.submit(fbank, padded, self.deadline, wait_for_room=True)
        except BatcherError as error:
            raise batcher_rejection(error, f"windows {first}..{first + masks.shape[0] - 1}: ") from error
        count = masks.shape[0]
        starts = window_starts_s(first, first + count, self.step)
        response = pb.EmbedRecordingResponse(
            embeddings=to_tensor(result.embeddings[:, : self.speakers]),
            first_window=first,
            starts=starts.tolist(),
            empty=(active == 0).ravel().tolist(),
            active_frames=active.ravel().tolist(),
            windows=self.windows or self.declared or 0,
            model_id=engine.model_id,
            precision=str(engine.math),
            request_id=self.request_id,
            plans=sorted(set(result.plans)),
            fp16_fallbacks=result.fp16_fallbacks,
        )
        if segmentation is not None:
            assert self.host.segmenter is not None
            response.segmentation.CopyFrom(to_tensor(np.ascontiguousarray(segmentation)))
            response.segmentation_model_id = self.host.segmenter.model_id
        return response


def speaker_masks(segmentation: np.ndarray) -> np.ndarray:
    """[k, 589, 3] multilabel -> [k, 3, 589] uint8: each local speaker's mask, what
    pyannote's get_embeddings pools a window's speakers under."""
    return np.ascontiguousarray(np.transpose(segmentation, (0, 2, 1)))


class MaskRows:
    """Mask rows received and not yet submitted, in order: `take` hands out the first rows
    without copying the rest (a recording's masks may all arrive before its audio)."""

    def __init__(self) -> None:
        self._parts: collections.deque[np.ndarray] = collections.deque()

    def append(self, rows: np.ndarray) -> None:
        self._parts.append(rows)

    def take(self, count: int) -> np.ndarray:
        taken: list[np.ndarray] = []
        while count:
            part = self._parts[0]
            if part.shape[0] <= count:
                taken.append(self._parts.popleft())
            else:
                taken.append(part[:count])
                self._parts[0] = part[count:]
            count -= taken[-1].shape[0]
        return taken[0] if len(taken) == 1 else np.concatenate(taken)


def metadata_request_id(context: grpc.aio.ServicerContext) -> str:
    """The x-request-id metadata ("" when absent); RequestIdError when unusable."""
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_KEY and value:
            return check_request_id(str(value), REQUEST_ID_KEY)
    return ""
