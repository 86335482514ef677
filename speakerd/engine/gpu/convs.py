"""Trunk convolutions through cuDNN frontend graphs (NHWC; float32 storage, float16 in FP16 mode).

Each distinct (shape, batch, math, fusion) gets one cuDNN graph whose execution plans
are built one by one and timed once on real buffers, replayed from CUDA graphs; the
fastest is kept (docs/performance.md: the
heuristic's first plan was up to 7x slower than the best). Buffers are bound at
execution, so one graph serves every convolution of that shape in the trunk.

Math (the rows of maths.py): strict FP32 deselects tensor-core engines too (an FP32-io
cuDNN convolution otherwise runs TF32), TF32 allows them (never FP16 down-conversion),
FP16 mixed uses half X, W and Y with FP32 compute (FP16 accumulation deselected). Fused
graphs (conv + bias [+ residual] [+ ReLU]) are built only where the math allows them
(TF32, and FP16 with an AMAX reduction as its range check, "A"); in strict FP32 our
epilogue kernel follows the bare conv (autotune.py says why).
Non-deterministic engines are always excluded, so two eager passes agree bit for bit.
Plans are timed as they serve: one execution captured into a CUDA graph and replayed.
A plan whose replay does not write the same bits as its eager execution is no candidate,
and plans that also capture in global mode and replay twice over a NaN-filled workspace
are preferred to any that do not (on the H200 a TF32 b1 shortcut conv replayed alone
fine yet differently inside the whole captured forward, with every plan tried).

Why plans are built one index at a time rather than with `build_plans(ALL)`: the C++
frontend refuses to build a deselected plan with an error that is not a "not
supported" decline, and the Python layer of frontend 1.32 propagates such an error out
of the ALL walk; building per index turns every refusal into "not a candidate".
"""

from __future__ import annotations

import logging
import statistics
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace

from speakerd.engine.gpu import maths
from speakerd.engine.gpu.bitwise import replay_matches
from speakerd.engine.gpu.epilogue import EPILOGUES
from speakerd.engine.gpu.timing import replay_ms
from speakerd.model.architecture import ConvSpec
from speakerd.model.numerics import Math

log = logging.getLogger(__name__)

#: Timed repetitions per execution plan (after one warm-up run): enough to rank plans
#: that differ by more than a few percent, cheap enough for ~25 graphs x ~10 plans.
TIMED_RUNS = 5
#: A plan slower than this multiple of the best so far on its warm-up run is not timed
#: further (strict FP32 has 50-100 ms plans next to 1-2 ms ones).
HOPELESS = 3.0
#: Execution plans that build and are timed per graph, in heuristic order (deselected ones
#: do not count: in strict FP32 the first dozen are all tensor-core plans). The best of every
#: trunk shape (measured on an H200: the specification's cuDNN anchors) was within the first 12, and
#: each runtime-compiled plan costs an NVRTC build at start-up.
MAX_PLANS = 12
#: The same for an FP16 fused graph (conv, epilogue and its AMAX range check): every plan
#: of those is runtime-compiled by cuDNN (eng4), ~3 s of start-up per graph at 12 plans
#: (an FP16 engine took 129 s to build, 28 s before fusion). On the H200 the fastest of
#: the first six was among the first five for all twelve trunk shapes probed
#: (scripts/probe_fp16_fusion.py at 97780cc; its output is in git history under measurements/).
MAX_RANGE_FUSED_PLANS = 5
#: cuDNN's heuristic modes whose execution plans are timed (cudnn.heur_mode names): A's
#: ranked list and the FALLBACK engines; scripts/probe_fp16_fusion.py --modes asks others.
HEURISTIC_MODES = ("A", "FALLBACK")
#: Plans needing more workspace than this are not candidates. Strict FP32's fastest plans
#: need a lot: eng70 ran layer1's b32 conv in 2.10 ms with 654 MB of workspace where the
#: best plan without workspace took 4.79 ms, layer2's in 1.40 ms with 327 MB vs 4.68
#: (an H200 probe of every strict plan at ea614f9, in git history under measurements/).
#: One workspace of the largest need is shared by every convolution, so 1 GiB is the most
#: it costs on a 141 GB device; larger is refused, so a pathological plan cannot take
#: gigabytes.
MAX_WORKSPACE_BYTES = 1 << 30


