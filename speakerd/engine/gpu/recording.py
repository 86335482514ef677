"""A recording's fbank on the GPU for `EmbedRecording`: samples uploaded as they arrive,
frames computed once, each window written straight into the batch the engine stages.

Why: on the host the fbank of an hour of audio took 28 s (NumPy, 2 cores) against 0.54 s of
FP16 trunk. Here the host only decodes and resamples; the 16 kHz samples go to the device
piece by piece while the call is still receiving, `finish` computes the recording's log-mel
frames there once (kernels/fbank.cu, ~1.3 ms an hour on an H200), and a batch's windows are
never on the host at all: the batcher passes `DeviceWindows` rows through like any fbank
rows, and the GPU engine's staging asks them to write themselves into its input slot on
its copy stream (staging.py), where they are cut from the frames with their own mean removed.

With `begin_pcm` the source takes the raw PCM instead (`push_pcm`), and decoding, downmix
and resampling run on the device at `finish` as well (pcm.py): the host only uploads.

Threads: `push`/`push_pcm` and `finish` run on the call's decode thread; `DeviceWindows.write_device`
on engine worker threads, always on the engine's one copy stream (asserted), ordered after
`finish`'s frames by an event. The source's lock keeps one batch's two window kernels (sums,
then writes, sharing the source's partial-sum buffer) together on that stream.
"""

from __future__ import annotations

import threading

import numpy as np

from speakerd.engine.gpu.device_rows import DeviceRows
from speakerd.engine.gpu.fbank import DEFAULT_MAX_WINDOWS, GpuFbank, RecordingLayout
from speakerd.engine.gpu.pcm import DevicePcm
from speakerd.model.architecture import FRAMES, MEL_BINS
from speakerd.model.fbank import STEP_SAMPLES
from speakerd.model.inputs import InputError
from speakerd.model.recording import Encoding

#: Device sample buffer to start with (one minute of 16 kHz); it doubles when full, so an
#: hour costs 6 device-to-device copies of what was already there.
INITIAL_SAMPLES = 60 * 16_000
#: Bytes of one fbank row (a window): 998 frames x 80 mel bins of float32.
WINDOW_BYTES = FRAMES * MEL_BINS * 4


