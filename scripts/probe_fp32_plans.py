"""Device probe: every cuDNN execution plan of the thin trunk convolutions in FP32 io, with
its time and its error against a float64 convolution, so "strict FP32" is measured, not
assumed from numerical notes (issue 3: our strict b32 is 87 ms, docs/performance.md's probe saw 2.09 ms
for layer1's conv where ours takes 4.9 ms).

Prints one JSON line per plan: shape, heuristic modes, index, name, whether our strict
notes deselect it, median ms, max relative error vs float64 (TF32 shows ~1e-3, FP32 ~1e-6).

    python scripts/probe_fp32_plans.py            # as the engine runs
    NVIDIA_TF32_OVERRIDE=0 python scripts/probe_fp32_plans.py
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = [  # (cin, cout, h, w, k, stride): layer1 conv, layer2 conv, layer2.0.conv1
    (32, 32, 80, 998, 3, 1),
    (64, 64, 40, 499, 3, 1),
    (32, 64, 80, 998, 3, 2),
]
BATCH = 32


def say(**fields) -> None:
    print(json.dumps(fields), flush=True)


def reference(x, w, k: int, stride: int):
    """float64 conv of chunk 0 (NHWC x [1,h,w,c], KRSC w) by im2col on the GPU."""
    import cupy

    pad = k // 2
    _, h, wd, c = x.shape
    xp = cupy.pad(x.astype(cupy.float64), ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    ho, wo = (h + 2 * pad - k) // stride + 1, (wd + 2 * pad - k) // stride + 1
    cols = [
        xp[:, r : r + stride * ho : stride, s : s + stride * wo : stride, :]
        for r in range(k)
        for s in range(k)
    ]
    patches = cupy.concatenate(cols, axis=3).reshape(ho * wo, k * k * c)
    return patches @ w.reshape(w.shape[0], -1).astype(cupy.float64).T  # [ho*wo, cout]


def main() -> int:
    import cudnn
    import cupy

    from speakerd.engine.gpu.convs import excluded_notes, fp32_graph
    from speakerd.model.numerics import Math

    handle = cudnn.create_handle()
    stream = cupy.cuda.Stream(non_blocking=True)
    cudnn.set_stream(handle=handle, stream=stream.ptr)
    fp32 = cudnn.data_type.FLOAT
    override = os.environ.get("NVIDIA_TF32_OVERRIDE")
    for cin, cout, h, w, k, stride in SHAPES:
        pad = k // 2
        ho, wo = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
        rng = cupy.random.RandomState(0)
        x = rng.standard_normal((BATCH, h, w, cin), dtype=cupy.float32)
        wt = rng.standard_normal((cout, k, k, cin), dtype=cupy.float32) * (2.0 / (k * k * cin)) ** 0.5
        y = cupy.empty((BATCH, ho, wo, cout), dtype=cupy.float32)
        ref = reference(x[:1], wt, k, stride)
        scale = float(cupy.abs(ref).max())
        for modes, strict_filter in ((("A", "B", "FALLBACK"), False), (("A", "B", "FALLBACK"), True)):
            g = fp32_graph(handle)
            X = g.tensor(
                name="X", dim=[BATCH, cin, h, w], stride=[cin * h * w, 1, w * cin, cin], data_type=fp32
            )
            W = g.tensor(
                name="W", dim=[cout, cin, k, k], stride=[cin * k * k, 1, k * cin, cin], data_type=fp32
            )
            Y = g.conv_fprop(
                image=X,
                weight=W,
                padding=[pad, pad],
                stride=[stride] * 2,
                dilation=[1, 1],
                compute_data_type=fp32,
            )
            Y.set_output(True).set_data_type(fp32)
            g.validate()
            g.build_operation_graph()
            g.create_execution_plans([getattr(cudnn.heur_mode, m) for m in modes])
            if strict_filter:
                g.deselect_numeric_notes(excluded_notes(Math.FP32))
            count = g.get_execution_plan_count()
            if (cin, strict_filter) == (32, False):
                say(
                    plans=count,
                    methods=[m for m in dir(g) if any(s in m for s in ("note", "knob", "behav", "plan"))],
                )
            pack = {X: x.data.ptr, W: wt.data.ptr, Y: y.data.ptr}
            for index in range(min(count, 40)):
                row = {
                    "shape": f"{cin}->{cout} {h}x{w} k{k} s{stride}",
                    "override": override,
                    "filtered": strict_filter,
                    "index": index,
                }
                try:
                    g.build_plan_at_index(index)
                    row["name"] = str(g.get_plan_name_at_index(index))
                    need = int(g.get_workspace_size_plan_at_index(index))
                    row["workspace"] = need
                    if need > 1 << 30:
                        raise RuntimeError("workspace > 1 GiB")
                    ws = cupy.empty((max(1, need),), dtype=cupy.uint8)
                    with stream:
                        g.execute_plan_at_index(pack, ws.data.ptr, index, handle=handle)
                        stream.synchronize()
                        err = cupy.abs(y[0].reshape(ho * wo, cout).astype(cupy.float64) - ref).max()
                        row["rel_err"] = float(err) / scale
                        times = []
                        for _ in range(3):
                            e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
                            e0.record(stream)
                            g.execute_plan_at_index(pack, ws.data.ptr, index, handle=handle)
                            e1.record(stream)
                            e1.synchronize()
                            times.append(cupy.cuda.get_elapsed_time(e0, e1))
                            if times[0] > 30:
                                break
                        row["ms"] = round(statistics.median(times), 4)
                        again = y.copy()
                        g.execute_plan_at_index(pack, ws.data.ptr, index, handle=handle)
                        row["deterministic"] = bool(cupy.array_equal(again, y))
                    del ws
                except Exception as error:
                    row["error"] = str(error)[:120]
                say(**row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
