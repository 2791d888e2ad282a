"""Local policies: config parsing and pure decisions on synthetic samples and fake time."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mapper.clock import FakeClock
from mapper.edge.control import policy
from mapper.edge.control.policy import (
    Amount,
    Decision,
    HealthState,
    PolicyConfig,
    PolicyContext,
    PolicyEngine,
    PolicyState,
    PowerSavingState,
    ThermalState,
    decide,
    format_duration,
    merge_override,
    parse_duration,
    parse_policies,
)
from mapper.edge.gpu.nvml import NvmlBackend
from mapper.edge.gpu.simnvml import SimNvml
from mapper.errors import ConfigError
from mapper.shared.model import DEVICE_STATES, TWIN_VALUE_RE, Constraints, GpuEvent, Value

H100 = Constraints(power_limit_min_w=200.0, power_limit_max_w=700.0, power_limit_default_w=700.0)
ISSUE_EXAMPLE = {
    "dryRun": False,
    "minChangeInterval": "30s",
    "thermalThrottling": {"enabled": True, "maxTemp": 85, "releaseTemp": 80, "coolDownPeriod": "5m", "step": "10%"},
    "powerSaving": {"enabled": True, "threshold": 10, "idleFor": "2m", "idlePowerLimit": "min"},
    "health": {"enabled": True, "criticalXids": [48, 62, 64, 74, 79, 95, 119, 120], "eccUncorrected": True},
}


def config(**sections: Mapping[str, object] | object) -> PolicyConfig:
    """The issue's example config with some keys replaced (sections merge one level deep)."""
    raw: dict[str, object] = {k: dict(v) if isinstance(v, dict) else v for k, v in ISSUE_EXAMPLE.items()}
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(raw.get(key), dict):
            raw[key] = {**raw[key], **value}  # type: ignore[dict-item]
        else:
            raw[key] = value
    return parse_policies(raw)


@dataclass
class Gpu:
    """A policy loop over one GPU with a stand-in for the reconciler: the GPU's power limit becomes
    min(cloud desired, policy limits), and the pre-policy limit is restored when the limits go away."""

    config: PolicyConfig
    desired_w: float | None = None
    limit_w: float = 700.0
    constraints: Constraints = H100
    state: PolicyState = field(default_factory=PolicyState)
    decisions: list[Decision] = field(default_factory=list)
    limit_changes: int = 0

    def step(
        self, now_s: float, events: tuple[GpuEvent, ...] = (), gpu_lost: bool = False, **values: Value
    ) -> Decision:
        ctx = PolicyContext(
            constraints=self.constraints,
            desired_power_limit_w=self.desired_w,
            current_power_limit_w=self.limit_w,
            events=events,
            gpu_lost=gpu_lost,
            uuid="GPU-test",
        )
        self.state, decision = decide(self.state, values, ctx, self.config, now_s)
        self.decisions.append(decision)
        before = self.limit_w
        cap = decision.power_limit_w
        if cap is not None:
            self.limit_w = min(cap, self.desired_w if self.desired_w is not None else math.inf)
        elif self.desired_w is not None:
            self.limit_w = self.desired_w
        elif decision.restore_power_limit_w is not None:
            self.limit_w = decision.restore_power_limit_w
        if self.limit_w != before:
            self.limit_changes += 1
        return decision


def cap_events(decisions: list[Decision]) -> list[str]:
    return [f"{e.policy}:{e.action}" for d in decisions for e in d.events if e.changes_cap]


# --------------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------------


def test_the_issue_example_parses_to_exact_values() -> None:
    c = parse_policies(ISSUE_EXAMPLE)
    assert c.min_change_interval_s == 30.0 and c.dry_run is False
    assert (c.thermal.max_temp_c, c.thermal.release_temp_c, c.thermal.cool_down_s) == (85.0, 80.0, 300.0)
    assert c.thermal.step == Amount("percent", 10.0)
    assert (c.power_saving.enabled, c.power_saving.threshold_pct, c.power_saving.idle_for_s) == (True, 10.0, 120.0)
    assert c.power_saving.idle_power_limit == Amount("min")
    assert c.health.critical_xids >= frozenset({48, 62, 64, 74, 79, 95, 119, 120})
    assert c.health.action == "none"


def test_a_missing_policies_section_gives_documented_defaults() -> None:
    c = parse_policies(None)
    assert c == PolicyConfig()
    assert c.thermal.enabled and c.health.enabled and not c.power_saving.enabled
    assert parse_policies({}) == c


def test_a_section_written_without_enabled_is_enabled() -> None:
    assert parse_policies({"powerSaving": {"threshold": 5}}).power_saving.enabled is True


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("250ms", 0.25), ("30s", 30.0), ("5m", 300.0), ("1h", 3600.0), ("1m30s", 90.0), ("1.5s", 1.5), ("0s", 0.0)],
)
def test_durations_parse_with_their_unit(text: str, seconds: float) -> None:
    assert parse_duration(text, "x") == pytest.approx(seconds)


@pytest.mark.parametrize("raw", ["30", 30, "5 minutes", "m5", "", "-5s", "5m3", True])
def test_a_duration_without_a_valid_unit_is_refused_with_its_path(raw: object) -> None:
    with pytest.raises(ConfigError, match=r"^policies\.minChangeInterval: expected a duration"):
        parse_policies({"minChangeInterval": raw})


