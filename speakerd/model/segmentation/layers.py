"""SincNet's layers in NumPy, each with torch's arithmetic where the network amplifies rounding.

segmentation-3.0 divides by a small spread three times: each InstanceNorm scales a channel
to unit variance, and some channels vary a thousand times less than their level (a band
the audio leaves empty, a low band's response to the waveform norm's offset), or not at
all (digital silence, where it divides by sqrt(eps)). Float32 rounding there becomes a
visible part of the output, pyannote's own included: its float32 log-probabilities differ
from its float64 forward's by 3.6e-4 on sample.wav. So to stay within 1e-4 of pyannote
(docs/segmentation.md) these layers repeat torch's rounding where it can be repeated and are
exact where it cannot:

- InstanceNorm (`norm_terms`, `instance_norm`): torch's CPU batch-norm kernel to the bit
  (aten/src/ATen/native/cpu/batch_norm_kernel.cpp: float64 sums, the mean and the variance
  rounded to float32, and fused multiply-adds; bit-identical to torch's InstanceNorm1d on
  sample.wav's activations).
- the filter bank and the two Conv1d (`sinc_frames`, `conv1d`): float64 sums of float32
  products, rounded once. torch's own summation order (oneDNN's) cannot be repeated, so
  only its rounding is left in the difference; and float32 BLAS rounds identical rows
  differently by their place in the matrix (OpenBLAS: up to 2 units in the last place),
  where torch gives every frame of a constant input the same bits, which digital silence
  needs (its InstanceNorms divide by sqrt(eps)).

Layout: [frames, channels] (channels last), one window at a time.
"""

from __future__ import annotations

import numpy as np

from speakerd.model.segmentation.architecture import (
    CONV_KERNEL,
    LEAKY_SLOPE,
    NORM_EPS,
    OUTPUT_FRAMES,
    POOL,
    SINC_KERNEL,
    SINC_STRIDE,
)
from speakerd.model.segmentation.weights import Affine, SegmentationModel

F32 = np.float32
#: Filter-bank frames per im2col matmul (the float64 columns of a block: 20 MB).
SINC_BLOCK_FRAMES = 10_000


def leaky_relu(x: np.ndarray) -> np.ndarray:
    """F.leaky_relu: x where x > 0, else slope x (max(x, slope x), as the slope is < 1), in place."""
    return np.maximum(x, x * F32(LEAKY_SLOPE), out=x)


def fused(x: np.ndarray, alpha: np.ndarray, beta: np.ndarray) -> np.ndarray:
    """x * alpha + beta rounded once to float32 (a fused multiply-add: the product of two
    float32 is exact in float64, the sum rounded there and then to float32, which differs
    from one rounding only when the float64 sum falls on a float32 halfway point)."""
    wide = np.multiply(x, alpha, dtype=np.float64)
    wide += beta
    return wide.astype(F32)


