"""Reporter on fake time: periodic twin and state reports per Device, at once on a state change, a new binding
or a reconnect; nothing for a removed Device. The DMI side is a recording StatusSink (the Reporter's own seam;
the DMI reporter behind it is tested in test_dmi_client.py and the whole path in test_app_dmi.py)."""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import pytest

from mapper.clock import FakeClock
from mapper.edge.control.collect import GpuWorker
from mapper.edge.control.policy import PolicyEngine
from mapper.edge.control.reconcile import Reconciler
from mapper.edge.gpu.nvml import NvmlBackend
from mapper.edge.gpu.simnvml import SimNvml
from mapper.edge.kubeedge.report import Reporter, device_twins
from mapper.shared.model import DeviceConfig, DeviceProperty, Twin


@dataclass
class Sink:
    """Records what the reporter offers, with the fake time of each offer."""

    clock: FakeClock
    statuses: list[tuple[float, str, dict[str, tuple[str, str]]]] = field(default_factory=list)
    states: list[tuple[float, str, str]] = field(default_factory=list)
    forgotten: list[str] = field(default_factory=list)
    #: Whether each of ``statuses`` / ``states`` was offered as prompt.
    status_prompt: list[bool] = field(default_factory=list)
    state_prompt: list[bool] = field(default_factory=list)

    def offer_status(self, namespace: str, name: str, twins: Iterable[Twin], *, prompt: bool = False) -> None:
        values = {t.name: (t.observed_desired, t.reported) for t in twins}
        self.statuses.append((self.clock.monotonic(), f"{namespace}/{name}", values))
        self.status_prompt.append(prompt)

    def offer_state(self, namespace: str, name: str, state: str, *, prompt: bool = False) -> None:
        self.states.append((self.clock.monotonic(), f"{namespace}/{name}", state))
        self.state_prompt.append(prompt)

    def forget(self, namespace: str, name: str) -> None:
        self.forgotten.append(f"{namespace}/{name}")


@dataclass
class Rig:
    clock: FakeClock
    sim: SimNvml
    workers: dict[str, GpuWorker]
    sink: Sink
    published: list[tuple[float, str, dict]]
    reporter: Reporter

    def run_for(self, seconds: float) -> None:
        """Run the report loop's passes on fake time for ``seconds``, sleeping as the loop would."""
        end = self.clock.monotonic() + seconds
        while True:
            delay = self.reporter.report_due()
            drain = getattr(self.sink, "drain", None)
            if drain is not None and (wait := drain()) is not None:
                delay = min(delay, max(wait, 0.01))
            if self.clock.monotonic() + delay > end:
                self.clock.advance(max(0.0, end - self.clock.monotonic()))
                return
            self.clock.advance(delay)


def gpu_device(name: str, uuid: str, *, report_cycle_ms: int = 20_000, state_cycle_ms: int = 60_000) -> DeviceConfig:
    props = tuple(
        DeviceProperty(p, report_cycle_ms=report_cycle_ms, report_to_cloud=True)
        for p in ("temperature", "power_usage", "power_limit")
    )
    return DeviceConfig(
        "default",
        name,
        "nvidia-gpu",
        uuid,
        properties=props,
        state_report_to_cloud=True,
        state_report_cycle_ms=state_cycle_ms,
    )


@pytest.fixture
def rig() -> Iterator[Rig]:
    clock = FakeClock()
    sim = SimNvml(2, "H100", seed=0, scenario="steady", clock=clock.monotonic)
    backend = NvmlBackend(sim, clock=clock)
    backend.init()
    workers = {}
    for info in backend.list_gpus():
        workers[info.uuid] = GpuWorker(
            info=info,
            backend=backend,
            reconciler=Reconciler(backend, info.uuid, clock=clock),
            policies=PolicyEngine(),
            clock=clock,
        )
    sink = Sink(clock)
    published: list[tuple[float, str, dict]] = []

    def publish(topic: str, payload: bytes) -> None:
        published.append((clock.monotonic(), topic, json.loads(payload)))

    reporter = Reporter(workers, clock=clock, dmi=sink, eventbus=publish)
    yield Rig(clock, sim, workers, sink, published, reporter)
    backend.shutdown()


async def bind_and_sample(rig: Rig) -> list[DeviceConfig]:
    devices = []
    for i, worker in enumerate(rig.workers.values()):
        device = gpu_device(f"gpu{i}", worker.uuid)
        worker.bind(device)
        rig.reporter.bound(device)
        await worker.tick()
        devices.append(device)
    return devices


