#!/bin/bash
# conv_wgmma.cu on the device: its tests (REQUIRE_GPU=1), the FP16 bench with PyTorch in the
# same run (BENCH=0 skips it), the builds of scripts/time_wgmma_variants.py timed
# (BASELINE=FILE adds another version of the file, VARIANT_BUILDS="a b" names the builds;
# VARIANTS=0 skips them), then Nsight Compute's view of the engine build's layer1 kernels
# where the machine's profiler reads counters (NCU=1).
set -o pipefail
source scripts/device_env.sh
REQUIRE_GPU=1 timeout ${TEST_S:-90} python3 -m pytest -q -s tests/test_gpu_fp16.py -k wgmma > $OUT/wgmma-tests.log 2>&1
grep -E "conv_wgmma|passed|failed|Error|^E " $OUT/wgmma-tests.log | sed -E 's/ +grid \([0-9, ]+\)//' | cut -c1-200 | head -24
echo "wgmma tests at $SECONDS s"
if [ "${BENCH:-1}" = 1 ]; then
  TESTS=0 TABLE_BATCHES="${TABLE_BATCHES:-1 32}" BENCH_S=${BENCH_S:-200} bash scripts/device_fp16.sh | grep -E '"kind": "(ours|ratio)"|layer[12]|rc ' | cut -c1-240
fi
if [ "${VARIANTS:-1}" = 1 ]; then
  timeout ${VARIANTS_S:-150} python3 scripts/time_wgmma_variants.py ${BASELINE:+--baseline $BASELINE} ${VARIANT_BUILDS:+--builds $VARIANT_BUILDS} > $OUT/wgmma-variants.jsonl 2> $OUT/wgmma-variants.err
  echo "variants rc $? at $SECONDS s"; grep -v '^{' $OUT/wgmma-variants.jsonl; tail -3 $OUT/wgmma-variants.err
fi
if [ "${NCU:-0}" = 1 ]; then
  timeout ${NCU_S:-150} ncu --clock-control none -k regex:conv_wgmma_c32 --section SpeedOfLight \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum" \
    python3 scripts/time_wgmma_variants.py --builds engine --launch-once > $OUT/ncu.txt 2>&1
  echo "ncu rc $? at $SECONDS s"
  grep -E "conv_wgmma|Duration|Throughput|gmma|issue_active|bank|stalled" $OUT/ncu.txt | awk '$NF+0 >= 0.05 || /conv_wgmma|Duration|Throughput/' | cut -c1-160 | head -150
fi
