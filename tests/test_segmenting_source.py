"""SegmentingSource: the samples a segmenting EmbedRecording keeps for its next windows.

The contract: whatever the piece sizes, `take` hands out exactly the recording's samples of
the windows pyannote's `Inference.slide` cuts (the padded last one's real part included),
with each window's start; the fbank source behind it sees every sample unchanged; and what
it keeps is only the span of the windows not yet taken, never the recording.
"""

from __future__ import annotations

import numpy as np
import pytest

from speakerd.model.fbank import chunk_starts
from speakerd.model.recording import SharedFrames, window_count
from speakerd.model.segmentation.architecture import WINDOW_SAMPLES
from speakerd.model.segmentation.samples import SegmentingSource

STEP = 16_000


def _feed(source: SegmentingSource, samples: np.ndarray, piece: int) -> None:
    for at in range(0, samples.shape[0], piece):
        source.push(samples[at : at + piece])


@pytest.mark.parametrize(
    ("seconds", "piece", "group"),
    [(23.5, 7_919, 4), (30.0, 16_000, 32), (6.5, 100_000, 1), (47.25, 1_234, 3)],
    ids=["padded-last", "exact-fit", "shorter-than-a-window", "small-pieces"],
)
def test_take_hands_out_every_window_exactly(seconds: float, piece: int, group: int) -> None:
    rng = np.random.default_rng(3)
    samples = rng.uniform(-1, 1, int(seconds * 16_000)).astype(np.float32)
    source = SegmentingSource(SharedFrames(STEP), STEP)
    _feed(source, samples, piece)
    count = source.finish()
    expected_starts = chunk_starts(samples.shape[0], WINDOW_SAMPLES, STEP)
    assert count == window_count(samples.shape[0], STEP) == expected_starts.shape[0]
    assert source.segmentable() == count
    taken = 0
    while taken < count:
        first, span, starts = source.take(min(group, count - taken))
        assert first == taken, (first, taken)
        for offset, start in zip(starts, expected_starts[first : first + starts.shape[0]], strict=True):
            window = span[offset : offset + WINDOW_SAMPLES]
            np.testing.assert_array_equal(window, samples[start : start + WINDOW_SAMPLES])
        taken += starts.shape[0]
    assert source.kept_samples == 0, source.kept_samples
    with pytest.raises(IndexError):
        source.take(1)


def test_fbank_source_sees_every_sample() -> None:
    samples = np.random.default_rng(5).uniform(-1, 1, 250_000).astype(np.float32)
    alone, wrapped = SharedFrames(STEP), SegmentingSource(SharedFrames(STEP), STEP)
    _feed(wrapped, samples, 30_000)
    alone.push(samples)
    assert wrapped.finish() == alone.finish() == 7
    np.testing.assert_array_equal(wrapped.windows(0, 7), alone.windows(0, 7))


def test_only_windows_not_taken_are_kept() -> None:
    """While the audio streams in, taking windows as they complete keeps at most one window
    and the pieces since: 10 s + a piece, whatever the recording's length."""
    source = SegmentingSource(SharedFrames(STEP), STEP)
    piece = 8_000
    most = 0
    for at in range(0, 120 * 16_000, piece):
        source.push(np.full(piece, at / 2e6, np.float32))
        while (left := source.segmentable() - _taken(source)) > 0:
            source.take(left)
        most = max(most, source.kept_samples)
    assert most <= WINDOW_SAMPLES + piece, most


def test_windows_are_handed_out_only_once_complete() -> None:
    source = SegmentingSource(SharedFrames(STEP), STEP)
    source.push(np.zeros(WINDOW_SAMPLES - 1, np.float32))
    assert source.segmentable() == 0
    with pytest.raises(IndexError, match="0 segmentable"):
        source.take(1)
    source.push(np.zeros(1, np.float32))
    assert source.segmentable() == 1


def _taken(source: SegmentingSource) -> int:
    return source._segmented
