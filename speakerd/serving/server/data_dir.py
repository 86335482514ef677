"""One server per `--data-dir` while it keeps its voiceprints there (the SQLite store).

Each server holds its voiceprint index in memory and hears of no write another process makes
to the SQLite file (PostgreSQL's store listens for them; SQLite has no such channel). Two
servers on one directory therefore drift apart: a voiceprint enrolled through one is listed
by the other, whose index never saw it, so its Identify names someone else. So a server takes
an exclusive lock on `speakerd.lock` in the directory before it listens, and a second one
exits 2 naming the flag.

The lock is `flock`'s: the kernel releases it when the holder's last descriptor closes, at
exit or at SIGKILL alike, so a killed server never leaves a stale lock behind; the file keeps
the holder's pid only to say who holds it.
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path
from typing import IO

from speakerd.serving.server.config import UsageError

log = logging.getLogger(__name__)

#: The lock file, beside the SQLite store in --data-dir.
LOCK_FILE = "speakerd.lock"


def hold(directory: Path) -> IO[str] | None:
    """Lock `directory` for this server: the open lock file, whose flock lasts while it stays
    open (keep it for the process's life). UsageError naming --data-dir when another process
    holds it; None when the lock file cannot be made at all (a read-only directory): the
    store cannot be opened there either, and its calls say so (serve.py's _open_voiceprints)."""
    path = directory / LOCK_FILE
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        file = path.open("a+")
    except OSError as error:
        log.warning("--data-dir %s: cannot make its lock file (%s)", directory, error)
        return None
    try:
        fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        file.seek(0)
        holder = file.read().strip() or "unknown"
        file.close()
        raise UsageError(
            f"--data-dir {directory}: another speakerd server (pid {holder}) keeps its SQLite voiceprints "
            "there, and two servers on one store would disagree about them; give this one its own "
            "--data-dir, or --voiceprints off, or share voiceprints through PostgreSQL "
            "(--voiceprints postgresql://...)"
        ) from None
    file.seek(0)
    file.truncate()
    file.write(f"{os.getpid()}\n")
    file.flush()
    return file
