"""Choosing what runs each convolution: every candidate that can is timed, the fastest serves.

The candidates, in the order they are tried (a later one must be strictly faster to win):
- `CudnnBare`: cuDNN's fastest execution plan of the bare convolution (convs.time_plans)
  followed by our epilogue kernel (epilogue.py);
- `CudnnFused`: cuDNN's fused graph, conv + bias [+ residual] [+ ReLU], where the math
  allows one (maths.py: TF32, and FP16 with its range check, an AMAX reduction, in the graph);
- `OwnStem`: our direct stem kernel (stem.py), the stem only;
- `OwnIgemm`: our implicit-GEMM kernels (igemm.py), every channel tile (and in FP16 every
  pixel tile, and split-K factor for grids too small to fill the GPU) the shape allows;
- `OwnWgmma`: our FP16 3x3 stride-1 kernels on Hopper's warpgroup MMA (kernels/conv_wgmma.cu,
  compute capability 9.0 only), every tile.

A whole BasicBlock has one more candidate once both its convolutions are chosen
(`choose_block`, with --conv-kernels blocks): our kernel that runs conv1 and conv2 in one
pass with the hidden activation kept on chip (block.py), checked against the two choices'
output on the same buffers and kept only when faster than the two together.

Each answers `can_implement(key) -> (ok, reason)` before anything is built, so a refusal is
a record (`Refusal`) with its reason, kept for conv_report and build_report, never a silent
skip. Our kernels are also checked on the same buffers against cuDNN's bare conv + our
epilogue; one outside the math's agreement bound is a bug of ours, and its family of our
kernels is refused for that shape from then on (a refusal too; the other families stay).
The shape of this registry follows vLLM's mixed-precision linear kernels (`can_implement`
per kernel, reasons collected).

Set-up only: timing allocates (workspaces, copies); the forward path never does.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from speakerd.engine.gpu import block, igemm, maths, stem
from speakerd.engine.gpu.block import BlockKernel
from speakerd.engine.gpu.context import DeviceContext
from speakerd.engine.gpu.convs import ConvGraph, ConvKey, from_entry, graph_entry, instantiate, time_plans
from speakerd.engine.gpu.epilogue import Epilogue
from speakerd.engine.gpu.igemm import IgemmConv
from speakerd.engine.gpu.stem import StemConv
from speakerd.engine.gpu.timing import OwnKernel, fill_random, time_launches
from speakerd.model.architecture import BlockSpec, ConvSpec
from speakerd.model.numerics import Math
from speakerd.model.weights import FoldedConv

log = logging.getLogger(__name__)
#: One of our kernels (a convolution or a whole block), as the candidate loop sees it.
K = TypeVar("K", bound=OwnKernel)

#: Set-up only: a half conv's candidates are timed and checked on input values within this
#: magnitude; beyond it (a model whose activations leave FP16's range, whose every batch
#: then falls back) the input is refilled with random values, so that infinities and NaNs
#: from earlier convolutions do not decide which kernel runs.
HALF_TIMING_RANGE = 4096.0


@dataclass(frozen=True)
class Refusal:
    """A candidate that may not run a convolution, and why."""

    candidate: str  # e.g. "cudnn-fused", "ours:igemm"
    key: str  # the convolution and its epilogue, e.g. "b1 32->32 80x998 k3 s1 tf32 + bias_relu"
    reason: str

    def __str__(self) -> str:
        return f"{self.candidate} for {self.key}: {self.reason}"


@dataclass
class ConvRequest:
    """One convolution of a plan, bound to the plan's buffers: what every candidate must
    compute, y[:elements] = epilogue(conv(x) + bias (+ residual))."""

    name: str  # e.g. "layer2.0.conv1"
    folded: FoldedConv
    batch: int
    math: Math
    x: object
    y: object  # a view of the widest activation size; the conv writes `elements` of it
    epilogue: str
    residual: object | None = None
    flag: object | None = None  # the plan's range flag, in range-flag maths
    #: this conv's one-float slot of the plan's range maxima, in range-flag maths: a fused
    #: cuDNN graph writes the largest magnitude of its FP32 result there (plan.py)
    amax: object | None = None

    @property
    def spec(self) -> ConvSpec:
        return self.folded.spec

    @property
    def elements(self) -> int:
        spec = self.spec
        return self.batch * spec.cout * spec.h_out * spec.w_out

    @property
    def key(self) -> ConvKey:
        return ConvKey.of(self.spec, self.batch, self.math, self.epilogue)

    @property
    def label(self) -> str:
        """The convolution in its plan, e.g. "b32 fp16 layer2.0.conv1": a fallback plan's
        convolutions differ by their math."""
        return f"b{self.batch} {self.math} {self.name}"


@dataclass
class ConvChoice:
    """What runs one convolution: our kernel (`own`), or a cuDNN graph of its own, fused or
    followed by our `epilogue`; with what every candidate measured."""

    key: ConvKey  # the bare convolution
    graph: ConvGraph | None  # cuDNN's graph that runs it; with `own`: the bare one ours beat (None: none ran)
    pack: dict  # the variant pack: cuDNN tensor -> device pointer
    epilogue: Epilogue | None  # ours after a bare cuDNN conv; None when cuDNN fused it or ours runs it
    epilogue_ms: float
    bare_ms: float | None  # bare conv + our epilogue, as measured (what a fused graph had to beat)
    fused_ms: float | None = None  # cuDNN's fused graph, when it was a candidate and ran
    own: OwnKernel | None = None  # our kernel, when it won
    own_ms: float | None = None  # our fastest kernel as measured, when one was a candidate
    refusals: tuple[Refusal, ...] = ()

    @property
    def ms(self) -> float:
        if self.own is not None:
            return self.own.ms
        assert self.graph is not None, self.key.label()
        return self.graph.ms + self.epilogue_ms

    @property
    def workspace_bytes(self) -> int:
        """cuDNN workspace this conv needs as it runs (none when our kernel runs it)."""
        return 0 if self.own is not None or self.graph is None else self.graph.workspace_bytes

    @property
    def fused(self) -> bool:
        """Whether cuDNN's fused graph runs it (conv and epilogue in one cuDNN plan)."""
        return self.own is None and self.epilogue is None

    @property
    def runner(self) -> str:
        """What runs it, for reports and logs."""
        if self.own is not None:
            return f"ours:{self.own.name}"
        assert self.graph is not None, self.key.label()
        return f"cudnn:{self.graph.plan_name}" + ("" if self.epilogue else " fused")

    @property
    def identity(self) -> tuple:
        """What runs it, as a value shared by every conv running the same thing (a cuDNN plan
        of one graph key, or one entry point of ours on one shape: its name carries the
        channel tile and, in FP16, the pixel tile)."""
        if self.own is not None:
            return ("ours", self.key, self.own.name)
        assert self.graph is not None, self.key.label()
        return ("cudnn", self.graph.key, self.graph.plan_index)

    def enqueue(self, ctx: DeviceContext, workspace_ptr: int | None = None) -> None:
        """Enqueue on ctx.stream (allocation-free, graph-capturable); a cuDNN plan uses the
        shared workspace unless given one (`workspace_ptr`, set-up only)."""
        if self.own is not None:
            self.own.launch(ctx.stream)
            return
        assert self.graph is not None, self.key.label()
        workspace = ctx.workspace.ptr if workspace_ptr is None else workspace_ptr
        self.graph.execute(self.pack, workspace, ctx.cudnn)
        if self.epilogue is not None:
            self.epilogue.launch(ctx.kernels, ctx.stream)


