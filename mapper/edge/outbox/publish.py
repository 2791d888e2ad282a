"""Publishing what the mapper did: desired-state acks and policy events, and fire-and-forget messages.

``Publisher`` owns the default broker's side of those messages:

* ``publish_step`` turns one GPU step's acks and policy events into JSON on
  ``gpu-mapper/{node}/{namespace}/{name}/desired/ack`` and ``.../events`` (logged, policy events counted; the
  topics are ``mapper.wire.topics``', the payloads ``mapper.wire.payloads``' and the reconciler's);
* ``publish_or_keep``: acks and events are published at once while the broker is up; while it is down (or when
  that publish fails) they are kept in the telemetry buffer through the outbox (``TelemetryStreams.keep_message``,
  which stores them after the batches cut before them) and sent in order with the telemetry when it is back.
  They record what the mapper did on its own, which the cloud must learn even after hours offline;
* ``publish_soon``: EventBus twins and states and the status topic. Never buffered (each is sent again,
  current, on reconnect; an old one replayed later would only mislead), never blocking;
* ``publish_live``: one sample as compact JSON on ``gpu-mapper/{node}/{namespace}/{name}/live`` (QoS 0, not
  retained, never buffered: a live value is worth nothing later), when ``telemetry.live`` is on.

``after_step`` takes a GPU's finished step from the collector (its acks and policy events), ``live_sample`` its
fresh sample, ``publish_events`` the health loop's events. ``telemetry_publish`` is the shipper's publish on the
default broker.

Pure loop logic over Protocols: it sees an MQTT session (``Link``) and the outbox, never paho.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Coroutine, Iterable, Sequence
from typing import Any, Protocol

from mapper.clock import Clock
from mapper.edge.control.collect import GpuWorker, TickResult
from mapper.edge.control.policy import PolicyEvent
from mapper.edge.control.reconcile import Ack
from mapper.edge.outbox.shipper import PublishFn
from mapper.errors import MapperError, TransientError
from mapper.shared.model import Sample
from mapper.wire import topics
from mapper.wire.payloads import STATUS_OFFLINE, ack_payload, event_payload, live_payload

log = logging.getLogger("mapper.edge.outbox.publish")

#: How long a fire-and-forget publish or an ack waits for its PUBACK.
PUBLISH_TIMEOUT_S = 5.0


def ack_line(ack: Ack, device_key: str) -> str:
    """An ack as one short log line: ``desired power_limit=450 on default/gpu0: applied``, ``desired
    power_limit=9999 on default/gpu0: rejected (out-of-range; allowed 100-700 W)``, ``desired power_limit removed
    on default/gpu0: applied (default-restored)``. The whole ack is logged at debug level."""
    if ack.desired is None:
        what = f"{ack.property} removed"
    else:
        raw = ack.desired if isinstance(ack.desired, str) else json.dumps(ack.desired)
        what = f"{ack.property}={raw if len(raw) <= 40 else raw[:39] + '…'}"
    details = [ack.reason] if ack.reason else []
    shown = "" if ack.desired is None else str(ack.desired).strip().lower()
    if ack.result in ("applied", "overridden") and ack.effective_value and ack.effective_value.lower() != shown:
        details.append(f"in force {ack.effective_value}")
    if ack.allowed:
        details.append(f"allowed {ack.allowed}")
    tail = f" ({'; '.join(details)})" if details else ""
    return f"desired {what} on {device_key}: {ack.result}{tail}"


class Link(Protocol):
    """What the publisher needs from ``mapper.net.mqtt.MqttSession``."""

    @property
    def connected(self) -> bool: ...

    async def publish(
        self, topic: str, payload: bytes | str, qos: int = 1, retain: bool = False, timeout_s: float = 10.0
    ) -> None: ...


class Outbox(Protocol):
    """Where a message is kept while the broker is down: ``mapper.edge.outbox.streams.TelemetryStreams``, which
    stores it after the telemetry batches cut before it (raises ``MapperError`` when the buffer is broken)."""

    def keep_message(
        self, *, device: str, uuid: str, topic: str, payload: bytes, ts_ms: int, qos: int = 1
    ) -> int | None: ...


def telemetry_publish(session: Link | None) -> PublishFn:
    """The shipper's publish on the default broker (resolves on PUBACK): the session's, or, with no broker
    configured, one that raises ``TransientError`` (the telemetry stays in the buffer)."""
    if session is not None:
        return session.publish

    async def no_broker(
        topic: str, payload: bytes, qos: int = 1, retain: bool = False, timeout_s: float = 10.0
    ) -> None:
        raise TransientError("no MQTT broker configured (--mqtt): telemetry stays in the buffer")

    return no_broker


class Publisher:
    """Acks, policy events and fire-and-forget messages on the default broker (``session``; None: no broker).

    ``outbox`` keeps acks and events while the broker is down, in order with the telemetry (None: nothing is
    kept). ``qos`` is the QoS of every message but the live topic's."""

    def __init__(
        self,
        node: str,
        session: Link | None,
        *,
        clock: Clock,
        qos: int = 1,
        outbox: Outbox | None = None,
    ) -> None:
        self.node = node
        self.session = session
        self.clock = clock
        self.qos = qos
        self.outbox = outbox
        #: Policy events published (or kept) by (policy, action).
        self.policy_events: dict[tuple[str, str], int] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def status_topic(self) -> str:
        return topics.status_topic(self.node)

    def tasks(self) -> list[asyncio.Task[None]]:
        """The publishes still in flight (shutdown cancels them: an ack cancelled before its PUBACK is kept)."""
        return list(self._tasks)

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- acks and events ---------------------------------------------------------------------------------
    def after_step(self, worker: GpuWorker, result: TickResult) -> None:
        """A GPU's step is done (a ``Collector`` consumer): its acks and policy events, if any, go out or are
        kept (most steps have neither: the device key is worked out only when one does)."""
        acks = result.reconcile.acks if result.reconcile is not None else ()
        events = result.decision.events if result.decision is not None else ()
        if acks or events:
            self.publish_step(worker.device_key, worker.uuid, acks, events)

    def publish_events(self, worker: GpuWorker, events: Sequence[PolicyEvent]) -> None:
        """Policy events of a GPU made outside its step (the health loop's recovery flow), as ``publish_step``."""
        self.publish_step(worker.device_key, worker.uuid, (), events)

    def publish_step(self, device_key: str, uuid: str, acks: Iterable[Ack], events: Iterable[PolicyEvent]) -> None:
        """The acks and policy events of one GPU step: logged, published or kept."""
        for ack in acks:
            payload = ack_payload(ack.as_dict())
            log.log(logging.WARNING if ack.result == "rejected" else logging.INFO, "%s", ack_line(ack, device_key))
            log.debug("desired %s on %s: ack %s", ack.property, device_key, payload.decode())
            self.publish_or_keep(topics.ack_topic(self.node, device_key), payload, device_key, uuid)
        for event in events:
            key = (event.policy, event.action)
            self.policy_events[key] = self.policy_events.get(key, 0) + 1
            payload = event_payload(event.to_payload(), node=self.node, device=device_key, ts_ms=self.clock.wall_ms())
            log.warning("policy %s %s on %s (GPU %s): %s", event.policy, event.action, device_key, uuid, event.reason)
            self.publish_or_keep(topics.events_topic(self.node, device_key), payload, device_key, uuid)

    def publish_or_keep(self, topic: str, payload: bytes, device: str, uuid: str) -> None:
        """Published at once while the broker is up; kept in the buffer while it is down or when the publish
        fails. Never blocking."""
        session = self.session
        if session is None:
            return
        if not session.connected:
            self._keep(topic, payload, device, uuid)
            return

        async def send() -> None:
            try:
                await session.publish(topic, payload, qos=self.qos, timeout_s=PUBLISH_TIMEOUT_S)
            except MapperError as exc:
                log.debug("publish to %s failed (%s): kept for replay", topic, exc)
                self._keep(topic, payload, device, uuid)
            except asyncio.CancelledError:  # shutting down before the PUBACK: keep it for the next start
                self._keep(topic, payload, device, uuid)
                raise

        self._background(send())

    def _keep(self, topic: str, payload: bytes, device: str, uuid: str) -> None:
        if self.outbox is None:
            return
        try:
            self.outbox.keep_message(
                device=device, uuid=uuid, topic=topic, payload=payload, ts_ms=self.clock.wall_ms(), qos=self.qos
            )
        except MapperError as exc:  # the buffer is closed or broken: the message is logged, not kept
            log.warning("status message for %s on %s not kept: %s", device, topic, exc)

    # --- fire and forget --------------------------------------------------------------------------------
    def publish_soon(self, topic: str, payload: bytes, *, retain: bool = False, qos: int | None = None) -> None:
        """Published if the broker is up, else dropped; never buffered, never blocking."""
        session = self.session
        if session is None or not session.connected:
            return

        async def send() -> None:
            try:
                await session.publish(
                    topic, payload, qos=self.qos if qos is None else qos, retain=retain, timeout_s=PUBLISH_TIMEOUT_S
                )
            except MapperError as exc:
                log.debug("publish to %s failed: %s", topic, exc)

        self._background(send())

    def live_sample(self, worker: GpuWorker, sample: Sample) -> None:
        """A GPU's fresh sample (the collector's ``on_sample``, with ``telemetry.live`` on): on its Device's live
        topic when a Device is bound (an unbound GPU has none)."""
        if worker.device is not None:
            self.publish_live(worker.device.key, sample)

    def publish_live(self, device_key: str, sample: Sample) -> None:
        """One sample on the Device's live topic: QoS 0, not retained, dropped while the broker is down."""
        session = self.session
        if session is None or not session.connected:
            return
        try:
            payload = live_payload(sample)
        except ValueError as exc:  # a value JSON cannot carry (NaN): that sample is not sent live
            log.debug("live sample of %s not sent: %s", device_key, exc)
            return
        self.publish_soon(topics.live_topic(self.node, device_key), payload, qos=0)

    async def publish_offline(self, timeout_s: float = 2.0) -> None:
        """The retained ``offline`` status at shutdown (the last will covers a crash)."""
        session = self.session
        if session is not None and session.connected:
            try:
                await session.publish(self.status_topic, STATUS_OFFLINE, qos=1, retain=True, timeout_s=timeout_s)
            except MapperError as exc:
                log.debug("could not publish offline: %s", exc)
