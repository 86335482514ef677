"""Requests that fail cleanly: every bad input class over the real gRPC server (CPU engine).

Each row of BAD is sent alone as a unary call and as a one-message stream, and must come
back with its code, a message that names the field, and a `google.rpc.BadRequest` detail
naming the same field (what a program reads instead of parsing text), while a good client
calls the same server in parallel and is never harmed. The rows are the classes a tester
found ending in UNKNOWN, in OK, or in a retryable code, next to the classic ones (shape,
dtype, byte length, NaN). Then the stream's rules: nothing sent after a failed request is
embedded, and a stream cancelled with its window full starts no further request.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from speakerd.client.client import build_request
from speakerd.model.architecture import CHUNK_SAMPLES, FRAMES, MEL_BINS
from speakerd.model.inputs import MAX_FBANK_MAGNITUDE
from speakerd.serving.api.request_ids import MAX_REQUEST_ID_CHARS
from speakerd.serving.api.service import SERVICE_NAME, STREAM_WINDOW
from speakerd.serving.memory.budget import ByteBudget
from speakerd.v1 import speakerd_pb2 as pb
from speakerd.v1.tensors import to_tensor
from tests.serving import ServerProcess, scrape, start_server

pytestmark = pytest.mark.slow  # a CPU server: seconds of 2 cores a test

#: b8 keeps a CPU batch near 1 s: long enough that a 64-chunk request holds a stream's
#: window full for seconds (8 batches on 3 workers sharing 2 cores).
PLANS = "1,8"
#: The server's queue, in chunks: one more makes a request that can never be served.
QUEUE_CHUNKS = 96
SLOW_CHUNKS = 64
MESSAGE_BYTES = 64 * 1024 * 1024
#: The good neighbour's request: one chunk keeps a call in flight for an engine run, far
#: longer than a bad call takes to be refused; each row of BAD pays for its neighbour's chunks.
NEIGHBOUR_CHUNKS = 1
#: Starts a log line of its own if a request id's newline reached the log unescaped.
FORGED = "FORGED-LOG-LINE"
CALL_TIMEOUT_S = 120.0


def _good(chunks: int = 1, request_id: str = "") -> pb.EmbedRequest:
    fbank = np.random.default_rng(chunks).standard_normal((chunks, FRAMES, MEL_BINS), dtype=np.float32)
    return build_request(np.ones((chunks, 3, 589), np.float32), fbank=fbank, request_id=request_id)


def _bytes(request: pb.EmbedRequest) -> bytes:
    return request.SerializeToString()


def _with_fbank(tensor: pb.Tensor, request_id: str = "") -> bytes:
    request = _good(request_id=request_id)
    request.fbank.CopyFrom(tensor)
    return _bytes(request)


@dataclass(frozen=True)
class Bad:
    raw: bytes
    field: str
    code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT
    request_id: str = ""  # sent as x-request-id metadata when set


def bad_inputs() -> dict[str, Bad]:
    fbank = np.zeros((1, FRAMES, MEL_BINS), np.float32)
    nan = fbank.copy()
    nan[0, 5, 7] = np.nan
    masks = np.ones((1, 3, 589), np.float32)
    inf_masks = masks.copy()
    inf_masks[0, 0, 0] = np.inf
    truncated = _good()
    truncated.fbank.data = truncated.fbank.data[:-4]
    return {
        # the classic classes
        "fbank frames": Bad(_bytes(build_request(masks, fbank=fbank[:, :997])), "fbank"),
        "fbank dtype": Bad(_with_fbank(to_tensor(np.zeros((1, FRAMES, MEL_BINS), np.uint8))), "fbank"),
        "fbank bytes": Bad(_bytes(truncated), "fbank"),
        "fbank NaN": Bad(_bytes(build_request(masks, fbank=nan)), "fbank"),
        "masks Inf": Bad(_bytes(build_request(inf_masks, fbank=fbank)), "masks"),
        "masks speakers": Bad(_bytes(build_request(np.ones((1, 4, 589), np.float32), fbank=fbank)), "masks"),
        "no features": Bad(_bytes(pb.EmbedRequest(masks=to_tensor(masks))), "features"),
        "no masks": Bad(_bytes(pb.EmbedRequest(fbank=to_tensor(fbank))), "masks"),
        "cut short": Bad(_bytes(_good())[:-100], "masks"),
        # were UNKNOWN: an int64-overflowing element count, and recursion in group skipping
        "shape overflows int64": Bad(
            _with_fbank(pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[2**32, 2**32], data=b"")), "fbank"
        ),
        "groups nested 5000 deep": Bad(b"\x2b" * 5000 + b"\x2c" * 5000 + _bytes(_good()), "request"),
        # was OK: float16 audio, and an fbank whose embedding is 768 NaN values
        "waveform float16": Bad(
            _bytes(
                pb.EmbedRequest(
                    waveform=to_tensor(np.zeros((1, CHUNK_SAMPLES), np.float16)), masks=to_tensor(masks)
                )
            ),
            "waveform",
        ),
        "fbank 3e38": Bad(_bytes(build_request(masks, fbank=np.full_like(fbank, 3e38))), "fbank"),
        # was OK, forging a log line; then one that overflowed an error's trailer
        "request_id newline": Bad(_bytes(_good(request_id=f"id\n{FORGED} by a client")), "request_id"),
        "request_id 10,000 chars": Bad(
            _bytes(build_request(masks, fbank=nan, request_id="x" * 10_000)), "request_id"
        ),
        "x-request-id too long": Bad(_bytes(_good()), "x-request-id", request_id="m" * 1000),
        # a bounded parse: refused at its 1,001st field, not seconds later for lacking features
        "4 MiB of tiny fields": Bad(b"\x28\x00" * (2 * 1024 * 1024), "request"),
        "5-dimension masks": Bad(
            _bytes(pb.EmbedRequest(fbank=to_tensor(fbank), masks=pb.Tensor(dtype=1, shape=[1] * 5))),
            "masks.shape",
        ),
        # can never fit: a code clients do not retry, naming the limit and the size
        "more chunks than the queue": Bad(
            _bytes(
                build_request(
                    np.ones((QUEUE_CHUNKS + 1, 1, 9), np.uint8),
                    fbank=np.zeros((QUEUE_CHUNKS + 1, FRAMES, MEL_BINS), np.float16),
                )
            ),
            "fbank",
        ),
    }


@pytest.fixture(scope="module")
def server(weights_path):
    running = start_server(weights_path, "--plans", PLANS, "--queue-chunks", str(QUEUE_CHUNKS))
    yield running
    assert running.terminate() == 0, running.log()


@pytest.fixture(scope="module")
def channel(server: ServerProcess) -> Iterator[grpc.Channel]:
    options = [
        ("grpc.max_send_message_length", MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MESSAGE_BYTES),
    ]
    with grpc.insecure_channel(server.target, options=options) as opened:
        yield opened


def unary(channel: grpc.Channel):
    return channel.unary_unary(
        f"/{SERVICE_NAME}/EmbedChunks", response_deserializer=pb.EmbedResponse.FromString
    )


def stream(channel: grpc.Channel):
    return channel.stream_stream(
        f"/{SERVICE_NAME}/EmbedChunksStream", response_deserializer=pb.EmbedResponse.FromString
    )


def _metadata(request_id: str) -> tuple[tuple[str, str], ...]:
    return (("x-request-id", request_id),) if request_id else ()


def field_violations(error: grpc.RpcError) -> list[tuple[str, str]]:
    """(field, description) of the error's google.rpc.BadRequest detail; [] without one."""
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    found = []
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            found += [(v.field, v.description) for v in bad.field_violations]
    return found


