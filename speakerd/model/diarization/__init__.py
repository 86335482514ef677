"""Diarization after the embeddings, in NumPy and SciPy: pyannote.audio 4.0.7's
`SpeakerDiarization` from its segmentations and embeddings to its turns, to the bit.

    from speakerd.model.diarization import diarize
    result = diarize(segmentations, embeddings, step_s=1.0, num_speakers=None)
    result.turns, result.exclusive_turns, result.centroids, result.rttm("meeting")

One job per module, in pipeline order: frames (pyannote's sliding-window arithmetic),
aggregate (overlap-add of window frames), count (speakers per frame), clustering
(AgglomerativeClustering) or vbx (VBxClustering, in the PLDA space of plda), reconstruct
(clusters -> 0/1 frames), turns (frames -> turns), rttm (turns -> RTTM), pipeline (`diarize`).
SciPy (and scikit-learn, for VBx's KMeans fallback only) are server dependencies: the thin
client never imports this package.
"""

from speakerd.model.diarization.clustering import (
    SPEAKER_DIARIZATION_3_1,
    AgglomerativeParameters,
    Clusters,
    agglomerative_clustering,
    clean_speakers,
)
from speakerd.model.diarization.count import SpeakerCount, speaker_count
from speakerd.model.diarization.frames import SEGMENTATION_FRAMES, SlidingFrames
from speakerd.model.diarization.pipeline import Diarization, bind_speakers, diarize, working_bytes
from speakerd.model.diarization.plda import Plda, PldaError, load_plda
from speakerd.model.diarization.reconstruct import reconstruct
from speakerd.model.diarization.rttm import rttm_field, to_rttm
from speakerd.model.diarization.turns import Turn, binarize
from speakerd.model.diarization.vbx import COMMUNITY_1, VBxParameters, vbx_clustering

__all__ = [
    "COMMUNITY_1",
    "SEGMENTATION_FRAMES",
    "SPEAKER_DIARIZATION_3_1",
    "AgglomerativeParameters",
    "Clusters",
    "Diarization",
    "Plda",
    "PldaError",
    "SlidingFrames",
    "SpeakerCount",
    "Turn",
    "VBxParameters",
    "agglomerative_clustering",
    "binarize",
    "bind_speakers",
    "clean_speakers",
    "diarize",
    "load_plda",
    "reconstruct",
    "rttm_field",
    "speaker_count",
    "to_rttm",
    "vbx_clustering",
    "working_bytes",
]