class GpuRecordingFrames:
    """FbankSource on the device (see speakerd.model.recording.FbankSource): push 16 kHz mono
    float32 samples in order, `finish`, then `windows(start, stop)` gives `DeviceWindows`."""

    def __init__(self, step: int = STEP_SAMPLES) -> None:
        import cupy

        self.step = step
        self.samples = 0
        self._stream = cupy.cuda.Stream(non_blocking=True)
        self._device = cupy.empty((INITIAL_SAMPLES,), dtype=cupy.float32)
        self._fbank: GpuFbank | None = None
        self._layout: RecordingLayout | None = None
        self._loaded = cupy.cuda.Event(block=False, disable_timing=True)
        self._lock = threading.Lock()
        self._writer_stream = None  # the one stream windows are written on (the engine's copy stream)
        self._pcm: DevicePcm | None = None  # set by begin_pcm: raw PCM decoded on the device

    def begin_pcm(self, sample_rate: int, channels: int, encoding: Encoding) -> None:
        """Take the recording as raw PCM (`push_pcm`) instead of 16 kHz samples: decoding,
        downmix and resampling then run on the device too (pcm.py). RecordingDecoder calls
        this when its source has it."""
        assert self.samples == 0 and self._layout is None, "begin_pcm before any audio"
        self._pcm = DevicePcm(sample_rate, channels, encoding, self._stream)

    def push_pcm(self, data: bytes | memoryview) -> None:
        """Whole frames of the recording's interleaved PCM, uploaded as they arrive."""
        assert self._pcm is not None, "push_pcm before begin_pcm"
        self._pcm.push(data)

    def push(self, samples: np.ndarray) -> None:
        import cupy

        if self._layout is not None:
            raise RuntimeError("push after finish")
        samples = np.ascontiguousarray(samples, dtype=np.float32)
        count = int(samples.shape[0])
        if count == 0:
            return
        needed = self.samples + count
        if needed > self._device.shape[0]:
            grown = cupy.empty((max(needed, 2 * self._device.shape[0]),), dtype=cupy.float32)
            with self._stream:
                grown[: self.samples] = self._device[: self.samples]
            # the old buffer goes back to CuPy's pool when replaced: not before this copy read it
            self._stream.synchronize()
            self._device = grown
        # pageable source: the copy is complete when this returns, so `samples` may be reused
        self._device[self.samples : needed].set(samples, stream=self._stream)
        self.samples = needed

    def finish(self) -> int:
        """The recording's frames, computed on the device; its window count."""
        if self._layout is not None:
            return self._layout.windows
        if self._pcm is not None:  # the 16 kHz samples made on the device from the raw PCM
            self._device = self._pcm.mono_16k()
            self.samples = int(self._device.shape[0])
            self._pcm = None
        if self.samples < 1:
            raise InputError("audio", "no samples; a recording needs at least one")
        fbank = GpuFbank(max_samples=self.samples, max_windows=DEFAULT_MAX_WINDOWS)
        self._layout = fbank.load(self._device[: self.samples], self._stream, self.step)
        self._loaded.record(self._stream)
        self._fbank = fbank
        return self._layout.windows

    def windows(self, start: int, stop: int) -> DeviceWindows:
        layout = self._layout
        if layout is None:
            raise RuntimeError("windows before finish")
        if not 0 <= start <= stop <= layout.windows:
            raise IndexError(f"windows [{start}, {stop}) of {layout.windows}")
        return DeviceWindows(self, start, stop)

    def write(self, start: int, stop: int, pointer: int, stream) -> None:
        """Windows [start, stop) as [stop - start, 998, 80] float32 at device `pointer`,
        enqueued on `stream` after the frames."""
        with self._lock:
            if self._writer_stream is None:
                self._writer_stream = stream
            assert stream is self._writer_stream, (
                "a recording's windows are written on one stream (the shared partial sums are "
                f"ordered by it): got {stream} after {self._writer_stream}"
            )
            self._enqueue(start, stop, pointer, stream)

    def to_host(self, start: int, stop: int) -> np.ndarray:
        """Windows [start, stop) copied to the host, synchronously (tests, the CPU engine)."""
        import cupy

        out = cupy.empty((stop - start, FRAMES, MEL_BINS), dtype=cupy.float32)
        with self._lock:
            if self._writer_stream is not None:  # its kernels share the partial sums: let them end
                self._writer_stream.synchronize()
            self._enqueue(start, stop, int(out.data.ptr), self._stream)
            host = cupy.asnumpy(out, stream=self._stream)
            self._stream.synchronize()
        return host

    def _enqueue(self, start: int, stop: int, pointer: int, stream) -> None:
        assert self._fbank is not None, "windows written before finish"
        stream.wait_event(self._loaded)
        for first in range(start, stop, DEFAULT_MAX_WINDOWS):
            count = min(DEFAULT_MAX_WINDOWS, stop - first)
            self._fbank.windows(first, count, pointer + (first - start) * WINDOW_BYTES, stream)


class DeviceWindows(DeviceRows):
    """Rows [start, stop) of a recording's window fbank, kept on the device until an engine
    asks for them: `write_device` into its own buffer, or `np.asarray(rows)` for a host copy
    (the CPU engine, tests)."""

    def __init__(self, source: GpuRecordingFrames, start: int, stop: int) -> None:
        self.source, self.start, self.stop = source, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def _rows(self, start: int, stop: int) -> DeviceWindows:
        return DeviceWindows(self.source, self.start + start, self.start + stop)

    def write_device(self, pointer: int, stream) -> None:
        if len(self):
            self.source.write(self.start, self.stop, pointer, stream)

    def _to_host(self) -> np.ndarray:
        return self.source.to_host(self.start, self.stop)
