"""Settings: the YAML config file (the ConfigMap), overridden by ``GPU_MAPPER_*`` environment variables,
overridden by command-line flags. Frozen dataclasses; every validation error names the key path.

The file uses the camelCase keys of ``deploy/configmap.yaml``; the environment and flags use the names listed in
``ENV_KEYS`` (``GPU_MAPPER_NODE_NAME``, ...). ``policies`` is kept as a mapping and parsed by
``mapper.edge.control.policy``.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from mapper.errors import ConfigError
from mapper.shared.push import PushSecrets
from mapper.shared.settings import (
    MAPPER_ENV_PREFIX,
    MQTT_KEYS,
    MqttSettings,
    convert,
    env_variable,
    key_tree,
    layered_values,
    lookup,
    read_config_file,
    read_secret_file,
    refuse_unknown_keys,
    take_mqtt_settings,
)

#: The simulated NVML's cost profiles (``mapper.edge.gpu.profiles.COST_PROFILES``; a test keeps the two equal).
SIM_COST_PROFILES = ("none", "h200")


@dataclass(frozen=True)
class Settings:
    node_name: str = field(default_factory=socket.gethostname)
    #: Number of simulated GPUs; 0 = the real NVML (pynvml).
    sim: int = 0
    sim_profile: str = "H100"
    sim_seed: int = 0
    sim_scenario: str = "inference"
    #: What each simulated NVML call costs (``SIM_COST_PROFILES``): ``none`` (free: the simulator as a functional
    #: stand-in, as tests want it) or ``h200`` (the per-call CPU and waits measured on an H200: what a benchmark
    #: projects a real driver with).
    sim_cost: str = "none"
    #: Which GPU library: ``auto`` (a Jetson where a Tegra GPU is found: sysfs, nvpmodel and NVML where it serves;
    #: else NVML), ``nvml`` or ``jetson``.
    backend: str = "auto"
    #: Jetson: the filesystem root sysfs, /proc and the nvpmodel files are read under (a host mount in a pod).
    jetson_root: str = "/"
    #: Jetson: the nvpmodel command (split on blanks); ``-m <id>`` is appended.
    jetson_nvpmodel: str = "nvpmodel"
    #: Jetson: a desired power mode that needs a reboot may reboot the node (else it is rejected: needs-reboot).
    jetson_allow_reboot: bool = False
    edgecore_socket: str = "/etc/kubeedge/dmi.sock"
    socket: str = "/etc/kubeedge/gpu.sock"
    mqtt: MqttSettings = field(default_factory=MqttSettings)
    data_dir: str = "/var/lib/gpu-mapper"
    #: Standalone mode: load Device/DeviceModel YAML from this folder instead of EdgeCore.
    devices_dir: str | None = None
    metrics_addr: str = "0.0.0.0:9410"
    #: TLS and basic auth for the HTTP endpoints: a Prometheus exporter-toolkit web config file (None = off).
    web_config_file: str | None = None
    log_format: str = "text"
    log_level: str = "INFO"
    #: The fastest collect cycle allowed (ms); a property whose cycle is 0 uses its catalog default.
    collect_cycle_ms: int = 1_000
    #: Defaults for a Device property whose report cycle is 0 (unset), in milliseconds.
    report_cycle_ms: int = 20_000
    state_report_cycle_ms: int = 60_000
    telemetry_window_s: float = 10.0
    telemetry_format: str = "binary"
    #: Publish each sample at once on ``gpu-mapper/{node}/{namespace}/{name}/live`` (QoS 0, not retained, never
    #: buffered) for edge applications that act on it. Off by default: it costs a publish per sample and GPU
    #: whether anyone listens or not, and the batches carry the same values.
    telemetry_live: bool = False
    buffer_max_bytes: int = 256 * 1024**2
    buffer_max_age_s: float = 7 * 86400.0
    #: While the data dir cannot be written (full, read-only): how much telemetry is kept in memory, and the reserve
    #: file the buffer deletes at the first full write so that dropping the oldest can work (docs/telemetry.md).
    buffer_memory_max_bytes: int = 16 * 1024**2
    buffer_reserve_bytes: int = 4 * 1024**2
    replay_rate_bytes_per_s: int | None = None
    #: Backlog compaction (mapper.edge.outbox.compact): waiting batches merged per stream into ``buffer_compact_slot_s``
    #: batches once ``buffer_compact_after_s`` old (0 = off), and those again into one per
    #: ``buffer_compact_cold_slot_s`` once that is over.
    buffer_compact_after_s: float = 30.0
    buffer_compact_slot_s: float = 600.0
    buffer_compact_cold_slot_s: float = 3600.0
    #: DMI rate budget shared by every report of this mapper (EdgeCore allows 1/s, burst 100, node-wide).
    dmi_rate_per_s: float = 0.8
    dmi_burst: int = 10
    #: Largest gRPC message the mapper's own DMI server receives or sends (EdgeCore's Devices and models).
    dmi_max_message_bytes: int = 4 * 1024**2
    #: Messages from the broker (deltas, membership updates): per device, messages per second and burst, and
    #: the largest payload parsed. A desired value over the rate waits for the device's next token (the newest
    #: per property wins); what is dropped (a value superseded while it waited, a membership update over the
    #: rate, a payload too large) is counted and logged once per minute.
    inbound_rate_per_s: float = 2.0
    inbound_burst: int = 20
    inbound_max_bytes: int = 64 * 1024
    #: Clamp out-of-range desired values to the GPU's limits instead of rejecting them.
    clamp: bool = False
    #: On removal of a desired persistence/compute mode, set them back to off/default (else leave them).
    restore_modes: bool = False
    #: The ``policies`` mapping, validated by ``mapper.edge.control.policy.parse_policies``.
    policies: Mapping[str, Any] = field(default_factory=dict)
    #: Print a live per-GPU table on stdout every ``print_interval_s`` (0 = off).
    print_interval_s: float = 0.0
    config_file: str | None = None
    #: The process cycle (docs/processes.md): who uses each GPU, sampled every ``process_interval_s`` (0 = off);
    #: series of their own for the top ``process_top_n`` processes per GPU (by SM share and by memory) and
    #: energy counters for at most ``process_max_workloads`` containers per GPU, the rest summed as ``other``.
    process_interval_s: float = 5.0
    process_top_n: int = 5
    process_max_workloads: int = 32
    #: Where the host's processes are seen (``/proc`` with ``hostPID: true``) and the root the kubelet's (or
    #: edged's) pod files are read under (``/var/log/containers``, ``/var/log/pods``, ``/var/lib/*/pods``).
    proc_root: str = "/proc"
    pod_files_root: str = "/"
    #: The GPU memory leak detector: a process whose memory floor rises over the window by the threshold.
    leak_enabled: bool = True
    leak_window_s: float = 1800.0
    leak_threshold_bytes: int = 1 << 30
    #: The idle power (W) of a GPU by UUID or product name, where known; else the process cycle learns it.
    idle_power_w: Mapping[str, float] = field(default_factory=dict)
    #: The push methods a Device names (docs/push.md). ``pushMethod.mqtt`` as our telemetry batches (``batch``,
    #: what the bridge reads) or as the framework's one text message per sample (``text``).
    push_mqtt_format: str = "batch"
    #: Every push request's time bound where the Device sets none (http ``timeout``).
    push_timeout_s: float = 10.0
    #: CA bundle for https destinations (http, otel, influxdb2); None: the system's.
    push_ca_file: str | None = None
    #: Credentials of the DB methods from files (a mounted Secret); else the framework's variables TOKEN,
    #: PASSWORD, USERNAME (``push_secrets``).
    push_token_file: str | None = None
    push_password_file: str | None = None
    push_username_file: str | None = None
    #: A destination's backlog is replayed at most this fast (samples per second).
    push_replay_rate_per_s: float = 200.0
    #: The longest wait between two tries of a destination that is down.
    push_retry_max_s: float = 10.0
    #: dbMethod.influxdb2 writes a number as a float field (the framework writes every value as a string field).
    push_influxdb2_numbers: bool = False
    #: The credentials every push and DB method uses (never shown by repr).
    push_secrets: PushSecrets = field(default_factory=PushSecrets)
    #: The names of the settings given in the file, the environment or flags (``load_settings``); the others
    #: are the defaults. (Settings made in code say nothing here: compare with ``Settings()`` too.)
    given: frozenset[str] = frozenset()

    @property
    def dmi_enabled(self) -> bool:
        return self.devices_dir is None

    @property
    def eventbus_enabled(self) -> bool:
        if self.mqtt.url is None:
            return False
        if self.mqtt.eventbus == "auto":
            return not self.dmi_enabled
        return self.mqtt.eventbus in ("true", "on", "yes", "1")


# name in flags/env -> (file key path, converter)
_FILE_KEYS: dict[str, tuple[str, str]] = {
    "node_name": ("nodeName", "str"),
    "sim": ("sim.count", "int"),
    "sim_profile": ("sim.profile", "str"),
    "sim_seed": ("sim.seed", "int"),
    "sim_scenario": ("sim.scenario", "str"),
    "sim_cost": ("sim.cost", "str"),
    "backend": ("backend", "str"),
    "jetson_root": ("jetson.root", "str"),
    "jetson_nvpmodel": ("jetson.nvpmodel", "str"),
    "jetson_allow_reboot": ("jetson.allowReboot", "bool"),
    "edgecore_socket": ("edgecoreSocket", "str"),
    "socket": ("socket", "str"),
    **MQTT_KEYS,
    "mqtt_eventbus": ("mqtt.eventbus", "str"),
    "mqtt_qos": ("mqtt.qos", "int"),
    "data_dir": ("dataDir", "str"),
    "devices_dir": ("devicesDir", "str"),
    "metrics_addr": ("metricsAddr", "str"),
    "web_config_file": ("webConfigFile", "str"),
    "log_format": ("log.format", "str"),
    "log_level": ("log.level", "str"),
    "collect_cycle_ms": ("defaults.collectCycle", "ms"),
    "report_cycle_ms": ("defaults.reportCycle", "ms"),
    "state_report_cycle_ms": ("defaults.stateReportCycle", "ms"),
    "telemetry_window_s": ("telemetry.window", "duration"),
    "telemetry_format": ("telemetry.format", "str"),
    "telemetry_live": ("telemetry.live", "bool"),
    "buffer_max_bytes": ("buffer.maxBytes", "size"),
    "buffer_max_age_s": ("buffer.maxAge", "duration"),
    "buffer_memory_max_bytes": ("buffer.memoryMaxBytes", "size"),
    "buffer_reserve_bytes": ("buffer.reserveBytes", "size"),
    "replay_rate_bytes_per_s": ("buffer.replayRateLimit", "size"),
    "buffer_compact_after_s": ("buffer.compactAfter", "duration"),
    "buffer_compact_slot_s": ("buffer.compactSlot", "duration"),
    "buffer_compact_cold_slot_s": ("buffer.compactColdSlot", "duration"),
    "dmi_rate_per_s": ("dmi.ratePerSecond", "float"),
    "dmi_burst": ("dmi.burst", "int"),
    "dmi_max_message_bytes": ("dmi.maxMessageBytes", "size"),
    "inbound_rate_per_s": ("mqtt.inboundRatePerSecond", "float"),
    "inbound_burst": ("mqtt.inboundBurst", "int"),
    "inbound_max_bytes": ("mqtt.inboundMaxBytes", "size"),
    "clamp": ("reconcile.clamp", "bool"),
    "restore_modes": ("reconcile.restoreModes", "bool"),
    "print_interval_s": ("console.printInterval", "duration"),
    "process_interval_s": ("processes.interval", "duration"),
    "process_top_n": ("processes.topN", "int"),
    "process_max_workloads": ("processes.maxWorkloads", "int"),
    "proc_root": ("processes.procRoot", "str"),
    "pod_files_root": ("processes.podFilesRoot", "str"),
    "leak_enabled": ("processes.leak.enabled", "bool"),
    "leak_window_s": ("processes.leak.window", "duration"),
    "leak_threshold_bytes": ("processes.leak.threshold", "size"),
    "push_mqtt_format": ("push.mqttFormat", "str"),
    "push_timeout_s": ("push.timeout", "duration"),
    "push_ca_file": ("push.caFile", "str"),
    "push_token_file": ("push.tokenFile", "str"),
    "push_password_file": ("push.passwordFile", "str"),
    "push_username_file": ("push.usernameFile", "str"),
    "push_replay_rate_per_s": ("push.replayRate", "float"),
    "push_retry_max_s": ("push.retryMax", "duration"),
    "push_influxdb2_numbers": ("push.influxdb2Numbers", "bool"),
}

#: The framework's variables for the DB methods' credentials (KubeEdge's mapper docs fill them from a Secret):
#: the influxdb2 token, the redis/mysql/tdengine password, the tdengine user.
PUSH_SECRET_VARIABLES = {"token": "TOKEN", "password": "PASSWORD", "username": "USERNAME"}

#: Environment variables read (each overrides the file, and is overridden by the flag of the same name).
ENV_KEYS: dict[str, str] = {name: env_variable(MAPPER_ENV_PREFIX, name) for name in _FILE_KEYS}

#: Every key the mapper reads in the config file: its settings', ``processes.idlePower`` (GPU -> watts, checked
#: by ``_idle_power``), ``policies`` (checked by ``mapper.edge.control.policy``) and the bridge's ``bridge``
#: (checked by ``mapper.bridge.config``). Any other key, at any depth, is refused naming its path.
FILE_KEY_TREE = key_tree([*(path for path, _ in _FILE_KEYS.values()), "processes.idlePower", "policies", "bridge"])

#: The top-level keys of the mapper's settings in the config file (``mapper.shared.settings.CONFIG_SECTIONS``
#: holds them, with ``policies`` and the bridge's ``bridge``: a test checks that they agree).
FILE_SECTIONS = frozenset(path.split(".")[0] for path, _ in _FILE_KEYS.values())


#: Settings that hold a secret, by the name of their flag: given on the command line they are visible to every
#: local user in the process list (``ps``, ``/proc/<pid>/cmdline``).
SECRET_FLAGS: dict[str, str] = {"mqtt_password": "mqtt_password_file"}


def load_settings(
    file_path: str | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> Settings:
    """Flags (non-None values) override the environment, which overrides the file, which overrides defaults."""
    env = os.environ if env is None else env
    flags = flags or {}
    if file_path is None:
        file_path = flags.get("config") or env.get("GPU_MAPPER_CONFIG")
    file_data = read_config_file(file_path) if file_path else {}
    refuse_unknown_keys(file_data, FILE_KEY_TREE, where=f"config file {file_path}: ")

    values = layered_values(_FILE_KEYS, file_data, env, ENV_KEYS, flags)
    given = frozenset(values)
    mqtt = replace(
        take_mqtt_settings(values, password_file_may_be_missing=True),
        eventbus=(values.pop("mqtt_eventbus", None) or "auto").lower(),
        qos=values.pop("mqtt_qos", None) if values.get("mqtt_qos") is not None else 1,
    )
    values.pop("mqtt_qos", None)
    policies = file_data.get("policies") or {}
    if not isinstance(policies, Mapping):
        raise ConfigError("policies: must be a mapping")
    idle_power = _idle_power(lookup(file_data, "processes.idlePower"))
    settings = replace(
        Settings(),
        mqtt=mqtt,
        policies=dict(policies),
        config_file=file_path,
        idle_power_w=idle_power,
        given=given,
        **values,
    )
    settings = replace(settings, push_secrets=push_secrets(settings, env))
    validate(settings)
    return settings


def push_secrets(settings: Settings, env: Mapping[str, str]) -> PushSecrets:
    """The DB methods' credentials: each from its file (``push.tokenFile``, ``push.passwordFile``,
    ``push.usernameFile``: a mounted Secret) where one is named, else from the framework's variable (``TOKEN``,
    ``PASSWORD``, ``USERNAME``), else none. Never from the Device."""
    files = {
        "token": (settings.push_token_file, "push.tokenFile"),
        "password": (settings.push_password_file, "push.passwordFile"),
        "username": (settings.push_username_file, "push.usernameFile"),
    }
    values: dict[str, str | None] = {}
    for name, (path, key) in files.items():
        if path is not None:
            values[name] = read_secret_file(path, key)
        else:
            values[name] = env.get(PUSH_SECRET_VARIABLES[name]) or None
    return PushSecrets(**values)


def _idle_power(raw: Any) -> dict[str, float]:
    """``processes.idlePower``: ``{<GPU UUID or product name>: <watts>}``."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"processes.idlePower: expected a mapping of GPU UUID or product name to watts, got {raw!r}")
    out: dict[str, float] = {}
    for key, value in raw.items():
        watts = convert("float", value, f"processes.idlePower.{key}")
        if not watts:
            raise ConfigError(f"processes.idlePower.{key}: must be more than 0 W, got {value!r}")
        out[str(key)] = watts
    return out


