"""The whole mapper on the simulated JetPack 7 boards (``gpu-mapper run --sim 1 --sim-profile orin-agx-jp7`` and
``--sim-profile thor``) in standalone mode with a real mosquitto: the backend chosen by ``--backend auto``, the
real TegraBackend over the simulated sysfs tree and the board's simulated NVML (behind the real pynvml and the
stand-in libnvidia-ml where said), EventBus twins, desired state, policies, the process cycle and health."""

from __future__ import annotations

import asyncio
import json
import logging
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from mapper.edge.app import MapperApp
from mapper.edge.backends import build_jetson_backend, wants_jetson
from mapper.edge.config import MqttSettings, Settings
from mapper.edge.gpu.jetson import JetsonBackend
from mapper.edge.gpu.simjetson import build_tree
from mapper.edge.gpu.simnvml import SimNvml
from mapper.edge.gpu.tegra import TegraBackend
from mapper.shared.model import family_properties
from mapper.tools.discover import probe_all
from tests.apphelpers import fast_settings, wait_for
from tests.nvml_standin import StandIn, installed_binding, standin_library
from tests.test_app_eventbus import Listener, matching

GIB = 1 << 30


def device(name: str, uuid: str, properties: dict[str, str | None]) -> str:
    """A Device of the nvidia-jetson model listing ``properties`` (name -> desired value or None), fast cycles."""
    lines = [
        "apiVersion: devices.kubeedge.io/v1beta1",
        "kind: Device",
        f"metadata: {{name: {name}, namespace: default}}",
        "spec:",
        "  deviceModelRef: {name: nvidia-jetson}",
        "  nodeName: edge-1",
        f"  protocol: {{protocolName: gpu, configData: {{uuid: {uuid}}}}}",
        "  properties:",
    ]
    for prop, desired in properties.items():
        want = f' desired: {{value: "{desired}"}},' if desired is not None else ""
        lines.append(f"  - {{name: {prop},{want} collectCycle: 100, reportCycle: 300, reportToCloud: true}}")
    return "\n".join(lines) + "\n"


def twin_value(update: dict[str, Any], name: str) -> str | None:
    value = update["twin"].get(name, {}).get("actual", {}).get("value")
    return None if value is None else str(value)


def latest_twins(listener: Listener, device_name: str) -> dict[str, str]:
    """Every twin of the Device as last reported (its twin/update messages so far)."""
    seen: dict[str, str] = {}
    for update in matching(listener, f"/{device_name}/twin/update"):
        for name in update["twin"]:
            value = twin_value(update, name)
            if value is not None:
                seen[name] = value
    return seen


@pytest.fixture
def standin_layer() -> Iterator[Callable[[SimNvml], Any]]:
    """The board's NVML as the mapper calls it: the installed pynvml over the stand-in library over the simulator."""
    made: list[StandIn] = []

    def over(sim: SimNvml) -> Any:
        made.append(StandIn(sim, standin_library(), installed_binding()))
        return made[-1].pynvml

    yield over
    for standin in made:
        standin.close()
        assert standin.failures == [], "a stand-in callback failed:\n" + "\n".join(standin.failures)


def jetpack6_orin_twins() -> list[str]:
    """The properties ``gpu-mapper discover`` lists for the simulated JetPack 6 AGX Orin: its tree's, probed."""
    with tempfile.TemporaryDirectory() as root:
        build_tree(root, "orin-agx")
        backend = TegraBackend(root, no_nvml="no NVML on JetPack 6")
        try:
            (gpu,) = backend.list_gpus()
            sources = {gpu.uuid: backend.property_sources(gpu.uuid)}
            left_out = probe_all(backend, [gpu], sources)[gpu.uuid]
        finally:
            backend.shutdown()
    return [p.name for p in family_properties("jetson") if p.name not in left_out]


async def run_app(settings: Settings, backend: JetsonBackend) -> tuple[MapperApp, asyncio.Task[int], asyncio.Event]:
    app = MapperApp(settings, backend)
    stop = asyncio.Event()
    task = asyncio.create_task(app.run(stop))
    await wait_for(lambda: app.metrics is not None or task.done(), what="the mapper to start")
    assert not task.done(), f"the mapper exited early with {task.result()}"
    return app, task, stop


async def stop_app(task: asyncio.Task[int], stop: asyncio.Event) -> None:
    stop.set()
    code = await asyncio.wait_for(task, 15)
    assert code == 0, f"the mapper exited with {code}"


