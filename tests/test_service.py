"""The gRPC service end to end: a real `python -m speakerd serve` on loopback, CPU engine.

Read as the service contract (docs/service.md): rows come back equal to the engine's own output and
in each request's order whatever its neighbours; concurrent requests share batches (every
bad input class, with its code and details, is test_bad_inputs.py's table); a full queue
is RESOURCE_EXHAUSTED; an expired deadline costs no engine work; SIGTERM drains; health
says SERVING only after the parity self-check; /metrics has every metric.
"""

from __future__ import annotations

import functools
import json
import signal
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from speakerd.client.cli import main as client_main
from speakerd.client.client import NO_RETRY, RetryPolicy, SpeakerClient
from speakerd.client.verify import main as verify_main
from speakerd.engine.cpu import CpuEngine
from speakerd.model.architecture import EMBEDDING_DIM, MAX_SPEAKERS
from speakerd.model.cases import B1_CASES, BATCH_CASE, FILE_SUFFIX, mixed_rows, save_case
from speakerd.model.numerics import Math
from speakerd.serving.batching.batcher import PIPELINE_DEPTH
from speakerd.serving.observability.metrics import METRIC_NAMES
from tests.serving import CPU_THREADS, ServerProcess, scrape, start_server, wait_until

pytestmark = pytest.mark.slow  # a CPU server and its engine work: seconds of 2 cores a test

#: The chunks of mixed_b32 the tests send: its last conversation chunk (partial), the short
#: recording's (speaker 2 empty), the empty-mask, one-frame and soft-mask chunks (16-20),
#: after four ordinary ones. Nine: one request of them all spans a b8 and a b1 plan run. The
#: other 23 chunks are more of the same computation, a CPU chunk at a time (all 32 were the
#: suite's third-slowest test). `verify` here sends mixed_b32 as these nine too, with every
#: b1 case (23 chunks more was 10 s of CPU); all 32 are test_suite_harness.py's, whose
#: service suite runs `verify` against a CPU server with the session's reference cases.
SENT = slice(12, 21)
#: Sizes of the concurrent requests, over SENT (wrapping): two larger than a b8 batch, so
#: split over batches, among six small ones that share batches with them (26 chunks; 31
#: with small ones of up to 3 chunks, and 8 seeded requests of up to 12 chunks, 71 chunks,
#: checked the same).
CONCURRENT_SIZES = (9, 1, 2, 1, 9, 1, 2, 1)
#: Where the stream's 2-chunk items start in SENT: first, middle (edge chunks), last.
STREAMED = (0, 4, 7)
#: The small server's largest plan, and its whole queue: a call of SMALL_BATCH chunks is
#: one full batch (~1 s of CPU engine time), so two concurrent ones fill the queue. b8 (the
#: shared server's) doubled the engine time of its tests for the same checks.
SMALL_BATCH = 4
#: How long a test waits for something the server does within a second on a quiet machine.
WAIT_S = 60.0
#: Counts the calls whose first chunks left the queue for an engine worker.
TAKEN = "speakerd_queue_wait_seconds_count{}"


@dataclass(frozen=True)
class Sent:
    """What the tests send: fbank [n, 998, 80] and masks [n, 3, 589]."""

    fbank: np.ndarray
    masks: np.ndarray

    @property
    def chunks(self) -> int:
        return self.fbank.shape[0]


