"""A property's ``pushMethod`` as the mapper honours it: parsed, checked, one push and one DB method (pure).

``parse_push_method`` reads the ``pushMethod`` mapping of one Device property, spelled as the Device CRD spells it
(``http{hostName, port, requestPath, timeout}``, ``mqtt``, ``otel{endpointURL}``, ``anomalyDetection``,
``dbMethod{influxdb2, redis, TDEngine, mysql}``: docs/push.md). Keys match case-insensitively, as EdgeCore's JSON
round trip does (``tdengine`` and ``TDEngine`` are one key). The Devices folder hands it the YAML; DMI hands it the
protobuf message turned into the same mapping (``mapper.edge.kubeedge.dmi.convert``).

As KubeEdge's framework does, the first of http, mqtt, otel, anomalyDetection is the property's push method and,
independently, the first of influxdb2, redis, tdengine, mysql its DB method; any other one named is ignored, and
said so. A method with a bad value in any field is refused with a ``PushNote`` whose message names the field; the
property, its other method and every other property and Device are not affected.

Also here: a method's canonical form (``method_to_dict`` / ``method_from_dict``: how a destination is kept in the
buffer across a restart), its kind (``method_kind``) and the destination's key (``destination_key``), which names it
in the buffer, ``gpu-mapper status``, ``/metrics`` and the logs.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from mapper.shared.model import PushMqtt, PushNote
from mapper.shared.push import (
    AnomalyDetection,
    DbInfluxdb2,
    DbMethod,
    DbMysql,
    DbRedis,
    DbTdengine,
    PushHttp,
    PushMethod,
    PushOtel,
    Scalar,
)

#: The push methods in the order the framework tries them, and the DB methods likewise (the CRD's spellings).
PUSH_ORDER = ("http", "mqtt", "otel", "anomalyDetection")
DB_ORDER = ("influxdb2", "redis", "TDEngine", "mysql")
#: The longest timeout a Device may ask of an http push (ms): a longer one would hold a destination's queue.
MAX_TIMEOUT_MS = 600_000
#: MySQL's limit on a table name (the framework's table is ``<namespace>/<device>/<property>``).
MYSQL_MAX_TABLE_NAME = 64
#: The MQTT schemes the mapper's sessions accept (mapper.net.mqtt).
MQTT_SCHEMES = ("mqtt", "mqtts", "tcp", "ssl", "tls")

#: Any method a destination is made of (``pushMethod.mqtt`` as the framework's text messages included).
Method = PushHttp | PushOtel | PushMqtt | DbInfluxdb2 | DbRedis | DbMysql | DbTdengine

_HOST_PORT = re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):(\d{1,5})")
_HOST = re.compile(r"\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+")
_SCHEME_HOST = re.compile(r"(https?)://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)")


@dataclass(frozen=True)
class PropertyPush:
    """What a property's ``pushMethod`` comes to: at most one push method (``mqtt`` or ``push``) and one DB
    method, and the notes on what was refused or ignored."""

    mqtt: PushMqtt | None = None
    push: PushMethod | None = None
    db: DbMethod | None = None
    notes: tuple[PushNote, ...] = ()


class _Refused(Exception):
    """A bad value: ``field`` (relative to the method) and the message's tail."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


def _get(mapping: Mapping[str, Any], key: str) -> Any:
    """``mapping[key]``, matching the key case-insensitively when it is not there as spelled (Go's JSON)."""
    if key in mapping:
        return mapping[key]
    folded = key.lower()
    for k, v in mapping.items():
        if isinstance(k, str) and k.lower() == folded:
            return v
    return None


def _has(mapping: Mapping[str, Any], key: str) -> bool:
    folded = key.lower()
    return any(isinstance(k, str) and k.lower() == folded for k in mapping)


def _dotted(field: str) -> str:
    return f".{field}" if field else ""


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _mapping(value: Any, field: str, *, required: bool = True) -> Mapping[str, Any]:
    if value is None:
        if required:
            raise _Refused(field, "is required")
        return {}
    if not isinstance(value, Mapping):
        raise _Refused(field, f"must be a mapping, got {type(value).__name__}")
    return value


