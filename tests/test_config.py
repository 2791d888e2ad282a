import re
from pathlib import Path

import pytest

from mapper.bridge.config import load_bridge_settings
from mapper.edge.config import FILE_SECTIONS, load_settings
from mapper.errors import ConfigError
from mapper.shared.settings import CONFIG_SECTIONS, parse_duration_s, parse_size_bytes


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


def test_flags_override_environment_which_overrides_the_file(tmp_path):
    cfg = write(tmp_path, "nodeName: from-file\nmqtt: {url: 'mqtt://file:1883'}\ndataDir: /file\n")
    env = {"GPU_MAPPER_NODE_NAME": "from-env", "GPU_MAPPER_DATA_DIR": "/env"}
    s = load_settings(cfg, env=env, flags={"node_name": "from-flag", "data_dir": None})
    assert s.node_name == "from-flag"
    assert s.data_dir == "/env"
    assert s.mqtt.url == "mqtt://file:1883"


def test_a_configmap_manifest_is_read_from_its_config_yaml_key(tmp_path):
    cfg = write(
        tmp_path,
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\ndata:\n  config.yaml: |\n    nodeName: edge-1\n"
        "    buffer: {maxBytes: 64MiB, maxAge: 2d}\n    telemetry: {window: 5s}\n",
    )
    s = load_settings(cfg, env={})
    assert s.node_name == "edge-1"
    assert s.buffer_max_bytes == 64 * 1024**2
    assert s.buffer_max_age_s == 2 * 86400
    assert s.telemetry_window_s == 5


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("mqtt: {url: 'http://x'}\n", "mqtt.url"),
        ("telemetry: {window: soon}\n", "telemetry.window"),
        ("buffer: {maxBytes: lots}\n", "buffer.maxBytes"),
        ("nodeName: Not_Valid\n", "nodeName"),
        ("bogus: 1\n", "bogus"),
        ("reconcile: {clamp: maybe}\n", "reconcile.clamp"),
        ("- a list\n", "top level"),
    ],
)
def test_bad_config_names_the_key(tmp_path, text, needle):
    with pytest.raises(ConfigError) as err:
        load_settings(write(tmp_path, text), env={})
    assert needle in str(err.value)


def test_a_bad_environment_value_names_the_variable():
    with pytest.raises(ConfigError) as err:
        load_settings(None, env={"GPU_MAPPER_SIM": "many", "GPU_MAPPER_NODE_NAME": "n"})
    assert "GPU_MAPPER_SIM" in str(err.value)


def test_durations_and_sizes():
    assert parse_duration_s("250ms", "x") == 0.25
    assert parse_duration_s("5m", "x") == 300
    assert parse_duration_s(30, "x") == 30
    assert parse_size_bytes("1GiB", "x") == 1024**3
    with pytest.raises(ConfigError):
        parse_duration_s("-1s", "x")


def test_standalone_mode_turns_dmi_off_and_eventbus_on_with_a_broker(tmp_path):
    s = load_settings(None, env={}, flags={"node_name": "n", "devices_dir": str(tmp_path), "mqtt_url": "mqtt://h:1"})
    assert not s.dmi_enabled
    assert s.eventbus_enabled
    s2 = load_settings(None, env={}, flags={"node_name": "n", "mqtt_url": "mqtt://h:1"})
    assert s2.dmi_enabled and not s2.eventbus_enabled


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        # Found by the bad-input suite (tests/fuzz): each of these raised TypeError or OverflowError before.
        ("defaults: {collectCycle: [1]}\n", "defaults.collectCycle: expected a number"),
        ("buffer: {maxBytes: .inf}\n", "buffer.maxBytes: must be a finite size"),
        ("telemetry: {window: .inf}\n", "telemetry.window: must be a finite duration"),
        ("dmi: {burst: .inf}\n", "dmi.burst: must be a finite number"),
        ("~: 1\n", "unknown key(s) None"),
        ("kind: ConfigMap\ndata: {config.yaml: 5}\n", "must be text"),
        ("kind: ConfigMap\ndata: {config.yaml: '[1, 2]'}\n", "must be a mapping"),
        ("kind: ConfigMap\ndata: {config.yaml: 'a: [b'}\n", "not valid YAML"),
    ],
)
def test_odd_config_values_are_refused_naming_the_key(tmp_path, text, needle):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(needle)):
        load_settings(str(path), env={})


def test_compaction_is_on_by_default_and_set_or_turned_off_in_the_buffer_section(tmp_path):
    assert (load_settings(None, env={}).buffer_compact_after_s, load_settings(None, env={}).buffer_compact_slot_s) == (
        30.0,
        600.0,
    )
    s = load_settings(write(tmp_path, "buffer: {compactAfter: 5m, compactSlot: 30m, compactColdSlot: 2h}\n"), env={})
    assert (s.buffer_compact_after_s, s.buffer_compact_slot_s, s.buffer_compact_cold_slot_s) == (300.0, 1800.0, 7200.0)
    off = load_settings(None, env={"GPU_MAPPER_BUFFER_COMPACT_AFTER_S": "0s"})
    assert off.buffer_compact_after_s == 0


def test_the_config_files_sections_are_the_mappers_its_policies_and_the_bridges() -> None:
    assert FILE_SECTIONS | {"policies", "bridge"} == CONFIG_SECTIONS


def test_both_processes_refuse_a_config_file_with_a_section_neither_knows(tmp_path):
    cfg = write(tmp_path, "nodeName: n\nbridge: {group: g}\nnodename: typo\n")
    bridge_flags = {"mqtt_url": "mqtt://b:1883", "remote_write": "http://p:9090/api/v1/write"}
    with pytest.raises(ConfigError, match=re.escape("unknown key(s) nodename")):
        load_settings(cfg, env={})
    with pytest.raises(ConfigError, match=re.escape("unknown key(s) nodename")):
        load_bridge_settings(cfg, env={}, flags=bridge_flags)
    cfg = write(tmp_path, "nodeName: n\nbridge: {group: g}\npolicies: {}\n")
    assert load_settings(cfg, env={}).node_name == "n"
    assert load_bridge_settings(cfg, env={}, flags=bridge_flags).group == "g"


def test_the_simulators_cost_profile_is_none_unless_the_file_environment_or_flag_names_one(tmp_path):
    from mapper.edge.app import build_backend

    assert load_settings(None, env={"GPU_MAPPER_NODE_NAME": "n"}).sim_cost == "none"
    assert load_settings(write(tmp_path, "nodeName: n\nsim: {count: 1, cost: h200}\n"), env={}).sim_cost == "h200"
    from_env = load_settings(None, env={"GPU_MAPPER_NODE_NAME": "n", "GPU_MAPPER_SIM_COST": "h200"})
    assert from_env.sim_cost == "h200"
    from_flag = load_settings(None, env={"GPU_MAPPER_SIM_COST": "h200"}, flags={"node_name": "n", "sim_cost": "none"})
    assert from_flag.sim_cost == "none"
    with pytest.raises(ConfigError, match=r"sim\.cost: must be one of none, h200, got 'h100'"):
        load_settings(write(tmp_path, "nodeName: n\nsim: {cost: h100}\n"), env={})
    backend = build_backend(load_settings(None, env={}, flags={"node_name": "n", "sim": 1, "sim_cost": "h200"}))
    assert backend.nvml.cost_profile == "h200"  # type: ignore[union-attr]
