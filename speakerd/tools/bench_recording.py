"""`python -m speakerd bench --recording SECONDS`: a whole recording through the GPU engine.

What EmbedRecording costs on the server, without the network: PCM s16 in host memory ->
4 MiB pieces uploaded, decoded (and downmixed/resampled when not 16 kHz mono) and turned
into fbank frames on the GPU as they arrive -> each 32-window batch, as soon as its audio
is in, cut from the frames straight into the engine's staging slot -> trunk, pooling,
linear -> the last embedding back on the host. Batches run PIPELINE_DEPTH at a time as the
server's batcher runs them, overlapping the rest of the upload. One JSON line per math with
the wall time end to end, its parts, and the fbank's share of GPU time. `client load
--recording SECONDS` measures the same job through a server, network included.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from speakerd.client.recording import PIECE_BYTES  # the decoder sees the pieces a server sees
from speakerd.engine.base import Engine
from speakerd.model.architecture import EMBEDDING_DIM, MASK_FRAMES, MAX_SPEAKERS
from speakerd.model.fbank import STEP_SAMPLES
from speakerd.model.recording import Encoding, RecordingDecoder, window_count
from speakerd.serving.batching.batcher import PIPELINE_DEPTH

#: Speech-like level for the synthetic recording (-20 dBFS RMS); timing does not depend on it.
NOISE_RMS = 0.1


def synthetic_pcm(seconds: float, sample_rate: int, channels: int, seed: int = 0) -> np.ndarray:
    """Interleaved little-endian int16 PCM [frames * channels] of noise at speech level."""
    frames = int(seconds * sample_rate)
    noise = np.random.default_rng(seed).standard_normal((frames, channels), dtype=np.float32) * NOISE_RMS
    return np.clip(np.round(noise * 32767), -32768, 32767).astype("<i2").reshape(-1)


def embed_recording(
    engine: Engine, pcm: bytes, sample_rate: int, channels: int, masks: np.ndarray
) -> tuple[np.ndarray, dict[str, float]]:
    """(embeddings [n, 3, 256], timings in seconds) of one recording, the server's way: the
    masks are known up front (as the client sends them first), each batch of windows goes
    to the engine as soon as its audio is in, PIPELINE_DEPTH batches at a time."""
    started = time.perf_counter()
    decoder = RecordingDecoder(
        sample_rate, channels, Encoding.S16, source=engine.fbank_source(STEP_SAMPLES), step=STEP_SAMPLES
    )
    count = masks.shape[0]
    out = np.empty((count, MAX_SPEAKERS, EMBEDDING_DIM), dtype=np.float32)
    compute = [0.0]

    def batch(first: int, stop: int) -> None:
        run = engine.run_batch([decoder.source.windows(first, stop)], [masks[first:stop]])
        out[first:stop] = run.embeddings
        compute[0] += run.compute_s

    submitted, running = 0, deque[Future[None]]()

    def submit(available: int, final: bool) -> None:
        nonlocal submitted
        while available - submitted >= engine.max_batch or (final and available > submitted):
            stop = min(submitted + engine.max_batch, available)
            if len(running) > PIPELINE_DEPTH:  # the server's BATCHES_IN_FLIGHT
                running.popleft().result()
            running.append(pool.submit(batch, submitted, stop))
            submitted = stop

    view = memoryview(pcm)
    with ThreadPoolExecutor(PIPELINE_DEPTH) as pool:
        for at in range(0, len(view), PIECE_BYTES):
            decoder.push(view[at : at + PIECE_BYTES])
            submit(decoder.ready(), final=False)
        windows = decoder.finish()
        assert windows == count, f"{windows} windows, masks for {count}"
        audio_in = time.perf_counter()
        submit(windows, final=True)
        for future in running:
            future.result()
    done = time.perf_counter()
    return out, {"total_s": done - started, "audio_in_s": audio_in - started,
                 "after_audio_s": done - audio_in, "trunk_compute_s": compute[0]}  # fmt: skip


def bench(engine: Engine, seconds: float, sample_rate: int, channels: int, runs: int) -> dict[str, object]:
    """The median of `runs` end-to-end timings (after one untimed run), as a JSON-ready dict."""
    from speakerd.engine.gpu.fbank import DEFAULT_MAX_WINDOWS, benchmark_hour

    pcm = synthetic_pcm(seconds, sample_rate, channels).tobytes()
    count = window_count(int(seconds * 16_000))
    rng = np.random.default_rng(1)
    masks = (rng.random((count, MAX_SPEAKERS, MASK_FRAMES)) > 0.5).astype(np.float32)
    embed_recording(engine, pcm, sample_rate, channels, masks)  # warm: CuPy pools, kernel caches
    timings = [embed_recording(engine, pcm, sample_rate, channels, masks)[1] for _ in range(runs)]
    median = {key: float(np.median([t[key] for t in timings])) for key in timings[0]}
    fbank = benchmark_hour() if seconds == 3600 and sample_rate == 16_000 else None
    report: dict[str, object] = {
        "kind": "recording", "math": str(engine.math), "audio_s": seconds, "sample_rate": sample_rate,
        "channels": channels, "windows": count, "pcm_bytes": len(pcm), "runs": runs,
        **{key: round(value, 4) for key, value in median.items()},
        "windows_per_s": round(count / median["total_s"], 1),
    }  # fmt: skip
    if fbank is not None:
        fbank_ms = float(fbank["frames_ms"]) + float(fbank[f"windows_by_{DEFAULT_MAX_WINDOWS}_eager_ms"])
        report["fbank_gpu_ms"] = round(fbank_ms, 3)
        report["fbank_share_of_gpu_time"] = round(fbank_ms / (fbank_ms + 1e3 * median["trunk_compute_s"]), 5)
    return report
