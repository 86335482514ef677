"""segmentation-3.0's weights: checked, converted, stored, and laid out for the NumPy forward.

The file is safetensors with pyannote's own PyanNet keys (`sincnet.wav_norm1d.weight`,
`sincnet.conv1d.0.filterbank.low_hz_`, `lstm.weight_ih_l0`, ..., `classifier.bias`), read,
checked and written by the embedding model's helpers (speakerd/model/weights.py) with this
network's validator, and converted from pyannote's `pytorch_model.bin` by the embedding
model's converter (speakerd/model/checkpoint.py, no torch) with this network's `NETWORK`.
The served model id is the sha256 of the safetensors file, as for the embedding model.

`load_model` then lays the weights out once for the forward (`SegmentationModel`): the
filter bank built from its band parameters (sincnet.py) and transposed for a matmul, the
convolutions as im2col matrices, and each LSTM layer's two directions side by side, with
the gate columns reordered and scaled so that one `exp` gives all four gates (see
`LSTM_GATE_ORDER`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from speakerd.model import checkpoint, weights
from speakerd.model.segmentation import sincnet
from speakerd.model.segmentation.architecture import (
    CLASSIFIER,
    CONVS,
    LINEARS,
    LSTM_DIRECTIONS,
    LSTM_GATES,
    LSTM_HIDDEN,
    LSTM_LAYERS,
    NORMS,
    WAV_NORM,
    lstm_key,
    state_dict_shapes,
)

F32 = np.float32
#: The gates' column order in the laid-out LSTM: the three sigmoid gates first (one slice),
#: the tanh cell gate last. torch's own row order is LSTM_GATES (i, f, g, o).
LSTM_GATE_ORDER = ("i", "f", "o", "g")
#: Each gate's pre-activation is stored multiplied by this (exact: a sign and a power of
#: two), so the forward takes one exp of all four: sigmoid(x) = 1 / (1 + exp(-x)) and
#: tanh(x) = 2 / (1 + exp(-2 x)) - 1.
LSTM_GATE_SCALE = {"i": -1.0, "f": -1.0, "o": -1.0, "g": -2.0}
SIGMOID_GATES = 3


def validate_state_dict(state: Mapping[str, np.ndarray]) -> None:
    """Raise WeightsError naming the first key that makes `state` no segmentation-3.0 state dict."""
    weights.check_state_dict(state, state_dict_shapes())


#: What conversion and `--segmentation-model` check a checkpoint against.
NETWORK = checkpoint.Network("segmentation-3.0 (PyanNet)", "pyannote/segmentation-3.0", validate_state_dict)


def save_state_dict(state: dict[str, np.ndarray], path: str | Path) -> None:
    """Validate as segmentation-3.0, then write the safetensors file."""
    weights.save_state_dict(state, path, validate_state_dict)


def load_state_dict(path: str | Path) -> dict[str, np.ndarray]:
    """Read and validate a segmentation-3.0 safetensors file (WeightsError names a bad key)."""
    return weights.load_state_dict(path, validate_state_dict)


def convert(checkpoint_path: str | Path, out_path: str | Path) -> None:
    """pyannote's segmentation `pytorch_model.bin` -> safetensors at `out_path`, without torch;
    torch_pickle.CheckpointError for an unreadable file, WeightsError for another network's."""
    checkpoint.convert(checkpoint_path, out_path, NETWORK)


@dataclass(frozen=True)
class Affine:
    """A per-channel scale and shift (an affine InstanceNorm's weight and bias), or a linear
    layer (`weight` [in, out], already transposed for `x @ weight`, and `bias` [out])."""

    weight: np.ndarray
    bias: np.ndarray


@dataclass(frozen=True)
class LstmLayer:
    """One bidirectional layer: forward direction first along the second-to-last axis."""

    input_weight: np.ndarray  # [in, 2 x 512]: both directions' input projections in one matmul
    bias: np.ndarray  # [2 x 512]: bias_ih + bias_hh
    hidden_weight: np.ndarray  # [2, 128, 512]: each direction's recurrent matrix


