#!/bin/bash
# The FP16 check on the H200: our FP16 kernels and the range fallback (tests with
# REQUIRE_GPU=1), then the FP16 benchmark with its per-conv table and PyTorch FP16 in the
# same run. Set TESTS=0 to skip the tests, MATHS to bench other maths too, TABLE_BATCHES to
# print other plans' per-conv rows (default 32; "1 32" for both: b1's show the split-K
# kernels where they won).
set -o pipefail
source scripts/device_env.sh
# PROBE=1: first, one wgmma against NumPy (scripts/probe_wgmma.py: which descriptor reading
# and accumulator layout hold), before conv_wgmma.cu's tests run on them.
if [ "${PROBE:-0}" = 1 ]; then
  timeout 60 python3 scripts/probe_wgmma.py 2>&1 | tee $OUT/probe-wgmma.log | cut -c1-400
fi
if [ "${TESTS:-1}" = 1 ]; then
  REQUIRE_GPU=1 timeout ${TEST_S:-300} python3 -m pytest -q -s tests/test_gpu_fp16.py > $OUT/fp16-tests.log 2>&1
  # the split-K and wgmma rows, shortened (kernel, epilogue, error, flag, same bits); the full
  # table is in fp16-tests.log
  grep -E "_sk[0-9]|conv_wgmma" $OUT/fp16-tests.log | sed -E 's/ +grid \([0-9, ]+\)//; s/  +/ /g' | cut -c1-150 | head -80
  grep -E "^stem|^forced|passed|failed|Error|^E " $OUT/fp16-tests.log | cut -c1-400 | head -30
  echo "fp16 tests at $SECONDS s"
fi
timeout ${BENCH_S:-240} python3 -m speakerd bench --math ${MATHS:-fp16} --convs --log-level INFO 2> $OUT/bench.err | tee $OUT/bench.jsonl | grep -v '"kind": "conv"' | cut -c1-700
echo "bench rc $? at $SECONDS s"; grep -v " INFO " $OUT/bench.err | tail -6
python3 - $OUT/bench.jsonl ${TABLE_BATCHES:-32} <<'PY'
import json, sys
batches = {int(b) for b in sys.argv[2:]}
for line in open(sys.argv[1]):
    row = json.loads(line)
    if row.get("kind") == "conv" and row["batch"] in batches:
        print(f'b{row["batch"]} {row["math"]} {row["conv"]:<18} {row["runs"][:34]:<34} {row["ms"]:>7} ms {row["tflops"]:>6} TF  '
              f'bare+ep {row["bare_plus_ours_ms"]} fused {row["fused_ms"]} own {row["own_kernel_ms"]}')
PY
