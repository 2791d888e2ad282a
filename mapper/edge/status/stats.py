"""What the running mapper looks like right now: plain, frozen values, no I/O.

``mapper.edge.status.source`` builds a ``MapperSnapshot`` on demand from the running parts (a callable handed
to ``mapper.edge.status.metrics``); the Prometheus collector, the ``/status`` endpoint, the data-dir status file
and ``gpu-mapper status`` all read it. Every self-metric the mapper exports has a field here, so nothing is ever
read twice from the hardware. This module knows the values only, not the loops that make them.

Also here, because it is a pure decision on plain values: the readiness rule (``Readiness.problems``; the
liveness rule is the HTTP server's, ``mapper.net.http.check_liveness``). A GPU's part of the snapshot gives its
device's retained state message (``GpuSnapshot.state_message``, written by ``mapper.wire.state``).

JSON (``to_json``/``from_json``) is the wire format of ``/status`` and the at-rest format of the status file.
Counters keyed by a tuple (``dmi_rpcs[(method, result)]``) are written as lists ``[method, result, count]``.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mapper.edge.health.checks import HEALTHY_REPORT, STATUSES, SUBSYSTEMS, CheckResult, HealthReport, ProbeResult
from mapper.edge.kubeedge.registry import CONFIG_SOURCES, ConfigProblem
from mapper.edge.processes.monitor import GpuWorkloads, PodUse, ProcessRow
from mapper.edge.push.destination import STATES as PUSH_STATES
from mapper.edge.push.destination import DestinationStatus
from mapper.shared.model import DEVICE_STATES, GpuInfo, Sample, Value
from mapper.shared.naming import INFOROM_VERSIONS
from mapper.wire.state import GpuHealth, GpuStatus, state_payload

#: Version of the JSON layout written by ``MapperSnapshot.to_json``.
SNAPSHOT_FORMAT = 1

#: File name of the snapshot the app writes into its data directory (read by ``gpu-mapper status --data-dir``).
STATUS_FILE_NAME = "status.json"

#: Default bucket bounds of the collect-duration histogram, in seconds (one GPU sample is ~100 us on the
#: simulator and a few ms on real NVML; a slow or hung call shows up in the top buckets).
DEFAULT_DURATION_BOUNDS_S: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
#: Bucket bounds of the collect-lateness histogram, in seconds: how long after its due time a GPU's sample was
#: read (the target is a p99 of at most 50 ms, docs/benchmarks.md).
LATENESS_BOUNDS_S: tuple[float, ...] = (
    0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0,
)  # fmt: skip


class SnapshotFormatError(ValueError):
    """A status document that is not a valid ``MapperSnapshot`` JSON; the message names the field."""


# --------------------------------------------------------------------------------------------------
# Values
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DurationHistogram:
    """A small fixed-bucket histogram. ``counts[i]`` counts observations ``<= bounds_s[i]`` and above the
    previous bound (not cumulative); ``counts[-1]`` counts those above the last bound."""

    bounds_s: tuple[float, ...] = DEFAULT_DURATION_BOUNDS_S
    counts: tuple[int, ...] = ()
    sum_s: float = 0.0

    def __post_init__(self) -> None:
        if list(self.bounds_s) != sorted(set(self.bounds_s)) or any(not math.isfinite(b) for b in self.bounds_s):
            raise ValueError(f"histogram bounds must be finite and strictly increasing, got {self.bounds_s}")
        if not self.counts:
            object.__setattr__(self, "counts", (0,) * (len(self.bounds_s) + 1))
        if len(self.counts) != len(self.bounds_s) + 1:
            raise ValueError(f"histogram needs {len(self.bounds_s) + 1} counts, got {len(self.counts)}")
        if any(c < 0 for c in self.counts):
            raise ValueError("histogram counts must not be negative")

    @property
    def count(self) -> int:
        return sum(self.counts)

    def observe(self, seconds: float) -> DurationHistogram:
        """A new histogram with one more observation (the original is unchanged)."""
        i = bisect.bisect_left(self.bounds_s, seconds)
        counts = list(self.counts)
        counts[i] += 1
        # Built without ``__post_init__``: the bounds were checked when this histogram was made, and the counts
        # only grow (observed once per GPU tick, so the checks would cost more than the observation).
        new = object.__new__(DurationHistogram)
        object.__setattr__(new, "bounds_s", self.bounds_s)
        object.__setattr__(new, "counts", tuple(counts))
        object.__setattr__(new, "sum_s", self.sum_s + seconds)
        return new

    def cumulative(self) -> list[tuple[float, int]]:
        """Prometheus-style ``(upper bound, cumulative count)`` pairs, ending with ``inf``."""
        out: list[tuple[float, int]] = []
        running = 0
        for bound, c in zip((*self.bounds_s, math.inf), self.counts, strict=True):
            running += c
            out.append((bound, running))
        return out


@dataclass(frozen=True)
class GpuSnapshot:
    """One GPU of this node as the mapper sees it now."""

    info: GpuInfo
    #: The KubeEdge Device bound to this GPU as ``namespace/name``; "" when no Device names its UUID.
    device: str = ""
    node: str = ""
    #: The latest sample (values in catalog units); None before the first one.
    sample: Sample | None = None
    #: The ``desired_status`` twin value ("" when nothing is desired).
    desired_status: str = ""
    #: The ``policy_state`` twin value ("" or e.g. ``normal``, ``thermal:throttling-step2``).
    policy_state: str = ""
    #: Device state last reported to EdgeCore: one of ``mapper.shared.model.DEVICE_STATES``.
    state: str = "unknown"
    #: XID events seen on this GPU since the mapper started, by XID code.
    xid_errors: Mapping[int, int] = field(default_factory=dict)
    #: The power cap the cloud (or the edge) asked for, before any policy override; None when unset.
    desired_power_limit_w: float | None = None
    #: The three health levels (the ``health`` twin), the last CUDA probe and the probes run, by outcome.
    health: HealthReport = HEALTHY_REPORT
    health_probe: ProbeResult | None = None
    probes: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.state not in DEVICE_STATES:
            raise ValueError(f"GPU {self.info.uuid}: state {self.state!r} is not one of {', '.join(DEVICE_STATES)}")

    @property
    def device_name(self) -> str:
        """The Device name without its namespace ("" when unbound)."""
        return self.device.rsplit("/", 1)[-1]

    def value(self, name: str) -> Value | None:
        if self.sample is None:
            return None
        return self.sample.values.get(name)

    def health_status(self) -> GpuHealth:
        """The GPU's health as ``/metrics`` shows it and its state message carries it: the status of the overall
        verdict (level 0) and of each level, of every subsystem and of the latest driver checks, the last CUDA
        probe (none when skipped), the probes run and the InfoROM versions (``N/A`` where not reported)."""
        h = self.health
        inforom = next((dict(c.detail) for c in h.checks if c.name == "inforom"), None)
        probe = self.health_probe
        return GpuHealth(
            levels=((0, h.status), *((lv, s) for lv, s, _ in h.levels)),
            subsystems=tuple((name, h.subsystem_status(name)) for name in SUBSYSTEMS),
            checks=tuple((c.name, c.status) for c in h.checks),
            probe=None if probe is None or probe.outcome == "skipped" else (probe.passed, probe.latency_s),
            probes=tuple(sorted(self.probes.items())),
            inforom=None if inforom is None else tuple(inforom.get(k, "N/A") for k in INFOROM_VERSIONS),
        )

    def state_message(self, device: str, *, driver_version: str, at_ms: int, degraded: str = "") -> bytes:
        """The retained state message of ``device`` with this GPU's status (``mapper.wire.state``): what the
        bridge turns into ``gpu_mapper_device_state``, ``gpu_xid_errors_total``, ``gpu_power_limit_desired_watts``,
        the health families and the ``gpu``, ``driver_version`` and ``pci_bus_id`` labels, as the mapper's
        ``/metrics`` shows them.
        ``driver_version``: the node's, for a GPU that does not say its own; ``at_ms``: when the snapshot was
        taken; ``degraded``: what of the mapper runs degraded (``data dir full``), "" when nothing does."""
        i = self.info
        status = GpuStatus(
            at_ms=at_ms,
            state=self.state,
            index=i.index,
            pci_bus_id=i.pci_bus_id,
            driver_version=i.driver_version or driver_version,
            xid_errors=self.xid_errors,
            power_limit_desired_w=self.desired_power_limit_w,
            health=self.health_status(),
            degraded=degraded,
        )
        return state_payload(device, self.sample if self.sample is not None else Sample(i.uuid, 0, {}), status)


@dataclass(frozen=True)
class MapperSnapshot:
    """Everything ``/metrics``, ``/status`` and ``gpu-mapper status`` show, taken at ``taken_at_ms``."""

    node: str
    taken_at_ms: int = 0
    version: str = ""
    #: ``dmi`` (registered with EdgeCore) or ``standalone`` (Devices from files).
    mode: str = "dmi"
    driver_version: str = ""
    gpus: tuple[GpuSnapshot, ...] = ()
    # --- offline buffer (issue 5) ---
    buffer_bytes: int = 0
    buffer_batches: int = 0
    buffer_max_bytes: int = 0
    #: Age of the oldest batch not yet acknowledged by the broker; None when the buffer is empty.
    buffer_oldest_age_s: float | None = None
    #: Batches dropped from the buffer, by reason (``size``, ``age``, ``disk_full``, ``unwritable``, ``corrupt``).
    buffer_drops: Mapping[str, int] = field(default_factory=dict)
    #: Samples (rows) in the batches dropped, by reason (``corrupt`` drops are not counted: not read).
    buffer_dropped_samples: Mapping[str, int] = field(default_factory=dict)
    #: Batches the buffer keeps in memory because the data dir cannot take them.
    buffer_memory_batches: int = 0
    #: What runs degraded now (``data dir full``, ``data dir read-only``...); empty when nothing does.
    degraded: tuple[str, ...] = ()
    replay_remaining_batches: int = 0
    replay_remaining_bytes: int = 0
    telemetry_published_batches: int = 0
    telemetry_published_bytes: int = 0
    # --- MQTT ---
    mqtt_enabled: bool = False
    mqtt_connected: bool = False
    mqtt_reconnects: int = 0
    #: Messages from the broker dropped at the door, by reason (``rate-limited``, ``too-large``, ``superseded``,
    #: ``refused``).
    mqtt_inbound_dropped: Mapping[str, int] = field(default_factory=dict)
    #: Desired values that waited at the door for their device's rate (applied later, or ``superseded``).
    mqtt_inbound_deferred: int = 0
    # --- DMI (issue 3) ---
    dmi_registered: bool = False
    #: RPCs by (method, result); result is ``ok`` or a short error code (``unavailable``, ``rate_limited``...).
    dmi_rpcs: Mapping[tuple[str, str], int] = field(default_factory=dict)
    # --- desired state (issue 4) ---
    #: Reconcile actions by (property, result): ``applied``, ``failed``, ``rejected``, ``unsupported``...
    reconcile_actions: Mapping[tuple[str, str], int] = field(default_factory=dict)
    #: Settings found changed behind the mapper's back and applied again, by property.
    drift_reapplies: Mapping[str, int] = field(default_factory=dict)
    #: Desired values refused, by reason (``mapper.shared.model.REJECT_REASONS``).
    desired_rejections: Mapping[str, int] = field(default_factory=dict)
    # --- local policies (issue 6) ---
    #: GPUs on which each policy holds an override now (gauge), by policy.
    policy_overrides_active: Mapping[str, int] = field(default_factory=dict)
    #: Policy decisions by (policy, action): ``engage``, ``step``, ``release``, ``dry-run``...
    policy_events: Mapping[tuple[str, str], int] = field(default_factory=dict)
    # --- collection ---
    collect_duration: DurationHistogram = field(default_factory=DurationHistogram)
    #: How long after its due time each GPU's sample was read (``mapper.edge.control.collect.Collector``).
    collect_lateness: DurationHistogram = field(default_factory=lambda: DurationHistogram(LATENESS_BOUNDS_S))
    #: The part of each sample's lateness spent behind the other GPUs' reads in the same round.
    collect_behind: DurationHistogram = field(default_factory=lambda: DurationHistogram(LATENESS_BOUNDS_S))
    #: Failed samples by error reason (``transient``, ``gpu-lost``, ``timeout``...).
    collect_errors: Mapping[str, int] = field(default_factory=dict)
    # --- who uses the GPUs (the process cycle, docs/processes.md) ---
    #: The latest process cycle of each GPU (empty when the cycle is off or has not run yet).
    workloads: tuple[GpuWorkloads, ...] = ()
    #: GPUs whose process cycle failed, by reason.
    process_errors: Mapping[str, int] = field(default_factory=dict)
    # --- configuration refused (a devices file that does not parse, a Device that does not convert) ---
    #: Inputs refused since start, by source (``devices-file``, ``dmi``, ``config-file``).
    config_errors: Mapping[str, int] = field(default_factory=dict)
    #: What stands refused now (the Devices it names keep their previous version).
    config_refused: tuple[ConfigProblem, ...] = ()
    # --- push and DB destinations the Devices name (docs/push.md) ---
    push_destinations: tuple[DestinationStatus, ...] = ()

    def gpu(self, uuid: str) -> GpuSnapshot | None:
        for g in self.gpus:
            if g.info.uuid == uuid:
                return g
        return None

    # ----------------------------------------------------------------------------------------------
    # JSON
    # ----------------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": SNAPSHOT_FORMAT,
            "node": self.node,
            "taken_at_ms": self.taken_at_ms,
            "version": self.version,
            "mode": self.mode,
            "driver_version": self.driver_version,
            "gpus": [_gpu_to_dict(g) for g in self.gpus],
            "buffer": {
                "bytes": self.buffer_bytes,
                "batches": self.buffer_batches,
                "max_bytes": self.buffer_max_bytes,
                "oldest_age_s": self.buffer_oldest_age_s,
                "drops": dict(self.buffer_drops),
                "dropped_samples": dict(self.buffer_dropped_samples),
                "memory_batches": self.buffer_memory_batches,
                "replay_remaining_batches": self.replay_remaining_batches,
                "replay_remaining_bytes": self.replay_remaining_bytes,
                "published_batches": self.telemetry_published_batches,
                "published_bytes": self.telemetry_published_bytes,
            },
            "mqtt": {
                "enabled": self.mqtt_enabled,
                "connected": self.mqtt_connected,
                "reconnects": self.mqtt_reconnects,
                "inbound_dropped": dict(self.mqtt_inbound_dropped),
                "inbound_deferred": self.mqtt_inbound_deferred,
            },
            "dmi": {"registered": self.dmi_registered, "rpcs": _pairs_out(self.dmi_rpcs)},
            "desired": {
                "reconcile_actions": _pairs_out(self.reconcile_actions),
                "drift_reapplies": dict(self.drift_reapplies),
                "rejections": dict(self.desired_rejections),
            },
            "policy": {
                "overrides_active": dict(self.policy_overrides_active),
                "events": _pairs_out(self.policy_events),
            },
            "collect": {
                "duration": {
                    "bounds_s": list(self.collect_duration.bounds_s),
                    "counts": list(self.collect_duration.counts),
                    "sum_s": self.collect_duration.sum_s,
                },
                "lateness": _histogram_out(self.collect_lateness),
                "behind_other_gpus": _histogram_out(self.collect_behind),
                "errors": dict(self.collect_errors),
            },
            "processes": {
                "gpus": [_workloads_to_dict(w) for w in self.workloads],
                "errors": dict(self.process_errors),
            },
            "degraded": list(self.degraded),
            "config": {
                "errors": dict(self.config_errors),
                "refused": [
                    {
                        "source": c.source,
                        "where": c.where,
                        "devices": list(c.devices),
                        "reason": c.reason,
                        "detail": c.detail,
                    }
                    for c in self.config_refused
                ],
            },
            "push": {"destinations": [_push_to_dict(d) for d in self.push_destinations]},
        }

    def to_json(self, *, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False, allow_nan=False)

    @classmethod
    def from_dict(cls, doc: Any) -> MapperSnapshot:
        r = _Reader(doc, "status")
        fmt = r.count("format")
        if fmt != SNAPSHOT_FORMAT:
            raise SnapshotFormatError(f"status.format: version {fmt} is not supported (expected {SNAPSHOT_FORMAT})")
        buf = r.obj("buffer")
        mqtt = r.obj("mqtt")
        dmi = r.obj("dmi")
        desired = r.obj("desired")
        policy = r.obj("policy")
        collect = r.obj("collect")
        dur = collect.obj("duration")
        # Absent from the status file of a mapper older than the process cycle, or than the push methods.
        procs = r.obj("processes") if "processes" in r.names() else None
        # Absent from the status file of a mapper older than the refused configuration's report.
        config = r.obj("config") if "config" in r.names() else None
        push = r.obj("push") if "push" in r.names() else None
        try:
            histogram = DurationHistogram(
                bounds_s=tuple(dur.numbers("bounds_s")),
                counts=tuple(dur.counts_list("counts")),
                sum_s=dur.number("sum_s"),
            )
        except ValueError as exc:
            raise SnapshotFormatError(f"{dur.path}: {exc}") from None
        # (absent from the status file of a mapper before issue 29)
        lateness, behind = (
            _histogram_in(collect.obj(key)) if key in collect.names() else DurationHistogram(LATENESS_BOUNDS_S)
            for key in ("lateness", "behind_other_gpus")
        )
        return cls(
            node=r.text("node"),
            taken_at_ms=r.count("taken_at_ms"),
            version=r.text("version"),
            mode=r.text("mode"),
            driver_version=r.text("driver_version"),
            gpus=tuple(_gpu_from_reader(g) for g in r.objs("gpus")),
            buffer_bytes=buf.count("bytes"),
            buffer_batches=buf.count("batches"),
            buffer_max_bytes=buf.count("max_bytes"),
            buffer_oldest_age_s=buf.opt_number("oldest_age_s"),
            buffer_drops=buf.count_map("drops"),
            # Absent from the status file of a mapper older than the data dir's degraded mode.
            buffer_dropped_samples=buf.count_map("dropped_samples") if "dropped_samples" in buf.names() else {},
            buffer_memory_batches=buf.count("memory_batches") if "memory_batches" in buf.names() else 0,
            degraded=tuple(r.texts("degraded")) if "degraded" in r.names() else (),
            replay_remaining_batches=buf.count("replay_remaining_batches"),
            replay_remaining_bytes=buf.count("replay_remaining_bytes"),
            telemetry_published_batches=buf.count("published_batches"),
            telemetry_published_bytes=buf.count("published_bytes"),
            mqtt_enabled=mqtt.flag("enabled"),
            mqtt_connected=mqtt.flag("connected"),
            mqtt_reconnects=mqtt.count("reconnects"),
            # Absent from the status file of a mapper older than this field.
            mqtt_inbound_dropped=mqtt.count_map("inbound_dropped") if "inbound_dropped" in mqtt.names() else {},
            mqtt_inbound_deferred=mqtt.count("inbound_deferred") if "inbound_deferred" in mqtt.names() else 0,
            dmi_registered=dmi.flag("registered"),
            dmi_rpcs=dmi.pairs("rpcs"),
            reconcile_actions=desired.pairs("reconcile_actions"),
            drift_reapplies=desired.count_map("drift_reapplies"),
            desired_rejections=desired.count_map("rejections"),
            policy_overrides_active=policy.count_map("overrides_active"),
            policy_events=policy.pairs("events"),
            collect_duration=histogram,
            collect_lateness=lateness,
            collect_behind=behind,
            collect_errors=collect.count_map("errors"),
            workloads=tuple(_workloads_from_reader(w) for w in procs.objs("gpus")) if procs else (),
            process_errors=procs.count_map("errors") if procs else {},
            config_errors=config.count_map("errors") if config else {},
            config_refused=tuple(_refused_from_reader(c) for c in config.objs("refused")) if config else (),
            push_destinations=tuple(_push_from_reader(d) for d in push.objs("destinations")) if push else (),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> MapperSnapshot:
        try:
            doc = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise SnapshotFormatError(f"status: not JSON ({exc})") from None
        return cls.from_dict(doc)


def _refused_from_reader(r: _Reader) -> ConfigProblem:
    source = r.text("source")
    for known in CONFIG_SOURCES:
        if source == known:
            devices = tuple(r.texts("devices"))
            return ConfigProblem(known, r.text("where"), devices, r.text("reason"), r.text("detail"))
    raise SnapshotFormatError(f"{r.path}.source: {source!r} is not one of {', '.join(CONFIG_SOURCES)}")


def _push_to_dict(d: DestinationStatus) -> dict[str, Any]:
    return {
        "key": d.key,
        "kind": d.kind,
        "state": d.state,
        "backlog_samples": d.backlog_samples,
        "backlog_bytes": d.backlog_bytes,
        "delivered_samples": d.delivered_samples,
        "failures": d.failures,
        "dropped": dict(d.dropped),
        "last_error": d.last_error,
        "last_success_ms": d.last_success_ms,
        "properties": d.properties,
    }


def _push_from_reader(r: _Reader) -> DestinationStatus:
    state = r.text("state")
    if state not in PUSH_STATES:
        raise SnapshotFormatError(f"{r.path}.state: {state!r} is not one of {', '.join(PUSH_STATES)}")
    return DestinationStatus(
        key=r.text("key"),
        kind=r.text("kind"),
        state=state,
        backlog_samples=r.count("backlog_samples"),
        backlog_bytes=r.count("backlog_bytes"),
        delivered_samples=r.count("delivered_samples"),
        failures=r.count("failures"),
        dropped=r.count_map("dropped"),
        last_error=r.text("last_error"),
        last_success_ms=r.opt_count("last_success_ms"),
        properties=r.count("properties"),
    )


def _histogram_out(h: DurationHistogram) -> dict[str, Any]:
    return {"bounds_s": list(h.bounds_s), "counts": list(h.counts), "sum_s": h.sum_s}


def _histogram_in(r: _Reader) -> DurationHistogram:
    try:
        return DurationHistogram(
            bounds_s=tuple(r.numbers("bounds_s")), counts=tuple(r.counts_list("counts")), sum_s=r.number("sum_s")
        )
    except ValueError as exc:
        raise SnapshotFormatError(f"{r.path}: {exc}") from None


def _pairs_out(counts: Mapping[tuple[str, str], int]) -> list[list[str | int]]:
    return [[a, b, n] for (a, b), n in sorted(counts.items())]


def _gpu_to_dict(g: GpuSnapshot) -> dict[str, Any]:
    i = g.info
    sample = None
    if g.sample is not None:
        sample = {
            "ts_ms": g.sample.ts_ms,
            "values": {k: _json_value(v) for k, v in g.sample.values.items()},
            "errors": dict(g.sample.errors),
        }
    return {
        "uuid": i.uuid,
        "index": i.index,
        "name": i.name,
        "pci_bus_id": i.pci_bus_id,
        "serial": i.serial,
        "driver_version": i.driver_version,
        "architecture": i.architecture,
        "device": g.device,
        "node": g.node,
        "state": g.state,
        "desired_status": g.desired_status,
        "policy_state": g.policy_state,
        "desired_power_limit_w": g.desired_power_limit_w,
        "xid_errors": {str(k): v for k, v in sorted(g.xid_errors.items())},
        "sample": sample,
        "health": _health_to_dict(g.health),
        "health_probe": None
        if g.health_probe is None
        else {
            "outcome": g.health_probe.outcome,
            "reason": g.health_probe.reason,
            "latency_s": g.health_probe.latency_s,
        },
        "probes": dict(sorted(g.probes.items())),
    }


def _probe_to_dict(p: ProbeResult | None) -> dict[str, Any] | None:
    return None if p is None else {"outcome": p.outcome, "reason": p.reason, "latency_s": p.latency_s}


def _health_to_dict(h: HealthReport) -> dict[str, Any]:
    return {
        "status": h.status,
        "level": h.level,
        "reason": h.reason,
        "levels": [list(lv) for lv in h.levels],
        "subsystems": [list(s) for s in h.subsystems],
        "checks": [
            {"name": c.name, "status": c.status, "reason": c.reason, "subsystem": c.subsystem, "detail": dict(c.detail)}
            for c in h.checks
        ],
    }


def _health_from(raw: Any, path: str) -> HealthReport:
    """The ``health`` part of a snapshot (absent in a snapshot of an older mapper: healthy)."""
    if raw is None:
        return HEALTHY_REPORT
    try:
        checks = tuple(
            CheckResult(
                str(c["name"]),
                c["status"],
                str(c["reason"]),
                str(c["subsystem"]),
                tuple((str(k), str(v)) for k, v in dict(c.get("detail", {})).items()),
            )
            for c in raw.get("checks", [])
        )
        return HealthReport(
            status=raw["status"] if raw["status"] in STATUSES else "unhealthy",
            level=int(raw["level"]),
            reason=str(raw["reason"]),
            levels=tuple((int(a), b, str(c)) for a, b, c in raw["levels"] if b in STATUSES),
            subsystems=tuple((str(a), b, str(c)) for a, b, c in raw.get("subsystems", []) if b in STATUSES),
            checks=checks,
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise SnapshotFormatError(f"{path}.health: not a health report ({exc!r})") from None


def _probe_from(raw: Any, path: str) -> ProbeResult | None:
    if raw is None:
        return None
    try:
        latency = raw.get("latency_s")
        return ProbeResult(raw["outcome"], str(raw["reason"]), None if latency is None else float(latency))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise SnapshotFormatError(f"{path}.health_probe: not a probe result ({exc!r})") from None


def _json_value(v: Value) -> Value | None:
    # JSON has no NaN/Infinity; a non-finite reading becomes null and is dropped on the way back.
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def _gpu_from_reader(r: _Reader) -> GpuSnapshot:
    info = GpuInfo(
        uuid=r.text("uuid"),
        index=r.count("index"),
        name=r.text("name"),
        pci_bus_id=r.text("pci_bus_id"),
        serial=r.text("serial"),
        driver_version=r.text("driver_version"),
        architecture=r.text("architecture"),
    )
    sample = None
    if r.get("sample") is not None:
        s = r.obj("sample")
        values: dict[str, Value] = {}
        raw_values = s.obj("values")
        for key, v in raw_values.items():
            if v is None:
                continue
            if not isinstance(v, int | float | str | bool):
                raise SnapshotFormatError(f"{raw_values.path}.{key}: {v!r} is not a number, string or boolean")
            values[key] = v
        errors = s.obj("errors")
        sample = Sample(
            uuid=info.uuid,
            ts_ms=s.count("ts_ms"),
            values=values,
            errors={k: errors.text(k) for k in errors.names()},
        )
    xids_r = r.obj("xid_errors")
    xids: dict[int, int] = {}
    for key in xids_r.names():
        try:
            code = int(key)
        except ValueError:
            raise SnapshotFormatError(f"{xids_r.path}: key {key!r} is not an XID number") from None
        xids[code] = xids_r.count(key)
    state = r.text("state")
    if state not in DEVICE_STATES:
        raise SnapshotFormatError(f"{r.path}.state: {state!r} is not one of {', '.join(DEVICE_STATES)}")
    return GpuSnapshot(
        info=info,
        device=r.text("device"),
        node=r.text("node"),
        sample=sample,
        desired_status=r.text("desired_status"),
        policy_state=r.text("policy_state"),
        state=state,
        xid_errors=xids,
        desired_power_limit_w=r.opt_number("desired_power_limit_w"),
        health=_health_from(r.get("health"), r.path),
        health_probe=_probe_from(r.get("health_probe"), r.path),
        probes={str(k): int(v) for k, v in dict(r.get("probes") or {}).items()},
    )


def _workloads_to_dict(w: GpuWorkloads) -> dict[str, Any]:
    return {
        "uuid": w.uuid,
        "ts_ms": w.ts_ms,
        "process_count": w.process_count,
        "processes": [
            {
                "pid": p.pid,
                "namespace": p.namespace,
                "pod": p.pod,
                "container": p.container,
                "memory_used_bytes": p.memory_used_bytes,
                "sm_ratio": p.sm_ratio,
                "power_w": p.power_w,
            }
            for p in w.processes
        ],
        "pods": [
            {
                "namespace": p.namespace,
                "pod": p.pod,
                "container": p.container,
                "energy_joules_total": p.energy_joules_total,
                "power_w": p.power_w,
                "memory_used_bytes": p.memory_used_bytes,
                "processes": p.processes,
                "sm_ratio": p.sm_ratio,
            }
            for p in w.pods
        ],
        "idle_joules_total": w.idle_joules_total,
        "idle_power_w": w.idle_power_w,
        "unattributed_joules_total": w.unattributed_joules_total,
        "idle_source": w.idle_source,
        "leaking_pids": list(w.leaking_pids),
        "reason": w.reason,
        "unsupported": dict(w.unsupported),
    }


def _workloads_from_reader(r: _Reader) -> GpuWorkloads:
    rows = tuple(
        ProcessRow(
            pid=p.count("pid"),
            namespace=p.text("namespace"),
            pod=p.text("pod"),
            container=p.text("container"),
            memory_used_bytes=p.opt_count("memory_used_bytes"),
            sm_ratio=p.opt_number("sm_ratio"),
            power_w=p.number("power_w"),
        )
        for p in r.objs("processes")
    )
    pods = tuple(
        PodUse(
            namespace=p.text("namespace"),
            pod=p.text("pod"),
            container=p.text("container"),
            energy_joules_total=p.number("energy_joules_total"),
            power_w=p.number("power_w"),
            memory_used_bytes=p.count("memory_used_bytes"),
            processes=p.count("processes"),
            sm_ratio=p.opt_number("sm_ratio"),
        )
        for p in r.objs("pods")
    )
    unsupported = r.obj("unsupported")
    return GpuWorkloads(
        uuid=r.text("uuid"),
        ts_ms=r.count("ts_ms"),
        process_count=r.count("process_count"),
        processes=rows,
        pods=pods,
        idle_joules_total=r.number("idle_joules_total"),
        idle_power_w=r.number("idle_power_w"),
        unattributed_joules_total=r.number("unattributed_joules_total"),
        idle_source=r.text("idle_source"),
        leaking_pids=tuple(r.counts_list("leaking_pids")),
        reason=r.text("reason"),
        unsupported={k: unsupported.text(k) for k in unsupported.names()},
    )


class _Reader:
    """Typed access to a JSON object with error messages that name the path."""

    def __init__(self, doc: Any, path: str) -> None:
        if not isinstance(doc, dict):
            raise SnapshotFormatError(f"{path}: expected an object, got {type(doc).__name__}")
        self.doc: dict[str, Any] = doc
        self.path = path

    def names(self) -> list[str]:
        return list(self.doc)

    def items(self) -> list[tuple[str, Any]]:
        return list(self.doc.items())

    def get(self, key: str) -> Any:
        return self.doc.get(key)

    def _need(self, key: str) -> Any:
        if key not in self.doc:
            raise SnapshotFormatError(f"{self.path}.{key}: missing")
        return self.doc[key]

    def _typed(self, key: str, check: Callable[[Any], bool], what: str) -> Any:
        v = self._need(key)
        if not check(v):
            raise SnapshotFormatError(f"{self.path}.{key}: expected {what}, got {v!r}")
        return v

    def text(self, key: str) -> str:
        return str(self._typed(key, lambda v: isinstance(v, str), "a string"))

    def count(self, key: str) -> int:
        return int(self._typed(key, _is_count, "a non-negative integer"))

    def flag(self, key: str) -> bool:
        return bool(self._typed(key, lambda v: isinstance(v, bool), "true or false"))

    def number(self, key: str) -> float:
        return float(self._typed(key, _is_number, "a number"))

    def opt_number(self, key: str) -> float | None:
        v = self.doc.get(key)
        return None if v is None else self.number(key)

    def opt_count(self, key: str) -> int | None:
        v = self.doc.get(key)
        return None if v is None else self.count(key)

    def numbers(self, key: str) -> list[float]:
        return [float(x) for x in self._list(key, _is_number, "numbers")]

    def counts_list(self, key: str) -> list[int]:
        return [int(x) for x in self._list(key, _is_count, "non-negative integers")]

    def _list(self, key: str, check: Callable[[Any], bool], what: str) -> list[Any]:
        v = self._typed(key, lambda v: isinstance(v, list), "a list")
        for i, x in enumerate(v):
            if not check(x):
                raise SnapshotFormatError(f"{self.path}.{key}[{i}]: expected {what}, got {x!r}")
        return list(v)

    def texts(self, key: str) -> list[str]:
        return self._list(key, lambda v: isinstance(v, str), "a string")

    def obj(self, key: str) -> _Reader:
        return _Reader(self._need(key), f"{self.path}.{key}")

    def objs(self, key: str) -> list[_Reader]:
        v = self._typed(key, lambda v: isinstance(v, list), "a list")
        return [_Reader(x, f"{self.path}.{key}[{i}]") for i, x in enumerate(v)]

    def count_map(self, key: str) -> dict[str, int]:
        o = self.obj(key)
        return {k: o.count(k) for k in o.names()}

    def pairs(self, key: str) -> dict[tuple[str, str], int]:
        v = self._typed(key, lambda v: isinstance(v, list), "a list")
        out: dict[tuple[str, str], int] = {}
        for i, row in enumerate(v):
            ok = (
                isinstance(row, list)
                and len(row) == 3
                and isinstance(row[0], str)
                and isinstance(row[1], str)
                and _is_count(row[2])
            )
            if not ok:
                raise SnapshotFormatError(f"{self.path}.{key}[{i}]: expected [label, label, count], got {row!r}")
            out[(row[0], row[1])] = int(row[2])
        return out


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


# --------------------------------------------------------------------------------------------------
# Readiness (a pure rule; mapper.edge.status.metrics serves it)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Readiness:
    """What ``/readyz`` needs: NVML initialised, and registered with EdgeCore unless in standalone mode."""

    nvml_initialised: bool
    dmi_registered: bool
    standalone: bool = False
    #: What runs degraded (``data dir full``): said by ``/readyz``, which stays 200 for it (a mapper that
    #: collects, enforces and publishes is ready; its /metrics must stay scraped to show the degradation).
    degraded: tuple[str, ...] = ()

    def problems(self) -> list[str]:
        out: list[str] = []
        if not self.nvml_initialised:
            out.append("NVML is not initialised")
        if not self.standalone and not self.dmi_registered:
            out.append("not registered with EdgeCore (DMI) and not in standalone mode")
        return out

    @property
    def ready(self) -> bool:
        return not self.problems()