def validate(settings: Settings) -> None:
    if settings.mqtt.url is not None and not re.match(
        r"^(mqtt|mqtts|tcp|ssl|tls)://[^/:]+(:\d+)?/?$", settings.mqtt.url
    ):
        raise ConfigError(f"mqtt.url: expected mqtt://host:port or mqtts://host:port, got {settings.mqtt.url!r}")
    if settings.mqtt.qos not in (0, 1, 2):
        raise ConfigError(f"mqtt.qos: must be 0, 1 or 2, got {settings.mqtt.qos}")
    if settings.mqtt.eventbus not in ("auto", "true", "false", "on", "off", "yes", "no", "1", "0"):
        raise ConfigError(f"mqtt.eventbus: must be auto, true or false, got {settings.mqtt.eventbus!r}")
    if settings.log_format not in ("text", "json"):
        raise ConfigError(f"log.format: must be text or json, got {settings.log_format!r}")
    if settings.telemetry_format not in ("binary", "json"):
        raise ConfigError(f"telemetry.format: must be binary or json, got {settings.telemetry_format!r}")
    if not re.match(r"^[^:]*:\d+$", settings.metrics_addr):
        raise ConfigError(f"metricsAddr: expected HOST:PORT (e.g. 0.0.0.0:9410), got {settings.metrics_addr!r}")
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", settings.node_name):
        raise ConfigError(f"nodeName: {settings.node_name!r} is not a valid Kubernetes node name")
    if settings.telemetry_window_s <= 0:
        raise ConfigError("telemetry.window: must be positive")
    if settings.collect_cycle_ms <= 0 or settings.report_cycle_ms <= 0 or settings.state_report_cycle_ms <= 0:
        raise ConfigError("defaults: cycles must be positive milliseconds")
    if settings.dmi_rate_per_s <= 0 or settings.dmi_rate_per_s > 1.0:
        raise ConfigError(f"dmi.ratePerSecond: must be in (0, 1] (EdgeCore allows 1/s), got {settings.dmi_rate_per_s}")
    if settings.inbound_rate_per_s <= 0 or settings.inbound_burst < 1:
        raise ConfigError(
            "mqtt.inboundRatePerSecond must be > 0 and mqtt.inboundBurst >= 1, got "
            f"{settings.inbound_rate_per_s} and {settings.inbound_burst}"
        )
    if not 1024 <= settings.inbound_max_bytes <= 16 * 1024**2:
        raise ConfigError(f"mqtt.inboundMaxBytes: must be 1KiB..16MiB, got {settings.inbound_max_bytes}")
    if not 64 * 1024 <= settings.dmi_max_message_bytes <= 256 * 1024**2:
        raise ConfigError(f"dmi.maxMessageBytes: must be 64KiB..256MiB, got {settings.dmi_max_message_bytes}")
    if settings.buffer_memory_max_bytes < 0 or settings.buffer_reserve_bytes < 0:
        raise ConfigError("buffer.memoryMaxBytes and buffer.reserveBytes: must not be negative")
    if settings.sim < 0 or settings.sim > 64:
        raise ConfigError(f"sim.count: must be 0..64, got {settings.sim}")
    if settings.sim_cost not in SIM_COST_PROFILES:
        raise ConfigError(f"sim.cost: must be one of {', '.join(SIM_COST_PROFILES)}, got {settings.sim_cost!r}")
    if settings.backend not in ("auto", "nvml", "jetson"):
        raise ConfigError(f"backend: must be auto, nvml or jetson, got {settings.backend!r}")
    if not settings.jetson_nvpmodel.split():
        raise ConfigError("jetson.nvpmodel: the command is empty")
    if settings.process_interval_s != 0 and not 0.1 <= settings.process_interval_s <= 3600:
        raise ConfigError(f"processes.interval: must be 0 (off) or 100ms..1h, got {settings.process_interval_s} s")
    if not 1 <= settings.process_top_n <= 100:
        raise ConfigError(f"processes.topN: must be 1..100, got {settings.process_top_n}")
    if not 1 <= settings.process_max_workloads <= 1000:
        raise ConfigError(f"processes.maxWorkloads: must be 1..1000, got {settings.process_max_workloads}")
    if settings.push_mqtt_format not in ("batch", "text"):
        raise ConfigError(f"push.mqttFormat: must be batch or text, got {settings.push_mqtt_format!r}")
    if not 0.1 <= settings.push_timeout_s <= 600:
        raise ConfigError(f"push.timeout: must be 100ms..10m, got {settings.push_timeout_s} s")
    if not settings.push_replay_rate_per_s > 0:
        raise ConfigError(f"push.replayRate: must be more than 0 samples/s, got {settings.push_replay_rate_per_s}")
    if not 1 <= settings.push_retry_max_s <= 3600:
        raise ConfigError(f"push.retryMax: must be 1s..1h, got {settings.push_retry_max_s} s")
    if settings.leak_window_s <= 0 or settings.leak_threshold_bytes <= 0:
        raise ConfigError(
            "processes.leak: window and threshold must be positive, got "
            f"{settings.leak_window_s} s and {settings.leak_threshold_bytes} bytes"
        )


def split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host or "0.0.0.0", int(port)
