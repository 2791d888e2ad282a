"""The push buffer (SQLite): per-destination order, bounds shared with the telemetry buffer, restarts, corruption."""

from __future__ import annotations

from pathlib import Path

import pytest

from mapper.clock import FakeClock
from mapper.edge.outbox.records import StoredBatch
from mapper.edge.storage.buffer import Buffer
from mapper.edge.storage.pushbuffer import ROW_OVERHEAD_BYTES, PushBuffer

SPEC_A = '{"kind":"http","hostName":"http://a","port":80,"requestPath":"","timeout":0}'
SPEC_B = '{"kind":"otel","endpointURL":"http://b/v1/metrics"}'


def rows(key: str, spec: str, start_ms: int, n: int, size: int = 10) -> list[tuple[str, str, int, bytes]]:
    return [(key, spec, start_ms + i, f"{key}-{i}".encode().ljust(size, b".")) for i in range(n)]


def test_each_destination_reads_its_own_samples_oldest_first_and_acked_ones_are_gone(
    tmp_path: Path, fake_clock: FakeClock
) -> None:
    buf = PushBuffer(tmp_path / "push.db", max_bytes=10**6, max_age_s=3600, clock=fake_clock)
    now = fake_clock.wall_ms()
    mixed = [r for pair in zip(rows("a", SPEC_A, now, 5), rows("b", SPEC_B, now, 5), strict=True) for r in pair]
    buf.put_many(mixed)
    a = buf.pending("a", 10)
    assert [p for _, p in a] == [f"a-{i}".encode().ljust(10, b".") for i in range(5)]
    assert buf.backlog("a") == (5, 5 * (10 + ROW_OVERHEAD_BYTES)) and buf.backlog("b")[0] == 5
    buf.ack("a", [i for i, _ in a[:3]])
    assert [p[:3] for _, p in buf.pending("a", 10)] == [b"a-3", b"a-4"]
    buf.ack("b", [i for i, _ in a[3:]])  # another destination's ids: not its to ack
    assert buf.backlog("a")[0] == 2
    assert buf.keys() == {"a": SPEC_A, "b": SPEC_B}
    buf.close()


def test_refused_samples_are_dropped_and_counted_per_destination(tmp_path: Path, fake_clock: FakeClock) -> None:
    buf = PushBuffer(tmp_path / "push.db", max_bytes=10**6, max_age_s=3600, clock=fake_clock)
    buf.put_many(rows("a", SPEC_A, fake_clock.wall_ms(), 3))
    buf.drop("a", [i for i, _ in buf.pending("a", 2)], "refused")
    assert buf.drops() == {("a", "refused"): 2} and buf.backlog("a")[0] == 1


def test_a_backlog_and_its_destinations_spec_survive_a_restart(tmp_path: Path, fake_clock: FakeClock) -> None:
    buf = PushBuffer(tmp_path / "push.db", max_bytes=10**6, max_age_s=3600, clock=fake_clock)
    buf.put_many(rows("a", SPEC_A, fake_clock.wall_ms(), 4))
    buf.close()
    again = PushBuffer(tmp_path / "push.db", max_bytes=10**6, max_age_s=3600, clock=fake_clock)
    assert again.keys() == {"a": SPEC_A}
    assert again.backlog("a") == (4, 4 * (10 + ROW_OVERHEAD_BYTES))
    assert [p[:3] for _, p in again.pending("a", 10)] == [b"a-0", b"a-1", b"a-2", b"a-3"]
    again.ack("a", [i for i, _ in again.pending("a", 10)])
    again.forget("a")
    assert again.keys() == {}


def test_samples_older_than_the_age_bound_are_dropped_oldest_first(tmp_path: Path, fake_clock: FakeClock) -> None:
    buf = PushBuffer(tmp_path / "push.db", max_bytes=10**6, max_age_s=60, clock=fake_clock)
    old = fake_clock.wall_ms()
    buf.put_many(rows("a", SPEC_A, old, 3))
    fake_clock.advance(61)
    buf.put_many(rows("b", SPEC_B, fake_clock.wall_ms(), 1))
    assert buf.backlog("a") == (0, 0) and buf.backlog("b")[0] == 1
    assert buf.drops() == {("a", "age"): 3}