async def test_twins_go_out_once_per_report_cycle_at_phases_of_their_own_and_states_once_per_state_cycle(
    rig: Rig,
) -> None:
    await bind_and_sample(rig)
    start = rig.clock.monotonic()
    rig.run_for(205.0)
    firsts, state_firsts = [], []
    for key in ("default/gpu0", "default/gpu1"):
        for got, cycle_s, seconds in ((rig.sink.statuses, 20.0, firsts), (rig.sink.states, 60.0, state_firsts)):
            times = [t - start for t, k, *_ in got if k == key]
            assert times[0] == pytest.approx(0.0, abs=0.01), "the first report at once"
            assert cycle_s / 2 <= times[1] < cycle_s * 1.5, "the second between half a cycle and one and a half"
            gaps = [b - a for a, b in itertools.pairwise(times[1:])]
            assert gaps and gaps == pytest.approx([cycle_s] * len(gaps), abs=0.01), times
            seconds.append(times[1])
    assert abs(firsts[0] - firsts[1]) > 5.0, f"two Devices bound together report apart: {firsts}"
    assert abs(state_firsts[0] - state_firsts[1]) > 15.0, f"and their states too: {state_firsts}"
    # The EventBus gets the same reports: twin/update and state/update per device, every twin a string.
    twin_updates = [d for _, topic, d in rig.published if topic == "$hw/events/device/default/gpu0/twin/update"]
    assert len(twin_updates) == len([1 for _, k, _ in rig.sink.statuses if k == "default/gpu0"])
    assert twin_updates[0]["twin"]["power_limit"]["actual"]["value"] == "700"
    assert {t["metadata"]["type"] for t in twin_updates[0]["twin"].values()} == {"string"}
    _, _, twins = rig.sink.statuses[0]
    assert set(twins) == {"temperature", "power_usage", "power_limit", "desired_status", "policy_state", "health"}


async def test_nothing_is_reported_before_the_first_sample(rig: Rig) -> None:
    worker = next(iter(rig.workers.values()))
    device = gpu_device("gpu0", worker.uuid)
    worker.bind(device)
    rig.reporter.bound(device)
    rig.run_for(3.0)
    assert rig.sink.statuses == [], "twins wait for the first sample"
    assert [s for _, _, s in rig.sink.states] == ["online"], "the state goes out at once"
    await worker.tick()
    rig.run_for(0.2)
    assert len(rig.sink.statuses) == 1


async def test_a_gpu_stepped_before_its_device_was_bound_reports_after_a_step_with_it_and_at_once(rig: Rig) -> None:
    """Start-up: the GPUs step unbound until EdgeCore's Devices arrive. A Device's first twins wait for a step
    with it bound (its desired values reconciled, not the unbound step's ``none``), and that step wakes the
    report loop at once instead of leaving them to its idle wait."""
    worker = next(iter(rig.workers.values()))
    await worker.tick()
    assert worker.stepped and worker.desired_status == "none"
    device = gpu_device("gpu0", worker.uuid)
    worker.desired.set("power_limit", "450", "cloud", rig.clock.wall_ms())
    worker.bind(device)
    rig.reporter.bound(device)
    assert not worker.stepped, "a new binding waits for a step with it"
    rig.reporter.report_due()
    assert rig.sink.statuses == []
    rig.reporter.wake.clear()
    rig.reporter.after_step(worker, await worker.tick())
    assert rig.reporter.wake.is_set(), "the step wakes the report loop"
    rig.reporter.report_due()
    [(_, _, twins)] = rig.sink.statuses
    assert twins["power_limit"] == ("450", "450") and "power_limit:applied" in twins["desired_status"][1]
    assert rig.sink.status_prompt == [False], "start-up's first report is periodic"


