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

import functools
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator

import grpc
import pytest

from speakerd.serving.api.service import SERVICE_NAME
from tests.serving import ServerProcess, scrape, start_server, wait_until
from tests.test_bad_inputs import _good

pytestmark = pytest.mark.slow

EMBEDDED = "speakerd_chunks_embedded_total{}"
TAKEN = "speakerd_queue_wait_seconds_count{}"  # calls whose first chunks left the queue
QUEUED = "speakerd_queue_depth_chunks{}"
EXPIRED = "speakerd_requests_rejected_total{reason=deadline_exceeded}"
CANCELLED = "speakerd_requests_rejected_total{reason=cancelled}"
#: Calls sent to expire in the queue, from this many threads on as many connections, each
#: of DOOMED_CHUNKS chunks: a few MB, so that a connection's later calls start (and their
#: deadlines reach the server) only once its earlier calls' bytes are through.
DOOMED_CALLS = 48
SENDERS = 8
DOOMED_CHUNKS = 8
#: Their deadline: far shorter than the backlog ahead of them.
DOOMED_TIMEOUT_S = 1.5
#: The server's one plan. A backlog call is one full batch of BATCH chunks, so that no two
#: share a batch and none is split (a split call's rest queues behind the calls that came
#: after it). A call behind the backlog finds every engine worker busy until all but the
#: last PIPELINE_DEPTH - 1 backlog batches have run: those are held by the other workers
#: and run after it. With b8 batches (~2 s each on CPU) that was 4 s of engine work a
#: backlog paid for nothing, with b2 1 s; b1 makes it 0.5 s, and the server's self-check
#: one chunk instead of three.
PLANS = "1"
BATCH = 1
#: Backlog calls ahead of each test's dead calls (no deadline), sized by what each must
#: outlast, measured on 2 cores (each test prints it): the 48 doomed calls had all ended
#: 1.8 s after their backlog began (their 1.5 s deadline after their bytes); 24 chunks of
#: protection are 2.9 s even at 0.12 s a chunk (cpu.py's figure; 0.26 s on the development
#: machine). The 160 short calls took 0.5 s and the cancellation 0.2 s: 12 and 6 chunks
#: leave them several times that. Each backlog is that protection plus the PIPELINE_DEPTH
#: - 1 = 2 batches run after the dead calls. (Six 8-chunk calls each, 144 chunks; b2
#: backlogs of the same protection, 54; these are 48.)
EXPIRED_BACKLOG = 26
REFUSAL_BACKLOG = 14
CANCEL_BACKLOG = 8
#: Calls in flight on one connection in the refused-stream test: the server's
#: MAX_CONCURRENT_STREAMS, each expiring in the queue, for REFUSAL_CALLS calls in all.
IN_FLIGHT = 32
REFUSAL_CALLS = 160
#: Deadlines the issue's probe used on an idle server.
SHORT_DEADLINES_MS = (5, 10, 20, 50, 100, 200)
SETTLE_S = 120.0


@pytest.fixture(scope="module")
def server(weights_path) -> Iterator[ServerProcess]:
    running = start_server(weights_path, "--plans", PLANS)
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


_wait = functools.partial(wait_until, timeout_s=SETTLE_S)


def _backlog(server: ServerProcess, requests: int):
    """(channel, futures) of `requests` calls of one full batch each, without a deadline,
    once every one of them is with the batcher (on a worker or queued): ahead of every call
    sent after."""
    before = scrape(server)
    channel, call = _embed(server)
    raw = _good(BATCH).SerializeToString()
    futures = [call.future(raw, timeout=600) for _ in range(requests)]

    def submitted() -> bool:
        now = scrape(server)
        taken = now.get(TAKEN, 0) - before.get(TAKEN, 0)
        return taken + now.get(QUEUED, 0) / BATCH >= requests

    _wait(submitted, f"{requests} backlog calls with the batcher")
    return channel, futures


def _left(server: ServerProcess, before: dict[str, float], backlog: int, began: float) -> str:
    """How much of the backlog's engine work was still to run (for the test's output)."""
    embedded = scrape(server)[EMBEDDED] - before[EMBEDDED]
    chunks, elapsed = backlog * BATCH, time.monotonic() - began
    return f"{elapsed:.2f} s after the backlog began, {chunks - embedded:.0f} of its {chunks} chunks to run"


def test_calls_expired_in_the_queue_are_counted_as_expired(server: ServerProcess) -> None:
    before = _settled(server)
    began = time.monotonic()
    backlog_channel, backlog = _backlog(server, EXPIRED_BACKLOG)
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
    left = _left(server, before, EXPIRED_BACKLOG, began)
    for future in backlog:
        future.result()
    backlog_channel.close()
    after = _settled(server)
    expired, cancelled = after[EXPIRED] - before[EXPIRED], after[CANCELLED] - before[CANCELLED]
    print(f"clients saw {dict(seen)}; counted deadline_exceeded {expired:.0f}, cancelled {cancelled:.0f}; "
          f"when the last ended, {left}")  # fmt: skip
    assert seen == {"DEADLINE_EXCEEDED": DOOMED_CALLS}, (seen, f"when the last ended, {left}")
    assert (expired, cancelled) == (DOOMED_CALLS, 0)


def test_no_stream_is_refused_with_32_calls_in_flight_on_one_connection(server: ServerProcess) -> None:
    """A raw grpc client (no retries) keeping MAX_CONCURRENT_STREAMS calls in flight on one
    connection, each expiring in the queue, never sees UNAVAILABLE (RST_STREAM code 7)."""
    before = _settled(server)
    began = time.monotonic()
    backlog_channel, backlog = _backlog(server, REFUSAL_BACKLOG)
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
    left = _left(server, before, REFUSAL_BACKLOG, began)
    for future in backlog:
        future.result()
    channel.close()
    backlog_channel.close()
    _settled(server)
    print(f"{REFUSAL_CALLS} calls, {IN_FLIGHT} in flight on one connection: {dict(seen)} {details}; "
          f"when the last ended, {left}")  # fmt: skip
    assert "UNAVAILABLE" not in seen, details
    assert sum(seen.values()) == REFUSAL_CALLS


def _behind(server: ServerProcess, backlog: list[grpc.Future]) -> None:
    """Wait until the server has one call in flight besides the backlog's unanswered calls
    (its gauge), so the call sent after the backlog is known to have reached the server
    behind it."""

    def arrived() -> bool:
        pending = sum(not future.done() for future in backlog)  # counted before the gauge is read
        return scrape(server).get("speakerd_inflight_requests{}", 0) >= pending + 1

    _wait(arrived, "the call sent after the backlog at the server")


def test_a_call_its_client_cancels_is_counted_as_cancelled(server: ServerProcess) -> None:
    before = _settled(server)
    began = time.monotonic()
    backlog_channel, backlog = _backlog(server, CANCEL_BACKLOG)
    channel, call = _embed(server)
    cancelled = call.future(_good().SerializeToString(), timeout=600)
    _behind(server, backlog)
    cancelled.cancel()
    left = _left(server, before, CANCEL_BACKLOG, began)
    for future in backlog:
        future.result()
    channel.close()
    backlog_channel.close()
    after = _settled(server)
    print(f"when the call was cancelled, {left}")
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
