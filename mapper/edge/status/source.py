"""The running mapper's snapshot (``mapper.edge.status.stats.MapperSnapshot``), built on demand from the parts that hold
each figure: the GPU workers, the collector's counts, the publisher, the door's limiter, the buffer, the
shipper, the MQTT session, the DMI client and server, the health loop, the process loop and the push router. What
reads the GPU workers is here (``gpu_snapshot``, ``worker_totals``): the snapshot's module holds values only.

``StatusSource.snapshot`` is what ``/metrics``, ``/status`` and the status file read; nothing in it touches
the hardware or the network. It sees the adapters through the small Protocols below only (``mapper.edge.app``
hands the concrete objects to its constructor). ``run_console`` is the loop that prints the live table of
``gpu-mapper run --sim N`` (``mapper.edge.status.view.console_table``) every ``print_interval_s``.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, TextIO

from mapper.clock import Clock
from mapper.edge.config import Settings
from mapper.edge.control.collect import GpuWorker, worker_sample
from mapper.edge.kubeedge.doorlimit import InboundLimiter
from mapper.edge.kubeedge.registry import ConfigErrors
from mapper.edge.outbox.publish import Publisher
from mapper.edge.outbox.shipper import TelemetryShipper
from mapper.edge.processes.monitor import GpuWorkloads
from mapper.edge.push.destination import DestinationStatus
from mapper.edge.status.stats import LATENESS_BOUNDS_S, DurationHistogram, GpuSnapshot, MapperSnapshot
from mapper.edge.status.view import console_table


class BufferFigures(Protocol):
    """What the snapshot reads of ``mapper.edge.storage.buffer.BufferStats``."""

    @property
    def bytes(self) -> int: ...
    @property
    def batches(self) -> int: ...
    @property
    def oldest_age_s(self) -> float | None: ...
    @property
    def drops_by_reason(self) -> Mapping[str, int]: ...
    @property
    def drop_samples_by_reason(self) -> Mapping[str, int]: ...
    @property
    def degraded(self) -> str: ...
    @property
    def memory_batches(self) -> int: ...


class BufferLike(Protocol):
    def stats(self) -> BufferFigures: ...


class SessionLike(Protocol):
    """What the snapshot reads of ``mapper.net.mqtt.MqttSession``."""

    @property
    def connected(self) -> bool: ...
    @property
    def reconnects(self) -> int: ...


class RpcCounting(Protocol):
    """``mapper.edge.kubeedge.dmi.server.DmiServer``: RPCs by method and result."""

    @property
    def rpc_counts(self) -> Mapping[str, Mapping[str, int]]: ...


class DmiClientLike(RpcCounting, Protocol):
    """``mapper.edge.kubeedge.dmi.client.DmiClient``: its RPCs, and whether EdgeCore knows us."""

    @property
    def registered(self) -> bool: ...


class WorkloadSource(Protocol):
    """What the snapshot reads of the process cycle (``mapper.edge.processes.loop.ProcessLoop``)."""

    @property
    def errors(self) -> Mapping[str, int]: ...

    def workloads(self) -> tuple[GpuWorkloads, ...]: ...


class CollectFigures(Protocol):
    """What the snapshot reads of the collector (``mapper.edge.control.collect.CollectCounts``, or the
    ``Collector`` itself): failed steps by reason, XIDs per GPU."""

    @property
    def errors(self) -> Mapping[str, int]: ...
    @property
    def xids(self) -> Mapping[str, Mapping[int, int]]: ...


class ProbeCounting(Protocol):
    """What the snapshot reads of the health loop (``mapper.edge.control.healthloop.HealthMonitor``): probes by
    outcome."""

    def probe_counts(self, uuid: str) -> Mapping[str, int]: ...


class PushFigures(Protocol):
    """What the snapshot reads of the push router (``mapper.edge.push.router.PushRouter``): each destination."""

    def statuses(self) -> tuple[DestinationStatus, ...]: ...


class StatusSource:
    """The snapshot of one mapper, from its parts (``settings``: its node name, mode and buffer cap). Of the
    parts made at start-up, None is one not made (no broker: no ``session``; no DMI: no ``dmi_client`` or
    ``dmi_server``; no ``health`` loop on a Jetson; no ``processes`` loop when it is off); its figures are
    zero. ``observe_round`` is the collector's per-round duration callback."""

    def __init__(
        self,
        settings: Settings,
        version: str,
        workers: Mapping[str, GpuWorker],
        collector: CollectFigures,
        publisher: Publisher,
        inbound: InboundLimiter,
        clock: Clock,
        processes: WorkloadSource | None = None,
        *,
        health: ProbeCounting | None = None,
        driver_version: str = "",
        buffer: BufferLike | None = None,
        shipper: TelemetryShipper | None = None,
        session: SessionLike | None = None,
        dmi_client: DmiClientLike | None = None,
        dmi_server: RpcCounting | None = None,
        config_errors: ConfigErrors | None = None,
        push: PushFigures | None = None,
    ) -> None:
        self.node = settings.node_name
        self.config_errors = config_errors
        self.processes = processes
        self.health = health
        self.version = version
        self.workers = workers
        self.collector = collector
        self.publisher = publisher
        self.inbound = inbound
        self.clock = clock
        self.dmi_enabled = settings.dmi_enabled
        self.buffer_max_bytes = settings.buffer_max_bytes
        self.driver_version = driver_version
        self.buffer = buffer
        self.shipper = shipper
        self.session = session
        self.dmi_client = dmi_client
        self.dmi_server = dmi_server
        self.push = push
        #: Durations of the collect rounds, and how late each GPU's sample was read (``Collector``).
        self.collect_duration = DurationHistogram()
        self.collect_lateness = DurationHistogram(LATENESS_BOUNDS_S)
        self.collect_behind = DurationHistogram(LATENESS_BOUNDS_S)

    def observe_round(self, duration_s: float) -> None:
        self.collect_duration = self.collect_duration.observe(duration_s)

    def observe_lateness(self, lateness_s: float, behind_s: float) -> None:
        """A GPU sample's lateness, and the part of it behind the other GPUs' reads of its round."""
        self.collect_lateness = self.collect_lateness.observe(lateness_s)
        self.collect_behind = self.collect_behind.observe(behind_s)

    def mqtt_state(self) -> str:
        """The default broker: off (none configured), up or down."""
        return "off" if self.session is None else "up" if self.session.connected else "down"

    def buffer_batches(self) -> int:
        return self.buffer.stats().batches if self.buffer is not None else 0

    def degraded(self) -> tuple[str, ...]:
        """What runs degraded now: the data dir that cannot be written (the buffer says why)."""
        why = self.buffer.stats().degraded if self.buffer is not None else ""
        return (why,) if why else ()

    def state_message(self, device_key: str, worker: GpuWorker) -> bytes:
        """A device's retained state message: its latest values and its GPU's status
        (``GpuSnapshot.state_message``)."""
        probes = self.health.probe_counts(worker.uuid) if self.health is not None else None
        g = gpu_snapshot(worker, self.node, self.collector.xids.get(worker.uuid, {}), probes)
        degraded = "; ".join(self.degraded())
        return g.state_message(
            device_key, driver_version=self.driver_version, at_ms=self.clock.wall_ms(), degraded=degraded
        )

    def snapshot(self) -> MapperSnapshot:
        xids = self.collector.xids
        health = self.health
        gpus = [
            gpu_snapshot(w, self.node, xids.get(w.uuid, {}), health.probe_counts(w.uuid) if health else None)
            for w in self.workers.values()
        ]
        totals = worker_totals(self.workers.values())
        counted = [part.rpc_counts for part in (self.dmi_client, self.dmi_server) if part is not None]
        dmi_rpcs = summed_rpc_counts(counted)
        buf = self.buffer.stats() if self.buffer is not None else None
        ship = self.shipper.stats() if self.shipper is not None else None
        return MapperSnapshot(
            node=self.node,
            taken_at_ms=self.clock.wall_ms(),
            version=self.version,
            mode="dmi" if self.dmi_enabled else "standalone",
            driver_version=self.driver_version,
            gpus=tuple(gpus),
            buffer_bytes=buf.bytes if buf else 0,
            buffer_batches=buf.batches if buf else 0,
            buffer_max_bytes=self.buffer_max_bytes,
            buffer_oldest_age_s=buf.oldest_age_s if buf else None,
            buffer_drops=dict(buf.drops_by_reason) if buf else {},
            buffer_dropped_samples=dict(buf.drop_samples_by_reason) if buf else {},
            buffer_memory_batches=buf.memory_batches if buf else 0,
            degraded=(buf.degraded,) if buf and buf.degraded else (),
            replay_remaining_batches=ship.replay_remaining_batches if ship else 0,
            replay_remaining_bytes=ship.replay_remaining_bytes if ship else 0,
            telemetry_published_batches=ship.published_batches if ship else 0,
            telemetry_published_bytes=ship.published_bytes if ship else 0,
            mqtt_enabled=self.session is not None,
            mqtt_connected=self.session.connected if self.session is not None else False,
            mqtt_reconnects=self.session.reconnects if self.session is not None else 0,
            mqtt_inbound_dropped=dict(self.inbound.dropped),
            mqtt_inbound_deferred=self.inbound.deferred,
            dmi_registered=self.dmi_client.registered if self.dmi_client is not None else False,
            dmi_rpcs=dmi_rpcs,
            reconcile_actions=totals.actions,
            drift_reapplies=totals.drift,
            desired_rejections=totals.rejections,
            policy_overrides_active=totals.overrides,
            policy_events=dict(self.publisher.policy_events),
            collect_duration=self.collect_duration,
            collect_lateness=self.collect_lateness,
            collect_behind=self.collect_behind,
            collect_errors=dict(self.collector.errors),
            workloads=self.processes.workloads() if self.processes is not None else (),
            process_errors=dict(self.processes.errors) if self.processes is not None else {},
            config_errors=dict(self.config_errors.counts) if self.config_errors is not None else {},
            config_refused=self.config_errors.current if self.config_errors is not None else (),
            push_destinations=self.push.statuses() if self.push is not None else (),
        )