async def test_no_twins_go_out_between_a_steps_sample_and_its_reconcile(rig: Rig) -> None:
    """The first step samples, then reads the GPU's constraints on the NVML thread before it reconciles: a
    report pass in that gap would send ``desired_status`` empty. Twins wait for the whole step."""
    import asyncio
    import threading

    from tests.apphelpers import wait_for

    worker = next(iter(rig.workers.values()))
    device = gpu_device("gpu0", worker.uuid)
    worker.bind(device)
    rig.reporter.bound(device)
    entered, release = threading.Event(), threading.Event()
    real = worker.reconciler.constraints

    def held() -> object:
        entered.set()
        release.wait(10.0)
        return real()

    worker.reconciler.constraints = held  # type: ignore[method-assign]
    step = asyncio.create_task(worker.tick())
    try:
        await wait_for(entered.is_set, what="the step to read the constraints")
        assert worker.values and worker.desired_status == "", "the gap: sampled, not yet reconciled"
        rig.reporter.report_due()
        assert rig.sink.statuses == [], "no twins from a half-done step"
    finally:
        release.set()
        await step
    rig.run_for(0.2)
    [(_, _, twins)] = rig.sink.statuses
    assert twins["desired_status"] == ("", "none") and twins["policy_state"] == ("", "normal")
    assert all(reported != "" for _, reported in twins.values()), twins


async def test_a_state_change_is_reported_at_once_and_a_removed_device_reports_nothing(rig: Rig) -> None:
    devices = await bind_and_sample(rig)
    rig.run_for(5.0)
    worker = rig.workers[devices[0].uuid]
    rig.sim.inject_gpu_lost(worker.uuid)
    result = await worker.tick()
    assert result.state_changed and worker.state == "offline"
    rig.reporter.state_changed(devices[0])
    changed_at = rig.clock.monotonic()
    rig.run_for(0.5)
    offline = [t for t, k, s in rig.sink.states if k == "default/gpu0" and s == "offline"]
    assert offline and offline[0] - changed_at < 0.2
    flags = {(k, s): p for (_, k, s), p in zip(rig.sink.states, rig.sink.state_prompt, strict=True)}
    assert flags[("default/gpu0", "offline")], "a change of state is prompt over DMI"
    assert not flags[("default/gpu0", "online")], "the first state after start-up is not"

    rig.reporter.removed(devices[1])
    worker1 = rig.workers[devices[1].uuid]
    worker1.bind(None)
    assert rig.sink.forgotten == ["default/gpu1"]
    before = len([1 for _, k, _ in rig.sink.statuses if k == "default/gpu1"])
    rig.run_for(45.0)
    assert len([1 for _, k, _ in rig.sink.statuses if k == "default/gpu1"]) == before


async def test_a_reconnect_sends_every_device_again_on_eventbus_at_once_without_moving_the_cycle(rig: Rig) -> None:
    await bind_and_sample(rig)
    start = rig.clock.monotonic()
    rig.run_for(7.0)
    dmi_before = len(rig.sink.statuses) + len(rig.sink.states)
    rig.reporter.resend_all()
    rig.run_for(0.5)
    topic = "$hw/events/device/default/gpu0/twin/update"
    times = [round(t - start, 1) for t, k, _ in rig.published if k == topic]
    assert times == [0.0, 7.0], "twins again at once on the EventBus"
    assert [round(t - start, 1) for t, k, _ in rig.published if k.endswith("gpu0/state/update")] == [0.0, 7.0]
    assert len(rig.sink.statuses) + len(rig.sink.states) == dmi_before, "the DMI path is not concerned"
    rig.run_for(40.0)
    times = [round(t - start, 1) for t, k, _ in rig.published if k == topic]
    assert times == [0.0, 7.0, 10.0, 30.0], "the cycle kept its phase (0.5 of 20 s for the first Device)"


async def test_device_twins_carry_observed_desired_for_writable_properties_and_hex_where_asked(rig: Rig) -> None:
    worker = next(iter(rig.workers.values()))
    props = (
        DeviceProperty("power_limit", report_to_cloud=True),
        DeviceProperty("clock_event_reasons", report_to_cloud=True, visitor_config={"format": "hex"}),
        DeviceProperty("temperature", report_to_cloud=False),
    )
    worker.bind(DeviceConfig("default", "gpu0", "nvidia-gpu", worker.uuid, properties=props))
    worker.desired.set("power_limit", "400", "cloud", 1)
    await worker.tick()
    twins = {t.name: t for t in device_twins(worker)}
    assert set(twins) == {"power_limit", "clock_event_reasons", "desired_status", "policy_state", "health"}
    assert twins["power_limit"].observed_desired == "400" and twins["power_limit"].reported == "400"
    assert twins["clock_event_reasons"].reported.startswith("0x")
    assert twins["clock_event_reasons"].observed_desired == ""


# --- prompt reports -------------------------------------------------------------------------------------------


