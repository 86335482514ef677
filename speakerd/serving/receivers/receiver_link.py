"""What the server process and its receiver processes (`serve --receivers N`) share.

Why receivers: gRPC's Python receive copies each message out of the core's slices into a
bytes object with the interpreter lock held. For 32-chunk requests (10.2 MB of fbank) on
the H200 that copy alone held the lock ~24% of the time on the event-loop thread (py-spy
--native), and the service gave 73-82% of the engine's chunks/s while the same batcher fed
in process gave 96%. A receiver is a process of its own, with its own lock, that accepts
gRPC connections on the server's port (SO_REUSEPORT: the kernel spreads connections over
the receivers) and pays that copy; an EmbedChunks request then reaches the server process
as its serialized bytes in a shared-memory slot, and only a few numbers cross the pipe.
The server parses and serves it exactly as a call it received itself (same validation,
request ids, batcher, metrics, errors); the response bytes go back over the pipe.

The link is one duplex pipe per receiver, carrying tuples:

receiver -> server
    (CALL, job, slot, size, metadata, deadline)  serve the `size` bytes in slot `slot`;
        `deadline` is time.monotonic() seconds (one clock for every process on the host)
        or None; `metadata` the call's invocation metadata
    (CANCEL, job)                                the caller went away or its deadline passed
server -> receiver
    (RESPONSE, job, response_bytes)              the call's answer
    (ABORT, job, code, details, trailing)        the call's status (an error)
    (STOP, grace_s)                              stop listening, finish calls, exit
receiver -> server
    (LISTENING, pid) / (FAILED, message)         after trying to bind

Each CALL gets exactly one RESPONSE or ABORT, also after a CANCEL, and only then does the
receiver write into that slot again: the server may still be reading it until then.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

CALL, CANCEL, LISTENING, FAILED = "call", "cancel", "listening", "failed"
RESPONSE, ABORT, STOP = "response", "abort", "stop"

#: Bytes of one request slot: a 32-chunk fbank request is 10.2 MB of fbank, 0.2 MB of
#: masks at pyannote's 589 frames and some framing. A larger request (more chunks, masks
#: at 10,000 frames, a waveform request over 18 chunks) is forwarded over the server's
#: internal socket instead and costs the server its receive copy as without receivers.
SLOT_BYTES = 12 * 1024 * 1024
#: Slots per receiver: calls a receiver hands over at once (more wait for a free one).
#: SO_REUSEPORT balances connections, not calls, so one receiver may well hold several
#: clients' connections: 8 covers 16 streams over 4 receivers with room to spare.
SLOTS_PER_RECEIVER = 8
#: The method served through slots; every other one is forwarded as bytes.
HOT_METHOD = "/speakerd.v1.SpeakerEmbedding/EmbedChunks"
#: Metadata a forwarded call must not copy: HTTP/2 pseudo-headers and gRPC's own.
RESERVED_METADATA = (":", "grpc-")


@dataclass(frozen=True)
class ReceiverSpec:
    """What a receiver process needs to listen as the server does (picklable)."""

    index: int
    host: str
    port: int
    max_message_bytes: int
    max_concurrent_streams: int
    #: the server's own listener for forwarded calls: a Unix socket only it and its
    #: receivers use (in a directory only the server's user can enter)
    internal_target: str
    slot_names: tuple[str, ...]
    slot_bytes: int
    tls_cert: Path | None
    tls_key: Path | None
    tls_client_ca: Path | None
    auth_tokens: Path | None
    log_level: str
    #: what SIGTERM gives calls in progress (the server's --drain-seconds)
    drain_seconds: float


def forwardable(metadata: tuple[tuple[str, str | bytes], ...] | None) -> tuple[tuple[str, str | bytes], ...]:
    """A call's metadata minus what gRPC sets itself (a forwarded call sets its own)."""
    return tuple((key, value) for key, value in metadata or () if not key.startswith(RESERVED_METADATA))


def send(conn: Connection | None, message: tuple[Any, ...]) -> bool:
    """Send one message; False when the other process is gone (its reader sees that too)."""
    if conn is None:
        return False
    try:
        conn.send(message)
    except (BrokenPipeError, OSError):
        return False
    return True


def read_link(
    conn: Connection,
    loop: asyncio.AbstractEventLoop,
    on_message: Callable[[tuple[Any, ...]], None],
    on_closed: Callable[[], None],
) -> None:
    """A link thread's body: each message from `conn` handled by `on_message` on `loop`,
    then `on_closed` there once the other process is gone. Once `loop` has closed (this
    process is exiting) the thread ends and later messages are dropped."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is left to tell
                loop.call_soon_threadsafe(on_closed)
            return
        try:
            loop.call_soon_threadsafe(on_message, message)
        except RuntimeError:
            return
