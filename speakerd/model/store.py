"""The synthetic default model, made on first use in speakerd's cache directory (source.py
resolves `--model`, and takes this model when none is given).

The default model is generated (never committed, never downloaded) into a cache directory
the first time anything needs it. Several processes may start at once (server replicas,
test workers), so generation holds an exclusive lock file and writes to a temporary file
that is atomically renamed into place: a reader sees either no file or a complete one
(`ensure_file`, which the synthetic segmentation model's store uses too).
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from speakerd.model.synthetic import DEFAULT_SEED, GENERATOR_VERSION, make_state_dict
from speakerd.model.weights import save_state_dict

#: Overrides the cache directory (containers mount a volume here).
CACHE_ENV = "SPEAKERD_CACHE"
DEFAULT_CACHE = Path("~/.cache/speakerd")


def cache_dir() -> Path:
    """$SPEAKERD_CACHE, else ~/.cache/speakerd."""
    configured = os.environ.get(CACHE_ENV, "")
    return Path(configured).expanduser() if configured else DEFAULT_CACHE.expanduser()


def default_model_name(seed: int = DEFAULT_SEED) -> str:
    """The generator version is in the name so a cache from an older generator is not reused."""
    return f"wespeaker-resnet34-synthetic-v{GENERATOR_VERSION}-seed{seed}.safetensors"


def ensure_file(path: Path, write: Callable[[Path], None]) -> Path:
    """`path`, made by `write(temporary)` unless it exists; safe under concurrent callers: one
    writes under an exclusive lock, into a temporary file beside `path` renamed into place."""
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if path.is_file():  # another process made it while we waited
            return path
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
        os.close(handle)
        try:
            write(Path(temporary))
            os.replace(temporary, path)
        finally:
            if os.path.exists(temporary):
                os.unlink(temporary)
    return path


def ensure_synthetic_model(path: Path, seed: int = DEFAULT_SEED) -> Path:
    """Generate the synthetic model at `path` unless it exists; safe under concurrent callers."""
    return ensure_file(path, lambda temporary: save_state_dict(make_state_dict(seed), temporary))


def default_weights_path() -> Path:
    """The synthetic default model in the cache directory, made on first use."""
    return ensure_synthetic_model(cache_dir() / default_model_name())
