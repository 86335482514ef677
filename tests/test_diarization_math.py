"""speakerd.model.diarization against pyannote.audio 4.0.7's own code, on the same arrays.

The promise: given pyannote's binarized segmentations [windows, 589, 3] and the embeddings
[windows, 3, 256], `diarize` gives what `SpeakerDiarization.apply` gives after its
embedding step (speaker-diarization-3.1's AgglomerativeClustering): the same turns and
exclusive turns (equal floats, same order, same names, so DER 0), the same centroids, RTTM
text and speech per speaker.

Two parts:

- Identity on sample.wav (pyannote's bundled 30 s, 21 windows). pyannote's pipeline is built
  as speakerd/pyannote/models.py builds it (segmentation-3.0, the synthetic embedding model
  of the `weights_path` fixture) and runs `apply` with a hook that captures the segmentation
  and embeddings it used; `diarize` then gets those arrays. The segmentation is pyannote's,
  computed once. The embedding step is where the two differ on purpose: pyannote's own
  (one ResNet run per window and speaker) took 110 s per run on this project's 2 cores
  shared with other work, so the pipeline's `get_embeddings` is replaced by arrays computed once outside it:
  the synthetic model's embeddings from speakerd's CPU engine under pyannote's masks (with
  and without `exclude_overlap`; tests/test_pyannote.py shows they are pyannote's to a
  cosine of 0.99999), and "planted" embeddings that follow sample.rttm's two real speakers,
  so that the clustering has real structure to find. Everything after the embeddings, the
  part under test, is pyannote's own `apply`.
- Each piece against the pyannote function it reproduces, on random inputs: the speaker
  count, the clustering (planted clusters, small ones, forced numbers, constrained
  assignment), the reconstruction, the turns (`Binarize` with min_duration_on/off) and RTTM.

Skips, saying why, without pyannote.audio (.ci/run installs 4.0.7); the sample.wav part also
without segmentation-3.0's checkpoint (scripts/pyannote_segmentation.sh).
"""

from __future__ import annotations

import copy
import io
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

# pyannote.audio 4 sends usage telemetry to its vendor unless told not to; tests send nothing
os.environ["PYANNOTE_METRICS_ENABLED"] = "false"
pytest.importorskip(
    "pyannote.audio",
    reason="pyannote.audio is not installed (pip install 'speakerd[pyannote]'; .ci/run installs 4.0.7)",
)

import soundfile
import torch
from pyannote.audio.pipelines.clustering import AgglomerativeClustering
from pyannote.audio.pipelines.speaker_diarization import SpeakerDiarization
from pyannote.audio.pipelines.utils.diarization import SpeakerDiarizationMixin, set_num_speakers
from pyannote.audio.utils.signal import Binarize
from pyannote.core import Annotation, Segment, SlidingWindow, SlidingWindowFeature
from pyannote.metrics.diarization import DiarizationErrorRate

from speakerd.model.diarization import (
    SEGMENTATION_FRAMES,
    AgglomerativeParameters,
    Clusters,
    Diarization,
    SpeakerCount,
    Turn,
    agglomerative_clustering,
    binarize,
    bind_speakers,
    diarize,
    reconstruct,
    speaker_count,
    to_rttm,
)
from speakerd.model.diarization.clustering import (
    assign_embeddings,
    bound_clusters,
    clean_speakers,
    cluster_embeddings,
)
from speakerd.model.diarization.frames import WINDOW_S, windows

#: pyannote.metrics warns that it scores the union of both extents when no UEM is given:
#: exactly what these comparisons want.
pytestmark = pytest.mark.filterwarnings("ignore:'uem' was approximated:UserWarning")

ROOT = Path(__file__).resolve().parent.parent
#: Where .ci/run (scripts/pyannote_segmentation.sh) extracts segmentation-3.0's checkpoint.
SEGMENTATION = Path(
    os.environ.get(
        "SPEAKERD_PYANNOTE_SEGMENTATION", ROOT / ".cache/pyannote/segmentation-3.0/pytorch_model.bin"
    )
)
#: speaker-diarization-3.1's clustering, as pyannote instantiates it (speakerd/pyannote/models.py).
PYANNOTE_3_1 = {"method": "centroid", "min_cluster_size": 12, "threshold": 0.7045654963945799}
#: Planted embeddings: spread of a row around its speaker's direction (per dimension, so a
#: row's noise has norm 0.35 against a unit direction: cosine ~0.94 to its own speaker, ~0
#: to others; speaker-diarization-3.1 cuts the centroid linkage of normalised rows at a
#: Euclidean 0.70, a cosine of 0.75).
PLANTED_NOISE = 0.35 / 16
#: Planted rows are scaled by a factor in this range: centroids are means of raw rows,
#: linkage sees normalised ones, so unequal norms tell the two apart.
PLANTED_SCALE = (0.5, 2.0)
#: Rows moved to a third, unrelated direction in the "intruder" case: fewer than
#: min_cluster_size (12, or 10% of ~35 clean rows here: 4), so a small cluster to reassign.
INTRUDER_ROWS = 3
EMBEDDING_DIM = 256
LOCAL_SPEAKERS = 3
#: The sample's segmentation (torch) and synthetic embeddings (ONNX Runtime) run on one
#: thread: on CI's 2 cores, which the other pytest worker shares, a pool of 2 spins waiting
#: for each other. pyannote's segmentation of 6 windows took 6 to 24 CPU-s on 2 torch threads
#: and 0.4 s on one; the CPU engine's 5 windows 4.2 CPU-s on 2 threads and 3.4 s on one.
THREADS = 1


