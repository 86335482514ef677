"""The voiceprint store's interface, and the backend a `--voiceprints` value picks.

Every method is blocking (the service runs them on its store thread) and atomic: a put or
delete is one transaction, so a crash leaves the old state or the new one, never a torn
record. `changes` lets a backend shared by several servers (PostgreSQL) tell this server's
index about writes made by others.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from speakerd.serving.voiceprints.records import Change, VoiceprintRecord

#: `--voiceprints` value for the default backend: a SQLite file in --data-dir.
SQLITE = "sqlite"
#: ... and for no voiceprint service at all (its methods answer UNIMPLEMENTED).
OFF = "off"
SQLITE_FILE = "voiceprints.sqlite3"


class VoiceprintStore(Protocol):
    #: where the voiceprints are, for the log (no password)
    description: str

    def put(self, record: VoiceprintRecord, replace: bool) -> str:
        """Insert `record`; with `replace`, erase the tenant's voiceprint of the same
        speaker_id in the same transaction and return its id ("" when none).
        DuplicateSpeaker when there is one and not `replace`."""
        ...

    def get(self, tenant: str, voiceprint_id: str) -> VoiceprintRecord | None: ...

    def get_any(self, voiceprint_id: str) -> VoiceprintRecord | None:
        """A voiceprint by id whatever its tenant: what a change names."""
        ...

    def list(self, tenant: str) -> list[VoiceprintRecord]:
        """The tenant's voiceprints, by speaker_id."""
        ...

    def delete(self, tenant: str, voiceprint_id: str) -> VoiceprintRecord | None:
        """Erase the voiceprint (None when the tenant has none of that id)."""
        ...

    def all(self) -> list[VoiceprintRecord]:
        """Every voiceprint of every tenant: what the index is built from."""
        ...

    def watch(self, on_change: Callable[[Change], None], on_reset: Callable[[], None]) -> None:
        """Call `on_change` for writes by other servers, and `on_reset` when some may
        have been missed (reload everything); a no-op for a single-server backend."""
        ...

    def close(self) -> None: ...


def open_store(spec: str, data_dir: Path) -> VoiceprintStore:
    """`sqlite` (the file SQLITE_FILE in `data_dir`) or a `postgresql://` URL."""
    if spec == SQLITE:
        from speakerd.serving.voiceprints.sqlite_store import SqliteStore

        return SqliteStore(data_dir / SQLITE_FILE)
    if spec.startswith(("postgresql://", "postgres://")):
        from speakerd.serving.voiceprints.postgres_store import PostgresStore

        return PostgresStore(spec)
    raise ValueError(f"{spec!r}, expected {SQLITE}, {OFF} or a postgresql:// URL")
