"""What a server's start-up chose on its GPU, kept on disk: the next start builds only that.

A GPU engine's start-up times every candidate for every convolution of every plan (cuDNN's
execution plans, fused graphs, our kernels) and keeps the fastest (engine/gpu/autotune.py):
most of a fresh start's minutes. The choices hold only for the GPU, driver and libraries
that timed them, and for the model, math, plan sizes and kernel sources they were timed
with: `BuildKey` names all of it, and an entry is used only under an equal key. Entries
are small JSON files in `$SPEAKERD_CACHE/builds/`, one per key (its digest is the name):

- A start whose key has no entry builds everything and stores what it chose; `load` says in
  one line why nothing was used: nothing cached, or which fields differ from the entry
  closest to this key (a new driver, another model).
- An entry is written to a temporary file beside it and renamed into place, so a reader
  sees a whole file or none, and two servers storing at once leave one of their whole files.
- An entry carries the SHA-256 of its choices: a truncated, edited or otherwise corrupt
  file is never trusted; `load` says so, removes it and the start builds afresh.

What the entries hold is the caller's (a JSON object); this module only keeps it valid.
A cached choice is still proven on the GPU before serving: the start-up self-check runs on
every start, cached or not.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: The cache's folder in the server's cache directory ($SPEAKERD_CACHE), unless
#: $SPEAKERD_BUILD_CACHE names another (serving/server/caches.py sets it for serve and warm).
BUILDS_DIR = "builds"
BUILD_CACHE_VARIABLE = "SPEAKERD_BUILD_CACHE"
#: The entries' layout; an entry of another format is not read (and is replaced on store).
FORMAT = "speakerd.build/1"
#: Hex digits of the key's SHA-256 in an entry's file name: 128 bits, no collision in practice
#: (and `load` compares the whole key anyway).
NAME_DIGITS = 32
#: An entry's file name: the key's digest and this suffix.
SUFFIX = ".json"


@dataclass(frozen=True)
class BuildKey:
    """Everything that makes a start-up's choices valid; equal keys, same choices.

    gpu and compute_capability: the device (its name and major.minor); driver, cuda,
    cudnn, cudnn_frontend: the versions that ran and built the kernels; model_id and
    math: what the plans compute; plan_sizes: the batch sizes built; conv_kernels: which
    candidates may run (`--conv-kernels`); kernel_sources: `sources_digest` of the
    project's CUDA sources; speakerd: the package version (its own choosing code)."""

    gpu: str
    compute_capability: str
    driver: str
    cuda: str
    cudnn: str
    cudnn_frontend: str
    model_id: str
    math: str
    plan_sizes: tuple[int, ...]
    conv_kernels: str
    kernel_sources: str
    speakerd: str

    def fields(self) -> dict[str, Any]:
        """The key as JSON values (plan sizes as a list)."""
        values = dataclasses.asdict(self)
        values["plan_sizes"] = list(self.plan_sizes)
        return values

    def digest(self) -> str:
        """SHA-256 of the key's canonical JSON, NAME_DIGITS hex digits: the entry's name."""
        return _sha256(self.fields())[:NAME_DIGITS]

    @classmethod
    def from_fields(cls, values: Mapping[str, Any]) -> BuildKey:
        """The key `fields` gave; KeyError or TypeError when it is not one."""
        names = {f.name for f in dataclasses.fields(cls)}
        if set(values) != names:
            raise KeyError(f"key fields {sorted(values)}, expected {sorted(names)}")
        return cls(**{**values, "plan_sizes": tuple(values["plan_sizes"])})


def sources_digest(sources: Iterable[tuple[str, bytes]]) -> str:
    """SHA-256 of (name, content) pairs, in name order: a changed, added or removed source
    changes it."""
    digest = hashlib.sha256()
    for name, content in sorted(sources):
        digest.update(name.encode() + b"\0" + hashlib.sha256(content).digest())
    return digest.hexdigest()


def _sha256(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True)
class Loaded:
    """What `load` found: the entries (None: build afresh) and, then, why in one line."""

    entries: dict[str, Any] | None
    why: str


