"""Who uses the GPU, through the whole mapper: simulated GPUs running several simulated pods (their cgroups a
fixture proc tree, their names from the kubelet's log links), a real mosquitto, the real HTTP ``/metrics`` and
``/status``. Each pod's GPU memory, utilisation, power and energy show in ``/metrics``, in the ``processes`` twin
and in the telemetry stream, summing to the GPU's own figures; a leaking process raises its event."""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
import urllib.request
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mapper.edge.app import build_backend
from mapper.edge.config import Settings
from mapper.edge.gpu.nvml import NvmlBackend
from mapper.edge.gpu.simnvml import SimNvml
from mapper.edge.processes.loop import telemetry_values
from mapper.edge.processes.workloads import PodDirs
from mapper.shared.naming import parse_pod_series, pod_series
from mapper.shared.settings import MqttSettings
from mapper.wire.telemetry import decode_batch
from tests.apphelpers import fast_settings, running_app, wait_for
from tests.test_app_eventbus import Listener

GIB = 1 << 30
REPO = Path(__file__).resolve().parents[1]
TWIN_VALUE = re.compile(r"[a-zA-Z0-9\-_.,:/@#]{1,512}")

DEVICE = """
apiVersion: devices.kubeedge.io/v1beta1
kind: Device
metadata: {{name: {name}, namespace: default}}
spec:
  deviceModelRef: {{name: nvidia-gpu}}
  nodeName: edge-1
  protocol: {{protocolName: gpu, configData: {{uuid: {uuid}}}}}
  properties:
  - {{name: power_usage, collectCycle: 100, reportCycle: 300, reportToCloud: true}}
  - {{name: energy_consumption, collectCycle: 100, reportCycle: 300, reportToCloud: true}}
  - {{name: memory_used, collectCycle: 100, reportCycle: 300, reportToCloud: true}}
  - {{name: utilization_gpu, collectCycle: 100, reportCycle: 300, reportToCloud: true}}
  - {{name: processes, reportCycle: 300, reportToCloud: true}}
"""


class SimTime:
    """The simulator's clock: real time, or held still (the GPUs' counters stop) while the test compares."""

    def __init__(self) -> None:
        self.held: float | None = None

    def __call__(self) -> float:
        return self.held if self.held is not None else time.monotonic() - self.offset

    offset = 0.0

    def hold(self) -> None:
        self.held = self()

    def release(self) -> None:
        assert self.held is not None
        self.offset = time.monotonic() - self.held
        self.held = None


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


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return str(resp.read().decode())


def scrape(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """``/metrics`` parsed (call it in a thread: the mapper answers from the event loop)."""
    text = fetch(url + "/metrics")
    out: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name].append((s.labels, s.value))
    return out


async def settled(url: str, check: Callable[[dict[str, list[tuple[dict[str, str], float]]]], None]) -> None:
    """Scrape until ``check`` passes (a figure of the last cycle may lag the GPU's by one cycle), at most 15 s."""
    deadline = time.monotonic() + 15
    while True:
        m = await asyncio.to_thread(scrape, url)
        try:
            check(m)
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
        await asyncio.sleep(0.2)


def by_gpu(metrics: dict[str, list[tuple[dict[str, str], float]]], name: str, uuid: str) -> list[tuple[dict, float]]:
    return [(labels, v) for labels, v in metrics.get(name, []) if labels["uuid"] == uuid]


def one(metrics: dict[str, list[tuple[dict[str, str], float]]], name: str, uuid: str) -> float:
    (only,) = by_gpu(metrics, name, uuid)
    return only[1]


def total(metrics: dict[str, list[tuple[dict[str, str], float]]], name: str, uuid: str) -> float:
    return math.fsum(v for _, v in by_gpu(metrics, name, uuid))


