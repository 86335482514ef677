"""FP16 mixed mode: our FP16 kernels against float64, and docs/parity.md's range rule.

- conv_f16.cu (halo implicit GEMM, FP16 MMAs accumulating in FP32) on every trunk shape
  class, every (channel tile, pixel tile) entry point, every epilogue, against a float64
  conv of the same half inputs: the only FP16 error left is the output's rounding to half
  (2^-11 relative), so F16_BOUND is a few of those, far below anything a wrong tap, channel
  or pixel would give.
  Every kernel also gives the same bits on a second launch and raises the range flag for
  weights that push its sums beyond 65504.
- Its split-K entry points (b1's layer3 and layer4 shapes): the same checks, and the same
  bits in a CUDA-graph replay.
- conv_wgmma.cu (Hopper's warpgroup MMA, compute capability 9.0 only; elsewhere skipped with
  the reason): the same bound, bits and flag on layer1's and layer2's shapes and a small one.
- The stem kernels (FP32 arithmetic; FP32 or FP16 out) against float64.
- The range flag: raised by an FP16 kernel whose output leaves FP16's range (weights scaled
  up) or meets a NaN, never on normal data.
- A fused cuDNN graph's range check (its AMAX reduction, read by the FP16 pooling kernel):
  the flag is raised for outputs beyond 65504 and stays down on normal data.
- The engine's fallback (docs/parity.md: a batch with an out-of-range value is recomputed without
  FP16): a model whose layer1.0.bn1 (our kernel runs its conv) or layer3.1.bn1 (a fused cuDNN
  graph runs it on the H200; the test prints what ran) is scaled by OVERFLOW_SCALE overflows FP16 in the
  trunk; the FP16 engine must flag the batch, recompute it in TF32, count it, and still
  meet the FP16 bound against the float64 forward of the same scaled model.
The tables printed: (shape, kernel, grid, epilogue, max |error| / max |reference|, flag,
same bits, registers, local memory).
"""

from __future__ import annotations

import numpy as np
import pytest

from speakerd.model.architecture import EMBEDDING_DIM, MAX_SPEAKERS, STEM, ConvSpec
from speakerd.model.numerics import BOUNDS, Math, compare
from tests.gpu_streams import ordered_stream
from tests.test_gpu_engine import needs_gpu
from tests.test_gpu_igemm import _reference, gpu_over_shapes, spec_of

#: Max |ours - float64| / max |float64| for our FP16 kernels: the half output is within
#: 2^-12 of the value (4.9e-4 of the scale at most after rounding to nearest, ~2.4e-4
#: typical), plus FP32 accumulation error (~1e-6).
F16_BOUND = 1e-3
#: The FP32 stem: nine FMAs per output, FP32 rounding only.
STEM_F32_BOUND = 1e-6
#: Scale of layer1.0.bn1's affine (weight and bias) in the forced-overflow model: the
#: synthetic model's activations are O(10), so its hidden activations reach ~1e5 > 65504
#: while every weight stays inside FP16's range (the FP16 engine can load it).
OVERFLOW_SCALE = 1e4


def _f16_inputs(spec: ConvSpec, batch: int, seed: int = 11):
    """(x, w, bias, residual) as the FP16 kernels take them: half NHWC x, half KRSC w with
    He scaling, float32 bias, half residual."""
    import cupy

    random = cupy.random.RandomState(seed)
    x = random.standard_normal((batch, spec.h_in, spec.w_in, spec.cin), dtype=cupy.float32).astype(
        cupy.float16
    )
    scale = np.float32((2.0 / (spec.kernel**2 * spec.cin)) ** 0.5)
    w = (
        random.standard_normal((spec.cout, spec.kernel, spec.kernel, spec.cin), dtype=cupy.float32) * scale
    ).astype(cupy.float16)
    bias = random.standard_normal((spec.cout,), dtype=cupy.float32)
    pixels = batch * spec.h_out * spec.w_out
    residual = random.standard_normal((pixels, spec.cout), dtype=cupy.float32).astype(cupy.float16)
    return x, w, bias, residual


