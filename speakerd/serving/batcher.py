"""Dynamic batching: chunks of concurrent requests packed into engine batches.

Why: one b32 plan run costs far less than 32 b1 runs on a GPU (SPEC 4), but a diarization
client sends a handful of chunks at a time. The batcher queues requests as chunks, and
whenever an engine worker is free it takes up to `max_batch` chunks in arrival order,
across requests, splitting a large request over several batches. A batch that is not full
waits at most `max_delay_s` (from its oldest chunk's arrival) for more chunks.

PIPELINE_DEPTH workers run batches at once (`Engine.run_batch` is thread-safe): on the GPU
one batch computes while the next ones are assembled, staged and uploaded. A batch is
formed only when a worker is free, so while all are busy the queue grows and the next
batch leaves fuller.

All queue state lives on the event loop thread; workers only read the requests' arrays
(never changed once queued) to assemble their batch, so no lock is needed. Requests whose
deadline has passed or whose caller has gone are dropped when a batch is formed, before
any engine work on them.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from speakerd.engine.base import BatchRun, Engine, plan_for
from speakerd.model.architecture import EMBEDDING_DIM, MAX_SPEAKERS, TRUNK_FRAMES
from speakerd.model.numerics import resize_masks
from speakerd.serving.metrics import Metrics

log = logging.getLogger(__name__)

#: Batches in flight at once: one computing while two are assembled and uploaded. Two
#: were not enough on the H200: assembling and staging a b32 batch (~8 ms of host work
#: under load) outlasts its ~7 ms TF32 compute, so the GPU waited between batches.
PIPELINE_DEPTH = 3


class BatcherError(Exception):
    """A request the batcher could not serve; subclasses map to one gRPC code each."""


class QueueFull(BatcherError):
    """The queue holds too many chunks to take this request now (RESOURCE_EXHAUSTED)."""


class DeadlinePassed(BatcherError):
    """The request's deadline passed before its chunks reached the engine (DEADLINE_EXCEEDED)."""


class Draining(BatcherError):
    """The server is shutting down and takes no new work (UNAVAILABLE)."""


class EngineFailed(BatcherError):
    """The engine raised while running a batch holding this request's chunks (INTERNAL)."""


def cheapest_pieces(chunks: int, plan_sizes: tuple[int, ...], times_ms: dict[int, float]) -> list[int]:
    """Split `chunks` (<= the largest plan) into the pieces whose plan runs cost least.

    With plans (1, 32), 3 chunks cost either 3 b1 runs or one b32 run padded with 29 zeros;
    which is cheaper depends on the device, so the measured plan times decide. Exact over
    all splits by dynamic programming (at most max_batch x plans steps). Without measured
    times the whole batch is one piece on the smallest plan that holds it.
    """
    if chunks < 1:
        return []
    if any(size not in times_ms for size in plan_sizes):
        return [chunks]
    cost = [0.0] + [float("inf")] * chunks
    choice = [0] * (chunks + 1)
    for k in range(1, chunks + 1):
        for size in plan_sizes:
            take = min(size, k)
            candidate = times_ms[plan_for(take, plan_sizes)] + cost[k - take]
            if candidate < cost[k] - 1e-12:
                cost[k], choice[k] = candidate, take
    pieces, k = [], chunks
    while k > 0:
        pieces.append(choice[k])
        k -= choice[k]
    return sorted(pieces, reverse=True)


@dataclass
class JobResult:
    """A request's embeddings [n, 3, 256] with the plans and fallbacks that produced them."""

    embeddings: np.ndarray
    plans: list[str]
    fp16_fallbacks: int
    queue_wait_s: float


@dataclass
class _Job:
    """One request in the queue: chunks [taken, n) still wait for a batch."""

    fbank: np.ndarray  # [n, 998, 80] float32
    masks: np.ndarray  # [n, 3, F] float32
    deadline: float | None  # time.monotonic() seconds
    future: asyncio.Future[JobResult]
    enqueued: float
    out: np.ndarray = field(init=False)
    taken: int = 0
    done: int = 0
    plans: list[str] = field(default_factory=list)
    fp16_fallbacks: int = 0
    queue_wait_s: float = 0.0

    def __post_init__(self) -> None:
        self.out = np.empty((self.chunks, MAX_SPEAKERS, EMBEDDING_DIM), dtype=np.float32)

    @property
    def chunks(self) -> int:
        return int(self.fbank.shape[0])

    @property
    def waiting(self) -> int:
        return self.chunks - self.taken

    @property
    def finished(self) -> bool:
        return self.future.done()


@dataclass(frozen=True)
class _Piece:
    """Chunks [start, stop) of a job, at `offset` in the batch."""

    job: _Job
    start: int
    stop: int
    offset: int


