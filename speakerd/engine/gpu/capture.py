"""A plan's forward captured into a CUDA graph, served only while it replays eager's bits.

`GraphCapture` records one plan's forward, checks its replays bit for bit against eager
forwards (two input sets, several replays each: a race inside the graph shows up as
replays that disagree) and, when they differ, finds the first convolution whose captured
prefix diverges and has it chosen again without what ran it (autotune.Autotuner.reject).
A graph that still disagrees is dropped and the plan serves eagerly: a captured graph that
disagrees with eager is never served.

Why re-choose rather than give up: on the H200 (cuDNN 9.19) the TF32 b1 forward diverged
first at layer3.0.shortcut's output whichever plan the shortcut ran, fused or bare (16
plans), yet the same bare plan replayed exactly inside a forward with no fused
convolution: the divergence showed at one convolution and came from a fused one before it
(a graph probe at ea614f9, in git history under measurements/). Hence the walk back to the nearest fused
convolution.
"""

from __future__ import annotations

import logging

import numpy as np

from speakerd.engine.gpu import held
from speakerd.engine.gpu.bitwise import replay_matches
from speakerd.engine.gpu.plan import TAIL_STEPS, BlockStep, ConvStep, Plan
from speakerd.model.architecture import MASK_FRAMES, MAX_SPEAKERS

log = logging.getLogger(__name__)

#: Convolutions chosen again, at most, when a captured forward replays differently from
#: eager (each time one convolution's runner is rejected, see GraphCapture.capture); then
#: every convolution goes bare once more, and failing that the plan serves eagerly.
MAX_RECHOICES = 8
#: Replays compared with eager per check input set when a graph is captured.
GRAPH_CHECK_REPLAYS = 8


