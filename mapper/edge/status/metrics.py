"""Prometheus metrics and the mapper's HTTP endpoints.

``GpuCollector`` builds every metric at scrape time from one ``MapperSnapshot`` (a callable the composition
root provides): no NVML call per scrape, and a GPU that left the snapshot leaves no stale series. It lives in
a fresh ``CollectorRegistry`` (``build_registry``), never in the global one.

``MetricsServer`` (the bounded server of ``mapper.net.http``, with its ``/healthz``) serves:

* ``/metrics``  Prometheus text format
* ``/healthz``  200 while every registered loop beats; 503 naming the stalled loop (liveness probe)
* ``/readyz``   200 when NVML is initialised and the mapper is registered with EdgeCore or standalone
* ``/status``   the snapshot as JSON (``?format=text``: the ``gpu-mapper status`` table; ``&wide=1``: its wide form)

The snapshot and readiness callables are run on the app's event loop (when one is given, so they read the
app's state from its own thread) or on a worker thread, and waited for at most ``snapshot_timeout_s``; a
callable that does not answer in time gives 503, never a hung scrape.

Also here: reading a snapshot back for ``gpu-mapper status`` (``fetch_status`` over HTTP, or
``read_status_file``/``write_status_file`` in the data directory).
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.openmetrics.exposition import UNDERSCORES, escape_label_name, escape_metric_name
from prometheus_client.samples import Sample as PromSample
from prometheus_client.utils import floatToGoString

from mapper.edge.health.checks import CheckResult, HealthReport, ProbeResult
from mapper.edge.processes.monitor import GpuWorkloads, PodUse, ProcessRow
from mapper.edge.push.destination import STATES as PUSH_STATES
from mapper.edge.push.destination import DestinationStatus
from mapper.edge.status.series import node_series
from mapper.edge.status.stats import STATUS_FILE_NAME, GpuSnapshot, MapperSnapshot, Readiness, SnapshotFormatError
from mapper.edge.status.view import render_status
from mapper.errors import ConfigError, NotFoundError, TransientError
from mapper.net.http import TEXT, Answer, HttpServer, LoopHeartbeat
from mapper.shared import naming
from mapper.shared.model import DEVICE_STATES, GpuInfo, Sample

log = logging.getLogger(__name__)

#: Labels of every per-GPU series (the naming table's).
GPU_LABELS = naming.GPU_LABELS

#: Catalog properties exported as one numeric series each (those with a Prometheus name).
EXPORTED_PROPERTIES = tuple(ps.spec for ps in naming.PROPERTY_SERIES)


# --------------------------------------------------------------------------------------------------
# The collector
# --------------------------------------------------------------------------------------------------


class GpuCollector:
    """A prometheus_client custom collector: every metric comes from ``snapshot()`` at scrape time."""

    def __init__(self, snapshot: Callable[[], MapperSnapshot]) -> None:
        self._snapshot = snapshot

    def describe(self) -> list[Metric]:
        # Nothing up front: registration must not take a snapshot.
        return []

    def collect(self) -> Iterator[Metric]:
        yield from snapshot_metrics(self._snapshot())


def build_registry(snapshot: Callable[[], MapperSnapshot]) -> CollectorRegistry:
    """A fresh registry holding only a ``GpuCollector`` over ``snapshot``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GpuCollector(snapshot))
    return registry


def render_metrics(registry: CollectorRegistry, renderer: TextRenderer | None = None) -> bytes:
    """The Prometheus text exposition of ``registry``: what ``generate_latest`` writes, byte for byte
    (``TextRenderer``; pass the same one to every scrape to reuse its label texts)."""
    return (renderer or TextRenderer()).render(registry.collect())


