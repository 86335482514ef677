"""`client load` sized for the server it calls: a load a CPU server can answer, and a GPU's.

The same command has to work against a GPU server (thousands of chunks/s) and against the
CPU engine on 2 cores (about 8 chunks/s), where 16 streams of 8-chunk calls queue for longer
than a call's deadline and every call fails with DEADLINE_EXCEEDED. So `load` first asks the
server (GetModelInfo: its largest plan) and times one probe call of one chunk (then, when
that was quick, one of a full batch: a GPU's one-chunk call is all round trip). What the
command line leaves out is then chosen from that rate: chunks per call (the largest plan, or
as many as take CALL_TARGET_S, or fewer when that many would not fit in a quarter of the
deadline) and streams (as many as
keep a call's wait behind the others within that quarter). A counted window and a warm-up
shorter than a few calls would count too few calls to give a rate, so both are lengthened
to CALLS_PER_WINDOW and one call's estimated time. A recording's deadline, unless given, is
twice its estimated time; a given one it cannot meet is one line saying what to change.
Everything chosen is reported in the JSON's `sizing`.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from typing import Any

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
#: The most recording streams sizing picks: two recordings in flight keep a GPU server busy
#: (one uploads while the other computes: the measured hour-long runs used 2).
MAX_RECORDING_STREAMS = 2
#: The longest the sized calls in flight may take together at the probe's rate: a call's
#: chunks fill the server's largest plan, and enough streams run to fill its batches, when
#: that is quick (a GPU's batch takes milliseconds); else fewer. A CPU server's 32-chunk call
#: takes 4-6 s on 2 cores, and three such calls (below) stretched `load --seconds 10` to 30 s
#: of counting, for the same chunks/s: its engine runs one chunk at a time whatever the load.
CALL_TARGET_S = 1.0
#: A counted window shorter than this many calls' time is lengthened to it.
CALLS_PER_WINDOW = 3
#: The probe: one chunk, so that even a slow CPU server answers it well within any deadline.
PROBE_CHUNKS = 1
#: A second probe of one full batch (the server's largest plan) follows when the first says
#: that batch takes at most this long. A GPU server's one-chunk answer is round trip, not
#: work, so its rate understates a batch's by up to the batch size: an H100 serving an hour
#: (3,591 windows) in 0.55 s gave 150 chunks/s to the one-chunk probe, which sized the
#: recording at 24 s a call, `suite service`'s two streams to 144 s of counted window and
#: the step past its budget. A CPU server (a one-chunk call of 0.1-0.2 s) gets no second probe.
BATCH_PROBE_S = 1.0
#: Deadlines when --timeout is not given: a chunk call's, and the least a recording's is.
DEFAULT_TIMEOUT_S = 30.0


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
    seconds: float
    chunks: int = PROBE_CHUNKS

    @property
    def chunks_per_s(self) -> float:
        return self.chunks / self.seconds

    def wants_batch_probe(self) -> bool:
        """True when a one-chunk probe says a full batch would take at most BATCH_PROBE_S."""
        return self.chunks < self.max_batch and self.max_batch * self.seconds <= BATCH_PROBE_S

    def report(self) -> dict[str, Any]:
        return {"engine": self.engine, "probe_chunks": self.chunks, "probe_s": round(self.seconds, 4),
                "probe_chunks_per_s": round(self.chunks_per_s, 3)}  # fmt: skip


def probe(args: argparse.Namespace) -> Probe:
    """GetModelInfo, then one EmbedChunks of PROBE_CHUNKS chunks, timed, and when that was
    fast, one of a full batch (BATCH_PROBE_S says why). Its deadline is at least
    DEFAULT_TIMEOUT_S: a --timeout too short for the load's calls still gets its probe."""
    timeout = max(args.timeout or 0.0, DEFAULT_TIMEOUT_S)
    with SpeakerClient(args.target, timeout_s=timeout, **client_kwargs(args)) as client:
        info = client.model_info()

        def timed(chunks: int) -> Probe:
            fbank, masks = sample_chunks(chunks)
            started = time.perf_counter()
            client.embed(fbank, masks, request_id="load-probe")
            return Probe(info.engine, int(info.max_batch), time.perf_counter() - started, chunks)

        first = timed(PROBE_CHUNKS)
        return timed(first.max_batch) if first.wants_batch_probe() else first


