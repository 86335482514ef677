"""speakerd for pyannote.audio: a diarization pipeline's embeddings computed by a server.

    import speakerd.pyannote
    pipeline = speakerd.pyannote.use_server(pipeline, "speakerd.example:50051")
    # or segmentation and embeddings both on the server, no weights in this process:
    pipeline = speakerd.pyannote.remote_pipeline("speakerd.example:50051")
    # or the whole diarization on the server, one call, pyannote's DiarizeOutput back:
    output = speakerd.pyannote.diarize("speakerd.example:50051", "meeting.wav")

The optional extra `speakerd[pyannote]` (pyannote.audio >= 4.0, with torch). This package may
import speakerd.client, speakerd.v1, speakerd.model, pyannote and torch, never the server's
packages (an import-linter contract in pyproject.toml). docs/pyannote.md tells the details.
"""

from speakerd.pyannote.diarization import diarize
from speakerd.pyannote.remote import remote_pipeline
from speakerd.pyannote.server import (
    ModelMismatchError,
    ServerEmbeddings,
    ServerRequestError,
    ServerUnavailableError,
    SpeakerdError,
    SpeakerdFallbackWarning,
    use_server,
)
from speakerd.pyannote.voiceprints import SpeakerName, identify_speakers, name_speakers

__all__ = [
    "ModelMismatchError",
    "ServerEmbeddings",
    "ServerRequestError",
    "ServerUnavailableError",
    "SpeakerName",
    "SpeakerdError",
    "SpeakerdFallbackWarning",
    "diarize",
    "identify_speakers",
    "name_speakers",
    "remote_pipeline",
    "use_server",
]
