"""Calls that die before their answer, over a real CPU server: each is counted once, under
the reason its client saw, and none costs engine work that could still be dropped.

- Under load, calls whose deadline passes while they wait in the queue all end
  DEADLINE_EXCEEDED for their clients, and `speakerd_requests_rejected_total` counts every
  one of them as `deadline_exceeded`, none as `cancelled` (before, a fifth to a third were
  `cancelled`: the client's deadline, sent as a cancellation, beat the server's own timer).
  A call its client cancels is still `cancelled`.
- On an idle server, calls whose deadline is shorter than one plan run end
  DEADLINE_EXCEEDED and `speakerd_chunks_embedded_total` does not move: a call that cannot
  be answered in time never reaches the engine (before, each such call was embedded).
"""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from collections.abc import Iterator

import grpc
import pytest

from speakerd.serving.api.service import SERVICE_NAME
from tests.serving import ServerProcess, scrape, start_server
from tests.test_bad_inputs import _good

pytestmark = pytest.mark.slow

EMBEDDED = "speakerd_chunks_embedded_total{}"
EXPIRED = "speakerd_requests_rejected_total{reason=deadline_exceeded}"
CANCELLED = "speakerd_requests_rejected_total{reason=cancelled}"
#: Calls sent to expire in the queue, from this many threads on as many connections, each
#: of DOOMED_CHUNKS chunks: a few MB, so that a connection's later calls start (and their
#: deadlines reach the server) only once its earlier calls' bytes are through.
DOOMED_CALLS = 48
SENDERS = 8
DOOMED_CHUNKS = 8
#: Their deadline: far shorter than the backlog of 8-chunk requests ahead of them.
DOOMED_TIMEOUT_S = 1.5
#: The backlog: 8-chunk requests (a CPU b8 run is ~1 s or more on 2 cores), no deadline.
BACKLOG_REQUESTS = 6
#: Calls in flight on one connection in the refused-stream test: the server's
#: MAX_CONCURRENT_STREAMS, each expiring in the queue, for REFUSAL_CALLS calls in all.
IN_FLIGHT = 32
REFUSAL_CALLS = 160
#: Deadlines the issue's probe used on an idle server.
SHORT_DEADLINES_MS = (5, 10, 20, 50, 100, 200)
SETTLE_S = 120.0


@pytest.fixture(scope="module")
def server(weights_path) -> Iterator[ServerProcess]:
    running = start_server(weights_path, "--plans", "1,8")
    yield running
    assert running.terminate() == 0, running.log()


def _embed(server: ServerProcess):
    channel = grpc.insecure_channel(server.target)
    return channel, channel.unary_unary(f"/{SERVICE_NAME}/EmbedChunks")


