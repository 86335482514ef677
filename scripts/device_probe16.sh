# One H200 run of experiments for the FP16 speed issue: cuDNN fused FP16 graphs with a max
# reduction (scripts/probe_fp16_fusion.py), the in-process recording bench, and an FP16
# server under 32-chunk load profiled with py-spy (--gil: what holds the interpreter lock),
# then served again with DEPTH batches in flight (scripts/serve_depth.py).
set -o pipefail
source scripts/device_env.sh
if [ "${FUSION:-1}" = 1 ]; then
  timeout ${FUSION_S:-220} python3 scripts/probe_fp16_fusion.py ${FUSION_ARGS} 2>$OUT/fusion.err | tee $OUT/fusion.jsonl \
    | grep -v '"built": false' | cut -c1-420
  tail -3 $OUT/fusion.err | cut -c1-300; echo "fusion probe at $SECONDS s"
fi
if [ -n "$BENCH_RECORDING" ]; then
  timeout 150 python3 -m speakerd bench --math fp16 --recording 3600 --runs 3 2> $OUT/bench-recording.err \
    | tee $OUT/bench-recording.jsonl | grep '"kind": "recording"' | cut -c1-500
  echo "bench --recording at $SECONDS s"
fi
serve_load() {  # $1: depth, $2: profile (1/0)
  DEPTH=$1 python3 scripts/serve_depth.py serve --engine gpu --math fp16 --port 50051 --metrics-port 9100 \
    > $OUT/serve-d$1.log 2>&1 &
  SPID=$!
  timeout 120 python3 -m speakerd.client health --wait 110 > /dev/null 2>&1; echo "depth $1 health rc $? at $SECONDS s"
  timeout 40 python3 -m speakerd.client load --streams 16 --chunks 32 --processes 4 --seconds 10 \
    --metrics-url http://127.0.0.1:9100/metrics 2>&1 | tee $OUT/load-d$1.json | cut -c1-700
  if [ "$2" = 1 ]; then
    py-spy record --pid $SPID --rate 200 --format raw --gil --threads --duration 8 --output $OUT/gil-profile.txt \
      > $OUT/py-spy.log 2>&1 &
    SPY=$!
    timeout 40 python3 -m speakerd.client load --streams 16 --chunks 32 --processes 4 --seconds 9 \
      --metrics-url http://127.0.0.1:9100/metrics > $OUT/load-d$1-profiled.json 2>&1
    wait $SPY
    py-spy record --pid $SPID --rate 200 --format raw --threads --idle --duration 8 --output $OUT/all-profile.txt \
      >> $OUT/py-spy.log 2>&1 &
    SPY=$!
    timeout 40 python3 -m speakerd.client load --streams 16 --chunks 32 --processes 4 --seconds 9 \
      --metrics-url http://127.0.0.1:9100/metrics > $OUT/load-d$1-profiled-all.json 2>&1
    wait $SPY
    echo "profiled at $SECONDS s"; tail -2 $OUT/py-spy.log
  fi
  if [ -n "$RECORDING" ]; then
    timeout 60 python3 -m speakerd.client load --recording 3600 --streams 1 --seconds 8 --timeout 50 2>&1 \
      | tee $OUT/load-recording-d$1.json | cut -c1-600
  fi
  kill $SPID; wait $SPID
}
for depth in ${DEPTHS:-3 5}; do
  serve_load $depth $([ "$depth" = "${PROFILE_DEPTH:-3}" ] && echo 1 || echo 0)
done
(cd $OUT && tar czf logs.tgz *.log *.err 2>/dev/null && rm -f *.log *.err)
echo "all done at $SECONDS s"
