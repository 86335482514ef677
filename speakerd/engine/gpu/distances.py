"""The clustering's pairwise distances on the GPU: SciPy's `pdist(X, "euclidean")` bits, as
the rows of the square matrix the compiled linkage merges in (model/diarization/linkage.py).

Why here: an hour's 5,000-odd clean (window, speaker) pairs are 14 M pairs of 256 float64
dimensions, about 1.5 s of one CPU core in SciPy and a millisecond of an H100's float64
units; the merge loop after it is sequential and stays on the host. kernels/distances.cu
keeps SciPy's order of operations per pair (a - b, squared, added in dimension order, then
the correctly rounded root, no FMA), so the matrix is SciPy's to the bit and the linkage
after it too; tests/test_gpu_distances.py checks both.

How: the rows are uploaded once; the matrix is computed in bands of rows (both triangles:
(i, j) and (j, i) are the same bits) into a device band of at most BAND_BYTES, each band
copied into a page-locked staging buffer while the next is computed, then into the host
matrix's rows by COPY_THREADS threads (one thread's copy into freshly allocated memory runs at
a few GB/s, most of it the kernel clearing the new pages: an hour's 222 MB matrix took 49 ms
end to end with one). Device memory is two bands and the rows, whatever the recording's length.
The work runs on a stream of its own, so the engine's batches on their streams interleave
with its few short kernels rather than wait behind the copy. Importing this module touches
no device: CuPy is imported when a GpuDistances is built.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from speakerd.engine.gpu import kernels

#: kernels/distances.cu and its entry point.
SOURCE = "distances.cu"
KERNEL = "pair_distances"
#: Launch shape; each equals the #define of the same name in kernels/distances.cu.
TILE = 64
MICRO = 4
THREADS = TILE // MICRO
#: Bytes of one band of matrix rows: 32 MiB is about 1.3 ms of PCIe Gen5 copy, long enough
#: to hide the next band's kernel and the host copy behind it, and small beside the engine.
BAND_BYTES = 32 << 20
#: Host threads that move a band from staging into the matrix (NumPy copies release the
#: interpreter lock): enough to keep up with the PCIe copy, few beside a 16-core host's work.
COPY_THREADS = max(1, min(8, (os.cpu_count() or 1) // 2))


class GpuDistances:
    """Square float64 distance matrices of clustering rows, computed on device `device`.
    Safe to call from several threads: one call at a time uses the staging buffers."""

    def __init__(self, device: int) -> None:
        import cupy

        self._cupy = cupy
        self.device = device
        self._lock = threading.Lock()
        with cupy.cuda.Device(device):
            self._stream = cupy.cuda.Stream(non_blocking=True)
            self._kernel = kernels.module(SOURCE).get_function(KERNEL)
        # two page-locked band buffers, kept (64 MiB of host memory); made here, so a server
        # counts them in its start-up baseline
        import cupyx

        self._staging = [cupyx.empty_pinned(BAND_BYTES // 8, dtype=np.float64) for _ in range(2)]
        self._copiers = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="distances-copy")

    def square(self, points: np.ndarray) -> np.ndarray:
        """points [n, dim] (linked as float64, as SciPy converts them) -> [n, n] float64,
        out[i, j] = SciPy's Euclidean distance of rows i and j."""
        cupy = self._cupy
        points = np.ascontiguousarray(points, dtype=np.float64)
        if points.ndim != 2:
            raise ValueError(f"points: expected [rows, dim], got shape {points.shape}")
        n, dim = points.shape
        out = np.empty((n, n), dtype=np.float64)
        if n == 0:
            return out
        band_rows = max(1, min(n, BAND_BYTES // (8 * n)))
        with self._lock, cupy.cuda.Device(self.device), self._stream:
            staging = self._staging
            rows = cupy.asarray(points)
            bands = [cupy.empty((band_rows, n), dtype=np.float64) for _ in range(2)]
            copied = [cupy.cuda.Event(), cupy.cuda.Event()]
            # the band waiting in staging, (slot, first row, last row): moved into `out`
            # while the GPU computes and copies the next one
            pending: tuple[int, int, int] | None = None
            for index, first in enumerate(range(0, n, band_rows)):
                last = min(n, first + band_rows)
                slot = index % 2
                grid = ((n + TILE - 1) // TILE, (last - first + TILE - 1) // TILE)
                self._kernel(
                    grid,
                    (THREADS, THREADS),
                    (rows, np.int32(n), np.int32(dim), np.int32(first), np.int32(last), bands[slot]),
                )
                count = (last - first) * n
                target = staging[slot][:count]
                cupy.cuda.runtime.memcpyAsync(
                    target.ctypes.data, bands[slot].data.ptr, count * 8,
                    cupy.cuda.runtime.memcpyDeviceToHost, self._stream.ptr,
                )  # fmt: skip
                copied[slot].record(self._stream)
                if pending is not None:
                    self._drain(pending, copied, staging, out)
                pending = (slot, first, last)
            if pending is not None:
                self._drain(pending, copied, staging, out)
        return out

    def _drain(
        self, pending: tuple[int, int, int], copied, staging: list[np.ndarray], out: np.ndarray
    ) -> None:
        """Wait for a band's copy into staging, then move it into the host matrix's rows."""
        slot, first, last = pending
        copied[slot].synchronize()
        n = out.shape[1]
        band = staging[slot][: (last - first) * n].reshape(last - first, n)
        cuts = np.linspace(0, last - first, COPY_THREADS + 1).astype(int)

        def copy(part: int) -> None:
            out[first + cuts[part] : first + cuts[part + 1]] = band[cuts[part] : cuts[part + 1]]

        list(self._copiers.map(copy, range(COPY_THREADS)))
