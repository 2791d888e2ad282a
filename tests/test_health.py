"""GPU health: the XID catalog and its lists, the three levels in the health policy, and the ways back."""

from __future__ import annotations

import pytest

from mapper.edge.control.policy import (
    Decision,
    PolicyConfig,
    PolicyContext,
    PolicyEngine,
    parse_policies,
)
from mapper.edge.health.checks import CheckResult, HealthReport, ProbeResult, build_report
from mapper.edge.health.xid import CATALOG, DEFAULT_FATAL_XIDS, XidPolicy
from mapper.errors import ConfigError
from mapper.shared.model import TWIN_VALUE_RE, Constraints, GpuEvent, Value

H100 = Constraints(power_limit_min_w=200.0, power_limit_max_w=700.0, power_limit_default_w=700.0)
UUID = "GPU-health-test"


def engine(health: dict[str, object] | None = None) -> PolicyEngine:
    return PolicyEngine(parse_policies({"health": health} if health is not None else None))


def step(
    e: PolicyEngine,
    now_s: float,
    *,
    events: tuple[GpuEvent, ...] = (),
    probe: ProbeResult | None = None,
    checks: tuple[CheckResult, ...] | None = None,
    gpu_lost: bool = False,
    **values: Value,
) -> Decision:
    ctx = PolicyContext(
        constraints=H100,
        current_power_limit_w=700.0,
        events=events,
        gpu_lost=gpu_lost,
        uuid=UUID,
        probe=probe,
        checks=checks,
    )
    base: dict[str, Value] = {"temperature": 50, "utilization_gpu": 30, "xid_last": 0, "ecc_errors_uncorrected": 0}
    return e.decide(UUID, {**base, **values}, ctx, now_s)


def xid(n: int) -> GpuEvent:
    return GpuEvent(UUID, 0, "xid", xid=n)


RESET = GpuEvent(UUID, 0, "driver_reload", detail="test")
PASS = ProbeResult("pass", latency_s=0.05)
FAIL = ProbeResult("fail", "cuCtxCreate-CUDA_ERROR_UNKNOWN", latency_s=0.2)


# --------------------------------------------------------------------------------------------------
# The catalog and the lists
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [13, 31, 43, 45, 68, 109])
def test_the_device_plugins_application_xids_are_application_errors(n: int) -> None:
    assert CATALOG[n].severity == "application"
    assert XidPolicy().classify(n).severity == "application"


def test_the_reset_and_reboot_class_is_fatal_with_its_way_back() -> None:
    assert {48, 62, 64, 74, 79, 95, 119, 120} <= DEFAULT_FATAL_XIDS
    p = XidPolicy()
    assert p.classify(79).recovery == "reboot" and p.classify(79).action == "reboot"
    assert p.classify(48).recovery == "reset" and p.classify(48).subsystem == "memory"
    assert p.classify(74).subsystem == "nvlink"


def test_an_unknown_xid_is_a_warning_that_passing_probes_clear() -> None:
    c = XidPolicy().classify(4242)
    assert (c.severity, c.recovery, c.known, c.reason) == ("warning", "probes", False, "xid4242-warning")


def test_the_lists_override_the_catalog() -> None:
    p = XidPolicy(ignore=frozenset({79}), fatal=frozenset({13, 48}))
    assert p.classify(79).severity == "ignored"
    assert p.classify(13).severity == "fatal" and p.classify(13).recovery == "reset"
    assert p.classify(62).severity == "warning"  # catalog-fatal, taken off the fatal list


def test_the_config_refuses_an_xid_on_both_lists_and_bad_probe_counts() -> None:
    with pytest.raises(ConfigError, match=r"policies.health.ignoreXids: \[79\] are also in criticalXids"):
        parse_policies({"health": {"criticalXids": [79], "ignoreXids": [79]}})
    with pytest.raises(ConfigError, match=r"policies\.health\.recoveryProbes: expected a whole number"):
        parse_policies({"health": {"recoveryProbes": 0}})
    with pytest.raises(ConfigError, match=r"policies.health.probe.timeout: "):
        parse_policies({"health": {"probe": {"timeout": 30}}})
    with pytest.raises(ConfigError, match=r"policies.health.checks.bogus: unknown key"):
        parse_policies({"health": {"checks": {"bogus": 1}}})


def test_the_health_config_round_trips_through_its_mapping() -> None:
    c = parse_policies(
        {
            "health": {
                "ignoreXids": [63],
                "recoveryProbes": 2,
                "probe": {"interval": "5m", "timeout": "20s", "skipAboveUtilization": 70},
                "checks": {"interval": "30s", "nvmlDeadline": "500ms", "persistence": True},
                "recovery": {"allowReset": True},
            }
        }
    )
    assert parse_policies(c.to_mapping()) == c
    assert c.health.probe.interval_s == 300 and c.health.checks.nvml_deadline_s == 0.5
    assert c.health.recovery.allow_reset and c.health.recovery_probes == 2


