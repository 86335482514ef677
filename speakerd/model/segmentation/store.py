"""The synthetic segmentation model, made on first use in speakerd's cache directory, as the
embedding model's synthetic default is (speakerd/model/store.py: the same directory,
`$SPEAKERD_CACHE`, and the same lock-and-rename, so concurrent starts make it once and never
read a half-written file). source.py takes it when `--segmentation-model` is not given.
"""

from __future__ import annotations

from pathlib import Path

from speakerd.model.segmentation.synthetic import DEFAULT_SEED, GENERATOR_VERSION, make_state_dict
from speakerd.model.segmentation.weights import save_state_dict
from speakerd.model.store import cache_dir, ensure_file


def default_segmentation_name(seed: int = DEFAULT_SEED) -> str:
    """The generator version is in the name so a cache from an older generator is not reused."""
    return f"pyannet-segmentation-synthetic-v{GENERATOR_VERSION}-seed{seed}.safetensors"


def ensure_synthetic_segmentation(path: Path, seed: int = DEFAULT_SEED) -> Path:
    """Generate the synthetic segmentation model at `path` unless it exists."""
    return ensure_file(path, lambda temporary: save_state_dict(make_state_dict(seed), temporary))


def default_segmentation_path() -> Path:
    """The synthetic segmentation model in the cache directory, made on first use."""
    return ensure_synthetic_segmentation(cache_dir() / default_segmentation_name())
