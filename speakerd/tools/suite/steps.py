"""Steps several suites share: finding the GPU, the anchor scripts and the reference cases,
the engine's own b32 speed, and one `client load` turned into a record."""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Any

from speakerd.tools.suite.record import anchor, figure
from speakerd.tools.suite.run import Context, StepFailed, json_lines, shown

#: Where the PyTorch anchor scripts are when neither --anchors nor $SPEAKERD_ANCHORS names
#: another folder (relative to the repository root; scripts/anchors/README.md).
ANCHOR_DIRS = ("scripts/anchors",)
ANCHORS_ENV = "SPEAKERD_ANCHORS"
#: The hour of audio the recording, service and pyannote suites send.
HOUR_S = 3600


@functools.cache
def gpu_problem() -> str | None:
    """None when the GPU engine can run here, else why not (one phrase)."""
    from speakerd.engine.gpu import gpu_available

    usable, detail = gpu_available()
    return None if usable else detail


def anchors_dir(ctx: Context) -> Path | None:
    """The folder of the PyTorch anchor scripts: --anchors, $SPEAKERD_ANCHORS, ANCHOR_DIRS."""
    given = ctx.options.anchors or os.environ.get(ANCHORS_ENV)
    candidates = [Path(given)] if given else [ctx.repo / name for name in ANCHOR_DIRS]
    return next((path.resolve() for path in candidates if path.is_dir()), None)


def anchor_script(ctx: Context, name: str) -> Path | None:
    """An anchor script, or None after one skip line saying where it was looked for."""
    folder = anchors_dir(ctx)
    if folder is None or not (folder / name).is_file():
        where = ctx.options.anchors or os.environ.get(ANCHORS_ENV) or " or ".join(ANCHOR_DIRS)
        ctx.skip(f"anchor {name}", f"not found in {where} (pass --anchors DIR)")
        return None
    return folder / name


def references(ctx: Context) -> Path:
    """--references, else `make-references` output for the default model, made once per
    output folder (the engine and service benches read mixed_b32 and first_b1 from it)."""
    if ctx.options.references:
        return Path(ctx.options.references).resolve()
    folder = ctx.out / "refs"
    if not (folder / "mixed_b32.safetensors").exists():
        ctx.run("make-references", ctx.python("-m", "speakerd", "make-references", "--out", str(folder)), 300)
    return folder


def serving_math(ctx: Context) -> str:
    return ctx.options.math or ("fp32" if ctx.options.engine == "cpu" else "fp16")


def engine_speed(ctx: Context, math: str, refs: Path) -> dict[str, Any] | None:
    """The engine alone on b32 (bench, no PyTorch): the ceiling a server's load is a share
    of, as an anchor dict's inputs; None on the CPU engine."""
    if ctx.options.engine == "cpu":
        return None
    flags = f"--math {math} --batches 32 --no-torch --no-profile".split()
    argv = ctx.python("-m", "speakerd", "bench", *flags, "--references", str(refs))
    done = ctx.run("bench-b32", argv, 300)
    line = next(
        row for row in json_lines(done.stdout) if row.get("kind") == "ours" and row["mode"] == "graph"
    )
    return {"value": line["chunks_per_s"], "command": shown(argv), "line": line}


def load(ctx: Context, name: str, server: dict[str, str], flags: list[str], limit_s: float) -> dict[str, Any]:
    where = ["--target", server["target"], "--metrics-url", server["metrics_url"]]
    argv = ctx.python("-m", "speakerd.client", "load", *where, *flags)
    done = ctx.run(name, argv, limit_s, check=False)  # a failed load still reports what it saw
    results = json_lines(done.stdout)
    if not results:
        raise StepFailed(f"{name}: exit {done.returncode}, no JSON ({shown(argv)}); log {ctx.log_path(name)}")
    return {**results[-1], "_command": shown(argv)}


def verify_record(ctx: Context, server: dict[str, str], refs: Path, math: str) -> None:
    argv = ctx.python(
        "-m", "speakerd.client", "verify", "--references", str(refs), "--target", server["target"]
    )
    done = ctx.run("verify", argv, 180, check=False)
    found = re.search(r"(\d+)/(\d+) cases", done.stdout)
    passed, total = (int(found.group(1)), int(found.group(2))) if found else (0, 0)
    ctx.record(
        f"verify {math}",
        shown(argv),
        figure(passed, "cases within parity bounds", "higher"),
        detail={"cases": total, "exit": done.returncode, "server": server["command"]},
        ok=done.returncode == 0 and total > 0,
        headline=True,
    )


def against_engine(ceiling: dict[str, Any] | None, fig: dict[str, Any]) -> list[dict[str, Any]]:
    """The engine's own b32 speed as the anchor of a load's figure (none on the CPU engine)."""
    if ceiling is None:
        return []
    name = "the engine alone, bench b32 graph"
    return [anchor(name, ceiling["value"], fig["unit"], "higher", fig, ceiling["command"])]


def load_record(
    ctx: Context,
    step: str,
    server: dict[str, str],
    flags: str,
    limit_s: float,
    name: str,
    unit: str,
    ceiling: dict[str, Any] | None,
    headline: bool = False,
) -> None:
    """One `client load` (FLAGS) against `server`, recorded as `name` in `unit` per second."""
    result = load(ctx, step, server, flags.split(), limit_s)
    fig = figure(result[unit.replace("/s", "_per_s")], unit, "higher")
    command = result.pop("_command")
    detail = {**result, "server": server["command"]}
    ctx.record(name, command, fig, against_engine(ceiling, fig), detail, bool(result.get("ok")), headline)
