"""`--model NAME_OR_PATH`: pyannote's checkpoint by repo id or path, converted without torch, served.

The checkpoint is pyannote.audio's own `WeSpeakerResNet34` with random weights, saved as
pyannote saves it (a Lightning checkpoint, tests/pyannote_checkpoints.py). No hub is
reachable here, so it is either served by tests/hub_server.py on 127.0.0.1 (the hub's file
API; `HF_ENDPOINT` points there) or placed in a huggingface_hub cache layout the test builds
(`HF_HUB_OFFLINE=1`). `serve --model` resolves it both ways, converts it, serves it, and its
embeddings equal pyannote's own model's on the same weights (cosine >= 0.99999, FP32).
Every way the weights cannot be had is one line on stderr and exit code 2.
Skips without torch or pyannote.audio (.ci/run installs both).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from speakerd.cli import main as speakerd_main
from speakerd.model.numerics import BOUNDS, Math, compare
from speakerd.model.source import CONVERTED_DIR, HUB_FILENAME
from speakerd.model.weights import file_sha256
from tests.hub_env import HUB_ENV, environment, speakerd
from tests.hub_server import Hub, Repo, build_cache, commit_of
from tests.pyannote_checkpoints import PYANNOTE_MISSING, TORCH_MISSING, random_wespeaker, save_checkpoint
from tests.serving import ServerProcess, start_server

torch = pytest.importorskip("torch", reason=TORCH_MISSING)
pytest.importorskip("pyannote.audio", reason=PYANNOTE_MISSING)

REPO = "pyannote/wespeaker-voxceleb-resnet34-LM"
#: The token the test hub wants for its gated and private repos.
TOKEN = "hf_speakerd_test_token"
#: One plan keeps each CPU server's start (plan build, self-check) short.
PLANS = "1"
#: An endpoint nothing listens on: every connection is refused at once.
UNREACHABLE = "http://127.0.0.1:1"
#: How long `serve` may take to say the hub is unreachable: its start-up and one refused
#: request on 2 busy cores. huggingface_hub's own retries alone sleep 23 s (1+2+4+8+8).
UNREACHABLE_S = 15.0
#: pyannote's forward on one thread: on 2 busy cores a second one spins more than it computes
#: (measured: 11 CPU-s on 2 threads, 5.5 on one, in the same wall time).
TORCH_THREADS = 1


@pytest.fixture(scope="module")
def model():
    return random_wespeaker(seed=1)


@pytest.fixture(scope="module")
def checkpoint(model, tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """pyannote's pytorch_model.bin for `model`, as pyannote writes it."""
    return save_checkpoint(
        model, tmp_path_factory.mktemp("checkpoint") / HUB_FILENAME, "lightning"
    ).read_bytes()


