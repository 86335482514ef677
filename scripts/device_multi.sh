#!/bin/bash
# The several-GPU run of `serve --devices` (issue 18), for an nvidia-h200-x2 machine (or
# larger), from the repository root:
#   1. the GPU engine tests with REQUIRE_GPU=1 on each GPU alone (CUDA_VISIBLE_DEVICES=i: the
#      tests build their engines on device 0), and the CPU stand-in tests of the pool;
#   2. parity per GPU through the worker path: a `--devices i` server for each GPU, checked
#      by `client verify` against ONNX Runtime references;
#   3. `client load --streams 16 --chunks 32 --processes 4` against the `--devices 0` server
#      and against a `--devices all` server, then one JSON line: chunks/s of each, the plan
#      runs each device answered (speakerd_device_batches_total) and the ratio (target >= 1.8);
#   4. (INPROCESS=1, the default) the same load against one engine in process (no --devices),
#      to see what the worker path costs on one GPU.
# Logs and JSON land in $OUT. TESTS=0 skips step 1; SERVE_MATH picks the math (fp16).
set -o pipefail
source scripts/device_env.sh
MATH=${SERVE_MATH:-fp16}
LOAD_S=${LOAD_S:-10}
GPUS=$(python3 -c "import cupy; print(cupy.cuda.runtime.getDeviceCount())")
echo "GPUs: $GPUS ($(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | xargs))"
if [ "${GPUS:-0}" -lt 2 ]; then echo "needs 2 GPUs or more, found ${GPUS:-none}"; exit 1; fi

if [ "${TESTS:-1}" = 1 ]; then
  for ((i = 0; i < GPUS; i++)); do
    CUDA_VISIBLE_DEVICES=$i REQUIRE_GPU=1 timeout ${TEST_S:-330} python3 -m pytest -q -p no:cacheprovider \
      tests/test_gpu_engine.py 2>&1 | tee $OUT/gpu-tests-device$i.log \
      | grep -E "[0-9]+ (passed|failed)|FAILED|ERROR" | head -5 | sed "s/^/device $i: /"
  done
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_devices.py tests/test_device_table.py \
    tests/test_config.py 2>&1 | tee $OUT/pool-tests.log | grep -E "[0-9]+ (passed|failed)|FAILED|ERROR" | head -5
  echo "tests at $SECONDS s"
fi

python3 -m speakerd make-references --out /tmp/refs > $OUT/refs.log 2>&1; echo "refs at $SECONDS s"

# start_server NAME FLAGS...: a GPU server on 50051/9100 logging to $OUT/serve-NAME.log; SPID
start_server() {
  local name=$1; shift
  python3 -m speakerd serve --engine gpu --math $MATH --port 50051 --metrics-port 9100 "$@" \
    > $OUT/serve-$name.log 2>&1 &
  SPID=$!
  timeout 300 python3 -m speakerd.client health --wait 290 > /dev/null 2>&1
  local rc=$?
  echo "$name: health rc $rc at $SECONDS s"
  [ $rc = 0 ] && kill -0 $SPID 2>/dev/null
}
stop_server() {
  kill $SPID 2>/dev/null; wait $SPID 2>/dev/null
  grep -E "SERVING|ready|taken out|ERROR|Traceback" $OUT/serve-$1.log | cut -c1-240 | head -8
}
verify() {  # verify NAME: client verify of the running server
  timeout 120 python3 -m speakerd.client verify --references /tmp/refs 2>&1 | tee $OUT/verify-$1.log | tail -1 \
    | sed "s/^/$1: /"
}
load() {  # load NAME: the 32-chunk load, one JSON line in $OUT/load-NAME.json
  timeout $((LOAD_S + 60)) python3 -m speakerd.client load --streams 16 --chunks 32 --processes 4 \
    --seconds $LOAD_S --metrics-url http://127.0.0.1:9100/metrics > $OUT/load-$1.json 2> $OUT/load-$1.err
  cut -c1-400 $OUT/load-$1.json | sed "s/^/$1: /"
}

for ((i = 0; i < GPUS; i++)); do
  if start_server device$i --devices $i; then
    verify device$i
    [ $i = 0 ] && load one
  fi
  stop_server device$i
done
if start_server all --devices all; then
  load all
  verify all
fi
stop_server all

python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def read(name):
    path = out / f"load-{name}.json"
    return json.loads(path.read_text()) if path.exists() and path.read_text().strip() else None
one, every = read("one"), read("all")
summary = {"target_ratio": 1.8}
for name, report in (("devices_0", one), ("devices_all", every)):
    if report:
        summary[name] = {key: report.get(key) for key in
                         ("chunks_per_s", "device_batches", "latency_p50_ms", "latency_p99_ms", "failed_calls")}
if one and every and one["chunks_per_s"]:
    summary["ratio"] = round(every["chunks_per_s"] / one["chunks_per_s"], 3)
    summary["ok"] = summary["ratio"] >= summary["target_ratio"] and len(every["device_batches"]) >= 2 \
        and min(every["device_batches"].values()) > 0
print(json.dumps(summary))
PY

if [ "${INPROCESS:-1}" = 1 ]; then
  if start_server inprocess; then load inprocess; fi
  stop_server inprocess
fi
echo "all done at $SECONDS s"
