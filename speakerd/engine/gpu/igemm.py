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
import math as arithmetic
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from speakerd.engine.gpu import kernels, maths
from speakerd.engine.gpu.context import SplitScratch
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
#: kernels/conv_f16.cu's tiling (its F16_* defines; tests check): threads, channels per K
#: chunk, padded shared rows (weights in halves, staged outputs: floats of padding).
F16_SOURCE = "conv_f16.cu"
F16_THREADS = 256
F16_CHUNK = 32
F16_LDB = 48
F16_OUT_PAD = 8
#: (kernel, stride) shapes conv_f16.cu has entry points for: every trunk conv but the stem.
F16_SHAPES = ((3, 1), (3, 2), (1, 2))
#: (kernel, stride, channel tile) -> the pixel tiles (output rows, output columns per block)
#: conv_f16.cu has entry points for (its F16_ENTRY lines; tests check). The autotuner times
#: each, so a tile is here because some conv may run faster with it:
#: - (2, 128): the first tile (the only one before pixel tiles were candidates): the fewest
#:   blocks, so the fewest reloads of a chunk's weights (18 KB at 32 channels, 3x3).
#: - (1, 128): twice the blocks, for grids too small to fill the H200's 132 SMs (layer2's
#:   b1 convs have 80 blocks of 2 x 128), at a halo of 3 x 130 input pixels = 3.05x the
#:   outputs (3x3 stride 1).
#: - (4, 64), (8, 32), 3x3 stride 1: squarer halos, fewer input pixels copied per output
#:   (6 x 66 = 1.55x and 10 x 34 = 1.33x, against 4 x 130 = 2.03x for 2 x 128), for layer1
#:   at b32 (32 -> 32 channels, 80 x 998), which is bound by these loads. 8 x 32 with 32
#:   channels only, for layer1: every entry point is one more kernel timed per conv at
#:   start-up.
F16_PIXEL_TILES: dict[tuple[int, int, int], tuple[tuple[int, int], ...]] = {
    (3, 1, 32): ((2, 128), (1, 128), (4, 64), (8, 32)),
    (3, 1, 64): ((2, 128), (1, 128), (4, 64)),
    (3, 2, 32): ((2, 128), (1, 128)),
    (3, 2, 64): ((2, 128), (1, 128)),
    (1, 2, 32): ((2, 128), (1, 128)),
    (1, 2, 64): ((2, 128), (1, 128)),
}
#: (kernel, stride, channel tile, pixel tile) -> the split-K factors conv_f16.cu has entry
#: points for (its F16_SPLIT_ENTRY lines; tests check). Split K is for grids that leave SMs
#: idle: at b1, layer3's 3x3 convolutions (128 channels, 20 x 250) have 80 blocks of 1 x 128
#: pixels x 64 channels and layer4's (256 channels, 10 x 125) 40, for the H200's 132 SMs
#: with room for two blocks each; cuDNN runs them in 12-14 us, ~120 TFLOP/s. Split 2, 4 or
#: 8 ways over the input channels, they have 2-8x the blocks, each summing 1/split of the
#: channels, and the last block of a tile adds the splits (conv_f16.cu: "Split K"). Only
#: 1 x 128 tiles: the most blocks of each channel tile before splitting.
F16_SPLITS: dict[tuple[int, int, int, tuple[int, int]], tuple[int, ...]] = {
    (3, 1, 64, (1, 128)): (2, 4, 8),
    (3, 1, 32, (1, 128)): (2, 4),
    (3, 2, 64, (1, 128)): (2, 4),
}
#: A split is offered only for a grid of fewer unsplit blocks than this many per SM (the
#: 3x3 stride-1 entry points fit two blocks on an SM): a grid that fills the GPU already
#: gains nothing from splitting, and b32 never splits.
SPLIT_BELOW_BLOCKS_PER_SM = 2


