"""The mapper's snapshot from its parts (``mapper.edge.status.source``), on fake time and simulated GPUs: what each part
contributes, the parts made at start-up missing or present, and the console loop."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from mapper.clock import FakeClock
from mapper.edge.config import Settings
from mapper.edge.control.collect import Collector, GpuWorker
from mapper.edge.control.policy import PolicyEngine
from mapper.edge.control.reconcile import Reconciler
from mapper.edge.gpu.nvml import NvmlBackend
from mapper.edge.gpu.simnvml import SimNvml
from mapper.edge.kubeedge.doorlimit import InboundLimiter
from mapper.edge.outbox.publish import Publisher
from mapper.edge.status.source import StatusSource, run_console, summed_rpc_counts
from mapper.edge.status.stats import MapperSnapshot
from mapper.shared.model import DeviceConfig, DeviceProperty
from tests.apphelpers import wait_for


@dataclass(frozen=True)
class Figures:
    bytes: int = 4096
    batches: int = 3
    oldest_age_s: float | None = 12.5
    drops_by_reason: dict[str, int] = field(default_factory=lambda: {"full": 2})
    drop_samples_by_reason: dict[str, int] = field(default_factory=lambda: {"full": 20})
    degraded: str = ""
    memory_batches: int = 0


class FakeBuffer:
    def stats(self) -> Figures:
        return Figures()


@dataclass
class FakeSession:
    connected: bool = True
    reconnects: int = 4


@dataclass
class FakeDmi:
    rpc_counts: dict[str, dict[str, int]]
    registered: bool = True


@dataclass
class Rig:
    clock: FakeClock
    workers: dict[str, GpuWorker]
    collector: Collector
    publisher: Publisher
    inbound: InboundLimiter
    status: StatusSource
    settings: Settings

    def started(self, **parts: Any) -> StatusSource:
        """The status of the same parts with those made at start-up (``driver_version``, ``buffer``, ...)."""
        rig_parts = (self.workers, self.collector, self.publisher, self.inbound, self.clock)
        return StatusSource(self.settings, "9.9.9", *rig_parts, **parts)


@pytest.fixture
def rig() -> Iterator[Rig]:
    clock = FakeClock()
    sim = SimNvml(2, "H100", seed=0, scenario="steady", clock=clock.monotonic)
    backend = NvmlBackend(sim, clock=clock)
    backend.init()
    workers = {
        info.uuid: GpuWorker(
            info=info,
            backend=backend,
            reconciler=Reconciler(backend, info.uuid, clock=clock),
            policies=PolicyEngine(),
            clock=clock,
        )
        for info in backend.list_gpus()
    }
    collector = Collector(workers, backend, clock=clock)
    publisher = Publisher("edge-1", None, clock=clock)
    inbound = InboundLimiter("EventBus messages", 5.0, 10, clock=clock)
    settings = Settings(node_name="edge-1", buffer_max_bytes=1 << 20)
    status = StatusSource(settings, "9.9.9", workers, collector, publisher, inbound, clock)
    yield Rig(clock, workers, collector, publisher, inbound, status, settings)
    backend.shutdown()


def test_before_start_up_the_snapshot_has_the_gpus_and_zeroes_for_the_parts_not_made_yet(rig: Rig) -> None:
    snap = rig.status.snapshot()
    assert snap.node == "edge-1" and snap.version == "9.9.9" and snap.mode == "dmi"
    assert [g.info.uuid for g in snap.gpus] == list(rig.workers)
    assert all(g.sample is None and g.device == "" for g in snap.gpus), "nothing sampled, nothing bound"
    assert (snap.buffer_bytes, snap.buffer_batches, snap.buffer_oldest_age_s) == (0, 0, None)
    assert snap.buffer_max_bytes == 1 << 20
    assert not snap.mqtt_enabled and not snap.mqtt_connected and not snap.dmi_registered
    assert snap.dmi_rpcs == {}
    assert snap.taken_at_ms == rig.clock.wall_ms()
    assert rig.status.mqtt_state() == "off" and rig.status.buffer_batches() == 0


async def test_each_part_made_at_start_up_shows_in_the_snapshot_and_it_survives_json(rig: Rig) -> None:
    uuid = next(iter(rig.workers))
    worker = rig.workers[uuid]
    worker.bind(DeviceConfig("default", "gpu0", "nvidia-gpu", uuid, properties=(DeviceProperty("power_limit"),)))
    await worker.tick()
    rig.collector.xids[uuid] = {79: 2}
    rig.collector.errors["gpu-lost"] = 1
    rig.inbound.dropped["too-large"] = 5
    rig.publisher.policy_events[("thermal", "started")] = 1
    client = FakeDmi({"ReportDeviceStatus": {"ok": 7, "rate_limited": 1}, "MapperRegister": {"ok": 1}})
    server = FakeDmi({"ReportDeviceStatus": {"ok": 2}, "GetDevice": {"ok": 3}}, registered=False)
    status = rig.started(
        driver_version="550.54.15",
        buffer=FakeBuffer(),
        session=FakeSession(connected=False),
        dmi_client=client,
        dmi_server=server,
    )
    status.observe_round(0.003)
    status.observe_round(0.004)

    snap = status.snapshot()
    assert snap.driver_version == "550.54.15"
    assert (snap.buffer_bytes, snap.buffer_batches, snap.buffer_oldest_age_s, snap.buffer_drops) == (
        4096,
        3,
        12.5,
        {"full": 2},
    )
    assert snap.mqtt_enabled and not snap.mqtt_connected and snap.mqtt_reconnects == 4
    assert status.mqtt_state() == "down" and status.buffer_batches() == 3
    assert snap.dmi_registered, "the client's registration, not the server's"
    assert snap.dmi_rpcs == {
        ("ReportDeviceStatus", "ok"): 9,
        ("ReportDeviceStatus", "rate_limited"): 1,
        ("MapperRegister", "ok"): 1,
        ("GetDevice", "ok"): 3,
    }
    assert snap.mqtt_inbound_dropped == {"too-large": 5}
    assert snap.policy_events == {("thermal", "started"): 1}
    assert snap.collect_errors == {"gpu-lost": 1}
    assert snap.collect_duration.count == 2
    gpu0 = next(g for g in snap.gpus if g.info.uuid == uuid)
    assert gpu0.device == "default/gpu0" and gpu0.sample is not None and gpu0.xid_errors == {79: 2}
    assert MapperSnapshot.from_json(snap.to_json()) == snap


def test_rpc_counts_of_client_and_server_add_up_by_method_and_result() -> None:
    assert summed_rpc_counts([]) == {}
    assert summed_rpc_counts([{"A": {"ok": 1}}, {"A": {"ok": 2, "x": 1}}, {"B": {"ok": 0}}]) == {
        ("A", "ok"): 3,
        ("A", "x"): 1,
        ("B", "ok"): 0,
    }


async def test_the_console_prints_a_line_per_gpu_with_the_buffer_and_mqtt_and_beats(rig: Rig) -> None:
    status = rig.started(driver_version="550.54.15", buffer=FakeBuffer(), session=FakeSession(connected=True))
    out = io.StringIO()
    beats: list[tuple[str, float]] = []
    task = asyncio.create_task(run_console(status, 0.01, lambda n, p: beats.append((n, p)), out))
    try:
        await wait_for(lambda: out.getvalue().count("node edge-1") >= 2, what="two tables")
    finally:
        task.cancel()
    tables = out.getvalue().split("\n\n")
    assert "node edge-1  buffer 3 batches  mqtt up" in tables[0]
    lines = tables[0].splitlines()
    assert len(lines) == 2 + len(rig.workers), lines
    assert all(uuid[:22] in tables[0] for uuid in rig.workers)
    assert beats[0] == ("console", 0.01) and len(beats) >= 2
