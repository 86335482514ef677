"""The embedded default model: deterministic, valid pyannote keys, trained-network ranges.

Why ranges matter: a random un-normalised ResNet either explodes (FP16 overflows, parity
bounds become meaningless) or dies (every ReLU silent, all embeddings the bias). The
calibrated model must look like a trained one on speech: every post-ReLU tap partly
active, magnitudes far inside FP16's range, embeddings that differ between speakers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from speakerd.cli import main
from speakerd.model.architecture import TAP_NAMES
from speakerd.model.synthetic import make_model, quantise
from speakerd.model.weights import file_sha256, load_state_dict, save_state_dict, validate_state_dict

pytestmark = pytest.mark.slow  # synthetic models made and calibrated: seconds of 2 cores a test

#: Post-ReLU taps must keep between these fractions of units active on speech.
MIN_ACTIVE, MAX_ACTIVE = 0.2, 0.95
#: Far inside FP16's 65504: a trained ResNet34's activations on fbank stay in the tens.
MAX_MAGNITUDE = 100.0


@pytest.fixture(scope="module")
def model_and_ranges():
    return make_model(seed=0)


def test_state_dict_has_pyannote_keys_and_calibrated_statistics(model_and_ranges) -> None:
    state, _ = model_and_ranges
    validate_state_dict(state)  # raises naming the key on any missing key, shape or dtype
    variances = [value for key, value in state.items() if key.endswith("running_var")]
    assert len(variances) == 36, f"{len(variances)} BatchNorms, expected 36"
    assert all(np.all(v > 0) for v in variances), "a calibrated running_var is not positive"
    assert not all(np.allclose(v, 1.0) for v in variances), "running_var left at the placeholder 1.0"


def test_activation_ranges_look_trained(model_and_ranges) -> None:
    _, ranges = model_and_ranges
    print(f"\n{'tap':<18} {'min':>9} {'max':>9} {'std':>8} {'>0':>6}")
    for r in ranges:
        print(f"{r.name:<18} {r.minimum:>9.3f} {r.maximum:>9.3f} {r.std:>8.3f} {r.active:>6.1%}")
    assert [r.name for r in ranges] == list(TAP_NAMES)
    for r in ranges:
        assert max(abs(r.minimum), abs(r.maximum)) < MAX_MAGNITUDE, (
            f"{r.name}: range {r.minimum}..{r.maximum}"
        )
        assert r.std > 1e-2, f"{r.name}: std {r.std:.3g}, the layer is dead"
        if r.name.endswith((".hidden", ".out")) or r.name == "stem":
            assert MIN_ACTIVE <= r.active <= MAX_ACTIVE, f"{r.name}: {r.active:.1%} of units active"


def test_same_seed_same_bytes_other_seed_other_weights(
    tmp_path: Path, model_and_ranges, weights_path
) -> None:
    """Two independent makings of seed 0 give the same bytes: the default model store.py made
    for the test run's cache (made anew, not read from anywhere) and this module's own
    make_model, written the way make-model writes. make-model itself runs once, for seed 1
    (each making calibrates on 4 chunks in float64: ~7 s of 2 cores)."""
    state, _ = model_and_ranges
    again, other = tmp_path / "a.safetensors", tmp_path / "c.safetensors"
    save_state_dict(state, again)
    assert again.read_bytes() == weights_path.read_bytes(), "making seed 0 is not deterministic"
    assert main(["make-model", "--out", str(other), "--seed", "1"]) == 0
    validate_state_dict(load_state_dict(other))
    assert file_sha256(other) != file_sha256(weights_path)


def test_quantise_keeps_ten_significant_bits() -> None:
    values = np.array([1.0, 1.0 + 2**-12, 3.14159, -2.5e-7], dtype=np.float64)
    q = quantise(values)
    assert q[0] == q[1] == 1.0, q  # 2^-12 is below the 10-bit resolution of 1.0
    np.testing.assert_allclose(q, values, rtol=2**-10)
