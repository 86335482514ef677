"""pyannote's checkpoint -> speakerd's safetensors, in NumPy (no torch).

The checkpoint may be a bare state dict or pyannote's Lightning checkpoint (tensors under
"state_dict", next to hyper-parameters and pyannote's task `Specifications`), with keys
under pyannote's `resnet.` attribute; a wrapper's prefix ("module." from DataParallel,
"model." from some Lightning wrappers) is removed, and WeSpeaker's own ResNet saved without
the `resnet.` attribute gets it. Floating-point tensors become float32 (FP16, BF16 and FP64
storages alike), integer counters keep their type: the file written is byte for byte the
one a torch-based conversion (`tensor.to(torch.float32).numpy()`) writes.

The same reading serves both networks speakerd knows: a `Network` says which one a file
must be (its validator, and for the embedding model the `resnet.` attribute); EMBEDDING is
the default, speakerd/model/segmentation/weights.py defines the segmentation model's.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from speakerd.model import torch_pickle
from speakerd.model.architecture import SEG_WEIGHT
from speakerd.model.weights import Validator, save_state_dict, validate_state_dict

#: Prefixes that wrappers add in front of pyannote's keys.
WRAPPER_PREFIXES = ("module.", "model.")
#: pyannote's embedding model holds the WeSpeaker ResNet under this attribute.
PYANNOTE_PREFIX = "resnet."
#: The written file's mode: mkstemp's 0600 would shut out a replica running as another uid.
READABLE = 0o644
#: File name endings read as torch checkpoints (pyannote's pytorch_model.bin, Lightning's .ckpt).
CHECKPOINT_SUFFIXES = (".bin", ".ckpt", ".pt", ".pth")


@dataclass(frozen=True)
class Network:
    """What conversion needs to know of one network pyannote saves."""

    name: str  # in messages: "not pyannote's {name} checkpoint"
    repo: str  # the hub repo of pyannote's own checkpoint of it, named in messages
    validate: Validator  # WeightsError naming the first key that is not this network's
    marker: str = ""  # a key of the network that, found without `attribute`, means a bare one
    attribute: str = ""  # pyannote's attribute holding the bare network: added to its keys


EMBEDDING = Network(
    "WeSpeaker ResNet34",
    "pyannote/wespeaker-voxceleb-resnet34-LM",
    validate_state_dict,
    marker=SEG_WEIGHT,
    attribute=PYANNOTE_PREFIX,
)


def _tensors(node: Any) -> dict[str, np.ndarray]:
    """The tensor-valued entries of a state-dict-like mapping."""
    if not isinstance(node, dict):
        raise torch_pickle.CheckpointError(
            f"checkpoint holds a {type(node).__name__}, expected a state dict or a Lightning dict"
        )
    return {str(key): value for key, value in node.items() if isinstance(value, np.ndarray)}


def extract_state_dict(checkpoint: Any, network: Network = EMBEDDING) -> dict[str, np.ndarray]:
    """pyannote's state dict of `network` (float32, integer counters kept) from a loaded checkpoint."""
    layout = checkpoint.get("state_dict") if isinstance(checkpoint, dict) else None
    tensors = _tensors(layout if isinstance(layout, dict) else checkpoint)
    if not tensors:
        raise torch_pickle.CheckpointError(
            "no tensors found (neither a state dict nor a Lightning checkpoint's 'state_dict')"
        )
    for prefix in WRAPPER_PREFIXES:
        if all(key.startswith(prefix) for key in tensors):
            tensors = {key[len(prefix) :]: value for key, value in tensors.items()}
    bare = network.marker[len(network.attribute) :]
    if network.attribute and network.marker not in tensors and bare in tensors:
        # WeSpeaker's own ResNet saved without pyannote's `resnet.` attribute
        tensors = {network.attribute + key: value for key, value in tensors.items()}
    return {
        key: value.astype(np.float32) if value.dtype.kind == "f" else value for key, value in tensors.items()
    }


def read_state_dict(path: str | Path, network: Network = EMBEDDING) -> dict[str, np.ndarray]:
    """The state dict of a torch checkpoint file (torch_pickle.CheckpointError if unreadable)."""
    return extract_state_dict(torch_pickle.load(path), network)


def convert(checkpoint_path: str | Path, out_path: str | Path, network: Network = EMBEDDING) -> None:
    """Convert and validate as `network` (WeightsError names a bad key); the output appears
    whole or not at all: written to a temporary file beside it and renamed, removed on any
    failure (a full disk included)."""
    state = read_state_dict(checkpoint_path, network)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    os.close(handle)
    try:
        save_state_dict(state, temporary, network.validate)
        os.chmod(temporary, READABLE)
        os.replace(temporary, out)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
