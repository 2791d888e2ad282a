"""The whole mapper on a simulated AGX Orin (``gpu-mapper run --sim 1 --sim-profile orin-agx``) in standalone mode
with a real mosquitto: the real JetsonBackend over the simulated sysfs tree, EventBus twins, a desired GPU
maximum applied to the files, a power mode switched through a delta and the fake nvpmodel, telemetry and
metrics."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest

from mapper.edge.app import MapperApp, build_backend
from mapper.edge.backends import wants_jetson
from mapper.edge.config import Settings
from mapper.edge.gpu.jetson import JetsonBackend
from mapper.errors import ConfigError
from mapper.shared.settings import MqttSettings
from mapper.wire.telemetry import decode_batch
from tests.apphelpers import fast_settings, wait_for
from tests.test_app_eventbus import Listener, matching

DEVICE = """
apiVersion: devices.kubeedge.io/v1beta1
kind: Device
metadata: {{name: orin0, namespace: default}}
spec:
  deviceModelRef: {{name: nvidia-jetson}}
  nodeName: edge-1
  protocol: {{protocolName: gpu, configData: {{uuid: {uuid}}}}}
  properties:
  - {{name: temperature, collectCycle: 100, reportCycle: 300, reportToCloud: true}}
  - {{name: utilization_gpu, collectCycle: 100, reportCycle: 300, reportToCloud: true}}
  - {{name: gpu_freq, collectCycle: 100, reportCycle: 300, reportToCloud: true}}
  - {{name: power_usage, collectCycle: 100, reportCycle: 300, reportToCloud: true}}
  - {{name: gpu_max_freq, desired: {{value: "612"}}, collectCycle: 100, reportCycle: 300, reportToCloud: true}}
  - {{name: power_mode, collectCycle: 100, reportCycle: 300, reportToCloud: true}}
  - {{name: power_mode_name, collectCycle: 100, reportCycle: 300, reportToCloud: true}}
  - {{name: product_name, collectCycle: 1000, reportCycle: 300, reportToCloud: true}}