@dataclass(frozen=True)
class SegmentationModel:
    """The network ready for speakerd/model/segmentation/forward.py, with its served model id."""

    wav_norm: Affine  # [1] each
    filters: np.ndarray  # [251, 80]: the filter bank, transposed for `frames @ filters`
    filter_sums: np.ndarray  # [80] float64: each filter's sum, for conv(a x + c) = a conv(x) + c sum(w)
    filter_norms: np.ndarray  # [80] float64: each filter's L2 norm (what white noise's rms is scaled by)
    norms: tuple[Affine, Affine, Affine]  # after the filter bank and each Conv1d
    convs: tuple[Affine, Affine]  # Conv1d, float64: weight [cin, 5 x cout] (tap-major columns), bias [cout]
    lstm: tuple[LstmLayer, ...]
    linears: tuple[Affine, ...]
    classifier: Affine
    model_id: str


def _vector(state: Mapping[str, np.ndarray], key: str) -> np.ndarray:
    return np.ascontiguousarray(state[key], dtype=F32)


def _affine(state: Mapping[str, np.ndarray], name: str) -> Affine:
    return Affine(_vector(state, f"{name}.weight"), _vector(state, f"{name}.bias"))


def _linear(state: Mapping[str, np.ndarray], name: str) -> Affine:
    return Affine(np.ascontiguousarray(_vector(state, f"{name}.weight").T), _vector(state, f"{name}.bias"))


def _conv(state: Mapping[str, np.ndarray], name: str) -> Affine:
    """[cout, cin, k] -> [cin, k x cout] float64 (the forward accumulates these convolutions in
    float64): one matmul gives every tap's contribution, summed shifted."""
    weight = _vector(state, f"{name}.weight").astype(np.float64)
    cout, cin, kernel = weight.shape
    taps = np.transpose(weight, (1, 2, 0)).reshape(cin, kernel * cout)
    return Affine(np.ascontiguousarray(taps), _vector(state, f"{name}.bias").astype(np.float64))


def _gate_columns(rows: np.ndarray) -> np.ndarray:
    """torch's [512, ...] gate rows (i, f, g, o) -> [..., 512] columns in LSTM_GATE_ORDER, scaled."""
    blocks = {
        gate: rows[index * LSTM_HIDDEN : (index + 1) * LSTM_HIDDEN] for index, gate in enumerate(LSTM_GATES)
    }
    ordered = np.concatenate([blocks[gate] * F32(LSTM_GATE_SCALE[gate]) for gate in LSTM_GATE_ORDER])
    return np.ascontiguousarray(ordered.T)


def _lstm_layer(state: Mapping[str, np.ndarray], layer: int) -> LstmLayer:
    inputs, biases, hidden = [], [], []
    for direction in LSTM_DIRECTIONS:
        inputs.append(_gate_columns(_vector(state, lstm_key("weight_ih", layer, direction))))
        bias = _vector(state, lstm_key("bias_ih", layer, direction)) + _vector(
            state, lstm_key("bias_hh", layer, direction)
        )
        biases.append(_gate_columns(bias[:, None])[0])
        hidden.append(_gate_columns(_vector(state, lstm_key("weight_hh", layer, direction))))
    return LstmLayer(
        np.ascontiguousarray(np.concatenate(inputs, axis=1)),
        np.ascontiguousarray(np.concatenate(biases)),
        np.ascontiguousarray(np.stack(hidden)),
    )


def prepare(state: Mapping[str, np.ndarray], model_id: str) -> SegmentationModel:
    """Validate `state` and lay it out for the forward (see module doc)."""
    validate_state_dict(state)
    bank = sincnet.filters(dict(state))[:, 0, :]  # [80, 251]
    norms = tuple(_affine(state, name) for name in NORMS)
    convs = tuple(_conv(state, name) for name in CONVS)
    assert len(norms) == 3 and len(convs) == 2, f"{len(norms)} norms, {len(convs)} convs"
    return SegmentationModel(
        wav_norm=_affine(state, WAV_NORM),
        filters=np.ascontiguousarray(bank.T),
        filter_sums=bank.astype(np.float64).sum(axis=1),
        filter_norms=np.sqrt(np.square(bank.astype(np.float64)).sum(axis=1)),
        norms=(norms[0], norms[1], norms[2]),
        convs=(convs[0], convs[1]),
        lstm=tuple(_lstm_layer(state, layer) for layer in range(LSTM_LAYERS)),
        linears=tuple(_linear(state, name) for name in LINEARS),
        classifier=_linear(state, CLASSIFIER),
        model_id=model_id,
    )


def load_model(path: str | Path) -> SegmentationModel:
    """Load, validate and lay out a segmentation-3.0 safetensors file; the id is its sha256."""
    return prepare(load_state_dict(path), weights.file_sha256(path))
