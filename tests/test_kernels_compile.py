"""Every kernels/*.cu compiles with NVRTC for sm_90 (the H200; sm_90a for the wgmma file,
kernels.CHIP_SOURCES), with no GPU needed.

NVRTC comes with CuPy here (cupy_backends.cuda.libs.nvrtc, which loads libnvrtc); .ci/run
installs cupy-cuda12x and nvidia-cuda-nvrtc-cu12, so CI compiles every kernel without a GPU.
Where neither is installed the compile test skips and says so, while the source checks
below (entry points present, constants equal to speakerd.model.architecture) always run: they
catch a kernel drifting from the Python side without any CUDA at all.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

from speakerd.engine.gpu import block, igemm, kernels
from speakerd.model import architecture


def _nvrtc_or_reason() -> str | None:
    """None when NVRTC is usable, else why not."""
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
    except Exception as error:  # ImportError without CuPy; a load error without libnvrtc
        return f"NVRTC unavailable (CuPy not installed, or no libnvrtc): {type(error).__name__}: {error}"
    return None


NO_NVRTC = _nvrtc_or_reason()
#: An entry point's declaration (launch bounds optional).
ENTRY = r'extern "C" __global__ (?:__launch_bounds__\([^)]*\) )?void (\w+)'


#: NVRTC's compile, kept before the cache test below replaces kernels.compile_binary with its
#: counting stand-in, which calls `compiled`: so that test runs alone too, not only after the compile test.
COMPILE_BINARY = kernels.compile_binary


@functools.cache
def compiled(name: str) -> bytes:
    """kernels/`name` compiled by NVRTC for its architecture, once per test process: the
    compile test and the cache test below share it (sm_90a's wgmma file alone costs seconds)."""
    return COMPILE_BINARY(kernels.kernel_sources()[name], kernels.arch_of(name), name)


@pytest.mark.slow
@pytest.mark.skipif(NO_NVRTC is not None, reason=str(NO_NVRTC))
@pytest.mark.parametrize("name", sorted(kernels.kernel_sources()))
def test_kernel_file_compiles_for_sm90(name: str) -> None:
    source = kernels.kernel_sources()[name]
    cubin = compiled(name)  # sm_90a for wgmma
    assert cubin[:4] == b"\x7fELF", f"{name}: NVRTC output is not an ELF cubin ({cubin[:16]!r})"
    launched = {
        kernels.ENGINE_SOURCE: kernels.KERNEL_NAMES, igemm.SOURCE: igemm.KERNEL_NAMES,
        igemm.F16_SOURCE: igemm.F16_KERNEL_NAMES, block.SOURCE: block.KERNEL_NAMES,
        igemm.WGMMA_SOURCE: igemm.WGMMA_KERNEL_NAMES,
    }.get(name, ())  # fmt: skip
    for entry in {*re.findall(ENTRY, source), *launched}:  # F16_ENTRY's names appear only in the cubin
        assert entry.encode() in cubin, f"{name}: entry point {entry} missing from the cubin"


def test_headers_are_pasted_into_the_sources() -> None:
    """`#include "x.cuh"` lines of kernels/ are replaced by the header's text (kernels.py)."""
    for name, source in kernels.kernel_sources().items():
        assert not kernels.INCLUDE.search(source), f"{name}: an include was left for NVRTC"
    assert "zero_fragments" in kernels.kernel_sources()[igemm.F16_SOURCE]


def test_compile_errors_carry_the_nvrtc_log() -> None:
    if NO_NVRTC is not None:
        pytest.skip(NO_NVRTC)
    with pytest.raises(RuntimeError, match="undeclared_name"):
        kernels.compile_binary('extern "C" __global__ void k(float* y) { y[0] = undeclared_name; }')


def test_engine_entry_points_are_defined() -> None:
    source = kernels.kernel_sources()[kernels.ENGINE_SOURCE]
    defined = set(re.findall(ENTRY, source))
    missing = sorted(set(kernels.KERNEL_NAMES) - defined)
    assert not missing, f"kernels the engine launches but {kernels.ENGINE_SOURCE} lacks: {missing}"


#: kernels/speakerd.cu #define -> the speakerd.model.architecture value it must equal.
CONSTANTS = {
    "FRAMES": architecture.FRAMES,
    "MELS": architecture.MEL_BINS,
    "SPEAKERS": architecture.MAX_SPEAKERS,
    "TRUNK_CHANNELS": architecture.TRUNK_CHANNELS,
    "TRUNK_MELS": architecture.TRUNK_MELS,
    "TRUNK_FRAMES": architecture.TRUNK_FRAMES,
    "STEM_CHANNELS": architecture.STEM.cout,
}


def test_kernel_constants_match_the_architecture() -> None:
    source = kernels.kernel_sources()[kernels.ENGINE_SOURCE]
    defines = dict(re.findall(r"^#define (\w+) (\d+)\s*$", source, flags=re.MULTILINE))
    wrong = {
        name: (defines.get(name), value)
        for name, value in CONSTANTS.items()
        if defines.get(name) != str(value)
    }
    assert not wrong, f"(kernel #define, architecture) disagree: {wrong}"
    from speakerd.engine.gpu.plan import TRANSPOSE_TILE

    assert defines.get("TILE") == str(TRANSPOSE_TILE), (defines.get("TILE"), TRANSPOSE_TILE)
    from speakerd.engine.gpu import stem

    assert defines.get("STEM_THREADS") == str(stem.THREADS), (defines.get("STEM_THREADS"), stem.THREADS)


@pytest.mark.skipif(NO_NVRTC is not None, reason=str(NO_NVRTC))
def test_chip_kernels_are_compiled_once_per_machine(tmp_path, monkeypatch) -> None:
    """A CHIP_SOURCES file (sm_90a, which CuPy's compiler cannot target) is compiled by
    NVRTC into a cubin kept in CuPy's cache folder: a second start finds it and compiles
    nothing; where the folder cannot be written the cubin goes to a folder of the process."""
    from speakerd.engine.gpu import igemm

    compiles: list[str] = []

    def compile_once(source: str, arch: str, name: str) -> bytes:
        """NVRTC's cubin of `name`, each call counted (the compile test's, when it ran first)."""
        assert source == kernels.kernel_sources()[name] and arch == kernels.arch_of(name), (name, arch)
        compiles.append(name)
        return compiled(name)

    monkeypatch.setattr(kernels, "compile_binary", compile_once)
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "cache"))
    first = kernels._cubin(igemm.WGMMA_SOURCE)
    assert compiles == [igemm.WGMMA_SOURCE], compiles
    assert first.parent == tmp_path / "cache" and first.read_bytes()[:4] == b"\x7fELF", first
    assert not list(first.parent.glob("*.part")), "a partial file was left behind"

    def no_compile(*args, **kwargs):
        raise AssertionError("compiled again although the cubin is cached")

    monkeypatch.setattr(kernels, "compile_binary", no_compile)
    assert kernels._cubin(igemm.WGMMA_SOURCE) == first
    monkeypatch.setattr(kernels, "compile_binary", compile_once)
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("CUPY_CACHE_DIR", str(blocked))
    fallback = kernels._cubin(igemm.WGMMA_SOURCE)
    assert compiles == [igemm.WGMMA_SOURCE] * 2, compiles
    assert fallback.parent == Path(kernels._process_folder().name), fallback
    assert fallback.read_bytes() == first.read_bytes()
