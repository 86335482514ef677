"""The batch queue's state machine (speakerd.serving.batching.queue), driven synchronously: no
engine, no event loop, the clock passed in by hand."""

from __future__ import annotations

import random

import pytest

from speakerd.model.architecture import TRUNK_FRAMES
from speakerd.serving.batching.queue import (
    BatcherError,
    Cancelled,
    DeadlinePassed,
    Draining,
    EngineFailed,
    QueueFull,
    QueueState,
)
from speakerd.serving.observability.metrics import REJECT_REASONS

#: pyannote segmentation-3.0's mask frames, the usual F
F = 589


def _taken(state: QueueState, now: float = 0.0) -> list[list[tuple[int, int, int]]]:
    """Every batch until the queue is empty, as (job, start, stop) pieces."""
    batches = []
    while (batch := state.next_batch(now)[0]) is not None:
        batches.append([(piece.job, piece.start, piece.stop) for piece in batch.pieces])
    return batches


def test_admit_counts_chunks_and_refuses_what_cannot_be_queued() -> None:
    state = QueueState(capacity_chunks=10, max_batch=4)
    first, second = state.admit(3, F, now=0.0), state.admit(5, F, now=0.0)
    assert first != second
    assert state.queued_chunks == 8 and state.order() == [first, second], (state.queued_chunks, state.order())
    with pytest.raises(QueueFull, match="queue holds 8 of 10 chunks; 3 more do not fit"):
        state.admit(3, F, now=0.0)
    with pytest.raises(DeadlinePassed, match="before the request was queued"):
        state.admit(1, F, now=5.0, deadline=5.0)
    with pytest.raises(ValueError, match="11 chunks exceed the queue's 10"):
        state.admit(11, F, now=0.0)
    with pytest.raises(ValueError, match="chunks: 0"):
        state.admit(0, F, now=0.0)
    assert state.queued_chunks == 8, "a refused request must not be counted"
    state.close()
    with pytest.raises(Draining):
        state.admit(1, F, now=0.0)
    with pytest.raises(ValueError, match="queue of 3 chunks cannot hold one batch of 4"):
        QueueState(capacity_chunks=3, max_batch=4)


def test_batches_take_chunks_in_arrival_order_and_split_a_large_request() -> None:
    state = QueueState(capacity_chunks=64, max_batch=4)
    a, b, c = state.admit(3, F, 0.0), state.admit(6, F, 0.0), state.admit(1, F, 0.0)
    batch, removals = state.next_batch(now=0.5)
    assert removals == []
    assert batch is not None
    assert [(p.job, p.start, p.stop, p.offset) for p in batch.pieces] == [(a, 0, 3, 0), (b, 0, 1, 3)], batch
    assert batch.started == ((a, 0.5), (b, 0.5)), batch.started
    assert state.queued_chunks == 10 - 4, state.queued_chunks
    # b was split: its remaining 5 chunks queue behind c, which arrived while b waited
    assert state.order() == [c, b], state.order()
    assert _taken(state) == [[(c, 0, 1), (b, 1, 4)], [(b, 4, 6)]]
    assert state.queued_chunks == 0 and len(state) == 0


def test_a_small_request_is_not_starved_by_a_large_one_that_started_first() -> None:
    """A 60-chunk request has had a batch; a 1-chunk one arriving then waits for one more
    turn of the large one (the batch after) and rides in the one after that, not after all
    56 remaining chunks (arrival order would put it in batch 16)."""
    state = QueueState(capacity_chunks=64, max_batch=4)
    large = state.admit(60, F, 0.0)
    state.next_batch(0.0)
    small = state.admit(1, F, 0.1)
    batches = _taken(state, 0.1)
    assert batches[0] == [(large, 4, 8)], batches[0]
    assert batches[1] == [(small, 0, 1), (large, 8, 11)], batches[1]
    assert sum(stop - start for batch in batches for job, start, stop in batch if job == large) == 56


