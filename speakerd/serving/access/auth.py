"""Optional bearer-token authentication: a grpc.aio server interceptor.

With `--auth-tokens FILE` every call must carry `authorization: Bearer <token>` metadata
with one of the file's tokens (one a line; blank lines and lines starting with # are
skipped), else it gets UNAUTHENTICATED before any work is done. The file is re-read when
its size or modification time changes, so tokens rotate without a restart; an unreadable
file keeps the tokens last read. Tokens are compared with `hmac.compare_digest` against
every known token, so the time a check takes does not tell how much of a guess was right.

Health checking stays open: Kubernetes' gRPC probes send no metadata, and a replica's
health tells an outsider nothing the load balancer does not already know.
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2

log = logging.getLogger(__name__)

AUTHORIZATION_KEY = "authorization"
BEARER_PREFIX = "bearer "
#: Methods any caller may use: the health service's Check and Watch.
OPEN_PREFIXES = (f"/{health_pb2.DESCRIPTOR.services_by_name['Health'].full_name}/",)


class TokenFile:
    """The tokens of a file, re-read when the file changes (size or mtime)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._signature: tuple[int, int] | None = None
        self._tokens: tuple[bytes, ...] = ()
        self.tokens()  # read now: a bad file shows at start, not at the first call
        if not self._tokens:
            log.warning("--auth-tokens %s holds no token: every call but health is refused", path)

    def tokens(self) -> tuple[bytes, ...]:
        with self._lock:
            try:
                stat = os.stat(self.path)
                signature = (stat.st_mtime_ns, stat.st_size)
                if signature != self._signature:
                    self._tokens = parse_tokens(self.path.read_text())
                    if self._signature is not None:
                        log.info("auth tokens reloaded from %s: %d tokens", self.path, len(self._tokens))
                    self._signature = signature
            except (OSError, UnicodeDecodeError) as error:
                if self._signature is None:
                    raise
                log.warning("auth tokens not reloaded from %s, keeping the last ones: %s", self.path, error)
            return self._tokens

    def accepts(self, token: str) -> bool:
        """True when `token` is one of the file's tokens; constant time per known token."""
        given = token.encode()
        found = False
        for known in self.tokens():
            found |= hmac.compare_digest(given, known)  # no short cut: every token is compared
        return found


def parse_tokens(text: str) -> tuple[bytes, ...]:
    """One token a line; surrounding whitespace, blank lines and # comments are ignored."""
    lines = (line.strip() for line in text.splitlines())
    return tuple(line.encode() for line in lines if line and not line.startswith("#"))


def bearer_token(metadata: tuple[tuple[str, str | bytes], ...] | None) -> str | None:
    """The token of an `authorization: Bearer <token>` entry, None when there is none."""
    for key, value in metadata or ():
        if key == AUTHORIZATION_KEY and isinstance(value, str) and value.lower().startswith(BEARER_PREFIX):
            return value[len(BEARER_PREFIX) :].strip()
    return None


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that answers UNAUTHENTICATED."""

    async def abort(request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def abort_stream(request: object, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - abort raises; this makes the function an async generator

    kind = (handler.request_streaming, handler.response_streaming)
    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[kind]
    return make(abort_stream if handler.response_streaming else abort)


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for calls without a known bearer token, except OPEN_PREFIXES."""

    def __init__(self, tokens: TokenFile) -> None:
        self.tokens = tokens

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        handler = await continuation(handler_call_details)
        if handler is None or method.startswith(OPEN_PREFIXES):
            return handler
        token = bearer_token(handler_call_details.invocation_metadata)
        if token is None:
            log.info("%s: UNAUTHENTICATED, no bearer token", method)
            return _refusal(handler, "missing bearer token: send 'authorization: Bearer <token>' metadata")
        if not self.tokens.accepts(token):
            log.info("%s: UNAUTHENTICATED, unknown bearer token", method)
            return _refusal(handler, "bearer token not accepted")
        return handler
