"""The `diarize` suite: an hour of speech through a server that segments, from audio in to
turns out, beside the same hour with the client's masks and the clustering's own time.

The server serves segmentation-3.0 (`--segmentation`, as the pyannote suite finds it) beside
the embedding model; the hour is a speech clip (`--speech`: pyannote's sample.wav, 30 s of
two speakers) tiled as speakerd/pyannote/bench.py tiles it, so segmentation finds speakers
and the clustering has an hour of clean embeddings to link. Three records:

- the hour's segmentation and embeddings through the server (EmbedRecording with
  `segment`), p50, against the same server embedding the hour under masks the client sends
  (`client load --recording`, the service suite's recording step): what segmenting costs;
- the hour diarized (Diarize: the same, then clustering, reconstruction and turns), p50;
- the clustering of that hour on this machine's CPU, step by step (bench_diarize's
  `clustering` line: how many pairs are linked, and what each step takes).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from speakerd.tools.suite.pyannote import segmentation_path
from speakerd.tools.suite.record import anchor, figure
from speakerd.tools.suite.run import Context, json_lines, shown
from speakerd.tools.suite.service import RECORDING_LOAD
from speakerd.tools.suite.steps import HOUR_S, load, serving_math

#: Where the speech clip is looked for when --speech is not given: a copy of pyannote.audio's
#: sample/sample.wav beside the checkpoint (a device machine has no pyannote.audio), then
#: pyannote.audio's own where it is installed.
SPEECH_PATHS = (".cache/pyannote/sample.wav",)


def speech_path(ctx: Context) -> Path | None:
    given = ctx.options.speech
    candidates = [Path(given)] if given else [ctx.repo / path for path in SPEECH_PATHS]
    spec = None if given else importlib.util.find_spec("pyannote")
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) / "audio" / "sample" / "sample.wav" for p in spec.submodule_search_locations]
    return next((path for path in candidates if path.is_file()), None)


def diarize(ctx: Context) -> None:
    checkpoint, speech = segmentation_path(ctx), speech_path(ctx)
    if checkpoint is None or speech is None:
        missing = (
            "segmentation-3.0 checkpoint (scripts/pyannote_segmentation.sh; or --segmentation)"
            if checkpoint is None
            else f"speech clip (--speech FILE, or pyannote.audio's sample.wav in {SPEECH_PATHS[0]})"
        )
        ctx.skip("diarize", f"no {missing}")
        return
    math = serving_math(ctx)
    saved = ctx.out / "diarize-hour.npz"
    serve = ["--engine", "gpu", "--math", math, "--segmentation-model", str(checkpoint)]
    with ctx.server("diarize", serve) as server:
        masked = load(ctx, "load-recording", server, RECORDING_LOAD.split(), 80)
        flags = f"--target {server['target']} --audio {speech} --seconds {HOUR_S} --runs 3 --save {saved}"
        argv = ctx.python("-m", "speakerd.tools.bench_diarize", *flags.split())
        done = ctx.run("bench-diarize", argv, 120)
    lines = {row["kind"]: row for row in json_lines(done.stdout)}
    command = shown(argv)
    segment = figure(lines["segment"]["p50_s"], "s", "lower")
    baseline = round(masked["latency_p50_ms"] / 1e3, 4) if masked.get("latency_p50_ms") else None
    anchors = []
    if baseline is not None:
        name = "the same server embedding the hour under the client's masks (no segmentation), p50"
        anchors.append(anchor(name, baseline, "s", "lower", segment, masked["_command"]))
    detail = {**lines["segment"], "masked": masked, "server": server["command"]}
    ctx.record(f"hour segmentation and embeddings {math} through the server, p50", command, segment,
               anchors, detail, bool(masked.get("ok")), headline=True)  # fmt: skip
    turns = figure(lines["diarize"]["p50_s"], "s", "lower")
    ctx.record(f"hour diarization {math} through the server, p50", command, turns,
               detail={**lines["diarize"], "server": server["command"]}, headline=True)  # fmt: skip
    steps = lines["clustering"]
    ctx.record("hour clustering on the CPU", command, figure(steps["diarize_s"], "s", "lower"), detail=steps)