@dataclass
class BlockChoice:
    """Our one-kernel BasicBlock (block.py) for a block whose two convolutions were chosen:
    `kernel` writes the block output only (what serves), `tap_kernel`, the same entry
    point, writes the hidden activation too (taps). `pair_ms`: the two convolutions'
    choices as timed, what the kernel had to beat."""

    block: BlockSpec
    kernel: BlockKernel
    tap_kernel: BlockKernel
    pair_ms: float

    @property
    def ms(self) -> float:
        return self.kernel.ms

    @property
    def wins(self) -> bool:
        return self.kernel.ms < self.pair_ms

    @property
    def runner(self) -> str:
        return f"ours:{self.kernel.name}"

    def enqueue(self, ctx: DeviceContext, taps: bool = False) -> None:
        """Enqueue on ctx.stream (allocation-free, graph-capturable)."""
        (self.tap_kernel if taps else self.kernel).launch(ctx.stream)


class Candidate(abc.ABC):
    """One way of running a convolution; `can_implement` decides before anything is built."""

    name: str

    def __init__(self, tuner: Autotuner) -> None:
        self.tuner = tuner

    @abc.abstractmethod
    def can_implement(self, key: ConvKey) -> tuple[bool, str]:
        """(True, "") when this candidate may run `key` (its epilogue included), else
        (False, why)."""


def _half_stem(key: ConvKey) -> bool:
    """The stem of a half-io math: its input is the FP32 fbank, its output half."""
    return maths.of(key.math).half_io and stem.applies(key, key.epilogue)


class CudnnBare(Candidate):
    name = "cudnn"

    def can_implement(self, key: ConvKey) -> tuple[bool, str]:
        if _half_stem(key):
            return False, "cuDNN's half convolution needs a half input; the stem's is the FP32 fbank"
        return True, ""


class CudnnFused(Candidate):
    name = "cudnn-fused"

    def can_implement(self, key: ConvKey) -> tuple[bool, str]:
        table = maths.of(key.math)
        if not table.cudnn_fusion:
            return False, table.no_fusion_reason
        if key in self.tuner.failed:
            return False, self.tuner.failed[key]
        return True, ""


