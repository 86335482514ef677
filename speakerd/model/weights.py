"""Load, validate and BatchNorm-fold a WeSpeakerResNet34 safetensors checkpoint.

Every engine (ONNX Runtime, NumPy reference, GPU) consumes the same folded float32
weights, so parity between them measures arithmetic only, never a different fold.

The file helpers (`check_state_dict`, `load_state_dict`, `save_state_dict`, `file_sha256`)
take the network's validator, so the segmentation model's weights
(speakerd/model/segmentation/weights.py) are read, checked and written by the same code.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save

from speakerd.model.architecture import (
    BLOCKS,
    BN_EPS,
    SEG_BIAS,
    SEG_WEIGHT,
    STEM,
    ConvSpec,
    state_dict_shapes,
)


class WeightsError(ValueError):
    """A checkpoint that is not the expected network's state dict; the message names the key."""


#: Raises WeightsError naming the first key that makes a state dict not the expected network's.
Validator = Callable[[Mapping[str, np.ndarray]], None]


@dataclass(frozen=True)
class FoldedConv:
    """A convolution with its BatchNorm folded in: y = conv(x, weight) + bias."""

    spec: ConvSpec
    weight: np.ndarray  # [cout, cin, k, k] float32
    bias: np.ndarray  # [cout] float32


@dataclass(frozen=True)
class FoldedBlock:
    conv1: FoldedConv
    conv2: FoldedConv
    shortcut: FoldedConv | None


@dataclass(frozen=True)
class FoldedModel:
    """The network ready to run: folded convs, the final linear and the served model id."""

    stem: FoldedConv
    blocks: tuple[FoldedBlock, ...]
    seg_weight: np.ndarray  # [256, 5120] float32
    seg_bias: np.ndarray  # [256] float32
    model_id: str  # sha256 of the safetensors file's bytes

    def convs(self) -> list[FoldedConv]:
        """All convolutions in forward order (stem, then conv1, conv2, shortcut per block)."""
        out = [self.stem]
        for block in self.blocks:
            out += [block.conv1, block.conv2] + ([block.shortcut] if block.shortcut else [])
        return out


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for piece in iter(lambda: handle.read(1 << 20), b""):
            digest.update(piece)
    return digest.hexdigest()


def check_state_dict(state: Mapping[str, np.ndarray], expected: Mapping[str, tuple[int, ...]]) -> None:
    """Raise WeightsError naming the first missing, unexpected or mis-shaped key of `state`
    against `expected` (key -> shape), or a tensor that is not finite floating point (the
    BatchNorm counters `*num_batches_tracked` are integers). Shared by both networks."""
    missing = sorted(set(expected) - set(state))
    if missing:
        raise WeightsError(
            f"missing key {missing[0]!r} of shape {expected[missing[0]]} ({len(missing)} missing in all)"
        )
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        shape = tuple(np.shape(state[unexpected[0]]))
        raise WeightsError(
            f"unexpected key {unexpected[0]!r} of shape {shape} ({len(unexpected)} unexpected in all)"
        )
    for key, shape in expected.items():
        array = state[key]
        if tuple(array.shape) != shape:
            raise WeightsError(f"key {key!r} has shape {tuple(array.shape)}, expected {shape}")
        if key.endswith("num_batches_tracked"):
            if array.dtype.kind not in "iu":
                raise WeightsError(f"key {key!r} has dtype {array.dtype}, expected an integer")
            continue
        if array.dtype not in (np.float32, np.float16, np.float64):
            raise WeightsError(f"key {key!r} has dtype {array.dtype}, expected float32")
        if not np.all(np.isfinite(array)):
            raise WeightsError(f"key {key!r} holds NaN or Inf")


def validate_state_dict(state: Mapping[str, np.ndarray]) -> None:
    """Raise WeightsError naming the first key that makes `state` no WeSpeakerResNet34 state dict."""
    check_state_dict(state, state_dict_shapes())
    for key, array in state.items():
        if key.endswith("running_var") and np.any(array < 0):
            raise WeightsError(f"key {key!r} has a negative variance")


def fold_conv(state: dict[str, np.ndarray], spec: ConvSpec) -> FoldedConv:
    """Fold eval-mode BatchNorm into the conv, in float64 then rounded once to float32."""
    weight = state[f"{spec.name}.weight"].astype(np.float64)
    gamma = state[f"{spec.bn}.weight"].astype(np.float64)
    beta = state[f"{spec.bn}.bias"].astype(np.float64)
    mean = state[f"{spec.bn}.running_mean"].astype(np.float64)
    var = state[f"{spec.bn}.running_var"].astype(np.float64)
    scale = gamma / np.sqrt(var + BN_EPS)
    folded_weight = (weight * scale[:, None, None, None]).astype(np.float32)
    folded_bias = (beta - mean * scale).astype(np.float32)
    return FoldedConv(spec, np.ascontiguousarray(folded_weight), folded_bias)


def fold_state_dict(state: dict[str, np.ndarray], model_id: str) -> FoldedModel:
    validate_state_dict(state)
    blocks = tuple(
        FoldedBlock(
            fold_conv(state, block.conv1),
            fold_conv(state, block.conv2),
            fold_conv(state, block.shortcut) if block.shortcut is not None else None,
        )
        for block in BLOCKS
    )
    return FoldedModel(
        stem=fold_conv(state, STEM),
        blocks=blocks,
        seg_weight=np.ascontiguousarray(state[SEG_WEIGHT], dtype=np.float32),
        seg_bias=np.ascontiguousarray(state[SEG_BIAS], dtype=np.float32),
        model_id=model_id,
    )


def load_state_dict(path: str | Path, validate: Validator = validate_state_dict) -> dict[str, np.ndarray]:
    """Read a safetensors checkpoint; WeightsError if it cannot be read or `validate` (by
    default: is it a WeSpeakerResNet34?) refuses it."""
    try:
        state = load_file(str(path))
    except FileNotFoundError:
        raise
    except Exception as error:  # safetensors raises its own types for a corrupt header
        raise WeightsError(f"{path}: not a readable safetensors file ({error})") from error
    validate(state)
    return state


def load_model(path: str | Path) -> FoldedModel:
    """Load, validate and fold; the model id is the sha256 of the file served."""
    return fold_state_dict(load_state_dict(path), file_sha256(path))


def save_state_dict(
    state: dict[str, np.ndarray], path: str | Path, validate: Validator = validate_state_dict
) -> None:
    """Validate (by default as a WeSpeakerResNet34), then write with pyannote's keys
    (contiguous float32, int64 counters).

    The bytes are made in memory and written by Python (not safetensors' own file writer),
    so a full disk is an OSError (ENOSPC) that callers can name, not a serializer error."""
    validate(state)
    # np.asarray(order="C"), not np.ascontiguousarray: the latter turns the 0-d
    # num_batches_tracked counters into shape (1,), which pyannote's keys do not have.
    clean = {key: np.asarray(value, order="C") for key, value in state.items()}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    # one metadata key only: safetensors writes metadata from a hash map, so with two keys
    # their order (and the file's bytes, and the model id) could differ between runs
    data = save(clean, metadata={"format": "pt"})
    with open(path, "wb") as handle:
        handle.write(data)
