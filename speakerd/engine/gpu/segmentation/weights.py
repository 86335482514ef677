"""Host-side weight preparation: pyannote's state dict -> the layouts the kernels read.

Done once at load in NumPy, so the device only ever sees kernel-ready tensors. The network's
sizes and state-dict keys come from speakerd.model.segmentation.architecture and the sinc
filters from its sincnet.filters (ParamSincFB's arithmetic, defined once in the model package):

- sinc filters transposed to [251, 80] (a thread reads 20 or 40 filters as float4s) and each
  filter's sum (the shared convolution needs it);
- conv weights to [Cin, 5, 60] (a thread reads 20 output channels as float4s);
- LSTM: both directions' W_ih stacked for one projection GEMM a layer, the two biases
  summed, W_hh in torch's [2, 512, 128] (lstm_cluster: a thread loads rows) and transposed
  [2, 128, 512] (lstm_layer: threads own gate columns);
- for the fast math, every GEMM weight W also as [W_hi | W_hi | W_lo] along its input axis
  (W_hi = W rounded to TF32, W_lo = W - W_hi), matching the split activations [hi | lo | hi]
  that the kernels write: one TF32 GEMM then sums hi*W_hi + lo*W_hi + hi*W_lo (3xTF32).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from speakerd.model.segmentation import sincnet
from speakerd.model.segmentation.architecture import (
    CLASSIFIER,
    CONVS,
    LINEAR_LAYERS,
    LINEARS,
    LSTM_DIRECTIONS,
    LSTM_LAYERS,
    NORMS,
    SINC_FILTERS,
    SINC_KERNEL,
    WAV_NORM,
    lstm_key,
)

F32 = np.float32
#: TF32 keeps 10 of float32's 23 mantissa bits: the low 13 are dropped (rounded to nearest,
#: ties away from zero, as the kernels' cvt.rna.tf32.f32 does).
TF32_DROPPED_BITS = 13


def tf32_round(values: np.ndarray) -> np.ndarray:
    """float32 `values` rounded to TF32 (10 mantissa bits), nearest with ties away from zero."""
    bits = np.ascontiguousarray(values, dtype=F32).view(np.uint32).astype(np.uint64)
    half = np.uint64(1 << (TF32_DROPPED_BITS - 1))
    mask = np.uint64((0xFFFFFFFF >> TF32_DROPPED_BITS) << TF32_DROPPED_BITS)
    rounded = ((bits + half) & mask).astype(np.uint32)  # magnitude rounding: the sign bit is untouched
    return rounded.view(F32)


def split3(weight: np.ndarray) -> np.ndarray:
    """[out, in] -> [out, 3 in] = [W_hi | W_hi | W_lo] (see the module docstring)."""
    weight = np.ascontiguousarray(weight, dtype=F32)
    hi = tf32_round(weight)
    return np.ascontiguousarray(np.concatenate([hi, hi, weight - hi], axis=1))


def _f32(state: Mapping[str, np.ndarray], key: str) -> np.ndarray:
    if key not in state:
        raise KeyError(f"segmentation state dict lacks {key!r} (has {len(state)} keys)")
    return np.ascontiguousarray(np.asarray(state[key], dtype=F32))


def prepare(state: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Kernel-ready host arrays (all C-contiguous) from pyannote's state dict."""
    bank = sincnet.filters(dict(state))[:, 0, :]  # [80, 251]
    assert bank.shape == (SINC_FILTERS, SINC_KERNEL), f"sinc filters {bank.shape}"
    w: dict[str, np.ndarray] = {
        "sinc_wT": np.ascontiguousarray(bank.T),
        # each filter's sum, in float64 (sinc="shared64") and rounded once to float32 ("shared32"):
        # it multiplies each window's shift c of the shared convolution
        "sinc_wsum64": bank.astype(np.float64).sum(axis=1),
        "sinc_wsum": bank.astype(np.float64).sum(axis=1).astype(F32),
        "wav_norm": np.array([_f32(state, f"{WAV_NORM}.weight")[0], _f32(state, f"{WAV_NORM}.bias")[0]], F32),
    }
    for i, key in enumerate(NORMS):
        w[f"in{i}_g"] = _f32(state, f"{key}.weight")
        w[f"in{i}_b"] = _f32(state, f"{key}.bias")
    for i, key in enumerate(CONVS, start=1):
        weight = _f32(state, f"{key}.weight")  # [60, Cin, 5]
        w[f"conv{i}_wT"] = np.ascontiguousarray(weight.transpose(1, 2, 0))
        w[f"conv{i}_b"] = _f32(state, f"{key}.bias")
    for layer in range(LSTM_LAYERS):
        wih = np.concatenate([_f32(state, lstm_key("weight_ih", layer, d)) for d in LSTM_DIRECTIONS])
        whh = np.stack([_f32(state, lstm_key("weight_hh", layer, d)) for d in LSTM_DIRECTIONS])
        w[f"lstm{layer}_wih"] = np.ascontiguousarray(wih)  # [1024, in]
        w[f"lstm{layer}_wih3"] = split3(wih)  # [1024, 3 in]
        w[f"lstm{layer}_whh"] = np.ascontiguousarray(whh)  # [2, 512, 128]
        w[f"lstm{layer}_whhT"] = np.ascontiguousarray(whh.transpose(0, 2, 1))  # [2, 128, 512]
        w[f"lstm{layer}_b"] = np.ascontiguousarray(
            np.stack(
                [
                    _f32(state, lstm_key("bias_ih", layer, d)) + _f32(state, lstm_key("bias_hh", layer, d))
                    for d in LSTM_DIRECTIONS
                ]
            )
        )
    assert len(LINEARS) == LINEAR_LAYERS
    for i, key in enumerate(LINEARS):
        w[f"lin{i}_w"] = _f32(state, f"{key}.weight")
        w[f"lin{i}_w3"] = split3(w[f"lin{i}_w"])
        w[f"lin{i}_b"] = _f32(state, f"{key}.bias")
    w["cls_w"] = _f32(state, f"{CLASSIFIER}.weight")
    w["cls_b"] = _f32(state, f"{CLASSIFIER}.bias")
    return w
