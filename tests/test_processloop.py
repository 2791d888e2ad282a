"""The process loop on fake time over simulated GPUs: every GPU's report, the processes twin, telemetry rows and
leak events as policy events; a failing GPU leaves the others alone; the snapshot's JSON, the status table and
the settings of the process cycle."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from mapper.clock import FakeClock
from mapper.edge.config import Settings, load_settings
from mapper.edge.control.collect import GpuWorker
from mapper.edge.control.policy import PolicyEngine, PolicyEvent
from mapper.edge.control.reconcile import Reconciler
from mapper.edge.gpu.nvml import NvmlBackend
from mapper.edge.gpu.simnvml import SimNvml
from mapper.edge.processes.loop import LEAK_POLICY, LeakPolicyEvent, ProcessLoop, process_loop
from mapper.edge.processes.monitor import TWIN_MAX_CHARS, GpuWorkloads, PodUse, ProcessRow
from mapper.edge.processes.workloads import PodDirs, PodResolver
from mapper.edge.status.stats import GpuSnapshot, MapperSnapshot
from mapper.edge.status.view import render_status
from mapper.errors import ConfigError, TransientError
from mapper.shared.model import GpuInfo, Sample
from mapper.shared.naming import parse_pod_series

GIB = 1 << 30
TWIN_VALUE = re.compile(r"[a-zA-Z0-9\-_.,:/@#]{1,512}")


def _pod(proc: Path, dirs: PodDirs, pid: int, ns: str, pod: str, container: str, index: int) -> None:
    uid = f"{index:08x}-0000-4000-8000-{index:012x}"
    cid = f"{index:064x}"
    (proc / str(pid)).mkdir(parents=True)
    (proc / str(pid) / "cgroup").write_text(f"0::/kubepods/burstable/pod{uid}/{cid}\n")
    Path(dirs.log_containers).mkdir(parents=True, exist_ok=True)
    (Path(dirs.log_containers) / f"{pod}_{ns}_{container}-{cid}.log").write_text("")


class Outputs:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, list[PolicyEvent]]] = []
        self.rows: list[tuple[str, Sample]] = []

    def publish(self, device_key: str, uuid: str, events: Sequence[PolicyEvent]) -> None:
        self.events.append((device_key, uuid, list(events)))

    def add(self, uuid: str, sample: Sample) -> None:
        self.rows.append((uuid, sample))


class FailingFor:
    """The backend, but the process query of one GPU fails (an NVML error)."""

    def __init__(self, backend: NvmlBackend, uuid: str) -> None:
        self.backend = backend
        self.uuid = uuid

    def processes(self, uuid: str) -> Any:
        if uuid == self.uuid:
            raise TransientError(f"GPU {uuid}: nvmlDeviceGetComputeRunningProcesses_v3 timed out", reason="timeout")
        return self.backend.processes(uuid)


@pytest.fixture
def node(tmp_path: Path, fake_clock: FakeClock) -> Iterator[tuple[SimNvml, NvmlBackend, dict[str, GpuWorker], Path]]:
    sim = SimNvml.from_profiles(["H100", "L4"], seed=1, clock=fake_clock.monotonic, scenario="steady")
    # the counter read at every cycle: the split is compared with the GPU's own power to 1e-6 (between reads the
    # default derives it from the power readings, a 1 s average in mW: test_nvml_contract.py tests that)
    backend = NvmlBackend(sim, clock=fake_clock, energy_read_s=0.0)
    backend.init()
    workers = {
        info.uuid: GpuWorker(
            info=info,
            backend=backend,
            reconciler=Reconciler(backend, info.uuid, clock=fake_clock),
            policies=PolicyEngine(),
            clock=fake_clock,
        )
        for info in backend.list_gpus()
    }
    sim.set_scenario_processes(None, False)
    yield sim, backend, workers, tmp_path
    backend.shutdown()


def make_loop(
    backend: Any, workers: dict[str, GpuWorker], tmp_path: Path, clock: FakeClock, outputs: Outputs, **kw: Any
) -> ProcessLoop:
    return ProcessLoop(
        backend,
        workers,
        clock,
        resolver=PodResolver(PodDirs.under(str(tmp_path / "host"))),
        proc_root=str(tmp_path / "proc"),
        publish_events=outputs.publish,
        add_telemetry=outputs.add,
        **kw,
    )


async def test_each_cycle_reports_every_gpu_sets_its_twin_and_streams_its_pods(
    node: tuple[SimNvml, NvmlBackend, dict[str, GpuWorker], Path], fake_clock: FakeClock
) -> None:
    sim, backend, workers, tmp_path = node
    h100, l4 = list(workers)
    dirs = PodDirs.under(str(tmp_path / "host"))
    outputs = Outputs()
    loop = make_loop(backend, workers, tmp_path, fake_clock, outputs)
    sim.set_utilization(None, 0)
    for _ in range(3):  # idle first: the GPUs' idle power is learnt
        await loop.run_once()
        fake_clock.advance(5.0)
    assert {w.idle_source for w in loop.workloads()} == {"observed-idle"}
    idle_w = {w.uuid: w.idle_power_w for w in loop.workloads()}
    sim.set_utilization(None, None)
    outputs.rows.clear()
    sim.start_process(h100, 501, 20 * GIB, weight=2.0)
    sim.start_process(h100, 502, 4 * GIB, weight=1.0)
    sim.start_process(l4, 601, 2 * GIB)
    _pod(tmp_path / "proc", dirs, 501, "ml", "train-a", "torch", 1)
    _pod(tmp_path / "proc", dirs, 502, "ml", "serve-b", "vllm", 2)
    _pod(tmp_path / "proc", dirs, 601, "ml", "serve-b", "vllm", 3)
    for _ in range(4):
        reports = await loop.run_once()
        fake_clock.advance(5.0)
    assert [r.uuid for r in reports] == [h100, l4] and [w.uuid for w in loop.workloads()] == sorted([h100, l4])
    report = loop.latest[h100]
    pods = {(p.namespace, p.pod, p.container): p for p in report.pods}
    assert set(pods) == {("ml", "train-a", "torch"), ("ml", "serve-b", "vllm")}
    # The SM shares 2 : 1 (NVML's whole percents: 47 and 23 of 70)
    assert pods[("ml", "train-a", "torch")].power_w == pytest.approx(
        2 * pods[("ml", "serve-b", "vllm")].power_w, rel=0.05
    )
    gpu_w = sim.gpu(h100).power_w
    assert math.fsum(p.power_w for p in report.pods) + report.idle_power_w == pytest.approx(gpu_w, rel=1e-6)
    assert report.idle_power_w == pytest.approx(idle_w[h100], rel=1e-6) and report.idle_power_w < 0.5 * gpu_w
    twin = workers[h100].values["processes"]
    assert isinstance(twin, str) and TWIN_VALUE.fullmatch(twin)
    assert twin.startswith("count:2,power:ml/train-a/torch@") and twin.endswith(f"memory:ml/train-a/torch@{20 * GIB}B")
    # One telemetry row per GPU and cycle, with every pod's four series and the GPU-wide ones.
    assert [u for u, _ in outputs.rows] == [h100, l4] * 4
    uuid, row = outputs.rows[-2]
    assert uuid == h100 and row.ts_ms > 0
    fields = {(p[0].name, p[2]) for p in map(parse_pod_series, row.values) if p is not None}
    families = ("gpu_pod_energy_joules", "gpu_pod_power_watts", "gpu_pod_memory_used_bytes")
    families += ("gpu_pod_sm_utilization_ratio",)
    assert fields == {(f, pod) for f in families for pod in ("train-a", "serve-b")}
    assert row.values["processes_count"] == 2
    energy = row.values["pod:energy:ml/train-a/torch"]
    assert isinstance(energy, float) and energy == pytest.approx(pods[("ml", "train-a", "torch")].energy_joules_total)
    assert outputs.events == []
    assert loop.errors == {}


async def test_a_leak_is_published_as_a_policy_event_with_the_process_and_its_pod(
    node: tuple[SimNvml, NvmlBackend, dict[str, GpuWorker], Path], fake_clock: FakeClock
) -> None:
    from mapper.edge.processes.leak import LeakConfig
    from mapper.edge.processes.monitor import ProcessMonitor

    sim, backend, workers, tmp_path = node
    h100 = next(iter(workers))
    sim.start_process(h100, 700, 2 * GIB, growth_bytes_per_s=8 << 20)
    _pod(tmp_path / "proc", PodDirs.under(str(tmp_path / "host")), 700, "ml", "leaky", "app", 7)
    outputs = Outputs()
    monitor = ProcessMonitor(leak=LeakConfig(window_s=300.0, threshold_bytes=GIB))
    loop = make_loop(backend, workers, tmp_path, fake_clock, outputs, monitor=monitor)
    for _ in range(80):
        await loop.run_once()
        fake_clock.advance(5.0)
    [(device_key, uuid, [event])] = outputs.events
    assert device_key == f"_unbound/{h100.lower()}" and uuid == h100
    assert isinstance(event, LeakPolicyEvent) and event.policy == LEAK_POLICY and event.action == "leak-suspected"
    payload = event.to_payload()
    assert payload["pid"] == 700 and (payload["namespace"], payload["pod"], payload["container"]) == (
        "ml",
        "leaky",
        "app",
    )
    assert payload["growthBytes"] >= GIB and payload["memoryUsedBytes"] > 2 * GIB and payload["uuid"] == h100
    json.dumps(payload)  # JSON-ready
    assert loop.latest[h100].leaking_pids == (700,)
    assert str(workers[h100].values["processes"]).endswith(",leak:700")
    # The process ends: the suspicion is cleared, with an event.
    sim.stop_process(h100, 700)
    await loop.run_once()
    assert outputs.events[-1][2][0].action == "leak-cleared" and loop.latest[h100].leaking_pids == ()


async def test_a_gpu_whose_process_query_fails_is_counted_and_the_others_go_on(
    node: tuple[SimNvml, NvmlBackend, dict[str, GpuWorker], Path], fake_clock: FakeClock
) -> None:
    sim, backend, workers, tmp_path = node
    h100, l4 = list(workers)
    sim.start_process(l4, 601, GIB)
    outputs = Outputs()
    loop = make_loop(FailingFor(backend, h100), workers, tmp_path, fake_clock, outputs)
    for _ in range(3):
        reports = await loop.run_once()
        fake_clock.advance(5.0)
    assert [r.uuid for r in reports] == [l4]
    assert loop.errors == {"timeout": 3}
    assert "processes" not in workers[h100].values
    # A pod the mapper cannot name (no hostPID here: pid 601 is not in the proc tree) is reported by pid.
    assert loop.latest[l4].reason == f"pid 601 not visible under {tmp_path / 'proc'} (the mapper needs hostPID: true)"
    # A GPU that left the node leaves no report behind.
    del workers[l4]
    await loop.run_once()
    assert loop.workloads() == () and loop.latest == {}


def test_the_settings_make_the_loop_or_none() -> None:
    settings = load_settings(
        env={"GPU_MAPPER_NODE_NAME": "edge-1", "GPU_MAPPER_PROCESS_INTERVAL_S": "2s", "GPU_MAPPER_PROCESS_TOP_N": "3"}
    )
    loop = process_loop(settings, object(), {}, clock=FakeClock())  # type: ignore[arg-type]
    assert loop is not None and loop.interval_s == 2.0 and loop.monitor.top_n == 3 and loop.proc_root == "/proc"
    assert loop.resolver.dirs == PodDirs()
    assert process_loop(replace(settings, process_interval_s=0), object(), {}, clock=FakeClock()) is None  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="interval_s must be > 0"):
        ProcessLoop(object(), {}, FakeClock(), interval_s=0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"GPU_MAPPER_PROCESS_INTERVAL_S": "10ms"}, r"processes.interval: must be 0 \(off\) or 100ms..1h"),
        ({"GPU_MAPPER_PROCESS_TOP_N": "0"}, "processes.topN: must be 1..100, got 0"),
        ({"GPU_MAPPER_PROCESS_MAX_WORKLOADS": "5000"}, "processes.maxWorkloads: must be 1..1000, got 5000"),
        ({"GPU_MAPPER_LEAK_WINDOW_S": "0"}, "processes.leak: window and threshold must be positive"),
        ({"GPU_MAPPER_LEAK_THRESHOLD_BYTES": "lots"}, "GPU_MAPPER_LEAK_THRESHOLD_BYTES: expected a size"),
    ],
)
def test_bad_process_settings_are_refused_naming_the_key(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_settings(env={"GPU_MAPPER_NODE_NAME": "edge-1", **env})


def test_the_config_file_keys_of_the_process_cycle(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(
        "processes:\n  interval: 10s\n  maxWorkloads: 8\n  procRoot: /host/proc\n  podFilesRoot: /host\n"
        "  leak:\n    enabled: false\n    window: 1h\n    threshold: 2GiB\n"
    )
    s = load_settings(str(path), env={"GPU_MAPPER_NODE_NAME": "edge-1"})
    assert (s.process_interval_s, s.process_max_workloads, s.proc_root, s.pod_files_root) == (
        10.0,
        8,
        "/host/proc",
        "/host",
    )
    assert (s.leak_enabled, s.leak_window_s, s.leak_threshold_bytes) == (False, 3600.0, 2 * GIB)
    assert Settings().process_interval_s == 5.0 and Settings().idle_power_w == {}


async def test_a_configured_idle_power_by_product_name_or_uuid_is_used_instead_of_learnt(
    node: tuple[SimNvml, NvmlBackend, dict[str, GpuWorker], Path], fake_clock: FakeClock, tmp_path: Path
) -> None:
    sim, backend, workers, _ = node
    h100, l4 = list(workers)
    path = tmp_path / "config.yaml"
    path.write_text(f'processes:\n  idlePower:\n    "{workers[h100].info.name}": 70\n    {l4}: 16.5\n')
    settings = load_settings(str(path), env={"GPU_MAPPER_NODE_NAME": "edge-1"})
    assert settings.idle_power_w == {workers[h100].info.name: 70.0, l4: 16.5}
    sim.start_process(h100, 501, GIB)
    sim.start_process(l4, 601, GIB)
    loop = process_loop(settings, backend, workers, clock=fake_clock)
    assert loop is not None
    for _ in range(3):
        await loop.run_once()
        fake_clock.advance(5.0)
    by_uuid = {w.uuid: w for w in loop.workloads()}
    assert (by_uuid[h100].idle_source, by_uuid[h100].idle_power_w) == ("configured", pytest.approx(70.0))
    assert (by_uuid[l4].idle_source, by_uuid[l4].idle_power_w) == ("configured", pytest.approx(16.5))
    path.write_text("processes:\n  idlePower:\n    H100: lots\n")
    with pytest.raises(ConfigError, match=r"processes\.idlePower\.H100: expected a number"):
        load_settings(str(path), env={"GPU_MAPPER_NODE_NAME": "edge-1"})
    path.write_text("processes:\n  idlePower: 70\n")
    with pytest.raises(ConfigError, match=r"processes\.idlePower: expected a mapping"):
        load_settings(str(path), env={"GPU_MAPPER_NODE_NAME": "edge-1"})


def workloads(uuid: str) -> GpuWorkloads:
    return GpuWorkloads(
        uuid,
        ts_ms=1_700_000_000_000,
        process_count=3,
        processes=(ProcessRow(501, "ml", "train-a", "torch", 20 * GIB, 0.5, 200.0), ProcessRow(0, "", "other", "")),
        pods=(
            PodUse("ml", "train-a", "torch", 5000.5, 200.0, 20 * GIB, 1, 0.5),
            PodUse("", "", "", 12.0, 3.5, GIB, 2, None),
        ),
        idle_joules_total=900.0,
        idle_power_w=60.0,
        unattributed_joules_total=1.5,
        idle_source="observed-idle",
        leaking_pids=(501,),
        reason="pod 1234 not found in the kubelet's or edged's files",
        unsupported={"utilization": "not-supported"},
    )


def test_the_snapshot_with_workloads_survives_json_and_an_older_status_file_still_reads() -> None:
    uuid = "GPU-00000000-0000-4000-8000-000000000001"
    snap = MapperSnapshot(
        node="edge-1",
        gpus=(GpuSnapshot(info=GpuInfo(uuid, 0, "H100"), device="default/gpu0"),),
        workloads=(workloads(uuid),),
        process_errors={"timeout": 2},
    )
    assert MapperSnapshot.from_json(snap.to_json()) == snap
    doc = json.loads(snap.to_json())
    del doc["processes"]
    assert MapperSnapshot.from_dict(doc) == replace(snap, workloads=(), process_errors={})


def test_the_status_table_lists_the_top_pods_and_each_gpus_idle_part_and_leaks() -> None:
    uuid = "GPU-00000000-0000-4000-8000-000000000001"
    snap = MapperSnapshot(
        node="edge-1",
        gpus=(GpuSnapshot(info=GpuInfo(uuid, 0, "H100"), device="default/gpu0"),),
        workloads=(workloads(uuid),),
    )
    text = render_status(snap)
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("POD (namespace/pod/container)"))
    assert lines[head + 1].split() == [
        "ml/train-a/torch",
        "gpu0",
        "200.0",
        "W",
        "5.0",
        "kJ",
        "20.0",
        "GiB",
        "50",
        "%",
        "1",
    ]
    assert lines[head + 2].split() == ["(host", "processes)", "gpu0", "3.5", "W", "12", "J", "1.0", "GiB", "-", "2"]
    assert "gpu0: 3 processes, idle 60.0 W (observed-idle), idle energy 900 J, LEAK SUSPECTED: pid 501" in text
    assert render_status(replace(snap, workloads=())).count("POD") == 0


def test_the_twin_stays_a_valid_twin_value_with_long_names_and_many_leaks() -> None:
    long = "a" * 253
    report = GpuWorkloads(
        "GPU-x",
        process_count=400,
        pods=(PodUse(long, long, long, 1.0, 99.5, 80 * GIB, 400, 1.0),),
        leaking_pids=tuple(range(100_000, 100_040)),
    )
    text = report.twin_text()
    assert len(text) <= TWIN_MAX_CHARS and TWIN_VALUE.fullmatch(text)
    assert text.startswith("count:400,power:" + "a" * 120 + "@99.5W") and text.endswith("/100007/#32more")
    odd = replace(report, pods=(PodUse("ns", "pöd", "c c", 1.0, 2.0, 3, 1),), leaking_pids=())
    assert odd.twin_text() == "count:400,power:ns/p_d/c_c@2.0W,memory:ns/p_d/c_c@3B"


async def test_a_cycle_that_fails_unexpectedly_is_logged_counted_and_run_again(
    node: tuple[SimNvml, NvmlBackend, dict[str, GpuWorker], Path],
    fake_clock: FakeClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    import asyncio

    from tests.apphelpers import wait_for

    sim, backend, workers, tmp_path = node
    sim.start_process(next(iter(workers)), 501, GIB)
    outputs = Outputs()
    beats: list[str] = []
    loop = make_loop(backend, workers, tmp_path, fake_clock, outputs, interval_s=0.05)
    loop.beat = lambda name, period_s: beats.append(name)

    def broken(*args: Any) -> Any:
        raise RuntimeError("a file the resolver did not expect")

    loop.resolver.owners = broken  # type: ignore[method-assign]
    task = asyncio.create_task(loop.run())
    try:
        await wait_for(lambda: loop.errors.get("cycle-failed", 0) >= 3, what="three failed cycles")
        assert not task.done() and beats.count("processes") >= 3
        assert sum("the process cycle failed" in r.getMessage() for r in caplog.records) == 1
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
