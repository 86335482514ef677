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
from tests.test_gpu_engine import needs_gpu

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
    stream = cupy.cuda.Stream(non_blocking=True)
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
    stream = cupy.cuda.Stream(non_blocking=True)
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
    f16_defined = {
        f"conv_f16_r{r}s{stride}_n{tile}"
        for r, stride, tile in re.findall(r"^F16_ENTRY\((\d), (\d), (\d+), \w+\)$", f16, re.M)
    }
    assert set(igemm.F16_KERNEL_NAMES) == f16_defined, (igemm.F16_KERNEL_NAMES, f16_defined)
    f16_defines = {name: int(value) for name, value in re.findall(r"#define F16_(\w+) (\d+)", f16)}
    f16_expected = {"THREADS": igemm.F16_THREADS, "COLS": igemm.F16_COLS, "ROWS": igemm.F16_ROWS,
                    "CHUNK": igemm.F16_CHUNK, "LDB": igemm.F16_LDB, "OUT_PAD": igemm.F16_OUT_PAD}  # fmt: skip
    assert {k: f16_defines[k] for k in f16_expected} == f16_expected, f16_defines
    # every tile fits one block's 227 KB, and two blocks of each stride-1 tile share an SM
    for kernel, stride in igemm.F16_SHAPES:
        for tile in igemm.TILE_CHANNELS:
            assert igemm.f16_shared_bytes(kernel, stride, tile) <= igemm.BLOCK_SHARED_MAX, (
                kernel,
                stride,
                tile,
            )
    assert 2 * (igemm.f16_shared_bytes(3, 1, 64) + 1024) <= 228 * 1024, igemm.f16_shared_bytes(3, 1, 64)
    assert igemm.f16_shared_bytes(3, 1, 64) == (4 * 130 * 48 + 9 * 64 * 48) * 2
    stem = ConvSpec("stem", "bn", 1, 32, 3, 1, 80, 998)
    assert igemm.tiles_for(stem, Math.FP32) == (), "the stem (1 input channel) is not an implicit GEMM's"
    assert igemm.tiles_for(stem, Math.FP16) == ()
    assert igemm.tiles_for(ConvSpec("l2", "bn", 32, 64, 3, 2, 80, 998), Math.FP16) == (64, 32)
    assert igemm.tiles_for(ConvSpec("sc", "bn", 64, 128, 1, 2, 40, 499), Math.FP16) == (64, 32)
    assert igemm.tiles_for(ConvSpec("sc1", "bn", 64, 128, 1, 1, 40, 499), Math.FP16) == (), "no 1x1 stride-1"
    assert igemm.tiles_for(ConvSpec("l1", "bn", 32, 32, 3, 1, 80, 998), Math.TF32) == (32,)
    assert igemm.tiles_for(ConvSpec("l4", "bn", 256, 256, 3, 1, 10, 125), Math.FP32) == (64, 32)
