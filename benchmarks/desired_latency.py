"""Desired-state latency: from a desired power limit arriving to the value read back as applied and its ack
published, through an EventBus delta (real mosquitto) and a DMI UpdateDevice (real Unix socket); and the time
to re-apply every power limit after a simulated driver reload.

The mapper runs in THIS process (a whole ``MapperApp`` over ``SimNvml``: 8 simulated H100s, 8 Devices with a
1000 ms collect cycle for every property, each with a desired power limit of 450 W, INFO logging to a file, the
SQLite buffer and desired store, metrics server). The party that sends the changes and listens for the acks is
a SEPARATE process (this script with ``--client``), as EdgeCore, an edge application and an ack consumer are:

* ``eventbus``: the client publishes ``$hw/events/device/default/<node>-gpu0/twin/update/delta`` (QoS 1, a new
  timestamp each time) and waits for the ack with result ``applied`` for that value and version on
  ``gpu-mapper/<node>/default/<node>-gpu0/desired/ack``. The mapper runs in standalone mode (devices folder).
  Changes this fast are over gpu0's inbound rate (``mqtt.inboundRatePerSecond`` 2/s, burst 20) once the burst is
  spent: such a change waits at the door for the device's next token and is acked ``pending``/``deferred`` first;
  those are reported apart (``eventbus_deferred``: their latency is mostly the wait, and none may be lost),
  ``eventbus`` being the changes applied at once.
* ``dmi``: the mapper runs in DMI mode against the test EdgeCore (tests/fake_edgecore.py) with MQTT configured
  for the acks; the client calls ``DeviceMapperService.UpdateDevice`` on the mapper's socket over one channel
  (``dmi``), and over a new channel per call as EdgeCore dials them (``dmi_new_channel``, which includes the
  connection set-up), and waits for the ``applied`` ack.

Each change alternates the power limit among 350/400/500/550 W (every one a real change), followed by a random
pause of 50-150 ms so the changes land at every phase of the 1 s collect cycle. Latency = ack received at the
client - change sent by the client (perf_counter in the client), so it includes both loopback hops.

Twin round trips (``eventbus_twin``, ``dmi_twin``): the same changes, 4-6 s apart (so each is measured on its
own: a Device's prompt DMI reports are coalesced over a second, and the DMI budget left over by the periodic
reports refills between changes), with every Device's report cycle at discover's 20 s and state cycle at 60 s.
EventBus: change sent -> the first ``twin/update`` of gpu0 carrying the new ``power_limit`` at the client.
DMI: UpdateDevice sent (a new channel per call, as EdgeCore dials) -> the first ``ReportDeviceStatus`` of gpu0
with the new value as both ``observedDesired`` and ``reported`` accepted by the test EdgeCore in this process
(client perf_counter and EdgeCore time.monotonic: one CLOCK_MONOTONIC). The DMI series starts once the ack
series' prompt reports (one a second while gpu0 changed every ~0.1 s) are paid back: the budget at 9 tokens.
Target: p99 < 2 s; the ack latency of the same path is the baseline.

Right after start-up (``dmi_startup``): a fresh mapper (DMI, 8 Devices, discover's cycles) registers; as soon as
every GPU has its desired 450 W (start-up's first twins and states are still being reported: 16 RPCs against a
burst of 10), the client changes all 8 Devices at once (8 UpdateDevice calls, a new channel each); per Device:
its call sent -> the first ``ReportDeviceStatus`` with the new value seen by the test EdgeCore. Baseline in the
same run, ``dmi_startup_reserve0``: the same with the DMI reporter's reserve for prompt reports set to 0, so
start-up's reports may spend the whole budget first (the reserve off; prompt reports still go first). Target:
< 1 s.

Live (``telemetry.live`` on, standalone, 8 GPUs at 1 s): every live message for ``--live-s`` seconds at a
subscriber in the client process, latency from the sample's ``ts_ms`` (end of its NVML read; wall clock, 1 ms
resolution) and from the collector's hand-off to the publisher (perf_counter); baseline: the broker hop alone
(the client publishing QoS 0 messages of the same size to itself).

Re-apply: ``SimNvml.driver_reload()`` wipes every setting; the main process polls the simulated GPUs every
2 ms until all 8 power limits read 450 W again (the desired value), in seconds and in collect cycles.

Baseline, same process, before the mapper starts: ``NvmlBackend.set_power_limit`` over the simulator alone
(the NVML call and its read-back through the backend's worker thread): what the mapper adds on top.

Run: ``.venv/bin/python benchmarks/desired_latency.py [--quick] [--changes N] [--twin-changes N] [--live-s S]
[--reloads N] [--startup-rounds N] [--smoke]``. ``--smoke`` (the benchmark smoke test): three changes a path,
one twin change (1 s apart), one reload, one start-up (without the reserve0 baseline), 1 s of live samples.
Prints one JSON line last. Target: p99 < 20 ms on loopback, re-apply within one collect cycle.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

NODE = "edge-1"
NAMESPACE = "default"
GPUS = 8
PROFILE = "H100"
#: The simulated NVML's cost profile: what each call costs on an H200 (``mapper.edge.gpu.profiles``).
SIM_COST = "h200"
DESIRED_W = 450
VALUES_W = (350, 400, 500, 550)
COLLECT_CYCLE_MS = 1000
WARMUP_CHANGES = 10
#: Pause between changes: desired changes are rare events, not a stream (back-to-back changes within TCP's
#: 40 ms delayed-ACK window would add the broker's Nagle stall on top, which isolated changes never see).
PAUSE_MIN_S, PAUSE_MAX_S = 0.05, 0.15
#: Pause between changes of the twin round trips: more than the one second a Device's prompt DMI reports are
#: coalesced over (changes within a second share one report), and slow enough that the DMI budget left over by
#: the 8 Devices' periodic reports (0.8/s minus about 0.53/s) keeps up: changes faster than one every ~4 s on
#: average drain it, and the twins then wait for tokens (what the rate limit is for).
TWIN_PAUSE_MIN_S, TWIN_PAUSE_MAX_S = 4.0, 6.0
#: Warm-up changes before a twin series (the ack series warmed the path already).
TWIN_WARMUP_CHANGES = 2
#: Report cycles of every Device: discover's defaults (twins 20 s, state 60 s), so a twin that shows sooner was
#: reported promptly, and the DMI budget is spent as on a node whose Devices discover wrote.
REPORT_CYCLE_MS = 20_000
STATE_REPORT_CYCLE_MS = 60_000


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    if not values:
        raise ValueError("percentile of an empty list")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def summary_ms(latencies_s: list[float]) -> dict[str, float]:
    ms = [x * 1000 for x in latencies_s]
    return {
        "p50_ms": round(percentile(ms, 50), 3),
        "p90_ms": round(percentile(ms, 90), 3),
        "p99_ms": round(percentile(ms, 99), 3),
        "max_ms": round(max(ms), 3),
        "mean_ms": round(statistics.fmean(ms), 3),
    }


def device_name(index: int) -> str:
    from mapper.tools.discover import device_name as name

    return name(NODE, index)


def ack_topic(index: int = 0) -> str:
    return f"gpu-mapper/{NODE}/{NAMESPACE}/{device_name(index)}/desired/ack"


# ---------------------------------------------------------------------------------------------------------------
# The client process: sends the changes, waits for the acks
# ---------------------------------------------------------------------------------------------------------------


def nodelay(client: Any) -> None:
    """TCP_NODELAY on a connected paho client's socket, as Go's net package sets by default (EdgeCore, Go apps)."""
    import socket

    sock = client.socket()
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class AckWaiter:
    """A paho subscriber on the ack topic; ``expect`` a value (and version), ``wait`` for its applied ack;
    ``deferred``: whether its ``pending``/``deferred`` ack came first (the change waited for the device's inbound
    rate)."""

    def __init__(self, port: int, topic: str) -> None:
        import paho.mqtt.client as paho

        self._cond = threading.Condition()
        self._expected: tuple[float, int | None] | None = None
        self._hit_at: float | None = None
        self._deferred = False
        self._subscribed = threading.Event()
        self.client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=f"latency-client-{os.getpid()}")
        self.client.on_message = self._on_message
        self.client.on_subscribe = lambda *a: self._subscribed.set()
        self.client.connect("127.0.0.1", port)
        nodelay(self.client)
        self.client.subscribe(topic, qos=1)
        self.client.loop_start()
        if not self._subscribed.wait(10):
            raise RuntimeError(f"no SUBACK for {topic} within 10 s")

    def _on_message(self, client: Any, userdata: Any, message: Any) -> None:
        now = time.perf_counter()
        try:
            doc = json.loads(message.payload)
        except ValueError:
            return
        deferred = doc.get("result") == "pending" and doc.get("reason") == "deferred"
        if doc.get("property") != "power_limit" or (doc.get("result") != "applied" and not deferred):
            return
        with self._cond:
            if self._expected is None or self._hit_at is not None:
                return
            value, version = self._expected
            try:
                desired = float(doc.get("desired"))
            except (TypeError, ValueError):
                return
            if desired != value or (version is not None and doc.get("version_ms") != version):
                return
            if deferred:
                self._deferred = True
                return
            self._hit_at = now
            self._cond.notify_all()

    def expect(self, value: float, version: int | None) -> None:
        with self._cond:
            self._expected = (value, version)
            self._hit_at = None
            self._deferred = False

    def wait(self, timeout_s: float) -> float | None:
        with self._cond:
            self._cond.wait_for(lambda: self._hit_at is not None, timeout=timeout_s)
            return self._hit_at

    @property
    def deferred(self) -> bool:
        with self._cond:
            return self._deferred

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


class TwinWaiter:
    """A paho subscriber on gpu0's ``twin/update`` (standing in for EdgeCore); ``expect`` a power limit,
    ``wait`` for the first twin update that reports it."""

    def __init__(self, port: int) -> None:
        import paho.mqtt.client as paho

        self._cond = threading.Condition()
        self._expected: float | None = None
        self._hit_at: float | None = None
        self._subscribed = threading.Event()
        self.client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=f"twin-client-{os.getpid()}")
        self.client.on_message = self._on_message
        self.client.on_subscribe = lambda *a: self._subscribed.set()
        self.client.connect("127.0.0.1", port)
        nodelay(self.client)
        self.client.subscribe(f"$hw/events/device/{NAMESPACE}/{device_name(0)}/twin/update", qos=1)
        self.client.loop_start()
        if not self._subscribed.wait(10):
            raise RuntimeError("no SUBACK for twin/update within 10 s")

    def _on_message(self, client: Any, userdata: Any, message: Any) -> None:
        now = time.perf_counter()
        try:
            value = json.loads(message.payload)["twin"]["power_limit"]["actual"]["value"]
            watts = float(value)
        except (ValueError, KeyError, TypeError):
            return
        with self._cond:
            if self._expected is not None and self._hit_at is None and watts == self._expected:
                self._hit_at = now
                self._cond.notify_all()

    def expect(self, value: float, version: int | None) -> None:
        with self._cond:
            self._expected = float(value)
            self._hit_at = None

    def wait(self, timeout_s: float) -> float | None:
        with self._cond:
            self._cond.wait_for(lambda: self._hit_at is not None, timeout=timeout_s)
            return self._hit_at

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def live_client(spec: dict[str, Any]) -> dict[str, Any]:
    """Every live message of the 8 Devices for ``live_s`` seconds: [uuid, ts_ms, received (perf_counter), received
    (wall ms)]; then the baseline: the same broker hop alone (this client publishing QoS 0 messages of the same
    size to itself)."""
    import paho.mqtt.client as paho

    got: list[list[Any]] = []
    recording = threading.Event()
    hops: list[float] = []
    sent: dict[str, float] = {}
    sizes: list[int] = []
    subscribed = threading.Event()

    def on_message(client: Any, userdata: Any, message: Any) -> None:
        now = time.perf_counter()
        if message.topic.startswith("bench/hop/"):
            t0 = sent.pop(message.topic, None)
            if t0 is not None:
                hops.append(now - t0)
            return
        if not recording.is_set():
            return
        wall_ms = time.time() * 1000
        doc = json.loads(message.payload)
        got.append([doc["uuid"], doc["ts_ms"], now, wall_ms])
        sizes.append(len(message.payload))

    client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=f"live-client-{os.getpid()}")
    client.on_message = on_message
    client.on_subscribe = lambda *a: subscribed.set()
    client.connect("127.0.0.1", spec["port"])
    nodelay(client)
    client.subscribe([(f"gpu-mapper/{NODE}/{NAMESPACE}/+/live", 0), ("bench/hop/#", 0)])
    client.loop_start()
    try:
        if not subscribed.wait(10):
            raise RuntimeError("no SUBACK for the live topics within 10 s")
        recording.set()
        time.sleep(spec["live_s"])  # the measurement window itself (the messages come on paho's thread)
        recording.clear()
        size = round(statistics.median(sizes)) if sizes else 300
        rng = random.Random(spec["seed"])
        for i in range(spec.get("hops", 300)):
            topic = f"bench/hop/{i}"
            sent[topic] = time.perf_counter()
            client.publish(topic, b"x" * size, qos=0)
            time.sleep(rng.uniform(0.005, 0.02))
        time.sleep(0.5)
    finally:
        client.loop_stop()
        client.disconnect()
    return {"live": got, "live_baseline": hops, "live_bytes": sizes}


def client_main(spec: dict[str, Any]) -> None:
    """Runs in the client process; prints one JSON document: {variant: [latency_s or null, ...]} (for
    ``dmi_twin``: [[value, sent (perf_counter)], ...], the twins being seen by the test EdgeCore in the other
    process; for ``live``: see ``live_client``)."""
    if spec["variants"] == ["live"]:
        print(json.dumps(live_client(spec)))
        return
    if spec["variants"] == ["dmi_all"]:
        print(json.dumps({"dmi_all": dmi_all_client(spec)}))
        return
    rng = random.Random(spec["seed"])
    waiter = AckWaiter(spec["port"], ack_topic())
    twin_waiter = TwinWaiter(spec["port"]) if "eventbus_twin" in spec["variants"] else None
    results: dict[str, list[Any]] = {}
    try:
        for variant in spec["variants"]:
            send = _sender(variant, spec)
            twin = variant.endswith("_twin")
            wait_on: Any = twin_waiter if variant == "eventbus_twin" else waiter
            latencies: list[Any] = []
            deferred: list[bool] = []
            version = 0
            changes = spec["twin_changes"] if twin else spec["changes"]
            warmup = spec.get("twin_warmup", TWIN_WARMUP_CHANGES) if twin else spec.get("warmup", WARMUP_CHANGES)
            twin_pause = spec.get("twin_pause_s", (TWIN_PAUSE_MIN_S, TWIN_PAUSE_MAX_S))
            try:
                for i in range(changes + warmup):
                    value = VALUES_W[i % len(VALUES_W)]
                    version = max(int(time.time() * 1000), version + 1)  # the send time, strictly newer
                    wait_on.expect(value, version if variant == "eventbus" else None)
                    t0 = time.perf_counter()
                    send(value, version)
                    hit = wait_on.wait(5.0)
                    if i >= warmup:
                        if variant == "dmi_twin":
                            latencies.append([value, t0])
                        else:
                            latencies.append(None if hit is None else hit - t0)
                            deferred.append(bool(getattr(wait_on, "deferred", False)))
                    if twin:
                        time.sleep(rng.uniform(*twin_pause))
                    else:
                        time.sleep(rng.uniform(PAUSE_MIN_S, PAUSE_MAX_S))
            finally:
                close = getattr(send, "close", None)
                if close is not None:
                    close()
            results[variant] = latencies
            if variant == "eventbus":
                results["eventbus_deferred_flags"] = deferred
    finally:
        waiter.close()
        if twin_waiter is not None:
            twin_waiter.close()
    print(json.dumps(results))


class _EventBusSender:
    def __init__(self, port: int) -> None:
        import paho.mqtt.client as paho

        self.client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=f"latency-app-{os.getpid()}")
        self.client.connect("127.0.0.1", port)
        nodelay(self.client)
        self.client.loop_start()
        self.topic = f"$hw/events/device/{NAMESPACE}/{device_name(0)}/twin/update/delta"

    def __call__(self, value: float, version: int) -> None:
        doc = {"event_id": f"bench-{version}", "timestamp": version, "twin": {}, "delta": {"power_limit": str(value)}}
        self.client.publish(self.topic, json.dumps(doc).encode(), qos=1)

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


class _DmiSender:
    def __init__(self, socket_path: str, uuid: str, *, new_channel: bool) -> None:
        import grpc

        from mapper.edge.kubeedge.dmi.pb import dmi_pb2_grpc as pb_grpc

        self._grpc = grpc
        self._pb_grpc = pb_grpc
        self.target = f"unix://{socket_path}"
        self.uuid = uuid
        self.new_channel = new_channel
        self.channel = None if new_channel else grpc.insecure_channel(self.target)
        self.stub = None if self.channel is None else pb_grpc.DeviceMapperServiceStub(self.channel)

    def __call__(self, value: float, version: int) -> None:
        from mapper.edge.kubeedge.dmi.pb import dmi_pb2 as pb

        request = pb.UpdateDeviceRequest(device=dmi_device(0, self.uuid, str(value)))
        if self.new_channel:
            with self._grpc.insecure_channel(self.target) as channel:
                self._pb_grpc.DeviceMapperServiceStub(channel).UpdateDevice(request, timeout=10)
        else:
            assert self.stub is not None
            self.stub.UpdateDevice(request, timeout=10)

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()


def dmi_all_client(spec: dict[str, Any]) -> list[list[float]]:
    """Every Device changed to ``spec["value"]`` at once: one UpdateDevice each over a new channel (as EdgeCore
    dials), back to back; [[index, value, sent (perf_counter)], ...]."""
    import grpc

    from mapper.edge.kubeedge.dmi.pb import dmi_pb2 as pb
    from mapper.edge.kubeedge.dmi.pb import dmi_pb2_grpc as pb_grpc

    requests = [
        pb.UpdateDeviceRequest(device=dmi_device(index, uuid, str(spec["value"])))
        for index, uuid in enumerate(spec["uuids"])
    ]
    sent: list[list[float]] = []
    for index, request in enumerate(requests):
        t0 = time.perf_counter()
        with grpc.insecure_channel(f"unix://{spec['socket']}") as channel:
            pb_grpc.DeviceMapperServiceStub(channel).UpdateDevice(request, timeout=10)
        sent.append([index, spec["value"], t0])
    return sent


def _sender(variant: str, spec: dict[str, Any]) -> Any:
    if variant in ("eventbus", "eventbus_twin"):
        return _EventBusSender(spec["port"])
    if variant in ("dmi", "dmi_new_channel", "dmi_twin"):
        # EdgeCore dials a new connection for every call: the twin round trip includes it.
        return _DmiSender(spec["socket"], spec["uuid"], new_channel=variant != "dmi")
    raise ValueError(f"unknown client variant {variant!r}")


def run_client(spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, __file__, "--client", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"client process failed ({proc.returncode}): {proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


# ---------------------------------------------------------------------------------------------------------------
# Devices: the same 8 Devices for the folder (standalone) and for the test EdgeCore (DMI)
# ---------------------------------------------------------------------------------------------------------------


def dmi_device(index: int, uuid: str, power_limit: str) -> Any:
    from mapper.shared.model import NVML_PROPERTIES
    from tests.fake_edgecore import pb_device

    props: dict[str, str | None] = {p.name: None for p in NVML_PROPERTIES}
    props["power_limit"] = power_limit
    device = pb_device(device_name(index), uuid, properties=props, cycle_ms=COLLECT_CYCLE_MS)
    for prop in device.spec.properties:
        prop.reportCycle = REPORT_CYCLE_MS  # discover's default: a twin seen sooner was reported promptly
    device.status.reportCycle = STATE_REPORT_CYCLE_MS
    return device


def dmi_model() -> Any:
    from mapper.shared.model import NVML_PROPERTIES
    from tests.fake_edgecore import pb_model

    return pb_model(props={p.name: p.ptype for p in NVML_PROPERTIES})


def write_devices_folder(folder: Path, uuids_by_index: list[tuple[int, str]]) -> None:
    """8 Devices from ``mapper.tools.discover.device_yaml`` with every collect cycle at 1000 ms, and the model."""
    import yaml

    from mapper.shared.model import GpuInfo
    from mapper.tools.discover import device_yaml, model_yaml

    gpus = [GpuInfo(uuid=u, index=i, name="NVIDIA H100", pci_bus_id="") for i, u in uuids_by_index]
    text = device_yaml(gpus, NODE, desired={u: {"power_limit": str(DESIRED_W)} for _, u in uuids_by_index})
    docs = [d for d in yaml.safe_load_all(text) if d]
    for doc in docs:
        for prop in doc["spec"]["properties"]:
            prop["collectCycle"] = COLLECT_CYCLE_MS
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "devices.yaml").write_text(yaml.safe_dump_all(docs, sort_keys=False))
    (folder / "model.yaml").write_text(model_yaml())


# ---------------------------------------------------------------------------------------------------------------
# The main process: baseline, the mapper, reloads
# ---------------------------------------------------------------------------------------------------------------


def baseline_set_power_limit(calls: int) -> dict[str, float]:
    """``NvmlBackend.set_power_limit`` over the simulator alone (set, read back, through the worker thread)."""
    from mapper.edge.gpu.nvml import NvmlBackend
    from mapper.edge.gpu.simnvml import SimNvml

    sim = SimNvml(1, PROFILE, seed=0, scenario="inference", cost=SIM_COST)
    backend = NvmlBackend(sim)
    backend.init()
    uuid = backend.list_gpus()[0].uuid
    times: list[float] = []
    for i in range(calls + 50):
        t0 = time.perf_counter()
        backend.set_power_limit(uuid, VALUES_W[i % len(VALUES_W)])
        if i >= 50:
            times.append(time.perf_counter() - t0)
    backend.shutdown()
    return summary_ms(times)


def configure_logging(path: Path) -> None:
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)


def new_sim() -> Any:
    from mapper.edge.gpu.simnvml import SimNvml

    return SimNvml(GPUS, PROFILE, seed=0, scenario="inference", cost=SIM_COST)


def base_settings(data_dir: Path, **overrides: Any) -> Any:
    from dataclasses import replace

    from mapper.edge.config import Settings

    settings = Settings(
        node_name=NODE,
        data_dir=str(data_dir),
        metrics_addr="127.0.0.1:0",
        collect_cycle_ms=COLLECT_CYCLE_MS,
        sim=GPUS,
        sim_profile=PROFILE,
    )
    return replace(settings, **overrides)


async def wait_until(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.01)


def mapper_nodelay(app: Any) -> None:
    """DIAGNOSTIC (--mapper-nodelay): TCP_NODELAY on the mapper's MQTT socket, reaching into MqttSession's paho
    client, to show what setting it in mapper/net/mqtt.py would gain. Not what the mapper does today."""
    nodelay(app.session._client)


def all_at(sim: Any, watts: float) -> bool:
    return all(abs(g.power_limit_w - watts) < 0.01 for g in sim.gpus)


async def measure_reloads(app: Any, sim: Any, reloads: int, rng: random.Random) -> dict[str, Any]:
    """Driver reloads at random phases of the collect cycle; seconds until every GPU reads 450 W again, and
    in collect ticks: the most ticks a GPU loop started between the reload and that GPU's re-apply (1 = the
    first tick after the reload re-applied it; a tick that starts after its GPU is back is not counted)."""
    gpu0 = sim.gpus[0].uuid
    times: list[float] = []
    ticks: list[int] = []
    drift_before = sum(sum(w.reconciler.counters.drift_reapplies.values()) for w in app.workers.values())
    for _ in range(reloads):
        await asyncio.sleep(rng.uniform(0.5, 1.5))
        await wait_until(lambda: all_at(sim, DESIRED_W), 10.0, "every GPU at 450 W before a reload")
        t0 = time.perf_counter()
        reload_mono = time.monotonic()
        sim.driver_reload()
        if abs(sim.gpu(gpu0).power_limit_w - DESIRED_W) < 0.01:
            raise RuntimeError("driver_reload did not reset the power limit; nothing to measure")
        started: dict[str, set[float]] = {uuid: set() for uuid in app.workers}
        while True:
            for uuid, worker in app.workers.items():
                # Ticks of this GPU's loop since the reload, until its own limit is back.
                if worker.last_tick_s >= reload_mono and abs(sim.gpu(uuid).power_limit_w - DESIRED_W) >= 0.01:
                    started[uuid].add(worker.last_tick_s)
            if all_at(sim, DESIRED_W):
                break
            if time.perf_counter() - t0 > 30:
                raise RuntimeError("the power limits were not re-applied within 30 s of a driver reload")
            await asyncio.sleep(0.002)
        times.append(time.perf_counter() - t0)
        ticks.append(max(len(s) for s in started.values()))
    drift_after = sum(sum(w.reconciler.counters.drift_reapplies.values()) for w in app.workers.values())
    cycle_s = COLLECT_CYCLE_MS / 1000
    return {
        "reloads": reloads,
        "reapply_s_mean": round(statistics.fmean(times), 3),
        "reapply_s_max": round(max(times), 3),
        "reapply_cycles_max": round(max(times) / cycle_s, 3),
        "reapply_ticks_max": max(ticks),
        "reapply_within_one_cycle": max(ticks) <= 1,
        "reapply_s_all": [round(t, 3) for t in times],
        "drift_reapplies_counted": drift_after - drift_before,
    }


async def eventbus_phase(tmp: Path, broker: Any, args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    from mapper.shared.settings import MqttSettings
    from tests.apphelpers import running_app

    sim = new_sim()
    folder = tmp / "eb-devices"
    write_devices_folder(folder, [(g.index, g.uuid) for g in sim.gpus])
    settings = base_settings(tmp / "eb-data", devices_dir=str(folder), mqtt=MqttSettings(url=broker.url))
    async with running_app(settings, sim) as app:
        await wait_until(lambda: app.session is not None and app.session.connected, 10, "MQTT connected")
        if args.mapper_nodelay:
            mapper_nodelay(app)
        await wait_until(lambda: all_at(sim, DESIRED_W), 10, "450 W on every GPU from the devices folder")
        spec = {
            "port": broker.port,
            "variants": ["eventbus", "eventbus_twin"],
            "changes": args.changes,
            "twin_changes": args.twin_changes,
            "seed": args.seed,
            **args.client_extra,
        }
        raw = await asyncio.to_thread(run_client, spec, 600)
        # Back to 450 W from the edge too, then the reload series.
        gpu0 = app.workers[sim.gpus[0].uuid]
        gpu0.desired.set("power_limit", str(DESIRED_W), "edge", int(time.time() * 1000) + 10_000)
        gpu0.wake()
        reload = await measure_reloads(app, sim, args.reloads, random.Random(args.seed))
    # Split by whether the change waited at the door for gpu0's inbound rate (2/s, burst 20): changes every
    # 50-150 ms, each after the one before was acked, are over it once the burst is spent.
    flags = raw["eventbus_deferred_flags"]
    at_once = [x for x, waited in zip(raw["eventbus"], flags, strict=True) if not waited]
    waited = [x for x, waited in zip(raw["eventbus"], flags, strict=True) if waited]
    return {"eventbus": at_once, "eventbus_deferred": waited, "eventbus_twin": raw["eventbus_twin"]}, reload


async def dmi_phase(tmp: Path, broker: Any, args: argparse.Namespace) -> dict[str, Any]:
    from mapper.shared.settings import MqttSettings
    from tests.apphelpers import running_app
    from tests.fake_edgecore import FakeEdgeCore

    sock_dir = Path(tempfile.mkdtemp(prefix="dmi-", dir="/tmp"))
    try:
        sim = new_sim()
        edge = FakeEdgeCore(str(sock_dir / "dmi.sock"))
        edge.devices = [dmi_device(g.index, g.uuid, str(DESIRED_W)) for g in sim.gpus]
        edge.models = [dmi_model()]
        await edge.start()
        settings = base_settings(
            tmp / "dmi-data",
            edgecore_socket=edge.socket_path,
            socket=str(sock_dir / "gpu.sock"),
            mqtt=MqttSettings(url=broker.url),
        )
        try:
            async with running_app(settings, sim) as app:
                await wait_until(lambda: app.dmi_client is not None and app.dmi_client.registered, 10, "registered")
                await wait_until(lambda: app.session is not None and app.session.connected, 10, "MQTT connected")
                if args.mapper_nodelay:
                    mapper_nodelay(app)
                await wait_until(lambda: all_at(sim, DESIRED_W), 10, "450 W on every GPU from EdgeCore")
                spec = {
                    "port": broker.port,
                    "variants": ["dmi", "dmi_new_channel"],
                    "changes": args.changes,
                    "twin_changes": args.twin_changes,
                    "seed": args.seed + 1,
                    "socket": settings.socket,
                    "uuid": sim.gpus[0].uuid,
                    **args.client_extra,
                }
                raw = await asyncio.to_thread(run_client, spec, 600)
                # The ack series changes gpu0 every ~0.1 s: its prompt reports spend the DMI budget (one a second,
                # above the 0.8/s refill). The twin series starts, as a quiet node would, with the budget back.
                assert app.dmi_client is not None
                refilled = args.budget_tokens
                await wait_until(lambda: app.dmi_client.bucket.tokens >= refilled, 120, "the DMI budget to refill")
                raw.update(await asyncio.to_thread(run_client, dict(spec, variants=["dmi_twin"]), 600))
                await asyncio.sleep(2.5)  # the last twin's report (well within; a missing one counts as a timeout)
        finally:
            await edge.stop()
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)
    raw["dmi_twin"] = dmi_twin_latencies(edge, raw["dmi_twin"])
    return raw


async def startup_phase(tmp: Path, args: argparse.Namespace, round_no: int, reserve: int | None) -> list[float | None]:
    """A fresh mapper in DMI mode; all 8 Devices changed at once as soon as every GPU has its desired 450 W (the
    start-up reports still going out); per Device, the change sent -> its twin with the new value at EdgeCore.
    ``reserve``: the DMI reporter's reserve for prompt reports (None: the default, one token per Device)."""
    from tests.apphelpers import running_app
    from tests.fake_edgecore import FakeEdgeCore

    sock_dir = Path(tempfile.mkdtemp(prefix="dmi-start-", dir="/tmp"))
    value = VALUES_W[round_no % len(VALUES_W)]
    try:
        sim = new_sim()
        edge = FakeEdgeCore(str(sock_dir / "dmi.sock"))
        edge.devices = [dmi_device(g.index, g.uuid, str(DESIRED_W)) for g in sim.gpus]
        edge.models = [dmi_model()]
        await edge.start()
        tag = "default" if reserve is None else f"reserve{reserve}"
        settings = base_settings(
            tmp / f"start-{tag}-{round_no}", edgecore_socket=edge.socket_path, socket=str(sock_dir / "gpu.sock")
        )
        try:
            async with running_app(settings, sim) as app:
                assert app.dmi_reporter is not None
                if reserve is not None:
                    app.dmi_reporter.scheduler.reserve_tokens = reserve
                await wait_until(lambda: all_at(sim, DESIRED_W), 20, "450 W on every GPU from EdgeCore")
                spec = {
                    "variants": ["dmi_all"],
                    "socket": settings.socket,
                    "uuids": [g.uuid for g in sim.gpus],
                    "value": value,
                    "seed": args.seed,
                    "port": 0,
                }
                sent = (await asyncio.to_thread(run_client, spec, 120))["dmi_all"]

                def latencies() -> list[float | None]:
                    return [dmi_twin_latencies(edge, [[v, t0]], index=int(i), limit_s=30.0)[0] for i, v, t0 in sent]

                with contextlib.suppress(RuntimeError):  # a twin missing after 30 s counts as a timeout
                    await wait_until(lambda: None not in latencies(), 30, "every Device's new twin")
                return latencies()
        finally:
            await edge.stop()
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)


