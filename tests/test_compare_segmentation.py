"""speakerd.tools.compare_segmentation: the hard-segmentation check every segmentation math
passes before it is served.

`compare` counts the cells and frames whose hard value differs from pyannote's, and which of
those frames are ties (pyannote's own top-2 margin below the tie margin); a math is `ok` when
no frame differs outside a tie. Then the tool end to end on pyannote's sample.wav with the
NumPy segmenter against PyanNet on the CPU (the GPU maths run the same code on the device:
`--maths fp32,fast`). Skips without torch, pyannote.audio's sample.wav or segmentation-3.0's
checkpoint (.ci/run installs them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from speakerd.model.segmentation.powerset import MAPPING
from speakerd.tools.compare_segmentation import TIE_MARGIN, compare
from tests.pyannote_checkpoints import SEGMENTATION_CHECKPOINT, SEGMENTATION_MISSING

ROOT = Path(__file__).resolve().parents[1]


def _log_probs(classes: np.ndarray, margin: float) -> np.ndarray:
    """[k, frames, 7] log-probabilities whose best class is `classes`, the runner-up
    (the next class) `margin` below it."""
    logp = np.full((*classes.shape, 7), -10.0, dtype=np.float32)
    np.put_along_axis(logp, classes[..., None], -0.5, axis=-1)
    np.put_along_axis(logp, ((classes + 1) % 7)[..., None], -0.5 - margin, axis=-1)
    return logp


def test_a_frame_moved_outside_a_tie_fails_and_one_at_a_tie_does_not() -> None:
    classes = np.random.default_rng(0).integers(0, 7, size=(3, 589))
    reference = _log_probs(classes, margin=0.5)
    reference[1, 100] = _log_probs(classes[1:2, 100:101], margin=TIE_MARGIN / 10)[0, 0]  # a tie
    same = MAPPING[classes].astype(np.uint8)

    assert compare(reference, same, reference, TIE_MARGIN).ok
    at_tie = same.copy()
    at_tie[1, 100] = MAPPING[(classes[1, 100] + 1) % 7]  # the runner-up's speakers
    result = compare(reference, at_tie, None, TIE_MARGIN)
    counts = (result.frames_differ, result.frames_differ_at_ties, result.ties, result.ok)
    assert counts == (1, 1, 1, True), result
    assert result.cells_differ >= 1 and result.cells == 3 * 589 * 3 and result.max_abs_logp is None

    moved = same.copy()
    moved[2, 7] = MAPPING[(classes[2, 7] + 1) % 7]
    result = compare(reference, moved, None, TIE_MARGIN)
    assert (result.frames_differ, result.frames_differ_at_ties, result.ok) == (1, 0, False), result


@pytest.mark.slow
def test_the_numpy_segmenter_gives_pyannotes_hard_segmentation_of_sample_wav() -> None:
    pytest.importorskip("torch", reason="torch is not installed (the reference PyanNet)")
    pyannote = pytest.importorskip("pyannote.audio", reason="pyannote.audio is not installed (sample.wav)")
    if not SEGMENTATION_CHECKPOINT.is_file():
        pytest.skip(SEGMENTATION_MISSING)
    sample = Path(pyannote.__file__).parent / "sample" / "sample.wav"
    argv = [sys.executable, "-m", "speakerd.tools.compare_segmentation", "--audio", str(sample),
            "--ckpt", str(SEGMENTATION_CHECKPOINT), "--maths", "cpu", "--device", "cpu"]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    print(done.stdout, done.stderr[-2000:])
    assert done.returncode == 0, done.stderr[-2000:]
    (line,) = [json.loads(row) for row in done.stdout.splitlines()]
    assert line["recording"] == "sample.wav" and line["windows"] == 21 and line["engine"] == "cpu-numpy"
    assert line["cells"] == 21 * 589 * 3
    # every frame that differs is a tie of pyannote's own (sample.wav has one, window 1 frame 548)
    assert line["ok"] and line["frames_differ"] == line["frames_differ_at_ties"] <= line["ties"], line
