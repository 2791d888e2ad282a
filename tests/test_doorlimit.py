"""Limits at the doors: per-device token buckets on messages from the broker (unit, and the whole mapper against
a real mosquitto), and the size bound of the mapper's own DMI server over a real Unix socket."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import urllib.request
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest

from mapper.clock import FakeClock
from mapper.edge.config import load_settings
from mapper.edge.kubeedge.dmi.pb import dmi_pb2 as pb
from mapper.edge.kubeedge.dmi.server import DmiServer
from mapper.edge.kubeedge.doorlimit import InboundLimiter, Values, Versioned
from mapper.edge.kubeedge.registry import Registry
from mapper.edge.storage.store import DesiredStore
from mapper.errors import ConfigError
from tests.apphelpers import running_app, wait_for
from tests.brokers import Mosquitto
from tests.fake_edgecore import FakeEdgeCore, pb_device, sock_dir
from tests.test_app_eventbus import Listener, standalone

__all__ = ["sock_dir"]


def test_each_device_gets_its_burst_then_its_rate_and_the_rest_is_dropped_and_counted() -> None:
    clock = FakeClock()
    limiter = InboundLimiter("deltas", 2.0, 5, clock=clock)
    assert [limiter.allow("default/gpu0") for _ in range(7)] == [True] * 5 + [False] * 2
    assert limiter.allow("default/gpu1")  # another device has its own bucket
    clock.advance(1.0)  # two tokens back
    assert [limiter.allow("default/gpu0") for _ in range(3)] == [True, True, False]
    clock.advance(100.0)  # never more than the burst
    assert sum(limiter.allow("default/gpu0") for _ in range(10)) == 5
    assert limiter.dropped == {"rate-limited": 2 + 1 + 5}


def test_drops_are_logged_at_once_then_at_most_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    limiter = InboundLimiter("deltas", 1.0, 1, clock=clock, log_interval_s=60)
    caplog.set_level(logging.WARNING, logger="mapper.edge.kubeedge.doorlimit")
    for _ in range(50):
        limiter.allow("default/gpu0")
    assert len(caplog.records) == 1
    assert "default/gpu0 rate-limited x1" in caplog.records[0].getMessage()
    assert "at most once per 60s" in caplog.records[0].getMessage()
    clock.advance(30)
    limiter.drop("default/gpu1", "too-large")
    assert len(caplog.records) == 1
    clock.advance(31)
    limiter.allow("default/gpu0")
    limiter.allow("default/gpu0")
    assert len(caplog.records) == 2
    summary = caplog.records[1].getMessage()
    # Everything since the last line: 48 earlier plus the one now, and the oversized one.
    assert "default/gpu0 rate-limited x49" in summary and "default/gpu1 too-large x1" in summary
    assert limiter.dropped == {"rate-limited": 50, "too-large": 1}


def test_a_flood_of_made_up_device_names_cannot_grow_the_buckets_without_bound() -> None:
    limiter = InboundLimiter("deltas", 1.0, 1, clock=FakeClock(), max_keys=100)
    for i in range(10_000):
        limiter.allow(f"default/fake-{i}")
    assert len(limiter._buckets) == 100


class FakeTimers:
    """``schedule`` on fake time: the callbacks due are run by ``run_due``."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.due: list[tuple[float, Callable[[], None], list[bool]]] = []

    def schedule(self, delay_s: float, callback: Callable[[], None]) -> Any:
        cancelled = [False]
        self.due.append((self.clock.monotonic() + delay_s, callback, cancelled))

        class Handle:
            def cancel(self) -> None:
                cancelled[0] = True

        return Handle()

    def run_due(self) -> int:
        ran = 0
        while ready := [t for t in self.due if t[0] <= self.clock.monotonic()]:
            for entry in ready:
                self.due.remove(entry)
                if not entry[2][0]:
                    entry[1]()
                    ran += 1
        return ran

    def pending(self) -> int:
        return sum(1 for t in self.due if not t[2][0])


def _door(clock: FakeClock, rate: float, burst: int):
    """A limiter with a desired-values gate whose messages are ``prop=value@version`` lines (a stand-in for the
    delta's JSON: the door only needs the values and versions read)."""
    limiter = InboundLimiter("deltas", rate, burst, clock=clock)
    timers = FakeTimers(clock)
    applied: list[tuple[str, dict[str, tuple[str, int]]]] = []
    deferred: list[tuple[str, dict[str, tuple[str, int]]]] = []

    def read(topic: str, payload: bytes) -> dict[str, Versioned]:
        values = {}
        for line in payload.decode().splitlines():
            prop, _, rest = line.partition("=")
            value, at, version = rest.partition("@")
            if not prop or not at:
                raise ValueError(f"not prop=value@version: {line!r}")
            values[prop] = Versioned(value, int(version))
        return values

    def as_plain(values: Values) -> dict[str, tuple[str, int]]:
        return {p: (v.value, v.version_ms) for p, v in values.items()}

    gate = limiter.gate_latest(
        read,
        lambda key, values: applied.append((key, as_plain(values))),
        1024,
        schedule=timers.schedule,
        on_deferred=lambda key, values: deferred.append((key, as_plain(values))),
    )
    return limiter, timers, gate, applied, deferred


