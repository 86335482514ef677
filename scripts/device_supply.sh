#!/bin/bash
# One H200 run on whether the requests' way in (load generator, connections, receivers)
# or the server limits `client load` against `serve --receivers 4`: the same 16 streams x
# 32 chunks from 4, 8 and 16 client processes (each process is one connection, which
# SO_REUSEPORT pins to one receiver), the server-side request time from /metrics, and
# py-spy --idle --native of the server with its receivers and of the load generator with
# its workers (--subprocesses) during one more run. Logs and JSON land in $OUT.
set -o pipefail
source scripts/device_env.sh
LOAD_S=${LOAD_S:-10}
metric_mean() {  # mean of a histogram over the whole server run, in ms
  curl -s http://127.0.0.1:9100/metrics | python3 -c "
import sys; from prometheus_client.parser import text_string_to_metric_families as parse
s = {(x.name, tuple(sorted(x.labels.items()))): x.value for f in parse(sys.stdin.read()) for x in f.samples}
key = lambda n: sum(v for (name, labels), v in s.items() if name == n and ('code', 'OK') in labels)
print(round(1e3 * key('$1_sum') / max(key('$1_count'), 1), 3))"
}
load() {  # load NAME PROCESSES
  timeout $((LOAD_S + 40)) python3 -m speakerd.client load --streams 16 --chunks 32 --processes $2 \
    --seconds $LOAD_S --metrics-url http://127.0.0.1:9100/metrics > $OUT/load-$1.json 2> $OUT/load-$1.err
  echo "$1: $(cut -c1-600 $OUT/load-$1.json) server EmbedChunks mean ms so far $(metric_mean speakerd_request_duration_seconds)"
}
python3 -m speakerd serve --engine gpu --math fp16 --port 50051 --metrics-port 9100 --receivers 4 \
  > $OUT/serve.log 2>&1 &
SPID=$!
timeout 150 python3 -m speakerd.client health --wait 140 > /dev/null 2>&1; echo "health rc $? at $SECONDS s"
for p in ${PROCESSES:-4 8 16}; do load p$p $p; done
timeout $((LOAD_S + 40)) python3 -m speakerd.client load --streams 16 --chunks 32 --processes 4 \
  --seconds $LOAD_S > $OUT/load-profiled.json 2> $OUT/load-profiled.err &
LPID=$!
sleep 3
py-spy record --pid $SPID --subprocesses --rate 200 --format raw --idle --native --threads --duration 6 \
  --output $OUT/profile-server.txt > $OUT/py-spy-server.log 2>&1 &
py-spy record --pid $LPID --subprocesses --rate 200 --format raw --idle --native --threads --duration 6 \
  --output $OUT/profile-client.txt > $OUT/py-spy-client.log 2>&1
wait $LPID; cut -c1-300 $OUT/load-profiled.json
kill $SPID; wait $SPID
grep -E "SERVING after|ERROR|Traceback|stopped after" $OUT/serve.log | cut -c1-220 | head -4
(cd $OUT && tar czf logs.tgz *.log *.err 2>/dev/null && rm -f *.log *.err)
echo "all done at $SECONDS s"
