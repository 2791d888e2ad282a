"""The config file both processes read, and the parsers both settings loaders use (pure but for reading files).

``gpu-mapper run`` (``mapper.edge.config``) and ``gpu-mapper bridge`` (``mapper.bridge.config``) read one YAML
file (a ConfigMap's ``config.yaml``, or the ConfigMap manifest itself): the mapper its top-level sections, the
bridge its ``bridge:`` section. Each setting has a file key path, a kind and an environment variable, and is
overridden by the variable, which is overridden by its flag (``layered_values``). Every error names the key
path, the variable or the flag. Secrets can come from files (``read_secret_file``).

``MqttSettings`` are the broker settings both processes have (``mqtt.*`` keys, ``MQTT_KEYS``), read by
``take_mqtt_settings`` and turned into a session by ``mapper.net.mqtt``.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mapper.errors import ConfigError

#: The top-level keys of the config file: the mapper's sections, its ``policies`` and the bridge's ``bridge``.
#: A file with any other is refused, by both processes (``mapper.edge.config`` checks that these are its keys').
CONFIG_SECTIONS = frozenset(
    {
        "backend",
        "bridge",
        "buffer",
        "console",
        "dataDir",
        "defaults",
        "devicesDir",
        "dmi",
        "edgecoreSocket",
        "jetson",
        "log",
        "metricsAddr",
        "mqtt",
        "nodeName",
        "policies",
        "processes",
        "push",
        "reconcile",
        "sim",
        "socket",
        "telemetry",
        "webConfigFile",
    }
)

#: The environment variables of the two processes: ``GPU_MAPPER_<SETTING>`` and ``GPU_MAPPER_BRIDGE_<SETTING>``.
MAPPER_ENV_PREFIX = "GPU_MAPPER_"
BRIDGE_ENV_PREFIX = "GPU_MAPPER_BRIDGE_"


def env_variable(prefix: str, name: str) -> str:
    """The environment variable of setting ``name`` (``mqtt_url`` -> ``GPU_MAPPER_MQTT_URL``)."""
    return prefix + name.upper()


# --------------------------------------------------------------------------------------------------
# Values
# --------------------------------------------------------------------------------------------------

_BARE_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|KiB|MB|MiB|GB|GiB)?\s*$", re.IGNORECASE)
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}
_SIZE_UNITS = {
    "b": 1,
    "kb": 1000,
    "kib": 1024,
    "mb": 1000**2,
    "mib": 1024**2,
    "gb": 1000**3,
    "gib": 1024**3,
    None: 1,
}
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|d|h|m|s)")
_DURATION_HINT = "a duration with a unit such as 30s, 5m, 1h, 1m30s or 250ms"


def parse_duration_s(value: Any, path: str, *, bare_seconds: bool = True) -> float:
    """``"30s"`` / ``"5m"`` / ``"1m30s"`` / ``"250ms"`` / ``"2d"`` -> seconds; a bare number means seconds
    unless ``bare_seconds`` is False (the policies insist on a unit). Errors name ``path``."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ConfigError(f"{path}: expected {_DURATION_HINT}, got {value!r}")
    text = str(value).strip()
    if isinstance(value, int | float) or _BARE_NUMBER_RE.fullmatch(text):
        if not bare_seconds:
            raise ConfigError(f"{path}: expected {_DURATION_HINT}, got {value!r}")
        seconds = float(value)
    else:
        pos, seconds = 0, 0.0
        for m in _DURATION_PART.finditer(text):
            if m.start() != pos:
                break
            seconds += float(m.group(1)) * _DURATION_UNITS[m.group(2)]
            pos = m.end()
        if pos == 0 or pos != len(text):
            raise ConfigError(f"{path}: expected {_DURATION_HINT}, got {value!r}")
    if seconds < 0 or not math.isfinite(seconds):
        raise ConfigError(f"{path}: must be a finite duration, not negative, got {value!r}")
    return seconds


