"""Our direct kernel for the stem (kernels/speakerd.cu `stem_f32` / `stem_f16`).

The stem is 1 -> 32 channels, 3x3: one input channel leaves an implicit GEMM nothing to
tile (cuDNN ran it at 2.7 TFLOP/s, 0.46 ms of a 6.9 ms TF32 b32 forward on the H200),
while a thread per output pixel doing nine FP32 FMAs per channel, its block's outputs
staged in shared memory and stored in coalesced 16-byte pieces, is bound by writing the
output once. It computes in FP32 in every math: in FP32 and TF32 mode a candidate timed
against cuDNN like any conv; in FP16 mode the only way the stem runs, because its input
stays FP32 (the fbank) while its output is the FP16 trunk's first half activation (range
checked, flag raised like every FP16 conv).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from speakerd.engine.gpu import maths
from speakerd.engine.gpu.convs import ConvKey
from speakerd.engine.gpu.timing import OwnKernel
from speakerd.model.architecture import STEM, ConvSpec
from speakerd.model.numerics import Math

#: Threads per block (one output pixel each): kernels/speakerd.cu's STEM_THREADS (tests check).
THREADS = 128
#: What the kernel computes: the stem's shape and epilogue, nothing else.
EPILOGUE = "bias_relu"


def applies(spec: ConvSpec | ConvKey, epilogue: str | None) -> bool:
    """Whether `spec` is the stem's convolution with its epilogue (the only one the kernel runs)."""
    same = (spec.cin, spec.cout, spec.kernel, spec.stride, spec.h_in, spec.w_in)
    stem = (STEM.cin, STEM.cout, STEM.kernel, STEM.stride, STEM.h_in, STEM.w_in)
    return same == stem and epilogue == EPILOGUE


@dataclass
class StemConv(OwnKernel):
    """The stem of one plan bound to its buffers (x FP32 [b, 80, 998]; w FP32 KRSC; y FP32,
    or FP16 with the plan's range `flag`)."""

    batch: int
    math: Math
    args: tuple
    grid: tuple[int]
    ms: float = 0.0
    tile: int = STEM.cout  # channels per thread, for reports (the interface of IgemmConv)
    family = "ours:stem"

    @classmethod
    def bind(cls, batch: int, math: Math, x, w, bias, y, flag=None) -> StemConv:
        assert (flag is not None) == maths.of(math).range_flag, (
            "range-flag maths' stems, and only they, take the flag"
        )
        pixels = batch * STEM.h_out * STEM.w_out
        args = (x, w, bias, y, np.int32(batch)) + ((flag,) if flag is not None else ())
        return cls(batch, math, args, (-(-pixels // THREADS),))

    @property
    def name(self) -> str:
        return maths.of(self.math).stem_kernel

    def launch(self, stream) -> None:
        from speakerd.engine.gpu import kernels

        kernels.function(self.name)(self.grid, (THREADS,), self.args, stream=stream)
