"""`python -m speakerd bench --batcher STREAMS`: the serving path without the network.

`client load --streams N --chunks 32` measures the whole server; `bench` the plans alone.
Between the two sit the batcher, its engine threads and the staging of each request into
pinned memory. This runs exactly those, in process: STREAMS coroutines on one event loop,
each keeping one 32-chunk request in `Batcher.submit` at a time, for `seconds`. The
requests are already-validated arrays (what a decode thread hands the batcher), so the
chunks/s here is the ceiling the gRPC front can approach: load / this = the share the
network path costs, this / plan = the share the batcher and staging cost.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time

import numpy as np

from speakerd.engine.base import Engine
from speakerd.serving.batching.batcher import PIPELINE_DEPTH, Batcher
from speakerd.serving.observability.metrics import Metrics
from speakerd.serving.server.config import DEFAULT_MAX_DELAY_MS

#: The server's default batching delay (a full b32 batch never waits for it).
MAX_DELAY_S = DEFAULT_MAX_DELAY_MS / 1e3
#: Chunks per request, as `client load --chunks 32` sends them: one request per b32 batch.
REQUEST_CHUNKS = 32


async def _load(engine: Engine, fbank: np.ndarray, masks: np.ndarray, streams: int, seconds: float) -> dict:
    metrics = Metrics()
    queue_chunks = max(streams * REQUEST_CHUNKS, engine.max_batch)  # every caller's request fits
    batcher = Batcher(engine, metrics, MAX_DELAY_S, queue_chunks)
    batcher.start()
    latencies: list[float] = []
    waits: list[float] = []
    until = time.perf_counter() + seconds

    async def stream() -> None:
        while time.perf_counter() < until:
            sent = time.perf_counter()
            result = await batcher.submit(fbank, masks)
            latencies.append(time.perf_counter() - sent)
            waits.append(result.queue_wait_s)

    started = time.perf_counter()
    await asyncio.gather(*(stream() for _ in range(streams)))
    elapsed = time.perf_counter() - started
    await batcher.close(timeout_s=5.0)
    plan = {"plan": f"b{engine.max_batch}"}
    return {
        "requests": len(latencies),
        "chunks_per_s": round(len(latencies) * REQUEST_CHUNKS / elapsed, 2),
        "latency_p50_ms": round(1e3 * statistics.median(latencies), 3),
        "latency_p99_ms": round(1e3 * float(np.percentile(latencies, 99)), 3),
        "queue_wait_ms_mean": round(1e3 * statistics.fmean(waits), 3),
        "batch_compute_ms_mean": _mean_ms(metrics, "speakerd_batch_compute_seconds", plan),
        "host_to_device_ms_mean": _mean_ms(metrics, "speakerd_host_to_device_seconds", {}),
        "device_gap_ms_mean": _mean_ms(metrics, "speakerd_device_gap_seconds", {}),
    }


def _mean_ms(metrics: Metrics, histogram: str, labels: dict[str, str]) -> float | None:
    """Mean of one of the batcher's histograms over the run, in ms (None when empty)."""
    count = metrics.registry.get_sample_value(f"{histogram}_count", labels)
    total = metrics.registry.get_sample_value(f"{histogram}_sum", labels)
    return round(1e3 * total / count, 3) if count and total is not None else None


def bench(engine: Engine, fbank: np.ndarray, masks: np.ndarray, streams: int, seconds: float) -> dict:
    """One JSON-ready line: the batcher's chunks/s with `streams` callers of 32 chunks."""
    if fbank.shape[0] != REQUEST_CHUNKS:
        raise ValueError(f"fbank: {fbank.shape[0]} chunks, expected {REQUEST_CHUNKS} (a b32 request)")
    return {
        "kind": "batcher",
        "engine": engine.name,
        "math": str(engine.math),
        "streams": streams,
        "chunks_per_request": REQUEST_CHUNKS,
        "batches_in_flight": PIPELINE_DEPTH,
        "switch_interval_ms": round(1e3 * sys.getswitchinterval(), 3),
        "seconds": seconds,
        **asyncio.run(_load(engine, fbank, masks, streams, seconds)),
    }
