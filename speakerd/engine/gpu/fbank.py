"""pyannote's fbank on the GPU: a recording's log-mel frames computed once, windows cut from them.

Why: the windows of a recording overlap by 90 % (10 s every 1 s) and fbank frames fall
every 160 samples, so window k's frames before its mean removal are frames [100 k, 100 k +
998) of the recording's own frames (only the zero-padded last window has frames of its
own). Computing the frames once and slicing them does a tenth of the work of a per-window
fbank and never sends fbank over the wire: the service receives samples.

`GpuFbank` owns its device buffers, sized at construction for the longest recording and
the most windows per call, so that a call allocates nothing and only enqueues kernels on
the stream it is given (and so can be captured in a CUDA graph):

- `load(samples, stream)`: the recording's shared frames [T, 80] and, when the last window
  is padded, that window's own 998 frames from its zero-padded samples;
- `windows(first, count, out, stream)`: windows [first, first + count) as [count, 998, 80]
  float32, each with its own per-mel mean removed, written to a device pointer (e.g. the
  GPU plan's fbank input buffer);
- `batch(waveforms, out, stream)`: [n, 160000] chunks -> [n, 998, 80] (EmbedChunks' waveform input).

The kernels (kernels/fbank.cu) compute in float64 with NumPy's own window, twiddle and mel
tables, so they equal speakerd.model.fbank up to float32 rounding. Importing this module
touches no device: CuPy is imported when a GpuFbank is built.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import numpy as np

from speakerd.model.architecture import CHUNK_SAMPLES, FRAMES, MEL_BINS, SAMPLE_RATE
from speakerd.model.fbank import FFT_SIZE, FRAME_SHIFT, STEP_SAMPLES, hamming_window, mel_banks, num_frames
from speakerd.model.inputs import InputError
from speakerd.model.recording import complete_windows

#: kernels/fbank.cu and its entry points.
SOURCE = "fbank.cu"
KERNEL_NAMES = ("fbank_frames", "fbank_window_sums", "fbank_window_write")
#: Launch shapes; each equals the #define of the same name in kernels/fbank.cu (tests check).
LANES = 16  # threads per frame: one per column / row of the 16 x 16 FFT
FRAME_THREADS = 128
FRAMES_PER_BLOCK = FRAME_THREADS // LANES
SLICE_ROWS = 128  # rows of a window summed (and written) by one block
SLICES = -(-FRAMES // SLICE_ROWS)
SUM_THREADS = 4 * MEL_BINS  # SUM_ROW_GROUPS x MELS
WRITE_THREADS = 256
#: Output rows are written as 16-byte float4s.
ALIGNMENT = 16
#: An hour of 16 kHz audio, the benchmark's recording (3,591 windows).
HOUR_SAMPLES = 3600 * SAMPLE_RATE
#: The engine's largest batch: windows per call unless told otherwise.
DEFAULT_MAX_WINDOWS = 32


@dataclass(frozen=True)
class RecordingLayout:
    """pyannote's windows of a recording of `samples` samples every `step` samples
    (speakerd.model.fbank.chunk_starts) and the frames they need: full windows share the
    recording's frames, a padded last one (when the full windows do not end at the last
    sample) has its own."""

    samples: int
    full_windows: int
    padded: bool
    step: int = STEP_SAMPLES

    @classmethod
    def of(cls, samples: int, step: int = STEP_SAMPLES) -> RecordingLayout:
        if samples < 1:
            raise InputError("samples", f"{samples} samples; a recording needs at least one")
        if not 0 < step <= CHUNK_SAMPLES or step % FRAME_SHIFT:
            raise InputError(
                "step", f"{step} samples, expected a multiple of {FRAME_SHIFT} in (0, {CHUNK_SAMPLES}]"
            )
        full = complete_windows(samples, step)
        padded = samples < CHUNK_SAMPLES or (samples - CHUNK_SAMPLES) % step > 0
        return cls(samples, full, padded, step)

    @property
    def step_frames(self) -> int:
        """Frames between consecutive windows' first frames."""
        return self.step // FRAME_SHIFT

    @property
    def windows(self) -> int:
        return self.full_windows + int(self.padded)

    @property
    def frames(self) -> int:
        """Shared frames: the span of the full windows, step_frames per step plus one window."""
        return self.step_frames * (self.full_windows - 1) + FRAMES if self.full_windows else 0

    @property
    def padded_start(self) -> int:
        """First sample of the padded window (it starts where the next full one would)."""
        return self.full_windows * self.step

    @property
    def padded_length(self) -> int:
        """Real samples in the padded window; the rest of its 160,000 are zeros."""
        return self.samples - self.padded_start if self.padded else 0