def test_the_byte_bound_is_shared_with_the_telemetry_buffer(tmp_path: Path, fake_clock: FakeClock) -> None:
    """Both files within one ``buffer.maxBytes``: whichever writes drops its own oldest when the two together
    would hold more."""
    cap = 2000
    push: PushBuffer | None = None
    telemetry = Buffer(
        tmp_path / "telemetry.db",
        max_bytes=cap,
        max_age_s=3600,
        clock=fake_clock,
        shared_bytes=lambda: push.stored_bytes if push is not None else 0,
    )
    push = PushBuffer(
        tmp_path / "push.db",
        max_bytes=cap,
        max_age_s=3600,
        clock=fake_clock,
        shared_bytes=lambda: telemetry.stored_bytes,
    )
    now = fake_clock.wall_ms()
    for i in range(3):
        telemetry.put(StoredBatch("d", "u", "b", i, now, now, "t", b"x" * 400))
    held = telemetry.stored_bytes
    assert held == 3 * (400 + 24)
    size = 100 - ROW_OVERHEAD_BYTES  # each push row counts 100 bytes
    push.put_many(rows("a", SPEC_A, now, 10, size))
    assert push.stored_bytes + telemetry.stored_bytes <= cap
    # 2000 - 1272 leaves room for 7 rows of 100 bytes: the 3 oldest go.
    assert push.stored_bytes == 700 and push.drops() == {("a", "size"): 3}
    assert next(p[:3] for _, p in push.pending("a", 20)) == b"a-3", "the oldest went first"
    # Now the telemetry writes: it drops its own oldest to stay within the shared cap.
    telemetry.put(StoredBatch("d", "u", "b", 9, now, now, "t", b"y" * 400))
    assert push.stored_bytes + telemetry.stored_bytes <= cap
    assert telemetry.stats().drops_by_reason["size"] == 1 and push.stored_bytes == 700
    telemetry.close()
    push.close()


def test_a_corrupt_file_is_moved_aside_and_a_fresh_one_started(tmp_path: Path, fake_clock: FakeClock) -> None:
    path = tmp_path / "push.db"
    path.write_bytes(b"this is not a database" * 100)
    buf = PushBuffer(path, max_bytes=10**6, max_age_s=3600, clock=fake_clock)
    buf.put_many(rows("a", SPEC_A, fake_clock.wall_ms(), 1))
    assert buf.files_moved_aside == 1 and buf.backlog("a")[0] == 1
    assert len(list(tmp_path.glob("push.db.corrupt-*"))) == 1


def test_bad_bounds_are_refused(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="max_bytes"):
        PushBuffer(tmp_path / "p.db", max_bytes=0, max_age_s=1)
    with pytest.raises(Exception, match="max_age_s"):
        PushBuffer(tmp_path / "p.db", max_bytes=1, max_age_s=0)


def test_a_push_buffer_opened_on_a_full_data_dir_degrades_keeps_its_file_and_opens_again_when_space_returns(
    tmp_path: Path, fake_clock: FakeClock
) -> None:
    """A restart on a full data dir (the push buffer beside the telemetry buffer): SQLite cannot open push.db for
    writing. The mapper must still start: the push buffer says why, refuses new samples with a TransientError (the
    router counts them) and, once space returns, opens the file with its backlog intact, nothing moved aside."""
    import sqlite3

    from mapper.errors import TransientError
    from tests.smallfs import fill, small_tmpfs

    with small_tmpfs(tmp_path / "fs", 1024**2) as fs:
        first = PushBuffer(fs / "push.db", max_bytes=10**6, max_age_s=10**9, clock=fake_clock)
        first.put_many(rows("http a", "spec-a", fake_clock.wall_ms(), 5))
        first.close()
        filler = fill(fs)
        with pytest.raises(sqlite3.OperationalError):  # what stopped the mapper's start before
            sqlite3.connect(fs / "push.db").execute("PRAGMA journal_mode=WAL").fetchone()
        buf = PushBuffer(fs / "push.db", max_bytes=10**6, max_age_s=10**9, clock=fake_clock)
        assert buf.degraded == "data dir full"
        with pytest.raises(TransientError, match="data dir full"):
            buf.put_many(rows("http a", "spec-a", fake_clock.wall_ms(), 1))
        filler.unlink()
        with pytest.raises(TransientError):  # tried again at most once a second
            buf.put_many(rows("http a", "spec-a", fake_clock.wall_ms(), 1))
        fake_clock.advance(1.5)
        buf.put_many(rows("http a", "spec-a", fake_clock.wall_ms(), 1))
        assert buf.degraded == "" and buf.backlog("http a")[0] == 6, "the file's five and the new one"
        assert len(buf.pending("http a", 100)) == 6
        buf.close()
        assert not list(fs.glob("*.corrupt-*"))
