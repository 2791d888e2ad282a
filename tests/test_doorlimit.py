"""Limits at the doors: per-device token buckets on messages from the broker (unit, and the whole mapper against
a real mosquitto), and the size bound of the mapper's own DMI server over a real Unix socket."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from mapper.clock import FakeClock
from mapper.edge.config import load_settings
from mapper.edge.kubeedge.dmi.pb import dmi_pb2 as pb
from mapper.edge.kubeedge.dmi.server import DmiServer
from mapper.edge.kubeedge.doorlimit import InboundLimiter
from mapper.edge.kubeedge.registry import Registry
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


@pytest.mark.timeout(60)
async def test_a_delta_flood_is_cut_to_the_devices_rate_and_the_excess_counted(
    mosquitto: Mosquitto, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sim, uuid0, _, settings = standalone(tmp_path, mosquitto.url)
    settings = replace(settings, inbound_rate_per_s=0.01, inbound_burst=3, inbound_max_bytes=4096)
    listener = Listener(mosquitto.port, "gpu-mapper/#")
    topic = "$hw/events/device/default/gpu0/twin/update/delta"
    caplog.set_level(logging.WARNING)
    try:
        async with running_app(settings, sim) as app:
            await wait_for(lambda: app.session is not None and app.session.subscribed, what="MQTT subscribed")
            await wait_for(lambda: app.registry.devices(), what="the Device loaded")
            # Too large: dropped unread, before the rate limit (its token is not spent).
            listener.publish(topic, b"{" + b" " * 5000 + b"}")
            now_ms = int(time.time() * 1000)
            for i in range(3):  # the burst: three deltas go through, the last one wins
                body = {"timestamp": now_ms + i, "delta": {"power_limit": str(250 + i)}}
                listener.publish(topic, json.dumps(body).encode())
            for i in range(20):  # the flood: all dropped (0.01/s refills nothing within this test)
                body = {"timestamp": now_ms + 10 + i, "delta": {"power_limit": "400"}}
                listener.publish(topic, json.dumps(body).encode())
            assert app.metrics is not None
            url = app.metrics.url
            # /metrics answers from the app's loop: read it from a thread while this loop runs on.
            deadline = time.monotonic() + 20
            while (seen := await asyncio.to_thread(_dropped, url)) != {"rate-limited": 20.0, "too-large": 1.0}:
                assert time.monotonic() < deadline, seen
                await asyncio.sleep(0.05)
            await wait_for(lambda: sim.gpu(uuid0).power_limit_w == 252, what="the burst's last delta applied")
            assert app.inbound.dropped == {"rate-limited": 20, "too-large": 1}
            assert sim.gpu(uuid0).power_limit_w == 252  # none of the flood's 400 W reached the GPU
    finally:
        listener.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "mapper.edge.kubeedge.doorlimit"]
    assert len(lines) == 1 and "default/gpu0 too-large x1" in lines[0], lines


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
