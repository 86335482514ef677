"""A recording's 16 kHz samples kept for the windows still to be segmented.

When the server segments a recording (`RecordingHeader.segment`), each window needs its
10 s of 16 kHz samples, which the fbank path does not keep (it turns samples into log-mel
frames as they arrive). `SegmentingSource` wraps the call's FbankSource: every sample pushed
reaches the fbank source as before and is also kept here, from the start of the first window
not yet segmented on; `take` hands out a group of complete windows' samples and forgets
those no later window reads. So the call holds at most the unsegmented windows' span of
audio (the recording path slows the reader down once that exceeds a bound, see
serving/api/recording.py), never the whole recording.

Windows are pyannote's (`Inference.slide`, as for the embeddings): window k starts at
k * step; after `finish`, a last window starting where the next regular one would is
zero-padded to 10 s when the regular ones do not end at the last sample.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol, runtime_checkable

import numpy as np

from speakerd.model.fbank import chunk_starts
from speakerd.model.recording import FbankSource, complete_windows
from speakerd.model.segmentation.architecture import WINDOW_SAMPLES


@runtime_checkable
class Segmentable(Protocol):
    """An FbankSource that keeps its recording's samples for the segmenter: this module's
    SegmentingSource in the server's memory, or (`serve --devices`) one that keeps them in
    the worker of the recording's device, whose `take` hands out what that device's
    segmenter reads there (serving/devices/remote_recording.py)."""

    @property
    def kept_samples(self) -> int: ...

    def segmentable(self) -> int: ...

    def take(self, count: int) -> tuple[int, Any, np.ndarray]: ...


class SegmentingSource:
    """An FbankSource (the wrapped one's fbank) that also keeps samples for segmentation.

    `push` runs on the call's decode thread, `take` on a segmentation thread: a lock guards
    the kept samples."""

    def __init__(self, inner: FbankSource, step: int) -> None:
        self.inner = inner
        self.step = step
        self._lock = threading.Lock()
        self._parts: list[np.ndarray] = []  # samples from _offset on, in order
        self._offset = 0  # recording index of the first kept sample
        self._kept = 0  # samples in _parts
        self._total = 0  # samples pushed
        self._segmented = 0  # windows handed out by take
        self._starts: np.ndarray | None = None  # every window's start, once finished

    # -- FbankSource ------------------------------------------------------------------
    def push(self, samples: np.ndarray) -> None:
        samples = np.asarray(samples, dtype=np.float32)
        self.inner.push(samples)
        if samples.size:
            with self._lock:
                self._parts.append(samples)
                self._kept += samples.shape[0]
                self._total += samples.shape[0]

    def ready(self) -> int:
        return self.inner.ready()

    def finish(self) -> int:
        count = self.inner.finish()
        with self._lock:
            self._starts = chunk_starts(self._total, WINDOW_SAMPLES, self.step).astype(np.int64)
        assert self._starts.shape[0] == count, f"{self._starts.shape[0]} windows here, {count} in fbank"
        return count

    def windows(self, start: int, stop: int) -> np.ndarray:
        return self.inner.windows(start, stop)

    # -- segmentation -----------------------------------------------------------------
    @property
    def kept_samples(self) -> int:
        """Samples held for windows not segmented yet (the reader's back-pressure reads it)."""
        return self._kept

    def segmentable(self) -> int:
        """Windows whose samples are all in: every one after `finish`."""
        with self._lock:
            if self._starts is not None:
                return int(self._starts.shape[0])
            return complete_windows(self._total, self.step)

    def take(self, count: int) -> tuple[int, np.ndarray, np.ndarray]:
        """(first window, samples, starts): the next `count` segmentable windows' samples,
        from the first one's start to the last one's end (or the recording's end, for the
        padded last window: the segmenter pads it), and each window's start in them."""
        with self._lock:
            first = self._segmented
            limit = (
                self._starts.shape[0]
                if self._starts is not None
                else complete_windows(self._total, self.step)
            )
            if not 1 <= count <= limit - first:
                raise IndexError(f"{count} windows from {first}, {limit - first} segmentable")
            if self._starts is not None:
                starts = self._starts[first : first + count]
            else:
                starts = np.arange(first, first + count, dtype=np.int64) * self.step
            joined = np.concatenate(self._parts) if len(self._parts) != 1 else self._parts[0]
            begin = int(starts[0]) - self._offset
            end = min(int(starts[-1]) + WINDOW_SAMPLES - self._offset, joined.shape[0])
            assert begin >= 0, f"window {first} starts at {starts[0]}, before the kept {self._offset}"
            samples = joined[begin:end]
            # the next window's start on is still needed; the rest is forgotten
            following = first + count
            if self._starts is not None:
                keep_from = int(self._starts[following]) if following < self._starts.shape[0] else self._total
            else:
                keep_from = following * self.step
            drop = min(keep_from - self._offset, joined.shape[0])
            rest = joined[drop:].copy()  # not a view: the joined buffer is freed
            self._parts = [rest] if rest.size else []
            self._offset += drop
            self._kept = rest.shape[0]
            self._segmented = following
        return first, samples, starts - starts[0]
