"""speakerd's VBx clustering and PLDA against pyannote.audio 4.0.7's own, on the same files.

The promise: with the same PLDA files, `vbx_clustering` gives what pyannote's
`VBxClustering` (speaker-diarization-community-1's clustering) gives, and `diarize(...,
clustering=VBxParameters(), plda=...)` gives what `SpeakerDiarization(clustering=
"VBxClustering").apply` gives after its embeddings: equal bits, not close floats.

The real PLDA is in a gated hub repo, so each test writes a random but valid one in
pyannote's layout (`xvec_transform.npz`: mean1, mean2, lda; `plda.npz`: mu, tr, psi) to a
temporary directory (tests/plda_files.py) and loads it twice: with pyannote's
`PLDA.from_pretrained(directory)` and with speakerd's `load_plda(directory)`. Embeddings are
planted clusters (rows around a few random directions), so VBx has speakers to find, merge
and prune. Speaker numbers VBx's own count misses send both to scikit-learn's KMeans (a
printed table lists those cases).

The pipeline part drives pyannote's own `apply` with its `get_segmentations` and
`get_embeddings` replaced by arrays (as tests/test_diarization_math.py does): sample.wav's
segmentation when segmentation-3.0's checkpoint is there (scripts/pyannote_segmentation.sh),
random segmentations always. The embedding model is an untrained `WeSpeakerResNet34`: the
pipeline needs one to exist, never runs it.

Skips, saying why, without pyannote.audio (.ci/run installs 4.0.7). The file took 31 to 40 s
on this project's 2 shared cores, most of it imports and segmentation-3.0 on sample.wav (9 to
25 s, the load decides); `-m "not slow"` leaves the sample.wav cases out (about 20 s).
"""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Callable
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

from pyannote.audio.core.plda import PLDA
from pyannote.audio.pipelines.clustering import VBxClustering
from pyannote.audio.utils.vbx import VBx, cluster_vbx
from pyannote.core import SlidingWindow, SlidingWindowFeature

from speakerd.model.diarization import (
    COMMUNITY_1,
    Clusters,
    Plda,
    PldaError,
    VBxParameters,
    diarize,
    load_plda,
    vbx_clustering,
)
from speakerd.model.diarization.clustering import clean_speakers
from speakerd.model.diarization.vbx import ahc_init, vb_iterations, vbx_responsibilities
from tests.plda_files import EMBEDDING_DIM, LDA_DIM, write_plda

ROOT = Path(__file__).resolve().parent.parent
#: Where .ci/run (scripts/pyannote_segmentation.sh) extracts segmentation-3.0's checkpoint.
SEGMENTATION = Path(
    os.environ.get(
        "SPEAKERD_PYANNOTE_SEGMENTATION", ROOT / ".cache/pyannote/segmentation-3.0/pytorch_model.bin"
    )
)
LOCAL_SPEAKERS = 3
NUM_FRAMES = 589
#: sample.wav's 21 windows in one segmentation batch (pyannote's default of 1 is ~25 s here).
SEGMENTATION_BATCH = 32
#: scikit-learn's KMeans sums its centres in chunks of this many rows, one thread a chunk
#: (sklearn.cluster._k_means_common.CHUNK_SIZE).
SKLEARN_CHUNK = 256
#: community-1's clustering as pyannote instantiates it.
PYANNOTE_COMMUNITY_1 = {"threshold": 0.6, "Fa": 0.07, "Fb": 0.8}
#: Planted rows: per-dimension noise around a unit direction (row noise of norm ~0.35: cosine
#: ~0.94 to its own direction, ~0 to the others), rows scaled in a range so that raw and
#: normalised means differ.
PLANTED_NOISE = 0.35 / 16
PLANTED_SCALE = (0.5, 2.0)
#: The last planted direction moved this far from the first one (relative): a cosine of
#: ~0.83, 0.58 apart once normalised, under community-1's 0.6 AHC threshold.
NEAR_OFFSET = 0.67


@pytest.fixture(scope="module")
def plda_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_plda(tmp_path_factory.mktemp("plda"), seed=0)


@pytest.fixture(scope="module")
def pyannote_plda(plda_dir: Path) -> PLDA:
    return PLDA.from_pretrained(str(plda_dir))


@pytest.fixture(scope="module")
def our_plda(plda_dir: Path) -> Plda:
    return load_plda(plda_dir)


