"""/metrics stays bounded: idle connections are closed and extra ones refused, not threaded.

Issue 14 found each idle connection to the metrics port holding a thread for as long as the
client kept it open. Here a server limited to 2 connections and 1 s of idleness is opened
12 idle connections: the threads it starts stay at 2, the ten beyond them read `503` and
are closed, the idle two are closed after their timeout, and a real scrape then works.
"""

from __future__ import annotations

import socket
import threading
import time
import urllib.request

from prometheus_client import CollectorRegistry, Counter

from speakerd.serving.metrics_http import BUSY_RESPONSE, serve_metrics

LIMIT = 2
IDLE_S = 1.0
IDLE_CONNECTIONS = 12


def _read_all(sock: socket.socket, within_s: float) -> bytes:
    sock.settimeout(within_s)
    chunks = []
    while True:
        try:
            data = sock.recv(4096)
        except TimeoutError:
            return b"".join(chunks) + b"<still open>"
        if not data:
            return b"".join(chunks)
        chunks.append(data)


def test_idle_connections_are_bounded_and_closed() -> None:
    registry = CollectorRegistry()
    Counter("speakerd_probe", "a counter to scrape", registry=registry).inc()
    server, thread = serve_metrics(registry, "127.0.0.1", 0, max_connections=LIMIT, idle_timeout_s=IDLE_S)
    port = server.server_port
    before = threading.active_count()
    try:
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(IDLE_CONNECTIONS)]
        time.sleep(0.5)  # the server accepts them all
        started = threading.active_count() - before
        assert started <= LIMIT, f"{started} threads for {IDLE_CONNECTIONS} idle connections (limit {LIMIT})"
        answers = [_read_all(sock, IDLE_S * 5) for sock in idle]
        refused = sum(answer == BUSY_RESPONSE for answer in answers)
        closed_idle = sum(answer == b"" for answer in answers)
        assert refused == IDLE_CONNECTIONS - LIMIT, answers
        assert closed_idle == LIMIT, f"{closed_idle} idle connections closed by the server, expected {LIMIT}"
        for sock in idle:
            sock.close()
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert "speakerd_probe_total 1.0" in body, body[:500]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
