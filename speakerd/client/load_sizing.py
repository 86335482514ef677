"""`client load` sized for the server it calls: a load a CPU server can answer, and a GPU's.

The same command has to work against a GPU server (thousands of chunks/s) and against the
CPU engine on 2 cores (about 8 chunks/s), where 16 streams of 8-chunk calls queue for longer
than a call's deadline and every call fails with DEADLINE_EXCEEDED. So, unless --streams and
--chunks are given, `load` asks the server (GetModelInfo: its largest plan) and times one
probe call of that many chunks, then runs as many streams as keep a call's wait behind the
others within a quarter of its deadline. A recording load also checks that one recording
fits in half the deadline, and says what to change when it cannot.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass

import numpy as np

from speakerd.client.client import SpeakerClient
from speakerd.client.files import UsageError
from speakerd.client.options import client_kwargs
from speakerd.model.architecture import FRAMES, MASK_FRAMES, MAX_SPEAKERS, MEL_BINS

#: The share of a call's deadline that its wait behind the load's own other calls may take
#: at the probe's rate: a quarter leaves room for a server slower than during the probe (a
#: CPU server whose cores the load generator shares, a GPU server warming its batches).
DEADLINE_SHARE = 0.25
#: A recording call must be estimated to take at most this share of its deadline.
RECORDING_SHARE = 0.5
#: The most streams sizing picks: enough to keep a GPU server's 32-chunk batches full (its
#: measured runs used 16 streams over 4 processes).
MAX_STREAMS = 16


def sample_chunks(chunks: int) -> tuple[np.ndarray, np.ndarray]:
    """(fbank [chunks, 998, 80], masks [chunks, 3, 589]): random, seeded, so every run sends the same."""
    rng = np.random.default_rng(0)
    fbank = rng.standard_normal((chunks, FRAMES, MEL_BINS)).astype(np.float32)
    masks = (rng.random((chunks, MAX_SPEAKERS, MASK_FRAMES)) > 0.5).astype(np.float32)
    return fbank, masks


@dataclass(frozen=True)
class Probe:
    """One call of `chunks` chunks to the server, timed; what the server said it is."""

    engine: str
    max_batch: int
    chunks: int
    seconds: float

    @property
    def chunks_per_s(self) -> float:
        return self.chunks / self.seconds

    def report(self) -> dict[str, object]:
        return {"engine": self.engine, "probe_chunks": self.chunks, "probe_s": round(self.seconds, 3),
                "probe_chunks_per_s": round(self.chunks_per_s, 3)}  # fmt: skip


def probe(args: argparse.Namespace) -> Probe:
    """GetModelInfo, then one EmbedChunks of `--chunks` (or the largest plan's) chunks, timed."""
    with SpeakerClient(args.target, timeout_s=args.timeout, **client_kwargs(args)) as client:
        info = client.model_info()
        chunks = args.chunks or int(info.max_batch)
        fbank, masks = sample_chunks(chunks)
        started = time.perf_counter()
        client.embed(fbank, masks, request_id="load-probe")
        return Probe(info.engine, int(info.max_batch), chunks, time.perf_counter() - started)


def streams_for(measured: Probe, timeout_s: float, work_per_call: float) -> int:
    """Streams whose calls, `work_per_call` chunks each, queue at most DEADLINE_SHARE of the
    deadline at the probe's rate: at least 1, at most MAX_STREAMS."""
    fits = math.floor(DEADLINE_SHARE * timeout_s * measured.chunks_per_s / work_per_call)
    return max(1, min(MAX_STREAMS, fits))


def size_chunks(args: argparse.Namespace) -> dict[str, object]:
    """Fill in --chunks and --streams where not given; what was measured and chosen (JSON)."""
    if args.chunks is not None and args.streams is not None:
        return {"sized": False}
    measured = probe(args)
    args.chunks = measured.chunks
    if args.streams is None:
        args.streams = streams_for(measured, args.timeout, args.chunks)
    return {"sized": True, **measured.report()}


def size_recording(args: argparse.Namespace, windows: int) -> dict[str, object]:
    """Fill in --streams for a recording load of `windows` windows a call, after checking that
    one recording fits in RECORDING_SHARE of --timeout (UsageError saying what to change)."""
    args.chunks = None  # the probe's size is the server's largest plan
    measured = probe(args)
    rate = measured.chunks_per_s
    one = windows / rate
    if one > RECORDING_SHARE * args.timeout:
        # n windows 1 s apart cover n + 9 s of audio (the last window is 10 s long)
        longest = max(10, math.floor(RECORDING_SHARE * args.timeout * rate) + 9)
        raise UsageError(
            f"load --recording {args.recording:g}: {windows} windows a call at the {rate:.1f} windows/s "
            f"this {measured.engine} server gave a {measured.chunks}-chunk probe is about {one:.0f} s a "
            f"call, more than {RECORDING_SHARE:g} of --timeout {args.timeout:g}: use --recording "
            f"{longest} or less, or --timeout {math.ceil(one / RECORDING_SHARE)}"
        )
    sized = args.streams is None
    if sized:
        args.streams = streams_for(measured, args.timeout, windows)
    return {"sized": sized, **measured.report()}