# ---------------------------------------------------------------------------------------
# sample.wav: pyannote's apply and diarize on the same captured arrays
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One identity case: which embeddings, which speaker numbers."""

    name: str
    embeddings: str  # a key of the `sample` fixture's embeddings
    options: dict[str, int]


CASES = [
    Case("default", "synthetic", {}),
    Case("num_speakers=2", "synthetic", {"num_speakers": 2}),
    Case("num_speakers=3", "synthetic", {"num_speakers": 3}),
    Case("max_speakers=1", "synthetic", {"max_speakers": 1}),
    Case("min_speakers=3", "synthetic", {"min_speakers": 3}),
    Case("min=2, max=2", "synthetic", {"min_speakers": 2, "max_speakers": 2}),
    Case("exclude_overlap", "synthetic exclude_overlap", {}),
    Case("exclude_overlap, num_speakers=2", "synthetic exclude_overlap", {"num_speakers": 2}),
    Case("planted", "planted", {}),
    Case("planted, num_speakers=3", "planted", {"num_speakers": 3}),
    Case("planted, max_speakers=1", "planted", {"max_speakers": 1}),
    Case("planted + intruder", "planted intruder", {}),
    Case("planted + intruder, min_speakers=3", "planted intruder", {"min_speakers": 3}),
    Case("one voice (count > clusters)", "one voice", {}),
    Case("silence (early exit)", "silence", {}),
]


@dataclass
class Outcome:
    """pyannote's output and diarize's on the arrays pyannote's apply used."""

    reference: Any  # DiarizeOutput
    result: Diarization
    pyannote_s: float
    speakerd_s: float
    warned: list[str]  # warnings from diarize


def _reference_turns(annotation: Annotation) -> list[tuple[float, float, str]]:
    return [
        (segment.start, segment.end, label) for segment, _, label in annotation.itertracks(yield_label=True)
    ]


def _turns(turns: list[Turn]) -> list[tuple[float, float, str]]:
    return [(turn.start, turn.end, turn.speaker) for turn in turns]


def _annotation(turns: list[Turn], uri: str) -> Annotation:
    annotation = Annotation(uri=uri)
    for index, turn in enumerate(turns):
        annotation[Segment(turn.start, turn.end), index] = turn.speaker
    return annotation


def _reference_speakers(rttm: Path) -> dict[str, list[tuple[float, float]]]:
    speakers: dict[str, list[tuple[float, float]]] = {}
    for line in rttm.read_text().splitlines():
        fields = line.split()
        start, duration = float(fields[3]), float(fields[4])
        speakers.setdefault(fields[7], []).append((start, start + duration))
    return speakers


def _planted(segmentations: np.ndarray, rttm: Path, seed: int, intruder: bool) -> np.ndarray:
    """Embeddings following sample.rttm: each (window, speaker) row points at the reference
    speaker its mask overlaps most (unit direction + noise, scaled); silent rows are one
    constant vector (pyannote's empty-mask rows are the model's bias); `intruder` moves a few
    clean rows to a third direction."""
    rng = np.random.default_rng(seed)
    speakers = _reference_speakers(rttm)
    directions = rng.standard_normal((len(speakers) + 1, EMBEDDING_DIM))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    num_windows, num_frames, num_local = segmentations.shape
    middles = SEGMENTATION_FRAMES.middles(num_frames)
    rows = np.empty((num_windows, num_local, EMBEDDING_DIM), dtype=np.float32)
    bias = rng.standard_normal(EMBEDDING_DIM)
    for window in range(num_windows):
        times = windows().starts(num_windows)[window] + middles
        for local in range(num_local):
            active = segmentations[window, :, local] > 0
            if not active.any():
                rows[window, local] = bias
                continue
            overlap = [
                sum(np.count_nonzero(active & (times >= s) & (times < e)) for s, e in turns)
                for turns in speakers.values()
            ]
            direction = directions[int(np.argmax(overlap))]
            noise = PLANTED_NOISE * rng.standard_normal(EMBEDDING_DIM)
            rows[window, local] = rng.uniform(*PLANTED_SCALE) * (direction + noise)
    if intruder:
        alone = segmentations.sum(axis=2, keepdims=True) == 1
        clean = np.argwhere((segmentations * alone).sum(axis=1) >= 0.2 * num_frames)
        for window, local in clean[rng.choice(len(clean), INTRUDER_ROWS, replace=False)]:
            rows[window, local] = directions[-1] + PLANTED_NOISE * rng.standard_normal(EMBEDDING_DIM)
    return rows


