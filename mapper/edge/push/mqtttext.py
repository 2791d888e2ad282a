"""``pushMethod.mqtt`` as the framework's text messages (``push.mqttFormat: text``; docs/push.md).

One message per sample on the property's topic, with its QoS and retained flag:
``time is <YYYY-MM-DD HH:MM:SS>  <topic>: <value>`` (``mapper.edge.push.wire.mqtt_text``; the sample's time).
Unlike the framework, which opens a new connection per message, every message to a broker goes through the
mapper's one long-lived session to it (``address`` "" is the mapper's own broker), and a message the broker did not
acknowledge (QoS 1 and 2) is kept and sent again, in order, once it is back.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from mapper.edge.push.spec import destination_key
from mapper.edge.push.wire import mqtt_text
from mapper.shared.model import PushMqtt
from mapper.shared.push import PushSample


class PublishFn(Protocol):
    """``mapper.net.mqtt.MqttSession.publish``: resolves once the broker has the message (QoS 1, 2), raises
    ``TransientError`` when it cannot."""

    def __call__(
        self, topic: str, payload: bytes, qos: int = 1, retain: bool = False, timeout_s: float = 10.0
    ) -> Awaitable[None]: ...


#: The publish function of a broker by its address ("" = the mapper's own): a session made once, when first asked.
PublisherFor = Callable[[str], Awaitable[PublishFn]]


class MqttTextWriter:
    """Writes samples to one topic of one broker as the framework's text messages, in order."""

    max_batch = 50

    def __init__(self, method: PushMqtt, publisher_for: PublisherFor, *, timeout_s: float) -> None:
        if not method.topic:
            raise ValueError("pushMethod.mqtt: the framework's text messages need a topic")
        self.method = method
        self.key = destination_key(method)
        self.timeout_s = timeout_s
        self._publisher_for = publisher_for
        self._publish: PublishFn | None = None

    async def write(self, samples: Sequence[PushSample]) -> None:
        if self._publish is None:
            self._publish = await self._publisher_for(self.method.address)
        m = self.method
        for sample in samples:
            await self._publish(m.topic, mqtt_text(sample, m.topic), m.qos, m.retained, self.timeout_s)

    async def aclose(self) -> None:
        """The session belongs to the mapper (``MqttSessions``), which closes it."""
