"""Reference cases (docs/model.md): the files every engine is judged against.

They must be exactly reproducible (two runs, the same bytes), hold what docs/model.md says, and
be internally consistent: a b1 case is the same chunk inside mixed_b32, an empty mask's
row is seg_1.bias alone.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from speakerd.cli import main
from speakerd.model.architecture import EMBEDDING_DIM, FRAMES, MASK_FRAMES, MAX_SPEAKERS, TAP_NAMES, tap_shape
from speakerd.model.cases import (
    B1_CASES,
    BATCH_CASE,
    CASE_NAMES,
    case_inputs,
    load_case,
    load_cases,
    mixed_rows,
)
from speakerd.model.numerics import active_frames


@pytest.mark.slow
def test_two_runs_are_byte_identical(tmp_path: Path, references_dir: Path, weights_path: Path) -> None:
    assert main(["make-references", "--out", str(tmp_path), "--weights", str(weights_path)]) == 0
    for name in CASE_NAMES:
        again, first = tmp_path / f"{name}.safetensors", references_dir / f"{name}.safetensors"
        assert again.read_bytes() == first.read_bytes(), f"{name} differs between two runs"


def test_cases_hold_spec_tensors(reference_cases, folded_model) -> None:
    print(f"\n{'case':<18} {'chunks':>6} {'taps':>5} {'empty rows':>10} {'min |row|':>10} {'max |row|':>10}")
    assert [case.name for case in reference_cases] == list(CASE_NAMES)
    for case in reference_cases:
        n = case.chunks
        assert case.fbank.shape == (n, FRAMES, 80) and case.fbank.dtype == np.float32, case.name
        assert case.masks.shape == (n, MAX_SPEAKERS, MASK_FRAMES) and case.masks.dtype == np.float32
        assert case.output.shape == (n * MAX_SPEAKERS, EMBEDDING_DIM), case.name
        assert case.metadata["model_id"] == folded_model.model_id
        expected_taps = set(TAP_NAMES) if case.name in B1_CASES else {"output"}
        assert set(case.taps) == expected_taps, f"{case.name}: taps {sorted(set(case.taps) ^ expected_taps)}"
        for tap, value in case.taps.items():
            assert value.shape == tap_shape(tap, n), f"{case.name} {tap}: {value.shape}"
            assert np.all(np.isfinite(value)), f"{case.name} {tap} is not finite"
        empty = active_frames(case.masks).reshape(-1) == 0
        norms = np.linalg.norm(case.output, axis=1)
        print(f"{case.name:<18} {n:>6} {len(case.taps):>5} {int(empty.sum()):>10}", end="")
        print(f" {norms.min():>10.4f} {norms.max():>10.4f}")
        # an empty mask pools mean 0 and std 0: the row is the bias alone
        bias = np.broadcast_to(folded_model.seg_bias, (int(empty.sum()), EMBEDDING_DIM))
        np.testing.assert_allclose(case.output[empty], bias, rtol=0, atol=1e-6)
        assert np.all(np.abs(case.output[~empty] - folded_model.seg_bias).max(axis=1) > 1e-3), case.name


def test_edge_cases_are_what_their_names_say(reference_cases) -> None:
    by_name = {case.name: case for case in reference_cases}
    assert active_frames(by_name["empty_mask_b1"].masks)[0].tolist()[1] == 0
    assert active_frames(by_name["one_frame_b1"].masks)[0].tolist() == [1, 1, 1]
    soft = by_name["soft_masks_b1"].masks
    assert soft.min() > 0 and soft.max() < 1, (soft.min(), soft.max())
    short = by_name["short_partial_b1"].masks
    assert np.all(short[0, 2] == 0), "short_partial_b1's third speaker should be empty"
    last = by_name["last_partial_b1"].fbank[0]
    # 0.5 s of zero padding: every padded frame has the same (log-floor minus mean) fbank
    assert np.all(last[-40:] == last[-1]), "the padded tail of last_partial_b1 is not constant"
    assert by_name[BATCH_CASE].chunks == 32


def test_b1_cases_are_rows_of_mixed_b32(reference_cases) -> None:
    by_name = {case.name: case for case in reference_cases}
    mixed = by_name[BATCH_CASE]
    assert set(mixed_rows()) == {"first_b1", "last_partial_b1", "short_partial_b1", "empty_mask_b1",
                                 "one_frame_b1", "soft_masks_b1"}  # fmt: skip
    for name, row in mixed_rows().items():
        np.testing.assert_array_equal(mixed.fbank[row], by_name[name].fbank[0], err_msg=name)
        np.testing.assert_array_equal(mixed.masks[row], by_name[name].masks[0], err_msg=name)
        rows = slice(row * MAX_SPEAKERS, (row + 1) * MAX_SPEAKERS)
        np.testing.assert_allclose(mixed.output[rows], by_name[name].output, rtol=0, atol=1e-5, err_msg=name)


def test_bad_files_and_names_are_named(tmp_path: Path) -> None:
    with pytest.raises(KeyError, match="unknown reference case 'nope'"):
        case_inputs("nope")
    save_file({"input/fbank": np.zeros((1, FRAMES, 80), np.float32)}, str(tmp_path / "x.safetensors"))
    with pytest.raises(KeyError, match="no 'input/masks'"):
        load_case(tmp_path / "x.safetensors")
    with pytest.raises(FileNotFoundError, match="reference case first_b1 missing"):
        load_cases(tmp_path)