def _one_voice(segmentations: np.ndarray, seed: int) -> np.ndarray:
    """Every speaking row around one direction: one cluster, while overlapped frames still
    count two speakers."""
    rng = np.random.default_rng(seed)
    direction = rng.standard_normal(EMBEDDING_DIM)
    direction /= np.linalg.norm(direction)
    num_windows, _, num_local = segmentations.shape
    rows = direction + PLANTED_NOISE * rng.standard_normal((num_windows, num_local, EMBEDDING_DIM))
    rows[segmentations.sum(axis=1) == 0] = rng.standard_normal(EMBEDDING_DIM)  # silent rows: a constant
    return rows.astype(np.float32)


@pytest.fixture(scope="module")
def models_module():
    if not SEGMENTATION.is_file():
        pytest.skip(
            f"segmentation-3.0 checkpoint not found at {SEGMENTATION}: run scripts/pyannote_segmentation.sh "
            "(or set SPEAKERD_PYANNOTE_SEGMENTATION)"
        )
    from speakerd.pyannote import models

    return models


@pytest.fixture(scope="module")
def sample(models_module, weights_path) -> dict[str, Any]:
    """sample.wav, pyannote's segmentation of it, and the embeddings of every case."""
    from speakerd.engine.cpu import CpuEngine
    from speakerd.model.fbank import chunk_recording, fbank
    from speakerd.model.recording import exclude_overlap
    from speakerd.model.weights import load_model

    models = models_module
    samples, rate = soundfile.read(str(models.sample_path()), dtype="float32")
    file = models.in_memory(samples, rate, "sample")
    segmentation_model = models.segmentation_model(SEGMENTATION)
    embedding_model = models.embedding_model(weights_path)
    pipeline = models.diarization_pipeline(segmentation_model, embedding_model)
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        segmentations = pipeline.get_segmentations(file)
    finally:
        torch.set_num_threads(threads)
    binarized = segmentations.data
    assert binarized.shape == (21, 589, LOCAL_SPEAKERS), binarized.shape

    # the synthetic model's embeddings, pooled under pyannote's masks (speakerd's CPU engine
    # runs one window at a time, so the windows exclude_overlap leaves alone keep their rows)
    engine = CpuEngine(load_model(weights_path), threads=THREADS)
    try:
        features = fbank(chunk_recording(samples).waveforms)
        masks = np.ascontiguousarray(np.transpose(binarized, (0, 2, 1)))
        full = engine.embed(features, masks).embeddings
        clean = exclude_overlap(masks)
        changed = np.nonzero(np.any(clean != masks, axis=(1, 2)))[0]
        without_overlap = full.copy()
        without_overlap[changed] = engine.embed(features[changed], clean[changed]).embeddings
    finally:
        engine.close()
    rttm = models.sample_path().with_suffix(".rttm")
    return {
        "file": file,
        "segmentations": segmentations,
        "segmentation_model": segmentation_model,
        "embedding_model": embedding_model,
        "embeddings": {
            "synthetic": full,
            "synthetic exclude_overlap": without_overlap,
            "planted": _planted(binarized, rttm, seed=0, intruder=False),
            "planted intruder": _planted(binarized, rttm, seed=1, intruder=True),
            "one voice": _one_voice(binarized, seed=2),
            "silence": full,
        },
    }


def _run_pyannote(sample: dict[str, Any], case: Case, models) -> tuple[Any, np.ndarray, np.ndarray, float]:
    """pyannote's apply on the case's arrays: (output, segmentation and embeddings its hook
    saw, seconds)."""
    pipeline = models.diarization_pipeline(
        sample["segmentation_model"],
        sample["embedding_model"],
        exclude_overlap="exclude_overlap" in case.embeddings,
    )
    segmentations = copy.deepcopy(sample["segmentations"])
    if case.embeddings == "silence":
        segmentations.data[:] = 0.0
    embeddings = sample["embeddings"][case.embeddings]
    pipeline.get_segmentations = lambda file, hook=None: copy.deepcopy(segmentations)
    pipeline.get_embeddings = lambda file, binary, exclude_overlap=False, hook=None: embeddings.copy()
    seen: dict[str, Any] = {}

    def hook(
        step: str, artifact: Any, file: Any = None, total: int | None = None, completed: int | None = None
    ):
        if artifact is not None:
            seen[step] = artifact

    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pyannote's out-of-bounds warning; diarize's is checked
        output = pipeline(dict(sample["file"]), hook=hook, **case.options)
    elapsed = time.perf_counter() - started
    captured = seen["segmentation"]
    assert captured.sliding_window.step == 1.0 and captured.sliding_window.duration == WINDOW_S
    return output, captured.data, seen.get("embeddings", embeddings), elapsed


