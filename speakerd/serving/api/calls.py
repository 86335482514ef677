"""One unary-answered call of a method built on the recording path, from start to answer:
metrics, the log line, the request id, and every failure as its gRPC code, never UNKNOWN.

The voiceprint methods and Diarize share it: each gives its `work(tenant)` and how its own
errors become Rejections (`rejection_of`); INVALID_ARGUMENT naming the field, cancellation,
draining and server bugs (INTERNAL, with the log line) are handled here once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextvars import ContextVar
from typing import Protocol, TypeVar

import grpc
from google.protobuf.message import Message

from speakerd.model.inputs import InputError
from speakerd.serving.api.errors import Rejection, abort, cancellation, decode_stream
from speakerd.serving.api.recording import REQUEST_ID_KEY
from speakerd.serving.api.request_ids import RequestIdError, check_request_id, fresh_request_id
from speakerd.serving.observability.metrics import Metrics

log = logging.getLogger(__name__)
#: The request id of the call the current task serves ("" outside one): `served` sets it,
#: so a call's own log lines name it without passing it through every function.
CALL_REQUEST_ID: ContextVar[str] = ContextVar("speakerd_call_request_id", default="")
T = TypeVar("T")
M = TypeVar("M", bound=Message)


class CallHost(Protocol):
    """What a call needs of the server: its metrics, whether it drains, its in-flight count."""

    draining: bool
    metrics: Metrics

    def _enter(self) -> None: ...

    def _leave(self) -> None: ...


def request_id_of(context: grpc.aio.ServicerContext) -> str:
    """The x-request-id metadata when usable, else a fresh id: echoed in the response."""
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_KEY and value:
            try:
                return check_request_id(str(value), REQUEST_ID_KEY)
            except RequestIdError as error:
                raise InputError(error.field, error.message) from error
    return fresh_request_id()


def default_rejection(error: Exception) -> Rejection | None:
    """Rejection and InputError as they are; None for anything else (a server bug)."""
    if isinstance(error, Rejection):
        return error
    if isinstance(error, (InputError, RequestIdError)):
        return Rejection.invalid(error.field, error.message)
    return None


async def served(
    host: CallHost,
    method: str,
    context: grpc.aio.ServicerContext,
    work: Callable[[str], Awaitable[T]],
    tenant: Callable[[grpc.aio.ServicerContext], str],
    rejection_of: Callable[[Exception], Rejection | None] = default_rejection,
) -> T:
    """Run `work(tenant(context))` with the call's metrics and log line; a failure that
    `rejection_of` knows is answered with its code, anything else is INTERNAL."""
    started, code = time.perf_counter(), grpc.StatusCode.OK
    metrics = host.metrics
    CALL_REQUEST_ID.set("")
    host._enter()
    try:
        if host.draining:
            raise Rejection(
                grpc.StatusCode.UNAVAILABLE, "draining", "the server is draining; retry elsewhere"
            )
        CALL_REQUEST_ID.set(request_id_of(context))
        response = await work(tenant(context))
        if "request_id" in response.DESCRIPTOR.fields_by_name:  # type: ignore[attr-defined]
            # the work may have taken its request's own id (CALL_REQUEST_ID)
            response.request_id = CALL_REQUEST_ID.get()  # type: ignore[attr-defined]
        return response
    except asyncio.CancelledError:
        code, reason = cancellation(context)
        metrics.rejected.labels(reason=reason).inc()
        log.info("%s %s: %s after %.1f s, the call's work stopped", method, CALL_REQUEST_ID.get(), code.name,
                 time.perf_counter() - started)  # fmt: skip
        raise
    except grpc.aio.AbortError:
        raise
    except Exception as error:
        rejection = rejection_of(error) or default_rejection(error)
        if rejection is None:  # a server bug: INTERNAL, not UNKNOWN
            code = grpc.StatusCode.INTERNAL
            metrics.rejected.labels(reason="internal").inc()
            request_id = CALL_REQUEST_ID.get()
            log.exception("%s %s: INTERNAL unexpected %s", method, request_id, type(error).__name__)
            rejection = Rejection(
                code, "internal", f"internal error ({type(error).__name__}); see the server log"
            )
        else:
            code = rejection.code
            metrics.rejected.labels(reason=rejection.reason).inc()
            request_id = CALL_REQUEST_ID.get()
            log.log(rejection.level, "%s %s: %s %s", method, request_id, code.name, rejection.message)
        await abort(context, rejection)
        raise AssertionError("unreachable: abort raises") from error
    finally:
        metrics.request_duration.labels(method=method, code=code.name).observe(time.perf_counter() - started)
        host._leave()


async def header_and_parts(
    requests: AsyncIterator[bytes], kind: type[M]
) -> tuple[object, AsyncIterator[tuple[str, object]]]:
    """The call's header, and its other parts as (name, value) pairs: each message decoded
    as a `kind` (undecodable bytes are INVALID_ARGUMENT naming its place in the stream)."""
    decoded = decode_stream(kind, requests)
    try:
        first = await anext(decoded)
    except StopAsyncIteration:
        raise InputError("header", "the call ended before its header") from None
    if first.WhichOneof("part") != "header":  # type: ignore[attr-defined]
        raise InputError(
            "header", f"the first message must be the header, got {first.WhichOneof('part') or 'nothing'}"
        )  # type: ignore[attr-defined]

    oneof = kind.DESCRIPTOR.oneofs_by_name["part"]  # type: ignore[attr-defined]
    expected = " or ".join(f.name for f in oneof.fields if f.name != "header")

    async def rest() -> AsyncIterator[tuple[str, object]]:
        async for message in decoded:
            part = message.WhichOneof("part")  # type: ignore[attr-defined]
            if part is None:
                raise InputError("part", f"an empty message (or another method's part); set {expected}")
            yield part, getattr(message, part)

    return first.header, rest()  # type: ignore[attr-defined]
