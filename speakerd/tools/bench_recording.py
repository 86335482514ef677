"""`python -m speakerd bench --recording SECONDS`: a whole recording through the GPU engine.

What EmbedRecording costs on the server, without the network: PCM s16 in host memory ->
decode (and downmix/resample when not 16 kHz mono) -> samples uploaded as they are decoded
-> the recording's fbank frames computed once on the GPU -> every 32-window batch's fbank
cut from them straight into the engine's staging slot -> trunk, pooling, linear -> the
last embedding back on the host. Batches run PIPELINE_DEPTH at a time as the server's
batcher runs them. One JSON line per math with the wall time end to end, its parts, and
the fbank's share of GPU time. `client load --recording SECONDS` measures the same job
through a server, network included.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from speakerd.engine.base import Engine
from speakerd.model.architecture import EMBEDDING_DIM, MASK_FRAMES, MAX_SPEAKERS
from speakerd.model.fbank import STEP_SAMPLES
from speakerd.model.recording import Encoding, RecordingDecoder, window_count
from speakerd.serving.batcher import PIPELINE_DEPTH

#: The client's piece size (speakerd.client.recording): the decoder sees what a server sees.
PIECE_BYTES = 1 << 20
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
    """(embeddings [n, 3, 256], timings in seconds) of one recording, the server's way."""
    started = time.perf_counter()
    decoder = RecordingDecoder(
        sample_rate, channels, Encoding.S16, source=engine.fbank_source(STEP_SAMPLES), step=STEP_SAMPLES
    )
    view = memoryview(pcm)
    for at in range(0, len(view), PIECE_BYTES):
        decoder.push(view[at : at + PIECE_BYTES])
    count = decoder.finish()
    decoded = time.perf_counter()
    assert count == masks.shape[0], f"{count} windows, masks for {masks.shape[0]}"
    rows = decoder.source.windows(0, count)
    out = np.empty((count, MAX_SPEAKERS, EMBEDDING_DIM), dtype=np.float32)
    compute = [0.0]

    def batch(first: int) -> None:
        stop = min(first + engine.max_batch, count)
        run = engine.run_batch([rows[first:stop]], [masks[first:stop]])
        out[first:stop] = run.embeddings
        compute[0] += run.compute_s

    with ThreadPoolExecutor(PIPELINE_DEPTH) as pool:
        list(pool.map(batch, range(0, count, engine.max_batch)))
    done = time.perf_counter()
    return out, {"total_s": done - started, "decode_s": decoded - started, "embed_s": done - decoded,
                 "trunk_compute_s": compute[0]}  # fmt: skip


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
