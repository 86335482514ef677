"""A Diarize call's room in the clustering budget (serving/diarization/service.py's `Room`).

Reserved for the linkage (8 n^2 for n clean pairs) before the clustering; resized for VBx's
updates once its AHC cut gives s initial clusters (working_bytes' max(8 n^2, 112 n s)):
shrunk when s is small, grown when the budget has the bytes free, and otherwise given back
whole and waited for in line, so that no call ever waits for room while holding some (two
calls each holding half the budget and each waiting for the other's half would never end).
An hour of two-speaker speech (5,273 clean pairs) clusters with VBx under the default 2 GiB.
"""

from __future__ import annotations

import asyncio

import numpy as np

from speakerd.model.diarization import clean_speakers, working_bytes
from speakerd.serving.diarization.service import Room
from speakerd.serving.memory.recording_budget import DEFAULT_CLUSTERING_MEMORY_MB, RecordingBudget

#: The benchmark hour: sample.wav tiled to 3,600 s keeps 5,273 clean pairs in 3,591 windows.
HOUR_WINDOWS, HOUR_PAIRS = 3591, 5273


class Service:
    """What a Room uses of DiarizationService: its budget and the metrics' report."""

    def __init__(self, limit_bytes: int) -> None:
        self.clustering_budget = RecordingBudget(limit_bytes, max_waiting=4)
        self.reports: list[int] = []

    def _report_clustering(self, waiting: int) -> None:
        self.reports.append(self.clustering_budget.held_bytes)


class Context:
    def time_remaining(self) -> float | None:
        return 5.0


def inputs(windows: int, clean_pairs: int) -> tuple[np.ndarray, np.ndarray]:
    """Segmentations and embeddings with `clean_pairs` clean pairs in `windows` windows."""
    segmentations = np.zeros((windows, 589, 3), np.uint8)
    embeddings = np.ones((windows, 3, 256), np.float32)
    for pair in range(clean_pairs):
        segmentations[pair // 2, (pair % 2) * 294 : (pair % 2) * 294 + 294, pair % 2] = 1
    return segmentations, embeddings


def room(service: Service, windows: int, pairs: int) -> Room:
    segmentations, embeddings = inputs(windows, pairs)
    assert len(clean_speakers(embeddings, segmentations)[0]) == pairs
    return Room(service, segmentations, embeddings, pairs, Context())  # type: ignore[arg-type]


def test_the_room_shrinks_and_grows_with_vbx_initial_clusters() -> None:
    async def run() -> None:
        service = Service(1 << 30)
        call = room(service, 400, 600)
        await call.reserve(0)
        linkage = working_bytes(400, 600) + call.kept
        assert call.reservation is not None and call.reservation.nbytes == linkage
        await call.reserve(3)  # 112 * 600 * 3 < 8 * 600^2: the linkage's need stays the larger
        assert call.reservation.nbytes == linkage
        await call.reserve(600)  # every pair its own initial cluster: 112 n^2
        assert call.reservation.nbytes == working_bytes(400, 600, 600) + call.kept > linkage
        call.release()
        assert service.clustering_budget.held_bytes == 0, service.clustering_budget.held_bytes

    asyncio.run(run())


def test_a_room_that_cannot_grow_waits_holding_nothing() -> None:
    async def run() -> None:
        first_need = working_bytes(100, 150) + inputs(100, 150)[0].nbytes + inputs(100, 150)[1].nbytes
        service = Service(2 * first_need)
        first, second = room(service, 100, 150), room(service, 100, 150)
        await first.reserve(0)
        await second.reserve(0)
        assert service.clustering_budget.held_bytes == 2 * first_need
        # both want 112 n^2 now: neither can grow; the first gives its room back and waits,
        # so the second grows into what the first freed and finishes
        waiting = asyncio.create_task(first.reserve(150))
        await asyncio.sleep(0.05)
        assert first.reservation is None and not waiting.done()
        await second.reserve(150)
        assert second.reservation is not None and second.reservation.nbytes > first_need
        second.release()
        await asyncio.wait_for(waiting, 2)
        assert first.reservation is not None and first.reservation.nbytes == second.reservation.nbytes
        first.release()
        assert service.clustering_budget.held_bytes == 0

    asyncio.run(run())


def test_vbx_on_the_benchmark_hour_fits_the_default_budget() -> None:
    budget = DEFAULT_CLUSTERING_MEMORY_MB << 20
    # the linkage's 8 n^2, then VBx's updates over the AHC cut's clusters (hundreds at most
    # for two speakers; every pair its own cluster would be 3.1 GB)
    linkage = working_bytes(HOUR_WINDOWS, HOUR_PAIRS)
    updates = working_bytes(HOUR_WINDOWS, HOUR_PAIRS, 400)
    print(f"\nhour, {HOUR_PAIRS} clean pairs: linkage {linkage / 2**20:.0f} MiB, VBx over 400 initial "
          f"clusters {updates / 2**20:.0f} MiB, budget {budget / 2**20:.0f} MiB")  # fmt: skip
    assert max(linkage, updates) <= budget
    assert working_bytes(HOUR_WINDOWS, HOUR_PAIRS, HOUR_PAIRS) > budget  # the old worst-case bound
