# Sourced by the device scripts: installs the carried wheels (.whl/, made by
# scripts/device_wheels.sh: the cuDNN frontend, grpcio >= 1.85 with its health, reflection
# and status packages and googleapis-common-protos, kaldi-native-fbank, soundfile, py-spy)
# into /tmp/site and sets the paths the project needs there.
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>/dev/null || exit 1
export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH
export LD_LIBRARY_PATH=$(python3 -c "import nvidia.cudnn,os;print(os.path.join(nvidia.cudnn.__path__[0],'lib'))"):$LD_LIBRARY_PATH
export PYTHONUNBUFFERED=1 SPEAKERD_CACHE=/tmp/spk

# chunk_load NAME PROCESSES [CHUNKS]: `client load` of 16 streams x CHUNKS chunks (32 unless
# given) for LOAD_S seconds (10, after the client's 1 s warm-up) against the server on 50051
# (its /metrics on 9100), the JSON in $OUT/load-NAME.json and its first 800 characters
# printed after NAME.
chunk_load() {
  local seconds=${LOAD_S:-10}
  timeout $((seconds + 40)) python3 -m speakerd.client load --streams 16 --chunks ${3:-32} --processes $2 \
    --seconds $seconds --metrics-url http://127.0.0.1:9100/metrics > $OUT/load-$1.json 2> $OUT/load-$1.err
  echo "$1: $(cut -c1-800 $OUT/load-$1.json)"
}
