"""The clustering's compile in a child process (serving/server/precompile.py).

The child fills numba's cache with what the start-up's clustering check loads: the compiled
linkage and diarize's frame loops. A child that fails costs one line and nothing else (the
start-up compiles for itself).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from speakerd.model.diarization import compiled
from speakerd.serving.server import precompile

pytestmark = pytest.mark.skipif(not compiled.available(), reason="numba is not installed")


@pytest.mark.slow
def test_the_child_fills_numbas_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    child = precompile.ClusteringCompile()
    assert child.child is not None, "no child process started"
    child.wait()
    assert child.child is None
    made = sorted(p.name for p in tmp_path.rglob("*.nbi"))
    assert any("_fast_linkage" in name for name in made), made
    assert any("_add_windows" in name for name in made), made


def test_a_failed_child_is_one_line(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    caplog.set_level(logging.WARNING, logger=precompile.__name__)
    monkeypatch.setattr(sys, "executable", "/bin/false")
    child = precompile.ClusteringCompile()
    child.wait()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert "the child process exited 1" in lines[0] and "compiling here" in lines[0], lines[0]
