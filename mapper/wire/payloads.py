"""The small JSON and text payloads of the mapper's own topics (``mapper.wire.topics``), pure.

The telemetry batches are ``mapper.wire.telemetry``'s, the retained state message ``mapper.wire.state``'s, the
KubeEdge EventBus messages ``mapper.wire.eventbus``'s.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from mapper.shared.model import Sample

#: The retained payloads of ``topics.status_topic``: published at connect and at shutdown; ``offline`` is
#: also the session's last will (the root hands it to ``mapper.net.mqtt.mapper_session``).
STATUS_ONLINE = b"online"
STATUS_OFFLINE = b"offline"


def ack_payload(ack: Mapping[str, Any]) -> bytes:
    """A desired-state ack (its fields, ``Ack.as_dict``) as compact JSON: no spaces, ASCII only, no NaN."""
    return json.dumps(ack, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def live_payload(sample: Sample) -> bytes:
    """One sample as compact JSON: ``{"ts_ms": <read time>, "uuid": ..., "values": {property: value}}``, values
    in catalog units as JSON numbers, booleans and strings (only what this sample read). ValueError for a value
    JSON cannot carry (NaN, infinity)."""
    return json.dumps(
        {"ts_ms": sample.ts_ms, "uuid": sample.uuid, "values": sample.values},
        separators=(",", ":"),
        ensure_ascii=True,
        allow_nan=False,
    ).encode()


def event_payload(event: Mapping[str, Any], *, node: str, device: str, ts_ms: int) -> bytes:
    """A policy event (its fields, ``PolicyEvent.to_payload``) with the node, the device and the time it was
    published, as JSON."""
    doc = dict(event)
    doc.update(node=node, device=device, ts_ms=ts_ms)
    return json.dumps(doc).encode()
