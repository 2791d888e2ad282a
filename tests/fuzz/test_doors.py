"""Bad input at every door, driven straight into the parsing and validation layers (most of the suite's
cases; ``test_wire.py`` sends a smaller share over real gRPC and MQTT). Every case must either be taken or
refused with the door's clear error, and no GPU setting may change because of anything invalid: after each case
the reconciler runs on the simulated GPUs and ``Rig.settle`` checks their settings."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from google.protobuf.message import DecodeError
from hypothesis import given
from hypothesis import strategies as st

from mapper.edge.config import load_settings
from mapper.edge.control.policy import parse_policies
from mapper.edge.kubeedge.devicefiles import load_folder
from mapper.edge.kubeedge.dmi.convert import device_from_pb, model_from_pb
from mapper.edge.kubeedge.dmi.pb import dmi_pb2 as pb
from mapper.errors import ConfigError, MapperError
from mapper.shared.model import Sample
from mapper.wire.eventbus import parse_delta, parse_membership
from mapper.wire.telemetry import BatchFormatError, decode_batch, encode_batch
from tests.fuzz.kit import (
    CATALOG,
    Rig,
    check_clear,
    count,
    desired_texts,
    fuzz,
    json_values,
    nested,
    pb_devices,
    pb_models,
    property_names,
)


@pytest.fixture(scope="module")
def rig() -> Any:
    with tempfile.TemporaryDirectory(prefix="fuzz-") as tmp:
        r = Rig(Path(tmp))
        try:
            yield r
        finally:
            r.close()


def _uuids() -> list[str]:
    from mapper.edge.gpu.simnvml import SimNvml

    return [g.uuid for g in SimNvml(2, "H100", seed=3).gpus]


UUIDS = _uuids()


# --- DMI: Device and DeviceModel messages -------------------------------------------------------------------


@fuzz(900)
@given(device=pb_devices(UUIDS), model=st.one_of(st.none(), pb_models()), remove=st.integers(0, 9))
def test_dmi_devices_and_models_are_taken_or_refused_and_never_change_a_gpu_wrongly(rig, device, model, remove):
    count("dmi device/model")
    if model is not None:
        try:
            rig.registry.upsert_model(model_from_pb(pb.DeviceModel.FromString(model.SerializeToString())))
        except Exception as exc:
            check_clear(exc, (MapperError,), "DeviceModel")
    try:
        config = device_from_pb(pb.Device.FromString(device.SerializeToString()))
        rig.registry.upsert_device(config)
    except Exception as exc:
        check_clear(exc, (MapperError,), "Device")
    if remove == 0:
        rig.registry.remove_device(device.namespace or "default", device.name)
    rig.settle()


@fuzz(600)
@given(data=st.one_of(st.binary(max_size=400), st.binary(min_size=1000, max_size=5000)))
def test_dmi_bytes_that_are_not_a_device_are_refused_by_the_decoder_or_by_validation(rig, data):
    count("dmi bytes")
    for cls, convert in ((pb.Device, device_from_pb), (pb.DeviceModel, model_from_pb)):
        try:
            convert(cls.FromString(data))
        except Exception as exc:
            check_clear(exc, (MapperError, DecodeError), cls.__name__)


# --- EventBus: deltas and membership updates ----------------------------------------------------------------

delta_docs = st.one_of(
    st.fixed_dictionaries(
        {"timestamp": st.one_of(st.integers(), st.floats(), st.text(max_size=5), st.none(), st.just(2**70))},
        optional={
            "event_id": json_values,
            "delta": st.one_of(
                st.dictionaries(property_names, st.one_of(desired_texts, json_values), max_size=4), json_values
            ),
            "twin": st.one_of(
                st.dictionaries(
                    property_names,
                    st.one_of(
                        st.fixed_dictionaries({"expected": st.fixed_dictionaries({"value": desired_texts})}),
                        json_values,
                    ),
                    max_size=3,
                ),
                json_values,
            ),
        },
    ),
    json_values,
)
payloads = st.one_of(
    delta_docs.map(lambda d: json.dumps(d).encode()),
    st.binary(max_size=300),
    st.integers(1, 200_000).map(nested),
    st.integers(1, 60_000).map(lambda n: b'{"delta": ' + nested(n, b'{"a":', b"}") + b"}"),
    st.integers(60_000, 200_000).map(lambda n: b'{"delta": {"power_limit": "' + b"9" * n + b'"}}'),
    st.just(b"1" * 5000),
)
topics = st.one_of(
    st.just("$hw/events/device/default/gpu0/twin/update/delta"),
    st.just("$hw/events/device/default/gpu1/twin/update/delta"),
    st.text(max_size=80),
    st.just("$hw/events/device/Default/gpu0/twin/update/delta"),
    st.just("$hw/events/device/default/gpu0/twin/update/delta/extra"),
)


@pytest.fixture(scope="module")
def bound(rig) -> Any:
    """gpu0 and gpu1 bound to the rig's two GPUs, so deltas reach a desired state."""
    from tests.fake_edgecore import pb_device

    for model in rig.registry.models():
        rig.registry.remove_model(model.namespace, model.name)
    for i, name in enumerate(("gpu0", "gpu1")):
        for device in rig.registry.devices():
            if device.uuid == UUIDS[i]:
                rig.registry.remove_device(device.namespace, device.name)
        rig.registry.upsert_device(device_from_pb(pb_device(name, UUIDS[i], properties={"power_limit": None})))
    return rig