def _run(conv, y, flag, stream) -> int:
    """Launch over a NaN-poisoned output with the flag cleared; the flag afterwards."""
    with stream:
        y.fill(float("nan"))
        flag.fill(0)
        conv.launch(stream)
    stream.synchronize()
    return int(flag.get()[0])


def _where_wrong(ours, reference, spec: ConvSpec, batch: int) -> str:
    """Where `ours` (rows = output pixels, NHWC) is not within F16_BOUND of `reference`: the
    share wrong and the first few as (image, row, column % 64, channel), which tells a wrong
    operand layout (a pattern over columns or channels) from a wrong edge (the last tile)."""
    import cupy

    scale = float(cupy.abs(reference).max())
    wrong = ~(cupy.abs(ours.astype(cupy.float64) - reference) <= F16_BOUND * scale)
    where = cupy.argwhere(wrong.reshape(batch, spec.h_out, spec.w_out, spec.cout)).get()[:6]
    first = ", ".join(f"({i}, {r}, {c % 64}, {ch})" for i, r, c, ch in where)
    return f"{float(wrong.mean()):.1%} wrong, first (image, row, col % 64, channel): {first}"


def _f16_kernel_failures(spec: ConvSpec, batch: int, variants, capsys, replay: bool = False,
                         sm_count: int | None = None) -> list[str]:  # fmt: skip
    """Every variant (igemm.Variant: conv_f16.cu's, split or not, or conv_wgmma.cu's) on
    `spec` at `batch`, every epilogue the shape has, each over a NaN-poisoned output: what
    fails of within F16_BOUND of float64 with no flag, the same bits on a second launch (and
    in a CUDA-graph replay with `replay`), no spills, and the flag raised by weights pushing
    the sums beyond 65504. `sm_count` sizes conv_wgmma.cu's persistent grids (default: the
    device's). Prints a row per run: shape, kernel, grid, epilogue, error, flag, repeat,
    registers, local memory."""
    import cupy

    from speakerd.engine.gpu import igemm, kernels
    from speakerd.engine.gpu.context import SplitScratch

    x, weight, bias, residual = _f16_inputs(spec, batch)
    y = cupy.empty((batch * spec.h_out * spec.w_out, spec.cout), dtype=cupy.float16)
    flag = cupy.zeros((1,), dtype=cupy.int32)
    stream = ordered_stream()
    scratch = SplitScratch(stream)
    sm_count = sm_count or int(cupy.cuda.Device().attributes["MultiProcessorCount"])

    def bind(variant, epilogue: str, w, add):
        return igemm.IgemmConv.of(variant, spec, batch, Math.FP16, epilogue, x, w, bias, add, y, flag,
                                  scratch, sm_count)  # fmt: skip

    failures = []
    square = spec.stride == 1 and spec.cin == spec.cout
    for epilogue in ["bias_only", "bias_relu"] + (["bias_add_relu"] if square else []):
        add = residual if epilogue == "bias_add_relu" else None
        wide = None if add is None else add.astype(cupy.float64)
        reference = _reference(x.astype(cupy.float32), weight.astype(cupy.float32), bias, wide, spec.kernel,
                               spec.stride, epilogue != "bias_only")  # fmt: skip
        for variant in variants:
            conv = bind(variant, epilogue, weight, add)
            raised = _run(conv, y, flag, stream)
            first = y.copy()
            error = igemm.relative_difference(first.astype(cupy.float64), reference)
            again = _run(conv, y, flag, stream) == 0 and bool((y == first).all())
            if replay:
                with stream:
                    y.fill(float("nan"))
                    stream.begin_capture()
                    conv.launch(stream)
                    stream.end_capture().launch(stream)
                stream.synchronize()
                again = again and bool((y == first).all())
            function = kernels.entry(conv.source, conv.name, conv.shared)
            with capsys.disabled():
                print(f"\n{spec.cin}->{spec.cout} {spec.h_in}x{spec.w_in} k{spec.kernel}s{spec.stride} "
                      f"b{batch}  {conv.name:<28} grid {conv.grid} {epilogue:<14} {error:.3e} flag {raised}  "
                      f"same bits {again}  regs {function.num_regs} local {function.local_size_bytes}",
                      end="")  # fmt: skip
            if not error <= F16_BOUND or raised:
                failures.append(f"{conv.name} {epilogue}: error {error:.3e} (bound {F16_BOUND:g}), "
                                f"flag {raised}; {_where_wrong(first, reference, spec, batch)}")  # fmt: skip
            if not again:
                failures.append(f"{conv.name} {epilogue}: other bits on a launch{' or replay' * replay}")
            if function.local_size_bytes:
                failures.append(f"{conv.name}: {function.local_size_bytes} bytes of local memory (spills)")
    huge = (weight.astype(cupy.float32) * 1e5 / 3).astype(cupy.float16)  # sums ~1e5, every weight finite
    assert bool(cupy.isfinite(huge).all())
    for variant in variants:
        loud = bind(variant, "bias_only", huge, None)
        if _run(loud, y, flag, stream) != 1:
            failures.append(f"{loud.name}: no flag for outputs beyond 65504")
    return failures


