"""The committed gRPC stubs are what the proto generates, and the Tensor wire codec round-trips."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from speakerd.v1 import speakerd_pb2 as pb
from speakerd.v1.tensors import TensorError, from_tensor, to_tensor

ROOT = Path(__file__).resolve().parents[1]
PROTO = Path("speakerd/v1/speakerd.proto")
GENERATED = ("speakerd_pb2.py", "speakerd_pb2.pyi", "speakerd_pb2_grpc.py")


def test_committed_stubs_match_the_proto(tmp_path: Path) -> None:
    """Regenerate exactly as `make proto` does; any difference means someone forgot `make proto`."""
    command = [
        sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT}",
        f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}", f"--pyi_out={tmp_path}",
        str(ROOT / PROTO),
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, text=True)
    for name in GENERATED:
        fresh = (tmp_path / PROTO.parent / name).read_text()
        committed = (ROOT / PROTO.parent / name).read_text()
        assert fresh == committed, f"{PROTO.parent / name} is stale: run `make proto` and commit it"


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.uint8, ">f4"])
def test_tensor_round_trip(dtype: str) -> None:
    array = (np.arange(24).reshape(2, 3, 4) % 2).astype(dtype)
    tensor = to_tensor(array)
    back = from_tensor(pb.Tensor.FromString(tensor.SerializeToString()), "x")
    assert back.shape == array.shape
    assert np.array_equal(back, array.astype(np.dtype(dtype).newbyteorder("=")))
    assert back.dtype.itemsize == np.dtype(dtype).itemsize


def test_tensor_bytes_are_little_endian() -> None:
    assert to_tensor(np.array([1.0], dtype=">f4")).data == np.array([1.0], dtype="<f4").tobytes()


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (pb.Tensor(dtype=pb.DTYPE_UNSPECIFIED, shape=[1], data=b"\0" * 4), "dtype DTYPE_UNSPECIFIED"),
        (pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[2, 3], data=b"\0" * 20), "20 bytes, expected 24"),
        (pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[], data=b""), "shape of 0 dimensions, expected 1 to 4"),
        (pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[1] * 5, data=b"\0" * 4), "shape of 5 dimensions"),
        (pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[2, -1], data=b""), "shape [2, -1]"),
        # 2**32 * 2**32 elements wrap to 0 in int64: the count must not, so 0 bytes is too few
        (pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[2**32, 2**32], data=b""), f"0 bytes, expected {2**66}"),
        (pb.Tensor(dtype=77, shape=[1], data=b"\0"), "dtype 77"),
    ],
)
def test_malformed_tensor_names_the_field(tensor: pb.Tensor, message: str) -> None:
    with pytest.raises(TensorError, match=r"^masks: ") as error:
        from_tensor(tensor, "masks")
    assert message in str(error.value), str(error.value)
    assert error.value.field == "masks"


def test_unsupported_dtype_is_refused_at_encode() -> None:
    with pytest.raises(TypeError, match="int64"):
        to_tensor(np.zeros(3, dtype=np.int64))
