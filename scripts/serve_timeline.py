"""Experiment: `speakerd serve` with every batch's host timeline recorded, to find where a
server whose queue is full still leaves its GPU idle between batches
(speakerd_device_gap_seconds).

Per batch (perf_counter seconds, one clock for every thread of the process):
- formed: the dispatcher took it from the queue (event loop);
- thread_start / thread_end: the engine thread's `_compute` (stage, enqueue, wait, rows out);
- run_start / run_end, stage_s: `GpuEngine.run_batch` and its `InputSlot.stage` inside it;
- h2d_s, compute_s, gap_s: the engine's own BatchRun numbers (gap: GPU idle before it);
- resumed: the event loop took the result back (`Batcher._record`).
Per decode: start and end of `service.decode` (a decode thread). Per garbage collection:
start, end and generation. Written as JSON to $TIMELINE when the server exits.

    TIMELINE=/tmp/t.json python scripts/serve_timeline.py serve --engine gpu --math fp16 ...
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import speakerd.engine.gpu.engine as gpu_engine
import speakerd.engine.gpu.staging as staging
import speakerd.serving.batcher as batcher
import speakerd.serving.service as service
from speakerd.cli import main

clock = time.perf_counter
batches: list[dict] = []  # one per batch formed, in order
live: dict[int, dict] = {}  # id(batch) -> its entry (an id is reused only once its batch is gone)
decodes: list[tuple[float, float]] = []
collections: list[tuple[float, float, int]] = []
local = threading.local()


def patch() -> None:
    cls = batcher.Batcher
    next_batch, compute, record = cls._next_batch, cls._compute, cls._record
    run_batch, stage, decode = gpu_engine.GpuEngine.run_batch, staging.InputSlot.stage, service.decode

    async def timed_next_batch(self):
        batch = await next_batch(self)
        if batch is not None:
            live[id(batch)] = entry = {"formed": clock(), "chunks": batch.chunks}
            batches.append(entry)
        return batch

    def timed_compute(self, batch, requests):
        entry = live.setdefault(id(batch), {})
        entry["thread_start"] = clock()
        local.entry = entry
        try:
            return compute(self, batch, requests)
        finally:
            entry["thread_end"] = clock()

    def timed_record(self, batch, outcome):
        live.setdefault(id(batch), {})["resumed"] = clock()
        return record(self, batch, outcome)

    def timed_run_batch(self, fbank, masks, **kwargs):
        entry = getattr(local, "entry", None) or {}
        entry["run_start"] = clock()
        run = run_batch(self, fbank, masks, **kwargs)
        entry.update(run_end=clock(), h2d_s=run.h2d_s, compute_s=run.compute_s, gap_s=run.gap_s)
        return run

    def timed_stage(self, inputs, stream):
        start = clock()
        stage(self, inputs, stream)
        entry = getattr(local, "entry", None)
        if entry is not None:
            entry["stage_s"] = clock() - start

    def timed_decode(*args, **kwargs):
        start = clock()
        try:
            return decode(*args, **kwargs)
        finally:
            decodes.append((start, clock()))

    batcher.Batcher._next_batch = timed_next_batch
    batcher.Batcher._compute = timed_compute
    batcher.Batcher._record = timed_record
    gpu_engine.GpuEngine.run_batch = timed_run_batch
    staging.InputSlot.stage = timed_stage
    service.decode = timed_decode

    started: dict[int, float] = {}

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[info["generation"]] = clock()
        else:
            collections.append((started.pop(info["generation"], clock()), clock(), info["generation"]))

    gc.callbacks.append(on_gc)

    def dump() -> None:
        out = {"batches": batches, "decodes": decodes, "collections": collections}
        Path(os.environ["TIMELINE"]).write_text(json.dumps(out))

    atexit.register(dump)


# guarded: `serve --receivers` spawns processes that import this module again
if __name__ == "__main__":
    patch()
    sys.exit(main())
