"""The `diarize` suite: an hour of speech through a server that segments, from audio in to
turns out, beside the same hour with the client's masks and the clustering's own time.

The server serves segmentation-3.0 (`--segmentation`, as the pyannote suite finds it) beside
the embedding model; the hour is a speech clip (`--speech`: pyannote's sample.wav, 30 s of
two speakers) tiled as speakerd/pyannote/bench.py tiles it, so segmentation finds speakers
and the clustering has an hour of clean embeddings to link. The records:

- the hour's segmentation and embeddings through the server (EmbedRecording with
  `segment`), p50, against the same server embedding the hour under masks the client sends
  (`client load --recording`, the service suite's recording step): what segmenting costs;
- with `--speakrs DIR`, speakrs 0.7.0 CUDA and CUDAFast diarizing the same hour on the same
  GPU (suite/speakrs.py), before the server starts;
- the hour diarized (Diarize: the same, then clustering, reconstruction and turns), p50,
  against the segmentation and embeddings alone (what the clustering and the rest add) and
  speakrs' two modes,
  with the server's own split of its calls (`server_split_s`: the medians of the steps its
  log line gives at the end of each call);
  with `--plda DIR` (a PLDA directory) the server gets it and VBx's hour is timed too;
- 8 hour-long Diarize calls at once: hours diarized per second, and the server's cores;
- the clustering of that hour on this machine's CPU, step by step (bench_diarize's
  `clustering` line: how many pairs are linked, and what each step takes);
- the centroid linkage alone (bench_clustering): the hour's own clean rows, and 15,000
  synthetic rows (3 h of a meeting), wholly on the GPU, with the GPU's distances and the
  host's merges, and on the host, each checked equal to SciPy's linkage where SciPy ran
  (the hour) or to each other (3 h).

Budget: a fresh H100's server start took 36 s (nothing cached: cuDNN's plans timed in worker
processes, docs/deployment.md), the steps after it about 100 s, speakrs' two modes before it
about 25 s.
"""

from __future__ import annotations

import importlib.util
import re
import statistics
from pathlib import Path

from speakerd.tools.suite.pyannote import segmentation_path
from speakerd.tools.suite.record import anchor, figure
from speakerd.tools.suite.run import Context, json_lines, shown
from speakerd.tools.suite.service import RECORDING_LOAD
from speakerd.tools.suite.speakrs import speakrs_anchors, speakrs_hours
from speakerd.tools.suite.steps import HOUR_S, load, serving_math

#: Hour-long Diarize calls sent at once for the throughput record.
CONCURRENT_HOURS = 8
#: Clean rows of a 3 h meeting (bench_clustering's synthetic rows).
THREE_HOURS_ROWS = 15000

#: The server's line at the end of each Diarize (serving/diarization/service.py): where the
#: call's time went on the server, step by step.
CALL_LINE = re.compile(
    r"Diarize \S*: (?P<windows>\d+) windows, (?P<pairs>\d+) clean pairs, (?P<method>\w+), .* in "
    r"(?P<total>[\d.]+) s: audio to embeddings (?P<embeddings>[\d.]+) s, waiting for clustering room "
    r"(?P<waiting>[\d.]+) s, clustering (?P<clustering>[\d.]+) s \(linkage (?P<linkage>[\d.]+) s; speaker "
    r"count (?P<count>[\d.]+) s beside it\), reconstruction (?P<reconstruction>[\d.]+) s, reply "
    r"(?P<reply>[\d.]+) s"
)
#: The steps of CALL_LINE, in the order they run (the linkage is part of the clustering).
CALL_STEPS = ("embeddings", "waiting", "clustering", "linkage", "count", "reconstruction", "reply", "total")


