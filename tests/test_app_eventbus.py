"""The whole mapper in standalone mode with a real mosquitto: EventBus twins, deltas, acks and telemetry."""

from __future__ import annotations

import asyncio
import json
import queue
import time
from pathlib import Path

import paho.mqtt.client as paho
import pytest

from mapper.edge.config import Settings
from mapper.edge.gpu.simnvml import SimNvml
from mapper.wire.telemetry import decode_batch
from tests.apphelpers import fast_settings, running_app, wait_for

DEVICE = """
apiVersion: devices.kubeedge.io/v1beta1
kind: Device
metadata: {{name: gpu0, namespace: default}}
spec:
  deviceModelRef: {{name: nvidia-gpu}}
  nodeName: edge-1
  protocol: {{protocolName: gpu, configData: {{uuid: {uuid}}}}}
  properties:
  - {{name: temperature, collectCycle: 100, reportCycle: 300, reportToCloud: true}}
  - {{name: power_usage, collectCycle: 100, reportCycle: 300, reportToCloud: true}}
  - {{name: power_limit, collectCycle: 100, reportCycle: 300, reportToCloud: true}}
  - {{name: product_name, collectCycle: 1000, reportCycle: 300, reportToCloud: true}}
"""


class Listener:
    """A plain paho subscriber standing in for EdgeCore and for a cloud consumer."""

    def __init__(self, port: int, *topics: str) -> None:
        self.messages: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self.seen: list[tuple[str, bytes]] = []
        client_id = f"listener-{time.monotonic_ns()}"
        self.client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=client_id)
        self.client.on_message = lambda c, u, m: self.messages.put((m.topic, m.payload))
        self._subacks: queue.Queue[int] = queue.Queue()
        self.client.on_subscribe = lambda c, u, mid, codes, props: self._subacks.put(mid)
        self.fence_topic = f"listener-fence/{client_id}"
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        # Every subscription acknowledged (SUBACK) before the constructor returns: a message published after it
        # reaches this listener.
        wanted = {self.client.subscribe(t, qos=1)[1] for t in (*topics, self.fence_topic)}
        deadline = time.monotonic() + 10
        while wanted:
            wanted.discard(self._subacks.get(timeout=max(0.01, deadline - time.monotonic())))

    def fence(self, timeout_s: float = 10.0) -> None:
        """Publish to this listener's own topic and wait until it comes back: what the broker delivered to this
        listener before it has been received (one broker thread, one connection, in order)."""
        token = str(time.monotonic_ns()).encode()
        self.client.publish(self.fence_topic, token, qos=1)
        deadline = time.monotonic() + timeout_s
        while True:
            topic, payload = self.messages.get(timeout=max(0.01, deadline - time.monotonic()))
            if topic == self.fence_topic and payload == token:
                return
            if topic != self.fence_topic:
                self.seen.append((topic, payload))

    def drain(self) -> list[tuple[str, bytes]]:
        while True:
            try:
                self.seen.append(self.messages.get_nowait())
            except queue.Empty:
                return self.seen

    def publish(self, topic: str, payload: bytes) -> None:
        self.client.publish(topic, payload, qos=1).wait_for_publish(5)

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def standalone(tmp_path: Path, mqtt_url: str) -> tuple[SimNvml, str, Path, Settings]:
    """One simulated H100 and its Device in a devices folder, and settings for standalone mode on the broker."""
    sim = SimNvml(1, "H100", seed=0, scenario="steady")
    uuid0 = sim.gpus[0].uuid
    devices = tmp_path / "devices"
    devices.mkdir()
    (devices / "gpu0.yaml").write_text(DEVICE.format(uuid=uuid0))
    return sim, uuid0, devices, fast_settings(str(tmp_path / "data"), devices_dir=str(devices), mqtt=_mqtt(mqtt_url))


def matching(listener: Listener, suffix: str) -> list[dict]:
    return [json.loads(p) for t, p in listener.drain() if t.endswith(suffix)]