def _text(value: Any, field: str, *, required: bool = True, max_len: int = 1024) -> str:
    if value is None or value == "":
        if required:
            raise _Refused(field, "is required")
        return ""
    if not isinstance(value, str):
        raise _Refused(field, f"must be a string, got {_shown(value)}")
    if len(value) > max_len:
        raise _Refused(field, f"is longer than {max_len} characters")
    if any(c in value for c in "\r\n\t\0"):
        raise _Refused(field, f"must not hold control characters, got {_shown(value)}")
    return value


def _integer(value: Any, field: str, *, default: int | None = None, low: int = 0, high: int = 2**31 - 1) -> int:
    if value is None:
        if default is None:
            raise _Refused(field, "is required")
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _Refused(field, f"must be a whole number, got {_shown(value)}")
    if isinstance(value, float) and (not math.isfinite(value) or value != int(value)):
        raise _Refused(field, f"must be a whole number, got {_shown(value)}")
    number = int(value)
    if not low <= number <= high:
        raise _Refused(field, f"must be {low}..{high}, got {number}")
    return number


def _flag(value: Any, field: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _Refused(field, f"must be true or false, got {_shown(value)}")
    return value


def _url(value: Any, field: str) -> str:
    """An http:// or https:// URL with a host (a port and a path may follow)."""
    url = _text(value, field)
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise _Refused(field, f"is not a URL ({exc}), got {_shown(url)}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise _Refused(field, f"must be an http:// or https:// URL with a host, got {_shown(url)}")
    if port == 0 or " " in url:
        raise _Refused(field, f"is not a usable URL, got {_shown(url)}")
    return url


def _addr(value: Any, field: str, *, port_optional: bool = False) -> str:
    """``host:port`` (a bracketed IPv6 host allowed), as the Go drivers take it; with ``port_optional`` a host alone
    too (the writer's default port: MySQL's 3306, Redis's 6379)."""
    addr = _text(value, field)
    if port_optional and _HOST.fullmatch(addr):
        return addr
    match = _HOST_PORT.fullmatch(addr)
    if match is None or not 1 <= int(match.group(1)) <= 65535:
        raise _Refused(field, f"must be host:port, got {_shown(addr)}")
    return addr


# --------------------------------------------------------------------------------------------------
# One method each
# --------------------------------------------------------------------------------------------------


def _http(raw: Any) -> PushHttp:
    spec = _mapping(raw, "")
    host = _text(_get(spec, "hostName"), "hostName")
    if _SCHEME_HOST.fullmatch(host) is None:
        # The framework writes hostName + ":" + port + requestPath: the scheme belongs here, the rest elsewhere.
        raise _Refused(
            "hostName",
            f"must be a scheme and a host, e.g. http://10.0.0.5 or https://sink.example (the port and the path "
            f"have fields of their own), got {_shown(host)}",
        )
    port = _integer(_get(spec, "port"), "port", low=1, high=65535)
    path = _text(_get(spec, "requestPath"), "requestPath", required=False)
    if path and (not path.startswith("/") or " " in path):
        raise _Refused("requestPath", f"must start with / and hold no blank, got {_shown(path)}")
    timeout = _integer(_get(spec, "timeout"), "timeout", default=0, high=MAX_TIMEOUT_MS)
    return PushHttp(host_name=host, port=port, request_path=path, timeout_ms=timeout)


def _otel(raw: Any) -> PushOtel:
    spec = _mapping(raw, "")
    return PushOtel(endpoint_url=_url(_get(spec, "endpointURL"), "endpointURL"))


def _mqtt(raw: Any) -> PushMqtt:
    spec = _mapping(raw, "")
    address = _text(_get(spec, "address"), "address", required=False)
    if address:
        scheme, sep, rest = address.partition("://")
        if not sep or scheme.lower() not in MQTT_SCHEMES or not rest.strip("/"):
            raise _Refused("address", f"must be {'|'.join(MQTT_SCHEMES)}://host:port, got {_shown(address)}")
    topic = _text(_get(spec, "topic"), "topic", required=False)
    if any(c in topic for c in "#+"):
        raise _Refused("topic", f"must not hold MQTT wildcards (# or +), got {_shown(topic)}")
    qos = _integer(_get(spec, "qos"), "qos", default=1, high=2)
    return PushMqtt(address=address, topic=topic, qos=qos, retained=_flag(_get(spec, "retained"), "retained"))


def _anomaly(raw: Any) -> AnomalyDetection:
    spec = _mapping(raw, "", required=False)
    config: dict[str, Scalar] = {}
    for key, value in spec.items():
        if isinstance(value, Mapping | list | tuple):
            # EdgeCore cannot turn a nested value into the DMI message either (it fails the Device).
            raise _Refused(str(key), "nested objects and lists are not supported (EdgeCore refuses them too)")
        if value is None:
            continue
        if not isinstance(value, str | int | float | bool):
            raise _Refused(str(key), f"must be a string, number or boolean, got {type(value).__name__}")
        config[str(key)] = value
    return AnomalyDetection(config=config)


def _influxdb2(raw: Any) -> DbInfluxdb2:
    spec = _mapping(raw, "")
    client = _mapping(_get(spec, "influxdb2ClientConfig"), "influxdb2ClientConfig")
    data = _mapping(_get(spec, "influxdb2DataConfig"), "influxdb2DataConfig")
    url = _url(_get(client, "url"), "influxdb2ClientConfig.url")
    org = _text(_get(client, "org"), "influxdb2ClientConfig.org")
    bucket = _text(_get(client, "bucket"), "influxdb2ClientConfig.bucket")
    measurement = _text(_get(data, "measurement"), "influxdb2DataConfig.measurement")
    field_key = _text(_get(data, "fieldKey"), "influxdb2DataConfig.fieldKey")
    tags: dict[str, str] = {}
    for key, value in _mapping(_get(data, "tag"), "influxdb2DataConfig.tag", required=False).items():
        where = f"influxdb2DataConfig.tag.{key}"
        if not isinstance(key, str) or not key:
            raise _Refused(where, "a tag needs a name")
        tags[key] = _text(value, where)
    return DbInfluxdb2(
        url=url, org=org, bucket=bucket, measurement=measurement, field_key=field_key, tags=dict(sorted(tags.items()))
    )


def _redis(raw: Any) -> DbRedis:
    spec = _mapping(raw, "")
    client = _mapping(_get(spec, "redisClientConfig"), "redisClientConfig")
    return DbRedis(
        addr=_addr(_get(client, "addr"), "redisClientConfig.addr", port_optional=True),
        db=_integer(_get(client, "db"), "redisClientConfig.db", default=0, high=65535),
        pool_size=_integer(_get(client, "poolsize"), "redisClientConfig.poolsize", default=0, high=10_000),
        min_idle_conns=_integer(_get(client, "minIdleConns"), "redisClientConfig.minIdleConns", default=0, high=10_000),
    )


def _tdengine(raw: Any) -> DbTdengine:
    spec = _mapping(raw, "")
    client = _mapping(_get(spec, "TDEngineClientConfig"), "TDEngineClientConfig")
    return DbTdengine(
        addr=_addr(_get(client, "addr"), "TDEngineClientConfig.addr"),
        db_name=_text(_get(client, "dbName"), "TDEngineClientConfig.dbName"),
    )


def _mysql(raw: Any, table: str) -> DbMysql:
    spec = _mapping(raw, "")
    client = _mapping(_get(spec, "mysqlClientConfig"), "mysqlClientConfig")
    method = DbMysql(
        addr=_addr(_get(client, "addr"), "mysqlClientConfig.addr", port_optional=True),
        database=_text(_get(client, "database"), "mysqlClientConfig.database", max_len=64),
        user_name=_text(_get(client, "userName"), "mysqlClientConfig.userName", max_len=80),
    )
    if len(table) > MYSQL_MAX_TABLE_NAME:
        raise _Refused(
            "mysqlClientConfig",
            f"the framework's table for this property, {table!r}, is {len(table)} characters: "
            f"MySQL allows {MYSQL_MAX_TABLE_NAME}",
        )
    return method


_PUSH_PARSERS: dict[str, Callable[[Any], PushMqtt | PushMethod]] = {
    "http": _http,
    "mqtt": _mqtt,
    "otel": _otel,
    "anomalyDetection": _anomaly,
}


# --------------------------------------------------------------------------------------------------
# A property's pushMethod
# --------------------------------------------------------------------------------------------------


def parse_push_method(raw: Any, where: str, *, table: str = "") -> PropertyPush:
    """The ``pushMethod`` of one property (``raw``: its mapping, None when absent). ``where`` prefixes every note
    (``Device ns/name: spec.properties[2].pushMethod``); ``table`` is the framework's MySQL table of this property
    (``<namespace>/<device>/<property>``), whose length MySQL bounds. Never raises for a bad method: it is refused
    in a note; a ``pushMethod`` that is not a mapping is one refused note."""
    if raw is None:
        return PropertyPush()
    if not isinstance(raw, Mapping):
        return PropertyPush(notes=(PushNote("pushMethod", f"{where}: must be a mapping, got {type(raw).__name__}"),))
    notes: list[PushNote] = []
    mqtt: PushMqtt | None = None
    push: PushMethod | None = None
    chosen = ""
    for name in PUSH_ORDER:
        if not _has(raw, name):
            continue
        value = _get(raw, name)
        if chosen:
            notes.append(
                PushNote(
                    name,
                    f"{where}.{name}: ignored: a property has one push method, the first of http, mqtt, otel, "
                    f"anomalyDetection ({chosen} here), as in KubeEdge's mapper framework",
                    refused=False,
                )
            )
            continue
        chosen = name
        try:
            parsed = _PUSH_PARSERS[name](value)
        except _Refused as exc:
            notes.append(PushNote(name, f"{where}.{name}{_dotted(exc.field)}: {exc.message}", field=exc.field))
            continue
        if isinstance(parsed, PushMqtt):
            mqtt = parsed
        else:
            push = parsed
    db: DbMethod | None = None
    if _has(raw, "dbMethod"):
        db, db_notes = _db_method(_get(raw, "dbMethod"), f"{where}.dbMethod", table)
        notes.extend(db_notes)
    return PropertyPush(mqtt=mqtt, push=push, db=db, notes=tuple(notes))


def _db_method(raw: Any, where: str, table: str) -> tuple[DbMethod | None, list[PushNote]]:
    if raw is None:
        return None, []
    if not isinstance(raw, Mapping):
        return None, [PushNote("dbMethod", f"{where}: must be a mapping, got {type(raw).__name__}")]
    notes: list[PushNote] = []
    chosen = ""
    db: DbMethod | None = None
    for name in DB_ORDER:
        if not _has(raw, name):
            continue
        kind = name.lower()
        if chosen:
            notes.append(
                PushNote(
                    kind,
                    f"{where}.{name}: ignored: a property has one DB method, the first of influxdb2, redis, "
                    f"TDEngine, mysql ({chosen} here), as in KubeEdge's mapper framework",
                    refused=False,
                )
            )
            continue
        chosen = name
        value = _get(raw, name)
        try:
            db = _mysql(value, table) if name == "mysql" else _DB_PARSERS[name](value)
        except _Refused as exc:
            notes.append(PushNote(kind, f"{where}.{name}{_dotted(exc.field)}: {exc.message}", field=exc.field))
    return db, notes


_DB_PARSERS: dict[str, Callable[[Any], DbMethod]] = {"influxdb2": _influxdb2, "redis": _redis, "TDEngine": _tdengine}


# --------------------------------------------------------------------------------------------------
# Destinations: kind, key, canonical form
# --------------------------------------------------------------------------------------------------


def method_kind(method: Method) -> str:
    """``http``, ``otel``, ``mqtt``, ``influxdb2``, ``redis``, ``mysql`` or ``tdengine``."""
    if isinstance(method, PushHttp):
        return "http"
    if isinstance(method, PushOtel):
        return "otel"
    if isinstance(method, PushMqtt):
        return "mqtt"
    if isinstance(method, DbInfluxdb2):
        return "influxdb2"
    if isinstance(method, DbRedis):
        return "redis"
    if isinstance(method, DbMysql):
        return "mysql"
    if isinstance(method, DbTdengine):
        return "tdengine"
    raise TypeError(f"not a push destination: {method!r}")


def http_url(method: PushHttp) -> str:
    """The framework's URL: ``hostName + ":" + port + requestPath``, as it is."""
    return f"{method.host_name}:{method.port}{method.request_path}"


def destination_key(method: Method) -> str:
    """The destination's name: its kind and where it writes, e.g. ``http http://10.0.0.5:8080/temp``,
    ``otel http://collector:4318/v1/metrics``, ``mysql gpu@10.0.0.9:3306/telemetry``. Two methods with the same
    key are one destination (one queue, one order); every field that changes what is written is in it."""
    if isinstance(method, PushHttp):
        timeout = f" timeout {method.timeout_ms}ms" if method.timeout_ms else ""
        return f"http {http_url(method)}{timeout}"
    if isinstance(method, PushOtel):
        return f"otel {method.endpoint_url}"
    if isinstance(method, PushMqtt):
        retained = " retained" if method.retained else ""
        return f"mqtt {method.address or 'default-broker'} {method.topic} qos{method.qos}{retained}"
    if isinstance(method, DbInfluxdb2):
        tags = "".join(f",{k}={v}" for k, v in sorted(method.tags.items()))
        return f"influxdb2 {method.url} {method.org}/{method.bucket} {method.measurement}{tags} {method.field_key}"
    if isinstance(method, DbRedis):
        return f"redis {method.addr}/{method.db}"
    if isinstance(method, DbMysql):
        return f"mysql {method.user_name}@{method.addr}/{method.database}"
    if isinstance(method, DbTdengine):
        return f"tdengine {method.addr}/{method.db_name}"
    raise TypeError(f"not a push destination: {method!r}")


def method_to_dict(method: Method) -> dict[str, Any]:
    """The method as plain JSON values, with its kind (``method_from_dict`` reads it back)."""
    if isinstance(method, PushHttp):
        fields: dict[str, Any] = {
            "hostName": method.host_name,
            "port": method.port,
            "requestPath": method.request_path,
            "timeout": method.timeout_ms,
        }
    elif isinstance(method, PushOtel):
        fields = {"endpointURL": method.endpoint_url}
    elif isinstance(method, PushMqtt):
        fields = {"address": method.address, "topic": method.topic, "qos": method.qos, "retained": method.retained}
    elif isinstance(method, DbInfluxdb2):
        fields = {
            "url": method.url,
            "org": method.org,
            "bucket": method.bucket,
            "measurement": method.measurement,
            "fieldKey": method.field_key,
            "tag": dict(sorted(method.tags.items())),
        }
    elif isinstance(method, DbRedis):
        fields = {
            "addr": method.addr,
            "db": method.db,
            "poolsize": method.pool_size,
            "minIdleConns": method.min_idle_conns,
        }
    elif isinstance(method, DbMysql):
        fields = {"addr": method.addr, "database": method.database, "userName": method.user_name}
    elif isinstance(method, DbTdengine):
        fields = {"addr": method.addr, "dbName": method.db_name}
    else:
        raise TypeError(f"not a push destination: {method!r}")
    return {"kind": method_kind(method), **fields}


def method_to_json(method: Method) -> str:
    return json.dumps(method_to_dict(method), sort_keys=True, separators=(",", ":"))


def method_from_dict(doc: Mapping[str, Any]) -> Method:
    """What ``method_to_dict`` wrote; ``ValueError`` for anything else (a buffer file of another build)."""
    kind = doc.get("kind")
    try:
        if kind == "http":
            return _http(doc)
        if kind == "otel":
            return _otel(doc)
        if kind == "mqtt":
            return _mqtt(doc)
        if kind == "influxdb2":
            return _influxdb2(
                {
                    "influxdb2ClientConfig": {k: doc.get(k) for k in ("url", "org", "bucket")},
                    "influxdb2DataConfig": {k: doc.get(k) for k in ("measurement", "fieldKey", "tag")},
                }
            )
        if kind == "redis":
            return _redis({"redisClientConfig": doc})
        if kind == "mysql":
            return _mysql({"mysqlClientConfig": doc}, "")
        if kind == "tdengine":
            return _tdengine({"TDEngineClientConfig": doc})
    except _Refused as exc:
        raise ValueError(f"{kind} destination{_dotted(exc.field)}: {exc.message}") from None
    raise ValueError(f"unknown destination kind {kind!r}")


def method_from_json(text: str) -> Method:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"destination spec is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ValueError("destination spec is not a JSON object")
    return method_from_dict(doc)
