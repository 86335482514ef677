"""`speakerd.pyannote.diarize(target, file)`: a whole diarization from one server call, as
pyannote's `DiarizeOutput`.

The server runs all of pyannote.audio 4.0.7's `SpeakerDiarization` (segmentation, embeddings,
speaker-diarization-3.1's clustering or, with `clustering="vbx"`, community-1's VBx,
reconstruction; docs/diarization.md), so the client
needs no pyannote model at all: this turns the call's answer into what
`pipeline(file)` returns, `DiarizeOutput(speaker_diarization, exclusive_speaker_diarization,
speaker_embeddings)`, with pyannote's `Annotation`s, for code that already consumes those.
A file is any `AudioFile` pyannote takes (a path, or `{"waveform", "sample_rate"}`), decoded
as pyannote decodes it (soundfile where pyannote cannot decode files).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

import numpy as np
from pyannote.audio.pipelines.speaker_diarization import DiarizeOutput
from pyannote.core import Annotation, Segment

from speakerd.client.diarize import Diarization, DiarizationClient, Turn
from speakerd.pyannote.audio_files import read_into
from speakerd.pyannote.server import DEFAULT_TIMEOUT_S, file_samples


def annotation(turns: list[Turn], uri: str) -> Annotation:
    """Turns -> a pyannote Annotation (one track per turn)."""
    result = Annotation(uri=uri)
    for track, turn in enumerate(turns):
        result[Segment(turn.start_s, turn.end_s), track] = turn.label
    return result


def diarize_output(result: Diarization, uri: str) -> DiarizeOutput:
    """Diarize's answer as pyannote's DiarizeOutput: speaker embeddings (the centroids) in
    the order of speaker_diarization.labels(), as pyannote sorts them."""
    diarization = annotation(result.turns, uri)
    centroids = {speaker.label: speaker.centroid for speaker in result.speakers}
    labels = diarization.labels()
    embeddings = (
        np.stack([centroids[label] for label in labels]) if labels else np.zeros((0, 256), np.float32)
    )
    return DiarizeOutput(
        speaker_diarization=diarization,
        exclusive_speaker_diarization=annotation(result.exclusive_turns, uri),
        speaker_embeddings=embeddings,
    )


def diarize(
    target: str,
    file: str | Path | Mapping[str, Any],
    *,
    client: DiarizationClient | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    **options: Any,
) -> DiarizeOutput:
    """Diarize `file` on the speakerd server at `target`; `options` are
    DiarizationClient.diarize's (num_speakers, min_speakers, max_speakers, names, threshold,
    exclude_overlap, clustering "agglomerative" or "vbx", clustering_threshold, fa, fb...).
    Give `client` to reuse one channel for many files."""
    given: MutableMapping[str, Any] = {"audio": file} if isinstance(file, str | Path) else dict(file)
    uri = str(given.get("uri") or (Path(given["audio"]).stem if "audio" in given else "recording"))
    read_into(given)
    samples, sample_rate = file_samples(given)
    own = client is None
    client = client or DiarizationClient(target, timeout_s=timeout_s)
    try:
        result = client.diarize(samples, sample_rate, uri=uri, timeout_s=timeout_s, **options)
    finally:
        if own:
            client.close()
    return diarize_output(result, uri)
