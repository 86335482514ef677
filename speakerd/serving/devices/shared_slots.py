"""Batch slots in shared memory between the server and a device worker process.

Why: a b32 batch is 10.2 MB of fbank. Sent through a pipe it would be pickled by the server
and unpickled by the worker, two copies and a GIL-held serialisation per batch on the front
end that already limits one GPU. Instead each worker has a few slots of shared memory the
server writes a batch's rows into (the one copy it would make into a staging buffer
anyway) and the worker reads in place; the embeddings come back the same way. The pipe
carries only the slot's number and a handful of counters.

A slot holds, for up to `max_batch` chunks:
- fbank [max_batch, 998, 80] float32;
- masks [max_batch, 3, 125] float32: already resized onto the trunk's 125 frames with
  pyannote's nearest resize, which every engine applies anyway (and which is the identity
  at 125), so a request's 10,000-frame masks do not size every slot;
- out [max_batch, 3, 256] float32.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from multiprocessing import shared_memory

import numpy as np

from speakerd.model.architecture import EMBEDDING_DIM, FRAMES, MAX_SPEAKERS, MEL_BINS, TRUNK_FRAMES

#: Where Linux keeps POSIX shared memory. A container's is small by default (Docker and
#: Kubernetes: 64 MiB), and a write past its end kills the writer with SIGBUS, so the
#: server checks its room before creating slots (`shared_memory_free`).
SHM_DIR = "/dev/shm"
#: Offsets of the arrays inside a slot are rounded up to this many bytes: a cache line,
#: so the worker's reads of one array never share a line with the server's writes of another.
ALIGN_BYTES = 64
_FLOAT = np.dtype(np.float32)


def _aligned(size: int) -> int:
    return -(-size // ALIGN_BYTES) * ALIGN_BYTES


@dataclass(frozen=True)
class SlotLayout:
    """Where fbank, masks and out lie in a slot for batches of up to `max_batch` chunks."""

    max_batch: int

    @property
    def fbank_shape(self) -> tuple[int, int, int]:
        return (self.max_batch, FRAMES, MEL_BINS)

    @property
    def masks_shape(self) -> tuple[int, int, int]:
        return (self.max_batch, MAX_SPEAKERS, TRUNK_FRAMES)

    @property
    def out_shape(self) -> tuple[int, int, int]:
        return (self.max_batch, MAX_SPEAKERS, EMBEDDING_DIM)

    def _offsets(self) -> tuple[int, int, int, int]:
        sizes = [int(np.prod(shape)) * _FLOAT.itemsize for shape in self._shapes()]
        fbank = 0
        masks = fbank + _aligned(sizes[0])
        out = masks + _aligned(sizes[1])
        return fbank, masks, out, out + _aligned(sizes[2])

    def _shapes(self) -> tuple[tuple[int, int, int], ...]:
        return (self.fbank_shape, self.masks_shape, self.out_shape)

    @property
    def nbytes(self) -> int:
        """Bytes of one slot (10.4 MB at max_batch 32)."""
        return self._offsets()[3]

    def views(self, buffer: memoryview) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(fbank, masks, out) arrays over `buffer`, no copy."""
        offsets = self._offsets()
        return tuple(  # type: ignore[return-value]
            np.ndarray(shape, dtype=_FLOAT, buffer=buffer, offset=offset)
            for shape, offset in zip(self._shapes(), offsets[:3], strict=True)
        )


class SharedSlot:
    """One slot: created (and finally unlinked) by the server, attached by name in a worker."""

    def __init__(self, layout: SlotLayout, name: str | None = None) -> None:
        self.layout = layout
        self.owner = name is None
        self._memory = shared_memory.SharedMemory(name=name, create=self.owner, size=layout.nbytes)
        self.fbank, self.masks, self.out = layout.views(self._memory.buf)
        self._closed = False

    @property
    def name(self) -> str:
        return self._memory.name

    def close(self) -> None:
        """Drop the views and the mapping; the owner also removes the segment itself (idempotent)."""
        if self._closed:
            return
        self._closed = True
        del self.fbank, self.masks, self.out  # views pin the buffer: SharedMemory.close refuses otherwise
        self._memory.close()
        if self.owner:
            self._memory.unlink()


def shared_memory_free() -> int | None:
    """Bytes free in SHM_DIR; None where there is no such directory (not Linux)."""
    try:
        return shutil.disk_usage(SHM_DIR).free
    except OSError:
        return None


#: Bytes of one audio slot: a recording's PCM or samples travel to its device's worker a slot
#: at a time (remote_recording.py), 4 MiB = 131 s of 16 kHz 16-bit mono, 22 s of 48 kHz
#: stereo float32, or 13 windows' fbank rows coming back.
AUDIO_SLOT_BYTES = 4 << 20


class AudioSlot:
    """Bytes in shared memory: created (and finally unlinked) by the server, attached by name
    in a worker; `buf` is the whole slot."""

    def __init__(self, nbytes: int = AUDIO_SLOT_BYTES, name: str | None = None) -> None:
        self.owner = name is None
        self._memory = shared_memory.SharedMemory(name=name, create=self.owner, size=nbytes)
        self.nbytes = nbytes if self.owner else min(nbytes, self._memory.size)
        self._closed = False

    @property
    def name(self) -> str:
        return self._memory.name

    @property
    def buf(self) -> memoryview:
        return self._memory.buf

    def close(self) -> None:
        """Drop the mapping; the owner also removes the segment (idempotent). Views of `buf`
        must be released first."""
        if self._closed:
            return
        self._closed = True
        self._memory.close()
        if self.owner:
            self._memory.unlink()
