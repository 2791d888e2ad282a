"""The health loop over the simulator on fake time: level-2 checks, level-3 probes, the recovery flow; and the
real CUDA probe's child process over a stand-in libcuda."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from mapper.clock import FakeClock
from mapper.edge.control.collect import Collector, GpuWorker, worker_sample
from mapper.edge.control.healthloop import HealthMonitor
from mapper.edge.control.policy import PolicyEngine, PolicyEvent, parse_policies
from mapper.edge.control.reconcile import Reconciler
from mapper.edge.gpu.cudaprobe import CudaProbe, cuda_bus_id
from mapper.edge.gpu.nvml import NvmlBackend
from mapper.edge.gpu.simnvml import SimHost, SimNvml, sim_health_tools
from mapper.edge.health.checks import HealthTools, ProbeResult
from mapper.edge.kubeedge.report import device_twins
from mapper.edge.status.metrics import snapshot_metrics
from mapper.edge.status.source import gpu_snapshot
from mapper.edge.status.stats import MapperSnapshot
from mapper.edge.status.view import render_status
from mapper.shared.model import DeviceConfig, DeviceProperty, GpuEvent
from tests.cuda_standin import build_library


@dataclass
class Rig:
    sim: SimNvml
    clock: FakeClock
    backend: NvmlBackend
    worker: GpuWorker
    monitor: HealthMonitor
    host: SimHost
    events: list[PolicyEvent] = field(default_factory=list)
    process_count: int = 0

    @property
    def uuid(self) -> str:
        return self.worker.uuid

    async def step(self) -> None:
        self.worker._woken = True
        await self.worker.tick()

    def recovery(self) -> list[tuple[str, str]]:
        return [(e.action, e.reason) for e in self.events if e.policy == "recovery"]

    def twin(self, name: str) -> str:
        twins = {t.name: t.reported for t in device_twins(self.worker)}
        return twins[name]


def make_rig(tmp_path: Path, health: dict[str, object] | None = None, *, dry_run: bool = False) -> Rig:
    clock = FakeClock()
    sim = SimNvml(1, "H100", seed=0, clock=clock.monotonic, sleep=clock.advance)
    backend = NvmlBackend(sim, clock=clock)
    info = backend.list_gpus()[0]
    policies = PolicyEngine(parse_policies({"dryRun": dry_run, "health": health or {}}))
    worker = GpuWorker(
        info=info,
        backend=backend,
        reconciler=Reconciler(backend, info.uuid, clock=clock),
        policies=policies,
        clock=clock,
    )
    worker.bind(DeviceConfig("default", "gpu-0", "gpu-model", info.uuid, properties=(DeviceProperty("temperature"),)))
    tools = sim_health_tools(sim, tmp_path / "host")
    rig_events: list[PolicyEvent] = []

    def emit(_w: GpuWorker, events: Sequence[PolicyEvent]) -> None:
        rig_events.extend(events)

    rig = Rig(sim, clock, backend, worker, None, SimHost(sim, tmp_path / "host"), rig_events)  # type: ignore[arg-type]
    rig.monitor = HealthMonitor(
        {info.uuid: worker},
        policies,
        backend,
        tools,
        clock=clock,
        emit=emit,
        processes=lambda _uuid: rig.process_count,
    )
    rig.monitor.attach()
    return rig


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    r = make_rig(tmp_path, {"recovery": {"allowReset": True}})
    yield r
    r.backend.shutdown()


async def settle(r: Rig) -> None:
    """The loop's round, then the GPU's step that takes its results, then any recovery it started, then a step."""
    await r.monitor.run_once()
    await r.step()
    await r.monitor.run_once()
    task = r.monitor.recovering(r.uuid)
    if task is not None:
        await asyncio.wait_for(task, 30)
    await r.step()


# --------------------------------------------------------------------------------------------------
# Done when: a GPU that fails the probe goes unhealthy within one probe and recovers after a reset
# --------------------------------------------------------------------------------------------------


async def test_a_gpu_failing_the_probe_is_unhealthy_within_one_probe_and_recovers_after_a_reset(rig: Rig) -> None:
    await rig.step()
    rig.sim.inject_probe_fault(rig.uuid, "context", until_reset=True)
    await rig.monitor.run_once()  # one probe
    await rig.step()
    assert rig.worker.state == "unhealthy"
    assert rig.twin("health") == "unhealthy:level3:probe-fail-cuCtxCreate-CUDA_ERROR_UNKNOWN"
    assert rig.twin("health_probe").startswith("fail:cuCtxCreate-CUDA_ERROR_UNKNOWN:latency-")
    assert rig.worker.policy_state == "health:unhealthy-probe-fail-cuCtxCreate-CUDA_ERROR_UNKNOWN"
    # the recovery flow: self-check fails again, no process runs, reset allowed -> reset, re-apply, verify
    await rig.monitor.run_once()
    task = rig.monitor.recovering(rig.uuid)
    assert task is not None
    await asyncio.wait_for(task, 30)
    actions = [a for a, _ in rig.recovery()]
    assert actions == ["start", "self-check", "reset", "reapply", "verify", "done"], rig.recovery()
    assert rig.recovery()[-1] == ("done", "recovered")
    assert rig.sim.gpu(rig.uuid).resets == 1
    await rig.step()
    assert rig.worker.state == "online" and rig.twin("health") == "healthy"
    assert rig.twin("health_probe").startswith("pass:latency-")


async def test_without_permission_to_reset_the_flow_stops_and_the_gpu_stays_unhealthy(tmp_path: Path) -> None:
    r = make_rig(tmp_path)  # allowReset defaults to false
    await r.step()
    r.sim.inject_probe_fault(r.uuid, "hang", until_reset=True)
    await settle(r)
    assert r.recovery()[-1] == ("done", "reset-needed-not-allowed")
    assert r.sim.gpu(r.uuid).resets == 0
    assert r.worker.state == "unhealthy" and r.twin("health").startswith("unhealthy:level3:probe-timeout-after-30s")
    r.backend.shutdown()


async def test_a_gpu_with_processes_is_not_reset(rig: Rig) -> None:
    await rig.step()
    rig.process_count = 2
    rig.sim.inject_probe_fault(rig.uuid, "alloc", until_reset=True)
    await settle(rig)
    assert rig.recovery()[-1] == ("done", "reset-needed-2-processes-running")
    assert rig.sim.gpu(rig.uuid).resets == 0


async def test_dry_run_says_what_the_flow_would_do(tmp_path: Path) -> None:
    r = make_rig(tmp_path, {"recovery": {"allowReset": True}}, dry_run=True)
    await r.step()
    r.sim.inject_probe_fault(r.uuid, "context", until_reset=True)
    await settle(r)
    assert r.recovery()[-1] == ("would-reset", "nvidia-smi-r")
    assert all(e.dry_run for e in r.events)
    assert r.sim.gpu(r.uuid).resets == 0
    r.backend.shutdown()


async def test_a_fatal_xid_whose_way_back_is_a_reset_is_reset_even_when_the_probe_passes(rig: Rig) -> None:
    await rig.step()
    rig.worker.pending_events.append(GpuEvent(rig.uuid, 0, "xid", xid=48))
    await rig.step()
    assert rig.worker.state == "unhealthy" and rig.twin("health") == "unhealthy:level1:xid48"
    assert rig.worker.probe_requested and rig.monitor.wake.is_set()
    await settle(rig)
    assert [a for a, _ in rig.recovery()] == ["start", "self-check", "reset", "reapply", "verify", "done"]
    assert rig.worker.state == "online" and rig.twin("health") == "healthy"


async def test_a_reboot_class_fault_ends_the_flow_at_reboot_required(rig: Rig) -> None:
    await rig.step()
    rig.worker.pending_events.append(GpuEvent(rig.uuid, 0, "xid", xid=79))
    await settle(rig)
    assert rig.recovery()[-1] == ("reboot-required", "xid79")
    assert rig.sim.gpu(rig.uuid).resets == 0


# --------------------------------------------------------------------------------------------------
# The probe's schedule
# --------------------------------------------------------------------------------------------------


async def test_the_probe_runs_on_its_interval_and_soon_after_an_xid(rig: Rig) -> None:
    await rig.step()
    await rig.monitor.run_once()
    assert rig.monitor.probe_counts(rig.uuid) == {"pass": 1}
    rig.clock.advance(599.0)
    await rig.monitor.run_once()
    assert rig.monitor.probe_counts(rig.uuid) == {"pass": 1}
    rig.clock.advance(1.0)
    assert rig.monitor.next_due_s() <= rig.clock.monotonic()
    await rig.monitor.run_once()
    assert rig.monitor.probe_counts(rig.uuid) == {"pass": 2}
    rig.worker.pending_events.append(GpuEvent(rig.uuid, 0, "xid", xid=31))  # an application error
    await rig.step()
    rig.clock.advance(5.0)
    await rig.monitor.run_once()
    assert rig.monitor.probe_counts(rig.uuid) == {"pass": 3}, "an XID brings the probe forward"


async def test_the_probe_is_skipped_while_the_gpu_is_busier_than_the_threshold(rig: Rig) -> None:
    rig.sim.set_utilization(rig.uuid, 90)
    rig.clock.advance(5.0)
    await rig.step()
    await rig.monitor.run_once()
    await rig.step()
    assert rig.twin("health_probe") == "skipped:busy-90pct"
    assert rig.worker.state == "online" and rig.sim.gpu(rig.uuid).resets == 0


async def test_a_slow_probe_degrades_the_gpu_and_a_hang_times_out(tmp_path: Path) -> None:
    r = make_rig(tmp_path, {"probe": {"slowAbove": "2s", "timeout": "10s"}})
    await r.step()
    r.sim.inject_probe_fault(r.uuid, "slow", count=1, seconds=3.0)
    await r.monitor.run_once()
    await r.step()
    assert r.twin("health") == "degraded:level3:probe-slow-above-2s"
    assert r.worker.state == "online"
    r.sim.inject_probe_fault(r.uuid, "hang", count=1)
    r.clock.advance(60.0)
    before = r.clock.monotonic()
    await r.monitor.run_once()
    await r.step()
    assert r.twin("health_probe") == "timeout:after-10s:latency-10s"
    assert r.clock.monotonic() - before >= 10.0, "the simulated probe waits out its timeout"
    r.backend.shutdown()


async def test_a_lost_gpu_is_not_probed_and_level1_reports_it(rig: Rig) -> None:
    await rig.step()
    rig.sim.inject_gpu_lost(rig.uuid)
    rig.clock.advance(2.0)
    await rig.step()
    await rig.monitor.run_once()
    assert rig.monitor.probe_counts(rig.uuid) == {}
    assert rig.worker.state == "offline"


# --------------------------------------------------------------------------------------------------
# Level 2
# --------------------------------------------------------------------------------------------------


async def test_the_driver_checks_report_each_fault_with_its_reason(tmp_path: Path) -> None:
    r = make_rig(tmp_path, {"checks": {"persistence": True}, "probe": {"enabled": False}})
    await r.step()
    await r.monitor.run_once()
    await r.step()
    report = r.worker.health
    assert report.status == "healthy"
    assert [c.name for c in report.checks] == [
        "nvml-responsive",
        "inforom",
        "device-nodes",
        "driver-version",
        "persistenced",
    ]
    inforom = dict(next(c for c in report.checks if c.name == "inforom").detail)
    assert inforom["image_version"] == "G520.0200.00.05" and inforom["power_version"] == "N/A"

    faults = [
        (lambda: r.sim.inject_inforom_corrupt(r.uuid), "unhealthy:level2:inforom-corrupted"),
        (lambda: r.host.remove_device_node("nvidia-uvm"), "unhealthy:level2:missing-nvidia-uvm"),
        (lambda: r.host.set_kernel_module_version("580.95.05"), "unhealthy:level2:kernel-580.95.05-nvml-590.48.01"),
        (lambda: r.host.stop_persistenced(), "degraded:level2:persistenced-not-running"),
    ]
    undo = [
        lambda: r.sim.inject_inforom_corrupt(r.uuid, False),
        lambda: r.host.populate(),
        lambda: r.host.set_kernel_module_version("590.48.01"),
        lambda: r.host.start_persistenced(),
    ]
    for (inject, expected), fix in zip(faults, undo, strict=True):
        inject()
        r.clock.advance(60.0)
        await r.monitor.run_once()
        await r.step()
        assert r.twin("health") == expected
        fix()
        r.clock.advance(60.0)
        await r.monitor.run_once()
        await r.step()
        assert r.twin("health") == "healthy", expected
    r.backend.shutdown()


async def test_nvml_slower_than_its_deadline_is_degraded(tmp_path: Path) -> None:
    clock = FakeClock()
    sim = SimNvml(1, "H100", clock=clock.monotonic)  # real sleeps: the check times NVML on the wall clock
    backend = NvmlBackend(sim, clock=clock)
    info = backend.list_gpus()[0]
    policies = PolicyEngine(parse_policies({"health": {"checks": {"nvmlDeadline": "20ms"}}}))
    worker = GpuWorker(info, backend, Reconciler(backend, info.uuid, clock=clock), policies, clock)
    monitor = HealthMonitor({info.uuid: worker}, policies, backend, sim_health_tools(sim, tmp_path), clock=clock)
    sim.set_call_delay_s(0.05, "nvmlDeviceValidateInforom")
    checks = await monitor.run_checks(worker, policies.config_for(info.uuid))
    assert checks is not None
    responsive = checks[0]
    assert responsive.name == "nvml-responsive" and responsive.status == "degraded"
    assert responsive.reason.startswith("nvml-slow-")
    backend.shutdown()


# --------------------------------------------------------------------------------------------------
# The levels in /metrics, /status and `gpu-mapper status`
# --------------------------------------------------------------------------------------------------


async def test_the_three_levels_show_in_metrics_status_and_the_status_table(rig: Rig) -> None:
    await rig.step()
    rig.sim.inject_probe_fault(rig.uuid, "context", until_reset=True)
    await rig.monitor.run_once()
    await rig.step()
    snap = MapperSnapshot(node="n", gpus=(gpu_snapshot(rig.worker, "n", {}, rig.monitor.probe_counts(rig.uuid)),))
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value for fam in snapshot_metrics(snap) for s in fam.samples
    }

    def value(name: str, **labels: str) -> float:
        hits = [v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items()]
        assert len(hits) == 1, (name, labels, hits)
        return hits[0]

    assert value("gpu_mapper_health_status", level="3", status="unhealthy") == 1
    assert value("gpu_mapper_health_status", level="0", status="unhealthy") == 1
    assert value("gpu_mapper_health_status", level="1", status="healthy") == 1
    assert value("gpu_mapper_health_subsystem_status", subsystem="cuda", status="unhealthy") == 1
    assert value("gpu_mapper_health_check_status", check="inforom", status="healthy") == 1
    assert value("gpu_mapper_health_probe_success") == 0
    assert value("gpu_mapper_health_probes_total", outcome="fail") == 1
    assert value("gpu_inforom_info", image_version="G520.0200.00.05") == 1
    back = MapperSnapshot.from_json(snap.to_json())
    assert back.gpus[0].health == snap.gpus[0].health
    table = render_status(back)
    assert "HEALTH L1/L2/L3" in table
    assert "unhealthy ok/ok/unhealthy (probe-fail-cuCtxCreate-CUDA_ERROR_UNKNOWN)" in table
    assert worker_sample(rig.worker).values["health"] == "unhealthy:level3:probe-fail-cuCtxCreate-CUDA_ERROR_UNKNOWN"


# --------------------------------------------------------------------------------------------------
# The real probe: a child process over a stand-in libcuda
# --------------------------------------------------------------------------------------------------

BUS = "00000000:3B:00.0"
UUID = "GPU-0123abcd-0000-4000-8000-00000000beef"


@pytest.fixture(scope="module")
def libcuda(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_library(tmp_path_factory.mktemp("cuda-standin"))


def standin_probe(libcuda: Path, **env: str) -> CudaProbe:
    base = {"CUDA_STANDIN_BUS": cuda_bus_id(BUS), "CUDA_STANDIN_UUID": UUID[4:].replace("-", "")}
    return CudaProbe(str(libcuda), env={**base, **env})


def test_cuda_spells_the_bus_id_with_a_four_digit_domain() -> None:
    assert cuda_bus_id("00000000:3B:00.0") == "0000:3B:00.0"


@pytest.mark.parametrize(
    ("fault", "outcome", "reason"),
    [
        ("", "pass", ""),
        ("init", "fail", "cuInit-CUDA_ERROR_NO_DEVICE"),
        ("context", "fail", "cuCtxCreate-CUDA_ERROR_UNKNOWN"),
        ("alloc", "fail", "cuMemAlloc-CUDA_ERROR_OUT_OF_MEMORY"),
        ("copy", "fail", "cuMemcpyDtoH-data-mismatch"),
        ("crash", "fail", "probe-killed-by-signal-6"),
    ],
)
def test_the_probe_process_reports_each_cuda_step(libcuda: Path, fault: str, outcome: str, reason: str) -> None:
    result = standin_probe(libcuda, CUDA_STANDIN_FAULT=fault).probe(UUID, BUS, 60.0)
    assert (result.outcome, result.reason) == (outcome, reason)
    assert result.latency_s is not None and result.latency_s > 0


def test_the_probe_checks_the_device_is_the_gpu_nvml_names(libcuda: Path) -> None:
    other = "GPU-ffffffff-0000-4000-8000-00000000beef"
    assert standin_probe(libcuda).probe(other, BUS, 60.0).reason == "uuid-mismatch"
    assert standin_probe(libcuda).probe(UUID, "00000000:3C:00.0", 60.0).reason == (
        "cuDeviceGetByPCIBusId-CUDA_ERROR_INVALID_DEVICE"
    )


def test_a_hung_probe_process_is_killed_at_the_timeout(libcuda: Path) -> None:
    result = standin_probe(libcuda, CUDA_STANDIN_FAULT="hang").probe(UUID, BUS, 1.5)
    assert (result.outcome, result.reason) == ("timeout", "after-1.5s")
    assert result.latency_s is not None and result.latency_s >= 1.5


def test_no_libcuda_skips_the_probe_without_a_verdict_on_the_gpu(tmp_path: Path) -> None:
    result = CudaProbe(str(tmp_path / "libcuda.so.1")).probe(UUID, BUS, 60.0)
    assert (result.outcome, result.reason, result.status) == ("skipped", "libcuda-not-found", None)


class _NoCuda:
    """The probe where the container has no libcuda: skipped, as ``CudaProbe`` answers."""

    def __init__(self) -> None:
        self.runs = 0

    def probe(self, uuid: str, pci_bus_id: str, timeout_s: float) -> ProbeResult:
        self.runs += 1
        return ProbeResult("skipped", "libcuda-not-found")


async def test_without_libcuda_the_probe_is_skipped_on_the_normal_interval_and_no_verdict(rig: Rig) -> None:
    no_cuda = _NoCuda()
    rig.monitor.tools = HealthTools(no_cuda, rig.monitor.tools.host_root, rig.monitor.tools.tools)
    await rig.step()
    await rig.monitor.run_once()
    await rig.step()
    assert rig.twin("health_probe") == "skipped:libcuda-not-found" and rig.twin("health") == "healthy"
    rig.clock.advance(599.0)
    await rig.monitor.run_once()
    assert no_cuda.runs == 1, "not retried every minute"
    rig.clock.advance(1.0)
    await rig.monitor.run_once()
    assert no_cuda.runs == 2


async def test_a_fault_a_reset_cannot_mend_is_not_reset(rig: Rig) -> None:
    await rig.step()
    rig.host.set_kernel_module_version("580.95.05")
    await settle(rig)
    assert rig.twin("health") == "unhealthy:level2:kernel-580.95.05-nvml-590.48.01"
    assert rig.recovery()[-1] == ("done", "driver-version-kernel-580.95.05-nvml-590.48.01-needs-driver-reload")
    assert rig.sim.gpu(rig.uuid).resets == 0


async def test_a_requested_probe_on_a_busy_gpu_waits_for_the_retry_interval_instead_of_spinning(rig: Rig) -> None:
    rig.sim.set_utilization(rig.uuid, 90)
    rig.clock.advance(5.0)
    await rig.step()
    rig.worker.pending_events.append(GpuEvent(rig.uuid, 0, "ecc_single"))
    await rig.step()
    assert rig.worker.probe_requested
    await rig.monitor.run_once()
    assert rig.monitor.probe_counts(rig.uuid) == {"skipped": 1}
    assert rig.monitor.next_due_s() >= rig.clock.monotonic() + 59.0, "the loop sleeps until the retry"
    rig.sim.set_utilization(rig.uuid, 0)
    rig.clock.advance(60.0)
    await rig.step()
    await rig.monitor.run_once()
    assert rig.monitor.probe_counts(rig.uuid) == {"skipped": 1, "pass": 1}
    assert not rig.worker.probe_requested


async def test_a_reset_of_one_gpu_reapplies_its_settings_and_leaves_the_other_gpus_alone(tmp_path: Path) -> None:
    clock = FakeClock()
    sim = SimNvml(2, "H100", seed=0, clock=clock.monotonic, sleep=clock.advance)
    sim.set_scenario_processes(None, False)
    backend = NvmlBackend(sim, clock=clock)
    infos = backend.list_gpus()
    policies = PolicyEngine(parse_policies({"health": {"recovery": {"allowReset": True}}}))
    workers = {i.uuid: GpuWorker(i, backend, Reconciler(backend, i.uuid, clock=clock), policies, clock) for i in infos}
    a, b = (workers[i.uuid] for i in infos)
    policies.set_override(b.uuid, {"health": {"recovery": {"allowReset": False}}})
    events: list[PolicyEvent] = []
    monitor = HealthMonitor(
        workers,
        policies,
        backend,
        sim_health_tools(sim, tmp_path),
        clock=clock,
        emit=lambda _w, evs: events.extend(evs),
        processes=lambda uuid: len(backend.processes(uuid).processes),
    )
    monitor.attach()

    collector = Collector(workers, backend, clock=clock)

    async def step_all() -> None:
        clock.advance(1.0)
        for w in (a, b):
            w._woken = True
            await w.tick()
        collector.route_events(backend.poll_events())  # NVML's events to their GPUs, as the collector does

    a.desired.set_many({"locked_gpu_clock_min": 1005, "locked_gpu_clock_max": 1500}, "cloud", 1)
    await step_all()
    assert sim.gpu(a.uuid).locked_gpu_clocks == (1005, 1500)
    b.pending_events.append(GpuEvent(b.uuid, 0, "xid", xid=48))
    await step_all()
    assert b.health.reason == "xid48"
    sim.inject_probe_fault(a.uuid, "context", until_reset=True)
    await monitor.run_once()
    await step_all()
    await monitor.run_once()
    for uuid in (a.uuid, b.uuid):
        task = monitor.recovering(uuid)
        if task is not None:
            await asyncio.wait_for(task, 30)
    assert sim.gpu(a.uuid).resets == 1 and sim.gpu(b.uuid).resets == 0
    assert sim.gpu(a.uuid).locked_gpu_clocks is None, "the reset took the locks"
    for _ in range(15):  # past the energy counter's cycle: its restart at 0 is this reset, not a driver reload
        await step_all()
    assert sim.gpu(a.uuid).locked_gpu_clocks == (1005, 1500), "re-applied after the reset"
    assert a.health.status == "healthy"
    assert b.health.reason == "xid48", "another GPU's fault is not cleared by this GPU's reset"
    backend.shutdown()
