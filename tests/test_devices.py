"""`serve --devices` with CPU engines standing in for GPUs: `--engine cpu --devices 0,1` runs
two worker processes, each with its own ONNX Runtime engine on one core (the same code path
as GPUs, less the CUDA_VISIBLE_DEVICES each GPU worker sets).

What is checked, on real worker processes, shared memory and pipes:
- SERVING only after every device's engine passed its self-check;
- a request spread over both devices gets its rows back in its own order;
- a recording's batches all run on its home device, with the rows of its windows as chunks;
- a segmenting recording is segmented by the workers' segmentation engines;
- waveform chunks get their fbank in the worker that runs their batch;
- a worker killed mid-load: every request still gets correct embeddings (its batches in
  flight re-ran on the other device), the failure is counted and logged, and the server
  keeps SERVING; with the last device gone, NOT_SERVING and UNAVAILABLE;
- an engine error takes its device out and the batch re-runs elsewhere; the same batch
  failing again on a second device fails the batch (INTERNAL), not that device.
The choice of device alone is tested as plain data in tests/test_device_table.py.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from speakerd.client.cli import main as client_main
from speakerd.client.client import NO_RETRY
from speakerd.client.diarize import DiarizationClient
from speakerd.model.architecture import EMBEDDING_DIM, MAX_SPEAKERS, SAMPLE_RATE
from speakerd.model.audio import speaker_masks, synthetic_recording
from speakerd.model.fbank import chunk_recording
from speakerd.model.fbank import fbank as fbank_of
from speakerd.model.numerics import BOUNDS, Math, compare, pad_speakers
from speakerd.serving.batching.queue import NoDevice
from speakerd.serving.devices.device_pool import DevicePool, PoolConfig, shared_bytes_per_device
from speakerd.serving.devices.shared_slots import shared_memory_free
from speakerd.serving.observability.metrics import Metrics
from speakerd.serving.receivers.receiver_link import SLOT_BYTES, SLOTS_PER_RECEIVER
from speakerd.serving.server import config as serve_config
from speakerd.serving.server.serve import _check_shared_memory
from tests.serving import ServerProcess, scrape, start_server, wait_until

pytestmark = pytest.mark.slow  # servers of several CPU workers: seconds of 2 cores a test

#: Small plans keep each CPU batch short (b1 ~0.15 s on one core) while a request of 3
#: chunks already spans two batches, so both devices hold work at once. (b4 took 5 chunks
#: for that, and 5 `load` streams: see LOAD_STREAMS.)
PLANS = "1,2"
#: One chunk more than a b2 batch: a request of these is a b2 and a b1 batch at once, one
#: on each device.
OVER_BOTH_CHUNKS = 3
#: The killed worker's load: REQUESTS concurrent requests of CHUNKS_PER_REQUEST chunks,
#: each its own rows (so rows answered to the wrong request would show), each one full b2
#: batch: two or three in flight on the two devices (the batcher's PIPELINE_DEPTH) and one
#: queued when device 1 is killed. (Six of 4 chunks checked the same with three times the
#: engine work.)
CHUNKS_PER_REQUEST = 2
REQUESTS = 4
#: `load`'s streams of one chunk: one more than a b2 batch holds, so two batches are in
#: flight at once and the least-loaded rule gives the second to device 1 (2 streams would
#: fit one batch at a time, which the rule always gives device 0). `load` runs three calls'
#: time of all its streams: each stream more lengthens the run (5 streams over b4 plans
#: ran 5/3 as long for the same check).
LOAD_STREAMS = 3
#: The engine-error pool's one plan: batches of up to 2 chunks, and the least self-check
#: work for each of its three workers to start (the check runs each plan on the fewest
#: chunks that select it: 1 + 2 chunks for the server's b1 and b2, 1 for b2 alone).
POOL_PLAN = 2
#: How long a test waits for something the server does within a second or two (a worker's
#: death noticed, a batch in flight), on a loaded 2-core machine.
WAIT_S = 60.0
WORKER_PIDS = re.compile(r"worker pids \[(?P<pids>[\d, ]+)\]")


@pytest.fixture(scope="module")
def server(weights_path):
    running = start_server(weights_path, "--devices", "0,1", "--plans", PLANS)
    yield running
    assert running.terminate() == 0, running.log()


@pytest.fixture(scope="module")
def expected(reference_cases) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(fbank, masks, embeddings) of the mixed case's first chunks (every one a test sends),
    the embeddings its ONNX Runtime reference rows: what docs/parity.md's FP32 bound holds
    every engine to (an engine built here to compute them cost ~5 s of CPU per run)."""
    case = reference_cases[-1]
    chunks = max(OVER_BOTH_CHUNKS, REQUESTS * CHUNKS_PER_REQUEST)
    rows = case.output.reshape(case.chunks, MAX_SPEAKERS, EMBEDDING_DIM)
    return case.fbank[:chunks], case.masks[:chunks], rows[:chunks]