@pytest.fixture(scope="module")
def outcomes(sample, models_module) -> dict[str, Outcome]:
    out = {}
    for case in CASES:
        reference, segmentations, embeddings, pyannote_s = _run_pyannote(sample, case, models_module)
        started = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = diarize(segmentations, embeddings, step_s=1.0, **case.options)
        speakerd_s = time.perf_counter() - started
        # what diarize warned; not a ResourceWarning, which the garbage collector emits for
        # whatever object it finds unclosed (an earlier test's pipe) while diarize runs
        warned = [str(w.message) for w in caught if not issubclass(w.category, ResourceWarning)]
        out[case.name] = Outcome(reference, result, pyannote_s, speakerd_s, warned)
    return out


@pytest.mark.slow
def test_identity_table(outcomes) -> None:
    """The whole comparison in one table (pytest -s shows it); each row is asserted below."""
    print(
        f"\n{'case':<36}{'turns':>6}{'excl':>6}{'spk':>5}{'clu':>5}{'same turns':>12}{'same excl':>11}"
        f"{'centroid |d|':>14}{'DER':>6}{'pyannote ms':>13}{'speakerd ms':>13}"
    )
    for name, o in outcomes.items():
        same = _turns(o.result.turns) == _reference_turns(o.reference.speaker_diarization)
        same_exclusive = _turns(o.result.exclusive_turns) == _reference_turns(
            o.reference.exclusive_speaker_diarization
        )
        reference_centroids = o.reference.speaker_embeddings
        gap = (
            float(np.max(np.abs(o.result.centroids - reference_centroids)))
            if o.result.centroids.shape == reference_centroids.shape and reference_centroids.size
            else 0.0
        )
        der = (
            DiarizationErrorRate()(o.reference.speaker_diarization, _annotation(o.result.turns, "sample"))
            if o.result.turns
            else 0.0
        )
        print(
            f"{name:<36}{len(o.result.turns):>6}{len(o.result.exclusive_turns):>6}{len(o.result.labels):>5}"
            f"{o.result.clusters:>5}{same!s:>12}{same_exclusive!s:>11}{gap:>14.1e}{der:>6.3f}"
            f"{1e3 * o.pyannote_s:>13.1f}{1e3 * o.speakerd_s:>13.1f}"
        )


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_diarize_equals_pyannote(outcomes, case: Case) -> None:
    o = outcomes[case.name]
    reference, result = o.reference, o.result
    expected = _reference_turns(reference.speaker_diarization)
    assert _turns(result.turns) == expected, (len(result.turns), len(expected))
    expected_exclusive = _reference_turns(reference.exclusive_speaker_diarization)
    assert _turns(result.exclusive_turns) == expected_exclusive, (
        len(result.exclusive_turns),
        len(expected_exclusive),
    )
    assert result.labels == reference.speaker_diarization.labels()
    assert result.centroids.shape == reference.speaker_embeddings.shape, (
        result.centroids.shape,
        reference.speaker_embeddings.shape,
    )
    # the same bits, not only allclose: the same NumPy reductions on the same rows
    assert np.array_equal(result.centroids, reference.speaker_embeddings, equal_nan=True), (
        f"centroids differ by up to {np.max(np.abs(result.centroids - reference.speaker_embeddings)):.3e}"
    )
    assert result.centroids.dtype == reference.speaker_embeddings.dtype, result.centroids.dtype
    assert result.rttm("sample") == reference.speaker_diarization.to_rttm()
    assert result.rttm("sample", exclusive=True) == reference.exclusive_speaker_diarization.to_rttm()
    for label in result.labels:
        expected_s = reference.speaker_diarization.label_duration(label)
        assert result.speech_s[label] == expected_s, (label, result.speech_s[label], expected_s)
    if result.turns:
        for name in ("speaker_diarization", "exclusive_speaker_diarization"):
            turns = result.turns if name == "speaker_diarization" else result.exclusive_turns
            der = DiarizationErrorRate()(getattr(reference, name), _annotation(turns, "sample"))
            assert der == 0.0, (name, der)


