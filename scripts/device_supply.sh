#!/bin/bash
# One H200 run on whether the requests' way in (load generator, connections, receivers)
# or the server limits `client load` against `serve --receivers 4` (FP16): the FP16 b32
# bench with the PyTorch anchor, then 16 streams x 32 chunks from 4 client processes three
# times and from 16 once (each process is one connection, which SO_REUSEPORT pins to one
# receiver: each load's JSON has `receiver_calls`, the split, and `queue_wait_ms_mean`,
# near 0 when the requests and not the server are the limit), and an hour-long recording
# (RECORDING_STREAMS callers, 1 by default). P16=0 leaves the 16-process load out.
# LATENCY=1 adds 16 streams of 1 and of 8 chunks (4 processes): loads that fill half a batch
# and four batches, whose p99 can be held to 2x the batch time plus the batching delay
# (16 full batches in a closed loop make ~16 batch times of queue by Little's law).
# PROFILE=1 adds py-spy --idle --native of the server during one more load. Logs and JSON
# land in $OUT.
set -o pipefail
source scripts/device_env.sh
if [ "${BENCH:-1}" = 1 ]; then
  timeout 280 python3 -m speakerd bench --math fp16 --batches 1,32 --no-profile 2> $OUT/bench.err \
    | tee $OUT/bench.jsonl | grep -E '"kind": "ratio"' | cut -c1-300
  echo "bench at $SECONDS s"
fi
python3 -m speakerd serve --engine gpu --math fp16 --port 50051 --metrics-port 9100 --receivers 4 \
  > $OUT/serve.log 2>&1 &
SPID=$!
# a fresh machine once took 119 s to build the cuDNN graphs: wait long enough
timeout 320 python3 -m speakerd.client health --wait 300 > /dev/null 2>&1; echo "health rc $? at $SECONDS s"
for run in 1 2 3; do chunk_load p4-$run 4; done
[ "${P16:-1}" = 1 ] && chunk_load p16 16
if [ "${LATENCY:-0}" = 1 ]; then chunk_load c1 4 1; chunk_load c8 4 8; fi
streams=${RECORDING_STREAMS:-1}
timeout 120 python3 -m speakerd.client load --recording 3600 --streams $streams --seconds ${RECORDING_S:-15} \
  --warmup ${RECORDING_WARMUP_S:-1} --timeout 60 > $OUT/load-recording.json 2> $OUT/load-recording.err
echo "recording: $(cut -c1-600 $OUT/load-recording.json)"
if [ "${PROFILE:-0}" = 1 ]; then
  py-spy record --pid $SPID --rate 200 --format raw --idle --native --threads --duration 8 \
    --output $OUT/profile-server.txt > $OUT/py-spy-server.log 2>&1 &
  SPY=$!
  chunk_load profiled 4 > /dev/null
  wait $SPY
fi
kill $SPID; wait $SPID
grep -E "SERVING after|ERROR|Traceback|stopped after" $OUT/serve.log | cut -c1-220 | head -4
(cd $OUT && tar czf logs.tgz *.log *.err 2>/dev/null && rm -f *.log *.err)
echo "all done at $SECONDS s"
