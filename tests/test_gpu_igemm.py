"""Our tensor-core convolution kernel (kernels/conv_igemm.cu) against a float64 convolution.

Every shape class of the trunk the kernel may take (3x3 stride 1 and 2, the 1x1 stride-2
shortcut, 32 to 256 channels), every channel tile, both maths, every epilogue. The bounds
say what the modes promise: FP32 mode (3xTF32) at most FP32_VS_CUDNN times the error of
cuDNN's fastest strict-FP32 plan on the same inputs (an FP32 dot product's error grows with
its length, so the yardstick is the strict engine, not a constant) and at least FP32_GAIN
times closer than one TF32 MMA, so FP32 mode is not TF32 in disguise; TF32 within
TF32_BOUND. The table printed is (shape, math, tile, epilogue, max |error| / max
|reference|), cuDNN strict FP32's conv first.
"""

from __future__ import annotations

import numpy as np
import pytest

from speakerd.model.architecture import ConvSpec
from speakerd.model.numerics import Math
from tests.gpu_streams import ordered_stream
from tests.test_gpu_engine import needs_gpu
from tests.test_kernels_compile import NO_NVRTC

#: (cin, cout, h, w, kernel, stride, batch): layer1 and layer2.0.conv1 at 80x998, the
#: layer3.0 shortcut, layer4's 3x3 conv.
SHAPES = [
    (32, 32, 80, 998, 3, 1, 2),
    (32, 64, 80, 998, 3, 2, 2),
    (64, 128, 40, 499, 1, 2, 3),
    (256, 256, 10, 125, 3, 1, 5),
]
#: 3xTF32 drops the lo*lo term and the tensor cores accumulate with their own rounding, so
#: ours may sit a few times above a strict FMA engine and still be FP32-accurate (TF32 is
#: ~500x above it).
FP32_VS_CUDNN = 4.0
TF32_BOUND = 5e-3
FP32_GAIN = 20.0