@pytest.mark.parametrize("seed", range(20))
def test_every_request_enters_one_of_the_next_jobs_ahead_plus_one_batches(seed: int) -> None:
    """The fairness bound of the module docstring, over random arrivals and sizes: a job
    with J jobs ahead of it on arrival is in one of the next J + 1 batches; and every chunk
    of every job is taken exactly once, in order."""
    rng = random.Random(seed)
    state = QueueState(capacity_chunks=128, max_batch=8)
    limit: dict[int, int] = {}  # job -> last batch index allowed
    covered: dict[int, int] = {}  # job -> chunks taken so far
    sizes: dict[int, int] = {}
    formed = 0
    for _ in range(300):
        if rng.random() < 0.5 and state.queued_chunks < 100:
            size = rng.choice([1, 2, 3, 8, 20])
            job = state.admit(size, F, 0.0)
            limit[job] = formed + len(state) - 1  # J = len - 1 jobs ahead: batches formed .. formed + J
            sizes[job], covered[job] = size, 0
        batch = state.next_batch(0.0)[0]
        if batch is None:
            continue
        for piece in batch.pieces:
            assert piece.start == covered[piece.job], f"job {piece.job} resumed at {piece.start}"
            if piece.start == 0:
                assert formed <= limit[piece.job], (
                    f"job {piece.job}: batch {formed} > bound {limit[piece.job]}"
                )
            covered[piece.job] = piece.stop
        assert batch.chunks <= 8 and (batch.chunks == 8 or state.queued_chunks == 0), batch
        formed += 1
        waiting = sum(sizes[job] - covered[job] for job in state.order())
        assert state.queued_chunks == waiting, (state.queued_chunks, waiting)
    _taken(state)


def test_cancel_removes_a_job_anywhere_in_the_queue_and_uncounts_it() -> None:
    state = QueueState(capacity_chunks=16, max_batch=4)
    jobs = [state.admit(2, F, 0.0) for _ in range(5)]
    removal = state.cancel(jobs[2])  # in the middle: the removal that used to raise ValueError
    assert removal is not None and removal.chunks == 2 and isinstance(removal.error, Cancelled), removal
    assert removal.reason == "cancelled"
    assert state.queued_chunks == 8 and jobs[2] not in state, state.order()
    assert state.cancel(jobs[2]) is None, "a second cancel must find nothing"
    assert all(jobs[2] != job for batch in _taken(state) for job, _, _ in batch)


def test_cancel_of_a_split_job_uncounts_only_its_queued_rest() -> None:
    state = QueueState(capacity_chunks=16, max_batch=4)
    job = state.admit(10, F, 0.0)
    state.next_batch(0.0)
    removal = state.cancel(job)
    assert removal is not None and removal.chunks == 6, removal
    assert state.queued_chunks == 0 and len(state) == 0


def test_sixty_expired_one_chunk_requests_leave_the_queue_with_deadline_passed() -> None:
    """Issue 14: 60 one-chunk requests expired while queued kept 60 of 64 chunks counted,
    and every new call got RESOURCE_EXHAUSTED."""
    state = QueueState(capacity_chunks=64, max_batch=32)
    expiring = [state.admit(1, F, now=0.0, deadline=1.0) for _ in range(60)]
    keeper = state.admit(2, F, now=0.0, deadline=100.0)
    assert state.expire(now=0.999) == []
    removals = state.expire(now=1.0)
    assert [removal.job for removal in removals] == expiring
    assert all(isinstance(r.error, DeadlinePassed) and r.reason == "deadline_exceeded" for r in removals)
    assert "after 1.000 s in the queue" in str(removals[0].error), removals[0].error
    assert state.queued_chunks == 2 and state.order() == [keeper], (state.queued_chunks, state.order())
    state.admit(62, F, now=1.0)  # the queue has room again


def test_next_batch_drops_expired_jobs_before_taking_any_chunk() -> None:
    state = QueueState(capacity_chunks=16, max_batch=4)
    late = state.admit(2, F, now=0.0, deadline=0.5)
    on_time = state.admit(2, F, now=0.0, deadline=9.0)
    batch, removals = state.next_batch(now=0.5)
    assert [r.job for r in removals] == [late]
    assert batch is not None and batch.jobs == (on_time,), batch


