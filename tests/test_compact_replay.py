"""Replay of a compacted backlog to a real mosquitto: order, rate cap, progress, nothing lost."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from mapper.clock import SystemClock
from mapper.edge.outbox.compact import CompactionSettings, Compactor
from mapper.edge.outbox.shipper import TelemetryShipper
from mapper.edge.storage.buffer import Buffer
from mapper.net.mqtt import MqttSession
from mapper.shared.model import Sample
from mapper.wire.telemetry import EncodedBatch, decode_batch, encode_batch
from tests.brokers import Mosquitto
from tests.test_shipper import _until

T0 = 1_780_000_200_000  # on a 600 s slot boundary, long ago: every batch is a candidate


def _batch(device: str, seq: int) -> EncodedBatch:
    samples = [
        Sample("", T0 + (seq * 10 + i) * 1000, {"temperature": 60 + (seq + i) % 7, "power_usage": 100.5 + i % 3})
        for i in range(10)
    ]
    return encode_batch(samples, node="n1", device=device, uuid="GPU-" + device[-1], boot_id="0badf00d", seq=seq)


class PartConsumer:
    """A real subscriber that drops duplicates per PART of a batch, as docs/telemetry.md tells consumers."""

    def __init__(self, url: str) -> None:
        self.session = MqttSession(url, "consumer", reconnect_min_s=0.05, reconnect_max_s=0.2)
        self.seen: set[tuple[str, str, int]] = set()
        self.order: dict[str, list[int]] = {}
        self.rows: dict[str, int] = {}
        self.merged_messages = 0
        self.session.subscribe("gpu-mapper/n1/+/+/telemetry", self._on)

    def _on(self, topic: str, payload: bytes) -> None:
        batch = decode_batch(payload)
        self.merged_messages += batch.merged
        for part in batch.split():
            key = (part.device, part.boot_id, part.seq)
            if key in self.seen:
                continue
            self.seen.add(key)
            self.order.setdefault(part.device, []).append(part.seq)
            self.rows[part.device] = self.rows.get(part.device, 0) + len(part.samples)


async def test_a_compacted_backlog_replays_in_order_within_the_rate_cap_with_progress(
    tmp_path: Path, mosquitto: Mosquitto, caplog: pytest.LogCaptureFixture
) -> None:
    clock = SystemClock()
    buf = Buffer(tmp_path / "buf.db", max_bytes=50_000_000, max_age_s=10**12, clock=clock)
    mosquitto.stop()
    session = MqttSession(mosquitto.url, "mapper-n1", reconnect_min_s=0.05, reconnect_max_s=0.2)
    await session.start()
    sent: list[tuple[float, int]] = []

    consumer_ready = asyncio.Event()

    async def publish(topic: str, payload: bytes, qos: int = 1, retain: bool = False, timeout_s: float = 10) -> None:
        if session.connected:  # offline: fail as the session does; online: not before the consumer subscribed
            await asyncio.wait_for(consumer_ready.wait(), 20)
        sent.append((clock.monotonic(), len(payload) + len(topic)))
        await session.publish(topic, payload, qos, retain, timeout_s)

    rate = 40_000.0
    shipper = TelemetryShipper(
        buf,
        publish,
        node="n1",
        clock=clock,
        rate_limit_bytes_per_s=rate,
        retry_s=0.2,
        max_in_flight=2,
        page_size=4,
        progress_log_s=0.0,
    )
    session.add_on_connect(shipper.notify_connected)
    devices = ("default/gpu0", "default/gpu1")
    for seq in range(240):  # 40 min of two GPUs while the broker is down
        shipper.submit_many([(_batch(d, seq), None) for d in devices])
    before = buf.stats()
    compactor = Compactor(
        buf,
        clock,
        CompactionSettings(cpu_fraction=1.0, interval_s=0.05, cold_slot_s=600),
        busy=shipper.busy_ids,
        on_compacted=shipper.note_compacted,
    )
    ship_task = asyncio.create_task(shipper.run())
    compact_task = asyncio.create_task(compactor.run())
    # In the background, with the shipper running (and failing: no broker): 4 slots x 2 GPUs = 8 rows.
    await _until(lambda: buf.stats().batches == 8, timeout_s=60)
    assert buf.stats().bytes < before.bytes / 2
    with caplog.at_level(logging.INFO, logger="mapper.edge.outbox.shipper"):
        mosquitto.start()
        consumer = PartConsumer(mosquitto.url)
        await consumer.session.start()
        assert await consumer.session.wait_connected(10)
        # Its subscriptions are in place once a probe published after them comes back to it.
        probes: list[bytes] = []
        consumer.session.subscribe("probe/compact-replay", lambda _t, p: probes.append(p))
        await _until(lambda: session.connected, timeout_s=20)
        deadline = asyncio.get_running_loop().time() + 20
        while not probes:
            assert asyncio.get_running_loop().time() < deadline, "the consumer's subscriptions never took"
            await session.publish("probe/compact-replay", b"1", 1, False, 5)
            await asyncio.sleep(0.1)
        consumer_ready.set()
        # Live batches keep coming while the backlog replays.
        for seq in range(240, 250):
            shipper.submit_many([(_batch(d, seq), None) for d in devices])
        await _until(lambda: sum(len(v) for v in consumer.order.values()) == 500, timeout_s=30)
    assert consumer.order == {d: list(range(250)) for d in devices}, "every batch once, in order, per device"
    assert consumer.rows == {d: 2500 for d in devices}, "every sample"
    assert consumer.merged_messages >= 8
    await _until(lambda: buf.stats().batches == 0)
    # The rate cap holds for merged batches too (one message of slack).
    start = sent[0][0]
    total = sum(n for _, n in sent[1:])
    assert total <= rate * (sent[-1][0] - start) + max(n for _, n in sent) + 1
    progress = [r.getMessage() for r in caplog.records if "replay" in r.getMessage()]
    assert any("%" in m and "ETA" in m for m in progress), progress
    assert any("replay done" in m for m in progress), progress
    compactor.stop()
    await shipper.stop(2)
    for task in (ship_task, compact_task):
        task.cancel()
    await consumer.session.stop(2)
    await session.stop(2)
    buf.close()
