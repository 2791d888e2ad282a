"""Enforcing desired GPU state: the pure plan, the twins and acks, and the Reconciler over the real NvmlBackend
driving the simulated NVML (the only stand-in)."""

from __future__ import annotations

import json
from collections.abc import Mapping

import pytest

from mapper.desired import DesiredState, DesiredValue, make_desired
from mapper.model import TWIN_VALUE_RE, Constraints, PolicyLimit, Scalar, Value
from mapper.reconcile import (
    GROUPS,
    Ack,
    Action,
    Status,
    ack_to_json,
    desired_status_twin,
    parse_desired_status,
    plan,
)

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
    text = ack_to_json(ack)
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
