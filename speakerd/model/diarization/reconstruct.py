"""Clustered windows -> which speakers talk in each frame of the recording (0/1 per frame).

pyannote.audio 4.0.7's `SpeakerDiarization.reconstruct` and `SpeakerDiarizationMixin.
to_diarization`:

1. per window, each cluster's activity is the max over the window's local speakers assigned
   to it (a cluster absent from a window is NaN there, so that window does not vote);
2. those activities are summed over the overlapping windows on the recording's frame grid
   (overlap-add, no averaging): a cluster's value in a frame is how many windows heard it;
3. in each frame, the `count` clusters with the largest sums are active (ties broken by
   NumPy's `argsort` of the negated sums, as pyannote does). When the count exceeds the
   number of clusters, silent extra columns are appended and take the surplus: they become
   speakers of their own, with no centroid.

The exclusive diarization is the same reconstruction with the count capped at 1.
"""

from __future__ import annotations

import numpy as np

from speakerd.model.diarization import compiled
from speakerd.model.diarization.aggregate import overlap_add, placement
from speakerd.model.diarization.clustering import NO_CLUSTER
from speakerd.model.diarization.count import SpeakerCount
from speakerd.model.diarization.frames import SEGMENTATION_FRAMES, SlidingFrames


def check_clusters(segmentations: np.ndarray, hard_clusters: np.ndarray) -> int:
    """The number of clusters hard_clusters [windows, speakers] names (its largest index +
    1); ValueError when its shape is not segmentations' [windows, _, speakers] or when it
    holds a negative cluster other than NO_CLUSTER."""
    num_windows, _, num_speakers = segmentations.shape
    if hard_clusters.shape != (num_windows, num_speakers):
        raise ValueError(f"hard clusters {hard_clusters.shape}, expected {(num_windows, num_speakers)}")
    negative = hard_clusters[(hard_clusters < 0) & (hard_clusters != NO_CLUSTER)]
    if len(negative):
        raise ValueError(f"hard clusters: negative cluster {int(negative.min())} other than {NO_CLUSTER}")
    return max(int(np.max(hard_clusters, initial=NO_CLUSTER)) + 1, 0)


def clustered_segmentations(segmentations: np.ndarray, hard_clusters: np.ndarray) -> np.ndarray:
    """segmentations [windows, frames, speakers], hard clusters [windows, speakers] ->
    [windows, frames, clusters] float64: per window, the max activity of the speakers in each
    cluster, NaN for clusters with none. NO_CLUSTER speakers are left out."""
    num_windows, num_frames, num_speakers = segmentations.shape
    num_clusters = check_clusters(segmentations, hard_clusters)
    clustered = np.full((num_windows, num_frames, num_clusters), np.nan)
    for speaker in range(num_speakers):
        cluster = hard_clusters[:, speaker].astype(np.int64)
        rows = np.nonzero(cluster != NO_CLUSTER)[0]
        # NaN (no speaker yet) yields to any activity; otherwise the larger activity wins
        clustered[rows, :, cluster[rows]] = np.fmax(
            clustered[rows, :, cluster[rows]], segmentations[rows, :, speaker]
        )
    return clustered


def _add_clusters(segmentations, hard_clusters, firsts, total):
    """Steps 1 and 2 as one loop (compiled by compiled.jit), without the clustered
    [windows, frames, clusters] array: window by window, each cluster's activity in a frame
    is the fmax of its speakers' in speaker order (NaN without one; NumPy's fmax: a NaN
    yields to the other value), added as float64 to the frame's float32 sum unless NaN, as
    overlap_add adds the clustered segmentations."""
    num_chunks, per_chunk, num_speakers = segmentations.shape
    for chunk in range(num_chunks):
        first = firsts[chunk]
        for speaker in range(num_speakers):
            cluster = hard_clusters[chunk, speaker]
            if cluster < 0:
                continue
            earlier = False  # the cluster's activity was added with its first speaker
            for other in range(speaker):
                earlier = earlier or hard_clusters[chunk, other] == cluster
            if earlier:
                continue
            for frame in range(per_chunk):
                activity = np.float64(segmentations[chunk, frame, speaker])
                for other in range(speaker + 1, num_speakers):
                    if hard_clusters[chunk, other] == cluster:
                        value = np.float64(segmentations[chunk, frame, other])
                        if activity != activity or value > activity:
                            activity = value
                if activity == activity:
                    total[first + frame, cluster] = total[first + frame, cluster] + activity


