"""SQLite persistence of every device's desired state, so the last desired state is enforced again after a
restart without EdgeCore or broker.

One file in the data directory (``desired.db``), WAL journal, schema versioned by named migrations. Each save
replaces one device's rows in one transaction: the state's values per source with their versions, and the
properties still waiting for their default to be restored ("had a desired value" memory).

A file that is not a readable database is moved aside (``<name>.corrupt-<ms>``) and the store starts empty,
logging an error: the mapper keeps running, and the cloud's next sync brings the desired values back. A file
written by a newer mapper (unknown migrations) is refused with a ``PermanentError`` instead: it is not ours to
destroy.

A file the data dir does not let open for writing (full, read-only: ``read_only`` says why) is never moved
aside: it is read through a read-only connection (so the desired state saved before is enforced again), each
save first tries to open it for writing and, while it cannot, raises ``TransientError`` (the caller keeps the
state in memory and saves it again later).
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from mapper.clock import SystemClock
from mapper.edge.control.desired import SOURCES, DesiredState
from mapper.edge.storage.sqlitefiles import DEGRADED_AT_START, move_aside, open_read_only, unwritable_reason
from mapper.errors import InvalidValueError, PermanentError, TransientError

log = logging.getLogger(__name__)

#: File name in the data directory.
DEFAULT_FILE = "desired.db"


def _m001_initial(db: sqlite3.Connection) -> None:
    db.execute(
        "CREATE TABLE devices ("
        " device TEXT PRIMARY KEY,"
        " uuid TEXT NOT NULL DEFAULT '',"
        " updated_at_ms INTEGER NOT NULL,"
        " stale_ignored TEXT NOT NULL DEFAULT '{}')"
    )
    db.execute(
        "CREATE TABLE desired ("
        " device TEXT NOT NULL REFERENCES devices(device) ON DELETE CASCADE,"
        " property TEXT NOT NULL,"
        " source TEXT NOT NULL,"
        " version_ms INTEGER NOT NULL,"
        " removed INTEGER NOT NULL,"
        " raw TEXT,"
        " seq INTEGER NOT NULL DEFAULT 0,"
        " PRIMARY KEY (device, property, source))"
    )
    db.execute(
        "CREATE TABLE restore ("
        " device TEXT NOT NULL REFERENCES devices(device) ON DELETE CASCADE,"
        " property TEXT NOT NULL,"
        " PRIMARY KEY (device, property))"
    )


#: Named migrations, applied in order; a name once released never changes meaning.
MIGRATIONS: tuple[tuple[str, Callable[[sqlite3.Connection], None]], ...] = (("001_initial", _m001_initial),)
SCHEMA_VERSION = len(MIGRATIONS)


@dataclass(frozen=True)
class StoredDevice:
    device: str
    uuid: str
    state: DesiredState
    updated_at_ms: int


class DesiredStore:
    """Desired state per device, in SQLite. Thread-safe (one connection behind a lock); every call is short.

    ``path`` is the database file (a directory means ``<path>/desired.db``). ``now_ms`` gives wall time in ms.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        now_ms: Callable[[], int] | None = None,
        busy_timeout_s: float = 5.0,
    ) -> None:
        target = Path(path)
        if target.is_dir():
            target = target / DEFAULT_FILE
        self.path = target
        self._now_ms = now_ms or SystemClock().wall_ms
        self._busy_timeout_s = busy_timeout_s
        self._lock = threading.Lock()
        #: Where a corrupt file was moved at open, if it was.
        self.moved_aside: Path | None = None
        #: Why the file is open read-only ("" while it is open for writing): the data dir did not let it open.
        self.read_only = ""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._db = self._open()
        except sqlite3.DatabaseError as exc:
            if isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc):
                raise TransientError(f"desired store {self.path}: database is locked: {exc}") from exc
            why = unwritable_reason(exc, self.path.parent)
            if why in DEGRADED_AT_START:
                self._db = self._open_read_only(why, exc)
                return
            self.moved_aside = self._move_aside(exc)
            self._db = self._open()

    def _open_read_only(self, why: str, exc: sqlite3.Error) -> sqlite3.Connection:
        """The file read through a read-only connection (``open_read_only``); an empty store in memory when even
        that cannot read it (the file is left as it is)."""
        self.read_only = why
        db: sqlite3.Connection | None = None
        try:
            db = open_read_only(self.path, check_same_thread=False)
            names = {str(r[0]) for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if not {"devices", "desired", "restore", "migrations"} <= names:
                raise sqlite3.DatabaseError("no desired store tables (yet)")
            read = "the desired state saved before is read from it"
        except sqlite3.Error as read_exc:
            if db is not None:
                db.close()
            db = sqlite3.connect(":memory:", check_same_thread=False, isolation_level=None)
            self._migrate(db)
            read = f"nothing of it can be read now ({read_exc}); it is left as it is"
        log.error(
            "desired store %s: cannot open it for writing (%s: %s); %s; desired values are enforced from memory "
            "and saved once it can be written",
            self.path,
            why,
            exc,
            read,
        )
        return db

    def _writable(self) -> sqlite3.Connection:
        """While open read-only: the file opened for writing now if the data dir lets it, else ``TransientError``
        (called with the lock held)."""
        try:
            db = self._open()
        except sqlite3.Error as exc:
            raise TransientError(f"desired store {self.path}: {self.read_only}: not saved ({exc})") from None
        self._db.close()
        self._db = db
        log.warning("desired store %s: open for writing again (it was: %s)", self.path, self.read_only)
        self.read_only = ""
        return db

    # --- opening -------------------------------------------------------------------------------------
    def _open(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=self._busy_timeout_s, check_same_thread=False, isolation_level=None)
        try:
            db.execute("PRAGMA foreign_keys = ON")
            mode = db.execute("PRAGMA journal_mode = WAL").fetchone()
            if mode is None:
                raise sqlite3.DatabaseError("journal_mode returned nothing")
            db.execute("PRAGMA synchronous = NORMAL")
            check = db.execute("PRAGMA quick_check").fetchone()
            if check is None or check[0] != "ok":
                raise sqlite3.DatabaseError(f"quick_check says {check!r}")
            self._migrate(db)
        except BaseException:
            db.close()
            raise
        return db

    def _migrate(self, db: sqlite3.Connection) -> None:
        db.execute("CREATE TABLE IF NOT EXISTS migrations (name TEXT PRIMARY KEY, applied_at_ms INTEGER NOT NULL)")
        done = {row[0] for row in db.execute("SELECT name FROM migrations")}
        known = {name for name, _ in MIGRATIONS}
        unknown = sorted(done - known)
        if unknown:
            raise PermanentError(
                f"desired store {self.path} was written by a newer mapper (migrations {', '.join(unknown)}); "
                "refusing to open it"
            )
        for name, migration in MIGRATIONS:
            if name in done:
                continue
            db.execute("BEGIN IMMEDIATE")
            try:
                migration(db)
                db.execute("INSERT INTO migrations (name, applied_at_ms) VALUES (?, ?)", (name, self._now_ms()))
                db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    def _move_aside(self, exc: Exception) -> Path:
        aside = move_aside(self.path, self._now_ms())
        log.error(
            "desired store %s is not a readable database (%s): moved it to %s and starting EMPTY; "
            "desired values come back with the next sync from the cloud or the files",
            self.path,
            exc,
            aside,
        )
        return aside

    # --- API -----------------------------------------------------------------------------------------
    @property
    def schema_version(self) -> int:
        with self._locked() as db:
            row = db.execute("PRAGMA user_version").fetchone()
        return int(row[0])

    def migrations(self) -> list[str]:
        with self._locked() as db:
            return [row[0] for row in db.execute("SELECT name FROM migrations ORDER BY name")]

    def save(self, device: str, state: DesiredState, *, uuid: str = "") -> None:
        """Replace ``device``'s stored desired state with ``state`` (one transaction)."""
        if not device:
            raise InvalidValueError("desired store: save needs a device key", reason="empty")
        data = state.to_dict()
        rows: list[tuple[Any, ...]] = []
        for prop, slots in data["properties"].items():
            for source, slot in slots.items():
                raw = None if slot["removed"] else json.dumps(slot["raw"])
                rows.append((device, prop, source, slot["version_ms"], int(slot["removed"]), raw, slot["seq"]))
        with self._transaction() as db:
            db.execute(
                "INSERT INTO devices (device, uuid, updated_at_ms, stale_ignored) VALUES (?, ?, ?, ?) "
                "ON CONFLICT(device) DO UPDATE SET uuid = excluded.uuid, updated_at_ms = excluded.updated_at_ms, "
                "stale_ignored = excluded.stale_ignored",
                (device, uuid, self._now_ms(), json.dumps(data["stale_ignored"])),
            )
            db.execute("DELETE FROM desired WHERE device = ?", (device,))
            db.execute("DELETE FROM restore WHERE device = ?", (device,))
            db.executemany(
                "INSERT INTO desired (device, property, source, version_ms, removed, raw, seq)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                rows,
            )
            db.executemany(
                "INSERT INTO restore (device, property) VALUES (?, ?)", [(device, p) for p in data["restore"]]
            )

    def load(self, device: str) -> StoredDevice | None:
        """``device``'s stored state, or None when nothing is stored for it."""
        with self._locked() as db:
            row = db.execute(
                "SELECT device, uuid, updated_at_ms, stale_ignored FROM devices WHERE device = ?", (device,)
            ).fetchone()
            if row is None:
                return None
            return self._build(db, row)

    def load_all(self) -> list[StoredDevice]:
        """Every stored device, by device key."""
        with self._locked() as db:
            rows = db.execute(
                "SELECT device, uuid, updated_at_ms, stale_ignored FROM devices ORDER BY device"
            ).fetchall()
            return [self._build(db, row) for row in rows]

    def delete(self, device: str) -> bool:
        """Forget ``device`` entirely (the Device was deleted). True when something was stored."""
        with self._transaction() as db:
            cursor = db.execute("DELETE FROM devices WHERE device = ?", (device,))
            return cursor.rowcount > 0

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> DesiredStore:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # --- internals -----------------------------------------------------------------------------------
    def _build(self, db: sqlite3.Connection, row: tuple[Any, ...]) -> StoredDevice:
        device, uuid, updated_at_ms, stale_json = row
        props: dict[str, dict[str, dict[str, Any]]] = {}
        for prop, source, version_ms, removed, raw, seq in db.execute(
            "SELECT property, source, version_ms, removed, raw, seq FROM desired WHERE device = ?", (device,)
        ):
            if source not in SOURCES:
                log.error("desired store: device %s property %s: unknown source %r skipped", device, prop, source)
                continue
            props.setdefault(prop, {})[source] = {
                "version_ms": int(version_ms),
                "removed": bool(removed),
                "raw": None if raw is None else json.loads(raw),
                "seq": int(seq),
            }
        restore = [r[0] for r in db.execute("SELECT property FROM restore WHERE device = ?", (device,))]
        data = {"format": 1, "properties": props, "restore": restore, "stale_ignored": json.loads(stale_json)}
        return StoredDevice(device, uuid, DesiredState.from_dict(data), int(updated_at_ms))

    @contextmanager
    def _locked(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            try:
                yield self._db
            except sqlite3.OperationalError as exc:
                raise TransientError(f"desired store {self.path}: {exc}") from exc
            except sqlite3.Error as exc:
                raise PermanentError(f"desired store {self.path}: {exc}") from exc
            except OverflowError as exc:  # an integer past SQLite's 64 bits: refused, never out of a loop
                raise InvalidValueError(f"desired store {self.path}: {exc}", reason="out-of-range") from exc

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._locked() as db:
            if self.read_only:
                db = self._writable()
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
