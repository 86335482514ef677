"""`python -m speakerd.tools.bench_diarize`: a recording through a server's Diarize, timed as
a user feels it (audio in memory -> the turns received), beside its parts.

The recording is a speech file tiled to `--seconds` (pyannote's sample.wav to an hour is the
pyannote suite's hour: speakerd/pyannote/bench.py tiles it the same way), so that
segmentation finds speakers and the clustering has an hour's worth of clean embeddings, as
it would on a meeting; noise (`client load --recording`) would leave it nothing to do.

Each run makes two calls one after the other, on one channel:
- `segment`: EmbedRecording with `segment` and no masks: the server's segmentation and the
  embeddings under it, everything before the clustering (issue: audio in -> segmentation
  and embeddings out);
- `diarize`: Diarize with pyannote's defaults: the same, then the clustering,
  reconstruction and turns on the server.
Then, in this process and on this machine's CPU, the last run's segmentation and embeddings
go through speakerd.model.diarization step by step (the clean pairs kept for clustering,
their linkage, the reconstruction), to say where the time between the two calls goes.

One JSON line per call kind (`kind`: `segment` / `diarize`, wall seconds of every run, the
median, x real time) and one `clustering` line (rows, seconds per step, the linkage by
SciPy and compiled, and whether their clusters are the same); `--save FILE.npz` keeps the
last run's segmentation and embeddings, and the clean rows the clustering links (`clean`,
for bench_clustering --rows-file), for study elsewhere. `--vbx` times Diarize with
`clustering.method` vbx too (a server started with `--plda`); `--concurrent N` then sends N
Diarize calls of the recording at once
(`diarize-concurrent`: hours diarized per second, and with `--metrics URL` the cores the
server used meanwhile).

  python -m speakerd.tools.bench_diarize --target 127.0.0.1:50051 --audio sample.wav --seconds 3600
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from speakerd.client.diarize import VBX, DiarizationClient
from speakerd.client.files import UsageError, read_audio
from speakerd.model.diarization import SPEAKER_DIARIZATION_3_1, diarize
from speakerd.model.diarization.clustering import clean_speakers, cluster_embeddings
from speakerd.model.diarization.linkage import SCIPY, Linker, proven_equal_to_scipy

#: Seconds of the warm-up calls (each kind once): long enough to fill a batch of windows and
#: to run the clustering, short enough to cost nothing next to the hour.
WARMUP_S = 60.0
#: A call's deadline: an hour on a CPU server takes many minutes; on a GPU, about a second.
DEFAULT_TIMEOUT_S = 600.0


def tiled(samples: np.ndarray, rate: int, seconds: float) -> np.ndarray:
    """`samples` [N, C] repeated to `seconds` of audio."""
    frames = round(seconds * rate)
    if frames < 1:
        raise UsageError(f"--seconds {seconds:g}: expected a positive length")
    repeats = -(-frames // samples.shape[0])
    return np.tile(samples, (repeats, 1))[:frames]


def timed(call: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = call()
    return time.perf_counter() - started, result


def summary(kind: str, seconds: float, walls: list[float], **extra: Any) -> dict[str, Any]:
    p50 = statistics.median(walls)
    return {
        "kind": kind, "audio_s": seconds, "runs": len(walls), "wall_s": [round(w, 4) for w in walls],
        "p50_s": round(p50, 4), "x_real_time": round(seconds / p50, 1), **extra,
    }  # fmt: skip


def clustering_steps(segmentation: np.ndarray, embeddings: np.ndarray) -> dict[str, Any]:
    """Where Diarize's time after the embeddings goes, step by step on this CPU: the clean
    pairs kept (pyannote's filter), their linkage and cut, and the whole diarize()."""
    binary = segmentation.astype(np.float32)
    proven_equal_to_scipy()  # compiled and checked before the timing, as a server does at start-up
    filter_s, (windows, speakers) = timed(lambda: clean_speakers(embeddings, binary))
    train = embeddings[windows, speakers]
    scipy = Linker(SCIPY)
    scipy_s, by_scipy = timed(lambda: cluster_embeddings(train, SPEAKER_DIARIZATION_3_1, linker=scipy))
    linkage_s, compiled = timed(lambda: cluster_embeddings(train, SPEAKER_DIARIZATION_3_1))
    whole_s, result = timed(lambda: diarize(binary, embeddings, 1.0))
    return {
        "kind": "clustering", "processor": "cpu", "windows": int(segmentation.shape[0]),
        "pairs": int(segmentation.shape[0] * segmentation.shape[2]), "clean_pairs": int(train.shape[0]),
        "filter_s": round(filter_s, 4), "linkage_and_cut_s": round(linkage_s, 4),
        "linkage_and_cut_scipy_s": round(scipy_s, 4),
        "same_clusters": bool(np.array_equal(compiled, by_scipy)),
        "diarize_s": round(whole_s, 4), "rest_s": round(whole_s - filter_s - linkage_s, 4),
        "speakers": len(result.labels), "turns": len(result.turns),
    }  # fmt: skip


def server_cpu_s(metrics_url: str | None) -> float | None:
    """The server's process_cpu_seconds_total (Prometheus' process collector), or None."""
    if not metrics_url:
        return None
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("process_cpu_seconds_total "):
                return float(line.split()[1])
    return None


def concurrent(args: argparse.Namespace, audio: np.ndarray, rate: int) -> dict[str, Any]:
    """`args.concurrent` Diarize calls of the recording at once, each on its own channel:
    the wall time of all, hours of audio diarized per second, and the server's CPU seconds
    over that wall time (the cores it used) when `--metrics` is given."""
    clients = [DiarizationClient(args.target, timeout_s=args.timeout) for _ in range(args.concurrent)]
    try:
        with ThreadPoolExecutor(args.concurrent) as pool:
            cpu_before = server_cpu_s(args.metrics)
            started = time.perf_counter()
            walls = list(pool.map(lambda client: timed(lambda: client.diarize(audio, rate))[0], clients))
            wall = time.perf_counter() - started
            cpu_after = server_cpu_s(args.metrics)
    finally:
        for client in clients:
            client.close()
    cores = None if cpu_before is None or cpu_after is None else round((cpu_after - cpu_before) / wall, 2)
    hours = args.concurrent * args.seconds / 3600
    return {
        "kind": "diarize-concurrent", "calls": args.concurrent, "audio_s": args.seconds,
        "wall_s": round(wall, 4), "call_wall_s": [round(w, 4) for w in walls],
        "hours_per_s": round(hours / wall, 3), "server_cores": cores,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m speakerd.tools.bench_diarize", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--target", required=True, help="the server, HOST:PORT")
    parser.add_argument("--audio", required=True, help="speech: any file libsndfile reads, or .npy")
    parser.add_argument("--sample-rate", type=int, help="with --audio FILE.npy: its sample rate in Hz")
    parser.add_argument("--seconds", type=float, default=3600.0, help="the recording's length, tiled")
    parser.add_argument("--runs", type=int, default=3, help="timed runs of each call")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="a call's deadline, s")
    parser.add_argument("--save", help="FILE.npz: the last run's segmentation and embeddings")
    parser.add_argument(
        "--vbx", action="store_true", help="also time Diarize with clustering vbx (needs --plda)"
    )
    parser.add_argument(
        "--concurrent", type=int, default=0, help="then N Diarize calls at once: hours per second"
    )
    parser.add_argument("--metrics", help="the server's /metrics URL: the CPU it used under --concurrent")
    args = parser.parse_args(argv)
    try:
        samples, rate = read_audio(args.audio, args.sample_rate)
        audio = tiled(samples, rate, args.seconds)
    except UsageError as error:
        print(f"bench_diarize: {error}", file=sys.stderr)
        return 2
    with DiarizationClient(args.target, timeout_s=args.timeout) as client:
        warm = tiled(samples, rate, min(WARMUP_S, args.seconds))
        client.embed_recording(warm, rate, None)
        client.diarize(warm, rate)
        if args.vbx:
            client.diarize(warm, rate, clustering=VBX)
        segment_walls, diarize_walls, vbx_walls = [], [], []
        for _ in range(args.runs):
            wall, segmented = timed(lambda: client.embed_recording(audio, rate, None))
            segment_walls.append(wall)
            wall, diarization = timed(lambda: client.diarize(audio, rate))
            diarize_walls.append(wall)
            if args.vbx:
                wall, by_vbx = timed(lambda: client.diarize(audio, rate, clustering=VBX))
                vbx_walls.append(wall)
    windows = int(segmented.embeddings.shape[0])
    print(json.dumps(summary("segment", args.seconds, segment_walls, windows=windows)), flush=True)
    turns = {"turns": len(diarization.turns), "speakers": len(diarization.speakers)}
    print(json.dumps(summary("diarize", args.seconds, diarize_walls, windows=windows, **turns)), flush=True)
    if args.vbx:
        turns = {"turns": len(by_vbx.turns), "speakers": len(by_vbx.speakers)}
        print(
            json.dumps(summary("diarize-vbx", args.seconds, vbx_walls, windows=windows, **turns)), flush=True
        )
    print(json.dumps(clustering_steps(segmented.segmentation, segmented.embeddings)), flush=True)
    if args.concurrent:
        print(json.dumps(concurrent(args, audio, rate)), flush=True)
    if args.save:
        binary = segmented.segmentation.astype(np.float32)
        windows, speakers = clean_speakers(segmented.embeddings, binary)
        np.savez_compressed(
            args.save,
            segmentation=segmented.segmentation.astype(np.uint8),
            embeddings=segmented.embeddings,
            clean=segmented.embeddings[windows, speakers],
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
