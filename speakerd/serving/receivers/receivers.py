"""The server's side of `serve --receivers N`: the receiver processes, their shared-memory
slots, and the EmbedChunks calls they hand over (receiver_link.py says why).

A handed-over call is served by the same `SpeakerEmbeddingService.EmbedChunks` as a call
this process receives itself, on the slot's bytes in place (a memoryview: the request's
tensors become NumPy views of the slot, copied once more only into pinned staging), with a
`RelayedContext` standing in for gRPC's: the caller's metadata and deadline, and an
`abort` that carries the status back to the receiver instead of ending a call here.

The slots belong to this process (created here, unlinked at stop), so a receiver that
dies leaves nothing behind: its calls in progress here are cancelled, an ERROR line says
so, and a new receiver takes its slots and its place on the port.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import multiprocessing
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from multiprocessing import shared_memory
from multiprocessing.connection import Connection
from typing import Any

import grpc

from speakerd.serving.api.errors import cancellation
from speakerd.serving.receivers.receiver import receiver_main
from speakerd.serving.receivers.receiver_link import (
    ABORT,
    CALL,
    CANCEL,
    LISTENING,
    RESPONSE,
    SLOTS_PER_RECEIVER,
    STOP,
    ReceiverSpec,
    read_link,
    send,
)

log = logging.getLogger(__name__)

#: How long a receiver gets to bind its port and say so (a spawned interpreter importing
#: gRPC and NumPy takes ~1 s; a loaded CI machine several).
START_TIMEOUT_S = 60.0
#: After STOP (and its grace), how long a receiver gets to exit before it is terminated.
EXIT_WAIT_S = 5.0
#: Pause before replacing a receiver that died, so one that dies at once does not spin.
RESTART_PAUSE_S = 1.0

#: What serves a handed-over call: SpeakerEmbeddingService.EmbedChunks.
Serve = Callable[[memoryview, Any], Any]


class ReceiverFailed(RuntimeError):
    """A receiver could not start (its message says why: usually the port)."""


class CallAborted(Exception):
    """RelayedContext.abort: the status a handed-over call ends with."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing: tuple[tuple[str, Any], ...]) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details, self.trailing = code, details, trailing


class RelayedContext:
    """What the service reads of a gRPC ServicerContext, for a call a receiver took."""

    def __init__(self, metadata: tuple[tuple[str, Any], ...], deadline: float | None) -> None:
        self._metadata = metadata
        self._deadline = deadline

    def invocation_metadata(self) -> tuple[tuple[str, Any], ...]:
        return self._metadata

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> None:
        raise CallAborted(code, details, tuple(trailing_metadata or ()))


@dataclass
class _Receiver:
    spec: ReceiverSpec
    slots: list[shared_memory.SharedMemory]
    process: multiprocessing.process.BaseProcess | None = None
    conn: Connection | None = None
    pid: int = 0
    #: calls being served here, by the receiver's job number
    calls: dict[int, asyncio.Task[None]] = field(default_factory=dict)


