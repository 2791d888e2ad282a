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
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from mapper.shared.model import CLOCK_EVENT_REASONS, COMPUTE_MODES, PROPERTIES, PromType, PropertySpec

#: Labels of every per-GPU series.
GPU_LABELS = ("uuid", "gpu", "device", "node")


@dataclass(frozen=True)
class Family:
    """One metric family: its name as prometheus_client takes it, its type, help text and extra labels."""

    name: str
    type: PromType
    doc: str
    #: Labels after ``GPU_LABELS`` (per-GPU families) or the only labels (``per_gpu=False``).
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
        return (*GPU_LABELS, *self.labels) if self.per_gpu else self.labels


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