@dataclass
class _BatchOutcome:
    embeddings: np.ndarray  # [n, 3, 256]
    runs: list[tuple[int, BatchRun]]  # (plan size, run) per plan run


class Batcher:
    """Queues requests as chunks and feeds the engine batches of up to its largest plan."""

    def __init__(self, engine: Engine, metrics: Metrics, max_delay_s: float, queue_chunks: int) -> None:
        if queue_chunks < engine.max_batch:
            raise ValueError(f"queue of {queue_chunks} chunks cannot hold one batch of {engine.max_batch}")
        self.engine = engine
        self.metrics = metrics
        self.max_delay_s = max_delay_s
        self.queue_chunks = queue_chunks
        self._times = engine.plan_times_ms()
        self._queue: collections.deque[_Job] = collections.deque()
        self._queued_chunks = 0
        self._wakeup = asyncio.Event()
        self._slots = asyncio.Semaphore(PIPELINE_DEPTH)
        self._executor = ThreadPoolExecutor(PIPELINE_DEPTH, thread_name_prefix="engine")
        self._running: set[asyncio.Task[None]] = set()
        self._closing = False
        self._dispatcher: asyncio.Task[None] | None = None

    @property
    def queued_chunks(self) -> int:
        return self._queued_chunks

    def start(self) -> None:
        self._dispatcher = asyncio.get_running_loop().create_task(self._dispatch(), name="batcher")

    async def submit(self, fbank: np.ndarray, masks: np.ndarray, deadline: float | None = None) -> JobResult:
        """Embed fbank [n, 998, 80] f32 with masks [n, 3, F] f32 (validated, speakers padded).

        Raises QueueFull, DeadlinePassed, Draining or EngineFailed. Cancelling the awaiting
        task drops the request's chunks that have not reached the engine yet.
        """
        if self._closing:
            raise Draining("the server is draining and takes no new requests")
        chunks = int(fbank.shape[0])
        if self._queued_chunks + chunks > self.queue_chunks:
            raise QueueFull(
                f"queue holds {self._queued_chunks} of {self.queue_chunks} chunks; "
                f"{chunks} more do not fit, retry with backoff"
            )
        now = time.monotonic()
        if deadline is not None and deadline <= now:
            raise DeadlinePassed("deadline passed before the request was queued")
        job = _Job(fbank, masks, deadline, asyncio.get_running_loop().create_future(), now)
        self._queue.append(job)
        self._set_queued(self._queued_chunks + chunks)
        self._wakeup.set()
        try:
            return await asyncio.shield(job.future)
        except asyncio.CancelledError:
            self._drop(job)
            raise

    def _set_queued(self, chunks: int) -> None:
        self._queued_chunks = chunks
        self.metrics.queue_depth.set(chunks)

    def _drop(self, job: _Job) -> None:
        """Forget a job whose caller went away: its waiting chunks leave the queue now."""
        if not job.finished:
            job.future.cancel()
        if job in self._queue:
            self._queue.remove(job)
            self._set_queued(self._queued_chunks - job.waiting)
            job.taken = job.chunks

    def _fail(self, job: _Job, error: BatcherError) -> None:
        if not job.finished:
            job.future.set_exception(error)
        self._drop(job)

    async def _wait_for_work(self) -> bool:
        """Block until something is queued; False when closing with nothing left to do."""
        while not self._queue:
            if self._closing:
                return False
            self._wakeup.clear()
            await self._wakeup.wait()
        return True

    async def _wait_for_fill(self) -> None:
        """Hold a partial batch until it fills or its oldest chunk has waited max_delay_s."""
        while self._queue and self._queued_chunks < self.engine.max_batch and not self._closing:
            remaining = self._queue[0].enqueued + self.max_delay_s - time.monotonic()
            if remaining <= 0:
                return
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), remaining)
            except TimeoutError:
                return

    async def _dispatch(self) -> None:
        while await self._wait_for_work():
            await self._slots.acquire()
            await self._wait_for_fill()
            pieces = self._take()
            if not pieces:
                self._slots.release()
                continue
            task = asyncio.get_running_loop().create_task(self._run(pieces))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    def _take(self) -> list[_Piece]:
        """Up to max_batch waiting chunks in arrival order; expired or abandoned jobs are dropped."""
        pieces: list[_Piece] = []
        room, now = self.engine.max_batch, time.monotonic()
        while self._queue and room > 0:
            job = self._queue[0]
            if job.finished:  # cancelled by its caller
                self._drop(job)
                continue
            if job.deadline is not None and job.deadline <= now:
                waited = now - job.enqueued
                self._fail(job, DeadlinePassed(f"deadline passed after {waited:.3f} s in the queue"))
                continue
            if job.taken == 0:
                job.queue_wait_s = now - job.enqueued
                self.metrics.queue_wait.observe(job.queue_wait_s)
            count = min(room, job.waiting)
            offset = self.engine.max_batch - room
            pieces.append(_Piece(job, job.taken, job.taken + count, offset))
            job.taken += count
            room -= count
            self._set_queued(self._queued_chunks - count)
            if job.waiting == 0:
                self._queue.popleft()
        return pieces

    async def _run(self, pieces: list[_Piece]) -> None:
        try:
            chunks = sum(piece.stop - piece.start for piece in pieces)
            loop = asyncio.get_running_loop()
            try:
                outcome = await loop.run_in_executor(self._executor, self._compute, pieces)
            except Exception as error:
                log.exception("engine failed on a batch of %d chunks", chunks)
                for piece in pieces:
                    self._fail(piece.job, EngineFailed(f"engine error: {error}"))
                return
            self._record(chunks, outcome)
            self.metrics.batch_requests.observe(len({id(piece.job) for piece in pieces}))
            self._scatter(pieces, outcome)
        finally:
            self._slots.release()
            self._wakeup.set()

    def _compute(self, pieces: list[_Piece]) -> _BatchOutcome:
        """Worker thread: assemble the batch (a 10 MB copy for b32: kept off the event loop)
        and run it as its cheapest sequence of plan runs."""
        fbank, masks = _assemble(pieces)
        sizes = self.engine.plan_sizes
        out = np.empty((fbank.shape[0], MAX_SPEAKERS, EMBEDDING_DIM), dtype=np.float32)
        runs, start = [], 0
        for count in cheapest_pieces(fbank.shape[0], sizes, self._times):
            run = self.engine.run_batch(fbank[start : start + count], masks[start : start + count])
            out[start : start + count] = run.embeddings
            runs.append((plan_for(count, sizes), run))
            start += count
        return _BatchOutcome(out, runs)

    def _record(self, chunks: int, outcome: _BatchOutcome) -> None:
        m = self.metrics
        m.batch_size.observe(chunks)
        m.batch_fill.observe(chunks / sum(size for size, _ in outcome.runs))
        m.chunks_embedded.inc(chunks)
        for size, run in outcome.runs:
            m.batch_compute.labels(plan=f"b{size}").observe(run.compute_s)
            m.host_to_device.observe(run.h2d_s)
            m.device_to_host.observe(run.d2h_s)
            if run.graph_replays:
                m.plan_runs.labels(plan=f"b{size}", mode="graph").inc(run.graph_replays)
            if run.eager_runs or not run.graph_replays:
                m.plan_runs.labels(plan=f"b{size}", mode="eager").inc(max(run.eager_runs, 1))
            if run.fp16_fallbacks:
                m.fp16_fallbacks.inc(run.fp16_fallbacks)

    def _scatter(self, pieces: list[_Piece], outcome: _BatchOutcome) -> None:
        plans = [plan for _, run in outcome.runs for plan in run.plans]
        fallbacks = sum(run.fp16_fallbacks for _, run in outcome.runs)
        for piece in pieces:
            job = piece.job
            if job.finished:  # cancelled or failed while this batch ran: its rows are dropped
                continue
            count = piece.stop - piece.start
            job.out[piece.start : piece.stop] = outcome.embeddings[piece.offset : piece.offset + count]
            job.done += count
            job.plans += plans
            job.fp16_fallbacks += fallbacks
            if job.done == job.chunks:
                job.future.set_result(JobResult(job.out, job.plans, job.fp16_fallbacks, job.queue_wait_s))

    async def close(self, timeout_s: float | None = None) -> None:
        """Take no new requests, finish the queued and running ones, then stop the workers."""
        self._closing = True
        self._wakeup.set()
        if self._dispatcher is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._dispatcher), timeout_s)
            except TimeoutError:
                log.warning("drain timed out with %d chunks queued; failing them", self._queued_chunks)
                self._dispatcher.cancel()
                for job in list(self._queue):
                    self._fail(job, Draining("the server stopped before this request reached the engine"))
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)
        self._executor.shutdown(wait=True)


def _assemble(pieces: list[_Piece]) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate the pieces' chunks; masks of different F are resized to the 125 trunk frames.

    The nearest resize of 125 frames onto 125 is the identity, so resizing on the host gives
    the same weights the engine would compute from each request's own F: a chunk's embedding
    does not depend on its neighbours.
    """
    fbank = np.concatenate([p.job.fbank[p.start : p.stop] for p in pieces], axis=0)
    frames = {p.job.masks.shape[-1] for p in pieces}
    masks = [p.job.masks[p.start : p.stop] for p in pieces]
    if len(frames) > 1:
        masks = [resize_masks(m, TRUNK_FRAMES) for m in masks]
    return fbank, np.concatenate(masks, axis=0)
