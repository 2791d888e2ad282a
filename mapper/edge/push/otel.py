"""``pushMethod.otel``: OTLP/HTTP with protobuf (``opentelemetry-proto``'s messages) to ``endpointURL``.

What the framework's exporter would send if its parser did not lose the method (docs/push.md): ``POST`` of an
``ExportMetricsServiceRequest`` to the URL's host and path (``Content-Type: application/x-protobuf``, no
compression), one metric per property named after it, the resource attribute ``device.id=<namespace>/<name>``.
Ours differ where the framework's do not run or lose information: each data point carries the sample's own time
(not the export's), the catalog's unit (in UCUM), a counter (``energy_consumption``) is a monotonic cumulative sum
rather than a gauge, the resource also says ``k8s.node.name`` and ``gpu.uuid``, and the samples of several
properties and Devices go in one request (one ``ResourceMetrics`` per Device), in their order.

Answers as the OTLP/HTTP specification says: 2xx is delivered (a partial success's rejected points are logged, not
sent again); 429, 502, 503 and 504 are kept and sent again later, after ``Retry-After`` when the receiver says
(``TransientError``); any other status is a refusal (``PermanentError``).
"""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import Sequence
from urllib.parse import urlsplit

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue
from opentelemetry.proto.metrics.v1.metrics_pb2 import (
    AGGREGATION_TEMPORALITY_CUMULATIVE,
    Metric,
    NumberDataPoint,
    ResourceMetrics,
)

from mapper.edge.push.spec import destination_key
from mapper.edge.push.wire import check_answer
from mapper.net.httpclient import HttpClient
from mapper.shared.push import PushOtel, PushSample

log = logging.getLogger(__name__)

PROTOBUF = {"Content-Type": "application/x-protobuf"}
#: The statuses OTLP/HTTP says to retry.
RETRYABLE = frozenset({429, 502, 503, 504})
#: The instrumentation scope of our metrics.
SCOPE = "kubeedge-gpu-mapper/push"
#: The catalog's units in UCUM, as OpenTelemetry names units.
UCUM = {"celsius": "Cel", "percent": "%", "bytes": "By", "W": "W", "J": "J", "MHz": "MHz", "RPM": "{rpm}"}


def ucum(unit: str) -> str:
    return UCUM.get(unit, unit)


def _attr(key: str, value: str) -> KeyValue:
    return KeyValue(key=key, value=AnyValue(string_value=value))


def export_request(samples: Sequence[PushSample], *, service_version: str = "") -> ExportMetricsServiceRequest:
    """The samples as one request: a ``ResourceMetrics`` per Device (in the order they first appear), a metric
    per property in it, a data point per sample in the order given. Samples that are not numbers are left out."""
    request = ExportMetricsServiceRequest()
    resources: dict[tuple[str, str, str, str], tuple[ResourceMetrics, dict[str, Metric]]] = {}
    for s in samples:
        if s.number is None:
            continue
        rkey = (s.namespace, s.device, s.uuid, s.node)
        entry = resources.get(rkey)
        if entry is None:
            rm = request.resource_metrics.add()
            attrs = [
                _attr("service.name", "gpu-mapper"),
                _attr("device.id", f"{s.namespace}/{s.device}"),
                _attr("k8s.node.name", s.node),
                _attr("gpu.uuid", s.uuid),
            ]
            if service_version:
                attrs.insert(1, _attr("service.version", service_version))
            rm.resource.attributes.extend(attrs)
            scope = rm.scope_metrics.add()
            scope.scope.CopyFrom(InstrumentationScope(name=SCOPE, version=service_version))
            entry = resources[rkey] = (rm, {})
        rm, metrics = entry
        metric = metrics.get(s.property)
        if metric is None:
            metric = metrics[s.property] = rm.scope_metrics[0].metrics.add()
            metric.name = s.property
            metric.unit = ucum(s.unit)
            if s.counter:
                metric.sum.aggregation_temporality = AGGREGATION_TEMPORALITY_CUMULATIVE
                metric.sum.is_monotonic = True
            else:
                metric.gauge.SetInParent()
        points = metric.sum.data_points if s.counter else metric.gauge.data_points
        points.append(NumberDataPoint(time_unix_nano=s.ts_ms * 1_000_000, as_double=s.number))
    return request


class OtelWriter:
    """Writes samples to one OTLP/HTTP metrics endpoint (``PushOtel``): up to ``max_batch`` in one request."""

    max_batch = 500

    def __init__(
        self, method: PushOtel, *, timeout_s: float, tls: ssl.SSLContext | None = None, service_version: str = ""
    ) -> None:
        self.method = method
        self.key = destination_key(method)
        parts = urlsplit(method.endpoint_url)
        self.target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.service_version = service_version
        self.client = HttpClient(f"{parts.scheme}://{parts.netloc}", timeout_s=timeout_s, tls=tls)
        self._rejected_logged_s = 0.0

    async def write(self, samples: Sequence[PushSample]) -> None:
        request = export_request(samples, service_version=self.service_version)
        if not request.resource_metrics:
            return
        answer = await self.client.post(self.target, request.SerializeToString(), PROTOBUF)
        check_answer(answer, f"otel {self.method.endpoint_url}", RETRYABLE)
        if answer.body and "protobuf" in answer.headers.get("content-type", ""):
            response = ExportMetricsServiceResponse()
            try:
                response.ParseFromString(answer.body)
            except Exception:  # an unreadable answer to a 2xx is still a delivery
                return
            rejected = response.partial_success.rejected_data_points
            now = time.monotonic()
            if rejected and now - self._rejected_logged_s >= 60.0:
                self._rejected_logged_s = now
                log.warning(
                    "otel %s rejected %d data points: %s (logged once a minute; not sent again, as OTLP says)",
                    self.method.endpoint_url,
                    rejected,
                    response.partial_success.error_message,
                )

    async def aclose(self) -> None:
        await self.client.aclose()
