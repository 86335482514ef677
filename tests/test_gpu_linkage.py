"""The centroid linkage on the GPU (speakerd.engine.gpu.linkage, kernels/linkage.cu) is SciPy's
`linkage(X, "centroid", "euclidean")`, to the bit: `np.array_equal`, not close.

The cases of tests/test_linkage.py's host port, on the device: random unit rows from 2 rows to
an hour's worth, exact duplicates and equal distances (the heap's and the candidate search's
tie rules pick the merge; duplicates spread over many warps' ranges of the live list), rows
on a grid (ties at every height), every row equal, float32 rows (linked as float64), a
synthetic hour of 4 speakers; then the check case a server proves it on, SciPy's refusal of
non-finite rows, and the Linker routing rows above the device's limit to the host. Each
test prints its table row (case, rows, merges, the first differing merge if any).

Without a usable GPU these tests skip with the reason (REQUIRE_GPU=1 makes that a failure);
the source check at the top needs no GPU and runs everywhere.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from scipy.cluster.hierarchy import linkage as scipy_linkage

from speakerd.engine.gpu import kernels
from speakerd.engine.gpu import linkage as gpu_linkage
from speakerd.model.diarization import linkage
from speakerd.tools.bench_clustering import synthetic_rows
from tests.test_gpu_fbank import NO_DEVICE
from tests.test_linkage import first_difference, unit

needs_gpu = pytest.mark.skipif(
    NO_DEVICE is not None, reason=f"no usable GPU for the linkage kernels: {NO_DEVICE}"
)


def test_launch_shape_and_arithmetic_match_the_kernel() -> None:
    source = kernels.kernel_sources()[gpu_linkage.SOURCE]
    defines = dict(re.findall(r"#define (\w+) (\d+)", source))
    assert int(defines["THREADS"]) == gpu_linkage.MERGE_THREADS
    assert int(defines["NONFINITE"]) == gpu_linkage.NONFINITE
    assert int(defines["NO_NEIGHBOR"]) == gpu_linkage.NO_NEIGHBOR
    assert int(defines["LOWERED_SHARED"]) == gpu_linkage.LOWERED_SHARED
    assert int(defines["MAX_ROWS"]) == gpu_linkage.MAX_ROWS
    # _centroid's operations, each correctly rounded and never contracted into an FMA
    assert all(name in source for name in ("__dsub_rn", "__dmul_rn", "__dadd_rn", "__ddiv_rn", "__dsqrt_rn"))


@pytest.fixture(scope="module")
def device() -> gpu_linkage.GpuLinkage:
    return gpu_linkage.GpuLinkage(0)


def check(device: gpu_linkage.GpuLinkage, case: str, points: np.ndarray, capsys) -> None:
    ours = device(points)
    reference = scipy_linkage(points, method="centroid", metric="euclidean")
    with capsys.disabled():
        print(f"\ngpu {case:<28} rows {points.shape[0]:>5} merges {len(reference):>5} "
              f"differs {first_difference(ours, reference)}")  # fmt: skip
    assert ours.dtype == reference.dtype and ours.shape == reference.shape
    assert np.array_equal(ours, reference), f"{case}: {first_difference(ours, reference)}"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("rows", [2, 3, 4, 5, 7, 33, 100, 1000, 3000])
@pytest.mark.parametrize("dim", [3, 256])
def test_random_unit_rows(device, rows: int, dim: int, capsys) -> None:
    rng = np.random.default_rng(rows * 1000 + dim)
    check(device, f"random {dim}-d", unit(rng.standard_normal((rows, dim))), capsys)


@pytest.mark.gpu
@needs_gpu
def test_duplicates_ties_grids_and_equal_rows(device, capsys) -> None:
    rng = np.random.default_rng(11)
    points = unit(rng.standard_normal((200, 16)))
    points[20:30] = points[5]  # ten copies of one row: ten zero distances
    points[100:140] = points[40:80]  # forty rows twice
    points[150:160] = -points[0]  # antipodes of a duplicated row
    check(device, "duplicates", points, capsys)
    wide = unit(np.random.default_rng(13).standard_normal((2748, 8)))
    wide[1000:1600] = wide[200:800]  # 600 rows twice: ties across the warps' ranges
    wide[2500:2600] = wide[7]
    check(device, "duplicates across warps", wide, capsys)
    grid = np.array([[x, y] for x in range(12) for y in range(12)], dtype=np.float64)
    check(device, "grid 12x12", grid, capsys)
    check(device, "grid shuffled", grid[np.random.default_rng(3).permutation(len(grid))], capsys)
    check(device, "two points repeated", np.array([[0.0, 0.0], [1.0, 0.0]] * 20), capsys)
    check(device, "one row 50 times", np.ones((50, 8)), capsys)
    check(device, "float32 unit rows", unit(rng.standard_normal((300, 256))).astype(np.float32), capsys)


@pytest.mark.gpu
@needs_gpu
def test_clustered_rows_of_a_synthetic_hour(device, capsys) -> None:
    check(device, "synthetic, 4 speakers", synthetic_rows(5300, speakers=4, seed=7), capsys)


@pytest.mark.gpu
@needs_gpu
def test_the_check_case_proves_it_and_non_finite_rows_are_refused(device) -> None:
    assert linkage.device_proven(device)
    assert device.max_rows >= 15000, f"{device.max_rows} rows: less than 3 hours of clean pairs"
    points = unit(np.random.default_rng(0).standard_normal((10, 4)))
    points[3] = np.nan
    with pytest.raises(ValueError, match="finite values"):
        device(points)
    with pytest.raises(ValueError, match="2 to"):
        device(points[:1])


@pytest.mark.gpu
@needs_gpu
def test_the_linker_links_on_the_device_up_to_its_rows_then_on_the_host() -> None:
    points = synthetic_rows(400, speakers=3, seed=5)
    reference = scipy_linkage(points, method="centroid", metric="euclidean")
    calls = []

    class Counted(gpu_linkage.GpuLinkage):
        def __call__(self, rows: np.ndarray) -> np.ndarray:
            calls.append(len(rows))
            return super().__call__(rows)

    counted = Counted(0)
    assert np.array_equal(linkage.Linker(linkage.COMPILED, device=counted)(points), reference)
    counted.max_rows = 300  # fewer than the points: the host links them
    assert np.array_equal(linkage.Linker(linkage.COMPILED, device=counted)(points), reference)
    assert calls == [400], calls