@pytest.mark.timeout(120)
async def test_auto_on_a_jetpack7_orin_picks_sysfs_and_fills_every_twin_a_jetpack6_orin_has(
    mosquitto, tmp_path: Path, standin_layer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="mapper.edge.gpu.tegra")
    devices = tmp_path / "devices"
    devices.mkdir()
    settings = fast_settings(
        str(tmp_path / "data"),
        devices_dir=str(devices),
        mqtt=MqttSettings(url=mosquitto.url),
        sim=1,
        sim_profile="orin-agx-jp7",
        sim_scenario="steady",
    )
    assert settings.backend == "auto" and wants_jetson(settings)
    backend = build_jetson_backend(settings, nvml_layer=standin_layer)
    (gpu,) = backend.list_gpus()
    names = jetpack6_orin_twins()
    assert {"utilization_gpu", "gpu_freq", "gpu_governor", "power_mode", "temperature_tj"} <= set(names)
    props: dict[str, str | None] = dict.fromkeys(names)
    props["gpu_max_freq"] = "612"
    (devices / "orin7.yaml").write_text(device("orin7", gpu.uuid, props))
    max_freq = tmp_path / "data/sim-jetson/sys/class/devfreq/17000000.gpu/max_freq"
    listener = Listener(mosquitto.port, "$hw/events/device/default/orin7/#")
    app, task, stop = await run_app(settings, backend)
    try:
        # NVML initialised and was asked; it answered NotSupported, so sysfs serves, and the log says so.
        said = [r.getMessage() for r in caplog.records if r.name == "mapper.edge.gpu.tegra"]
        assert any("not served: memory_used (NVML answers NotSupported" in m for m in said), said
        assert app.processes is None and app.health is None  # NVML manages nothing here
        await wait_for(lambda: max_freq.read_text().strip() == "612000000", what="612 MHz in max_freq")
        twins = await wait_for(
            lambda: (t := latest_twins(listener, "orin7")) and set(names) <= set(t) and t,
            timeout_s=20,
            what="every twin of the Device reported",
        )
        assert not [n for n in names if twins[n] == "unsupported"], twins
        assert not any(twin_value(u, n) == "unsupported" for u in matching(listener, "/twin/update") for n in u["twin"])
        assert 0 <= float(twins["utilization_gpu"]) <= 100 and twins["gpu_governor"] == "nvhost_podgov"
        assert "gpu_freq_range:applied" in twins["desired_status"]
    finally:
        listener.close()
        await stop_app(task, stop)


