"""Backlog compaction on a real SQLite buffer: what is merged, when, in order, and what the bounds do."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from mapper.clock import FakeClock
from mapper.edge.outbox.compact import CompactionSettings, Compactor, compaction_settings
from mapper.edge.outbox.records import StoredBatch
from mapper.edge.storage.buffer import Buffer
from mapper.errors import ConfigError
from mapper.shared.model import Sample
from mapper.wire.telemetry import BatchEncoder, BatchPart, EncodedBatch, decode_batch
from mapper.wire.topics import telemetry_topic

NODE = "edge-1"
UUID = "GPU-12345678-1234-1234-1234-123456789abc"
#: On a 600 s slot boundary.
ALIGNED = 1_780_000_200_000


def _batches(
    clock: FakeClock, device: str, seconds: int, *, boot_id: str = "0badf00d", start_seq: int = 0
) -> list[EncodedBatch]:
    """Ten-second batches of one GPU sampled every second from the clock's wall time (which it advances)."""
    enc = BatchEncoder(NODE, device, UUID, boot_id, 10.0, start_seq)
    out = []
    for i in range(seconds):
        ts = clock.wall_ms()
        batch = enc.flush_due(ts)
        if batch is not None:
            out.append(batch)
        enc.add(Sample(UUID, ts, {"power_usage": 100.0 + (i * 37 % 11) / 4, "temperature": 60 + i // 60}))
        clock.advance(1.0)
    last = enc.flush()
    assert last is not None
    return [*out, last]


def _store(buf: Buffer, batches: list[EncodedBatch], topic: str | None = None) -> list[int]:
    return [
        buf.put(
            StoredBatch(
                device=b.device,
                uuid=b.uuid,
                boot_id=b.boot_id,
                seq=b.seq,
                ts_first_ms=b.ts_first_ms,
                ts_last_ms=b.ts_last_ms,
                topic=topic or telemetry_topic(NODE, b.device),
                payload=b.payload,
            )
        )
        for b in batches
    ]


def _open(tmp_path: Path, clock: FakeClock, **kw: float) -> Buffer:
    return Buffer(
        tmp_path / "buffer.db",
        max_bytes=int(kw.get("max_bytes", 10**9)),
        max_age_s=kw.get("max_age_s", 10**6),
        clock=clock,
    )


def _all_samples(buf: Buffer) -> list[tuple[str, int, dict[str, object]]]:
    out = []
    for row in buf.pending(10**6):
        b = decode_batch(row.payload)
        out += [(b.device, s.ts_ms, dict(s.values)) for s in b.samples]
    return out


def _parts(buf: Buffer) -> list[list[int]]:
    return [list(decode_batch(r.payload).seqs) for r in buf.pending(10**6)]


def test_closed_slots_merge_into_one_batch_each_in_order_and_nothing_changes(tmp_path: Path) -> None:
    clock = FakeClock(start_wall_ms=ALIGNED + 200_000)  # 200 s into a 600 s slot
    buf = _open(tmp_path, clock)
    batches = _batches(clock, "default/gpu0", 1800)  # 30 min: 180 batches
    _store(buf, batches)
    before = _all_samples(buf)
    bytes_before = buf.stats().bytes
    clock.advance(120)
    stats = Compactor(buf, clock, CompactionSettings(cold_slot_s=600)).compact_all()
    rows = buf.pending(10**6)
    # Slots: [0, 600) holds 40 batches (200 s .. 600 s), then 60, 60 and 21 (the last 10 s in the next slot):
    # every slot but the current one (its batches younger than 60 s are no candidates) is one row now.
    seqs = _parts(buf)
    assert [len(s) for s in seqs][:3] == [40, 60, 60]
    assert [s for part in seqs for s in part] == [b.seq for b in batches], "every batch once, in order"
    assert _all_samples(buf) == before, "the same samples in the same order"
    assert stats.merges == 3 + (1 if len(rows) == 4 else 0)
    assert buf.stats().batches == len(rows) and buf.stats().bytes < bytes_before / 2
    assert all(decode_batch(r.payload).ts_last_ms == r.ts_last_ms for r in rows)
    # Nothing left to do: a second pass merges nothing.
    assert Compactor(buf, clock, CompactionSettings(cold_slot_s=600)).compact_all().merges == 0


def test_a_slot_that_is_not_over_merges_only_once_it_holds_enough_batches(tmp_path: Path) -> None:
    clock = FakeClock(start_wall_ms=ALIGNED + 200_000)
    buf = _open(tmp_path, clock)
    settings = CompactionSettings(min_age_s=60, slot_s=600, partial_after=30)
    first = _batches(clock, "default/gpu0", 250)  # 26 batches, the slot still open
    _store(buf, first)
    clock.advance(61)
    assert Compactor(buf, clock, settings).compact_all().merges == 0
    second = _batches(clock, "default/gpu0", 100, start_seq=len(first))
    _store(buf, second)
    clock.advance(61)
    Compactor(buf, clock, settings).compact_all()
    seqs = _parts(buf)
    assert len(seqs[0]) >= 30 and seqs[0] == list(range(len(seqs[0])))
    assert [s for part in seqs for s in part] == [b.seq for b in first + second]


def test_streams_devices_boots_and_status_messages_never_mix(tmp_path: Path) -> None:
    clock = FakeClock(start_wall_ms=ALIGNED)
    buf = _open(tmp_path, clock)
    t0 = clock.now_s
    a = _batches(clock, "default/gpu0", 300)
    clock.now_s = t0
    b = _batches(clock, "default/gpu1", 300)
    clock.now_s = t0
    c = _batches(clock, "default/gpu0", 300, boot_id="11112222")
    for i in range(len(a)):
        _store(buf, [a[i]])
        _store(buf, [b[i]])
        _store(buf, [c[i]])
        if i % 5 == 0:
            buf.put(
                StoredBatch(
                    device="default/gpu0",
                    uuid=UUID,
                    boot_id="",
                    seq=-1,
                    ts_first_ms=a[i].ts_first_ms,
                    ts_last_ms=a[i].ts_last_ms,
                    topic="gpu-mapper/edge-1/default/gpu0/events",
                    payload=b'{"event":"x"}',
                )
            )
    clock.advance(700)
    Compactor(buf, clock).compact_all()
    rows = buf.pending(10**6)
    kinds = {}
    for r in rows:
        if r.payload.startswith(b"{"):
            kinds.setdefault("message", 0)
            kinds["message"] += 1
            continue
        d = decode_batch(r.payload)
        assert (d.device, d.boot_id) == (r.device, r.boot_id)
        kinds[(d.device, d.boot_id)] = kinds.get((d.device, d.boot_id), 0) + 1
    assert kinds == {
        "message": 6,
        ("default/gpu0", "0badf00d"): 1,
        ("default/gpu1", "0badf00d"): 1,
        ("default/gpu0", "11112222"): 1,
    }


def test_busy_rows_are_left_alone_and_a_row_acked_meanwhile_voids_the_merge(tmp_path: Path) -> None:
    clock = FakeClock(start_wall_ms=ALIGNED)
    buf = _open(tmp_path, clock)
    ids = _store(buf, _batches(clock, "default/gpu0", 120))
    clock.advance(700)
    busy = {ids[3]}
    comp = Compactor(buf, clock, busy=lambda: busy)
    assert comp.compact_all().merges == 0
    busy.clear()
    groups = comp.due_groups()
    assert [r.id for r in groups[0]] == ids
    originals = buf.payloads(ids)
    buf.ack(ids[5])  # the shipper's PUBACK comes first
    merged = comp._merge(dict(originals))
    assert comp._store(merged) is False and comp.stats.merges_skipped == 1
    assert len(buf.pending(100)) == len(ids) - 1
    assert comp.compact_all().merges == 1 and len(buf.pending(100)) == 1


def test_bounds_hold_with_compaction_running(tmp_path: Path) -> None:
    clock = FakeClock(start_wall_ms=ALIGNED)
    buf = _open(tmp_path, clock, max_bytes=40_000, max_age_s=3600)
    comp = Compactor(buf, clock, CompactionSettings(min_age_s=30, slot_s=300))
    for _ in range(12):  # 12 x 10 min; compaction after each
        _store(buf, _batches(clock, "default/gpu0", 600))
        comp.compact_all()
        stats = buf.stats()
        assert stats.bytes <= 40_000
        cutoff = clock.wall_ms() - 3600 * 1000
        assert all(r.ts_last_ms >= cutoff for r in buf.pending(10**6)), "no batch past the age bound"
        # The buffer's own count agrees with the file.
        assert stats.batches == len(buf.pending(10**6))
    assert comp.stats.merges > 0 and sum(buf.stats().drops_by_reason.values()) > 0


def test_the_background_loop_keeps_to_its_cpu_budget_and_stops(tmp_path: Path) -> None:
    clock = FakeClock(start_wall_ms=ALIGNED)
    buf = _open(tmp_path, clock)
    _store(buf, _batches(clock, "default/gpu0", 1800))
    clock.advance(700)
    pauses: list[float] = []
    comp: Compactor

    async def sleep(s: float) -> None:
        pauses.append(s)
        if comp.stats.merges >= 3:
            comp.stop()
        await asyncio.sleep(0)

    comp = Compactor(buf, clock, CompactionSettings(cpu_fraction=0.02, cold_slot_s=600), sleep=sleep)

    async def main() -> None:
        await asyncio.wait_for(comp.run(), timeout=60)

    asyncio.run(main())
    assert comp.stats.merges == 3
    assert len(pauses) == 3, "a pause after every merge (none of them the idle wait)"
    # Each pause is at least the merge's CPU time x 49 (2 % of a core) less the merge's own wall time.
    assert sum(pauses) >= comp.stats.cpu_s * 30


@pytest.mark.parametrize(
    "bad", [{"min_age_s": -1}, {"slot_s": 0}, {"cold_slot_s": 0}, {"partial_after": 1}, {"cpu_fraction": 0}]
)
def test_bad_settings_are_refused_by_name(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        CompactionSettings(**bad)  # type: ignore[arg-type]


def test_a_merged_row_is_one_part_per_original(tmp_path: Path) -> None:
    clock = FakeClock(start_wall_ms=ALIGNED)
    buf = _open(tmp_path, clock)
    batches = _batches(clock, "default/gpu0", 95)
    _store(buf, batches)
    clock.advance(700)
    Compactor(buf, clock).compact_all()
    (row,) = buf.pending(10)
    d = decode_batch(row.payload)
    assert d.parts[0] == BatchPart(0, 10, UUID) and d.parts[1].uuid == ""
    assert [p.seq for p in d.parts] == [b.seq for b in batches]


async def test_the_shipper_reports_the_rows_it_holds_and_compaction_leaves_them_alone(tmp_path: Path) -> None:
    from mapper.edge.outbox.shipper import TelemetryShipper

    clock = FakeClock(start_wall_ms=ALIGNED)
    buf = _open(tmp_path, clock)
    release = asyncio.Event()
    published: list[int] = []

    async def publish(topic: str, payload: bytes, qos: int = 1, retain: bool = False, timeout_s: float = 10) -> None:
        await release.wait()
        published.append(decode_batch(payload).seq)

    shipper = TelemetryShipper(buf, publish, node=NODE, clock=clock, max_in_flight=1, page_size=50)
    ids = _store(buf, _batches(clock, "default/gpu0", 200))
    clock.advance(700)
    task = asyncio.create_task(shipper.run())
    deadline = asyncio.get_running_loop().time() + 10
    while not shipper.busy_ids() >= set(ids):  # one in flight, the rest of its page waiting for the slot
        assert asyncio.get_running_loop().time() < deadline, shipper.busy_ids()
        await asyncio.sleep(0.01)
    comp = Compactor(buf, clock, busy=shipper.busy_ids, on_compacted=shipper.note_compacted)
    assert comp.compact_all().merges == 0 and len(buf.pending(100)) == len(ids)
    release.set()
    while buf.stats().batches:
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.01)
    assert published == list(range(len(ids)))
    assert shipper.busy_ids() == set()
    await shipper.stop(1)
    task.cancel()


def test_a_row_that_does_not_decode_is_left_as_it_is_and_tried_once(tmp_path: Path) -> None:
    clock = FakeClock(start_wall_ms=ALIGNED)
    buf = _open(tmp_path, clock)
    batches = _batches(clock, "default/gpu0", 300)
    ids = _store(buf, batches[:10])
    broken = batches[10]
    bad_id = buf.put(StoredBatch(**{**_row_of(broken), "payload": b"G\x02\x00" + b"\xff" * 40}))
    ids += _store(buf, batches[11:])
    clock.advance(700)
    comp = Compactor(buf, clock)
    stats = comp.compact_all()
    assert stats.failures == 1
    again = comp.compact_all()
    assert again.failures == 1, "not retried"
    rows = buf.pending(10**6)
    assert bad_id in [r.id for r in rows]
    seqs = [s for r in rows if r.id != bad_id for s in decode_batch(r.payload).seqs]
    assert seqs == [b.seq for b in batches if b is not broken], "none lost, in order"
    # Its neighbours merged around it: the rows before it as one, the rows after it (its slot's rest) as another.
    assert len(rows) <= 1 + 2 + 1, [decode_batch(r.payload).seqs if r.id != bad_id else "bad" for r in rows]


def _row_of(b: EncodedBatch) -> dict[str, object]:
    return {
        "device": b.device,
        "uuid": b.uuid,
        "boot_id": b.boot_id,
        "seq": b.seq,
        "ts_first_ms": b.ts_first_ms,
        "ts_last_ms": b.ts_last_ms,
        "topic": telemetry_topic(NODE, b.device),
        "payload": b.payload,
    }


def test_an_open_slot_is_merged_in_format_3_and_put_in_its_cold_form_format_4_once_it_is_over(
    tmp_path: Path,
) -> None:
    clock = FakeClock(start_wall_ms=ALIGNED)
    buf = _open(tmp_path, clock)
    settings = CompactionSettings(min_age_s=30, slot_s=600, partial_after=6)
    batches = _batches(clock, "default/gpu0", 599)  # the whole slot [0, 600 s): 60 batches
    _store(buf, batches)
    before = _all_samples(buf)
    clock.advance(10)  # the slot is over, but its last batches are younger than min_age_s: not closed yet
    compactor = Compactor(buf, clock, settings)
    compactor.compact_all()
    versions = [r.payload[1] for r in buf.pending(10**6)]
    assert 3 in versions and 4 not in versions, versions
    clock.advance(60)  # now closed: what is left merges, and one merged row of format 3 is re-encoded alone
    compactor.compact_all()
    rows = buf.pending(10**6)
    assert [r.payload[1] for r in rows] == [4]
    assert _all_samples(buf) == before
    assert [s for part in _parts(buf) for s in part] == [b.seq for b in batches]
    # Finished: nothing more to do, and a fresh compactor (a restarted mapper) finds nothing either.
    merges = compactor.stats.merges
    assert compactor.compact_all().merges == merges
    assert Compactor(buf, clock, settings).compact_all().merges == 0


def test_a_merged_row_of_a_closed_slot_is_put_in_its_cold_form_alone(tmp_path: Path) -> None:
    clock = FakeClock(start_wall_ms=ALIGNED)
    buf = _open(tmp_path, clock)
    settings = CompactionSettings(min_age_s=0, slot_s=600, partial_after=60)
    batches = _batches(clock, "default/gpu0", 599)
    _store(buf, batches)
    before = _all_samples(buf)
    # Every batch of the slot merged while it was open (format 3): one row.
    open_slot = Compactor(buf, FakeClock(start_wall_ms=ALIGNED + 599_500), settings)
    open_slot.compact_all()
    rows = buf.pending(10**6)
    assert [r.payload[1] for r in rows] == [3]
    size_v3 = len(rows[0].payload)
    clock.advance(30)
    stats = Compactor(buf, clock, settings).compact_all()
    rows = buf.pending(10**6)
    assert (stats.merges, stats.rows_removed, [r.payload[1] for r in rows]) == (1, 0, [4])
    assert len(rows[0].payload) < size_v3
    assert _all_samples(buf) == before


def test_the_slots_of_a_cold_slot_that_is_over_merge_again_into_one_batch_in_order(tmp_path: Path) -> None:
    hour = 3_600_000
    start = (ALIGNED // hour + 1) * hour  # an hour boundary
    clock = FakeClock(start_wall_ms=start)
    buf = _open(tmp_path, clock)
    settings = CompactionSettings(min_age_s=30, slot_s=600, cold_slot_s=3600)
    batches = _batches(clock, "default/gpu0", 3600 + 1200)  # the hour [0, 3600 s), then 20 min of the next
    _store(buf, batches)
    before = _all_samples(buf)
    compactor = Compactor(buf, clock, settings)
    clock.advance(60)
    compactor.compact_all()
    rows = buf.pending(10**6)
    seqs = _parts(buf)
    # The first hour is one row (360 batches) in its cold form; the next hour's closed slots are a row each.
    assert len(seqs[0]) == 360 and rows[0].payload[1] == 4
    assert [len(s) for s in seqs[1:3]] == [60, 60] and [r.payload[1] for r in rows[1:3]] == [4, 4]
    assert [s for part in seqs for s in part] == [b.seq for b in batches], "every batch once, in order"
    assert _all_samples(buf) == before
    # Once that hour is over too, its slots merge into one row.
    more = _batches(clock, "default/gpu0", 2400, start_seq=len(batches))
    _store(buf, more)
    clock.advance(60)
    compactor.compact_all()
    seqs = _parts(buf)
    second_hour = sum(1 for b in batches + more if b.ts_last_ms // hour == start // hour + 1)
    assert second_hour > 300 and [len(s) for s in seqs][:2] == [360, second_hour]
    assert [s for part in seqs for s in part] == [b.seq for b in batches + more]
    assert Compactor(buf, clock, settings).compact_all().merges == 0


def test_a_group_whose_merge_is_not_smaller_is_left_as_it_is_and_not_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mapper.edge.outbox.compact as compact_module

    clock = FakeClock(start_wall_ms=ALIGNED)
    buf = _open(tmp_path, clock)
    _store(buf, _batches(clock, "default/gpu0", 599))
    before = [r.payload for r in buf.pending(10**6)]
    clock.advance(120)
    calls = []
    real = compact_module.merge_batches

    def bigger(*args: object, **kwargs: object) -> EncodedBatch:
        calls.append(1)
        merged = real(*args, **kwargs)  # type: ignore[arg-type]
        return EncodedBatch(**{**merged.__dict__, "payload": merged.payload + bytes(10**5)})

    monkeypatch.setattr(compact_module, "merge_batches", bigger)
    compactor = Compactor(buf, clock, CompactionSettings(cold_slot_s=600))
    for _ in range(3):
        compactor.compact_all()
    assert len(calls) == 1 and compactor.stats.merges == 0 and compactor.stats.merges_skipped == 1
    assert [r.payload for r in buf.pending(10**6)] == before


def test_two_batches_of_a_closed_slot_merge_into_one(tmp_path: Path) -> None:
    clock = FakeClock(start_wall_ms=ALIGNED)
    buf = _open(tmp_path, clock)
    batches = _batches(clock, "default/gpu0", 19)  # 0-9 s and 10-18 s: two batches
    assert len(batches) == 2
    _store(buf, batches)
    before = _all_samples(buf)
    clock.advance(700)
    assert Compactor(buf, clock, CompactionSettings(cold_slot_s=600)).compact_all().merges == 1
    assert _parts(buf) == [[0, 1]]
    assert _all_samples(buf) == before


def test_the_closed_slots_of_a_cold_slot_not_over_yet_are_merged_with_the_rest_of_it_once_it_is(
    tmp_path: Path,
) -> None:
    """Merged rows of closed slots wait for their cold slot: a later pass must still see them (none is passed over
    as done), so that the hour ends as one row."""
    hour = 3_600_000
    clock = FakeClock(start_wall_ms=(ALIGNED // hour + 1) * hour)
    buf = _open(tmp_path, clock)
    settings = CompactionSettings(min_age_s=30, slot_s=600, cold_slot_s=3600)
    compactor = Compactor(buf, clock, settings)
    first = _batches(clock, "default/gpu0", 1200)  # two slots of the hour
    _store(buf, first)
    clock.advance(60)
    compactor.compact_all()
    assert [len(s) for s in _parts(buf)] == [60, 60]
    rest = _batches(clock, "default/gpu0", 2400 - 61, start_seq=len(first))  # the rest of the hour
    _store(buf, rest)
    clock.advance(60)
    compactor.compact_all()
    assert _parts(buf) == [[b.seq for b in first + rest]], "the hour is one row"


def test_a_merge_whose_rows_the_shipper_took_meanwhile_is_not_stored_and_counted_once(tmp_path: Path) -> None:
    clock = FakeClock(start_wall_ms=ALIGNED)
    taken: set[int] = set()

    class TakenWhileMerging(Buffer):
        """The real buffer; the shipper reads a page with these rows while the merge is being computed."""

        def payloads(self, ids):  # type: ignore[no-untyped-def]
            found = super().payloads(ids)
            taken.update(ids)
            return found

    buf = TakenWhileMerging(tmp_path / "buffer.db", max_bytes=10**9, max_age_s=10**6, clock=clock)
    ids = _store(buf, _batches(clock, "default/gpu0", 60))
    clock.advance(700)
    comp: Compactor

    async def sleep(_s: float) -> None:
        comp.stop()
        await asyncio.sleep(0)

    comp = Compactor(buf, clock, CompactionSettings(cold_slot_s=600), busy=lambda: taken, sleep=sleep)
    asyncio.run(asyncio.wait_for(comp.run(), timeout=60))
    assert (comp.stats.merges, comp.stats.merges_skipped) == (0, 1)
    assert [r.id for r in buf.pending(100)] == ids, "every row as it was"


def test_compaction_is_off_only_for_a_minimum_age_of_zero() -> None:
    assert compaction_settings(0, 600, 3600) is None
    settings = compaction_settings(0.5, 60, 600)
    assert settings is not None and (settings.min_age_s, settings.slot_s, settings.cold_slot_s) == (0.5, 60, 600)
    with pytest.raises(ConfigError, match=r"buffer: .*cold_slot_s"):
        compaction_settings(30, 600, 0)


def test_every_merge_tells_the_shipper_how_many_rows_it_removed(tmp_path: Path) -> None:
    clock = FakeClock(start_wall_ms=ALIGNED)
    buf = _open(tmp_path, clock)
    _store(buf, _batches(clock, "default/gpu0", 1800))  # three 600 s slots of 60 batches
    clock.advance(700)
    removed: list[int] = []
    stats = Compactor(buf, clock, CompactionSettings(cold_slot_s=600), on_compacted=removed.append).compact_all()
    assert removed == [59, 59, 59] and stats.rows_removed == 177
