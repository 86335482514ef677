"""`CpuSegmenter`: pyannote/segmentation-3.0 in NumPy on the host (engine/segmenter.py's interface).

It runs speakerd.model.segmentation's forward (SincNet once over the group's samples, the
LSTM vectorised over the group's windows) and holds no state between calls, so the
recording threads may call it at once.
"""

from __future__ import annotations

import time

import numpy as np

from speakerd.engine.segmenter import Segmentation, Segmenter
from speakerd.model.segmentation.architecture import OUTPUT_FRAMES, SPEAKERS
from speakerd.model.segmentation.forward import recording_log_probs
from speakerd.model.segmentation.powerset import to_multilabel
from speakerd.model.segmentation.weights import SegmentationModel

#: Windows one CPU forward takes at once. The LSTM's 4 x 589 steps run one matmul per step
#: over the whole group, so larger groups amortise NumPy's per-step overhead; 32 windows keep
#: a group's activations near 80 MB and the first window's masks within a few seconds of its
#: audio on 2 cores.
CPU_GROUP_WINDOWS = 32


class CpuSegmenter(Segmenter):
    """pyannote/segmentation-3.0 in NumPy on the host."""

    name = "cpu-numpy"

    def __init__(self, weights: SegmentationModel, max_windows: int = CPU_GROUP_WINDOWS) -> None:
        self.weights = weights
        self.model_id = weights.model_id
        self.max_windows = max_windows

    def segment(self, samples: np.ndarray, starts: np.ndarray) -> Segmentation:
        starts = np.asarray(starts, dtype=np.int64)
        assert 1 <= starts.shape[0] <= self.max_windows, (
            f"{starts.shape[0]} windows, expected 1..{self.max_windows}"
        )
        started = time.perf_counter()
        log_probs = recording_log_probs(self.weights, samples, starts)
        multilabel = to_multilabel(log_probs)
        assert multilabel.shape == (starts.shape[0], OUTPUT_FRAMES, SPEAKERS), multilabel.shape
        return Segmentation(multilabel.astype(np.uint8, copy=False), time.perf_counter() - started)
