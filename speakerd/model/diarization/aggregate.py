"""Per-window frame scores -> one score per frame of the recording (overlap-add).

Windows overlap (10 s every second), so every frame of the recording is seen by up to ten
windows. pyannote.audio 4.0.7's `Inference.aggregate` adds each window's frames onto the
recording's frame grid at the frame closest to the window's start, and either averages them
(the speaker count) or keeps the sum (the clustered activations). The pipeline calls it with
the Hamming window off and no warm-up, the only case reproduced here.

The float details are pyannote's on purpose: sums accumulate in float32, each window's
contribution is added as float64 and stored back as float32, and the mean is a float32
division. For binarized inputs every value is a small integer and all of that is exact, but
keeping the same dtypes means a frame's value is the same bits as pyannote's for any input.
"""

from __future__ import annotations

import numpy as np

from speakerd.model.diarization.frames import SlidingFrames

#: `Inference.aggregate`'s floor on the number of contributing windows when averaging: a
#: frame no window saw divides by this instead of by 0, then gets the `missing` value anyway.
EMPTY_DIVISOR = 1e-12


def frame_count(chunks: SlidingFrames, num_chunks: int, frames: SlidingFrames) -> int:
    """Frames on the recording's grid: the one closest to the last window's end plus half a
    frame, plus one (pyannote's sum, in its order of additions)."""
    last_end = chunks.start + chunks.duration + (num_chunks - 1) * chunks.step + 0.5 * frames.duration
    return frames.moved_to(chunks.start).closest_frame(last_end) + 1


def overlap_add(
    scores: np.ndarray,
    chunks: SlidingFrames,
    frames: SlidingFrames,
    *,
    average: bool,
    missing: float,
) -> tuple[np.ndarray, SlidingFrames]:
    """scores [windows, frames per window, classes] -> ([num_frames, classes] float32, the grid).

    NaN scores (a class absent from a window) contribute nothing; a frame no window
    contributed to gets `missing`. `average` divides each frame's sum by the number of
    windows that contributed (pyannote's `skip_average=False`).
    """
    num_chunks, per_chunk, classes = scores.shape
    grid = frames.moved_to(chunks.start)
    num_frames = frame_count(chunks, num_chunks, frames)
    total = np.zeros((num_frames, classes), dtype=np.float32)
    contributors = np.zeros((num_frames, classes), dtype=np.float32)
    covered = np.zeros((num_frames, classes), dtype=bool)
    chunk_starts = chunks.starts(num_chunks)
    for chunk in range(num_chunks):
        score = scores[chunk]
        present = ~np.isnan(score)
        first = grid.closest_frame(chunk_starts[chunk] + 0.5 * grid.duration)
        span = slice(first, first + per_chunk)
        # float64 contributions stored into float32 sums, as pyannote's `+=` does
        total[span] += np.where(present, score.astype(np.float64), 0.0)
        contributors[span] += present.astype(np.float64)
        covered[span] |= present
    if average:
        total = total / np.maximum(contributors, np.float32(EMPTY_DIVISOR))
    total[~covered] = missing
    return total, grid
