"""Streams for GPU tests that see what the test enqueued before them.

A test builds its operands with CuPy on the legacy default stream (`cupy.random`,
`cupy.full_like`, a float64 reference convolution), then launches the kernel under test on
a non-blocking stream, as the engine does. A non-blocking stream does not wait for the
default stream: without an explicit order the kernel may run before its inputs are written,
or, the case that bit us, a NaN fill of the output queued behind a slow reference lands
after the kernel has written it, so a correct kernel reads as all-NaN.
"""

from __future__ import annotations


def ordered_stream():
    """A non-blocking stream whose work starts after everything already enqueued on the
    legacy default stream (an event recorded there, waited on here)."""
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    stream.wait_event(cupy.cuda.Stream.null.record())
    return stream
