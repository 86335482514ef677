"""Recordings are admitted by the memory they hold, first come first served, not by count.

The budget itself (speakerd/serving/memory/recording_budget.py) on the event loop: calls
that fit are admitted at once, the others wait in arrival order and are admitted as room
frees up; a cancelled wait leaves the queue and lets the calls behind it in; only a full
queue refuses at once. Then through a real CPU server: many callers at once all get their
rows (a bad one beside them gets INVALID_ARGUMENT, the good ones the rows they get alone,
bit for bit); a flood past the queue is refused promptly while the bytes held stay within
the budget; a window count that disagrees with `header.frames` costs no engine work.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from speakerd.client.client import RetryPolicy, SpeakerClient
from speakerd.client.recording import recording_requests
from speakerd.model.audio import speaker_masks, synthetic_recording
from speakerd.model.fbank import chunk_recording
from speakerd.serving.memory.recording_budget import QueueFull, RecordingBudget, TooLarge
from speakerd.v1 import speakerd_pb2_grpc as pb_grpc
from tests.serving import scrape, serve_module, start_server
from tests.test_bad_inputs import field_violations

pytestmark = pytest.mark.slow  # CPU servers and 32 recordings at once: seconds of 2 cores a test

#: b8 keeps a CPU batch near 1 s.
PLANS = "1,8"
TIMEOUT_S = 600.0
#: Callers at once: more than a connection's 32 streams would be another test.
CALLERS = 32
#: Room for about three of the callers' 10-11 s recordings at once (0.33-0.37 MB each with
#: float32 masks), so most of the callers wait for room rather than being admitted at once.
BUDGET_MB = 1
#: The callers' recordings: 10 s (one window, the cheapest the issue's 10-20 s allows), every
#: fourth one 11 s (two windows), so that calls of one and of several windows share batches.
SECONDS, LONGER_EVERY, LONGER_S = 10.0, 4, 11.0
#: The flood's recording: two windows, so that a served call holds its room while the rest
#: of the flood arrives.
FLOOD_S = 11.0
EMBEDDED = "speakerd_chunks_embedded_total{}"
HELD = "speakerd_recording_bytes_held{}"
#: A refusal for a full queue comes before any work: well within this on a loaded CI machine.
PROMPT_S = 10.0


# --- the budget on its own -----------------------------------------------------------------


def test_calls_that_do_not_fit_wait_in_arrival_order() -> None:
    async def scenario() -> list[str]:
        budget = RecordingBudget(limit_bytes=100, max_waiting=3)
        order: list[str] = []
        first = await budget.admit(60)
        order.append("first")

        async def call(name: str, size: int) -> None:
            reservation = await budget.admit(size)
            order.append(name)
            await asyncio.sleep(0.01)
            reservation.release()

        waiting = [asyncio.ensure_future(call(name, size)) for name, size in (("big", 70), ("small", 10))]
        await asyncio.sleep(0.01)
        assert budget.waiting == 2 and order == ["first"], (budget.waiting, order)  # small waits behind big
        first.release()
        await asyncio.gather(*waiting)
        assert budget.held_bytes == 0 and budget.holders == 0, (budget.held_bytes, budget.holders)
        return order

    assert asyncio.run(scenario()) == ["first", "big", "small"]


def test_a_full_queue_refuses_at_once_and_a_cancelled_wait_lets_others_in() -> None:
    async def scenario() -> None:
        budget = RecordingBudget(limit_bytes=100, max_waiting=2)
        holder = await budget.admit(100)
        blocked = asyncio.ensure_future(budget.admit(80))
        behind = asyncio.ensure_future(budget.admit(30))
        await asyncio.sleep(0)
        assert budget.waiting == 2
        with pytest.raises(QueueFull):
            await budget.admit(1)
        with pytest.raises(TooLarge):
            await budget.admit(101)
        blocked.cancel()  # a deadline passed or the client went away: it leaves the queue
        with pytest.raises(asyncio.CancelledError):
            await blocked
        assert budget.waiting == 1 and not behind.done()
        assert holder.grow(0) and not holder.grow(1)  # growing never waits
        holder.shrink(30)  # the holder needs less: the call behind fits now
        admitted = await behind
        assert (budget.held_bytes, budget.holders, budget.waiting) == (100, 2, 0), budget.held_bytes
        admitted.release()
        holder.release()
        holder.release()  # once only
        assert budget.held_bytes == 0 and budget.holders == 0

    asyncio.run(scenario())


# --- through a server --------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(weights_path):
    yield from serve_module(
        weights_path,
        "--plans",
        PLANS,
        "--recording-memory-mb",
        str(BUDGET_MB),
        "--recording-queue",
        str(CALLERS),
    )


def _recordings() -> list[tuple[np.ndarray, np.ndarray]]:
    """CALLERS recordings of SECONDS or LONGER_S, each with its masks."""
    out = []
    for index in range(CALLERS):
        seconds = LONGER_S if index % LONGER_EVERY == LONGER_EVERY - 1 else SECONDS
        recording = synthetic_recording(seconds, seed=100 + index)
        masks = speaker_masks(recording, chunk_recording(recording.samples).starts)
        out.append((recording.samples, masks))
    return out


def test_many_callers_at_once_all_get_their_rows(server) -> None:
    recordings = _recordings()
    with SpeakerClient(server.target, timeout_s=TIMEOUT_S) as client:
        alone = [client.embed_recording(samples, 16_000, masks) for samples, masks in recordings[:4]]

        def call(index: int):
            samples, masks = recordings[index]
            if index == 5:  # a bad recording among them: samples out of [-1, 1]
                samples = samples * np.float32(4)
            try:
                return client.embed_recording(samples, 16_000, masks)
            except grpc.RpcError as error:
                return error

        with ThreadPoolExecutor(CALLERS) as pool:
            results = list(pool.map(call, range(CALLERS)))
    bad = results[5]
    assert isinstance(bad, grpc.RpcError) and bad.code() == grpc.StatusCode.INVALID_ARGUMENT, bad
    assert [field for field, _ in field_violations(bad)] == ["audio"], field_violations(bad)
    failed = [(i, r.code()) for i, r in enumerate(results) if isinstance(r, grpc.RpcError) and i != 5]
    assert not failed, failed
    for index, expected in enumerate(alone):
        np.testing.assert_array_equal(results[index].embeddings, expected.embeddings)
        np.testing.assert_array_equal(results[index].active_frames, expected.active_frames)
    assert scrape(server)[HELD] == 0


def test_a_flood_past_the_queue_is_refused_promptly(weights_path) -> None:
    """A server of its own, with a queue of 2 (b1 alone: batching is not what it checks, and
    the fewer plans, the quicker its start)."""
    recording = synthetic_recording(FLOOD_S, seed=7)
    masks = speaker_masks(recording, chunk_recording(recording.samples).starts)
    running = start_server(
        weights_path, "--plans", "1", "--recording-memory-mb", "1", "--recording-queue", "2"
    )
    try:
        # one attempt: the refusals themselves, not the client's retries of them
        with SpeakerClient(running.target, timeout_s=TIMEOUT_S, retry=RetryPolicy(attempts=1)) as client:

            def call(_: int):
                started = time.monotonic()
                try:
                    client.embed_recording(recording.samples, 16_000, masks)
                    return "ok", time.monotonic() - started
                except grpc.RpcError as error:
                    return error.code().name, time.monotonic() - started

            held = []
            with ThreadPoolExecutor(16) as pool:
                futures = [pool.submit(call, i) for i in range(16)]
                while not all(f.done() for f in futures):
                    held.append(scrape(running)[HELD])
                    time.sleep(0.2)
                outcomes = [f.result() for f in futures]
        refused = [seconds for code, seconds in outcomes if code == "RESOURCE_EXHAUSTED"]
        served = [code for code, _ in outcomes if code == "ok"]
        print(f"\n{len(served)} served, {len(refused)} refused in at most {max(refused, default=0):.2f} s")
        assert served and refused and len(served) + len(refused) == 16, outcomes
        assert max(refused) < PROMPT_S, refused
        assert max(held) <= 1 << 20, max(held)
    finally:
        assert running.terminate() == 0, running.log()


def test_a_window_count_disagreeing_with_header_frames_costs_no_engine_work(server) -> None:
    recording = synthetic_recording(13.0, seed=9)
    masks = speaker_masks(recording, chunk_recording(recording.samples).starts)  # 4 windows
    before = scrape(server)[EMBEDDED]
    requests = list(recording_requests(recording.samples, 16_000, masks))
    requests[1].masks.windows = 5  # header.frames makes 4
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.SpeakerEmbeddingStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.EmbedRecording(iter(requests), timeout=TIMEOUT_S))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
    assert [field for field, _ in field_violations(caught.value)] == ["masks.windows"]
    assert scrape(server)[EMBEDDED] == before
