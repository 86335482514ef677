"""Daemon threads running engine batches for an asyncio event loop.

Why not a ThreadPoolExecutor: its threads are joined when the interpreter exits, and
`shutdown(wait=True)` blocks the event loop until every batch handed to it has run. A
batch inside the engine is native code that cannot be interrupted, so a drain of a few
seconds turned into the whole backlog of running batches (issue 14: 27.9 s for a 3 s
drain on the CPU engine, three b32 batches in line for its lock). These threads are
daemons and `stop` never waits, so nothing here stretches a shutdown: the batcher decides
what it waits for.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_STOP = None  # sentinel on the work queue: one per thread


class EngineThreads:
    """`count` daemon threads taking work items in order; results arrive as futures of
    `loop`. Work already taken by a thread when `stop` is called finishes (unobserved if
    nobody awaits it any more); work not taken yet is failed with RuntimeError."""

    def __init__(self, count: int, loop: asyncio.AbstractEventLoop, name: str = "engine") -> None:
        if count < 1:
            raise ValueError(f"count: {count}, expected at least 1 thread")
        self._loop = loop
        self._work: queue.SimpleQueue[tuple[asyncio.Future[Any], Callable[[], Any]] | None] = (
            queue.SimpleQueue()
        )
        self._stopped = False
        self._threads = [
            threading.Thread(target=self._serve, name=f"{name}-{index}", daemon=True)
            for index in range(count)
        ]
        for thread in self._threads:
            thread.start()

    def run(self, work: Callable[[], T]) -> asyncio.Future[T]:
        """Run `work()` on a free thread; its result or exception arrives in the future."""
        future: asyncio.Future[T] = self._loop.create_future()
        if self._stopped:
            future.set_exception(RuntimeError("engine threads stopped; no new work is run"))
            return future
        self._work.put((future, work))
        return future

    def stop(self) -> None:
        """Take no new work and let the threads end after the item each is running; never
        waits (see the module docstring)."""
        if self._stopped:
            return
        self._stopped = True
        for _ in self._threads:
            self._work.put(_STOP)

    def alive(self) -> int:
        """Threads still running (a thread inside a long engine call stays alive)."""
        return sum(thread.is_alive() for thread in self._threads)

    def _serve(self) -> None:
        while (item := self._work.get()) is not _STOP:
            future, work = item
            result: Any = None
            error: BaseException | None = None
            if self._stopped:
                error = RuntimeError("engine threads stopped before this work started")
            else:
                try:
                    result = work()
                except BaseException as caught:  # delivered to the awaiting coroutine
                    error = caught
            with contextlib.suppress(RuntimeError):  # a closed loop: the process is on its way out
                self._loop.call_soon_threadsafe(_settle, future, result, error)


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # cancelled: nobody waits for it any more
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
