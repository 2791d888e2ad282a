"""The Prometheus naming table: every per-GPU series name, type, help text and label set, in ONE place (pure).

Two writers read it: the mapper's own ``/metrics`` (``mapper.edge.status.metrics``) and the cloud-side bridge
(``mapper.bridge.app``, MQTT telemetry -> remote write). So a series is called the same whether a Prometheus scrapes
the edge node or the bridge writes the node's telemetry into a store, and a name is changed in one line.

* ``PROPERTY_SERIES``: the catalog properties with a Prometheus name (``PropertySpec.prom_name``, in base units:
  ``prom_scale`` turns the catalog value into the base unit), one numeric series each.
* ``GPU_INFO``, ``CLOCK_EVENT_REASON``, ``COMPUTE_MODE``, ``POLICY_STATE``, ...: the families derived from other
  values (``clock_event_reason_flags`` and ``compute_mode_flags`` say how), or from the mapper's own state.
* ``GPU_LABELS``: the labels every per-GPU series carries. The bridge cannot fill ``gpu`` (the NVML index is not
  in the telemetry stream; identity is the uuid) and leaves it absent, as remote write's empty value means.
* ``NODE_FAMILIES``: the mapper's own health (``gpu_mapper_build_info``, the buffer, the links, desired state,
  policies, collection), one set per node, labelled ``node``: ``/metrics`` shows them and the mapper's node stream
  carries them to the bridge (``sample_key``: a sample's name and labels as one telemetry series name;
  ``node_sample`` reads one back, for the families of this table only).
* ``health_samples``: a GPU's health families from its health levels, subsystems, checks and probe (``/metrics``
  and the bridge, which reads them from the GPU's state message).
* ``BRIDGE_JOB``: the ``job`` label the bridge gives every series it writes, so that a store that also scrapes
  the mapper tells the two copies apart (docs/operations.md, "Scraping and bridging at once").
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from mapper.shared.model import CLOCK_EVENT_REASONS, COMPUTE_MODES, PROPERTIES, PromType, PropertySpec

#: Labels of every per-GPU series.
GPU_LABELS = ("uuid", "gpu", "device", "node")
#: The label of every series of the mapper itself (``NODE_FAMILIES``): the node it runs on.
NODE_LABEL = "node"
#: The ``job`` label of every series the bridge writes (a scrape gives its own job name to what it scrapes).
BRIDGE_JOB = "gpu-mapper-bridge"

FamilyType = PromType | Literal["histogram"]


@dataclass(frozen=True)
class Family:
    """One metric family: its name as prometheus_client takes it, its type, help text and extra labels."""

    name: str
    type: FamilyType
    doc: str
    #: Labels after ``GPU_LABELS`` (per-GPU families) or after ``NODE_LABEL`` (``per_gpu=False``: the mapper's own).
    labels: tuple[str, ...] = ()
    per_gpu: bool = True

    @property
    def series_name(self) -> str:
        """The name of its samples (the ``__name__`` a store sees): counters end in ``_total``."""
        if self.type == "counter" and not self.name.endswith("_total"):
            return self.name + "_total"
        return self.name

    @property
    def all_labels(self) -> tuple[str, ...]:
        return (*GPU_LABELS, *self.labels) if self.per_gpu else (NODE_LABEL, *self.labels)


@dataclass(frozen=True)
class PropertySeries:
    """A catalog property exported as one numeric series: value * ``scale`` in the base unit."""

    spec: PropertySpec
    family: Family

    @property
    def scale(self) -> float:
        return self.spec.prom_scale


def _property_doc(spec: PropertySpec) -> str:
    return f"{spec.description} ({spec.name}" + (f", {spec.unit}" if spec.unit else "") + ")"


PROPERTY_SERIES: tuple[PropertySeries, ...] = tuple(
    PropertySeries(p, Family(p.prom_name, p.prom_type, _property_doc(p))) for p in PROPERTIES if p.prom_name
)

GPU_INFO = Family(
    "gpu_info",
    "gauge",
    "GPU identity: always 1, labelled with the product name, driver version and PCI bus id",
    ("product_name", "driver_version", "pci_bus_id"),
)
CLOCK_EVENT_REASON = Family(
    "gpu_clock_event_reason_active",
    "gauge",
    "1 while the clock event reason holds the clocks back (one series per nvmlClocksEventReason bit)",
    ("reason",),
)
COMPUTE_MODE = Family("gpu_compute_mode", "gauge", "1 for the compute mode in force, 0 for the others", ("mode",))
XID_ERRORS = Family(
    "gpu_xid_errors", "counter", "XID events seen on the GPU since the mapper started, by XID code", ("xid",)
)
DESIRED_POWER_LIMIT = Family(
    "gpu_power_limit_desired_watts",
    "gauge",
    "power cap asked for by the cloud or an edge application, before local policies",
)
DEVICE_STATE = Family(
    "gpu_mapper_device_state", "gauge", "1 for the device state last reported to EdgeCore, 0 for the others", ("state",)
)
POLICY_STATE = Family(
    "gpu_mapper_policy_state",
    "gauge",
    "1, labelled with what the local policies are doing on the GPU (the policy_state twin)",
    ("state",),
)
SAMPLE_TIMESTAMP = Family("gpu_mapper_sample_timestamp_seconds", "gauge", "Unix time of the GPU's latest sample")
HEALTH_STATUS = Family(
    "gpu_mapper_health_status",
    "gauge",
    "1 for the GPU's health (healthy, degraded, unhealthy) per level (0: overall, 1: node, 2: driver, 3: CUDA "
    "probe), 0 for the others",
    ("level", "status"),
)
HEALTH_SUBSYSTEM = Family(
    "gpu_mapper_health_subsystem_status",
    "gauge",
    "1 for each health subsystem's status (pcie, nvlink, memory, thermal, power, driver, inforom, engine, cuda), "
    "0 for the others",
    ("subsystem", "status"),
)
HEALTH_CHECK = Family(
    "gpu_mapper_health_check_status",
    "gauge",
    "1 for each level-2 driver check's verdict, 0 for the others",
    ("check", "status"),
)
HEALTH_PROBE_LATENCY = Family(
    "gpu_mapper_health_probe_latency_seconds", "gauge", "how long the GPU's last CUDA probe took"
)
HEALTH_PROBE_SUCCESS = Family(
    "gpu_mapper_health_probe_success", "gauge", "1 when the GPU's last CUDA probe passed (pass or slow), else 0"
)
HEALTH_PROBES = Family("gpu_mapper_health_probes", "counter", "CUDA probes run on the GPU, by outcome", ("outcome",))
INFOROM_INFO = Family(
    "gpu_inforom_info",
    "gauge",
    "the GPU's InfoROM: always 1, labelled with its image and object versions (N/A where not reported)",
    ("image_version", "oem_version", "ecc_version", "power_version"),
)

#: The statuses of a health family (``HEALTH_STATUS``, ``HEALTH_SUBSYSTEM``, ``HEALTH_CHECK``), one series each.
HEALTH_STATUSES = ("healthy", "degraded", "unhealthy")
#: The InfoROM versions ``INFOROM_INFO`` is labelled with, in its label order.
INFOROM_VERSIONS = INFOROM_INFO.labels

HealthSample = tuple[Family, tuple[str, ...], float]


def health_samples(
    levels: Iterable[tuple[int, str]],
    subsystems: Iterable[tuple[str, str]],
    checks: Iterable[tuple[str, str]],
    probe: tuple[bool, float | None] | None = None,
    probes: Iterable[tuple[str, int]] = (),
    inforom: Sequence[str] | None = None,
) -> Iterator[HealthSample]:
    """A GPU's health families, each sample as (family, its labels after ``GPU_LABELS``, value): the status of
    each level (0: overall, 1, 2, 3), subsystem and level-2 check as 1 for its status and 0 for the others; the
    last CUDA probe (``probe``: passed, latency in s; None when none ran or it was skipped); the probes run by
    outcome; the InfoROM versions (``inforom``, ``INFOROM_VERSIONS`` in order; None without an InfoROM check).
    ``/metrics`` and the bridge (from the GPU's state message) both write these."""
    for table, family in ((levels, HEALTH_STATUS), (subsystems, HEALTH_SUBSYSTEM), (checks, HEALTH_CHECK)):
        for name, current in table:
            for s in HEALTH_STATUSES:
                yield family, (str(name), s), 1.0 if current == s else 0.0
    if probe is not None:
        passed, latency_s = probe
        yield HEALTH_PROBE_SUCCESS, (), 1.0 if passed else 0.0
        if latency_s is not None:
            yield HEALTH_PROBE_LATENCY, (), float(latency_s)
    for outcome, n in sorted(probes):
        yield HEALTH_PROBES, (outcome,), float(n)
    if inforom is not None:
        yield INFOROM_INFO, tuple(inforom), 1.0


#: Property values the derived families read (the property names of the catalog).
CLOCK_EVENT_REASONS_PROPERTY = "clock_event_reasons"
COMPUTE_MODE_PROPERTY = "compute_mode"
PRODUCT_NAME_PROPERTY = "product_name"
POLICY_STATE_PROPERTY = "policy_state"


def device_label(device: str) -> str:
    """The ``device`` label of a KubeEdge Device ``namespace/name``: its name, without the namespace."""
    return device.rsplit("/", 1)[-1]


def number(v: object) -> float | None:
    """A property value as a Prometheus sample value: booleans 0/1, finite numbers as floats, else None."""
    if isinstance(v, bool):
        return 1.0 if v else 0.0
    if isinstance(v, int | float) and math.isfinite(v):
        return float(v)
    return None


def clock_event_reason_flags(mask: int) -> Iterator[tuple[str, int]]:
    """(reason, 1 or 0) for every known nvmlClocksEventReason bit of ``mask`` (``CLOCK_EVENT_REASON``)."""
    for bit, name in CLOCK_EVENT_REASONS:
        yield name, 1 if mask & bit else 0


def compute_mode_flags(mode: str) -> Iterator[tuple[str, int]]:
    """(mode, 1 or 0) for every compute mode, 1 for ``mode`` (``COMPUTE_MODE``); nothing for an unknown mode."""
    if mode in COMPUTE_MODES:
        for m in COMPUTE_MODES:
            yield m, 1 if m == mode else 0


# --------------------------------------------------------------------------------------------------
# Who uses the GPU (the process cycle, ``mapper.edge.processes.monitor``; docs/processes.md)
# --------------------------------------------------------------------------------------------------

#: Labels of a process series after ``GPU_LABELS``: the host pid (``other`` for the row summing the processes
#: past the top N) and what it belongs to ("" where unknown; a host process has all three empty).
PROCESS_LABELS = ("pid", "namespace", "pod", "container")
#: Labels of a workload (container) series after ``GPU_LABELS``; ``pod="other"`` sums those past the bound.
POD_LABELS = ("namespace", "pod", "container")

PROCESS_MEMORY = Family(
    "gpu_process_memory_used_bytes",
    "gauge",
    "GPU memory a process holds (the top N processes by SM share and by memory, the rest summed as other)",
    PROCESS_LABELS,
)
PROCESS_SM = Family(
    "gpu_process_sm_utilization_ratio",
    "gauge",
    "share of the GPU's time a process had kernels on the SMs over the last process cycle (0-1)",
    PROCESS_LABELS,
)
PROCESSES = Family("gpu_processes", "gauge", "processes running on the GPU (compute and graphics)")
POD_ENERGY = Family(
    "gpu_pod_energy_joules",
    "counter",
    "GPU energy attributed to a container by its SM share, the idle part excluded (docs/processes.md)",
    POD_LABELS,
)
POD_POWER = Family(
    "gpu_pod_power_watts", "gauge", "GPU power attributed to a container over the last process cycle", POD_LABELS
)
POD_MEMORY = Family("gpu_pod_memory_used_bytes", "gauge", "GPU memory the processes of a container hold", POD_LABELS)
POD_SM = Family(
    "gpu_pod_sm_utilization_ratio",
    "gauge",
    "SM share of the processes of a container over the last process cycle (0-1)",
    POD_LABELS,
)
IDLE_ENERGY = Family(
    "gpu_idle_energy_joules", "counter", "GPU energy counted as idle (the GPU's power at no load), given to no pod"
)
IDLE_POWER = Family("gpu_idle_power_watts", "gauge", "the GPU's idle power the attribution uses")
UNATTRIBUTED_ENERGY = Family(
    "gpu_unattributed_energy_joules", "counter", "active GPU energy of intervals in which no process was seen"
)
LEAK_SUSPECTED = Family(
    "gpu_process_memory_leak_suspected",
    "gauge",
    "1 for a process whose GPU memory floor kept rising over the leak window (a signal only)",
    PROCESS_LABELS,
)

#: The telemetry series of a workload's use of a GPU: ``pod:<field>:<namespace>/<pod>/<container>`` (names
#: cannot hold ``/`` or ``:``), each field a family above, in its base unit.
POD_TELEMETRY_PREFIX = "pod:"
POD_TELEMETRY_FIELDS: dict[str, Family] = {
    "energy": POD_ENERGY,
    "power": POD_POWER,
    "memory": POD_MEMORY,
    "sm": POD_SM,
}


#: The GPU-wide telemetry series of the process cycle, each a family above (plain numbers in base units).
PROCESS_GPU_SERIES: dict[str, Family] = {
    "processes_count": PROCESSES,
    "processes_idle_energy": IDLE_ENERGY,
    "processes_unattributed_energy": UNATTRIBUTED_ENERGY,
    "processes_idle_power": IDLE_POWER,
}

#: The telemetry series of a process suspected of leaking GPU memory: ``leak:<pid>:<namespace>/<pod>/<container>``
#: (1 while suspected, absent after; an owner not known is three empty names), ``LEAK_SUSPECTED`` on the bridge.
LEAK_TELEMETRY_PREFIX = "leak:"


def pod_series(field: str, namespace: str, pod: str, container: str) -> str:
    """The telemetry series name of one field of one workload (``POD_TELEMETRY_FIELDS``)."""
    return f"{POD_TELEMETRY_PREFIX}{field}:{namespace}/{pod}/{container}"


def parse_pod_series(name: str) -> tuple[Family, str, str, str] | None:
    """``(family, namespace, pod, container)`` of a ``pod_series`` name, None for any other name."""
    if not name.startswith(POD_TELEMETRY_PREFIX):
        return None
    field, sep, who = name[len(POD_TELEMETRY_PREFIX) :].partition(":")
    family = POD_TELEMETRY_FIELDS.get(field)
    parts = who.split("/")
    if family is None or not sep or len(parts) != 3:
        return None
    return family, parts[0], parts[1], parts[2]


def leak_series(pid: int, namespace: str, pod: str, container: str) -> str:
    """The telemetry series name of a process suspected of leaking (``LEAK_TELEMETRY_PREFIX``)."""
    return f"{LEAK_TELEMETRY_PREFIX}{pid}:{namespace}/{pod}/{container}"


def parse_leak_series(name: str) -> tuple[str, str, str, str] | None:
    """``(pid, namespace, pod, container)`` of a ``leak_series`` name, None for any other name."""
    if not name.startswith(LEAK_TELEMETRY_PREFIX):
        return None
    pid, sep, who = name[len(LEAK_TELEMETRY_PREFIX) :].partition(":")
    parts = who.split("/")
    if not pid.isdigit() or not sep or len(parts) != 3:
        return None
    return pid, parts[0], parts[1], parts[2]


# --------------------------------------------------------------------------------------------------
# The mapper itself: its own health, one set per node (``/metrics`` and the node stream to the bridge)
# --------------------------------------------------------------------------------------------------


def _node(name: str, type: FamilyType, doc: str, labels: tuple[str, ...] = ()) -> Family:
    return Family(name, type, doc, labels, per_gpu=False)


BUILD_INFO = _node(
    "gpu_mapper_build_info", "gauge", "always 1, labelled with the mapper version, mode and node", ("version", "mode")
)
GPUS = _node("gpu_mapper_gpus", "gauge", "GPUs the mapper sees on this node")
BUFFER_BYTES = _node("gpu_mapper_buffer_bytes", "gauge", "bytes of telemetry batches waiting in the offline buffer")
BUFFER_BATCHES = _node("gpu_mapper_buffer_batches", "gauge", "telemetry batches waiting in the offline buffer")
BUFFER_MAX_BYTES = _node("gpu_mapper_buffer_max_bytes", "gauge", "size cap of the offline buffer")
BUFFER_OLDEST_AGE = _node(
    "gpu_mapper_buffer_oldest_unsent_age_seconds",
    "gauge",
    "age of the oldest batch not yet acknowledged by the broker (0 when the buffer is empty)",
)
BUFFER_DROPPED = _node(
    "gpu_mapper_buffer_dropped_batches",
    "counter",
    "telemetry batches dropped from the offline buffer, by reason",
    ("reason",),
)
BUFFER_DROPPED_SAMPLES = _node(
    "gpu_mapper_buffer_dropped_samples",
    "counter",
    "samples (one GPU's readings at one time) in the telemetry batches dropped from the offline buffer, by reason",
    ("reason",),
)
BUFFER_MEMORY_BATCHES = _node(
    "gpu_mapper_buffer_memory_batches",
    "gauge",
    "telemetry batches kept in memory because the data dir cannot take them",
)
DEGRADED = _node(
    "gpu_mapper_degraded",
    "gauge",
    "1 while the mapper runs degraded, by reason (data dir full, data dir read-only, ...); 0 without a reason while "
    "nothing does",
    ("reason",),
)
REPLAY_REMAINING_BATCHES = _node(
    "gpu_mapper_replay_remaining_batches", "gauge", "batches still to replay after a reconnect"
)
REPLAY_REMAINING_BYTES = _node("gpu_mapper_replay_remaining_bytes", "gauge", "bytes still to replay after a reconnect")
PUBLISHED_BATCHES = _node(
    "gpu_mapper_telemetry_published_batches", "counter", "telemetry batches acknowledged by the broker"
)
PUBLISHED_BYTES = _node(
    "gpu_mapper_telemetry_published_bytes", "counter", "bytes of telemetry batches acknowledged by the broker"
)
MQTT_ENABLED = _node("gpu_mapper_mqtt_enabled", "gauge", "1 when a broker is configured")
MQTT_CONNECTED = _node("gpu_mapper_mqtt_connected", "gauge", "1 while the MQTT session is up")
MQTT_RECONNECTS = _node("gpu_mapper_mqtt_reconnects", "counter", "MQTT reconnects since the mapper started")
MQTT_INBOUND_DROPPED = _node(
    "gpu_mapper_mqtt_inbound_dropped",
    "counter",
    "messages from the broker (deltas, membership updates) dropped at the door, by reason",
    ("reason",),
)
MQTT_INBOUND_DEFERRED = _node(
    "gpu_mapper_mqtt_inbound_deferred",
    "counter",
    "desired values from the broker that waited for their device's inbound rate (applied once it allowed, or "
    "superseded by a newer value while they waited)",
)
DMI_REGISTERED = _node(
    "gpu_mapper_dmi_registered", "gauge", "1 while registered with EdgeCore over DMI (always 0 in standalone mode)"
)
STANDALONE = _node("gpu_mapper_standalone", "gauge", "1 in standalone mode (Devices from files)")
DMI_RPCS = _node("gpu_mapper_dmi_rpcs", "counter", "DMI calls to EdgeCore by method and result", ("method", "result"))
RECONCILE_ACTIONS = _node(
    "gpu_mapper_reconcile_actions", "counter", "desired-state actions by property and result", ("property", "result")
)
DRIFT_REAPPLIES = _node(
    "gpu_mapper_drift_reapplies",
    "counter",
    "settings found changed behind the mapper's back and applied again, by property",
    ("property",),
)
DESIRED_REJECTIONS = _node("gpu_mapper_desired_rejections", "counter", "desired values refused, by reason", ("reason",))
POLICY_OVERRIDES_ACTIVE = _node(
    "gpu_mapper_policy_overrides_active",
    "gauge",
    "GPUs on which a local policy holds an override now, by policy",
    ("policy",),
)
POLICY_EVENTS = _node(
    "gpu_mapper_policy_events", "counter", "local policy decisions by policy and action", ("policy", "action")
)
COLLECT_DURATION = _node(
    "gpu_mapper_collect_duration_seconds", "histogram", "time to sample every GPU of the node once"
)
COLLECT_ERRORS = _node("gpu_mapper_collect_errors", "counter", "failed GPU samples, by reason", ("reason",))
PROCESS_ERRORS = _node(
    "gpu_mapper_process_errors", "counter", "process cycles of a GPU that failed, by reason", ("reason",)
)
COLLECT_LATENESS = _node(
    "gpu_mapper_collect_lateness_seconds",
    "histogram",
    "how long after its due time each GPU's sample was read (other GPUs' reads, the NVML worker, the event loop)",
)
COLLECT_BEHIND = _node(
    "gpu_mapper_collect_behind_other_gpus_seconds",
    "histogram",
    "the part of a GPU sample's lateness spent behind the other GPUs' reads in the same collect round",
)
CONFIG_ERRORS = _node(
    "gpu_mapper_config_errors",
    "counter",
    "configuration inputs refused (a devices file that does not parse, a Device that does not convert or validate, "
    "a config file edit), by source; the Devices they name keep their previous version",
    ("source",),
)
CONFIG_REFUSED = _node(
    "gpu_mapper_config_refused",
    "gauge",
    "configuration inputs that stand refused now, by source (see /status, config.refused)",
    ("source",),
)

#: Every family of the mapper itself, in the order ``/metrics`` shows them.
NODE_FAMILIES: tuple[Family, ...] = (
    BUILD_INFO,
    GPUS,
    BUFFER_BYTES,
    BUFFER_BATCHES,
    BUFFER_MAX_BYTES,
    BUFFER_OLDEST_AGE,
    BUFFER_DROPPED,
    BUFFER_DROPPED_SAMPLES,
    BUFFER_MEMORY_BATCHES,
    DEGRADED,
    REPLAY_REMAINING_BATCHES,
    REPLAY_REMAINING_BYTES,
    PUBLISHED_BATCHES,
    PUBLISHED_BYTES,
    MQTT_ENABLED,
    MQTT_CONNECTED,
    MQTT_RECONNECTS,
    MQTT_INBOUND_DROPPED,
    MQTT_INBOUND_DEFERRED,
    DMI_REGISTERED,
    STANDALONE,
    DMI_RPCS,
    RECONCILE_ACTIONS,
    DRIFT_REAPPLIES,
    DESIRED_REJECTIONS,
    POLICY_OVERRIDES_ACTIVE,
    POLICY_EVENTS,
    COLLECT_DURATION,
    COLLECT_LATENESS,
    COLLECT_BEHIND,
    COLLECT_ERRORS,
    PROCESS_ERRORS,
    CONFIG_ERRORS,
    CONFIG_REFUSED,
)

#: A sample of a family of the mapper itself: (family, sample name, labels after ``NODE_LABEL``, value).
NodeSample = tuple[Family, str, tuple[tuple[str, str], ...], float]

#: The label of a histogram's buckets.
BUCKET_LABEL = "le"


def le_text(bound: float) -> str:
    """A bucket's upper bound as Prometheus writes it: ``0.005``, ``1.0``, ``+Inf``."""
    return "+Inf" if bound == math.inf else repr(float(bound))


def histogram_samples(
    family: Family, cumulative: Iterable[tuple[float, int]], sum_value: float
) -> Iterator[NodeSample]:
    """A histogram family's samples: ``_bucket{le}`` (``cumulative``: (bound, count up to it), ending with inf),
    ``_sum`` and ``_count``."""
    count = 0.0
    for bound, n in cumulative:
        count = float(n)
        yield family, family.name + "_bucket", ((BUCKET_LABEL, le_text(bound)),), count
    yield family, family.name + "_sum", (), float(sum_value)
    yield family, family.name + "_count", (), count


def node_samples(family: Family, values: Mapping[tuple[str, ...], float] | float) -> Iterator[NodeSample]:
    """A gauge or counter family of the mapper itself as samples: one value (a family without labels) or values
    by their label values (in the family's label order), sorted."""
    name = family.series_name
    if not isinstance(values, Mapping):
        yield family, name, (), float(values)
        return
    for key, v in sorted(values.items()):
        yield family, name, tuple(zip(family.labels, key, strict=True)), float(v)


#: sample name -> (family, the labels its samples carry after ``NODE_LABEL``), for ``node_sample``.
_NODE_SAMPLES: dict[str, tuple[Family, tuple[str, ...]]] = {}
for _f in NODE_FAMILIES:
    if _f.type == "histogram":
        _NODE_SAMPLES[_f.name + "_bucket"] = (_f, (*_f.labels, BUCKET_LABEL))
        _NODE_SAMPLES[_f.name + "_sum"] = (_f, _f.labels)
        _NODE_SAMPLES[_f.name + "_count"] = (_f, _f.labels)
    else:
        _NODE_SAMPLES[_f.series_name] = (_f, _f.labels)


def node_sample_families() -> dict[str, Family]:
    """Every sample name of the mapper's own families (counters with ``_total``, histograms' three parts) -> its
    family."""
    return {name: family for name, (family, _) in _NODE_SAMPLES.items()}


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def sample_key(name: str, labels: Sequence[tuple[str, str]] = ()) -> str:
    """One sample's name and labels as one telemetry series name, in the Prometheus text format's spelling:
    ``gpu_mapper_gpus``, ``gpu_mapper_dmi_rpcs_total{method="GetDevice",result="ok"}`` (labels in the order
    given, values escaped as the text format escapes them)."""
    if not labels:
        return name
    return name + "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels) + "}"


