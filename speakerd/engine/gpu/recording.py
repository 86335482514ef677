"""A recording's fbank on the GPU for `EmbedRecording`: frames computed as the audio arrives,
each window written straight into the batch the engine stages.

Why: on the host the fbank of an hour of audio took 28 s (NumPy, 2 cores) against 0.54 s of
FP16 trunk. Here the host only uploads: each piece of samples (or, after `begin_pcm`, raw
PCM that pcm.py decodes, downmixes and resamples on the device) goes to the device when it
arrives, and the log-mel frames it completes are computed at once (kernels/fbank.cu, ~1.3 ms
an hour on an H200 in all), so `ready()` windows can be embedded while the rest of the
recording is still on the wire. `finish` adds the last frames and the zero-padded last
window's own. A batch's windows are never on the host at all: the batcher passes
`DeviceWindows` rows through like any fbank rows, and the GPU engine's staging asks them to
write themselves into its input slot on its copy stream (staging.py), where they are cut
from the frames with their own mean removed.

Every frame is computed once from samples that no later piece changes (pcm.py's outputs
are final when made), so the windows are the same whichever way the audio was cut.

Threads: `push`/`push_pcm` and `finish` run on the call's decode thread, on this source's
own stream; `DeviceWindows.write_device` on engine worker threads, always on the engine's
one copy stream (asserted), after an event recorded behind the frames it reads. The lock
keeps each advance (frames, buffer swap, event) and each batch's two window kernels
(sums, then writes, sharing the partial-sum buffer) whole. A frame buffer replaced by a
larger one stays alive with this source: a window kernel already queued may still read it.
"""

from __future__ import annotations

import threading

import numpy as np

from speakerd.engine.device_rows import DeviceRows
from speakerd.engine.gpu.fbank import DEFAULT_MAX_WINDOWS, GpuFbank, RecordingLayout
from speakerd.engine.gpu.pcm import DevicePcm, GrowingBuffer
from speakerd.model.architecture import CHUNK_SAMPLES, FRAMES, MEL_BINS, SAMPLE_RATE
from speakerd.model.fbank import FRAME_SHIFT, STEP_SAMPLES, num_frames
from speakerd.model.inputs import InputError
from speakerd.model.recording import Encoding, complete_windows

#: Device sample and frame buffers to start with (one minute of audio); each doubles when
#: full, so an hour costs 6 device-to-device copies of what was already there.
INITIAL_SECONDS = 60
#: Bytes of one fbank row (a window): 998 frames x 80 mel bins of float32.
WINDOW_BYTES = FRAMES * MEL_BINS * 4
FRAME_BYTES = MEL_BINS * 4


