"""The compiled overlap-add loops give the bits of NumPy's (aggregate.py, reconstruct.py).

The speaker count and the clustered activations add every window's frames onto the
recording's frame grid, window after window, float64 contributions into float32 sums, as
pyannote's `Inference.aggregate` does with NumPy slices (tests/test_diarization_math.py
checks the NumPy way against pyannote itself). Where numba is installed the same additions
run as compiled loops; these tests hold the two to `np.array_equal` on inputs that make
any reordering or dropped NaN rule show: soft scores (not 0/1) whose float32 sums round,
NaN (a class absent from a window), negative values, window steps shorter and longer than
a window, several speakers of one window in one cluster, and NO_CLUSTER speakers. Each
test prints its table: case, frames, classes, max |compiled - NumPy|, equal.
"""

from __future__ import annotations

import numpy as np
import pytest

from speakerd.model.diarization import compiled
from speakerd.model.diarization.aggregate import overlap_add
from speakerd.model.diarization.clustering import NO_CLUSTER
from speakerd.model.diarization.count import speakers_per_frame
from speakerd.model.diarization.frames import SEGMENTATION_FRAMES, SlidingFrames, windows
from speakerd.model.diarization.reconstruct import cluster_activations

pytestmark = pytest.mark.skipif(not compiled.available(), reason="numba is not installed")

#: Window steps, seconds: pyannote's 1 s, a step that is not a whole number of frames, a
#: short one (20 windows over a frame) and one longer than a window (frames no window sees).
STEPS = (1.0, 2.5, 0.5, 12.0)
FRAMES_PER_WINDOW = 589
LOCAL_SPEAKERS = 3


def soft_scores(rng: np.random.Generator, windows_: int, classes: int, dtype: type) -> np.ndarray:
    """Scores in [-0.5, 1) with a tenth NaN: sums that round in float32, and absent classes."""
    scores = rng.random((windows_, FRAMES_PER_WINDOW, classes)) - 0.5 * (rng.random((1, 1, classes)) < 0.3)
    scores[rng.random(scores.shape) < 0.1] = np.nan
    return scores.astype(dtype)


def row(case: str, ours: np.ndarray, reference: np.ndarray) -> bool:
    equal = ours.shape == reference.shape and np.array_equal(ours, reference, equal_nan=True)
    gap = float(np.nanmax(np.abs(ours - reference), initial=0.0)) if ours.shape == reference.shape else np.inf
    print(f"{case:<40} {ours.shape[0]:>7} {ours.shape[1]:>7} {gap:>12.3g} {equal!s:>6}")
    return equal


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("average", [True, False])
def test_overlap_add_compiled_is_numpys(step: float, average: bool) -> None:
    rng = np.random.default_rng(int(step * 10) + average)
    print(f"\n{'case':<40} {'frames':>7} {'classes':>7} {'max |diff|':>12} {'equal':>6}")
    results = []
    for dtype in (np.float64, np.float32, np.uint8):
        if dtype == np.uint8:
            scores = rng.integers(0, 4, size=(25, FRAMES_PER_WINDOW, 1)).astype(np.uint8)
        else:
            scores = soft_scores(rng, 25, 3, dtype)
        chunks = windows(step)
        kwargs = {"average": average, "missing": 0.5}
        ours, grid = overlap_add(scores, chunks, SEGMENTATION_FRAMES, use_compiled=True, **kwargs)
        numpys, numpy_grid = overlap_add(scores, chunks, SEGMENTATION_FRAMES, use_compiled=False, **kwargs)
        assert grid == numpy_grid
        results.append(row(f"step {step} {np.dtype(dtype).name} average={average}", ours, numpys))
    assert all(results), "the compiled overlap-add differs from NumPy's (table above)"


