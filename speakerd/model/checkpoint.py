"""pyannote's checkpoint -> speakerd's safetensors, in NumPy (no torch).

The checkpoint may be a bare state dict or pyannote's Lightning checkpoint (tensors under
"state_dict", next to hyper-parameters and pyannote's task `Specifications`), with keys
under pyannote's `resnet.` attribute; a wrapper's prefix ("module." from DataParallel,
"model." from some Lightning wrappers) is removed, and WeSpeaker's own ResNet saved without
the `resnet.` attribute gets it. Floating-point tensors become float32 (FP16, BF16 and FP64
storages alike), integer counters keep their type: the file written is byte for byte the
one a torch-based conversion (`tensor.to(torch.float32).numpy()`) writes.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from speakerd.model import torch_pickle
from speakerd.model.architecture import SEG_WEIGHT
from speakerd.model.weights import save_state_dict

#: Prefixes that wrappers add in front of pyannote's `resnet.` keys.
WRAPPER_PREFIXES = ("module.", "model.")
#: pyannote's embedding model holds the WeSpeaker ResNet under this attribute.
PYANNOTE_PREFIX = "resnet."
#: The written file's mode: mkstemp's 0600 would shut out a replica running as another uid.
READABLE = 0o644
#: File name endings read as torch checkpoints (pyannote's pytorch_model.bin, Lightning's .ckpt).
CHECKPOINT_SUFFIXES = (".bin", ".ckpt", ".pt", ".pth")


def _tensors(node: Any) -> dict[str, np.ndarray]:
    """The tensor-valued entries of a state-dict-like mapping."""
    if not isinstance(node, dict):
        raise torch_pickle.CheckpointError(
            f"checkpoint holds a {type(node).__name__}, expected a state dict or a Lightning dict"
        )
    return {str(key): value for key, value in node.items() if isinstance(value, np.ndarray)}


def extract_state_dict(checkpoint: Any) -> dict[str, np.ndarray]:
    """pyannote's `resnet.*` state dict (float32, integer counters kept) from a loaded checkpoint."""
    layout = checkpoint.get("state_dict") if isinstance(checkpoint, dict) else None
    tensors = _tensors(layout if isinstance(layout, dict) else checkpoint)
    if not tensors:
        raise torch_pickle.CheckpointError(
            "no tensors found (neither a state dict nor a Lightning checkpoint's 'state_dict')"
        )
    for prefix in WRAPPER_PREFIXES:
        if all(key.startswith(prefix) for key in tensors):
            tensors = {key[len(prefix) :]: value for key, value in tensors.items()}
    if SEG_WEIGHT not in tensors and SEG_WEIGHT[len(PYANNOTE_PREFIX) :] in tensors:
        # WeSpeaker's own ResNet saved without pyannote's `resnet.` attribute
        tensors = {PYANNOTE_PREFIX + key: value for key, value in tensors.items()}
    return {
        key: value.astype(np.float32) if value.dtype.kind == "f" else value for key, value in tensors.items()
    }


def read_state_dict(path: str | Path) -> dict[str, np.ndarray]:
    """The state dict of a torch checkpoint file (torch_pickle.CheckpointError if unreadable)."""
    return extract_state_dict(torch_pickle.load(path))


def convert(checkpoint_path: str | Path, out_path: str | Path) -> None:
    """Convert and validate (WeightsError names a bad key); the output appears whole or not at
    all: written to a temporary file beside it and renamed, removed on any failure (a full
    disk included)."""
    state = read_state_dict(checkpoint_path)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    os.close(handle)
    try:
        save_state_dict(state, temporary)
        os.chmod(temporary, READABLE)
        os.replace(temporary, out)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
