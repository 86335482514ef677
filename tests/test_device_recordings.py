"""A recording's audio on its home device with `serve --devices` (serving/devices/
remote_recording.py, worker_recordings.py), on two CPU worker processes standing in for GPUs.

What is checked, on real workers, shared memory and pipes:
- recordings are spread by the recordings each device holds, and each closes its place;
- samples and raw PCM sent in audio slots of a few hundred KiB give the windows the host
  computes from the same audio, bit for bit, copied back through the slots;
- a batch naming a recording's windows runs on its home device and gives the rows the same
  windows give from the host;
- bad audio is the worker's InputError naming `audio`, and the device serves on;
- the workers' segmentation gives the host's multilabel rows, from samples sent or (a
  recording the server segments) from the samples its worker decoded and kept; a linkage a
  device cannot take
  is MemoryError (the caller links on the host);
- a home device killed: its recordings fail with RecordingFailed (UNAVAILABLE, retry), the
  next recording and the next segmentation go to the device left.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from speakerd.engine.cpu_segmenter import CpuSegmenter
from speakerd.model.architecture import CHUNK_SAMPLES
from speakerd.model.fbank import STEP_SAMPLES
from speakerd.model.fbank import fbank as fbank_of
from speakerd.model.inputs import InputError
from speakerd.model.numerics import BOUNDS, Math, compare, pad_speakers
from speakerd.model.recording import Encoding, RecordingDecoder, SharedFrames
from speakerd.model.segmentation.samples import Segmentable, SegmentingSource
from speakerd.model.segmentation.weights import load_model
from speakerd.serving.devices.device_pool import DevicePool, PoolConfig
from speakerd.serving.devices.remote_compute import RemoteLinkage, RemoteSegmenter
from speakerd.serving.devices.remote_recording import RecordingFailed, RemoteFrames
from speakerd.serving.devices.waveforms import CHUNK_BYTES, HostWaveforms
from speakerd.serving.observability.metrics import Metrics

pytestmark = pytest.mark.slow  # two CPU worker processes: seconds of 2 cores

#: Audio slots of one waveform chunk (the least a pool takes), two fbank rows: a 25 s
#: recording's samples take 3 slots, its PCM at 48 kHz stereo 8, a host copy of its windows
#: 9, and 2 waveform chunks 2: every op is split, as an hour's are.
AUDIO_BYTES = CHUNK_BYTES
#: 25.3 s of audio: 17 windows at 1 s steps, the last one (from 16 s) zero-padded.
SECONDS = 25.3
WINDOWS = 17
PLAN = 2
WAIT_S = 60.0


@pytest.fixture(scope="module")
def pool(weights_path, segmentation_path):
    config = PoolConfig(
        "cpu", str(weights_path), Math.FP32, (PLAN,), (0, 1), segmentation=str(segmentation_path)
    )
    pool = DevicePool(config, Metrics(), audio_bytes=AUDIO_BYTES)
    pool.start()
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def audio() -> np.ndarray:
    rng = np.random.default_rng(54)
    t = np.arange(int(SECONDS * 16_000)) / 16_000
    tone = 0.3 * np.sin(2 * np.pi * 220 * t) * (1 + np.sin(2 * np.pi * 0.3 * t))
    return (tone + 0.05 * rng.standard_normal(t.shape)).astype(np.float32)


def host_windows(audio: np.ndarray) -> np.ndarray:
    source = SharedFrames(STEP_SAMPLES)
    source.push(audio)
    return source.windows(0, source.finish())


def test_workers_may_start_processes_of_their_own(pool: DevicePool) -> None:
    """A GPU worker's engine times its first start's cuDNN plans in processes it starts
    (engine/gpu/tuning_pool.py); a daemonic worker may not, and failed its start on an H100
    ("daemonic processes are not allowed to have children")."""
    daemonic = {device: worker.process.daemon for device, worker in pool._workers.items()}
    assert daemonic == {0: False, 1: False}, daemonic


def test_recordings_are_spread_and_each_closes_its_place(pool: DevicePool) -> None:
    first, second, third = (pool.fbank_source(STEP_SAMPLES) for _ in range(3))
    assert [first.pool_device, second.pool_device, third.pool_device] == [0, 1, 0]
    assert [pool.recordings(0), pool.recordings(1)] == [2, 1]
    gauge = [pool.metrics.device_recordings.labels(device=str(d))._value.get() for d in (0, 1)]
    assert gauge == [2, 1], gauge
    first.close()
    first.close()  # idempotent: the place is given back once
    third.close()
    second.close()
    assert [pool.recordings(0), pool.recordings(1)] == [0, 0]
    assert [pool.metrics.device_recordings.labels(device=str(d))._value.get() for d in (0, 1)] == [0, 0]


def test_samples_in_slots_give_the_hosts_windows_bit_for_bit(pool: DevicePool, audio: np.ndarray) -> None:
    source = pool.fbank_source(STEP_SAMPLES)
    try:
        for piece in np.array_split(audio, 7):  # pieces that cut windows and slots anywhere
            source.push(piece)
        windows = source.finish()
        expected = host_windows(audio)
        assert windows == expected.shape[0] == WINDOWS, (windows, expected.shape)
        served = np.asarray(source.windows(0, windows))  # back through the slots, 2 rows a time
        assert served.dtype == np.float32 and np.array_equal(served, expected), np.abs(
            served - expected
        ).max()
        assert np.array_equal(np.asarray(source.windows(3, 8)[1:4]), expected[4:7]), "slices name their rows"
    finally:
        source.close()


def test_raw_pcm_is_decoded_in_the_worker_as_on_the_host(pool: DevicePool, audio: np.ndarray) -> None:
    rate, channels = 48_000, 2
    stereo = np.repeat(np.interp(np.arange(len(audio) * 3) / 3, np.arange(len(audio)), audio), channels)
    pcm = (stereo * 32767).astype("<i2").tobytes()
    frame = 2 * channels
    local = RecordingDecoder(rate, channels, Encoding.S16, SharedFrames(STEP_SAMPLES))
    source = pool.fbank_source(STEP_SAMPLES)
    remote = RecordingDecoder(rate, channels, Encoding.S16, source)  # hands it raw PCM (begin_pcm)
    try:
        for start in range(0, len(pcm), 123_457 * frame):  # the server's decoder keeps whole frames
            piece = pcm[start : start + 123_457 * frame]
            local.push(piece)
            remote.push(piece)
        assert source.ready() >= 1, "windows become ready while the audio arrives"
        windows = remote.finish()
        assert windows == local.finish()
        assert np.array_equal(np.asarray(source.windows(0, windows)), local.source.windows(0, windows))
    finally:
        source.close()


def test_a_batch_of_a_recordings_windows_runs_on_its_home(
    pool: DevicePool, audio: np.ndarray, reference_cases
) -> None:
    masks = pad_speakers(reference_cases[-1].masks[:PLAN])
    holder = pool.fbank_source(STEP_SAMPLES)  # device 0: the recording below goes to device 1
    source = pool.fbank_source(STEP_SAMPLES)
    try:
        source.push(audio)
        source.finish()
        before = [pool.metrics.device_batches.labels(device=str(d))._value.get() for d in (0, 1)]
        served = pool.run_batch([source.windows(5, 6), source.windows(6, 7)], [masks[:1], masks[1:]])
        after = [pool.metrics.device_batches.labels(device=str(d))._value.get() for d in (0, 1)]
        assert source.pool_device == 1 and [b - a for a, b in zip(before, after, strict=True)] == [0, 1]
        from_host = pool.run_batch(host_windows(audio)[5:7], masks)
        parity = compare(served.embeddings, from_host.embeddings)
        print(f"\nrecording's windows named vs copied from the host: {parity}")
        assert parity.within(BOUNDS[Math.FP32]), parity
    finally:
        source.close()
        holder.close()


def test_a_batch_of_a_recording_that_ended_fails_alone(pool: DevicePool, audio: np.ndarray) -> None:
    """A call that ended (its source closed) while one of its batches was still on the way:
    the worker no longer holds the windows, so that batch fails, and only it: the device is
    not taken out and the next recording is served."""
    source = pool.fbank_source(STEP_SAMPLES)
    source.push(audio[:160_000])
    windows = source.windows(0, 1)
    source.close()
    # the close is applied in order with the device's other recording ops, and answers
    # nothing: an op of another recording on the same device, answered, comes after it
    flush = pool.fbank_source(STEP_SAMPLES)
    assert flush.pool_device == source.pool_device
    flush.push(audio[:16_000])
    flush.close()
    live = pool.live_devices
    with pytest.raises(RuntimeError, match="is not open on this device"):
        pool.run_batch(windows, np.ones((1, 3, 589), dtype=np.float32))
    assert pool.live_devices == live
    again = pool.fbank_source(STEP_SAMPLES)
    try:
        again.push(audio)
        assert again.finish() == WINDOWS
    finally:
        again.close()


def test_waveform_chunks_get_their_fbank_in_the_worker(
    pool: DevicePool, audio: np.ndarray, reference_cases, monkeypatch
) -> None:
    """EmbedChunks' waveform input: the pool keeps the waveforms (HostWaveforms) and the
    worker running their batch makes their fbank, here one chunk an audio slot; the rows
    are those of the host's fbank of the same chunks, beside a plain fbank piece."""
    masks = pad_speakers(reference_cases[-1].masks[:PLAN])
    waveforms = np.stack([audio[:CHUNK_SAMPLES], audio[STEP_SAMPLES : STEP_SAMPLES + CHUNK_SAMPLES]])
    kept = pool.waveform_fbank(waveforms)
    assert isinstance(kept, HostWaveforms) and kept.shape == (2, 998, 80)
    with monkeypatch.context() as patched:  # no fbank of theirs is made on this host
        patched.setattr(HostWaveforms, "_to_host", lambda rows: pytest.fail("fbank made on the host"))
        both = pool.run_batch([kept], [masks])
        mixed = pool.run_batch([fbank_of(waveforms[:1]), kept[1:]], [masks[:1], masks[1:]])
    from_host = pool.run_batch(fbank_of(waveforms), masks)
    for served in (both, mixed):
        parity = compare(served.embeddings, from_host.embeddings)
        assert parity.within(BOUNDS[Math.FP32]) and parity.max_abs == 0.0, parity
    assert np.array_equal(np.asarray(kept), fbank_of(waveforms)), "a host copy is the host's fbank"


