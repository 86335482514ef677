"""Device probe: can cuDNN fuse an FP16 convolution's epilogue AND tell us about overflow?

Why: in FP16 our epilogue kernel follows each bare cuDNN convolution of layers 2-4 (~0.74
ms of a 4.88 ms b32 forward) because a fused graph rounds to half inside cuDNN, where an
overflow cannot be flagged. If the fused graph can also reduce its FP32 result to a max
(a reduction node on the ReLU output, before the rounding to half), the range check is
one comparison of that max with 65504, and the separate epilogue pass goes away.

For each trunk shape and variant this prints one JSON line per execution plan: whether it
builds, its GPU ms (CUDA-graph replay, median of 5), its output's max relative difference
from bare conv + the epilogue in float32, the reduction against the true max, whether the
reduction overwrites or accumulates into its output (prefilled with 1e30), and, with the
weights scaled far beyond FP16's range, what the reduction and Y hold.

    python scripts/probe_fp16_fusion.py [--plans 6] [--batches 32,1] [--modes A,B,FALLBACK]
        [--variants bare,fused,fused_amax,fused_cmax] [--shapes layer3.conv2,...]

`--modes` names cuDNN's heuristic modes whose plans are listed (by default the engine's,
convs.HEURISTIC_MODES); B, and more `--plans`, tell whether cuDNN has a faster plan than the
engine tries, e.g. for b1's layer3 and layer4 convolutions (~11-13 us each, launch- and
occupancy-bound): `--batches 1 --modes A,B,FALLBACK --plans 40 --variants fused_amax`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from speakerd.engine.gpu.convs import HEURISTIC_MODES

#: (name, cin, cout, kernel, stride, h_in, w_in, epilogue): the trunk's cuDNN-run shapes
SHAPES = (
    ("layer2.conv2", 64, 64, 3, 1, 40, 499, "bias_add_relu"),
    ("layer2.conv1", 64, 64, 3, 1, 40, 499, "bias_relu"),
    ("layer2.0.conv1", 32, 64, 3, 2, 80, 998, "bias_relu"),
    ("layer3.conv2", 128, 128, 3, 1, 20, 250, "bias_add_relu"),
    ("layer3.0.conv1", 64, 128, 3, 2, 40, 499, "bias_relu"),
    ("layer4.conv2", 256, 256, 3, 1, 10, 125, "bias_add_relu"),
    ("layer4.0.conv1", 128, 256, 3, 2, 20, 250, "bias_relu"),
    ("layer4.0.shortcut", 128, 256, 1, 2, 20, 250, "bias_only"),
)
VARIANTS = ("bare", "fused", "fused_amax", "fused_cmax")
HALF_MAX = 65504.0


def say(**fields) -> None:
    print(json.dumps(fields), flush=True)


def build(shape, batch: int, variant: str, handle, modes: tuple[str, ...]):
    import cudnn

    from speakerd.engine.gpu import maths
    from speakerd.engine.gpu.convs import _nhwc, fp32_graph
    from speakerd.model.numerics import Math

    _, cin, cout, k, s, h, w, epilogue = shape
    fp32, io = cudnn.data_type.FLOAT, cudnn.data_type.HALF
    graph = fp32_graph(handle, io)
    x = _nhwc(graph, "X", batch, cin, h, w, io)
    wt = _nhwc(graph, "W", cout, cin, k, k, io)
    y = graph.conv_fprop(image=x, weight=wt, padding=[k // 2] * 2, stride=[s, s], dilation=[1, 1],
                         compute_data_type=fp32)  # fmt: skip
    tensors = {"X": x, "W": wt}
    if variant != "bare":
        b = graph.tensor(name="B", dim=[1, cout, 1, 1], stride=[cout, 1, cout, cout], data_type=fp32)
        y = graph.bias(input=y, bias=b)
        tensors["B"] = b
        if epilogue == "bias_add_relu":
            ho, wo = (h + 2 * (k // 2) - k) // s + 1, (w + 2 * (k // 2) - k) // s + 1
            z = _nhwc(graph, "Z", batch, cout, ho, wo, io)
            y = graph.add(a=y, b=z)
            tensors["Z"] = z
        if epilogue != "bias_only":
            y = graph.relu(input=y)
    y.set_output(True).set_data_type(io)
    tensors["Y"] = y
    if variant in ("fused_amax", "fused_cmax"):
        mode = cudnn.reduction_mode.AMAX if variant == "fused_amax" else cudnn.reduction_mode.MAX
        a = graph.reduction(input=y, mode=mode, compute_data_type=fp32)
        dims = [1, 1, 1, 1] if variant == "fused_amax" else [1, cout, 1, 1]
        strides = [1, 1, 1, 1] if variant == "fused_amax" else [cout, 1, cout, cout]
        a.set_output(True).set_dim(dims).set_stride(strides).set_data_type(fp32)
        tensors["A"] = a
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([getattr(cudnn.heur_mode, mode) for mode in modes])
    graph.deselect_numeric_notes(maths.of(Math.FP16).cudnn_notes())
    return graph, tensors


def probe(
    shape, batch: int, max_plans: int, handle, stream, modes: tuple[str, ...], variants: tuple[str, ...]
) -> None:
    import cupy

    from speakerd.engine.gpu.convs import _capture_one
    from speakerd.engine.gpu.timing import replay_ms

    name, cin, cout, k, s, h, w, epilogue = shape
    ho, wo = (h + 2 * (k // 2) - k) // s + 1, (w + 2 * (k // 2) - k) // s + 1
    rs = cupy.random.RandomState(1)
    with stream:
        x = rs.standard_normal((batch, h, w, cin), dtype=cupy.float32).astype(cupy.float16)
        weight32 = rs.standard_normal((cout, k, k, cin), dtype=cupy.float32) / (k * k * cin) ** 0.5
        weight = weight32.astype(cupy.float16)
        huge = (weight32 * 3e4).astype(cupy.float16)  # outputs ~3e4 sigma: beyond 65504
        bias = rs.standard_normal((cout,), dtype=cupy.float32) * 0.1
        z = rs.standard_normal((batch, ho, wo, cout), dtype=cupy.float32).astype(cupy.float16)
        y = cupy.empty((batch, ho, wo, cout), dtype=cupy.float16)
        a = cupy.empty((cout,), dtype=cupy.float32)
        workspace = cupy.empty((1 << 28,), dtype=cupy.uint8)
    pointers = {"X": x.data.ptr, "W": weight.data.ptr, "B": bias.data.ptr, "Z": z.data.ptr, "Y": y.data.ptr,
                "A": a.data.ptr}  # fmt: skip
    reference = None
    # the bare conv's output is every fused variant's reference: it runs first, whatever was asked
    for variant in ("bare", *(v for v in variants if v != "bare")):
        started = time.perf_counter()
        try:
            graph, tensors = build(shape, batch, variant, handle, modes)
        except Exception as error:
            why = f"{type(error).__name__}: {error}"[:400]
            say(shape=name, batch=batch, variant=variant, built=False, error=why)
            continue
        count, tried = graph.get_execution_plan_count(), 0
        for index in range(count):
            if tried >= max_plans:
                break
            try:
                graph.build_plan_at_index(index)
            except Exception as error:
                if "Deselect" not in str(error):
                    say(shape=name, batch=batch, variant=variant, plan=index, built=False,
                        error=f"{type(error).__name__}: {error}"[:240])  # fmt: skip
                continue
            tried += 1
            row = {"shape": name, "batch": batch, "variant": variant, "plan": index,
                   "plan_name": str(graph.get_plan_name_at_index(index))}  # fmt: skip
            try:
                need = int(graph.get_workspace_size_plan_at_index(index))
                assert need <= workspace.nbytes, need
                pack = {tensor: pointers[key] for key, tensor in tensors.items()}
                with stream:
                    a.fill(1e30)
                    y.fill(float("nan"))
                    graph.execute_plan_at_index(pack, workspace.data.ptr, index, handle=handle)
                    stream.synchronize()
                    out = y.astype(cupy.float32)
                    if variant == "bare":
                        conv = out
                        full = conv + bias
                        if epilogue == "bias_add_relu":
                            full = full + z.astype(cupy.float32)
                        if epilogue != "bias_only":
                            full = cupy.maximum(full, 0)
                        reference = full if reference is None else reference
                    else:
                        scale = float(cupy.abs(reference).max())
                        row["max_rel_diff"] = float(cupy.abs(out - reference).max()) / scale
                    if "A" in tensors:
                        got = a[:1] if variant == "fused_amax" else a
                        row["reduction_after_1e30_fill"] = float(got.max())
                        true = float(cupy.abs(reference).max()) if variant == "fused_amax" else None
                        if variant == "fused_cmax":
                            true_c = reference.reshape(-1, cout).max(axis=0)
                            worst = cupy.abs(got - true_c).max() / cupy.abs(true_c).max()
                            row["cmax_rel_diff"] = float(worst)
                        else:
                            row["true_amax"] = true
                        a.fill(0)
                        graph.execute_plan_at_index(pack, workspace.data.ptr, index, handle=handle)
                        stream.synchronize()
                        row["reduction_after_0_fill"] = float(got.max())
                    captured = _capture_one(graph, index, pack, workspace, handle, stream, None)
                    times = [replay_ms(captured, stream) for _ in range(6)][1:]
                    row["ms"] = round(statistics.median(times), 4)
                    if "A" in tensors:  # overflow: the reduction must exceed 65504
                        pack_huge = dict(pack)
                        pack_huge[tensors["W"]] = huge.data.ptr
                        a.fill(0)
                        graph.execute_plan_at_index(pack_huge, workspace.data.ptr, index, handle=handle)
                        stream.synchronize()
                        row["overflow_reduction"] = float(got.max())
                        yf = y.astype(cupy.float32)
                        row["overflow_y_inf"] = int(cupy.isinf(yf).sum())
                        finite = cupy.where(cupy.isfinite(yf), cupy.abs(yf), 0)
                        row["overflow_y_max_finite"] = float(finite.max())
                        row["overflow_flagged"] = row["overflow_reduction"] > HALF_MAX
            except Exception as error:
                row["error"] = f"{type(error).__name__}: {error}"[:300]
            say(**row)
        say(shape=name, batch=batch, variant=variant, plans=count, tried=tried,
            seconds=round(time.perf_counter() - started, 1))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plans", type=int, default=6)
    parser.add_argument("--batches", default="32,1")
    parser.add_argument("--shapes", default="", help="comma-separated names (default: all)")
    parser.add_argument(
        "--modes",
        default=",".join(HEURISTIC_MODES),
        help="cuDNN heuristic modes, comma-separated (A, B, FALLBACK)",
    )
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}"
    )
    args = parser.parse_args()
    modes = tuple(filter(None, args.modes.split(",")))
    unknown = sorted(set(modes) - {"A", "B", "FALLBACK"})
    if unknown:
        parser.error(f"--modes: {', '.join(unknown)} is no cuDNN heuristic mode; use A, B or FALLBACK")
    variants = tuple(filter(None, args.variants.split(",")))
    if not variants or set(variants) - set(VARIANTS):
        parser.error(
            f"--variants: expected a comma-separated subset of {', '.join(VARIANTS)}, not {args.variants!r}"
        )
    import cudnn
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=stream.ptr)
    say(cudnn=int(cudnn.backend_version()), frontend=getattr(cudnn, "__version__", "?"))
    wanted = set(filter(None, args.shapes.split(",")))
    for batch in map(int, args.batches.split(",")):
        for shape in SHAPES:
            if wanted and shape[0] not in wanted:
                continue
            if not wanted and batch == 1 and shape[1] < 128 and shape[0] != "layer4.0.shortcut":
                continue  # by default b1 probes layers 3-4 (cuDNN's at b1); --shapes names any
            probe(shape, batch, args.plans, handle, stream, modes, variants)


if __name__ == "__main__":
    main()
