"""How a failed call is answered: one gRPC code, one metrics reason, a message, and for
INVALID_ARGUMENT a `google.rpc.BadRequest` detail naming the field.

The message is for people (it starts with the field's name); the detail is for programs:
a client reads it with `grpc_status.rpc_status.from_call(error)` and finds the field
violation without parsing text. Both say the same thing, built from one Rejection.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import TypeVar

import grpc
from google.protobuf import any_pb2
from google.protobuf.message import DecodeError, Message
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from speakerd.serving.batching import queue

#: Longest message sent to a client. gRPC carries it in a trailer, and trailers past the
#: peer's metadata limit (8 KiB by default) end the call as RESOURCE_EXHAUSTED instead of
#: the code meant: every message built here stays far below that, this makes sure of it.
MAX_MESSAGE_CHARS = 1024


class Rejection(Exception):
    """A call answered with a gRPC error: code, metrics reason and a message for the client.

    `field` (with `expected`, what the field should have been) is set for INVALID_ARGUMENT
    and becomes the BadRequest field violation; the message is "field: expected".
    """

    def __init__(
        self, code: grpc.StatusCode, reason: str, message: str, field: str = "", expected: str = ""
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.field = field
        self.expected = expected
        self.given_id = ""  # the request's own request_id, when parsing got that far
        self.request_id = ""  # the id the call is logged under, set by the service
        #: bytes that are no protobuf message of the method's type: a broken or hostile
        #: client rather than a mistake in one field, logged at WARNING (see `level`)
        self.malformed = False

    @classmethod
    def invalid(cls, field: str, expected: str) -> Rejection:
        """INVALID_ARGUMENT for `field`, saying what was expected of it."""
        return cls(
            grpc.StatusCode.INVALID_ARGUMENT, "invalid_argument", f"{field}: {expected}", field, expected
        )

    @classmethod
    def undecodable(cls, field: str, expected: str) -> Rejection:
        """INVALID_ARGUMENT for bytes that do not decode as the message they should be."""
        rejection = cls.invalid(field, expected)
        rejection.malformed = True
        return rejection

    @property
    def level(self) -> int:
        """The log level of the call's one line: ERROR for the server's own faults, WARNING
        for undecodable bytes, INFO for every other refusal (a client's everyday mistake)."""
        if self.code == grpc.StatusCode.INTERNAL:
            return logging.ERROR
        return logging.WARNING if self.malformed else logging.INFO

    def status(self, prefix: str = "") -> grpc.Status:
        """The status to abort with: `prefix` (e.g. a stream position) before the message."""
        message = _bounded(prefix + self.message)
        status = status_pb2.Status(code=_rpc_code(self.code), message=message)
        if self.field:
            violation = error_details_pb2.BadRequest.FieldViolation(
                field=self.field, description=_bounded(self.expected)
            )
            detail = any_pb2.Any()
            detail.Pack(error_details_pb2.BadRequest(field_violations=[violation]))
            status.details.append(detail)
        return rpc_status.to_status(status)


M = TypeVar("M", bound=Message)


def decode_message(kind: type[M], raw: bytes, position: str = "") -> M:
    """`raw` parsed as a `kind` message; Rejection (INVALID_ARGUMENT, malformed) naming the
    message, and `position` (a stream's message number) when given, otherwise.

    Why not the handler's `request_deserializer`: gRPC answers a deserializer's failure
    itself, as UNKNOWN for a unary call and as an exception inside a stream's iterator (which
    became INTERNAL), without the BadRequest detail, the log line or the metric every other
    refusal gets."""
    name = kind.DESCRIPTOR.name
    try:
        return kind.FromString(raw)
    except DecodeError as error:
        where = f"{position} ({len(raw)} bytes)" if position else f"{len(raw)} bytes"
        why = str(error).rpartition(": ")[2]  # protobuf's reason, without its type name again
        raise Rejection.undecodable(
            name, f"{where}: not a valid {kind.DESCRIPTOR.full_name} ({why})"
        ) from None


async def decode_stream(kind: type[M], raws: AsyncIterator[bytes]) -> AsyncIterator[M]:
    """A client stream's messages, each parsed as a `kind` (decode_message), the Rejection
    of an undecodable one naming its place in the stream."""
    index = 0
    async for raw in raws:
        yield decode_message(kind, raw, f"message {index} of the stream")
        index += 1


#: The code each batcher error is answered with; its metrics reason is the error's own.
BATCHER_CODES: dict[type[queue.BatcherError], grpc.StatusCode] = {
    queue.QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    queue.DeadlinePassed: grpc.StatusCode.DEADLINE_EXCEEDED,
    queue.Draining: grpc.StatusCode.UNAVAILABLE,
    queue.NoDevice: grpc.StatusCode.UNAVAILABLE,
    queue.EngineFailed: grpc.StatusCode.INTERNAL,
    queue.Cancelled: grpc.StatusCode.CANCELLED,
}


def batcher_rejection(error: queue.BatcherError, prefix: str = "") -> Rejection:
    """The answer to a request the batcher could not serve; `prefix` places it (windows).
    A subclass is answered as its nearest listed base (a recording's lost device, NoDevice's)."""
    listed = (BATCHER_CODES[kind] for kind in type(error).__mro__ if kind in BATCHER_CODES)
    code = next(listed, grpc.StatusCode.INTERNAL)
    return Rejection(code, error.reason, prefix + str(error))


def _rpc_code(code: grpc.StatusCode) -> int:
    """grpc.StatusCode -> its google.rpc.Code number (the same numbering)."""
    return code_pb2.Code.Value(code.name)


def _bounded(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 3] + "..."


async def abort(context: grpc.aio.ServicerContext, rejection: Rejection, prefix: str = "") -> None:
    """End the call with `rejection`'s status and details (raises, as context.abort does).

    The rejection's traceback and causes are dropped first: gRPC keeps the AbortError that
    context.abort raises in a reference cycle, and through the rejection's traceback it
    held the frames that hold the call's request bytes, so every refused call's message
    stayed in memory until the next full garbage collection (measured: 10 refused 8 MiB
    calls kept 88 MB that only gc.collect freed; under repeated floods the peak grew with
    each). The handler deletes its own reference to the bytes before calling this."""
    status = rejection.status(prefix)
    rejection.__traceback__ = rejection.__cause__ = rejection.__context__ = None
    await context.abort(status.code, status.details, status.trailing_metadata)


#: A call cancelled with at most this much of its deadline left is counted as expired: gRPC
#: cancels the handler when the client's deadline passes, and the server's clock then still
#: shows a few milliseconds (seen in tests: 55 of 60 expired calls had time "remaining").
DEADLINE_SLACK_S = 0.05
#: ... or with at most this share of the time it had on arrival left. The server's copy of
#: the deadline starts when the call's headers are read, the client's when the call starts:
#: a client sending several large messages on one connection queues the later calls'
#: headers behind the earlier calls' bytes, so its deadline (sent to the server as a
#: cancellation) can come hundreds of milliseconds before the server's own. Seen: 18-22 of
#: 68 calls that expired in the queue counted as `cancelled`. A client that cancels in
#: the last quarter of its deadline is counted as expired; one that cancels earlier (a
#: person pressing Ctrl-C, a stream given up) is not.
DEADLINE_SLACK_SHARE = 0.25


def cancellation(
    context: grpc.aio.ServicerContext, budget_s: float | None = None
) -> tuple[grpc.StatusCode, str]:
    """(code, rejected_total reason) of a call whose handler was cancelled: its deadline
    passed (DEADLINE_EXCEEDED) or its client went away (CANCELLED). `budget_s`: the time
    the call had left when its handler started (None: no deadline)."""
    remaining = context.time_remaining()
    slack = (
        max(DEADLINE_SLACK_S, DEADLINE_SLACK_SHARE * budget_s) if budget_s is not None else DEADLINE_SLACK_S
    )
    if remaining is not None and remaining <= slack:
        return grpc.StatusCode.DEADLINE_EXCEEDED, "deadline_exceeded"
    return grpc.StatusCode.CANCELLED, "cancelled"