def gpu_snapshot(
    worker: GpuWorker, node: str, xids: Mapping[int, int], probes: Mapping[str, int] | None = None
) -> GpuSnapshot:
    """One GPU's part of the snapshot, from its worker (``xids``: the XIDs seen on it, by number; ``probes``: the
    CUDA probes run on it, by outcome)."""
    state = worker.state if worker.state in ("online", "offline", "unhealthy") else "unknown"
    desired_pl = worker.desired.effective().get("power_limit")
    return GpuSnapshot(
        info=worker.info,
        device=worker.device.key if worker.device is not None else "",
        node=node,
        sample=worker_sample(worker) if worker.values else None,
        desired_status=worker.desired_status,
        policy_state=worker.policy_state,
        state=state,
        xid_errors=dict(xids),
        desired_power_limit_w=float(desired_pl.value)
        if desired_pl is not None and desired_pl.valid and desired_pl.value is not None
        else None,
        health=worker.health,
        health_probe=worker.last_probe,
        probes=dict(probes or {}),
    )


@dataclass
class WorkerTotals:
    """The reconcilers' and policies' counts summed over every GPU."""

    actions: dict[tuple[str, str], int] = field(default_factory=dict)
    drift: dict[str, int] = field(default_factory=dict)
    rejections: dict[str, int] = field(default_factory=dict)
    #: GPUs each policy overrides now.
    overrides: dict[str, int] = field(default_factory=dict)


