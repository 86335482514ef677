"""The `pyannote` suite: pyannote.audio's whole pipeline on an hour, alone and with a
speakerd server, from `speakerd.pyannote.bench`'s report.

With `--engine cpu`, the diarization service a CPU-only fleet would run: a CPU server that
segments and embeds (`serve --engine cpu --segmentation-model`), a client holding no weights
(`remote_pipeline`, the bench's `--server-segmentation`), against pyannote alone on the same
CPU, on CPU_AUDIO_S of audio (an hour takes a 2-core machine over an hour alone)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from speakerd.tools.suite.record import anchor, figure
from speakerd.tools.suite.run import Context, shown
from speakerd.tools.suite.steps import HOUR_S, serving_math

#: Where segmentation-3.0's checkpoint is looked for (scripts/pyannote_segmentation.sh and
#: scripts/prepare_pyannote_wheels.sh write these).
SEGMENTATION_PATHS = (
    ".cache/pyannote/segmentation-3.0/pytorch_model.bin",
    ".whl-pyannote/segmentation-3.0/pytorch_model.bin",
)


#: The CPU row's audio: 10 minutes, some 600 windows each way on 2 cores.
CPU_AUDIO_S = 600


def segmentation_path(ctx: Context) -> Path | None:
    given = ctx.options.segmentation
    candidates = [Path(given)] if given else [ctx.repo / path for path in SEGMENTATION_PATHS]
    return next((path for path in candidates if path.is_file()), None)


def pyannote(ctx: Context) -> None:
    if importlib.util.find_spec("pyannote") is None or importlib.util.find_spec("pyannote.audio") is None:
        ctx.skip(
            "pyannote",
            "pyannote.audio is not importable (scripts/device_pyannote.sh installs it on a device)",
        )
        return
    checkpoint = segmentation_path(ctx)
    if checkpoint is None:
        ctx.skip(
            "pyannote", "no segmentation-3.0 checkpoint (scripts/pyannote_segmentation.sh; or --segmentation)"
        )
        return
    math = serving_math(ctx)
    output = ctx.out / "pyannote-bench.json"
    if ctx.options.engine == "cpu":
        serve = ["--engine", "cpu", "--segmentation-model", str(checkpoint)]
        bench = f"--device cpu --audio-seconds {CPU_AUDIO_S} --server-segmentation"
        setup = "CPU client without weights, CPU server segmenting"
    else:
        serve, bench, setup = (
            ["--engine", "gpu", "--math", math],
            f"--device cuda --audio-seconds {HOUR_S}",
            "",
        )
        bench += " --exclude-overlap"
    with ctx.server("pyannote", serve) as server:
        files = ["--segmentation", str(checkpoint), "--output", str(output)]
        argv = ctx.python(
            "-m", "speakerd.pyannote.bench", "--target", server["target"], *bench.split(), *files
        )
        ctx.run("pyannote-bench", argv, ctx.left() - 10, env={"PYANNOTE_METRICS_ENABLED": "false"})
    for kwargs in pyannote_records(json.loads(output.read_text()), shown(argv), setup):
        ctx.record(**kwargs)


def pyannote_records(report: dict[str, Any], command: str, setup: str = "") -> list[dict[str, Any]]:
    """speakerd.pyannote.bench's JSON -> Context.record keyword arguments: the whole
    pipeline and its embedding step (with the server segmenting, the segmentation and
    embedding steps it takes over), each against pyannote alone in the same run; `setup`
    (e.g. the CPU row's) ends each name."""
    ok = report.get("parity", {}).get("der", 0.0) == 0.0
    out = []
    steps = (
        ("model_steps_s", "segmentation and embedding steps")
        if report.get("server_segmentation")
        else ("embeddings_s", "embedding step")
    )
    for key, what in (("total_s", "pipeline"), steps):
        fig = figure(report["speakerd"][key], "s", "lower")
        anchors = []
        if "pyannote" in report:  # absent with --skip-local
            alone = f"pyannote.audio {report.get('pyannote_audio', '')} alone".replace("  ", " ")
            anchors.append(anchor(alone, report["pyannote"][key], "s", "lower", fig, command))
        out.append(
            {
                "name": f"pyannote {what}, {report['audio_seconds']:g} s of audio"
                + (f", {setup}" if setup else ""),
                "command": command,
                "fig": fig,
                "anchors": anchors,
                "detail": report,
                "ok": ok,
                "headline": True,
            }
        )
    return out
