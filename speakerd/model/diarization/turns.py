"""0/1 frames -> speech turns (start, end, speaker), in pyannote's order and with its times.

pyannote.audio 4.0.7 turns the discrete diarization into an `Annotation` with
`SpeakerDiarizationMixin.to_annotation` (utils/signal.py's `Binarize`, onset = offset =
0.5) and speakerd's turns are that annotation's `itertracks(yield_label=True)`:

- a turn starts at the middle of its first active frame and ends at the middle of the first
  inactive frame after it, or at the middle of the last frame when it runs to the end (so a
  turn starting on the last frame is empty and, as pyannote.core drops segments of 1 us or
  less, is dropped);
- min_duration_off: a speaker's turns separated by less than that (or touching) are merged
  (`Annotation.support(collar)`); min_duration_on: turns shorter than that are removed;
- order: by (start, end), then by track name, as pyannote.core sorts its tracks. Each
  speaker column is one track named A, B, ... Z, AA, ...; after a merge the tracks are
  renamed in the order of the speakers' labels as strings ("10" before "2") then time.

The times are the float64 middles `SlidingFrames.middles` computes exactly as pyannote does,
so turns compare equal to pyannote's with `==`.
"""

from __future__ import annotations

import itertools
import string
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from speakerd.model.diarization.frames import SlidingFrames

#: pyannote.core's `SEGMENT_PRECISION`: a segment of this length or less is empty and is
#: never added to an annotation (1 us).
SEGMENT_PRECISION_S = 1e-6
#: `Binarize(onset=0.5, offset=0.5)`: above is active, below inactive, exactly 0.5 keeps the
#: previous state (a 0/1 diarization never has it).
THRESHOLD = 0.5


@dataclass(frozen=True)
class Turn:
    """One speaker speaking from `start` to `end` (seconds)."""

    start: float
    end: float
    speaker: str

    @property
    def duration(self) -> float:
        """`Segment.duration`: end - start, 0 for an empty segment."""
        return _duration(self.start, self.end)


@dataclass(frozen=True)
class Track:
    """A turn before naming: speaker column index and pyannote.core's track name."""

    start: float
    end: float
    column: int
    track: str


def _duration(start: float, end: float) -> float:
    return end - start if (end - start) > SEGMENT_PRECISION_S else 0.0


def track_names() -> Iterator[str]:
    """A, B, ..., Z, AA, AB, ... (pyannote.core's `string_generator`)."""
    for length in itertools.count(1):
        for letters in itertools.product(string.ascii_uppercase, repeat=length):
            yield "".join(letters)


def _runs(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(firsts, stops): the [first, stop) frame ranges where `Binarize`'s state is active."""
    above, below = values > THRESHOLD, values < THRESHOLD
    # the state changes only when a value is strictly above or below the threshold
    state = np.where(above, 1.0, np.where(below, 0.0, np.nan))
    state[0] = 1.0 if above[0] else 0.0
    decided = np.where(~np.isnan(state), np.arange(len(state)), 0)
    active = state[np.maximum.accumulate(decided)] == 1.0
    edges = np.diff(np.concatenate(([False], active, [False])).astype(np.int8))
    return np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)


def support(segments: list[tuple[float, float]], collar: float = 0.0) -> list[tuple[float, float]]:
    """Sorted segments merged where they overlap, touch (gap of 1 us or less) or are less
    than `collar` apart (`Timeline.support(collar)`)."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(segments):
        if merged:
            last_start, last_end = merged[-1]
            gap_start, gap_end = min(end, last_end), max(start, last_start)
            gap = _duration(gap_start, gap_end)
            if gap == 0.0 or gap < collar:
                merged[-1] = (min(start, last_start), max(end, last_end))
                continue
        merged.append((start, end))
    return merged


def binarize(
    discrete: np.ndarray,
    frames: SlidingFrames,
    min_duration_on: float = 0.0,
    min_duration_off: float = 0.0,
) -> list[Track]:
    """discrete [num_frames, columns] (0/1) on `frames` -> tracks in pyannote's order
    (module docstring)."""
    num_frames, num_columns = discrete.shape
    names = track_names()
    tracks: list[Track] = []
    for column in range(num_columns):
        name = next(names)
        firsts, stops = _runs(discrete[:, column])
        # the middles of the runs' edges only (an hour has 213,000 frames and a few thousand edges)
        starts = frames.middles_at(firsts).tolist()
        ends = frames.middles_at(np.minimum(stops, num_frames - 1)).tolist()
        for start, end in zip(starts, ends, strict=True):
            if end - start > SEGMENT_PRECISION_S:
                tracks.append(Track(start, end, column, name))
    if min_duration_off > 0.0:
        names = track_names()
        by_label = sorted({track.column for track in tracks}, key=str)
        tracks = [
            Track(start, end, column, next(names))
            for column in by_label
            for start, end in support(
                support([(t.start, t.end) for t in tracks if t.column == column], min_duration_off)
            )
        ]
    if min_duration_on > 0.0:
        tracks = [track for track in tracks if _duration(track.start, track.end) >= min_duration_on]
    return sorted(tracks, key=lambda t: (t.start, t.end, t.track, str(t.column)))


def speech_seconds(turns: list[Turn], speaker: str) -> float:
    """A speaker's total speech: the length of the union of their turns
    (`Annotation.label_duration`)."""
    return sum(
        _duration(start, end)
        for start, end in support([(t.start, t.end) for t in turns if t.speaker == speaker])
    )
