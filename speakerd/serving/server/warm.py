"""`python -m speakerd warm`: build what `serve` builds with the same flags, then exit.

For an image build step on a GPU node, an init container, or a node that is about to take
traffic: the models are fetched and converted (or the synthetic defaults made), the
segmenter and the engine are built and pass their self-check, Diarize's linkage is compiled
and checked, and everything that start-up keeps on disk stays there for the next `serve`:
converted checkpoints and the default models in $SPEAKERD_CACHE, the compiled CUDA kernels
in CuPy's kernel cache and the clustering's compiled loops in numba's, both in
$SPEAKERD_CACHE too unless $CUPY_CACHE_DIR or $NUMBA_CACHE_DIR say otherwise (caches.py).
Nothing listens and no voiceprint store is opened; one line at the end says where the
seconds went, as the SERVING line of `serve` does. Exit 0 when all of it passed, 1 when the
start-up failed (a self-check that did not pass), 2 for flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time

from speakerd.serving.server import config

log = logging.getLogger("speakerd.warm")


def configure(parser: argparse.ArgumentParser) -> None:
    config.configure(parser)


def run(args: argparse.Namespace) -> int:
    try:
        # no voiceprint store: nothing to open, and no --data-dir lock to hold beside a server
        settings = dataclasses.replace(config.from_args(args), voiceprints="off")
        if settings.devices is not None:
            raise config.UsageError(
                "--devices: warm builds one engine in this process; drop --devices (each device's "
                "worker builds what this builds, from the same caches)"
            )
    except config.UsageError as error:
        print(f"speakerd warm: error: {error}", file=sys.stderr)
        return config.USAGE_EXIT
    from speakerd.serving.observability.metrics import Metrics
    from speakerd.serving.server import serve
    from speakerd.serving.server.caches import point_start_caches
    from speakerd.serving.server.phases import Phases

    point_start_caches()
    logging.basicConfig(level=settings.log_level, format=serve.LOG_FORMAT)
    started = time.monotonic()
    try:
        prepared = serve.preflight(settings)
    except config.UsageError as error:
        log.error("%s", error)
        return config.USAGE_EXIT
    phases = Phases()
    try:
        built = serve.build_all(settings, prepared, phases, Metrics(), lambda device, left: None)
    except serve.SelfCheckFailed as error:
        log.error("self-check failed: %s", error)
        return serve.START_FAILED_EXIT
    except Exception:
        log.exception("start-up failed")
        return serve.START_FAILED_EXIT
    built.engine.close()
    built.segmenter.close()
    log.info("warm: what serve builds with these flags is built and checked, in %.1f s (%s)",
             time.monotonic() - started, phases.text())  # fmt: skip
    return 0
