"""The default voiceprint store: one SQLite file in the server's data directory.

Durability: WAL journal with synchronous=FULL, so a put or delete that returned is on disk,
and a server killed mid-write (SIGKILL, power loss) reopens to the state before or after
that transaction, never a torn row. Erasure: secure_delete overwrites a deleted row's bytes
in the database file, and every delete ends with a WAL checkpoint that truncates the WAL,
so no copy of the vector is left in either file (docs/voiceprints.md; filesystem snapshots
and backups are the operator's to erase).

One server process owns the file: a second server on the same data directory would not see
the first one's writes in its index (use PostgreSQL for several servers).
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path

from speakerd.serving.voiceprints.records import (
    COLUMNS,
    SELECT_COLUMNS,
    Change,
    DuplicateSpeaker,
    StoreUnavailable,
    VoiceprintRecord,
    from_row,
    to_row,
)

SCHEMA = """
CREATE TABLE IF NOT EXISTS voiceprints (
  tenant TEXT NOT NULL,
  voiceprint_id TEXT PRIMARY KEY,
  speaker_id TEXT NOT NULL,
  model_id TEXT NOT NULL,
  vector BLOB NOT NULL,
  speech_s REAL NOT NULL,
  quality REAL NOT NULL,
  windows INTEGER NOT NULL,
  created_ms INTEGER NOT NULL,
  UNIQUE (tenant, speaker_id)
)
"""
#: How long a write waits for a lock held by another connection before failing.
BUSY_TIMEOUT_MS = 5000


class SqliteStore:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.description = f"SQLite {path}"
        self._lock = threading.Lock()
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            for pragma in ("journal_mode=WAL", "synchronous=FULL", "secure_delete=ON",
                           f"busy_timeout={BUSY_TIMEOUT_MS}"):  # fmt: skip
                self._db.execute(f"PRAGMA {pragma}")
            self._db.execute(SCHEMA)
            path.chmod(0o600)  # biometric data: this user only
        except (sqlite3.Error, OSError) as error:
            raise StoreUnavailable(f"{self.description}: {error}") from error

    def _run(self, work: Callable[[sqlite3.Connection], object]) -> object:
        """`work` in one transaction (rolled back on any error); StoreUnavailable for
        SQLite's own failures (disk full, locked, I/O)."""
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    result = work(self._db)
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
                self._db.execute("COMMIT")
                return result
            except sqlite3.Error as error:
                raise StoreUnavailable(f"{self.description}: {error}") from error

    def put(self, record: VoiceprintRecord, replace: bool) -> str:
        def work(db: sqlite3.Connection) -> str:
            row = db.execute(
                "SELECT voiceprint_id FROM voiceprints WHERE tenant = ? AND speaker_id = ?",
                (record.tenant, record.speaker_id),
            ).fetchone()
            if row is not None and not replace:
                raise DuplicateSpeaker(record.speaker_id, row[0])
            if row is not None:
                db.execute("DELETE FROM voiceprints WHERE voiceprint_id = ?", (row[0],))
            marks = ", ".join("?" for _ in COLUMNS)
            db.execute(f"INSERT INTO voiceprints ({SELECT_COLUMNS}) VALUES ({marks})", to_row(record))
            return "" if row is None else str(row[0])

        replaced = str(self._run(work))
        if replaced:
            self._checkpoint()
        return replaced

    def get(self, tenant: str, voiceprint_id: str) -> VoiceprintRecord | None:
        row = self._run(lambda db: db.execute(
            f"SELECT {SELECT_COLUMNS} FROM voiceprints WHERE tenant = ? AND voiceprint_id = ?",
            (tenant, voiceprint_id)).fetchone())  # fmt: skip
        return None if row is None else from_row(row)  # type: ignore[arg-type]

    def get_any(self, voiceprint_id: str) -> VoiceprintRecord | None:
        row = self._run(
            lambda db: db.execute(
                f"SELECT {SELECT_COLUMNS} FROM voiceprints WHERE voiceprint_id = ?", (voiceprint_id,)
            ).fetchone()
        )
        return None if row is None else from_row(row)  # type: ignore[arg-type]

    def list(self, tenant: str) -> list[VoiceprintRecord]:
        rows = self._run(lambda db: db.execute(
            f"SELECT {SELECT_COLUMNS} FROM voiceprints WHERE tenant = ? ORDER BY speaker_id",
            (tenant,)).fetchall())  # fmt: skip
        return [from_row(row) for row in rows]  # type: ignore[union-attr]

    def delete(self, tenant: str, voiceprint_id: str) -> VoiceprintRecord | None:
        def work(db: sqlite3.Connection) -> VoiceprintRecord | None:
            row = db.execute(
                f"SELECT {SELECT_COLUMNS} FROM voiceprints WHERE tenant = ? AND voiceprint_id = ?",
                (tenant, voiceprint_id),
            ).fetchone()
            if row is not None:
                db.execute("DELETE FROM voiceprints WHERE voiceprint_id = ?", (voiceprint_id,))
            return None if row is None else from_row(row)

        deleted = self._run(work)
        if deleted is not None:
            self._checkpoint()
        return deleted  # type: ignore[return-value]

    def _checkpoint(self) -> None:
        """Copy the WAL into the database and truncate it: the deleted row's old pages
        leave the WAL file (secure_delete has zeroed them in the database)."""
        with self._lock:
            try:
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            except sqlite3.Error as error:
                raise StoreUnavailable(f"{self.description}: {error}") from error

    def all(self) -> list[VoiceprintRecord]:
        rows = self._run(lambda db: db.execute(f"SELECT {SELECT_COLUMNS} FROM voiceprints").fetchall())
        return [from_row(row) for row in rows]  # type: ignore[union-attr]

    def watch(self, on_change: Callable[[Change], None], on_reset: Callable[[], None]) -> None:
        """Nothing to watch: this process is the file's only writer."""

    def close(self) -> None:
        with self._lock:
            self._db.close()
