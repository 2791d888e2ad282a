"""DmiClient and DmiReporter against the test EdgeCore over real Unix sockets."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Callable

import grpc
import grpc.aio
import pytest

from mapper.clock import FakeClock
from mapper.edge.kubeedge.dmi.client import DmiClient, DmiReporter, translate_rpc_error
from mapper.errors import PermanentError, TransientError
from mapper.shared.model import DeviceConfig, DeviceModelConfig, Twin
from tests.fake_edgecore import FakeEdgeCore, pb_device, pb_model, sock_dir

__all__ = ["sock_dir"]

UUIDS = [f"GPU-00000000-0000-0000-0000-00000000000{i}" for i in range(8)]


@pytest.fixture
async def edge(sock_dir: str) -> AsyncIterator[FakeEdgeCore]:
    core = FakeEdgeCore(os.path.join(sock_dir, "dmi.sock"))
    core.models = [pb_model()]
    core.devices = [pb_device(f"gpu{i}", UUIDS[i]) for i in range(3)]
    await core.start()
    try:
        yield core
    finally:
        await core.stop()


def make_client(edge: FakeEdgeCore, sock_dir: str, **kwargs: object) -> DmiClient:
    return DmiClient(
        edgecore_socket=edge.socket_path,
        mapper_socket=os.path.join(sock_dir, "gpu.sock"),
        timeout_s=2.0,
        **kwargs,  # type: ignore[arg-type]
    )


def fake_sleeper(clock: FakeClock) -> Callable[[float], object]:
    async def sleep(seconds: float) -> None:
        clock.advance(seconds)
        await asyncio.sleep(0)

    return sleep


async def wait_until(predicate: Callable[[], bool], timeout_s: float) -> float:
    """Real-time wait for something the client does on its own (returns the seconds it took)."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(0.02)
    return time.monotonic() - start


async def test_register_sends_with_data_protocol_gpu_and_the_raw_socket_path(edge: FakeEdgeCore, sock_dir: str) -> None:
    client = make_client(edge, sock_dir, version="1.2.3")
    try:
        reply = await client.register()
    finally:
        await client.close()
    (request,) = edge.rec.registers
    assert request.withData is True
    assert request.mapper.protocol == "gpu"
    assert request.mapper.address == os.path.join(sock_dir, "gpu.sock").encode()
    assert not request.mapper.address.startswith(b"unix:")
    assert request.mapper.name == "gpu-mapper"
    assert request.mapper.version == "1.2.3"
    assert request.mapper.api_version == "v1beta1"
    assert request.mapper.state == "ok"
    assert [d.name for d in reply.devices] == ["gpu0", "gpu1", "gpu2"]
    assert reply.devices[0].uuid == UUIDS[0]
    assert [m.key for m in reply.models] == ["default/nvidia-gpu"]  # EdgeCore sent it three times


async def test_register_skips_a_device_that_does_not_convert_and_keeps_the_others(
    edge: FakeEdgeCore, sock_dir: str
) -> None:
    edge.devices.append(pb_device("weird", None, config={"uuid": 5}))
    client = make_client(edge, sock_dir)
    try:
        reply = await client.register()
    finally:
        await client.close()
    assert [d.name for d in reply.devices] == ["gpu0", "gpu1", "gpu2"]
    assert len(reply.rejected) == 1
    key, why = reply.rejected[0]
    assert key == "default/weird" and "uuid must be a string" in why


async def test_reports_carry_every_twin_with_both_fields_and_the_namespace(edge: FakeEdgeCore, sock_dir: str) -> None:
    client = make_client(edge, sock_dir)
    twins = [Twin("temperature", "", "61"), Twin("power_limit", "300", "300"), Twin("power_usage", "", "")]
    try:
        await client.report_status("default", "gpu0", twins)
        await client.report_state("default", "gpu0", "online")
    finally:
        await client.close()
    assert edge.rec.violations == [] and edge.rec.twin_rejections == []
    (status,) = edge.rec.statuses
    assert status.deviceNamespace == "default" and status.deviceName == "gpu0"
    got = [(t.propertyName, t.observedDesired.value, t.reported.value) for t in status.reportedDevice.twins]
    assert got == [("temperature", "", "61"), ("power_limit", "300", "300"), ("power_usage", "", "")]
    assert all(t.HasField("observedDesired") and t.HasField("reported") for t in status.reportedDevice.twins)
    (state,) = edge.rec.states
    assert (state.deviceNamespace, state.deviceName, state.state) == ("default", "gpu0", "online")
    assert client.rpc_counts == {"ReportDeviceStatus": {"ok": 1}, "ReportDeviceStates": {"ok": 1}}
    assert client.channels_opened == 1


