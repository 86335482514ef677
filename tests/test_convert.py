"""`convert`: checkpoints saved from a torch module with pyannote's exact WeSpeakerResNet34 tree.

The module tree below mirrors pyannote.audio 4.0.7 (`models/embedding/wespeaker/resnet.py`:
ResNet(BasicBlock, [3, 4, 6, 3], m_channels=32, feat_dim=80, embed_dim=256, two_emb_layer=False)
held as `self.resnet` by `WeSpeakerResNet34`), so its state-dict keys are pyannote's keys.
"""

from __future__ import annotations

import dataclasses
import enum
from pathlib import Path

import numpy as np
import pytest

from speakerd.cli import main
from speakerd.model.architecture import state_dict_shapes
from speakerd.model.weights import file_sha256, load_state_dict

torch = pytest.importorskip("torch", reason="torch is the `convert` extra; install it to test the converter")
nn = torch.nn


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, kernel_size=1, stride=stride, bias=False), nn.BatchNorm2d(planes)
            )


class ResNet(nn.Module):
    def __init__(self, num_blocks: list[int], m_channels: int = 32, feat_dim: int = 80, embed_dim: int = 256):
        super().__init__()
        self.in_planes = m_channels
        self.conv1 = nn.Conv2d(1, m_channels, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(m_channels)
        self.layer1 = self._make_layer(m_channels, num_blocks[0], 1)
        self.layer2 = self._make_layer(m_channels * 2, num_blocks[1], 2)
        self.layer3 = self._make_layer(m_channels * 4, num_blocks[2], 2)
        self.layer4 = self._make_layer(m_channels * 8, num_blocks[3], 2)
        self.seg_1 = nn.Linear(int(feat_dim / 8) * m_channels * 8 * 2, embed_dim)
        self.seg_bn_1 = nn.Identity()  # two_emb_layer=False
        self.seg_2 = nn.Identity()

    def _make_layer(self, planes: int, count: int, stride: int) -> nn.Sequential:
        layers = []
        for block_stride in [stride] + [1] * (count - 1):
            layers.append(BasicBlock(self.in_planes, planes, block_stride))
            self.in_planes = planes
        return nn.Sequential(*layers)


class WeSpeakerResNet34(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.resnet = ResNet([3, 4, 6, 3])


class Problem(enum.Enum):  # stands for pyannote's task enums pickled into Lightning checkpoints
    REPRESENTATION = 3


@dataclasses.dataclass
class Specifications:  # stands for pyannote.audio.core.task.Specifications
    problem: Problem
    duration: float


@pytest.fixture(scope="module")
def torch_state() -> dict[str, object]:
    torch.manual_seed(0)
    model = WeSpeakerResNet34()
    with torch.no_grad():  # trained-looking BatchNorm statistics, so values are all distinct
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.weight.uniform_(0.5, 1.5)
                module.bias.normal_(0, 0.1)
                module.running_mean.normal_(0, 0.2)
                module.running_var.uniform_(0.5, 2.0)
                module.num_batches_tracked.fill_(12345)
    return model.state_dict()


def test_module_tree_keys_are_architecture_keys(torch_state: dict[str, object]) -> None:
    shapes = {key: tuple(value.shape) for key, value in torch_state.items()}
    expected = state_dict_shapes()
    assert set(shapes) == set(expected), (sorted(set(shapes) ^ set(expected)))[:5]
    for key, shape in expected.items():
        assert shapes[key] == shape, (key, shapes[key], shape)


def _assert_round_trip(torch_state: dict[str, object], out: Path) -> None:
    converted = load_state_dict(out)
    assert set(converted) == set(torch_state)
    for key, tensor in torch_state.items():
        np.testing.assert_array_equal(converted[key], tensor.numpy(), err_msg=key)
        assert converted[key].dtype == tensor.numpy().dtype, (key, converted[key].dtype)


@pytest.mark.parametrize("layout", ["bare", "lightning", "dataparallel"])
def test_convert_round_trips(
    torch_state: dict[str, object], tmp_path: Path, layout: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if layout == "bare":
        checkpoint: object = torch_state
    elif layout == "lightning":  # pyannote's layout: pickled non-tensor objects beside "state_dict"
        checkpoint = {
            "epoch": 7,
            "state_dict": torch_state,
            "hyper_parameters": {"sample_rate": 16000, "num_channels": 1},
            "pyannote.audio": {
                "versions": {"torch": torch.__version__, "pyannote.audio": "4.0.7"},
                "architecture": {"module": "pyannote.audio.models.embedding", "class": "WeSpeakerResNet34"},
                "specifications": Specifications(Problem.REPRESENTATION, 10.0),
            },
        }
    else:
        checkpoint = {f"module.{key}": value for key, value in torch_state.items()}
    source, out = tmp_path / "pytorch_model.bin", tmp_path / "model.safetensors"
    torch.save(checkpoint, source)
    assert main(["convert", str(source), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"model id {file_sha256(out)}" in printed, printed
    _assert_round_trip(torch_state, out)


def test_lightning_checkpoint_runs_no_pickled_code(tmp_path: Path) -> None:
    """A pickled callable in the checkpoint is replaced by a placeholder, never called."""

    class Boom:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (print, ("code from the checkpoint ran",))

    torch.save({"state_dict": {"x": torch.zeros(1)}, "evil": Boom()}, tmp_path / "evil.bin")
    from speakerd.tools.convert import load_checkpoint

    loaded = load_checkpoint(tmp_path / "evil.bin")
    assert type(loaded["evil"]).__module__.startswith("server.inert"), type(loaded["evil"])


def test_bad_checkpoints_name_the_problem(
    torch_state: dict[str, object], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = dict(torch_state)
    del broken["resnet.layer3.2.bn1.running_var"]
    torch.save(broken, tmp_path / "missing.bin")
    assert main(["convert", str(tmp_path / "missing.bin"), "--out", str(tmp_path / "a.safetensors")]) == 1
    assert "resnet.layer3.2.bn1.running_var" in capsys.readouterr().err

    reshaped = dict(torch_state)
    reshaped["resnet.seg_1.weight"] = torch.zeros(256, 2560)
    torch.save(reshaped, tmp_path / "shape.bin")
    assert main(["convert", str(tmp_path / "shape.bin"), "--out", str(tmp_path / "b.safetensors")]) == 1
    err = capsys.readouterr().err
    assert "resnet.seg_1.weight" in err and "(256, 5120)" in err, err

    (tmp_path / "junk.bin").write_bytes(b"not a checkpoint")
    assert main(["convert", str(tmp_path / "junk.bin"), "--out", str(tmp_path / "c.safetensors")]) == 1
    assert "junk.bin" in capsys.readouterr().err

    assert main(["convert", str(tmp_path / "absent.bin"), "--out", str(tmp_path / "d.safetensors")]) == 1
    assert "no such file" in capsys.readouterr().err
    assert not any(tmp_path.glob("*.safetensors")), "a failed conversion must not leave a file"