async def change_power_limit(rig: Rig, worker: GpuWorker, watts: str) -> None:
    """A new desired power limit, applied in the GPU's next step (as a DMI UpdateDevice wakes it)."""
    worker.desired.set("power_limit", watts, "cloud", rig.clock.wall_ms())
    result = await worker.tick()
    assert result.reconcile is not None and result.reconcile.acks, "the step applied it"
    rig.reporter.after_step(worker, result)


async def test_a_desired_value_applied_is_reported_at_once_on_both_paths_and_the_cycle_keeps_its_phase(
    rig: Rig,
) -> None:
    devices = await bind_and_sample(rig)
    start = rig.clock.monotonic()
    rig.run_for(3.0)
    worker = rig.workers[devices[0].uuid]
    await change_power_limit(rig, worker, "400")
    changed_at = rig.clock.monotonic()
    rig.run_for(0.05)
    prompt = [(t, twins) for t, k, twins in rig.sink.statuses if k == "default/gpu0" and t >= changed_at]
    assert len(prompt) == 1 and prompt[0][0] - changed_at < 0.02
    twins = prompt[0][1]
    assert set(twins) == {"power_limit", "desired_status", "policy_state", "health"}, "the affected twins only"
    assert twins["power_limit"] == ("400", "400"), "observedDesired and reported"
    assert "power_limit:applied" in twins["desired_status"][1]
    updates = [d for t, topic, d in rig.published if topic.endswith("gpu0/twin/update") and t >= changed_at]
    assert len(updates) == 1 and updates[0]["twin"]["power_limit"]["actual"]["value"] == "400"
    assert not [1 for t, k, _ in rig.sink.statuses if k == "default/gpu1" and t >= changed_at]

    # A step that changes nothing reports nothing; the periodic cycle kept its phase (0.5 of 20 s).
    rig.reporter.after_step(worker, await worker.tick())
    rig.run_for(40.0)
    times = [round(t - start, 2) for t, k, _ in rig.sink.statuses if k == "default/gpu0"]
    assert times == [0.0, round(changed_at - start, 2), 10.0, 30.0]
    assert rig.reporter.counts["prompt"] == 1 and rig.reporter.counts["prompt_eventbus"] == 1
    flags = [p for (_, k, _), p in zip(rig.sink.statuses, rig.sink.status_prompt, strict=True) if k == "default/gpu0"]
    assert flags == [False, True, False, False], "only the change is offered as prompt; the cycles are periodic"


async def test_changes_within_a_second_go_in_one_dmi_report_and_at_once_on_the_eventbus(rig: Rig) -> None:
    devices = await bind_and_sample(rig)
    rig.run_for(3.0)
    worker = rig.workers[devices[0].uuid]
    await change_power_limit(rig, worker, "400")
    first_at = rig.clock.monotonic()
    rig.run_for(0.3)
    await change_power_limit(rig, worker, "350")
    rig.run_for(0.3)
    await change_power_limit(rig, worker, "300")
    rig.run_for(1.5)
    dmi = [
        (round(t - first_at, 2), twins) for t, k, twins in rig.sink.statuses if k == "default/gpu0" and t >= first_at
    ]
    assert [t for t, _ in dmi] == [0.0, 1.0], "the second and third change coalesced, a second after the first"
    assert dmi[0][1]["power_limit"] == ("400", "400") and dmi[1][1]["power_limit"] == ("300", "300")
    bus = [
        d["twin"]["power_limit"]["actual"]["value"]
        for t, topic, d in rig.published
        if topic.endswith("gpu0/twin/update") and t >= first_at
    ]
    assert bus == ["400", "350", "300"], "EventBus at once, every change"


async def test_a_rejected_value_and_a_restore_are_reported_promptly(rig: Rig) -> None:
    devices = await bind_and_sample(rig)
    rig.run_for(3.0)
    worker = rig.workers[devices[0].uuid]
    worker.desired.set("power_limit", "5000", "cloud", rig.clock.wall_ms())  # above the H100's 700 W maximum
    result = await worker.tick()
    rig.reporter.after_step(worker, result)
    at = rig.clock.monotonic()
    rig.run_for(0.05)
    twins = [tw for t, k, tw in rig.sink.statuses if k == "default/gpu0" and t >= at][-1]
    assert "power_limit:rejected" in twins["desired_status"][1] and twins["power_limit"] == ("5000", "700")

    rig.run_for(2.0)
    await change_power_limit(rig, worker, "400")
    rig.run_for(2.0)
    worker.desired.sync_source("cloud", {}, rig.clock.wall_ms())  # the Device no longer asks: back to default
    at = rig.clock.monotonic()
    for _ in range(3):
        rig.reporter.after_step(worker, await worker.tick())
    rig.run_for(0.05)
    twins = [tw for t, k, tw in rig.sink.statuses if k == "default/gpu0" and t >= at][-1]
    assert twins["power_limit"][1] == "700", "the default restored and reported at once"


