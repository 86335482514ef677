"""The clustering's distances on the GPU (speakerd.engine.gpu.distances, kernels/distances.cu)
are SciPy's `pdist(X, "euclidean")`, to the bit, and so the linkage after them is SciPy's.

Rows that span several bands and tiles (the band is cut to a few rows here so a small
matrix crosses many), dimensions that are not a multiple of the kernel's 16-dimension step,
duplicates (zero distances) and float32 input (linked as float64, as SciPy converts it).
Every test prints its numbers (`capsys.disabled`), so a passing device run shows them.

Without a usable GPU these tests skip with the reason (REQUIRE_GPU=1 makes that a failure);
the source check at the top needs no GPU and runs everywhere.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from scipy.cluster.hierarchy import linkage as scipy_linkage
from scipy.spatial.distance import pdist, squareform

from speakerd.engine.gpu import distances as gpu_distances
from speakerd.engine.gpu import kernels
from speakerd.model.diarization import linkage
from speakerd.tools.bench_clustering import synthetic_rows
from tests.test_gpu_fbank import NO_DEVICE

needs_gpu = pytest.mark.skipif(
    NO_DEVICE is not None, reason=f"no usable GPU for the distances kernel: {NO_DEVICE}"
)


def test_launch_shape_matches_the_kernel() -> None:
    source = kernels.kernel_sources()[gpu_distances.SOURCE]
    defines = dict(re.findall(r"#define (\w+) (\d+)", source))
    assert int(defines["TILE"]) == gpu_distances.TILE and int(defines["MICRO"]) == gpu_distances.MICRO
    assert f'"{gpu_distances.KERNEL}"' not in source and f" {gpu_distances.KERNEL}(" in source
    # the intrinsics that are never contracted into an FMA carry SciPy's order of operations
    assert all(name in source for name in ("__dsub_rn", "__dmul_rn", "__dadd_rn", "__dsqrt_rn"))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(
    ("rows", "dim", "band_rows"), [(1, 8, 1), (2, 256, 1), (63, 17, 5), (200, 256, 64), (3000, 256, 700)]
)
def test_square_distances_are_scipys(rows: int, dim: int, band_rows: int, monkeypatch, capsys) -> None:
    monkeypatch.setattr(gpu_distances, "BAND_BYTES", band_rows * rows * 8)
    points = np.ascontiguousarray(synthetic_rows(rows, speakers=3, seed=rows)[:, :dim])
    if rows > 10:
        points[rows // 2] = points[1]  # a duplicate: a zero distance off the diagonal
    ours = gpu_distances.GpuDistances(0).square(points)
    reference = squareform(pdist(points.astype(np.float64)))
    largest = float(np.max(np.abs(ours - reference)))
    with capsys.disabled():
        print(f"\ngpu pdist rows {rows:>5} dim {dim:>3} bands of {band_rows:>4} rows: "
              f"equal {np.array_equal(ours, reference)}, max |diff| {largest:.3g}")  # fmt: skip
    assert np.array_equal(ours, reference)


@pytest.mark.gpu
@needs_gpu
def test_linkage_from_gpu_distances_is_scipys(capsys) -> None:
    points = synthetic_rows(4000, speakers=4, seed=9)
    device = gpu_distances.GpuDistances(0)
    ours = linkage.Linker(linkage.COMPILED, device.square)(points)
    reference = scipy_linkage(points, method="centroid", metric="euclidean")
    with capsys.disabled():
        print(f"\ngpu linkage rows 4000: equal to SciPy's {np.array_equal(ours, reference)}")
    assert np.array_equal(ours, reference)
