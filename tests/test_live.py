"""The live topic with a real mosquitto: each sample as compact JSON on ``gpu-mapper/{node}/{ns}/{name}/live``
right after its NVML read, QoS 0, not retained, one message per sample (bounded by the collect cycles), never
buffered while the broker is down; off unless ``telemetry.live`` is on."""

from __future__ import annotations

import json
import queue
import time
from pathlib import Path

import paho.mqtt.client as paho
import pytest
import yaml

from mapper.edge.config import Settings, load_settings
from mapper.edge.gpu.simnvml import SimNvml
from mapper.shared.model import GpuInfo, Sample
from mapper.shared.settings import MqttSettings
from mapper.tools.discover import device_doc
from mapper.wire.payloads import live_payload
from tests.apphelpers import fast_settings, running_app, wait_for


class LiveListener:
    def __init__(self, port: int) -> None:
        self.messages: queue.Queue[tuple[str, bytes, int, bool, float]] = queue.Queue()
        self.seen: list[tuple[str, bytes, int, bool, float]] = []
        self.client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=f"live-{time.monotonic_ns()}")
        self.client.on_message = lambda c, u, m: self.messages.put(
            (m.topic, m.payload, m.qos, bool(m.retain), time.time())
        )
        self.client.reconnect_delay_set(0.05, 0.2)
        self.client.connect("127.0.0.1", port)
        self.client.on_connect = lambda c, u, f, rc, p=None: c.subscribe("gpu-mapper/#", qos=1)
        self.client.subscribe("gpu-mapper/#", qos=1)
        self.client.loop_start()

    def drain(self) -> list[tuple[str, bytes, int, bool, float]]:
        while True:
            try:
                self.seen.append(self.messages.get_nowait())
            except queue.Empty:
                return self.seen

    def live(self) -> list[tuple[str, dict, int, bool, float]]:
        return [(t, json.loads(p), q, r, at) for t, p, q, r, at in self.drain() if t.endswith("/live")]

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def devices_folder(tmp_path: Path, sim: SimNvml) -> Path:
    folder = tmp_path / "devices"
    folder.mkdir()
    docs = []
    for i, gpu in enumerate(sim.gpus):
        info = GpuInfo(uuid=gpu.uuid, index=i, name="NVIDIA H100", pci_bus_id="")
        docs.append(device_doc(info, "edge-1"))  # catalog collect cycles (1 s for load, power, temperature)
    (folder / "gpus.yaml").write_text(yaml.safe_dump_all(docs))
    return folder


def test_live_is_off_by_default_and_turned_on_by_its_config_key(tmp_path: Path) -> None:
    assert Settings().telemetry_live is False
    cfg = tmp_path / "c.yaml"
    cfg.write_text("telemetry:\n  live: true\n")
    assert load_settings(str(cfg), env={}, flags={"node_name": "n"}).telemetry_live is True
    assert load_settings(None, env={"GPU_MAPPER_TELEMETRY_LIVE": "on"}, flags={"node_name": "n"}).telemetry_live


def test_the_live_payload_is_compact_json_in_catalog_units() -> None:
    payload = live_payload(Sample("GPU-1", 1_780_000_000_123, {"temperature": 61, "power_usage": 312.5}))
    assert json.dumps(json.loads(payload), separators=(",", ":")).encode() == payload
    assert json.loads(payload) == {
        "ts_ms": 1_780_000_000_123,
        "uuid": "GPU-1",
        "values": {"temperature": 61, "power_usage": 312.5},
    }


@pytest.mark.timeout(90)
async def test_each_sample_goes_out_live_at_qos_0_not_retained_and_nothing_is_kept_while_the_broker_is_down(
    mosquitto, tmp_path: Path
) -> None:
    sim = SimNvml(2, "H100", seed=0, scenario="steady")
    folder = devices_folder(tmp_path, sim)
    settings = fast_settings(
        str(tmp_path / "data"), devices_dir=str(folder), mqtt=MqttSettings(url=mosquitto.url), telemetry_live=True
    )
    listener = LiveListener(mosquitto.port)
    try:
        async with running_app(settings, sim) as app:
            await wait_for(lambda: len(listener.live()) >= 6, timeout_s=20, what="live samples")
            start_s = time.time()
            first = len(listener.live())
            await wait_for(lambda: time.time() > start_s + 4.0 and listener.live(), timeout_s=10, what="4 s more")
            window = listener.live()[first:]
            per_device: dict[str, list[dict]] = {}
            for topic, doc, qos, retained, _ in window:
                assert topic.startswith("gpu-mapper/edge-1/default/edge-1-gpu") and topic.endswith("/live")
                assert qos == 0 and not retained, "QoS 0, not retained"
                per_device.setdefault(topic, []).append(doc)
            assert len(per_device) == 2
            elapsed_s = time.time() - start_s
            for topic, docs in per_device.items():
                # One message per sample, bounded by the collect cycles (the fastest is 1 s here).
                assert len(docs) <= elapsed_s / 1.0 + 2, (topic, len(docs), elapsed_s)
                assert len(docs) >= 2
                assert all(isinstance(d["values"]["temperature"], int) for d in docs)
                assert len({d["ts_ms"] for d in docs}) == len(docs), "each message a sample of its own"
                uuid = docs[0]["uuid"]
                assert uuid in {g.uuid for g in sim.gpus} and all(d["uuid"] == uuid for d in docs)
            raw = next(p for t, p, *_ in listener.seen if t.endswith("/live"))
            assert json.dumps(json.loads(raw), separators=(",", ":")).encode() == raw, "compact JSON"

            # The broker goes away: live samples are dropped, not kept; nothing old arrives when it is back.
            kept_before = app.shipper.submitted_messages if app.shipper else 0
            mosquitto.stop()
            await wait_for(lambda: app.session is not None and not app.session.connected, what="disconnected")
            down_s = time.time()
            await wait_for(
                lambda: min(w.values_ts_ms for w in app.workers.values()) > down_s * 1000 + 2000,
                timeout_s=10,
                what="two seconds of samples while the broker is down",
            )
            assert app.shipper is not None and app.shipper.submitted_messages == kept_before
            listener.drain()
            count = len(listener.seen)
            mosquitto.start()
            await wait_for(lambda: app.session is not None and app.session.connected, timeout_s=20, what="back")
            back_ms = time.time() * 1000
            await wait_for(
                lambda: len(listener.live()) > 0 and len(listener.seen) > count, timeout_s=20, what="live again"
            )
            await wait_for(
                lambda: any(t.endswith("/live") for t, *_ in listener.drain()[count:]), timeout_s=20, what="a live one"
            )
            after = [json.loads(p) for t, p, *_ in listener.seen[count:] if t.endswith("/live")]
            assert after and all(d["ts_ms"] >= back_ms - 1500 for d in after), "no sample from the outage"
    finally:
        listener.close()


@pytest.mark.timeout(60)
async def test_without_the_key_nothing_is_published_live(mosquitto, tmp_path: Path) -> None:
    sim = SimNvml(1, "H100", seed=0, scenario="steady")
    folder = devices_folder(tmp_path, sim)
    settings = fast_settings(
        str(tmp_path / "data"), devices_dir=str(folder), mqtt=MqttSettings(url=mosquitto.url), telemetry_window_s=0.5
    )
    listener = LiveListener(mosquitto.port)
    try:
        async with running_app(settings, sim):
            await wait_for(
                lambda: len([t for t, *_ in listener.drain() if t.endswith("/telemetry")]) >= 3,
                timeout_s=20,
                what="three telemetry batches (several samples each)",
            )
            assert listener.live() == []
    finally:
        listener.close()
