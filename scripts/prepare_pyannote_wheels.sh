#!/usr/bin/env bash
# Downloads into .whl-pyannote/ (ignored by git) what scripts/device_pyannote.sh needs on the
# device image, which has Python 3.12, torch 2.11 + CUDA, numpy, grpcio, protobuf, safetensors
# and onnxruntime but not pyannote.audio nor its dependencies. Run from the project root:
#
#   scripts/prepare_pyannote_wheels.sh        # then see scripts/device_pyannote.sh's header
#
# What it writes:
#   .whl-pyannote/part-N/           the wheels below, packed into parts of at most PART_MIB
#                                   (45) MiB: each part fits one `run`'s 64 MiB carry
#   .whl-pyannote/wheels.txt        the names of all of them (device_pyannote.sh checks it)
#   .whl-pyannote/segmentation-3.0/ segmentation-3.0's checkpoint (scripts/pyannote_segmentation.sh)
#
# The wheels: pyannote.audio 4.0.7 and what importing and running its SpeakerDiarization with
# AgglomerativeClustering needs (the versions CI tests), all for CPython 3.12 manylinux.
# Pure Python:
#   pyannote.audio 4.0.7, pyannote.core 6.1.0, pyannote.database 6.1.1, pyannote.metrics
#   4.2.0, pyannote.pipeline 4.1.0, asteroid-filterbanks 0.4.0, einops 0.8.2, huggingface-hub
#   2.4.0, httpx2/httpcore2 2.16.2, h11 0.16.0, anyio 4.16.0, truststore 0.10.5, lightning
#   2.6.6, pytorch-lightning 2.6.6, lightning-utilities 0.15.3, torchmetrics 1.9.0,
#   torch-audiomentations 0.12.0, julius 0.2.8, torch-pitch-shift 1.2.5, primepy 1.3, optuna
#   5.1.0, colorlog 6.12.0, rich 15.0.0, markdown-it-py 4.3.0, mdurl 0.1.2, pygments 2.21.0,
#   tqdm 4.70.1, joblib 1.6.0, cloudpickle 3.1.3, threadpoolctl 3.8.0, narwhals 2.29.0,
#   sortedcontainers 2.4.0,
#   python-dateutil 4.0.0, tzdata 2026.6, cycler 0.12.1, pyparsing 3.3.3, fonttools 4.68.0,
#   opentelemetry-api/-sdk/-proto/-exporter-otlp(-proto-common, -proto-grpc, -proto-http)
#   1.45.2, opentelemetry-semantic-conventions/-exporter-otlp-common/-exporter-http-transport
#   0.66b2, googleapis-common-protos 1.76.0, requests 2.34.2, urllib3 2.8.0, idna 3.20,
#   certifi 2026.10.19.post1, charset-normalizer 3.5.3, packaging 26.4 (the image's pytest has
#   one; carried so as not to depend on it)
# Compiled (cp312 manylinux; about 76 MB of the total, scipy alone 34 MB):
#   scipy 1.17.1, scikit-learn 1.9.1, pandas 3.1.1, matplotlib 3.11.2, pillow 13.0.0,
#   kiwisolver 1.5.1, contourpy 1.3.3, pyyaml 6.0.4, torchaudio 2.11.1 (built for torch 2.11;
#   device_pyannote.sh removes its compiled libraries anyway, as .ci/run does: pyannote uses
#   its pure-PyTorch resample and kaldi fbank only)
# Not needed by the pipeline and left out: sqlalchemy, alembic, mako (optuna's storages),
# torchcodec (pyannote warns and the benchmark's audio is in memory), hf-xet, pyannoteai-sdk,
# pytorch-metric-learning.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
python=${PYTHON:-python3}
py_version=${PY_VERSION:-3.12}
part_mib=${PART_MIB:-45}
out=${OUT_DIR:-.whl-pyannote}
rm -rf "$out/part-"* "$out/download"
mkdir -p "$out/download"
pure=(
  pyannote.audio==4.0.7 pyannote.core==6.1.0 pyannote.database==6.1.1 pyannote.metrics==4.2.0
  pyannote.pipeline==4.1.0 asteroid-filterbanks==0.4.0 einops==0.8.2 huggingface-hub==2.4.0 cloudpickle==3.1.3
  httpx2==2.16.2 httpcore2==2.16.2 h11==0.16.0 anyio==4.16.0 truststore==0.10.5 lightning==2.6.6
  pytorch-lightning==2.6.6 lightning-utilities==0.15.3 torchmetrics==1.9.0 torch-audiomentations==0.12.0
  julius==0.2.8 torch-pitch-shift==1.2.5 primepy==1.3 optuna==5.1.0 colorlog==6.12.0 rich==15.0.0
  markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0 tqdm==4.70.1 joblib==1.6.0 threadpoolctl==3.8.0
  narwhals==2.29.0 sortedcontainers==2.4.0 python-dateutil==4.0.0 tzdata==2026.6 cycler==0.12.1
  pyparsing==3.3.3 fonttools==4.68.0 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2
  opentelemetry-proto==1.45.2 opentelemetry-exporter-otlp==1.45.2
  opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-exporter-otlp-proto-grpc==1.45.2
  opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-semantic-conventions==0.66b2
  opentelemetry-exporter-otlp-common==0.66b2 opentelemetry-exporter-http-transport==0.66b2
  googleapis-common-protos==1.76.0 requests==2.34.2 urllib3==2.8.0 idna==3.20
  certifi==2026.10.19.post1 charset-normalizer==3.5.3 packaging==26.4
)
compiled=(
  scipy==1.17.1 scikit-learn==1.9.1 pandas==3.1.1 matplotlib==3.11.2 pillow==13.0.0 kiwisolver==1.5.1
  contourpy==1.3.3 pyyaml==6.0.4 torchaudio==2.11.1
)
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version "$py_version" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$out/download" "${pure[@]}" "${compiled[@]}"
# first-fit by decreasing size into parts of at most part_mib MiB
"$python" - "$out" "$part_mib" <<'PY'
import sys
from pathlib import Path

out, limit = Path(sys.argv[1]), int(sys.argv[2]) << 20
wheels = sorted((out / "download").glob("*.whl"), key=lambda p: p.stat().st_size, reverse=True)
parts: list[list[Path]] = []
for wheel in wheels:
    size = wheel.stat().st_size
    if size > limit:
        sys.exit(f"{wheel.name}: {size >> 20} MiB, more than a part's {limit >> 20} MiB")
    part = next((p for p in parts if sum(w.stat().st_size for w in p) + size <= limit), None)
    if part is None:
        parts.append(part := [])
    part.append(wheel)
for number, part in enumerate(parts, 1):
    folder = out / f"part-{number}"
    folder.mkdir()
    for wheel in part:
        wheel.rename(folder / wheel.name)
    print(f"{folder}: {len(part)} wheels, {sum(w.stat().st_size for w in folder.iterdir()) / 2**20:.1f} MiB")
PY
rmdir "$out/download"
(cd "$out" && ls part-*/ | grep '\.whl$' | sort > wheels.txt)  # what device_pyannote.sh checks
PYTHON=$python scripts/pyannote_segmentation.sh "$out/segmentation-3.0"
du -sh "$out"/*
