"""The GPU fbank (speakerd.engine.gpu.fbank, kernels/fbank.cu) against the float64 NumPy
fbank (speakerd.model.fbank) and kaldi-native-fbank, on speech-like audio.

The kernels compute in float64 with NumPy's own tables, so against the float64 NumPy
pipeline the only difference is float32 rounding: the frames once, the mean-removed value
once (FLOAT32_BOUND). Against kaldi-native-fbank, a float32 implementation, the bounds are
tests/test_fbank.py's for our NumPy fbank. Windows cut from a recording's shared frames
equal, bit for bit, the same windows computed from their own samples; a captured CUDA graph
replays the eager result bit for bit and no call allocates device memory. Every GPU test
prints its numbers (`capsys.disabled`), so a passing device run shows them.

Without a usable GPU the GPU tests skip with the reason (REQUIRE_GPU=1 makes that a
failure); the layout, table and source checks at the top need no GPU and run everywhere.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from speakerd.engine.gpu import fbank as gpu_fbank
from speakerd.engine.gpu import kernels
from speakerd.engine.gpu.fbank import GpuFbank, RecordingLayout, tables
from speakerd.model.architecture import CHUNK_SAMPLES, FRAMES, MEL_BINS
from speakerd.model.audio import synthetic_recording
from speakerd.model.fbank import (
    FFT_SIZE,
    FRAME_LENGTH,
    FRAME_SHIFT,
    INT16_SCALE,
    _log_mel,
    chunk_recording,
    chunk_starts,
    fbank,
    log_mel_frames,
    mel_banks,
    num_frames,
)
from speakerd.model.inputs import InputError
from tests.test_fbank import KNF_BOUND, MEAN_BOUND, NULL_BOUND, RESOLVED_RANGE, knf_fbank

#: GPU vs float64 NumPy: a log energy |x| <= ~32 has a float32 spacing of 3.8e-6; the frame
#: is rounded once, its mean-removed value once (1.9e-6 measured in a host emulation of
#: the kernel), so a few spacings, nowhere near the float32 pipeline's 1.8e-3 on nulls.
FLOAT32_BOUND = 1e-5
#: Mean |GPU - NumPy| over a window: well under one float32 spacing.
FLOAT32_MEAN_BOUND = 1e-6


def _device_or_reason() -> str | None:
    """None when CuPy sees a CUDA device, else why not (the fbank needs no cuDNN)."""
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # ImportError, no driver, a runtime mismatch
        return f"no CUDA device for CuPy ({type(error).__name__}: {error})"
    return None if count > 0 else "CUDA reports 0 devices"


NO_DEVICE = _device_or_reason()
needs_gpu = pytest.mark.skipif(
    NO_DEVICE is not None, reason=f"no usable GPU for the fbank kernels: {NO_DEVICE}"
)


# ---------------------------------------------------------------------------------------
# No GPU needed
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("samples", "step"),
    [(1, 16_000), (399, 16_000), (50_000, 16_000), (160_000, 16_000), (170_000, 16_000), (176_000, 16_000),
     (376_000, 16_000), (gpu_fbank.HOUR_SAMPLES, 16_000), (208_000, 8_000), (200_160, 160)],
)  # fmt: skip
def test_layout_follows_pyannote_slide(samples: int, step: int) -> None:
    layout = RecordingLayout.of(samples, step)
    starts = chunk_starts(samples, CHUNK_SAMPLES, step)
    assert layout.windows == starts.shape[0], (samples, step, layout, starts.shape[0])
    full = starts[starts + CHUNK_SAMPLES <= samples]
    assert layout.full_windows == full.shape[0], (layout, full.shape[0])
    if layout.full_windows:
        last_frame = int(full[-1]) // FRAME_SHIFT + FRAMES
        assert layout.frames == last_frame <= num_frames(samples), (
            layout.frames,
            last_frame,
            num_frames(samples),
        )
    if layout.padded:
        assert layout.padded_start == int(starts[-1]) and layout.padded_length == samples - int(starts[-1])
    if samples == gpu_fbank.HOUR_SAMPLES:
        assert (layout.windows, layout.frames, layout.padded) == (3591, 359_998, False), layout


def test_layout_rejects_bad_input() -> None:
    with pytest.raises(InputError, match="samples"):
        RecordingLayout.of(0)
    with pytest.raises(InputError, match="step"):
        RecordingLayout.of(200_000, 1000)  # not a whole number of 10 ms frames


def test_tables_are_numpys_numbers() -> None:
    """The sparse mel runs rebuild mel_banks() exactly; the twiddles are W512^k."""
    table = tables()
    dense = np.zeros((FFT_SIZE // 2 + 1, MEL_BINS))
    for mel, (first, count, offset) in enumerate(table.mel_index.T):
        dense[first : first + count, mel] = table.mel_weight[offset : offset + count]
    np.testing.assert_array_equal(dense, mel_banks())
    expected = np.exp(-2j * np.pi * np.arange(FFT_SIZE) / FFT_SIZE)
    worst = float(np.abs(table.twiddle[:, 0] + 1j * table.twiddle[:, 1] - expected).max())
    assert worst < 1e-15, f"twiddle error {worst:.2e}"
    assert table.window.shape == (FRAME_LENGTH,) and table.window.dtype == np.float64


#: kernels/fbank.cu #define -> the Python value it must equal.
DEFINES = {
    "FRAME_LENGTH": FRAME_LENGTH,
    "FRAME_SHIFT": FRAME_SHIFT,
    "MELS": MEL_BINS,
    "FRAMES": FRAMES,
    "FFT_SIZE": FFT_SIZE,
    "LANES": gpu_fbank.LANES,
    "FRAME_THREADS": gpu_fbank.FRAME_THREADS,
    "SLICE_ROWS": gpu_fbank.SLICE_ROWS,
    "WRITE_THREADS": gpu_fbank.WRITE_THREADS,
    "SUM_ROW_GROUPS": gpu_fbank.SUM_THREADS // MEL_BINS,
}


def test_kernel_defines_match_the_launcher() -> None:
    source = kernels.kernel_sources()[gpu_fbank.SOURCE]
    defines = dict(re.findall(r"^#define (\w+) (\S+)\s*$", source, flags=re.MULTILINE))
    wrong = {
        name: (defines.get(name), value) for name, value in DEFINES.items() if defines.get(name) != str(value)
    }
    assert not wrong, f"(kernel #define, Python) disagree: {wrong}"
    assert float(defines["INT16_SCALE"]) == INT16_SCALE and float(defines["PREEMPHASIS"]) == 0.97, defines
    assert float(defines["LOG_FLOOR"]) == float(np.finfo(np.float32).eps), defines["LOG_FLOOR"]
    entries = re.findall(r'extern "C" __global__ (?:__launch_bounds__\([^)]*\) )?void (\w+)', source)
    assert tuple(entries) == gpu_fbank.KERNEL_NAMES, entries


def test_import_touches_no_device() -> None:
    """Importing the launcher imports no CuPy (so no CUDA context, nothing on a CPU host)."""
    code = "import sys, speakerd.engine.gpu.fbank; print('cupy' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.strip() == "False", result.stdout + result.stderr


# ---------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------


def _row(capsys, text: str) -> None:
    with capsys.disabled():
        print(text, flush=True)


def _recording_windows(
    samples: np.ndarray, max_windows: int, step: int = gpu_fbank.STEP_SAMPLES
) -> np.ndarray:
    """Every window of `samples` by GpuFbank (load, then windows in calls of max_windows)."""
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    engine = GpuFbank(max(samples.shape[0], CHUNK_SAMPLES), max_windows)
    with stream:  # the upload on the stream the kernels run on (a non-blocking one)
        device = cupy.asarray(samples)
    layout = engine.load(device, stream, step)
    out = cupy.empty((layout.windows, FRAMES, MEL_BINS), dtype=cupy.float32)
    for first in range(0, layout.windows, max_windows):
        count = min(max_windows, layout.windows - first)
        engine.windows(first, count, out[first:], stream)
    stream.synchronize()
    return cupy.asnumpy(out)


def _diff(ours: np.ndarray, reference: np.ndarray) -> tuple[float, float]:
    diff = np.abs(ours.astype(np.float64) - reference)
    return float(diff.max()), float(diff.mean())


@pytest.fixture(scope="module")
def speech() -> np.ndarray:
    """23.5 s of 3-speaker speech: 14 full windows and a padded 15th starting at 14 s
    (152,000 real samples, then 8,000 zeros)."""
    samples = synthetic_recording(23.5, seed=11).samples
    layout = RecordingLayout.of(samples.shape[0])
    assert (layout.full_windows, layout.padded, layout.padded_length) == (14, True, 152_000), layout
    return samples


@pytest.mark.gpu
@needs_gpu
def test_recording_matches_numpy_and_kaldi_native_fbank(speech: np.ndarray, capsys) -> None:
    import cupy

    ours = _recording_windows(speech, max_windows=4)  # calls of 4: the last mixes full and padded
    chunks = chunk_recording(speech)
    reference = fbank(chunks.waveforms)
    _row(capsys, f"\n{'case':<22} {'vs':<8} {'max abs':>10} {'mean abs':>10} {'max abs nulls':>14}")
    worst = worst_mean = 0.0
    for k in range(len(chunks)):
        high, mean = _diff(ours[k], reference[k])
        worst, worst_mean = max(worst, high), max(worst_mean, mean)
        name = f"window {k}" + (" (padded)" if chunks.lengths[k] < CHUNK_SAMPLES else "")
        _row(capsys, f"{name:<22} {'numpy64':<8} {high:>10.2e} {mean:>10.2e}")
    frames = GpuFbank(speech.shape[0], 1)
    frames.load(cupy.asarray(speech))
    shared = cupy.asnumpy(frames.frames[: frames.layout.frames])
    frame_high, frame_mean = _diff(shared, log_mel_frames(speech)[: frames.layout.frames].astype(np.float64))
    _row(capsys, f"{'shared frames':<22} {'numpy':<8} {frame_high:>10.2e} {frame_mean:>10.2e}")
    knf_worst = knf_all = knf_mean = 0.0
    for k in (0, 6, len(chunks) - 1):
        expected = knf_fbank(chunks.waveforms[k])
        diff = np.abs(ours[k].astype(np.float64) - expected)
        energy = _log_mel(chunks.waveforms[k : k + 1].astype(np.float64) * INT16_SCALE)[0]
        resolved = energy >= energy.max(axis=1, keepdims=True) - RESOLVED_RANGE
        row = (float(diff[resolved].max()), float(diff.mean()), float(diff.max()))
        _row(capsys, f"{f'window {k}':<22} {'knf':<8} {row[0]:>10.2e} {row[1]:>10.2e} {row[2]:>14.2e}")
        knf_worst, knf_mean, knf_all = max(knf_worst, row[0]), max(knf_mean, row[1]), max(knf_all, row[2])
    _row(capsys, "knf rows: 'max abs' over bins within 80 dB of their frame's peak, 'max abs nulls' over all")
    assert worst < FLOAT32_BOUND, f"GPU vs float64 NumPy: max abs {worst:.3e} >= {FLOAT32_BOUND}"
    assert worst_mean < FLOAT32_MEAN_BOUND, f"GPU vs float64 NumPy: mean abs {worst_mean:.3e}"
    assert frame_high < FLOAT32_BOUND, f"shared frames vs log_mel_frames: max abs {frame_high:.3e}"
    assert knf_worst < KNF_BOUND, f"vs kaldi-native-fbank {knf_worst:.3e} >= {KNF_BOUND} on resolved bins"
    assert knf_all < NULL_BOUND and knf_mean < MEAN_BOUND, (knf_all, knf_mean)


@pytest.mark.gpu
@needs_gpu
def test_shared_frames_equal_per_window_computation(speech: np.ndarray, capsys) -> None:
    """Window k cut from the recording's frames == window k computed from its own 160,000
    samples by the batch API (padded window included), bit for bit: same samples, same code."""
    import cupy

    shared = _recording_windows(speech, max_windows=32)
    waveforms = chunk_recording(speech).waveforms
    engine = GpuFbank(CHUNK_SAMPLES, waveforms.shape[0])
    own = cupy.empty((waveforms.shape[0], FRAMES, MEL_BINS), dtype=cupy.float32)
    engine.batch(cupy.asarray(waveforms), own)
    own = cupy.asnumpy(own)
    differing = [k for k in range(waveforms.shape[0]) if not np.array_equal(shared[k], own[k])]
    _row(
        capsys,
        f"\nshared-frame windows vs per-window batch: {waveforms.shape[0]} windows, differing {differing}",
    )
    assert not differing, f"windows {differing} differ; max abs {float(np.abs(shared - own).max()):.3e}"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(
    ("samples", "step"),
    [(1, 16_000), (399, 16_000), (50_000, 16_000), (160_000, 16_000), (176_000, 16_000), (208_000, 8_000)],
)
def test_short_recordings_and_other_steps(samples: int, step: int, capsys) -> None:
    audio = synthetic_recording(14.0, seed=samples).samples[:samples]
    ours = _recording_windows(audio, max_windows=8, step=step)
    reference = fbank(chunk_recording(audio, step=step).waveforms)
    assert ours.shape == reference.shape, (ours.shape, reference.shape)
    high, mean = _diff(ours, reference)
    _row(
        capsys,
        f"\n{samples} samples, step {step}: {ours.shape[0]} windows, max abs {high:.2e}, mean abs {mean:.2e}",
    )
    assert high < FLOAT32_BOUND, f"max abs {high:.3e} >= {FLOAT32_BOUND}"


@pytest.mark.gpu
@needs_gpu
def test_graph_replay_is_eager_bit_for_bit_and_calls_allocate_nothing(speech: np.ndarray) -> None:
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    windows = RecordingLayout.of(speech.shape[0]).windows  # 15: every row of `out` is written
    engine = GpuFbank(speech.shape[0], 16)
    with stream:  # uploads and fills ordered with the kernels (a non-blocking stream)
        samples = cupy.asarray(speech)
        waveforms = cupy.asarray(chunk_recording(speech).waveforms[:3])
        out = cupy.zeros((windows, FRAMES, MEL_BINS), dtype=cupy.float32)
        batch_out = cupy.zeros((3, FRAMES, MEL_BINS), dtype=cupy.float32)
    pool = cupy.get_default_memory_pool()

    def work() -> None:
        engine.load(samples, stream)
        engine.windows(0, 10, out, stream)
        engine.windows(10, windows - 10, out[10:], stream)  # the full windows 10-13 and the padded one
        engine.batch(waveforms, batch_out, stream)

    work()
    stream.synchronize()
    eager, eager_batch = cupy.asnumpy(out), cupy.asnumpy(batch_out)
    used = pool.used_bytes()
    work()
    stream.synchronize()
    assert pool.used_bytes() == used, f"a call allocated {pool.used_bytes() - used} bytes"
    np.testing.assert_array_equal(cupy.asnumpy(out), eager)  # two eager runs
    with stream:
        out.fill(np.nan)
        batch_out.fill(np.nan)
    stream.synchronize()
    stream.begin_capture()
    try:
        work()
    finally:
        graph = stream.end_capture()
    graph.launch(stream)
    stream.synchronize()
    np.testing.assert_array_equal(cupy.asnumpy(out), eager)
    np.testing.assert_array_equal(cupy.asnumpy(batch_out), eager_batch)


@pytest.mark.gpu
@needs_gpu
def test_bad_input_names_the_field() -> None:
    import cupy

    engine = GpuFbank(CHUNK_SAMPLES * 2, 4)
    out = cupy.empty((4, FRAMES, MEL_BINS), dtype=cupy.float32)
    with pytest.raises(InputError, match=r"^first: no recording loaded"):
        engine.windows(0, 1, out)
    with pytest.raises(InputError, match=r"^samples: float64"):
        engine.load(cupy.zeros(1000, dtype=cupy.float64))
    with pytest.raises(InputError, match=r"^samples: ndarray, expected a cupy\.ndarray"):
        engine.load(np.zeros(1000, dtype=np.float32))
    with pytest.raises(InputError, match=r"^samples: 320001 samples, expected 1\.\.320000"):
        engine.load(cupy.zeros(CHUNK_SAMPLES * 2 + 1, dtype=cupy.float32))
    layout = engine.load(cupy.zeros(CHUNK_SAMPLES + 40_000, dtype=cupy.float32))
    assert layout.windows == 4, layout
    with pytest.raises(InputError, match=r"^count: windows \[2, 5\) of 4"):
        engine.windows(2, 3, out)
    with pytest.raises(InputError, match=r"^count: windows"):
        engine.windows(0, 0, out)
    with pytest.raises(InputError, match=r"^out: device pointer .* is not 16-byte aligned"):
        engine.windows(0, 1, int(out.data.ptr) + 4)
    with pytest.raises(InputError, match=r"^out: float32 shape \(1, 998, 80\), expected .* >= 159680 values"):
        engine.windows(0, 2, out[:1])
    with pytest.raises(InputError, match=r"^waveform: shape \(5, 160000\)"):
        engine.batch(cupy.zeros((5, CHUNK_SAMPLES), dtype=cupy.float32), out)
    with pytest.raises(InputError, match=r"^waveform: shape \(1, 1000\)"):
        engine.batch(cupy.zeros((1, 1000), dtype=cupy.float32), out)


@pytest.mark.gpu
@needs_gpu
def test_an_hour_spot_checked_then_benchmarked(capsys) -> None:
    """An hour (57.6 M samples, 3,591 windows: every index at full size) spot-checked
    against NumPy at its first, middle and last windows; then the benchmark's numbers,
    printed for the record (speed is never asserted)."""
    import cupy

    minute = synthetic_recording(60.0, seed=4).samples
    hour = np.tile(minute, 60)
    samples = cupy.asarray(hour)
    engine = GpuFbank(hour.shape[0], 1)
    layout = engine.load(samples)
    assert (layout.windows, layout.frames) == (3591, 359_998), layout
    out = cupy.empty((1, FRAMES, MEL_BINS), dtype=cupy.float32)
    rows = []
    for k in (0, 1795, 3590):
        engine.windows(k, 1, out)
        start = k * gpu_fbank.STEP_SAMPLES
        high, mean = _diff(
            cupy.asnumpy(out[0]), fbank(hour[start : start + CHUNK_SAMPLES]).astype(np.float64)
        )
        rows.append((k, high, mean))
    del engine, out, samples
    _row(
        capsys,
        "\nhour window   max abs   mean abs\n"
        + "\n".join(f"{k:>11} {h:>9.2e} {m:>10.2e}" for k, h, m in rows),
    )
    assert max(high for _, high, _ in rows) < FLOAT32_BOUND, rows
    cupy.get_default_memory_pool().free_all_blocks()
    result = gpu_fbank.benchmark_hour(repeats=5)
    _row(capsys, "fbank benchmark: " + json.dumps(result))
    assert result["windows"] == 3591 and result["frames"] == 359_998, result
