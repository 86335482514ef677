"""`python -m speakerd embed`: the real CLI on the CPU engine, its outputs and its input errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from speakerd.cli import main
from speakerd.model.architecture import CHUNK_SAMPLES, EMBEDDING_DIM
from speakerd.model.audio import speaker_masks, synthetic_recording
from speakerd.model.fbank import chunk_recording, fbank
from speakerd.model.numerics import active_frames
from speakerd.model.weights import file_sha256, load_model

#: docs/parity.md FP32 bounds against the ONNX Runtime CPU references.
FP32_MIN_COSINE = 0.99999
FP32_REL_MAX_ABS = 1e-4


def _embed(tmp_path: Path, arrays: dict[str, np.ndarray], *extra: str) -> tuple[int, Path]:
    source, out = tmp_path / "in.npz", tmp_path / "out.npz"
    np.savez(source, **arrays)
    return main(["embed", "--input", str(source), "--output", str(out), *extra]), out


GOOD_MASKS = np.ones((2, 3, 589), np.float32)


@pytest.mark.parametrize(
    ("arrays", "expected"),
    [
        ({"fbank": np.zeros((2, 998, 80), np.float32)}, "masks: missing"),
        (
            {
                "masks": GOOD_MASKS,
                "fbank": np.zeros((2, 998, 80), np.float32),
                "waveform": np.zeros((2, 160000)),
            },
            "exactly one of",
        ),
        (
            {"masks": GOOD_MASKS, "fbank": np.zeros((2, 80, 998), np.float32)},
            "fbank: shape (2, 80, 998), expected [n, 998, 80]",
        ),
        (
            {"masks": GOOD_MASKS, "waveform": np.zeros((2, 16000), np.float32)},
            "waveform: shape (2, 16000), expected [n, 160000]",
        ),
        ({"masks": GOOD_MASKS, "waveform": np.full((2, 160000), 3.0, np.float32)}, "waveform: peak"),
        (
            {"masks": GOOD_MASKS[:1], "fbank": np.zeros((2, 998, 80), np.float32)},
            "masks: shape (1, 3, 589), expected [2, s, F]",
        ),
        (
            {"masks": GOOD_MASKS, "fbank": np.zeros((2, 998, 80), np.float64)},
            "fbank: dtype float64, expected float32",
        ),
        (
            {"masks": GOOD_MASKS, "fbank": np.zeros((2, 998, 80), np.float32), "extra": np.zeros(3)},
            "extra: unexpected",
        ),
    ],
    ids=[
        "no-masks",
        "both",
        "fbank-shape",
        "waveform-shape",
        "waveform-range",
        "mask-chunks",
        "fbank-dtype",
        "extra",
    ],
)
def test_bad_input_exits_2_naming_array_and_shapes(
    tmp_path: Path, arrays: dict[str, np.ndarray], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = _embed(tmp_path, arrays, "--engine", "cpu")
    err = capsys.readouterr().err
    assert code == 2, (code, err)
    assert expected in err, err
    assert not out.exists(), "no output on bad input"


def test_unreadable_input_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    assert main(["embed", "--input", str(tmp_path / "junk.npz"), "--output", str(tmp_path / "o.npz")]) == 2
    assert "junk.npz" in capsys.readouterr().err
    assert main(["embed", "--input", str(tmp_path / "absent.npz"), "--output", str(tmp_path / "o.npz")]) == 2
    assert "no file at" in capsys.readouterr().err


def test_waveform_input_on_cpu_engine(
    tmp_path: Path, weights_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two chunks (the second zero-padded), two speakers, one all-zero mask row."""
    recording = synthetic_recording(10.5, seed=5)  # windows at 0 s and a padded 1 s
    chunks = chunk_recording(recording.samples)
    assert len(chunks) == 2 and chunks.lengths[1] < CHUNK_SAMPLES
    masks = np.ascontiguousarray(speaker_masks(recording, chunks.starts)[:, :2])
    masks[1, 1] = 0.0
    code, out = _embed(
        tmp_path,
        {"waveform": chunks.waveforms, "masks": masks},
        "--engine",
        "cpu",
        "--weights",
        str(weights_path),
    )
    printed = capsys.readouterr()
    assert code == 0, printed.err
    model = load_model(weights_path)
    with np.load(out, allow_pickle=False) as result:
        assert set(result.files) == {"embeddings", "empty", "active_frames", "fbank", "model_id", "math"}
        embeddings, empty = result["embeddings"], result["empty"]
        assert embeddings.shape == (2, 2, EMBEDDING_DIM) and embeddings.dtype == np.float32
        np.testing.assert_array_equal(result["fbank"], fbank(chunks.waveforms))
        np.testing.assert_array_equal(result["active_frames"], active_frames(masks))
        assert empty.tolist() == (active_frames(masks) == 0).tolist() and empty[1, 1] and empty.sum() == 1
        assert str(result["model_id"]) == file_sha256(weights_path) == model.model_id
        assert str(result["math"]) == "fp32"
    # an empty row is seg_1.bias alone (mean 0, std 0), whatever the trunk computed
    np.testing.assert_allclose(embeddings[1, 1], model.seg_bias, rtol=0, atol=1e-6)
    for chunk, speaker in [(0, 0), (0, 1), (1, 0)]:
        distance = float(np.abs(embeddings[chunk, speaker] - model.seg_bias).max())
        assert distance > 1e-2, f"row ({chunk}, {speaker}) is the bias alone: {distance:.2e}"
    assert "1 empty rows" in printed.out and model.model_id in printed.out, printed.out


