"""The push buffer: samples on their way to the push and DB destinations a Device names, in SQLite (``push.db``).

Every sample a destination is to receive is committed here first and deleted once the destination has it
(``ack``) or refused it for good (``drop``), so what a dead destination could not take waits here, in order, and
a crash loses nothing committed (WAL journal, ``synchronous=NORMAL``, as the telemetry buffer). Each destination is
kept with its spec (``keys``), so a backlog is delivered after a restart even before any Device names it again.

Bounds: the telemetry buffer's (``buffer.maxBytes``, ``buffer.maxAge``), shared with it: ``shared_bytes`` is what
the telemetry buffer holds, and the push buffer drops its OLDEST samples (whatever their destination) when it and
the telemetry together would hold more than ``max_bytes``, or when a sample is older than ``max_age_s`` (by the
sample's own time). Drops are counted per destination and reason (``size``, ``age``, ``refused``, ``corrupt``). A
corrupt or unreadable file is renamed ``push.db.corrupt-<wall ms>`` and a fresh one started.

The push package sees it through ``mapper.edge.push.destination.PushStore``. Call it from one thread (the loop).
"""

from __future__ import annotations

import logging
import os
import sqlite3
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from mapper.clock import Clock, SystemClock
from mapper.edge.storage.sqlitefiles import DEGRADED_AT_START, move_aside, unwritable_reason
from mapper.errors import ConfigError, PermanentError, TransientError

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
#: Bytes counted for each stored sample on top of its payload (its row, its index entry).
ROW_OVERHEAD_BYTES = 32
PUSH_DROP_REASONS = ("size", "age", "refused", "corrupt")
_T = TypeVar("_T")


class _Corrupt(Exception):
    pass


def _is_corrupt(exc: sqlite3.DatabaseError) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None and code & 0xFF in (11, 26):  # SQLITE_CORRUPT, SQLITE_NOTADB
        return True
    text = str(exc).lower()
    return "malformed" in text or "not a database" in text


