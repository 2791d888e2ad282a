"""``dbMethod.mysql``: each sample a row of its property's table, as KubeEdge's framework writes it.

The table is `` `<namespace>/<device>/<property>` `` (slashes kept, backquoted), created when missing with the
framework's columns ``id INT AUTO_INCREMENT PRIMARY KEY, ts DATETIME NOT NULL, field TEXT``; a row is ``(ts,
field)`` = (the sample's time as ``YYYY-MM-DD HH:MM:SS``, whole seconds in the process's local time zone; the
value's text). User: the spec's ``userName``; password: ``PASSWORD`` (``PushSecrets.password``). Client: PyMySQL,
in the writer's own thread (the event loop and the default executor never wait on the database), one connection
kept (pinged before each write), its connect, read and write each bounded by ``timeout_s``.

Differences from the framework, on purpose: a batch goes in ONE transaction (the framework inserts row by row,
and stops the property for good on the first error), the rows of a table in the samples' order (the ``id``
shows it); a table is created once per connection, not before every row.

Errors: a connection that fails or times out, and the server's "not now" answers (too many connections, lock
wait timeout, deadlock, shutdown in progress, disk full, ...) are a ``TransientError``: the transaction is rolled
back and the framework retries the batch. Access denied and an unknown database are a ``PermanentError`` for the
batch. A row the server refuses (a value too long for TEXT, a time out of DATETIME's range, a table name over 64
characters, no right to create it) is refused by itself: the batch's other rows are committed, then a
``PartlyRefusedError`` names the refused ones (and says which they were, so the rest count as delivered).

Idempotence: a transaction that failed before COMMIT left nothing; one whose COMMIT went out with no answer may
or may not have landed, and retrying it blindly could write it twice. So the writer remembers one row of that
transaction, its ``id`` (the first row of a table is inserted alone, for its ``id``), time and value: the next
write looks that row up with a locking read (which waits for the old transaction to end on the server) and, if it
is there, leaves out the samples the landed transaction held. No table of our own, no privilege beyond the
framework's (CREATE, INSERT; SELECT for the look-up). A batch is written once, unless the process dies between
the COMMIT and its answer (the framework's buffer then replays it), or the table has no ``id`` to look up.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pymysql
import pymysql.err

from mapper.edge.push.address import host_port
from mapper.edge.push.ownthread import OwnThread
from mapper.errors import PartlyRefusedError, PermanentError, TransientError, short_repr
from mapper.shared.push import DbMysql, PushSample, PushSecrets, PushWriter

DEFAULT_PORT = 3306

#: Server errors that mean "not now" (the same statement can succeed later).
TRANSIENT_CODES = frozenset(
    {
        1021,  # disk full
        1037,  # out of memory
        1038,  # out of sort memory
        1040,  # too many connections
        1041,  # out of memory
        1053,  # server shutdown in progress
        1114,  # the table is full
        1158,  # network: error reading
        1159,  # network: timeout reading
        1160,  # network: error writing
        1161,  # network: timeout writing
        1203,  # the user's connections at their maximum
        1205,  # lock wait timeout
        1213,  # deadlock
        1226,  # a user resource exhausted
        1317,  # query interrupted
        1146,  # no such table: dropped while we wrote; the retry's connection creates it again
        1927,  # connection killed
        1969,  # max_statement_time exceeded
        2002,  # client: cannot connect (socket)
        2003,  # client: cannot connect
        2006,  # client: server has gone away
        2013,  # client: lost connection (a timeout among them)
        2014,  # client: commands out of sync (a connection cut mid-answer)
        2055,  # client: lost connection at a system call
    }
)
#: Samples remembered as landed by a write the framework saw fail; beyond this the memory is dropped.
MAX_REMEMBERED_SAMPLES = 100_000
#: A refused sample: (reason, text, the sample).
_Refused = tuple[str, str, PushSample]
#: Errors of the connection itself: the whole batch refused.
ACCESS_CODES = frozenset({1044, 1045, 1698})  # access denied (to the database, for the user, without a password)
UNKNOWN_DATABASE = 1049
NO_SUCH_TABLE = 1146

_Ident = tuple[str, int, str]


@dataclass(frozen=True)
class _Probe:
    """A row of a transaction whose COMMIT got no answer: its table, id, time text and value."""

    table: str
    row_id: int
    ts: str
    value: str


def make_writer(method: DbMysql, secrets: PushSecrets, *, timeout_s: float) -> PushWriter:
    """The writer for one mysql client config; the password is ``secrets.password``. A config no connection can
    be made from is a ``PermanentError``."""
    return MysqlWriter(method, secrets.password, timeout_s=timeout_s)


def table_name(sample: PushSample) -> str:
    """The framework's table of ``sample``'s property: ``<namespace>/<device>/<property>``."""
    return f"{sample.namespace}/{sample.device}/{sample.property}"


def quote_name(name: str) -> str:
    """An identifier, backquoted (a backquote in it doubled)."""
    return "`" + name.replace("`", "``") + "`"


def time_text(ts_ms: int) -> str:
    """The framework's time text: ``YYYY-MM-DD HH:MM:SS``, whole seconds (cut, not rounded), local time."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts_ms // 1000))


