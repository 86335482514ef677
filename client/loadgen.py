"""`python -m client load`: N concurrent streams of K-chunk requests for T seconds, JSON out.

Each stream is a loop of unary EmbedChunks calls (one in flight per stream), reusing one
prebuilt request so the client's own encoding is not what is measured. Batch fill and batch
size come from the server's /metrics (deltas over the run) when --metrics-url is given.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import time
import urllib.request

import grpc
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from client.client import NO_RETRY, AsyncSpeakerClient, build_request
from server.architecture import FRAMES, MASK_FRAMES, MAX_SPEAKERS, MEL_BINS

#: A stream's pause after a failed call before its next one.
ERROR_PAUSE_S = 0.01
#: Percentiles reported, as the SLOs are written.
PERCENTILES = (50, 90, 99)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="HOST:PORT (loopback)")
    parser.add_argument("--streams", type=int, default=8, help="concurrent callers")
    parser.add_argument("--seconds", type=float, default=10.0, help="run time")
    parser.add_argument("--chunks", type=int, default=4, help="chunks per request")
    parser.add_argument("--metrics-url", default="", help="the server's /metrics URL, for batch fill")
    parser.add_argument("--timeout", type=float, default=30.0, help="per-call deadline in seconds")


def scrape(url: str) -> dict[str, float]:
    """Sum of each sample name over its labels, e.g. speakerd_batch_fill_ratio_sum."""
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    totals: dict[str, float] = collections.defaultdict(float)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] += sample.value
    return dict(totals)


def _mean_delta(before: dict[str, float], after: dict[str, float], name: str) -> float | None:
    count = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
    total = after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)
    return total / count if count > 0 else None


async def _stream(
    client: AsyncSpeakerClient, request, until: float, timeout: float, latencies, errors
) -> int:
    chunks = 0
    while time.monotonic() < until:
        started = time.perf_counter()
        try:
            response = await client.embed_request(request, timeout_s=timeout)
        except grpc.aio.AioRpcError as error:
            errors[error.code().name] += 1
            # a refused call comes back in microseconds: without a pause one stream would spin
            # on RESOURCE_EXHAUSTED, counting thousands of errors and starving the server's CPU
            await asyncio.sleep(ERROR_PAUSE_S)
            continue
        latencies.append(time.perf_counter() - started)
        chunks += response.embeddings.shape[0]
    return chunks


async def generate(args: argparse.Namespace) -> dict[str, object]:
    rng = np.random.default_rng(0)
    fbank = rng.standard_normal((args.chunks, FRAMES, MEL_BINS)).astype(np.float32)
    masks = (rng.random((args.chunks, MAX_SPEAKERS, MASK_FRAMES)) > 0.5).astype(np.float32)
    request = build_request(masks, fbank=fbank, request_id="loadgen")
    before = scrape(args.metrics_url) if args.metrics_url else {}
    latencies: list[float] = []
    errors: collections.Counter[str] = collections.Counter()
    async with AsyncSpeakerClient(args.target, retry=NO_RETRY) as client:
        started = time.monotonic()
        until = started + args.seconds
        done = await asyncio.gather(
            *(_stream(client, request, until, args.timeout, latencies, errors) for _ in range(args.streams))
        )
        elapsed = time.monotonic() - started
    after = scrape(args.metrics_url) if args.metrics_url else {}
    lat = np.array(latencies) * 1e3
    report: dict[str, object] = {
        "streams": args.streams, "chunks_per_request": args.chunks, "seconds": round(elapsed, 3),
        "requests_ok": len(latencies), "chunks_per_s": round(sum(done) / elapsed, 2),
        "errors": dict(errors),
    }  # fmt: skip
    for p in PERCENTILES:
        report[f"latency_p{p}_ms"] = round(float(np.percentile(lat, p)), 3) if lat.size else None
    if args.metrics_url:
        report["batch_fill_mean"] = _mean_delta(before, after, "speakerd_batch_fill_ratio")
        report["batch_size_mean_chunks"] = _mean_delta(before, after, "speakerd_batch_size_chunks")
    return report


def run(args: argparse.Namespace) -> int:
    report = asyncio.run(generate(args))
    print(json.dumps(report))
    return 0 if report["requests_ok"] else 1
