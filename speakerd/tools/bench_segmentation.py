"""`python -m speakerd bench-segmentation`: the NumPy segmentation forward on a long recording.

Times `recording_log_probs` (the filter bank shared over the recording) on a synthetic
speech-like recording of `--seconds` with pyannote's windows (10 s, step 1 s: 591 for 10
minutes), with the segmentation model `--segmentation-model` names (the synthetic one by
default: the timing does not depend on the weights). `--straight` times `log_probs` on the
same windows too; `--pyannote CHECKPOINT` times pyannote.audio's own model (torch, batches
of 32 as the pipeline's `segmentation_batch_size`) on them, in the same run, as the anchor
(`--torch-threads`: torch's thread count; its OpenMP threads spin while they wait, which on
cores shared with other work costs it far more than a thread less). Prints one line per
measurement (wall and CPU seconds: on a loaded machine the CPU time is the steadier
figure) and the peak resident memory.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from collections.abc import Callable
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
    parser.add_argument(
        "--torch-threads", type=int, help="torch.set_num_threads for --pyannote (default: torch's)"
    )


def _timed(function: Callable[[], object]) -> tuple[float, float]:
    """(wall, CPU) seconds of `function()`; CPU counts every thread of the process."""
    wall, cpu = time.perf_counter(), time.process_time()
    function()
    return time.perf_counter() - wall, time.process_time() - cpu


def _report(name: str, seconds: float, timed: tuple[float, float], windows: int) -> None:
    wall, cpu = timed
    print(
        f"{name}: {seconds:.0f} s of audio, {windows} windows in {wall:.2f} s "
        f"({wall / windows * 1e3:.1f} ms a window, {seconds / wall:.0f}x real time), "
        f"{cpu:.2f} CPU s ({cpu / windows * 1e3:.1f} ms a window)"
    )


def _pyannote(checkpoint: Path, windows: np.ndarray, threads: int | None) -> Callable[[], None]:
    """pyannote's own forward over `windows`, ready to time (the model loaded first)."""
    os.environ.setdefault("PYANNOTE_METRICS_ENABLED", "false")
    import torch
    from pyannote.audio import Model

    if threads:
        torch.set_num_threads(threads)
    model = Model.from_pretrained(str(checkpoint)).eval()

    def run() -> None:
        with torch.inference_mode():
            for first in range(0, windows.shape[0], PYANNOTE_BATCH):
                model(torch.from_numpy(windows[first : first + PYANNOTE_BATCH, None]))

    return run


def run(args: argparse.Namespace) -> int:
    try:
        model = load_model(resolve_model(args.segmentation_model, "--segmentation-model", SEGMENTATION).path)
    except ModelError as error:
        print(f"bench-segmentation: {error}", file=sys.stderr)
        return USAGE_EXIT
    recording = synthetic_recording(args.seconds, seed=AUDIO_SEED)
    starts = chunk_starts(recording.samples.shape[0])
    load = os.getloadavg()[0]
    print(f"{os.cpu_count()} CPUs, load average {load:.2f}, {forward.GROUP_WINDOWS}-window groups")
    timed = _timed(lambda: forward.recording_log_probs(model, recording.samples, starts))
    _report("recording_log_probs", args.seconds, timed, starts.shape[0])
    windows = chunk_recording(recording.samples).waveforms
    if args.straight:
        _report(
            "log_probs", args.seconds, _timed(lambda: forward.log_probs(model, windows)), windows.shape[0]
        )
    if args.pyannote:
        name = f"pyannote (torch, {args.torch_threads or 'default'} threads)"
        _report(
            name,
            args.seconds,
            _timed(_pyannote(args.pyannote, windows, args.torch_threads)),
            windows.shape[0],
        )
    print(f"peak resident memory {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")
    return 0
