"""Edge-autonomous local policies: thermal throttling, power saving and GPU health. Pure: no I/O.

Two halves:

* **Configuration**: ``parse_policies(mapping)`` turns the ``policies:`` section of the mapper's YAML config
  into frozen dataclasses; ``merge_override(config, text)`` lays a Device's ``policy`` configData (a JSON or
  YAML mapping held in a string) over it. Every error is a ``ConfigError`` whose message starts with the key
  path (``policies.thermalThrottling.releaseTemp: ...``).
* **Decisions**: ``decide(state, sample_values, ctx, config, now_s) -> (state, Decision)``. The state is a
  frozen value the caller keeps per GPU (by UUID) and hands back at the next sample; it survives a config
  swap. The decision carries the ``PolicyLimit``s for the reconciler (which applies
  ``min(cloud desired, limits)``: policies only ever tighten), one twin-safe ``policy_state`` string, the
  device state (``ok``/``unhealthy``/``offline``) and the events to publish, log and count.

``PolicyEngine`` wraps both for the composition root: it holds the node config, the per-device overrides
and one state per GPU.

Times are monotonic seconds (``Clock.monotonic()``), temperatures degrees Celsius, caps watts, utilisation
percent. Thermal thresholds compare strictly: throttling starts above ``maxTemp`` (``T > maxTemp``), the
cool-down runs below ``releaseTemp`` (``T < releaseTemp``).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypeVar

import yaml

from mapper.edge.health.checks import HEALTHY_REPORT, CheckResult, HealthReport, HealthStatus, ProbeResult, build_report
from mapper.edge.health.xid import DEFAULT_FATAL_XIDS, XidPolicy
from mapper.errors import ConfigError
from mapper.shared.model import TWIN_VALUE_RE, Constraints, GpuEvent, PolicyLimit, Value, format_number, twin_safe
from mapper.shared.settings import key_tree, parse_duration_s, refuse_unknown_keys

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_CRITICAL_XIDS",
    "Amount",
    "ChecksConfig",
    "Decision",
    "HealthConfig",
    "HealthState",
    "PolicyConfig",
    "PolicyContext",
    "PolicyEngine",
    "PolicyEvent",
    "PolicyState",
    "PowerSavingConfig",
    "PowerSavingState",
    "ProbeConfig",
    "RecoveryConfig",
    "ThermalConfig",
    "ThermalState",
    "decide",
    "format_duration",
    "merge_override",
    "parse_amount",
    "parse_duration",
    "parse_policies",
]

#: XIDs after which NVIDIA advises a GPU reset or a reboot: the XID catalog's fatal ones (``mapper.edge.health.xid``).
DEFAULT_CRITICAL_XIDS: frozenset[int] = DEFAULT_FATAL_XIDS

HealthAction = Literal["none", "min-power"]
HEALTH_ACTIONS: tuple[str, ...] = ("none", "min-power")

#: Policy names as they appear in PolicyLimit.policy, events and ``overridden-<policy>``.
THERMAL = "thermal"
POWER_SAVING = "power-saving"
HEALTH = "health"

# --------------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Amount:
    """A power amount: ``percent`` of a reference cap, absolute ``watts``, or the GPU's ``min`` limit."""

    kind: Literal["percent", "watts", "min", "mhz"]
    value: float = 0.0

    def text(self) -> str:
        """The config spelling: ``10%``, ``25W``, ``800MHz``, ``min``."""
        if self.kind == "min":
            return "min"
        unit = {"percent": "%", "watts": "W", "mhz": "MHz"}[self.kind]
        return f"{format_number(self.value)}{unit}"


#: What a policy acts through: the power cap, or the GPU (SM) clock's upper lock (``docs/policies.md``).
Actuator = Literal["power", "clocks"]
ACTUATORS: tuple[str, ...] = ("power", "clocks")


@dataclass(frozen=True)
class ThermalConfig:
    enabled: bool = True
    max_temp_c: float = 85.0
    release_temp_c: float = 80.0
    cool_down_s: float = 300.0
    #: One step down: a percent of the current effective cap, or watts.
    step: Amount = Amount("percent", 10.0)
    actuator: Actuator = "power"
    #: One step down with the clocks actuator: a percent of the current clock cap, or MHz.
    clock_step: Amount = Amount("percent", 10.0)
    #: Key on the GPU's own slowdown threshold (``temperature_slowdown``) instead: throttle above
    #: ``slowdown - max_margin_c``, cool down below ``slowdown - release_margin_c``. None: the absolute temps.
    max_margin_c: float | None = None
    release_margin_c: float | None = None


@dataclass(frozen=True)
class PowerSavingConfig:
    enabled: bool = False
    threshold_pct: float = 10.0
    idle_for_s: float = 120.0
    #: The idle cap: ``min`` (the GPU's minimum), watts, or a percent of the GPU's default limit.
    idle_power_limit: Amount = Amount("min")
    actuator: Actuator = "power"
    #: The idle clock cap with the clocks actuator: ``min`` (the lowest supported clock), MHz, or a percent of the
    #: GPU's maximum clock.
    idle_clock: Amount = Amount("min")


@dataclass(frozen=True)
class ProbeConfig:
    """Level 3: the CUDA probe (``docs/health.md``)."""

    enabled: bool = True
    interval_s: float = 600.0
    #: The probe process is killed after this long: ``timeout``.
    timeout_s: float = 30.0
    #: Not run while the GPU's utilisation is above this (percent): ``skipped:busy-<n>pct``.
    skip_above_pct: float = 50.0
    #: A pass slower than this is ``slow`` (degraded).
    slow_above_s: float = 5.0
    #: While the GPU is not healthy, probe this often (the way back by passing probes).
    retry_interval_s: float = 60.0


@dataclass(frozen=True)
class ChecksConfig:
    """Level 2: the driver checks."""

    enabled: bool = True
    interval_s: float = 60.0
    #: NVML must answer the checks' calls within this.
    nvml_deadline_s: float = 2.0
    #: Persistence is wanted on this node: ``nvidia-persistenced`` must run.
    persistence: bool = False


@dataclass(frozen=True)
class RecoveryConfig:
    """The recovery flow after a fatal fault (``mapper.recovery``)."""

    enabled: bool = True
    #: Reset the GPU (``nvidia-smi -r``) when the self-check fails and no process runs on it.
    allow_reset: bool = False
    #: Run ``nvidia-smi -q`` / ``dcgmi diag -r 1`` where present as part of the self-check.
    self_check_tools: bool = True


@dataclass(frozen=True)
class HealthConfig:
    enabled: bool = True
    #: The XIDs that make the GPU unhealthy (the fatal list; the catalog's fatal XIDs by default).
    critical_xids: frozenset[int] = DEFAULT_CRITICAL_XIDS
    #: XIDs counted and logged but never acted upon.
    ignore_xids: frozenset[int] = frozenset()
    ecc_uncorrected: bool = True
    #: ``none``: report only. ``min-power``: also cap the unhealthy GPU at its minimum power limit.
    action: HealthAction = "none"
    #: Passing probes in a row that bring a GPU back from a fault whose way back is ``probes``.
    recovery_probes: int = 3
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    checks: ChecksConfig = field(default_factory=ChecksConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)

    @property
    def xids(self) -> XidPolicy:
        return XidPolicy(ignore=self.ignore_xids, fatal=self.critical_xids)


