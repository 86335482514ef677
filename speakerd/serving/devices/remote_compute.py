"""The segmentation and the clustering's linkage on the device workers of `serve --devices`.

Why: with one GPU in process, a segmenting call's windows are segmented on the GPU
(engine/gpu/segmentation) and Diarize's centroid linkage runs there (engine/gpu/linkage.py);
with `--devices` the GPUs belong to the workers, and the server's CPU would take minutes to
segment an hour and ~0.3 s more to link it. So each worker builds the segmentation engine
beside its embedding engine, and the server's segmenter and device linkage are these
proxies. A recording's group of windows is segmented by its home worker from the samples it
keeps (remote_recording.KeptWindows). Samples handed in (any other caller) and a linkage's
rows go to the device with the fewest such calls waiting (ties: the lowest index), pickled
through the worker's pipe (an hour's clean rows are 5.4 MB of float32, a linkage matrix
170 KB); those keep no state between calls, so a call whose device is lost meanwhile runs
again on another; with none left it fails with NoDevice (UNAVAILABLE). A device that cannot
link a call's rows (its memory) answers so, and the caller links on the host, as in process.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import numpy as np

from speakerd.engine.segmenter import Segmentation, Segmenter
from speakerd.serving.devices.remote_recording import KeptWindows


class ComputeLink(Protocol):
    """What the proxies need of the pool (device_pool.py implements it)."""

    def ask(self, op: str, args: tuple[Any, ...]) -> Any:
        """Run `op` on the least-busy live device, again on another if that one is lost;
        its answer. MemoryError or ValueError as the worker raised them; NoDevice when no
        device is left."""
        ...


class RemoteSegmenter(Segmenter):
    """The segmentation engine of the workers (each built the same model, `model_id`)."""

    def __init__(self, link: ComputeLink, name: str, model_id: str, max_windows: int) -> None:
        self.link = link
        self.name = f"devices/{name}"
        self.model_id = model_id
        self.max_windows = max_windows

    def segment(self, samples: np.ndarray | KeptWindows, starts: np.ndarray) -> Segmentation:
        """Samples sent to the least busy device; or a recording's windows whose samples its
        worker keeps (remote_recording.KeptWindows), segmented there."""
        started = time.perf_counter()
        if isinstance(samples, KeptWindows):
            multilabel, _ = samples.segment()
        else:
            samples = np.ascontiguousarray(samples, dtype=np.float32)
            starts = np.ascontiguousarray(starts, dtype=np.int64)
            multilabel, _ = self.link.ask("segment", (samples, starts))
        # the round trip, pipe included: what the call waited for
        return Segmentation(multilabel, time.perf_counter() - started)


class RemoteLinkage:
    """model/diarization/linkage.py's DeviceLinkage on the workers' GPUs: up to `max_rows`
    (the smallest any worker takes); MemoryError when the device chosen has not the memory
    for a call, so the caller links on the host."""

    def __init__(self, link: ComputeLink, max_rows: int) -> None:
        self.link = link
        self.max_rows = max_rows

    def can_implement(self, rows: int) -> bool:
        return 2 <= rows <= self.max_rows

    def __call__(self, points: np.ndarray) -> np.ndarray:
        return self.link.ask("link", (np.ascontiguousarray(points),))