@pytest.mark.timeout(60)
async def test_an_edge_application_sets_the_power_limit_through_an_eventbus_delta(
    mosquitto, tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    sim, uuid0, _, settings = standalone(tmp_path, mosquitto.url)
    listener = Listener(mosquitto.port, "$hw/events/device/default/gpu0/#", "gpu-mapper/#")
    try:
        async with running_app(settings, sim) as app:
            await wait_for(lambda: app.session is not None and app.session.subscribed, what="MQTT subscribed")

            # Actual values go out in KubeEdge's JSON, every value a string, types consistent ("string").
            updates = await wait_for(
                lambda: [u for u in matching(listener, "/twin/update") if "product_name" in u["twin"]],
                what="a periodic twin/update (every twin; a prompt one carries only the affected)",
            )
            doc = updates[-1]
            assert isinstance(doc["timestamp"], int) and doc["event_id"] == ""
            assert doc["twin"]["temperature"]["actual"]["value"].isdigit()
            assert doc["twin"]["product_name"]["actual"]["value"] == "NVIDIA_H100_80GB_HBM3"
            assert {t["metadata"]["type"] for t in doc["twin"].values()} == {"string"}
            states = await wait_for(lambda: matching(listener, "/state/update"), what="state/update")
            assert states[-1]["state"] == "online"

            # A malformed delta and a delta with a wrong type change nothing and crash nothing.
            delta_topic = "$hw/events/device/default/gpu0/twin/update/delta"
            listener.publish(delta_topic, b"{not json")
            listener.publish(delta_topic, json.dumps({"timestamp": 1, "delta": {"power_limit": 250}}).encode())
            listener.publish(
                delta_topic, json.dumps({"timestamp": int(time.time() * 1000), "delta": {"temperature": "1"}}).encode()
            )
            await wait_for(
                lambda: (
                    sum(
                        r.getMessage().startswith("EventBus delta") and r.levelname == "WARNING" for r in caplog.records
                    )
                    >= 3
                ),
                what="the three bad deltas refused",
            )
            assert sim.gpu(uuid0).power_limit_w == 700

            # A good delta: the GPU changes, the ack says applied, the twin reports it.
            now_ms = int(time.time() * 1000)
            listener.publish(
                delta_topic,
                json.dumps(
                    {"event_id": "d1", "timestamp": now_ms, "twin": {}, "delta": {"power_limit": "275"}}
                ).encode(),
            )
            await wait_for(lambda: sim.gpu(uuid0).power_limit_w == 275, what="275 W on the GPU")
            acks = await wait_for(
                lambda: [a for a in matching(listener, "/desired/ack") if a["result"] == "applied"], what="an ack"
            )
            assert acks[-1]["property"] == "power_limit" and acks[-1]["source"] == "edge"
            assert acks[-1]["reported_value"] == "275"
            await wait_for(
                lambda: any(
                    u["twin"].get("power_limit", {}).get("actual", {}).get("value") == "275"
                    for u in matching(listener, "/twin/update")
                ),
                what="power_limit 275 in twin/update",
            )

            # Telemetry batches arrive on the per-device topic and decode to the sampled values.
            batches = await wait_for(
                lambda: [p for t, p in listener.drain() if t == "gpu-mapper/edge-1/default/gpu0/telemetry"],
                what="a telemetry batch",
            )
            decoded = decode_batch(batches[0])
            assert decoded.device == "default/gpu0" and decoded.uuid == uuid0
            props = {name for sample in decoded.samples for name in sample.values}
            assert {"temperature", "power_usage"} <= props
    finally:
        listener.close()


def _mqtt(url: str):
    from mapper.shared.settings import MqttSettings

    return MqttSettings(url=url)


def devicetwin_accepts(twin_type: str, value: str) -> bool:
    """EdgeCore devicetwin's check of a value against the type the twin was created with."""
    if twin_type == "string":
        return True
    if twin_type in ("int", "integer"):
        return value.lstrip("-").isdigit()
    if twin_type == "float":
        try:
            float(value)
        except ValueError:
            return False
        return True
    if twin_type == "boolean":
        return value in ("true", "false")
    return False


@pytest.mark.timeout(60)
@pytest.mark.parametrize("eventbus", ["auto", "true"])
async def test_dmi_and_eventbus_twins_never_conflict_in_type(mosquitto, tmp_path: Path, eventbus: str):
    import tempfile

    from mapper.shared.settings import MqttSettings
    from tests.fake_edgecore import FakeEdgeCore, pb_device, pb_model

    sock_dir = tempfile.mkdtemp(prefix="dmi-", dir="/tmp")
    sim = SimNvml(1, "T4", seed=1, scenario="steady")
    uuid0 = sim.gpus[0].uuid
    edge = FakeEdgeCore(f"{sock_dir}/dmi.sock")
    props = {"temperature": None, "power_usage": None, "power_limit": "65"}
    edge.devices = [pb_device("gpu0", uuid0, properties=props, cycle_ms=200)]
    edge.models = [pb_model()]
    await edge.start()
    settings = fast_settings(
        str(tmp_path),
        edgecore_socket=edge.socket_path,
        socket=f"{sock_dir}/gpu.sock",
        mqtt=MqttSettings(url=mosquitto.url, eventbus=eventbus),
    )
    listener = Listener(mosquitto.port, "$hw/events/device/#")
    try:
        async with running_app(settings, sim):
            await wait_for(lambda: len(edge.rec.statuses) >= 2, what="two DMI reports")
            # Two more report cycles: had twins gone to the EventBus too, some would be out by now; the fence
            # makes sure what the broker had for the listener has arrived.
            reports = len(edge.rec.statuses)
            await wait_for(lambda: len(edge.rec.statuses) >= reports + 2, what="two more DMI reports")
            await asyncio.to_thread(listener.fence)
            mqtt_updates = matching(listener, "/twin/update")
            if eventbus == "auto":
                assert mqtt_updates == [], "with DMI active, twins go through DMI only"
                return
            assert mqtt_updates, "eventbus forced on publishes twin/update too"
            created: dict[str, str] = {}
            for update in mqtt_updates:
                for name, twin in update["twin"].items():
                    created.setdefault(name, twin["metadata"]["type"])
            for request in edge.rec.statuses:
                for twin in request.reportedDevice.twins:
                    twin_type = created.get(twin.propertyName, "string")
                    for value in (twin.observedDesired.value, twin.reported.value):
                        assert devicetwin_accepts(twin_type, value), (twin.propertyName, twin_type, value)
    finally:
        listener.close()
        await edge.stop()


@pytest.mark.timeout(90)
async def test_acks_and_policy_events_made_while_the_broker_is_down_arrive_when_it_is_back(
    mosquitto, tmp_path: Path
) -> None:
    sim, uuid0, devices, settings = standalone(tmp_path, mosquitto.url)
    async with running_app(settings, sim) as app:
        await wait_for(lambda: app.session is not None and app.session.subscribed, what="MQTT subscribed")
        mosquitto.stop()
        await wait_for(lambda: app.session is not None and not app.session.connected, what="MQTT disconnected")

        # Offline: the cloud's desired power limit (the Device file) is enforced and acked, and the health policy
        # reacts to a critical XID. Neither can be published now.
        desired = DEVICE.format(uuid=uuid0).replace(
            "  - {name: power_limit, collectCycle: 100, reportCycle: 300, reportToCloud: true}",
            '  - {name: power_limit, desired: {value: "300"}, collectCycle: 100, reportCycle: 300, '
            "reportToCloud: true}",
        )
        assert desired != DEVICE.format(uuid=uuid0)
        (devices / "gpu0.yaml").write_text(desired)
        await wait_for(lambda: sim.gpu(uuid0).power_limit_w == 300, timeout_s=15, what="300 W on the GPU offline")
        sim.inject_xid(uuid0, 48)
        assert app.shipper is not None
        await wait_for(lambda: app.shipper.submitted_messages >= 2, timeout_s=15, what="ack and event kept")

        listener_box: list[Listener] = []
        try:
            mosquitto.start()
            # Subscribe before the mapper reconnects would be racy; the kept messages are QoS 1 and replayed
            # after the reconnect, so subscribe at once and wait.
            listener_box.append(Listener(mosquitto.port, "gpu-mapper/#"))
            listener = listener_box[0]
            acks = await wait_for(
                lambda: [a for a in matching(listener, "/desired/ack") if a["result"] == "applied"],
                timeout_s=30,
                what="the offline ack after the broker came back",
            )
            assert acks[0]["property"] == "power_limit" and acks[0]["desired"] == "300"
            events = await wait_for(
                lambda: [e for e in matching(listener, "/events") if e["policy"] == "health"],
                timeout_s=30,
                what="the offline health event",
            )
            assert events[0]["device"] == "default/gpu0" and "xid48" in json.dumps(events[0])
            # Made before the broker came back: their timestamps say so.
            assert acks[0]["ts_ms"] <= events[0]["ts_ms"]
        finally:
            for listener in listener_box:
                listener.close()