def parse_size_bytes(value: Any, path: str) -> int:
    """``1048576`` / ``"256MiB"`` / ``"1GB"`` -> bytes."""
    if isinstance(value, bool):
        raise ConfigError(f"{path}: expected a size such as 256MiB, got {value!r}")
    if isinstance(value, int | float):
        size = float(value)
    else:
        match = _SIZE_RE.match(str(value))
        if not match:
            raise ConfigError(f"{path}: expected a size such as 256MiB or 1GB, got {value!r}")
        unit = match.group(2).lower() if match.group(2) else None
        size = float(match.group(1)) * _SIZE_UNITS[unit]
    if size < 0 or not math.isfinite(size):
        raise ConfigError(f"{path}: must be a finite size, not negative, got {value!r}")
    return int(size)


def convert(kind: str, value: Any, path: str) -> Any:
    """A raw value (from the file, a variable or a flag) as a setting of ``kind``: ``str``, ``int``, ``float``
    (finite, not negative), ``bool``, ``duration`` (seconds), ``ms`` (integer milliseconds: a number as it is, a
    text as a duration) or ``size`` (bytes). None stays None; errors name ``path``."""
    if value is None:
        return None
    if kind == "str":
        if isinstance(value, dict | list):
            raise ConfigError(f"{path}: expected a string, got {type(value).__name__}")
        return str(value)
    if kind in ("int", "float"):
        if isinstance(value, bool):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{path}: expected a number, got {value!r}") from None
        if number < 0 or not math.isfinite(number):
            raise ConfigError(f"{path}: must be a finite number, not negative, got {value!r}")
        return int(number) if kind == "int" else number
    if kind == "bool":
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("true", "1", "yes", "on"):
            return True
        if text in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{path}: expected true or false, got {value!r}")
    if kind == "duration":
        return parse_duration_s(value, path)
    if kind == "ms":
        return round(parse_duration_s(value, path) * 1000) if isinstance(value, str) else convert("int", value, path)
    if kind == "size":
        return parse_size_bytes(value, path)
    raise AssertionError(kind)


def lookup(mapping: Mapping[str, Any], dotted: str) -> Any:
    """The value at key path ``a.b.c`` of nested mappings, or None where any part is missing."""
    node: Any = mapping
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def layered_values(
    keys: Mapping[str, tuple[str, str]],
    section: Mapping[str, Any],
    env: Mapping[str, str],
    env_names: Mapping[str, str],
    flags: Mapping[str, Any],
    *,
    key_prefix: str = "",
) -> dict[str, Any]:
    """The settings of ``keys`` (setting name -> (key path in ``section``, kind)) that are given anywhere: from
    the file's ``section``, overridden by a non-empty variable (``env_names``), overridden by a flag that is not
    None. Each is converted by its kind; an error names the key path (after ``key_prefix``: what the section is
    called in the file), the variable or the flag (``--mqtt-url``)."""
    values: dict[str, Any] = {}
    for name, (key_path, kind) in keys.items():
        raw = lookup(section, key_path)
        if raw is not None:
            values[name] = convert(kind, raw, key_prefix + key_path)
        env_name = env_names[name]
        if env.get(env_name, "") != "":
            values[name] = convert(kind, env[env_name], env_name)
        if flags.get(name) is not None:
            values[name] = convert(kind, flags[name], "--" + name.replace("_", "-"))
    return values


# --------------------------------------------------------------------------------------------------
# Keys
# --------------------------------------------------------------------------------------------------

#: The keys a mapping may have: key -> the keys of the mapping under it, or None for a leaf (a value of any
#: shape, checked by whoever reads it: a converter, ``policies``' parser, the bridge's own check).
KeyTree = Mapping[str, "KeyTree | None"]


