"""`speakerd fetch-model --model NAME_OR_PATH`: fill the caches `serve --model` reads, then exit.

Downloads pyannote's checkpoint into the Hugging Face cache (or reads a local one) and
writes its converted safetensors next to it, exactly as `serve --model` would at start-up.
Run it where the hub is reachable (a Kubernetes init container, a build step, a laptop),
and servers started later with `HF_HUB_OFFLINE=1` and the same cache convert and download
nothing. Prints the safetensors path, the model id and the source; a failure is one line
and exit code 2.
"""

from __future__ import annotations

import argparse
import sys

from speakerd.model.source import MODEL_ENV, ModelError, add_model_flag, resolve_model
from speakerd.model.weights import file_sha256

USAGE_EXIT = 2


def configure(parser: argparse.ArgumentParser) -> None:
    add_model_flag(parser)


def run(args: argparse.Namespace) -> int:
    if not args.model:
        print(f"fetch-model: error: give --model (or {MODEL_ENV}): a repo id or a path", file=sys.stderr)
        return USAGE_EXIT
    try:
        resolved = resolve_model(args.model, fetching=True)
    except ModelError as error:
        print(f"fetch-model: {error}", file=sys.stderr)
        return USAGE_EXIT
    source = resolved.source
    print(f"weights {resolved.path}")
    print(f"model id {file_sha256(resolved.path)}")
    where = f"{source.repo_id}@{source.revision} " if source.repo_id else ""
    print(f"source {where}{source.filename} sha256 {source.sha256}")
    return 0
