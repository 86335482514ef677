"""`python -m speakerd.pyannote.bench --target HOST:PORT --audio-seconds 3600 --segmentation CKPT`:
the whole pyannote.audio diarization pipeline on long audio, pyannote alone vs pyannote +
speakerd, as one JSON object.

The audio is pyannote's bundled sample.wav (30 s, two speakers) tiled to `--audio-seconds`,
held in memory (no decoder needed). Both runs use the same pipeline objects built without a
hub (speakerd.pyannote.models: segmentation-3.0 from `--segmentation`, pyannote's
WeSpeakerResNet34 holding `--weights`, AgglomerativeClustering); the server must serve the
same weights (the default synthetic model on both sides unless told otherwise). Each run is
preceded by a warm-up on one tile (CUDA start-up, cuDNN autotuning), reported apart. The
segmentation and embedding steps are timed by wrapping the pipeline's `get_segmentations`
and `get_embeddings`, so `embeddings_share` is the embedding step's part of the whole.
`parity` compares the two runs: the embeddings' min cosine over non-empty rows and the
diarization error rate between the two outputs (0 when they diarize alike).

`--server-segmentation`: the served run is `remote_pipeline` (segmentation and embeddings from
one server call per file, no weights in this process; the server must serve the same
segmentation-3.0 as `--segmentation`, `serve --segmentation-model`), and `parity` also counts
the (window, frame, speaker) cells where its segmentation differs from pyannote's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: The benchmark must not time pyannote's telemetry exporter (5 s timeouts where there is no
#: network) nor send anything: off unless the caller set it.
os.environ.setdefault("PYANNOTE_METRICS_ENABLED", "false")

import numpy as np
import soundfile
import torch
from pyannote.metrics.diarization import DiarizationErrorRate

from speakerd.model.numerics import compare
from speakerd.model.store import default_weights_path
from speakerd.pyannote import models
from speakerd.pyannote.remote import remote_pipeline
from speakerd.pyannote.server import DEFAULT_TIMEOUT_S, use_server

#: The issue's benchmark: an hour of audio.
DEFAULT_AUDIO_SECONDS = 3600.0


class Timed:
    """Wraps a pipeline step: records the wall time of each call and what it returned."""

    def __init__(self, step: Callable[..., Any]) -> None:
        self.step = step
        self.seconds = 0.0
        self.result: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        self.result = self.step(*args, **kwargs)
        self.seconds += time.perf_counter() - started
        return self.result


def tiled_sample(seconds: float) -> tuple[np.ndarray, int]:
    """sample.wav repeated to `seconds` of audio: [N, C] float32 and its rate."""
    samples, rate = soundfile.read(str(models.sample_path()), dtype="float32", always_2d=True)
    frames = round(seconds * rate)
    repeats = -(-frames // samples.shape[0])
    return np.tile(samples, (repeats, 1))[:frames], int(rate)


def run(pipeline: Any, file: dict[str, Any]) -> dict[str, Any]:
    """Apply `pipeline` once with its two heavy steps timed; the timings and the outputs."""
    segmentations, embeddings = Timed(pipeline.get_segmentations), Timed(pipeline.get_embeddings)
    pipeline.get_segmentations, pipeline.get_embeddings = segmentations, embeddings
    try:
        started = time.perf_counter()
        output = pipeline(dict(file))
        total = time.perf_counter() - started
    finally:
        pipeline.get_segmentations, pipeline.get_embeddings = segmentations.step, embeddings.step
    return {
        "total_s": round(total, 3),
        "segmentation_s": round(segmentations.seconds, 3),
        "embeddings_s": round(embeddings.seconds, 3),
        "embeddings_share": round(embeddings.seconds / total, 4),
        "rest_s": round(total - segmentations.seconds - embeddings.seconds, 3),
        # what a server takes over: with server segmentation both come from one call, which
        # pyannote makes in get_segmentations (get_embeddings then answers from it)
        "model_steps_s": round(segmentations.seconds + embeddings.seconds, 3),
        "speakers": len(output.speaker_diarization.labels()),
        "_output": output,
        "_embeddings": embeddings.result,
        "_segmentations": segmentations.result,
    }


def measure(pipeline: Any, warmup: dict[str, Any], file: dict[str, Any]) -> dict[str, Any]:
    started = time.perf_counter()
    pipeline(dict(warmup))
    result = run(pipeline, file)
    result["warmup_s"] = round(time.perf_counter() - started - result["total_s"], 3)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m speakerd.pyannote.bench", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--target", required=True, help="the speakerd server, HOST:PORT")
    parser.add_argument("--segmentation", required=True, help="segmentation-3.0's pytorch_model.bin")
    parser.add_argument(
        "--weights", help="the served safetensors weights (default: the synthetic default model)"
    )
    parser.add_argument("--audio-seconds", type=float, default=DEFAULT_AUDIO_SECONDS)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-size", type=int, default=models.DEFAULT_BATCH_SIZE,
                        help="segmentation and embedding batch size of the pipeline")  # fmt: skip
    parser.add_argument("--exclude-overlap", action="store_true", help="embedding_exclude_overlap")
    parser.add_argument("--skip-local", action="store_true", help="time pyannote + speakerd only")
    parser.add_argument(
        "--server-segmentation",
        action="store_true",
        help="the server segments too: remote_pipeline, no weights in the client (module doc)",
    )
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="one recording's deadline")
    parser.add_argument("--output", help="also write the JSON here")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    weights = Path(args.weights) if args.weights else default_weights_path()
    segmentation = models.segmentation_model(args.segmentation)
    embedding = models.embedding_model(weights)

    def pipeline() -> Any:
        built = models.diarization_pipeline(segmentation, embedding, args.exclude_overlap, args.batch_size)
        return built.to(device)

    samples, rate = tiled_sample(args.audio_seconds)
    file = models.in_memory(samples, rate, "tiled-sample")
    warmup = models.in_memory(tiled_sample(30.0)[0], rate, "warmup")
    report: dict[str, Any] = {
        "audio_seconds": args.audio_seconds,
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "pyannote_audio": _version("pyannote.audio"),
        "batch_size": args.batch_size,
        "exclude_overlap": args.exclude_overlap,
        "target": args.target,
    }
    local = None if args.skip_local else measure(pipeline(), warmup, file)

    started = time.perf_counter()
    if args.server_segmentation:
        served_pipeline = remote_pipeline(
            args.target,
            exclude_overlap=args.exclude_overlap,
            batch_size=args.batch_size,
            timeout_s=args.timeout,
        )
    else:
        served_pipeline = use_server(pipeline(), args.target, timeout_s=args.timeout)
    connect_s = time.perf_counter() - started
    embeddings = served_pipeline.get_embeddings
    info = embeddings.client.model_info()
    report["server"] = {"engine": info.engine, "precision": info.precision, "model_id": info.model_id[:16],
                        "segmentation_engine": info.segmentation.engine,
                        "segmentation_model_id": info.segmentation.model_id[:16]}  # fmt: skip
    if embeddings.verified is not None:
        report["server"]["probe_min_cosine"] = round(embeddings.verified.min_cosine, 7)
    report["server_segmentation"] = args.server_segmentation
    served = measure(served_pipeline, warmup, file)
    served["use_server_s"] = round(connect_s, 3)
    served["windows"], served["bytes_sent"] = (
        embeddings.last.windows,
        embeddings.last.audio_bytes + (embeddings.last.mask_bytes),
    )
    if local is not None:
        empty = embeddings.last.empty
        parity = compare(served["_embeddings"][~empty], local["_embeddings"][~empty])
        report["pyannote"] = _public(local)
        report["speedup_total"] = round(local["total_s"] / served["total_s"], 2)
        report["speedup_model_steps"] = round(local["model_steps_s"] / served["model_steps_s"], 2)
        if not args.server_segmentation:
            report["speedup_embeddings"] = round(local["embeddings_s"] / served["embeddings_s"], 2)
        local_cells, served_cells = local["_segmentations"].data, served["_segmentations"].data
        report["parity"] = {
            "segmentation_cells": int(local_cells.size),
            "segmentation_cells_differ": int(np.sum(local_cells != served_cells)),
            "rows": parity.rows,
            "empty_rows": int(empty.sum()),
            "min_cosine": round(parity.min_cosine, 7),
            "der": round(
                float(
                    DiarizationErrorRate()(
                        local["_output"].speaker_diarization, served["_output"].speaker_diarization
                    )
                ),
                6,
            ),
        }
    report["speakerd"] = _public(served)
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 0


def _public(result: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in result.items() if not key.startswith("_")}


def _version(distribution: str) -> str:
    from importlib.metadata import version

    return version(distribution)


if __name__ == "__main__":
    sys.exit(main())