def check_error(name: str, error: grpc.RpcError, bad: Bad, prefix: str = "") -> None:
    code, details = error.code(), error.details() or ""
    print(f"{name:<28} {code.name:<18} {details[:150]}")
    assert code == bad.code, f"{name}: {code.name}, expected {bad.code.name}: {details}"
    names = f"): {bad.field}: " in details if prefix else details.startswith(f"{bad.field}: ")
    assert details.startswith(prefix) and names, f"{name}: {details!r} does not name {bad.field}"
    violations = field_violations(error)
    assert len(violations) == 1, f"{name}: BadRequest field violations {violations}"
    field, description = violations[0]
    assert field == bad.field and description, f"{name}: violation {violations[0]}, expected {bad.field}"
    assert details.endswith(description), f"{name}: message {details!r} and detail {description!r} differ"


def wait_for(server: ServerProcess, key: str, satisfied, timeout_s: float = CALL_TIMEOUT_S) -> float:
    """Poll /metrics until `satisfied(value of key)`; the value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = scrape(server).get(key, 0.0)
        if satisfied(value):
            return value
        assert time.monotonic() < deadline, f"{key} stayed {value} for {timeout_s} s"
        time.sleep(0.05)


def settled(server: ServerProcess) -> dict[str, float]:
    """/metrics once no call is in flight and the queue is empty (cancelled work is dropped)."""
    wait_for(server, "speakerd_inflight_requests{}", lambda v: v == 0)
    wait_for(server, "speakerd_queue_depth_chunks{}", lambda v: v == 0)
    time.sleep(1.0)  # room for a batch that was already running when its caller went away
    return scrape(server)


class GoodNeighbour:
    """Good calls in a loop on their own channel while a bad one is being answered; on exit
    it finishes the call in progress (at least one)."""

    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.results: list[np.ndarray] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        with grpc.insecure_channel(self.server.target) as channel:
            call = unary(channel)
            while not self._stop.is_set() or not (self.results or self.errors):
                try:
                    response = call(_bytes(_good(NEIGHBOUR_CHUNKS, "neighbour")), timeout=CALL_TIMEOUT_S)
                    array = np.frombuffer(response.embeddings.data, np.float32)
                    self.results.append(array.reshape(tuple(response.embeddings.shape)))
                except grpc.RpcError as error:
                    self.errors.append(f"{error.code().name}: {error.details()}")

    def __enter__(self) -> GoodNeighbour:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def check(self, reference: np.ndarray) -> None:
        assert not self.errors, f"the good neighbour failed: {self.errors}"
        assert self.results, "the good neighbour finished no call"
        for result in self.results:
            assert np.array_equal(result, reference), "the good neighbour's rows changed"


BAD = bad_inputs()


@pytest.fixture(scope="module")
def neighbour_rows(channel: grpc.Channel) -> np.ndarray:
    """What the good neighbour's request embeds to, asked alone."""
    response = unary(channel)(_bytes(_good(NEIGHBOUR_CHUNKS)), timeout=CALL_TIMEOUT_S)
    rows = np.frombuffer(response.embeddings.data, np.float32).reshape(tuple(response.embeddings.shape))
    assert rows.shape == (NEIGHBOUR_CHUNKS, 3, 256) and np.isfinite(rows).all(), rows.shape
    return rows


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_fails_cleanly(
    name: str, server: ServerProcess, channel: grpc.Channel, neighbour_rows: np.ndarray
) -> None:
    """Unary and stream: the code, the field in the message and in the BadRequest detail,
    counted under that code; a good call running meanwhile gets its own rows."""
    bad = BAD[name]
    key = "speakerd_request_duration_seconds_count{code=INVALID_ARGUMENT,method=EmbedChunks}"
    before = scrape(server).get(key, 0.0)
    with GoodNeighbour(server) as neighbour:
        with pytest.raises(grpc.RpcError) as raised:
            unary(channel)(bad.raw, timeout=CALL_TIMEOUT_S, metadata=_metadata(bad.request_id))
        print()
        check_error(name, raised.value, bad)
        counted = scrape(server).get(key, 0.0) - before  # observed before the call was answered
        assert counted == 1, f"{name}: counted {counted} times under code=INVALID_ARGUMENT"
        with pytest.raises(grpc.RpcError) as raised:
            list(stream(channel)(iter([bad.raw]), timeout=CALL_TIMEOUT_S, metadata=_metadata(bad.request_id)))
        # a request's error ends its stream naming the position; a bad stream id ends it at once
        check_error(
            f"stream: {name}", raised.value, bad, "" if bad.field == "x-request-id" else "request 0 (id "
        )
    neighbour.check(neighbour_rows)
    forged = [line for line in server.lines if line.startswith(FORGED)]
    assert not forged, f"a request id forged log lines: {forged}"


