"""Window speakers -> recording speakers: pyannote's VBx clustering (community-1's).

pyannote.audio 4.0.7's `VBxClustering` (pipelines/clustering.py, with utils/vbx.py's `VBx`
and `cluster_vbx`) is the clustering of pyannote/speaker-diarization-community-1. Where the
agglomerative clustering of speaker-diarization-3.1 cuts a dendrogram and tidies its small
clusters, VBx treats the clean embeddings as draws from a mixture of speakers in a PLDA
space (plda.py) and refines an initial clustering by variational Bayes: speakers that
explain too little of the data get a prior near zero and are dropped. The steps:

1. clean pairs (`filter_embeddings`, the same as the agglomerative one: clustering.py's
   `clean_speakers`). Fewer than two: no clustering, everything is cluster 0.
2. initialisation: centroid linkage of the L2-normalised clean embeddings, cut at
   `threshold` (a Euclidean distance between unit vectors: 0.6 is a cosine of 0.82), with
   no small-cluster handling; each row starts with its cluster's one-hot responsibilities,
   smoothed by a softmax with temperature 1/7.
3. VB iterations on the PLDA features with community-1's `Fa` (scales the data's weight)
   and `Fb` (speaker regularisation: the larger, the fewer speakers): at most 20 updates,
   stopping when the ELBO gains less than 1e-4.
4. speakers whose prior stays above 1e-7 are kept; their centroids are the
   responsibility-weighted means of the raw clean embeddings.
5. a forced or bounded number of speakers that VBx's count misses: pyannote re-clusters the
   unit clean embeddings with scikit-learn's KMeans (`n_init=3, random_state=42`: k-means++
   seeding from a seeded RandomState, 3 runs, the best kept), and each centroid is the mean
   of its raw clean embeddings; the same scikit-learn call on the same array gives the same
   labels (`kmeans_centroids` says what holds it to one thread, and why).
6. assignment: each pair to its most similar centroid (2 - cosine distance). community-1
   uses the constrained (Hungarian, one cluster per speaker of a window) assignment, with
   the window's silent speakers given a score below every real one; the KMeans path turns
   it off.

The same NumPy, SciPy and scikit-learn calls run in the same order and on the same dtypes
as pyannote's, so the responsibilities, the kept speakers, the centroids and the clusters
are its bits.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy.cluster.hierarchy import fcluster
from scipy.spatial.distance import cdist
from scipy.special import logsumexp, softmax

from speakerd.model.diarization.clustering import (
    SIMILARITY_OFFSET,
    Clusters,
    clean_speakers,
    constrained_argmax,
    one_cluster,
)
from speakerd.model.diarization.linkage import HOST, Link
from speakerd.model.diarization.plda import Plda

log = logging.getLogger(__name__)

#: VB updates at most: `VBxClustering` passes maxIters=20 to `cluster_vbx` (VBx's own
#: default is 10).
MAX_ITERATIONS = 20
#: Stop once an update raises the ELBO by less than this (`VBx`'s default epsilon).
ELBO_EPSILON = 1e-4
#: Softmax temperature (inverse) turning the one-hot AHC labels into initial
#: responsibilities: 7 makes a row's own cluster e^7 ≈ 1100 times likelier than any other
#: (`cluster_vbx`'s init_smoothing).
INIT_SMOOTHING = 7.0
#: Added to the speaker priors before their log, so a pruned speaker's log prior is
#: log(1e-8), not -inf (`VBx`'s eps).
PRIOR_FLOOR = 1e-8
#: A speaker whose final prior is at most this is dropped (`VBxClustering`'s sp > 1e-7).
KEPT_PRIOR = 1e-7
#: Bytes VBx holds per (clean pair, initial cluster) at its peak, at most: its variational
#: updates keep several float64 [n, s] arrays (one-hot labels, their softmax, the
#: log-likelihoods, their exponent, the responsibilities) for n clean pairs and the s
#: initial clusters of the AHC cut. Measured peak resident size of `diarize` with every pair
#: its own initial cluster (s = n): 80-87 n s over n = 2,000 and 3,000, with a quarter of
#: margin. The AHC's linkage before it holds its own 8 n^2 (clustering.py), freed before
#: the updates: what VBx holds is the larger of the two (pipeline.working_bytes).
VBX_BYTES_PER_PAIR_CLUSTER = 112
#: Fewer clean embeddings than this: no clustering, one cluster.
MIN_TRAIN_EMBEDDINGS = 2
#: `VBxClustering`'s KMeans: 3 runs from different k-means++ seeds (the lowest inertia kept),
#: seeded with 42 so that a recording always gets the same clusters.
KMEANS_RUNS = 3
KMEANS_SEED = 42
#: OpenMP threads of scikit-learn's Lloyd iterations and inertia: each thread sums its own
#: partial centres (and inertia) and the partials are added afterwards, so on more than one
#: thread the float sums, and in a near tie a label or the choice among the runs, depend
#: on the machine's core count. One thread makes the answer the same on every machine (it
#: is pyannote's under OMP_NUM_THREADS=1). Up to 256 clean rows (scikit-learn's CHUNK_SIZE)
#: the centres are summed on one thread whatever the limit; only the runs' inertias, which
#: pick the best run, are summed per thread.
KMEANS_THREADS = 1
#: Added below the lowest similarity for the silent speakers of a window, so the Hungarian
#: assignment prefers any real speaker (`VBxClustering`'s const = min - 1).
SILENT_MARGIN = 1.0


@dataclass(frozen=True)
class VBxParameters:
    """The VBx clustering's hyper-parameters; the defaults are
    pyannote/speaker-diarization-community-1's (`SpeakerDiarization.default_parameters`:
    `clustering: {threshold: 0.6, Fa: 0.07, Fb: 0.8}`), the embedding model's cosine metric,
    and `VBxClustering`'s constrained assignment. Fa and Fb keep pyannote's names so that a
    pipeline config's `clustering` mapping passes as keywords."""

    threshold: float = 0.6
    Fa: float = 0.07
    Fb: float = 0.8
    metric: str = "cosine"
    constrained_assignment: bool = True


