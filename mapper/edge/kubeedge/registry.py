"""The devices and models this mapper owns, whichever way they arrive (DMI, YAML files).

Pure bookkeeping: validates a Device against the catalog and the GPUs of this node, diffs specs, and tells
listeners what changed. EdgeCore <= 1.22 sends UpdateDevice on every status change with an unchanged spec:
``upsert_device`` returns ``unchanged`` for those and notifies nobody, so no GPU is touched and no loop restarts.

**Bad input never changes a GPU.** A Device whose new version is refused (it does not parse, convert or validate)
keeps the version it had: ``sync`` removes only what is absent from input that was read whole, never a Device
named in ``keep`` (the Devices of a file that failed to parse, a Device EdgeCore sent that did not convert).
``ConfigErrors`` keeps what stands refused now (for ``/status``, the ``desired_status`` twin of each Device it
names) and counts the refusals (``gpu_mapper_config_errors_total{source}``), logging each once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from mapper.errors import InvalidValueError, NotFoundError, PermanentError, short_repr
from mapper.shared.model import (
    PROPERTY_BY_NAME,
    TWIN_KEY_RE,
    DeviceConfig,
    DeviceModelConfig,
)

#: ``config``: nothing of the Device changed, but what stands refused of it did (its ``desired_status``).
ChangeKind = Literal["added", "updated", "removed", "unchanged", "config"]

log = logging.getLogger("mapper.edge.kubeedge.registry")

#: Where a configuration comes from: the devices folder, EdgeCore over DMI, the mapper's config file.
ConfigSource = Literal["devices-file", "dmi", "config-file"]
CONFIG_SOURCES: tuple[ConfigSource, ...] = ("devices-file", "dmi", "config-file")


class PreconditionError(PermanentError):
    """The request is well-formed but cannot apply on this node (e.g. a GPU UUID that is not here)."""

    reason = "precondition"


@dataclass(frozen=True)
class DeviceChange:
    kind: ChangeKind
    device: DeviceConfig
    previous: DeviceConfig | None = None

    @property
    def desired_changed(self) -> bool:
        """True when any desired value differs from the previous spec (or the device is new)."""
        if self.previous is None:
            return True
        return desired_values(self.device) != desired_values(self.previous)

    @property
    def cycles_changed(self) -> bool:
        """True when anything but the desired values changed (cycles, pushMethod, properties, uuid)."""
        if self.previous is None:
            return True
        return _without_desired(self.device) != _without_desired(self.previous)


def desired_values(device: DeviceConfig) -> dict[str, str]:
    return {p.name: p.desired for p in device.properties if p.desired is not None}


def _without_desired(device: DeviceConfig) -> tuple[object, ...]:
    props = tuple(
        sorted(
            (
                (
                    p.name,
                    p.collect_cycle_ms,
                    p.report_cycle_ms,
                    p.report_to_cloud,
                    p.push_mqtt,
                    p.push,
                    p.db,
                    p.push_notes,
                    tuple(sorted(p.visitor_config.items())),
                )
                for p in device.properties
            ),
            key=lambda t: t[0],
        )
    )
    return (
        device.uuid,
        device.model,
        props,
        tuple(sorted(device.protocol_config.items())),
        device.state_report_to_cloud,
        device.state_report_cycle_ms,
    )


def _spec_key(device: DeviceConfig) -> tuple[object, ...]:
    # Property lists compare sorted by name (EdgeCore v1.23 does the same).
    desired = tuple(sorted((p.name, p.desired, tuple(sorted(p.desired_metadata.items()))) for p in device.properties))
    return (_without_desired(device), desired)


Listener = Callable[[DeviceChange], None]


def refusal_reason(exc: Exception) -> str:
    """A refusal's short reason for the twin (``mapper.errors``' ``reason``, else ``invalid``)."""
    reason = getattr(exc, "reason", "")
    return reason if isinstance(reason, str) and reason else "invalid"


@dataclass(frozen=True)
class ConfigProblem:
    """One input refused: ``source`` (``CONFIG_SOURCES``), ``where`` (the file, or the DMI call), ``devices``
    (``namespace/name`` of the Devices it would have changed, which keep their version; empty when none is known),
    ``reason`` (a short slug: ``parse-error``, ``invalid``, ``unknown-property``...) and ``detail`` (what was
    wrong)."""

    source: ConfigSource
    where: str
    devices: tuple[str, ...]
    reason: str
    detail: str

    @property
    def key(self) -> tuple[str, str, tuple[str, ...]]:
        return (self.source, self.where, self.devices)


class ConfigErrors:
    """The configuration refused, now and since start. ``refuse`` records a problem (counted and logged at ERROR
    when it is new or its detail changed: a file re-read with the same fault, or EdgeCore sending the same bad
    Device again, is neither counted nor logged again); ``settle`` drops the problems of a source (and ``where``)
    that are not standing any more, once a newer version was read."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self._current: dict[tuple[str, str, tuple[str, ...]], ConfigProblem] = {}

    def refuse(self, problem: ConfigProblem) -> None:
        if self._current.get(problem.key) == problem:
            return
        self._current.pop(problem.key, None)  # the newest last: it speaks for its Devices
        self._current[problem.key] = problem
        self.counts[problem.source] = self.counts.get(problem.source, 0) + 1
        kept = f"; nothing of {', '.join(problem.devices)} changes" if problem.devices else ""
        log.error("%s %s refused (%s)%s: %s", problem.source, problem.where, problem.reason, kept, problem.detail)

    def settle(self, source: ConfigSource, standing: Iterable[ConfigProblem] = (), *, where: str | None = None) -> None:
        """The problems of ``source`` (only those at ``where``, when given) are ``standing`` now and no others:
        each new one is recorded (``refuse``), the rest of that source forgotten (a valid version came)."""
        standing = list(standing)
        keep = {p.key for p in standing}
        for key, problem in list(self._current.items()):
            if problem.source == source and (where is None or problem.where == where) and key not in keep:
                del self._current[key]
                log.info("%s %s: no longer refused", problem.source, problem.where)
        for problem in standing:
            self.refuse(problem)

    def clear_device(self, source: ConfigSource, device: str) -> None:
        """A valid version of ``device`` came from ``source`` (or it was removed): what stood refused of it from
        there goes."""
        for key, problem in list(self._current.items()):
            if problem.source == source and device in problem.devices:
                del self._current[key]

    @property
    def current(self) -> tuple[ConfigProblem, ...]:
        return tuple(self._current.values())

    def device_reason(self, device: str) -> str:
        """Why the latest version of ``device`` was refused ("" when it was not): for its ``desired_status``."""
        for problem in reversed(self._current.values()):
            if device in problem.devices:
                return problem.reason
        return ""