#: kernels/conv_wgmma.cu: FP16 3x3 stride-1 convolutions on Hopper's warpgroup MMA (wgmma,
#: sm_90a: compute capability 9.0 only), one warpgroup per block, persistent: BLOCKS blocks
#: per SM walk the output tiles, the weights copied once per block, the next tile's halo
#: copied while this one's MMAs run. Its entry points (WG_ENTRY lines; tests check):
#: (input channels, channel tile, (pixel rows, columns), blocks per SM). 32 input channels
#: for layer1 (8 x 64: eight m64 tiles, two blocks per SM; 4 x 64 and 2 x 128: four, three
#: and two blocks), 64 for layer2 (64 outputs at one block per SM, 32 at two), 128 for
#: layer3 (one 64-pixel row, 32 outputs, one block per SM: for b1's small grids).
WGMMA_SOURCE = "conv_wgmma.cu"
WGMMA_THREADS = 128
WGMMA_STAGES = 2


class WgmmaEntry(NamedTuple):
    """One WG_ENTRY line of conv_wgmma.cu: the input channels it is compiled for (its halo
    and weights hold them all), its channel and pixel tiles, and its blocks per SM."""

    cin: int
    tile: int
    pixels: tuple[int, int]
    blocks: int  # per SM, the grid's size and the launch bounds' register cap


WGMMA_ENTRIES: tuple[WgmmaEntry, ...] = (
    WgmmaEntry(32, 32, (8, 64), 2),
    WgmmaEntry(32, 32, (4, 64), 3),
    WgmmaEntry(32, 32, (2, 128), 2),
    WgmmaEntry(64, 64, (2, 64), 1),
    WgmmaEntry(64, 32, (2, 64), 2),
    WgmmaEntry(128, 32, (1, 64), 1),
)


#: The autotuner candidates (their names) our kernels here belong to: conv_igemm.cu's and
#: conv_f16.cu's, and conv_wgmma.cu's.
IGEMM_FAMILY = "ours:igemm"
WGMMA_FAMILY = "ours:wgmma"


class Variant(NamedTuple):
    """One kernel of our families for a convolution: channel tile, pixel tile (rows, cols;
    None for conv_igemm.cu), split-K factor (1: unsplit), and whether it is conv_wgmma.cu's."""

    tile: int
    pixels: tuple[int, int] | None
    split: int = 1
    wgmma: bool = False


#: (kernel, stride) shapes each family has entry points for (None: any 1x1 or 3x3).
FAMILY_SHAPES: dict[str, tuple[tuple[int, int], ...] | None] = {SOURCE: None, F16_SOURCE: F16_SHAPES}


def kernel_name(
    math: Math, tile: int, kernel: int = 3, stride: int = 1, pixels: tuple[int, int] | None = None,
    split: int = 1,
) -> str:  # fmt: skip
    """The entry point of our family of `math` for the channel tile, shape, pixel tile
    (rows, cols) and split: conv_f16.cu's names carry the pixel tile and a split-K factor
    above 1 (`_sk4`), conv_igemm.cu's neither."""
    row = maths.of(math)
    assert (pixels is not None) == (row.own_source == F16_SOURCE), (math, pixels)
    assert split == 1 or split in F16_SPLITS.get((kernel, stride, tile, pixels), ()), (tile, pixels, split)
    return row.own_kernel(tile, kernel, stride, pixels) + (f"_sk{split}" if split > 1 else "")


def wgmma_entry(cin: int, tile: int, pixels: tuple[int, int]) -> WgmmaEntry:
    """conv_wgmma.cu's entry for the input channels, channel tile and pixel tile."""
    found = [e for e in WGMMA_ENTRIES if (e.cin, e.tile, e.pixels) == (cin, tile, pixels)]
    assert found, f"conv_wgmma.cu has no entry point for {cin} input channels, tile {tile}, pixels {pixels}"
    return found[0]


