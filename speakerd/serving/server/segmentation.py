"""The server's segmentation model (`--segmentation-model`): resolved before listening, built
beside the embedding engine.

An explicit `--segmentation-model` is resolved and loaded in preflight, so a repo that cannot
be fetched or a file that is not segmentation-3.0 is one line and exit 2 before the port
opens; the synthetic default is made (on first use) while health still answers NOT_SERVING,
as the default embedding model is. A call that does not ask to segment never runs it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from speakerd.engine.factory import create_segmenter
from speakerd.engine.segmenter import Segmenter
from speakerd.model.segmentation.weights import SegmentationModel, load_model
from speakerd.model.source import SEGMENTATION, ModelError, ResolvedModel, resolve_model
from speakerd.serving.server.config import UsageError

log = logging.getLogger(__name__)

FLAG = "--segmentation-model"


def resolve(spec: str) -> ResolvedModel:
    """An explicit --segmentation-model's safetensors (downloaded, converted, cached as
    needed); UsageError naming the flag otherwise."""
    try:
        return resolve_model(spec, FLAG, SEGMENTATION)
    except ModelError as error:
        raise UsageError(str(error)) from error


def load(resolved: ResolvedModel, spec: str | None) -> SegmentationModel:
    """The weights of a resolved segmentation model; UsageError saying what to give instead."""
    try:
        return load_model(resolved.path)
    except (ValueError, KeyError, OSError) as error:
        said = spec if spec is not None else "(the default)"
        raise UsageError(
            f"{FLAG} {said}: {resolved.path} is not usable ({error}); give pyannote's segmentation-3.0 "
            "(a repo id like pyannote/segmentation-3.0, its pytorch_model.bin, or safetensors)"
        ) from error


def build(weights: SegmentationModel, path: Path, engine_kind: str, math: str = "fp32") -> Segmenter:
    """The segmentation engine serving `weights` (read from `path`) beside an engine of
    `engine_kind`, in `math` (engine/factory.py's create_segmenter)."""
    segmenter = create_segmenter(weights, path, engine_kind, math)
    log.info("segmentation model %s on %s (%s), %d windows a run", segmenter.model_id[:16], segmenter.name,
             math, segmenter.max_windows)  # fmt: skip
    return segmenter