def worker_pids(server: ServerProcess) -> list[int]:
    match = WORKER_PIDS.search(server.log())
    assert match, server.log()
    return [int(pid) for pid in match["pids"].split(",")]


def assert_within_fp32(served: np.ndarray, reference: np.ndarray) -> None:
    parity = compare(served, reference)
    assert parity.within(BOUNDS[Math.FP32]), parity


wait_for = functools.partial(wait_until, timeout_s=WAIT_S)


def test_serving_only_after_every_device_passed_its_self_check(server: ServerProcess) -> None:
    assert server.health_seen[0] != "SERVING" and server.health_seen[-1] == "SERVING", server.health_seen
    serving = server.index_of("SERVING speakerd")
    for device in (0, 1):
        checked = server.index_of(f"device {device} speakerd.reference.self_check")
        assert 0 <= checked < serving, (device, checked, serving, server.log())
    assert 0 <= server.index_of("devices [0, 1] ready") < serving
    samples = scrape(server)
    assert samples["speakerd_device_up{device=0}"] == 1 and samples["speakerd_device_up{device=1}"] == 1


def test_a_request_over_both_devices_keeps_its_order(server: ServerProcess, expected) -> None:
    fbank, masks, reference = expected
    before = scrape(server)
    with server.client() as client:
        served = client.embed(fbank[:OVER_BOTH_CHUNKS], masks[:OVER_BOTH_CHUNKS], timeout_s=WAIT_S)
    after = scrape(server)
    assert_within_fp32(served.embeddings, reference[:OVER_BOTH_CHUNKS, : masks.shape[1]])
    ran = {d: after[f"speakerd_device_batches_total{{device={d}}}"] - before.get(
        f"speakerd_device_batches_total{{device={d}}}", 0.0) for d in (0, 1)}  # fmt: skip
    assert ran[0] > 0 and ran[1] > 0, (
        f"{OVER_BOTH_CHUNKS} chunks in plans {PLANS} ran on {ran}: one device idle"
    )


def test_load_reports_batches_per_device(server: ServerProcess, capsys) -> None:
    """LOAD_STREAMS one-chunk streams keep two batches in flight, so both devices get work."""
    flags = ["--target", server.target, "--streams", str(LOAD_STREAMS), "--seconds", "1", "--warmup", "0",
             "--chunks", "1", "--metrics-url", server.metrics_url]  # fmt: skip
    assert client_main(["load", *flags]) == 0
    report = json.loads(capsys.readouterr().out)
    batches = report["device_batches"]
    assert sorted(batches) == ["0", "1"] and min(batches.values()) > 0, report