def test_ignoring_a_default_fatal_xid_needs_no_edit_of_the_fatal_list() -> None:
    e = engine({"ignoreXids": [79]})
    d = step(e, 0.0, events=(xid(79),))
    assert d.device_state == "ok" and d.events == ()


# --------------------------------------------------------------------------------------------------
# Level 1: XIDs and ECC, and the way back
# --------------------------------------------------------------------------------------------------


def test_a_fatal_xid_makes_the_gpu_unhealthy_and_a_reset_brings_it_back() -> None:
    e = engine()
    d = step(e, 0.0, events=(xid(48),))
    assert d.device_state == "unhealthy"
    report = e.health(UUID)
    assert (report.status, report.level, report.reason) == ("unhealthy", 1, "xid48")
    assert report.subsystem_status("memory") == "unhealthy"
    assert report.twin_text() == "unhealthy:level1:xid48"
    assert step(e, 1.0).device_state == "unhealthy"
    d = step(e, 2.0, events=(RESET,))
    assert d.device_state == "ok" and e.health(UUID).twin_text() == "healthy"
    assert [(ev.action, ev.reason) for ev in d.events] == [("recovered", "gpu-reset-xid48")]


def test_a_reboot_class_fault_is_not_cleared_by_a_reset() -> None:
    e = engine()
    step(e, 0.0, events=(xid(79),))
    d = step(e, 1.0, events=(RESET,))
    assert d.device_state == "unhealthy" and e.health(UUID).reason == "xid79"


def test_a_warning_xid_degrades_without_unhealthy_and_passing_probes_clear_it() -> None:
    e = engine({"recoveryProbes": 2})
    d = step(e, 0.0, events=(xid(92),))
    assert d.device_state == "ok"
    assert e.health(UUID).twin_text() == "degraded:level1:xid92-warning"
    step(e, 1.0, probe=PASS)
    assert e.health(UUID).status == "degraded"
    d = step(e, 2.0, probe=PASS)
    assert e.health(UUID).status == "healthy"
    assert ("recovered", "xid92-warning-2-passing-probes") in [(ev.action, ev.reason) for ev in d.events]


def test_an_application_xid_is_an_event_and_nothing_else() -> None:
    e = engine()
    d = step(e, 0.0, events=(xid(31),))
    assert d.device_state == "ok" and e.health(UUID).status == "healthy"
    assert [(ev.action, ev.reason) for ev in d.events] == [("xid", "xid31-application")]


def test_an_xid_on_the_fatal_list_whose_way_back_is_probes() -> None:
    e = PolicyEngine(PolicyConfig())
    e.configure(parse_policies({"health": {"criticalXids": [8], "recoveryProbes": 3}}))
    step(e, 0.0, events=(xid(8),))
    assert e.health(UUID).reason == "xid8"
    # XID 8 is catalog "warning" with recovery probes, made fatal by the list: it keeps the list's way back (reset)
    step(e, 1.0, events=(RESET,))
    assert e.health(UUID).status == "healthy"


# --------------------------------------------------------------------------------------------------
# Level 2: the driver checks
# --------------------------------------------------------------------------------------------------


def checks(**statuses: str) -> tuple[CheckResult, ...]:
    names = ("nvml-responsive", "device-nodes", "persistenced", "driver-version", "inforom")
    out = []
    for name in names:
        status = statuses.get(name.replace("-", "_"), "healthy")
        out.append(CheckResult(name, status, "ok" if status == "healthy" else f"{name}-bad"))  # type: ignore[arg-type]
    return tuple(out)


def test_a_failing_driver_check_is_level2_with_its_reason_and_clears_when_it_passes() -> None:
    e = engine()
    d = step(e, 0.0, checks=checks(driver_version="unhealthy"))
    assert d.device_state == "unhealthy"
    report = e.health(UUID)
    assert report.twin_text() == "unhealthy:level2:driver-version-bad"
    assert report.level_status(2) == "unhealthy" and report.level_status(1) == "healthy"
    assert d.policy_state == "health:unhealthy-driver-version-bad"
    assert [(ev.action, ev.reason) for ev in d.events] == [
        ("check-unhealthy", "level2-driver-version-driver-version-bad")
    ]
    step(e, 1.0)
    assert e.health(UUID).status == "unhealthy"  # held until the next run of the checks
    d = step(e, 60.0, checks=checks())
    assert d.device_state == "ok" and e.health(UUID).status == "healthy"
    assert len(e.health(UUID).checks) == 5
    assert [(ev.action, ev.reason) for ev in d.events] == [("check-ok", "level2-driver-version")]


