"""Local policies acting on a Jetson through the GPU's maximum frequency, on fake time: the real JetsonBackend over a
simulated AGX Orin's sysfs tree (its physics stepped each cycle), the real PolicyEngine and the real Reconciler, as
the GPU loop wires them. A Jetson has no power cap, so the thermal and power-saving policies (actuator ``power`` or
``clocks``) cap the devfreq ``max_freq``, snapped to ``available_frequencies``, and give it back on release."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from mapper.clock import FakeClock
from mapper.edge.control.desired import DesiredState, make_desired
from mapper.edge.control.policy import POWER_SAVING, THERMAL, Decision, PolicyContext, PolicyEngine, parse_policies
from mapper.edge.control.reconcile import Reconciler, ReconcileResult, plan
from mapper.edge.gpu.jetson import JetsonBackend
from mapper.edge.gpu.simjetson import SimJetson, nvpmodel_command
from mapper.shared.model import Constraints, PolicyLimit, Value

#: Orin's devfreq steps (MHz), as the simulated board lists them.
ORIN_MHZ = (306.0, 408.0, 510.0, 612.0, 714.0, 816.0, 918.0, 1020.0, 1122.0, 1224.0, 1300.5)


#: The board's physics (and so its files) move every few simulated seconds: writing the tree is the slow part,
#: and the temperature's time constant is 40 s. The policies and the reconciler run every (1 s) cycle.
SIM_STEP_S = 4.0
#: What the policies and the reconciler read each cycle (the GPU loop's collect of these properties).
WATCHED = ("temperature", "utilization_gpu", "gpu_min_freq", "gpu_max_freq", "power_mode")


@dataclass
class Cycle:
    now_s: float
    values: dict[str, Value]
    decision: Decision
    result: ReconcileResult
    max_freq_mhz: float


@dataclass
class Orin:
    clock: FakeClock
    sim: SimJetson
    backend: JetsonBackend
    uuid: str
    engine: PolicyEngine
    reconciler: Reconciler
    desired: DesiredState = field(default_factory=DesiredState)
    history: list[Cycle] = field(default_factory=list)
    stepped_s: float = 0.0

    def cycle(self, dt_s: float = 1.0) -> Cycle:
        self.clock.advance(dt_s)
        if self.clock.monotonic() - self.stepped_s >= SIM_STEP_S:
            self.stepped_s = self.clock.monotonic()
            self.sim.step()
        sample = self.backend.sample(self.uuid, WATCHED)
        effective = self.desired.effective()
        d = effective.get("gpu_max_freq")
        desired_mhz = float(d.value) if d is not None and d.valid and isinstance(d.value, int | float) else None
        ctx = PolicyContext(
            constraints=self.reconciler.constraints(), desired_clock_max_mhz=desired_mhz, uuid=self.uuid
        )
        decision = self.engine.decide(self.uuid, sample.values, ctx, self.clock.monotonic())
        result = self.reconciler.step(effective, sample, decision.limits, restore=self.desired.pending_restore())
        for prop in result.restored:
            self.desired.mark_restored(prop)
        c = Cycle(self.clock.monotonic(), dict(sample.values), decision, result, self.max_freq_mhz)
        self.history.append(c)
        return c

    def run_until(self, predicate: Callable[[Cycle], bool], limit_s: int) -> Cycle:
        for _ in range(limit_s):
            c = self.cycle()
            if predicate(c):
                return c
        raise AssertionError(f"condition not met within {limit_s} simulated seconds")

    @property
    def max_freq_mhz(self) -> float:
        return int((self.sim.devfreq / "max_freq").read_text()) / 1e6

    def events(self, since: int = 0) -> list[dict[str, Any]]:
        return [e.to_payload() for c in self.history[since:] for e in c.decision.events]


def make_orin(tmp_path: Path, scenario: str, policies: dict[str, Any] | None = None) -> Orin:
    clock = FakeClock()
    root = tmp_path / "orin"
    sim = SimJetson.create(root, "orin-agx", scenario=scenario, clock=clock.monotonic)
    backend = JetsonBackend(root, nvpmodel=nvpmodel_command(root), clock=clock)
    uuid = backend.list_gpus()[0].uuid
    backend.set_power_mode(uuid, 0)  # MAXN: the whole range up to 1300.5 MHz (MODE_30W stops at 816)
    reconciler = Reconciler(backend, uuid, clock=clock, backoff_min_s=1.0, backoff_max_s=4.0)
    engine = PolicyEngine(parse_policies(policies))
    return Orin(clock, sim, backend, uuid, engine, reconciler)


def temp(c: Cycle) -> float:
    t = c.values.get("temperature")
    assert isinstance(t, int | float)
    return float(t)


def test_a_hot_half_hour_lowers_the_maximum_frequency_and_releases_it_after_the_cool_down(tmp_path: Path) -> None:
    orin = make_orin(tmp_path, "heat")
    assert orin.max_freq_mhz == 1300.5
    # Heat: above 85 C the first step lowers max_freq at once, 10% of 1300.5 MHz snapped down to a step.
    hot = orin.run_until(lambda c: temp(c) > 85, 900)
    assert hot.max_freq_mhz == 1122.0, "the first thermal step is taken in the cycle that crosses maxTemp"
    (first,) = orin.events(len(orin.history) - 1)
    assert (first["policy"], first["action"], first["oldClockLimit"], first["newClockLimit"]) == (
        "thermal",
        "step-down",
        1300.5,
        1170.0,
    )
    assert "oldPowerLimit" not in first and "newPowerLimit" not in first
    assert hot.decision.policy_state == "thermal:throttling-step1"
    (limit,) = hot.decision.limits
    assert limit.power_limit_w is None and limit.clock_max_mhz == 1170

    # The rest of the half hour: the caps stay on the GPU's steps, at most one change per minChangeInterval (30 s).
    start = len(orin.history)
    for _ in range(1800 - int(hot.now_s)):
        orin.cycle()
    hour = orin.history[start - 1 :]
    changes = [c for prev, c in itertools.pairwise(hour) if c.max_freq_mhz != prev.max_freq_mhz]
    assert changes, "the heat went on: throttling went further than one step"
    assert all(c.max_freq_mhz in ORIN_MHZ and c.max_freq_mhz < 1300.5 for c in hour)
    times = [hot.now_s] + [c.now_s for c in changes]
    assert all(b - a >= 30 for a, b in itertools.pairwise(times)), times
    # Hysteresis: once the temperature is back inside [80, 85] the cap holds, with no flapping.
    tail = orin.history[-600:]
    assert all(80 - 2 <= temp(c) <= 85 + 1 for c in tail), [temp(c) for c in tail][:20]
    assert len({c.max_freq_mhz for c in tail}) == 1 and not orin.events(len(orin.history) - 600)
    assert tail[-1].decision.policy_state.startswith("thermal:")

    # The heat ends: nothing moves before five minutes below releaseTemp, then the steps go back up and release.
    orin.sim.scenario = "idle"
    cool = orin.run_until(lambda c: temp(c) < 80, 600)
    held = cool.max_freq_mhz
    for _ in range(299):
        assert orin.cycle().max_freq_mhz == held, "the cool-down runs five minutes before the first step up"
    released = orin.run_until(lambda c: c.decision.policy_state == "normal", 600)
    assert released.max_freq_mhz == 1300.5, "on release the power mode's maximum comes back"
    actions = [e["action"] for e in orin.events(start) if e["policy"] == "thermal"]
    assert actions[-1] == "release" and "step-up" in actions
    assert orin.cycle().result.desired_status == "none"  # nothing desired, nothing overridden: the board as it was


def test_low_load_lowers_the_maximum_to_the_idle_clock_and_work_brings_it_back_in_one_cycle(tmp_path: Path) -> None:
    orin = make_orin(tmp_path, "idle", {"powerSaving": {"idleFor": "2m", "idleClock": "800MHz"}})
    for _ in range(119):
        assert orin.cycle().max_freq_mhz == 1300.5, "idle for less than idleFor: nothing capped"
    engaged = orin.run_until(lambda c: c.decision.policy_state == "power-saving:active", 5)
    assert engaged.max_freq_mhz == 714.0, "800 MHz snapped down to the step below it"
    (event,) = [e for e in orin.events(len(orin.history) - 1) if e["action"] == "engage"]
    assert (event["oldClockLimit"], event["newClockLimit"]) == (1300.5, 800.0)
    for _ in range(60):
        assert orin.cycle().max_freq_mhz == 714.0
    orin.sim.scenario = "training"
    busy = orin.run_until(lambda c: float(c.values.get("utilization_gpu") or 0) >= 10, 2 * int(SIM_STEP_S))
    assert busy.max_freq_mhz == 1300.5, "the first busy sample gives the maximum back"
    assert [e["action"] for e in orin.events(len(orin.history) - 1)] == ["restore"]


def test_the_clouds_desired_maximum_is_never_exceeded_and_shows_the_override(tmp_path: Path) -> None:
    orin = make_orin(tmp_path, "heat", {"thermalThrottling": {"actuator": "clocks", "clockStep": "10%"}})
    orin.desired.set("gpu_max_freq", "1020", "cloud", 1_000)
    first = orin.cycle()
    assert first.max_freq_mhz == 1020.0 and first.result.desired_status == "gpu_freq_range:applied"
    orin.sim.temp_c = 95.0  # a hot start: the board is above maxTemp in the next sample
    hot = orin.run_until(lambda c: c.decision.policy_state.startswith("thermal:throttling"), 2 * int(SIM_STEP_S))
    assert hot.max_freq_mhz == 918.0, "10% below the cloud's 1020 MHz, snapped down"
    assert hot.result.statuses["gpu_max_freq"].text == "overridden-thermal"
    assert hot.result.desired_status == "gpu_freq_range:overridden-thermal"
    (event,) = orin.events(len(orin.history) - 1)
    assert (event["oldClockLimit"], event["newClockLimit"]) == (1020.0, 918.0)
    orin.sim.scenario = "idle"
    orin.run_until(lambda c: c.decision.policy_state == "normal", 1800)
    after = orin.cycle()
    assert after.max_freq_mhz == 1020.0 and after.result.desired_status == "gpu_freq_range:applied"
    assert max(c.max_freq_mhz for c in orin.history) == 1020.0, "a policy never raised the cloud's maximum"


def test_a_policy_cap_above_the_clouds_maximum_does_not_bind(tmp_path: Path) -> None:
    orin = make_orin(tmp_path, "idle", {"powerSaving": {"idleFor": "1m", "idleClock": "1224MHz"}})
    orin.desired.set("gpu_max_freq", "612", "cloud", 1_000)
    c = orin.run_until(lambda c: c.decision.policy_state == "power-saving:active", 120)
    assert c.max_freq_mhz == 612.0 and not c.decision.limits, "an idle cap above the cloud's value is not emitted"
    assert orin.cycle().result.desired_status == "gpu_freq_range:applied"


def test_a_power_actuator_on_a_board_with_no_power_cap_acts_through_the_clocks_and_says_so_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    orin = make_orin(tmp_path, "idle", {"powerSaving": {"actuator": "power", "idleFor": "30s"}})
    with caplog.at_level(logging.INFO, logger="mapper.edge.control.policy"):
        c = orin.run_until(lambda c: c.decision.policy_state == "power-saving:active", 60)
        for _ in range(5):
            orin.cycle()
    assert c.max_freq_mhz == 306.0, "idleClock min: the lowest step"
    notes = [r.getMessage() for r in caplog.records if "no power cap" in r.getMessage()]
    assert len(notes) == 1 and orin.uuid in notes[0] and "power saving" in notes[0] and "max_freq" in notes[0]


def test_dry_run_on_a_jetson_decides_but_leaves_the_maximum(tmp_path: Path) -> None:
    orin = make_orin(tmp_path, "idle", {"dryRun": True, "powerSaving": {"idleFor": "30s"}})
    c = orin.run_until(lambda c: c.decision.policy_state == "dry-run:power-saving:active", 60)
    assert c.max_freq_mhz == 1300.5 and not c.decision.limits


def test_the_ceiling_is_the_clouds_maximum_as_written_even_above_the_power_modes(tmp_path: Path) -> None:
    orin = make_orin(tmp_path, "heat")
    orin.backend.set_power_mode(orin.uuid, 2)  # MODE_30W: its own maximum is 816 MHz
    orin.reconciler.invalidate()
    orin.desired.set("gpu_max_freq", "1100", "cloud", 1_000)  # written as 1020, the step below
    assert orin.cycle().max_freq_mhz == 1020.0
    orin.sim.temp_c = 95.0
    hot = orin.run_until(lambda c: c.decision.policy_state.startswith("thermal:throttling"), 2 * int(SIM_STEP_S))
    (event,) = orin.events(len(orin.history) - 1)
    assert (event["oldClockLimit"], event["newClockLimit"]) == (1020.0, 918.0), "one step below what is in force"
    assert hot.max_freq_mhz == 918.0


# --- the plan alone: a policy's clock cap on the devfreq range ---------------------------------------------------

ORIN_30W = Constraints(
    unsupported=frozenset({"power_limit", "locked_gpu_clocks", "locked_memory_clocks"}),
    gpu_freqs_mhz=ORIN_MHZ,
    gpu_freq_default_mhz=(306.0, 816.0),
)


def test_plan_a_cap_with_nothing_desired_lowers_the_power_modes_maximum_and_keeps_its_minimum() -> None:
    p = plan({}, {"gpu_min_freq": 306.0, "gpu_max_freq": 816.0}, ORIN_30W, [PolicyLimit(THERMAL, None, "x", 700)])
    assert p.targets["gpu_freq_range"].value == (306.0, 612.0) and p.targets["gpu_freq_range"].policy == THERMAL
    assert [a.value for a in p.actions] == [(306.0, 612.0)] and not p.statuses
    # a cap at or above what is in force does nothing; the lower of two caps binds
    assert not plan({}, {}, ORIN_30W, [PolicyLimit(THERMAL, None, "x", 900)]).targets
    two = [PolicyLimit(THERMAL, None, "x", 700), PolicyLimit(POWER_SAVING, None, "idle", 400)]
    assert plan({}, {}, ORIN_30W, two).targets["gpu_freq_range"].value == (306.0, 306.0)


def test_plan_a_cap_below_a_desired_minimum_lowers_both_ends_and_overrides_both() -> None:
    desired = {
        "gpu_min_freq": make_desired("gpu_min_freq", "714", "cloud", 1),
        "gpu_max_freq": make_desired("gpu_max_freq", "1020", "cloud", 1),
    }
    p = plan(desired, {}, ORIN_30W, [PolicyLimit(POWER_SAVING, None, "idle", 510)])
    assert p.targets["gpu_freq_range"].value == (510.0, 510.0)
    assert {k: s.text for k, s in p.statuses.items()} == {
        "gpu_min_freq": "overridden-power_saving",
        "gpu_max_freq": "overridden-power_saving",
    }


def test_plan_a_rejected_desired_value_keeps_its_reason_and_the_cap_still_binds() -> None:
    desired = {"gpu_max_freq": make_desired("gpu_max_freq", "100", "cloud", 1)}  # below the lowest step
    p = plan(desired, {}, ORIN_30W, [PolicyLimit(THERMAL, None, "x", 700)])
    assert p.statuses["gpu_max_freq"].text == "rejected-out-of-range"
    assert p.targets["gpu_freq_range"].value == (306.0, 612.0)


def test_plan_a_power_mode_switch_writes_the_policy_range_again_after_it() -> None:
    desired = {"power_mode": make_desired("power_mode", "3", "cloud", 1)}
    observed = {"power_mode": 2, "gpu_min_freq": 306.0, "gpu_max_freq": 612.0}
    cons = replace(ORIN_30W, power_modes=((0, "MAXN"), (2, "MODE_30W"), (3, "MODE_50W")))
    p = plan(desired, observed, cons, [PolicyLimit(THERMAL, None, "x", 700)])
    assert [(a.group, a.value) for a in p.actions] == [("power_mode", (3,)), ("gpu_freq_range", (306.0, 612.0))]


def test_a_desired_maximum_below_every_step_is_rejected_and_the_policy_acts_below_the_power_modes(
    tmp_path: Path,
) -> None:
    orin = make_orin(tmp_path, "heat")
    orin.desired.set("gpu_max_freq", "100", "cloud", 1_000)
    assert orin.cycle().result.desired_status == "gpu_freq_range:rejected-out-of-range"
    orin.sim.temp_c = 95.0
    hot = orin.run_until(lambda c: c.decision.policy_state.startswith("thermal:throttling"), 2 * int(SIM_STEP_S))
    assert hot.max_freq_mhz == 1122.0, "10% below MAXN's 1300.5 MHz, snapped down"
    assert hot.result.desired_status == "gpu_freq_range:rejected-out-of-range"
