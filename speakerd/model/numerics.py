"""The numbers every layer agrees on: which arithmetic a trunk uses, how close an engine's
embeddings must be to the FP32 reference for that arithmetic, and pyannote's mask arithmetic.

Kept in `speakerd.model` (NumPy only) so that the thin client's `verify`, the server's
self-check and the tests judge parity with one `compare` and one table of bounds.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from speakerd.model.architecture import MAX_SPEAKERS, TRUNK_FRAMES


class Math(enum.StrEnum):
    """What arithmetic the trunk's convolutions use; pooling and linear stay FP32 where noted."""

    # FP32-accurate everywhere: IEEE FP32 FMA (cuDNN without tensor-core engines) or our
    # 3xTF32 tensor-core kernel (FP32-level error, checked against cuDNN and float64)
    FP32 = "fp32"
    TF32 = "tf32"  # FP32 storage, TF32 tensor-core convolutions, FP32 accumulate
    FP16 = "fp16"  # FP16 storage/tensor cores, FP32 accumulate, FP32 pooling and linear


def resize_masks(masks: np.ndarray, frames: int = TRUNK_FRAMES) -> np.ndarray:
    """pyannote's nearest resize of F mask frames onto the trunk's 125 frames.

    w[t] = mask[floor(t * F / 125)], computed in integers so it is exact for every F.
    """
    source = masks.shape[-1]
    index = (np.arange(frames, dtype=np.int64) * source) // frames
    return np.ascontiguousarray(masks[..., index], dtype=np.float32)


def active_frames(masks: np.ndarray) -> np.ndarray:
    """[n, s, F] -> [n, s] int32: trunk frames (of 125) whose resized weight is non-zero.

    Zero means the embedding is seg_1.bias alone: the service flags such a row as empty.
    """
    return np.count_nonzero(resize_masks(masks) != 0, axis=-1).astype(np.int32)


def pad_speakers(masks: np.ndarray) -> np.ndarray:
    """[n, s, F] -> [n, 3, F] with all-zero masks for the absent speakers."""
    n, s, frames = masks.shape
    if s == MAX_SPEAKERS:
        return masks
    out = np.zeros((n, MAX_SPEAKERS, frames), dtype=np.float32)
    out[:, :s] = masks
    return out


@dataclass(frozen=True)
class Bound:
    """docs/parity.md: minimum per-row cosine vs the FP32 reference and max |diff| / max |reference|."""

    min_cosine: float
    max_relative_abs: float


#: docs/parity.md's table, by the math the engine's trunk uses.
BOUNDS: dict[Math, Bound] = {
    Math.FP32: Bound(0.99999, 1e-4),
    Math.TF32: Bound(0.999, 1e-1),
    Math.FP16: Bound(0.999, 1e-1),
}


@dataclass(frozen=True)
class Parity:
    """How far rows [rows, d] are from their reference rows."""

    rows: int
    min_cosine: float
    max_abs: float
    max_relative_abs: float  # max_abs / max |reference|

    def within(self, bound: Bound) -> bool:
        return self.min_cosine >= bound.min_cosine and self.max_relative_abs < bound.max_relative_abs


def compare(actual: np.ndarray, reference: np.ndarray) -> Parity:
    """Per-row cosine and max abs difference of [..., d] arrays (rows flattened), in float64.

    Two all-zero rows count as cosine 1 (equal); one zero row against a non-zero one as 0.
    """
    a = np.asarray(actual, dtype=np.float64).reshape(-1, reference.shape[-1])
    b = np.asarray(reference, dtype=np.float64).reshape(-1, reference.shape[-1])
    if a.shape != b.shape:
        raise ValueError(f"shape {a.shape} vs reference {b.shape}")
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    dots = np.sum(a * b, axis=1)
    both_zero = (np.linalg.norm(a, axis=1) == 0) & (np.linalg.norm(b, axis=1) == 0)
    cosine = np.where(both_zero, 1.0, dots / np.where(norms > 0, norms, 1.0))
    if not np.all(np.isfinite(a)):
        cosine = np.where(np.all(np.isfinite(a), axis=1), cosine, -1.0)
    max_abs = float(np.max(np.abs(a - b))) if a.size else 0.0
    scale = float(np.max(np.abs(b))) if b.size else 0.0
    relative = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
    return Parity(int(a.shape[0]), float(np.min(cosine)) if a.size else 1.0, max_abs, relative)