@pytest.mark.slow
def test_cases_cover_what_they_claim(outcomes, sample) -> None:
    """Each case exercises its path: a case that silently took another would prove less."""
    o = {name: outcome.result for name, outcome in outcomes.items()}
    assert len(o["default"].turns) > 0
    assert len(o["max_speakers=1"].labels) == 1
    assert o["planted"].clusters == 2, o["planted"].clusters  # sample.rttm's two speakers
    # a third cluster would be smaller than min_cluster_size: pyannote's search gives up, warns
    assert o["planted, num_speakers=3"].clusters == 2, o["planted, num_speakers=3"].clusters
    warned = outcomes["planted, num_speakers=3"].warned
    assert any("outside the bounds [3, 3]" in w for w in warned), warned
    # the intruder rows are a cluster of their own at the threshold, too small to stay one
    binarized = sample["segmentations"].data
    rows = sample["embeddings"]["planted intruder"]
    train = rows[clean_speakers(rows, binarized)]
    alone = cluster_embeddings(train, AgglomerativeParameters(min_cluster_size=1))
    sizes = sorted(np.bincount(alone).tolist())
    assert sizes[0] == INTRUDER_ROWS and len(sizes) == 3, sizes
    assert o["planted + intruder"].clusters == 2, o["planted + intruder"].clusters
    voice = o["one voice (count > clusters)"]
    assert voice.clusters == 1 and len(voice.labels) == 2, (voice.clusters, voice.labels)
    assert not np.any(voice.centroids[1]), "the count's extra speaker has a zero centroid"
    silence = o["silence (early exit)"]
    assert silence.turns == [] and silence.centroids.shape == (0, EMBEDDING_DIM), silence
    assert not outcomes["default"].warned, outcomes["default"].warned


# ---------------------------------------------------------------------------------------
# each piece against the pyannote function it reproduces, on random inputs
# ---------------------------------------------------------------------------------------


def _random_segmentations(
    rng: np.random.Generator,
    num_windows: int,
    num_frames: int = 589,
    speakers: int = 3,
    p_switch: float = 0.02,
) -> np.ndarray:
    """0/1 float32 [windows, frames, speakers] made of runs (a speaker toggles with
    probability p_switch per frame), some speakers silent for a whole window."""
    toggles = rng.random((num_windows, num_frames, speakers)) < p_switch
    start = rng.random((num_windows, 1, speakers)) < 0.5
    active = (np.cumsum(toggles, axis=1) + start) % 2 == 1
    silent = rng.random((num_windows, speakers)) < 0.15
    active &= ~silent[:, None, :]  # some speakers silent for the whole window
    return active.astype(np.float32)


def _sliding(data: np.ndarray, step: float, duration: float = WINDOW_S) -> SlidingWindowFeature:
    return SlidingWindowFeature(data.copy(), SlidingWindow(start=0.0, duration=duration, step=step))


def _receptive_field() -> SlidingWindow:
    f = SEGMENTATION_FRAMES
    return SlidingWindow(start=f.start, duration=f.duration, step=f.step)


@pytest.mark.parametrize(
    ("seed", "num_windows", "step"), [(0, 12, 1.0), (1, 7, 2.5), (2, 1, 1.0), (3, 30, 0.5)]
)
def test_speaker_count_equals_pyannote(seed: int, num_windows: int, step: float) -> None:
    binarized = _random_segmentations(np.random.default_rng(seed), num_windows)
    expected = SpeakerDiarizationMixin.speaker_count(
        _sliding(binarized, step), _receptive_field(), warm_up=(0.0, 0.0)
    )
    count = speaker_count(binarized, step)
    assert count.counts.shape == (expected.data.shape[0],), (count.counts.shape, expected.data.shape)
    assert count.counts.dtype == expected.data.dtype == np.uint8
    mismatched = np.count_nonzero(count.counts != expected.data[:, 0])
    assert mismatched == 0, f"{mismatched} of {len(count.counts)} frames differ"
    window = expected.sliding_window
    assert (count.frames.start, count.frames.duration, count.frames.step) == (
        window.start,
        window.duration,
        window.step,
    )


#: "near": the last planted direction is moved this far (relative) from the first one, to
#: a cosine of 0.83 (0.58 apart once normalised): the threshold (0.70) merges the two
#: groups, a lower cut of the dendrogram splits them.
NEAR_OFFSET = 0.67


