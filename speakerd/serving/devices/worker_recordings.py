"""The worker's side of remote recordings (remote_recording.py): the recordings whose home is
this device, each a decoder over its engine's own FbankSource.

A GPU engine's source takes raw PCM and decodes, resamples and computes the fbank on the
GPU (engine/gpu/recording.py); a CPU engine's (the stand-in in tests) decodes on this
process's host. Either way the decoding is `RecordingDecoder`'s, as in the server with one
engine, so a recording's windows are the same bits whichever process computed them.

A recording the server segments is decoded here too (its source a SegmentingSource around
the engine's: the samples kept for the segmenter), and `segment` takes each group of its
windows from them. Ops arrive in order on one thread (`apply`); batches read windows and
segmentation calls take samples from other threads (`windows`, `segment`). An op for a
recording not open (the call ended and its `close` overtook a batch) raises RecordingGone:
the batch's requests have left, and the device is fine.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from speakerd.engine.base import Engine
from speakerd.engine.segmenter import Segmenter
from speakerd.model.recording import Encoding, FbankSource, RecordingDecoder
from speakerd.model.segmentation.samples import SegmentingSource
from speakerd.serving.devices.shared_slots import AudioSlot


class RecordingGone(LookupError):
    """An op or a batch named a recording this worker does not hold (any more)."""


@dataclass
class _Recording:
    source: FbankSource  # a SegmentingSource around the engine's, for a segmenting recording
    decoder: RecordingDecoder | None  # None: 16 kHz samples pushed as they are
    version: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def state(self) -> tuple[int, int, int, int]:
        """(version, windows ready, windows segmentable, samples kept): what a push, a finish
        and a segmentation answer. Pushes and segmentations run on different threads and
        their answers may cross on the way: the version, counted as each state is read, lets
        the server keep only the latest (a stale `kept` could hold its reader back forever)."""
        source = self.source
        with self.lock:
            self.version += 1
            if isinstance(source, SegmentingSource):
                return self.version, source.ready(), source.segmentable(), source.kept_samples
            return self.version, source.ready(), 0, 0


class WorkerRecordings:
    """Recordings open on this worker's engine, by the server's recording number."""

    def __init__(self, engine: Engine, audio: list[AudioSlot]) -> None:
        self.engine = engine
        self.audio = audio
        self._open: dict[int, _Recording] = {}
        self._lock = threading.Lock()

    def apply(self, op: str, recording: int, args: tuple[Any, ...], slot: int | None, nbytes: int) -> Any:
        """One op of remote_recording.py's protocol; its answer (InputError for bad audio)."""
        if op == "open":
            step, pcm, segmenting = args
            source = self.engine.fbank_source(step)
            if segmenting:  # the samples kept here for the segmenter; decoded on this host
                source = SegmentingSource(source, step)
            decoder = None
            if pcm is not None:
                decoder = RecordingDecoder(
                    pcm.sample_rate, pcm.channels, Encoding[pcm.encoding], source=source, step=step
                )
            with self._lock:
                self._open[recording] = _Recording(source, decoder)
            return None
        entry = self._get(recording)
        if op == "pcm":
            assert entry.decoder is not None and slot is not None, "pcm before open with a format"
            entry.decoder.push(self.audio[slot].buf[:nbytes])
            return entry.state()
        if op == "samples":
            assert slot is not None
            samples = np.frombuffer(self.audio[slot].buf[:nbytes], dtype=np.float32).copy()
            entry.source.push(samples)
            return entry.state()
        if op == "finish":
            if entry.decoder is not None:
                entry.decoder.finish()
            else:
                entry.source.finish()
            return entry.state()
        if op == "rows":
            assert slot is not None
            first, last = args
            rows = np.ascontiguousarray(np.asarray(entry.source.windows(first, last)), dtype=np.float32)
            view = np.frombuffer(self.audio[slot].buf, dtype=np.uint8, count=rows.nbytes)
            view[:] = rows.reshape(-1).view(np.uint8)
            return rows.nbytes
        raise ValueError(f"recording op {op!r}: expected open, pcm, samples, finish or rows")

    def segment(self, recording: int, first: int, count: int, segmenter: Segmenter) -> tuple[Any, ...]:
        """Windows [first, first + count) of a segmenting recording, segmented from the
        samples kept here: (multilabel [count, 589, 3] uint8, compute seconds, the state
        after: `_Recording.state`)."""
        entry = self._get(recording)
        source = entry.source
        assert isinstance(source, SegmentingSource), f"recording {recording} was not opened to be segmented"
        taken, samples, starts = source.take(count)
        assert taken == first, f"recording {recording}: windows from {first} asked, {taken} next"
        state = entry.state()  # the samples taken are let go already
        done = segmenter.segment(samples, starts)
        return done.multilabel, done.compute_s, state

    def windows(self, recording: int, start: int, stop: int) -> Any:
        """Windows [start, stop) of an open recording, as its source gives them (device rows
        on a GPU, host rows on a CPU engine), for a batch."""
        return self._get(recording).source.windows(start, stop)

    def close(self, recording: int) -> None:
        with self._lock:
            self._open.pop(recording, None)

    def _get(self, recording: int) -> _Recording:
        with self._lock:
            entry = self._open.get(recording)
        if entry is None:
            raise RecordingGone(f"recording {recording} is not open on this device (its call ended)")
        return entry
