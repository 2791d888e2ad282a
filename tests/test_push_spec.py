"""pushMethod parsing, from the Devices folder and from DMI: every method, one push and one DB method per property,
bad values refused naming the field with no effect on the rest (docs/push.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from google.protobuf import struct_pb2

from mapper.edge.kubeedge.devicefiles import load_folder
from mapper.edge.kubeedge.dmi import convert
from mapper.edge.kubeedge.dmi.pb import dmi_pb2 as pb
from mapper.edge.kubeedge.registry import Registry
from mapper.edge.push.spec import destination_key, method_from_json, method_to_json, parse_push_method
from mapper.shared.model import DeviceConfig, DeviceProperty, PushMqtt
from mapper.shared.push import (
    AnomalyDetection,
    DbInfluxdb2,
    DbMysql,
    DbRedis,
    DbTdengine,
    PushHttp,
    PushOtel,
)

UUID = "GPU-7a1c2e44-0b1d-4c55-9e0f-12ab34cd56ef"
UUID2 = "GPU-00000000-0000-4000-8000-00000000beef"

#: One Device whose properties name every method, in the Device CRD's spellings.
EVERY_METHOD: list[dict[str, Any]] = [
    {
        "name": "temperature",
        "reportCycle": 2000,
        "pushMethod": {
            "http": {"hostName": "http://10.0.0.5", "port": 8080, "requestPath": "/gpu/temp", "timeout": 1500},
            "dbMethod": {"redis": {"redisClientConfig": {"addr": "10.0.0.6:6379", "db": 2, "poolsize": 10}}},
        },
    },
    {
        "name": "power_usage",
        "pushMethod": {
            "otel": {"endpointURL": "https://collector.example:4318/v1/metrics"},
            "dbMethod": {
                "influxdb2": {
                    "influxdb2ClientConfig": {"url": "http://influx:8086", "org": "edge", "bucket": "gpu"},
                    "influxdb2DataConfig": {"measurement": "gpu", "tag": {"site": "a", "rack": "7"}, "fieldKey": "w"},
                }
            },
        },
    },
    {
        "name": "temperature_memory",
        "pushMethod": {
            "mqtt": {"address": "tcp://10.0.0.7:1883", "topic": "gpu/mem", "qos": 2, "retained": True},
            "dbMethod": {"mysql": {"mysqlClientConfig": {"addr": "10.0.0.8:3306", "database": "t", "userName": "u"}}},
        },
    },
    {
        "name": "utilization_gpu",
        "pushMethod": {
            "anomalyDetection": {"algorithm": "zscore", "threshold": 3.5, "window": 60, "enabled": True},
            "dbMethod": {"TDEngine": {"TDEngineClientConfig": {"addr": "10.0.0.9:6041", "dbName": "gpu"}}},
        },
    },
]

EXPECTED = {
    "temperature": (
        None,
        PushHttp(host_name="http://10.0.0.5", port=8080, request_path="/gpu/temp", timeout_ms=1500),
        DbRedis(addr="10.0.0.6:6379", db=2, pool_size=10, min_idle_conns=0),
    ),
    "power_usage": (
        None,
        PushOtel(endpoint_url="https://collector.example:4318/v1/metrics"),
        DbInfluxdb2(
            url="http://influx:8086",
            org="edge",
            bucket="gpu",
            measurement="gpu",
            field_key="w",
            tags={"rack": "7", "site": "a"},
        ),
    ),
    "temperature_memory": (
        PushMqtt(address="tcp://10.0.0.7:1883", topic="gpu/mem", qos=2, retained=True),
        None,
        DbMysql(addr="10.0.0.8:3306", database="t", user_name="u"),
    ),
    "utilization_gpu": (
        None,
        AnomalyDetection(config={"algorithm": "zscore", "threshold": 3.5, "window": 60, "enabled": True}),
        DbTdengine(addr="10.0.0.9:6041", db_name="gpu"),
    ),
}


def device_doc(name: str, uuid: str, properties: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "devices.kubeedge.io/v1beta1",
        "kind": "Device",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "deviceModelRef": {"name": "nvidia-gpu"},
            "protocol": {"protocolName": "gpu", "configData": {"uuid": uuid}},
            "properties": properties,
        },
    }


def load(tmp_path: Path, *docs: dict[str, Any]) -> dict[str, DeviceConfig]:
    (tmp_path / "devices.yaml").write_text(yaml.safe_dump_all(docs))
    contents = load_folder(tmp_path)
    assert contents.errors == [], contents.errors
    return {d.name: d for d in contents.devices}


def methods(prop: DeviceProperty | None) -> tuple[object, object, object]:
    assert prop is not None
    return prop.push_mqtt, prop.push, prop.db


def test_every_method_is_read_from_the_devices_folder_in_the_crds_spellings(tmp_path: Path) -> None:
    device = load(tmp_path, device_doc("gpu0", UUID, EVERY_METHOD))["gpu0"]
    for name, expected in EXPECTED.items():
        prop = device.property(name)
        assert methods(prop) == expected, name
        assert prop is not None and prop.push_notes == (), name


def dmi_property(name: str) -> pb.DeviceProperty:
    """The DMI message EdgeCore sends for the property of ``EVERY_METHOD`` of that name (its lower-case names)."""
    prop = pb.DeviceProperty(name=name, reportCycle=2000)
    p = prop.pushMethod
    if name == "temperature":
        p.http.CopyFrom(pb.PushMethodHTTP(hostname="http://10.0.0.5", port=8080, requestpath="/gpu/temp", timeout=1500))
        p.dbMethod.redis.CopyFrom(
            pb.DBMethodRedis(redisClientConfig=pb.RedisClientConfig(addr="10.0.0.6:6379", db=2, poolsize=10))
        )
    elif name == "power_usage":
        p.otel.CopyFrom(pb.PushMethodOTEL(endpointURL="https://collector.example:4318/v1/metrics"))
        p.dbMethod.influxdb2.CopyFrom(
            pb.DBMethodInfluxdb2(
                influxdb2ClientConfig=pb.Influxdb2ClientConfig(url="http://influx:8086", org="edge", bucket="gpu"),
                influxdb2DataConfig=pb.Influxdb2DataConfig(
                    measurement="gpu", tag={"site": "a", "rack": "7"}, fieldKey="w"
                ),
            )
        )
    elif name == "temperature_memory":
        p.mqtt.CopyFrom(pb.PushMethodMQTT(address="tcp://10.0.0.7:1883", topic="gpu/mem", qos=2, retained=True))
        p.dbMethod.mysql.CopyFrom(
            pb.DBMethodMySQL(mysqlClientConfig=pb.MySQLClientConfig(addr="10.0.0.8:3306", database="t", userName="u"))
        )
    elif name == "utilization_gpu":
        # EdgeCore: strings become StringValue, JSON numbers FloatValue (float32), booleans BoolValue.
        for key, value in {"algorithm": "zscore", "threshold": 3.5, "window": 60, "enabled": True}.items():
            p.anomalyDetection.data[key].CopyFrom(convert.encode_any(value))
        p.anomalyDetection.data["threshold"].Pack(convert.wrappers_pb2.FloatValue(value=3.5))
        p.anomalyDetection.data["window"].Pack(convert.wrappers_pb2.FloatValue(value=60))
        p.dbMethod.tdengine.CopyFrom(
            pb.DBMethodTDEngine(tdEngineClientConfig=pb.TDEngineClientConfig(addr="10.0.0.9:6041", dbname="gpu"))
        )
    return prop


def dmi_device(name: str, properties: list[pb.DeviceProperty]) -> pb.Device:
    return pb.Device(
        name=name,
        namespace="default",
        spec=pb.DeviceSpec(
            deviceModelReference="nvidia-gpu",
            protocol=pb.ProtocolConfig(protocolName="gpu", configData=convert.encode_config_data({"uuid": UUID})),
            properties=properties,
        ),
    )


def test_every_method_is_read_from_dmi_with_edgecores_lower_case_names() -> None:
    device = convert.device_from_pb(dmi_device("gpu0", [dmi_property(n) for n in EXPECTED]))
    for name, expected in EXPECTED.items():
        prop = device.property(name)
        assert methods(prop) == expected, name
        assert prop is not None and prop.push_notes == (), name


def test_get_device_answers_with_the_methods_the_mapper_holds_and_they_read_back_the_same(tmp_path: Path) -> None:
    device = load(tmp_path, device_doc("gpu0", UUID, EVERY_METHOD))["gpu0"]
    back = convert.device_from_pb(convert.device_to_pb(device))
    for name in EXPECTED:
        assert methods(back.property(name)) == methods(device.property(name)), name


# --------------------------------------------------------------------------------------------------
# Bad values: refused naming the field, nothing else affected
# --------------------------------------------------------------------------------------------------

GOOD_HTTP = {"hostName": "http://10.0.0.5", "port": 8080, "requestPath": "/t"}
INFLUX = {
    "influxdb2ClientConfig": {"url": "http://influx:8086", "org": "o", "bucket": "b"},
    "influxdb2DataConfig": {"measurement": "m", "fieldKey": "f", "tag": {"k": "v"}},
}


def _with(base: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A deep copy of ``base`` with ``path`` (dotted) set to ``value`` (deleted when ``value`` is ...)."""
    import copy

    out = copy.deepcopy(base)
    node = out
    parts = path.split(".")
    for part in parts[:-1]:
        node = node[part]
    if value is ...:
        del node[parts[-1]]
    else:
        node[parts[-1]] = value
    return out