class TextRenderer:
    """Prometheus text format 0.0.4, byte for byte what prometheus_client's ``generate_latest`` writes for the
    same families (the tests compare the two), in a fraction of its CPU.

    ``generate_latest`` validates, escapes, sorts and joins every sample's labels, and formats its value through
    a general routine, line by line: 8 GPUs make about 500 lines and 4 to 10 ms of CPU per scrape on a small edge
    node, as much as the collect loop spends in a second or two. Here the text of each label set is kept from one
    scrape to the next (a node's label sets hardly change; at most ``max_label_sets`` are kept, then the cache
    starts afresh), and within a scrape it is found by the identity of the labels dict (``snapshot_metrics``
    hands every plain series of a GPU the same dict) before its items are hashed. Each sample name is escaped
    once, and a plain value is shown by ``repr`` (what ``floatToGoString`` returns for it).

    One renderer may serve concurrent scrapes: its cache only ever gains entries or is replaced whole."""

    def __init__(self, max_label_sets: int = 4096) -> None:
        self.max_label_sets = max_label_sets
        self._label_texts: dict[tuple[tuple[str, str], ...], str] = {}
        self._names: dict[str, str] = {}

    def render(self, families: Iterable[Metric]) -> bytes:
        out: list[str] = []
        if len(self._label_texts) > self.max_label_sets:
            self._label_texts = {}
            self._names = {}
        label_texts = self._label_texts
        # id(labels dict) -> (the dict, its text): the entry holds the dict, so its id is not reused meanwhile.
        by_identity: dict[int, tuple[dict[str, str], str]] = {}
        names = self._names

        def label_text(labels: dict[str, str]) -> str:
            if not labels:
                return ""
            held = by_identity.get(id(labels))
            if held is not None and held[0] is labels:
                return held[1]
            key = tuple(labels.items())
            text = label_texts.get(key)
            if text is None:
                pairs = (f'{escape_label_name(k, UNDERSCORES)}="{_escape_label_value(v)}"' for k, v in sorted(key))
                text = label_texts[key] = "{" + ",".join(pairs) + "}"
            by_identity[id(labels)] = (labels, text)
            return text

        def line(sample: Any) -> str:
            name = names.get(sample.name)
            if name is None:
                name = names[sample.name] = escape_metric_name(sample.name, UNDERSCORES)
            number = float(sample.value)
            # floatToGoString is repr() but for infinities, NaN and positive values of 1e6 and more.
            shown = repr(number) if -1e300 < number < 1e6 else floatToGoString(number)
            stamp = "" if sample.timestamp is None else f" {int(float(sample.timestamp) * 1000):d}"
            return f"{name}{label_text(sample.labels)} {shown}{stamp}\n"

        for metric in families:
            mname, mtype = metric.name, metric.type
            # The OpenMetrics types as the Prometheus text format names them (as generate_latest does).
            if mtype == "counter":
                mname += "_total"
            elif mtype == "info":
                mname += "_info"
                mtype = "gauge"
            elif mtype == "stateset":
                mtype = "gauge"
            elif mtype == "gaugehistogram":
                mtype = "histogram"
            elif mtype == "unknown":
                mtype = "untyped"
            doc = _escape_help(metric.documentation)
            shown = escape_metric_name(mname, UNDERSCORES)
            out.append(f"# HELP {shown} {doc}\n# TYPE {shown} {mtype}\n")
            # OpenMetrics-only samples go after the family, each suffix as a gauge of its own.
            late_names = {metric.name + suffix: suffix for suffix in _LATE_SUFFIXES}
            late: dict[str, list[str]] = {}
            for sample in metric.samples:
                suffix = late_names.get(sample.name)
                if suffix is None:
                    out.append(line(sample))
                else:
                    late.setdefault(suffix, []).append(line(sample))
            for suffix, lines in sorted(late.items()):
                shown = escape_metric_name(metric.name + suffix, UNDERSCORES)
                out.append(f"# HELP {shown} {doc}\n# TYPE {shown} gauge\n")
                out.extend(lines)
        return "".join(out).encode("utf-8")


#: Sample suffixes the text format shows as separate gauges after their family (as ``generate_latest`` does).
_LATE_SUFFIXES = ("_created", "_gsum", "_gcount")


def _escape_label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def metric_names() -> frozenset[str]:
    """Every metric family name the collector can emit (for dashboards and alert rules to be checked
    against). Counters are listed with their ``_total`` sample name, histograms with ``_bucket/_sum/_count``."""
    names: set[str] = set()
    for fam in snapshot_metrics(_FULL_EXAMPLE()):
        if fam.type == "counter":
            names.add(fam.name + "_total")
        elif fam.type == "histogram":
            names.update({fam.name + "_bucket", fam.name + "_sum", fam.name + "_count"})
        else:
            names.add(fam.name)
    return frozenset(names)


