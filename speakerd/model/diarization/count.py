"""How many speakers talk in each frame of the recording: pyannote's speaker count.

pyannote.audio 4.0.7's `SpeakerDiarizationMixin.speaker_count(binarized, receptive_field,
warm_up=(0, 0))`, as `SpeakerDiarization.apply` calls it: each window's active speakers are
summed per frame, those sums are averaged over the windows that see the frame (overlap-add
without a Hamming window), and the mean is rounded to the nearest integer, halves to even
(`np.rint`): a mean of 1.5 counts 2, but 0.5 counts 0 and 2.5 counts 2. Frames no window
sees count 0.

The count decides how many speakers each frame of the final diarization has: the
reconstruction keeps that many of the most active clusters there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from speakerd.model.diarization.aggregate import overlap_add
from speakerd.model.diarization.frames import (
    SEGMENTATION_FRAMES,
    WINDOW_S,
    WINDOW_STEP_S,
    SlidingFrames,
    windows,
)


@dataclass(frozen=True)
class SpeakerCount:
    """counts [num_frames] uint8 on `frames` (pyannote's `count.data[:, 0]` and its window)."""

    counts: np.ndarray
    frames: SlidingFrames


def speakers_per_frame(binarized: np.ndarray) -> np.ndarray:
    """binarized [windows, frames, speakers] -> the active speakers of each window's frames,
    [windows, frames, 1]: `np.sum` over the speakers, as pyannote sums them. Integers (a
    server's 0/1 bytes) are summed speaker by speaker into np.sum's own dtype instead, the
    same exact sums about seven times faster than a reduction over an axis of 3."""
    if not np.issubdtype(binarized.dtype, np.integer) or binarized.shape[-1] == 0:
        return np.sum(binarized, axis=-1, keepdims=True)
    total = binarized[..., 0].astype(np.sum(binarized[:1, :1], axis=-1).dtype)
    for speaker in range(1, binarized.shape[-1]):
        total += binarized[..., speaker]
    return total[..., None]


def speaker_count(
    binarized: np.ndarray,
    step_s: float = WINDOW_STEP_S,
    *,
    window_s: float = WINDOW_S,
    start_s: float = 0.0,
    frames: SlidingFrames = SEGMENTATION_FRAMES,
) -> SpeakerCount:
    """binarized [windows, frames per window, local speakers] (0/1) -> frame-level counts.

    `step_s`, `window_s`, `start_s` place the windows (pyannote's segmentation
    `SlidingWindow`); `frames` is the segmentation model's receptive field.
    """
    if binarized.ndim != 3:
        raise ValueError(f"binarized segmentations: {binarized.ndim} dimensions, expected 3")
    per_window = speakers_per_frame(binarized)
    mean, grid = overlap_add(
        per_window, windows(step_s, window_s, start_s), frames, average=True, missing=0.0
    )
    return SpeakerCount(counts=np.rint(mean[:, 0]).astype(np.uint8), frames=grid)
