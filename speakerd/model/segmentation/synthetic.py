"""The deterministic synthetic segmentation model (`python -m speakerd make-segmentation-model`).

segmentation-3.0's hub repo is gated and no weights can be downloaded where speakerd is
built and tested, so, as for the embedding model (speakerd/model/synthetic.py), the default
segmentation model is generated: every tensor of pyannote's PyanNet, with its exact shape,
drawn from numpy's PCG64 stream of one seed, so the same seed writes the same bytes on any
machine (no calibration pass whose BLAS rounding could differ between CPUs).

The draws are scaled so activations sit in the trained segmentation-3.0's ranges (the
trained spreads are in the comments below): the filter bank is asteroid's mel-spaced
initialisation with jittered bands; the waveform norm scales to a hundredth with a small
offset, as the trained one does; the InstanceNorm affines and conv weights have the trained
spreads; the LSTM is kept out of chaos (see LSTM_HIDDEN_STD); the linear layers and the
classifier are scaled so their outputs spread as the trained ones do. On speech-like audio
(speakerd.model.audio.synthetic_recording) the most likely of the 7 classes then changes
from frame to frame and several classes win somewhere (tests/test_segmentation_model.py
checks it). It segments nothing meaningfully.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from speakerd.model.architecture import SAMPLE_RATE
from speakerd.model.segmentation.architecture import (
    BAND_HZ,
    CLASSIFIER,
    CONVS,
    LINEARS,
    LOW_HZ,
    LSTM_DIRECTIONS,
    LSTM_LAYERS,
    MIN_BAND_HZ,
    MIN_LOW_HZ,
    NORMS,
    SINC_BANDS,
    SINC_HALF,
    SINC_KERNEL,
    SINC_TIME,
    SINC_WINDOW,
    WAV_NORM,
    lstm_key,
    state_dict_shapes,
)
from speakerd.model.segmentation.weights import save_state_dict, validate_state_dict
from speakerd.model.synthetic import configure, report_written

__all__ = ["DEFAULT_SEED", "GENERATOR_VERSION", "configure", "make_state_dict", "run"]

F32 = np.float32
DEFAULT_SEED = 0
#: Bumped whenever generation changes, so a cached default model of an older generator is
#: never mistaken for the current one (it is part of the cache file name).
GENERATOR_VERSION = 1
#: asteroid's ParamSincFB initialisation: bands mel-spaced from 30 Hz to the Nyquist
#: frequency less min_low_hz + min_band_hz; each band's edges are then jittered by this
#: relative amount (the trained ones moved by tens of per cent).
FIRST_BAND_HZ = 30.0
BAND_JITTER = 0.1
#: The trained waveform InstanceNorm: weight 0.0099, bias 0.0453 (uniform ranges around them).
WAV_NORM_WEIGHT = (0.008, 0.012)
WAV_NORM_BIAS = (0.03, 0.06)
#: (weight range, bias mean, bias spread) of each InstanceNorm; trained: weight 0.81 +- 0.78,
#: 1.48 +- 0.48, 0.21 +- 0.08; bias 0.84 +- 0.97, 0.37 +- 0.80, -0.02 +- 0.09.
NORM_AFFINES = (((0.2, 1.6), 0.8, 0.9), ((0.8, 2.2), 0.4, 0.8), ((0.1, 0.35), 0.0, 0.09))
#: Conv1d weights and biases: the trained spreads (weights 1.0 and 0.97, biases 0.8 and 0.13).
CONV_WEIGHT_STD = 1.0
CONV_BIAS_STD = (0.8, 0.13)
#: LSTM weights. The trained ones spread 0.8 to 1.0, but random recurrent weights that large
#: make a chaotic network: noise of 1e-6 on its input moved its log-probabilities by 2.4e-3,
#: where the trained model's moved by 3e-4 (float32 rounding alone would then decide the
#: synthetic model's output). So the recurrent weights have torch's initial spread
#: (U(+-1/sqrt(128)): 0.05), the input weights a third of the trained one: the same noise
#: then moves the output by 5e-5.
LSTM_INPUT_STD = 0.3
LSTM_HIDDEN_STD = 0.05
#: LSTM biases: the trained spread around the trained mean.
LSTM_BIAS = (-0.2, 0.6)
#: Linear layers' weights and biases. A random LSTM's outputs are dense (spread 0.2 to 0.3)
#: where the trained one's are sparse (0.06 to 0.15), so the weights are scaled to give the
#: trained activations rather than copy the trained weights: the first linear layer's
#: output spreads 4.2 (trained 4.6), the second's 7.3 (7.1), the logits 2.9 (3.1), measured
#: on synthetic_recording(30 s). Biases: the trained means and spreads.
LINEAR_WEIGHT_STD = (0.85, 0.25)
LINEAR_BIASES = ((-0.5, 0.7), (-1.2, 0.7))
CLASSIFIER_WEIGHT_STD = 0.05
CLASSIFIER_BIAS_STD = 0.57


def _to_mel(hz: np.ndarray | float) -> np.ndarray:
    return 2595 * np.log10(1 + np.asarray(hz) / 700)


def _to_hz(mel: np.ndarray) -> np.ndarray:
    return 700 * (10 ** (mel / 2595) - 1)


def _filter_bank(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """ParamSincFB's parameters and buffers as asteroid_filterbanks 0.4 initialises them, the
    band edges jittered. The mel spacing is computed in float64 and rounded once (asteroid
    uses float32 powers, whose last bit may differ between math libraries: the file must not)."""
    high_hz = SAMPLE_RATE / 2 - (MIN_LOW_HZ + MIN_BAND_HZ)
    hz = _to_hz(np.linspace(_to_mel(FIRST_BAND_HZ), _to_mel(high_hz), SINC_BANDS + 1))
    low = hz[:-1] * rng.uniform(1 - BAND_JITTER, 1 + BAND_JITTER, SINC_BANDS)
    band = np.diff(hz) * rng.uniform(1 - BAND_JITTER, 1 + BAND_JITTER, SINC_BANDS)
    time = np.arange(-SINC_HALF, 0, dtype=F32) / F32(SAMPLE_RATE) * F32(2 * np.pi)
    return {
        LOW_HZ: low.astype(F32)[:, None],
        BAND_HZ: band.astype(F32)[:, None],
        SINC_WINDOW: np.hamming(SINC_KERNEL)[:SINC_HALF].astype(F32),
        SINC_TIME: time[None, :],
    }


def _normal(rng: np.random.Generator, shape: tuple[int, ...], mean: float, std: float) -> np.ndarray:
    return (mean + std * rng.standard_normal(shape)).astype(F32)


def make_state_dict(seed: int = DEFAULT_SEED) -> dict[str, np.ndarray]:
    """The synthetic state dict with pyannote's PyanNet keys and shapes, in their order."""
    rng = np.random.default_rng(seed)
    shapes = state_dict_shapes()
    state: dict[str, np.ndarray] = {
        f"{WAV_NORM}.weight": rng.uniform(*WAV_NORM_WEIGHT, 1).astype(F32),
        f"{WAV_NORM}.bias": rng.uniform(*WAV_NORM_BIAS, 1).astype(F32),
        **_filter_bank(rng),
    }
    for name, bias_std in zip(CONVS, CONV_BIAS_STD, strict=True):
        state[f"{name}.weight"] = _normal(rng, shapes[f"{name}.weight"], 0.0, CONV_WEIGHT_STD)
        state[f"{name}.bias"] = _normal(rng, shapes[f"{name}.bias"], 0.0, bias_std)
    for name, (weight_range, bias_mean, bias_std) in zip(NORMS, NORM_AFFINES, strict=True):
        state[f"{name}.weight"] = rng.uniform(*weight_range, shapes[f"{name}.weight"]).astype(F32)
        state[f"{name}.bias"] = _normal(rng, shapes[f"{name}.bias"], bias_mean, bias_std)
    for layer in range(LSTM_LAYERS):
        for direction in LSTM_DIRECTIONS:
            for kind, std in (("weight_ih", LSTM_INPUT_STD), ("weight_hh", LSTM_HIDDEN_STD)):
                key = lstm_key(kind, layer, direction)
                state[key] = _normal(rng, shapes[key], 0.0, std)
            for kind in ("bias_ih", "bias_hh"):
                key = lstm_key(kind, layer, direction)
                state[key] = _normal(rng, shapes[key], *LSTM_BIAS)
    for name, weight_std, (bias_mean, bias_std) in zip(
        LINEARS, LINEAR_WEIGHT_STD, LINEAR_BIASES, strict=True
    ):
        state[f"{name}.weight"] = _normal(rng, shapes[f"{name}.weight"], 0.0, weight_std)
        state[f"{name}.bias"] = _normal(rng, shapes[f"{name}.bias"], bias_mean, bias_std)
    state[f"{CLASSIFIER}.weight"] = _normal(rng, shapes[f"{CLASSIFIER}.weight"], 0.0, CLASSIFIER_WEIGHT_STD)
    state[f"{CLASSIFIER}.bias"] = _normal(rng, shapes[f"{CLASSIFIER}.bias"], 0.0, CLASSIFIER_BIAS_STD)
    ordered = {key: state[key] for key in shapes}
    validate_state_dict(ordered)
    return ordered


def run(args: argparse.Namespace) -> int:
    """`make-segmentation-model --out FILE [--seed N]` (flags: the embedding model's `configure`)."""
    started = time.perf_counter()
    save_state_dict(make_state_dict(args.seed), args.out)
    report_written(args, started)
    return 0
