"""Admission of recordings by the memory they will hold, first come first served.

A recording call (EmbedRecording, and the voiceprint methods built on it) holds its
recording's log-mel frames (32 KB a second of audio) and one mask row per window until it
ends: a 10 s call holds 0.3 MB, a 3 h one 421 MB with pyannote's masks. Counting calls says
nothing of that, so calls reserve what they will hold against one byte budget
(`--recording-memory-mb`). A call that does not fit yet waits, in arrival order, for calls
ahead of it to end, up to its deadline; only when `--recording-queue` calls already wait is
one refused at once (RESOURCE_EXHAUSTED: the server is saturated, a client should back off).
A reservation can grow once its call knows more (its masks turn out wider than assumed):
without waiting, since a call that holds memory and waits for more could wait forever on
another that does the same; a growth that does not fit is the call's RESOURCE_EXHAUSTED.

The state lives on the event loop's thread (no lock): `admit` is awaited there, and
`release` and `grow` are called there.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field
from typing import Protocol

# The server's two budgets, defined here rather than beside the calls that reserve in them
# so that `serve`'s flags (serving/server/config.py) load without the services' modules.
#: Bytes of recordings in progress at once (`--recording-memory-mb`): four 3 h recordings
#: with pyannote's float32 masks (421 MB each), or hundreds of short ones.
DEFAULT_RECORDING_MEMORY_MB = 2048
#: Calls waiting for room in that budget (`--recording-queue`); one more is RESOURCE_EXHAUSTED
#: at once (the clients retry with backoff).
DEFAULT_RECORDING_QUEUE = 64
#: MiB Diarize calls clustering at once may hold (`--clustering-memory-mb`): an hour's
#: clustering takes at most 1.0 GB (every pair clean), so two at once fit; a 3 h recording
#: fits with up to 47% of its pairs clean (sample.wav's share, 47%, takes 2.1 GB).
DEFAULT_CLUSTERING_MEMORY_MB = 2048


class QueueFull(Exception):
    """`max_waiting` calls already wait: refused without waiting."""


class TooLarge(Exception):
    """The call needs more than the whole budget: it could never be admitted."""


@dataclass
class Reservation:
    """Bytes one call holds in the budget; `release` gives them back (once)."""

    budget: RecordingBudget
    nbytes: int
    released: bool = field(default=False, repr=False)

    def grow(self, extra: int) -> bool:
        """Hold `extra` more bytes if they fit now (never waits); False otherwise."""
        return self.budget._grow(self, extra)

    def shrink(self, fewer: int) -> None:
        """Give back `fewer` of the held bytes (the call needs less than it reserved)."""
        self.budget._shrink(self, fewer)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.budget._release(self)


class Gauge(Protocol):
    """What `RecordingBudget.report` sets: a Prometheus gauge, or anything with `set`."""

    def set(self, value: float) -> None: ...


class RecordingBudget:
    """`limit_bytes` of recordings held at once; at most `max_waiting` calls wait for room."""

    def __init__(self, limit_bytes: int, max_waiting: int) -> None:
        if limit_bytes < 1 or max_waiting < 0:
            raise ValueError(
                f"recording budget {limit_bytes} bytes, {max_waiting} waiting: expected > 0, >= 0"
            )
        self.limit_bytes = limit_bytes
        self.max_waiting = max_waiting
        self.held_bytes = 0
        self.holders = 0
        self._queue: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def report(self, waiting_gauge: Gauge, held_gauge: Gauge, waiting: int = 0) -> None:
        """Set the budget's two gauges: calls waiting (plus `waiting` about to) and bytes held."""
        waiting_gauge.set(self.waiting + waiting)
        held_gauge.set(self.held_bytes)

    async def admit(self, nbytes: int) -> Reservation:
        """Reserve `nbytes`, waiting behind earlier calls while they do not fit. QueueFull
        when `max_waiting` calls wait already, TooLarge when the budget can never hold it.
        Cancelling the wait (a deadline, a client gone) leaves the queue at once."""
        if nbytes > self.limit_bytes:
            raise TooLarge(f"{nbytes} bytes, the whole budget is {self.limit_bytes}")
        if not self._queue and self.held_bytes + nbytes <= self.limit_bytes:
            return self._take(nbytes)
        if len(self._queue) >= self.max_waiting:
            raise QueueFull(f"{len(self._queue)} recordings wait already, the most this server queues")
        entry = (nbytes, asyncio.get_running_loop().create_future())
        self._queue.append(entry)
        try:
            await entry[1]
        except asyncio.CancelledError:
            if entry[1].done() and not entry[1].cancelled():  # admitted as it was cancelled
                self._release(Reservation(self, nbytes))
            else:
                self._queue.remove(entry)
                self._wake()  # the calls behind it may fit now
            raise
        return Reservation(self, nbytes)

    def _take(self, nbytes: int) -> Reservation:
        self.held_bytes += nbytes
        self.holders += 1
        return Reservation(self, nbytes)

    def _grow(self, reservation: Reservation, extra: int) -> bool:
        assert not reservation.released and extra >= 0, (reservation, extra)
        if self.held_bytes + extra > self.limit_bytes:
            return False
        self.held_bytes += extra
        reservation.nbytes += extra
        return True

    def _shrink(self, reservation: Reservation, fewer: int) -> None:
        assert not reservation.released and 0 <= fewer <= reservation.nbytes, (reservation, fewer)
        self.held_bytes -= fewer
        reservation.nbytes -= fewer
        self._wake()

    def _release(self, reservation: Reservation) -> None:
        self.held_bytes -= reservation.nbytes
        self.holders -= 1
        assert self.held_bytes >= 0 and self.holders >= 0, (self.held_bytes, self.holders)
        self._wake()

    def _wake(self) -> None:
        """Admit waiting calls in arrival order while the first of them fits."""
        while self._queue and self.held_bytes + self._queue[0][0] <= self.limit_bytes:
            nbytes, future = self._queue.popleft()
            if future.cancelled():
                continue
            self.held_bytes += nbytes
            self.holders += 1
            future.set_result(None)