def snapshot_metrics(snap: MapperSnapshot) -> list[Metric]:
    """Build every metric family for one snapshot (pure apart from the prometheus_client types). Names, types,
    help texts and labels come from ``mapper.shared.naming`` (shared with the bridge)."""
    out: list[Metric] = []
    per_prop: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
    for ps in naming.PROPERTY_SERIES:
        per_prop[ps.spec.name] = _family(ps.family)

    info = _family(naming.GPU_INFO)
    reasons = _family(naming.CLOCK_EVENT_REASON)
    compute = _family(naming.COMPUTE_MODE)
    xids = _family(naming.XID_ERRORS)
    desired_cap = _family(naming.DESIRED_POWER_LIMIT)
    state = _family(naming.DEVICE_STATE)
    policy_state = _family(naming.POLICY_STATE)
    sample_ts = _family(naming.SAMPLE_TIMESTAMP)

    # The plain per-GPU series get their samples here rather than through ``add_metric``: one labels dict per
    # GPU, shared by all of them (``TextRenderer`` renders it once), instead of one dict per series.
    prop_series = [
        (spec, per_prop[spec.name].samples, _sample_name(per_prop[spec.name])) for spec in EXPORTED_PROPERTIES
    ]
    driver = snap.driver_version
    for g in snap.gpus:
        labels = [g.info.uuid, str(g.info.index), naming.device_label(g.device), g.node or snap.node]
        shared = dict(zip(GPU_LABELS, labels, strict=True))
        info.add_metric(
            [*labels, g.info.name, g.info.driver_version or driver, g.info.pci_bus_id],
            1,
        )
        for s in DEVICE_STATES:
            state.add_metric([*labels, s], 1 if g.state == s else 0)
        if g.policy_state:
            policy_state.add_metric([*labels, g.policy_state], 1)
        if g.desired_power_limit_w is not None:
            desired_cap.samples.append(PromSample(desired_cap.name, shared, g.desired_power_limit_w))
        for code, n in sorted(g.xid_errors.items()):
            xids.add_metric([*labels, str(code)], n)
        if g.sample is None:
            continue
        sample_ts.samples.append(PromSample(sample_ts.name, shared, g.sample.ts_ms / 1000.0))
        values = g.sample.values
        for spec, samples, name in prop_series:
            number = _number(values.get(spec.name))
            if number is not None:
                samples.append(PromSample(name, shared, number * spec.prom_scale))
        mask = _number(values.get(naming.CLOCK_EVENT_REASONS_PROPERTY))
        if mask is not None:
            for reason, flag in naming.clock_event_reason_flags(int(mask)):
                reasons.add_metric([*labels, reason], flag)
        mode = values.get(naming.COMPUTE_MODE_PROPERTY)
        if isinstance(mode, str):
            for m, flag in naming.compute_mode_flags(mode):
                compute.add_metric([*labels, m], flag)

    out.extend(per_prop.values())
    out.extend([info, reasons, compute, xids, desired_cap, state, policy_state, sample_ts])
    out.extend(_health_metrics(snap))
    out.extend(_self_metrics(snap))
    out.extend(workload_metrics(snap))
    out.extend(push_metrics(snap))
    return out


def _health_metrics(snap: MapperSnapshot) -> list[Metric]:
    """The three health levels, the subsystems, the level-2 checks, the probe and the InfoROM (``docs/health.md``):
    ``naming.health_samples`` of each GPU's ``health_status``, as its state message carries them to the bridge."""
    families = (
        naming.HEALTH_STATUS,
        naming.HEALTH_SUBSYSTEM,
        naming.HEALTH_CHECK,
        naming.HEALTH_PROBE_LATENCY,
        naming.HEALTH_PROBE_SUCCESS,
        naming.HEALTH_PROBES,
        naming.INFOROM_INFO,
    )
    fams = {f.name: _family(f) for f in families}
    for g in snap.gpus:
        labels = [g.info.uuid, str(g.info.index), naming.device_label(g.device), g.node or snap.node]
        h = g.health_status()
        samples = naming.health_samples(h.levels, h.subsystems, h.checks, h.probe, h.probes, h.inforom)
        for family, extra, value in samples:
            fams[family.name].add_metric([*labels, *extra], value)
    return list(fams.values())


def _sample_name(fam: Metric) -> str:
    """The name of a family's plain samples (what its ``add_metric`` uses: counters end in ``_total``)."""
    return fam.name + "_total" if fam.type == "counter" else fam.name


