"""Clocks as an actuator: thermal throttling and power saving through the locked SM clock (pure decisions, the
reconciler's plan, and the hot-hour workload on the simulator through the real backend and reconciler)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from mapper.clock import FakeClock
from mapper.edge.control.collect import GpuWorker
from mapper.edge.control.desired import DesiredState
from mapper.edge.control.policy import PolicyContext, PolicyEngine, parse_policies
from mapper.edge.control.reconcile import Reconciler, plan
from mapper.edge.gpu.nvml import NvmlBackend
from mapper.edge.gpu.simnvml import SimNvml
from mapper.errors import ConfigError
from mapper.shared.model import Constraints, PolicyLimit, Value

CLOCKS = tuple(range(1980, 344, -15))  # an H100's supported graphics clocks, highest first (as the simulator's)
H100 = Constraints(
    power_limit_min_w=200.0, power_limit_max_w=700.0, power_limit_default_w=700.0, graphics_clocks_mhz=CLOCKS
)
UUID = "GPU-clocks"


def engine(**sections: object) -> PolicyEngine:
    return PolicyEngine(parse_policies(dict(sections)))


def decide(e: PolicyEngine, now_s: float, constraints: Constraints = H100, **values: Value):  # type: ignore[no-untyped-def]
    ctx = PolicyContext(constraints=constraints, current_power_limit_w=700.0, uuid=UUID)
    base: dict[str, Value] = {"temperature": 50, "utilization_gpu": 100, "power_limit": 700.0}
    return e.decide(UUID, {**base, **values}, ctx, now_s)


def test_thermal_throttling_steps_the_clock_down_with_the_same_hysteresis() -> None:
    e = engine(thermalThrottling={"actuator": "clocks", "coolDownPeriod": "60s"}, minChangeInterval="30s")
    d = decide(e, 0.0, temperature=90)
    (limit,) = d.limits
    assert limit == PolicyLimit("thermal", None, "step1-max-temp-85", clock_max_mhz=1782)
    assert d.policy_state == "thermal:throttling-step1"
    (event,) = d.events
    assert (event.action, event.old_clock_mhz, event.new_clock_mhz, event.old_cap_w) == ("step-down", 1980, 1782, None)
    assert event.to_payload()["newClockLimit"] == 1782 and "newPowerLimit" not in event.to_payload()
    assert decide(e, 10.0, temperature=90).limits[0].clock_max_mhz == 1782, "one change per interval"
    assert decide(e, 30.0, temperature=90).limits[0].clock_max_mhz == 1603
    decide(e, 40.0, temperature=79)  # cool-down starts
    assert decide(e, 99.0, temperature=79).limits[0].clock_max_mhz == 1603
    d = decide(e, 100.0, temperature=79)
    assert [ev.action for ev in d.events] == ["step-up"] and d.limits[0].clock_max_mhz == 1782
    d = decide(e, 130.0, temperature=79)
    assert [ev.action for ev in d.events] == ["release"] and d.limits == ()


def test_thermal_throttling_can_key_on_the_margin_to_the_gpus_own_slowdown_threshold() -> None:
    e = engine(thermalThrottling={"actuator": "clocks", "maxTempMargin": 5, "releaseTempMargin": 10})
    assert decide(e, 0.0, temperature=84, temperature_slowdown=89).limits == ()
    d = decide(e, 1.0, temperature=85, temperature_slowdown=89)
    assert d.limits and d.limits[0].reason == "step1-max-temp-84"
    # the same temperature on a GPU whose threshold is higher is no reason to throttle
    e2 = engine(thermalThrottling={"maxTempMargin": 5, "releaseTempMargin": 10})
    assert decide(e2, 0.0, temperature=85, temperature_slowdown=98).limits == ()


def test_a_gpu_with_no_clock_actuator_is_throttled_through_its_power_cap() -> None:
    e = engine(thermalThrottling={"actuator": "clocks"})
    no_clocks = Constraints(power_limit_min_w=200.0, power_limit_max_w=700.0, power_limit_default_w=700.0)
    (limit,) = decide(e, 0.0, constraints=no_clocks, temperature=90).limits
    assert limit.power_limit_w == 630.0 and limit.clock_max_mhz is None


def test_power_saving_locks_an_idle_gpu_to_its_idle_clock() -> None:
    e = engine(powerSaving={"enabled": True, "actuator": "clocks", "idleFor": "60s", "idleClock": "800MHz"})
    decide(e, 0.0, utilization_gpu=2)
    d = decide(e, 60.0, utilization_gpu=2)
    assert d.limits == (PolicyLimit("power-saving", None, "idle", clock_max_mhz=800),)
    assert d.events[0].new_clock_mhz == 800
    d = decide(e, 61.0, utilization_gpu=80)
    assert d.limits == () and [ev.action for ev in d.events] == ["restore"]


@pytest.mark.parametrize(
    ("section", "match"),
    [
        ({"thermalThrottling": {"actuator": "fans"}}, "policies.thermalThrottling.actuator: expected one of power"),
        ({"thermalThrottling": {"clockStep": "10W"}}, "policies.thermalThrottling.clockStep: expected a percent"),
        ({"powerSaving": {"idleClock": 800}}, "policies.powerSaving.idleClock: expected a percent"),
        (
            {"thermalThrottling": {"maxTempMargin": 10, "releaseTempMargin": 5}},
            "policies.thermalThrottling.releaseTempMargin: must be above maxTempMargin",
        ),
    ],
)
def test_bad_actuator_settings_are_refused_with_their_path(section: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_policies(section)


def test_the_actuator_settings_round_trip() -> None:
    c = parse_policies(
        {
            "thermalThrottling": {"actuator": "clocks", "clockStep": "90MHz", "maxTempMargin": 3},
            "powerSaving": {"actuator": "clocks", "idleClock": "40%"},
        }
    )
    assert parse_policies(c.to_mapping()) == c
    assert c.thermal.release_margin_c == 8.0


# --------------------------------------------------------------------------------------------------
# The reconciler's plan
# --------------------------------------------------------------------------------------------------


def test_a_clock_cap_locks_the_upper_clock_at_the_highest_supported_clock_below_it() -> None:
    p = plan(
        {}, {"locked_gpu_clock_min": 0, "locked_gpu_clock_max": 0}, H100, [PolicyLimit("thermal", None, "x", 1790)]
    )
    assert p.targets["locked_gpu_clocks"].value == (345, 1785)
    assert p.targets["locked_gpu_clocks"].origin == "policy"
    assert [(a.group, a.op, a.value) for a in p.actions] == [("locked_gpu_clocks", "set", (345, 1785))]


def test_a_clock_cap_below_the_clouds_locks_overrides_them_and_says_so() -> None:
    desired = DesiredState()
    desired.set_many({"locked_gpu_clock_min": 1005, "locked_gpu_clock_max": 1500}, "cloud", 1)
    effective = desired.effective()
    p = plan(effective, {}, H100, [PolicyLimit("power-saving", None, "idle", 1200)])
    assert p.targets["locked_gpu_clocks"].value == (1005, 1200)
    assert p.statuses["locked_gpu_clock_max"].text == "overridden-power_saving"
    # a cap above what the cloud asked for does not bind: the cloud's locks stand
    p = plan(effective, {}, H100, [PolicyLimit("thermal", None, "x", 1800)])
    assert p.targets["locked_gpu_clocks"].value == (1005, 1500) and p.targets["locked_gpu_clocks"].origin == "desired"


def test_a_clock_cap_below_the_clouds_upper_lock_alone_overrides_it_and_says_so() -> None:
    """The cloud asks only for the upper lock: the cap still overrides what it asked for, and the ack says so."""
    desired = DesiredState()
    desired.set_many({"locked_gpu_clock_max": 1500}, "cloud", 1)
    p = plan(desired.effective(), {}, H100, [PolicyLimit("power-saving", None, "idle", 1200)])
    assert p.targets["locked_gpu_clocks"].value == (345, 1200)
    assert p.statuses["locked_gpu_clock_max"].text == "overridden-power_saving"


def test_a_clock_cap_equal_to_the_clouds_upper_lock_does_not_bind() -> None:
    """Policies only tighten: a cap at exactly the clock the cloud locked changes nothing and overrides nothing."""
    desired = DesiredState()
    desired.set_many({"locked_gpu_clock_min": 1005, "locked_gpu_clock_max": 1500}, "cloud", 1)
    p = plan(desired.effective(), {}, H100, [PolicyLimit("thermal", None, "x", 1500)])
    assert p.targets["locked_gpu_clocks"].value == (1005, 1500)
    assert p.targets["locked_gpu_clocks"].origin == "desired"
    assert {prop: st.result for prop, st in p.statuses.items()} == {
        "locked_gpu_clock_min": "pending",
        "locked_gpu_clock_max": "pending",
    }


# --------------------------------------------------------------------------------------------------
# The hot-hour workload on the simulator, through the real backend and reconciler
# --------------------------------------------------------------------------------------------------


@dataclass
class Hot:
    clock: FakeClock
    sim: SimNvml
    worker: GpuWorker


@pytest.fixture
def hot() -> Iterator[Hot]:
    clock = FakeClock()
    sim = SimNvml(1, "H100", clock=clock.monotonic, scenario="heat")
    backend = NvmlBackend(sim, clock=clock)
    info = backend.list_gpus()[0]
    policies = PolicyEngine(parse_policies({"thermalThrottling": {"actuator": "clocks"}}))
    worker = GpuWorker(info, backend, Reconciler(backend, info.uuid, clock=clock), policies, clock)
    yield Hot(clock, sim, worker)
    backend.shutdown()


async def run_until(h: Hot, predicate, limit_s: int) -> None:  # type: ignore[no-untyped-def]
    for _ in range(limit_s):
        h.clock.advance(1.0)
        h.worker._woken = True
        await h.worker.tick()
        if predicate():
            return
    raise AssertionError(f"not within {limit_s} simulated seconds")


async def test_the_clocks_actuator_throttles_the_hot_hour_without_touching_the_power_cap(hot: Hot) -> None:
    gpu = hot.sim.gpu(hot.worker.uuid)
    await run_until(hot, lambda: gpu.locked_gpu_clocks is not None, limit_s=900)
    assert float(hot.worker.values["temperature"]) > 85
    assert gpu.locked_gpu_clocks is not None and gpu.locked_gpu_clocks[1] < 1980
    assert gpu.power_limit_w == 700.0, "the power cap is left alone"
    assert hot.worker.policy_state.startswith("thermal:throttling")
    # the clock cap brings the temperature back under maxTemp, then the job ends and the lock goes after cool-down
    await run_until(hot, lambda: float(hot.worker.values["temperature"]) <= 85, limit_s=900)
    hot.sim.set_scenario(hot.worker.uuid, "steady")
    await run_until(hot, lambda: gpu.locked_gpu_clocks is None, limit_s=3600)
    assert hot.worker.policy_state == "normal"