def test_a_batch_of_waveforms_then_a_recordings_windows_keeps_its_row_order(
    pool: DevicePool, audio: np.ndarray, reference_cases
) -> None:
    """A recording's batch may take unbound requests too: here a waveform chunk at row 0 and
    a recording's window at row 1, each named in the run message, in row order."""
    masks = pad_speakers(reference_cases[-1].masks[:PLAN])
    source = pool.fbank_source(STEP_SAMPLES)
    try:
        source.push(audio)
        source.finish()
        waveform = audio[None, 3 * STEP_SAMPLES : 3 * STEP_SAMPLES + CHUNK_SAMPLES]
        served = pool.run_batch([pool.waveform_fbank(waveform), source.windows(5, 6)], [masks[:1], masks[1:]])
        from_host = pool.run_batch(np.concatenate([fbank_of(waveform), host_windows(audio)[5:6]]), masks)
        parity = compare(served.embeddings, from_host.embeddings)
        assert parity.within(BOUNDS[Math.FP32]) and parity.max_abs == 0.0, parity
    finally:
        source.close()


def test_bad_audio_is_the_workers_input_error(pool: DevicePool) -> None:
    source = pool.fbank_source(STEP_SAMPLES)
    try:
        decoder = RecordingDecoder(16_000, 1, Encoding.F32, source)
        samples = np.zeros(16_000, dtype="<f4")
        samples[100] = np.nan
        with pytest.raises(InputError, match="audio") as raised:
            decoder.push(samples.tobytes())
        assert raised.value.field == "audio", raised.value
    finally:
        source.close()
    again = pool.fbank_source(STEP_SAMPLES)
    try:
        again.push(np.zeros(16_000, dtype=np.float32))
        assert again.finish() == 1, "the device serves the next recording"
    finally:
        again.close()


