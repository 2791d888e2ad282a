"""Local policies driving a simulated GPU through the real backend, on fake time (no EdgeCore, no broker).

A tiny control loop per test: sample through ``NvmlBackend``, ``decide``, and apply the decision's cap with
``NvmlBackend.set_power_limit`` (as the reconciler would: the policy cap, else the pre-policy limit on release).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from mapper.clock import FakeClock
from mapper.edge.control.policy import Decision, PolicyConfig, PolicyContext, PolicyState, decide, parse_policies
from mapper.edge.gpu.nvml import NvmlBackend
from mapper.edge.gpu.simnvml import SimNvml
from mapper.errors import GpuLostError
from mapper.shared.model import Constraints, GpuEvent, Value

WATCHED = ("temperature", "utilization_gpu", "power_limit", "xid_last", "ecc_errors_uncorrected", "energy_consumption")


@dataclass
class Cycle:
    now_s: float
    values: dict[str, Value]
    decision: Decision
    applied_w: float | None


@dataclass
class Loop:
    clock: FakeClock
    sim: SimNvml
    backend: NvmlBackend
    uuid: str
    config: PolicyConfig
    constraints: Constraints
    state: PolicyState = field(default_factory=PolicyState)
    history: list[Cycle] = field(default_factory=list)

    def cycle(self, dt_s: float = 1.0) -> Cycle:
        self.clock.advance(dt_s)
        events: tuple[GpuEvent, ...] = tuple(e for e in self.backend.poll_events() if e.uuid == self.uuid)
        lost = False
        try:
            values = dict(self.backend.sample(self.uuid, WATCHED).values)
        except GpuLostError:
            values, lost = {}, True
        ctx = PolicyContext(constraints=self.constraints, events=events, gpu_lost=lost, uuid=self.uuid)
        self.state, decision = decide(self.state, values, ctx, self.config, self.clock.monotonic())
        target = decision.power_limit_w if decision.limits else decision.restore_power_limit_w
        applied = None
        if target is not None and not lost and target != values.get("power_limit"):
            applied = self.backend.set_power_limit(self.uuid, target)
        c = Cycle(self.clock.monotonic(), values, decision, applied)
        self.history.append(c)
        return c

    def run_until(self, predicate: Callable[[Cycle], bool], limit_s: int) -> Cycle:
        for _ in range(limit_s):
            c = self.cycle()
            if predicate(c):
                return c
        raise AssertionError(f"condition not met within {limit_s} simulated seconds")

    @property
    def gpu_limit_w(self) -> float:
        return self.sim.gpu(self.uuid).power_limit_w


@pytest.fixture
def heat_loop(fake_clock: FakeClock) -> Iterator[Loop]:
    sim = SimNvml(1, "H100", clock=fake_clock.monotonic, scenario="heat")
    backend = NvmlBackend(sim, clock=fake_clock)
    backend.init()
    try:
        (gpu,) = backend.list_gpus()
        yield Loop(fake_clock, sim, backend, gpu.uuid, PolicyConfig(), backend.constraints(gpu.uuid))
    finally:
        backend.shutdown()


def temp(c: Cycle) -> int:
    t = c.values.get("temperature")
    assert isinstance(t, int)
    return t


def test_the_heat_scenario_crosses_85_c_and_the_cap_drops_within_one_cycle(heat_loop: Loop) -> None:
    hot = heat_loop.run_until(lambda c: temp(c) > 85, limit_s=600)
    assert [e.action for e in hot.decision.events] == ["step-down"]
    assert hot.applied_w == 630.0 and heat_loop.gpu_limit_w == 630.0
    before = heat_loop.history[-2]
    assert temp(before) <= 85 and before.applied_w is None and before.decision.limits == ()
    nxt = heat_loop.cycle()
    assert nxt.values["power_limit"] == 630.0  # the next sample reads the cap back from the GPU


def test_throttling_brings_the_temperature_back_down_and_holds_the_cap_without_flapping(heat_loop: Loop) -> None:
    heat_loop.run_until(lambda c: temp(c) > 85, limit_s=600)
    for _ in range(1200):
        heat_loop.cycle()
    last = heat_loop.history[-300:]
    assert max(temp(c) for c in last) <= 85, "the cap did not bring the heat scenario under maxTemp"
    # Two steps (700 -> 630 -> 567 W) settle the GPU between releaseTemp and maxTemp; then nothing moves.
    assert [c.applied_w for c in heat_loop.history if c.applied_w is not None] == [630.0, 567.0]
    assert all(80 <= temp(c) <= 85 for c in last)
    assert heat_loop.history[-1].decision.policy_state == "thermal:holding-step2"


def test_the_cap_is_released_only_after_the_cool_down(heat_loop: Loop) -> None:
    heat_loop.run_until(lambda c: temp(c) > 85, limit_s=600)
    heat_loop.sim.set_scenario(heat_loop.uuid, "steady")  # the hot job ends; a lighter one runs on
    cool = heat_loop.run_until(lambda c: temp(c) < 80, limit_s=600)
    capped_w = heat_loop.gpu_limit_w
    assert capped_w < 700.0
    # 299 more seconds below releaseTemp: still capped.
    for _ in range(299):
        c = heat_loop.cycle()
        assert temp(c) < 80 and heat_loop.gpu_limit_w == capped_w, f"released after {c.now_s - cool.now_s:.0f} s"
    up = heat_loop.cycle()
    assert up.now_s - cool.now_s == 300.0
    assert [e.action for e in up.decision.events] in (["step-up"], ["release"])
    assert heat_loop.gpu_limit_w > capped_w
    heat_loop.run_until(lambda c: heat_loop.gpu_limit_w == 700.0, limit_s=600)
    assert heat_loop.history[-1].decision.policy_state == "normal"


def test_a_cloud_desired_cap_below_the_policy_is_never_raised(heat_loop: Loop) -> None:
    heat_loop.backend.set_power_limit(heat_loop.uuid, 400.0)  # the cloud's desired value, applied
    for _ in range(900):
        heat_loop.clock.advance(1.0)
        values = dict(heat_loop.backend.sample(heat_loop.uuid, WATCHED).values)
        ctx = PolicyContext(constraints=heat_loop.constraints, desired_power_limit_w=400.0)
        heat_loop.state, d = decide(heat_loop.state, values, ctx, heat_loop.config, heat_loop.clock.monotonic())
        for lim in d.limits:
            assert lim.power_limit_w is not None and lim.power_limit_w < 400.0
        heat_loop.backend.set_power_limit(
            heat_loop.uuid, min([400.0, *(lim.power_limit_w or 400.0 for lim in d.limits)])
        )
    assert heat_loop.gpu_limit_w <= 400.0


def test_dry_run_on_the_simulator_leaves_the_gpu_at_its_limit(heat_loop: Loop) -> None:
    heat_loop.config = parse_policies({"dryRun": True})
    hot = heat_loop.run_until(lambda c: temp(c) > 85, limit_s=600)
    assert hot.decision.policy_state == "dry-run:thermal:throttling-step1"
    assert [(e.action, e.dry_run) for e in hot.decision.events] == [("step-down", True)]
    for _ in range(120):
        heat_loop.cycle()
    assert heat_loop.gpu_limit_w == 700.0
    assert all(c.applied_w is None for c in heat_loop.history)


def test_power_saving_caps_an_idle_gpu_and_restores_it_in_the_first_busy_cycle(fake_clock: FakeClock) -> None:
    sim = SimNvml(1, "T4", clock=fake_clock.monotonic, scenario="idle")
    backend = NvmlBackend(sim, clock=fake_clock)
    backend.init()
    try:
        (gpu,) = backend.list_gpus()
        cons = backend.constraints(gpu.uuid)
        loop = Loop(fake_clock, sim, backend, gpu.uuid, parse_policies({"powerSaving": {"idleFor": "1m"}}), cons)
        engaged = loop.run_until(lambda c: bool(c.decision.limits), limit_s=200)
        assert engaged.now_s - loop.history[0].now_s == 60.0  # idle since the first sample, capped 60 s later
        assert loop.gpu_limit_w == cons.power_limit_min_w
        sim.set_scenario(gpu.uuid, "steady")
        busy = loop.cycle()
        assert [e.action for e in busy.decision.events] == ["restore"]
        assert loop.gpu_limit_w == cons.power_limit_default_w
    finally:
        backend.shutdown()


def test_health_follows_injected_xids_ecc_errors_and_a_lost_gpu(heat_loop: Loop) -> None:
    sim, uuid = heat_loop.sim, heat_loop.uuid
    assert heat_loop.cycle().decision.device_state == "ok"
    sim.inject_ecc(uuid, uncorrected=1)
    c = heat_loop.cycle()
    assert c.decision.device_state == "unhealthy" and c.decision.policy_state.startswith("health:unhealthy-ecc")
    sim.driver_reload()
    c = heat_loop.run_until(lambda c: c.decision.device_state == "ok", limit_s=120)
    assert "recovered" in [e.action for e in c.decision.events]
    sim.inject_xid(uuid, 48)
    c = heat_loop.cycle()
    assert c.decision.device_state == "unhealthy" and "health:unhealthy-xid48" in c.decision.policy_state
    sim.inject_gpu_lost(uuid)
    c = heat_loop.cycle()
    assert c.decision.device_state == "offline" and c.decision.policy_state.startswith("health:offline-gpu-lost")
    assert ("health", "offline") in [(e.policy, e.action) for e in c.decision.events]
