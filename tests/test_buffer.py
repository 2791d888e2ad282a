from __future__ import annotations

import logging
import random
import sqlite3
from pathlib import Path

import pytest

from mapper.clock import FakeClock
from mapper.edge.outbox.records import StoredBatch
from mapper.edge.storage.buffer import ROW_OVERHEAD_BYTES, Buffer
from mapper.errors import ConfigError, PermanentError, TransientError
from mapper.shared.model import Sample
from mapper.wire.telemetry import encode_batch
from tests.smallfs import NEEDS_ROOT, ext4_that_fails, fill, free_bytes, small_tmpfs


def _put(buf: Buffer, clock: FakeClock, seq: int, *, device: str = "default/gpu0", size: int = 200) -> int:
    return buf.put(_item(clock, seq, device=device, size=size))


def _open(path: Path, clock: FakeClock, **kw: object) -> Buffer:
    opts: dict[str, object] = {"max_bytes": 10_000_000, "max_age_s": 86_400.0, "clock": clock}
    opts.update(kw)
    return Buffer(path, **opts)  # type: ignore[arg-type]


def test_batches_come_back_oldest_first_across_devices_and_pages(tmp_path: Path, fake_clock: FakeClock) -> None:
    buf = _open(tmp_path / "b.db", fake_clock)
    for seq in range(10):
        _put(buf, fake_clock, seq, device=f"default/gpu{seq % 3}")
    first = buf.pending(4)
    rest = buf.pending(100, after_id=first[-1].id)
    rows = first + rest
    assert [r.payload[0] for r in rows] == list(range(10))
    assert [r.device for r in rows][:3] == ["default/gpu0", "default/gpu1", "default/gpu2"]
    assert rows[0].payload == bytes([0]) * 200
    assert (rows[0].qos, rows[0].retain, rows[0].address, rows[0].boot_id) == (1, False, "", "boot-a")


def test_an_acked_batch_is_gone_and_stats_follow(tmp_path: Path, fake_clock: FakeClock) -> None:
    buf = _open(tmp_path / "b.db", fake_clock)
    ids = [_put(buf, fake_clock, seq) for seq in range(3)]
    buf.ack(ids[1])
    buf.ack(ids[1])  # twice is harmless
    assert [r.payload[0] for r in buf.pending(10)] == [0, 2]
    stats = buf.stats()
    assert (stats.batches, stats.bytes) == (2, 2 * (200 + ROW_OVERHEAD_BYTES))


def test_stored_batches_survive_closing_and_reopening(tmp_path: Path, fake_clock: FakeClock) -> None:
    buf = _open(tmp_path / "b.db", fake_clock)
    for seq in range(5):
        _put(buf, fake_clock, seq)
    buf.put_latest("default/gpu0", b'{"temperature":61}')
    buf.close()
    again = _open(tmp_path / "b.db", fake_clock)
    assert [r.payload[0] for r in again.pending(10)] == [0, 1, 2, 3, 4]
    assert again.stats().batches == 5
    assert again.latest() == {"default/gpu0": b'{"temperature":61}'}


def test_new_ids_keep_growing_after_the_newest_batch_was_acked(tmp_path: Path, fake_clock: FakeClock) -> None:
    buf = _open(tmp_path / "b.db", fake_clock)
    last = _put(buf, fake_clock, 0)
    buf.ack(last)
    assert _put(buf, fake_clock, 1) > last


def test_the_size_cap_drops_the_oldest_batches_and_counts_them(tmp_path: Path, fake_clock: FakeClock) -> None:
    per_batch = 200 + ROW_OVERHEAD_BYTES
    buf = _open(tmp_path / "b.db", fake_clock, max_bytes=10 * per_batch)
    for seq in range(25):
        _put(buf, fake_clock, seq)
    assert [r.payload[0] for r in buf.pending(100)] == list(range(15, 25))
    stats = buf.stats()
    assert stats.bytes <= 10 * per_batch
    assert stats.drops_by_reason["size"] == 15


def test_the_age_cap_drops_batches_older_than_max_age(tmp_path: Path, fake_clock: FakeClock) -> None:
    buf = _open(tmp_path / "b.db", fake_clock, max_age_s=60.0)
    for seq in range(5):
        _put(buf, fake_clock, seq)
        fake_clock.advance(20)
    # now: batch 0 ended 100 s ago, batch 1 80 s ago, batch 2 60 s, 3 40 s, 4 20 s
    buf.enforce_bounds()
    assert [r.payload[0] for r in buf.pending(10)] == [2, 3, 4]
    assert buf.stats().drops_by_reason["age"] == 2
    # batch 2's first sample is in its payload; this test payload is not a batch, so its last time (60 s ago) counts
    assert buf.stats().oldest_age_s == pytest.approx(60.0)


