"""The clustering's centroid linkage on the GPU: `scipy.cluster.hierarchy.linkage(X, "centroid",
"euclidean")`'s bits, the distances and the merges both on the device.

Why here: the merge loop is sequential, n - 1 merges each touching every live cluster, and on
a host it waits on memory (an hour's 5,273 rows: a 222 MB matrix read and written row by row,
0.11-0.15 s on a 16-core GPU host whatever its thread count, after 0.03 s of copying the
matrix off the device). On the device the matrix stays where pair_distances (distances.cu)
wrote it, and one block of kernels/linkage.cu's centroid_merges runs the merges: the heap in
shared memory, each merge's per-cluster work spread over 1,024 threads. It occupies one of
the GPU's multiprocessors while it runs, on a stream of its own, so the engine's batches
keep the others.

The port keeps SciPy's operations in SciPy's order (model/diarization/linkage.py is the
reference it follows line for line: the versioned rows, the heap's strict sifts, the first
minimum by index), so the linkage matrix is SciPy's to the bit; tests/test_gpu_linkage.py
checks it against SciPy on random rows, ties and duplicates, and a server proves it on the
seeded check case before using it (model/diarization/linkage.py's `device_proven`).

Memory: the square matrix, 8 n^2 bytes of device memory, and 56 bytes a row of scratch (six
int32, two int64 and two float64 arrays) while a call runs (one at a time: a lock); the heap,
12 bytes a row of shared memory (a float64 value and two 16-bit indices), bounds
the rows one call takes (`max_rows`: about 18,200 on an H100 or H200, more than 3 hours of
speech); beyond it, or when the device memory is not there, `can_implement` says no and the
caller links on the host. Importing this module touches no device.
"""

from __future__ import annotations

import logging
import threading

import numpy as np

from speakerd.engine.gpu import kernels

log = logging.getLogger(__name__)

#: kernels/linkage.cu and kernels/distances.cu, and their entry points.
SOURCE = "linkage.cu"
DISTANCES_SOURCE = "distances.cu"
#: Threads of centroid_merges' one block; equals THREADS in kernels/linkage.cu.
MERGE_THREADS = 1024
#: Warps of initial_neighbors' blocks (one warp a row).
NEIGHBOR_WARPS_PER_BLOCK = 8
#: Bits of the kernels' status word (NONFINITE and NO_NEIGHBOR in kernels/linkage.cu).
NONFINITE, NO_NEIGHBOR = 1, 2
#: Shared memory centroid_merges declares statically, bytes (its per-warp arrays and
#: broadcast values, rounded up): the heap gets the rest of the block's limit.
STATIC_SHARED_BYTES = 1024
#: Heap bytes a row: its value (float64), its key by position and position by key (uint16).
HEAP_BYTES_PER_ROW = 12
#: Fallen bounds of one merge gathered into shared memory, and their bytes (a float64 and an
#: int32 each); LOWERED_SHARED in kernels/linkage.cu.
LOWERED_SHARED = 1024
LOWERED_BYTES = 12 * LOWERED_SHARED
#: Rows one call takes at most: the heap's 16-bit indices (MAX_ROWS in kernels/linkage.cu).
MAX_ROWS = 65535
#: What SciPy's linkage raises for these conditions (scipy/cluster/hierarchy.py and
#: _hierarchy.pyx), word for word, so a caller cannot tell the two apart.
NONFINITE_MESSAGE = "The condensed distance matrix must contain only finite values."
NO_NEIGHBOR_MESSAGE = (
    "find_min_dist cannot find any neighbors closer than inf away. "
    "Check that distances contain no negative/infinite/NaN entries. "
)


