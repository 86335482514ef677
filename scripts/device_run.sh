#!/bin/bash
# The H200 benchmark run (scripts/device_tests.sh runs the tests): references, the engine
# benchmark for every math with its per-conv table and PyTorch in the same run, then a GPU
# server (SERVE_MATH, fp16 by default) checked by `client verify` and loaded by `client load`.
# Run from the repo root on the device with the wheels scripts/device_env.sh names in .whl/
# carried along.
set -o pipefail
source scripts/device_env.sh
python3 -m speakerd make-references --out /tmp/refs > $OUT/refs.log 2>&1; echo "refs at $SECONDS s"
timeout ${BENCH_S:-330} python3 -m speakerd bench --references /tmp/refs --convs --log-level INFO 2> $OUT/bench.err | tee $OUT/bench.jsonl | grep -E '"kind": "(ours|ratio)"' | grep '"mode": "graph"' | cut -c1-330
echo "bench rc $? at $SECONDS s"; grep -v " INFO " $OUT/bench.err | tail -4
python3 -m speakerd serve --engine gpu --math ${SERVE_MATH:-fp16} --port 50051 --log-level INFO --metrics-port 9100 > $OUT/serve.log 2>&1 &
SPID=$!
python3 -m speakerd.client health --target 127.0.0.1:50051 --wait 150 > $OUT/health.log 2>&1 &
HPID=$!
while kill -0 $SPID 2>/dev/null && kill -0 $HPID 2>/dev/null; do sleep 1; done
kill $HPID 2>/dev/null
wait $HPID; echo "health rc $? at $SECONDS s"; cat $OUT/health.log
if kill -0 $SPID 2>/dev/null; then
  timeout 60 python3 -m speakerd.client verify --target 127.0.0.1:50051 --references /tmp/refs 2>&1 | tee $OUT/verify.log | tail -9
  timeout 40 python3 -m speakerd.client load --target 127.0.0.1:50051 --streams 16 --chunks 32 --processes 4 --seconds 10 --metrics-url http://127.0.0.1:9100/metrics 2>&1 | tee -a $OUT/load.json | cut -c1-400
  curl -s http://127.0.0.1:9100/metrics 2>/dev/null | grep -E "^speakerd_fp16_fallbacks_total|^speakerd_graph" | head -4
  kill $SPID; wait $SPID
fi
grep -E "self-check|ERROR|Traceback|Error" $OUT/serve.log | head -6
echo "all done at $SECONDS s"
