"""`python -m speakerd convert pytorch_model.bin --out model.safetensors`: pyannote checkpoint -> safetensors.

A user with pyannote's `pyannote/wespeaker-voxceleb-resnet34-LM` checkpoint converts it once;
the service then never needs torch. The checkpoint may be a bare state dict or pyannote's
Lightning checkpoint (tensors under "state_dict", next to hyper-parameters and pyannote's own
objects such as task `Specifications`). Keys keep pyannote's `resnet.*` names; wrappers'
prefixes ("module." from DataParallel, "model." from some Lightning wrappers) are removed.

Loading is safe: torch's `weights_only` loader first; if the file holds pickled non-tensor
objects (pyannote's Lightning checkpoints do), a restricted unpickler rebuilds tensors and
containers only and replaces every other class with an inert placeholder, so no code from
the file runs and pyannote need not be installed.
"""

from __future__ import annotations

import argparse
import pickle
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np

from speakerd.model.architecture import SEG_WEIGHT
from speakerd.model.weights import WeightsError, file_sha256, save_state_dict

#: Prefixes that wrappers add in front of pyannote's `resnet.` keys.
WRAPPER_PREFIXES = ("module.", "model.")
#: pyannote's embedding model holds the WeSpeaker ResNet under this attribute.
PYANNOTE_PREFIX = "resnet."
INSTALL_HINT = "the convert command needs torch: pip install 'speakerd[convert]' (or pip install torch)"


class ConvertError(ValueError):
    """A checkpoint that cannot be converted; the message says what was found."""


def _import_torch() -> Any:
    try:
        import torch
    except ImportError as error:
        raise ConvertError(INSTALL_HINT) from error
    return torch


class _Inert:
    """Stands in for a pickled class the converter does not need (pyannote Specifications, enums)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state: object) -> None:
        self.state = state


def _restricted_pickle_module(torch: Any) -> types.ModuleType:
    """A pickle module whose Unpickler resolves only tensor-rebuilding globals and containers."""
    allowed = {
        ("collections", "OrderedDict"),
        ("copyreg", "_reconstructor"),
        ("builtins", "object"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "slice"),
        ("builtins", "complex"),
        ("torch", "Size"),
        ("torch", "device"),
    }

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
            return type(name, (_Inert,), {"__module__": f"server.inert.{module}"})

    restricted = types.ModuleType("speakerd_restricted_pickle")
    restricted.Unpickler = Unpickler  # type: ignore[attr-defined]
    restricted.load = lambda file, **kwargs: Unpickler(file, **kwargs).load()  # type: ignore[attr-defined]
    restricted.__dict__.update(UnpicklingError=pickle.UnpicklingError)
    return restricted


def load_checkpoint(path: str | Path) -> Any:
    """torch.load on CPU, weights_only first, then the restricted unpickler (see module doc)."""
    torch = _import_torch()
    try:
        return torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        pass  # pickled non-tensor objects: pyannote's Lightning checkpoint; retry restricted
    except FileNotFoundError:
        raise
    except Exception as error:  # torch raises RuntimeError for a file that is no checkpoint at all
        raise ConvertError(f"{path}: not a torch checkpoint ({error})") from error
    try:
        return torch.load(
            str(path), map_location="cpu", weights_only=False, pickle_module=_restricted_pickle_module(torch)
        )
    except Exception as error:
        raise ConvertError(f"{path}: cannot read the checkpoint ({error})") from error


def _tensors(node: Any, torch: Any) -> dict[str, Any]:
    """The tensor-valued entries of a state-dict-like mapping."""
    if not isinstance(node, dict):
        raise ConvertError(
            f"checkpoint holds a {type(node).__name__}, expected a state dict or a Lightning dict"
        )
    return {str(key): value for key, value in node.items() if isinstance(value, torch.Tensor)}


def extract_state_dict(checkpoint: Any) -> dict[str, np.ndarray]:
    """pyannote's `resnet.*` state dict as NumPy arrays (float32, integer counters kept)."""
    torch = _import_torch()
    layout = checkpoint.get("state_dict") if isinstance(checkpoint, dict) else None
    tensors = _tensors(layout if isinstance(layout, dict) else checkpoint, torch)
    if not tensors:
        raise ConvertError(
            "no tensors found (neither a state dict nor a Lightning checkpoint's 'state_dict')"
        )
    for prefix in WRAPPER_PREFIXES:
        if all(key.startswith(prefix) for key in tensors):
            tensors = {key[len(prefix) :]: value for key, value in tensors.items()}
    if SEG_WEIGHT not in tensors and f"{SEG_WEIGHT[len(PYANNOTE_PREFIX) :]}" in tensors:
        # WeSpeaker's own ResNet saved without pyannote's `resnet.` attribute
        tensors = {PYANNOTE_PREFIX + key: value for key, value in tensors.items()}
    state: dict[str, np.ndarray] = {}
    for key, tensor in tensors.items():
        tensor = tensor.detach().cpu()
        if tensor.is_floating_point():
            tensor = tensor.to(torch.float32)
        state[key] = tensor.numpy().copy()  # a C-contiguous copy that keeps 0-d counters 0-d
    return state


def convert(checkpoint_path: str | Path, out_path: str | Path) -> str:
    """Convert, validate (WeightsError names a bad key), write; returns the model id (sha256)."""
    state = extract_state_dict(load_checkpoint(checkpoint_path))
    save_state_dict(state, out_path)
    return file_sha256(out_path)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", type=Path, help="pyannote pytorch_model.bin (or any torch state dict)")
    parser.add_argument("--out", type=Path, required=True, help="safetensors file to write")


def run(args: argparse.Namespace) -> int:
    try:
        model_id = convert(args.checkpoint, args.out)
    except FileNotFoundError as error:
        print(f"convert: {error.filename or args.checkpoint}: no such file", file=sys.stderr)
        return 1
    except (ConvertError, WeightsError) as error:
        print(f"convert: {error}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}")
    print(f"model id {model_id}")
    return 0