def _reference(x, w, bias, residual, kernel: int, stride: int, relu: bool):
    """float64 NHWC conv (KRSC weights) + bias (+ residual) (+ ReLU), by im2col on the GPU."""
    import cupy

    pad = kernel // 2
    n, h, wd, c = x.shape
    ho, wo = (h + 2 * pad - kernel) // stride + 1, (wd + 2 * pad - kernel) // stride + 1
    padded = cupy.pad(x.astype(cupy.float64), ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    taps = [
        padded[:, dh : dh + stride * ho : stride, dw : dw + stride * wo : stride, :]
        for dh in range(kernel)
        for dw in range(kernel)
    ]
    patches = cupy.concatenate(taps, axis=3).reshape(n * ho * wo, kernel * kernel * c)
    out = patches @ w.reshape(w.shape[0], -1).astype(cupy.float64).T + bias.astype(cupy.float64)
    if residual is not None:
        out += residual.reshape(out.shape)
    return cupy.maximum(out, 0.0) if relu else out


def _cudnn_strict(spec: ConvSpec, batch: int, x, weight):
    """The conv by cuDNN's fastest strict-FP32 plan (what the engine's FP32 mode would use)."""
    import cudnn
    import cupy

    from speakerd.engine.gpu.convs import ConvKey, time_plans

    handle = cudnn.create_handle()
    stream = ordered_stream()
    cudnn.set_stream(handle=handle, stream=stream.ptr)
    y = cupy.empty((batch * spec.h_out * spec.w_out, spec.cout), dtype=cupy.float32)
    buffers = {"X": x.data.ptr, "W": weight.data.ptr, "Y": y.data.ptr}
    graph = time_plans(ConvKey.of(spec, batch, Math.FP32, None), handle, stream, buffers)
    workspace = cupy.empty((max(1, graph.workspace_bytes),), dtype=cupy.uint8)
    with stream:
        graph.execute(graph.pack(buffers), workspace.data.ptr, handle)
    stream.synchronize()
    cudnn.destroy_handle(handle)
    return y, graph.plan_name


def shape_id(shape: tuple[int, ...]) -> str:
    cin, cout, h, w, kernel, stride, _ = shape
    return f"{cin}->{cout}_{h}x{w}_k{kernel}s{stride}"


def gpu_over_shapes(test):
    """A GPU test run once per SHAPES entry, with readable ids."""
    return pytest.mark.gpu(needs_gpu(pytest.mark.parametrize("shape", SHAPES, ids=shape_id)(test)))


def spec_of(shape: tuple[int, ...]) -> ConvSpec:
    cin, cout, h, w, kernel, stride, _ = shape
    return ConvSpec("test", "test", cin, cout, kernel, stride, h, w)


@gpu_over_shapes
def test_kernel_matches_float64(shape, capsys) -> None:
    import cupy

    from speakerd.engine.gpu import igemm

    cin, cout, h, w, kernel, stride, batch = shape
    spec = spec_of(shape)
    random = cupy.random.RandomState(7)
    x = random.standard_normal((batch, h, w, cin), dtype=cupy.float32)
    weight = random.standard_normal((cout, kernel, kernel, cin), dtype=cupy.float32) * np.float32(
        (2.0 / (kernel * kernel * cin)) ** 0.5
    )
    bias = random.standard_normal((cout,), dtype=cupy.float32)
    pixels = batch * spec.h_out * spec.w_out
    residual = random.standard_normal((pixels, cout), dtype=cupy.float32)
    y = cupy.empty((pixels, cout), dtype=cupy.float32)
    stream = ordered_stream()
    epilogues = ["bias_only", "bias_relu"] + (["bias_add_relu"] if stride == 1 and cin == cout else [])
    errors: dict[tuple[str, int, str], float] = {}
    strict, plan = _cudnn_strict(spec, batch, x, weight)
    for epilogue in epilogues:
        add = residual if epilogue == "bias_add_relu" else None
        relu = epilogue != "bias_only"
        reference = _reference(x, weight, bias, add, kernel, stride, relu)
        cudnn_out = strict.astype(cupy.float64) + bias.astype(cupy.float64) + (0.0 if add is None else add)
        errors[("cudnn", 0, epilogue)] = igemm.relative_difference(
            cupy.maximum(cudnn_out, 0.0) if relu else cudnn_out, reference
        )
        with capsys.disabled():
            print(f"\n{cin}->{cout} {h}x{w} k{kernel}s{stride} b{batch}  cudnn {plan[:12]:<12} "
                  f"{epilogue:<14} {errors[('cudnn', 0, epilogue)]:.3e}", end="")  # fmt: skip
        for math in (Math.FP32, Math.TF32):
            tiles = igemm.tiles_for(spec, math)
            assert tiles, f"{spec.cin}->{spec.cout}: no tile for {math}"
            for tile in tiles:
                conv = igemm.IgemmConv.bind(spec, batch, math, tile, epilogue, x, weight, bias, add, y)
                with stream:
                    y.fill(float("nan"))
                    conv.launch(stream)
                stream.synchronize()
                error = igemm.relative_difference(y.astype(cupy.float64), reference)
                errors[(str(math), tile, epilogue)] = error
                with capsys.disabled():
                    print(f"\n{cin}->{cout} {h}x{w} k{kernel}s{stride} b{batch}  {math!s:<5} n{tile:<3} "
                          f"{epilogue:<14} {error:.3e}", end="")  # fmt: skip
    for (math, tile, epilogue), error in errors.items():
        if math == "fp32":
            tf32, cudnn_error = errors[("tf32", tile, epilogue)], errors[("cudnn", 0, epilogue)]
            assert error <= FP32_VS_CUDNN * cudnn_error, (
                f"3xTF32 n{tile} {epilogue}: {error:.3e} > {FP32_VS_CUDNN:g} x cuDNN strict {cudnn_error:.3e}"
            )
            assert error * FP32_GAIN <= tf32, (
                f"3xTF32 n{tile} {epilogue}: {error:.3e} is not {FP32_GAIN:g}x below TF32's {tf32:.3e}"
            )
        elif math == "tf32":
            assert error <= TF32_BOUND, f"TF32 n{tile} {epilogue}: {error:.3e} > {TF32_BOUND:g}"


def test_kernel_names_and_tiling_match_the_source() -> None:
    """The Python side's entry points and tiling constants are the .cu file's (no GPU)."""
    import re

    from speakerd.engine.gpu import igemm, kernels

    source = kernels.kernel_sources()[igemm.SOURCE]
    defined = set(re.findall(r'extern "C" __global__ __launch_bounds__\([^)]*\) void (\w+)', source))
    assert set(igemm.KERNEL_NAMES) <= defined, (
        f"missing from {igemm.SOURCE}: {set(igemm.KERNEL_NAMES) - defined}"
    )
    defines = {name: int(value) for name, value in re.findall(r"#define IGEMM_(\w+) (\d+)", source)}
    expected = {"BM": igemm.BLOCK_PIXELS, "THREADS": igemm.THREADS, "STAGES": igemm.STAGES,
                "LDS": igemm.SHARED_ROW, "BK": igemm.CHANNEL_STEP}  # fmt: skip
    assert {k: defines[k] for k in expected} == expected, defines
    f16 = kernels.kernel_sources()[igemm.F16_SOURCE]
    entries = re.findall(r"^F16_ENTRY\((\d), (\d), (\d+), (\d+), (\d+), (\w+)\)$", f16, re.M)
    f16_defined = {f"conv_f16_r{r}s{s}_n{tile}_{rows}x{cols}" for r, s, tile, rows, cols, _ in entries}
    split_entries = re.findall(
        r"^F16_SPLIT_ENTRY\((\d), (\d), (\d+), (\d+), (\d+), (\w+), (\d+)\)$", f16, re.M
    )
    f16_defined |= {
        f"conv_f16_r{r}s{s}_n{t}_{rows}x{cols}_sk{k}" for r, s, t, rows, cols, _, k in split_entries
    }
    assert set(igemm.F16_KERNEL_NAMES) == f16_defined, (igemm.F16_KERNEL_NAMES, f16_defined)
    assert len(igemm.F16_KERNEL_NAMES) == len(entries) + len(split_entries), "an entry point listed twice"
    splits: dict[tuple[int, int, int, tuple[int, int]], list[int]] = {}
    bounds = {(r, s, t, rows, cols): blocks for r, s, t, rows, cols, blocks in entries}
    for r, s, t, rows, cols, blocks, k in split_entries:
        splits.setdefault((int(r), int(s), int(t), (int(rows), int(cols))), []).append(int(k))
        assert blocks == bounds[(r, s, t, rows, cols)], f"{r}x{r} s{s} n{t} split {k}: launch bounds"
    assert splits == {key: list(ks) for key, ks in igemm.F16_SPLITS.items()}, splits
    pixel_tiles: dict[tuple[int, int, int], list[tuple[int, int]]] = {}
    for r, s, tile, rows, cols, _ in entries:
        pixel_tiles.setdefault((int(r), int(s), int(tile)), []).append((int(rows), int(cols)))
    assert pixel_tiles == {key: list(tiles) for key, tiles in igemm.F16_PIXEL_TILES.items()}, pixel_tiles
    assert {(r, s) for r, s, _ in igemm.F16_PIXEL_TILES} == set(igemm.F16_SHAPES)
    f16_defines = {name: int(value) for name, value in re.findall(r"#define F16_(\w+) (\d+)", f16)}
    f16_expected = {"THREADS": igemm.F16_THREADS, "CHUNK": igemm.F16_CHUNK, "LDB": igemm.F16_LDB,
                    "OUT_PAD": igemm.F16_OUT_PAD, "BLOCKS_PER_SM": 2, "BLOCKS_PER_SM_WIDE": 1}  # fmt: skip
    assert {k: f16_defines[k] for k in f16_expected} == f16_expected, f16_defines
    # every entry point fits one block's 227 KB; two blocks share an SM (228 KB, 1 KB reserved
    # per block) wherever the launch bounds ask for two (every 3x3 stride-1 and 1x1 entry)
    for r, s, tile, rows, cols, blocks in entries:
        shared = igemm.f16_shared_bytes(int(r), int(s), int(tile), int(rows), int(cols))
        name = f"conv_f16_r{r}s{s}_n{tile}_{rows}x{cols}"
        assert shared <= igemm.BLOCK_SHARED_MAX, (name, shared)
        warps_per_row = int(cols) // (int(rows) * int(cols) // 8)
        assert int(rows) * warps_per_row == 8 and int(cols) * int(rows) // 8 in (16, 32), name
        if blocks == "F16_BLOCKS_PER_SM":
            assert 2 * (shared + 1024) <= 228 * 1024, (name, shared)
        else:
            assert (int(r), int(s)) == (3, 2), f"{name}: only 3x3 stride 2 keeps one block per SM"
    assert igemm.f16_shared_bytes(3, 1, 64, 2, 128) == (4 * 130 * 48 + 9 * 64 * 48) * 2
    assert igemm.f16_shared_bytes(3, 1, 32, 8, 32) == (10 * 34 * 48 + 9 * 32 * 48) * 2
    assert igemm.f16_shared_bytes(3, 2, 64, 1, 128) == (3 * 257 * 40 + 9 * 64 * 48) * 2
    assert igemm.f16_shared_bytes(1, 2, 64, 2, 128) == 2 * 128 * (64 + 8) * 4, "staged outputs dominate"
    # layer2's b1 conv: 80 blocks of 2 x 128 (too few for 132 SMs), 160 of 1 x 128
    layer2 = ConvSpec("l2", "bn", 64, 64, 3, 1, 40, 499)
    assert igemm.f16_grid(layer2, 1, 64, 2, 128) == (1, 4, 20)
    assert igemm.f16_grid(layer2, 1, 64, 1, 128) == (1, 4, 40)
    layer1 = ConvSpec("l1", "bn", 32, 32, 3, 1, 80, 998)
    assert igemm.f16_grid(layer1, 32, 32, 8, 32) == (1, 32, 32 * 10)
    assert igemm.f16_grid(layer1, 32, 32, 4, 64) == (1, 16, 32 * 20)
    assert igemm.candidates_for(layer1, Math.FP16) == tuple(
        igemm.Variant(32, p) for p in igemm.F16_PIXEL_TILES[(3, 1, 32)]
    )
    assert igemm.candidates_for(layer1, Math.TF32) == (igemm.Variant(32, None),)
    # split K at b1 on the H200's 132 SMs: layer3 (80 blocks of 1 x 128 x 64 channels, four
    # 32-channel chunks: 2 or 4 ways), layer4 (40 blocks, eight chunks: 2, 4 or 8 ways); never
    # at b32, where the grids fill the GPU; never without the SM count
    layer3 = ConvSpec("l3", "bn", 128, 128, 3, 1, 20, 250)
    layer4 = ConvSpec("l4", "bn", 256, 256, 3, 1, 10, 125)
    assert igemm.f16_grid(layer3, 1, 64, 1, 128) == (2, 2, 20)
    assert igemm.f16_grid(layer3, 1, 64, 1, 128, split=4) == (2, 2, 80)
    assert igemm.splits_for(layer3, 1, 64, (1, 128), 132) == (1, 2, 4)
    assert igemm.splits_for(layer4, 1, 64, (1, 128), 132) == (1, 2, 4, 8)
    assert igemm.splits_for(layer4, 1, 32, (1, 128), 132) == (1, 2, 4)
    assert igemm.splits_for(layer4, 1, 64, (2, 128), 132) == (1,), "only 1 x 128 tiles split"
    assert igemm.splits_for(layer4, 7, 64, (1, 128), 132) == (1,), "7 x 40 blocks fill 132 SMs twice"
    assert igemm.splits_for(layer4, 1, 64, (1, 128), None) == (1,)
    assert all(v.split == 1 for v in igemm.candidates_for(layer3, Math.FP16, 32, 132))
    assert igemm.candidates_for(layer4, Math.FP16, 1, 132).count(igemm.Variant(64, (1, 128), 8)) == 1
    assert igemm.kernel_name(Math.FP16, 64, 3, 1, (1, 128), 4) == "conv_f16_r3s1_n64_1x128_sk4"
    assert igemm.split_partial_bytes(40, 64, (1, 128), 8) == 8 * 40 * 128 * 64 * 4  # 10.5 MB
    assert "not 8 whole 32-channel chunks" in igemm.why_no_split(layer3, 1, 64, (1, 128), 8)
    assert "more than the scratch" in igemm.why_no_split(layer4, 4, 64, (1, 128), 8)
    assert igemm.why_no_split(layer4, 1, 64, (1, 128), 8) == ""
    assert igemm.kernel_name(Math.FP16, 32, 3, 1, (4, 64)) == "conv_f16_r3s1_n32_4x64"
    assert igemm.kernel_name(Math.TF32, 64) == "conv_igemm_tf32_n64", "conv_igemm.cu's names are unchanged"
    stem = ConvSpec("stem", "bn", 1, 32, 3, 1, 80, 998)
    assert igemm.tiles_for(stem, Math.FP32) == (), "the stem (1 input channel) is not an implicit GEMM's"
    assert igemm.tiles_for(stem, Math.FP16) == ()
    assert igemm.tiles_for(ConvSpec("l2", "bn", 32, 64, 3, 2, 80, 998), Math.FP16) == (64, 32)
    assert igemm.tiles_for(ConvSpec("sc", "bn", 64, 128, 1, 2, 40, 499), Math.FP16) == (64, 32)
    assert igemm.tiles_for(ConvSpec("sc1", "bn", 64, 128, 1, 1, 40, 499), Math.FP16) == (), "no 1x1 stride-1"
    assert igemm.tiles_for(ConvSpec("l1", "bn", 32, 32, 3, 1, 80, 998), Math.TF32) == (32,)
    assert igemm.tiles_for(ConvSpec("l4", "bn", 256, 256, 3, 1, 10, 125), Math.FP32) == (64, 32)


def test_wgmma_names_tiles_and_rules_match_the_source() -> None:
    """conv_wgmma.cu's entry points are igemm.WGMMA_ENTRIES, their blocks per SM fit an SM's
    shared memory, and which convolutions it may run (no GPU)."""
    import re

    from speakerd.engine.gpu import igemm, kernels

    source = kernels.kernel_sources()[igemm.WGMMA_SOURCE]
    lines = re.findall(r"^WG_ENTRY\((\d+), (\d+), (\d+), (\d+), (\d+)\)$", source, re.M)
    found = tuple(
        igemm.WgmmaEntry(int(cin), int(tile), (int(rows), int(cols)), int(blocks))
        for cin, tile, rows, cols, blocks in lines
    )
    assert found == igemm.WGMMA_ENTRIES, found
    for entry in found:
        shared = igemm.wgmma_shared_bytes(entry)
        # the grid's blocks per SM fit one SM's 228 KB (1 KB reserved per block)
        assert entry.blocks * (shared + 1024) <= 228 * 1024, (entry, shared)
    defines = {name: int(value) for name, value in re.findall(r"#define WG_(\w+) (\d+)", source)}
    assert (defines["THREADS"], defines["STAGES"]) == (igemm.WGMMA_THREADS, igemm.WGMMA_STAGES), defines
    layer1_8x64 = igemm.wgmma_entry(32, 32, (8, 64))
    assert igemm.wgmma_shared_bytes(layer1_8x64) == 2 * 4 * 10 * 66 * 16 + 9 * 4 * 32 * 16
    assert igemm.wgmma_kernel_name(layer1_8x64) == "conv_wgmma_c32_n32_8x64"
    layer1 = ConvSpec("l1", "bn", 32, 32, 3, 1, 80, 998)
    # persistent: two blocks per SM for 32 x 10 x 16 = 5,120 tiles; a small image gets one per tile
    assert igemm.wgmma_grid(layer1, 32, layer1_8x64, 132) == (264, 1, 1)
    assert igemm.wgmma_grid(ConvSpec("s", "bn", 32, 64, 3, 1, 13, 140), 3, layer1_8x64, 132) == (18, 2, 1)
    # two channel tiles share the SMs' blocks
    assert igemm.wgmma_grid(ConvSpec("s", "bn", 32, 64, 3, 1, 80, 998), 32, layer1_8x64, 132) == (132, 2, 1)
    assert igemm.wgmma_candidates_for(layer1, Math.FP16, "90") == tuple(
        igemm.Variant(32, e.pixels, wgmma=True) for e in igemm.WGMMA_ENTRIES if e.cin == 32
    )
    layer2 = ConvSpec("l2", "bn", 64, 64, 3, 1, 40, 499)
    assert {v.tile for v in igemm.wgmma_candidates_for(layer2, Math.FP16, "90")} == {32, 64}
    assert "compute capability 90" in igemm.wgmma_why_not(layer1, Math.FP16, "100")
    assert "FP16 only" in igemm.wgmma_why_not(layer1, Math.TF32, "90")
    stride2 = ConvSpec("s2", "bn", 32, 64, 3, 2, 80, 998)
    assert "3x3 stride 1 only" in igemm.wgmma_why_not(stride2, Math.FP16, "90")
    layer4 = ConvSpec("l4", "bn", 256, 256, 3, 1, 10, 125)
    assert "fit no entry point" in igemm.wgmma_why_not(layer4, Math.FP16, "90")
    assert igemm.wgmma_candidates_for(layer1, Math.FP16, "89") == ()
    assert kernels.arch_of(igemm.WGMMA_SOURCE) == "90a" and kernels.arch_of(igemm.F16_SOURCE) == "90"


def _assert_compiles_with(source_name: str, checks: str) -> None:
    """kernels/`source_name` with `checks` (C++ static asserts) appended in its anonymous
    namespace compiles to PTX for its architecture (kernels.arch_of): no GPU needed."""
    from cupy_backends.cuda.libs import nvrtc

    from speakerd.engine.gpu import kernels

    source = kernels.kernel_sources()[source_name] + "namespace {\n" + checks + "}\n"
    program = nvrtc.createProgram(source, source_name, (), ())
    try:
        try:
            arch = f"--gpu-architecture=compute_{kernels.arch_of(source_name)}"
            nvrtc.compileProgram(program, (*kernels.compile_options(), arch))
        except nvrtc.NVRTCError as error:
            raise AssertionError(nvrtc.getProgramLog(program)) from error
    finally:
        nvrtc.destroyProgram(program)


@pytest.mark.skipif(NO_NVRTC is not None, reason=str(NO_NVRTC))
def test_wgmma_shared_bytes_are_the_kernels() -> None:
    """igemm.wgmma_shared_bytes equals WgTile<...>::SHARED_BYTES of every WG_ENTRY."""
    from speakerd.engine.gpu import igemm

    _assert_compiles_with(igemm.WGMMA_SOURCE, "".join(
        f"static_assert(WgTile<{e.cin}, {e.tile}, {e.pixels[0]}, {e.pixels[1]}>::SHARED_BYTES == "
        f'{igemm.wgmma_shared_bytes(e)}, "wgmma_shared_bytes({e})");\n'
        for e in igemm.WGMMA_ENTRIES
    ))  # fmt: skip


@pytest.mark.slow
@pytest.mark.skipif(NO_NVRTC is not None, reason=str(NO_NVRTC))
def test_f16_shared_bytes_are_the_kernels() -> None:
    """igemm.f16_shared_bytes equals HaloTile<...>::SHARED_BYTES of every F16_ENTRY."""
    from speakerd.engine.gpu import igemm

    _assert_compiles_with(igemm.F16_SOURCE, "".join(
        f"static_assert(HaloTile<{kernel}, {stride}, {tile}, {rows}, {cols}>::SHARED_BYTES == "
        f"{igemm.f16_shared_bytes(kernel, stride, tile, rows, cols)}, "
        f'"f16_shared_bytes({kernel}, {stride}, {tile}, {rows}, {cols})");\n'
        for (kernel, stride, tile), tiles in igemm.F16_PIXEL_TILES.items()
        for rows, cols in tiles
    ))  # fmt: skip
