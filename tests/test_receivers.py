"""`serve --receivers N`: receiver processes take the calls, the server serves them.

Read as the contract of the option (docs/service.md): a client cannot tell a server with
receivers from one without. EmbedChunks handed over through shared memory returns the
engine's own rows bit for bit; every other call (streams, model info, health, reflection,
and requests larger than a slot) is forwarded and answers as the server itself would,
errors included; deadlines and cancellations reach the server's queue; the server's
/metrics counts the calls; a receiver killed mid-run is replaced while the others serve;
SIGTERM drains and ends every receiver. TLS and tokens through receivers are
test_tls_auth.py's (each of its tests runs with `--receivers 2` too).
"""

from __future__ import annotations

import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from speakerd.client.client import NO_RETRY
from speakerd.engine.cpu import CpuEngine
from speakerd.model.architecture import FRAMES, MEL_BINS
from speakerd.model.numerics import Math
from speakerd.serving.batching.batcher import PIPELINE_DEPTH
from speakerd.serving.receivers.receiver_link import SLOT_BYTES
from tests.serving import ServerProcess, scrape, start_server

pytestmark = pytest.mark.slow  # a CPU server doing seconds of engine work per test

#: b8 keeps CPU batches short (~2 s) yet several requests share one.
PLANS = "1,8"
RECEIVERS = 2
PIDS = re.compile(r"receiver processes take calls on port \d+ \(pids \[(?P<pids>[\d, ]+)\]\)")


@pytest.fixture(scope="module")
def server(weights_path):
    running = start_server(weights_path, "--plans", PLANS, "--receivers", str(RECEIVERS))
    yield running
    pids = receiver_pids(running)
    assert running.terminate() == 0, running.log()
    gone = [pid for pid in pids if not alive(pid)]
    assert gone == pids, f"receivers still running after the server exited: {set(pids) - set(gone)}"


@pytest.fixture(scope="module")
def mixed(reference_cases):
    return reference_cases[-1]


@pytest.fixture(scope="module")
def direct(folded_model, mixed) -> np.ndarray:
    """The same engine in process on the first 8 chunks of mixed_b32: what must come back."""
    return CpuEngine(folded_model, Math.FP32, (1, 8)).embed(mixed.fbank[:8], mixed.masks[:8]).embeddings


def receiver_pids(server: ServerProcess) -> list[int]:
    match = PIDS.search(server.log())
    assert match, f"no receiver pids in the log:\n{server.log()}"
    return [int(pid) for pid in match["pids"].split(",")]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped) counts as gone
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(")")[-1].split()[0] != "Z"


def test_handed_over_calls_equal_the_engine_output(server: ServerProcess, mixed, direct) -> None:
    """Concurrent clients on fresh connections (spread over the receivers by the kernel)."""

    def call(index: int) -> np.ndarray:
        with server.client(retry=NO_RETRY) as client:
            result = client.embed(mixed.fbank[:8], mixed.masks[:8], request_id=f"handed-{index}")
        assert result.request_id == f"handed-{index}"
        return result.embeddings

    before = scrape(server)
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(call, range(6)))
    for result in results:
        assert np.array_equal(result, direct), f"max abs {np.abs(result - direct).max()}"
    after = scrape(server)
    counted = [key for key in after if key.startswith("speakerd_receiver_calls_total{")]
    calls = {key: after[key] - before.get(key, 0) for key in counted}
    handed = {f"speakerd_receiver_calls_total{{receiver={index}}}" for index in range(RECEIVERS)}
    assert set(calls) <= handed and sum(calls.values()) == 6, f"calls per receiver {calls}, expected 6 in all"


