"""Desired-state merging: sources, latest-change-wins, stale changes, removal, bad values, plain dicts."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mapper.edge.control.desired import DesiredState, make_desired, observed_desired_value
from mapper.errors import InvalidValueError
from mapper.shared.model import TWIN_VALUE_RE


def test_a_cloud_value_becomes_the_effective_desired_value() -> None:
    state = DesiredState()
    change = state.set("power_limit", "450", "cloud", 1_000)
    assert change is not None and change.after is not None
    assert change.before is None
    winner = state.effective()["power_limit"]
    assert winner.value == 450.0 and winner.source == "cloud" and winner.version_ms == 1_000


def test_the_latest_change_wins_between_cloud_and_edge() -> None:
    state = DesiredState()
    state.set("power_limit", "450", "cloud", 1_000)
    state.set("power_limit", "300", "edge", 2_000)
    assert state.get("power_limit") is not None
    assert state.effective()["power_limit"].value == 300.0
    state.set("power_limit", "350", "cloud", 3_000)
    assert state.effective()["power_limit"].source == "cloud"
    assert state.effective()["power_limit"].value == 350.0


def test_an_older_change_never_replaces_a_newer_one_and_is_counted() -> None:
    state = DesiredState()
    state.set("power_limit", "300", "edge", 5_000)
    assert state.set("power_limit", "450", "cloud", 4_000) is None
    assert state.set("power_limit", "200", "edge", 4_999) is None
    assert state.effective()["power_limit"].value == 300.0
    assert state.stale_ignored == {"cloud": 1, "edge": 1}


def test_a_stale_removal_is_ignored_too() -> None:
    state = DesiredState()
    state.set("compute_mode", "prohibited", "edge", 5_000)
    assert state.remove("compute_mode", "edge", 4_000) is None
    assert state.effective()["compute_mode"].value == "prohibited"
    assert state.stale_ignored == {"edge": 1}


def test_the_same_value_again_is_not_a_change_and_keeps_its_version() -> None:
    state = DesiredState()
    state.set("power_limit", "450", "cloud", 1_000)
    state.set("power_limit", "300", "edge", 2_000)
    # EdgeCore re-sends the unchanged cloud value (re-register): the edge's newer value stays.
    assert state.set("power_limit", "450", "cloud", 9_000) is None
    assert state.effective()["power_limit"].source == "edge"


def test_removal_falls_back_to_the_value_another_source_still_sets() -> None:
    state = DesiredState()
    state.set("power_limit", "450", "cloud", 1_000)
    state.set("power_limit", "300", "edge", 2_000)
    change = state.remove("power_limit", "edge", 3_000)
    assert change is not None and change.after is not None
    assert change.after.source == "cloud" and change.after.value == 450.0
    assert state.pending_restore() == frozenset()


def test_removal_by_the_only_source_leaves_no_desired_value_and_asks_for_restore() -> None:
    state = DesiredState()
    state.set("locked_gpu_clock_max", "1755", "cloud", 1_000)
    change = state.remove("locked_gpu_clock_max", "cloud", 2_000)
    assert change is not None and change.removed
    assert "locked_gpu_clock_max" not in state.effective()
    assert state.pending_restore() == frozenset({"locked_gpu_clock_max"})
    state.mark_restored("locked_gpu_clock_max")
    assert state.pending_restore() == frozenset()


def test_setting_a_value_again_cancels_a_pending_restore() -> None:
    state = DesiredState()
    state.set("power_limit", "450", "cloud", 1_000)
    state.remove("power_limit", "cloud", 2_000)
    state.set("power_limit", "400", "edge", 3_000)
    assert state.pending_restore() == frozenset()


def test_removing_what_a_source_never_set_changes_nothing() -> None:
    state = DesiredState()
    state.set("power_limit", "450", "cloud", 1_000)
    assert state.remove("power_limit", "edge", 2_000) is None
    assert state.remove("compute_mode", "cloud", 2_000) is None
    assert state.effective()["power_limit"].value == 450.0


def test_a_removal_reports_the_change_with_the_source_and_version_that_removed_it() -> None:
    state = DesiredState()
    state.set("power_limit", "450", "cloud", 1_000)
    change = state.remove("power_limit", "cloud", 2_000)
    assert change is not None
    assert (change.prop, change.source, change.version_ms, change.removed) == ("power_limit", "cloud", 2_000, True)
    assert change.before is not None and change.before.raw == "450"


def test_sync_source_sets_new_values_and_removes_absent_ones() -> None:
    state = DesiredState()
    state.sync_source("cloud", {"power_limit": "450", "compute_mode": "default"}, 1_000)
    state.set("persistence_mode", "true", "edge", 1_500)
    changes = state.sync_source("cloud", {"power_limit": "400"}, 2_000)
    assert {(c.prop, c.removed) for c in changes} == {("power_limit", False), ("compute_mode", True)}
    assert set(state.effective()) == {"power_limit", "persistence_mode"}
    assert state.pending_restore() == frozenset({"compute_mode"})


@pytest.mark.parametrize(
    ("prop", "raw", "reason"),
    [
        ("power_limit", "abc", "not-a-number"),
        ("power_limit", True, "wrong-type"),
        ("power_limit", "nan", "nan"),
        ("power_limit", "inf", "infinite"),
        ("power_limit", "-5", "negative"),
        ("power_limit", "", "empty"),
        ("power_limit", "9" * 600, "too-long"),
        ("power_limit", "45\u00b0", "non-ascii"),
        ("locked_gpu_clock_min", "1200.5", "wrong-type"),
        ("persistence_mode", "maybe", "wrong-type"),
        ("compute_mode", 3, "wrong-type"),
        ("compute_mode", "exclusive_thread", "unknown-value"),
        ("temperature", "50", "read-only"),
        ("warp_drive", "9", "unknown-property"),
    ],
)
def test_a_bad_raw_value_is_kept_with_its_rejection_reason_not_raised(prop: str, raw: object, reason: str) -> None:
    state = DesiredState()
    change = state.set(prop, raw, "cloud", 1_000)  # type: ignore[arg-type]
    assert change is not None
    kept = state.effective()[prop]
    assert not kept.valid
    assert kept.reason == reason
    assert kept.value is None
    assert kept.message  # says what was wrong
    assert (kept.prop, kept.raw, kept.source, kept.version_ms) == (prop, raw, "cloud", 1_000), "what was refused"


def test_compute_mode_names_are_normalised() -> None:
    assert make_desired("compute_mode", "Exclusive-Process", "cloud", 1).value == "exclusive_process"


def test_an_unknown_source_is_refused_with_a_clear_error() -> None:
    with pytest.raises(ValueError, match="'policy' is not one of cloud, edge, file"):
        DesiredState().set("power_limit", "450", "policy", 1)  # type: ignore[arg-type]


def test_observed_desired_is_what_was_received_made_twin_safe() -> None:
    assert observed_desired_value(None) == ""
    assert observed_desired_value(make_desired("power_limit", "450", "cloud", 1)) == "450"
    assert observed_desired_value(make_desired("power_limit", 450.0, "file", 1)) == "450"
    assert observed_desired_value(make_desired("persistence_mode", True, "file", 1)) == "true"
    weird = observed_desired_value(make_desired("compute_mode", "exclusive process\u00e9", "cloud", 1))
    assert TWIN_VALUE_RE.fullmatch(weird)
    long = observed_desired_value(make_desired("power_limit", "9" * 600, "cloud", 1))
    assert TWIN_VALUE_RE.fullmatch(long)
    state = DesiredState()
    state.set("power_limit", "nan", "cloud", 1)
    assert state.observed_desired_value("power_limit") == "nan"


def test_a_state_round_trips_through_plain_json_dicts() -> None:
    state = DesiredState()
    state.set("power_limit", "450", "cloud", 1_000)
    state.set("power_limit", "300", "edge", 2_000)
    state.set("compute_mode", "bogus", "file", 1_500)
    state.set("locked_gpu_clock_max", "1755", "cloud", 1_000)
    state.remove("locked_gpu_clock_max", "cloud", 2_500)
    state.set("power_limit", "1", "cloud", 500)  # stale, counted
    copy = DesiredState.from_dict(json.loads(json.dumps(state.to_dict())))
    assert copy.effective() == state.effective()
    assert copy.pending_restore() == frozenset({"locked_gpu_clock_max"})
    assert copy.effective()["compute_mode"].reason == "unknown-value"
    assert copy.stale_ignored == {"cloud": 1}
    # The removal's version is kept: an older cloud value still cannot come back.
    assert copy.set("locked_gpu_clock_max", "1500", "cloud", 2_000) is None


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"format": 99}, "format 99"),
        ({"format": 1, "properties": []}, "'properties' is not a mapping"),
        ({"format": 1, "properties": {"power_limit": {"sky": {"version_ms": 1}}}}, "unknown source"),
        ({"format": 1, "properties": {"power_limit": {"cloud": {"version_ms": "x"}}}}, "integer version_ms"),
        ({"format": 1, "properties": {"power_limit": {"cloud": {"version_ms": 1, "raw": [1]}}}}, "not a scalar"),
        ({"format": 1, "restore": "power_limit"}, "'restore' is not a list"),
    ],
)
def test_a_malformed_plain_dict_is_refused_naming_what_is_wrong(data: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidValueError, match=message):
        DesiredState.from_dict(data)


def test_set_many_applies_every_value_of_a_delta() -> None:
    state = DesiredState()
    changes = state.set_many({"power_limit": "300", "compute_mode": "prohibited"}, "edge", 7)
    assert {c.prop for c in changes} == {"power_limit", "compute_mode"}
    assert {d.source for d in state.effective().values()} == {"edge"}


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["cloud", "edge", "file"]), st.integers(min_value=0, max_value=20)),
        min_size=1,
        max_size=30,
    )
)
def test_whatever_the_arrival_order_the_newest_accepted_change_wins(ops: list[tuple[str, int]]) -> None:
    state = DesiredState()
    newest = -1
    expected: tuple[str, int, str] | None = None
    stale = 0
    for i, (source, version) in enumerate(ops):
        raw = str(200 + i)  # every change is a new value
        state.set("power_limit", raw, source, version)  # type: ignore[arg-type]
        if version >= newest:
            newest, expected = version, (source, version, raw)
        else:
            stale += 1
    winner = state.get("power_limit")
    assert winner is not None and expected is not None
    assert (winner.source, winner.version_ms, winner.raw) == expected
    assert sum(state.stale_ignored.values()) == stale
