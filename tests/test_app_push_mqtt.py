"""``push.mqttFormat: text``: a property's ``pushMethod.mqtt`` as the framework's text messages, one per sample at
its report cycle, on a real mosquitto, kept through a broker outage and sent in order; the property's values stay
in the device's telemetry batches (what the bridge reads)."""

from __future__ import annotations

import asyncio
import calendar
import itertools
import os
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import paho.mqtt.client as paho
import pytest

from mapper.edge.gpu.nvml import NvmlBackend
from mapper.edge.gpu.simnvml import SimNvml
from mapper.shared.settings import MqttSettings
from mapper.wire.telemetry import decode_batch
from tests.apphelpers import fast_settings, running_app, wait_for
from tests.brokers import Mosquitto

DEVICE = """
apiVersion: devices.kubeedge.io/v1beta1
kind: Device
metadata: {{name: gpu0, namespace: default}}
spec:
  deviceModelRef: {{name: nvidia-gpu}}
  protocol: {{protocolName: gpu, configData: {{uuid: {uuid}}}}}
  properties:
  - name: temperature
    collectCycle: 100
    reportCycle: 1000
    pushMethod: {{mqtt: {{topic: gpu/temp, qos: 1}}}}
  - {{name: power_usage, collectCycle: 100, reportCycle: 1000}}
"""


class KeepingMosquitto(Mosquitto):
    """A mosquitto that keeps its sessions (and the QoS 1 messages queued for them) across a stop and start."""

    def config_text(self) -> str:
        # (As root, mosquitto would drop to its own user, which cannot write the test's directory.)
        user = "user root\n" if os.geteuid() == 0 else ""
        keep = f"persistence true\npersistence_location {self.workdir}/\n{user}"
        return super().config_text().replace("persistence false\n", keep)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: it saves its sessions first
            self.proc.wait(timeout=10)
        self.proc = None


class Listener:
    """A consumer with a persistent session (QoS 1): what the broker took while it was away reaches it later."""

    def __init__(self, port: int, *topics: str) -> None:
        self.messages: list[tuple[str, bytes]] = []
        self.client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="push-listener", clean_session=False)
        self.client.on_message = lambda c, u, m: self.messages.append((m.topic, m.payload))
        subscribed: list[int] = []
        self.client.on_subscribe = lambda c, u, mid, codes, props: subscribed.append(mid)
        self.client.reconnect_delay_set(0.1, 0.5)
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        mids = {self.client.subscribe(t, qos=1)[1] for t in topics}
        deadline = time.monotonic() + 10
        while not mids <= set(subscribed):
            assert time.monotonic() < deadline, "no SUBACK"
            time.sleep(0.01)

    def drain(self) -> list[tuple[str, bytes]]:
        return list(self.messages)

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[KeepingMosquitto]:
    server = KeepingMosquitto(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def utc() -> Iterator[None]:
    before = os.environ.get("TZ")
    os.environ["TZ"] = "UTC"
    time.tzset()
    yield
    if before is None:
        os.environ.pop("TZ", None)
    else:
        os.environ["TZ"] = before
    time.tzset()


def text_times(listener: Listener) -> list[int]:
    """The time of each text message on gpu/temp (Unix ms, whole seconds), in arrival order."""
    out = []
    for topic, payload in listener.drain():
        if topic != "gpu/temp":
            continue
        text = payload.decode()
        assert text.startswith("time is ") and "  gpu/temp: " in text, text
        stamp, value = text.removeprefix("time is ").split("  gpu/temp: ")
        assert value.isdigit(), text
        out.append(calendar.timegm(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) * 1000)
    return out


@pytest.mark.timeout(120)
async def test_mqtt_text_messages_of_the_framework_go_out_per_sample_and_survive_a_broker_outage(
    tmp_path: Path, broker: KeepingMosquitto, utc: None
) -> None:
    mosquitto = broker
    sim = SimNvml(1, "H100", seed=0)
    backend = NvmlBackend(SimNvml(1, "H100", seed=0))
    backend.init()
    uuid = backend.list_gpus()[0].uuid
    backend.shutdown()
    devices = tmp_path / "devices"
    devices.mkdir()
    (devices / "gpu0.yaml").write_text(DEVICE.format(uuid=uuid))
    settings = replace(
        fast_settings(str(tmp_path / "data"), mqtt=MqttSettings(url=mosquitto.url)),
        devices_dir=str(devices),
        push_mqtt_format="text",
        push_retry_max_s=1.0,
    )
    listener = Listener(mosquitto.port, "gpu/temp", "gpu-mapper/edge-1/default/gpu0/telemetry")
    try:
        async with running_app(settings, sim) as app:
            await wait_for(lambda: len([t for t, _ in listener.drain() if t == "gpu/temp"]) >= 2, what="text messages")
            await wait_for(lambda: any(t.endswith("/telemetry") for t, _ in listener.drain()), what="a telemetry batch")
            batches = [decode_batch(p) for t, p in listener.drain() if t.endswith("/telemetry")]
            names = {name for b in batches for s in b.samples for name in s.values}
            assert {"temperature", "power_usage"} <= names, "the property stays in the device's batches"

            mosquitto.stop()
            down_ms = time.time() * 1000
            await asyncio.sleep(4)
            mosquitto.start()
            up_ms = time.time() * 1000
            await wait_for(
                lambda: bool(text_times(listener)) and text_times(listener)[-1] > up_ms + 1000,
                timeout_s=30,
                what="the kept messages and new ones",
            )
            times = text_times(listener)
            assert times == sorted(times), times
            outage = [t for t in times if down_ms - 1000 <= t <= up_ms - 1000]
            assert len(outage) >= 3, f"the messages sampled while the broker was away came: {times}"
            gaps = [b - a for a, b in itertools.pairwise(times)]
            assert max(gaps) <= 2000, gaps
            status = app.snapshot().push_destinations
            assert [(d.kind, d.state) for d in status] == [("mqtt", "ok")]
    finally:
        listener.close()
