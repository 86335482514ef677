"""The voiceprint store for a fleet: one PostgreSQL database shared by every replica.

Each write is one transaction that also sends NOTIFY on CHANNEL with "put <id>" or
"delete <id>" (delivered at commit, only if it commits). Every replica LISTENs on its own
connection (`watch`, a daemon thread) and applies each change to its in-memory index: an
enrollment on one replica is searchable on the others as soon as the notification
arrives, within LISTEN_POLL_S of it at worst (measured in tests/test_voiceprints_store.py).
A listener that loses its connection reconnects every RECONNECT_S and then reloads the
whole index (`on_reset`), since notifications sent meanwhile are lost.

The vectors are BYTEA (no pgvector: Debian does not package it, and an exact search of the
in-memory index is what pgvector's would be). A database that cannot be reached is
StoreUnavailable (UNAVAILABLE to the client, who retries); a failed transaction is rolled
back, so nothing is half-written.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from urllib.parse import urlsplit

import psycopg

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

log = logging.getLogger(__name__)

CHANNEL = "speakerd_voiceprints"
SCHEMA = """
CREATE TABLE IF NOT EXISTS voiceprints (
  tenant TEXT NOT NULL,
  voiceprint_id TEXT PRIMARY KEY,
  speaker_id TEXT NOT NULL,
  model_id TEXT NOT NULL,
  vector BYTEA NOT NULL,
  speech_s DOUBLE PRECISION NOT NULL,
  quality DOUBLE PRECISION NOT NULL,
  windows INTEGER NOT NULL,
  created_ms BIGINT NOT NULL,
  UNIQUE (tenant, speaker_id)
)
"""
#: Any constant: serialises the replicas' CREATE TABLE IF NOT EXISTS at start-up (two
#: racing ones can both pass the check and one then fails on the catalog's unique index).
SCHEMA_LOCK_KEY = 0x5EA4E4D
#: Longest wait for a connection: past it a call gets UNAVAILABLE instead of hanging.
CONNECT_TIMEOUT_S = 5
#: How often the listener wakes without a notification (to notice being closed).
LISTEN_POLL_S = 0.5
#: Pause between reconnection attempts of a listener that lost its connection.
RECONNECT_S = 1.0


class PostgresStore:
    def __init__(self, url: str) -> None:
        self.url = url
        parts = urlsplit(url)
        self.description = f"PostgreSQL {parts.hostname or 'localhost'}:{parts.port or 5432}{parts.path}"
        self._lock = threading.Lock()
        self._conn: psycopg.Connection | None = None
        self._closed = threading.Event()
        self._listener: threading.Thread | None = None
        self._run(self._create_schema)

    @staticmethod
    def _create_schema(conn: psycopg.Connection) -> None:
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK_KEY,))
        conn.execute(SCHEMA)

    def _connect(self) -> psycopg.Connection:
        return psycopg.connect(self.url, connect_timeout=CONNECT_TIMEOUT_S)

    def _run(self, work: Callable[[psycopg.Connection], object]) -> object:
        """`work` in one transaction on the store's connection (made again after a failure);
        StoreUnavailable when the database cannot be reached or the transaction failed."""
        with self._lock:
            try:
                if self._conn is None or self._conn.closed:
                    self._conn = self._connect()
                with self._conn.transaction():
                    return work(self._conn)
            except psycopg.OperationalError as error:
                self._drop()
                raise StoreUnavailable(f"{self.description}: {_first_line(error)}") from error
            except psycopg.errors.UniqueViolation as error:  # a racing put of the same speaker
                raise StoreUnavailable(f"{self.description}: concurrent enrollment, retry") from error

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def put(self, record: VoiceprintRecord, replace: bool) -> str:
        def work(conn: psycopg.Connection) -> str:
            row = conn.execute(
                "SELECT voiceprint_id FROM voiceprints WHERE tenant = %s AND speaker_id = %s FOR UPDATE",
                (record.tenant, record.speaker_id),
            ).fetchone()
            if row is not None and not replace:
                raise DuplicateSpeaker(record.speaker_id, row[0])
            if row is not None:
                conn.execute("DELETE FROM voiceprints WHERE voiceprint_id = %s", (row[0],))
                conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, f"delete {row[0]}"))
            marks = ", ".join("%s" for _ in COLUMNS)
            conn.execute(f"INSERT INTO voiceprints ({SELECT_COLUMNS}) VALUES ({marks})", to_row(record))
            conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, f"put {record.voiceprint_id}"))
            return "" if row is None else str(row[0])

        return str(self._run(work))

    def get(self, tenant: str, voiceprint_id: str) -> VoiceprintRecord | None:
        row = self._run(lambda conn: conn.execute(
            f"SELECT {SELECT_COLUMNS} FROM voiceprints WHERE tenant = %s AND voiceprint_id = %s",
            (tenant, voiceprint_id)).fetchone())  # fmt: skip
        return None if row is None else from_row(row)  # type: ignore[arg-type]

    def get_any(self, voiceprint_id: str) -> VoiceprintRecord | None:
        """A voiceprint by id whatever its tenant: what a notification names."""
        row = self._run(lambda conn: conn.execute(
            f"SELECT {SELECT_COLUMNS} FROM voiceprints WHERE voiceprint_id = %s",
            (voiceprint_id,)).fetchone())  # fmt: skip
        return None if row is None else from_row(row)  # type: ignore[arg-type]

    def list(self, tenant: str) -> list[VoiceprintRecord]:
        rows = self._run(lambda conn: conn.execute(
            f"SELECT {SELECT_COLUMNS} FROM voiceprints WHERE tenant = %s ORDER BY speaker_id",
            (tenant,)).fetchall())  # fmt: skip
        return [from_row(row) for row in rows]  # type: ignore[union-attr]

    def delete(self, tenant: str, voiceprint_id: str) -> VoiceprintRecord | None:
        def work(conn: psycopg.Connection) -> VoiceprintRecord | None:
            row = conn.execute(
                "DELETE FROM voiceprints WHERE tenant = %s AND voiceprint_id = %s "
                f"RETURNING {SELECT_COLUMNS}",
                (tenant, voiceprint_id),
            ).fetchone()
            if row is not None:
                conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, f"delete {voiceprint_id}"))
            return None if row is None else from_row(row)

        return self._run(work)  # type: ignore[return-value]

    def all(self) -> list[VoiceprintRecord]:
        rows = self._run(lambda conn: conn.execute(f"SELECT {SELECT_COLUMNS} FROM voiceprints").fetchall())
        return [from_row(row) for row in rows]  # type: ignore[union-attr]

    def watch(self, on_change: Callable[[Change], None], on_reset: Callable[[], None]) -> None:
        """Start the listener thread (once)."""
        if self._listener is None:
            self._listener = threading.Thread(
                target=self._listen, args=(on_change, on_reset), name="voiceprints-listen", daemon=True
            )
            self._listener.start()

    def _listen(self, on_change: Callable[[Change], None], on_reset: Callable[[], None]) -> None:
        missed = False  # notifications may have been lost: reload once listening again
        while not self._closed.is_set():
            try:
                with psycopg.connect(self.url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    if missed:
                        on_reset()
                        missed = False
                        log.info("voiceprints: listening again on %s; index reloaded", self.description)
                    while not self._closed.is_set():
                        for note in conn.notifies(timeout=LISTEN_POLL_S):
                            kind, _, voiceprint_id = note.payload.partition(" ")
                            on_change((kind, voiceprint_id))
            except Exception as error:  # the database went away, or applying a change failed
                if self._closed.is_set():
                    return
                missed = True
                log.warning("voiceprints: listener lost %s (%s); reconnecting every %.0f s",
                            self.description, _first_line(error), RECONNECT_S)  # fmt: skip
                self._closed.wait(RECONNECT_S)

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            self._drop()
        if self._listener is not None:
            self._listener.join(LISTEN_POLL_S * 4)


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
