#!/bin/bash
# The harness's pyannote suite on a device machine (`python -m speakerd.tools.suite pyannote`:
# the whole pyannote.audio 4.0.7 diarization pipeline on an hour of audio, alone and with an
# FP16 GPU speakerd server), after installing the wheels it needs.
#
# The image lacks pyannote.audio and its dependencies (about 90 MiB of wheels, listed in
# scripts/prepare_pyannote_wheels.sh's header), more than one `run` may carry next to .whl/.
# So the wheels travel in parts of at most 45 MiB, each stashed on the machine by one call,
# then the last call installs them all at once (one pip call: pyannote, opentelemetry and
# google are namespace packages split over several wheels, which `pip --target` would
# overwrite one another across calls) and runs the benchmark. Back to back, so that the
# machine stays warm (a fresh machine has an empty /tmp: stash again):
#
#   scripts/prepare_pyannote_wheels.sh                       # once, here (and .whl/: see
#                                                            # scripts/device_env.sh)
#   run  carry [".whl-pyannote/part-1"]   bash scripts/device_pyannote.sh stash
#   run  carry [".whl-pyannote/part-2"]   bash scripts/device_pyannote.sh stash   (each part-N)
#   run  carry [".whl", ".whl-pyannote/segmentation-3.0", ".whl-pyannote/wheels.txt"]
#        bash scripts/device_pyannote.sh bench
#
# bench passes its further arguments to the suite (e.g. --math fp16).
set -o pipefail
stash=/tmp/pyannote-wheels
case "${1:-}" in
  stash)
    mkdir -p $stash
    cp .whl-pyannote/part-*/*.whl $stash/ || exit 1
    echo "stashed: $(ls $stash | wc -l) wheels in $stash"
    exit 0
    ;;
  bench) ;;
  *) echo "usage: scripts/device_pyannote.sh stash|bench (see the header)" >&2; exit 2 ;;
esac

source scripts/device_env.sh
manifest=.whl-pyannote/wheels.txt  # every wheel of every part (prepare_pyannote_wheels.sh)
[ -f $manifest ] || { echo "carry .whl-pyannote/wheels.txt too (see the header)" >&2; exit 2; }
# The image's transformers requires huggingface_hub < 2, and torchmetrics (via lightning)
# imports transformers whenever it is installed: a stashed huggingface_hub 2.x shadowing the
# image's made `import pyannote.audio` fail on the device. pyannote.audio 4.0.7 runs with the
# image's (1.33), so that wheel is left out when the image has one.
keep_image=""
python3 -c "import huggingface_hub" 2>/dev/null && keep_image="huggingface_hub-"
wanted() { if [ -n "$keep_image" ]; then grep -v "^$keep_image"; else cat; fi; }
missing=$(comm -23 <(wanted < $manifest | sort) <(ls $stash 2>/dev/null | sort))
if [ -n "$missing" ]; then
  echo "not stashed on this machine yet (run 'stash' with each part first, back to back):" >&2
  echo "$missing" | head -20 >&2
  exit 2
fi
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/pyannote-site \
  $(wanted < $manifest | sed "s|^|$stash/|") 2>&1 \
  | grep -v "WARNING: Target directory" | tail -3
# torchaudio's compiled libraries are built for another torch; pyannote needs only its pure
# PyTorch parts (resample, kaldi fbank), as in .ci/run
rm -f /tmp/pyannote-site/torchaudio/lib/*.so
export PYTHONPATH=$PYTHONPATH:/tmp/pyannote-site PYANNOTE_METRICS_ENABLED=false
python3 -c "import pyannote.audio, scipy, sklearn, pandas, matplotlib; print('pyannote.audio', pyannote.audio.__version__)" \
  2>&1 | grep -v -i "torchcodec\|warn\|^$" | tail -3
echo "installed at $SECONDS s"
# what is left of the call's 600 s (with a margin for the server's stop) is the run's budget
exec python3 -m speakerd.tools.suite pyannote --budget-s $((580 - SECONDS)) \
  --segmentation .whl-pyannote/segmentation-3.0/pytorch_model.bin "${@:2}"
