"""What the engine sets up once and its plans share, handed to them as one typed value.

A Plan (and the autotuner choosing its convolutions) reads the device through a frozen
`DeviceContext` rather than through the engine: the streams, the cuDNN and cuBLAS handles,
the shared cuDNN workspace and split-K scratch, the device weights, our compiled kernels and the activation
arena. Frozen, because a plan must not re-point any of them; the two things that do change
after set-up are objects of their own: the workspace grows (`Workspace.grow`, which tells
the caller that captured graphs hold its old address) and weights are uploaded on first
use (`DeviceWeights`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from speakerd.engine.gpu.cublas import Cublas
from speakerd.model.weights import FoldedConv, FoldedModel

#: Largest finite FP16 value: weights beyond it cannot be stored for FP16 mode.
HALF_MAX = 65504.0


class Workspace:
    """The cuDNN workspace every convolution of every plan shares (one buffer of the
    largest need: plans never run at once)."""

    def __init__(self, stream) -> None:
        import cupy

        self.stream = stream
        with stream:
            self.buffer = cupy.zeros((1,), dtype=cupy.uint8)  # sized once the plans are chosen

    @property
    def ptr(self) -> int:
        return int(self.buffer.data.ptr)

    @property
    def nbytes(self) -> int:
        return int(self.buffer.nbytes)

    def grow(self, need: int) -> bool:
        """Grow to `need` bytes; True when it moved (captured graphs hold its old address
        and must be captured again)."""
        import cupy

        if need <= self.buffer.nbytes:
            return False
        with self.stream:
            self.buffer = cupy.zeros((need,), dtype=cupy.uint8)
        self.stream.synchronize()
        return True


class SplitScratch:
    """What our split-K convolutions (kernels/conv_f16.cu, `_sk` entry points) share: the
    FP32 partial sums of every split of one output tile, and one ticket counter per tile,
    which the kernel leaves at zero for the next launch. One buffer for every plan, like
    the workspace (plans never run at once), allocated on the first split kernel bound.

    Sizes: the largest split of the trunk at b1 (layer3's 4-way or layer4's 8-way, 80 or 40
    tiles of 1 x 128 pixels x 64 channels) writes 2.6 M floats = 10.5 MB, so PARTIAL_BYTES
    leaves room; a split that needs more, or more tiles than TICKETS, is not offered
    (igemm.splits_for)."""

    PARTIAL_BYTES = 16 * 1024 * 1024
    TICKETS = 1024
    #: the tickets come first; the partial sums start at this byte offset (16-byte aligned
    #: for the kernel's float4 accesses)
    PARTIALS_AT = TICKETS * 4

    def __init__(self, stream) -> None:
        self.stream = stream
        self.buffer = None

    def pointers(self) -> tuple[int, int]:
        """(partials, tickets) device pointers, the buffer allocated zeroed on first use."""
        import cupy

        if self.buffer is None:
            with self.stream:
                self.buffer = cupy.zeros((self.PARTIALS_AT + self.PARTIAL_BYTES,), dtype=cupy.uint8)
            self.stream.synchronize()
        base = int(self.buffer.data.ptr)
        return base + self.PARTIALS_AT, base

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else int(self.buffer.nbytes)


class DeviceWeights:
    """The model's weights on the device in the layouts the kernels read: convolutions KRSC
    [cout, k, k, cin] (uploaded on first use, once per dtype), the final linear row-major."""

    def __init__(self, model: FoldedModel) -> None:
        import cupy

        self.seg_weight = cupy.asarray(model.seg_weight)  # [256, 5120] row-major
        self.seg_bias = cupy.asarray(model.seg_bias)
        self._convs: dict[tuple[int, bool], tuple[object, object, FoldedConv]] = {}

    def conv(self, folded: FoldedConv, half: bool = False) -> tuple[object, object]:
        """(weight KRSC, bias [cout]): float32, or float16 weights for FP16 mode (the bias
        stays float32: the epilogues add it in FP32). ValueError when a weight does not fit
        FP16's range."""
        import cupy

        key = (id(folded), half)
        if key not in self._convs:
            weight = np.ascontiguousarray(folded.weight.transpose(0, 2, 3, 1))
            if half:
                largest = float(np.abs(weight).max())
                if not largest <= HALF_MAX:
                    raise ValueError(
                        f"math fp16: {folded.spec.name} has a weight of magnitude {largest:.4g}, "
                        f"beyond FP16's {HALF_MAX:g}; serve this model with tf32 or fp32"
                    )
                weight = weight.astype(np.float16)
            # the FoldedConv is kept alive with its upload, so its id() is never reused
            self._convs[key] = (cupy.asarray(weight), cupy.asarray(folded.bias), folded)
        weight, bias, _ = self._convs[key]
        return weight, bias

    def nbytes(self) -> int:
        convs = sum(int(w.nbytes) + int(b.nbytes) for w, b, _ in self._convs.values())
        return convs + int(self.seg_weight.nbytes) + int(self.seg_bias.nbytes)


@dataclass(frozen=True)
class DeviceContext:
    """The device resources plans share (see the module docstring)."""

    stream: object  # cupy.cuda.Stream: all compute, in order
    copy_stream: object  # cupy.cuda.Stream: input uploads (staging.py)
    cudnn: object  # cuDNN handle bound to `stream`
    cublas: Cublas  # strict-FP32 linear, bound to `stream`
    workspace: Workspace
    split_scratch: SplitScratch  # our split-K convolutions' partial sums and tickets
    weights: DeviceWeights
    kernels: Mapping[str, object]  # entry point name -> cupy.RawKernel (kernels/speakerd.cu)
    arena: Mapping[str, object]  # activation buffer name -> float32 device array, see plan.py
    sm_count: int
    compute_capability: str  # e.g. "90": which chip-specific kernels may run (kernels.CHIP_SOURCES)

    def linear(self, pooled, output) -> None:
        """output [rows, 256] = pooled [rows, 5120] @ seg_1.weight^T in FP32 on cuBLAS."""
        rows, inner = pooled.shape
        outer = self.weights.seg_weight.shape[0]
        self.cublas.linear(
            pooled.data.ptr, self.weights.seg_weight.data.ptr, output.data.ptr, rows, inner, outer
        )
