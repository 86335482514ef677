"""segmentation-3.0's 7 powerset classes as speaker sets, and pyannote's hard conversion to
per-speaker activity.

The classifier scores every set of at most 2 of the window's 3 local speakers, in
pyannote.audio's `Powerset(3, 2)` order (sets by size, then `itertools.combinations`
order): {}, {0}, {1}, {2}, {0, 1}, {0, 2}, {1, 2}. `to_multilabel` is
`Powerset.to_multilabel(soft=False)`: the most likely class per frame (its first index on
a tie, as torch.argmax), one-hot, times the [7, 3] mapping, i.e. that class's row of it.
"""

from __future__ import annotations

from itertools import combinations

import numpy as np

from speakerd.model.segmentation.architecture import CLASSES, MAX_SET_SIZE, SPEAKERS


def powerset_classes(
    speakers: int = SPEAKERS, max_set_size: int = MAX_SET_SIZE
) -> tuple[tuple[int, ...], ...]:
    """The speaker sets in pyannote's order: by size, then `combinations` order within a size."""
    return tuple(chosen for size in range(max_set_size + 1) for chosen in combinations(range(speakers), size))


def build_mapping(speakers: int = SPEAKERS, max_set_size: int = MAX_SET_SIZE) -> np.ndarray:
    """[classes, speakers] float32: mapping[k, s] = 1 iff speaker s is in class k's set."""
    sets = powerset_classes(speakers, max_set_size)
    mapping = np.zeros((len(sets), speakers), dtype=np.float32)
    for index, chosen in enumerate(sets):
        mapping[index, list(chosen)] = 1.0
    return mapping


#: segmentation-3.0's mapping: [7, 3].
MAPPING = build_mapping()
assert MAPPING.shape == (CLASSES, SPEAKERS), (
    f"powerset mapping {MAPPING.shape}, expected ({CLASSES}, {SPEAKERS})"
)
MAPPING.setflags(write=False)


def to_multilabel(log_probs: np.ndarray) -> np.ndarray:
    """[..., 7] powerset scores -> [..., 3] float32 hard speaker activity (0 or 1)."""
    log_probs = np.asarray(log_probs)
    if log_probs.shape[-1:] != (CLASSES,):
        raise ValueError(f"powerset scores of shape {log_probs.shape}, expected [..., {CLASSES}]")
    return MAPPING[np.argmax(log_probs, axis=-1)]