class Registry:
    """Devices and models by ``namespace/name``. ``node_gpus`` returns the UUIDs present on this node."""

    def __init__(self, node_gpus: Callable[[], Iterable[str]]) -> None:
        self._node_gpus = node_gpus
        self._devices: dict[str, DeviceConfig] = {}
        self._models: dict[str, DeviceModelConfig] = {}
        self._listeners: list[Listener] = []
        #: What stands refused of the configuration, and the refusals counted (every way in records here).
        self.config_errors = ConfigErrors()

    # --- refusals ----------------------------------------------------------------------------------
    def refuse(self, source: ConfigSource, where: str, key: str, exc: Exception) -> None:
        """A message that would have changed Device ``key`` (``namespace/name``; "" when unknown) was refused (it
        did not convert or validate): recorded, and the listeners told (``config``) when that Device is here."""
        devices = (key,) if key in self._devices else ()
        before = self.config_errors.device_reason(key)
        self.config_errors.refuse(ConfigProblem(source, where, devices, refusal_reason(exc), f"{key}: {exc}"))
        self._config_changed(key, before)

    def accepted(self, source: ConfigSource, key: str) -> None:
        """A valid version of Device ``key`` came from ``source`` (or it was removed): what stood refused of it
        from there goes."""
        before = self.config_errors.device_reason(key)
        self.config_errors.clear_device(source, key)
        self._config_changed(key, before)

    def _config_changed(self, key: str, before: str) -> None:
        device = self._devices.get(key)
        if device is not None and self.config_errors.device_reason(key) != before:
            self._emit(DeviceChange("config", device, device))

    # --- listeners ---------------------------------------------------------------------------------
    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def _emit(self, change: DeviceChange) -> None:
        """Every listener hears of ``change``, even after one raised (a bug): the others are not starved of it.
        The first exception is raised again once all have run, so the DMI call that made the change answers
        INTERNAL (and logs it) instead of OK."""
        failure: Exception | None = None
        for listener in list(self._listeners):
            try:
                listener(change)
            except Exception as exc:
                failure = failure or exc
        if failure is not None:
            raise failure

    # --- validation --------------------------------------------------------------------------------
    def validate_device(self, device: DeviceConfig) -> None:
        """Raise a ``mapper.errors`` type that says what is wrong; change nothing."""
        if not device.name:
            raise InvalidValueError("device has no name", reason="empty")
        if not device.uuid:
            raise InvalidValueError(
                f"device {device.key}: protocol.configData.uuid is missing (the GPU's UUID, GPU-...)",
                reason="empty",
            )
        if not device.uuid.startswith(("GPU-", "MIG-")):
            raise InvalidValueError(
                f"device {device.key}: configData.uuid {short_repr(device.uuid)} is not a GPU UUID (GPU-...)",
                reason="wrong-type",
            )
        if device.uuid not in set(self._node_gpus()):
            raise PreconditionError(f"device {device.key}: GPU {device.uuid} is not on this node")
        for other in self._devices.values():
            if other.uuid == device.uuid and other.key != device.key:
                raise PreconditionError(f"device {device.key}: GPU {device.uuid} already belongs to device {other.key}")
        seen: set[str] = set()
        for prop in device.properties:
            if prop.name in seen:
                raise InvalidValueError(
                    f"device {device.key}: property {short_repr(prop.name)} listed twice", reason="wrong-type"
                )
            seen.add(prop.name)
            if prop.name not in PROPERTY_BY_NAME:
                raise InvalidValueError(
                    f"device {device.key}: unknown property {short_repr(prop.name)} (not in the GPU catalog)",
                    reason="unknown-property",
                )
            if prop.collect_cycle_ms < 0 or prop.report_cycle_ms < 0:
                raise InvalidValueError(f"device {device.key}: property {prop.name}: negative cycle", reason="negative")
        model = self._models.get(f"{device.namespace}/{device.model}")
        if model is not None:
            names = {p.name for p in model.properties}
            for prop in device.properties:
                if prop.name not in names:
                    raise InvalidValueError(
                        f"device {device.key}: property {short_repr(prop.name)} is not in model {model.key}",
                        reason="unknown-property",
                    )

    def validate_model(self, model: DeviceModelConfig) -> None:
        if not model.name:
            raise InvalidValueError("device model has no name", reason="empty")
        for prop in model.properties:
            if not TWIN_KEY_RE.fullmatch(prop.name):
                raise InvalidValueError(
                    f"model {model.key}: property name {short_repr(prop.name)} is not a valid twin key",
                    reason="wrong-type",
                )
            spec = PROPERTY_BY_NAME.get(prop.name)
            if spec is None:
                raise InvalidValueError(
                    f"model {model.key}: unknown property {short_repr(prop.name)} (not in the GPU catalog)",
                    reason="unknown-property",
                )
            ptype = prop.ptype.upper()
            compatible = {spec.ptype} | ({"DOUBLE"} if spec.ptype == "FLOAT" else set())
            if ptype and ptype not in compatible:
                raise InvalidValueError(
                    f"model {model.key}: property {prop.name} has type {prop.ptype}, the catalog says {spec.ptype}",
                    reason="wrong-type",
                )
            if prop.access_mode == "ReadWrite" and spec.access != "ReadWrite":
                raise InvalidValueError(
                    f"model {model.key}: property {prop.name} is read-only on a GPU, not ReadWrite",
                    reason="read-only",
                )

    # --- devices -----------------------------------------------------------------------------------
    def upsert_device(self, device: DeviceConfig) -> DeviceChange:
        self.validate_device(device)
        previous = self._devices.get(device.key)
        if previous is not None and _spec_key(previous) == _spec_key(device):
            return DeviceChange("unchanged", device, previous)
        self._devices[device.key] = device
        change = DeviceChange("added" if previous is None else "updated", device, previous)
        self._emit(change)
        return change

    def remove_device(self, namespace: str, name: str) -> DeviceChange | None:
        previous = self._devices.pop(f"{namespace}/{name}", None)
        if previous is None:
            return None
        change = DeviceChange("removed", previous, previous)
        self._emit(change)
        return change

    def get_device(self, namespace: str, name: str) -> DeviceConfig:
        try:
            return self._devices[f"{namespace}/{name}"]
        except KeyError:
            raise NotFoundError(f"device {namespace}/{name} is not known to this mapper") from None

    def devices(self) -> list[DeviceConfig]:
        return list(self._devices.values())

    def device_by_uuid(self, uuid: str) -> DeviceConfig | None:
        for device in self._devices.values():
            if device.uuid == uuid:
                return device
        return None

    # --- models ------------------------------------------------------------------------------------
    def upsert_model(self, model: DeviceModelConfig) -> None:
        self.validate_model(model)
        self._models[model.key] = model

    def remove_model(self, namespace: str, name: str) -> None:
        self._models.pop(f"{namespace}/{name}", None)

    def models(self) -> list[DeviceModelConfig]:
        return list(self._models.values())

    def model_of(self, device: DeviceConfig) -> DeviceModelConfig | None:
        return self._models.get(f"{device.namespace}/{device.model}")

    # --- full sync (MapperRegister reply, a re-read folder) ------------------------------------------
    def sync(
        self,
        devices: Iterable[DeviceConfig],
        models: Iterable[DeviceModelConfig],
        *,
        keep: Iterable[str] = (),
    ) -> tuple[list[DeviceChange], list[tuple[str, Exception]]]:
        """Make the registry equal to the given lists: upsert each, remove what is absent.

        ``keep``: Devices (``namespace/name``) whose new version was refused before it got here (a file that
        failed to parse, a Device that did not convert): they stay as they are, neither updated nor removed. A
        Device given here and refused by validation stays as it was too. Returns the changes and the
        devices/models refused (by key, with the error); one bad entry never stops the others.
        """
        errors: list[tuple[str, Exception]] = []
        for model in models:
            try:
                self.upsert_model(model)
            except (InvalidValueError, PermanentError) as exc:
                errors.append((model.key, exc))
        changes: list[DeviceChange] = []
        devices = list(devices)
        wanted: set[str] = set(keep) | {d.key for d in devices}
        # Removals first: a Device renamed (or replaced by another on its GPU) in one version of the files is
        # one removed and one added, and the added one's GPU must be free when it comes.
        for key in [k for k in self._devices if k not in wanted]:
            namespace, name = key.split("/", 1)
            try:
                removed = self.remove_device(namespace, name)
            except Exception as exc:  # a listener's bug: the device is gone from the registry all the same
                errors.append((key, exc))
                continue
            if removed is not None:
                changes.append(removed)
        # A Device may take the GPU another one of this version leaves (a Device moved to another GPU): what was
        # refused for a GPU still in use is tried again while a pass makes progress.
        pending = devices
        while pending:
            refused: list[tuple[DeviceConfig, Exception]] = []
            for device in pending:
                try:
                    change = self.upsert_device(device)
                except PreconditionError as exc:
                    refused.append((device, exc))
                    continue
                except Exception as exc:  # refused, or a listener's bug: one entry never stops the others
                    errors.append((device.key, exc))
                    continue
                if change.kind != "unchanged":
                    changes.append(change)
            if len(refused) == len(pending):
                errors += [(d.key, exc) for d, exc in refused]
                break
            pending = [d for d, _ in refused]
        return changes, errors