@pytest.mark.timeout(120)
async def test_each_pods_share_of_the_gpu_shows_everywhere_and_sums_to_the_gpus_own_figures(
    mosquitto, tmp_path: Path
) -> None:
    sim_time = SimTime()
    sim = SimNvml.from_profiles(["H100", "L4"], seed=3, scenario="steady", clock=sim_time)
    h100, l4 = (g.uuid for g in sim.gpus)
    # No load and no process first: the mapper learns each GPU's idle power.
    sim.set_scenario_processes(None, False)
    sim.set_utilization(None, 0)
    proc = tmp_path / "proc"
    proc.mkdir()
    host = tmp_path / "host"
    dirs = PodDirs.under(str(host))
    devices = tmp_path / "devices"
    devices.mkdir()
    for name, uuid in (("gpu0", h100), ("gpu1", l4)):
        (devices / f"{name}.yaml").write_text(DEVICE.format(name=name, uuid=uuid))
    settings = fast_settings(
        str(tmp_path / "data"),
        devices_dir=str(devices),
        mqtt=MqttSettings(url=mosquitto.url),
        process_interval_s=0.25,
        proc_root=str(proc),
        pod_files_root=str(host),
        leak_window_s=3.0,
        leak_threshold_bytes=256 << 20,
    )
    listener = Listener(mosquitto.port, "$hw/events/device/#", "gpu-mapper/#")
    try:
        # The counter read at every sample: below, the GPUs' time is held while the mapper's runs on, and a counter
        # derived from power between reads (the default, its own tests in test_nvml_contract.py) integrates over
        # the mapper's time.
        async with running_app(settings, sim, energy_read_s=0.0) as app:
            assert app.processes is not None and app.metrics is not None
            url = app.metrics.url
            loop = app.processes
            await wait_for(
                lambda: all(w.idle_source == "observed-idle" for w in loop.workloads()) and len(loop.workloads()) == 2,
                what="an idle interval of each GPU",
            )
            # The pods start; the GPUs run at 70 %, shared by the processes' weights.
            for index, (uuid, pid, ns, pod, container, mem, weight) in enumerate(
                [
                    (h100, 2001, "ml", "trainer-0", "pytorch", 30 * GIB, 3.0),
                    (h100, 2002, "ml", "trainer-0", "sidecar", 1 * GIB, 0.5),
                    (h100, 2003, "vision", "detector-7f", "triton", 8 * GIB, 1.5),
                    (l4, 2101, "vision", "detector-7f", "triton", 4 * GIB, 1.0),
                    (l4, 2102, "ml", "leaky-0", "app", 2 * GIB, 1.0),
                ],
                start=1,
            ):
                growth = 200 << 20 if pid == 2102 else 0.0  # 200 MiB/s: a leak
                sim.start_process(uuid, pid, mem, weight=weight, growth_bytes_per_s=growth)
                _pod(proc, dirs, pid, ns, pod, container, index)
            sim.set_utilization(None, None)

            # The leak: an MQTT event of the gpu-memory-leak policy on the Device's events topic, and its metrics.
            events = await wait_for(
                lambda: [
                    json.loads(p)
                    for t, p in listener.drain()
                    if t == "gpu-mapper/edge-1/default/gpu1/events" and json.loads(p)["policy"] == "gpu-memory-leak"
                ],
                timeout_s=30,
                what="the leak event",
            )
            leak = events[0]
            assert leak["action"] == "leak-suspected" and leak["uuid"] == l4 and leak["pid"] == 2102
            assert (leak["namespace"], leak["pod"], leak["container"]) == ("ml", "leaky-0", "app")
            assert leak["growthBytes"] >= 256 << 20 and leak["node"] == "edge-1" and leak["device"] == "default/gpu1"
            assert not any(e["pid"] != 2102 for e in events), "only the leaking process raises an event"
            m = await asyncio.to_thread(scrape, url)
            (suspected,) = by_gpu(m, "gpu_process_memory_leak_suspected", l4)
            assert suspected[0]["pid"] == "2102" and suspected[0]["pod"] == "leaky-0" and suspected[1] == 1
            assert not by_gpu(m, "gpu_process_memory_leak_suspected", h100)
            counted = [v for labels, v in m["gpu_mapper_policy_events_total"] if labels["policy"] == "gpu-memory-leak"]
            assert counted == [1.0]

            # Running: per GPU, the pods' SM shares sum to the GPU's utilisation, and the pods' power with the
            # idle part to the GPU's power (steady load: the interval's mean is the reading).
            await wait_for(
                lambda: all(
                    p.sm_ratio is not None and p.power_w > 0 for w in loop.workloads() if w.uuid == h100 for p in w.pods
                ),
                what="a whole interval with the pods",
            )

            def running(m: dict[str, list[tuple[dict[str, str], float]]]) -> None:
                for uuid in (h100, l4):
                    pods = {
                        (x["namespace"], x["pod"], x["container"]) for x, _ in by_gpu(m, "gpu_pod_power_watts", uuid)
                    }
                    want = {
                        h100: {("ml", "trainer-0", "pytorch"), ("ml", "trainer-0", "sidecar"),
                               ("vision", "detector-7f", "triton")},
                        l4: {("vision", "detector-7f", "triton"), ("ml", "leaky-0", "app")},
                    }[uuid]  # fmt: skip
                    assert pods == want
                    sm = total(m, "gpu_pod_sm_utilization_ratio", uuid)
                    assert sm == pytest.approx(one(m, "gpu_utilization_ratio", uuid), abs=0.01 * len(want))
                    assert total(m, "gpu_process_sm_utilization_ratio", uuid) == pytest.approx(sm, abs=1e-9)
                    power = total(m, "gpu_pod_power_watts", uuid) + one(m, "gpu_idle_power_watts", uuid)
                    assert power == pytest.approx(one(m, "gpu_power_usage_watts", uuid), rel=0.05)
                    assert one(m, "gpu_processes", uuid) == len(want)
                h100_pods = {x["container"]: v for x, v in by_gpu(m, "gpu_pod_power_watts", h100)}
                assert h100_pods["pytorch"] / h100_pods["triton"] == pytest.approx(2.0, rel=0.1)  # SM shares 3 : 1.5

            await settled(url, running)

            # Held still: memory and energy compared exactly with the GPU's own counters.
            async def held() -> dict[str, list[tuple[dict[str, str], float]]]:
                sim_time.hold()
                since_ms = time.time() * 1000
                await wait_for(
                    lambda: (
                        all(w.ts_ms > since_ms + 300 for w in loop.workloads())
                        and all(w.values_ts_ms > since_ms + 300 for w in app.workers.values())
                    ),
                    what="a process cycle and a sample after the GPUs' time stopped",
                )
                return await asyncio.to_thread(scrape, url)

            first = await held()
            sim_time.release()
            released_ms = time.time() * 1000
            await wait_for(
                lambda: all(
                    w.ts_ms > released_ms + 600 and any(p.power_w > 0 for p in w.pods) for w in loop.workloads()
                ),
                what="the GPUs to run again",
            )
            second = await held()
            for uuid in (h100, l4):
                for m in (first, second):
                    memory = total(m, "gpu_pod_memory_used_bytes", uuid)
                    assert memory == total(m, "gpu_process_memory_used_bytes", uuid)
                    driver_part = one(m, "gpu_memory_used_bytes", uuid) - memory
                    assert 0 <= driver_part <= 0.01 * one(m, "gpu_memory_total_bytes", uuid)

                def attributed(m: dict[str, list[tuple[dict[str, str], float]]], uuid: str = uuid) -> float:
                    return math.fsum(
                        [
                            total(m, "gpu_pod_energy_joules_total", uuid),
                            one(m, "gpu_idle_energy_joules_total", uuid),
                            one(m, "gpu_unattributed_energy_joules_total", uuid),
                        ]
                    )

                counter = one(second, "gpu_energy_consumption_joules_total", uuid) - one(
                    first, "gpu_energy_consumption_joules_total", uuid
                )
                assert counter > 0
                assert attributed(second) - attributed(first) == pytest.approx(counter, rel=1e-6, abs=1e-3)
                assert one(second, "gpu_unattributed_energy_joules_total", uuid) == pytest.approx(0.0, abs=1e-3)

            # The processes twin: the count and the top container by power and by memory, a valid twin value.
            twins = [
                json.loads(p)["twin"]["processes"]["actual"]["value"]
                for t, p in listener.drain()
                if t == "$hw/events/device/default/gpu0/twin/update" and "processes" in json.loads(p)["twin"]
            ]
            assert twins and all(TWIN_VALUE.fullmatch(t) for t in twins)
            running = [t for t in twins if t.startswith("count:3,power:ml/trainer-0/pytorch@")]
            assert running, twins
            assert ",memory:ml/trainer-0/pytorch@32212254720B" in running[-1]
            l4_twins = await wait_for(
                lambda: [
                    json.loads(p)["twin"]["processes"]["actual"]["value"]
                    for t, p in listener.drain()
                    if t == "$hw/events/device/default/gpu1/twin/update" and "processes" in json.loads(p)["twin"]
                ],
                what="the twins of gpu1",
            )
            assert any(t.endswith(",leak:2102") for t in l4_twins), l4_twins

            # The telemetry stream carries every pod's series and the GPU's idle and unattributed energy.
            batches = [decode_batch(p) for t, p in listener.drain() if t == "gpu-mapper/edge-1/default/gpu0/telemetry"]
            names = {name for b in batches for s in b.samples for name in s.values}
            parsed = {parse_pod_series(n) for n in names} - {None}
            seen = {(fam.name, ns, pod, c) for fam, ns, pod, c in parsed if fam is not None}  # type: ignore[misc]
            for fam in ("gpu_pod_energy_joules", "gpu_pod_power_watts", "gpu_pod_memory_used_bytes"):
                assert (fam, "ml", "trainer-0", "pytorch") in seen
            assert {"processes_count", "processes_idle_energy", "processes_unattributed_energy"} <= names

            # gpu-mapper status: the top pods.
            text = await asyncio.to_thread(fetch, url + "/status?format=text")
            assert "ml/trainer-0/pytorch" in text and "vision/detector-7f/triton" in text
            assert "LEAK SUSPECTED: pid 2102" in text
    finally:
        listener.close()