class OwnFamily(Candidate):
    """Our kernels: allowed unless turned off (--conv-kernels cudnn) or this family was
    refused for the shape."""

    #: our kernels take float32 weights even in a half-io math (the stem) or the io dtype
    io_weights = True

    def can_implement(self, key: ConvKey) -> tuple[bool, str]:
        if not self.tuner.own_kernels:
            return False, "--conv-kernels cudnn"
        refused = self.tuner.own_refused.get((self.name, key.bare()))
        if refused is not None:
            return False, f"turned off: {refused}"
        return self.fits(key)

    @abc.abstractmethod
    def fits(self, key: ConvKey) -> tuple[bool, str]:
        """Whether a kernel of this family exists for the shape and epilogue."""

    @abc.abstractmethod
    def bind(self, request: ConvRequest, weight, bias) -> list[OwnKernel]:
        """This family's kernels for `request`, bound to its buffers."""


class OwnStem(OwnFamily):
    """The stem kernel computes in FP32 in every math (FP32 weights, FP32 input)."""

    name = StemConv.family
    io_weights = False

    def fits(self, key: ConvKey) -> tuple[bool, str]:
        if not stem.applies(key, key.epilogue):
            return False, f"runs only the stem ({stem.EPILOGUE}); this is not it"
        return True, ""

    def bind(self, request: ConvRequest, weight, bias) -> list[OwnKernel]:
        return [StemConv.bind(request.batch, request.math, request.x, weight, bias, request.y, request.flag)]


class OwnIgemm(OwnFamily):
    name = igemm.IGEMM_FAMILY

    def fits(self, key: ConvKey) -> tuple[bool, str]:
        why = igemm.why_not(key, key.math)
        return (not why, why)

    def bind(self, request: ConvRequest, weight, bias) -> list[OwnKernel]:
        """One kernel per channel tile, (FP16) pixel tile and split-K factor: which is fastest
        depends on the shape and batch (grid size against the SMs, halo loads), so each is
        timed."""
        ctx = self.tuner.ctx
        variants = igemm.candidates_for(request.spec, request.math, request.batch, ctx.sm_count)
        return _bound(request, weight, bias, variants, ctx.split_scratch)


class OwnWgmma(OwnFamily):
    name = igemm.WGMMA_FAMILY

    def fits(self, key: ConvKey) -> tuple[bool, str]:
        why = igemm.wgmma_why_not(key, key.math, self.tuner.ctx.compute_capability)
        return (not why, why)

    def bind(self, request: ConvRequest, weight, bias) -> list[OwnKernel]:
        """One kernel per channel and pixel tile, each timed."""
        ctx = self.tuner.ctx
        variants = igemm.wgmma_candidates_for(request.spec, request.math, ctx.compute_capability)
        return _bound(request, weight, bias, variants, sm_count=ctx.sm_count)


def _bound(request: ConvRequest, weight, bias, variants, scratch=None, sm_count=None) -> list[OwnKernel]:
    """IgemmConv `variants` bound to `request`'s buffers."""
    r = request
    return [
        IgemmConv.of(v, r.spec, r.batch, r.math, r.epilogue, r.x, weight, bias, r.residual, r.y, r.flag,
                     scratch, sm_count)
        for v in variants
    ]  # fmt: skip


