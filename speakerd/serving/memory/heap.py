"""The server's memory between requests: freed buffers kept (glibc), and the objects that
live as long as the process kept out of the garbage collector's full passes.

keep_freed_memory: keep freed heap memory in the process instead of handing it back to
the kernel.

Why: a process that receives 32-chunk requests through gRPC allocates and frees buffers of
~10 MB for every message. glibc's malloc serves such sizes with fresh mmap()s or trims them
off the top of the heap when they are freed, so the next message faults every page in
again, and the kernel zeroes each one. Measured on a 2-core CI machine with gRPC 1.85
(a server answering 10.4 MB unary calls from 4 streams of one connection): 1,676 minor page
faults and 12.2 ms of CPU per call by default, 133 faults and 10.4 ms with the settings
below; 103 and 112 calls/s (three more pairs of runs: 93-108 against 116-118). Later, on
the same machine under other load, three more pairs: 2,216-2,562 faults, 18.9-20.0 ms and
63-67 calls/s by default against 154-176 faults, 13.0-13.8 ms and 85-91 calls/s. The
receivers of `serve --receivers` and the server process pay that on every request.

What it costs: memory freed during a burst stays with the process while calls keep
coming. So that it does not stay for good, `give_back` (malloc_trim) returns every free
page to the kernel once the server has been idle for a moment (service.py calls it), and
malloc is held to MALLOC_ARENAS arenas: glibc gives each thread that allocates under
contention an arena of its own (up to 8 per core), and memory freed in one arena is never
reused by another, so each flood of requests landing on other threads (decode, engine,
gRPC's) raised the peak again. Measured on a 2-core CI machine before the cap and the trim
(issue 33): peaks of 602, 724 and 791 MB over three identical floods, and 1.35-1.66 GB
still resident 10 s after 16 refused 39 MiB messages.

Elsewhere than glibc (no `mallopt`), nothing changes.

freeze_long_lived: after the start-up, move every object alive then (the model, the
engine and its plans, gRPC, NumPy, CuPy: the bulk of the heap) into the collector's
permanent generation (`gc.freeze`). Why: a full collection walks every tracked object with
the interpreter lock held, so every thread stops, the GPU engine's threads too. Measured on
the H200 (`serve --receivers 4`, FP16, 20 s of 16 x 32-chunk load, every batch's timeline
recorded): three full collections of 25, 40 and 58 ms, and the 58 ms one left the GPU idle
for 54 ms. Frozen objects are never collected (they live as long as the process anyway),
and a full pass walks only what requests made since.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging

log = logging.getLogger(__name__)

#: mallopt parameters (glibc's malloc.h).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
#: malloc arenas: two, so that threads allocating at once seldom wait for each other's
#: lock, and freed memory is found again by the next request (see the module docstring).
MALLOC_ARENAS = 2
#: Allocations below this come from the heap, not a fresh mmap() each time: the largest
#: value glibc accepts on 64-bit (HEAP_MAX / 2), above a 32-chunk request (~10.4 MB).
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
#: Free memory at the heap's top is given back to the kernel only above this: several
#: requests' worth, so a burst's buffers are reused rather than faulted in again.
TRIM_THRESHOLD_BYTES = 512 * 1024 * 1024


def _libc_function(name: str):  # type: ignore[no-untyped-def]
    """glibc's `name` (mallopt, malloc_trim), or None elsewhere."""
    library = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(library), name) if library else None
    except (OSError, AttributeError):
        return None


def keep_freed_memory() -> bool:
    """Apply the settings above to this process's malloc (call it before the process starts
    its threads: the arena cap applies to arenas made after it); False where it is not
    glibc's."""
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        log.debug("no glibc mallopt here; malloc keeps its defaults")
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # mallopt returns 1 on success, 0 on error
    return (
        bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
        and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
        and bool(mallopt(M_ARENA_MAX, MALLOC_ARENAS))
    )


def give_back() -> bool:
    """Return the free pages of every malloc arena to the kernel (glibc's malloc_trim(0));
    True when some were. It walks the arenas under their locks: call it when idle, off the
    event loop."""
    trim = _libc_function("malloc_trim")
    if trim is None:
        return False
    trim.argtypes, trim.restype = (ctypes.c_size_t,), ctypes.c_int
    return bool(trim(0))


def freeze_long_lived() -> int:
    """Collect once, then freeze every object left (see the module docstring); returns the
    number of objects frozen so far in this process."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
