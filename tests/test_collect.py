"""GpuWorker's schedule: every property on its own collect cycle, sampled together when due together; the
Collector handing each step to its consumers."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pynvml
import pytest

from mapper.clock import FakeClock, SystemClock
from mapper.edge.control.collect import DUE_SLACK_S, Collector, GpuWorker, TickResult, unbound_device
from mapper.edge.control.policy import PolicyEngine
from mapper.edge.control.reconcile import Reconciler
from mapper.edge.gpu.nvml import NvmlBackend
from mapper.edge.gpu.simnvml import SimNvml
from mapper.edge.outbox.shipper import TelemetryShipper
from mapper.edge.outbox.streams import TelemetryStreams
from mapper.edge.storage.buffer import Buffer
from mapper.shared.model import NVML_PROPERTIES, PROPERTY_BY_NAME, DeviceConfig, DeviceProperty, GpuEvent, Sample
from tests.apphelpers import wait_for


class Recording:
    """The backend as GpuWorker sees it, recording which properties each sample asked for."""

    def __init__(self, backend: NvmlBackend) -> None:
        self.backend = backend
        self.asked: list[set[str]] = []

    def sample(self, uuid: str, properties: Iterable[str] | None = None) -> Sample:
        names = set(properties or ())
        self.asked.append(names)
        return self.backend.sample(uuid, names)

    def __getattr__(self, name: str) -> Any:
        if name == "call_async":  # its calls go through call_in_thread, so sample() is the recorded one
            raise AttributeError(name)
        return getattr(self.backend, name)


def make_worker(backend: NvmlBackend, clock: FakeClock, seen_as: Any = None) -> GpuWorker:
    """A GpuWorker for the backend's first GPU; ``seen_as``: the backend object the worker calls instead."""
    info = backend.list_gpus()[0]
    return GpuWorker(
        info=info,
        backend=seen_as if seen_as is not None else backend,
        reconciler=Reconciler(backend, info.uuid, clock=clock),
        policies=PolicyEngine(),
        clock=clock,
    )


@pytest.fixture
def rig() -> Iterable[tuple[GpuWorker, Recording, SimNvml, FakeClock]]:
    clock = FakeClock()
    sim = SimNvml(1, "H100", seed=0, clock=clock.monotonic)
    backend = NvmlBackend(sim, clock=clock)
    backend.init()
    recording = Recording(backend)
    worker = make_worker(backend, clock, recording)
    yield worker, recording, sim, clock
    backend.shutdown()


def device(gpu_uuid: str, **cycles_ms: int) -> DeviceConfig:
    props = tuple(DeviceProperty(name, collect_cycle_ms=ms) for name, ms in cycles_ms.items())
    return DeviceConfig("default", "gpu-0", "gpu-model", gpu_uuid, properties=props)


async def test_each_property_is_sampled_on_its_own_collect_cycle(rig: Any) -> None:
    worker, recording, _, clock = rig
    worker.bind(device(worker.uuid, temperature=1000, memory_total=5000))
    seen: dict[str, list[int]] = {"temperature": [], "memory_total": []}
    for second in range(11):
        await worker.tick()
        for name, seconds in seen.items():
            if recording.asked and name in recording.asked[-1]:
                seconds.append(second)
        recording.asked.clear()
        clock.advance(1.0)
    assert seen["temperature"] == list(range(11))
    assert seen["memory_total"] == [0, 5, 10]
    assert worker.values["memory_total"] > 0


async def test_the_first_tick_samples_every_nvml_property_of_the_catalog(rig: Any) -> None:
    worker, recording, _, _ = rig
    worker.bind(device(worker.uuid, temperature=1000))
    await worker.tick()
    assert recording.asked[0] == {p.name for p in NVML_PROPERTIES}


async def test_properties_a_device_does_not_list_keep_the_catalogs_cycle(rig: Any) -> None:
    worker, recording, _, clock = rig
    worker.bind(device(worker.uuid, temperature=1000))
    slow = PROPERTY_BY_NAME["product_name"].collect_cycle_ms / 1000
    assert slow > 1.0  # the catalog samples identity rarely
    await worker.tick()
    clock.advance(1.0)
    recording.asked.clear()
    await worker.tick()
    assert "temperature" in recording.asked[0]
    assert "product_name" not in recording.asked[0]


