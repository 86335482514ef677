"""`--plda NAME_OR_PATH`: VBx's PLDA from a local directory or a hub repo's `plda/` folder.

community-1's real PLDA is in a gated repo no test can reach, so the PLDA is a random valid
one in pyannote's layout (tests/plda_files.py), served by tests/hub_server.py on 127.0.0.1
as pyannote/speaker-diarization-community-1's `plda/xvec_transform.npz` and `plda/plda.npz`
(gated: the test's token), or given as a local directory. `speakerd fetch-model --plda`
fetches it into the Hugging Face cache as pyannote's `PLDA.from_pretrained(repo,
subfolder="plda")` would and then finds it there offline, asking nothing; every way it
cannot be had is one line and exit 2, from fetch-model and from `serve` before it listens
(`SPEAKERD_PLDA` as well as the flag). A PLDA for embeddings of another size is refused at
start. No pyannote.audio needed; the server that uses the PLDA is tests/test_diarize_vbx.py's.
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import numpy as np
import pytest

from speakerd.model.diarization.plda import PLDA_FILE, TRANSFORM_FILE
from speakerd.model.source import PLDA_SUBFOLDER, ModelError, ModelSource, resolve_plda
from speakerd.serving.server import plda as server_plda
from speakerd.serving.server.config import UsageError
from tests.hub_env import environment, one_line, speakerd
from tests.hub_env import fetched as fetched_lines
from tests.hub_server import Hub, Repo, commit_of
from tests.plda_files import write_plda

REPO = "pyannote/speaker-diarization-community-1"
#: The token the test hub wants for its gated repo.
TOKEN = "hf_speakerd_test_token"
#: Environment variables of huggingface_hub and speakerd that each command gets fresh.
#: A PLDA for 512-dimensional embeddings (the served model's are 256), to community-1's 128.
WIDE_EMBEDDINGS = 512


@pytest.fixture(scope="module")
def plda_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_plda(tmp_path_factory.mktemp("community-1") / PLDA_SUBFOLDER, seed=3)


def plda_id(directory: Path) -> str:
    """What GetModelInfo and fetch-model call the PLDA: sha256 of both files, one after the other."""
    return hashlib.sha256(
        (directory / TRANSFORM_FILE).read_bytes() + (directory / PLDA_FILE).read_bytes()
    ).hexdigest()


@pytest.fixture(scope="module")
def hub(plda_dir: Path):
    transform, plda = (f"{PLDA_SUBFOLDER}/{name}" for name in (TRANSFORM_FILE, PLDA_FILE))
    files = {transform: (plda_dir / TRANSFORM_FILE).read_bytes(), plda: (plda_dir / PLDA_FILE).read_bytes()}
    repos = {}
    for name, held, access in (
        (REPO, {**files, "config.yaml": b"pipeline: {}\n"}, "gated"),
        ("acme/no-plda", {"README.md": b"# nothing here\n"}, "public"),
        ("acme/half-plda", {transform: files[transform]}, "public"),
    ):
        commit = commit_of(name)
        repos[name] = Repo(held, commit, {"main": commit}, access, TOKEN)
    server = Hub(repos)
    yield server
    server.close()


def fetched(done: subprocess.CompletedProcess[str]) -> dict[str, str]:
    """fetch-model's `plda {directory,id,source} ...` lines: {"directory": ..., ...}."""
    return fetched_lines(done, "plda", ("directory", "id", "source"))


def serve(env: dict[str, str], *flags: str) -> subprocess.CompletedProcess[str]:
    return speakerd("serve", "--engine", "cpu", "--port", "0", "--metrics-port", "0", *flags, env=env)


@pytest.mark.slow
def test_by_name_from_the_hub_then_offline(plda_dir: Path, hub: Hub, tmp_path: Path) -> None:
    """Both files in one snapshot's plda/ folder; offline, the same lines and no request."""
    online = environment(tmp_path, HF_ENDPOINT=hub.endpoint, HF_TOKEN=TOKEN)
    lines = fetched(speakerd("fetch-model", "--plda", REPO, env=online))
    commit = commit_of(REPO)
    folder = tmp_path / "hf" / "hub" / "models--pyannote--speaker-diarization-community-1"
    assert lines == {
        "directory": str(folder / "snapshots" / commit / PLDA_SUBFOLDER),
        "id": plda_id(plda_dir),
        "source": f"{REPO}@{commit} {PLDA_SUBFOLDER}",
    }, lines
    asked = len(hub.requests)
    assert any(f"/{REPO}/resolve/{commit}/{PLDA_SUBFOLDER}/{PLDA_FILE}" in r for r in hub.requests), (
        hub.requests
    )
    offline = {**online, "HF_HUB_OFFLINE": "1"}
    assert fetched(speakerd("fetch-model", "--plda", REPO, env=offline)) == lines
    assert fetched(speakerd("fetch-model", "--plda", f"{REPO}@{commit}", env=offline)) == lines
    assert len(hub.requests) == asked, hub.requests[asked:]


