"""SincNet's filter bank [80, 1, 251] from the checkpoint's parameters, as asteroid_filterbanks does it.

segmentation-3.0 does not store its first convolution's kernels: it stores each band's low
cut-off and width (`low_hz_`, `band_hz_`, 40 each) and ParamSincFB rebuilds the 80 kernels
on every forward (`ParamSincFB.filters`, asteroid_filterbanks 0.4). This module does the
same arithmetic, in float32 and in torch's order of operations, once when the weights load:

    low  = 50 + |low_hz_|
    high = clamp(low + 50 + |band_hz_|, 50, 8000)
    band = high - low
    cos filter (even):  left = (sin(high n) - sin(low n)) / (n / 2) * window,  centre = 2 band
    sin filter (odd):   left = (cos(low n) - cos(high n)) / (n / 2) * window,  centre = 0
    right half = the left half reversed (negated for the odd filters); all / (2 band)

with `n` = 2 pi t / 16000 for t = -125..-1 and `window` the left half of a Hamming window,
both buffers of the checkpoint. The sines and cosines are taken in float64 of the float32
arguments and rounded once (torch's float32 sin is within one unit in the last place of
that), so the bank equals torch's to a few float32 ulps: tests/test_segmentation_model.py
compares it with pyannote's `model.sincnet.conv1d[0].filterbank.filters()`.
"""

from __future__ import annotations

import numpy as np

from speakerd.model.architecture import SAMPLE_RATE
from speakerd.model.segmentation.architecture import (
    BAND_HZ,
    LOW_HZ,
    MIN_BAND_HZ,
    MIN_LOW_HZ,
    SINC_BANDS,
    SINC_KERNEL,
    SINC_TIME,
    SINC_WINDOW,
)

F32 = np.float32


def _rounded(function: np.ufunc, argument: np.ndarray) -> np.ndarray:
    """`function` of float32 `argument`, evaluated in float64 and rounded once to float32."""
    return function(argument.astype(np.float64)).astype(F32)


def filters(state: dict[str, np.ndarray]) -> np.ndarray:
    """The 80 kernels [80, 1, 251] float32: 40 cosine (even) filters, then 40 sine (odd) ones."""
    low_hz = np.asarray(state[LOW_HZ], dtype=F32)  # [40, 1]
    band_hz = np.asarray(state[BAND_HZ], dtype=F32)
    window = np.asarray(state[SINC_WINDOW], dtype=F32)  # [125]
    time = np.asarray(state[SINC_TIME], dtype=F32)  # [1, 125]
    low = F32(MIN_LOW_HZ) + np.abs(low_hz)
    high = np.clip(low + F32(MIN_BAND_HZ) + np.abs(band_hz), F32(MIN_LOW_HZ), F32(SAMPLE_RATE / 2))
    band = (high - low)[:, 0]
    ft_low, ft_high = low * time, high * time  # torch.matmul of [40, 1] by [1, 125]: one product each
    half_time = time / F32(2)
    cos_left = ((_rounded(np.sin, ft_high) - _rounded(np.sin, ft_low)) / half_time) * window
    sin_left = ((_rounded(np.cos, ft_low) - _rounded(np.cos, ft_high)) / half_time) * window
    scale = (F32(2) * band)[:, None]
    cos_filters = np.concatenate([cos_left, F32(2) * band[:, None], cos_left[:, ::-1]], axis=1) / scale
    sin_filters = (
        np.concatenate([sin_left, np.zeros((SINC_BANDS, 1), F32), -sin_left[:, ::-1]], axis=1) / scale
    )
    bank = np.concatenate([cos_filters, sin_filters], axis=0).astype(F32)
    assert bank.shape == (2 * SINC_BANDS, SINC_KERNEL), f"filter bank {bank.shape}"
    return np.ascontiguousarray(bank[:, None, :])