def test_a_device_asking_for_faster_than_the_floor_gets_the_floor(rig: Any) -> None:
    worker, _, _, _ = rig
    worker.min_collect_cycle_ms = 2000
    worker.bind(device(worker.uuid, temperature=100))
    assert worker.cycle_ms("temperature") == 2000


async def test_next_due_is_the_earliest_group_and_properties_due_within_the_slack_come_along(rig: Any) -> None:
    worker, recording, _, clock = rig
    worker.bind(device(worker.uuid, temperature=1000, power_usage=2000))
    await worker.tick()
    start = clock.monotonic()
    assert worker.next_due_s() == pytest.approx(start + 1.0)
    clock.advance(2.0 - DUE_SLACK_S / 2)  # power_usage is due a hair later: read in this tick too
    recording.asked.clear()
    await worker.tick()
    assert {"temperature", "power_usage"} <= recording.asked[0]


def test_the_same_groups_due_give_the_same_tuple_object(rig: Any) -> None:
    """The backend caches its reading plan by the names it is given: an unchanged schedule must not build a
    new tuple every tick."""
    worker, _, _, clock = rig
    worker.bind(device(worker.uuid, temperature=1000))
    now = clock.monotonic()
    first = worker.due_properties(now)
    assert first is worker.due_properties(now)
    assert set(first) == {p.name for p in NVML_PROPERTIES}


async def test_a_failed_sample_is_retried_after_the_errors_retry_time_not_a_whole_cycle(rig: Any) -> None:
    worker, _, sim, clock = rig
    worker.bind(device(worker.uuid, **{p.name: 10_000 for p in NVML_PROPERTIES}))
    await worker.tick()
    assert worker.next_due_s() == pytest.approx(clock.monotonic() + 10.0)
    clock.advance(10.0)
    sim.inject_errors("*", pynvml.NVML_ERROR_TIMEOUT, count=1)  # NVML timed out: transient, retry in 1 s
    result = await worker.tick()
    assert "Timeout" in result.error or "timed out" in result.error.lower()
    assert result.sample is None
    assert worker.collect_errors == 1
    assert worker.next_due_s() == pytest.approx(clock.monotonic() + 1.0)
    clock.advance(1.0)
    result = await worker.tick()
    assert result.error == ""
    assert result.sample is not None and "temperature" in result.sample.values
    # The retry was off the grid; once it succeeds the group is back on it (in step with the other GPUs).
    assert worker.next_due_s() == pytest.approx(1020.0)


async def test_a_driver_reload_makes_everything_due_at_once(rig: Any) -> None:
    worker, recording, _, clock = rig
    worker.bind(device(worker.uuid, temperature=1000))
    await worker.tick()
    clock.advance(1.0)
    await worker.tick()
    worker.driver_reloaded()
    assert worker.next_due_s() <= clock.monotonic()
    recording.asked.clear()
    await worker.tick()
    assert recording.asked[0] == {p.name for p in NVML_PROPERTIES}


async def test_binding_another_device_applies_its_cycles_at_once(rig: Any) -> None:
    worker, recording, _, clock = rig
    worker.bind(device(worker.uuid, temperature=1000))
    await worker.tick()
    worker.bind(device(worker.uuid, temperature=3000))
    assert worker.cycle_ms("temperature") == 3000
    recording.asked.clear()
    read_at: list[float] = []
    for _ in range(8):
        await worker.tick()  # the first: everything due again on a new binding
        if "temperature" in recording.asked[-1]:
            read_at.append(clock.monotonic())
        clock.advance(1.0)
    assert read_at[0] == 1000.0
    assert read_at[1:] == [1002.0, 1005.0]  # then on the 3 s grid


