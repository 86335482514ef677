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
n - k, the update formula's operation order. What differs is only where values live and
which threads compute them:

- The distances are a square float64 matrix (8 n^2 bytes for n rows, as much as SciPy's two
  condensed copies, `pdist`'s and `fast_linkage`'s), updated in place by rows only: merge k
  writes the merged cluster's row and marks it with version k, and a pair's current distance
  is in the row of whichever of the two was merged into last (`_fast_linkage`).
- The loops over clusters walk a list of the live ones, in index order, instead of all n
  indices testing each for size 0; SciPy's four loops after a merge are one update, cut into
  chunks on numba's threads when the live list is long, their effects (heap changes in index
  order, the first nearest candidate) applied in SciPy's order.
- `pdist` runs on every core given (tiles of pairs, each pair's sum still in dimension
  order), or wherever the caller computes it: `centroid_linkage(points, square)` takes a
  matrix made elsewhere (the GPU engine's float64 kernel, engine/gpu/distances.py).
- On a GPU server the whole linkage runs on the device (`Linker.device`: the GPU engine's
  engine/gpu/linkage.py, this loop ported to one CUDA block), where the rows fit it.

Whether the bits are SciPy's is not assumed: `proven_equal_to_scipy` links a seeded case
with ties and duplicates both ways once per process, and callers keep SciPy when it differs
(a SciPy built with FMA contraction, another platform's rounding).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from speakerd.model.diarization import compiled
from speakerd.model.diarization.compiled import available

log = logging.getLogger(__name__)


#: The functions below that numba compiles, and those of them whose loops run in parallel.
#: They are plain Python until `_compile` turns them into numba dispatchers in this module's
#: globals (so their calls to each other are compiled calls): importing this module imports
#: no numba (0.4 s of CPU), only linking does.
_COMPILED_FUNCTIONS = (
    "_pdist_tile", "_heap_swap", "_heap_sift_up", "_heap_sift_down", "_heap_change_value",
    "_distance", "_find_min_dist", "_centroid", "_update_chunk", "_fast_linkage",
)  # fmt: skip
_PARALLEL_FUNCTIONS = ("_pdist_square", "_update_parallel", "_all_finite")
#: numba.prange once compiled; range in the plain Python functions.
prange = range
_compile_lock = threading.Lock()
_compiled = False
#: Held around the compiled calls when numba's threading layer cannot run parallel regions
#: from several threads at once (`_compile`); else no lock.
_parallel_turns: contextlib.AbstractContextManager = contextlib.nullcontext()


def _compile() -> None:
    """compiled.jit on every function of _COMPILED_FUNCTIONS and _PARALLEL_FUNCTIONS (its
    options: cached per machine, the interpreter lock released, NumPy's error model, no
    fastmath, so the bits are SciPy's)."""
    global _compiled, prange
    with _compile_lock:
        if _compiled:
            return
        import numba

        names = globals()
        for name in _COMPILED_FUNCTIONS + _PARALLEL_FUNCTIONS:
            names[name] = compiled.jit(names[name], parallel=name in _PARALLEL_FUNCTIONS)
        prange = numba.prange
        # numba's threading layer is chosen at the first parallel region: TBB or OpenMP take
        # regions from several threads at once (the server's two clustering threads); its
        # own "workqueue" layer does not, and then the compiled calls take turns
        _all_finite(np.zeros((2, 2)))
        if numba.threading_layer() == "workqueue":
            global _parallel_turns
            _parallel_turns = threading.Lock()
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
    with _parallel_turns:
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


def _distance(S, version, a, b):
    """The current distance of clusters a and b: in the row of whichever was merged into
    last (`_fast_linkage`'s versions), either row while neither was."""
    return S[a, b] if version[a] >= version[b] else S[b, a]


def _find_min_dist(S, version, alive, count, position, x):
    """(nearest live cluster above x, its distance): the first minimum by index, strict <,
    as `find_min_dist`; (-1, inf) when none is below inf (where SciPy raises)."""
    current_min = np.inf
    y = -1
    for p in range(position[x] + 1, count):
        i = alive[p]
        dist = _distance(S, version, x, i)
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


#: Live clusters from which a merge's update runs on several threads: a parallel region
#: costs a few microseconds to start, the update about 10 ns a live cluster.
PARALLEL_MIN_LIVE = 2048
#: Chunks of the live list in a parallel update: a few per thread of a 16-core host, so a
#: thread slowed by other work delays little.
UPDATE_CHUNKS = 64


def _update_chunk(S, version, alive, first, last, x, y, d_xy, size_x, size_y, neighbor, min_dist,
                  merged, lowered):  # fmt: skip
    """The merge's update for alive[first:last] (`_fast_linkage`): each z's distance to the
    merged y from its distances to x and y (read from the row of whichever of the pair was
    merged into last), into row y and merged[p]; x's candidates moved to y; lowered[p] set
    where z < y and the new distance is below z's bound. Returns the first minimum over
    z > y in this chunk, (-1, inf) if none."""
    row_x = S[x]
    row_y = S[y]
    version_x = version[x]
    version_y = version[y]
    nearest = -1
    nearest_dist = np.inf
    for p in range(first, last):
        z = alive[p]
        lowered[p] = 0
        if z == x or z == y:  # noqa: SIM109 - two compares, not a tuple, in the compiled loop
            continue
        version_z = version[z]
        to_x = row_x[z] if version_x >= version_z else S[z, x]
        to_y = row_y[z] if version_y >= version_z else S[z, y]
        distance = _centroid(to_x, to_y, d_xy, size_x, size_y)
        row_y[z] = distance
        merged[p] = distance
        if z < y:
            if z < x and neighbor[z] == x:
                neighbor[z] = y
            if distance < min_dist[z]:
                lowered[p] = 1
        elif distance < nearest_dist:
            nearest = z
            nearest_dist = distance
    return nearest, nearest_dist


def _update_parallel(S, version, alive, count, x, y, d_xy, size_x, size_y, neighbor, min_dist,
                     merged, lowered, best_index, best_dist):  # fmt: skip
    """`_update_chunk` over UPDATE_CHUNKS chunks of the live list on numba's threads."""
    for c in prange(UPDATE_CHUNKS):
        first = c * count // UPDATE_CHUNKS
        last = (c + 1) * count // UPDATE_CHUNKS
        best_index[c], best_dist[c] = _update_chunk(
            S, version, alive, first, last, x, y, d_xy, size_x, size_y, neighbor, min_dist, merged, lowered
        )


def _fast_linkage(S: np.ndarray, Z: np.ndarray) -> int:
    """fast_linkage over the square distances S (updated in place) into Z [n-1, 4]. Returns
    0, or -1 where SciPy's find_min_dist raises (no neighbour below inf: NaN or inf
    distances, which `linkage` refuses before getting here).

    Only rows are written: merge k writes the merged cluster y's distances into row y and
    marks y with version k. The current distance of two clusters is then in the row of the
    one with the higher version (`_distance`), and both rows hold it while neither was
    merged into (S starts symmetric). Keeping S symmetric instead would write column y too,
    one cache line per live cluster per merge, which was most of the loop's time (13.9 M
    lines for an hour's 5,273 rows); reading a column entry where the partner is newer
    happens for a few percent of the reads (0.75 M for that hour)."""
    n = Z.shape[0] + 1
    version = np.full(n, -1, dtype=np.int64)
    size = np.ones(n, dtype=np.int64)
    cluster_id = np.arange(n)
    # the live clusters in index order, and each one's place in that list
    alive = np.arange(n)
    position = np.arange(n)
    count = n
    neighbor = np.empty(n - 1, dtype=np.int64)
    min_dist = np.empty(n - 1)
    # a merge's distances of the live clusters to the merged cluster, the lower bounds it
    # lowered, and each chunk's nearest candidate above y
    merged = np.empty(n)
    lowered = np.zeros(n, dtype=np.uint8)
    best_index = np.empty(UPDATE_CHUNKS, dtype=np.int64)
    best_dist = np.empty(UPDATE_CHUNKS)

    for x in range(n - 1):
        y, dist = _find_min_dist(S, version, alive, count, position, x)
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
            if dist == _distance(S, version, x, y):
                break
            y, dist = _find_min_dist(S, version, alive, count, position, x)
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
        # SciPy's four loops after a merge, with the same effects in the same order: every
        # live z gets its distance to the merged y (into row y); for z < x a candidate x
        # becomes y; for z < y a lower bound that fell is marked, then lowered here in z's
        # order (heap changes in SciPy's order); over z > y the first minimum is y's
        # nearest-neighbour candidate (`find_min_dist(y)`). Nothing one z's step reads is
        # written by another's, so the live list is cut into chunks, on several threads
        # when it is long (`_update_parallel`), and their nearest candidates combined in
        # chunk order: the first minimum, as one pass would find it.
        if count >= PARALLEL_MIN_LIVE:
            _update_parallel(S, version, alive, count, x, y, dist, nx, ny, neighbor, min_dist,
                             merged, lowered, best_index, best_dist)  # fmt: skip
            chunks = UPDATE_CHUNKS
        else:
            best_index[0], best_dist[0] = _update_chunk(
                S, version, alive, 0, count, x, y, dist, nx, ny, neighbor, min_dist, merged, lowered
            )
            chunks = 1
        version[y] = k
        nearest = -1
        nearest_dist = np.inf
        for c in range(chunks):
            if best_dist[c] < nearest_dist:
                nearest = best_index[c]
                nearest_dist = best_dist[c]
        for p in range(count):
            if lowered[p]:
                z = alive[p]
                neighbor[z] = y
                min_dist[z] = merged[p]
                _heap_change_value(values, key_by_index, index_by_key, heap_size, z, merged[p])
        # x leaves the live list (x < y always: a heap key's neighbour has a higher index)
        for p in range(position[x], count - 1):
            alive[p] = alive[p + 1]
            position[alive[p]] = p
        count -= 1

        if y < n - 1:
            if nearest == -1:
                return -1
            neighbor[y] = nearest
            min_dist[y] = nearest_dist
            _heap_change_value(values, key_by_index, index_by_key, heap_size, y, nearest_dist)
    return 0


def _all_finite(S: np.ndarray) -> bool:
    """True when no entry above the diagonal (the condensed matrix SciPy checks) is NaN or
    infinite; rows on numba's threads, no temporary."""
    n = S.shape[0]
    bad = 0
    for i in prange(n):
        row = S[i]
        for j in range(i + 1, n):
            if not np.isfinite(row[j]):
                bad += 1
    return bad == 0


def linkage_from_square(distances: np.ndarray) -> np.ndarray:
    """`scipy.cluster.hierarchy.linkage(squareform(distances), "centroid")` for a square,
    symmetric float64 distance matrix, which this overwrites (the merge loop updates it in
    place, as SciPy updates its copy; it is no distance matrix afterwards). Raises ValueError
    as SciPy does."""
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
    _compile()
    with _parallel_turns:
        finite = _all_finite(distances)
    if not finite:
        raise ValueError("The condensed distance matrix must contain only finite values.")
    Z = np.empty((n - 1, 4))
    with _parallel_turns:
        failed = _fast_linkage(distances, Z) != 0
    if failed:
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
    if square is None:
        square = pdist_square(points)  # checks the shape
    return linkage_from_square(square)  # checks the rows and values


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


def equal_on_check_case(link: Callable[[np.ndarray], np.ndarray], what: str, instead: str) -> bool:
    """True when `link` gives SciPy's linkage matrix of `proof_points` to the bit; else a
    WARNING naming `what` and what is used `instead`, with how many merges differ."""
    from scipy.cluster.hierarchy import linkage

    points = proof_points()
    ours = link(points)
    scipy = linkage(points, method="centroid", metric="euclidean")
    if np.array_equal(ours, scipy):
        return True
    differ = int(np.sum(np.any(ours != scipy, axis=1)))
    log.warning("clustering: %s differs from this SciPy's on its check case (%d of %d merges); %s",
                what, differ, len(scipy), instead)  # fmt: skip
    return False


@functools.cache
def _proven() -> bool:
    return equal_on_check_case(
        centroid_linkage, "the compiled centroid linkage", "linking with SciPy instead"
    )


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


class DeviceLinkage(Protocol):
    """The whole linkage on a device (the GPU engine's engine/gpu/linkage.py): points [n, dim]
    -> SciPy's linkage matrix, for the row counts `can_implement` accepts; MemoryError when
    the device has not the memory for a call (the caller links on the host instead)."""

    #: the most rows one call takes
    max_rows: int

    def can_implement(self, rows: int) -> bool: ...

    def __call__(self, points: np.ndarray) -> np.ndarray: ...


def device_proven(device: DeviceLinkage) -> bool:
    """True when `device` gives SciPy's linkage matrix to the bit on the seeded check case
    (`proof_points`, as the compiled port is checked); a server uses it only then."""
    if not device.can_implement(PROOF_ROWS):
        return False
    return equal_on_check_case(device, "the device's centroid linkage", "linking on the host instead")


#: points [n, dim] -> SciPy's linkage matrix of `linkage(points, "centroid", "euclidean")`: a
#: Linker, or anything called like one (diarize times its Linker's calls through one).
Link = Callable[[np.ndarray], np.ndarray]

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
    #: the whole linkage on a device, proven equal to SciPy (`device_proven`): used for the
    #: row counts it can implement, the host's port for the others
    device: DeviceLinkage | None = None

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
        device = self.device if self.implementation == COMPILED else None
        if device is not None and device.can_implement(len(points)):
            try:
                return device(points)
            except MemoryError as error:
                log.warning("clustering: %s; linking %d rows on the host", error, len(points))
        if not self.compiled:
            from scipy.cluster.hierarchy import linkage

            return linkage(points, method="centroid", metric="euclidean")
        square = None
        if self.distances is not None:
            square = self.distances(points)
        elif self.threads:
            import numba  # compiled by now: `compiled` proved the port

            # numba's thread count is the calling thread's own setting
            numba.set_num_threads(min(self.threads, numba.config.NUMBA_NUM_THREADS))
        return centroid_linkage(points, square)


#: The compiled port on the host's cores: what the NumPy pipeline uses unless told otherwise.
HOST = Linker()
