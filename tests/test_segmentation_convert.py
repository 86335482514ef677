"""The segmentation model's checkpoint: converted without torch, refused in one line, found by name.

The checkpoints are the real segmentation-3.0 `pytorch_model.bin` (when
scripts/pyannote_segmentation.sh has extracted it) and pyannote's own `PyanNet` with
segmentation-3.0's hyper-parameters and random weights, saved as pyannote saves it (a
Lightning checkpoint), as a bare and a DataParallel state dict, in FP32 and FP16
(tests/pyannote_checkpoints.py). The torch-free conversion must write the bytes the
torch-based one writes (tests/torch_converter.py). `--segmentation-model` resolves a name as
`--model` does (tests/test_model_source.py): a local file or directory, a repo id served by
tests/hub_server.py on 127.0.0.1 or found in a hand-built hub cache, and every way the
weights cannot be had is one line. Skips without torch or pyannote.audio.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from speakerd.cli import main
from speakerd.model.segmentation.store import default_segmentation_name
from speakerd.model.source import (
    HUB_FILENAME,
    SEGMENTATION,
    SEGMENTATION_CONVERTED_DIR,
    ModelSource,
    resolve_model,
)
from speakerd.model.store import default_model_name
from speakerd.model.weights import file_sha256
from tests.hub_env import environment, one_line
from tests.hub_env import fetched as fetched_lines
from tests.hub_server import Hub, Repo, build_cache, commit_of
from tests.pyannote_checkpoints import (
    LAYOUTS,
    PRECISIONS,
    SEGMENTATION_CHECKPOINT,
    SEGMENTATION_MISSING,
    require_pyannote,
    save_checkpoint,
)

torch = require_pyannote()

from speakerd.model.segmentation.weights import NETWORK, load_state_dict  # noqa: E402
from tests.pyannote_checkpoints import random_pyannet, random_wespeaker  # noqa: E402

REPO = "pyannote/segmentation-3.0"
#: The token the test hub wants for its gated repo.
TOKEN = "hf_speakerd_test_token"
#: Environment variables of huggingface_hub and speakerd that each command gets fresh.


@pytest.fixture(scope="module")
def model():
    return random_pyannet(seed=2)


@pytest.fixture(scope="module")
def checkpoint(model, tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """pyannote's pytorch_model.bin for `model`, as pyannote writes it."""
    path = tmp_path_factory.mktemp("checkpoint") / HUB_FILENAME
    return save_checkpoint(model, path, "lightning").read_bytes()


