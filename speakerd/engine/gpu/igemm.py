"""Our tensor-core convolutions as candidates next to cuDNN's plans.

Two kernel families, both NHWC with the block's epilogue (bias, residual, ReLU) fused:
- kernels/conv_igemm.cu, float32 io: in FP32 mode the 3xTF32 variant, which keeps FP32
  accuracy on tensor cores (see the .cu file); in TF32 mode one TF32 MMA per product.
- kernels/conv_f16.cu, FP16 mode: half io, FP16 MMAs accumulating in FP32, halo tiles
  (each input pixel copied to shared memory once per block, read by all r x r taps), and
  the range check of FP16 mode (a flag raised by any output outside FP16's range).

The autotuner (autotune.py) times them per convolution against cuDNN (bare conv + our
epilogue, and cuDNN's fused graph where the math allows) and keeps whichever is fastest,
after checking the output against cuDNN's on the same buffers (the math's agreement
bound, maths.py). Which family and entry points a math uses is the maths table's too.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from speakerd.engine.gpu import kernels, maths
from speakerd.engine.gpu.convs import ConvKey
from speakerd.engine.gpu.timing import OwnKernel
from speakerd.model.architecture import ConvSpec
from speakerd.model.numerics import Math

SOURCE = "conv_igemm.cu"
#: kernels/conv_igemm.cu's tiling: output pixels per block, threads, pipeline stages and the
#: padded shared-memory row (floats). Must equal its IGEMM_* defines (tests check).
BLOCK_PIXELS = 128
THREADS = 128
STAGES = 3
SHARED_ROW = 40
#: Channel tiles there are kernels for, widest first (fewer blocks re-reading the input).
TILE_CHANNELS = (64, 32)
#: Input channels one K step covers: cin must be a multiple.
CHANNEL_STEP = 32
#: kernels/conv_f16.cu's tiling (its F16_* defines; tests check): threads, output columns
#: and rows per block, channels per K chunk, padded shared rows (weights in halves, staged
#: outputs: floats of padding).
F16_SOURCE = "conv_f16.cu"
F16_THREADS = 256
F16_COLS = 128
F16_ROWS = 2
F16_CHUNK = 32
F16_LDB = 48
F16_OUT_PAD = 8
#: (kernel, stride) shapes conv_f16.cu has entry points for: every trunk conv but the stem.
F16_SHAPES = ((3, 1), (3, 2), (1, 2))
#: (kernel, stride) shapes each family has entry points for (None: any 1x1 or 3x3).
FAMILY_SHAPES: dict[str, tuple[tuple[int, int], ...] | None] = {SOURCE: None, F16_SOURCE: F16_SHAPES}


def kernel_name(math: Math, tile: int, kernel: int = 3, stride: int = 1) -> str:
    return maths.of(math).own_kernel(tile, kernel, stride)


#: Every entry point of kernels/conv_igemm.cu this module launches, then of kernels/conv_f16.cu.
KERNEL_NAMES = tuple(
    row.own_kernel(tile) for row in maths.MATHS.values() if row.own_source == SOURCE for tile in TILE_CHANNELS
)
F16_KERNEL_NAMES = tuple(
    row.own_kernel(tile, kernel, stride)
    for row in maths.MATHS.values()
    if row.own_source == F16_SOURCE
    for kernel, stride in F16_SHAPES
    for tile in TILE_CHANNELS
)


def tiles_for(spec: ConvSpec | ConvKey, math: Math) -> tuple[int, ...]:
    """Channel tiles our kernel can run `spec` with under `math` (none: not a candidate)."""
    return tuple(tile for tile in TILE_CHANNELS if spec.cout % tile == 0) if not why_not(spec, math) else ()


def why_not(spec: ConvSpec | ConvKey, math: Math) -> str:
    """Why our family of `math` has no kernel for `spec` ("" when it has)."""
    shapes = FAMILY_SHAPES[maths.of(math).own_source]
    if spec.kernel not in (1, 3):
        return f"{spec.kernel}x{spec.kernel} kernels are not implemented"
    if spec.cin % CHANNEL_STEP:
        return f"{spec.cin} input channels are not a multiple of {CHANNEL_STEP}"
    if shapes is not None and (spec.kernel, spec.stride) not in shapes:
        return f"no entry point for k{spec.kernel} s{spec.stride} (has {shapes})"
    if not any(spec.cout % tile == 0 for tile in TILE_CHANNELS):
        return f"{spec.cout} output channels fit no tile of {TILE_CHANNELS}"
    return ""


#: Shared memory one block may have on Hopper.
BLOCK_SHARED_MAX = 227 * 1024


def f16_shared_bytes(kernel: int, stride: int, tile: int) -> int:
    """conv_f16.cu's HaloTile<kernel, stride, tile>::SHARED_BYTES: the halo and the weights
    of one K chunk, or the staged FP32 outputs, whichever is larger."""
    step = 1 if kernel == 1 else stride
    lda = 48 if step == 1 else 40
    rows, cols = (F16_ROWS - 1) * step + kernel, (F16_COLS - 1) * step + kernel
    loads = (rows * cols * lda + kernel * kernel * tile * F16_LDB) * 2
    return max(loads, F16_ROWS * F16_COLS * (tile + F16_OUT_PAD) * 4)


def f16_grid(spec: ConvSpec, batch: int, tile: int) -> tuple[int, int, int]:
    """conv_f16.cu's grid: channel tiles fastest (they read the same halo, so it is in L2),
    then 128-column tiles, then pairs of output rows of every image."""
    return (spec.cout // tile, -(-spec.w_out // F16_COLS), batch * -(-spec.h_out // F16_ROWS))


def shared_bytes(tile: int) -> int:
    return STAGES * (BLOCK_PIXELS + tile) * SHARED_ROW * 4


@dataclass
class IgemmConv(OwnKernel):
    """One convolution of a plan bound to its buffers: `launch` enqueues it, fused epilogue
    included (`epilogue`: bias_only, bias_relu or bias_add_relu). In FP16 mode `flag` is
    the plan's range flag."""

    spec: ConvSpec
    batch: int
    math: Math
    tile: int
    epilogue: str
    args: tuple
    grid: tuple[int, int, int]
    threads: int
    shared: int  # dynamic shared memory bytes
    source: str  # the kernels/ file of the entry point
    ms: float = 0.0

    @classmethod
    def bind(cls, spec: ConvSpec, batch: int, math: Math, tile: int, epilogue: str, x, w, bias, residual, y,
             flag=None):  # fmt: skip
        assert tile in tiles_for(spec, math), f"{spec.name}: tile {tile} not in {tiles_for(spec, math)}"
        assert (residual is not None) == (epilogue == "bias_add_relu"), (epilogue, residual is None)
        table = maths.of(math)
        assert (flag is not None) == table.range_flag, "range-flag maths' convs, and only they, take the flag"
        null = np.uint64(0)
        relu = np.int32(epilogue != "bias_only")
        residual = null if residual is None else residual
        if table.own_source == F16_SOURCE:
            sizes = (spec.h_in, spec.w_in, spec.cin, spec.h_out, spec.w_out, spec.cout)
            args = (x, w, bias, residual, y, flag, *(np.int32(v) for v in sizes), relu)
            shared = f16_shared_bytes(spec.kernel, spec.stride, tile)
            grid = f16_grid(spec, batch, tile)
            return cls(spec, batch, math, tile, epilogue, args, grid, F16_THREADS, shared, F16_SOURCE)
        pixels = batch * spec.h_out * spec.w_out
        grid = (-(-pixels // BLOCK_PIXELS), spec.cout // tile, 1)
        sizes = (
            batch,
            spec.h_in,
            spec.w_in,
            spec.cin,
            spec.h_out,
            spec.w_out,
            spec.cout,
            spec.kernel,
            spec.stride,
        )
        args = (x, w, bias, residual, y, *(np.int32(v) for v in sizes), relu)
        return cls(spec, batch, math, tile, epilogue, args, grid, THREADS, shared_bytes(tile), SOURCE)

    @property
    def name(self) -> str:
        return kernel_name(self.math, self.tile, self.spec.kernel, self.spec.stride)

    def launch(self, stream) -> None:
        function = _function(self.source, self.name, self.shared)
        function(self.grid, (self.threads,), self.args, stream=stream, shared_mem=self.shared)


@functools.cache
def _function(source: str, name: str, shared: int):  # -> cupy.RawKernel
    """The entry point, fetched once per process (launches sit on the eager forward path)
    with its dynamic shared memory limit raised (above 48 KB needs it)."""
    function = kernels.module(source).get_function(name)
    function.max_dynamic_shared_size_bytes = shared
    return function


def relative_difference(ours, reference) -> float:
    """max |ours - reference| / max |reference| (device arrays, one sync; halves are
    compared in float32, wider types as they are)."""
    import cupy

    ours, reference = (a.astype(cupy.float32) if a.dtype.itemsize == 2 else a for a in (ours, reference))
    scale = float(cupy.abs(reference).max().get())
    return float(cupy.abs(ours - reference).max().get()) / max(scale, 1e-30)
