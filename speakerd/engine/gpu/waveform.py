"""EmbedChunks' waveform input on the GPU: [n, 160000] chunks in, fbank rows computed on the
device straight into the engine's staging slot.

Why: the server's NumPy fbank capped waveform requests at ~127 chunks/s on an H200 host (the
engine does ~6,600). Here a request's waveforms stay on the host until its batch is staged;
then, on the engine's copy stream, they are uploaded 32 chunks at a time into one reused
device buffer and `GpuFbank.batch` (kernels/fbank.cu) writes their fbank where the batch's
fbank goes. Rows reach the batcher as `WaveformRows` (an engine.base.DeviceFbank), so the
batcher, splitting and ordering are those of fbank requests.

One stream: the device buffer and GpuFbank's scratch are shared by every call, so calls are
serialised by a lock and all enqueued on the first stream that writes (the copy stream).
"""

from __future__ import annotations

import threading

import numpy as np

from speakerd.engine.device_rows import DeviceRows
from speakerd.engine.gpu.fbank import DEFAULT_MAX_WINDOWS, GpuFbank
from speakerd.engine.gpu.recording import WINDOW_BYTES
from speakerd.model.architecture import CHUNK_SAMPLES, FRAMES, MEL_BINS


class WaveformFbank:
    """The engine's one waveform -> fbank converter on the device."""

    def __init__(self) -> None:
        import cupy

        self._fbank = GpuFbank(max_samples=CHUNK_SAMPLES, max_windows=DEFAULT_MAX_WINDOWS)
        self._waves = cupy.empty((DEFAULT_MAX_WINDOWS, CHUNK_SAMPLES), dtype=cupy.float32)
        self._own = cupy.cuda.Stream(non_blocking=True)
        self._lock = threading.Lock()
        self._writer = None

    def rows(self, waveform: np.ndarray) -> WaveformRows:
        """Rows of checked waveforms [n, 160000] float32 (kept on the host until staged)."""
        assert waveform.ndim == 2 and waveform.shape[1] == CHUNK_SAMPLES, waveform.shape
        return WaveformRows(self, waveform)

    def write(self, waveform: np.ndarray, pointer: int, stream) -> None:
        """Fbank [n, 998, 80] of `waveform` at device `pointer`, enqueued on `stream`."""
        with self._lock:
            if self._writer is None:
                self._writer = stream
            assert stream is self._writer, f"waveform fbank written on {stream} after {self._writer}"
            self._enqueue(waveform, pointer, stream)

    def to_host(self, waveform: np.ndarray) -> np.ndarray:
        """Fbank of `waveform` on the host, synchronously (tests, the FP16 fallback's checks)."""
        import cupy

        out = cupy.empty((waveform.shape[0], FRAMES, MEL_BINS), dtype=cupy.float32)
        with self._lock:
            if self._writer is not None:  # its kernels share the buffers: let them end
                self._writer.synchronize()
            self._enqueue(waveform, int(out.data.ptr), self._own)
            host = cupy.asnumpy(out, stream=self._own)
            self._own.synchronize()
        return host

    def _enqueue(self, waveform: np.ndarray, pointer: int, stream) -> None:
        for first in range(0, waveform.shape[0], DEFAULT_MAX_WINDOWS):
            part = np.ascontiguousarray(waveform[first : first + DEFAULT_MAX_WINDOWS], dtype=np.float32)
            waves = self._waves[: part.shape[0]]
            # pageable source: staged by the driver before this returns, so `part` may go
            waves.set(part, stream=stream)
            self._fbank.batch(waves, pointer + first * WINDOW_BYTES, stream)


class WaveformRows(DeviceRows):
    """fbank rows of host waveforms, computed on the device when staged (engine.base.DeviceFbank)."""

    def __init__(self, owner: WaveformFbank, waveform: np.ndarray) -> None:
        self.owner, self.waveform = owner, waveform

    def __len__(self) -> int:
        return int(self.waveform.shape[0])

    def _rows(self, start: int, stop: int) -> WaveformRows:
        return WaveformRows(self.owner, self.waveform[start:stop])

    def write_device(self, pointer: int, stream) -> None:
        if len(self):
            self.owner.write(self.waveform, pointer, stream)

    def _to_host(self) -> np.ndarray:
        return self.owner.to_host(self.waveform)
