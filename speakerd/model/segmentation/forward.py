"""segmentation-3.0's forward in NumPy float32: per window, and over a whole recording.

Two entry points give the same numbers, both held to pyannote's own `PyanNet` on the real
weights by tests/test_segmentation_parity.py (log-probabilities within 1e-4, the same hard
multilabel output):

- `log_probs(model, windows)`: windows [n, 160000] -> [n, 589, 7], straight, each window as
  pyannote's `Model` sees it: its waveform InstanceNorm applied to the samples, then the
  filter bank. The reference.
- `recording_log_probs(model, samples, starts)`: the windows of one recording, sharing the
  filter bank's convolution. A window starts at a multiple of the stride (10 samples; the
  pipeline's step is 16,000), so window k's filter-bank frames are the recording's frames
  start_k / 10 + j: the convolution runs once over the recording (zero-padded past its end,
  as pyannote pads the last window) instead of ten times. Each window's waveform
  InstanceNorm is an affine map a x + c of its samples, so its frames are
  conv(a x + c) = a conv(x) + c sum(w), computed exactly (float64).

torch convolves the normalised samples rounded to float32, though, and where the audio
leaves a band empty (sample.wav above 7 kHz) that rounding's own convolution is a visible
part of the band's channel, which the InstanceNorm after it scales up to unit variance: left
out, it moved sample.wav's log-probabilities by 1.3e-4. So per window, each channel whose
rounding share (the rounding's rms through the filter, over the channel's spread after
pooling) exceeds ROUNDING_SHARE gets conv(rounding) added, in float32 (`rounding_bands`);
on full-band speech none does.

Then per window the rest of SincNet (layers.py), and the LSTM and classifier over a group
of windows at once (lstm.py). Windows go in groups of GROUP_WINDOWS, which bounds memory
whatever the recording's length; the output itself is 16.5 kB a window (59 MB for an
hour's 3,591 windows). Threads: workers.py.

Measured on this project's 2-core machine (AMD EPYC, AVX2, NumPy 2.4 with OpenBLAS 0.3.31),
shared with other jobs at the time (load average 3 to 7), 10 minutes of synthetic speech
(591 windows), `python -m speakerd bench-segmentation --seconds 600 --pyannote
.cache/pyannote/segmentation-3.0/pytorch_model.bin --torch-threads 1`: recording_log_probs
54.4 s (37.2 CPU s, 63 ms a window); pyannote's own PyanNet in the same run (torch 2.13, one
thread, batches of 32) 65.4 s (42.4 CPU s). docs/segmentation.md has the details.
"""

from __future__ import annotations

import numpy as np

from speakerd.model.segmentation.architecture import (
    CLASSES,
    OUTPUT_FRAMES,
    SINC_FRAMES,
    SINC_KERNEL,
    SINC_STRIDE,
    WINDOW_SAMPLES,
)
from speakerd.model.segmentation.layers import (
    SINC_BLOCK_FRAMES,
    front_end,
    normalised_window,
    pooled_abs,
    sinc_frame_count,
    sinc_frames,
    wav_norm_terms,
)
from speakerd.model.segmentation.lstm import head
from speakerd.model.segmentation.weights import SegmentationModel
from speakerd.model.segmentation.workers import one_blas_thread, spread

F32 = np.float32
#: Windows whose LSTM runs as one batch. Per group: each LSTM direction's input
#: projections (1.2 MB a window), a layer's input and output (0.6 MB each) and the
#: recording's shared filter-bank frames in float64 (1,600 new frames a window: 1 MB); per
#: window in flight (one per worker), about 40 MB. Measured with tracemalloc: 162 MB of
#: working arrays at the peak for 111 windows and for 591 alike, plus the output. 32 windows
#: make the recurrence's matmuls [32, 128] x [128, 512]: the LSTM takes a seventh less time
#: a window than with 16 (measured: 5.1 against 5.95 ms a layer and direction).
GROUP_WINDOWS = 32
#: A channel whose float32 rounding of the normalised waveform moves it by more than this
#: share of its spread gets that rounding reproduced (see module doc). Measured: the
#: channels of sample.wav's empty bands above 7 kHz sit at 1e-4 to 4e-4; every other
#: channel of it, and every channel of the synthetic speech, below 1e-5.
ROUNDING_SHARE = 1e-5


def window_features(model: SegmentationModel, window: np.ndarray) -> np.ndarray:
    """One window [160000] -> the LSTM's input [589, 60], the waveform norm applied first."""
    normalised, _ = normalised_window(window, model.wav_norm)
    return front_end(model, pooled_abs(sinc_frames(normalised, model.filters)))