def test_rows_name_what_was_expected(server: ServerProcess, channel: grpc.Channel) -> None:
    """The messages of the rows a caller most needs to act on carry the limits."""
    expected = {
        "fbank 3e38": f"within +-{MAX_FBANK_MAGNITUDE:g}",
        "request_id 10,000 chars": f"expected at most {MAX_REQUEST_ID_CHARS} characters",
        "more chunks than the queue": f"{QUEUE_CHUNKS + 1} chunks, expected at most {QUEUE_CHUNKS}",
        "waveform float16": "expected float32",
    }
    for name, text in expected.items():
        bad = BAD[name]
        with pytest.raises(grpc.RpcError) as raised:
            unary(channel)(bad.raw, timeout=CALL_TIMEOUT_S, metadata=_metadata(bad.request_id))
        assert text in raised.value.details(), f"{name}: {raised.value.details()!r} lacks {text!r}"


def test_an_error_is_not_counted_as_ok(server: ServerProcess, channel: grpc.Channel) -> None:
    """The int64-overflow shape once ended in UNKNOWN and was counted under code=OK."""
    before = settled(server)
    with pytest.raises(grpc.RpcError):
        unary(channel)(BAD["shape overflows int64"].raw, timeout=CALL_TIMEOUT_S)
    after = settled(server)
    ok = "speakerd_request_duration_seconds_count{code=OK,method=EmbedChunks}"
    invalid = "speakerd_request_duration_seconds_count{code=INVALID_ARGUMENT,method=EmbedChunks}"
    assert after.get(ok, 0.0) == before.get(ok, 0.0), "an error was counted under code=OK"
    assert after.get(invalid, 0.0) - before.get(invalid, 0.0) == 1


