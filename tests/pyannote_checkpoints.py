"""pyannote's own WeSpeakerResNet34 and PyanNet with random weights, saved the ways checkpoints are found.

`pyannote.audio.models.embedding.WeSpeakerResNet34` (4.0.7) builds the module tree; its
weights and BatchNorm statistics are drawn from a seeded generator (trained-looking running
statistics, so every value differs). `random_pyannet` is pyannote's segmentation model,
`PyanNet` with segmentation-3.0's hyper-parameters and task (the powerset of 3 speakers,
at most 2 at once), torch's own initialisation from a seed. Either is saved
- "lightning": as pyannote saves it, a Lightning checkpoint written by
  `Trainer.save_checkpoint`, with pyannote's `on_save_checkpoint` metadata (the task
  `Specifications` beside the weights): what `pytorch_model.bin` on the hub is;
- "bare": `torch.save(model.state_dict())`;
- "dataparallel": `torch.save(nn.DataParallel(model).state_dict())` ("module." prefixed keys);
each with FP32 or FP16 storages. Callers skip without torch and pyannote.audio.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

# pyannote.audio 4 sends usage telemetry to its vendor unless told not to; tests send nothing
os.environ["PYANNOTE_METRICS_ENABLED"] = "false"

#: Where .ci/run (scripts/pyannote_segmentation.sh) extracts segmentation-3.0's checkpoint
#: (the hub repo is gated); SPEAKERD_PYANNOTE_SEGMENTATION names another place.
SEGMENTATION_CHECKPOINT = Path(
    os.environ.get(
        "SPEAKERD_PYANNOTE_SEGMENTATION",
        Path(__file__).resolve().parent.parent / ".cache/pyannote/segmentation-3.0/pytorch_model.bin",
    )
)
SEGMENTATION_MISSING = (
    f"segmentation-3.0 checkpoint not found at {SEGMENTATION_CHECKPOINT}: run "
    "scripts/pyannote_segmentation.sh (or set SPEAKERD_PYANNOTE_SEGMENTATION)"
)
LAYOUTS = ("bare", "lightning", "dataparallel")
PRECISIONS = ("fp32", "fp16")
TORCH_MISSING = "torch is not installed (.ci/run installs the CPU build of 2.13.0)"
PYANNOTE_MISSING = "pyannote.audio is not installed (.ci/run installs 4.0.7)"


def require_pyannote() -> Any:
    """torch, or the calling test module skipped saying which of torch and pyannote.audio is missing."""
    import pytest

    torch = pytest.importorskip("torch", reason=TORCH_MISSING)
    pytest.importorskip("pyannote.audio", reason=PYANNOTE_MISSING)
    return torch


def random_wespeaker(seed: int) -> Any:
    """pyannote's WeSpeakerResNet34, eval mode, seeded random weights and BN statistics."""
    import torch
    from pyannote.audio.core.task import Problem, Resolution, Specifications
    from pyannote.audio.models.embedding import WeSpeakerResNet34

    torch.manual_seed(seed)
    model = WeSpeakerResNet34()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.weight.uniform_(0.5, 1.5)
                module.bias.normal_(0, 0.1)
                module.running_mean.normal_(0, 0.2)
                module.running_var.uniform_(0.5, 2.0)
                module.num_batches_tracked.fill_(12345)
    # what pyannote's embedding task sets before training; on_save_checkpoint pickles it
    model.specifications = Specifications(
        problem=Problem.REPRESENTATION, resolution=Resolution.CHUNK, duration=10.0
    )
    return model.eval()


#: segmentation-3.0's config.yaml: PyanNet's hyper-parameters.
PYANNET_HPARAMS: dict[str, Any] = {
    "sincnet": {"stride": 10},
    "lstm": {"hidden_size": 128, "num_layers": 4, "bidirectional": True, "monolithic": True},
    "linear": {"hidden_size": 128, "num_layers": 2},
}


def random_pyannet(seed: int) -> Any:
    """pyannote's PyanNet as segmentation-3.0 builds it, eval mode, torch's init from `seed`."""
    import torch
    from pyannote.audio.core.task import Problem, Resolution, Specifications
    from pyannote.audio.models.segmentation import PyanNet

    torch.manual_seed(seed)
    model = PyanNet(**PYANNET_HPARAMS)
    # what pyannote's SpeakerDiarization task (max_speakers_per_chunk 3, per_frame 2) sets;
    # on_load_checkpoint does the same, then setup() adds the classifier
    model.specifications = Specifications(
        problem=Problem.MONO_LABEL_CLASSIFICATION,
        resolution=Resolution.FRAME,
        duration=10.0,
        classes=["speaker#1", "speaker#2", "speaker#3"],
        powerset_max_classes=2,
        permutation_invariant=True,
    )
    model.setup()
    return model.eval()


def save_checkpoint(model: Any, path: Path, layout: str, precision: str = "fp32") -> Path:
    """Write `model` to `path` in `layout` with `precision` storages (see module doc)."""
    import copy

    import torch

    model = copy.deepcopy(model)
    if precision == "fp16":
        model = model.half()
    path.parent.mkdir(parents=True, exist_ok=True)
    if layout == "bare":
        torch.save(model.state_dict(), path)
    elif layout == "dataparallel":
        torch.save(torch.nn.DataParallel(model).state_dict(), path)
    elif layout == "lightning":
        import pytorch_lightning as pl

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = pl.Trainer(
                accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False,
            )  # fmt: skip
            trainer.strategy.connect(model)
            trainer.save_checkpoint(path)
    else:
        raise ValueError(f"layout {layout!r}: expected one of {LAYOUTS}")
    return path
