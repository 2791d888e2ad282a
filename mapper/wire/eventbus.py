"""KubeEdge EventBus (MQTT) device-twin protocol: its JSON payloads, pure (its topics: ``mapper.wire.topics``).

Twin updates go to ``$hw/events/device/{namespace}/{name}/twin/update`` with KubeEdge's JSON (``event_id``,
``timestamp`` in integer milliseconds, ``twin.{property}.actual.value`` as a string, ``metadata.type``);
device states to ``.../state/update``. Edge applications set desired values by publishing to
``.../twin/update/delta``; ``parse_delta`` turns such a message into desired values, refusing malformed input
with a ``ValueError`` that says what was wrong.

Typing: devicetwin fixes a twin's type with the update that creates it and checks every later value against
it. DMI reports carry no type (so ``string``) and send ``observedDesired == ""`` for read-only properties, which
an ``int``-typed twin refuses. So every twin we publish here declares ``metadata.type = "string"``: whichever
path creates a twin first, the other path's values stay valid.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from mapper.errors import short_repr
from mapper.shared.model import DEVICE_STATES, TWIN_KEY_RE, TWIN_VALUE_RE
from mapper.wire.topics import device_of_delta_topic

#: Largest EventBus payload we parse (a twin delta for every catalog property is a few KiB).
MAX_PAYLOAD_BYTES = 64 * 1024
TWIN_TYPE = "string"
_TYPED = {"type": TWIN_TYPE}
#: A delta's ``timestamp`` (ms since the epoch) must lie in [0, this]: the last millisecond of year 9999. A larger
#: one would not fit SQLite's 64-bit INTEGER where the desired value's version is stored, and, as the newest
#: version ever seen, would make every later change to the property look stale.
MAX_TIMESTAMP_MS = 253_402_300_799_999

#: The twin metadata of a property the GPU cannot read (next to ``type``; EdgeCore keeps only ``type``, an edge
#: application subscribed to ``twin/update`` sees both).
UNSUPPORTED_METADATA = {"type": TWIN_TYPE, "reason": "not-supported-by-gpu"}


def twin_update_payload(
    values: Mapping[str, str], timestamp_ms: int, event_id: str = "", unsupported: Collection[str] = ()
) -> bytes:
    """``values``: property -> twin string (already formatted; empty values are left out). ``unsupported``: the
    properties whose value says the GPU cannot read them; their metadata says so too."""
    twin = {
        name: {"actual": {"value": value}, "metadata": UNSUPPORTED_METADATA if name in unsupported else _TYPED}
        for name, value in values.items()
        if value != "" and TWIN_KEY_RE.fullmatch(name) and TWIN_VALUE_RE.fullmatch(value)
    }
    return json.dumps(
        {"event_id": event_id, "timestamp": int(timestamp_ms), "twin": twin}, separators=(",", ":")
    ).encode()


def state_update_payload(state: str, timestamp_ms: int, event_id: str = "") -> bytes:
    if state not in DEVICE_STATES:
        raise ValueError(f"device state {state!r} is not one EdgeCore accepts ({', '.join(DEVICE_STATES)})")
    return json.dumps(
        {"event_id": event_id, "timestamp": int(timestamp_ms), "state": state}, separators=(",", ":")
    ).encode()


@dataclass(frozen=True)
class Delta:
    namespace: str
    name: str
    timestamp_ms: int
    #: property -> desired value (a string, as KubeEdge sends it)
    values: Mapping[str, str]


def parse_delta(topic: str, payload: bytes, max_bytes: int = MAX_PAYLOAD_BYTES) -> Delta:
    """Parse a ``twin/update/delta`` message of at most ``max_bytes``. Raises ValueError naming what is wrong."""
    namespace, name = device_of_delta_topic(topic)
    if len(payload) > max_bytes:
        raise ValueError(f"delta for {namespace}/{name}: payload of {len(payload)} bytes exceeds {max_bytes}")
    doc = load_json(payload, f"delta for {namespace}/{name}")
    if not isinstance(doc, dict):
        raise ValueError(f"delta for {namespace}/{name}: the payload must be a JSON object")
    timestamp = doc.get("timestamp", 0)
    if isinstance(timestamp, bool) or not isinstance(timestamp, int):
        raise ValueError(
            f"delta for {namespace}/{name}: timestamp must be integer milliseconds, got {short_repr(timestamp)}"
        )
    if not 0 <= timestamp <= MAX_TIMESTAMP_MS:
        raise ValueError(
            f"delta for {namespace}/{name}: timestamp {short_repr(timestamp)} is not milliseconds since the epoch "
            f"(0 to {MAX_TIMESTAMP_MS})"
        )
    delta = doc.get("delta")
    if delta is None:
        # Some publishers send only twin.{p}.expected.value.
        twin = doc.get("twin")
        if not isinstance(twin, dict):
            raise ValueError(f"delta for {namespace}/{name}: neither 'delta' nor 'twin' is an object")
        delta = {}
        for prop, body in twin.items():
            expected = body.get("expected") if isinstance(body, dict) else None
            if isinstance(expected, dict) and "value" in expected:
                delta[prop] = expected["value"]
    if not isinstance(delta, dict):
        raise ValueError(f"delta for {namespace}/{name}: 'delta' must be an object of property -> value")
    values: dict[str, str] = {}
    for prop, value in delta.items():
        if not isinstance(prop, str) or not TWIN_KEY_RE.fullmatch(prop):
            raise ValueError(f"delta for {namespace}/{name}: {short_repr(prop)} is not a valid twin name")
        if not isinstance(value, str):
            raise ValueError(f"delta for {namespace}/{name}: value of {prop} must be a string, got {short_repr(value)}")
        values[prop] = value
    return Delta(namespace, name, timestamp, values)


@dataclass(frozen=True)
class Membership:
    """A ``membership/updated`` message: the device ids (or names) EdgeCore added to and removed from the node."""

    added: tuple[str, ...]
    removed: tuple[str, ...]


def parse_membership(payload: bytes) -> Membership:
    """Parse ``$hw/events/node/{node}/membership/updated``. Raises ValueError naming what is wrong."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise ValueError(f"membership update: payload of {len(payload)} bytes exceeds {MAX_PAYLOAD_BYTES}")
    doc = load_json(payload, "membership update")
    if not isinstance(doc, dict):
        raise ValueError("membership update: the payload must be a JSON object")
    lists: dict[str, tuple[str, ...]] = {}
    for key in ("added_devices", "removed_devices"):
        entries = doc.get(key) or []
        if not isinstance(entries, list):
            raise ValueError(f"membership update: {key} must be a list, got {short_repr(entries)}")
        ids: list[str] = []
        for entry in entries:
            ident = (entry.get("id") or entry.get("name")) if isinstance(entry, dict) else None
            if not isinstance(ident, str):
                raise ValueError(f"membership update: {key} entry {short_repr(entry)} has no string id or name")
            ids.append(ident)
        lists[key] = tuple(ids)
    return Membership(lists["added_devices"], lists["removed_devices"])


def load_json(payload: bytes, what: str) -> object:
    """``json.loads`` for a message from the bus: ValueError naming ``what`` for bytes that are not UTF-8 JSON,
    and for JSON nested too deeply to parse (a RecursionError inside the parser)."""
    try:
        return json.loads(payload)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, and an integer of more than 4300 digits
        raise ValueError(f"{what}: not valid JSON ({_cut(str(exc))})") from None
    except RecursionError:
        raise ValueError(f"{what}: JSON nested too deeply to parse") from None


def _cut(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else f"{text[: limit - 3]}..."
