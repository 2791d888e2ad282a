"""The running mapper's health end to end: a simulated GPU that fails the CUDA probe goes unhealthy in its twins
(EventBus twin/update on a real broker) within one probe, the recovery flow resets it and it comes back, and the
three levels show in /metrics and in `gpu-mapper status`."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mapper.edge.status.metrics import fetch_status
from mapper.edge.status.view import render_status
from tests.apphelpers import running_app, wait_for
from tests.test_app_eventbus import Listener, matching, standalone


def health_twins(listener: Listener) -> list[str]:
    return [u["twin"]["health"]["actual"]["value"] for u in matching(listener, "/twin/update") if "health" in u["twin"]]


def metrics(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        text: str = resp.read().decode()
        return text


@pytest.mark.timeout(90)
async def test_a_gpu_failing_the_probe_is_unhealthy_in_its_twins_and_comes_back_after_a_reset(
    mosquitto, tmp_path: Path
) -> None:
    sim, uuid0, _, settings = standalone(tmp_path, mosquitto.url)
    # (the "steady" scenario keeps the GPU busy: the probe would be skipped under the default 50 %)
    health = {"recovery": {"allowReset": True}, "probe": {"skipAboveUtilization": 100}}
    settings = replace(settings, policies={"health": health})
    sim.set_scenario_processes(None, False)  # no process on the GPU: the reset is allowed
    listener = Listener(mosquitto.port, "$hw/events/device/default/gpu0/#", "gpu-mapper/#")
    try:
        async with running_app(settings, sim) as app:
            assert app.health is not None and app.metrics is not None
            await wait_for(lambda: "healthy" in health_twins(listener), timeout_s=20, what="a healthy twin")
            await wait_for(lambda: app.health.probe_counts(uuid0).get("pass"), what="the first probe")

            sim.inject_probe_fault(uuid0, "context", until_reset=True)
            app.health._gpu(uuid0).next_probe_s = 0.0  # the next probe now (as soon after an XID)
            app.health.wake.set()
            failed = "unhealthy:level3:probe-fail-cuCtxCreate-CUDA_ERROR_UNKNOWN"
            await wait_for(lambda: failed in health_twins(listener), timeout_s=20, what="the unhealthy twin")
            states = [json.loads(p)["state"] for t, p in listener.drain() if t.endswith("/state/update")]
            assert "unhealthy" in states

            # the recovery flow: self-check, reset (no process runs), re-apply, verify
            def recovery() -> list[str]:
                return [
                    json.loads(p)["action"]
                    for t, p in listener.drain()
                    if t.endswith("/events") and json.loads(p).get("policy") == "recovery"
                ]

            await wait_for(lambda: "done" in recovery(), timeout_s=20, what="the recovery flow")
            assert recovery() == ["start", "self-check", "reset", "reapply", "verify", "done"]
            assert sim.gpu(uuid0).resets == 1
            seen = health_twins(listener)
            await wait_for(
                lambda: health_twins(listener)[len(seen) - 1 :].count("healthy") > 0,
                timeout_s=20,
                what="healthy again",
            )
            assert app.workers[uuid0].state == "online"

            text = await asyncio.to_thread(metrics, app.metrics.url)
            samples = [
                (sample.name, sample.labels, sample.value)
                for family in text_string_to_metric_families(text)
                for sample in family.samples
                if sample.labels.get("uuid") == uuid0
            ]

            def value(name: str, **labels: str) -> float:
                (hit,) = [v for n, ls, v in samples if n == name and labels.items() <= ls.items()]
                return hit

            for level in ("0", "1", "2", "3"):
                assert value("gpu_mapper_health_status", level=level, status="healthy") == 1.0
            assert value("gpu_mapper_health_check_status", check="inforom", status="healthy") == 1.0
            assert (
                value("gpu_mapper_health_probes_total", outcome="fail") == 2.0
            )  # the scheduled one and the self-check
            assert value("gpu_mapper_health_probe_success") == 1.0
            assert value("gpu_inforom_info", image_version="G520.0200.00.05") == 1.0
            table = render_status(await asyncio.to_thread(fetch_status, app.metrics.url))
            assert "HEALTH L1/L2/L3" in table and "healthy ok/ok/ok" in table
    finally:
        listener.close()
