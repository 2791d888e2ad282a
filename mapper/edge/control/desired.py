"""Desired GPU state of one device, merged across its sources. Pure: no I/O, no clock of its own.

Sources (``Source``):

* ``cloud``: ``spec.properties[].desired.value`` from DMI (RegisterDevice / UpdateDevice / the register reply).
  Its version is the time (ms) the mapper received a *changed* value; an unchanged value re-sent by EdgeCore is
  not a change and keeps its old version.
* ``edge``: EventBus twin deltas from edge applications; their version is the delta's own timestamp (ms).
* ``file``: the standalone YAML files; behaves exactly like ``cloud`` (used where there is no EdgeCore).

Local policies are not a source here: they cap the power limit through ``mapper.shared.model.PolicyLimit`` in the
reconciler, and may only tighten.

Rules (see docs/desired-state.md):

* Per property, the newest change wins across sources. A change older than the newest change already seen for
  that property (from any source, removals included) is *stale*: ignored and counted. Equal versions are
  accepted (the later arrival wins).
* Setting the value a source already holds is not a change (no new version, nothing returned).
* A removal clears only that source's value. The property keeps the newest value still set by another source;
  if none is left, the property has no desired value and is marked for *restore*: the reconciler returns the
  GPU to its default and the caller then calls ``mark_restored``.
* A bad raw value never raises: it is kept with its rejection reason (``DesiredValue.reason``) so the status
  can say ``rejected-<reason>``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from mapper.errors import InvalidValueError
from mapper.shared.model import (
    COMPUTE_MODES,
    PROPERTY_BY_NAME,
    Scalar,
    Value,
    parse_value,
    twin_safe,
)

Source = Literal["cloud", "edge", "file"]
SOURCES: tuple[Source, ...] = ("cloud", "edge", "file")

#: Version of the plain-dict form produced by ``DesiredState.to_dict``.
DICT_FORMAT = 1


@dataclass(frozen=True)
class DesiredValue:
    """One property's desired value as received, parsed once.

    ``value`` is the parsed value (catalog type) or None when ``raw`` was refused; ``reason`` then holds one of
    ``mapper.shared.model.REJECT_REASONS`` and ``message`` says what was wrong.
    """

    prop: str
    raw: Scalar
    source: Source
    version_ms: int
    value: Value | None = None
    reason: str = ""
    message: str = ""

    @property
    def valid(self) -> bool:
        return self.value is not None and not self.reason


def make_desired(prop: str, raw: Scalar, source: Source, version_ms: int) -> DesiredValue:
    """Parse ``raw`` for ``prop``; a refused value comes back with ``reason`` set, never as an exception."""
    spec = PROPERTY_BY_NAME.get(prop)
    if spec is None:
        return DesiredValue(
            prop, raw, source, version_ms, reason="unknown-property", message=f"{prop!r} is not a GPU property"
        )
    if not spec.writable:
        return DesiredValue(prop, raw, source, version_ms, reason="read-only", message=f"{prop} is read-only")
    try:
        value = parse_value(spec, raw)
    except InvalidValueError as exc:
        return DesiredValue(prop, raw, source, version_ms, reason=exc.reason, message=str(exc))
    if prop == "compute_mode":
        mode = str(value).lower().replace("-", "_")
        if mode not in COMPUTE_MODES:
            return DesiredValue(
                prop,
                raw,
                source,
                version_ms,
                reason="unknown-value",
                message=f"compute_mode {str(value)[:40]!r} is not one of {', '.join(COMPUTE_MODES)}",
            )
        value = mode
    return DesiredValue(prop, raw, source, version_ms, value=value)


def observed_desired_value(desired: DesiredValue | None) -> str:
    """The ``observedDesired`` twin value: what was received, made twin-safe ("" when nothing is desired)."""
    if desired is None:
        return ""
    raw = desired.raw
    if isinstance(raw, bool):
        return "true" if raw else "false"
    if isinstance(raw, float) and raw.is_integer():
        return str(int(raw))
    text = str(raw)
    if not text.strip():
        return ""
    return twin_safe(text)


@dataclass(frozen=True)
class Change:
    """What a ``set``/``remove`` did to the *effective* desired value of a property."""

    prop: str
    source: Source
    version_ms: int
    before: DesiredValue | None
    after: DesiredValue | None

    @property
    def removed(self) -> bool:
        return self.after is None


@dataclass
class _Slot:
    """One source's latest word on one property: a value, or a removal (``desired is None``)."""

    version_ms: int
    desired: DesiredValue | None
    #: Arrival order within the state: breaks ties between equal versions (the later arrival wins).
    seq: int = 0