def test_the_workers_segment_as_the_host_does(pool: DevicePool, audio: np.ndarray, segmentation_path) -> None:
    """A segmenting call's groups of windows go to the workers' segmentation engines, the
    least busy first; the multilabel rows are those of the same engine on the host."""
    segmenter = pool.segmenter()
    assert isinstance(segmenter, RemoteSegmenter) and segmenter.name == "devices/cpu-numpy", segmenter
    host = CpuSegmenter(load_model(segmentation_path))
    assert (segmenter.model_id, segmenter.max_windows) == (host.model_id, host.max_windows)
    starts = np.arange(0, 4) * STEP_SAMPLES
    served = segmenter.segment(audio, starts)
    expected = host.segment(audio, starts)
    assert served.multilabel.shape == (4, 589, 3) and served.multilabel.dtype == np.uint8
    assert np.array_equal(served.multilabel, expected.multilabel)


def test_a_segmenting_recording_is_decoded_kept_and_segmented_in_its_worker(
    pool: DevicePool, audio: np.ndarray, segmentation_path
) -> None:
    """A recording the server segments: its raw PCM goes to the worker, which decodes it,
    keeps its samples for the segmenter and segments each group there; the windows, the
    multilabel rows and the samples kept are those of the same audio on the host."""
    pcm = (audio * 32767).astype("<i2").tobytes()
    host_source = SegmentingSource(SharedFrames(STEP_SAMPLES), STEP_SAMPLES)
    local = RecordingDecoder(16_000, 1, Encoding.S16, host_source)
    source = pool.segmenting_source(STEP_SAMPLES)
    remote = RecordingDecoder(16_000, 1, Encoding.S16, source)
    segmenter, host = pool.segmenter(), CpuSegmenter(load_model(segmentation_path))
    assert isinstance(source, Segmentable) and segmenter is not None
    try:
        for start in range(0, len(pcm), 2 * 70_001):
            local.push(pcm[start : start + 2 * 70_001])
            remote.push(pcm[start : start + 2 * 70_001])
        assert source.segmentable() == host_source.segmentable() > 0
        assert source.kept_samples == host_source.kept_samples > 0, "the worker keeps what the host would"
        first, kept, starts = source.take(4)
        _, samples, host_starts = host_source.take(4)
        assert first == 0 and np.array_equal(starts, host_starts), (starts, host_starts)
        served = segmenter.segment(kept, starts).multilabel
        assert np.array_equal(served, host.segment(samples, host_starts).multilabel)
        assert source.kept_samples == host_source.kept_samples, "the samples of segmented windows are let go"
        windows = remote.finish()
        assert windows == local.finish() == source.segmentable() == WINDOWS
        rest = windows - 4
        first, kept, starts = source.take(rest)
        _, samples, host_starts = host_source.take(rest)
        assert first == 4 and np.array_equal(starts[: rest - 1], host_starts[: rest - 1])
        assert np.array_equal(
            segmenter.segment(kept, starts).multilabel, host.segment(samples, host_starts).multilabel
        )
        assert np.array_equal(np.asarray(source.windows(0, windows)), host_source.windows(0, windows))
        assert source.kept_samples == 0 == host_source.kept_samples
    finally:
        source.close()


