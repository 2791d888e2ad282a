"""gpu-mapper bridge against a real mosquitto and a real Prometheus (remote-write receiver, out-of-order window)."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import zlib
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import IO

import pytest
import yaml

from mapper.bridge.core import bridged_series_names
from mapper.shared.naming import BRIDGE_JOB
from mapper.wire.telemetry import decode_batch
from tests.apphelpers import wait_for
from tests.bridgehelpers import (
    DESIRED_W,
    NODE,
    FlakyReceiver,
    bridge_settings,
    decoded_values,
    expected_samples,
    node_stream,
    publish_all,
    publish_states,
    running_bridge,
    state_stream,
    states,
    stream,
)
from tests.brokers import Mosquitto, free_port
from tests.promserver import Prometheus
from tests.realparts import require
from tests.test_deploy import dashboard, exprs, metric_refs

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Prometheus]:
    prom = Prometheus(tmp_path)
    prom.start()
    try:
        yield prom
    finally:
        prom.stop()


def count_samples(prom: Prometheus, selector: str, at_s: float, window_s: int) -> int:
    return sum(len(v) for v in prom.raw_samples(selector, at_s, window_s).values())


async def test_batches_on_the_broker_reach_prometheus_once_each_named_as_the_mapper_names_them(
    tmp_path: Path, mosquitto: Mosquitto, prometheus: Prometheus
) -> None:
    batches = stream(gpus=2, seconds=120)
    want = expected_samples(batches)
    async with running_bridge(bridge_settings(mosquitto.url, prometheus.write_url, tmp_path)) as bridge:
        publish_all(mosquitto.url, batches)
        publish_all(mosquitto.url, batches[:5], with_states=False)  # redelivered: dropped as duplicates
        await wait_for(
            lambda: bridge.stats.batches_written + bridge.stats.duplicate_batches >= len(batches) + 5,
            timeout_s=60,
            what="every batch written",
        )
    assert bridge.stats.duplicate_batches == 5
    assert bridge.stats.samples_written == want
    now = time.time() + 1
    total = count_samples(prometheus, '{__name__=~"gpu_.+"}', now, 600)
    assert total == want
    power = prometheus.raw_samples("gpu_power_usage_watts", now, 600)
    assert len(power) == 2
    gpus = {p.batch.uuid: p.gpu for p in batches if p.batch.uuid}
    for labels, points in power.items():
        names = dict(labels)
        assert names["uuid"].startswith("GPU-") and names["node"] == "edge-1"
        gpu = gpus[names["uuid"]]
        assert gpu is not None and names["gpu"] == str(gpu.index), "the NVML index, from the state message"
        stamps = [t for t, _ in points]
        assert len(stamps) == 120 and stamps == sorted(set(stamps))
    # the values, in base units: the decoded batch's own times the unit's factor (W: 1, MHz: 1e6, %: 0.01)
    for series, prop, factor in (
        ("gpu_power_usage_watts", "power_usage", 1.0),
        ("gpu_clock_sm_hertz", "clock_sm", 1e6),
        ("gpu_utilization_ratio", "utilization_gpu", 0.01),
    ):
        got = {(dict(k)["uuid"], t): v for k, points in prometheus.raw_samples(series, now, 600).items()
               for t, v in points}  # fmt: skip
        want_values = decoded_values(batches, prop, factor)
        assert len(want_values) == 240 and got.keys() == want_values.keys(), series
        assert all(got[k] == pytest.approx(x, rel=1e-12) for k, x in want_values.items()), series
    infos = {dict(k)["uuid"]: dict(k) for k in prometheus.raw_samples("gpu_info", now, 600)}
    assert infos.keys() == gpus.keys()
    for uuid, labels in infos.items():
        gpu = gpus[uuid]
        assert gpu is not None
        assert (labels["gpu"], labels["pci_bus_id"], labels["driver_version"]) == (
            str(gpu.index),
            gpu.pci_bus_id,
            batches[0].driver_version,
        )


async def test_two_replicas_in_one_group_each_take_part_and_together_write_everything_once(
    tmp_path: Path, mosquitto: Mosquitto, prometheus: Prometheus
) -> None:
    batches = stream(gpus=4, seconds=300)
    want = expected_samples(batches)
    a = bridge_settings(mosquitto.url, prometheus.write_url, tmp_path / "a", client_id="bridge-a")
    b = bridge_settings(mosquitto.url, prometheus.write_url, tmp_path / "b", client_id="bridge-b")
    async with running_bridge(a) as ra, running_bridge(b) as rb:
        await wait_for(lambda: ra.session.connected and rb.session.connected, what="both replicas connected")
        publish_all(mosquitto.url, batches)
        await wait_for(
            lambda: ra.stats.batches_written + rb.stats.batches_written >= len(batches),
            timeout_s=60,
            what="every batch written by one of the replicas",
        )
    assert ra.stats.batches_received > 0 and rb.stats.batches_received > 0, "both replicas took part"
    assert ra.stats.batches_received + rb.stats.batches_received == len(batches), "each batch went to one replica"
    assert ra.stats.duplicate_batches == rb.stats.duplicate_batches == 0
    # each replica writes the retained state messages (a plain subscription): the store takes the second copy
    # (same series, timestamp and value) as a no-op
    status = want - expected_samples(batches, with_states=False)
    assert status > 0 and ra.stats.state_messages == rb.stats.state_messages == 4
    assert ra.stats.samples_written + rb.stats.samples_written == want + status
    assert count_samples(prometheus, '{__name__=~"gpu_.+"}', time.time() + 1, 900) == want


async def test_a_receiver_answering_500_is_retried_with_backoff_and_nothing_is_lost(
    tmp_path: Path, mosquitto: Mosquitto, prometheus: Prometheus
) -> None:
    batches = stream(gpus=2, seconds=120)
    want = expected_samples(batches)
    flaky = FlakyReceiver(prometheus.write_url)
    flaky.status = 500
    try:
        async with running_bridge(bridge_settings(mosquitto.url, flaky.url, tmp_path)) as bridge:
            publish_all(mosquitto.url, batches)
            await wait_for(lambda: bridge.stats.retries.get("http_500", 0) >= 3, timeout_s=30, what="retries")
            assert bridge.stats.batches_written == 0
            assert bridge.problems() == [] or "failing" in " ".join(bridge.problems())
            assert count_samples(prometheus, '{__name__=~"gpu_.+"}', time.time() + 1, 600) == 0
            flaky.status = None  # the receiver recovers
            await wait_for(
                lambda: bridge.stats.batches_written >= len(batches), timeout_s=60, what="every batch written"
            )
        assert bridge.stats.samples_written == want
        assert sum(bridge.stats.refused_requests.values()) == 0
        assert count_samples(prometheus, '{__name__=~"gpu_.+"}', time.time() + 1, 600) == want
        assert flaky.answers.count(500) >= 3 and flaky.answers[-1] // 100 == 2
    finally:
        flaky.close()


def _bridge_process(url: str, write_url: str, tmp: Path, port: int) -> subprocess.Popen[bytes]:
    log = (tmp / f"bridge-{port}.log").open("ab")
    cmd = [sys.executable, "-m", "mapper.cli", "bridge", "--mqtt", url, "--remote-write", write_url]
    cmd += ["--mqtt-client-id", "bridge-k", "--metrics-addr", f"127.0.0.1:{port}", "--spool-dir", str(tmp / "spool")]
    cmd += ["--batch-max-delay", "200ms", "--batch-max-samples", "500", "--retry-min-backoff", "100ms"]
    return subprocess.Popen(cmd, stdout=log, stderr=log, cwd=REPO)


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as resp:
            return resp.status == 200
    except OSError:
        return False


async def test_a_bridge_sigkilled_mid_stream_and_restarted_loses_nothing(
    tmp_path: Path, mosquitto: Mosquitto, prometheus: Prometheus
) -> None:
    batches = stream(gpus=2, seconds=600)
    want = expected_samples(batches)
    flaky = FlakyReceiver(prometheus.write_url)
    flaky.delay_s = 0.05  # slow enough to be killed mid-stream
    port = free_port()
    proc = _bridge_process(mosquitto.url, flaky.url, tmp_path, port)
    selector, now = '{__name__=~"gpu_.+"}', time.time() + 1
    try:
        await wait_for(lambda: _ready(port), timeout_s=30, what="the bridge process to be ready")
        publish_all(mosquitto.url, batches)
        await wait_for(lambda: count_samples(prometheus, selector, now, 900) > 0, timeout_s=30, what="some written")
        proc.kill()  # SIGKILL: no goodbye, unacknowledged messages stay with the broker
        proc.wait(10)
        written_before = count_samples(prometheus, selector, now, 900)
        assert 0 < written_before < want, "killed mid-stream"
        proc = _bridge_process(mosquitto.url, flaky.url, tmp_path, port)
        await wait_for(
            lambda: count_samples(prometheus, selector, now, 900) >= want, timeout_s=90, what="everything written"
        )
        assert count_samples(prometheus, selector, now, 900) == want
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        flaky.close()


async def test_a_request_refused_with_400_is_spooled_and_exports_to_openmetrics_that_promtool_accepts(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    prom = Prometheus(tmp_path, ooo_window="10m")
    prom.start()
    try:
        recent = stream(gpus=1, seconds=60)
        # the same GPU three hours earlier (another boot): far older than the 10 min out-of-order window
        old = stream(gpus=1, seconds=30, start_ms=int(time.time() * 1000) - 3 * 3600 * 1000, boot_id="0ld0b007")
        spool = tmp_path / "spool"
        async with running_bridge(bridge_settings(mosquitto.url, prom.write_url, tmp_path, spool_dir=str(spool))) as br:
            publish_all(mosquitto.url, recent)
            await wait_for(lambda: br.stats.batches_written >= len(recent), timeout_s=30, what="recent written")
            publish_all(mosquitto.url, old + recent[-1:], with_states=False)
            await wait_for(lambda: br.stats.spooled_requests >= len(old), timeout_s=30, what="old batches spooled")
            await wait_for(lambda: br.idle, timeout_s=10, what="all done")
        reasons = br.stats.refused_requests
        assert sum(reasons.values()) == len(old) and set(reasons) <= {"out_of_bounds", "too_old", "out_of_order"}
        refused = sum(br.stats.refused_samples.values())
        assert refused == expected_samples(old, with_states=False)
        assert br.stats.duplicate_batches == 1, "the recent batch sent again was dropped"
        assert len(list(spool.glob("*.rw1"))) == len(old)
        om = tmp_path / "backfill.om"
        out = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "mapper.cli", "bridge", "export", "--spool-dir", str(spool), "-o", str(om)],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
        )
        assert out.returncode == 0, out.stderr
        assert om.read_text().endswith("# EOF\n")
        blocks = tmp_path / "blocks"
        made = await asyncio.to_thread(
            subprocess.run,
            ["promtool", "tsdb", "create-blocks-from", "openmetrics", str(om), str(blocks)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert made.returncode == 0, made.stdout + made.stderr
        listing = await asyncio.to_thread(
            subprocess.run, ["promtool", "tsdb", "list", str(blocks)], capture_output=True, text=True, timeout=60
        )
        assert listing.returncode == 0, listing.stderr
        rows = [line.split() for line in listing.stdout.splitlines()[1:] if line.strip()]
        assert sum(int(r[4]) for r in rows) == refused, listing.stdout  # NUM SAMPLES column
    finally:
        prom.stop()


def _mapper_process(argv: list[str], log: IO[bytes]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "mapper.cli", *argv], cwd=REPO, stdout=log, stderr=log)


def _series_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        text: str = resp.read().decode()
        return text


async def test_scraped_and_bridged_at_once_each_source_shows_every_gpu_once_and_the_mappers_own_series(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    """docs/operations.md, "Scraping and bridging at once": one Prometheus scrapes a running mapper (job
    gpu-mapper) and receives the bridge's remote write of the same mapper's stream. Every GPU is there twice (the
    doubling the issue saw: 4 GPUs of a node of 2); the dashboard's Source variable lists both jobs, and with
    either one its Node row counts each GPU once and its mapper row draws one series per node."""
    metrics_port = free_port()
    prom = Prometheus(tmp_path, scrape={"gpu-mapper": f"127.0.0.1:{metrics_port}"})
    prom.start()
    (tmp_path / "devices").mkdir()
    cfg = tmp_path / "config.yaml"
    cfg.write_text("telemetry: {window: 1s}\ndefaults: {reportCycle: 1s}\n")  # batches and node stream every 1 s
    argv = ["run", "--sim", "2", "--node-name", "edge-9", "--config", str(cfg), "--devices", str(tmp_path / "devices")]
    argv += ["--data-dir", str(tmp_path / "data"), "--metrics-addr", f"127.0.0.1:{metrics_port}"]
    argv += ["--mqtt", mosquitto.url]
    log = (tmp_path / "mapper.log").open("ab")
    mapper = _mapper_process(argv, log)
    jobs = {"gpu-mapper", BRIDGE_JOB}
    try:
        async with running_bridge(bridge_settings(mosquitto.url, prom.write_url, tmp_path)) as bridge:

            def both_sources() -> bool:
                assert mapper.poll() is None, (tmp_path / "mapper.log").read_text()[-3000:]
                gpus = {s["metric"]["job"]: s["value"][1] for s in prom.query("count by (job) (gpu_info)")}
                own = {s["metric"]["job"] for s in prom.query("gpu_mapper_buffer_max_bytes")}
                return gpus == {"gpu-mapper": "2", BRIDGE_JOB: "2"} and own == jobs

            await wait_for(both_sources, timeout_s=120, what="the scraped and the bridged series")
            assert bridge.stats.batches_written > 0
        at = time.time()
        # the store holds every GPU twice: a query that picks no source counts 4 GPUs on a node of 2
        [doubled] = prom.query('count by (node) (gpu_info{node="edge-9"})', at)
        assert doubled["value"][1] == "4"
        # the dashboard's Source variable offers both, and each source draws each GPU once
        board = dashboard()
        variables = {v["name"]: v["definition"] for v in board["templating"]["list"] if "definition" in v}
        assert {s["metric"]["job"] for s in prom.query(_grafana_to_promql(variables["job"]), at)} == jobs
        stats = {p["title"]: p["targets"][0]["expr"] for p in board["panels"] if p.get("type") == "stat"}
        metrics = _series_text(f"http://127.0.0.1:{metrics_port}/metrics")
        caps = [line for line in metrics.splitlines() if line.startswith("gpu_power_limit_enforced_watts{")]
        assert len(caps) == 2
        cap_w = sum(float(line.rsplit(" ", 1)[1]) for line in caps)
        for job in sorted(jobs):
            [gpus] = prom.query(_grafana_to_promql(stats["GPUs"], job), at)
            assert (gpus["metric"], gpus["value"][1]) == ({"node": "edge-9"}, "2"), job
            [cap] = prom.query(_grafana_to_promql(stats["Power cap"], job), at)
            assert float(cap["value"][1]) == cap_w, job  # the two GPUs' caps once, not twice
            nodes = {s["metric"]["node"] for s in prom.query(_grafana_to_promql(variables["node"], job), at)}
            assert nodes == {"edge-9"}, job
            # the mapper row: one series a node, from either source
            for name in ("gpu_mapper_buffer_max_bytes", "gpu_mapper_mqtt_connected", "gpu_mapper_gpus"):
                [one] = prom.query(f'{name}{{job="{job}", node="edge-9"}}', at)
                want = {"gpu_mapper_gpus": "2", "gpu_mapper_mqtt_connected": "1"}.get(name)
                assert want is None or one["value"][1] == want, (job, name)
    finally:
        mapper.send_signal(signal.SIGTERM)
        try:
            mapper.wait(20)
        except subprocess.TimeoutExpired:
            mapper.kill()
            mapper.wait(10)
        log.close()
        prom.stop()


def _promtool_dump(blocks: Path) -> set[tuple[tuple[tuple[str, str], ...], int, float]]:
    """Every sample of a promtool block directory: (sorted labels with __name__, ts_ms, value)."""
    (blocks / "wal").mkdir(exist_ok=True)  # promtool 2.42's dump opens the directory as a TSDB, WAL and all
    dump = subprocess.run(
        ["promtool", "tsdb", "dump", str(blocks)], check=True, capture_output=True, text=True, timeout=120
    ).stdout
    out = set()
    for line in dump.splitlines():
        labels, value, ts = line.rsplit(" ", 2)
        fields = re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', labels)
        out.add((tuple(sorted(fields)), int(ts), float(value)))
    return out


async def test_a_buffer_export_backfilled_with_promtool_holds_exactly_what_the_bridge_wrote_for_the_same_samples(
    tmp_path: Path, mosquitto: Mosquitto, prometheus: Prometheus
) -> None:
    """The same batches (GPUs with their processes, and the mapper's own node stream) and state snapshots, once in a
    mapper's buffer file exported with ``buffer export --format openmetrics`` and backfilled by promtool, once
    through the bridge into Prometheus: the same series, labels and values at the same times."""
    from mapper.clock import FakeClock
    from mapper.edge.outbox.records import StoredBatch
    from mapper.edge.storage.buffer import Buffer
    from mapper.wire.state import parse_state

    batches = stream(gpus=2, seconds=300, processes_every_s=5)
    node = node_stream(seconds=300)
    snapshots = list(states(batches))  # each device's last state message, as the buffer's latest table keeps it
    db = tmp_path / "telemetry.db"
    buf = Buffer(db, max_bytes=10**9, max_age_s=10**9, clock=FakeClock(start_wall_ms=batches[-1].batch.ts_last_ms))
    for p in batches + node:
        b = p.batch
        buf.put(StoredBatch(b.device, b.uuid, b.boot_id, b.seq, b.ts_first_ms, b.ts_last_ms, p.topic, p.payload))
    for _, payload in snapshots:
        buf.put_latest(parse_state(payload).device, payload)
    buf.close()

    async with running_bridge(bridge_settings(mosquitto.url, prometheus.write_url, tmp_path)) as bridge:
        publish_states(mosquitto.url, snapshots)
        await wait_for(lambda: bridge.stats.state_messages >= len(snapshots), timeout_s=30, what="the states read")
        publish_all(mosquitto.url, batches + node, with_states=False)
        await wait_for(
            lambda: bridge.stats.batches_written >= len(batches) + len(node), timeout_s=60, what="every batch written"
        )
        await wait_for(lambda: bridge.idle, timeout_s=30, what="all written")
    bridged = set()
    raw = prometheus.raw_samples(f'{{job="{BRIDGE_JOB}"}}', time.time() + 1, 900)
    for labels, points in raw.items():
        bridged |= {(labels, ts, v) for ts, v in points}

    om = tmp_path / "backlog.om"
    cli = [sys.executable, "-m", "mapper.cli", "buffer", "export", str(db), "--format", "openmetrics", "-o", str(om)]
    out = await asyncio.to_thread(subprocess.run, cli, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    blocks = tmp_path / "blocks"
    made = await asyncio.to_thread(
        subprocess.run,
        ["promtool", "tsdb", "create-blocks-from", "openmetrics", str(om), str(blocks)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert made.returncode == 0, made.stdout + made.stderr
    exported = await asyncio.to_thread(_promtool_dump, blocks)

    names = {dict(labels)["__name__"] for labels, _, _ in exported}
    # the GPUs' series, their processes' and pods', the status of the snapshots and the mapper's own
    assert {"gpu_power_usage_watts", "gpu_clock_sm_hertz", "gpu_pod_energy_joules_total"} <= names
    assert {"gpu_mapper_device_state", "gpu_mapper_health_status", "gpu_mapper_buffer_bytes"} <= names
    assert not [n for n in names if not n.startswith("gpu_")]
    assert len(bridged) == expected_samples(batches + node, with_states=True)
    only_bridged, only_exported = sorted(bridged - exported)[:5], sorted(exported - bridged)[:5]
    assert exported == bridged, f"only bridged: {only_bridged}; only exported: {only_exported}"


def _grafana_to_promql(expr: str, job: str = BRIDGE_JOB) -> str:
    """A dashboard expression as Prometheus evaluates it: the source ``job``, the other variables matched to
    anything, label_values(sel, l) as its selector."""
    text = re.sub(r"label_values\(([^,{)]+(?:\{[^}]*\})?)\s*,[^)]*\)", r"\1", expr)
    return text.replace("$job", job).replace("$node", ".+").replace("$gpu", ".+").replace("$instance", ".+")


async def _bridged_scenario(tmp_path: Path, mosquitto: Mosquitto, prometheus: Prometheus) -> float:
    """A mapper of two simulated GPUs over 15 minutes, bridged into ``prometheus`` alone: its batches (processes
    and pods included), its node stream (the mapper's own series) and the state messages of every report cycle
    (the status and health series over time). Returns the time of the last sample (s)."""
    # GPU 0 runs under the power cap its state messages ask for (DESIRED_W): its clocks are held back by it
    batches = stream(gpus=2, seconds=900, processes_every_s=5, cap_first_w=DESIRED_W)
    node = node_stream(seconds=900)  # the same mapper's own series over the same 15 minutes
    periodic = state_stream(batches)  # the state messages of every report cycle: the status series over time
    async with running_bridge(bridge_settings(mosquitto.url, prometheus.write_url, tmp_path)) as bridge:
        publish_states(mosquitto.url, periodic)
        publish_all(mosquitto.url, batches)
        publish_all(mosquitto.url, node, with_states=False)
        await wait_for(
            lambda: bridge.stats.batches_written >= len(batches) + len(node), timeout_s=60, what="every batch written"
        )
        await wait_for(
            lambda: bridge.stats.state_messages_written >= len(periodic) + 2, timeout_s=30, what="the states written"
        )
    return batches[-1].batch.ts_last_ms / 1000


async def test_every_dashboard_and_alert_expression_parses_and_draws_from_the_bridge_alone(
    tmp_path: Path, mosquitto: Mosquitto, prometheus: Prometheus
) -> None:
    """A cloud Prometheus fed only by the bridge: every panel's expression and every alert's draws data, the
    mapper's own series (the node stream) and the GPUs' health (the state messages) included."""
    at = await _bridged_scenario(tmp_path, mosquitto, prometheus)
    bridged = bridged_series_names()
    dash = [_grafana_to_promql(e) for e in exprs(dashboard())]
    rules = yaml.safe_load((REPO / "deploy" / "prometheus" / "alerts.yaml").read_text())
    alerts = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    on_gpu_series = 0
    drawn: set[str] = set()
    for expr in dash + alerts:
        result = prometheus.query(expr, at)  # raises naming the error when it does not parse
        refs = metric_refs(expr)
        assert refs and refs <= bridged, f"{expr} reads {sorted(refs - bridged)}, which the bridge does not write"
        if refs and refs <= bridged:
            on_gpu_series += 1
            drawn |= refs
            for name in refs:
                assert prometheus.query(name, at), f"{name} has no data from the bridge"
            head, *threshold = re.split(r"\s(?:>|<|==|!=|>=|<=)\s", expr)
            if threshold:  # a condition may well be false: the expression without its threshold has data
                assert prometheus.query(head, at), f"{expr}: {head} returns nothing from the bridged series"
            else:
                assert result, f"{expr} returns nothing from the bridged series"
    # every GPU series the dashboard and the alerts read is bridged: the status series from the state messages too
    gpu_refs = {n for e in dash + alerts for n in metric_refs(e) if n.startswith("gpu_") and "_mapper_" not in n}
    gpu_refs |= {n for e in dash + alerts for n in metric_refs(e) if n == "gpu_mapper_device_state"}
    assert gpu_refs <= drawn, f"not drawn from the bridge: {sorted(gpu_refs - drawn)}"
    assert {"gpu_xid_errors_total", "gpu_power_limit_desired_watts", "gpu_mapper_device_state"} <= drawn
    # and so is every series of the mapper itself they read, and the GPUs' health
    every_ref = {n for e in dash + alerts for n in metric_refs(e)}
    assert every_ref <= drawn, f"not drawn from the bridge: {sorted(every_ref - drawn)}"
    assert {
        "gpu_mapper_collect_duration_seconds_bucket",
        "gpu_mapper_buffer_bytes",
        "gpu_mapper_health_status",
    } <= drawn
    [build] = prometheus.query("gpu_mapper_build_info", at)
    assert build["metric"] == {"__name__": "gpu_mapper_build_info", "job": BRIDGE_JOB, "node": NODE, "mode": "dmi",
                               "version": "0.1.0"}  # fmt: skip
    assert on_gpu_series == len(dash + alerts) >= 23 + 16
    # the Source variable lists the bridge; the Node variable the node, from the bridged series alone
    [source] = [v["definition"] for v in dashboard()["templating"]["list"] if v["name"] == "job"]
    assert {s["metric"]["job"] for s in prometheus.query(_grafana_to_promql(source), at)} == {BRIDGE_JOB}
    # the alerts evaluate on the bridged series: the buffer 90 % full is over the 80 % threshold, the GPUs healthy
    by_name = {r["alert"]: r["expr"] for g in rules["groups"] for r in g["rules"]}
    [full] = prometheus.query(by_name["GpuMapperBufferNearlyFull"], at)
    assert full["metric"]["node"] == NODE and full["metric"]["job"] == BRIDGE_JOB
    assert prometheus.query(by_name["GpuHealthDegraded"], at) == []
    assert len(prometheus.query('gpu_mapper_health_status{level="0",status="healthy"} == 1', at)) == 2


@pytest.fixture
def persistent_mosquitto(tmp_path: Path) -> Iterator[Mosquitto]:
    """A broker that keeps its sessions across a restart (as a production broker must for the bridge: a session
    it forgot would miss what the mapper replays before the bridge subscribes again), saved every second."""
    store = tmp_path / "mosquitto-store"
    store.mkdir()
    # as root, mosquitto drops to its own user, which cannot write a test's private directory: it stays root
    user = "user root\n" if os.geteuid() == 0 else ""
    config = f"{user}persistence true\npersistence_location {store}/\nautosave_interval 1"
    broker = Mosquitto(tmp_path, extra_config=config)
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


async def test_a_mapper_offline_for_a_while_is_backfilled_in_place_with_no_gap_and_no_duplicate(
    tmp_path: Path, persistent_mosquitto: Mosquitto, prometheus: Prometheus
) -> None:
    from mapper.edge.gpu.simnvml import SimNvml
    from mapper.shared.settings import MqttSettings
    from tests.apphelpers import fast_settings, running_app

    mosquitto = persistent_mosquitto

    sim = SimNvml(2, "H100", seed=11, scenario="training")
    settings = fast_settings(
        str(tmp_path / "mapper"), devices_dir=None, telemetry_window_s=1.0, mqtt=MqttSettings(url=mosquitto.url)
    )
    async with running_bridge(bridge_settings(mosquitto.url, prometheus.write_url, tmp_path)) as bridge:
        async with running_app(settings, sim) as app:
            assert app.buffer is not None
            await wait_for(lambda: bridge.stats.batches_written >= 4, timeout_s=30, what="the online part written")
            mosquitto.stop()
            down_ms = int(time.time() * 1000)
            # offline: the mapper keeps sampling into its buffer
            await wait_for(lambda: app.buffer.stats().batches >= 24, timeout_s=60, what="12 s of offline batches")
            up_ms = int(time.time() * 1000)
            mosquitto.start()
            await wait_for(lambda: app.buffer.stats().batches == 0, timeout_s=60, what="the backlog replayed")

            def newest_ms() -> int:
                series = prometheus.raw_samples("gpu_power_usage_watts", time.time() + 5, 600)
                return min((p[-1][0] for p in series.values()), default=0) if len(series) == 2 else 0

            await wait_for(lambda: newest_ms() > up_ms + 1000, timeout_s=30, what="live samples after the outage")
            end_ms = int(time.time() * 1000)
        await wait_for(lambda: bridge.idle, timeout_s=30, what="the bridge idle")
    series = prometheus.raw_samples("gpu_power_usage_watts", end_ms / 1000 + 5, 600)
    assert {dict(k)["uuid"] for k in series} == {g.uuid for g in sim.gpus}, "every GPU, by uuid"
    for labels, points in series.items():
        stamps = [t for t, _ in points]
        assert stamps == sorted(set(stamps)), f"{labels}: duplicates or disorder"
        assert stamps[0] < down_ms and stamps[-1] > up_ms, f"{labels}: the offline part is missing"
        gaps = [b - a for a, b in itertools.pairwise(stamps)]
        step = sorted(gaps)[len(gaps) // 2]
        assert max(gaps) <= 2 * step, f"{labels}: a gap of {max(gaps)} ms (samples every {step} ms)"
        offline = [t for t in stamps if down_ms < t < up_ms]
        assert len(offline) >= (up_ms - down_ms) // step - 2, f"{labels}: {len(offline)} samples in the outage"


async def test_remote_write_2_falls_back_to_1_when_the_receiver_answers_2xx_without_the_written_header(
    tmp_path: Path, mosquitto: Mosquitto, prometheus: Prometheus
) -> None:
    # Prometheus 2.42 reads any body as 1.0: a 2.0 body parses as an empty WriteRequest, 204, no header.
    batches = stream(gpus=1, seconds=60)
    want = expected_samples(batches)
    settings = bridge_settings(mosquitto.url, prometheus.write_url, tmp_path, remote_write_version=2)
    async with running_bridge(settings) as bridge:
        assert bridge.snapshot().remote_write_version == 2
        publish_all(mosquitto.url, batches)
        await wait_for(lambda: bridge.stats.batches_written >= len(batches), timeout_s=30, what="every batch written")
    assert bridge.stats.version_fallbacks == 1 and bridge.version == 1
    assert count_samples(prometheus, '{__name__=~"gpu_.+"}', time.time() + 1, 600) == want


@pytest.mark.parametrize(("status", "retried"), [(429, True), (503, True), (404, False), (415, False)])
async def test_429_and_5xx_are_retried_and_other_4xx_are_refused_at_once_and_spooled(
    tmp_path: Path, mosquitto: Mosquitto, prometheus: Prometheus, status: int, retried: bool
) -> None:
    batches = stream(gpus=1, seconds=30)
    flaky = FlakyReceiver(prometheus.write_url)
    flaky.status = status
    try:
        async with running_bridge(bridge_settings(mosquitto.url, flaky.url, tmp_path)) as bridge:
            publish_all(mosquitto.url, batches)
            if retried:
                await wait_for(lambda: len(flaky.answers) >= 3, timeout_s=30, what="three attempts")
                await wait_for(lambda: bridge.stats.retries.get(f"http_{status}", 0) >= 3, timeout_s=10, what="counted")
                assert set(bridge.stats.retries) == {f"http_{status}"} and bridge.stats.batches_written == 0
                flaky.status = None
                await wait_for(lambda: bridge.stats.batches_written == len(batches), timeout_s=30, what="written")
                assert bridge.stats.spooled_requests == 0
            else:
                await wait_for(
                    lambda: bridge.idle and bridge.stats.batches_received == len(batches), timeout_s=30, what="refused"
                )
                assert bridge.stats.retries == {}
                # a request of several batches is split: each batch refused alone is counted and spooled (and the
                # state message, the first in the request)
                assert bridge.stats.refused_requests == {f"http_{status}": len(batches) + 1}
                spooled = len(list((tmp_path / "spool").glob("*.rw1")))
                assert bridge.stats.spooled_requests == len(batches) + 1 == spooled
                assert set(flaky.answers) == {status}
                assert bridge.stats.batches_written == 0
    finally:
        flaky.close()


async def test_the_bridge_serves_its_metrics_liveness_and_readiness(
    tmp_path: Path, mosquitto: Mosquitto, prometheus: Prometheus
) -> None:
    batches = stream(gpus=1, seconds=30)
    async with running_bridge(bridge_settings(mosquitto.url, prometheus.write_url, tmp_path)) as bridge:
        publish_all(mosquitto.url, batches)
        await wait_for(lambda: bridge.stats.batches_written == len(batches), timeout_s=30, what="written")
        assert bridge.metrics is not None
        base = bridge.metrics.url

        def get(path: str) -> tuple[int, str]:
            try:
                with urllib.request.urlopen(base + path, timeout=5) as resp:
                    return resp.status, resp.read().decode()
            except urllib.error.HTTPError as exc:
                return exc.code, exc.read().decode()

        status, text = await asyncio.to_thread(get, "/metrics")
        assert status == 200
        assert f"gpu_mapper_bridge_batches_written_total {float(len(batches))}" in text
        assert "gpu_mapper_bridge_write_duration_seconds_bucket" in text
        assert "gpu_mapper_bridge_sample_lag_seconds_count" in text
        assert "gpu_mapper_bridge_mqtt_connected 1.0" in text
        assert (await asyncio.to_thread(get, "/healthz"))[0] == 200
        assert await asyncio.to_thread(get, "/readyz") == (200, "ready\n")
        mosquitto.stop()
        await wait_for(lambda: not bridge.session.connected, timeout_s=10, what="the broker gone")
        status, text = await asyncio.to_thread(get, "/readyz")
        assert status == 503 and "not connected to the broker" in text
        mosquitto.start()
        await wait_for(lambda: bridge.session.connected, timeout_s=20, what="reconnected")


async def test_a_merged_batch_and_the_batches_it_replaced_dedup_against_each_other(
    tmp_path: Path, mosquitto: Mosquitto, prometheus: Prometheus
) -> None:
    from mapper.wire.telemetry import merge_batches
    from tests.bridgehelpers import Published

    batches = stream(gpus=1, seconds=200)  # 20 batches, seq 0..19
    assert [p.batch.seq for p in batches] == list(range(20))
    merged_payload = merge_batches([p.batch for p in batches[5:15]]).payload
    merged = Published(batches[0].topic, merged_payload, decode_batch(merged_payload))
    assert merged.batch.merged and merged.batch.seqs == tuple(range(5, 15))
    want = expected_samples(batches)
    async with running_bridge(bridge_settings(mosquitto.url, prometheus.write_url, tmp_path)) as bridge:
        publish_all(mosquitto.url, batches[:10])
        await wait_for(lambda: bridge.stats.batches_written >= 10, timeout_s=30, what="the first ten written")
        publish_all(mosquitto.url, [merged], with_states=False)  # 5..9 written already: 10..14 are new
        await wait_for(lambda: bridge.stats.batches_written >= 15, timeout_s=30, what="the merged batch written")
        publish_all(mosquitto.url, batches[12:], with_states=False)  # 12..14 came in the merged batch
        await wait_for(lambda: bridge.stats.batches_written >= 20, timeout_s=30, what="all written")
        await wait_for(lambda: bridge.idle, timeout_s=10, what="the bridge idle")
    assert bridge.stats.duplicate_batches == 5 + 3
    assert bridge.stats.batches_written == 20
    assert bridge.stats.samples_written == want
    assert count_samples(prometheus, '{__name__=~"gpu_.+"}', time.time() + 1, 900) == want


async def test_a_day_of_offline_telemetry_replayed_lands_in_place_on_the_time_axis(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    """The done-when of the bridge: a node offline for a day replays its buffer (oldest first, as the shipper
    does); with an out-of-order window of a day the whole day lands live, every sample at its own timestamp."""
    prom = Prometheus(tmp_path, ooo_window="25h")
    prom.start()
    try:
        now_ms = int(time.time() * 1000)
        day = stream(gpus=1, seconds=86_400, every_s=5, window_s=60.0, start_ms=now_ms - 86_400_000 - 5_000)
        want = expected_samples(day)
        settings = bridge_settings(mosquitto.url, prom.write_url, tmp_path)
        async with running_bridge(settings) as bridge:
            publish_all(mosquitto.url, day)
            await wait_for(lambda: bridge.stats.batches_written >= len(day), timeout_s=100, what="the day written")
        assert bridge.stats.samples_written == want
        assert sum(bridge.stats.refused_requests.values()) == 0
        [(_, points)] = prom.raw_samples("gpu_power_usage_watts", now_ms / 1000 + 1, 90_000).items()
        stamps = [t for t, _ in points]
        assert len(stamps) == 86_400 // 5
        assert stamps == sorted(set(stamps))
        assert stamps[0] == day[0].batch.ts_first_ms and stamps[-1] == day[-1].batch.ts_last_ms
        assert max(b - a for a, b in itertools.pairwise(stamps)) == 5_000, "no gap anywhere in the day"
        assert abs(stamps[0] - (now_ms - 86_400_000)) < 10_000, "a day ago, in place"
    finally:
        prom.stop()


_DEVICE = """
apiVersion: devices.kubeedge.io/v1beta1
kind: Device
metadata: {{name: gpu0, namespace: default}}
spec:
  deviceModelRef: {{name: nvidia-gpu}}
  nodeName: edge-1
  protocol: {{protocolName: gpu, configData: {{uuid: {uuid}}}}}
  properties:
  - {{name: power_usage, collectCycle: 100, reportCycle: 300, reportToCloud: true}}
  - {{name: power_limit, desired: {{value: "300"}}, collectCycle: 100, reportCycle: 300, reportToCloud: true}}
  - {{name: product_name, collectCycle: 1000, reportCycle: 300, reportToCloud: true}}
"""

#: The per-GPU series the bridge writes from the state messages, and two it writes from the telemetry batches.
_STATUS_SERIES = ("gpu_mapper_device_state", "gpu_xid_errors_total", "gpu_power_limit_desired_watts", "gpu_info")


async def test_a_mappers_status_series_and_identity_labels_reach_prometheus_as_its_own_metrics_show_them(
    tmp_path: Path, mosquitto: Mosquitto, prometheus: Prometheus
) -> None:
    """End to end from a real mapper: its desired power limit, an XID that makes its GPU unhealthy, the GPU's
    index, PCI bus id and driver go out in its state messages; the bridged Prometheus then holds exactly the
    series, labels and values of the mapper's own /metrics, and the unhealthy alert's expression is true."""
    from prometheus_client.parser import text_string_to_metric_families

    from mapper.edge.gpu.simnvml import SimNvml
    from mapper.shared.settings import MqttSettings
    from tests.apphelpers import fast_settings, running_app

    sim = SimNvml(1, "H100", seed=0, scenario="steady")
    uuid0 = sim.gpus[0].uuid
    devices = tmp_path / "devices"
    devices.mkdir()
    (devices / "gpu0.yaml").write_text(_DEVICE.format(uuid=uuid0))
    settings = fast_settings(str(tmp_path / "mapper"), devices_dir=str(devices), mqtt=MqttSettings(url=mosquitto.url))

    def edge(metrics_url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        with urllib.request.urlopen(metrics_url + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name in (*_STATUS_SERIES, "gpu_power_usage_watts"):
                    labels = tuple(sorted((k, v) for k, v in s.labels.items() if v))
                    out[(s.name, labels)] = 0.0 if s.name == "gpu_power_usage_watts" else s.value
        return out

    def store() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        out = {}
        for name in (*_STATUS_SERIES, "gpu_power_usage_watts"):
            for series in prometheus.query(name, time.time()):
                assert series["metric"]["job"] == BRIDGE_JOB  # every series the bridge writes says so
                labels = tuple(sorted((k, v) for k, v in series["metric"].items() if k not in ("__name__", "job")))
                out[(name, labels)] = 0.0 if name == "gpu_power_usage_watts" else float(series["value"][1])
        return out

    bridge_config = bridge_settings(mosquitto.url, prometheus.write_url, tmp_path)
    async with running_bridge(bridge_config) as bridge, running_app(settings, sim) as app:
        assert app.metrics is not None
        metrics_url = app.metrics.url
        await wait_for(lambda: sim.gpu(uuid0).power_limit_w == 300, timeout_s=20, what="the desired 300 W set")
        sim.inject_xid(uuid0, 48)
        await wait_for(lambda: app.workers[uuid0].state == "unhealthy", timeout_s=20, what="unhealthy: XID 48")
        want = await asyncio.to_thread(edge, metrics_url)  # (the server asks the app's loop: not from it)
        assert (
            "gpu_xid_errors_total",
            (("device", "gpu0"), ("gpu", "0"), ("node", "edge-1"), ("uuid", uuid0), ("xid", "48")),
        ) in want
        assert {k[0] for k in want} == {*_STATUS_SERIES, "gpu_power_usage_watts"}
        # the mapper's state messages go out every report cycle: the store catches up with its /metrics
        deadline = time.monotonic() + 30
        while (got := store()) != want:
            assert time.monotonic() < deadline, f"the store shows {got}, the mapper's /metrics {want}"
            await asyncio.sleep(0.2)
            want = await asyncio.to_thread(edge, metrics_url)
    assert bridge.stats.identity_unknown_batches == 0 and bridge.stats.bad_state_messages == 0
    desired = prometheus.query('gpu_power_limit_desired_watts{gpu="0"}', time.time())
    assert [float(s["value"][1]) for s in desired] == [300.0]
    [info] = prometheus.query("gpu_info", time.time())
    assert info["metric"]["pci_bus_id"] == sim.gpus[0].pci.busId and info["metric"]["driver_version"]
    [alert] = prometheus.query('gpu_mapper_device_state{state="unhealthy"} == 1', time.time())
    assert alert["metric"]["uuid"] == uuid0


async def test_without_a_state_message_a_devices_batches_wait_once_then_go_without_the_identity_labels(
    tmp_path: Path, mosquitto: Mosquitto, prometheus: Prometheus
) -> None:
    from mapper.wire.state import state_payload
    from mapper.wire.topics import state_topic
    from tests.bridgehelpers import NODE, Publisher

    batches = stream(gpus=2, seconds=60)
    gpu0 = [p for p in batches if p.gpu is not None and p.gpu.index == 0]
    gpu1 = [p for p in batches if p.gpu is not None and p.gpu.index == 1]
    assert len(gpu0) == len(gpu1) == 6
    # GPU 1's mapper predates the status keys: its state message names the uuid alone
    last1 = gpu1[-1].batch
    old_state = state_payload(last1.device, replace(last1.samples[-1], uuid=gpu1[0].batch.uuid))
    pub = Publisher(mosquitto.url, "test-old-mapper")
    try:
        settings = bridge_settings(mosquitto.url, prometheus.write_url, tmp_path, uuid_wait_s=1.0)
        async with running_bridge(settings) as bridge:
            pub.publish([(state_topic(NODE, last1.device), old_state, True)])
            publish_all(mosquitto.url, gpu0[:3] + gpu1[:3], with_states=False)
            await wait_for(lambda: bridge.stats.batches_written >= 6, timeout_s=30, what="the first batches written")
            # GPU 0's first batches waited for a state message that never came; GPU 1's did not wait
            assert bridge.stats.identity_unknown_batches == 3
            publish_all(mosquitto.url, gpu0[3:] + gpu1[3:], with_states=False)
            await wait_for(lambda: bridge.stats.batches_written >= 12, timeout_s=30, what="every batch written")
            assert bridge.stats.identity_unknown_batches == 3, "a device that had no state message waits once"
            assert bridge.stats.uuid_unknown_batches == 0 and bridge.stats.bad_state_messages == 0
    finally:
        pub.close()
    power = prometheus.raw_samples("gpu_power_usage_watts", time.time() + 1, 600)
    assert len(power) == 2
    for labels, points in power.items():
        assert "gpu" not in dict(labels) and len(points) == 60, labels
    assert not prometheus.query("gpu_mapper_device_state", time.time() + 1), "no status without the status keys"


DEVICE_FILE = """
apiVersion: devices.kubeedge.io/v1beta1
kind: Device
metadata: {{name: gpu0, namespace: default}}
spec:
  deviceModelRef: {{name: nvidia-gpu}}
  protocol: {{protocolName: gpu, configData: {{uuid: {uuid}}}}}
  properties:
  - {{name: power_usage, collectCycle: 100}}
"""


async def test_a_device_removed_and_added_again_while_the_mapper_runs_keeps_reaching_prometheus(
    tmp_path: Path, mosquitto: Mosquitto, prometheus: Prometheus
) -> None:
    """The route an operator takes: a Device removed and put back while the mapper runs (its GPU streams as
    ``_unbound/<uuid>`` meanwhile). The re-added Device's new batches must reach Prometheus: none dropped as a
    duplicate of one from before the removal, and no sequence anomaly at the bridge."""
    from mapper.edge.gpu.simnvml import SimNvml
    from mapper.shared.settings import MqttSettings
    from tests.apphelpers import fast_settings, running_app

    sim = SimNvml(1, "H100", seed=5, scenario="training")
    uuid = sim.gpus[0].uuid
    devices = tmp_path / "devices"
    devices.mkdir()
    device_file = devices / "gpu0.yaml"
    device_file.write_text(DEVICE_FILE.format(uuid=uuid))
    settings = fast_settings(
        str(tmp_path / "mapper"), devices_dir=str(devices), telemetry_window_s=1.0, mqtt=MqttSettings(url=mosquitto.url)
    )

    def newest_ms(device: str) -> int:
        series = prometheus.raw_samples(f'gpu_power_usage_watts{{device="{device}"}}', time.time() + 5, 600)
        return max((points[-1][0] for points in series.values()), default=0)

    async with running_bridge(bridge_settings(mosquitto.url, prometheus.write_url, tmp_path)) as bridge:
        async with running_app(settings, sim) as app:
            await wait_for(lambda: newest_ms("gpu0") > 0, timeout_s=30, what="gpu0's samples in Prometheus")
            written = bridge.stats.batches_written
            await wait_for(lambda: bridge.stats.batches_written >= written + 8, timeout_s=30, what="8 s of gpu0")
            device_file.unlink()  # removed: the GPU streams as _unbound/<uuid>
            await wait_for(lambda: not app.registry.devices(), what="the Device removed")
            written = bridge.stats.batches_written
            await wait_for(lambda: bridge.stats.batches_written >= written + 3, timeout_s=30, what="unbound batches")
            readded_ms = int(time.time() * 1000)
            device_file.write_text(DEVICE_FILE.format(uuid=uuid))  # put back
            await wait_for(lambda: app.registry.devices(), what="the Device back")
            await wait_for(
                lambda: newest_ms("gpu0") > readded_ms + 2000,
                timeout_s=30,
                what="samples of the re-added Device in Prometheus",
            )
        await wait_for(lambda: bridge.idle, timeout_s=30, what="the bridge idle")
    assert bridge.stats.duplicate_batches == 0, "a batch of the re-added Device was taken for an old one"
    assert bridge.stats.sequence_anomalies == {"backwards": 0, "gap": 0}
    # (One series, or two where the first batches went out before the state message named the GPU's identity:
    # the bridge then writes them without the gpu labels, docs/bridge.md.)
    series = prometheus.raw_samples('gpu_power_usage_watts{device="gpu0"}', time.time() + 5, 600)
    stamps = sorted(t for points in series.values() for t, _ in points)
    assert stamps == sorted(set(stamps)), "a sample written twice"
    after = [t for t in stamps if t > readded_ms]
    assert after and after[0] < readded_ms + 4000, "the re-added Device's first batches did not reach Prometheus"


async def test_a_stream_whose_numbering_starts_again_under_the_same_boot_id_is_written_and_counted(
    tmp_path: Path, mosquitto: Mosquitto, prometheus: Prometheus, caplog: pytest.LogCaptureFixture
) -> None:
    """A mapper before the fix (or any publisher) starting a device's sequence again at 0 under the same boot id:
    the bridge compares what identifies the data (number AND sample times), writes every new batch, counts the
    sequence going backwards once per restart of the numbering and logs it once per stream and minute; a true
    redelivery is still dropped. A jump is counted as a gap."""
    now_ms = int(time.time() * 1000)
    first = stream(gpus=1, seconds=120, start_ms=now_ms - 400_000, boot_id="5c1f0e9a")
    again = stream(gpus=1, seconds=120, start_ms=now_ms - 200_000, boot_id="5c1f0e9a", seed=4)
    assert [p.batch.seq for p in again][:3] == [0, 1, 2] and first[0].batch.device == again[0].batch.device
    want = expected_samples(first) + expected_samples(again)
    async with running_bridge(bridge_settings(mosquitto.url, prometheus.write_url, tmp_path)) as bridge:
        publish_all(mosquitto.url, first)
        await wait_for(lambda: bridge.stats.batches_written >= len(first), timeout_s=60, what="the first numbering")
        publish_all(mosquitto.url, again)
        publish_all(mosquitto.url, again[:3], with_states=False)  # redelivered: true duplicates
        await wait_for(
            lambda: bridge.stats.batches_written >= len(first) + len(again) and bridge.stats.duplicate_batches >= 3,
            timeout_s=60,
            what="the second numbering written",
        )
        await wait_for(lambda: bridge.idle, timeout_s=30, what="the bridge idle")
    assert bridge.stats.batches_written == len(first) + len(again)
    assert bridge.stats.duplicate_batches == 3
    assert bridge.stats.sequence_anomalies == {"backwards": 1, "gap": 0}
    assert len([r for r in caplog.records if "sequence went backwards" in r.getMessage()]) == 1
    assert count_samples(prometheus, '{__name__=~"gpu_.+"}', time.time() + 1, 900) == want
    power = prometheus.raw_samples("gpu_power_usage_watts", time.time() + 1, 900)
    stamps = sorted(t for points in power.values() for t, _ in points)
    assert len(stamps) == len(set(stamps)) == 240, "both numberings' samples (another GPU's, seed 4), each once"


async def test_batches_missing_from_a_stream_are_counted_as_a_gap(
    tmp_path: Path, mosquitto: Mosquitto, prometheus: Prometheus
) -> None:
    batches = stream(gpus=1, seconds=1200)  # 120 batches
    kept = batches[:10] + batches[90:]  # 80 missing: more than the tolerance (64)
    async with running_bridge(bridge_settings(mosquitto.url, prometheus.write_url, tmp_path)) as bridge:
        publish_all(mosquitto.url, kept)
        await wait_for(lambda: bridge.stats.batches_written >= len(kept), timeout_s=60, what="every batch written")
    assert bridge.stats.sequence_anomalies == {"backwards": 0, "gap": 1}
    assert bridge.stats.duplicate_batches == 0


_ORIN = """
apiVersion: devices.kubeedge.io/v1beta1
kind: Device
metadata: {{name: orin0, namespace: default}}
spec:
  deviceModelRef: {{name: nvidia-jetson}}
  nodeName: edge-1
  protocol: {{protocolName: gpu, configData: {{uuid: {uuid}}}}}
  properties:
{properties}
"""


async def test_a_jetsons_batches_reach_prometheus_in_base_units_as_its_own_metrics_show_them(
    tmp_path: Path, mosquitto: Mosquitto, prometheus: Prometheus
) -> None:
    """A mapper on a simulated AGX Orin (sysfs floats: 816.0 MHz, 10.095 W) into the bridge and a real
    Prometheus: at the time of the mapper's latest sample, every series the store holds has the value the
    mapper's own /metrics showed for it (gpu_frequency_hertz 8.16e8, not 816)."""
    from prometheus_client.parser import text_string_to_metric_families

    from mapper.bridge.core import bridged_series_names
    from mapper.edge.app import MapperApp, build_backend
    from mapper.edge.config import MqttSettings
    from mapper.shared.model import PROPERTY_BY_NAME
    from tests.apphelpers import fast_settings

    props = ("gpu_freq", "gpu_min_freq", "gpu_max_freq", "emc_freq", "power_usage", "power_gpu_rail",
             "temperature_tj", "utilization_gpu", "shared_memory_used", "power_mode", "product_name")  # fmt: skip
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
    (gpu,) = backend.list_gpus()
    # one sample a second: time enough to read /status, /metrics and /status again within one
    lines = "\n".join(f"  - {{name: {p}, collectCycle: 1000, reportCycle: 1000, reportToCloud: true}}" for p in props)
    (devices / "orin0.yaml").write_text(_ORIN.format(uuid=gpu.uuid, properties=lines))
    # the series of the Device's properties (the mapper's /metrics also shows its own status series)
    bridged = {PROPERTY_BY_NAME[p].prom_name for p in props} - {""} | {"gpu_info"}
    assert bridged <= bridged_series_names()

    def get(url: str) -> str:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.read().decode()

    def snapshot(base: str) -> tuple[int, dict[tuple[str, tuple[tuple[str, str], ...]], float]] | None:
        """(the latest sample's time, the bridged series of /metrics) when no sample came in between."""
        before = json.loads(get(base + "/status"))["gpus"][0]["sample"]["ts_ms"]
        text = get(base + "/metrics")
        if json.loads(get(base + "/status"))["gpus"][0]["sample"]["ts_ms"] != before:
            return None
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name in bridged:
                    out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if v)))] = s.value
        return before, out

    app = MapperApp(settings, backend)
    stop = asyncio.Event()
    task = asyncio.create_task(app.run(stop))
    try:
        async with running_bridge(bridge_settings(mosquitto.url, prometheus.write_url, tmp_path)) as bridge:
            await wait_for(lambda: app.metrics is not None or task.done(), what="the mapper to start")
            assert not task.done() and app.metrics is not None
            base = app.metrics.url
            await wait_for(lambda: bridge.stats.batches_written >= 2, timeout_s=30, what="batches written")
            deadline = time.monotonic() + 30
            while (snap := await asyncio.to_thread(snapshot, base)) is None:
                assert time.monotonic() < deadline, "no /metrics read between two samples"
            at_ms, want = snap

            def stored() -> dict[tuple[str, tuple[tuple[str, str], ...]], list[tuple[int, float]]]:
                out = {}
                for name in {n for n, _ in want}:
                    for labels, points in prometheus.raw_samples(name, time.time() + 5, 600).items():
                        # (the bridge's job label set aside: the mapper's own /metrics has none)
                        assert ("job", BRIDGE_JOB) in labels
                        out[(name, tuple(x for x in labels if x[0] not in ("__name__", "job")))] = points
                return out

            # the batch that holds the sample of at_ms is written
            await wait_for(
                lambda: any(t >= at_ms for p in stored().values() for t, _ in p), timeout_s=30, what="at_ms stored"
            )
            got = stored()
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 15) == 0
    hz = [v for (name, _), v in want.items() if name == "gpu_frequency_hertz"]
    assert hz and all(v >= 1e8 for v in hz), f"the mapper's /metrics gives Hz: {hz}"
    assert want.keys() <= got.keys(), sorted(want.keys() - got.keys())
    for key, value in want.items():
        latest = [v for t, v in got[key] if t <= at_ms][-1]  # the store's value at the time of that sample
        assert latest == pytest.approx(value, rel=1e-12), f"{key}: the store has {latest}, /metrics {value}"
    assert {"gpu_frequency_hertz", "gpu_rail_power_watts", "gpu_utilization_ratio"} <= {n for n, _ in want}


