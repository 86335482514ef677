"""Times builds of kernels/conv_wgmma.cu that differ from the engine's in a measurement
switch (WG_RESIDUAL_EARLY, WG_OMIT: see the file's head), and optionally another version of
the file (--baseline FILE, e.g. an older commit's), on layer1's b32 convolutions (32 -> 32
channels, 80 x 998) and layer2's (64 -> 64, 40 x 499), each with both epilogues (bias +
ReLU; bias + residual + ReLU).

Why: a kernel's time says nothing of where it goes. A build that leaves one stage out (the
MMAs, the epilogue's memory traffic, the next tile's halo copy) prices that stage by
difference, with no profiler. Builds that leave nothing out must give the engine build's
bits exactly (`same_bits`); the others' outputs are wrong by design (`same_bits` null).

Prints one JSON line per (build, kernel, epilogue), then a table of the times. With
--launch-once, launches each (build, kernel, epilogue) once without timing: for a profiler
(ncu -k regex:conv_wgmma) to capture.
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
from pathlib import Path

import cupy

from speakerd.engine.gpu import igemm, kernels
from speakerd.engine.gpu.timing import fill_random, time_launches
from speakerd.model.architecture import ConvSpec
from speakerd.model.numerics import Math

#: build name -> the switches it compiles conv_wgmma.cu with ({} is the engine's build)
BUILDS: dict[str, dict[str, int]] = {
    "engine": {},
    "residual_late": {"WG_RESIDUAL_EARLY": 0},
    "omit_mma": {"WG_OMIT": 1},
    "omit_epilogue_io": {"WG_OMIT": 2},
    "omit_halo_copy": {"WG_OMIT": 4},
    "mma_only": {"WG_OMIT": 6},
}
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
    sources = {name: (kernels.kernel_sources()[igemm.WGMMA_SOURCE], BUILDS[name]) for name in options.builds}
    if options.baseline:
        sources["baseline"] = (kernels.expand_includes(options.baseline.read_text()), {})
    random = cupy.random.RandomState(1)
    stream = cupy.cuda.Stream(non_blocking=True)
    engine_bits: dict[tuple[str, str], cupy.ndarray] = {}
    rows = []
    with tempfile.TemporaryDirectory() as folder, stream:
        modules = {name: build(text, flags, Path(folder), name) for name, (text, flags) in sources.items()}
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
            epilogues = (("bias_relu", None), ("bias_add_relu", residual))
            variants = igemm.wgmma_candidates_for(spec, Math.FP16, str(device.compute_capability))
            for variant, (epilogue, add) in itertools.product(variants, epilogues):
                # the engine's binding (arguments, grid, block, shared memory), each build's
                # entry point of the same name launched with it
                conv = igemm.IgemmConv.of(variant, spec, BATCH, Math.FP16, epilogue, x, w, bias, add, y, flag,
                                          sm_count=sm_count)  # fmt: skip
                key = (conv.name, epilogue)
                for name, module in modules.items():
                    kernel = module.get_function(conv.name)
                    kernel.max_dynamic_shared_size_bytes = conv.shared

                    def launch(on, kernel=kernel, conv=conv) -> None:
                        kernel(conv.grid, (conv.threads, 1, 1), conv.args, shared_mem=conv.shared, stream=on)

                    y.fill(cupy.float16("nan"))
                    launch(stream)
                    if options.launch_once:
                        continue
                    if name == "engine":
                        engine_bits[key] = y.copy()
                    exact = not sources[name][1].get("WG_OMIT", 0) and key in engine_bits
                    same = bool(cupy.array_equal(y, engine_bits[key])) if exact else None
                    ms = time_launches(launch, stream)
                    row = {"build": name, "conv": spec.name, "kernel": conv.name, "epilogue": epilogue,
                           "ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1), "grid": list(conv.grid),
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
