"""Publishing what the mapper did: desired-state acks and policy events, and fire-and-forget messages.

``Publisher`` owns the default broker's side of those messages:

* ``publish_step`` turns one GPU step's acks and policy events into JSON on
  ``gpu-mapper/{node}/{namespace}/{name}/desired/ack`` and ``.../events`` (logged, policy events counted; the
  topics are ``mapper.wire.topics``', the payloads ``mapper.wire.payloads``' and the reconciler's);
* ``publish_or_keep``: acks and events are published at once while the broker is up; while it is down (or when
  that publish fails) they are stored in the telemetry buffer (``TelemetryShipper.submit_message``) and sent in
  order with the telemetry when it is back. They record what the mapper did on its own, which the cloud must
  learn even after hours offline;
* ``publish_soon``: EventBus twins and states and the status topic. Never buffered (each is sent again,
  current, on reconnect; an old one replayed later would only mislead), never blocking;
* ``publish_live``: one sample as compact JSON on ``gpu-mapper/{node}/{namespace}/{name}/live`` (QoS 0, not
  retained, never buffered: a live value is worth nothing later), when ``telemetry.live`` is on.

Pure loop logic over Protocols: it sees an MQTT session (``Link``) and the shipper, never paho.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, Protocol

from mapper.clock import Clock
from mapper.edge.control.policy import PolicyEvent
from mapper.edge.control.reconcile import Ack, ack_to_json
from mapper.edge.outbox.shipper import TelemetryShipper
from mapper.errors import MapperError, TransientError
from mapper.shared.model import Sample
from mapper.wire import topics
from mapper.wire.payloads import STATUS_OFFLINE, event_payload, live_payload

log = logging.getLogger("mapper.edge.outbox.publish")

#: How long a fire-and-forget publish or an ack waits for its PUBACK.
PUBLISH_TIMEOUT_S = 5.0


class Link(Protocol):
    """What the publisher needs from ``mapper.net.mqtt.MqttSession``."""

    @property
    def connected(self) -> bool: ...

    async def publish(
        self, topic: str, payload: bytes | str, qos: int = 1, retain: bool = False, timeout_s: float = 10.0
    ) -> None: ...


class Publisher:
    """Acks, policy events and fire-and-forget messages on the default broker (``session``; None: no broker).

    ``shipper`` keeps acks and events while the broker is down (set it once it exists); ``before_keep`` runs
    before a message is kept, so that it goes after the telemetry batches cut before it (the collector's
    round). ``qos`` is the QoS of every message but the live topic's."""

    def __init__(
        self,
        node: str,
        session: Link | None,
        *,
        clock: Clock,
        qos: int = 1,
        shipper: TelemetryShipper | None = None,
        before_keep: Callable[[], None] | None = None,
    ) -> None:
        self.node = node
        self.session = session
        self.clock = clock
        self.qos = qos
        self.shipper = shipper
        self.before_keep = before_keep
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
    def publish_step(self, device_key: str, uuid: str, acks: Iterable[Ack], events: Iterable[PolicyEvent]) -> None:
        """The acks and policy events of one GPU step: logged, published or kept."""
        for ack in acks:
            text = ack_to_json(ack)
            log.info("desired %s on %s: %s", ack.property, device_key, text)
            self.publish_or_keep(topics.ack_topic(self.node, device_key), text.encode(), device_key, uuid)
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
        if self.shipper is None:
            return
        if self.before_keep is not None:
            self.before_keep()  # a message kept during a round goes after the batches cut before it
        try:
            self.shipper.submit_message(
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

    async def publish_telemetry(
        self, topic: str, payload: bytes, qos: int = 1, retain: bool = False, timeout_s: float = 10.0
    ) -> None:
        """The shipper's publish on the default broker (resolves on PUBACK); ``TransientError`` without one."""
        if self.session is None:
            raise TransientError("no MQTT broker configured (--mqtt): telemetry stays in the buffer")
        await self.session.publish(topic, payload, qos=qos, retain=retain, timeout_s=timeout_s)

    async def publish_offline(self, timeout_s: float = 2.0) -> None:
        """The retained ``offline`` status at shutdown (the last will covers a crash)."""
        session = self.session
        if session is not None and session.connected:
            try:
                await session.publish(self.status_topic, STATUS_OFFLINE, qos=1, retain=True, timeout_s=timeout_s)
            except MapperError as exc:
                log.debug("could not publish offline: %s", exc)
