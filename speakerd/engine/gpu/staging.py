"""Input staging: a batch's host-to-device copy made while another batch computes.

Why: a b32 batch is 14 MB of fbank and masks, 1-2 ms over PCIe next to ~7 ms of TF32
compute. If the copy went straight into a plan's input buffers it would have to wait for
the plan's previous batch to finish, so copy and compute would alternate. Instead each
batch is staged into one of a few `InputSlot`s (pinned host memory and a device buffer of
the largest plan's size) on a copy stream of its own, outside the engine's compute lock;
the compute stream then waits for that copy's event and moves the slot into the plan's
inputs with a device-to-device copy (~10 us for b32), so the captured graph keeps its
fixed input pointers.
"""

from __future__ import annotations

import numpy as np

from speakerd.engine.base import BatchInputs, DeviceFbank
from speakerd.engine.gpu import held
from speakerd.model.architecture import EMBEDDING_DIM, FRAMES, MAX_SPEAKERS, MEL_BINS
from speakerd.model.inputs import MAX_MASK_FRAMES

#: Slots in rotation, one per batch the batcher keeps in flight (batcher.PIPELINE_DEPTH):
#: one consumed by the compute stream while the others fill. A thread finding none free
#: waits; more would only hold memory.
INPUT_SLOTS = 3


class InputSlot:
    """Pinned host and device staging for one batch of up to `batch` chunks."""

    def __init__(self, batch: int) -> None:
        import cupy

        self.batch = batch
        self.fbank = cupy.zeros((batch * FRAMES * MEL_BINS,), dtype=cupy.float32)
        self.masks = cupy.zeros((batch * MAX_SPEAKERS * MAX_MASK_FRAMES,), dtype=cupy.float32)
        self.frames = cupy.ones((1,), dtype=cupy.int32)
        self.host_fbank = pinned((batch * FRAMES * MEL_BINS,), np.float32)
        self.host_masks = pinned((batch * MAX_SPEAKERS * MAX_MASK_FRAMES,), np.float32)
        self.host_frames = pinned((1,), np.int32)
        self.ready = cupy.cuda.Event(block=True, disable_timing=True)  # the H2D copy finished
        self.fbank_elements = 0
        self.mask_elements = 0
        # the batch's results come back here, not into its plan's buffers: the compute lock
        # is let go once a batch is enqueued, and the next batch on the same plan may finish
        # its own download before this thread has read these
        rows = batch * MAX_SPEAKERS
        self.host_output = pinned((rows, EMBEDDING_DIM), np.float32)
        self.host_active = pinned((rows,), np.int32)
        self.host_flag = pinned((1,), np.int32)
        self.started = cupy.cuda.Event()  # timing: the forward's first launch ...
        self.computed = cupy.cuda.Event()  # ... and its end (the download follows)
        self.finished = cupy.cuda.Event(block=True)  # results on the host: waited for off the lock

    def stage(self, inputs: BatchInputs, stream) -> None:
        """Copy a checked batch into pinned memory, piece by piece at its offset (no joined
        copy of the batch on the host), enqueue its upload on `stream` (the copy stream) and
        record `ready` after it."""
        self.fbank_elements = inputs.chunks * FRAMES * MEL_BINS
        self.mask_elements = inputs.chunks * MAX_SPEAKERS * inputs.frames
        assert self.fbank_elements <= self.host_fbank.size and self.mask_elements <= self.host_masks.size, (
            f"batch of {self.fbank_elements} fbank / {self.mask_elements} mask values exceeds the slot "
            f"({self.host_fbank.size} / {self.host_masks.size})"
        )
        # NumPy releases the GIL for these copies (and casts to float32 as it copies)
        host_runs = _fill(self.host_fbank, inputs.fbank)
        _fill(self.host_masks, inputs.masks)
        self.host_frames[0] = inputs.frames
        for start, stop in host_runs:  # host pieces' values (usually the whole batch: one run)
            held.copy(self.fbank.data.ptr + 4 * start, self.host_fbank.ctypes.data + 4 * start,
                      4 * (stop - start), stream)  # fmt: skip
        offset = 0
        for piece in inputs.fbank:  # device pieces write themselves in place, on this stream
            if isinstance(piece, DeviceFbank):
                piece.write_device(self.fbank.data.ptr + 4 * offset, stream)
            offset += piece.size
        held.copy(self.masks.data.ptr, self.host_masks.ctypes.data, self.mask_elements * 4, stream)
        held.copy(self.frames.data.ptr, self.host_frames.ctypes.data, 4, stream)
        held.record(self.ready, stream)

    def move_to(self, fbank, masks, frames, stream) -> None:
        """Enqueue on `stream` (the compute stream): wait for the upload, then copy the
        staged values into a plan's input buffers."""
        held.wait(stream, self.ready)
        held.copy(fbank.data.ptr, self.fbank.data.ptr, self.fbank_elements * 4, stream)
        held.copy(masks.data.ptr, self.masks.data.ptr, self.mask_elements * 4, stream)
        held.copy(frames.data.ptr, self.frames.data.ptr, 4, stream)

    def device_bytes(self) -> int:
        return int(self.fbank.nbytes + self.masks.nbytes + self.frames.nbytes)

    def pinned_bytes(self) -> int:
        host = (self.host_fbank, self.host_masks, self.host_frames, self.host_output, self.host_active,
                self.host_flag)  # fmt: skip
        return int(sum(a.nbytes for a in host))


def _fill(host: np.ndarray, pieces: tuple[np.ndarray | DeviceFbank, ...]) -> list[tuple[int, int]]:
    """host[:total] = the host pieces one after another, flattened (each copied once, in
    place; a DeviceFbank piece keeps its place but is not copied). Returns the [start, stop)
    element runs that host pieces filled, adjacent ones merged."""
    offset, runs = 0, []
    for piece in pieces:
        stop = offset + piece.size
        if not isinstance(piece, DeviceFbank):
            host[offset:stop].reshape(piece.shape)[...] = piece
            if runs and runs[-1][1] == offset:
                runs[-1] = (runs[-1][0], stop)
            else:
                runs.append((offset, stop))
        offset = stop
    return runs


def pinned(shape: tuple[int, ...], dtype) -> np.ndarray:
    """A NumPy array in page-locked host memory (asynchronous copies need it)."""
    import cupy

    count = int(np.prod(shape))
    memory = cupy.cuda.alloc_pinned_memory(count * np.dtype(dtype).itemsize)
    return np.frombuffer(memory, dtype=dtype, count=count).reshape(shape)