class PushBuffer:
    """Samples per destination, oldest first. ``put_many`` takes (key, spec, ts_ms, payload) rows, one collect
    round's, in one transaction; ``pending``/``ack``/``drop`` are a destination's."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_bytes: int,
        max_age_s: float,
        clock: Clock | None = None,
        shared_bytes: Callable[[], int] | None = None,
    ) -> None:
        if max_bytes <= 0:
            raise ConfigError(f"push buffer max_bytes must be > 0, got {max_bytes}")
        if not max_age_s > 0:
            raise ConfigError(f"push buffer max_age_s must be > 0, got {max_age_s}")
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self.clock: Clock = clock or SystemClock()
        self.shared_bytes = shared_bytes
        self._conn: sqlite3.Connection | None = None
        self._closed = False
        #: destination key -> (its row id, its spec)
        self._dests: dict[str, tuple[int, str]] = {}
        self._key_of: dict[int, str] = {}
        #: destination key -> [samples, bytes] stored now
        self._backlog: dict[str, list[int]] = {}
        #: (destination key, reason) -> samples dropped
        self._drops: dict[tuple[str, str], int] = {}
        self._last_drop_log: float | None = None
        self.files_moved_aside = 0
        #: Why the file cannot be opened now (``data dir full``, ``data dir read-only``); "" while it is open.
        self.degraded = ""
        self._last_open_try = 0.0
        self._open()

    # ------------------------------------------------------------------------------------------ open

    def _open(self) -> None:
        try:
            self._connect()
        except _Corrupt as exc:
            self._move_aside(str(exc))
            try:
                self._connect()
            except (_Corrupt, sqlite3.Error) as exc2:
                raise PermanentError(f"push buffer {self.path}: a fresh file does not open either: {exc2}") from None
        except sqlite3.Error as exc:
            why = unwritable_reason(exc, self.path.parent)
            if why not in DEGRADED_AT_START:
                raise PermanentError(f"push buffer {self.path}: cannot open: {exc}") from None
            # A full or read-only data dir: the mapper runs without the push buffer until it opens (tried again
            # at most once a second, at the next write); a backlog the file holds waits there, nothing is lost.
            if not self.degraded:
                log.error(
                    "push buffer %s: cannot open it (%s: %s); the push destinations' samples are not kept until "
                    "it opens again (what it holds waits in it)",
                    self.path,
                    why,
                    exc,
                )
            self.degraded = why
            self._last_open_try = self.clock.monotonic()

    def _reopen(self) -> None:
        """Open the file; while degraded, at most once a second (a call in between finds no connection)."""
        if self.degraded and self.clock.monotonic() - self._last_open_try < 1.0:
            return
        was = self.degraded
        self._open()
        if was and self._conn is not None:
            self.degraded = ""
            log.warning("push buffer %s: open again (the data dir takes writes); storing resumes", self.path)

    def _connect(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(self.path, isolation_level=None, timeout=5.0)
        try:
            try:
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=NORMAL")
                conn.execute("PRAGMA journal_size_limit=8388608")
                verdict = conn.execute("PRAGMA quick_check").fetchone()[0]
                if verdict != "ok":
                    raise _Corrupt(f"quick_check says {verdict}")
                conn.executescript(
                    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;"
                    "CREATE TABLE IF NOT EXISTS destinations (id INTEGER PRIMARY KEY, key TEXT NOT NULL UNIQUE, "
                    "spec TEXT NOT NULL);"
                    "CREATE TABLE IF NOT EXISTS samples (id INTEGER PRIMARY KEY, dest INTEGER NOT NULL, "
                    "ts_ms INTEGER NOT NULL, payload BLOB NOT NULL);"
                    "CREATE INDEX IF NOT EXISTS samples_by_dest ON samples (dest, id);"
                )
                row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
                if row is None:
                    conn.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
                elif int(row[0]) > SCHEMA_VERSION:
                    raise PermanentError(f"push buffer schema {row[0]} is newer than this mapper's ({SCHEMA_VERSION})")
                dests = conn.execute("SELECT id, key, spec FROM destinations").fetchall()
                counts = conn.execute(
                    f"SELECT dest, COUNT(*), SUM(length(payload) + {ROW_OVERHEAD_BYTES}) FROM samples GROUP BY dest"
                ).fetchall()
            except sqlite3.DatabaseError as exc:
                if _is_corrupt(exc):
                    raise _Corrupt(str(exc)) from None
                raise
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        self._dests = {str(key): (int(i), str(spec)) for i, key, spec in dests}
        self._key_of = {i: key for key, (i, _) in self._dests.items()}
        self._backlog = {}
        for dest, n, size in counts:
            key = self._key_of.get(int(dest))
            if key is not None:
                self._backlog[key] = [int(n), int(size)]

    def _move_aside(self, why: str) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except sqlite3.Error:
                pass
            self._conn = None
        for key, (n, _) in self._backlog.items():
            if n:
                self._drops[(key, "corrupt")] = self._drops.get((key, "corrupt"), 0) + n
        self._backlog = {}
        target = move_aside(self.path, self.clock.wall_ms())
        self.files_moved_aside += 1
        log.error(
            "push buffer %s is corrupt or unreadable (%s): moved aside to %s, starting a new one",
            self.path,
            why,
            target,
        )

    def _run(self, op: Callable[[sqlite3.Connection], _T]) -> _T:
        """One operation; a corrupt file is moved aside and the operation tried once more on a fresh one."""
        if self._closed:
            raise PermanentError(f"push buffer {self.path} is closed")
        for attempt in (1, 2):
            if self._conn is None:
                self._reopen()
            if self._conn is None:
                raise TransientError(f"push buffer {self.path}: {self.degraded}; nothing stored")
            try:
                return op(self._conn)
            except sqlite3.DatabaseError as exc:
                if self._conn is not None and self._conn.in_transaction:
                    try:
                        self._conn.execute("ROLLBACK")
                    except sqlite3.Error:
                        pass
                if _is_corrupt(exc) and attempt == 1:
                    self._move_aside(str(exc))
                    self._open()
                    continue
                if isinstance(exc, sqlite3.OperationalError):
                    raise TransientError(f"push buffer {self.path}: {exc}") from None
                raise PermanentError(f"push buffer {self.path}: {exc}") from None
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------------------------------ writes

    def put_many(self, rows: Sequence[tuple[str, str, int, bytes]]) -> None:
        """Store samples, each (destination key, its spec, the sample's time in ms, payload), in one transaction
        (committed when this returns), then enforce the bounds in it. ``TransientError`` when SQLite cannot
        (nothing of the call is stored)."""
        if not rows:
            return

        def write(
            conn: sqlite3.Connection,
        ) -> tuple[dict[str, tuple[int, str]], list[tuple[str, int]], list[tuple[str, str, int, int]]]:
            conn.execute("BEGIN IMMEDIATE")
            new_dests: dict[str, tuple[int, str]] = {}
            added: list[tuple[str, int]] = []
            values = []
            for key, spec, ts_ms, payload in rows:
                known = self._dests.get(key) or new_dests.get(key)
                if known is None:
                    cur = conn.execute("INSERT INTO destinations (key, spec) VALUES (?, ?)", (key, spec))
                    known = new_dests[key] = (int(cur.lastrowid or 0), spec)
                elif known[1] != spec:
                    conn.execute("UPDATE destinations SET spec = ? WHERE id = ?", (spec, known[0]))
                    new_dests[key] = (known[0], spec)
                values.append((known[0], int(ts_ms), payload))
                added.append((key, len(payload) + ROW_OVERHEAD_BYTES))
            conn.executemany("INSERT INTO samples (dest, ts_ms, payload) VALUES (?, ?, ?)", values)
            key_of = dict(self._key_of)
            key_of.update({i: k for k, (i, _) in new_dests.items()})
            stored = sum(b for _, b in self._backlog.values()) + sum(size for _, size in added)
            drops = self._drop_due(conn, stored, key_of)
            conn.execute("COMMIT")
            return new_dests, added, drops

        new_dests, added, drops = self._run(write)
        for key, spec in new_dests.items():
            self._dests[key] = spec
            self._key_of[spec[0]] = key
        for key, size in added:
            counts = self._backlog.setdefault(key, [0, 0])
            counts[0] += 1
            counts[1] += size
        for key, reason, n, size in drops:
            self._count_drop(key, reason, n, size)

    def _drop_due(
        self, conn: sqlite3.Connection, stored: int, key_of: dict[int, str]
    ) -> list[tuple[str, str, int, int]]:
        """Delete, oldest id first, the samples older than ``max_age_s`` up to the first young enough to keep,
        then the oldest until this buffer and the telemetry's are within ``max_bytes`` together. Returns the drops
        (key, reason, samples, bytes) to count once committed."""
        cutoff = self.clock.wall_ms() - round(self.max_age_s * 1000)
        limit = self.max_bytes - (self.shared_bytes() if self.shared_bytes is not None else 0)
        doomed: list[tuple[int, int, int, str]] = []  # (id, dest, size, reason)
        cur = conn.execute(f"SELECT id, dest, ts_ms, length(payload) + {ROW_OVERHEAD_BYTES} FROM samples ORDER BY id")
        try:
            for row_id, dest, ts_ms, size in cur:
                if ts_ms < cutoff:
                    doomed.append((row_id, dest, size, "age"))
                elif stored > limit:
                    doomed.append((row_id, dest, size, "size"))
                else:
                    break
                stored -= size
        finally:
            cur.close()
        if not doomed:
            return []
        conn.execute("DELETE FROM samples WHERE id <= ?", (doomed[-1][0],))
        out: dict[tuple[str, str], list[int]] = {}
        for _, dest, size, reason in doomed:
            counts = out.setdefault((key_of.get(dest, "?"), reason), [0, 0])
            counts[0] += 1
            counts[1] += size
        return [(key, reason, n, size) for (key, reason), (n, size) in out.items()]

    def _count_drop(self, key: str, reason: str, n: int, size: int) -> None:
        counts = self._backlog.get(key)
        if counts is not None:
            counts[0] = max(0, counts[0] - n)
            counts[1] = max(0, counts[1] - size)
        self._drops[(key, reason)] = self._drops.get((key, reason), 0) + n
        if reason == "refused":
            return  # the destination logs its refusals
        now = self.clock.monotonic()
        if self._last_drop_log is None or now - self._last_drop_log >= 60.0:
            self._last_drop_log = now
            log.warning(
                "push buffer %s: dropped the %d oldest samples of %s (%s; logged once a minute)",
                self.path,
                n,
                key,
                "older than buffer.maxAge" if reason == "age" else "over buffer.maxBytes",
            )

    def _delete(self, key: str, ids: Sequence[int]) -> tuple[int, int]:
        dest = self._dests.get(key)
        if dest is None or not ids:
            return 0, 0

        def delete(conn: sqlite3.Connection) -> tuple[int, int]:
            conn.execute("BEGIN IMMEDIATE")
            n = size = 0
            for i in ids:
                row = conn.execute(
                    f"DELETE FROM samples WHERE id = ? AND dest = ? RETURNING length(payload) + {ROW_OVERHEAD_BYTES}",
                    (i, dest[0]),
                ).fetchone()
                if row is not None:
                    n += 1
                    size += int(row[0])
            conn.execute("COMMIT")
            return n, size

        return self._run(delete)

    def ack(self, key: str, ids: Sequence[int]) -> None:
        """The destination has these samples: forget them (ids already gone are ignored)."""
        n, size = self._delete(key, ids)
        counts = self._backlog.get(key)
        if counts is not None:
            counts[0] = max(0, counts[0] - n)
            counts[1] = max(0, counts[1] - size)

    def drop(self, key: str, ids: Sequence[int], reason: str) -> None:
        """The destination refused these samples for good: delete them, counted under ``reason``."""
        n, size = self._delete(key, ids)
        if n:
            self._count_drop(key, reason, n, size)

    def forget(self, key: str) -> None:
        """A destination no Device names any more and that holds nothing: its row goes (a new one starts afresh)."""
        dest = self._dests.get(key)
        if dest is None or self._backlog.get(key, [0, 0])[0]:
            return

        def delete(conn: sqlite3.Connection) -> None:
            conn.execute(
                "DELETE FROM destinations WHERE id = ? AND NOT EXISTS (SELECT 1 FROM samples WHERE dest = ?)",
                (dest[0], dest[0]),
            )

        self._run(delete)
        self._dests.pop(key, None)
        self._key_of.pop(dest[0], None)
        self._backlog.pop(key, None)

    # ------------------------------------------------------------------------------------------ reads

    def pending(self, key: str, limit: int) -> list[tuple[int, bytes]]:
        """Up to ``limit`` samples of a destination, oldest first: (id, payload)."""
        dest = self._dests.get(key)
        if dest is None:
            return []

        def select(conn: sqlite3.Connection) -> list[tuple[int, bytes]]:
            rows = conn.execute(
                "SELECT id, payload FROM samples WHERE dest = ? ORDER BY id LIMIT ?", (dest[0], limit)
            ).fetchall()
            return [(int(r[0]), bytes(r[1])) for r in rows]

        return self._run(select)

    def backlog(self, key: str) -> tuple[int, int]:
        """(samples, bytes) a destination has waiting."""
        counts = self._backlog.get(key)
        return (counts[0], counts[1]) if counts is not None else (0, 0)

    def keys(self) -> dict[str, str]:
        """Every destination that has samples waiting, with its spec."""
        return {key: spec for key, (_, spec) in self._dests.items() if self._backlog.get(key, [0, 0])[0] > 0}

    def drops(self) -> dict[tuple[str, str], int]:
        """Samples dropped since start, by (destination key, reason)."""
        return dict(self._drops)

    @property
    def stored_bytes(self) -> int:
        return sum(size for _, size in self._backlog.values())

    @property
    def stored_samples(self) -> int:
        return sum(n for n, _ in self._backlog.values())

    def close(self) -> None:
        self._closed = True
        if self._conn is not None:
            try:
                self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            except sqlite3.Error as exc:
                log.warning("push buffer %s: checkpoint at close failed: %s", self.path, exc)
            self._conn.close()
            self._conn = None
