"""A full data dir under a running ``gpu-mapper run --sim 2`` (a real, small tmpfs, filled up and freed): the mapper
degrades and never stops. Collection, policies and desired-state enforcement go on from memory, the buffer drops
the oldest and counts them in samples, telemetry keeps reaching the broker, ``/healthz`` stays 200 while
``/readyz`` and the devices' state messages say ``degraded: data dir full``; storing resumes by itself once space
returns, and SIGTERM on a full disk exits 0."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import paho.mqtt.client as paho
import pytest

from tests.brokers import Mosquitto, free_port
from tests.smallfs import NEEDS_ROOT, fill, free_bytes, small_tmpfs

REPO = Path(__file__).resolve().parents[1]

DEVICE = """
apiVersion: devices.kubeedge.io/v1beta1
kind: Device
metadata: {{name: gpu{index}, namespace: default}}
spec:
  deviceModelRef: {{name: nvidia-gpu}}
  protocol: {{protocolName: gpu, configData: {{uuid: {uuid}}}}}
  properties:
  - {{name: power_limit, desired: {{value: "{watts}"}}}}
"""

CONFIG = """
telemetry: {window: 1s}
defaults: {collectCycle: 200, reportCycle: 500, stateReportCycle: 1000}
buffer: {memoryMaxBytes: 16KiB, reserveBytes: 16KiB, compactAfter: 0s}
"""


def http(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return 0, str(exc)


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of one series of the text format (labels given must match), None when absent."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0])) if "{" in line else {}
        if all(found.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def stored_caps(data: Path) -> dict[str, float]:
    """The power caps the desired store holds (GPU uuid -> W), read from its file as another reader would."""
    uri = f"file:{data / 'desired.db'}?mode=ro"
    with contextlib.closing(sqlite3.connect(uri, uri=True, timeout=5)) as db:
        rows = db.execute(
            "SELECT d.uuid, s.raw FROM desired s JOIN devices d ON d.device = s.device "
            "WHERE s.property = 'power_limit' AND s.removed = 0"
        ).fetchall()
    return {str(uuid): float(json.loads(raw)) for uuid, raw in rows}


def wait(predicate, timeout_s: float, what: str, proc: subprocess.Popen[bytes]):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the mapper exited on its own (code {proc.returncode}) waiting for {what}"
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


class Listener:
    """A plain paho subscriber (its own thread) keeping every message on a filter."""

    def __init__(self, url: str, topic: str) -> None:
        host, port = url.removeprefix("mqtt://").split(":")
        self.messages: list[tuple[float, str, bytes]] = []
        self.client = paho.Client(callback_api_version=paho.CallbackAPIVersion.VERSION2, client_id="test-listener")
        self.client.on_message = lambda _c, _u, m: self.messages.append((time.time(), m.topic, m.payload))
        self.client.on_connect = lambda c, *_: c.subscribe(topic, qos=1)
        self.client.connect(host, int(port), keepalive=30)
        self.client.loop_start()

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@NEEDS_ROOT
@pytest.mark.timeout(420)
def test_a_data_dir_that_fills_up_under_a_running_mapper_degrades_never_stops_and_recovers(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    devices = tmp_path / "devices"
    devices.mkdir()
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with small_tmpfs(tmp_path / "data", 6 * 1024**2) as data:
        log = (tmp_path / "mapper.log").open("wb")
        cmd = [
            sys.executable,
            "-m",
            "mapper.cli",
            "run",
            "--sim",
            "2",
            "--node-name",
            "edge-1",
            "--data-dir",
            str(data),
        ]
        cmd += ["--devices", str(devices), "--mqtt", mosquitto.url, "--metrics-addr", f"127.0.0.1:{port}"]
        cmd += ["--config", str(config)]
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait(lambda: http(base + "/readyz")[0] == 200, 60, "the mapper ready", proc)
            status = json.loads(http(base + "/status")[1])
            uuids = [g["uuid"] for g in status["gpus"]]
            assert len(uuids) == 2
            caps = {uuids[0]: 400, uuids[1]: 410}
            (devices / "gpus.yaml").write_text(
                "---".join(DEVICE.format(index=i, uuid=u, watts=caps[u]) for i, u in enumerate(uuids))
            )

            def limits() -> dict[str, float | None]:
                text = http(base + "/metrics")[1]
                return {u: metric(text, "gpu_power_limit_watts", uuid=u) for u in uuids}

            wait(lambda: limits() == caps, 60, "the caps applied", proc)

            # The broker goes away: the batches pile up in the buffer; then the data dir fills up.
            mosquitto.stop()
            wait(
                lambda: (metric(http(base + "/metrics")[1], "gpu_mapper_buffer_batches") or 0) >= 10,
                60,
                "a backlog in the buffer",
                proc,
            )
            filler = fill(data)
            assert free_bytes(data) == 0
            wait(lambda: "degraded: data dir full" in http(base + "/readyz")[1], 60, "/readyz degraded", proc)
            assert http(base + "/readyz")[0] == 200, "degraded is still ready: its /metrics must stay scraped"
            assert http(base + "/healthz")[0] == 200

            def dropped_samples() -> float:
                text = http(base + "/metrics")[1]
                return metric(text, "gpu_mapper_buffer_dropped_samples_total", reason="disk_full") or 0.0

            wait(lambda: dropped_samples() > 0, 120, "samples dropped and counted (disk_full)", proc)
            text = http(base + "/metrics")[1]
            assert metric(text, "gpu_mapper_degraded", reason="data dir full") == 1.0
            assert (metric(text, "gpu_mapper_buffer_dropped_batches_total", reason="disk_full") or 0) > 0

            # Desired state is still enforced: a new cap applies on the full disk (its store fails softly).
            caps = {uuids[0]: 350, uuids[1]: 360}
            (devices / "gpus.yaml").write_text(
                "---".join(DEVICE.format(index=i, uuid=u, watts=caps[u]) for i, u in enumerate(uuids))
            )
            wait(lambda: limits() == caps, 60, "the new caps applied on a full disk", proc)

            # The broker comes back: state messages say degraded, and new telemetry reaches it.
            mosquitto.start()
            listener = Listener(mosquitto.url, "gpu-mapper/edge-1/#")
            try:
                back_s = time.time()

                def degraded_state() -> bool:
                    for _, topic, payload in list(listener.messages):
                        if topic.endswith("/state") and json.loads(payload).get("degraded") == "data dir full":
                            return True
                    return False

                wait(degraded_state, 60, "a state message saying degraded: data dir full", proc)

                def fresh_batches() -> int:
                    return sum(
                        1 for t, topic, _ in list(listener.messages) if topic.endswith("/telemetry") and t > back_s
                    )

                wait(lambda: fresh_batches() >= 4, 60, "telemetry reaching the broker while the disk is full", proc)
            finally:
                listener.close()
            assert http(base + "/healthz")[0] == 200

            # Space returns: storing resumes by itself, and the degradation ends.
            filler.unlink()
            wait(lambda: "degraded" not in http(base + "/readyz")[1], 60, "/readyz no longer degraded", proc)
            wait(
                lambda: metric(http(base + "/metrics")[1], "gpu_mapper_buffer_memory_batches") == 0,
                30,
                "nothing left in memory",
                proc,
            )
            assert (data / "telemetry.db-reserve").stat().st_size == 16 * 1024, "the reserve made again"
            # The caps set while the disk was full are persisted once it takes writes again (no new change needed).
            wait(lambda: stored_caps(data) == caps, 60, "the caps set on the full disk in the desired store", proc)

            # Full again, and stopped there: SIGTERM stores what it can and exits 0, no traceback.
            mosquitto.stop()
            filler = fill(data)
            wait(lambda: "degraded: data dir full" in http(base + "/readyz")[1], 60, "degraded again", proc)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0

            # Started again on the full disk (a restart by the kubelet, a reboot): it starts degraded, never exits,
            # enforces the caps, and stores again once space returns; nothing of the data dir is moved aside.
            fill(data, "filler-2")  # what the shutdown left free
            assert free_bytes(data) == 0
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
            wait(lambda: "degraded: data dir full" in http(base + "/readyz")[1], 60, "started degraded", proc)
            assert http(base + "/readyz")[0] == 200 and http(base + "/healthz")[0] == 200
            wait(lambda: limits() == caps, 60, "the caps enforced after a start on the full disk", proc)
            wait(
                lambda: (metric(http(base + "/metrics")[1], "gpu_mapper_buffer_memory_batches") or 0) > 0,
                60,
                "new batches kept in memory",
                proc,
            )
            filler.unlink()
            (data / "filler-2").unlink()
            wait(lambda: "degraded" not in http(base + "/readyz")[1], 60, "/readyz no longer degraded", proc)
            wait(
                lambda: metric(http(base + "/metrics")[1], "gpu_mapper_buffer_memory_batches") == 0,
                30,
                "nothing left in memory after the start on a full disk",
                proc,
            )
            assert not list(data.glob("*.corrupt-*")), "nothing taken for corrupt"
            assert stored_caps(data) == caps, "the desired store kept"
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            log.close()
    output = (tmp_path / "mapper.log").read_text()
    assert "Traceback" not in output, output[-3000:]
    assert "crashed" not in output