class GpuLinkage:
    """Centroid linkage matrices of clustering rows, computed on device `device`. Safe to
    call from several threads: calls take turns."""

    def __init__(self, device: int) -> None:
        import cupy

        self._cupy = cupy
        self.device = device
        self._lock = threading.Lock()
        with cupy.cuda.Device(device):
            limit = cupy.cuda.runtime.deviceGetAttribute(
                cupy.cuda.runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin, device
            )
            #: rows one call takes: its heap fits the block's shared memory
            self.max_rows = min(
                MAX_ROWS, (limit - STATIC_SHARED_BYTES - LOWERED_BYTES) // HEAP_BYTES_PER_ROW + 1
            )
            self._stream = cupy.cuda.Stream(non_blocking=True)
            self._distances = kernels.module(DISTANCES_SOURCE).get_function("pair_distances")
            self._neighbors = kernels.module(SOURCE).get_function("initial_neighbors")
            self._merges = kernels.entry(SOURCE, "centroid_merges", limit - STATIC_SHARED_BYTES)

    def can_implement(self, rows: int) -> bool:
        """True for 2 to `max_rows` rows: the heap fits shared memory (the device memory is
        asked for when a call runs; a call that cannot have it raises MemoryError)."""
        return 2 <= rows <= self.max_rows

    def __call__(self, points: np.ndarray) -> np.ndarray:
        """points [n, dim] (linked as float64, as SciPy converts them) -> Z [n - 1, 4].
        Raises ValueError as SciPy does (non-finite distances), MemoryError when the device
        has not the matrix's memory free (the caller then links on the host)."""
        from speakerd.engine.gpu import distances

        cupy = self._cupy
        points = np.ascontiguousarray(points, dtype=np.float64)
        if points.ndim != 2 or not self.can_implement(points.shape[0]):
            raise ValueError(
                f"points: expected [rows, dim] with 2 to {self.max_rows} rows, got shape {points.shape}"
            )
        n, dim = points.shape
        with self._lock, cupy.cuda.Device(self.device), self._stream:
            try:
                S = cupy.empty((n, n), dtype=np.float64)
                ints = [
                    cupy.empty(n + (MERGE_THREADS // 32 if i == 5 else 0), dtype=np.int32) for i in range(6)
                ]
                longs = [cupy.empty(n, dtype=np.int64) for _ in range(2)]
                doubles = [
                    cupy.empty(n + (MERGE_THREADS // 32 if i == 0 else 0), dtype=np.float64) for i in range(2)
                ]
            except cupy.cuda.memory.OutOfMemoryError as error:
                raise MemoryError(
                    f"the GPU has not {8 * n * n} bytes free for {n} rows' distances"
                ) from error
            version, alive, position, moved, neighbor, lowered_z = ints
            size, cluster_id = longs
            lowered_d, min_dist = doubles
            status = cupy.zeros(1, dtype=np.int32)
            Z = cupy.empty((n - 1, 4), dtype=np.float64)
            rows = cupy.asarray(points)
            tile = distances.TILE
            self._distances(
                ((n + tile - 1) // tile, (n + tile - 1) // tile),
                (distances.THREADS, distances.THREADS),
                (rows, np.int32(n), np.int32(dim), np.int32(0), np.int32(n), S),
            )
            warps = NEIGHBOR_WARPS_PER_BLOCK
            self._neighbors(
                ((n - 1 + warps - 1) // warps,), (32 * warps,), (S, np.int32(n), neighbor, min_dist, status)
            )
            self._merges(
                (1,),
                (MERGE_THREADS,),
                (S, np.int32(n), Z, neighbor, min_dist, version, size, cluster_id, alive, position, moved,
                 lowered_z, lowered_d, status),
                shared_mem=HEAP_BYTES_PER_ROW * (n - 1) + LOWERED_BYTES,
            )  # fmt: skip
            result = Z.get(stream=self._stream)
            flags = int(status.get(stream=self._stream)[0])
            del S, ints, longs, doubles
        if flags & NONFINITE:
            raise ValueError(NONFINITE_MESSAGE)
        if flags & NO_NEIGHBOR:
            raise ValueError(NO_NEIGHBOR_MESSAGE)
        return result
