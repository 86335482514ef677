#!/bin/bash
# The benchmark harness on a device machine: the carried wheels installed (device_env.sh),
# then `python -m speakerd.tools.suite` with these arguments, its records and logs in $OUT.
# Carry .whl (scripts/device_wheels.sh); the PyTorch anchors are in scripts/anchors/. The
# machine's copy of the tree has no .git, so pass the commit measured:
#
#   SPEAKERD_COMMIT=$(git rev-parse --short=12 HEAD)   # here; write its value into the call
#   run  carry [".whl"]  SPEAKERD_COMMIT=<hash> bash scripts/device_suite.sh engine
source scripts/device_env.sh
exec python3 -m speakerd.tools.suite "$@"