class GraphCapture:
    """The CUDA graph of one plan's forward (`graph`, None while there is none or it was
    dropped; `check`: why it was dropped)."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.stream = plan.ctx.stream
        self.graph = None  # cupy.cuda.Graph once captured and checked
        self.check: str | None = None

    def run(self, use_graph: bool = True) -> str:
        """Replay the graph when there is one (and `use_graph`), else enqueue the eager
        forward; returns "graph" or "eager"."""
        if use_graph and self.graph is not None:
            held.launch(self.graph, self.stream)  # the interpreter lock kept (held.py)
            return "graph"
        self.plan.forward()
        return "eager"

    def capture(self) -> bool:
        """Record the forward into a CUDA graph, kept only if its replay is bit-identical to
        eager. True when a re-choice grew the shared workspace (graphs of the other plans
        must then be captured again).

        When the replay differs, the first convolution (or one-kernel block) whose captured
        prefix replays differently is found, and the nearest cuDNN-fused convolution at or
        before it is chosen again without its runner (a fused key loses its fusion: bare
        conv + our epilogue); with no fused one before it, that step itself (a block goes
        back to its two convolutions). Up to
        MAX_RECHOICES times; then every convolution goes bare, and failing that too the
        plan serves eagerly (module docstring)."""
        moved = False
        for _ in range(MAX_RECHOICES):
            if self._captured_matches():
                return moved
            step = self._first_divergent_conv()
            if step is None:
                break
            moved |= self._choose_again([self._culprit(step)])
        fused = [i for i, step in enumerate(self.plan.steps) if isinstance(step, ConvStep) and step.fused]
        if fused:
            log.warning("b%d: graph replay still differs (%s); every convolution goes bare",
                        self.plan.batch, self.check)  # fmt: skip
            moved |= self._choose_again(fused)
        if self._captured_matches():
            return moved
        log.warning("b%d graph replay differs from eager (%s): serving this plan eagerly",
                    self.plan.batch, self.check)  # fmt: skip
        self.graph = None
        return moved

    def _captured_matches(self) -> bool:
        self.graph = self._record()
        self.check = self._check_graph()
        return self.check is None

    def _culprit(self, step: int) -> int:
        """The conv step to choose again when `step` is the first whose output diverges:
        the nearest cuDNN-fused conv at or before it, else `step` itself."""
        for i in range(step, -1, -1):
            candidate = self.plan.steps[i]
            if isinstance(candidate, ConvStep) and candidate.fused:
                return i
        return step

    def _record(self, stop: int | None = None, warm_up: bool = True):
        """Capture the forward (its first `stop` steps), after an eager warm-up (kernels
        loaded, cuBLAS and cuDNN initialised) so the capture records only launches;
        `warm_up=False` when the caller has just run those steps eagerly."""
        if warm_up:
            self.plan.forward(stop=stop)
        self.stream.synchronize()
        self.stream.begin_capture()
        try:
            self.plan.forward(stop=stop)
        finally:
            graph = self.stream.end_capture()
        if hasattr(graph, "upload"):  # instantiate on the device now, not at the first replay
            try:
                graph.upload(self.stream)
            except TypeError:  # an older CuPy's upload() takes no stream
                graph.upload()
        self.stream.synchronize()
        return graph

    def _random_inputs(self, realistic: bool = False) -> None:
        """Check inputs: random fbank with masks all ones over one frame, or (`realistic`)
        random 0/1 masks over MASK_FRAMES frames with the last speaker of chunk 0 empty."""
        import cupy

        plan = self.plan
        random = cupy.random.RandomState(plan.batch + int(realistic))
        with self.stream:
            plan.fbank[...] = random.standard_normal(plan.fbank.shape, dtype=cupy.float32)
            if not realistic:
                plan.masks.fill(1.0)
                plan.mask_frames.fill(1)
                return
            used = plan.batch * MAX_SPEAKERS * MASK_FRAMES
            plan.masks[:used] = (random.random_sample(used) > 0.5).astype(cupy.float32)
            plan.masks[(MAX_SPEAKERS - 1) * MASK_FRAMES : MAX_SPEAKERS * MASK_FRAMES] = 0.0
            plan.mask_frames.fill(MASK_FRAMES)

    def _check_graph(self) -> str | None:
        """Replays against eager (set-up only); None when bit-identical every time. Two
        input sets, GRAPH_CHECK_REPLAYS replays each. Compared on the host: the outputs are
        a few hundred rows, and CuPy's comparison and count kernels cost a fresh machine
        seconds of compiling each."""
        plan = self.plan
        for realistic in (False, True):
            self._random_inputs(realistic)
            with self.stream:
                plan.forward()
                eager, eager_active = plan.output.get(), plan.active.get()
                for replay in range(GRAPH_CHECK_REPLAYS):
                    plan.output.fill(float("nan"))
                    plan.active.fill(-1)
                    self.graph.launch(self.stream)
                    output, active = plan.output.get(), plan.active.get()
                    differ = int(np.count_nonzero(output.view(np.uint32) != eager.view(np.uint32)))
                    differ += int(np.count_nonzero(active != eager_active))
                    if differ:
                        with np.errstate(invalid="ignore"):
                            worst = float(np.nanmax(np.abs(output - eager), initial=0.0))
                        inputs = "realistic masks" if realistic else "masks of ones"
                        return f"replay {replay + 1} on {inputs}: {differ} values differ, max abs {worst:.3g}"
            self.stream.synchronize()
        return None

    def _prefix_differs(self, step: int) -> bool:
        """Whether the forward up to and including step `step` (a conv or a tail step: the
        pooling, the linear, its bias), captured and replayed, writes that step's output
        differently from eager."""
        y = self.plan.steps[step].output  # type: ignore[union-attr]
        with self.stream:
            self.plan.forward(stop=step + 1)
            eager = y.copy()
        graph = self._record(stop=step + 1, warm_up=False)
        with self.stream:
            same = replay_matches(graph, self.stream, y, eager)
        self.stream.synchronize()
        return not same

    def _first_divergent_conv(self) -> int | None:
        """Step index of the first convolution whose captured prefix replays differently
        (binary search: once a prefix diverges, longer ones do too); None when every conv
        matches, after logging whether a tail step differs."""
        self._random_inputs()
        steps = [i for i, step in enumerate(self.plan.steps) if isinstance(step, ConvStep | BlockStep)]
        if not self._prefix_differs(steps[-1]):
            tail = [i for i, step in enumerate(self.plan.steps) if isinstance(step, TAIL_STEPS)]
            first = next(
                (self.plan.steps[i].label for i in tail if self._prefix_differs(i)),  # type: ignore[union-attr]
                "none alone",
            )
            log.warning("b%d: every convolution replays as eager; the first step that differs: %s",
                        self.plan.batch, first)  # fmt: skip
            return None
        low, high = 0, len(steps) - 1  # steps[high] differs
        while low < high:
            middle = (low + high) // 2
            if self._prefix_differs(steps[middle]):
                high = middle
            else:
                low = middle + 1
        return steps[high]

    def _choose_again(self, indexes: list[int]) -> bool:
        """Reject what ran each conv step in `indexes` (autotune.Autotuner.reject) and have
        the plan choose again every conv that ran one of those; a one-kernel block there
        goes back to its two convolutions, and its kernel is turned off for the shape. True
        when the workspace grew."""
        rejected = set()
        for index in sorted(indexes, reverse=True):  # unfusing a block shifts the steps after it
            bad = self.plan.steps[index]
            assert isinstance(bad, ConvStep | BlockStep), (index, bad)
            log.warning("b%d: %s (%s) replays differently inside the captured forward; choosing again",
                        self.plan.batch, bad.name, bad.runner)  # fmt: skip
            if isinstance(bad, BlockStep):
                self.plan.tuner.refuse_block(bad.first.request.key.bare(), "replayed wrongly")
                self.plan.unfuse(index)
                continue
            rejected.add(bad.choice.identity)
            self.plan.tuner.reject(bad.choice, "replayed wrongly")
        return self.plan.rechoose(lambda choice: choice.identity in rejected)
