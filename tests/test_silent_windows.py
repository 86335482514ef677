"""Silent windows cost no engine work (issue 36): a window whose every speaker mask is empty
is answered with the engine's empty-mask rows (seg_1.bias) by the batcher and never reaches
the engine, on every path (EmbedChunks with fbank or waveform chunks, EmbedChunksStream,
EmbedRecording), and every row is the one today's path (every window through the engine)
gives, bit for bit. The CPU engine throughout; the service tests run a real
`python -m speakerd serve` on loopback.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time

import numpy as np
import pytest

from speakerd.client.recording import PIECE_BYTES
from speakerd.engine.base import BatchRun, Pieces, batch_inputs
from speakerd.engine.cpu import CpuEngine
from speakerd.model.architecture import EMBEDDING_DIM, FRAMES, MAX_SPEAKERS, MEL_BINS, TRUNK_FRAMES
from speakerd.model.audio import speaker_masks, synthetic_recording
from speakerd.model.fbank import chunk_recording, fbank
from speakerd.model.numerics import Math, resize_masks
from speakerd.model.recording import Encoding, RecordingDecoder, exclude_overlap
from speakerd.serving.batching.batcher import Batcher, DeadlinePassed, Draining, silent_windows
from speakerd.serving.observability.metrics import Metrics
from tests.serving import ServerProcess, scrape, start_server

pytestmark = pytest.mark.slow  # a CPU server doing seconds of engine work per test

#: Plans of the engines here: b4 keeps a CPU batch short while a request spans several, and
#: few windows with speech fill more than one batch (the batcher test's 6, the recording's 5).
PLANS = (1, 4)
MAX_BATCH = PLANS[-1]
TIMEOUT_S = 600.0
SKIPPED = "speakerd_windows_skipped_total{}"
EMBEDDED = "speakerd_chunks_embedded_total{}"
BATCHES = "speakerd_batch_size_chunks_count{}"
#: Mask frames of segmentation-3.0; the nearest resize onto 125 trunk frames reads frame
#: floor(t * 589 / 125), so frames 1-3 (between the reads of t = 0 and t = 1) are never read.
MASK_FRAMES = 589
UNREAD_FRAMES = [1, 2, 3]


class WatchedCpuEngine(CpuEngine):
    """The CPU engine, keeping the masks of every chunk `run_batch` is given."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.given: list[np.ndarray] = []
        self._given_lock = threading.Lock()

    def run_batch(self, fbank: Pieces, masks: Pieces) -> BatchRun:
        joined = batch_inputs(fbank, masks).joined()[1]
        with self._given_lock:
            self.given.append(joined)
        return super().run_batch(fbank, masks)

    def chunks_given(self) -> np.ndarray:
        """[k, 3, F] masks of every chunk given since the last `forget`."""
        with self._given_lock:
            return np.concatenate(self.given) if self.given else np.zeros((0, MAX_SPEAKERS, 1), np.float32)

    def forget(self) -> None:
        with self._given_lock:
            self.given.clear()


@pytest.fixture(scope="module")
def engine(folded_model) -> WatchedCpuEngine:
    return WatchedCpuEngine(folded_model, Math.FP32, PLANS)


def bias_rows(folded_model) -> np.ndarray:
    """[3, 256]: the row SPEC 1 documents for an empty mask, seg_1.bias, for each speaker."""
    return np.broadcast_to(folded_model.seg_bias, (MAX_SPEAKERS, EMBEDDING_DIM))


