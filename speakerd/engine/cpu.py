"""CpuEngine: ONNX Runtime CPU behind the engine interface, so speakerd serves anywhere.

It runs the project's own ONNX export (`speakerd.onnx.export`, outputs only) in FP32: ONNX
Runtime's CPU provider has no TF32 or FP16 convolutions worth serving, so asking for them
is an error rather than a silent FP32.

Plans: a CPU "plan" of size b is a batch size the engine was warmed up and timed at; its
chunks run through ORT one at a time. Two measurements decided that, on 2 cores:
- ORT's batch-32 run cost the same per chunk as batch 1 (3.90 s vs 32 x 0.119 s): on a CPU
  the convolutions already fill the cores for one chunk, so batching saves nothing;
- batched runs are not batch-invariant: the same chunk at position 5 of a 6-chunk batch
  came out 1.5e-7 away from its batch-1 embedding (where inside ORT was not pinned down;
  a GEMM kernel's tail-row path is the likely place).
One chunk per run makes every chunk's bits independent of its neighbours, which the
service promises (tests/test_cpu_engine.py and tests/test_service.py check it bit for
bit). Masks are resized to the trunk's 125 frames before ORT for the same reason: the
graph then always sees one frame count, whatever F the request sent.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np

from speakerd.engine.base import BatchRun, Engine, Pieces, batch_inputs, check_engine_config, plan_for
from speakerd.model.architecture import EMBEDDING_DIM, FRAMES, MAX_SPEAKERS, MEL_BINS, TRUNK_FRAMES
from speakerd.model.numerics import Math, resize_masks
from speakerd.model.weights import FoldedModel
from speakerd.onnx.runtime import cpu_session

#: Runs not timed: the first run of the session lets ORT size its arenas (every run has the
#: same shape, see the module docstring); one run after that is representative on a CPU (no
#: clocks to ramp up).
WARMUP_RUNS = 1


def default_threads() -> int:
    """Intra-op threads: every core this process may run on (cgroup/affinity aware)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


class CpuEngine(Engine):
    """ONNX Runtime CPU, FP32 only; see the module docstring."""

    name = "cpu-onnxruntime"

    def __init__(
        self,
        model: FoldedModel,
        math: Math | str = Math.FP32,
        plan_sizes: tuple[int, ...] = (1, 32),
        threads: int | None = None,
    ) -> None:
        math, sizes = check_engine_config(self.name, math, (Math.FP32,), plan_sizes)
        self.model = model
        self.model_id = model.model_id
        self.math = math
        self.plan_sizes = sizes
        self.threads = threads or default_threads()
        self.session = cpu_session(model, taps=False, threads=self.threads)
        # ORT sessions are thread-safe, but two concurrent runs on a 2-core machine only
        # contend for the same cores; serialising keeps each batch's timing honest.
        self._lock = threading.Lock()
        self._times_ms: dict[int, float] | None = None  # measured on first ask: see plan_times_ms
        self._chunk_runs = 0  # ORT runs so far; the first WARMUP_RUNS are not timed
        self._warm_chunk_ms: float | None = None  # the latest warm run's time, see plan_times_ms

    def _warm_chunk(self) -> float:
        """A warm chunk's run time (ms, wall clock): the latest one run, else zero chunks run
        until one is warm."""
        fbank = np.zeros((1, FRAMES, MEL_BINS), dtype=np.float32)
        masks = np.ones((1, MAX_SPEAKERS, TRUNK_FRAMES), dtype=np.float32)
        while self._warm_chunk_ms is None:
            self._forward(fbank, masks)
        return self._warm_chunk_ms

    def _forward(self, fbank: np.ndarray, masks: np.ndarray) -> np.ndarray:
        """[n, 998, 80] and [n, 3, F] -> [n * 3, 256], one chunk per ORT run (module
        docstring); each warm run's time is kept for plan_times_ms."""
        rows = []
        for i in range(fbank.shape[0]):
            started = time.perf_counter()
            feeds = {"fbank": fbank[i : i + 1], "masks": masks[i : i + 1]}
            rows.append(self.session.run(["output"], feeds)[0])
            if self._chunk_runs >= WARMUP_RUNS:
                self._warm_chunk_ms = (time.perf_counter() - started) * 1e3
            self._chunk_runs += 1
        return np.concatenate(rows, axis=0)

    def plan_times_ms(self) -> dict[int, float]:
        """Plan b costs b single-chunk runs (one chunk per ORT call), so one chunk's time
        gives every plan's. Measured on first ask (the server asks at start-up, an offline
        `embed` never does): a warm chunk the engine already ran (the server's self-check
        runs several) is that measurement, else one is run for it."""
        if self._times_ms is None:
            chunk_ms = self._warm_chunk()
            self._times_ms = {size: size * chunk_ms for size in self.plan_sizes}
        return dict(self._times_ms)

    def run_batch(self, fbank: Pieces, masks: Pieces) -> BatchRun:
        """See Engine.run_batch; pieces are joined on the host (ORT takes one array)."""
        inputs = batch_inputs(fbank, masks)
        chunks = inputs.chunks
        if not 1 <= chunks <= self.max_batch:
            raise ValueError(f"fbank: {chunks} chunks, expected 1..{self.max_batch} per batch")
        plan = plan_for(chunks, self.plan_sizes)
        fbank, masks = inputs.joined()
        masks = resize_masks(masks)  # one frame count for the graph, see the module docstring
        with self._lock:
            started = time.perf_counter()
            output = self._forward(fbank, masks)
            elapsed = time.perf_counter() - started
        embeddings = output.reshape(chunks, MAX_SPEAKERS, EMBEDDING_DIM)
        return BatchRun(embeddings, [f"b{plan}/eager"], elapsed, eager_runs=1)