def test_every_other_call_is_forwarded(server: ServerProcess, mixed, direct) -> None:
    with server.client(retry=NO_RETRY) as client:
        assert client.health() == "SERVING"
        info = client.model_info()
        assert (info.engine, info.max_batch) == ("cpu-onnxruntime", 8)
        streamed = list(
            client.embed_stream([(mixed.fbank[:4], mixed.masks[:4]), (mixed.fbank[4:8], mixed.masks[4:8])])
        )
    assert np.array_equal(np.concatenate([r.embeddings for r in streamed]), direct)
    with grpc.insecure_channel(server.target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        answers = list(
            stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        )
    services = {service.name for service in answers[0].list_services_response.service}
    assert "speakerd.v1.SpeakerEmbedding" in services, services


def test_errors_name_the_field_on_both_paths(server: ServerProcess) -> None:
    """A bad request in a slot, and one larger than a slot (forwarded): the server's own
    INVALID_ARGUMENT either way."""
    chunks_over_a_slot = SLOT_BYTES // (FRAMES * MEL_BINS * 4) + 1
    fbank = np.zeros((chunks_over_a_slot, FRAMES, MEL_BINS), np.float32)
    cases = [
        (fbank[:1, :10], np.ones((1, 1, 589), np.float32), "fbank: shape (1, 10, 80)"),
        (fbank, np.ones((chunks_over_a_slot - 1, 1, 589), np.float32), "masks"),
    ]
    for features, masks, expected in cases:
        with server.client(retry=NO_RETRY) as client, pytest.raises(grpc.RpcError) as raised:
            client.embed(features, masks)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value
        assert expected in raised.value.details(), raised.value.details()


def test_a_deadline_reaches_the_servers_queue(server: ServerProcess, mixed) -> None:
    """With every engine worker busy on a full b8 batch (~2 s each on CPU), a request with
    0.3 s to live waits in the server's queue: the caller gets DEADLINE_EXCEEDED, the server
    counts it as dropped and never runs its chunks (test_service.py's rule, through a receiver)."""
    before = scrape(server)
    with ThreadPoolExecutor(PIPELINE_DEPTH) as pool:
        busy = []
        for _ in range(PIPELINE_DEPTH):  # 0.2 s apart: each leaves the queue before the next
            busy.append(pool.submit(server.client(timeout_s=120).embed, mixed.fbank[:8], mixed.masks[:8]))
            time.sleep(0.2)
        with server.client(retry=NO_RETRY) as client, pytest.raises(grpc.RpcError) as raised:
            client.embed(mixed.fbank[:1], mixed.masks[:1], timeout_s=0.3)
        for future in busy:
            future.result()
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, raised.value
    reasons = [f"speakerd_requests_rejected_total{{reason={r}}}" for r in ("deadline_exceeded", "cancelled")]
    deadline = time.monotonic() + 10
    while sum(scrape(server).get(key, 0) - before.get(key, 0) for key in reasons) < 1:
        assert time.monotonic() < deadline, "the server never counted the expired request"
        time.sleep(0.1)
    chunks = "speakerd_chunks_embedded_total{}"
    embedded = scrape(server)[chunks] - before[chunks]
    assert embedded == 8 * PIPELINE_DEPTH, f"{embedded} chunks embedded; only the busy requests' should be"


def test_a_killed_receiver_is_replaced(weights_path, mixed, direct) -> None:
    running = start_server(weights_path, "--plans", PLANS, "--receivers", str(RECEIVERS))
    try:
        victim = receiver_pids(running)[0]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while "listening again" not in running.log():
            assert time.monotonic() < deadline, running.log()
            time.sleep(0.1)
        assert f"(pid {victim}) exited (code -9)" in running.log(), running.log()
        for index in range(4):  # fresh connections, whichever receiver each lands on
            with running.client(retry=NO_RETRY) as client:
                assert np.array_equal(client.embed(mixed.fbank[:8], mixed.masks[:8]).embeddings, direct), (
                    index
                )
    finally:
        assert running.terminate() == 0, running.log()


def test_sigterm_to_every_process_drains_the_calls_in_progress(weights_path, mixed, direct) -> None:
    """What systemd does by default: SIGTERM to the server and its receivers at once. Calls
    already received are answered (each receiver drains as the server does), and every
    process exits."""
    running = start_server(weights_path, "--plans", PLANS, "--receivers", str(RECEIVERS))
    pids = receiver_pids(running)

    def call() -> np.ndarray:
        with running.client(retry=NO_RETRY, timeout_s=120) as client:
            return client.embed(mixed.fbank[:8], mixed.masks[:8]).embeddings

    try:
        with ThreadPoolExecutor(2) as pool:
            calls = [pool.submit(call) for _ in range(2)]
            deadline = time.monotonic() + 60
            while scrape(running).get("speakerd_inflight_requests{}", 0) < 2:
                assert time.monotonic() < deadline, "the calls never reached the server"
                time.sleep(0.05)
            for pid in pids:
                os.kill(pid, signal.SIGTERM)
            running.process.send_signal(signal.SIGTERM)
            for result in [future.result() for future in calls]:
                assert np.array_equal(result, direct)
        assert running.wait(60) == 0, running.log()
    finally:
        if running.process.poll() is None:
            running.process.kill()
    assert "SIGTERM, stopping" in running.log(), running.log()
    assert not [pid for pid in pids if alive(pid)], "receivers outlived the server"