def test_gated_without_a_token(hub: Hub, tmp_path: Path) -> None:
    line = one_line(
        speakerd("fetch-model", "--plda", REPO, env=environment(tmp_path, HF_ENDPOINT=hub.endpoint))
    )
    assert f"--plda {REPO}: {REPO} is gated" in line and "set HF_TOKEN" in line, line


def test_a_repo_without_its_plda_files(hub: Hub, tmp_path: Path) -> None:
    env = environment(tmp_path, HF_ENDPOINT=hub.endpoint)
    line = one_line(speakerd("fetch-model", "--plda", "acme/no-plda", env=env))
    assert f"acme/no-plda has no {PLDA_SUBFOLDER}/{TRANSFORM_FILE} (404)" in line, line
    assert f"is it a pyannote pipeline with a PLDA, like {REPO}?" in line, line
    line = one_line(speakerd("fetch-model", "--plda", "acme/half-plda", env=env))
    commit = commit_of("acme/half-plda")
    assert f"acme/half-plda at revision {commit} has no {PLDA_SUBFOLDER}/{PLDA_FILE} (404)" in line, line


def test_serve_offline_and_not_cached_is_one_line(tmp_path: Path) -> None:
    """`serve --plda NAME` where the hub cannot be asked: one line before listening, saying
    what to run where the hub is reachable."""
    line = one_line(serve(environment(tmp_path, HF_HUB_OFFLINE="1"), "--plda", REPO))
    assert f"--plda {REPO}: not in the Hugging Face cache {tmp_path / 'hf' / 'hub'}" in line, line
    assert f"speakerd fetch-model --plda {REPO} on a machine that can reach the hub" in line, line


def test_serve_with_a_bad_plda_file_is_one_line(plda_dir: Path, tmp_path: Path) -> None:
    """From SPEAKERD_PLDA as from the flag: the line names the flag, the file, the array and
    what to give instead."""
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / TRANSFORM_FILE).write_bytes((plda_dir / TRANSFORM_FILE).read_bytes())
    with np.load(plda_dir / PLDA_FILE) as arrays:
        np.savez(bad / PLDA_FILE, mu=arrays["mu"], tr=arrays["tr"], psi=-arrays["psi"])
    line = one_line(serve(environment(tmp_path, SPEAKERD_PLDA=str(bad))))
    assert f"--plda {bad}: {bad / PLDA_FILE}: array 'psi' must be positive" in line, line
    assert f"give pyannote's PLDA: a directory holding {TRANSFORM_FILE} and {PLDA_FILE}" in line, line


def test_local_directory(plda_dir: Path, tmp_path: Path) -> None:
    """Used where it is; its id is both files' sha256; a file, a folder without them, a name
    that is neither a path nor a repo id: one line each."""
    resolved = resolve_plda(plda_dir)
    assert resolved.directory == plda_dir
    assert resolved.source == ModelSource(filename=PLDA_SUBFOLDER, sha256=plda_id(plda_dir))
    with pytest.raises(ModelError, match=r"--plda .*: not a directory; expected pyannote's plda folder"):
        resolve_plda(plda_dir / PLDA_FILE)
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / TRANSFORM_FILE).write_bytes(b"")
    with pytest.raises(ModelError, match=f"the directory holds no {PLDA_FILE} "):
        resolve_plda(tmp_path / "half")
    with pytest.raises(ModelError, match="no such directory, and not a Hugging Face repo id"):
        resolve_plda(tmp_path / "absent")


def test_a_plda_for_other_embeddings_is_refused(tmp_path: Path) -> None:
    """A valid PLDA whose LDA takes 512 dimensions, not the served model's 256."""
    wide = write_plda(tmp_path / "wide", seed=4, dim_in=WIDE_EMBEDDINGS)
    with pytest.raises(UsageError) as error:
        server_plda.prepare(str(wide))
    message = str(error.value)
    assert message.startswith(f"--plda {wide}: the PLDA transforms {WIDE_EMBEDDINGS}-dimensional "), message
    assert "\n" not in message and "the served model's are 256-dimensional" in message, message
