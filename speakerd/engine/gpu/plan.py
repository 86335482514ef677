"""One preallocated forward pass of the network for a fixed batch size, as typed steps.

A Plan owns (or views) every device buffer its forward touches, so the forward path
allocates nothing and can be captured once into a CUDA graph and replayed (capture.py):

- fbank input [b, 998, 80], the stem's NHWC input [b, 80, 998, 1], masks [b, 3, F<=10000]
  and the mask frame count F as a device int32 (read by the pooling kernel, so one graph
  serves any F);
- four activation buffers (block input, hidden, shortcut, block output) that ping-pong
  through the trunk, in the math's io dtype (float32, or float16 in FP16 mode). They are
  views of an arena the engine shares between its plans: plans never run at once (the
  engine serialises them on one stream under a lock);
- in a range-flag math (FP16) a device int32 range flag, cleared at the start of the
  forward and raised by any kernel that produced a value outside FP16's range; read back
  with the outputs. A convolution that a fused cuDNN graph runs cannot raise it itself: the
  graph writes the largest magnitude of its FP32 result into the convolution's slot of
  `amax` (one float per convolution), and the pooling kernel, which runs after the whole
  trunk, raises the flag for any slot beyond FP16's range;
- pooled [3b, 5120], output [3b, 256], active frames [3b];
- pinned host buffers for the outputs (asynchronous copies). Inputs arrive through the
  engine's staging slots (staging.py), copied in while the previous batch computes.

The forward is a list of steps, each a dataclass bound to its buffers at build time that
enqueues its work on the context's stream: ClearFlagStep, TransposeStep, ConvStep (what
the autotuner chose), TapStep (a named activation handed to a hook: taps, profiling),
PoolStep, LinearStep and EpilogueStep (the linear's bias), and BlockStep where one kernel of
ours runs a whole BasicBlock (--conv-kernels blocks, when faster than its two ConvSteps). A
Plan reads the device only through its DeviceContext (context.py) and asks the Autotuner
(autotune.py) what runs each convolution; it never sees the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from speakerd.engine.gpu import held, maths
from speakerd.engine.gpu.autotune import Autotuner, BlockChoice, ConvChoice, ConvRequest
from speakerd.engine.gpu.context import DeviceContext
from speakerd.engine.gpu.epilogue import Epilogue
from speakerd.engine.gpu.staging import InputSlot, pinned
from speakerd.model.architecture import (
    BLOCKS,
    EMBEDDING_DIM,
    FRAMES,
    MAX_SPEAKERS,
    MEL_BINS,
    STATS_DIM,
    STEM,
    TRUNK_CHANNELS,
    TRUNK_MELS,
    ConvSpec,
    tap_shape,
)
from speakerd.model.inputs import MAX_MASK_FRAMES
from speakerd.model.numerics import Math
from speakerd.model.weights import FoldedConv, FoldedModel

#: fbank_to_stem tile (kernels/speakerd.cu TILE) and its block shape.
TRANSPOSE_TILE = 32
TRANSPOSE_ROWS = 8
#: Convolutions of the trunk: the stem, two per block and the blocks' shortcuts.
CONVOLUTIONS = 1 + sum(2 + (block.shortcut is not None) for block in BLOCKS)
#: (tap name, device view, tap shape) -> None, called after each tap is computed.
TapHook = Callable[[str, object, tuple[int, ...]], None]
#: What follows each convolution of the trunk (epilogue.py): ReLU after the stem and a
#: block's first convolution, the bias alone on a shortcut, the residual and ReLU after a
#: block's second.
STEM_EPILOGUE, CONV1_EPILOGUE, SHORTCUT_EPILOGUE, CONV2_EPILOGUE = (
    "bias_relu",
    "bias_relu",
    "bias_only",
    "bias_add_relu",
)


def trunk_convs() -> list[tuple[ConvSpec, str]]:
    """Every convolution of a plan's trunk with its epilogue, in the order a plan chooses
    them (Plan._build): what a fresh start can time before the plans exist (tuning_pool.py)."""
    convs = [(STEM, STEM_EPILOGUE)]
    for block in BLOCKS:
        convs.append((block.conv1, CONV1_EPILOGUE))
        if block.shortcut is not None:
            convs.append((block.shortcut, SHORTCUT_EPILOGUE))
        convs.append((block.conv2, CONV2_EPILOGUE))
    return convs


def activation_elements(batch: int) -> dict[str, int]:
    """Float32 elements of each activation buffer for `batch` chunks (the trunk's largest;
    an FP16 plan views the same bytes as twice as many halves and uses half of them)."""
    widest = max(c.cout * c.h_out * c.w_out for c in (STEM, *(b.conv1 for b in BLOCKS)))
    shortcut = max(b.shortcut.cout * b.shortcut.h_out * b.shortcut.w_out for b in BLOCKS if b.shortcut)
    return {
        "x": batch * widest,
        "hidden": batch * widest,
        "out": batch * widest,
        "shortcut": batch * shortcut,
    }


# ----- the steps of a forward ----------------------------------------------------------------
@dataclass
class ClearFlagStep:
    """Clear the range flag (range-flag maths; first step of the forward)."""

    flag: object

    def enqueue(self, ctx: DeviceContext) -> None:
        self.flag.fill(0)


@dataclass
class TransposeStep:
    """fbank [b, 998, 80] -> the stem's NHWC input [b, 80, 998, 1]."""

    fbank: object
    stem_in: object
    batch: int

    def enqueue(self, ctx: DeviceContext) -> None:
        grid = (-(-FRAMES // TRANSPOSE_TILE), -(-MEL_BINS // TRANSPOSE_TILE), self.batch)
        ctx.kernels["fbank_to_stem"](grid, (TRANSPOSE_TILE, TRANSPOSE_ROWS), (self.fbank, self.stem_in),
                                     stream=ctx.stream)  # fmt: skip


@dataclass
class ConvStep:
    """One convolution with its epilogue: what it computes (`request`) and what runs it
    (`choice`, replaced when the capture chooses again)."""

    request: ConvRequest
    choice: ConvChoice
    label: ClassVar[str] = "conv"

    @property
    def name(self) -> str:
        return self.request.name

    @property
    def y(self):
        """The output buffer (a view of the widest size)."""
        return self.request.y

    @property
    def output(self):
        """What this step writes: the conv's own elements of `y`."""
        return self.request.y[: self.request.elements]

    @property
    def fused(self) -> bool:
        return self.choice.fused

    @property
    def runner(self) -> str:
        return self.choice.runner

    def enqueue(self, ctx: DeviceContext) -> None:
        self.choice.enqueue(ctx)


@dataclass
class BlockStep:
    """A whole BasicBlock by one kernel of ours (autotune.BlockChoice) in place of its two
    convolutions. Their ConvSteps stay as the record of what would run them: reports show
    them, and a block that replays wrongly inside a captured forward goes back to them
    (Plan.unfuse)."""

    first: ConvStep
    second: ConvStep
    choice: BlockChoice
    label: ClassVar[str] = "block"

    @property
    def name(self) -> str:
        return self.choice.block.prefix

    @property
    def output(self):
        """What this step writes that the next reads: the block output."""
        return self.second.output

    @property
    def runner(self) -> str:
        return self.choice.runner

    def enqueue(self, ctx: DeviceContext, taps: bool = False) -> None:
        """The kernel; with `taps`, the one that writes the hidden activation too."""
        self.choice.enqueue(ctx, taps)


@dataclass
class TapStep:
    """A named activation, handed to the forward's hook; enqueues nothing."""

    name: str
    view: object
    shape: tuple[int, ...]

    def enqueue(self, ctx: DeviceContext) -> None:
        """Nothing: the forward hands a tap to its hook instead."""


@dataclass
class PoolStep:
    """Masked statistics pooling of the trunk's output into pooled [3b, 5120], counting each
    row's active frames (the kernel resizes the F mask frames itself). In a range-flag math
    it also reads (and clears) the fused convolutions' range maxima `amax` into `flag`."""

    kernel: str
    batch: int
    trunk_out: object
    masks: object
    mask_frames: object
    pooled: object
    active: object
    amax: object | None = None
    flag: object | None = None
    label: ClassVar[str] = "pool"

    @property
    def output(self):
        return self.pooled

    def enqueue(self, ctx: DeviceContext) -> None:
        args = (self.trunk_out, self.masks, self.mask_frames, self.pooled, self.active)
        if self.amax is not None:
            args += (self.amax, np.int32(self.amax.size), self.flag)
        ctx.kernels[self.kernel]((self.batch, TRUNK_MELS), (TRUNK_CHANNELS,), args, stream=ctx.stream)


@dataclass
class LinearStep:
    """output = pooled @ seg_1.weight^T, strict FP32 on cuBLAS (its bias: an EpilogueStep)."""

    pooled: object
    output: object
    label: ClassVar[str] = "linear"

    def enqueue(self, ctx: DeviceContext) -> None:
        ctx.linear(self.pooled, self.output)


@dataclass
class EpilogueStep:
    """One of our epilogue kernels on its own (the linear's bias)."""

    epilogue: Epilogue
    output: object
    label: ClassVar[str] = "bias"

    def enqueue(self, ctx: DeviceContext) -> None:
        self.epilogue.launch(ctx.kernels, ctx.stream)


Step = ClearFlagStep | TransposeStep | ConvStep | BlockStep | TapStep | PoolStep | LinearStep | EpilogueStep
#: Steps after the trunk whose output a capture check may compare on its own.
TAIL_STEPS = (PoolStep, LinearStep, EpilogueStep)


class Plan:
    """Preallocated buffers and the ordered steps of one forward pass for `batch` chunks."""

    def __init__(
        self, ctx: DeviceContext, tuner: Autotuner, model: FoldedModel, batch: int, math: Math
    ) -> None:
        import cupy

        self.ctx = ctx
        self.tuner = tuner
        self.batch = batch
        self.math = math  # the FP16 engine's fallback plans: its fallback math
        self.table = maths.of(math)
        rows = batch * MAX_SPEAKERS
        sizes = activation_elements(batch)
        self.act = {name: ctx.arena[name].view(self.table.io_dtype)[: sizes[name]] for name in sizes}
        self.flag = cupy.zeros((1,), dtype=cupy.int32)  # the range flag (see the module docstring)
        # one range maximum per convolution, written by the fused cuDNN graphs (range-flag maths)
        self.amax = cupy.zeros((CONVOLUTIONS,), dtype=cupy.float32) if self.table.range_flag else None
        self.host_flag = pinned((1,), np.int32)
        self.fbank = cupy.zeros((batch, FRAMES, MEL_BINS), dtype=cupy.float32)
        # random, not zeros, while the stem's plans are timed (zeros can run faster)
        self.stem_in = cupy.random.RandomState(batch).standard_normal(
            (batch, MEL_BINS, FRAMES, 1), dtype=cupy.float32
        )
        self.masks = cupy.zeros((batch * MAX_SPEAKERS * MAX_MASK_FRAMES,), dtype=cupy.float32)
        self.mask_frames = cupy.ones((1,), dtype=cupy.int32)
        self.pooled = cupy.zeros((rows, STATS_DIM), dtype=cupy.float32)
        self.output = cupy.zeros((rows, EMBEDDING_DIM), dtype=cupy.float32)
        self.active = cupy.zeros((rows,), dtype=cupy.int32)
        self.host_output = pinned((rows, EMBEDDING_DIM), np.float32)
        self.host_active = pinned((rows,), np.int32)
        self._requests: list[ConvRequest] = []
        self.steps: list[Step] = self._build(model)

    # ----- set-up -------------------------------------------------------------------
    def _conv(self, name: str, folded: FoldedConv, x, y, epilogue: str, residual=None) -> ConvStep:
        flag = amax = None
        if self.table.range_flag:
            flag, slot = self.flag, len(self._requests)
            amax = self.amax[slot : slot + 1]
        request = ConvRequest(name, folded, self.batch, self.math, x, y, epilogue, residual, flag, amax)
        self._requests.append(request)
        return ConvStep(request, self.tuner.choose(request))

    def _build(self, model: FoldedModel) -> list[Step]:
        a, b, c, d = (self.act[k] for k in ("x", "hidden", "out", "shortcut"))
        tap = self._tap
        steps: list[Step] = [ClearFlagStep(self.flag)] if self.table.range_flag else []
        steps.append(TransposeStep(self.fbank, self.stem_in, self.batch))
        steps += [self._conv("stem", model.stem, self.stem_in, a, STEM_EPILOGUE), tap("stem", a)]
        x, out = a, c
        for spec_block, block in zip(BLOCKS, model.blocks, strict=True):
            prefix = spec_block.prefix
            first = self._conv(f"{prefix}.conv1", block.conv1, x, b, CONV1_EPILOGUE)
            middle: list[Step] = [tap(spec_block.hidden_tap, b)]
            residual = x
            if block.shortcut is not None:
                shortcut = self._conv(f"{prefix}.shortcut", block.shortcut, x, d, SHORTCUT_EPILOGUE)
                middle += [shortcut, tap(spec_block.shortcut_tap, d)]
                residual = d
            second = self._conv(f"{prefix}.conv2", block.conv2, b, out, CONV2_EPILOGUE, residual)
            fused = self.tuner.choose_block(spec_block, first.request, first.choice, second.request,
                                            second.choice)  # fmt: skip
            if fused is not None and fused.wins:
                steps += [BlockStep(first, second, fused), *middle, tap(spec_block.out_tap, out)]
            else:
                steps += [first, *middle, second, tap(spec_block.out_tap, out)]
            x, out = out, x
        self.trunk_out = x
        assert len(self._requests) == CONVOLUTIONS, (len(self._requests), CONVOLUTIONS)
        assert [(r.spec, r.epilogue) for r in self._requests] == trunk_convs(), (
            "trunk_convs is not what _build binds"
        )
        pool = PoolStep(self.table.pool_kernel, self.batch, x, self.masks, self.mask_frames, self.pooled,
                        self.active, self.amax, self.flag if self.amax is not None else None)  # fmt: skip
        bias = Epilogue.bind("bias_only", self.output, self.ctx.weights.seg_bias, None, EMBEDDING_DIM,
                             self.output.size, None, self.ctx.sm_count)  # fmt: skip
        steps += [pool, tap("pooled", self.pooled), LinearStep(self.pooled, self.output),
                  EpilogueStep(bias, self.output), tap("output", self.output)]  # fmt: skip
        return steps

    def _tap(self, name: str, view) -> TapStep:
        return TapStep(name, view, tap_shape(name, self.batch))

    @property
    def convs(self) -> list[ConvStep]:
        """The convolution steps in forward order, those a BlockStep runs included."""
        convs: list[ConvStep] = []
        for step in self.steps:
            if isinstance(step, ConvStep):
                convs.append(step)
            elif isinstance(step, BlockStep):
                convs += [step.first, step.second]
        return convs

    @property
    def blocks(self) -> list[BlockStep]:
        """The blocks one kernel runs, in forward order."""
        return [step for step in self.steps if isinstance(step, BlockStep)]

    def unfuse(self, index: int) -> None:
        """Run the block of step `index` as its two convolutions again: conv1 where the block
        step was, conv2 right after the hidden activation's tap (no shortcut: the kernel
        runs identity-shortcut blocks only)."""
        step = self.steps[index]
        assert isinstance(step, BlockStep), (index, step)
        hidden = self.steps[index + 1]
        assert isinstance(hidden, TapStep) and hidden.name.endswith(".hidden"), (index, hidden)
        self.steps[index : index + 2] = [step.first, hidden, step.second]

    def rechoose(self, again: Callable[[ConvChoice], bool]) -> bool:
        """Ask the autotuner again for every convolution whose choice `again` selects (after
        what ran it was rejected); True when the shared workspace grew (moved)."""
        for step in self.convs:
            if again(step.choice):
                step.choice = self.tuner.choose(step.request)
        return self.ctx.workspace.grow(max(step.choice.workspace_bytes for step in self.convs))

    # ----- the forward path (allocation-free, graph-capturable) ---------------------
    def forward(self, hook: TapHook | None = None, stop: int | None = None) -> None:
        """Enqueue the forward (its first `stop` steps, when given) on the context's stream;
        `hook` sees each tap in order."""
        with self.ctx.stream:  # CuPy launches on its current stream: make it ours, whoever calls
            for step in self.steps[:stop]:
                if isinstance(step, TapStep):
                    if hook is not None:
                        hook(step.name, step.view, step.shape)
                elif isinstance(step, BlockStep):
                    step.enqueue(self.ctx, taps=hook is not None)  # a hook reads the hidden tap
                else:
                    step.enqueue(self.ctx)

    # ----- host <-> device ------------------------------------------------------------
    def load(self, slot: InputSlot) -> None:
        """Enqueue the move of a staged batch into this plan's inputs (see staging.py).
        Rows past the batch's chunks keep stale values: rows never mix in the trunk, and
        their outputs are not read."""
        slot.move_to(self.fbank, self.masks, self.mask_frames, self.ctx.stream)

    def download(self, chunks: int) -> tuple[np.ndarray, np.ndarray, bool]:
        """(output [chunks*3, 256], active frames [chunks*3], range flag raised) copied back
        (synchronises). The flag is read in the same synchronisation: a range-flag math's
        output is never used without it."""
        self.enqueue_download(chunks, self.host_output, self.host_active, self.host_flag)
        self.ctx.stream.synchronize()
        return read_results(chunks, self.host_output, self.host_active, self.host_flag, self.table.range_flag)

    def enqueue_download(self, chunks: int, output: np.ndarray, active: np.ndarray, flag: np.ndarray) -> None:
        """Enqueue on the compute stream the copies of the batch's results (and its range
        flag) into pinned host arrays; read them with `read_results` once the stream is past."""
        rows, stream = chunks * MAX_SPEAKERS, self.ctx.stream
        held.copy(output.ctypes.data, self.output.data.ptr, rows * EMBEDDING_DIM * 4, stream)
        held.copy(active.ctypes.data, self.active.data.ptr, rows * 4, stream)
        if self.table.range_flag:
            held.copy(flag.ctypes.data, self.flag.data.ptr, 4, stream)

    # ----- reports ----------------------------------------------------------------------
    def own_bytes(self) -> int:
        """Device bytes of the buffers this plan owns (not its arena views)."""
        own = (self.fbank, self.stem_in, self.masks, self.mask_frames, self.pooled, self.output, self.active,
               self.flag, self.amax)  # fmt: skip
        return sum(int(a.nbytes) for a in own if a is not None)

    def pinned_bytes(self) -> int:
        return int(self.host_output.nbytes + self.host_active.nbytes + self.host_flag.nbytes)


def read_results(
    chunks: int, output: np.ndarray, active: np.ndarray, flag: np.ndarray, range_flag: bool
) -> tuple[np.ndarray, np.ndarray, bool]:
    """(output [chunks*3, 256], active frames [chunks*3], range flag raised), copied out of
    the pinned arrays a download filled. The flag is read with the output: a range-flag
    math's output is never used without it."""
    rows = chunks * MAX_SPEAKERS
    return output[:rows].copy(), active[:rows].copy(), range_flag and bool(flag[0])


def nhwc_to_nchw(values: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A trunk tap copied from its NHWC buffer, as the NCHW float32 array the references hold
    (FP16 taps are upcast exactly)."""
    n, c, h, w = shape
    nchw = values[: n * h * w * c].reshape(n, h, w, c).transpose(0, 3, 1, 2)
    return np.ascontiguousarray(nchw, dtype=np.float32)