class BuildCache:
    """Start-up choices on disk, one JSON file per BuildKey under `directory`."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def path(self, key: BuildKey) -> Path:
        return self.directory / f"{key.digest()}{SUFFIX}"

    def load(self, key: BuildKey) -> Loaded:
        """The entries stored under `key`, or None with why they cannot be used (logged once,
        at INFO; a corrupt entry at WARNING, and removed)."""
        path = self.path(key)
        try:
            text = path.read_text()
        except FileNotFoundError:
            loaded = Loaded(None, f"no cached build for this key: {self._closest(key)}")
            log.info("build cache: %s", loaded.why)
            return loaded
        except OSError as error:
            loaded = Loaded(None, f"{path} unreadable ({error.strerror}); building afresh")
            log.warning("build cache: %s", loaded.why)
            return loaded
        problem = _problem(text, key)
        if problem is not None:
            loaded = Loaded(None, f"{path} is corrupt ({problem}); removed, building afresh")
            log.warning("build cache: %s", loaded.why)
            path.unlink(missing_ok=True)
            return loaded
        entries = json.loads(text)["entries"]
        loaded = Loaded(entries, f"cached build {path.name} ({len(entries)} entries)")
        log.info("build cache: using %s", loaded.why)
        return loaded

    def store(self, key: BuildKey, entries: Mapping[str, Any]) -> Path:
        """Write `entries` under `key`, atomically (a temporary file renamed into place,
        flushed to disk first): concurrent writers leave one whole entry."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.path(key)
        document = {"format": FORMAT, "key": key.fields(), "entries": dict(entries),
                    "sha256": _sha256(dict(entries))}  # fmt: skip
        handle, temporary = tempfile.mkstemp(dir=self.directory, prefix=path.stem + ".", suffix=".tmp")
        try:
            with os.fdopen(handle, "w") as out:
                json.dump(document, out, sort_keys=True)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temporary, path)
        finally:
            if os.path.exists(temporary):
                os.unlink(temporary)
        return path

    def holds_any(self, key: BuildKey, ignoring: Iterable[str] = ()) -> bool:
        """Whether an entry's key equals `key` in every field but `ignoring`: a start that
        does not know all of its key yet (its model not loaded) may find an entry once it
        does."""
        skip = set(ignoring)
        wanted = {name: value for name, value in key.fields().items() if name not in skip}
        return any(all(other.get(name) == value for name, value in wanted.items()) for other in self._keys())

    def _keys(self) -> Iterator[dict[str, Any]]:
        """The key of every readable entry (a corrupt one says nothing)."""
        for path in sorted(self.directory.glob(f"*{SUFFIX}")):
            try:
                other = json.loads(path.read_text())["key"]
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if isinstance(other, dict):
                yield other

    def _closest(self, key: BuildKey) -> str:
        """Why no entry fits: none cached, or the fields in which the closest entry's key
        differs from this one (`driver 580.95 -> 580.159`)."""
        wanted = key.fields()
        best: dict[str, tuple[Any, Any]] | None = None
        for other in self._keys():
            differ = {
                name: (other.get(name), value) for name, value in wanted.items() if other.get(name) != value
            }
            if best is None or len(differ) < len(best):
                best = differ
        if best is None:
            return f"nothing cached in {self.directory} (a first start)"
        changes = ", ".join(f"{name} {old} -> {new}" for name, (old, new) in best.items())
        return f"the closest cached build differs in {changes}"


def _problem(text: str, key: BuildKey) -> str | None:
    """Why the entry file's `text` cannot be the entry of `key`, or None when it is."""
    try:
        document = json.loads(text)
    except ValueError as error:
        return f"not JSON: {error}"
    if not isinstance(document, dict):
        return "not a JSON object"
    if document.get("format") != FORMAT:
        return f"format {document.get('format')!r}, expected {FORMAT!r}"
    entries = document.get("entries")
    if not isinstance(entries, dict):
        return "no entries object"
    if document.get("sha256") != _sha256(entries):
        return "its entries do not match their checksum"
    if document.get("key") != key.fields():
        return "its key is not the key its name stands for"
    return None


def build_cache_dir() -> Path:
    """Where the start-up choices are kept: $SPEAKERD_BUILD_CACHE, else `builds/` in the
    server's cache directory."""
    from speakerd.model.store import cache_dir

    named = os.environ.get(BUILD_CACHE_VARIABLE)
    return Path(named) if named else cache_dir() / BUILDS_DIR