async def test_an_empty_twin_list_or_a_foreign_state_is_refused_before_any_rpc(
    edge: FakeEdgeCore, sock_dir: str
) -> None:
    client = make_client(edge, sock_dir)
    try:
        with pytest.raises(PermanentError, match="at least one twin"):
            await client.report_status("default", "gpu0", [])
        with pytest.raises(ValueError, match="'disconnected' is not one of"):
            await client.report_state("default", "gpu0", "disconnected")
    finally:
        await client.close()
    assert edge.rec.statuses == [] and edge.rec.states == [] and edge.rec.call_times == []
    assert client.rpc_counts == {}


async def test_edgecore_down_gives_a_transient_error_and_marks_the_client_unregistered(sock_dir: str) -> None:
    client = DmiClient(edgecore_socket=os.path.join(sock_dir, "absent.sock"), timeout_s=1.0)
    client.registered = True
    try:
        with pytest.raises(TransientError) as info:
            await client.report_state("default", "gpu0", "online")
    finally:
        await client.close()
    assert "ReportDeviceStates" in str(info.value) and "absent.sock" in str(info.value)
    assert client.registered is False
    assert client.rpc_counts == {"ReportDeviceStates": {"unavailable": 1}}
    assert "UNAVAILABLE" in client.last_error


async def test_edgecore_rate_limit_becomes_a_transient_error_with_a_longer_retry(sock_dir: str) -> None:
    core = FakeEdgeCore(os.path.join(sock_dir, "dmi.sock"), burst=1)
    await core.start()
    client = make_client(core, sock_dir)
    try:
        await client.report_state("default", "gpu0", "online")
        with pytest.raises(TransientError) as info:
            await client.report_state("default", "gpu0", "online")
    finally:
        await client.close()
        await core.stop()
    assert info.value.reason == "rate-limited"
    assert info.value.retry_after_s >= 5
    assert client.rpc_counts["ReportDeviceStates"] == {"ok": 1, "rate_limited": 1}


def test_other_rpc_errors_become_permanent_errors_naming_method_and_socket() -> None:
    exc = grpc.aio.AioRpcError(
        grpc.StatusCode.UNKNOWN, grpc.aio.Metadata(), grpc.aio.Metadata(), "device gpu0 not found", None
    )
    err = translate_rpc_error("ReportDeviceStatus", "/etc/kubeedge/dmi.sock", exc)
    assert isinstance(err, PermanentError)
    assert "ReportDeviceStatus" in str(err) and "/etc/kubeedge/dmi.sock" in str(err) and "not found" in str(err)
    timeout = grpc.aio.AioRpcError(
        grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(), "deadline", None
    )
    assert isinstance(translate_rpc_error("MapperRegister", "x", timeout), TransientError)


async def test_run_registers_and_hands_devices_and_models_to_the_callback(edge: FakeEdgeCore, sock_dir: str) -> None:
    seen: list[tuple[list[DeviceConfig], list[DeviceModelConfig]]] = []

    async def on_registered(
        devices: list[DeviceConfig], models: list[DeviceModelConfig], rejected: list[tuple[str, str]]
    ) -> None:
        seen.append((devices, models))

    client = make_client(edge, sock_dir, on_registered=on_registered)
    task = asyncio.create_task(client.run())
    try:
        await wait_until(lambda: bool(seen), 5)
    finally:
        await client.close()
        await asyncio.wait_for(task, 5)
    devices, models = seen[0]
    assert client.registered is True
    assert [d.name for d in devices] == ["gpu0", "gpu1", "gpu2"]
    assert [m.name for m in models] == ["nvidia-gpu"]


async def test_edgecore_restart_leads_to_reregistration_within_five_seconds(edge: FakeEdgeCore, sock_dir: str) -> None:
    client = make_client(edge, sock_dir)
    task = asyncio.create_task(client.run())
    try:
        await wait_until(lambda: client.registered, 5)
        old_socket = edge.identity()
        await edge.restart()
        assert edge.identity() != old_socket
        took_s = await wait_until(lambda: len(edge.rec.registers) >= 2 and client.registered, 5)
        assert took_s < 5
        await client.report_state("default", "gpu0", "online")  # the link works again
    finally:
        await client.close()
        await asyncio.wait_for(task, 5)
    assert client.registrations == 2
    assert task.exception() is None


