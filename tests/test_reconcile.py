"""Enforcing desired GPU state: the pure plan, the twins and acks, and the Reconciler over the real NvmlBackend
driving the simulated NVML (the only stand-in)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mapper.edge.control.reconcile as reconcile_module
from mapper.clock import FakeClock
from mapper.edge.control.desired import DesiredState, DesiredValue, make_desired
from mapper.edge.control.reconcile import (
    GROUPS,
    Ack,
    Action,
    Reconciler,
    ReconcileResult,
    Status,
    desired_status_twin,
    parse_desired_status,
    plan,
)
from mapper.edge.gpu.nvml import NvmlBackend
from mapper.edge.gpu.simnvml import SimGpu, SimNvml
from mapper.edge.storage.store import DesiredStore
from mapper.shared.model import TWIN_VALUE_RE, Constraints, PolicyLimit, Sample, Scalar, Value
from mapper.wire.payloads import ack_payload

H100 = Constraints(
    power_limit_min_w=200.0,
    power_limit_max_w=700.0,
    power_limit_default_w=700.0,
    memory_clocks_mhz=(2619,),
    graphics_clocks_mhz=tuple(range(1980, 329, -15)),
)
AT_DEFAULT: Mapping[str, Value] = {
    "power_limit": 700.0,
    "locked_gpu_clock_min": 0,
    "locked_gpu_clock_max": 0,
    "locked_memory_clock_min": 0,
    "locked_memory_clock_max": 0,
    "persistence_mode": False,
    "compute_mode": "default",
}


def want(**values: Scalar) -> dict[str, DesiredValue]:
    return {prop: make_desired(prop, raw, "cloud", 1_000) for prop, raw in values.items()}


# --------------------------------------------------------------------------------------------------
# plan: valid values
# --------------------------------------------------------------------------------------------------


def test_a_valid_power_limit_plans_one_set_and_is_pending_until_read_back() -> None:
    p = plan(want(power_limit="450"), AT_DEFAULT, H100)
    assert p.actions == (Action("power_limit", "set", (450.0,), "desired"),)
    assert p.statuses["power_limit"] == Status("pending")
    done = plan(want(power_limit="450"), {**AT_DEFAULT, "power_limit": 450.0}, H100)
    assert done.actions == ()
    assert done.statuses["power_limit"].text == "applied"


def test_a_power_limit_read_back_within_a_milliwatt_counts_as_applied() -> None:
    p = plan(want(power_limit="450.0004"), {**AT_DEFAULT, "power_limit": 450.0}, H100)
    assert p.actions == () and p.statuses["power_limit"].text == "applied"
    assert plan(want(power_limit="450.01"), {**AT_DEFAULT, "power_limit": 450.0}, H100).actions


def test_the_power_limit_bounds_themselves_are_accepted() -> None:
    assert plan(want(power_limit="200"), AT_DEFAULT, H100).statuses["power_limit"].text == "pending"
    assert plan(want(power_limit="700"), AT_DEFAULT, H100).statuses["power_limit"].text == "applied"


def test_a_clock_pair_plans_one_locked_clocks_call() -> None:
    p = plan(want(locked_gpu_clock_min="1200", locked_gpu_clock_max="1755"), AT_DEFAULT, H100)
    assert p.actions == (Action("locked_gpu_clocks", "set", (1200, 1755), "desired"),)
    assert p.statuses["locked_gpu_clock_min"] == p.statuses["locked_gpu_clock_max"] == Status("pending")


def test_a_zero_zero_clock_pair_resets_the_locked_clocks() -> None:
    locked = {**AT_DEFAULT, "locked_gpu_clock_min": 1200, "locked_gpu_clock_max": 1755}
    p = plan(want(locked_gpu_clock_min="0", locked_gpu_clock_max="0"), locked, H100)
    assert p.actions == (Action("locked_gpu_clocks", "reset", (), "desired"),)


def test_a_lone_max_clock_caps_from_the_lowest_supported_clock() -> None:
    p = plan(want(locked_gpu_clock_max="1755"), AT_DEFAULT, H100)
    assert p.actions == (Action("locked_gpu_clocks", "set", (min(H100.graphics_clocks_mhz), 1755), "desired"),)
    assert "locked_gpu_clock_min" not in p.statuses
    assert p.statuses["locked_gpu_clock_max"].text == "pending"


def test_modes_plan_their_setters() -> None:
    p = plan(want(persistence_mode="on", compute_mode="exclusive_process"), AT_DEFAULT, H100)
    assert set(p.actions) == {
        Action("persistence_mode", "set", (True,), "desired"),
        Action("compute_mode", "set", ("exclusive_process",), "desired"),
    }
    done = plan(
        want(persistence_mode="on", compute_mode="exclusive_process"),
        {**AT_DEFAULT, "persistence_mode": True, "compute_mode": "exclusive_process"},
        H100,
    )
    assert done.actions == ()
    assert {done.statuses["persistence_mode"].text, done.statuses["compute_mode"].text} == {"applied"}


def test_nothing_desired_plans_nothing() -> None:
    p = plan({}, AT_DEFAULT, H100)
    assert p.actions == () and p.statuses == {} and p.targets == {}


# --------------------------------------------------------------------------------------------------
# plan: every bad input is rejected with its reason and leaves the GPU unchanged
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "prop", "reason"),
    [
        ({"power_limit": "900"}, "power_limit", "out-of-range"),
        ({"power_limit": "150"}, "power_limit", "out-of-range"),
        ({"power_limit": "lots"}, "power_limit", "not-a-number"),
        ({"power_limit": True}, "power_limit", "wrong-type"),
        ({"power_limit": "NaN"}, "power_limit", "nan"),
        ({"power_limit": "Infinity"}, "power_limit", "infinite"),
        ({"power_limit": "-300"}, "power_limit", "negative"),
        ({"power_limit": "  "}, "power_limit", "empty"),
        ({"power_limit": "4" * 513}, "power_limit", "too-long"),
        ({"power_limit": "\uff14\uff15\uff10"}, "power_limit", "non-ascii"),
        ({"locked_gpu_clock_min": "0", "locked_gpu_clock_max": "1755"}, "locked_gpu_clock_max", "unpaired"),
        ({"locked_gpu_clock_min": "1200", "locked_gpu_clock_max": "0"}, "locked_gpu_clock_min", "unpaired"),
        ({"locked_gpu_clock_min": "1755", "locked_gpu_clock_max": "1200"}, "locked_gpu_clock_min", "out-of-range"),
        (
            {"locked_gpu_clock_min": "1201", "locked_gpu_clock_max": "1755"},
            "locked_gpu_clock_min",
            "not-supported-clock",
        ),
        ({"locked_gpu_clock_min": "1200", "locked_gpu_clock_max": "3000"}, "locked_gpu_clock_max", "out-of-range"),
        (
            {"locked_memory_clock_min": "1593", "locked_memory_clock_max": "1593"},
            "locked_memory_clock_min",
            "out-of-range",
        ),
        ({"locked_gpu_clock_min": "x", "locked_gpu_clock_max": "1755"}, "locked_gpu_clock_min", "not-a-number"),
        ({"locked_gpu_clock_min": "x", "locked_gpu_clock_max": "1755"}, "locked_gpu_clock_max", "not-a-number"),
        ({"compute_mode": "exclusive_thread"}, "compute_mode", "unknown-value"),
        ({"persistence_mode": "sometimes"}, "persistence_mode", "wrong-type"),
    ],
)
def test_a_bad_desired_value_is_rejected_with_its_reason_and_plans_no_action(
    values: dict[str, Scalar], prop: str, reason: str
) -> None:
    p = plan(want(**values), AT_DEFAULT, H100)
    assert p.statuses[prop] == Status("rejected", reason)
    assert p.statuses[prop].text == f"rejected-{reason}"
    assert p.actions == ()


def test_a_lone_clock_side_without_a_supported_list_is_unpaired() -> None:
    p = plan(want(locked_memory_clock_max="1593"), AT_DEFAULT, Constraints())
    assert p.statuses["locked_memory_clock_max"].text == "rejected-unpaired"
    assert p.actions == ()


def test_a_property_the_gpu_cannot_set_is_rejected_not_supported_without_an_action() -> None:
    t4ish = Constraints(
        power_limit_min_w=60.0,
        power_limit_max_w=70.0,
        power_limit_default_w=70.0,
        unsupported=frozenset({"locked_memory_clock_min", "locked_memory_clock_max", "power_limit"}),
    )
    p = plan(want(power_limit="65", locked_memory_clock_min="5001", locked_memory_clock_max="5001"), {}, t4ish)
    assert p.statuses["power_limit"].text == "rejected-not-supported"
    assert p.statuses["locked_memory_clock_max"].text == "rejected-not-supported"
    assert p.actions == ()


# --------------------------------------------------------------------------------------------------
# plan: clamping (operator config)
# --------------------------------------------------------------------------------------------------


def test_clamp_mode_brings_an_out_of_range_power_limit_to_the_nearest_bound_and_says_so() -> None:
    p = plan(want(power_limit="900"), {**AT_DEFAULT, "power_limit": 450.0}, H100, clamp=True)
    assert p.actions == (Action("power_limit", "set", (700.0,), "desired"),)
    assert p.targets["power_limit"].clamped
    low = plan(want(power_limit="20"), {**AT_DEFAULT, "power_limit": 200.0}, H100, clamp=True)
    assert low.actions == () and low.statuses["power_limit"].text == "applied-clamped"


def test_clamp_mode_picks_the_nearest_supported_clock() -> None:
    p = plan(want(locked_gpu_clock_min="1201", locked_gpu_clock_max="2500"), AT_DEFAULT, H100, clamp=True)
    assert p.actions == (Action("locked_gpu_clocks", "set", (1200, 1980), "desired"),)
    assert p.statuses["locked_gpu_clock_min"] == Status("pending", "clamped")


def test_clamp_mode_still_rejects_values_that_are_not_numbers_or_inverted() -> None:
    assert plan(want(power_limit="nan"), AT_DEFAULT, H100, clamp=True).statuses["power_limit"].text == "rejected-nan"
    inverted = plan(want(locked_gpu_clock_min="1755", locked_gpu_clock_max="1200"), AT_DEFAULT, H100, clamp=True)
    assert inverted.statuses["locked_gpu_clock_min"].text == "rejected-out-of-range"


# --------------------------------------------------------------------------------------------------
# plan: policies only tighten
# --------------------------------------------------------------------------------------------------


def test_a_policy_cap_above_the_clouds_value_changes_nothing() -> None:
    p = plan(want(power_limit="400"), {**AT_DEFAULT, "power_limit": 400.0}, H100, [PolicyLimit("thermal", 500.0)])
    assert p.actions == ()
    assert p.statuses["power_limit"].text == "applied"


def test_a_policy_cap_below_the_clouds_value_wins_and_says_overridden() -> None:
    limits = [PolicyLimit("power-saving", 350.0), PolicyLimit("thermal", 300.0, "hot")]
    p = plan(want(power_limit="400"), {**AT_DEFAULT, "power_limit": 400.0}, H100, limits)
    assert p.actions == (Action("power_limit", "set", (300.0,), "policy"),)
    assert p.statuses["power_limit"].text == "overridden-thermal"
    assert p.targets["power_limit"].policy == "thermal"


def test_a_policy_cap_below_the_gpu_minimum_becomes_the_minimum() -> None:
    p = plan(want(power_limit="400"), AT_DEFAULT, H100, [PolicyLimit("thermal", 50.0)])
    assert p.actions == (Action("power_limit", "set", (200.0,), "policy"),)


def test_a_policy_caps_from_the_default_when_nothing_is_desired() -> None:
    p = plan({}, AT_DEFAULT, H100, [PolicyLimit("thermal", 500.0)])
    assert p.actions == (Action("power_limit", "set", (500.0,), "policy"),)
    assert p.statuses == {}
    assert plan({}, AT_DEFAULT, H100, [PolicyLimit("thermal", 800.0)]).actions == ()


def test_a_policy_still_tightens_while_the_desired_value_is_rejected() -> None:
    p = plan(want(power_limit="9000"), {**AT_DEFAULT, "power_limit": 450.0}, H100, [PolicyLimit("thermal", 400.0)])
    assert p.actions == (Action("power_limit", "set", (400.0,), "policy"),)
    assert p.statuses["power_limit"].text == "rejected-out-of-range"
    loose = plan(want(power_limit="9000"), {**AT_DEFAULT, "power_limit": 450.0}, H100, [PolicyLimit("thermal", 600.0)])
    assert loose.actions == ()  # the bad value leaves the GPU as it is; a looser cap never raises it


# --------------------------------------------------------------------------------------------------
# plan: removal restores defaults
# --------------------------------------------------------------------------------------------------


def test_a_removed_power_limit_returns_to_the_default() -> None:
    p = plan({}, {**AT_DEFAULT, "power_limit": 450.0}, H100, restore={"power_limit"})
    assert p.actions == (Action("power_limit", "set", (700.0,), "default"),)
    assert p.restored == frozenset()
    assert plan({}, AT_DEFAULT, H100, restore={"power_limit"}).restored == {"power_limit"}


def test_removed_clocks_are_unlocked() -> None:
    locked = {**AT_DEFAULT, "locked_gpu_clock_min": 1200, "locked_gpu_clock_max": 1755}
    p = plan({}, locked, H100, restore={"locked_gpu_clock_min", "locked_gpu_clock_max"})
    assert p.actions == (Action("locked_gpu_clocks", "reset", (), "default"),)


def test_removed_modes_are_left_as_they_are_unless_restore_modes_is_on() -> None:
    now = {**AT_DEFAULT, "persistence_mode": True, "compute_mode": "prohibited"}
    kept = plan({}, now, H100, restore={"persistence_mode", "compute_mode"})
    assert kept.actions == () and kept.restored == {"persistence_mode", "compute_mode"}
    reset = plan({}, now, H100, restore={"persistence_mode", "compute_mode"}, restore_modes=True)
    assert set(reset.actions) == {
        Action("persistence_mode", "set", (False,), "default"),
        Action("compute_mode", "set", ("default",), "default"),
    }


def test_a_removed_power_limit_under_an_active_policy_keeps_the_policy_cap() -> None:
    p = plan({}, {**AT_DEFAULT, "power_limit": 300.0}, H100, [PolicyLimit("thermal", 300.0)], restore={"power_limit"})
    assert p.actions == () and p.restored == frozenset()


# --------------------------------------------------------------------------------------------------
# desired_status twin and acks
# --------------------------------------------------------------------------------------------------


def test_desired_status_names_each_group_in_a_parseable_form() -> None:
    statuses = {
        "power_limit": Status("overridden", "thermal"),
        "locked_gpu_clock_min": Status("rejected", "out-of-range"),
        "locked_gpu_clock_max": Status("rejected", "out-of-range"),
        "persistence_mode": Status("pending"),
    }
    text = desired_status_twin(statuses)
    assert text == "power_limit:overridden-thermal,locked_gpu_clocks:rejected-out-of-range,persistence_mode:pending"
    assert parse_desired_status(text) == {
        "power_limit": "overridden-thermal",
        "locked_gpu_clocks": "rejected-out-of-range",
        "persistence_mode": "pending",
    }
    assert desired_status_twin({}) == "none" and parse_desired_status("none") == {}


def test_desired_status_fits_the_twin_charset_with_every_property_rejected_by_the_longest_reason() -> None:
    longest = max(["not-supported-clock", "out-of-range", "no-permission", "unknown-property", "not-a-number"], key=len)
    every = {prop: Status("rejected", longest) for props in GROUPS.values() for prop in props}
    text = desired_status_twin(every)
    assert TWIN_VALUE_RE.fullmatch(text)
    assert len(parse_desired_status(text)) == len(GROUPS)
    hostile = {prop: Status("overridden", "a very, long: policy name " * 20) for prop in every}
    assert TWIN_VALUE_RE.fullmatch(desired_status_twin(hostile))


def test_a_malformed_desired_status_is_refused_naming_the_part() -> None:
    with pytest.raises(ValueError, match="'warp:applied'"):
        parse_desired_status("power_limit:applied,warp:applied")


def test_an_ack_is_compact_json_with_every_field() -> None:
    ack = Ack(
        uuid="GPU-1",
        property="power_limit",
        desired="450",
        source="cloud",
        version_ms=1_000,
        result="applied",
        reason="",
        applied_at_ms=2_000,
        effective_value="450",
        reported_value="450",
        ts_ms=2_000,
    )
    text = ack_payload(ack.as_dict()).decode()
    assert " " not in text
    assert json.loads(text) == {
        "uuid": "GPU-1",
        "property": "power_limit",
        "desired": "450",
        "source": "cloud",
        "version_ms": 1_000,
        "result": "applied",
        "reason": "",
        "applied_at_ms": 2_000,
        "effective_value": "450",
        "reported_value": "450",
        "ts_ms": 2_000,
    }


def test_desired_values_come_from_desired_state_unchanged() -> None:
    state = DesiredState()
    state.set("power_limit", "450", "edge", 5)
    p = plan(state.effective(), AT_DEFAULT, H100)
    assert p.actions == (Action("power_limit", "set", (450.0,), "desired"),)


# ==================================================================================================
# The Reconciler over the real NvmlBackend driving the simulated NVML
# ==================================================================================================


@dataclass
class Rig:
    clock: FakeClock
    sim: SimNvml
    backend: NvmlBackend
    uuid: str
    reconciler: Reconciler
    state: DesiredState

    def cycle(self, limits: Iterable[PolicyLimit] = (), constraints: Constraints | None = None) -> ReconcileResult:
        """One collect cycle as the lead runs it: sample, step, then forget restored removals."""
        sample = self.backend.sample(self.uuid)
        result = self.reconciler.step(
            self.state.effective(), sample, limits, restore=self.state.pending_restore(), constraints=constraints
        )
        for prop in result.restored:
            self.state.mark_restored(prop)
        return result

    @property
    def gpu(self) -> SimGpu:
        return self.sim.gpu(self.uuid)

    def calls(self, fname: str) -> int:
        return self.sim.calls[fname]


def make_rig(clock: FakeClock, profile: str = "H100", **reconciler_kwargs: object) -> Rig:
    sim = SimNvml(1, profile, seed=3, clock=clock.monotonic, sleep=lambda s: None)
    backend = NvmlBackend(sim, clock=clock)
    uuid = sim.gpus[0].uuid
    options: dict[str, object] = {
        "backoff_min_s": 1.0,
        "backoff_max_s": 4.0,
        "unsupported_retry_s": 300.0,
        "no_permission_retry_s": 120.0,
    }
    options.update(reconciler_kwargs)
    reconciler = Reconciler(backend, uuid, clock=clock, **options)  # type: ignore[arg-type]
    return Rig(clock, sim, backend, uuid, reconciler, DesiredState())


def setter_calls(rig: Rig) -> int:
    return sum(n for f, n in rig.sim.calls.items() if f.startswith(("nvmlDeviceSet", "nvmlDeviceReset")))


@pytest.fixture
def rig(fake_clock: FakeClock) -> Iterator[Rig]:
    r = make_rig(fake_clock)
    try:
        yield r
    finally:
        r.backend.shutdown()


@pytest.fixture
def t4(fake_clock: FakeClock) -> Iterator[Rig]:
    r = make_rig(fake_clock, "T4")
    try:
        yield r
    finally:
        r.backend.shutdown()


def test_a_desired_power_limit_is_applied_read_back_and_acked_in_one_step(rig: Rig) -> None:
    rig.state.set("power_limit", "450", "cloud", 1_000)
    result = rig.cycle()
    assert rig.gpu.power_limit_mw == 450_000
    assert result.statuses["power_limit"].text == "applied"
    assert [o.outcome for o in result.actions] == ["ok"]
    (ack,) = result.acks
    assert (ack.property, ack.result, ack.source, ack.version_ms) == ("power_limit", "applied", "cloud", 1_000)
    assert ack.effective_value == "450" and ack.reported_value == "450"
    assert ack.applied_at_ms == rig.clock.wall_ms()
    assert result.desired_status == "power_limit:applied"
    # Level-triggered: the next cycle compares again, finds nothing to do, and says nothing new.
    again = rig.cycle()
    assert again.actions == () and again.acks == ()
    assert again.statuses["power_limit"].text == "applied"


def test_every_writable_property_is_applied_on_the_gpu(rig: Rig) -> None:
    rig.state.sync_source(
        "cloud",
        {
            "power_limit": "500",
            "locked_gpu_clock_min": "1200",
            "locked_gpu_clock_max": "1755",
            "locked_memory_clock_min": "2619",
            "locked_memory_clock_max": "2619",
            "persistence_mode": "true",
            "compute_mode": "exclusive_process",
        },
        1_000,
    )
    result = rig.cycle()
    assert {s.text for s in result.statuses.values()} == {"applied"}
    gpu = rig.gpu
    assert gpu.power_limit_mw == 500_000
    assert gpu.locked_gpu_clocks == (1200, 1755)
    assert gpu.locked_memory_clocks == (2619, 2619)
    assert gpu.persistence_mode == 1
    assert gpu.compute_mode == 3
    assert len(result.acks) == 7
    assert result.desired_status == (
        "power_limit:applied,locked_gpu_clocks:applied,locked_memory_clocks:applied,"
        "persistence_mode:applied,compute_mode:applied"
    )


@pytest.mark.parametrize(
    ("values", "prop", "reason"),
    [
        ({"power_limit": "900"}, "power_limit", "out-of-range"),
        ({"power_limit": "abc"}, "power_limit", "not-a-number"),
        ({"power_limit": "nan"}, "power_limit", "nan"),
        ({"power_limit": "inf"}, "power_limit", "infinite"),
        ({"power_limit": "-1"}, "power_limit", "negative"),
        ({"power_limit": ""}, "power_limit", "empty"),
        ({"power_limit": "1" * 600}, "power_limit", "too-long"),
        ({"power_limit": "45\u00e9"}, "power_limit", "non-ascii"),
        ({"locked_gpu_clock_min": "0", "locked_gpu_clock_max": "1755"}, "locked_gpu_clock_min", "unpaired"),
        (
            {"locked_gpu_clock_min": "1201", "locked_gpu_clock_max": "1755"},
            "locked_gpu_clock_max",
            "not-supported-clock",
        ),
        ({"compute_mode": "shared"}, "compute_mode", "unknown-value"),
        ({"persistence_mode": "2"}, "persistence_mode", "wrong-type"),
    ],
)
def test_a_bad_value_is_rejected_with_its_reason_and_the_gpu_is_unchanged(
    rig: Rig, values: dict[str, Scalar], prop: str, reason: str
) -> None:
    rig.state.sync_source("cloud", values, 1_000)
    setters_before = setter_calls(rig)
    result = rig.cycle()
    assert result.statuses[prop].text == f"rejected-{reason}"
    assert setter_calls(rig) == setters_before
    gpu = rig.gpu
    assert (gpu.power_limit_mw, gpu.locked_gpu_clocks, gpu.compute_mode, gpu.persistence_mode) == (700_000, None, 0, 0)
    acked = {a.property: a for a in result.acks}
    assert acked[prop].result == "rejected" and acked[prop].reason == reason
    assert result.counters.rejections.get(reason, 0) >= 1
    assert TWIN_VALUE_RE.fullmatch(result.desired_status)
    assert TWIN_VALUE_RE.fullmatch(rig.state.observed_desired_value(prop) or "x")


def test_a_rejected_change_leaves_the_previous_value_in_force(rig: Rig) -> None:
    rig.state.set("power_limit", "450", "cloud", 1_000)
    rig.cycle()
    rig.state.set("power_limit", "9000", "cloud", 2_000)
    result = rig.cycle()
    assert result.statuses["power_limit"].text == "rejected-out-of-range"
    assert rig.gpu.power_limit_mw == 450_000


def test_clamp_mode_applies_the_nearest_allowed_value_and_says_so(fake_clock: FakeClock) -> None:
    r = make_rig(fake_clock, clamp=True)
    try:
        r.state.sync_source("cloud", {"power_limit": "900", "locked_gpu_clock_min": "1201"}, 1_000)
        result = r.cycle()
        assert r.gpu.power_limit_mw == 700_000
        assert result.statuses["power_limit"].text == "applied-clamped"
        assert r.gpu.locked_gpu_clocks == (1200, max(r.reconciler.constraints().graphics_clocks_mhz))
        ack = next(a for a in result.acks if a.property == "power_limit")
        assert (ack.desired, ack.effective_value, ack.reason) == ("900", "700", "clamped")
    finally:
        r.backend.shutdown()


def test_an_invalid_value_refused_by_the_gpu_itself_is_rejected_with_its_reason(rig: Rig) -> None:
    # Constraints unknown (e.g. the read failed): the plan cannot check the range, NVML refuses it.
    rig.state.set("power_limit", "900", "cloud", 1_000)
    result = rig.cycle(constraints=Constraints())
    assert result.statuses["power_limit"].text == "rejected-out-of-range"
    assert [o.outcome for o in result.actions] == ["rejected"]
    assert rig.gpu.power_limit_mw == 700_000
    # Not retried every cycle.
    calls = rig.calls("nvmlDeviceSetPowerManagementLimit")
    rig.clock.advance(10)
    assert rig.cycle(constraints=Constraints()).actions == ()
    assert rig.calls("nvmlDeviceSetPowerManagementLimit") == calls


def test_not_supported_is_reported_once_and_not_retried_every_cycle(t4: Rig) -> None:
    t4.state.sync_source("cloud", {"locked_memory_clock_min": "5001", "locked_memory_clock_max": "5001"}, 1_000)
    first = t4.cycle()
    assert first.statuses["locked_memory_clock_min"].text == "rejected-not-supported"
    assert [a.reason for a in first.acks] == ["not-supported", "not-supported"]
    assert [(o.action.group, o.action.value, o.outcome) for o in first.actions] == [
        ("locked_memory_clocks", (5001, 5001), "not-supported")
    ], "the outcome names the action the GPU refused"
    tries = t4.calls("nvmlDeviceSetMemoryLockedClocks")
    assert tries == 1
    for _ in range(10):
        t4.clock.advance(10)
        later = t4.cycle()
        assert later.acks == ()
        assert later.statuses["locked_memory_clock_max"].text == "rejected-not-supported"
    assert t4.calls("nvmlDeviceSetMemoryLockedClocks") == tries
    assert first.counters.rejections == {"not-supported": 2}
    t4.clock.advance(300)
    t4.reconciler.invalidate()  # constraints re-read: the backend has learnt the GPU cannot do it
    retried = t4.cycle()
    assert retried.statuses["locked_memory_clock_min"].text == "rejected-not-supported"
    assert t4.calls("nvmlDeviceSetMemoryLockedClocks") == tries  # known unsupported: no call at all


def test_an_ack_carries_a_desired_number_as_a_number_and_a_long_string_cut_to_512_characters(rig: Rig) -> None:
    """A desired value from a file can be a JSON number: the ack keeps it (it is no string to cut); a string is
    cut to 512 characters so that one huge value cannot swell every ack."""
    rig.state.set("power_limit", 300, "file", 1_000)
    rig.state.set("compute_mode", "x" * 600, "cloud", 1_000)
    acks = {a.property: a for a in rig.cycle().acks}
    assert acks["power_limit"].desired == 300 and acks["power_limit"].result == "applied"
    assert acks["compute_mode"].desired == "x" * 512 and acks["compute_mode"].reason == "too-long"


def test_not_supported_is_retried_at_once_when_the_desired_value_changes(t4: Rig) -> None:
    t4.state.sync_source("cloud", {"locked_memory_clock_min": "5001", "locked_memory_clock_max": "5001"}, 1_000)
    t4.reconciler.constraints()  # read before the GPU is known not to support it
    t4.cycle()
    assert t4.calls("nvmlDeviceSetMemoryLockedClocks") == 1
    t4.state.sync_source("cloud", {"locked_memory_clock_min": "0", "locked_memory_clock_max": "0"}, 2_000)
    result = t4.cycle()
    assert t4.calls("nvmlDeviceResetMemoryLockedClocks") == 1
    assert result.statuses["locked_memory_clock_min"].text == "rejected-not-supported"


def test_no_permission_is_reported_as_such_and_retried_rarely(rig: Rig) -> None:
    rig.sim.set_as_root(False)
    rig.state.set("power_limit", "450", "cloud", 1_000)
    result = rig.cycle()
    assert result.statuses["power_limit"].text == "rejected-no-permission"
    assert result.acks[0].reason == "no-permission"
    assert rig.calls("nvmlDeviceSetPowerManagementLimit") == 1
    for _ in range(11):
        rig.clock.advance(10)
        assert rig.cycle().actions == ()
    rig.sim.set_as_root(True)
    rig.clock.advance(10)  # 120 s since the refusal
    healed = rig.cycle()
    assert healed.statuses["power_limit"].text == "applied"
    assert rig.gpu.power_limit_mw == 450_000


def test_transient_errors_are_retried_with_capped_exponential_backoff(rig: Rig) -> None:
    rig.state.set("power_limit", "450", "cloud", 1_000)
    rig.sim.inject_errors("nvmlDeviceSetPowerManagementLimit", pynvml.NVML_ERROR_TIMEOUT, count=5, uuid=rig.uuid)
    attempts: list[float] = []
    statuses: list[str] = []
    start = rig.clock.monotonic()
    for _ in range(40):
        before = rig.calls("nvmlDeviceSetPowerManagementLimit")
        result = rig.cycle()
        if rig.calls("nvmlDeviceSetPowerManagementLimit") > before:
            attempts.append(rig.clock.monotonic() - start)
        statuses.append(result.statuses["power_limit"].text)
        if statuses[-1] == "applied":
            break
        rig.clock.advance(0.5)
    # Waits 1, 2, 4, then capped at 4 s; the sixth try succeeds.
    assert attempts == [0.0, 1.0, 3.0, 7.0, 11.0, 15.0]
    assert set(statuses[:-1]) == {"pending"} and statuses[-1] == "applied"
    assert rig.gpu.power_limit_mw == 450_000
    assert result.counters.actions[("power_limit", "transient")] == 5
    assert result.counters.actions[("power_limit", "ok")] == 1


def test_a_lost_gpu_keeps_the_value_pending(rig: Rig) -> None:
    rig.state.set("power_limit", "450", "cloud", 1_000)
    rig.sim.inject_gpu_lost(rig.uuid)
    result = rig.reconciler.step(rig.state.effective(), None, ())
    assert result.statuses["power_limit"].text == "pending"
    assert [o.outcome for o in result.actions] == ["transient"]


def test_a_reapply_the_gpu_does_not_take_is_a_read_back_mismatch_pending_and_retried_with_backoff(rig: Rig) -> None:
    rig.state.set("power_limit", "450", "cloud", 1_000)
    assert rig.cycle().statuses["power_limit"].text == "applied"
    # Another tool sets 300 W, and the driver now says yes to every power limit and changes nothing.
    rig.gpu.power_limit_mw = 300_000
    real = rig.sim.nvmlDeviceSetPowerManagementLimit
    calls: list[tuple[object, ...]] = []
    rig.sim.nvmlDeviceSetPowerManagementLimit = lambda *args: calls.append(args)  # type: ignore[method-assign]
    rig.clock.advance(1.0)
    result = rig.cycle()
    (outcome,) = result.actions
    assert (outcome.outcome, outcome.drift) == ("readback-mismatch", True)
    assert "reads back as 300000 mW" in outcome.error
    # Not a rejection: pending, and the cloud hears so with the value the GPU really has.
    assert result.statuses["power_limit"].text == "pending"
    assert result.desired_status == "power_limit:pending"
    (ack,) = result.acks
    assert (ack.result, ack.reason, ack.applied_at_ms) == ("pending", "", None)
    assert (ack.effective_value, ack.reported_value) == ("450", "300")
    assert result.counters.actions[("power_limit", "readback-mismatch")] == 1
    assert ("power_limit", "rejected") not in result.counters.actions
    assert result.counters.drift_reapplies == {"power_limit": 1}
    # Backed off like a transient error (1 s, then 2 s), not parked for unsupported_retry_s (300 s).
    assert rig.cycle().actions == () and len(calls) == 1
    rig.clock.advance(1.0)
    again = rig.cycle()
    assert [(o.outcome, o.drift) for o in again.actions] == [("readback-mismatch", False)] and len(calls) == 2
    assert again.acks == (), "still pending: nothing new to say"
    assert again.counters.drift_reapplies == {"power_limit": 1}, "one drift episode, counted once"
    rig.sim.nvmlDeviceSetPowerManagementLimit = real  # type: ignore[method-assign]
    rig.clock.advance(1.0)
    assert rig.cycle().actions == (), "the second backoff is 2 s"
    rig.clock.advance(1.0)
    healed = rig.cycle()
    assert healed.statuses["power_limit"].text == "applied" and rig.gpu.power_limit_mw == 450_000
    assert [a.result for a in healed.acks] == ["applied"]


def test_drift_after_a_simulated_driver_reload_is_reapplied_within_one_step_and_counted(rig: Rig) -> None:
    rig.state.sync_source(
        "cloud",
        {
            "power_limit": "450",
            "locked_gpu_clock_min": "1200",
            "locked_gpu_clock_max": "1755",
            "persistence_mode": "on",
            "compute_mode": "prohibited",
        },
        1_000,
    )
    assert {s.text for s in rig.cycle().statuses.values()} == {"applied"}
    rig.sim.driver_reload()
    gpu = rig.gpu
    assert (gpu.power_limit_mw, gpu.locked_gpu_clocks, gpu.persistence_mode, gpu.compute_mode) == (700_000, None, 0, 0)
    rig.clock.advance(1)
    result = rig.cycle()
    gpu = rig.gpu
    assert (gpu.power_limit_mw, gpu.locked_gpu_clocks, gpu.persistence_mode, gpu.compute_mode) == (
        450_000,
        (1200, 1755),
        1,
        2,
    )
    assert {s.text for s in result.statuses.values()} == {"applied"}
    assert result.counters.drift_reapplies == {
        "power_limit": 1,
        "locked_gpu_clocks": 1,
        "persistence_mode": 1,
        "compute_mode": 1,
    }
    assert all(o.drift for o in result.actions)
    assert result.acks == ()  # the status never changed from the cloud's point of view


def test_another_tool_changing_the_setting_is_drift_too(rig: Rig) -> None:
    rig.state.set("power_limit", "450", "edge", 1_000)
    rig.cycle()
    rig.gpu.power_limit_mw = 300_000  # nvidia-smi -pl 300 by hand
    result = rig.cycle()
    assert rig.gpu.power_limit_mw == 450_000
    assert result.counters.drift_reapplies == {"power_limit": 1}


def test_a_stale_change_is_ignored_and_the_gpu_keeps_the_newer_value(rig: Rig) -> None:
    rig.state.set("power_limit", "300", "edge", 5_000)
    rig.cycle()
    assert rig.state.set("power_limit", "450", "cloud", 4_000) is None
    result = rig.cycle()
    assert rig.gpu.power_limit_mw == 300_000
    assert result.acks == ()
    assert rig.state.stale_ignored == {"cloud": 1}


def test_removal_returns_the_gpu_to_its_defaults(rig: Rig) -> None:
    rig.state.sync_source(
        "cloud",
        {
            "power_limit": "450",
            "locked_gpu_clock_min": "1200",
            "locked_gpu_clock_max": "1755",
            "compute_mode": "prohibited",
        },
        1_000,
    )
    rig.cycle()
    rig.state.sync_source("cloud", {}, 2_000)
    result = rig.cycle()
    gpu = rig.gpu
    assert gpu.power_limit_mw == 700_000
    assert gpu.locked_gpu_clocks is None
    assert gpu.compute_mode == 2  # modes are left as the operator set them
    reasons = {a.property: a.reason for a in result.acks}
    assert reasons == {
        "power_limit": "default-restored",
        "locked_gpu_clock_min": "default-restored",
        "locked_gpu_clock_max": "default-restored",
        "compute_mode": "released",
    }
    assert result.desired_status == "none"
    assert rig.state.pending_restore() == frozenset()
    quiet = rig.cycle()
    assert quiet.actions == () and quiet.acks == ()
    rig.gpu.power_limit_mw = 300_000  # released: no longer enforced
    assert rig.cycle().actions == ()


def test_removal_with_restore_modes_resets_persistence_and_compute_mode(fake_clock: FakeClock) -> None:
    r = make_rig(fake_clock, restore_modes=True)
    try:
        r.state.sync_source("file", {"persistence_mode": "true", "compute_mode": "prohibited"}, 1_000)
        r.cycle()
        assert (r.gpu.persistence_mode, r.gpu.compute_mode) == (1, 2)
        r.state.sync_source("file", {}, 2_000)
        r.cycle()
        assert (r.gpu.persistence_mode, r.gpu.compute_mode) == (0, 0)
    finally:
        r.backend.shutdown()


def test_a_policy_cap_above_the_cloud_value_changes_nothing_on_the_gpu(rig: Rig) -> None:
    rig.state.set("power_limit", "400", "cloud", 1_000)
    result = rig.cycle([PolicyLimit("thermal", 500.0)])
    assert rig.gpu.power_limit_mw == 400_000
    assert result.statuses["power_limit"].text == "applied"


def test_a_policy_cap_below_the_cloud_value_is_applied_and_lifted(rig: Rig) -> None:
    rig.state.set("power_limit", "400", "cloud", 1_000)
    rig.cycle()
    capped = rig.cycle([PolicyLimit("thermal", 300.0, "temperature 88 C")])
    assert rig.gpu.power_limit_mw == 300_000
    assert capped.statuses["power_limit"].text == "overridden-thermal"
    (ack,) = capped.acks
    assert (ack.result, ack.reason, ack.desired, ack.effective_value) == ("overridden", "thermal", "400", "300")
    assert capped.desired_status == "power_limit:overridden-thermal"
    lifted = rig.cycle()
    assert rig.gpu.power_limit_mw == 400_000
    assert lifted.statuses["power_limit"].text == "applied"


def test_a_policy_without_a_desired_value_caps_from_the_default_and_lifting_it_restores_the_default(
    rig: Rig,
) -> None:
    rig.cycle([PolicyLimit("power-saving", 500.0)])
    assert rig.gpu.power_limit_mw == 500_000
    result = rig.cycle()
    assert rig.gpu.power_limit_mw == 700_000
    assert result.statuses == {}


def test_restart_enforces_the_persisted_desired_state_without_edgecore(fake_clock: FakeClock, tmp_path: Path) -> None:
    state = DesiredState()
    state.sync_source(
        "cloud", {"power_limit": "350", "locked_gpu_clock_min": "1200", "locked_gpu_clock_max": "1500"}, 1
    )
    with DesiredStore(tmp_path) as store:
        store.save("default/gpu-0", state, uuid="GPU-x")
    # The node reboots: a fresh GPU at its defaults, a fresh mapper, no DMI and no broker at all.
    r = make_rig(fake_clock)
    try:
        with DesiredStore(tmp_path) as store:
            (stored,) = store.load_all()
        r.state = stored.state
        result = r.cycle()
        assert r.gpu.power_limit_mw == 350_000
        assert r.gpu.locked_gpu_clocks == (1200, 1500)
        assert {s.text for s in result.statuses.values()} == {"applied"}
    finally:
        r.backend.shutdown()


def test_a_removal_persisted_before_a_restart_still_restores_the_default(rig: Rig, tmp_path: Path) -> None:
    rig.state.set("power_limit", "450", "cloud", 1_000)
    rig.cycle()
    rig.state.remove("power_limit", "cloud", 2_000)
    with DesiredStore(tmp_path) as store:
        store.save("default/gpu-0", rig.state)
        loaded = store.load("default/gpu-0")
    assert loaded is not None
    # A new mapper process on the same (not rebooted) GPU: a fresh reconciler that never set anything.
    rig.reconciler = Reconciler(rig.backend, rig.uuid, clock=rig.clock)
    rig.state = loaded.state
    result = rig.cycle()
    assert rig.gpu.power_limit_mw == 700_000
    assert result.restored == {"power_limit"}
    assert rig.state.pending_restore() == frozenset()


def test_the_ack_json_names_source_version_and_both_values(rig: Rig) -> None:
    rig.state.set("compute_mode", "exclusive_process", "edge", 1_780_000_000_123)
    (ack,) = rig.cycle().acks
    payload = json.loads(ack_payload(ack.as_dict()))
    assert payload["uuid"] == rig.uuid
    assert payload["source"] == "edge" and payload["version_ms"] == 1_780_000_000_123
    assert payload["desired"] == "exclusive_process"
    assert payload["effective_value"] == "exclusive_process" and payload["reported_value"] == "exclusive_process"


def test_reconciler_settings_are_validated_with_clear_errors(rig: Rig) -> None:
    with pytest.raises(ValueError, match="backoff_min_s must be a positive"):
        Reconciler(rig.backend, rig.uuid, clock=rig.clock, backoff_min_s=0)
    with pytest.raises(ValueError, match=r"backoff_max_s .* is below backoff_min_s"):
        Reconciler(rig.backend, rig.uuid, clock=rig.clock, backoff_min_s=5, backoff_max_s=1)
    with pytest.raises(ValueError, match="UUID"):
        Reconciler(rig.backend, "", clock=rig.clock)


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from([p for props in GROUPS.values() for p in props]),
        st.tuples(st.sampled_from(["applied", "pending", "rejected", "overridden"]), st.text(max_size=80)),
    )
)
def test_desired_status_is_always_within_the_twin_charset_and_parses_back(
    raw: dict[str, tuple[str, str]],
) -> None:
    statuses = {prop: Status(result, reason) for prop, (result, reason) in raw.items()}  # type: ignore[arg-type]
    text = desired_status_twin(statuses)
    assert TWIN_VALUE_RE.fullmatch(text)
    parsed = parse_desired_status(text)
    assert set(parsed) == {group for group, props in GROUPS.items() if any(p in statuses for p in props)}
    for status in parsed.values():
        assert status.split("-", 1)[0] in ("applied", "pending", "rejected", "overridden")


def test_a_sample_of_another_gpu_is_refused(rig: Rig) -> None:
    other = Sample(uuid="GPU-other", ts_ms=1, values={"power_limit": 300.0})
    with pytest.raises(ValueError, match="was given a sample of GPU GPU-other"):
        rig.reconciler.step({}, other)


def test_a_partial_sample_does_not_make_the_reconciler_reapply_what_it_set(rig: Rig) -> None:
    rig.state.set("persistence_mode", "on", "cloud", 1)
    rig.cycle()
    calls = rig.calls("nvmlDeviceSetPersistenceMode")
    # The collector sampled only the fast properties this cycle.
    fast = rig.backend.sample(rig.uuid, ["temperature", "power_usage"])
    result = rig.reconciler.step(rig.state.effective(), fast)
    assert result.actions == ()
    assert rig.calls("nvmlDeviceSetPersistenceMode") == calls
    assert result.statuses["persistence_mode"].text == "applied"


def test_drift_whose_reapply_fails_first_is_counted_once_and_healed_after_backoff(rig: Rig) -> None:
    rig.state.set("power_limit", "450", "cloud", 1)
    rig.cycle()
    rig.gpu.power_limit_mw = 600_000
    rig.sim.inject_errors("nvmlDeviceSetPowerManagementLimit", pynvml.NVML_ERROR_TIMEOUT, count=1, uuid=rig.uuid)
    failed = rig.cycle()
    assert failed.statuses["power_limit"].text == "pending"
    assert [a.result for a in failed.acks] == ["pending"]
    rig.clock.advance(1)
    healed = rig.cycle()
    assert rig.gpu.power_limit_mw == 450_000
    assert healed.counters.drift_reapplies == {"power_limit": 1}
    assert [a.result for a in healed.acks] == ["applied"]


@pytest.mark.parametrize(
    ("setter", "prop", "target", "drifted"),
    [
        # the backend's own read-back of the limit (set_power_limit reads it back) differs
        ("nvmlDeviceSetPowerManagementLimit", "power_limit", "450", "300"),
        # the setter returns, and the step's read-back sample shows the old mode
        ("nvmlDeviceSetComputeMode", "compute_mode", "prohibited", "default"),
    ],
)
def test_a_drift_reapply_the_gpu_reads_back_otherwise_is_pending_counted_once_and_never_acked_applied(
    rig: Rig, setter: str, prop: str, target: str, drifted: str
) -> None:
    rig.state.set(prop, target, "cloud", 1_000)
    assert rig.cycle().statuses[prop].text == "applied"
    # another tool changes the setting, and the GPU now ignores the setter while saying yes
    if prop == "power_limit":
        rig.gpu.power_limit_mw = 300_000
    else:
        rig.gpu.compute_mode = 0
    real = getattr(rig.sim, setter)
    calls: list[tuple[object, ...]] = []
    setattr(rig.sim, setter, lambda *args: calls.append(args))
    rig.clock.advance(1)
    result = rig.cycle()
    assert len(calls) == 1
    [outcome] = result.actions
    assert (outcome.outcome, outcome.drift) == ("readback-mismatch", True)
    assert result.statuses[prop].text == "pending", "never 'applied' while the GPU reads otherwise"
    [ack] = result.acks
    assert (ack.property, ack.result, ack.effective_value, ack.reported_value) == (prop, "pending", target, drifted)
    assert result.counters.drift_reapplies == {prop: 1}
    assert result.counters.actions[(prop, "readback-mismatch")] == 1
    assert result.desired_status == f"{prop}:pending"
    # backed off: the next step calls nothing and says nothing new
    quiet = rig.cycle()
    assert (len(calls), quiet.actions, quiet.acks) == (1, (), ())
    assert quiet.statuses[prop].text == "pending"
    # after the backoff it tries again: the same episode of drift, not counted twice
    rig.clock.advance(1)
    again = rig.cycle()
    assert len(calls) == 2 and [(o.outcome, o.drift) for o in again.actions] == [("readback-mismatch", False)]
    assert again.counters.drift_reapplies == {prop: 1} and again.acks == ()
    assert again.counters.actions[(prop, "readback-mismatch")] == 2
    # a GPU that takes the value again: applied, acked as such
    setattr(rig.sim, setter, real)
    rig.clock.advance(5)
    healed = rig.cycle()
    assert healed.statuses[prop].text == "applied"
    assert [(a.result, a.reported_value) for a in healed.acks] == [("applied", target)]
    assert healed.counters.drift_reapplies == {prop: 1}
    assert (rig.gpu.power_limit_mw if prop == "power_limit" else rig.gpu.compute_mode) == (
        450_000 if prop == "power_limit" else 2
    )


def test_would_act_says_when_a_step_may_call_the_gpu_and_a_quiet_step_calls_nothing(rig: Rig) -> None:
    sample = rig.backend.sample(rig.uuid)
    assert rig.reconciler.would_act({}, sample), "constraints not read yet: the step may do I/O"
    rig.reconciler.constraints()
    assert not rig.reconciler.would_act({}, sample)
    rig.state.set("power_limit", "450", "cloud", 1_000)
    assert rig.reconciler.would_act(rig.state.effective(), sample)
    rig.cycle()
    sample = rig.backend.sample(rig.uuid)
    assert not rig.reconciler.would_act(rig.state.effective(), sample), "in force: nothing to set"
    before = sum(n for f, n in rig.sim.calls.items() if "Set" in f or "Reset" in f or "Get" in f)
    result = rig.reconciler.step(rig.state.effective(), sample)
    after = sum(n for f, n in rig.sim.calls.items() if "Set" in f or "Reset" in f or "Get" in f)
    assert after == before and result.statuses["power_limit"].text == "applied"
    rig.sim.driver_reload()
    rig.reconciler.invalidate()
    assert rig.reconciler.would_act(rig.state.effective(), sample), "after a reload: re-read and re-apply"


def count_plans(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Every call of ``reconcile.plan`` from now on, recorded (the real plan still runs)."""
    plans: list[object] = []
    real_plan = reconcile_module.plan

    def counting_plan(*args: Any, **kwargs: Any) -> Any:
        plans.append(args)
        return real_plan(*args, **kwargs)

    monkeypatch.setattr(reconcile_module, "plan", counting_plan)
    return plans


