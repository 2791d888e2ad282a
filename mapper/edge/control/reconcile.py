"""Enforcing the desired GPU state: a pure ``plan`` and a level-triggered ``Reconciler`` over ``GpuBackend``.

``plan(desired, observed, constraints, limits)`` decides, from values only, what each writable property should
be (its *target*), which NVML actions bring the GPU there, and a status per property. ``Reconciler.step`` runs
once per collect cycle per GPU: it plans, applies the actions through the backend, reads back, plans again on
the read-back values to know what is really in force, and returns statuses, outcomes, counters and ``Ack``
records for every status change. Every cycle compares again, so drift (driver reload, GPU reset, another tool)
is re-applied within one cycle and counted.

Action groups: the power limit, the two locked-clock *pairs* (min and max are one NVML call) and the two modes;
on a Jetson the devfreq range (``gpu_min_freq`` / ``gpu_max_freq``, one ``set_gpu_freq_range`` call: values snap
to the frequencies the GPU offers, the maximum down and the minimum up) and the nvpmodel ``power_mode``, set
through the backend's ``FrequencyActuator`` methods; a policy's clock cap (``PolicyLimit.clock_max_mhz``) binds
there as the devfreq maximum. Counters and the ``desired_status`` twin use the group names;
statuses and acks are per property.

No I/O here: the backend is the ``mapper.shared.model.GpuBackend`` Protocol and time comes from an injected ``Clock``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from mapper.clock import Clock
from mapper.edge.control.desired import DesiredValue, observed_desired_value
from mapper.errors import (
    InvalidValueError,
    MapperError,
    NoPermissionError,
    PermanentError,
    ReadBackMismatchError,
    TransientError,
    UnsupportedError,
)
from mapper.shared.model import (
    COMPUTE_MODES,
    PROPERTY_BY_NAME,
    TWIN_VALUE_RE,
    Constraints,
    GpuBackend,
    PolicyLimit,
    Sample,
    Value,
    format_number,
    format_value,
)

__all__ = [
    "CONFIG_PART",
    "GROUPS",
    "POWER_TOLERANCE_W",
    "Ack",
    "Action",
    "ActionOutcome",
    "Plan",
    "ReconcileCounters",
    "ReconcileResult",
    "Reconciler",
    "Status",
    "Target",
    "allowed_values",
    "deferred_ack",
    "desired_status_twin",
    "group_of",
    "observed_desired_value",
    "parse_desired_status",
    "plan",
    "with_config_error",
]

#: Action groups in twin order, with the properties each one sets.
GROUPS: Mapping[str, tuple[str, ...]] = {
    "power_limit": ("power_limit",),
    "locked_gpu_clocks": ("locked_gpu_clock_min", "locked_gpu_clock_max"),
    "locked_memory_clocks": ("locked_memory_clock_min", "locked_memory_clock_max"),
    "persistence_mode": ("persistence_mode",),
    "compute_mode": ("compute_mode",),
    "power_mode": ("power_mode",),
    "gpu_freq_range": ("gpu_min_freq", "gpu_max_freq"),
}
#: What to read back after a group was set, where it changes more than its own properties (nvpmodel sets the
#: mode's devfreq range).
_READ_BACK: Mapping[str, tuple[str, ...]] = {"power_mode": ("power_mode", "gpu_min_freq", "gpu_max_freq")}
_GROUP_OF: Mapping[str, str] = {prop: group for group, props in GROUPS.items() for prop in props}
#: The properties a desired value can set, in catalog order (the order acks go out in).
_WRITABLE_IN_ORDER = tuple(p for p in PROPERTY_BY_NAME if p in _GROUP_OF)

#: NVML keeps power limits in mW; a read-back within this many watts of the target is the target.
POWER_TOLERANCE_W = 0.0011
#: Devfreq keeps Hz; a frequency within this many MHz of the target is the target.
FREQ_TOLERANCE_MHZ = 0.001

Result = Literal["applied", "pending", "rejected", "overridden"]
_TAG_UNSAFE = re.compile(r"[^a-zA-Z0-9_.]+")
_REASON_UNSAFE = re.compile(r"[^a-zA-Z0-9_.\-]+")
_MAX_TAG = 32
#: Ack reasons after which a property is no longer enforced.
_TERMINAL = ("default-restored", "released")


def group_of(prop: str) -> str:
    """The action group of a writable property (``locked_gpu_clock_min`` -> ``locked_gpu_clocks``)."""
    try:
        return _GROUP_OF[prop]
    except KeyError:
        raise ValueError(f"{prop!r} is not a writable GPU property") from None


def _tag(text: str) -> str:
    """A policy name made safe for ``overridden-<policy>`` in the status twin (no ``-``, ``,`` or ``:``)."""
    return _TAG_UNSAFE.sub("_", text.strip())[:_MAX_TAG] or "policy"


def _reason(text: str) -> str:
    return _REASON_UNSAFE.sub("_", text.strip())[:_MAX_TAG] or "error"


# --------------------------------------------------------------------------------------------------
# Plan: pure
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Status:
    """A writable property's status. ``text`` is its form in the ``desired_status`` twin."""

    result: Result
    reason: str = ""

    @property
    def text(self) -> str:
        if self.result in ("rejected", "overridden") or (self.result == "applied" and self.reason == "clamped"):
            return f"{self.result}-{self.reason}" if self.reason else self.result
        return self.result


@dataclass(frozen=True)
class Target:
    """What a group should read on the GPU: ``(watts,)``, ``(min_mhz, max_mhz)`` (``(0, 0)`` = unlocked),
    ``(enabled,)`` or ``(mode_name,)``."""

    group: str
    value: tuple[Value, ...]
    #: "desired": a desired value; "policy": a policy's cap; "default": returning to the GPU's default.
    origin: Literal["desired", "policy", "default"]
    policy: str = ""
    clamped: bool = False

    def value_of(self, prop: str) -> Value:
        props = GROUPS[self.group]
        return self.value[props.index(prop)]


@dataclass(frozen=True)
class Action:
    """One NVML setter call. ``op`` ``reset`` takes no value (locked clocks back to unlocked)."""

    group: str
    op: Literal["set", "reset"]
    value: tuple[Value, ...] = ()
    origin: Literal["desired", "policy", "default"] = "desired"

    def describe(self) -> str:
        if self.op == "reset":
            return f"reset {self.group}"
        return f"set {self.group} " + ",".join(_fmt(v) for v in self.value)