def wgmma_kernel_name(entry: WgmmaEntry) -> str:
    """conv_wgmma.cu's entry point name."""
    return f"conv_wgmma_c{entry.cin}_n{entry.tile}_{entry.pixels[0]}x{entry.pixels[1]}"


#: Every entry point of kernels/conv_igemm.cu this module launches, then of kernels/conv_f16.cu.
KERNEL_NAMES = tuple(
    row.own_kernel(tile) for row in maths.MATHS.values() if row.own_source == SOURCE for tile in TILE_CHANNELS
)
F16_KERNEL_NAMES = tuple(
    kernel_name(math, tile, kernel, stride, pixels)
    for math, row in maths.MATHS.items()
    if row.own_source == F16_SOURCE
    for (kernel, stride, tile), tiles in F16_PIXEL_TILES.items()
    for pixels in tiles
) + tuple(
    kernel_name(Math.FP16, tile, kernel, stride, pixels, split)
    for (kernel, stride, tile, pixels), splits in F16_SPLITS.items()
    for split in splits
)


#: ... and of kernels/conv_wgmma.cu.
WGMMA_KERNEL_NAMES = tuple(wgmma_kernel_name(entry) for entry in WGMMA_ENTRIES)


def wgmma_why_not(spec: ConvSpec | ConvKey, math: Math, capability: str) -> str:
    """Why conv_wgmma.cu cannot run `spec` under `math` on a device of compute capability
    `capability` ("" when it can)."""
    needed = kernels.CHIP_SOURCES[WGMMA_SOURCE]
    if capability != needed:
        return f"wgmma needs compute capability {needed} (sm_90a); this device is {capability}"
    if maths.of(math).own_source != F16_SOURCE:
        return f"FP16 only, not {math}"
    if (spec.kernel, spec.stride) != (3, 1):
        return f"3x3 stride 1 only, not k{spec.kernel} s{spec.stride}"
    if not _wgmma_entries_for(spec):
        shapes = sorted({(e.cin, e.tile) for e in WGMMA_ENTRIES})
        return f"{spec.cin} -> {spec.cout} channels fit no entry point's (input channels, tile) of {shapes}"
    return ""


def _wgmma_entries_for(spec: ConvSpec | ConvKey) -> tuple[WgmmaEntry, ...]:
    return tuple(e for e in WGMMA_ENTRIES if e.cin == spec.cin and spec.cout % e.tile == 0)


def wgmma_candidates_for(spec: ConvSpec | ConvKey, math: Math, capability: str) -> tuple[Variant, ...]:
    """conv_wgmma.cu's variants for `spec` (none where wgmma_why_not says why)."""
    if wgmma_why_not(spec, math, capability):
        return ()
    return tuple(Variant(e.tile, e.pixels, wgmma=True) for e in _wgmma_entries_for(spec))


def wgmma_shared_bytes(entry: WgmmaEntry) -> int:
    """conv_wgmma.cu's WgTile<cin, tile, rows, cols>::SHARED_BYTES: WGMMA_STAGES halos (all
    input channels, [channel group][pixel], 16 bytes each) and the block's weights."""
    groups, (rows, cols) = entry.cin // 8, entry.pixels
    return WGMMA_STAGES * groups * (rows + 2) * (cols + 2) * 16 + 9 * groups * entry.tile * 16


