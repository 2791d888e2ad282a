"""dbMethod.mysql against a real MariaDB: the framework's table per property, its columns and time text, read
back; an outage, a COMMIT whose answer never came (written once all the same), refusals (password, database,
a value or a table name the server refuses, alone)."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest

from mapper.edge.push import mysql as push_mysql
from mapper.errors import PartlyRefusedError, PermanentError, TransientError
from mapper.shared.push import DbMysql, PushSample, PushSecrets, PushWriter
from tests.dbservers import CuttingProxy, MariaDb

#: 2026-12-04 17:20:00.123 UTC
T0_MS = 1_796_404_800_123
TIMEOUT_S = 5.0
PASSWORD = "mysql-pw"


def sample(prop: str, value: str, ts_ms: int, *, device: str = "edge-1-gpu0") -> PushSample:
    return PushSample(namespace="default", device=device, property=prop, value=value, ts_ms=ts_ms, kind="int")


@pytest.fixture
def local_zone() -> Iterator[None]:
    """The process in UTC (the mapper runs with TZ=UTC in the acceptance check); restored after."""
    before = os.environ.get("TZ")
    os.environ["TZ"] = "UTC"
    time.tzset()
    try:
        yield
    finally:
        if before is None:
            del os.environ["TZ"]
        else:
            os.environ["TZ"] = before
        time.tzset()


@pytest.fixture(scope="module")
def mariadb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MariaDb]:
    server = MariaDb(tmp_path_factory.mktemp("mariadb"))
    server.start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def database(mariadb: MariaDb) -> str:
    """A database of the test's own, and the user ``gpu`` with ``PASSWORD`` on it."""
    name = f"telemetry_{uuid.uuid4().hex[:8]}"
    mariadb.make_database(name, "gpu", PASSWORD)
    return name


def writer_for(
    port: int, database: str, *, password: str | None = PASSWORD, timeout_s: float = TIMEOUT_S
) -> PushWriter:
    method = DbMysql(addr=f"127.0.0.1:{port}", database=database, user_name="gpu")
    return push_mysql.make_writer(method, PushSecrets(password=password), timeout_s=timeout_s)


def rows(server: MariaDb, database: str, table: str) -> list[tuple[int, int, str]]:
    """(id, UNIX_TIMESTAMP(ts), field) in id order, read in a UTC session."""
    got = server.sql(f"SELECT id, UNIX_TIMESTAMP(ts), field FROM `{table}` ORDER BY id", database=database)
    return [(int(i), int(ts), field) for i, ts, field in got]


async def test_rows_land_in_the_frameworks_table_per_property(
    mariadb: MariaDb, database: str, local_zone: None
) -> None:
    writer = writer_for(mariadb.port, database)
    samples = [
        sample("temperature", "41", T0_MS),
        sample("power_usage", "182.6", T0_MS + 10),
        sample("temperature", "42", T0_MS + 876),  # 17:20:00.999: cut to the second, not rounded
        sample("temperature", "43", T0_MS + 877),  # 17:20:01.000
    ]
    try:
        await writer.write(samples)
    finally:
        await writer.aclose()
    assert writer.key == f"mysql gpu@127.0.0.1:{mariadb.port}/{database}"
    tables = {t for (t,) in mariadb.sql("SHOW TABLES", database=database)}
    assert tables == {"default/edge-1-gpu0/temperature", "default/edge-1-gpu0/power_usage"}  # nothing of ours
    columns = mariadb.sql(
        "SELECT column_name, column_type, is_nullable, column_key, extra FROM information_schema.columns "
        "WHERE table_schema = %s AND table_name = %s ORDER BY ordinal_position",
        (database, "default/edge-1-gpu0/temperature"),
    )
    assert [tuple(c) for c in columns] == [
        ("id", "int(11)", "NO", "PRI", "auto_increment"),
        ("ts", "datetime", "NO", "", ""),
        ("field", "text", "YES", "", ""),
    ]
    t0_s = T0_MS // 1000  # whole seconds, cut
    assert rows(mariadb, database, "default/edge-1-gpu0/temperature") == [
        (1, t0_s, "41"),
        (2, t0_s, "42"),
        (3, t0_s + 1, "43"),
    ]
    assert rows(mariadb, database, "default/edge-1-gpu0/power_usage") == [(1, t0_s, "182.6")]
    text = mariadb.sql("SELECT CAST(ts AS CHAR) FROM `default/edge-1-gpu0/temperature` ORDER BY id", database=database)
    assert [t for (t,) in text] == ["2026-12-04 17:20:00", "2026-12-04 17:20:00", "2026-12-04 17:20:01"]