@pytest.mark.timeout(60)
async def test_the_processes_twin_goes_to_edgecore_over_dmi_as_a_twin_it_accepts(sock_dir: str, tmp_path: Path) -> None:
    from tests.fake_edgecore import FakeEdgeCore, pb_device, pb_model

    sim = SimNvml(1, "H100", seed=0, scenario="steady")
    uuid = sim.gpus[0].uuid
    sim.set_scenario_processes(None, False)
    proc = tmp_path / "proc"
    host = tmp_path / "host"
    dirs = PodDirs.under(str(host))
    long_pod = "inference-" + "x" * 140  # a pod name of 150 characters: the twin cuts names to 120
    for index, (pid, pod, container, mem) in enumerate(
        [(3001, long_pod, "vllm", 20 * GIB), (3002, "etl-0", "job", GIB)]
    ):
        sim.start_process(uuid, pid, mem, weight=2.0 - index)
        _pod(proc, dirs, pid, "ml", pod, container, index + 1)
    edge = FakeEdgeCore(f"{sock_dir}/dmi.sock")
    edge.devices = [pb_device("gpu0", uuid, properties={"power_usage": None, "processes": None}, cycle_ms=200)]
    edge.models = [pb_model(props={"power_usage": "FLOAT", "processes": "STRING"})]
    await edge.start()
    settings = fast_settings(
        str(tmp_path / "data"),
        edgecore_socket=edge.socket_path,
        socket=f"{sock_dir}/gpu.sock",
        process_interval_s=0.25,
        proc_root=str(proc),
        pod_files_root=str(host),
    )
    try:
        async with running_app(settings, sim):

            def processes_twins() -> list[str]:
                return [
                    t.reported.value
                    for r in edge.rec.statuses
                    for t in r.reportedDevice.twins
                    if t.propertyName == "processes" and ",power:" in t.reported.value
                ]

            twins = await wait_for(processes_twins, what="a processes twin with the top pod by power")
            cut = f"ml/{long_pod}/vllm"[:120]
            assert twins[-1].startswith(f"count:2,power:{cut}@")
            assert f",memory:{cut}@{20 * GIB}B" in twins[-1]
            assert TWIN_VALUE.fullmatch(twins[-1])
            assert edge.rec.twin_rejections == [] and edge.rec.violations == []
    finally:
        await edge.stop()


