"""The memory a diarization's clustering holds: the bound the server reserves, and the 3 h figures.

`speakerd.model.diarization.working_bytes(windows, clean_pairs, initial_clusters)` is what
Diarize reserves in the clustering budget (`--clustering-memory-mb`): 8 n^2 bytes for the
centroid linkage of the n clean pairs before it clusters, and for VBx, once its AHC cut gives
s initial clusters, the larger of that and 112 n s for its updates; plus
DIARIZE_BYTES_PER_WINDOW a window. Each case runs `diarize` in a fresh process, its linkage
compiled and checked first as a server does at start-up, and compares its peak resident size
above its inputs with that bound: the bound must hold, and be tight enough to mean something
(the measured peak at least half of it). The cases load each term alone: many clean pairs in
few windows (the linkage), many windows with nothing to link (the per-window arrays), VBx's
updates where every pair starts as its own cluster (its most), and VBx with a few initial
clusters (the linkage again, where the old bound of 112 n^2 reserved fourteen times too much).
docs/service.md's figures for an hour and for 3 h are the formula's.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("scipy", reason="SciPy is a server dependency (pip install 'speakerd[server]')")

from speakerd.model.diarization import working_bytes
from speakerd.serving.diarization.service import KEPT_ROW_BYTES
from speakerd.serving.memory.recording_budget import DEFAULT_CLUSTERING_MEMORY_MB
from tests.plda_files import write_plda

REPO = Path(__file__).resolve().parent.parent
SERVICE_DOC = REPO / "docs" / "service.md"
#: 3 h and an hour of audio in pyannote's 10 s windows every 1 s; 3 local speakers a window.
WINDOWS_3H, WINDOWS_HOUR, SPEAKERS = 10_791, 3_591, 3
#: sample.wav's share of clean pairs (speaking alone in at least 20% of their window's
#: frames): 51 of its first 45 s's 108 pairs, as the server segments it.
SAMPLE_CLEAN_SHARE = 0.47
#: The least share of the bound a measured peak must reach for the bound to be worth having.
TIGHTNESS = 0.5

#: Run in a fresh process: `diarize` on the inputs saved in argv[1] (np.load allocates just
#: the arrays, so nothing before the call peaks above the process's resident size then), its
#: peak resident size above that. Linux's VmHWM, the high-water mark of this process's own
#: memory: getrusage's ru_maxrss also keeps the resident size of the process it was forked
#: from (a pytest worker's 750 MB read as this process's peak).
PEAK = r"""
import json, sys
import numpy as np
from speakerd.model.diarization import COMMUNITY_1, clean_speakers, diarize, load_plda
from speakerd.model.diarization.linkage import proven_equal_to_scipy

def status(field):
    with open("/proc/self/status") as lines:
        return next(int(line.split()[1]) * 1024 for line in lines if line.startswith(field + ":"))

with np.load(sys.argv[1]) as saved:
    segmentations, embeddings = saved["segmentations"], saved["embeddings"]
options = {"clustering": COMMUNITY_1, "plda": load_plda(sys.argv[2])} if len(sys.argv) > 2 else {}
pairs = len(clean_speakers(embeddings, segmentations)[0])
assert proven_equal_to_scipy()  # compiled and checked, as `serve` does before it serves
seen = {"initial_clusters": 0}
if options:
    options["on_initial_clusters"] = lambda n, s: seen.update(initial_clusters=s)
