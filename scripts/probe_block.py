"""Device probe: the fused FP16 BasicBlock kernel against its two convolutions one by one.

For layer1's shape (32 -> 32 channels, 80 x 998) at each batch, one JSON line per runner
with its GPU ms per block (CUDA-graph replays, as the autotuner times): our FP16 conv
kernel twice (each pixel tile of conv_f16.cu), and each tile of kernels/block_f16.cu. The
engine's own choice (cuDNN fused for conv1 at b32 in the 2e43b77 run) is in `bench --convs`.

    python scripts/probe_block.py [--batches 32,1]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="32,1")
    args = parser.parse_args()
    import cupy
    import numpy as np

    from speakerd.engine.gpu import block as fused
    from speakerd.engine.gpu import igemm
    from speakerd.engine.gpu.timing import time_launches
    from speakerd.model.architecture import BLOCKS
    from speakerd.model.numerics import Math

    spec = BLOCKS[0]
    h, w = spec.conv1.h_in, spec.conv1.w_in
    sm_count = int(cupy.cuda.Device().attributes["MultiProcessorCount"])
    stream = cupy.cuda.Stream(non_blocking=True)
    for batch in (int(b) for b in args.batches.split(",")):
        random = cupy.random.RandomState(batch)
        x = cupy.maximum(random.standard_normal((batch, h, w, 32), dtype=cupy.float32), 0)
        x = x.astype(cupy.float16)
        scale = np.float32((2.0 / 288) ** 0.5)
        w1 = (random.standard_normal((32, 3, 3, 32), dtype=cupy.float32) * scale).astype(cupy.float16)
        w2 = (random.standard_normal((32, 3, 3, 32), dtype=cupy.float32) * scale).astype(cupy.float16)
        b1 = random.standard_normal((32,), dtype=cupy.float32) * np.float32(0.1)
        b2 = random.standard_normal((32,), dtype=cupy.float32) * np.float32(0.1)
        hidden, y = cupy.empty_like(x), cupy.empty_like(x)
        flag = cupy.zeros((1,), dtype=cupy.int32)
        flops = 2 * spec.conv1.flops_per_chunk * batch
        for pixels in igemm.F16_PIXEL_TILES[(3, 1, 32)]:
            bind, fp16 = igemm.IgemmConv.bind, Math.FP16
            pair = (
                bind(spec.conv1, batch, fp16, 32, "bias_relu", x, w1, b1, None, hidden, flag, pixels),
                bind(spec.conv2, batch, fp16, 32, "bias_add_relu", hidden, w2, b2, x, y, flag, pixels),
            )
            with stream:
                ms = time_launches(lambda s, pair=pair: [conv.launch(s) for conv in pair], stream)
            runner = f"conv_f16 x2 {pixels[0]}x{pixels[1]}"
            print(json.dumps({"batch": batch, "runner": runner, "ms": round(ms, 4),
                              "tflops": round(flops / ms / 1e9, 1)}), flush=True)  # fmt: skip
        for variant in fused.VARIANTS:
            for taps in (False, True):
                kernel = fused.BlockKernel.bind(spec, batch, variant, x, w1, b1, w2, b2, y, flag, sm_count,
                                                hidden if taps else None)  # fmt: skip
                with stream:
                    ms = kernel.time(stream)
                print(json.dumps({"batch": batch, "runner": kernel.name + (" +hidden" if taps else ""),
                                  "ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1),
                                  "grid": kernel.grid[0], "shared": kernel.shared}), flush=True)  # fmt: skip
        stream.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
