"""Who uses each GPU, per process cycle: processes, their pods, energy attributed, leaks. Pure: no I/O.

``ProcessMonitor.observe(sample, owners, now_s)`` takes one ``ProcessSample`` of a GPU (``NvmlBackend.processes``)
and the owners of its PIDs (``mapper.edge.processes.workloads.PodResolver.owners``), splits the energy the GPU's
counter moved since the previous sample (``mapper.edge.processes.attribution``: idle apart, the rest by SM share), adds
it to that GPU's per-container ledger, feeds the leak detector, and returns a frozen ``GpuWorkloads`` (what
``/metrics``, the ``processes`` twin and ``gpu-mapper status`` show) and the leak events of this observation.

Bounded: at most ``top_n`` processes per GPU by SM share and ``top_n`` by memory get series of their own, the
rest is one ``other`` row; at most ``max_workloads`` containers per GPU get energy counters of their own (see
``EnergyLedger``). Counts and sums are kept over all processes, so totals always match the GPU.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from mapper.edge.processes.attribution import (
    OTHER,
    EnergyLedger,
    EnergySplit,
    IdlePower,
    ProcessUse,
    WorkloadKey,
    split_energy,
    top_processes,
)
from mapper.edge.processes.leak import LeakConfig, LeakDetector, LeakEvent
from mapper.edge.processes.workloads import ProcessOwner
from mapper.shared.model import ProcessSample

__all__ = ["TWIN_MAX_CHARS", "GpuWorkloads", "PodUse", "ProcessMonitor", "ProcessRow", "workload_key"]

#: Counter deltas larger than this many seconds at the GPU's maximum plausible draw are a reset, not energy.
_MAX_INTERVAL_S = 3600.0


def workload_key(owner: ProcessOwner | None) -> WorkloadKey:
    """What a process's energy is summed by: its pod's namespace, pod name (else UID) and container name (else
    the runtime's id, 12 characters); a container outside Kubernetes by its id; host processes together."""
    if owner is None:
        return WorkloadKey()
    ref = owner.container
    container = owner.container_name or (ref.container_id[:12] if ref is not None else "")
    if owner.pod is not None:
        return WorkloadKey(owner.namespace, owner.pod_name, container)
    return WorkloadKey("", "", container)


@dataclass(frozen=True)
class ProcessRow:
    """One process with a series of its own (pid 0: the ``other`` row summing the rest)."""

    pid: int
    namespace: str = ""
    pod: str = ""
    container: str = ""
    memory_used_bytes: int | None = None
    sm_ratio: float | None = None
    power_w: float = 0.0


@dataclass(frozen=True)
class PodUse:
    """One container's use of one GPU (``pod == "other"`` sums those over the bound)."""

    namespace: str
    pod: str
    container: str
    energy_joules_total: float
    power_w: float
    memory_used_bytes: int = 0
    processes: int = 0
    #: The SM shares of its processes summed (0..1; None when NVML gave none of them one).
    sm_ratio: float | None = None


#: The longest twin value KubeEdge's devicetwin accepts (``^[a-zA-Z0-9-_.,:/@#]{1,512}$``).
TWIN_MAX_CHARS = 512
#: The longest workload name the twin carries (namespace/pod/container, each part up to 253 characters).
_TWIN_NAME_CHARS = 120
#: Suspected pids the twin lists at most (then ``#<n>more``).
_TWIN_LEAK_PIDS = 8


@dataclass(frozen=True)
class GpuWorkloads:
    uuid: str
    ts_ms: int = 0
    process_count: int = 0
    processes: tuple[ProcessRow, ...] = ()
    pods: tuple[PodUse, ...] = ()
    idle_joules_total: float = 0.0
    idle_power_w: float = 0.0
    unattributed_joules_total: float = 0.0
    #: ``configured``, ``observed-idle``, ``observed-minimum`` or ``unknown`` (see ``IdlePower``).
    idle_source: str = "unknown"
    #: PIDs suspected of leaking GPU memory now.
    leaking_pids: tuple[int, ...] = ()
    #: Why some processes could not be named down to a pod ("" when all could), and what NVML could not read.
    reason: str = ""
    unsupported: Mapping[str, str] = field(default_factory=dict)

    @property
    def top_by_power(self) -> PodUse | None:
        named = [p for p in self.pods if p.power_w > 0]
        return max(named, key=lambda p: (p.power_w, p.namespace, p.pod, p.container)) if named else None

    @property
    def top_by_memory(self) -> PodUse | None:
        named = [p for p in self.pods if p.memory_used_bytes > 0]
        return max(named, key=lambda p: (p.memory_used_bytes, p.namespace, p.pod, p.container)) if named else None

    def twin_text(self) -> str:
        """The ``processes`` twin: compact, twin-safe (``[a-zA-Z0-9-_.,:/@#]``, at most ``TWIN_MAX_CHARS``):
        ``count:3,power:ns/pod/c@41.5W,memory:ns/pod/c@12884901888B,leak:31``. Long names are cut to 120
        characters, and at most 8 suspected pids are listed (``leak:31/32/#5more``)."""
        parts = [f"count:{self.process_count}"]
        top = self.top_by_power
        if top is not None:
            parts.append(f"power:{_who(top)}@{top.power_w:.1f}W")
        top = self.top_by_memory
        if top is not None:
            parts.append(f"memory:{_who(top)}@{top.memory_used_bytes}B")
        if self.leaking_pids:
            pids = [str(p) for p in self.leaking_pids[:_TWIN_LEAK_PIDS]]
            if len(self.leaking_pids) > _TWIN_LEAK_PIDS:
                pids.append(f"#{len(self.leaking_pids) - _TWIN_LEAK_PIDS}more")
            parts.append("leak:" + "/".join(pids))
        return ",".join(parts)[:TWIN_MAX_CHARS]


def _who(p: PodUse) -> str:
    name = "/".join(x for x in (p.namespace, p.pod, p.container) if x) or "host"
    safe = "".join(c if (c.isascii() and c.isalnum()) or c in "-_./:@#" else "_" for c in name)
    return safe[:_TWIN_NAME_CHARS]


@dataclass
class _GpuState:
    ledger: EnergyLedger
    idle: IdlePower
    last_energy_j: float | None = None
    last_ts_s: float | None = None


@dataclass
class ProcessMonitor:
    top_n: int = 5
    max_workloads: int = 32
    retention_s: float = 600.0
    idle_power_w: Mapping[str, float] = field(default_factory=dict)
    leak: LeakConfig = field(default_factory=LeakConfig)
    _gpus: dict[str, _GpuState] = field(default_factory=dict)
    _detector: LeakDetector | None = None

    def __post_init__(self) -> None:
        if self.top_n < 1 or self.max_workloads < 1:
            raise ValueError(f"top_n and max_workloads must be >= 1, got {self.top_n}, {self.max_workloads}")
        self._detector = LeakDetector(self.leak)

    def forget(self, uuid: str) -> None:
        self._gpus.pop(uuid, None)
        if self._detector is not None:
            self._detector.forget([uuid])

    def observe(
        self, sample: ProcessSample, owners: Mapping[int, ProcessOwner], now_s: float
    ) -> tuple[GpuWorkloads, list[LeakEvent]]:
        state = self._gpus.get(sample.uuid)
        if state is None:
            state = self._gpus[sample.uuid] = _GpuState(
                EnergyLedger(max_keys=self.max_workloads, retention_s=self.retention_s),
                IdlePower(configured_w=self.idle_power_w.get(sample.uuid)),
            )
        uses = [
            ProcessUse(p.pid, p.memory_used_bytes, p.sm_ratio, p.memory_ratio, p.encoder_ratio, p.decoder_ratio)
            for p in sample.processes
        ]
        keys = {u.pid: workload_key(owners.get(u.pid)) for u in uses}
        power_by_pid: dict[int, float] = {}
        energy = sample.energy_j
        dt = None if state.last_ts_s is None else now_s - state.last_ts_s
        delta = None
        if energy is not None and state.last_energy_j is not None and dt is not None and dt > 0:
            delta = energy - state.last_energy_j
            if delta < 0 or dt > _MAX_INTERVAL_S:
                delta = None  # the counter restarted (driver reload) or the gap is too long to split
        if delta is None and energy is None and sample.power_w is not None and dt is not None and dt > 0:
            delta = sample.power_w * min(dt, _MAX_INTERVAL_S)  # no counter: the power reading over the interval
        if delta is not None and dt is not None and dt > 0:
            # An interval in which no process had time on the SMs (none at all, or resident processes that
            # computed nothing: an inference server between requests) shows the GPU's idle power. Where NVML gives
            # no per-process utilisation (MIG, an old driver), only an interval without processes does.
            busy = sum(1 for u in uses if (u.sm_ratio or 0.0) > 0) if sample.utilization_source else len(uses)
            state.idle.observe(delta / dt, busy)
            idle_w = state.idle.watts or 0.0
            per_process = split_energy(delta, dt, idle_w, {u.pid: u.sm_ratio for u in uses})
            by_key: dict[WorkloadKey, float] = {}
            for pid, joules in per_process.by_key.items():
                by_key[keys[pid]] = by_key.get(keys[pid], 0.0) + joules
                power_by_pid[pid] = joules / dt
            summed = EnergySplit(per_process.energy_j, dt, per_process.idle_j, per_process.unattributed_j, by_key)
            state.ledger.add(summed, now_s)
        state.last_energy_j = energy
        state.last_ts_s = now_s
        events: list[LeakEvent] = []
        if self._detector is not None:
            events = self._detector.observe(sample.uuid, {u.pid: u.memory_used_bytes for u in uses}, now_s)
        kept, rest = top_processes(uses, self.top_n)
        rows = [self._row(u, keys[u.pid], power_by_pid.get(u.pid, 0.0)) for u in kept]
        if rest is not None:
            other_power = math.fsum(w for pid, w in power_by_pid.items() if pid not in {u.pid for u in kept})
            rows.append(ProcessRow(0, "", "other", "", rest.memory_used_bytes, rest.sm_ratio, other_power))
        pods = self._pods(state.ledger, uses, keys)
        reasons = sorted({o.reason for o in owners.values() if o.reason and o.reason != "host process"})
        return (
            GpuWorkloads(
                uuid=sample.uuid,
                ts_ms=sample.ts_ms,
                process_count=len(uses),
                processes=tuple(rows),
                pods=pods,
                idle_joules_total=state.ledger.idle_joules_total,
                idle_power_w=state.ledger.idle_power_w,
                unattributed_joules_total=state.ledger.unattributed_joules_total,
                idle_source=state.idle.source,
                leaking_pids=tuple(self._detector.suspected(sample.uuid)) if self._detector else (),
                reason="; ".join(reasons),
                unsupported=dict(sample.unsupported),
            ),
            events,
        )

    @staticmethod
    def _row(use: ProcessUse, key: WorkloadKey, power_w: float) -> ProcessRow:
        return ProcessRow(use.pid, key.namespace, key.pod, key.container, use.memory_used_bytes, use.sm_ratio, power_w)

    @staticmethod
    def _pods(ledger: EnergyLedger, uses: list[ProcessUse], keys: Mapping[int, WorkloadKey]) -> tuple[PodUse, ...]:
        free = ledger.max_keys - sum(1 for k in ledger.entries if k != OTHER)
        slots: dict[WorkloadKey, WorkloadKey] = {}
        for key in sorted(set(keys.values())):  # the order the ledger gives out its slots
            slot = ledger.slot(key)
            if slot == key and key not in ledger.entries:
                if free > 0:
                    free -= 1
                else:
                    slot = OTHER
            slots[key] = slot
        memory: dict[WorkloadKey, int] = {}
        count: dict[WorkloadKey, int] = {}
        sm: dict[WorkloadKey, float] = {}
        for use in uses:
            slot = slots[keys[use.pid]]
            memory[slot] = memory.get(slot, 0) + (use.memory_used_bytes or 0)
            count[slot] = count.get(slot, 0) + 1
            if use.sm_ratio is not None:
                sm[slot] = sm.get(slot, 0.0) + use.sm_ratio
        rows = []
        for key in sorted(set(ledger.entries) | set(memory)):
            entry = ledger.entries.get(key)
            joules, power = (entry.joules_total, entry.power_w) if entry is not None else (0.0, 0.0)
            rows.append(
                PodUse(
                    key.namespace,
                    key.pod,
                    key.container,
                    joules,
                    power,
                    memory.get(key, 0),
                    count.get(key, 0),
                    sm.get(key),
                )
            )
        return tuple(rows)