@dataclass(frozen=True)
class PolicyConfig:
    dry_run: bool = False
    #: At most one policy cap change per GPU per interval (the first thermal step and a power-saving
    #: restore are exempt: they must act at once).
    min_change_interval_s: float = 30.0
    thermal: ThermalConfig = field(default_factory=ThermalConfig)
    power_saving: PowerSavingConfig = field(default_factory=PowerSavingConfig)
    health: HealthConfig = field(default_factory=HealthConfig)

    def to_mapping(self) -> dict[str, Any]:
        """The config in its YAML shape (``parse_policies(c.to_mapping()) == c``)."""
        t, p, h = self.thermal, self.power_saving, self.health
        return {
            "dryRun": self.dry_run,
            "minChangeInterval": format_duration(self.min_change_interval_s),
            "thermalThrottling": {
                "enabled": t.enabled,
                "maxTemp": t.max_temp_c,
                "releaseTemp": t.release_temp_c,
                "coolDownPeriod": format_duration(t.cool_down_s),
                "step": t.step.text(),
                "actuator": t.actuator,
                "clockStep": t.clock_step.text(),
                **({"maxTempMargin": t.max_margin_c} if t.max_margin_c is not None else {}),
                **({"releaseTempMargin": t.release_margin_c} if t.release_margin_c is not None else {}),
            },
            "powerSaving": {
                "enabled": p.enabled,
                "threshold": p.threshold_pct,
                "idleFor": format_duration(p.idle_for_s),
                "idlePowerLimit": p.idle_power_limit.text(),
                "actuator": p.actuator,
                "idleClock": p.idle_clock.text(),
            },
            "health": {
                "enabled": h.enabled,
                "criticalXids": sorted(h.critical_xids),
                "ignoreXids": sorted(h.ignore_xids),
                "eccUncorrected": h.ecc_uncorrected,
                "action": h.action,
                "recoveryProbes": h.recovery_probes,
                "probe": {
                    "enabled": h.probe.enabled,
                    "interval": format_duration(h.probe.interval_s),
                    "timeout": format_duration(h.probe.timeout_s),
                    "skipAboveUtilization": h.probe.skip_above_pct,
                    "slowAbove": format_duration(h.probe.slow_above_s),
                    "retryInterval": format_duration(h.probe.retry_interval_s),
                },
                "checks": {
                    "enabled": h.checks.enabled,
                    "interval": format_duration(h.checks.interval_s),
                    "nvmlDeadline": format_duration(h.checks.nvml_deadline_s),
                    "persistence": h.checks.persistence,
                },
                "recovery": {
                    "enabled": h.recovery.enabled,
                    "allowReset": h.recovery.allow_reset,
                    "selfCheckTools": h.recovery.self_check_tools,
                },
            },
        }


_AMOUNT_RE = re.compile(r"(\d+(?:\.\d+)?)\s*(%|w|W)")
_CLOCK_AMOUNT_RE = re.compile(r"(\d+(?:\.\d+)?)\s*(%|MHz|mhz)")


def parse_clock_amount(raw: object, path: str, *, allow_min: bool) -> Amount:
    """``10%`` -> percent, ``800MHz`` -> MHz, ``min`` (where allowed). A bare number is refused (% or MHz?)."""
    return _parse_amount(raw, path, allow_min, _CLOCK_AMOUNT_RE, "mhz", "MHz such as 800MHz", "MHz")


def _actuator(raw: Mapping[str, Any], path: str) -> Actuator:
    value = raw.get("actuator", "power")
    if value not in ACTUATORS:
        raise ConfigError(f"{path}.actuator: expected one of {', '.join(ACTUATORS)}, got {value!r}")
    return value


def parse_duration(raw: object, path: str) -> float:
    """``250ms``, ``30s``, ``5m``, ``1h``, ``1m30s`` -> seconds. A bare number is refused (which unit?)."""
    return parse_duration_s(raw, path, bare_seconds=False)


