"""The engine interface every backend implements, and the pieces they all share.

An engine owns preallocated plans (one per batch size) and turns host arrays
fbank [n, 998, 80] + masks [n, s, F] into embeddings [n, s, 256]. The batcher above it
only ever calls `run_batch` with n <= the largest plan; `embed` splits larger inputs.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from speakerd.engine.device_rows import DeviceRows
from speakerd.model.architecture import EMBEDDING_DIM, FRAMES, MAX_SPEAKERS, MEL_BINS, TRUNK_FRAMES
from speakerd.model.fbank import fbank as fbank_of
from speakerd.model.inputs import MAX_MASK_FRAMES, InputError, InputLengthError, check_fbank, check_masks
from speakerd.model.numerics import Math, active_frames, pad_speakers
from speakerd.model.recording import FbankSource, SharedFrames

if TYPE_CHECKING:  # the clustering's types; importing them would import numba and SciPy
    from speakerd.model.diarization.linkage import DeviceLinkage, SquareDistances
    from speakerd.model.segmentation.samples import Segmentable


@runtime_checkable
class DeviceFbank(Protocol):
    """fbank rows [k, 998, 80] that are not in host memory (a GPU recording's windows, see
    engine/gpu/recording.py): an engine with a device asks them to write themselves into its
    own buffer; any other code gets a host copy through `np.asarray`. Sliced along rows."""

    shape: tuple[int, int, int]
    size: int

    def write_device(self, pointer: int, stream) -> None: ...

    def __array__(self, dtype=None, copy=None) -> np.ndarray: ...


def device_of(rows: object) -> int | None:
    """The device among several (`serve --devices`) whose memory holds DeviceFbank `rows`
    (their `pool_device` attribute: not `device`, which NumPy's arrays have too), or None:
    host rows, or rows of the one device in process. The batcher binds such a request's
    chunks to that device (serving/batching/queue.py)."""
    device = getattr(rows, "pool_device", None)
    return None if device is None else int(device)


#: One array, or the pieces of several requests in order (concatenated along axis 0 they
#: are the batch): the batcher hands an engine its requests' arrays without joining them.
#: An fbank piece may be DeviceFbank rows.
Pieces = np.ndarray | DeviceFbank | Sequence[np.ndarray | DeviceFbank]


@dataclass(frozen=True)
class BatchInputs:
    """A batch's fbank and masks as pieces (each a tuple of arrays, in order), with its chunk
    count and mask frame count F, checked by `batch_inputs`."""

    fbank: tuple[np.ndarray | DeviceFbank, ...]  # together chunks * 998 * 80 values
    masks: tuple[np.ndarray, ...]  # each [k, 3, F], the k summing to `chunks`
    chunks: int
    frames: int

    def joined(self) -> tuple[np.ndarray, np.ndarray]:
        """(fbank [chunks, 998, 80] float32, masks [chunks, 3, F] float32) in one array each
        (no copy for a batch of one piece already float32 and contiguous)."""
        fbank = [np.asarray(piece, dtype=np.float32).reshape(-1) for piece in self.fbank]
        masks = [np.asarray(piece, dtype=np.float32) for piece in self.masks]
        fbank_one = fbank[0] if len(fbank) == 1 else np.concatenate(fbank)
        masks_one = masks[0] if len(masks) == 1 else np.concatenate(masks, axis=0)
        return (
            np.ascontiguousarray(fbank_one).reshape(self.chunks, FRAMES, MEL_BINS),
            np.ascontiguousarray(masks_one),
        )


def _as_pieces(value: Pieces, field: str) -> tuple[np.ndarray | DeviceFbank, ...]:
    if isinstance(value, np.ndarray | DeviceFbank | DeviceRows):  # rows the engine reads as they are
        return (value,)
    pieces = tuple(
        piece if isinstance(piece, DeviceFbank | DeviceRows) else np.asarray(piece) for piece in value
    )
    if not pieces:
        raise InputError(field, "an empty list of pieces; a batch needs at least one chunk")
    return pieces


def batch_inputs(fbank: Pieces, masks: Pieces) -> BatchInputs:
    """Check a batch given as arrays or lists of pieces: every masks piece [k, 3, F] with one
    F for the whole batch (pieces of several requests share F: the batcher resizes mixed
    ones to 125 first), and fbank's values totalling chunks * 998 * 80. InputLengthError
    names the array (`masks[i]` for a piece of a list) and the expected and given element
    counts; InputError a disagreeing F."""
    fbank_pieces, mask_pieces = _as_pieces(fbank, "fbank"), _as_pieces(masks, "masks")
    listed = not isinstance(masks, np.ndarray)
    chunks, frames = 0, 0
    for index, piece in enumerate(mask_pieces):
        field = f"masks[{index}]" if listed else "masks"
        if piece.ndim != 3 or piece.shape[1] != MAX_SPEAKERS or not 1 <= piece.shape[2] <= MAX_MASK_FRAMES:
            width = int(piece.shape[-1]) if piece.ndim and 1 <= piece.shape[-1] <= MAX_MASK_FRAMES else 1
            whole = max(1, int(piece.size) // (MAX_SPEAKERS * width))
            if whole * MAX_SPEAKERS * width == piece.size:  # the elements are there, the axes are not
                raise InputError(field, f"shape {tuple(piece.shape)}: expected [chunks, {MAX_SPEAKERS}, F] "
                                        f"with F from 1 to {MAX_MASK_FRAMES}")  # fmt: skip
            raise InputLengthError(field, whole * MAX_SPEAKERS * width, int(piece.size))
        if index == 0:
            frames = int(piece.shape[2])
        elif piece.shape[2] != frames:
            raise InputError(
                field,
                f"{piece.shape[2]} mask frames where masks[0] has {frames}; pieces of one batch share F",
            )
        chunks += int(piece.shape[0])
    if chunks < 1:
        raise InputError("masks", "0 chunks; a batch needs at least one")
    given = sum(int(piece.size) for piece in fbank_pieces)
    if given != chunks * FRAMES * MEL_BINS:
        raise InputLengthError("fbank", chunks * FRAMES * MEL_BINS, given)
    return BatchInputs(fbank_pieces, mask_pieces, chunks, frames)


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
    #: GPU: device time between the previous plan run's end and this run's forward, which is
    #: the device waiting for the host (plus this run's ~10 us input move) while batches
    #: queue; None where unknown (the first run; the CPU engine)
    gap_s: float | None = None


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


#: Guards the first measurement of every engine's empty-mask rows (`Engine.empty_rows`): one
#: lock for all engines, since each measures once in its life.
_EMPTY_ROWS_LOCK = threading.Lock()


class Engine(abc.ABC):
    """A model loaded on a device with preallocated plans for fixed batch sizes."""

    #: e.g. "cpu-onnxruntime" or "gpu-cupy"
    name: str
    model_id: str
    math: Math
    #: batch sizes with a preallocated plan, ascending, e.g. (1, 32)
    plan_sizes: tuple[int, ...]
    #: the host threads of a CPU engine's pool (--cpu-threads); None for a device engine
    threads: int | None = None
    #: `empty_rows` once measured
    _empty_rows: np.ndarray | None = None

    @property
    def max_batch(self) -> int:
        return self.plan_sizes[-1]

    @property
    def device_count(self) -> int:
        """Devices running batches independently behind this engine: the batcher keeps its
        pipeline full on each (1 for an engine in process; N for `serve --devices`)."""
        return 1

    @abc.abstractmethod
    def run_batch(self, fbank: Pieces, masks: Pieces) -> BatchRun:
        """One batch of n <= max_batch chunks, already validated.

        fbank [n, 998, 80] float32; masks [n, 3, F] float32 with speakers padded and any
        F >= 1. Either may also be a list of pieces, the arrays of several requests in order
        (see `batch_inputs`): the GPU engine copies each piece straight into its pinned
        staging, so the batcher never joins a batch on the host. The engine does pyannote's
        nearest resize onto 125 trunk frames itself (the GPU in its pooling kernel, ONNX
        Runtime inside the graph); every piece of a batch has the same F. A batch mixing requests
        of different F is resized on the host to F = 125 first, where the nearest resize
        is the identity, so a chunk's embedding does not depend on its neighbours.
        Must be safe to call from several threads at once: the batcher overlaps batches'
        assembly and host-to-device copies with the previous batch's compute that way.
        """

    def pair_distances(self) -> SquareDistances | None:
        """What computes the clustering's square distance matrices on this engine's device
        (SciPy's pdist bits, model/diarization/linkage.py), or None: the host computes them."""
        return None

    def centroid_linkage(self) -> DeviceLinkage | None:
        """What computes the clustering's whole centroid linkage on this engine's device
        (SciPy's bits, model/diarization/linkage.py's DeviceLinkage), or None: the host
        merges."""
        return None

    def waveform_fbank(self, waveform: np.ndarray) -> np.ndarray | DeviceFbank:
        """fbank rows of checked waveforms [n, 160000] (EmbedChunks' waveform input): NumPy's
        on the host by default; an engine with a device returns rows computed there when
        their batch is staged. Called on the service's decode threads."""
        return fbank_of(waveform)

    def fbank_source(self, step: int) -> FbankSource:
        """Where a recording's fbank is computed for this engine (EmbedRecording): on the
        host by default; an engine with a device returns a source whose windows stay there."""
        return SharedFrames(step)

    def segmenting_source(self, step: int) -> Segmentable | None:
        """Where a recording the server segments keeps its samples and its fbank, when not
        in the server's memory: None by default (the recording path wraps `fbank_source` in
        a SegmentingSource); `serve --devices` keeps both in the recording's device worker,
        which decodes the audio and segments it there."""
        return None

    def plan_times_ms(self) -> dict[int, float]:
        """Measured wall time of one run of each plan, for the batcher's cost model."""
        return {}

    def empty_rows(self) -> np.ndarray:
        """[3, 256] float32, read-only: the rows this engine gives a window whose every
        speaker mask is empty, so that the batcher can answer such (silent) windows without
        running them.

        Every weight of an empty mask is 0, so the pooled mean and std are exactly 0 whatever
        the trunk computed from the audio (finite: the service bounds its inputs, and an FP16
        batch out of range is recomputed), and the row is the linear's bias, seg_1.bias
        (SPEC 1): one row per model, not per window. It is measured, not read from the
        weights, so that the batcher hands out exactly the bits this engine's plans give
        (and an engine that keeps no weights in this process, `serve --devices`, needs none):
        one run of one all-zero window, on first ask, cached. The server asks at start-up,
        off the event loop, as for `plan_times_ms`.
        """
        rows = self._empty_rows
        if rows is None:
            with _EMPTY_ROWS_LOCK:
                rows = self._empty_rows
                if rows is None:
                    fbank = np.zeros((1, FRAMES, MEL_BINS), dtype=np.float32)
                    masks = np.zeros((1, MAX_SPEAKERS, TRUNK_FRAMES), dtype=np.float32)
                    run = self.run_batch(fbank, masks)
                    rows = np.array(run.embeddings[0], dtype=np.float32)
                    assert rows.shape == (MAX_SPEAKERS, EMBEDDING_DIM), rows.shape
                    rows.flags.writeable = False
                    self._empty_rows = rows
        return rows

    @property
    def known_empty_rows(self) -> np.ndarray | None:
        """`empty_rows` if already measured, else None (never runs the engine)."""
        return self._empty_rows

    #: whether this engine was built from cached start-up choices (engine/build_cache.py)
    built_from_cache: bool = False

    def keep_build(self) -> None:  # noqa: B027 - engines that tune nothing at start-up keep nothing
        """Keep this build's start-up choices for the next start (called once the self-check
        passed)."""

    def forget_build(self) -> None:  # noqa: B027 - nothing kept, nothing to forget
        """Drop the cached choices this engine was built from (its self-check failed)."""

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