resident = status("VmRSS")
diarize(segmentations, embeddings, 1.0, **options)
peak = status("VmHWM") - resident
print(json.dumps({"windows": len(segmentations), "pairs": pairs, "peak_bytes": peak, **seen}))
"""


def measured(windows: int, clean: bool, vbx: bool, folder: Path, noise: float = 1.0) -> dict[str, int]:
    """Inputs of `windows` windows (`clean`: two speakers taking turns in each, both pairs
    clean; else all three at once throughout, no pair ever alone) with embeddings of 6
    voices under `noise` (1: as strong as the voices, so the AHC cut leaves every pair alone),
    diarized in a fresh process (`vbx`: with a random but valid PLDA: VBx's cost depends on
    the shapes, not on what it learnt)."""
    rng = np.random.default_rng(0)
    segmentations = np.zeros((windows, 589, 3), np.uint8)
    if clean:
        segmentations[:, :300, 0] = 1
        segmentations[:, 300:, 1] = 1
    else:
        segmentations[:] = 1
    voices = rng.standard_normal((6, 256))
    embeddings = voices[rng.integers(0, 6, (windows, 3))] + noise * rng.standard_normal((windows, 3, 256))
    inputs = folder / f"inputs-{windows}-{noise}.npz"
    np.savez(inputs, segmentations=segmentations, embeddings=embeddings.astype(np.float32))
    plda = [str(write_plda(folder / "plda", 0))] if vbx else []
    done = subprocess.run(
        [sys.executable, "-c", PEAK, str(inputs), *plda],
        capture_output=True, text=True, timeout=300, cwd=REPO, check=True,
    )  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_working_bytes_bound_the_peak_of_diarize(tmp_path: Path) -> None:
    print(f"\n{'case':<36}{'windows':>8}{'pairs':>7}{'initial':>8}{'peak MB':>9}{'bound MB':>10}{'share':>7}")
    for case, windows, clean, vbx, noise in (
        ("linkage: 2 clean pairs a window", 1_500, True, False, 1.0),
        ("per window: nothing to link", 4_000, False, False, 1.0),
        ("VBx: every pair its own cluster", 1_000, True, True, 1.0),
        ("VBx: a few initial clusters", 1_500, True, True, 0.2),
    ):
        run = measured(windows, clean, vbx, tmp_path, noise)
        bound = working_bytes(run["windows"], run["pairs"], run["initial_clusters"])
        share = run["peak_bytes"] / bound
        print(f"{case:<36}{run['windows']:>8}{run['pairs']:>7}{run['initial_clusters']:>8}"
              f"{run['peak_bytes'] / 1e6:>9.1f}{bound / 1e6:>10.1f}{share:>7.2f}")  # fmt: skip
        assert run["peak_bytes"] <= bound, f"{case}: peak {run['peak_bytes']} > bound {bound}"
        assert share >= TIGHTNESS, f"{case}: peak {run['peak_bytes']} is {share:.2f} of bound {bound}"


def _reserved(windows: int, pairs: int) -> int:
    """What Diarize reserves for a recording: the clustering and what it keeps of each window."""
    return working_bytes(windows, pairs) + KEPT_ROW_BYTES * windows


def test_the_documented_hour_and_3_hour_figures_are_the_formulas() -> None:
    doc = " ".join(SERVICE_DOC.read_text().split())
    every_pair_hour = _reserved(WINDOWS_HOUR, SPEAKERS * WINDOWS_HOUR)
    every_pair_3h = _reserved(WINDOWS_3H, SPEAKERS * WINDOWS_3H)
    sample_3h = _reserved(WINDOWS_3H, round(SAMPLE_CLEAN_SHARE * SPEAKERS * WINDOWS_3H))
    without_pairs_3h = _reserved(WINDOWS_3H, 0)
    figures = [f"{value / 1e9:.1f} GB" for value in (every_pair_hour, sample_3h, every_pair_3h)]
    said = (
        f"An hour takes at most {figures[0]} (all 10,773 pairs clean); a 3 h recording (10,791 windows) "
        f"{without_pairs_3h / 1e9:.2f} GB + 8 n^2 + 4 KB n: {figures[1]} with 47% of its pairs clean"
    )
    assert said in doc, said
    assert f"{figures[2]} if every pair were" in doc, figures[2]
    budget = DEFAULT_CLUSTERING_MEMORY_MB << 20
    assert f"`--clustering-memory-mb` ({DEFAULT_CLUSTERING_MEMORY_MB})" in doc
    # the default holds the worst hour twice over, and a 3 h recording with sample.wav's share
    assert 2 * every_pair_hour <= budget and sample_3h <= budget < every_pair_3h
    share = _largest_clean_share(budget)
    assert re.search(rf"fits a 3 h recording with up to {int(100 * share)}% clean pairs", doc), share


def _largest_clean_share(budget: int) -> float:
    """The largest share of a 3 h recording's pairs that may be clean for it to fit `budget`."""
    low, high = 0, SPEAKERS * WINDOWS_3H
    while low < high:  # the largest n whose reservation fits
        middle = (low + high + 1) // 2
        low, high = (middle, high) if _reserved(WINDOWS_3H, middle) <= budget else (low, middle - 1)
    return low / (SPEAKERS * WINDOWS_3H)
