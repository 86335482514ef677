"""Segmentations and embeddings -> a diarization: the end of pyannote's `SpeakerDiarization`.

`diarize` is what pyannote.audio 4.0.7's `SpeakerDiarization.apply` does after
`get_segmentations` and `get_embeddings`, with AgglomerativeClustering
(speaker-diarization-3.1's, clustering.py) or VBxClustering (community-1's, vbx.py, with its
PLDA): the same steps in the same order, so the turns are pyannote's to the bit.

1. speaker bounds (`set_num_speakers`): num_speakers fixes both bounds; min defaults to 1,
   max to no limit;
2. frame-level speaker count (count.py); when no frame has a speaker, the diarization is
   empty and nothing else runs;
3. clustering of the (window, speaker) embeddings (clustering.py or vbx.py, as the
   `clustering` parameters' type says), bound by the speaker numbers; a result outside the
   bounds (too few clean embeddings) is kept, with a warning;
4. the count is capped at max_speakers; speakers silent in a whole window are taken out
   of every cluster;
5. reconstruction (reconstruct.py) and turns (turns.py), once with the count and once with
   the count capped at 1 (the exclusive diarization, for transcription alignment);
6. speakers named SPEAKER_00, SPEAKER_01, ... in the order of their cluster indices as
   strings ("10" sorts before "2", as pyannote sorts labels), and the centroids reordered
   to match; a speaker made only by the count exceeding the clusters has a zero centroid.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from speakerd.model.diarization import compiled
from speakerd.model.diarization.clustering import (
    LINKAGE_BYTES_PER_PAIR_SQUARED,
    NO_CLUSTER,
    SPEAKER_DIARIZATION_3_1,
    AgglomerativeParameters,
    Clusters,
    agglomerative_clustering,
)
from speakerd.model.diarization.count import SpeakerCount, speaker_count
from speakerd.model.diarization.frames import (
    FRAMES_PER_WINDOW,
    SEGMENTATION_FRAMES,
    WINDOW_S,
    SlidingFrames,
    windows,
)
from speakerd.model.diarization.linkage import HOST, Link, Linker
from speakerd.model.diarization.plda import Plda
from speakerd.model.diarization.reconstruct import cluster_activations, most_active, ranking
from speakerd.model.diarization.rttm import to_rttm
from speakerd.model.diarization.turns import Track, Turn, binarize, speech_seconds
from speakerd.model.diarization.vbx import VBX_BYTES_PER_PAIR_CLUSTER, VBxParameters, vbx_clustering

#: pyannote's speaker names: SPEAKER_ and the speaker's index, two digits at least.
SPEAKER_PREFIX = "SPEAKER_"
#: The exclusive diarization keeps at most this many speakers per frame.
EXCLUSIVE_SPEAKERS = 1
#: Bytes `diarize` holds per window above its inputs, the linkage aside: the speaker count
#: and the search for silent speakers (made beside the clustering), the clean-pair filter and
#: the aggregated and reconstructed frames (measured peak RSS with nothing to link: 6.4-8.7
#: KB a window over 4,000 and 8,000 windows), rounded up with a margin for other allocators.
DIARIZE_BYTES_PER_WINDOW = 11_000
#: Bytes the clustering holds per clean pair beside the linkage's square matrix: the pair's
#: embedding gathered (float32) and normalised (float64), the linkage's per-row scratch
#: (measured: 13.5 KB a window with two clean pairs each, 8.7 KB of it the window's own, over
#: 1,500 and 3,000 windows, so 2.4 KB a pair), rounded up with a margin.
CLUSTERING_BYTES_PER_PAIR = 4_096


@dataclass(frozen=True)
class Diarization:
    """Who spoke when.

    turns: pyannote's `speaker_diarization`, overlaps included; exclusive_turns: its
    `exclusive_speaker_diarization` (one speaker at a time); labels: the speakers, sorted;
    centroids [len(labels), dim]: each speaker's mean embedding (`speaker_embeddings`), zero
    for a speaker without a cluster; speech_s: each speaker's speech in `turns`, seconds;
    clusters: how many clusters the clustering made (may fall outside the speaker bounds);
    seconds: where diarize()'s time went, wall seconds of each step ("clustering": the clean
    pairs' filter, linkage and assignment; "linkage": the centroid linkage, part of the
    clustering, absent when nothing was linked; "count": the speaker count, beside the
    clustering, with the search for speakers silent in a whole window; "reconstruction": the
    turns from both; "total"), for logs and benchmarks.
    """

    turns: list[Turn]
    exclusive_turns: list[Turn]
    labels: list[str]
    centroids: np.ndarray
    speech_s: dict[str, float]
    clusters: int
    seconds: dict[str, float] = field(default_factory=dict, compare=False)

    def rttm(self, uri: str | None, exclusive: bool = False) -> str:
        """The RTTM text pyannote's `write_rttm` writes for these turns."""
        return to_rttm(self.exclusive_turns if exclusive else self.turns, uri)