def demo_settings(tmp_path: Path, **overrides: Any) -> tuple[SimNvml, Settings]:
    """``gpu-mapper run --sim 2 --sim-scenario inference`` on the demo's Devices (two inference servers a GPU), and
    its simulator, as ``mapper.edge.app.build_backend`` makes it."""
    settings = fast_settings(
        str(tmp_path / "data"),
        sim=2,
        sim_scenario="inference",
        node_name="demo-node",
        devices_dir=str(REPO / "device-models" / "examples"),
        process_interval_s=0.25,
        **overrides,
    )
    backend = build_backend(settings)
    assert isinstance(backend, NvmlBackend) and isinstance(backend.nvml, SimNvml)
    return backend.nvml, settings


@pytest.mark.timeout(60)
async def test_with_sim_defaults_the_simulated_processes_pods_are_named_everywhere(tmp_path: Path) -> None:
    sim, settings = demo_settings(tmp_path)
    uuids = [g.uuid for g in sim.gpus]
    want = {u: {("demo", f"job-{i}-0", "main"), ("demo", f"job-{i}-1", "main")} for i, u in enumerate(uuids)}
    async with running_app(settings, sim) as app:
        assert app.processes is not None and app.metrics is not None
        loop, url = app.processes, app.metrics.url

        def named() -> bool:
            got = {
                w.uuid: {(p.namespace, p.pod, p.container) for p in w.pods if p.power_w > 0} for w in loop.workloads()
            }
            return bool(got == want)

        await wait_for(named, timeout_s=20, what="both GPUs' pods named, with power")
        host = tmp_path / "data" / "sim-host"
        assert loop.proc_root == str(host / "proc") and (host / "proc" / "1001" / "cgroup").is_file()
        assert oct(host.stat().st_mode & 0o777) == "0o700"

        # The snapshot (behind /metrics and /status): every process named, so no reason.
        snapshot = app.snapshot()
        assert {w.uuid for w in snapshot.workloads} == set(uuids)
        for w in snapshot.workloads:
            assert w.reason == "" and w.process_count == 2, w.reason
            # The telemetry row of the cycle carries the pods' series.
            i = uuids.index(w.uuid)
            assert pod_series("energy", "demo", f"job-{i}-0", "main") in telemetry_values(w)

        def pods_in_metrics(m: dict[str, list[tuple[dict[str, str], float]]]) -> None:
            for uuid in uuids:
                for series in ("gpu_pod_energy_joules_total", "gpu_pod_power_watts", "gpu_pod_memory_used_bytes"):
                    labels = {(x["namespace"], x["pod"], x["container"]) for x, _ in by_gpu(m, series, uuid)}
                    assert labels == want[uuid], (series, labels)
                rows = {x["pid"]: x["pod"] for x, _ in by_gpu(m, "gpu_process_memory_used_bytes", uuid)}
                i = uuids.index(uuid)
                assert rows == {str(1001 + 100 * i): f"job-{i}-0", str(1002 + 100 * i): f"job-{i}-1"}

        await settled(url, pods_in_metrics)

        # The processes twin: the server of weight 3 draws the most power.
        # (waited for: a process cycle that ran twice with no collect sample between them, on a loaded host, sees
        # no energy go by and attributes 0 W to every pod until the next one)
        def twin() -> str:
            value = app.workers[uuids[0]].values["processes"]
            return value if isinstance(value, str) else ""

        await wait_for(lambda: twin().startswith("count:2,power:demo/job-0-0/main@"), what=f"the twin ({twin()})")
        assert TWIN_VALUE.fullmatch(twin())

        # gpu-mapper status: the node's top pods.
        text = await asyncio.to_thread(fetch, url + "/status?format=text")
        for i in range(2):
            assert f"demo/job-{i}-0/main" in text and f"demo/job-{i}-1/main" in text
        assert "hostPID" not in text


@pytest.mark.timeout(60)
async def test_with_sim_a_proc_root_the_user_set_is_read_and_the_simulated_host_is_not(tmp_path: Path) -> None:
    own = tmp_path / "own-proc"
    own.mkdir()
    sim, settings = demo_settings(tmp_path, proc_root=str(own))
    async with running_app(settings, sim) as app:
        assert app.processes is not None
        loop = app.processes
        assert loop.proc_root == str(own)
        seen = await wait_for(
            lambda: [w for w in loop.workloads() if w.process_count == 2] if len(loop.workloads()) == 2 else [],
            timeout_s=20,
            what="both GPUs' processes",
        )
        for w in seen:
            assert f"not visible under {own}" in w.reason, w.reason
            assert not any(p.pod.startswith("job-") for p in w.pods)
        # The health loop's simulated host is there, without the processes' tree.
        await wait_for(lambda: (tmp_path / "data" / "sim-host" / "dev").is_dir(), what="the simulated host")
        assert not (tmp_path / "data" / "sim-host" / "proc" / "1001").exists()
