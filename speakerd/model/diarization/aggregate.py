"""Per-window frame scores -> one score per frame of the recording (overlap-add).

Windows overlap (10 s every second), so every frame of the recording is seen by up to ten
windows. pyannote.audio 4.0.7's `Inference.aggregate` adds each window's frames onto the
recording's frame grid at the frame closest to the window's start, and either averages them
(the speaker count) or keeps the sum (the clustered activations). The pipeline calls it with
the Hamming window off and no warm-up, the only case reproduced here.

The float details are pyannote's on purpose: sums accumulate in float32, each window's
contribution is added as float64 and stored back as float32, window after window, and the
mean is a float32 division. For binarized inputs every value is a small integer and all of
that is exact, but keeping the same dtypes and order means a frame's value is the same bits
as pyannote's for any input.

pyannote adds one window at a time with NumPy slices (3,600 additions for an hour, each a
few microseconds of interpreter around a small array); where numba is installed the same
additions run as one compiled loop (compiled.py), about ten times faster and without the
interpreter lock. Both give the same bits (tests/test_diarization_math.py).
"""

from __future__ import annotations

import numpy as np

from speakerd.model.diarization import compiled
from speakerd.model.diarization.frames import SlidingFrames

#: `Inference.aggregate`'s floor on the number of contributing windows when averaging: a
#: frame no window saw divides by this instead of by 0, then gets the `missing` value anyway.
EMPTY_DIVISOR = 1e-12


def frame_count(chunks: SlidingFrames, num_chunks: int, frames: SlidingFrames) -> int:
    """Frames on the recording's grid: the one closest to the last window's end plus half a
    frame, plus one (pyannote's sum, in its order of additions)."""
    last_end = chunks.start + chunks.duration + (num_chunks - 1) * chunks.step + 0.5 * frames.duration
    return frames.moved_to(chunks.start).closest_frame(last_end) + 1


def placement(
    chunks: SlidingFrames, num_chunks: int, per_chunk: int, frames: SlidingFrames
) -> tuple[SlidingFrames, int, np.ndarray]:
    """Where `num_chunks` windows of `per_chunk` frames land: (the recording's grid, its
    frame_count, the grid frame each window's first frame lands on, [num_chunks] int64: the
    one closest to the window's start plus half a frame). ValueError unless every window's
    frames fit the grid (the compiled loops write where they are told, unchecked;
    pyannote's slices would not fit either)."""
    grid = frames.moved_to(chunks.start)
    num_frames = frame_count(chunks, num_chunks, frames)
    firsts = grid.closest_frames(chunks.starts(num_chunks) + 0.5 * grid.duration)
    if num_chunks and (int(firsts.min()) < 0 or int(firsts.max()) + per_chunk > num_frames):
        raise ValueError(
            f"windows of {per_chunk} frames from grid frames {int(firsts.min())}..{int(firsts.max())} "
            f"do not fit the recording's {num_frames} frames: expected frames that span their window"
        )
    return grid, num_frames, firsts


def _add_windows(scores, firsts, total, contributors, covered):
    """The overlap-add as one loop (compiled by compiled.jit): window by window, each
    frame's float64 contribution added to its float32 sum and stored back as float32, as
    the slices of `overlap_add` do. A NaN contributes nothing (pyannote adds 0.0 for it,
    which leaves a sum that started at +0.0 unchanged)."""
    num_chunks, per_chunk, classes = scores.shape
    for chunk in range(num_chunks):
        first = firsts[chunk]
        for frame in range(per_chunk):
            for cls in range(classes):
                score = np.float64(scores[chunk, frame, cls])
                if score == score:
                    total[first + frame, cls] = total[first + frame, cls] + score
                    contributors[first + frame, cls] = contributors[first + frame, cls] + 1.0
                    covered[first + frame, cls] = True


def overlap_add(
    scores: np.ndarray,
    chunks: SlidingFrames,
    frames: SlidingFrames,
    *,
    average: bool,
    missing: float,
    use_compiled: bool | None = None,
) -> tuple[np.ndarray, SlidingFrames]:
    """scores [windows, frames per window, classes] -> ([num_frames, classes] float32, the grid).

    NaN scores (a class absent from a window) contribute nothing; a frame no window
    contributed to gets `missing`. `average` divides each frame's sum by the number of
    windows that contributed (pyannote's `skip_average=False`). use_compiled: the compiled
    loop (None: where numba is installed) or NumPy's slices; the same bits either way.
    """
    num_chunks, per_chunk, classes = scores.shape
    grid, num_frames, firsts = placement(chunks, num_chunks, per_chunk, frames)
    total = np.zeros((num_frames, classes), dtype=np.float32)
    contributors = np.zeros((num_frames, classes), dtype=np.float32)
    covered = np.zeros((num_frames, classes), dtype=bool)
    if compiled.available() if use_compiled is None else use_compiled:
        compiled.jit(_add_windows)(scores, firsts, total, contributors, covered)
    else:
        for chunk in range(num_chunks):
            score = scores[chunk]
            present = ~np.isnan(score)
            span = slice(firsts[chunk], firsts[chunk] + per_chunk)
            # float64 contributions stored into float32 sums, as pyannote's `+=` does
            total[span] += np.where(present, score.astype(np.float64), 0.0)
            contributors[span] += present.astype(np.float64)
            covered[span] |= present
    if average:
        total = total / np.maximum(contributors, np.float32(EMPTY_DIVISOR))
    total[~covered] = missing
    return total, grid