def bind_speakers(
    num_speakers: int | None = None, min_speakers: int | None = None, max_speakers: int | None = None
) -> tuple[int | None, int, float]:
    """(num_speakers, min_speakers, max_speakers) as pyannote's `set_num_speakers`:
    num_speakers overrides both bounds, equal bounds fix num_speakers, max defaults to
    infinity. 0 counts as not given, as in pyannote."""
    low = num_speakers or min_speakers or 1
    high = num_speakers or max_speakers or math.inf
    if low > high:
        raise ValueError(
            f"min_speakers must be at most max_speakers (here min_speakers={low:g}, max_speakers={high:g})"
        )
    if low == high:
        num_speakers = low
    return num_speakers, low, high


def working_bytes(windows: int, clean_pairs: int, initial_clusters: int = 0) -> int:
    """The most memory `diarize` holds at once above its inputs, for `windows` windows of
    which `clean_pairs` (window, speaker) pairs are clustered (clustering.clean_speakers):
    the clustering's quadratic scratch, the centroid linkage's 8 n^2 bytes (the agglomerative
    clustering's, and VBx's initialisation's), or with `initial_clusters` s > 0 VBx's updates
    over the s initial clusters of its AHC cut when they hold more (112 n s), plus the
    per-pair and per-window arrays. An upper bound, not an estimate: the server reserves it
    before clustering, and again for VBx once s is known (serving/diarization/service.py)."""
    linkage = LINKAGE_BYTES_PER_PAIR_SQUARED * clean_pairs * clean_pairs
    updates = VBX_BYTES_PER_PAIR_CLUSTER * clean_pairs * initial_clusters
    arrays = CLUSTERING_BYTES_PER_PAIR * clean_pairs + DIARIZE_BYTES_PER_WINDOW * windows
    return max(linkage, updates) + arrays


def compile_loops() -> None:
    """Compiles the frame loops `diarize` runs (aggregate.py's and reconstruct.py's, numba:
    a fraction of a second from its cache, a few seconds the first time on a machine) for a
    server's arrays (0/1 bytes, int64 clusters), so that no call waits for it; nothing where
    numba is not installed."""
    if not compiled.available():
        return
    # numba compiles for the arrays' types, not their sizes: one window of 3 speakers will do
    segmentations = np.zeros((1, FRAMES_PER_WINDOW, 3), dtype=np.uint8)
    speaker_count(segmentations)
    cluster_activations(segmentations, np.zeros((1, 3), dtype=np.int64), windows())


def _named(tracks: list[Track], names: dict[int, str]) -> list[Turn]:
    # a column missing from `names` would keep pyannote's integer label: written as its digits
    return [Turn(t.start, t.end, names.get(t.column, str(t.column))) for t in tracks]


