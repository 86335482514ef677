#!/bin/bash
# Downloads into .whl/ (ignored by git) the wheels scripts/device_env.sh installs on the device
# image, for `carry: [".whl"]`; run from the repository root on a machine with the package
# registries. The image has CuPy, cuDNN, NumPy, protobuf, ONNX Runtime, prometheus_client,
# pytest and PyTorch, but an older grpcio (the server needs >= 1.85 and its health, reflection
# and status packages, and grpcio-status needs googleapis-common-protos), and not the cuDNN
# frontend, kaldi-native-fbank or soundfile (nor cffi, which soundfile imports). A device run
# without one of these fails at start-up.
set -euo pipefail
mkdir -p .whl
rm -f .whl/grpcio_health_checking-1.84* .whl/grpcio_reflection-1.84*
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d .whl \
  "nvidia-cudnn-frontend==1.32.0" "grpcio==1.85.*" "grpcio-health-checking==1.85.*" "grpcio-reflection==1.85.*" \
  "grpcio-status==1.85.*" "googleapis-common-protos>=1.63,<2" "kaldi-native-fbank>=1.20,<2" "soundfile>=0.12,<1" \
  "cffi>=1.17,<3" "pycparser>=2.22,<4"
ls .whl