@fuzz(2000)
@given(topic=topics, payload=payloads)
def test_eventbus_deltas_are_taken_or_refused_and_never_change_a_gpu_wrongly(bound, topic, payload):
    count("eventbus delta")
    try:
        delta = parse_delta(topic, payload)
    except Exception as exc:
        check_clear(exc, (ValueError,), "delta")
    else:
        try:
            bound.set_edge(delta.namespace, delta.name, dict(delta.values), delta.timestamp_ms)
        except Exception as exc:
            check_clear(exc, (MapperError,), "delta -> desired state")
    bound.settle()


@fuzz(800)
@given(
    payload=st.one_of(
        payloads,
        st.dictionaries(st.sampled_from(["added_devices", "removed_devices"]), json_values).map(
            lambda d: json.dumps(d).encode()
        ),
    )
)
def test_eventbus_membership_updates_are_parsed_or_refused(payload):
    count("eventbus membership")
    try:
        parse_membership(payload)
    except Exception as exc:
        check_clear(exc, (ValueError,), "membership")


# --- config files -------------------------------------------------------------------------------------------

config_keys = st.sampled_from(
    [
        "nodeName",
        "sim",
        "sim.count",
        "sim.profile",
        "mqtt",
        "mqtt.url",
        "mqtt.qos",
        "mqtt.eventbus",
        "dataDir",
        "metricsAddr",
        "log.format",
        "defaults.collectCycle",
        "defaults.reportCycle",
        "telemetry.window",
        "telemetry.format",
        "buffer.maxBytes",
        "buffer.maxAge",
        "buffer.replayRateLimit",
        "dmi.ratePerSecond",
        "dmi.burst",
        "reconcile.clamp",
        "console.printInterval",
        "policies",
        "policies.thermalThrottling",
        "policies.thermalThrottling.maxTemp",
        "policies.powerSaving",
        "policies.health",
        "policies.dryRun",
        "policies.minChangeInterval",
        "unknownKey",
    ]
)
config_values = st.one_of(
    json_values,
    st.sampled_from(["10s", "-1s", "1h2m", "5 MiB", "1e400", "nan", "-5", "0", "mqtt://x:1", "x:99999", "ééé"]),
    st.integers(),
    st.floats(),
)


def _nest(path: str, value: Any) -> dict[str, Any]:
    out: Any = value
    for part in reversed(path.split(".")):
        out = {part: out}
    return out


@fuzz(700)
@given(
    entries=st.lists(st.tuples(config_keys, config_values), max_size=5), raw=st.one_of(st.none(), st.text(max_size=200))
)
def test_config_files_load_or_are_refused_naming_the_key(tmp_path_factory, entries, raw):
    count("config file")
    path = tmp_path_factory.getbasetemp() / "fuzz-config.yaml"
    if raw is not None:
        path.write_text(raw)
    else:
        doc: dict[str, Any] = {}
        for key, value in entries:
            merged = _nest(key, value)
            top = next(iter(merged))
            if isinstance(doc.get(top), dict) and isinstance(merged[top], dict):
                doc[top].update(merged[top])
            else:
                doc.update(merged)
        path.write_text(yaml.safe_dump(doc))
    try:
        settings = load_settings(str(path), env={})
        parse_policies(settings.policies)
    except Exception as exc:
        check_clear(exc, (ConfigError,), "config file")


# --- Device YAML in standalone mode -------------------------------------------------------------------------

yaml_property = st.one_of(
    st.fixed_dictionaries(
        {"name": property_names},
        optional={
            "desired": st.one_of(st.fixed_dictionaries({"value": st.one_of(desired_texts, json_values)}), json_values),
            "collectCycle": st.one_of(st.integers(), st.text(max_size=6), json_values),
            "reportCycle": st.one_of(st.integers(), json_values),
            "reportToCloud": json_values,
            "visitors": json_values,
            "pushMethod": st.one_of(
                st.fixed_dictionaries({"mqtt": st.one_of(json_values, st.fixed_dictionaries({"qos": json_values}))}),
                json_values,
            ),
        },
    ),
    json_values,
)


