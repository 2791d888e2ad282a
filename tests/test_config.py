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
        ("~: 1\n", "None: unknown key (expected one of backend, bridge, buffer"),
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
    with pytest.raises(ConfigError, match=re.escape("nodename: unknown key; did you mean nodeName?")):
        load_settings(cfg, env={})
    with pytest.raises(ConfigError, match=re.escape("nodename: unknown key; did you mean nodeName?")):
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


# Every section of the mapper's, one misspelt key each: the error names the key path and the key meant. The key
# meant is written here by hand, not taken from the code's tables.
@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("mqtt: {urll: 'mqtt://b:1883'}\n", "mqtt.urll: unknown key; did you mean url?"),
        ("mqtt: {inboundburst: 5}\n", "mqtt.inboundburst: unknown key; did you mean inboundBurst?"),
        ("buffer: {maxByte: 1MiB}\n", "buffer.maxByte: unknown key; did you mean maxBytes?"),
        ("telemetry: {windw: 5s}\n", "telemetry.windw: unknown key; did you mean window?"),
        ("sim: {cont: 2}\n", "sim.cont: unknown key; did you mean count?"),
        ("jetson: {allowReboots: true}\n", "jetson.allowReboots: unknown key; did you mean allowReboot?"),
        ("log: {levl: debug}\n", "log.levl: unknown key; did you mean level?"),
        ("defaults: {reportcycle: 5s}\n", "defaults.reportcycle: unknown key; did you mean reportCycle?"),
        ("dmi: {bursts: 5}\n", "dmi.bursts: unknown key; did you mean burst?"),
        ("reconcile: {clmp: true}\n", "reconcile.clmp: unknown key; did you mean clamp?"),
        ("console: {printIntervall: 5s}\n", "console.printIntervall: unknown key; did you mean printInterval?"),
        ("processes: {topn: 3}\n", "processes.topn: unknown key; did you mean topN?"),
        ("processes: {leak: {windoww: 1h}}\n", "processes.leak.windoww: unknown key; did you mean window?"),
    ],
)
def test_a_misspelt_key_in_any_section_is_refused_naming_its_path_and_the_key_meant(tmp_path, text, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_settings(write(tmp_path, "nodeName: n\n" + text), env={})


def test_a_key_nothing_is_close_to_is_refused_with_the_keys_of_its_section(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_settings(write(tmp_path, "telemetry: {zzzzzz: 1}\n"), env={})
    assert "telemetry.zzzzzz: unknown key (expected one of window, format, live)" in str(err.value)


def test_every_fault_is_named_at_once_and_a_section_that_is_no_mapping_is_refused(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_settings(write(tmp_path, "mqtt: {urll: x}\nbuffer: {maxage: 1d}\n"), env={})
    assert "mqtt.urll: unknown key; did you mean url?" in str(err.value)
    assert "buffer.maxage: unknown key; did you mean maxAge?" in str(err.value)
    # ``mqtt: mqtt://b:1883`` would otherwise run with no broker and no word.
    with pytest.raises(ConfigError, match=re.escape("mqtt: expected a mapping (with keys url, ")):
        load_settings(write(tmp_path, "mqtt: 'mqtt://b:1883'\n"), env={})
    # An empty section is no fault; the free-form mappings (idlePower, policies, bridge) are checked elsewhere.
    s = load_settings(
        write(tmp_path, "nodeName: n\nmqtt:\nprocesses: {idlePower: {H100: 60}}\nbridge: {group: g}\n"), env={}
    )
    assert (s.mqtt.url, dict(s.idle_power_w)) == (None, {"H100": 60.0})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("bridge: {mqtt: {urll: 'mqtt://b:1883'}}\n", "bridge.mqtt.urll: unknown key; did you mean url?"),
        ("bridge: {mqtt: {sessionExpiri: 1h}}\n", "bridge.mqtt.sessionExpiri: unknown key; did you mean sessionExpiry"),
        ("bridge: {remoteWrite: {timout: 5s}}\n", "bridge.remoteWrite.timout: unknown key; did you mean timeout?"),
        ("bridge: {batch: {maxSample: 5}}\n", "bridge.batch.maxSample: unknown key; did you mean maxSamples?"),
        ("bridge: {retry: {minbackoff: 1s}}\n", "bridge.retry.minbackoff: unknown key; did you mean minBackoff?"),
        ("bridge: {dedup: {maxStream: 5}}\n", "bridge.dedup.maxStream: unknown key; did you mean maxStreams?"),
        ("bridge: {log: {formatt: json}}\n", "bridge.log.formatt: unknown key; did you mean format?"),
        ("bridge: {grup: g}\n", "bridge.grup: unknown key; did you mean group?"),
        ("bridge: {remoteWrite: 'http://p/w'}\n", "bridge.remoteWrite: expected a mapping (with keys url, "),
    ],
)
def test_the_bridge_refuses_a_misspelt_key_in_any_of_its_sections(tmp_path, text, message):
    flags = {"mqtt_url": "mqtt://b:1883", "remote_write": "http://p:9090/api/v1/write"}
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_bridge_settings(write(tmp_path, text), env={}, flags=flags)


REPO = Path(__file__).resolve().parent.parent


def _yaml_blocks(markdown: Path) -> list[str]:
    return re.findall(r"```yaml\n(.*?)```", markdown.read_text(), flags=re.DOTALL)


def test_the_config_files_and_config_snippets_in_the_repository_still_load(tmp_path):
    env = {"GPU_MAPPER_NODE_NAME": "edge1"}
    bridge_env = {"GPU_MAPPER_BRIDGE_REMOTE_WRITE": "http://p:9090/api/v1/write"}
    loaded = 0
    for configmap in (REPO / "deploy/configmap.yaml", REPO / "deploy/bridge/configmap.yaml"):
        load_settings(str(configmap), env=env)
        load_bridge_settings(str(configmap), env={**bridge_env, "GPU_MAPPER_BRIDGE_MQTT_URL": "mqtt://b:1"}, flags={})
        loaded += 1
    # The docs' snippets of the config file (a YAML block whose top-level keys are all config sections).
    for markdown in [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]:
        for block in _yaml_blocks(markdown):
            keys = re.findall(r"^([A-Za-z]\w*):", block, flags=re.MULTILINE)
            if keys and set(keys) <= CONFIG_SECTIONS:
                load_settings(write(tmp_path, block), env=env)
                loaded += 1
    assert loaded >= 4  # the two ConfigMaps and the policies snippets of docs/policies.md, docs/health.md