async def test_gpus_whose_loops_started_apart_fall_due_at_the_same_instant(rig: Any) -> None:
    """Due times lie on a grid of the cycle, so the GPUs' loops wake together (one NVML job for all)."""
    worker, _, _, clock = rig
    other = GpuWorker(
        info=worker.info,
        backend=worker.backend,
        reconciler=worker.reconciler,
        policies=PolicyEngine(),
        clock=clock,
    )
    worker.bind(device(worker.uuid, temperature=1000))
    other.bind(device(worker.uuid, temperature=1000))
    clock.advance(0.3)
    await worker.tick()
    clock.advance(0.41)
    await other.tick()
    assert worker.next_due_s() == other.next_due_s() == pytest.approx(1001.0)
    clock.advance(1001.02 - clock.monotonic())  # a late tick keeps to the grid
    await worker.tick()
    assert worker.next_due_s() == pytest.approx(1002.0)
    clock.advance(5.0)  # much later: no burst of catch-up ticks, the next grid point
    await worker.tick()
    assert worker.next_due_s() == pytest.approx(1007.0)


async def test_a_tick_late_by_almost_a_cycle_does_not_sample_again_within_the_slack(rig: Any) -> None:
    """A tick that ran just before the next grid point has read that point's values: the next read is the one
    after it, not a few milliseconds later."""
    worker, recording, _, clock = rig
    worker.bind(device(worker.uuid, **{p.name: 1000 for p in NVML_PROPERTIES}))
    await worker.tick()
    clock.advance(1.0 - DUE_SLACK_S / 2 + 1.0)  # the tick due at 1001 runs at 1001.975 (a slow NVML call)
    await worker.tick()
    assert worker.next_due_s() == pytest.approx(1003.0)
    recording.asked.clear()
    clock.advance(0.01)
    await worker.tick()
    assert recording.asked == []


async def test_the_first_due_times_lie_on_the_grid_even_when_the_monotonic_clock_is_young() -> None:
    """Monotonic time counts from boot: a mapper started a few seconds after it still keeps to the grid."""
    clock = FakeClock(now_s=3.0)
    sim = SimNvml(1, "H100", seed=0, clock=clock.monotonic)
    backend = NvmlBackend(sim, clock=clock)
    backend.init()
    try:
        worker = make_worker(backend, clock)
        worker.bind(device(worker.uuid, **{p.name: 10_000 for p in NVML_PROPERTIES}))
        await worker.tick()
        assert worker.next_due_s() == pytest.approx(10.0)
    finally:
        backend.shutdown()


class RebindingBackend:
    """A backend whose sample is answered after ``during_sample`` ran on the event loop (a Device update that
    arrives while the GPU loop waits for NVML)."""

    def __init__(self, backend: NvmlBackend) -> None:
        self.backend = backend
        self.during_sample: list[Any] = []

    def sample(self, uuid: str, properties: Iterable[str] | None = None) -> Sample:
        return self.backend.sample(uuid, properties)

    async def call_async(self, fn: Any, *args: Any) -> Any:
        while self.during_sample and fn == self.sample:
            self.during_sample.pop(0)()
        return fn(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)


async def test_a_device_bound_while_a_sample_is_in_flight_gets_everything_due_at_once(rig: Any) -> None:
    worker, _, _, clock = rig
    rebinding = RebindingBackend(worker.backend.backend)
    worker.backend = rebinding
    worker.bind(device(worker.uuid, temperature=1000))  # the catalog's cycles: several groups
    await worker.tick()
    clock.advance(60.0)
    one_cycle = device(worker.uuid, **{p.name: 2000 for p in NVML_PROPERTIES})  # one group
    rebinding.during_sample.append(lambda: worker.bind(one_cycle))
    result = await worker.tick()
    assert result.error == ""
    assert worker.due_properties(clock.monotonic()) == tuple(p.name for p in NVML_PROPERTIES)


async def test_a_driver_reload_while_a_sample_is_in_flight_leaves_everything_due(rig: Any) -> None:
    """The values in flight may predate the reload: everything is read again, as ``driver_reloaded`` says."""
    worker, _, _, clock = rig
    rebinding = RebindingBackend(worker.backend.backend)
    worker.backend = rebinding
    worker.bind(device(worker.uuid, temperature=1000))
    await worker.tick()
    clock.advance(1.0)
    rebinding.during_sample.append(worker.driver_reloaded)
    await worker.tick()
    assert worker.next_due_s() <= clock.monotonic()
    assert set(worker.due_properties(clock.monotonic())) == {p.name for p in NVML_PROPERTIES}


