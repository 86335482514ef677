"""The final linear's cuBLAS, called through ctypes on a handle bound to our stream.

Why not CuPy's wrapper (`cupy_backends.cuda.libs.cublas`): every call there re-binds the
handle to CuPy's *current* stream (the legacy stream unless the caller is inside
`with stream:`), which raced our non-blocking stream and gave wrong embeddings on the
H200, and it refuses to run during stream capture at all ("calling cuBLAS API during
stream capture is currently unsupported"). cuBLAS itself captures fine. So the handle is
created, bound and used here, all through the library CuPy already loaded (so there is
exactly one cuBLAS in the process).
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

#: cuBLAS library sonames tried when none is loaded yet (CUDA 13, then 12).
SONAMES = ("libcublas.so.13", "libcublas.so.12", "libcublas.so")
#: CUBLAS_DEFAULT_MATH never uses TF32 (cublasMath_t = 0): the linear stays strict FP32.
CUBLAS_DEFAULT_MATH = 0
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
#: cuBLAS workspace given to the handle (cublasSetWorkspace): the size NVIDIA recommends
#: for Hopper. Without a user workspace cuBLAS may pick other algorithms while a stream
#: is being captured than when it runs eagerly, and a captured linear must replay eager's bits.
WORKSPACE_BYTES = 32 << 20
#: Scalars alpha/beta read from host memory (cublasPointerMode_t = 0); a captured graph
#: holds the values read at capture time.
CUBLAS_POINTER_MODE_HOST = 0


class CublasError(RuntimeError):
    """A cuBLAS call returned a status other than CUBLAS_STATUS_SUCCESS (0)."""


def _loaded_path() -> str | None:
    """The libcublas already mapped into this process (CuPy's), if any."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if os.path.basename(path).startswith("libcublas.so"):
                    return path
    except OSError:
        return None
    return None


def _library() -> ctypes.CDLL:
    """CuPy's cuBLAS: CuPy is made to load it first (it finds CUDA libraries where the
    dynamic loader may not, e.g. in pip wheels), then it is opened by its mapped path."""
    import cupy

    cupy.cuda.device.get_cublas_handle()
    loaded = _loaded_path()
    for name in ([loaded] if loaded else []) + list(SONAMES):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise CublasError(f"libcublas not found (tried {', '.join(SONAMES)})")


class Cublas:
    """One cuBLAS handle, bound once to `stream_ptr`, with FP32 GEMM in default math."""

    def __init__(self, stream_ptr: int) -> None:
        import cupy

        lib = _library()
        p, i = ctypes.c_void_p, ctypes.c_int
        self._sgemm = lib.cublasSgemm_v2
        self._sgemm.restype = i
        self._sgemm.argtypes = [p, i, i, i, i, i, p, p, i, p, i, p, p, i]
        self._destroy = lib.cublasDestroy_v2
        self._destroy.argtypes = [p]
        handle = p()
        self._check("cublasCreate_v2", lib.cublasCreate_v2(ctypes.byref(handle)))
        self.handle: int | None = handle.value
        self._check("cublasSetStream_v2", lib.cublasSetStream_v2(p(self.handle), p(stream_ptr)))
        self._check("cublasSetMathMode", lib.cublasSetMathMode(p(self.handle), i(CUBLAS_DEFAULT_MATH)))
        mode = lib.cublasSetPointerMode_v2(p(self.handle), i(CUBLAS_POINTER_MODE_HOST))
        self._check("cublasSetPointerMode_v2", mode)
        # after SetStream, which resets a handle's workspace to cuBLAS's default pool
        self.workspace = cupy.zeros((WORKSPACE_BYTES,), dtype=cupy.uint8)
        size = ctypes.c_size_t(WORKSPACE_BYTES)
        status = lib.cublasSetWorkspace_v2(p(self.handle), p(self.workspace.data.ptr), size)
        self._check("cublasSetWorkspace_v2", status)
        self._one = np.ones((1,), dtype=np.float32)
        self._zero = np.zeros((1,), dtype=np.float32)

    @staticmethod
    def _check(call: str, status: int) -> None:
        if status != 0:
            raise CublasError(f"{call} returned cuBLAS status {status}")

    def linear(self, x_ptr: int, weight_ptr: int, out_ptr: int, rows: int, inner: int, outer: int) -> None:
        """out [rows, outer] = x [rows, inner] @ weight[outer, inner]^T, all row-major FP32.

        Column-major view: out^T (outer x rows) = W (outer x inner) @ x^T (inner x rows),
        where W row-major is W^T column-major, hence op T on it."""
        assert self.handle is not None, "cuBLAS handle used after close()"
        status = self._sgemm(
            self.handle, CUBLAS_OP_T, CUBLAS_OP_N, outer, rows, inner,
            self._one.ctypes.data, weight_ptr, inner, x_ptr, inner, self._zero.ctypes.data, out_ptr, outer,
        )  # fmt: skip
        self._check("cublasSgemm_v2", status)

    def close(self) -> None:
        if self.handle is not None:
            self._destroy(ctypes.c_void_p(self.handle))
            self.handle = None
