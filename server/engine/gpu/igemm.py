"""Our tensor-core convolution (kernels/conv_igemm.cu) as a candidate next to cuDNN's plans.

A Plan times it per convolution against cuDNN (bare conv + our epilogue, and cuDNN's fused
graph) and keeps whichever is fastest, after checking its output against cuDNN's on the
same buffers. In FP32 mode the kernel is the 3xTF32 variant, which keeps FP32 accuracy on
tensor cores (see the .cu file); in TF32 mode one TF32 MMA per product.
"""

from __future__ import annotations

import functools
import statistics
from dataclasses import dataclass

import numpy as np

from server.architecture import ConvSpec
from server.engine.base import Math
from server.engine.gpu import kernels
from server.engine.gpu.convs import replay_ms

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
#: Replays timed per candidate (after one warm-up), and launches captured per replay, so
#: a b1 conv of ~15 us is timed as GPU work, not launch overhead.
TIMED_REPLAYS = 5
LAUNCHES_PER_REPLAY = 5
#: Largest accepted max |ours - cuDNN| / max |cuDNN| on the same buffers, per math: both
#: FP32-accurate paths land near 1e-6 of the output scale (H200 probe: 9e-7 against float64),
#: TF32 results near 3e-4.
#: A kernel outside it is a bug and never serves.
AGREEMENT = {Math.FP32: 2e-5, Math.TF32: 5e-3}


def kernel_name(math: Math, tile: int) -> str:
    return f"conv_igemm_{'3xtf32' if math == Math.FP32 else 'tf32'}_n{tile}"


#: Every entry point of kernels/conv_igemm.cu this module launches.
KERNEL_NAMES = tuple(kernel_name(math, tile) for math in (Math.TF32, Math.FP32) for tile in TILE_CHANNELS)


def tiles_for(spec: ConvSpec, math: Math) -> tuple[int, ...]:
    """Channel tiles our kernel can run `spec` with under `math` (none: not a candidate)."""
    if math not in (Math.FP32, Math.TF32) or spec.kernel not in (1, 3) or spec.cin % CHANNEL_STEP:
        return ()
    return tuple(tile for tile in TILE_CHANNELS if spec.cout % tile == 0)


def shared_bytes(tile: int) -> int:
    return STAGES * (BLOCK_PIXELS + tile) * SHARED_ROW * 4


@dataclass
class IgemmConv:
    """One convolution of a plan bound to its buffers: `launch` enqueues it, fused epilogue
    included (`epilogue`: bias_only, bias_relu or bias_add_relu)."""

    spec: ConvSpec
    batch: int
    math: Math
    tile: int
    epilogue: str
    args: tuple
    grid: tuple[int, int]
    ms: float = 0.0

    @classmethod
    def bind(cls, spec: ConvSpec, batch: int, math: Math, tile: int, epilogue: str, x, w, bias, residual, y):
        assert tile in tiles_for(spec, math), f"{spec.name}: tile {tile} not in {tiles_for(spec, math)}"
        assert (residual is not None) == (epilogue == "bias_add_relu"), (epilogue, residual is None)
        pixels = batch * spec.h_out * spec.w_out
        grid = (-(-pixels // BLOCK_PIXELS), spec.cout // tile)
        null = np.uint64(0)
        args = (
            x, w, bias, null if residual is None else residual, y,
            *(np.int32(v) for v in (batch, spec.h_in, spec.w_in, spec.cin, spec.h_out, spec.w_out, spec.cout,
                                    spec.kernel, spec.stride, epilogue != "bias_only")),
        )  # fmt: skip
        return cls(spec, batch, math, tile, epilogue, args, grid)

    @property
    def name(self) -> str:
        return kernel_name(self.math, self.tile)

    def launch(self, stream) -> None:
        function = _function(self.name, self.tile)
        function(self.grid, (THREADS,), self.args, stream=stream, shared_mem=shared_bytes(self.tile))

    def time(self, stream) -> float:
        """Median GPU ms of one launch, from replays of a graph of LAUNCHES_PER_REPLAY."""
        self.launch(stream)
        stream.begin_capture()
        try:
            for _ in range(LAUNCHES_PER_REPLAY):
                self.launch(stream)
        finally:
            graph = stream.end_capture()
        graph.launch(stream)
        per_launch = [replay_ms(graph, stream) / LAUNCHES_PER_REPLAY for _ in range(TIMED_REPLAYS)]
        self.ms = statistics.median(per_launch)
        return self.ms


@functools.cache
def _function(name: str, tile: int):  # -> cupy.RawKernel
    """The entry point, fetched once per process (launches sit on the eager forward path)
    with its dynamic shared memory limit raised (above 48 KB needs it)."""
    function = kernels.module(SOURCE).get_function(name)
    function.max_dynamic_shared_size_bytes = shared_bytes(tile)
    return function


def relative_difference(ours, reference) -> float:
    """max |ours - reference| / max |reference| (device arrays, one sync)."""
    import cupy

    scale = float(cupy.abs(reference).max().get())
    return float(cupy.abs(ours - reference).max().get()) / max(scale, 1e-30)