@pytest.fixture(scope="module")
def other_architecture(model, tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A checkpoint of another network: the same tree with layer4's last block missing."""
    state = {
        key: value for key, value in model.state_dict().items() if not key.startswith("resnet.layer4.2.")
    }
    path = tmp_path_factory.mktemp("other") / HUB_FILENAME
    torch.save(state, path)
    return path.read_bytes()


@pytest.fixture(scope="module")
def hub(checkpoint: bytes, other_architecture: bytes):
    def repo(name: str, files: dict[str, bytes], access: str = "public") -> tuple[str, Repo]:
        commit = commit_of(name)
        return name, Repo(files, commit, {"main": commit}, access, TOKEN)

    server = Hub(
        dict(
            [
                repo(REPO, {HUB_FILENAME: checkpoint}, access="gated"),
                repo("acme/private-model", {HUB_FILENAME: checkpoint}, access="private"),
                repo("acme/no-checkpoint", {"README.md": b"# nothing here\n"}),
                repo("acme/other-architecture", {HUB_FILENAME: other_architecture}),
            ]
        )
    )
    yield server
    server.close()


def serve_error(model: str, env: dict[str, str]) -> str:
    """`serve --model MODEL`'s one line on stderr; asserts exit code 2 and no traceback."""
    done = speakerd(
        "serve", "--engine", "cpu", "--port", "0", "--metrics-port", "0", "--model", model, env=env
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    print(f"\n{lines[0]}")
    return lines[0]


def started(model: str, env: dict[str, str]) -> ServerProcess:
    previous = {key: os.environ.get(key) for key in env}
    os.environ.update(env)  # start_server's subprocess inherits this process's environment
    try:
        return start_server(model, "--plans", PLANS)  # type: ignore[arg-type]  # --weights is --model
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        for key in set(env) - set(previous):
            os.environ.pop(key, None)


def waveform_and_masks() -> tuple[np.ndarray, np.ndarray]:
    """Two 10 s chunks of pyannote's sample.wav and three speakers' masks each (589 frames)."""
    import soundfile

    from speakerd.pyannote import models

    samples, _ = soundfile.read(str(models.sample_path()), dtype="float32")
    waveform = np.stack([samples[:160_000], samples[160_000:320_000]])
    rng = np.random.default_rng(7)
    masks = np.ones((2, 3, 589), dtype=np.float32)
    masks[:, 1, 300:] = 0
    masks[:, 2] = rng.random((2, 589)) < 0.4
    return waveform, masks


def pyannote_embeddings(model, waveform: np.ndarray, masks: np.ndarray) -> np.ndarray:
    """pyannote's own model, one (chunk, speaker) pair at a time, as its pipeline runs it."""
    with torch.no_grad():
        rows = [
            model(torch.from_numpy(waveform[:, None]), weights=torch.from_numpy(masks[:, speaker])).numpy()
            for speaker in range(masks.shape[1])
        ]
    return np.stack(rows, axis=1)


@pytest.fixture(scope="module")
def expected(model) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The waveform, its masks and pyannote's own model's embeddings of them: the same for
    every server of `model`'s checkpoint, so computed once, on TORCH_THREADS."""
    waveform, masks = waveform_and_masks()
    threads = torch.get_num_threads()
    torch.set_num_threads(TORCH_THREADS)
    try:
        return waveform, masks, pyannote_embeddings(model, waveform, masks)
    finally:
        torch.set_num_threads(threads)


def check_serves_pyannote(server: ServerProcess, expected, checkpoint: bytes, commit: str, case: str) -> str:
    """GetModelInfo names the source; the embeddings are pyannote's. Returns the model id."""
    waveform, masks, rows = expected
    with server.client() as client:
        info = client.model_info()
        served = client.embed_waveform(waveform, masks)
    source = info.source
    assert (source.repo_id, source.revision, source.filename) == (REPO, commit, HUB_FILENAME), source
    assert source.sha256 == hashlib.sha256(checkpoint).hexdigest(), source
    assert served.model_id == info.model_id and len(info.model_id) == 64
    parity = compare(served.embeddings, rows)
    print(f"\n{'case':<34}{'rows':>6}{'min cosine':>14}{'max abs':>11}")
    print(f"{case:<34}{parity.rows:>6}{parity.min_cosine:>14.9f}{parity.max_abs:>11.2e}")
    assert parity.min_cosine >= BOUNDS[Math.FP32].min_cosine, parity
    return info.model_id


@pytest.mark.slow
def test_serve_by_name_from_the_hub_then_offline(
    expected, checkpoint: bytes, hub: Hub, tmp_path: Path
) -> None:
    commit = commit_of(REPO)
    online = environment(tmp_path, HF_ENDPOINT=hub.endpoint, HF_TOKEN=TOKEN)
    server = started(REPO, online)
    try:
        model_id = check_serves_pyannote(
            server, expected, checkpoint, commit, "hub on 127.0.0.1 (HF_ENDPOINT)"
        )
    finally:
        assert server.terminate() == 0, server.log()
    repo_folder = tmp_path / "hf" / "hub" / "models--pyannote--wespeaker-voxceleb-resnet34-LM"
    sha = hashlib.sha256(checkpoint).hexdigest()
    converted = repo_folder / CONVERTED_DIR / f"{sha}.safetensors"
    assert file_sha256(converted) == model_id, "the served model id is the converted file's sha256"
    assert (repo_folder / "snapshots" / commit / HUB_FILENAME).is_file()

    # a restart, offline and pinned to the commit: nothing downloaded, nothing converted again
    asked, written = len(hub.requests), converted.stat().st_mtime_ns
    done = speakerd("fetch-model", "--model", f"{REPO}@{commit}", env={**online, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr
    assert f"model id {model_id}" in done.stdout and f"source {REPO}@{commit}" in done.stdout, done.stdout
    assert len(hub.requests) == asked and converted.stat().st_mtime_ns == written


@pytest.mark.slow
def test_serve_by_name_from_a_cache_it_did_not_fill(expected, checkpoint: bytes, tmp_path: Path) -> None:
    commit = commit_of("a commit of the cache")
    build_cache(tmp_path / "hf" / "hub", REPO, HUB_FILENAME, checkpoint, commit)
    server = started(REPO, environment(tmp_path, HF_HUB_OFFLINE="1"))
    try:
        check_serves_pyannote(server, expected, checkpoint, commit, "hand-built cache (HF_HUB_OFFLINE)")
    finally:
        assert server.terminate() == 0, server.log()


def test_local_checkpoint_and_directory(
    checkpoint: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A local pytorch_model.bin, its directory and the converted .safetensors are one model.
    fetch-model runs in this process, in the environment a subprocess would get: what is
    checked is how paths resolve, not the process (test_two_processes_convert_at_once runs it
    as one)."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / HUB_FILENAME).write_bytes(checkpoint)
    for key in HUB_ENV:
        monkeypatch.delenv(key, raising=False)
    for key, value in environment(tmp_path).items():
        monkeypatch.setenv(key, value)

    def fetch(model: Path) -> list[str]:
        assert speakerd_main(["fetch-model", "--model", str(model)]) == 0
        return capsys.readouterr().out.splitlines()

    ids = set()
    for given in (tmp_path / "model" / HUB_FILENAME, tmp_path / "model"):
        stdout = fetch(given)
        ids.add(next(line for line in stdout if line.startswith("model id")))
        weights = Path(stdout[0].removeprefix("weights "))
    assert weights.parent == tmp_path / "speakerd" / CONVERTED_DIR
    ids.add(next(line for line in fetch(weights) if line.startswith("model id")))
    assert len(ids) == 1, ids


def test_two_processes_convert_at_once(checkpoint: bytes, tmp_path: Path) -> None:
    """Two replicas starting together on one cache: both get the whole file, made once."""
    source = tmp_path / HUB_FILENAME
    source.write_bytes(checkpoint)
    env = environment(tmp_path)
    command = [sys.executable, "-m", "speakerd", "fetch-model", "--model", str(source)]
    runs = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]  # fmt: skip
    outputs = [run.communicate(timeout=300) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs
    assert outputs[0][0] == outputs[1][0], outputs
    folder = tmp_path / "speakerd" / CONVERTED_DIR
    sha = hashlib.sha256(checkpoint).hexdigest()
    assert sorted(path.name for path in folder.iterdir()) == [f"{sha}.lock", f"{sha}.safetensors"]
    from tests.torch_converter import torch_convert

    torch_convert(source, tmp_path / "torch.safetensors")
    assert (folder / f"{sha}.safetensors").read_bytes() == (tmp_path / "torch.safetensors").read_bytes()


# ---------------------------------------------------------------------------------------
# Each way the weights cannot be had: one line, exit code 2
# ---------------------------------------------------------------------------------------


def test_offline_and_not_cached(tmp_path: Path) -> None:
    line = serve_error(REPO, environment(tmp_path, HF_HUB_OFFLINE="1"))
    assert f"not in the Hugging Face cache {tmp_path / 'hf' / 'hub'}" in line, line
    assert f"speakerd fetch-model --model {REPO}" in line and "HF_HUB_OFFLINE" in line, line


def test_unreachable_hub_is_one_line_at_once(tmp_path: Path) -> None:
    """No hub and no cache: one line within seconds (before, 24 lines over 24 s: each of
    huggingface_hub's retry warnings twice), saying what to do on a machine without the hub;
    fetch-model's advice does not tell it to run fetch-model."""
    env = environment(tmp_path, HF_ENDPOINT=UNREACHABLE)
    started_at = time.monotonic()
    line = serve_error(REPO, env)
    elapsed = time.monotonic() - started_at
    assert elapsed < UNREACHABLE_S, f"{elapsed:.1f} s to say the hub is unreachable"
    assert f"cannot reach {UNREACHABLE} (ConnectError)" in line, line
    assert f"speakerd fetch-model --model {REPO} on a machine that can reach the hub" in line, line
    assert "HF_HUB_OFFLINE=1" in line, line
    done = speakerd("fetch-model", "--model", REPO, env=env)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    cache = tmp_path / "hf" / "hub"
    assert f"copy its Hugging Face cache into {cache}" in done.stderr, done.stderr
    assert "HF_HUB_OFFLINE=1" in done.stderr and "fetch-model --model" not in done.stderr, done.stderr


def test_gated_without_token(hub: Hub, tmp_path: Path) -> None:
    line = serve_error(REPO, environment(tmp_path, HF_ENDPOINT=hub.endpoint))
    assert f"{REPO} is gated" in line and "set HF_TOKEN" in line, line


def test_private_without_and_with_a_wrong_token(hub: Hub, tmp_path: Path) -> None:
    line = serve_error("acme/private-model", environment(tmp_path, HF_ENDPOINT=hub.endpoint))
    assert "refused access to acme/private-model (401, no HF_TOKEN is set): set HF_TOKEN" in line, line
    line = serve_error("acme/private-model", environment(tmp_path, HF_ENDPOINT=hub.endpoint, HF_TOKEN="hf_x"))
    assert "(403, HF_TOKEN was not accepted): set HF_TOKEN" in line, line


@pytest.mark.slow
def test_no_such_repo_revision_or_file(hub: Hub, tmp_path: Path) -> None:
    env = environment(tmp_path, HF_ENDPOINT=hub.endpoint)
    assert "no model repo acme/absent" in serve_error("acme/absent", env)
    line = serve_error("acme/no-checkpoint@v9", env)
    assert "acme/no-checkpoint has no revision 'v9'" in line, line
    line = serve_error("acme/no-checkpoint", env)
    assert f"acme/no-checkpoint has no {HUB_FILENAME} (404)" in line, line


def test_not_this_architecture(hub: Hub, tmp_path: Path) -> None:
    line = serve_error("acme/other-architecture", environment(tmp_path, HF_ENDPOINT=hub.endpoint))
    assert (
        "not pyannote's WeSpeaker ResNet34 checkpoint: missing key 'resnet.layer4.2.bn1.bias' of shape (256,)"
        in (line)
    ), line


def test_truncated_download_and_file(checkpoint: bytes, tmp_path: Path) -> None:
    blob = build_cache(tmp_path / "hf" / "hub", REPO, HUB_FILENAME, checkpoint, commit_of(REPO))
    blob.write_bytes(checkpoint[: len(checkpoint) // 3])  # a download cut short
    line = serve_error(REPO, environment(tmp_path, HF_HUB_OFFLINE="1"))
    assert f"the cached {HUB_FILENAME} is truncated or corrupt" in line and f"delete {blob}" in line, line
    local = tmp_path / "cut.bin"
    local.write_bytes(checkpoint[: len(checkpoint) // 3])
    line = serve_error(str(local), environment(tmp_path))
    assert f"--model {local}: truncated or corrupt checkpoint" in line, line


class RunsCode:
    """Unpickling this calls os.system: a reader that runs pickled code would create MARKER."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickled_code_is_refused(model, tmp_path: Path) -> None:
    marker = tmp_path / "code-ran"
    torch.save({"state_dict": model.state_dict(), "callbacks": RunsCode(marker)}, tmp_path / "evil.bin")
    line = serve_error(str(tmp_path / "evil.bin"), environment(tmp_path))
    assert "asks for posix.system" in line and "refused, nothing in the file was run" in line, line
    assert not marker.exists()


def test_disk_full_while_caching(checkpoint: bytes, tmp_path: Path) -> None:
    """The converted model (26.6 MB) does not fit a 4 MiB tmpfs: one line, nothing left half-written.
    The tmpfs is mounted in a private user and mount namespace (unshare), gone when it exits."""
    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "-Urm", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs unshare -Urm (user and mount namespaces) for a small tmpfs")
    source = tmp_path / HUB_FILENAME
    source.write_bytes(checkpoint)
    cache = tmp_path / "small"
    cache.mkdir()
    script = (
        f'mount -t tmpfs -o size=4m tmpfs "{cache}" && '
        f'"{sys.executable}" -m speakerd serve --engine cpu --port 0 --metrics-port 0 --model "{source}"; '
        f'echo "exit $?"; ls -A "{cache}/{CONVERTED_DIR}"'
    )
    env = environment(tmp_path, SPEAKERD_CACHE=str(cache))
    done = subprocess.run([unshare, "-Urm", "sh", "-c", script], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    lines = done.stderr.strip().splitlines()
    print(f"\n{lines[-1] if lines else ''}")
    assert len(lines) == 1 and "no space left on the device" in lines[0], done.stderr
    assert "nothing was left half-written" in lines[0]
    left = done.stdout.split()
    assert left[:2] == ["exit", "2"], done.stdout
    assert all(name.endswith(".lock") for name in left[2:]), f"left behind: {left[2:]}"