def _cluster(
    embeddings: np.ndarray,
    segmentations: np.ndarray,
    clustering: AgglomerativeParameters | VBxParameters,
    plda: Plda | None,
    num_speakers: int | None,
    min_speakers: int,
    max_speakers: float,
    linker: Link,
    on_initial_clusters: Callable[[int, int], None] | None,
    clean: tuple[np.ndarray, np.ndarray] | None,
) -> Clusters:
    """The clustering `clustering`'s type picks (diarize's step 3)."""
    if isinstance(clustering, VBxParameters):
        assert plda is not None  # diarize checked it, before any work
        return vbx_clustering(
            embeddings,
            segmentations,
            plda,
            num_clusters=num_speakers,
            min_clusters=min_speakers,
            max_clusters=max_speakers,
            parameters=clustering,
            linker=linker,
            on_initial_clusters=on_initial_clusters,
            clean=clean,
        )
    return agglomerative_clustering(
        embeddings,
        segmentations,
        num_clusters=num_speakers,
        min_clusters=min_speakers,
        max_clusters=max_speakers,
        parameters=clustering,
        linker=linker,
        clean=clean,
    )


def diarize(
    segmentations: np.ndarray,
    embeddings: np.ndarray,
    step_s: float,
    num_speakers: int | None = None,
    min_speakers: int | None = 1,
    max_speakers: int | None = None,
    *,
    window_s: float = WINDOW_S,
    start_s: float = 0.0,
    frames: SlidingFrames = SEGMENTATION_FRAMES,
    clustering: AgglomerativeParameters | VBxParameters = SPEAKER_DIARIZATION_3_1,
    plda: Plda | None = None,
    min_duration_off: float = 0.0,
    linker: Linker = HOST,
    on_initial_clusters: Callable[[int, int], None] | None = None,
    clean: tuple[np.ndarray, np.ndarray] | None = None,
) -> Diarization:
    """segmentations [windows, frames, speakers] (0/1, pyannote's binarized segmentation),
    embeddings [windows, speakers, dim] (`get_embeddings`' array) -> Diarization.

    step_s, window_s, start_s: the segmentation windows (pyannote: 10 s every 1 s from 0);
    frames: the segmentation model's frames; clustering: the hyper-parameters, whose type
    picks the clustering (default AgglomerativeParameters, pyannote/speaker-diarization-3.1's;
    VBxParameters, e.g. vbx.COMMUNITY_1, for community-1's VBx, which needs `plda`, e.g.
    plda.load_plda(directory)); min_duration_off: the pipeline's
    `segmentation.min_duration_off` (0 in speaker-diarization-3.1 and community-1);
    linker: how the centroid linkage is computed (linkage.py: the compiled port on this
    host's cores by default, distances from the GPU on a GPU server; SciPy's bits always);
    on_initial_clusters: VBx's (vbx_clustering), called with (clean pairs, initial clusters)
    once its AHC cut is made, before its updates; clean: the (window, speaker) indices
    clustering.clean_speakers gives for these arrays, where the caller found them already (a
    server does, window by window as they arrive: the filter is per window), else found here.
    With VBx, speaker numbers it does not meet by itself are met by re-clustering with
    scikit-learn's KMeans, as pyannote does (vbx.py; scikit-learn is imported only then).
    """
    if isinstance(clustering, VBxParameters) and plda is None:
        raise ValueError("diarize: VBx clustering needs a PLDA (plda=load_plda(directory))")
    segmentations = np.asarray(segmentations)
    embeddings = np.asarray(embeddings)
    if segmentations.ndim != 3 or embeddings.ndim != 3:
        raise ValueError(
            f"segmentations {segmentations.shape} and embeddings {embeddings.shape}: expected "
            "[windows, frames, speakers] and [windows, speakers, dim]"
        )
    num_windows, _, num_local = segmentations.shape
    if embeddings.shape[:2] != (num_windows, num_local):
        raise ValueError(
            f"embeddings {embeddings.shape} do not match segmentations {segmentations.shape}: "
            f"expected [{num_windows}, {num_local}, dim]"
        )
    num_speakers, min_speakers, max_speakers = bind_speakers(num_speakers, min_speakers, max_speakers)
    chunks = windows(step_s, window_s, start_s)
    started = time.perf_counter()
    seconds: dict[str, float] = {}

    def counted() -> tuple[SpeakerCount, np.ndarray]:
        # the speaker count, and the speakers silent in a whole window (step 4)
        began = time.perf_counter()
        try:
            count = speaker_count(segmentations, step_s, window_s=window_s, start_s=start_s, frames=frames)
            return count, np.sum(segmentations, axis=1) == 0
        finally:
            seconds["count"] = time.perf_counter() - began

    def linked(points: np.ndarray) -> np.ndarray:  # the linker, its seconds kept
        began = time.perf_counter()
        try:
            return linker(points)
        finally:
            seconds["linkage"] = seconds.get("linkage", 0.0) + time.perf_counter() - began

    with ThreadPoolExecutor(1, thread_name_prefix="diarize-beside") as beside:
        # the speaker count and the clustering need nothing of each other: the count (and
        # the search for silent speakers) runs beside the clustering, whose compiled linkage
        # and GPU waits release the interpreter lock; pyannote counts first and stops there
        # when nobody speaks, so the clustering's outcome, an error too, is dropped then
        counting = beside.submit(counted)
        try:
            clusters: Clusters | None = _cluster(
                embeddings, segmentations, clustering, plda, num_speakers, min_speakers, max_speakers,
                linked, on_initial_clusters, clean,
            )  # fmt: skip
            failure: Exception | None = None
        except Exception as error:  # raised below unless the recording has no speaker
            clusters, failure = None, error
        seconds["clustering"] = time.perf_counter() - started
        count, silent = counting.result()
    if np.nanmax(count.counts, initial=0) == 0:
        seconds["total"] = time.perf_counter() - started
        return Diarization([], [], [], np.zeros((0, embeddings.shape[-1])), {}, 0, seconds)
    if failure is not None:
        raise failure
    assert clusters is not None
    found = int(np.max(clusters.hard)) + 1
    if not min_speakers <= found <= max_speakers:
        warnings.warn(
            f"diarize: {found} speakers found, outside the bounds [{min_speakers}, {max_speakers}] "
            "(too few clean embeddings for more clusters; a lower min_speakers may help)",
            stacklevel=2,
        )

    capped = np.minimum(count.counts, max_speakers).astype(np.int8)
    hard = np.array(clusters.hard, dtype=np.int64)
    hard[silent] = NO_CLUSTER
    exclusive = np.minimum(capped, EXCLUSIVE_SPEAKERS).astype(np.int8)

    reconstructing = time.perf_counter()
    # pyannote reconstructs twice (the count, then the count capped at 1); the clusters'
    # summed activity is the same both times, so it is computed once
    activations = cluster_activations(segmentations, hard, chunks, frames)
    ranked = ranking(activations)  # the same for both, unless a count needs more columns

    def turns_of(counts: np.ndarray) -> list[Track]:
        reconstructed = most_active(activations, SpeakerCount(counts, count.frames), ranked)
        return binarize(reconstructed, count.frames, min_duration_off=min_duration_off)

    tracks = turns_of(capped)
    exclusive_tracks = turns_of(exclusive)
    seconds["reconstruction"] = time.perf_counter() - reconstructing

    columns = sorted({t.column for t in tracks}, key=str)
    names = {column: f"{SPEAKER_PREFIX}{index:02d}" for index, column in enumerate(columns)}
    labels = sorted(names.values())
    column_of = {name: column for column, name in names.items()}
    centroids = clusters.centroids
    rows_needed = max(len(labels), max(columns, default=-1) + 1)
    if centroids.shape[0] < rows_needed:
        # the count made more speakers than clusters: theirs are zero (pyannote's padding)
        centroids = np.pad(centroids, ((0, rows_needed - centroids.shape[0]), (0, 0)))
    turns = _named(tracks, names)
    return Diarization(
        turns=turns,
        exclusive_turns=_named(exclusive_tracks, names),
        labels=labels,
        centroids=centroids[[column_of[label] for label in labels]],
        speech_s={label: speech_seconds(turns, label) for label in labels},
        clusters=found,
        seconds={**seconds, "total": time.perf_counter() - started},
    )
