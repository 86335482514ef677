"""Experiment: a `speakerd` command (serve, or bench --batcher) with host knobs changed by
environment variables, to measure under load whether the GPU idles between batches for
want of queued work or of the interpreter lock:

- DEPTH: batches in flight (the batcher's PIPELINE_DEPTH and the GPU engine's input slots);
- SWITCH_MS: the interpreter's switch interval (sys.setswitchinterval), which bounds how
  long a thread woken by the GPU waits for the lock while the event loop holds it.

    DEPTH=5 SWITCH_MS=0.5 python scripts/serve_depth.py serve --engine gpu --math fp16 ...
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import speakerd.engine.gpu.engine as gpu_engine
import speakerd.serving.batcher as batcher
import speakerd.tools.bench_batcher as bench_batcher
from speakerd.cli import main


def apply_knobs() -> None:
    depth = int(os.environ.get("DEPTH", batcher.PIPELINE_DEPTH))
    batcher.PIPELINE_DEPTH = depth
    bench_batcher.PIPELINE_DEPTH = depth
    gpu_engine.INPUT_SLOTS = depth
    if "SWITCH_MS" in os.environ:
        sys.setswitchinterval(float(os.environ["SWITCH_MS"]) / 1e3)
    print(f"serve_depth: {depth} batches in flight, switch interval {1e3 * sys.getswitchinterval():g} ms",
          file=sys.stderr, flush=True)  # fmt: skip


# guarded: `serve --receivers` spawns processes that import this module again
if __name__ == "__main__":
    apply_knobs()
    sys.exit(main())
