#!/bin/bash
# The short H200 check (when device time is short): our conv kernel's test, the GPU engine
# tests with REQUIRE_GPU=1, and the FP32 b32 benchmark with its per-conv table and PyTorch.
set -o pipefail
source scripts/device_env.sh
REQUIRE_GPU=1 timeout 60 python3 -m pytest -q -s tests/test_gpu_igemm.py 2>&1 | tee $OUT/igemm-tests.log | grep -E "^[0-9]+->|passed|failed|Error" | cut -c1-120 | tail -60
REQUIRE_GPU=1 timeout 150 python3 -m pytest -q tests/test_gpu_engine.py tests/test_kernels_compile.py 2>&1 | tee $OUT/gpu-tests.log | grep -E "^(first|last|short|empty|one|soft|b32|fp32|tf32|  *(stem|pooled|output|layer4.2.out)|[0-9]+ (passed|failed)|FAILED|ERROR|E  )" | cut -c1-400 | head -60
echo "tests at $SECONDS s"
timeout 70 python3 -m server bench --math fp32 --batches 32 --no-profile --convs 2> $OUT/bench.err | tee $OUT/bench.jsonl | grep -v '"kind": "conv"' | cut -c1-400
echo "bench rc $? at $SECONDS s"