def test_a_linkage_a_device_cannot_take_is_linked_on_the_host(pool: DevicePool) -> None:
    """CPU workers have no device linkage: the pool offers none, and a call sent anyway is
    answered MemoryError, what a GPU without the memory answers, so the caller links on
    the host."""
    assert pool.centroid_linkage() is None
    with pytest.raises(MemoryError, match="linkage does not take 10 rows"):
        RemoteLinkage(pool, max_rows=100)(np.ones((10, 4)))


def test_a_recordings_home_lost_fails_it_and_the_next_goes_elsewhere(
    pool: DevicePool, audio: np.ndarray
) -> None:
    """Last in this module: it kills device 0's worker."""
    source = pool.fbank_source(STEP_SAMPLES)
    assert source.pool_device == 0
    source.push(audio[:160_000])
    masks = np.ones((1, 3, 589), dtype=np.float32)
    os.kill(pool.pid(0), signal.SIGKILL)
    deadline = time.monotonic() + WAIT_S
    while 0 in pool.live_devices and time.monotonic() < deadline:
        time.sleep(0.02)
    message = "device 0, which held this recording's audio, failed; retry the call"
    with pytest.raises(RecordingFailed, match=message):
        source.push(audio[160_000:])
    with pytest.raises(RecordingFailed, match=message):
        pool.run_batch(source.windows(0, 1), masks)
    source.close()
    after = pool.fbank_source(STEP_SAMPLES)
    try:
        assert after.pool_device == 1
        after.push(audio)
        assert after.finish() == WINDOWS
    finally:
        after.close()
    segmenter = pool.segmenter()
    assert segmenter is not None
    assert segmenter.segment(audio, np.zeros(1, dtype=np.int64)).multilabel.shape == (1, 589, 3), (
        "segmentation holds no state: it goes to the device left"
    )


def test_a_lost_home_is_answered_unavailable_for_the_client_to_retry() -> None:
    import grpc

    from speakerd.serving.api.errors import batcher_rejection

    rejection = batcher_rejection(RecordingFailed("device 1, which held this recording's audio, failed"))
    assert (rejection.code, rejection.reason) == (grpc.StatusCode.UNAVAILABLE, "no_device"), rejection


def test_a_stale_state_never_overwrites_a_later_one() -> None:
    """A push's answer and a segmentation's may cross on their way back: the state read later
    in the worker (the higher version) stands, or a stale count of kept samples could hold
    the call's reader back for good."""

    class Link:
        audio_bytes = AUDIO_BYTES

        def forget(self, device: int, recording: int) -> None:
            pass

    frames = RemoteFrames(Link(), 0, STEP_SAMPLES, segmenting=True)  # type: ignore[arg-type]
    frames._answered((2, 5, 5, 48_000))  # after a segmentation let samples go
    frames._answered((1, 5, 5, 900_000))  # a push's answer, read before it, arriving after
    assert (frames.ready(), frames.segmentable(), frames.kept_samples) == (5, 5, 48_000)
    frames._answered((3, 6, 6, 64_000))
    assert (frames.ready(), frames.kept_samples) == (6, 64_000)
