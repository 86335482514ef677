"""Names for a diarization's speakers: its per-speaker embeddings against the voiceprints
enrolled on a speakerd server (docs/voiceprints.md).

    output = pipeline(file)                       # pyannote.audio 4: a DiarizeOutput
    named = speakerd.pyannote.name_speakers(output, VoiceprintClient(target, token=...))
    named.speaker_diarization                      # labels are enrolled names where found

pyannote's pipeline already returns one embedding per speaker label (`speaker_embeddings`,
the clusters' centroids, in `speaker_diarization.labels()` order): those rows go to
`Identify` as they are, in one call, so the audio is never embedded a second time. The rows
must come from the model that made the voiceprints: a pipeline running on the same server
(`use_server`) guarantees it; the server compares only voiceprints of its own weights.

A label whose best score is under the threshold keeps its label. A speaker pyannote found
no centroid for (its row is zeros) is never sent.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from speakerd.client.voiceprints import VoiceprintClient


@dataclass(frozen=True)
class SpeakerName:
    """What Identify said of one label: the enrolled name (None: unknown) and its score."""

    label: str
    speaker_id: str | None
    score: float | None
    voiceprint_id: str | None


def identify_speakers(
    labels: list[Any], embeddings: np.ndarray, client: VoiceprintClient, threshold: float | None = None
) -> list[SpeakerName]:
    """One SpeakerName per label, for `embeddings` [len(labels), D] in the labels' order."""
    embeddings = np.asarray(embeddings, np.float32)
    if embeddings.shape[0] != len(labels):
        raise ValueError(
            f"embeddings: {embeddings.shape[0]} rows for {len(labels)} labels, expected one each"
        )
    present = [i for i, row in enumerate(embeddings) if np.isfinite(row).all() and np.any(row != 0)]
    names = [SpeakerName(str(label), None, None, None) for label in labels]
    if not present:
        return names
    found = client.identify(embeddings=embeddings[present], threshold=threshold)
    for i, row in zip(present, found.rows, strict=True):
        best = row.matches[0] if row.matches else None
        names[i] = SpeakerName(
            str(labels[i]),
            None if row.unknown else row.speaker_id,
            None if best is None else best.score,
            None if best is None else best.voiceprint_id,
        )
    return names


def name_speakers(output: Any, client: VoiceprintClient, threshold: float | None = None) -> Any:
    """A copy of a pyannote.audio 4 DiarizeOutput whose diarizations carry enrolled names
    instead of the labels identified (unknown ones keep theirs). ValueError when the output
    has no speaker_embeddings (an oracle clustering computes none)."""
    if output.speaker_embeddings is None:
        raise ValueError("output.speaker_embeddings is None: the pipeline computed no per-speaker embeddings")
    labels = list(output.speaker_diarization.labels())
    mapping = {name.label: name.speaker_id for name in identify_speakers(labels, output.speaker_embeddings,
                                                                         client, threshold)}  # fmt: skip
    rename = {label: mapping[str(label)] for label in labels if mapping[str(label)] is not None}
    return dataclasses.replace(
        output,
        speaker_diarization=output.speaker_diarization.rename_labels(mapping=rename),
        exclusive_speaker_diarization=output.exclusive_speaker_diarization.rename_labels(mapping=rename),
    )