@gpu_over_shapes
def test_f16_kernel_matches_float64(shape, capsys) -> None:
    """Every unsplit conv_f16.cu entry point (channel and pixel tile) for the shape."""
    from speakerd.engine.gpu import igemm

    spec, batch = spec_of(shape), shape[-1]
    variants = igemm.candidates_for(spec, Math.FP16)  # no SM count: unsplit only
    assert variants, f"{spec}: no FP16 tile"
    failures = _f16_kernel_failures(spec, batch, variants, capsys)
    assert not failures, failures


#: The b1 convolutions split-K serves (igemm.F16_SPLITS): layer3's and layer4's 3x3 stride-1
#: convolutions and layer4.0.conv1 (3x3 stride 2), as (cin, cout, h, w, kernel, stride).
SPLIT_SHAPES = [(128, 128, 20, 250, 3, 1), (256, 256, 10, 125, 3, 1), (128, 256, 20, 250, 3, 2)]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape", SPLIT_SHAPES, ids=lambda s: f"{s[0]}->{s[1]}_{s[2]}x{s[3]}_k{s[4]}s{s[5]}")
def test_f16_split_kernels_match_float64_and_repeat_bit_for_bit(shape, capsys) -> None:
    """Every split-K entry point the b1 plan may time for the shape (igemm.candidates_for
    with this device's SMs); a CUDA-graph replay gives the same bits too (the last block of
    each tile adds the splits in a fixed order and sets the tile's ticket back to zero: a
    ticket left over would leave the tile unwritten, NaN)."""
    import cupy

    from speakerd.engine.gpu import igemm

    cin, cout, h, w, kernel, stride = shape
    spec = ConvSpec("test", "test", cin, cout, kernel, stride, h, w)
    sm_count = int(cupy.cuda.Device().attributes["MultiProcessorCount"])
    variants = [v for v in igemm.candidates_for(spec, Math.FP16, 1, sm_count) if v.split > 1]
    assert variants, f"{spec}: no split-K variant at b1 on {sm_count} SMs"
    failures = _f16_kernel_failures(spec, 1, variants, capsys, replay=True)
    assert not failures, failures