def identical(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit for bit (so -0.0 differs from 0.0 and NaN equals the same NaN)."""
    a, b = np.ascontiguousarray(a, np.float32), np.ascontiguousarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def speech_windows(seconds: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Waveform windows [n, 160000] of a synthetic speech recording and their masks [n, 3, 589]."""
    recording = synthetic_recording(seconds, seed=seed)
    chunks = chunk_recording(recording.samples)
    return chunks.waveforms, speaker_masks(recording, chunks.starts)


def silence(masks: np.ndarray, windows: list[int]) -> np.ndarray:
    """`masks` with every speaker of `windows` empty; some of them keep weight on frames the
    resize onto the trunk never reads, which are silent all the same."""
    out = masks.copy()
    out[windows] = 0.0
    for window in windows[::2]:
        out[window, 0, UNREAD_FRAMES] = 1.0
    return out


# --- what the engine gives an empty window, and which windows are silent ---------------


def test_an_empty_window_is_seg_1_bias_whatever_its_audio(engine: WatchedCpuEngine, folded_model) -> None:
    """Today's engine output for a window with every mask empty does not depend on the audio:
    it is seg_1.bias bit for bit (SPEC 1), for zeros, speech, and noise at the service's
    largest accepted fbank magnitude, with F = 589 or 125 and weight only on unread frames.
    So one measured row per model is every such window's row."""
    assert identical(engine.empty_rows(), bias_rows(folded_model))
    waveforms, _ = speech_windows(12.0, seed=3)
    rng = np.random.default_rng(5)
    windows = np.stack([
        np.zeros((FRAMES, MEL_BINS), np.float32),
        fbank(waveforms[:1])[0],
        (rng.uniform(-1, 1, (FRAMES, MEL_BINS)) * 1e4).astype(np.float32),
    ])  # fmt: skip
    for frames in (MASK_FRAMES, TRUNK_FRAMES):
        masks = np.zeros((len(windows), MAX_SPEAKERS, frames), np.float32)
        if frames == MASK_FRAMES:
            masks[1, :, UNREAD_FRAMES] = 1.0
        rows = engine.run_batch(windows, masks).embeddings
        for window in range(len(windows)):
            assert identical(rows[window], engine.empty_rows()), (frames, window)


def test_silent_means_no_weight_on_the_frames_the_trunk_pools() -> None:
    masks = np.ones((5, MAX_SPEAKERS, MASK_FRAMES), np.float32)
    masks[0] = 0.0  # nothing at all
    masks[1] = 0.0
    masks[1, :, UNREAD_FRAMES] = 1.0  # weight the nearest resize never reads
    masks[2] = 0.0
    masks[2, 2, 4] = 1e-30  # one read frame (t = 1), however light: a speaker
    masks[3, :2] = 0.0  # one speaker of three left
    assert silent_windows(masks).tolist() == [True, True, False, False, False]
    assert np.count_nonzero(resize_masks(masks[2])) == 1


# --- the batcher on the CPU engine ----------------------------------------------------


#: The chunks of the reference case mixed_b32 the batcher test sends: 13 of its 32 are enough
#: for two requests of 5 and 1 windows to run with silent ones between (6, more than a batch,
#: so the second batch holds windows of both), and they hold its padded last window, a short
#: recording's and one with an empty speaker (rows 16-18: cases.mixed_rows), which run, and
#: its one-frame and soft ones (19, 20), which go silent.
MIXED_CHUNKS = slice(11, 24)
#: Where the two requests meet: a run of silent windows straddles it.
SPLIT = 9


def run(test) -> None:  # type: ignore[no-untyped-def]
    asyncio.run(asyncio.wait_for(test(), TIMEOUT_S))


def metric(metrics: Metrics, name: str) -> float:
    return metrics.registry.get_sample_value(name) or 0.0


def test_mixed_requests_give_todays_rows_and_only_speech_reaches_the_engine(
    engine: WatchedCpuEngine, reference_cases
) -> None:
    """Two requests with silent windows alone, in runs, first and last: every row equals
    today's path (every window through the engine) bit for bit; the engine is given only
    the windows that are not silent, in full batches (4, then the rest) across the two."""
    mixed = reference_cases[-1]
    fbank_in = mixed.fbank[MIXED_CHUNKS]
    silent = [0, 2, 3, 8, 9, 10, 12]  # alone first and last, a run, a run across the requests
    masks = silence(mixed.masks[MIXED_CHUNKS], silent)
    today = engine.embed(fbank_in, masks).embeddings  # every window through the engine
    chunks = fbank_in.shape[0]
    voiced = chunks - len(silent)  # 5 in the first request, 1 in the second

    async def scenario() -> None:
        metrics = Metrics()
        batcher = Batcher(engine, metrics, max_delay_s=0.002, queue_chunks=64)
        batcher.start()
        engine.empty_rows()  # measured (the server does it at start-up): not counted below
        engine.forget()
        try:
            first, second = await asyncio.gather(
                batcher.submit(fbank_in[:SPLIT], masks[:SPLIT]),
                batcher.submit(fbank_in[SPLIT:], masks[SPLIT:]),
            )
        finally:
            await batcher.drain(TIMEOUT_S)
        rows = np.concatenate([first.embeddings, second.embeddings])
        for window in range(chunks):
            assert identical(rows[window], today[window]), f"window {window} differs from today's"
        given = engine.chunks_given()
        assert len(given) == voiced and not silent_windows(given).any(), (len(given), voiced)
        assert metric(metrics, "speakerd_windows_skipped_total") == len(silent)
        assert metric(metrics, "speakerd_chunks_embedded_total") == voiced
        assert metric(metrics, "speakerd_batch_size_chunks_count") == math.ceil(voiced / MAX_BATCH)

    run(scenario)


def test_a_request_of_silent_windows_alone_is_answered_without_the_engine(
    engine: WatchedCpuEngine, folded_model
) -> None:
    """Answered at once with seg_1.bias rows and no plan run; refused like any request while
    the server drains or once its deadline has passed."""
    rng = np.random.default_rng(9)
    fbank_rows = rng.standard_normal((5, FRAMES, MEL_BINS)).astype(np.float32)
    masks = silence(np.ones((5, MAX_SPEAKERS, MASK_FRAMES), np.float32), list(range(5)))

    async def scenario() -> None:
        metrics = Metrics()
        batcher = Batcher(engine, metrics, max_delay_s=0.002, queue_chunks=64)
        batcher.start()
        engine.empty_rows()
        engine.forget()
        result = await batcher.submit(fbank_rows, masks)
        assert all(identical(row, bias_rows(folded_model)) for row in result.embeddings)
        assert result.plans == [] and result.fp16_fallbacks == 0
        assert engine.chunks_given().shape[0] == 0, "a silent window reached the engine"
        assert metric(metrics, "speakerd_windows_skipped_total") == 5
        assert metric(metrics, "speakerd_chunks_embedded_total") == 0
        with pytest.raises(DeadlinePassed):
            await batcher.submit(fbank_rows, masks, deadline=time.monotonic() - 1.0)
        await batcher.drain(TIMEOUT_S)
        with pytest.raises(Draining):
            await batcher.submit(fbank_rows, masks)
        assert metric(metrics, "speakerd_windows_skipped_total") == 5

    run(scenario)


# --- through a real server ------------------------------------------------------------


@pytest.fixture(scope="module")
def server(weights_path):
    """A CPU server forming a batch as soon as a worker is free (--max-delay-ms 0), so each
    batch holds what was queued at that moment: the batch count shows how full they were."""
    running = start_server(
        weights_path, "--plans", ",".join(str(size) for size in PLANS), "--max-delay-ms", "0"
    )
    yield running
    assert running.terminate() == 0, running.log()


def delta(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_embed_chunks_fbank_waveform_and_stream_skip_silent_windows(
    server: ServerProcess, engine: WatchedCpuEngine, folded_model
) -> None:
    """fbank and waveform chunks over EmbedChunks, and a stream of three requests (one of
    silent windows alone): rows equal today's path bit for bit, silent rows are seg_1.bias
    flagged empty, and the server runs only the windows that are not silent."""
    waveforms, speech_masks = speech_windows(14.0, seed=21)  # 5 windows
    chunks = fbank(waveforms)
    silent = [1, 2, 4]
    masks = silence(speech_masks, silent)
    today = engine.embed(chunks, masks).embeddings
    all_silent = silence(speech_masks[:3, :2], [0, 1, 2])
    requests = [(chunks, masks), (chunks[:3], all_silent), (chunks[::-1].copy(), masks[::-1].copy())]
    before = scrape(server)
    with server.client(timeout_s=TIMEOUT_S) as client:
        from_fbank = client.embed(chunks, masks)
        from_waveform = client.embed_waveform(waveforms, masks)
        streamed = list(client.embed_stream(requests))
    after = scrape(server)
    for name, result in (("fbank", from_fbank), ("waveform", from_waveform), ("stream 0", streamed[0])):
        assert identical(result.embeddings, today), name
        assert result.empty[silent].all() and not result.empty[[0, 3]].all(axis=1).any(), name
    assert identical(streamed[2].embeddings, today[::-1])
    assert identical(streamed[1].embeddings, np.broadcast_to(folded_model.seg_bias, (3, 2, EMBEDDING_DIM)))
    assert streamed[1].empty.all() and streamed[1].plans == []
    sent_silent = 4 * len(silent) + 3
    sent_voiced = 4 * (len(chunks) - len(silent))
    assert delta(before, after, SKIPPED) == sent_silent
    assert delta(before, after, EMBEDDED) == sent_voiced


def expected_recording(samples: np.ndarray, masks: np.ndarray, engine: CpuEngine) -> np.ndarray:
    """Today's rows for a 16 kHz float32 recording: the server's own host fbank windows
    (RecordingDecoder, fed the client's pieces), every window through the engine under its
    exclude_overlap masks."""
    decoder = RecordingDecoder(16_000, 1, Encoding.F32)
    pcm = samples.astype("<f4")
    step = PIECE_BYTES // pcm.itemsize
    for at in range(0, pcm.shape[0], step):
        decoder.push(pcm[at : at + step].tobytes())
    windows = decoder.finish()
    return engine.embed(decoder.source.windows(0, windows), exclude_overlap(masks)).embeddings


def test_embed_recording_skips_silent_windows_and_keeps_batches_full(
    server: ServerProcess, engine: WatchedCpuEngine
) -> None:
    """17.5 s (9 windows, the last zero-padded) with a 3-window silence and a silent window
    alone: the rows equal today's bit for bit, in window order; the 5 windows with speech
    run as two batches, 4 and 1: a submission holds 4 windows to run, the silent ones riding
    along (submissions of 4 windows would make three batches of 3, 1 and 1)."""
    recording = synthetic_recording(17.5, seed=31)
    chunks = chunk_recording(recording.samples)
    silent = [2, *range(4, 7)]
    masks = silence(speaker_masks(recording, chunks.starts), silent)
    assert silent_windows(exclude_overlap(masks)).tolist() == [w in silent for w in range(len(chunks))]
    today = expected_recording(recording.samples, masks, engine)
    before = scrape(server)
    with server.client(timeout_s=TIMEOUT_S) as client:
        result = client.embed_recording(recording.samples, 16_000, masks, exclude_overlap=True)
    after = scrape(server)
    assert identical(result.embeddings, today)
    assert result.empty[silent].all()
    voiced = len(chunks) - len(silent)
    assert delta(before, after, SKIPPED) == len(silent)
    assert delta(before, after, EMBEDDED) == voiced
    assert delta(before, after, BATCHES) == math.ceil(voiced / MAX_BATCH)
