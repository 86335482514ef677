"""Device probe: can a start-up keep cuDNN's built execution plans, not only its choices?

Why: a start from the build cache (engine/build_cache.py) still builds each chosen plan, and
building is cuDNN compiling its kernel (~0.1 s a plan, ~110 plans for an FP16 engine); a
first start's tuning workers (engine/gpu/tuning_pool.py) build every candidate in their own
processes and the engine then builds the chosen ones again. If a built plan serializes
(the frontend's `serialize()`, the backend's execution-plan format) and loads in another
process without compiling, the cache could keep the plans themselves and the workers could
hand theirs over.

For each graph this prints one JSON line: the plan timed and chosen (convs.time_plans on
random buffers), the seconds to rebuild that plan alone (convs.instantiate, what a cached
start does today), to serialize it, to deserialize it here and in a fresh process; whether
the deserialized plan writes the original's bits eagerly and from a CUDA graph captured in
global mode and replayed twice (what the engine serves).

    python scripts/probe_plan_serialization.py [--math fp16] [--batches 32,1] [--graphs 6]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from speakerd.engine.gpu import maths
from speakerd.engine.gpu.autotune import graph_keys
from speakerd.engine.gpu.convs import ConvKey, _y_view, instantiate, time_plans
from speakerd.engine.gpu.plan import trunk_convs
from speakerd.engine.gpu.tuning_pool import random_buffers
from speakerd.model.numerics import Math


def _uids(graph) -> dict[str, int]:
    """name -> uid of each tensor the variant pack binds."""
    return {name: int(tensor.get_uid()) for name, tensor in graph.tensors.items()}


def _deserialized(blob: bytes, handle):
    import cudnn

    loaded = cudnn.pygraph(handle=handle)
    loaded.deserialize(handle, blob)
    return loaded


def _in_child(blob: bytes, device: int, out) -> None:
    """A fresh process: how long deserializing takes there (its CUDA and cuDNN set-up apart)."""
    import cudnn
    import cupy

    cupy.cuda.Device(device).use()
    handle = cudnn.create_handle()
    started = time.perf_counter()
    try:
        _deserialized(blob, handle)
        out.put({"child_deserialize_s": round(time.perf_counter() - started, 4)})
    except Exception as error:
        out.put({"child_error": f"{type(error).__name__}: {str(error)[:300]}"})


def probe(key: ConvKey, handle, stream, device: int) -> dict:
    import cupy

    from speakerd.engine.gpu.bitwise import bits

    row: dict = {"graph": key.label()}
    arrays: list = []
    with stream:
        buffers = random_buffers(key, cupy.random.RandomState(0), arrays)
        timed = time_plans(key, handle, stream, buffers)
        row.update(plan=timed.plan_name, index=timed.plan_index, ms=round(timed.ms, 4),
                   timing_s=round(timed.build_s, 2))  # fmt: skip
        started = time.perf_counter()
        own = instantiate(timed, handle)
        row["rebuild_s"] = round(time.perf_counter() - started, 4)
        workspace = cupy.empty((max(1, timed.workspace_bytes),), dtype=cupy.uint8)
        y = _y_view(buffers["Y"], key.output_elements, key.math)
        own.execute(own.pack(buffers), workspace.data.ptr, handle)
        expected = y.copy()
        stream.synchronize()
        try:
            started = time.perf_counter()
            blob = own.graph.serialize(as_bytes=True)
            row.update(serialize_s=round(time.perf_counter() - started, 4), bytes=len(blob))
        except Exception as error:
            row["serialize_error"] = f"{type(error).__name__}: {str(error)[:300]}"
            return row
        try:
            started = time.perf_counter()
            loaded = _deserialized(blob, handle)
            row["deserialize_s"] = round(time.perf_counter() - started, 4)
            pack = {uid: buffers[name] for name, uid in _uids(own).items()}
            y.fill(float("nan"))
            loaded.execute(pack, workspace.data.ptr, handle=handle)
            row["eager_equal"] = bool(cupy.array_equal(bits(y), bits(expected)))
            stream.begin_capture(mode=cupy.cuda.runtime.streamCaptureModeGlobal)
            try:
                loaded.execute(pack, workspace.data.ptr, handle=handle)
            finally:
                captured = stream.end_capture()
            replays = []
            for _ in range(2):
                y.fill(float("nan"))
                workspace.fill(255)
                captured.launch(stream)
                replays.append(bool(cupy.array_equal(bits(y), bits(expected))))
            row["replays_equal"] = replays
        except Exception as error:
            row["deserialized_error"] = f"{type(error).__name__}: {str(error)[:300]}"
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    child = context.Process(target=_in_child, args=(blob, device, out))
    child.start()
    try:
        row.update(out.get(timeout=120))
    except Exception as error:
        row["child_error"] = f"{type(error).__name__}: {error}"
    child.join(30)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--math", default="fp16", choices=[m.value for m in Math])
    parser.add_argument("--batches", default="32,1")
    parser.add_argument("--graphs", type=int, default=6, help="graphs probed, fused ones first")
    args = parser.parse_args()

    import cudnn
    import cupy

    math = Math(args.math)
    fallback = maths.of(math).fallback
    sizes = tuple(int(b) for b in args.batches.split(","))
    keys = graph_keys(trunk_convs(), sizes, (math,) if fallback is None else (math, fallback))
    keys = sorted(keys, key=lambda k: (k.math != math, k.epilogue is None, -k.batch, -k.flops))[: args.graphs]
    device = int(cupy.cuda.Device().id)
    stream = cupy.cuda.Stream(non_blocking=True)
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=stream.ptr)
    name = cupy.cuda.runtime.getDeviceProperties(device)["name"].decode()
    versions = {"cudnn": cudnn.backend_version(), "frontend": getattr(cudnn, "__version__", None)}
    print(json.dumps({"gpu": name, **versions}))
    for key in keys:
        try:
            row = probe(key, handle, stream, device)
        except Exception as error:
            row = {"graph": key.label(), "error": f"{type(error).__name__}: {str(error)[:300]}"}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