class ReceiverGroup:
    """`count` receiver processes on `port`, serving handed-over calls with `serve`;
    `on_lost` is told of each that exits while serving (before it is replaced), `on_call`
    of each call handed over (with the receiver's index)."""

    def __init__(
        self,
        count: int,
        template: ReceiverSpec,
        serve: Serve,
        on_lost: Callable[[], None],
        on_call: Callable[[int], None],
    ) -> None:
        self._template = template
        self._serve = serve
        self._on_lost = on_lost
        self._on_call = on_call
        self._count = count
        self._receivers: list[_Receiver] = []
        self._context = multiprocessing.get_context("spawn")  # fork would copy gRPC and CUDA state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._restarts: set[asyncio.Task[None]] = set()

    @property
    def pids(self) -> list[int]:
        return [receiver.pid for receiver in self._receivers]

    async def start(self) -> None:
        """Create the slots, start every receiver and wait until each listens; ReceiverFailed
        (after stopping them all) when one cannot."""
        self._loop = asyncio.get_running_loop()
        try:
            for index in range(self._count):
                slots = [shared_memory.SharedMemory(create=True, size=self._template.slot_bytes)
                         for _ in range(SLOTS_PER_RECEIVER)]  # fmt: skip
                names = tuple(memory.name for memory in slots)
                spec = replace(self._template, index=index, slot_names=names)
                self._receivers.append(_Receiver(spec, slots))
            await asyncio.gather(*(self._launch(receiver) for receiver in self._receivers))
        except BaseException:
            await self.stop(0.0)
            raise

    async def _launch(self, receiver: _Receiver) -> None:
        ours, theirs = self._context.Pipe(duplex=True)
        name = f"speakerd-receiver-{receiver.spec.index}"
        process = self._context.Process(
            target=receiver_main, args=(receiver.spec, theirs), name=name, daemon=True
        )
        process.start()
        theirs.close()  # ours alone now: its recv sees EOF when the receiver dies
        receiver.process, receiver.conn = process, ours
        loop = asyncio.get_running_loop()
        reply = await loop.run_in_executor(None, _first_message, ours, START_TIMEOUT_S)
        if reply is None or reply[0] != LISTENING:
            why = "it did not start" if reply is None else reply[1]
            raise ReceiverFailed(f"receiver {receiver.spec.index}: {why}")
        receiver.pid = int(reply[1])
        assert self._loop is not None
        on_message = functools.partial(self._on_message, receiver)
        on_closed = functools.partial(self._lost, receiver, ours)
        threading.Thread(target=read_link, args=(ours, self._loop, on_message, on_closed), daemon=True,
                         name=f"receiver-{receiver.spec.index}-link").start()  # fmt: skip

    # --- the link (a thread per receiver reads; everything else runs on the event loop) --

    def _on_message(self, receiver: _Receiver, message: tuple[Any, ...]) -> None:
        if message[0] == CALL:
            _, job, slot, size, metadata, deadline = message
            raw = receiver.slots[slot].buf[:size]
            task = asyncio.ensure_future(self._call(receiver, job, raw, RelayedContext(metadata, deadline)))
            receiver.calls[job] = task
            self._on_call(receiver.spec.index)
        elif message[0] == CANCEL:
            task = receiver.calls.get(message[1])
            if task is not None:
                task.cancel()

    async def _call(self, receiver: _Receiver, job: int, raw: memoryview, context: RelayedContext) -> None:
        try:
            response = await self._serve(raw, context)
            reply: tuple[Any, ...] = (RESPONSE, job, response.SerializeToString())
        except CallAborted as aborted:
            reply = (ABORT, job, aborted.code.name, aborted.details, aborted.trailing)
        except asyncio.CancelledError:  # CANCEL from the receiver (the service counted it)
            code, reason = cancellation(context)
            reply = (ABORT, job, code.name, reason.replace("_", " "), ())
        except Exception as error:  # the service answers every error itself: this is a bug
            name = type(error).__name__
            log.exception("receiver %d call %d: unexpected %s", receiver.spec.index, job, name)
            reply = (ABORT, job, "INTERNAL", f"internal error ({name}); see the server log", ())
        finally:
            receiver.calls.pop(job, None)
        send(receiver.conn, reply)  # a receiver gone is handled by _lost

    def _lost(self, receiver: _Receiver, conn: Connection) -> None:
        """A receiver's pipe closed: it exited. Unless stopping, cancel its calls here and
        start another in its place (same index, same slots)."""
        if conn is not receiver.conn or self._stopping:
            return
        self._on_lost()
        calls = len(receiver.calls)
        for task in list(receiver.calls.values()):
            task.cancel()
        task = asyncio.ensure_future(self._replace(receiver, calls))
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)

    async def _replace(self, receiver: _Receiver, calls: int) -> None:
        process = receiver.process
        if process is not None:  # reaped first, so that its exit code is known
            await asyncio.get_running_loop().run_in_executor(None, process.join, EXIT_WAIT_S)
        log.error("receiver %d (pid %d) exited (code %s) with %d calls in progress; starting another",
                  receiver.spec.index, receiver.pid, None if process is None else process.exitcode,
                  calls)  # fmt: skip
        await asyncio.sleep(RESTART_PAUSE_S)
        if self._stopping:
            return
        try:
            await self._launch(receiver)
        except ReceiverFailed as error:
            log.error("%s; %d receivers left", error, sum(r.pid > 0 for r in self._receivers) - 1)
            receiver.pid = 0
            return
        log.info("receiver %d listening again (pid %d)", receiver.spec.index, receiver.pid)

    # --- stop ----------------------------------------------------------------------------

    async def stop(self, grace_s: float) -> None:
        """Tell every receiver to stop (each finishes its calls within `grace_s`), wait for
        them to exit (terminate those that do not) and remove the slots."""
        self._stopping = True
        for task in list(self._restarts):
            task.cancel()
        for receiver in self._receivers:
            send(receiver.conn, (STOP, grace_s))
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(None, _end, receiver, grace_s + EXIT_WAIT_S)
                               for receiver in self._receivers))  # fmt: skip
        gc.collect()  # a finished call's views may sit in a reference cycle (an error's traceback)
        for receiver in self._receivers:
            for memory in receiver.slots:
                _close(memory)
                with contextlib.suppress(FileNotFoundError):
                    memory.unlink()


def _close(memory: shared_memory.SharedMemory) -> None:
    """Unmap a slot; one still viewed (by a batch abandoned in the engine) stays mapped
    until the process exits, without SharedMemory's own retry at exit complaining."""
    try:
        memory.close()
    except BufferError:
        log.debug("slot %s still viewed; it stays mapped until exit", memory.name)
        _still_viewed.append(memory)


#: Slots that could not be unmapped: kept alive (not collected, so never closed again) until exit.
_still_viewed: list[shared_memory.SharedMemory] = []


def _first_message(conn: Connection, timeout_s: float) -> tuple[Any, ...] | None:
    """A receiver's LISTENING or FAILED, or None when it exits or says nothing in time."""
    try:
        if conn.poll(timeout_s):
            return conn.recv()
    except (EOFError, OSError):
        pass
    return None


def _end(receiver: _Receiver, wait_s: float) -> None:
    process = receiver.process
    if process is None:
        return
    process.join(wait_s)
    if process.is_alive():
        log.warning("receiver %d (pid %d) did not stop in %.1f s; terminating it",
                    receiver.spec.index, receiver.pid, wait_s)  # fmt: skip
        process.terminate()
        process.join(EXIT_WAIT_S)
    if receiver.conn is not None:
        receiver.conn.close()
