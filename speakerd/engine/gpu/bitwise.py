"""Bit-for-bit comparison of device arrays, for the replay checks of cuDNN plans (convs.py)
and of captured forwards (capture.py): a CUDA graph serves only if it writes exactly what
the eager execution wrote. The count runs in kernels/compare.cu (why not CuPy's array_equal:
there)."""

from __future__ import annotations

import numpy as np

from speakerd.engine.gpu import kernels

SOURCE = "compare.cu"
#: Threads per block of the count, and the most blocks (a grid-stride loop covers the rest).
THREADS = 256
MAX_BLOCKS = 1024


def bits(values):
    """`values` viewed as unsigned integers of its width: equal bits compare equal, NaNs
    included (an FP16 plan timed on out-of-range data has NaNs, identical when the replay is
    right)."""
    import cupy

    return values.view({2: cupy.uint16, 4: cupy.uint32, 8: cupy.uint64}[values.dtype.itemsize])


def differing(a, b, stream) -> int:
    """How many elements of the device arrays `a` and `b` (one size, one width) differ in
    their bits, counted on `stream` (waits for it)."""
    import cupy

    assert a.size == b.size and a.dtype.itemsize == b.dtype.itemsize, (a.shape, a.dtype, b.shape, b.dtype)
    width = 8 * a.dtype.itemsize
    kernel = kernels.module(SOURCE).get_function(f"count_differing_u{width}")
    with stream:
        count = cupy.zeros((1,), dtype=cupy.uint64)
        if a.size:
            blocks = min(MAX_BLOCKS, -(-a.size // THREADS))
            kernel((blocks,), (THREADS,), (bits(a.ravel()), bits(b.ravel()), np.uint64(a.size), count))
        return int(count.get()[0])


def replay_matches(captured, stream, y, eager) -> bool:
    """Launch `captured` on `stream` over a NaN-filled `y`; whether it wrote exactly `eager`."""
    with stream:
        y.fill(float("nan"))
    captured.launch(stream)
    return differing(y, eager, stream) == 0
