"""Everything a server's start-up builds, cached in one directory: `$SPEAKERD_CACHE`.

The server's own files are there already (the default models, converted checkpoints). What
start-up compiles and chooses has a variable of its own, each pointed into the same
directory unless set: CuPy's compiled CUDA kernels ($CUPY_CACHE_DIR, else under ~/.cupy),
numba's compiled clustering loops ($NUMBA_CACHE_DIR, else beside the installed package or
under ~) and the GPU engine's start-up choices ($SPEAKERD_BUILD_CACHE,
engine/build_cache.py). `serve` and `warm` set each one not set, so one volume mounted at
$SPEAKERD_CACHE carries a start's whole work to the next start; where $SPEAKERD_CACHE is
read-only (the image's layer of default models), the three variables name a writable
volume instead (docs/deployment.md).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

from speakerd.engine.build_cache import BUILD_CACHE_VARIABLE, BUILDS_DIR
from speakerd.model.store import cache_dir

#: Each start-up cache's variable -> its folder in the server's cache directory.
START_CACHES = {"CUPY_CACHE_DIR": "cupy", "NUMBA_CACHE_DIR": "numba", BUILD_CACHE_VARIABLE: BUILDS_DIR}


def point_start_caches(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set each of START_CACHES not set in `environ` to its folder of cache_dir(), before
    the library reads it (numba on import, CuPy when it compiles); the variables set."""
    folder = cache_dir()
    chosen = {name: str(folder / sub) for name, sub in START_CACHES.items() if not environ.get(name)}
    environ.update(chosen)
    return chosen
