"""The fused FP16 BasicBlock kernel (kernels/block_f16.cu) as a specification.

- It equals, bit for bit, our FP16 convolution kernel run twice (conv1 + bias + ReLU into
  the hidden activation, then conv2 + bias + the block input + ReLU): the same fragments in
  the same order, so fusing changes where the hidden tile lives, never a bit of the result.
  Every entry point (pixel tile and warps), layer1's shape at b1 and b3, and a small shape
  whose edges cut tiles.
- Against float64 (the math's agreement bound, as our convolutions are held to).
- The hidden activation it writes for taps is the first kernel's output, bit for bit, and
  writing it does not change y.
- FP16 mode's range flag: raised when the hidden activation overflows, when only the
  output does (the residual pushes it past 65504), and not on normal data.
- In an engine (--conv-kernels blocks), with the kernel made to serve every layer1 block
  whether or not it wins: the embeddings and every tap meet the FP16 bounds, the captured
  graph replays eager's bits, and the report puts each block's time on its conv1 row.

The table printed is (shape, batch, entry point, max |error| / max |float64|).
"""

from __future__ import annotations

import numpy as np
import pytest

from speakerd.model.architecture import BLOCKS, EMBEDDING_DIM, MAX_SPEAKERS, TAP_NAMES, BlockSpec, ConvSpec
from speakerd.model.numerics import BOUNDS, Math, compare
from tests.gpu_streams import ordered_stream
from tests.test_gpu_engine import needs_gpu
from tests.test_gpu_igemm import _reference as conv_reference

#: (h, w, batch): layer1's 80 x 998 at b1 and b3, and 19 x 45, where every tile of every
#: shape is cut by an edge (19 rows: 8 x 32 leaves 3, 16 x 16 leaves 3, 4 x 32 leaves 3).
SHAPES = [(80, 998, 1), (80, 998, 3), (19, 45, 2)]


def _block(h: int, w: int) -> BlockSpec:
    def conv(name: str) -> ConvSpec:
        return ConvSpec(name, name, 32, 32, 3, 1, h, w)

    return BlockSpec(1, 0, conv("test.conv1"), conv("test.conv2"), None)


def _operands(h: int, w: int, batch: int, seed: int = 11):
    """Half input and weights scaled like a trained block (unit-variance activations)."""
    import cupy

    random = cupy.random.RandomState(seed)
    x = cupy.maximum(random.standard_normal((batch, h, w, 32), dtype=cupy.float32), 0).astype(cupy.float16)
    scale = np.float32((2.0 / (9 * 32)) ** 0.5)
    w1, w2 = ((random.standard_normal((32, 3, 3, 32), dtype=cupy.float32) * scale).astype(cupy.float16)
              for _ in range(2))  # fmt: skip
    b1, b2 = (random.standard_normal((32,), dtype=cupy.float32) * np.float32(0.1) for _ in range(2))
    return x, w1, b1, w2, b2


def _pair(block: BlockSpec, batch: int, x, w1, b1, w2, b2, flag):
    """(hidden, y) by our FP16 convolution kernel, one conv at a time (its 8 x 32 tile)."""
    import cupy

    from speakerd.engine.gpu import igemm

    hidden, y = cupy.empty_like(x), cupy.empty_like(x)
    stream = ordered_stream()
    bind, tile = igemm.IgemmConv.bind, (8, 32)
    first = bind(block.conv1, batch, Math.FP16, 32, "bias_relu", x, w1, b1, None, hidden, flag, tile)
    second = bind(block.conv2, batch, Math.FP16, 32, "bias_add_relu", hidden, w2, b2, x, y, flag, tile)
    with stream:
        first.launch(stream)
        second.launch(stream)
    stream.synchronize()
    return hidden, y


def _fused(block: BlockSpec, batch: int, variant, x, w1, b1, w2, b2, flag, hidden=None):
    import cupy

    from speakerd.engine.gpu import block as fused

    y = cupy.full_like(x, np.nan)
    stream = ordered_stream()
    sm_count = int(cupy.cuda.Device().attributes["MultiProcessorCount"])
    kernel = fused.BlockKernel.bind(block, batch, variant, x, w1, b1, w2, b2, y, flag, sm_count, hidden)
    with stream:
        kernel.launch(stream)
    stream.synchronize()
    return y


