"""`--model NAME_OR_PATH`: the weights to serve, from a Hugging Face repo, a local file, or the default.

The same resolution serves both networks speakerd knows, each a `ModelKind`: EMBEDDING
(`--model`, pyannote/wespeaker-voxceleb-resnet34-LM) and SEGMENTATION (`--segmentation-model`,
pyannote/segmentation-3.0, speakerd/model/segmentation/); below, "the model" is either.

- nothing: the synthetic default model (store.py, segmentation/store.py), made on first use;
- a local `.safetensors` file: served as it is;
- a local `.bin` / `.ckpt` (pyannote's checkpoint; `.pt`, `.pth` too), or a directory holding
  pyannote's `pytorch_model.bin`: converted once, without torch (checkpoint.py);
- otherwise a Hugging Face repo id, `org/name` or `org/name@revision` (a branch, tag or commit
  hash): pyannote's `pytorch_model.bin` of that repo, fetched by huggingface_hub the way
  pyannote fetches it, so its cache, `HF_TOKEN`, `HF_HUB_OFFLINE`, `HF_ENDPOINT` and `HF_HOME`
  mean what they mean to pyannote.

A converted checkpoint is cached by the sha256 of the checkpoint's bytes: for a hub download
in the repo's own cache folder (`models--org--name/speakerd-converted-v1/`, next to `blobs/`
and `snapshots/`, so one volume holds both), for a local file in
`$SPEAKERD_CACHE/speakerd-converted-v1/`; each kind in its own folder (the segmentation
model's: `speakerd-converted-segmentation-v1/`), so a file converted as one network is never
served as the other.
It is written to a temporary file and renamed into place under a lock, so a restart or a
second replica (even one starting at the same moment) converts nothing and never reads a
half-written file. The served model id stays the sha256 of the safetensors file.

`--plda NAME_OR_PATH` (`resolve_plda`) names VBx's PLDA the same way: a local directory
holding pyannote's `xvec_transform.npz` and `plda.npz`, or a repo id whose `plda/` folder
holds them (pyannote/speaker-diarization-community-1), fetched as pyannote's
`PLDA.from_pretrained(repo, subfolder="plda")` fetches them. Nothing is converted: the
server reads the two files from the hub cache.

Every failure is a ModelError whose message is one line saying what to do. A hub that cannot
be reached is said at once: huggingface_hub, finding no cached copy after a failed request,
retries it five times over 23 s and logs two warnings each time, so a file that is not cached
is first asked for once, without retries (`_unreachable`), and only a hub that answered is
downloaded from.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import hashlib
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speakerd.model import checkpoint, torch_pickle
from speakerd.model.segmentation import weights as segmentation_weights
from speakerd.model.segmentation.store import default_segmentation_path
from speakerd.model.store import cache_dir, default_weights_path
from speakerd.model.weights import WeightsError, file_sha256

#: The checkpoint pyannote's `Model.from_pretrained` downloads from a repo.
HUB_FILENAME = "pytorch_model.bin"
#: What a repo without that checkpoint was expected to be (the end of the 404's line).
MODEL_REPO = "a pyannote model repo"
#: `org/name` or `org/name@revision` (huggingface_hub's repo id characters).
REPO_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")
#: Converted files' folder; the version is in the name so a future converter writing other
#: bytes never reuses an older one's output.
CONVERTED_DIR = "speakerd-converted-v1"
SEGMENTATION_CONVERTED_DIR = "speakerd-converted-segmentation-v1"
SAFETENSORS_SUFFIX = ".safetensors"
#: How the synthetic generators name their files (store.py, segmentation/store.py): a local
#: file so named is the synthetic model too (a test's or a copied cache's), and says so.
SYNTHETIC_NAME = re.compile(r"-synthetic-v\d+-seed\d+\.safetensors$")
#: A blob in the hub cache named by 64 hex digits is an LFS file named by its sha256.
SHA256_NAME = re.compile(r"^[0-9a-f]{64}$")
#: The HTTP clients under huggingface_hub (it has used each): they log every request at INFO.
HTTP_LOGGERS = ("httpx2", "httpx", "httpcore")
#: Read when --model is not given; SPEAKERD_WEIGHTS is its older name, read when it is unset.
MODEL_ENV = "SPEAKERD_MODEL"
WEIGHTS_ENV = "SPEAKERD_WEIGHTS"
MODEL_HELP = (
    "Hugging Face repo id (org/name[@revision]: its pytorch_model.bin) or a local .safetensors, .bin or "
    ".ckpt file or directory; --weights is the same flag (default: the synthetic test model, made on "
    "first use in $SPEAKERD_CACHE, ~/.cache/speakerd)"
)


#: Read when --segmentation-model is not given.
SEGMENTATION_MODEL_ENV = "SPEAKERD_SEGMENTATION_MODEL"
SEGMENTATION_MODEL_HELP = (
    "the segmentation model: Hugging Face repo id (org/name[@revision]: its pytorch_model.bin, e.g. "
    "pyannote/segmentation-3.0) or a local .safetensors, .bin or .ckpt file or directory (default: the "
    "synthetic segmentation model, made on first use in $SPEAKERD_CACHE, ~/.cache/speakerd)"
)


#: Read when --plda is not given.
PLDA_ENV = "SPEAKERD_PLDA"
PLDA_HELP = (
    "VBx's PLDA (Diarize's clustering.method vbx): a Hugging Face repo id (org/name[@revision]: its "
    "plda/ folder, e.g. pyannote/speaker-diarization-community-1) or a local directory holding pyannote's "
    "xvec_transform.npz and plda.npz (default: none, and VBx is unavailable)"
)
#: The folder of a pipeline repo that holds its PLDA: pyannote's
#: `PLDA.from_pretrained(repo, subfolder="plda")` reads its two files from there.
PLDA_SUBFOLDER = "plda"
#: Bytes read at a time while hashing the PLDA's files (community-1's are ~0.2 MB together).
HASH_BLOCK = 1 << 20
#: What a repo without those files was expected to be (the end of the 404's line).
PLDA_REPO = "a pyannote pipeline with a PLDA, like pyannote/speaker-diarization-community-1"


def env_model() -> str | None:
    """$SPEAKERD_MODEL, else $SPEAKERD_WEIGHTS, else None (the default model)."""
    return os.environ.get(MODEL_ENV) or os.environ.get(WEIGHTS_ENV) or None


def add_model_flag(parser: argparse.ArgumentParser) -> None:
    """`--model` (`--weights` is the same flag under its older name), defaulting to the environment."""
    parser.add_argument(
        "--model", "--weights", dest="model", default=env_model(), help=f"{MODEL_HELP} [{MODEL_ENV}]"
    )


def add_plda_flag(parser: argparse.ArgumentParser) -> None:
    """`--plda` (dest `plda`), defaulting to $SPEAKERD_PLDA."""
    parser.add_argument("--plda", default=os.environ.get(PLDA_ENV) or None, help=f"{PLDA_HELP} [{PLDA_ENV}]")


def add_segmentation_model_flag(parser: argparse.ArgumentParser) -> None:
    """`--segmentation-model` (dest `segmentation_model`), defaulting to $SPEAKERD_SEGMENTATION_MODEL."""
    parser.add_argument(
        "--segmentation-model",
        dest="segmentation_model",
        default=os.environ.get(SEGMENTATION_MODEL_ENV) or None,
        help=f"{SEGMENTATION_MODEL_HELP} [{SEGMENTATION_MODEL_ENV}]",
    )


class ModelError(ValueError):
    """The weights cannot be had; the message is one line naming what to do."""


@dataclass(frozen=True)
class ModelSource:
    """Where the served weights came from (GetModelInfo's `source`)."""

    repo_id: str = ""  # Hugging Face repo id; "" for a local file or the default model
    revision: str = ""  # the commit the file came from (40 hex digits); "" unless from a repo
    filename: str = ""  # the file read: "pytorch_model.bin", a local file's name
    sha256: str = ""  # of that file's bytes (before any conversion)
    synthetic: bool = False  # the built-in synthetic default (random weights, for trying the service)


@dataclass(frozen=True)
class ResolvedModel:
    path: Path  # the safetensors file to serve
    source: ModelSource


@dataclass(frozen=True)
class ModelKind:
    """One network a flag names: what its checkpoint must be, its synthetic default, and the
    folder its conversions are cached in."""

    network: checkpoint.Network
    default: Callable[[], Path]  # the synthetic default's safetensors, made on first use
    converted_dir: str


EMBEDDING = ModelKind(checkpoint.EMBEDDING, default_weights_path, CONVERTED_DIR)
SEGMENTATION = ModelKind(segmentation_weights.NETWORK, default_segmentation_path, SEGMENTATION_CONVERTED_DIR)


def resolve_model(
    spec: str | Path | None, flag: str = "--model", kind: ModelKind = EMBEDDING, fetching: bool = False
) -> ResolvedModel:
    """The safetensors of `kind` to serve for `spec` (see module doc); ModelError otherwise.
    `fetching`: the caller is `speakerd fetch-model`, so no error advises running it."""
    text = "" if spec is None else str(spec).strip()
    if not text:
        path = kind.default()
        return ResolvedModel(path, ModelSource(filename=path.name, sha256=file_sha256(path), synthetic=True))
    local = Path(text).expanduser()
    if local.exists():
        return _resolve_local(local, f"{flag} {text}", kind, fetching)
    match = REPO_ID.match(text)
    if match is None or text.startswith((".", "/", "~")):
        raise ModelError(
            f"{flag} {text}: no such file or directory, and not a Hugging Face repo id "
            "(org/name or org/name@revision)"
        )
    return _resolve_hub(match["repo"], match["revision"], f"{flag} {text}", kind, fetching)


def _resolve_local(path: Path, said: str, kind: ModelKind, fetching: bool) -> ResolvedModel:
    if path.is_dir():
        inside = path / HUB_FILENAME
        if not inside.is_file():
            raise ModelError(f"{said}: the directory holds no {HUB_FILENAME} (pyannote's checkpoint)")
        path = inside
    try:
        digest = file_sha256(path)
    except OSError as error:
        raise ModelError(f"{said}: cannot read it ({error.strerror})") from error
    source = ModelSource(filename=path.name, sha256=digest, synthetic=bool(SYNTHETIC_NAME.search(path.name)))
    if path.suffix == SAFETENSORS_SUFFIX:
        return ResolvedModel(path, source)
    if path.suffix not in checkpoint.CHECKPOINT_SUFFIXES:
        kinds = ", ".join((*checkpoint.CHECKPOINT_SUFFIXES, SAFETENSORS_SUFFIX))
        raise ModelError(f"{said}: expected a checkpoint or weights file ({kinds}) or a directory")
    return ResolvedModel(
        converted(path, digest, cache_dir() / kind.converted_dir, said, kind, fetching), source
    )


def converted(
    source: Path, digest: str, folder: Path, said: str, kind: ModelKind = EMBEDDING, fetching: bool = False
) -> Path:
    """The safetensors for checkpoint `source` (sha256 `digest`) in `folder`, converted as
    `kind` now unless a previous run (or another process, while we waited for the lock)
    already did."""
    target = folder / f"{digest}{SAFETENSORS_SUFFIX}"
    if target.is_file():
        return target
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"{digest}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if not target.is_file():
                checkpoint.convert(source, target, kind.network)
    except torch_pickle.CheckpointError as error:
        raise ModelError(f"{said}: {str(error).removeprefix(f'{source}: ')}") from error
    except WeightsError as error:
        raise ModelError(
            f"{said}: not pyannote's {kind.network.name} checkpoint: {error}; "
            f"give {kind.network.repo}'s {HUB_FILENAME}"
        ) from error
    except OSError as error:
        if error.errno == errno.ENOSPC:
            raise ModelError(
                f"{said}: no space left on the device of {folder} while writing the converted model "
                "(nothing was left half-written); free some space there and start again"
            ) from error
        if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            where = "" if fetching else f", or convert once where it is: {fetch_command(said)}"
            raise ModelError(
                f"{said}: cannot write the converted model into {folder} ({error.strerror}); make it "
                f"writable{where}"
            ) from error
        raise ModelError(f"{said}: cannot convert it ({error})") from error
    return target


def hub_cache_dir() -> Path:
    """huggingface_hub's cache ($HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _resolve_hub(
    repo_id: str, revision: str | None, said: str, kind: ModelKind, fetching: bool
) -> ResolvedModel:
    downloaded, digest = _download(repo_id, revision, HUB_FILENAME, said, fetching)
    # <cache>/models--org--name/snapshots/<commit>/pytorch_model.bin
    commit, repo_folder = downloaded.parent.name, downloaded.parent.parent.parent
    source = ModelSource(repo_id=repo_id, revision=commit, filename=HUB_FILENAME, sha256=digest)
    return ResolvedModel(
        converted(downloaded, digest, repo_folder / kind.converted_dir, said, kind, fetching), source
    )


def _download(
    repo_id: str,
    revision: str | None,
    filename: str,
    said: str,
    fetching: bool,
    subfolder: str = "",
    expected: str = MODEL_REPO,
) -> tuple[Path, str]:
    """`filename` (in the repo's `subfolder`) fetched by huggingface_hub as pyannote fetches
    it: (its path in the hub cache, its sha256); ModelError with one line otherwise.
    `expected` ends the line of a repo without that file (what kind of repo holds it)."""
    try:
        import huggingface_hub
    except ImportError as error:
        raise ModelError(
            f"{said}: a Hugging Face repo id needs huggingface_hub: pip install 'speakerd[server]'"
        ) from error
    from huggingface_hub import constants, errors
    from huggingface_hub.utils import logging as hub_logging

    for name in HTTP_LOGGERS:  # one INFO line per request otherwise, under serve's INFO logging
        logging.getLogger(name).setLevel(logging.WARNING)
    # huggingface_hub's logger has a handler of its own and also hands each line to the root
    # logger's, which serve configures: every warning would be printed twice
    hub_logging.disable_propagation()
    in_repo = f"{subfolder}/{filename}" if subfolder else filename
    try:
        unreachable = _unreachable(repo_id, revision, constants, in_repo)
        if unreachable is not None:
            raise errors.LocalEntryNotFoundError(f"{constants.ENDPOINT} unreachable") from unreachable
        fetched = huggingface_hub.hf_hub_download(
            repo_id, filename, subfolder=subfolder or None, revision=revision, library_name="speakerd",
            library_version=_version(),
        )  # fmt: skip
        downloaded = Path(fetched)
    except Exception as error:
        raise ModelError(
            _hub_error(error, repo_id, revision, said, constants, fetching, in_repo, expected)
        ) from error
    try:
        digest = file_sha256(downloaded)
    except OSError as error:
        raise ModelError(f"{said}: cannot read {downloaded} ({error.strerror})") from error
    blob = downloaded.resolve()
    if SHA256_NAME.match(blob.name) and blob.name != digest:
        raise ModelError(
            f"{said}: the cached {in_repo} is truncated or corrupt (sha256 {digest[:12]}..., "
            f"the hub's is {blob.name[:12]}...): delete {blob} and start again to download it anew"
        )
    return downloaded, digest


@dataclass(frozen=True)
class ResolvedPlda:
    """Where a PLDA's two files are, and where they came from.

    source.sha256 is the PLDA's id: the sha256 of xvec_transform.npz's bytes followed by
    plda.npz's (`cat xvec_transform.npz plda.npz | sha256sum`); source.filename is the folder
    read ("plda" in a repo, a local directory's name)."""

    directory: Path  # holding xvec_transform.npz and plda.npz
    source: ModelSource

    @property
    def plda_id(self) -> str:
        return self.source.sha256


def resolve_plda(spec: str | Path, flag: str = "--plda", fetching: bool = False) -> ResolvedPlda:
    """The directory of pyannote's PLDA files for `spec`: a local directory holding them, or
    a repo id (`org/name[@revision]`) whose `plda/` folder holds them, fetched by
    huggingface_hub as pyannote's `PLDA.from_pretrained(repo, subfolder="plda")` fetches them
    (the same cache, HF_TOKEN, HF_HUB_OFFLINE, HF_ENDPOINT). Both files land in one snapshot,
    `.../snapshots/<commit>/plda/`: the second is asked for at the commit the first came
    from. ModelError with one line otherwise; whether the files are a usable PLDA is
    `load_plda`'s to say (speakerd.model.diarization.plda)."""
    # here, not at the top: the diarization package brings SciPy, which `--model` never needs
    from speakerd.model.diarization.plda import PLDA_FILE, TRANSFORM_FILE

    files = (TRANSFORM_FILE, PLDA_FILE)
    text = str(spec).strip()
    said = f"{flag} {text}"
    local = Path(text).expanduser()
    if text and local.exists():
        if not local.is_dir():
            raise ModelError(
                f"{said}: not a directory; expected pyannote's plda folder, holding {TRANSFORM_FILE} and "
                f"{PLDA_FILE}"
            )
        missing = [name for name in files if not (local / name).is_file()]
        if missing:
            raise ModelError(
                f"{said}: the directory holds no {' and no '.join(missing)} (pyannote's PLDA is "
                f"{TRANSFORM_FILE} and {PLDA_FILE}, the {PLDA_SUBFOLDER}/ folder of "
                "pyannote/speaker-diarization-community-1)"
            )
        return ResolvedPlda(local, ModelSource(filename=local.name, sha256=_files_sha256(local, files, said)))
    match = REPO_ID.match(text)
    if match is None or text.startswith((".", "/", "~")):
        raise ModelError(
            f"{said}: no such directory, and not a Hugging Face repo id (org/name or org/name@revision)"
        )
    repo_id, folder = match["repo"], PLDA_SUBFOLDER
    first, _ = _download(repo_id, match["revision"], TRANSFORM_FILE, said, fetching, folder, PLDA_REPO)
    # <cache>/models--org--name/snapshots/<commit>/plda/xvec_transform.npz
    directory = first.parent
    commit = directory.parent.name
    _download(repo_id, commit, PLDA_FILE, said, fetching, folder, PLDA_REPO)
    source = ModelSource(repo_id, commit, folder, _files_sha256(directory, files, said))
    return ResolvedPlda(directory, source)


def _files_sha256(directory: Path, names: tuple[str, ...], said: str) -> str:
    """The sha256 of the files' bytes, one after the other (ResolvedPlda's id)."""
    digest = hashlib.sha256()
    for name in names:
        try:
            with open(directory / name, "rb") as handle:
                while block := handle.read(HASH_BLOCK):
                    digest.update(block)
        except OSError as error:
            raise ModelError(f"{said}: cannot read {directory / name} ({error.strerror})") from error
    return digest.hexdigest()


def _unreachable(
    repo_id: str, revision: str | None, constants: Any, filename: str = HUB_FILENAME
) -> Exception | None:
    """Why the hub cannot be asked for `filename` (its path in the repo), when it is not
    cached and one request without retries gets no answer; None when it is cached
    (huggingface_hub falls back to that copy without retrying), offline (nothing is asked),
    or the hub answered (hf_hub_download then asks again and says what the answer means).
    One more HEAD request, only before a download."""
    from huggingface_hub import errors, get_hf_file_metadata, hf_hub_url, try_to_load_from_cache

    if constants.HF_HUB_OFFLINE:
        return None
    if isinstance(try_to_load_from_cache(repo_id, filename, revision=revision), str):
        return None
    url = hf_hub_url(repo_id, filename, revision=revision)
    try:
        get_hf_file_metadata(
            url, timeout=constants.HF_HUB_ETAG_TIMEOUT, library_name="speakerd", library_version=_version()
        )
    except errors.HfHubHTTPError:
        return None  # an answer: gated, private, no such repo, a 5xx worth retrying
    except ValueError:
        return None  # a repo id or revision huggingface_hub refuses: hf_hub_download says so
    except Exception as error:  # no answer: refused, timed out, no route, TLS, proxy
        return error
    return None


def _version() -> str:
    """speakerd's version, for the hub's user agent."""
    from importlib import metadata

    try:
        return metadata.version("speakerd")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def fetch_command(said: str) -> str:
    """The command that fills the caches for `said` ("--model NAME", "--segmentation-model
    NAME"), wherever the hub is reachable."""
    return f"speakerd fetch-model {said}"


def _fill_elsewhere(said: str, cache: str, fetching: bool) -> str:
    """How to get the checkpoint here from a machine that can reach the hub (fetch-model
    itself is not told to run fetch-model)."""
    how = "run this" if fetching else f"run {fetch_command(said)}"
    return f"{how} on a machine that can reach the hub, then copy its Hugging Face cache into {cache}"


def _hub_error(
    error: Exception,
    repo_id: str,
    revision: str | None,
    said: str,
    constants: Any,
    fetching: bool = False,
    filename: str = HUB_FILENAME,
    expected: str = MODEL_REPO,
) -> str:
    """One line saying what to do about huggingface_hub's `error` while fetching `filename`
    (its path in the repo); `expected` says what kind of repo holds it."""
    from huggingface_hub import errors

    endpoint = constants.ENDPOINT
    at = f" at revision {revision}" if revision else ""
    if isinstance(error, errors.LocalEntryNotFoundError) and isinstance(
        error.__cause__, errors.HfHubHTTPError
    ):
        error = error.__cause__  # an answer the hub gave (a 403 without an error code, a 5xx): say it
    status = getattr(getattr(error, "response", None), "status_code", None)
    if isinstance(error, errors.GatedRepoError):
        return (
            f"{said}: {repo_id} is gated: accept its conditions at {endpoint}/{repo_id} and set HF_TOKEN "
            "to a token of that account"
        )
    if isinstance(error, errors.HfHubHTTPError) and status in (401, 403):
        token = "HF_TOKEN was not accepted" if os.environ.get("HF_TOKEN") else "no HF_TOKEN is set"
        return (
            f"{said}: the hub refused access to {repo_id} ({status}, {token}): set HF_TOKEN to a token "
            "that can read it, or check the repo id"
        )
    if isinstance(error, errors.RevisionNotFoundError):
        return f"{said}: {repo_id} has no revision {revision!r} on {endpoint}: give a branch, tag or commit"
    if isinstance(error, errors.RepositoryNotFoundError):
        return f"{said}: no model repo {repo_id} on {endpoint} (404): check the repo id"
    if isinstance(error, errors.RemoteEntryNotFoundError):
        return f"{said}: {repo_id}{at} has no {filename} (404): is it {expected}?"
    if isinstance(error, errors.LocalEntryNotFoundError):
        cache = constants.HF_HUB_CACHE
        if constants.HF_HUB_OFFLINE:
            folder, _, name = filename.rpartition("/")
            local = f"its {folder}/ folder" if folder else f"a {name} or its directory"
            return (
                f"{said}: not in the Hugging Face cache {cache} and HF_HUB_OFFLINE is set: unset it if the "
                f"hub is reachable from here, give {said.split()[0]} a local copy instead ({local}), or "
                f"{_fill_elsewhere(said, cache, fetching)}"
            )
        cause = error.__cause__ or error.__context__
        reason = f" ({type(cause).__name__})" if cause is not None else ""
        return (
            f"{said}: cannot reach {endpoint}{reason} and it is not in the Hugging Face cache {cache}: "
            f"check the network or HF_ENDPOINT, or {_fill_elsewhere(said, cache, fetching)} and set "
            "HF_HUB_OFFLINE=1 here"
        )
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        return f"{said}: no space left on the device of {constants.HF_HUB_CACHE} while downloading: free some"
    if isinstance(error, ValueError):  # huggingface_hub's validation of the repo id or revision
        return f"{said}: {str(error).splitlines()[0]}"
    return f"{said}: cannot download {filename} of {repo_id}{at} ({type(error).__name__}: {error})".split(
        "\n"
    )[0]
