#!/bin/bash
# One H200 run recording every batch's host timeline (scripts/serve_timeline.py): the
# batcher in process (`bench --batcher 16`, no gRPC), then `serve --receivers 4` (FP16)
# under two 10 s loads of 16 streams x 32 chunks, with the device-gap histogram scraped
# after each. Timelines, JSON and logs land in $OUT.
set -o pipefail
source scripts/device_env.sh
TIMELINE=$OUT/timeline-batcher.json timeout 300 python3 scripts/serve_timeline.py bench --math fp16 --batcher 16 \
  --seconds 10 > $OUT/bench-batcher.jsonl 2> $OUT/bench-batcher.err
echo "batcher rc $? at $SECONDS s: $(tail -1 $OUT/bench-batcher.jsonl | cut -c1-600)"
TIMELINE=$OUT/timeline-serve.json python3 scripts/serve_timeline.py serve --engine gpu --math fp16 --port 50051 \
  --metrics-port 9100 --receivers 4 > $OUT/serve.log 2>&1 &
SPID=$!
timeout 320 python3 -m speakerd.client health --wait 300 > /dev/null 2>&1; echo "health rc $? at $SECONDS s"
for run in 1 2; do
  chunk_load t$run 4
  curl -s http://127.0.0.1:9100/metrics | grep -E "device_gap|batch_compute_seconds" > $OUT/metrics-t$run.txt
done
kill $SPID; wait $SPID
grep -E "SERVING after|ERROR|Traceback|stopped after" $OUT/serve.log | cut -c1-220 | head -4
ls -la $OUT/*.json | cut -c30-200
(cd $OUT && tar czf logs.tgz *.log *.err 2>/dev/null && rm -f *.log *.err)
echo "all done at $SECONDS s"