#: conv_wgmma.cu's shapes, (cin, cout, h, w, batch, SMs the grid is sized for: None for
#: the device's): layer1, layer2 and layer3 at b1 (3x3 stride 1), each block walking one
#: or two tiles; a small image whose 140 columns leave part of a 64-pixel tile and whose
#: rows part of a row tile; and layer1 on a grid sized for 2 SMs, so that each block walks
#: ~80 tiles through both halo stages in turn.
WGMMA_SHAPES = [(32, 32, 80, 998, 2, None), (64, 64, 40, 499, 2, None), (128, 128, 20, 250, 1, None),
                (32, 64, 13, 140, 3, None), (32, 32, 80, 998, 2, 2)]  # fmt: skip


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape", WGMMA_SHAPES, ids=lambda s: f"{s[0]}-{s[1]}_{s[2]}x{s[3]}_b{s[4]}_{s[5]}sm")
def test_wgmma_kernels_match_float64(shape, capsys) -> None:
    """Every conv_wgmma.cu entry point for the shape (compute capability 9.0 only; elsewhere
    skipped with the reason), its persistent walk replayed in a CUDA graph too. A mismatch
    says where it is."""
    import cupy

    from speakerd.engine.gpu import igemm

    cin, cout, h, w, batch, sm_count = shape
    spec = ConvSpec("test", "test", cin, cout, 3, 1, h, w)
    capability = str(cupy.cuda.Device().compute_capability)
    why = igemm.wgmma_why_not(spec, Math.FP16, capability)
    if why:
        pytest.skip(why)
    variants = igemm.wgmma_candidates_for(spec, Math.FP16, capability)
    failures = _f16_kernel_failures(spec, batch, variants, capsys, replay=True, sm_count=sm_count)
    assert not failures, failures


@pytest.mark.gpu
@needs_gpu
def test_f16_kernel_flags_values_out_of_half_range() -> None:
    import cupy

    from speakerd.engine.gpu import igemm

    spec = ConvSpec("test", "test", 64, 64, 3, 1, 12, 140)
    x, weight, bias, _ = _f16_inputs(spec, 2)
    y = cupy.empty((2 * spec.h_out * spec.w_out, spec.cout), dtype=cupy.float16)
    flag = cupy.zeros((1,), dtype=cupy.int32)
    stream = ordered_stream()
    pixels = igemm.F16_PIXEL_TILES[(3, 1, 64)][0]  # the range check is the same code in every tile
    normal = igemm.IgemmConv.bind(spec, 2, Math.FP16, 64, "bias_relu", x, weight, bias, None, y, flag, pixels)
    assert _run(normal, y, flag, stream) == 0, "flag raised on normal data"
    # outputs ~ 1e5: every weight still a finite half (max ~ 4e3), the sums beyond 65504
    huge = (weight.astype(cupy.float32) * 1e5 / 3).astype(cupy.float16)
    assert bool(cupy.isfinite(huge).all())
    overflow = igemm.IgemmConv.bind(spec, 2, Math.FP16, 64, "bias_only", x, huge, bias, None, y, flag, pixels)
    assert _run(overflow, y, flag, stream) == 1, "no flag for outputs beyond 65504"
    poisoned = x.copy()
    poisoned[1, 5, 70, 3] = float("nan")
    nan = igemm.IgemmConv.bind(
        spec, 2, Math.FP16, 64, "bias_only", poisoned, weight, bias, None, y, flag, pixels
    )
    assert _run(nan, y, flag, stream) == 1, "no flag for a NaN input"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("epilogue", ["bias_relu", "bias_add_relu", "bias_only"])
