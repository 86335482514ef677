"""SciPy's centroid linkage, the same bits, compiled: `linkage(X, "centroid", "euclidean")`.

pyannote's agglomerative clustering (clustering.py) and VBx's initialisation (vbx.py) link the
clean embeddings with `scipy.cluster.hierarchy.linkage(points, "centroid", "euclidean")`. SciPy
does it in two steps, both single-threaded and both quadratic or worse:

1. `pdist` (scipy/spatial/src/distance_metrics.h, `EuclideanDistance`): the rows as float64;
   for each pair (i < j) in row-major order, sum |x_ik - x_jk|^2 over k = 0, 1, ... in that
   order, starting from 0.0, then the square root. No fused multiply-add on x86-64 (SciPy's
   wheels are built for a baseline without FMA).
2. `_hierarchy.fast_linkage` (Müllner's generic algorithm, SciPy 1.17's _hierarchy.pyx):
   each cluster x keeps a candidate nearest neighbour among the clusters of higher index and
   a lower bound of its distance in a binary heap (_structures.pxi's `Heap`); the heap's
   minimum is merged once its candidate's distance is still the bound, else the candidate is
   searched again; the merged pair's distances to the others follow the Lance-Williams
   centroid formula on plain distances (_hierarchy_distance_update.pxi's `_centroid`).

This module does the same operations in the same order, so the linkage matrix is SciPy's to
the bit (merge order, heights, counts), ties included: the heap, its sift rules (strict
comparisons), the candidate search's first minimum by index, the re-search loop bounded by
n - k, the update formula's operation order. What differs is only where values live:

- The distances are the condensed upper triangle, as SciPy's (4 n^2 bytes for n rows, where
  SciPy holds the condensed matrix twice: `pdist`'s and `fast_linkage`'s working copy).
- The loops over clusters walk a compact list of the live ones, in index order, instead of
  all n indices testing each for size 0; the order of every comparison and heap operation is
  unchanged, so is the result.
- `pdist` runs on every core given (rows in parallel, each pair's sum still in order), or
  wherever the caller computes it: `centroid_linkage(distances=...)` takes a condensed
  matrix made elsewhere (the GPU engine's float64 kernel, engine/gpu/distances.py).

Whether the bits are SciPy's is not assumed: `proven_equal_to_scipy` links a seeded case
with ties and duplicates both ways once per process, and callers keep SciPy when it differs
(a SciPy built with FMA contraction, another platform's rounding).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

#: Bytes the compiled linkage holds per squared row: the condensed float64 distances,
#: n(n-1)/2 of them, updated in place (the per-cluster arrays are O(n)). SciPy's own
#: `linkage` holds 8 n^2 (`pdist`'s matrix and `fast_linkage`'s copy).
CONDENSED_BYTES_PER_ROW_SQUARED = 4


def available() -> bool:
    """True when the compiled linkage can run here (numba is installed)."""
    return importlib.util.find_spec("numba") is not None


#: The functions below that numba compiles, and those of them whose loops run in parallel.
#: They are plain Python until `_compile` turns them into numba dispatchers in this module's
#: globals (so their calls to each other are compiled calls): importing this module imports
#: no numba (0.4 s of CPU), only linking does.
_COMPILED_FUNCTIONS = (
    "_pdist_tile", "_heap_swap", "_heap_sift_up", "_heap_sift_down", "_heap_change_value",
    "_find_min_dist", "_centroid", "_fast_linkage",
)  # fmt: skip
_PARALLEL_FUNCTIONS = ("_pdist_square",)
#: numba.prange once compiled; range in the plain Python functions.
prange = range
_compile_lock = threading.Lock()
_compiled = False


def _compile() -> None:
    """numba.njit on every function of _COMPILED_FUNCTIONS, with the options they share:
    compiled once per machine (cache=True keeps the machine code beside the module or in
    numba's user cache), no Python objects, the interpreter lock released, and NumPy's error
    model (a division by zero gives inf, never an exception; sizes are never zero here). No
    fastmath: every floating-point operation stays as written, in the order written, so the
    bits are SciPy's."""
    global _compiled, prange
    with _compile_lock:
        if _compiled:
            return
        import numba

        names = globals()
        for name in _COMPILED_FUNCTIONS + _PARALLEL_FUNCTIONS:
            names[name] = numba.njit(
                cache=True, nogil=True, error_model="numpy", parallel=name in _PARALLEL_FUNCTIONS
            )(names[name])
        prange = numba.prange
        _compiled = True


# --- pdist, as the rows of a square matrix ------------------------------------------------


#: A tile of `_pdist_tile`: ROWS x COLUMNS pairs whose sums stay in registers and L1 while
#: the dimensions stream past; COLUMNS float64 are 8 AVX-512 (16 AVX2) vectors of pairs.
TILE_ROWS = 4
TILE_COLUMNS = 64
#: Tile side of the lower triangle's copy: 64 x 64 float64 (32 KB) stays in L1 while it is
#: read by rows and written by columns.
MIRROR_TILE = 64


def _pdist_tile(points, columns, out, i0, j0):
    """out[i0:i0+TILE_ROWS, j0:j0+TILE_COLUMNS] = SciPy's distances: per pair, |a - b|
    squared summed over the dimensions in order from 0.0, then sqrt. columns is points
    transposed ([dim, n]), so the innermost loop runs over pairs: vector lanes hold different
    pairs, never parts of one sum, and each sum keeps its order."""
    n, dim = points.shape
    sums = np.zeros((TILE_ROWS, TILE_COLUMNS))
    width = min(TILE_COLUMNS, n - j0)
    height = min(TILE_ROWS, n - i0)
    if width == TILE_COLUMNS and height == TILE_ROWS:  # constant trip counts: vectorised
        for k in range(dim):
            column = columns[k, j0 : j0 + TILE_COLUMNS]
            for r in range(TILE_ROWS):
                a = points[i0 + r, k]
                row = sums[r]
                for c in range(TILE_COLUMNS):
                    difference = a - column[c]
                    row[c] = row[c] + difference * difference
    else:
        for k in range(dim):
            for r in range(height):
                a = points[i0 + r, k]
                for c in range(width):
                    difference = a - columns[k, j0 + c]
                    sums[r, c] = sums[r, c] + difference * difference
    for r in range(height):
        for c in range(width):
            out[i0 + r, j0 + c] = np.sqrt(sums[r, c])


def _pdist_square(points: np.ndarray, columns: np.ndarray, out: np.ndarray) -> None:
    """out[i, j] = SciPy's distance(i, j) for all i, j: the upper triangle in tiles
    (`_pdist_tile`), row groups spread over the threads, then the lower triangle copied from
    it in tiles: (i, j) and (j, i) are the same bits, as a - b is exactly -(b - a)."""
    n = points.shape[0]
    for g in prange((n + TILE_ROWS - 1) // TILE_ROWS):
        i0 = g * TILE_ROWS
        for j0 in range((i0 // TILE_COLUMNS) * TILE_COLUMNS, n, TILE_COLUMNS):
            _pdist_tile(points, columns, out, i0, j0)
    for t in prange((n + MIRROR_TILE - 1) // MIRROR_TILE):
        j0 = t * MIRROR_TILE
        for i0 in range(0, j0 + 1, MIRROR_TILE):
            for j in range(j0, min(j0 + MIRROR_TILE, n)):
                for i in range(i0, min(i0 + MIRROR_TILE, j)):
                    out[j, i] = out[i, j]


def pdist_square(points: np.ndarray) -> np.ndarray:
    """`squareform(scipy.spatial.distance.pdist(points, "euclidean"))`, the same bits, on
    the threads numba is given (`numba.set_num_threads`, NUMBA_NUM_THREADS)."""
    points = np.ascontiguousarray(points, dtype=np.float64)
    if points.ndim != 2:
        raise ValueError(f"points: expected [rows, dim], got shape {points.shape}")
    out = np.empty((points.shape[0], points.shape[0]), dtype=np.float64)
    _compile()
    _pdist_square(points, np.ascontiguousarray(points.T), out)
    return out


# --- the heap (_structures.pxi's Heap: keys 0..size-1, values, strict sift comparisons) ----


def _heap_swap(values, key_by_index, index_by_key, i, j):
    value = values[i]
    values[i] = values[j]
    values[j] = value
    key_i = key_by_index[i]
    key_j = key_by_index[j]
    key_by_index[i] = key_j
    key_by_index[j] = key_i
    index_by_key[key_i] = j
    index_by_key[key_j] = i


def _heap_sift_up(values, key_by_index, index_by_key, index):
    parent = (index - 1) >> 1
    while index > 0 and values[parent] > values[index]:
        _heap_swap(values, key_by_index, index_by_key, index, parent)
        index = parent
        parent = (index - 1) >> 1


def _heap_sift_down(values, key_by_index, index_by_key, size, index):
    child = (index << 1) + 1
    while child < size:
        if child + 1 < size and values[child + 1] < values[child]:
            child += 1
        if values[index] > values[child]:
            _heap_swap(values, key_by_index, index_by_key, index, child)
            index = child
            child = (index << 1) + 1
        else:
            break


def _heap_change_value(values, key_by_index, index_by_key, size, key, value):
    index = index_by_key[key]
    old_value = values[index]
    values[index] = value
    if value < old_value:
        _heap_sift_up(values, key_by_index, index_by_key, index)
    else:
        _heap_sift_down(values, key_by_index, index_by_key, size, index)


# --- fast_linkage ---------------------------------------------------------------------------


def _find_min_dist(S, alive, count, position, x):
    """(nearest live cluster above x, its distance): the first minimum by index, strict <,
    as `find_min_dist`; (-1, inf) when none is below inf (where SciPy raises)."""
    current_min = np.inf
    y = -1
    row = S[x]
    for p in range(position[x] + 1, count):
        i = alive[p]
        dist = row[i]
        if dist < current_min:
            current_min = dist
            y = i
    return y, current_min


def _centroid(d_xi, d_yi, d_xy, size_x, size_y):
    """_hierarchy_distance_update.pxi's `_centroid`, operation for operation: C's int * double
    promotes the size, size_x * size_y multiplies as ints first, and the divisions by the
    merged size are by its double."""
    merged = np.float64(size_x + size_y)
    spread = (np.float64(size_x) * d_xi) * d_xi + (np.float64(size_y) * d_yi) * d_yi
    return np.sqrt((spread - ((np.float64(size_x * size_y) * d_xy) * d_xy) / merged) / merged)


def _fast_linkage(S: np.ndarray, Z: np.ndarray) -> int:
    """fast_linkage over the square distances S (updated in place, kept symmetric) into
    Z [n-1, 4]. Returns 0, or -1 where SciPy's find_min_dist raises (no neighbour below inf:
    NaN or inf distances, which `linkage` refuses before getting here)."""
    n = Z.shape[0] + 1
    size = np.ones(n, dtype=np.int64)
    cluster_id = np.arange(n)
    # the live clusters in index order, and each one's place in that list
    alive = np.arange(n)
    position = np.arange(n)
    count = n
    neighbor = np.empty(n - 1, dtype=np.int64)
    min_dist = np.empty(n - 1)

    for x in range(n - 1):
        y, dist = _find_min_dist(S, alive, count, position, x)
        if y == -1:
            return -1
        neighbor[x] = y
        min_dist[x] = dist

    # Heap(min_dist): keys 0..n-2, heapified bottom-up
    heap_size = n - 1
    values = min_dist.copy()
    key_by_index = np.arange(n - 1)
    index_by_key = np.arange(n - 1)
    for i in range(heap_size // 2 - 1, -1, -1):
        _heap_sift_down(values, key_by_index, index_by_key, heap_size, i)

    x = 0
    y = 0
    dist = 0.0
    for k in range(n - 1):
        for _ in range(n - k):
            x = key_by_index[0]
            dist = values[0]
            y = neighbor[x]
            if dist == S[x, y]:
                break
            y, dist = _find_min_dist(S, alive, count, position, x)
            if y == -1:
                return -1
            neighbor[x] = y
            min_dist[x] = dist
            _heap_change_value(values, key_by_index, index_by_key, heap_size, x, dist)
        # remove_min
        _heap_swap(values, key_by_index, index_by_key, 0, heap_size - 1)
        heap_size -= 1
        _heap_sift_down(values, key_by_index, index_by_key, heap_size, 0)

        id_x = cluster_id[x]
        id_y = cluster_id[y]
        nx = size[x]
        ny = size[y]
        if id_x > id_y:
            id_x, id_y = id_y, id_x
        Z[k, 0] = id_x
        Z[k, 1] = id_y
        Z[k, 2] = dist
        Z[k, 3] = nx + ny

        size[x] = 0
        size[y] = nx + ny
        cluster_id[y] = n + k
        # x leaves the live list (x < y always: a heap key's neighbour has a higher index)
        for p in range(position[x], count - 1):
            alive[p] = alive[p + 1]
            position[alive[p]] = p
        count -= 1

        # the merged cluster's distances (row y, and column y for the rows that read it)
        row_x = S[x]
        row_y = S[y]
        for p in range(count):
            z = alive[p]
            if z != y:
                distance = _centroid(row_x[z], row_y[z], dist, nx, ny)
                row_y[z] = distance
                S[z, y] = distance

        # reassign neighbour candidates from x to y
        for p in range(count):
            z = alive[p]
            if z >= x:
                break
            if neighbor[z] == x:
                neighbor[z] = y

        # update lower bounds of distance
        for p in range(count):
            z = alive[p]
            if z >= y:
                break
            distance = row_y[z]
            if distance < min_dist[z]:
                neighbor[z] = y
                min_dist[z] = distance
                _heap_change_value(values, key_by_index, index_by_key, heap_size, z, distance)

        # find the nearest neighbour for y
        if y < n - 1:
            z, distance = _find_min_dist(S, alive, count, position, y)
            if z == -1:
                return -1
            neighbor[y] = z
            min_dist[y] = distance
            _heap_change_value(values, key_by_index, index_by_key, heap_size, y, distance)
    return 0


def linkage_from_square(distances: np.ndarray) -> np.ndarray:
    """`scipy.cluster.hierarchy.linkage(squareform(distances), "centroid")` for a square,
    symmetric float64 distance matrix, which this overwrites (the merge loop updates it in
    place, as SciPy updates its copy). Raises ValueError as SciPy does."""
    if (
        distances.dtype != np.float64
        or distances.ndim != 2
        or distances.shape[0] != distances.shape[1]
        or not distances.flags.c_contiguous
    ):
        raise ValueError(
            f"distances: expected a contiguous square float64 matrix, got {distances.dtype} {distances.shape}"
        )
    n = distances.shape[0]
    if n < 2:
        raise ValueError(f"points: at least 2 rows are needed for a linkage, got {n}")
    if not np.all(np.isfinite(distances)):
        raise ValueError("The condensed distance matrix must contain only finite values.")
    Z = np.empty((n - 1, 4))
    _compile()
    if _fast_linkage(distances, Z) != 0:
        raise ValueError(
            "find_min_dist cannot find any neighbors closer than inf away. "
            "Check that distances contain no negative/infinite/NaN entries. "
        )
    return Z


def centroid_linkage(points: np.ndarray, square: np.ndarray | None = None) -> np.ndarray:
    """`scipy.cluster.hierarchy.linkage(points, "centroid", "euclidean")`, the same bits.

    points [n, dim] (any float dtype; linked as float64, as SciPy converts them); square:
    their square Euclidean distance matrix when the caller computed it elsewhere (the GPU),
    consumed; else `pdist_square` computes it here. Raises ValueError as SciPy does for
    fewer than 2 rows or non-finite values."""
    points = np.asarray(points)
    if points.ndim != 2:
        raise ValueError(f"points: expected [rows, dim], got shape {points.shape}")
    if points.shape[0] < 2:
        raise ValueError(f"points: at least 2 rows are needed for a linkage, got {points.shape[0]}")
    if square is None:
        square = pdist_square(points)
    return linkage_from_square(square)


#: A seeded case for `proven_equal_to_scipy`: unit rows in 3 tight groups (centroid heights
#: that rise and fall), exact duplicates and a row repeated four times (equal distances:
#: the heap's and the candidate search's tie rules decide the merge order).
PROOF_ROWS = 300
PROOF_DIM = 16
PROOF_SEED = 20261207


def proof_points() -> np.ndarray:
    rng = np.random.default_rng(PROOF_SEED)
    centres = rng.standard_normal((3, PROOF_DIM))
    points = centres[rng.integers(0, 3, PROOF_ROWS)] + 0.3 * rng.standard_normal((PROOF_ROWS, PROOF_DIM))
    points[10:14] = points[3]
    points[100:110] = points[50:60]
    points = points.astype(np.float32)
    return points / np.linalg.norm(points, axis=1, keepdims=True)


_proof_lock = threading.Lock()


@functools.cache
def _proven() -> bool:
    from scipy.cluster.hierarchy import linkage

    points = proof_points()
    ours = centroid_linkage(points)
    scipy = linkage(points, method="centroid", metric="euclidean")
    if np.array_equal(ours, scipy):
        return True
    differ = int(np.sum(np.any(ours != scipy, axis=1)))
    log.warning(
        "clustering: the compiled centroid linkage differs from this SciPy's on its check case "
        "(%d of %d merges); linking with SciPy instead",
        differ,
        len(scipy),
    )
    return False


def proven_equal_to_scipy() -> bool:
    """True when the compiled linkage runs here and gave SciPy's linkage matrix to the bit
    on the seeded check case (compiled and checked once per process, on first call: a few
    seconds to compile the first time on a machine, a fraction of one from numba's cache)."""
    if not available():
        return False
    with _proof_lock:
        return _proven()


#: points [n, dim] -> their square float64 Euclidean distance matrix [n, n], SciPy's bits
#: (pdist_square here, or the GPU engine's engine/gpu/distances.py).
SquareDistances = Callable[[np.ndarray], np.ndarray]
#: `Linker.implementation` values: this module's port, or SciPy's own `linkage` (the reference,
#: `serve --linkage scipy` to check a server against it).
COMPILED = "compiled"
SCIPY = "scipy"
IMPLEMENTATIONS = (COMPILED, SCIPY)


@dataclass(frozen=True)
class Linker:
    """How the clustering computes `linkage(points, "centroid", "euclidean")`: the compiled
    port (distances from `distances`, else `pdist_square` on the host's cores) where it
    proved equal to this SciPy, else SciPy itself. Every choice gives SciPy's bits."""

    implementation: str = COMPILED
    distances: SquareDistances | None = None
    #: host threads of `pdist_square` (the CPU engine's --cpu-threads); None: numba's default,
    #: every core. Unused when `distances` is given.
    threads: int | None = None

    def __post_init__(self) -> None:
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(
                f"linkage implementation {self.implementation!r}, expected one of {IMPLEMENTATIONS}"
            )

    @property
    def compiled(self) -> bool:
        """True when calls run the compiled port (numba there and proven equal to SciPy)."""
        return self.implementation == COMPILED and proven_equal_to_scipy()

    def __call__(self, points: np.ndarray) -> np.ndarray:
        if not self.compiled:
            from scipy.cluster.hierarchy import linkage

            return linkage(points, method="centroid", metric="euclidean")
        points = np.asarray(points)
        square = None
        if self.distances is not None and points.ndim == 2 and points.shape[0] >= 2:
            square = self.distances(points)
        elif self.threads:
            import numba  # compiled by now: `compiled` proved the port

            # numba's thread count is the calling thread's own setting
            numba.set_num_threads(min(self.threads, numba.config.NUMBA_NUM_THREADS))
        return centroid_linkage(points, square)


#: The compiled port on the host's cores: what the NumPy pipeline uses unless told otherwise.
HOST = Linker()
