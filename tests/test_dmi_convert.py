"""DMI messages <-> domain types: Any wrappers, devices, models and twin reports."""

from __future__ import annotations

import struct

import pytest
from google.protobuf import any_pb2, struct_pb2, wrappers_pb2
from hypothesis import given
from hypothesis import strategies as st

from mapper.edge.kubeedge.dmi import convert
from mapper.edge.kubeedge.dmi.pb import dmi_pb2 as pb
from mapper.errors import InvalidValueError
from mapper.shared.model import DeviceConfig, DeviceModelConfig, DeviceProperty, ModelProperty, PushMqtt, Twin
from tests.fake_edgecore import any_of, pb_device, pb_model

UUID = "GPU-7a1c2e44-0b1d-4c55-9e0f-12ab34cd56ef"


def packed(message: object) -> any_pb2.Any:
    out = any_pb2.Any()
    out.Pack(message)  # type: ignore[arg-type]
    return out


@pytest.mark.parametrize(
    ("wrapper", "expected"),
    [
        (wrappers_pb2.FloatValue(value=1755.0), 1755),
        (wrappers_pb2.FloatValue(value=0.1), 0.1),
        (wrappers_pb2.FloatValue(value=-3.0), -3),
        (wrappers_pb2.DoubleValue(value=2.5), 2.5),
        (wrappers_pb2.BoolValue(value=True), True),
        (wrappers_pb2.BoolValue(value=False), False),
        (wrappers_pb2.StringValue(value="00000000:17:00.0"), "00000000:17:00.0"),
        (wrappers_pb2.Int32Value(value=-7), -7),
        (wrappers_pb2.Int64Value(value=2**40), 2**40),
        (wrappers_pb2.UInt32Value(value=4_000_000_000), 4_000_000_000),
        (wrappers_pb2.UInt64Value(value=2**63), 2**63),
    ],
)
def test_any_wrappers_decode_to_plain_values(wrapper: object, expected: object) -> None:
    value = convert.decode_any(packed(wrapper), "protocol.configData.x")
    assert value == expected
    assert type(value) is type(expected)


def test_a_whole_float_value_decodes_to_an_int_because_crd_numbers_arrive_as_float32() -> None:
    assert convert.decode_any(any_of(1755), "k") == 1755
    assert isinstance(convert.decode_any(any_of(1755), "k"), int)


@pytest.mark.parametrize(
    "message",
    [struct_pb2.Struct(), struct_pb2.ListValue(), wrappers_pb2.BytesValue(value=b"x")],
)
def test_nested_or_unknown_any_values_are_refused_naming_key_and_type_url(message: object) -> None:
    with pytest.raises(InvalidValueError) as info:
        convert.decode_any(packed(message), "protocol.configData.limits")
    text = str(info.value)
    assert "protocol.configData.limits" in text
    assert "type.googleapis.com/google.protobuf." in text


def test_an_any_with_a_corrupt_payload_is_refused() -> None:
    bad = any_pb2.Any(type_url="type.googleapis.com/google.protobuf.StringValue", value=b"\xff\xff\xff")
    with pytest.raises(InvalidValueError, match="does not decode"):
        convert.decode_any(bad, "protocol.configData.uuid")


def test_encode_then_decode_keeps_every_scalar_type() -> None:
    for value in ("abc", True, False, 42, 2.5):
        decoded = convert.decode_any(convert.encode_any(value), "k")
        assert decoded == value and type(decoded) is type(value)


def test_device_pb_becomes_a_device_config_with_uuid_cycles_and_desired_values() -> None:
    device = pb_device(
        "gpu0-edge1",
        UUID,
        properties={"power_limit": "450", "temperature": None},
        config={"pciBusId": "00000000:17:00.0", "verifyReadback": True, "maxClock": 1755},
        cycle_ms=2000,
    )
    device.spec.properties[0].pushMethod.mqtt.CopyFrom(
        pb.PushMethodMQTT(address="tcp://127.0.0.1:1883", topic="gpu/power", qos=1, retained=True)
    )
    device.spec.properties[0].visitors.CopyFrom(
        pb.VisitorConfig(protocolName="gpu", configData=pb.CustomizedValue(data={"format": any_of("hex")}))
    )
    device.spec.properties[0].desired.metadata["type"] = "float"
    config = convert.device_from_pb(device)
    assert config.key == "default/gpu0-edge1"
    assert config.uuid == UUID
    assert config.model == "nvidia-gpu"
    assert config.protocol_config == {"pciBusId": "00000000:17:00.0", "verifyReadback": True, "maxClock": 1755}
    power = config.property("power_limit")
    assert power is not None
    assert power.desired == "450"
    assert power.desired_metadata == {"type": "float"}
    assert power.collect_cycle_ms == 2000 and power.report_cycle_ms == 2000
    assert power.report_to_cloud is True
    assert power.push_mqtt == PushMqtt(address="tcp://127.0.0.1:1883", topic="gpu/power", qos=1, retained=True)
    assert power.visitor_config == {"format": "hex"}
    temperature = config.property("temperature")
    assert temperature is not None and temperature.desired is None and temperature.push_mqtt is None
    assert config.state_report_to_cloud is True
    assert config.state_report_cycle_ms == 30_000


