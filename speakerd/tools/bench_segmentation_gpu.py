"""Benchmark: segment an hour of audio (3591 windows, 1 s step) on the GPU; JSON lines.

One line per measurement, all in one process on one GPU so the numbers compare: the engine
(engine/gpu/segmentation) for each math and group size, then the PyTorch anchor
(scripts/anchors/torch_segmentation.py) at pyannote's batch 32 and larger batches. An engine
line carries `stages_ms`: one eager pass over the same hour with a CUDA event after each
stage (summed over the hour's groups; eager, so its total exceeds the graph replay's by the
launch gaps). Audio upload is included for the engine (it is part of `segment`); the
anchor's windows are already on the GPU (its favour).
Usage: python -m speakerd.tools.bench_segmentation [--ckpt PATH] [--configs fp32@3591,fast/simple@1024]
(a config is math[/lstm kernel]@group; the default adds the simple LSTM kernel once, for comparison)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
HOUR_S, STEP, WINDOW, SR = 3600, 16000, 160000, 16000
HOUR_WINDOWS = (HOUR_S * SR - WINDOW) // STEP + 1  # 3591
#: timed hours per configuration (the best is reported), after one that builds plans and graphs
REPS = 3


def _line(**fields) -> None:
    print(json.dumps(fields), flush=True)


def _engine(seg, audio: np.ndarray, dev: str) -> None:
    """Time an hour through `seg` (best of REPS after a warm-up), then its stages; one line."""
    starts = np.arange(HOUR_WINDOWS, dtype=np.int64) * STEP
    groups = [starts[i : i + seg.max_windows] for i in range(0, HOUR_WINDOWS, seg.max_windows)]

    def hour() -> None:
        for st in groups:
            seg.segment(audio[st[0] : st[-1] + WINDOW], st - st[0])

    hour()  # plans + graph capture
    best = float("inf")
    for _ in range(REPS):
        t0 = time.perf_counter()
        hour()
        best = min(best, time.perf_counter() - t0)
    stages: dict[str, float] = {}
    for st in groups:
        for name, ms in seg.stage_times(audio[st[0] : st[-1] + WINDOW], st - st[0]).items():
            stages[name] = stages.get(name, 0.0) + ms
    _line(
        engine=seg.name, math=seg.math, lstm=seg.lstm, group=seg.max_windows, windows=HOUR_WINDOWS,
        ms_per_hour=round(best * 1e3, 2), windows_per_s=round(HOUR_WINDOWS / best, 1), device=dev,
        stages_ms={k: round(v, 2) for k, v in stages.items()}, stages_total_ms=round(sum(stages.values()), 2),
    )  # fmt: skip
    seg.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", default=str(ROOT / ".cache/pyannote/segmentation-3.0/pytorch_model.bin"))
    ap.add_argument("--configs", default="fp32@1024,fp32@3591,fast@1024,fast@3591,fast/simple@3591")
    ap.add_argument("--anchor-batches", default="32,128,512")
    args = ap.parse_args()
    import cupy as cp

    sys.path.insert(0, str(ROOT / "scripts/anchors"))
    from torch_segmentation import PyanNet, hour_seconds, load_state_dict

    from speakerd.engine.gpu.segmentation import GpuSegmenter

    dev = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    sd = load_state_dict(args.ckpt)
    rng = np.random.default_rng(0)
    audio = (rng.standard_normal(HOUR_S * SR) * 0.1).astype(np.float32)
    for config in args.configs.split(","):
        kind, group = config.split("@")
        math, _, lstm = kind.partition("/")
        _engine(
            GpuSegmenter(sd, model_id="bench", max_windows=int(group), math=math, lstm=lstm or "cluster"),
            audio,
            dev,
        )
        cp.get_default_memory_pool().free_all_blocks()
    import torch

    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = PyanNet(sd).cuda().eval()
    for b in (int(v) for v in args.anchor_batches.split(",")):
        s = hour_seconds(model, b)
        _line(
            engine="torch-pyannet-anchor", math="fp32", group=b, windows=HOUR_WINDOWS,
            ms_per_hour=round(s * 1e3, 2), windows_per_s=round(HOUR_WINDOWS / s, 1), device=dev,
        )  # fmt: skip


if __name__ == "__main__":
    main()