def test_fused_cudnn_graph_range_check_raises_the_flag_through_the_pool_kernel(epilogue, capsys) -> None:
    """A fused FP16 cuDNN graph (conv + epilogue + its AMAX reduction, convs.build_graph)
    writes the largest magnitude of its result into its slot; the FP16 pooling kernel reads
    the slots, raises the range flag for one beyond 65504 and clears them. Normal data: the
    slot holds the output's true max and the flag stays down; weights pushing outputs past
    65504: the flag is raised. The output agrees with float64 like our kernels'."""
    import cudnn
    import cupy

    from speakerd.engine.gpu import igemm, kernels
    from speakerd.engine.gpu.convs import ConvKey, time_plans
    from speakerd.model.architecture import TRUNK_CHANNELS, TRUNK_FRAMES, TRUNK_MELS

    spec = ConvSpec("test", "test", 128, 128, 3, 1, 20, 250)
    batch = 2
    x, weight, bias, residual = _f16_inputs(spec, batch)
    huge = (weight.astype(cupy.float32) * 1e5 / 3).astype(cupy.float16)
    assert bool(cupy.isfinite(huge).all())
    y = cupy.empty((batch * spec.h_out * spec.w_out, spec.cout), dtype=cupy.float16)
    amax = cupy.zeros((4,), dtype=cupy.float32)
    flag = cupy.zeros((1,), dtype=cupy.int32)
    stream = ordered_stream()
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=stream.ptr)
    add = residual if epilogue == "bias_add_relu" else None
    buffers = {"X": x.data.ptr, "W": weight.data.ptr, "Y": y.data.ptr, "B": bias.data.ptr,
               "A": amax[2:3].data.ptr}  # fmt: skip
    if add is not None:
        buffers["Z"] = add.data.ptr
    key = ConvKey.of(spec, batch, Math.FP16, epilogue)
    # a trunk output and masks for the pooling kernel: its pooling is not what is tested
    trunk = cupy.zeros((1, TRUNK_MELS, TRUNK_FRAMES, TRUNK_CHANNELS), dtype=cupy.float16)
    masks = cupy.ones((1, MAX_SPEAKERS, TRUNK_FRAMES), dtype=cupy.float32)
    frames = cupy.full((1,), TRUNK_FRAMES, dtype=cupy.int32)
    pooled = cupy.empty((MAX_SPEAKERS, 2 * TRUNK_CHANNELS * TRUNK_MELS), dtype=cupy.float32)
    active = cupy.empty((MAX_SPEAKERS,), dtype=cupy.int32)
    pool = kernels.function("stats_pool_f16")
    try:
        graph = time_plans(key, handle, stream, buffers)
        rows = []
        for name, w in (("normal", weight), ("huge", huge)):
            pack = graph.pack(dict(buffers, W=w.data.ptr))
            workspace = cupy.empty((max(1, graph.workspace_bytes),), dtype=cupy.uint8)
            with stream:
                flag.fill(0)
                amax.fill(0)
                graph.execute(pack, workspace.data.ptr, handle)
                slot = float(amax[2].get())
                true_max = float(cupy.abs(y.astype(cupy.float32)).max().get())
                pool((1, TRUNK_MELS), (TRUNK_CHANNELS,),
                     (trunk, masks, frames, pooled, active, amax, np.int32(amax.size), flag))  # fmt: skip
                raised, left = int(flag.get()[0]), float(cupy.abs(amax).max().get())
            rows.append((name, slot, true_max, raised, left))
            if name == "normal":
                reference = _reference(x.astype(cupy.float32), weight.astype(cupy.float32), bias,
                                       None if add is None else add.astype(cupy.float64), 3, 1,
                                       epilogue != "bias_only")  # fmt: skip
                error = igemm.relative_difference(y.astype(cupy.float64), reference)
    finally:
        cudnn.destroy_handle(handle)
    with capsys.disabled():
        print(f"\nfused FP16 {key.label()} ({graph.plan_name}, {graph.ms:.4f} ms): error {error:.3e}; "
              + "; ".join(f"{n}: slot {s:.6g}, |y| max {t:.6g}, flag {r}, slots after pool {a:g}"
                          for n, s, t, r, a in rows))  # fmt: skip
    (_, slot, true_max, raised, left), (_, huge_slot, _, huge_raised, huge_left) = rows
    assert error <= F16_BOUND, f"fused output differs from float64 by {error:.3e} (bound {F16_BOUND:g})"
    # the slot holds the max of the result as rounded to half (H200) or before it: within a half ulp
    assert abs(slot - true_max) <= true_max * 2**-10 and raised == 0 and left == 0, rows[0]
    assert not huge_slot <= 65504 and huge_raised == 1 and huge_left == 0, rows[1]


