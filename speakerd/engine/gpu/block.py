"""A whole FP16 BasicBlock in one kernel (kernels/block_f16.cu), as a candidate against its
two convolutions run one by one.

What it computes is exactly a block's two `ConvRequest`s: conv1 + bias + ReLU into the
hidden activation, conv2 + bias + the block input + ReLU into the output, with FP16 mode's
range check on both. What it saves is HBM traffic: the hidden activation stays in shared
memory (recomputed on each tile's one-pixel ring), and the residual is read from the halo
conv1 already loaded, so a block reads x once and writes y once instead of five tensor
crossings (the .cu file says how).

It exists for layer1 only (32 -> 32 channels, 3x3 stride 1, identity shortcut): its
weights (2 x 9 x 32 x 32 halves) and halos fit one SM's shared memory; layer2's 64-channel
weights alone would take 147 KB. The autotuner (autotune.Autotuner.choose_block) times it
against what it chose for the two convolutions and keeps whichever is faster.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from speakerd.engine.gpu import kernels, maths
from speakerd.engine.gpu.timing import OwnKernel
from speakerd.model.architecture import BlockSpec
from speakerd.model.numerics import Math

SOURCE = "block_f16.cu"
#: kernels/block_f16.cu's F16B_* defines (tests check): warps along the pixels, channels
#: in and out, halves per padded shared row, halves per staged output pixel.
PIXEL_WARPS = 8
CHANNELS = 32
SHARED_ROW = 48
STAGE_ROW = 40
TAPS = 9
#: Entry points (output rows, output columns, warps) there are (F16B_ENTRY lines; tests
#: check), each timed by the autotuner:
#: - 8 x 32: hidden ring 10 x 34 = 1.33x the outputs; 22 conv1 fragments on 8 pixel warps
#:   (3 each, 2 of them idle on the last).
#: - 16 x 16: ring 18 x 18 = 1.27x, 21 fragments; fewer columns, so fewer partial tiles at
#:   the 998-frame edge (63 tiles of 16 against 32 of 32).
#: - 4 x 32: half the tile, twice the tiles, for b1 (320 tiles of 8 x 32 fill 132 SMs in
#:   2.4 rounds), at a ring of 6 x 34 = 1.59x.
#: - 8 warps: each covers all 32 channels (the fewest shared-memory bytes per MMA); 16: two
#:   warps split the channels, twice the warps to hide latency (one block per SM either way).
VARIANTS: tuple[tuple[int, int, int], ...] = ((8, 32, 8), (16, 16, 8), (4, 32, 8), (8, 32, 16), (16, 16, 16))


def kernel_name(variant: tuple[int, int, int]) -> str:
    """The entry point of a variant (output rows, output columns, warps)."""
    rows, cols, warps = variant
    return f"block_f16_{rows}x{cols}_w{warps}"


KERNEL_NAMES = tuple(kernel_name(variant) for variant in VARIANTS)
#: Shared memory one block may have on Hopper.
BLOCK_SHARED_MAX = 227 * 1024


def shared_bytes(rows: int, cols: int) -> int:
    """kernels/block_f16.cu's BlockTile<rows, cols>::SHARED_BYTES: both weight sets, two
    halo buffers, the hidden tile and the staged output tile."""
    weights = TAPS * CHANNELS * SHARED_ROW
    halo = (rows + 4) * (cols + 4) * SHARED_ROW
    hidden = (rows + 2) * (cols + 2) * SHARED_ROW
    staged = rows * cols * STAGE_ROW
    return (2 * weights + 2 * halo + hidden + staged) * 2


def tiles(batch: int, h: int, w: int, rows: int, cols: int) -> int:
    """Output tiles of a batch: what the persistent blocks walk."""
    return batch * -(-h // rows) * -(-w // cols)


def why_not(block: BlockSpec, math: Math) -> str:
    """Why the fused kernel cannot run `block` in `math` ("" when it can)."""
    table = maths.of(math)
    if not (table.half_io and table.range_flag):
        return f"FP16 only (halves with the range check); this is {math}"
    if block.shortcut is not None:
        return "the block has a shortcut convolution; the kernel adds the block input itself"
    for conv in (block.conv1, block.conv2):
        shape = (conv.cin, conv.cout, conv.kernel, conv.stride)
        if shape != (CHANNELS, CHANNELS, 3, 1):
            found = f"{conv.cin}->{conv.cout} k{conv.kernel} s{conv.stride}"
            return f"{conv.name}: {found}; the kernel runs 32->32 k3 s1"
    return ""


@dataclass
class BlockKernel(OwnKernel):
    """One block of a plan bound to its buffers: `launch` enqueues the fused kernel. Bound
    with `hidden`, it writes the hidden activation too (a tap); without, only the output."""

    block: BlockSpec
    batch: int
    variant: tuple[int, int, int]  # output rows, output columns, warps
    args: tuple
    grid: tuple[int]
    shared: int
    ms: float = 0.0
    tile: int = CHANNELS  # channels per block, for reports (the interface of IgemmConv)
    family = "ours:block"

    @classmethod
    def bind(cls, block: BlockSpec, batch: int, variant: tuple[int, int, int], x, w1, b1, w2, b2, y, flag,
             sm_count: int, hidden=None) -> BlockKernel:  # fmt: skip
        assert variant in VARIANTS, f"{variant} not in {VARIANTS}"
        rows, cols, _ = variant
        assert not why_not(block, Math.FP16), why_not(block, Math.FP16)
        h, w = block.conv1.h_in, block.conv1.w_in
        count = tiles(batch, h, w, rows, cols)
        hidden_ptr = np.uint64(0) if hidden is None else hidden
        args = (x, w1, b1, w2, b2, y, hidden_ptr, flag, *(np.int32(v) for v in (batch, h, w)))
        grid = (min(count, sm_count),)
        return cls(block, batch, variant, args, grid, shared_bytes(rows, cols))

    @property
    def name(self) -> str:
        return kernel_name(self.variant)

    def launch(self, stream) -> None:
        function = kernels.entry(SOURCE, self.name, self.shared)
        function(self.grid, (32 * self.variant[2],), self.args, stream=stream, shared_mem=self.shared)
