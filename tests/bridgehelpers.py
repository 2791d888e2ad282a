"""Helpers of the bridge tests: telemetry streams from simulated GPUs, a plain MQTT publisher, bridge settings,
an in-process bridge."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import math
import threading
import time
import urllib.error
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho

from mapper.bridge.app import Bridge
from mapper.bridge.config import BridgeSettings
from mapper.clock import FakeClock
from mapper.edge.gpu.nvml import NvmlBackend
from mapper.edge.gpu.simnvml import SimNvml
from mapper.edge.processes.leak import LeakConfig
from mapper.edge.processes.loop import telemetry_values
from mapper.edge.processes.monitor import ProcessMonitor
from mapper.edge.processes.workloads import PodInfo, ProcessOwner
from mapper.edge.status.nodestream import NodeStream
from mapper.edge.status.stats import DurationHistogram, GpuSnapshot, MapperSnapshot
from mapper.shared.model import GpuInfo, Sample
from mapper.shared.naming import NODE_DEVICE
from mapper.shared.settings import MqttSettings
from mapper.tools.discover import device_name
from mapper.wire.telemetry import BatchEncoder, DecodedBatch, EncodedBatch, Route, decode_batch
from mapper.wire.topics import state_topic, telemetry_topic
from tests.apphelpers import wait_for

NODE = "edge-1"


@dataclass(frozen=True)
class Published:
    topic: str
    payload: bytes
    batch: DecodedBatch
    #: The GPU the batch is of, as the mapper enumerated it, and the node's driver (its state messages say them).
    gpu: GpuInfo | None = None
    driver_version: str = ""


def stream(
    *,
    gpus: int = 2,
    seconds: int = 60,
    start_ms: int | None = None,
    node: str = NODE,
    boot_id: str = "5c1f0e9a",
    window_s: float = 10.0,
    seed: int = 3,
    every_s: int = 1,
    processes_every_s: int = 0,
    cap_first_w: float | None = None,
) -> list[Published]:
    """Batches a mapper on ``gpus`` simulated H100s would publish for ``seconds`` of sampling every ``every_s``
    (every property), ending now unless ``start_ms`` is given. Returned in publish order. ``processes_every_s``:
    the process cycle's rows too, at that cycle (the simulator's trainer of each GPU in pod ``ml/trainer-<i>``, and
    on the first GPU a process that leaks). ``cap_first_w``: the first GPU's power limit (W), set before sampling
    (its clocks are then held back by the power cap whenever its load would draw more)."""
    start = start_ms if start_ms is not None else int(time.time() * 1000) - seconds * 1000
    clock = FakeClock(start_wall_ms=start)
    sim = SimNvml(gpus, "H100", clock=clock.monotonic, seed=seed, scenario="training")
    backend = NvmlBackend(sim, clock=clock)
    backend.init()
    encoders: dict[str, BatchEncoder] = {}
    out: list[Published] = []
    # A leak over a short window, so that a 15-minute stream shows one (the default window is 30 min).
    monitor = ProcessMonitor(leak=LeakConfig(window_s=300.0, threshold_bytes=256 << 20))
    try:
        infos = backend.list_gpus()
        if cap_first_w is not None:  # the first GPU under a power cap, as the mapper applies a desired one
            backend.set_power_limit(infos[0].uuid, cap_first_w)
        if processes_every_s:  # the first GPU also runs a process that leaks 4 MiB/s beside its trainer
            sim.start_process(infos[0].uuid, 4242, 1 << 30, weight=0.2, growth_bytes_per_s=float(4 << 20))
        driver = backend.driver_version()
        by_device = {f"default/{device_name(node, g.index)}": g for g in infos}
        for step in range(0, seconds, every_s):
            clock.advance(float(every_s))
            for g in infos:
                dev = f"default/{device_name(node, g.index)}"
                enc = encoders.get(dev)
                if enc is None:
                    enc = encoders[dev] = BatchEncoder(node, dev, g.uuid, boot_id, window_s=window_s)
                sample = backend.sample(g.uuid, None)
                enc.add(sample)
                if processes_every_s and step % processes_every_s == 0:
                    procs = backend.processes(g.uuid)
                    pod = PodInfo(
                        uid=f"00000000-0000-4000-8000-{g.index:012x}", namespace="ml", name=f"trainer-{g.index}"
                    )
                    owners = {p.pid: ProcessOwner(p.pid, pod=pod, container_name="pytorch") for p in procs.processes}
                    report, _ = monitor.observe(procs, owners, clock.monotonic())
                    enc.add(Sample(g.uuid, procs.ts_ms, telemetry_values(report)))
                b = enc.flush_due(sample.ts_ms)
                if b is not None:
                    out.append(Published(telemetry_topic(node, dev), b.payload, decode_batch(b.payload), g, driver))
        for dev, enc in encoders.items():
            b = enc.flush()
            if b is not None:
                out.append(
                    Published(telemetry_topic(node, dev), b.payload, decode_batch(b.payload), by_device[dev], driver)
                )
    finally:
        backend.shutdown()
    return out


#: The buffer cap of the mapper of ``node_stream``: its buffer fills to 90 % of it over the stream.
NODE_BUFFER_MAX_BYTES = 256 << 20


def node_snapshot(i_s: int, ts_ms: int, *, node: str = NODE, gpus: int = 2) -> MapperSnapshot:
    """What a mapper of ``gpus`` GPUs would show ``i_s`` seconds into ``node_stream``: a broker link that holds, a
    buffer filling up (90 % of its cap at 900 s), a drop every 5 minutes, DMI calls, desired-state actions, a
    thermal policy holding an override, collect rounds of 2 ms and now and then 300 ms."""
    hist = DurationHistogram()
    for k in range(i_s):
        hist = hist.observe(0.3 if k % 50 == 0 else 0.002)
    return MapperSnapshot(
        node=node,
        taken_at_ms=ts_ms,
        version="0.1.0",
        mode="dmi",
        gpus=tuple(GpuSnapshot(info=GpuInfo(f"GPU-{g}", g, "H100")) for g in range(gpus)),
        buffer_bytes=NODE_BUFFER_MAX_BYTES * min(i_s, 900) // 1000,
        buffer_batches=i_s // 10,
        buffer_max_bytes=NODE_BUFFER_MAX_BYTES,
        buffer_oldest_age_s=float(i_s),
        buffer_drops={"age": i_s // 300},
        telemetry_published_batches=3 * i_s,
        telemetry_published_bytes=600 * i_s,
        mqtt_enabled=True,
        mqtt_connected=True,
        mqtt_reconnects=1,
        dmi_registered=True,
        dmi_rpcs={("ReportDeviceStatus", "ok"): i_s // 20, ("MapperRegister", "ok"): 1},
        reconcile_actions={("power_limit", "applied"): 1 + i_s // 100},
        drift_reapplies={"power_limit": i_s // 200},
        desired_rejections={"out-of-range": i_s // 400},
        policy_overrides_active={"thermal": 1},
        policy_events={("thermal", "engage"): 1 + i_s // 300},
        collect_duration=hist,
        collect_errors={"transient": i_s // 250},
    )


def node_stream(
    *, seconds: int = 60, start_ms: int | None = None, node: str = NODE, boot_id: str = "5c1f0e9a", every_s: int = 20
) -> list[Published]:
    """The node stream (the mapper's own series) the mapper of ``stream`` would publish over the same time: a sample
    of ``node_snapshot`` every ``every_s`` (the report cycle), cut by the mapper's own ``NodeStream``."""
    start = start_ms if start_ms is not None else int(time.time() * 1000) - seconds * 1000
    clock = FakeClock(start_wall_ms=start)
    made: list[tuple[EncodedBatch, Route | None]] = []
    snap = {"i": 0}
    ns = NodeStream(
        node,
        boot_id,
        lambda: node_snapshot(snap["i"], clock.wall_ms(), node=node),
        lambda batch, route: made.append((batch, route)),
        clock=clock,
        cycle_s=every_s,
        window_s=3 * every_s,
    )
    for i in range(0, seconds, every_s):
        clock.advance(float(every_s))
        snap["i"] = i + every_s
        ns.sample()
    ns.flush()
    out = []
    for batch, route in made:
        assert route is not None
        out.append(Published(route.topic, batch.payload, decode_batch(batch.payload)))
    return out


#: The XID the state messages of GPU 0 count (one more every XID_EVERY_S of sample time), and its desired power
#: limit (the other GPUs have neither).
XID, XID_EVERY_S, DESIRED_W = 48, 300, 300.0


def state_message(p: Published, sample: Sample, uuid: str, since_ms: int) -> tuple[str, bytes]:
    """The state message the mapper would publish for ``p``'s device at ``sample`` (``GpuSnapshot.state_message``):
    GPU 0 online with a desired power limit and XIDs counted since ``since_ms``, the others online."""
    assert p.gpu is not None, "a batch of stream() says its GPU"
    first = p.gpu.index == 0
    gpu = GpuSnapshot(
        info=replace(p.gpu, driver_version=""),  # the node's driver stands for it, as the mapper's does
        device=p.batch.device,
        sample=replace(sample, uuid=uuid),
        state="online",
        xid_errors={XID: 1 + (sample.ts_ms - since_ms) // (XID_EVERY_S * 1000)} if first else {},
        desired_power_limit_w=DESIRED_W if first else None,
    )
    payload = gpu.state_message(p.batch.device, driver_version=p.driver_version, at_ms=sample.ts_ms)
    return state_topic(p.batch.node, p.batch.device), payload


def _uuid_of(batches: list[Published], device: str) -> str:
    return next(p.batch.uuid for p in batches if p.batch.device == device and p.batch.uuid)


def _since_ms(batches: list[Published], device: str) -> int:
    return min(p.batch.ts_first_ms for p in batches if p.batch.device == device)


def states(batches: list[Published]) -> Iterator[tuple[str, bytes]]:
    """The retained state message of every device of ``batches`` (its last sample)."""
    last: dict[tuple[str, str], Published] = {}
    for p in batches:
        if p.batch.device != NODE_DEVICE:  # the node stream has no state message
            last[(p.batch.node, p.batch.device)] = p
    for p in last.values():
        device = p.batch.device
        uuid = p.batch.uuid or _uuid_of(batches, device)
        yield state_message(p, p.batch.samples[-1], uuid, _since_ms(batches, device))


def state_stream(batches: list[Published], every_s: int = 20) -> list[tuple[str, bytes]]:
    """The state messages the mapper would publish every ``every_s`` of sample time (its report cycle) over
    ``batches``, in time order."""
    out: list[tuple[int, str, bytes]] = []
    next_ms: dict[str, int] = {}
    for p in batches:
        device = p.batch.device
        uuid, since_ms = p.batch.uuid or _uuid_of(batches, device), _since_ms(batches, device)
        for s in p.batch.samples:
            if s.ts_ms >= next_ms.get(device, 0):
                next_ms[device] = s.ts_ms + every_s * 1000
                out.append((s.ts_ms, *state_message(p, s, uuid, since_ms)))
    out.sort(key=lambda m: m[0])
    return [(topic, payload) for _, topic, payload in out]


class Publisher:
    """A plain paho client (its own network thread) publishing QoS 1 and waiting for every PUBACK."""

    def __init__(self, url: str, client_id: str = "test-publisher") -> None:
        host, port = url.removeprefix("mqtt://").split(":")
        self.client = paho.Client(callback_api_version=paho.CallbackAPIVersion.VERSION2, client_id=client_id)
        self.client.max_inflight_messages_set(100)
        self.client.connect(host, int(port), keepalive=30)
        self.client.loop_start()

    def publish(self, items: list[tuple[str, bytes, bool]], timeout_s: float = 60.0) -> None:
        infos = [self.client.publish(topic, payload, qos=1, retain=retain) for topic, payload, retain in items]
        deadline = time.monotonic() + timeout_s
        for info in infos:
            info.wait_for_publish(max(0.1, deadline - time.monotonic()))
            assert info.is_published(), "a publish was not acknowledged in time"

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def publish_all(url: str, batches: list[Published], *, with_states: bool = True) -> None:
    pub = Publisher(url)
    try:
        if with_states:
            pub.publish([(t, p, True) for t, p in states(batches)])
        pub.publish([(p.topic, p.payload, False) for p in batches])
    finally:
        pub.close()


def publish_states(url: str, messages: list[tuple[str, bytes]]) -> None:
    """State messages (``state_stream``), retained as the mapper publishes them, in order."""
    pub = Publisher(url, client_id="test-state-publisher")
    try:
        pub.publish([(t, p, True) for t, p in messages])
    finally:
        pub.close()


def bridge_settings(
    broker_url: str, write_url: str, tmp: Path, client_id: str = "bridge-test-1", **overrides: Any
) -> BridgeSettings:
    """Fast settings of a bridge on ``broker_url`` as ``client_id`` writing to ``write_url``; ``overrides``: other
    fields."""
    base = BridgeSettings(
        mqtt=MqttSettings(url=broker_url, client_id=client_id),
        remote_write=write_url,
        metrics_addr="127.0.0.1:0",
        spool_dir=str(tmp / "spool"),
        batch_max_delay_s=0.2,
        retry_min_s=0.1,
        retry_max_s=1.0,
        uuid_wait_s=2.0,
        mqtt_reconnect_max_s=1.0,
    )
    return replace(base, **overrides)


@contextlib.asynccontextmanager
async def running_bridge(settings: BridgeSettings) -> AsyncIterator[Bridge]:
    bridge = Bridge(settings)
    stop = asyncio.Event()
    task = asyncio.create_task(bridge.run(stop))
    try:
        await wait_for(lambda: bridge.session.connected or task.done(), timeout_s=15, what="the bridge to connect")
        assert not task.done(), f"the bridge exited early: {task.result()}"
        yield bridge
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 20) == 0


def expected_samples(batches: list[Published], *, with_states: bool = True) -> int:
    """Samples the bridge must write for ``batches`` (each (device, seq) once), with those of the state messages
    ``publish_all`` sends before them (``with_states``). Counted from the decoded batches and the state messages'
    JSON by the mapping docs/bridge.md states, never by the bridge's own converter (a conversion bug it shared
    with the count would pass): a numeric value (or a bool) of a catalog property with a Prometheus name is one
    sample, as is a number of the process cycle (``pod:...``, ``leak:...``, ``processes_*``); the clock event
    reasons one per known reason, the compute mode one per mode, the product name and the policy state one
    each; strings and non-finite numbers none. A state message with a state gives one sample per device state,
    plus one per XID it counts, plus one for a desired power limit."""
    from mapper.shared.model import CLOCK_EVENT_REASONS, COMPUTE_MODES, DEVICE_STATES, PROPERTY_BY_NAME

    def is_number(v: object) -> bool:
        return isinstance(v, bool) or (isinstance(v, int | float) and math.isfinite(v))

    def samples_of(name: str, v: object) -> int:
        if name == "clock_event_reasons":
            return len(CLOCK_EVENT_REASONS) if is_number(v) else 0
        if name == "compute_mode":
            return len(COMPUTE_MODES) if v in COMPUTE_MODES else 0
        if name in ("product_name", "policy_state"):
            return 1 if isinstance(v, str) and v else 0
        spec = PROPERTY_BY_NAME.get(name)
        process_cycle = name.startswith(("pod:", "leak:")) or name.startswith("processes_")
        return 1 if (process_cycle or (spec is not None and spec.prom_name)) and is_number(v) else 0

    def node_samples_of(name: str, v: object) -> int:
        # the node stream (docs/telemetry.md): each value is one sample of the mapper's own series
        return 1 if is_number(v) else 0

    def health_samples_of(health: dict[str, Any]) -> int:
        # docs/bridge.md: each level, subsystem and check one sample per status; the probe's outcome and latency;
        # one per probe outcome counted; the InfoROM versions one
        statuses = 3  # healthy, degraded, unhealthy
        n = statuses * (len(health.get("levels", {})) + len(health.get("subsystems", {})) + len(health["checks"]))
        probe = health.get("probe")
        if probe is not None:
            n += 1 + (1 if probe.get("latency_s") is not None else 0)
        return n + len(health.get("probes", {})) + (1 if "inforom" in health else 0)

    seen = set()
    total = 0
    for p in batches:
        key = (p.batch.device, p.batch.seq)
        if key in seen:
            continue
        seen.add(key)
        count = node_samples_of if p.batch.device == NODE_DEVICE else samples_of
        total += sum(count(n, v) for row in p.batch.samples for n, v in row.values.items())
    if with_states:
        for _, payload in states(batches):
            doc = json.loads(payload)
            total += len(DEVICE_STATES) if doc.get("state") else 0
            total += len(doc.get("xid_errors") or {})
            total += 1 if doc.get("power_limit_desired_w") is not None else 0
            total += health_samples_of(doc["health"]) if doc.get("health") else 0
    return total


def decoded_values(batches: list[Published], prop: str, factor: float) -> dict[tuple[str, int], float]:
    """(uuid, ts_ms) -> the decoded value of ``prop`` times ``factor`` (its unit's, written out by the caller), for
    each sample of ``batches`` that has one."""
    uuids = {p.batch.device: p.batch.uuid for p in batches if p.batch.uuid}
    out = {}
    for p in batches:
        for row in p.batch.samples:
            v = row.values.get(prop)
            if isinstance(v, int | float) and not isinstance(v, bool):
                out[(uuids[p.batch.device], row.ts_ms)] = float(v) * factor
    return out


class ReceiverServer:
    """A remote-write endpoint on 127.0.0.1 (a free port) served by ``handler`` in threads of its own, until
    ``close``."""

    def __init__(self, handler: type[http.server.BaseHTTPRequestHandler]) -> None:
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/api/v1/write"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


class FlakyReceiver(ReceiverServer):
    """A real HTTP server in front of a real Prometheus: it forwards every POST unchanged, except that while
    ``status`` is set it answers that status instead (a receiver outage), and it waits ``delay_s`` per request."""

    def __init__(self, target_url: str) -> None:
        self.target_url = target_url
        self.status: int | None = None
        self.delay_s = 0.0
        self.answers: list[int] = []
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if owner.delay_s:
                    time.sleep(owner.delay_s)
                status = owner.status
                text = b"receiver outage (test)\n"
                if status is None:
                    req = urllib.request.Request(owner.target_url, data=body, method="POST")
                    for k in ("Content-Encoding", "Content-Type", "X-Prometheus-Remote-Write-Version"):
                        req.add_header(k, self.headers.get(k, ""))
                    try:
                        with urllib.request.urlopen(req, timeout=30) as resp:
                            status, text = resp.status, resp.read()
                    except urllib.error.HTTPError as exc:
                        status, text = exc.code, exc.read()
                owner.answers.append(status)
                self.send_response(status)
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)

        super().__init__(Handler)