async def test_a_cycle_shorter_than_the_slack_is_still_sampled_every_cycle(rig: Any) -> None:
    worker, recording, _, clock = rig
    worker.min_collect_cycle_ms = 20
    worker.bind(device(worker.uuid, temperature=40))
    await worker.tick()
    reads = 0
    for _ in range(10):
        clock.advance(worker.next_due_s() - clock.monotonic())
        recording.asked.clear()
        await worker.tick()
        reads += "temperature" in recording.asked[-1]
    assert reads == 10
    assert clock.monotonic() == pytest.approx(1000.0 + 10 * 0.04, abs=0.041)


async def test_a_worker_is_due_on_its_grid_or_when_woken_and_the_wake_reaches_the_collector(rig: Any) -> None:
    worker, recording, _, clock = rig
    notified: list[int] = []
    worker.notify = lambda: notified.append(1)
    worker.bind(device(worker.uuid, temperature=1000))
    assert notified == [1], "bind wakes the worker and tells the collector"
    assert worker.is_due(clock.monotonic())
    start = worker.begin()
    assert "temperature" in start.names
    result = await worker.finish(start, recording.backend.sample(worker.uuid, start.names))
    assert result.sample is not None and result.error == ""
    assert not worker.is_due(clock.monotonic()), "sampled: nothing due until the next grid point"
    worker.wake()
    assert worker.is_due(clock.monotonic()) and notified == [1, 1]
    woken = worker.begin()
    assert woken.names == () and not worker.is_due(clock.monotonic()), "a wake samples nothing that is not due"
    await worker.finish(woken, None)
    clock.advance(worker.next_due_s() - clock.monotonic())
    assert worker.is_due(clock.monotonic())


async def test_finish_takes_a_sampling_error_as_tick_would(rig: Any) -> None:
    from mapper.errors import GpuLostError, TransientError

    worker, _, _, _ = rig
    worker.bind(device(worker.uuid, temperature=1000))
    start = worker.begin()
    result = await worker.finish(start, TransientError("NVML busy", retry_after_s=0.5))
    assert result.sample is None and "NVML busy" in result.error and worker.collect_errors == 1
    assert worker.next_due_s() == pytest.approx(start.now_s + 0.5), "retried after the error's retry_after_s"
    lost = await worker.finish(worker.begin(), GpuLostError("gone"))
    assert worker.lost and worker.state == "offline" and lost.state_changed


class SeenContexts(PolicyEngine):
    """The policy engine, keeping every context it was asked to decide with."""

    def __init__(self) -> None:
        super().__init__()
        self.contexts: list[Any] = []

    def decide(self, uuid: str, sample_values: Any, ctx: Any, now_s: float) -> Any:
        self.contexts.append(ctx)
        return super().decide(uuid, sample_values, ctx, now_s)


async def test_the_policies_see_each_event_once_and_every_change_of_desired_cap_constraints_or_loss(rig: Any) -> None:
    worker, _, sim, clock = rig
    seen = worker.policies = SeenContexts()
    await worker.tick()
    clock.advance(1.0)
    await worker.tick()
    first, second = seen.contexts
    assert second is first, "nothing changed: the context is used again"
    assert first.constraints == worker.constraints and first.constraints.power_limit_max_w > 0
    event = GpuEvent(uuid=worker.uuid, ts_ms=1, kind="xid", xid=13, detail="XID 13")
    worker.pending_events.append(event)
    clock.advance(1.0)
    await worker.tick()
    clock.advance(1.0)
    await worker.tick()
    with_event, after = seen.contexts[2:]
    assert with_event.events == (event,) and after.events == ()
    worker.desired.set("power_limit", "450", "cloud", 1_000)
    clock.advance(1.0)
    await worker.tick()
    assert seen.contexts[-1].desired_power_limit_w == 450.0
    sim.inject_gpu_lost(worker.uuid)
    clock.advance(1.0)
    await worker.tick()
    assert worker.lost and seen.contexts[-1].gpu_lost is True


