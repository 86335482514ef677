# speakerd GPU image: CUDA 12 runtime + cuDNN 9, Python 3.12, `pip install .[gpu]` (no
# torch: pyannote's checkpoint is read with NumPy), the project's CUDA kernels (package data
# of speakerd.engine.gpu), and the synthetic default model made at build time.
#
#   docker build -t speakerd:0.1.0 .
#   docker run --rm --gpus all -p 50051:50051 -p 9100:9100 speakerd:0.1.0
# pyannote's real model by name, downloaded and converted once into the volume at /models
# (HF_HOME is /models/huggingface; add -e HF_TOKEN=hf_... for a gated or private repo):
#   docker run --rm --gpus all -v speakerd-models:/models -p 50051:50051 \
#     -e SPEAKERD_MODEL=pyannote/wespeaker-voxceleb-resnet34-LM -e SPEAKERD_MATH=tf32 speakerd:0.1.0
#
# Ubuntu 24.04 rather than 22.04: pyproject's requires-python is >= 3.11 and 24.04's python3
# is 3.12 (22.04 has 3.10). Layers go from least to most often changed: system packages,
# Python dependencies (pyproject.toml only), then the source, so a code change rebuilds
# only the last small layers.
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 AS base
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# Ubuntu's archive replaces package versions on every security update, so exact pins would
# break the build within weeks; the base image tag pins the distribution instead.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*

FROM base AS build
# The virtual environment is copied whole into the runtime stage at the same path.
ENV VIRTUAL_ENV=/opt/speakerd
ENV PATH=/opt/speakerd/bin:$PATH
RUN python3 -m venv /opt/speakerd
WORKDIR /src
# 1. Dependencies, from pyproject.toml alone (this layer survives every source change).
COPY pyproject.toml ./
#    The gpu extra names `speakerd[server]`; that self-reference is expanded here, since pip
#    would look for a package called speakerd on the index.
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
extra = p['optional-dependencies']; \
print('\n'.join(r for r in p['dependencies'] + extra['server'] + extra['gpu'] if not r.startswith('speakerd')))" \
    > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt
# 2. The package itself (not editable: the image holds no source tree).
COPY . .
# `.[gpu]` with its dependencies already in place: --no-deps installs only speakerd, and pip
# check proves the gpu extra's requirements are all met.
RUN pip install --no-deps . && pip check
# 3. The default model, made once here instead of at every pod start (the runtime root file
#    system is read-only in deploy/k8s/deployment.yaml). Run from / so that the installed
#    package, not /src, is what imports.
WORKDIR /
RUN SPEAKERD_CACHE=/opt/speakerd-cache python -c "from speakerd.model.store import default_weights_path; \
from speakerd.engine.gpu.kernels import kernel_sources; print(default_weights_path(), sorted(kernel_sources()))"

FROM base AS runtime
# The uid/gid deploy/k8s/deployment.yaml's securityContext runs as.
RUN groupadd --system --gid 10001 speakerd \
    && useradd --system --uid 10001 --gid speakerd --create-home --home-dir /home/speakerd speakerd \
    && install -d -o 10001 -g 10001 /models
COPY --from=build /opt/speakerd /opt/speakerd
COPY --from=build /opt/speakerd-cache /opt/speakerd-cache
# SPEAKERD_HOST: listen on every interface (the server's own default is loopback only).
# CUPY_CACHE_DIR: serve and warm put CuPy's compiled kernels in $SPEAKERD_CACHE/cupy unless
# this is set, and $SPEAKERD_CACHE here is the image's read-only layer of default models;
# /tmp is the Deployment's writable emptyDir. NUMBA_CACHE_DIR: the same for the clustering's
# compiled loops (numba's machine code is for the CPU it runs on, so it is made at the first
# start). SPEAKERD_BUILD_CACHE: the same for the GPU engine's start-up choices. deploy/k8s
# points all three at a per-node volume instead, so a pod's later starts reuse them.
# HF_HOME: huggingface_hub's cache for `--model org/name`, and the converted model beside each
# download, on the /models volume (owned by the server's uid, so a new Docker volume is too).
ENV VIRTUAL_ENV=/opt/speakerd \
    PATH=/opt/speakerd/bin:$PATH \
    SPEAKERD_HOST=0.0.0.0 \
    SPEAKERD_PORT=50051 \
    SPEAKERD_METRICS_PORT=9100 \
    SPEAKERD_CACHE=/opt/speakerd-cache \
    CUPY_CACHE_DIR=/tmp/cupy-kernel-cache \
    NUMBA_CACHE_DIR=/tmp/numba-cache \
    SPEAKERD_BUILD_CACHE=/tmp/speakerd-builds \
    HF_HOME=/models/huggingface \
    HF_HUB_DISABLE_PROGRESS_BARS=1
# numeric, so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd
USER 10001:10001
WORKDIR /home/speakerd
# gRPC, then Prometheus /metrics
EXPOSE 50051 9100
# Exit 0 only when health is SERVING: warm, self-checked and not draining. The start period
# covers plan timing, CUDA graph capture and the parity self-check: 43.7 s on a fresh H100
# with nothing cached, 9.5 s from the start-up cache (docs/deployment.md).
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-m", "speakerd.client", "health", "--target", "127.0.0.1:50051", "--timeout", "3"]
ENTRYPOINT ["speakerd"]
CMD ["serve"]