@dataclass(frozen=True)
class ConvKey:
    """One convolution problem: its shape, batch, math and the epilogue after it. As a
    cuDNN graph's key, `epilogue` is what cuDNN fuses (None: the bare conv, our epilogue
    kernel follows); as an autotune key, what every candidate must compute."""

    batch: int
    cin: int
    cout: int
    kernel: int
    stride: int
    h_in: int
    w_in: int
    math: Math
    epilogue: str | None  # None: bare conv (epilogue by our kernel); else fused in cuDNN

    @classmethod
    def of(cls, spec: ConvSpec, batch: int, math: Math, epilogue: str | None) -> ConvKey:
        return cls(batch, spec.cin, spec.cout, spec.kernel, spec.stride, spec.h_in, spec.w_in, math, epilogue)

    def bare(self) -> ConvKey:
        """The same convolution without the epilogue (cuDNN's bare graph; our kernels'
        refusals are kept per bare key)."""
        return replace(self, epilogue=None)

    @property
    def h_out(self) -> int:
        return (self.h_in + 2 * (self.kernel // 2) - self.kernel) // self.stride + 1

    @property
    def w_out(self) -> int:
        return (self.w_in + 2 * (self.kernel // 2) - self.kernel) // self.stride + 1

    @property
    def output_elements(self) -> int:
        return self.batch * self.cout * self.h_out * self.w_out

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.h_out * self.w_out * self.cout * self.cin * self.kernel**2

    def label(self) -> str:
        fused = f" fused {self.epilogue}" if self.epilogue else ""
        return (
            f"b{self.batch} {self.cin}->{self.cout} {self.h_in}x{self.w_in} k{self.kernel} s{self.stride} "
            f"{self.math}{fused}"
        )


@dataclass
class ConvGraph:
    """A built cuDNN graph with its timed choice of execution plan."""

    key: ConvKey
    graph: object  # cudnn.pygraph
    tensors: dict[str, object]  # "X", "W", "Y" (+ "B", "Z" when fused, "A" fused in FP16) -> cudnn tensor
    plan_index: int
    plan_name: str
    workspace_bytes: int
    ms: float  # median time of the chosen plan
    plan_ms: list[float | None] = field(default_factory=list)  # every candidate (None: failed)
    build_s: float = 0.0  # host seconds spent building and timing this graph

    def pack(self, pointers: dict[str, int]) -> dict[object, int]:
        """The variant pack for fixed buffers, built once per convolution of a plan."""
        return {self.tensors[name]: pointer for name, pointer in pointers.items()}

    def execute(self, pack: dict[object, int], workspace_ptr: int, handle) -> None:
        """Enqueue the chosen plan on the handle's stream (graph-capturable)."""
        self.graph.execute_plan_at_index(pack, workspace_ptr, self.plan_index, handle=handle)


def _nhwc(graph, name: str, n: int, c: int, h: int, w: int, data_type):
    return graph.tensor(name=name, dim=[n, c, h, w], stride=[c * h * w, 1, w * c, c], data_type=data_type)


def excluded_notes(math: Math) -> list:
    """Numerical notes whose engines may not serve `math` (the maths table says which)."""
    return maths.of(math).cudnn_notes()


def instantiate(prototype: ConvGraph, handle) -> ConvGraph:
    """A private copy of a timed graph for one convolution of the trunk: the same key and
    execution plan (only that plan is built), its own cuDNN graph and plan objects.

    Why not share one graph between the convolutions of a shape: a captured CUDA graph
    replays the host-to-device copies cuDNN records per execute from host staging that
    belongs to the execution plan, so every capture of a shared plan would replay the last
    convolution's operands (seen on the H200: eager right, graph replay wrong). One plan
    object per convolution keeps each recorded copy's source its own."""
    started = time.perf_counter()
    graph, tensors = build_graph(prototype.key, handle)
    graph.build_plan_at_index(prototype.plan_index)
    try:
        name = str(graph.get_plan_name_at_index(prototype.plan_index))
    except Exception:  # names are a check here, not a requirement
        name = prototype.plan_name
    if name != prototype.plan_name:
        raise RuntimeError(
            f"{prototype.key.label()}: plan {prototype.plan_index} is {name!r} in a rebuilt graph, "
            f"{prototype.plan_name!r} when timed; heuristics are not deterministic here"
        )
    return ConvGraph(
        prototype.key, graph, tensors, prototype.plan_index, name, prototype.workspace_bytes, prototype.ms,
        prototype.plan_ms, time.perf_counter() - started,
    )  # fmt: skip


def graph_entry(graph: ConvGraph) -> dict:
    """What a start-up keeps of a timed graph (engine/build_cache.py): its chosen plan and
    the times it measured, enough for `from_entry` to build that plan alone next time."""
    return {
        "plan_index": graph.plan_index,
        "plan_name": graph.plan_name,
        "workspace_bytes": graph.workspace_bytes,
        "ms": graph.ms,
        "plan_ms": list(graph.plan_ms),
    }


def from_entry(key: ConvKey, entry: dict, handle) -> ConvGraph:
    """`key`'s graph with only the plan `entry` (graph_entry's) chose built, not timed again:
    the plan timed on an equal BuildKey. Raises when the rebuilt graph's plan at that index
    is not the one the entry names (another heuristic order), as instantiate does."""
    timed = ConvGraph(
        key, None, {}, int(entry["plan_index"]), str(entry["plan_name"]), int(entry["workspace_bytes"]),
        float(entry["ms"]), list(entry["plan_ms"]),
    )  # fmt: skip
    return instantiate(timed, handle)


def fp32_graph(handle, io=None):
    """An empty cuDNN graph with FP32 intermediates and compute (io FP32 unless `io` says),
    to be replayed from CUDA graphs (the frontend then only offers plans that can be)."""
    import cudnn

    fp32 = cudnn.data_type.FLOAT
    return cudnn.pygraph(
        io_data_type=fp32 if io is None else io,
        intermediate_data_type=fp32,
        compute_data_type=fp32,
        handle=handle,
        is_cuda_graph_replay_expected=True,
    )


def build_graph(key: ConvKey, handle):
    """cuDNN graph for `key` with its execution plans created and filtered (not built)."""
    import cudnn

    fp32, io = cudnn.data_type.FLOAT, maths.of(key.math).cudnn_io()
    graph = fp32_graph(handle, io)
    pad = key.kernel // 2
    x = _nhwc(graph, "X", key.batch, key.cin, key.h_in, key.w_in, io)
    w = _nhwc(graph, "W", key.cout, key.cin, key.kernel, key.kernel, io)
    y = graph.conv_fprop(
        image=x,
        weight=w,
        padding=[pad, pad],
        stride=[key.stride] * 2,
        dilation=[1, 1],
        compute_data_type=fp32,
    )
    tensors = {"X": x, "W": w}
    if key.epilogue is not None:
        assert key.epilogue in EPILOGUES, key.epilogue
        bias = graph.tensor(
            name="B", dim=[1, key.cout, 1, 1], stride=[key.cout, 1, key.cout, key.cout], data_type=fp32
        )
        y = graph.bias(input=y, bias=bias)
        tensors["B"] = bias
        if key.epilogue == "bias_add_relu":
            z = _nhwc(graph, "Z", key.batch, key.cout, key.h_out, key.w_out, io)
            y = graph.add(a=y, b=z)
            tensors["Z"] = z
        if key.epilogue != "bias_only":
            y = graph.relu(input=y)
    y.set_output(True).set_data_type(io)
    tensors["Y"] = y
    if key.epilogue is not None and maths.of(key.math).range_flag:
        # the range check of a fused graph: the largest |value| of its result. On the H200
        # (scripts/probe_fp16_fusion.py, every plan of every trunk shape) an output beyond
        # 65504 reads inf here, as Y holds it (cuDNN rounds to half without saturating), and
        # the reduction overwrites its output, so the slot needs no clearing before a run
        amax = graph.reduction(input=y, mode=cudnn.reduction_mode.AMAX, compute_data_type=fp32)
        amax.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(fp32)
        tensors["A"] = amax
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([getattr(cudnn.heur_mode, mode) for mode in HEURISTIC_MODES])
    graph.deselect_numeric_notes(excluded_notes(key.math))
    return graph, tensors


def _y_view(y_ptr: int, elements: int, math: Math):
    """A CuPy view of a convolution's output buffer (owned by the plan)."""
    import cupy

    table = maths.of(math)
    memory = cupy.cuda.UnownedMemory(y_ptr, elements * table.element_bytes, owner=None)
    return cupy.ndarray((elements,), dtype=table.io_dtype, memptr=cupy.cuda.MemoryPointer(memory, 0))


def _capture_one(graph, index: int, pack: dict, workspace, handle, stream, mode: int | None):
    """One execution of plan `index` captured into a CUDA graph (`mode`: a capture mode of
    cupy.cuda.runtime, None for CuPy's default, relaxed)."""
    if mode is None:
        stream.begin_capture()
    else:
        stream.begin_capture(mode=mode)
    try:
        graph.execute_plan_at_index(pack, workspace.data.ptr, index, handle=handle)
    finally:
        captured = stream.end_capture()
    return captured


def _replays_strictly(graph, index: int, pack: dict, workspace, handle, stream, y, eager) -> bool:
    """Whether plan `index` captures in global mode (any call that cannot be captured, e.g.
    work on the legacy stream, invalidates the capture) and two replays over a workspace
    filled with NaN bytes each write exactly `eager`: a plan relying on work done outside
    the graph fails here."""
    import cupy

    try:
        mode = cupy.cuda.runtime.streamCaptureModeGlobal
        captured = _capture_one(graph, index, pack, workspace, handle, stream, mode)
    except Exception as error:
        log.info("plan %d does not capture in global mode: %s", index, str(error)[:160])
        return False
    for _ in range(2):
        workspace.fill(255)
        if not replay_matches(captured, stream, y, eager):
            return False
    return True


def _time_candidate(
    graph, index: int, pack: dict, handle, stream, y, best: float | None
) -> tuple[float, bool]:
    """(median GPU ms, strict) of plan `index` replayed from a CUDA graph holding one
    execution; `strict` as _replays_strictly.

    Why replays: graphs are what serves, and at b1 a plan's eager execute costs more host
    time (~80 us) than GPU time (~15 us), so eager timing ranks host overhead, not plans.
    The replay must write exactly what the eager execution wrote, else the plan is no
    candidate (raises). Allocates a workspace and a copy: set-up only."""
    import cupy

    need = int(graph.get_workspace_size_plan_at_index(index))
    if need > MAX_WORKSPACE_BYTES:
        raise RuntimeError(f"needs {need} workspace bytes")
    workspace = cupy.empty((max(1, need),), dtype=cupy.uint8)
    with stream:
        graph.execute_plan_at_index(pack, workspace.data.ptr, index, handle=handle)
        eager = y.copy()
        stream.synchronize()
        strict = _replays_strictly(graph, index, pack, workspace, handle, stream, y, eager)
        replay = _capture_one(graph, index, pack, workspace, handle, stream, None)
        if not replay_matches(replay, stream, y, eager):
            raise RuntimeError("its captured replay differs from its eager execution")
        times = []
        for run in range(TIMED_RUNS):
            times.append(replay_ms(replay, stream))
            if run == 0 and best is not None and times[0] > HOPELESS * best:
                break
    return statistics.median(times), strict


def plan_limit(key: ConvKey) -> int:
    """Execution plans built and timed for `key` (see MAX_PLANS, MAX_RANGE_FUSED_PLANS)."""
    fused_with_range_check = key.epilogue is not None and maths.of(key.math).range_flag
    return MAX_RANGE_FUSED_PLANS if fused_with_range_check else MAX_PLANS


def time_plans(
    key: ConvKey,
    handle,
    stream,
    buffers: dict[str, int],
    banned: frozenset[int] = frozenset(),
    gpu_lock: AbstractContextManager | None = None,
) -> ConvGraph:
    """Build `key`'s graph, build and time each execution plan (see _time_candidate) on
    `buffers` (device pointers for X, W, Y [, B, Z]) and keep the fastest. Plans in
    `banned` (seen replaying wrongly inside a whole forward) are skipped. With `gpu_lock`,
    each plan is built without it and timed holding it (processes building plans side by
    side take turns on the GPU: tuning_pool.py)."""
    started = time.perf_counter()
    graph, tensors = build_graph(key, handle)
    pack = {tensors[name]: pointer for name, pointer in buffers.items()}
    y = _y_view(buffers["Y"], key.output_elements, key.math)
    results: list[float | None] = []
    failures: list[str] = []
    best: tuple[bool, float, int] | None = None  # (not strict, median ms, index) of the best so far
    tried = 0
    for index in range(graph.get_execution_plan_count()):
        if tried >= plan_limit(key):
            break
        try:
            if index in banned:
                raise RuntimeError("banned: replayed wrongly inside a captured forward")
            graph.build_plan_at_index(index)  # a deselected plan refuses here, uncounted
        except Exception as error:
            results.append(None)
            failures.append(f"[{index}] {type(error).__name__}: {str(error)[:160]}")
            continue
        tried += 1
        try:
            fastest = None if best is None else best[1]
            with gpu_lock or nullcontext():
                ms, strict = _time_candidate(graph, index, pack, handle, stream, y, fastest)
        except Exception as error:  # unsupported here, or replays wrongly: not a candidate
            results.append(None)
            failures.append(f"[{index}] {type(error).__name__}: {str(error)[:160]}")
            log.info("%s: plan %d is not a candidate: %s", key.label(), index, str(error)[:160])
            continue
        results.append(round(ms, 4))
        if best is None or (not strict, ms) < best[:2]:
            best = (not strict, ms, index)
    if best is None:
        deselected = sum("Deselecting" in failure for failure in failures)
        others = [failure for failure in failures if "Deselecting" not in failure][:MAX_PLANS]
        raise RuntimeError(
            f"cuDNN has no working execution plan for {key.label()}: {deselected} deselected by the "
            f"numerical notes of {key.math}; others: {'; '.join(others) or 'none'}"
        )
    loose, ms, index = best
    if loose:
        log.info("%s: no plan replays strictly; plan %d replays once as eager", key.label(), index)
    need = int(graph.get_workspace_size_plan_at_index(index))
    try:
        name = str(graph.get_plan_name_at_index(index))
    except Exception:  # a name is a report nicety; never fail a working plan over it
        name = f"plan{index}"
    return ConvGraph(key, graph, tensors, index, name, need, ms, results, time.perf_counter() - started)
