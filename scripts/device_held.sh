#!/bin/bash
# One H200 run for the held enqueue (engine/gpu/held.py): its GPU tests, then `client load`
# (16 streams x 32 chunks, 4 processes) against `serve --receivers 4` (FP16), the GPU
# engine's tests with REQUIRE_GPU=1, then the FP16 b32 bench with the PyTorch anchor in the
# time left (BUDGET_S in all). Logs and JSON land in $OUT.
set -o pipefail
source scripts/device_env.sh
BUDGET_S=${BUDGET_S:-420}
REQUIRE_GPU=1 timeout 60 python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu_held.py 2>&1 \
  | tee $OUT/held-tests.log | grep -E "steps|passed|failed|Error" | cut -c1-220 | head -6
python3 -m speakerd serve --engine gpu --math fp16 --port 50051 --metrics-port 9100 --receivers 4 \
  > $OUT/serve.log 2>&1 &
SPID=$!
timeout 150 python3 -m speakerd.client health --wait 140 > /dev/null 2>&1; echo "health rc $? at $SECONDS s"
for run in 1 2; do chunk_load $run 4; done
kill $SPID; wait $SPID
grep -E "SERVING after|ERROR|Traceback|stopped after" $OUT/serve.log | cut -c1-220 | head -4
REQUIRE_GPU=1 timeout $((BUDGET_S - 100 - SECONDS)) python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu_engine.py \
  2>&1 | tee $OUT/gpu-engine-tests.log | grep -E "passed|failed|FAILED|Error|pause" | cut -c1-220 | head -12
echo "engine tests at $SECONDS s"
timeout $((BUDGET_S - SECONDS)) python3 -m speakerd bench --math fp16 --batches 32 --no-profile 2> $OUT/bench.err \
  | tee $OUT/bench.jsonl | grep -E '"kind": "(ours|ratio)"' | cut -c1-300
echo "bench at $SECONDS s"
(cd $OUT && tar czf logs.tgz *.log *.err 2>/dev/null && rm -f *.log *.err)
echo "all done at $SECONDS s"
