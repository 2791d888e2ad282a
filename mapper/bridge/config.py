"""``gpu-mapper bridge`` settings (pure): the ``bridge:`` section of the YAML config file (a ConfigMap's
``config.yaml`` too), overridden by ``GPU_MAPPER_BRIDGE_*`` environment variables, overridden by flags.

Every key is listed in ``BRIDGE_KEYS`` (flag/env name -> file key path under ``bridge.`` and kind); errors name
the key path, the variable or the flag.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from mapper.errors import ConfigError
from mapper.shared.settings import (
    BRIDGE_ENV_PREFIX,
    MQTT_KEYS,
    MqttSettings,
    env_variable,
    key_tree,
    layered_values,
    read_config_file,
    read_secret_file,
    refuse_unknown_keys,
    take_mqtt_settings,
)
from mapper.wire import topics


@dataclass(frozen=True)
class BridgeSettings:
    #: The cloud-side broker (``mqtt.url``: mqtt:// or mqtts://), its credentials and TLS files. Secrets are
    #: never shown by repr; each can come from a file (``...passwordFile``, ``mqtt.keyPasswordFile``).
    #: ``mqtt.client_id``: the broker keeps the session (and its share of the stream) under it; empty (the
    #: default): ``<group>-<hostname>``, or ``<group>-<hostname>-<n>`` where another process of this host holds
    #: that (``mapper.net.mqtt.ClientIdClaim``). (``eventbus`` and ``qos`` are the mapper's: the bridge has no such
    #: keys.)
    mqtt: MqttSettings = field(default_factory=MqttSettings)
    mqtt_session_expiry_s: float = 3600.0
    mqtt_receive_maximum: int = 1000
    mqtt_reconnect_max_s: float = 30.0
    topic: str = topics.TELEMETRY_FILTER
    #: Retained state messages (they carry the GPU uuid); "" derives it from ``topic`` (".../state").
    state_topic: str = ""
    #: The node streams (the mappers' own series); "" derives it from ``topic`` (``gpu-mapper/+/metrics``).
    node_topic: str = ""
    group: str = "gpu-mapper-bridge"
    remote_write: str | None = None
    remote_write_version: int = 1
    remote_write_username: str | None = None
    remote_write_password: str | None = field(default=None, repr=False)
    remote_write_bearer_token_file: str | None = None
    remote_write_ca_file: str | None = None
    remote_write_timeout_s: float = 30.0
    batch_max_samples: int = 10_000
    batch_max_delay_s: float = 1.0
    retry_min_s: float = 0.5
    retry_max_s: float = 30.0
    uuid_wait_s: float = 5.0
    dedup_max_streams: int = 100_000
    #: A batch more than this many sequence numbers past the highest seen of its stream counts as a gap.
    dedup_gap_tolerance: int = 64
    metrics_addr: str = "0.0.0.0:9411"
    spool_dir: str = "/var/lib/gpu-mapper-bridge/spool"
    log_format: str = "text"
    log_level: str = "INFO"
    config_file: str | None = None

    @property
    def shared_filter(self) -> str:
        """The shared subscription: ``$share/<group>/<topic>``."""
        return topics.shared_subscription(self.group, self.topic)

    @property
    def state_filter(self) -> str:
        """``state_topic``, else the state messages beside ``topic``'s telemetry ("" when it names none)."""
        return self.state_topic or topics.state_filter_beside(self.topic)

    @property
    def node_filter(self) -> str:
        """``node_topic``, else the node streams beside ``topic``'s telemetry ("" when it names none)."""
        return self.node_topic or topics.node_filter_beside(self.topic)


