"""Bit-for-bit comparison of device arrays, for the replay checks of cuDNN plans (convs.py)
and of captured forwards (capture.py): a CUDA graph serves only if it writes exactly what
the eager execution wrote."""

from __future__ import annotations


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
