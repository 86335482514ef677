"""The compiled centroid linkage (speakerd.model.diarization.linkage) is SciPy's, to the bit.

`scipy.cluster.hierarchy.linkage(X, "centroid", "euclidean")` is the reference everywhere:
the linkage matrix (merge order, heights, counts) must be `np.array_equal` to it, not close.
The cases are the ones where a port goes wrong first: random unit rows from 2 rows to a few
thousand, exact duplicates and equal distances (ties: the heap's and the candidate search's
rules pick the merge), rows on a grid (many equal distances at every height), float32 rows
(SciPy links them as float64), and the clean embeddings of a synthetic hour-long recording's
worth of rows. The distances alone (`pdist_square`) equal SciPy's `pdist` too. Each test
prints its table: case, rows, merges, and the first differing merge if any.

The GPU's distances are tests/test_gpu_distances.py's.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from scipy.cluster.hierarchy import linkage as scipy_linkage
from scipy.spatial.distance import pdist, squareform

from speakerd.model.diarization import linkage
from speakerd.model.diarization.clustering import SPEAKER_DIARIZATION_3_1, cluster_embeddings
from speakerd.tools.bench_clustering import synthetic_rows

pytestmark = pytest.mark.skipif(not linkage.available(), reason="numba is not installed")


def unit(points: np.ndarray) -> np.ndarray:
    return points / np.linalg.norm(points, axis=1, keepdims=True)


def first_difference(ours: np.ndarray, reference: np.ndarray) -> str:
    rows = np.flatnonzero(np.any(ours != reference, axis=1))
    if rows.size == 0:
        return "-"
    k = int(rows[0])
    return f"merge {k}: ours {ours[k].tolist()} scipy {reference[k].tolist()}"


def check(case: str, points: np.ndarray) -> None:
    ours = linkage.centroid_linkage(points)
    reference = scipy_linkage(points, method="centroid", metric="euclidean")
    rows = f"rows {points.shape[0]:>5} merges {len(reference):>5}"
    print(f"{case:<28} {rows} differs {first_difference(ours, reference)}")
    assert ours.dtype == reference.dtype and ours.shape == reference.shape
    assert np.array_equal(ours, reference), f"{case}: {first_difference(ours, reference)}"


@pytest.mark.parametrize("rows", [2, 3, 4, 5, 7, 16, 33, 100, 257, 1000])
@pytest.mark.parametrize("dim", [3, 256])
def test_random_unit_rows(rows: int, dim: int) -> None:
    rng = np.random.default_rng(rows * 1000 + dim)
    check(f"random {dim}-d", unit(rng.standard_normal((rows, dim))))


def test_float32_rows_are_linked_as_float64() -> None:
    rng = np.random.default_rng(5)
    check("float32 unit rows", unit(rng.standard_normal((300, 256))).astype(np.float32))


def test_exact_duplicates_and_ties() -> None:
    rng = np.random.default_rng(11)
    points = unit(rng.standard_normal((200, 16)))
    points[20:30] = points[5]  # ten copies of one row: ten zero distances
    points[100:140] = points[40:80]  # forty rows twice
    points[150:160] = -points[0]  # antipodes of a duplicated row
    check("duplicates", points)


def test_ties_in_a_merge_long_enough_for_threads() -> None:
    # above PARALLEL_MIN_LIVE live clusters a merge's update runs in chunks on several
    # threads; the chunks' nearest candidates must combine to the first minimum
    rng = np.random.default_rng(13)
    points = unit(rng.standard_normal((linkage.PARALLEL_MIN_LIVE + 700, 8)))
    points[1000:1600] = points[200:800]  # 600 rows twice: ties across chunks
    points[2500:2600] = points[7]
    check("duplicates, threaded merges", points)


def test_grid_rows_have_equal_distances_at_every_height() -> None:
    grid = np.array([[x, y] for x in range(12) for y in range(12)], dtype=np.float64)
    check("grid 12x12", grid)
    check("grid shuffled", grid[np.random.default_rng(3).permutation(len(grid))])
    check("two points repeated", np.array([[0.0, 0.0], [1.0, 0.0]] * 20))


def test_all_rows_equal() -> None:
    check("one row 50 times", np.ones((50, 8)))


def test_clustered_rows_of_a_synthetic_hour() -> None:
    check("synthetic, 4 speakers", synthetic_rows(3000, speakers=4, seed=7))


def test_distances_are_scipys_pdist() -> None:
    rng = np.random.default_rng(2)
    for rows, dim in [(1, 4), (2, 256), (65, 256), (130, 7), (700, 256)]:
        points = unit(rng.standard_normal((rows, dim))).astype(np.float32)
        ours = linkage.pdist_square(points)
        reference = squareform(pdist(points.astype(np.float64)))
        print(f"pdist rows {rows:>4} dim {dim:>3} equal {np.array_equal(ours, reference)}")
        assert np.array_equal(ours, reference), (rows, dim, np.max(np.abs(ours - reference)))


def test_refuses_what_scipy_refuses() -> None:
    with pytest.raises(ValueError, match="at least 2 rows"):
        linkage.centroid_linkage(np.ones((1, 4)))
    points = unit(np.random.default_rng(0).standard_normal((10, 4)))
    points[3] = np.nan
    with pytest.raises(ValueError, match="finite values"):
        scipy_linkage(points, method="centroid", metric="euclidean")
    with pytest.raises(ValueError, match="finite values"):
        linkage.centroid_linkage(points)
    with pytest.raises(ValueError, match="square float64"):
        linkage.linkage_from_square(np.zeros((3, 4)))


def test_linkers_give_the_same_clusters() -> None:
    train = synthetic_rows(800, speakers=3, seed=1)
    compiled = cluster_embeddings(train, SPEAKER_DIARIZATION_3_1, linker=linkage.Linker(linkage.COMPILED))
    reference = cluster_embeddings(train, SPEAKER_DIARIZATION_3_1, linker=linkage.Linker(linkage.SCIPY))
    print(f"clusters: compiled {np.bincount(compiled).tolist()} scipy {np.bincount(reference).tolist()}")
    assert np.array_equal(compiled, reference)


def test_the_linker_uses_the_distances_it_is_given() -> None:
    seen: list[int] = []

    def distances(points: np.ndarray) -> np.ndarray:
        seen.append(points.shape[0])
        return linkage.pdist_square(points)

    points = synthetic_rows(50, speakers=2, seed=4)
    ours = linkage.Linker(linkage.COMPILED, distances)(points)
    assert seen == [50]
    assert np.array_equal(ours, scipy_linkage(points, method="centroid", metric="euclidean"))


def test_the_servers_linkage_flag_offers_every_implementation() -> None:
    from speakerd.serving.server.config import LINKAGES

    assert LINKAGES == linkage.IMPLEMENTATIONS


def test_the_check_case_proves_the_port_here() -> None:
    assert linkage.proven_equal_to_scipy()
    with pytest.raises(ValueError, match="implementation"):
        linkage.Linker("fastcluster")


def test_two_threads_link_at_once() -> None:
    # the server clusters two recordings at once; numba's parallel regions must allow it
    # (TBB, OpenMP) or take turns (its workqueue layer)
    inputs = [synthetic_rows(linkage.PARALLEL_MIN_LIVE + 300, speakers=3, seed=seed) for seed in (21, 22)]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(linkage.centroid_linkage, inputs))
    for points, ours in zip(inputs, results, strict=True):
        assert np.array_equal(ours, scipy_linkage(points, method="centroid", metric="euclidean"))


class HostDevice:
    """A DeviceLinkage that links on this host (the compiled port), counting its calls; with
    `out_of_memory` every call raises MemoryError, as a GPU without the matrix's room does."""

    def __init__(self, max_rows: int, out_of_memory: bool = False) -> None:
        self.max_rows = max_rows
        self.out_of_memory = out_of_memory
        self.calls: list[int] = []

    def can_implement(self, rows: int) -> bool:
        return 2 <= rows <= self.max_rows

    def __call__(self, points: np.ndarray) -> np.ndarray:
        self.calls.append(len(points))
        if self.out_of_memory:
            raise MemoryError("the device has no room")
        return linkage.centroid_linkage(points)


