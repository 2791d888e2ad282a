"""The process cycle end to end on fake time: simulated GPUs running several simulated pods (processes whose
cgroups are a fixture proc tree, pods named from the kubelet's log links), energy attributed to each pod and
summing to the GPU's own counter, bounded series, a leaking process raising its event."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from mapper.clock import FakeClock
from mapper.edge.gpu.nvml import NvmlBackend
from mapper.edge.gpu.simnvml import SimNvml
from mapper.edge.processes.leak import LeakConfig
from mapper.edge.processes.monitor import ProcessMonitor, workload_key
from mapper.edge.processes.workloads import PodDirs, PodInfo, PodResolver, ProcessOwner
from mapper.shared.model import GpuProcess, ProcessSample

GIB = 1 << 30


def _pod(proc: Path, dirs: PodDirs, pid: int, ns: str, pod: str, container: str, index: int) -> None:
    uid = f"{index:08x}-0000-4000-8000-{index:012x}"
    cid = f"{index:064x}"
    d = proc / str(pid)
    d.mkdir(parents=True)
    d.joinpath("cgroup").write_text(
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid.replace('-', '_')}.slice/"
        f"cri-containerd-{cid}.scope\n"
    )
    d.joinpath("comm").write_text("python3\n")
    links = Path(dirs.log_containers)
    links.mkdir(parents=True, exist_ok=True)
    links.joinpath(f"{pod}_{ns}_{container}-{cid}.log").write_text("")


@pytest.fixture
def node(tmp_path: Path, fake_clock: FakeClock) -> Iterator[tuple[SimNvml, NvmlBackend, Path, PodResolver]]:
    sim = SimNvml.from_profiles(["H100", "L4"], seed=3, clock=fake_clock.monotonic, scenario="steady")
    backend = NvmlBackend(sim, clock=fake_clock)
    proc = tmp_path / "proc"
    dirs = PodDirs.under(str(tmp_path / "host"))
    h100, l4 = (g.uuid for g in sim.gpus)
    sim.set_scenario_processes(None, False)
    for index, (uuid, pid, ns, pod, container, mem, weight) in enumerate(
        [
            (h100, 2001, "ml", "trainer-0", "pytorch", 30 * GIB, 3.0),
            (h100, 2002, "ml", "trainer-0", "sidecar", 1 * GIB, 0.5),
            (h100, 2003, "vision", "detector-7f", "triton", 8 * GIB, 1.5),
            (l4, 2101, "vision", "detector-7f", "triton", 4 * GIB, 1.0),
        ],
        start=1,
    ):
        sim.start_process(uuid, pid, mem, weight=weight)
        _pod(proc, dirs, pid, ns, pod, container, index)
    # a host process (no pod) on the L4
    sim.start_process(l4, 2102, GIB // 2, weight=1.0)
    (proc / "2102").mkdir(parents=True)
    (proc / "2102" / "cgroup").write_text("0::/system.slice/ollama.service\n")
    yield sim, backend, proc, PodResolver(dirs)
    backend.shutdown()


def test_pods_energy_and_memory_sum_to_the_gpus_own_figures(
    node: tuple[SimNvml, NvmlBackend, Path, PodResolver], fake_clock: FakeClock
) -> None:
    sim, backend, proc, resolver = node
    monitor = ProcessMonitor(top_n=5)
    first: dict[str, float] = {}
    for step in range(40):
        for gpu in sim.gpus:
            sample = backend.processes(gpu.uuid)
            owners = resolver.owners(str(proc), [p.pid for p in sample.processes], gpu.uuid)
            report, _events = monitor.observe(sample, owners, fake_clock.monotonic())
            first.setdefault(gpu.uuid, sample.energy_j or 0.0)
            last_energy = sample.energy_j or 0.0
            if step == 39:
                pods = {(p.namespace, p.pod, p.container): p for p in report.pods}
                attributed = math.fsum(p.energy_joules_total for p in report.pods)
                total = attributed + report.idle_joules_total + report.unattributed_joules_total
                assert total == pytest.approx(last_energy - first[gpu.uuid], rel=1e-9)
                assert math.fsum(p.memory_used_bytes for p in report.pods) == sum(
                    p.memory_used_bytes or 0 for p in sample.processes
                )
                if gpu.profile.key == "H100":
                    assert set(pods) == {("ml", "trainer-0", "pytorch"), ("ml", "trainer-0", "sidecar"),
                                         ("vision", "detector-7f", "triton")}  # fmt: skip
                    # energy by SM share 3 : 0.5 : 1.5
                    trainer = pods[("ml", "trainer-0", "pytorch")].energy_joules_total
                    detector = pods[("vision", "detector-7f", "triton")].energy_joules_total
                    assert trainer / detector == pytest.approx(2.0, rel=0.05)
                    assert report.idle_joules_total > 0 and report.unattributed_joules_total == 0
                    assert report.process_count == 3 and report.reason == ""
                    top = report.top_by_power
                    assert top is not None and top.pod == "trainer-0" and top.container == "pytorch"
                    assert report.twin_text().startswith("count:3,power:ml/trainer-0/pytorch@")
                else:
                    assert ("", "", "") in pods  # the host process, by itself
                    assert pods[("vision", "detector-7f", "triton")].memory_used_bytes == 4 * GIB
        fake_clock.advance(5.0)


def test_process_series_stay_bounded_with_hundreds_of_short_lived_processes(fake_clock: FakeClock) -> None:
    monitor = ProcessMonitor(top_n=5, max_workloads=16)
    energy = 0.0
    pid = 10_000
    for step in range(300):
        procs = []
        for _ in range(20):  # 20 live processes, each lives one cycle
            pid += 1
            procs.append(GpuProcess(pid, memory_used_bytes=(pid % 7 + 1) * GIB, sm_ratio=(pid % 5) / 10))
        energy += 1500.0
        sample = ProcessSample("GPU-x", step * 5000, tuple(procs), energy_j=energy)
        # every process its own container (outside Kubernetes)
        owners = {p.pid: ProcessOwner(pid=p.pid, container_name=f"c{p.pid}") for p in procs}
        report, _ = monitor.observe(sample, owners, step * 5.0)
        assert len(report.processes) <= 2 * 5 + 1
        assert len(report.pods) <= 16 + 1
        assert report.process_count == 20
        assert sum(r.memory_used_bytes or 0 for r in report.processes) == sum(p.memory_used_bytes or 0 for p in procs)
    total = math.fsum(p.energy_joules_total for p in report.pods)
    assert total + report.idle_joules_total + report.unattributed_joules_total <= energy - 1500.0 + 1e-6


def test_a_leaking_simulated_process_raises_its_event(fake_clock: FakeClock) -> None:
    sim = SimNvml(1, "H100", clock=fake_clock.monotonic, scenario="idle")
    backend = NvmlBackend(sim, clock=fake_clock)
    uuid = sim.gpus[0].uuid
    sim.start_process(uuid, 31, 2 * GIB, growth_bytes_per_s=4 << 20)  # 4 MiB/s: 2.4 GiB in 10 min
    sim.start_process(uuid, 32, 2 * GIB, sawtooth_bytes=3 * GIB, sawtooth_period_s=60.0)
    monitor = ProcessMonitor(leak=LeakConfig(window_s=600.0, threshold_bytes=GIB))
    events = []
    for _ in range(200):
        sample = backend.processes(uuid)
        report, new = monitor.observe(sample, {}, fake_clock.monotonic())
        events += new
        fake_clock.advance(5.0)
    backend.shutdown()
    assert [(e.pid, e.action) for e in events] == [(31, "leak-suspected")]
    assert report.leaking_pids == (31,)
    assert "leak:31" in report.twin_text()


def test_workload_keys() -> None:
    assert workload_key(None).pod == ""
    assert workload_key(ProcessOwner(pid=1)) == workload_key(None)


def test_two_processes_of_one_container_on_one_gpu_are_summed_not_overwritten() -> None:
    """Data-loader workers and torchrun ranks: several processes of one container on one GPU. Figures of a
    real H200 (two PyTorch processes in one container): 691 W drawn, 78 W of it idle, so 613 W belong to the
    container; 12 GB + 7.5 GB = 19.5 GB of memory. Every process's share goes to the container, none is lost."""
    uuid = "GPU-h200"
    monitor = ProcessMonitor(idle_power_w={uuid: 78.0})
    pod = PodInfo(uid="00000000-0000-4000-8000-000000000001", namespace="ml", name="trainer-0")
    owners = {pid: ProcessOwner(pid, pod=pod, container_name="pytorch") for pid in (4101, 4102)}
    procs = (
        GpuProcess(4101, memory_used_bytes=12_000_000_000, sm_ratio=0.55),
        GpuProcess(4102, memory_used_bytes=7_500_000_000, sm_ratio=0.35),
    )

    def observe(step: int):  # one process cycle every 5 s; the GPU draws 691 W throughout
        sample = ProcessSample(uuid, step * 5000, procs, energy_j=1_000_000.0 + 691.0 * 5 * step,
                               utilization_source="processes-utilization-info")  # fmt: skip
        return monitor.observe(sample, owners, step * 5.0)[0]

    observe(0)
    report = observe(1)
    [container] = report.pods
    assert (container.namespace, container.pod, container.container) == ("ml", "trainer-0", "pytorch")
    assert container.processes == 2
    assert container.memory_used_bytes == 19_500_000_000
    assert container.sm_ratio == pytest.approx(0.90)
    assert container.power_w == pytest.approx(613.0)
    assert container.energy_joules_total == pytest.approx(613.0 * 5)
    assert report.idle_joules_total == pytest.approx(78.0 * 5)
    assert report.unattributed_joules_total == 0.0
    # each process keeps its own share in its row
    rows = {r.pid: r for r in report.processes}
    assert rows[4101].power_w == pytest.approx(613.0 * 0.55 / 0.90)
    assert rows[4102].power_w == pytest.approx(613.0 * 0.35 / 0.90)
    # and the container's counter keeps adding both, interval after interval
    report = observe(2)
    assert report.pods[0].energy_joules_total == pytest.approx(613.0 * 10)
    assert report.pods[0].power_w == pytest.approx(613.0)
