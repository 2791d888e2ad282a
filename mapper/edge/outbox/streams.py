"""Each GPU's telemetry stream, from its samples to the shipper, and the order of what is kept with them.

``TelemetryStreams`` keeps one ``DeviceTelemetry`` (the batch encoders of a device's routes) per GPU: a GPU no
Device names streams as ``_unbound/<uuid>``; when its Device changes the old stream is flushed and a new one
takes its routes (``pushMethod.mqtt``). The batches the GPUs cut in one collect round are stored together at its
end (``store_round``: one buffer transaction), and whatever is left is cut and stored at shutdown
(``flush_all``).

**A stream's identity never goes backwards.** Consumers drop a batch whose (device, boot id, sequence) they have
seen, so a sequence number is never used twice under one boot id: each device name (a Device's
``namespace/name``, or ``_unbound/<uuid>``) has ONE counter for the life of the process (``next_seq``), which
every stream of that name takes its numbers from, whichever GPU it is on and whatever its routes. A Device
removed and re-added, renamed and named again, moved to another GPU and back, or with its pushMethod changed, goes
on from the number it had reached (docs/telemetry.md, "Duplicates and order"). One int per name ever used.

It is also the one way into the buffer for the status messages kept while the broker is down
(``keep_message``), so the outbox's ordering rule lives here alone: a message goes out after the batches cut
before it.

Pure loop logic: it sees the shipper and the telemetry encoders, never the buffer or MQTT.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Literal

from mapper.clock import Clock
from mapper.edge.control.collect import GpuWorker, TickResult
from mapper.edge.outbox.shipper import TelemetryShipper
from mapper.shared.model import DeviceConfig, Sample
from mapper.wire.telemetry import BatchCodec, DeviceTelemetry, EncodedBatch, Route

log = logging.getLogger("mapper.edge.outbox.streams")


class TelemetryStreams:
    """One telemetry stream per GPU (by UUID). ``shipper``: where the batches (and the kept messages) go, in the
    order they were made. ``clock``: the wall time a sample is added at (when a window is due)."""

    def __init__(
        self,
        node: str,
        boot_id: str,
        shipper: TelemetryShipper,
        *,
        clock: Clock,
        window_s: float,
        fmt: Literal["binary", "json"] = "binary",
        qos: int = 1,
        mqtt_text: bool = False,
    ) -> None:
        """``mqtt_text``: ``pushMethod.mqtt`` goes out as the framework's text messages (``push.mqttFormat:
        text``, ``mapper.edge.push``): its properties then stay in the device's default batches."""
        self.node = node
        self.mqtt_text = mqtt_text
        self.boot_id = boot_id
        self.shipper = shipper
        self.clock = clock
        self.window_s = window_s
        self.fmt: Literal["binary", "json"] = fmt
        self.qos = qos
        #: One zstd context (with its dictionary, ~2 MB) shared by every device's batches.
        self.codec = BatchCodec()
        self.by_uuid: dict[str, DeviceTelemetry] = {}
        #: Device name -> the next sequence number of its streams, for the life of this boot id (never reset).
        self.next_seq: dict[str, int] = {}
        #: The batches cut in the current collect round, stored together at its end (one transaction).
        self.round_batches: list[tuple[EncodedBatch, Route | None]] = []

    def _new(self, device: DeviceConfig, start_seq: int = 0) -> DeviceTelemetry:
        if self.mqtt_text and any(p.push_mqtt is not None for p in device.properties):
            device = replace(device, properties=tuple(replace(p, push_mqtt=None) for p in device.properties))
        return DeviceTelemetry(
            self.node,
            device,
            self.boot_id,
            window_s=self.window_s,
            fmt=self.fmt,
            start_seq=start_seq,
            default_qos=self.qos,
            codec=self.codec,
        )

    def bind(self, uuid: str, device: DeviceConfig) -> None:
        """GPU ``uuid`` streams as ``device`` from now on (its unbound identity, or the Device that names it),
        numbering on from wherever that name's counter stands."""
        old = self.by_uuid.get(uuid)
        if old is not None:
            for route, batch in self._cut(old, old.flush):
                self.shipper.submit(batch, route)
        start_seq = self.next_seq.get(device.key, 0)
        try:
            self.by_uuid[uuid] = self._new(device, start_seq)
        except ValueError as exc:
            log.error("device %s: pushMethod refused, default telemetry route used: %s", device.key, exc)
            self.by_uuid[uuid] = self._new(replace(device, properties=()), start_seq)

    def _cut(
        self, telemetry: DeviceTelemetry, how: Callable[[], list[tuple[Route, EncodedBatch]]]
    ) -> list[tuple[Route, EncodedBatch]]:
        """Cut ``telemetry``'s batches with ``how`` numbered from its name's counter, and move the counter on."""
        key = telemetry.device.key
        telemetry.next_seq = max(telemetry.next_seq, self.next_seq.get(key, 0))
        out = how()
        self.next_seq[key] = telemetry.next_seq
        return out

    def after_step(self, worker: GpuWorker, result: TickResult) -> None:
        """A GPU's step is done (a ``Collector`` consumer): its sample, if it read one, joins its stream."""
        if result.sample is not None:
            self.add(worker.uuid, result.sample, self.clock.wall_ms())

    def add(self, uuid: str, sample: Sample, now_ms: int) -> None:
        """A sample of GPU ``uuid``; the batches it completes wait for ``store_round``."""
        telemetry = self.by_uuid[uuid]
        telemetry.add(sample)
        for route, batch in self._cut(telemetry, lambda: telemetry.flush_due(now_ms)):
            self.round_batches.append((batch, route))

    def store_round(self) -> None:
        """The batches cut so far in this collect round into the buffer, in one transaction."""
        if self.round_batches:
            pairs, self.round_batches = self.round_batches, []
            self.shipper.submit_many(pairs)

    def keep_message(
        self, *, device: str, uuid: str, topic: str, payload: bytes, ts_ms: int, qos: int = 1
    ) -> int | None:
        """Keep a status message (a desired-state ack, a policy event) to go out with the telemetry while the
        broker is down; its buffer id, or None when the buffer could not store it.

        The ordering rule of the outbox: **a message goes out after the batches cut before it.** The shipper
        sends the buffer in id order, so the batches this round has cut so far (``round_batches``, otherwise
        stored together only at the round's end) are stored first, then the message: an ack made in a collect
        round follows the telemetry that round cut before it, as it happened. Every kept message comes through
        here (``mapper.edge.outbox.publish.Publisher``); nothing else stores one."""
        self.store_round()
        return self.shipper.submit_message(device=device, uuid=uuid, topic=topic, payload=payload, ts_ms=ts_ms, qos=qos)

    def flush_all(self) -> None:
        """At shutdown: whatever was sampled but not yet cut is stored, after what a round cut and had not
        stored yet (a collector that crashed in the middle of publishing its round)."""
        for telemetry in self.by_uuid.values():
            self.round_batches.extend((batch, route) for route, batch in self._cut(telemetry, telemetry.flush))
        self.store_round()
