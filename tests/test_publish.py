"""Publisher with a real mosquitto, a real MQTT session and a real SQLite buffer: acks and policy events go out
at once while the broker is up, are kept in the buffer while it is down and arrive, in order, when it is back;
fire-and-forget messages are dropped while it is down, never kept."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from mapper.clock import SystemClock
from mapper.edge.control.policy import PolicyEvent
from mapper.edge.control.reconcile import Ack
from mapper.edge.outbox.publish import Publisher
from mapper.edge.outbox.shipper import TelemetryShipper
from mapper.edge.outbox.streams import TelemetryStreams
from mapper.edge.storage.buffer import Buffer
from mapper.net.mqtt import MqttSession
from tests.brokers import Mosquitto


async def until(cond: Callable[[], object], what: str, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def subscribed(listener: MqttSession, got: list[tuple[str, dict]]) -> None:
    """Wait until the listener's subscription is live (its own probe comes back), then forget the probes."""
    for i in range(200):
        await listener.publish(f"gpu-mapper/probe/{i}", b"{}", qos=1, timeout_s=5)
        deadline = asyncio.get_running_loop().time() + 0.1
        while asyncio.get_running_loop().time() < deadline:
            if any(t.startswith("gpu-mapper/probe/") for t, _ in got):
                got[:] = [(t, d) for t, d in got if not t.startswith("gpu-mapper/probe/")]
                return
            await asyncio.sleep(0.01)
    raise AssertionError("the listener's subscription never came live")


def ack(value: int, ts_ms: int) -> Ack:
    return Ack(
        uuid="GPU-1",
        property="power_limit",
        desired=str(value),
        source="cloud",
        version_ms=ts_ms,
        result="applied",
        reason="",
        applied_at_ms=ts_ms,
        effective_value=str(value),
        reported_value=str(value),
        ts_ms=ts_ms,
    )


@pytest.fixture
async def session(mosquitto: Mosquitto) -> AsyncIterator[MqttSession]:
    s = MqttSession(mosquitto.url, "mapper-edge1", reconnect_min_s=0.05, reconnect_max_s=0.2)
    await s.start()
    yield s
    await s.stop(2)


@pytest.fixture
async def listener(mosquitto: Mosquitto) -> AsyncIterator[tuple[MqttSession, list[tuple[str, dict]]]]:
    got: list[tuple[str, dict]] = []
    s = MqttSession(mosquitto.url, "listener", reconnect_min_s=0.05, reconnect_max_s=0.2)
    s.subscribe("gpu-mapper/#", lambda topic, payload: got.append((topic, json.loads(payload))))
    await s.start()
    assert await s.wait_connected(5)
    yield s, got
    await s.stop(2)


@pytest.mark.timeout(60)
async def test_acks_and_events_are_published_at_once_and_kept_while_the_broker_is_down(
    tmp_path: Path, mosquitto: Mosquitto, session: MqttSession, listener: tuple[MqttSession, list[tuple[str, dict]]]
) -> None:
    listener_session, got = listener
    clock = SystemClock()
    buf = Buffer(tmp_path / "buf.db", max_bytes=10_000_000, max_age_s=10**9, clock=clock)
    gate = asyncio.Event()  # replay waits for the listener to be subscribed again (it is a clean session)
    gate.set()

    async def gated(topic: str, payload: bytes, qos: int = 1, retain: bool = False, timeout_s: float = 10) -> None:
        await asyncio.wait_for(gate.wait(), 30)
        await session.publish(topic, payload, qos, retain, timeout_s)

    shipper = TelemetryShipper(buf, gated, node="edge1", clock=clock, retry_s=0.2)
    session.add_on_connect(shipper.notify_connected)
    streams = TelemetryStreams("edge1", "0badf00d", shipper, clock=clock, window_s=2.0)
    rounds: list[int] = []
    store_round = streams.store_round
    streams.store_round = lambda: rounds.append(len(rounds)) or store_round()  # type: ignore[method-assign]
    publisher = Publisher("edge1", session, clock=clock, outbox=streams)
    task = asyncio.create_task(shipper.run())
    try:
        assert await session.wait_connected(5)
        await subscribed(listener_session, got)
        event = PolicyEvent(policy="thermal", action="engage", reason="95 C >= 90 C", uuid="GPU-1")
        publisher.publish_step("default/gpu0", "GPU-1", [ack(400, 1)], [event])
        await until(lambda: len(got) == 2, "the ack and the event")
        topics = [t for t, _ in got]
        assert topics == ["gpu-mapper/edge1/default/gpu0/desired/ack", "gpu-mapper/edge1/default/gpu0/events"]
        assert got[0][1]["result"] == "applied" and got[0][1]["desired"] == "400"
        assert got[1][1]["policy"] == "thermal" and got[1][1]["device"] == "default/gpu0"
        assert publisher.policy_events == {("thermal", "engage"): 1}
        assert shipper.submitted_messages == 0 and rounds == [], "nothing kept while the broker is up"

        gate.clear()
        mosquitto.stop()
        await until(lambda: not session.connected, "the session to notice the broker is gone")
        publisher.publish_step("default/gpu0", "GPU-1", [ack(350, 2), ack(300, 3)], [])
        publisher.publish_soon("$hw/events/device/default/gpu0/twin/update", b"{}")
        assert shipper.submitted_messages == 2, "both acks kept"
        assert len(rounds) == 2, "each kept message first lets the round's batches be stored"
        assert publisher.tasks() == [], "nothing in flight: the twin was dropped, not kept"

        got.clear()
        mosquitto.start()
        await until(lambda: listener_session.connected and session.connected, "both sessions back")
        await subscribed(listener_session, got)
        gate.set()
        await until(lambda: len(got) >= 2, "the kept acks after the broker came back", timeout_s=20)
        desired = [d["desired"] for t, d in got if t.endswith("/desired/ack")]
        assert desired[:2] == ["350", "300"], "in the order they were made"
        assert not [t for t, _ in got if "twin" in t]
    finally:
        await shipper.stop(2)
        task.cancel()
        buf.close()


async def test_without_a_broker_nothing_is_published_or_kept(tmp_path: Path) -> None:
    clock = SystemClock()
    buf = Buffer(tmp_path / "buf.db", max_bytes=10_000_000, max_age_s=10**9, clock=clock)

    async def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("no publish without a broker")

    shipper = TelemetryShipper(buf, never, node="edge1", clock=clock)
    streams = TelemetryStreams("edge1", "0badf00d", shipper, clock=clock, window_s=2.0)
    publisher = Publisher("edge1", None, clock=clock, outbox=streams)
    publisher.publish_step("default/gpu0", "GPU-1", [ack(400, 1)], [])
    publisher.publish_soon("gpu-mapper/edge1/status", b"online")
    assert shipper.submitted_messages == 0 and publisher.tasks() == []
    await publisher.publish_offline()
    buf.close()
