"""`python -m speakerd.client load`: N concurrent streams of K-chunk requests for T seconds, JSON out.

What is measured is the server, not this generator, so:
- each request is serialized once and sent as those bytes on every call (a 32-chunk
  request takes ~3 ms to serialize in Python: at 4,000 chunks/s that alone would fill a
  core), and only the response is parsed;
- the streams are spread over `--processes` worker processes (each its own channel and
  event loop), because one Python process tops out below what a GPU server answers.
Each stream keeps one call in flight. What is counted is a steady state: every process
first builds its request and waits for the others (spawning a process that imports gRPC
and NumPy takes ~1 s, which a count from the parent's start put into the run: on the H200
the server's batches of a 10.13 s run spanned 9.33 s), then all run `--warmup` seconds
uncounted (connections, the server's first batches, and the GPU's idle time since the
last run, which the device-gap mean would otherwise take in), then `--seconds` during
which each call begun is counted (loadgen_window.py). Batch fill, batch size and the
server's timings come from its /metrics (deltas from the window's start until the last
call ended) when --metrics-url is given. The load is sized for the server first
(load_sizing.py: GetModelInfo and one timed probe call fill in what the command line leaves
out), so the same command suits a GPU server and the CPU engine on 2 cores. The exit code is 0 only when no
call failed and at least one call was counted; otherwise 1, and the JSON's `failure` says
which (loadgen_window.outcome), so a script cannot mistake a broken server for a measured
one.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import multiprocessing
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import grpc
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from speakerd.client import load_sizing, recording_load
from speakerd.client.client import (
    DEFAULT_MAX_MESSAGE_MB,
    Security,
    build_request,
    channel_options,
    make_channel,
)
from speakerd.client.files import UsageError
from speakerd.client.load_sizing import sample_chunks
from speakerd.client.loadgen_window import Window, outcome
from speakerd.client.options import add_connection_flags, security
from speakerd.client.recording import PIECE_BYTES
from speakerd.v1 import speakerd_pb2 as pb

#: A stream's pause after a failed call before its next one.
ERROR_PAUSE_S = 0.01
#: Percentiles reported, as the SLOs are written.
PERCENTILES = (50, 90, 99)
EMBED_METHOD = "/speakerd.v1.SpeakerEmbedding/EmbedChunks"
#: How long the worker processes get to start and build their requests; past it the load
#: ends with one line saying so (a loaded CI machine spawns a Python process in seconds).
START_TIMEOUT_S = 120.0


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--streams", type=int, default=None,
        help="concurrent callers, over all processes (default: sized from a probe call, 1 to 16)",
    )  # fmt: skip
    parser.add_argument("--processes", type=int, default=1, help="processes the streams share")
    parser.add_argument(
        "--seconds", type=float, default=10.0,
        help="counted run time, after the warm-up (at least 3 calls' estimated time)",
    )  # fmt: skip
    parser.add_argument(
        "--warmup", type=float, default=1.0,
        help="seconds of calls before the counted run (connections, first batches; at least one call's "
        "estimated time); failures count",
    )  # fmt: skip
    parser.add_argument(
        "--chunks", type=int, default=None, help="chunks per request (default: the server's largest plan)"
    )
    parser.add_argument("--recording", type=float, default=0.0, help="seconds: EmbedRecording calls instead")
    parser.add_argument("--sample-rate", type=int, default=16_000, help="with --recording: its PCM16 rate")
    parser.add_argument("--channels", type=int, default=1, help="with --recording: its channel count")
    parser.add_argument(
        "--masks-after-audio", action="store_true",
        help="with --recording: send the masks after the audio (no window embedded before the audio's end)",
    )  # fmt: skip
    parser.add_argument(
        "--piece-kib", type=int, default=PIECE_BYTES >> 10,
        help="with --recording: KiB of PCM per message (the client's default %(default)s)",
    )  # fmt: skip
    parser.add_argument("--metrics-url", default="", help="the server's /metrics URL, for batch fill")
    add_connection_flags(
        parser, timeout_s=None,
        timeout_help="deadline in seconds per call (default: 30; for a recording at least twice its "
        "estimated time)", retries=False,
    )  # fmt: skip


#: Counters whose deltas the report gives per label value: plan runs per device of `serve
#: --devices`, calls per receiver of `serve --receivers` (report key, label).
PER_LABEL = {
    "speakerd_device_batches_total": ("device_batches", "device"),
    "speakerd_receiver_calls_total": ("receiver_calls", "receiver"),
}


def scrape(url: str) -> dict[str, float]:
    """Sum of each sample name over its labels, e.g. speakerd_batch_fill_ratio_sum; and the
    PER_LABEL counters per label value too, e.g. `speakerd_device_batches_total{device=0}`."""
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    totals: dict[str, float] = collections.defaultdict(float)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] += sample.value
            if sample.name in PER_LABEL:
                label = PER_LABEL[sample.name][1]
                totals[f"{sample.name}{{{label}={sample.labels[label]}}}"] += sample.value
    return dict(totals)


def per_label(before: dict[str, float], after: dict[str, float], name: str) -> dict[str, int]:
    """PER_LABEL counter `name`'s increase during the run per label value ({} where the
    server has no such series: no --devices, no --receivers)."""
    prefix = f"{name}{{{PER_LABEL[name][1]}="
    return {
        key[len(prefix) : -1]: int(value - before.get(key, 0.0))
        for key, value in sorted(after.items())
        if key.startswith(prefix)
    }


def _mean_delta(before: dict[str, float], after: dict[str, float], name: str) -> float | None:
    count = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
    total = after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)
    return total / count if count > 0 else None


def request_bytes(chunks: int) -> bytes:
    """One serialized EmbedChunks request of `chunks` random chunks (seeded: reproducible)."""
    fbank, masks = sample_chunks(chunks)
    return build_request(masks, fbank=fbank, request_id="loadgen").SerializeToString()


@dataclass
class WorkerResult:
    """What one process saw: embedded chunks, per-call latencies (s), errors by code."""

    chunks: int = 0
    latencies: list[float] = field(default_factory=list)
    errors: collections.Counter[str] = field(default_factory=collections.Counter)


async def _stream(
    call, payload: bytes, window: Window, timeout: float, metadata: tuple, result: WorkerResult
) -> None:
    while (begun := time.monotonic()) < window.end:
        started = time.perf_counter()
        try:
            response = await call(payload, timeout=timeout, metadata=metadata)
        except grpc.aio.AioRpcError as error:
            result.errors[error.code().name] += 1  # in the warm-up too: a failure is a failure
            # a refused call comes back in microseconds: without a pause one stream would spin
            # on RESOURCE_EXHAUSTED, counting thousands of errors and starving the server's CPU
            await asyncio.sleep(ERROR_PAUSE_S)
            continue
        if window.counts(begun):
            result.latencies.append(time.perf_counter() - started)
            result.chunks += response.embeddings.shape[0]


@dataclass(frozen=True)
class Work:
    """What every worker process is given (picklable: spawned processes receive it)."""

    target: str
    chunks: int
    warmup_s: float
    seconds: float
    timeout: float
    security: Security


async def _worker_async(work: Work, streams: int, payload: bytes, window: Window) -> WorkerResult:
    result = WorkerResult()
    options = channel_options(DEFAULT_MAX_MESSAGE_MB)
    metadata = work.security.metadata()
    async with make_channel(work.target, options, work.security, aio=True) as channel:
        # bytes in (pre-serialized once), EmbedResponse out
        parse = pb.EmbedResponse.FromString
        call = channel.unary_unary(EMBED_METHOD, request_serializer=None, response_deserializer=parse)
        streaming = (_stream(call, payload, window, work.timeout, metadata, result) for _ in range(streams))
        await asyncio.gather(*streaming)
    return result


#: The start line of this worker process (set by _join, in each spawned process).
_start_line: threading.Barrier | None = None


def _join(start_line) -> None:
    """ProcessPoolExecutor initializer: a barrier reaches a spawned process only this way."""
    global _start_line
    _start_line = start_line


def _worker(work: Work, streams: int, started: Callable[[Window], None] | None = None) -> WorkerResult:
    """One process's share of the streams: its request built, then (with other processes)
    the start line, then the warm-up and the counted window (given to `started` first)."""
    payload = request_bytes(work.chunks)
    if _start_line is not None:
        _start_line.wait(START_TIMEOUT_S)
    window = Window.after(time.monotonic(), work.warmup_s, work.seconds)
    if started is not None:
        started(window)
    return asyncio.run(_worker_async(work, streams, payload, window))


def _shares(streams: int, processes: int) -> list[int]:
    """Streams per process, as even as possible, no process without a stream."""
    processes = max(1, min(processes, streams))
    return [streams // processes + (i < streams % processes) for i in range(processes)]


def generate(args: argparse.Namespace) -> dict[str, object]:
    if args.seconds <= 0 or args.warmup < 0 or (args.timeout is not None and args.timeout <= 0):
        raise UsageError(
            f"load --seconds {args.seconds:g} --warmup {args.warmup:g} --timeout {args.timeout}: expected "
            "seconds > 0, warmup >= 0, timeout > 0"
        )
    counts = (("--streams", args.streams), ("--chunks", args.chunks), ("--processes", args.processes))
    for flag, value in counts:
        if value is not None and value < 1:
            raise UsageError(f"load {flag} {value}: expected 1 or more")
    if args.recording:
        return recording_load.generate(args)
    _read_metrics(args.metrics_url)  # a URL nobody answers is one line before any call
    sizing = load_sizing.size_chunks(args)
    shares = _shares(args.streams, args.processes)
    work = Work(args.target, args.chunks, args.warmup, args.seconds, args.timeout, security(args))
    at_start = _MetricsAt(args.metrics_url)
    if len(shares) == 1:
        results = [_worker(work, shares[0], started=lambda window: at_start.read_at(window.start))]
    else:
        # spawn, not fork: gRPC's C core does not survive a fork of a process using it
        context = multiprocessing.get_context("spawn")
        start_line = context.Barrier(len(shares) + 1)  # the workers and this process
        pool = ProcessPoolExecutor(len(shares), mp_context=context, initializer=_join, initargs=(start_line,))
        with pool:
            futures = [pool.submit(_worker, work, share) for share in shares]
            try:
                start_line.wait(START_TIMEOUT_S)
            except threading.BrokenBarrierError:
                raise SystemExit(
                    f"client load: {len(shares)} worker processes did not all start within "
                    f"{START_TIMEOUT_S:g} s; try fewer --processes"
                ) from None
            at_start.read_at(Window.after(time.monotonic(), args.warmup, args.seconds).start)
            results = [future.result() for future in futures]
    before = at_start.values()
    # after every counted call ended: the means below are the window's batches, and those of
    # the calls begun in it that ended after it
    after = _read_metrics(args.metrics_url)
    latencies = np.array([latency for result in results for latency in result.latencies]) * 1e3
    errors: collections.Counter[str] = collections.Counter()
    for result in results:
        errors.update(result.errors)
    seconds = args.seconds
    report: dict[str, object] = {
        "streams": args.streams, "processes": len(shares), "chunks_per_request": args.chunks,
        "warmup_s": args.warmup, "seconds": seconds, "requests_ok": int(latencies.size),
        # from the reported seconds and to 6 significant digits: requests_ok * chunks / seconds
        # recomputed from this JSON agrees to 1e-5 (rounding to 2 decimals did not at low rates)
        "chunks_per_s": _significant(sum(result.chunks for result in results) / seconds),
        "errors": dict(errors), **outcome(int(latencies.size), errors, seconds), "sizing": sizing,
    }  # fmt: skip
    for p in PERCENTILES:
        report[f"latency_p{p}_ms"] = round(float(np.percentile(latencies, p)), 3) if latencies.size else None
    if args.metrics_url:
        report["batch_fill_mean"] = _mean_delta(before, after, "speakerd_batch_fill_ratio")
        report["batch_size_mean_chunks"] = _mean_delta(before, after, "speakerd_batch_size_chunks")
        report["batch_compute_ms_mean"] = _ms(_mean_delta(before, after, "speakerd_batch_compute_seconds"))
        report["host_to_device_ms_mean"] = _ms(_mean_delta(before, after, "speakerd_host_to_device_seconds"))
        report["device_gap_ms_mean"] = _ms(_mean_delta(before, after, "speakerd_device_gap_seconds"))
        report["queue_wait_ms_mean"] = _ms(_mean_delta(before, after, "speakerd_queue_wait_seconds"))
        for name, (key, _) in PER_LABEL.items():
            report[key] = per_label(before, after, name)
    return report


def _read_metrics(url: str) -> dict[str, float]:
    """scrape(url); {} without a URL; one line naming the URL when it cannot be read."""
    if not url:
        return {}
    try:
        return scrape(url)
    except (OSError, ValueError) as error:  # urllib's URLError is an OSError
        raise SystemExit(f"client load: --metrics-url {url}: {error}") from None


class _MetricsAt:
    """The server's /metrics read by a thread at one time.monotonic() moment of the run
    (the window's start) while the workers call."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._thread: threading.Thread | None = None
        self._values: dict[str, float] = {}
        self._failure: SystemExit | None = None

    def read_at(self, at: float) -> None:
        if not self._url:
            return

        def read() -> None:
            time.sleep(max(0.0, at - time.monotonic()))
            try:
                self._values = _read_metrics(self._url)
            except SystemExit as failure:
                self._failure = failure

        self._thread = threading.Thread(target=read, name="metrics-before", daemon=True)
        self._thread.start()

    def values(self) -> dict[str, float]:
        """What was read (after the read ended); the one-line SystemExit if it failed."""
        if self._thread is not None:
            self._thread.join()
        if self._failure is not None:
            raise self._failure
        return self._values


def _significant(value: float, digits: int = 6) -> float:
    return float(f"{value:.{digits}g}")


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


def run(args: argparse.Namespace) -> int:
    report = generate(args)
    print(json.dumps(report))
    return 0 if report["ok"] else 1
