"""Choosing and building the engine: the GPU engine where a GPU is usable, else the CPU one.

`kind="auto"` asks `speakerd.engine.gpu.gpu_available()`, which imports CuPy and the cuDNN
frontend lazily and never raises, so a CPU-only machine never pays for (or fails on) CUDA
imports. An explicit `kind="gpu"` that cannot be honoured is an error that says why, never
a silent fallback to the CPU.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from speakerd.engine.base import Engine, check_engine_config
from speakerd.engine.build_cache import BuildCache, build_cache_dir
from speakerd.engine.segmenter import Segmenter
from speakerd.model.numerics import Math
from speakerd.model.segmentation.weights import SegmentationModel
from speakerd.model.weights import FoldedModel

log = logging.getLogger(__name__)

ENGINE_KINDS = ("auto", "cpu", "gpu")
DEFAULT_PLAN_SIZES = (1, 32)


class EngineUnavailable(RuntimeError):
    """The engine asked for cannot run here (e.g. --engine gpu without a usable GPU)."""


def resolve_kind(kind: str) -> str:
    """'auto' -> 'gpu' when a GPU is usable, else 'cpu'; other kinds are checked and returned."""
    from speakerd.engine.gpu import gpu_available

    if kind not in ENGINE_KINDS:
        raise ValueError(f"engine: {kind!r}, expected one of {', '.join(ENGINE_KINDS)}")
    if kind == "cpu":
        return kind
    usable, detail = gpu_available()
    if kind == "gpu" and not usable:
        raise EngineUnavailable(f"engine: gpu requested but no GPU is usable: {detail}")
    if kind == "auto":
        log.info("engine auto: %s", f"GPU ({detail})" if usable else f"CPU, because {detail}")
    return "gpu" if usable else "cpu"


def device_count(kind: str) -> tuple[int, str]:
    """(how many devices an engine of the resolved `kind` may run on here, what they are
    called), for `serve --devices`: the GPUs CUDA lists (after CUDA_VISIBLE_DEVICES), or for
    the CPU engine one worker slot per core this process may use (CPU workers stand in for
    GPUs in tests and on machines without one; more workers than cores would only contend)."""
    if kind == "cpu":
        from speakerd.engine.cpu import default_threads

        return default_threads(), "CPU worker slots (one per core)"
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount()), "GPUs"
    except Exception as error:  # no CuPy or no driver: resolve_kind said so already
        log.debug("no GPU count: %s", error)
        return 0, "GPUs"


def create_engine(
    kind: str,
    model: FoldedModel,
    math: Math | str = Math.FP32,
    plan_sizes: tuple[int, ...] = DEFAULT_PLAN_SIZES,
    conv_kernels: str = "auto",
    cpu_threads: int | None = None,
    build_cache: bool = False,
    tuning: Any = None,
) -> Engine:
    """Build, warm up and time an engine of `kind` (auto | cpu | gpu) for `model`;
    `conv_kernels` ("auto" | "cudnn" | "blocks") says whether the GPU engine may run our
    kernels, and (blocks) our one-kernel BasicBlocks too;
    `cpu_threads` caps the CPU engine's threads (None: every core); `build_cache`: the GPU
    engine uses and keeps its start-up choices in build_cache_dir() (build_cache.py;
    the caller stores them once the self-check passed: Engine.keep_build); `tuning`: what
    start_tuning began for it."""
    resolved = resolve_kind(kind)
    if resolved == "cpu":
        from speakerd.engine.cpu import CpuEngine

        return CpuEngine(model, Math(math), plan_sizes, threads=cpu_threads)
    from speakerd.engine.gpu.engine import GpuEngine

    cache = BuildCache(build_cache_dir()) if build_cache else None
    return GpuEngine(model, Math(math), plan_sizes, **gpu_kernel_options(conv_kernels), build_cache=cache,
                     tuning=tuning)  # fmt: skip


def start_tuning(kind: str, math: Math | str, plan_sizes: tuple[int, ...], conv_kernels: str) -> Any:
    """For a GPU engine of the resolved `kind` on the current device: its first start's cuDNN
    plan timing begun now, in worker processes, before the model is loaded (a
    tuning_pool.TuningPool for create_engine's `tuning`); None for the CPU engine, where
    the build cache holds this engine's choices, or where the host has too few cores."""
    if kind != "gpu":
        return None
    import cupy

    from speakerd.engine.gpu.build_key import conv_kernels_option
    from speakerd.engine.gpu.engine import GpuEngine
    from speakerd.engine.gpu.maths import MATHS
    from speakerd.engine.gpu.tuning_pool import start_before_the_model

    math, sizes = check_engine_config(GpuEngine.name, math, tuple(MATHS), plan_sizes)
    options = gpu_kernel_options(conv_kernels)
    return start_before_the_model(int(cupy.cuda.Device().id), math, sizes,
                                  conv_kernels_option(options["own_kernels"], options["fused_blocks"]),
                                  BuildCache(build_cache_dir()))  # fmt: skip


def gpu_kernel_options(conv_kernels: str) -> dict[str, bool]:
    """GpuEngine's keyword arguments for a --conv-kernels value: auto (our convolution
    kernels where faster than cuDNN), cudnn (cuDNN only), blocks (auto, and layer1's
    BasicBlocks by one kernel each where faster than their two convolutions)."""
    return {"own_kernels": conv_kernels != "cudnn", "fused_blocks": conv_kernels == "blocks"}


#: Windows one GPU segmentation run takes: 256 windows' activations are about 1.5 GB on the
#: device, and a group is a few seconds of an hour's audio to wait for before its first masks.
GPU_SEGMENTATION_WINDOWS = 256


def create_segmenter(model: SegmentationModel, path: Path, kind: str, math: str = "fp32") -> Segmenter:
    """The segmentation engine for `model` (read from `path`) beside an embedding engine of the
    resolved `kind`: on the GPU (engine/gpu/segmentation) in `math` ("fp32" or "fast") for
    "gpu", else NumPy on the host (engine/cpu_segmenter.py), which has fp32 only."""
    if kind == "gpu":
        from speakerd.engine.gpu.segmentation.engine import GpuSegmenter
        from speakerd.model.segmentation.weights import load_state_dict

        state = load_state_dict(path)
        return GpuSegmenter(state, model.model_id, max_windows=GPU_SEGMENTATION_WINDOWS, math=math)
    if math != "fp32":
        raise ValueError(f"segmentation math {math!r}: the CPU segmenter computes fp32 only")
    from speakerd.engine.cpu_segmenter import CpuSegmenter

    return CpuSegmenter(model)