@pytest.mark.timeout(120)
async def test_on_a_thor_the_mapper_reports_load_memory_processes_frequencies_rails_and_health_and_applies_desires(
    mosquitto, tmp_path: Path
) -> None:
    devices = tmp_path / "devices"
    devices.mkdir()
    settings = fast_settings(
        str(tmp_path / "data"),
        devices_dir=str(devices),
        mqtt=MqttSettings(url=mosquitto.url),
        sim=1,
        sim_profile="thor",
        sim_scenario="steady",
        process_interval_s=0.25,
        leak_window_s=3.0,
        leak_threshold_bytes=256 << 20,
    )
    boards: list[SimNvml] = []
    backend = build_jetson_backend(settings, nvml_layer=lambda sim: boards.append(sim) or sim)  # as --sim runs it
    (gpu,) = backend.list_gpus()
    props: dict[str, str | None] = dict.fromkeys(
        [
            "utilization_gpu",
            "memory_used",
            "memory_total",
            "processes",
            "health",
            "gpu_freq",
            "gpu_governor",
            "power_rails",
            "power_usage",
            "temperature",
            "power_mode_name",
            "desired_status",
        ]
    )
    props.update(gpu_max_freq="918", power_mode="2")  # 90W opens the GPU to 1071 MHz; the desired 918 holds
    (devices / "thor0.yaml").write_text(device("thor0", gpu.uuid, props))
    data = tmp_path / "data/sim-jetson"
    listener = Listener(mosquitto.port, "$hw/events/device/default/thor0/#", "gpu-mapper/#")
    app, task, stop = await run_app(settings, backend)
    try:
        assert app.processes is not None and app.health is not None
        # The desired power mode through nvpmodel, the desired maximum through devfreq gpu-gpc-0.
        await wait_for(
            lambda: (data / "var/lib/nvpmodel/status").read_text().startswith("pmode:0002"),
            timeout_s=20,
            what="power mode 2 in force",
        )
        max_freq = data / "sys/class/devfreq/gpu-gpc-0/max_freq"
        await wait_for(lambda: max_freq.read_text().strip() == "918000000", what="918 MHz in max_freq")
        twins = await wait_for(
            lambda: (t := latest_twins(listener, "thor0")).get("health") and t.get("processes") and t,
            timeout_s=20,
            what="the health and processes twins",
        )
        assert 0 <= float(twins["utilization_gpu"]) <= 100  # from NVML: a Thor has no load file
        assert 0 < int(twins["memory_used"]) < int(twins["memory_total"])
        assert twins["processes"].startswith("count:1")  # steady: one trainer, from NVML's process list
        assert twins["health"] == "healthy"
        # ... from NVML's level-2 checks and the host's driver traces, which ran (not a healthy default).
        worker = app.workers[gpu.uuid]
        await wait_for(lambda: worker.health.checks and worker.last_probe, what="the level-2 checks and a probe")
        checks = {c.name: c.status for c in worker.health.checks}
        assert {"nvml-responsive", "inforom"} <= set(checks) and set(checks.values()) == {"healthy"}, checks
        assert worker.last_probe is not None and worker.last_probe.outcome in ("pass", "skipped"), worker.last_probe
        assert twins["gpu_governor"] == "nvhost_podgov" and ",VIN:" in twins["power_rails"]
        assert float(twins["power_usage"]) > 0
        # The board's governor runs inside the new range from its next step on (every 0.5 s).
        await wait_for(
            lambda: float(latest_twins(listener, "thor0")["gpu_freq"]) <= 918, what="the GPU clock at or below 918"
        )
        await wait_for(
            lambda: (
                "power_mode:applied" in (s := latest_twins(listener, "thor0").get("desired_status", ""))
                and "gpu_freq_range:applied" in s
            ),
            what="both desires applied in desired_status",
        )
        assert latest_twins(listener, "thor0")["power_mode_name"] == "90W"

        # A process that leaks GPU memory, alone on the GPU: the leak detector's event (NVML lists a Thor's
        # processes; the trainer's memory follows the board's load, so it goes first).
        (nvml_sim,) = boards
        nvml_sim.set_scenario_processes(None, False)
        listener.drain()
        nvml_sim.start_process(nvml_sim.gpus[0].uuid, 4242, 2 * GIB, growth_bytes_per_s=200 << 20)
        leaks = await wait_for(
            lambda: [
                e
                for t, p in listener.drain()
                if t == "gpu-mapper/edge-1/default/thor0/events"
                and (e := json.loads(p))["policy"] == "gpu-memory-leak"
                and e["pid"] == 4242
            ],
            timeout_s=30,
            what="the leak event",
        )
        assert leaks[0]["action"] == "leak-suspected" and leaks[0]["growthBytes"] >= 256 << 20
        assert leaks[0]["uuid"] == gpu.uuid  # the board's identity, not NVML's
    finally:
        listener.close()
        await stop_app(task, stop)


@pytest.mark.timeout(120)
async def test_on_an_idle_thor_power_saving_caps_the_devfreq_maximum_from_nvmls_load(
    mosquitto, tmp_path: Path, standin_layer
) -> None:
    devices = tmp_path / "devices"
    devices.mkdir()
    settings = fast_settings(
        str(tmp_path / "data"),
        devices_dir=str(devices),
        mqtt=MqttSettings(url=mosquitto.url),
        sim=1,
        sim_profile="thor",
        sim_scenario="idle",
        policies={"powerSaving": {"idleFor": "1s", "idleClock": "459MHz"}, "health": {"enabled": False}},
    )
    backend = build_jetson_backend(settings, nvml_layer=standin_layer)
    (gpu,) = backend.list_gpus()
    props: dict[str, str | None] = dict.fromkeys(["utilization_gpu", "policy_state", "desired_status", "gpu_freq"])
    props["gpu_max_freq"] = "1224"
    (devices / "thor0.yaml").write_text(device("thor0", gpu.uuid, props))
    max_freq = tmp_path / "data/sim-jetson/sys/class/devfreq/gpu-gpc-0/max_freq"
    listener = Listener(mosquitto.port, "$hw/events/device/default/thor0/#", "gpu-mapper/#")
    _app, task, stop = await run_app(settings, backend)
    try:
        # The load comes from NVML (no load file on a Thor): idle, so power saving caps the devfreq maximum.
        await wait_for(lambda: max_freq.read_text().strip() == "459000000", timeout_s=20, what="459 MHz in max_freq")
        twins = await wait_for(
            lambda: (t := latest_twins(listener, "thor0")).get("policy_state") == "power-saving:active" and t,
            what="power saving in the twins",
        )
        assert float(twins["utilization_gpu"]) <= 5
        engaged = await wait_for(
            lambda: [e for e in matching(listener, "/thor0/events") if e.get("action") == "engage"],
            what="the engage event",
        )
        assert (engaged[0]["policy"], engaged[0]["oldClockLimit"], engaged[0]["newClockLimit"]) == (
            "power-saving",
            1224.0,
            459.0,
        )
    finally:
        listener.close()
        await stop_app(task, stop)
