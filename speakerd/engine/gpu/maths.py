"""One table of what each trunk math means on the GPU, read by every module of the engine.

Why a table: the differences between FP32, TF32 and FP16 mixed (storage dtype, which cuDNN
engines may serve, whether cuDNN may fuse the epilogue, which of our kernels run, how close
they must be to cuDNN, whether a range flag guards the batch, what a flagged batch falls
back to) used to be ~30 scattered `== Math.X` checks; here each is one field of one row, so
a math is read in one place and a new one is one more row.

No CUDA import at module level: `cudnn_io` and `cudnn_notes` ask the cuDNN frontend only
when called, so the table can be read on a machine without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from speakerd.model.numerics import BOUNDS, Bound, Math

#: cuDNN numerical notes no math may serve: non-deterministic engines (two eager passes must
#: agree bit for bit), FP16 down-conversion of FP32 inputs and FP16 accumulation.
ALWAYS_EXCLUDED = ("NONDETERMINISTIC", "DOWN_CONVERT_INPUTS", "REDUCED_PRECISION_REDUCTION")


@dataclass(frozen=True)
class MathSpec:
    """What one trunk math means to the GPU engine (see the module docstring)."""

    math: Math
    #: dtype of activations, conv weights and conv outputs (CuPy takes NumPy dtypes)
    io_dtype: np.dtype
    #: cuDNN's name for it (a member of cudnn.data_type)
    cudnn_io_name: str
    #: cuDNN numerical notes whose engines may not serve this math (cudnn.numerical_note names)
    excluded_notes: tuple[str, ...]
    #: whether cuDNN's fused graphs (conv + bias [+ residual] [+ ReLU]) may be candidates
    cudnn_fusion: bool
    #: why not, when they may not (reported as a refusal)
    no_fusion_reason: str
    #: kernels/ file of our convolution family, and its entry-point names (str.format with
    #: tile, kernel, stride, and for conv_f16.cu the pixel tile's rows and cols)
    own_source: str
    own_name: str
    #: our stem kernel (kernels/speakerd.cu) and statistics pooling kernel
    stem_kernel: str
    pool_kernel: str
    #: largest max |ours - cuDNN| / max |cuDNN| on the same buffers; beyond it ours is a bug
    #: and never serves. Both FP32-accurate paths land near 1e-6 of the output scale (H200
    #: probe: 9e-7 against float64), TF32 results near 3e-4; two FP16 results, each rounded
    #: to half once (2^-11 relative) after FP32 sums in different orders, near 1e-3.
    agreement: float
    #: the embeddings' bound against the FP32 reference (speakerd.model.numerics.BOUNDS)
    parity: Bound
    #: whether every kernel raises a device flag on values beyond the io dtype's range, read
    #: with the outputs (a flagged batch is recomputed in `fallback`)
    range_flag: bool
    #: the math a flagged batch is recomputed in (None: no range flag, nothing to fall back to)
    fallback: Math | None

    @property
    def element_bytes(self) -> int:
        """Bytes of one activation element."""
        return int(self.io_dtype.itemsize)

    @property
    def half_io(self) -> bool:
        """Whether activations and conv weights are stored as halves."""
        return self.element_bytes == 2

    def cudnn_io(self):  # -> cudnn.data_type
        """cuDNN's data type for a conv's X, W, Y (and Z); compute is FP32 in every math."""
        import cudnn

        return getattr(cudnn.data_type, self.cudnn_io_name)

    def cudnn_notes(self) -> list:
        """The excluded numerical notes as cudnn.numerical_note members."""
        import cudnn

        return [getattr(cudnn.numerical_note, name) for name in self.excluded_notes]

    def own_kernel(
        self, tile: int, kernel: int = 3, stride: int = 1, pixels: tuple[int, int] | None = None
    ) -> str:
        """The entry point of our convolution family for this channel tile, shape and pixel
        tile (rows, cols; None for a family whose names carry none)."""
        rows, cols = pixels if pixels is not None else (None, None)
        return self.own_name.format(tile=tile, kernel=kernel, stride=stride, rows=rows, cols=cols)


#: The rows. FP32 strict: engines with TENSOR_CORE are excluded too, because an FP32-io cuDNN
#: convolution otherwise runs TF32 (measured on the H200); its fused graphs fell back to a
#: 26-76 ms engine. FP16: a fused graph converts its result to half inside cuDNN, where an
#: overflow cannot be flagged by a kernel of ours, so in a range-flag math every fused graph
#: also reduces its FP32 result to its largest magnitude (a cuDNN AMAX reduction node, read
#: by the pooling kernel: plan.py); the range check is then as strict as our kernels'.
MATHS: dict[Math, MathSpec] = {
    spec.math: spec
    for spec in (
        MathSpec(
            Math.FP32, np.dtype(np.float32), "FLOAT", (*ALWAYS_EXCLUDED, "TENSOR_CORE"),
            False, "strict FP32 fused graphs ran 26-76 ms on the H200 (our epilogue follows a bare conv)",
            "conv_igemm.cu", "conv_igemm_3xtf32_n{tile}", "stem_f32", "stats_pool_f32",
            2e-5, BOUNDS[Math.FP32], False, None,
        ),
        MathSpec(
            Math.TF32, np.dtype(np.float32), "FLOAT", ALWAYS_EXCLUDED,
            True, "",
            "conv_igemm.cu", "conv_igemm_tf32_n{tile}", "stem_f32", "stats_pool_f32",
            5e-3, BOUNDS[Math.TF32], False, None,
        ),
        MathSpec(
            Math.FP16, np.dtype(np.float16), "HALF", ALWAYS_EXCLUDED,
            True, "",
            "conv_f16.cu", "conv_f16_r{kernel}s{stride}_n{tile}_{rows}x{cols}", "stem_f16", "stats_pool_f16",
            1e-2, BOUNDS[Math.FP16], True, Math.TF32,
        ),
    )
}  # fmt: skip


def of(math: Math | str) -> MathSpec:
    """The row of `math`; ValueError naming the maths the GPU engine has."""
    try:
        return MATHS[Math(math)]
    except (KeyError, ValueError):
        raise ValueError(f"math: {math!r}, expected one of {', '.join(MATHS)}") from None