def _reference(x, w1, b1, w2, b2):
    """float64 block: relu(conv2(half(relu(conv1(x) + b1))) + b2 + x), the hidden activation
    rounded to half as the kernels store it (test_gpu_igemm's float64 convolution)."""
    import cupy

    hidden = conv_reference(x, w1, b1, None, 3, 1, True).reshape(x.shape).astype(cupy.float16)
    residual = x.astype(cupy.float64).reshape(-1, x.shape[-1])
    return conv_reference(hidden, w2, b2, residual, 3, 1, True).reshape(x.shape)


def _same_bits(a, b) -> int:
    """Elements whose bits differ."""
    from speakerd.engine.gpu.bitwise import bits

    return int((bits(a) != bits(b)).sum().get())


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}_b{s[2]}")
def test_fused_block_equals_two_convs_bit_for_bit(shape, capsys) -> None:
    import cupy

    from speakerd.engine.gpu import block as fused
    from speakerd.engine.gpu import igemm, maths

    h, w, batch = shape
    block = _block(h, w)
    x, w1, b1, w2, b2 = _operands(h, w, batch)
    flag = cupy.zeros((1,), dtype=cupy.int32)
    hidden_pair, y_pair = _pair(block, batch, x, w1, b1, w2, b2, flag)
    reference = _reference(x, w1, b1, w2, b2)
    bound = maths.of(Math.FP16).agreement
    for variant in fused.VARIANTS:
        name = "{}x{} w{}".format(*variant)
        y = _fused(block, batch, variant, x, w1, b1, w2, b2, flag)
        hidden = cupy.full_like(x, np.nan)
        y_taps = _fused(block, batch, variant, x, w1, b1, w2, b2, flag, hidden)
        error = igemm.relative_difference(y.astype(cupy.float64), reference)
        with capsys.disabled():
            print(f"\nblock {h}x{w} b{batch} {name}: vs float64 {error:.3e}", end="")
        assert _same_bits(y, y_pair) == 0, (
            f"{name}: {_same_bits(y, y_pair)} of {y.size} outputs differ from conv_f16 run twice"
        )
        assert _same_bits(y_taps, y) == 0, f"{name}: writing the hidden activation changed y"
        assert _same_bits(hidden, hidden_pair) == 0, (
            f"{name}: {_same_bits(hidden, hidden_pair)} hidden values differ from conv_f16's conv1"
        )
        assert error <= bound, f"{name}: {error:.3e} of the output scale from float64 (bound {bound:g})"
    assert int(flag.get()[0]) == 0, "the range flag was raised on data within FP16's range"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("where", ["hidden", "output"])
def test_range_flag_is_raised_where_a_value_overflows(where: str) -> None:
    """hidden: conv1's weights scaled so that its sums pass 65504. output: conv1's weights zero (hidden = 0),
    and b2 + x beyond 65504, so only the residual sum overflows."""
    import cupy

    from speakerd.engine.gpu import block as fused

    h, w, batch = 19, 45, 2
    block = _block(h, w)
    x, w1, b1, w2, b2 = _operands(h, w, batch, seed=5)
    if where == "hidden":
        w1 = (w1.astype(cupy.float32) * 20000).astype(cupy.float16)  # sums of ~1e5
    else:
        w1[...] = 0
        b1[...] = 0
        b2[...] = 60000.0
        x[...] = 10000.0
    for variant in fused.VARIANTS:
        flag = cupy.zeros((1,), dtype=cupy.int32)
        _fused(block, batch, variant, x, w1, b1, w2, b2, flag)
        assert int(flag.get()[0]) == 1, f"{variant}: {where} overflowed and the range flag stayed down"