async def test_a_vanished_socket_is_survived_and_registration_follows_its_return(
    edge: FakeEdgeCore, sock_dir: str
) -> None:
    client = make_client(edge, sock_dir)
    steps: list[float] = []
    step = client.step

    async def counting_step() -> None:
        steps.append(time.monotonic())
        await step()

    client.step = counting_step  # type: ignore[method-assign]
    task = asyncio.create_task(client.run())
    try:
        await wait_until(lambda: client.registered, 5)
        await edge.stop()
        await wait_until(lambda: not client.registered, 5)
        assert "missing" in client.last_error
        polls = len(steps)
        await wait_until(lambda: len(steps) >= polls + 2, 10)  # two more polls with nothing there
        assert not task.done()
        await edge.start()
        took_s = await wait_until(lambda: client.registered, 5)
        assert took_s < 5
    finally:
        await client.close()
        await asyncio.wait_for(task, 5)
    assert len(edge.rec.registers) == 2


async def test_a_stale_socket_file_with_nobody_behind_it_does_not_crash_the_loop(sock_dir: str) -> None:
    import socket

    path = os.path.join(sock_dir, "dmi.sock")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()  # the file stays, nobody listens
    client = DmiClient(edgecore_socket=path, mapper_socket=os.path.join(sock_dir, "gpu.sock"), timeout_s=1.0)
    task = asyncio.create_task(client.run())
    try:
        await wait_until(lambda: client.rpc_counts.get("MapperRegister", {}).get("unavailable", 0) >= 1, 5)
        assert not client.registered and not task.done()
        core = FakeEdgeCore(path)
        await core.start()  # replaces the stale file: a new inode
        try:
            took_s = await wait_until(lambda: client.registered, 5)
        finally:
            await core.stop()
    finally:
        await client.close()
        await asyncio.wait_for(task, 5)
    assert took_s < 5


async def test_run_reregisters_periodically_on_fake_time(sock_dir: str) -> None:
    clock = FakeClock()
    core = FakeEdgeCore(os.path.join(sock_dir, "dmi.sock"), now=clock.monotonic)
    await core.start()
    client = make_client(core, sock_dir, clock=clock, sleep=fake_sleeper(clock), reregister_interval_s=300.0)
    task = asyncio.create_task(client.run())
    try:
        await wait_until(lambda: len(core.rec.registers) >= 3, 10)
    finally:
        await client.close()
        await asyncio.wait_for(task, 5)
        await core.stop()
    first, second, third = core.rec.call_times[:3]
    assert 300 <= second - first <= 301
    assert 300 <= third - second <= 301
    assert client.channels_opened == 1


async def test_reporter_over_real_sockets_keeps_eight_gpus_within_the_limit_on_fake_time(sock_dir: str) -> None:
    """10 minutes of fake time: 8 devices offer fresh twins every second, EdgeCore enforces 1/s burst 100 on
    the same fake clock. Nothing is refused and every twin report carries the value offered last."""
    clock = FakeClock()
    core = FakeEdgeCore(os.path.join(sock_dir, "dmi.sock"), now=clock.monotonic)
    await core.start()
    client = make_client(core, sock_dir, clock=clock)
    reporter = DmiReporter(client)
    latest: dict[str, str] = {}
    try:
        await client.register()
        client.registered = True
        for second in range(600):
            for d in range(8):
                latest[f"gpu{d}"] = str(second)
                reporter.offer_status("default", f"gpu{d}", [Twin("temperature", "", str(second))])
            if second % 60 == 0:
                reporter.offer_state("default", "gpu0", "online")
            for _ in range(4):
                before = {k: v for k, v in latest.items()}
                count_before = len(core.rec.statuses)
                await reporter.send_ready()
                for status in core.rec.statuses[count_before:]:
                    assert status.reportedDevice.twins[0].reported.value == before[status.deviceName]
                clock.advance(0.25)
    finally:
        await client.close()
        await core.stop()
    assert core.rec.refused == []
    assert core.rec.violations == []
    total = len(core.rec.call_times)
    assert total <= 0.8 * 600 + 10 + 1  # + the MapperRegister
    assert total >= 0.8 * 600 - 2
    assert reporter.sent["state"] == 10
    assert reporter.scheduler.stats.coalesced > 3000