class Autotuner:
    """Chooses every convolution of an engine's plans and remembers what it learned: one
    timed cuDNN graph per key (shared by plans), fusions cuDNN cannot build or that replayed
    wrongly, banned plans, shapes our kernels may not run, and every refusal."""

    def __init__(
        self,
        ctx: DeviceContext,
        own_kernels: bool = True,
        fused_blocks: bool = False,
        cached_graphs: Mapping[str, dict] | None = None,
        cached_choices: Mapping[str, dict] | None = None,
    ) -> None:
        self.ctx = ctx
        #: cuDNN graphs a start-up under an equal BuildKey timed (key label -> convs.graph_entry,
        #: or {"unsupported": why} for a fused graph cuDNN could not serve): their chosen plan
        #: is built alone, nothing timed (engine/build_cache.py)
        self.cached_graphs = dict(cached_graphs or {})
        #: what ran each convolution of that start (request label -> choice_entry): the same
        #: runs it again, nothing built or timed beside it (`_from_cache`)
        self.cached_choices = dict(cached_choices or {})
        #: the same of this build, what the next start may use: every graph known (a cached
        #: one stays known until banned or timed again) and every convolution's choice
        self.graph_entries: dict[str, dict] = dict(self.cached_graphs)
        self.choice_entries: dict[str, dict] = {}
        self.from_cache = 0  # convolutions this build ran on a cached choice
        self.own_kernels = own_kernels  # False: cuDNN runs every convolution (--conv-kernels cudnn)
        self.fused_blocks = fused_blocks  # True: one-kernel blocks where faster (--conv-kernels blocks)
        self.block_refused: dict[ConvKey, str] = {}  # conv1 keys (bare) our block kernel may not run
        self.graphs: dict[ConvKey, ConvGraph] = {}
        self.failed: dict[ConvKey, str] = {}  # fused keys cuDNN cannot serve, or turned off
        self.banned: dict[ConvKey, set[int]] = {}  # plans that replayed wrongly in a forward
        self.own_refused: dict[tuple[str, ConvKey], str] = {}  # (family, bare key) refused, and why
        self.instances: list[ConvGraph] = []
        self._refusals: dict[tuple[str, str, str], Refusal] = {}
        self.bare, self.fusion = CudnnBare(self), CudnnFused(self)
        self.own: tuple[OwnFamily, ...] = (OwnStem(self), OwnIgemm(self), OwnWgmma(self))
        self.candidates: tuple[Candidate, ...] = (self.bare, self.fusion, *self.own)

    # ----- choosing ---------------------------------------------------------------------
    def choose(self, request: ConvRequest) -> ConvChoice:
        """What runs `request`: what ran it at a start under an equal BuildKey when that is
        cached and may still run it, else the fastest of every candidate that can, timed
        (module docstring). Either way kept in `choice_entries` for the next start."""
        entry = self.cached_choices.get(request.label)
        choice = self._from_cache(request, entry) if entry is not None else None
        if choice is None:
            choice = self._timed_choice(request)
        else:
            self.from_cache += 1
        self.choice_entries[request.label] = choice_entry(choice)
        return choice

    def _timed_choice(self, request: ConvRequest) -> ConvChoice:
        """Time every candidate that can run `request` and keep the fastest."""
        key, table = request.key, maths.of(request.math)
        refusals: list[Refusal] = []
        able: list[Candidate] = []
        for candidate in self.candidates:
            ok, why = candidate.can_implement(key)
            if ok:
                able.append(candidate)
            else:
                refusals.append(Refusal(candidate.name, _label(key), why))
        own = [family for family in self.own if family in able]
        if self.bare not in able and not own:
            raise RuntimeError(
                f"b{request.batch} {request.math} {request.name}: nothing can run {key.label()}: "
                + "; ".join(f"{r.candidate}: {r.reason}" for r in refusals)
            )
        if request.x.dtype.itemsize == 2:
            self._within_timing_range(request.x, request.batch * request.spec.cin * request.spec.h_in
                                      * request.spec.w_in)  # fmt: skip
            if request.residual is not None:
                self._within_timing_range(request.residual, request.elements)
        best: ConvChoice | None = None
        buffers: dict[str, int] = {}
        fused, fused_buffers = None, {}  # fused_buffers: X, W, Y, B [, Z]
        if self.bare in able:
            weight, bias = self.ctx.weights.conv(request.folded, half=table.half_io)
            buffers = _cudnn_buffers(request, weight, bias, fused=False)
            bare = self.conv_graph(key.bare(), buffers)
            assert bare is not None, key.label()
            epilogue = self._epilogue(request, bias)
            epilogue_ms = self._time_epilogue(epilogue)
            best = ConvChoice(
                key.bare(), bare, bare.pack(buffers), epilogue, epilogue_ms, bare.ms + epilogue_ms
            )
            fused_buffers = _cudnn_buffers(request, weight, bias, fused=True)
        if self.fusion in able and best is not None:
            fused = self.conv_graph(key, fused_buffers, required=False)
            if fused is None:
                refusals.append(Refusal(self.fusion.name, _label(key), self.failed[key]))
            elif best is not None:
                best.fused_ms = fused.ms
        ours = None
        if own:
            families: list[list[OwnKernel]] = []
            for family in own:
                weight, bias = self.ctx.weights.conv(request.folded, half=table.half_io and family.io_weights)
                families.append(family.bind(request, weight, bias))
            ours, refused = self._fastest_own(request, families, best)
            refusals += refused
        for refusal in refusals:
            self._remember(refusal)
        return self._pick(request, best, buffers, fused, fused_buffers, ours, tuple(refusals))

    def _from_cache(self, request: ConvRequest, entry: dict) -> ConvChoice | None:
        """`request`'s choice rebuilt from a cached start's `entry` (choice_entry's): our kernel
        of that name bound to the request's buffers, or cuDNN's plan of that graph built alone
        as the convolution's own graph, nothing timed. None, with one line why, when it may
        not run it now (refused or banned here since, or the candidate cannot be rebuilt):
        the request is then timed as on a first start."""
        key = request.key
        try:
            if entry["runs"] == "ours":
                return self._cached_own(request, entry)
            return self._cached_cudnn(request, entry)
        except Exception as error:  # a cache of another layout or a plan that does not rebuild
            why = f"{type(error).__name__}: {str(error)[:200]}"
        log.info("build cache: %s (%s): the cached choice does not run it (%s); timing its candidates",
                 request.label, key.label(), why)  # fmt: skip
        return None

    def _cached_own(self, request: ConvRequest, entry: dict) -> ConvChoice:
        key, table = request.key, maths.of(request.math)
        family = next((f for f in self.own if f.name == entry["family"]), None)
        if family is None:
            raise LookupError(f"no kernel family {entry['family']!r}")
        ok, why = family.can_implement(key)
        if not ok:
            raise LookupError(why)
        weight, bias = self.ctx.weights.conv(request.folded, half=table.half_io and family.io_weights)
        kernel = next((k for k in family.bind(request, weight, bias) if k.name == entry["kernel"]), None)
        if kernel is None:
            raise LookupError(f"no kernel {entry['kernel']!r} in {family.name} for this shape")
        kernel.ms = float(entry["ms"])
        return ConvChoice(key.bare(), None, {}, None, 0.0, _float(entry.get("bare_ms")),
                          fused_ms=_float(entry.get("fused_ms")), own=kernel, own_ms=kernel.ms)  # fmt: skip

    def _cached_cudnn(self, request: ConvRequest, entry: dict) -> ConvChoice:
        key, table = request.key, maths.of(request.math)
        graph_key = key if entry["fused"] else key.bare()
        ok, why = (self.fusion if entry["fused"] else self.bare).can_implement(key)
        if not ok:
            raise LookupError(why)
        graph_entry = self.cached_graphs[graph_key.label()]
        if graph_entry.get("plan_index") in self.banned.get(graph_key, ()):
            raise LookupError(f"plan {graph_entry['plan_index']} was banned")
        weight, bias = self.ctx.weights.conv(request.folded, half=table.half_io)
        buffers = _cudnn_buffers(request, weight, bias, fused=entry["fused"])
        epilogue = None if entry["fused"] else self._epilogue(request, bias)
        graph = from_entry(graph_key, graph_entry, self.ctx.cudnn)  # the convolution's own (see instance)
        self.instances.append(graph)
        return ConvChoice(key.bare(), graph, graph.pack(buffers), epilogue, float(entry["epilogue_ms"]),
                          _float(entry.get("bare_ms")), fused_ms=_float(entry.get("fused_ms")),
                          own_ms=_float(entry.get("own_ms")))  # fmt: skip

    def _pick(
        self, request: ConvRequest, best: ConvChoice | None, buffers: dict[str, int], fused: ConvGraph | None,
        fused_buffers: dict[str, int], ours: OwnKernel | None, refusals: tuple[Refusal, ...],
    ) -> ConvChoice:  # fmt: skip
        """Ours when strictly faster than cuDNN's best, else the fused graph when strictly
        faster than bare + our epilogue, else bare + our epilogue."""
        if best is None:  # nothing of cuDNN's could run it: ours, checked by the GPU tests
            assert ours is not None, request.name
            return ConvChoice(request.key.bare(), None, {}, None, 0.0, None, own=ours, own_ms=ours.ms,
                              refusals=refusals)  # fmt: skip
        best.refusals = refusals
        assert best.bare_ms is not None, request.name
        cudnn_ms = min(best.bare_ms, fused.ms if fused is not None else best.bare_ms)
        if ours is not None:
            best.own_ms = ours.ms
            log.info("b%d %s %s: ours %s %.4f ms, cuDNN %.4f ms", request.batch, request.math, request.name,
                     ours.name, ours.ms, cudnn_ms)  # fmt: skip
            if ours.ms < cudnn_ms:
                return dataclasses.replace(best, own=ours, epilogue=None, epilogue_ms=0.0, pack={})
        if fused is not None and fused.ms < best.bare_ms:
            instance = self.instance(fused)
            return dataclasses.replace(
                best, graph=instance, epilogue=None, epilogue_ms=0.0, pack=instance.pack(fused_buffers)
            )
        assert best.graph is not None, request.name
        instance = self.instance(best.graph)
        return dataclasses.replace(best, graph=instance, pack=instance.pack(buffers))

    def _fastest_own(
        self, request: ConvRequest, families: list[list[OwnKernel]], bare: ConvChoice | None
    ) -> tuple[OwnKernel | None, list[Refusal]]:
        """(our fastest kernel of the families' kernels, refusals): a family one of whose
        kernels disagrees with cuDNN's bare conv + our epilogue on the same buffers by more
        than the math's agreement bound is turned off for the shape (with a warning: that is
        a bug of ours) and gives a refusal; the other families' kernels still compete. With
        no cuDNN to compare with (the half stem) ours are timed unchecked here; the GPU
        tests check them against float64, and the start-up self-check the whole network."""
        if not any(families):
            return None, []
        y = request.y[: request.elements]
        reference = None
        if bare is not None:
            assert bare.graph is not None and bare.epilogue is not None, request.name
            reference = self._output_of([bare], y)
        bound = maths.of(request.math).agreement
        fastest: OwnKernel | None = None
        refusals: list[Refusal] = []
        for kernels in filter(None, families):
            best, failed = self._checked_fastest(kernels, y, reference, bound, "cuDNN")
            if failed is not None:
                kernel, reason = failed
                self.refuse_own(request.key.bare(), reason, kernel.family)
                refusals.append(Refusal(f"ours:{kernel.name}", _label(request.key), reason))
            elif best is not None and (fastest is None or best.ms < fastest.ms):
                fastest = best
        return fastest, refusals

    def _checked_fastest(
        self, kernels: list[K], y, reference, bound: float, against: str
    ) -> tuple[K | None, tuple[K, str] | None]:
        """(the fastest of `kernels`, None) after each wrote `y` within `bound` of
        `reference` (relative to its scale; None: unchecked) and was timed; or (None,
        (the first that did not, why)). Set-up only."""
        stream, fastest = self.ctx.stream, None
        for kernel in kernels:
            if reference is not None:
                with stream:
                    y.fill(float("nan"))
                    kernel.launch(stream)
                    difference = igemm.relative_difference(y, reference)
                if not difference <= bound:
                    reason = (f"{kernel.name} differs from {against} by {difference:.3g} of the output scale "
                              f"(bound {bound:g})")  # fmt: skip
                    return None, (kernel, reason)
            kernel.time(stream)
            if fastest is None or kernel.ms < fastest.ms:
                fastest = kernel
        return fastest, None

    def _output_of(self, choices: list[ConvChoice], y):
        """A copy of `y` after `choices` ran in order, each cuDNN plan with a workspace of its
        own (set-up runs this before the shared workspace has grown to the plans' needs)."""
        import cupy

        with self.ctx.stream:
            for choice in choices:
                workspace = cupy.empty((max(1, choice.workspace_bytes),), dtype=cupy.uint8)
                choice.enqueue(self.ctx, workspace.data.ptr)
            return y.copy()

    # ----- whole blocks ------------------------------------------------------------------
    def why_no_block(self, spec: BlockSpec, first: ConvRequest, second: ConvRequest) -> str:
        """Why our one-kernel block may not run this block ("" when it may)."""
        if not self.own_kernels:
            return "--conv-kernels cudnn"
        why = block.why_not(spec, first.math)
        if why:
            return why
        if second.residual is not first.x:
            return "conv2's residual is not the block input"
        return self.block_refused.get(first.key.bare(), "")

    def choose_block(
        self, spec: BlockSpec, first: ConvRequest, first_choice: ConvChoice, second: ConvRequest,
        second_choice: ConvChoice,
    ) -> BlockChoice | None:  # fmt: skip
        """Our one-kernel block for `spec`, timed (every entry point, the fastest kept) after
        its output was checked against what the two convolutions' choices write on the same
        buffers; None when it may not run (a refusal is kept, with why) or disagrees beyond
        the math's agreement bound (then it is turned off for the shape: a bug of ours).
        The caller runs it only when it `wins`."""
        key = first.key.bare()
        if not self.fused_blocks:  # not asked for: no candidate, no refusal to report
            return None
        why = self.why_no_block(spec, first, second)
        if why:
            self._remember(Refusal(BlockKernel.family, _label(first.key), why))
            return None
        w1, b1 = self.ctx.weights.conv(first.folded, half=True)
        w2, b2 = self.ctx.weights.conv(second.folded, half=True)
        y = second.y[: second.elements]
        reference = self._output_of([first_choice, second_choice], y)

        def bind(variant: tuple[int, int, int], hidden=None) -> BlockKernel:
            return BlockKernel.bind(spec, first.batch, variant, first.x, w1, b1, w2, b2, second.y, first.flag,
                                    self.ctx.sm_count, hidden)  # fmt: skip

        bound = maths.of(first.math).agreement
        kernels = [bind(variant) for variant in block.VARIANTS]
        fastest, failed = self._checked_fastest(kernels, y, reference, bound, "the two convolutions")
        if failed is not None:
            self.refuse_block(key, failed[1])
            return None
        assert fastest is not None, spec.prefix
        pair_ms = first_choice.ms + second_choice.ms
        choice = BlockChoice(spec, fastest, bind(fastest.variant, first.y), pair_ms)
        log.info("b%d %s %s: ours %s %.4f ms, its two convolutions %.4f ms", first.batch, first.math,
                 spec.prefix, fastest.name, fastest.ms, choice.pair_ms)  # fmt: skip
        return choice

    def refuse_block(self, key: ConvKey, reason: str) -> None:
        """Never run our block kernel for blocks whose conv1 is `key` (bare) again."""
        self.block_refused[key] = reason
        log.warning("%s: our block kernel turned off: %s", key.label(), reason)

    def _remember(self, refusal: Refusal) -> None:
        """Keep `refusal` for the reports, once per (candidate, key, reason)."""
        self._refusals.setdefault((refusal.candidate, refusal.key, refusal.reason), refusal)

    def _epilogue(self, request: ConvRequest, bias) -> Epilogue:
        """Our epilogue kernel after a bare cuDNN convolution of `request`."""
        return Epilogue.bind(
            request.epilogue, request.y, bias, request.residual, request.spec.cout, request.elements,
            request.flag if request.y.dtype.itemsize == 2 else None, self.ctx.sm_count,
        )  # fmt: skip

    def _time_epilogue(self, epilogue: Epilogue) -> float:
        """GPU ms of our epilogue kernel on its buffers, from graph replays as it serves
        (timed eagerly, a b1 epilogue of ~3 us measured its ~10 us launch)."""
        stream = self.ctx.stream
        with stream:
            return time_launches(lambda s: epilogue.launch(self.ctx.kernels, s), stream)

    def _within_timing_range(self, values, count: int) -> None:
        """Refill values[:count] with random halves when any is beyond HALF_TIMING_RANGE or
        not finite (set-up only, see HALF_TIMING_RANGE)."""
        import cupy

        view = values[:count]
        with self.ctx.stream:
            largest = float(cupy.abs(view.astype(cupy.float32)).max().get())
            if not largest <= HALF_TIMING_RANGE:
                fill_random(view, cupy.random.RandomState(count))

    # ----- cuDNN graphs -----------------------------------------------------------------
    def conv_graph(self, key: ConvKey, buffers: dict[str, int], required: bool = True) -> ConvGraph | None:
        """The cuDNN graph for `key`, built and its plans timed on first request (again after
        a ban). A graph cuDNN cannot serve raises when `required`, else gives None (a fused
        candidate; the reason is kept in `failed`)."""
        label = key.label()
        if not required and key not in self.failed and "unsupported" in self.cached_graphs.get(label, {}):
            self.failed[key] = self.cached_graphs[label]["unsupported"]
            self.graph_entries[label] = {"unsupported": self.failed[key]}
        if key in self.failed and not required:
            return None
        if key not in self.graphs:
            try:
                banned = frozenset(self.banned.get(key, ()))
                graph = self._cached_graph(key, banned)
                if graph is None:
                    graph = time_plans(key, self.ctx.cudnn, self.ctx.stream, buffers, banned)
                self.graphs[key] = graph
                self.graph_entries[label] = graph_entry(graph)
            except Exception as error:
                if required:
                    raise
                self.failed[key] = f"{type(error).__name__}: {error}"
                self.graph_entries[label] = {"unsupported": self.failed[key]}
                log.info("no fused cuDNN graph for %s: %s", label, str(error)[:300])
                return None
        return self.graphs[key]

    def _cached_graph(self, key: ConvKey, banned: frozenset[int]) -> ConvGraph | None:
        """`key`'s graph with the plan a cached start-up chose, built alone; None when none
        is cached for it, its plan was banned here, or it does not rebuild (one line why:
        the plans are timed again)."""
        entry = self.cached_graphs.get(key.label())
        if entry is None or "plan_index" not in entry or entry["plan_index"] in banned:
            return None
        try:
            return from_entry(key, entry, self.ctx.cudnn)
        except Exception as error:
            log.info("build cache: %s: the cached plan %s did not rebuild (%s); timing its plans",
                     key.label(), entry.get("plan_name"), str(error)[:200])  # fmt: skip
            return None

    def instance(self, prototype: ConvGraph) -> ConvGraph:
        """A graph of its own for one convolution, with the plan timed on `prototype`
        (see convs.instantiate for why convolutions never share one)."""
        own = instantiate(prototype, self.ctx.cudnn)
        self.instances.append(own)
        return own

    # ----- what a captured forward taught ------------------------------------------------
    def reject(self, choice: ConvChoice, reason: str) -> None:
        """Never run what runs `choice` again for its key: our kernel is turned off for the
        shape, a cuDNN plan is banned (see ban)."""
        if choice.own is not None:
            self.refuse_own(choice.key, reason, choice.own.family)
        else:
            assert choice.graph is not None, choice.key.label()
            self.ban(choice.graph.key, choice.graph.plan_index)

    def ban(self, key: ConvKey, plan_index: int) -> None:
        """Never use plan `plan_index` for `key` again (it replayed wrongly inside a captured
        forward). A fused key loses fusion altogether: its convolutions run bare with our
        epilogue, which is how every strict-FP32 graph runs. Why not try the next fused plan:
        on the H200 the TF32 b1 layer3.0.shortcut had seven fused plans, all variants of one
        engine (eng51), and every one of them replayed wrongly inside the forward. A bare
        key times its remaining plans at the next conv_graph(key)."""
        if key.epilogue is not None:
            self.failed[key] = f"fused plan {plan_index} replayed wrongly inside a captured forward"
            log.warning("%s: fusion off (%s)", key.label(), self.failed[key])
        self.banned.setdefault(key, set()).add(plan_index)
        self.graphs.pop(key, None)
        # what the next start keeps of it is what this build settles on after the ban
        if key.epilogue is not None:
            self.graph_entries[key.label()] = {"unsupported": self.failed[key]}
        else:
            self.graph_entries.pop(key.label(), None)

    def refuse_own(self, key: ConvKey, reason: str, family: str) -> None:
        """Never run our kernels of `family` (a candidate's name) for `key` (bare) again (one
        disagreed with cuDNN or replayed wrongly)."""
        self.own_refused[(family, key)] = reason
        log.warning("%s: our %s kernels turned off: %s", key.label(), family, reason)

    # ----- reports ----------------------------------------------------------------------
    def refusals(self) -> list[Refusal]:
        """Every distinct refusal so far, in the order first met."""
        return list(self._refusals.values())

    def report(self) -> dict:
        return {
            "cudnn_graphs": len(self.graphs),
            "cudnn_build_s": round(sum(g.build_s for g in self.graphs.values()), 2),
            "conv_instances": len(self.instances),
            "conv_choices_cached": self.from_cache,
            "instance_build_s": round(sum(g.build_s for g in self.instances), 2),
            "fusions_unsupported": sorted(key.label() for key in self.failed),  # or turned off
            "own_kernel_refused": {f"{n} {key.label()}": why for (n, key), why in self.own_refused.items()},
            "block_kernel_refused": {key.label(): why for key, why in self.block_refused.items()},
            "refusals": summarize(self.refusals()),
        }

    def close(self) -> None:
        self.graphs.clear()
        self.instances.clear()


