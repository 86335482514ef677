"""The NumPy segmentation model on its own: the synthetic model, the two forward paths, the inputs.

Needs neither torch nor pyannote (tests/test_segmentation_parity.py holds the forward to
pyannote's own). The synthetic model must be deterministic (the same bytes for a seed),
made once on first use, shaped exactly as segmentation-3.0 is, and alive: on speech-like
audio its most likely class changes over time and several of the 7 classes win somewhere,
so code that reads its output (multilabel, speaker counts) sees more than one answer. The
recording path (the filter bank convolved once per recording) must give the per-window
path's numbers, the padded last window included.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from speakerd.cli import main
from speakerd.model.architecture import state_dict_shapes as embedding_shapes
from speakerd.model.audio import synthetic_recording
from speakerd.model.fbank import chunk_recording, chunk_starts
from speakerd.model.segmentation import forward, powerset
from speakerd.model.segmentation.architecture import (
    CLASSES,
    FRAME_DURATION_S,
    FRAME_START_S,
    FRAME_STEP_S,
    OUTPUT_FRAMES,
    num_frames,
    state_dict_shapes,
)
from speakerd.model.segmentation.store import default_segmentation_name, default_segmentation_path
from speakerd.model.segmentation.synthetic import make_state_dict
from speakerd.model.segmentation.weights import load_model, load_state_dict
from speakerd.model.weights import WeightsError, file_sha256

#: The recording path and the per-window path differ only by float32 rounding (the same
#: bound the parity with pyannote is held to).
PARITY_BOUND = 1e-4
#: "Several classes win somewhere": at least this many of the 7, each on at least this share
#: of a synthetic conversation's frames.
MIN_CLASSES, MIN_SHARE = 3, 0.05
#: The argmax changes between consecutive frames at least this often (a constant answer, or
#: one that never moves within a window, fails).
MIN_CHANGES = 0.02


@pytest.fixture(scope="module")
def model(segmentation_path: Path):
    return load_model(segmentation_path)


@pytest.fixture(scope="module")
def conversation():
    """14 s of a three-speaker synthetic conversation: 5 windows, the last one padded."""
    return synthetic_recording(14.5, seed=21)


def test_frame_timing_is_pyannotes() -> None:
    assert num_frames(160_000) == OUTPUT_FRAMES == 589
    assert (FRAME_START_S, FRAME_STEP_S, FRAME_DURATION_S) == (0.0, 0.016875, 0.0619375)


def test_synthetic_model_is_deterministic_and_shaped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first, second, other = (tmp_path / f"{name}.safetensors" for name in ("a", "b", "c"))
    assert main(["make-segmentation-model", "--out", str(first)]) == 0
    assert main(["make-segmentation-model", "--out", str(second)]) == 0
    assert main(["make-segmentation-model", "--out", str(other), "--seed", "1"]) == 0
    assert f"model id {file_sha256(first)}" in capsys.readouterr().out
    assert first.read_bytes() == second.read_bytes(), "make-segmentation-model is not deterministic"
    assert file_sha256(other) != file_sha256(first)
    state = load_state_dict(first)
    assert {key: tuple(value.shape) for key, value in state.items()} == state_dict_shapes()
    assert all(value.dtype == np.float32 for value in state.values())
    for key, value in make_state_dict(0).items():
        np.testing.assert_array_equal(state[key], value, err_msg=key)


def test_made_once_on_first_use(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPEAKERD_CACHE", str(tmp_path))
    path = default_segmentation_path()
    assert path == tmp_path / default_segmentation_name()
    written = path.stat().st_mtime_ns
    assert default_segmentation_path() == path and path.stat().st_mtime_ns == written
    assert sorted(entry.name for entry in tmp_path.iterdir()) == [path.name, f"{path.name}.lock"]


def test_synthetic_outputs_vary_on_speech(model, conversation) -> None:
    starts = chunk_starts(conversation.samples.shape[0])
    log_probs = forward.recording_log_probs(model, conversation.samples, starts)
    assert log_probs.shape == (starts.shape[0], OUTPUT_FRAMES, CLASSES) and log_probs.dtype == np.float32
    assert np.all(np.isfinite(log_probs))
    np.testing.assert_allclose(np.exp(log_probs).sum(axis=-1), 1.0, atol=1e-5)
    winners = log_probs.argmax(axis=-1)
    shares = np.bincount(winners.ravel(), minlength=CLASSES) / winners.size
    changes = float(np.mean(winners[:, 1:] != winners[:, :-1]))
    print(f"\nclass shares {np.round(shares, 3)}, argmax changes on {changes:.1%} of frames")
    assert np.count_nonzero(shares >= MIN_SHARE) >= MIN_CLASSES, f"class shares {np.round(shares, 3)}"
    assert changes >= MIN_CHANGES, f"the argmax changes on {changes:.1%} of frames"
    multilabel = powerset.to_multilabel(log_probs)
    assert len({tuple(row) for row in multilabel.reshape(-1, 3)}) >= MIN_CLASSES


def test_recording_path_equals_per_window_path(model, conversation) -> None:
    """Every window of a 14.5 s recording (the last zero-padded), then a window set the
    pipeline would not make (overlapping at a 10-sample offset, out of group order)."""
    chunks = chunk_recording(conversation.samples)
    assert chunks.lengths[-1] < 160_000, "the last window should be padded"
    straight = forward.log_probs(model, chunks.waveforms)
    shared = forward.recording_log_probs(model, conversation.samples, chunks.starts)
    difference = float(np.abs(shared - straight).max())
    agree = float(np.mean(shared.argmax(-1) == straight.argmax(-1)))
    print(f"\nrecording vs per-window path: max abs {difference:.2e}, argmax agreement {agree:.4%}")
    assert difference <= PARITY_BOUND, difference
    odd = np.array([10, 30_000, 30_010])
    windows = np.zeros((odd.size, 160_000), np.float32)
    for row, start in enumerate(odd):
        piece = conversation.samples[start : start + 160_000]
        windows[row, : piece.size] = piece
    shared = forward.recording_log_probs(model, conversation.samples, odd)
    difference = float(np.abs(shared - forward.log_probs(model, windows)).max())
    assert difference <= PARITY_BOUND, difference


def test_silence_and_a_short_recording(model) -> None:
    """All-zero audio (the waveform norm's variance is 0) and a recording shorter than one window."""
    silence = np.zeros((1, 160_000), np.float32)
    shared = forward.recording_log_probs(model, silence[0], np.array([0]))
    assert np.all(np.isfinite(shared))
    assert float(np.abs(shared - forward.log_probs(model, silence)).max()) <= PARITY_BOUND
    short = synthetic_recording(6.5, seed=4).samples
    padded = np.zeros((1, 160_000), np.float32)
    padded[0, : short.size] = short
    difference = np.abs(
        forward.recording_log_probs(model, short, np.array([0])) - forward.log_probs(model, padded)
    )
    assert float(difference.max()) <= PARITY_BOUND


def test_bad_inputs_are_named(model) -> None:
    samples = np.zeros(200_000, np.float32)
    with pytest.raises(ValueError, match=r"windows of shape \(2, 1000\), expected \[n, 160000\]"):
        forward.log_probs(model, np.zeros((2, 1000), np.float32))
    with pytest.raises(ValueError, match="multiples of 10 samples"):
        forward.recording_log_probs(model, samples, np.array([0, 16_005]))
    with pytest.raises(ValueError, match="inside the recording's 200000"):
        forward.recording_log_probs(model, samples, np.array([200_000]))
    with pytest.raises(ValueError, match="increasing order"):
        forward.recording_log_probs(model, samples, np.array([16_000, 0]))
    with pytest.raises(ValueError, match=r"expected a mono recording \[N\]"):
        forward.recording_log_probs(model, np.zeros((2, 160_000), np.float32), np.array([0]))
    with pytest.raises(ValueError, match=r"expected \[\.\.\., 7\]"):
        powerset.to_multilabel(np.zeros((4, 3)))


def test_a_wrong_file_is_one_line(tmp_path: Path) -> None:
    """The embedding model's safetensors is no segmentation model (its first missing key is
    named), nor is one with a tensor of another shape."""
    embedding = {key: np.zeros(shape, np.float32) for key, shape in embedding_shapes().items()}
    save_file(embedding, str(tmp_path / "embedding.safetensors"))
    with pytest.raises(WeightsError) as refused:
        load_model(tmp_path / "embedding.safetensors")
    assert str(refused.value).startswith("missing key 'classifier.bias' of shape (7,)"), refused.value
    state = make_state_dict(0)
    state["lstm.weight_hh_l2"] = np.ascontiguousarray(state["lstm.weight_hh_l2"][:, :64])
    save_file(state, str(tmp_path / "narrow.safetensors"))
    with pytest.raises(
        WeightsError, match=r"'lstm.weight_hh_l2' has shape \(512, 64\), expected \(512, 128\)"
    ):
        load_model(tmp_path / "narrow.safetensors")