async def test_eight_gpus_changed_in_the_same_second_all_report_within_it_inside_the_dmi_budget() -> None:
    clock = FakeClock()
    sim = SimNvml(8, "H100", seed=5, scenario="steady", clock=clock.monotonic)
    backend = NvmlBackend(sim, clock=clock)
    backend.init()
    try:
        workers = {
            info.uuid: GpuWorker(
                info=info,
                backend=backend,
                reconciler=Reconciler(backend, info.uuid, clock=clock),
                policies=PolicyEngine(),
                clock=clock,
            )
            for info in backend.list_gpus()
        }
        sink = BudgetSink(clock)
        reporter = Reporter(workers, clock=clock, dmi=sink)
        rig = Rig(clock, sim, workers, sink, [], reporter)  # type: ignore[arg-type]
        await bind_and_sample(rig)
        rig.run_for(120.0)  # at start-up every Device reports at once; by now they have spread over the cycle
        changed_at = clock.monotonic()
        for worker in workers.values():
            await change_power_limit(rig, worker, "450")
        rig.run_for(1.0)
        prompt = [(t, k, tw) for t, k, tw in sink.statuses if t >= changed_at and "power_limit" in tw]
        assert sorted(k for _, k, _ in prompt if tw_has(prompt, k, "450")) == sorted(
            f"default/gpu{i}" for i in range(8)
        )
        assert max(t for t, _, _ in prompt) - changed_at <= 1.0, "every GPU's change within a second"
        rig.run_for(60.0)
        # The budget: never more RPCs than a 0.8/s bucket with a burst of 10 allows (EdgeCore allows 1/s, 100).
        sent = sorted(t for t, _, _ in sink.statuses) + [t for t, _, _ in sink.states]
        sent.sort()
        for i, t in enumerate(sent):
            in_window = [u for u in sent[: i + 1] if u > t - 10.0]
            assert len(in_window) <= 10 + 0.8 * 10 + 1e-9, (t, len(in_window))
        assert len(sent) / (clock.monotonic() - sent[0]) < 1.0
    finally:
        backend.shutdown()


async def test_eight_gpus_changed_right_after_start_up_all_report_within_a_second_inside_the_dmi_budget() -> None:
    """Start-up's first twins and states (16 periodic reports against a bucket of 10) leave a token per Device,
    so a change on all 8 as soon as each has its first twins still goes out in the same second; start-up's
    states follow, and the cycles carry on within the budget."""
    clock = FakeClock()
    sim = SimNvml(8, "H100", seed=5, scenario="steady", clock=clock.monotonic)
    backend = NvmlBackend(sim, clock=clock)
    backend.init()
    try:
        workers = {
            info.uuid: GpuWorker(
                info=info,
                backend=backend,
                reconciler=Reconciler(backend, info.uuid, clock=clock),
                policies=PolicyEngine(),
                clock=clock,
            )
            for info in backend.list_gpus()
        }
        sink = BudgetSink(clock)
        sink.scheduler.bucket.take_forced()  # MapperRegister took one
        reporter = Reporter(workers, clock=clock, dmi=sink)
        rig = Rig(clock, sim, workers, sink, [], reporter)  # type: ignore[arg-type]
        start = clock.monotonic()
        await bind_and_sample(rig)
        keys = {f"default/gpu{i}" for i in range(8)}
        while {k for _, k, _ in sink.statuses} != keys:
            rig.run_for(0.25)
            assert clock.monotonic() - start < 30.0, "every Device's first twins"
        first_twins_s = clock.monotonic() - start
        assert not sink.states or len(sink.states) < 8, "start-up's first twins went before its first states"
        changed_at = clock.monotonic()
        for worker in workers.values():
            await change_power_limit(rig, worker, "450")
        rig.run_for(1.0)
        prompt = [(t, k, tw) for t, k, tw in sink.statuses if t >= changed_at and "power_limit" in tw]
        assert sorted(k for _, k, _ in prompt if tw_has(prompt, k, "450")) == sorted(keys)
        assert max(t for t, _, _ in prompt) - changed_at <= 1.0, "every GPU's change within a second"
        rig.run_for(60.0)
        assert {k for _, k, s in sink.states if s == "online"} == keys, "start-up's states followed"
        sent = sorted([t for t, _, _ in sink.statuses] + [t for t, _, _ in sink.states])
        for i, t in enumerate(sent):
            in_window = [u for u in sent[: i + 1] if u > t - 10.0]
            assert len(in_window) <= 9 + 0.8 * 10 + 1e-9, (t, len(in_window))
        assert first_twins_s < 10.0, f"start-up's first twins took {first_twins_s:.1f} s"
    finally:
        backend.shutdown()


