"""What a voiceprint store keeps: one row per enrolled speaker, the changes it reports, and
the store's errors. The backends (sqlite_store.py, postgres_store.py) import these from here,
not from store.py, which imports the backends to pick one."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import numpy as np

#: A write made elsewhere: ("put", voiceprint_id) or ("delete", voiceprint_id).
Change = tuple[str, str]
#: Vectors are stored as little-endian float32 bytes, the dtype the embeddings come in.
VECTOR_DTYPE = np.dtype("<f4")


@dataclass(frozen=True)
class VoiceprintRecord:
    """One voiceprint: its namespace, ids, unit vector and how it was made."""

    tenant: str
    voiceprint_id: str
    speaker_id: str
    model_id: str
    vector: np.ndarray  # [D] float32, unit length
    speech_s: float
    quality: float
    windows: int
    created_ms: int

    @classmethod
    def new(cls, tenant: str, speaker_id: str, model_id: str, vector: np.ndarray, speech_s: float,
            quality: float, windows: int) -> VoiceprintRecord:  # fmt: skip
        """A fresh record: a random id (nothing about the speaker in it) and the time now."""
        return cls(tenant, uuid.uuid4().hex, speaker_id, model_id, np.asarray(vector, VECTOR_DTYPE),
                   float(speech_s), float(quality), int(windows), int(time.time() * 1000))  # fmt: skip

    def vector_bytes(self) -> bytes:
        return np.asarray(self.vector, VECTOR_DTYPE).tobytes()


def vector_from_bytes(data: bytes) -> np.ndarray:
    return np.frombuffer(bytes(data), dtype=VECTOR_DTYPE).astype(np.float32)


class StoreError(Exception):
    """A store failure the service answers with its own code."""


class DuplicateSpeaker(StoreError):
    """The tenant already has a voiceprint for this speaker_id and replace was not asked."""

    def __init__(self, speaker_id: str, voiceprint_id: str) -> None:
        super().__init__(f"speaker_id {speaker_id!r} already has voiceprint {voiceprint_id}")
        self.speaker_id = speaker_id
        self.voiceprint_id = voiceprint_id


class StoreUnavailable(StoreError):
    """The database cannot be reached or failed mid-call; nothing was written (the
    transaction was rolled back), so the call can be retried."""


#: Stored columns, in the order `from_row` reads them (both backends use this order).
COLUMNS = ("tenant", "voiceprint_id", "speaker_id", "model_id", "vector", "speech_s", "quality", "windows",
           "created_ms")  # fmt: skip
SELECT_COLUMNS = ", ".join(COLUMNS)


def to_row(record: VoiceprintRecord) -> tuple[object, ...]:
    return (record.tenant, record.voiceprint_id, record.speaker_id, record.model_id, record.vector_bytes(),
            record.speech_s, record.quality, record.windows, record.created_ms)  # fmt: skip


def from_row(row: tuple[object, ...]) -> VoiceprintRecord:
    tenant, voiceprint_id, speaker_id, model_id, vector, speech_s, quality, windows, created_ms = row
    return VoiceprintRecord(str(tenant), str(voiceprint_id), str(speaker_id), str(model_id),
                            vector_from_bytes(vector), float(speech_s), float(quality), int(windows),
                            int(created_ms))  # fmt: skip
