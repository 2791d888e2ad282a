"""The writer of each kind of destination, made from its method (``WriterFactory``: the router's ``make_writer``).

http, otel and mqtt (the framework's text) and the DB methods (influxdb2, redis, mysql, tdengine: each module's
``make_writer(method, secrets, *, timeout_s)``). A writer that cannot be made raises ``PermanentError`` with the
reason (tdengine always: nothing to test it against here), which the destination shows (``push_status`` twin,
``gpu-mapper status``). The OTLP messages (protobuf) are imported only when an otel destination is made.
"""

from __future__ import annotations

import ssl

from mapper.edge.push import influxdb2, mysql, redis, tdengine
from mapper.edge.push.http import HttpWriter
from mapper.edge.push.mqtttext import MqttTextWriter, PublisherFor
from mapper.edge.push.spec import Method
from mapper.errors import PermanentError
from mapper.net.httpclient import tls_context
from mapper.shared.model import PushMqtt
from mapper.shared.push import DbInfluxdb2, DbMysql, DbRedis, DbTdengine, PushHttp, PushOtel, PushSecrets, PushWriter


class WriterFactory:
    """Makes the writer of a destination. ``timeout_s``: every request's bound where the Device sets none;
    ``ca_file``: the CA bundle of https destinations (None: the system's); ``secrets``: the credentials of the DB
    methods; ``publisher_for``: a broker's publish (mqtt text; None: no broker, refused); ``influxdb2_numbers``:
    influxdb2 writes a number as a float field (the framework, and the default, write every value as a string)."""

    def __init__(
        self,
        *,
        timeout_s: float,
        ca_file: str | None = None,
        secrets: PushSecrets | None = None,
        publisher_for: PublisherFor | None = None,
        service_version: str = "",
        influxdb2_numbers: bool = False,
    ) -> None:
        self.timeout_s = timeout_s
        self.ca_file = ca_file
        self.secrets = secrets or PushSecrets()
        self.publisher_for = publisher_for
        self.service_version = service_version
        self.influxdb2_numbers = influxdb2_numbers
        # A bad CA file is a configuration error at start, not a surprise at the first https push.
        self._tls: ssl.SSLContext | None = tls_context(ca_file) if ca_file else None

    def tls(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = tls_context(None)
        return self._tls

    def __call__(self, method: Method) -> PushWriter:
        if isinstance(method, PushHttp):
            https = method.host_name.startswith("https://")
            return HttpWriter(method, timeout_s=self.timeout_s, tls=self.tls() if https else None)
        if isinstance(method, PushOtel):
            from mapper.edge.push.otel import OtelWriter

            https = method.endpoint_url.startswith("https://")
            return OtelWriter(
                method,
                timeout_s=self.timeout_s,
                tls=self.tls() if https else None,
                service_version=self.service_version,
            )
        if isinstance(method, PushMqtt):
            if self.publisher_for is None:
                raise PermanentError("pushMethod.mqtt: the mapper has no MQTT broker configured", reason="no-broker")
            return MqttTextWriter(method, self.publisher_for, timeout_s=self.timeout_s)
        if isinstance(method, DbInfluxdb2):
            https = method.url.startswith("https://")
            return influxdb2.make_writer(
                method,
                self.secrets,
                timeout_s=self.timeout_s,
                numeric=self.influxdb2_numbers,
                ssl_context=self.tls() if https else None,
            )
        if isinstance(method, DbRedis):
            return redis.make_writer(method, self.secrets, timeout_s=self.timeout_s)
        if isinstance(method, DbMysql):
            return mysql.make_writer(method, self.secrets, timeout_s=self.timeout_s)
        if isinstance(method, DbTdengine):
            return tdengine.make_writer(method, self.secrets, timeout_s=self.timeout_s)
        raise PermanentError(f"not a push destination: {method!r}")