_number = naming.number


def workload_metrics(snap: MapperSnapshot) -> list[Metric]:
    """Who uses each GPU (the process cycle's latest ``GpuWorkloads``): process rows, per-container energy,
    power, memory and SM share, the GPU's idle and unattributed energy, suspected leaks (docs/processes.md)."""
    fams = {
        f.name: _family(f)
        for f in (
            naming.PROCESSES,
            naming.PROCESS_MEMORY,
            naming.PROCESS_SM,
            naming.POD_ENERGY,
            naming.POD_POWER,
            naming.POD_MEMORY,
            naming.POD_SM,
            naming.IDLE_ENERGY,
            naming.IDLE_POWER,
            naming.UNATTRIBUTED_ENERGY,
            naming.LEAK_SUSPECTED,
        )
    }
    labels_of = {
        g.info.uuid: [g.info.uuid, str(g.info.index), naming.device_label(g.device), g.node or snap.node]
        for g in snap.gpus
    }
    for w in snap.workloads:
        labels = labels_of.get(w.uuid)
        if labels is None:
            continue
        fams[naming.PROCESSES.name].add_metric(labels, w.process_count)
        fams[naming.IDLE_ENERGY.name].add_metric(labels, w.idle_joules_total)
        fams[naming.IDLE_POWER.name].add_metric(labels, w.idle_power_w)
        fams[naming.UNATTRIBUTED_ENERGY.name].add_metric(labels, w.unattributed_joules_total)
        rows = {r.pid: r for r in w.processes}
        for r in w.processes:
            who = [*labels, str(r.pid) if r.pid else "other", r.namespace, r.pod, r.container]
            if r.memory_used_bytes is not None:
                fams[naming.PROCESS_MEMORY.name].add_metric(who, r.memory_used_bytes)
            if r.sm_ratio is not None:
                fams[naming.PROCESS_SM.name].add_metric(who, r.sm_ratio)
        for pid in w.leaking_pids:
            row = rows.get(pid)
            owner = [row.namespace, row.pod, row.container] if row is not None else ["", "", ""]
            fams[naming.LEAK_SUSPECTED.name].add_metric([*labels, str(pid), *owner], 1)
        for p in w.pods:
            who = [*labels, p.namespace, p.pod, p.container]
            fams[naming.POD_ENERGY.name].add_metric(who, p.energy_joules_total)
            fams[naming.POD_POWER.name].add_metric(who, p.power_w)
            fams[naming.POD_MEMORY.name].add_metric(who, p.memory_used_bytes)
            if p.sm_ratio is not None:
                fams[naming.POD_SM.name].add_metric(who, p.sm_ratio)
    return list(fams.values())


def _family(f: naming.Family) -> GaugeMetricFamily | CounterMetricFamily:
    kind = CounterMetricFamily if f.type == "counter" else GaugeMetricFamily
    return kind(f.name, f.doc, labels=f.all_labels)


def push_metrics(snap: MapperSnapshot) -> list[Metric]:
    """Each push or DB destination a Device names (docs/push.md): its state, backlog, deliveries, failed tries,
    drops by reason and last error, labelled with the destination's key and its method."""
    labels = ("destination", "method")
    state = GaugeMetricFamily(
        "gpu_mapper_push_state",
        "1 for the destination's state (waiting, ok, down, refused), 0 for the others",
        labels=(*labels, "state"),
    )
    backlog = GaugeMetricFamily(
        "gpu_mapper_push_backlog_samples", "samples waiting in the push buffer for the destination", labels=labels
    )
    backlog_bytes = GaugeMetricFamily(
        "gpu_mapper_push_backlog_bytes", "bytes of the samples waiting for the destination", labels=labels
    )
    delivered = CounterMetricFamily("gpu_mapper_push_delivered_samples", "samples the destination took", labels=labels)
    failures = CounterMetricFamily(
        "gpu_mapper_push_failures",
        "writes to the destination that failed and were kept to be sent again",
        labels=labels,
    )
    dropped = CounterMetricFamily(
        "gpu_mapper_push_dropped_samples",
        "samples dropped: refused by the destination, or over the buffer's size or age bounds",
        labels=(*labels, "reason"),
    )
    last_ok = GaugeMetricFamily(
        "gpu_mapper_push_last_success_timestamp_seconds", "Unix time of the last delivered write", labels=labels
    )
    last_error = GaugeMetricFamily(
        "gpu_mapper_push_last_error_info", "1, labelled with the destination's last error", labels=(*labels, "error")
    )
    for d in snap.push_destinations:
        key = [d.key, d.kind]
        for name in PUSH_STATES:
            state.add_metric([*key, name], 1 if d.state == name else 0)
        backlog.add_metric(key, d.backlog_samples)
        backlog_bytes.add_metric(key, d.backlog_bytes)
        delivered.add_metric(key, d.delivered_samples)
        failures.add_metric(key, d.failures)
        for reason, n in sorted(d.dropped.items()):
            dropped.add_metric([*key, reason], n)
        if d.last_success_ms is not None:
            last_ok.add_metric(key, d.last_success_ms / 1000)
        if d.last_error:
            last_error.add_metric([*key, d.last_error[:200]], 1)
    return [state, backlog, backlog_bytes, delivered, failures, dropped, last_ok, last_error]