BAD: list[tuple[str, dict[str, Any], str, str]] = [
    # (method, the pushMethod, the field path the reason must name, a word of the reason)
    ("http", {"http": _with(GOOD_HTTP, "hostName", "10.0.0.5")}, "http.hostName", "scheme"),
    ("http", {"http": _with(GOOD_HTTP, "hostName", "http://10.0.0.5:80")}, "http.hostName", "scheme"),
    ("http", {"http": _with(GOOD_HTTP, "hostName", ...)}, "http.hostName", "required"),
    ("http", {"http": _with(GOOD_HTTP, "hostName", 5)}, "http.hostName", "string"),
    ("http", {"http": _with(GOOD_HTTP, "port", 0)}, "http.port", "1..65535"),
    ("http", {"http": _with(GOOD_HTTP, "port", 70000)}, "http.port", "1..65535"),
    ("http", {"http": _with(GOOD_HTTP, "port", "8080")}, "http.port", "whole number"),
    ("http", {"http": _with(GOOD_HTTP, "port", ...)}, "http.port", "required"),
    ("http", {"http": _with(GOOD_HTTP, "requestPath", "temp")}, "http.requestPath", "start with /"),
    ("http", {"http": _with(GOOD_HTTP, "requestPath", ["/a"])}, "http.requestPath", "string"),
    ("http", {"http": _with(GOOD_HTTP, "timeout", -1)}, "http.timeout", "0..600000"),
    ("http", {"http": _with(GOOD_HTTP, "timeout", 2.5)}, "http.timeout", "whole number"),
    ("http", {"http": "http://10.0.0.5"}, "pushMethod.http", "mapping"),
    ("otel", {"otel": {"endpointURL": "collector:4318/v1/metrics"}}, "otel.endpointURL", "http://"),
    ("otel", {"otel": {"endpointURL": "ftp://collector/v1"}}, "otel.endpointURL", "http://"),
    ("otel", {"otel": {}}, "otel.endpointURL", "required"),
    ("otel", {"otel": {"endpointURL": "http://c:99999/v1"}}, "otel.endpointURL", "URL"),
    ("mqtt", {"mqtt": {"address": "10.0.0.7:1883", "topic": "t"}}, "mqtt.address", "://host:port"),
    ("mqtt", {"mqtt": {"topic": "t", "qos": 3}}, "mqtt.qos", "0..2"),
    ("mqtt", {"mqtt": {"topic": "t/#"}}, "mqtt.topic", "wildcards"),
    ("mqtt", {"mqtt": {"topic": "t", "retained": "yes"}}, "mqtt.retained", "true or false"),
    ("anomalyDetection", {"anomalyDetection": {"model": {"kind": "zscore"}}}, "anomalyDetection.model", "nested"),
    ("anomalyDetection", {"anomalyDetection": {"windows": [1, 2]}}, "anomalyDetection.windows", "nested"),
    ("anomalyDetection", {"anomalyDetection": ["zscore"]}, "pushMethod.anomalyDetection", "mapping"),
    (
        "influxdb2",
        {"dbMethod": {"influxdb2": _with(INFLUX, "influxdb2ClientConfig.url", "influx:8086")}},
        "dbMethod.influxdb2.influxdb2ClientConfig.url",
        "http://",
    ),
    (
        "influxdb2",
        {"dbMethod": {"influxdb2": _with(INFLUX, "influxdb2ClientConfig.org", "")}},
        "dbMethod.influxdb2.influxdb2ClientConfig.org",
        "required",
    ),
    (
        "influxdb2",
        {"dbMethod": {"influxdb2": _with(INFLUX, "influxdb2ClientConfig.bucket", 7)}},
        "dbMethod.influxdb2.influxdb2ClientConfig.bucket",
        "string",
    ),
    (
        "influxdb2",
        {"dbMethod": {"influxdb2": _with(INFLUX, "influxdb2DataConfig.measurement", ...)}},
        "dbMethod.influxdb2.influxdb2DataConfig.measurement",
        "required",
    ),
    (
        "influxdb2",
        {"dbMethod": {"influxdb2": _with(INFLUX, "influxdb2DataConfig.fieldKey", "a\nb")}},
        "dbMethod.influxdb2.influxdb2DataConfig.fieldKey",
        "control",
    ),
    (
        "influxdb2",
        {"dbMethod": {"influxdb2": _with(INFLUX, "influxdb2DataConfig.tag", {"site": {"x": 1}})}},
        "dbMethod.influxdb2.influxdb2DataConfig.tag.site",
        "string",
    ),
    (
        "influxdb2",
        {"dbMethod": {"influxdb2": _with(INFLUX, "influxdb2ClientConfig", ...)}},
        "dbMethod.influxdb2.influxdb2ClientConfig",
        "required",
    ),
    (
        "redis",
        {"dbMethod": {"redis": {"redisClientConfig": {"addr": "redis:99999"}}}},
        "dbMethod.redis.redisClientConfig.addr",
        "host:port",
    ),
    (
        "redis",
        {"dbMethod": {"redis": {"redisClientConfig": {"addr": "r:6379", "db": -1}}}},
        "dbMethod.redis.redisClientConfig.db",
        "0..65535",
    ),
    (
        "redis",
        {"dbMethod": {"redis": {"redisClientConfig": {"addr": "r:6379", "poolsize": "ten"}}}},
        "dbMethod.redis.redisClientConfig.poolsize",
        "whole number",
    ),
    (
        "redis",
        {"dbMethod": {"redis": {"redisClientConfig": {"addr": "r:6379", "minIdleConns": True}}}},
        "dbMethod.redis.redisClientConfig.minIdleConns",
        "whole number",
    ),
    ("redis", {"dbMethod": {"redis": {}}}, "dbMethod.redis.redisClientConfig", "required"),
    (
        "mysql",
        {"dbMethod": {"mysql": {"mysqlClientConfig": {"addr": "m:99999", "database": "d", "userName": "u"}}}},
        "dbMethod.mysql.mysqlClientConfig.addr",
        "host:port",
    ),
    (
        "mysql",
        {"dbMethod": {"mysql": {"mysqlClientConfig": {"addr": "m:3306", "userName": "u"}}}},
        "dbMethod.mysql.mysqlClientConfig.database",
        "required",
    ),
    (
        "mysql",
        {"dbMethod": {"mysql": {"mysqlClientConfig": {"addr": "m:3306", "database": "d", "userName": 3}}}},
        "dbMethod.mysql.mysqlClientConfig.userName",
        "string",
    ),
    (
        "tdengine",
        {"dbMethod": {"TDEngine": {"TDEngineClientConfig": {"addr": "t", "dbName": "d"}}}},
        "dbMethod.TDEngine.TDEngineClientConfig.addr",
        "host:port",
    ),
    (
        "tdengine",
        {"dbMethod": {"TDEngine": {"TDEngineClientConfig": {"addr": "t:6041"}}}},
        "dbMethod.TDEngine.TDEngineClientConfig.dbName",
        "required",
    ),
    ("dbMethod", {"dbMethod": "redis"}, "pushMethod.dbMethod", "mapping"),
]


