"""The batcher's plan split: cheapest sequence of plan runs for a partial batch."""

from __future__ import annotations

import itertools

import pytest

from speakerd.serving.batcher import cheapest_pieces, plan_for

PLANS = (1, 8, 32)


def _cost(pieces: list[int], times: dict[int, float]) -> float:
    return sum(times[plan_for(piece, PLANS)] for piece in pieces)


@pytest.mark.parametrize(
    "times", [{1: 1.0, 8: 3.0, 32: 10.0}, {1: 0.3, 8: 2.9, 32: 9.0}, {1: 5.0, 8: 5.1, 32: 5.2}]
)
def test_split_is_optimal_and_covers_every_chunk(times: dict[int, float]) -> None:
    for chunks in range(1, 33):
        pieces = cheapest_pieces(chunks, PLANS, times)
        assert sum(pieces) == chunks, (chunks, pieces)
        best = min(
            _cost(list(split), times)
            for count in range(1, chunks + 1)
            for split in itertools.product(range(1, chunks + 1), repeat=count)
            if sum(split) == chunks
        ) if chunks <= 6 else None  # fmt: skip
        if best is not None:
            assert _cost(pieces, times) == pytest.approx(best), (chunks, pieces, best)


def test_three_b1_runs_beat_a_padded_b32_when_cheaper() -> None:
    assert cheapest_pieces(3, (1, 32), {1: 1.0, 32: 5.0}) == [1, 1, 1]
    assert cheapest_pieces(20, (1, 32), {1: 1.0, 32: 5.0}) == [20]


def test_without_measured_times_one_piece() -> None:
    assert cheapest_pieces(5, (1, 32), {}) == [5]
    with pytest.raises(ValueError, match="exceed the largest plan 32"):
        plan_for(33, (1, 32))