def clusters_with_shared_speakers(rng: np.random.Generator, windows_: int, clusters: int) -> np.ndarray:
    """hard [windows, 3]: random clusters, a quarter of the windows with two or three of their
    speakers in one cluster, a tenth of the speakers NO_CLUSTER."""
    hard = rng.integers(0, clusters, size=(windows_, LOCAL_SPEAKERS))
    shared = rng.random(windows_) < 0.25
    hard[shared, 1] = hard[shared, 0]
    every = rng.random(windows_) < 0.1
    hard[every, 2] = hard[every, 0]
    hard[rng.random(hard.shape) < 0.1] = NO_CLUSTER
    return hard


@pytest.mark.parametrize("step", STEPS)
def test_cluster_activations_compiled_are_numpys(step: float) -> None:
    rng = np.random.default_rng(int(step * 10))
    print(f"\n{'case':<40} {'frames':>7} {'classes':>7} {'max |diff|':>12} {'equal':>6}")
    binary = (rng.random((30, FRAMES_PER_WINDOW, LOCAL_SPEAKERS)) < 0.4).astype(np.uint8)
    cases = {
        "0/1 bytes, int8 clusters": (binary, clusters_with_shared_speakers(rng, 30, 4).astype(np.int8)),
        "soft float64, NaN, negatives": (
            soft_scores(rng, 30, LOCAL_SPEAKERS, np.float64),
            clusters_with_shared_speakers(rng, 30, 5),
        ),
        "soft float32, one cluster": (
            soft_scores(rng, 30, LOCAL_SPEAKERS, np.float32),
            np.zeros((30, LOCAL_SPEAKERS), dtype=np.int64),
        ),
    }
    results = []
    for case, (segmentations, hard) in cases.items():
        ours = cluster_activations(segmentations, hard, windows(step), use_compiled=True)
        numpys = cluster_activations(segmentations, hard, windows(step), use_compiled=False)
        results.append(row(f"step {step} {case}", ours, numpys))
    assert all(results), "the compiled cluster activations differ from NumPy's (table above)"


def test_every_speaker_without_cluster_gives_no_columns() -> None:
    segmentations = np.ones((4, FRAMES_PER_WINDOW, LOCAL_SPEAKERS), dtype=np.uint8)
    hard = np.full((4, LOCAL_SPEAKERS), NO_CLUSTER)
    for use_compiled in (True, False):
        activations = cluster_activations(segmentations, hard, windows(1.0), use_compiled=use_compiled)
        assert activations.shape[1] == 0, (use_compiled, activations.shape)


@pytest.mark.parametrize("use_compiled", [True, False])
def test_bad_clusters_and_windows_are_refused(use_compiled: bool) -> None:
    segmentations = np.ones((4, FRAMES_PER_WINDOW, LOCAL_SPEAKERS), dtype=np.uint8)
    with pytest.raises(ValueError, match="negative cluster -1"):
        cluster_activations(segmentations, np.full((4, 3), -1), windows(1.0), use_compiled=use_compiled)
    with pytest.raises(ValueError, match=r"hard clusters \(4, 2\), expected \(4, 3\)"):
        cluster_activations(segmentations, np.zeros((4, 2)), windows(1.0), use_compiled=use_compiled)
    # frames longer than the window they come from would land past the recording's grid
    long_frames = SlidingFrames(start=0.0, duration=0.1, step=0.1)
    with pytest.raises(ValueError, match="do not fit the recording's"):
        overlap_add(
            segmentations, windows(1.0), long_frames, average=True, missing=0.0, use_compiled=use_compiled
        )


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int32, np.bool_, np.float32])
def test_speakers_per_frame_is_numpys_sum(dtype: type) -> None:
    # bytes are summed speaker by speaker: the same values and dtype as np.sum over the axis
    binarized = (np.random.default_rng(0).random((6, FRAMES_PER_WINDOW, LOCAL_SPEAKERS)) < 0.5).astype(dtype)
    ours, numpys = speakers_per_frame(binarized), np.sum(binarized, axis=-1, keepdims=True)
    assert ours.dtype == numpys.dtype and np.array_equal(ours, numpys), (ours.dtype, numpys.dtype)