def test_a_recording_runs_on_its_home_device_as_its_chunks_would(server: ServerProcess) -> None:
    """EmbedRecording through `--devices`: the audio goes to one worker, which computes the
    fbank, and every batch of the recording runs there; the rows are those of the same
    windows sent as fbank chunks (EmbedChunks, the client's own fbank)."""
    recording = synthetic_recording(seconds=14.0, seed=14)
    chunks = chunk_recording(recording.samples)
    masks = speaker_masks(recording, chunks.starts)
    before = scrape(server)
    with server.client() as client:
        served = client.embed_recording(recording.samples, SAMPLE_RATE, masks, timeout_s=WAIT_S)
        after = scrape(server)
        as_chunks = client.embed(fbank_of(chunks.waveforms), masks, timeout_s=WAIT_S)
    counter = "speakerd_device_batches_total{{device={}}}"
    ran = {d: after.get(counter.format(d), 0.0) - before.get(counter.format(d), 0.0) for d in (0, 1)}
    assert sorted(ran.values())[0] == 0 and sorted(ran.values())[1] > 0, f"one home device: {ran}"
    assert_within_fp32(served.embeddings, as_chunks.embeddings)


def test_waveform_chunks_get_their_fbank_in_a_worker(server: ServerProcess) -> None:
    """EmbedChunks' waveform input through `--devices`: the worker running each batch makes
    the fbank; the rows are those of the same chunks sent as the client's fbank."""
    recording = synthetic_recording(seconds=12.0, seed=16)
    chunks = chunk_recording(recording.samples)
    masks = speaker_masks(recording, chunks.starts)
    with server.client() as client:
        served = client.embed_waveform(chunks.waveforms, masks, timeout_s=WAIT_S)
        as_fbank = client.embed(fbank_of(chunks.waveforms), masks, timeout_s=WAIT_S)
    assert_within_fp32(served.embeddings, as_fbank.embeddings)


def test_a_segmenting_recording_is_segmented_by_the_workers(server: ServerProcess) -> None:
    """`segment` through `--devices`: each worker built the segmentation model beside its
    engine and the server's segmentation calls go to them; the rows pooled under the served
    segmentation are those the same masks give when the client sends them."""
    for device in (0, 1):
        built = f"device {device} speakerd.serving.devices.device_worker: segmentation model"
        assert server.index_of(built) >= 0, server.log()
    recording = synthetic_recording(seconds=14.0, seed=15)
    with server.client() as client:
        segmented = client.embed_recording(recording.samples, SAMPLE_RATE, None, timeout_s=WAIT_S)
        masks = np.ascontiguousarray(segmented.segmentation.transpose(0, 2, 1), dtype=np.float32)
        given = client.embed_recording(recording.samples, SAMPLE_RATE, masks, timeout_s=WAIT_S)
    assert segmented.segmentation.shape == (5, 589, 3), segmented.segmentation.shape
    assert_within_fp32(segmented.embeddings, given.embeddings)
    with DiarizationClient(server.target, timeout_s=WAIT_S) as client:
        diarized = client.diarize(recording.samples, SAMPLE_RATE)  # the same path, then the clustering
    assert diarized.windows == 5 and diarized.turns, diarized


def test_a_worker_killed_mid_load_loses_no_request(server: ServerProcess, expected) -> None:
    fbank, masks, reference = expected
    doomed = worker_pids(server)[1]

    def one(index: int) -> np.ndarray:
        rows = slice(index * CHUNKS_PER_REQUEST, (index + 1) * CHUNKS_PER_REQUEST)
        with server.client() as client:
            return client.embed(fbank[rows], masks[rows], timeout_s=WAIT_S).embeddings

    with ThreadPoolExecutor(REQUESTS) as pool:
        futures = [pool.submit(one, index) for index in range(REQUESTS)]
        wait_for(lambda: scrape(server).get("speakerd_device_inflight_batches{device=1}", 0) >= 1,
                 "a batch in flight on device 1", server)  # fmt: skip
        os.kill(doomed, signal.SIGKILL)
        served = [future.result() for future in futures]  # each raises if its call failed
    for index, embeddings in enumerate(served):
        rows = slice(index * CHUNKS_PER_REQUEST, (index + 1) * CHUNKS_PER_REQUEST)
        assert_within_fp32(embeddings, reference[rows, : masks.shape[1]])
    samples = scrape(server)
    assert samples["speakerd_device_failures_total{device=1}"] == 1, samples
    assert samples["speakerd_device_failures_total{device=0}"] == 0, samples
    assert samples["speakerd_device_up{device=1}"] == 0 and samples["speakerd_device_up{device=0}"] == 1
    assert any("ERROR" in line and "device 1 taken out" in line for line in server.lines), server.log()
    with server.client() as client:
        assert client.health() == "SERVING"