@dataclass(frozen=True)
class Plan:
    actions: tuple[Action, ...]
    #: By property, for every writable property with a desired value.
    statuses: Mapping[str, Status]
    #: By group, for every group the plan manages (desired, policy or restore).
    targets: Mapping[str, Target]
    #: Properties asked to be restored whose group is at its default now (or has no default to return to).
    restored: frozenset[str] = frozenset()


def _fmt(value: Value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return format_number(value)
    return str(value)


def _same(group: str, observed: tuple[Value | None, ...], target: tuple[Value, ...]) -> bool:
    if any(v is None for v in observed):
        return False
    if group == "power_limit":
        obs = observed[0]
        return isinstance(obs, int | float) and abs(float(obs) - float(target[0])) <= POWER_TOLERANCE_W
    if group == "compute_mode":
        return str(observed[0]) == str(target[0])
    if group == "persistence_mode":
        return bool(observed[0]) == bool(target[0])
    if group == "gpu_freq_range":
        return all(
            isinstance(o, int | float) and abs(float(o) - float(t)) <= FREQ_TOLERANCE_MHZ
            for o, t in zip(observed, target, strict=True)
        )
    return tuple(int(v) for v in observed if v is not None) == tuple(int(v) for v in target)


def _observed(group: str, observed: Mapping[str, Value]) -> tuple[Value | None, ...]:
    return tuple(observed.get(p) for p in GROUPS[group])


def _nearest(value: int, allowed: Collection[int]) -> int:
    return min(allowed, key=lambda a: (abs(a - value), a))


CLOCK_GROUPS = ("locked_gpu_clocks", "locked_memory_clocks")


def group_unsupported(constraints: Constraints, group: str) -> bool:
    """True when the GPU is known not to support setting ``group`` (learnt from NotSupported)."""
    return any(p in constraints.unsupported for p in GROUPS[group]) or group in constraints.unsupported


def plan(
    desired: Mapping[str, DesiredValue],
    observed: Mapping[str, Value],
    constraints: Constraints,
    limits: Iterable[PolicyLimit] = (),
    *,
    clamp: bool = False,
    restore: Collection[str] = (),
    restore_modes: bool = False,
) -> Plan:
    """Decide targets, actions and statuses from values alone.

    ``desired``: the winning ``DesiredValue`` per property (``DesiredState.effective()``). ``observed``: the
    latest sample values (catalog units). ``limits``: the active policy caps (tighten only). ``clamp``: bring an
    out-of-range value to the nearest allowed one instead of rejecting it. ``restore``: properties whose desired
    value was removed: their group returns to its default (power limit default, clocks unlocked; persistence off
    and compute ``default`` only when ``restore_modes``).
    """
    actions: list[Action] = []
    statuses: dict[str, Status] = {}
    targets: dict[str, Target] = {}
    restored: set[str] = set()
    restore_set = set(restore)

    def add_target(target: Target) -> None:
        targets[target.group] = target
        if not _same(target.group, _observed(target.group, observed), target.value):
            if target.group in CLOCK_GROUPS and target.value == (0, 0):
                actions.append(Action(target.group, "reset", (), target.origin))
            else:
                actions.append(Action(target.group, "set", target.value, target.origin))

    def in_force(target: Target) -> bool:
        return _same(target.group, _observed(target.group, observed), target.value)

    # --- power limit ---------------------------------------------------------------------------------
    limits = list(limits)
    _plan_power(desired, observed, constraints, limits, clamp, restore_set, statuses, add_target, restored)

    # --- locked clock pairs --------------------------------------------------------------------------
    for group in CLOCK_GROUPS:
        min_prop, max_prop = GROUPS[group]
        d_min, d_max = desired.get(min_prop), desired.get(max_prop)
        if group == "locked_gpu_clocks" and _plan_clock_cap(
            d_min, d_max, constraints, limits, clamp, statuses, add_target
        ):
            continue
        if d_min is None and d_max is None:
            asked = restore_set & {min_prop, max_prop}
            if asked:
                target = Target(group, (0, 0), "default")
                if group_unsupported(constraints, group):
                    restored |= asked
                else:
                    add_target(target)
                    if in_force(target):
                        restored |= asked
            continue
        allowed = constraints.graphics_clocks_mhz if group == "locked_gpu_clocks" else constraints.memory_clocks_mhz
        checked = _check_clocks(group, d_min, d_max, allowed, constraints, clamp)
        if not isinstance(checked, Target):
            statuses.update(checked)
            continue
        add_target(checked)
        status = Status("applied" if in_force(checked) else "pending", "clamped" if checked.clamped else "")
        for d in (d_min, d_max):
            if d is not None:
                statuses[d.prop] = status

    # --- modes ---------------------------------------------------------------------------------------
    for group, default in (("persistence_mode", False), ("compute_mode", "default")):
        d = desired.get(group)
        if d is None:
            if group in restore_set:
                if restore_modes and group not in constraints.unsupported:
                    target = Target(group, (default,), "default")
                    add_target(target)
                    if in_force(target):
                        restored.add(group)
                else:
                    restored.add(group)
            continue
        if not d.valid:
            statuses[group] = Status("rejected", d.reason or "wrong-type")
            continue
        if group in constraints.unsupported:
            statuses[group] = Status("rejected", "not-supported")
            continue
        value: Value
        if group == "compute_mode":
            name = str(d.value).strip().lower().replace("-", "_")
            if name not in COMPUTE_MODES:
                statuses[group] = Status("rejected", "unknown-value")
                continue
            value = name
        else:
            value = bool(d.value)
        target = Target(group, (value,), "desired")
        add_target(target)
        statuses[group] = Status("applied" if in_force(target) else "pending")

    # --- Jetson: the power mode first (nvpmodel resets the devfreq range), then the range -------------
    _plan_power_mode(desired, constraints, restore_set, restore_modes, statuses, add_target, in_force, restored)
    _plan_freq_range(desired, constraints, limits, clamp, restore_set, statuses, add_target, in_force, restored)
    range_target = targets.get("gpu_freq_range")
    groups_acting = {a.group for a in actions}
    if range_target is not None and "power_mode" in groups_acting and "gpu_freq_range" not in groups_acting:
        # nvpmodel sets the mode's own devfreq range: a range in force now is set again after the switch.
        actions.append(Action("gpu_freq_range", "set", range_target.value, range_target.origin))

    return Plan(tuple(actions), statuses, targets, frozenset(restored))


def _plan_power_mode(
    desired: Mapping[str, DesiredValue],
    constraints: Constraints,
    restore: set[str],
    restore_modes: bool,
    statuses: dict[str, Status],
    add_target: Callable[[Target], None],
    in_force: Callable[[Target], bool],
    restored: set[str],
) -> None:
    prop = "power_mode"
    d = desired.get(prop)
    modes = dict(constraints.power_modes)
    if d is None:
        if prop in restore:
            default = constraints.power_mode_default
            if restore_modes and default is not None and prop not in constraints.unsupported:
                target = Target(prop, (default,), "default")
                add_target(target)
                if in_force(target):
                    restored.add(prop)
            else:
                restored.add(prop)
        return
    if not d.valid or isinstance(d.value, str | bool) or d.value is None:
        statuses[prop] = Status("rejected", d.reason or "wrong-type")
        return
    if not modes or prop in constraints.unsupported:
        statuses[prop] = Status("rejected", "not-supported")
        return
    mode = int(d.value)
    if mode not in modes:
        statuses[prop] = Status("rejected", "unknown-value")
        return
    target = Target(prop, (mode,), "desired")
    add_target(target)
    statuses[prop] = Status("applied" if in_force(target) else "pending")


def _snap(value: float, allowed: tuple[float, ...], down: bool) -> float | None:
    """The allowed frequency at or below (``down``) / at or above ``value``; None when there is none."""
    if down:
        below = [a for a in allowed if a <= value + FREQ_TOLERANCE_MHZ]
        return max(below) if below else None
    above = [a for a in allowed if a >= value - FREQ_TOLERANCE_MHZ]
    return min(above) if above else None


def _plan_freq_range(
    desired: Mapping[str, DesiredValue],
    constraints: Constraints,
    limits: list[PolicyLimit],
    clamp: bool,
    restore: set[str],
    statuses: dict[str, Status],
    add_target: Callable[[Target], None],
    in_force: Callable[[Target], bool],
    restored: set[str],
) -> None:
    group = "gpu_freq_range"
    min_prop, max_prop = GROUPS[group]
    d_min, d_max = desired.get(min_prop), desired.get(max_prop)
    allowed = tuple(sorted(constraints.gpu_freqs_mhz))
    default = constraints.gpu_freq_default_mhz or ((allowed[0], allowed[-1]) if allowed else None)
    # A policy's clock cap (the clocks actuator on a Jetson) snapped down to a frequency the GPU offers; it binds
    # only below the maximum in force without it (the cloud's, else the default): policies only tighten.
    caps = sorted((lim.clock_max_mhz, lim.policy) for lim in limits if lim.clock_max_mhz)
    cap = None
    if caps and allowed and not group_unsupported(constraints, group):
        cap = (_snap(caps[0][0], allowed, down=True) or allowed[0], caps[0][1])

    def capped(lo: float, hi: float) -> Target | None:
        if cap is None or cap[0] >= hi - FREQ_TOLERANCE_MHZ:
            return None
        target = Target(group, (min(lo, cap[0]), cap[0]), "policy", policy=cap[1])
        add_target(target)
        return target

    if d_min is None and d_max is None:
        if default is not None and capped(float(default[0]), float(default[1])) is not None:
            return
        asked = restore & {min_prop, max_prop}
        if asked:
            if default is None or group_unsupported(constraints, group):
                restored |= asked
            else:
                target = Target(group, (float(default[0]), float(default[1])), "default")
                add_target(target)
                if in_force(target):
                    restored |= asked
        return
    present = {d.prop: d for d in (d_min, d_max) if d is not None}

    def reject(reason: str, reasons: Mapping[str, str] | None = None) -> None:
        for prop in present:
            statuses[prop] = Status("rejected", (reasons or {}).get(prop, reason))
        if default is not None:  # a rejected value leaves the default in force: a policy cap still binds below it
            capped(float(default[0]), float(default[1]))

    bad = {prop: d.reason or "wrong-type" for prop, d in present.items() if not d.valid}
    if bad:  # a bad side carries its own reason; the other cannot apply alone and shows the same
        reject(next(iter(bad.values())), bad)
        return
    if not allowed or default is None or group_unsupported(constraints, group):
        reject("not-supported")
        return
    clamped = False
    lo_want = float(d_min.value) if d_min is not None else default[0]  # type: ignore[arg-type]
    hi_want = float(d_max.value) if d_max is not None else default[1]  # type: ignore[arg-type]
    lo = _snap(lo_want, allowed, down=False)  # the minimum snaps up, the maximum down: never outside the ask
    hi = _snap(hi_want, allowed, down=True)
    if lo is None or hi is None:
        if not clamp:
            reject("out-of-range")
            return
        lo = allowed[-1] if lo is None else lo
        hi = allowed[0] if hi is None else hi
        clamped = True
    if lo > hi:
        reject("out-of-range")
        return
    policy = capped(lo, hi)
    if policy is not None:
        for prop in present:
            statuses[prop] = Status("overridden", _tag(policy.policy))
        return
    target = Target(group, (lo, hi), "desired", clamped=clamped)
    add_target(target)
    status = Status("applied" if in_force(target) else "pending", "clamped" if clamped else "")
    for prop in present:
        statuses[prop] = status


def _plan_power(
    desired: Mapping[str, DesiredValue],
    observed: Mapping[str, Value],
    constraints: Constraints,
    limits: list[PolicyLimit],
    clamp: bool,
    restore: set[str],
    statuses: dict[str, Status],
    add_target: Callable[[Target], None],
    restored: set[str],
) -> None:
    prop = "power_limit"
    d = desired.get(prop)
    lo, hi, default = constraints.power_limit_min_w, constraints.power_limit_max_w, constraints.power_limit_default_w
    if group_unsupported(constraints, prop):
        if d is not None:
            statuses[prop] = Status("rejected", "not-supported")
        if prop in restore:
            restored.add(prop)
        return
    status: Status | None = None
    base: float | None = None  # what the desired value asks for (clamped when allowed), or None
    clamped = False
    if d is not None:
        if not d.valid or isinstance(d.value, str | bool) or d.value is None:
            status = Status("rejected", d.reason or "wrong-type")
        else:
            watts = float(d.value)
            low_ok = lo is None or watts >= lo - POWER_TOLERANCE_W
            high_ok = hi is None or watts <= hi + POWER_TOLERANCE_W
            if low_ok and high_ok:
                base = watts
            elif clamp:
                base = lo if not low_ok else hi
                clamped = True
            else:
                status = Status("rejected", "out-of-range")
    # The reference a policy cap must be below to bind. Without a usable desired value it is the default; while
    # the desired value is rejected it is what the GPU has now, so a bad value leaves the GPU unchanged.
    reference: float | None = base
    if reference is None:
        now = observed.get(prop)
        if status is not None and isinstance(now, int | float) and not isinstance(now, bool):
            reference = float(now)
        else:
            reference = default if default is not None else hi
    policy, effective = "", reference
    caps = sorted(
        (lim.power_limit_w, lim.policy)
        for lim in limits
        if lim.power_limit_w is not None and _finite(lim.power_limit_w)
    )
    if caps:
        cap, name = caps[0]
        if lo is not None:
            cap = max(cap, lo)  # a cap below what the GPU accepts is the lowest it accepts
        if hi is not None:
            cap = min(cap, hi)
        if reference is None or cap < reference - POWER_TOLERANCE_W:
            policy, effective = name, cap
    if status is not None:
        statuses[prop] = status
    if not policy and base is None:
        # No desired value in force and no binding policy: only a removal moves the GPU (back to default).
        if d is None and prop in restore:
            if default is None:
                restored.add(prop)
                return
            target = Target(prop, (float(default),), "default")
            add_target(target)
            if _same(prop, (observed.get(prop),), target.value):
                restored.add(prop)
        return
    assert effective is not None
    target = Target(prop, (float(effective),), "policy" if policy else "desired", policy=policy, clamped=clamped)
    add_target(target)
    if status is None and d is not None:
        if policy:
            statuses[prop] = Status("overridden", _tag(policy))
        else:
            in_force = _same(prop, (observed.get(prop),), target.value)
            statuses[prop] = Status("applied" if in_force else "pending", "clamped" if clamped else "")


def _plan_clock_cap(
    d_min: DesiredValue | None,
    d_max: DesiredValue | None,
    constraints: Constraints,
    limits: list[PolicyLimit],
    clamp: bool,
    statuses: dict[str, Status],
    add_target: Callable[[Target], None],
) -> bool:
    """A policy's SM clock cap (``PolicyLimit.clock_max_mhz``, the clocks actuator) on the locked GPU clocks: the
    upper lock is the cap (the highest supported clock at or below it), below what the cloud asked for or, with
    nothing asked, below the GPU's maximum; the lower lock stays (at most the cap). True when the cap binds."""
    caps = sorted((lim.clock_max_mhz, lim.policy) for lim in limits if lim.clock_max_mhz)
    allowed = constraints.graphics_clocks_mhz
    if not caps or not allowed or group_unsupported(constraints, "locked_gpu_clocks"):
        return False
    cap_mhz, policy = caps[0]
    hi_cap = max((c for c in allowed if c <= cap_mhz), default=min(allowed))
    base: Target | None = None
    if d_min is not None or d_max is not None:
        checked = _check_clocks("locked_gpu_clocks", d_min, d_max, allowed, constraints, clamp)
        if isinstance(checked, Target):
            base = checked
        else:
            statuses.update(checked)
    lo, hi = (int(base.value[0]), int(base.value[1])) if base is not None and base.value != (0, 0) else (0, 0)
    if hi == 0:
        lo, hi = min(allowed), max(allowed)
    if hi_cap >= hi:
        return False
    add_target(Target("locked_gpu_clocks", (min(lo, hi_cap), hi_cap), "policy", policy=policy))
    if base is not None:
        for d in (d_min, d_max):
            if d is not None:
                statuses[d.prop] = Status("overridden", _tag(policy))
    return True


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value) and value > 0


