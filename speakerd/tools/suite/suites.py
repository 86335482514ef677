"""The suites: what each one runs, what it needs, its time budget, and its records.

Budgets are what one suite may take of a device call's ten minutes, measured from the
longest step seen (a fresh machine builds an FP16 engine's cuDNN graphs in up to ~120 s);
a run of several suites takes each whose budget still fits and skips the rest, saying so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from speakerd.tools.suite.devices import devices
from speakerd.tools.suite.diarize import diarize
from speakerd.tools.suite.engine import engine
from speakerd.tools.suite.pyannote import pyannote
from speakerd.tools.suite.recording import recording
from speakerd.tools.suite.run import Context
from speakerd.tools.suite.service import service
from speakerd.tools.suite.startup import startup
from speakerd.tools.suite.tests_gpu import tests_gpu


@dataclass(frozen=True)
class Suite:
    name: str
    purpose: str
    budget_s: int
    run: Callable[[Context], None]
    #: True: `--engine cpu` runs it on the CPU engine, without a GPU
    cpu_engine: bool = False
    #: its budget with `--engine cpu` when not `budget_s` (2 cores are slower than a GPU)
    cpu_budget_s: int = 0

    def budget(self, engine: str) -> int:
        return self.cpu_budget_s if engine == "cpu" and self.cpu_budget_s else self.budget_s


SUITES: dict[str, Suite] = {
    suite.name: suite
    for suite in (
        Suite("tests-gpu", "every GPU test file with REQUIRE_GPU=1 (a skip is a failure)", 560, tests_gpu),
        Suite(
            "engine",
            "bench of every math, b1 and b32, per-layer times; PyTorch eager and torch.compile "
            "max-autotune anchors in the same call",
            560,
            engine,
        ),
        Suite(
            "service",
            "a server checked by `client verify`, then 32-chunk and hour-recording loads against "
            "the engine's own bench in the same call (--engine cpu: briefly, on the CPU engine)",
            420,
            service,
            cpu_engine=True,
        ),
        Suite(
            "recording",
            "an hour of 16 kHz mono and 48 kHz stereo, in process and through a server, against "
            "the PyTorch hour anchors",
            420,
            recording,
        ),
        Suite(
            "pyannote",
            "pyannote.audio's whole pipeline on an hour, alone and with a speakerd server "
            "(--engine cpu: 10 minutes, a weightless client and a CPU server that segments)",
            420,
            pyannote,
            cpu_engine=True,
            cpu_budget_s=2400,
        ),
        Suite(
            "diarize",
            "an hour of speech through a server that segments: segmentation and embeddings, and "
            "Diarize (and with --plda VBx's), against the same hour under the client's masks; 8 hours "
            "at once; the clustering's steps; the linkage alone at the hour's rows and at 3 h's",
            480,
            diarize,
        ),
        Suite(
            "startup",
            "a server's start-up to SERVING with an empty cache, then a second server on the cache "
            "the first kept, each with its phases (--engine cpu: the CPU engine's)",
            420,
            startup,
            cpu_engine=True,
        ),
        Suite(
            "devices",
            "`serve --devices 0` against plain `serve` on one GPU: verify, 32-chunk load, an hour's "
            "recording, its segmentation and Diarize, the worker killed under load; with 2 GPUs or "
            "more `--devices all` against `--devices 0` (--engine cpu: CPU workers, no hour)",
            480,
            devices,
            cpu_engine=True,
        ),
    )
}
