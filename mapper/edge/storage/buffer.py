"""The offline buffer: encoded telemetry batches in SQLite (the stdlib sqlite3), bounded and crash-safe.

A batch is committed here BEFORE it is published and deleted only after the broker acknowledged it, so a crash
at any moment loses nothing that was stored. Durability: WAL journal with ``synchronous=NORMAL``. A process
crash (SIGKILL, OOM kill, exception) loses nothing committed; a power loss or kernel crash can lose the
transactions committed since the last WAL sync (at most the last checkpoint interval, about 1000 pages = 4 MiB
of batches, typically the last few seconds to minutes of telemetry). ``synchronous="FULL"`` closes that
window at the cost of one fsync per batch. See docs/telemetry.md.

Bounds: ``max_bytes`` (payload bytes plus ``ROW_OVERHEAD_BYTES`` per batch) and ``max_age_s`` (by the batch's
last sample time); the OLDEST batches go first and every drop is counted by reason (``size``, ``age``,
``disk_full``, ``unwritable``, ``corrupt``), in batches and in samples (rows; ``corrupt`` in batches only). A
corrupt or unreadable file is renamed ``<file>.corrupt-<wall ms>`` and a fresh one started (logged at ERROR).
``max_bytes`` is shared with the push buffer (``shared_bytes``: what it holds; ``mapper.edge.storage.pushbuffer``):
each drops its own oldest when the two together would hold more.

**A full or read-only data dir degrades, never stops.** A full disk drops the oldest batches and retries; so that
this can work at all on a full file system (a WAL-mode delete needs room in the WAL), the buffer keeps a reserve
file (``<file>-reserve``, ``reserve_bytes``) that it deletes at the first full write, then checkpoints the WAL.
When a write still cannot be stored (nothing left to drop, a read-only mount, an I/O error), the buffer keeps the
batches in memory (``memory_max_bytes``; the oldest dropped beyond it, counted), in the same id order, and
serves them from there (``pending``, ``ack``, the latest state snapshots too): telemetry goes on to the broker.
``degraded`` says why (``data dir full``, ``data dir read-only``...). The file is tried again at most once a second,
whichever write met the full disk first, by the same policy (the reserve, then the oldest dropped); once a write
works the batches kept in memory are stored, the reserve made again when the file system has room for it twice
over, and ``degraded`` cleared. A file the data dir does not let open at all (a start on a full or read-only
data dir) is read through a read-only connection and the buffer starts degraded (``_open_read_only``). ``close``
stores what it can and counts the rest as dropped. No call raises a raw ``sqlite3`` error: a write that cannot be
done is a ``TransientError`` (or kept in memory).

Writes: ``put`` stores one batch, ``put_many`` several (a collect round's) in one transaction, as the same
puts would one by one; both enforce the bounds in the transaction that stores. All calls are quick, synchronous
SQLite statements; call them from one thread (the asyncio loop).
"""

from __future__ import annotations

import logging
import os
import sqlite3
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from mapper.clock import Clock, SystemClock
from mapper.edge.outbox.records import CompactionRow, StoredBatch, peek_header
from mapper.edge.storage.sqlitefiles import (
    DATA_DIR_FULL,
    DEGRADED_AT_START,
    move_aside,
    open_read_only,
    unwritable_reason,
)
from mapper.errors import ConfigError, MapperError, PermanentError, TransientError
from mapper.wire.telemetry import MERGED_FORMAT_VERSION, MERGED_VERSIONS, batch_rows

log = logging.getLogger(__name__)

SCHEMA_VERSION = 3
#: Bytes counted against ``max_bytes`` for each stored batch on top of its payload (its SQLite row and page slack).
ROW_OVERHEAD_BYTES = 24
#: A batch's size as counted against ``max_bytes`` (SQL expression over a ``batches`` row).
_SIZE_SQL = f"(length(payload) + {ROW_OVERHEAD_BYTES})"
#: 1 KiB pages (only applies to a new file): merged batches span several pages, and the last, partly filled one
#: of each costs less in small pages (measured: docs/benchmarks.md); a few fixed pages for the small tables.
PAGE_SIZE = 1024
DROP_REASONS = ("size", "age", "disk_full", "unwritable", "corrupt")
#: What ``Buffer.degraded`` says of a data dir that cannot be written (``mapper.edge.storage.sqlitefiles``).
#: Ids of what a buffer opened read-only keeps in memory start this far above the largest id its file shows: the
#: file's ``-wal`` (not read) may hold rows with larger ids, and the memory's rows must never meet them.
READ_ONLY_ID_GAP = 2**32
#: While degraded, a write to the file is tried again at most this often (s); in between, batches go to memory.
RETRY_WRITE_S = 1.0
Synchronous = Literal["OFF", "NORMAL", "FULL"]

_SQLITE_CORRUPT = 11
_SQLITE_FULL = 13
_SQLITE_NOTADB = 26
_T = TypeVar("_T")


#: The version bytes of a merged batch (mapper.wire.telemetry.MERGED_VERSIONS: formats 3 and 4).
MERGED_VERSION_BYTES = frozenset(bytes((v,)) for v in MERGED_VERSIONS)
#: The version byte of a merged batch in its cold form (mapper.wire.telemetry.MERGED_FORMAT_VERSION).
COLD_VERSION = bytes((MERGED_FORMAT_VERSION,))


@dataclass(frozen=True)
class BufferStats:
    bytes: int
    batches: int
    oldest_ts_ms: int | None
    oldest_age_s: float | None
    drops_by_reason: dict[str, int] = field(default_factory=dict)
    files_moved_aside: int = 0
    #: Samples (rows) in the batches dropped, by reason.
    drop_samples_by_reason: dict[str, int] = field(default_factory=dict)
    #: Why the data dir cannot be written now ("" while it can): ``data dir full``, ``data dir read-only``...
    degraded: str = ""
    #: Batches kept in memory because the file could not take them.
    memory_batches: int = 0


_StreamKey = tuple[str, str, str, str, int, bool, str]
#: A stored batch's columns (``_stored`` makes the record of them), over ``batches b JOIN streams s``.
_BATCH_COLUMNS = "b.id, s.device, s.uuid, s.boot_id, b.ts_last_rel_ms, s.topic, s.qos, s.retain, b.payload, s.address"