CHROMIUM = shutil.which("chromium-headless-shell") or shutil.which("chromium")
#: The browser window: wide enough for the dashboard's 24 columns, tall enough for every row.
WINDOW = (1600, 3300)


def _chromium(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Headless Chromium on ``url``; it waits (in virtual time) until the page's queries are done."""
    assert CHROMIUM is not None
    cmd = [CHROMIUM, "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--force-device-scale-factor=1"]
    cmd += [f"--window-size={WINDOW[0]},{WINDOW[1]}", "--virtual-time-budget=60000", *args, url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180)


def _png_pixels(data: bytes) -> tuple[int, int, int, bytes]:
    """(width, height, bytes per pixel, the unfiltered rows) of an 8-bit, non-interlaced RGB or RGBA PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, b"", b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        header, idat = (body, idat) if kind == b"IHDR" else (header, idat + body if kind == b"IDAT" else idat)
        pos += 12 + length
    width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", header)
    assert depth == 8 and color in (2, 6) and interlace == 0, (depth, color, interlace)
    bpp = 3 if color == 2 else 4
    raw, stride = zlib.decompress(idat), width * bpp
    out, prev = bytearray(), bytearray(stride)
    for row in range(height):
        kind, line = raw[row * (stride + 1)], bytearray(raw[row * (stride + 1) + 1 : (row + 1) * (stride + 1)])
        for i in range(stride):
            a, b = line[i - bpp] if i >= bpp else 0, prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            if kind == 1:
                line[i] = (line[i] + a) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + b) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + (a + b) // 2) & 0xFF
            elif kind == 4:
                p_ = a + b - c
                pa, pb, pc = abs(p_ - a), abs(p_ - b), abs(p_ - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 0xFF
        out += line
        prev = line
    return width, height, bpp, bytes(out)


def _coloured_pixels(png: tuple[int, int, int, bytes], rect: tuple[int, int, int, int]) -> int:
    """Pixels in ``rect`` (x, y, w, h) of a saturated colour (channels more than 60 apart): a drawn series; the
    page's background, borders, text and "No data" are greys."""
    width, _, bpp, pixels = png
    x0, y0, w, h = rect
    n = 0
    for y in range(y0, y0 + h):
        row = pixels[(y * width + x0) * bpp : (y * width + x0 + w) * bpp]
        for i in range(0, len(row), bpp):
            rgb = row[i : i + 3]
            n += max(rgb) - min(rgb) > 60
    return n


async def test_the_dashboard_drawn_in_headless_chromium_has_data_in_every_panel_from_the_bridge_alone(
    tmp_path: Path, mosquitto: Mosquitto, prometheus: Prometheus
) -> None:
    """The dashboard as a user sees it without Grafana: deploy/grafana/preview.html runs every panel's own PromQL
    against a Prometheus fed only by the bridge (the scenario above) and draws it; headless Chromium renders it.
    Every panel of the dashboard JSON says it drew data, and its part of the screenshot shows a drawn series."""
    require(CHROMIUM is not None, "chromium-headless-shell is not installed (scripts/bootstrap.sh --test installs it)")
    at = await _bridged_scenario(tmp_path, mosquitto, prometheus)
    query = urllib.parse.urlencode({"prometheus": prometheus.url, "end": f"{at:.3f}", "range": "1200"})
    url = (REPO / "deploy" / "grafana" / "preview.html").as_uri() + "?" + query
    dom = (await asyncio.to_thread(_chromium, url, "--dump-dom")).stdout
    assert re.search(r'<body[^>]*data-done="true"', dom), dom[-3000:]
    assert "data-error" not in dom.split('<div id="grid"', 1)[0], "the page itself failed"
    assert f"Source (job): {BRIDGE_JOB}" in dom, "the Source variable's first value: the bridge, the only job"
    drawn = {}
    for tag in re.findall(r'<div class="panel"[^>]*>', dom):
        attrs = dict(re.findall(r'data-([a-z]+)="([^"]*)"', tag))
        drawn[int(attrs["id"])] = attrs
    panels = {p["id"]: p for p in dashboard()["panels"] if p["type"] != "row"}
    assert set(drawn) == set(panels), "one drawn panel per panel of the dashboard"
    not_drawn = {panels[i]["title"]: (a["state"], a.get("error", "")) for i, a in drawn.items() if a["state"] != "data"}
    assert not not_drawn, f"panels without data: {not_drawn}"
    stats = {panels[i]["title"]: int(a["series"]) for i, a in drawn.items() if panels[i]["type"] == "stat"}
    assert stats == {"GPUs": 1, "Power draw": 1, "Power cap": 1, "Hottest GPU": 1}  # one node: one value each

    shot = tmp_path / "dashboard.png"
    made = await asyncio.to_thread(_chromium, url, f"--screenshot={shot}")
    assert shot.exists(), made.stderr[-2000:]
    png = _png_pixels(shot.read_bytes())
    assert png[:2] == WINDOW
    for i, a in drawn.items():
        x, y, w, h = (int(v) for v in a["rect"].split(","))
        assert w > 50 and h > 20 and y + h <= WINDOW[1], f"{panels[i]['title']} is outside the screenshot: {a['rect']}"
        assert _coloured_pixels(png, (x, y, w, h)) >= 20, f"{panels[i]['title']}: nothing drawn in the screenshot"
    print(f"screenshot of {len(drawn)} panels, every one with data: {shot}")
