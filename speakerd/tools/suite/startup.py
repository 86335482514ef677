"""The `startup` suite: a server's start-up with an empty cache, then again from what it kept.

Two `serve` processes one after the other, with the flags the diarize suite serves with
(FP16 on a GPU, segmentation-3.0 where it is found, else the default segmentation model),
both with $SPEAKERD_CACHE a folder of this run that is empty before the first, and every
start-up cache inside it (CuPy's kernels, numba's loops, the GPU engine's build cache: their
variables unset, so serve points them there: serving/server/caches.py). The records:

- seconds from the first server's process start to health SERVING (what a pod's startup
  probe waits for), with nothing cached: the models made or converted, every cuDNN plan
  timed, our kernels and the clustering's loops compiled;
- the same for the second server, on the first one's cache, against the first;

each with the server's own SERVING line (its start-up seconds and each phase's), its
engine's lines (what was timed, in how many worker processes, what came from the cache) and
the files each cache folder holds.

Budget: a fresh H100 took 139-185 s to SERVING with nothing cached and 41 s on a restart;
two starts and two drains fit in 420 s.
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

from speakerd.serving.server.caches import START_CACHES
from speakerd.serving.server.phases import serving_seconds
from speakerd.tools.suite.pyannote import segmentation_path
from speakerd.tools.suite.record import anchor, figure
from speakerd.tools.suite.run import Context
from speakerd.tools.suite.steps import serving_math

#: The server's lines about its engine's build, kept in a record's detail.
ENGINE_LINES = re.compile(r"^.*(gpu engine |worker processes|build cache: |\bengine \S+ \S+ plans ).*$", re.M)
#: The most of those lines a record keeps.
LINES_KEPT = 8


def _files(folder: Path) -> dict[str, int]:
    """Files under each folder of `folder` (what a start left in the cache)."""
    folders = sorted(sub for sub in folder.iterdir() if sub.is_dir())
    return {sub.name: sum(1 for path in sub.rglob("*") if path.is_file()) for sub in folders}


def startup(ctx: Context) -> None:
    math = serving_math(ctx)
    kind = "cpu" if ctx.options.engine == "cpu" else "gpu"
    checkpoint = segmentation_path(ctx)
    flags = ["--engine", kind, "--math", math]
    if checkpoint is not None:
        flags += ["--segmentation-model", str(checkpoint)]
    cache = ctx.out / "startup-cache"
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir(parents=True)
    env: dict[str, str | None] = {"SPEAKERD_CACHE": str(cache), **dict.fromkeys(START_CACHES)}
    segmentation = "segmentation-3.0" if checkpoint is not None else "the default segmentation model"
    first: tuple[float, str] | None = None  # the empty-cache start's seconds and command
    for run, what in (("empty", "with an empty cache"), ("cached", "from the first start's cache")):
        started = time.monotonic()
        with ctx.server(f"startup-{run}", flags, env=env) as server:
            seconds = round(time.monotonic() - started, 1)
        log = Path(server["log"]).read_text()
        logged = serving_seconds(log)
        detail = {
            "serving_line_s": logged[0] if logged else None,
            "phases_s": logged[1] if logged else None,
            "engine_lines": [m.group(0).strip()[:400] for m in ENGINE_LINES.finditer(log)][:LINES_KEPT],
            "cache_files": _files(cache),
            "segmentation": segmentation,
            "server": server["command"],
        }  # fmt: skip
        fig = figure(seconds, "s", "lower")
        anchors = []
        if first is not None:
            anchors.append(anchor("the same server's start with an empty cache", first[0], "s", "lower", fig,
                                  first[1]))  # fmt: skip
        name = f"start-up to SERVING {what}, {math} {kind} server"
        ctx.record(name, server["command"], fig, anchors, detail, ok=logged is not None, headline=True)
        first = first or (seconds, server["command"])
