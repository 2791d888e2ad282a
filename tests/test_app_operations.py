"""Operating the running mapper: probes, metrics, status, and policies reloaded without a restart."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest

from mapper.edge.config import load_settings
from mapper.edge.gpu.simnvml import SimNvml
from tests.apphelpers import fast_settings, running_app, wait_for

REPO = Path(__file__).resolve().parents[1]


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


@pytest.mark.timeout(60)
async def test_probes_metrics_and_status_come_from_the_running_loops(tmp_path: Path):
    import asyncio

    sim = SimNvml(2, "H100", seed=0, scenario="steady")
    settings = fast_settings(str(tmp_path), devices_dir=str(REPO / "device-models" / "examples"), node_name="demo-node")
    async with running_app(settings, sim, housekeeping_interval_s=0.2) as app:
        assert app.metrics is not None
        base = app.metrics.url
        await wait_for(
            lambda: all(w.device is not None and w.values.get("power_usage") is not None for w in app.workers.values()),
            what="every GPU bound to its Device and sampled",
        )
        status, body = await asyncio.to_thread(get, base + "/readyz")
        assert status == 200, body
        status, body = await asyncio.to_thread(get, base + "/healthz")
        assert status == 200, body
        status, text = await asyncio.to_thread(get, base + "/metrics")
        assert status == 200
        uuid0 = sim.gpus[0].uuid
        lines = [ln for ln in text.splitlines() if ln.startswith("gpu_power_usage_watts{")]
        assert any(f'uuid="{uuid0}"' in ln and 'node="demo-node"' in ln for ln in lines), lines
        assert 'device="demo-node-gpu0"' in text
        assert "gpu_mapper_buffer_bytes" in text
        status, body = await asyncio.to_thread(get, base + "/status")
        doc = json.loads(body)
        assert doc["node"] == "demo-node" and len(doc["gpus"]) == 2
        await wait_for(lambda: (tmp_path / "status.json").exists(), what="status.json in the data dir")

        # A stalled loop fails /healthz (here: the collect loop, which samples every GPU, stops beating).
        collect_task = next(t for t in app._tasks if t.get_name() == "collect")
        collect_task.cancel()
        deadline = asyncio.get_running_loop().time() + 20.0
        while True:
            status, body = await asyncio.to_thread(get, base + "/healthz")
            if status == 503 or asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.2)
        assert status == 503, "/healthz fails when a loop stalls"
        assert "collect" in body, body


@pytest.mark.timeout(60)
async def test_policies_are_reloaded_when_the_config_file_changes_and_a_bad_edit_is_refused(tmp_path: Path):
    cfg = tmp_path / "config.yaml"
    cfg.write_text("policies:\n  thermalThrottling: {enabled: true, maxTemp: 85, releaseTemp: 80}\n")
    base = load_settings(str(cfg), env={}, flags={"node_name": "edge-1"})
    settings = replace(
        fast_settings(str(tmp_path / "data"), devices_dir=str(tmp_path)), policies=base.policies, config_file=str(cfg)
    )
    sim = SimNvml(1, "H100", seed=0, scenario="idle")
    async with running_app(settings, sim, housekeeping_interval_s=0.1) as app:
        assert app.policies.config.thermal.max_temp_c == 85
        await wait_for(lambda: app.housekeeping.config_mtime != 0.0, what="the config file to be watched")
        cfg.write_text("policies:\n  thermalThrottling: {enabled: true, maxTemp: 78, releaseTemp: 70}\n")
        await wait_for(lambda: app.policies.config.thermal.max_temp_c == 78, what="the new maxTemp in force")
        cfg.write_text("policies:\n  thermalThrottling: {enabled: true, maxTemp: 70, releaseTemp: 75}\n")
        bad_mtime = cfg.stat().st_mtime
        await wait_for(lambda: app.housekeeping.config_mtime == bad_mtime, what="the bad edit looked at")
        assert app.policies.config.thermal.max_temp_c == 78, "a bad edit keeps the previous policies"


async def test_on_started_is_called_once_when_every_loop_runs(tmp_path: Path):
    import asyncio

    from mapper.edge.app import MapperApp
    from mapper.edge.gpu.nvml import NvmlBackend

    app = MapperApp(fast_settings(str(tmp_path)), NvmlBackend(SimNvml(2, "H100", seed=1)))
    seen: list[tuple[bool, int]] = []
    stop = asyncio.Event()
    task = asyncio.create_task(app.run(stop, on_started=lambda: seen.append((app.nvml_ready, len(app.workers)))))
    try:
        await wait_for(lambda: seen, what="on_started")
        rounds = app.status.collect_duration.count
        await wait_for(lambda: app.status.collect_duration.count >= rounds + 3, what="three more collect rounds")
        assert seen == [(True, 2)], "called once, after NVML is up and both GPUs have their loops"
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 15) == 0


async def test_one_collector_reads_every_gpu_in_one_nvml_job_and_a_lost_gpu_does_not_stop_the_others(tmp_path: Path):
    sim = SimNvml(3, "H100", seed=2, scenario="steady")
    settings = fast_settings(str(tmp_path), devices_dir=None)
    async with running_app(settings, sim) as app:
        rounds: list[list[str]] = []
        polls: list[bool] = []
        singles: list[str] = []
        sample_many, sample = app.backend.sample_many, app.backend.sample

        def counting_many(_backend, requests, events=False):  # type: ignore[no-untyped-def]
            rounds.append([uuid for uuid, _ in requests])
            polls.append(events)
            return sample_many(requests, events)

        def counting_one(_backend, uuid, properties=None):  # type: ignore[no-untyped-def]
            singles.append(uuid)
            return sample(uuid, properties)

        # call_async accepts only this backend's own public methods: patch them on the instance, names kept.
        counting_many.__name__, counting_one.__name__ = "sample_many", "sample"
        app.backend.sample_many = counting_many.__get__(app.backend)  # type: ignore[method-assign]
        app.backend.sample = counting_one.__get__(app.backend)  # type: ignore[method-assign]
        await wait_for(lambda: len(rounds) >= 4, what="four collect rounds")
        uuids = sorted(app.workers)
        assert all(sorted(r) == uuids for r in rounds[1:]), rounds  # every GPU, one job per round
        assert singles == []
        assert any(polls), "NVML's events are polled in the same job"
        assert not [t for t in app._tasks if t.get_name() == "events"], "no loop of their own"
        sim.inject_xid(uuids[0], 13)
        await wait_for(lambda: app.collector.xids.get(uuids[0], {}).get(13) == 1, what="the XID to be counted")

        lost = uuids[1]
        sim.inject_gpu_lost(lost)
        await wait_for(lambda: app.workers[lost].lost, what="the lost GPU to be noticed")
        before = {u: app.workers[u].values_ts_ms for u in uuids}
        others = [u for u in uuids if u != lost]
        await wait_for(
            lambda: all(app.workers[u].values_ts_ms > before[u] for u in others),
            what="the other GPUs to be sampled again",
        )
        assert app.workers[lost].state == "offline"


async def test_the_batches_every_gpu_cut_in_one_round_are_stored_in_one_call(tmp_path: Path):
    sim = SimNvml(3, "H100", seed=3, scenario="steady")
    settings = fast_settings(str(tmp_path), devices_dir=None, telemetry_window_s=1.0)
    async with running_app(settings, sim) as app:
        assert app.shipper is not None
        calls: list[list[str]] = []
        submit_many = app.shipper.submit_many

        def recording(pairs):  # type: ignore[no-untyped-def]
            calls.append([batch.uuid for batch, _ in pairs])
            return submit_many(pairs)

        app.shipper.submit_many = recording  # type: ignore[method-assign]
        await wait_for(lambda: len(calls) >= 3, timeout_s=15, what="three rounds with batches")
        assert any(sorted(c) == sorted(app.workers) for c in calls), calls  # all GPUs' batches in one call
        assert all(len(c) == len(set(c)) for c in calls), "one batch per GPU and round"
        assert app.streams.round_batches == [], "nothing left behind after a round"


async def test_batches_cut_in_a_round_where_publishing_a_step_raised_are_stored_and_the_mapper_runs_on(tmp_path: Path):
    import asyncio

    from mapper.edge.app import MapperApp
    from mapper.edge.gpu.nvml import NvmlBackend
    from tests.apphelpers import wait_for

    app = MapperApp(fast_settings(str(tmp_path), devices_dir=None), NvmlBackend(SimNvml(2, "H100", seed=4)))
    cut: list[tuple[str, int]] = []
    stored: list[tuple[str, int]] = []

    def started() -> None:
        # The last of the collector's consumers (the reporter) raises once, after the whole step was handed on.
        assert app.collector.consumers[-1] is app.reporter
        after_step = app.reporter.after_step

        def crashing(worker, result):  # type: ignore[no-untyped-def]
            after_step(worker, result)
            if not cut and app.streams.round_batches and worker is list(app.workers.values())[-1]:
                cut.extend((batch.uuid, batch.seq) for batch, _ in app.streams.round_batches)
                raise RuntimeError("a bug in publishing a step")

        app.reporter.after_step = crashing  # type: ignore[method-assign]
        assert app.shipper is not None
        submit_many = app.shipper.submit_many

        def recording(pairs):  # type: ignore[no-untyped-def]
            stored.extend((batch.uuid, batch.seq) for batch, _ in pairs)
            return submit_many(pairs)

        app.shipper.submit_many = recording  # type: ignore[method-assign]

    stop = asyncio.Event()
    task = asyncio.create_task(app.run(stop, on_started=started))
    await wait_for(
        lambda: cut and set(cut) <= set(stored), timeout_s=20, what="the batches cut before the crash stored"
    )
    await wait_for(lambda: app.collector.errors.get("step-failed", 0) == 1, what="the failed step counted")
    stop.set()
    code = await asyncio.wait_for(task, 20)
    assert code == 0, "a bug in one GPU's step does not stop the mapper"


async def test_every_start_has_a_new_boot_id_and_a_consumer_that_drops_duplicates_keeps_both_runs_batches(
    tmp_path: Path,
):
    """Consumers drop duplicates by (device, boot id, seq) (docs/telemetry.md); a restarted mapper numbers its
    batches from the start again, so only a new boot id keeps its batches apart from those of the run before.
    Two runs on one data dir, no broker: every batch of both is in the buffer, and a consumer keeps them all."""
    from mapper.clock import SystemClock
    from mapper.edge.storage.buffer import Buffer
    from mapper.wire.telemetry import decode_batch

    settings = fast_settings(str(tmp_path / "data"), devices_dir=None)

    async def run(batches_after: int) -> str:
        async with running_app(settings, SimNvml(1, "H100", seed=3, scenario="steady")) as app:
            buffer = app.buffer
            assert buffer is not None
            await wait_for(lambda: buffer.stats().batches >= batches_after, timeout_s=20, what="three more batches")
            return app.boot_id

    boot_ids = [await run(3), await run(6)]
    assert len(set(boot_ids)) == 2, f"the same boot id at both starts: {boot_ids}"
    assert all(len(b) == 8 and int(b, 16) >= 0 for b in boot_ids), boot_ids  # 8 hex digits (docs/telemetry.md)
    buf = Buffer(tmp_path / "data" / "telemetry.db", max_bytes=10**9, max_age_s=10**9, clock=SystemClock())
    try:
        batches = [decode_batch(row.payload) for row in buf.pending(10_000)]
    finally:
        buf.close()
    seqs = {b: sorted(x.seq for x in batches if x.boot_id == b) for b in boot_ids}
    assert {x.boot_id for x in batches} == set(boot_ids)
    assert all(s[0] == 0 and len(s) >= 3 for s in seqs.values()), seqs  # each run numbers its batches from 0
    kept = {(x.device, x.boot_id, x.seq): x for x in batches}  # the consumer's dedup
    assert len(kept) == len(batches), "a consumer dropped batches of one run as duplicates of the other's"