@st.composite
def device_yaml(draw: Any) -> str:
    uuid = draw(st.one_of(st.sampled_from(UUIDS), st.text(max_size=20), json_values))
    device = {
        "apiVersion": "devices.kubeedge.io/v1beta1",
        "kind": "Device",
        "metadata": draw(
            st.one_of(
                st.fixed_dictionaries({"name": st.sampled_from(["gpu0", "gpu1"])}, optional={"namespace": json_values}),
                json_values,
            )
        ),
        "spec": draw(
            st.one_of(
                st.fixed_dictionaries(
                    {
                        "deviceModelRef": st.one_of(st.just({"name": "nvidia-gpu"}), json_values),
                        "protocol": st.one_of(
                            st.fixed_dictionaries(
                                {
                                    "protocolName": st.just("gpu"),
                                    "configData": st.one_of(st.just({"uuid": uuid}), json_values),
                                }
                            ),
                            json_values,
                        ),
                        "properties": st.one_of(st.lists(yaml_property, max_size=4), json_values),
                    },
                    optional={"nodeName": json_values, "stateReport": json_values},
                ),
                json_values,
            )
        ),
    }
    model = {
        "apiVersion": "devices.kubeedge.io/v1beta1",
        "kind": "DeviceModel",
        "metadata": {"name": "nvidia-gpu"},
        "spec": draw(
            st.one_of(
                st.fixed_dictionaries({"properties": st.one_of(st.lists(yaml_property, max_size=3), json_values)}),
                json_values,
            )
        ),
    }
    docs = [device] + ([model] if draw(st.booleans()) else [])
    text = yaml.safe_dump_all(docs)
    if draw(st.integers(0, 9)) == 0:
        cut = draw(st.integers(0, len(text)))
        text = text[:cut] + draw(st.sampled_from(["", ": :", "\t", "- [", "*x", "&a [*a]"])) + text[cut:]
    return text


@fuzz(500)
@given(text=device_yaml())
def test_device_yaml_is_taken_or_skipped_with_a_reason_and_never_changes_a_gpu_wrongly(tmp_path_factory, rig, text):
    count("device yaml")
    folder = tmp_path_factory.getbasetemp() / "fuzz-devices"
    folder.mkdir(exist_ok=True)
    (folder / "d.yaml").write_text(text)
    contents = load_folder(folder, "edge-1")
    for file, reason in contents.errors:
        assert file.endswith("d.yaml") and reason.strip() and len(reason) < 4000
    _, errors = rig.registry.sync(contents.devices, contents.models)
    for key, exc in errors:
        check_clear(exc, (MapperError,), f"device yaml {key}")
    rig.settle()


# --- telemetry batches fed to the decoder -------------------------------------------------------------------

T0 = 1_780_000_000_000


def _valid_batch(fmt: str, n: int) -> bytes:
    samples = [
        Sample(
            "GPU-12345678-1234-1234-1234-123456789abc",
            T0 + i * 1000,
            {"temperature": 40 + i % 7, "power_usage": 100.5 + i, "product_name": "H100"},
        )
        for i in range(n)
    ]
    return encode_batch(
        samples, node="edge-1", device="default/gpu0", uuid=samples[0].uuid, boot_id="boot-a", seq=1, fmt=fmt
    ).payload  # type: ignore[arg-type]


BATCHES = [_valid_batch(fmt, n) for fmt in ("binary", "json") for n in (1, 5, 60)]


@st.composite
def damaged_batches(draw: Any) -> bytes:
    data = bytearray(draw(st.sampled_from(BATCHES)))
    how = draw(st.sampled_from(["flip", "truncate", "insert", "random", "splice"]))
    if how == "flip":
        for _ in range(draw(st.integers(1, 8))):
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= 1 << draw(st.integers(0, 7))
    elif how == "truncate":
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif how == "insert":
        i = draw(st.integers(0, len(data)))
        data[i:i] = draw(st.binary(min_size=1, max_size=20))
    elif how == "splice":
        other = draw(st.sampled_from(BATCHES))
        data = data[: draw(st.integers(0, len(data)))] + other[draw(st.integers(0, len(other))) :]
    else:
        data = bytearray(draw(st.binary(max_size=500)))
    return bytes(data)


@fuzz(4000)
@given(data=damaged_batches())
def test_damaged_telemetry_batches_decode_or_are_refused_by_the_decoder(data):
    count("telemetry batch")
    try:
        decode_batch(data)
    except Exception as exc:
        check_clear(exc, (BatchFormatError,), "decode_batch")


def test_the_catalog_strategies_cover_every_property():
    assert set(CATALOG) >= {"power_limit", "compute_mode", "temperature"}


def test_the_gpu_check_catches_a_setting_no_valid_desired_value_asked_for(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    try:
        rig.settle()
        handle = rig.sim.nvmlDeviceGetHandleByUUID(rig.uuids[0])
        rig.sim.nvmlDeviceSetPowerManagementLimit(handle, 300_000)  # as if something invalid had reached NVML
        with pytest.raises(AssertionError, match="power_limit_mw changed"):
            rig.settle()
    finally:
        rig.close()
