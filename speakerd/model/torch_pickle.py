"""Read what `torch.save` wrote, without torch: tensors become NumPy arrays, nothing runs.

pyannote's checkpoints (`pytorch_model.bin`, Lightning `.ckpt`) are torch's zip format: one
top folder holding `data.pkl` (a pickle of the checkpoint's dicts), `data/<key>` (one file of
raw bytes per storage, stored uncompressed) and `byteorder` ("little" or "big"; absent in
files from torch before 1.10, which wrote little-endian only). A tensor in the pickle is
`torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)`, where the storage is a
persistent id `("storage", torch.FloatStorage, key, location, numel)`; here that becomes a
NumPy view of `data/<key>` with the same offset and strides (in elements), copied out
C-contiguous in native byte order, as `torch.load(...).numpy()` would give.

A pickle can name any importable callable, so the unpickler below resolves a closed list of
names only: the tensor-rebuilding functions and storage types (implemented here in NumPy,
torch's are never imported), `collections.OrderedDict`, and the plain-data metadata pyannote
and Lightning put beside the weights (pyannote's task `Specifications` and its enums, torch's
version string, Lightning's `AttributeDict`), which become inert records. Any other name
refuses the whole file before anything in it is called.
"""

from __future__ import annotations

import collections
import io
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

#: torch's storage type names -> NumPy element type. bfloat16 has no NumPy type: its 16 bits
#: are the high half of a float32, widened exactly when the tensor is rebuilt.
STORAGE_DTYPES: dict[str, str] = {
    "DoubleStorage": "f8",
    "FloatStorage": "f4",
    "HalfStorage": "f2",
    "BFloat16Storage": "u2",
    "LongStorage": "i8",
    "IntStorage": "i4",
    "ShortStorage": "i2",
    "CharStorage": "i1",
    "ByteStorage": "u1",
    "BoolStorage": "?",
}
#: Metadata classes pickled beside the weights: read as inert records (their fields kept,
#: their code never imported). pyannote.audio 4 writes the first three under
#: checkpoint["pyannote.audio"]["specifications"].
RECORD_CLASSES = frozenset(
    {
        ("pyannote.audio.core.task", "Specifications"),
        ("pyannote.audio.core.task", "Problem"),
        ("pyannote.audio.core.task", "Resolution"),
    }
)
#: Subclasses of dict or str that carry nothing else: read as a dict or a str.
DICT_CLASSES = frozenset(
    {
        ("pytorch_lightning.utilities.parsing", "AttributeDict"),
        ("lightning.pytorch.utilities.parsing", "AttributeDict"),
        ("lightning_fabric.utilities.data", "AttributeDict"),
        ("lightning.fabric.utilities.data", "AttributeDict"),
    }
)
STR_CLASSES = frozenset({("torch.torch_version", "TorchVersion")})
#: What torch's legacy (pre-1.6, non-zip) format starts with: a pickled magic number.
LEGACY_MAGIC = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19."


class CheckpointError(ValueError):
    """A file that is no readable torch checkpoint, or one that asks for code; says which."""


class RefusedGlobal(CheckpointError):
    """The pickle names a callable outside the allowed list: the file is refused, nothing ran."""


class Record:
    """An inert stand-in for a pickled metadata object: its class name, the arguments it was
    called with and the state it was given, nothing else."""

    def __init__(self, kind: str, args: tuple[Any, ...] = (), state: Any = None) -> None:
        self.kind, self.args, self.state = kind, args, state

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"Record({self.kind}, args={self.args!r}, state={self.state!r})"


class _AttributeDict(dict):  # type: ignore[type-arg]
    """Lightning's AttributeDict as a plain dict (its __dict__ state, if any, is dropped)."""

    def __setstate__(self, state: object) -> None:
        pass


@dataclass(frozen=True)
class _StorageType:
    name: str


@dataclass(frozen=True)
class _Storage:
    """One `data/<key>` file: its elements as a 1-D array (file byte order)."""

    elements: np.ndarray
    bfloat16: bool


