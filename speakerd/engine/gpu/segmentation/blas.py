"""The segmentation engine's GEMMs: two cuBLAS handles on one stream, strict FP32 and TF32.

Why two: the FP32 math's projections must stay strict FP32 (cuBLAS default math never uses
TF32), while the fast math runs the same projections on TF32 tensor cores over split operands
(weights.py: [hi | lo | hi] x [W_hi | W_hi | W_lo], FP32-accurate products), which needs a
handle whose math mode allows TF32 (CUBLAS_TF32_TENSOR_OP_MATH). Both are engine/gpu/cublas.py's
`Cublas` (bound once to our stream, with their own workspace, so a captured graph replays
eager's bits), the second with its math mode switched.
"""

from __future__ import annotations

import ctypes

from speakerd.engine.gpu import cublas

#: cublasMath_t CUBLAS_TF32_TENSOR_OP_MATH: single-precision routines may use TF32 tensor cores.
CUBLAS_TF32_TENSOR_OP_MATH = 3


class Gemms:
    """`linear(..., tf32=False)`: out [rows, outer] = x [rows, inner] @ W[outer, inner]^T."""

    def __init__(self, stream_ptr: int) -> None:
        self.strict = cublas.Cublas(stream_ptr)
        self.tensor = cublas.Cublas(stream_ptr)
        lib = cublas._library()
        status = lib.cublasSetMathMode(
            ctypes.c_void_p(self.tensor.handle), ctypes.c_int(CUBLAS_TF32_TENSOR_OP_MATH)
        )
        cublas.Cublas._check("cublasSetMathMode(TF32)", status)

    def linear(
        self, x_ptr: int, w_ptr: int, out_ptr: int, rows: int, inner: int, outer: int, tf32: bool
    ) -> None:
        (self.tensor if tf32 else self.strict).linear(x_ptr, w_ptr, out_ptr, rows, inner, outer)

    def close(self) -> None:
        self.strict.close()
        self.tensor.close()
