import json

import pytest

from mapper.wire.eventbus import (
    MAX_TIMESTAMP_MS,
    parse_delta,
    parse_membership,
    state_update_payload,
    twin_update_payload,
)
from mapper.wire.topics import DELTA_FILTER, device_of_topic, twin_update_topic


def test_twin_update_follows_kubeedge_json():
    doc = json.loads(twin_update_payload({"temperature": "61", "power_usage": "72.5", "bad": "a b"}, 1748764800000))
    assert doc["event_id"] == ""
    assert doc["timestamp"] == 1748764800000 and isinstance(doc["timestamp"], int)
    assert doc["twin"]["temperature"] == {"actual": {"value": "61"}, "metadata": {"type": "string"}}
    assert "bad" not in doc["twin"], "values outside the twin charset are never published"
    assert twin_update_topic("default", "gpu0") == "$hw/events/device/default/gpu0/twin/update"


def test_a_twin_update_is_compact_json() -> None:
    twin = '{"temperature":{"actual":{"value":"61"},"metadata":{"type":"string"}}}'
    assert (
        twin_update_payload({"temperature": "61"}, 5) == b'{"event_id":"","timestamp":5,"twin":' + twin.encode() + b"}"
    )


def test_state_update_refuses_states_edgecore_drops():
    assert json.loads(state_update_payload("online", 5))["state"] == "online"
    with pytest.raises(ValueError, match="disconnected"):
        state_update_payload("disconnected", 5)


def test_a_state_update_carries_the_base_fields_every_eventbus_message_has():
    """EdgeCore reads ``event_id`` (a string, may be empty) and ``timestamp`` (int64 milliseconds) from every
    message (docs kubeedge-interfaces, Base), and ``state`` from a StateUpdate: exactly these keys."""
    assert json.loads(state_update_payload("unhealthy", 1748764800123)) == {
        "event_id": "",
        "timestamp": 1748764800123,
        "state": "unhealthy",
    }
    doc = json.loads(state_update_payload("ok", 1748764800123.9, event_id="e7"))
    assert doc == {"event_id": "e7", "timestamp": 1748764800123, "state": "ok"}
    assert isinstance(doc["timestamp"], int)


def test_delta_values_become_desired_values():
    topic = "$hw/events/device/default/gpu0-edge1/twin/update/delta"
    payload = json.dumps({"event_id": "e", "timestamp": 17, "twin": {}, "delta": {"power_limit": "300"}}).encode()
    delta = parse_delta(topic, payload)
    assert (delta.namespace, delta.name, delta.timestamp_ms) == ("default", "gpu0-edge1", 17)
    assert delta.values == {"power_limit": "300"}
    assert DELTA_FILTER == "$hw/events/device/+/+/twin/update/delta"


def test_a_delta_of_twins_alone_takes_each_expected_value_never_the_actual_one():
    """Some publishers send no ``delta`` object, only the twins: the desired value is ``expected.value``;
    ``actual`` is what the device reported and must never become desired state."""
    topic = "$hw/events/device/default/gpu0/twin/update/delta"
    payload = json.dumps(
        {
            "event_id": "e2",
            "timestamp": 1748764800123,
            "twin": {
                "power_limit": {"expected": {"value": "300"}, "actual": {"value": "700"}},
                "compute_mode": {"actual": {"value": "default"}, "metadata": {"type": "string"}},
                "persistence_mode": {"expected": {"value": "true", "metadata": {"timestamp": 5}}},
                "fan_speed": {"expected": {"metadata": {"type": "string"}}},
                "temperature": "61",
            },
        }
    ).encode()
    delta = parse_delta(topic, payload)
    assert (delta.namespace, delta.name, delta.timestamp_ms) == ("default", "gpu0", 1748764800123)
    # only the twins that carry an expected value; an actual value, a bare twin, an expected without value: none
    assert delta.values == {"power_limit": "300", "persistence_mode": "true"}


def test_a_delta_object_wins_over_the_twins_of_the_same_message():
    topic = "$hw/events/device/default/gpu0/twin/update/delta"
    payload = json.dumps(
        {"timestamp": 9, "delta": {"power_limit": "250"}, "twin": {"power_limit": {"expected": {"value": "300"}}}}
    ).encode()
    assert parse_delta(topic, payload).values == {"power_limit": "250"}


