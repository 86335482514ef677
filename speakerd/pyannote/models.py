"""pyannote.audio objects built without a model hub: the embedding model from speakerd's
safetensors weights, the segmentation model from a local checkpoint, and a diarization
pipeline that needs nothing else.

The tests and `speakerd.pyannote.bench` build their pipelines here because the machines they
run on reach no model hub: the segmentation-3.0 checkpoint is a local file, the embedding
model is the served weights file loaded into pyannote's own `WeSpeakerResNet34` (speakerd's
state-dict keys are pyannote's), and the clustering is `AgglomerativeClustering`, which needs
no PLDA download. A user with hub access builds the pipeline as usual and only calls
`speakerd.pyannote.use_server`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from pyannote.audio import Model
from pyannote.audio.core.plda import PLDA
from pyannote.audio.models.embedding import WeSpeakerResNet34
from pyannote.audio.pipelines import SpeakerDiarization

from speakerd.model.weights import load_state_dict

#: pyannote/speaker-diarization-3.1's AgglomerativeClustering hyper-parameters (the last hub
#: pipeline that used it): centroid linkage, clusters under 12 embeddings merged, cosine
#: distance threshold 0.7045654963945799.
AGGLOMERATIVE_PARAMETERS: dict[str, Any] = {
    "segmentation": {"min_duration_off": 0.0},
    "clustering": {"method": "centroid", "min_cluster_size": 12, "threshold": 0.7045654963945799},
}
#: The hub configurations' batch sizes (pyannote's own default is 1, far slower on a GPU).
DEFAULT_BATCH_SIZE = 32


def embedding_model(weights: str | Path) -> WeSpeakerResNet34:
    """pyannote's `WeSpeakerResNet34` holding the weights of a speakerd safetensors file (the
    file a server serves), in eval mode. Strict loading: a key missing on either side raises."""
    state = {key: torch.from_numpy(np.array(value)) for key, value in load_state_dict(weights).items()}
    model = WeSpeakerResNet34()
    model.load_state_dict(state, strict=True)
    return model.eval()


def segmentation_model(checkpoint: str | Path) -> Model:
    """The segmentation model of a local pyannote checkpoint (`pytorch_model.bin`)."""
    path = Path(checkpoint)
    if not path.is_file():
        raise FileNotFoundError(
            f"segmentation checkpoint: no file at {path} (expected segmentation-3.0's pytorch_model.bin; "
            "scripts/pyannote_segmentation.sh extracts one)"
        )
    return Model.from_pretrained(str(path))


def _unused_plda() -> PLDA:
    """A PLDA object that is never read: pyannote.audio 4.0.7's `SpeakerDiarization` loads a
    PLDA whatever the clustering, but only `VBxClustering` uses it, and the real one is a
    hub download. Built without `__init__`, so it holds nothing."""
    return PLDA.__new__(PLDA)


def diarization_pipeline(
    segmentation: Model,
    embedding: WeSpeakerResNet34,
    exclude_overlap: bool = False,
    batch_size: int = DEFAULT_BATCH_SIZE,
) -> SpeakerDiarization:
    """A hub-free `SpeakerDiarization` (AgglomerativeClustering), instantiated and ready."""
    pipeline = SpeakerDiarization(
        segmentation=segmentation,
        embedding=embedding,
        embedding_exclude_overlap=exclude_overlap,
        plda=_unused_plda(),
        clustering="AgglomerativeClustering",
        embedding_batch_size=batch_size,
        segmentation_batch_size=batch_size,
    )
    return pipeline.instantiate(AGGLOMERATIVE_PARAMETERS)


def sample_path() -> Path:
    """pyannote.audio's bundled `sample/sample.wav` (30 s, 16 kHz mono, two speakers)."""
    import pyannote.audio

    return Path(pyannote.audio.__file__).parent / "sample" / "sample.wav"


def in_memory(samples: np.ndarray, sample_rate: int, uri: str) -> dict[str, Any]:
    """An `AudioFile` holding its waveform: samples [N] or [N, C] -> {"waveform": (C, N)}.
    Pipelines then need no audio decoder (pyannote 4 decodes files with torchcodec)."""
    frames = np.asarray(samples, dtype=np.float32)
    frames = frames[:, None] if frames.ndim == 1 else frames
    return {
        "waveform": torch.from_numpy(np.ascontiguousarray(frames.T)),
        "sample_rate": sample_rate,
        "uri": uri,
    }