def delta(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


wait_for = functools.partial(wait_until, timeout_s=WAIT_S)


@pytest.fixture(scope="module")
def server(shared_server: ServerProcess) -> ServerProcess:
    return shared_server


@pytest.fixture(scope="module")
def engine(folded_model) -> CpuEngine:
    """The same engine in-process: what the service must reproduce bit for bit."""
    return CpuEngine(folded_model, Math.FP32, (1, 8))


@pytest.fixture(scope="module")
def mixed(reference_cases) -> Sent:
    """The SENT chunks of mixed_b32, its edge cases among them."""
    case = reference_cases[-1]
    edges = {row for name, row in mixed_rows().items() if name != "first_b1"}
    assert edges <= set(range(case.chunks)[SENT]), f"edge chunks {edges} not all in {SENT}"
    return Sent(np.ascontiguousarray(case.fbank[SENT]), np.ascontiguousarray(case.masks[SENT]))


@pytest.fixture(scope="module")
def direct(engine: CpuEngine, mixed: Sent) -> np.ndarray:
    """Engine output for every chunk sent [9, 3, 256]."""
    return engine.embed(mixed.fbank, mixed.masks).embeddings


def test_the_cpu_engine_runs_the_threads_asked_for(server: ServerProcess) -> None:
    """--cpu-threads reaches the engine (tests/serving.py starts every test server with
    CPU_THREADS), and its build line says so."""
    built = [line for line in server.lines if "engine cpu-onnxruntime" in line and " built in " in line]
    said = f"), {CPU_THREADS} thread{'s' * (CPU_THREADS != 1)} built in"
    assert len(built) == 1 and said in built[0], built


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
    sizes = np.array(CONCURRENT_SIZES)
    starts = np.random.default_rng(7).integers(0, mixed.chunks, len(sizes))
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

    with ThreadPoolExecutor(len(sizes)) as pool:
        results = list(pool.map(call, range(len(sizes))))
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
            client.embed_stream([(mixed.fbank[i : i + 2], mixed.masks[i : i + 2]) for i in STREAMED])
        )
    assert info.model_id == folded_model.model_id and info.engine == "cpu-onnxruntime"
    assert list(info.plan_sizes) == [1, 8] and info.max_batch == 8 and info.precision == "fp32"
    for i, result in zip(STREAMED, streamed, strict=True):
        assert np.array_equal(result.embeddings, direct[i : i + 2]), f"stream item at chunk {i}"
    with grpc.insecure_channel(server.target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        answer = next(
            stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        )
    services = {s.name for s in answer.list_services_response.service}
    every = {"speakerd.v1.SpeakerEmbedding", "speakerd.v1.Diarization", "speakerd.v1.Voiceprints"}
    assert every | {"grpc.health.v1.Health"} <= services, services


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


@pytest.fixture(scope="module")
def sent_references(tmp_path_factory, references_dir, reference_cases, mixed: Sent) -> Path:
    """The reference cases with mixed_b32 cut to its SENT chunks and their reference rows
    (row = chunk * 3 + speaker), every b1 case as it is."""
    directory = tmp_path_factory.mktemp("sent-references")
    for name in B1_CASES:
        (directory / f"{name}{FILE_SUFFIX}").symlink_to(references_dir / f"{name}{FILE_SUFFIX}")
    case = reference_cases[-1]
    assert case.name == BATCH_CASE, case.name
    rows = case.output[SENT.start * MAX_SPEAKERS : SENT.stop * MAX_SPEAKERS]
    save_case(directory / f"{BATCH_CASE}{FILE_SUFFIX}", mixed.fbank, mixed.masks, {"output": rows}, {})
    return directory


def test_verify_passes_against_the_server(server: ServerProcess, sent_references, capsys) -> None:
    assert verify_main(["--target", server.target, "--references", str(sent_references)]) == 0
    table = capsys.readouterr().out
    print(table)
    assert "7/7 cases within the parity bounds (docs/parity.md)" in table and "FAIL" not in table


def test_load_generator_reports_throughput_latency_and_batch_fill(server: ServerProcess, capsys) -> None:
    """`client load` over two processes: every call succeeds, and the JSON's numbers agree
    with each other and with the server's /metrics. One-chunk calls and the shortest window
    (`load` lengthens it to three calls' time of the 4 streams): a call of 2 chunks doubled
    the run for the same checks."""
    chunks = 1
    flags = ["--target", server.target, "--streams", "4", "--processes", "2", "--seconds", "1",
             "--warmup", "0", "--chunks", str(chunks), "--metrics-url", server.metrics_url]  # fmt: skip
    assert client_main(["load", *flags]) == 0
    report = json.loads(capsys.readouterr().out)
    print(report)
    assert report["processes"] == 2 and report["streams"] == 4 and report["errors"] == {}, report
    assert report["requests_ok"] >= 4, report
    rate = report["requests_ok"] * chunks / report["seconds"]
    assert report["chunks_per_s"] == pytest.approx(rate, rel=1e-3), (report["chunks_per_s"], rate)
    assert report["latency_p50_ms"] <= report["latency_p90_ms"] <= report["latency_p99_ms"], report
    assert 0 < report["batch_fill_mean"] <= 1 and 1 <= report["batch_size_mean_chunks"] <= 8, report
    assert report["batch_compute_ms_mean"] > 0, report


# --- a second server with a tiny queue: back-pressure, deadlines and draining ------------


@pytest.fixture(scope="module")
def small_server(weights_path):
    """Queue of SMALL_BATCH chunks (one full batch), no batching delay."""
    running = start_server(weights_path, "--plans", f"1,{SMALL_BATCH}", "--queue-chunks", str(SMALL_BATCH),
                           "--max-delay-ms", "0", "--drain-seconds", "60")  # fmt: skip
    yield running
    if running.process.poll() is None:
        running.terminate()


def test_full_queue_is_resource_exhausted_and_retry_gets_through(small_server: ServerProcess, mixed) -> None:
    codes: list[grpc.StatusCode] = []
    lock = threading.Lock()
    fbank, masks = mixed.fbank[:SMALL_BATCH], mixed.masks[:SMALL_BATCH]

    def call(_: int) -> None:
        with SpeakerClient(small_server.target, timeout_s=120, retry=NO_RETRY) as client:
            try:
                client.embed(fbank, masks)
                code = grpc.StatusCode.OK
            except grpc.RpcError as error:
                code = error.code()
        with lock:
            codes.append(code)

    before = scrape(small_server)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(call, range(8)))
    after = scrape(small_server)
    print(f"\ncodes of 8 concurrent calls of a full queue each: {[c.name for c in codes]}")
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes and grpc.StatusCode.OK in codes, codes
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    rejected = delta(before, after, "speakerd_requests_rejected_total{reason=queue_full}")
    assert rejected == codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED)
    # the client's retry with backoff gets every call through eventually
    retry = RetryPolicy(attempts=50, initial_backoff_s=0.1, max_backoff_s=1.0)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: SpeakerClient(small_server.target, 300, retry).embed(fbank, masks),
                                range(4)))  # fmt: skip
    assert len(results) == 4


