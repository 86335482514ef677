"""Start-up phases and their seconds: what the SERVING line (and `speakerd warm`'s) says.

An operator sizing a startup probe, or looking at a slow pod, reads where the start-up went
from one line: `SERVING ... after 167.9 s of start-up (models 1.2 s, segmentation 14.0 s,
engine 152.9 s, self-check 0.6 s, plan timing 0.4 s, clustering check 0.2 s)`.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Iterator

#: The SERVING line's start-up: its seconds and its phases' (`Phases.text`), as logged.
SERVING_LINE = re.compile(r"SERVING \S+ after (?P<seconds>[\d.]+) s of start-up \((?P<phases>[^)]*)\)")


class Phases:
    """Named phases' wall seconds, in the order they began; safe from several threads."""

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def timed(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - started)

    def add(self, name: str, seconds: float) -> None:
        with self._lock:
            self._seconds[name] = self._seconds.get(name, 0.0) + seconds

    def seconds(self) -> dict[str, float]:
        with self._lock:
            return dict(self._seconds)

    def text(self) -> str:
        """'models 1.2 s, engine 152.9 s, ...' (empty when nothing was timed)."""
        return ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.seconds().items())


def serving_seconds(log: str) -> tuple[float, dict[str, float]] | None:
    """(start-up seconds, each phase's seconds) from the first SERVING line in a server's
    `log`; None when it has none."""
    found = SERVING_LINE.search(log)
    if found is None:
        return None
    return float(found["seconds"]), phase_seconds(found["phases"])


def phase_seconds(text: str) -> dict[str, float]:
    """Each phase's seconds from `Phases.text`'s form ('models 1.2 s, engine 152.9 s')."""
    phases = {}
    for part in filter(None, text.split(", ")):
        name, _, seconds = part.removesuffix(" s").rpartition(" ")
        phases[name] = float(seconds)
    return phases
