"""deploy/prometheus/alerts.yaml: `promtool check rules` passes, the `promtool test rules` unit tests in
tests/alerts/ pass, every alert is tested both firing and not firing, and every expression uses metrics the
collector emits."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from mapper.edge.status.metrics import metric_names
from tests.test_deploy import metric_refs

REPO = Path(__file__).resolve().parents[1]
RULES = REPO / "deploy" / "prometheus" / "alerts.yaml"
TESTS = sorted((REPO / "tests" / "alerts").glob("*.yaml"))


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("promtool")
    assert exe, "promtool is needed (Debian package prometheus; scripts/test.sh installs it)"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=60, cwd=cwd)


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def alert_tests() -> list[dict[str, Any]]:
    out = []
    for path in TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            out.extend(case.get("alert_rule_test", []))
    return out


def test_promtool_check_rules_accepts_the_alert_rules() -> None:
    proc = promtool("check", "rules", str(RULES))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(rules())} rules found" in proc.stdout


def test_the_promtool_unit_tests_pass() -> None:
    assert TESTS, "tests/alerts/ has no promtool tests"
    proc = promtool("test", "rules", *(p.name for p in TESTS), cwd=TESTS[0].parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("SUCCESS") == len(TESTS)


def test_the_issues_alerts_exist_with_their_thresholds_durations_and_severities() -> None:
    by_name = {r["alert"]: r for r in rules()}
    util = by_name["GpuHighUtilization"]
    assert util["expr"] == "gpu_utilization_ratio > 0.9"
    assert (util["for"], util["labels"]["severity"]) == ("5m", "warning")
    temp = by_name["GpuHighTemperature"]
    assert temp["expr"] == "gpu_temperature_celsius > 80"
    assert (temp["for"], temp["labels"]["severity"]) == ("2m", "critical")
    for name in (
        "GpuMapperBufferNearlyFull",
        "GpuMapperTelemetryDropped",
        "GpuMapperEdgeCoreUnreachable",
        "GpuMapperDesiredStateRejected",
    ):
        assert name in by_name
    assert "gpu_mapper_dmi_registered == 0" in by_name["GpuMapperEdgeCoreUnreachable"]["expr"]


def test_every_alert_is_tested_firing_and_not_firing() -> None:
    cases = alert_tests()
    for rule in rules():
        mine = [c for c in cases if c["alertname"] == rule["alert"]]
        assert any(c["exp_alerts"] for c in mine), f"{rule['alert']}: no test where it fires"
        assert any(not c["exp_alerts"] for c in mine), f"{rule['alert']}: no test where it stays quiet"


def test_every_alert_has_a_severity_summary_and_description() -> None:
    for rule in rules():
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]


def test_every_alert_expression_uses_metrics_the_collector_emits() -> None:
    known = metric_names()
    for rule in rules():
        refs = metric_refs(rule["expr"])
        assert refs, rule["alert"]
        assert refs <= known, f"{rule['alert']} uses {sorted(refs - known)}"


def test_the_unit_tests_catch_a_changed_threshold(tmp_path: Path) -> None:
    """The promtool tests really pin the rules: with the temperature threshold moved, they fail."""
    (tmp_path / "deploy" / "prometheus").mkdir(parents=True)
    (tmp_path / "tests" / "alerts").mkdir(parents=True)
    text = RULES.read_text()
    assert "gpu_temperature_celsius > 80" in text
    (tmp_path / "deploy" / "prometheus" / "alerts.yaml").write_text(
        text.replace("gpu_temperature_celsius > 80", "gpu_temperature_celsius > 87")
    )
    test_file = tmp_path / "tests" / "alerts" / "gpu.yaml"
    test_file.write_text((REPO / "tests" / "alerts" / "gpu.yaml").read_text())
    proc = promtool("test", "rules", "gpu.yaml", cwd=test_file.parent)
    assert proc.returncode != 0
    assert "GpuHighTemperature" in proc.stdout + proc.stderr


@pytest.mark.parametrize("path", TESTS, ids=lambda p: p.name)
def test_each_promtool_test_file_loads_the_deployed_rules(path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    assert [(path.parent / f).resolve() for f in doc["rule_files"]] == [RULES.resolve()]