def test_a_present_but_empty_desired_is_kept_apart_from_an_absent_one() -> None:
    device = pb_device("gpu0", UUID, properties={"power_limit": ""})
    prop = convert.device_from_pb(device).property("power_limit")
    assert prop is not None and prop.desired == ""


def test_a_policy_string_in_config_data_is_kept_as_the_string() -> None:
    policy = '{"thermal":{"maxTemp":83}}'
    config = convert.device_from_pb(pb_device("gpu0", UUID, config={"policy": policy}))
    assert config.protocol_config["policy"] == policy


def test_a_device_without_uuid_converts_with_an_empty_uuid_for_the_registry_to_refuse() -> None:
    assert convert.device_from_pb(pb_device("gpu0", None)).uuid == ""


def test_a_numeric_uuid_is_refused_naming_the_key() -> None:
    device = pb_device("gpu0", None, config={"uuid": 12})
    with pytest.raises(InvalidValueError, match=r"protocol\.configData\.uuid must be a string"):
        convert.device_from_pb(device)


def test_a_nested_config_value_is_refused_naming_the_device_and_key() -> None:
    device = pb_device("gpu0", UUID, config={"limits": packed(struct_pb2.Struct())})
    with pytest.raises(InvalidValueError, match=r"device default/gpu0: protocol\.configData\.limits"):
        convert.device_from_pb(device)


def test_an_empty_namespace_becomes_default() -> None:
    assert convert.device_from_pb(pb_device("gpu0", UUID, namespace="")).namespace == "default"


def test_models_convert_and_duplicates_from_register_are_dropped() -> None:
    first = pb_model(props={"power_limit": "FLOAT", "temperature": "INT"})
    other = pb_model("other")
    deduped = convert.dedupe_models([first, pb_model(), other, pb_model("other")])
    assert [m.name for m in deduped] == ["nvidia-gpu", "other"]
    model = convert.model_from_pb(first)
    assert model == DeviceModelConfig(
        namespace="default",
        name="nvidia-gpu",
        properties=(
            ModelProperty(name="power_limit", ptype="FLOAT", access_mode="ReadWrite"),
            ModelProperty(name="temperature", ptype="INT", access_mode="ReadOnly"),
        ),
    )


def test_status_request_carries_every_twin_with_both_fields_even_when_empty() -> None:
    twins = [Twin("temperature", "", "61"), Twin("power_limit", "450", "450"), Twin("power_usage", "", "")]
    request = convert.status_request("default", "gpu0", twins, timestamp_ms=1_780_000_000_000)
    wire = pb.ReportDeviceStatusRequest.FromString(request.SerializeToString())
    assert wire.deviceName == "gpu0" and wire.deviceNamespace == "default"
    assert [t.propertyName for t in wire.reportedDevice.twins] == ["temperature", "power_limit", "power_usage"]
    for twin in wire.reportedDevice.twins:
        assert twin.HasField("observedDesired")
        assert twin.HasField("reported")
    assert wire.reportedDevice.twins[1].observedDesired.value == "450"
    assert wire.reportedDevice.twins[0].reported.metadata["timestamp"] == "1780000000000"


def test_status_request_refuses_an_empty_twin_list() -> None:
    with pytest.raises(InvalidValueError, match="at least one twin"):
        convert.status_request("default", "gpu0", [])


@pytest.mark.parametrize(
    ("twin", "what"),
    [
        (Twin("bad key", "", "1"), "twin name"),
        (Twin("product_name", "", "NVIDIA H100 80GB"), "reported value"),
        (Twin("power_limit", "1e+05", "300"), "observedDesired value"),
        (Twin("x", "", "a" * 513), "reported value"),
    ],
)
def test_status_request_refuses_twins_devicetwin_would_reject(twin: Twin, what: str) -> None:
    with pytest.raises(InvalidValueError, match=what):
        convert.status_request("default", "gpu0", [twin])


def test_status_request_refuses_a_twin_listed_twice_whatever_its_values() -> None:
    # devicetwin keeps one value per twin name: two of one name in a report leave it to chance which one wins.
    for twins in (
        [Twin("power_limit", "300", "300"), Twin("temperature", "", "61"), Twin("power_limit", "450", "450")],
        [Twin("temperature", "", "61"), Twin("temperature", "", "61")],
    ):
        with pytest.raises(InvalidValueError, match="a twin is listed twice in one report") as err:
            convert.status_request("default", "gpu0", twins)
        assert err.value.reason == "wrong-type"
    # distinct names of one prefix are not twice the same
    request = convert.status_request(
        "default", "gpu0", [Twin("power_limit", "", "1"), Twin("power_limit_min", "", "2")]
    )
    assert [t.propertyName for t in request.reportedDevice.twins] == ["power_limit", "power_limit_min"]


