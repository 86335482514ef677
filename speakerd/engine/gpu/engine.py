"""GpuEngine: the model on one CUDA device, with a preallocated plan per batch size.

The engine sets up once what its plans share and hands it to them as a frozen
DeviceContext (context.py): the CuPy stream the whole forward runs on, the cuDNN handle
bound to it, the device weights in the layouts the kernels read (KRSC), one cuDNN workspace
of the largest need, the activation arena, our compiled kernels, and the cuBLAS handle of
the final linear (strict FP32: default math, never TF32, whatever the trunk's math). One
Autotuner (autotune.py) chooses every convolution of every plan; one GraphCapture
(capture.py) per plan records and checks its CUDA graph.

Range-flag maths (FP16, docs/parity.md's range rule; see maths.py): every FP16 kernel raises the
plan's range flag where a value leaves FP16's range, and the flag is read with the outputs.
A flagged batch is recomputed on a plan of the math's fallback (TF32) of the same size that
shares the arena (fallback plans, run eagerly: they are for the rare batch, not for speed),
counted in `BatchRun.fp16_fallbacks` (the speakerd_fp16_fallbacks_total metric) and logged
once per engine: an embedding is never silently wrong.

Plans never run at once: every entry point holds one lock while it computes, and all
compute is ordered on one stream, so the arena and the workspace can be shared safely and
several threads may call `run_batch` at once. Only the input upload happens outside the
lock, into a staging slot of its own on a copy stream (staging.py), so one batch's copy
overlaps the other's compute. A batch given as pieces (the batcher's requests) is copied
piece by piece into the slot's pinned memory: the host never joins it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from speakerd.engine.base import BatchInputs, BatchRun, Engine, Pieces, batch_inputs, check_engine_config
from speakerd.engine.build_cache import BUILD_CACHE_VARIABLE, BuildCache, Loaded
from speakerd.engine.gpu import held, kernels, maths, recording
from speakerd.engine.gpu.autotune import Autotuner
from speakerd.engine.gpu.build_key import conv_kernels_option, engine_build_key
from speakerd.engine.gpu.capture import GraphCapture
from speakerd.engine.gpu.context import DeviceContext, DeviceWeights, SplitScratch, Workspace
from speakerd.engine.gpu.convs import ConvKey
from speakerd.engine.gpu.cublas import Cublas
from speakerd.engine.gpu.plan import Plan, activation_elements, nhwc_to_nchw, read_results
from speakerd.engine.gpu.recording import GpuRecordingFrames
from speakerd.engine.gpu.staging import INPUT_SLOTS, InputSlot
from speakerd.engine.gpu.timing import fill_random, gpu_ms, median_ms
from speakerd.engine.gpu.tuning_pool import TuningPool, pool_for
from speakerd.engine.gpu.waveform import WaveformFbank, WaveformRows
from speakerd.model.architecture import EMBEDDING_DIM, MAX_SPEAKERS, TAP_NAMES
from speakerd.model.inputs import InputError
from speakerd.model.numerics import Math
from speakerd.model.weights import FoldedModel

log = logging.getLogger(__name__)

#: Runs timed per plan at start-up for `plan_times_ms` (the batcher's cost model), after
#: one warm-up run: the median of this many is stable to a few percent on an H200.
TIMING_RUNS = 10
#: Seed of the random activations the cuDNN plans are timed on (never zeros: zeros can
#: run faster than real data).
TIMING_SEED = 0


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
        fused_blocks: bool = False,
        build_cache: BuildCache | None = None,
        tuning_workers: int | None = None,
        tuning: TuningPool | None = None,
    ) -> None:
        import cudnn
        import cupy

        math, sizes = check_engine_config(self.name, math, tuple(maths.MATHS), plan_sizes)
        started = time.perf_counter()
        self.model = model
        self.model_id = model.model_id
        self.math = math
        self.table = maths.of(math)
        self.plan_sizes = sizes
        self.own_kernels = own_kernels  # False: cuDNN runs every convolution (--conv-kernels cudnn)
        self._lock = threading.RLock()
        self._fallbacks_logged = False
        self._distances = None  # GpuDistances, made by pair_distances
        self._linkage = None  # GpuLinkage, made by centroid_linkage
        self._last_active: dict[int, np.ndarray] = {}  # plan batch -> the last run's active frames
        #: the event where the last batch enqueued ends (BatchRun.gap_s): one per batch, never
        #: recorded again, so reading it later cannot race with a newer batch (a slot's own
        #: events are reused by the batch staged into it next, maybe before this one is read)
        self._last_end: Any = None
        self.device = int(cupy.cuda.Device().id)  # the current device: bound on each engine thread
        #: where this build's choices are kept, under what key, and what was loaded
        self.build_cache = build_cache
        self.build_key = engine_build_key(self.device, model.model_id, math, sizes,
                                          conv_kernels_option(own_kernels, fused_blocks))  # fmt: skip
        loaded = build_cache.load(self.build_key) if build_cache is not None else Loaded(None, "no cache")
        self.build_loaded = loaded.entries or {}
        # the kernels set-up needs, compiled at once on threads (a fresh machine's ~40 s of
        # NVRTC on one core) while the context and weights are made; waited for before the
        # first plan is timed, since a CUDA graph captured in global mode (convs.py) fails
        # when another thread loads a module or allocates meanwhile
        compiling = kernels.compile_in_background(self.device)
        stream = cupy.cuda.Stream(non_blocking=True)
        handle = cudnn.create_handle()
        cudnn.set_stream(handle=handle, stream=stream.ptr)
        with stream:
            self.ctx = DeviceContext(
                stream=stream,
                copy_stream=cupy.cuda.Stream(non_blocking=True),
                cudnn=handle,
                cublas=Cublas(stream.ptr),  # strict FP32 linear; see gpu/cublas.py
                workspace=Workspace(stream),
                split_scratch=SplitScratch(stream),
                weights=DeviceWeights(model),
                # compiled and loaded now, not on the first batch
                kernels={name: kernels.function(name) for name in kernels.KERNEL_NAMES},
                arena={
                    name: cupy.empty((count,), dtype=cupy.float32)
                    for name, count in activation_elements(sizes[-1]).items()
                },
                sm_count=int(cupy.cuda.Device().attributes["MultiProcessorCount"]),
                compute_capability=str(cupy.cuda.Device().compute_capability),
            )
            # nothing cached: the cuDNN graphs are timed in worker processes (tuning_pool.py)
            # while this process finishes compiling; `tuning`: a pool the start-up began
            # before the model was loaded (closed unused when the cache held this model's)
            if self.build_loaded and tuning is not None:
                tuning.close()
            pool = None if self.build_loaded else tuning or pool_for(self.device, math, sizes, tuning_workers)
            concurrent.futures.wait(compiling)  # a failed compile fails again where it is used
            #: what the tuning pool answered (None: no pool)
            self.tuned = pool.result() if pool is not None else None
            if self.tuned is not None:
                tuned = self.tuned
                left = f"; {len(tuned.unanswered)} left to this process" if tuned.unanswered else ""
                log.info("%d cuDNN graphs timed in %d worker processes in %.1f s%s", len(tuned.entries),
                         tuned.workers, tuned.seconds, left)  # fmt: skip
            graphs = self.tuned.entries if self.tuned is not None else self.build_loaded.get("graphs")
            self.tuner = Autotuner(self.ctx, own_kernels, fused_blocks, graphs,
                                   self.build_loaded.get("choices"))  # fmt: skip
            self._randomize_arena(math)
            self.plans: dict[int, Plan] = {
                size: Plan(self.ctx, self.tuner, model, size, math) for size in sizes
            }
            self.fallback_plans: dict[int, Plan] = {}
            fallback = self.table.fallback
            if fallback is not None:
                self._randomize_arena(fallback)  # the fallback plans time on their own io dtype
                self.fallback_plans = {
                    size: Plan(self.ctx, self.tuner, model, size, fallback) for size in sizes
                }
            every = [*self.plans.values(), *self.fallback_plans.values()]
            self.ctx.workspace.grow(max([1, *(c.choice.workspace_bytes for p in every for c in p.convs)]))
            self.slots = [InputSlot(sizes[-1]) for _ in range(INPUT_SLOTS)]
            self._waveforms = WaveformFbank()  # EmbedChunks' waveform input, fbank on this GPU
            recording.warm_up()  # EmbedRecording's kernels compiled now, not in the first call
        self.captures = {size: GraphCapture(plan) for size, plan in self.plans.items()}
        self._free_slots: queue.SimpleQueue[InputSlot] = queue.SimpleQueue()
        for slot in self.slots:
            self._free_slots.put(slot)
        stream.synchronize()
        cupy.get_default_memory_pool().free_all_blocks()  # timing scratch goes back
        if graphs:
            self._capture_all()
        self._times = {size: median_ms(stream, self.captures[size].run, TIMING_RUNS) for size in sizes}
        self.setup_s = time.perf_counter() - started
        report = self.tuner.report()
        log.info(
            "gpu engine %s plans %s ready in %.1f s (%d cuDNN graphs built in %.1f s, %d convolutions built "
            "in %.1f s, %d of %d on cached choices); plan ms %s",
            math, sizes, self.setup_s, report["cudnn_graphs"], report["cudnn_build_s"],
            report["conv_instances"], report["instance_build_s"], report["conv_choices_cached"],
            len(self.tuner.choice_entries),
            {size: round(ms, 3) for size, ms in self._times.items()},
        )  # fmt: skip

    def build_entries(self) -> dict:
        """What this build chose that the next start under the same key may use."""
        return {"graphs": dict(self.tuner.graph_entries), "choices": dict(self.tuner.choice_entries)}

    def keep_build(self) -> None:
        """Store this build's choices in the build cache (after the self-check passed: only a
        proven build is kept), unless the cache already holds exactly these."""
        if self.build_cache is not None and self.build_entries() != self.build_loaded:
            try:
                path = self.build_cache.store(self.build_key, self.build_entries())
            except OSError as error:  # serving goes on; the next start builds afresh
                where = self.build_cache.directory
                log.warning("build cache: this build's choices could not be kept in %s (%s): set %s to a "
                            "writable directory", where, error, BUILD_CACHE_VARIABLE)  # fmt: skip
                return
            log.info("build cache: this build's choices kept in %s", path)

    def forget_build(self) -> None:
        """Remove this key's cached choices (they built an engine that failed its self-check)."""
        if self.build_cache is not None:
            path = self.build_cache.path(self.build_key)
            try:
                path.unlink(missing_ok=True)
            except OSError as error:
                log.warning("build cache: %s could not be removed (%s)", path, error)

    @property
    def built_from_cache(self) -> bool:
        """Whether cached choices were used for this build."""
        return bool(self.build_loaded)

    @property
    def stream(self):
        """The compute stream (every plan's forward runs on it)."""
        return self.ctx.stream

    def _randomize_arena(self, math: Math) -> None:
        """Random activations in the arena as `math`'s plans read them (its io dtype), for
        timing and checking convolutions on real-looking data."""
        import cupy

        random = cupy.random.RandomState(TIMING_SEED)
        dtype = maths.of(math).io_dtype
        for values in self.ctx.arena.values():
            fill_random(values.view(dtype), random)

    # ----- Engine interface -----------------------------------------------------------
    def plan_for(self, chunks: int) -> Plan:
        """The smallest plan holding `chunks`."""
        for size in self.plan_sizes:
            if chunks <= size:
                return self.plans[size]
        raise InputError("fbank", f"{chunks} chunks in one batch, expected at most {self.max_batch}")

    def run_batch(self, fbank: Pieces, masks: Pieces, *, use_graph: bool = True) -> BatchRun:
        """One batch on the smallest plan holding it: its graph replayed (`use_graph`,
        when captured) or the forward enqueued eagerly. See Engine.run_batch.

        The batch is staged and uploaded on the copy stream before the compute lock is
        taken, so a second thread's upload overlaps this one's compute (staging.py). The
        lock covers only the enqueueing (inputs moved in, forward, results' download into
        the slot's own pinned arrays); the wait for the results comes after it, so the next
        batch's forward is already queued behind this one and the GPU does not idle while
        this thread wakes, copies its rows out and hands the lock over (with the wait inside
        the lock, ~0.1 s of an hour's 0.65 s in process on the H200 was such gaps)."""
        import cupy

        self._check_open()
        inputs = batch_inputs(fbank, masks)
        chunks = inputs.chunks
        plan = self.plan_for(chunks)
        start = time.perf_counter()
        held.bind(self.device)
        end = cupy.cuda.Event()  # where this batch ends, for the next one's gap (BatchRun.gap_s)
        with self._staged(inputs) as slot:
            slot.ready.synchronize()  # only this thread waits; the compute stream waits on the event
            copied = time.perf_counter()
            with self._lock:  # every call in here keeps the interpreter lock (held.py)
                self._check_open()
                plan.load(slot)
                held.record(slot.started, self.stream)
                mode = self.captures[plan.batch].run(use_graph)
                held.record(slot.computed, self.stream)
                plan.enqueue_download(chunks, slot.host_output, slot.host_active, slot.host_flag)
                held.record(slot.finished, self.stream)
                held.record(end, self.stream)
                previous, self._last_end = self._last_end, end
            slot.finished.synchronize()
            gap_s = None if previous is None else cupy.cuda.get_elapsed_time(previous, slot.started) / 1e3
            output, active, flagged = read_results(
                chunks, slot.host_output, slot.host_active, slot.host_flag, self.table.range_flag
            )
            self._last_active[plan.batch] = active  # for active_frames (one reference, swapped whole)
            compute_s = cupy.cuda.get_elapsed_time(slot.started, slot.computed) / 1e3
            d2h_s = cupy.cuda.get_elapsed_time(slot.computed, slot.finished) / 1e3
            plans = [f"b{plan.batch}/{mode}"]
            if flagged:  # out of the io dtype's range: this batch again, in the fallback math
                with self._lock:
                    self._check_open()
                    output, again_s = self._recompute(plan, slot, chunks)
                compute_s += again_s
                plans.append(f"b{plan.batch}/{self.table.fallback}-fallback")
        return BatchRun(
            embeddings=output.reshape(chunks, MAX_SPEAKERS, EMBEDDING_DIM),
            plans=plans,
            compute_s=compute_s,
            h2d_s=copied - start,
            d2h_s=d2h_s,
            graph_replays=int(mode == "graph"),
            eager_runs=int(mode == "eager") + int(flagged),
            fp16_fallbacks=int(flagged),
            gap_s=gap_s,
        )

    def _recompute(self, plan: Plan, slot: InputSlot, chunks: int) -> tuple[np.ndarray, float]:
        """(output, GPU seconds) of a flagged batch run again on its fallback plan (caller
        holds the lock; `slot` still holds the batch). Logged once per engine."""
        if not self._fallbacks_logged:
            self._fallbacks_logged = True
            log.warning(
                "b%d: an FP16 value left FP16's range; the batch is recomputed in %s (logged once; "
                "the speakerd_fp16_fallbacks_total metric counts every one)",
                plan.batch,
                self.table.fallback,
            )
        fallback = self.fallback_plans[plan.batch]
        fallback.load(slot)
        again_ms, _ = gpu_ms(self.stream, fallback.forward)
        output, _active, _ = fallback.download(chunks)
        return output, again_ms / 1e3

    @contextlib.contextmanager
    def _staged(self, inputs: BatchInputs) -> Iterator[InputSlot]:
        """A free input slot holding the batch, its upload enqueued. The slot goes back to
        the pool when the block ends (after the plan consumed it)."""
        slot = self._free_slots.get()
        try:
            slot.stage(inputs, self.ctx.copy_stream)
            yield slot
        finally:
            self._free_slots.put(slot)

    def active_frames(self, chunks: int) -> np.ndarray:
        """[chunks, 3] trunk frames with non-zero weight of the last batch `run_batch` ran on
        that plan, as the pooling kernel counted them (0 flags an empty mask). Kept per plan
        by run_batch: the plan's own pinned arrays are no longer where results land (each
        batch downloads into its staging slot, engine.run_batch)."""
        plan = self.plan_for(chunks)
        active = self._last_active.get(plan.batch)
        if active is None:
            raise RuntimeError(f"{self.name}: no batch has run on plan b{plan.batch} yet")
        return active[: chunks * MAX_SPEAKERS].reshape(chunks, MAX_SPEAKERS).copy()

    def forward_with_taps(self, fbank: Pieces, masks: Pieces) -> dict[str, np.ndarray]:
        """Eager forward returning FP32 host copies of all 38 taps (NCHW trunk taps; rows
        = chunk * 3 + speaker after pooling), each tap copied as soon as it is computed."""
        taps: dict[str, np.ndarray] = {}
        inputs = batch_inputs(fbank, masks)
        chunks = inputs.chunks
        plan = self.plan_for(chunks)
        with self._staged(inputs) as slot, self._lock:
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

    # ----- CUDA graphs ------------------------------------------------------------------
    def capture_graph(self, batch: int) -> None:
        """(Re)capture plan `batch`'s forward into a CUDA graph (all plans' graphs when a
        re-chosen convolution had to grow the shared workspace)."""
        with self._lock:
            self._check_open()
            if self.captures[batch].capture():
                self._capture_all()

    def _capture_all(self) -> None:
        """Capture every plan's graph; again while a capture grew the workspace (the
        graphs captured before it would hold its old address)."""
        for _ in range(len(self.plans) + 1):
            if not any([capture.capture() for capture in self.captures.values()]):
                return
        raise RuntimeError("the cuDNN workspace kept growing while graphs were captured")

    def has_graph(self, batch: int) -> bool:
        return self.captures[batch].graph is not None

    # ----- reports ----------------------------------------------------------------------
    def pair_distances(self) -> Callable[[np.ndarray], np.ndarray]:
        """The clustering's distances on this engine's device (engine/gpu/distances.py), built
        on the first call (a server makes it at start-up: serve.py's diarization_linker)."""
        if self._distances is None:
            with self._lock:
                if self._distances is None:
                    from speakerd.engine.gpu.distances import GpuDistances

                    self._distances = GpuDistances(self.device)
        return self._distances.square

    def centroid_linkage(self):  # -> GpuLinkage
        """The clustering's whole centroid linkage on this engine's device
        (engine/gpu/linkage.py), built on the first call (a server makes it at start-up)."""
        if self._linkage is None:
            with self._lock:
                if self._linkage is None:
                    from speakerd.engine.gpu.linkage import GpuLinkage

                    self._linkage = GpuLinkage(self.device)
        return self._linkage

    def waveform_fbank(self, waveform: np.ndarray) -> WaveformRows:
        """Waveform rows whose fbank the GPU computes when their batch is staged (waveform.py)."""
        self._check_open()
        return self._waveforms.rows(waveform)

    def fbank_source(self, step: int) -> GpuRecordingFrames:
        """A recording's fbank on this GPU: frames computed once on the device, each batch's
        windows written straight into its staging slot (engine/gpu/recording.py)."""
        self._check_open()
        return GpuRecordingFrames(step)

    def plan_times_ms(self) -> dict[int, float]:
        return dict(self._times)

    def memory_report(self) -> dict[str, int]:
        """Device bytes by kind: buffers (plans' own + the shared activation arena),
        weights, workspace (cuDNN's, cuBLAS's and our split-K scratch), and their total;
        plus pinned host staging bytes."""
        every = [*self.plans.values(), *self.fallback_plans.values()]
        own = sum(plan.own_bytes() for plan in every)
        own += sum(slot.device_bytes() for slot in self.slots)
        arena = sum(int(a.nbytes) for a in self.ctx.arena.values())
        weights = self.ctx.weights.nbytes()
        ctx = self.ctx
        workspace = ctx.workspace.nbytes + int(ctx.cublas.workspace.nbytes) + ctx.split_scratch.nbytes
        return {
            "buffers": own + arena,
            "weights": weights,
            "workspace": workspace,
            "total": own + arena + weights + workspace,
            "pinned_host": sum(plan.pinned_bytes() for plan in every)
            + sum(slot.pinned_bytes() for slot in self.slots),
        }

    def conv_report(self, batch: int) -> list[dict]:
        """Per convolution of plan `batch`: the chosen cuDNN plan, fused or ours, ms, TFLOP/s,
        and what refused to run it (candidate: reason). Where one kernel runs a whole block,
        its time is on conv1's row (TFLOP/s of both convs) and conv2's row has 0; both keep
        what would run them alone as `unfused_ms`."""
        rows = []

        def ms(value: float | None) -> float | None:
            return None if value is None else round(value, 4)

        plan = self.plans[batch]
        blocks = {id(conv): block for block in plan.blocks for conv in (block.first, block.second)}
        for step in plan.convs:
            choice = step.choice
            key, graph = ConvKey.of(step.request.spec, batch, step.request.math, None), choice.graph
            if choice.own is not None:
                epilogue = "in-our-kernel"
            else:
                epilogue = "cudnn-fused" if choice.fused else f"ours:{choice.epilogue.kind}"  # type: ignore[union-attr]
            rows.append({
                "conv": step.name, "shape": key.label(), "runs": choice.runner, "ms": round(choice.ms, 4),
                "cudnn_plan": None if graph is None else graph.plan_name, "epilogue": epilogue,
                "conv_ms": None if graph is None else ms(graph.ms), "epilogue_ms": ms(choice.epilogue_ms),
                "bare_plus_ours_ms": ms(choice.bare_ms), "fused_ms": ms(choice.fused_ms),
                "own_kernel_ms": ms(choice.own_ms), "tflops": round(key.flops / (choice.ms * 1e9), 1),
                "plans_ms": None if graph is None else graph.plan_ms,
                "graph_build_s": None if graph is None else round(graph.build_s, 2),
                "refused": [f"{refusal.candidate}: {refusal.reason}" for refusal in choice.refusals],
            })  # fmt: skip
            block = blocks.get(id(step))
            if block is not None:  # the block's kernel runs it: its time goes on conv1's row
                first = step is block.first
                rows[-1].update({
                    "runs": block.runner if first else f"{block.runner} (in {block.name}.conv1's row)",
                    "ms": round(block.choice.ms if first else 0.0, 4), "unfused_ms": rows[-1]["ms"],
                    "block_pair_ms": round(block.choice.pair_ms, 4),
                    "tflops": round(2 * key.flops / (block.choice.ms * 1e9), 1) if first else None,
                })  # fmt: skip
        return rows

    def build_report(self) -> dict:
        """Start-up cost: seconds in total and building cuDNN graphs, graphs, failed fusions,
        shapes our kernels were turned off for, and every candidate's refusal."""
        fallback = self.table.fallback
        return {
            "setup_s": round(self.setup_s, 2),
            **self.tuner.report(),
            "fp16_fallback_plans": [f"b{size}/{fallback}/eager" for size in self.fallback_plans],
        }

    def _check_open(self) -> None:
        if not self.plans:
            raise RuntimeError(f"{self.name}: the engine is closed")

    def close(self) -> None:
        import cudnn

        with self._lock:
            if not self.plans:
                return
            # batches enqueued by threads now waiting off the lock still read these buffers
            self.stream.synchronize()
            for capture in self.captures.values():
                capture.graph = None
            self.captures = {}
            self.plans = {}
            self.fallback_plans = {}
            self.tuner.close()
            self.ctx.cublas.close()
            cudnn.destroy_handle(self.ctx.cudnn)
