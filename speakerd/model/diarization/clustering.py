"""Window speakers -> recording speakers: pyannote's agglomerative clustering.

Each (window, local speaker) pair has an embedding; clustering says which pairs are the same
person. This is pyannote.audio 4.0.7's `AgglomerativeClustering` (pipelines/clustering.py)
with pyannote/speaker-diarization-3.1's hyper-parameters, in the same steps:

1. `clean_speakers` (`BaseClustering.filter_embeddings`): only pairs that speak alone in at
   least 20% of the window's frames, with an embedding free of NaN, are clustered ("train"
   embeddings); the rest are only assigned at the end.
2. `bound_clusters` (`set_num_clusters`): num/min/max clusters, clipped to the number of
   train embeddings. With at most one cluster allowed, nothing is clustered: every pair goes
   to cluster 0.
3. `cluster_embeddings` (`AgglomerativeClustering.cluster`): the train embeddings are
   L2-normalised (centroid linkage needs a Euclidean space; on unit vectors it orders pairs
   as cosine does), linked by SciPy, and cut at the distance threshold. Clusters smaller
   than `min_cluster_size` (12, or 10% of the embeddings when there are few) are "small";
   when the number of large ones misses the bounds, the dendrogram is cut at other merge
   steps, nearest the threshold first, until one gives the wanted number; finally each
   small cluster joins the large one whose centroid is nearest.
4. `assign_embeddings`: centroids are the mean raw (unnormalised) train embeddings of each
   cluster, and every pair, train or not, goes to its most similar centroid (2 - cosine
   distance), or with `constrained_assignment` by a Hungarian assignment per window so
   that two speakers of a window never share a cluster.

SciPy's `fcluster` and `cdist`, and NumPy's reductions, are called on the same dtypes as
pyannote calls them, and the centroid linkage is SciPy's `linkage` to the bit (linkage.py's
compiled port, or SciPy itself), so the clusters (and centroids) are the same bits, ties
included.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
from scipy.cluster.hierarchy import fcluster, linkage
from scipy.optimize import linear_sum_assignment
from scipy.spatial.distance import cdist

from speakerd.model.diarization.linkage import HOST, Link

log = logging.getLogger(__name__)

#: `filter_embeddings`' default: a speaker must talk alone in a fifth of the window's frames
#: (about 2 s of a 10 s window) for its embedding to shape the clusters.
MIN_ACTIVE_RATIO = 0.2
#: Linkage methods SciPy defines only for Euclidean distances: with the cosine metric,
#: pyannote normalises the embeddings and links them with the Euclidean distance instead.
EUCLIDEAN_ONLY_METHODS = ("centroid", "median", "ward")
#: Below 10 embeddings per wanted cluster, `min_cluster_size` shrinks to 10% of the
#: embeddings (pyannote's "kind of arbitrary" heuristic for short recordings).
SMALL_SET_CLUSTER_RATIO = 0.1
#: Bytes the centroid linkage holds per squared clean pair, either way it is computed: the
#: compiled one's square float64 matrix (linkage.py), or SciPy's condensed float64 distances
#: (n(n-1)/2 of them) and the working copy it merges in (measured peak RSS over 2,000, 4,000
#: and 8,000 rows: 2.00x the condensed matrix). The clustering's largest allocation,
#: quadratic: an hour's clean pairs (up to 3 a window, 10,773) take at most 0.93 GB, a 3 h
#: recording's (32,373) 8.4 GB.
LINKAGE_BYTES_PER_PAIR_SQUARED = 8

#: `constrained_argmax`'s and the pipeline's marker for "no cluster" (an inactive speaker).
NO_CLUSTER = -2
#: Similarity from cosine distance in [0, 2]: 2 - d, so the most similar centroid is the max.
SIMILARITY_OFFSET = 2


@dataclass(frozen=True)
class AgglomerativeParameters:
    """The clustering's hyper-parameters; the defaults are pyannote/speaker-diarization-3.1's
    (`clustering: {method: centroid, min_cluster_size: 12, threshold: 0.7045654963945799}`,
    the embedding model's metric cosine, unconstrained assignment)."""

    method: str = "centroid"
    min_cluster_size: int = 12
    threshold: float = 0.7045654963945799
    metric: str = "cosine"
    constrained_assignment: bool = False


#: pyannote/speaker-diarization-3.1's clustering.
SPEAKER_DIARIZATION_3_1 = AgglomerativeParameters()


@dataclass(frozen=True)
class Clusters:
    """The clustering of every (window, local speaker) pair.

    hard [windows, speakers]: cluster index, or NO_CLUSTER; soft [windows, speakers,
    clusters]: 2 - cosine distance to each centroid; centroids [clusters, dim]: mean raw
    train embedding of each cluster.
    """

    hard: np.ndarray
    soft: np.ndarray
    centroids: np.ndarray


def one_cluster(embeddings: np.ndarray, train: np.ndarray) -> Clusters:
    """Every speaker of every window in one cluster, its centroid the mean of the clean
    `train` rows (NaN, pyannote's mean of nothing, when no pair was clean)."""
    num_windows, num_speakers, dim = embeddings.shape
    if train.shape[0] == 0:
        centroids = np.full((1, dim), np.nan, dtype=np.mean(np.zeros(1, dtype=train.dtype)).dtype)
    else:
        centroids = np.mean(train, axis=0, keepdims=True)
    return Clusters(
        hard=np.zeros((num_windows, num_speakers), dtype=np.int8),
        soft=np.ones((num_windows, num_speakers, 1)),
        centroids=centroids,
    )


def clean_speakers(
    embeddings: np.ndarray, segmentations: np.ndarray, min_active_ratio: float = MIN_ACTIVE_RATIO
) -> tuple[np.ndarray, np.ndarray]:
    """(window indices, speaker indices) of the pairs that are clustered, in row-major
    order: speaking alone in at least `min_active_ratio` of the frames, embedding without NaN.
    embeddings [windows, speakers, dim], segmentations [windows, frames, speakers] (0/1)."""
    num_frames = segmentations.shape[1]
    if segmentations.dtype == np.uint8 and segmentations.shape[2] < 256:
        # a server's 0/1 bytes: the same counts in byte arithmetic, no float copy (the
        # speakers' sum fits a byte, the frames' an int32)
        alone = np.sum(segmentations, axis=2, dtype=np.uint8, keepdims=True) == 1
        clean_frames = np.sum(segmentations & alone, axis=1, dtype=np.int32)
    else:
        alone = np.sum(segmentations, axis=2, keepdims=True) == 1
        clean_frames = np.sum(segmentations * alone, axis=1)
    active = clean_frames >= min_active_ratio * num_frames
    valid = ~np.any(np.isnan(embeddings), axis=2)
    windows, speakers = np.where(active * valid)
    return windows, speakers


def bound_clusters(
    num_embeddings: int,
    num_clusters: int | None = None,
    min_clusters: int | None = None,
    max_clusters: float | None = None,
) -> tuple[int | None, int, int]:
    """(num_clusters, min_clusters, max_clusters) as `BaseClustering.set_num_clusters`:
    num_clusters overrides both bounds, both are clipped to [1, num_embeddings], and equal
    bounds fix num_clusters. 0 counts as not given, as in pyannote."""
    low = num_clusters or min_clusters or 1
    low = max(1, min(num_embeddings, low))
    high = num_clusters or max_clusters or num_embeddings
    high = max(1, min(num_embeddings, high))
    if low > high:
        raise ValueError(
            f"min_clusters must be at most max_clusters (here min_clusters={low:g}, max_clusters={high:g})"
        )
    if low == high:
        num_clusters = low
    return num_clusters, int(low), int(high)


def _sizes(clusters: np.ndarray, min_cluster_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(cluster ids, their sizes, the ids of clusters of at least min_cluster_size)."""
    ids, sizes = np.unique(clusters, return_counts=True)
    return ids, sizes, ids[sizes >= min_cluster_size]


def _cut_nearest_target(
    dendrogram: np.ndarray,
    threshold: float,
    min_cluster_size: int,
    target: int,
    cut_at_threshold: np.ndarray,
) -> np.ndarray:
    """Flat clusters of the merge step whose number of large clusters is `target`, trying
    merge steps in order of their linkage distance's closeness to `threshold`; the closest
    miss when none hits it (pyannote's "look for perfect candidate").

    Steps merging into a cluster still smaller than min_cluster_size are skipped: they cannot
    change the number of large clusters. pyannote keeps the last step it tried when the
    target is one and no step gives one large cluster; so does this.
    """
    num_embeddings = dendrogram.shape[0] + 1
    # cutting "at distance i" of a dendrogram whose heights are its step numbers keeps the
    # first i + 1 merges
    by_step = np.copy(dendrogram)
    by_step[:, 2] = np.arange(num_embeddings - 1)
    best_step, best_large = num_embeddings - 1, 1
    clusters = cut_at_threshold
    for step in np.argsort(np.abs(dendrogram[:, 2] - threshold)):
        if by_step[step, 3] < min_cluster_size:
            continue
        clusters = fcluster(by_step, step, criterion="distance") - 1
        large = len(_sizes(clusters, min_cluster_size)[2])
        if abs(large - target) < abs(best_large - target):
            best_step, best_large = step, large
        if large == target:
            return clusters
    if best_large != target:
        clusters = fcluster(by_step, best_step, criterion="distance") - 1
        log.info(
            "clustering: found only %d large clusters of the %d wanted (min_cluster_size %d)",
            len(_sizes(clusters, min_cluster_size)[2]),
            target,
            min_cluster_size,
        )
    return clusters


def cluster_embeddings(
    train: np.ndarray,
    parameters: AgglomerativeParameters = SPEAKER_DIARIZATION_3_1,
    min_clusters: int = 1,
    max_clusters: int | None = None,
    num_clusters: int | None = None,
    linker: Link = HOST,
) -> np.ndarray:
    """train [n, dim] -> cluster index per row, 0..k-1 (`AgglomerativeClustering.cluster`).
    Centroid linkage (pyannote's) is `linker`'s, SciPy's bits however computed (linkage.py);
    other methods are SciPy's `linkage`."""
    num_embeddings = train.shape[0]
    max_clusters = num_embeddings if max_clusters is None else max_clusters
    min_cluster_size = min(
        parameters.min_cluster_size, max(1, round(SMALL_SET_CLUSTER_RATIO * num_embeddings))
    )
    if num_embeddings == 1:
        return np.zeros((1,), dtype=np.uint8)

    if parameters.metric == "cosine" and parameters.method in EUCLIDEAN_ONLY_METHODS:
        with np.errstate(divide="ignore", invalid="ignore"):
            points = train / np.linalg.norm(train, axis=-1, keepdims=True)
        if parameters.method == "centroid":
            dendrogram = linker(points)
        else:
            dendrogram = linkage(points, method=parameters.method, metric="euclidean")
    else:
        points = train
        dendrogram = linkage(points, method=parameters.method, metric=parameters.metric)

    clusters = fcluster(dendrogram, parameters.threshold, criterion="distance") - 1
    num_large = len(_sizes(clusters, min_cluster_size)[2])
    if num_large < min_clusters:
        num_clusters = min_clusters
    elif num_large > max_clusters:
        num_clusters = max_clusters
    if num_clusters is not None and num_large != num_clusters:
        clusters = _cut_nearest_target(
            dendrogram, parameters.threshold, min_cluster_size, num_clusters, clusters
        )

    ids, sizes, large = _sizes(clusters, min_cluster_size)
    if len(large) == 0:
        clusters[:] = 0
        return clusters
    small = ids[sizes < min_cluster_size]
    if len(small) == 0:
        return clusters

    # each small cluster joins the large cluster with the nearest centroid (of the points
    # that were linked: normalised ones for centroid linkage)
    large_centroids = np.vstack([np.mean(points[clusters == k], axis=0) for k in large])
    small_centroids = np.vstack([np.mean(points[clusters == k], axis=0) for k in small])
    nearest = np.argmin(cdist(large_centroids, small_centroids, metric=parameters.metric), axis=0)
    for small_id, large_index in zip(small, nearest, strict=True):
        clusters[clusters == small_id] = large[large_index]
    return np.unique(clusters, return_inverse=True)[1]


def constrained_argmax(soft: np.ndarray) -> np.ndarray:
    """soft [windows, speakers, clusters] -> hard [windows, speakers] int8: per window, the
    assignment of speakers to distinct clusters with the largest total similarity (Hungarian,
    SciPy's linear_sum_assignment); speakers left without a cluster get NO_CLUSTER. NaN
    similarities count as the smallest one (`BaseClustering.constrained_argmax`)."""
    soft = np.nan_to_num(soft, nan=np.nanmin(soft))
    hard = np.full(soft.shape[:2], NO_CLUSTER, dtype=np.int8)
    for window, similarity in enumerate(soft):
        speakers, clusters = linear_sum_assignment(similarity, maximize=True)
        hard[window, speakers] = clusters
    return hard


def assign_embeddings(
    embeddings: np.ndarray,
    train_windows: np.ndarray,
    train_speakers: np.ndarray,
    train_clusters: np.ndarray,
    metric: str = "cosine",
    constrained: bool = False,
) -> Clusters:
    """Every pair to its most similar cluster centroid (`BaseClustering.assign_embeddings`).

    Centroids are the mean raw train embeddings of each cluster; similarity is 2 - distance.
    A train pair may end in another cluster than the one it was clustered into, as in
    pyannote."""
    num_windows, num_speakers, dim = embeddings.shape
    num_clusters = int(np.max(train_clusters)) + 1
    train = embeddings[train_windows, train_speakers]
    centroids = np.vstack([np.mean(train[train_clusters == k], axis=0) for k in range(num_clusters)])
    distance = cdist(embeddings.reshape(num_windows * num_speakers, dim), centroids, metric=metric)
    soft = SIMILARITY_OFFSET - distance.reshape(num_windows, num_speakers, num_clusters)
    hard = constrained_argmax(soft) if constrained else np.argmax(soft, axis=2)
    return Clusters(hard=hard, soft=soft, centroids=centroids)


def agglomerative_clustering(
    embeddings: np.ndarray,
    segmentations: np.ndarray,
    num_clusters: int | None = None,
    min_clusters: int | None = None,
    max_clusters: float | None = None,
    parameters: AgglomerativeParameters = SPEAKER_DIARIZATION_3_1,
    linker: Link = HOST,
    clean: tuple[np.ndarray, np.ndarray] | None = None,
) -> Clusters:
    """embeddings [windows, speakers, dim], binarized segmentations [windows, frames,
    speakers] -> Clusters, as `AgglomerativeClustering.__call__` (module docstring);
    `linker` computes the centroid linkage (linkage.py); `clean`: what `clean_speakers`
    gives for these arrays, where the caller has it already (a server finds it window by
    window as they arrive), else found here."""
    if embeddings.ndim != 3 or segmentations.ndim != 3:
        raise ValueError(
            f"embeddings {embeddings.shape} and segmentations {segmentations.shape}: expected "
            "[windows, speakers, dim] and [windows, frames, speakers]"
        )
    train_windows, train_speakers = clean if clean is not None else clean_speakers(embeddings, segmentations)
    train = embeddings[train_windows, train_speakers]
    num_clusters, min_clusters, max_clusters = bound_clusters(
        train.shape[0], num_clusters, min_clusters, max_clusters
    )
    if max_clusters < 2:
        # one cluster at most: no clustering (its centroid is NaN when no pair was clean)
        return one_cluster(embeddings, train)
    train_clusters = cluster_embeddings(
        train,
        parameters,
        min_clusters=min_clusters,
        max_clusters=max_clusters,
        num_clusters=num_clusters,
        linker=linker,
    )
    return assign_embeddings(
        embeddings,
        train_windows,
        train_speakers,
        train_clusters,
        metric=parameters.metric,
        constrained=parameters.constrained_assignment,
    )