def server_split(log: str, windows: int, method: str, calls: int) -> dict[str, float] | None:
    """The median seconds of each step of the first `calls` Diarize calls of `windows` windows
    clustered by `method` in a server's log (the timed runs come before the concurrent ones);
    None when it has fewer."""
    found = [m for m in CALL_LINE.finditer(log) if int(m["windows"]) == windows and m["method"] == method]
    if len(found) < calls:
        return None
    return {step: round(statistics.median(float(m[step]) for m in found[:calls]), 4) for step in CALL_STEPS}


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
    # speakrs first, the GPU its own: the server below holds its plans until the end
    speakrs = speakrs_hours(ctx, speech, HOUR_S)
    saved = ctx.out / "diarize-hour.npz"
    serve = ["--engine", "gpu", "--math", math, "--segmentation-model", str(checkpoint)]
    plda = ctx.options.plda
    if plda:
        serve += ["--plda", str(plda)]
    with ctx.server("diarize", serve) as server:
        masked = load(ctx, "load-recording", server, RECORDING_LOAD.split(), 80)
        flags = (
            f"--target {server['target']} --audio {speech} --seconds {HOUR_S} --runs 3 --save {saved} "
            f"--concurrent {CONCURRENT_HOURS} --metrics {server['metrics_url']}" + (" --vbx" if plda else "")
        )
        argv = ctx.python("-m", "speakerd.tools.bench_diarize", *flags.split())
        done = ctx.run("bench-diarize", argv, 180)
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
    log = Path(server["log"]).read_text()
    windows, runs = lines["diarize"]["windows"], lines["diarize"]["runs"]
    turns = figure(lines["diarize"]["p50_s"], "s", "lower")
    name = "the same server's segmentation and embeddings of the hour, p50 (all Diarize adds is after it)"
    split = server_split(log, windows, "agglomerative", runs)
    anchors = [anchor(name, segment["value"], "s", "lower", turns, command), *speakrs_anchors(speakrs, turns)]
    ctx.record(f"hour diarization {math} through the server, p50", command, turns, anchors,
               detail={**lines["diarize"], "server_split_s": split, "server": server["command"]},
               headline=True)  # fmt: skip
    if "diarize-vbx" in lines:
        vbx = figure(lines["diarize-vbx"]["p50_s"], "s", "lower")
        split = server_split(log, windows, "vbx", runs)
        detail = {**lines["diarize-vbx"], "server_split_s": split, "server": server["command"]}
        ctx.record(f"hour diarization {math} through the server, clustering.method vbx, p50", command,
                   vbx, detail=detail)  # fmt: skip
    at_once = lines["diarize-concurrent"]
    throughput = figure(at_once["hours_per_s"], "hours/s", "higher")
    ctx.record(f"{CONCURRENT_HOURS} hour-long Diarize calls at once, hours diarized per second", command,
               throughput, detail=at_once, headline=True)  # fmt: skip
    steps = lines["clustering"]
    ctx.record("hour clustering on the CPU", command, figure(steps["diarize_s"], "s", "lower"), detail=steps)
    linkage_alone(ctx, saved)


def linkage_alone(ctx: Context, saved: Path, three_hours_rows: int = THREE_HOURS_ROWS) -> None:
    """bench_clustering on the hour's own clean rows (SciPy too) and on 3 h's worth."""
    for rows, flags in (("hour", f"--rows-file {saved}"), ("3 h", f"--rows {three_hours_rows} --repeat 2")):
        argv = ctx.python("-m", "speakerd.tools.bench_clustering", *flags.split())
        done = ctx.run(f"bench-clustering-{rows.replace(' ', '')}", argv, 90)
        line = json_lines(done.stdout)[-1]
        seconds = line["seconds"]
        fastest = next(name for name in ("device", "gpu", "host") if name in seconds)
        anchors = []
        if "scipy" in seconds:
            anchors.append(anchor("SciPy's linkage (pdist and fast_linkage, one core), the reference",
                                  seconds["scipy"], "s", "lower", figure(seconds[fastest], "s", "lower"),
                                  shown(argv)))  # fmt: skip
        equal = all(value is True or value == "reference" for value in line["equal"].values())
        where = "on the device" if fastest == "device" else f"{fastest} distances"
        ctx.record(f"centroid linkage of the {rows}'s {line['rows']} clean rows, {where}",
                   shown(argv), figure(seconds[fastest], "s", "lower"), anchors, line, equal,
                   headline=True)  # fmt: skip