@pytest.mark.gpu
@needs_gpu
def test_an_engine_serving_block_kernels_meets_the_fp16_bounds(folded_model, reference_cases, monkeypatch,
                                                               capsys) -> None:  # fmt: skip
    from speakerd.engine.gpu import autotune
    from speakerd.engine.gpu.engine import GpuEngine

    # served whether or not faster, so that this path is what is checked
    monkeypatch.setattr(autotune.BlockChoice, "wins", property(lambda choice: True))
    engine = GpuEngine(folded_model, Math.FP16, (1, 32), fused_blocks=True)
    bound = BOUNDS[Math.FP16]
    cases = {case.name: case for case in reference_cases}
    try:
        for batch, plan in engine.plans.items():
            assert [step.name for step in plan.blocks] == ["layer1.0", "layer1.1", "layer1.2"], plan.blocks
            assert engine.has_graph(batch), f"b{batch}: the captured forward did not replay eager's bits"
            rows = {row["conv"]: row for row in engine.conv_report(batch)}
            for step in plan.blocks:
                first, second = rows[f"{step.name}.conv1"], rows[f"{step.name}.conv2"]
                with capsys.disabled():
                    print(f"\nb{batch} {step.name}: {first['runs']} {first['ms']} ms, its two convolutions "
                          f"{first['block_pair_ms']} ms", end="")  # fmt: skip
                assert first["ms"] == round(step.choice.ms, 4) and second["ms"] == 0.0, (first, second)
        case = cases["mixed_b32"]
        expected = case.output.reshape(32, MAX_SPEAKERS, EMBEDDING_DIM)
        eager = engine.run_batch(case.fbank, case.masks, use_graph=False)
        graphed = engine.run_batch(case.fbank, case.masks)
        assert graphed.plans == ["b32/graph"] and eager.fp16_fallbacks == 0, graphed
        differ = int(np.count_nonzero(graphed.embeddings != eager.embeddings))
        assert differ == 0, f"b32: graph replay differs from eager in {differ} values"
        parity = compare(graphed.embeddings, expected)
        with capsys.disabled():
            print(f"\nb32 mixed_b32 fp16 blocks: min cosine {parity.min_cosine:.12f}, "
                  f"max abs {parity.max_abs:.3e}", end="")  # fmt: skip
        assert parity.min_cosine >= bound.min_cosine, f"b32: min cosine {parity.min_cosine:.9f}"
        first_b1 = cases["first_b1"]
        run = engine.run_batch(first_b1.fbank, first_b1.masks)
        parity = compare(run.embeddings, first_b1.output.reshape(1, MAX_SPEAKERS, EMBEDDING_DIM))
        assert run.plans == ["b1/graph"] and parity.min_cosine >= bound.min_cosine, (run.plans, parity)
        taps = engine.forward_with_taps(first_b1.fbank, first_b1.masks)
        assert list(taps) == list(TAP_NAMES), list(taps)
        for name in TAP_NAMES:
            reference = first_b1.taps[name]
            relative = float(np.max(np.abs(taps[name].astype(np.float64) - reference))) / float(
                np.max(np.abs(reference))
            )
            assert relative < bound.max_relative_abs, f"tap {name}: {relative:.3e} of its scale"
    finally:
        engine.close()


def test_entry_points_and_tiling_match_the_source() -> None:
    """block.py's entry points, tiles and shared-memory sizes are the .cu file's (no GPU)."""
    import re

    from speakerd.engine.gpu import block as fused
    from speakerd.engine.gpu import kernels

    source = kernels.kernel_sources()[fused.SOURCE]
    entries = re.findall(r"^F16B_ENTRY\((\d+), (\d+), (\d+)\)$", source, re.M)
    assert tuple((int(r), int(c), int(w)) for r, c, w in entries) == fused.VARIANTS, entries
    defines = {name: int(value) for name, value in re.findall(r"#define F16B_(\w+) (\d+)", source)}
    expected = {"PIXEL_WARPS": fused.PIXEL_WARPS, "C": fused.CHANNELS, "LD": fused.SHARED_ROW,
                "STAGE_LD": fused.STAGE_ROW, "TAPS": fused.TAPS}  # fmt: skip
    assert {k: defines[k] for k in expected} == expected, defines
    for rows, cols, warps in fused.VARIANTS:
        assert fused.shared_bytes(rows, cols) <= fused.BLOCK_SHARED_MAX, (rows, cols)
        assert rows * cols % (16 * fused.PIXEL_WARPS) == 0, "conv2's fragments split over the pixel warps"
        assert warps in (fused.PIXEL_WARPS, 2 * fused.PIXEL_WARPS), "the channels split over one or two warps"
    # 8 x 32: weights 2 x 9 x 32 x 48, halos 2 x 12 x 36 x 48, hidden 10 x 34 x 48, staged 256 x 40
    assert fused.shared_bytes(8, 32) == (2 * 9 * 32 * 48 + 2 * 12 * 36 * 48 + 10 * 34 * 48 + 256 * 40) * 2
    assert fused.tiles(32, 80, 998, 8, 32) == 32 * 10 * 32


def test_the_kernel_takes_layer1_blocks_only() -> None:
    from speakerd.engine.gpu import block as fused

    takes = [b.prefix for b in BLOCKS if not fused.why_not(b, Math.FP16)]
    assert takes == ["layer1.0", "layer1.1", "layer1.2"], takes
    assert "FP16 only" in fused.why_not(BLOCKS[0], Math.TF32)
    assert "shortcut" in fused.why_not(BLOCKS[3], Math.FP16)
    assert "32->32 k3 s1" in fused.why_not(BLOCKS[4], Math.FP16)
