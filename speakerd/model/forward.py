"""An independent NumPy float64 forward of the multi-mask model, with every tap of docs/model.md.

This is the yardstick for the ONNX export: it starts from the UNFOLDED state dict and
applies BatchNorm explicitly in eval mode, convolves by im2col + matmul instead of a
runtime's conv kernels, and pools with docs/model.md's formula in float64. Agreement with ONNX
Runtime to float32 rounding therefore checks the BatchNorm fold, the NCHW layout, the
strides and paddings, the residual wiring, the in-graph mask resize and the pooling all
at once.

`trunk_float64` takes the BatchNorm as a callable so the synthetic-model generator can
run the same forward while it calibrates each BatchNorm's running statistics.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from speakerd.model.architecture import (
    BLOCKS,
    BN_EPS,
    MAX_SPEAKERS,
    POOL_FEATURES,
    POOL_V1_EPS,
    POOL_VAR_EPS,
    SEG_BIAS,
    SEG_WEIGHT,
    STATS_DIM,
    STEM,
    TRUNK_FRAMES,
    ConvSpec,
)
from speakerd.model.numerics import resize_masks

#: (pre-BatchNorm conv output [n, C, H, W] float64, the conv it came from) -> normalised output.
BatchNorm = Callable[[np.ndarray, ConvSpec], np.ndarray]
StateDict = dict[str, np.ndarray]
#: Receives each trunk tap (name, [n, C, H, W] float64) as the forward computes it.
TapSink = Callable[[str, np.ndarray], None]


def conv2d(x: np.ndarray, weight: np.ndarray, stride: int, pad: int) -> np.ndarray:
    """[n, cin, H, W] * [cout, cin, k, k] -> [n, cout, Ho, Wo], no bias, float64.

    im2col one chunk at a time (the column buffer of layer1 is 288 x 79,840 doubles, 184 MB;
    a whole batch at once would not fit comfortably), then one BLAS matmul per chunk.
    """
    n, cin, h, w = x.shape
    cout, _, k, _ = weight.shape
    h_out = (h + 2 * pad - k) // stride + 1
    w_out = (w + 2 * pad - k) // stride + 1
    kernel = weight.reshape(cout, cin * k * k).astype(np.float64)
    out = np.empty((n, cout, h_out, w_out), dtype=np.float64)
    columns = np.empty((cin, k, k, h_out, w_out), dtype=np.float64)
    for chunk in range(n):
        padded = np.pad(x[chunk], ((0, 0), (pad, pad), (pad, pad)))
        for ky in range(k):
            rows = slice(ky, ky + stride * (h_out - 1) + 1, stride)
            for kx in range(k):
                columns[:, ky, kx] = padded[:, rows, kx : kx + stride * (w_out - 1) + 1 : stride]
        out[chunk] = (kernel @ columns.reshape(cin * k * k, h_out * w_out)).reshape(cout, h_out, w_out)
    return out


def apply_batch_norm(y: np.ndarray, state: StateDict, spec: ConvSpec) -> np.ndarray:
    """torch BatchNorm2d in eval mode from the state dict: (y - mean) / sqrt(var + eps) * gamma + beta."""
    mean = state[f"{spec.bn}.running_mean"].astype(np.float64)[:, None, None]
    var = state[f"{spec.bn}.running_var"].astype(np.float64)[:, None, None]
    gamma = state[f"{spec.bn}.weight"].astype(np.float64)[:, None, None]
    beta = state[f"{spec.bn}.bias"].astype(np.float64)[:, None, None]
    return (y - mean) / np.sqrt(var + BN_EPS) * gamma + beta


def eval_batch_norm(state: StateDict) -> BatchNorm:
    """Every conv's eval-mode BatchNorm, read from `state`."""
    return lambda y, spec: apply_batch_norm(y, state, spec)


def _conv_bn(state: StateDict, x: np.ndarray, spec: ConvSpec, batch_norm: BatchNorm) -> np.ndarray:
    return batch_norm(conv2d(x, state[f"{spec.name}.weight"], spec.stride, spec.pad), spec)


def fbank_image(fbank: np.ndarray) -> np.ndarray:
    """[n, 998, 80] -> [n, 1, 80, 998] float64: pyannote's `permute(0, 2, 1).unsqueeze(1)`."""
    return np.ascontiguousarray(np.transpose(fbank, (0, 2, 1))[:, None], dtype=np.float64)


def trunk_float64(
    state: StateDict, image: np.ndarray, batch_norm: BatchNorm, on_tap: TapSink | None = None
) -> np.ndarray:
    """Stem and 16 BasicBlocks on [n, 1, 80, 998] -> [n, 256, 10, 125].

    Each trunk tap is handed to `on_tap(name, value)` as it is computed, so a caller can
    keep it (the reference) or summarise and drop it (calibration of a 4-chunk batch).
    """

    def record(name: str, value: np.ndarray) -> None:
        if on_tap is not None:
            on_tap(name, value)

    x = np.maximum(_conv_bn(state, image, STEM, batch_norm), 0.0)
    record("stem", x)
    for block in BLOCKS:
        hidden = np.maximum(_conv_bn(state, x, block.conv1, batch_norm), 0.0)
        record(block.hidden_tap, hidden)
        branch = _conv_bn(state, hidden, block.conv2, batch_norm)
        shortcut = x
        if block.shortcut is not None:
            assert block.shortcut_tap is not None, block.prefix
            shortcut = _conv_bn(state, x, block.shortcut, batch_norm)
            record(block.shortcut_tap, shortcut)
        x = np.maximum(branch + shortcut, 0.0)
        record(block.out_tap, x)
    return x


def stats_pool_float64(trunk: np.ndarray, masks: np.ndarray) -> np.ndarray:
    """docs/model.md weighted StatsPool: [n, 256, 10, 125] and [n, 3, F] -> [n * 3, 5120] float64."""
    n = trunk.shape[0]
    x = trunk.reshape(n, 1, POOL_FEATURES, TRUNK_FRAMES)  # row = channel * 10 + mel
    w = resize_masks(masks).astype(np.float64)[:, :, None, :]  # [n, 3, 1, 125]
    v1 = w.sum(axis=-1) + POOL_V1_EPS  # [n, 3, 1]
    mean = (x * w).sum(axis=-1) / v1  # [n, 3, 2560]
    v2 = (w * w).sum(axis=-1)
    var = (w * (x - mean[..., None]) ** 2).sum(axis=-1) / (v1 - v2 / v1 + POOL_VAR_EPS)
    stats = np.concatenate([mean, np.sqrt(var)], axis=-1)
    return stats.reshape(n * MAX_SPEAKERS, STATS_DIM)


def forward_float64(state_dict: StateDict, fbank: np.ndarray, masks: np.ndarray) -> dict[str, np.ndarray]:
    """Every tap of docs/model.md in float64: trunk taps [n, C, H, W], `pooled` and `output` by rows."""
    if masks.shape[:2] != (fbank.shape[0], MAX_SPEAKERS):
        raise ValueError(f"masks shape {masks.shape}, expected [{fbank.shape[0]}, {MAX_SPEAKERS}, F]")
    taps: dict[str, np.ndarray] = {}
    trunk = trunk_float64(state_dict, fbank_image(fbank), eval_batch_norm(state_dict), taps.__setitem__)
    pooled = stats_pool_float64(trunk, masks)
    taps["pooled"] = pooled
    weight = state_dict[SEG_WEIGHT].astype(np.float64)
    taps["output"] = pooled @ weight.T + state_dict[SEG_BIAS].astype(np.float64)
    return taps