#: pyannote/speaker-diarization-community-1's clustering.
COMMUNITY_1 = VBxParameters()


def unit_rows(train: np.ndarray) -> np.ndarray:
    """[n, dim] clean embeddings, each divided by its L2 norm (`train_embeddings_normed`,
    which both the AHC initialisation and the KMeans fallback cluster)."""
    return train / np.linalg.norm(train, axis=1, keepdims=True)


def ahc_init(train: np.ndarray, threshold: float, linker: Link = HOST) -> np.ndarray:
    """[n, dim] clean embeddings -> initial cluster per row, 0..k-1: centroid linkage of the
    unit rows (`linker`'s: SciPy's bits, linkage.py) cut at `threshold`, labels renumbered in
    sorted order."""
    dendrogram = linker(unit_rows(train))
    clusters = fcluster(dendrogram, threshold, criterion="distance") - 1
    return np.unique(clusters, return_inverse=True)[1]


def vb_iterations(
    features: np.ndarray,
    phi: np.ndarray,
    responsibilities: np.ndarray,
    Fa: float,
    Fb: float,
    max_iterations: int = MAX_ITERATIONS,
    epsilon: float = ELBO_EPSILON,
) -> tuple[np.ndarray, np.ndarray, list[float]]:
    """Variational Bayes for a mixture of speakers in the PLDA space (utils/vbx.py's `VBx`
    without the HMM, the only form pyannote 4 keeps; Landini et al. 2022, "Bayesian HMM
    clustering of x-vector sequences (VBx)", whose equation numbers the comments give).

    features [n, d] PLDA features, phi [d] between-speaker variances (zero mean, identity
    within-speaker covariance), responsibilities [n, s] the initial ones. Returns the final
    responsibilities [n, s], the speaker priors [s] and the ELBO per update.
    """
    num_speakers = responsibilities.shape[1]
    priors = np.ones(num_speakers) / num_speakers
    dim = features.shape[1]
    # per-row constant of the log-likelihood (23), and the features scaled to unit prior (18)
    row_constant = -0.5 * (np.sum(features**2, axis=1, keepdims=True) + dim * np.log(2 * np.pi))
    scaled = features * np.sqrt(phi)
    gamma = responsibilities
    elbos: list[float] = []
    for iteration in range(max_iterations):
        # speaker posteriors: precision (17) and mean (16) of each speaker's latent vector
        inv_precision = 1.0 / (1 + Fa / Fb * gamma.sum(axis=0, keepdims=True).T * phi)
        mean = Fa / Fb * inv_precision * gamma.T.dot(scaled)
        # expected log-likelihood of each row under each speaker (23)
        log_likelihood = Fa * (scaled.dot(mean.T) - 0.5 * (inv_precision + mean**2).dot(phi) + row_constant)
        log_prior = np.log(priors + PRIOR_FLOOR)
        log_marginal = logsumexp(log_likelihood + log_prior, axis=-1)
        total = np.sum(log_marginal, axis=0)
        # responsibilities and priors: a mixture (GMM) update
        gamma = np.exp(log_likelihood + log_prior - log_marginal[:, None])
        priors = np.sum(gamma, axis=0)
        priors = priors / priors.sum()
        # the bound (25): data term plus the speakers' KL to their prior
        elbo = total + Fb * 0.5 * np.sum(np.log(inv_precision) - inv_precision - mean**2 + 1)
        elbos.append(elbo)
        if iteration > 0 and elbo - elbos[-2] < epsilon:
            if elbo < elbos[-2]:
                log.info("vbx: the ELBO decreased at update %d (%g -> %g)", iteration, elbos[-2], elbo)
            break
    return gamma, priors, elbos


