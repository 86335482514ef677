"""A recording's raw PCM to 16 kHz mono float32 on the GPU (kernels/pcm.cu).

Why: decoding, downmixing and resampling on the host took 7.3 s of the 8.0 s an hour of
48 kHz stereo spent in the server (one NumPy thread), against ~0.6 s of GPU work. Here the
PCM bytes go to the device as they arrive (the upload is the only host work), and at the
end of the audio the GPU turns them into the 16 kHz samples the fbank frames are computed
from, with speakerd.model.recording's and .resample's arithmetic (see the kernel file).
Importing this module touches no device.
"""

from __future__ import annotations

import numpy as np

from speakerd.model.architecture import SAMPLE_RATE
from speakerd.model.inputs import InputError
from speakerd.model.recording import Encoding
from speakerd.model.resample import output_length, reduced_rates, sinc_kernel

SOURCE = "pcm.cu"
KERNEL_NAMES = ("pcm_mono_s16", "pcm_mono_f32", "resample_sinc")
#: Launch shapes; each equals the #define of the same name in kernels/pcm.cu.
MONO_THREADS = 256
RESAMPLE_THREADS = 256
#: Grid-stride loops: this many blocks per SM keep the H200's HBM busy.
BLOCKS_PER_SM = 8
#: Device byte buffer to start with (8 MiB); it doubles when full.
INITIAL_BYTES = 8 << 20
#: first_bad's value when every f32 sample is fine.
NO_BAD_FRAME = np.iinfo(np.uint64).max


class DevicePcm:
    """Raw interleaved PCM of one recording, uploaded piece by piece on `stream`."""

    def __init__(self, sample_rate: int, channels: int, encoding: Encoding, stream) -> None:
        import cupy

        from speakerd.engine.gpu import kernels

        self.sample_rate, self.channels, self.encoding = sample_rate, channels, encoding
        self.frame_bytes = encoding.itemsize * channels
        self.stream = stream
        self.bytes = 0
        self._raw = cupy.empty((INITIAL_BYTES,), dtype=cupy.uint8)
        module = kernels.module(SOURCE)
        self._s16, self._f32, self._resample = (module.get_function(name) for name in KERNEL_NAMES)
        self._blocks = BLOCKS_PER_SM * cupy.cuda.Device().attributes["MultiProcessorCount"]

    def push(self, data: bytes | memoryview) -> None:
        """Whole frames of PCM (the caller keeps partial frames for the next piece)."""
        import cupy

        size = len(data)
        assert size % self.frame_bytes == 0, f"{size} bytes is not whole {self.frame_bytes}-byte frames"
        if size == 0:
            return
        needed = self.bytes + size
        if needed > self._raw.shape[0]:
            grown = cupy.empty((max(needed, 2 * self._raw.shape[0]),), dtype=cupy.uint8)
            with self.stream:
                grown[: self.bytes] = self._raw[: self.bytes]
            self.stream.synchronize()  # the old buffer returns to the pool only after the copy
            self._raw = grown
        host = np.frombuffer(data, dtype=np.uint8)
        # pageable source: staged by the driver before this returns, so `data` may be reused
        self._raw[self.bytes : needed].set(host, stream=self.stream)
        self.bytes = needed

    @property
    def frames(self) -> int:
        return self.bytes // self.frame_bytes

    def mono_16k(self):  # -> cupy.ndarray [N'] float32
        """The recording as 16 kHz mono float32 on the device; InputError naming `audio` for an
        f32 sample that is NaN, Inf or outside [-1, 1] (synchronises `stream` to read that)."""
        import cupy

        frames = self.frames
        with self.stream:  # every allocation, fill and copy ordered on this one stream
            mono = cupy.empty((frames,), dtype=cupy.float32)
            grid = (max(1, min(self._blocks, -(-frames // MONO_THREADS))),)
            if self.encoding is Encoding.S16:
                args = (self._raw, np.int32(self.channels), np.int64(frames), mono)
                self._s16(grid, (MONO_THREADS,), args, stream=self.stream)
            else:
                first_bad = cupy.full((1,), NO_BAD_FRAME, dtype=cupy.uint64)
                args = (self._raw, np.int32(self.channels), np.int64(frames), mono, first_bad)
                self._f32(grid, (MONO_THREADS,), args, stream=self.stream)
                bad = int(first_bad.get(stream=self.stream)[0])
                if bad != NO_BAD_FRAME:
                    raise InputError(
                        "audio",
                        f"frame {bad} holds NaN, Inf or |sample| > 1; f32 samples must lie in [-1, 1]",
                    )
            if self.sample_rate == SAMPLE_RATE:
                return mono
            return self.resample(mono)

    def resample(self, mono):  # -> cupy.ndarray
        import cupy

        kernel, width = sinc_kernel(self.sample_rate, SAMPLE_RATE)
        orig, new = reduced_rates(self.sample_rate, SAMPLE_RATE)
        out_len = output_length(int(mono.shape[0]), self.sample_rate, SAMPLE_RATE)
        with self.stream:
            filters = cupy.asarray(kernel)  # [new, 2 width + orig] float32, at most 16 MiB
            out = cupy.empty((out_len,), dtype=cupy.float32)
            grid = (max(1, min(self._blocks, -(-out_len // RESAMPLE_THREADS))),)
            args = (
                mono, np.int64(mono.shape[0]), filters, np.int32(orig), np.int32(new), np.int32(width),
                np.int32(kernel.shape[1]), np.int64(out_len), out,
            )  # fmt: skip
            self._resample(grid, (RESAMPLE_THREADS,), args, stream=self.stream)
        return out