def tw_has(prompt: list[tuple[float, str, dict[str, tuple[str, str]]]], key: str, watts: str) -> bool:
    return any(k == key and tw["power_limit"] == (watts, watts) for _, k, tw in prompt)


@dataclass
class BudgetSink(Sink):
    """The DMI reporter's queue and token bucket (the real ``ReportScheduler`` and ``TokenBucket``, 0.8/s,
    burst 10) on fake time: records each report when the budget lets it go, not when it is offered. As the DMI
    reporter's task does, it sends after the report loop's pass (``Rig.run_for`` drains it), not in the offer."""

    def __post_init__(self) -> None:
        from mapper.clock import TokenBucket
        from mapper.edge.kubeedge.dmi.ratelimit import ReportScheduler

        self.scheduler = ReportScheduler(TokenBucket(self.clock, rate_per_s=0.8, burst=10))

    def offer_status(self, namespace: str, name: str, twins: Iterable[Twin], *, prompt: bool = False) -> None:
        self.scheduler.offer_status(namespace, name, twins, prompt=prompt)

    def offer_state(self, namespace: str, name: str, state: str, *, prompt: bool = False) -> None:
        self.scheduler.offer_state(namespace, name, state, prompt=prompt)

    def drain(self) -> float | None:
        from mapper.edge.kubeedge.dmi.ratelimit import StateReport

        while (report := self.scheduler.pop_ready()) is not None:
            now = self.clock.monotonic()
            if isinstance(report, StateReport):
                self.states.append((now, report.key, report.state))
                self.state_prompt.append(report.prompt)
            else:
                self.statuses.append(
                    (now, report.key, {t.name: (t.observed_desired, t.reported) for t in report.twins})
                )
                self.status_prompt.append(report.prompt)
        return self.scheduler.wait_s()


# --- unsupported properties ------------------------------------------------------------------------------------