def _planted_embeddings(
    rng: np.random.Generator, sizes: list[int], nan_rows: int = 2, near: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """(embeddings [windows, 3, 256], segmentations [windows, 589, 3]): one window per three
    rows, rows of cluster k around direction k (sizes[k] rows each, shuffled), the other rows
    unrelated noise, a few NaN rows, and segmentations where about a quarter of the rows
    speak alone too little to be clustered."""
    total = sum(sizes)
    num_windows = -(-total // LOCAL_SPEAKERS) + 1
    directions = rng.standard_normal((len(sizes), EMBEDDING_DIM))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    if near:
        directions[-1] = directions[0] + NEAR_OFFSET * directions[-1]
        directions[-1] /= np.linalg.norm(directions[-1])
    labels = rng.permutation(np.repeat(np.arange(len(sizes)), sizes))
    rows = rng.standard_normal((num_windows * LOCAL_SPEAKERS, EMBEDDING_DIM)) / 16  # unclustered noise rows
    rows[:total] = directions[labels] + PLANTED_NOISE * rng.standard_normal((total, EMBEDDING_DIM))
    rows *= rng.uniform(*PLANTED_SCALE, size=(len(rows), 1))
    rows[rng.choice(len(rows), nan_rows, replace=False)] = np.nan
    segmentations = np.zeros((num_windows, 589, LOCAL_SPEAKERS), dtype=np.float32)
    for window in range(num_windows):
        # speaker s alone on its own third of the window, with lengths around the 20% cut
        for local in range(LOCAL_SPEAKERS):
            length = int(rng.choice([100, 118, 130, 190]))
            segmentations[window, local * 196 : local * 196 + length, local] = 1.0
        segmentations[window, 150:170, :] = 1.0  # an overlap, which is not clean
    return rows.reshape(num_windows, LOCAL_SPEAKERS, EMBEDDING_DIM).astype(np.float32), segmentations


CLUSTERING_CASES = [
    # (name, cluster sizes, speaker numbers, hyper-parameter changes, near, clusters expected)
    ("three large", [30, 25, 20], {}, {}, False, 3),
    ("large + small (reassigned)", [30, 25, 3, 2], {}, {}, False, 2),
    ("min_cluster_size=3 keeps 6, not 2", [30, 25, 6, 2], {}, {"min_cluster_size": 3}, False, 3),
    ("num_clusters=2 of 3 (search)", [30, 25, 20], {"num_clusters": 2}, {}, False, 2),
    ("num_clusters=4 of 3 (search misses)", [30, 25, 20], {"num_clusters": 4}, {}, False, 3),
    ("near pair merged", [30, 25, 20], {}, {}, True, 2),
    ("near pair, min_clusters=3 (search splits)", [30, 25, 20], {"min_clusters": 3}, {}, True, 3),
    ("max_clusters=2", [30, 25, 20], {"max_clusters": 2}, {}, False, 2),
    ("max_clusters=1 (no clustering)", [30, 25], {"max_clusters": 1}, {}, False, 1),
    ("few rows (min size 10%)", [6, 4, 2], {}, {}, False, 3),
    ("average linkage", [30, 25, 3], {}, {"method": "average"}, False, 2),
    ("constrained", [30, 25, 20], {}, {"constrained_assignment": True}, False, 3),
]


def _both_clusterings(
    embeddings: np.ndarray, segmentations: np.ndarray, numbers: dict[str, int], changes: dict[str, Any]
) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], Clusters]:
    """(pyannote's (hard, soft, centroids), speakerd's Clusters) on the same arrays."""
    hyper = {**PYANNOTE_3_1, **{k: v for k, v in changes.items() if k != "constrained_assignment"}}
    constrained = bool(changes.get("constrained_assignment", False))
    pyannote = AgglomerativeClustering(metric="cosine", constrained_assignment=constrained).instantiate(hyper)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # pyannote's mean of no rows
        expected = pyannote(
            embeddings=embeddings.copy(), segmentations=_sliding(segmentations, 1.0), **numbers
        )
    ours = agglomerative_clustering(
        embeddings,
        segmentations,
        parameters=AgglomerativeParameters(**hyper, constrained_assignment=constrained),
        **numbers,
    )
    return expected, ours


def _assert_same_clusters(ours: Clusters, hard: np.ndarray, soft: np.ndarray, centroids: np.ndarray) -> None:
    assert np.array_equal(ours.hard, hard), (
        f"{np.count_nonzero(ours.hard != hard)} of {hard.size} pairs differ"
    )
    assert np.array_equal(ours.soft, soft, equal_nan=True), (
        f"soft differs by {np.nanmax(np.abs(ours.soft - soft))}"
    )
    assert np.array_equal(ours.centroids, centroids, equal_nan=True), (ours.centroids.shape, centroids.shape)


@pytest.mark.parametrize(
    ("sizes", "numbers", "changes", "near", "clusters"),
    [case[1:] for case in CLUSTERING_CASES],
    ids=[case[0] for case in CLUSTERING_CASES],
)
def test_clustering_equals_pyannote(
    sizes: list[int], numbers: dict[str, int], changes: dict[str, Any], near: bool, clusters: int
) -> None:
    embeddings, segmentations = _planted_embeddings(np.random.default_rng(sum(sizes)), sizes, near=near)
    (hard, soft, centroids), ours = _both_clusterings(embeddings, segmentations, numbers, changes)
    _assert_same_clusters(ours, hard, soft, centroids)
    # the case takes the path its name says
    assert len(ours.centroids) == clusters, (len(ours.centroids), clusters)


