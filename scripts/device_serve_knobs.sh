# One H200 run of servers (MATH, fp16 by default) under 32-chunk load (16 streams), one per CONFIGS entry
# DEPTH:SWITCH_MS:RECEIVERS (scripts/serve_depth.py applies the first two; "-" keeps the
# server's own), two 10 s loads each; PROFILE=1 samples the first server with py-spy
# (SPY_FLAGS, --gil by default; --idle shows where threads wait, --native --threads always)
# during a third load; BENCH=1 first times MATH's plans with the PyTorch
# anchor. Logs and JSON land in $OUT.
set -o pipefail
source scripts/device_env.sh
math=${MATH:-fp16}
if [ -n "$BENCH" ]; then
  python3 -m speakerd make-references --out /tmp/refs > $OUT/refs.log 2>&1
  timeout 200 python3 -m speakerd bench --math $math --batches 32 --no-profile --references /tmp/refs \
    2> $OUT/bench.err | tee $OUT/bench-$math.jsonl | grep -E '"kind": "ratio"' | cut -c1-300
  echo "bench at $SECONDS s"
fi
first=1
for config in ${CONFIGS:-3:-:4 5:-:4 3:1:4}; do
  IFS=: read -r depth switch receivers <<< "$config"
  env=""
  [ "$depth" != - ] && env="$env DEPTH=$depth"
  [ "$switch" != - ] && env="$env SWITCH_MS=$switch"
  tag="$math-d$depth-s$switch-r$receivers"
  env $env python3 scripts/serve_depth.py serve --engine gpu --math $math --port 50051 --metrics-port 9100 \
    --receivers $receivers > $OUT/serve-$tag.log 2>&1 &
  SPID=$!
  timeout 320 python3 -m speakerd.client health --wait 300 > /dev/null 2>&1; echo "$tag health rc $? at $SECONDS s"
  for run in 1 2; do
    timeout 40 python3 -m speakerd.client load --streams 16 --chunks 32 --processes 4 --seconds 10 \
      --metrics-url http://127.0.0.1:9100/metrics 2>&1 | tee $OUT/load-$tag-$run.json | cut -c1-420
  done
  if [ -n "$PROFILE" ] && [ $first = 1 ]; then
    py-spy record --pid $SPID --rate 200 --format raw ${SPY_FLAGS:---gil} --native --threads --duration 8 \
      --output $OUT/gil-$tag.txt > $OUT/py-spy.log 2>&1 &
    SPY=$!
    timeout 40 python3 -m speakerd.client load --streams 16 --chunks 32 --processes 4 --seconds 9 \
      --metrics-url http://127.0.0.1:9100/metrics > $OUT/load-$tag-profiled.json 2>&1
    wait $SPY; tail -1 $OUT/py-spy.log
  fi
  first=0
  kill $SPID; wait $SPID
done
(cd $OUT && tar czf logs.tgz *.log *.err 2>/dev/null && rm -f *.log *.err)
echo "all done at $SECONDS s"