def test_fbank_input_matches_reference_case(
    tmp_path: Path, weights_path: Path, reference_cases: list
) -> None:
    """The offline path reproduces the ORT CPU reference of first_b1 within docs/parity.md's FP32 bounds."""
    print("\ncase              math  min_cosine   max_abs/max|ref|")
    checked = 0
    for case in reference_cases:
        if case.name not in ("first_b1", "last_partial_b1"):
            continue
        code, out = _embed(
            tmp_path,
            {"fbank": case.fbank, "masks": case.masks},
            "--engine",
            "cpu",
            "--weights",
            str(weights_path),
        )
        assert code == 0
        with np.load(out, allow_pickle=False) as result:
            rows = result["embeddings"].reshape(-1, EMBEDDING_DIM).astype(np.float64)
        reference = case.output.astype(np.float64)
        cosine = (rows * reference).sum(1) / (
            np.linalg.norm(rows, axis=1) * np.linalg.norm(reference, axis=1)
        )
        relative = float(np.abs(rows - reference).max() / np.abs(reference).max())
        print(f"{case.name:<17} fp32  {cosine.min():.8f}   {relative:.2e}")
        assert cosine.min() >= FP32_MIN_COSINE, f"{case.name}: min cosine {cosine.min():.8f}"
        assert relative < FP32_REL_MAX_ABS, f"{case.name}: max abs / max |ref| {relative:.2e}"
        checked += 1
    assert checked == 2, f"reference cases first_b1 and last_partial_b1 expected, {checked} found"


def test_cpu_engine_refuses_fp16(
    tmp_path: Path, weights_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    arrays = {"fbank": np.zeros((1, 998, 80), np.float32), "masks": np.ones((1, 1, 589), np.float32)}
    code, out = _embed(tmp_path, arrays, "--engine", "cpu", "--math", "fp16", "--weights", str(weights_path))
    err = capsys.readouterr().err
    assert code == 1 and "fp16" in err, (code, err)
    assert not out.exists()


def test_missing_model_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    arrays = {"fbank": np.zeros((1, 998, 80), np.float32), "masks": np.ones((1, 1, 589), np.float32)}
    code, _ = _embed(tmp_path, arrays, "--engine", "cpu", "--model", str(tmp_path / "nope.safetensors"))
    err = capsys.readouterr().err
    assert code == 2 and "nope.safetensors: no such file" in err, (code, err)