def test_a_dmi_device_listing_a_property_twice_is_converted_as_sent_and_refused_by_the_registry() -> None:
    from mapper.edge.kubeedge.registry import Registry

    device = pb_device("gpu0", UUID, properties={"power_limit": "300"})
    twice = pb.DeviceProperty(name="power_limit", collectCycle=10_000, reportCycle=10_000, reportToCloud=True)
    twice.desired.CopyFrom(pb.TwinProperty(value="450"))
    device.spec.properties.append(twice)
    config = convert.device_from_pb(device)
    assert [(p.name, p.desired) for p in config.properties] == [("power_limit", "300"), ("power_limit", "450")]
    registry = Registry(node_gpus=lambda: {UUID})
    with pytest.raises(InvalidValueError, match="property 'power_limit' listed twice"):
        registry.upsert_device(config)
    assert registry.devices() == [], "nothing stored"


def test_state_request_accepts_only_edgecore_states() -> None:
    assert convert.state_request("default", "gpu0", "unhealthy").state == "unhealthy"
    with pytest.raises(ValueError, match="'disconnected' is not one of ok, online, offline, unknown, unhealthy"):
        convert.state_request("default", "gpu0", "disconnected")


def test_device_config_round_trips_through_pb_with_twins_in_status() -> None:
    config = DeviceConfig(
        namespace="edge",
        name="gpu1",
        model="nvidia-gpu",
        uuid=UUID,
        properties=(
            DeviceProperty(
                name="power_limit",
                desired="300",
                collect_cycle_ms=5000,
                report_cycle_ms=10_000,
                push_mqtt=PushMqtt(address="tcp://b:1883", topic="t"),
                visitor_config={"verifyReadback": True},
            ),
            DeviceProperty(name="temperature", report_to_cloud=False),
        ),
        protocol_config={"pciBusId": "00000000:17:00.0", "policy": "{}"},
        state_report_to_cloud=False,
        state_report_cycle_ms=60_000,
    )
    message = convert.device_to_pb(config, [Twin("temperature", "", "55")])
    assert message.spec.protocol.protocolName == "gpu"
    assert [(t.propertyName, t.reported.value) for t in message.status.twins] == [("temperature", "55")]
    assert message.status.twins[0].HasField("observedDesired")
    again = convert.device_from_pb(pb.Device.FromString(message.SerializeToString()))
    assert again == config


@given(st.integers(min_value=-(2**24), max_value=2**24))
def test_every_integer_a_float32_holds_exactly_comes_back_as_that_int(number: int) -> None:
    decoded = convert.decode_any(any_of(number), "k")
    assert decoded == number and isinstance(decoded, int)


@given(st.floats(width=32, allow_nan=False, allow_infinity=False).filter(lambda f: f != int(f)))
def test_a_fractional_float32_decodes_to_a_float_that_is_the_same_float32(number: float) -> None:
    decoded = convert.decode_any(any_of(number), "k")
    assert isinstance(decoded, float)
    assert struct.pack("<f", decoded) == struct.pack("<f", number)


@given(
    st.one_of(
        st.text(max_size=50),
        st.booleans(),
        st.integers(min_value=-(2**63), max_value=2**63 - 1),
        st.floats(allow_nan=False),
    )
)
def test_encode_any_round_trips_every_scalar(value: str | bool | int | float) -> None:
    decoded = convert.decode_any(convert.encode_any(value), "k")
    assert decoded == value and type(decoded) is type(value)


def test_a_value_whose_type_url_is_the_bare_type_name_decodes_and_an_empty_one_is_refused_naming_it() -> None:
    wrapped = wrappers_pb2.StringValue(value="GPU-1").SerializeToString()
    bare = any_pb2.Any(type_url="google.protobuf.StringValue", value=wrapped)
    assert convert.decode_any(bare, "protocol.configData.uuid") == "GPU-1"
    with pytest.raises(InvalidValueError, match=r"protocol.configData.uuid: unsupported value type \(empty type URL\)"):
        convert.decode_any(any_pb2.Any(type_url="", value=wrapped), "protocol.configData.uuid")


def test_a_device_model_goes_to_dmi_and_back_unchanged() -> None:
    model = DeviceModelConfig(
        namespace="gpus",
        name="nvidia-h100",
        properties=(
            ModelProperty(
                name="power_limit",
                ptype="FLOAT",
                access_mode="ReadWrite",
                unit="W",
                minimum="200",
                maximum="700",
                description="the power cap",
            ),
            ModelProperty(name="temperature", ptype="INT", access_mode="ReadOnly", unit="C"),
        ),
    )
    sent = convert.model_to_pb(model)
    assert (sent.namespace, sent.name, [p.type for p in sent.spec.properties]) == (
        "gpus",
        "nvidia-h100",
        ["FLOAT", "INT"],
    )
    assert convert.model_from_pb(sent) == model
