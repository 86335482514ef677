"""ONNX Runtime (the reference) against an independent float64 NumPy forward, tap by tap.

The NumPy forward runs the UNFOLDED state dict with eval-mode BatchNorm, so it checks the
BatchNorm fold, the ONNX graph (layouts, strides, padding, the in-graph mask resize and
pyannote's pooling epsilons) and ORT at once. Bounds (issue 2): every tap within 1e-5
relative (max abs / max |ref|), output min per-row cosine >= 0.9999999.
"""

from __future__ import annotations

import pytest

from speakerd.model.architecture import TAP_NAMES
from speakerd.model.cases import case_inputs
from speakerd.model.forward import forward_float64
from speakerd.model.numerics import compare
from speakerd.model.weights import load_state_dict
from speakerd.onnx.runtime import OnnxReference

TAP_RELATIVE_BOUND = 1e-5
OUTPUT_MIN_COSINE = 0.9999999
#: a full chunk of speech, and soft masks (weights in (0, 1) exercise v2 != v1)
CASES = ("first_b1", "soft_masks_b1")


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_ort_taps_match_float64_numpy(case: str, folded_model, weights_path) -> None:
    fbank, masks = case_inputs(case)
    ort_taps = OnnxReference(folded_model, taps=True).run(fbank, masks)
    numpy_taps = forward_float64(load_state_dict(weights_path), fbank, masks)
    print(f"\n{'case':<14} {'tap':<18} {'max abs':>10} {'rel':>10}")
    worst = ("", 0.0)
    for tap in TAP_NAMES:
        parity = compare(ort_taps[tap], numpy_taps[tap])
        print(f"{case:<14} {tap:<18} {parity.max_abs:>10.3e} {parity.max_relative_abs:>10.3e}")
        worst = max(worst, (tap, parity.max_relative_abs), key=lambda item: item[1])
        assert parity.max_relative_abs < TAP_RELATIVE_BOUND, (
            f"{case} {tap}: max abs / max |ref| = {parity.max_relative_abs:.3e} >= {TAP_RELATIVE_BOUND}"
        )
    output = compare(ort_taps["output"], numpy_taps["output"])
    print(f"{case}: output min cosine {output.min_cosine:.9f}; worst tap {worst[0]} ({worst[1]:.3e})")
    assert output.min_cosine >= OUTPUT_MIN_COSINE, f"{case}: min cosine {output.min_cosine:.9f}"