class GpuRecordingFrames:
    """FbankSource on the device (see speakerd.model.recording.FbankSource): push 16 kHz mono
    float32 samples in order (or raw PCM after `begin_pcm`), and `windows(start, stop)` gives
    `DeviceWindows` for any `stop <= ready()`; `finish` makes every window ready."""

    def __init__(self, step: int = STEP_SAMPLES) -> None:
        import cupy

        self.step = step
        self._stream = cupy.cuda.Stream(non_blocking=True)
        self._samples = GrowingBuffer(INITIAL_SECONDS * SAMPLE_RATE, cupy.float32, self._stream)
        with self._stream:
            rows = INITIAL_SECONDS * SAMPLE_RATE // FRAME_SHIFT
            self._frames = cupy.empty((rows, MEL_BINS), dtype=cupy.float32)
        self._retired: list[object] = []  # replaced frame buffers (see the module docstring)
        self._frames_done = 0
        self._ready = 0  # windows whose fbank can be written
        self._fbank = GpuFbank(max_samples=CHUNK_SAMPLES, max_windows=DEFAULT_MAX_WINDOWS, chunks=False)
        self._layout: RecordingLayout | None = None
        self._loaded = cupy.cuda.Event(block=False, disable_timing=True)
        self._lock = threading.Lock()
        self._writer_stream = None  # the one stream windows are written on (the engine's copy stream)
        self._pcm: DevicePcm | None = None  # set by begin_pcm: raw PCM decoded on the device

    def begin_pcm(self, sample_rate: int, channels: int, encoding: Encoding) -> None:
        """Take the recording as raw PCM (`push_pcm`) instead of 16 kHz samples: decoding,
        downmix and resampling then run on the device too (pcm.py). RecordingDecoder calls
        this when its source has it."""
        assert self._samples.size == 0 and self._layout is None, "begin_pcm before any audio"
        self._pcm = DevicePcm(sample_rate, channels, encoding, self._stream)

    def push_pcm(self, data: bytes | memoryview) -> None:
        """Whole frames of the recording's interleaved PCM, decoded as they arrive."""
        assert self._pcm is not None, "push_pcm before begin_pcm"
        self._pcm.push(data)
        self._advance(self._pcm.samples, complete_windows(self._pcm.ready, self.step))

    def push(self, samples: np.ndarray) -> None:
        if self._layout is not None:
            raise RuntimeError("push after finish")
        samples = np.ascontiguousarray(samples, dtype=np.float32)
        count = int(samples.shape[0])
        if count == 0:
            return
        buffer = self._samples
        buffer.reserve(buffer.size + count)
        # pageable source: the copy is complete when this returns, so `samples` may be reused
        buffer.array[buffer.size : buffer.size + count].set(samples, stream=self._stream)
        buffer.size += count
        self._advance(buffer.data, complete_windows(buffer.size, self.step))

    def ready(self) -> int:
        """Windows whose fbank `windows` can give now."""
        return self._ready

    def finish(self) -> int:
        """The last frames (and the padded window's own), computed on the device; the
        recording's window count."""
        if self._layout is not None:
            return self._layout.windows
        samples = self._pcm.finish() if self._pcm is not None else self._samples.data
        total = int(samples.shape[0])
        if total < 1:
            raise InputError("audio", "no samples; a recording needs at least one")
        layout = RecordingLayout.of(total, self.step)
        with self._lock:
            self._compute_frames(samples, layout.frames)
            if layout.padded:
                start = int(samples.data.ptr) + 4 * layout.padded_start
                self._fbank.compute_frames(
                    start, 0, layout.padded_length, FRAMES, FRAMES, self._fbank.padded_frames, self._stream
                )
            self._loaded.record(self._stream)
            self._layout, self._ready = layout, layout.windows
        # the windows read only the frames from here on: the samples and the PCM decoder's
        # buffers go back to CuPy's pool once the kernels reading them have run
        self._stream.synchronize()
        self._pcm = None
        self._samples = GrowingBuffer(0, samples.dtype, self._stream)
        return layout.windows

    def _advance(self, samples, windows: int) -> None:
        """Frames of `samples` (the 16 kHz samples so far) not computed yet; `windows` ready."""
        with self._lock:
            self._compute_frames(samples, num_frames(int(samples.shape[0])))
            self._loaded.record(self._stream)
            self._ready = max(self._ready, windows)

    def _compute_frames(self, samples, end: int) -> None:
        import cupy

        begin = self._frames_done
        if end <= begin:
            return
        if end > self._frames.shape[0]:
            with self._stream:
                grown = cupy.empty((max(end, 2 * self._frames.shape[0]), MEL_BINS), dtype=cupy.float32)
                grown[:begin] = self._frames[:begin]
            self._retired.append(self._frames)
            self._frames = grown
        start = int(samples.data.ptr) + 4 * FRAME_SHIFT * begin
        out = int(self._frames.data.ptr) + FRAME_BYTES * begin
        valid = int(samples.shape[0]) - FRAME_SHIFT * begin
        self._fbank.compute_frames(start, 0, valid, end - begin, end - begin, out, self._stream)
        self._frames_done = end

    def windows(self, start: int, stop: int) -> DeviceWindows:
        if not 0 <= start <= stop <= self._ready:
            raise IndexError(f"windows [{start}, {stop}) of {self._ready} ready")
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
        """Under the lock: the window kernels for [start, stop), after the frames' event."""
        assert stop <= self._ready, f"windows up to {stop} asked, {self._ready} ready"
        stream.wait_event(self._loaded)
        layout = self._layout
        full_windows = layout.full_windows if layout is not None else self._ready
        frames = int(self._frames.data.ptr)
        step_frames = self.step // FRAME_SHIFT
        for first in range(start, stop, DEFAULT_MAX_WINDOWS):
            count = min(DEFAULT_MAX_WINDOWS, stop - first)
            out = pointer + (first - start) * WINDOW_BYTES
            full = max(0, min(first + count, full_windows) - first)
            if full:
                self._fbank.write_windows(frames, first, full, step_frames, out, stream)
            if full < count:  # the padded window: the last, with frames of its own
                padded = self._fbank.padded_frames
                self._fbank.write_windows(padded, 0, 1, FRAMES, out + full * WINDOW_BYTES, stream)


#: Seconds of audio the warm-up sends through each path: one full window and a padded one.
WARM_UP_SECONDS = 11


def warm_up() -> None:
    """Compile and load everything a recording call launches (pcm.cu, fbank.cu and CuPy's
    own fill and copy kernels) by sending WARM_UP_SECONDS of silence through the s16 path at
    16 kHz and the f32 path with resampling. Without it a fresh server's first recording
    spent ~1.2 s compiling them on its event loop (py-spy on the H200)."""
    for rate, encoding in ((SAMPLE_RATE, Encoding.S16), (48_000, Encoding.F32)):
        source = GpuRecordingFrames(STEP_SAMPLES)
        source.begin_pcm(rate, 2, encoding)
        source.push_pcm(bytes(WARM_UP_SECONDS * rate * 2 * encoding.itemsize))
        windows = source.finish()
        source.to_host(0, windows)


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
