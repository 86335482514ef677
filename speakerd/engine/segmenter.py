"""The segmentation engine: a recording's windows in, pyannote's hard multilabel segmentation out.

`Segmenter` is what the recording path (serving/api/recording.py) calls when a client asks
the server to segment (`RecordingHeader.segment`): the 16 kHz samples covering a group of
consecutive windows, and where each window starts in them, become the windows' powerset
log-probabilities and their multilabel conversion, `[k, 589, 3]` uint8, the masks the
embeddings are then pooled under. One interface, so a device backend slots in beside the
CPU one as the embedding engines do.

Backends: `engine/cpu_segmenter.py` (NumPy) and `engine/gpu/segmentation/` (CuPy).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Segmentation:
    """A group of windows' segmentation and what it cost."""

    multilabel: np.ndarray  # [k, 589, 3] uint8 in {0, 1}
    compute_s: float


class Segmenter(abc.ABC):
    """A segmentation model loaded for serving."""

    #: e.g. "cpu-numpy"
    name: str
    #: sha256 of the served segmentation weights file
    model_id: str
    #: most windows one `segment` call takes
    max_windows: int

    @abc.abstractmethod
    def segment(self, samples: np.ndarray, starts: np.ndarray) -> Segmentation:
        """Windows starting at `starts` (int64 sample offsets into `samples`, ascending,
        multiples of the SincNet stride) of 16 kHz mono float32 `samples`; a window reaching
        past the end is zero-padded, as pyannote pads the last one. At most `max_windows`."""

    def close(self) -> None:  # noqa: B027 - the CPU segmenter holds nothing to release
        """Release device resources."""