@pytest.mark.gpu
@needs_gpu
def test_stem_kernels_match_float64(capsys) -> None:
    import cupy

    from speakerd.engine.gpu.igemm import relative_difference
    from speakerd.engine.gpu.stem import StemConv

    batch = 3
    random = cupy.random.RandomState(5)
    x = random.standard_normal((batch, STEM.h_in, STEM.w_in), dtype=cupy.float32) * 4
    w = random.standard_normal((STEM.cout, 3, 3, 1), dtype=cupy.float32) * np.float32(0.4)
    bias = random.standard_normal((STEM.cout,), dtype=cupy.float32)
    reference = _reference(x[..., None], w, bias, None, 3, 1, True)
    flag = cupy.zeros((1,), dtype=cupy.int32)
    stream = ordered_stream()
    for math, dtype, bound in (
        (Math.TF32, cupy.float32, STEM_F32_BOUND),
        (Math.FP16, cupy.float16, F16_BOUND),
    ):
        y = cupy.empty((batch * STEM.h_out * STEM.w_out, STEM.cout), dtype=dtype)
        stem = StemConv.bind(batch, math, x, w, bias, y, flag if math == Math.FP16 else None)
        raised = _run(stem, y, flag, stream)
        error = relative_difference(y.astype(cupy.float64), reference)
        with capsys.disabled():
            print(f"\nstem b{batch} {stem.name}: {error:.3e} (bound {bound:g}), flag {raised}", end="")
        assert error <= bound and raised == 0, (stem.name, error, raised)
    y = cupy.empty((batch * STEM.h_out * STEM.w_out, STEM.cout), dtype=cupy.float16)
    loud = StemConv.bind(batch, Math.FP16, x * 1e5, w, bias, y, flag)
    assert _run(loud, y, flag, stream) == 1, "the FP16 stem did not flag outputs beyond 65504"


@pytest.mark.gpu
@needs_gpu
# on the H200 our kernel runs layer1.0.conv1 at b1, a fused cuDNN graph layer3.1.conv1
@pytest.mark.parametrize("block", ["layer1.0", "layer3.1"])
def test_fp16_overflow_is_recomputed_in_tf32_and_meets_the_bound(
    block, weights_path, reference_cases, capsys
) -> None:
    from speakerd.engine.gpu.engine import GpuEngine
    from speakerd.model.forward import forward_float64
    from speakerd.model.weights import fold_state_dict, load_state_dict

    state = load_state_dict(weights_path)
    for field in ("weight", "bias"):
        key = f"resnet.{block}.bn1.{field}"
        state[key] = (state[key] * OVERFLOW_SCALE).astype(np.float32)
    model = fold_state_dict(state, "overflow-test")
    case = next(c for c in reference_cases if c.name == "first_b1")
    expected = forward_float64(state, case.fbank, case.masks)["output"]
    engine = GpuEngine(model, Math.FP16, (1,))
    try:
        taps = engine.forward_with_taps(case.fbank, case.masks)
        hidden = float(np.max(np.abs(taps[f"{block}.hidden"])))
        runner = next(c.runner for c in engine.plans[1].convs if c.name == f"{block}.conv1")
        run = engine.run_batch(case.fbank, case.masks)
        again = engine.run_batch(case.fbank, case.masks)
    finally:
        engine.close()
    parity = compare(run.embeddings, expected.reshape(1, MAX_SPEAKERS, EMBEDDING_DIM))
    with capsys.disabled():
        print(f"\nforced overflow ({block}.bn1 x {OVERFLOW_SCALE:g}, {block}.conv1 run by {runner}): "
              f"FP16 {block}.hidden max |x| {hidden:.4g}; "
              f"plans {run.plans}, fallbacks {run.fp16_fallbacks}; vs float64: min cosine "
              f"{parity.min_cosine:.9f}, max abs {parity.max_abs:.3e}")  # fmt: skip
    assert not np.isfinite(hidden) or hidden > 65504, f"the scaled model did not overflow FP16 ({hidden})"
    assert run.fp16_fallbacks == 1 and again.fp16_fallbacks == 1, (run, again)
    assert run.plans == ["b1/graph", "b1/tf32-fallback"], run.plans
    assert parity.min_cosine >= BOUNDS[Math.FP16].min_cosine, f"fallback min cosine {parity.min_cosine:.9f}"
    assert np.array_equal(run.embeddings, again.embeddings), "two fallback runs differ"