async def test_the_time_text_is_the_process_local_time(mariadb: MariaDb, database: str) -> None:
    before = os.environ.get("TZ")
    os.environ["TZ"] = "IST-5:30"  # POSIX: 5 h 30 min east of UTC
    time.tzset()
    try:
        writer = writer_for(mariadb.port, database)
        try:
            await writer.write([sample("temperature", "41", T0_MS)])
        finally:
            await writer.aclose()
    finally:
        if before is None:
            del os.environ["TZ"]
        else:
            os.environ["TZ"] = before
        time.tzset()
    expected = datetime.fromtimestamp(T0_MS // 1000, tz=UTC).astimezone(timezone(timedelta(hours=5, minutes=30)))
    got = mariadb.sql("SELECT CAST(ts AS CHAR) FROM `default/edge-1-gpu0/temperature`", database=database)
    assert got == [(expected.strftime("%Y-%m-%d %H:%M:%S"),)] == [("2026-12-04 22:50:00",)]


async def test_an_existing_table_of_the_framework_is_appended_to(
    mariadb: MariaDb, database: str, local_zone: None
) -> None:
    mariadb.sql(
        "CREATE TABLE `default/edge-1-gpu0/temperature` "
        "(id INT AUTO_INCREMENT PRIMARY KEY, ts DATETIME NOT NULL, field TEXT)",
        database=database,
    )
    mariadb.sql(
        "INSERT INTO `default/edge-1-gpu0/temperature` (ts, field) VALUES ('2026-12-04 17:00:00', '39')",
        database=database,
    )
    writer = writer_for(mariadb.port, database)
    try:
        await writer.write([sample("temperature", "41", T0_MS)])
    finally:
        await writer.aclose()
    got = rows(mariadb, database, "default/edge-1-gpu0/temperature")
    assert [(i, field) for i, _, field in got] == [(1, "39"), (2, "41")]


async def test_the_frameworks_privileges_are_enough(mariadb: MariaDb, local_zone: None) -> None:
    """CREATE and INSERT on the database, what the framework needs: no table of ours, no other right."""
    name = f"telemetry_{uuid.uuid4().hex[:8]}"
    mariadb.sql(f"CREATE DATABASE `{name}`")
    mariadb.sql("CREATE USER IF NOT EXISTS %s@%s IDENTIFIED BY %s", ("writer_only", "%", PASSWORD))
    mariadb.sql(f"GRANT CREATE, INSERT ON `{name}`.* TO %s@%s", ("writer_only", "%"))
    method = DbMysql(addr=f"127.0.0.1:{mariadb.port}", database=name, user_name="writer_only")
    writer = push_mysql.make_writer(method, PushSecrets(password=PASSWORD), timeout_s=TIMEOUT_S)
    try:
        await writer.write([sample("temperature", "41", T0_MS), sample("temperature", "42", T0_MS + 1000)])
    finally:
        await writer.aclose()
    assert [f for _, _, f in rows(mariadb, name, "default/edge-1-gpu0/temperature")] == ["41", "42"]


async def test_server_down_is_transient_and_the_retry_writes_each_row_once(tmp_path: Path, local_zone: None) -> None:
    server = MariaDb(tmp_path)
    server.start()
    try:
        server.make_database("telemetry", "gpu", PASSWORD)
        writer = writer_for(server.port, "telemetry", timeout_s=2.0)
        first = [sample("temperature", str(40 + i), T0_MS + i * 1000) for i in range(3)]
        later = [sample("temperature", str(50 + i), T0_MS + (3 + i) * 1000) for i in range(3)]
        try:
            await writer.write(first)
            server.stop()
            started = time.monotonic()
            with pytest.raises(TransientError):
                await writer.write(later)
            assert time.monotonic() - started < 2 * 2.0 + 1
            with pytest.raises(TransientError):  # still down: a fresh connection is refused too
                await writer.write(later)
            server.start()
            await writer.write(later)
            server.stop()  # a restart between two writes costs no error: the ping finds the connection dead
            server.start()
            await writer.write([sample("temperature", "53", T0_MS + 6000)])
        finally:
            await writer.aclose()
        got = rows(server, "telemetry", "default/edge-1-gpu0/temperature")
    finally:
        server.cleanup()
    t0_s = T0_MS // 1000
    assert got == [(i + 1, t0_s + i, str(v)) for i, v in enumerate([40, 41, 42, 50, 51, 52, 53])]


async def test_a_commit_whose_answer_never_came_is_not_written_twice(
    mariadb: MariaDb, database: str, local_zone: None
) -> None:
    proxy = CuttingProxy(mariadb.port)
    writer = writer_for(proxy.port, database)
    first = [sample("temperature", str(40 + i), T0_MS + i * 1000) for i in range(3)]
    more = [sample("temperature", "43", T0_MS + 3000), sample("power_usage", "100", T0_MS + 3000)]
    try:
        await writer.write([sample("temperature", "39", T0_MS - 1000)])
        proxy.cut_after(b"\x03COMMIT")
        with pytest.raises(TransientError):
            await writer.write(first)
        assert proxy.cuts == 1
        # The server committed it: the rows are there although the writer was told nothing.
        assert [f for _, _, f in rows(mariadb, database, "default/edge-1-gpu0/temperature")] == ["39", "40", "41", "42"]
        await writer.write(first + more)  # the framework retries the batch, with what came since
    finally:
        await writer.aclose()
        proxy.close()
    t0_s = T0_MS // 1000
    assert rows(mariadb, database, "default/edge-1-gpu0/temperature") == [
        (1, t0_s - 1, "39"),
        (2, t0_s, "40"),
        (3, t0_s + 1, "41"),
        (4, t0_s + 2, "42"),
        (5, t0_s + 3, "43"),
    ]
    assert rows(mariadb, database, "default/edge-1-gpu0/power_usage") == [(1, t0_s + 3, "100")]


async def test_a_cut_before_commit_leaves_nothing_and_the_retry_writes_once(
    mariadb: MariaDb, database: str, local_zone: None
) -> None:
    proxy = CuttingProxy(mariadb.port)
    writer = writer_for(proxy.port, database)
    batch = [sample("temperature", str(40 + i), T0_MS + i * 1000) for i in range(3)]
    try:
        await writer.write([sample("temperature", "39", T0_MS - 1000)])
        proxy.cut_before(b"\x03COMMIT")
        with pytest.raises(TransientError):
            await writer.write(batch)
        assert proxy.cuts == 1
        assert [f for _, _, f in rows(mariadb, database, "default/edge-1-gpu0/temperature")] == ["39"]
        await writer.write(batch)
    finally:
        await writer.aclose()
        proxy.close()
    got = rows(mariadb, database, "default/edge-1-gpu0/temperature")
    assert [f for _, _, f in got] == ["39", "40", "41", "42"]


async def test_wrong_password_and_unknown_database_are_permanent(mariadb: MariaDb, database: str) -> None:
    for db, password, reason in ((database, "not-it", "auth"), ("no_such_db", PASSWORD, "auth")):
        writer = writer_for(mariadb.port, db, password=password)
        try:
            with pytest.raises(PermanentError) as caught:
                await writer.write([sample("temperature", "41", T0_MS)])
        finally:
            await writer.aclose()
        assert caught.value.reason == reason, caught.value
        assert "Access denied" in str(caught.value)
        assert PASSWORD not in str(caught.value) and "not-it" not in str(caught.value)
    # root sees every database: one that is not there is named as such
    method = DbMysql(addr=f"127.0.0.1:{mariadb.port}", database="no_such_db", user_name="root")
    writer = push_mysql.make_writer(method, PushSecrets(), timeout_s=TIMEOUT_S)
    try:
        with pytest.raises(PermanentError) as caught:
            await writer.write([sample("temperature", "41", T0_MS)])
    finally:
        await writer.aclose()
    assert caught.value.reason == "unknown-database"


async def test_a_row_or_table_the_server_refuses_is_refused_alone(
    mariadb: MariaDb, database: str, local_zone: None
) -> None:
    long_device = "edge-1-" + "g" * 60  # `default/<device>/temperature`: over 64 characters, a name MariaDB refuses
    samples = [
        sample("temperature", "41", T0_MS),
        sample("temperature", "x" * 70_000, T0_MS + 1000),  # over TEXT's 65535 bytes: refused in strict mode
        sample("temperature", "43", T0_MS + 2000),
        sample("temperature", "44", T0_MS, device=long_device),
        sample("power_usage", "100", T0_MS),
    ]
    writer = writer_for(mariadb.port, database)
    try:
        with pytest.raises(PermanentError) as caught:
            await writer.write(samples)
    finally:
        await writer.aclose()
    message = str(caught.value)
    assert "2 of 5 samples refused" in message
    assert isinstance(caught.value, PartlyRefusedError) and caught.value.refused == (1, 3), "which were refused"
    assert "Incorrect table name" in message  # the first refused (tables are made before the rows go in)
    assert caught.value.reason == "mysql-1103"
    t0_s = T0_MS // 1000
    got = rows(mariadb, database, "default/edge-1-gpu0/temperature")
    # In order; the ids have a gap (the batch's multi-row INSERT was undone before the rows went one by one).
    assert [(ts, field) for _, ts, field in got] == [(t0_s, "41"), (t0_s + 2, "43")]
    assert got[0][0] < got[1][0]
    assert rows(mariadb, database, "default/edge-1-gpu0/power_usage") == [(1, t0_s, "100")]


async def test_the_error_of_each_refusal_is_named(mariadb: MariaDb, database: str, local_zone: None) -> None:
    writer = writer_for(mariadb.port, database)
    try:
        with pytest.raises(PermanentError) as too_long:
            await writer.write([sample("temperature", "x" * 70_000, T0_MS)])
        with pytest.raises(PermanentError) as bad_name:
            await writer.write([sample("temperature", "44", T0_MS, device="edge-1-" + "g" * 60)])
    finally:
        await writer.aclose()
    assert too_long.value.reason == "mysql-1406" and "Data too long" in str(too_long.value)
    assert bad_name.value.reason == "mysql-1103" and "Incorrect table name" in str(bad_name.value)


@pytest.mark.parametrize(
    ("addr", "database", "user", "reason"),
    [
        ("", "db", "gpu", "bad-addr"),
        ("127.0.0.1:0", "db", "gpu", "bad-addr"),
        ("127.0.0.1:3306", "", "gpu", "bad-config"),
        ("127.0.0.1:3306", "db", "", "bad-config"),
    ],
)
def test_a_config_no_connection_can_be_made_from_is_permanent(addr: str, database: str, user: str, reason: str) -> None:
    with pytest.raises(PermanentError) as caught:
        push_mysql.make_writer(DbMysql(addr=addr, database=database, user_name=user), PushSecrets(), timeout_s=1.0)
    assert caught.value.reason == reason


async def test_a_server_that_never_answers_times_out() -> None:
    import socket
    import threading

    silent = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(silent.accept()[0]), daemon=True).start()
    writer = writer_for(silent.getsockname()[1], "db", timeout_s=1.0)
    started = time.monotonic()
    try:
        with pytest.raises(TransientError):
            await writer.write([sample("temperature", "41", T0_MS)])
    finally:
        await writer.aclose()
        silent.close()
        for sock in accepted:
            sock.close()
    assert 0.9 < time.monotonic() - started < 3.0