def _check_clocks(
    group: str,
    d_min: DesiredValue | None,
    d_max: DesiredValue | None,
    allowed: tuple[int, ...],
    constraints: Constraints,
    clamp: bool,
) -> Target | dict[str, Status]:
    """Validate a desired clock pair: the target, or the rejection status of each side that has a value."""
    present = {d.prop: d for d in (d_min, d_max) if d is not None}

    def rejected(reason: str) -> dict[str, Status]:
        return {prop: Status("rejected", reason) for prop in present}

    bad = {prop: d.reason or "wrong-type" for prop, d in present.items() if not d.valid}
    if bad:  # a bad side carries its own reason; the other side cannot apply alone and shows the same
        first = next(iter(bad.values()))
        return {prop: Status("rejected", bad.get(prop, first)) for prop in present}
    if group_unsupported(constraints, group):
        return rejected("not-supported")
    lo_v = None if d_min is None else int(d_min.value)  # type: ignore[arg-type]
    hi_v = None if d_max is None else int(d_max.value)  # type: ignore[arg-type]
    # Only one side given: 0 unlocks; otherwise the other side is the widest the GPU allows.
    if lo_v is None or hi_v is None:
        given = lo_v if lo_v is not None else hi_v
        if given == 0:
            lo_v = hi_v = 0
        elif not allowed:
            return rejected("unpaired")
        elif lo_v is None:
            lo_v = min(allowed)
        else:
            hi_v = max(allowed)
    assert lo_v is not None and hi_v is not None
    if (lo_v == 0) != (hi_v == 0):
        return rejected("unpaired")
    if lo_v == 0:
        return Target(group, (0, 0), "desired")
    if lo_v > hi_v:
        return rejected("out-of-range")
    clamped = False
    if allowed:
        fixed: list[int] = []
        for v in (lo_v, hi_v):
            if v in allowed:
                fixed.append(v)
                continue
            if not clamp:
                outside = v < min(allowed) or v > max(allowed)
                return rejected("out-of-range" if outside else "not-supported-clock")
            fixed.append(_nearest(v, allowed))
            clamped = True
        lo_v, hi_v = fixed
    return Target(group, (lo_v, hi_v), "desired", clamped=clamped)


