"""The clustering's compiled loops, compiled in a child process beside the start-up.

Diarize's centroid linkage and frame loops are numba functions cached on disk
($NUMBA_CACHE_DIR, pointed into $SPEAKERD_CACHE by caches.py): from the cache they load in
a fraction of a second, but a fresh machine compiles them for about 20 s of one core, and a
compile in the server's own process holds its GIL, so the engine's build on another thread
would wait on it. `build_all` therefore starts this module as a child process first
(`python -m speakerd.serving.server.precompile`): the child compiles into the cache on a core
of its own while the models, segmenter and engine are built; the start-up's own clustering
check waits for the child and then loads what it compiled. A child that fails or is not
there changes nothing but the time: the start-up compiles for itself.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time

log = logging.getLogger(__name__)

#: The longest the clustering check waits for the child (a fresh compile takes about 20 s on
#: one core of a GPU host): past it the child is stopped and the start-up compiles for itself.
CHILD_WAIT_S = 180.0


class ClusteringCompile:
    """The child compiling the clustering's loops; `wait` before compiling them here."""

    def __init__(self) -> None:
        from speakerd.model.diarization import compiled

        self.started = time.perf_counter()
        self.child: subprocess.Popen[bytes] | None = None
        if compiled.available():
            self.child = subprocess.Popen(
                [sys.executable, "-m", __name__], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
            )

    def wait(self, timeout_s: float = CHILD_WAIT_S) -> None:
        """Until the child is done (or stopped after `timeout_s`); one line when it failed."""
        if self.child is None:
            return
        try:
            _, stderr = self.child.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.close()
            log.warning("clustering compile: the child process ran past %.0f s; compiling here", timeout_s)
            return
        seconds = time.perf_counter() - self.started
        if self.child.returncode != 0:
            tail = stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
            log.warning("clustering compile: the child process exited %d (%s); compiling here",
                        self.child.returncode, tail[0][:300])  # fmt: skip
        else:
            log.debug("clustering compile: the child process compiled in %.1f s", seconds)
        self.child = None

    def close(self) -> None:
        """Stop the child if it still runs (a start-up that failed before waiting for it)."""
        if self.child is not None and self.child.poll() is None:
            self.child.kill()
            self.child.communicate()
        self.child = None


def main() -> None:
    """The child: compile (and check) what the clustering check will load."""
    from speakerd.model.diarization import linkage
    from speakerd.model.diarization.pipeline import compile_loops

    linkage.proven_equal_to_scipy()
    compile_loops()


if __name__ == "__main__":
    main()