@pytest.mark.parametrize(("method", "push", "field", "word"), BAD, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_a_bad_value_refuses_that_method_naming_the_field_and_nothing_else(
    tmp_path: Path, method: str, push: dict[str, Any], field: str, word: str
) -> None:
    good = {"name": "temperature", "pushMethod": {"http": GOOD_HTTP, "dbMethod": {"influxdb2": INFLUX}}}
    bad = {"name": "power_usage", "pushMethod": push}
    other = device_doc("gpu1", UUID2, [good])
    devices = load(tmp_path, device_doc("gpu0", UUID, [good, bad]), other)
    assert set(devices) == {"gpu0", "gpu1"}, "the Device with the bad value is kept, and so is the other"
    prop = devices["gpu0"].property("power_usage")
    assert prop is not None and prop.push_mqtt is None and prop.push is None and prop.db is None
    assert len(prop.push_notes) == 1
    note = prop.push_notes[0]
    assert note.refused and note.method == method
    assert note.message.startswith(
        f"Device default/gpu0: spec.properties[1].pushMethod.{field.removeprefix('pushMethod.')}:"
    )
    assert word in note.message.split(": ", 2)[-1]
    for device in devices.values():
        kept = device.property("temperature")
        assert kept is not None and kept.push_notes == ()
        assert kept.push == PushHttp("http://10.0.0.5", 8080, "/t") and isinstance(kept.db, DbInfluxdb2)


def test_a_bad_push_method_leaves_the_same_propertys_db_method_working(tmp_path: Path) -> None:
    prop = {"name": "power_usage", "pushMethod": {"http": {"port": 8080}, "dbMethod": {"influxdb2": INFLUX}}}
    device = load(tmp_path, device_doc("gpu0", UUID, [prop]))["gpu0"]
    got = device.property("power_usage")
    assert got is not None and got.push is None and isinstance(got.db, DbInfluxdb2)
    assert [n.method for n in got.push_notes] == ["http"]


def test_a_bad_value_from_dmi_is_refused_as_from_the_folder_and_a_nested_anomaly_value_keeps_the_device() -> None:
    http = pb.DeviceProperty(name="temperature")
    http.pushMethod.http.CopyFrom(pb.PushMethodHTTP(hostname="10.0.0.5", port=8080))
    anomaly = pb.DeviceProperty(name="utilization_gpu")
    anomaly.pushMethod.anomalyDetection.data["window"].Pack(convert.wrappers_pb2.FloatValue(value=60))
    anomaly.pushMethod.anomalyDetection.data["model"].Pack(struct_pb2.Struct())
    device = convert.device_from_pb(dmi_device("gpu0", [http, anomaly, dmi_property("power_usage")]))
    temp = device.property("temperature")
    assert temp is not None and temp.push is None
    assert [(n.method, n.field) for n in temp.push_notes] == [("http", "hostName")]
    util = device.property("utilization_gpu")
    assert util is not None and util.push is None
    assert [(n.method, n.field) for n in util.push_notes] == [("anomalyDetection", "model")]
    assert methods(device.property("power_usage")) == EXPECTED["power_usage"]


def test_a_port_of_zero_from_dmi_is_refused_rather_than_posted_to() -> None:
    prop = pb.DeviceProperty(name="temperature")
    prop.pushMethod.http.CopyFrom(pb.PushMethodHTTP(hostname="http://sink"))
    got = convert.device_from_pb(dmi_device("gpu0", [prop])).property("temperature")
    assert got is not None and got.push is None and got.push_notes[0].field == "port"


# --------------------------------------------------------------------------------------------------
# One push and one DB method per property, as the framework honours
# --------------------------------------------------------------------------------------------------


def test_the_first_push_method_and_the_first_db_method_are_honoured_and_the_others_said_ignored() -> None:
    got = parse_push_method(
        {
            "otel": {"endpointURL": "http://c:4318/v1/metrics"},
            "mqtt": {"topic": "t"},
            "http": GOOD_HTTP,
            "anomalyDetection": {"a": 1},
            "dbMethod": {
                "mysql": {"mysqlClientConfig": {"addr": "m:3306", "database": "d", "userName": "u"}},
                "redis": {"redisClientConfig": {"addr": "r:6379"}},
            },
        },
        "where",
    )
    # The framework's order: http, mqtt, otel, anomalyDetection; influxdb2, redis, TDEngine, mysql.
    assert got.push == PushHttp("http://10.0.0.5", 8080, "/t") and got.mqtt is None
    assert got.db == DbRedis(addr="r:6379")
    assert [(n.method, n.refused) for n in got.notes] == [
        ("mqtt", False),
        ("otel", False),
        ("anomalyDetection", False),
        ("mysql", False),
    ]
    assert "where.otel: ignored" in got.notes[1].message


def test_method_names_match_case_insensitively_as_edgecores_json_round_trip_does() -> None:
    got = parse_push_method(
        {"dbMethod": {"tdengine": {"tdEngineClientConfig": {"addr": "t:6041", "dbname": "gpu"}}}}, "w"
    )
    assert got.db == DbTdengine(addr="t:6041", db_name="gpu") and got.notes == ()


def test_anomaly_detection_scalars_are_carried_as_given() -> None:
    got = parse_push_method({"anomalyDetection": {"threshold": 0.9, "on": False, "name": "z", "skip": None}}, "w")
    assert got.push == AnomalyDetection(config={"threshold": 0.9, "on": False, "name": "z"})


def test_a_db_addr_may_name_a_host_alone_for_the_default_port_but_tdengine_needs_its_port() -> None:
    mysql = {"mysql": {"mysqlClientConfig": {"addr": "db.example", "database": "d", "userName": "u"}}}
    assert parse_push_method({"dbMethod": mysql}, "w").db == DbMysql("db.example", "d", "u")
    redis = parse_push_method({"dbMethod": {"redis": {"redisClientConfig": {"addr": "cache"}}}}, "w")
    assert redis.db == DbRedis(addr="cache")
    td = parse_push_method({"dbMethod": {"TDEngine": {"TDEngineClientConfig": {"addr": "td", "dbName": "g"}}}}, "w")
    assert td.db is None and td.notes[0].field == "TDEngineClientConfig.addr"


def test_a_mysql_table_name_longer_than_mysql_allows_is_refused() -> None:
    mysql = {"mysql": {"mysqlClientConfig": {"addr": "m:3306", "database": "d", "userName": "u"}}}
    table = "default/" + "g" * 40 + "/temperature_memory"
    got = parse_push_method({"dbMethod": mysql}, "w", table=table)
    assert got.db is None and "64" in got.notes[0].message and str(len(table)) in got.notes[0].message
    assert parse_push_method({"dbMethod": mysql}, "w", table="default/gpu0/temperature").db is not None


# --------------------------------------------------------------------------------------------------
# Destinations: keys and the stored spec
# --------------------------------------------------------------------------------------------------


def test_every_method_reads_back_from_its_stored_spec_and_has_a_key_naming_where_it_writes(tmp_path: Path) -> None:
    device = load(tmp_path, device_doc("gpu0", UUID, EVERY_METHOD))["gpu0"]
    methods_seen = []
    for prop in device.properties:
        for method in (prop.push_mqtt, prop.push, prop.db):
            if method is None or isinstance(method, AnomalyDetection):
                continue
            methods_seen.append(method)
            assert method_from_json(method_to_json(method)) == method
    assert len(methods_seen) == 7
    keys = {destination_key(m) for m in methods_seen}
    assert "http http://10.0.0.5:8080/gpu/temp timeout 1500ms" in keys
    assert "otel https://collector.example:4318/v1/metrics" in keys
    assert "influxdb2 http://influx:8086 edge/gpu gpu,rack=7,site=a w" in keys
    assert "mysql u@10.0.0.8:3306/t" in keys
    assert len(keys) == 7


def test_a_device_update_that_changes_a_method_reaches_the_listeners() -> None:
    registry = Registry(node_gpus=lambda: [UUID])
    seen: list[str] = []
    registry.subscribe(lambda change: seen.append(change.kind))
    base = DeviceConfig(
        "default", "gpu0", "nvidia-gpu", UUID, (DeviceProperty("temperature", push=PushOtel("http://a/v1")),)
    )
    registry.upsert_device(base)
    assert registry.upsert_device(base).kind == "unchanged"
    changed = DeviceConfig(
        "default", "gpu0", "nvidia-gpu", UUID, (DeviceProperty("temperature", push=PushOtel("http://b/v1")),)
    )
    change = registry.upsert_device(changed)
    assert change.kind == "updated" and change.cycles_changed
    assert seen == ["added", "updated"]


def test_the_example_devices_name_every_method_and_load_without_a_refusal() -> None:
    folder = Path(__file__).resolve().parents[1] / "device-models" / "examples-push"
    contents = load_folder(folder)
    assert contents.errors == []
    kinds: set[str] = set()
    for device in contents.devices:
        for p in device.properties:
            assert p.push_notes == (), (device.key, p.name, p.push_notes)
            for method in (p.push_mqtt, p.push, p.db):
                if method is not None:
                    kinds.add(type(method).__name__)
    assert kinds == {
        "PushHttp",
        "PushOtel",
        "PushMqtt",
        "AnomalyDetection",
        "DbInfluxdb2",
        "DbRedis",
        "DbMysql",
        "DbTdengine",
    }
    assert len({d.uuid for d in contents.devices}) == len(contents.devices) == 4, "one demo GPU each"
