#!/bin/bash
# The H200 test run: our conv kernels against float64 (FP32/TF32 and FP16), the FP16 range
# fallback, the GPU engine tests (FP32, TF32, FP16), and fbank on the GPU (kernels against
# NumPy and kaldi-native-fbank; recordings and waveform chunks through the engine), the
# held enqueue, then the one-kernel BasicBlock's tests in the time left of BUDGET_S (560 s:
# a device call runs at most 600), all with REQUIRE_GPU=1.
set -o pipefail
source scripts/device_env.sh
# KERNEL_TESTS=0: the engine tests only (a short re-run after an engine-only change)
if [ "${KERNEL_TESTS:-1}" != 0 ]; then
REQUIRE_GPU=1 timeout 60 python3 -m pytest -q -s tests/test_gpu_igemm.py 2>&1 | tee $OUT/igemm-tests.log | grep -E "passed|failed|Error" | tail -3
REQUIRE_GPU=1 timeout 300 python3 -m pytest -q -s tests/test_gpu_fp16.py 2>&1 | tee $OUT/fp16-tests.log | grep -E "^stem|^forced|passed|failed|Error" | cut -c1-300 | tail -8
echo "kernel tests at $SECONDS s"
fi
REQUIRE_GPU=1 timeout ${TEST_S:-330} python3 -m pytest -q tests/test_gpu_engine.py tests/test_kernels_compile.py 2>&1 | tee $OUT/gpu-tests.log | grep -E "^(first|last|short|empty|one|soft|b32|b1 |fp32|tf32|fp16|  *(stem|pooled|output|layer4.2.out)|[0-9]+ (passed|failed)|FAILED|ERROR|E  )" | cut -c1-300 | head -80
echo "tests at $SECONDS s"
REQUIRE_GPU=1 timeout ${FBANK_TEST_S:-200} python3 -m pytest -q -s tests/test_gpu_fbank.py tests/test_gpu_recording.py 2>&1 \
  | tee $OUT/fbank-tests.log | grep -E "[0-9]+ (passed|failed)|FAILED|ERROR|GPU recording|device rows|recording gpu|waveform rows" | cut -c1-240 | head -30
echo "fbank tests at $SECONDS s"
REQUIRE_GPU=1 timeout 60 python3 -m pytest -q -s tests/test_gpu_held.py 2>&1 \
  | tee $OUT/held-tests.log | grep -E "steps|[0-9]+ (passed|failed)|FAILED|ERROR" | cut -c1-220 | head -6
LEFT=$(( ${BUDGET_S:-560} - SECONDS ))
if [ "$LEFT" -gt 30 ]; then
  REQUIRE_GPU=1 timeout $LEFT python3 -m pytest -q -s tests/test_gpu_block.py 2>&1 | tee $OUT/block-tests.log \
    | grep -E "^block|[0-9]+ (passed|failed)|FAILED|ERROR" | cut -c1-240 | head -20
else
  echo "block tests not run: $LEFT s left of BUDGET_S"
fi
echo "all tests at $SECONDS s"
