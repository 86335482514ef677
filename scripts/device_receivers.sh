# One H200 run for `serve --receivers N` (issue 16's service target): the plan bench with
# the PyTorch anchor (ratios in the same run), then one FP16 server per RECEIVERS value
# (0: the server receives its calls itself), each checked by `client verify` and loaded
# with 32-chunk requests from 16 streams; the last one also with an hour-long recording
# (EmbedRecording, forwarded by the receivers). Logs and JSON land in $OUT.
set -o pipefail
source scripts/device_env.sh
python3 -m speakerd make-references --out /tmp/refs > $OUT/refs.log 2>&1; echo "refs at $SECONDS s"
if [ "${BENCH:-1}" = 1 ]; then
  timeout 200 python3 -m speakerd bench --math fp16 --batches 1,32 --no-profile --references /tmp/refs \
    2> $OUT/bench.err | tee $OUT/bench.jsonl | grep -E '"kind": "ratio"' | cut -c1-300
  echo "bench at $SECONDS s"
fi
last=$(echo ${RECEIVERS:-0 2 4} | awk '{print $NF}')
for n in ${RECEIVERS:-0 2 4}; do
  python3 -m speakerd serve --engine gpu --math fp16 --port 50051 --metrics-port 9100 --receivers $n \
    > $OUT/serve-r$n.log 2>&1 &
  SPID=$!
  timeout 120 python3 -m speakerd.client health --wait 110 > /dev/null 2>&1; echo "receivers $n health rc $? at $SECONDS s"
  timeout 60 python3 -m speakerd.client verify --references /tmp/refs 2>&1 | tee $OUT/verify-r$n.log | tail -1
  for run in 1 2; do
    timeout 40 python3 -m speakerd.client load --streams 16 --chunks 32 --processes 4 --seconds 10 \
      --metrics-url http://127.0.0.1:9100/metrics 2>&1 | tee $OUT/load-r$n-$run.json | cut -c1-600
  done
  if [ "$n" = "$last" ] && [ "${RECORDING:-1}" = 1 ]; then
    timeout 90 python3 -m speakerd.client load --recording 3600 --streams 1 --seconds 15 --timeout 60 2>&1 \
      | tee $OUT/load-recording-r$n.json | cut -c1-600
  fi
  kill $SPID; wait $SPID
  grep -E "receiver|SERVING after|ERROR|Traceback|stopped after" $OUT/serve-r$n.log | cut -c1-220 | head -6
done
(cd $OUT && tar czf logs.tgz *.log *.err 2>/dev/null && rm -f *.log *.err)
echo "all done at $SECONDS s"
