"""``gpu-mapper bridge``'s own ``/metrics`` (``gpu_mapper_bridge_*``, from ``BridgeStats``), ``/healthz`` and
``/readyz``, on the bounded server of ``mapper.net.http``.

The text format is prometheus_client's ``generate_latest`` (a few dozen series: the mapper's faster renderer,
``mapper.edge.status.metrics.TextRenderer``, writes the same bytes, and is the mapper's).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.utils import floatToGoString

from mapper.bridge.core import BridgeStats, Histogram
from mapper.errors import TransientError
from mapper.net.http import TEXT, Answer, HttpServer, LoopHeartbeat


def bridge_metrics(s: BridgeStats) -> list[Metric]:
    """The bridge's families (``gpu_mapper_bridge_*``) from its stats."""
    p = "gpu_mapper_bridge_"
    return [
        _counter(p + "batches_received", "telemetry batches received from the broker", s.batches_received),
        _counter(p + "samples_received", "property values in the batches received", s.samples_received),
        _counter(p + "batches_written", "batches whose samples the receiver accepted", s.batches_written),
        _counter(p + "samples_written", "samples the receiver accepted", s.samples_written),
        _counter(p + "requests_written", "remote-write requests the receiver accepted", s.requests_written),
        _counter(
            p + "duplicate_batches",
            "batches dropped as already written (node, device, boot id, seq range)",
            s.duplicate_batches,
        ),
        _counter(p + "duplicate_samples", "property values in the duplicate batches dropped", s.duplicate_samples),
        _labelled(
            CounterMetricFamily,
            p + "sequence_anomalies",
            "batches whose sequence number went backwards (the stream's numbering started again) or jumped (batches "
            "missing), by kind; written all the same",
            ("kind",),
            _keyed(s.sequence_anomalies),
        ),
        _counter(p + "decode_errors", "messages that are not telemetry batches (kept in the spool)", s.decode_errors),
        _counter(
            p + "uuid_unknown_batches",
            "batches written without a uuid label (no uuid known in time)",
            s.uuid_unknown_batches,
        ),
        _counter(
            p + "identity_unknown_batches",
            "batches written without the gpu, driver_version and pci_bus_id labels (no state message in time)",
            s.identity_unknown_batches,
        ),
        _counter(p + "state_messages", "device state messages received from the broker", s.state_messages),
        _counter(
            p + "state_messages_written",
            "state messages whose status samples the receiver accepted",
            s.state_messages_written,
        ),
        _counter(
            p + "bad_state_messages", "messages on the state topic that are not state messages", s.bad_state_messages
        ),
        _labelled(
            CounterMetricFamily,
            p + "refused_requests",
            "requests refused with a 4xx (not retried), by reason",
            ("reason",),
            _keyed(s.refused_requests),
        ),
        _labelled(
            CounterMetricFamily,
            p + "refused_samples",
            "samples in refused requests (kept in the spool)",
            ("reason",),
            _keyed(s.refused_samples),
        ),
        _labelled(
            CounterMetricFamily,
            p + "retries",
            "remote-write attempts retried (5xx, 429, network), by reason",
            ("reason",),
            _keyed(s.retries),
        ),
        _counter(p + "spooled_requests", "refused requests written to the spool directory", s.spooled_requests),
        _counter(
            p + "spool_failures", "refused requests or messages the spool could not keep (dropped)", s.spool_failures
        ),
        _counter(p + "version_fallbacks", "falls back from remote write 2.0 to 1.0", s.version_fallbacks),
        _histogram(p + "write_duration_seconds", "time of one remote-write POST", s.write_duration),
        _histogram(p + "sample_lag_seconds", "age of a batch's newest sample when it was written", s.lag),
        _gauge(p + "last_write_lag_seconds", "age of the newest sample of the last batch written", s.last_write_lag_s),
        _gauge(p + "pending_batches", "batches received and not yet written or refused", s.pending_batches),
        _gauge(p + "pending_samples", "samples waiting in requests not yet written", s.pending_samples),
        _gauge(p + "mqtt_connected", "1 while the MQTT session is up", 1 if s.mqtt_connected else 0),
        _gauge(p + "remote_write_version", "remote-write protocol version in use (1 or 2)", s.remote_write_version),
        _gauge(p + "dedup_streams", "streams (node, device, boot id, topic) the dedup remembers", s.dedup_streams),
    ]


class _BridgeCollector:
    def __init__(self, families: Callable[[], list[Metric]]) -> None:
        self._families = families

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        yield from self._families()


class BridgeMetricsServer(HttpServer):
    """``/metrics``, ``/healthz`` and ``/readyz`` of ``gpu-mapper bridge``. ``stats`` gives its counters,
    ``heartbeats`` its loops' last beats, ``problems()`` why it is not ready (empty: ready); with ``loop``
    given, they run on that asyncio loop. ``kwargs``: the rest of ``HttpServer``'s."""

    name = "gpu-mapper bridge"
    paths = ("/metrics", "/healthz", "/readyz")

    def __init__(
        self,
        addr: str,
        *,
        stats: Callable[[], BridgeStats],
        heartbeats: Callable[[], Iterable[LoopHeartbeat]],
        problems: Callable[[], list[str]],
        loop: asyncio.AbstractEventLoop | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(addr, heartbeats=heartbeats, loop=loop, **kwargs)
        self._problems = problems
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(_BridgeCollector(lambda: bridge_metrics(self.call(stats))))

    def route(self, path: str, query: dict[str, list[str]]) -> Answer | None:
        if path == "/metrics":
            try:
                return 200, CONTENT_TYPE_LATEST, generate_latest(self._registry)
            except TransientError as exc:
                return 503, TEXT, f"metrics unavailable: {exc}\n".encode()
        if path == "/readyz":
            try:
                problems = self.call(self._problems)
            except TransientError as exc:
                return 503, TEXT, f"not ready: {exc}\n".encode()
            if problems:
                return 503, TEXT, ("not ready: " + "; ".join(problems) + "\n").encode()
            return 200, TEXT, b"ready\n"
        return None


def _histogram(name: str, doc: str, h: Histogram) -> HistogramMetricFamily:
    fam = HistogramMetricFamily(name, doc)
    fam.add_metric([], [(floatToGoString(le), float(n)) for le, n in h.cumulative()], sum_value=h.sum)
    return fam


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _labelled(
    kind: type[GaugeMetricFamily] | type[CounterMetricFamily],
    name: str,
    doc: str,
    labels: tuple[str, ...],
    counts: Iterable[tuple[tuple[str, ...], float]],
) -> Metric:
    fam = kind(name, doc, labels=labels)
    for key, n in sorted(counts):
        fam.add_metric(list(key), n)
    return fam


def _keyed(counts: Mapping[str, int]) -> list[tuple[tuple[str, ...], float]]:
    return [((k,), v) for k, v in counts.items()]
