"""`python -m speakerd.tools.bench_clustering`: the clustering's centroid linkage alone, timed
for an hour's and a 3 h recording's clean pairs, SciPy against the compiled port on the
host's cores and, where a GPU is, with the distances computed there (`gpu`) and wholly on
the device (`device`: engine/gpu/linkage.py).

The rows are what `Diarize` links: unit vectors of 256 dimensions, one per clean (window,
speaker) pair, `--rows` of them (an hour of two-speaker speech tiled from pyannote's
sample.wav keeps 5,273; a 3 h meeting about 15,000) drawn around `--speakers` centres with
the spread of real speaker embeddings (a pair's cosine distance to its own speaker's other
pairs about 0.5, to other speakers' about 1), so the merge loop meets the structure it
meets in a recording. `--rows-file` links rows saved by bench_diarize (`--save`, key
`clean`) instead.

Per size one JSON line: seconds of each variant (best of `--repeat`), the rows, and whether
each linkage matrix equals SciPy's (`np.array_equal`; SciPy runs where `--scipy-max-rows`
allows, since it takes minutes at 3 h) or the first variant's.

  python -m speakerd.tools.bench_clustering --rows 5273 15000
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

import numpy as np

from speakerd.engine.gpu import cuda_available
from speakerd.model.architecture import EMBEDDING_DIM
from speakerd.model.diarization import linkage

#: An hour of two-speaker speech (pyannote's sample.wav tiled to 3,600 s) keeps this many
#: clean (window, speaker) pairs; 3 h of a meeting, about this many.
HOUR_ROWS = 5273
THREE_HOURS_ROWS = 15000
#: Spread of a pair around its speaker's centre, per dimension, against the centres' 1.0:
#: cosine distances within a speaker about 0.5, between speakers about 1.
SPREAD = 0.8
#: SciPy runs up to this many rows by default: 5,273 rows take it about 3 s on one core,
#: 15,000 about 40 s.
SCIPY_MAX_ROWS = 6000


def synthetic_rows(rows: int, speakers: int, seed: int = 0) -> np.ndarray:
    """[rows, 256] float32 unit vectors around `speakers` random centres (module docstring)."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((speakers, EMBEDDING_DIM))
    points = centres[rng.integers(0, speakers, rows)] + SPREAD * rng.standard_normal((rows, EMBEDDING_DIM))
    points = points.astype(np.float32)
    return points / np.linalg.norm(points, axis=1, keepdims=True)


def timed(function: Callable[[], np.ndarray], repeat: int) -> tuple[float, np.ndarray]:
    """(best seconds of `repeat` calls, the last result)."""
    best, result = float("inf"), None
    for _ in range(repeat):
        started = time.perf_counter()
        result = function()
        best = min(best, time.perf_counter() - started)
    assert result is not None
    return best, result


def bench(points: np.ndarray, repeat: int, scipy_max_rows: int) -> dict:
    """One size: every variant's seconds and whether its matrix equals SciPy's."""
    import numba
    from scipy.cluster.hierarchy import linkage as scipy_linkage

    n = points.shape[0]
    record: dict = {"rows": n, "threads": numba.get_num_threads(), "seconds": {}, "equal": {}}
    reference = None
    if n <= scipy_max_rows:
        record["seconds"]["scipy"], reference = timed(
            lambda: scipy_linkage(points, method="centroid", metric="euclidean"), 1
        )
    variants: dict[str, Callable[[], np.ndarray]] = {}
    square: dict[str, float] = {}

    def host() -> np.ndarray:
        started = time.perf_counter()
        distances = linkage.pdist_square(points)
        square["host"] = time.perf_counter() - started
        return linkage.linkage_from_square(distances)

    variants["host"] = host
    if cuda_available()[0]:
        from speakerd.engine.gpu.distances import GpuDistances
        from speakerd.engine.gpu.linkage import GpuLinkage

        device_distances = GpuDistances(0).square

        def gpu() -> np.ndarray:
            started = time.perf_counter()
            distances = device_distances(points)
            square["gpu"] = time.perf_counter() - started
            return linkage.linkage_from_square(distances)

        variants["gpu"] = gpu
        on_device = GpuLinkage(0)
        if on_device.can_implement(n):
            variants["device"] = lambda: on_device(points)
    for name, function in variants.items():
        record["seconds"][name], result = timed(function, repeat)
        if name in square:
            record["seconds"][f"{name}_distances"] = square[name]
        if reference is None:
            reference = result
            record["equal"][name] = "reference"
        else:
            record["equal"][name] = bool(np.array_equal(result, reference))
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[HOUR_ROWS, THREE_HOURS_ROWS])
    parser.add_argument("--speakers", type=int, default=4)
    parser.add_argument("--rows-file", help="an .npz with key 'clean' [n, 256] (bench_diarize --save)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--scipy-max-rows", type=int, default=SCIPY_MAX_ROWS)
    args = parser.parse_args(argv)
    if not linkage.available():
        print("bench_clustering: numba is not installed (pip install 'speakerd[server]')", file=sys.stderr)
        return 2
    started = time.perf_counter()
    proven = linkage.proven_equal_to_scipy()
    print(json.dumps({"compile_and_check_s": round(time.perf_counter() - started, 3), "proven": proven}))
    if args.rows_file:
        sets = [np.load(args.rows_file)["clean"]]
        sets = [rows / np.linalg.norm(rows, axis=1, keepdims=True) for rows in sets]
    else:
        sets = [synthetic_rows(n, args.speakers) for n in args.rows]
    for points in sets:
        print(json.dumps(bench(points, args.repeat, args.scipy_max_rows)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