# --------------------------------------------------------------------------------------------------
# Twins and acks: pure
# --------------------------------------------------------------------------------------------------


def desired_status_twin(statuses: Mapping[str, Status]) -> str:
    """One twin value for every writable property with a status, by group in catalog order:
    ``power_limit:applied,locked_gpu_clocks:rejected-out-of-range``; ``none`` when nothing is desired.

    A clock pair shows its min side's status (both sides share it but for a bad side's own reason).
    Always within ``[a-zA-Z0-9-_.,:/@#]{1,512}``: reasons and policy names are sanitised and at most 32 chars.
    """
    if not statuses:
        return "none"
    parts: list[str] = []
    for group, props in GROUPS.items():
        status = next((statuses[p] for p in props if p in statuses), None)
        if status is not None:
            parts.append(f"{group}:{_REASON_UNSAFE.sub('_', status.text)[:64]}")
    value = ",".join(parts) or "none"
    while len(value) > 512:  # cannot happen with 5 groups of bounded length; kept as a guarantee
        value = value.rsplit(",", 1)[0]
    assert TWIN_VALUE_RE.fullmatch(value), value
    return value


#: The ``desired_status`` part that says the latest version of the Device's configuration was refused (a devices
#: file that does not parse, a Device that does not convert or validate): ``config:refused-<reason>``. The values
#: the other parts speak of are the previous, valid version's.
CONFIG_PART = "config"


