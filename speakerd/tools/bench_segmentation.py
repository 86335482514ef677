"""`python -m speakerd bench-segmentation`: the NumPy segmentation forward on a long recording.

Times `recording_log_probs` (the filter bank shared over the recording) on a synthetic
speech-like recording of `--seconds` with pyannote's windows (10 s, step 1 s: 591 for 10
minutes), with the segmentation model `--segmentation-model` names (the synthetic one by
default: the timing does not depend on the weights). `--straight` times `log_probs` on the
same windows too; `--pyannote CHECKPOINT` times pyannote.audio's own model (torch, its
default threads, batches of 32 as the pipeline's `segmentation_batch_size`) on them, in the
same run, as the anchor. Prints one line per measurement and the peak resident memory.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np

from speakerd.model.audio import synthetic_recording
from speakerd.model.fbank import chunk_recording, chunk_starts
from speakerd.model.segmentation import forward
from speakerd.model.segmentation.weights import load_model
from speakerd.model.source import SEGMENTATION, ModelError, add_segmentation_model_flag, resolve_model

USAGE_EXIT = 2
#: pyannote's hub pipelines segment in batches of 32 windows (speakerd.pyannote.models).
PYANNOTE_BATCH = 32
#: The recording's seed: any speech-like audio times the same.
AUDIO_SEED = 3


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=600.0, help="length of the recording")
    add_segmentation_model_flag(parser)
    parser.add_argument("--straight", action="store_true", help="time log_probs (per window) too")
    parser.add_argument(
        "--pyannote", type=Path, help="time pyannote's own model of this pytorch_model.bin too"
    )


def _report(name: str, seconds: float, elapsed: float, windows: int) -> None:
    print(
        f"{name}: {seconds:.0f} s of audio, {windows} windows in {elapsed:.2f} s "
        f"({elapsed / windows * 1e3:.1f} ms a window, {seconds / elapsed:.0f}x real time)"
    )


def _time_pyannote(checkpoint: Path, windows: np.ndarray) -> float:
    os.environ.setdefault("PYANNOTE_METRICS_ENABLED", "false")
    import torch
    from pyannote.audio import Model

    model = Model.from_pretrained(str(checkpoint)).eval()
    started = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, windows.shape[0], PYANNOTE_BATCH):
            model(torch.from_numpy(windows[first : first + PYANNOTE_BATCH, None]))
    return time.perf_counter() - started


def run(args: argparse.Namespace) -> int:
    try:
        model = load_model(resolve_model(args.segmentation_model, "--segmentation-model", SEGMENTATION).path)
    except ModelError as error:
        print(f"bench-segmentation: {error}", file=sys.stderr)
        return USAGE_EXIT
    recording = synthetic_recording(args.seconds, seed=AUDIO_SEED)
    starts = chunk_starts(recording.samples.shape[0])
    print(
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}, {forward.GROUP_WINDOWS}-window groups"
    )
    started = time.perf_counter()
    forward.recording_log_probs(model, recording.samples, starts)
    _report("recording_log_probs", args.seconds, time.perf_counter() - started, starts.shape[0])
    if args.straight or args.pyannote:
        windows = chunk_recording(recording.samples).waveforms
        if args.straight:
            started = time.perf_counter()
            forward.log_probs(model, windows)
            _report("log_probs", args.seconds, time.perf_counter() - started, windows.shape[0])
        if args.pyannote:
            _report(
                "pyannote (torch)", args.seconds, _time_pyannote(args.pyannote, windows), windows.shape[0]
            )
    print(f"peak resident memory {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")
    return 0
