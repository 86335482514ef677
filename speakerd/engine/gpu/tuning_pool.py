"""A first start's cuDNN plan timing, spread over worker processes.

Why: a GPU engine's first start times up to 12 execution plans of every cuDNN graph its
plans use (convs.time_plans), and building a plan is cuDNN compiling its kernel: about
0.1 s a plan, some 1,100 plans for an FP16 engine, two minutes of one core. The cuDNN
frontend's Python binding holds the GIL while it builds, so threads would only take turns;
processes do not.

How: the graphs a first start asks for (autotune.graph_keys) are handed out to up to
MAX_WORKERS spawned processes on the engine's device. Each builds its graphs' plans on a
core of its own and times them holding one lock shared by every worker, so that a plan is
never timed beside another (plans timed side by side on one GPU would slow each other and
rank wrongly); each works on buffers of its own filled with random values, as the engine
times on random activations. A worker answers what the build cache keeps of a graph
(convs.graph_entry, or {"unsupported": why} for a fused graph cuDNN cannot serve), and the
engine then builds each chosen plan once, as it does on a start from the build cache
(engine/build_cache.py). A graph a worker could not time (a worker that died, a pool past
its deadline, a bare graph with no working plan) is timed by the engine itself, as before.
"""

from __future__ import annotations

import concurrent.futures
import logging
import multiprocessing
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from speakerd.engine.build_cache import BuildCache
from speakerd.engine.gpu import maths
from speakerd.engine.gpu.autotune import graph_keys
from speakerd.engine.gpu.build_key import engine_build_key
from speakerd.engine.gpu.convs import ConvKey, graph_entry, time_plans
from speakerd.engine.gpu.plan import trunk_convs
from speakerd.engine.gpu.timing import fill_random
from speakerd.model.numerics import Math

log = logging.getLogger(__name__)

#: Workers at most. Each holds a CUDA context, its buffers and a plan's workspace (up to
#: convs.MAX_WORKSPACE_BYTES): about 2 GB each at b32, 16 GB for eight beside the server's
#: own on an 80 GB card; eight keep half of a 16-core GPU host for the engine's own compiles.
MAX_WORKERS = 8
#: Cores left to the starting process (its kernels' compiles and its own plan builds): below
#: CORES_KEPT + 2 usable cores no pool is started, the engine times every graph itself.
CORES_KEPT = 2
#: The longest the engine waits for the pool; graphs not answered by then it times itself.
DEADLINE_S = 600.0
#: Seed of the workers' random buffers (as the engine's TIMING_SEED: never zeros).
SEED = 0

# one worker process's device state, set by _start_worker
_state: dict[str, Any] = {}


@dataclass
class Tuned:
    """What the pool answered: graph label -> convs.graph_entry (or {"unsupported": why})."""

    entries: dict[str, dict] = field(default_factory=dict)
    workers: int = 0
    seconds: float = 0.0
    unanswered: list[str] = field(default_factory=list)  # the labels the engine times itself