def norm_terms(x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(alpha, beta) [channels] float32 of InstanceNorm1d(affine) over the frames of [frames,
    channels] float32, as torch's CPU kernel computes them: the mean a float64 sum rounded
    to float32; the variance a float64 sum of the float32 squares of x - mean, rounded to
    float32 and divided by the count in float32; invstd = 1 / sqrt(var + eps) in float64,
    rounded; alpha = invstd * weight; beta = bias - mean * alpha (fused)."""
    count = x.shape[0]
    mean = (x.astype(np.float64).sum(axis=0) / count).astype(F32)
    centred = x - mean
    squares = np.square(centred, out=centred).astype(np.float64)
    variance = squares.sum(axis=0).astype(F32) / F32(count)
    invstd = (1.0 / np.sqrt(variance.astype(np.float64) + NORM_EPS)).astype(F32)
    alpha = invstd * weight
    return alpha, fused(-mean, alpha, bias)


def instance_norm(x: np.ndarray, affine: Affine) -> np.ndarray:
    """InstanceNorm1d(affine) of [frames, channels] float32: x * alpha + beta, fused."""
    alpha, beta = norm_terms(x, affine.weight, affine.bias)
    return fused(x, alpha, beta)


def wav_norm_terms(samples: np.ndarray, affine: Affine) -> tuple[F32, F32]:
    """(alpha, beta) of the waveform InstanceNorm of one window's 160,000 samples (padding
    included): normalised = samples * alpha + beta, fused."""
    alpha, beta = norm_terms(samples[:, None], affine.weight, affine.bias)
    return alpha[0], beta[0]


def normalised_window(window: np.ndarray, affine: Affine) -> tuple[np.ndarray, np.ndarray]:
    """One window's waveform InstanceNorm as torch writes it. Returns (the normalised samples
    [160000] float32, their rounding [160000] float64: normalised - exact)."""
    alpha, beta = wav_norm_terms(window, affine)
    exact = np.multiply(window, alpha, dtype=np.float64)
    exact += beta
    rounded = exact.astype(F32)
    return rounded, np.subtract(rounded, exact, out=exact)


def max_pool(x: np.ndarray) -> np.ndarray:
    """MaxPool1d(3, stride 3) over the frames of [frames, channels] (a last partial triple dropped)."""
    frames = x.shape[0] // POOL
    return x[: frames * POOL].reshape(frames, POOL, x.shape[1]).max(axis=1)


def pooled_abs(frames: np.ndarray) -> np.ndarray:
    """Filter-bank frames (float64) rounded once to float32, then |.| and max-pooled."""
    rounded = frames.astype(F32)
    return max_pool(np.abs(rounded, out=rounded))


def conv1d(x: np.ndarray, affine: Affine) -> np.ndarray:
    """Conv1d(kernel 5, no padding) of [frames, cin] float32 -> [frames - 4, cout] float32: one
    float64 matmul gives every tap's products [frames, 5, cout] (weights.py lays the kernel
    out so), summed at their shifts and rounded once."""
    taps = (x.astype(np.float64) @ affine.weight).reshape(x.shape[0], CONV_KERNEL, -1)
    frames = x.shape[0] - CONV_KERNEL + 1
    out = taps[:frames, 0] + affine.bias
    for tap in range(1, CONV_KERNEL):
        out += taps[tap : tap + frames, tap]
    return out.astype(F32)


def sinc_frame_count(samples: int) -> int:
    return (samples - SINC_KERNEL) // SINC_STRIDE + 1


def sinc_frames(samples: np.ndarray, filters: np.ndarray, dtype: type = np.float64) -> np.ndarray:
    """The filter bank's stride-10 convolution of [N] samples by `filters` [251, k] ->
    [(N - 251) // 10 + 1, k] in `dtype` (float64: exact products of float32 inputs, float64
    sums), as im2col matmuls of SINC_BLOCK_FRAMES frames."""
    wide = samples.astype(dtype)
    bank = filters.astype(dtype)
    total = sinc_frame_count(wide.shape[0])
    columns = np.lib.stride_tricks.sliding_window_view(wide, SINC_KERNEL)[::SINC_STRIDE]
    out = np.empty((total, bank.shape[1]), dtype=dtype)
    for first in range(0, total, SINC_BLOCK_FRAMES):
        last = min(total, first + SINC_BLOCK_FRAMES)
        np.matmul(np.ascontiguousarray(columns[first:last]), bank, out=out[first:last])
    return out


def front_end(model: SegmentationModel, pooled_sinc: np.ndarray) -> np.ndarray:
    """One window's max-pooled |filter bank| [5325, 80] -> the LSTM's input [589, 60]."""
    x = leaky_relu(instance_norm(pooled_sinc, model.norms[0]))
    for conv, norm in zip(model.convs, model.norms[1:], strict=True):
        x = leaky_relu(instance_norm(max_pool(conv1d(x, conv)), norm))
    assert x.shape[0] == OUTPUT_FRAMES, f"{x.shape[0]} frames after SincNet, expected {OUTPUT_FRAMES}"
    return x
