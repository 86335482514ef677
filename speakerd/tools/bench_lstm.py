"""Micro-benchmark: one bidirectional LSTM layer's recurrence of segmentation-3.0, its kernels
and their floor; JSON lines, in well under a minute on one GPU.

The recurrence is the part of the segmenter bound by dependent steps: 589 of them per layer
and direction, each a [windows x 128] x [128 x 512] product and the cell update, so how
many windows a step carries decides how much of the GPU it uses. One line per
(kernel, windows, windows a cluster): GPU ms of one layer (CUDA events over graph replays),
microseconds a step, the SMs the launch occupies, and two floors:
- `fma_floor_ms`: the layer's multiply-adds (windows x 589 x 2 directions x 512 x 128) at
  the FP32 FMA peak of every SM (128 lanes an SM a clock, the SM clock the device reports);
- `fma_floor_used_ms`: the same at the SMs the launch occupies.
`vs_floor` is ms / fma_floor_ms. The server segments 256 windows a run
(engine/factory.GPU_SEGMENTATION_WINDOWS), `bench_segmentation_gpu` the hour in groups.

The engine's choice of windows a cluster is always timed; `--tiles` adds others (multiples of
8: lstm_cluster8 takes those that are not multiples of 16).

Usage: python -m speakerd.tools.bench_lstm [--windows 256,1024,3591] [--tiles 16,32,112]
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from speakerd.model.segmentation.architecture import LSTM_GATE_ROWS, LSTM_HIDDEN, LSTM_OUTPUT, OUTPUT_FRAMES

#: FP32 FMA lanes of one SM a clock (Hopper and Ampere: 128)
FMA_PER_SM_CLOCK = 128
#: graph replays timed per configuration (the median is reported), launches captured per replay
REPLAYS, LAUNCHES = 5, 3


def _floor_ms(windows: int, sms: int, clock_hz: float) -> float:
    fmas = windows * OUTPUT_FRAMES * 2 * LSTM_GATE_ROWS * LSTM_HIDDEN
    return fmas / (sms * FMA_PER_SM_CLOCK * clock_hz) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", default="256,1024,3591", help="window counts a launch carries")
    ap.add_argument("--tiles", default="", help="windows a cluster takes, besides the engine's choice")
    ap.add_argument("--split", type=int, default=0, help="1: write split rows ([hi | lo | hi], math=fast)")
    args = ap.parse_args()
    import cupy as cp

    from speakerd.engine.gpu.segmentation.engine import LC_HALF_CHUNK, LC_THREADS, LSTM_TB, GpuSegmenter
    from speakerd.engine.gpu.timing import time_launches
    from speakerd.model.segmentation.synthetic import make_state_dict

    seg = GpuSegmenter(make_state_dict(), model_id="bench-lstm", max_windows=1)
    device = cp.cuda.Device()
    clock_hz = float(device.attributes["ClockRate"]) * 1e3
    name = cp.cuda.runtime.getDeviceProperties(device.id)["name"].decode()
    i32 = np.int32
    w = seg.w
    width = (3 if args.split else 1) * LSTM_OUTPUT
    for windows in (int(v) for v in args.windows.split(",")):
        rng = np.random.default_rng(0)
        with seg.stream:
            xp = cp.asarray(rng.standard_normal((windows, OUTPUT_FRAMES, 2 * LSTM_GATE_ROWS), np.float32))
            out = cp.zeros((windows, OUTPUT_FRAMES, width), cp.float32)
        common = (out, i32(windows), i32(OUTPUT_FRAMES), i32(args.split))
        asked = {int(v) for v in args.tiles.split(",") if v}
        fits = {t for t in asked if t % LC_HALF_CHUNK == 0 and t <= seg.lc_max_tb}
        tiles = {seg._lstm_tile(windows)} | fits
        # (kernel, windows a cluster or block, SMs occupied, grid, block, arguments, shared bytes)
        runs = [
            (seg._lstm_kernel(tb), tb, min(4 * -(-windows // tb), seg.sms), (2 * -(-windows // tb), 2),
             (LC_THREADS,), (xp, w["lstm1_whh"], w["lstm1_b"], *common, i32(tb)), seg._lc_shared(tb))
            for tb in sorted(tiles)
        ]  # fmt: skip
        blocks = -(-windows // LSTM_TB)
        runs.append(
            ("lstm_layer", LSTM_TB, min(2 * blocks, seg.sms), (blocks, 2), (256,),
             (xp, w["lstm1_whhT"], w["lstm1_b"], *common), 0)
        )  # fmt: skip
        for kernel, tb, sms, grid, block, kernel_args, shared in runs:
            function = seg.k[kernel]

            def launch(_stream, f=function, grid=grid, block=block, a=kernel_args, shared=shared) -> None:
                f(grid, block, a, shared_mem=shared)

            with seg.stream:  # the kernels launch on the current stream, which time_launches captures
                ms = time_launches(launch, seg.stream)
            floor = _floor_ms(windows, seg.sms, clock_hz)
            print(
                json.dumps(
                    {
                        "bench": "lstm_layer_recurrence", "kernel": kernel, "windows": windows,
                        "windows_a_cluster": tb, "sms_used": sms, "sms": seg.sms, "ms": round(ms, 4),
                        "us_per_step": round(ms * 1e3 / OUTPUT_FRAMES, 3),
                        "fma_floor_ms": round(floor, 4),
                        "fma_floor_used_ms": round(_floor_ms(windows, sms, clock_hz), 4),
                        "vs_floor": round(ms / floor, 2), "device": name,
                    }
                ),
                flush=True,
            )  # fmt: skip
    seg.close()


if __name__ == "__main__":
    main()
