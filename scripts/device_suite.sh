#!/bin/bash
# The benchmark harness on a device machine: the carried wheels installed (device_env.sh),
# then `python -m speakerd.tools.suite` with these arguments, its records and logs in $OUT.
# Carry .whl (scripts/device_wheels.sh) and, for the engine and recording suites' PyTorch
# anchors, .anchors (a copy of ../shared/anchors); the device copy has no .git, so pass the
# commit measured:
#
#   cp -r ../shared/anchors .anchors
#   SPEAKERD_COMMIT=$(git rev-parse --short=12 HEAD)   # here; write its value into the call
#   run  carry [".whl", ".anchors"]  SPEAKERD_COMMIT=<hash> bash scripts/device_suite.sh engine
source scripts/device_env.sh
exec python3 -m speakerd.tools.suite "$@"
