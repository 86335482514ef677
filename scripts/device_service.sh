#!/bin/bash
# The H200 service run: the GPU engine tests with REQUIRE_GPU=1, then an FP16 server checked
# by `client verify` and loaded with 32-chunk requests and with hour-long recordings
# (EmbedRecording end to end: PCM in client memory -> last embedding received), one per
# RATE:CHANNELS in RECORDINGS (16 kHz mono and 48 kHz stereo by default). BENCH_RECORDING=1
# adds the in-process `bench --recording`; PROFILE=1 samples the server with py-spy (carried
# wheel) during the first recording load. When
# ANCHORS names a folder holding the PyTorch anchor torch_hour_embedding.py, it runs first
# (same machine, same run) for the ratios. Logs and JSON land in $OUT.
set -o pipefail
source scripts/device_env.sh
if [ "${TESTS:-1}" = 1 ]; then
  # TEST_FILES: the engine's by default; the fbank/recording ones after a change there
  REQUIRE_GPU=1 timeout ${TEST_S:-200} python3 -m pytest -q -s -p no:cacheprovider \
    ${TEST_FILES:-tests/test_gpu_engine.py tests/test_kernels_compile.py} 2>&1 | tee $OUT/gpu-tests.log \
    | grep -E "[0-9]+ (passed|failed)|FAILED|ERROR|windows taken|on the GPU:|device rows|waveform rows|recording gpu|threads|^forced" \
    | cut -c1-240 | head -30
  timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_recording.py -k torchaudio -s 2>&1 \
    | tee $OUT/torchaudio.log | grep -E "Hz ->|passed|failed|skipped" | head -8
  echo "tests at $SECONDS s"
fi
if [ -n "$ANCHORS" ] && [ -f "$ANCHORS/torch_hour_embedding.py" ]; then
  timeout 150 python3 "$ANCHORS/torch_hour_embedding.py" ${RECORDING_S:-3600} 2>&1 | tee $OUT/anchor-hour.jsonl | tail -3
  echo "anchor at $SECONDS s"
fi
if [ -n "$BENCH_RECORDING" ]; then  # the same hour in process (no network), for the server's overhead
  timeout 240 python3 -m speakerd bench --math fp16 --recording ${RECORDING_S:-3600} --runs 3 2> $OUT/bench-recording.err \
    | tee $OUT/bench-recording.jsonl | grep '"kind": "recording"' | cut -c1-500
  echo "bench --recording at $SECONDS s"
fi
python3 -m speakerd make-references --out /tmp/refs > $OUT/refs.log 2>&1; echo "refs at $SECONDS s"
python3 -m speakerd serve --engine gpu --math ${SERVE_MATH:-fp16} --port 50051 --metrics-port 9100 > $OUT/serve.log 2>&1 &
SPID=$!
timeout 200 python3 -m speakerd.client health --wait 190 > $OUT/health.log 2>&1; echo "health rc $? at $SECONDS s"
if kill -0 $SPID 2>/dev/null; then
  timeout 90 python3 -m speakerd.client verify --references /tmp/refs 2>&1 | tee $OUT/verify.log | tail -2
  timeout 40 python3 -m speakerd.client load --streams 16 --chunks 32 --processes 4 --seconds 10 \
    --metrics-url http://127.0.0.1:9100/metrics 2>&1 | tee $OUT/load.json | cut -c1-600
  # RATE:CHANNELS[:ORDER[:KIB]] of each hour sent; ORDER "after" sends the masks after the
  # audio (for comparison), KIB the PCM per message
  for format in ${RECORDINGS:-16000:1 48000:2}; do
    IFS=: read -r rate channels order kib <<< "$format"
    flags=""
    [ "$order" = after ] && flags="--masks-after-audio"
    [ -n "$kib" ] && flags="$flags --piece-kib $kib"
    if [ -n "$PROFILE" ] && [ -z "$profiled" ]; then  # py-spy samples the server during the first
      profiled=1
      py-spy record --pid $SPID --rate 250 --format raw --threads --duration ${RECORDING_LOAD_S:-15} \
        --output $OUT/server-profile.txt > $OUT/py-spy.log 2>&1 &
      SPYPID=$!
      sleep 1
    fi
    timeout 120 python3 -m speakerd.client load --recording ${RECORDING_S:-3600} --sample-rate $rate \
      --channels $channels $flags --streams 1 --seconds ${RECORDING_LOAD_S:-15} \
      --timeout 100 2>&1 | tee -a $OUT/load-recording.json | cut -c1-700
  done
  [ -n "$SPYPID" ] && wait $SPYPID
  curl -s http://127.0.0.1:9100/metrics | grep -E "^speakerd_(fp16_fallbacks_total|requests_rejected_total)" | head -6
  kill $SPID; wait $SPID
fi
grep -E "SERVING|self-check|ERROR|Traceback|Error" $OUT/serve.log | cut -c1-300 | head -12
# at most 8 files come back: the logs travel as one archive
(cd $OUT && tar czf logs.tgz *.log *.err 2>/dev/null && rm -f *.log *.err)
echo "all done at $SECONDS s"
