"""`convert` and the torch-free checkpoint reader against torch itself.

Checkpoints come from pyannote.audio's own `WeSpeakerResNet34` with random weights, saved as
pyannote saves it (Lightning), as a bare state dict and as a DataParallel one, with FP32 and
FP16 storages (tests/pyannote_checkpoints.py). The torch-free converter must write the same
bytes as the torch-based one (tests/torch_converter.py); the reader must give torch.load's
arrays for any layout torch writes (views: offsets and strides; every dtype; big-endian).
Skips without torch or pyannote.audio (.ci/run installs both).
"""

from __future__ import annotations

import io
import pickle
import zipfile
from pathlib import Path

import numpy as np
import pytest

from speakerd.cli import main
from speakerd.model import torch_pickle
from speakerd.model.architecture import state_dict_shapes
from speakerd.model.weights import file_sha256, load_state_dict
from tests.pyannote_checkpoints import LAYOUTS, PRECISIONS, PYANNOTE_MISSING, TORCH_MISSING, save_checkpoint

torch = pytest.importorskip("torch", reason=TORCH_MISSING)


@pytest.fixture(scope="module")
def model():
    pytest.importorskip("pyannote.audio", reason=PYANNOTE_MISSING)
    from tests.pyannote_checkpoints import random_wespeaker

    return random_wespeaker(seed=0)


def test_module_tree_keys_are_architecture_keys(model) -> None:
    shapes = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    assert shapes == state_dict_shapes()


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_same_bytes_as_the_torch_converter(
    model, tmp_path: Path, layout: str, precision: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.torch_converter import torch_convert

    source = save_checkpoint(model, tmp_path / "pytorch_model.bin", layout, precision)
    torch_convert(source, tmp_path / "torch.safetensors")
    out = tmp_path / "speakerd.safetensors"
    assert main(["convert", str(source), "--out", str(out)]) == 0
    assert f"model id {file_sha256(out)}" in capsys.readouterr().out
    assert out.read_bytes() == (tmp_path / "torch.safetensors").read_bytes()
    converted = load_state_dict(out)
    for key, tensor in model.state_dict().items():
        expected = tensor.half().float() if precision == "fp16" and tensor.is_floating_point() else tensor
        np.testing.assert_array_equal(converted[key], expected.numpy(), err_msg=key)
    assert [path.name for path in tmp_path.iterdir() if path.name.startswith(".")] == []


def _same_as_torch(path: Path) -> None:
    expected, read = torch.load(path, weights_only=True), torch_pickle.load(path)
    assert list(read) == list(expected)
    for key, tensor in expected.items():
        reference = tensor.float().numpy() if tensor.dtype == torch.bfloat16 else tensor.numpy()
        assert read[key].dtype == reference.dtype, (key, read[key].dtype, reference.dtype)
        assert read[key].shape == reference.shape, key
        assert read[key].flags.c_contiguous, key
        np.testing.assert_array_equal(read[key], reference, err_msg=key)


def test_reader_gives_torch_arrays_for_every_layout(tmp_path: Path) -> None:
    base = torch.arange(120, dtype=torch.float64).reshape(4, 5, 6) / 7
    tensors = {
        "transposed_slice": base.transpose(0, 2)[1:, ::2],  # offset and non-contiguous strides
        "shared_a": base[1],  # two tensors of one storage at different offsets
        "shared_b": base[2, 1:],
        "scalar": torch.tensor(12345),
        "empty": torch.zeros(0, 3),
    }
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
                  torch.int8, torch.uint8, torch.bool):  # fmt: skip
        tensors[str(dtype)] = (base * 3).to(dtype)[:, 2]
    torch.save(tensors, tmp_path / "layouts.bin")
    _same_as_torch(tmp_path / "layouts.bin")


class Anything(dict):
    """Whatever the pickle builds, while only its storages' element sizes are wanted."""

    def __setstate__(self, state: object) -> None:
        pass


