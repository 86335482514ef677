"""Everything a server's start-up builds, cached in one directory: `$SPEAKERD_CACHE`.

The server's own files are there already (the default models, converted checkpoints, the
build cache of a GPU engine's choices). The libraries that compile what start-up builds
keep caches of their own elsewhere by default: CuPy its compiled CUDA kernels (under
~/.cupy), numba the clustering's compiled loops (beside the installed package, or under
~). `serve` and `warm` point those into the same directory unless the variable is set, so
one volume mounted at $SPEAKERD_CACHE carries a start's whole work to the next start, on
this node or another one (docs/deployment.md).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

from speakerd.model.store import cache_dir

#: Each library's cache variable -> its folder in the server's cache directory.
LIBRARY_CACHES = {"CUPY_CACHE_DIR": "cupy", "NUMBA_CACHE_DIR": "numba"}


def point_library_caches(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set each of LIBRARY_CACHES not set in `environ` to its folder of cache_dir(), before
    the library reads it (numba on import, CuPy when it compiles); the variables set."""
    folder = cache_dir()
    chosen = {name: str(folder / sub) for name, sub in LIBRARY_CACHES.items() if not environ.get(name)}
    environ.update(chosen)
    return chosen