def _table_names(conn: sqlite3.Connection) -> set[str]:
    return {str(row[0]) for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def _is_corrupt(exc: sqlite3.DatabaseError) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None and code & 0xFF in (_SQLITE_CORRUPT, _SQLITE_NOTADB):
        return True
    text = str(exc).lower()
    return "malformed" in text or "not a database" in text or "file is encrypted" in text


def _is_full(exc: sqlite3.DatabaseError) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None and code & 0xFF == _SQLITE_FULL:
        return True
    return "database or disk is full" in str(exc).lower()


def _drop_reason(why: str) -> str:
    return "disk_full" if why == DATA_DIR_FULL else "unwritable"


def _stored(r: Sequence[Any], epoch_ms: int) -> StoredBatch:
    """A ``_BATCH_COLUMNS`` row as the record (its seq and first sample time are in its payload only)."""
    return StoredBatch(
        device=r[1],
        uuid=r[2],
        boot_id=r[3],
        seq=None,
        ts_first_ms=None,
        ts_last_ms=int(r[4]) + epoch_ms,
        topic=r[5],
        payload=bytes(r[8]),
        qos=int(r[6]),
        retain=bool(r[7]),
        address=r[9],
        id=int(r[0]),
    )


def read_batches(conn: sqlite3.Connection) -> Iterator[StoredBatch]:
    """Every stored batch of a buffer file (schema 3) open on ``conn``, oldest id first: what the buffer tool
    reads, on its own read-only connection, in the transaction it holds."""
    epoch_ms = int(conn.execute("SELECT value FROM meta WHERE key = 'epoch_ms'").fetchone()[0])
    rows = conn.execute(f"SELECT {_BATCH_COLUMNS} FROM batches b JOIN streams s ON s.id = b.stream ORDER BY b.id")
    for r in rows:
        yield _stored(r, epoch_ms)


#: A checked batch ready to insert: (stream key, ts_last_ms, payload).
_Row = tuple[_StreamKey, int, bytes]
#: Batches deleted by a bound, to count once committed: (reason, batches, bytes, samples).
_Drop = tuple[str, int, int, int]


def _batches(n: int) -> str:
    return "batch" if n == 1 else f"{n} batches"


def _checked_row(batch: StoredBatch, where: str) -> _Row:
    """A batch as ``_store`` inserts it; ValueError naming the batch (``where``: its place in a call) and its
    fault when it has an empty topic, a QoS other than 0, 1, 2, or ``ts_last_ms`` before ``ts_first_ms``."""
    b = batch
    if b.topic and b.qos in (0, 1, 2) and b.ts_last_ms >= b.ts_first_ms:
        return (b.device, b.uuid, b.boot_id, b.topic, b.qos, bool(b.retain), b.address), b.ts_last_ms, b.payload
    what = f"batch {b.device} seq {b.seq}{where}"
    if not b.topic:
        raise ValueError(f"{what}: empty topic")
    if b.qos not in (0, 1, 2):
        raise ValueError(f"{what}: qos must be 0, 1 or 2, got {b.qos}")
    raise ValueError(f"{what}: ts_last_ms {b.ts_last_ms} is before ts_first_ms {b.ts_first_ms}")


def _extend(runs: list[tuple[int, str]], row_id: int, reason: str) -> None:
    """Add a dropped row to the runs of drops by reason (the last run grows when the reason is the same)."""
    if runs and runs[-1][1] == reason:
        runs[-1] = (row_id, reason)
    else:
        runs.append((row_id, reason))


#: Larger than any row id: ``enforce_bounds`` sees every stored batch.
_NO_ID_LIMIT = 2**63 - 1


class _Corrupt(Exception):
    pass


class Buffer:
    """Encoded batches waiting for a PUBACK, plus the latest state snapshot of every device."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_bytes: int,
        max_age_s: float,
        clock: Clock | None = None,
        synchronous: Synchronous = "NORMAL",
        check_on_open: bool = True,
        max_page_count: int | None = None,
        shared_bytes: Callable[[], int] | None = None,
        memory_max_bytes: int = 0,
        reserve_bytes: int = 0,
    ) -> None:
        """``shared_bytes``: what another store holds within the same ``max_bytes`` (the push buffer,
        ``mapper.edge.storage.pushbuffer``): this buffer drops its oldest batches when both together hold more.
        ``memory_max_bytes``: how much may be kept in memory while the file cannot be written (0: none; a write
        that cannot be stored then raises ``TransientError``, its batches counted as dropped). ``reserve_bytes``:
        the reserve file deleted at the first full write, so that dropping the oldest can work (0: none)."""
        if max_bytes <= 0:
            raise ConfigError(f"buffer max_bytes must be > 0, got {max_bytes}")
        if not max_age_s > 0:
            raise ConfigError(f"buffer max_age_s must be > 0, got {max_age_s}")
        if synchronous not in ("OFF", "NORMAL", "FULL"):
            raise ConfigError(f"buffer synchronous must be OFF, NORMAL or FULL, got {synchronous!r}")
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self.clock: Clock = clock or SystemClock()
        self.synchronous = synchronous
        self.check_on_open = check_on_open
        self.max_page_count = max_page_count
        self.shared_bytes = shared_bytes
        self.drops: dict[str, int] = dict.fromkeys(DROP_REASONS, 0)
        #: Samples (rows) in the batches dropped, by reason (``corrupt`` drops are not read, so not counted).
        self.drop_samples: dict[str, int] = dict.fromkeys(DROP_REASONS, 0)
        self.files_moved_aside = 0
        self.memory_max_bytes = memory_max_bytes
        self.reserve_bytes = reserve_bytes
        self.reserve_path = self.path.with_name(self.path.name + "-reserve")
        #: Why the data dir cannot be written now ("" while it can).
        self.degraded = ""
        #: Rows kept in memory while the file cannot be written: id -> (row, counted size), in id order.
        self._memory: dict[int, tuple[_Row, int]] = {}
        self._memory_bytes = 0
        #: Latest state snapshots not stored in the file yet: device -> (ts_ms, payload).
        self._memory_latest: dict[str, tuple[int, bytes]] = {}
        #: Rows acknowledged whose delete did not reach the file yet: id -> counted size (deleted with the next
        #: write that works).
        self._acked: dict[int, int] = {}
        self._last_write_try: float | None = None
        #: Why the file is open read-only ("" while it is open for writing): a start on a data dir that takes no
        #: writes (``_open_read_only``); it is opened for writing again by the next retry that can.
        self._read_only = ""
        #: What the last write that failed met, as the error of a call that could not store says it.
        self._write_failure = ""
        #: Whether a failed drop of the oldest was logged while degraded (it is tried again every second).
        self._drop_failure_logged = False
        self._conn: sqlite3.Connection | None = None
        self._closed = False
        self._last_drop_log: float | None = None
        self._streams: dict[_StreamKey, int] = {}
        self._next_id = 1
        self._epoch_ms = 0
        self._bytes = 0
        self._batches = 0
        self._open()
        self._make_reserve()

    # ------------------------------------------------------------------------------------------ open / reset

    def _open(self) -> None:
        try:
            self._connect()
        except _Corrupt as exc:
            self._move_aside(str(exc))
            try:
                self._connect()
            except (_Corrupt, sqlite3.Error) as exc2:
                raise PermanentError(f"buffer {self.path}: a fresh database does not open either: {exc2}") from None
        except sqlite3.Error as exc:
            why = self._why(exc)
            if why is None or why not in DEGRADED_AT_START or self.memory_max_bytes <= 0:
                raise PermanentError(f"buffer {self.path}: cannot open: {exc}") from None
            self._open_read_only(why, exc)

    def _why(self, exc: sqlite3.Error) -> str | None:
        """Why a call failed because the data dir cannot take a write (``unwritable_reason``), or None."""
        return unwritable_reason(exc, self.path.parent)

    def _open_read_only(self, why: str, exc: sqlite3.Error) -> None:
        """The data dir does not let the file open for writing (full: SQLite cannot even extend its ``-shm``;
        read-only): what the file holds is read through a read-only connection (``open_read_only``; an empty
        in-memory buffer when even that fails), the buffer starts degraded, new batches go to memory with ids
        ``READ_ONLY_ID_GAP`` above the file's, and each retry first tries to open the file for writing."""
        conn: sqlite3.Connection | None = None
        try:
            conn = open_read_only(self.path)
            if not {"meta", "streams", "batches", "latest"} <= _table_names(conn):
                raise sqlite3.DatabaseError("not a buffer file (yet)")
            version = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            if version is None or int(version[0]) != SCHEMA_VERSION:
                raise sqlite3.DatabaseError(f"schema {version and version[0]}, not {SCHEMA_VERSION}")
            read = "what it holds is read from it"
        except (sqlite3.Error, ValueError) as read_exc:
            if conn is not None:
                conn.close()
            conn = sqlite3.connect(":memory:", isolation_level=None)
            self._create_schema(conn, self.clock.wall_ms())
            read = f"nothing of it can be read now ({read_exc}): it is left as it is"
        epoch = conn.execute("SELECT value FROM meta WHERE key = 'epoch_ms'").fetchone()
        row = conn.execute(
            f"SELECT COUNT(*), COALESCE(SUM({_SIZE_SQL}), 0), COALESCE(MAX(id), 0) FROM batches"
        ).fetchone()
        self._conn = conn
        self._batches, self._bytes = int(row[0]), int(row[1])
        self._epoch_ms = int(epoch[0])
        self._next_id = max(self._next_id, int(row[2]) + 1 + READ_ONLY_ID_GAP)
        self._streams = {}
        self._read_only = why
        log.error("buffer %s: cannot open it for writing (%s: %s); %s", self.path, why, exc, read)
        self._degrade(why)

    def _reopen(self) -> bool:
        """A file open read-only (``_open_read_only``) opened for writing, when the data dir lets it now."""
        read_only = self._conn
        self._conn = None
        try:
            self._connect()
        except (_Corrupt, sqlite3.Error) as exc:
            self._conn = read_only
            why = self._why(exc) if isinstance(exc, sqlite3.Error) else None
            log.debug("buffer %s: still cannot open it for writing: %s", self.path, exc)
            if why is not None:
                self.degraded = why
            return False
        if read_only is not None:
            read_only.close()
        log.warning("buffer %s: open for writing again", self.path)
        self._read_only = ""
        return True

    def _connect(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(self.path, isolation_level=None, timeout=5.0)
        try:
            try:
                conn.execute(f"PRAGMA page_size={PAGE_SIZE}")
                # A new file only (like the page size): compaction frees pages, replace() returns them.
                conn.execute("PRAGMA auto_vacuum=INCREMENTAL")
                mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
                if str(mode).lower() != "wal":
                    log.warning("buffer %s: journal mode is %s, not wal", self.path, mode)
                conn.execute(f"PRAGMA synchronous={self.synchronous}")
                conn.execute("PRAGMA journal_size_limit=8388608")
                if self.max_page_count is not None:
                    conn.execute(f"PRAGMA max_page_count={int(self.max_page_count)}")
                if self.check_on_open:
                    verdict = conn.execute("PRAGMA quick_check").fetchone()[0]
                    if verdict != "ok":
                        raise _Corrupt(f"quick_check says {verdict}")
                self._create_schema(conn, self.clock.wall_ms())
                epoch = conn.execute("SELECT value FROM meta WHERE key = 'epoch_ms'").fetchone()
                row = conn.execute(
                    f"SELECT COUNT(*), COALESCE(SUM({_SIZE_SQL}), 0), COALESCE(MAX(id), 0) FROM batches"
                ).fetchone()
            except sqlite3.DatabaseError as exc:
                if _is_corrupt(exc):
                    raise _Corrupt(str(exc)) from None
                raise
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        self._batches, self._bytes = int(row[0]), int(row[1])
        self._epoch_ms = int(epoch[0])
        # Ids only grow while this process runs (a replay cursor never skips a new batch), without the
        # sqlite_sequence page AUTOINCREMENT would cost.
        self._next_id = max(self._next_id, int(row[2]) + 1)
        self._streams = {}

    @staticmethod
    def _create_schema(conn: sqlite3.Connection, now_ms: int) -> None:
        """Schema 3: rows as small as SQLite allows (bytes at rest are what this buffer is measured by).

        ``streams`` turns the text that repeats per batch (device, uuid, boot id, topic, address) into a small
        integer; ``batches`` keeps the integer primary key as its only index and, besides the stream and the
        payload, only what a query needs: the last sample time (the age bound), relative to the file's
        ``epoch_ms`` (3 or 4 bytes instead of 6). No size column (``length(payload)``), no sequence number and
        no first time (both are in the payload; ``StoredBatch`` reads them from it when asked). ``latest`` and
        ``meta`` are WITHOUT ROWID, so no table here has a separate index. A schema 1 or 2 file (earlier builds)
        is converted in place."""
        tables = _table_names(conn)
        if "meta" not in tables:
            conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID")
        row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        version = int(row[0]) if row is not None else (1 if "batches" in tables else SCHEMA_VERSION)
        if version > SCHEMA_VERSION:
            raise PermanentError(f"buffer schema {version} is newer than this mapper's ({SCHEMA_VERSION})")
        complete = {"streams", "batches", "latest"} <= tables
        has_epoch = conn.execute("SELECT 1 FROM meta WHERE key = 'epoch_ms'").fetchone() is not None
        if version == SCHEMA_VERSION and complete and has_epoch:
            return
        conn.execute("BEGIN IMMEDIATE")
        try:
            if version < 2 and "batches" in tables:
                conn.execute("ALTER TABLE batches RENAME TO batches_v1")
                conn.execute("ALTER TABLE streams RENAME TO streams_v1")
                tables -= {"batches", "streams"}
            elif version == 2 and "batches" in tables:
                conn.execute("ALTER TABLE batches RENAME TO batches_v2")
                tables -= {"batches"}
            if "streams" not in tables:
                conn.execute(
                    "CREATE TABLE streams (id INTEGER PRIMARY KEY, device TEXT NOT NULL, uuid TEXT NOT NULL, "
                    "boot_id TEXT NOT NULL, topic TEXT NOT NULL, qos INTEGER NOT NULL, retain INTEGER NOT NULL, "
                    "address TEXT NOT NULL)"
                )
            if "batches" not in tables:
                conn.execute(
                    "CREATE TABLE batches (id INTEGER PRIMARY KEY, stream INTEGER NOT NULL, "
                    "ts_last_rel_ms INTEGER NOT NULL, payload BLOB NOT NULL)"
                )
            epoch_ms = now_ms
            if version < 2 and "batches_v1" in _table_names(conn):
                first = conn.execute("SELECT MIN(ts_first_ms) FROM batches_v1").fetchone()[0]
                epoch_ms = now_ms if first is None else int(first)
                conn.execute(
                    "INSERT INTO streams SELECT id, device, uuid, boot_id, topic, qos, retain, address FROM streams_v1"
                )
                conn.execute(
                    "INSERT INTO batches SELECT id, stream, ts_last_ms - ?, payload FROM batches_v1", (epoch_ms,)
                )
                conn.execute("DROP TABLE batches_v1")
                conn.execute("DROP TABLE streams_v1")
                log.warning("buffer: converted a schema 1 file to schema %d", SCHEMA_VERSION)
            if version == 2 and "batches_v2" in _table_names(conn):
                conn.execute(
                    "INSERT INTO batches SELECT id, stream, ts_first_rel_ms + span_ms, payload FROM batches_v2"
                )
                conn.execute("DROP TABLE batches_v2")
                log.warning("buffer: converted a schema 2 file to schema %d", SCHEMA_VERSION)
            if "latest" in tables and version < 2:
                conn.execute("ALTER TABLE latest RENAME TO latest_v1")
                conn.execute(
                    "CREATE TABLE latest (device TEXT PRIMARY KEY, ts_ms INTEGER NOT NULL, payload BLOB NOT NULL) "
                    "WITHOUT ROWID"
                )
                conn.execute("INSERT INTO latest SELECT device, ts_ms, payload FROM latest_v1")
                conn.execute("DROP TABLE latest_v1")
            elif "latest" not in tables:
                conn.execute(
                    "CREATE TABLE latest (device TEXT PRIMARY KEY, ts_ms INTEGER NOT NULL, payload BLOB NOT NULL) "
                    "WITHOUT ROWID"
                )
            conn.execute(
                "INSERT INTO meta (key, value) VALUES ('schema_version', ?) "
                "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                (str(SCHEMA_VERSION),),
            )
            conn.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('epoch_ms', ?)", (str(epoch_ms),))
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    def _move_aside(self, why: str) -> None:
        lost = self._batches
        if self._conn is not None:
            try:
                self._conn.close()
            except sqlite3.Error:
                pass
            self._conn = None
        target = move_aside(self.path, self.clock.wall_ms())
        self.files_moved_aside += 1
        self.drops["corrupt"] += lost
        self._batches = self._bytes = 0
        log.error(
            "buffer %s is corrupt or unreadable (%s): moved aside to %s, starting a new one (%d batches known lost)",
            self.path,
            why,
            target,
            lost,
        )

    def _run(self, op: Callable[[sqlite3.Connection], _T]) -> _T:
        """``_run_raw``, with any other SQLite error a ``TransientError`` naming the file (never a raw ``sqlite3``
        error out of the buffer)."""
        try:
            return self._run_raw(op)
        except sqlite3.Error as exc:
            self._rollback()
            raise TransientError(f"buffer {self.path}: {exc}") from None

    def _run_raw(self, op: Callable[[sqlite3.Connection], _T]) -> _T:
        """Run one operation; a corrupt file is moved aside and the operation retried once on a fresh one."""
        if self._closed:
            raise PermanentError(f"buffer {self.path} is closed")
        for attempt in (1, 2):
            if self._conn is None:
                self._open()
            assert self._conn is not None
            try:
                return op(self._conn)
            except sqlite3.DatabaseError as exc:
                self._rollback()
                if _is_corrupt(exc) and self._read_only:  # read as the last checkpoint left it: never moved aside
                    raise
                if _is_corrupt(exc) and attempt == 1:
                    self._move_aside(str(exc))
                    self._open()
                    continue
                if _is_corrupt(exc):
                    raise PermanentError(f"buffer {self.path}: corrupt again after a reset: {exc}") from None
                raise
        raise AssertionError("unreachable")

    def _rollback(self) -> None:
        if self._conn is not None and self._conn.in_transaction:
            try:
                self._conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass

    # ------------------------------------------------------------------------------------------ writes

    def put(self, batch: StoredBatch) -> int:
        """Store one batch (committed when this returns) and return its id; the bounds are enforced in the same
        transaction. ``put_many`` with one item."""
        return self.put_many((batch,))[0]

    def put_many(self, items: Sequence[StoredBatch]) -> list[int]:
        """Store several batches in ONE transaction (committed when this returns) and return their ids, in order.

        The same as ``put`` for each item in turn, at the cost of one commit: every item is checked first (a bad
        one raises ValueError and nothing of the call is stored), the ids are increasing in item order, and the
        bounds are enforced as if the items had been put one by one (the same batches dropped, counted under the
        same reasons), in the same transaction. All or nothing: a ``TransientError`` (disk still full after
        dropping, or nothing left to drop) means none of them was stored, each counted as a ``disk_full`` drop.
        With ``memory_max_bytes``, batches the file cannot take are kept in memory instead (``degraded``).
        """
        n = len(items)
        rows = [_checked_row(it, f" (item {i} of {n})" if n > 1 else "") for i, it in enumerate(items)]
        if not rows:
            return []
        first_id = self._store(rows)
        return list(range(first_id, first_id + n))

    def _write(self, rows: Sequence[tuple[int, _Row]]) -> Callable[[sqlite3.Connection], tuple[int, list[_Drop]]]:
        """The transaction that inserts ``rows`` (each with its id), deletes the acknowledged rows still in the
        file and enforces the bounds: its result is (bytes added, the drops to count once committed)."""

        def write(conn: sqlite3.Connection) -> tuple[int, list[_Drop]]:
            conn.execute("BEGIN IMMEDIATE")
            epoch_ms = self._epoch_ms  # read here: a file replaced after corruption has a new epoch
            new_streams: dict[_StreamKey, int] = {}
            values = []
            steps = []
            added = 0
            for row_id, (key, ts_last_ms, payload) in rows:
                stream = self._streams.get(key)
                if stream is None:
                    stream = new_streams.get(key)
                    if stream is None:
                        stream = new_streams[key] = self._stream_id(conn, key)
                values.append((row_id, stream, ts_last_ms - epoch_ms, payload))
                size = len(payload) + ROW_OVERHEAD_BYTES
                steps.append((row_id, size))
                added += size
            acked = list(self._acked)
            for i in range(0, len(acked), 500):
                chunk = acked[i : i + 500]
                conn.execute(f"DELETE FROM batches WHERE id IN ({','.join('?' * len(chunk))})", chunk)
            conn.executemany("INSERT INTO batches (id, stream, ts_last_rel_ms, payload) VALUES (?, ?, ?, ?)", values)
            stored = self._bytes - sum(self._acked.values()) + self._shared()
            drops = self._drop_due(conn, stored, steps)
            conn.execute("COMMIT")
            # Only now: a rolled-back transaction must leave no stream id behind.
            self._streams.update(new_streams)
            return added, drops

        return write

    def _committed(self, n: int, added: int, drops: list[_Drop]) -> None:
        """A write of ``n`` rows (``added`` bytes) is committed: the acknowledged rows it deleted go, the drops
        are counted."""
        if self._acked:
            self._batches -= len(self._acked)
            self._bytes -= sum(self._acked.values())
            self._acked = {}
        self._batches += n
        self._bytes += added
        for drop in drops:
            self._count_drop(*drop)

    def _store(self, rows: Sequence[_Row]) -> int:
        """Insert checked rows in one transaction that also enforces the bounds; the id of the first row. While
        degraded (with memory) they join what memory holds, and all of it is written when a retry is due."""
        n = len(rows)
        if self.degraded and self.memory_max_bytes:
            first_id = self._keep(rows, self.degraded)
            self._try_write_again()
            return first_id
        first_id = self._next_id
        result = self._write_rows(list(enumerate(rows, first_id)), drop_oldest=True)
        if isinstance(result, str):
            if self.memory_max_bytes:
                return self._keep(rows, result)
            self._degrade(result)
            self._count_lost(rows, _drop_reason(result))
            raise TransientError(f"buffer {self.path}: {self._write_failure}; {_batches(n)} lost")
        self._next_id = first_id + n
        self._committed(n, *result)
        if self.degraded:
            self._recovered()
        return first_id

    def _write_rows(self, numbered: Sequence[tuple[int, _Row]], *, drop_oldest: bool) -> tuple[int, list[_Drop]] | str:
        """Write rows (each with its id) in one transaction, by the full-disk policy: on a full disk the reserve
        file goes (and the WAL is checkpointed), then, with ``drop_oldest``, the oldest 10 % of the file's batches
        (counted ``disk_full``), and the write is tried again (8 tries in all). The write's result (bytes added,
        drops), or why the data dir does not take it (``DATA_DIR_FULL``...; then nothing of it is stored).
        ``TransientError`` for any other failure."""
        n = len(numbered)
        for _attempt in range(8):
            try:
                return self._run_raw(self._write(numbered))
            except sqlite3.Error as exc:
                self._rollback()
                why = self._why(exc)
                if why is None:
                    raise TransientError(f"buffer {self.path}: cannot store {_batches(n)}: {exc}") from None
            self._write_failure = why
            if why != DATA_DIR_FULL:
                return why
            self._degrade(why)
            if self._make_room():
                continue  # the reserve's room: the same write again
            in_file = self._batches - len(self._acked)
            if not drop_oldest or in_file <= 0:
                self._write_failure = "disk full and nothing left to drop" if drop_oldest else why
                return why
            oldest = max(1, in_file // 10)
            log.debug("buffer %s: disk full; dropping the %d oldest batches", self.path, oldest)  # counted, logged
            try:
                self._drop_oldest(oldest, "disk_full")
            except MapperError as exc:
                if not self._drop_failure_logged:  # once while degraded: tried again every second
                    self._drop_failure_logged = True
                    log.warning(
                        "buffer %s: dropping the oldest failed too (what the file cannot take is kept in memory; "
                        "logged once until the data dir takes writes again): %s",
                        self.path,
                        exc,
                    )
                return why
        self._write_failure = "disk still full after dropping"
        return DATA_DIR_FULL

    # --- a data dir that cannot be written ----------------------------------------------------------------------

    def _degrade(self, why: str) -> None:
        """The data dir does not take a write (``why``): logged when that starts or changes; the next try of the
        file is due ``RETRY_WRITE_S`` after the first failure (a retry sets its own time)."""
        if self.degraded != why:
            kept = (
                f"telemetry the file cannot take is kept in memory (up to {self.memory_max_bytes} bytes, the oldest "
                "dropped first) until it can be stored again"
                if self.memory_max_bytes
                else "telemetry the file cannot take is dropped (counted)"
            )
            log.error("buffer %s: %s; collection, policies and desired state go on; %s", self.path, why, kept)
        if not self.degraded:
            self._last_write_try = self.clock.monotonic()
        self.degraded = why

    def _try_write_again(self) -> bool:
        """While degraded: whether the file takes writes again (tried at most every ``RETRY_WRITE_S``): what memory
        holds is written, by the full-disk policy (the oldest dropped to make room). False while it does not."""
        now = self.clock.monotonic()
        if self._last_write_try is not None and now - self._last_write_try < RETRY_WRITE_S:
            return False
        self._last_write_try = now
        return self._flush_memory(drop_oldest=True)

    def _flush_memory(self, *, drop_oldest: bool, chunk: int = 256) -> bool:
        """Store what memory holds (rows in id order, ``chunk`` rows a transaction, each by ``_write_rows``; then
        the latest snapshots); True when all of it is stored (or there was nothing), False when the file still
        cannot take the rest (what it took is stored and gone from memory)."""
        if self._read_only and not self._reopen():
            return False
        stored = 0
        try:
            while self._memory or self._acked:
                rows = [(row_id, row) for row_id, (row, _) in list(self._memory.items())[:chunk]]
                result = self._write_rows(rows, drop_oldest=drop_oldest)
                if isinstance(result, str):
                    self.degraded = result
                    return False
                self._committed(len(rows), *result)
                for row_id, _ in rows:
                    self._memory_bytes -= self._memory.pop(row_id)[1]
                stored += len(rows)
            for device, (ts_ms, payload) in list(self._memory_latest.items()):
                self._run_raw(self._upsert_latest(device, payload, ts_ms))
                del self._memory_latest[device]
        except sqlite3.Error as exc:
            self._rollback()
            why = self._why(exc)
            if why is not None:
                self.degraded = why
            return False
        except MapperError:
            return False
        finally:
            if stored:  # every second while degraded: not at INFO
                log.debug("buffer %s: %s of those kept in memory stored", self.path, _batches(stored))
        self._recovered()
        return True

    def _recovered(self) -> None:
        """A write worked: with the reserve made again (or none wanted), the data dir is writable again."""
        if self._memory or self._memory_latest or not self._make_reserve():
            return
        if self.degraded:
            log.warning("buffer %s: the data dir takes writes again (it was: %s)", self.path, self.degraded)
        self.degraded = ""
        self._drop_failure_logged = False

    def _keep(self, rows: Sequence[_Row], why: str) -> int:
        """Keep rows the file cannot take in memory (ids as if stored); beyond ``memory_max_bytes`` the oldest kept
        are dropped and counted. Without memory (``memory_max_bytes`` 0): counted as lost, ``TransientError``."""
        n = len(rows)
        reason = _drop_reason(why)
        if self.memory_max_bytes <= 0:
            self._count_lost(rows, reason)
            raise TransientError(f"buffer {self.path}: {why}; {_batches(n)} lost")
        self._degrade(why)
        first_id = self._next_id
        self._next_id += n
        for row_id, row in enumerate(rows, first_id):
            size = len(row[2]) + ROW_OVERHEAD_BYTES
            self._memory[row_id] = (row, size)
            self._memory_bytes += size
        lost: list[_Row] = []
        while self._memory_bytes > self.memory_max_bytes and self._memory:
            oldest = next(iter(self._memory))
            row, size = self._memory.pop(oldest)
            self._memory_bytes -= size
            lost.append(row)
        if lost:
            self._count_lost(lost, reason)
        return first_id

    def _count_lost(self, rows: Sequence[_Row], reason: str) -> None:
        """Rows never stored (or kept in memory and dropped): counted as dropped, logged once a minute."""
        self.drops[reason] += len(rows)
        self.drop_samples[reason] += sum(batch_rows(r[2]) for r in rows)
        self._log_drop(len(rows))

    def _make_room(self) -> bool:
        """At a full write: the reserve file goes (its room lets the WAL take a delete, and a checkpoint the pages
        it moves into the file), and the WAL is checkpointed into the file so that the next write reuses it from
        its start (RESTART, not TRUNCATE: a WAL given back to the file system would be room the reserve, or another
        process, takes, and the next write would meet a full disk again). True when a reserve file was deleted."""
        released = False
        try:
            self.reserve_path.unlink()
            released = True
            log.warning("buffer %s: reserve file %s deleted to make room", self.path, self.reserve_path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("buffer %s: cannot delete the reserve file: %s", self.path, exc)
        try:
            self._run_raw(lambda conn: conn.execute("PRAGMA wal_checkpoint(RESTART)").fetchone())
        except (sqlite3.Error, MapperError):
            pass  # what it could copy is copied
        return released

    def _make_reserve(self) -> bool:
        """Make (or complete) the reserve file when the file system has room for it and a margin as large again;
        True when it is there (or none is wanted)."""
        if self.reserve_bytes <= 0:
            return True
        try:
            have = self.reserve_path.stat().st_size
        except FileNotFoundError:
            have = 0
        except OSError:
            return False
        if have >= self.reserve_bytes:
            return True
        try:
            fs = os.statvfs(self.path.parent)
            if fs.f_bavail * fs.f_frsize < 2 * (self.reserve_bytes - have):
                return False
            fd = os.open(self.reserve_path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            try:
                os.lseek(fd, have, os.SEEK_SET)
                block = bytes(min(65536, self.reserve_bytes))
                left = self.reserve_bytes - have
                while left > 0:  # written, not a hole: the room is taken for real
                    left -= os.write(fd, block[: min(left, len(block))])
            finally:
                os.close(fd)
        except OSError as exc:
            log.debug("buffer %s: reserve file not made: %s", self.path, exc)
            try:
                os.truncate(self.reserve_path, have)
            except OSError:
                pass
            return False
        return True

    @staticmethod
    def _stream_id(conn: sqlite3.Connection, key: _StreamKey) -> int:
        """The id of a stream, inserted when the file has none (inside the caller's transaction)."""
        # No unique index on streams (it would cost a page): a scan of this small table instead.
        row = conn.execute(
            "SELECT id FROM streams WHERE device=? AND uuid=? AND boot_id=? AND topic=? AND qos=? "
            "AND retain=? AND address=?",
            key,
        ).fetchone()
        if row is not None:
            return int(row[0])
        cur = conn.execute(
            "INSERT INTO streams (device, uuid, boot_id, topic, qos, retain, address) VALUES (?, ?, ?, ?, ?, ?, ?)",
            key,
        )
        return int(cur.lastrowid or 0)

    def enforce_bounds(self) -> None:
        """Drop batches older than ``max_age_s``, then the oldest until within ``max_bytes``."""

        def enforce(conn: sqlite3.Connection) -> list[_Drop]:
            conn.execute("BEGIN IMMEDIATE")
            drops = self._drop_due(conn, self._bytes + self._shared(), ((_NO_ID_LIMIT, 0),))
            conn.execute("COMMIT")
            return drops

        for drop in self._run(enforce):
            self._count_drop(*drop)

    def _drop_due(self, conn: sqlite3.Connection, stored: int, steps: Iterable[tuple[int, int]]) -> list[_Drop]:
        """Delete what the bounds drop when they are enforced once after each step, as consecutive puts do.

        A step is (the newest id it sees, the bytes it added); ``stored`` is the bytes stored before the first.
        Each step drops, oldest first by id (no index on time), the batches older than ``max_age_s`` up to the
        first one young enough to keep, then the oldest until within ``max_bytes``. Only the head of the table
        is read: as many rows as are dropped, plus one. Returns the drops to count, once committed: (reason,
        batches, bytes, samples), one per run of batches dropped for the same reason (usually none, or one).
        """
        cutoff = self.clock.wall_ms() - round(self.max_age_s * 1000) - self._epoch_ms
        max_bytes = self.max_bytes
        runs: list[tuple[int, str]] = []  # (the last id of the run, its reason), oldest first
        cur = conn.execute(f"SELECT id, ts_last_rel_ms, {_SIZE_SQL} FROM batches ORDER BY id")
        try:
            head = cur.fetchone()
            for newest_id, added in steps:
                stored += added
                while head is not None and head[0] <= newest_id and head[1] < cutoff:
                    _extend(runs, head[0], "age")
                    stored -= head[2]
                    head = cur.fetchone()
                while head is not None and head[0] <= newest_id and stored > max_bytes:
                    _extend(runs, head[0], "size")
                    stored -= head[2]
                    head = cur.fetchone()
        finally:
            cur.close()
        drops: list[_Drop] = []
        for last, reason in runs:
            deleted = conn.execute(
                f"DELETE FROM batches WHERE id <= ? RETURNING {_SIZE_SQL}, payload", (last,)
            ).fetchall()
            samples = sum(batch_rows(bytes(r[1])) for r in deleted)
            drops.append((reason, len(deleted), sum(int(r[0]) for r in deleted), samples))
        return drops

    def _drop_oldest(self, n: int, reason: str) -> None:
        def delete(conn: sqlite3.Connection) -> list[Any]:
            row = conn.execute("SELECT id FROM batches ORDER BY id LIMIT 1 OFFSET ?", (n - 1,)).fetchone()
            if row is None:
                row = conn.execute("SELECT MAX(id) FROM batches").fetchone()
            if row is None or row[0] is None:
                return []
            return conn.execute(
                f"DELETE FROM batches WHERE id <= ? RETURNING id, {_SIZE_SQL}, payload", (row[0],)
            ).fetchall()

        count = size = samples = 0
        for r in self._run(delete):
            row_id, row_size = int(r[0]), int(r[1])
            if self._acked.pop(row_id, None) is not None:  # acknowledged already: gone, not dropped
                self._batches -= 1
                self._bytes -= row_size
                continue
            count += 1
            size += row_size
            samples += batch_rows(bytes(r[2]))
        self._count_drop(reason, count, size, samples)

    def _shared(self) -> int:
        return self.shared_bytes() if self.shared_bytes is not None else 0

    @property
    def stored_bytes(self) -> int:
        """The bytes counted against ``max_bytes`` (payloads plus their row overhead)."""
        return self._bytes

    def _count_drop(self, reason: str, count: int, size: int, samples: int = 0) -> None:
        """Account for ``count`` batches (``size`` bytes, ``samples`` rows) deleted, once that is committed; logged
        once a minute."""
        if not count:
            return
        self._batches -= count
        self._bytes -= size
        self.drops[reason] += count
        self.drop_samples[reason] += samples
        self._log_drop(count)

    def _log_drop(self, count: int) -> None:
        now = self.clock.monotonic()
        if self._last_drop_log is None or now - self._last_drop_log >= 60.0:
            self._last_drop_log = now
            log.warning(
                "buffer %s: dropping the oldest batches (%d now, %s so far by reason; logged once a minute)",
                self.path,
                count,
                self.drops,
            )

    def ack(self, batch_id: int) -> None:
        """The broker has the batch: forget it. Unknown ids (already dropped or acked) are ignored."""
        self.ack_many((batch_id,))

    def ack_many(self, batch_ids: Iterable[int]) -> None:
        """Forget batches the broker has. A row kept in memory goes at once; a row in the file is deleted, or,
        when the file cannot be written now, deleted with the next write that works (it is gone for ``pending``
        and the counts meanwhile)."""
        ids = []
        for i in batch_ids:
            kept = self._memory.pop(i, None)
            if kept is not None:
                self._memory_bytes -= kept[1]
            elif i not in self._acked:
                ids.append(i)
        if not ids:
            return

        def delete(conn: sqlite3.Connection) -> tuple[int, int]:
            conn.execute("BEGIN IMMEDIATE")
            count = size = 0
            for i in ids:
                row = conn.execute(f"DELETE FROM batches WHERE id = ? RETURNING {_SIZE_SQL}", (i,)).fetchone()
                if row is not None:
                    count += 1
                    size += int(row[0])
            conn.execute("COMMIT")
            return count, size

        try:
            count, size = self._run_raw(delete)
        except sqlite3.OperationalError as exc:
            self._rollback()
            if self._why(exc) is None:
                raise TransientError(f"buffer {self.path}: {exc}") from None
            self._defer_acks(ids)
            return
        except sqlite3.Error as exc:
            self._rollback()
            raise TransientError(f"buffer {self.path}: {exc}") from None
        self._batches -= count
        self._bytes -= size

    def _defer_acks(self, ids: Sequence[int]) -> None:
        """Acknowledged rows the file could not delete now: remembered (with their sizes, read: reading works on
        a full disk) and deleted by the next write that works."""
        try:
            marks = ",".join("?" * len(ids))
            rows = self._run(
                lambda conn: conn.execute(
                    f"SELECT id, {_SIZE_SQL} FROM batches WHERE id IN ({marks})", tuple(ids)
                ).fetchall()
            )
        except MapperError:
            return  # it will be sent again: a duplicate the consumer drops
        for r in rows:
            self._acked[int(r[0])] = int(r[1])

    @staticmethod
    def _upsert_latest(device: str, payload: bytes, ts: int) -> Callable[[sqlite3.Connection], None]:
        def upsert(conn: sqlite3.Connection) -> None:
            conn.execute(
                "INSERT INTO latest (device, ts_ms, payload) VALUES (?, ?, ?) "
                "ON CONFLICT(device) DO UPDATE SET ts_ms=excluded.ts_ms, payload=excluded.payload",
                (device, ts, payload),
            )

        return upsert

    def put_latest(self, device: str, payload: bytes, ts_ms: int | None = None) -> None:
        """Keep the newest state snapshot of a device (replaces the previous one); in memory while the file
        cannot take it (with ``memory_max_bytes``)."""
        ts = self.clock.wall_ms() if ts_ms is None else ts_ms
        if self.degraded and self.memory_max_bytes:
            self._memory_latest[device] = (ts, payload)
            return
        try:
            self._run_raw(self._upsert_latest(device, payload, ts))
        except sqlite3.Error as exc:
            self._rollback()
            why = self._why(exc) if isinstance(exc, sqlite3.OperationalError) else None
            if why is None or not self.memory_max_bytes:
                raise TransientError(f"buffer {self.path}: {exc}") from None
            self._degrade(why)
            self._memory_latest[device] = (ts, payload)
            return
        self._memory_latest.pop(device, None)

    def forget_latest(self, device: str) -> None:
        self._memory_latest.pop(device, None)
        self._run(lambda conn: conn.execute("DELETE FROM latest WHERE device = ?", (device,)))

    # ------------------------------------------------------------------------------------------ compaction

    def compaction_rows(self, *, before_ms: int, after_id: int = 0, limit: int = 20000) -> list[CompactionRow]:
        """Telemetry batches a compaction may merge, oldest id first: binary batches (not status messages, not
        JSON) whose last sample is before ``before_ms``, with id > ``after_id``; at most ``limit``. Reads no
        payload beyond its first two bytes. None while the data dir cannot be written (``degraded``): a merge
        could not be stored."""
        if self.degraded:
            return []

        def select(conn: sqlite3.Connection) -> list[CompactionRow]:
            rows = conn.execute(
                "SELECT b.id, b.stream, b.ts_last_rel_ms, length(b.payload), substr(b.payload, 1, 2) "
                "FROM batches b JOIN streams s ON s.id = b.stream "
                "WHERE b.id > ? AND b.ts_last_rel_ms < ? AND s.boot_id != '' ORDER BY b.id LIMIT ?",
                (after_id, before_ms - self._epoch_ms, limit),
            ).fetchall()
            epoch = self._epoch_ms
            return [
                CompactionRow(
                    int(r[0]),
                    int(r[1]),
                    int(r[2]) + epoch,
                    int(r[3]),
                    bytes(r[4])[1:2] in MERGED_VERSION_BYTES,
                    bytes(r[4])[1:2] == COLD_VERSION,
                )
                for r in rows
                if bytes(r[4])[:1] == b"G"
            ]

        return self._run(select)

    def payloads(self, ids: Sequence[int]) -> dict[int, bytes]:
        """The payloads of the rows with these ids that still exist."""

        def select(conn: sqlite3.Connection) -> dict[int, bytes]:
            marks = ",".join("?" * len(ids))
            rows = conn.execute(f"SELECT id, payload FROM batches WHERE id IN ({marks})", tuple(ids)).fetchall()
            return {int(r[0]): bytes(r[1]) for r in rows}

        return self._run(select) if ids else {}

    def replace(self, originals: Mapping[int, bytes], payload: bytes, ts_last_ms: int) -> bool:
        """Compaction's one transaction: the rows ``originals`` (id -> the payload that was merged; one stream)
        become ONE row, the LAST id, holding ``payload`` (the merged batch) with ``ts_last_ms``; the others are
        deleted (one row: its payload is re-encoded in place, a merged batch put in its cold form). (The last id:
        the rows before it, with the other streams' rows merged in the same pass, leave whole pages free for new
        rows; the first id would leave holes in half-empty pages.) Nothing changes and False is returned when any
        of them is gone or holds another payload by now (acked, dropped, replaced) or they are not of one stream.
        A crash at any point leaves either every original or the merged row (SQLite commits the transaction
        whole)."""
        ids = sorted(originals)
        if not ids:
            raise ValueError("replace needs at least one row")
        if any(i in self._acked for i in ids):  # acknowledged, its delete deferred: gone, not to be merged
            return False

        def write(conn: sqlite3.Connection) -> tuple[bool, int]:
            conn.execute("BEGIN IMMEDIATE")
            try:
                marks = ",".join("?" * len(ids))
                rows = conn.execute(
                    f"SELECT id, stream, payload FROM batches WHERE id IN ({marks})", tuple(ids)
                ).fetchall()
                if (
                    len(rows) != len(ids)
                    or len({int(r[1]) for r in rows}) != 1
                    or any(bytes(r[2]) != originals[int(r[0])] for r in rows)
                ):
                    conn.execute("ROLLBACK")
                    return False, 0
                # Delete first: the pages the old rows free are then reused for the merged payload in this very
                # transaction, instead of the file growing by it and keeping the freed pages for later.
                if len(ids) > 1:
                    conn.execute(f"DELETE FROM batches WHERE id IN ({','.join('?' * (len(ids) - 1))})", tuple(ids[:-1]))
                conn.execute(
                    "UPDATE batches SET payload = ?, ts_last_rel_ms = ? WHERE id = ?",
                    (payload, ts_last_ms - self._epoch_ms, ids[-1]),
                )
                conn.execute("COMMIT")
            except BaseException:
                self._rollback()
                raise
            # Give the pages left free back to the file system (a new file is INCREMENTAL auto-vacuum): after a
            # merge the file holds what it stores. (sqlite3_exec steps the pragma to its end; one step frees one.)
            conn.executescript("PRAGMA incremental_vacuum;")
            before = sum(len(p) + ROW_OVERHEAD_BYTES for p in originals.values())
            return True, before - (len(payload) + ROW_OVERHEAD_BYTES)

        try:
            done, saved = self._run(write)
        except sqlite3.OperationalError as exc:
            raise TransientError(f"buffer {self.path}: cannot store a merged batch: {exc}") from None
        if done:
            self._batches -= len(ids) - 1
            self._bytes -= saved
        return done

    # ------------------------------------------------------------------------------------------ reads

    def pending(self, limit: int = 100, after_id: int | None = None) -> list[StoredBatch]:
        """Up to ``limit`` stored batches with id > ``after_id``, oldest first (so per-device order holds): the
        file's and those kept in memory, in one id order; acknowledged ones not yet deleted from the file left
        out."""
        if limit <= 0:
            raise ValueError(f"pending limit must be > 0, got {limit}")
        after = after_id if after_id is not None else -1
        skip = len(self._acked)

        def select(conn: sqlite3.Connection) -> list[StoredBatch]:
            rows = conn.execute(
                f"SELECT {_BATCH_COLUMNS} FROM batches b JOIN streams s ON s.id = b.stream "
                "WHERE b.id > ? ORDER BY b.id LIMIT ?",
                (after, limit + skip),
            ).fetchall()
            return [_stored(r, self._epoch_ms) for r in rows if int(r[0]) not in self._acked]

        out = self._run(select)
        if self._memory:
            kept = [self._kept(i, row) for i, (row, _) in self._memory.items() if i > after]
            out = sorted(out + kept[:limit], key=lambda b: b.id)
        return out[:limit]

    @staticmethod
    def _kept(row_id: int, row: _Row) -> StoredBatch:
        (device, uuid, boot_id, topic, qos, retain, address), ts_last_ms, payload = row
        return StoredBatch(
            device, uuid, boot_id, None, None, ts_last_ms, topic, payload, qos, retain, address, id=row_id
        )

    def latest(self) -> dict[str, bytes]:
        """The newest state snapshot of every device (those kept in memory over the file's)."""
        try:
            rows = self._run(lambda conn: conn.execute("SELECT device, payload FROM latest ORDER BY device").fetchall())
        except TransientError:
            if not self._memory_latest:
                raise
            rows = []
        out = {str(r[0]): bytes(r[1]) for r in rows}
        out.update((device, payload) for device, (_, payload) in self._memory_latest.items())
        return dict(sorted(out.items()))

    def stats(self) -> BufferStats:
        """The figures of what waits (file and memory, acknowledged rows left out) and what was dropped. A file
        that cannot be read leaves ``oldest_ts_ms`` None; the counts are kept in memory."""
        acked = list(self._acked)
        where = f"WHERE id NOT IN ({','.join('?' * len(acked))}) " if 0 < len(acked) <= 1000 else ""
        try:
            row = self._run(
                lambda conn: conn.execute(
                    f"SELECT ts_last_rel_ms, payload FROM batches {where}ORDER BY id LIMIT 1",
                    tuple(acked) if where else (),
                ).fetchone()
            )
        except MapperError:
            row = None
        # The first sample time of the oldest batch is in its payload (one decode).
        oldest = None if row is None else peek_header(bytes(row[1]), int(row[0]) + self._epoch_ms)[1]
        if oldest is None and self._memory:
            first = next(iter(self._memory.values()))[0]
            oldest = peek_header(first[2], first[1])[1]
        age = None if oldest is None else max(0.0, (self.clock.wall_ms() - oldest) / 1000)
        return BufferStats(
            bytes=self._bytes - sum(self._acked.values()) + self._memory_bytes,
            batches=self._batches - len(self._acked) + len(self._memory),
            oldest_ts_ms=oldest,
            oldest_age_s=age,
            drops_by_reason=dict(self.drops),
            files_moved_aside=self.files_moved_aside,
            drop_samples_by_reason=dict(self.drop_samples),
            degraded=self.degraded,
            memory_batches=len(self._memory),
        )

    def file_bytes(self) -> int:
        """Bytes on disk: the database file plus its WAL."""
        total = 0
        for suffix in ("", "-wal"):
            p = Path(str(self.path) + suffix)
            if p.exists():
                total += p.stat().st_size
        return total

    def checkpoint(self) -> None:
        """Move the WAL into the database file and truncate it."""
        self._run(lambda conn: conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone())

    def close(self) -> None:
        """Store what memory holds if the file takes it now (else it is counted as dropped), checkpoint, close.
        Never raises for a file that cannot be written."""
        kept = self._memory or self._memory_latest or self._acked
        if not self._closed and kept and not self._flush_memory(drop_oldest=False) and self._memory:
            lost = [row for row, _ in self._memory.values()]
            self._count_lost(lost, _drop_reason(self.degraded or DATA_DIR_FULL))
            log.error(
                "buffer %s: %s at shutdown: %s kept in memory not stored (counted as dropped)",
                self.path,
                self.degraded or "the file cannot be written",
                _batches(len(lost)),
            )
            self._memory, self._memory_bytes = {}, 0
        self._closed = True
        if self._conn is not None:
            try:
                if not self._read_only:
                    self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            except sqlite3.Error as exc:
                log.warning("buffer %s: checkpoint at close failed: %s", self.path, exc)
            self._conn.close()
            self._conn = None