def test_a_degraded_check_leaves_the_device_state_ok() -> None:
    e = engine()
    d = step(e, 0.0, checks=checks(persistenced="degraded"))
    assert d.device_state == "ok" and e.health(UUID).status == "degraded"


# --------------------------------------------------------------------------------------------------
# Level 3: the probe
# --------------------------------------------------------------------------------------------------


def test_a_failed_probe_makes_the_gpu_unhealthy_at_once() -> None:
    e = engine()
    d = step(e, 0.0, probe=FAIL)
    assert d.device_state == "unhealthy"
    assert e.health(UUID).twin_text() == "unhealthy:level3:probe-fail-cuCtxCreate-CUDA_ERROR_UNKNOWN"
    assert e.health(UUID).subsystem_status("cuda") == "unhealthy"


def test_after_a_probe_failure_n_passes_or_a_reset_and_one_pass_bring_it_back() -> None:
    e = engine({"recoveryProbes": 3})
    step(e, 0.0, probe=FAIL)
    step(e, 60.0, probe=PASS)
    step(e, 120.0, probe=PASS)
    assert e.health(UUID).status == "unhealthy"
    d = step(e, 180.0, probe=PASS)
    assert d.device_state == "ok"
    assert ("recovered", "level3-3-passing-probes") in [(ev.action, ev.reason) for ev in d.events]

    step(e, 200.0, probe=ProbeResult("timeout", "after-30s", latency_s=30.0))
    assert e.health(UUID).reason == "probe-timeout-after-30s"
    step(e, 210.0, events=(RESET,))
    assert e.health(UUID).status == "unhealthy"  # a reset alone is no proof: the probe must pass after it
    d = step(e, 220.0, probe=PASS)
    assert d.device_state == "ok"
    assert ("recovered", "level3-after-reset") in [(ev.action, ev.reason) for ev in d.events]


def test_a_slow_probe_degrades_and_a_skipped_one_changes_nothing() -> None:
    e = engine()
    step(e, 0.0, probe=ProbeResult("slow", "above-5s", latency_s=7.5))
    assert e.health(UUID).twin_text() == "degraded:level3:probe-slow-above-5s"
    step(e, 1.0, probe=ProbeResult("skipped", "busy-90pct"))
    assert e.health(UUID).status == "degraded"
    step(e, 2.0, probe=PASS)
    assert e.health(UUID).status == "healthy"


def test_health_disabled_clears_every_level() -> None:
    e = engine()
    step(e, 0.0, probe=FAIL, checks=checks(inforom="unhealthy"))
    e.configure(parse_policies({"health": {"enabled": False}}))
    d = step(e, 1.0)
    assert d.device_state == "ok" and e.health(UUID).status == "healthy"
    assert step(e, 2.0, checks=checks(inforom="unhealthy")).device_state == "ok"


# --------------------------------------------------------------------------------------------------
# The report and the twins' text
# --------------------------------------------------------------------------------------------------


def test_the_report_names_the_worst_level_and_counts_the_others() -> None:
    report = build_report(
        ("degraded", "xid92-warning", "memory"),
        (CheckResult("inforom", "unhealthy", "inforom-corrupted", "inforom"),),
        ("unhealthy", "probe-timeout"),
    )
    assert (report.status, report.level, report.reason) == ("unhealthy", 2, "inforom-corrupted")
    assert report.twin_text() == "unhealthy:level2:inforom-corrupted,2-more"
    assert dict((n, s) for n, s, _ in report.subsystems) == {
        "memory": "degraded",
        "inforom": "unhealthy",
        "cuda": "unhealthy",
    }
    assert HealthReport().twin_text() == "healthy"


@pytest.mark.parametrize(
    "probe",
    [
        ProbeResult("pass", latency_s=0.0841),
        ProbeResult("fail", "cuMemAlloc CUDA_ERROR_OUT_OF_MEMORY (2)", latency_s=1.5),
        ProbeResult("timeout", "after-30s", latency_s=30.0),
        ProbeResult("skipped", "busy-87pct"),
    ],
)
def test_the_probe_twin_is_twin_safe(probe: ProbeResult) -> None:
    text = probe.twin_text()
    assert TWIN_VALUE_RE.fullmatch(text), text
    assert text.startswith(probe.outcome)


def test_an_xid79_delivered_with_the_gpus_return_belongs_to_the_episode_that_ended() -> None:
    e = engine()
    assert step(e, 0.0, gpu_lost=True).device_state == "offline"
    d = step(e, 1.0, events=(xid(79), GpuEvent(UUID, 0, "driver_reload")))
    assert d.device_state == "ok" and e.health(UUID).status == "healthy"
    assert [(ev.action, ev.reason) for ev in d.events] == [("recovered", "gpu-back")]
    # a fresh XID 79 later is a new fault again
    assert step(e, 2.0, events=(xid(79),)).device_state == "unhealthy"