_KEY_RE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?", re.DOTALL)
_PAIR_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"(,|$)', re.DOTALL)
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def parse_sample_key(key: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    """``sample_key``'s (name, labels) back; ValueError for a text that is not one."""
    m = _KEY_RE.fullmatch(key)
    if m is None:
        raise ValueError(f"{key[:80]!r} is not a sample name with labels")
    name, body = m.group(1), m.group(2)
    if body is None:
        return name, ()
    labels: list[tuple[str, str]] = []
    pos = 0
    while pos < len(body):
        pair = _PAIR_RE.match(body, pos)
        if pair is None:
            raise ValueError(f"{key[:80]!r}: bad labels at {body[pos : pos + 20]!r}")
        value = re.sub(r"\\.", lambda e: _UNESCAPE.get(e.group(0), e.group(0)), pair.group(2))
        labels.append((pair.group(1), value))
        pos = pair.end()
    if not labels:
        raise ValueError(f"{key[:80]!r}: empty label braces")
    return name, tuple(labels)


def node_sample(key: str) -> tuple[Family, str, tuple[tuple[str, str], ...]] | None:
    """(family, sample name, labels) of a telemetry series name of the node stream (``sample_key``), None when it
    names no sample of ``NODE_FAMILIES`` with exactly that family's labels (a newer mapper's family, or not one)."""
    try:
        name, labels = parse_sample_key(key)
    except ValueError:
        return None
    known = _NODE_SAMPLES.get(name)
    if known is None or tuple(k for k, _ in labels) != known[1]:
        return None
    return known[0], name, labels


#: The device name of the mapper's own stream (its batches' header; no KubeEdge Device can be called so:
#: ``_node`` is no valid namespace) and the uuid it carries (none).
NODE_DEVICE = "_node/gpu-mapper"