def _label(key: ConvKey) -> str:
    """`key` for a refusal: the bare convolution and the epilogue every candidate must add."""
    return f"{key.bare().label()} + {key.epilogue}"


def summarize(refusals: list[Refusal]) -> dict[str, int]:
    """ "candidate: reason" -> how many convolution keys it refused, in the order first met:
    build_report's view (conv_report lists each convolution's own refusals)."""
    counts: dict[str, int] = {}
    for refusal in refusals:
        line = f"{refusal.candidate}: {refusal.reason}"
        counts[line] = counts.get(line, 0) + 1
    return counts


def graph_keys(
    convs: Sequence[tuple[ConvSpec, str]], sizes: Sequence[int], plan_maths: Sequence[Math]
) -> list[ConvKey]:
    """The cuDNN graphs a first start times for plans of `sizes` in each of `plan_maths`
    (`convs`: each convolution's spec and epilogue, plan.trunk_convs): what `choose` asks
    `conv_graph` for before anything was refused, each convolution's bare graph where cuDNN
    may run it (CudnnBare) and its fused one where the math fuses (CudnnFused); tuning_pool.py
    times them before the plans exist."""
    keys: dict[ConvKey, None] = {}
    for math in plan_maths:
        for batch in sizes:
            for spec, epilogue in convs:
                key = ConvKey.of(spec, batch, math, epilogue)
                if _half_stem(key):
                    continue
                keys[key.bare()] = None
                if maths.of(math).cudnn_fusion:
                    keys[key] = None
    return list(keys)


