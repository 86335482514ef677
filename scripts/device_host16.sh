# One H200 run on where the FP16 server's host path loses to its engine (issue 16's
# service target): the plan bench with the PyTorch anchor; the batcher in process under
# switch intervals and simulated receive pressure (scripts/probe_host.py); then FP16
# servers under 32-chunk load at each SWITCHES interval (scripts/serve_depth.py), the
# first profiled with py-spy --native --gil. Logs and JSON land in $OUT.
set -o pipefail
source scripts/device_env.sh
if [ "${BENCH:-1}" = 1 ]; then
  timeout 150 python3 -m speakerd bench --math fp16 --batches ${BATCHES:-1,32} --no-profile 2> $OUT/bench.err \
    | tee $OUT/bench.jsonl | grep -E '"kind": "(ratio|ours)"' | grep '"graph"' | cut -c1-300
  echo "bench at $SECONDS s"
fi
if [ "${PROBE:-1}" = 1 ]; then
  timeout 150 python3 scripts/probe_host.py ${RATE:-190} 2> $OUT/probe.err | tee $OUT/probe-host.jsonl | cut -c1-600
  tail -2 $OUT/probe.err | cut -c1-300; echo "probe at $SECONDS s"
fi
serve_load() {  # $1: switch interval ms (or "-" for the server's own), $2: profile (1/0)
  local env=""
  [ "$1" != - ] && env="SWITCH_MS=$1"
  env $env DEPTH=${DEPTH:-3} python3 scripts/serve_depth.py serve --engine gpu --math fp16 --port 50051 \
    --metrics-port 9100 > $OUT/serve-s$1.log 2>&1 &
  SPID=$!
  timeout 120 python3 -m speakerd.client health --wait 110 > /dev/null 2>&1; echo "switch $1 health rc $? at $SECONDS s"
  timeout 40 python3 -m speakerd.client load --streams 16 --chunks 32 --processes 4 --seconds 10 \
    --metrics-url http://127.0.0.1:9100/metrics 2>&1 | tee $OUT/load-s$1.json | cut -c1-700
  if [ "$2" = 1 ]; then
    py-spy record --pid $SPID --rate 200 --format raw --gil --native --threads --duration 8 \
      --output $OUT/native-gil-profile.txt > $OUT/py-spy.log 2>&1 &
    SPY=$!
    timeout 40 python3 -m speakerd.client load --streams 16 --chunks 32 --processes 4 --seconds 9 \
      --metrics-url http://127.0.0.1:9100/metrics > $OUT/load-s$1-profiled.json 2>&1
    wait $SPY; tail -2 $OUT/py-spy.log
  fi
  [ -n "$RECORDING" ] && timeout 60 python3 -m speakerd.client load --recording 3600 --streams 1 --seconds 8 \
    --timeout 50 2>&1 | tee $OUT/load-recording-s$1.json | cut -c1-600
  kill $SPID; wait $SPID
  grep -E "serve_depth|SERVING|ERROR|Traceback" $OUT/serve-s$1.log | cut -c1-200 | head -4
}
first=1
for switch in ${SWITCHES:-- 0.5}; do
  serve_load $switch $([ -n "$PROFILE" ] && [ $first = 1 ] && echo 1 || echo 0)
  first=0
done
(cd $OUT && tar czf logs.tgz *.log *.err 2>/dev/null && rm -f *.log *.err)
echo "all done at $SECONDS s"