def vbx_responsibilities(
    initial: np.ndarray, features: np.ndarray, phi: np.ndarray, Fa: float, Fb: float
) -> tuple[np.ndarray, np.ndarray]:
    """Initial clusters [n] -> (responsibilities [n, k], priors [k]) (`cluster_vbx`):
    one-hot labels smoothed by a softmax, then the VB updates."""
    one_hot = np.zeros((len(initial), initial.max() + 1))
    one_hot[range(len(initial)), initial.astype(int)] = 1.0
    start = softmax(one_hot * INIT_SMOOTHING, axis=1)
    gamma, priors, _ = vb_iterations(features, phi, start, Fa=Fa, Fb=Fb)
    return gamma, priors


def kmeans_centroids(train: np.ndarray, num_clusters: int) -> np.ndarray:
    """[n, dim] clean embeddings -> [k, dim] centroids of `VBxClustering`'s KMeans fallback:
    `KMeans(n_clusters=k, n_init=3, random_state=42, copy_x=False).fit_predict` on the unit
    rows, then each cluster's mean raw row, as pyannote computes them (scikit-learn's own
    centres, of the unit rows, are not used).

    scikit-learn is imported here, on the only path that needs it, so a server that never
    forces a count of speakers on VBx never loads it. Its OpenMP threads are limited to
    KMEANS_THREADS for this call only (an OpenMP limit is per calling thread). More clusters
    than rows, where KMeans (and so pyannote) raises, are clipped to one cluster per row, as
    the agglomerative clustering clips them."""
    from sklearn.cluster import KMeans
    from threadpoolctl import threadpool_limits

    if num_clusters > train.shape[0]:
        log.info(
            "vbx: %d clusters asked of %d clean embeddings: KMeans makes %d",
            num_clusters, train.shape[0], train.shape[0],
        )  # fmt: skip
        num_clusters = train.shape[0]
    kmeans = KMeans(n_clusters=num_clusters, n_init=KMEANS_RUNS, random_state=KMEANS_SEED, copy_x=False)
    with threadpool_limits(limits=KMEANS_THREADS, user_api="openmp"):
        labels = kmeans.fit_predict(unit_rows(train))
    return np.vstack([np.mean(train[labels == k], axis=0) for k in range(num_clusters)])


