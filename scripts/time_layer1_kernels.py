"""Times every FP16 kernel of ours on layer1's b32 convolutions (32 -> 32 channels, 80 x 998)
as the autotuner does (CUDA-graph replays), conv_f16.cu's and conv_wgmma.cu's, with both of
layer1's epilogues (conv1: bias + ReLU; conv2: bias + residual + ReLU), and prints one JSON
line each: what the autotuner's log does not show for the kernels that lose."""

from __future__ import annotations

import json

import cupy
import numpy as np

from speakerd.engine.gpu import igemm
from speakerd.model.architecture import ConvSpec
from speakerd.model.numerics import Math


def main() -> None:
    spec, batch = ConvSpec("layer1", "bn", 32, 32, 3, 1, 80, 998), 32
    random = cupy.random.RandomState(1)
    x = random.standard_normal((batch, 80, 998, 32), dtype=cupy.float32).astype(cupy.float16)
    w = (random.standard_normal((32, 3, 3, 32), dtype=cupy.float32) * 0.08).astype(cupy.float16)
    bias = random.standard_normal((32,), dtype=cupy.float32)
    y = cupy.empty((batch * 80 * 998, 32), dtype=cupy.float16)
    residual = random.standard_normal((batch * 80 * 998, 32), dtype=cupy.float32).astype(cupy.float16)
    flag = cupy.zeros((1,), dtype=cupy.int32)
    stream = cupy.cuda.Stream(non_blocking=True)
    capability = str(cupy.cuda.Device().compute_capability)
    sm_count = int(cupy.cuda.Device().attributes["MultiProcessorCount"])
    variants = [*igemm.candidates_for(spec, Math.FP16)]
    variants += igemm.wgmma_candidates_for(spec, Math.FP16, capability)
    flops = 2 * batch * 80 * 998 * 32 * 9 * 32
    with stream:
        for epilogue, add in (("bias_relu", None), ("bias_add_relu", residual)):
            for variant in variants:
                conv = igemm.IgemmConv.of(variant, spec, batch, Math.FP16, epilogue, x, w, bias, add, y, flag,
                                          sm_count=sm_count)  # fmt: skip
                ms = conv.time(stream)
                print(json.dumps({"kernel": conv.name, "epilogue": epilogue, "ms": round(ms, 4),
                                  "tflops": round(flops / ms / 1e9, 1), "blocks": int(np.prod(conv.grid)),
                                  "threads": conv.threads}))  # fmt: skip


if __name__ == "__main__":
    main()
