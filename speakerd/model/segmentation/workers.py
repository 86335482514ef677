"""The threads a segmentation forward runs on, and BLAS held to one thread meanwhile.

OpenBLAS's own threads cost hundreds of microseconds on each of the LSTM's small matmuls
([32, 128] x [128, 512], 589 per layer and direction) on 2 cores: measured 6 to 14 times
slower than one thread (1.04 ms against 74 us for 32 windows). So while a forward runs,
BLAS gets one thread (threadpoolctl; the limit is process-wide for that time) and the work
is spread over WORKERS Python threads instead: windows of the front end, blocks of a
recording's convolution, the LSTM's two directions (NumPy and BLAS release the GIL).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

#: The LSTM's two directions are independent, and 2 cores is the machine this is measured
#: on (and where pyannote's own CPU timing is taken, docs/segmentation.md). On that machine, shared with other
#: jobs when measured (load average 5 on its 2 cores), 1 and 2 workers took the same time
#: (6.7 s for 60 s of audio, half a core each): the second worker pays only where a second
#: core is idle, and costs nothing where none is.
WORKERS = 2

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_blas: Any = None
T = TypeVar("T")


def spread(function: Callable[..., T], *items: Iterable[Any]) -> list[T]:
    """`map(function, *items)` over the workers, in order."""
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="speakerd-segmentation")
    return list(_pool.map(function, *items))


@contextmanager
def one_blas_thread() -> Iterator[None]:
    """BLAS single-threaded while the block runs (threadpoolctl finds numpy's BLAS once)."""
    global _blas
    from threadpoolctl import ThreadpoolController

    with _lock:
        if _blas is None:
            _blas = ThreadpoolController()
    with _blas.limit(limits=1, user_api="blas"):
        yield