def vbx_clustering(
    embeddings: np.ndarray,
    segmentations: np.ndarray,
    plda: Plda,
    num_clusters: int | None = None,
    min_clusters: int | None = None,
    max_clusters: float | None = None,
    parameters: VBxParameters = COMMUNITY_1,
    linker: Link = HOST,
    on_initial_clusters: Callable[[int, int], None] | None = None,
    clean: tuple[np.ndarray, np.ndarray] | None = None,
) -> Clusters:
    """embeddings [windows, speakers, dim], binarized segmentations [windows, frames,
    speakers] -> Clusters, as `VBxClustering.__call__` (module docstring); `linker` computes
    the initialisation's centroid linkage (linkage.py); `on_initial_clusters(n, s)` hears the
    AHC's outcome (n clean pairs in s initial clusters) before the updates that hold
    VBX_BYTES_PER_PAIR_CLUSTER n s bytes (the server resizes its memory reservation there);
    `clean`: `clean_speakers` of these arrays where the caller has it (agglomerative_clustering).

    The speaker numbers are the pipeline's (`set_num_speakers`): min defaults to 1, max to
    no limit; unlike the agglomerative clustering they are not clipped to the number of
    clean embeddings, except where KMeans would need more rows than it has (pyannote fails
    there; `kmeans_centroids`).
    """
    if embeddings.ndim != 3 or segmentations.ndim != 3:
        raise ValueError(
            f"embeddings {embeddings.shape} and segmentations {segmentations.shape}: expected "
            "[windows, speakers, dim] and [windows, frames, speakers]"
        )
    if embeddings.shape[-1] != plda.embedding_dimension:
        raise ValueError(
            f"embeddings of {embeddings.shape[-1]} dimensions, the PLDA transforms {plda.embedding_dimension}"
        )
    min_clusters = 1 if min_clusters is None else min_clusters
    max_clusters = math.inf if max_clusters is None else max_clusters
    num_windows, num_speakers, dim = embeddings.shape
    train_windows, train_speakers = clean if clean is not None else clean_speakers(embeddings, segmentations)
    train = embeddings[train_windows, train_speakers]
    if train.shape[0] < MIN_TRAIN_EMBEDDINGS:
        return one_cluster(embeddings, train)  # no clustering

    initial = ahc_init(train, parameters.threshold, linker)
    if on_initial_clusters is not None:
        on_initial_clusters(len(initial), int(initial.max()) + 1)
    gamma, priors = vbx_responsibilities(
        initial, plda.transform(train), plda.phi, Fa=parameters.Fa, Fb=parameters.Fb
    )
    weights = gamma[:, priors > KEPT_PRIOR]
    centroids = weights.T @ train.reshape(-1, dim) / weights.sum(0, keepdims=True).T

    found = centroids.shape[0]
    if found < min_clusters:
        num_clusters = min_clusters
    elif found > max_clusters:
        num_clusters = max_clusters
    constrained = parameters.constrained_assignment
    if num_clusters and num_clusters != found:
        # pyannote turns the constrained assignment off here: it could make more clusters
        # than asked for (two speakers of a window never share one)
        constrained = False
        centroids = kmeans_centroids(train, int(num_clusters))
        found = centroids.shape[0]

    distance = cdist(embeddings.reshape(num_windows * num_speakers, dim), centroids, metric=parameters.metric)
    soft = SIMILARITY_OFFSET - distance.reshape(num_windows, num_speakers, found)
    if constrained:
        soft[segmentations.sum(1) == 0] = soft.min() - SILENT_MARGIN
        hard = constrained_argmax(soft)
    else:
        hard = np.argmax(soft, axis=2)
    return Clusters(hard=hard, soft=soft, centroids=centroids)
