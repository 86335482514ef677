"""The BuildKey of a GPU engine: this device, its driver and libraries, and what the engine
builds (engine/build_cache.py says what the key guards and why every field is in it)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from speakerd.engine.build_cache import BuildKey, sources_digest
from speakerd.engine.gpu import kernels
from speakerd.model.numerics import Math

#: Where the NVIDIA kernel module states its version (the driver, e.g. 580.159.04); the
#: CUDA driver API's version stands in where it is not there (a container without /proc's).
NVIDIA_VERSION_FILE = Path("/proc/driver/nvidia/version")


def driver_version() -> str:
    """The NVIDIA driver's version ("580.159.04"), else the CUDA driver API's ("cuda 13020")."""
    try:
        words = NVIDIA_VERSION_FILE.read_text().split()
        for word in words:
            if word.count(".") >= 1 and word.replace(".", "").isdigit():
                return word
    except OSError:
        pass
    import cupy

    return f"cuda {cupy.cuda.runtime.driverGetVersion()}"


def package_version() -> str:
    try:
        return importlib.metadata.version("speakerd")
    except importlib.metadata.PackageNotFoundError:  # a source checkout on PYTHONPATH
        return "source"


def conv_kernels_option(own_kernels: bool, fused_blocks: bool) -> str:
    """The --conv-kernels value (engine/factory.py's gpu_kernel_options) of these options."""
    return "blocks" if fused_blocks else ("auto" if own_kernels else "cudnn")


def engine_build_key(
    device: int, model_id: str, math: Math, plan_sizes: tuple[int, ...], conv_kernels: str
) -> BuildKey:
    """The key of an engine on CUDA device `device` building `plan_sizes` of `model_id` in
    `math` with `conv_kernels` (auto | cudnn | blocks)."""
    import cudnn
    import cupy

    properties = cupy.cuda.runtime.getDeviceProperties(device)
    name = properties["name"]
    return BuildKey(
        gpu=name.decode() if isinstance(name, bytes) else str(name),
        compute_capability=f"{properties['major']}.{properties['minor']}",
        driver=driver_version(),
        cuda=str(cupy.cuda.runtime.runtimeGetVersion()),
        cudnn=str(cudnn.backend_version()),
        cudnn_frontend=str(cudnn.__version__),
        model_id=model_id,
        math=str(math),
        plan_sizes=tuple(plan_sizes),
        conv_kernels=conv_kernels,
        kernel_sources=sources_digest(
            (file, text.encode()) for file, text in kernels.kernel_sources().items()
        ),
        speakerd=package_version(),
    )
