"""The batch queue's state as plain data: which requests wait, in what order, how many of
their chunks are counted, which pieces the next batch takes, and which requests leave the
queue early with which error.

Why a separate module: the batcher (batcher.py) mixes this bookkeeping with futures,
timers and engine threads, and a bookkeeping mistake there (a job left counted after its
caller went away) wedged the service with a full queue of nothing. Here the state is
synchronous and free of arrays, clocks and event loops: every method takes `now` and
returns what changed, so tests drive it step by step with no engine and no loop.

A job is known by the integer id `admit` gives it, never by comparing jobs: removal is by
identity whatever the job's position in the queue.

Order and fairness. Jobs are served in arrival order, each taking as many of its waiting
chunks as the batch has room for. A job that a batch splits (more chunks waiting than the
room left) goes to the back of the queue with the rest of its chunks, behind every job
waiting at that moment. So one large request cannot hold back smaller ones that arrived
after it started: a job that has J jobs ahead of it in the queue enters one of the next
J + 1 batches formed (each job ahead gets at most one turn before it, and every batch
formed without it is full and holds at least one of those turns).

Device affinity (`serve --devices`). A job whose rows already lie on one device (a
recording's windows, computed on the GPU its audio went to) is bound to that device, and a
batch holds jobs of at most one device: the first bound job a batch takes binds it, and
later jobs bound elsewhere are passed over, keeping their place at the front of the queue
for the next batch. Unbound jobs go with any batch. With every job unbound (one engine)
nothing changes; a bound job has at most J + 1 batches of its own device ahead of it.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import ClassVar

from speakerd.model.architecture import TRUNK_FRAMES


class BatcherError(Exception):
    """A request the batcher could not serve; each subclass maps to one gRPC code and to the
    `reason` label of speakerd_requests_rejected_total."""

    reason: ClassVar[str] = "internal"


class QueueFull(BatcherError):
    """The queue holds too many chunks to take this request now (RESOURCE_EXHAUSTED)."""

    reason = "queue_full"


class DeadlinePassed(BatcherError):
    """The request's deadline passed before its chunks reached the engine (DEADLINE_EXCEEDED)."""

    reason = "deadline_exceeded"


class Draining(BatcherError):
    """The server is shutting down and takes no new work (UNAVAILABLE)."""

    reason = "draining"


class EngineFailed(BatcherError):
    """The engine raised while running a batch holding this request's chunks (INTERNAL)."""

    reason = "internal"


class NoDevice(BatcherError):
    """Every device of `serve --devices` failed and was taken out (UNAVAILABLE: another
    replica can serve it; this one reports NOT_SERVING)."""

    reason = "no_device"


class Cancelled(BatcherError):
    """The caller went away; its queued chunks leave the queue (CANCELLED, nobody to tell)."""

    reason = "cancelled"


#: The refusals `admit` and `check_open` share: a request is told the same whether or not
#: it needed the engine.
DRAINING_MESSAGE = "the server is draining and takes no new requests"
LATE_MESSAGE = "deadline passed before the request was queued"


@dataclass(eq=False)  # identity only: two jobs are never "equal" (see the module docstring)
class Job:
    """One request in the queue: chunks [taken, chunks) still wait for a batch."""

    id: int
    chunks: int
    frames: int  # mask frames F of the request
    enqueued: float  # the caller's clock (e.g. time.monotonic()), seconds
    deadline: float | None  # same clock; None: no deadline
    taken: int = 0
    #: the device its rows lie on (module docstring); None: any device
    device: int | None = None

    @property
    def waiting(self) -> int:
        return self.chunks - self.taken