#: flag/env name -> (file key path under ``bridge.``, kind)
BRIDGE_KEYS: dict[str, tuple[str, str]] = {
    **MQTT_KEYS,
    "mqtt_session_expiry_s": ("mqtt.sessionExpiry", "duration"),
    "mqtt_receive_maximum": ("mqtt.receiveMaximum", "int"),
    "mqtt_reconnect_max_s": ("mqtt.reconnectMaxBackoff", "duration"),
    "topic": ("topic", "str"),
    "state_topic": ("stateTopic", "str"),
    "node_topic": ("nodeTopic", "str"),
    "group": ("group", "str"),
    "remote_write": ("remoteWrite.url", "str"),
    "remote_write_version": ("remoteWrite.version", "int"),
    "remote_write_username": ("remoteWrite.username", "str"),
    "remote_write_password": ("remoteWrite.password", "str"),
    "remote_write_password_file": ("remoteWrite.passwordFile", "str"),
    "remote_write_bearer_token_file": ("remoteWrite.bearerTokenFile", "str"),
    "remote_write_ca_file": ("remoteWrite.caFile", "str"),
    "remote_write_timeout_s": ("remoteWrite.timeout", "duration"),
    "batch_max_samples": ("batch.maxSamples", "int"),
    "batch_max_delay_s": ("batch.maxDelay", "duration"),
    "retry_min_s": ("retry.minBackoff", "duration"),
    "retry_max_s": ("retry.maxBackoff", "duration"),
    "uuid_wait_s": ("uuidWait", "duration"),
    "dedup_max_streams": ("dedup.maxStreams", "int"),
    "dedup_gap_tolerance": ("dedup.gapTolerance", "int"),
    "metrics_addr": ("metricsAddr", "str"),
    "spool_dir": ("spoolDir", "str"),
    "log_format": ("log.format", "str"),
    "log_level": ("log.level", "str"),
}

#: The keys of the ``bridge:`` section: any other, at any depth, is refused naming its path.
BRIDGE_KEY_TREE = key_tree(path for path, _ in BRIDGE_KEYS.values())

#: Environment variables read (each overrides the file and is overridden by its flag).
BRIDGE_ENV_KEYS: dict[str, str] = {name: env_variable(BRIDGE_ENV_PREFIX, name) for name in BRIDGE_KEYS}
CONFIG_ENV = "GPU_MAPPER_BRIDGE_CONFIG"

#: Secrets that may be given as values, by flag name -> the name of the flag that reads the same from a file.
#: On the command line a value is visible to every local user in the process list: ``gpu-mapper bridge`` warns.
BRIDGE_SECRET_FLAGS: dict[str, str] = {
    "mqtt_password": "mqtt_password_file",
    "remote_write_password": "remote_write_password_file",
}


def _remote_write_password_from_file(values: dict[str, Any]) -> None:
    """Replace ``remote_write_password_file`` of ``values`` by the secret it holds (in place). (The broker's
    secrets are read by ``take_mqtt_settings``.)"""
    name, file_name = "remote_write_password", BRIDGE_SECRET_FLAGS["remote_write_password"]
    path = values.pop(file_name, None)
    if path is None:
        return
    key = "bridge." + BRIDGE_KEYS[file_name][0]
    if values.get(name) is not None:
        both = f"bridge.{BRIDGE_KEYS[name][0]} and {key}"
        raise ConfigError(f"{both} are both set (file, environment or flags): keep one")
    values[name] = read_secret_file(path, key)


