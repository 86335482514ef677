"""Every voiceprint in memory, one matrix per (tenant, model): an exact cosine search by
matrix product (NumPy on the CPU; BLAS uses every core).

The search is exact: all of a tenant's voiceprints are scored for every query row, so
its cost is the brute-force floor (bench_voiceprints.py measures it: a 100,000 x 256
matrix is 100 MB, read once per batch of queries). The GPU engine's server searches on
the CPU too: the matrix stays in host memory, and one batch of 1,000 queries costs a
fraction of what embedding their audio did.

A deleted voiceprint's row is overwritten (by the last row, then zeroed), so its vector
does not linger in the process's memory.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from speakerd.model.architecture import EMBEDDING_DIM
from speakerd.serving.voiceprints.records import VoiceprintRecord

#: Rows a matrix grows by at least: amortises the copy when enrolling one at a time.
MIN_CAPACITY = 64


@dataclass
class _Matrix:
    """The voiceprints of one tenant and model: rows [0, size) of `vectors` are in use."""

    vectors: np.ndarray = field(default_factory=lambda: np.zeros((0, EMBEDDING_DIM), np.float32))
    ids: list[str] = field(default_factory=list)
    speakers: list[str] = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.ids)

    def add(self, record: VoiceprintRecord) -> None:
        if self.size == self.vectors.shape[0]:
            grown = np.zeros((max(MIN_CAPACITY, 2 * self.size), self.vectors.shape[1]), np.float32)
            grown[: self.size] = self.vectors[: self.size]
            self.vectors[:] = 0  # the old buffer holds every vector: wipe it before letting it go
            self.vectors = grown
        self.vectors[self.size] = record.vector
        self.ids.append(record.voiceprint_id)
        self.speakers.append(record.speaker_id)

    def remove(self, row: int) -> None:
        last = self.size - 1
        self.vectors[row] = self.vectors[last]
        self.vectors[last] = 0
        self.ids[row], self.speakers[row] = self.ids[last], self.speakers[last]
        self.ids.pop()
        self.speakers.pop()


@dataclass(frozen=True)
class Matches:
    """Top-k per query row, best first: ids, speaker ids and cosine scores."""

    ids: list[list[str]]
    speakers: list[list[str]]
    scores: np.ndarray  # [m, k'] float32, k' = min(k, voiceprints)
    other_model: int  # the tenant's voiceprints of other models, not compared


class VoiceprintIndex:
    """Thread-safe: the service searches from worker threads while the PostgreSQL listener
    applies other replicas' writes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._matrices: dict[tuple[str, str], _Matrix] = {}
        self._where: dict[str, tuple[str, str]] = {}  # voiceprint_id -> its matrix key

    def reset(self, records: list[VoiceprintRecord]) -> None:
        """Replace everything with `records` (start-up, or a listener that missed changes)."""
        with self._lock:
            for matrix in self._matrices.values():
                matrix.vectors[:] = 0
            self._matrices.clear()
            self._where.clear()
            for record in records:
                self._add(record)

    def add(self, record: VoiceprintRecord) -> None:
        with self._lock:
            self._remove(record.voiceprint_id)  # a repeated notification: no second row
            self._add(record)

    def remove(self, voiceprint_id: str) -> None:
        with self._lock:
            self._remove(voiceprint_id)

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, voiceprint_id: str) -> bool:
        return voiceprint_id in self._where

    def _add(self, record: VoiceprintRecord) -> None:
        key = (record.tenant, record.model_id)
        self._matrices.setdefault(key, _Matrix()).add(record)
        self._where[record.voiceprint_id] = key

    def _remove(self, voiceprint_id: str) -> None:
        key = self._where.pop(voiceprint_id, None)
        if key is None:
            return
        matrix = self._matrices[key]
        matrix.remove(matrix.ids.index(voiceprint_id))
        if matrix.size == 0:
            del self._matrices[key]

    def search(self, tenant: str, model_id: str, queries: np.ndarray, k: int) -> Matches:
        """The k best of the tenant's voiceprints of `model_id` for each unit row of
        `queries` [m, D], by cosine (a dot product of unit vectors)."""
        with self._lock:
            other = sum(
                m.size for (t, model), m in self._matrices.items() if t == tenant and model != model_id
            )
            matrix = self._matrices.get((tenant, model_id))
            if matrix is None or len(queries) == 0:
                empty = [[] for _ in range(len(queries))]
                return Matches(empty, [[] for _ in range(len(queries))], np.zeros((len(queries), 0)), other)
            scores = queries.astype(np.float32, copy=False) @ matrix.vectors[: matrix.size].T
            # a cosine: float32 rounding of unit vectors' dot product can pass 1 by an ulp
            # (1.000000238 for a voiceprint's own audio); the contract says [-1, 1]
            np.clip(scores, -1.0, 1.0, out=scores)
            top = top_k(scores, k)
            return Matches(
                [[matrix.ids[j] for j in row] for row in top],
                [[matrix.speakers[j] for j in row] for row in top],
                np.take_along_axis(scores, top, axis=1),
                other,
            )


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """[m, N] -> [m, min(k, N)] column indices of each row's largest scores, best first."""
    k = min(k, scores.shape[1])
    if (
        k < scores.shape[1]
    ):  # the k largest, partitioned in place of a negated copy (400 MB at 1,000 x 100,000)
        part = np.argpartition(scores, scores.shape[1] - k, axis=1)[:, -k:]
    else:
        part = np.broadcast_to(np.arange(scores.shape[1]), scores.shape).copy()
    order = np.argsort(-np.take_along_axis(scores, part, axis=1), axis=1, kind="stable")
    return np.take_along_axis(part, order, axis=1)
