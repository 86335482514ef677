"""The engine interface every backend implements, and the pieces they all share.

An engine owns preallocated plans (one per batch size) and turns host arrays
fbank [n, 998, 80] + masks [n, s, F] into embeddings [n, s, 256]. The batcher above it
only ever calls `run_batch` with n <= the largest plan; `embed` splits larger inputs.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

import numpy as np

from speakerd.model.architecture import EMBEDDING_DIM
from speakerd.model.inputs import check_fbank, check_masks
from speakerd.model.numerics import Math, active_frames, pad_speakers


def plan_for(chunks: int, plan_sizes: tuple[int, ...]) -> int:
    """The plan an engine runs `chunks` on: the smallest plan holding them."""
    for size in plan_sizes:
        if size >= chunks:
            return size
    raise ValueError(f"{chunks} chunks exceed the largest plan {plan_sizes[-1]}")


def check_engine_config(
    engine: str, math: Math | str, supported: tuple[Math, ...], plan_sizes: tuple[int, ...]
) -> tuple[Math, tuple[int, ...]]:
    """(math, ascending unique plan sizes), or ValueError naming what `engine` cannot do."""
    math = Math(math)
    if math not in supported:
        expected = " or ".join(str(m) for m in supported)
        raise ValueError(f"math: {math} is not supported by {engine}; expected {expected}")
    sizes = tuple(sorted({int(size) for size in plan_sizes}))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"plan_sizes: {plan_sizes!r}, expected positive batch sizes")
    return math, sizes


@dataclass
class BatchRun:
    """What one `run_batch` produced and what it cost, for the caller and for metrics."""

    embeddings: np.ndarray  # [n, 3, 256] float32
    plans: list[str]  # plans used, e.g. ["b32/graph"] or ["b1/graph"] * 3
    compute_s: float  # device compute time (CUDA events on GPU, wall time on CPU)
    h2d_s: float = 0.0  # host-to-device copy time
    d2h_s: float = 0.0  # device-to-host copy time
    graph_replays: int = 0
    eager_runs: int = 0
    fp16_fallbacks: int = 0  # batches recomputed without FP16 after a range overflow


@dataclass
class EmbedResult:
    """Embeddings for n chunks and s speakers, with what produced them."""

    embeddings: np.ndarray  # [n, s, 256] float32
    active_frames: np.ndarray  # [n, s] int32: trunk frames (of 125) with non-zero weight
    math: Math
    plans: list[str] = field(default_factory=list)  # e.g. ["b32/graph"], one per batch run
    fp16_fallbacks: int = 0  # batches recomputed without FP16 because of a range overflow

    @property
    def empty(self) -> np.ndarray:
        """[n, s] bool: the mask had no weight, so the row is seg_1.bias and not a speaker."""
        return self.active_frames == 0


class Engine(abc.ABC):
    """A model loaded on a device with preallocated plans for fixed batch sizes."""

    #: e.g. "cpu-onnxruntime" or "gpu-cupy"
    name: str
    model_id: str
    math: Math
    #: batch sizes with a preallocated plan, ascending, e.g. (1, 32)
    plan_sizes: tuple[int, ...]

    @property
    def max_batch(self) -> int:
        return self.plan_sizes[-1]

    @abc.abstractmethod
    def run_batch(self, fbank: np.ndarray, masks: np.ndarray) -> BatchRun:
        """One batch of n <= max_batch chunks, already validated.

        fbank [n, 998, 80] float32; masks [n, 3, F] float32 with speakers padded and any
        F >= 1: the engine does pyannote's nearest resize onto 125 trunk frames itself (the
        GPU in its pooling kernel, ONNX Runtime inside the graph). A batch mixing requests
        of different F is resized on the host to F = 125 first, where the nearest resize
        is the identity, so a chunk's embedding does not depend on its neighbours.
        Must be safe to call from several threads at once: the batcher overlaps batches'
        assembly and host-to-device copies with the previous batch's compute that way.
        """

    def plan_times_ms(self) -> dict[int, float]:
        """Measured wall time of one run of each plan, for the batcher's cost model."""
        return {}

    def close(self) -> None:  # noqa: B027 - engines without device resources need no cleanup
        """Release device resources; the engine is unusable afterwards."""

    def embed(self, fbank: np.ndarray, masks: np.ndarray) -> EmbedResult:
        """Validate, split into batches of at most max_batch chunks, and run them in order."""
        fbank = check_fbank(fbank)
        masks = check_masks(masks, fbank.shape[0])
        speakers = masks.shape[1]
        active = active_frames(masks)
        padded = pad_speakers(masks)
        pieces, plans, fallbacks = [], [], 0
        for start in range(0, fbank.shape[0], self.max_batch):
            stop = start + self.max_batch
            run = self.run_batch(fbank[start:stop], padded[start:stop])
            pieces.append(run.embeddings)
            plans += run.plans
            fallbacks += run.fp16_fallbacks
        embeddings = np.concatenate(pieces, axis=0)[:, :speakers]
        assert embeddings.shape[1:] == (speakers, EMBEDDING_DIM), embeddings.shape
        return EmbedResult(np.ascontiguousarray(embeddings), active, self.math, plans, fallbacks)
