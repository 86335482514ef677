"""The /metrics HTTP endpoint, bounded: a few threads, and idle connections closed.

Why not prometheus_client's `start_http_server`: it serves each connection on a thread of
its own for as long as the client keeps it open, so every idle connection to the metrics
port held a thread (a scanner or a misbehaving scraper could hold hundreds). Here a
connection is served by at most MAX_CONNECTIONS threads at once; one more is answered
`503` and closed at once, and a connection idle for IDLE_TIMEOUT_S is closed. Only
/metrics is served; every other path is 404. A scrape
takes milliseconds and Prometheus opens one connection per target, so neither limit is
ever near for it.
"""

from __future__ import annotations

import contextlib
import socket
import socketserver
import sys
import threading
from collections.abc import Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app

#: Connections served at once; Prometheus needs one, a person with curl another.
MAX_CONNECTIONS = 8
#: Seconds a connection may sit without sending a full request before it is closed.
IDLE_TIMEOUT_S = 10.0
#: What a connection beyond MAX_CONNECTIONS reads before it is closed.
_BUSY_BODY = b"too many connections to /metrics; retry\n"
BUSY_RESPONSE = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nConnection: close\r\n"
    + f"Content-Length: {len(_BUSY_BODY)}\r\n\r\n".encode()
    + _BUSY_BODY
)


class _Handler(WSGIRequestHandler):
    """Quiet (no access log on stderr), with a socket timeout for idle connections."""

    def log_message(self, format: str, *args: object) -> None:
        pass


class BoundedMetricsServer(socketserver.ThreadingMixIn, WSGIServer):
    """A threaded WSGI server that serves at most `max_connections` connections at once."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], max_connections: int, idle_timeout_s: float) -> None:
        self.slots = threading.BoundedSemaphore(max_connections)
        handler = type("Handler", (_Handler,), {"timeout": idle_timeout_s})
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.address_family = family
        super().__init__(address, handler)

    def process_request(self, request, client_address) -> None:
        if not self.slots.acquire(blocking=False):
            with contextlib.suppress(OSError):
                request.sendall(BUSY_RESPONSE)
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def handle_error(self, request, client_address) -> None:
        """An idle connection timing out, or a client hanging up, is routine: no traceback."""
        error = sys.exc_info()[1]
        if isinstance(error, TimeoutError | ConnectionError):
            return
        super().handle_error(request, client_address)

    def process_request_thread(self, request, client_address) -> None:
        """ThreadingMixIn's, with the slot given back before the connection is closed: a
        client that sees its connection end may connect again at once and must find the
        slot free (released after the close, a quick reconnect was refused with 503)."""
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.slots.release()
            self.shutdown_request(request)


#: The one path served: Prometheus scrapes /metrics by default (its metrics_path); anything
#: else is 404, so a scanner or a typo learns nothing and a wrong scrape config fails loudly.
METRICS_PATH = "/metrics"
_NOT_FOUND_BODY = b"not found; the metrics are at /metrics\n"


def only_metrics(app: Callable) -> Callable:
    """`app` on METRICS_PATH (any query string), 404 on every other path."""

    def routed(environ: dict, start_response: Callable) -> Iterable[bytes]:
        if environ.get("PATH_INFO", "") == METRICS_PATH:
            return app(environ, start_response)
        headers = [
            ("Content-Type", "text/plain; charset=utf-8"),
            ("Content-Length", str(len(_NOT_FOUND_BODY))),
        ]
        start_response("404 Not Found", headers)
        return [_NOT_FOUND_BODY]

    return routed


def serve_metrics(
    registry: CollectorRegistry,
    host: str,
    port: int,
    max_connections: int = MAX_CONNECTIONS,
    idle_timeout_s: float = IDLE_TIMEOUT_S,
) -> tuple[BoundedMetricsServer, threading.Thread]:
    """Serve `registry` on host:port (0 = a free port) from a daemon thread."""
    server = BoundedMetricsServer((host, port), max_connections, idle_timeout_s)
    server.set_app(only_metrics(make_wsgi_app(registry)))
    thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    return server, thread
