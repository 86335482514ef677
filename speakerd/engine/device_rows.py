"""fbank rows that stay on the device until an engine stages them (engine.base.DeviceFbank).

Shared by a recording's windows (engine/gpu/recording.py) and EmbedChunks' waveform chunks
(engine/gpu/waveform.py), and by `serve --devices`' windows that lie in a device worker
(serving/devices/remote_recording.py): an array-like of [rows, 998, 80] float32 that slices
along its rows and copies to the host through `np.asarray` (a GPU's rows also write
themselves into a device buffer, `write_device`).
"""

from __future__ import annotations

import numpy as np

from speakerd.model.architecture import FRAMES, MEL_BINS


class DeviceRows:
    """Rows [0, len) of some device-computed fbank; subclasses say how to slice and write."""

    ndim = 3
    dtype = np.dtype(np.float32)

    def __len__(self) -> int:
        raise NotImplementedError

    @property
    def shape(self) -> tuple[int, int, int]:
        return (len(self), FRAMES, MEL_BINS)

    @property
    def size(self) -> int:
        return len(self) * FRAMES * MEL_BINS

    def __getitem__(self, rows: slice) -> DeviceRows:
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise TypeError(f"{type(self).__name__} takes a contiguous slice of rows, not {rows!r}")
        start, stop, _ = rows.indices(len(self))
        return self._rows(start, max(start, stop))

    def _rows(self, start: int, stop: int) -> DeviceRows:
        """Rows [start, stop) of these rows."""
        raise NotImplementedError

    def _to_host(self) -> np.ndarray:
        raise NotImplementedError

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        host = self._to_host()
        return host if dtype is None else host.astype(dtype, copy=False)