def worker_totals(workers: Iterable[GpuWorker]) -> WorkerTotals:
    totals = WorkerTotals()
    for worker in workers:
        counters = worker.reconciler.counters
        for k, v in counters.actions.items():
            totals.actions[k] = totals.actions.get(k, 0) + v
        for k2, v in counters.drift_reapplies.items():
            totals.drift[k2] = totals.drift.get(k2, 0) + v
        for k2, v in counters.rejections.items():
            totals.rejections[k2] = totals.rejections.get(k2, 0) + v
        for part in worker.policy_state.removeprefix("dry-run:").split(","):
            policy = part.split(":", 1)[0]
            if policy and policy != "normal":
                totals.overrides[policy] = totals.overrides.get(policy, 0) + 1
    return totals


def summed_rpc_counts(sources: Iterable[Mapping[str, Mapping[str, int]]]) -> dict[tuple[str, str], int]:
    """RPC counts of the DMI client and server, summed by (method, result)."""
    dmi_rpcs: dict[tuple[str, str], int] = {}
    for counts in sources:
        for method, results in counts.items():
            for result, n in results.items():
                dmi_rpcs[(method, result)] = dmi_rpcs.get((method, result), 0) + n
    return dmi_rpcs


async def run_console(
    status: StatusSource, interval_s: float, beat: Callable[[str, float], None], out: TextIO | None = None
) -> None:
    """``console_table`` written to ``out`` (stdout) every ``interval_s``."""
    while True:
        beat("console", interval_s)
        stream = out or sys.stdout
        table = console_table(
            status.node, status.workers.values(), buffer_batches=status.buffer_batches(), mqtt=status.mqtt_state()
        )
        stream.write(table)
        stream.flush()
        await asyncio.sleep(interval_s)
