"""The few CUDA calls that enqueue a batch, made without letting go of the interpreter lock.

Why: CuPy releases the lock around every CUDA call (`with nogil`), which is right for a
call that may block, but enqueueing a batch is a dozen calls of a few microseconds each
(wait for the upload, three input moves, a graph launch, timing events, three result
copies). Each release is a chance for the server's event-loop thread to take the lock,
and the engine thread then waits for it to let go before its next call. On the H200
under `client load` against `serve --receivers 4` the engine threads spent ~7% of their
time in such waits (py-spy --idle --native: pthread_cond_timedwait under CuPy's calls), the
GPU idled 0.9-1.6 ms between batches of 4.6 ms (speakerd_device_gap_seconds), and a wait
that fell between a batch's start event and its launch read as compute (4.58 ms under load,
4.38 in the bench). These calls never block (copies are between device memory and pinned
host memory, so asynchronous), so holding the lock through them costs other threads tens
of microseconds at most.

How: the CUDA driver API through `ctypes.PyDLL`, whose calls keep the lock (ctypes.CDLL
releases it). CuPy's streams, events and graph executables are the driver's handles
(CUstream, CUevent, CUgraphExec: the runtime's types are the same objects), and pinned
host pointers are valid device addresses under unified addressing, so one `cuMemcpyAsync`
serves every direction. The driver needs the device's context current on the calling
thread; CuPy's runtime calls make the primary context current, and `bind` does that once
per thread before a thread's first call here.

Where the driver library or one of these functions cannot be loaded, `AVAILABLE` is False
and each function makes CuPy's call instead: the same work, with the lock let go.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

#: The driver library every CUDA install has (the runtime and CuPy load it too).
DRIVER_LIBRARY = "libcuda.so.1"
#: CUDA_SUCCESS.
SUCCESS = 0


class DriverError(RuntimeError):
    """A driver call failed; the message names the call and CUDA's error name."""


def _load() -> ctypes.PyDLL | None:
    try:
        library = ctypes.PyDLL(DRIVER_LIBRARY)
    except OSError:
        return None
    pointer, size, uint = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint
    signatures = {
        "cuMemcpyAsync": (ctypes.c_uint64, ctypes.c_uint64, size, pointer),
        "cuEventRecord": (pointer, pointer),
        "cuStreamWaitEvent": (pointer, pointer, uint),
        "cuGraphLaunch": (pointer, pointer),
        "cuGetErrorName": (ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)),
    }
    try:
        for name, arguments in signatures.items():
            function = getattr(library, name)
            function.argtypes = arguments
            function.restype = ctypes.c_int
    except AttributeError:  # a driver without one of these: use CuPy's calls
        return None
    return library


_driver = _load()
#: Whether these calls are in use (the driver library loaded with every function).
AVAILABLE = _driver is not None
_bound = threading.local()


def _check(result: int, call: str) -> None:
    if result == SUCCESS:
        return
    name = ctypes.c_char_p()
    assert _driver is not None
    _driver.cuGetErrorName(result, ctypes.byref(name))
    raise DriverError(f"{call}: {(name.value or b'unknown').decode()} ({result})")


def bind(device: int) -> None:
    """Make `device`'s primary context current on this thread (once per thread), so that
    driver calls here find it; CuPy's setDevice does exactly that since CUDA 12."""
    if getattr(_bound, "device", None) == device:
        return
    import cupy

    cupy.cuda.runtime.setDevice(device)
    _bound.device = device


def copy(destination: int, source: int, nbytes: int, stream: Any) -> None:
    """Enqueue a copy of `nbytes` on `stream` (device or pinned host addresses, any direction)."""
    if _driver is None:
        import cupy

        cupy.cuda.runtime.memcpyAsync(
            destination, source, nbytes, cupy.cuda.runtime.memcpyDefault, stream.ptr
        )
        return
    _check(_driver.cuMemcpyAsync(destination, source, nbytes, stream.ptr), "cuMemcpyAsync")


def record(event: Any, stream: Any) -> None:
    """Record CuPy `event` on `stream`."""
    if _driver is None:
        event.record(stream)
        return
    _check(_driver.cuEventRecord(event.ptr, stream.ptr), "cuEventRecord")


def wait(stream: Any, event: Any) -> None:
    """Make `stream` wait for `event` (enqueued; the host does not wait)."""
    if _driver is None:
        stream.wait_event(event)
        return
    _check(_driver.cuStreamWaitEvent(stream.ptr, event.ptr, 0), "cuStreamWaitEvent")


def launch(graph: Any, stream: Any) -> None:
    """Launch CuPy `graph` on `stream` (through CuPy the first time: it instantiates it)."""
    if _driver is None or not graph.graphExec:
        graph.launch(stream)
        return
    _check(_driver.cuGraphLaunch(graph.graphExec, stream.ptr), "cuGraphLaunch")
