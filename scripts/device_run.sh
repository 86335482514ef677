#!/bin/bash
# The H200 check run used by the developers (see ../shared/device/README.md): GPU tests with
# REQUIRE_GPU=1, references, the engine benchmark, then a GPU server with verify, load and a
# py-spy GIL profile. Run from the repo root on the device with the wheels of
# ../shared/device/prepare-wheels.sh (plus grpcio>=1.85, py-spy) in .whl/ carried along.
set -o pipefail
source scripts/device_env.sh
# our conv kernel first, in a process of its own: if it fails, everything after runs cuDNN only
REQUIRE_GPU=1 timeout 90 python3 -m pytest -q -s tests/test_gpu_igemm.py 2>&1 | tee $OUT/igemm-tests.log | grep -E "^[0-9]+->|passed|failed|Error" | head -40
# a crash (no pytest summary line, or a CUDA error) turns our kernels off; a failed bound does
# not (it is reported as a failure, and the engine checks each kernel against cuDNN anyway)
grep -q -E "[0-9]+ (passed|failed)" $OUT/igemm-tests.log && ! grep -q -E "illegal|CUDARuntimeError|Fatal" $OUT/igemm-tests.log || export SPEAKERD_CONV_KERNELS=cudnn
echo "igemm tests at $SECONDS s; SPEAKERD_CONV_KERNELS=${SPEAKERD_CONV_KERNELS:-auto}"
REQUIRE_GPU=1 timeout ${TEST_S:-260} python3 -m pytest -q tests/test_gpu_engine.py tests/test_kernels_compile.py 2>&1 | tee $OUT/gpu-tests.log | grep -E "^(first|last|short|empty|one|soft|b32|fp32|tf32|[0-9]+->|  *(stem|pooled|output|layer4.2.out)|[0-9]+ (passed|failed)|FAILED|ERROR)" | head -70
echo "tests at $SECONDS s"
python3 -m server make-references --out /tmp/refs > $OUT/refs.log 2>&1; echo "refs at $SECONDS s"
timeout ${BENCH_S:-200} python3 -m server bench --references /tmp/refs --convs --log-level INFO 2> $OUT/bench.err | tee $OUT/bench.jsonl | grep -v '"kind": "conv"' | cut -c1-900
echo "bench rc $? at $SECONDS s"; grep -v INFO $OUT/bench.err | tail -4
python3 -m server serve --engine gpu --math tf32 --port 50051 --log-level INFO --metrics-port 9100 > $OUT/serve.log 2>&1 &
SPID=$!
python3 -m client health --target 127.0.0.1:50051 --wait 200 > $OUT/health.log 2>&1 &
HPID=$!
while kill -0 $SPID 2>/dev/null && kill -0 $HPID 2>/dev/null; do sleep 1; done
kill $HPID 2>/dev/null
wait $HPID; echo "health rc $? at $SECONDS s"; cat $OUT/health.log
if kill -0 $SPID 2>/dev/null; then
  timeout 90 python3 -m client verify --target 127.0.0.1:50051 --references /tmp/refs 2>&1 | tee $OUT/verify.log
  ( sleep 4; timeout 30 /tmp/site/bin/py-spy record --gil --threads --nonblocking -r 200 -d 6 -f raw -o $OUT/pyspy-gil.txt -p $SPID > $OUT/pyspy.log 2>&1;
    timeout 30 /tmp/site/bin/py-spy record --threads --nonblocking -r 200 -d 5 -f raw -o $OUT/pyspy-all.txt -p $SPID >> $OUT/pyspy.log 2>&1 ) &
  for shape in "16 8 4" "16 32 4"; do set -- $shape
    timeout 60 python3 -m client load --target 127.0.0.1:50051 --streams $1 --chunks $2 --processes $3 --seconds 12 --metrics-url http://127.0.0.1:9100/metrics 2>&1 | tee -a $OUT/load.json
  done
  kill $SPID; wait $SPID
fi
grep -E "self-check|ERROR|Traceback|Error" $OUT/serve.log | head -8
grep -h "does not capture in global\|replays differently\|no plan replays strictly\|graph replay differs\|first step that differs\|fusion off\|goes bare" $OUT/bench.err $OUT/serve.log | cut -c1-220 | sort | uniq -c | sort -rn | head -12
echo "all done at $SECONDS s"