@pytest.mark.parametrize("clean_rows", [0, 1])
def test_clustering_with_almost_no_clean_rows(clean_rows: int) -> None:
    """No clean row: one cluster with a NaN centroid; one: linkage is skipped (pyannote
    special-cases a single embedding), then every row is assigned to it."""
    embeddings, segmentations = _planted_embeddings(np.random.default_rng(5), [4, 3], nan_rows=0)
    segmentations[:] = 0.0
    segmentations[:, :50, :] = 1.0  # everyone speaks together: nobody alone
    if clean_rows:
        segmentations[1, 200:400, 2] = 1.0
    (hard, soft, centroids), ours = _both_clusterings(embeddings, segmentations, {}, {})
    _assert_same_clusters(ours, hard, soft, centroids)
    assert np.isnan(ours.centroids).all() == (clean_rows == 0), ours.centroids[:, :3]


def test_assignment_equals_pyannote() -> None:
    """assign_embeddings, constrained and not, with more speakers than clusters in a window."""
    rng = np.random.default_rng(7)
    embeddings = rng.standard_normal((9, LOCAL_SPEAKERS, 16)).astype(np.float32)
    train_windows, train_speakers = np.nonzero(rng.random((9, LOCAL_SPEAKERS)) < 0.7)
    clusters = rng.integers(0, 2, size=len(train_windows))
    for constrained in (False, True):
        hard, soft, centroids = AgglomerativeClustering().assign_embeddings(
            embeddings, train_windows, train_speakers, clusters, constrained=constrained
        )
        ours = assign_embeddings(embeddings, train_windows, train_speakers, clusters, constrained=constrained)
        assert np.array_equal(ours.hard, hard), (constrained, ours.hard, hard)
        assert np.array_equal(ours.soft, soft) and np.array_equal(ours.centroids, centroids), constrained
    assert np.count_nonzero(ours.hard == -2) > 0, "some window has more speakers than clusters"


@pytest.mark.parametrize(
    ("num", "low", "high"),
    [(None, None, None), (2, None, None), (None, 2, 5), (None, 3, 3), (None, 4, 2), (0, 0, 3)],
)
def test_speaker_bounds_equal_pyannote(num: int | None, low: int | None, high: int | None) -> None:
    try:
        expected: Any = set_num_speakers(num, low, high)
    except ValueError as error:
        expected = type(error)
    try:
        got: Any = bind_speakers(num, low, high)
    except ValueError as error:
        got = type(error)
    assert got == expected, (got, expected)
    for embeddings in (0, 1, 3, 10):
        try:
            expected = AgglomerativeClustering().set_num_clusters(embeddings, num, low, high)
        except ValueError as error:
            expected = type(error)
        try:
            got = bound_clusters(embeddings, num, low, high)
        except ValueError as error:
            got = type(error)
        assert got == expected, (embeddings, got, expected)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reconstruct_equals_pyannote(seed: int) -> None:
    """Including frames whose count exceeds the clusters (extra columns) and speakers with
    no cluster (-2)."""
    rng = np.random.default_rng(seed)
    binarized = _random_segmentations(rng, 10, p_switch=0.03)
    hard = rng.integers(0, 1 + seed, size=(10, LOCAL_SPEAKERS))
    hard[binarized.sum(axis=1) == 0] = -2
    expected_count = SpeakerDiarizationMixin.speaker_count(
        _sliding(binarized, 1.0), _receptive_field(), warm_up=(0.0, 0.0)
    )
    expected_count.data = np.minimum(expected_count.data, 3).astype(np.int8)
    expected = SpeakerDiarization.reconstruct(
        SpeakerDiarizationMixin(), _sliding(binarized, 1.0), hard.copy(), expected_count
    )
    count = speaker_count(binarized, 1.0)
    capped = SpeakerCount(np.minimum(count.counts, 3).astype(np.int8), count.frames)
    ours = reconstruct(binarized, hard, capped, windows(1.0))
    assert ours.shape == expected.data.shape and ours.dtype == expected.data.dtype, (
        ours.shape,
        expected.data.shape,
    )
    assert np.array_equal(ours, expected.data), f"{np.count_nonzero(ours != expected.data)} cells differ"
    if seed == 0:
        assert ours.shape[1] > 1, "one cluster and overlaps: extra columns must appear"


