"""The deterministic synthetic default model (`python -m speakerd make-model`).

No pretrained weights can be downloaded where this service is built and tested, so the
default model is generated: He-initialised convs, seeded BatchNorm affine parameters, and
BatchNorm running statistics CALIBRATED layer by layer on fbank of speech-like audio
(`speakerd.model.audio.synthetic_recording`). Calibration runs the float64 forward and, at each
BatchNorm, sets running_mean / running_var to the statistics of the batch arriving there,
so every pre-activation is N(beta, gamma^2) per channel on speech, as in a trained
network: activations neither explode nor vanish across the 36 convs, ReLUs are partly
active, and the parity bounds of docs/parity.md are exercised at realistic magnitudes (which
matters for FP16, whose range a random un-normalised network would overflow).

Same seed -> byte-identical file: weights come from numpy's PCG64 stream, and the
calibrated statistics are rounded to `STAT_MANTISSA_BITS` significant bits so that BLAS
summation-order differences between CPUs (~1e-15 relative) cannot change a stored byte.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from speakerd.model.architecture import (
    CONVS,
    EMBEDDING_DIM,
    SEG_BIAS,
    SEG_WEIGHT,
    STATS_DIM,
    TAP_NAMES,
    ConvSpec,
)
from speakerd.model.audio import speaker_masks, synthetic_recording
from speakerd.model.fbank import chunk_recording, fbank
from speakerd.model.forward import (
    StateDict,
    apply_batch_norm,
    fbank_image,
    stats_pool_float64,
    trunk_float64,
)
from speakerd.model.weights import file_sha256, save_state_dict

DEFAULT_SEED = 0
#: Bumped whenever generation changes, so a cached default model of an older generator is
#: never mistaken for the current one (it is part of the cache file name).
GENERATOR_VERSION = 2  # 2: one safetensors metadata key (v1 files had two, in varying order)
#: Calibration audio: its own seed, so the reference cases (other seeds) are never the
#: calibration data; 4 disjoint 10 s chunks of a 40 s conversation are enough statistics
#: (>= 125 x 10 x 4 = 5000 positions per channel even at layer4) and take ~7 s in float64.
CALIBRATION_AUDIO_SEED = 9176
CALIBRATION_SECONDS = 40.0
CALIBRATION_CHUNK_STARTS_S = (0, 10, 20, 30)
#: Calibrated statistics keep 10 significant bits (0.1 % relative): far finer than matters
#: for a synthetic network, far coarser than cross-CPU BLAS rounding.
STAT_MANTISSA_BITS = 10
#: BatchNorm affine parameters, chosen like a trained ResNet's: the BN before a ReLU has
#: gamma near 1 and a slightly negative beta (about 40 % of units silent); the last BN of a
#: residual branch has a smaller gamma so the residual stream grows slowly with depth.
GAMMA_PRE_RELU = (0.7, 1.2)  # uniform range
BETA_PRE_RELU = (-0.25, 0.15)  # (mean, std)
GAMMA_RESIDUAL = (0.25, 0.6)
BETA_RESIDUAL = (0.0, 0.1)
#: seg_1 as torch.nn.Linear initialises it: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
SEG_BOUND = 1.0 / np.sqrt(STATS_DIM)


def quantise(values: np.ndarray, bits: int = STAT_MANTISSA_BITS) -> np.ndarray:
    """Round to `bits` significant binary digits (exact in float32 for bits <= 24)."""
    mantissa, exponent = np.frexp(np.asarray(values, dtype=np.float64))
    return np.ldexp(np.round(mantissa * (1 << bits)) / (1 << bits), exponent).astype(np.float32)


def _is_residual_bn(spec: ConvSpec) -> bool:
    """The BN whose output is added to the shortcut: conv2 of a block, or its shortcut's."""
    return spec.bn.endswith(".bn2") or spec.bn.endswith(".shortcut.1")


def initial_state_dict(seed: int) -> StateDict:
    """Seeded weights with placeholder running statistics (mean 0, var 1), not yet calibrated."""
    rng = np.random.default_rng(seed)
    state: StateDict = {}
    for spec in CONVS:
        fan_in = spec.cin * spec.kernel * spec.kernel
        weight = rng.standard_normal((spec.cout, spec.cin, spec.kernel, spec.kernel)) * np.sqrt(2.0 / fan_in)
        gamma_range, (beta_mean, beta_std) = (
            (GAMMA_RESIDUAL, BETA_RESIDUAL) if _is_residual_bn(spec) else (GAMMA_PRE_RELU, BETA_PRE_RELU)
        )
        state[f"{spec.name}.weight"] = weight.astype(np.float32)
        state[f"{spec.bn}.weight"] = rng.uniform(*gamma_range, spec.cout).astype(np.float32)
        state[f"{spec.bn}.bias"] = (beta_mean + beta_std * rng.standard_normal(spec.cout)).astype(np.float32)
        state[f"{spec.bn}.running_mean"] = np.zeros(spec.cout, np.float32)
        state[f"{spec.bn}.running_var"] = np.ones(spec.cout, np.float32)
        state[f"{spec.bn}.num_batches_tracked"] = np.array(0, np.int64)
    state[SEG_WEIGHT] = rng.uniform(-SEG_BOUND, SEG_BOUND, (EMBEDDING_DIM, STATS_DIM)).astype(np.float32)
    state[SEG_BIAS] = rng.uniform(-SEG_BOUND, SEG_BOUND, EMBEDDING_DIM).astype(np.float32)
    return state


