"""speakerd.model.weights (validate, fold, save/load) and .inputs: errors name their key or field."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from speakerd.model.architecture import BLOCKS, BN_EPS, CONVS, STEM, ConvSpec, state_dict_shapes
from speakerd.model.inputs import InputError, check_fbank, check_masks, check_waveform
from speakerd.model.weights import (
    WeightsError,
    file_sha256,
    fold_conv,
    load_model,
    load_state_dict,
    save_state_dict,
    validate_state_dict,
)

#: Folding rounds once to float32: the folded conv equals float64 BN(conv) to float32 precision.
FOLD_RTOL = 1e-6


def random_state(seed: int = 0) -> dict[str, np.ndarray]:
    """A valid state dict with distinct, trained-looking values (not the A2 synthetic model)."""
    rng = np.random.default_rng(seed)
    state: dict[str, np.ndarray] = {}
    for key, shape in state_dict_shapes().items():
        if key.endswith("num_batches_tracked"):
            state[key] = np.array(int(rng.integers(1, 10_000)), dtype=np.int64)
        elif key.endswith("running_var"):
            state[key] = rng.uniform(0.2, 3.0, shape).astype(np.float32)
        elif key.endswith("bn1.weight") or key.endswith("bn2.weight") or key.endswith(".1.weight"):
            state[key] = rng.uniform(0.5, 1.5, shape).astype(np.float32)
        else:
            state[key] = rng.normal(0, 0.1, shape).astype(np.float32)
    return state


@pytest.fixture(scope="module")
def state() -> dict[str, np.ndarray]:
    return random_state()


def test_valid_state_passes(state: dict[str, np.ndarray]) -> None:
    validate_state_dict(state)
    assert len(CONVS) == 36, len(CONVS)  # stem + 16 blocks x 2 + 3 shortcuts


@pytest.mark.parametrize(
    ("key", "mutate", "expected"),
    [
        ("resnet.layer2.1.conv2.weight", "delete", "missing key 'resnet.layer2.1.conv2.weight'"),
        ("resnet.seg_2.weight", "add", "unexpected key 'resnet.seg_2.weight'"),
        ("resnet.layer4.0.shortcut.0.weight", "shape", "key 'resnet.layer4.0.shortcut.0.weight' has shape"),
        ("resnet.layer1.0.bn1.bias", "int", "key 'resnet.layer1.0.bn1.bias' has dtype int32"),
        ("resnet.bn1.num_batches_tracked", "float", "key 'resnet.bn1.num_batches_tracked' has dtype float32"),
        ("resnet.seg_1.bias", "nan", "key 'resnet.seg_1.bias' holds NaN"),
        (
            "resnet.layer3.5.bn2.running_var",
            "negative",
            "key 'resnet.layer3.5.bn2.running_var' has a negative",
        ),
    ],
)
def test_every_error_names_the_key(
    state: dict[str, np.ndarray], key: str, mutate: str, expected: str
) -> None:
    bad = dict(state)
    if mutate == "delete":
        del bad[key]
    elif mutate == "add":
        bad[key] = np.zeros((256, 256), np.float32)
    elif mutate == "shape":
        bad[key] = np.zeros((1, 2, 3, 4), np.float32)
    elif mutate == "int":
        bad[key] = bad[key].astype(np.int32)
    elif mutate == "float":
        bad[key] = np.array(1.0, np.float32)
    elif mutate == "nan":
        bad[key] = bad[key].copy()
        bad[key][3] = np.nan
    else:
        bad[key] = bad[key].copy()
        bad[key][0] = -1.0
    with pytest.raises(WeightsError) as error:
        validate_state_dict(bad)
    assert expected in str(error.value), str(error.value)


def test_shape_error_says_expected_shape(state: dict[str, np.ndarray]) -> None:
    bad = dict(state, **{"resnet.seg_1.weight": np.zeros((256, 2560), np.float32)})
    with pytest.raises(WeightsError, match=r"\(256, 2560\), expected \(256, 5120\)"):
        validate_state_dict(bad)


@pytest.mark.parametrize(
    "spec", [STEM, BLOCKS[3].conv1, BLOCKS[3].shortcut, BLOCKS[15].conv2], ids=lambda s: s.name
)
def test_fold_equals_explicit_batchnorm_in_float64(state: dict[str, np.ndarray], spec: ConvSpec) -> None:
    """conv(x, W') + b' == gamma (conv(x, W) - mean) / sqrt(var + eps) + beta at random positions."""
    folded = fold_conv(state, spec)
    rng = np.random.default_rng(1)
    patches = rng.normal(0, 1, (16, spec.cin, spec.kernel, spec.kernel))  # 16 receptive fields
    weight = state[f"{spec.name}.weight"].astype(np.float64)
    conv = np.einsum("ockl,pckl->po", weight, patches)
    bn = {
        field: state[f"{spec.bn}.{field}"].astype(np.float64)
        for field in ("weight", "bias", "running_mean", "running_var")
    }
    explicit = bn["weight"] * (conv - bn["running_mean"]) / np.sqrt(bn["running_var"] + BN_EPS) + bn["bias"]
    fused = np.einsum("ockl,pckl->po", folded.weight.astype(np.float64), patches) + folded.bias.astype(
        np.float64
    )
    error = float(np.abs(fused - explicit).max() / np.abs(explicit).max())
    assert folded.weight.dtype == np.float32 and folded.bias.dtype == np.float32
    assert error < FOLD_RTOL, f"{spec.name}: max abs / max |ref| = {error:.2e} >= {FOLD_RTOL}"


def test_save_load_round_trip_and_model_id(state: dict[str, np.ndarray], tmp_path: Path) -> None:
    """Includes the 0-d num_batches_tracked counters: they must come back 0-d, as pyannote saves them."""
    path = tmp_path / "model.safetensors"
    save_state_dict(state, path)
    loaded = load_state_dict(path)
    assert set(loaded) == set(state)
    for key, value in state.items():
        assert loaded[key].shape == value.shape and loaded[key].dtype == value.dtype, (key, loaded[key].shape)
        np.testing.assert_array_equal(loaded[key], value, err_msg=key)
    model = load_model(path)
    assert model.model_id == file_sha256(path) and len(model.model_id) == 64
    assert len(model.convs()) == len(CONVS)
    assert model.seg_weight.shape == (256, 5120) and model.seg_weight.dtype == np.float32


def test_unreadable_file_names_the_path(tmp_path: Path) -> None:
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00" * 64)
    with pytest.raises(WeightsError, match=r"junk\.safetensors"):
        load_state_dict(junk)


@pytest.mark.parametrize(
    ("call", "field", "expected"),
    [
        (lambda: check_fbank(np.zeros((2, 997, 80), np.float32)), "fbank", "expected [n, 998, 80]"),
        (lambda: check_fbank(np.zeros((1, 998, 80), np.float64)), "fbank", "dtype float64"),
        (lambda: check_fbank(np.full((1, 998, 80), np.inf, np.float32)), "fbank", "NaN or Inf"),
        (lambda: check_waveform(np.zeros((1, 16000), np.float32)), "waveform", "expected [n, 160000]"),
        (lambda: check_masks(np.zeros((2, 4, 589), np.float32), 2), "masks", "expected [2, s, F]"),
        (lambda: check_masks(np.zeros((3, 3, 589), np.float32), 2), "masks", "expected [2, s, F]"),
        (lambda: check_masks(np.full((1, 3, 589), 2, np.uint8), 1), "masks", "0 or 1"),
        (lambda: check_masks(np.full((1, 3, 589), 1.5, np.float32), 1), "masks", "[0, 1]"),
    ],
)
def test_input_errors_name_the_field(call: Callable[[], object], field: str, expected: str) -> None:
    with pytest.raises(InputError) as error:
        call()
    assert error.value.field == field and str(error.value).startswith(f"{field}:"), str(error.value)
    assert expected in str(error.value), str(error.value)


def test_inputs_convert_what_they_accept() -> None:
    fbank = check_fbank(np.ones((1, 998, 80), np.float16))
    assert fbank.dtype == np.float32 and fbank.flags.c_contiguous
    masks = check_masks(np.ones((1, 2, 7), np.uint8), 1)
    assert masks.dtype == np.float32 and masks.shape == (1, 2, 7)
