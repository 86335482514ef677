"""The committed gRPC stubs are what the proto generates, and the Tensor wire codec round-trips."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
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


def _requirement(requirements: list[str], name: str) -> str:
    """The version specifier pyproject.toml gives `name` (exactly one line must name it)."""
    found = [r for r in requirements if re.match(rf"{re.escape(name)}\s*[<>=!~]", r)]
    assert len(found) == 1, f"pyproject.toml names {name} {len(found)} times: {found}"
    return found[0][len(name) :].strip()


def test_generator_pin_and_runtime_floors_match_the_stubs() -> None:
    """The stubs record the grpcio-tools and protobuf versions that wrote them and refuse older
    runtimes. So the generator is pinned to exactly that version (a new patch release on the
    registry cannot change `make proto`'s output) and the package's runtime floors are those
    versions: installing speakerd never gives a grpcio or protobuf the stubs reject at import."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    stubs = ROOT / PROTO.parent
    grpc_generated = re.search(
        r"GRPC_GENERATED_VERSION = '([0-9.]+)'", (stubs / "speakerd_pb2_grpc.py").read_text()
    )
    protobuf_generated = re.search(
        r"# Protobuf Python Version: ([0-9.]+)", (stubs / "speakerd_pb2.py").read_text()
    )
    assert grpc_generated and protobuf_generated, "the stubs no longer record their generator versions"
    dev = project["optional-dependencies"]["dev"]
    assert _requirement(dev, "grpcio-tools") == f"=={grpc_generated[1]}", (
        f"the dev extra must pin grpcio-tools=={grpc_generated[1]}, the version that wrote the stubs"
    )
    runtime = project["dependencies"]
    for name, floor in (("grpcio", grpc_generated[1]), ("grpcio-status", grpc_generated[1]),
                        ("protobuf", protobuf_generated[1])):  # fmt: skip
        assert _requirement(runtime, name).startswith(f">={floor},"), (
            f"{name}'s floor must be {floor}, what the stubs demand; "
            f"pyproject.toml says {_requirement(runtime, name)}"
        )


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