@dataclass(frozen=True)
class CalibrationAudio:
    fbank: np.ndarray  # [n, 998, 80] float32
    masks: np.ndarray  # [n, 3, 589] float32 from the recording's known turns


def calibration_audio() -> CalibrationAudio:
    """Fbank and speaker masks of disjoint 10 s chunks of a synthetic conversation."""
    recording = synthetic_recording(CALIBRATION_SECONDS, CALIBRATION_AUDIO_SEED)
    chunks = chunk_recording(recording.samples)
    wanted = np.searchsorted(chunks.starts, np.asarray(CALIBRATION_CHUNK_STARTS_S) * recording.sample_rate)
    assert np.array_equal(
        chunks.starts[wanted], np.asarray(CALIBRATION_CHUNK_STARTS_S) * recording.sample_rate
    ), f"calibration chunk starts {chunks.starts[wanted]} are not {CALIBRATION_CHUNK_STARTS_S} s"
    return CalibrationAudio(fbank(chunks.waveforms[wanted]), speaker_masks(recording, chunks.starts[wanted]))


@dataclass(frozen=True)
class TapRange:
    """Summary of one tap's values over the calibration batch."""

    name: str
    minimum: float
    maximum: float
    mean: float
    std: float
    active: float  # fraction of values > 0 (the ReLU duty cycle for post-ReLU taps)


def _summary(name: str, value: np.ndarray) -> TapRange:
    return TapRange(
        name,
        float(value.min()),
        float(value.max()),
        float(value.mean()),
        float(value.std()),
        float(np.count_nonzero(value > 0) / value.size),
    )


def calibrate(state: StateDict, audio: CalibrationAudio) -> list[TapRange]:
    """Set every BatchNorm's running statistics from the batch reaching it; return tap ranges.

    One forward pass: at each conv the pre-BN output's per-channel mean and (unbiased, as
    torch tracks it) variance become the running statistics, then that BN is applied in
    eval mode with them, so the layers after it calibrate on exactly what inference sees.
    """
    ranges: list[TapRange] = []

    def calibrating_batch_norm(y: np.ndarray, spec: ConvSpec) -> np.ndarray:
        state[f"{spec.bn}.running_mean"] = quantise(y.mean(axis=(0, 2, 3)))
        state[f"{spec.bn}.running_var"] = quantise(y.var(axis=(0, 2, 3), ddof=1))
        state[f"{spec.bn}.num_batches_tracked"] = np.array(1, np.int64)
        return apply_batch_norm(y, state, spec)

    def on_tap(name: str, value: np.ndarray) -> None:
        ranges.append(_summary(name, value))

    trunk = trunk_float64(state, fbank_image(audio.fbank), calibrating_batch_norm, on_tap)
    pooled = stats_pool_float64(trunk, audio.masks)
    ranges.append(_summary("pooled", pooled))
    ranges.append(_summary("output", pooled @ state[SEG_WEIGHT].astype(np.float64).T + state[SEG_BIAS]))
    assert [r.name for r in ranges] == list(TAP_NAMES), "calibration saw the taps out of order"
    return ranges


def make_model(seed: int = DEFAULT_SEED) -> tuple[StateDict, list[TapRange]]:
    """The calibrated synthetic state dict and its per-tap activation ranges on speech."""
    state = initial_state_dict(seed)
    ranges = calibrate(state, calibration_audio())
    return state, ranges


def make_state_dict(seed: int = DEFAULT_SEED) -> StateDict:
    """The calibrated synthetic state dict with pyannote's WeSpeakerResNet34 keys."""
    return make_model(seed)[0]


def format_ranges(ranges: list[TapRange]) -> str:
    lines = [f"{'tap':<18} {'min':>10} {'max':>10} {'mean':>10} {'std':>10} {'>0':>6}"]
    lines += [
        f"{r.name:<18} {r.minimum:>10.4f} {r.maximum:>10.4f} {r.mean:>10.4f} {r.std:>10.4f} {r.active:>6.1%}"
        for r in ranges
    ]
    return "\n".join(lines)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, required=True, help="safetensors file to write")
    parser.add_argument(
        "--seed", type=int, default=DEFAULT_SEED, help=f"weight seed (default {DEFAULT_SEED})"
    )


def report_written(args: argparse.Namespace, started: float) -> None:
    """The line `make-model` (and `make-segmentation-model`) ends with."""
    print(
        f"wrote {args.out} (seed {args.seed}, model id {file_sha256(args.out)}) "
        f"in {time.perf_counter() - started:.1f} s"
    )


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    state, ranges = make_model(args.seed)
    save_state_dict(state, args.out)
    print(format_ranges(ranges))
    report_written(args, started)
    return 0