@pytest.mark.parametrize(
    ("columns", "on", "off"), [(3, 0.0, 0.0), (4, 0.0, 0.5), (3, 0.3, 0.0), (5, 0.2, 0.1), (30, 0.0, 0.3)]
)
def test_turns_equal_binarize(columns: int, on: float, off: float) -> None:
    """`Binarize` with pyannote's onset/offset 0.5; 30 columns reach track names past Z."""
    rng = np.random.default_rng(columns)
    discrete = (rng.random((900, columns)) < 0.5).astype(np.float32)
    discrete = np.repeat(discrete[::6], 6, axis=0)[:900]  # runs of 6 frames or more
    discrete[-1, 0], discrete[-2, 0] = 1.0, 0.0  # a turn starting on the last frame: empty
    expected = Binarize(onset=0.5, offset=0.5, min_duration_on=on, min_duration_off=off)(
        SlidingWindowFeature(discrete, _receptive_field())
    )
    tracks = binarize(discrete, SEGMENTATION_FRAMES, min_duration_on=on, min_duration_off=off)
    got = [(t.start, t.end, t.column, t.track) for t in tracks]
    want = [(s.start, s.end, label, track) for s, track, label in expected.itertracks(yield_label=True)]
    assert got == want, (len(got), len(want), next((g, w) for g, w in zip(got, want, strict=False) if g != w))


def test_rttm_equals_write_rttm() -> None:
    rng = np.random.default_rng(3)
    starts = np.round(rng.uniform(0, 100, 40), 4)  # 4 decimals: .xxx5 exercises the rounding
    turns = sorted(
        (
            Turn(float(s), float(s + d), f"SPEAKER_{k:02d}")
            for s, d, k in zip(starts, rng.uniform(0.1, 5, 40), rng.integers(0, 12, 40), strict=True)
        ),
        key=lambda t: (t.start, t.end),
    )
    for uri in ("meeting-1", None):
        annotation = _annotation(turns, uri)
        written = io.StringIO()
        annotation.write_rttm(written)
        assert to_rttm(turns, uri) == written.getvalue()
        # pyannote's own order too: the annotation re-sorts, and the text is the same
        assert to_rttm(turns, uri) == annotation.to_rttm()
    with pytest.raises(ValueError, match="space"):
        to_rttm(turns, "a meeting")
    with pytest.raises(ValueError, match="space"):
        to_rttm([Turn(0.0, 1.0, "Ada Lovelace")], "m")


def test_clean_pairs_of_bytes_are_those_of_floats() -> None:
    """A server's segmentation arrives as 0/1 bytes: clean_speakers counts it in byte
    arithmetic, and must pick exactly the pairs pyannote's float formula picks (every pair
    at the 20% boundary included), NaN embeddings left out either way."""
    rng = np.random.default_rng(12)
    binary = (rng.random((400, 589, 3)) < rng.random((400, 1, 3))).astype(np.uint8)
    binary[:50, :118, 0], binary[:50, 118:, 0] = 1, 0  # 118 clean frames: exactly 20% of 589 is 117.8
    binary[:50, :, 1:] = 0
    embeddings = rng.standard_normal((400, 3, 8)).astype(np.float32)
    embeddings[7, 2] = np.nan
    as_bytes = clean_speakers(embeddings, binary)
    as_floats = clean_speakers(embeddings, binary.astype(np.float32))
    assert all(np.array_equal(a, b) for a, b in zip(as_bytes, as_floats, strict=True))
    assert 0 < len(as_bytes[0]) < 1200 and (7, 2) not in set(zip(*as_bytes, strict=True))


def test_clean_pairs_found_window_by_window_are_those_of_the_whole() -> None:
    """A server finds the clean pairs as windows arrive and hands them to diarize (`clean`):
    window by window, offset by each group's first window, they are the whole recording's,
    and the diarization made with them is the same."""
    rng = np.random.default_rng(21)
    binary = (rng.random((60, 589, 3)) < rng.random((60, 1, 3))).astype(np.uint8)
    embeddings = rng.standard_normal((60, 3, 256)).astype(np.float32)
    embeddings[embeddings[:, :, 0] > 2.0] = np.nan
    found = [clean_speakers(embeddings[a : a + 7], binary[a : a + 7]) for a in range(0, 60, 7)]
    windows = np.concatenate([w + a for (w, _), a in zip(found, range(0, 60, 7), strict=True)])
    speakers = np.concatenate([s for _, s in found])
    whole = clean_speakers(embeddings, binary)
    assert np.array_equal(windows, whole[0]) and np.array_equal(speakers, whole[1])
    given, found_here = (
        diarize(binary, embeddings, 1.0, clean=(windows, speakers)),
        diarize(binary, embeddings, 1.0),
    )
    assert given.turns == found_here.turns and given.exclusive_turns == found_here.exclusive_turns
    assert np.array_equal(given.centroids, found_here.centroids) and given.turns, given.turns
