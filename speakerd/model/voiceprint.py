"""A voiceprint's math (docs/voiceprints.md): window embeddings of one speaker -> one vector.

Shared by the server (Enroll, and Identify/Verify of a recording), the client and
speakerd.pyannote, so a centroid made anywhere is the same function of the same rows:

- each window's embedding is the model's, pooled under that speaker's mask (EmbedRecording);
- windows whose mask has no weight on any trunk frame (`empty`) are left out: their row is
  the model's bias alone;
- every other row is L2-normalised (cosine scoring ignores length, so a loud window must not
  outweigh a quiet one) and weighted by its active trunk frames (of 125): a window the
  speaker fills counts more than one they say a word in;
- the weighted mean is L2-normalised again: the voiceprint is a unit vector, and a score is
  a dot product.

Quality is the mean cosine of the used windows to the voiceprint (1: all windows agree).
Speech seconds are the union over time of the mask frames at or above SPEECH_LEVEL: with
windows every second, each moment lies in up to ten windows and counts once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from speakerd.model.architecture import CHUNK_SAMPLES, MASK_FRAMES, SAMPLE_RATE, TRUNK_FRAMES
from speakerd.model.inputs import InputError

WINDOW_S = CHUNK_SAMPLES / SAMPLE_RATE
#: A mask value counted as speech for speech seconds: pyannote binarises its segmentation
#: at 0.5, so soft masks are counted as its pipeline would count them.
SPEECH_LEVEL = 0.5
#: Time grid on which speech seconds are counted: the fbank's 10 ms hop, finer than any
#: mask frame (17 ms for segmentation-3.0's 589 per window).
SPEECH_GRID_S = 0.01
#: Least speech an enrollment takes. An embedding of a few seconds of speech varies with
#: what was said more than with who said it, so a shorter enrollment would be a poor
#: reference; 3 s is a floor, not a target: 10-30 s of clean speech makes a better one, and
#: the voiceprint's quality says how consistent its windows were.
MIN_ENROLL_SPEECH_S = 3.0
#: Least speech of one query column (Identify, Verify from a recording): less is reported
#: as unknown with its speech seconds rather than compared.
MIN_QUERY_SPEECH_S = 1.0
#: Peak sample magnitude under which audio counts as silent (-60 dBFS): nothing to enroll
#: or compare, whatever the masks say. 16-bit dither alone peaks near 3e-5.
SILENCE_PEAK = 1e-3
#: Norm under which a row is refused: a zero vector has no direction to compare.
MIN_NORM = 1e-12


@dataclass(frozen=True)
class Pooled:
    """One speaker's windows pooled: the unit vector, how many windows, and their agreement."""

    vector: np.ndarray  # [D] float32, unit length
    windows: int
    quality: float


def normalize(rows: np.ndarray, field: str = "embeddings") -> np.ndarray:
    """[m, D] -> unit rows, float32; InputError for a row of (near) zero length or not finite."""
    rows = np.asarray(rows, dtype=np.float32)
    if not np.isfinite(rows).all():
        raise InputError(field, "non-finite values; expected finite float32")
    norms = np.linalg.norm(rows, axis=-1, keepdims=True)
    if (norms <= MIN_NORM).any():
        bad = int(np.flatnonzero(norms.ravel() <= MIN_NORM)[0])
        raise InputError(field, f"row {bad} has zero length; expected a non-zero embedding")
    return rows / norms


def pool(embeddings: np.ndarray, active: np.ndarray) -> Pooled | None:
    """[n, D] window embeddings of one speaker with their [n] active trunk frames -> the
    voiceprint; None when no window has speech (every row empty)."""
    used = np.asarray(active) > 0
    if not used.any():
        return None
    rows = normalize(np.asarray(embeddings)[used])
    weights = np.asarray(active, dtype=np.float32)[used] / TRUNK_FRAMES
    mean = (weights[:, None] * rows).sum(axis=0)
    norm = float(np.linalg.norm(mean))
    if norm <= MIN_NORM:  # windows pointing every way at once: no direction to keep
        return None
    vector = (mean / norm).astype(np.float32)
    return Pooled(vector, int(used.sum()), float(np.mean(rows @ vector)))


def speech_seconds(masks: np.ndarray, step_s: float, duration_s: float) -> float:
    """Seconds of the recording where one speaker's masks [n, F] (window i starting at
    i * step_s, F frames over WINDOW_S) reach SPEECH_LEVEL, each moment counted once, within
    the first `duration_s` (the last window is zero-padded past the audio)."""
    masks = np.asarray(masks)
    n, frames = masks.shape
    cells = int(np.ceil(duration_s / SPEECH_GRID_S))
    if n == 0 or cells <= 0:
        return 0.0
    window, frame = np.nonzero(masks >= SPEECH_LEVEL)
    frame_s = WINDOW_S / frames
    starts = window * step_s + frame * frame_s
    first = np.clip(np.floor(starts / SPEECH_GRID_S + 1e-9).astype(np.int64), 0, cells)
    last = np.clip(np.ceil((starts + frame_s) / SPEECH_GRID_S - 1e-9).astype(np.int64), 0, cells)
    edges = np.zeros(cells + 1, dtype=np.int64)
    np.add.at(edges, first, 1)
    np.add.at(edges, last, -1)
    return float(np.count_nonzero(np.cumsum(edges[:-1]) > 0) * SPEECH_GRID_S)


def segment_masks(
    segments: Sequence[tuple[float, float]], windows: int, step_s: float, frames: int = MASK_FRAMES
) -> np.ndarray:
    """Speech segments (start_s, end_s) -> masks [windows, 1, frames] uint8: a frame is speech
    when its centre lies in a segment."""
    centres = np.arange(windows)[:, None] * step_s + (np.arange(frames)[None, :] + 0.5) * (WINDOW_S / frames)
    speech = np.zeros((windows, frames), dtype=bool)
    for start, end in segments:
        speech |= (centres >= start) & (centres < end)
    return speech[:, None, :].astype(np.uint8)


def single_speaker_speech(segmentation: np.ndarray) -> np.ndarray:
    """A segmentation [windows, frames, speakers] (hard multilabel, the server's) -> masks
    [windows, 1, frames] uint8 of the frames where exactly one speaker talks: the speech of a
    recording of one person, with its silences, noises and any overlapped frames (where a
    second voice would leak into the voiceprint) left out."""
    return (np.asarray(segmentation).sum(axis=2) == 1)[:, None, :].astype(np.uint8)


def check_segments(segments: Sequence[tuple[float, float]], field: str = "speech.segments") -> None:
    """InputError unless every segment is finite with 0 <= start < end."""
    for index, (start, end) in enumerate(segments):
        if not (np.isfinite(start) and np.isfinite(end) and 0 <= start < end):
            raise InputError(
                f"{field}[{index}]", f"[{start}, {end}] s, expected finite seconds with 0 <= start_s < end_s"
            )


def check_threshold(threshold: float, field: str = "threshold") -> float:
    """The threshold itself; InputError unless it is a cosine in [-1, 1]."""
    if not (np.isfinite(threshold) and -1.0 <= threshold <= 1.0):
        raise InputError(field, f"{threshold}, expected a cosine similarity in [-1, 1]")
    return float(threshold)
