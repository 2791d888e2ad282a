"""The push router: one sample per report cycle per property (the sample's own time), to each destination the
property names; the ``push_status`` twin; a method changed mid-run; destinations made, refused and closed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from mapper.clock import FakeClock, SystemClock
from mapper.edge.control.collect import GpuWorker, TickResult
from mapper.edge.control.policy import PolicyEngine
from mapper.edge.control.reconcile import Reconciler
from mapper.edge.gpu.nvml import NvmlBackend
from mapper.edge.gpu.simnvml import SimNvml
from mapper.edge.kubeedge.report import device_twins
from mapper.edge.push.router import PushRouter
from mapper.edge.push.spec import destination_key, parse_push_method
from mapper.edge.push.writers import WriterFactory
from mapper.edge.storage.pushbuffer import PushBuffer
from mapper.shared.model import DeviceConfig, DeviceProperty, Sample
from mapper.shared.push import PushHttp, PushSecrets
from tests.apphelpers import wait_for
from tests.dbservers import RedisServer
from tests.pushhelpers import HttpReceiver, OtlpReceiver

UUID = "GPU-7a1c2e44-0b1d-4c55-9e0f-12ab34cd56ef"
#: The samples carry fixed times in the past: the buffer keeps them whatever the day the tests run.
KEEP_S = 100 * 365 * 86400.0
T0_MS = 1_796_407_083_000  # = 1000 (mod 2000)


def prop(name: str, push: dict[str, Any] | None, report_cycle_ms: int = 2000, **kw: Any) -> DeviceProperty:
    parsed = parse_push_method(push, f"p {name}", table=f"default/gpu0/{name}")
    return DeviceProperty(
        name,
        report_cycle_ms=report_cycle_ms,
        push_mqtt=parsed.mqtt,
        push=parsed.push,
        db=parsed.db,
        push_notes=parsed.notes,
        **kw,
    )


def device(*props: DeviceProperty) -> DeviceConfig:
    return DeviceConfig("default", "gpu0", "nvidia-gpu", UUID, tuple(props))


def worker(dev: DeviceConfig | None) -> Any:
    """What the router reads of a ``GpuWorker``: its uuid, its Device, and the twin it sets."""
    return SimpleNamespace(uuid=UUID, device=dev, push_status="")


@pytest.fixture
async def router(tmp_path: Path) -> AsyncIterator[PushRouter]:
    buf = PushBuffer(tmp_path / "push.db", max_bytes=10**7, max_age_s=KEEP_S)
    r = PushRouter("edge-1", buf, WriterFactory(timeout_s=2.0), clock=SystemClock(), default_report_cycle_ms=5000)
    task = asyncio.create_task(r.run())
    yield r
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    buf.close()


def step(r: PushRouter, w: Any, ts_ms: int, values: dict[str, Any]) -> None:
    r.after_step(w, TickResult(sample=Sample(UUID, ts_ms, values)))
    r.store_round()


async def test_one_sample_per_report_cycle_on_the_cycles_grid_with_its_own_time(router: PushRouter) -> None:
    with HttpReceiver() as rx:
        host, port, _ = rx.url()
        w = worker(device(prop("temperature", {"http": {"hostName": host, "port": port, "requestPath": "/t"}})))
        sent = [T0_MS + 500 * i + (7 if i % 3 else 0) for i in range(21)]  # every 500 ms, some a few ms late
        for i, ts in enumerate(sent):
            step(router, w, ts, {"temperature": 40 + i, "power_usage": 100.0})
        await wait_for(lambda: len(rx.snapshot()) == 6, what="the pushes")
        await asyncio.sleep(0.2)
        got = [int(p.form["temperature"]) - 40 for p in rx.snapshot()]
        # The first sample, then the one read at each 2 s point of the wall clock (T0 + 1000 + 2000 k: every 4th
        # sample from the 3rd on), with its own time, a few ms late or not.
        assert got == [0, 2, 6, 10, 14, 18]
        assert [int(p.form["time"][-2:]) for p in rx.snapshot()] == [3, 4, 6, 8, 10, 12]
        assert {p.path for p in rx.snapshot()} == {"/t"} and all("power_usage" not in p.form for p in rx.snapshot())


async def test_a_property_without_a_report_cycle_pushes_on_the_mappers_default(router: PushRouter) -> None:
    with HttpReceiver() as rx:
        host, port, _ = rx.url()
        w = worker(device(prop("temperature", {"http": {"hostName": host, "port": port}}, report_cycle_ms=0)))
        for i in range(21):
            step(router, w, T0_MS + 1000 * i, {"temperature": i})
        await wait_for(lambda: len(rx.snapshot()) == 5, what="the pushes")
        # 5000 ms: the first, then each 5 s point of the wall clock (T0 = 3000 mod 5000: T0 + 2000 + 5000 k).
        assert [int(p.form["temperature"]) for p in rx.snapshot()] == [0, 2, 7, 12, 17]


async def test_the_push_status_twin_says_how_each_method_fares(router: PushRouter) -> None:
    with HttpReceiver() as rx:
        host, port, _ = rx.url()
        dev = device(
            prop(
                "temperature",
                {
                    "http": {"hostName": host, "port": port},
                    "otel": {"endpointURL": "http://x/v1/metrics"},
                    "dbMethod": {"TDEngine": {"TDEngineClientConfig": {"addr": "t:6041", "dbName": "d"}}},
                },
            ),
            prop("utilization_gpu", {"anomalyDetection": {"threshold": 90}}),
            prop("power_usage", {"http": {"hostName": "sink", "port": 80}}),
            prop("product_name", {"otel": {"endpointURL": "http://x/v1/metrics"}}),
        )
        w = worker(dev)
        step(router, w, T0_MS, {"temperature": 41})
        assert w.push_status == (
            "temperature:http:waiting,temperature:otel:ignored,temperature:tdengine:refused@not-supported,"
            "utilization_gpu:anomalyDetection:carried,power_usage:http:refused@hostName,"
            "product_name:otel:refused@not-a-number"
        )
        await wait_for(lambda: len(rx.snapshot()) == 1, what="the push")
        await wait_for(lambda: {s.state for s in router.statuses() if s.kind == "http"} == {"ok"}, what="its answer")
        step(router, w, T0_MS + 100, {"temperature": 42})  # not due: only the twin is refreshed
        assert w.push_status.startswith("temperature:http:ok,")
        unbound = worker(None)
        unbound.push_status = "stale"
        step(router, unbound, T0_MS, {"temperature": 1})
        assert unbound.push_status == ""


async def test_a_device_update_that_changes_the_method_mid_run_moves_the_samples_and_closes_the_old_one(
    router: PushRouter,
) -> None:
    with HttpReceiver() as old, HttpReceiver() as new:
        w = worker(device(prop("temperature", {"http": {"hostName": "http://127.0.0.1", "port": old.port}})))
        for i in range(3):
            step(router, w, T0_MS + 2000 * i, {"temperature": i})
        old_key = destination_key(PushHttp("http://127.0.0.1", old.port))
        await wait_for(lambda: len(old.snapshot()) == 3, what="the first method's pushes")
        w.device = device(prop("temperature", {"http": {"hostName": "http://127.0.0.1", "port": new.port}}))
        for i in range(3, 6):
            step(router, w, T0_MS + 2000 * i, {"temperature": i})
        await wait_for(lambda: len(new.snapshot()) == 3, what="the new method's pushes")
        assert [p.form["temperature"] for p in old.snapshot()] == ["0", "1", "2"]
        assert [p.form["temperature"] for p in new.snapshot()] == ["3", "4", "5"]
        router._changed.set()
        await wait_for(lambda: old_key not in router.destinations, what="the old destination closed")
        assert [s.key for s in router.statuses()] == [destination_key(PushHttp("http://127.0.0.1", new.port))]


async def test_an_old_method_still_delivers_what_it_holds_before_it_is_closed(router: PushRouter) -> None:
    with HttpReceiver() as new:
        old = HttpReceiver()  # down while the Device changes
        w = worker(device(prop("temperature", {"http": {"hostName": "http://127.0.0.1", "port": old.port}})))
        for i in range(3):
            step(router, w, T0_MS + 2000 * i, {"temperature": i})
        old_key = destination_key(PushHttp("http://127.0.0.1", old.port))
        await wait_for(lambda: router.destinations[old_key].failures >= 1, what="the old one down")
        w.device = device(prop("temperature", {"http": {"hostName": "http://127.0.0.1", "port": new.port}}))
        step(router, w, T0_MS + 6000, {"temperature": 3})
        router._changed.set()
        await asyncio.sleep(0.3)
        assert old_key in router.destinations, "kept while it holds samples"
        old.start()
        try:
            await wait_for(lambda: len(old.snapshot()) == 3, timeout_s=15, what="the old backlog")
            router._changed.set()
            await wait_for(lambda: old_key not in router.destinations, what="closed once delivered")
        finally:
            old.stop()
        assert [p.form["temperature"] for p in new.snapshot()] == ["3"]


async def test_a_backlog_from_before_a_restart_is_delivered_before_any_device_names_it(tmp_path: Path) -> None:
    with HttpReceiver() as rx:
        method = {"http": {"hostName": "http://127.0.0.1", "port": rx.port}}
        buf = PushBuffer(tmp_path / "push.db", max_bytes=10**6, max_age_s=KEEP_S)
        first = PushRouter("edge-1", buf, WriterFactory(timeout_s=2.0), clock=SystemClock(), default_report_cycle_ms=1)
        w = worker(device(prop("temperature", method)))
        rx.stop()
        for i in range(3):
            step(first, w, T0_MS + 2000 * i, {"temperature": i})
        await first.close()
        buf.close()
        rx.start()
        buf2 = PushBuffer(tmp_path / "push.db", max_bytes=10**6, max_age_s=KEEP_S)
        second = PushRouter(
            "edge-1", buf2, WriterFactory(timeout_s=2.0), clock=SystemClock(), default_report_cycle_ms=1
        )
        task = asyncio.create_task(second.run())
        try:
            await wait_for(lambda: len(rx.snapshot()) == 3, what="the stored backlog")
            assert [p.form["temperature"] for p in rx.snapshot()] == ["0", "1", "2"]
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            buf2.close()


async def test_a_device_that_names_a_method_reports_the_push_status_twin_and_one_without_does_not(
    router: PushRouter,
) -> None:
    clock = FakeClock()
    backend = NvmlBackend(SimNvml(2, "H100", seed=0, clock=clock.monotonic), clock=clock)
    backend.init()
    try:
        gpus = backend.list_gpus()
        workers = [
            GpuWorker(info, backend, Reconciler(backend, info.uuid, clock=clock), PolicyEngine(), clock)
            for info in gpus
        ]
        pushing = DeviceConfig(
            "default",
            "gpu0",
            "nvidia-gpu",
            gpus[0].uuid,
            (prop("temperature", {"anomalyDetection": {"threshold": 90}}, report_to_cloud=True),),
        )
        plain = DeviceConfig("default", "gpu1", "nvidia-gpu", gpus[1].uuid, (DeviceProperty("temperature"),))
        for worker, dev in zip(workers, (pushing, plain), strict=True):
            worker.bind(dev)
            result = await worker.tick()
            router.after_step(worker, result)
        twins = {t.name: t.reported for t in device_twins(workers[0])}
        assert twins["push_status"] == "temperature:anomalyDetection:carried"
        assert "push_status" not in {t.name for t in device_twins(workers[1])}
    finally:
        backend.shutdown()


async def test_a_device_update_that_moves_a_property_to_another_kind_of_method_and_adds_a_db_method(
    tmp_path: Path,
) -> None:
    """http to otel, and a redis dbMethod added, mid-run: each sample goes to the method named when it was taken."""
    redis = RedisServer(tmp_path, password="pw")
    redis.start()
    buf = PushBuffer(tmp_path / "push.db", max_bytes=10**7, max_age_s=KEEP_S)
    r = PushRouter(
        "edge-1",
        buf,
        WriterFactory(timeout_s=2.0, secrets=PushSecrets(password="pw")),
        clock=SystemClock(),
        default_report_cycle_ms=5000,
    )
    task = asyncio.create_task(r.run())
    try:
        with HttpReceiver() as http, OtlpReceiver() as otel:
            w = worker(device(prop("temperature", {"http": {"hostName": "http://127.0.0.1", "port": http.port}})))
            for i in range(3):
                step(r, w, T0_MS + 2000 * i, {"temperature": i})
            await wait_for(lambda: len(http.snapshot()) == 3, what="the http pushes")
            redis_method = {"redisClientConfig": {"addr": f"127.0.0.1:{redis.port}"}}
            w.device = device(
                prop("temperature", {"otel": {"endpointURL": otel.endpoint}, "dbMethod": {"redis": redis_method}})
            )
            for i in range(3, 6):
                step(r, w, T0_MS + 2000 * i, {"temperature": i})
            await wait_for(lambda: len(otel.snapshot()) == 3, what="the otel points")
            await wait_for(lambda: len(redis.zrange("gpu0")) == 3, what="the redis members")
            assert [p.form["temperature"] for p in http.snapshot()] == ["0", "1", "2"], "http got nothing after"
            assert [(p.metric, p.value, p.time_ms) for p in otel.snapshot()] == [
                ("temperature", float(i), T0_MS + 2000 * i) for i in range(3, 6)
            ]
            members = [(json.loads(m)["Value"], score) for m, score in redis.zrange("gpu0")]
            assert members == [(str(i), T0_MS + 2000 * i) for i in range(3, 6)]
            await wait_for(
                lambda: {s.kind: s.state for s in r.statuses() if s.kind != "http"} == {"otel": "ok", "redis": "ok"},
                what="their answers seen",
            )
            step(r, w, T0_MS + 10_100, {"temperature": 5})  # not due: the twin is refreshed
            assert w.push_status == "temperature:otel:ok,temperature:redis:ok"
            r._changed.set()
            http_key = destination_key(PushHttp("http://127.0.0.1", http.port))
            await wait_for(lambda: http_key not in r.destinations, what="the http destination closed")
            assert sorted(s.kind for s in r.statuses()) == ["otel", "redis"]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        buf.close()
        redis.stop()