def key_tree(paths: Iterable[str]) -> dict[str, Any]:
    """The ``KeyTree`` of dotted key paths (``["mqtt.url", "mqtt.qos", "nodeName"]``), in their order."""
    tree: dict[str, Any] = {}
    for path in paths:
        *parents, leaf = path.split(".")
        node = tree
        for part in parents:
            child = node.setdefault(part, {})
            if child is None:
                raise AssertionError(f"{path}: {part} is a leaf and a section")
            node = child
        if isinstance(node.get(leaf), dict):
            raise AssertionError(f"{path}: a section and a leaf")
        node[leaf] = None
    return tree


def unknown_keys(node: Mapping[Any, Any], allowed: KeyTree, prefix: str = "") -> list[str]:
    """What is wrong with the keys of ``node`` (nested mappings) against ``allowed``, one line per fault, each
    naming its key path (``prefix`` + ``mqtt.urll``): a key not allowed (with the closest allowed key, where one
    is close: ``mqtt.urll: unknown key; did you mean url?``), or a section given as something other than a
    mapping. Empty when all is well. A section given as null is empty."""
    faults: list[str] = []
    for key, value in node.items():
        path = f"{prefix}{key}"
        if not isinstance(key, str) or key not in allowed:
            faults.append(f"{path}: unknown key{_suggestion(key, allowed)}")
            continue
        below = allowed[key]
        if below is None or value is None:
            continue
        if not isinstance(value, Mapping):
            keys = ", ".join(below)
            faults.append(f"{path}: expected a mapping (with keys {keys}), got {type(value).__name__} {value!r}")
            continue
        faults.extend(unknown_keys(value, below, path + "."))
    return faults


def refuse_unknown_keys(node: Mapping[Any, Any], allowed: KeyTree, prefix: str = "", *, where: str = "") -> None:
    """Raise a ``ConfigError`` listing every fault ``unknown_keys`` finds (each line after ``where``, such as
    ``config file c.yaml: ``). The one check of keys every settings loader and the policies' parser use."""
    faults = unknown_keys(node, allowed, prefix)
    if faults:
        raise ConfigError(where + "; ".join(faults))


def _suggestion(key: Any, allowed: Iterable[str]) -> str:
    """``; did you mean url?`` where an allowed key is close to ``key`` (case aside), else the allowed keys."""
    choices = list(allowed)
    by_lower = {choice.lower(): choice for choice in choices}
    close = difflib.get_close_matches(str(key).lower(), list(by_lower), n=1, cutoff=0.6)
    if close:
        return f"; did you mean {by_lower[close[0]]}?"
    return f" (expected one of {', '.join(choices)})"


# --------------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------------


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The config file as a mapping: YAML, or a ConfigMap manifest whose ``data.config.yaml`` holds it. A
    top-level key outside ``CONFIG_SECTIONS`` is refused (a misspelt section would otherwise be ignored); the
    keys inside each section are checked by the process that reads it (``refuse_unknown_keys``)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"config file {path}: cannot read it: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path}: not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: the top level must be a mapping, got {type(data).__name__}")
    # A ConfigMap manifest holds the config as text under data["config.yaml"].
    if data.get("kind") == "ConfigMap" and isinstance(data.get("data"), dict):
        inner = data["data"].get("config.yaml")
        if inner is None:
            raise ConfigError(f"config file {path}: ConfigMap has no data.config.yaml")
        if not isinstance(inner, str):
            raise ConfigError(f"config file {path}: ConfigMap data.config.yaml must be text")
        try:
            data = yaml.safe_load(inner) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path}: data.config.yaml is not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path}: data.config.yaml must be a mapping, got {type(data).__name__}")
    refuse_unknown_keys(data, key_tree(sorted(CONFIG_SECTIONS)), where=f"config file {path}: ")
    return data


