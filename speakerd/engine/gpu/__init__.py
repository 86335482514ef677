"""CuPy + cuDNN frontend GPU engine.

Importing this package imports nothing heavy: `gpu_available` probes CuPy, a device and
the cuDNN frontend lazily so a CPU-only server can ask without paying for (or failing on)
CUDA imports.
"""

from __future__ import annotations


def cuda_available() -> tuple[bool, str]:
    """(True, "") when CuPy sees a CUDA device; else (False, why). Enough for the kernels of
    our own (the clustering's), which need no cuDNN. Never raises."""
    try:
        import cupy
    except Exception as error:  # ImportError, or a CUDA library that fails to load
        return False, f"CuPy is not importable ({type(error).__name__}: {error})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # no driver, or a driver/runtime mismatch
        return False, f"no CUDA device ({type(error).__name__}: {error})"
    return (True, "") if count >= 1 else (False, "CUDA reports 0 devices")


def gpu_available() -> tuple[bool, str]:
    """(True, device name) when CuPy sees a CUDA device and the cuDNN frontend loads; else
    (False, why). Never raises: the engine factory calls it to choose between GPU and CPU."""
    found, why = cuda_available()
    if not found:
        return False, why
    import cupy

    try:
        import cudnn
    except Exception as error:
        return False, f"the cuDNN frontend (nvidia-cudnn-frontend) is not importable ({error})"
    try:
        version = cudnn.backend_version()
        name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    except Exception as error:  # libcudnn missing from the library path
        return False, f"cuDNN backend not loadable ({type(error).__name__}: {error})"
    return True, f"{name}, cuDNN {version}"
