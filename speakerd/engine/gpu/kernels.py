"""The project's own CUDA kernels (the package data `kernels/*.cu` beside this module),
compiled once per process by NVRTC.

Kept apart from the engine so CI can compile every kernel file without a GPU
(`kernel_sources`, `compile_options`, `compile_binary` and `KERNEL_NAMES` are what
tests/test_kernels_compile.py uses).
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

#: The kernels' folder, read through importlib.resources so that it works the same from a
#: source checkout, an installed wheel or a zip: the .cu files are package data of
#: speakerd.engine.gpu (pyproject's package-data), never copied anywhere by hand.
KERNEL_DIR: Traversable = resources.files("speakerd.engine.gpu") / "kernels"
#: The file holding every entry point the engine launches.
ENGINE_SOURCE = "speakerd.cu"
#: every extern "C" entry point of kernels/speakerd.cu that the engine launches.
KERNEL_NAMES = (
    "fbank_to_stem", "bias_only", "bias_relu", "bias_add_relu", "stats_pool_f32", "stem_f32",
    "bias_only_f16", "bias_relu_f16", "bias_add_relu_f16", "stats_pool_f16", "stem_f16",
)  # fmt: skip
#: The compute capability CI compiles for without a device: the H200 (Hopper, sm_90),
#: in the digits-only form CuPy's compiler takes.
CI_ARCH = "90"
#: kernels/ files that use instructions of one chip only (wgmma: sm_90a, "a" for the
#: architecture-specific target) -> the compute capability they are built for. CuPy's
#: compiler names plain targets only, so these are compiled here (compile_binary) and their
#: cubin loaded; they run on that compute capability alone.
CHIP_SOURCES = {"conv_wgmma.cu": "90"}


def arch_of(source: str, capability: str = CI_ARCH) -> str:
    """The NVRTC architecture (digits, maybe with "a") `source` is compiled for on a device
    of `capability`."""
    return f"{CHIP_SOURCES[source]}a" if source in CHIP_SOURCES else capability


#: `#include "name.cuh"`: a header of kernels/ that kernel_sources() pastes in place.
INCLUDE = re.compile(r'^#include "(\w+\.cuh)"$', re.MULTILINE)


def kernel_sources() -> dict[str, str]:
    """file name -> CUDA C++ source of every kernels/*.cu, each `#include "x.cuh"` of
    kernels/ replaced by that file's text. Why not NVRTC's include path: CuPy caches a
    binary under its source text and options, so a header edit would not recompile a
    source that merely names it."""
    files = sorted((item for item in KERNEL_DIR.iterdir() if item.name.endswith(".cu")), key=lambda f: f.name)
    assert files, f"no kernels found under {KERNEL_DIR}"
    return {path.name: expand_includes(path.read_text()) for path in files}


def expand_includes(text: str) -> str:
    """CUDA C++ `text` with each `#include "x.cuh"` of kernels/ replaced by that file's
    text (also for a kernel file kept outside the package, e.g. an older version timed
    against this one)."""
    return INCLUDE.sub(_header, text)


def _header(match: re.Match) -> str:
    path = KERNEL_DIR / match.group(1)
    assert path.is_file(), f"kernels/{match.group(1)} is included but missing"
    return f"// ---- kernels/{path.name} ----\n{path.read_text()}// ---- end of kernels/{path.name} ----"


def compile_options() -> tuple[str, ...]:
    """NVRTC options. -fmad=true is NVRTC's default; named so that a change is a
    decision, since FMA contraction is part of the arithmetic the parity bounds were
    measured with."""
    return ("-std=c++17", "-fmad=true")


def compile_binary(source: str, arch: str = CI_ARCH, name: str = ENGINE_SOURCE) -> bytes:
    """`source` compiled by NVRTC into sm_`arch` machine code (a cubin). No device is
    needed: the architecture is named, not queried. Raises RuntimeError carrying NVRTC's
    log on a compile error."""
    from cupy_backends.cuda.libs import nvrtc

    program = nvrtc.createProgram(source, name, (), ())
    try:
        try:
            nvrtc.compileProgram(program, (*compile_options(), f"--gpu-architecture=sm_{arch}"))
        except nvrtc.NVRTCError as error:
            raise RuntimeError(
                f"NVRTC failed on {name} for sm_{arch}: {error}\n{nvrtc.getProgramLog(program)}"
            ) from error
        return bytes(nvrtc.getCUBIN(program))
    finally:
        nvrtc.destroyProgram(program)


def module(source: str = ENGINE_SOURCE):  # -> cupy.RawModule
    """kernels/`source` compiled for the current device (CuPy caches the binary on disk; a
    CHIP_SOURCES file is compiled here and its cubin cached beside CuPy's: _cubin). Once per
    process: a call while another thread compiles it (compile_in_background) waits for that
    compile instead of starting its own."""
    with _guard:
        lock = _locks.setdefault(source, threading.Lock())
    with lock:
        return _module(source)


#: One lock per source, so that a source is compiled once however many threads ask for it.
_locks: dict[str, threading.Lock] = {}
_guard = threading.Lock()


def compile_in_background(device: int, threads: int | None = None) -> list[Future]:
    """Start compiling every kernels/ source that device `device` runs, each on a thread of
    its own (NVRTC releases the GIL), and return at once: a fresh machine then spends the
    longest compile on them, not their sum (about 40 s of NVRTC on one core), while start-up
    loads models and builds plans; `module` waits where a compile is still running. A
    source that fails here fails again, with NVRTC's log, where it is used."""
    import cupy

    capability = str(cupy.cuda.Device(device).compute_capability)
    sources = [s for s in kernel_sources() if s not in CHIP_SOURCES or CHIP_SOURCES[s] == capability]

    def build(source: str) -> None:
        with cupy.cuda.Device(device):
            module(source)

    pool = ThreadPoolExecutor(max_workers=threads or len(sources), thread_name_prefix="nvrtc")
    futures = [pool.submit(build, source) for source in sources]
    pool.shutdown(wait=False)
    return futures


@functools.cache
def _module(source: str):  # -> cupy.RawModule
    import cupy

    if source not in CHIP_SOURCES:
        raw = cupy.RawModule(code=kernel_sources()[source], options=compile_options(), backend="nvrtc")
        raw.compile()
        return raw
    capability = cupy.cuda.Device().compute_capability
    assert capability == CHIP_SOURCES[source], (
        f"{source} is built for compute capability {CHIP_SOURCES[source]}; this device is {capability}"
    )
    return cupy.RawModule(path=str(_cubin(source)))  # loaded at its first get_function


def _cubin(source: str) -> Path:
    """The cubin of CHIP_SOURCES file `source`, compiled once per machine: kept in CuPy's
    kernel cache folder ($CUPY_CACHE_DIR, else ~/.cupy/kernel_cache) under a hash of the
    source text, options, architecture and NVRTC version (an edit or another NVRTC compiles
    afresh); where that folder cannot be written, in a folder of this process."""
    from cupy_backends.cuda.libs import nvrtc

    text, arch = kernel_sources()[source], arch_of(source)
    key = hashlib.sha256(repr((text, compile_options(), arch, nvrtc.getVersion())).encode()).hexdigest()[:20]
    name = f"speakerd-{source}-{arch}-{key}.cubin"
    folder = Path(os.environ.get("CUPY_CACHE_DIR") or Path.home() / ".cupy" / "kernel_cache")
    if (folder / name).is_file():
        return folder / name
    cubin = compile_binary(text, arch, source)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, suffix=".part", delete=False) as part:
            part.write(cubin)
        os.replace(part.name, folder / name)  # whole or absent, whoever writes it too
        return folder / name
    except OSError:
        path = Path(_process_folder().name) / name
        path.write_bytes(cubin)
        return path


@functools.cache
def _process_folder() -> tempfile.TemporaryDirectory:
    """This process's folder for cubins it could not cache (removed at exit)."""
    return tempfile.TemporaryDirectory(prefix="speakerd-kernels-")


@functools.cache
def function(name: str):  # -> cupy.RawKernel
    """Entry point `name` of kernels/speakerd.cu, fetched once per process."""
    assert name in KERNEL_NAMES, f"unknown kernel {name!r}; kernels are {KERNEL_NAMES}"
    return module().get_function(name)


@functools.cache
def entry(source: str, name: str, shared: int):  # -> cupy.RawKernel
    """Entry point `name` of kernels/`source`, fetched once per process (launches sit on the
    eager forward path), its dynamic shared memory limit raised to `shared` bytes (above 48
    KB needs it)."""
    function = module(source).get_function(name)
    function.max_dynamic_shared_size_bytes = shared
    return function