def test_mixed_mask_frames_are_resized_to_the_trunk_frames() -> None:
    state = QueueState(capacity_chunks=16, max_batch=4)
    state.admit(2, 589, 0.0)
    state.admit(2, 589, 0.0)
    same = state.next_batch(0.0)[0]
    assert same is not None and (same.frames, same.resize) == (589, False), same
    state.admit(2, 589, 0.0)
    state.admit(2, 293, 0.0)
    mixed = state.next_batch(0.0)[0]
    assert mixed is not None and (mixed.frames, mixed.resize) == (TRUNK_FRAMES, True), mixed


def test_rows_map_a_plan_run_onto_its_requests_chunks() -> None:
    state = QueueState(capacity_chunks=64, max_batch=8)
    a, b, c = state.admit(3, F, 0.0), state.admit(2, F, 0.0), state.admit(9, F, 0.0)
    batch = state.next_batch(0.0)[0]
    assert batch is not None
    assert batch.rows(0, 8) == [(a, 0, 3), (b, 0, 2), (c, 0, 3)]
    assert batch.rows(2, 6) == [(a, 2, 3), (b, 0, 2), (c, 0, 1)]
    assert batch.rows(7, 8) == [(c, 2, 3)]
    with pytest.raises(ValueError, match=r"rows \[6, 9\) outside the batch's 8 rows"):
        batch.rows(6, 9)


def test_a_partial_batch_is_due_after_the_delay_a_full_or_draining_one_at_once() -> None:
    state = QueueState(capacity_chunks=16, max_batch=4)
    assert state.due_in(now=0.0, max_delay_s=0.002) is None
    state.admit(1, F, now=10.0)
    assert state.due_in(now=10.0005, max_delay_s=0.002) == pytest.approx(0.0015)
    assert state.due_in(now=10.003, max_delay_s=0.002) == 0.0
    state.admit(3, F, now=10.001)
    assert state.due_in(now=10.001, max_delay_s=0.002) == 0.0, "a full batch waits for nothing"
    state.next_batch(10.001)
    state.admit(1, F, now=20.0)
    state.close()
    assert state.due_in(now=20.0, max_delay_s=0.002) == 0.0, "while draining nothing more arrives"


def test_fail_all_empties_the_queue_with_draining() -> None:
    state = QueueState(capacity_chunks=16, max_batch=4)
    jobs = [state.admit(3, F, 0.0) for _ in range(3)]
    state.next_batch(0.0)
    state.close()
    removals = state.fail_all("the server stopped")
    assert [(r.job, r.chunks) for r in removals] == [(jobs[2], 3), (jobs[1], 2)], removals
    assert all(isinstance(r.error, Draining) and str(r.error) == "the server stopped" for r in removals)
    assert state.queued_chunks == 0 and len(state) == 0


def test_random_operations_keep_the_count_equal_to_the_live_queued_chunks() -> None:
    rng = random.Random(14)
    state = QueueState(capacity_chunks=64, max_batch=8)
    waiting: dict[int, int] = {}
    now = 0.0
    for step in range(2000):
        now += rng.random() * 0.01
        action = rng.random()
        if action < 0.45:
            size = rng.randint(1, 12)
            try:
                job = state.admit(size, rng.choice([589, 125]), now, now + rng.random() * 0.2)
            except QueueFull:
                assert state.queued_chunks + size > 64, (step, state.queued_chunks, size)
                continue
            waiting[job] = size
        elif action < 0.65 and waiting:
            job = rng.choice(list(waiting))
            removal = state.cancel(job)
            assert removal is not None and removal.chunks == waiting.pop(job), (step, removal)
        elif action < 0.75:
            for removal in state.expire(now):
                assert removal.chunks == waiting.pop(removal.job), (step, removal)
        else:
            batch, removals = state.next_batch(now)
            for removal in removals:
                assert removal.chunks == waiting.pop(removal.job), (step, removal)
            for piece in batch.pieces if batch else ():
                waiting[piece.job] -= piece.chunks
                if waiting[piece.job] == 0:
                    del waiting[piece.job]
        assert state.queued_chunks == sum(waiting.values()), (step, state.queued_chunks, waiting)
        assert sorted(state.order()) == sorted(waiting), (step, state.order(), waiting)


