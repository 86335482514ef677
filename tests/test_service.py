"""The gRPC service end to end: a real `python -m speakerd serve` on loopback, CPU engine.

Read as the service contract (docs/service.md): rows come back equal to the engine's own output and
in each request's order whatever its neighbours; concurrent requests share batches (every
bad input class, with its code and details, is test_bad_inputs.py's table); a full queue
is RESOURCE_EXHAUSTED; an expired deadline costs no engine work; SIGTERM drains; health
says SERVING only after the parity self-check; /metrics has every metric.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from speakerd.client.client import NO_RETRY, RetryPolicy, SpeakerClient
from speakerd.client.verify import main as verify_main
from speakerd.engine.cpu import CpuEngine
from speakerd.model.architecture import EMBEDDING_DIM
from speakerd.model.numerics import Math
from speakerd.serving.batching.batcher import PIPELINE_DEPTH
from speakerd.serving.observability.metrics import METRIC_NAMES
from tests.serving import ServerProcess, scrape, start_server

#: Plans of the test servers: b8 keeps CPU batches short (~1 s) yet spans several requests.
PLANS = "1,8"
#: Concurrent requests of 1 to MAX_REQUEST_CHUNKS chunks (seeded: 71 chunks, 5 requests larger
#: than a b8 batch, so split): enough to share batches; 16 of up to 40 chunks (330 chunks)
#: was the suite's second-slowest test.
CONCURRENT_REQUESTS = 8
MAX_REQUEST_CHUNKS = 12


def delta(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


@pytest.fixture(scope="module")
def server(shared_server: ServerProcess) -> ServerProcess:
    return shared_server


@pytest.fixture(scope="module")
def engine(folded_model) -> CpuEngine:
    """The same engine in-process: what the service must reproduce bit for bit."""
    return CpuEngine(folded_model, Math.FP32, (1, 8))


@pytest.fixture(scope="module")
def mixed(reference_cases):
    return reference_cases[-1]


@pytest.fixture(scope="module")
def direct(engine: CpuEngine, mixed) -> np.ndarray:
    """Engine output for every chunk of mixed_b32 [32, 3, 256]."""
    return engine.embed(mixed.fbank, mixed.masks).embeddings


def test_health_serving_only_after_self_check(server: ServerProcess) -> None:
    assert server.health_seen[0] != "SERVING", f"SERVING before warm-up: {server.health_seen}"
    assert server.health_seen[-1] == "SERVING"
    checked, serving = server.index_of("self-check passed"), server.index_of("SERVING speakerd")
    assert 0 <= checked < serving, f"self-check line {checked}, SERVING line {serving}:\n{server.log()}"


def test_embeddings_equal_the_engine_output(server: ServerProcess, mixed, direct, folded_model) -> None:
    with SpeakerClient(server.target) as client:
        result = client.embed(mixed.fbank, mixed.masks, request_id="equal-engine")
        one = client.embed(mixed.fbank[:1], mixed.masks[:1, :2])
    assert np.array_equal(result.embeddings, direct), np.abs(result.embeddings - direct).max()
    assert np.array_equal(one.embeddings, direct[:1, :2])
    np.testing.assert_array_equal(result.empty, result.active_frames == 0)
    assert result.model_id == folded_model.model_id and result.precision == "fp32"
    assert result.request_id == "equal-engine" and all(plan.startswith("b") for plan in result.plans)


def test_concurrent_requests_share_batches_and_keep_their_rows(server: ServerProcess, mixed, direct) -> None:
    rng = np.random.default_rng(7)
    sizes = rng.integers(1, MAX_REQUEST_CHUNKS + 1, CONCURRENT_REQUESTS)
    starts = rng.integers(0, mixed.chunks, CONCURRENT_REQUESTS)
    before = scrape(server)

    def call(i: int) -> tuple[int, np.ndarray, np.ndarray]:
        index = (starts[i] + np.arange(sizes[i])) % mixed.chunks
        masks = mixed.masks[index]
        if i % 4 == 3:  # some requests send masks at the trunk's 125 frames: any F is allowed
            masks = np.ascontiguousarray(masks[..., (np.arange(125) * masks.shape[-1]) // 125])
        with SpeakerClient(server.target, timeout_s=600) as client:
            return (
                i,
                index,
                client.embed(mixed.fbank[index], masks, request_id=f"concurrent-{i}").embeddings,
            )

    with ThreadPoolExecutor(CONCURRENT_REQUESTS) as pool:
        results = list(pool.map(call, range(CONCURRENT_REQUESTS)))
    after = scrape(server)
    for i, index, embeddings in results:
        assert embeddings.shape == (sizes[i], 3, EMBEDDING_DIM)
        worst = float(np.abs(embeddings - direct[index]).max())
        assert np.array_equal(embeddings, direct[index]), f"request {i}: rows differ by {worst:.3e}"
    batches = delta(before, after, "speakerd_batch_requests_count{}")
    single = delta(before, after, "speakerd_batch_requests_bucket{le=1.0}")
    chunks = delta(before, after, "speakerd_chunks_embedded_total{}")
    print(
        f"\n{int(sizes.sum())} chunks in {int(batches)} batches, {int(batches - single)} holding >1 request"
    )
    assert chunks == sizes.sum(), f"embedded {chunks} chunks, sent {sizes.sum()}"
    assert batches - single >= 1, "no batch held chunks of more than one request"


def test_model_info_stream_and_reflection(server: ServerProcess, mixed, direct, folded_model) -> None:
    with SpeakerClient(server.target) as client:
        info = client.model_info()
        streamed = list(
            client.embed_stream([(mixed.fbank[i : i + 2], mixed.masks[i : i + 2]) for i in (0, 6, 30)])
        )
    assert info.model_id == folded_model.model_id and info.engine == "cpu-onnxruntime"
    assert list(info.plan_sizes) == [1, 8] and info.max_batch == 8 and info.precision == "fp32"
    for i, result in zip((0, 6, 30), streamed, strict=True):
        assert np.array_equal(result.embeddings, direct[i : i + 2]), f"stream item at chunk {i}"
    with grpc.insecure_channel(server.target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        answer = next(
            stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        )
    services = {s.name for s in answer.list_services_response.service}
    assert {"speakerd.v1.SpeakerEmbedding", "grpc.health.v1.Health"} <= services, services


def test_metrics_endpoint_has_every_metric(server: ServerProcess) -> None:
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    declared = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    missing = [
        name for name in METRIC_NAMES if name not in declared and name.removesuffix("_total") not in declared
    ]
    assert not missing, f"/metrics lacks {missing}"
    samples = scrape(server)
    assert samples["speakerd_build_info{version=0.1.0}"] == 1 or any(
        k.startswith("speakerd_build_info") for k in samples
    )
    assert any(k.startswith("speakerd_model_info{engine=cpu-onnxruntime") for k in samples), samples.keys()
    assert samples.get("speakerd_request_duration_seconds_count{code=OK,method=EmbedChunks}", 0) >= 1


def test_verify_passes_against_the_server(server: ServerProcess, references_dir, capsys) -> None:
    assert verify_main(["--target", server.target, "--references", str(references_dir)]) == 0
    table = capsys.readouterr().out
    print(table)
    assert "7/7 cases within the parity bounds (docs/parity.md)" in table and "FAIL" not in table


def test_load_generator_reports_throughput_latency_and_batch_fill(server: ServerProcess) -> None:
    """`client load` over two processes: every call succeeds, and the JSON's numbers agree
    with each other and with the server's /metrics."""
    command = [sys.executable, "-m", "speakerd.client", "load", "--target", server.target, "--streams", "4",
               "--processes", "2", "--seconds", "3", "--warmup", "0", "--chunks", "2",
               "--metrics-url", server.metrics_url]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    print(report)
    assert report["processes"] == 2 and report["streams"] == 4 and report["errors"] == {}, report
    assert report["requests_ok"] >= 4, report
    rate = report["requests_ok"] * 2 / report["seconds"]
    assert report["chunks_per_s"] == pytest.approx(rate, rel=1e-3), (report["chunks_per_s"], rate)
    assert report["latency_p50_ms"] <= report["latency_p90_ms"] <= report["latency_p99_ms"], report
    assert 0 < report["batch_fill_mean"] <= 1 and 1 <= report["batch_size_mean_chunks"] <= 8, report
    assert report["batch_compute_ms_mean"] > 0, report