@pytest.mark.parametrize(
    ("twin", "needle"),
    [
        ('"nope"', "neither 'delta' nor 'twin' is an object"),
        ("null", "neither 'delta' nor 'twin' is an object"),
        ('{"power_limit": {"expected": {"value": 300}}}', "must be a string"),
    ],
)
def test_a_delta_of_twins_alone_that_is_malformed_is_refused_naming_what(twin: str, needle: str) -> None:
    topic = "$hw/events/device/default/gpu0/twin/update/delta"
    payload = ('{"timestamp": 1, "twin": ' + twin + "}").encode()
    with pytest.raises(ValueError, match=needle) as err:
        parse_delta(topic, payload)
    assert "delta for default/gpu0" in str(err.value)


@pytest.mark.parametrize(
    ("topic", "payload", "needle"),
    [
        ("$hw/events/device/default/g/twin/update/delta", b"{not json", "not valid JSON"),
        ("$hw/events/device/default/g/twin/update/delta", b"[1]", "JSON object"),
        ("$hw/events/device/default/g/twin/update/delta", b'{"timestamp":"1","delta":{}}', "timestamp"),
        ("$hw/events/device/default/g/twin/update/delta", b'{"timestamp":1,"delta":{"power_limit":300}}', "string"),
        ("$hw/events/device/default/g/twin/update/delta", b'{"timestamp":1,"delta":{"a b":"1"}}', "twin name"),
        ("$hw/events/device/default/g/twin/update/delta", b"{" + b" " * 70000 + b"}", "exceeds"),
        ("$hw/events/device/g/twin/update/delta", b"{}", "two-segment"),
        # Found by the fuzzer: a timestamp past SQLite's 64-bit INTEGER reached the desired store.
        ("$hw/events/device/default/g/twin/update/delta", b'{"timestamp":1180591620717411303424,"delta":{}}', "epoch"),
        ("$hw/events/device/default/g/twin/update/delta", b'{"timestamp":-1,"delta":{}}', "epoch"),
        ("$hw/events/device/default/g/twin/update/delta", b'{"timestamp":253402300800000,"delta":{}}', "epoch"),
        # Found by the fuzzer: deep nesting raised RecursionError out of json.loads.
        ("$hw/events/device/default/g/twin/update/delta", b"[" * 50000 + b"]" * 50000, "exceeds"),
        ("$hw/events/device/default/g/twin/update/delta", b"[" * 30000 + b"]" * 30000, "nested too deeply"),
        ("$hw/events/device/default/g/twin/update/delta", b"1" * 5000, "not valid JSON"),
        ("$hw/events/device/default/g/twin/update/delta", b"\xff\xfe{}", "not valid JSON"),
    ],
)
def test_malformed_deltas_are_refused_with_a_reason(topic, payload, needle):
    with pytest.raises(ValueError, match=needle):
        parse_delta(topic, payload)


def test_device_of_topic():
    assert device_of_topic("$hw/events/device/ns1/dev-1/state/update") == ("ns1", "dev-1")


def test_the_timestamp_bounds_are_inclusive():
    topic = "$hw/events/device/default/g/twin/update/delta"
    for ts in (0, MAX_TIMESTAMP_MS):
        assert parse_delta(topic, json.dumps({"timestamp": ts, "delta": {}}).encode()).timestamp_ms == ts


def test_an_error_message_never_carries_a_huge_input_back():
    topic = "$hw/events/device/default/g/twin/update/delta"
    with pytest.raises(ValueError) as info:
        parse_delta(topic, json.dumps({"timestamp": 1, "delta": {"power_limit": ["x" * 10000]}}).encode())
    assert "power_limit" in str(info.value) and len(str(info.value)) < 200


def test_membership_updates_parse_or_are_refused_with_a_reason():
    update = parse_membership(b'{"added_devices":[{"id":"gpu0"},{"name":"gpu1"}],"removed_devices":null}')
    assert update.added == ("gpu0", "gpu1") and update.removed == ()
    for payload, needle in [
        (b"[" * 30000 + b"]" * 30000, "nested too deeply"),
        (b"[]", "JSON object"),
        (b'{"added_devices": 5}', "must be a list"),
        (b'{"added_devices": [7]}', "no string id"),
        (b'{"removed_devices": [{"id": 3}]}', "no string id"),
        (b"{" + b" " * 70000 + b"}", "exceeds"),
    ]:
        with pytest.raises(ValueError, match=needle):
            parse_membership(payload)