def test_a_step_given_the_prepared_plan_plans_no_second_time_and_ends_the_same(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    sample = rig.backend.sample(rig.uuid)
    assert rig.reconciler.prepare({}, sample) is None, "constraints not read yet: no plan without them"
    rig.reconciler.constraints()
    rig.state.set("power_limit", "450", "cloud", 1_000)
    rig.cycle()
    sample = rig.backend.sample(rig.uuid)
    desired = rig.state.effective()
    planned = rig.reconciler.prepare(desired, sample)
    assert planned is not None and not planned.actions
    plans = count_plans(monkeypatch)
    with_plan = rig.reconciler.step(desired, sample, planned=planned)
    assert plans == [], "the prepared plan is used as the first plan"
    without = rig.reconciler.step(desired, sample)
    assert len(plans) == 1
    assert with_plan.statuses == without.statuses
    assert with_plan.targets == without.targets


def test_a_gpu_with_nothing_desired_is_not_planned_each_cycle_and_leaves_idle_at_once_when_asked(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    plans = count_plans(monkeypatch)
    rig.reconciler.constraints()
    idle = rig.cycle()
    assert plans == [], "nothing desired, no cap, nothing held: no plan to make"
    assert (idle.statuses, idle.actions, idle.acks, idle.targets) == ({}, (), (), {})
    assert idle.observed["power_limit"] == 700.0 and idle.desired_status == "none"
    # The same answer as the full path (a plan from scratch) gives for these inputs.
    full = plan({}, idle.observed, rig.reconciler.constraints(), [])
    assert (full.actions, dict(full.statuses), dict(full.targets)) == ((), {}, {})
    # A policy cap is enforced in the very next step.
    capped = rig.cycle(limits=[PolicyLimit("thermal", 500.0, "too hot")])
    assert rig.gpu.power_limit_mw == 500_000 and capped.actions
    plans.clear()
    # Lifting it restores the default, with its acks, and only then is the GPU idle again.
    lifted = rig.cycle()
    assert rig.gpu.power_limit_mw == 700_000 and lifted.actions and plans
    for _ in range(3):
        rig.cycle()
    plans.clear()
    rig.cycle()
    assert plans == [], "back to idle once the default is verified and acked"
    # A desired value set from the cloud is applied in the next step.
    rig.state.set("power_limit", "450", "cloud", 5_000)
    applied = rig.cycle()
    assert rig.gpu.power_limit_mw == 450_000
    assert [a.property for a in applied.acks] == ["power_limit"]


def test_idle_steps_on_the_same_values_share_one_result_until_a_real_step_changes_the_counters(rig: Rig) -> None:
    rig.reconciler.constraints()
    values = dict(rig.backend.sample(rig.uuid).values)
    first = rig.reconciler.step({}, Sample(rig.uuid, 1, values))
    again = rig.reconciler.step({}, Sample(rig.uuid, 2, values))
    assert again is first, "the GPU loop's values dict did not change: the idle result is kept"
    assert again.observed is values
    other = dict(values)
    fresh = rig.reconciler.step({}, Sample(rig.uuid, 3, other))
    assert fresh is not first and fresh.observed is other
    # A policy cap is enforced (an action counted), lifted (the default restored), then the GPU is idle again:
    # the idle result now shows the new counts, not the ones kept from before.
    rig.cycle(limits=[PolicyLimit("thermal", 500.0, "too hot")])
    for _ in range(5):
        rig.cycle()
    assert rig.reconciler.counters.actions.get(("power_limit", "ok"), 0) >= 2
    idle = rig.reconciler.step({}, Sample(rig.uuid, 4, other))
    assert idle is not fresh
    assert idle.counters == rig.reconciler.counters
    assert idle.counters is not rig.reconciler.counters, "a result holds a copy, not the live counters"
    assert fresh.counters.actions == {}, "the earlier result kept the counts of its own time"
    # A driver reload (invalidate) drops the kept result as well.
    rig.reconciler.invalidate()
    rig.reconciler.constraints()
    assert rig.reconciler.step({}, Sample(rig.uuid, 5, other)) is not idle
