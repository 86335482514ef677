"""Dynamic batching: chunks of concurrent requests packed into engine batches.

Why: one b32 plan run costs far less than 32 b1 runs on a GPU (docs/performance.md), but a diarization
client sends a handful of chunks at a time. The batcher queues requests as chunks, and
whenever an engine worker is free it takes up to `max_batch` chunks across requests,
splitting a large request over several batches. A batch that is not full waits at most
`max_delay_s` (from its longest-queued chunk's arrival) for more chunks.

What is queued, in which order, which pieces a batch takes and which requests leave with
which error is `QueueState` (queue.py), plain data tested on its own; this module is the
plumbing around it: futures, deadline timers, the dispatcher task and the engine threads.
Every change of the state goes through this module's event-loop thread and is followed by
setting the queue-depth gauge, so the gauge is always the chunks really waiting.

PIPELINE_DEPTH workers run batches at once (`Engine.run_batch` is thread-safe): on the GPU
one batch computes while the next ones are staged and uploaded. A batch is formed only
when a worker is free, so while all are busy the queue grows and the next batch leaves
fuller. A batch reaches the engine as lists of its requests' arrays (no joined copy on the
host); the engine copies each piece into its own staging.

Silent windows are not queued at all: a window whose every speaker mask is empty (silence,
music) has the same rows whatever its audio, the model's seg_1.bias (`Engine.empty_rows`,
measured once per engine), so `submit` writes those rows itself and queues only the other
windows, which then fill the batches. A request of silent windows alone is answered at once;
speakerd_windows_skipped_total counts them. The response still says which rows are empty.

A request leaves the queue, before any engine work on its queued chunks, when its caller
cancels (the awaiting task is cancelled: `Cancelled`, the caller is gone), when its
deadline is nearer than one plan run (a timer then: DeadlinePassed; work that cannot be
answered in time is not started), or when a drain runs out of time (Draining). Workers
skip the plan runs of a batch whose requests have all left or are due before the run
could end, and fail the latter with DeadlinePassed. One plan run's time is the smallest
plan's, measured at start-up and then followed (EWMA) as runs complete.

Drain (`drain(timeout_s)`): no new requests (Draining), queued and running work gets up to
`timeout_s`; then everything still queued fails with Draining and the drain waits only for
the batches already handed to the engine threads (at most PIPELINE_DEPTH batches of at
most max_batch chunks each; their plan runs serving only failed requests are skipped). It
never blocks the event loop, and the engine threads are daemons that the process does not
join at exit, so a caller may bound that last wait too (asyncio.wait_for) and leave.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

import numpy as np

from speakerd.engine.base import BatchRun, Engine, device_of, plan_for
from speakerd.model.architecture import EMBEDDING_DIM, MAX_SPEAKERS
from speakerd.model.numerics import active_frames, resize_masks
from speakerd.serving.batching.queue import (
    LATE_MESSAGE,
    Batch,
    BatcherError,
    Cancelled,
    DeadlinePassed,
    Draining,
    EngineFailed,
    NoDevice,
    QueueFull,
    QueueState,
    Removal,
)
from speakerd.serving.batching.workers import EngineThreads
from speakerd.serving.observability.metrics import Metrics

__all__ = [
    "PIPELINE_DEPTH",
    "Batcher",
    "BatcherError",
    "Cancelled",
    "DeadlinePassed",
    "DrainReport",
    "Draining",
    "EngineFailed",
    "JobResult",
    "NoDevice",
    "QueueFull",
    "cheapest_pieces",
    "plan_for",
    "silent_windows",
]

log = logging.getLogger(__name__)

#: Batches in flight at once: one computing while two are assembled and uploaded. Two
#: were not enough on the H200: assembling and staging a b32 batch (~8 ms of host work
#: under load) outlasts its ~7 ms TF32 compute, so the GPU waited between batches.
PIPELINE_DEPTH = 3
#: Weight of the latest run in a plan's running time estimate (EWMA): a few runs follow a
#: change of load, one slow run does not double the estimate.
RUN_TIME_WEIGHT = 0.2


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


def silent_windows(masks: np.ndarray) -> np.ndarray:
    """masks [n, s, F] -> [n] bool: the windows whose every speaker mask has no weight on the
    trunk's 125 frames after pyannote's nearest resize (each row's `active_frames` is 0), the
    very weights an engine pools under. Their rows are the engine's `empty_rows` whatever
    their audio, so they need no engine work."""
    return ~active_frames(masks).any(axis=1)


@dataclass
class JobResult:
    """A request's embeddings [n, 3, 256] with the plans and fallbacks that produced them."""

    embeddings: np.ndarray
    plans: list[str]
    fp16_fallbacks: int
    queue_wait_s: float


@dataclass(frozen=True)
class DrainReport:
    """How a drain ended, for the caller's log line."""

    #: everything queued and running finished within the timeout
    finished: bool
    #: requests and chunks still queued at the timeout, failed with Draining
    failed_requests: int
    failed_chunks: int
    #: batches on the engine threads at the timeout, waited for (0 when finished)
    running_batches: int
    seconds: float


@dataclass(eq=False)  # identity: a request holds arrays, never compare two
class _Request:
    """The arrays and the caller's future of one queued job (its chunk bookkeeping is the
    QueueState's, which counts only the windows the engine runs). Workers write their rows
    of `out` and read `abandoned`; the rest is touched on the event loop only."""

    fbank: np.ndarray  # [n, 998, 80] float32
    masks: np.ndarray  # [n, 3, F] float32
    future: asyncio.Future[JobResult]
    #: the rows the engine runs, ascending (the windows not silent); None: every row
    voiced: np.ndarray | None = None
    out: np.ndarray = field(init=False)
    done: int = 0
    plans: list[str] = field(default_factory=list)
    fp16_fallbacks: int = 0
    queue_wait_s: float = 0.0
    deadline: float | None = None  # time.monotonic() seconds
    timer: asyncio.TimerHandle | None = None
    #: the caller will not read a result (cancelled or failed): its pending runs are skipped
    abandoned: bool = False
    #: an engine thread skipped a run of it: its deadline would pass before the run ended
    late: bool = False

    def __post_init__(self) -> None:
        self.out = np.empty((self.fbank.shape[0], MAX_SPEAKERS, EMBEDDING_DIM), dtype=np.float32)

    @property
    def chunks(self) -> int:
        """Chunks the engine runs (the job's chunks in the queue)."""
        return int(self.fbank.shape[0]) if self.voiced is None else int(self.voiced.size)

    def spans(self, low: int, high: int) -> list[tuple[int, int]]:
        """The job's chunks [low, high) as runs [start, stop) of consecutive rows of fbank,
        masks and out: one piece each for the engine, so no row is copied on the host."""
        if self.voiced is None:
            return [(low, high)]
        rows = self.voiced[low:high]
        breaks = (np.flatnonzero(np.diff(rows) != 1) + 1).tolist()
        firsts, ends = [0, *breaks], [*breaks, rows.size]
        return [(int(rows[a]), int(rows[b - 1]) + 1) for a, b in zip(firsts, ends, strict=True)]


@dataclass
class _Outcome:
    """A batch's plan runs: (plan size, chunks run, run) each; `skipped` chunks belonged
    only to requests that had left and were not run."""

    runs: list[tuple[int, int, BatchRun]]
    skipped: int


class Batcher:
    """Queues requests as chunks and feeds the engine batches of up to its largest plan."""

    def __init__(self, engine: Engine, metrics: Metrics, max_delay_s: float, queue_chunks: int) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_delay_s = max_delay_s
        self.queue_chunks = queue_chunks
        self._state = QueueState(queue_chunks, engine.max_batch)  # ValueError: no room for a batch
        self._times = engine.plan_times_ms()
        #: seconds one run of each plan takes (start-up measurement, then an EWMA of runs)
        self._run_s = {size: ms / 1e3 for size, ms in self._times.items()}
        self._requests: dict[int, _Request] = {}
        self._wakeup = asyncio.Event()
        #: set (and replaced) at every change of the queue: `submit(wait_for_room=True)`
        #: callers waiting for chunks to leave retry then, in the order they began waiting
        self._room = asyncio.Event()
        #: batches in flight: PIPELINE_DEPTH on each device behind the engine
        self._depth = PIPELINE_DEPTH * engine.device_count
        self._slots = asyncio.Semaphore(self._depth)
        self._threads: EngineThreads | None = None
        self._running: set[asyncio.Task[None]] = set()
        self._dispatcher: asyncio.Task[None] | None = None
        self._stopped = False  # a drain ran out of time: no batch is formed any more
        #: how the drain went, once its time is up (before it waits for running batches)
        self.drain_report: DrainReport | None = None

    @property
    def queued_chunks(self) -> int:
        """Chunks of live requests waiting for a batch."""
        return self._state.queued_chunks

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._threads = EngineThreads(self._depth, loop)
        self._dispatcher = loop.create_task(self._dispatch(), name="batcher")

    async def submit(
        self,
        fbank: np.ndarray,
        masks: np.ndarray,
        deadline: float | None = None,
        wait_for_room: bool = False,
    ) -> JobResult:
        """Embed fbank [n, 998, 80] f32 with masks [n, 3, F] f32 (validated, speakers padded).

        `deadline`: time.monotonic() seconds. Raises QueueFull, DeadlinePassed, Draining or
        EngineFailed. A full queue is QueueFull at once (a client's EmbedChunks: its caller
        retries with backoff), or with `wait_for_room` a wait until the chunks fit or the
        deadline passes: a recording's windows, whose call was admitted by the recording
        budget and holds its frames, wait their turn instead of failing an hour's work
        because other recordings fill the queue for a moment. Cancelling the awaiting task
        takes the request's chunks that have not reached the engine out of the queue at once.
        Silent windows (`silent_windows`) are not queued: their rows are the engine's
        `empty_rows`, written here.
        """
        loop = asyncio.get_running_loop()
        silent = silent_windows(masks)
        skipped = int(np.count_nonzero(silent))
        voiced = np.flatnonzero(~silent) if skipped else None
        request = _Request(fbank, masks, loop.create_future(), voiced, deadline=deadline)
        if skipped:
            self._state.check_open(time.monotonic(), deadline)  # refused as if queued
            request.out[silent] = await self._silent_rows()
        if not request.chunks:  # every window silent: no engine work at all
            self.metrics.windows_skipped.inc(skipped)
            return JobResult(request.out, [], 0, 0.0)
        now = time.monotonic()
        lead = self._lead_s()
        if deadline is not None and now < deadline <= now + lead:
            raise DeadlinePassed(
                f"deadline {deadline - now:.3f} s away on arrival, less than one plan run ({lead:.3f} s): "
                "it could not be answered in time"
            )
        device = device_of(fbank)  # a recording's windows on one device of serve --devices
        job = await self._admit(request.chunks, int(masks.shape[-1]), deadline, wait_for_room, device)
        self.metrics.windows_skipped.inc(skipped)
        self._requests[job] = request
        request.future.add_done_callback(lambda _: self._forget(job))
        if deadline is not None:
            request.timer = loop.call_later(max(0.0, deadline - lead - now), self._expire)
        self._changed()
        try:
            return await asyncio.shield(request.future)
        except asyncio.CancelledError:
            self._apply([self._state.cancel(job)])
            request.future.cancel()
            raise

    async def _admit(
        self, chunks: int, frames: int, deadline: float | None, wait_for_room: bool, device: int | None
    ) -> int:
        """The queue's `admit` (bound to `device` when the rows lie there), retried after each
        change of the queue while it is full and `wait_for_room`; DeadlinePassed once the
        deadline is nearer than one plan run."""
        while True:
            now = time.monotonic()
            try:
                return self._state.admit(chunks, frames, now, deadline, device)
            except QueueFull:
                if not wait_for_room:
                    raise
            room = self._room
            left = None if deadline is None else deadline - self._lead_s() - now
            if left is not None and left <= 0:
                raise DeadlinePassed(f"{LATE_MESSAGE} (the queue stayed full)")
            try:
                await asyncio.wait_for(room.wait(), left)
            except TimeoutError:
                raise DeadlinePassed(f"{LATE_MESSAGE} (the queue stayed full)") from None

    async def _silent_rows(self) -> np.ndarray:
        """The engine's `empty_rows`: cached by the engine (the server measures them at
        start-up); measured on an engine thread if not yet, never on the event loop."""
        rows = self.engine.known_empty_rows
        if rows is None:
            assert self._threads is not None, "start() first"
            rows = await self._threads.run(self.engine.empty_rows)
        return rows

    # --- state changes (event loop only; each publishes the queue depth) ---------------

    def _changed(self) -> None:
        self.metrics.queue_depth.set(self._state.queued_chunks)
        self._wakeup.set()
        self._room.set()
        self._room = asyncio.Event()

    def _apply(self, removals: list[Removal | None]) -> None:
        """Tell the callers of removed jobs (their futures) and publish the new depth."""
        for removal in removals:
            if removal is None:
                continue
            request = self._requests.get(removal.job)
            if request is not None and not request.future.done():
                if isinstance(removal.error, Cancelled):
                    request.future.cancel()
                else:
                    request.future.set_exception(removal.error)
        self._changed()

    def _lead_s(self) -> float:
        """The shortest plan run: a job due sooner cannot be answered in time."""
        return min(self._run_s.values(), default=0.0)

    def _expire(self) -> None:
        """A job's timer fired (one plan run before its deadline): remove every queued job
        due within one plan run (timers may fire a clock tick early: a job left here is
        taken out when the next batch is formed, or by its caller's deadline)."""
        self._apply(list(self._state.expire(time.monotonic(), self._lead_s())))

    def _forget(self, job: int) -> None:
        """The job's future is done: drop its arrays; runs still pending for it are skipped."""
        request = self._requests.pop(job)
        if request.timer is not None:
            request.timer.cancel()
        request.abandoned = request.future.cancelled() or request.future.exception() is not None
        assert job not in self._state, f"job {job} answered while {self._state.waiting(job)} chunks queued"

    def _fail(self, job: int, error: BatcherError) -> None:
        """Fail a job that has chunks on the engine: its queued rest leaves the queue too."""
        request = self._requests.get(job)
        if request is not None and not request.future.done():
            request.future.set_exception(error)
        self._apply([self._state.remove(job, error)])

    # --- dispatch ----------------------------------------------------------------------

    async def _dispatch(self) -> None:
        while True:
            await self._slots.acquire()
            batch = await self._next_batch()
            if batch is None:
                self._slots.release()
                return
            # looked up in the step that took the batch: every job in it is live right now
            requests = {job: self._requests[job] for job in batch.jobs}
            task = asyncio.get_running_loop().create_task(self._run(batch, requests))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _next_batch(self) -> Batch | None:
        """The next batch once one is due; None when draining with nothing left, or stopped."""
        while not self._stopped:
            self._wakeup.clear()
            now = time.monotonic()
            due = self._state.due_in(now, self.max_delay_s)
            if due is None:
                if self._state.closed:
                    return None
                await self._wakeup.wait()
                continue
            if due > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wakeup.wait(), due)
                continue
            batch, removals = self._state.next_batch(now, self._lead_s())
            self._apply(list(removals))
            if batch is not None:
                return batch
        return None

    async def _run(self, batch: Batch, requests: dict[int, _Request]) -> None:
        try:
            for job, waited in batch.started:
                requests[job].queue_wait_s = waited
                self.metrics.queue_wait.observe(waited)
            assert self._threads is not None, "start() first"
            try:
                outcome = await self._threads.run(lambda: self._compute(batch, requests))
            except BatcherError as error:  # the engine says what the callers get (NoDevice)
                log.error("batch of %d chunks not run: %s", batch.chunks, error)
                for job in batch.jobs:
                    self._fail(job, error)
                return
            except Exception as error:
                log.exception("engine failed on a batch of %d chunks", batch.chunks)
                for job in batch.jobs:
                    self._fail(job, EngineFailed(f"engine error: {error}"))
                return
            self._record(batch, outcome)
            for job in batch.jobs:
                if requests[job].late and not requests[job].future.done():
                    self._fail(job, DeadlinePassed("deadline would pass before its chunks' plan run ended"))
            plans = [plan for _, _, run in outcome.runs for plan in run.plans]
            fallbacks = sum(run.fp16_fallbacks for _, _, run in outcome.runs)
            for piece in batch.pieces:
                request = requests[piece.job]
                if request.future.done():  # cancelled or failed while this batch ran
                    continue
                request.done += piece.chunks
                request.plans += plans
                request.fp16_fallbacks += fallbacks
                if request.done == request.chunks:
                    request.future.set_result(
                        JobResult(request.out, request.plans, request.fp16_fallbacks, request.queue_wait_s)
                    )
        finally:
            self._slots.release()
            self._wakeup.set()

    def _compute(self, batch: Batch, requests: dict[int, _Request]) -> _Outcome:
        """Engine thread: run the batch as its cheapest sequence of plan runs, each given its
        requests' rows as pieces, and write each run's rows into their requests' outputs
        (rows of one piece belong to one request only: no two threads write the same rows)."""
        sizes = self.engine.plan_sizes
        runs, skipped, start = [], 0, 0
        for count in cheapest_pieces(batch.chunks, sizes, self._times):
            parts = batch.rows(start, start + count)
            start += count
            ends = time.monotonic() + self._run_s.get(plan_for(count, sizes), 0.0)
            due = [requests[job] for job, _, _ in parts]
            if all(r.abandoned or (r.deadline is not None and r.deadline <= ends) for r in due):
                for request in due:
                    request.late = not request.abandoned  # failed by _run, on the event loop
                skipped += count
                continue
            spans = [
                (requests[job], *span) for job, low, high in parts for span in requests[job].spans(low, high)
            ]
            fbank = [request.fbank[a:b] for request, a, b in spans]
            masks = [request.masks[a:b] for request, a, b in spans]
            if batch.resize:
                masks = [resize_masks(piece, batch.frames) for piece in masks]
            run = self.engine.run_batch(fbank, masks)
            row = 0
            for request, a, b in spans:
                request.out[a:b] = run.embeddings[row : row + b - a]
                row += b - a
            runs.append((plan_for(count, sizes), count, run))
        return _Outcome(runs, skipped)

    def _record(self, batch: Batch, outcome: _Outcome) -> None:
        if outcome.skipped:
            log.debug("%d of %d chunks not run: their requests had left", outcome.skipped, batch.chunks)
        chunks = sum(count for _, count, _ in outcome.runs)
        if not chunks:
            return
        for size, _, run in outcome.runs:
            estimate = self._run_s.get(size, run.compute_s)
            self._run_s[size] = estimate + RUN_TIME_WEIGHT * (run.compute_s - estimate)
        m = self.metrics
        m.batch_size.observe(chunks)
        m.batch_fill.observe(chunks / sum(size for size, _, _ in outcome.runs))
        m.batch_requests.observe(len(batch.jobs))
        m.chunks_embedded.inc(chunks)
        for size, _, run in outcome.runs:
            m.batch_compute.labels(plan=f"b{size}").observe(run.compute_s)
            m.host_to_device.observe(run.h2d_s)
            m.device_to_host.observe(run.d2h_s)
            if run.gap_s is not None:
                m.device_gap.observe(run.gap_s)
            if run.graph_replays:
                m.plan_runs.labels(plan=f"b{size}", mode="graph").inc(run.graph_replays)
            if run.eager_runs or not run.graph_replays:
                m.plan_runs.labels(plan=f"b{size}", mode="eager").inc(max(run.eager_runs, 1))
            if run.fp16_fallbacks:
                m.fp16_fallbacks.inc(run.fp16_fallbacks)

    # --- shutdown ----------------------------------------------------------------------

    async def drain(self, timeout_s: float | None = None) -> DrainReport:
        """Take no new requests; give queued and running work up to `timeout_s` (None: no
        limit); then fail what is still queued with Draining and wait only for the batches
        already on the engine threads (module docstring: the bound). Cancelling the drain
        does the failing at once and leaves those batches unawaited. A second call finds
        nothing queued."""
        started = time.monotonic()
        self._state.close()
        self._changed()
        settled = asyncio.ensure_future(self._settled())
        failed: list[Removal] = []
        why = "the drain was cancelled"
        try:
            done, _ = await asyncio.wait({settled}, timeout=timeout_s)
            finished = bool(done) or (not len(self._state) and not self._running)
            why = "all work finished" if finished else f"the drain's {timeout_s:.1f} s passed"
            failed = self._stop(why)
            running = len(self._running)
            chunks = sum(removal.chunks for removal in failed)
            # known now, before the wait for running batches, which a caller may cut short
            self.drain_report = DrainReport(
                finished, len(failed), chunks, running, time.monotonic() - started
            )
            if self._running:
                await asyncio.gather(*list(self._running), return_exceptions=True)
        finally:  # also when cancelled: nothing stays queued, no thread is waited for
            if not settled.done():
                settled.cancel()
            if not self._stopped:
                self._stop(why)
            if self._threads is not None:
                self._threads.stop()
        chunks = sum(removal.chunks for removal in failed)
        seconds = time.monotonic() - started
        return DrainReport(finished, len(failed), chunks, running, seconds)

    def _stop(self, why: str) -> list[Removal]:
        """Form no more batches and fail every queued request with Draining."""
        self._stopped = True
        if self._dispatcher is not None:
            self._dispatcher.cancel()
        failed = self._state.fail_all("the server stopped before this request reached the engine")
        self._apply(list(failed))
        if failed or self._running:  # the server's drain line says it to the operator
            log.debug(
                "drain: %s; %d queued requests (%d chunks) failed with UNAVAILABLE, %d batches "
                "already on the engine", why, len(failed), sum(r.chunks for r in failed), len(self._running),
            )  # fmt: skip
        return failed

    async def close(self, timeout_s: float | None = None) -> None:
        """`drain(timeout_s)`, for callers that need no report."""
        await self.drain(timeout_s)

    async def _settled(self) -> None:
        """Until nothing is queued or running (the dispatcher ends once closed and empty;
        without one, started never, queued work could not run: wait for the timeout)."""
        if self._dispatcher is None:
            if len(self._state):
                await asyncio.Event().wait()
        else:
            await asyncio.shield(self._dispatcher)
        while self._running:
            await asyncio.gather(*list(self._running), return_exceptions=True)
