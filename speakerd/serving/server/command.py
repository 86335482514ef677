"""`python -m speakerd serve`'s entry: the flags parsed and checked before the server loads.

A mistyped flag or variable is one line and exit code 2 at once: this module imports only
the flags' definitions (config.py), and the server's modules (gRPC, ONNX, SciPy: 1.5 s of
imports on 2 cores, longer than the check itself) load once the flags are good.
"""

from __future__ import annotations

import argparse
import sys

from speakerd.serving.server import config


def configure(parser: argparse.ArgumentParser) -> None:
    config.configure(parser)


def run(args: argparse.Namespace) -> int:
    try:
        settings = config.from_args(args)
    except config.UsageError as error:
        print(f"speakerd serve: error: {error}", file=sys.stderr)
        return config.USAGE_EXIT
    from speakerd.serving.server import serve
    from speakerd.serving.server.caches import point_start_caches

    point_start_caches()
    return serve.run(settings)