async def test_prompt_reports_go_before_start_ups_and_keep_within_a_burst_10_edgecore_on_fake_time(
    sock_dir: str,
) -> None:
    """Start-up offers every one of 8 devices' first twins and state (periodic); right after the first send,
    all 8 change (prompt). The 8 prompt reports reach EdgeCore in the same fake second, before start-up's
    states; EdgeCore (1/s, burst 10: as if other mappers had spent 90 of its tokens) refuses nothing."""
    clock = FakeClock()
    core = FakeEdgeCore(os.path.join(sock_dir, "dmi.sock"), now=clock.monotonic, burst=10)
    await core.start()
    client = make_client(core, sock_dir, clock=clock)
    reporter = DmiReporter(client)
    try:
        await client.register()
        client.registered = True
        for d in range(8):
            reporter.offer_state("default", f"gpu{d}", "online")
            reporter.offer_status("default", f"gpu{d}", [Twin("power_limit", "", "700")])
        assert await reporter.send_ready() == 1, "start-up's reports leave a token per device"
        assert reporter.next_wait_s() == pytest.approx(1.25)
        clock.advance(0.2)
        changed_at = clock.monotonic()
        for d in range(8):
            reporter.offer_status("default", f"gpu{d}", [Twin("power_limit", "400", "400")], prompt=True)
        assert await reporter.send_ready() == 8
        prompt_at = core.rec.call_times[-8:]
        assert all(t - changed_at < 1.0 for t in prompt_at)
        assert {s.deviceName for s in core.rec.statuses[-8:]} == {f"gpu{d}" for d in range(8)}
        assert all(s.reportedDevice.twins[-1].reported.value == "400" for s in core.rec.statuses[-8:])
        assert core.rec.states == [], "start-up's states wait behind the prompt reports"
        for _ in range(400):  # 100 s: the rest of start-up as the budget refills
            await reporter.send_ready()
            clock.advance(0.25)
    finally:
        await client.close()
        await core.stop()
    assert core.rec.refused == [] and core.rec.violations == []
    assert sorted(s.deviceName for s in core.rec.states) == [f"gpu{d}" for d in range(8)]
    assert reporter.scheduler.pending == 0
    assert reporter.scheduler.stats.popped_prompt == 8


async def test_reporter_holds_reports_during_an_outage_and_then_sends_only_the_latest(sock_dir: str) -> None:
    clock = FakeClock()
    core = FakeEdgeCore(os.path.join(sock_dir, "dmi.sock"), now=clock.monotonic)
    client = make_client(core, sock_dir, clock=clock)
    reporter = DmiReporter(client)
    try:
        reporter.offer_status("default", "gpu0", [Twin("temperature", "", "50")])
        await reporter.send_ready()  # not registered: nothing goes out
        assert reporter.scheduler.pending == 1
        for value in range(51, 80):
            reporter.offer_status("default", "gpu0", [Twin("temperature", "", str(value))])
        reporter.offer_state("default", "gpu0", "offline")
        reporter.offer_state("default", "gpu0", "online")
        await core.start()
        await client.step()
        assert client.registered
        assert await reporter.send_ready() == 2
    finally:
        await client.close()
        await core.stop()
    assert [s.state for s in core.rec.states] == ["online"]
    assert [s.reportedDevice.twins[0].reported.value for s in core.rec.statuses] == ["79"]


async def test_reporter_requeues_after_edgecore_vanishes_mid_run(sock_dir: str) -> None:
    clock = FakeClock()
    core = FakeEdgeCore(os.path.join(sock_dir, "dmi.sock"), now=clock.monotonic)
    await core.start()
    client = make_client(core, sock_dir, clock=clock)
    reporter = DmiReporter(client)
    try:
        await client.step()
        await core.stop()
        reporter.offer_status("default", "gpu0", [Twin("temperature", "", "50")])
        assert await reporter.send_ready() == 0
        assert reporter.failed["status"] == 1
        assert not client.registered
        assert reporter.scheduler.pending == 1  # kept, not lost
        await core.start()
        clock.advance(1.0)
        await client.step()
        assert await reporter.send_ready() == 1
    finally:
        await client.close()
        await core.stop()
    assert [s.reportedDevice.twins[0].reported.value for s in core.rec.statuses] == ["50"]


