"""Experiment: `speakerd serve` with another number of batches in flight (DEPTH env var;
the batcher's PIPELINE_DEPTH and the GPU engine's input slots), to measure under `client
load` whether the GPU idles between batches for want of queued work.

    DEPTH=5 python scripts/serve_depth.py serve --engine gpu --math fp16 ...
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import speakerd.engine.gpu.engine as gpu_engine
import speakerd.serving.batcher as batcher
from speakerd.cli import main

depth = int(os.environ.get("DEPTH", batcher.PIPELINE_DEPTH))
batcher.PIPELINE_DEPTH = depth
gpu_engine.INPUT_SLOTS = depth
print(f"serve_depth: {depth} batches in flight", file=sys.stderr, flush=True)
sys.exit(main())
