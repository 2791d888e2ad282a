"""What the mapper logs, as an operator reads it: the real mapper, a real mosquitto stopped and started, the log
captured as it is written.

A broker outage is one warning when it begins and one line when the broker is back and the backlog has gone out
(how long it was away, how much waited, how long the replay took); in between only rate-limited counts. The
replay starts once the link is up and its byte figures are the buffer's. The session reconnects within a few
seconds of the broker's return. Acknowledgements are one short line each; a rejected value names what the GPU
allows; a missing EdgeCore socket is a warning at once, repeated with back-off.
"""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
import sqlite3
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from mapper.clock import FakeClock, format_duration_s
from mapper.edge.gpu.simnvml import SimNvml
from mapper.edge.kubeedge.dmi.client import DmiClient
from mapper.edge.outbox.shipper import TelemetryShipper
from mapper.edge.storage.buffer import Buffer
from mapper.errors import TransientError
from mapper.net.mqtt import MAPPER_RECONNECT_MAX_S, MqttSession, mapper_session
from mapper.shared.model import GpuInfo, Sample
from mapper.shared.settings import MqttSettings
from mapper.tools.discover import device_yaml
from mapper.wire.payloads import STATUS_OFFLINE
from mapper.wire.telemetry import EncodedBatch, encode_batch
from tests.apphelpers import fast_settings, running_app, wait_for
from tests.brokers import Mosquitto

REPO = Path(__file__).resolve().parent.parent
MQTT = "mapper.net.mqtt"
SHIPPER = "mapper.edge.outbox.shipper"
#: How long the broker stays away: long enough that a back-off without a low cap would wait more than 8 s
#: (doubling from 0.5 s, the 6th wait is 8-16 s and starts before 15.5 s), and shorter than the first count
#: line (60 s).
OUTAGE_S = 16.0
#: The issue's bound between two attempts (the mapper's cap is below it), and broker start to session connected at
#: most: that plus a generous margin for a loaded CI machine (it took ~20 s with a 30 s cap).
ATTEMPTS_APART_S = 5.0
RECONNECT_BOUND_S = 8.0
BACK_RE = re.compile(
    r"telemetry: broker 'default' back after (?P<away>[\d.]+ \w+) away; replay done: (?P<batches>\d+) batches "
    r"\((?P<bytes>[\d.]+ \w+)\) had waited, sent in (?P<took>[\d.]+ \w+)$"
)


def _seconds(text: str) -> float:
    value, unit = text.split()
    return float(value) * {"s": 1, "min": 60, "h": 3600}[unit]


def _bytes(text: str) -> float:
    value, unit = text.split()
    return float(value) * {"B": 1, "KiB": 1024, "MiB": 2**20}[unit]


@dataclass
class Line:
    wall: float
    logger: str
    level: int
    text: str


def _lines(caplog: pytest.LogCaptureFixture, *loggers: str, level: int = logging.INFO) -> list[Line]:
    return [
        Line(r.created, r.name, r.levelno, r.getMessage())
        for r in caplog.records
        if r.name in loggers and r.levelno >= level
    ]