def create_table_sql(table: str) -> str:
    return (
        f"CREATE TABLE IF NOT EXISTS {quote_name(table)} "
        "(id INT AUTO_INCREMENT PRIMARY KEY, ts DATETIME NOT NULL, field TEXT)"
    )


def _error_code(exc: BaseException) -> int:
    """A PyMySQL error's code (0 for one without: a closed connection, the client's own errors)."""
    if isinstance(exc, pymysql.err.MySQLError) and exc.args and isinstance(exc.args[0], int):
        return exc.args[0]
    return 0


def _error_text(exc: BaseException) -> str:
    if isinstance(exc, pymysql.err.MySQLError) and len(exc.args) > 1:
        return short_repr(str(exc.args[1]), 200)
    return short_repr(str(exc) or type(exc).__name__, 200)


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` (from PyMySQL or the socket) means the same statement can succeed later."""
    if isinstance(exc, pymysql.err.MySQLError):
        code = _error_code(exc)
        return code == 0 or code in TRANSIENT_CODES
    return isinstance(exc, OSError)


class _Transient(Exception):
    """Raised inside the writer's thread to break off a write; turned into ``TransientError`` once."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


class MysqlWriter:
    """One mysql client config's writer (see the module docstring); build it with ``make_writer``."""

    key: str

    def __init__(self, method: DbMysql, password: str | None, *, timeout_s: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self._host, self._port = host_port(method.addr, default_port=DEFAULT_PORT, what="mysql")
        if not method.database:
            raise PermanentError("mysql: the database is empty", reason="bad-config")
        if not method.user_name:
            raise PermanentError("mysql: the userName is empty", reason="bad-config")
        self.key = f"mysql {method.user_name}@{method.addr.strip()}/{method.database}"
        self._database = method.database
        self._user = method.user_name
        self._password = password or ""
        self._timeout_s = timeout_s
        self._conn: pymysql.connections.Connection[Any] | None = None
        #: Tables this connection has made sure of (created or found).
        self._tables: set[str] = set()
        #: A row of the transaction whose COMMIT got no answer, and the samples it held; None when every
        #: outcome is known.
        self._uncertain: tuple[_Probe, frozenset[_Ident]] | None = None
        #: Samples known to be in the database that a write still failed around (left out when written again).
        self._landed: set[_Ident] = set()
        self._thread = OwnThread("push-mysql")

    def __repr__(self) -> str:
        return f"MysqlWriter({self.key!r})"

    async def write(self, samples: Sequence[PushSample]) -> None:
        if not samples:
            return
        refused = await self._thread.run(self._deliver, list(samples))
        if refused:
            refused_ids = {id(sample) for _, _, sample in refused}
            raise PartlyRefusedError(
                f"{self.key}: {len(refused)} of {len(samples)} samples refused (the rest written): {refused[0][1]}",
                refused=[i for i, sample in enumerate(samples) if id(sample) in refused_ids],
                reason=refused[0][0],
            )

    async def aclose(self) -> None:
        await self._thread.close(self._drop)

    # -- in the writer's thread --

    def _deliver(self, samples: list[PushSample]) -> list[_Refused]:
        """Write ``samples``; the refused ones as (reason, text, sample)."""
        try:
            conn = self._connection()
            return self._write_batch(conn, samples)
        except _Transient as exc:
            self._drop()
            cause = exc.cause
            reason = "timeout" if "timed out" in str(cause) else f"mysql-{_error_code(cause)}"
            raise TransientError(f"{self.key}: {_error_text(cause)}", reason=reason) from None

    def _connection(self) -> pymysql.connections.Connection[Any]:
        if self._conn is not None:
            try:
                self._conn.ping()
                return self._conn
            except (pymysql.err.MySQLError, OSError):
                self._drop()
        try:
            conn = pymysql.connect(
                host=self._host,
                port=self._port,
                user=self._user,
                password=self._password,
                database=self._database,
                charset="utf8mb4",
                connect_timeout=self._timeout_s,
                read_timeout=self._timeout_s,
                write_timeout=self._timeout_s,
                autocommit=False,
            )
        except (pymysql.err.MySQLError, OSError) as exc:
            code = _error_code(exc)
            if code in ACCESS_CODES:
                raise PermanentError(f"{self.key}: {_error_text(exc)}", reason="auth") from None
            if code == UNKNOWN_DATABASE:
                raise PermanentError(f"{self.key}: {_error_text(exc)}", reason="unknown-database") from None
            if is_transient(exc):
                raise _Transient(exc) from None
            raise PermanentError(f"{self.key}: {_error_text(exc)}", reason=f"mysql-{code}") from None
        self._conn = conn
        return conn

    def _drop(self) -> None:
        self._tables.clear()
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except (pymysql.err.MySQLError, OSError):
                pass

    def _write_batch(self, conn: pymysql.connections.Connection[Any], samples: list[PushSample]) -> list[_Refused]:
        refused: list[_Refused] = []
        rows: dict[str, list[tuple[PushSample, str]]] = {}
        for sample in samples:
            table = table_name(sample)
            try:
                if "\x00" in table:
                    raise ValueError("a NUL character in the table's name")
                text = time_text(sample.ts_ms)
                sample.value.encode("utf-8")
                table.encode("utf-8")
            except (ValueError, OverflowError, OSError) as exc:
                refused.append(("bad-value", f"{_name(sample)}: {exc}", sample))
                continue
            rows.setdefault(table, []).append((sample, text))
        with conn.cursor() as cursor:
            # DDL commits whatever transaction is open, so the tables come first, each in its own statement.
            for table in list(rows):
                if table in self._tables:
                    continue
                try:
                    cursor.execute(create_table_sql(table))
                except (pymysql.err.MySQLError, OSError) as exc:
                    if is_transient(exc):
                        raise _Transient(exc) from None
                    refused += [
                        (f"mysql-{_error_code(exc)}", f"{_name(s)}: {_error_text(exc)}", s) for s, _ in rows[table]
                    ]
                    del rows[table]
                    continue
                self._tables.add(table)
            if not rows:
                return refused
            try:
                self._transaction(conn, cursor, rows, refused)
            except (pymysql.err.MySQLError, OSError) as exc:
                if is_transient(exc):
                    raise _Transient(exc) from None
                raise PermanentError(f"{self.key}: {_error_text(exc)}", reason=f"mysql-{_error_code(exc)}") from None
        self._landed.difference_update(
            (table, sample.ts_ms, sample.value) for table, table_rows in rows.items() for sample, _ in table_rows
        )
        return refused

    def _transaction(
        self,
        conn: pymysql.connections.Connection[Any],
        cursor: pymysql.cursors.Cursor,
        rows: dict[str, list[tuple[PushSample, str]]],
        refused: list[_Refused],
    ) -> None:
        conn.begin()
        try:
            if self._uncertain is not None:
                self._resolve_uncertain(cursor)
            inserted: list[_Ident] = []
            probe: _Probe | None = None
            for table, table_rows in rows.items():
                table_rows = [(s, text) for s, text in table_rows if (table, s.ts_ms, s.value) not in self._landed]
                if not table_rows:
                    continue
                insert = f"INSERT INTO {quote_name(table)} (ts, field) VALUES (%s, %s)"
                # The first row alone (its id is the probe), the rest at once: executemany may send several
                # statements, so back to the savepoint if one fails, then row by row (a failed row's statement is
                # undone alone, the transaction goes on) to refuse only the bad ones.
                cursor.execute("SAVEPOINT push_table")
                try:
                    first, first_text = table_rows[0]
                    cursor.execute(insert, (first_text, first.value))
                    first_id = cursor.lastrowid
                    if len(table_rows) > 1:
                        cursor.executemany(insert, [(text, sample.value) for sample, text in table_rows[1:]])
                    inserted += [(table, sample.ts_ms, sample.value) for sample, _ in table_rows]
                    if probe is None and first_id:
                        probe = _Probe(table, first_id, first_text, first.value)
                    continue
                except pymysql.err.MySQLError as exc:
                    if is_transient(exc):
                        raise
                cursor.execute("ROLLBACK TO SAVEPOINT push_table")
                for sample, text in table_rows:
                    try:
                        cursor.execute(insert, (text, sample.value))
                    except pymysql.err.MySQLError as exc:
                        if is_transient(exc):
                            raise
                        refused.append((f"mysql-{_error_code(exc)}", f"{_name(sample)}: {_error_text(exc)}", sample))
                        continue
                    inserted.append((table, sample.ts_ms, sample.value))
                    if probe is None and cursor.lastrowid:
                        probe = _Probe(table, cursor.lastrowid, text, sample.value)
        except BaseException:
            try:
                conn.rollback()
            except (pymysql.err.MySQLError, OSError):
                pass
            raise
        # Without a probe (nothing inserted, or a table without an AUTO_INCREMENT id) there is nothing to look up.
        self._uncertain = (probe, frozenset(inserted)) if probe is not None else None
        conn.commit()
        self._uncertain = None

    def _resolve_uncertain(self, cursor: pymysql.cursors.Cursor) -> None:
        """After a COMMIT with no answer: whether it landed (its probe row is there, as written; the locking read
        waits for that transaction to end on the server); if so its samples are remembered as landed."""
        assert self._uncertain is not None
        probe, held = self._uncertain
        try:
            cursor.execute(
                f"SELECT CAST(ts AS CHAR), field FROM {quote_name(probe.table)} WHERE id = %s FOR UPDATE",
                (probe.row_id,),
            )
            found = cursor.fetchone()
        except pymysql.err.MySQLError as exc:
            if is_transient(exc) and _error_code(exc) != NO_SUCH_TABLE:
                raise
            found = None  # the table is gone (dropped), or cannot be read: nothing to leave out
        self._uncertain = None
        if found is not None and tuple(found) == (probe.ts, probe.value):
            if len(self._landed) + len(held) > MAX_REMEMBERED_SAMPLES:
                self._landed.clear()
            self._landed.update(held)


def _name(sample: PushSample) -> str:
    return f"{sample.namespace}/{sample.device}/{sample.property}@{sample.ts_ms}"
