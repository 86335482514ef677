"""`speakerd warm` builds what `serve` builds with the same flags, checks it, fills the caches
and exits; `serve`'s SERVING line says where its start-up seconds went.

warm on an empty cache makes the default models there (the first start's longest phase on a
CPU), passes the self-check and the linkage's check, and exits 0 with one line of its
phases; a serve on that cache then starts without making them again and names its phases on
the SERVING line. A flag warm cannot honour is one line and exit 2, before any work.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from speakerd.model.store import default_model_name
from speakerd.serving.server.caches import START_CACHES
from speakerd.serving.server.phases import phase_seconds
from tests.serving import SERVING_LINE, start_server

#: A CPU engine's warm-up on 2 shared cores: the default models made, every plan checked.
WARM_TIMEOUT_S = 300
#: The phases each start-up names, in order.
PHASES = ("models", "segmentation", "engine", "self-check", "plan timing", "clustering check")


def _phases(line: str) -> list[str]:
    return list(phase_seconds(line[line.rindex("(") + 1 : line.rindex(")")]))


def warm(cache: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    # the libraries' own cache variables unset: warm points them into SPEAKERD_CACHE
    env = {name: value for name, value in os.environ.items() if name not in START_CACHES}
    env["SPEAKERD_CACHE"] = str(cache)
    return subprocess.run(
        [sys.executable, "-m", "speakerd", "warm", "--engine", "cpu", "--plans", "1", *flags],
        capture_output=True, text=True, timeout=WARM_TIMEOUT_S, env=env,
    )  # fmt: skip


@pytest.mark.slow
def test_warm_fills_the_cache_and_a_server_then_names_its_phases(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    done = warm(cache)
    assert done.returncode == 0, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert "warm: what serve builds with these flags is built and checked, in " in last, last
    assert _phases(last) == list(PHASES), last
    assert (cache / default_model_name()).is_file(), sorted(p.name for p in cache.iterdir())
    # the clustering's compiled loops in numba's cache, inside SPEAKERD_CACHE
    compiled = sorted(p.name for p in (cache / START_CACHES["NUMBA_CACHE_DIR"]).rglob("*.nbi"))
    assert any("_fast_linkage" in name for name in compiled), compiled
    assert any("_add_windows" in name for name in compiled), compiled
    made = {path: path.stat().st_mtime_ns for path in cache.iterdir()}
    again = warm(cache)
    assert again.returncode == 0, again.stderr[-3000:]
    assert {path: path.stat().st_mtime_ns for path in cache.iterdir()} == made, "warm made its models again"
    server = start_server(cache / default_model_name(), "--plans", "1")
    try:
        line = next(line for line in server.lines if SERVING_LINE in line)
        assert _phases(line) == list(PHASES), line
    finally:
        assert server.terminate() == 0, server.log()


def test_warm_refuses_devices_in_one_line(tmp_path: Path) -> None:
    done = warm(tmp_path / "cache", "--devices", "0")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, (done.returncode, done.stderr[-2000:])
    assert lines[0].startswith("speakerd warm: error: --devices: warm builds one engine"), lines[0]
    assert not (tmp_path / "cache").exists(), "a refused warm made files"