def test_durations_format_back_to_their_shortest_spelling() -> None:
    assert [format_duration(s) for s in (300.0, 3600.0, 30.0, 0.25, 90.0)] == ["5m", "1h", "30s", "250ms", "90s"]


def test_steps_and_idle_limits_accept_percent_watts_and_min() -> None:
    c = config(thermalThrottling={"step": "25W"}, powerSaving={"idlePowerLimit": "150W"})
    assert c.thermal.step == Amount("watts", 25.0) and c.power_saving.idle_power_limit == Amount("watts", 150.0)
    assert config(powerSaving={"idlePowerLimit": "40%"}).power_saving.idle_power_limit == Amount("percent", 40.0)


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        (
            {"thermalThrottling": {"releaseTemp": 90}},
            "policies.thermalThrottling.releaseTemp: must be below maxTemp (85), got 90",
        ),
        ({"thermalThrottling": {"maxTemp": "hot"}}, "policies.thermalThrottling.maxTemp: expected a number"),
        ({"thermalThrottling": {"maxTemp": 500}}, "policies.thermalThrottling.maxTemp: must lie between 1 and 150"),
        ({"thermalThrottling": {"step": "10"}}, "policies.thermalThrottling.step: expected a percent"),
        ({"thermalThrottling": {"step": "min"}}, "policies.thermalThrottling.step: expected a percent"),
        ({"thermalThrottling": {"step": "100%"}}, "policies.thermalThrottling.step: a percent must lie between"),
        ({"thermalThrottling": {"step": "0W"}}, "policies.thermalThrottling.step: watts must be above 0"),
        ({"thermalThrottling": {"coolDown": "5m"}}, "policies.thermalThrottling.coolDown: unknown key"),
        ({"thermalThrottling": {"enabled": "yes"}}, "policies.thermalThrottling.enabled: expected true or false"),
        ({"thermalThrottling": [1, 2]}, "policies.thermalThrottling: expected a mapping"),
        ({"powerSaving": {"threshold": 101}}, "policies.powerSaving.threshold: must lie between 0 and 100 percent"),
        ({"powerSaving": {"idlePowerLimit": "idle"}}, "policies.powerSaving.idlePowerLimit: expected a percent"),
        ({"powerSaving": {"idleFor": 120}}, "policies.powerSaving.idleFor: expected a duration"),
        ({"health": {"criticalXids": [48, "x"]}}, r"policies.health.criticalXids\[1\]: expected a non-negative"),
        ({"health": {"criticalXids": "48"}}, "policies.health.criticalXids: expected a list"),
        ({"health": {"action": "drain"}}, "policies.health.action: expected one of none, min-power, got 'drain'"),
        ({"dryRun": "false"}, "policies.dryRun: expected true or false"),
        ({"thermal": {}}, "policies.thermal: unknown key"),
    ],
)
def test_config_errors_name_the_key_path(sections: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        config(**sections)


def test_a_config_that_is_not_a_mapping_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^policies: expected a mapping, got list"):
        parse_policies([1, 2])  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(
    max_temp=st.integers(60, 100),
    gap=st.integers(1, 20),
    cool_s=st.integers(0, 7200),
    step=st.one_of(st.integers(1, 99).map(lambda v: f"{v}%"), st.integers(1, 300).map(lambda v: f"{v}W")),
    idle=st.sampled_from(["min", "150W", "40%"]),
    dry=st.booleans(),
)
def test_a_config_round_trips_through_its_yaml_shape(
    max_temp: int, gap: int, cool_s: int, step: str, idle: str, dry: bool
) -> None:
    c = config(
        dryRun=dry,
        thermalThrottling={"maxTemp": max_temp, "releaseTemp": max_temp - gap, "coolDownPeriod": f"{cool_s}s"},
        powerSaving={"idlePowerLimit": idle},
    )
    c = parse_policies({**c.to_mapping(), "thermalThrottling": {**c.to_mapping()["thermalThrottling"], "step": step}})
    assert parse_policies(c.to_mapping()) == c


# --------------------------------------------------------------------------------------------------
# Per-device overrides
# --------------------------------------------------------------------------------------------------


def test_a_json_override_replaces_only_the_keys_it_names() -> None:
    node = config()
    merged = merge_override(node, '{"thermalThrottling":{"maxTemp":82}}')
    assert merged.thermal.max_temp_c == 82.0
    assert merged.thermal.release_temp_c == 80.0 and merged.thermal.cool_down_s == 300.0
    assert merged.power_saving == node.power_saving and merged.health == node.health


def test_a_yaml_override_works_too_and_may_switch_a_policy_off() -> None:
    merged = merge_override(config(), "powerSaving:\n  enabled: false\ndryRun: true\n")
    assert merged.power_saving.enabled is False and merged.dry_run is True
    assert merged.power_saving.threshold_pct == 10.0


def test_an_empty_override_leaves_the_node_config_untouched() -> None:
    node = config()
    assert merge_override(node, "") is node
    assert merge_override(node, None) is node
    assert merge_override(node, "  \n") is node


def test_an_override_is_validated_against_the_merged_config() -> None:
    with pytest.raises(
        ConfigError, match=r"^policy\.thermalThrottling\.releaseTemp: must be below maxTemp \(78\), got 80"
    ):
        merge_override(config(), '{"thermalThrottling":{"maxTemp":78}}')


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"thermalThrottling": {', r"^policy: not a JSON or YAML mapping"),
        ("[1, 2]", r"^policy: expected a mapping"),
        ("85", r"^policy: expected a mapping"),
        ('{"thermal": {"maxTemp": 80}}', r"^policy\.thermal: unknown key"),
        ('{"thermalThrottling": 80}', r"^policy\.thermalThrottling: expected a mapping, got int"),
        ('{"thermalThrottling": {"step": "lots"}}', r"^policy\.thermalThrottling\.step: expected a percent"),
    ],
)
def test_a_bad_override_is_refused_naming_its_path(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        merge_override(config(), text)


# --------------------------------------------------------------------------------------------------
# Thermal throttling
# --------------------------------------------------------------------------------------------------


def test_a_heat_stream_crossing_max_temp_drops_the_cap_at_the_first_decision_above_it() -> None:
    gpu = Gpu(config())
    for t, temp in enumerate([70, 78, 83, 85]):
        assert gpu.step(float(t), temperature=temp).limits == ()
    d = gpu.step(4.0, temperature=86)
    thermal = d.limit_for("thermal")
    assert thermal is not None and thermal.power_limit_w == 630.0
    assert d.policy_state == "thermal:throttling-step1"
    (event,) = d.events
    assert (event.policy, event.action, event.old_cap_w, event.new_cap_w) == ("thermal", "step-down", 700.0, 630.0)
    assert event.temperature_c == 86 and event.reason == "temperature-86-above-85" and event.uuid == "GPU-test"


def test_throttling_keeps_stepping_once_per_interval_while_still_too_hot() -> None:
    gpu = Gpu(config())
    caps = []
    for t in range(0, 121):
        gpu.step(float(t), temperature=90)
        caps.append(gpu.limit_w)
    assert caps[0] == 630.0
    assert caps[29] == 630.0 and caps[30] == 567.0 and caps[60] == 510.0 and caps[90] == 459.0 and caps[120] == 413.0
    assert gpu.limit_changes == 5
    assert gpu.decisions[-1].policy_state == "thermal:throttling-step5"


def test_throttling_never_goes_below_the_gpu_minimum() -> None:
    gpu = Gpu(config(thermalThrottling={"step": "200W"}))
    for t in range(0, 300, 10):
        gpu.step(float(t), temperature=95)
    assert gpu.limit_w == 200.0
    assert min(d.power_limit_w or 700.0 for d in gpu.decisions) == 200.0
    assert gpu.limit_changes == 3  # 700 -> 500 -> 300 -> 200


def test_between_release_and_max_temp_the_cap_is_held() -> None:
    gpu = Gpu(config())
    gpu.step(0.0, temperature=88)
    for t in range(1, 1000, 5):
        d = gpu.step(float(t), temperature=82)
    assert gpu.limit_w == 630.0 and d.policy_state == "thermal:holding-step1"
    assert gpu.limit_changes == 1


def test_the_cool_down_is_honoured_to_the_second() -> None:
    gpu = Gpu(config())
    gpu.step(0.0, temperature=90)
    assert gpu.limit_w == 630.0
    gpu.step(10.0, temperature=79)  # cool-down starts here
    for t in range(11, 310):
        d = gpu.step(float(t), temperature=75)
        assert gpu.limit_w == 630.0, f"released at t={t}, before the 5 min cool-down"
    assert d.policy_state == "thermal:cooldown-step1"
    d = gpu.step(310.0, temperature=75)
    assert [e.action for e in d.events] == ["release"]
    assert d.limits == () and gpu.limit_w == 700.0 and d.policy_state == "normal"
    assert d.restore_power_limit_w == 700.0


def test_an_excursion_above_release_temp_restarts_the_cool_down() -> None:
    gpu = Gpu(config())
    gpu.step(0.0, temperature=90)
    for t in range(1, 200):
        gpu.step(float(t), temperature=75)
    gpu.step(200.0, temperature=81)  # above releaseTemp, below maxTemp: the clock restarts
    for t in range(201, 501):
        gpu.step(float(t), temperature=75)
        assert gpu.limit_w == 630.0, f"released at t={t}, only {t - 201} s after the excursion"
    gpu.step(501.0, temperature=75)
    assert gpu.limit_w == 700.0


def test_the_release_retraces_the_throttle_one_step_per_interval() -> None:
    gpu = Gpu(config())
    for t in range(0, 61):
        gpu.step(float(t), temperature=90)  # 630, 567, 510
    assert gpu.limit_w == 510.0
    t = 61
    while gpu.limit_w != 700.0 and t < 2000:
        gpu.step(float(t), temperature=70)
        t += 1
    actions = [e.action for d in gpu.decisions for e in d.events]
    assert actions == ["step-down"] * 3 + ["step-up", "step-up", "release"]
    ups = [(e.old_cap_w, e.new_cap_w) for d in gpu.decisions for e in d.events if e.action != "step-down"]
    assert ups == [(510.0, 567.0), (567.0, 630.0), (630.0, None)]
    assert t - 1 == 61 + 300 + 60  # cool-down, then one step per 30 s interval


def test_an_oscillating_temperature_around_the_thresholds_does_not_flap() -> None:
    """Temperature swings 78..88 C with a 40 s period for an hour: the cap only ever goes down."""
    gpu = Gpu(config())
    naive_changes, naive_cap = 0, 700.0
    for t in range(3600):
        temp = 83 + 5 * math.sin(2 * math.pi * t / 40)
        gpu.step(float(t), temperature=round(temp))
        new_naive = 200.0 if temp > 85 else 700.0
        naive_changes += new_naive != naive_cap
        naive_cap = new_naive
    actions = {e.action for d in gpu.decisions for e in d.events}
    assert actions == {"step-down"}  # never released: the cool-down never completes
    # The synthetic temperature ignores the cap, so the policy walks down to the floor in 12 steps, then holds.
    assert gpu.limit_changes == 12 and gpu.limit_w == 200.0
    assert naive_changes > 150


def test_the_thermal_step_is_taken_from_the_cloud_cap_when_it_is_lower() -> None:
    gpu = Gpu(config(), desired_w=500.0, limit_w=500.0)
    d = gpu.step(0.0, temperature=90)
    lim = d.limit_for("thermal")
    assert lim is not None and lim.power_limit_w == 450.0
    assert (d.events[0].old_cap_w, d.events[0].new_cap_w) == (500.0, 450.0)
    assert gpu.limit_w == 450.0


def test_when_the_cloud_lowers_its_cap_below_the_thermal_cap_the_thermal_limit_disappears() -> None:
    gpu = Gpu(config())
    gpu.step(0.0, temperature=90)
    assert gpu.limit_w == 630.0
    gpu.desired_w = 400.0
    d = gpu.step(5.0, temperature=84)
    assert d.limits == () and gpu.limit_w == 400.0
    assert d.policy_state == "thermal:holding-step1"


@settings(max_examples=80, deadline=None)
@given(
    temps=st.lists(st.integers(40, 100), min_size=1, max_size=80),
    desired=st.one_of(st.none(), st.floats(200.0, 700.0)),
    dt=st.integers(1, 60),
    power=st.booleans(),
)
def test_no_policy_limit_is_ever_at_or_above_the_ceiling_nor_below_the_minimum(
    temps: list[int], desired: float | None, dt: int, power: bool
) -> None:
    gpu = Gpu(config(powerSaving={"enabled": power}), desired_w=desired, limit_w=desired or 700.0)
    ceiling = desired if desired is not None else 700.0
    for i, temp in enumerate(temps):
        d = gpu.step(float(i * dt), temperature=temp, utilization_gpu=temp % 20)
        for lim in d.limits:
            assert lim.power_limit_w is not None and 200.0 <= lim.power_limit_w < ceiling
        assert TWIN_VALUE_RE.fullmatch(d.policy_state)
        assert d.device_state in DEVICE_STATES


def test_a_sample_without_temperature_holds_the_thermal_state() -> None:
    gpu = Gpu(config())
    gpu.step(0.0, temperature=90)
    d = gpu.step(400.0, utilization_gpu=50)
    assert d.events == () and gpu.limit_w == 630.0 and d.policy_state == "thermal:throttling-step1"


def test_with_no_cloud_cap_the_release_restores_the_limit_the_gpu_had_before() -> None:
    gpu = Gpu(config(), limit_w=600.0)
    gpu.step(0.0, temperature=90)
    assert gpu.limit_w == 540.0
    for t in range(1, 400):
        gpu.step(float(t), temperature=70)
    assert gpu.limit_w == 600.0
    releases = [d for d in gpu.decisions if d.restore_power_limit_w is not None]
    assert len(releases) == 1 and releases[0].restore_power_limit_w == 600.0


# --------------------------------------------------------------------------------------------------
# Power saving
# --------------------------------------------------------------------------------------------------


def test_power_saving_engages_after_idle_for_and_not_a_second_before() -> None:
    gpu = Gpu(config())
    for t in range(0, 120):
        assert gpu.step(float(t), utilization_gpu=3).limits == (), f"engaged at t={t}"
    d = gpu.step(120.0, utilization_gpu=3)
    lim = d.limit_for("power-saving")
    assert lim is not None and lim.power_limit_w == 200.0
    assert d.policy_state == "power-saving:active"
    (event,) = d.events
    assert (event.action, event.old_cap_w, event.new_cap_w, event.utilization_pct) == ("engage", 700.0, 200.0, 3)


def test_power_saving_releases_at_the_first_busy_sample() -> None:
    gpu = Gpu(config())
    for t in range(0, 200):
        gpu.step(float(t), utilization_gpu=0)
    assert gpu.limit_w == 200.0
    d = gpu.step(200.0, utilization_gpu=60)
    assert d.limits == () and gpu.limit_w == 700.0 and d.policy_state == "normal"
    assert [e.action for e in d.events] == ["restore"] and d.restore_power_limit_w == 700.0


def test_a_busy_sample_restarts_the_idle_timer() -> None:
    gpu = Gpu(config())
    for t in range(0, 100):
        gpu.step(float(t), utilization_gpu=2)
    gpu.step(100.0, utilization_gpu=40)
    for t in range(101, 221):
        assert gpu.step(float(t), utilization_gpu=2).limits == ()
    assert gpu.step(221.0, utilization_gpu=2).limit_for("power-saving") is not None


def test_the_idle_limit_may_be_watts_or_a_percent_of_the_default() -> None:
    for idle, expected in (("300W", 300.0), ("50%", 350.0), ("100W", 200.0)):
        gpu = Gpu(config(powerSaving={"idlePowerLimit": idle, "idleFor": "10s"}))
        for t in range(0, 11):
            gpu.step(float(t), utilization_gpu=0)
        assert gpu.limit_w == expected, idle


def test_power_saving_is_off_by_default() -> None:
    gpu = Gpu(PolicyConfig())
    for t in range(0, 1000, 10):
        assert gpu.step(float(t), utilization_gpu=0).limits == ()


def test_when_thermal_and_power_saving_both_apply_the_lower_cap_wins() -> None:
    gpu = Gpu(config(powerSaving={"idleFor": "10s"}))
    gpu.step(0.0, temperature=90, utilization_gpu=0)
    for t in range(1, 60):
        d = gpu.step(float(t), temperature=84, utilization_gpu=0)
    assert {lim.policy for lim in d.limits} == {"thermal", "power-saving"}
    assert d.power_limit_w == 200.0 and d.policy_state == "thermal:holding-step1,power-saving:active"
    d = gpu.step(60.0, temperature=84, utilization_gpu=90)
    assert [lim.policy for lim in d.limits] == ["thermal"] and gpu.limit_w == 630.0


def test_power_saving_waits_for_the_change_interval_after_a_thermal_step() -> None:
    gpu = Gpu(config(powerSaving={"idleFor": "0s"}))
    d = gpu.step(0.0, temperature=90, utilization_gpu=0)
    assert [e.action for e in d.events] == ["step-down"]
    d = gpu.step(29.0, temperature=84, utilization_gpu=0)
    assert d.events == ()
    d = gpu.step(30.0, temperature=84, utilization_gpu=0)
    assert [e.action for e in d.events] == ["engage"]


# --------------------------------------------------------------------------------------------------
# Dry run
# --------------------------------------------------------------------------------------------------


def test_dry_run_reports_the_same_decisions_but_changes_nothing() -> None:
    real, dry = Gpu(config()), Gpu(config(dryRun=True))
    for t in range(0, 61):
        real.step(float(t), temperature=90)
        d = dry.step(float(t), temperature=90)
        assert d.limits == () and d.dry_run
    assert dry.limit_w == 700.0 and dry.limit_changes == 0
    dry_events = [e for d in dry.decisions for e in d.events]
    real_events = [e for d in real.decisions for e in d.events]
    assert [(e.action, e.new_cap_w) for e in dry_events] == [(e.action, e.new_cap_w) for e in real_events]
    assert all(e.dry_run for e in dry_events) and not any(e.dry_run for e in real_events)
    assert dry.decisions[-1].policy_state == "dry-run:thermal:throttling-step3"
    assert dry_events[0].to_payload()["dryRun"] is True


# --------------------------------------------------------------------------------------------------
# Health
# --------------------------------------------------------------------------------------------------


def test_a_critical_xid_in_the_sample_makes_the_gpu_unhealthy_once() -> None:
    gpu = Gpu(config())
    assert gpu.step(0.0, xid_last=0).device_state == "ok"
    d = gpu.step(1.0, xid_last=79)
    assert d.device_state == "unhealthy" and d.policy_state == "health:unhealthy-xid79"
    assert [(e.policy, e.action, e.reason) for e in d.events] == [("health", "unhealthy", "xid79")]
    d = gpu.step(2.0, xid_last=79)
    assert d.device_state == "unhealthy" and d.events == ()
    assert d.limits == ()  # action none: report only


def test_a_non_critical_xid_is_reported_but_leaves_the_gpu_healthy() -> None:
    gpu = Gpu(config())
    d = gpu.step(0.0, xid_last=13)
    assert (
        d.device_state == "ok" and [e.action for e in d.events] == ["xid"] and d.events[0].reason == "xid13-application"
    )


def test_a_critical_xid_event_from_the_backend_counts_too() -> None:
    gpu = Gpu(config())
    d = gpu.step(0.0, events=(GpuEvent("GPU-test", 0, "xid", xid=48),), temperature=50)
    assert d.device_state == "unhealthy" and d.policy_state == "health:unhealthy-xid48"


def test_a_rise_in_uncorrected_ecc_errors_makes_the_gpu_unhealthy() -> None:
    gpu = Gpu(config())
    assert gpu.step(0.0, ecc_errors_uncorrected=2).device_state == "ok"  # the first reading is a baseline
    assert gpu.step(10.0, ecc_errors_uncorrected=2).device_state == "ok"
    d = gpu.step(20.0, ecc_errors_uncorrected=3)
    assert d.device_state == "unhealthy" and d.policy_state == "health:unhealthy-ecc"


def test_ecc_rises_are_ignored_when_ecc_uncorrected_is_off() -> None:
    gpu = Gpu(config(health={"eccUncorrected": False}))
    gpu.step(0.0, ecc_errors_uncorrected=0)
    assert gpu.step(10.0, ecc_errors_uncorrected=5).device_state == "ok"


def test_a_driver_reload_clears_the_unhealthy_state() -> None:
    gpu = Gpu(config())
    gpu.step(0.0, ecc_errors_uncorrected=0)
    assert gpu.step(1.0, ecc_errors_uncorrected=1).device_state == "unhealthy"
    d = gpu.step(2.0, events=(GpuEvent("GPU-test", 0, "driver_reload"),), ecc_errors_uncorrected=0)
    assert d.device_state == "ok" and [e.action for e in d.events] == ["recovered"]


def test_a_lost_gpu_goes_offline_and_comes_back_when_samples_return() -> None:
    gpu = Gpu(config())
    gpu.step(0.0, temperature=50)
    d = gpu.step(1.0, gpu_lost=True)
    assert d.device_state == "offline" and d.policy_state == "health:offline-gpu-lost"
    assert [(e.action, e.reason) for e in d.events] == [("offline", "gpu-lost")]
    assert gpu.step(2.0, events=(GpuEvent("GPU-test", 0, "gpu_lost"),)).events == ()
    d = gpu.step(3.0, temperature=50)
    assert d.device_state == "ok" and [e.action for e in d.events] == ["recovered"]


def test_the_min_power_action_caps_an_unhealthy_gpu_at_its_minimum() -> None:
    gpu = Gpu(config(health={"action": "min-power"}))
    d = gpu.step(0.0, xid_last=74)
    lim = d.limit_for("health")
    assert lim is not None and lim.power_limit_w == 200.0 and lim.reason == "unhealthy-xid74"


def test_health_disabled_ignores_xids() -> None:
    gpu = Gpu(config(health={"enabled": False}))
    assert gpu.step(0.0, xid_last=79).device_state == "ok"


# --------------------------------------------------------------------------------------------------
# Config swaps and the engine
# --------------------------------------------------------------------------------------------------


def test_a_config_swap_keeps_the_cool_down_timer_running() -> None:
    gpu = Gpu(config())
    gpu.step(0.0, temperature=90)
    for t in range(1, 200):
        gpu.step(float(t), temperature=70)
    gpu.config = config(thermalThrottling={"maxTemp": 83, "releaseTemp": 78})  # reload
    for t in range(200, 301):
        gpu.step(float(t), temperature=70)
        assert gpu.limit_w == 630.0
    gpu.step(301.0, temperature=70)
    assert gpu.limit_w == 700.0, "the cool-down started at t=1 and ended at t=301 across the swap"


def test_switching_a_policy_off_releases_its_limit_at_once() -> None:
    gpu = Gpu(config())
    gpu.step(0.0, temperature=90)
    gpu.config = config(thermalThrottling={"enabled": False})
    d = gpu.step(1.0, temperature=90)
    assert d.limits == () and gpu.limit_w == 700.0 and d.policy_state == "normal"
    assert [(e.action, e.reason) for e in d.events] == [("disabled", "policy-disabled")]


def test_the_engine_applies_each_gpus_override_and_keeps_state_per_uuid() -> None:
    engine = PolicyEngine(config())
    engine.set_override("GPU-b", '{"thermalThrottling":{"maxTemp":82,"releaseTemp":75}}')
    ctx = PolicyContext(constraints=H100, current_power_limit_w=700.0)
    a = engine.decide("GPU-a", {"temperature": 84}, ctx, 0.0)
    b = engine.decide("GPU-b", {"temperature": 84}, ctx, 0.0)
    assert a.limits == () and b.limit_for("thermal") is not None
    assert b.events[0].uuid == "GPU-b"
    assert engine.state("GPU-b").thermal.phase == "throttling" and engine.state("GPU-a").thermal.phase == "normal"


def test_the_engine_merges_overrides_again_over_a_new_node_config() -> None:
    engine = PolicyEngine(config())
    engine.set_override("GPU-b", '{"thermalThrottling":{"maxTemp":82}}')
    engine.configure(config(minChangeInterval="10s"))
    assert engine.config_for("GPU-b").min_change_interval_s == 10.0
    assert engine.config_for("GPU-b").thermal.max_temp_c == 82.0


def test_a_bad_config_swap_leaves_the_engine_as_it_was() -> None:
    engine = PolicyEngine(config())
    engine.set_override("GPU-b", '{"thermalThrottling":{"maxTemp":82}}')
    with pytest.raises(ConfigError, match=r"^devices\[GPU-b\]\.policy\.thermalThrottling\.releaseTemp"):
        engine.configure(config(thermalThrottling={"releaseTemp": 84}))
    assert engine.config.thermal.release_temp_c == 80.0
    with pytest.raises(ConfigError):
        engine.set_override("GPU-b", '{"thermalThrottling":{"maxTemp":70}}')
    assert engine.config_for("GPU-b").thermal.max_temp_c == 82.0
    engine.set_override("GPU-b", "")
    assert engine.config_for("GPU-b") == engine.config


def test_forgetting_a_gpu_drops_its_state_and_override() -> None:
    engine = PolicyEngine(config())
    engine.set_override("GPU-b", '{"dryRun": true}')
    engine.decide("GPU-b", {"temperature": 90}, PolicyContext(constraints=H100, current_power_limit_w=700.0), 0.0)
    engine.forget("GPU-b")
    assert engine.state("GPU-b") == PolicyState() and engine.config_for("GPU-b") == engine.config


def test_event_payloads_are_json_ready_and_omit_unknown_values() -> None:
    gpu = Gpu(config())
    (event,) = gpu.step(0.0, temperature=90).events
    assert event.to_payload() == {
        "policy": "thermal",
        "action": "step-down",
        "reason": "temperature-90-above-85",
        "uuid": "GPU-test",
        "dryRun": False,
        "temperature": 90.0,
        "oldPowerLimit": 700.0,
        "newPowerLimit": 630.0,
    }


def test_the_engine_takes_a_whole_set_of_overrides_with_a_new_config() -> None:
    engine = PolicyEngine(config())
    engine.set_override("GPU-a", '{"dryRun": true}')
    engine.configure(config(), {"GPU-b": {"powerSaving": {"enabled": False}}, "GPU-c": ""})
    assert engine.config_for("GPU-a") == engine.config, "a full set replaces the old overrides"
    assert engine.config_for("GPU-b").power_saving.enabled is False
    assert engine.config_for("GPU-c") == engine.config


def test_a_critical_xid_arriving_both_as_event_and_in_the_sample_is_reported_once() -> None:
    gpu = Gpu(config())
    d1 = gpu.step(0.0, events=(GpuEvent("GPU-test", 0, "xid", xid=74),), xid_last=0)
    d2 = gpu.step(1.0, xid_last=74)
    assert [e.action for e in d1.events] == ["unhealthy"] and d2.events == ()
    assert d2.policy_state == "health:unhealthy-xid74"


# --------------------------------------------------------------------------------------------------
# The steady fast path decides exactly as the full decision
# --------------------------------------------------------------------------------------------------

#: Configs the equivalence tests switch between: defaults, the issue's (power saving on), dry run, policies off,
#: the min-power health action, no change interval and no idle wait.
EQUIVALENCE_CONFIGS = (
    PolicyConfig(),
    config(),
    config(dryRun=True),
    config(thermalThrottling={"enabled": False}, powerSaving={"enabled": False}, health={"enabled": False}),
    config(health={"action": "min-power"}, minChangeInterval="0s"),
    config(powerSaving={"idleFor": "0s", "idlePowerLimit": "50%"}, thermalThrottling={"step": "60W"}),
)
NAN = float("nan")
INF = float("inf")
BIG = 2**60 + 1  # an int a float cannot hold exactly


def test_a_steady_call_returns_its_state_and_the_fresh_computations_decision() -> None:
    values: dict[str, Value] = {"temperature": 46, "utilization_gpu": 30, "power_limit": 700.0}
    values |= {"xid_last": 0, "ecc_errors_uncorrected": 0}
    ctx = PolicyContext(constraints=H100, uuid="GPU-test")
    for cfg in (PolicyConfig(), config(), config(dryRun=True)):
        state, _ = decide(PolicyState(), values, ctx, cfg, 0.0)  # learns the baseline and the counters
        again, decision = decide(state, values, ctx, cfg, 1.0)
        assert again is state, "a call where nothing moves keeps the state object"
        assert (again, decision) == policy._decide_full(state, values, ctx, cfg, 1.0, "GPU-test")
        assert decision.policy_state == ("dry-run:normal" if cfg.dry_run else "normal")


def test_the_fast_path_leaves_the_events_to_the_full_decision() -> None:
    ctx = PolicyContext(constraints=H100, current_power_limit_w=700.0, uuid="GPU-test")
    state, _ = decide(PolicyState(), {"temperature": 46, "xid_last": 0, "ecc_errors_uncorrected": 0}, ctx, config(), 0)
    for changed in ({"temperature": 86}, {"xid_last": 79}, {"ecc_errors_uncorrected": 1}):
        values: dict[str, Value] = {"temperature": 46, "xid_last": 0, "ecc_errors_uncorrected": 0, **changed}
        _, decision = decide(state, values, ctx, config(), 1.0)
        assert len(decision.events) == 1, changed


@pytest.mark.parametrize(
    ("start", "values", "cfg"),
    [
        # Counters a float cannot hold: the full path reads them through a float and sees them change.
        (PolicyState(health=HealthState(last_xid=BIG)), {"xid_last": BIG}, PolicyConfig()),
        (PolicyState(health=HealthState(ecc_uncorrected=BIG)), {"ecc_errors_uncorrected": BIG}, PolicyConfig()),
        # The applied cap is kept while the reading is within 0.5 W of it, not further.
        (PolicyState(baseline_w=700.0, applied_w=630.0), {"power_limit": 630.45}, PolicyConfig()),
        (PolicyState(baseline_w=700.0, applied_w=630.0), {"power_limit": 630.55}, PolicyConfig()),
        # Exactly at maxTemp (cool) and exactly idleFor idle (engage).
        (PolicyState(), {"temperature": 85.0, "power_limit": 700.0}, PolicyConfig()),
        (PolicyState(power_saving=PowerSavingState(0.0)), {"utilization_gpu": 0, "power_limit": 700.0}, config()),
        (PolicyState(power_saving=PowerSavingState(1.0)), {"utilization_gpu": 0, "power_limit": 700.0}, config()),
    ],
)
def test_edge_values_decide_the_same_on_both_paths(
    start: PolicyState, values: dict[str, Value], cfg: PolicyConfig
) -> None:
    ctx = PolicyContext(constraints=H100, uuid="GPU-test")
    assert decide(start, values, ctx, cfg, 120.0) == policy._decide_full(start, values, ctx, cfg, 120.0, "GPU-test")


def _equal_runs(steps: list[tuple[int, float, dict[str, Value], PolicyContext]], start: PolicyState) -> int:
    """Drive ``decide`` and ``_decide_full`` side by side from ``start``; every state and decision must match.
    Returns how many events the run produced (so a test can check it exercised the policies)."""
    fast = slow = start
    events = 0
    for i, (config_index, now_s, values, ctx) in enumerate(steps):
        cfg = EQUIVALENCE_CONFIGS[config_index]
        fast, fast_decision = decide(fast, values, ctx, cfg, now_s)
        slow, slow_decision = policy._decide_full(slow, values, ctx, cfg, now_s, ctx.uuid)
        assert fast_decision == slow_decision, f"step {i}: {values} {ctx}"
        assert fast == slow, f"step {i}: {values} {ctx}"
        events += len(slow_decision.events)
    return events


SAMPLE_VALUES = st.fixed_dictionaries(
    {},
    optional={
        "temperature": st.sampled_from([46, 79, 80, 84, 85, 85.0, 85.5, 86, 95, NAN, INF, -INF, True, "hot"]),
        "utilization_gpu": st.sampled_from([0, 5, 9.99, 10, 50, 100, NAN, INF, False]),
        "power_limit": st.sampled_from([700.0, 630.0, 630.45, 630.55, 567, 200.0, 699.8, NAN]),
        "xid_last": st.sampled_from([0, 0, 13, 79, 79.0, BIG, -1]),
        "ecc_errors_uncorrected": st.sampled_from([0, 0, 1, 2, 2.0, BIG]),
    },
)
CONTEXTS = st.builds(
    PolicyContext,
    constraints=st.sampled_from([H100, Constraints()]),
    desired_power_limit_w=st.sampled_from([None, None, 400.0, 650.0, 700.0]),
    current_power_limit_w=st.sampled_from([None, None, 630.0, 700.0]),
    events=st.sampled_from(
        [(), (), (), (GpuEvent("GPU-test", 0, "xid", xid=79),), (GpuEvent("GPU-test", 0, "driver_reload"),)]
    ),
    gpu_lost=st.sampled_from([False, False, False, False, True]),
    uuid=st.just("GPU-test"),
)


@settings(max_examples=300, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from([0, 0, 0, 0, 1, 2, 3, 4, 5]),
            st.sampled_from([0.0, 1.0, 1.0, 5.0, 30.0, 120.0, 301.0]),
            SAMPLE_VALUES,
            CONTEXTS,
        ),
        min_size=1,
        max_size=60,
    ),
    first_config=st.integers(0, len(EQUIVALENCE_CONFIGS) - 1),
    start=st.sampled_from(
        [
            PolicyState(),
            PolicyState(health=HealthState(last_xid=BIG, ecc_uncorrected=BIG)),
            PolicyState(thermal=ThermalState(last_change_s=0.0), baseline_w=700.0, applied_w=630.0),
            PolicyState(power_saving=PowerSavingState(idle_since_s=0.0), baseline_w=650.0, capped=True),
        ]
    ),
)
def test_the_fast_path_decides_exactly_as_the_full_decision(
    steps: list[tuple[int, float, dict[str, Value], PolicyContext]], first_config: int, start: PolicyState
) -> None:
    # Mostly one config (so timers run out), now and then a swap; time moves on by the step's delta.
    now_s = 0.0
    timed = []
    for config_index, dt_s, values, ctx in steps:
        now_s += dt_s
        timed.append((config_index or first_config, now_s, values, ctx))
    _equal_runs(timed, start)