"""


def twin_value(update: dict, name: str) -> str | None:
    return update["twin"].get(name, {}).get("actual", {}).get("value")


@pytest.mark.timeout(90)
async def test_the_whole_mapper_runs_over_a_simulated_orin_with_twins_desired_state_telemetry_and_metrics(
    mosquitto, tmp_path: Path
):
    devices = tmp_path / "devices"
    devices.mkdir()
    settings = fast_settings(
        str(tmp_path / "data"),
        devices_dir=str(devices),
        mqtt=MqttSettings(url=mosquitto.url),
        sim=1,
        sim_profile="orin-agx",
        sim_scenario="steady",
    )
    backend = build_backend(settings)
    assert isinstance(backend, JetsonBackend)
    (gpu,) = backend.list_gpus()
    (devices / "orin0.yaml").write_text(DEVICE.format(uuid=gpu.uuid))
    max_freq = tmp_path / "data/sim-jetson/sys/class/devfreq/17000000.gpu/max_freq"
    listener = Listener(mosquitto.port, "$hw/events/device/default/orin0/#", "gpu-mapper/#")
    app = MapperApp(settings, backend)
    stop = asyncio.Event()
    task = asyncio.create_task(app.run(stop))
    try:
        await wait_for(lambda: app.metrics is not None or task.done(), what="the mapper to start")
        assert not task.done(), f"the mapper exited early with {task.result()}"
        await wait_for(lambda: app.session is not None and app.session.subscribed, what="MQTT subscribed")

        # The Device's desired maximum reaches the devfreq files, and the twins say so.
        await wait_for(lambda: max_freq.read_text().strip() == "612000000", what="612 MHz in max_freq")
        updates = await wait_for(
            lambda: [
                u
                for u in matching(listener, "/twin/update")
                if "product_name" in u["twin"] and twin_value(u, "gpu_max_freq") == "612"
            ],
            what="a whole twin/update with gpu_max_freq 612",
        )
        doc = updates[-1]
        assert twin_value(doc, "product_name") == "NVIDIA_Jetson_AGX_Orin_Developer_Kit"
        assert twin_value(doc, "power_mode_name") == "MODE_30W"
        # The governor runs inside the new range from its next step on (the simulated board's, every 0.5 s).
        await wait_for(
            lambda: any(float(twin_value(u, "gpu_freq") or 1e9) <= 612 for u in matching(listener, "/twin/update")),
            what="the GPU clock at or below 612 MHz in the twins",
        )
        assert str(twin_value(doc, "temperature")).isdigit() and float(twin_value(doc, "power_usage") or 0) > 0
        assert "gpu_freq_range:applied" in str(twin_value(doc, "desired_status"))

        # An edge application switches the power mode with an EventBus delta: nvpmodel runs, the ack says applied,
        # and the desired maximum holds over the mode's own range (MODE_50W would open it to 1020 MHz).
        listener.publish(
            "$hw/events/device/default/orin0/twin/update/delta",
            json.dumps({"timestamp": int(time.time() * 1000), "delta": {"power_mode": "3"}}).encode(),
        )
        acks = await wait_for(
            lambda: [
                a
                for a in matching(listener, "/desired/ack")
                if a["property"] == "power_mode" and a["result"] == "applied"
            ],
            timeout_s=20,
            what="power_mode applied",
        )
        assert acks[-1]["source"] == "edge" and acks[-1]["reported_value"] == "3"
        status = tmp_path / "data/sim-jetson/var/lib/nvpmodel/status"
        assert status.read_text().startswith("pmode:0003")
        await wait_for(
            lambda: any(twin_value(u, "power_mode_name") == "MODE_50W" for u in matching(listener, "/twin/update")),
            what="MODE_50W in the twins",
        )
        assert max_freq.read_text().strip() == "612000000"

        # Telemetry batches carry the Jetson's values; /metrics exports them in base units.
        batches = await wait_for(
            lambda: [p for t, p in listener.drain() if t == "gpu-mapper/edge-1/default/orin0/telemetry"],
            what="a telemetry batch",
        )
        decoded = decode_batch(batches[0])
        assert decoded.uuid == gpu.uuid
        assert {"gpu_freq", "temperature"} <= {n for s in decoded.samples for n in s.values}
        assert app.metrics is not None
        text = await asyncio.to_thread(lambda: urllib.request.urlopen(app.metrics.url + "/metrics", timeout=5).read())
        metrics = text.decode()
        assert "gpu_frequency_max_hertz{" in metrics and "6.12e+08" in metrics
        assert "gpu_tj_temperature_celsius{" in metrics and "gpu_rail_power_watts{" in metrics
    finally:
        listener.close()
        stop.set()
        code = await asyncio.wait_for(task, 15)
        assert code == 0, f"the mapper exited with {code}"


def test_the_backend_choice_follows_the_flags_and_refuses_a_mismatch(tmp_path: Path) -> None:
    base = Settings(node_name="n1", data_dir=str(tmp_path))
    assert wants_jetson(replace(base, sim=1, sim_profile="xavier-agx"))
    assert not wants_jetson(replace(base, sim=2, sim_profile="H100"))
    assert wants_jetson(replace(base, backend="jetson"))
    assert not wants_jetson(replace(base, backend="nvml"))
    # auto on a machine with no Tegra GPU under the root: NVML (its own error says what is missing)
    assert not wants_jetson(replace(base, jetson_root=str(tmp_path)))
    with pytest.raises(ConfigError, match="is a Jetson profile, but backend is nvml"):
        wants_jetson(replace(base, sim=1, sim_profile="orin-agx", backend="nvml"))
    with pytest.raises(ConfigError, match="a Jetson has one GPU"):
        build_backend(replace(base, sim=2, sim_profile="orin-nano"))


@pytest.mark.timeout(90)
async def test_on_a_simulated_orin_power_saving_lowers_the_maximum_frequency_and_the_twins_show_the_override(
    mosquitto, tmp_path: Path
):
    devices = tmp_path / "devices"
    devices.mkdir()
    settings = fast_settings(
        str(tmp_path / "data"),
        devices_dir=str(devices),
        mqtt=MqttSettings(url=mosquitto.url),
        sim=1,
        sim_profile="orin-agx",
        sim_scenario="idle",
        policies={"powerSaving": {"idleFor": "1s", "idleClock": "510MHz"}},
    )
    backend = build_backend(settings)
    (gpu,) = backend.list_gpus()
    (devices / "orin0.yaml").write_text(DEVICE.format(uuid=gpu.uuid))
    max_freq = tmp_path / "data/sim-jetson/sys/class/devfreq/17000000.gpu/max_freq"
    listener = Listener(mosquitto.port, "$hw/events/device/default/orin0/#", "gpu-mapper/#")
    app = MapperApp(settings, backend)
    stop = asyncio.Event()
    task = asyncio.create_task(app.run(stop))
    try:
        await wait_for(lambda: app.metrics is not None or task.done(), what="the mapper to start")
        assert not task.done(), f"the mapper exited early with {task.result()}"
        # An idle board: power saving lowers the devfreq maximum below the cloud's 612 MHz (no power cap to act on).
        await wait_for(lambda: max_freq.read_text().strip() == "510000000", what="510 MHz in max_freq")
        updates = await wait_for(
            lambda: [
                u
                for u in matching(listener, "/twin/update")
                if twin_value(u, "policy_state") == "power-saving:active"
                and "overridden-power_saving" in str(twin_value(u, "desired_status"))
            ],
            what="power saving and its override in the twins",
        )
        assert twin_value(updates[-1], "desired_status") == "gpu_freq_range:overridden-power_saving"
        engaged = await wait_for(
            lambda: [e for e in matching(listener, "/orin0/events") if e.get("action") == "engage"],
            what="the engage event",
        )
        assert (engaged[0]["policy"], engaged[0]["oldClockLimit"], engaged[0]["newClockLimit"]) == (
            "power-saving",
            612.0,
            510.0,
        )
    finally:
        listener.close()
        stop.set()
        code = await asyncio.wait_for(task, 15)
        assert code == 0, f"the mapper exited with {code}"