def format_duration(seconds: float) -> str:
    """Seconds -> the shortest config spelling (``300.0`` -> ``5m``, ``0.25`` -> ``250ms``)."""
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{int(seconds // 3600)}h"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{int(seconds // 60)}m"
    if seconds == int(seconds):
        return f"{int(seconds)}s"
    return f"{format_number(seconds * 1000)}ms"


def parse_amount(raw: object, path: str, *, allow_min: bool) -> Amount:
    """``10%`` -> percent, ``25W`` -> watts, ``min`` (where allowed). A bare number is refused (% or W?)."""
    return _parse_amount(raw, path, allow_min, _AMOUNT_RE, "watts", "watts such as 25W", "watts")


def _parse_amount(
    raw: object,
    path: str,
    allow_min: bool,
    pattern: re.Pattern[str],
    kind: Literal["watts", "mhz"],
    example: str,
    unit: str,
) -> Amount:
    """A percent, an absolute amount of ``kind`` (``pattern``'s second group not ``%``), or ``min``."""
    expected = f"a percent such as 10%, {example}" + (" or min" if allow_min else "")
    if isinstance(raw, bool) or not isinstance(raw, str):
        raise ConfigError(f"{path}: expected {expected}, got {raw!r}")
    text = raw.strip()
    if allow_min and text.lower() == "min":
        return Amount("min")
    m = pattern.fullmatch(text)
    if m is None:
        raise ConfigError(f"{path}: expected {expected}, got {raw!r}")
    value = float(m.group(1))
    if m.group(2) == "%":
        if not 0 < value < 100:
            raise ConfigError(f"{path}: a percent must lie between 0% and 100% (exclusive), got {raw!r}")
        return Amount("percent", value)
    if value <= 0:
        raise ConfigError(f"{path}: {unit} must be above 0, got {raw!r}")
    return Amount(kind, value)


def _section(raw: Mapping[str, Any], key: str, path: str) -> Mapping[str, Any] | None:
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ConfigError(f"{path}.{key}: expected a mapping, got {type(value).__name__}")
    return value


def _check_keys(raw: Mapping[str, Any], allowed: Iterable[str], path: str) -> None:
    """The keys of one section: the shared check (``mapper.shared.settings``), each key a leaf read here."""
    refuse_unknown_keys(raw, key_tree(allowed), path + ".")


def _bool(raw: Mapping[str, Any], key: str, path: str, default: bool) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{path}.{key}: expected true or false, got {value!r}")
    return value


def _number(raw: Mapping[str, Any], key: str, path: str, default: float, lo: float, hi: float, unit: str) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{path}.{key}: expected a number ({unit}), got {value!r}")
    number = float(value)
    if not math.isfinite(number) or not lo <= number <= hi:
        raise ConfigError(
            f"{path}.{key}: must lie between {format_number(lo)} and {format_number(hi)} {unit}, got {value!r}"
        )
    return number


def _duration(raw: Mapping[str, Any], key: str, path: str, default: float) -> float:
    if key not in raw:
        return default
    return parse_duration(raw[key], f"{path}.{key}")


def _parse_thermal(raw: Mapping[str, Any] | None, path: str) -> ThermalConfig:
    if raw is None:
        return ThermalConfig()
    keys = ("enabled", "maxTemp", "releaseTemp", "coolDownPeriod", "step", "actuator", "clockStep")
    _check_keys(raw, (*keys, "maxTempMargin", "releaseTempMargin"), path)
    d = ThermalConfig()
    max_temp = _number(raw, "maxTemp", path, d.max_temp_c, 1, 150, "celsius")
    release = _number(raw, "releaseTemp", path, d.release_temp_c, 0, 150, "celsius")
    if release >= max_temp:
        raise ConfigError(
            f"{path}.releaseTemp: must be below maxTemp ({format_number(max_temp)}), got {format_number(release)}"
        )
    step = parse_amount(raw["step"], f"{path}.step", allow_min=False) if "step" in raw else d.step
    clock_step = d.clock_step
    if "clockStep" in raw:
        clock_step = parse_clock_amount(raw["clockStep"], f"{path}.clockStep", allow_min=False)
    max_margin = release_margin = None
    if "maxTempMargin" in raw or "releaseTempMargin" in raw:
        max_margin = _number(raw, "maxTempMargin", path, 5.0, 0, 100, "celsius")
        release_margin = _number(raw, "releaseTempMargin", path, max_margin + 5.0, 0, 100, "celsius")
        if release_margin <= max_margin:
            raise ConfigError(
                f"{path}.releaseTempMargin: must be above maxTempMargin ({format_number(max_margin)}): the "
                f"release point lies further below the slowdown threshold, got {format_number(release_margin)}"
            )
    return ThermalConfig(
        enabled=_bool(raw, "enabled", path, True),
        max_temp_c=max_temp,
        release_temp_c=release,
        cool_down_s=_duration(raw, "coolDownPeriod", path, d.cool_down_s),
        step=step,
        actuator=_actuator(raw, path),
        clock_step=clock_step,
        max_margin_c=max_margin,
        release_margin_c=release_margin,
    )


def _parse_power_saving(raw: Mapping[str, Any] | None, path: str) -> PowerSavingConfig:
    if raw is None:
        return PowerSavingConfig()
    _check_keys(raw, ("enabled", "threshold", "idleFor", "idlePowerLimit", "actuator", "idleClock"), path)
    d = PowerSavingConfig()
    limit = d.idle_power_limit
    if "idlePowerLimit" in raw:
        limit = parse_amount(raw["idlePowerLimit"], f"{path}.idlePowerLimit", allow_min=True)
    idle_clock = d.idle_clock
    if "idleClock" in raw:
        idle_clock = parse_clock_amount(raw["idleClock"], f"{path}.idleClock", allow_min=True)
    return PowerSavingConfig(
        enabled=_bool(raw, "enabled", path, True),
        threshold_pct=_number(raw, "threshold", path, d.threshold_pct, 0, 100, "percent"),
        idle_for_s=_duration(raw, "idleFor", path, d.idle_for_s),
        idle_power_limit=limit,
        actuator=_actuator(raw, path),
        idle_clock=idle_clock,
    )


def _xid_list(raw: Mapping[str, Any], key: str, path: str, default: frozenset[int]) -> frozenset[int]:
    if key not in raw:
        return default
    items = raw[key]
    if isinstance(items, str) or not isinstance(items, Sequence):
        raise ConfigError(f"{path}.{key}: expected a list of XID numbers, got {items!r}")
    for i, x in enumerate(items):
        if isinstance(x, bool) or not isinstance(x, int) or x < 0:
            raise ConfigError(f"{path}.{key}[{i}]: expected a non-negative integer XID, got {x!r}")
    return frozenset(items)


def _parse_probe(raw: Mapping[str, Any] | None, path: str) -> ProbeConfig:
    if raw is None:
        return ProbeConfig()
    _check_keys(raw, ("enabled", "interval", "timeout", "skipAboveUtilization", "slowAbove", "retryInterval"), path)
    d = ProbeConfig()
    timeout = _duration(raw, "timeout", path, d.timeout_s)
    if timeout <= 0:
        raise ConfigError(f"{path}.timeout: must be above 0s, got {raw['timeout']!r}")
    interval = _duration(raw, "interval", path, d.interval_s)
    if interval < 1:
        raise ConfigError(f"{path}.interval: must be at least 1s, got {raw['interval']!r}")
    retry = _duration(raw, "retryInterval", path, d.retry_interval_s)
    if retry < 1:
        raise ConfigError(f"{path}.retryInterval: must be at least 1s, got {raw['retryInterval']!r}")
    return ProbeConfig(
        enabled=_bool(raw, "enabled", path, True),
        interval_s=interval,
        timeout_s=timeout,
        skip_above_pct=_number(raw, "skipAboveUtilization", path, d.skip_above_pct, 0, 100, "percent"),
        slow_above_s=_duration(raw, "slowAbove", path, d.slow_above_s),
        retry_interval_s=retry,
    )


def _parse_checks(raw: Mapping[str, Any] | None, path: str) -> ChecksConfig:
    if raw is None:
        return ChecksConfig()
    _check_keys(raw, ("enabled", "interval", "nvmlDeadline", "persistence"), path)
    d = ChecksConfig()
    interval = _duration(raw, "interval", path, d.interval_s)
    if interval < 1:
        raise ConfigError(f"{path}.interval: must be at least 1s, got {raw['interval']!r}")
    deadline = _duration(raw, "nvmlDeadline", path, d.nvml_deadline_s)
    if deadline <= 0:
        raise ConfigError(f"{path}.nvmlDeadline: must be above 0s, got {raw['nvmlDeadline']!r}")
    return ChecksConfig(
        enabled=_bool(raw, "enabled", path, True),
        interval_s=interval,
        nvml_deadline_s=deadline,
        persistence=_bool(raw, "persistence", path, d.persistence),
    )


def _parse_recovery(raw: Mapping[str, Any] | None, path: str) -> RecoveryConfig:
    if raw is None:
        return RecoveryConfig()
    _check_keys(raw, ("enabled", "allowReset", "selfCheckTools"), path)
    d = RecoveryConfig()
    return RecoveryConfig(
        enabled=_bool(raw, "enabled", path, True),
        allow_reset=_bool(raw, "allowReset", path, d.allow_reset),
        self_check_tools=_bool(raw, "selfCheckTools", path, d.self_check_tools),
    )


_HEALTH_KEYS = (
    "enabled",
    "criticalXids",
    "ignoreXids",
    "eccUncorrected",
    "action",
    "recoveryProbes",
    "probe",
    "checks",
    "recovery",
)


def _parse_health(raw: Mapping[str, Any] | None, path: str) -> HealthConfig:
    if raw is None:
        return HealthConfig()
    _check_keys(raw, _HEALTH_KEYS, path)
    d = HealthConfig()
    fatal = _xid_list(raw, "criticalXids", path, d.critical_xids)
    ignore = _xid_list(raw, "ignoreXids", path, d.ignore_xids)
    both = sorted(fatal & ignore)
    if both and "ignoreXids" in raw and "criticalXids" in raw:
        raise ConfigError(f"{path}.ignoreXids: {both} are also in criticalXids (an XID is ignored or fatal, not both)")
    action = raw.get("action", d.action)
    if action not in HEALTH_ACTIONS:
        raise ConfigError(f"{path}.action: expected one of {', '.join(HEALTH_ACTIONS)}, got {action!r}")
    probes = raw.get("recoveryProbes", d.recovery_probes)
    if isinstance(probes, bool) or not isinstance(probes, int) or not 1 <= probes <= 100:
        raise ConfigError(f"{path}.recoveryProbes: expected a whole number of probes from 1 to 100, got {probes!r}")
    return HealthConfig(
        enabled=_bool(raw, "enabled", path, True),
        critical_xids=fatal,
        ignore_xids=ignore,
        ecc_uncorrected=_bool(raw, "eccUncorrected", path, d.ecc_uncorrected),
        action=action,
        recovery_probes=probes,
        probe=_parse_probe(_section(raw, "probe", path), f"{path}.probe"),
        checks=_parse_checks(_section(raw, "checks", path), f"{path}.checks"),
        recovery=_parse_recovery(_section(raw, "recovery", path), f"{path}.recovery"),
    )


def parse_policies(mapping: Mapping[str, Any] | None, path: str = "policies") -> PolicyConfig:
    """The ``policies`` section (None or absent keys -> defaults) -> ``PolicyConfig``; ``ConfigError`` names the
    key path of the first problem."""
    if mapping is None:
        return PolicyConfig()
    if not isinstance(mapping, Mapping):
        raise ConfigError(f"{path}: expected a mapping, got {type(mapping).__name__}")
    _check_keys(mapping, ("dryRun", "minChangeInterval", "thermalThrottling", "powerSaving", "health"), path)
    d = PolicyConfig()
    return PolicyConfig(
        dry_run=_bool(mapping, "dryRun", path, d.dry_run),
        min_change_interval_s=_duration(mapping, "minChangeInterval", path, d.min_change_interval_s),
        thermal=_parse_thermal(_section(mapping, "thermalThrottling", path), f"{path}.thermalThrottling"),
        power_saving=_parse_power_saving(_section(mapping, "powerSaving", path), f"{path}.powerSaving"),
        health=_parse_health(_section(mapping, "health", path), f"{path}.health"),
    )


def _deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def merge_override(
    config: PolicyConfig, override: str | Mapping[str, Any] | None, path: str = "policy"
) -> PolicyConfig:
    """A per-device override (a Device's protocol configData ``policy``: a JSON or YAML mapping, as text or
    already parsed) merged key by key over the node ``config`` and validated like the node config.

    An empty override returns ``config`` unchanged. Errors name ``path`` (``policy.thermalThrottling.maxTemp``).
    """
    if override is None:
        return config
    if isinstance(override, str):
        if not override.strip():
            return config
        try:
            loaded = yaml.safe_load(override)
        except yaml.YAMLError as exc:
            first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ConfigError(f"{path}: not a JSON or YAML mapping ({first_line})") from None
        if loaded is None:
            return config
    else:
        loaded = override
    if not isinstance(loaded, Mapping):
        raise ConfigError(
            f'{path}: expected a mapping such as {{"thermalThrottling": {{"maxTemp": 80}}}}, got {loaded!r}'
        )
    # Check the override's own keys first so a typo is reported against the override, not the merge.
    _check_keys(loaded, ("dryRun", "minChangeInterval", "thermalThrottling", "powerSaving", "health"), path)
    for key, value in loaded.items():
        if (
            key in ("thermalThrottling", "powerSaving", "health")
            and value is not None
            and not isinstance(value, Mapping)
        ):
            raise ConfigError(f"{path}.{key}: expected a mapping, got {type(value).__name__}")
    overridden = {k: v for k, v in loaded.items() if v is not None}
    return parse_policies(_deep_merge(config.to_mapping(), overridden), path)


# --------------------------------------------------------------------------------------------------
# Decision state, context and results
# --------------------------------------------------------------------------------------------------

ThermalPhase = Literal["normal", "throttling", "holding", "cooldown", "releasing"]


@dataclass(frozen=True)
class ThermalState:
    """``throttling``: above maxTemp, stepping down. ``holding``: at or below maxTemp but not below releaseTemp,
    the cap held. ``cooldown``: below releaseTemp since ``below_since_s``. ``releasing``: the cool-down is done,
    stepping back up one step per interval."""

    phase: ThermalPhase = "normal"
    cap_w: float | None = None
    steps: int = 0
    below_since_s: float | None = None
    last_change_s: float | None = None
    #: The clock cap (MHz) when the clocks actuator acts (``cap_w`` is None then).
    cap_mhz: float | None = None


@dataclass(frozen=True)
class PowerSavingState:
    idle_since_s: float | None = None
    active: bool = False
    cap_w: float | None = None
    #: The idle clock cap (MHz) when the clocks actuator acts (``cap_w`` is None then).
    cap_mhz: float | None = None


@dataclass(frozen=True)
class HealthState:
    """Level 1 (``status``, ``cause``: XIDs, ECC, GPU lost), the level-2 checks and level 3 (the probe), and the
    way back from each fault (``docs/health.md``)."""

    status: Literal["ok", "unhealthy", "offline"] = "ok"
    #: Twin-safe cause: ``xid79``, ``ecc``, ``gpu-lost``.
    cause: str = ""
    last_xid: int = 0
    ecc_uncorrected: int | None = None
    #: How the level-1 fault clears: ``reset``, ``reboot`` or ``probes`` ("" while ok).
    recovery: str = ""
    #: The subsystem of the level-1 fault, or of ``degraded``.
    subsystem: str = ""
    #: A level-1 warning (an XID of severity warning): degraded until ``recovery_probes`` passing probes.
    degraded: str = ""
    #: Level 3: the probe's verdict and reason.
    probe_status: HealthStatus = "healthy"
    probe_cause: str = ""
    #: Passing probes in a row since the last fault.
    passes: int = 0
    #: A reset (driver reload) happened since the last probe failure: one passing probe clears it then.
    reset_seen: bool = False
    #: The latest level-2 checks.
    checks: tuple[CheckResult, ...] = ()
    last_probe: ProbeResult | None = None
    report: HealthReport = HEALTHY_REPORT


@dataclass(frozen=True)
class PolicyState:
    """Everything ``decide`` remembers about one GPU. Start with ``PolicyState()``."""

    thermal: ThermalState = field(default_factory=ThermalState)
    power_saving: PowerSavingState = field(default_factory=PowerSavingState)
    health: HealthState = field(default_factory=HealthState)
    #: The GPU's own power limit the last time no policy cap was in force (the ceiling when the cloud sets none).
    baseline_w: float | None = None
    #: When a policy last changed this GPU's cap (monotonic seconds).
    last_change_s: float | None = None
    #: The tightest cap the last decisions imposed, kept until the GPU's reading moves off it.
    applied_w: float | None = None
    #: The last decision emitted at least one PolicyLimit.
    capped: bool = False


@dataclass(frozen=True)
class PolicyContext:
    """What ``decide`` needs to know beyond the sample."""

    constraints: Constraints = field(default_factory=Constraints)
    #: The cloud's desired ``power_limit`` in watts; None when the Device sets none.
    desired_power_limit_w: float | None = None
    #: The GPU's requested power limit now (the ``power_limit`` property); None: taken from the sample.
    current_power_limit_w: float | None = None
    #: Events the backend reported for this GPU since the last decision (``poll_events``).
    events: tuple[GpuEvent, ...] = ()
    #: The backend raised GpuLostError for this GPU, or it is no longer enumerated (no sample).
    gpu_lost: bool = False
    uuid: str = ""
    #: The cloud's desired upper locked GPU clock (MHz); None when the Device sets none (the clocks actuator's
    #: ceiling, else the GPU's highest supported clock).
    desired_clock_max_mhz: float | None = None
    #: A level-3 probe that finished since the last decision.
    probe: ProbeResult | None = None
    #: Level-2 checks run since the last decision (all of them: they replace the previous set).
    checks: tuple[CheckResult, ...] | None = None


@dataclass(frozen=True)
class PolicyEvent:
    """One thing a policy did (or, in dry run, would have done): published on MQTT, logged, counted."""

    policy: str
    #: ``step-down``, ``step-up``, ``release``, ``engage``, ``restore``, ``unhealthy``, ``offline``,
    #: ``recovered``, ``xid``, ``disabled``.
    action: str
    reason: str
    uuid: str = ""
    ts_s: float = 0.0
    temperature_c: float | None = None
    utilization_pct: float | None = None
    old_cap_w: float | None = None
    new_cap_w: float | None = None
    dry_run: bool = False
    #: The clock caps (MHz) of a policy acting through the clocks actuator.
    old_clock_mhz: float | None = None
    new_clock_mhz: float | None = None

    @property
    def changes_cap(self) -> bool:
        power = self.old_cap_w != self.new_cap_w and (self.old_cap_w is not None or self.new_cap_w is not None)
        clock = self.old_clock_mhz != self.new_clock_mhz and (
            self.old_clock_mhz is not None or self.new_clock_mhz is not None
        )
        return power or clock

    def to_payload(self) -> dict[str, Any]:
        """A JSON-ready mapping for the MQTT event (None values omitted)."""
        payload: dict[str, Any] = {
            "policy": self.policy,
            "action": self.action,
            "reason": self.reason,
            "uuid": self.uuid,
            "dryRun": self.dry_run,
        }
        for key, value in (
            ("temperature", self.temperature_c),
            ("utilization", self.utilization_pct),
            ("oldPowerLimit", self.old_cap_w),
            ("newPowerLimit", self.new_cap_w),
            ("oldClockLimit", self.old_clock_mhz),
            ("newClockLimit", self.new_clock_mhz),
        ):
            if value is not None:
                payload[key] = value
        return payload


@dataclass(frozen=True)
class Decision:
    #: The limits for the reconciler: at most one per policy, each strictly below the ceiling. Empty in dry run.
    limits: tuple[PolicyLimit, ...] = ()
    #: One twin value: ``normal``, ``thermal:throttling-step2``, ``power-saving:active``,
    #: ``health:unhealthy-xid79``, comma-joined when several apply; prefixed ``dry-run:`` in dry run.
    policy_state: str = "normal"
    #: ``ok``, ``unhealthy`` or ``offline`` (mapper.shared.model.DEVICE_STATES).
    device_state: str = "ok"
    events: tuple[PolicyEvent, ...] = ()
    dry_run: bool = False
    #: The limit the GPU had before the policies acted, set on the decision where the last policy limit goes
    #: away: the reconciler restores it when the cloud has no desired power_limit of its own.
    restore_power_limit_w: float | None = None

    @property
    def power_limit_w(self) -> float | None:
        """The tightest policy cap, or None."""
        return min((lim.power_limit_w for lim in self.limits if lim.power_limit_w is not None), default=None)

    def limit_for(self, policy: str) -> PolicyLimit | None:
        return next((lim for lim in self.limits if lim.policy == policy), None)


# --------------------------------------------------------------------------------------------------
# Decisions
# --------------------------------------------------------------------------------------------------


def _num(values: Mapping[str, Value], name: str) -> float | None:
    v = values.get(name)
    # The common types first (exact types: bool is an int, float subclasses take the general path).
    if type(v) is float:
        return v if _isfinite(v) else None
    if type(v) is int:
        return float(v)
    if v is None or isinstance(v, bool | str):
        return None
    f = float(v)
    return f if _isfinite(f) else None


_isfinite = math.isfinite


def _ceiling(state: PolicyState, ctx: PolicyContext, current_w: float | None) -> float | None:
    """The cap the GPU would run at with no policy: the cloud's desired limit, else the pre-policy limit."""
    c = ctx.constraints
    ceiling = ctx.desired_power_limit_w
    if ceiling is None:
        ceiling = state.baseline_w if state.baseline_w is not None else current_w
    if ceiling is None:
        ceiling = c.power_limit_default_w if c.power_limit_default_w is not None else c.power_limit_max_w
    if ceiling is None:
        return None
    if c.power_limit_max_w is not None:
        ceiling = min(ceiling, c.power_limit_max_w)
    if c.power_limit_min_w is not None:
        ceiling = max(ceiling, c.power_limit_min_w)
    return ceiling


def _floor_w(ctx: PolicyContext) -> float:
    return ctx.constraints.power_limit_min_w if ctx.constraints.power_limit_min_w is not None else 0.0


def _step_down(cap_w: float, step: Amount, floor_w: float) -> float:
    new = cap_w * (1 - step.value / 100) if step.kind == "percent" else cap_w - step.value
    return max(floor_w, float(math.floor(new + 1e-9)))


def _step_up(cap_w: float, step: Amount) -> float:
    # The inverse of a step down, so a release retraces the caps of the throttle (700 -> 630 -> 567 -> 630 -> 700).
    new = cap_w / (1 - step.value / 100) if step.kind == "percent" else cap_w + step.value
    return float(math.ceil(new - 1e-9))


@dataclass
class _Run:
    """Scratch space for one decision."""

    config: PolicyConfig
    ctx: PolicyContext
    #: For the events: ``ctx.uuid``, or the engine's key when the context carries none.
    uuid: str
    now_s: float
    temperature_c: float | None
    utilization_pct: float | None
    events: list[PolicyEvent] = field(default_factory=list)
    changed: bool = False
    #: The thermal thresholds in force (the absolute ones, or keyed on the GPU's slowdown threshold).
    max_temp_c: float = 85.0
    release_temp_c: float = 80.0
    #: What the policy being decided acts through: the caps below are W (``power``) or MHz (``clocks``).
    clocks: bool = False
    floor: float = 0.0
    step: Amount = Amount("percent", 10.0)

    def event(self, policy: str, action: str, reason: str, old: float | None = None, new: float | None = None) -> None:
        self.events.append(
            PolicyEvent(
                policy=policy,
                action=action,
                reason=twin_safe(reason),
                uuid=self.uuid,
                ts_s=self.now_s,
                temperature_c=self.temperature_c,
                utilization_pct=self.utilization_pct,
                old_cap_w=None if self.clocks else old,
                new_cap_w=None if self.clocks else new,
                dry_run=self.config.dry_run,
                old_clock_mhz=old if self.clocks else None,
                new_clock_mhz=new if self.clocks else None,
            )
        )

    def interval_passed(self, last_change_s: float | None) -> bool:
        return last_change_s is None or self.now_s - last_change_s >= self.config.min_change_interval_s


def _thermal(st: ThermalState, run: _Run, ceiling: float | None, last_change_s: float | None) -> ThermalState:
    cfg = run.config.thermal
    if not cfg.enabled:
        if st.phase != "normal":
            run.event(THERMAL, "disabled", "policy-disabled", st.cap_w, None)
            run.changed = True
        return _THERMAL_NORMAL
    temp = run.temperature_c
    if temp is None or ceiling is None:
        return st
    if temp <= run.max_temp_c and st.phase == "normal":
        return st  # the usual case: cool, nothing to do
    floor = run.floor
    effective = min(ceiling, st.cap_w) if st.cap_w is not None else ceiling
    max_txt = format_number(run.max_temp_c)
    if temp > run.max_temp_c:
        st = replace(st, below_since_s=None)
        first = st.phase == "normal"
        if (first or run.interval_passed(last_change_s)) and effective > floor:
            new = _step_down(effective, run.step, floor)
            run.event(THERMAL, "step-down", f"temperature-{format_number(temp)}-above-{max_txt}", effective, new)
            run.changed = True
            return ThermalState("throttling", new, st.steps + 1, None, run.now_s)
        return replace(st, phase="throttling", cap_w=effective if first else st.cap_w, steps=max(st.steps, 1))
    if st.phase == "normal":
        return st
    if temp >= run.release_temp_c:
        return replace(st, phase="holding", below_since_s=None)
    below_since = st.below_since_s if st.below_since_s is not None else run.now_s
    st = replace(st, below_since_s=below_since, phase="cooldown" if st.phase != "releasing" else "releasing")
    if run.now_s - below_since < cfg.cool_down_s or not run.interval_passed(last_change_s):
        return st
    new = _step_up(effective, run.step)
    reason = f"below-{format_number(run.release_temp_c)}-for-{format_duration(cfg.cool_down_s)}"
    run.changed = True
    if new >= ceiling or st.steps <= 1:
        run.event(THERMAL, "release", reason, effective, None)
        return ThermalState(last_change_s=run.now_s)
    run.event(THERMAL, "step-up", reason, effective, new)
    return ThermalState("releasing", new, st.steps - 1, below_since, run.now_s)


def _thermal_thresholds(cfg: ThermalConfig, values: Mapping[str, Value]) -> tuple[float, float]:
    """(max, release) in °C: keyed on the GPU's own slowdown threshold where configured and known, else the
    absolute ``maxTemp`` / ``releaseTemp``."""
    if cfg.max_margin_c is not None and cfg.release_margin_c is not None:
        slowdown = _num(values, "temperature_slowdown")
        if slowdown is not None:
            return slowdown - cfg.max_margin_c, slowdown - cfg.release_margin_c
    return cfg.max_temp_c, cfg.release_temp_c


def _clock_steps(c: Constraints) -> tuple[float, ...]:
    """The clocks the clocks actuator can cap at (MHz, highest first): NVML's supported SM clocks where locked
    clocks can be set, else a Jetson's devfreq ``available_frequencies`` where ``max_freq`` can be set; () when
    the backend offers no clock actuator."""
    u = c.unsupported
    if c.graphics_clocks_mhz and "locked_gpu_clocks" not in u and "locked_gpu_clock_max" not in u:
        return tuple(float(f) for f in c.graphics_clocks_mhz)
    if c.gpu_freqs_mhz and "gpu_freq_range" not in u and "gpu_max_freq" not in u:
        return tuple(sorted(c.gpu_freqs_mhz, reverse=True))
    return ()


def _clocks_instead_of_power(c: Constraints) -> bool:
    """True where a ``power`` actuator acts through the clocks: the GPU has no power cap but a clock actuator (a
    Jetson: its devfreq maximum)."""
    return "power_limit" in c.unsupported and bool(_clock_steps(c))


def _clock_ceiling(ctx: PolicyContext) -> float | None:
    """The clocks actuator's ceiling (MHz): the cloud's desired upper clock (NVML's upper lock, a Jetson's
    ``gpu_max_freq``), else the GPU's highest clock (a Jetson: the power mode's maximum); None where the backend
    offers no clock actuator (no clocks known, or setting them is not supported): the policy then acts through
    the power cap."""
    c = ctx.constraints
    steps = _clock_steps(c)
    if not steps:
        return None
    top = steps[0]
    desired = ctx.desired_clock_max_mhz
    if c.graphics_clocks_mhz:
        return min(top, desired) if desired is not None and desired > 0 else top
    # A Jetson: the maximum in force is the desired one snapped down to a step (as the reconciler writes it), else
    # the power mode's (also while a desired value below the lowest step is rejected).
    if desired is None or desired < steps[-1] - 1e-3:
        desired = float(c.gpu_freq_default_mhz[1]) if c.gpu_freq_default_mhz is not None else top
    return next((f for f in steps if f <= desired + 1e-3), steps[-1])


_S = TypeVar("_S", ThermalState, PowerSavingState)


def _acting(run: _Run, clocks: bool, step: Amount, decide_one: Callable[[_S], _S], st: _S) -> _S:
    """Run one policy's state machine in its actuator's unit. The machines work on ``cap_w`` as "the cap"; with
    the clocks actuator the cap is MHz, kept in ``cap_mhz`` outside them."""
    run.clocks = clocks
    run.step = step
    if clocks:
        clocks_ = _clock_steps(run.ctx.constraints)
        run.floor = clocks_[-1] if clocks_ else 0.0  # (highest first)
        given = replace(st, cap_w=st.cap_mhz, cap_mhz=None) if st.cap_w is not None or st.cap_mhz is not None else st
        out = decide_one(given)
        if out is given:
            out = st
        elif out.cap_w is not None or out.cap_mhz is not None:
            out = replace(out, cap_mhz=out.cap_w, cap_w=None)
    else:
        run.floor = _floor_w(run.ctx)
        out = decide_one(replace(st, cap_mhz=None) if st.cap_mhz is not None else st)
    run.clocks = False
    return out


def _idle_clock(cfg: PowerSavingConfig, ctx: PolicyContext, ceiling: float) -> float:
    """The idle clock cap (MHz) with the clocks actuator: the lowest supported clock, MHz, or a percent of the
    GPU's maximum clock; within [lowest, ceiling]."""
    clocks = _clock_steps(ctx.constraints)
    lowest = min(clocks) if clocks else 0.0
    amount = cfg.idle_clock
    if amount.kind == "min":
        cap = lowest
    elif amount.kind == "mhz":
        cap = amount.value
    else:
        cap = (max(clocks) if clocks else ceiling) * amount.value / 100
    return min(ceiling, max(lowest, cap))


def _idle_cap(cfg: PowerSavingConfig, ctx: PolicyContext, ceiling: float) -> float:
    c = ctx.constraints
    amount = cfg.idle_power_limit
    if amount.kind == "min":
        cap = _floor_w(ctx)
    elif amount.kind == "watts":
        cap = amount.value
    else:
        reference = c.power_limit_default_w if c.power_limit_default_w is not None else ceiling
        cap = reference * amount.value / 100
    return min(ceiling, max(_floor_w(ctx), cap))


def _power_saving(
    st: PowerSavingState, run: _Run, ceiling: float | None, last_change_s: float | None
) -> PowerSavingState:
    cfg = run.config.power_saving
    if not cfg.enabled:
        if st.active:
            run.event(POWER_SAVING, "disabled", "policy-disabled", st.cap_w, None)
            run.changed = True
        return _BUSY
    util = run.utilization_pct
    if util is None:
        return st
    if util >= cfg.threshold_pct:
        if st.active:
            threshold = format_number(cfg.threshold_pct)
            run.event(
                POWER_SAVING, "restore", f"utilization-{format_number(util)}-at-or-above-{threshold}", st.cap_w, None
            )
            run.changed = True
        return _BUSY
    idle_since = st.idle_since_s if st.idle_since_s is not None else run.now_s
    if st.idle_since_s != idle_since:
        st = replace(st, idle_since_s=idle_since)
    if st.active or ceiling is None:
        return st
    if run.now_s - idle_since >= cfg.idle_for_s and run.interval_passed(last_change_s):
        cap = _idle_clock(cfg, run.ctx, ceiling) if run.clocks else _idle_cap(cfg, run.ctx, ceiling)
        reason = f"utilization-below-{format_number(cfg.threshold_pct)}-for-{format_duration(cfg.idle_for_s)}"
        run.event(POWER_SAVING, "engage", reason, ceiling, cap)
        run.changed = True
        return PowerSavingState(idle_since, True, cap)
    return st


#: Power saving's state while the GPU is busy or the policy is off (immutable, so one instance serves every GPU).
_BUSY = PowerSavingState()
#: Thermal throttling's state while the policy is off (immutable, shared likewise).
_THERMAL_NORMAL = ThermalState()


def _health(st: HealthState, run: _Run, values: Mapping[str, Value]) -> HealthState:
    cfg = run.config.health
    ctx = run.ctx
    lost = ctx.gpu_lost or any(e.kind == "gpu_lost" for e in ctx.events)
    reset = any(e.kind == "driver_reload" for e in ctx.events)
    xids = [e.xid for e in ctx.events if e.kind == "xid"]
    xid_now = _num(values, "xid_last")
    last_xid = st.last_xid
    if xid_now is not None and int(xid_now) != st.last_xid:
        last_xid = int(xid_now)
        if last_xid != 0 and last_xid not in xids:
            xids.append(last_xid)
    ecc_now = _num(values, "ecc_errors_uncorrected")
    ecc_rise = any(e.kind == "ecc_double" for e in ctx.events)
    if ecc_now is not None and st.ecc_uncorrected is not None:
        if ecc_now > st.ecc_uncorrected:
            ecc_rise = True
        elif ecc_now < st.ecc_uncorrected:
            reset = True  # volatile counters restart on a driver reload or GPU reset
    ecc = int(ecc_now) if ecc_now is not None else st.ecc_uncorrected
    unchanged = last_xid == st.last_xid and ecc == st.ecc_uncorrected
    new = st if unchanged else replace(st, last_xid=last_xid, ecc_uncorrected=ecc)

    if lost:
        if st.status != "offline":
            run.event(HEALTH, "offline", "gpu-lost")
        new = replace(new, status="offline", cause="gpu-lost", recovery="reboot", subsystem="pcie")
        return _with_report(new)
    if st.status == "offline" and values:
        run.event(HEALTH, "recovered", "gpu-back")
        new = replace(new, status="ok", cause="", recovery="", subsystem="", reset_seen=True)
        # An XID that needs a reboot (79) delivered with the GPU's return belongs to the episode that ended.
        xids = [x for x in xids if cfg.xids.classify(x).recovery != "reboot"]
    if not cfg.enabled:
        if new.status == "unhealthy" or new.degraded or new.probe_status != "healthy":
            run.event(HEALTH, "disabled", "policy-disabled")
        cleared = replace(
            new, status="ok", cause="", recovery="", degraded="", probe_status="healthy", probe_cause="", checks=()
        )
        return _with_report(cleared)
    if reset:
        new = replace(new, reset_seen=True)
        if new.status == "unhealthy" and new.recovery != "reboot":
            run.event(HEALTH, "recovered", f"gpu-reset-{new.cause}")
            new = replace(new, status="ok", cause="", recovery="", subsystem="")
    new = _level1_faults(new, run, xids, ecc_rise)
    if ctx.checks is not None:
        new = _level2(new, run, ctx.checks)
    if ctx.probe is not None:
        new = _level3(new, run, ctx.probe)
    return _with_report(new)


def _level1_faults(st: HealthState, run: _Run, xids: Sequence[int], ecc_rise: bool) -> HealthState:
    """New XIDs (classified by the catalog and the lists) and a rise of uncorrected ECC errors."""
    if not xids and not ecc_rise:
        return st
    cfg = run.config.health
    policy = cfg.xids
    fatal: tuple[str, str, str] | None = None  # cause, recovery, subsystem
    for xid in xids:
        c = policy.classify(xid)
        if c.severity == "ignored":
            continue
        if c.severity == "fatal":
            fatal = (f"xid{xid}", c.recovery, c.subsystem)
        elif c.severity == "warning":
            if st.degraded != c.reason:
                run.event(HEALTH, "degraded", c.reason)
            st = replace(st, degraded=c.reason, subsystem=st.subsystem or c.subsystem, passes=0)
        else:
            run.event(HEALTH, "xid", c.reason)
    if fatal is None and ecc_rise and cfg.ecc_uncorrected:
        fatal = ("ecc", "reset", "memory")
    if fatal is None:
        return st
    cause, recovery, subsystem = fatal
    if st.status != "unhealthy" or st.cause != cause:
        run.event(HEALTH, "unhealthy", cause)
    return replace(
        st, status="unhealthy", cause=cause, recovery=recovery, subsystem=subsystem, passes=0, reset_seen=False
    )


def _level2(st: HealthState, run: _Run, checks: tuple[CheckResult, ...]) -> HealthState:
    """The checks replace the previous ones; a check that changes verdict is an event."""
    before = {c.name: c for c in st.checks}
    for c in checks:
        old = before.get(c.name)
        if old is not None and old.status == c.status and old.reason == c.reason:
            continue
        if c.status != "healthy":
            run.event(HEALTH, f"check-{c.status}", f"level2-{c.name}-{c.reason}")
        elif old is not None:
            run.event(HEALTH, "check-ok", f"level2-{c.name}")
    return replace(st, checks=checks)


def _level3(st: HealthState, run: _Run, probe: ProbeResult) -> HealthState:
    """A probe's verdict, and the ways back that passing probes open."""
    cfg = run.config.health
    status = probe.status
    st = replace(st, last_probe=probe)
    if status is None:  # skipped: no news
        return st
    if status == "unhealthy":
        cause = f"probe-{probe.outcome}" + (f"-{probe.reason}" if probe.reason else "")
        if st.probe_status != "unhealthy" or st.probe_cause != cause:
            run.event(HEALTH, "unhealthy", f"level3-{cause}")
        return replace(st, probe_status="unhealthy", probe_cause=cause, passes=0, reset_seen=False)
    passes = st.passes + 1
    enough = passes >= cfg.recovery_probes
    if st.probe_status == "unhealthy":
        if not (enough or st.reset_seen):
            return replace(st, passes=passes)
        why = "after-reset" if st.reset_seen and not enough else f"{passes}-passing-probes"
        run.event(HEALTH, "recovered", f"level3-{why}")
        st = replace(st, probe_status="healthy", probe_cause="")
    if status == "degraded":
        cause = f"probe-slow-{probe.reason}" if probe.reason else "probe-slow"
        if st.probe_status != "degraded":
            run.event(HEALTH, "degraded", f"level3-{cause}")
        st = replace(st, probe_status="degraded", probe_cause=cause)
    elif st.probe_status == "degraded":
        st = replace(st, probe_status="healthy", probe_cause="")
    if enough and st.status == "unhealthy" and st.recovery == "probes":
        run.event(HEALTH, "recovered", f"{st.cause}-{passes}-passing-probes")
        st = replace(st, status="ok", cause="", recovery="", subsystem="")
    if enough and st.degraded:
        run.event(HEALTH, "recovered", f"{st.degraded}-{passes}-passing-probes")
        st = replace(st, degraded="")
    return replace(st, passes=passes)


def _health_cause(st: HealthState) -> str:
    """The cause named in ``policy_state``: level 1's, else the worst level's reason."""
    return st.cause if st.status == "unhealthy" else st.report.reason


def _with_report(st: HealthState) -> HealthState:
    """``st`` with its ``HealthReport`` (the same object while nothing changed)."""
    if st.status == "offline":
        level1: tuple[HealthStatus, str, str] = ("unhealthy", "gpu-lost", "pcie")
    elif st.status == "unhealthy":
        level1 = ("unhealthy", st.cause, st.subsystem or "engine")
    elif st.degraded:
        level1 = ("degraded", st.degraded, st.subsystem or "engine")
    else:
        level1 = ("healthy", "ok", "")
    level3: tuple[HealthStatus, str] = (st.probe_status, st.probe_cause or "ok")
    if level1[0] == "healthy" and level3[0] == "healthy" and all(c.status == "healthy" for c in st.checks):
        report = HEALTHY_REPORT if not st.checks else _healthy_with(st.checks, st.report)
    else:
        report = build_report(level1, st.checks, level3)
    if report is st.report or report == st.report:
        return st
    return replace(st, report=report)


def _healthy_with(checks: tuple[CheckResult, ...], old: HealthReport) -> HealthReport:
    if old.status == "healthy" and old.checks == checks:
        return old
    return HealthReport(checks=checks)


def decide(
    state: PolicyState,
    sample_values: Mapping[str, Value],
    ctx: PolicyContext,
    config: PolicyConfig,
    now_s: float,
) -> tuple[PolicyState, Decision]:
    """One decision for one GPU from its latest sample values (catalog names and units).

    Missing values hold the policy that needs them (no temperature: no thermal change). The state returned
    replaces ``state``; keep it per GPU across config swaps.
    """
    return _decide(state, sample_values, ctx, config, now_s, ctx.uuid)


def _decide(
    state: PolicyState,
    sample_values: Mapping[str, Value],
    ctx: PolicyContext,
    config: PolicyConfig,
    now_s: float,
    uuid: str,
) -> tuple[PolicyState, Decision]:
    """``_steady`` where it applies, else ``_decide_full``; events carry ``uuid``."""
    steady = _steady(state, sample_values, ctx, config, now_s)
    if steady is not None:
        return steady
    return _decide_full(state, sample_values, ctx, config, now_s, uuid)


#: The decisions of a GPU where nothing is going on (no limit, no event, healthy), by ``dry_run``. Frozen, so
#: one instance serves every GPU and every call.
_STEADY_DECISIONS: dict[bool, Decision] = {
    False: Decision(),
    True: Decision(policy_state="dry-run:normal", dry_run=True),
}


def _current_limit_w(ctx: PolicyContext, values: Mapping[str, Value]) -> float | None:
    """The power limit in force: the context's, else the sample's."""
    current_w = ctx.current_power_limit_w
    return current_w if current_w is not None else _num(values, "power_limit")


def _limit_books(
    state: PolicyState, current_w: float | None, tightest: float | None
) -> tuple[float | None, float | None]:
    """(applied, baseline) after a decision whose tightest emitted limit is ``tightest``. The cap we imposed is
    remembered until the GPU's reading moves off it (the reconciler may lag a cycle), so the pre-policy baseline
    is never learnt from our own cap."""
    applied = tightest
    if (
        applied is None
        and state.applied_w is not None
        and current_w is not None
        and abs(current_w - state.applied_w) < 0.5
    ):
        applied = state.applied_w
    baseline = state.baseline_w if state.baseline_w is not None else current_w
    if applied is None and current_w is not None:
        baseline = current_w
    return applied, baseline


def _steady(
    state: PolicyState, values: Mapping[str, Value], ctx: PolicyContext, config: PolicyConfig, now_s: float
) -> tuple[PolicyState, Decision] | None:
    """The usual decision, cheaply: a healthy GPU under no policy cap, no event, cool, no power-saving action due.

    Returns what ``_decide_full`` would return (the same ``state`` object when nothing moved, a shared
    ``Decision``), or None where any policy might act, emit or change phase: then the full decision runs.
    Every test here is a sufficient condition for "``_decide_full`` does nothing but keep its books".
    """
    if ctx.events or ctx.gpu_lost or state.capped or ctx.probe is not None or ctx.checks is not None:
        return None
    health = state.health
    thermal = state.thermal
    power = state.power_saving
    if health.status != "ok" or health.report.status != "healthy" or thermal.phase != "normal" or power.active:
        return None
    # Health: a new XID or uncorrected ECC count (or a first reading) goes the full way. Values the full path
    # would convert with a loss (not a plain int, or an int beyond a float's exact range) too.
    xid = values.get("xid_last")
    if xid is not None and (type(xid) is not int or xid != health.last_xid or float(xid) != xid):
        return None
    ecc = values.get("ecc_errors_uncorrected")
    if ecc is not None and (type(ecc) is not int or ecc != health.ecc_uncorrected or float(ecc) != ecc):
        return None
    # Thermal: enabled and at or below maxTemp (NaN and -inf read as "no temperature" both ways), or off.
    thermal_cfg = config.thermal
    if thermal_cfg.enabled:
        temp = values.get("temperature")
        max_temp = (
            thermal_cfg.max_temp_c if thermal_cfg.max_margin_c is None else _thermal_thresholds(thermal_cfg, values)[0]
        )
        if temp is not None and ((type(temp) is not int and type(temp) is not float) or temp > max_temp):
            return None
    else:
        thermal = _THERMAL_NORMAL
    # Power saving: off, busy, or idle for less than idleFor.
    power_cfg = config.power_saving
    if not power_cfg.enabled:
        power = _BUSY
    else:
        util = _num(values, "utilization_gpu")
        if util is not None:
            if util >= power_cfg.threshold_pct:
                power = _BUSY
            else:
                idle_since = power.idle_since_s if power.idle_since_s is not None else now_s
                if now_s - idle_since >= power_cfg.idle_for_s:
                    return None
                if power.idle_since_s is None:
                    power = PowerSavingState(idle_since, False, power.cap_w)
    # No limit: the bookkeeping of ``_decide_full`` with ``emitted`` empty.
    applied, baseline = _limit_books(state, _current_limit_w(ctx, values), None)
    decision = _STEADY_DECISIONS[config.dry_run]
    if (
        thermal is state.thermal
        and power is state.power_saving
        and applied is state.applied_w
        and baseline == state.baseline_w
    ):
        return state, decision
    return PolicyState(thermal, power, health, baseline, state.last_change_s, applied, False), decision


def _decide_full(
    state: PolicyState,
    sample_values: Mapping[str, Value],
    ctx: PolicyContext,
    config: PolicyConfig,
    now_s: float,
    uuid: str,
) -> tuple[PolicyState, Decision]:
    """``decide`` the long way, for every case (``_steady`` covers the usual one); events carry ``uuid``."""
    run = _Run(config, ctx, uuid, now_s, _num(sample_values, "temperature"), _num(sample_values, "utilization_gpu"))
    run.max_temp_c, run.release_temp_c = _thermal_thresholds(config.thermal, sample_values)
    current_w = _current_limit_w(ctx, sample_values)
    ceiling = _ceiling(state, ctx, current_w)
    # No power cap to act on (a Jetson): the power actuator acts through the clocks where the backend has them.
    no_cap = "power_limit" in ctx.constraints.unsupported
    clocks_wanted = no_cap or config.thermal.actuator == "clocks" or config.power_saving.actuator == "clocks"
    clock_ceiling = _clock_ceiling(ctx) if clocks_wanted else None

    health = _health(state.health, run, sample_values)
    thermal_clocks = (no_cap or config.thermal.actuator == "clocks") and clock_ceiling is not None
    thermal = _acting(
        run,
        thermal_clocks,
        config.thermal.clock_step if thermal_clocks else config.thermal.step,
        lambda st: _thermal(st, run, clock_ceiling if thermal_clocks else ceiling, state.last_change_s),
        state.thermal,
    )
    # One change per interval: a thermal change this decision holds back a power-saving engagement.
    power_clocks = (no_cap or config.power_saving.actuator == "clocks") and clock_ceiling is not None
    last_change = now_s if run.changed else state.last_change_s
    power = _acting(
        run,
        power_clocks,
        run.step,
        lambda st: _power_saving(st, run, clock_ceiling if power_clocks else ceiling, last_change),
        state.power_saving,
    )
    last_change_s = now_s if run.changed else state.last_change_s

    limits: list[PolicyLimit] = []
    max_txt = format_number(run.max_temp_c)
    if clock_ceiling is not None:
        if thermal.cap_mhz is not None and thermal.phase != "normal" and thermal.cap_mhz < clock_ceiling:
            reason = f"step{thermal.steps}-max-temp-{max_txt}"
            limits.append(PolicyLimit(THERMAL, None, reason, clock_max_mhz=int(thermal.cap_mhz)))
        if power.active and power.cap_mhz is not None and power.cap_mhz < clock_ceiling:
            limits.append(PolicyLimit(POWER_SAVING, None, "idle", clock_max_mhz=int(power.cap_mhz)))
    if ceiling is not None:
        if thermal.cap_w is not None and thermal.phase != "normal" and thermal.cap_w < ceiling:
            reason = f"step{thermal.steps}-max-temp-{max_txt}"
            limits.append(PolicyLimit(THERMAL, thermal.cap_w, reason))
        if power.active and power.cap_w is not None and power.cap_w < ceiling:
            limits.append(PolicyLimit(POWER_SAVING, power.cap_w, "idle"))
        floor = _floor_w(ctx)
        unhealthy = health.status != "offline" and health.report.status == "unhealthy"
        if unhealthy and config.health.action == "min-power" and floor < ceiling:
            limits.append(PolicyLimit(HEALTH, floor, f"unhealthy-{_health_cause(health)}"))

    emitted = () if config.dry_run else tuple(limits)
    tightest = min((lim.power_limit_w for lim in emitted if lim.power_limit_w is not None), default=None)
    applied, baseline = _limit_books(state, current_w, tightest)
    restore = state.baseline_w if state.capped and not emitted else None

    parts: list[str] = []
    if health.status == "offline":
        parts.append("health:offline-gpu-lost")
    elif health.report.status == "unhealthy":
        parts.append(f"health:unhealthy-{_health_cause(health)}")
    if thermal.phase != "normal":
        parts.append(f"thermal:{thermal.phase}-step{thermal.steps}")
    if power.active:
        parts.append("power-saving:active")
    policy_state = ",".join(parts) if parts else "normal"
    if config.dry_run:
        policy_state = f"dry-run:{policy_state}"
    assert TWIN_VALUE_RE.fullmatch(policy_state), policy_state

    new_state = PolicyState(thermal, power, health, baseline, last_change_s, applied, bool(emitted))
    decision = Decision(
        limits=emitted,
        policy_state=policy_state,
        device_state="offline"
        if health.status == "offline"
        else ("unhealthy" if health.report.status == "unhealthy" else "ok"),
        events=tuple(run.events),
        dry_run=config.dry_run,
        restore_power_limit_w=restore,
    )
    return new_state, decision


# --------------------------------------------------------------------------------------------------
# Engine: config + overrides + per-GPU state, for the composition root
# --------------------------------------------------------------------------------------------------


class PolicyEngine:
    """Holds the node config, the per-device overrides (by GPU UUID) and one ``PolicyState`` per GPU.

    ``configure`` swaps configs without touching the decision state: cool-down timers and caps carry on unless
    a policy is switched off. Not thread-safe: call it from the event loop.
    """

    def __init__(self, config: PolicyConfig | None = None) -> None:
        self._config = config if config is not None else PolicyConfig()
        self._override_raw: dict[str, str | Mapping[str, Any]] = {}
        self._overrides: dict[str, PolicyConfig] = {}
        self._states: dict[str, PolicyState] = {}
        #: GPUs whose actuator was looked at once their constraints were known (the fallback is logged once).
        self._actuator_noted: set[str] = set()

    @property
    def config(self) -> PolicyConfig:
        return self._config

    def configure(
        self, config: PolicyConfig, overrides: Mapping[str, str | Mapping[str, Any] | None] | None = None
    ) -> None:
        """Swap in a new node config and, when given, the whole set of per-GPU overrides (by UUID; otherwise the
        current overrides are merged again over the new config). Everything is validated before anything
        changes: on ``ConfigError`` the engine keeps its old configs."""
        raw = dict(self._override_raw) if overrides is None else {u: o for u, o in overrides.items() if o}
        merged = {uuid: merge_override(config, text, f"devices[{uuid}].policy") for uuid, text in raw.items()}
        self._config = config
        self._override_raw = raw
        self._overrides = merged

    def set_override(self, uuid: str, override: str | Mapping[str, Any] | None) -> None:
        """Set (or clear, with None or "") one GPU's override; on ``ConfigError`` the old one stays."""
        if not override:
            self._override_raw.pop(uuid, None)
            self._overrides.pop(uuid, None)
            return
        self._overrides[uuid] = merge_override(self._config, override, f"devices[{uuid}].policy")
        self._override_raw[uuid] = override

    def config_for(self, uuid: str) -> PolicyConfig:
        return self._overrides.get(uuid, self._config)

    def state(self, uuid: str) -> PolicyState:
        state = self._states.get(uuid)
        return state if state is not None else PolicyState()

    def health(self, uuid: str) -> HealthReport:
        """The GPU's three health levels after its last decision (the ``health`` twin and series)."""
        return self.state(uuid).health.report

    def forget(self, uuid: str) -> None:
        """Drop a GPU that left the node (its Device was deleted)."""
        self._states.pop(uuid, None)
        self._actuator_noted.discard(uuid)
        self._override_raw.pop(uuid, None)
        self._overrides.pop(uuid, None)

    def decide(self, uuid: str, sample_values: Mapping[str, Value], ctx: PolicyContext, now_s: float) -> Decision:
        """``decide`` for one GPU with its own config and state (events carry ``uuid`` when ``ctx`` names no
        GPU); the new state is kept."""
        if uuid not in self._actuator_noted:
            self._note_actuator(uuid, ctx.constraints)
        state, decision = _decide(self.state(uuid), sample_values, ctx, self.config_for(uuid), now_s, ctx.uuid or uuid)
        self._states[uuid] = state
        return decision

    def _note_actuator(self, uuid: str, c: Constraints) -> None:
        """Log once per GPU, when its constraints are known, that a power actuator acts through the clocks."""
        if not (c.unsupported or c.graphics_clocks_mhz or c.gpu_freqs_mhz):
            return  # not known yet
        self._actuator_noted.add(uuid)
        cfg = self.config_for(uuid)
        power_actuated = [
            name
            for name, on, actuator in (
                ("thermal throttling", cfg.thermal.enabled, cfg.thermal.actuator),
                ("power saving", cfg.power_saving.enabled, cfg.power_saving.actuator),
            )
            if on and actuator == "power"
        ]
        if power_actuated and _clocks_instead_of_power(c):
            what = "the devfreq max_freq" if c.gpu_freqs_mhz and not c.graphics_clocks_mhz else "the locked SM clock"
            log.info(
                "GPU %s has no power cap: %s (actuator power) acts through the GPU clock instead (%s)",
                uuid,
                " and ".join(power_actuated),
                what,
            )