def read_secret_file(path: str, key: str) -> str:
    """A secret from a file (a Kubernetes Secret mounted as a volume): its text without the trailing newline.
    The error names the key and the path, never the content."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{key}: cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{key}: {path} is not UTF-8 text") from None
    secret = text.rstrip("\r\n")
    if secret == "":
        raise ConfigError(f"{key}: {path} is empty")
    return secret


def key_password_from_file(values: dict[str, Any], key_prefix: str = "") -> str | None:
    """Take ``mqtt_key_password_file`` out of ``values``: the passphrase that file holds, None where it is not
    set; a ConfigError where ``values`` has no ``mqtt_key_file`` for it to unlock. ``key_prefix``: what the keys
    are named below in errors (``bridge.`` for the bridge's)."""
    path = values.pop("mqtt_key_password_file", None)
    if path is None:
        return None
    key = f"{key_prefix}mqtt.keyPasswordFile"
    if values.get("mqtt_key_file") is None:
        raise ConfigError(f"{key}: set, but there is no {key_prefix}mqtt.keyFile for it to unlock")
    return read_secret_file(path, key)


# --------------------------------------------------------------------------------------------------
# The broker
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MqttSettings:
    #: ``mqtt://host:port`` or ``mqtts://host:port``; None = no broker (the mapper buffers its telemetry only).
    url: str | None = None
    username: str | None = None
    #: Never shown by repr (a settings object in a log line or a traceback must not carry it).
    password: str | None = field(default=None, repr=False)
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    #: The passphrase of an encrypted ``key_file``, read from ``mqtt.keyPasswordFile`` (never a plain value).
    key_password: str | None = field(default=None, repr=False)
    client_id: str = ""
    #: The mapper's: publish KubeEdge EventBus twin/state updates. "auto": only when DMI is off (standalone
    #: mode). The bridge has no such key (it keeps the default).
    eventbus: str = "auto"
    #: The mapper's: the QoS of what it publishes (the bridge has no such key; it subscribes with QoS 1).
    qos: int = 1


#: The broker keys both sections have: setting name -> (key path, kind). The mapper's section adds
#: ``mqtt.eventbus`` and ``mqtt.qos``, the bridge's its session's expiry, receive maximum and reconnect backoff.
MQTT_KEYS: dict[str, tuple[str, str]] = {
    "mqtt_url": ("mqtt.url", "str"),
    "mqtt_username": ("mqtt.username", "str"),
    "mqtt_password": ("mqtt.password", "str"),
    "mqtt_password_file": ("mqtt.passwordFile", "str"),
    "mqtt_ca_file": ("mqtt.caFile", "str"),
    "mqtt_cert_file": ("mqtt.certFile", "str"),
    "mqtt_key_file": ("mqtt.keyFile", "str"),
    "mqtt_key_password_file": ("mqtt.keyPasswordFile", "str"),
    "mqtt_client_id": ("mqtt.clientId", "str"),
}


def take_mqtt_settings(
    values: dict[str, Any], *, key_prefix: str = "", password_file_may_be_missing: bool = False
) -> MqttSettings:
    """Take the ``MQTT_KEYS`` settings out of ``values`` (``layered_values``): the password and the key's
    passphrase read from their files. ``password_file_may_be_missing`` (the mapper's): without a user name,
    MQTT sends no password, so a password file that is not there (an optional Secret not created) means no
    credentials at all; with a user name it must be there."""
    password = values.pop("mqtt_password", None)
    password_file = values.pop("mqtt_password_file", None)
    if password_file is not None:
        if password is not None:
            raise ConfigError(
                f"{key_prefix}mqtt.password and {key_prefix}mqtt.passwordFile are both set (file, environment "
                "or flags): keep one"
            )
        if not password_file_may_be_missing or values.get("mqtt_username") is not None or Path(password_file).exists():
            password = read_secret_file(password_file, f"{key_prefix}mqtt.passwordFile")
    key_password = key_password_from_file(values, key_prefix)
    return MqttSettings(
        url=values.pop("mqtt_url", None),
        username=values.pop("mqtt_username", None),
        password=password,
        ca_file=values.pop("mqtt_ca_file", None),
        cert_file=values.pop("mqtt_cert_file", None),
        key_file=values.pop("mqtt_key_file", None),
        key_password=key_password,
        client_id=values.pop("mqtt_client_id", None) or "",
    )
