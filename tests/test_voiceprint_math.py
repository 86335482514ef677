"""A voiceprint's math (speakerd.model.voiceprint, docs/voiceprints.md) and the in-memory
index's exact search."""

from __future__ import annotations

import numpy as np
import pytest

from speakerd.model.inputs import InputError
from speakerd.model.voiceprint import (
    check_threshold,
    normalize,
    pool,
    segment_masks,
    speech_seconds,
)
from speakerd.serving.voiceprints.index import VoiceprintIndex, top_k
from speakerd.serving.voiceprints.records import VoiceprintRecord


def unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v, axis=-1, keepdims=True)


def test_pool_is_the_unit_speech_weighted_mean_of_unit_rows() -> None:
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((4, 256)).astype(np.float32) * np.array([[1], [10], [0.1], [5]], np.float32)
    active = np.array([125, 25, 0, 50])  # the third window has no speech: left out
    pooled = pool(rows, active)
    assert pooled is not None and pooled.windows == 3
    expected = unit(125 * unit(rows[0]) + 25 * unit(rows[1]) + 50 * unit(rows[3]))
    np.testing.assert_allclose(pooled.vector, expected, atol=1e-6)
    used = unit(rows[[0, 1, 3]])
    assert pooled.quality == pytest.approx(float(np.mean(used @ expected)), abs=1e-6)


def test_a_row_scaled_by_any_gain_pools_the_same() -> None:
    row = np.random.default_rng(1).standard_normal((1, 256)).astype(np.float32)
    a, b = pool(row, np.array([125])), pool(1000 * row, np.array([125]))
    assert a is not None and b is not None
    np.testing.assert_allclose(a.vector, b.vector, atol=1e-6)
    assert a.quality == pytest.approx(1.0)


def test_no_speech_pools_to_nothing() -> None:
    assert pool(np.ones((3, 256), np.float32), np.zeros(3)) is None


def test_normalize_refuses_zero_and_nonfinite_rows() -> None:
    with pytest.raises(InputError, match="row 1 has zero length"):
        normalize(np.array([[1.0, 0.0], [0.0, 0.0]]))
    with pytest.raises(InputError, match="non-finite"):
        normalize(np.array([[np.nan, 1.0]]))


def test_speech_seconds_count_each_moment_once_across_overlapping_windows() -> None:
    # 3 windows every second, 100 frames of 0.1 s each: all speech -> 12 s of audio, counted once
    masks = np.ones((3, 100), np.float32)
    assert speech_seconds(masks, step_s=1.0, duration_s=12.0) == pytest.approx(12.0)
    # clipped to the audio: the last window's padding past 11.5 s is not speech
    assert speech_seconds(masks, step_s=1.0, duration_s=11.5) == pytest.approx(11.5)
    # soft masks count where they reach 0.5, as pyannote binarises them
    soft = np.zeros((1, 100), np.float32)
    soft[0, :30] = 0.6
    soft[0, 30:] = 0.4
    assert speech_seconds(soft, step_s=1.0, duration_s=10.0) == pytest.approx(3.0)


def test_segments_become_masks_and_back_into_the_same_seconds() -> None:
    masks = segment_masks([(0.5, 2.5), (12.0, 14.0)], windows=6, step_s=1.0, frames=589)
    assert masks.shape == (6, 1, 589) and masks.dtype == np.uint8
    assert speech_seconds(masks[:, 0], step_s=1.0, duration_s=15.0) == pytest.approx(4.0, abs=0.03)


@pytest.mark.parametrize("threshold", [-1.01, 1.01, float("nan"), float("inf")])
def test_a_threshold_must_be_a_cosine(threshold: float) -> None:
    with pytest.raises(InputError, match=r"threshold: .* expected a cosine similarity in \[-1, 1\]"):
        check_threshold(threshold)
    assert check_threshold(-1.0) == -1.0 and check_threshold(1.0) == 1.0


def test_top_k_is_the_k_best_best_first() -> None:
    scores = np.array([[0.1, 0.9, 0.5, 0.7], [0.4, 0.3, 0.2, 0.1]], np.float32)
    assert top_k(scores, 2).tolist() == [[1, 3], [0, 1]]
    assert top_k(scores, 10).tolist() == [[1, 3, 2, 0], [0, 1, 2, 3]]


def record(tenant: str, speaker: str, vector: np.ndarray, model: str = "m") -> VoiceprintRecord:
    return VoiceprintRecord.new(tenant, speaker, model, unit(vector.astype(np.float32)), 10.0, 1.0, 3)


def test_the_index_search_is_exact_per_tenant_and_model() -> None:
    rng = np.random.default_rng(2)
    vectors = unit(rng.standard_normal((300, 256)).astype(np.float32))
    index = VoiceprintIndex()
    records = [record("a", f"s{i}", v) for i, v in enumerate(vectors)]
    index.reset(records)
    index.add(record("b", "theirs", vectors[0]))  # another tenant: never a match for a
    index.add(record("a", "old", vectors[0], model="other"))  # other weights: counted, not compared
    queries = unit(rng.standard_normal((7, 256)).astype(np.float32))
    found = index.search("a", "m", queries, 3)
    exact = np.argsort(-(queries @ vectors.T), axis=1)[:, :3]
    assert found.ids == [[records[j].voiceprint_id for j in row] for row in exact]
    np.testing.assert_allclose(found.scores, np.take_along_axis(queries @ vectors.T, exact, 1), rtol=1e-5)
    assert found.other_model == 1


def test_removing_a_voiceprint_wipes_its_row() -> None:
    index = VoiceprintIndex()
    rng = np.random.default_rng(3)
    kept, gone = record("a", "kept", rng.standard_normal(256)), record("a", "gone", rng.standard_normal(256))
    index.reset([gone, kept])
    index.remove(gone.voiceprint_id)
    matrix = index._matrices[("a", "m")]
    assert matrix.ids == [kept.voiceprint_id]
    assert not np.isin(gone.vector, matrix.vectors).all()  # nowhere in the buffer, used or spare
    assert gone.vector.tobytes() not in matrix.vectors.tobytes()
    index.remove(kept.voiceprint_id)
    assert len(index) == 0 and index.search("a", "m", np.ones((1, 256), np.float32), 1).ids == [[]]


def test_scores_are_cosines_within_minus_one_and_one() -> None:
    # unit float32 vectors whose own dot product rounds above 1 (1.000000238 was seen for a
    # voiceprint's own audio): the index answers 1.0, never more
    rng = np.random.default_rng(0)
    records = [record("a", f"s{i}", v) for i, v in enumerate(rng.standard_normal((200, 256)))]
    over = [r for r in records if np.float32(r.vector @ r.vector) > 1]
    assert over, "no vector whose float32 self-product passes 1: pick another seed"
    index = VoiceprintIndex()
    index.add(over[0])
    found = index.search("a", "m", over[0].vector[None], k=1)
    assert found.scores.tolist() == [[1.0]], found.scores
    index.add(record("a", "opposite", -over[0].vector))
    assert float(index.search("a", "m", -over[0].vector[None], k=2).scores.min()) >= -1.0
