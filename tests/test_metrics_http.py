"""/metrics stays bounded: extra connections are refused, not threaded, and idle ones closed.

Issue 14 found each idle connection to the metrics port holding a thread for as long as the
client kept it open. Two servers, so that neither check depends on timing: one limited to 2
connections with a long idle timeout is opened 12 idle connections (the 2 it serves hold
their threads, the 10 beyond read `503` and are closed); one with a short idle timeout
closes the idle connection it serves by itself. A real scrape works on both afterwards.
"""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request

from prometheus_client import CollectorRegistry, Counter

from speakerd.serving.observability.metrics_http import BUSY_RESPONSE, serve_metrics

LIMIT = 2
IDLE_CONNECTIONS = 12
#: Long enough that no held connection times out while the test runs, however slow the machine.
LONG_IDLE_S = 120.0
SHORT_IDLE_S = 0.5
#: How long a read may wait for the server's answer or close (a slow, shared CI machine).
READ_S = 60.0


def _registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    Counter("speakerd_probe", "a counter to scrape", registry=registry).inc()
    return registry


def _read_all(sock: socket.socket) -> bytes:
    sock.settimeout(READ_S)
    chunks = []
    while data := sock.recv(4096):
        chunks.append(data)
    return b"".join(chunks)


def _until(condition, what: str) -> None:
    deadline = time.monotonic() + READ_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=READ_S).read().decode()


def test_connections_beyond_the_limit_are_refused_without_a_thread() -> None:
    server, thread = serve_metrics(
        _registry(), "127.0.0.1", 0, max_connections=LIMIT, idle_timeout_s=LONG_IDLE_S
    )
    port = server.server_port
    before = threading.active_count()
    try:
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(LIMIT)]
        _until(lambda: threading.active_count() - before >= LIMIT, f"{LIMIT} connection threads")
        extra = [socket.create_connection(("127.0.0.1", port)) for _ in range(IDLE_CONNECTIONS - LIMIT)]
        answers = [_read_all(sock) for sock in extra]
        assert answers == [BUSY_RESPONSE] * len(extra), answers
        started = threading.active_count() - before
        assert started == LIMIT, f"{started} threads for {IDLE_CONNECTIONS} idle connections (limit {LIMIT})"
        for sock in [*held, *extra]:
            sock.close()
        _until(lambda: threading.active_count() - before == 0, "the held connections' threads to end")
        assert "speakerd_probe_total 1.0" in _scrape(port)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_an_idle_connection_is_closed_by_the_server() -> None:
    server, thread = serve_metrics(
        _registry(), "127.0.0.1", 0, max_connections=1, idle_timeout_s=SHORT_IDLE_S
    )
    try:
        idle = socket.create_connection(("127.0.0.1", server.server_port))
        assert _read_all(idle) == b"", "the server answered an idle connection instead of closing it"
        idle.close()
        assert "speakerd_probe_total 1.0" in _scrape(server.server_port)  # its slot is free again
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_only_the_metrics_path_is_served() -> None:
    """/metrics (with or without a query string) is the page; every other path is 404."""
    server, _ = serve_metrics(_registry(), "127.0.0.1", 0)
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        for path in ("/metrics", "/metrics?name[]=speakerd_probe_total"):
            with urllib.request.urlopen(base + path, timeout=READ_S) as answer:
                assert answer.status == 200 and b"speakerd_probe_total 1.0" in answer.read(), path
        for path in ("/", "/debug", "/metrics/", "/metricsx", "/favicon.ico"):
            try:
                urllib.request.urlopen(base + path, timeout=READ_S)
                status = 200
            except urllib.error.HTTPError as error:
                status, body = error.code, error.read()
            assert status == 404 and b"speakerd_probe" not in body, (path, status)
    finally:
        server.shutdown()
        server.server_close()
