#!/bin/bash
# One H200 run on where the FP16 server's cycle per batch goes (issue 16's service target):
# the device gap between batches (speakerd_device_gap_seconds) with the batcher in process
# (bench --batcher 16), then under `client load` against `serve --receivers 4` (engine in
# the server process; profiled with py-spy --idle --native: what each thread waits for),
# and against `serve --receivers 4 --devices 0` (the engine in a worker process of its own,
# so its CUDA calls never wait for the server's interpreter lock); then the gap's GPU test
# with REQUIRE_GPU=1. Logs and JSON in $OUT.
set -o pipefail
source scripts/device_env.sh
LOAD_S=${LOAD_S:-10}
if [ "${BATCHER:-1}" = 1 ]; then
  timeout ${BATCHER_S:-300} python3 -m speakerd bench --math fp16 --batches 32 --batcher 16 --seconds $LOAD_S \
    --no-torch 2> $OUT/bench-batcher.err | tee $OUT/bench-batcher.jsonl | cut -c1-600
  echo "batcher bench at $SECONDS s"
fi
serve() {  # serve NAME FLAGS...: an FP16 server on 50051/9100 under load, twice (+ a profiled run)
  local name=$1; shift
  python3 -m speakerd serve --engine gpu --math fp16 --port 50051 --metrics-port 9100 "$@" \
    > $OUT/serve-$name.log 2>&1 &
  SPID=$!
  timeout 150 python3 -m speakerd.client health --wait 140 > /dev/null 2>&1; echo "$name health rc $? at $SECONDS s"
  chunk_load $name-1 4; chunk_load $name-2 4
  if [ "${PROFILE:-1}" = 1 ] && [ "$name" = r4 ]; then
    py-spy record --pid $SPID --rate 250 --format raw --idle --native --threads --duration 8 \
      --output $OUT/profile-$name.txt > $OUT/py-spy-$name.log 2>&1 &
    SPY=$!
    chunk_load $name-profiled 4 > /dev/null
    wait $SPY; tail -1 $OUT/py-spy-$name.log
  fi
  kill $SPID; wait $SPID
  grep -E "SERVING after|ERROR|Traceback|stopped after" $OUT/serve-$name.log | cut -c1-220 | head -4
}
serve r4 --receivers 4
serve r4-devices0 --receivers 4 --devices 0
[ "${TESTS:-1}" = 1 ] && REQUIRE_GPU=1 timeout ${TEST_S:-200} python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu_engine.py -k gap \
  2>&1 | tee $OUT/gap-test.log | grep -E "pause|passed|failed|Error" | cut -c1-200 | head -5
(cd $OUT && tar czf logs.tgz *.log *.err 2>/dev/null && rm -f *.log *.err)
echo "all done at $SECONDS s"