def load_bridge_settings(
    file_path: str | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> BridgeSettings:
    """Flags (non-None) override the environment, which overrides the file's ``bridge:`` section."""
    env = os.environ if env is None else env
    flags = flags or {}
    if file_path is None:
        file_path = flags.get("config") or env.get(CONFIG_ENV)
    section: Mapping[str, Any] = {}
    if file_path:
        data = read_config_file(file_path)
        raw = data.get("bridge") or {}
        if not isinstance(raw, Mapping):
            raise ConfigError(f"config file {file_path}: bridge: must be a mapping")
        section = raw
        refuse_unknown_keys(section, BRIDGE_KEY_TREE, "bridge.", where=f"config file {file_path}: ")
    values = layered_values(BRIDGE_KEYS, section, env, BRIDGE_ENV_KEYS, flags, key_prefix="bridge.")
    mqtt = take_mqtt_settings(values, key_prefix="bridge.")
    _remote_write_password_from_file(values)
    known = {f.name for f in fields(BridgeSettings)}
    settings = replace(
        BridgeSettings(), mqtt=mqtt, config_file=file_path, **{k: v for k, v in values.items() if k in known}
    )
    validate_bridge(settings)
    return settings


def validate_bridge(s: BridgeSettings) -> None:
    """Raise ``ConfigError`` naming the first bad setting."""
    if not s.mqtt.url:
        raise ConfigError("bridge.mqtt.url (--mqtt, GPU_MAPPER_BRIDGE_MQTT_URL): a broker is required")
    if not re.match(r"^(mqtt|mqtts|tcp|ssl)://[^/:]+(:\d+)?/?$", s.mqtt.url):
        raise ConfigError(f"bridge.mqtt.url: expected mqtt://host:port or mqtts://host:port, got {s.mqtt.url!r}")
    if not s.remote_write:
        raise ConfigError("bridge.remoteWrite.url (--remote-write, GPU_MAPPER_BRIDGE_REMOTE_WRITE): required")
    if not re.match(r"^https?://[^/]+(/.*)?$", s.remote_write):
        raise ConfigError(f"bridge.remoteWrite.url: expected http(s)://host[:port]/path, got {s.remote_write!r}")
    if s.remote_write_version not in (1, 2):
        raise ConfigError(f"bridge.remoteWrite.version: must be 1 or 2, got {s.remote_write_version}")
    if not s.topic or "#" in s.topic[:-1] or s.topic.startswith("$"):
        raise ConfigError(f"bridge.topic: not a usable topic filter: {s.topic!r}")
    if not re.fullmatch(r"[^/+#$]+", s.group):
        raise ConfigError(f"bridge.group: a share name without '/', '+', '#' or '$', got {s.group!r}")
    if not 1 <= s.mqtt_receive_maximum <= 65535:
        raise ConfigError(f"bridge.mqtt.receiveMaximum: must be 1..65535, got {s.mqtt_receive_maximum}")
    if s.mqtt_reconnect_max_s < 0.5:
        raise ConfigError(f"bridge.mqtt.reconnectMaxBackoff: must be at least 0.5 s, got {s.mqtt_reconnect_max_s}")
    if s.batch_max_samples < 1:
        raise ConfigError("bridge.batch.maxSamples: must be at least 1")
    if s.batch_max_delay_s <= 0 or s.remote_write_timeout_s <= 0:
        raise ConfigError("bridge.batch.maxDelay and bridge.remoteWrite.timeout: must be positive")
    if not 0 < s.retry_min_s <= s.retry_max_s:
        raise ConfigError(
            f"bridge.retry: need 0 < minBackoff <= maxBackoff, got {s.retry_min_s:g} s and {s.retry_max_s:g} s"
        )
    if s.dedup_max_streams < 1:
        raise ConfigError("bridge.dedup.maxStreams: must be at least 1")
    if s.dedup_gap_tolerance < 0:
        raise ConfigError(f"bridge.dedup.gapTolerance: must be 0 or more, got {s.dedup_gap_tolerance}")
    if s.log_format not in ("text", "json"):
        raise ConfigError(f"bridge.log.format: must be text or json, got {s.log_format!r}")
    if not re.match(r"^[^:]*:\d+$", s.metrics_addr) and not s.metrics_addr.startswith("["):
        raise ConfigError(f"bridge.metricsAddr: expected HOST:PORT, got {s.metrics_addr!r}")
    if s.remote_write_bearer_token_file and s.remote_write_username:
        raise ConfigError("bridge.remoteWrite: give basic auth (username/password) or a bearer token file, not both")
