"""`remote_pipeline(target)`: a pyannote.audio diarization pipeline whose models run on a
speakerd server, built without loading a single weight.

pyannote's `SpeakerDiarization` needs model objects to exist, for what it reads of them
(the segmentation model's specifications and receptive field, the embedding's dimension),
not for their weights once `use_server(segmentation=True)` gives it both the segmentation
and the embeddings of each file from one server call. So the pipeline is built here on
pyannote's own PyanNet (segmentation-3.0's architecture and task specifications) and
WeSpeakerResNet34 modules as constructed, untrained and never run, with the clustering of
pyannote/speaker-diarization-3.1: nothing is downloaded or read from disk, no GPU is needed,
and the diarization equals pyannote's own pipeline with the server's weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pyannote.audio.core.task import Problem, Resolution, Specifications
from pyannote.audio.models.embedding import WeSpeakerResNet34
from pyannote.audio.models.segmentation import PyanNet
from pyannote.audio.pipelines import SpeakerDiarization

from speakerd.client import RetryPolicy
from speakerd.model.architecture import MAX_SPEAKERS
from speakerd.pyannote.models import DEFAULT_BATCH_SIZE, diarization_pipeline
from speakerd.pyannote.server import DEFAULT_TIMEOUT_S, WINDOW_S, use_server

#: pyannote/segmentation-3.0's model hyper-parameters (its config.yaml): SincNet of stride
#: 10, a monolithic 4-layer bidirectional LSTM of 128, two linear layers of 128.
SEGMENTATION_3_0 = {
    "sincnet": {"stride": 10},
    "lstm": {"hidden_size": 128, "num_layers": 4, "bidirectional": True, "monolithic": True},
    "linear": {"hidden_size": 128, "num_layers": 2},
}
#: At most 2 of the 3 local speakers at once: segmentation-3.0's powerset of 7 classes.
MAX_SPEAKERS_PER_FRAME = 2


def weightless_segmentation() -> PyanNet:
    """segmentation-3.0's PyanNet with its task specifications (what pyannote reads from the
    checkpoint's metadata) and the untrained weights it is constructed with."""
    model = PyanNet(**SEGMENTATION_3_0)
    model.specifications = Specifications(
        problem=Problem.MONO_LABEL_CLASSIFICATION,
        resolution=Resolution.FRAME,
        duration=WINDOW_S,
        min_duration=None,
        warm_up=(0.0, 0.0),
        classes=[f"speaker#{i + 1}" for i in range(MAX_SPEAKERS)],
        powerset_max_classes=MAX_SPEAKERS_PER_FRAME,
        permutation_invariant=True,
    )
    model.setup()  # the task-dependent layers (the classifier), as loading a checkpoint does
    return model.eval()


def remote_pipeline(
    target: str,
    *,
    exclude_overlap: bool = False,
    batch_size: int = DEFAULT_BATCH_SIZE,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    retry: RetryPolicy | None = None,
    tls_ca: str | Path | None = None,
    tls_cert: str | Path | None = None,
    tls_key: str | Path | None = None,
    token: str | None = None,
) -> SpeakerDiarization:
    """A `SpeakerDiarization` (AgglomerativeClustering, speaker-diarization-3.1's parameters)
    whose segmentation and embeddings come from the speakerd server at `target`, one call per
    file; the client holds no weights (module doc). `exclude_overlap` is pyannote's
    `embedding_exclude_overlap`; the rest are use_server's options."""
    pipeline = diarization_pipeline(
        weightless_segmentation(), WeSpeakerResNet34().eval(), exclude_overlap, batch_size
    )
    options: dict[str, Any] = {"tls_ca": tls_ca, "tls_cert": tls_cert, "tls_key": tls_key, "token": token}
    return use_server(
        pipeline, target, segmentation=True, verify=False, timeout_s=timeout_s, retry=retry, **options
    )
