"""A receiver process of `serve --receivers N`: accepts gRPC calls on the server's port and
hands them to the server process (receiver_link.py says why and how).

EmbedChunks requests that fit a slot are copied into one of this receiver's shared-memory
slots and served by the server process from there; every other call (EmbedChunksStream,
EmbedRecording, GetModelInfo, health, reflection, and EmbedChunks requests larger than a
slot) is forwarded as bytes over the server's internal Unix socket, metadata and deadline
included, and its answer or status comes back unchanged. Authentication (bearer tokens)
and TLS are this process's, from the same flags as the server's, so a call is refused or
accepted here exactly as the server would.

The server process decides when a receiver stops: a STOP message (sent once the server has
drained), or the server's end of the pipe closing (the server died). SIGINT is ignored (a
Ctrl-C reaches the whole process group, and the server drains first). SIGTERM, which only
a supervisor signalling every process (systemd's default) or the server's own exit sends
here, stops the receiver as a drain does: no new calls, up to --drain-seconds for the
calls in progress.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import os
import signal
import threading
import time
from collections.abc import AsyncIterator
from multiprocessing import shared_memory
from multiprocessing.connection import Connection
from typing import Any

import grpc

from speakerd.serving.access.auth import TokenAuthInterceptor, TokenFile
from speakerd.serving.access.security import TlsFiles, add_port, server_credentials
from speakerd.serving.api.http2 import stream_options
from speakerd.serving.memory import heap
from speakerd.serving.observability.logs import LOG_FORMAT
from speakerd.serving.receivers.receiver_link import (
    ABORT,
    CALL,
    CANCEL,
    FAILED,
    HOT_METHOD,
    LISTENING,
    RESPONSE,
    STOP,
    ReceiverSpec,
    forwardable,
    read_link,
    send,
)

log = logging.getLogger(__name__)


def receiver_main(spec: ReceiverSpec, conn: Connection) -> None:
    """Process entry point (spawned by receivers.ReceiverGroup)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=spec.log_level, format=LOG_FORMAT)
    heap.keep_freed_memory()  # every request's ~10 MB buffers reused, not faulted in again (heap.py)
    asyncio.run(Receiver(spec, conn).run())