def convert(source: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["convert", str(source), "--out", str(out), "--segmentation"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_same_bytes_as_the_torch_converter(
    model, tmp_path: Path, layout: str, precision: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.torch_converter import torch_convert

    source = save_checkpoint(model, tmp_path / HUB_FILENAME, layout, precision)
    torch_convert(source, tmp_path / "torch.safetensors", NETWORK)
    code, out, err = convert(source, tmp_path / "speakerd.safetensors", capsys)
    assert code == 0, err
    assert f"model id {file_sha256(tmp_path / 'speakerd.safetensors')}" in out
    assert (tmp_path / "speakerd.safetensors").read_bytes() == (tmp_path / "torch.safetensors").read_bytes()
    converted = load_state_dict(tmp_path / "speakerd.safetensors")
    for key, tensor in model.state_dict().items():
        expected = tensor.half().float() if precision == "fp16" else tensor
        np.testing.assert_array_equal(converted[key], expected.numpy(), err_msg=key)


def test_the_real_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """segmentation-3.0 itself (pyannote.audio 3.0's Lightning checkpoint): the same bytes."""
    if not SEGMENTATION_CHECKPOINT.is_file():
        pytest.skip(SEGMENTATION_MISSING)
    from tests.torch_converter import torch_convert

    torch_convert(SEGMENTATION_CHECKPOINT, tmp_path / "torch.safetensors", NETWORK)
    code, _, err = convert(SEGMENTATION_CHECKPOINT, tmp_path / "speakerd.safetensors", capsys)
    assert code == 0, err
    assert (tmp_path / "speakerd.safetensors").read_bytes() == (tmp_path / "torch.safetensors").read_bytes()


def _refused(source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    code, _, err = convert(source, tmp_path / "out.safetensors", capsys)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "out.safetensors").exists() and not any(tmp_path.glob(".out.safetensors.*"))
    print(f"\n{err.strip()}")
    return err


def test_bad_checkpoints_are_one_line(model, checkpoint: bytes, tmp_path: Path, capsys) -> None:
    embedding = save_checkpoint(random_wespeaker(seed=0), tmp_path / "embedding.bin", "lightning")
    err = _refused(embedding, tmp_path, capsys)
    assert "not pyannote's segmentation-3.0 (PyanNet): missing key 'classifier.bias' of shape (7,)" in err, (
        err
    )

    (tmp_path / "truncated.bin").write_bytes(checkpoint[: len(checkpoint) // 2])
    assert "truncated.bin: truncated or corrupt checkpoint" in _refused(
        tmp_path / "truncated.bin", tmp_path, capsys
    )

    state = model.state_dict()
    torch.save({**state, "classifier.weight": torch.zeros(4, 128)}, tmp_path / "multilabel.bin")
    err = _refused(tmp_path / "multilabel.bin", tmp_path, capsys)
    assert "'classifier.weight' has shape (4, 128), expected (7, 128)" in err, err

    two_layers = {key: value for key, value in state.items() if "_l2" not in key and "_l3" not in key}
    torch.save(two_layers, tmp_path / "two-layers.bin")
    err = _refused(tmp_path / "two-layers.bin", tmp_path, capsys)
    assert "missing key 'lstm.bias_hh_l2' of shape (512,) (16 missing in all)" in err, err


# ---------------------------------------------------------------------------------------
# --segmentation-model NAME_OR_PATH
# ---------------------------------------------------------------------------------------


def fetched(done: subprocess.CompletedProcess[str]) -> dict[str, str]:
    """fetch-model's `segmentation {weights,model id,source} ...` lines: {"weights": ..., ...}."""
    return fetched_lines(done, "segmentation", ("weights", "model id", "source"))


def fetch(spec: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "speakerd", "fetch-model", "--segmentation-model", spec]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def hub(checkpoint: bytes):
    commit = commit_of(REPO)
    server = Hub({REPO: Repo({HUB_FILENAME: checkpoint}, commit, {"main": commit}, "gated", TOKEN)})
    yield server
    server.close()


def test_by_name_from_the_hub_then_offline(checkpoint: bytes, hub: Hub, tmp_path: Path) -> None:
    online = environment(tmp_path, HF_ENDPOINT=hub.endpoint, HF_TOKEN=TOKEN)
    lines = fetched(fetch(REPO, online))
    commit, sha = commit_of(REPO), hashlib.sha256(checkpoint).hexdigest()
    folder = tmp_path / "hf" / "hub" / "models--pyannote--segmentation-3.0"
    converted = folder / SEGMENTATION_CONVERTED_DIR / f"{sha}.safetensors"
    assert lines["weights"] == str(converted) and lines["model id"] == file_sha256(converted), lines
    assert lines["source"] == f"{REPO}@{commit} {HUB_FILENAME} sha256 {sha}", lines
    asked, written = len(hub.requests), converted.stat().st_mtime_ns
    again = fetched(fetch(f"{REPO}@{commit}", {**online, "HF_HUB_OFFLINE": "1"}))
    assert again == lines and len(hub.requests) == asked and converted.stat().st_mtime_ns == written

    line = one_line(fetch(REPO, environment(tmp_path / "no-token", HF_ENDPOINT=hub.endpoint)))
    assert f"--segmentation-model {REPO}: {REPO} is gated" in line and "set HF_TOKEN" in line, line
    line = one_line(fetch(REPO, environment(tmp_path / "offline", HF_HUB_OFFLINE="1")))
    # fetch-model's own advice names what to do instead of fetch-model (a local checkpoint, a
    # machine that can reach the hub, the cache to copy), as for --model.
    assert f"--segmentation-model {REPO}: not in the Hugging Face cache" in line, line
    assert "give --segmentation-model a local copy instead (a pytorch_model.bin or its" in line, line
    assert "HF_HUB_OFFLINE" in line and "machine that can reach the hub" in line, line


def test_by_name_from_a_cache_and_locally(checkpoint: bytes, tmp_path: Path) -> None:
    commit = commit_of("a commit of the cache")
    build_cache(tmp_path / "hf" / "hub", REPO, HUB_FILENAME, checkpoint, commit)
    cached = fetched(fetch(REPO, environment(tmp_path, HF_HUB_OFFLINE="1")))
    assert cached["source"].startswith(f"{REPO}@{commit} "), cached
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / HUB_FILENAME).write_bytes(checkpoint)
    env = environment(tmp_path)
    local = fetched(fetch(str(tmp_path / "model"), env))
    assert Path(local["weights"]).parent == tmp_path / "speakerd" / SEGMENTATION_CONVERTED_DIR
    assert local["model id"] == cached["model id"] == fetched(fetch(local["weights"], env))["model id"]


def test_nothing_given_is_the_synthetic_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPEAKERD_CACHE", str(tmp_path))
    resolved = resolve_model(None, "--segmentation-model", SEGMENTATION)
    assert resolved.path == tmp_path / default_segmentation_name()
    expected = ModelSource(filename=resolved.path.name, sha256=file_sha256(resolved.path), synthetic=True)
    assert resolved.source == expected  # GetModelInfo and the client say it is synthetic
    assert default_model_name() != resolved.path.name  # the embedding model's default is another file


def test_the_embedding_model_is_not_a_segmentation_model(tmp_path: Path) -> None:
    """Both flags at once, each checked as its own network: the embedding model's checkpoint
    given as the segmentation model is refused, naming the first key it lacks."""
    source = save_checkpoint(random_wespeaker(seed=0), tmp_path / "wespeaker" / HUB_FILENAME, "lightning")
    env = environment(tmp_path)
    command = [sys.executable, "-m", "speakerd", "fetch-model", "--model", str(source),
               "--segmentation-model", str(source)]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    line = one_line(done)
    assert done.stdout.startswith("weights "), done.stdout  # --model took it: it is the embedding model
    assert line.startswith(
        f"fetch-model: --segmentation-model {source}: not pyannote's segmentation-3.0 (PyanNet) checkpoint: "
        "missing key 'classifier.bias' of shape (7,)"
    ), line
    assert line.endswith("give pyannote/segmentation-3.0's pytorch_model.bin"), line