@pytest.mark.parametrize("config_index", range(len(EQUIVALENCE_CONFIGS)))
def test_a_simulated_hot_and_cold_hour_decides_the_same_on_both_paths(
    config_index: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FakeClock()
    sim = SimNvml(1, "H100", clock=clock.monotonic, scenario="inference")
    backend = NvmlBackend(sim, clock=clock)
    backend.init()
    try:
        (gpu,) = backend.list_gpus()
        constraints = backend.constraints(gpu.uuid)
        steps = []
        for second in range(3600):
            if second % 900 == 0:  # inference, heat, idle, heat: cool, hot, idle and cooling-down stretches
                sim.set_scenario(gpu.uuid, ("inference", "heat", "idle", "heat")[second // 900])
            clock.advance(1.0)
            values = dict(backend.sample(gpu.uuid).values)
            steps.append((config_index, clock.monotonic(), values, PolicyContext(constraints=constraints)))
        full_calls = cool_full_calls = 0
        full = policy._decide_full

        def counted(*args: object, **kwargs: object) -> tuple[PolicyState, Decision]:
            nonlocal full_calls
            full_calls += 1
            return full(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(policy, "_decide_full", counted)
        engine = PolicyEngine(EQUIVALENCE_CONFIGS[config_index])
        fast, slow = PolicyState(), PolicyState()
        events = 0
        for i, (_, now_s, values, ctx) in enumerate(steps):
            if i == 900:
                cool_full_calls = full_calls
            decision = engine.decide(gpu.uuid, values, ctx, now_s)
            fast, fast_decision = decide(fast, values, ctx, EQUIVALENCE_CONFIGS[config_index], now_s)
            slow, slow_decision = full(slow, values, ctx, EQUIVALENCE_CONFIGS[config_index], now_s, gpu.uuid)
            assert decision == slow_decision and engine.state(gpu.uuid) == slow, f"second {i}"
            assert fast == slow and fast_decision.events == tuple(replace(e, uuid="") for e in slow_decision.events)
            events += len(slow_decision.events)
    finally:
        backend.shutdown()
    # The policies acted (the heat crosses maxTemp, idle engages power saving where it is on) ...
    assert events >= (0 if config_index == 3 else 2)
    # ... and in the first, cool stretch of inference (where power saving waits 2 min, which inference never
    # idles for) only the first decision of the engine and of ``decide`` took the full path.
    if EQUIVALENCE_CONFIGS[config_index].power_saving.idle_for_s > 0:
        assert cool_full_calls == 2