def _as_big_endian(source: Path, target: Path) -> None:
    """The same checkpoint as torch writes it on a big-endian machine: storages byte-swapped
    (element sizes from the pickle's storage types), `byteorder` saying "big"."""
    with zipfile.ZipFile(source) as archive:
        prefix = next(name for name in archive.namelist() if name.endswith("data.pkl"))[: -len("data.pkl")]
        sizes: dict[str, int] = {}

        class Sizes(pickle.Unpickler):
            def find_class(self, module: str, name: str):  # a dtype code for storages, else a dict
                return (
                    torch_pickle.STORAGE_DTYPES.get(name) if module == "torch" else (lambda *args: Anything())
                )

            def persistent_load(self, pid):
                sizes[pid[2]] = np.dtype(pid[1]).itemsize
                return None

        Sizes(io.BytesIO(archive.read(f"{prefix}data.pkl"))).load()
        with zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as out:
            for name in archive.namelist():
                data = archive.read(name)
                if name.startswith(f"{prefix}data/"):
                    size = sizes[name.rsplit("/", 1)[1]]
                    data = np.frombuffer(data, dtype=f"<u{size}" if size > 1 else "u1").byteswap().tobytes()
                elif name == f"{prefix}byteorder":
                    data = b"big"
                out.writestr(name, data)


def test_reader_reads_big_endian_storages(model, tmp_path: Path) -> None:
    little = save_checkpoint(model, tmp_path / "little.bin", "bare", "fp16")
    _as_big_endian(little, tmp_path / "big.bin")
    expected, read = torch_pickle.load(little), torch_pickle.load(tmp_path / "big.bin")
    assert set(read) == set(expected)
    for key in expected:
        assert read[key].dtype == expected[key].dtype and read[key].dtype.isnative, key
        np.testing.assert_array_equal(read[key], expected[key], err_msg=key)


class RunsCode:
    """Unpickling this calls os.system: a reader that runs pickled code would create MARKER."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_pickled_code_is_refused_and_never_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    marker = tmp_path / "code-ran"
    torch.save({"state_dict": {"x": torch.zeros(1)}, "evil": RunsCode(marker)}, tmp_path / "evil.bin")
    assert main(["convert", str(tmp_path / "evil.bin"), "--out", str(tmp_path / "out.safetensors")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "asks for posix.system" in err and "refused" in err, err
    assert not marker.exists() and not (tmp_path / "out.safetensors").exists()


def _convert_error(tmp_path: Path, source: Path, capsys: pytest.CaptureFixture[str]) -> str:
    out = tmp_path / "out.safetensors"
    assert main(["convert", str(source), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert not out.exists() and not any(tmp_path.glob(".out.safetensors.*")), "nothing half-written"
    return err


def test_bad_checkpoints_are_one_line(model, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = model.state_dict()
    missing = {key: value for key, value in state.items() if key != "resnet.layer3.2.bn1.running_var"}
    torch.save(missing, tmp_path / "missing.bin")
    err = _convert_error(tmp_path, tmp_path / "missing.bin", capsys)
    assert "missing key 'resnet.layer3.2.bn1.running_var' of shape (128,)" in err, err

    torch.save({**state, "resnet.seg_2.weight": torch.zeros(256, 256)}, tmp_path / "extra.bin")
    err = _convert_error(tmp_path, tmp_path / "extra.bin", capsys)
    assert "unexpected key 'resnet.seg_2.weight' of shape (256, 256)" in err, err

    torch.save({**state, "resnet.seg_1.weight": torch.zeros(256, 2560)}, tmp_path / "shape.bin")
    err = _convert_error(tmp_path, tmp_path / "shape.bin", capsys)
    assert "'resnet.seg_1.weight' has shape (256, 2560), expected (256, 5120)" in err, err

    whole = save_checkpoint(model, tmp_path / "whole.bin", "lightning").read_bytes()
    (tmp_path / "truncated.bin").write_bytes(whole[: len(whole) // 2])
    err = _convert_error(tmp_path, tmp_path / "truncated.bin", capsys)
    assert "truncated.bin: truncated or corrupt checkpoint" in err, err

    (tmp_path / "junk.bin").write_bytes(b"not a checkpoint")
    assert "junk.bin: truncated or corrupt checkpoint" in _convert_error(
        tmp_path, tmp_path / "junk.bin", capsys
    )

    assert "absent.bin: no such file" in _convert_error(tmp_path, tmp_path / "absent.bin", capsys)