@dataclass(frozen=True)
class Tables:
    """The numbers speakerd.model.fbank computes with, in the layout the kernel reads."""

    window: np.ndarray  # [400] float64 symmetric Hamming window
    twiddle: np.ndarray  # [512, 2] float64: (cos, -sin)(2 pi k / 512) = W512^k
    mel_weight: np.ndarray  # [nonzeros] float64: each filter's weights over its run of FFT bins
    mel_index: np.ndarray  # [3, 80] int32: first FFT bin, bin count, offset into mel_weight


def tables() -> Tables:
    """The window, FFT twiddles and mel filters (as contiguous runs of FFT bins) for the kernel.

    The kernel skips the Nyquist bin (k = 256): Kaldi's banks give it weight 0, checked here."""
    banks = mel_banks()  # [257, 80]
    assert not banks[FFT_SIZE // 2].any(), "the kernel assumes the Nyquist bin has no mel weight"
    firsts, counts, offsets, weights = [], [], [], []
    for mel in range(MEL_BINS):
        nonzero = np.flatnonzero(banks[:, mel])
        assert nonzero.size, f"mel filter {mel} covers no FFT bin"
        first, last = int(nonzero[0]), int(nonzero[-1])
        firsts.append(first)
        counts.append(last - first + 1)
        offsets.append(sum(len(w) for w in weights))
        weights.append(banks[first : last + 1, mel])
    angle = 2.0 * np.pi * np.arange(FFT_SIZE, dtype=np.float64) / FFT_SIZE
    return Tables(
        window=np.ascontiguousarray(hamming_window(), dtype=np.float64),
        twiddle=np.stack([np.cos(angle), -np.sin(angle)], axis=1),
        mel_weight=np.concatenate(weights).astype(np.float64),
        mel_index=np.asarray([firsts, counts, offsets], dtype=np.int32),
    )


@functools.cache
def device_tables() -> tuple:  # -> (window, twiddle, mel_weight, mel_index) CuPy arrays
    """The kernel's tables on the current device, uploaded once per process: a recording
    call builds a GpuFbank of its own, and must not pay an upload and a device-wide
    synchronisation (which waits for every stream's work, the engine's batches included)."""
    import cupy

    table = tables()
    arrays = tuple(cupy.asarray(a) for a in (table.window, table.twiddle, table.mel_weight, table.mel_index))
    cupy.cuda.Device().synchronize()  # uploaded before any stream uses them
    return arrays


def _pointer(out, field: str, elements: int) -> int:
    """A device pointer from an int (the caller vouches for its room) or a C-contiguous
    float32 CuPy array holding at least `elements`; 16-byte aligned either way (float4 stores)."""
    if isinstance(out, (int, np.integer)):
        pointer = int(out)
    else:
        if out.dtype != np.float32 or not out.flags.c_contiguous or out.size < elements:
            raise InputError(
                field,
                f"{out.dtype} shape {tuple(out.shape)}, "
                f"expected C-contiguous float32 with >= {elements} values",
            )
        pointer = int(out.data.ptr)
    if pointer % ALIGNMENT:
        raise InputError(field, f"device pointer {pointer:#x} is not {ALIGNMENT}-byte aligned")
    return pointer


def _check_array(array, field: str, ndim: int) -> None:
    """A C-contiguous float32 CuPy array of `ndim` dimensions, else an InputError naming `field`."""
    import cupy

    if not isinstance(array, cupy.ndarray):
        raise InputError(field, f"{type(array).__name__}, expected a cupy.ndarray on the device")
    if array.dtype != cupy.float32 or array.ndim != ndim or not array.flags.c_contiguous:
        raise InputError(
            field,
            f"{array.dtype} shape {tuple(array.shape)}, expected C-contiguous float32 with {ndim} dimensions",
        )


class GpuFbank:
    """Device fbank of recordings up to `max_samples` long, up to `max_windows` windows (or
    batch chunks) per call. Buffers are allocated here, once; calls only launch kernels.

    One stream at a time: the frame and partial-sum buffers are shared by all calls, so
    calls on different streams must be ordered by the caller (events), as the engine's
    single compute stream does."""

    def __init__(
        self, max_samples: int = HOUR_SAMPLES, max_windows: int = DEFAULT_MAX_WINDOWS, chunks: bool = True
    ) -> None:
        """`chunks=False` leaves out the `batch` API's frame buffer (10 MB at 32 chunks): a
        recording source that keeps its frames itself needs only the tables and kernels."""
        import cupy

        from speakerd.engine.gpu import kernels

        if max_samples < 1 or max_windows < 1:
            raise InputError(
                "max_samples", f"max_samples={max_samples}, max_windows={max_windows}; both must be >= 1"
            )
        self.max_samples, self.max_windows = max_samples, max_windows
        capacity = max(num_frames(max_samples), FRAMES)  # the most any step needs
        self.frames = cupy.empty((capacity, MEL_BINS), dtype=cupy.float32)  # the recording's shared frames
        self.padded_frames = cupy.empty((FRAMES, MEL_BINS), dtype=cupy.float32)  # the padded window's own
        batch_rows = max_windows * FRAMES
        self.batch_frames = cupy.empty((batch_rows, MEL_BINS), dtype=cupy.float32) if chunks else None
        self.partial = cupy.empty((max_windows, SLICES, MEL_BINS), dtype=cupy.float64)
        self.window, self.twiddle, self.mel_weight, self.mel_index = device_tables()
        module = kernels.module(SOURCE)
        self._frames_kernel, self._sums_kernel, self._write_kernel = (
            module.get_function(n) for n in KERNEL_NAMES
        )
        self.layout: RecordingLayout | None = None

    # -- frames ---------------------------------------------------------------------------

    def compute_frames(
        self, samples_ptr: int, stride: int, valid: int, per_recording: int, total: int, out, stream
    ) -> None:
        """Frames [0, total) into `out` (a CuPy array or device pointer): frame g is frame
        g % per_recording of the recording whose samples start `stride` samples after the
        previous one's at `samples_ptr`; samples at or past `valid` read as zeros."""
        grid = (-(-total // FRAMES_PER_BLOCK),)
        out = np.uint64(out) if isinstance(out, (int, np.integer)) else out
        args = (
            np.uint64(samples_ptr), np.int64(stride), np.int64(valid), np.int32(per_recording),
            np.int64(total), self.window, self.twiddle, self.mel_weight, self.mel_index, out,
        )  # fmt: skip
        self._frames_kernel(grid, (FRAME_THREADS,), args, stream=stream)

    def load(self, samples, stream=None, step: int = STEP_SAMPLES) -> RecordingLayout:
        """Compute the frames of a recording with windows every `step` samples: `samples` a
        [N] float32 CuPy array (16 kHz mono in [-1, 1], not checked here: that costs a device
        sync). Enqueued on `stream`; the samples must stay alive until the stream has run
        the launches."""
        _check_array(samples, "samples", 1)
        if not 1 <= samples.shape[0] <= self.max_samples:
            raise InputError(
                "samples", f"{samples.shape[0]} samples, expected 1..{self.max_samples} (max_samples)"
            )
        layout = RecordingLayout.of(int(samples.shape[0]), step)
        base = int(samples.data.ptr)
        if layout.full_windows:
            self.compute_frames(base, 0, layout.samples, layout.frames, layout.frames, self.frames, stream)
        if layout.padded:
            start = base + 4 * layout.padded_start
            self.compute_frames(start, 0, layout.padded_length, FRAMES, FRAMES, self.padded_frames, stream)
        self.layout = layout
        return layout

    # -- windows --------------------------------------------------------------------------

    def write_windows(self, frames, first: int, count: int, frame_step: int, out_ptr: int, stream) -> None:
        """Windows [first, first + count) of `frames` (a CuPy array or device pointer), window
        k starting at frame k * frame_step, each minus its own per-mel mean, to `out_ptr`."""
        grid = (count, SLICES)
        frames = np.uint64(frames) if isinstance(frames, (int, np.integer)) else frames
        self._sums_kernel(grid, (SUM_THREADS,), (frames, np.int32(first), np.int32(frame_step), self.partial),
                          stream=stream)  # fmt: skip
        args = (frames, np.int32(first), np.int32(frame_step), self.partial, np.uint64(out_ptr))
        self._write_kernel(grid, (WRITE_THREADS,), args, stream=stream)

    def windows(self, first: int, count: int, out, stream=None) -> None:
        """Windows [first, first + count) of the loaded recording into `out` (a device pointer
        or CuPy array with room for [count, 998, 80] float32), each minus its own per-mel mean."""
        layout = self.layout
        if layout is None:
            raise InputError("first", "no recording loaded; call load(samples) first")
        if not (first >= 0 and 1 <= count <= self.max_windows and first + count <= layout.windows):
            raise InputError(
                "count",
                f"windows [{first}, {first + count}) of {layout.windows}; "
                f"at most {self.max_windows} per call",
            )
        pointer = _pointer(out, "out", count * FRAMES * MEL_BINS)
        full = max(0, min(first + count, layout.full_windows) - first)
        if full:
            self.write_windows(self.frames, first, full, layout.step_frames, pointer, stream)
        if full < count:  # the padded window is the last, and it is in the range
            padded_out = pointer + full * FRAMES * MEL_BINS * 4
            self.write_windows(self.padded_frames, 0, 1, FRAMES, padded_out, stream)

    # -- batch of chunks ------------------------------------------------------------------

    def batch(self, waveforms, out, stream=None) -> None:
        """[n, 160000] float32 CuPy chunks -> `out` [n, 998, 80] (pointer or CuPy array)."""
        _check_array(waveforms, "waveform", 2)
        assert self.batch_frames is not None, "GpuFbank(chunks=False) has no batch API"
        n = int(waveforms.shape[0])
        if waveforms.shape[1] != CHUNK_SAMPLES or not 1 <= n <= self.max_windows:
            raise InputError(
                "waveform",
                f"shape {tuple(waveforms.shape)}, "
                f"expected [n, {CHUNK_SAMPLES}] with n in 1..{self.max_windows}",
            )
        pointer = _pointer(out, "out", n * FRAMES * MEL_BINS)
        ptr = int(waveforms.data.ptr)
        self.compute_frames(ptr, CHUNK_SAMPLES, CHUNK_SAMPLES, FRAMES, n * FRAMES, self.batch_frames, stream)
        self.write_windows(self.batch_frames, 0, n, FRAMES, pointer, stream)


# -- benchmark (run by the bench tooling and printed by the GPU test; never asserted) ------


def _elapsed_ms(stream, launch, repeats: int) -> float:
    """Mean GPU ms of `launch()` over `repeats` runs on `stream`, by CUDA events (after a warm-up)."""
    import cupy

    launch()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record(stream)
    for _ in range(repeats):
        launch()
    stop.record(stream)
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop) / repeats


def benchmark_hour(repeats: int = 5, seed: int = 0) -> dict:
    """Time an hour of audio (3,591 windows) with CUDA events and return the numbers.

    Timed: the frames once (`load`); the windows as the engine would ask for them, in calls
    of DEFAULT_MAX_WINDOWS into one reused buffer, eagerly (host launch overhead included)
    and as one captured CUDA graph replay (GPU time); one window's graph (a b1 batch); all
    windows in one call (the kernels' throughput); the batch API at DEFAULT_MAX_WINDOWS
    chunks; and, for the design's record, cuFFT's batched 512-point real FFT of the same
    number of frames (the FFT alone, frames already cut, float32 and float64) next to our
    whole frames kernel.

    The audio is uniform noise in [-0.5, 0.5]: the kernels' time does not depend on content.
    Needs ~2.5 GB of device memory (the one-call output is 1.15 GB)."""
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        samples = (cupy.random.default_rng(seed).uniform(-0.5, 0.5, HOUR_SAMPLES)).astype(cupy.float32)
        layout = RecordingLayout.of(HOUR_SAMPLES)
        fbank = GpuFbank(HOUR_SAMPLES, layout.windows)
        batch_out = cupy.empty((DEFAULT_MAX_WINDOWS, FRAMES, MEL_BINS), dtype=cupy.float32)
        all_out = cupy.empty((layout.windows, FRAMES, MEL_BINS), dtype=cupy.float32)
        fbank.load(samples, stream)
        stream.synchronize()

        def batched_windows() -> None:
            for first in range(0, layout.windows, DEFAULT_MAX_WINDOWS):
                fbank.windows(first, min(DEFAULT_MAX_WINDOWS, layout.windows - first), batch_out, stream)

        frames_ms = _elapsed_ms(stream, lambda: fbank.load(samples, stream), repeats)
        batched_ms = _elapsed_ms(stream, batched_windows, repeats)
        stream.begin_capture()
        try:
            batched_windows()
        finally:
            graph = stream.end_capture()
        graph_ms = _elapsed_ms(stream, lambda: graph.launch(stream), repeats)
        stream.begin_capture()
        try:
            fbank.windows(layout.windows // 2, 1, batch_out, stream)  # one window: a b1 batch's fbank
        finally:
            single = stream.end_capture()
        single_ms = _elapsed_ms(stream, lambda: single.launch(stream), repeats)
        one_call_ms = _elapsed_ms(stream, lambda: fbank.windows(0, layout.windows, all_out, stream), repeats)
        chunks = samples[: DEFAULT_MAX_WINDOWS * CHUNK_SAMPLES].reshape(DEFAULT_MAX_WINDOWS, CHUNK_SAMPLES)
        batch_ms = _elapsed_ms(stream, lambda: fbank.batch(chunks, batch_out, stream), repeats)
        fft_ms = {}
        for dtype in (cupy.float32, cupy.float64):
            framed = cupy.zeros((layout.frames, FFT_SIZE), dtype=dtype)
            # the warm-up call makes the plan; CuPy's plan cache serves the timed calls
            ms = _elapsed_ms(stream, lambda f=framed: cupy.fft.rfft(f, axis=1), repeats)
            fft_ms[np.dtype(dtype).name] = round(ms, 4)
            del framed
    written = 4 * layout.windows * FRAMES * MEL_BINS
    return {
        "samples": HOUR_SAMPLES,
        "frames": layout.frames,
        "windows": layout.windows,
        "frames_ms": round(frames_ms, 4),
        "frames_gb_per_s": round((4 * HOUR_SAMPLES + 4 * layout.frames * MEL_BINS) / frames_ms / 1e6, 1),
        f"windows_by_{DEFAULT_MAX_WINDOWS}_eager_ms": round(batched_ms, 4),
        f"windows_by_{DEFAULT_MAX_WINDOWS}_graph_ms": round(graph_ms, 4),
        "window_b1_graph_ms": round(single_ms, 4),
        "windows_one_call_ms": round(one_call_ms, 4),
        "windows_one_call_gb_written_per_s": round(written / one_call_ms / 1e6, 1),
        "hour_frames_plus_windows_graph_ms": round(frames_ms + graph_ms, 4),
        f"batch_api_{DEFAULT_MAX_WINDOWS}_chunks_ms": round(batch_ms, 4),
        "cufft_rfft512_only_ms": fft_ms,
    }


if __name__ == "__main__":
    print(json.dumps(benchmark_hour(), indent=1))
