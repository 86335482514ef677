"""numba, where it is installed: the loops of the diarization that NumPy cannot vectorise
(the centroid linkage's merges, the overlap-add of windows onto frames) compiled to machine
code, with the options they all share.

Every compiled function is plain Python until `jit` compiles it, so importing a module that
has one imports no numba (0.4 s of CPU); the first call compiles it for its argument types
(a fraction of a second from numba's cache, a few seconds the first time on a machine). Each
has a NumPy or SciPy counterpart it is tested against, which callers use where numba is not
installed.
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Callable
from typing import Any

_lock = threading.Lock()
_jitted: dict[tuple[Callable[..., Any], bool], Callable[..., Any]] = {}


def available() -> bool:
    """True when numba is installed, so `jit` can compile."""
    return importlib.util.find_spec("numba") is not None


def jit(function: Callable[..., Any], parallel: bool = False) -> Callable[..., Any]:
    """numba.njit of `function`, made once per process: cached on disk (cache=True keeps the
    machine code beside the module or in numba's user cache), no Python objects, the
    interpreter lock released (a server's other threads run meanwhile), NumPy's error model
    (a division by zero gives inf, never an exception), loops marked numba.prange run on
    numba's threads when `parallel`. No fastmath: every floating-point operation stays as
    written, in the order written, so the results are the NumPy or SciPy counterpart's bits."""
    with _lock:
        key = (function, parallel)
        if key not in _jitted:
            import numba

            _jitted[key] = numba.njit(cache=True, nogil=True, error_model="numpy", parallel=parallel)(
                function
            )
        return _jitted[key]
