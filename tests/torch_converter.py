"""The torch-based converter speakerd had before its torch-free one: the oracle of tests/test_convert.py
and tests/test_segmentation_convert.py.

`torch.load` (weights_only first; for pyannote's Lightning checkpoints, which pickle task
objects, torch's loader with a restricted pickle module that turns every non-tensor class
into an inert placeholder), then `tensor.to(torch.float32).numpy()` for floating-point
tensors, integer counters kept, and speakerd's `save_state_dict` with the network's
validator (the embedding model's by default). The torch-free converter must write the same
bytes.
"""

from __future__ import annotations

import pickle
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch

from speakerd.model.checkpoint import EMBEDDING, Network
from speakerd.model.weights import save_state_dict

WRAPPER_PREFIXES = ("module.", "model.")


class _Inert:
    def __init__(self, *args: object, **kwargs: object) -> None:
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state: object) -> None:
        self.state = state


def _restricted_pickle_module() -> types.ModuleType:
    allowed = {("collections", "OrderedDict"), ("torch", "Size"), ("torch", "device")}

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if (module, name) in allowed:
                return super().find_class(module, name)
            if module == "torch._utils" and name.startswith("_rebuild_"):
                return super().find_class(module, name)
            if module == "torch" and (
                name.endswith("Storage") or isinstance(getattr(torch, name, None), torch.dtype)
            ):
                return super().find_class(module, name)
            return type(name, (_Inert,), {"__module__": f"inert.{module}"})

    restricted = types.ModuleType("restricted_pickle")
    restricted.Unpickler = Unpickler  # type: ignore[attr-defined]
    restricted.load = lambda file, **kwargs: Unpickler(file, **kwargs).load()  # type: ignore[attr-defined]
    restricted.__dict__.update(UnpicklingError=pickle.UnpicklingError)
    return restricted


def load_checkpoint(path: Path) -> Any:
    try:
        return torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        return torch.load(
            str(path), map_location="cpu", weights_only=False, pickle_module=_restricted_pickle_module()
        )


def torch_convert(checkpoint_path: Path, out_path: Path, network: Network = EMBEDDING) -> None:
    """`network`'s checkpoint (its keys, prefix and validator) -> safetensors, through torch."""
    checkpoint = load_checkpoint(checkpoint_path)
    layout = checkpoint.get("state_dict") if isinstance(checkpoint, dict) else None
    node = layout if isinstance(layout, dict) else checkpoint
    tensors = {str(key): value for key, value in node.items() if isinstance(value, torch.Tensor)}
    for prefix in WRAPPER_PREFIXES:
        if all(key.startswith(prefix) for key in tensors):
            tensors = {key[len(prefix) :]: value for key, value in tensors.items()}
    bare = network.marker[len(network.attribute) :]
    if network.attribute and network.marker not in tensors and bare in tensors:
        tensors = {network.attribute + key: value for key, value in tensors.items()}
    state: dict[str, np.ndarray] = {}
    for key, tensor in tensors.items():
        tensor = tensor.detach().cpu()
        if tensor.is_floating_point():
            tensor = tensor.to(torch.float32)
        state[key] = tensor.numpy().copy()
    save_state_dict(state, out_path, network.validate)
