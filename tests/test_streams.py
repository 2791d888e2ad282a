"""TelemetryStreams with a real SQLite buffer behind the shipper: a GPU streams as ``_unbound/<uuid>`` until a
Device names it; a round's batches are stored in one call; a rebind flushes the old stream and keeps the
sequence only for the same Device; whatever is left is stored at shutdown; a message kept goes after the batches
cut before it."""

from __future__ import annotations

from pathlib import Path

from mapper.clock import FakeClock
from mapper.edge.control.collect import unbound_device
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
    streams = TelemetryStreams("edge1", "0badf00d", shipper, clock=clock, window_s=2.0)
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


def test_a_message_kept_in_a_round_goes_after_the_batches_that_round_cut_before_it(tmp_path: Path) -> None:
    """The outbox's ordering rule, on the object that owns it: an ack kept while the broker is down, in the middle
    of a collect round, is stored after the batches the round cut before it and before those cut after it. The
    shipper sends in buffer id order, so that is the order the broker gets them in."""
    streams, shipper, buf, clock = rig(tmp_path)
    streams.bind(GPU.uuid, unbound_device(GPU))
    ack_topic = "gpu-mapper/edge1/_unbound/x/desired/ack"

    def sample() -> None:
        streams.add(GPU.uuid, Sample(GPU.uuid, clock.wall_ms(), {"temperature": 60}), clock.wall_ms())
        clock.advance(1.0)

    while not streams.round_batches:  # one round's samples, until the 2 s window is cut (not stored yet)
        sample()
    cut_before = [batch.seq for batch, _ in streams.round_batches]
    message_id = streams.keep_message(
        device="_unbound/x", uuid=GPU.uuid, topic=ack_topic, payload=b"{}", ts_ms=clock.wall_ms()
    )
    assert message_id is not None and streams.round_batches == []
    while not streams.round_batches:  # the same round goes on and cuts the next window
        sample()
    cut_after = [batch.seq for batch, _ in streams.round_batches]
    streams.store_round()

    rows = buf.pending(limit=100)
    assert [r.id for r in rows] == sorted(r.id for r in rows)
    in_order = [("message" if r.topic == ack_topic else r.seq) for r in rows]
    assert in_order == [*cut_before, "message", *cut_after], in_order
    assert shipper.submitted_messages == 1
    buf.close()


GPU2 = GpuInfo(uuid="GPU-00000000-0000-4000-8000-000000000002", index=1, name="H100")


def test_a_streams_sequence_never_goes_backwards_whatever_route_its_gpus_samples_take(tmp_path: Path) -> None:
    """A consumer dedups on (device, boot id, seq): under one boot id no device name may use a number twice. The
    routes an operator combines: unbound -> bound -> removed (unbound) -> re-added; renamed and named back; the
    Device moved to another GPU and back; its pushMethod changed. Every batch stored, by device name, must have
    numbers that only grow, one after the other."""
    from mapper.shared.model import DeviceProperty, PushMqtt

    streams, _, buf, clock = rig(tmp_path)
    gpu0 = DeviceConfig("default", "gpu0", "nvidia-gpu", GPU.uuid)
    renamed = DeviceConfig("default", "gpu0-renamed", "nvidia-gpu", GPU.uuid)
    on_gpu2 = DeviceConfig("default", "gpu0", "nvidia-gpu", GPU2.uuid)
    pushed = DeviceConfig(
        "default",
        "gpu0",
        "nvidia-gpu",
        GPU.uuid,
        properties=(DeviceProperty("temperature", push_mqtt=PushMqtt(topic="site/gpu0/temperature")),),
    )

    def feed_both(seconds: int) -> None:
        for _ in range(seconds):
            for gpu in (GPU, GPU2):
                values = {"temperature": 60, "power_usage": 100.5}
                streams.add(gpu.uuid, Sample(gpu.uuid, clock.wall_ms(), values), clock.wall_ms())
            streams.store_round()
            clock.advance(1.0)

    streams.bind(GPU2.uuid, unbound_device(GPU2))
    route = [
        (GPU.uuid, unbound_device(GPU)),
        (GPU.uuid, gpu0),
        (GPU.uuid, unbound_device(GPU)),  # removed
        (GPU.uuid, gpu0),  # re-added
        (GPU.uuid, renamed),
        (GPU.uuid, gpu0),  # named back
        (GPU.uuid, pushed),  # its pushMethod changed: a second route
        (GPU.uuid, gpu0),
    ]
    for uuid, device in route:
        streams.bind(uuid, device)
        feed_both(5)
    # Moved to the other GPU (the first is released first, as the bindings do), and back.
    streams.bind(GPU.uuid, unbound_device(GPU))
    streams.bind(GPU2.uuid, on_gpu2)
    feed_both(5)
    streams.bind(GPU2.uuid, unbound_device(GPU2))
    streams.bind(GPU.uuid, gpu0)
    feed_both(5)
    streams.flush_all()

    seqs: dict[str, list[int]] = {}
    for row in buf.pending(limit=1000):
        seqs.setdefault(row.device, []).append(row.seq)
    assert set(seqs) == {"default/gpu0", "default/gpu0-renamed", unbound_device(GPU).key, unbound_device(GPU2).key}
    for device, numbers in seqs.items():
        assert numbers == list(range(len(numbers))), f"{device}: {numbers}"
    assert len(seqs["default/gpu0"]) >= 12, "every binding of gpu0 cut batches"
    buf.close()