def test_nothing_sent_after_a_stream_error_is_embedded(server: ServerProcess, channel: grpc.Channel) -> None:
    """[good, bad, good x 4]: one response, then the bad request's status; only the first
    request's chunk reaches the engine (later ones wait for the earlier ones' validation)."""
    before = settled(server)
    requests = [_bytes(_good(1)), BAD["fbank NaN"].raw] + [_bytes(_good(2)) for _ in range(4)]
    responses = []
    with pytest.raises(grpc.RpcError) as raised:
        for response in stream(channel)(iter(requests), timeout=CALL_TIMEOUT_S):
            responses.append(response)
    after = settled(server)
    assert len(responses) == 1, f"{len(responses)} responses before the error"
    check_error("stream [good, bad, ...]", raised.value, BAD["fbank NaN"], "request 1 (id ")
    embedded = after["speakerd_chunks_embedded_total{}"] - before["speakerd_chunks_embedded_total{}"]
    assert embedded == 1, f"{embedded} chunks embedded; only the first request's 1 was sent before the error"


def test_stream_cancelled_with_a_full_window_starts_no_more(
    server: ServerProcess, channel: grpc.Channel
) -> None:
    """A slow first request holds the window full (STREAM_WINDOW in flight); the client
    sends one more and cancels. Exactly STREAM_WINDOW requests were ever started."""
    requests = [_bytes(_good(SLOW_CHUNKS))] + [_bytes(_good(1)) for _ in range(STREAM_WINDOW)]
    key = "speakerd_request_duration_seconds_count{code=CANCELLED,method=EmbedChunksStream}"
    ok_key = "speakerd_request_duration_seconds_count{code=OK,method=EmbedChunksStream}"
    before = settled(server)
    call = stream(channel)(iter(requests), timeout=CALL_TIMEOUT_S)
    received: list[pb.EmbedResponse] = []
    reader = threading.Thread(target=lambda: received.extend(_until_cancelled(call)))
    reader.start()
    wait_for(server, "speakerd_inflight_requests{}", lambda v: v >= STREAM_WINDOW)
    time.sleep(0.3)  # time for a 17th request to be started, were it going to be
    assert not received, "the slow first request finished before the cancel: the window never filled"
    call.cancel()
    reader.join()
    after = settled(server)
    started = sum(after.get(k, 0.0) - before.get(k, 0.0) for k in (key, ok_key))
    assert started == STREAM_WINDOW, f"{started} stream requests started, the window holds {STREAM_WINDOW}"


def _until_cancelled(call) -> list[pb.EmbedResponse]:
    responses = []
    try:
        for response in call:
            responses.append(response)
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.CANCELLED, error
    return responses


def test_byte_budget_refuses_past_its_limit() -> None:
    """Bytes being decoded are bounded: a take that would pass the limit takes nothing."""
    budget = ByteBudget(100)
    assert budget.take(60) and budget.take(40)
    assert not budget.take(1), "took a byte past the limit"
    assert budget.used_bytes == 100
    budget.give(60)
    assert not budget.take(61) and budget.take(60), f"used {budget.used_bytes} of 100"
    with pytest.raises(ValueError, match="only 100 are taken"):
        budget.give(101)