@dataclass(frozen=True)
class Piece:
    """Chunks [start, stop) of job `job`, at rows [offset, offset + stop - start) of a batch."""

    job: int
    start: int
    stop: int
    offset: int

    @property
    def chunks(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Batch:
    """What one batch holds: its pieces in row order, the mask frame count they share, and
    the jobs whose first chunk rides in it (with how long they waited, for the metric)."""

    pieces: tuple[Piece, ...]
    #: F of every masks piece as handed to the engine
    frames: int
    #: the pieces' requests differ in F: resize each piece to `frames` (= 125) first, where
    #: the nearest resize is the identity, so no chunk depends on its neighbours
    resize: bool
    #: (job id, seconds queued before its first chunk entered a batch)
    started: tuple[tuple[int, float], ...]
    #: the device every bound job in it is bound to; None: no job is bound
    device: int | None = None

    @property
    def chunks(self) -> int:
        return sum(piece.chunks for piece in self.pieces)

    @property
    def jobs(self) -> tuple[int, ...]:
        """Distinct job ids in row order."""
        return tuple(dict.fromkeys(piece.job for piece in self.pieces))

    def rows(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """The batch rows [start, stop) as (job id, first chunk, end chunk) of each job, in
        row order: what one plan run covering those rows reads and writes."""
        if not 0 <= start < stop <= self.chunks:
            raise ValueError(f"rows [{start}, {stop}) outside the batch's {self.chunks} rows")
        parts = []
        for piece in self.pieces:
            low, high = max(start, piece.offset), min(stop, piece.offset + piece.chunks)
            if low < high:
                parts.append((piece.job, piece.start + low - piece.offset, piece.start + high - piece.offset))
        return parts


@dataclass(frozen=True)
class Removal:
    """A job that left the queue before all its chunks were taken, with its queued chunks
    and the error its caller gets (Cancelled: the caller is gone already)."""

    job: int
    chunks: int
    error: BatcherError

    @property
    def reason(self) -> str:
        return self.error.reason


class QueueState:
    """Jobs waiting for batches of at most `max_batch` chunks, holding at most
    `capacity_chunks` queued chunks in all. Not thread-safe: one owner (the batcher's event
    loop) calls it."""

    def __init__(self, capacity_chunks: int, max_batch: int) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch: {max_batch}, expected at least 1 chunk")
        if capacity_chunks < max_batch:
            raise ValueError(f"queue of {capacity_chunks} chunks cannot hold one batch of {max_batch}")
        self.capacity_chunks = capacity_chunks
        self.max_batch = max_batch
        self._jobs: collections.OrderedDict[int, Job] = collections.OrderedDict()  # queue order
        self._queued_chunks = 0
        self._next_id = 0
        self._closed = False

    # --- what is queued ----------------------------------------------------------------

    @property
    def queued_chunks(self) -> int:
        """Chunks of queued jobs not yet taken by a batch (the queue-depth gauge)."""
        return self._queued_chunks

    @property
    def closed(self) -> bool:
        """True once `close` was called: no job is admitted any more."""
        return self._closed

    def __len__(self) -> int:
        return len(self._jobs)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._jobs

    def order(self) -> list[int]:
        """Queued job ids, next to be served first."""
        return list(self._jobs)

    def waiting(self, job_id: int) -> int:
        """Chunks of `job_id` still queued (0 when it is not queued)."""
        job = self._jobs.get(job_id)
        return 0 if job is None else job.waiting

    # --- changes -----------------------------------------------------------------------

    def admit(
        self, chunks: int, frames: int, now: float, deadline: float | None = None, device: int | None = None
    ) -> int:
        """Queue a job of `chunks` chunks with masks of `frames` frames, bound to `device`
        when its rows lie there (module docstring); its id.

        Raises Draining once closed, QueueFull when the chunks do not fit now,
        DeadlinePassed when `deadline` <= `now`, and ValueError for a job that could never
        be queued (no chunks, or more than the whole capacity: callers check that first).
        """
        if self._closed:
            raise Draining(DRAINING_MESSAGE)
        if chunks < 1 or frames < 1:
            raise ValueError(f"chunks: {chunks}, frames: {frames}; expected at least 1 of each")
        if chunks > self.capacity_chunks:
            raise ValueError(
                f"fbank: {chunks} chunks exceed the queue's {self.capacity_chunks}; split the request"
            )
        if self._queued_chunks + chunks > self.capacity_chunks:
            raise QueueFull(
                f"queue holds {self._queued_chunks} of {self.capacity_chunks} chunks; "
                f"{chunks} more do not fit, retry with backoff"
            )
        if deadline is not None and deadline <= now:
            raise DeadlinePassed(LATE_MESSAGE)
        job = Job(self._next_id, chunks, frames, now, deadline, device=device)
        self._next_id += 1
        self._jobs[job.id] = job
        self._queued_chunks += chunks
        return job.id

    def check_open(self, now: float, deadline: float | None = None) -> None:
        """What `admit` refuses for a request that needs no queued chunk (every window of it
        silent, answered without the engine): Draining once closed, DeadlinePassed when
        `deadline` <= `now`; such a request is refused as any other would be."""
        if self._closed:
            raise Draining(DRAINING_MESSAGE)
        if deadline is not None and deadline <= now:
            raise DeadlinePassed(LATE_MESSAGE)

    def due_in(self, now: float, max_delay_s: float) -> float | None:
        """Seconds until the next batch should be formed: None when nothing is queued; 0 when
        a full batch waits, the longest-queued job has waited `max_delay_s`, or the queue is
        closed (draining: nothing more will arrive to fill a batch)."""
        if not self._jobs:
            return None
        if self._closed or self._queued_chunks >= self.max_batch:
            return 0.0
        oldest = min(job.enqueued for job in self._jobs.values())
        return max(0.0, oldest + max_delay_s - now)

    def next_batch(self, now: float, lead_s: float = 0.0) -> tuple[Batch | None, list[Removal]]:
        """Take the next batch (None when nothing is left), after removing the jobs whose
        deadline passes within `lead_s` (their removals are returned, errors DeadlinePassed):
        `lead_s` is the shortest plan run, so a job due sooner could not be answered in time."""
        removals = self.expire(now, lead_s)
        pieces: list[Piece] = []
        started: list[tuple[int, float]] = []
        frames: set[int] = set()
        room = self.max_batch
        device: int | None = None
        for job in list(self._jobs.values()):  # a snapshot: a split job moves to the end
            if room == 0:
                break
            if job.device is not None:
                if device is not None and job.device != device:
                    continue  # bound elsewhere: keeps its place for a batch of its device
                device = job.device
            count = min(room, job.waiting)
            if job.taken == 0:
                started.append((job.id, now - job.enqueued))
            pieces.append(Piece(job.id, job.taken, job.taken + count, self.max_batch - room))
            frames.add(job.frames)
            job.taken += count
            room -= count
            self._queued_chunks -= count
            if job.waiting == 0:
                del self._jobs[job.id]
            else:  # split: the rest queues behind every job waiting now (fairness)
                self._jobs.move_to_end(job.id)
        if not pieces:
            return None, removals
        mixed = len(frames) > 1
        batch = Batch(tuple(pieces), TRUNK_FRAMES if mixed else frames.pop(), mixed, tuple(started), device)
        return batch, removals

    def remove(self, job_id: int, error: BatcherError) -> Removal | None:
        """Take `job_id`'s queued chunks out of the queue, whatever its position; None when
        it is not queued (all its chunks already taken, or removed before)."""
        job = self._jobs.pop(job_id, None)
        if job is None:
            return None
        self._queued_chunks -= job.waiting
        return Removal(job.id, job.waiting, error)

    def cancel(self, job_id: int) -> Removal | None:
        """The caller of `job_id` went away: `remove` with Cancelled."""
        return self.remove(job_id, Cancelled("the caller went away before its chunks were embedded"))

    def expire(self, now: float, lead_s: float = 0.0) -> list[Removal]:
        """Remove every queued job whose deadline is <= now + lead_s, wherever it is in the
        queue: work that could not finish before its deadline is not worth starting."""
        horizon = now + lead_s
        expired = [job for job in self._jobs.values() if job.deadline is not None and job.deadline <= horizon]
        removals = []
        for job in expired:
            queued = now - job.enqueued
            assert job.deadline is not None
            when = (
                "passed"
                if job.deadline <= now
                else f"is {job.deadline - now:.3f} s away, less than one plan run ({lead_s:.3f} s),"
            )
            error = DeadlinePassed(
                f"deadline {when} after {queued:.3f} s in the queue with {job.waiting} of "
                f"{job.chunks} chunks not yet in a batch"
            )
            removal = self.remove(job.id, error)
            assert removal is not None, f"job {job.id} listed as queued but not removable"
            removals.append(removal)
        return removals

    def close(self) -> None:
        """Admit no more jobs (draining); queued ones stay until taken or `fail_all`."""
        self._closed = True

    def fail_all(self, message: str) -> list[Removal]:
        """Remove every queued job with Draining(message): the drain ran out of time."""
        return [
            removal
            for job_id in list(self._jobs)
            if (removal := self.remove(job_id, Draining(message))) is not None
        ]
