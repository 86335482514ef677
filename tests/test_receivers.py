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

import functools
import os
import re
import signal
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
from tests.serving import ServerProcess, scrape, start_server, wait_until

pytestmark = pytest.mark.slow  # a CPU server doing seconds of engine work per test

#: b8 keeps CPU batches short (~2 s) yet several requests share one.
PLANS = "1,8"
RECEIVERS = 2
PIDS = re.compile(r"receiver processes take calls on port \d+ \(pids \[(?P<pids>[\d, ]+)\]\)")
REPLACED = re.compile(r"receiver (?P<index>\d+) listening again \(pid (?P<pid>\d+)\)")
#: Chunks of a call whose rows are compared: more than one, so a slot carries several
#: chunks and their order shows; how a call travels does not depend on more (a call of 8
#: cost 4x the engine time for the same check).
CALL_CHUNKS = 2
#: Chunks of a call that must still be running when the test acts (its worker busy, a
#: drain with work to finish): ~1 s of CPU engine time, several times what the test needs
#: to see the call reach the server and act on it.
LONG_CHUNKS = 4
#: How long a test waits for something the server does within a second or two on a quiet
#: machine (a call reaching it, a receiver replaced), on a loaded 2-core one.
WAIT_S = 60.0


@pytest.fixture(scope="module")
def server(weights_path):
    """One server for the whole module, the killed receiver's replacement and the final
    SIGTERM (the module's last two tests) included: each start costs 5-15 s of 2 cores.
    Whichever test stopped it, the server and every receiver it ever started must be gone."""
    running = start_server(weights_path, "--plans", PLANS, "--receivers", str(RECEIVERS))
    yield running
    assert running.terminate() == 0, running.log()
    started = receiver_pids(running, every=True)
    assert not [pid for pid in started if alive(pid)], (
        f"receivers still running after the server exited: {started}"
    )


@pytest.fixture(scope="module")
def mixed(reference_cases):
    return reference_cases[-1]


@pytest.fixture(scope="module")
def direct(folded_model, mixed) -> np.ndarray:
    """The same engine in process on the first LONG_CHUNKS chunks of mixed_b32 (every chunk
    a test sends): what must come back."""
    fbank, masks = mixed.fbank[:LONG_CHUNKS], mixed.masks[:LONG_CHUNKS]
    return CpuEngine(folded_model, Math.FP32, (1, 8)).embed(fbank, masks).embeddings


def receiver_pids(server: ServerProcess, every: bool = False) -> list[int]:
    """The receivers' pids now (each replaced one's successor in its place), or with `every`
    each pid any receiver ever had."""
    match = PIDS.search(server.log())
    assert match, f"no receiver pids in the log:\n{server.log()}"
    pids = [int(pid) for pid in match["pids"].split(",")]
    replacements = [(int(found["index"]), int(found["pid"])) for found in REPLACED.finditer(server.log())]
    if every:
        return pids + [pid for _, pid in replacements]
    for index, pid in replacements:
        pids[index] = pid
    return pids


