"""Devices bound to GPUs, and where desired values come in.

``Bindings`` keeps each Device on the GPU its ``protocol.configData.uuid`` names and feeds the GPU workers'
desired state from every source:

* the registry (``on_device_change``, its listener): Devices added, updated, moved to another GPU or removed,
  from EdgeCore over DMI (``on_registered``, ``RegisterDevice`` / ``UpdateDevice``) or from the devices folder
  (``apply_folder``); their desired values are the ``cloud`` source (``file`` in standalone mode);
* EventBus deltas (``on_delta``, or ``read_delta`` then ``apply_delta`` behind the app's door, where values
  over the device's rate wait and are acked ``pending``/``deferred``: ``deferred_acks``): an edge application's
  desired values, the ``edge`` source;
* the desired store: what an earlier run persisted is enforced again at start (``restore_desired``), and every
  change is saved (``save_desired``).

Bad input never changes a GPU: a devices file that fails to parse keeps the Devices it defined when it last
parsed (the bindings remember which file defined which Device), a Device that does not convert or validate keeps
its previous version, and only an explicit removal (the file deleted, or the Device gone from a file that parsed;
EdgeCore's RemoveDevice, or a registration reply without it) removes one. What stands refused is in
``config_errors`` (``/status``, the counter) and in the ``desired_status`` twin of each Device it names
(``config:refused-<reason>``, ``GpuWorker.config_error``).

Bookkeeping only (DMI handlers must answer within EdgeCore's deadline): the worker's next step does the work.
It sees domain types and Protocols only, never an adapter.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from mapper.clock import Clock
from mapper.edge.control.collect import GpuWorker, TickResult, unbound_device
from mapper.edge.control.desired import DesiredState, Source
from mapper.edge.control.policy import PolicyEngine
from mapper.edge.control.reconcile import Ack, deferred_ack
from mapper.edge.kubeedge.devicefiles import FolderContents
from mapper.edge.kubeedge.doorlimit import Versioned, message_key
from mapper.edge.kubeedge.registry import (
    ConfigErrors,
    ConfigProblem,
    DeviceChange,
    PreconditionError,
    Registry,
    refusal_reason,
)
from mapper.errors import ConfigError, MapperError
from mapper.shared.model import PROPERTY_BY_NAME, DeviceConfig, DeviceModelConfig
from mapper.wire.eventbus import MAX_PAYLOAD_BYTES, parse_delta, parse_membership

log = logging.getLogger("mapper.edge.kubeedge.binding")


class StoredLike(Protocol):
    @property
    def device(self) -> str: ...
    @property
    def uuid(self) -> str: ...
    @property
    def state(self) -> DesiredState: ...
    @property
    def updated_at_ms(self) -> int: ...


class DesiredStoreLike(Protocol):
    """What the bindings need from ``mapper.edge.storage.store.DesiredStore``."""

    def save(self, device: str, state: DesiredState, *, uuid: str = "") -> None: ...
    def load_all(self) -> Iterable[StoredLike]: ...


class Reports(Protocol):
    """What the bindings tell ``mapper.edge.kubeedge.report.Reporter``."""

    def bound(self, device: DeviceConfig) -> None: ...
    def removed(self, device: DeviceConfig) -> None: ...
    def offer_state(self, namespace: str, name: str, state: str) -> None: ...


def policy_override(device: DeviceConfig | None) -> str | None:
    """The Device's own policy set (``protocol.configData.policy``), or None."""
    if device is None:
        return None
    value = device.protocol_config.get("policy")
    return str(value) if value not in (None, "") else None


