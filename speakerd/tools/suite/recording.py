"""The `recording` suite: an hour of 16 kHz mono and 48 kHz stereo, in process and through a
server, against the PyTorch hour anchors timed in the same run."""

from __future__ import annotations

from typing import Any

from speakerd.tools.suite.record import anchor, figure
from speakerd.tools.suite.run import Context, StepFailed, json_lines, shown
from speakerd.tools.suite.steps import HOUR_S, anchor_script, load, serving_math

#: The two formats the hour is sent in: pyannote's own rate, and a typical recorder's.
RECORDING_FORMATS = ((16_000, 1), (48_000, 2))


def hour_anchors(ctx: Context) -> dict[str, dict[str, Any]]:
    """way -> the PyTorch hour anchor's line (torch_hour_embedding.py), with its command."""
    script = anchor_script(ctx, "torch_hour_embedding.py")
    if script is None:
        return {}
    argv = ctx.python(str(script), str(HOUR_S))
    try:
        done = ctx.run("anchor-hour", argv, 200)
    except StepFailed as error:
        ctx.skip("anchor torch_hour_embedding.py", str(error))
        return {}
    return {
        row["way"]: {**row, "command": shown(argv)}
        for row in json_lines(done.stdout)
        if row.get("kind") == "anchor_hour"
    }


def recording(ctx: Context) -> None:
    math = serving_math(ctx)
    ways = hour_anchors(ctx)
    names = {
        "best": "PyTorch at its best (fbank on the GPU, multi-mask, FP16)",
        "pyannote": "PyTorch the way pyannote 4.0.7 does it",
    }
    for rate, channels in RECORDING_FORMATS:
        flags = f"--math {math} --recording {HOUR_S} --runs 3 --sample-rate {rate} --channels {channels}"
        argv = ctx.python("-m", "speakerd", "bench", *flags.split())
        done = ctx.run(f"bench-recording-{rate}x{channels}", argv, 240)
        line = next(row for row in json_lines(done.stdout) if row.get("kind") == "recording")
        ctx.record(
            f"hour {rate} Hz x{channels} {math} in process",
            shown(argv),
            figure(line["total_s"], "s", "lower"),
            detail=line,
        )
    with ctx.server("recording", ["--engine", "gpu", "--math", math]) as server:
        for rate, channels in RECORDING_FORMATS:
            flags = (
                f"--recording {HOUR_S} --sample-rate {rate} --channels {channels} --streams 1 --seconds 15"
            )
            result = load(ctx, f"load-{rate}x{channels}", server, [*flags.split(), "--timeout", "100"], 150)
            fig = figure(round(result["latency_p50_ms"] / 1e3, 4), "s", "lower")
            anchors = [
                anchor(names[way], ways[way]["wall_s"], "s", "lower", fig, ways[way]["command"])
                for way in ("best", "pyannote")
                if way in ways
            ]
            ctx.record(
                f"hour {rate} Hz x{channels} {math} through the server, p50",
                result.pop("_command"),
                fig,
                anchors,
                detail={**result, "anchors": ways, "server": server["command"]},
                ok=bool(result.get("ok")),
                headline=True,
            )