wait_for = functools.partial(wait_until, timeout_s=WAIT_S)


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
    fbank, masks, expected = mixed.fbank[:CALL_CHUNKS], mixed.masks[:CALL_CHUNKS], direct[:CALL_CHUNKS]

    def call(index: int) -> np.ndarray:
        with server.client(retry=NO_RETRY) as client:
            result = client.embed(fbank, masks, request_id=f"handed-{index}")
        assert result.request_id == f"handed-{index}"
        return result.embeddings

    before = scrape(server)
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(call, range(6)))
    for result in results:
        assert np.array_equal(result, expected), f"max abs {np.abs(result - expected).max()}"
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
        items = [(mixed.fbank[i : i + 1], mixed.masks[i : i + 1]) for i in range(CALL_CHUNKS)]
        streamed = list(client.embed_stream(items))
    assert np.array_equal(np.concatenate([r.embeddings for r in streamed]), direct[:CALL_CHUNKS])
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
    """With every engine worker busy on a call of LONG_CHUNKS chunks (~1 s of CPU engine
    time each), a request with 0.3 s to live waits in the server's queue: the caller gets
    DEADLINE_EXCEEDED, the server counts it as dropped and never runs its chunks
    (test_service.py's rule, through a receiver)."""
    before = scrape(server)
    taken = "speakerd_queue_wait_seconds_count{}"  # a call's first chunks left the queue
    with ThreadPoolExecutor(PIPELINE_DEPTH) as pool:
        busy = []
        # each taken by a worker before the next is sent: no two share a batch, leaving a
        # worker free for the short call
        for index in range(PIPELINE_DEPTH):
            call = server.client(timeout_s=120).embed
            busy.append(pool.submit(call, mixed.fbank[:LONG_CHUNKS], mixed.masks[:LONG_CHUNKS]))
            wait_for(lambda index=index: scrape(server).get(taken, 0) - before.get(taken, 0) > index,
                     f"busy call {index} taken by a worker", server)  # fmt: skip
        with server.client(retry=NO_RETRY) as client, pytest.raises(grpc.RpcError) as raised:
            client.embed(mixed.fbank[:1], mixed.masks[:1], timeout_s=0.3)
        for future in busy:
            future.result()
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, raised.value
    reasons = [f"speakerd_requests_rejected_total{{reason={r}}}" for r in ("deadline_exceeded", "cancelled")]
    wait_for(lambda: sum(scrape(server).get(key, 0) - before.get(key, 0) for key in reasons) >= 1,
             "the expired request counted", server)  # fmt: skip
    chunks = "speakerd_chunks_embedded_total{}"
    embedded = scrape(server)[chunks] - before[chunks]
    expected = LONG_CHUNKS * PIPELINE_DEPTH
    assert embedded == expected, f"{embedded} chunks embedded; only the busy requests' {expected} should be"


def test_a_killed_receiver_is_replaced(server: ServerProcess, mixed, direct) -> None:
    """On the module's server: the killed receiver is replaced, and calls on fresh
    connections answer the engine's rows whichever receiver each reaches. (The next test,
    the module's last, stops that server: none runs on the replacement unawares.)"""
    victim = receiver_pids(server)[0]
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: victim not in receiver_pids(server), "the killed receiver replaced", server)
    assert f"(pid {victim}) exited (code -9)" in server.log(), server.log()
    fbank, masks = mixed.fbank[:CALL_CHUNKS], mixed.masks[:CALL_CHUNKS]
    for index in range(4):  # fresh connections, whichever receiver each lands on
        with server.client(retry=NO_RETRY) as client:
            assert np.array_equal(client.embed(fbank, masks).embeddings, direct[:CALL_CHUNKS]), index


def test_sigterm_to_every_process_drains_the_calls_in_progress(server: ServerProcess, mixed, direct) -> None:
    """What systemd does by default: SIGTERM to the server and its receivers at once. Calls
    already received are answered (each receiver drains as the server does), and every
    process exits. The module's last test: it stops the module's server."""
    pids = receiver_pids(server)

    def call() -> np.ndarray:
        with server.client(retry=NO_RETRY, timeout_s=120) as client:
            return client.embed(mixed.fbank[:LONG_CHUNKS], mixed.masks[:LONG_CHUNKS]).embeddings

    try:
        with ThreadPoolExecutor(2) as pool:
            calls = [pool.submit(call) for _ in range(2)]
            wait_for(lambda: scrape(server).get("speakerd_inflight_requests{}", 0) >= 2,
                     "both calls at the server", server)  # fmt: skip
            for pid in pids:
                os.kill(pid, signal.SIGTERM)
            server.process.send_signal(signal.SIGTERM)
            for result in [future.result() for future in calls]:
                assert np.array_equal(result, direct)
        assert server.wait(60) == 0, server.log()
    finally:
        if server.process.poll() is None:
            server.process.kill()
    assert "SIGTERM, stopping" in server.log(), server.log()
    assert not [pid for pid in pids if alive(pid)], "receivers outlived the server"