def _buffer_rows(db: Path) -> tuple[int, int]:
    """Rows of the buffer file and their size as the buffer counts it (payload + 24 per row), read with SQLite
    itself: what the mapper's own figures must match."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
        n, size = conn.execute("SELECT COUNT(*), COALESCE(SUM(length(payload) + 24), 0) FROM batches").fetchone()
    return int(n), int(size)


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            # (the mapper's own series carry its node: ``name{node="..."} value``)
            if line.startswith((name + " ", name + "{")):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_broker_outage_is_one_line_out_one_line_back_with_a_true_replay_soon_after_it_returns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    broker = Mosquitto(tmp_path)
    broker.start()
    devices = tmp_path / "devices"
    devices.mkdir()
    data = tmp_path / "data"
    settings = fast_settings(
        str(data),
        devices_dir=str(devices),
        mqtt=MqttSettings(url=broker.url),
        # Slow enough that the replay lasts a few seconds (its figures can be watched), far above the live rate.
        replay_rate_bytes_per_s=4000,
    )
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.DEBUG, logger=MQTT)
    caplog.set_level(logging.DEBUG, logger=SHIPPER)
    sim = SimNvml(2, "H100", seed=0, scenario="steady")
    try:
        async with running_app(settings, sim) as app:
            assert app.session is not None and app.metrics is not None
            await wait_for(lambda: app.session is not None and app.session.connected, what="the first connection")
            await wait_for(lambda: app.shipper.published_batches >= 2, what="live batches published")

            # The broker goes away.
            stopped_wall = time.time()
            stopped = time.monotonic()
            broker.stop()
            while time.monotonic() - stopped < OUTAGE_S:
                # No replay while the broker is away, and nothing said to be replaying.
                snap = app.status.snapshot()
                assert not app.shipper.stats().replay_active
                assert snap.replay_remaining_batches == 0 and snap.replay_remaining_bytes == 0
                await asyncio.sleep(0.25)
            waiting_rows, _ = _buffer_rows(data / "telemetry.db")
            assert waiting_rows > app.shipper.max_in_flight, "a backlog long enough for a replay"

            # It comes back: the session is connected again within the bound.
            started_wall = time.time()
            started = time.monotonic()
            broker.start()
            await wait_for(lambda: app.session is not None and app.session.connected, timeout_s=30, what="reconnect")
            reconnect_s = time.monotonic() - started
            connected_wall = time.time()
            assert reconnect_s < RECONNECT_BOUND_S, f"reconnected {reconnect_s:.1f} s after the broker started"

            # The replay: its remaining bytes are the buffer's, counted by SQLite; /metrics says the same.
            samples: list[tuple[int, int, int]] = []
            metric_bytes: float | None = None

            def back_lines() -> list[Line]:
                # (after the outage: a mapper whose first publish, its node stream's, goes out before its first
                # connection says the broker was back after a few ms at start-up)
                return [ln for ln in _lines(caplog, SHIPPER) if "back after" in ln.text and ln.wall >= stopped_wall]

            deadline = time.monotonic() + 60
            while not back_lines():
                assert time.monotonic() < deadline, "no line saying the broker is back"
                snap = app.status.snapshot()
                if snap.replay_remaining_batches > 0:
                    _, sql_bytes = _buffer_rows(data / "telemetry.db")
                    samples.append((snap.replay_remaining_batches, snap.replay_remaining_bytes, sql_bytes))
                    if metric_bytes is None and snap.replay_remaining_batches >= 10:
                        metric_bytes = await asyncio.to_thread(
                            _metric, app.metrics.url, "gpu_mapper_replay_remaining_bytes"
                        )
                await asyncio.sleep(0.05)
            back_wall = time.time()
    finally:
        broker.stop()

    # Start-up says nothing of a return: the node stream's first sample raced the first connection, no outage.
    early = [ln for ln in _lines(caplog, SHIPPER) if "back after" in ln.text and ln.wall < stopped_wall]
    assert early == [], early
    assert len(samples) >= 3, f"the replay was watched only {len(samples)} times"
    for batches, nbytes, sql_bytes in samples:
        assert batches > 0 and nbytes == sql_bytes > 0, (batches, nbytes, sql_bytes)
    assert metric_bytes is not None and metric_bytes > 0

    # While it was away: one warning from the session; nothing else above debug from the session or the shipper.
    during = [ln for ln in _lines(caplog, MQTT, SHIPPER) if stopped_wall <= ln.wall < started_wall]
    assert [(ln.logger, ln.level) for ln in during] == [(MQTT, logging.WARNING)], during
    assert "connection lost" in during[0].text
    # Each wait between two attempts was within the cap (a debug line per attempt).
    waits = [
        float(m.group(1))
        for ln in _lines(caplog, MQTT, level=logging.DEBUG)
        if stopped_wall <= ln.wall < connected_wall
        and (m := re.search(r"next connection attempt in ([\d.]+)s", ln.text))
    ]
    assert len(waits) >= 5 and max(waits) <= ATTEMPTS_APART_S, waits
    # The replay started once the link was up, never before.
    starts = [
        ln for ln in _lines(caplog, SHIPPER, level=logging.DEBUG) if "replay of" in ln.text and ln.wall >= stopped_wall
    ]
    assert starts and all(ln.wall >= connected_wall - 0.5 for ln in starts), (starts, connected_wall)

    # Back: one line, after the replay, saying how long it was away, what waited and how long the replay took.
    after = [ln for ln in _lines(caplog, MQTT, SHIPPER) if started_wall <= ln.wall <= back_wall]
    said = [ln for ln in after if "%" not in ln.text]  # (a replay longer than 10 s adds progress lines)
    assert len(said) == 1, said
    m = BACK_RE.search(said[0].text)
    assert m is not None, said[0].text
    away_s = _seconds(m["away"])
    assert abs(away_s - (connected_wall - stopped_wall)) <= 2.0, (m["away"], connected_wall - stopped_wall)
    cut_meanwhile = waiting_rows / OUTAGE_S * (reconnect_s + 2) + 2  # batches cut from the count to the link
    assert waiting_rows <= int(m["batches"]) <= waiting_rows + cut_meanwhile, (m["batches"], waiting_rows)
    assert _bytes(m["bytes"]) > 0
    assert 0 < _seconds(m["took"]) <= back_wall - connected_wall + 1.0


def test_the_mappers_session_waits_at_most_its_cap_between_attempts() -> None:
    """The back-off doubles from 0.5 s and stops at the mapper's cap (with jitter below it), however long the
    broker is away; the mapper's session says its return at debug level (the shipper's line says it)."""
    session = mapper_session("mqtt://127.0.0.1:1", MqttSettings(url="mqtt://127.0.0.1:1"), "n1", "t", STATUS_OFFLINE)
    assert session.reconnect_max_s == MAPPER_RECONNECT_MAX_S <= ATTEMPTS_APART_S
    assert session.reconnect_log_level == logging.DEBUG
    delays = [session._next_delay() for _ in range(40)]
    assert delays[0] == pytest.approx(0.5)
    assert max(delays) <= MAPPER_RECONNECT_MAX_S and min(delays[10:]) >= MAPPER_RECONNECT_MAX_S / 2
    assert len({round(d, 6) for d in delays[10:]}) > 20, "jittered, not in step"
    # A session of its own (the bridge's) keeps its default: info, 30 s.
    plain = MqttSession("mqtt://127.0.0.1:1", "other")
    assert plain.reconnect_log_level == logging.INFO and plain.reconnect_max_s == 30.0


# --------------------------------------------------------------------------------------------------
# The counts while a broker is away: rate-limited, on fake time
# --------------------------------------------------------------------------------------------------


def _batch(seq: int) -> EncodedBatch:
    sample = Sample("GPU-1", 1_780_000_000_000 + seq * 1000, {"temperature": 60, "power_usage": 100.5})
    return encode_batch([sample], node="n1", device="default/gpu0", uuid="GPU-1", boot_id="0a1b2c3d", seq=seq)


async def test_while_a_broker_is_away_the_count_is_logged_at_doubling_intervals(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    buf = Buffer(tmp_path / "buf.db", max_bytes=50_000_000, max_age_s=10**9, clock=clock)

    async def refuse(topic: str, payload: bytes, qos: int = 1, retain: bool = False, timeout_s: float = 10.0) -> None:
        raise TransientError("not connected", reason="mqtt-offline")

    async def fake_sleep(seconds: float) -> None:
        clock.advance(seconds)
        await asyncio.sleep(0)

    shipper = TelemetryShipper(buf, refuse, node="n1", clock=clock, retry_s=5.0, sleep=fake_sleep)
    for seq in range(30):
        shipper.submit(_batch(seq))
    caplog.set_level(logging.INFO, logger=SHIPPER)
    task = asyncio.create_task(shipper.run())
    start = clock.monotonic()
    await wait_for(lambda: clock.monotonic() - start >= 2 * 3600, timeout_s=60, what="two hours of fake time")
    await shipper.stop(1)
    task.cancel()
    buf.close()
    counts = [r.getMessage() for r in caplog.records if "unreachable for" in r.getMessage()]
    # The first after a minute, then at 2, 4, 8, 16 min, then hourly: 60, 180, 420, 900, 1860, 3780 s in 2 h.
    expected_s = [60, 180, 420, 900, 1860, 3780]
    assert len(counts) == len(expected_s), counts
    for text, due in zip(counts, expected_s, strict=True):
        said = _seconds(re.search(r"unreachable for ([\d.]+ \w+):", text).group(1))  # type: ignore[union-attr]
        assert due <= said <= due + 5.0 + 60, (text, due)  # within one retry (and the rounding of minutes)
        assert "30 batches" in text and "buffered" in text
    assert not [r for r in caplog.records if r.levelno >= logging.INFO and "replay" in r.getMessage()]


# --------------------------------------------------------------------------------------------------
# Acknowledgements and a rejected value
# --------------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
async def test_acks_are_one_short_line_and_an_out_of_range_value_names_the_range(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sim = SimNvml(2, "H100", seed=0, scenario="steady")
    probe = SimNvml(1, "H100", seed=0)  # the range as NVML gives it, asked directly
    probe.nvmlInit()
    lo_mw, hi_mw = probe.nvmlDeviceGetPowerManagementLimitConstraints(probe.nvmlDeviceGetHandleByIndex(0))
    probe.nvmlShutdown()
    gpus = [GpuInfo(uuid=g.uuid, index=i, name="NVIDIA H100 80GB HBM3") for i, g in enumerate(sim.gpus)]
    devices = tmp_path / "devices"
    devices.mkdir()
    shutil.copy(REPO / "device-models" / "nvidia-gpu.yaml", devices)
    desired = {gpus[0].uuid: {"power_limit": "9999"}, gpus[1].uuid: {"power_limit": "300", "persistence_mode": "true"}}
    (devices / "edge-1.yaml").write_text(device_yaml(gpus, "edge-1", desired=desired))
    caplog.set_level(logging.INFO)
    async with running_app(fast_settings(str(tmp_path / "data"), devices_dir=str(devices)), sim) as app:
        await wait_for(
            lambda: (
                all(w.desired_status and "pending" not in w.desired_status for w in app.workers.values())
                and sum(1 for w in app.workers.values() if "applied" in w.desired_status) == 1
            ),
            what="both GPUs' desired values settled",
        )
    acks = [
        r for r in caplog.records if r.name == "mapper.edge.outbox.publish" and r.getMessage().startswith("desired")
    ]
    texts = [r.getMessage() for r in acks]
    allowed = f"{lo_mw / 1000:g}-{hi_mw / 1000:g} W"
    rejected = f"desired power_limit=9999 on default/edge-1-gpu0: rejected (out-of-range; allowed {allowed})"
    assert rejected in texts, texts
    assert next(r for r in acks if r.getMessage() == rejected).levelno == logging.WARNING
    assert "desired power_limit=300 on default/edge-1-gpu1: applied" in texts
    assert "desired persistence_mode=true on default/edge-1-gpu1: applied" in texts
    assert all(len(t) <= 120 and "{" not in t for t in texts), texts


# --------------------------------------------------------------------------------------------------
# EdgeCore's socket missing
# --------------------------------------------------------------------------------------------------


async def test_a_missing_edgecore_socket_is_a_warning_at_once_then_with_back_off(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    socket_path = str(tmp_path / "dmi.sock")
    client = DmiClient(edgecore_socket=socket_path, mapper_socket=str(tmp_path / "gpu.sock"), clock=clock)
    caplog.set_level(logging.WARNING, logger="mapper.edge.kubeedge.dmi.client")
    at: list[float] = []
    start = clock.monotonic()
    for _ in range(1000):
        before = len(caplog.records)
        await client.step()
        if len(caplog.records) > before:
            at.append(clock.monotonic() - start)
        clock.advance(1.0)
    await client.close()
    # At once, then 10, 20, 40, 80, 160 s apart, then every 5 min: 0, 10, 30, 70, 150, 310, 610, 910 s.
    assert at == [0, 10, 30, 70, 150, 310, 610, 910]
    texts = [r.getMessage() for r in caplog.records]
    assert all(socket_path in t and "dmiSockPath" in t for t in texts)
    assert f"(for {format_duration_s(610)})" in texts[6]
    assert client.last_error == f"EdgeCore socket {socket_path} is missing"


@pytest.mark.timeout(60)
async def test_the_mapper_without_edgecore_says_so_in_its_first_seconds(
    tmp_path: Path, sock_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    sim = SimNvml(1, "H100", seed=0, scenario="steady")
    missing = f"{sock_dir}/dmi.sock"
    caplog.set_level(logging.INFO)
    started = time.monotonic()
    settings = fast_settings(str(tmp_path / "data"), edgecore_socket=missing, socket=f"{sock_dir}/gpu.sock")
    async with running_app(settings, sim):
        await wait_for(
            lambda: any(missing in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records),
            what="a warning naming the missing socket",
        )
        assert time.monotonic() - started < 5.0


# --------------------------------------------------------------------------------------------------
# The start-up line of each HTTP server names exactly what it serves
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["mapper", "bridge"])
def test_the_start_up_line_names_only_the_paths_that_answer(which: str, caplog: pytest.LogCaptureFixture) -> None:
    import urllib.error

    from mapper.bridge.core import BridgeStats
    from mapper.bridge.metrics import BridgeMetricsServer
    from mapper.edge.status.metrics import MetricsServer
    from mapper.edge.status.stats import Readiness
    from mapper.net.http import LoopHeartbeat, parse_metrics_addr
    from tests.test_metrics import make_snapshot

    caplog.set_level(logging.INFO, logger="mapper.net.http")
    beats = [LoopHeartbeat("loop", time.monotonic(), 1.0)]
    server = (
        MetricsServer(
            "127.0.0.1:0",
            snapshot=make_snapshot,
            heartbeats=lambda: beats,
            readiness=lambda: Readiness(nvml_initialised=True, dmi_registered=True),
        )
        if which == "mapper"
        else BridgeMetricsServer("127.0.0.1:0", stats=BridgeStats, heartbeats=lambda: beats, problems=lambda: [])
    )
    with server:
        (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("metrics: serving ")]
        m = re.fullmatch(r"metrics: serving (?P<paths>(?:/\w+ ?)+) on (?P<url>http://[\d.:]+)", line)
        assert m is not None, line
        assert parse_metrics_addr(m["url"].removeprefix("http://")) == ("127.0.0.1", server.port)
        named = m["paths"].split()

        def status_of(path: str) -> int:
            try:
                with urllib.request.urlopen(m["url"] + path, timeout=5) as resp:
                    return int(resp.status)
            except urllib.error.HTTPError as exc:
                return int(exc.code)

        answering = [p for p in ("/metrics", "/healthz", "/readyz", "/status") if status_of(p) != 404]
    assert named == answering, (line, answering)
    assert ("/status" in named) == (which == "mapper")