def dmi_twin_latencies(
    edge: Any, sent: list[list[float]], *, index: int = 0, limit_s: float = 5.0
) -> list[float | None]:
    """Per change (value, sent at): the first ReportDeviceStatus of Device ``index`` the test EdgeCore accepted
    after it whose power_limit twin has the value as both observedDesired and reported, minus the send (both on
    CLOCK_MONOTONIC: the client's perf_counter and the EdgeCore's time.monotonic, two processes, one clock)."""
    reports = []
    for request, at in zip(edge.rec.statuses, edge.rec.status_times, strict=True):
        if request.deviceName != device_name(index):
            continue
        for twin in request.reportedDevice.twins:
            if twin.propertyName == "power_limit":
                reports.append((at, twin.observedDesired.value, twin.reported.value))
    out: list[float | None] = []
    for value, t0 in sent:
        hit = None
        for at, observed, reported in reports:
            if at >= t0 and float(observed or "nan") == value and float(reported or "nan") == value:
                hit = at - t0
                break
        out.append(hit if hit is not None and hit < limit_s else None)
    return out


async def live_phase(tmp: Path, broker: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Standalone with ``telemetry.live`` on: each sample's live message to the subscriber in the client process,
    from the sample's read time (its ``ts_ms``, taken at the end of the NVML read on the backend's thread; wall
    clock, 1 ms resolution) and from the moment the collector hands it to the publisher (perf_counter, precise)."""
    from mapper.shared.settings import MqttSettings
    from tests.apphelpers import running_app

    sim = new_sim()
    folder = tmp / "live-devices"
    write_devices_folder(folder, [(g.index, g.uuid) for g in sim.gpus])
    settings = base_settings(
        tmp / "live-data", devices_dir=str(folder), mqtt=MqttSettings(url=broker.url), telemetry_live=True
    )
    handed_at: dict[tuple[str, int], float] = {}
    async with running_app(settings, sim) as app:
        await wait_until(lambda: app.session is not None and app.session.connected, 10, "MQTT connected")
        on_sample = app.collector.on_sample
        assert on_sample is not None, "telemetry.live wires the collector's on_sample"

        def timed(worker: Any, sample: Any) -> None:
            handed_at[(sample.uuid, sample.ts_ms)] = time.perf_counter()
            on_sample(worker, sample)

        app.collector.on_sample = timed
        spec = {"port": broker.port, "variants": ["live"], "live_s": args.live_s, "seed": args.seed + 2}
        spec["hops"] = args.client_extra.get("hops", 300)
        raw = await asyncio.to_thread(run_client, spec, 120)
    from_read = [(wall_ms - ts) / 1000 for _, ts, _, wall_ms in raw["live"]]
    from_handoff = [t - handed_at[(u, ts)] for u, ts, t, _ in raw["live"] if (u, ts) in handed_at]
    expected = args.live_s * GPUS / (COLLECT_CYCLE_MS / 1000)
    return {
        "live": {
            "messages": len(raw["live"]),
            "messages_per_sample_expected": round(len(raw["live"]) / expected, 3),
            "bytes_median": round(statistics.median(raw["live_bytes"])) if raw["live_bytes"] else 0,
            **(summary_ms(from_read) if from_read else {}),
        },
        "live_from_handoff": {"matched": len(from_handoff), **(summary_ms(from_handoff) if from_handoff else {})},
        "live_baseline_broker_hop": summary_ms(raw["live_baseline"]) if raw["live_baseline"] else {},
    }


def series_figures(raw: list[float | None]) -> dict[str, Any]:
    ok = [x for x in raw if x is not None]
    out: dict[str, Any] = {"changes": len(raw), "timeouts": len(raw) - len(ok)}
    if ok:
        out.update(summary_ms(ok))
    return out


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    from tests.brokers import Mosquitto

    baseline = baseline_set_power_limit(1000)
    tmp = Path(tempfile.mkdtemp(prefix="desired-latency-"))
    configure_logging(tmp / "mapper.log")
    broker = Mosquitto(tmp, extra_config=args.broker_config)
    broker.start()
    try:
        t0 = time.perf_counter()
        phases_s: dict[str, float] = {}
        eb_raw, reload = await eventbus_phase(tmp, broker, args)
        phases_s["eventbus"] = time.perf_counter() - t0
        dmi_raw = await dmi_phase(tmp, broker, args)
        phases_s["dmi"] = time.perf_counter() - t0 - sum(phases_s.values())
        for reserve, name in ((None, "dmi_startup"), (0, "dmi_startup_reserve0"))[: 1 if args.smoke else 2]:
            dmi_raw[name] = []
            for round_no in range(args.startup_rounds):
                dmi_raw[name] += await startup_phase(tmp, args, round_no, reserve)
        phases_s["startup"] = time.perf_counter() - t0 - sum(phases_s.values())
        live = await live_phase(tmp, broker, args)
        wall_s = time.perf_counter() - t0
        phases_s["live"] = wall_s - sum(phases_s.values())
    finally:
        broker.stop()
        logging.getLogger().handlers[:] = []
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    series = {name: series_figures(values) for name, values in {**eb_raw, **dmi_raw}.items()}
    result: dict[str, Any] = {
        "benchmark": "desired_latency",
        "gpus": GPUS,
        "sim_cost": SIM_COST,
        "collect_cycle_ms": COLLECT_CYCLE_MS,
        "baseline_set_power_limit": baseline,
        **{name: figures for name, figures in series.items()},
        "reload": reload,
        **live,
        "broker_config": args.broker_config,
        "mapper_nodelay": args.mapper_nodelay,
        "wall_s": round(wall_s, 1),
        "phases_s": {k: round(v, 1) for k, v in phases_s.items()},
        "python": platform.python_version(),
    }
    base_p50 = baseline["p50_ms"]
    for name, figures in series.items():
        if name.startswith("dmi_startup"):
            # 8 Devices changed at once right after start-up: each twin within 1 s (the issue's target).
            figures["devices_per_round"] = GPUS
            figures["target_met"] = "p99_ms" in figures and figures["p99_ms"] < 1000.0 and figures["timeouts"] == 0
        elif name == "eventbus_deferred":
            # Changes over gpu0's inbound rate: each waited for its token (at most 1 / 2 per s) and was applied
            # and acked then; none may be lost (timeouts 0). No latency target: the wait is the limit's.
            figures["inbound_rate_per_s"] = 2.0
            figures["none_lost"] = figures["timeouts"] == 0
        elif "p99_ms" in figures and not name.endswith("_twin"):
            figures["p50_vs_baseline"] = round(figures["p50_ms"] / base_p50, 1)
            figures["p99_target_met"] = figures["p99_ms"] < 20.0 and figures["timeouts"] == 0
        elif "p99_ms" in figures:
            # The twin round trip (change sent -> the twin with the new value seen by EdgeCore): under 2 s with
            # 20 s report cycles; the ack latency of the same path is its baseline.
            ack = series[name.removesuffix("_twin") if name == "eventbus_twin" else "dmi_new_channel"]
            figures["report_cycle_ms"] = REPORT_CYCLE_MS
            figures["p50_vs_ack_p50"] = round(figures["p50_ms"] / ack["p50_ms"], 1) if "p50_ms" in ack else None
            figures["target_met"] = figures["p99_ms"] < 2000.0 and figures["timeouts"] == 0
    if args.keep:
        result["kept"] = str(tmp)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer driver reloads (200 changes per path still)")
    parser.add_argument("--changes", type=int, default=None, help="measured changes per path (default 300)")
    parser.add_argument("--reloads", type=int, default=None, help="driver reloads (default 10, 4 with --quick)")
    parser.add_argument(
        "--twin-changes", type=int, default=None, help="twin round trips per path, 4-6 s apart (default 24, 10)"
    )
    parser.add_argument("--live-s", type=float, default=None, help="seconds of live samples (default 30, 10)")
    parser.add_argument(
        "--startup-rounds", type=int, default=None, help="start-ups with all 8 changed at once, per variant (3, 2)"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (logs, databases)")
    parser.add_argument("--broker-config", default="", help="extra mosquitto.conf lines (e.g. 'set_tcp_nodelay true')")
    parser.add_argument(
        "--mapper-nodelay",
        action="store_true",
        help="diagnostic: set TCP_NODELAY on the mapper's MQTT socket (what a fix in mapper/net/mqtt.py would gain)",
    )
    parser.add_argument("--client", help=argparse.SUPPRESS)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="the benchmark smoke test: a few changes of each kind, short pauses, one start-up, no reserve0",
    )
    args = parser.parse_args()
    if args.client:
        client_main(json.loads(args.client))
        return
    args.client_extra = {}
    args.budget_tokens = 9.0
    if args.smoke:
        args.changes, args.reloads, args.twin_changes, args.live_s, args.startup_rounds = 3, 1, 1, 1.0, 1
        args.client_extra = {"warmup": 1, "twin_warmup": 1, "twin_pause_s": (1.0, 1.2), "hops": 30}
        args.budget_tokens = 5.0
    args.changes = args.changes if args.changes is not None else (200 if args.quick else 300)
    args.reloads = args.reloads if args.reloads is not None else (4 if args.quick else 10)
    args.twin_changes = args.twin_changes if args.twin_changes is not None else (10 if args.quick else 24)
    args.live_s = args.live_s if args.live_s is not None else (10.0 if args.quick else 30.0)
    args.startup_rounds = args.startup_rounds if args.startup_rounds is not None else (2 if args.quick else 3)
    if args.changes < 1 or args.reloads < 1:
        parser.error("--changes and --reloads must be at least 1")
    result = asyncio.run(main_async(args))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