@dataclass
class DesiredState:
    """The desired state of one device (one GPU): every source's latest value per property."""

    #: Changes ignored because they were older than the newest one seen, by source.
    stale_ignored: dict[str, int] = field(default_factory=dict)
    _slots: dict[str, dict[Source, _Slot]] = field(default_factory=dict)
    _restore: set[str] = field(default_factory=set)
    _seq: int = 0

    # --- changes -----------------------------------------------------------------------------------
    def set(self, prop: str, raw: Scalar, source: Source, version_ms: int) -> Change | None:
        """Record ``raw`` from ``source``. Returns the change to the effective value, or None when nothing
        changed (the same value again, a stale change, or a value hidden by a newer one from another source)."""
        _check_source(source)
        slots = self._slots.setdefault(prop, {})
        current = slots.get(source)
        if current is not None and current.desired is not None and _same_raw(current.desired.raw, raw):
            return None
        if self._is_stale(prop, version_ms):
            self.stale_ignored[source] = self.stale_ignored.get(source, 0) + 1
            return None
        before = self.get(prop)
        slots[source] = _Slot(version_ms, make_desired(prop, raw, source, version_ms), self._next_seq())
        after = self.get(prop)
        self._restore.discard(prop)
        if after == before:
            return None
        return Change(prop, source, version_ms, before, after)

    def remove(self, prop: str, source: Source, version_ms: int) -> Change | None:
        """``source`` no longer sets ``prop``. Returns the change to the effective value, or None."""
        _check_source(source)
        slots = self._slots.get(prop)
        current = None if slots is None else slots.get(source)
        if slots is None or current is None or current.desired is None:
            return None
        if self._is_stale(prop, version_ms):
            self.stale_ignored[source] = self.stale_ignored.get(source, 0) + 1
            return None
        before = self.get(prop)
        slots[source] = _Slot(version_ms, None, self._next_seq())
        after = self.get(prop)
        if after is None:
            self._restore.add(prop)
        if after == before:
            return None
        return Change(prop, source, version_ms, before, after)

    def set_many(self, values: Mapping[str, Scalar], source: Source, version_ms: int) -> list[Change]:
        """Set several properties from one message (an EventBus delta carries only what changed)."""
        changes = [self.set(prop, raw, source, version_ms) for prop, raw in values.items()]
        return [c for c in changes if c is not None]

    def sync_source(self, source: Source, values: Mapping[str, Scalar], version_ms: int) -> list[Change]:
        """Make ``source``'s values equal to ``values`` (a full spec, e.g. a Device from DMI): set each one and
        remove the properties ``source`` had set that are absent now. Returns the effective changes."""
        changes: list[Change] = []
        for prop, raw in values.items():
            change = self.set(prop, raw, source, version_ms)
            if change is not None:
                changes.append(change)
        for prop, slots in list(self._slots.items()):
            slot = slots.get(source)
            if prop not in values and slot is not None and slot.desired is not None:
                change = self.remove(prop, source, version_ms)
                if change is not None:
                    changes.append(change)
        return changes

    def mark_restored(self, prop: str) -> None:
        """The reconciler has returned ``prop`` to its default: forget that it once had a desired value."""
        self._restore.discard(prop)

    # --- reading -----------------------------------------------------------------------------------
    def get(self, prop: str) -> DesiredValue | None:
        """The winning desired value of ``prop``: the newest one still set by any source."""
        best: _Slot | None = None
        for slot in self._slots.get(prop, {}).values():
            if slot.desired is not None and (best is None or (slot.version_ms, slot.seq) > (best.version_ms, best.seq)):
                best = slot
        return None if best is None else best.desired

    def effective(self) -> dict[str, DesiredValue]:
        """Every property that has a desired value, with the winning value."""
        out: dict[str, DesiredValue] = {}
        for prop in self._slots:
            winner = self.get(prop)
            if winner is not None:
                out[prop] = winner
        return out

    def pending_restore(self) -> frozenset[str]:
        """Properties whose desired value was removed by every source and whose default is not yet restored."""
        return frozenset(self._restore)

    def observed_desired_value(self, prop: str) -> str:
        return observed_desired_value(self.get(prop))

    def latest_version_ms(self, prop: str) -> int | None:
        versions = [s.version_ms for s in self._slots.get(prop, {}).values()]
        return max(versions) if versions else None

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _is_stale(self, prop: str, version_ms: int) -> bool:
        latest = self.latest_version_ms(prop)
        return latest is not None and version_ms < latest

    # --- plain dicts (for the store) ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A JSON-able plain dict; ``from_dict`` reads it back (bad values keep their reason)."""
        props: dict[str, dict[str, dict[str, Any]]] = {}
        for prop, slots in self._slots.items():
            props[prop] = {
                source: {
                    "version_ms": slot.version_ms,
                    "removed": slot.desired is None,
                    "raw": None if slot.desired is None else slot.desired.raw,
                    "seq": slot.seq,
                }
                for source, slot in slots.items()
            }
        return {
            "format": DICT_FORMAT,
            "properties": props,
            "restore": sorted(self._restore),
            "stale_ignored": dict(self.stale_ignored),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DesiredState:
        """Rebuild a state from ``to_dict`` output. Raises ``InvalidValueError`` naming what is malformed."""
        if data.get("format") != DICT_FORMAT:
            raise InvalidValueError(
                f"desired state: format {data.get('format')!r} is not {DICT_FORMAT}", reason="wrong-type"
            )
        state = cls()
        props = data.get("properties", {})
        if not isinstance(props, Mapping):
            raise InvalidValueError("desired state: 'properties' is not a mapping", reason="wrong-type")
        for prop, slots in props.items():
            if not isinstance(slots, Mapping):
                raise InvalidValueError(f"desired state: properties.{prop} is not a mapping", reason="wrong-type")
            for source, slot in slots.items():
                where = f"desired state: properties.{prop}.{source}"
                if source not in SOURCES:
                    raise InvalidValueError(f"{where}: unknown source", reason="unknown-value")
                if not isinstance(slot, Mapping) or not isinstance(slot.get("version_ms"), int):
                    raise InvalidValueError(f"{where}: needs an integer version_ms", reason="wrong-type")
                src = cast(Source, source)
                if slot.get("removed"):
                    desired = None
                else:
                    raw = slot.get("raw")
                    if not isinstance(raw, str | int | float | bool):
                        raise InvalidValueError(f"{where}: raw value {raw!r} is not a scalar", reason="wrong-type")
                    desired = make_desired(prop, raw, src, slot["version_ms"])
                seq = slot.get("seq", 0)
                if not isinstance(seq, int):
                    raise InvalidValueError(f"{where}: seq {seq!r} is not an integer", reason="wrong-type")
                state._slots.setdefault(prop, {})[src] = _Slot(slot["version_ms"], desired, seq)
                state._seq = max(state._seq, seq)
        restore = data.get("restore", [])
        if not isinstance(restore, list) or not all(isinstance(p, str) for p in restore):
            raise InvalidValueError("desired state: 'restore' is not a list of property names", reason="wrong-type")
        state._restore = set(restore)
        stale = data.get("stale_ignored", {})
        if isinstance(stale, Mapping):
            state.stale_ignored = {str(k): int(v) for k, v in stale.items()}
        return state

    @classmethod
    def from_values(cls, values: Mapping[str, Scalar], source: Source, version_ms: int) -> DesiredState:
        state = cls()
        state.sync_source(source, values, version_ms)
        return state


def _check_source(source: str) -> None:
    if source not in SOURCES:
        raise ValueError(f"desired source {source!r} is not one of {', '.join(SOURCES)}")


def _same_raw(a: Scalar, b: Scalar) -> bool:
    return type(a) is type(b) and a == b
