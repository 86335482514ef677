"""Times builds of kernels/conv_wgmma.cu that differ from the engine's in a measurement
switch (WG_RESIDUAL_EARLY, WG_OMIT: see the file's head) or in how the halo is loaded (the
TMA with a tensor map, or every thread's cp.async when the map is null), and optionally
another version of the file (--baseline FILE, e.g. an older commit's, launched with the
arguments it takes), on layer1's b32 convolutions (32 -> 32 channels, 80 x 998) and
layer2's (64 -> 64, 40 x 499), each with both epilogues (bias + ReLU; bias + residual +
ReLU).

Why: a kernel's time says nothing of where it goes. A build that leaves one stage out (the
MMAs, the epilogue's memory traffic, the next tile's halo copy) prices that stage by
difference, with no profiler. Builds that leave nothing out must give the engine build's
bits exactly (`same_bits`, against the first build timed: cp_async_halo unless --builds says
otherwise, so that a TMA launch that fails does so after the copies' numbers are out); the
others' outputs are wrong by design (`same_bits` null).

Prints one JSON line per (build, kernel, epilogue), then a table of the times. With
--launch-once, launches each (build, kernel, epilogue) once without timing: for a profiler
(ncu -k regex:conv_wgmma) to capture.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import cupy

from speakerd.engine.gpu import igemm, kernels, tensor_map
from speakerd.engine.gpu.timing import fill_random, time_launches
from speakerd.model.architecture import ConvSpec

#: build name -> the switches it compiles conv_wgmma.cu with ({} is the engine's build) and
#: whether its launches pass the halo's tensor map (the engine's do)
BUILDS: dict[str, tuple[dict[str, int], bool]] = {
    "cp_async_halo": ({}, False),
    "engine": ({}, True),
    "residual_late": ({"WG_RESIDUAL_EARLY": 0}, True),
    "omit_mma": ({"WG_OMIT": 1}, True),
    "omit_epilogue_io": ({"WG_OMIT": 2}, True),
    "omit_halo_copy": ({"WG_OMIT": 4}, True),
    "mma_only": ({"WG_OMIT": 6}, True),
}
#: the kernel arguments before --baseline's file: no halo map (conv_wgmma.cu before the TMA)
BASELINE_TAKES_MAP = False
#: the convolutions timed: layer1's and layer2's 3x3 stride-1 shapes at b32
SPECS = (ConvSpec("layer1", "bn", 32, 32, 3, 1, 80, 998), ConvSpec("layer2", "bn", 64, 64, 3, 1, 40, 499))
BATCH = 32


def build(text: str, switches: dict[str, int], folder: Path, name: str):  # -> cupy.RawModule
    """conv_wgmma.cu's `text` compiled for sm_90a with `switches` defined ahead of it."""
    defines = "".join(f"#define {key} {value}\n" for key, value in switches.items())
    cubin = folder / f"{name}.cubin"
    arch = kernels.arch_of(igemm.WGMMA_SOURCE)
    cubin.write_bytes(kernels.compile_binary(defines + text, arch, igemm.WGMMA_SOURCE))
    return cupy.RawModule(path=str(cubin))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--builds", nargs="+", choices=sorted(BUILDS), default=list(BUILDS))
    parser.add_argument("--baseline", type=Path, help="another conv_wgmma.cu to time as build 'baseline'")
    parser.add_argument("--launch-once", action="store_true", help="launch each kernel once, untimed (ncu)")
    options = parser.parse_args()

    device = cupy.cuda.Device()
    sm_count = int(device.attributes["MultiProcessorCount"])
    text = kernels.kernel_sources()[igemm.WGMMA_SOURCE]
    sources = {name: (text, *BUILDS[name]) for name in options.builds}
    if options.baseline:
        baseline = (kernels.expand_includes(options.baseline.read_text()), {}, BASELINE_TAKES_MAP)
        sources = {"baseline": baseline, **sources}
    random = cupy.random.RandomState(1)
    stream = cupy.cuda.Stream(non_blocking=True)
    first_bits: dict[tuple[str, str], cupy.ndarray] = {}
    rows = []
    with tempfile.TemporaryDirectory() as folder, stream:
        modules = {name: build(text, flags, Path(folder), name) for name, (text, flags, _) in sources.items()}
        for spec in SPECS:
            pixels = BATCH * spec.h_out * spec.w_out
            x = cupy.empty((pixels, spec.cin), dtype=cupy.float16)
            w = cupy.empty((spec.cout, 3, 3, spec.cin), dtype=cupy.float16)
            bias = cupy.empty((spec.cout,), dtype=cupy.float32)
            residual = cupy.empty((pixels, spec.cout), dtype=cupy.float16)
            for values in (x, w, bias, residual):
                fill_random(values, random)
            w *= 0.08  # sums of ~ unit size: no FP16 overflow
            y = cupy.empty((pixels, spec.cout), dtype=cupy.float16)
            flag = cupy.zeros((1,), dtype=cupy.int32)
            flops = 2 * pixels * spec.cout * 9 * spec.cin
            entries = [e for e in igemm.WGMMA_ENTRIES if e.cin == spec.cin]
            for name, module in modules.items():
                for entry in entries:
                    kernel = module.get_function(igemm.wgmma_kernel_name(entry))
                    shared = igemm.wgmma_shared_bytes(entry)
                    kernel.max_dynamic_shared_size_bytes = shared
                    grid = igemm.wgmma_grid(spec, BATCH, entry, sm_count)
                    halo = (entry.pixels[0] + 2, entry.pixels[1] + 2)
                    halo_map = tensor_map.nhwc_box_map(x, (BATCH, spec.h_in, spec.w_in, spec.cin), halo)
                    takes_map = sources[name][2] or name != "baseline"
                    map_argument = (halo_map if sources[name][2] else cupy.uint64(0),) if takes_map else ()
                    for epilogue, add in (("bias_relu", 0), ("bias_add_relu", residual.data.ptr)):
                        sizes = (spec.h_in, spec.w_in, spec.cin, spec.h_out, spec.w_out, spec.cout, 1, BATCH)
                        args = (
                            x,
                            w,
                            bias,
                            cupy.uint64(add),
                            y,
                            flag,
                            *(cupy.int32(v) for v in sizes),
                            *map_argument,
                        )

                        def launch(on, kernel=kernel, grid=grid, args=args, shared=shared) -> None:
                            kernel(grid, (igemm.WGMMA_THREADS, 1, 1), args, shared_mem=shared, stream=on)

                        y.fill(cupy.float16("nan"))
                        launch(stream)
                        if options.launch_once:
                            continue
                        key = (igemm.wgmma_kernel_name(entry), epilogue)
                        if key not in first_bits:
                            first_bits[key] = y.copy()
                        exact = not sources[name][1].get("WG_OMIT", 0)
                        same = bool(cupy.array_equal(y, first_bits[key])) if exact else None
                        ms = time_launches(launch, stream)
                        row = {"build": name, "conv": spec.name, "kernel": key[0], "epilogue": epilogue,
                               "ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1), "grid": list(grid),
                               "same_bits": same}  # fmt: skip
                        rows.append(row)
                        print(json.dumps(row), flush=True)
        stream.synchronize()
    if rows:
        print(f"{'kernel':<26} {'epilogue':<14}" + "".join(f"{name[:16]:>17}" for name in modules))
        for kernel, epilogue in dict.fromkeys((r["kernel"], r["epilogue"]) for r in rows):
            times = {r["build"]: r["ms"] for r in rows if (r["kernel"], r["epilogue"]) == (kernel, epilogue)}
            print(f"{kernel:<26} {epilogue:<14}" + "".join(f"{times.get(name, ''):>17}" for name in modules))


if __name__ == "__main__":
    main()