GPU0 = "$hw/events/device/default/gpu0/twin/update/delta"
GPU1 = "$hw/events/device/default/gpu1/twin/update/delta"


def test_desired_values_over_the_rate_wait_and_the_newest_per_property_is_applied_when_a_token_comes() -> None:
    clock = FakeClock()
    limiter, timers, gate, applied, deferred = _door(clock, 2.0, 2)
    gate(GPU0, b"power_limit=300@1")
    gate(GPU0, b"power_limit=310@2")
    assert applied == [("default/gpu0", {"power_limit": ("300", 1)}), ("default/gpu0", {"power_limit": ("310", 2)})]
    # The bucket is empty: these wait, merged per property.
    gate(GPU0, b"power_limit=320@3")
    gate(GPU0, b"power_limit=330@4\ncompute_mode=PROHIBITED@4")
    gate(GPU0, b"power_limit=340@5")
    gate(GPU1, b"power_limit=200@6")  # another device: its own bucket, applied at once
    assert applied[2:] == [("default/gpu1", {"power_limit": ("200", 6)})]
    assert limiter.waiting("default/gpu0") == {
        "power_limit": Versioned("340", 5),
        "compute_mode": Versioned("PROHIBITED", 4),
    }
    # Each property that started to wait was announced once; 320 and 330 were superseded.
    assert deferred == [
        ("default/gpu0", {"power_limit": ("320", 3)}),
        ("default/gpu0", {"compute_mode": ("PROHIBITED", 4)}),
    ]
    assert limiter.dropped == {"superseded": 2} and limiter.deferred == 2
    # Nothing is due before the next token (1 / 2 per s = 0.5 s).
    clock.advance(0.49)
    assert timers.run_due() == 0 and len(applied) == 3
    clock.advance(0.01)
    assert timers.run_due() == 1
    assert applied[3:] == [("default/gpu0", {"power_limit": ("340", 5), "compute_mode": ("PROHIBITED", 4)})]
    assert limiter.waiting("default/gpu0") == {} and timers.pending() == 0


def test_a_value_waiting_is_not_replaced_by_an_older_version_and_later_messages_never_overtake_it() -> None:
    clock = FakeClock()
    limiter, timers, gate, applied, _ = _door(clock, 1.0, 1)
    gate(GPU0, b"power_limit=300@10")
    gate(GPU0, b"power_limit=350@20")  # waits
    gate(GPU0, b"power_limit=320@15")  # older than the one waiting: it is the superseded one
    assert limiter.waiting("default/gpu0") == {"power_limit": Versioned("350", 20)}
    assert limiter.dropped == {"superseded": 1}
    clock.advance(1.0)  # a token is back, but the one waiting goes first: a new message joins it
    gate(GPU0, b"locked_gpu_clock_max=1500@21")
    assert applied == [("default/gpu0", {"power_limit": ("300", 10)})]
    assert timers.run_due() == 1
    assert applied[1:] == [("default/gpu0", {"power_limit": ("350", 20), "locked_gpu_clock_max": ("1500", 21)})]


def test_a_timer_that_comes_early_waits_on_and_flush_applies_whatever_waits() -> None:
    clock = FakeClock()
    limiter, timers, gate, applied, _ = _door(clock, 1.0, 1)
    gate(GPU0, b"power_limit=300@1")
    gate(GPU0, b"power_limit=310@2")
    clock.advance(1.0)
    assert limiter.allow("default/gpu0")  # the token it waited for is taken by another door of the same key
    timers.run_due()
    assert len(applied) == 1 and limiter.waiting("default/gpu0") and timers.pending() == 1
    limiter.flush()  # shutdown: applied whatever the tokens, the timer cancelled
    assert applied[1:] == [("default/gpu0", {"power_limit": ("310", 2)})]
    assert timers.pending() == 0 and limiter.waiting("default/gpu0") == {}


def test_over_the_rate_a_message_that_cannot_be_read_is_counted_not_logged_each_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    limiter, _, gate, applied, _ = _door(clock, 1.0, 1)
    caplog.set_level(logging.WARNING, logger="mapper.edge.kubeedge.doorlimit")
    gate(GPU0, b"garbage")  # within the rate: refused with its reason, logged
    assert "not prop=value@version" in caplog.records[0].getMessage()
    for _ in range(100):
        gate(GPU0, b"garbage")
    assert limiter.dropped == {"refused": 100} and applied == []
    assert len(caplog.records) == 2  # the first drop at once; the rest in the next summary


