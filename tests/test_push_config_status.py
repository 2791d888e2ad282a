"""The push section of the mapper's config and its credentials; each destination in ``/status`` (and the status
file), ``gpu-mapper status`` and ``/metrics``."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from mapper.edge.config import load_settings
from mapper.edge.push.destination import DestinationStatus
from mapper.edge.status.metrics import build_registry, metric_names, render_metrics
from mapper.edge.status.stats import MapperSnapshot, SnapshotFormatError
from mapper.edge.status.view import render_status
from mapper.errors import ConfigError

ENV = {"GPU_MAPPER_NODE_NAME": "edge1"}


def config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


def test_the_push_section_is_read_with_its_defaults(tmp_path: Path) -> None:
    default = load_settings(config(tmp_path, "nodeName: edge1\n"), env={})
    assert default.push_mqtt_format == "batch" and default.push_timeout_s == 10.0
    assert default.push_replay_rate_per_s == 200.0 and default.push_influxdb2_numbers is False
    text = (
        "push: {mqttFormat: text, timeout: 2500ms, caFile: /etc/ca.pem, replayRate: 50, retryMax: 30s, "
        "influxdb2Numbers: true}\n"
    )
    s = load_settings(config(tmp_path, text), env=ENV)
    assert (s.push_mqtt_format, s.push_timeout_s, s.push_ca_file) == ("text", 2.5, "/etc/ca.pem")
    assert (s.push_replay_rate_per_s, s.push_retry_max_s, s.push_influxdb2_numbers) == (50.0, 30.0, True)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("push: {mqttFormat: lines}", "push.mqttFormat"),
        ("push: {timeout: 0s}", "push.timeout"),
        ("push: {timeout: soon}", "push.timeout"),
        ("push: {replayRate: 0}", "push.replayRate"),
        ("push: {retryMax: 0s}", "push.retryMax"),
        ("push: {influxdb2Numbers: maybe}", "push.influxdb2Numbers"),
    ],
)
def test_a_bad_push_setting_is_refused_naming_its_key(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_settings(config(tmp_path, text + "\n"), env=ENV)


def test_credentials_come_from_the_frameworks_variables_and_files_win_never_shown(tmp_path: Path) -> None:
    env = {**ENV, "TOKEN": "tok-env", "PASSWORD": "pw-env", "USERNAME": "user-env"}
    s = load_settings(config(tmp_path, "nodeName: edge1\n"), env=env)
    assert (s.push_secrets.token, s.push_secrets.password, s.push_secrets.username) == ("tok-env", "pw-env", "user-env")
    assert "tok-env" not in repr(s) and "pw-env" not in repr(s)
    (tmp_path / "password").write_text("pw-file\n")
    s = load_settings(config(tmp_path, f"push: {{passwordFile: {tmp_path / 'password'}}}\n"), env=env)
    assert s.push_secrets.password == "pw-file" and s.push_secrets.token == "tok-env"
    none = load_settings(config(tmp_path, "nodeName: edge1\n"), env=ENV)
    assert none.push_secrets.token is None and none.push_secrets.password is None
    with pytest.raises(ConfigError, match=r"push\.tokenFile"):
        load_settings(config(tmp_path, f"push: {{tokenFile: {tmp_path / 'missing'}}}\n"), env=env)


# --------------------------------------------------------------------------------------------------
# status, gpu-mapper status, /metrics
# --------------------------------------------------------------------------------------------------

DOWN = DestinationStatus(
    key="http http://10.0.0.5:8080/temp",
    kind="http",
    state="down",
    backlog_samples=12,
    backlog_bytes=2048,
    delivered_samples=300,
    failures=7,
    dropped={"refused": 2, "age": 1},
    last_error="http http://10.0.0.5:8080: ConnectionRefusedError: [Errno 111] Connection refused",
    last_success_ms=1_780_000_000_000,
    properties=2,
)
OK = DestinationStatus(key="otel http://c:4318/v1/metrics", kind="otel", state="ok", delivered_samples=5, properties=1)


def snapshot() -> MapperSnapshot:
    return MapperSnapshot(node="edge1", push_destinations=(DOWN, OK))


def test_the_destinations_go_through_the_status_json_and_an_older_file_without_them_still_reads() -> None:
    snap = snapshot()
    back = MapperSnapshot.from_json(snap.to_json())
    assert back.push_destinations == (DOWN, OK)
    doc = snap.to_dict()
    del doc["push"]
    assert MapperSnapshot.from_dict(doc).push_destinations == ()
    doc = snap.to_dict()
    doc["push"]["destinations"][0]["state"] = "sleeping"
    with pytest.raises(SnapshotFormatError, match="state"):
        MapperSnapshot.from_dict(doc)


def test_gpu_mapper_status_shows_each_destinations_state_backlog_and_last_error() -> None:
    # (the wide form: one line a destination; the default form wraps a line at 120 columns, the error included)
    narrow = render_status(snapshot())
    assert max(len(line) for line in narrow.splitlines()) <= 120
    assert "last error: http http://10.0.0.5:8080:" in " ".join(narrow.split())
    text = render_status(snapshot(), wide=True)
    lines = text.splitlines()
    down = next(line for line in lines if "http://10.0.0.5:8080/temp" in line)
    assert "DOWN" in down and "12 waiting (2.0 KiB)" in down and "300 delivered" in down
    assert "dropped: age 1, refused 2" in down and "7 failed tries" in down
    assert "last error: http http://10.0.0.5:8080: ConnectionRefusedError" in down
    ok = next(line for line in lines if "otel http://c:4318" in line)
    assert ": ok, 0 waiting" in ok and "last error" not in ok
    assert "push destinations:" not in render_status(MapperSnapshot(node="edge1"))


def test_metrics_show_each_destinations_state_backlog_drops_and_last_error_in_base_units() -> None:
    reg = build_registry(snapshot)
    labels = {"destination": DOWN.key, "method": "http"}
    assert reg.get_sample_value("gpu_mapper_push_state", {**labels, "state": "down"}) == 1
    assert reg.get_sample_value("gpu_mapper_push_state", {**labels, "state": "ok"}) == 0
    assert reg.get_sample_value("gpu_mapper_push_backlog_samples", labels) == 12
    assert reg.get_sample_value("gpu_mapper_push_backlog_bytes", labels) == 2048
    assert reg.get_sample_value("gpu_mapper_push_delivered_samples_total", labels) == 300
    assert reg.get_sample_value("gpu_mapper_push_failures_total", labels) == 7
    assert reg.get_sample_value("gpu_mapper_push_dropped_samples_total", {**labels, "reason": "refused"}) == 2
    assert reg.get_sample_value("gpu_mapper_push_last_success_timestamp_seconds", labels) == 1_780_000_000
    assert reg.get_sample_value("gpu_mapper_push_last_error_info", {**labels, "error": DOWN.last_error}) == 1
    ok = {"destination": OK.key, "method": "otel"}
    assert reg.get_sample_value("gpu_mapper_push_last_error_info", {**ok, "error": ""}) is None
    for name in ("gpu_mapper_push_state", "gpu_mapper_push_backlog_samples", "gpu_mapper_push_failures_total"):
        assert name in metric_names()


def test_promtool_accepts_the_push_metrics() -> None:
    assert shutil.which("promtool"), "promtool is needed (Debian package prometheus)"
    text = render_metrics(build_registry(snapshot))
    proc = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, timeout=30)
    assert proc.returncode == 0, proc.stdout.decode() + proc.stderr.decode()