class Bindings:
    """Devices on their GPUs (``workers`` by UUID) and the desired values that reach them.

    ``source``: the desired source of the registry's Devices (``cloud`` with DMI, ``file`` standalone).
    ``rebind(worker, device)``: called when a GPU's Device changes (its telemetry identity and routes).
    ``store``: the desired store, or None (nothing persisted). ``max_delta_bytes``: the largest EventBus delta
    parsed (``mqtt.inboundMaxBytes``; the app's door drops bigger ones before this). What stands refused is the
    registry's ``config_errors`` (the DMI server records its refusals there too)."""

    def __init__(
        self,
        workers: Mapping[str, GpuWorker],
        registry: Registry,
        policies: PolicyEngine,
        reports: Reports,
        *,
        clock: Clock,
        source: Source,
        node: str,
        rebind: Callable[[GpuWorker, DeviceConfig], None],
        store: DesiredStoreLike | None = None,
        max_delta_bytes: int = MAX_PAYLOAD_BYTES,
    ) -> None:
        self.workers = workers
        self.registry = registry
        self.policies = policies
        self.reports = reports
        self.clock = clock
        self.source: Source = source
        self.node = node
        self.rebind = rebind
        self.store = store
        self.max_delta_bytes = max_delta_bytes
        #: The desired store's last error while saving fails ("" while it works): logged once, not every save.
        self.store_error = ""
        #: Devices whose desired state could not be saved (device key -> GPU uuid): saved again by
        #: ``save_unsaved`` (each housekeeping round, and at shutdown) once the data dir takes writes again.
        self._unsaved: dict[str, str] = {}
        self.config_errors: ConfigErrors = registry.config_errors
        #: Each devices file that parsed -> the Devices it defined then (kept while it fails to parse).
        self._file_devices: dict[str, set[str]] = {}

    # --- the registry -------------------------------------------------------------------------------------------
    def on_device_change(self, change: DeviceChange) -> None:
        """Registry listener: bookkeeping only; the GPU's next step (woken here) does the work."""
        if change.kind == "config":  # what stands refused of a Device changed (the DMI server refused a message)
            self.mark_config_errors()
            return
        device = change.device
        previous = change.previous
        moved = change.kind == "updated" and previous is not None and previous.uuid != device.uuid
        if moved and previous is not None:
            # The Device now names another GPU: the old GPU is released first, as if the Device had gone.
            self.on_device_change(DeviceChange("removed", previous, previous))
        worker = self.workers.get(device.uuid)
        if worker is None:
            return
        now_ms = self.clock.wall_ms()
        if change.kind == "removed":
            if worker.device is not None and worker.device.key == device.key:
                worker.desired.sync_source(self.source, {}, now_ms)
                worker.bind(None)
                worker.config_error = ""
                self.policies.set_override(worker.uuid, None)
                self.rebind(worker, unbound_device(worker.info))
                self.reports.removed(device)
                self.save_desired(worker, device.key)
                log.info("device %s removed; GPU %s returns to its defaults", device.key, worker.uuid)
            return
        if change.desired_changed or moved:
            desired = {p.name: p.desired for p in device.properties if p.desired is not None}
            changes = worker.desired.sync_source(self.source, desired, now_ms)
            if changes:
                log.info(
                    "desired values of %s changed: %s",
                    device.key,
                    ", ".join(f"{c.prop}={c.after.raw if c.after else '(removed)'}" for c in changes),
                )
        if change.kind == "added" or change.cycles_changed:
            try:
                self.policies.set_override(worker.uuid, policy_override(device))
            except ConfigError as exc:
                log.error("device %s: policy override refused, node policies apply: %s", device.key, exc)
            worker.bind(device)
            self.rebind(worker, device)
            self.reports.bound(device)
        self.save_desired(worker, device.key)
        worker.wake()

    async def on_registered(
        self,
        devices: list[DeviceConfig],
        models: list[DeviceModelConfig],
        rejected: list[tuple[str, str]] | tuple[tuple[str, str], ...] = (),
    ) -> None:
        """EdgeCore's MapperRegister reply: the Devices and models this mapper serves now. ``rejected``:
        (namespace/name, why) of the Devices and models in it that did not convert; such a Device keeps the version
        it had."""
        known = {d.key for d in self.registry.devices()}
        keep = {key for key, _ in rejected if key in known}
        problems = [
            ConfigProblem("dmi", "MapperRegister", (key,) if key in known else (), "invalid", f"{key}: {why}")
            for key, why in rejected
        ]
        changes, errors = self.registry.sync(devices, models, keep=keep)
        refused = {key for key, _ in errors}
        for key, exc in errors:
            namespace, _, name = key.partition("/")
            if isinstance(exc, PreconditionError) and name:
                # Its GPU is missing from this node (removed, or fell off the bus before we started).
                self.reports.offer_state(namespace, name, "offline")
            named = (key,) if any(d.key == key for d in self.registry.devices()) else ()
            problems.append(ConfigProblem("dmi", "MapperRegister", named, refusal_reason(exc), f"{key}: {exc}"))
        for given in devices:
            if given.key not in refused:
                self.config_errors.clear_device("dmi", given.key)
        self.config_errors.settle("dmi", problems, where="MapperRegister")
        self.mark_config_errors()
        if not problems:
            self._release_orphans()
        log.info("EdgeCore registration: %d device(s) on this mapper, %d changed", len(devices), len(changes))

    def apply_folder(self, contents: FolderContents) -> None:
        """What the devices folder holds now, synced into the registry. A file that failed to parse keeps the
        Devices it defined when it last parsed; a Device refused on conversion or validation keeps its previous
        version; a Device is removed only when its file is deleted or parsed without it."""
        keep: set[str] = set()
        problems: list[ConfigProblem] = []
        for file, reason in contents.failed_files.items():
            held = self._file_devices.get(file, set())
            keep |= held
            problems.append(ConfigProblem("devices-file", file, tuple(sorted(held)), "parse-error", reason))
        for file, keys in contents.file_devices.items():
            self._file_devices[file] = set(keys)
        present = contents.file_devices.keys() | contents.failed_files.keys()
        for gone in [f for f in self._file_devices if f not in present and not contents.folder_error]:
            del self._file_devices[gone]  # deleted: its Devices go
        if contents.folder_error:  # the folder cannot be listed: nothing was removed, everything stays
            for defined in self._file_devices.values():
                keep |= defined
            everything = tuple(sorted(keep))
            reason = contents.folder_error
            problems.append(ConfigProblem("devices-file", "devices folder", everything, "unreadable", reason))
        represented = set(contents.failed_files.items())
        for key, (file, reason) in contents.refused.items():
            keep.add(key)
            represented.add((file, reason))
            problems.append(ConfigProblem("devices-file", file, (key,), "invalid", reason))
        problems += [
            ConfigProblem("devices-file", file, (), "invalid", reason)
            for file, reason in contents.errors
            if (file, reason) not in represented
        ]
        changes, errors = self.registry.sync(contents.devices, contents.models, keep=keep)
        files = {key: file for file, keys in contents.file_devices.items() for key in keys}
        known = {d.key for d in self.registry.devices()}
        for key, exc in errors:
            where, named = files.get(key, "devices folder"), (key,) if key in known or key in files else ()
            problems.append(ConfigProblem("devices-file", where, named, refusal_reason(exc), f"{key}: {exc}"))
        self.config_errors.settle("devices-file", problems)
        self.mark_config_errors()
        if not problems and not errors:
            self._release_orphans()
        log.info(
            "devices folder: %d device(s), %d model(s), %d change(s)%s",
            len(contents.devices),
            len(contents.models),
            len(changes),
            f", {len(problems)} refused (the Devices they name keep their previous version)" if problems else "",
        )

    def _release_orphans(self) -> None:
        """After a whole list of Devices with nothing refused (a read of the devices folder, EdgeCore's
        registration reply): a GPU no Device names that still holds values of this source (restored from the
        store at start, its Device never seen by this process: deleted while the mapper was down or its GPU
        absent, or its file failed to parse at start and was deleted since) had its Device removed; its values
        go, as a removal's do (the defaults return)."""
        now_ms = self.clock.wall_ms()
        for worker in self.workers.values():
            if worker.device is not None:
                continue
            changes = worker.desired.sync_source(self.source, {}, now_ms)
            if changes:
                log.info(
                    "GPU %s: no Device names it; its desired %s from an earlier run released",
                    worker.uuid,
                    ", ".join(c.prop for c in changes),
                )
                self.save_desired(worker, worker.device_key)
                worker.wake()

    def mark_config_errors(self) -> None:
        """Each bound GPU's ``config_error`` (its ``desired_status`` twin) as ``config_errors`` stands now; a GPU
        whose error came or went is woken, so that its twin is reported."""
        for worker in self.workers.values():
            reason = self.config_errors.device_reason(worker.device.key) if worker.device is not None else ""
            if worker.config_error != reason:
                worker.config_error = reason
                worker.wake()

    # --- EventBus ------------------------------------------------------------------------------------------------
    def on_delta(self, topic: str, payload: bytes) -> None:
        """An edge application set desired values through ``twin/update/delta``: read and applied at once (the
        app's door reads and applies in two steps, ``read_delta`` and ``apply_delta``, so that values over the
        device's rate can wait)."""
        try:
            values = self.read_delta(topic, payload)
        except ValueError as exc:
            log.warning("EventBus delta refused: %s", exc)
            return
        if values:
            self.apply_delta(message_key(topic), values)

    def read_delta(self, topic: str, payload: bytes) -> dict[str, Versioned]:
        """The writable properties a delta sets, each with its version (the delta's timestamp, else the time it
        is read): empty when its Device's GPU is not on this mapper. ValueError naming what is wrong: a
        malformed delta, or no such Device."""
        delta = parse_delta(topic, payload, max_bytes=self.max_delta_bytes)
        try:
            device = self.registry.get_device(delta.namespace, delta.name)
        except MapperError:
            raise ValueError(f"delta for {delta.namespace}/{delta.name}: no such GPU device on this mapper") from None
        if device.uuid not in self.workers:
            return {}
        version = delta.timestamp_ms or self.clock.wall_ms()
        values: dict[str, Versioned] = {}
        for prop, raw in delta.values.items():
            spec = PROPERTY_BY_NAME.get(prop)
            if spec is None or not spec.writable:
                log.warning("EventBus delta for %s: %s is not a writable GPU property; ignored", device.key, prop)
                continue
            values[prop] = Versioned(raw, version)
        return values

    def apply_delta(self, device_key: str, values: Mapping[str, Versioned]) -> None:
        """Desired values of the ``edge`` source for the Device ``namespace/name`` (``read_delta``'s, now or
        after they waited at the door): set, saved, and the GPU's next step woken."""
        worker = self._worker_of(device_key)
        if worker is None:
            return
        changed = [p for p, v in values.items() if worker.desired.set(p, v.value, "edge", v.version_ms) is not None]
        if changed:
            log.info("EventBus delta for %s: desired %s", device_key, ", ".join(changed))
            self.save_desired(worker, device_key)
            worker.wake()

    def deferred_acks(self, device_key: str, values: Mapping[str, Versioned]) -> tuple[str, list[Ack]]:
        """The acks of desired values that wait at the door for the device's rate: ``pending``, reason
        ``deferred``, one per property that starts to wait (a value equal to the one in force already, which
        will change nothing and get no other ack, gets none). The GPU's UUID and the acks; none when the
        Device's GPU is not here."""
        worker = self._worker_of(device_key)
        if worker is None:
            return "", []
        now_ms = self.clock.wall_ms()
        acks = []
        for prop, v in values.items():
            current = worker.desired.get(prop)
            if current is not None and current.source == "edge" and current.raw == v.value:
                continue
            acks.append(deferred_ack(worker.uuid, prop, v.value, "edge", v.version_ms, now_ms))
        return worker.uuid, acks

    def _worker_of(self, device_key: str) -> GpuWorker | None:
        namespace, _, name = device_key.partition("/")
        try:
            device = self.registry.get_device(namespace, name)
        except MapperError:
            return None
        return self.workers.get(device.uuid)

    def on_membership(self, topic: str, payload: bytes) -> None:
        try:
            update = parse_membership(payload)
        except ValueError as exc:
            log.warning("EventBus membership update refused: %s", exc)
            return
        log.info("EventBus membership of %s: added %s, removed %s", self.node, list(update.added), list(update.removed))

    # --- the desired store ------------------------------------------------------------------------------------
    def after_step(self, worker: GpuWorker, result: TickResult) -> None:
        """A GPU's step is done (a ``Collector`` consumer): a step that acked desired values saves its desired
        state (what was applied, rejected or restored is what the next start enforces again)."""
        if result.reconcile is not None and result.reconcile.acks:
            self.save_desired(worker, worker.device_key)

    def save_desired(self, worker: GpuWorker, device_key: str) -> None:
        if self.store is None:
            return
        try:
            self.store.save(device_key, worker.desired, uuid=worker.uuid)
        except MapperError as exc:
            if not self.store_error:
                log.error(
                    "could not persist the desired state of %s (it is enforced from memory; logged once until a "
                    "save works again): %s",
                    device_key,
                    exc,
                )
            self.store_error = str(exc)
            self._unsaved[device_key] = worker.uuid
            return
        self._unsaved.pop(device_key, None)
        if self.store_error and not self._unsaved:
            log.info("the desired state is persisted again")
            self.store_error = ""

    def save_unsaved(self) -> None:
        """Save again the desired states whose save failed (a full or read-only data dir), each still bound to the
        GPU it was saved for; stops at the first that still fails."""
        for device_key, uuid in list(self._unsaved.items()):
            worker = self.workers.get(uuid)
            if worker is None or worker.device_key != device_key:
                self._unsaved.pop(device_key, None)  # unbound since: its removal decides what is stored
                continue
            self.save_desired(worker, device_key)
            if device_key in self._unsaved:
                return
        if not self._unsaved and self.store_error:
            log.info("the desired state is persisted again")
            self.store_error = ""

    def restore_desired(self) -> None:
        """Desired state persisted by an earlier run is enforced again, with or without EdgeCore."""
        if self.store is None:
            return
        # A GPU's desired state is one object, saved under the key of whatever named the GPU at the time
        # (``_unbound/<uuid>``, a Device, the Device's next name): the record saved last is the state it had.
        # An older record (a name the GPU had before, with its removal's "defaults to restore") must not win
        # over it, or a restart would reset a GPU to its defaults that its current Device caps.
        latest: dict[str, StoredLike] = {}
        for stored in self.store.load_all():
            if stored.uuid not in self.workers:
                log.warning("persisted desired state of %s names GPU %s, not on this node", stored.device, stored.uuid)
                continue
            kept = latest.get(stored.uuid)
            if kept is None or stored.updated_at_ms >= kept.updated_at_ms:
                latest[stored.uuid] = stored
        for uuid, stored in latest.items():
            self.workers[uuid].desired = stored.state
            log.info(
                "restored desired state of %s (GPU %s): %s",
                stored.device,
                stored.uuid,
                ", ".join(f"{k}={v.raw}" for k, v in stored.state.effective().items()) or "defaults to restore",
            )

    def policy_overrides(self) -> dict[str, str]:
        """Each bound GPU's own policy set, by UUID (for a reload of the node's policies)."""
        overrides = {w.uuid: policy_override(w.device) for w in self.workers.values() if w.device is not None}
        return {k: v for k, v in overrides.items() if v}
