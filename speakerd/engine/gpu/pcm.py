"""A recording's raw PCM to 16 kHz mono float32 on the GPU (kernels/pcm.cu), as it arrives.

Why: decoding, downmixing and resampling on the host took 7.3 s of the 8.0 s an hour of
48 kHz stereo spent in the server (one NumPy thread), against ~0.6 s of GPU work. Here each
piece of PCM bytes goes to the device when it arrives (the upload is the only host work)
and is decoded and downmixed there at once; every 16 kHz output whose resampling taps are
all in is computed too, so the fbank frames, and the windows' embeddings, can follow the
upload instead of waiting for the end of the audio. `finish` adds the last outputs (those
that read the zero padding past the recording's end). Each output is the same sum over the
same samples wherever the pieces were cut, with speakerd.model.recording's and .resample's
arithmetic (see the kernel file). Importing this module touches no device.
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
#: Device buffers to start with (one minute at the source rate); each doubles when full.
INITIAL_SECONDS = 60
#: first_bad's value when every f32 sample is fine.
NO_BAD_FRAME = np.iinfo(np.uint64).max


class GrowingBuffer:
    """A 1-D device array that doubles when full; everything on one stream.

    Growth copies what is there on `stream` and synchronises before the old array is
    dropped: CuPy's pool may hand its memory to the next allocation at once."""

    def __init__(self, capacity: int, dtype, stream) -> None:
        import cupy

        self.stream = stream
        with stream:
            self.array = cupy.empty((max(1, capacity),), dtype=dtype)
        self.size = 0

    def reserve(self, size: int) -> None:
        import cupy

        if size <= self.array.shape[0]:
            return
        with self.stream:
            grown = cupy.empty((max(size, 2 * self.array.shape[0]),), dtype=self.array.dtype)
            grown[: self.size] = self.array[: self.size]
        self.stream.synchronize()
        self.array = grown

    @property
    def pointer(self) -> int:
        return int(self.array.data.ptr)

    @property
    def data(self):  # -> cupy.ndarray, the filled part
        return self.array[: self.size]


class DevicePcm:
    """Raw interleaved PCM of one recording, decoded on `stream` piece by piece.

    `push` uploads whole frames and makes every 16 kHz sample it can (`ready` of them in
    `samples`); `finish` makes the rest. A piece's bytes are only staged: they are decoded
    into the mono buffer before the next piece reuses the staging buffer (stream order)."""

    def __init__(self, sample_rate: int, channels: int, encoding: Encoding, stream) -> None:
        import cupy

        from speakerd.engine.gpu import kernels

        self.sample_rate, self.channels, self.encoding = sample_rate, channels, encoding
        self.frame_bytes = encoding.itemsize * channels
        self.stream = stream
        self.frames = 0  # frames decoded (at the source rate)
        self.finished = False
        self._staging = GrowingBuffer(0, cupy.uint8, stream)
        self._mono = GrowingBuffer(INITIAL_SECONDS * sample_rate, cupy.float32, stream)
        self.identity = sample_rate == SAMPLE_RATE
        # 16 kHz output: the mono buffer itself when no resampling is needed
        self._out = (
            self._mono
            if self.identity
            else GrowingBuffer(INITIAL_SECONDS * SAMPLE_RATE, cupy.float32, stream)
        )
        module = kernels.module(SOURCE)
        self._s16, self._f32, self._resample = (module.get_function(name) for name in KERNEL_NAMES)
        self._blocks = BLOCKS_PER_SM * cupy.cuda.Device().attributes["MultiProcessorCount"]
        self._first_bad = cupy.full((1,), NO_BAD_FRAME, dtype=cupy.uint64)
        if not self.identity:
            kernel, self._width = sinc_kernel(sample_rate, SAMPLE_RATE)
            self._orig, self._new = reduced_rates(sample_rate, SAMPLE_RATE)
            self._taps = int(kernel.shape[1])
            with stream:
                self._filters = cupy.asarray(kernel)  # [new, 2 width + orig] float32, at most 16 MiB

    @property
    def ready(self) -> int:
        """16 kHz samples computed so far (final: later pieces do not change them)."""
        return self._out.size

    @property
    def samples(self):  # -> cupy.ndarray [ready] float32
        return self._out.data

    def push(self, data: bytes | memoryview) -> None:
        """Whole frames of PCM (the caller keeps partial frames for the next piece);
        InputError naming `audio` for an f32 sample that is NaN, Inf or outside [-1, 1]
        (reading that synchronises the stream)."""
        size = len(data)
        assert size % self.frame_bytes == 0, f"{size} bytes is not whole {self.frame_bytes}-byte frames"
        assert not self.finished, "push after finish"
        if size == 0:
            return
        count = size // self.frame_bytes
        self._staging.reserve(size)
        # pageable source: staged by the driver before this returns, so `data` may be reused
        self._staging.array[:size].set(np.frombuffer(data, dtype=np.uint8), stream=self.stream)
        self._mono.reserve(self.frames + count)
        grid = (max(1, min(self._blocks, -(-count // MONO_THREADS))),)
        out = np.uint64(self._mono.pointer + 4 * self.frames)
        if self.encoding is Encoding.S16:
            args = (self._staging.array, np.int32(self.channels), np.int64(count), out)
            self._s16(grid, (MONO_THREADS,), args, stream=self.stream)
        else:
            args = (self._staging.array, np.int32(self.channels), np.int64(count), out, self._first_bad)
            self._f32(grid, (MONO_THREADS,), args, stream=self.stream)
            bad = int(self._first_bad.get(stream=self.stream)[0])
            if bad != NO_BAD_FRAME:
                raise InputError(
                    "audio",
                    f"frame {self.frames + bad} holds NaN, Inf or |sample| > 1; "
                    "f32 samples must lie in [-1, 1]",
                )
        self.frames += count
        self._mono.size = self.frames
        if not self.identity:
            # output frame j (outputs j new .. j new + new - 1) reads inputs [j orig - width,
            # j orig - width + taps): complete once that span ends within the frames in
            complete = (self.frames + self._width - self._taps) // self._orig + 1
            self._resample_to(max(0, complete) * self._new)

    def finish(self):  # -> cupy.ndarray [N'] float32
        """The recording's 16 kHz mono samples, the last ones read the zero padding."""
        if not self.finished:
            self.finished = True
            if not self.identity:
                self._resample_to(output_length(self.frames, self.sample_rate, SAMPLE_RATE))
        return self.samples

    def _resample_to(self, end: int) -> None:
        begin = self._out.size
        if end <= begin:
            return
        self._out.reserve(end)
        grid = (max(1, min(self._blocks, -(-(end - begin) // RESAMPLE_THREADS))),)
        args = (
            self._mono.array, np.int64(self.frames), self._filters, np.int32(self._orig), np.int32(self._new),
            np.int32(self._width), np.int32(self._taps), np.int64(begin), np.int64(end), self._out.array,
        )  # fmt: skip
        self._resample(grid, (RESAMPLE_THREADS,), args, stream=self.stream)
        self._out.size = end
