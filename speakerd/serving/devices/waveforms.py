"""EmbedChunks' waveform chunks sent to the device that runs their batch (`serve --devices`).

Why: with one GPU engine in process, a waveform chunk's fbank is computed on the GPU when
its batch is staged (engine/gpu/waveform.py); on the server's host it costs ~8 ms of NumPy
a chunk, which a front end serving several GPUs cannot spare. So the pool's
`waveform_fbank` returns `HostWaveforms`: the checked waveforms themselves, as rows that
say which batch rows they fill. When a batch holding them is given a device, the pool sends
each piece's waveforms to that device's worker through its audio slots (a slot holds
WAVEFORMS_PER_SLOT chunks), the worker turns them into fbank rows with its own engine
(`Engine.waveform_fbank`: on its GPU), keeps those for the batch, and the batch's "run"
message names them instead of carrying fbank. `np.asarray` gives the host's fbank, for
anything else that must read them.
"""

from __future__ import annotations

import numpy as np

from speakerd.engine.device_rows import DeviceRows
from speakerd.model.architecture import CHUNK_SAMPLES
from speakerd.model.fbank import fbank as fbank_of

#: Bytes of one waveform chunk (10 s of 16 kHz float32).
CHUNK_BYTES = CHUNK_SAMPLES * 4


def waveforms_per_slot(audio_bytes: int) -> int:
    """Chunks one audio slot of `audio_bytes` carries (6 of 640,000 bytes in 4 MiB)."""
    return max(1, audio_bytes // CHUNK_BYTES)


class HostWaveforms(DeviceRows):
    """Waveform chunks [n, 160000] float32 (checked) standing for their fbank rows."""

    def __init__(self, waveform: np.ndarray) -> None:
        self.waveform = np.ascontiguousarray(waveform, dtype=np.float32)

    def __len__(self) -> int:
        return int(self.waveform.shape[0])

    def _rows(self, start: int, stop: int) -> HostWaveforms:
        return HostWaveforms(self.waveform[start:stop])

    def _to_host(self) -> np.ndarray:
        return fbank_of(self.waveform)