async def test_each_step_goes_to_the_collectors_consumers_in_order_and_a_raising_one_costs_that_step_only(
    tmp_path: Path,
) -> None:
    """A sample reaches its telemetry stream straight from the collector (the streams are its first consumer, the
    round's batches stored by ``on_round``); the next consumers get each step after it, in the order given; one
    that raises for a GPU costs that GPU's step (the consumers after it skip it, it is counted), not the
    others'."""
    clock = SystemClock()
    backend = NvmlBackend(SimNvml(2, "H100", seed=0, scenario="steady"))
    backend.init()
    buf = Buffer(tmp_path / "t.db", max_bytes=10_000_000, max_age_s=10**9, clock=clock)

    async def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("nothing is published here")

    streams = TelemetryStreams(
        "edge1", "0badf00d", TelemetryShipper(buf, never, node="edge1", clock=clock), clock=clock, window_s=0.3
    )
    failing, healthy = (info.uuid for info in backend.list_gpus())
    seen: list[tuple[str, str]] = []

    class Consumer:
        def __init__(self, name: str, raise_for: str = "") -> None:
            self.name, self.raise_for = name, raise_for

        def after_step(self, worker: GpuWorker, result: TickResult) -> None:
            seen.append((self.name, worker.uuid))
            if worker.uuid == self.raise_for:
                raise RuntimeError("a bug in a consumer")

    workers: dict[str, GpuWorker] = {}
    collector = Collector(
        workers,
        backend,
        clock=clock,
        consumers=(streams, Consumer("first", raise_for=failing), Consumer("second")),
        on_round=streams.store_round,
    )
    for info in backend.list_gpus():
        reconciler = Reconciler(backend, info.uuid, clock=clock)
        workers[info.uuid] = GpuWorker(info, backend, reconciler, PolicyEngine(), clock, notify=collector.wake.set)
        streams.bind(info.uuid, unbound_device(info))
    expected = {f"_unbound/{uuid.lower()}" for uuid in workers}
    task = asyncio.create_task(collector.run())
    try:
        await wait_for(lambda: {r.device for r in buf.pending(limit=1000)} == expected, what="batches of both GPUs")
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    firsts = [i for i, (name, _) in enumerate(seen) if name == "first"]
    assert firsts and all(seen[i + 1] == ("second", healthy) for i in firsts if seen[i][1] == healthy)
    assert ("second", failing) not in seen, "the consumers after the raising one skip that GPU's step"
    assert collector.errors["step-failed"] == sum(1 for s in seen if s == ("first", failing)) >= 1
    assert workers[failing].state == "unhealthy" and workers[healthy].state == "online"
    buf.close()
    backend.shutdown()


async def test_the_collector_measures_how_late_each_gpus_read_began_after_its_due_time() -> None:
    """A GPU whose read follows a slow one is late by that read; the start-up round (due at once) is not timed."""
    clock = FakeClock()
    # injected delays advance the fake clock: the 30 ms below is 30 ms of the backend's (and collector's) time
    sim = SimNvml(2, "H100", seed=0, clock=clock.monotonic, sleep=clock.advance)
    backend = NvmlBackend(sim, clock=clock)
    try:
        workers = {g.uuid: make_worker_for(backend, g, clock) for g in backend.list_gpus()}
        for worker in workers.values():
            worker.bind(device(worker.uuid, temperature=1000))
        late: list[tuple[float, float]] = []
        collector = Collector(workers, backend, clock=clock, observe_lateness=lambda *x: late.append(x))
        await collector.tick_all(list(workers.values()), False)
        assert late == []  # everything due at once at start-up: no due time to be late for
        first = next(iter(workers.values()))
        clock.advance(first.next_due_s() - clock.monotonic() + 0.002)  # the round runs 2 ms after the grid point
        sim.set_call_delay_s(0.03, "nvmlDeviceGetTemperatureV")
        await collector.tick_all(list(workers.values()), False)
        # (lateness, the part of it behind the other GPUs' reads): the second GPU waited for the first one's 30 ms
        assert late == [pytest.approx((0.002, 0.0)), pytest.approx((0.032, 0.030))]
    finally:
        backend.shutdown()


def make_worker_for(backend: NvmlBackend, info: Any, clock: FakeClock) -> GpuWorker:
    return GpuWorker(
        info=info,
        backend=backend,
        reconciler=Reconciler(backend, info.uuid, clock=clock),
        policies=PolicyEngine(),
        clock=clock,
    )