def _self_metrics(snap: MapperSnapshot) -> list[Metric]:
    """The mapper's own families (``node_series``: what the node stream carries too), labelled with the node."""
    kinds = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily, "histogram": HistogramMetricFamily}
    fams = {f.name: kinds[f.type](f.name, f.doc, labels=f.all_labels) for f in naming.NODE_FAMILIES}
    for family, name, labels, value in node_series(snap):
        fams[family.name].samples.append(PromSample(name, {naming.NODE_LABEL: snap.node, **dict(labels)}, value))
    return list(fams.values())


def _FULL_EXAMPLE() -> MapperSnapshot:
    """A snapshot with every field set, so ``metric_names`` sees every family with samples."""
    values: dict[str, Any] = {p.name: 1 for p in EXPORTED_PROPERTIES}
    values["compute_mode"] = "default"
    gpu = GpuSnapshot(
        info=GpuInfo(uuid="GPU-0", index=0, name="x"),
        device="default/x",
        sample=Sample(uuid="GPU-0", ts_ms=1, values=values),
        policy_state="normal",
        xid_errors={79: 1},
        desired_power_limit_w=1.0,
        health=HealthReport(checks=(CheckResult("inforom", "healthy", "ok", "inforom"),)),
        health_probe=ProbeResult("pass", "", 0.1),
        probes={"pass": 1},
    )
    pod = PodUse("ns", "pod", "c", 1.0, 1.0, 1, 1, 0.5)
    workloads = GpuWorkloads(
        "GPU-0", 1, 1, (ProcessRow(1, "ns", "pod", "c", 1, 0.5, 1.0),), (pod,), 1.0, 1.0, 1.0, leaking_pids=(1,)
    )
    push = DestinationStatus(
        "http http://sink:8080/gpu", "http", "down", 1, 100, 1, 1, {"refused": 1}, "refused (example)", 1, 1
    )
    return MapperSnapshot(node="n", gpus=(gpu,), workloads=(workloads,), push_destinations=(push,))


# --------------------------------------------------------------------------------------------------
# The HTTP endpoints
# --------------------------------------------------------------------------------------------------