async def test_a_listed_property_the_gpu_cannot_read_reports_unsupported_logged_once_and_its_value_once_readable(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    import dataclasses

    caplog.set_level("INFO", logger="mapper.edge.kubeedge.report")
    worker = next(iter(rig.workers.values()))
    assert not rig.sim.gpu(worker.uuid).profile.has_fan, "the simulated H100 is passively cooled"
    props = tuple(DeviceProperty(p, report_cycle_ms=20_000) for p in ("temperature", "fan_speed", "power_limit"))
    device = DeviceConfig("default", "gpu0", "nvidia-gpu", worker.uuid, properties=props)
    worker.bind(device)
    rig.reporter.bound(device)
    await worker.tick()
    assert "fan_speed" in worker.unsupported and "fan_speed" not in worker.values
    rig.run_for(45.0)
    reports = [tw for _, k, tw in rig.sink.statuses if k == "default/gpu0"]
    assert len(reports) >= 2
    assert all(tw["fan_speed"] == ("", "unsupported") for tw in reports)
    assert all(tw["temperature"][1].isdigit() for tw in reports)
    warnings = [r for r in caplog.records if "fan_speed" in r.getMessage() and r.levelname == "WARNING"]
    assert len(warnings) == 1 and "default/gpu0" in warnings[0].getMessage(), "one log line for many reports"
    update = [d for _, topic, d in rig.published if topic.endswith("gpu0/twin/update")][-1]
    assert update["twin"]["fan_speed"] == {
        "actual": {"value": "unsupported"},
        "metadata": {"type": "string", "reason": "not-supported-by-gpu"},
    }
    assert update["twin"]["temperature"]["metadata"] == {"type": "string"}

    # A driver upgrade makes it readable: the backend asks again after its retry interval, the twin fills.
    gpu = rig.sim.gpu(worker.uuid)
    gpu.profile = dataclasses.replace(gpu.profile, has_fan=True)
    rig.clock.advance(601.0)
    await worker.tick()
    assert "fan_speed" not in worker.unsupported and "fan_speed" in worker.values
    rig.run_for(21.0)
    last = [tw for _, k, tw in rig.sink.statuses if k == "default/gpu0"][-1]
    assert last["fan_speed"][1].isdigit()
    assert any("reads fan_speed again" in r.getMessage() for r in caplog.records)


# --- short report cycles: the changed twins, every twin once per default cycle ----------------------------------


@dataclass
class ViewSink(Sink):
    """A Sink that also keeps what EdgeCore would hold after each report (every twin of a report applied on its
    own, the others kept) beside the Device's full twins at that moment (``device_twins`` of the worker)."""

    workers: dict[str, GpuWorker] = field(default_factory=dict)
    views: dict[str, dict[str, tuple[str, str]]] = field(default_factory=dict)
    mismatches: list[tuple[float, str, dict[str, tuple[str, str]], dict[str, tuple[str, str]]]] = field(
        default_factory=list
    )

    def offer_status(self, namespace: str, name: str, twins: Iterable[Twin], *, prompt: bool = False) -> None:
        twins = list(twins)
        super().offer_status(namespace, name, twins, prompt=prompt)
        key = f"{namespace}/{name}"
        view = self.views.setdefault(key, {})
        view.update({t.name: (t.observed_desired, t.reported) for t in twins})
        worker = next(w for w in self.workers.values() if w.device is not None and w.device.key == key)
        full = {t.name: (t.observed_desired, t.reported) for t in device_twins(worker)}
        if view != full:
            self.mismatches.append((self.clock.monotonic(), key, dict(view), full))


def short_cycle_rig(rig: Rig) -> tuple[ViewSink, dict[str, list[tuple[float, dict]]], list[tuple[float, str]]]:
    """``rig`` with a ViewSink, EventBus updates by Device and the state messages recorded."""
    sink = ViewSink(rig.clock, workers=rig.workers)
    rig.sink = sink
    rig.reporter.dmi = sink
    bus: dict[str, list[tuple[float, dict]]] = {}

    def publish(topic: str, payload: bytes) -> None:
        if topic.endswith("/twin/update"):
            key = topic.removeprefix("$hw/events/device/").removesuffix("/twin/update")
            bus.setdefault(key, []).append((rig.clock.monotonic(), json.loads(payload)["twin"]))

    rig.reporter.eventbus = publish
    snapshots: list[tuple[float, str]] = []
    rig.reporter.device_state = lambda key, payload: snapshots.append((rig.clock.monotonic(), key))
    return sink, bus, snapshots


async def run_stepping(rig: Rig, seconds: int) -> list[tuple[float, dict[str, tuple[str, str]]]]:
    """``seconds`` of 1 s GPU steps, the report loop running in between as in the mapper. Returns the first
    Device's every twin at the end of each second (after that second's report, before the next step)."""
    first = next(iter(rig.workers.values()))
    seen = []
    for _ in range(seconds):
        for worker in rig.workers.values():
            rig.reporter.after_step(worker, await worker.tick())
        rig.run_for(1.0)
        seen.append((rig.clock.monotonic(), {t.name: (t.observed_desired, t.reported) for t in device_twins(first)}))
    return seen


async def test_a_one_second_cycle_sends_the_changed_twins_and_every_twin_once_per_default_cycle(rig: Rig) -> None:
    sink, bus, snapshots = short_cycle_rig(rig)
    for i, worker in enumerate(rig.workers.values()):
        device = gpu_device(f"gpu{i}", worker.uuid, report_cycle_ms=1000)
        worker.bind(device)
        rig.reporter.bound(device)
    start = rig.clock.monotonic()
    seen = await run_stepping(rig, 65)

    reports = [(t - start, tw) for t, k, tw in sink.statuses if k == "default/gpu0"]
    every = {"temperature", "power_usage", "power_limit", "desired_status", "policy_state", "health"}
    full_at = [round(t) for t, tw in reports if set(tw) == every]
    # The first at once, then one every 20 s (defaults.reportCycle): 20 one-second cycles.
    assert len(full_at) == 4 and [b - a for a, b in itertools.pairwise(full_at)] == [20, 20, 20], full_at
    # In between, a second's report holds exactly the twins that differ from the second before (none: no report).
    by_second = {round(t): set(tw) for t, tw in reports}
    changed_seconds = 0
    for (_, before), (t, now) in itertools.pairwise(seen):
        second = round(t - start)
        if second in full_at:
            continue
        expected = {name for name in now if before.get(name) != now[name]}
        assert by_second.get(second, set()) == expected, (second, before, now)
        changed_seconds += bool(expected)
    assert 10 <= changed_seconds < len(seen) - 4, "some seconds changed something, some nothing"
    assert all("power_limit" not in tw for t, tw in reports if round(t) not in full_at), "unchanged: full only"
    assert sink.mismatches == [], "what EdgeCore holds after each report is the Device's every twin"

    # EventBus: the same rule, and a changed twin there is the value the DMI report had.
    updates = bus["default/gpu0"]
    full_bus = [round(t - start) for t, tw in updates if set(tw) == every]
    assert full_bus == full_at
    view: dict[str, str] = {}
    for _, tw in updates:
        view.update({name: t["actual"]["value"] for name, t in tw.items()})
    worker = next(iter(rig.workers.values()))
    assert view == {t.name: t.reported for t in device_twins(worker)}

    # The retained state message with the full reports only (the state did not change).
    assert [round(t - start) for t, k in snapshots if k == "default/gpu0"] == full_at


async def test_one_second_cycles_of_every_device_go_in_one_wake_up_on_the_grid(rig: Rig) -> None:
    sink, _, _ = short_cycle_rig(rig)
    passes: list[float] = []
    real = rig.reporter.report_due

    def report_due() -> float:
        passes.append(rig.clock.monotonic())
        return real()

    rig.reporter.report_due = report_due  # type: ignore[method-assign]
    for i, worker in enumerate(rig.workers.values()):
        device = gpu_device(f"gpu{i}", worker.uuid, report_cycle_ms=1000)
        worker.bind(device)
        rig.reporter.bound(device)
    await run_stepping(rig, 12)
    # The loop wakes on whole seconds of the monotonic clock only (the GPU loops' grid), once each: both
    # Devices' reports in the same pass. (With the default 20 s cycles they keep phases of their own: the first
    # test of this module.)
    assert passes == [pytest.approx(round(t), abs=1e-6) for t in passes], passes
    # (Rig.run_for passes once more at the start of each second it runs: the same instant.)
    assert sorted({round(t) for t in passes}) == list(range(round(passes[0]), round(passes[0]) + 13))
    times = {t for t, _, _ in sink.statuses}
    assert times and times <= set(passes)
    both = {t for t, k, _ in sink.statuses if k == "default/gpu0"} & {
        t for t, k, _ in sink.statuses if k != "default/gpu0"
    }
    assert len(both) > 3, "the two Devices' reports in the same wake-ups"


async def test_after_a_reconnect_eventbus_gets_every_twin_again_and_a_state_change_its_snapshot(rig: Rig) -> None:
    sink, bus, snapshots = short_cycle_rig(rig)
    worker = next(iter(rig.workers.values()))
    device = gpu_device("gpu0", worker.uuid, report_cycle_ms=1000)
    worker.bind(device)
    rig.reporter.bound(device)
    await run_stepping(rig, 5)
    every = {"temperature", "power_usage", "power_limit", "desired_status", "policy_state", "health"}
    assert set(bus["default/gpu0"][-1][1]) != every, "a changed-only update by now"
    dmi_before = len(sink.statuses)
    rig.reporter.resend_all()
    rig.run_for(0.05)
    assert set(bus["default/gpu0"][-1][1]) == every, "every twin again at once on EventBus"
    assert len(sink.statuses) == dmi_before, "the DMI path is not concerned"
    # The broker back in the very pass a changed-only report is due: that report is every twin on EventBus.
    await run_stepping(rig, 2)
    rig.clock.advance(math.ceil(rig.clock.monotonic()) - rig.clock.monotonic())
    sent = len(bus["default/gpu0"])
    rig.reporter.resend_all()
    rig.reporter.report_due()
    assert len(bus["default/gpu0"]) == sent + 1 and set(bus["default/gpu0"][-1][1]) == every

    before = len(snapshots)
    rig.sim.inject_gpu_lost(worker.uuid)
    rig.reporter.after_step(worker, await worker.tick())
    rig.run_for(1.0)
    assert worker.state == "offline" and len(snapshots) == before + 1, "the new state in the retained message"