def cluster_activations(
    segmentations: np.ndarray,
    hard_clusters: np.ndarray,
    chunks: SlidingFrames,
    frames: SlidingFrames = SEGMENTATION_FRAMES,
    use_compiled: bool | None = None,
) -> np.ndarray:
    """Steps 1 and 2: each cluster's summed activity on the recording's frames,
    [num_frames, clusters]. It does not depend on the count, so the diarization and its
    exclusive form (the same with the count capped at 1) share it. use_compiled: one
    compiled loop (None: where numba is installed), or the clustered segmentations
    overlap-added by NumPy as pyannote does; the same bits either way."""
    if not (compiled.available() if use_compiled is None else use_compiled):
        activations, _ = overlap_add(
            clustered_segmentations(segmentations, hard_clusters), chunks, frames, average=False,
            missing=0.0, use_compiled=False,
        )  # fmt: skip
        return activations
    hard = np.asarray(hard_clusters, dtype=np.int64)
    num_clusters = check_clusters(segmentations, hard)
    num_chunks, per_chunk, _ = segmentations.shape
    _, num_frames, firsts = placement(chunks, num_chunks, per_chunk, frames)
    total = np.zeros((num_frames, num_clusters), dtype=np.float32)
    compiled.jit(_add_clusters)(segmentations, hard, firsts, total)
    return total


def discrete_diarization(
    clustered: np.ndarray,
    count: SpeakerCount,
    chunks: SlidingFrames,
    frames: SlidingFrames = SEGMENTATION_FRAMES,
) -> np.ndarray:
    """clustered [windows, frames, clusters] + frame counts -> [num_frames, columns] float32
    of 0/1 on `count.frames` (`to_diarization`); columns >= clusters when a count exceeds
    the number of clusters."""
    activations, _ = overlap_add(clustered, chunks, frames, average=False, missing=0.0)
    return most_active(activations, count)


def ranking(activations: np.ndarray) -> np.ndarray:
    """Each frame's columns from the most active down: NumPy's `argsort` of the negated
    activations, as pyannote ranks them (its ties broken as NumPy's sort breaks them)."""
    return np.argsort(-activations, axis=-1)


def most_active(activations: np.ndarray, count: SpeakerCount, ranked: np.ndarray | None = None) -> np.ndarray:
    """Step 3: in each frame the `count` columns of largest activation are 1, the others 0
    (`to_diarization`'s ranking), [num_frames, columns]. ranked: `ranking(activations)`
    where the caller has it (the diarization and its exclusive form rank the same
    activations); ranked again when the count needs more columns than it has."""
    counts = np.asarray(count.counts)
    if activations.shape[0] != counts.shape[0]:
        # pyannote crops both to their common extent; from the same windows they are equal
        raise ValueError(f"{activations.shape[0]} activation frames but {counts.shape[0]} counted frames")
    most = int(counts.max(initial=0))
    if activations.shape[1] < most:
        activations = np.pad(activations, ((0, 0), (0, most - activations.shape[1])))
    if ranked is None or ranked.shape != activations.shape:
        ranked = ranking(activations)
    # frame t keeps its counts[t] best-ranked columns
    keep = np.arange(activations.shape[1])[None, :] < counts.astype(np.int64)[:, None]
    binary = np.zeros_like(activations)
    np.put_along_axis(binary, ranked, keep.astype(binary.dtype), axis=-1)
    return binary


def reconstruct(
    segmentations: np.ndarray,
    hard_clusters: np.ndarray,
    count: SpeakerCount,
    chunks: SlidingFrames,
    frames: SlidingFrames = SEGMENTATION_FRAMES,
) -> np.ndarray:
    """`SpeakerDiarization.reconstruct`: binarized segmentations [windows, frames, speakers]
    and their clusters -> the 0/1 diarization [num_frames, columns] on `count.frames`."""
    return discrete_diarization(clustered_segmentations(segmentations, hard_clusters), count, chunks, frames)
