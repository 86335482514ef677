"""Bit-for-bit comparison of device arrays, for the replay checks of cuDNN plans (convs.py)
and of captured forwards (capture.py): a CUDA graph serves only if it writes exactly what
the eager execution wrote."""

from __future__ import annotations

import threading


def bits(values):
    """`values` viewed as unsigned integers of its width: equal bits compare equal, NaNs
    included (an FP16 plan timed on out-of-range data has NaNs, identical when the replay is
    right)."""
    import cupy

    return values.view({2: cupy.uint16, 4: cupy.uint32, 8: cupy.uint64}[values.dtype.itemsize])


def replay_matches(captured, stream, y, eager) -> bool:
    """Launch `captured` on `stream` over a NaN-filled `y`; whether it wrote exactly `eager`."""
    import cupy

    y.fill(float("nan"))
    captured.launch(stream)
    return bool(cupy.array_equal(bits(y), bits(eager)))


def compile_in_background(device: int) -> threading.Thread:
    """Start compiling, on a thread, the CuPy kernels `replay_matches` runs for 16- and 32-bit
    words (its comparison and reduction): a fresh machine compiles them for seconds, which
    the first plan check would otherwise wait for (CuPy keeps them in its kernel cache)."""
    import cupy

    def build() -> None:
        with cupy.cuda.Device(device):
            for dtype in (cupy.float16, cupy.float32):
                values = cupy.zeros((2,), dtype=dtype)
                cupy.array_equal(bits(values), bits(values))

    thread = threading.Thread(target=build, name="cupy-compile", daemon=True)
    thread.start()
    return thread
