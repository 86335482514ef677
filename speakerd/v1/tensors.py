"""The wire form of arrays: `speakerd.v1.Tensor` <-> NumPy, shared by server and client.

Raw little-endian bytes with dtype and shape, decoded without a copy where NumPy allows,
so a 10 MB fbank costs one memcpy per side instead of a per-float protobuf decode.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from speakerd.v1 import speakerd_pb2 as pb

#: wire dtype -> little-endian NumPy dtype
DTYPES: dict[int, np.dtype] = {
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
    pb.DTYPE_FLOAT16: np.dtype("<f2"),
    pb.DTYPE_UINT8: np.dtype("u1"),
}
#: No real request has more dimensions than [n, s, F]; deeper shapes are a client bug.
MAX_DIMS = 4


class TensorError(ValueError):
    """A Tensor that cannot be an array; `field` names the request field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def to_tensor(array: np.ndarray) -> pb.Tensor:
    """float32, float16 or uint8 array -> Tensor (bytes in little-endian C order)."""
    array = np.asarray(array)
    # match on kind and width, so a big-endian float32 array is sent (swapped) like a native one
    kind = (array.dtype.kind, array.dtype.itemsize)
    matches = [wire for wire, dtype in DTYPES.items() if (dtype.kind, dtype.itemsize) == kind]
    if not matches:
        raise TypeError(f"dtype {array.dtype}: the wire carries float32, float16 or uint8")
    wire = matches[0]
    data = np.ascontiguousarray(array, dtype=DTYPES[wire]).tobytes()
    return pb.Tensor(dtype=wire, shape=list(array.shape), data=data)


class TensorFields(Protocol):
    """What from_tensor reads: a pb.Tensor, or the server's zero-copy view of one."""

    dtype: int
    shape: Sequence[int]
    data: bytes | memoryview


def from_tensor(tensor: TensorFields, field: str) -> np.ndarray:
    """Tensor -> read-only array of its shape (a view of `data`, no copy); TensorError
    naming `field` when malformed."""
    if tensor.dtype not in DTYPES:
        name = pb.DType.Name(tensor.dtype) if tensor.dtype in pb.DType.values() else str(tensor.dtype)
        raise TensorError(field, f"dtype {name}, expected DTYPE_FLOAT32, DTYPE_FLOAT16 or DTYPE_UINT8")
    if not 1 <= len(tensor.shape) <= MAX_DIMS:  # the count only: a long shape would make a huge message
        raise TensorError(field, f"shape of {len(tensor.shape)} dimensions, expected 1 to {MAX_DIMS}")
    shape = tuple(int(d) for d in tensor.shape)
    if any(d < 0 for d in shape):
        raise TensorError(field, f"shape {list(shape)} has a negative dimension")
    dtype = DTYPES[tensor.dtype]
    # Python ints, not np.prod: an int64 product wraps (2**32 * 2**32 == 0 in int64), and a
    # wrapped count would accept 0 bytes for a 16-exbi-element shape and fail in reshape
    expected = math.prod(shape) * dtype.itemsize
    data = tensor.data  # each read of a bytes field copies it out of the message: read once
    if len(data) != expected:
        raise TensorError(
            field, f"{len(data)} bytes, expected {expected} for shape {list(shape)} of {dtype.name}"
        )
    return np.frombuffer(data, dtype=dtype).reshape(shape)
