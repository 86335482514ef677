#!/bin/bash
# The one-kernel BasicBlock on the H200: its tests (bit for bit against conv_f16 run twice,
# float64, the range flag, an engine serving it) with REQUIRE_GPU=1, the probe timing it
# against its two convolutions, then the FP16 benchmark with --conv-kernels blocks and with
# auto in the same run (per-conv tables; PyTorch FP16 as the anchor).
set -o pipefail
source scripts/device_env.sh
REQUIRE_GPU=1 timeout ${TEST_S:-240} python3 -m pytest -q -s tests/test_gpu_block.py 2>&1 | tee $OUT/block-tests.log | grep -E "^block|^b(1|32) |passed|failed|Error|error" | cut -c1-240 | head -40
echo "block tests at $SECONDS s"
timeout 120 python3 scripts/probe_block.py 2>&1 | tee $OUT/probe-block.jsonl
echo "probe at $SECONDS s"
for KERNELS in blocks auto; do
  timeout ${BENCH_S:-240} python3 -m speakerd bench --math fp16 --convs --conv-kernels $KERNELS --log-level INFO 2> $OUT/bench-$KERNELS.err | tee $OUT/bench-$KERNELS.jsonl | grep -E '"kind": "(ours|ratio)"' | grep '"mode": "graph"' | cut -c1-400
  echo "bench $KERNELS rc $? at $SECONDS s"; grep -v " INFO " $OUT/bench-$KERNELS.err | tail -4
  grep -E "ours block_f16|block kernel" $OUT/bench-$KERNELS.err | cut -c1-200 | head -8
done