def workers_for(graphs: int) -> int:
    """Workers for `graphs` graphs on this host's usable cores (0: time in process)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = min(MAX_WORKERS, cores - CORES_KEPT, graphs)
    return workers if workers >= 2 else 0


def pool_for(
    device: int, math: Math, sizes: tuple[int, ...], workers: int | None = None
) -> TuningPool | None:
    """The pool timing the graphs an engine of `math` and plan `sizes` (with its math's
    fallback) asks for on `device`, started; None where this host has too few cores
    (`workers`: how many, None for workers_for's choice, 0 for none)."""
    fallback = maths.of(math).fallback
    keys = graph_keys(trunk_convs(), sizes, (math,) if fallback is None else (math, fallback))
    count = workers_for(len(keys)) if workers is None else min(workers, len(keys))
    if count <= 0:
        return None
    log.info("timing %d cuDNN graphs' plans in %d worker processes", len(keys), count)
    return TuningPool(keys, device, count)


def start_before_the_model(
    device: int, math: Math, sizes: tuple[int, ...], conv_kernels: str, cache: BuildCache | None
) -> TuningPool | None:
    """A start-up's pool begun before its model is loaded (made, downloaded or converted:
    seconds the pool's workers need not wait): started unless the build cache holds an entry
    for this device, its libraries, math, plans and kernels under any model, since one for
    this model would make the pool idle (the engine then closes it unused: GpuEngine)."""
    key = engine_build_key(device, "", math, sizes, conv_kernels)
    if cache is not None and cache.holds_any(key, ignoring=("model_id",)):
        return None
    return pool_for(device, math, sizes)


class TuningPool:
    """Worker processes timing `keys` on device `device`, started at once; `result` waits."""

    def __init__(self, keys: Sequence[ConvKey], device: int, workers: int) -> None:
        self.keys, self.workers = list(keys), workers
        self.started = time.perf_counter()
        context = multiprocessing.get_context("spawn")  # CUDA in a forked child is undefined
        self._lock = context.Lock()
        self._pool = concurrent.futures.ProcessPoolExecutor(
            workers, mp_context=context, initializer=_start_worker, initargs=(device, self._lock)
        )
        # the largest graphs first: the pool's last graph is then a short one
        order = sorted(self.keys, key=lambda k: (-k.batch, -k.flops))
        self._futures = {self._pool.submit(_time_graph, key): key for key in order}

    @property
    def gpu_lock(self):
        """The workers' GPU lock: the starting process holds it around GPU work of its own
        (the segmenter's build) so that no plan is timed beside it."""
        return self._lock

    def result(self, deadline_s: float = DEADLINE_S) -> Tuned:
        """Every answer the workers gave within `deadline_s` of the start; the pool is shut."""
        tuned = Tuned(workers=self.workers)
        failed: list[str] = []
        late = False
        try:
            left = max(0.0, deadline_s - (time.perf_counter() - self.started))
            for future in concurrent.futures.as_completed(self._futures, timeout=left):
                key = self._futures[future]
                try:
                    entry = future.result()
                except Exception as error:  # a worker died (BrokenProcessPool) or raised
                    failed.append(f"{key.label()}: {type(error).__name__}: {str(error)[:200]}")
                    continue
                if entry is not None:
                    tuned.entries[key.label()] = entry
        except concurrent.futures.TimeoutError:
            late = True
            log.warning("tuning pool: past its %.0f s deadline; the engine times the rest", deadline_s)
        finally:
            self.close(kill=late)
        if failed:
            log.warning("tuning pool: %d graphs not timed in a worker, the engine times them (first: %s)",
                        len(failed), failed[0])  # fmt: skip
        tuned.unanswered = [key.label() for key in self.keys if key.label() not in tuned.entries]
        tuned.seconds = time.perf_counter() - self.started
        return tuned

    def close(self, kill: bool = False) -> None:
        """Stop the workers: what they have not started is cancelled; with `kill` (a pool past
        its deadline) what they are running too."""
        if kill:
            for process in list(getattr(self._pool, "_processes", {}).values()):
                process.kill()
        self._pool.shutdown(wait=not kill, cancel_futures=True)


def _start_worker(device: int, lock) -> None:
    """A worker's set-up: its device, a stream and a cuDNN handle on it, the shared lock."""
    import cudnn
    import cupy

    cupy.cuda.Device(device).use()
    stream = cupy.cuda.Stream(non_blocking=True)
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=stream.ptr)
    _state.update(stream=stream, handle=handle, lock=lock, random=cupy.random.RandomState(SEED))


def random_buffers(key: ConvKey, random, arrays: list) -> dict[str, int]:
    """Device buffers of `key`'s shapes filled with `random`'s normal draws (the arrays are
    appended to `arrays`, which keeps them alive): X, W, Y and, for a fused graph, B, Z
    (with a residual) and A (in range-flag maths), as a graph of `key` binds them."""
    import cupy

    table = maths.of(key.math)

    def filled(count: int, dtype) -> int:
        values = cupy.empty((count,), dtype=dtype)
        fill_random(values, random)
        arrays.append(values)
        return int(values.data.ptr)

    io = table.io_dtype
    buffers = {
        "X": filled(key.batch * key.cin * key.h_in * key.w_in, io),
        "W": filled(key.cout * key.cin * key.kernel * key.kernel, io),
        "Y": filled(key.output_elements, io),
    }
    if key.epilogue is not None:
        buffers["B"] = filled(key.cout, cupy.float32)
        if key.epilogue == "bias_add_relu":
            buffers["Z"] = filled(key.output_elements, io)
        if table.range_flag:
            buffers["A"] = filled(1, cupy.float32)
    return buffers


def _time_graph(key: ConvKey) -> dict | None:
    """In a worker: `key`'s plans built and timed on random buffers of its shapes; the entry
    the build cache keeps, {"unsupported": why} for a fused graph cuDNN cannot serve, None for
    a bare one with no working plan (the engine times it and says why)."""
    import cupy

    stream = _state["stream"]
    arrays: list = []
    try:
        with stream:
            with _state["lock"]:  # GPU work: never beside another worker's timing
                buffers = random_buffers(key, _state["random"], arrays)
                stream.synchronize()
            graph = time_plans(key, _state["handle"], stream, buffers, gpu_lock=_state["lock"])
            stream.synchronize()
        return graph_entry(graph)
    except Exception as error:
        if key.epilogue is None or isinstance(error, cupy.cuda.memory.OutOfMemoryError):
            return None  # the engine times it (and says why a bare graph has no plan)
        return {"unsupported": f"{type(error).__name__}: {error}"}
    finally:
        arrays.clear()
        cupy.get_default_memory_pool().free_all_blocks()
