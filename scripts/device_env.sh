# Sourced on a device machine (by scripts/device_suite.sh and scripts/device_pyannote.sh):
# installs the carried wheels (.whl/, made by scripts/device_wheels.sh: the cuDNN frontend,
# grpcio >= 1.85 with its health, reflection and status packages and googleapis-common-protos,
# kaldi-native-fbank, soundfile with cffi) into /tmp/site and sets the paths the project needs there.
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>/dev/null \
  || { echo "device_env.sh: installing .whl/*.whl failed: carry .whl (scripts/device_wheels.sh makes it)" >&2; exit 1; }
export PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH
export LD_LIBRARY_PATH=$(python3 -c "import nvidia.cudnn,os;print(os.path.join(nvidia.cudnn.__path__[0],'lib'))"):$LD_LIBRARY_PATH
export PYTHONUNBUFFERED=1 SPEAKERD_CACHE=/tmp/spk
