"""TelemetryStreams with a real SQLite buffer behind the shipper: a GPU streams as ``_unbound/<uuid>`` until a
Device names it; a round's batches are stored in one call; a rebind flushes the old stream and keeps the
sequence only for the same Device; whatever is left is stored at shutdown."""

from __future__ import annotations

from pathlib import Path

from mapper.clock import FakeClock
from mapper.edge.kubeedge.binding import unbound_device
from mapper.edge.outbox.shipper import TelemetryShipper
from mapper.edge.outbox.streams import TelemetryStreams
from mapper.edge.storage.buffer import Buffer
from mapper.shared.model import DeviceConfig, GpuInfo, Sample

GPU = GpuInfo(uuid="GPU-00000000-0000-4000-8000-000000000001", index=0, name="H100")


async def never(*args: object, **kwargs: object) -> None:
    raise AssertionError("nothing is published here: the batches stay in the buffer")


def rig(tmp_path: Path) -> tuple[TelemetryStreams, TelemetryShipper, Buffer, FakeClock]:
    clock = FakeClock()
    buf = Buffer(tmp_path / "t.db", max_bytes=10_000_000, max_age_s=10**9, clock=clock)
    shipper = TelemetryShipper(buf, never, node="edge1", clock=clock)
    streams = TelemetryStreams("edge1", "0badf00d", window_s=2.0, shipper=shipper)
    return streams, shipper, buf, clock


def feed(streams: TelemetryStreams, clock: FakeClock, seconds: int) -> None:
    for _ in range(seconds):
        streams.add(GPU.uuid, Sample(GPU.uuid, clock.wall_ms(), {"temperature": 60}), clock.wall_ms())
        streams.store_round()
        clock.advance(1.0)


def test_streams_cut_store_rebind_and_flush(tmp_path: Path) -> None:
    streams, shipper, buf, clock = rig(tmp_path)
    calls: list[int] = []
    submit_many = shipper.submit_many
    shipper.submit_many = lambda pairs: calls.append(len(pairs)) or submit_many(pairs)  # type: ignore[method-assign]
    streams.bind(GPU.uuid, unbound_device(GPU))
    feed(streams, clock, 5)
    assert calls and all(n == 1 for n in calls), "each round's batches in one call"
    assert streams.round_batches == []
    first = buf.stats().batches
    assert first >= 2

    device = DeviceConfig("default", "gpu0", "nvidia-gpu", GPU.uuid)
    streams.bind(GPU.uuid, device)  # the old stream is flushed; the new Device starts at sequence 0
    assert buf.stats().batches == first + 1
    assert streams.by_uuid[GPU.uuid].device.key == "default/gpu0" and streams.by_uuid[GPU.uuid].next_seq == 0
    feed(streams, clock, 5)
    seq = streams.by_uuid[GPU.uuid].next_seq
    assert seq >= 2
    held = buf.stats().batches
    streams.bind(GPU.uuid, device)  # the same Device again (its cycles changed): the sequence goes on
    assert buf.stats().batches == held + 1, "the half-cut window flushed"
    assert streams.by_uuid[GPU.uuid].next_seq == seq + 1, "after the flushed batch, not from 0"

    feed(streams, clock, 1)
    before = buf.stats().batches
    streams.flush_all()
    assert buf.stats().batches == before + 1, "the half-cut window is stored at shutdown"
    buf.close()


def test_a_refused_push_method_falls_back_to_the_default_route(tmp_path: Path) -> None:
    from mapper.shared.model import DeviceProperty, PushMqtt

    streams, _, buf, _ = rig(tmp_path)
    bad = DeviceProperty("temperature", push_mqtt=PushMqtt(topic="t/x", qos=5))
    device = DeviceConfig("default", "gpu0", "nvidia-gpu", GPU.uuid, properties=(bad,))
    streams.bind(GPU.uuid, device)
    routes = streams.by_uuid[GPU.uuid].routes
    assert len(routes) == 1 and routes[0].properties is None, "only the default route"
    buf.close()