def test_expired_deadline_costs_no_engine_work(small_server: ServerProcess, mixed) -> None:
    before = scrape(small_server)
    with ThreadPoolExecutor(PIPELINE_DEPTH) as pool:
        # one full batch per engine worker: all busy for ~1 s each (smaller requests would
        # share a batch and leave a worker free to serve the next call in time), each sent
        # once the one before has left the one-batch queue
        busy = []
        for index in range(PIPELINE_DEPTH):
            call = SpeakerClient(small_server.target, 120).embed
            busy.append(pool.submit(call, mixed.fbank[:SMALL_BATCH], mixed.masks[:SMALL_BATCH]))
            wait_for(lambda index=index: delta(before, scrape(small_server), TAKEN) > index,
                     f"busy call {index} taken by a worker")  # fmt: skip
        with (
            SpeakerClient(small_server.target, retry=NO_RETRY) as client,
            pytest.raises(grpc.RpcError) as raised,
        ):
            client.embed(mixed.fbank[:2], mixed.masks[:2], timeout_s=0.05)
        for future in busy:
            future.result()
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    reasons = [f"speakerd_requests_rejected_total{{reason={r}}}" for r in ("deadline_exceeded", "cancelled")]
    wait_for(lambda: sum(delta(before, scrape(small_server), key) for key in reasons) >= 1,
             "the expired call counted")  # fmt: skip
    after = scrape(small_server)
    embedded = delta(before, after, "speakerd_chunks_embedded_total{}")
    expected = SMALL_BATCH * PIPELINE_DEPTH
    assert embedded == expected, f"{embedded} chunks embedded; only the busy requests' {expected} should be"
    dropped = sum(delta(before, after, key) for key in reasons)
    assert dropped == 1, f"rejections {dropped}"


def test_sigterm_drains_in_flight_requests(small_server: ServerProcess, mixed, direct) -> None:
    """A call of one full batch (~1 s of engine time), its run begun, is in flight when the
    SIGTERM comes (and likely still through the health check and the refused call after)."""
    before = scrape(small_server)
    with ThreadPoolExecutor(1) as pool:
        in_flight = pool.submit(SpeakerClient(small_server.target, 120, NO_RETRY).embed,
                                mixed.fbank[:SMALL_BATCH], mixed.masks[:SMALL_BATCH])  # fmt: skip
        wait_for(lambda: delta(before, scrape(small_server), TAKEN) >= 1, "the call's first batch begun")
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
    assert np.array_equal(result.embeddings, direct[:SMALL_BATCH]), (
        "the in-flight request did not complete intact"
    )
    assert small_server.process.wait(60) == 0, small_server.log()
    print(f"\ndrained and exited in {time.monotonic() - started:.2f} s")
    assert small_server.index_of("draining") >= 0 and small_server.index_of("stopped after") >= 0