async def test_reporter_refuses_a_state_edgecore_would_drop(edge: FakeEdgeCore, sock_dir: str) -> None:
    reporter = DmiReporter(make_client(edge, sock_dir))
    with pytest.raises(ValueError, match="'gone' is not one of"):
        reporter.offer_state("default", "gpu0", "gone")
    assert reporter.scheduler.pending == 0


async def test_reporter_run_loop_sends_offers_in_real_time(edge: FakeEdgeCore, sock_dir: str) -> None:
    client = make_client(edge, sock_dir)
    reporter = DmiReporter(client, idle_poll_s=0.05)
    tasks = [asyncio.create_task(client.run()), asyncio.create_task(reporter.run())]
    try:
        await wait_until(lambda: client.registered, 5)
        reporter.offer_status("default", "gpu1", [Twin("temperature", "", "70")])
        await wait_until(lambda: len(edge.rec.statuses) == 1, 5)
    finally:
        reporter.stop()
        await client.close()
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert edge.rec.statuses[0].deviceName == "gpu1"


async def test_an_idle_reporter_sleeps_long_and_an_offer_wakes_it_at_once(edge: FakeEdgeCore, sock_dir: str) -> None:
    client = make_client(edge, sock_dir)
    reporter = DmiReporter(client, idle_wait_s=30.0)
    assert reporter.next_wait_s() == reporter.idle_poll_s, "not registered yet: look again soon"
    # What the run loop decided to sleep, each time: it calls this just before it goes to sleep.
    waits: list[float] = []
    next_wait_s = reporter.next_wait_s

    def recorded() -> float:
        waits.append(next_wait_s())
        return waits[-1]

    reporter.next_wait_s = recorded  # type: ignore[method-assign]
    tasks = [asyncio.create_task(client.run()), asyncio.create_task(reporter.run())]
    try:
        await wait_until(lambda: client.registered, 5)
        assert next_wait_s() == 30.0, "registered, nothing pending: no polling"
        # The loop is asleep now, with 30 s to go: it chose that wait (and sleeps in the same step, so by the time
        # this task runs again it is asleep). No head start by the clock: that could end inside a short poll wait.
        await wait_until(lambda: 30.0 in waits, 10)
        reporter.offer_state("default", "gpu1", "online")
        await wait_until(lambda: len(edge.rec.states) == 1, 10)  # well before the 30 s: the offer woke it
    finally:
        reporter.stop()
        await client.close()
        await asyncio.wait_for(asyncio.gather(*tasks), 5)


async def test_reporter_leaves_out_a_twin_devicetwin_would_reject_and_sends_the_rest(
    edge: FakeEdgeCore, sock_dir: str
) -> None:
    client = make_client(edge, sock_dir)
    reporter = DmiReporter(client)
    try:
        await client.step()
        reporter.offer_status(
            "default", "gpu0", [Twin("temperature", "", "61"), Twin("product_name", "", "NVIDIA H100 80GB")]
        )
        reporter.offer_status("default", "gpu1", [Twin("product_name", "", "has space")])
        assert await reporter.send_ready() == 1
    finally:
        await client.close()
    (status,) = edge.rec.statuses
    assert [t.propertyName for t in status.reportedDevice.twins] == ["temperature"]
    assert edge.rec.twin_rejections == []
    assert reporter.dropped_twins == 2
    assert reporter.dropped == 1
    assert "no twin left" in reporter.last_error


async def test_register_spends_a_token_of_the_node_wide_budget(edge: FakeEdgeCore, sock_dir: str) -> None:
    clock = FakeClock()
    client = make_client(edge, sock_dir, clock=clock, rate_per_s=0.5, burst=2)
    try:
        for _ in range(3):
            await client.register()
    finally:
        await client.close()
    assert client.bucket.tokens == pytest.approx(-1.0)
    assert client.bucket.wait_s() == pytest.approx(4.0)


async def test_closing_the_client_during_a_call_ends_run_quietly(edge: FakeEdgeCore, sock_dir: str) -> None:
    edge.register_gate = asyncio.Event()  # EdgeCore holds the MapperRegister call
    client = make_client(edge, sock_dir)
    task = asyncio.create_task(client.run())
    try:
        await wait_until(lambda: len(edge.rec.registers) == 1, 5)
        await client.close()
        await asyncio.wait_for(task, 5)
    finally:
        edge.register_gate.set()
    assert task.exception() is None
    assert client.rpc_counts == {"MapperRegister": {"cancelled": 1}}
    assert not client.registered
