from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import pytest

from mapper.clock import FakeClock, SystemClock
from mapper.edge.outbox.records import StoredBatch
from mapper.edge.outbox.shipper import PublishFn, TelemetryShipper
from mapper.edge.storage.buffer import Buffer
from mapper.errors import TransientError
from mapper.net.mqtt import MqttSession
from mapper.shared.model import Sample
from mapper.wire.telemetry import EncodedBatch, Route, decode_batch, encode_batch
from tests.brokers import Mosquitto

REPO = Path(__file__).resolve().parent.parent
T0 = 1_780_000_000_000


async def _until(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


def _batch(device: str, seq: int, *, boot_id: str = "boot-a", n: int = 10) -> EncodedBatch:
    samples = [
        Sample("GPU-" + device[-1], T0 + (seq * n + i) * 1000, {"temperature": 60 + i % 7, "power_usage": 100.5 + i})
        for i in range(n)
    ]
    return encode_batch(samples, node="n1", device=device, uuid="GPU-" + device[-1], boot_id=boot_id, seq=seq)


class Consumer:
    """A real MQTT subscriber that decodes batches and drops duplicates by (device, boot_id, seq)."""

    def __init__(self, url: str) -> None:
        self.session = MqttSession(url, "consumer", reconnect_min_s=0.05, reconnect_max_s=0.2)
        self.messages: list[tuple[str, bytes]] = []
        self.seen: set[tuple[str, str, int]] = set()
        self.order: dict[str, list[int]] = {}
        self.duplicates = 0
        self.session.subscribe("gpu-mapper/#", self._on)

    def _on(self, topic: str, payload: bytes) -> None:
        self.messages.append((topic, payload))
        if not topic.endswith("/telemetry"):
            return
        b = decode_batch(payload)
        key = (b.device, b.boot_id, b.seq)
        if key in self.seen:
            self.duplicates += 1
            return
        self.seen.add(key)
        self.order.setdefault(b.device, []).append(b.seq)

    async def __aenter__(self) -> Consumer:
        await self.session.start()
        assert await self.session.wait_subscribed(5), "the consumer's SUBACK"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.session.stop(2)


@pytest.fixture
async def session(mosquitto: Mosquitto) -> AsyncIterator[MqttSession]:
    s = MqttSession(mosquitto.url, "mapper-n1", reconnect_min_s=0.05, reconnect_max_s=0.2)
    await s.start()
    yield s
    await s.stop(2)


def gated(session: MqttSession, gate: asyncio.Event) -> PublishFn:
    """A publisher that holds messages until the test's subscriber is back (a clean-session subscriber misses
    what the broker delivers before it re-subscribes)."""

    async def wrapper(topic: str, payload: bytes, qos: int = 1, retain: bool = False, timeout_s: float = 10) -> None:
        if session.connected:  # offline: fail as the session does
            await asyncio.wait_for(gate.wait(), 10)
        await session.publish(topic, payload, qos, retain, timeout_s)

    return wrapper


def _shipper(buf: Buffer, sess: MqttSession, publish: PublishFn | None = None, **kw: object) -> TelemetryShipper:
    opts: dict[str, object] = {"node": "n1", "clock": SystemClock(), "retry_s": 0.2, "publish_timeout_s": 3}
    opts.update(kw)
    shipper = TelemetryShipper(buf, publish or sess.publish, **opts)  # type: ignore[arg-type]
    sess.add_on_connect(shipper.notify_connected)
    return shipper


async def test_batches_buffer_while_the_broker_is_down_and_all_arrive_in_order_when_it_returns(
    tmp_path: Path, mosquitto: Mosquitto, session: MqttSession
) -> None:
    buf = Buffer(tmp_path / "buf.db", max_bytes=50_000_000, max_age_s=10**9)
    gate = asyncio.Event()
    gate.set()
    shipper = _shipper(buf, session, gated(session, gate))
    task = asyncio.create_task(shipper.run())
    async with Consumer(mosquitto.url) as consumer:
        assert await session.wait_connected(5)
        for seq in range(5):
            shipper.submit(_batch("default/gpu0", seq))
        await _until(lambda: len(consumer.seen) == 5)
        await _until(lambda: buf.stats().batches == 0)

        gate.clear()
        mosquitto.stop()
        await _until(lambda: not session.connected)
        for seq in range(5, 205):
            for dev in ("default/gpu0", "default/gpu1"):
                shipper.submit(_batch(dev, seq if dev.endswith("0") else seq - 5))
            await asyncio.sleep(0)
        assert buf.stats().batches >= 390  # buffered, not lost

        mosquitto.start()
        assert await consumer.session.wait_subscribed(10), "the consumer's SUBACK"
        gate.set()
        await _until(lambda: len(consumer.seen) == 405, timeout_s=20)
    assert consumer.order["default/gpu0"] == list(range(205))
    assert consumer.order["default/gpu1"] == list(range(200))
    await _until(lambda: buf.stats().batches == 0)  # the last PUBACKs may trail the deliveries
    stats = shipper.stats()
    assert stats.published_batches >= 405
    assert stats.publish_failures >= 1
    assert stats.replay_remaining_batches == 0
    await _until(lambda: shipper.stats().replay_active is False)  # noticed once the loop is idle
    await shipper.stop(2)
    task.cancel()
    buf.close()


async def test_replay_sends_the_current_state_first_then_the_backlog_with_progress(
    tmp_path: Path, mosquitto: Mosquitto, session: MqttSession, caplog: pytest.LogCaptureFixture
) -> None:
    buf = Buffer(tmp_path / "buf.db", max_bytes=50_000_000, max_age_s=10**9)
    shipper = _shipper(buf, session, progress_log_s=0.0, max_in_flight=5, page_size=10)
    mosquitto.stop()
    await _until(lambda: not session.connected)
    batches = [_batch("default/gpu0", seq) for seq in range(100)]
    for batch in batches:
        shipper.submit(batch)
    shipper.update_state("default/gpu0", b'{"temperature":66}')
    mosquitto.start()
    with caplog.at_level(logging.INFO, logger="mapper.edge.outbox.shipper"):
        async with Consumer(mosquitto.url) as consumer:
            assert await consumer.session.wait_subscribed(10), "the consumer's SUBACK"
            task = asyncio.create_task(shipper.run())
            await _until(lambda: len(consumer.seen) == 100, timeout_s=20)
    topics = [t for t, _ in consumer.messages]
    state_at = topics.index("gpu-mapper/n1/default/gpu0/state")
    first_batch_at = topics.index("gpu-mapper/n1/default/gpu0/telemetry")
    assert state_at < first_batch_at
    stats = shipper.stats()
    assert stats.replayed_batches >= 90
    sizes = sorted(len(b.payload) for b in batches)
    assert sum(sizes[: stats.replayed_batches]) <= stats.replayed_bytes <= sum(sizes[-stats.replayed_batches :])
    assert stats.states_published >= 1
    progress = [r.getMessage() for r in caplog.records if "replay" in r.getMessage()]
    assert any("%" in m and "ETA" in m for m in progress), progress
    assert any("replay done" in m for m in progress), progress
    await shipper.stop(2)
    task.cancel()
    buf.close()


async def test_the_replay_rate_cap_is_honoured(tmp_path: Path, mosquitto: Mosquitto, session: MqttSession) -> None:
    clock = FakeClock()
    sent: list[tuple[float, int]] = []

    async def fake_sleep(seconds: float) -> None:
        clock.advance(seconds)
        await asyncio.sleep(0)

    async def publish(topic: str, payload: bytes, qos: int = 1, retain: bool = False, timeout_s: float = 10) -> None:
        sent.append((clock.monotonic(), len(payload) + len(topic)))
        await session.publish(topic, payload, qos, retain, timeout_s)

    buf = Buffer(tmp_path / "buf.db", max_bytes=50_000_000, max_age_s=10**9, clock=clock)
    rate = 20_000.0
    shipper = TelemetryShipper(
        buf, publish, node="n1", clock=clock, rate_limit_bytes_per_s=rate, sleep=fake_sleep, retry_s=0.2
    )
    assert await session.wait_connected(5)
    for seq in range(150):
        shipper.submit(_batch("default/gpu0", seq))
    start = clock.monotonic()
    task = asyncio.create_task(shipper.run())
    await _until(lambda: buf.stats().batches == 0, timeout_s=20)
    await shipper.stop(2)
    task.cancel()
    total = sum(n for _, n in sent)
    elapsed = sent[-1][0] - start
    biggest = max(n for _, n in sent)
    assert total <= rate * elapsed + biggest + 1  # never above the cap (one message of slack)
    assert total >= rate * elapsed * 0.9  # and not far below it either
    # every window of 1 s holds at most rate + one message
    for t0, _ in sent:
        window = sum(n for t, n in sent if t0 <= t < t0 + 1.0)
        assert window <= rate + biggest + 1
    buf.close()


async def test_a_property_pushed_to_another_broker_does_not_stall_the_default_one(
    tmp_path: Path, mosquitto: Mosquitto, session: MqttSession
) -> None:
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    other = Mosquitto(other_dir)
    other_url = other.url.replace("mqtt://", "tcp://")
    other_session = MqttSession(other_url, "mapper-n1-other", reconnect_min_s=0.05, reconnect_max_s=0.2)
    await other_session.start()

    watcher_ready = asyncio.Event()

    async def publish_to(address: str) -> PublishFn:
        assert address == other_url
        return gated(other_session, watcher_ready)

    buf = Buffer(tmp_path / "buf.db", max_bytes=50_000_000, max_age_s=10**9)
    shipper = _shipper(buf, session, publish_to=publish_to)
    other_session.add_on_connect(lambda: shipper.notify_connected(other_url))
    task = asyncio.create_task(shipper.run())
    route = Route(other_url, "site/power", 1, False, frozenset({"power_usage"}))
    async with Consumer(mosquitto.url) as consumer:
        for seq in range(20):
            shipper.submit(_batch("default/gpu0", seq))
            shipper.submit(_batch("default/gpu1", seq), route)
        await _until(lambda: len(consumer.seen) == 20)
        await _until(lambda: buf.stats().batches == 20)  # the other broker's batches wait in the buffer
        other.start()
        try:
            got: list[bytes] = []
            watcher = MqttSession(other.url, "watcher", reconnect_min_s=0.05, reconnect_max_s=0.2)
            watcher.subscribe("site/#", lambda t, p: got.append(p))
            await watcher.start()
            assert await watcher.wait_subscribed(5), "the watcher's SUBACK"
            watcher_ready.set()
            await _until(lambda: len({decode_batch(p).seq for p in got}) == 20, timeout_s=20)
            await _until(lambda: buf.stats().batches == 0)  # the last PUBACKs may trail the deliveries
            await watcher.stop(2)
        finally:
            await other_session.stop(2)
            other.stop()
    await shipper.stop(2)
    task.cancel()
    buf.close()


def _spawn_offline_mapper(db: Path, url: str, count: int) -> subprocess.Popen[bytes]:
    script = textwrap.dedent(
        f"""
        import asyncio
        from mapper.edge.storage.buffer import Buffer
        from mapper.clock import SystemClock
        from mapper.net.mqtt import MqttSession
        from mapper.edge.outbox.shipper import PublishFn, TelemetryShipper
        from mapper.wire.telemetry import BatchEncoder
        from mapper.shared.model import Sample

        async def main():
            session = MqttSession({url!r}, "doomed", reconnect_min_s=0.05, reconnect_max_s=0.2)
            await session.start()
            buf = Buffer({str(db)!r}, max_bytes=10**9, max_age_s=10**9)
            shipper = TelemetryShipper(buf, session.publish, node="n1", clock=SystemClock(), retry_s=0.1)
            task = asyncio.create_task(shipper.run())
            enc = BatchEncoder("n1", "default/gpu0", "GPU-0", "boot-k", window_s=10)
            for i in range({count}):
                for j in range(10):
                    enc.add(Sample("GPU-0", {T0} + (i * 10 + j) * 1000, {{"temperature": 60 + j}}))
                shipper.submit(enc.flush())
            print("stored", flush=True)
            await asyncio.sleep(600)

        asyncio.run(main())
        """
    )
    return subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE)


