"""Device probe: what a plan's captured CUDA graph holds and whether its replays stay equal
to eager over time (the TF32 b1 problem of issue 3).

Writes the graph's DOT (CuPy's debug_dot_str, verbose) to $OUT, prints JSON lines: the
node types of the whole-forward graph and of each convolution captured alone, and the
replay-vs-eager differences before and after host-heap churn, first with the plan as
chosen and then with every cuDNN-fused convolution replaced by bare conv + our epilogue.

    python scripts/probe_graph.py [--math tf32] [--batch 1]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def say(**fields) -> None:
    print(json.dumps(fields), flush=True)


def node_types(dot: str) -> dict[str, int]:
    """Counts of node kinds in a verbose DOT dump (labels start with the kind)."""
    kinds = re.findall(r'label="\{?\s*([A-Z_]+)', dot)
    return dict(collections.Counter(kinds))


def dot_of(graph) -> str:
    import cupy

    flags = cupy.cuda.runtime.cudaGraphDebugDotFlagsVerbose
    try:
        return graph.debug_dot_str(flags)
    except TypeError:
        return graph.debug_dot_str()


def churn() -> None:
    """Allocate and free host memory of many sizes (what a serving process does between
    replays), so a graph that reads freed host memory sees it change."""
    import numpy as np

    keep = []
    for size in [64, 256, 1024, 4096, 16384, 65536, 1 << 20] * 40:
        keep.append(bytearray(os.urandom(64)) * (size // 64))
        keep.append(np.random.standard_normal(size // 8))
    del keep


def replay_diffs(capture, replays: int) -> list[int]:
    """Values of output/active differing from eager on each replay (realistic inputs)."""
    import cupy

    plan, stream = capture.plan, capture.stream
    capture._random_inputs(realistic=True)
    counts = []
    with stream:
        plan.forward()
        eager, active = plan.output.copy(), plan.active.copy()
        for _ in range(replays):
            plan.output.fill(float("nan"))
            capture.graph.launch(stream)
            counts.append(
                int(cupy.count_nonzero(plan.output != eager).get())
                + int(cupy.count_nonzero(plan.active != active).get())
            )
    stream.synchronize()
    return counts


def survey(capture, label: str, out: Path) -> None:
    import cupy

    plan, stream = capture.plan, capture.stream
    capture.graph = capture._record()
    dot = dot_of(capture.graph)
    (out / f"{label}.dot").write_text(dot)
    say(probe=label, nodes=node_types(dot), dot_bytes=len(dot))
    before = replay_diffs(capture, 10)
    churn()
    for _ in range(3):  # eager forwards in between, as the self-check and bench do
        plan.forward()
    stream.synchronize()
    after = replay_diffs(capture, 10)
    say(probe=label, replay_diffs_before_churn=before, replay_diffs_after_churn=after)
    alone = {}
    for step in plan.convs:
        choice = step.choice
        if choice.graph is None or choice.own is not None:
            continue  # ours: one kernel launch, nothing of cuDNN's to survey
        with stream:
            stream.begin_capture()
            try:
                choice.graph.execute(choice.pack, plan.ctx.workspace.ptr, plan.ctx.cudnn)
            finally:
                captured = stream.end_capture()
        kinds = node_types(dot_of(captured))
        if set(kinds) - {"KERNEL"} or kinds.get("KERNEL", 0) != 1:
            alone[step.name] = {
                "nodes": kinds,
                "plan": choice.graph.plan_name,
                "fused": choice.fused,
                "workspace": choice.graph.workspace_bytes,
            }
        if step.name == "layer3.0.shortcut":
            (out / f"{label}-layer3.0.shortcut.dot").write_text(dot_of(captured))
    say(probe=label, convs_not_one_kernel=alone)
    cupy.cuda.Device().synchronize()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--math", default="tf32")
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    out = Path(os.environ.get("OUT", "/tmp"))

    from speakerd.engine.gpu.engine import GpuEngine
    from speakerd.model.store import default_weights_path
    from speakerd.model.weights import load_model

    engine = GpuEngine(load_model(default_weights_path()), args.math, (args.batch,), graphs=False)
    plan, capture = engine.plans[args.batch], engine.captures[args.batch]
    say(
        probe="choices",
        convs=[[c.name, c.runner, c.choice.workspace_bytes] for c in plan.convs],
    )
    survey(capture, f"{args.math}-b{args.batch}-as-chosen", out)

    for step in plan.convs:  # every fused conv -> bare conv + our epilogue
        if step.fused:
            assert step.choice.graph is not None
            engine.tuner.failed[step.choice.graph.key] = "probe: fusion off"
    plan.rechoose(lambda choice: choice.fused)
    say(probe="bare choices", convs=[[c.name, c.runner, c.choice.workspace_bytes] for c in plan.convs])
    survey(capture, f"{args.math}-b{args.batch}-bare", out)
    engine.close()

    # the engine's own capture path (re-choices, fusion turned off where it replays wrongly)
    engine = GpuEngine(load_model(default_weights_path()), args.math, (args.batch,), graphs=True)
    plan, capture = engine.plans[args.batch], engine.captures[args.batch]
    say(
        probe="engine capture",
        graph=capture.graph is not None,
        check=capture.check,
        build=engine.build_report(),
        fused=[c.name for c in plan.convs if c.fused],
    )
    if capture.graph is not None:
        before = replay_diffs(capture, 10)
        churn()
        say(
            probe="engine capture",
            replay_diffs_before_churn=before,
            replay_diffs_after_churn=replay_diffs(capture, 10),
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
