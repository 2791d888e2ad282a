"""Where a Device's property data goes besides the twins: the destinations a Device names in
``spec.properties[].pushMethod`` (KubeEdge's spellings in docs/push.md), as typed values, and what every push
writer receives and promises.

The framework honours one push method (the first of http, mqtt, otel, anomalyDetection) and, independently, one
DB method (the first of influxdb2, redis, tdengine, mysql) per property; so do we. ``pushMethod.mqtt`` keeps its
own type, ``mapper.shared.model.PushMqtt``. No credential is ever part of a spec: they come from the mapper's
environment or files (``PushSecrets``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

Scalar = str | int | float | bool


@dataclass(frozen=True)
class PushHttp:
    """``pushMethod.http``: one POST per property and report cycle to ``host_name:port`` + ``request_path``
    (``host_name`` carries the scheme, as in the framework); ``timeout_ms`` 0: the mapper's default."""

    host_name: str
    port: int
    request_path: str = ""
    timeout_ms: int = 0


@dataclass(frozen=True)
class PushOtel:
    """``pushMethod.otel``: OTLP over HTTP (protobuf) to ``endpoint_url``."""

    endpoint_url: str


@dataclass(frozen=True)
class AnomalyDetection:
    """``pushMethod.anomalyDetection`` (KubeEdge v1.23): accepted and carried; its scalars only."""

    config: Mapping[str, Scalar] = field(default_factory=dict)


PushMethod = PushHttp | PushOtel | AnomalyDetection


@dataclass(frozen=True)
class DbInfluxdb2:
    """``dbMethod.influxdb2``: ``influxdb2ClientConfig{url, org, bucket}`` and
    ``influxdb2DataConfig{measurement, tag, fieldKey}``; the token is ``PushSecrets.token``."""

    url: str
    org: str
    bucket: str
    measurement: str
    field_key: str
    tags: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class DbRedis:
    """``dbMethod.redis.redisClientConfig{addr, db, poolsize, minIdleConns}``; the password is
    ``PushSecrets.password``."""

    addr: str
    db: int = 0
    pool_size: int = 0
    min_idle_conns: int = 0


@dataclass(frozen=True)
class DbMysql:
    """``dbMethod.mysql.mysqlClientConfig{addr, database, userName}``; the password is ``PushSecrets.password``."""

    addr: str
    database: str
    user_name: str


@dataclass(frozen=True)
class DbTdengine:
    """``dbMethod.TDEngine.TDEngineClientConfig{addr, dbName}``; user and password from ``PushSecrets``."""

    addr: str
    db_name: str


DbMethod = DbInfluxdb2 | DbRedis | DbMysql | DbTdengine


@dataclass(frozen=True)
class PushSecrets:
    """The credentials of every destination, one set for all properties as in KubeEdge's framework (its variables
    ``TOKEN``, ``PASSWORD``, ``USERNAME``, or files named in the mapper's config). Never printed."""

    token: str | None = field(default=None, repr=False)
    password: str | None = field(default=None, repr=False)
    username: str | None = field(default=None, repr=False)


@dataclass(frozen=True)
class PushSample:
    """One property's value at one time, as every push writer receives it.

    ``value`` is the text the framework would send (floats in shortest decimal form); ``number`` the same value as
    a number where it is one (None for text); ``kind`` the property's desired metadata type ("" when none), as the
    framework's ``Type``; ``ts_ms`` the sample's own time (never the write time); ``counter``: a monotonic total
    (energy), exported as a sum where the destination has one."""

    namespace: str
    device: str
    property: str
    value: str
    ts_ms: int
    kind: str = ""
    number: float | None = None
    unit: str = ""
    counter: bool = False
    uuid: str = ""
    node: str = ""


class PushWriter(Protocol):
    """One destination's writer. ``write`` delivers the samples in the order given, or raises
    ``mapper.errors.TransientError`` (keep them and try again later: the destination is down, slow, or answered
    429/5xx) or ``mapper.errors.PermanentError`` (refused: bad request, authentication; counted, logged and dropped
    by rule, never retried). Every network wait is bounded by the writer's timeout."""

    #: The destination's identity for buffering, status and metrics, e.g. ``redis 127.0.0.1:6379/0``.
    key: str

    async def write(self, samples: Sequence[PushSample]) -> None: ...

    async def aclose(self) -> None: ...