async def test_nothing_stored_is_lost_when_the_mapper_is_killed_while_offline(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    db = tmp_path / "buf.db"
    mosquitto.stop()
    proc = _spawn_offline_mapper(db, mosquitto.url, 300)
    try:
        assert proc.stdout is not None
        line = await asyncio.to_thread(proc.stdout.readline)
        assert line.strip() == b"stored"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        await asyncio.to_thread(proc.wait, 10)
    assert proc.returncode == -signal.SIGKILL

    mosquitto.start()
    buf = Buffer(db, max_bytes=10**9, max_age_s=10**9)
    assert buf.stats().batches == 300
    session = MqttSession(mosquitto.url, "reborn", reconnect_min_s=0.05, reconnect_max_s=0.2)
    async with Consumer(mosquitto.url) as consumer:
        await session.start()
        shipper = _shipper(buf, session)
        task = asyncio.create_task(shipper.run())
        await _until(lambda: len(consumer.seen) == 300, timeout_s=20)
        assert consumer.order["default/gpu0"] == list(range(300))
        await shipper.stop(2)
        task.cancel()
    await session.stop(2)
    buf.close()


async def test_a_status_message_kept_offline_goes_out_in_order_between_the_batches_around_it(
    tmp_path: Path, mosquitto: Mosquitto, session: MqttSession
) -> None:
    buf = Buffer(tmp_path / "buf.db", max_bytes=50_000_000, max_age_s=10**9)
    gate = asyncio.Event()
    shipper = _shipper(buf, session, gated(session, gate))
    task = asyncio.create_task(shipper.run())
    async with Consumer(mosquitto.url) as consumer:
        assert await session.wait_connected(5)
        mosquitto.stop()
        await _until(lambda: not session.connected)
        ack_topic = "gpu-mapper/n1/default/gpu0/desired/ack"
        shipper.submit(_batch("default/gpu0", 0))
        message_id = shipper.submit_message(
            device="default/gpu0", uuid="GPU-0", topic=ack_topic, payload=b'{"result":"applied"}', ts_ms=T0
        )
        shipper.submit(_batch("default/gpu0", 1))
        assert message_id is not None and shipper.stats().submitted_messages == 1
        assert buf.stats().batches == 3  # stored, not lost
        # A row with no boot id is a status message to the buffer tool and to compaction, never a batch.
        assert [(r.id, r.boot_id, r.topic) for r in buf.pending(10) if r.id == message_id] == [
            (message_id, "", ack_topic)
        ]

        mosquitto.start()
        assert await consumer.session.wait_subscribed(10), "the consumer's SUBACK"
        gate.set()
        await _until(lambda: len(consumer.messages) == 3, timeout_s=20)
        await _until(lambda: buf.stats().batches == 0)  # removed after PUBACK, like a batch
    topics = [t.rsplit("/", 1)[-1] for t, _ in consumer.messages]
    assert topics == ["telemetry", "ack", "telemetry"]
    assert consumer.messages[1] == (ack_topic, b'{"result":"applied"}')
    await shipper.stop(2)
    task.cancel()
    buf.close()


class _CountingBuffer:
    """A real buffer that counts its write calls (one transaction each): the size of each call."""

    def __init__(self, buf: Buffer) -> None:
        self.buf = buf
        self.calls: list[int] = []

    def put(self, batch: StoredBatch) -> int:
        self.calls.append(1)
        return self.buf.put(batch)

    def put_many(self, items: Sequence[StoredBatch]) -> list[int]:
        self.calls.append(len(items))
        return self.buf.put_many(items)

    def __getattr__(self, name: str) -> object:
        return getattr(self.buf, name)


class _CountingEvent(asyncio.Event):
    def __init__(self) -> None:
        super().__init__()
        self.sets = 0

    def set(self) -> None:
        self.sets += 1
        super().set()


async def test_submit_many_stores_a_round_in_one_call_wakes_the_loop_once_and_it_goes_out_in_order(
    tmp_path: Path,
) -> None:
    buf = Buffer(tmp_path / "buf.db", max_bytes=50_000_000, max_age_s=10**9)
    counting = _CountingBuffer(buf)
    sent: list[tuple[str, int, int, bool]] = []

    async def publish(topic: str, payload: bytes, qos: int = 1, retain: bool = False, timeout_s: float = 10) -> None:
        sent.append((topic, decode_batch(payload).seq, qos, retain))

    shipper = TelemetryShipper(counting, publish, node="n1", clock=SystemClock())  # type: ignore[arg-type]
    wake = _CountingEvent()
    shipper._wake = wake
    route = Route("", "site/power", 0, True, frozenset({"power_usage"}))
    pairs = [(_batch(f"default/gpu{g}", 40 + g), route if g == 5 else None) for g in range(8)]
    ids = shipper.submit_many(pairs)
    assert len(ids) == 8 and all(i is not None for i in ids) and ids == sorted(set(ids))
    assert counting.calls == [8]  # one buffer call: one transaction
    assert wake.sets == 1
    stats = shipper.stats()
    assert (stats.submitted_batches, stats.buffer_failures) == (8, 0)
    assert shipper.submit(_batch("default/gpu0", 48)) == ids[-1] + 1  # submit goes the same way
    assert counting.calls == [8, 1] and wake.sets == 2
    assert shipper.stats().submitted_batches == 9, "counted over every call"

    task = asyncio.create_task(shipper.run())
    await _until(lambda: buf.stats().batches == 0)
    expected = [(f"gpu-mapper/n1/default/gpu{g}/telemetry", 40 + g, 1, False) for g in range(8)]
    expected[5] = ("site/power", 45, 0, True)
    assert sent == [*expected, ("gpu-mapper/n1/default/gpu0/telemetry", 48, 1, False)]
    assert shipper.stats().published_batches == 9
    await shipper.stop(2)
    task.cancel()
    buf.close()


def test_submit_many_counts_every_batch_as_a_failure_when_the_buffer_cannot_store_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    buf = Buffer(tmp_path / "buf.db", max_bytes=50_000_000, max_age_s=10**9, max_page_count=40)  # 160 KiB of file

    async def publish(topic: str, payload: bytes, qos: int = 1, retain: bool = False, timeout_s: float = 10) -> None:
        raise AssertionError("not running")

    shipper = TelemetryShipper(buf, publish, node="n1", clock=SystemClock())
    wake = _CountingEvent()
    shipper._wake = wake
    too_big = [
        EncodedBatch(f"default/gpu{g}", f"GPU-{g}", "boot-a", 7, T0, T0 + 9_000, bytes([g]) * 100_000) for g in range(3)
    ]
    with caplog.at_level(logging.ERROR, logger="mapper.edge.outbox.shipper"):
        assert shipper.submit_many([(b, None) for b in too_big]) == [None, None, None]
    assert any("default/gpu2 seq 7" in r.getMessage() and "not stored" in r.getMessage() for r in caplog.records)
    stats = shipper.stats()
    assert (stats.submitted_batches, stats.buffer_failures, buf.stats().batches) == (0, 3, 0)
    assert wake.sets == 0

    with pytest.raises(ValueError, match="empty topic"):  # a refused batch: nothing of the call is stored
        shipper.submit_many([(_batch("default/gpu0", 1), None), (_batch("default/gpu1", 1), Route("", "", 1, False))])
    assert (buf.stats().batches, shipper.stats().submitted_batches, wake.sets) == (0, 0, 0)

    assert shipper.submit_many([(_batch("default/gpu0", 2), None)]) != [None]  # the buffer still works
    assert (shipper.stats().submitted_batches, shipper.stats().buffer_failures, wake.sets) == (1, 3, 1)
    assert shipper.submit_many([]) == [] and wake.sets == 1
    buf.close()


async def test_a_state_update_publishes_that_devices_state_alone_retained_and_not_the_others_again(
    tmp_path: Path,
) -> None:
    buf = Buffer(tmp_path / "buf.db", max_bytes=50_000_000, max_age_s=10**9)
    sent: list[tuple[str, bytes, int, bool, float]] = []

    async def publish(topic: str, payload: bytes, qos: int = 1, retain: bool = False, timeout_s: float = 10) -> None:
        sent.append((topic, payload, qos, retain, timeout_s))

    shipper = TelemetryShipper(buf, publish, node="n1", clock=SystemClock(), publish_timeout_s=3)
    shipper.update_state("default/gpu0", b'{"temperature":61}')
    shipper.update_state("default/gpu1", b'{"temperature":62}')
    task = asyncio.create_task(shipper.run())
    await _until(lambda: len(sent) == 2)  # the first pass: every device's state
    shipper.update_state("default/gpu1", b'{"temperature":63}')
    shipper.submit(_batch("default/gpu0", 0))  # goes out after the state the same pass sends
    await _until(lambda: buf.stats().batches == 0)
    state = "gpu-mapper/n1/default/{}/state"
    assert sent[:3] == [
        (state.format("gpu0"), b'{"temperature":61}', 1, True, 3),
        (state.format("gpu1"), b'{"temperature":62}', 1, True, 3),
        (state.format("gpu1"), b'{"temperature":63}', 1, True, 3),
    ]
    assert [t for t, *_ in sent[3:]] == ["gpu-mapper/n1/default/gpu0/telemetry"]
    assert shipper.stats().states_published == 3
    await shipper.stop(2)
    task.cancel()
    buf.close()


async def test_publish_failures_count_each_failed_attempt_once(tmp_path: Path) -> None:
    buf = Buffer(tmp_path / "buf.db", max_bytes=50_000_000, max_age_s=10**9)
    attempts: list[bool] = []

    async def publish(topic: str, payload: bytes, qos: int = 1, retain: bool = False, timeout_s: float = 10) -> None:
        fail = len(attempts) < 3
        attempts.append(fail)
        if fail:
            raise TransientError("broker away", reason="mqtt-offline")

    shipper = TelemetryShipper(buf, publish, node="n1", clock=SystemClock(), retry_s=0.05, max_in_flight=1)
    shipper.submit(_batch("default/gpu0", 0))
    task = asyncio.create_task(shipper.run())
    await _until(lambda: buf.stats().batches == 0)
    assert attempts == [True, True, True, False]
    assert (shipper.stats().publish_failures, shipper.stats().published_batches) == (3, 1)
    await shipper.stop(2)
    task.cancel()
    buf.close()


async def test_a_row_that_failed_just_before_the_broker_came_back_is_sent_again_first_whatever_the_page_does(
    tmp_path: Path,
) -> None:
    """The broker comes back (``notify_connected``) while the shipper is in the middle of a page, just after a row
    of that page failed: the rewind to the failed row must hold (the rest of the page must not move the cursor
    past it again, or the row waits in the buffer until some later outage), and the row that was waiting for its
    turn when it came must not go out before the failed one (per-device order)."""
    clock = FakeClock()
    buf = Buffer(tmp_path / "buf.db", max_bytes=50_000_000, max_age_s=10**9, clock=clock)
    outcomes: list[tuple[int, bool]] = []
    shipper: TelemetryShipper

    async def publish(topic: str, payload: bytes, qos: int = 1, retain: bool = False, timeout_s: float = 10) -> None:
        seq = decode_batch(payload).seq
        fail = not outcomes  # the first attempt: the broker is away
        outcomes.append((seq, not fail))
        if fail:
            raise TransientError("broker away", reason="mqtt-offline")

    async def sleep(s: float) -> None:  # the rate cap's pause between two rows of a page
        clock.advance(s)
        for _ in range(5):  # the failed send finishes meanwhile
            await asyncio.sleep(0)
        if outcomes == [(0, False)]:
            shipper.notify_connected()  # and the broker is back right then

    shipper = TelemetryShipper(
        buf, publish, node="n1", clock=clock, rate_limit_bytes_per_s=1000.0, retry_s=3600.0, sleep=sleep
    )
    for seq in range(6):
        shipper.submit(_batch("default/gpu0", seq))
    task = asyncio.create_task(shipper.run())
    await _until(lambda: buf.stats().batches == 0, timeout_s=10)
    assert [seq for seq, ok in outcomes if ok] == [0, 1, 2, 3, 4, 5], "every batch once, in order"
    await shipper.stop(2)
    task.cancel()
    buf.close()


async def test_a_publisher_that_raises_anything_counts_a_failure_and_the_row_is_kept(tmp_path: Path) -> None:
    buf = Buffer(tmp_path / "buf.db", max_bytes=50_000_000, max_age_s=10**9)
    attempts: list[int] = []

    async def publish(topic: str, payload: bytes, qos: int = 1, retain: bool = False, timeout_s: float = 10) -> None:
        attempts.append(decode_batch(payload).seq)
        if len(attempts) <= 2:
            raise RuntimeError("a bug in a publisher")

    shipper = TelemetryShipper(buf, publish, node="n1", clock=SystemClock(), retry_s=0.05, max_in_flight=1)
    shipper.submit(_batch("default/gpu0", 0))
    task = asyncio.create_task(shipper.run())
    await _until(lambda: buf.stats().batches == 0)
    assert attempts == [0, 0, 0]
    assert (shipper.stats().publish_failures, shipper.stats().published_batches) == (2, 1)
    await shipper.stop(2)
    task.cancel()
    buf.close()


async def test_a_state_that_cannot_be_published_pauses_the_default_broker_until_it_is_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    buf = Buffer(tmp_path / "buf.db", max_bytes=50_000_000, max_age_s=10**9)
    sent: list[tuple[str, bool]] = []

    async def publish(topic: str, payload: bytes, qos: int = 1, retain: bool = False, timeout_s: float = 10) -> None:
        ok = len(sent) > 0
        sent.append((topic.rsplit("/", 1)[-1], ok))
        if not ok:
            raise TransientError("broker away", reason="mqtt-offline")

    shipper = TelemetryShipper(buf, publish, node="n1", clock=SystemClock(), retry_s=3600.0)
    shipper.update_state("default/gpu0", b'{"temperature":61}')
    shipper.submit(_batch("default/gpu0", 0))
    with caplog.at_level(logging.DEBUG, logger="mapper.edge.outbox.shipper"):  # (the session warns at INFO)
        task = asyncio.create_task(shipper.run())
        await _until(lambda: shipper.stats().publish_failures == 1)
        assert any("broker 'default' unreachable" in r.getMessage() for r in caplog.records)
        shipper.notify_connected()  # the broker is back: the state first, then the batch
        await _until(lambda: buf.stats().batches == 0)
    assert sent == [("state", False), ("state", True), ("telemetry", True)]
    await shipper.stop(2)
    task.cancel()
    buf.close()


async def test_a_backlog_no_bigger_than_the_in_flight_window_is_no_replay(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    buf = Buffer(tmp_path / "buf.db", max_bytes=50_000_000, max_age_s=10**9)

    async def publish(topic: str, payload: bytes, qos: int = 1, retain: bool = False, timeout_s: float = 10) -> None:
        return None

    for backlog, replay in ((2, False), (3, True)):
        shipper = TelemetryShipper(buf, publish, node="n1", clock=SystemClock(), max_in_flight=2)
        for seq in range(backlog):
            shipper.submit(_batch("default/gpu0", seq))
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="mapper.edge.outbox.shipper"):
            shipper.notify_connected()  # a replay starts only once the link is up
            task = asyncio.create_task(shipper.run())
            await _until(lambda: buf.stats().batches == 0)
            await shipper.stop(2)
            task.cancel()
        starts = [r.getMessage() for r in caplog.records if "replay of" in r.getMessage()]
        assert [m.startswith(f"telemetry: replay of {backlog} buffered batches (") for m in starts] == (
            [True] if replay else []
        )
    buf.close()


class _Recorder:
    """A publisher that records (last topic part, device, ok) and fails while ``down``."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str, bool]] = []
        self.down = False

    async def __call__(
        self, topic: str, payload: bytes, qos: int = 1, retain: bool = False, timeout_s: float = 10
    ) -> None:
        parts = topic.split("/")
        self.sent.append((parts[-1], parts[3], not self.down))
        if self.down:
            raise TransientError("broker away", reason="mqtt-offline")


async def test_the_states_a_previous_run_stored_go_out_first_when_the_next_one_starts(tmp_path: Path) -> None:
    buf = Buffer(tmp_path / "buf.db", max_bytes=50_000_000, max_age_s=10**9)
    earlier = TelemetryShipper(buf, _Recorder(), node="n1", clock=SystemClock())
    earlier.update_state("default/gpu1", b'{"temperature":62}')
    earlier.submit(_batch("default/gpu1", 0))  # the mapper stopped before sending either
    rec = _Recorder()
    shipper = TelemetryShipper(buf, rec, node="n1", clock=SystemClock())
    task = asyncio.create_task(shipper.run())
    await _until(lambda: buf.stats().batches == 0)
    assert rec.sent == [("state", "gpu1", True), ("telemetry", "gpu1", True)]
    await shipper.stop(2)
    task.cancel()
    buf.close()


async def test_every_state_goes_out_again_before_the_backlog_whenever_the_broker_is_back(tmp_path: Path) -> None:
    """Back after a failed publish (retried after ``retry_s``), and back after a reconnect the shipper only hears
    of (``notify_connected``, nothing failed): each time every device's state first."""
    buf = Buffer(tmp_path / "buf.db", max_bytes=50_000_000, max_age_s=10**9)
    rec = _Recorder()
    shipper = TelemetryShipper(buf, rec, node="n1", clock=SystemClock(), retry_s=0.2)
    shipper.update_state("default/gpu0", b'{"temperature":61}')
    task = asyncio.create_task(shipper.run())
    await _until(lambda: len(rec.sent) == 1)
    rec.down = True
    shipper.submit(_batch("default/gpu0", 0))
    await _until(lambda: shipper.stats().publish_failures >= 1)
    rec.down = False  # the retry after retry_s finds it back
    await _until(lambda: buf.stats().batches == 0)
    ok = [(kind, dev) for kind, dev, good in rec.sent if good]
    assert ok == [("state", "gpu0"), ("state", "gpu0"), ("telemetry", "gpu0")]
    rec.sent.clear()
    shipper.notify_connected()
    shipper.submit(_batch("default/gpu0", 1))
    await _until(lambda: buf.stats().batches == 0)
    assert rec.sent == [("state", "gpu0", True), ("telemetry", "gpu0", True)]
    await shipper.stop(2)
    task.cancel()
    buf.close()


async def test_a_replay_slower_than_a_batch_a_second_still_gets_an_eta(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    buf = Buffer(tmp_path / "buf.db", max_bytes=50_000_000, max_age_s=10**9, clock=clock)

    async def publish(topic: str, payload: bytes, qos: int = 1, retain: bool = False, timeout_s: float = 10) -> None:
        clock.advance(4.0)  # a slow link: 4 s a batch

    shipper = TelemetryShipper(buf, publish, node="n1", clock=clock, max_in_flight=1, page_size=2, progress_log_s=0.0)
    for seq in range(8):
        shipper.submit(_batch("default/gpu0", seq))
    shipper.notify_connected()  # the link is up: the replay starts before anything is sent
    with caplog.at_level(logging.INFO, logger="mapper.edge.outbox.shipper"):
        task = asyncio.create_task(shipper.run())
        await _until(lambda: buf.stats().batches == 0)
    progress = [r.getMessage() for r in caplog.records if "ETA" in r.getMessage()]
    assert progress[0].endswith("(8 of 8 batches remaining, 0 batches/s, ETA unknown)"), "nothing sent yet"
    # then one batch every 4 s: what remains takes 4 s a batch
    later = [m.split("(", 1)[1] for m in progress[1:]]
    assert later and all(m.endswith(f"ETA {4 * int(m.split()[0])}s)") for m in later), later
    await shipper.stop(2)
    task.cancel()
    buf.close()
