"""A recording's audio sent to one device worker of `serve --devices`, its windows left there.

Why: with one GPU in process, a recording's PCM is decoded, resampled and turned into fbank
on the GPU (engine/gpu/recording.py), and its windows never touch the host. With
`--devices` the GPUs belong to worker processes; computing the fbank on the server's host
instead made an hour take 3.85 s against 0.55 s. So the pool gives each recording a home
device (device_table.py: the one with the fewest recordings open) and `RemoteFrames`, the
call's FbankSource in the server, forwards the recording's raw PCM to that device's worker,
which decodes it where its engine decodes it (on the GPU for a GPU engine); 16 kHz samples
decoded elsewhere can be pushed as well (FbankSource's `push`). Bytes travel through the
device's audio slots in shared memory, a slot at a time; each push returns once the worker
has taken it, with the windows now ready.

A recording the server segments (`segmenting`) is decoded in the worker too, which keeps
its samples there for the segmenter (model/segmentation/samples.py's SegmentingSource,
around its fbank): the server then holds none of its audio. `take` hands out
`KeptWindows`, a group of windows named by number, which the server's segmenter
(remote_compute.py) has that worker segment from the samples it keeps.

`windows(start, stop)` gives `RemoteWindows`: rows that lie in the worker, named by the
recording and the window range. The batcher binds their requests to the home device
(`pool_device`, serving/batching/queue.py) and the pool sends their batches there with the
rows named rather than copied (device_pool.py); `np.asarray` copies them to the host through
an audio slot, for anything else that must read them.

The link (`RecordingLink`) is the pool's: one request and one answer per call, which raise
RecordingFailed (the device was lost: UNAVAILABLE, the call can be retried) or InputError
(bad audio, as the in-process path says it).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from speakerd.engine.device_rows import DeviceRows
from speakerd.model.architecture import FRAMES, MEL_BINS
from speakerd.model.recording import Encoding
from speakerd.serving.batching.queue import NoDevice

#: Bytes of one fbank window row (998 x 80 float32): a host copy comes back in whole rows.
ROW_BYTES = FRAMES * MEL_BINS * 4
_SAMPLE_BYTES = 4


class RecordingFailed(NoDevice):
    """The recording's home device was taken out: its audio and windows are gone with it
    (UNAVAILABLE: the call can be retried, on this replica's other devices or another)."""


@dataclass(frozen=True)
class PcmFormat:
    """How the recording's raw PCM is laid out (RecordingHeader's fields, checked)."""

    sample_rate: int
    channels: int
    encoding: str  # Encoding's name: the worker rebuilds the enum

    @property
    def frame_bytes(self) -> int:
        return Encoding[self.encoding].itemsize * self.channels


class RecordingLink(Protocol):
    """What RemoteFrames needs of the pool (device_pool.py implements it)."""

    #: bytes of one audio slot: the most one `call` carries
    audio_bytes: int

    def call(
        self, device: int, op: str, recording: int, args: tuple[Any, ...], data: memoryview | None
    ) -> Any:
        """Run `op` on `device`'s worker for `recording`, with `data` in an audio slot; its
        answer (the `rows` op: the slot's bytes the worker wrote, copied out)."""
        ...

    def forget(self, device: int, recording: int) -> None:
        """The recording ended: its worker drops it; the device's count of open recordings
        goes down. Never raises, never waits for the worker."""
        ...


_ids = itertools.count(1)


class RemoteFrames:
    """The FbankSource of a recording whose home is `device` (module docstring). Push and
    finish on the call's decode thread; `windows` from any thread; `close` once, at the
    call's end (also run when it is collected)."""

    def __init__(self, link: RecordingLink, device: int, step: int, segmenting: bool = False) -> None:
        self.link, self.pool_device, self.step = link, device, step
        self.segmenting = segmenting
        self.recording = next(_ids)
        self._format: PcmFormat | None = None
        self._opened = False
        # what the worker's latest state said (`_answered`): windows ready, windows
        # segmentable, samples kept, and that state's version
        self._ready = self._segmentable = self._kept = self._version = 0
        self._state_lock = threading.Lock()
        self._taken = 0  # windows handed out by take
        self._windows: int | None = None
        self._lock = threading.Lock()
        self._closer = weakref.finalize(self, link.forget, device, self.recording)

    # -- FbankSource (and the raw-PCM half RecordingDecoder uses) ------------------------
    def begin_pcm(self, sample_rate: int, channels: int, encoding: Encoding) -> None:
        """Raw PCM from here on (`push_pcm`): decoded where the worker's engine decodes."""
        assert not self._opened, "begin_pcm before any audio"
        self._format = PcmFormat(sample_rate, channels, encoding.name)

    def push_pcm(self, data: bytes | memoryview) -> None:
        """Whole frames of interleaved PCM, sent in audio slots of whole frames."""
        assert self._format is not None, "push_pcm before begin_pcm"
        self._send("pcm", memoryview(data).cast("B"), self._format.frame_bytes)

    def push(self, samples: np.ndarray) -> None:
        """16 kHz mono float32 samples, decoded by the caller (the server's recording path
        sends raw PCM instead: `push_pcm`)."""
        if self._windows is not None:
            raise RuntimeError("push after finish")
        samples = np.ascontiguousarray(samples, dtype=np.float32)
        self._send("samples", memoryview(samples).cast("B"), _SAMPLE_BYTES)

    def ready(self) -> int:
        return self._ready

    def finish(self) -> int:
        if self._windows is None:
            self._open()
            self._answered(self._call("finish", (), None))
            self._windows = self._ready
        return self._windows

    def windows(self, start: int, stop: int) -> RemoteWindows:
        if not 0 <= start <= stop <= self._ready:
            raise IndexError(f"windows [{start}, {stop}) of {self._ready} ready")
        return RemoteWindows(self, start, stop)

    def close(self) -> None:
        """The call ended: the worker drops the recording (idempotent)."""
        self._closer()

    # -- Segmentable (model/segmentation/samples.py), when `segmenting` -------------------
    @property
    def kept_samples(self) -> int:
        """Samples the worker keeps for windows not segmented yet (the reader's back-pressure)."""
        return self._kept

    def segmentable(self) -> int:
        return self._segmentable

    def take(self, count: int) -> tuple[int, KeptWindows, np.ndarray]:
        """The next `count` segmentable windows, as a group the worker segments from the
        samples it keeps; `starts` is the windows' starts from the first one's (the worker
        computes the same)."""
        assert self.segmenting, "take on a recording not opened to be segmented"
        if not 1 <= count <= self._segmentable - self._taken:
            raise IndexError(
                f"{count} windows from {self._taken}, {self._segmentable - self._taken} segmentable"
            )
        first = self._taken
        self._taken += count
        return first, KeptWindows(self, first, count), np.arange(count, dtype=np.int64) * self.step

    def segment_kept(self, first: int, count: int) -> tuple[np.ndarray, float]:
        """Windows [first, first + count) segmented in the worker: ([count, 589, 3] uint8, the
        worker's compute seconds). Not ordered with the pushes (no lock): the windows are
        segmentable already, and the worker's source takes concurrent pushes."""
        multilabel, compute_s, state = self.link.call(
            self.pool_device, "segment_kept", self.recording, (first, count), None
        )
        self._answered(state)
        return multilabel, float(compute_s)

    # -- the link ------------------------------------------------------------------------
    def to_host(self, start: int, stop: int) -> np.ndarray:
        """Windows [start, stop) copied to the host, as many rows an audio slot at a time."""
        out = np.empty((stop - start, FRAMES, MEL_BINS), dtype=np.float32)
        per_call = max(1, self.link.audio_bytes // ROW_BYTES)
        for first in range(start, stop, per_call):
            last = min(stop, first + per_call)
            data = self._call("rows", (first, last), None)
            out[first - start : last - start] = np.frombuffer(data, dtype=np.float32).reshape(
                -1, FRAMES, MEL_BINS
            )
        return out

    def _send(self, op: str, data: memoryview, unit: int) -> None:
        """`data` in slot-sized parts of whole `unit`s (frames, samples)."""
        self._open()
        part = max(unit, self.link.audio_bytes - self.link.audio_bytes % unit)
        for offset in range(0, len(data), part):
            self._answered(self._call(op, (), data[offset : offset + part]))

    def _answered(self, state: tuple[int, int, int, int]) -> None:
        """A state the worker answered (version, windows ready, windows segmentable, samples
        kept; worker_recordings.py), kept unless a later one came first: a push's answer
        and a segmentation's may cross."""
        version, ready, segmentable, kept = (int(value) for value in state)
        with self._state_lock:
            if version > self._version:
                self._version, self._ready, self._segmentable, self._kept = version, ready, segmentable, kept

    def _open(self) -> None:
        if not self._opened:
            self._call("open", (self.step, self._format, self.segmenting), None)
            self._opened = True

    def _call(self, op: str, args: tuple[Any, ...], data: memoryview | None) -> Any:
        with self._lock:  # one op at a time, in order: the worker applies them so
            return self.link.call(self.pool_device, op, self.recording, args, data)


class RemoteWindows(DeviceRows):
    """Windows [start, stop) of a RemoteFrames recording, lying in its home device's worker:
    the pool names them in a batch instead of copying them (`pool_device`, `recording`,
    `start`, `stop`); `np.asarray` copies them to the host."""

    def __init__(self, source: RemoteFrames, start: int, stop: int) -> None:
        self.source, self.start, self.stop = source, start, stop

    @property
    def pool_device(self) -> int:
        return self.source.pool_device

    @property
    def recording(self) -> int:
        return self.source.recording

    def __len__(self) -> int:
        return self.stop - self.start

    def _rows(self, start: int, stop: int) -> RemoteWindows:
        return RemoteWindows(self.source, self.start + start, self.start + stop)

    def _to_host(self) -> np.ndarray:
        return self.source.to_host(self.start, self.stop)


@dataclass(frozen=True)
class KeptWindows:
    """A group of a segmenting recording's windows whose samples its worker keeps: what the
    server's segmenter is handed instead of samples (remote_compute.RemoteSegmenter)."""

    source: RemoteFrames
    first: int
    count: int

    def segment(self) -> tuple[np.ndarray, float]:
        return self.source.segment_kept(self.first, self.count)