def with_config_error(twin: str, reason: str) -> str:
    """``twin`` (a ``desired_status_twin`` value) with ``config:refused-<reason>`` after it when ``reason`` is
    given; ``twin`` unchanged when it is not, or when ``twin`` is "" (no step has made one yet)."""
    if not reason or not twin:
        return twin
    part = f"{CONFIG_PART}:refused-{_REASON_UNSAFE.sub('_', reason)[:48]}"
    value = part if twin == "none" else f"{twin},{part}"
    assert TWIN_VALUE_RE.fullmatch(value), value
    return value


def parse_desired_status(text: str) -> dict[str, str]:
    """Inverse of ``desired_status_twin`` (and ``with_config_error``): ``{group: status text}``, ``config`` among
    them when the configuration was refused. Raises ``ValueError`` on a malformed value."""
    if text == "none":
        return {}
    out: dict[str, str] = {}
    for part in text.split(","):
        group, sep, status = part.partition(":")
        if not sep or (group not in GROUPS and group != CONFIG_PART) or not status:
            raise ValueError(f"desired_status part {part!r} is not <group>:<status>")
        out[group] = status
    return out


@dataclass(frozen=True)
class Ack:
    """A status change of one property, published as JSON on ``gpu-mapper/{node}/{device}/desired/ack``."""

    uuid: str
    property: str
    desired: Value | None
    source: str
    version_ms: int | None
    result: Result
    reason: str
    #: Wall time (ms) the value was seen in force; None unless result is applied or overridden.
    applied_at_ms: int | None
    effective_value: str
    reported_value: str
    ts_ms: int
    #: What the GPU accepts, for a value it rejected as out of range or unknown (``allowed_values``): for the
    #: log line, not part of the published ack.
    allowed: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "uuid": self.uuid,
            "property": self.property,
            "desired": self.desired,
            "source": self.source,
            "version_ms": self.version_ms,
            "result": self.result,
            "reason": self.reason,
            "applied_at_ms": self.applied_at_ms,
            "effective_value": self.effective_value,
            "reported_value": self.reported_value,
            "ts_ms": self.ts_ms,
        }


#: Rejections that are about the value itself: their log line says what the GPU accepts.
_VALUE_REASONS = frozenset({"out-of-range", "not-supported-clock", "unknown-value", "clamped"})


def allowed_values(prop: str, constraints: Constraints | None) -> str:
    """What ``prop`` may be set to on a GPU of ``constraints``, for people: ``100-700 W``, ``one of 81 clocks in
    210-1980 MHz``, ``0 (MAXN), 1 (MODE_15W)``; "" when not known."""
    if prop in ("persistence_mode",):
        return "true or false"
    if prop == "compute_mode":
        return ", ".join(COMPUTE_MODES)
    if constraints is None:
        return ""
    if prop == "power_limit":
        lo, hi = constraints.power_limit_min_w, constraints.power_limit_max_w
        return f"{lo:g}-{hi:g} W" if lo is not None and hi is not None else ""
    if prop == "power_mode":
        return ", ".join(f"{mode} ({name})" for mode, name in constraints.power_modes)
    clocks: tuple[float, ...] = ()
    if prop.startswith("locked_gpu_clock_"):
        clocks = tuple(constraints.graphics_clocks_mhz)
    elif prop.startswith("locked_memory_clock_"):
        clocks = tuple(constraints.memory_clocks_mhz)
    elif prop in ("gpu_min_freq", "gpu_max_freq"):
        clocks = tuple(constraints.gpu_freqs_mhz)
    if not clocks:
        return ""
    lo_c, hi_c = min(clocks), max(clocks)
    if len(clocks) == 1:
        return f"{lo_c:g} MHz"
    return f"one of {len(clocks)} clocks in {lo_c:g}-{hi_c:g} MHz"


def deferred_ack(uuid: str, prop: str, raw: Value, source: str, version_ms: int, now_ms: int) -> Ack:
    """The ack of a desired value that waits for its device's inbound rate (``mapper.edge.kubeedge.doorlimit``):
    ``pending``, reason ``deferred``. Its ``applied`` (or ``rejected``) ack follows once it is applied, unless a
    newer value for the property supersedes it while it waits (then that one's does)."""
    return Ack(
        uuid=uuid,
        property=prop,
        desired=_json_scalar(raw),
        source=source,
        version_ms=version_ms,
        result="pending",
        reason="deferred",
        applied_at_ms=None,
        effective_value="",
        reported_value="",
        ts_ms=now_ms,
    )


# --------------------------------------------------------------------------------------------------
# The enforcement step
# --------------------------------------------------------------------------------------------------


@dataclass
class ReconcileCounters:
    """Cumulative counts since the reconciler was built (for Prometheus counters)."""

    #: By (group, outcome); outcome: ok, transient, rejected, not-supported, no-permission, readback-mismatch.
    actions: dict[tuple[str, str], int] = field(default_factory=dict)
    #: Re-applications of a target that had been verified in force, by group.
    drift_reapplies: dict[str, int] = field(default_factory=dict)
    #: Transitions into ``rejected-<reason>``, by reason.
    rejections: dict[str, int] = field(default_factory=dict)

    def copy(self) -> ReconcileCounters:
        return ReconcileCounters(dict(self.actions), dict(self.drift_reapplies), dict(self.rejections))


@dataclass(frozen=True)
class ActionOutcome:
    action: Action
    #: ok, transient, rejected, not-supported, no-permission, readback-mismatch.
    outcome: str
    error: str = ""
    drift: bool = False


@dataclass(frozen=True)
class ReconcileResult:
    uuid: str
    #: By property: every writable property with a desired value, and those being returned to default.
    statuses: Mapping[str, Status]
    actions: tuple[ActionOutcome, ...]
    acks: tuple[Ack, ...]
    counters: ReconcileCounters
    targets: Mapping[str, Target]
    #: Properties whose removal is complete (default in force): call ``DesiredState.mark_restored`` on each.
    restored: frozenset[str]
    #: The values seen on the GPU after this step (sample plus read-back).
    observed: Mapping[str, Value]

    @property
    def desired_status(self) -> str:
        return desired_status_twin(self.statuses)