def _fits(measured: Probe, timeout_s: float, work: float, most: int) -> int:
    """How many calls of `work` chunks the probe's rate answers in DEADLINE_SHARE of the
    deadline: at least 1, at most `most`."""
    return max(1, min(most, math.floor(DEADLINE_SHARE * timeout_s * measured.chunks_per_s / work)))


def _stretch(args: argparse.Namespace, call_s: float) -> dict[str, Any]:
    """Lengthen --seconds to CALLS_PER_WINDOW calls and --warmup to one call (of `call_s`
    estimated seconds, every stream's share of the server included); what changed."""
    asked = {"seconds": args.seconds, "warmup": args.warmup}
    args.seconds = max(args.seconds, round(CALLS_PER_WINDOW * call_s, 1))
    args.warmup = max(args.warmup, round(call_s, 1))
    changed = {f"{name}_asked": value for name, value in asked.items() if getattr(args, name) != value}
    return {"call_s_estimated": round(call_s, 3), **changed}


def size_chunks(args: argparse.Namespace) -> dict[str, Any]:
    """Fill in --chunks, --streams and --timeout where not given, lengthen --seconds and
    --warmup to the calls' time; what was measured and chosen (JSON)."""
    return chunk_sizing(args, probe(args))


def chunk_sizing(args: argparse.Namespace, measured: Probe) -> dict[str, Any]:
    """size_chunks' choices from a probe already made."""
    args.timeout = args.timeout or DEFAULT_TIMEOUT_S
    chosen = [name for name in ("chunks", "streams") if getattr(args, name) is None]
    quick = max(1, math.floor(CALL_TARGET_S * measured.chunks_per_s))  # chunks in CALL_TARGET_S
    if args.chunks is None:
        args.chunks = _fits(measured, args.timeout, 1, min(measured.max_batch, quick))
    if args.streams is None:  # the calls in flight together take at most CALL_TARGET_S too
        args.streams = _fits(
            measured, args.timeout, args.chunks, min(MAX_STREAMS, max(1, quick // args.chunks))
        )
    call_s = args.streams * args.chunks / measured.chunks_per_s
    return {**measured.report(), "chosen": chosen, **_stretch(args, call_s)}


def size_recording(args: argparse.Namespace, windows: int) -> dict[str, Any]:
    """The same for a recording load of `windows` windows a call; a --timeout given that one
    recording would not fit in RECORDING_SHARE of is a UsageError saying what to change."""
    return recording_sizing(args, windows, probe(args))


def recording_sizing(args: argparse.Namespace, windows: int, measured: Probe) -> dict[str, Any]:
    """size_recording's choices from a probe already made."""
    rate = measured.chunks_per_s
    one = windows / rate
    needed = math.ceil(one / RECORDING_SHARE)
    chosen = [name for name in ("timeout", "streams") if getattr(args, name) is None]
    if args.timeout is None:
        args.timeout = max(DEFAULT_TIMEOUT_S, needed)
    elif one > RECORDING_SHARE * args.timeout:
        # n windows 1 s apart cover n + 9 s of audio (the last window is 10 s long)
        longest = max(10, math.floor(RECORDING_SHARE * args.timeout * rate) + 9)
        raise UsageError(
            f"load --recording {args.recording:g}: {windows} windows a call at the {rate:.1f} windows/s "
            f"this {measured.engine} server gave a probe is about {one:.0f} s a call, more than "
            f"{RECORDING_SHARE:g} of --timeout {args.timeout:g}: use --recording {longest} or less, or "
            f"--timeout {needed} (or leave --timeout out)"
        )
    if args.streams is None:
        args.streams = _fits(measured, args.timeout, windows, MAX_RECORDING_STREAMS)
    call_s = args.streams * one
    return {**measured.report(), "chosen": chosen, "timeout": args.timeout, **_stretch(args, call_s)}
