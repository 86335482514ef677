"""speakerd.model.audio: deterministic speech-like recordings and masks from their known turns."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from speakerd.model.architecture import MASK_FRAMES, SAMPLE_RATE
from speakerd.model.audio import (
    SEGMENTATION_CENTER_SAMPLES,
    SEGMENTATION_STEP_SAMPLES,
    Recording,
    Turn,
    speaker_masks,
    synthetic_recording,
)
from speakerd.model.fbank import chunk_recording


@pytest.fixture(scope="module")
def recording() -> Recording:
    return synthetic_recording(40.5, seed=0)


def test_deterministic_and_in_range(recording: Recording) -> None:
    again = synthetic_recording(40.5, seed=0)
    assert again.turns == recording.turns
    assert again.samples.tobytes() == recording.samples.tobytes(), "same seed must give identical audio"
    other = synthetic_recording(40.5, seed=1)
    assert other.samples.tobytes() != recording.samples.tobytes(), "another seed must give other audio"
    assert recording.samples.dtype == np.float32 and recording.samples.shape == (40.5 * SAMPLE_RATE,)
    peak = float(np.abs(recording.samples).max())
    assert 0.3 < peak <= 1.0, f"peak {peak}"
    assert recording.speakers == 3 and recording.seconds == 40.5


def _covered(turns: tuple[Turn, ...], seconds: float, step: float = 0.01) -> np.ndarray:
    """[speakers, t] boolean activity on a 10 ms grid."""
    grid = np.arange(0, seconds, step)
    return np.stack(
        [
            np.any([(grid >= t.start_s) & (grid < t.end_s) for t in turns if t.speaker == k], axis=0)
            for k in range(3)
        ]
    )


def test_turns_have_overlap_silence_and_an_absent_speaker(recording: Recording) -> None:
    activity = _covered(recording.turns, recording.seconds)
    talking = activity.sum(axis=0)
    overlap_s = float((talking >= 2).sum()) * 0.01
    silence_s = float((talking == 0).sum()) * 0.01
    print(f"\nturns {len(recording.turns)}, overlap {overlap_s:.2f} s, silence {silence_s:.2f} s")
    assert overlap_s > 1.0, f"overlapped speech {overlap_s:.2f} s"
    assert silence_s > 2.0, f"silence {silence_s:.2f} s"
    for turn in recording.turns:
        assert 0 <= turn.start_s < turn.end_s <= recording.seconds, turn
    for k in range(3):  # nobody overlaps themself
        own = sorted((t.start_s, t.end_s) for t in recording.turns if t.speaker == k)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(own)), own
    chunks = chunk_recording(recording.samples)
    masks = speaker_masks(recording, chunks.starts)
    present = masks.max(axis=2) > 0  # [n, 3]
    assert np.any(present.sum(axis=1) == 2), f"no chunk with a speaker absent: {present.astype(int)}"
    assert np.all(present.any(axis=0)), "every speaker speaks somewhere"


def test_masks_follow_turns_at_segmentation_frame_centres(recording: Recording) -> None:
    chunks = chunk_recording(recording.samples)
    masks = speaker_masks(recording, chunks.starts)
    assert masks.shape == (len(chunks), 3, MASK_FRAMES) and masks.dtype == np.float32
    assert set(np.unique(masks).tolist()) <= {0.0, 1.0}
    # an independent scalar walk over a few frames
    for row in (0, 5, len(chunks) - 1):
        for frame in (0, 1, 100, 300, 588):
            center = (
                chunks.starts[row] + SEGMENTATION_CENTER_SAMPLES + SEGMENTATION_STEP_SAMPLES * frame
            ) / 16000
            for k in range(3):
                active = center < recording.seconds and any(
                    t.speaker == k and t.start_s <= center < t.end_s for t in recording.turns
                )
                assert masks[row, k, frame] == float(active), (row, k, frame, center)
    # the last chunk is padded (40.5 s): frames past the end carry no speaker
    last_start = int(chunks.starts[-1])
    assert chunks.lengths[-1] < 160_000
    past_end = (last_start + SEGMENTATION_CENTER_SAMPLES + SEGMENTATION_STEP_SAMPLES * np.arange(589)) >= len(
        recording.samples
    )
    assert past_end.any() and np.all(masks[-1][:, past_end] == 0)
    # last frame centre lies inside the 10 s chunk: 495 + 588 * 270 = 159,255 < 160,000
    assert SEGMENTATION_CENTER_SAMPLES + SEGMENTATION_STEP_SAMPLES * (MASK_FRAMES - 1) < 160_000


def test_other_frame_counts_tile_the_chunk(recording: Recording) -> None:
    """A coarser mask (e.g. 125 frames) spans the same 10 s: the same share of speech per speaker."""
    starts = chunk_recording(recording.samples).starts
    coarse = speaker_masks(recording, starts, frames=125)
    fine = speaker_masks(recording, starts)
    assert coarse.shape == (len(starts), 3, 125)
    gap = float(np.abs(coarse.mean(axis=2) - fine.mean(axis=2)).max())
    assert gap < 0.03, f"speech share differs by {gap:.3f} between 125 and 589 frames"


def _solo_segments(recording: Recording, speaker: int, seconds: float = 0.8) -> list[np.ndarray]:
    """Audio where only `speaker` talks, for `seconds` from the middle of each long enough turn."""
    activity = _covered(recording.turns, recording.seconds)
    out = []
    for turn in recording.turns:
        if turn.speaker != speaker or turn.end_s - turn.start_s < seconds + 0.4:
            continue
        a = turn.start_s + 0.2
        span = slice(int(a * 100), int((a + seconds) * 100))
        if activity[:, span].sum(axis=0).max() == 1:
            out.append(recording.samples[int(a * SAMPLE_RATE) : int((a + seconds) * SAMPLE_RATE)])
    return out


def _pitch(segment: np.ndarray) -> float:
    """F0 by autocorrelation over 60-400 Hz, median over 40 ms frames with voicing."""
    estimates = []
    for start in range(0, len(segment) - 640, 320):
        frame = segment[start : start + 640].astype(np.float64)
        frame = frame - frame.mean()
        corr = np.correlate(frame, frame, "full")[639:]
        if corr[0] <= 0:
            continue
        lags = np.arange(SAMPLE_RATE // 400, SAMPLE_RATE // 60)
        best = lags[np.argmax(corr[lags])]
        if corr[best] > 0.5 * corr[0]:
            estimates.append(SAMPLE_RATE / best)
    return float(np.median(estimates)) if estimates else float("nan")


def test_speakers_have_distinct_pitch(recording: Recording) -> None:
    pitch = [np.nanmedian([_pitch(s) for s in _solo_segments(recording, k)]) for k in range(3)]
    print(f"\nmedian F0 per speaker (Hz): {[round(p) for p in pitch]}")
    assert 85 < pitch[0] < 140 and 170 < pitch[1] < 280 and 125 < pitch[2] < 200, pitch


def test_syllabic_rhythm_near_4_hz(recording: Recording) -> None:
    """The energy envelope of solo speech is modulated at a syllable rate of 2-8 Hz."""
    rates = []
    for segment in _solo_segments(recording, 0, seconds=1.6) + _solo_segments(recording, 1, seconds=1.6):
        energy = np.sqrt(
            np.mean(segment[: len(segment) // 160 * 160].reshape(-1, 160) ** 2, axis=1)
        )  # 100 Hz
        spectrum = np.abs(np.fft.rfft(energy - energy.mean()))
        freqs = np.fft.rfftfreq(len(energy), 0.01)
        rates.append(freqs[1:][np.argmax(spectrum[1:])])
    print(f"\nenvelope modulation peaks (Hz): {np.round(rates, 1).tolist()}")
    assert rates and 2.0 <= float(np.median(rates)) <= 8.0, rates


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="speakers=4"):
        synthetic_recording(5.0, seed=0, speakers=4)
    with pytest.raises(ValueError, match="seconds=0"):
        synthetic_recording(0.0, seed=0)
    short = synthetic_recording(6.0, seed=2, speakers=2)
    assert short.speakers <= 2 and short.samples.shape == (96_000,)