# ---------------------------------------------------------------------------------------
# planted embeddings
# ---------------------------------------------------------------------------------------


def _planted(
    rng: np.random.Generator, sizes: list[int], near: bool = False, nan_rows: int = 2
) -> tuple[np.ndarray, np.ndarray]:
    """(embeddings [windows, 3, 256] float32, segmentations [windows, 589, 3]): rows of
    cluster k around direction k (sizes[k] rows, shuffled), the rest unrelated noise, a few
    NaN rows; each window's speakers speak alone on their own third, for lengths around the
    20% cut, so some rows are not clean; some speakers are silent for a whole window."""
    total = sum(sizes)
    num_windows = -(-total // LOCAL_SPEAKERS) + 1
    directions = rng.standard_normal((len(sizes), EMBEDDING_DIM))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    if near:
        directions[-1] = directions[0] + NEAR_OFFSET * directions[-1]
        directions[-1] /= np.linalg.norm(directions[-1])
    labels = rng.permutation(np.repeat(np.arange(len(sizes)), sizes))
    rows = rng.standard_normal((num_windows * LOCAL_SPEAKERS, EMBEDDING_DIM)) / 16
    rows[:total] = directions[labels] + PLANTED_NOISE * rng.standard_normal((total, EMBEDDING_DIM))
    rows *= rng.uniform(*PLANTED_SCALE, size=(len(rows), 1))
    rows[rng.choice(len(rows), nan_rows, replace=False)] = np.nan
    segmentations = np.zeros((num_windows, NUM_FRAMES, LOCAL_SPEAKERS), dtype=np.float32)
    for window in range(num_windows):
        for local in range(LOCAL_SPEAKERS):
            if rng.random() < 0.05:
                continue  # silent in this window
            length = int(rng.choice([100, 118, 130, 190]))
            segmentations[window, local * 196 : local * 196 + length, local] = 1.0
        segmentations[window, 150:170, :] = 1.0  # an overlap, which is not clean
    return rows.reshape(num_windows, LOCAL_SPEAKERS, EMBEDDING_DIM).astype(np.float32), segmentations


def _sliding(data: np.ndarray, step: float = 1.0) -> SlidingWindowFeature:
    return SlidingWindowFeature(data.copy(), SlidingWindow(start=0.0, duration=10.0, step=step))


def _pyannote_vbx(
    plda: PLDA, embeddings: np.ndarray, segmentations: np.ndarray, hyper: dict[str, Any], **numbers: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    constrained = hyper.pop("constrained_assignment", True)
    clustering = VBxClustering(plda, metric="cosine", constrained_assignment=constrained).instantiate(hyper)
    # VBxClustering compares with min/max_clusters without defaulting them: the pipeline always
    # passes set_num_speakers' numbers (min 1, max inf)
    numbers = {"min_clusters": 1, "max_clusters": np.inf, **numbers}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # mean of no rows
        return clustering(embeddings=embeddings.copy(), segmentations=_sliding(segmentations), **numbers)


def _assert_same(ours: Clusters, hard: np.ndarray, soft: np.ndarray, centroids: np.ndarray) -> None:
    assert ours.hard.dtype == hard.dtype, (ours.hard.dtype, hard.dtype)
    assert np.array_equal(ours.hard, hard), (
        f"{np.count_nonzero(ours.hard != hard)} of {hard.size} pairs differ"
    )
    assert ours.centroids.dtype == centroids.dtype, (ours.centroids.dtype, centroids.dtype)
    assert np.array_equal(ours.centroids, centroids, equal_nan=True), (
        f"centroids {ours.centroids.shape} vs {centroids.shape}, max |d|",
        np.nanmax(np.abs(ours.centroids - centroids)) if ours.centroids.shape == centroids.shape else "-",
    )
    assert np.array_equal(ours.soft, soft, equal_nan=True), "soft clusters differ"


# ---------------------------------------------------------------------------------------
# PLDA
# ---------------------------------------------------------------------------------------


def test_plda_equals_pyannote(our_plda: Plda, pyannote_plda: PLDA) -> None:
    """community-1's sizes (256 -> 128), float64 files: features and phi are pyannote's bits."""
    embeddings = np.random.default_rng(2).standard_normal((40, EMBEDDING_DIM)).astype(np.float32)
    expected = pyannote_plda(embeddings)
    got = our_plda.transform(embeddings)
    assert got.dtype == expected.dtype and got.shape == expected.shape == (40, LDA_DIM)
    assert np.array_equal(got, expected), np.max(np.abs(got - expected))
    assert np.array_equal(our_plda.phi, pyannote_plda.phi)


#: A smaller PLDA for the float32 case (the arithmetic is the same at any size): 64 -> 32,
#: of which the first 16 directions are kept.
SMALL_PLDA = (64, 32, 16)


def test_plda_float32_files_truncated_equal_pyannote(tmp_path: Path) -> None:
    """float32 archives and lda_dimension below the PLDA's size: still pyannote's bits."""
    dim_in, dim_out, kept = SMALL_PLDA
    directory = write_plda(tmp_path / "plda", seed=1, dtype=np.float32, dim_in=dim_in, dim_out=dim_out)
    theirs = PLDA(directory / "xvec_transform.npz", directory / "plda.npz", lda_dimension=kept)
    ours = load_plda(directory, lda_dimension=kept)
    embeddings = np.random.default_rng(2).standard_normal((40, dim_in)).astype(np.float32)
    expected = theirs(embeddings)
    got = ours.transform(embeddings)
    assert got.dtype == expected.dtype and got.shape == expected.shape == (40, kept)
    assert np.array_equal(got, expected), np.max(np.abs(got - expected))
    assert np.array_equal(ours.phi, theirs.phi)


#: The bad-file cases' model size: small, since only the checks are under test.
SMALL_IN, SMALL_OUT = 8, 4


def _bad_files() -> tuple[dict[str, tuple[str, Any, str]], dict[str, np.ndarray], dict[str, np.ndarray]]:
    good_x = {
        "mean1": np.zeros(SMALL_IN),
        "mean2": np.zeros(SMALL_OUT),
        "lda": np.eye(SMALL_IN)[:, :SMALL_OUT],
    }
    good_p = {"mu": np.zeros(SMALL_OUT), "tr": np.eye(SMALL_OUT), "psi": np.ones(SMALL_OUT)}
    # (file to spoil, its contents, what the message must say)
    return (
        {
            "missing lda": (
                "xvec_transform.npz",
                {"mean1": good_x["mean1"], "mean2": good_x["mean2"]},
                "'lda'",
            ),
            "mean1 ill-shaped": ("xvec_transform.npz", {**good_x, "mean1": np.zeros(10)}, "'mean1'"),
            "psi zero": ("plda.npz", {**good_p, "psi": np.zeros(SMALL_OUT)}, "'psi'"),
            "tr not square": ("plda.npz", {**good_p, "tr": np.eye(SMALL_OUT)[:2]}, "'tr'"),
            "tr singular": ("plda.npz", {**good_p, "tr": np.zeros((SMALL_OUT, SMALL_OUT))}, "'tr'"),
            "mu NaN": ("plda.npz", {**good_p, "mu": np.full(SMALL_OUT, np.nan)}, "'mu'"),
            "object array": ("plda.npz", {**good_p, "mu": np.array([{}], dtype=object)}, "'mu'"),
            "not an archive": ("plda.npz", b"not a zip file", "not a NumPy .npz archive"),
            "missing file": ("plda.npz", b"", "no such file"),
        },
        good_x,
        good_p,
    )


@pytest.mark.parametrize(
    "case",
    [
        "missing lda",
        "mean1 ill-shaped",
        "psi zero",
        "tr not square",
        "tr singular",
        "mu NaN",
        "object array",
        "not an archive",
        "missing file",
    ],
)
def test_bad_plda_files_say_which(tmp_path: Path, case: str) -> None:
    """A bad file is a PldaError of one line naming the file and the array."""
    cases, good_x, good_p = _bad_files()
    name, contents, expected = cases[case]
    np.savez(tmp_path / "xvec_transform.npz", **good_x)
    np.savez(tmp_path / "plda.npz", **good_p)
    if case == "missing file":
        (tmp_path / name).unlink()
    elif isinstance(contents, bytes):
        (tmp_path / name).write_bytes(contents)
    else:
        np.savez(tmp_path / name, **contents)
    with pytest.raises(PldaError) as error:
        load_plda(tmp_path, lda_dimension=SMALL_OUT)
    message = str(error.value)
    assert "\n" not in message, message
    assert str(tmp_path / name) in message and expected in message, message


def test_plda_directory_must_exist(tmp_path: Path) -> None:
    with pytest.raises(PldaError, match="not a directory"):
        load_plda(tmp_path / "nowhere")


# ---------------------------------------------------------------------------------------
# VBx pieces and the whole clustering
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("Fa", "Fb", "iterations"), [(0.07, 0.8, 20), (0.3, 10.0, 20), (1.0, 1.0, 10)])
def test_vb_iterations_equal_pyannote(Fa: float, Fb: float, iterations: int) -> None:
    """`VBx` itself: responsibilities, priors and ELBOs, bit for bit."""
    rng = np.random.default_rng(4)
    features = rng.standard_normal((60, 16)) * 3
    phi = np.sort(rng.uniform(0.1, 50, size=16))[::-1]
    start = rng.dirichlet(np.ones(5), size=60)
    gamma, priors, elbos = VBx(features, phi, Fa=Fa, Fb=Fb, pi=5, gamma=start.copy(), maxIters=iterations)
    ours = vb_iterations(features, phi, start.copy(), Fa=Fa, Fb=Fb, max_iterations=iterations)
    assert np.array_equal(ours[0], gamma) and np.array_equal(ours[1], priors)
    assert ours[2] == [elbo for (elbo,) in elbos]


def test_cluster_vbx_equals_pyannote(our_plda: Plda, pyannote_plda: PLDA) -> None:
    """AHC init + `cluster_vbx` on PLDA features, with an init of more clusters than speakers."""
    embeddings, _ = _planted(np.random.default_rng(5), [30, 25, 20], nan_rows=0)
    train = embeddings.reshape(-1, EMBEDDING_DIM)[:75]
    initial = ahc_init(train, 0.3)  # a low cut: many initial clusters for VBx to merge
    assert initial.max() + 1 > 3
    gamma, priors = cluster_vbx(
        initial, pyannote_plda(train), pyannote_plda.phi, Fa=0.07, Fb=0.8, maxIters=20
    )
    ours = vbx_responsibilities(initial, our_plda.transform(train), pyannote_plda.phi, 0.07, 0.8)
    assert np.array_equal(ours[0], gamma) and np.array_equal(ours[1], priors)


CLUSTERING_CASES = [
    # (name, cluster sizes, near, hyper-parameter changes, speaker numbers, clusters expected)
    ("three speakers", [30, 25, 20], False, {}, {}, 3),
    ("large + small", [30, 25, 3, 2], False, {}, {}, None),
    ("near pair", [30, 25, 20], True, {}, {}, None),
    ("low threshold: VBx merges AHC's pieces", [30, 25, 20], False, {"threshold": 0.3}, {}, None),
    ("Fb=15 prunes", [30, 25, 20], False, {"Fb": 15.0}, {}, None),
    ("Fa=0.5, Fb=0.01", [30, 25, 20], False, {"Fa": 0.5, "Fb": 0.01}, {}, None),
    ("unconstrained", [30, 25, 20], False, {"constrained_assignment": False}, {}, 3),
    ("num_clusters=3 met by VBx", [30, 25, 20], False, {}, {"num_clusters": 3}, 3),
    ("max_clusters=1 (KMeans of one)", [30, 25, 20], False, {}, {"max_clusters": 1}, 1),
    ("num_clusters=1 (KMeans of one)", [30, 25], False, {}, {"num_clusters": 1}, 1),
    ("min_clusters=2 met", [30, 25, 20], False, {}, {"min_clusters": 2}, 3),
]


@pytest.mark.parametrize(
    ("sizes", "near", "changes", "numbers", "clusters"),
    [case[1:] for case in CLUSTERING_CASES],
    ids=[case[0] for case in CLUSTERING_CASES],
)
def test_vbx_clustering_equals_pyannote(
    our_plda: Plda,
    pyannote_plda: PLDA,
    sizes: list[int],
    near: bool,
    changes: dict[str, Any],
    numbers: dict[str, Any],
    clusters: int | None,
) -> None:
    """hard and soft clusters and centroids: equal bits (np.array_equal, not allclose)."""
    embeddings, segmentations = _planted(np.random.default_rng(len(sizes) + 7 * near), sizes, near=near)
    hyper = {**PYANNOTE_COMMUNITY_1, **changes}
    hard, soft, centroids = _pyannote_vbx(pyannote_plda, embeddings, segmentations, dict(hyper), **numbers)
    ours = vbx_clustering(embeddings, segmentations, our_plda, parameters=VBxParameters(**hyper), **numbers)
    _assert_same(ours, hard, soft, centroids)
    if clusters is not None:
        assert len(ours.centroids) == clusters, len(ours.centroids)


@pytest.mark.parametrize("clean_rows", [0, 1])
def test_vbx_with_almost_no_clean_rows(our_plda: Plda, pyannote_plda: PLDA, clean_rows: int) -> None:
    """Fewer than two clean rows: one cluster, no VBx (a NaN centroid with none)."""
    embeddings, segmentations = _planted(np.random.default_rng(9), [6], nan_rows=0)
    segmentations[:] = 0.0
    segmentations[:clean_rows, :300, 0] = 1.0
    hard, soft, centroids = _pyannote_vbx(
        pyannote_plda, embeddings, segmentations, dict(PYANNOTE_COMMUNITY_1)
    )
    _assert_same(vbx_clustering(embeddings, segmentations, our_plda), hard, soft, centroids)


#: (name, cluster sizes, speaker numbers): numbers VBx's own count misses, so pyannote
#: re-clusters with scikit-learn's KMeans (and assigns without the constraint).
KMEANS_CASES = [
    ("num_clusters=2, VBx finds 3", [30, 25, 20], {"num_clusters": 2}),
    ("num_clusters=5, VBx finds 3", [30, 25, 20], {"num_clusters": 5}),
    ("min_clusters=4", [30, 25, 20], {"min_clusters": 4}),
    ("max_clusters=2", [30, 25, 20], {"max_clusters": 2}),
    ("large + small, num_clusters=4", [30, 25, 3, 2], {"num_clusters": 4}),
    ("min 3, max 4 of (30, 25, 3, 2)", [30, 25, 3, 2], {"min_clusters": 3, "max_clusters": 4}),
    # more clean rows than scikit-learn's chunk (SKLEARN_CHUNK): its centres are summed per thread
    ("over 256 clean rows, num_clusters=2", [160, 140, 100], {"num_clusters": 2}),
]


@pytest.fixture(scope="module")
def kmeans_table() -> Callable[..., None]:
    """The KMeans cases' printed table: its header once, then a row per case."""
    columns = "{:<36}{:>6}{:>5}{:>14}{:>7}  {}"
    print("\n" + columns.format("KMeans case", "clean", "VBx", "asked", "KMeans", "hard, soft, centroids"))
    return lambda *cells: print(columns.format(*cells))


@pytest.mark.parametrize(("name", "sizes", "numbers"), KMEANS_CASES, ids=[case[0] for case in KMEANS_CASES])
def test_kmeans_fallback_equals_pyannote(
    our_plda: Plda,
    pyannote_plda: PLDA,
    kmeans_table: Callable[..., None],
    name: str,
    sizes: list[int],
    numbers: dict[str, int],
) -> None:
    """Where VBx's count misses the numbers, pyannote's KMeans: equal bits again. Above 256
    clean rows scikit-learn sums partial centres per OpenMP thread; speakerd holds its KMeans
    to one thread, so it must equal pyannote run on one thread, and (no label being near a
    tie here) pyannote on this machine's threads too."""
    from threadpoolctl import threadpool_limits

    embeddings, segmentations = _planted(np.random.default_rng(sum(sizes)), sizes)
    clean = len(clean_speakers(embeddings, segmentations)[0])
    found = len(vbx_clustering(embeddings, segmentations, our_plda).centroids)
    ours = vbx_clustering(embeddings, segmentations, our_plda, **numbers)
    hyper = dict(PYANNOTE_COMMUNITY_1)
    _assert_same(ours, *_pyannote_vbx(pyannote_plda, embeddings, segmentations, dict(hyper), **numbers))
    if clean > SKLEARN_CHUNK:
        with threadpool_limits(limits=1, user_api="openmp"):
            _assert_same(
                ours, *_pyannote_vbx(pyannote_plda, embeddings, segmentations, dict(hyper), **numbers)
            )
    asked = ", ".join(f"{key.removesuffix('_clusters')} {value}" for key, value in numbers.items())
    kmeans_table(name, clean, found, asked, len(ours.centroids), "equal")
    # pyannote's rule: the bound VBx's count falls outside of, else num_clusters
    wanted = numbers.get("num_clusters")
    if found < numbers.get("min_clusters", 1):
        wanted = numbers["min_clusters"]
    elif found > numbers.get("max_clusters", np.inf):
        wanted = numbers["max_clusters"]
    assert found != wanted and len(ours.centroids) == wanted, (found, wanted, len(ours.centroids))


def test_kmeans_of_more_clusters_than_rows_is_clipped(our_plda: Plda, pyannote_plda: PLDA) -> None:
    """More clusters asked than clean rows: scikit-learn's KMeans, so pyannote, raises; speakerd
    clips to one cluster per clean row, as the agglomerative clustering clips the numbers."""
    embeddings, segmentations = _planted(np.random.default_rng(13), [3, 2], nan_rows=0)
    clean = len(clean_speakers(embeddings, segmentations)[0])
    asked = clean + 3
    with pytest.raises(ValueError, match="n_samples"):
        _pyannote_vbx(
            pyannote_plda, embeddings, segmentations, dict(PYANNOTE_COMMUNITY_1), num_clusters=asked
        )
    ours = vbx_clustering(embeddings, segmentations, our_plda, num_clusters=asked)
    assert len(ours.centroids) == clean and not np.isnan(ours.centroids).any()
    # the same as asking for exactly that many, which pyannote does answer
    _assert_same(ours, *_pyannote_vbx(
        pyannote_plda, embeddings, segmentations, dict(PYANNOTE_COMMUNITY_1), num_clusters=clean
    ))  # fmt: skip


# ---------------------------------------------------------------------------------------
# diarize against pyannote's apply
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vbx_pipeline(pyannote_plda: PLDA) -> Any:
    """pyannote's community-1 pipeline with VBxClustering and the test PLDA, hub-free:
    segmentation-3.0 (for sample.wav's segmentation and the model's frames) and an untrained
    embedding model that never runs."""
    from pyannote.audio.models.embedding import WeSpeakerResNet34
    from pyannote.audio.pipelines import SpeakerDiarization

    from speakerd.pyannote import models

    if not SEGMENTATION.is_file():
        pytest.skip(
            f"segmentation-3.0 checkpoint not found at {SEGMENTATION} (scripts/pyannote_segmentation.sh)"
        )
    segmentation = models.segmentation_model(SEGMENTATION)
    pipeline = SpeakerDiarization(
        segmentation=segmentation,
        embedding=WeSpeakerResNet34().eval(),
        plda=pyannote_plda,
        clustering="VBxClustering",
        segmentation_batch_size=SEGMENTATION_BATCH,
    )
    return pipeline.instantiate(
        {"segmentation": {"min_duration_off": 0.0}, "clustering": PYANNOTE_COMMUNITY_1}
    )


@pytest.fixture(scope="module")
def sample_segmentation(vbx_pipeline: Any) -> np.ndarray:
    """pyannote's segmentation of sample.wav (21 windows of 589 frames, 3 speakers)."""
    import soundfile

    from speakerd.pyannote import models

    samples, rate = soundfile.read(str(models.sample_path()), dtype="float32")
    return vbx_pipeline.get_segmentations(models.in_memory(samples, rate, "sample")).data


def _apply(pipeline: Any, segmentations: np.ndarray, embeddings: np.ndarray, options: dict[str, int]) -> Any:
    features = _sliding(segmentations)
    pipeline.get_segmentations = lambda file, hook=None: copy.deepcopy(features)
    pipeline.get_embeddings = lambda file, binary, exclude_overlap=False, hook=None: embeddings.copy()
    import torch

    # apply only validates the file: get_segmentations and get_embeddings are the arrays
    file = {"uri": "case", "waveform": torch.zeros((1, 16000)), "sample_rate": 16000}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pipeline(file, **options)


def _sample_planted(segmentations: np.ndarray, seed: int, speakers: int) -> np.ndarray:
    """Rows of sample.wav's windows around `speakers` directions: local speaker s of window w
    is speaker (w // 7 + s) % speakers, so speakers recur across windows."""
    rng = np.random.default_rng(seed)
    directions = rng.standard_normal((speakers, EMBEDDING_DIM))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    num_windows = segmentations.shape[0]
    who = (np.arange(num_windows)[:, None] // 7 + np.arange(LOCAL_SPEAKERS)[None, :]) % speakers
    rows = directions[who] + PLANTED_NOISE * rng.standard_normal((num_windows, LOCAL_SPEAKERS, EMBEDDING_DIM))
    rows *= rng.uniform(*PLANTED_SCALE, size=(num_windows, LOCAL_SPEAKERS, 1))
    return rows.astype(np.float32)


PIPELINE_CASES = [
    # (name, segmentations ("sample" or a seed of planted ones), embeddings seed, options)
    ("sample, 2 planted speakers", "sample", (0, 2), {}),
    ("sample, 3 planted speakers", "sample", (1, 3), {}),
    ("sample, 2 speakers, num_speakers=2", "sample", (0, 2), {"num_speakers": 2}),
    ("sample, 3 speakers, max_speakers=1", "sample", (1, 3), {"max_speakers": 1}),
    ("planted [30, 25, 20]", 11, None, {}),
    ("planted [30, 25, 3, 2]", 12, None, {}),
    # numbers VBx misses: KMeans
    ("sample, 2 speakers, num_speakers=3", "sample", (0, 2), {"num_speakers": 3}),
    ("planted [30, 25, 20], num_speakers=2", 11, None, {"num_speakers": 2}),
    ("planted [30, 25, 3, 2], min_speakers=3", 12, None, {"min_speakers": 3}),
    ("silence", "silence", (0, 2), {}),
]


@pytest.fixture(scope="module")
def pipeline_table() -> Callable[..., None]:
    """The pipeline cases' printed table: its header once, then a row per case."""
    columns = "{:<40}{:>6}{:>10}{:>9}{:>7}  {}"
    print("\n" + columns.format("diarize vs apply", "turns", "exclusive", "speakers", "KMeans", "all equal"))
    return lambda *cells: print(columns.format(*cells))


@pytest.mark.parametrize(
    ("name", "source", "planted", "options"),
    [
        # sample.wav's segmentation is segmentation-3.0 run once (9 to 25 s on 2 shared cores)
        pytest.param(*case, id=case[0], marks=[pytest.mark.slow] if isinstance(case[1], str) else [])
        for case in PIPELINE_CASES
    ],
)
def test_diarize_vbx_equals_pyannote_apply(
    request: pytest.FixtureRequest,
    vbx_pipeline: Any,
    our_plda: Plda,
    pipeline_table: Callable[..., None],
    name: str,
    source: str | int,
    planted: tuple[int, int] | None,
    options: dict[str, int],
) -> None:
    """Turns, exclusive turns, labels and centroids of `diarize` equal `apply`'s, bit for bit."""
    if isinstance(source, int):
        sizes = [30, 25, 20] if source == 11 else [30, 25, 3, 2]
        embeddings, segmentations = _planted(np.random.default_rng(source), sizes, nan_rows=0)
    else:
        segmentations = request.getfixturevalue("sample_segmentation").copy()
        assert planted is not None
        embeddings = _sample_planted(segmentations, *planted)
        if source == "silence":
            segmentations[:] = 0.0
    reference = _apply(vbx_pipeline, segmentations, embeddings, options)
    result = diarize(segmentations, embeddings, step_s=1.0, clustering=COMMUNITY_1, plda=our_plda, **options)
    expected = [
        (s.start, s.end, label) for s, _, label in reference.speaker_diarization.itertracks(yield_label=True)
    ]
    assert [(t.start, t.end, t.speaker) for t in result.turns] == expected
    expected = [
        (s.start, s.end, label)
        for s, _, label in reference.exclusive_speaker_diarization.itertracks(yield_label=True)
    ]
    assert [(t.start, t.end, t.speaker) for t in result.exclusive_turns] == expected
    assert result.labels == reference.speaker_diarization.labels()
    assert np.array_equal(result.centroids, reference.speaker_embeddings), "centroids differ"
    if source != "silence":
        assert result.turns, "a case with speech has turns"
    # whether the numbers sent VBx to KMeans: its own count, unbound, misses them
    unbound = diarize(segmentations, embeddings, step_s=1.0, clustering=COMMUNITY_1, plda=our_plda)
    kmeans = bool(options) and unbound.clusters != result.clusters
    pipeline_table(name, len(result.turns), len(result.exclusive_turns), len(result.labels),
                   "yes" if kmeans else "no", "yes")  # fmt: skip


def test_diarize_vbx_needs_a_plda() -> None:
    with pytest.raises(ValueError, match="PLDA"):
        diarize(
            np.ones((2, NUM_FRAMES, 3), np.float32),
            np.ones((2, 3, EMBEDDING_DIM), np.float32),
            1.0,
            clustering=COMMUNITY_1,
        )
