"""Twins that show a change at once, with the whole mapper on simulated GPUs and Devices as ``gpu-mapper
discover`` writes them (report cycles of 20 s): over DMI against the test EdgeCore (real gRPC over Unix
sockets) and over EventBus with a real mosquitto. And a Device listing a property its GPU cannot read."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from mapper.edge.gpu.nvml import NvmlBackend
from mapper.edge.gpu.simnvml import SimNvml
from mapper.edge.kubeedge.dmi.pb import dmi_pb2 as pb
from mapper.shared.model import GpuInfo
from mapper.shared.settings import MqttSettings
from mapper.tools.discover import DEFAULT_REPORT_CYCLE_MS, device_doc, model_doc, probe_all
from tests.apphelpers import fast_settings, running_app, wait_for
from tests.fake_edgecore import FakeEdgeCore, pb_from_doc, pb_model_from_doc
from tests.test_app_eventbus import Listener, matching


def discovered(sim: SimNvml, node: str) -> tuple[list[GpuInfo], list[dict[str, Any]]]:
    """The GPUs of ``sim`` and their Devices as ``gpu-mapper discover`` writes them (probed: what a GPU cannot
    read is left out)."""
    backend = NvmlBackend(sim)
    backend.init()
    try:
        gpus = backend.list_gpus()
        lacking = probe_all(backend, gpus)
    finally:
        backend.shutdown()
    from mapper.tools.discover import device_yaml

    docs = [d for d in yaml.safe_load_all(device_yaml(gpus, node, unsupported=lacking)) if d]
    assert all({p["reportCycle"] for p in d["spec"]["properties"]} == {DEFAULT_REPORT_CYCLE_MS} for d in docs)
    return gpus, docs


def with_desired(doc: dict[str, Any], prop: str, value: str) -> dict[str, Any]:
    out = json.loads(json.dumps(doc))
    for p in out["spec"]["properties"]:
        if p["name"] == prop:
            p["desired"] = {"value": value}
    return out


def twins_of(request: Any) -> dict[str, tuple[str, str]]:
    return {t.propertyName: (t.observedDesired.value, t.reported.value) for t in request.reportedDevice.twins}


def report_with(edge: FakeEdgeCore, device: str, prop: str, value: str, since: int) -> Any:
    """The first ReportDeviceStatus of ``device`` after the ``since``-th whose ``prop`` twin has ``value`` as
    both observedDesired and reported."""
    for request in edge.rec.statuses[since:]:
        if request.deviceName == device and twins_of(request).get(prop) == (value, value):
            return request
    return None


@pytest.mark.timeout(60)
async def test_update_device_shows_in_report_device_status_within_2_s_with_20_s_report_cycles(sock_dir, tmp_path):
    sim = SimNvml(2, "H100", seed=0, scenario="steady")
    _, docs = discovered(sim, "edge-1")
    edge = FakeEdgeCore(f"{sock_dir}/dmi.sock")
    edge.devices = [pb_from_doc(d) for d in docs]
    edge.models = [pb_model_from_doc(model_doc())]
    await edge.start()
    settings = fast_settings(str(tmp_path), edgecore_socket=edge.socket_path, socket=f"{sock_dir}/gpu.sock")
    try:
        async with running_app(settings, sim):
            name = docs[0]["metadata"]["name"]
            await wait_for(lambda: any(r.deviceName == name for r in edge.rec.statuses), what="the first report")
            first = next(r for r in edge.rec.statuses if r.deviceName == name)
            assert twins_of(first)["power_limit"] == ("", "700")
            assert "fan_speed" not in twins_of(first), "discover left out what the H100 cannot read"
            assert all(reported != "" for _, reported in twins_of(first).values()), "every listed twin has a value"
            registered = edge.rec.registers[0]

            for watts in ("300", "450"):
                since = len(edge.rec.statuses)
                device = pb_from_doc(with_desired(docs[0], "power_limit", watts))
                async with edge.mapper(registered.mapper.address) as stub:
                    sent = time.monotonic()
                    await stub.UpdateDevice(pb.UpdateDeviceRequest(device=device), timeout=10)
                    request = await wait_for(
                        lambda w=watts, s=since: report_with(edge, name, "power_limit", w, s),  # type: ignore[misc]
                        timeout_s=5.0,
                        what=f"power_limit {watts} in a ReportDeviceStatus",
                    )
                elapsed = time.monotonic() - sent
                assert elapsed < 2.0, f"the twin took {elapsed:.2f} s (report cycle 20 s)"
                twins = twins_of(request)
                assert "power_limit:applied" in twins["desired_status"][1]
                # (the status twins go with every prompt report; health_probe once the first probe has run)
                status = {"desired_status", "policy_state", "health"}
                assert set(twins) - {"health_probe"} == {"power_limit", *status}, "the affected twins"
                assert sim.gpu(docs[0]["spec"]["protocol"]["configData"]["uuid"]).power_limit_w == int(watts)
            assert not edge.rec.refused and not edge.rec.twin_rejections and not edge.rec.violations
    finally:
        await edge.stop()


@pytest.mark.timeout(120)
async def test_eight_devices_changed_in_the_same_second_all_arrive_within_2_s_and_under_1_rpc_per_s(sock_dir, tmp_path):
    sim = SimNvml(8, "H100", seed=3, scenario="steady")
    _, docs = discovered(sim, "edge-1")
    # A stricter EdgeCore than the real one (1 token/s, burst 100): as if other mappers had spent 90 of its
    # tokens. The mapper must never be refused.
    edge = FakeEdgeCore(f"{sock_dir}/dmi.sock", burst=10)
    edge.devices = [pb_from_doc(d) for d in docs]
    edge.models = [pb_model_from_doc(model_doc())]
    await edge.start()
    settings = fast_settings(str(tmp_path), edgecore_socket=edge.socket_path, socket=f"{sock_dir}/gpu.sock")
    names = [d["metadata"]["name"] for d in docs]
    try:
        async with running_app(settings, sim) as app:
            await wait_for(
                lambda: {r.deviceName for r in edge.rec.statuses} == set(names),
                timeout_s=30,
                what="every Device's first report",
            )
            # Right after start-up: its first twins and states (17 RPCs with MapperRegister, against a burst of
            # 10) leave a token per Device for prompt reports, so all 8 changed in the same second still go out
            # within it; start-up's states wait behind them.
            assert app.dmi_reporter is not None
            assert app.dmi_reporter.scheduler.reserve == 8
            since = len(edge.rec.statuses)
            registered = edge.rec.registers[0]
            # One channel for the 8 calls (a channel each cost a connect each: on a loaded machine the 8 could
            # take longer than the second this test is about).
            async with edge.mapper(registered.mapper.address) as stub:
                sent = time.monotonic()
                for doc in docs:
                    device = pb_from_doc(with_desired(doc, "power_limit", "400"))
                    await stub.UpdateDevice(pb.UpdateDeviceRequest(device=device), timeout=10)
            assert time.monotonic() - sent < 1.0, "the 8 changes were sent within a second"
            await wait_for(
                lambda: all(report_with(edge, n, "power_limit", "400", since) is not None for n in names),
                timeout_s=10,
                what="all 8 twins",
            )
            elapsed = time.monotonic() - sent
            assert elapsed < 2.0, f"the last of the 8 twins took {elapsed:.2f} s"
            changed_at = edge.now()
            await wait_for(
                lambda: {r.deviceName for r in edge.rec.states} == set(names),
                timeout_s=40,
                what="start-up's states, after the prompt reports",
            )
            await wait_for(lambda: edge.now() > changed_at + 5.0, timeout_s=10, what="5 s more")
        calls = edge.rec.call_times
        assert not [r for r in edge.rec.refused if r[1] == "rate"], "never refused by a 1/s, burst-10 EdgeCore"
        # The mapper's own budget (0.8/s, burst 10; MapperRegister may take one token ahead): in any window of
        # W seconds at most 10 + 0.8 W calls, so under 1 RPC/s over any window longer than 50 s.
        for i in range(len(calls)):
            for j in range(i, len(calls)):
                assert j - i + 1 <= 11 + 0.8 * (calls[j] - calls[i]) + 1e-6, (i, j, calls[j] - calls[i])
    finally:
        await edge.stop()


@pytest.mark.timeout(60)
async def test_an_eventbus_delta_shows_in_twin_update_within_2_s_with_20_s_report_cycles(mosquitto, tmp_path: Path):
    sim = SimNvml(1, "H100", seed=0, scenario="steady")
    _, docs = discovered(sim, "edge-1")
    devices = tmp_path / "devices"
    devices.mkdir()
    (devices / "gpus.yaml").write_text(yaml.safe_dump_all(docs))
    settings = fast_settings(str(tmp_path / "data"), devices_dir=str(devices), mqtt=MqttSettings(url=mosquitto.url))
    name = docs[0]["metadata"]["name"]
    listener = Listener(mosquitto.port, f"$hw/events/device/default/{name}/#")
    try:
        async with running_app(settings, sim) as app:
            await wait_for(lambda: app.session is not None and app.session.subscribed, what="MQTT subscribed")
            await wait_for(lambda: matching(listener, "/twin/update"), what="the first twin/update")
            for watts in ("275", "500"):
                listener.drain()
                already = len(listener.seen)
                sent = time.monotonic()
                listener.publish(
                    f"$hw/events/device/default/{name}/twin/update/delta",
                    json.dumps({"timestamp": int(time.time() * 1000), "delta": {"power_limit": watts}}).encode(),
                )

                def arrived(w: str = watts, n: int = already) -> bool:
                    listener.drain()
                    return any(
                        t.endswith("/twin/update")
                        and json.loads(p)["twin"].get("power_limit", {}).get("actual", {}).get("value") == w
                        for t, p in listener.seen[n:]
                    )

                await wait_for(arrived, timeout_s=5.0, what=f"power_limit {watts} in twin/update")
                elapsed = time.monotonic() - sent
                assert elapsed < 2.0, f"the twin took {elapsed:.2f} s (report cycle 20 s)"
    finally:
        listener.close()


@pytest.mark.timeout(60)
async def test_a_device_listing_fan_speed_on_a_gpu_without_a_fan_reports_unsupported_and_logs_it_once(
    sock_dir, tmp_path, caplog: pytest.LogCaptureFixture
):
    caplog.set_level(logging.INFO, logger="mapper.edge.kubeedge.report")
    sim = SimNvml(1, "H100", seed=0, scenario="steady")
    gpus, _ = discovered(sim, "edge-1")
    # One list for mixed GPUs (or written by hand): every catalog property, fan_speed included.
    doc = device_doc(gpus[0], "edge-1", report_cycle_ms=300)
    assert "fan_speed" in [p["name"] for p in doc["spec"]["properties"]]
    edge = FakeEdgeCore(f"{sock_dir}/dmi.sock", enforce_rate=False)
    edge.devices = [pb_from_doc(doc)]
    edge.models = [pb_model_from_doc(model_doc())]
    await edge.start()
    settings = fast_settings(
        str(tmp_path), edgecore_socket=edge.socket_path, socket=f"{sock_dir}/gpu.sock", dmi_rate_per_s=1.0
    )
    try:
        async with running_app(settings, sim):
            name = doc["metadata"]["name"]

            def reports() -> list[dict[str, tuple[str, str]]]:
                return [twins_of(r) for r in edge.rec.statuses if r.deviceName == name and "fan_speed" in twins_of(r)]

            await wait_for(lambda: len(reports()) >= 3, timeout_s=20, what="three reports with fan_speed")
            assert all(r["fan_speed"] == ("", "unsupported") for r in reports())
            assert all(r["temperature"][1].isdigit() for r in reports())
            assert not edge.rec.twin_rejections, "'unsupported' is a value devicetwin accepts"
        lines = [r for r in caplog.records if "fan_speed" in r.getMessage()]
        assert len(lines) == 1, [r.getMessage() for r in lines]
        assert name in lines[0].getMessage() and "cannot read" in lines[0].getMessage()
    finally:
        await edge.stop()