def test_a_corrupt_file_is_moved_aside_loudly_and_a_new_one_works(
    tmp_path: Path, fake_clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "b.db"
    path.write_bytes(b"this is not sqlite at all" * 200)
    with caplog.at_level(logging.ERROR, logger="mapper.edge.storage.buffer"):
        buf = _open(path, fake_clock)
    moved = list(tmp_path.glob("b.db.corrupt-*"))
    assert len(moved) == 1
    assert moved[0].read_bytes().startswith(b"this is not sqlite")
    assert any("corrupt" in r.message and r.levelno == logging.ERROR for r in caplog.records)
    assert buf.stats().files_moved_aside == 1
    _put(buf, fake_clock, 1)
    assert [r.payload[0] for r in buf.pending(10)] == [1]


def test_a_file_that_goes_bad_while_open_is_replaced_and_the_write_retried(
    tmp_path: Path, fake_clock: FakeClock
) -> None:
    path = tmp_path / "b.db"
    buf = _open(path, fake_clock)
    for seq in range(3):
        _put(buf, fake_clock, seq)
    buf.close()
    data = bytearray(path.read_bytes())
    data[0:16] = b"garbage garbage!"
    path.write_bytes(bytes(data))
    buf = _open(path, fake_clock, check_on_open=False)
    _put(buf, fake_clock, 9)
    assert [r.payload[0] for r in buf.pending(10)] == [9]
    assert buf.stats().files_moved_aside == 1


def test_a_full_disk_drops_the_oldest_and_the_new_batch_is_stored(tmp_path: Path, fake_clock: FakeClock) -> None:
    buf = _open(tmp_path / "b.db", fake_clock, max_page_count=40)
    stored = 0
    for seq in range(300):
        _put(buf, fake_clock, seq, size=1000)
        stored += 1
    rows = buf.pending(1000)
    assert rows[-1].payload[0] == 299 % 256
    assert buf.stats().drops_by_reason["disk_full"] > 0
    assert len(rows) + buf.stats().drops_by_reason["disk_full"] == stored
    assert [r.payload[0] for r in rows] == [s % 256 for s in range(300 - len(rows), 300)]


def test_the_latest_snapshot_per_device_replaces_the_previous_one(tmp_path: Path, fake_clock: FakeClock) -> None:
    buf = _open(tmp_path / "b.db", fake_clock)
    buf.put_latest("default/gpu0", b"a")
    buf.put_latest("default/gpu1", b"b")
    buf.put_latest("default/gpu0", b"c")
    assert buf.latest() == {"default/gpu0": b"c", "default/gpu1": b"b"}
    buf.forget_latest("default/gpu1")
    assert buf.latest() == {"default/gpu0": b"c"}


def test_the_database_runs_in_wal_mode_with_synchronous_normal(tmp_path: Path, fake_clock: FakeClock) -> None:
    buf = _open(tmp_path / "b.db", fake_clock)
    _put(buf, fake_clock, 0)
    conn = sqlite3.connect(tmp_path / "b.db")
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.close()
    assert buf.synchronous == "NORMAL"


def test_bad_settings_and_bad_batches_are_refused_with_a_clear_error(tmp_path: Path, fake_clock: FakeClock) -> None:
    with pytest.raises(ConfigError, match="max_bytes"):
        _open(tmp_path / "b.db", fake_clock, max_bytes=0)
    with pytest.raises(ConfigError, match="max_age_s"):
        _open(tmp_path / "b.db", fake_clock, max_age_s=-1)
    buf = _open(tmp_path / "b.db", fake_clock)
    with pytest.raises(ValueError, match="qos"):
        buf.put(
            StoredBatch(
                device="d", uuid="u", boot_id="b", seq=0, ts_first_ms=0, ts_last_ms=0, topic="t", payload=b"", qos=3
            )
        )
    buf.close()
    with pytest.raises(PermanentError, match="closed"):
        buf.pending(1)


def test_stored_time_ranges_and_seq_come_back_exactly_across_a_reopen(tmp_path: Path, fake_clock: FakeClock) -> None:
    buf = _open(tmp_path / "b.db", fake_clock)
    start = fake_clock.wall_ms()
    samples = [Sample("GPU-1", start - 123_456, {"temperature": 61}), Sample("GPU-1", start + 7, {"temperature": 62})]
    batch = encode_batch(samples, node="n", device="d", uuid="GPU-1", boot_id="0badf00d", seq=41)
    buf.put(
        StoredBatch(
            device="d",
            uuid="GPU-1",
            boot_id="0badf00d",
            seq=41,
            ts_first_ms=batch.ts_first_ms,
            ts_last_ms=batch.ts_last_ms,
            topic="t",
            payload=batch.payload,
        )
    )
    buf.close()
    fake_clock.advance(3600)
    again = _open(tmp_path / "b.db", fake_clock)
    (row,) = again.pending(10)
    assert (row.seq, row.ts_first_ms, row.ts_last_ms) == (41, start - 123_456, start + 7)
    assert again.stats().oldest_ts_ms == start - 123_456


def test_a_payload_that_is_not_a_batch_has_no_seq_and_its_last_time_as_first(
    tmp_path: Path, fake_clock: FakeClock
) -> None:
    buf = _open(tmp_path / "b.db", fake_clock)
    now = fake_clock.wall_ms()
    buf.put(
        StoredBatch(
            device="d", uuid="u", boot_id="b", seq=3, ts_first_ms=now - 5, ts_last_ms=now, topic="t", payload=b"x"
        )
    )
    (row,) = buf.pending(10)
    assert (row.seq, row.ts_first_ms, row.ts_last_ms) == (-1, now, now)


def test_the_file_has_no_index_besides_the_tables_themselves(tmp_path: Path, fake_clock: FakeClock) -> None:
    buf = _open(tmp_path / "b.db", fake_clock)
    _put(buf, fake_clock, 0)
    buf.close()
    conn = sqlite3.connect(tmp_path / "b.db")
    kinds = conn.execute("SELECT type, name FROM sqlite_master ORDER BY name").fetchall()
    conn.close()
    assert kinds == [("table", "batches"), ("table", "latest"), ("table", "meta"), ("table", "streams")]


def test_a_schema_1_file_is_converted_in_place_and_keeps_its_batches(tmp_path: Path, fake_clock: FakeClock) -> None:
    path = tmp_path / "b.db"
    conn = sqlite3.connect(path)
    conn.executescript(
        """
        CREATE TABLE streams (id INTEGER PRIMARY KEY, device TEXT NOT NULL, uuid TEXT NOT NULL,
            boot_id TEXT NOT NULL, topic TEXT NOT NULL, qos INTEGER NOT NULL, retain INTEGER NOT NULL,
            address TEXT NOT NULL, UNIQUE (device, uuid, boot_id, topic, qos, retain, address));
        CREATE TABLE batches (id INTEGER PRIMARY KEY AUTOINCREMENT, stream INTEGER NOT NULL, seq INTEGER NOT NULL,
            ts_first_ms INTEGER NOT NULL, ts_last_ms INTEGER NOT NULL, size INTEGER NOT NULL, payload BLOB NOT NULL);
        CREATE TABLE latest (device TEXT PRIMARY KEY, ts_ms INTEGER, payload BLOB);
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT);
        INSERT INTO meta VALUES ('schema_version', '1');
        INSERT INTO streams VALUES (1, 'default/gpu0', 'GPU-1', 'boot-a', 'gpu-mapper/n/gpu0/telemetry', 1, 0, '');
        INSERT INTO batches VALUES (7, 1, 41, 1780000000000, 1780000009000, 52, x'0102');
        INSERT INTO latest VALUES ('default/gpu0', 1780000009000, x'7b7d');
        """
    )
    conn.close()
    buf = _open(path, fake_clock)
    (row,) = buf.pending(10)
    assert (row.id, row.device, row.ts_last_ms, row.payload) == (7, "default/gpu0", 1_780_000_009_000, b"\x01\x02")
    assert buf.latest() == {"default/gpu0": b"{}"}
    assert _put(buf, fake_clock, 42) == 8


def test_a_schema_2_file_is_converted_in_place_and_keeps_its_batches(tmp_path: Path, fake_clock: FakeClock) -> None:
    path = tmp_path / "b.db"
    conn = sqlite3.connect(path)
    conn.executescript(
        """
        CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID;
        CREATE TABLE streams (id INTEGER PRIMARY KEY, device TEXT NOT NULL, uuid TEXT NOT NULL,
            boot_id TEXT NOT NULL, topic TEXT NOT NULL, qos INTEGER NOT NULL, retain INTEGER NOT NULL,
            address TEXT NOT NULL);
        CREATE TABLE batches (id INTEGER PRIMARY KEY, stream INTEGER NOT NULL, seq INTEGER NOT NULL,
            ts_first_rel_ms INTEGER NOT NULL, span_ms INTEGER NOT NULL, payload BLOB NOT NULL);
        CREATE TABLE latest (device TEXT PRIMARY KEY, ts_ms INTEGER NOT NULL, payload BLOB NOT NULL) WITHOUT ROWID;
        INSERT INTO meta VALUES ('schema_version', '2');
        INSERT INTO meta VALUES ('epoch_ms', '1780000000000');
        INSERT INTO streams VALUES (1, 'default/gpu0', 'GPU-1', 'boot-a', 'gpu-mapper/n/gpu0/telemetry', 1, 0, '');
        INSERT INTO batches VALUES (7, 1, 41, 5000, 9000, x'0102');
        INSERT INTO latest VALUES ('default/gpu0', 1780000014000, x'7b7d');
        """
    )
    conn.close()
    buf = _open(path, fake_clock)
    (row,) = buf.pending(10)
    assert (row.id, row.device, row.ts_last_ms, row.payload) == (7, "default/gpu0", 1_780_000_014_000, b"\x01\x02")
    assert buf.latest() == {"default/gpu0": b"{}"}
    assert _put(buf, fake_clock, 42) == 8


def _item(
    clock: FakeClock,
    seq: int,
    *,
    device: str = "default/gpu0",
    size: int = 200,
    age_s: float = 0.0,
    **fields: object,
) -> StoredBatch:
    """A batch of ``size`` bytes whose first byte is ``seq % 256`` (r.payload[0] == seq % 256), its last sample
    ``age_s`` old; ``fields``: other values for the record's own fields (topic, qos, ts_first_ms, ...)."""
    last = clock.wall_ms() - round(age_s * 1000)
    values: dict[str, object] = {
        "device": device,
        "uuid": "GPU-1",
        "boot_id": "boot-a",
        "seq": seq,
        "ts_first_ms": last - 10_000,
        "ts_last_ms": last,
        "topic": f"gpu-mapper/n/{device}/telemetry",
        "payload": bytes([seq % 256]) * size,
    }
    values.update(fields)
    return StoredBatch(**values)  # type: ignore[arg-type]


def _contents(buf: Buffer) -> tuple[object, ...]:
    rows = [(r.id, r.device, r.topic, r.qos, r.retain, r.address, r.ts_last_ms, r.payload) for r in buf.pending(10_000)]
    s = buf.stats()
    return rows, s.bytes, s.batches, s.oldest_ts_ms, s.drops_by_reason


def test_replace_merges_rows_only_while_each_still_holds_what_was_merged(tmp_path: Path, fake_clock: FakeClock) -> None:
    """Compaction read the rows, merged them in a thread; meanwhile the shipper may have acked one, or another
    merge rewritten one. ``replace`` re-checks every row in its transaction: a row gone, a row holding another
    payload, or rows of two streams leave the buffer exactly as it was."""
    buf = _open(tmp_path / "b.db", fake_clock)
    ids = [_put(buf, fake_clock, seq) for seq in range(5)]  # one stream: 200 bytes each
    other = _put(buf, fake_clock, 9, device="default/gpu1")
    read = buf.payloads(ids)
    assert read == {i: bytes([seq]) * 200 for seq, i in enumerate(ids)}
    ts = fake_clock.wall_ms()

    # a row rewritten since it was read (here: by a merge of its own)
    assert buf.replace({ids[1]: read[ids[1]], ids[2]: read[ids[2]]}, b"M" * 250, ts) is True
    unchanged = _contents(buf)
    stale = {ids[2]: read[ids[2]], ids[3]: read[ids[3]]}
    assert buf.replace(stale, b"X" * 100, ts) is False
    assert _contents(buf) == unchanged
    # a row acked since it was read
    buf.ack(ids[3])
    unchanged = _contents(buf)
    assert buf.replace({ids[3]: read[ids[3]], ids[4]: read[ids[4]]}, b"Y" * 100, ts) is False
    assert _contents(buf) == unchanged
    # rows of two streams, each as it was read
    assert buf.replace({ids[4]: read[ids[4]], other: buf.payloads([other])[other]}, b"Z" * 100, ts) is False
    assert _contents(buf) == unchanged
    # rows that still hold what was read are merged: the last id takes the payload, the others are gone
    assert buf.replace({ids[0]: read[ids[0]], ids[2]: b"M" * 250}, b"W" * 300, ts) is True
    assert [(r.id, r.payload) for r in buf.pending(10)] == [(ids[2], b"W" * 300), (ids[4], read[ids[4]]),
                                                            (other, bytes([9]) * 200)]  # fmt: skip
    stats = buf.stats()
    assert (stats.batches, stats.bytes) == (3, 300 + 200 + 200 + 3 * ROW_OVERHEAD_BYTES)
    with pytest.raises(ValueError, match="at least one row"):
        buf.replace({}, b"", ts)


def test_put_many_stores_a_round_in_order_with_increasing_ids(tmp_path: Path, fake_clock: FakeClock) -> None:
    buf = _open(tmp_path / "b.db", fake_clock)
    first = _put(buf, fake_clock, 0)
    items = [_item(fake_clock, seq, device=f"default/gpu{seq % 8}") for seq in range(1, 9)]
    other = StoredBatch(
        "default/gpu3", "GPU-3", "boot-a", 9, 5, 6, "site/power", b"\x09", qos=0, retain=True, address="tcp://b:1883"
    )
    ids = buf.put_many([*items, other])
    assert ids == sorted(set(ids)) and ids[0] > first  # strictly increasing, after what was there
    assert _put(buf, fake_clock, 10) > ids[-1]
    rows = buf.pending(4) + buf.pending(100, after_id=ids[2])
    assert [r.id for r in rows] == [first, *ids, ids[-1] + 1]
    assert [r.payload[0] for r in rows] == list(range(11))
    assert [r.device for r in rows[1:9]] == [f"default/gpu{seq % 8}" for seq in range(1, 9)]
    assert (rows[9].topic, rows[9].qos, rows[9].retain, rows[9].address, rows[9].ts_last_ms) == (
        "site/power",
        0,
        True,
        "tcp://b:1883",
        6,
    )
    assert buf.stats().batches == 11
    assert buf.put_many([]) == []


def test_put_many_rows_are_committed_when_it_returns(tmp_path: Path, fake_clock: FakeClock) -> None:
    buf = _open(tmp_path / "b.db", fake_clock)
    ids = buf.put_many([_item(fake_clock, seq) for seq in range(8)])
    other = sqlite3.connect(tmp_path / "b.db")  # what a crash right now would leave: another reader's view
    try:
        seen = other.execute("SELECT id, length(payload) FROM batches ORDER BY id").fetchall()
    finally:
        other.close()
    assert seen == [(i, 200) for i in ids]


def test_a_bad_item_stores_nothing_of_its_put_many(tmp_path: Path, fake_clock: FakeClock) -> None:
    buf = _open(tmp_path / "b.db", fake_clock)
    before = _put(buf, fake_clock, 0)
    good = [_item(fake_clock, seq, device="default/gpu7") for seq in (1, 2)]  # a device the file does not know yet
    bad = {
        "empty topic": _item(fake_clock, 3, topic=""),
        "qos": _item(fake_clock, 3, qos=3),
        "before ts_first_ms": _item(fake_clock, 3, ts_first_ms=fake_clock.wall_ms() + 1),
    }
    for why, item in bad.items():
        with pytest.raises(ValueError, match=f"default/gpu0 seq 3 \\(item 2 of 3\\): .*{why}"):
            buf.put_many([*good, item])
    assert [r.id for r in buf.pending(10)] == [before]
    assert buf.stats().batches == 1
    ids = buf.put_many(good)  # the refused calls left nothing behind: their stream is new here
    assert ids[0] > before
    assert [r.device for r in buf.pending(10)] == ["default/gpu0", "default/gpu7", "default/gpu7"]


def test_put_many_enforces_the_bounds_exactly_as_the_same_puts_one_by_one(
    tmp_path: Path, fake_clock: FakeClock
) -> None:
    # Rounds of 0-9 batches of mixed sizes and ages against tight caps: drops for age and for size interleave
    # within a round (a batch enforced against the caps only at the end of a round would be dropped for size
    # where the puts drop it for age, or kept where they drop it). Acks and time pass between rounds.
    rng = random.Random(20240611)
    for case in range(6):
        max_bytes, max_age_s = [(700, 60.0), (1_500, 30.0), (4_000, 60.0), (10**9, 60.0), (900, 10**6), (3_000, 45.0)][
            case
        ]
        one = _open(tmp_path / f"one{case}.db", fake_clock, max_bytes=max_bytes, max_age_s=max_age_s)
        many = _open(tmp_path / f"many{case}.db", fake_clock, max_bytes=max_bytes, max_age_s=max_age_s)
        seq = 0
        for _round in range(25):
            items = []
            for _ in range(rng.randint(0, 9)):
                age_s = rng.choice([0.0, 0.0, 20.0, 50.0, 70.0, 200.0])
                items.append(
                    _item(fake_clock, seq, device=f"default/gpu{seq % 3}", size=rng.choice([20, 200, 450]), age_s=age_s)
                )
                seq += 1
            ids_one = [one.put(item) for item in items]
            assert many.put_many(items) == ids_one
            assert _contents(many) == _contents(one)
            if rng.random() < 0.3 and ids_one:
                one.ack(ids_one[0])
                many.ack(ids_one[0])
            fake_clock.advance(rng.choice([0.0, 5.0, 20.0]))
        drops = many.stats().drops_by_reason
        assert drops == one.stats().drops_by_reason
    assert drops["age"] > 0 and drops["size"] > 0  # the last case dropped for both reasons


def test_put_many_after_the_file_went_bad_stores_the_round_in_a_new_file(tmp_path: Path, fake_clock: FakeClock) -> None:
    path = tmp_path / "b.db"
    buf = _open(path, fake_clock)
    _put(buf, fake_clock, 0)
    buf.close()
    data = bytearray(path.read_bytes())
    data[0:16] = b"garbage garbage!"
    path.write_bytes(bytes(data))
    fake_clock.advance(3600)  # the new file's time base differs from the old one's
    buf = _open(path, fake_clock, check_on_open=False)
    items = [_item(fake_clock, seq) for seq in range(1, 9)]
    buf.put_many(items)
    rows = buf.pending(10)
    assert [(r.payload[0], r.ts_last_ms) for r in rows] == [(i.seq, i.ts_last_ms) for i in items]
    assert buf.stats().files_moved_aside == 1
    assert buf.stats().batches == 8


def test_put_many_on_a_full_disk_drops_the_oldest_and_stores_the_round(tmp_path: Path, fake_clock: FakeClock) -> None:
    buf = _open(tmp_path / "b.db", fake_clock, max_page_count=40)
    stored = 0
    for rnd in range(40):
        buf.put_many([_item(fake_clock, rnd * 8 + g, device=f"default/gpu{g}", size=1000) for g in range(8)])
        stored += 8
    rows = buf.pending(1000)
    drops = buf.stats().drops_by_reason["disk_full"]
    assert drops > 0
    assert len(rows) + drops == stored
    assert [r.payload[0] for r in rows] == [s % 256 for s in range(stored - len(rows), stored)]


def test_put_many_that_cannot_fit_stores_none_and_counts_each_as_lost(tmp_path: Path, fake_clock: FakeClock) -> None:
    buf = _open(tmp_path / "b.db", fake_clock, max_page_count=40)  # 160 KiB
    with pytest.raises(TransientError, match="3 batches lost"):
        buf.put_many([_item(fake_clock, seq, size=100_000) for seq in range(3)])
    assert buf.pending(10) == []
    assert (buf.stats().batches, buf.stats().drops_by_reason["disk_full"]) == (0, 3)
    assert buf.put_many([_item(fake_clock, 3, size=1000)]) != []  # and the buffer still works


# --------------------------------------------------------------------------------------------------
# A data dir that fills up or turns read-only: a real tmpfs
# --------------------------------------------------------------------------------------------------

ROWS = 10


def _real(clock: FakeClock, seq: int) -> StoredBatch:
    """A real telemetry batch of ``ROWS`` samples (noisy values: a few hundred bytes), its seq ``seq``."""
    import random

    from mapper.shared.model import Sample
    from mapper.wire.telemetry import encode_batch

    rng = random.Random(seq)
    t0 = clock.wall_ms()
    samples = [
        Sample("GPU-1", t0 + i * 1000, {"power_usage": rng.uniform(50, 700), "temperature": rng.randint(30, 90)})
        for i in range(ROWS)
    ]
    b = encode_batch(samples, node="n", device="default/gpu0", uuid="GPU-1", boot_id="0badf00d", seq=seq)
    clock.advance(0.001)
    return StoredBatch(
        b.device,
        b.uuid,
        b.boot_id,
        b.seq,
        b.ts_first_ms,
        b.ts_last_ms,
        "gpu-mapper/n/default/gpu0/telemetry",
        b.payload,
    )


def _seqs(buf: Buffer) -> list[int]:
    return [r.seq for r in buf.pending(100_000)]


@NEEDS_ROOT
def test_a_full_data_dir_keeps_batches_in_memory_drops_the_oldest_counted_and_stores_them_when_space_returns(
    tmp_path: Path, fake_clock: FakeClock
) -> None:
    with small_tmpfs(tmp_path / "fs", 2 * 1024**2) as fs:
        buf = _open(fs / "t.db", fake_clock, memory_max_bytes=30_000, reserve_bytes=256 * 1024)
        assert buf.reserve_path.stat().st_size == 256 * 1024, "the reserve is made, with real blocks"
        for seq in range(20):
            buf.put(_real(fake_clock, seq))
        filler = fill(fs)
        assert free_bytes(fs) == 0
        seq = 20
        for seq in range(20, 400):  # nothing raises, whatever the file system says
            buf.put(_real(fake_clock, seq))
        assert buf.degraded == "data dir full"
        assert not buf.reserve_path.exists(), "the reserve went to make room"
        stats = buf.stats()
        assert stats.degraded == "data dir full" and stats.memory_batches > 0
        kept = _seqs(buf)
        dropped = stats.drops_by_reason["disk_full"]
        assert dropped > 0, "memory is bounded: the oldest kept there were dropped"
        assert len(kept) + dropped == 400 and stats.batches == len(kept)
        assert kept == sorted(kept) and kept[-1] == 399, "id order is seq order; the newest kept"
        assert stats.drop_samples_by_reason["disk_full"] == dropped * ROWS

        # Acknowledged: a row in the file (its delete deferred while the file cannot be written) and one in memory.
        rows = buf.pending(100_000)
        buf.ack_many([rows[0].id, rows[-1].id])
        assert _seqs(buf) == kept[1:-1] and buf.stats().batches == len(kept) - 2

        # Space returns: the next write stores what memory holds (at most once a second it is tried).
        filler.unlink()
        fake_clock.advance(2.0)
        buf.put(_real(fake_clock, 400))
        assert buf.degraded == "" and buf.stats().memory_batches == 0
        assert buf.reserve_path.stat().st_size == 256 * 1024, "the reserve is made again"
        assert _seqs(buf) == [*kept[1:-1], 400]
        buf.close()
        again = _open(fs / "t.db", fake_clock)
        assert _seqs(again) == [*kept[1:-1], 400], "all of it in the file"
        again.close()


@NEEDS_ROOT
def test_at_close_a_full_data_dir_stores_what_it_can_and_counts_the_rest(tmp_path: Path, fake_clock: FakeClock) -> None:
    with small_tmpfs(tmp_path / "fs", 1024**2) as fs:
        buf = _open(fs / "t.db", fake_clock, memory_max_bytes=10_000_000, reserve_bytes=64 * 1024)
        for seq in range(10):
            buf.put(_real(fake_clock, seq))
        fill(fs)
        total = 1500  # far more than the reserve's 64 KiB can take
        for seq in range(10, total):
            buf.put(_real(fake_clock, seq))
        buf.put_latest("default/gpu0", b'{"device":"default/gpu0"}')
        assert buf.degraded == "data dir full" and buf.latest() == {"default/gpu0": b'{"device":"default/gpu0"}'}
        in_memory = buf.stats().memory_batches
        assert in_memory > 0
        waiting = _seqs(buf)
        in_file = waiting[: len(waiting) - in_memory]
        dropped_before = buf.drops["disk_full"]  # the oldest, dropped to make room while it ran
        assert len(waiting) + dropped_before == total
        buf.close()  # never raises: stores what the file takes, counts the rest
        lost = buf.drops["disk_full"] - dropped_before
        assert lost > 0 and buf.drop_samples["disk_full"] == (dropped_before + lost) * ROWS
        again = _open(fs / "t.db", fake_clock)
        stored = _seqs(again)
        assert stored == sorted(stored) and len(stored) + lost == len(waiting)
        assert stored[: len(in_file)] == in_file, "at close nothing in the file is dropped"
        again.close()


@NEEDS_ROOT
def test_a_data_dir_whose_disk_fails_keeps_batches_in_memory_and_raises_nothing(
    tmp_path: Path, fake_clock: FakeClock
) -> None:
    """A file system that fails under the buffer (ext4 turning read-only after an error: every write an I/O
    error): the batches go on into memory and out through ``pending``; nothing raises, not even ``close``, which
    counts what it could not store."""
    with ext4_that_fails(tmp_path / "ext4") as (fs, fail):
        buf = _open(fs / "t.db", fake_clock, memory_max_bytes=1_000_000)
        for seq in range(5):
            buf.put(_real(fake_clock, seq))
        fail()
        for seq in range(5, 15):
            buf.put(_real(fake_clock, seq))
        buf.put_latest("default/gpu0", b"{}")
        assert buf.degraded == "data dir unwritable"
        assert buf.stats().degraded == "data dir unwritable" and buf.stats().memory_batches == 10
        assert _seqs(buf) == list(range(15))
        rows = buf.pending(100)
        buf.ack_many([r.id for r in rows[3:7]])  # two in the file (deferred), two in memory
        assert _seqs(buf) == [0, 1, 2, *range(7, 15)]
        fake_clock.advance(2.0)
        buf.put(_real(fake_clock, 15))  # tried again: still failing, kept
        assert buf.stats().memory_batches == 9
        buf.close()
        assert buf.drops["unwritable"] == 9 and buf.drop_samples["unwritable"] == 9 * ROWS


@NEEDS_ROOT
def test_a_full_disk_met_first_by_a_state_snapshot_still_frees_the_reserve_and_stores(
    tmp_path: Path, fake_clock: FakeClock
) -> None:
    """Whichever write meets the full disk first (here a state snapshot, kept in memory), the next retry of the
    file goes by the full-disk policy: the reserve goes and what memory holds is stored in its room."""
    with small_tmpfs(tmp_path / "fs", 1024**2) as fs:
        buf = _open(fs / "t.db", fake_clock, memory_max_bytes=1_000_000, reserve_bytes=128 * 1024)
        for seq in range(5):
            buf.put(_real(fake_clock, seq))
        fill(fs)
        snapshot = b'{"device":"default/gpu0","pad":"' + b"x" * 16_000 + b'"}'  # more than the WAL's free pages
        buf.put_latest("default/gpu0", snapshot)
        assert buf.degraded == "data dir full" and buf.reserve_path.exists()
        fake_clock.advance(2.0)  # a retry is due
        buf.put(_real(fake_clock, 5))
        assert not buf.reserve_path.exists(), "the reserve went to make room"
        assert buf.stats().memory_batches == 0 and _seqs(buf) == list(range(6))
        assert buf.degraded == "data dir full", "no room to make the reserve again: still degraded"
        buf.close()
        again = _open(fs / "t.db", fake_clock)
        assert _seqs(again) == list(range(6)) and again.latest() == {"default/gpu0": snapshot}
        again.close()


@NEEDS_ROOT
def test_a_buffer_opened_on_a_full_data_dir_reads_its_file_keeps_new_batches_in_memory_and_stores_them_later(
    tmp_path: Path, fake_clock: FakeClock
) -> None:
    """A restart on a full data dir: SQLite cannot even open the file for writing. The buffer reads what the file
    holds, keeps new batches in memory (ids above the file's), takes acks of both, and once space returns opens the
    file for writing and stores them: all in one order, nothing moved aside."""
    with small_tmpfs(tmp_path / "fs", 1024**2) as fs:
        first = _open(fs / "t.db", fake_clock)
        for seq in range(10):
            first.put(_real(fake_clock, seq))
        first.close()
        filler = fill(fs)
        with pytest.raises(sqlite3.OperationalError):  # what stopped the mapper's start before
            sqlite3.connect(fs / "t.db").execute("PRAGMA journal_mode=WAL").fetchone()
        buf = _open(fs / "t.db", fake_clock, memory_max_bytes=1_000_000)
        assert buf.degraded == "data dir full"
        assert _seqs(buf) == list(range(10)), "what the file holds is read"
        for seq in range(10, 15):
            buf.put(_real(fake_clock, seq))
        rows = buf.pending(100)
        assert [r.seq for r in rows] == list(range(15)) and buf.stats().memory_batches == 5
        assert [r.id for r in rows] == sorted(r.id for r in rows)
        buf.ack_many([rows[0].id, rows[12].id])  # one of the file's (deferred), one of memory's
        expected = [s for s in range(15) if s not in (0, 12)]
        assert _seqs(buf) == expected and buf.stats().batches == 13
        filler.unlink()
        fake_clock.advance(2.0)
        buf.put(_real(fake_clock, 15))
        assert buf.degraded == "" and buf.stats().memory_batches == 0
        assert _seqs(buf) == [*expected, 15]
        buf.close()
        assert not list(fs.glob("*.corrupt-*"))
        again = _open(fs / "t.db", fake_clock)
        assert _seqs(again) == [*expected, 15] and again.stats().batches == 14
        again.close()


def test_a_retained_batch_is_stored_and_replayed_retained(tmp_path: Path, fake_clock: FakeClock) -> None:
    buf = _open(tmp_path / "b.db", fake_clock)
    buf.put(_item(fake_clock, 0, retain=True, qos=0, address="cloud"))
    buf.put(_item(fake_clock, 1))
    assert [(r.retain, r.qos, r.address) for r in buf.pending(10)] == [(True, 0, "cloud"), (False, 1, "")]


def test_a_full_disk_drops_a_tenth_of_the_stored_batches_at_a_time_not_all_of_them(
    tmp_path: Path, fake_clock: FakeClock
) -> None:
    buf = _open(tmp_path / "b.db", fake_clock, max_page_count=40)
    for seq in range(300):
        before = buf.stats()
        _put(buf, fake_clock, seq, size=1000)
        dropped = buf.stats().drops_by_reason["disk_full"] - before.drops_by_reason["disk_full"]
        if dropped:
            break
    assert dropped, "the disk never filled"
    assert before.batches >= 20
    assert dropped == before.batches // 10, "the oldest tenth"
    assert buf.stats().batches == before.batches - dropped + 1
    assert [r.payload[0] for r in buf.pending(1000)] == [s % 256 for s in range(dropped, seq + 1)]


def test_compaction_rows_tell_merged_batches_and_cold_ones_apart_by_their_format_version(
    tmp_path: Path, fake_clock: FakeClock
) -> None:
    """Only the first two bytes are read: ``G`` and the format version (2 plain, 3 merged, 4 merged and cold);
    a payload that is no binary batch is no compaction row."""
    buf = _open(tmp_path / "b.db", fake_clock)
    ids = [
        buf.put(_item(fake_clock, seq, age_s=3600, payload=payload))
        for seq, payload in enumerate([b"G\x02plain", b"G\x03merged", b"G\x04cold", b'{"json":1}'])
    ]
    rows = buf.compaction_rows(before_ms=fake_clock.wall_ms())
    assert [(r.id, r.merged, r.cold) for r in rows] == [
        (ids[0], False, False),
        (ids[1], True, False),
        (ids[2], True, True),
    ]


def test_the_bytes_on_disk_are_the_database_file_and_its_wal(tmp_path: Path, fake_clock: FakeClock) -> None:
    buf = _open(tmp_path / "b.db", fake_clock)
    for seq in range(20):
        _put(buf, fake_clock, seq, size=2000)
    db, wal = tmp_path / "b.db", tmp_path / "b.db-wal"
    assert wal.stat().st_size > 0, "WAL mode: the last commits are in the WAL"
    assert buf.file_bytes() == db.stat().st_size + wal.stat().st_size