def test_the_limits_are_config_keys_with_defaults_and_bad_values_are_refused_by_name(tmp_path: Path) -> None:
    env = {"GPU_MAPPER_NODE_NAME": "edge-1"}
    s = load_settings(env=env)
    assert (s.inbound_rate_per_s, s.inbound_burst, s.inbound_max_bytes) == (2.0, 20, 64 * 1024)
    assert s.dmi_max_message_bytes == 4 * 1024**2
    config = tmp_path / "c.yaml"
    config.write_text("mqtt:\n  inboundRatePerSecond: 0.5\n  inboundBurst: 3\n  inboundMaxBytes: 8KiB\n"
                      "dmi:\n  maxMessageBytes: 1MiB\n")  # fmt: skip
    s = load_settings(str(config), env=env)
    assert (s.inbound_rate_per_s, s.inbound_burst, s.inbound_max_bytes) == (0.5, 3, 8192)
    assert s.dmi_max_message_bytes == 1024**2
    for key, value, message in (
        ("GPU_MAPPER_INBOUND_RATE_PER_S", "0", "inboundRatePerSecond"),
        ("GPU_MAPPER_INBOUND_MAX_BYTES", "100", "inboundMaxBytes"),
        ("GPU_MAPPER_DMI_MAX_MESSAGE_BYTES", "1GiB", "maxMessageBytes"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_settings(env={**env, key: value})


# --------------------------------------------------------------------------------------------------
# The whole mapper against a real mosquitto
# --------------------------------------------------------------------------------------------------


def _dropped(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("gpu_mapper_mqtt_inbound_dropped_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = float(line.rsplit(" ", 1)[1])
    return out


def _acks(listener: Listener) -> list[dict[str, Any]]:
    return [json.loads(p) for t, p in listener.drain() if t.endswith("/desired/ack")]


@pytest.mark.timeout(60)
async def test_a_delta_flood_is_cut_to_the_devices_rate_its_newest_value_waits_and_the_rest_is_counted(
    mosquitto: Mosquitto, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sim, uuid0, _, settings = standalone(tmp_path, mosquitto.url)
    settings = replace(settings, inbound_rate_per_s=0.01, inbound_burst=3, inbound_max_bytes=4096)
    listener = Listener(mosquitto.port, "gpu-mapper/#")
    topic = "$hw/events/device/default/gpu0/twin/update/delta"
    caplog.set_level(logging.WARNING)
    now_ms = int(time.time() * 1000)
    try:
        async with running_app(settings, sim) as app:
            await wait_for(lambda: app.session is not None and app.session.subscribed, what="MQTT subscribed")
            await wait_for(lambda: app.registry.devices(), what="the Device loaded")
            # Too large: dropped unread, before the rate limit (its token is not spent).
            listener.publish(topic, b"{" + b" " * 5000 + b"}")
            for i in range(3):  # the burst: three deltas go through, the last one wins
                body = {"timestamp": now_ms + i, "delta": {"power_limit": str(250 + i)}}
                listener.publish(topic, json.dumps(body).encode())
            for i in range(20):  # the flood: its newest value waits (0.01/s refills nothing within this test)
                body = {"timestamp": now_ms + 10 + i, "delta": {"power_limit": str(400 + i)}}
                listener.publish(topic, json.dumps(body).encode())
            assert app.metrics is not None
            url = app.metrics.url
            # /metrics answers from the app's loop: read it from a thread while this loop runs on.
            deadline = time.monotonic() + 20
            while (seen := await asyncio.to_thread(_dropped, url)) != {"superseded": 19.0, "too-large": 1.0}:
                assert time.monotonic() < deadline, seen
                await asyncio.sleep(0.05)
            await wait_for(lambda: sim.gpu(uuid0).power_limit_w == 252, what="the burst's last delta applied")
            assert app.inbound.dropped == {"superseded": 19, "too-large": 1} and app.inbound.deferred == 1
            assert app.inbound.waiting("default/gpu0") == {"power_limit": Versioned("419", now_ms + 29)}
            assert sim.gpu(uuid0).power_limit_w == 252  # the flood's values wait for the device's rate
            # The first value that waited was acked pending/deferred (the ones that replaced it were dropped).
            deferred = await wait_for(
                lambda: [a for a in _acks(listener) if a["result"] == "pending" and a["reason"] == "deferred"],
                what="the deferred ack",
            )
            assert [(a["desired"], a["version_ms"], a["uuid"]) for a in deferred] == [("400", now_ms + 10, uuid0)]
    finally:
        listener.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "mapper.edge.kubeedge.doorlimit"]
    assert len(lines) == 1 and "default/gpu0 too-large x1" in lines[0], lines
    # Stopped while 419 W waited: it went into the desired store, which the next start enforces.
    store = DesiredStore(tmp_path / "data" / "desired.db")
    try:
        (stored,) = list(store.load_all())
        value = stored.state.get("power_limit")
        assert value is not None and (value.raw, value.source, value.version_ms) == ("419", "edge", now_ms + 29)
    finally:
        store.close()


@pytest.mark.timeout(120)
async def test_a_burst_of_300_changes_to_one_property_ends_with_the_last_applied_and_acked(
    mosquitto: Mosquitto, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The default limits (2/s, burst 20): what the burst's tokens let through is applied at once, the rest
    waits and the newest wins; every change is either applied (once, logged by the bindings) or superseded
    (counted at the door), and the last one is applied and acked."""
    sim, uuid0, _, settings = standalone(tmp_path, mosquitto.url)
    assert (settings.inbound_rate_per_s, settings.inbound_burst) == (2.0, 20)
    listener = Listener(mosquitto.port, "gpu-mapper/#")
    topic = "$hw/events/device/default/gpu0/twin/update/delta"
    changes = 300
    watts = [200 + i for i in range(changes)]  # every change a new value: each applied one changes the GPU
    caplog.set_level(logging.INFO, logger="mapper.edge.kubeedge.binding")
    now_ms = int(time.time() * 1000)
    try:
        async with running_app(settings, sim) as app:
            await wait_for(lambda: app.session is not None and app.session.subscribed, what="MQTT subscribed")
            await wait_for(lambda: app.registry.devices(), what="the Device loaded")
            for i, w in enumerate(watts):
                body = {"timestamp": now_ms + i, "delta": {"power_limit": str(w)}}
                listener.publish(topic, json.dumps(body).encode())
            last_version = now_ms + changes - 1

            def last_acked() -> list[dict[str, Any]]:
                return [
                    a
                    for a in _acks(listener)
                    if a["result"] == "applied" and a["version_ms"] == last_version and a["desired"] == "499"
                ]

            await wait_for(last_acked, timeout_s=30, what="the applied ack of the last change")
            assert sim.gpu(uuid0).power_limit_w == 499
            assert app.inbound.waiting("default/gpu0") == {}
            superseded = app.inbound.dropped.get("superseded", 0)
            applied = [
                r.getMessage()
                for r in caplog.records
                if r.getMessage() == "EventBus delta for default/gpu0: desired power_limit"
            ]
            assert superseded > 0
            assert len(applied) + superseded == changes, (len(applied), superseded)
            assert set(app.inbound.dropped) == {"superseded"}  # nothing else was dropped
            metrics = await asyncio.to_thread(_dropped, app.metrics.url if app.metrics else "")
            assert metrics == {"superseded": float(superseded)}
            # Each value that started to wait was acked pending/deferred with its own value and version.
            deferred = [a for a in _acks(listener) if a["result"] == "pending" and a["reason"] == "deferred"]
            assert len(deferred) == app.inbound.deferred > 0
            assert all(a["desired"] == str(200 + a["version_ms"] - now_ms) for a in deferred)
    finally:
        listener.close()


# --------------------------------------------------------------------------------------------------
# The DMI server's message size bound
# --------------------------------------------------------------------------------------------------


async def test_the_dmi_server_refuses_a_message_over_its_bound_before_parsing_it(sock_dir: str) -> None:
    registry = Registry(node_gpus=lambda: {"GPU-aaaaaaaa-0000-0000-0000-000000000001"})
    path = os.path.join(sock_dir, "gpu.sock")
    server = DmiServer(registry, lambda d: [], socket_path=path, max_message_bytes=64 * 1024)
    edge = FakeEdgeCore(os.path.join(sock_dir, "dmi.sock"))
    await server.start()
    try:
        small = pb_device("gpu0", "GPU-aaaaaaaa-0000-0000-0000-000000000001")
        big = pb_device("gpu1", "GPU-aaaaaaaa-0000-0000-0000-000000000001", config={"padding": "x" * 100_000})
        assert big.ByteSize() > 64 * 1024 > small.ByteSize()
        async with edge.mapper(path.encode()) as stub:
            await stub.RegisterDevice(pb.RegisterDeviceRequest(device=small), timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.RegisterDevice(pb.RegisterDeviceRequest(device=big), timeout=10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert [d.name for d in registry.devices()] == ["gpu0"]
    finally:
        await server.stop(0)
