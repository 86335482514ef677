"""`python -m speakerd bench`: time the GPU engine's plans and print JSON lines.

For each math (FP32 strict, TF32, FP16 mixed) and plan (b1, b32) in eager and graph mode: GPU compute
ms per batch from CUDA events (median and min over `--runs` after `--warmup`), chunks/s,
host-to-device and device-to-host ms, device memory, and the min per-row cosine / max abs
against the reference case (first_b1 for b1, mixed_b32 for b32). Then, when torch is
importable, the same network in PyTorch (cudnn.benchmark, channels_last, CUDA graph, the
same math, our folded weights) timed the same way, and our/PyTorch ratios; and a per-tap
GPU time profile of one b32 forward (CUDA events at every tap).

Why PyTorch in the same run: docs/performance.md's goals are ratios measured in the same run as the
anchor, since clocks and driver state differ between machines and days.
Speed is shown here, never in a unit test.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from speakerd.engine.factory import gpu_kernel_options
from speakerd.model.architecture import MAX_SPEAKERS, TRUNK_FLOPS_PER_CHUNK
from speakerd.model.numerics import Math, compare, pad_speakers
from speakerd.model.source import add_model_flag
from speakerd.serving.server.config import CONV_KERNELS, env_default

#: The reference case each benchmarked batch size runs (docs/model.md names).
CASE_FOR_BATCH = {1: "first_b1", 32: "mixed_b32"}
#: Defaults mirror the seed suite's benchmark: 5 warm-up runs, 30 timed.
DEFAULT_WARMUP = 5
DEFAULT_RUNS = 30
MIB = 1 << 20


def configure(parser: argparse.ArgumentParser) -> None:
    add_model_flag(parser)
    parser.add_argument(
        "--references", default=None, help="make-references output dir (default: compute with ORT CPU now)"
    )
    parser.add_argument(
        "--math", default="fp32,tf32,fp16", help="comma-separated maths to run (fp32,tf32,fp16)"
    )
    parser.add_argument("--batches", default="1,32", help="comma-separated plan sizes to time (1,32)")
    parser.add_argument("--warmup", type=int, default=DEFAULT_WARMUP, help="untimed runs per configuration")
    parser.add_argument("--runs", type=int, default=DEFAULT_RUNS, help="timed runs per configuration")
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch comparison")
    parser.add_argument("--no-profile", action="store_true", help="skip the per-tap b32 profile")
    parser.add_argument("--convs", action="store_true", help="also print the per-convolution choice table")
    parser.add_argument(
        "--conv-kernels", default=env_default("conv-kernels", "auto"), choices=CONV_KERNELS,
        help="auto: our conv kernel where faster; cudnn: cuDNN only; blocks: auto and layer1's blocks as "
        "one kernel each where faster [SPEAKERD_CONV_KERNELS]",
    )  # fmt: skip
    parser.add_argument(
        "--log-level", default="WARNING", help="logging level on stderr (INFO shows start-up)"
    )
    parser.add_argument(
        "--recording", type=float, default=None, metavar="SECONDS",
        help="instead: a whole recording of SECONDS through the GPU engine (EmbedRecording's path)",
    )  # fmt: skip
    parser.add_argument(
        "--batcher", type=int, default=None, metavar="STREAMS",
        help="instead: STREAMS callers of 32-chunk requests through the server's batcher, in process",
    )  # fmt: skip
    parser.add_argument("--seconds", type=float, default=10.0, help="with --batcher: run time")
    parser.add_argument("--sample-rate", type=int, default=16_000, help="with --recording: its PCM rate")
    parser.add_argument("--channels", type=int, default=1, help="with --recording: its channel count")


def say(**fields) -> None:
    print(json.dumps(fields), flush=True)


def _cases(
    batches: list[int], references: str | None, model
) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """batch -> (fbank, masks [n, 3, F], reference output [n*3, 256])."""
    out = {}
    for batch in batches:
        name = CASE_FOR_BATCH.get(batch)
        if name is None:
            raise SystemExit(
                f"--batches: no reference case for b{batch}; benchmarked sizes are {list(CASE_FOR_BATCH)}"
            )
        if references:
            from speakerd.model.cases import FILE_SUFFIX, load_case

            case = load_case(Path(references) / f"{name}{FILE_SUFFIX}")
            out[batch] = (case.fbank, pad_speakers(case.masks), case.output)
        else:
            from speakerd.model.cases import case_inputs
            from speakerd.onnx.runtime import OnnxReference

            fbank, masks = case_inputs(name)
            masks = pad_speakers(masks)
            out[batch] = (fbank, masks, OnnxReference(model, taps=False).run(fbank, masks)["output"])
    return out


def _median_min(values: list[float]) -> tuple[float, float]:
    return statistics.median(values), min(values)


def bench_ours(math: Math, model, cases, args) -> dict[tuple[int, str], float]:
    """Print our lines for `math`; returns (batch, mode) -> median compute ms."""
    import cupy

    from speakerd.engine.gpu.engine import GpuEngine

    # the pool still holds a closed engine's blocks: hand them back so the delta is ours
    cupy.get_default_memory_pool().free_all_blocks()
    free_before, total = cupy.cuda.runtime.memGetInfo()
    started = time.perf_counter()
    engine = GpuEngine(model, math, tuple(sorted(cases)), **gpu_kernel_options(args.conv_kernels))
    free_after, _ = cupy.cuda.runtime.memGetInfo()
    say(
        kind="engine",
        math=str(math),
        build_s=round(time.perf_counter() - started, 2),
        **engine.build_report(),
    )
    memory = engine.memory_report()
    medians = {}
    try:
        for batch, (fbank, masks, expected) in sorted(cases.items()):
            for mode in ("eager", "graph"):
                compute, h2d, d2h, output, fallbacks = [], [], [], None, 0
                for run in range(args.warmup + args.runs):
                    result = engine.run_batch(fbank, masks, use_graph=mode == "graph")
                    fallbacks += result.fp16_fallbacks
                    used = result.plans[0]  # "b1/eager" where a graph was dropped at start-up
                    if run >= args.warmup:
                        compute.append(result.compute_s * 1e3)
                        h2d.append(result.h2d_s * 1e3)
                        d2h.append(result.d2h_s * 1e3)
                    output = result.embeddings
                parity = compare(output, expected.reshape(-1, MAX_SPEAKERS, expected.shape[-1]))
                median, best = _median_min(compute)
                medians[(batch, mode)] = median
                say(
                    kind="ours", engine=engine.name, batch=batch, math=str(math), mode=mode, plan=used,
                    compute_ms_median=round(median, 4), compute_ms_min=round(best, 4),
                    chunks_per_s=round(batch / median * 1e3, 1),
                    tflops=round(TRUNK_FLOPS_PER_CHUNK * batch / (median * 1e9), 1),
                    h2d_ms=round(statistics.median(h2d), 4), d2h_ms=round(statistics.median(d2h), 4),
                    device_memory_mib=round((free_before - free_after) / MIB, 1),
                    engine_memory_mib={kind: round(size / MIB, 1) for kind, size in memory.items()},
                    device_total_mib=round(total / MIB), min_cosine=parity.min_cosine, max_abs=parity.max_abs,
                    max_relative_abs=parity.max_relative_abs, fp16_fallbacks=fallbacks,
                )  # fmt: skip
        if args.convs:
            for batch in sorted(cases):
                for row in engine.conv_report(batch):
                    say(kind="conv", math=str(math), batch=batch, **row)
        if not args.no_profile and 32 in cases:
            taps = engine.profile(32)
            say(
                kind="profile", math=str(math), batch=32, mode="eager", unit="ms",
                total_ms=round(sum(ms for _, ms in taps), 4), taps={name: round(ms, 4) for name, ms in taps},
            )  # fmt: skip
    finally:
        engine.close()
        cupy.get_default_memory_pool().free_all_blocks()
    return medians


def _whole_path(engine, args: argparse.Namespace) -> dict[str, object]:
    """--recording or --batcher: one line for `engine` on that path."""
    if args.batcher is not None:
        from speakerd.model.cases import case_inputs
        from speakerd.tools.bench_batcher import bench as bench_batcher

        if args.batcher < 1:
            raise SystemExit(f"--batcher: {args.batcher} streams, expected at least 1")
        fbank, masks = case_inputs(CASE_FOR_BATCH[32])
        return bench_batcher(engine, fbank, pad_speakers(masks), args.batcher, args.seconds)
    from speakerd.tools.bench_recording import bench as bench_recording

    return bench_recording(engine, args.recording, args.sample_rate, args.channels, args.runs)


# ----- the PyTorch comparison ------------------------------------------------------------
def torch_forward_factory(model, math: Math):
    """The same folded network in PyTorch, channels_last, `math`; returns (step, inputs).
    FP16: the trunk in half (weights, activations; cuDNN accumulates in FP32), the pooling
    and the linear in FP32, as ours."""
    import torch
    import torch.nn.functional as F

    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = math == Math.TF32
    torch.backends.cuda.matmul.allow_tf32 = False  # the linear is FP32 in both maths, as ours

    dtype = torch.float16 if math == Math.FP16 else torch.float32

    def conv(folded):
        weight = (
            torch.from_numpy(folded.weight).cuda().to(dtype).contiguous(memory_format=torch.channels_last)
        )
        return weight, torch.from_numpy(folded.bias).cuda().to(dtype), folded.spec.stride, folded.spec.pad

    stem = conv(model.stem)
    blocks = [
        (conv(b.conv1), conv(b.conv2), conv(b.shortcut) if b.shortcut is not None else None)
        for b in model.blocks
    ]
    seg_w = torch.from_numpy(model.seg_weight).cuda()
    seg_b = torch.from_numpy(model.seg_bias).cuda()

    def apply(x, params):
        weight, bias, stride, pad = params
        return F.conv2d(x, weight, bias, stride, pad)

    def forward(fbank, masks):
        x = fbank.permute(0, 2, 1).unsqueeze(1).to(dtype).contiguous(memory_format=torch.channels_last)
        x = F.relu(apply(x, stem))
        for conv1, conv2, shortcut in blocks:
            hidden = F.relu(apply(x, conv1))
            x = F.relu(apply(hidden, conv2) + (apply(x, shortcut) if shortcut is not None else x))
        b, c, f, t = x.shape
        x = x.float().reshape(b, c * f, t)
        index = (torch.arange(t, device=x.device) * masks.shape[-1]) // t  # pyannote nearest resize
        w = masks[..., index]  # [b, s, t]
        v1 = w.sum(-1, keepdim=True) + 1e-8
        mean = torch.einsum("bct,bst->bsc", x, w) / v1
        dx = x.unsqueeze(1) - mean.unsqueeze(-1)  # [b, s, c, t]: the exact two-pass variance
        v2 = (w * w).sum(-1, keepdim=True)
        var = torch.einsum("bsct,bst->bsc", dx * dx, w) / (v1 - v2 / v1 + 1e-8)
        stats = torch.cat([mean, var.sqrt()], -1)
        return stats @ seg_w.T + seg_b

    return forward


def bench_torch(math: Math, model, cases, args, ours: dict[tuple[int, str], float]) -> None:
    import torch

    for batch, (fbank, masks, expected) in sorted(cases.items()):
        forward = torch_forward_factory(model, math)
        fbank_d = torch.from_numpy(np.ascontiguousarray(fbank)).cuda()
        masks_d = torch.from_numpy(np.ascontiguousarray(masks)).cuda()

        def step(forward=forward, fbank_d=fbank_d, masks_d=masks_d):
            with torch.inference_mode():
                return forward(fbank_d, masks_d)

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            out = step()
        times = []
        for run in range(args.warmup + args.runs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            if run >= args.warmup:
                times.append(start.elapsed_time(end))
        parity = compare(out.float().cpu().numpy(), expected.reshape(-1, MAX_SPEAKERS, expected.shape[-1]))
        median, best = _median_min(times)
        say(
            kind="torch", torch=torch.__version__, cudnn=torch.backends.cudnn.version(), batch=batch,
            math=str(math), mode="graph", layout="channels_last", ms_median=round(median, 4),
            ms_min=round(best, 4), chunks_per_s=round(batch / median * 1e3, 1), min_cosine=parity.min_cosine,
            max_abs=parity.max_abs,
        )  # fmt: skip
        if (batch, "graph") in ours:
            say(
                kind="ratio", batch=batch, math=str(math), mode="graph",
                ours_ms=round(ours[(batch, "graph")], 4), torch_ms=round(median, 4),
                ours_over_torch_speed=round(median / ours[(batch, "graph")], 3),
            )  # fmt: skip
        del graph, out
        torch.cuda.empty_cache()


def run(args: argparse.Namespace) -> int:
    from speakerd.engine.gpu import gpu_available
    from speakerd.model.source import ModelError, resolve_model
    from speakerd.model.weights import load_model

    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(name)s %(message)s"
    )
    usable, detail = gpu_available()
    if not usable:
        print(f"bench: no usable GPU: {detail}", file=sys.stderr)
        return 2
    maths = [Math(name.strip()) for name in args.math.split(",") if name.strip()]
    batches = sorted({int(size) for size in args.batches.split(",") if size.strip()})
    try:
        model = load_model(resolve_model(args.model).path)
    except ModelError as error:
        print(f"bench: {error}", file=sys.stderr)
        return 2
    say(
        kind="env",
        device=detail,
        model_id=model.model_id[:16],
        gflop_per_chunk=round(TRUNK_FLOPS_PER_CHUNK / 1e9, 2),
    )
    if args.recording is not None or args.batcher is not None:
        from speakerd.engine.gpu.engine import GpuEngine

        for math in maths:
            engine = GpuEngine(model, math, (1, 32), **gpu_kernel_options(args.conv_kernels))
            try:
                say(**_whole_path(engine, args))
            finally:
                engine.close()
        return 0
    cases = _cases(batches, args.references, model)
    results = {math: bench_ours(math, model, cases, args) for math in maths}
    if args.no_torch:
        return 0
    try:
        import torch  # noqa: F401
    except ImportError as error:
        say(kind="torch", skipped=f"torch not importable: {error}")
        return 0
    for math in maths:
        bench_torch(math, model, cases, args, results[math])
    return 0