def _record_class(module: str, name: str) -> type[Record]:
    """A Record subclass for `module.name`: REDUCE calls it (enums: `Problem(3)`), NEWOBJ calls
    its `__new__` (dataclasses), BUILD its `__setstate__`; each only stores what it is given."""

    def new(cls: type[Record], *args: Any) -> Record:
        record = object.__new__(cls)
        Record.__init__(record, f"{module}.{name}", args)
        return record

    return type(name, (Record,), {"__new__": new, "__init__": lambda self, *args: None})


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, archive: zipfile.ZipFile, prefix: str, byteorder: str) -> None:
        super().__init__(io.BytesIO(data))
        self._archive, self._prefix, self._byteorder = archive, prefix, byteorder
        self._storages: dict[str, _Storage] = {}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch._utils" and name in _REBUILDERS:
            return _REBUILDERS[name]
        if module == "torch" and name in STORAGE_DTYPES:
            return _StorageType(name)
        if (module, name) in RECORD_CLASSES:
            return _record_class(module, name)
        if (module, name) in DICT_CLASSES:
            return _AttributeDict
        if (module, name) in STR_CLASSES:
            return str
        raise RefusedGlobal(
            f"the checkpoint's pickle asks for {module}.{name}, which is not a tensor or plain data: "
            "refused, nothing in the file was run (use a checkpoint saved from the model's state dict)"
        )

    def persistent_load(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise CheckpointError(f"unexpected persistent id {str(pid)[:60]!r} (not a torch storage)")
        _, storage_type, key, _location, numel = pid
        if not isinstance(storage_type, _StorageType):
            raise CheckpointError(f"storage {key!r} has an unknown type {storage_type!r}")
        if key not in self._storages:
            dtype = np.dtype(STORAGE_DTYPES[storage_type.name]).newbyteorder(self._byteorder)
            name = f"{self._prefix}data/{key}"
            try:
                raw = self._archive.read(name)
            except KeyError as error:
                raise CheckpointError(f"storage file {name} is missing (truncated checkpoint?)") from error
            if len(raw) < int(numel) * dtype.itemsize:
                raise CheckpointError(
                    f"storage {name} holds {len(raw)} bytes, {int(numel) * dtype.itemsize} expected "
                    "(truncated checkpoint?)"
                )
            elements = np.frombuffer(raw, dtype=dtype, count=int(numel))
            self._storages[key] = _Storage(elements, storage_type.name == "BFloat16Storage")
        return self._storages[key]


def _rebuild_tensor_v2(
    storage: _Storage,
    storage_offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    requires_grad: bool = False,
    backward_hooks: Any = None,
    metadata: Any = None,
) -> np.ndarray:
    """The tensor as torch rebuilds it (`storage[offset:]` viewed with size and stride),
    copied C-contiguous in native byte order; bfloat16 widened exactly to float32."""
    if not isinstance(storage, _Storage):
        raise CheckpointError("a tensor's storage is not a storage of this file")
    elements = storage.elements
    size, stride = tuple(int(n) for n in size), tuple(int(s) for s in stride)
    if len(size) != len(stride) or storage_offset < 0 or any(n < 0 for n in size):
        raise CheckpointError(f"a tensor has size {size} and stride {stride}: not a valid layout")
    if 0 not in size:
        last = storage_offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
        if any(s < 0 for s in stride) or last >= elements.size:
            raise CheckpointError(
                f"a tensor of size {size} reaches element {last} of a storage of {elements.size} "
                "(truncated or corrupt checkpoint)"
            )
        view = np.lib.stride_tricks.as_strided(
            elements[storage_offset:],
            shape=size,
            strides=tuple(s * elements.itemsize for s in stride),
            writeable=False,
        )
    else:
        view = np.empty(size, dtype=elements.dtype)
    native = np.array(view, dtype=elements.dtype.newbyteorder("="), order="C")
    if storage.bfloat16:
        return (native.astype(np.uint32) << 16).view(np.float32)
    return native


def _rebuild_parameter(
    data: np.ndarray, requires_grad: bool = False, backward_hooks: Any = None
) -> np.ndarray:
    return data


def _rebuild_parameter_with_state(
    data: np.ndarray, requires_grad: bool, backward_hooks: Any, state: Any
) -> np.ndarray:
    return data


_REBUILDERS = {
    "_rebuild_tensor_v2": _rebuild_tensor_v2,
    "_rebuild_parameter": _rebuild_parameter,
    "_rebuild_parameter_with_state": _rebuild_parameter_with_state,
}


def load(path: str | Path) -> Any:
    """The checkpoint's object tree with NumPy arrays for tensors; CheckpointError (or its
    RefusedGlobal) saying what is wrong with the file. FileNotFoundError passes through."""
    path = Path(path)
    with open(path, "rb") as handle:
        head = handle.read(len(LEGACY_MAGIC))
    if head.startswith(LEGACY_MAGIC):
        raise CheckpointError(
            f"{path}: torch's legacy (pre-1.6) format: load it with torch and torch.save it again"
        )
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [name for name in archive.namelist() if name.endswith("/data.pkl")]
            if len(pickles) != 1:
                raise CheckpointError(f"{path}: a zip file but not a torch checkpoint (no data.pkl)")
            prefix = pickles[0][: -len("data.pkl")]
            byteorder = "little"
            if f"{prefix}byteorder" in archive.namelist():
                byteorder = archive.read(f"{prefix}byteorder").decode("ascii", "replace").strip()
            if byteorder not in ("little", "big"):
                raise CheckpointError(f"{path}: byteorder {byteorder!r}, expected little or big")
            unpickler = _Unpickler(
                archive.read(pickles[0]), archive, prefix, "<" if byteorder == "little" else ">"
            )
            return unpickler.load()
    except CheckpointError as error:
        if str(error).startswith(str(path)):
            raise
        raise type(error)(f"{path}: {error}") from error
    except (zipfile.BadZipFile, EOFError, pickle.UnpicklingError, ValueError, TypeError, OSError) as error:
        if isinstance(error, FileNotFoundError):
            raise
        raise CheckpointError(f"{path}: truncated or corrupt checkpoint ({error})") from error
