"""pyannote's powerset of 3 local speakers with at most 2 at once, and its hard conversion.

segmentation-3.0 classifies each frame into one of 7 sets of speakers, in the order of
`pyannote.audio.utils.powerset.Powerset(3, 2).powerset_classes` (sets by size, then in
`itertools.combinations` order): {}, {0}, {1}, {2}, {0, 1}, {0, 2}, {1, 2}.
`to_multilabel` is `Powerset.to_multilabel(soft=False)`: the class of highest
log-probability (the first one on an exact tie, as torch.argmax) as its speakers' 0/1 row.
"""

from __future__ import annotations

from itertools import combinations

import numpy as np

from speakerd.model.segmentation.architecture import CLASSES, MAX_SET_SIZE, SPEAKERS

#: The speaker sets of the 7 classes, in pyannote's order.
POWERSET_CLASSES: tuple[frozenset[int], ...] = tuple(
    frozenset(members) for size in range(MAX_SET_SIZE + 1) for members in combinations(range(SPEAKERS), size)
)
assert len(POWERSET_CLASSES) == CLASSES, f"{len(POWERSET_CLASSES)} powerset classes, expected {CLASSES}"
#: [7, 3] uint8: MAPPING[c, s] = 1 iff speaker s is in class c (pyannote's `mapping` buffer).
MAPPING = np.array([[int(s in members) for s in range(SPEAKERS)] for members in POWERSET_CLASSES], np.uint8)
MAPPING.flags.writeable = False


def to_multilabel(log_probs: np.ndarray) -> np.ndarray:
    """[..., 7] powerset scores -> [..., 3] uint8 speakers of each frame's most likely class."""
    return MAPPING[np.argmax(log_probs, axis=-1)]