def rounding_bands(
    model: SegmentationModel, window: np.ndarray, frames: np.ndarray, pooled: np.ndarray
) -> None:
    """Add the convolution of the window's normalisation rounding to the channels where it
    shows (see module doc): `frames` [15975, 80] float64 and `pooled` [5325, 80] in place."""
    _, rounding = normalised_window(window, model.wav_norm)
    share = np.sqrt(np.mean(np.square(rounding))) * model.filter_norms
    noisy = np.flatnonzero(share > ROUNDING_SHARE * pooled.std(axis=0, dtype=np.float64))
    if noisy.size:
        bands = frames[:, noisy] + sinc_frames(rounding.astype(F32), model.filters[:, noisy], F32)
        pooled[:, noisy] = pooled_abs(bands)


def recording_window_features(model: SegmentationModel, window: np.ndarray, shared: np.ndarray) -> np.ndarray:
    """One window [160000] of a recording and its rows [15975, 80] of the recording's
    filter-bank frames (float64, of the raw samples) -> the LSTM's input [589, 60]."""
    alpha, beta = wav_norm_terms(window, model.wav_norm)
    frames = shared * np.float64(alpha)
    frames += np.float64(beta) * model.filter_sums
    pooled = pooled_abs(frames)
    rounding_bands(model, window, frames, pooled)
    return front_end(model, pooled)


def log_probs(model: SegmentationModel, windows: np.ndarray) -> np.ndarray:
    """[n, 160000] float32 windows -> [n, 589, 7] float32 powerset log-probabilities, each
    window as pyannote's `Model` computes it (the reference for `recording_log_probs`)."""
    windows = np.asarray(windows)
    if windows.ndim != 2 or windows.shape[1] != WINDOW_SAMPLES:
        raise ValueError(f"windows of shape {windows.shape}, expected [n, {WINDOW_SAMPLES}]")
    windows = np.ascontiguousarray(windows, dtype=F32)
    out = np.empty((windows.shape[0], OUTPUT_FRAMES, CLASSES), dtype=F32)
    with one_blas_thread():
        for first in range(0, windows.shape[0], GROUP_WINDOWS):
            group = windows[first : first + GROUP_WINDOWS]
            features = spread(lambda window: window_features(model, window), group)
            out[first : first + group.shape[0]] = head(model, np.stack(features))
    return out


def _window_starts(samples: int, starts: np.ndarray) -> np.ndarray:
    starts = np.asarray(starts)
    if starts.ndim != 1 or starts.size == 0 or starts.dtype.kind not in "iu":
        raise ValueError(
            f"window starts {starts.dtype} of shape {starts.shape}, expected [n] integers, n >= 1"
        )
    starts = starts.astype(np.int64)
    if np.any(starts % SINC_STRIDE) or np.any(starts < 0) or np.any(starts >= samples):
        raise ValueError(
            f"window starts must be multiples of {SINC_STRIDE} samples inside the recording's {samples}"
        )
    if np.any(np.diff(starts) < 0):
        raise ValueError("window starts must be in increasing order")
    return starts


def shared_sinc_frames(model: SegmentationModel, span: np.ndarray) -> np.ndarray:
    """`sinc_frames` of a group's span of the recording, in blocks spread over the workers."""
    firsts = range(0, sinc_frame_count(span.shape[0]), SINC_BLOCK_FRAMES)
    last_sample = (SINC_BLOCK_FRAMES - 1) * SINC_STRIDE + SINC_KERNEL
    pieces = spread(
        lambda first: sinc_frames(
            span[first * SINC_STRIDE : first * SINC_STRIDE + last_sample], model.filters
        ),
        firsts,
    )
    return np.concatenate(pieces)


def recording_log_probs(model: SegmentationModel, samples: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Windows of one recording [N] float32 starting at `starts` (sample offsets, multiples of
    10, increasing; pyannote's: speakerd.model.fbank.chunk_starts) -> [n, 589, 7] float32,
    each window zero-padded past the recording's end. `log_probs` of the same windows to
    float32 rounding, with the filter bank convolved once (see module doc)."""
    samples = np.asarray(samples)
    if samples.ndim != 1:
        raise ValueError(f"samples of shape {samples.shape}, expected a mono recording [N]")
    samples = np.ascontiguousarray(samples, dtype=F32)
    starts = _window_starts(samples.shape[0], starts)
    out = np.empty((starts.shape[0], OUTPUT_FRAMES, CLASSES), dtype=F32)
    with one_blas_thread():
        for first in range(0, starts.shape[0], GROUP_WINDOWS):
            group = starts[first : first + GROUP_WINDOWS]
            span = np.zeros(int(group[-1] - group[0]) + WINDOW_SAMPLES, dtype=F32)
            available = samples[group[0] : group[0] + span.shape[0]]
            span[: available.shape[0]] = available
            shared = shared_sinc_frames(model, span)
            offsets = [int(start - group[0]) for start in group]
            features = spread(
                lambda offset, span=span, shared=shared: recording_window_features(
                    model,
                    span[offset : offset + WINDOW_SAMPLES],
                    shared[offset // SINC_STRIDE : offset // SINC_STRIDE + SINC_FRAMES],
                ),
                offsets,
            )
            out[first : first + group.shape[0]] = head(model, np.stack(features))
    return out
