"""The `engine` suite: `speakerd bench` of every math with PyTorch eager in the same process,
then the torch.compile anchor; one record per graph plan and per layer group."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any

from speakerd.tools.suite.record import anchor, figure
from speakerd.tools.suite.run import Context, json_lines, shown
from speakerd.tools.suite.steps import anchor_script, references

#: Seconds the torch.compile anchor needs at least (its max-autotune compile takes minutes);
#: the engine suite's bench leaves it this much of the budget.
COMPILE_RESERVE_S = 240
ALL_MATHS = "fp32,tf32,fp16"


def layer_group(conv: str) -> str:
    """stem, layer1 .. layer4: the per-layer table's rows."""
    return conv.split(".")[0]


def engine_records(
    lines: Iterable[dict[str, Any]],
    command: str,
    compile_lines: Iterable[dict[str, Any]] = (),
    compile_command: str = "",
) -> list[dict[str, Any]]:
    """`speakerd bench` JSON lines (and the torch.compile anchor's) -> keyword arguments of
    Context.record: one record per (math, batch) graph plan with its same-run anchors, and
    one per (math, batch, layer group) from the per-convolution table."""
    lines = list(lines)
    ours = {(row["math"], row["batch"], row["mode"]): row for row in lines if row.get("kind") == "ours"}
    torch = {
        (row["math"], row["batch"]): row for row in lines if row.get("kind") == "torch" and "ms_median" in row
    }
    built = {row["math"]: row.get("build_s") for row in lines if row.get("kind") == "engine"}
    compiled = {
        row["batch"]: row
        for row in compile_lines
        if row.get("anchor") == "torch.compile" and "ms_median" in row
    }
    out: list[dict[str, Any]] = []
    for (math, batch, mode), row in sorted(ours.items()):
        if mode != "graph":
            continue
        fig = figure(row["compute_ms_median"], "ms", "lower")
        anchors = []
        if (math, batch) in torch:
            theirs = torch[(math, batch)]
            anchors.append(
                anchor(
                    f"PyTorch {theirs.get('torch', '')} eager, CUDA graph".replace("  ", " "),
                    theirs["ms_median"],
                    "ms",
                    "lower",
                    fig,
                    command,
                )
            )
        if math == "fp16" and batch in compiled:
            anchors.append(
                anchor(
                    f"torch.compile {compiled[batch].get('mode', 'max-autotune')}",
                    compiled[batch]["ms_median"],
                    "ms",
                    "lower",
                    fig,
                    compile_command,
                )
            )
        eager = ours.get((math, batch, "eager"))
        detail = {
            "ours": row,
            "torch": torch.get((math, batch)),
            "torch_compile": compiled.get(batch) if math == "fp16" else None,
            "eager_ms": eager["compute_ms_median"] if eager else None,
            "build_s": built.get(math),
        }
        out.append(
            {
                "name": f"b{batch} {math} graph",
                "command": command,
                "fig": fig,
                "anchors": anchors,
                "detail": detail,
                "headline": True,
            }
        )
    groups: dict[tuple[str, int, str], list[dict[str, Any]]] = defaultdict(list)
    for row in lines:
        if row.get("kind") == "conv":
            groups[(row["math"], row["batch"], layer_group(row["conv"]))].append(row)
    for (math, batch, group), rows in sorted(groups.items()):
        total = round(sum(row["ms"] for row in rows), 4)
        runners = Counter(row["runs"].split(" ")[0] for row in rows if row["ms"] > 0)
        detail = {
            "convs": len(rows),
            "runs": dict(runners),
            "rows": [
                {"conv": row["conv"], "ms": row["ms"], "runs": row["runs"], "tflops": row.get("tflops")}
                for row in rows
            ],
        }
        out.append(
            {
                "name": f"b{batch} {math} {group}",
                "command": command,
                "fig": figure(total, "ms", "lower"),
                "anchors": [],
                "detail": detail,
                "headline": False,
            }
        )
    return out


def engine(ctx: Context) -> None:
    refs = references(ctx)
    maths = ctx.options.math or ALL_MATHS
    compile_script = anchor_script(ctx, "torch_compile_resnet34.py")
    reserve = COMPILE_RESERVE_S if compile_script else 0
    flags = f"--math {maths} --batches 1,32 --convs --no-profile".split()
    argv = ctx.python("-m", "speakerd", "bench", *flags, "--references", str(refs))
    bench = ctx.run("bench", argv, ctx.left() - reserve)
    compile_lines: list[dict[str, Any]] = []
    compile_command = ""
    if compile_script is not None and "fp16" in maths:
        compile_argv = ctx.python(str(compile_script), "max-autotune")
        compile_command = shown(compile_argv)
        done = ctx.run("torch-compile", compile_argv, ctx.left(), check=False, keep_partial=True)
        compile_lines = json_lines(done.stdout)
        if not any("ms_median" in row and row.get("anchor") == "torch.compile" for row in compile_lines):
            errors = [row["error"] for row in compile_lines if "error" in row]
            ctx.skip("anchor torch.compile", errors[0] if errors else "no timing within the budget")
    for kwargs in engine_records(json_lines(bench.stdout), shown(argv), compile_lines, compile_command):
        ctx.record(**kwargs)
