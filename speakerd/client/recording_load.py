"""`client load --recording SECONDS`: concurrent EmbedRecording calls of one synthetic recording.

The diarization use case end to end (upload, decode, fbank, embedding, answers): each of
`--streams` callers sends the same SECONDS-long 16 kHz s16 recording with all-active masks
for 3 speakers, again and again for `--warmup` and then `--seconds`; the report counts the
recordings begun within those `--seconds` (as `client load` counts its calls:
loadgen_window.py) and gives windows/s and per-recording latency. One process: the
recording's 4 MiB pieces cost the client far less than the server's work on them.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import time

import grpc
import numpy as np

from speakerd.client import load_sizing
from speakerd.client.client import AsyncSpeakerClient, RetryPolicy
from speakerd.client.files import UsageError
from speakerd.client.loadgen_window import Window, outcome
from speakerd.client.options import client_kwargs
from speakerd.client.recording import recording_requests
from speakerd.model.architecture import MASK_FRAMES, MAX_SPEAKERS
from speakerd.model.recording import window_count

#: Noise level of the synthetic recording: speech-like RMS (-20 dBFS), well inside int16.
NOISE_RMS = 0.1
PERCENTILES = (50, 90, 99)


def synthetic(
    seconds: float, sample_rate: int = 16_000, channels: int = 1, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """(int16 samples [N, channels] at `sample_rate`, float32 masks [n, 3, 589] all ones, n the
    window count pyannote gives `seconds` of audio) for a synthetic recording."""
    frames = int(seconds * sample_rate)
    if frames < 1 or sample_rate < 1 or channels < 1:
        raise UsageError(
            f"load --recording {seconds} --sample-rate {sample_rate} --channels {channels}: expected "
            "positive numbers"
        )
    noise = np.random.default_rng(seed).standard_normal((frames, channels), dtype=np.float32)
    pcm = np.clip(np.round(noise * (NOISE_RMS * 32767)), -32768, 32767).astype(np.int16)
    # the server's window count is that of the audio resampled to 16 kHz
    windows = window_count(-(-frames * 16_000 // sample_rate))
    return pcm, np.ones((windows, MAX_SPEAKERS, MASK_FRAMES), dtype=np.float32)


async def _caller(
    client: AsyncSpeakerClient,
    pcm: np.ndarray,
    rate: int,
    masks: np.ndarray,
    window: Window,
    out: dict,
    args: argparse.Namespace,
):
    """Calls as AsyncSpeakerClient.embed_recording makes them, with the message order and
    piece size the options give (masks after the audio: the first protocol's order, where
    no window is embedded before the audio's end)."""
    while (begun := time.monotonic()) < window.end:
        started = time.perf_counter()
        try:
            await client.embed_recording(
                pcm, rate, masks, piece_bytes=args.piece_kib << 10, masks_first=not args.masks_after_audio
            )
        except grpc.aio.AioRpcError as error:
            out["errors"][error.code().name] += 1  # in the warm-up too
            continue
        if window.counts(begun):
            out["latencies"].append(time.perf_counter() - started)


async def _run(args: argparse.Namespace, pcm: np.ndarray, masks: np.ndarray) -> dict:
    out: dict = {"latencies": [], "errors": collections.Counter()}
    kwargs = {**client_kwargs(args), "retry": RetryPolicy(1)}  # a load counts every failure
    async with AsyncSpeakerClient(args.target, timeout_s=args.timeout, **kwargs) as client:
        window = Window.after(time.monotonic(), args.warmup, args.seconds)
        callers = (
            _caller(client, pcm, args.sample_rate, masks, window, out, args) for _ in range(args.streams)
        )
        await asyncio.gather(*callers)
    return out


def generate(args: argparse.Namespace) -> dict[str, object]:
    """The JSON report of a recording load run."""
    pcm, masks = synthetic(args.recording, args.sample_rate, args.channels)
    sizing = load_sizing.size_recording(args, int(masks.shape[0]))  # may lengthen the window
    messages = recording_requests(pcm, args.sample_rate, masks, piece_bytes=args.piece_kib << 10)
    sent = sum(message.ByteSize() for message in messages)
    out = asyncio.run(_run(args, pcm, masks))
    elapsed = args.seconds
    latencies = np.array(out["latencies"]) * 1e3
    report: dict[str, object] = {
        "mode": "recording", "recording_s": args.recording, "sample_rate": args.sample_rate,
        "channels": args.channels, "windows_per_recording": int(masks.shape[0]),
        "streams": args.streams, "warmup_s": args.warmup, "seconds": elapsed,
        "recordings_ok": int(latencies.size),
        "windows_per_s": round(latencies.size * masks.shape[0] / elapsed, 3),
        "errors": dict(out["errors"]), **outcome(int(latencies.size), out["errors"], elapsed),
        "sizing": sizing,
        "masks": "after the audio" if args.masks_after_audio else "first", "piece_kib": args.piece_kib,
        "pcm_bytes": int(pcm.nbytes), "bytes_sent_per_recording": int(sent),
        "bytes_sent_over_pcm": round(sent / pcm.nbytes, 4),
    }  # fmt: skip
    for p in PERCENTILES:
        report[f"latency_p{p}_ms"] = round(float(np.percentile(latencies, p)), 3) if latencies.size else None
    return report