def _cudnn_buffers(request: ConvRequest, weight, bias, fused: bool) -> dict[str, int]:
    """The device pointers a cuDNN graph of `request` binds: X, W, Y, and for a fused graph
    its bias B, residual Z and, in range-flag maths, the range maximum's slot A."""
    buffers = {"X": request.x.data.ptr, "W": weight.data.ptr, "Y": request.y.data.ptr}
    if fused:
        buffers["B"] = bias.data.ptr
        if request.residual is not None:
            buffers["Z"] = request.residual.data.ptr
        if maths.of(request.math).range_flag:
            assert request.amax is not None, f"{request.name}: no range-maximum slot for a fused graph"
            buffers["A"] = request.amax.data.ptr
    return buffers


def choice_entry(choice: ConvChoice) -> dict:
    """What a start-up keeps of one convolution's choice (engine/build_cache.py): enough for
    Autotuner._from_cache to run the same again, with the times it was chosen on."""
    times = {"bare_ms": choice.bare_ms, "fused_ms": choice.fused_ms, "own_ms": choice.own_ms}
    if choice.own is not None:
        return {"runs": "ours", "family": choice.own.family, "kernel": choice.own.name, "ms": choice.own.ms,
                **times}  # fmt: skip
    assert choice.graph is not None, choice.key.label()
    return {"runs": "cudnn", "fused": choice.fused, "graph": choice.graph.key.label(),
            "epilogue_ms": choice.epilogue_ms, **times}  # fmt: skip


def _float(value) -> float | None:
    return None if value is None else float(value)