#: What ``plan`` returns when there is nothing to enforce (``Reconciler._idle``).
_IDLE_PLAN = Plan(actions=(), statuses=MappingProxyType({}), targets=MappingProxyType({}))


@dataclass
class _GroupState:
    target: tuple[Value, ...]
    failures: int = 0
    next_try_s: float = 0.0
    status: Status | None = None


class Reconciler:
    """Level-triggered enforcement of one GPU's desired state. Not thread-safe: one ``step`` at a time.

    ``step`` is synchronous and blocking (NVML): run it through ``asyncio.to_thread`` once per collect cycle.
    """

    def __init__(
        self,
        backend: GpuBackend,
        uuid: str,
        *,
        clock: Clock,
        clamp: bool = False,
        backoff_min_s: float = 1.0,
        backoff_max_s: float = 60.0,
        unsupported_retry_s: float = 3600.0,
        no_permission_retry_s: float = 600.0,
        restore_modes: bool = False,
    ) -> None:
        if not uuid:
            raise ValueError("Reconciler needs the GPU's UUID")
        for name, value in (
            ("backoff_min_s", backoff_min_s),
            ("backoff_max_s", backoff_max_s),
            ("unsupported_retry_s", unsupported_retry_s),
            ("no_permission_retry_s", no_permission_retry_s),
        ):
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"Reconciler {name} must be a positive number of seconds, not {value!r}")
        if backoff_max_s < backoff_min_s:
            raise ValueError(f"Reconciler backoff_max_s ({backoff_max_s}) is below backoff_min_s ({backoff_min_s})")
        self.backend = backend
        self.uuid = uuid
        self.clock = clock
        self.clamp = clamp
        self.backoff_min_s = backoff_min_s
        self.backoff_max_s = backoff_max_s
        self.unsupported_retry_s = unsupported_retry_s
        self.no_permission_retry_s = no_permission_retry_s
        self.restore_modes = restore_modes
        self.counters = ReconcileCounters()
        self._constraints: Constraints | None = None
        self._groups: dict[str, _GroupState] = {}
        #: Target last verified in force, by group (a later mismatch with the same target is drift).
        self._verified: dict[str, tuple[Value, ...]] = {}
        #: Groups this reconciler changed; when nothing targets them any more they return to default.
        self._managed: set[str] = set()
        #: Values this reconciler set, for properties NVML cannot read back (locked clocks on some backends).
        self._last_set: dict[str, Value] = {}
        #: The last ack key per property (status text, raw, version) to publish only changes.
        self._acked: dict[str, tuple[object, ...]] = {}
        #: The result of the last idle step, handed out again while idle steps see the same values dict: nothing
        #: an idle step reports can change until a step that is not idle (which drops it) or ``invalidate``.
        self._idle_cached: ReconcileResult | None = None

    # --- lifecycle -----------------------------------------------------------------------------------
    def invalidate(self) -> None:
        """Forget what this reconciler believes about the GPU (call it after a driver reload or GPU reset):
        constraints are re-read, values it set are no longer assumed, backoffs restart."""
        self._constraints = None
        self._last_set.clear()
        self._groups.clear()
        self._idle_cached = None

    def constraints(self) -> Constraints:
        """The GPU's constraints, read once and cached (re-read after ``invalidate``); unknown on error."""
        if self._constraints is None:
            try:
                self._constraints = self.backend.constraints(self.uuid)
            except MapperError:
                return Constraints()
        return self._constraints

    # --- the step ------------------------------------------------------------------------------------
    def would_act(
        self,
        desired: Mapping[str, DesiredValue],
        observed_sample: Sample | Mapping[str, Value] | None,
        limits: Iterable[PolicyLimit] = (),
        *,
        restore: Collection[str] = (),
    ) -> bool:
        """True when ``step`` with these inputs could call the GPU: constraints not read yet, or the plan
        has actions. When False, ``step`` is pure bookkeeping and may run on the event loop."""
        planned = self.prepare(desired, observed_sample, limits, restore=restore)
        return planned is None or bool(planned.actions)

    def prepare(
        self,
        desired: Mapping[str, DesiredValue],
        observed_sample: Sample | Mapping[str, Value] | None,
        limits: Iterable[PolicyLimit] = (),
        *,
        restore: Collection[str] = (),
    ) -> Plan | None:
        """The plan ``step`` starts from with these inputs (hand it to ``step`` as ``planned`` so it is not made
        twice), or None while the constraints are unknown (``step`` must read them: a GPU call). Without
        actions, ``step`` is pure bookkeeping and may run on the event loop."""
        if self._constraints is None:
            return None
        limits = list(limits)
        if self._idle(desired, limits, restore):
            return _IDLE_PLAN
        return plan(
            desired,
            self._observed(observed_sample),
            self._constraints,
            limits,
            clamp=self.clamp,
            restore=set(restore) | self._released(desired),
            restore_modes=self.restore_modes,
        )

    def step(
        self,
        desired: Mapping[str, DesiredValue],
        observed_sample: Sample | Mapping[str, Value] | None,
        limits: Iterable[PolicyLimit] = (),
        *,
        restore: Collection[str] = (),
        constraints: Constraints | None = None,
        planned: Plan | None = None,
    ) -> ReconcileResult:
        """Plan, apply, read back, compare. ``restore``: ``DesiredState.pending_restore()``. ``planned``: what
        ``prepare`` returned for the same inputs just before (saves making the first plan again)."""
        limits = list(limits)
        if constraints is None and self._constraints is not None and self._idle(desired, limits, restore):
            return self._idle_result(observed_sample)
        self._idle_cached = None  # this step may count actions, set values or keep books an idle result shows
        now_s = self.clock.monotonic()
        cons = constraints if constraints is not None else self.constraints()
        observed = self._observed(observed_sample)
        restore_set = set(restore) | self._released(desired)

        def plan_for(seen: Mapping[str, Value]) -> Plan:
            return plan(
                desired, seen, cons, limits, clamp=self.clamp, restore=restore_set, restore_modes=self.restore_modes
            )

        first = planned if planned is not None and constraints is None else plan_for(observed)
        # Targets that changed (or vanished) reset their backoff state.
        for group in list(self._groups):
            target = first.targets.get(group)
            if target is None or target.value != self._groups[group].target:
                del self._groups[group]

        outcomes: list[ActionOutcome] = []
        applied_any = False
        for action in first.actions:
            target = first.targets[action.group]
            state = self._groups.get(action.group)
            if state is not None and now_s < state.next_try_s:
                continue
            # Drift: a target verified in force no longer is. Counted once per episode, when first re-applied.
            drift = self._verified.pop(action.group, None) == target.value
            if drift:
                self.counters.drift_reapplies[action.group] = self.counters.drift_reapplies.get(action.group, 0) + 1
            outcome = self._apply(action, target, now_s)
            if outcome.outcome == "ok":
                applied_any = True
            outcomes.append(ActionOutcome(action, outcome.outcome, outcome.error, drift))

        # Nothing applied: the GPU reads as before, so the plan is the one already made (plan is pure).
        final = first
        if applied_any:
            observed = self._read_back(observed, [o for o in outcomes if o.outcome == "ok"])
            final = plan_for(observed)
        # A setter that said yes but the GPU reads otherwise: back off as for a transient error.
        pending_groups = {a.group for a in final.actions}
        for i, out in enumerate(outcomes):
            if out.outcome == "ok" and out.action.group in pending_groups:
                target = final.targets[out.action.group]
                self._fail(out.action.group, target.value, Status("pending"), now_s, self._backoff_s(out.action.group))
                outcomes[i] = ActionOutcome(out.action, "readback-mismatch", "the GPU reads another value", out.drift)
                self._count(out.action.group, "readback-mismatch")

        statuses = dict(final.statuses)
        for group in [g for g in self._verified if g not in final.targets]:
            del self._verified[group]
        for group, target in final.targets.items():
            state = self._groups.get(group)
            if group not in pending_groups:
                self._verified[group] = target.value
                self._groups.pop(group, None)
                if target.origin == "default":
                    self._managed.discard(group)
                else:
                    self._managed.add(group)
                continue
            self._verified.pop(group, None)
            for prop in GROUPS[group]:
                restoring = target.origin == "default" and prop in restore_set
                if prop in statuses or restoring:
                    statuses[prop] = (
                        state.status
                        if state is not None and state.status is not None
                        else (statuses.get(prop, Status("pending")))
                    )
        acks = self._acks(desired, statuses, final, observed, final.restored)
        return ReconcileResult(
            uuid=self.uuid,
            statuses=statuses,
            actions=tuple(outcomes),
            acks=tuple(acks),
            counters=self.counters.copy(),
            targets=final.targets,
            restored=final.restored,
            observed=observed,
        )

    # --- internals -----------------------------------------------------------------------------------
    def _idle(
        self, desired: Mapping[str, DesiredValue], limits: Collection[PolicyLimit], restore: Collection[str]
    ) -> bool:
        """Nothing to enforce and nothing left over: no desired value, no policy cap, nothing to restore, and this
        reconciler holds no state from earlier steps (no group it manages, verified or is backing off, no ack it
        must follow up). ``plan`` would return an empty plan and ``step`` an empty result, so both are skipped:
        the common case of a GPU that is only watched costs next to nothing per cycle. (Values it set earlier
        still fill in what NVML cannot read back: see ``_idle_result``.)"""
        return (
            not desired
            and not restore
            and not limits
            and not self._managed
            and not self._groups
            and not self._verified
            and not self._acked
        )

    def _idle_result(self, observed_sample: Sample | Mapping[str, Value] | None) -> ReconcileResult:
        """What an idle step returns: no statuses, actions or acks, the counters, and the values it was given
        (with what this reconciler set filled in). The GPU loop hands in the same values dict every cycle, so
        the result made for it is kept and returned again (counters and ``_last_set`` only change in a step
        that is not idle, which drops it): no copy of the counters and no new result per GPU per cycle."""
        observed: Mapping[str, Value]
        if self._last_set:
            observed = self._observed(observed_sample)
        elif isinstance(observed_sample, Sample):
            if observed_sample.uuid != self.uuid:
                raise ValueError(f"Reconciler of GPU {self.uuid} was given a sample of GPU {observed_sample.uuid}")
            observed = observed_sample.values
            cached = self._idle_cached
            if cached is not None and cached.observed is observed:
                return cached
        else:
            observed = observed_sample or {}
        result = self._idle_cached = ReconcileResult(
            uuid=self.uuid,
            statuses={},
            actions=(),
            acks=(),
            counters=self.counters.copy(),
            targets={},
            restored=frozenset(),
            observed=observed,
        )
        return result

    def _observed(self, sample: Sample | Mapping[str, Value] | None) -> dict[str, Value]:
        values: Mapping[str, Value]
        if sample is None:
            values = {}
        elif isinstance(sample, Sample):
            if sample.uuid != self.uuid:
                raise ValueError(f"Reconciler of GPU {self.uuid} was given a sample of GPU {sample.uuid}")
            values = sample.values
        else:
            values = sample
        merged = dict(self._last_set)
        merged.update(values)
        return merged

    def _released(self, desired: Mapping[str, DesiredValue]) -> set[str]:
        """Properties of groups this reconciler changed that no desired value targets now; ``plan`` returns them
        to default unless a policy still caps them (desired removed, or a policy's cap lifted)."""
        out: set[str] = set()
        for group in self._managed:
            props = GROUPS[group]
            if not any(p in desired for p in props):
                out.update(props)
        return out

    def _backoff_s(self, group: str) -> float:
        state = self._groups.get(group)
        failures = 1 if state is None else state.failures + 1
        return float(min(self.backoff_max_s, self.backoff_min_s * (2 ** (failures - 1))))

    def _fail(self, group: str, target: tuple[Value, ...], status: Status, now_s: float, delay_s: float) -> None:
        state = self._groups.get(group)
        if state is None or state.target != target:
            state = _GroupState(target)
            self._groups[group] = state
        state.failures += 1
        state.next_try_s = now_s + delay_s
        state.status = status

    def _count(self, group: str, outcome: str) -> None:
        key = (group, outcome)
        self.counters.actions[key] = self.counters.actions.get(key, 0) + 1

    def _apply(self, action: Action, target: Target, now_s: float) -> ActionOutcome:
        group = action.group
        try:
            self._call(action)
        except TransientError as exc:
            delay = min(self.backoff_max_s, max(self._backoff_s(group), exc.retry_after_s))
            self._fail(group, target.value, Status("pending"), now_s, delay)
            self._count(group, "transient")
            return ActionOutcome(action, "transient", str(exc))
        except UnsupportedError as exc:
            self._fail(group, target.value, Status("rejected", "not-supported"), now_s, self.unsupported_retry_s)
            self._count(group, "not-supported")
            return ActionOutcome(action, "not-supported", str(exc))
        except NoPermissionError as exc:
            self._fail(group, target.value, Status("rejected", "no-permission"), now_s, self.no_permission_retry_s)
            self._count(group, "no-permission")
            return ActionOutcome(action, "no-permission", str(exc))
        except InvalidValueError as exc:
            reason = _reason(exc.reason) if exc.reason != "invalid" else "out-of-range"
            self._fail(group, target.value, Status("rejected", reason), now_s, self.unsupported_retry_s)
            self._count(group, "rejected")
            return ActionOutcome(action, "rejected", str(exc))
        except ReadBackMismatchError as exc:  # the setter said yes, the GPU says no: pending, backed off
            self._fail(group, target.value, Status("pending"), now_s, self._backoff_s(group))
            self._count(group, "readback-mismatch")
            return ActionOutcome(action, "readback-mismatch", str(exc))
        except PermanentError as exc:
            self._fail(group, target.value, Status("rejected", _reason(exc.reason)), now_s, self.unsupported_retry_s)
            self._count(group, "rejected")
            return ActionOutcome(action, "rejected", str(exc))
        self._count(group, "ok")
        return ActionOutcome(action, "ok")

    def _call(self, action: Action) -> None:
        uuid, group, value = self.uuid, action.group, action.value
        if group == "power_limit":
            readback = self.backend.set_power_limit(uuid, float(value[0]))
            self._last_set["power_limit"] = float(readback) if readback is not None else float(value[0])
        elif group == "locked_gpu_clocks":
            if action.op == "reset":
                self.backend.reset_locked_gpu_clocks(uuid)
            else:
                self.backend.set_locked_gpu_clocks(uuid, int(value[0]), int(value[1]))
            self._remember_clocks(group, value)
        elif group == "locked_memory_clocks":
            if action.op == "reset":
                self.backend.reset_locked_memory_clocks(uuid)
            else:
                self.backend.set_locked_memory_clocks(uuid, int(value[0]), int(value[1]))
            self._remember_clocks(group, value)
        elif group == "persistence_mode":
            self.backend.set_persistence_mode(uuid, bool(value[0]))
            self._last_set["persistence_mode"] = bool(value[0])
        elif group == "compute_mode":
            self.backend.set_compute_mode(uuid, str(value[0]))
            self._last_set["compute_mode"] = str(value[0])
        elif group == "gpu_freq_range":
            lo, hi = _actuator(self.backend, "set_gpu_freq_range", uuid)(uuid, float(value[0]), float(value[1]))
            self._last_set["gpu_min_freq"], self._last_set["gpu_max_freq"] = float(lo), float(hi)
        elif group == "power_mode":
            _actuator(self.backend, "set_power_mode", uuid)(uuid, int(value[0]))
            self._last_set["power_mode"] = int(value[0])
            self._constraints = None  # the mode's devfreq range (a removed range's default) changed with it
        else:  # pragma: no cover - plan only emits the groups above
            raise ValueError(f"unknown action group {group!r}")

    def _remember_clocks(self, group: str, value: tuple[Value, ...]) -> None:
        lo, hi = (value[0], value[1]) if value else (0, 0)
        min_prop, max_prop = GROUPS[group]
        self._last_set[min_prop] = int(lo)
        self._last_set[max_prop] = int(hi)

    def _read_back(self, observed: dict[str, Value], applied: list[ActionOutcome]) -> dict[str, Value]:
        props = [p for out in applied for p in _READ_BACK.get(out.action.group, GROUPS[out.action.group])]
        merged = dict(observed)
        for prop in props:  # the setter's word first, the GPU's reading (when there is one) over it
            if prop in self._last_set:
                merged[prop] = self._last_set[prop]
        try:
            sample = self.backend.sample(self.uuid, props)
        except MapperError:
            return merged
        merged.update({k: v for k, v in sample.values.items() if k in props})
        return merged

    def _acks(
        self,
        desired: Mapping[str, DesiredValue],
        statuses: Mapping[str, Status],
        final: Plan,
        observed: Mapping[str, Value],
        restored: frozenset[str],
    ) -> list[Ack]:
        acks: list[Ack] = []
        now_ms = self.clock.wall_ms()
        for prop in _WRITABLE_IN_ORDER:
            d = desired.get(prop)
            status = statuses.get(prop)
            target = final.targets.get(_GROUP_OF[prop])
            previous = self._acked.get(prop)
            if status is None and d is None:
                if prop in restored:
                    restored_default = target is not None and target.origin == "default"
                    status = Status("applied", "default-restored" if restored_default else "released")
                elif previous is not None and previous[1] not in _TERMINAL:
                    status = Status("applied", "released")  # removed; nothing to restore (modes left as they are)
                else:
                    self._acked.pop(prop, None)
                    continue
            if status is None:  # a desired value the plan does not manage (cannot happen for writable ones)
                continue
            key: tuple[object, ...] = (status.text, status.reason, None if d is None else (d.raw, d.version_ms))
            if previous == key:
                continue
            self._acked[prop] = key
            if status.result == "rejected" and d is not None:
                self.counters.rejections[status.reason] = self.counters.rejections.get(status.reason, 0) + 1
            reported = observed.get(prop)
            spec = PROPERTY_BY_NAME[prop]
            allowed = allowed_values(prop, self._constraints) if status.reason in _VALUE_REASONS else ""
            acks.append(
                Ack(
                    uuid=self.uuid,
                    property=prop,
                    desired=None if d is None else _json_scalar(d.raw),
                    source="" if d is None else d.source,
                    version_ms=None if d is None else d.version_ms,
                    result=status.result,
                    reason=status.reason,
                    applied_at_ms=now_ms if status.result in ("applied", "overridden") else None,
                    effective_value="" if target is None else _fmt(target.value_of(prop)),
                    reported_value="" if reported is None else format_value(spec, reported),
                    ts_ms=now_ms,
                    allowed=allowed,
                )
            )
        return acks


def _actuator(backend: GpuBackend, name: str, uuid: str) -> Callable[..., Any]:
    """The backend's ``FrequencyActuator`` method ``name``; ``UnsupportedError`` where it offers none (NVML)."""
    method = getattr(backend, name, None)
    if method is None:
        raise UnsupportedError(f"GPU {uuid}: its backend cannot {name.removeprefix('set_').replace('_', ' ')}")
    return method


def _json_scalar(raw: Value) -> Value | None:
    if isinstance(raw, float) and not math.isfinite(raw):
        return str(raw)
    if isinstance(raw, str) and len(raw) > 512:
        return raw[:512]
    return raw