def test_every_error_names_a_rejection_reason_of_the_metric() -> None:
    for error in (QueueFull, DeadlinePassed, Draining, EngineFailed, Cancelled):
        assert issubclass(error, BatcherError)
        assert error.reason in REJECT_REASONS, (error.__name__, error.reason, REJECT_REASONS)


def test_a_job_due_within_one_plan_run_leaves_before_the_next_batch() -> None:
    """Work that could not be answered before its deadline is not started: with `lead_s`
    (the shortest plan run) a job due sooner leaves with DeadlinePassed saying so."""
    state = QueueState(64, 8)
    soon, later = state.admit(1, F, 0.0, deadline=1.0), state.admit(1, F, 0.0, deadline=2.0)
    batch, removals = state.next_batch(0.9, lead_s=0.2)
    assert [removal.job for removal in removals] == [soon]
    assert isinstance(removals[0].error, DeadlinePassed)
    assert "0.100 s away, less than one plan run (0.200 s)" in str(removals[0].error)
    assert batch is not None and batch.jobs == (later,)


def test_a_batch_holds_jobs_bound_to_one_device_and_unbound_jobs_go_with_any() -> None:
    """`serve --devices`: a recording's windows lie on the GPU its audio went to, so its job
    is bound there; a batch never mixes two devices' jobs, and a job passed over keeps its
    place at the front for the next batch."""
    state = QueueState(capacity_chunks=64, max_batch=4)
    on_0 = state.admit(2, F, 0.0, device=0)
    on_1 = state.admit(3, F, 0.0, device=1)
    free = state.admit(1, F, 0.0)
    also_0 = state.admit(3, F, 0.0, device=0)
    first, _ = state.next_batch(0.0)
    assert first is not None and first.device == 0, first
    assert [(p.job, p.start, p.stop) for p in first.pieces] == [(on_0, 0, 2), (free, 0, 1), (also_0, 0, 1)]
    assert state.order() == [on_1, also_0], "device 1's job keeps the front; the split job queues behind"
    second, _ = state.next_batch(0.0)
    assert second is not None and second.device == 1
    assert [(p.job, p.start, p.stop) for p in second.pieces] == [(on_1, 0, 3)], second.pieces
    third, _ = state.next_batch(0.0)
    assert third is not None and third.device == 0
    assert [(p.job, p.start, p.stop) for p in third.pieces] == [(also_0, 1, 3)]
    assert state.next_batch(0.0)[0] is None and state.queued_chunks == 0


def test_unbound_jobs_batch_as_before_and_the_batch_names_no_device() -> None:
    state = QueueState(capacity_chunks=64, max_batch=4)
    jobs = [state.admit(n, F, 0.0) for n in (3, 2, 4)]
    batches = []
    while (batch := state.next_batch(0.0)[0]) is not None:
        assert batch.device is None, batch
        batches.append([(p.job, p.start, p.stop) for p in batch.pieces])
    a, b, c = jobs
    assert batches == [[(a, 0, 3), (b, 0, 1)], [(c, 0, 4)], [(b, 1, 2)]], batches


def test_device_bound_jobs_are_each_served_within_their_devices_turns() -> None:
    """Random arrivals over 3 devices and unbound jobs: every batch is of one device (or
    none), and every chunk is taken exactly once, in each job's own order."""
    rng = random.Random(54)
    state = QueueState(capacity_chunks=10_000, max_batch=8)
    bound: dict[int, int | None] = {}
    for _ in range(200):
        device = rng.choice([None, 0, 1, 2])
        bound[state.admit(rng.randint(1, 20), F, 0.0, device=device)] = device
    next_chunk = dict.fromkeys(bound, 0)
    while (batch := state.next_batch(0.0)[0]) is not None:
        devices = {bound[p.job] for p in batch.pieces} - {None}
        assert len(devices) <= 1 and batch.device == (devices.pop() if devices else None), batch
        assert batch.chunks <= 8
        for piece in batch.pieces:
            assert piece.start == next_chunk[piece.job], (piece, next_chunk[piece.job])
            next_chunk[piece.job] = piece.stop
    assert state.queued_chunks == 0 and len(state) == 0
