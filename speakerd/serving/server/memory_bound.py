"""The most host memory a server can use, from its flags: the formula of docs/service.md.

Why a formula: an operator sets a container's memory limit, and a server pushed past it is
killed (OOM) with every call in flight. Each term is a bound the code enforces, not an
estimate of typical use:

- baseline: the server's resident size once warm (model, engine, gRPC, Python), measured
  by the server itself after the start-up's self-check, with freed memory given back;
- decode: the decode budget (DECODE_BUDGET_MESSAGES messages) of float32 copies that
  validation makes of float16 tensors (twice the bytes);
- queue: --queue-chunks queued chunks, each a float32 fbank and the widest masks;
- engine: the batches on the engine threads beyond the one the baseline ran, each at most
  the largest plan's chunks of activations (CPU engine; the GPU's are on the device);
- receivers: each receiver process at rest, with its shared-memory slots;
- per call open at once: gRPC receives a call's whole message (up to --max-message-mb)
  before the handler runs, and Python copies it into a bytes object: twice the message.
  Calls open at once are at most MAX_CONCURRENT_STREAMS per connection; the number of
  connections is the clients' (the server does not refuse connections);
- recordings: --recording-memory-mb, the budget recording calls reserve what they hold in
  (frames, mask rows and, when the server segments, the samples kept for the windows not
  yet segmented) before they start; calls that do not fit wait (recording_budget.py);
- clustering: --clustering-memory-mb, the budget Diarize calls reserve their clustering in
  (the linkage's 8 n^2 bytes for n clean speaker pairs, the per-window arrays and what the
  call keeps of each window) before they cluster, holding their recording's reservation
  while they wait (serving/diarization/service.py);
- segmentation: the groups of windows the segmentation engine runs at once (SEGMENT_THREADS),
  each at most SEGMENT_GROUP_BYTES of activations (CPU engine; the GPU's are on the device).

Device workers (`--devices`) are processes of their own, bounded by their own engine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from speakerd.model.architecture import FRAMES, MAX_SPEAKERS, MEL_BINS
from speakerd.model.inputs import MAX_MASK_FRAMES
from speakerd.serving.api.recording import SEGMENT_THREADS
from speakerd.serving.api.service import DECODE_BUDGET_MESSAGES
from speakerd.serving.batching.batcher import PIPELINE_DEPTH
from speakerd.serving.receivers.receiver_link import SLOT_BYTES, SLOTS_PER_RECEIVER

MB = 1_000_000
#: One queued chunk: its float32 fbank and its masks at the most frames a request may send.
CHUNK_BYTES = FRAMES * MEL_BINS * 4 + MAX_SPEAKERS * MAX_MASK_FRAMES * 4
#: Activations of one chunk while the CPU engine (ONNX Runtime) runs it: the stem's output
#: is 32 x 998 x 80 float32 (10.2 MB) and a residual block holds about four such tensors.
ACTIVATION_BYTES_PER_CHUNK = 4 * 32 * FRAMES * MEL_BINS * 4
#: A receiver process at rest (measured on a 2-core CI machine: 53 MB).
RECEIVER_BASELINE_BYTES = 64 * MB
#: One group of CPU_GROUP_WINDOWS windows through the CPU segmenter: 98 MB at its peak
#: (tracemalloc, the NumPy forward on 32 windows of the real segmentation-3.0 weights),
#: rounded up.
SEGMENT_GROUP_BYTES = 128 * MB


@dataclass(frozen=True)
class MemoryBound:
    """The bound's terms in bytes: `fixed` ones, plus `per_call` for each call open at once."""

    baseline: int
    decode: int
    queue: int
    engine: int
    receivers: int
    recordings: int
    clustering: int
    segmentation: int
    per_call: int

    @property
    def fixed(self) -> int:
        return (self.baseline + self.decode + self.queue + self.engine + self.receivers + self.recordings
                + self.clustering + self.segmentation)  # fmt: skip

    def total(self, calls: int) -> int:
        """The bound with `calls` calls open at once."""
        return self.fixed + calls * self.per_call

    def describe(self) -> str:
        terms = ", ".join(f"{name} {value / MB:.0f}" for name, value in vars(self).items())
        return f"{terms} MB"


def memory_bound(
    baseline_bytes: int,
    max_message_bytes: int,
    queue_chunks: int,
    max_batch: int,
    devices: int = 1,
    receivers: int = 0,
    recording_bytes: int = 0,
    clustering_bytes: int = 0,
) -> MemoryBound:
    """The terms of docs/service.md's bound for a server with these flags whose warm
    resident size is `baseline_bytes`."""
    return MemoryBound(
        baseline=baseline_bytes,
        decode=DECODE_BUDGET_MESSAGES * 2 * max_message_bytes,
        queue=queue_chunks * CHUNK_BYTES,
        engine=(PIPELINE_DEPTH * devices - 1) * max_batch * ACTIVATION_BYTES_PER_CHUNK,
        receivers=receivers * (RECEIVER_BASELINE_BYTES + SLOTS_PER_RECEIVER * SLOT_BYTES),
        recordings=recording_bytes,
        clustering=clustering_bytes,
        segmentation=SEGMENT_THREADS * SEGMENT_GROUP_BYTES,
        per_call=2 * max_message_bytes,
    )


def resident_bytes(pid: int | str = "self") -> int:
    """A process's resident set size (Linux /proc; 0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
