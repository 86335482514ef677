"""`speakerd fetch-model --model NAME_OR_PATH`: fill the caches `serve --model` reads, then exit.

Downloads pyannote's checkpoint into the Hugging Face cache (or reads a local one) and
writes its converted safetensors next to it, exactly as `serve --model` would at start-up.
Run it where the hub is reachable (a Kubernetes init container, a build step, a laptop),
and servers started later with `HF_HUB_OFFLINE=1` and the same cache convert and download
nothing. `--segmentation-model NAME_OR_PATH` does the same for the segmentation model
(pyannote/segmentation-3.0), and `--plda NAME_OR_PATH` for VBx's PLDA (the `plda/` folder of
pyannote/speaker-diarization-community-1, loaded once to check it as `serve --plda` does),
each alone or beside the others. Prints the path, the id and the source of each; a failure
is one line and exit code 2.
"""

from __future__ import annotations

import argparse
import sys

from speakerd.model.source import (
    EMBEDDING,
    MODEL_ENV,
    PLDA_ENV,
    SEGMENTATION,
    SEGMENTATION_MODEL_ENV,
    ModelError,
    ModelKind,
    ModelSource,
    add_model_flag,
    add_plda_flag,
    add_segmentation_model_flag,
    resolve_model,
    resolve_plda,
)
from speakerd.model.weights import file_sha256

USAGE_EXIT = 2


def configure(parser: argparse.ArgumentParser) -> None:
    add_model_flag(parser)
    add_segmentation_model_flag(parser)
    add_plda_flag(parser)


def _where(source: ModelSource) -> str:
    """`org/name@commit ` for a repo's file, nothing for a local one."""
    return f"{source.repo_id}@{source.revision} " if source.repo_id else ""


def _fetch(spec: str, flag: str, kind: ModelKind, label: str) -> None:
    """Resolve one model and print its lines, each starting with `label`."""
    resolved = resolve_model(spec, flag, kind, fetching=True)
    source = resolved.source
    print(f"{label}weights {resolved.path}")
    print(f"{label}model id {file_sha256(resolved.path)}")
    print(f"{label}source {_where(source)}{source.filename} sha256 {source.sha256}")


def _fetch_plda(spec: str) -> None:
    """Resolve the PLDA, load it as the server would, and print its lines (`plda ...`)."""
    from speakerd.model.diarization.plda import PldaError, load_plda

    resolved = resolve_plda(spec, "--plda", fetching=True)
    try:
        load_plda(resolved.directory)
    except PldaError as error:
        raise ModelError(f"--plda {spec}: {error}") from error
    print(f"plda directory {resolved.directory}")
    print(f"plda id {resolved.plda_id}")
    print(f"plda source {_where(resolved.source)}{resolved.source.filename}")


def run(args: argparse.Namespace) -> int:
    if not args.model and not args.segmentation_model and not args.plda:
        print(
            f"fetch-model: error: give --model (or {MODEL_ENV}), --segmentation-model (or "
            f"{SEGMENTATION_MODEL_ENV}) or --plda (or {PLDA_ENV}): a repo id or a path",
            file=sys.stderr,
        )
        return USAGE_EXIT
    try:
        if args.model:
            _fetch(args.model, "--model", EMBEDDING, "")
        if args.segmentation_model:
            _fetch(args.segmentation_model, "--segmentation-model", SEGMENTATION, "segmentation ")
        if args.plda:
            _fetch_plda(args.plda)
    except ModelError as error:
        print(f"fetch-model: {error}", file=sys.stderr)
        return USAGE_EXIT
    return 0