def test_the_linker_links_on_its_device_for_the_rows_it_takes(caplog) -> None:
    points = synthetic_rows(300, speakers=3, seed=4)
    reference = scipy_linkage(points, method="centroid", metric="euclidean")
    device = HostDevice(max_rows=300)
    assert np.array_equal(linkage.Linker(device=device)(points), reference) and device.calls == [300]
    small = HostDevice(max_rows=299)  # fewer rows than the points: the host links them
    assert np.array_equal(linkage.Linker(device=small)(points), reference) and small.calls == []
    scipy = HostDevice(max_rows=300)  # --linkage scipy never uses the device
    assert (
        np.array_equal(linkage.Linker(linkage.SCIPY, device=scipy)(points), reference) and scipy.calls == []
    )
    full = HostDevice(max_rows=300, out_of_memory=True)
    with caplog.at_level("WARNING"):
        assert np.array_equal(linkage.Linker(device=full)(points), reference) and full.calls == [300]
    assert "the device has no room; linking 300 rows on the host" in caplog.text


def test_a_device_is_proven_on_the_check_case() -> None:
    assert linkage.device_proven(HostDevice(max_rows=linkage.PROOF_ROWS))
    assert not linkage.device_proven(HostDevice(max_rows=linkage.PROOF_ROWS - 1))