# --- a second server with a tiny queue: back-pressure, deadlines and draining ------------


@pytest.fixture(scope="module")
def small_server(weights_path):
    """Queue of 8 chunks (one b8 batch), no batching delay."""
    running = start_server(weights_path, "--plans", PLANS, "--queue-chunks", "8", "--max-delay-ms", "0",
                           "--drain-seconds", "60")  # fmt: skip
    yield running
    if running.process.poll() is None:
        running.terminate()


def test_full_queue_is_resource_exhausted_and_retry_gets_through(small_server: ServerProcess, mixed) -> None:
    codes: list[grpc.StatusCode] = []
    lock = threading.Lock()

    def call(_: int) -> None:
        with SpeakerClient(small_server.target, timeout_s=120, retry=NO_RETRY) as client:
            try:
                client.embed(mixed.fbank[:8], mixed.masks[:8])
                code = grpc.StatusCode.OK
            except grpc.RpcError as error:
                code = error.code()
        with lock:
            codes.append(code)

    before = scrape(small_server)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(call, range(8)))
    after = scrape(small_server)
    print(f"\ncodes of 8 concurrent 8-chunk calls on an 8-chunk queue: {[c.name for c in codes]}")
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes and grpc.StatusCode.OK in codes, codes
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    rejected = delta(before, after, "speakerd_requests_rejected_total{reason=queue_full}")
    assert rejected == codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED)
    # the client's retry with backoff gets every call through eventually
    retry = RetryPolicy(attempts=50, initial_backoff_s=0.1, max_backoff_s=1.0)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: SpeakerClient(small_server.target, 300, retry).embed(
            mixed.fbank[:8], mixed.masks[:8]), range(4)))  # fmt: skip
    assert len(results) == 4


