"""Every MQTT topic gpu-mapper spells, the mapper's and the bridge's (pure).

gpu-mapper's own topics, under ``gpu-mapper/{node}/`` (``device`` is the Device's ``namespace/name``):

* ``{node}/{namespace}/{name}/telemetry``: telemetry batches (``mapper.wire.telemetry``), QoS 1, stored and
  replayed; a property's ``pushMethod.mqtt`` may send its values to a topic of its own instead
* ``{node}/{namespace}/{name}/state``: the device's retained state message (``mapper.wire.state``)
* ``{node}/{namespace}/{name}/live``: each sample at once (``telemetry.live``), QoS 0, never stored
* ``{node}/{namespace}/{name}/desired/ack`` and ``.../events``: desired-state acks and policy events
* ``{node}/status``: ``online`` / ``offline``, retained; ``offline`` is also the session's last will
* ``{node}/metrics``: the node stream, telemetry batches of the mapper's own series (``gpu_mapper_*``), QoS 1,
  stored and replayed like a device's; outside ``TELEMETRY_FILTER``, so a bridge that predates it never sees it

KubeEdge's EventBus topics, under ``$hw/events/``: ``device/{namespace}/{name}/twin/update`` (and its
``/delta`` and ``/result``), ``device/{namespace}/{name}/state/update``, ``node/{node}/membership/updated``.

The bridge subscribes to ``TELEMETRY_FILTER`` as a shared subscription (``shared_subscription``), to the node
streams beside it (``node_filter_beside``, shared too) and to the state messages beside it
(``state_filter_beside``).
"""

from __future__ import annotations

import re

#: The root of gpu-mapper's own topics.
ROOT = "gpu-mapper"

#: Every telemetry topic of every node (the bridge's default subscription).
TELEMETRY_FILTER = f"{ROOT}/+/+/+/telemetry"


def telemetry_topic(node: str, device: str) -> str:
    """``gpu-mapper/{node}/{namespace}/{name}/telemetry`` (the device key keeps its slash)."""
    return f"{ROOT}/{node}/{device}/telemetry"


def state_topic(node: str, device: str) -> str:
    """Where the latest values of a device are published, retained, first on every reconnect."""
    return f"{ROOT}/{node}/{device}/state"


def live_topic(node: str, device: str) -> str:
    """``gpu-mapper/{node}/{namespace}/{name}/live``: each sample as it is read."""
    return f"{ROOT}/{node}/{device}/live"


def ack_topic(node: str, device: str) -> str:
    """``gpu-mapper/{node}/{namespace}/{name}/desired/ack``: the status changes of desired values."""
    return f"{ROOT}/{node}/{device}/desired/ack"


def events_topic(node: str, device: str) -> str:
    """``gpu-mapper/{node}/{namespace}/{name}/events``: policy events."""
    return f"{ROOT}/{node}/{device}/events"


def status_topic(node: str) -> str:
    """The mapper's online/offline topic (the MQTT last will)."""
    return f"{ROOT}/{node}/status"


def node_metrics_topic(node: str) -> str:
    """``gpu-mapper/{node}/metrics``: the batches of the mapper's own series (its node stream)."""
    return f"{ROOT}/{node}/metrics"


def node_of(topic: str) -> str:
    """The node of a device topic (``gpu-mapper/{node}/{namespace}/{name}/...``, one segment after the device);
    ValueError when the topic has too few segments to name one."""
    parts = topic.split("/")
    if len(parts) < 4:
        raise ValueError("the topic names no node")
    return parts[-4]


def shared_subscription(group: str, topic_filter: str) -> str:
    """The MQTT 5 shared subscription ``$share/<group>/<filter>``: the group's members split the messages."""
    return f"$share/{group}/{topic_filter}"


def state_filter_beside(telemetry_filter: str) -> str:
    """The state messages of the devices whose telemetry ``telemetry_filter`` takes (``.../telemetry`` ->
    ``.../state``); "" when it does not end in ``telemetry``."""
    head, sep, last = telemetry_filter.rpartition("/")
    return f"{head}/state" if sep and last == "telemetry" else ""


def node_filter_beside(telemetry_filter: str) -> str:
    """The node streams of the nodes whose telemetry ``telemetry_filter`` takes (``A/+/+/telemetry`` ->
    ``A/metrics``: the device's two levels and ``telemetry`` give way to ``metrics``); "" when it does not end in
    ``telemetry`` after at least three levels."""
    parts = telemetry_filter.split("/")
    if len(parts) < 4 or parts[-1] != "telemetry":
        return ""
    return "/".join([*parts[:-3], "metrics"])


# --------------------------------------------------------------------------------------------------
# KubeEdge EventBus
# --------------------------------------------------------------------------------------------------

DEVICE_PREFIX = "$hw/events/device"
NODE_PREFIX = "$hw/events/node"

#: Desired values from edge applications, for every device.
DELTA_FILTER = f"{DEVICE_PREFIX}/+/+/twin/update/delta"
TWIN_RESULT_FILTER = f"{DEVICE_PREFIX}/+/+/twin/update/result"

_SEGMENT_RE = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")


def twin_update_topic(namespace: str, name: str) -> str:
    return f"{DEVICE_PREFIX}/{namespace}/{name}/twin/update"


def state_update_topic(namespace: str, name: str) -> str:
    return f"{DEVICE_PREFIX}/{namespace}/{name}/state/update"


def membership_topic(node: str) -> str:
    return f"{NODE_PREFIX}/{node}/membership/updated"


def device_of_topic(topic: str) -> tuple[str, str]:
    """``$hw/events/device/{ns}/{name}/...`` -> (ns, name); ValueError for anything else."""
    parts = topic.split("/")
    if len(parts) < 6 or "/".join(parts[:3]) != DEVICE_PREFIX:
        raise ValueError(f"topic {topic!r} is not a two-segment KubeEdge device topic")
    namespace, name = parts[3], parts[4]
    if not _SEGMENT_RE.fullmatch(namespace) or not _SEGMENT_RE.fullmatch(name):
        raise ValueError(f"topic {topic!r}: {namespace}/{name} is not a valid namespace/name")
    return namespace, name


def device_of_delta_topic(topic: str) -> tuple[str, str]:
    """``$hw/events/device/{ns}/{name}/twin/update/delta`` -> (ns, name); ValueError for anything else."""
    if len(topic.split("/")) != 8 or not topic.endswith("/twin/update/delta"):
        raise ValueError(f"topic {topic!r} is not a two-segment KubeEdge twin/update/delta topic")
    return device_of_topic(topic)