def test_with_no_device_left_not_serving_and_unavailable(server: ServerProcess, expected) -> None:
    fbank, masks, _ = expected
    os.kill(worker_pids(server)[0], signal.SIGKILL)
    with server.client() as client:
        wait_for(lambda: client.health() == "NOT_SERVING", "NOT_SERVING", server)
    with server.client(retry=NO_RETRY) as client, pytest.raises(grpc.RpcError) as raised:
        client.embed(fbank[:1], masks[:1], timeout_s=WAIT_S)
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE, raised.value
    assert "every device of --devices failed" in raised.value.details()
    samples = scrape(server)
    assert samples["speakerd_requests_rejected_total{reason=no_device}"] >= 1, samples
    assert samples["speakerd_device_failures_total{device=0}"] == 1


def test_an_engine_error_takes_its_device_out_once(weights_path, expected) -> None:
    """Three CPU workers, batches sent one at a time (so each goes to the idle device of
    lowest index). Batch A raises on device 0 and again on device 1: the batch's fault, so A
    fails and only device 0 is out. Batch B raises on device 1: out, and B re-runs on
    device 2. With device 2 killed no device is left: NoDevice, and the server is told."""
    fbank, masks, reference = expected
    padded, speakers = pad_speakers(masks), masks.shape[1]
    lost: list[tuple[int, int]] = []
    faults = {0: (1,), 1: (1, 2)}  # device -> its batches (1-based) whose engine run raises
    config = PoolConfig("cpu", str(weights_path), Math.FP32, (POOL_PLAN,), (0, 1, 2), fail_batches=faults)
    pool = DevicePool(config, Metrics(), on_lost=lambda device, left: lost.append((device, left)))
    pool.start()
    try:
        with pytest.raises(RuntimeError, match="engine error on device 0 and again on device 1"):
            pool.run_batch(fbank[:2], padded[:2])
        assert lost == [(0, 2)] and pool.live_devices == (1, 2)
        run = pool.run_batch(fbank[2:4], padded[2:4])
        assert lost == [(0, 2), (1, 1)] and pool.live_devices == (2,)
        assert_within_fp32(run.embeddings[:, :speakers], reference[2:4])
        failures = {device: pool.metrics.device_failures.labels(device=str(device))._value.get()
                    for device in (0, 1, 2)}  # fmt: skip
        assert failures == {0: 1, 1: 1, 2: 0}
        os.kill(pool.pid(2), signal.SIGKILL)  # seen by its reply reader although idle
        deadline = time.monotonic() + WAIT_S
        while len(lost) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert lost == [(0, 2), (1, 1), (2, 0)]
        with pytest.raises(NoDevice, match="every device of --devices failed"):
            pool.run_batch(fbank[:1], padded[:1])
    finally:
        pool.close()


def test_too_little_shared_memory_is_a_usage_error_before_start() -> None:
    """A write past the end of /dev/shm is a SIGBUS mid-batch: the room for the devices'
    batch slots and the receivers' request slots is checked first, naming the flag."""
    free = shared_memory_free()
    if free is None:
        pytest.skip("no /dev/shm on this system")
    per_device = shared_bytes_per_device(serve_config.MAX_PLAN_SIZE)
    per_receiver = SLOTS_PER_RECEIVER * SLOT_BYTES
    _check_shared_memory(1, serve_config.MAX_PLAN_SIZE, 0)  # one device's slots fit here
    too_much = r"\(\d+ MB\): need \d+ MB of shared memory in /dev/shm"
    with pytest.raises(serve_config.UsageError, match="--devices " + too_much):
        _check_shared_memory(free // per_device + 1, serve_config.MAX_PLAN_SIZE, 0)
    with pytest.raises(serve_config.UsageError, match="--receivers " + too_much):
        _check_shared_memory(0, serve_config.MAX_PLAN_SIZE, free // per_receiver + 1)