def _settled(server: ServerProcess) -> dict[str, float]:
    """/metrics once no call is in flight and nothing is queued."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        samples = scrape(server)
        if not samples.get("speakerd_inflight_requests{}") and not samples.get(
            "speakerd_queue_depth_chunks{}"
        ):
            return samples
        assert time.monotonic() < deadline, "the server did not settle"
        time.sleep(0.2)


def _b1_ms(server: ServerProcess) -> float:
    """The b1 plan time the server measured at start (its log line)."""
    match = re.search(r"plan times .*?b1 (\d+\.\d+) ms", server.log())
    assert match, server.log()
    return float(match[1])


def _backlog(server: ServerProcess):
    """(channel, futures) of BACKLOG_REQUESTS 8-chunk calls without a deadline."""
    channel, call = _embed(server)
    raw = _good(8).SerializeToString()
    futures = [call.future(raw, timeout=600) for _ in range(BACKLOG_REQUESTS)]
    time.sleep(0.5)  # queued ahead of every call sent after
    return channel, futures


def test_calls_expired_in_the_queue_are_counted_as_expired(server: ServerProcess) -> None:
    before = _settled(server)
    backlog_channel, backlog = _backlog(server)
    seen: Counter[str] = Counter()
    lock = threading.Lock()

    def send(count: int) -> None:
        channel, call = _embed(server)
        raw = _good(DOOMED_CHUNKS).SerializeToString()
        futures = [call.future(raw, timeout=DOOMED_TIMEOUT_S) for _ in range(count)]
        for future in futures:
            try:
                future.result()
                code = "OK"
            except grpc.RpcError as error:
                code = error.code().name
                if code != "DEADLINE_EXCEEDED":
                    print(code, error.details())
            with lock:
                seen[code] += 1
        channel.close()

    senders = [threading.Thread(target=send, args=(DOOMED_CALLS // SENDERS,)) for _ in range(SENDERS)]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join()
    for future in backlog:
        future.result()
    backlog_channel.close()
    after = _settled(server)
    expired, cancelled = after[EXPIRED] - before[EXPIRED], after[CANCELLED] - before[CANCELLED]
    print(f"clients saw {dict(seen)}; counted deadline_exceeded {expired:.0f}, cancelled {cancelled:.0f}")
    assert seen == {"DEADLINE_EXCEEDED": DOOMED_CALLS}, seen
    assert (expired, cancelled) == (DOOMED_CALLS, 0)


def test_no_stream_is_refused_with_32_calls_in_flight_on_one_connection(server: ServerProcess) -> None:
    """A raw grpc client (no retries) keeping MAX_CONCURRENT_STREAMS calls in flight on one
    connection, each expiring in the queue, never sees UNAVAILABLE (RST_STREAM code 7)."""
    _settled(server)
    backlog_channel, backlog = _backlog(server)
    channel, call = _embed(server)
    raw = _good().SerializeToString()
    seen: Counter[str] = Counter()
    details: set[str] = set()
    in_flight: list[grpc.Future] = []
    for _ in range(REFUSAL_CALLS):
        in_flight.append(call.future(raw, timeout=0.3))
        while len(in_flight) >= IN_FLIGHT:
            finished = [future for future in in_flight if future.done()]
            if not finished:
                time.sleep(0.005)
                continue
            for future in finished:
                in_flight.remove(future)
                error = future.exception()
                seen["OK" if error is None else error.code().name] += 1
                if error is not None and error.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    details.add(error.details())
    for future in in_flight:
        error = future.exception()
        seen["OK" if error is None else error.code().name] += 1
    for future in backlog:
        future.result()
    channel.close()
    backlog_channel.close()
    _settled(server)
    print(f"{REFUSAL_CALLS} calls, {IN_FLIGHT} in flight on one connection: {dict(seen)} {details}")
    assert "UNAVAILABLE" not in seen, details
    assert sum(seen.values()) == REFUSAL_CALLS


def _in_flight(server: ServerProcess, calls: int) -> None:
    """Wait until the server has `calls` calls in flight (its gauge), so a call sent after
    another is known to have reached the server behind it."""
    deadline = time.monotonic() + SETTLE_S
    while scrape(server).get("speakerd_inflight_requests{}", 0) < calls:
        assert time.monotonic() < deadline, f"the server never had {calls} calls in flight"
        time.sleep(0.05)


def test_a_call_its_client_cancels_is_counted_as_cancelled(server: ServerProcess) -> None:
    before = _settled(server)
    backlog_channel, backlog = _backlog(server)
    _in_flight(server, BACKLOG_REQUESTS)
    channel, call = _embed(server)
    cancelled = call.future(_good().SerializeToString(), timeout=600)
    _in_flight(server, BACKLOG_REQUESTS + 1)  # queued behind seconds of 8-chunk batches
    cancelled.cancel()
    for future in backlog:
        future.result()
    channel.close()
    backlog_channel.close()
    after = _settled(server)
    assert after[CANCELLED] - before[CANCELLED] == 1
    assert after[EXPIRED] == before[EXPIRED]


def test_calls_that_cannot_finish_in_time_cost_no_engine_work(server: ServerProcess) -> None:
    b1_ms = _b1_ms(server)
    deadlines = [ms for ms in SHORT_DEADLINES_MS if ms < b1_ms / 2] or [1]
    channel, call = _embed(server)
    raw = _good().SerializeToString()
    before = _settled(server)
    codes = Counter()
    for ms in deadlines * 3:
        try:
            call(raw, timeout=ms / 1e3)
            codes["OK"] += 1
        except grpc.RpcError as error:
            codes[error.code().name] += 1
        time.sleep(0.05)
    channel.close()
    after = _settled(server)
    embedded = after[EMBEDDED] - before[EMBEDDED]
    print(f"b1 {b1_ms:.1f} ms; deadlines {deadlines} ms x3: {dict(codes)}; chunks embedded {embedded:.0f}")
    assert codes == {"DEADLINE_EXCEEDED": 3 * len(deadlines)}, codes
    assert embedded == 0