def wgmma_grid(spec: ConvSpec, batch: int, entry: WgmmaEntry, sm_count: int) -> tuple[int, int, int]:
    """conv_wgmma.cu's persistent grid: `entry.blocks` blocks per SM shared by the channel
    tiles (blockIdx.y), no more per channel tile than there are output tiles."""
    rows, cols = entry.pixels
    tiles = batch * -(-spec.h_out // rows) * -(-spec.w_out // cols)
    channel_tiles = spec.cout // entry.tile
    return (min(tiles, max(1, entry.blocks * sm_count // channel_tiles)), channel_tiles, 1)


def tiles_for(spec: ConvSpec | ConvKey, math: Math) -> tuple[int, ...]:
    """Channel tiles our kernel can run `spec` with under `math` (none: not a candidate)."""
    return tuple(tile for tile in TILE_CHANNELS if spec.cout % tile == 0) if not why_not(spec, math) else ()


def pixel_tiles_for(spec: ConvSpec | ConvKey, math: Math, tile: int) -> tuple[tuple[int, int] | None, ...]:
    """The pixel tiles (rows, cols) of channel tile `tile` for `spec` under `math`: the FP16
    family's from F16_PIXEL_TILES; (None,) for conv_igemm.cu, whose block takes 128
    consecutive output pixels wherever the rows break."""
    if maths.of(math).own_source != F16_SOURCE:
        return (None,)
    return F16_PIXEL_TILES[(spec.kernel, spec.stride, tile)]


def candidates_for(
    spec: ConvSpec | ConvKey, math: Math, batch: int = 1, sm_count: int | None = None
) -> tuple[Variant, ...]:
    """Every variant our family of `math` can run `spec` at `batch` with: the kernels the
    autotuner times (none: not a candidate). Split-K variants only with `sm_count`, the
    SMs the grid has to fill (splits_for)."""
    return tuple(
        Variant(tile, pixels, split)
        for tile in tiles_for(spec, math)
        for pixels in pixel_tiles_for(spec, math, tile)
        for split in (splits_for(spec, batch, tile, pixels, sm_count) if pixels is not None else (1,))
    )


def splits_for(
    spec: ConvSpec | ConvKey, batch: int, tile: int, pixels: tuple[int, int], sm_count: int | None
) -> tuple[int, ...]:
    """1 (unsplit) and the split-K factors of F16_SPLITS worth timing for this channel and
    pixel tile: only for a grid of fewer than SPLIT_BELOW_BLOCKS_PER_SM blocks per SM,
    splits that divide the input channels into whole 32-channel chunks, and whose partial
    sums and tickets fit SplitScratch."""
    offered = F16_SPLITS.get((spec.kernel, spec.stride, tile, pixels), ())
    if not offered or sm_count is None:
        return (1,)
    tiles = arithmetic.prod(f16_grid(spec, batch, tile, *pixels))
    if tiles >= SPLIT_BELOW_BLOCKS_PER_SM * sm_count:
        return (1,)
    return (1, *(split for split in offered if not why_no_split(spec, batch, tile, pixels, split)))


def why_no_split(spec: ConvSpec | ConvKey, batch: int, tile: int, pixels: tuple[int, int], split: int) -> str:
    """Why conv_f16.cu cannot run `spec` split `split` ways with this tile ("" when it can)."""
    if split not in F16_SPLITS.get((spec.kernel, spec.stride, tile, pixels), ()):
        return f"no split-{split} entry point for k{spec.kernel} s{spec.stride} n{tile} {pixels}"
    if spec.cin % (F16_CHUNK * split):
        return f"{spec.cin} input channels are not {split} whole {F16_CHUNK}-channel chunks"
    tiles = arithmetic.prod(f16_grid(spec, batch, tile, *pixels))
    if tiles > SplitScratch.TICKETS:
        return f"{tiles} tiles, more than the scratch's {SplitScratch.TICKETS} tickets"
    need = split_partial_bytes(tiles, tile, pixels, split)
    if need > SplitScratch.PARTIAL_BYTES:
        return f"{need} bytes of partial sums, more than the scratch's {SplitScratch.PARTIAL_BYTES}"
    return ""


def split_partial_bytes(tiles: int, tile: int, pixels: tuple[int, int], split: int) -> int:
    """Bytes of FP32 partial sums a split-K kernel writes: every split of every output tile
    (rows x cols pixels x `tile` channels), as conv_f16.cu lays them out."""
    rows, cols = pixels
    return split * tiles * rows * cols * tile * 4


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


def f16_shared_bytes(kernel: int, stride: int, tile: int, rows: int, cols: int) -> int:
    """conv_f16.cu's HaloTile<kernel, stride, tile, rows, cols>::SHARED_BYTES: the halo and
    the weights of one K chunk, or the staged FP32 outputs, whichever is larger."""
    step = 1 if kernel == 1 else stride
    lda = 48 if step == 1 else 40
    halo_rows, halo_cols = (rows - 1) * step + kernel, (cols - 1) * step + kernel
    loads = (halo_rows * halo_cols * lda + kernel * kernel * tile * F16_LDB) * 2
    return max(loads, rows * cols * (tile + F16_OUT_PAD) * 4)


def f16_grid(
    spec: ConvSpec | ConvKey, batch: int, tile: int, rows: int, cols: int, split: int = 1
) -> tuple[int, int, int]:
    """conv_f16.cu's grid: channel tiles fastest (they read the same halo, so it is in L2),
    then `cols`-column tiles, then `rows`-row tiles of every image, each `split` times (the
    splits of one tile are neighbours in z)."""
    return (spec.cout // tile, -(-spec.w_out // cols), batch * -(-spec.h_out // rows) * split)


def shared_bytes(tile: int) -> int:
    return STAGES * (BLOCK_PIXELS + tile) * SHARED_ROW * 4


@dataclass
class IgemmConv(OwnKernel):
    """One convolution of a plan bound to its buffers: `launch` enqueues it, fused epilogue
    included (`epilogue`: bias_only, bias_relu or bias_add_relu). In FP16 mode `flag` is
    the plan's range flag, and `pixels` the pixel tile (output rows, columns per block) of
    conv_f16.cu's entry point; None for conv_igemm.cu."""

    spec: ConvSpec
    batch: int
    math: Math
    tile: int
    pixels: tuple[int, int] | None
    epilogue: str
    args: tuple
    grid: tuple[int, int, int]
    threads: int
    shared: int  # dynamic shared memory bytes
    source: str  # the kernels/ file of the entry point
    ms: float = 0.0
    split: int = 1  # split-K factor (conv_f16.cu's _sk entry points)
    wgmma: bool = False  # conv_wgmma.cu's entry point, not conv_f16.cu's

    @classmethod
    def bind(cls, spec: ConvSpec, batch: int, math: Math, tile: int, epilogue: str, x, w, bias, residual, y,
             flag=None, pixels: tuple[int, int] | None = None, split: int = 1,
             scratch: SplitScratch | None = None, wgmma: bool = False,
             sm_count: int | None = None):  # fmt: skip
        """`split` above 1 needs `scratch`, where the kernel keeps its partial sums and
        tickets (one per engine: DeviceContext.split_scratch). `wgmma`: conv_wgmma.cu's
        kernel for the channel and pixel tile (the caller checked wgmma_why_not: it takes
        conv_f16.cu's arguments and the batch, one warpgroup per block, and a grid sized
        by `sm_count`)."""
        assert (residual is not None) == (epilogue == "bias_add_relu"), (epilogue, residual is None)
        table = maths.of(math)
        assert (flag is not None) == table.range_flag, "range-flag maths' convs, and only they, take the flag"
        null = np.uint64(0)
        relu = np.int32(epilogue != "bias_only")
        residual = null if residual is None else residual
        if table.own_source == F16_SOURCE:
            sizes = (spec.h_in, spec.w_in, spec.cin, spec.h_out, spec.w_out, spec.cout)
            args = (x, w, bias, residual, y, flag, *(np.int32(v) for v in sizes), relu)
            assert pixels is not None, f"{spec.name}: FP16 kernels take a pixel tile"
            # both FP16 families move halves 16 bytes (8 channels) at a time
            buffers = (x, w, y) if residual is null else (x, w, y, residual)
            misaligned = [hex(b.data.ptr) for b in buffers if b.data.ptr % 16]
            assert not misaligned, f"{spec.name}: FP16 kernels need 16-byte aligned buffers, not {misaligned}"
            if wgmma:
                entry = wgmma_entry(spec.cin, tile, pixels)
                assert split == 1 and sm_count, f"{spec.name}: wgmma kernels need the SM count and no split"
                grid = wgmma_grid(spec, batch, entry, sm_count)
                return cls(spec, batch, math, tile, pixels, epilogue, (*args, np.int32(batch)), grid,
                           WGMMA_THREADS, wgmma_shared_bytes(entry), WGMMA_SOURCE, wgmma=True)  # fmt: skip
            grid = f16_grid(spec, batch, tile, *pixels, split)
            assert tile in tiles_for(spec, math), f"{spec.name}: tile {tile} not in {tiles_for(spec, math)}"
            assert pixels in pixel_tiles_for(spec, math, tile), (
                f"{spec.name}: pixel tile {pixels} not in {pixel_tiles_for(spec, math, tile)}"
            )
            if split > 1:
                why = why_no_split(spec, batch, tile, pixels, split)
                assert not why, f"{spec.name}: {why}"
                assert scratch is not None, f"{spec.name}: a split-K kernel needs the split scratch"
                args += tuple(np.uint64(pointer) for pointer in scratch.pointers())
            shared = f16_shared_bytes(spec.kernel, spec.stride, tile, *pixels)
            return cls(spec, batch, math, tile, pixels, epilogue, args, grid, F16_THREADS, shared, F16_SOURCE,
                       split=split)  # fmt: skip
        assert split == 1 and not wgmma, f"{spec.name}: conv_igemm.cu has no split-K or wgmma kernels"
        assert tile in tiles_for(spec, math), f"{spec.name}: tile {tile} not in {tiles_for(spec, math)}"
        outputs = batch * spec.h_out * spec.w_out
        grid = (-(-outputs // BLOCK_PIXELS), spec.cout // tile, 1)
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
        return cls(spec, batch, math, tile, None, epilogue, args, grid, THREADS, shared_bytes(tile), SOURCE)

    @classmethod
    def of(cls, variant: Variant, spec: ConvSpec, batch: int, math: Math, epilogue: str, x, w, bias, residual,
           y, flag=None, scratch: SplitScratch | None = None,
           sm_count: int | None = None) -> IgemmConv:  # fmt: skip
        """bind() for one of candidates_for's or wgmma_candidates_for's variants (`scratch`
        is used by split ones only, `sm_count` by wgmma ones)."""
        tile, pixels, split, wgmma = variant
        return cls.bind(spec, batch, math, tile, epilogue, x, w, bias, residual, y, flag, pixels, split,
                        scratch if split > 1 else None, wgmma, sm_count)  # fmt: skip

    @functools.cached_property
    def name(self) -> str:  # type: ignore[override]
        """The entry point (computed once: launches on the eager path read it)."""
        if self.wgmma:
            assert self.pixels is not None, self.spec.name
            return wgmma_kernel_name(wgmma_entry(self.spec.cin, self.tile, self.pixels))
        return kernel_name(self.math, self.tile, self.spec.kernel, self.spec.stride, self.pixels, self.split)

    @property
    def family(self) -> str:  # type: ignore[override]
        return WGMMA_FAMILY if self.wgmma else IGEMM_FAMILY

    def launch(self, stream) -> None:
        function = kernels.entry(self.source, self.name, self.shared)
        function(self.grid, (self.threads,), self.args, stream=stream, shared_mem=self.shared)


def relative_difference(ours, reference) -> float:
    """max |ours - reference| / max |reference| (device arrays, one sync; halves are
    compared in float32, wider types as they are)."""
    import cupy

    ours, reference = (a.astype(cupy.float32) if a.dtype.itemsize == 2 else a for a in (ours, reference))
    scale = float(cupy.abs(reference).max().get())
    return float(cupy.abs(ours - reference).max().get()) / max(scale, 1e-30)