class MetricsServer(HttpServer):
    """``/metrics``, ``/healthz``, ``/readyz`` and ``/status`` on ``addr`` (``HOST:PORT``), in a daemon thread.

    ``snapshot`` builds the current ``MapperSnapshot``; ``heartbeats`` lists the loops' last beats (monotonic
    seconds, compared with ``monotonic()``); ``readiness`` says whether NVML is up and EdgeCore registered.
    With ``loop`` given, the three callables run on that asyncio loop (thread-safe reads of the app's state;
    an event loop that does not answer within ``snapshot_timeout_s`` fails ``/healthz``).
    """

    name = "gpu-mapper"
    paths = ("/metrics", "/healthz", "/readyz", "/status")
    callable_name = "the snapshot callable"

    def __init__(
        self,
        addr: str,
        *,
        snapshot: Callable[[], MapperSnapshot],
        heartbeats: Callable[[], Iterable[LoopHeartbeat]] = lambda: (),
        readiness: Callable[[], Readiness] = lambda: Readiness(nvml_initialised=True, dmi_registered=False),
        loop: asyncio.AbstractEventLoop | None = None,
        monotonic: Callable[[], float] | None = None,
        request_timeout_s: float = 10.0,
        snapshot_timeout_s: float = 5.0,
        stall_periods: float = 5.0,
        min_stall_s: float = 10.0,
        web_config_file: str | None = None,
    ) -> None:
        super().__init__(
            addr,
            heartbeats=heartbeats,
            loop=loop,
            monotonic=monotonic,
            request_timeout_s=request_timeout_s,
            call_timeout_s=snapshot_timeout_s,
            stall_periods=stall_periods,
            min_stall_s=min_stall_s,
            web_config_file=web_config_file,
        )
        self._snapshot = snapshot
        self._readiness = readiness
        self._registry = build_registry(lambda: self.call(self._snapshot))
        self._renderer = TextRenderer()

    def route(self, path: str, query: dict[str, list[str]]) -> Answer | None:
        if path == "/metrics":
            try:
                return 200, CONTENT_TYPE_LATEST, render_metrics(self._registry, self._renderer)
            except TransientError as exc:
                return 503, TEXT, f"metrics unavailable: {exc}\n".encode()
        if path == "/readyz":
            try:
                ready = self.call(self._readiness)
            except TransientError as exc:
                return 503, TEXT, f"not ready: {exc}\n".encode()
            problems = ready.problems()
            if problems:
                return 503, TEXT, ("not ready: " + "; ".join(problems) + "\n").encode()
            mode = "standalone" if ready.standalone else "registered with EdgeCore"
            degraded = "".join(f"; degraded: {d}" for d in ready.degraded)
            return 200, TEXT, f"ready ({mode}){degraded}\n".encode()
        if path == "/status":
            try:
                snap = self.call(self._snapshot)
            except TransientError as exc:
                return 503, TEXT, f"status unavailable: {exc}\n".encode()
            if query.get("format", [""])[0] == "text":
                wide = query.get("wide", [""])[0] in ("1", "true")
                return 200, TEXT, render_status(snap, wide=wide).encode()
            return 200, "application/json", snap.to_json().encode()
        return None


# --------------------------------------------------------------------------------------------------
# Reading a snapshot back (gpu-mapper status)
# --------------------------------------------------------------------------------------------------


def fetch_status(url: str, *, timeout_s: float = 5.0) -> MapperSnapshot:
    """GET ``<url>/status`` from a running mapper (``url`` like ``http://127.0.0.1:9100``).

    Raises ``TransientError`` when the mapper cannot be reached, ``SnapshotFormatError`` on a bad answer."""
    base = url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ConfigError(f"status url {url!r}: expected http://HOST:PORT")
    target = base if base.endswith("/status") else base + "/status"
    try:
        with urllib.request.urlopen(target, timeout=timeout_s) as resp:
            body = resp.read(64 * 1024 * 1024)
    except urllib.error.HTTPError as exc:
        raise TransientError(f"{target}: HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise TransientError(f"{target}: cannot reach the mapper ({reason})") from None
    return MapperSnapshot.from_json(body)


def status_file_path(data_dir: str | os.PathLike[str]) -> Path:
    return Path(data_dir) / STATUS_FILE_NAME


def write_status_file(data_dir: str | os.PathLike[str], snap: MapperSnapshot) -> Path:
    """Write the snapshot atomically (temp file + rename) to ``<data_dir>/status.json``."""
    path = status_file_path(data_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".status-", suffix=".json", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(snap.to_json(indent=1))
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def read_status_file(data_dir: str | os.PathLike[str]) -> MapperSnapshot:
    """Read ``<data_dir>/status.json``; ``NotFoundError`` names the path when there is none."""
    path = status_file_path(data_dir)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise NotFoundError(f"{path}: no status file (is the mapper running with --data-dir {data_dir}?)") from None
    try:
        return MapperSnapshot.from_json(text)
    except SnapshotFormatError as exc:
        raise SnapshotFormatError(f"{path}: {exc}") from None


def read_status(url: str | None = None, data_dir: str | None = None) -> MapperSnapshot:
    """The snapshot of a running mapper (its HTTP /status), or the last one it wrote to its data directory."""
    if data_dir is not None and url is None:
        return read_status_file(data_dir)
    return fetch_status(url or "http://127.0.0.1:9410")
