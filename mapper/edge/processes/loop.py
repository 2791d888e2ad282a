"""The process cycle: who uses each GPU, every ``interval_s`` (5 s by default), on a timer of its own.

Each cycle, for every GPU of the node in turn: one NVML job (``NvmlBackend.processes``: the processes, their
utilisation since the previous cycle, the GPU's energy counter and power), the owners of its PIDs
(``mapper.edge.processes.workloads.PodResolver.owners``: a thread hop, bounded by a timeout, since it reads ``/proc``
and the kubelet's files), then ``mapper.edge.processes.monitor.ProcessMonitor.observe`` (the energy split, the bounded
rows, the leak detector). What comes out goes to every output the mapper has:

* ``workloads()``: the latest ``GpuWorkloads`` of every GPU, for the snapshot behind ``/metrics``, ``/status``
  and ``gpu-mapper status``;
* the ``processes`` twin: its text is the GPU worker's ``processes`` value, which the reporter sends when the
  bound Device lists the property (a periodic twin, never a prompt report);
* the telemetry stream of the GPU: one row per cycle with every workload's energy, power, memory and SM share
  (``mapper.shared.naming.pod_series``), the GPU's process count, idle and unattributed energy, idle power and the
  processes suspected of leaking (``mapper.shared.naming.leak_series``);
* leak events: ``leak-suspected`` / ``leak-cleared`` as MQTT events of the ``gpu-memory-leak`` policy on the
  Device's ``.../events`` topic (kept in the buffer while the broker is down, counted in
  ``gpu_mapper_policy_events_total``). Nothing is done to the process.

A GPU whose process query fails (NVML error, timeout, a lost GPU) is counted by reason and skipped for that cycle;
the others go on. Pure loop logic: it sees the backend through ``ProcessSource`` and the outputs as callables.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mapper.clock import Clock
from mapper.edge.config import Settings
from mapper.edge.control.collect import GpuWorker, call_backend, call_in_thread
from mapper.edge.control.policy import PolicyEvent
from mapper.edge.outbox.publish import Publisher
from mapper.edge.outbox.streams import TelemetryStreams
from mapper.edge.processes.leak import LeakConfig, LeakEvent
from mapper.edge.processes.monitor import GpuWorkloads, ProcessMonitor
from mapper.edge.processes.workloads import PodDirs, PodResolver, ProcessOwner
from mapper.errors import MapperError
from mapper.shared.model import ProcessSample, ProcessSource, Sample, Value
from mapper.shared.naming import leak_series, pod_series

__all__ = [
    "LEAK_POLICY",
    "TWIN_PROPERTY",
    "LeakPolicyEvent",
    "ProcessLoop",
    "telemetry_values",
]

log = logging.getLogger("mapper.edge.processes.loop")

#: The policy name of the leak detector's MQTT events.
LEAK_POLICY = "gpu-memory-leak"
#: The catalog property the ``processes`` twin reports.
TWIN_PROPERTY = "processes"

#: ``(device key, uuid, events)``: ``mapper.edge.outbox.publish.Publisher.publish_step`` without acks.
PublishEvents = Callable[[str, str, Sequence[PolicyEvent]], None]
#: ``(uuid, sample)``: a row for the GPU's telemetry stream.
AddTelemetry = Callable[[str, Sample], None]


@dataclass(frozen=True)
class LeakPolicyEvent(PolicyEvent):
    """A leak detector event as a policy event (``policy == LEAK_POLICY``), with the process it is about."""

    pid: int = 0
    namespace: str = ""
    pod: str = ""
    container: str = ""
    growth_bytes: int = 0
    window_s: float = 0.0
    memory_used_bytes: int = 0

    def to_payload(self) -> dict[str, Any]:
        payload = super().to_payload()
        payload.update(
            pid=self.pid,
            namespace=self.namespace,
            pod=self.pod,
            container=self.container,
            growthBytes=self.growth_bytes,
            windowSeconds=self.window_s,
            memoryUsedBytes=self.memory_used_bytes,
        )
        return payload


def leak_policy_event(event: LeakEvent, owner: ProcessOwner | None) -> LeakPolicyEvent:
    container = ""
    if owner is not None:
        ref = owner.container
        container = owner.container_name or (ref.container_id[:12] if ref is not None else "")
    return LeakPolicyEvent(
        policy=LEAK_POLICY,
        action=event.action,
        reason=event.reason,
        uuid=event.uuid,
        ts_s=event.ts_s,
        pid=event.pid,
        namespace=owner.namespace if owner is not None else "",
        pod=owner.pod_name if owner is not None else "",
        container=container,
        growth_bytes=event.growth_bytes,
        window_s=event.window_s,
        memory_used_bytes=event.memory_used_bytes,
    )


def telemetry_values(report: GpuWorkloads) -> dict[str, Value]:
    """The telemetry row of one cycle: per workload ``pod:energy|power|memory|sm:<ns>/<pod>/<container>`` (J, W,
    bytes, ratio), the GPU's process count, idle and unattributed energy (J) and idle power (W), and
    ``leak:<pid>:<ns>/<pod>/<container>`` 1 for each process suspected of leaking."""
    values: dict[str, Value] = {
        "processes_count": report.process_count,
        "processes_idle_energy": round(report.idle_joules_total, 3),
        "processes_unattributed_energy": round(report.unattributed_joules_total, 3),
        "processes_idle_power": round(report.idle_power_w, 3),
    }
    owners = {r.pid: (r.namespace, r.pod, r.container) for r in report.processes}
    for pid in report.leaking_pids:
        values[leak_series(pid, *owners.get(pid, ("", "", "")))] = 1
    for p in report.pods:
        who = (p.namespace, p.pod, p.container)
        values[pod_series("energy", *who)] = round(p.energy_joules_total, 3)
        values[pod_series("power", *who)] = round(p.power_w, 3)
        values[pod_series("memory", *who)] = p.memory_used_bytes
        if p.sm_ratio is not None:
            values[pod_series("sm", *who)] = round(p.sm_ratio, 4)
    return values


@dataclass
class ProcessLoop:
    """Runs the process cycle over ``workers`` (every GPU of the node, by UUID; read, and each one's
    ``processes`` value written)."""

    backend: ProcessSource
    workers: Mapping[str, GpuWorker]
    clock: Clock
    resolver: PodResolver = field(default_factory=PodResolver)
    monitor: ProcessMonitor = field(default_factory=ProcessMonitor)
    interval_s: float = 5.0
    proc_root: str = "/proc"
    call_timeout_s: float = 10.0
    publish_events: PublishEvents | None = None
    add_telemetry: AddTelemetry | None = None
    beat: Callable[[str, float], None] | None = None
    #: Configured idle power (W) by GPU UUID or product name (``processes.idlePower``); else it is learnt.
    idle_power_by_gpu: Mapping[str, float] = field(default_factory=dict)
    #: Run once, in the first cycle's thread hop, before the kubelet's files are first read (the simulated GPUs
    #: write their processes' host tree there).
    prepare: Callable[[], None] | None = None
    #: The latest report of each GPU.
    latest: dict[str, GpuWorkloads] = field(default_factory=dict)
    #: GPUs whose cycle failed, by reason (NVML's error reason, ``timeout``, ``owners``).
    errors: dict[str, int] = field(default_factory=dict)
    _refreshed: bool = False
    _reasons_logged: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        if not math.isfinite(self.interval_s) or self.interval_s <= 0:
            raise ValueError(f"process interval_s must be > 0, got {self.interval_s!r}")
        #: The monitor's configured idle power by UUID, filled as each GPU is first seen.
        self.idle_power_w: dict[str, float] = dict(self.monitor.idle_power_w)
        self.monitor.idle_power_w = self.idle_power_w

    def workloads(self) -> tuple[GpuWorkloads, ...]:
        """The latest report of each GPU still on the node, by UUID."""
        return tuple(self.latest[u] for u in sorted(self.latest) if u in self.workers)

    async def run(self) -> None:
        while True:
            started = self.clock.monotonic()
            if self.beat is not None:
                self.beat("processes", self.interval_s)
            try:
                await self.run_once()
            except Exception:
                # A bug in one cycle (a file the resolver did not expect, ...) must not stop the mapper: the
                # cycle is logged with its traceback (the first time and every 100th), counted, and tried again.
                failed = self.errors["cycle-failed"] = self.errors.get("cycle-failed", 0) + 1
                if failed % 100 == 1:
                    log.exception("the process cycle failed (%d times); it runs again in %g s", failed, self.interval_s)
            elapsed = self.clock.monotonic() - started
            await asyncio.sleep(max(0.0, self.interval_s - elapsed))

    async def run_once(self) -> list[GpuWorkloads]:
        """One cycle over every GPU; the reports made (a GPU whose query failed has none this cycle). The GPUs'
        NVML queries go to the backend's worker as one job, and their owners are found in one thread hop (none
        when every PID and pod is known already)."""
        if not self._refreshed:
            self._refreshed = True
            await call_in_thread(self._first_refresh, timeout_s=self.call_timeout_s)
            if self.resolver.unreadable_reason:
                log.warning("processes: pods cannot be named: %s", self.resolver.unreadable_reason)
        uuids = list(self.workers)
        sampled = await asyncio.gather(*(self._sample(uuid) for uuid in uuids))
        samples = {uuid: s for uuid, s in zip(uuids, sampled, strict=True) if s is not None}
        owners = await self._owners(samples)
        out: list[GpuWorkloads] = []
        for uuid, sample in samples.items():
            out.append(self._observe(uuid, sample, owners.get(uuid, {})))
        for gone in [u for u in self.latest if u not in self.workers]:
            del self.latest[gone]
            self.monitor.forget(gone)
        return out

    def _first_refresh(self) -> None:
        if self.prepare is not None:
            self.prepare()
        self.resolver.refresh()

    async def _sample(self, uuid: str) -> ProcessSample | None:
        try:
            sample: ProcessSample = await call_backend(
                self.backend, self.backend.processes, uuid, timeout_s=self.call_timeout_s, what=f"GPU {uuid}: "
            )
        except MapperError as exc:
            self._failed(uuid, exc.reason, str(exc))
            return None
        return sample

    async def _owners(self, samples: Mapping[str, ProcessSample]) -> dict[str, dict[int, ProcessOwner]]:
        pids = {uuid: [p.pid for p in s.processes] for uuid, s in samples.items()}
        resolver, root = self.resolver, self.proc_root

        def owners() -> dict[str, dict[int, ProcessOwner]]:
            return {uuid: resolver.owners(root, these, uuid) for uuid, these in pids.items()}

        if all(resolver.cached(these, uuid) for uuid, these in pids.items()):
            return owners()
        try:
            found: dict[str, dict[int, ProcessOwner]] = await call_in_thread(owners, timeout_s=self.call_timeout_s)
        except (TimeoutError, OSError) as exc:
            for uuid in pids:
                self._failed(uuid, "owners", f"reading the owners of its processes failed: {exc}")
            return {}
        return found

    def _observe(self, uuid: str, sample: ProcessSample, owners: Mapping[int, ProcessOwner]) -> GpuWorkloads:
        worker = self.workers.get(uuid)
        if worker is not None and uuid not in self.idle_power_w:
            known = self.idle_power_by_gpu.get(uuid, self.idle_power_by_gpu.get(worker.info.name))
            if known is not None:
                self.idle_power_w[uuid] = known
        report, leaks = self.monitor.observe(sample, owners, self.clock.monotonic())
        self.latest[uuid] = report
        if report.reason and report.reason not in self._reasons_logged and len(self._reasons_logged) < 32:
            self._reasons_logged.add(report.reason)
            log.warning("processes on GPU %s: %s", uuid, report.reason)
        if worker is not None:
            worker.values[TWIN_PROPERTY] = report.twin_text()
        if self.add_telemetry is not None:
            self.add_telemetry(uuid, Sample(uuid, sample.ts_ms or self.clock.wall_ms(), telemetry_values(report)))
        if leaks and self.publish_events is not None:
            device_key = self._device_key(uuid)
            self.publish_events(device_key, uuid, [leak_policy_event(e, owners.get(e.pid)) for e in leaks])
        return report

    def _device_key(self, uuid: str) -> str:
        worker = self.workers.get(uuid)
        if worker is None:
            return f"_unbound/{uuid.lower()}"
        return worker.device_key

    def _failed(self, uuid: str, reason: str, message: str) -> None:
        self.errors[reason] = self.errors.get(reason, 0) + 1
        if self.errors[reason] % 100 == 1:
            log.warning("processes of GPU %s: %s (%d times for %s)", uuid, message, self.errors[reason], reason)


def process_loop(
    settings: Settings,
    backend: ProcessSource,
    workers: Mapping[str, GpuWorker],
    publisher: Publisher | None = None,
    streams: TelemetryStreams | None = None,
    *,
    clock: Clock,
    beat: Callable[[str, float], None] | None = None,
    prepare: Callable[[], None] | None = None,
) -> ProcessLoop | None:
    """The process loop ``settings`` ask for, or None when it is off (``processes.interval: 0``): leak events
    through ``publisher`` (as its policy events), telemetry rows into ``streams``, ``prepare`` run before the first
    cycle reads ``processes.procRoot`` and ``processes.podFilesRoot``."""
    if settings.process_interval_s <= 0:
        return None
    publish_events: PublishEvents | None = None
    add_telemetry: AddTelemetry | None = None
    if publisher is not None:
        pub = publisher

        def publish_events(device_key: str, uuid: str, events: Sequence[PolicyEvent]) -> None:
            pub.publish_step(device_key, uuid, (), events)

    if streams is not None:
        st = streams

        def add_telemetry(uuid: str, sample: Sample) -> None:
            st.add(uuid, sample, clock.wall_ms())
            st.store_round()

    monitor = ProcessMonitor(
        top_n=settings.process_top_n,
        max_workloads=settings.process_max_workloads,
        leak=LeakConfig(
            enabled=settings.leak_enabled,
            window_s=settings.leak_window_s,
            threshold_bytes=settings.leak_threshold_bytes,
        ),
    )
    return ProcessLoop(
        backend,
        workers,
        clock,
        resolver=PodResolver(PodDirs.under(settings.pod_files_root)),
        monitor=monitor,
        interval_s=settings.process_interval_s,
        proc_root=settings.proc_root,
        publish_events=publish_events,
        add_telemetry=add_telemetry,
        beat=beat,
        idle_power_by_gpu=dict(settings.idle_power_w),
        prepare=prepare,
    )
