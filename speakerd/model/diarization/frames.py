"""Sliding windows and their time arithmetic, as pyannote.core's `SlidingWindow` does it.

Every time in a diarization comes from two sliding windows: the segmentation windows
(chunks: 10 s every `step_s`) and the segmentation model's output frames (its receptive
field). pyannote computes frame indices and timestamps from them with particular float
operations (`start + i * step`, `rint((t - start - duration / 2) / step)`, a frame's middle
as `(start + end) / 2`), and a turn's boundary is such a timestamp. speakerd repeats the
same operations in the same order, so its turns equal pyannote's to the last bit rather than
to a tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from speakerd.model.architecture import SAMPLE_RATE
from speakerd.model.segmentation.architecture import (
    FRAME_DURATION_S,
    FRAME_STEP_S,
    OUTPUT_FRAMES,
    WINDOW_SAMPLES,
)

#: segmentation-3.0 (PyanNet) frames, `Model.receptive_field` in pyannote: one output frame
#: sees 991 samples at 16 kHz (0.0619375 s) and the next one starts 270 samples later
#: (0.016875 s), the sample counts divided by the rate as pyannote divides them
#: (speakerd/model/segmentation/architecture.py derives them from the layers).
SEGMENTATION_FRAME_DURATION_S = FRAME_DURATION_S
SEGMENTATION_FRAME_STEP_S = FRAME_STEP_S
#: The receptive field's first frame starts at 0 s in pyannote.audio 4.0.7's PyanNet.
SEGMENTATION_FRAME_START_S = 0.0
#: segmentation-3.0's `specifications.duration`: each window is 10 s of audio.
WINDOW_S = WINDOW_SAMPLES / SAMPLE_RATE
#: `SpeakerDiarization(segmentation_step=0.1)`: a window every 10% of its duration.
WINDOW_STEP_S = 0.1 * WINDOW_S
#: Output frames per window of segmentation-3.0 (10 s in 270-sample steps).
FRAMES_PER_WINDOW = OUTPUT_FRAMES


@dataclass(frozen=True)
class SlidingFrames:
    """pyannote.core's `SlidingWindow` (start, duration, step in seconds), without an end."""

    start: float
    duration: float
    step: float

    def starts(self, count: int) -> np.ndarray:
        """Start times of positions 0..count-1: `start + i * step` (`SlidingWindow[i]`)."""
        return self.start + np.arange(count) * self.step

    def middles(self, count: int) -> np.ndarray:
        """Middles of positions 0..count-1, `Segment.middle` of `SlidingWindow[i]`."""
        return self.middles_at(np.arange(count))

    def middles_at(self, positions: np.ndarray) -> np.ndarray:
        """Middles of the given positions (integers), the same float operations as `middles`."""
        starts = self.start + positions * self.step
        return 0.5 * (starts + (starts + self.duration))

    def closest_frame(self, t: float) -> int:
        """Index of the position whose middle is closest to t (`SlidingWindow.closest_frame`)."""
        return int(self.closest_frames(np.float64(t)))

    def closest_frames(self, times: np.ndarray) -> np.ndarray:
        """`closest_frame` of each of `times`, the same float operations element-wise, int64."""
        return np.rint((times - self.start - 0.5 * self.duration) / self.step).astype(np.int64)

    def moved_to(self, start: float) -> SlidingFrames:
        """The same frames starting at `start`: `Inference.aggregate` puts the frames on the
        chunks' start."""
        return SlidingFrames(start=start, duration=self.duration, step=self.step)


#: segmentation-3.0's frames (`model.receptive_field`).
SEGMENTATION_FRAMES = SlidingFrames(
    start=SEGMENTATION_FRAME_START_S,
    duration=SEGMENTATION_FRAME_DURATION_S,
    step=SEGMENTATION_FRAME_STEP_S,
)


def windows(
    step_s: float = WINDOW_STEP_S, duration_s: float = WINDOW_S, start_s: float = 0.0
) -> SlidingFrames:
    """The pipeline's segmentation windows (`Inference`'s `SlidingWindow(0, duration, step)`)."""
    return SlidingFrames(start=start_s, duration=duration_s, step=step_s)