class Receiver:
    """The gRPC server of one receiver process and its side of the link."""

    def __init__(self, spec: ReceiverSpec, conn: Connection) -> None:
        self.spec = spec
        self.conn = conn
        self._slots = [shared_memory.SharedMemory(name=name) for name in spec.slot_names]
        self._free: asyncio.Queue[int] = asyncio.Queue()
        self._pending: dict[int, tuple[asyncio.Future[tuple[Any, ...]], int]] = {}
        self._jobs = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Future[float] | None = None
        self._channel: grpc.aio.Channel | None = None

    async def run(self) -> None:
        s = self.spec
        self._loop = asyncio.get_running_loop()
        self._stop = self._loop.create_future()
        self._loop.add_signal_handler(signal.SIGTERM, self._terminated)
        for index in range(len(self._slots)):
            self._free.put_nowait(index)
        sizes = [("grpc.max_receive_message_length", s.max_message_bytes),
                 ("grpc.max_send_message_length", s.max_message_bytes)]  # fmt: skip
        interceptors = [] if s.auth_tokens is None else [TokenAuthInterceptor(TokenFile(s.auth_tokens))]
        # every receiver binds the same port: the kernel spreads new connections over them
        options = [*sizes, *stream_options(s.max_concurrent_streams), ("grpc.so_reuseport", 1)]
        server = grpc.aio.server(options=options, interceptors=interceptors)
        server.add_generic_rpc_handlers((_Handlers(self),))
        self._channel = grpc.aio.insecure_channel(s.internal_target, options=sizes)
        address = f"{s.host}:{s.port}"
        credentials = None
        if s.tls_cert is not None and s.tls_key is not None:
            credentials = server_credentials(TlsFiles(s.tls_cert, s.tls_key, s.tls_client_ca))
        try:
            add_port(server, address, credentials)
        except RuntimeError as error:
            self.conn.send((FAILED, f"cannot listen on {address} ({error})"))
            await self._close()
            return
        await server.start()
        heap.freeze_long_lived()  # full collections walk requests' objects only (heap.py)
        self.conn.send((LISTENING, os.getpid()))
        threading.Thread(target=read_link, args=(self.conn, self._loop, self._on_message, self._server_gone),
                         name="link", daemon=True).start()  # fmt: skip
        grace = await self._stop
        await server.stop(grace)
        await self._close()

    async def _close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
        for memory in self._slots:
            with contextlib.suppress(BufferError):  # a view still held by a cancelled call
                memory.close()

    # --- the link ------------------------------------------------------------------------

    def _on_message(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == STOP:
            self._request_stop(float(message[1]))
            return
        pending = self._pending.pop(message[1], None)
        if pending is None:  # a call failed already when the server was seen to go
            return
        future, slot = pending
        self._free.put_nowait(slot)  # the server is done with it: RESPONSE or ABORT is its last word
        if not future.done():
            future.set_result(message)

    def _server_gone(self) -> None:
        """The server process ended: every call waiting on it fails, and this receiver stops."""
        log.error("receiver %d: the server process is gone; failing %d calls and stopping",
                  self.spec.index, len(self._pending))  # fmt: skip
        for future, _ in self._pending.values():
            if not future.done():
                future.set_result((ABORT, -1, "UNAVAILABLE", "the server process stopped; retry", ()))
        self._pending.clear()
        self._request_stop(0.0)

    def _terminated(self) -> None:
        log.info("receiver %d: SIGTERM, stopping (up to %.1f s for calls in progress)",
                 self.spec.index, self.spec.drain_seconds)  # fmt: skip
        self._request_stop(self.spec.drain_seconds)

    def _request_stop(self, grace_s: float) -> None:
        if self._stop is not None and not self._stop.done():
            self._stop.set_result(grace_s)

    # --- calls ---------------------------------------------------------------------------

    async def embed_chunks(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """EmbedChunks through a slot, or forwarded when larger than one."""
        if len(raw) > self.spec.slot_bytes:
            return await self.forward_unary(HOT_METHOD, raw, context)
        slot = await self._free.get()
        self._slots[slot].buf[: len(raw)] = raw
        job = next(self._jobs)
        assert self._loop is not None
        future: asyncio.Future[tuple[Any, ...]] = self._loop.create_future()
        self._pending[job] = (future, slot)
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        metadata = forwardable(context.invocation_metadata())
        if not send(self.conn, (CALL, job, slot, len(raw), metadata, deadline)):
            self._pending.pop(job)
            self._free.put_nowait(slot)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server process stopped; retry")
        try:
            reply = await asyncio.shield(future)
        except asyncio.CancelledError:
            send(self.conn, (CANCEL, job))  # the slot comes back with the server's answer
            raise
        if reply[0] == RESPONSE:
            return reply[2]
        _, _, code, details, trailing = reply
        await context.abort(grpc.StatusCode[code], details, tuple(trailing))
        raise AssertionError("not reached: abort raises")

    async def forward_unary(self, method: str, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """One request, one answer, over the internal socket."""
        assert self._channel is not None
        call = self._channel.unary_unary(method)
        try:
            return await call(raw, timeout=context.time_remaining(),
                              metadata=forwardable(context.invocation_metadata()))  # fmt: skip
        except grpc.aio.AioRpcError as error:
            await _abort_as(context, error)
            raise AssertionError("not reached: abort raises") from error

    async def forward_stream(
        self, method: str, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        """Any other call, as a stream of bytes both ways (a unary call is a stream of one)."""
        assert self._channel is not None
        call = self._channel.stream_stream(method)(
            requests, timeout=context.time_remaining(), metadata=forwardable(context.invocation_metadata())
        )
        try:
            async for response in call:
                yield response
        except grpc.aio.AioRpcError as error:
            await _abort_as(context, error)
        finally:  # the caller went away (this generator cancelled or closed): so does the call
            call.cancel()


async def _abort_as(context: grpc.aio.ServicerContext, error: grpc.aio.AioRpcError) -> None:
    """End this call with the forwarded call's status, details and trailing metadata."""
    await context.abort(error.code(), error.details() or "", tuple(error.trailing_metadata() or ()))


class _Handlers(grpc.GenericRpcHandler):
    """EmbedChunks through slots, everything else forwarded (no (de)serializers: bytes)."""

    def __init__(self, receiver: Receiver) -> None:
        self._hot = grpc.unary_unary_rpc_method_handler(receiver.embed_chunks)
        self._receiver = receiver

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        if method == HOT_METHOD:
            return self._hot
        return grpc.stream_stream_rpc_method_handler(functools.partial(self._receiver.forward_stream, method))
