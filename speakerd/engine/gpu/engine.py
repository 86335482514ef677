"""GpuEngine: the model on one CUDA device, with a preallocated plan per batch size.

Everything that is set up once lives here and is shared by the plans: the CuPy stream
the whole forward runs on, the cuDNN handle bound to it, the device weights in the
layouts cuDNN reads (KRSC), one cuDNN graph per distinct convolution (its execution plan
chosen by timing), one cuDNN workspace of the largest need, the activation arena, our
compiled kernels, and the cuBLAS handle of the final linear (strict FP32: default math,
never TF32, whatever the trunk's math).

FP16 mode (SPEC 3's range rule): every FP16 kernel raises the plan's range flag where a
value leaves FP16's range, and the flag is read with the outputs. A flagged batch is
recomputed on a TF32 plan of the same size that shares the arena (fallback plans, run
eagerly: they are for the rare batch, not for speed), counted in `BatchRun.fp16_fallbacks`
(the speakerd_fp16_fallbacks_total metric) and logged once per engine: an embedding is
never silently wrong.

Plans never run at once: every entry point holds one lock while it computes, and all
compute is ordered on one stream, so the arena and the workspace can be shared safely and
several threads may call `run_batch` at once. Only the input upload happens outside the lock,
into a staging slot of its own on a copy stream (staging.py), so one batch's copy overlaps
the other's compute.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Iterator

import numpy as np

from speakerd.engine.base import BatchRun, Engine, check_engine_config
from speakerd.engine.gpu import kernels
from speakerd.engine.gpu.convs import ConvGraph, ConvKey, gpu_ms, instantiate, time_plans
from speakerd.engine.gpu.cublas import Cublas
from speakerd.engine.gpu.plan import Plan, activation_elements, fill_random, nhwc_to_nchw
from speakerd.engine.gpu.staging import INPUT_SLOTS, InputSlot
from speakerd.model.architecture import EMBEDDING_DIM, MAX_SPEAKERS, STATS_DIM, TAP_NAMES
from speakerd.model.inputs import InputError
from speakerd.model.numerics import Math
from speakerd.model.weights import FoldedConv, FoldedModel

log = logging.getLogger(__name__)

#: Runs timed per plan at start-up for `plan_times_ms` (the batcher's cost model), after
#: one warm-up run: the median of this many is stable to a few percent on an H200.
TIMING_RUNS = 10
#: Seed of the random activations the cuDNN plans are timed on (never zeros: zeros can
#: run faster than real data).
TIMING_SEED = 0
#: The math a flagged FP16 batch is recomputed in (SPEC 3: "without FP16").
FALLBACK_MATH = Math.TF32
#: Largest finite FP16 value: weights beyond it cannot be stored for FP16 mode.
HALF_MAX = 65504.0


class GpuEngine(Engine):
    """CuPy + cuDNN engine (and our convolution kernels, gpu/igemm.py and gpu/stem.py);
    FP32, TF32 or FP16 mixed. See the module docstring."""

    name = "gpu-cupy"

    def __init__(
        self,
        model: FoldedModel,
        math: Math | str = Math.FP32,
        plan_sizes: tuple[int, ...] = (1, 32),
        graphs: bool = True,
        own_kernels: bool = True,
    ) -> None:
        import cudnn
        import cupy

        math, sizes = check_engine_config(self.name, math, (Math.FP32, Math.TF32, Math.FP16), plan_sizes)
        started = time.perf_counter()
        self.model = model
        self.model_id = model.model_id
        self.math = math
        self.plan_sizes = sizes
        self._lock = threading.RLock()
        self.device = cupy.cuda.Device()
        self.sm_count = int(self.device.attributes["MultiProcessorCount"])
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.copy_stream = cupy.cuda.Stream(non_blocking=True)  # input uploads (staging.py)
        self.handle = cudnn.create_handle()
        cudnn.set_stream(handle=self.handle, stream=self.stream.ptr)
        self.cublas = Cublas(self.stream.ptr)  # strict FP32 linear; see gpu/cublas.py
        for name in kernels.KERNEL_NAMES:  # compiled and loaded now, not on the first batch
            kernels.function(name)
        self._weights: dict[int, tuple] = {}
        self._graphs: dict[ConvKey, ConvGraph] = {}
        self._failed: dict[ConvKey, str] = {}
        self._banned: dict[ConvKey, set[int]] = {}  # plans that replayed wrongly in a forward
        self._own_refused: dict[ConvKey, str] = {}  # shapes our kernel may not run, and why
        self.own_kernels = own_kernels  # False: cuDNN runs every convolution (--conv-kernels cudnn)
        self._instances: list[ConvGraph] = []
        self.seg_weight = cupy.asarray(model.seg_weight)  # [256, 5120] row-major
        self.seg_bias = cupy.asarray(model.seg_bias)
        self._fallbacks_logged = False
        with self.stream:
            self.arena = {
                name: cupy.empty((count,), dtype=cupy.float32)
                for name, count in activation_elements(sizes[-1]).items()
            }
            self._randomize_arena(math)
            self.workspace = cupy.zeros((1,), dtype=cupy.uint8)  # the real one comes below
            self.plans: dict[int, Plan] = {size: Plan(self, size, self.arena) for size in sizes}
            self.fallback_plans: dict[int, Plan] = {}
            if math == Math.FP16:
                self._randomize_arena(FALLBACK_MATH)  # the fallback plans time on float32 values
                self.fallback_plans = {size: Plan(self, size, self.arena, FALLBACK_MATH) for size in sizes}
            every = [*self.plans.values(), *self.fallback_plans.values()]
            need = max([1, *(c.workspace_bytes for p in every for c in p.convs)])
            self.workspace = cupy.zeros((need,), dtype=cupy.uint8)
            self.slots = [InputSlot(sizes[-1]) for _ in range(INPUT_SLOTS)]
        self._free_slots: queue.SimpleQueue[InputSlot] = queue.SimpleQueue()
        for slot in self.slots:
            self._free_slots.put(slot)
        self.stream.synchronize()
        cupy.get_default_memory_pool().free_all_blocks()  # timing scratch goes back
        self._times: dict[int, float] = {}
        if graphs:
            self._capture_all()
        for plan in self.plans.values():
            self._times[plan.batch] = self._time_plan(plan)
        self.setup_s = time.perf_counter() - started
        log.info(
            "gpu engine %s plans %s ready in %.1f s (%d cuDNN graphs, %.1f s building them); plan ms %s",
            math, sizes, self.setup_s, len(self._graphs), sum(g.build_s for g in self._graphs.values()),
            {size: round(ms, 3) for size, ms in self._times.items()},
        )  # fmt: skip

    # ----- shared set-up pieces, used by Plan -----------------------------------------
    def kernel(self, name: str):  # -> cupy.RawKernel
        return kernels.function(name)

    def _randomize_arena(self, math: Math) -> None:
        """Random activations in the arena as `math`'s plans read them (FP16: halves, else
        floats), for timing and checking convolutions on real-looking data."""
        import cupy

        random = cupy.random.RandomState(TIMING_SEED)
        for values in self.arena.values():
            fill_random(values.view(cupy.float16) if math == Math.FP16 else values, random)

    def device_weights(self, folded: FoldedConv, half: bool = False):
        """(weight KRSC [cout, k, k, cin], bias [cout]) on the device, uploaded once per
        dtype: float32, or float16 weights for FP16 mode (the bias stays float32: the
        epilogues add it in FP32). ValueError when a weight does not fit FP16's range."""
        import cupy

        key = (id(folded), half)
        if key not in self._weights:
            weight = np.ascontiguousarray(folded.weight.transpose(0, 2, 3, 1))
            if half:
                largest = float(np.abs(weight).max())
                if not largest <= HALF_MAX:
                    raise ValueError(
                        f"math fp16: {folded.spec.name} has a weight of magnitude {largest:.4g}, "
                        f"beyond FP16's {HALF_MAX:g}; serve this model with tf32 or fp32"
                    )
                weight = weight.astype(np.float16)
            self._weights[key] = (cupy.asarray(weight), cupy.asarray(folded.bias), folded)
        weight, bias, _ = self._weights[key]
        return weight, bias

    def conv_graph(self, key: ConvKey, buffers: dict[str, int], required: bool = True) -> ConvGraph | None:
        """The cuDNN graph for `key`, built and its plans timed on first request (again after
        a ban). A graph cuDNN cannot serve raises when `required`, else gives None (a fused
        candidate)."""
        if key in self._failed and not required:
            return None
        if key not in self._graphs:
            try:
                banned = frozenset(self._banned.get(key, ()))
                self._graphs[key] = time_plans(key, self.handle, self.stream, buffers, banned)
            except Exception as error:
                if required:
                    raise
                self._failed[key] = f"{type(error).__name__}: {error}"
                log.info("no fused cuDNN graph for %s: %s", key.label(), str(error)[:300])
                return None
        return self._graphs[key]

    def ban(self, key: ConvKey, plan_index: int) -> None:
        """Never use plan `plan_index` for `key` again (it replayed wrongly inside a captured
        forward). A fused key loses fusion altogether: its convolutions run bare with our
        epilogue, which is how every strict-FP32 graph runs. Why not try the next fused plan:
        on the H200 the TF32 b1 layer3.0.shortcut had seven fused plans, all variants of one
        engine (eng51), and every one of them replayed wrongly inside the forward. A bare
        key times its remaining plans at the next conv_graph(key)."""
        if key.epilogue is not None:
            self._failed[key] = f"fused plan {plan_index} replayed wrongly inside a captured forward"
            log.warning("%s: fusion off (%s)", key.label(), self._failed[key])
        self._banned.setdefault(key, set()).add(plan_index)
        self._graphs.pop(key, None)

    def own_allowed(self, key: ConvKey) -> bool:
        """Whether our convolution kernel may be a candidate for `key` (a bare key)."""
        return self.own_kernels and key not in self._own_refused

    def own_refusal(self, key: ConvKey) -> str:
        """Why our kernel may not run `key` ("" when it may)."""
        return self._own_refused.get(key, "" if self.own_kernels else "--conv-kernels cudnn")

    def refuse_own(self, key: ConvKey, reason: str) -> None:
        """Never run our kernel for `key` again (it disagreed with cuDNN or replayed wrongly)."""
        self._own_refused[key] = reason
        log.warning("%s: our convolution kernel turned off: %s", key.label(), reason)

    def ensure_workspace(self, need: int) -> bool:
        """Grow the shared cuDNN workspace to `need` bytes; True when it moved (captured
        graphs hold its old address and must be captured again)."""
        import cupy

        if need <= self.workspace.nbytes:
            return False
        with self.stream:
            self.workspace = cupy.zeros((need,), dtype=cupy.uint8)
        self.stream.synchronize()
        return True

    def conv_instance(self, prototype: ConvGraph) -> ConvGraph:
        """A graph of its own for one convolution, with the plan timed on `prototype`
        (see convs.instantiate for why convolutions never share one)."""
        own = instantiate(prototype, self.handle)
        self._instances.append(own)
        return own

    def linear(self, pooled, output) -> None:
        """output [rows, 256] = pooled [rows, 5120] @ seg_1.weight^T in FP32 on cuBLAS."""
        x, weight, out = pooled.data.ptr, self.seg_weight.data.ptr, output.data.ptr
        self.cublas.linear(x, weight, out, pooled.shape[0], STATS_DIM, EMBEDDING_DIM)

    # ----- Engine interface -----------------------------------------------------------
    def plan_for(self, chunks: int) -> Plan:
        """The smallest plan holding `chunks`."""
        for size in self.plan_sizes:
            if chunks <= size:
                return self.plans[size]
        raise InputError("fbank", f"{chunks} chunks in one batch, expected at most {self.max_batch}")

    def run_batch(self, fbank: np.ndarray, masks: np.ndarray, *, use_graph: bool = True) -> BatchRun:
        """One batch on the smallest plan holding it: its graph replayed (`use_graph`,
        when captured) or the forward enqueued eagerly. See Engine.run_batch.

        The batch is staged and uploaded on the copy stream before the compute lock is
        taken, so a second thread's upload overlaps this one's compute (staging.py)."""
        chunks = int(masks.shape[0]) if masks.ndim == 3 else 1
        self._check_open()
        plan = self.plan_for(max(1, chunks))
        start = time.perf_counter()
        with self._staged(plan, fbank, masks) as (slot, chunks):
            slot.ready.synchronize()  # only this thread waits; the compute stream waits on the event
            copied = time.perf_counter()
            with self._lock:
                self._check_open()
                plan.load(slot)
                compute_ms, mode = gpu_ms(self.stream, lambda: plan.run(use_graph))
                computed = time.perf_counter()
                output, _active, flagged = plan.download(chunks)
                done = time.perf_counter()
                compute_s = compute_ms / 1e3
                plans = [f"b{plan.batch}/{mode}"]
                if flagged:  # out of FP16's range: this batch again, without FP16
                    output, again_s = self._recompute(plan, slot, chunks)
                    compute_s += again_s
                    plans.append(f"b{plan.batch}/{FALLBACK_MATH}-fallback")
        return BatchRun(
            embeddings=output.reshape(chunks, MAX_SPEAKERS, EMBEDDING_DIM),
            plans=plans,
            compute_s=compute_s,
            h2d_s=copied - start,
            d2h_s=done - computed,
            graph_replays=int(mode == "graph"),
            eager_runs=int(mode == "eager") + int(flagged),
            fp16_fallbacks=int(flagged),
        )

    def _recompute(self, plan: Plan, slot: InputSlot, chunks: int) -> tuple[np.ndarray, float]:
        """(output, GPU seconds) of a flagged FP16 batch run again on its fallback plan
        (caller holds the lock; `slot` still holds the batch). Logged once per engine."""
        if not self._fallbacks_logged:
            self._fallbacks_logged = True
            log.warning(
                "b%d: an FP16 value left FP16's range; the batch is recomputed in %s (logged once; "
                "the speakerd_fp16_fallbacks_total metric counts every one)",
                plan.batch,
                FALLBACK_MATH,
            )
        fallback = self.fallback_plans[plan.batch]
        fallback.load(slot)
        again_ms, _mode = gpu_ms(self.stream, lambda: fallback.run(use_graph=False))
        output, _active, _ = fallback.download(chunks)
        return output, again_ms / 1e3

    @contextlib.contextmanager
    def _staged(self, plan: Plan, fbank: np.ndarray, masks: np.ndarray) -> Iterator[tuple[InputSlot, int]]:
        """A free input slot holding the batch, its upload enqueued; (slot, chunks).
        The slot goes back to the pool when the block ends (after the plan consumed it)."""
        chunks, frames = plan.check_inputs(fbank, masks)
        slot = self._free_slots.get()
        try:
            slot.stage(fbank, masks, frames, self.copy_stream)
            yield slot, chunks
        finally:
            self._free_slots.put(slot)

    def active_frames(self, chunks: int) -> np.ndarray:
        """[chunks, 3] trunk frames with non-zero weight of the last batch of that plan,
        as the pooling kernel counted them (0 flags an empty mask)."""
        with self._lock:
            plan = self.plan_for(chunks)
            return plan.host_active[: chunks * MAX_SPEAKERS].reshape(chunks, MAX_SPEAKERS).copy()

    def forward_with_taps(self, fbank: np.ndarray, masks: np.ndarray) -> dict[str, np.ndarray]:
        """Eager forward returning FP32 host copies of all 38 taps (NCHW trunk taps; rows
        = chunk * 3 + speaker after pooling), each tap copied as soon as it is computed."""
        taps: dict[str, np.ndarray] = {}
        chunks = int(masks.shape[0]) if masks.ndim == 3 else 1
        plan = self.plan_for(max(1, chunks))
        with self._staged(plan, fbank, masks) as (slot, chunks), self._lock:
            self._check_open()
            plan.load(slot)

            def copy(name: str, view, shape: tuple[int, ...]) -> None:
                if name in taps:
                    raise AssertionError(f"tap {name} fired twice")
                host = view.get(stream=self.stream)
                self.stream.synchronize()
                if len(shape) == 4:
                    taps[name] = nhwc_to_nchw(host, (chunks, *shape[1:]))
                else:
                    taps[name] = np.ascontiguousarray(host[: chunks * MAX_SPEAKERS])

            plan.forward(copy)
            self.stream.synchronize()
        missing = [name for name in TAP_NAMES if name not in taps]
        assert not missing, f"taps never fired: {missing}"
        return taps

    def profile(self, batch: int, repeats: int = 5) -> list[tuple[str, float]]:
        """GPU ms between consecutive taps of an eager forward of plan `batch` (CUDA events
        recorded at every tap; the median of `repeats` forwards), on whatever inputs the
        plan holds. Eager launch gaps are included where the GPU waited for the host."""
        import cupy

        samples: dict[str, list[float]] = {}
        with self._lock:
            self._check_open()
            plan = self.plans[batch]
            for _ in range(repeats):
                events: list[tuple[str, object]] = []
                start = cupy.cuda.Event()
                start.record(self.stream)

                def mark(name: str, _view, _shape, events=events) -> None:
                    event = cupy.cuda.Event()
                    event.record(self.stream)
                    events.append((name, event))

                plan.forward(mark)
                self.stream.synchronize()
                previous = start
                for name, event in events:
                    samples.setdefault(name, []).append(cupy.cuda.get_elapsed_time(previous, event))
                    previous = event
        return [(name, float(np.median(values))) for name, values in samples.items()]

    def capture_graph(self, batch: int) -> None:
        """(Re)capture plan `batch`'s forward into a CUDA graph (all plans' graphs when a
        re-chosen convolution had to grow the shared workspace)."""
        with self._lock:
            self._check_open()
            if self.plans[batch].capture_graph():
                self._capture_all()

    def _capture_all(self) -> None:
        """Capture every plan's graph; again while a capture grew the workspace (the
        graphs captured before it would hold its old address)."""
        for _ in range(len(self.plans) + 1):
            if not any([plan.capture_graph() for plan in self.plans.values()]):
                return
        raise RuntimeError("the cuDNN workspace kept growing while graphs were captured")

    def has_graph(self, batch: int) -> bool:
        return self.plans[batch].graph is not None

    def _time_plan(self, plan: Plan) -> float:
        plan.run()
        return float(np.median([gpu_ms(self.stream, plan.run)[0] for _ in range(TIMING_RUNS)]))

    def plan_times_ms(self) -> dict[int, float]:
        return dict(self._times)

    def memory_report(self) -> dict[str, int]:
        """Device bytes by kind: buffers (plans' own + the shared activation arena),
        weights, cuDNN workspace, and their total; plus pinned host staging bytes."""
        every = [*self.plans.values(), *self.fallback_plans.values()]
        own = sum(plan.own_bytes() for plan in every)
        own += sum(slot.device_bytes() for slot in self.slots)
        arena = sum(int(a.nbytes) for a in self.arena.values())
        weights = sum(int(w.nbytes) + int(b.nbytes) for w, b, _ in self._weights.values())
        weights += int(self.seg_weight.nbytes) + int(self.seg_bias.nbytes)
        workspace = int(self.workspace.nbytes) + int(self.cublas.workspace.nbytes)  # cuDNN + cuBLAS
        return {
            "buffers": own + arena,
            "weights": weights,
            "workspace": workspace,
            "total": own + arena + weights + workspace,
            "pinned_host": sum(plan.pinned_bytes() for plan in every)
            + sum(slot.pinned_bytes() for slot in self.slots),
        }

    def conv_report(self, batch: int) -> list[dict]:
        """Per convolution of plan `batch`: the chosen cuDNN plan, fused or ours, ms, TFLOP/s."""
        rows = []
        plan = self.plans[batch]

        def ms(value: float | None) -> float | None:
            return None if value is None else round(value, 4)

        for choice in plan.convs:
            key, graph = ConvKey.of(choice.spec, batch, plan.math, None), choice.graph
            if choice.own is not None:
                epilogue = "in-our-kernel"
            else:
                epilogue = "cudnn-fused" if choice.fused else f"ours:{choice.epilogue_kernel}"
            rows.append({
                "conv": choice.name, "shape": key.label(), "runs": choice.runner, "ms": round(choice.ms, 4),
                "cudnn_plan": None if graph is None else graph.plan_name, "epilogue": epilogue,
                "conv_ms": None if graph is None else ms(graph.ms), "epilogue_ms": ms(choice.epilogue_ms),
                "bare_plus_ours_ms": ms(choice.bare_ms), "fused_ms": ms(choice.fused_ms),
                "own_kernel_ms": ms(choice.own_ms), "tflops": round(key.flops / (choice.ms * 1e9), 1),
                "plans_ms": None if graph is None else graph.plan_ms,
                "graph_build_s": None if graph is None else round(graph.build_s, 2),
            })  # fmt: skip
        return rows

    def build_report(self) -> dict:
        """Start-up cost: seconds in total and building cuDNN graphs, graphs, failed fusions."""
        return {
            "setup_s": round(self.setup_s, 2),
            "cudnn_graphs": len(self._graphs),
            "cudnn_build_s": round(sum(g.build_s for g in self._graphs.values()), 2),
            "conv_instances": len(self._instances),
            "instance_build_s": round(sum(g.build_s for g in self._instances), 2),
            "fusions_unsupported": sorted(key.label() for key in self._failed),  # or turned off
            "own_kernel_refused": {key.label(): why for key, why in self._own_refused.items()},
            "fp16_fallback_plans": [f"b{size}/{FALLBACK_MATH}/eager" for size in self.fallback_plans],
        }

    def _check_open(self) -> None:
        if not self.plans:
            raise RuntimeError(f"{self.name}: the engine is closed")

    def close(self) -> None:
        import cudnn

        with self._lock:
            for plan in self.plans.values():
                plan.graph = None
            self.plans = {}
            self.fallback_plans = {}
            self._graphs.clear()
            self._instances.clear()
            self.cublas.close()
            if self.handle is not None:
                cudnn.destroy_handle(self.handle)
                self.handle = None