def test_expired_deadline_costs_no_engine_work(small_server: ServerProcess, mixed) -> None:
    before = scrape(small_server)
    with ThreadPoolExecutor(3) as pool:
        # one full b8 batch per engine worker: all busy for ~1 s each (smaller requests
        # would share a batch and leave a worker free to serve the next call in time),
        # sent 0.2 s apart so each has left the 8-chunk queue when the next arrives
        busy = []
        for _ in range(PIPELINE_DEPTH):
            busy.append(
                pool.submit(SpeakerClient(small_server.target, 120).embed, mixed.fbank[:8], mixed.masks[:8])
            )
            time.sleep(0.2)
        with (
            SpeakerClient(small_server.target, retry=NO_RETRY) as client,
            pytest.raises(grpc.RpcError) as raised,
        ):
            client.embed(mixed.fbank[:2], mixed.masks[:2], timeout_s=0.05)
        for future in busy:
            future.result()
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    time.sleep(0.5)
    after = scrape(small_server)
    embedded = delta(before, after, "speakerd_chunks_embedded_total{}")
    expected = 8 * PIPELINE_DEPTH
    assert embedded == expected, f"{embedded} chunks embedded; only the busy requests' {expected} should be"
    dropped = sum(delta(before, after, f"speakerd_requests_rejected_total{{reason={r}}}")
                  for r in ("deadline_exceeded", "cancelled"))  # fmt: skip
    assert dropped == 1, f"rejections {dropped}"


def test_sigterm_drains_in_flight_requests(small_server: ServerProcess, mixed, direct) -> None:
    with ThreadPoolExecutor(1) as pool:
        in_flight = pool.submit(SpeakerClient(small_server.target, 120, NO_RETRY).embed,
                                mixed.fbank[:8], mixed.masks[:8])  # fmt: skip
        time.sleep(0.3)
        started = time.monotonic()
        small_server.process.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        with SpeakerClient(small_server.target, retry=NO_RETRY) as client:
            try:
                status = client.health(timeout_s=2.0)
            except grpc.RpcError as error:
                status = error.code().name
            with pytest.raises(grpc.RpcError) as refused:
                client.embed(mixed.fbank[:1], mixed.masks[:1], timeout_s=5)
        result = in_flight.result(timeout=120)
    assert status in ("NOT_SERVING", "UNAVAILABLE"), status
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
    assert np.array_equal(result.embeddings, direct[:8]), "the in-flight request did not complete intact"
    assert small_server.process.wait(60) == 0, small_server.log()
    print(f"\ndrained and exited in {time.monotonic() - started:.2f} s")
    assert small_server.index_of("draining") >= 0 and small_server.index_of("stopped after") >= 0
