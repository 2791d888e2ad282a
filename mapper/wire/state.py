"""A device's retained state message: its one writer (``state_payload``) and its one reader (``parse_state``).

The mapper publishes it on ``mapper.wire.topics.state_topic`` with every periodic twin report, retained, so
that a consumer that starts listening learns at once which GPU a device is and how it stands; the bridge reads
it for the GPU uuid of batches whose header omits it, the GPU's identity labels and the status series.

One JSON object: ``device``, ``uuid``, ``ts_ms`` and ``values`` (the latest sample, catalog units), then the
mapper's status of the GPU (``GpuStatus``; all optional: a reader takes a message without them, as mappers
before them sent): when the snapshot was taken (``at_ms``), the device ``state``, the GPU's identity (``gpu``:
``{"index", "pci_bus_id", "driver_version"}``), the XID events seen by code (``xid_errors``: ``{"79": 1}``),
the desired power limit in W (``power_limit_desired_w``, only when one is set) and the GPU's health (``health``,
``GpuHealth``: the status of each level, subsystem and driver check by name, the last CUDA probe, the probes run
by outcome and the InfoROM versions; docs/telemetry.md) and what of the mapper runs degraded (``degraded``:
``data dir full``; only while something does). A reader skips keys it does not know.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mapper.shared.model import DEVICE_STATES, Sample
from mapper.shared.naming import HEALTH_STATUSES

#: The status keys of a state message, after ``device``, ``uuid``, ``ts_ms`` and ``values``.
STATE_AT_MS, STATE_STATE, STATE_GPU = "at_ms", "state", "gpu"
STATE_XID_ERRORS, STATE_POWER_LIMIT_DESIRED_W = "xid_errors", "power_limit_desired_w"
STATE_HEALTH = "health"
STATE_DEGRADED = "degraded"


@dataclass(frozen=True)
class GpuHealth:
    """A GPU's health as the state message carries it (``mapper.shared.naming.health_samples`` turns it into the
    health families, on ``/metrics`` and on the bridge alike). Statuses are ``healthy``, ``degraded`` or
    ``unhealthy``."""

    #: (level, status): 0 (overall), then levels 1, 2 and 3.
    levels: tuple[tuple[int, str], ...] = ()
    #: (subsystem, status) of every subsystem.
    subsystems: tuple[tuple[str, str], ...] = ()
    #: (check, status) of the latest level-2 checks.
    checks: tuple[tuple[str, str], ...] = ()
    #: The last CUDA probe: (passed, latency in s or None); None when none ran or it was skipped.
    probe: tuple[bool, float | None] | None = None
    #: CUDA probes run, by outcome.
    probes: tuple[tuple[str, int], ...] = ()
    #: The InfoROM versions (image, OEM, ECC, power); None without an InfoROM check.
    inforom: tuple[str, ...] | None = None

    def to_doc(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "levels": {str(lv): s for lv, s in self.levels},
            "subsystems": dict(self.subsystems),
            "checks": dict(self.checks),
            "probes": dict(self.probes),
        }
        if self.probe is not None:
            doc["probe"] = {"passed": self.probe[0], "latency_s": self.probe[1]}
        if self.inforom is not None:
            doc["inforom"] = list(self.inforom)
        return doc

    @classmethod
    def from_doc(cls, doc: object) -> GpuHealth:
        """ValueError saying what is wrong when ``doc`` is not ``to_doc``'s."""
        if not isinstance(doc, dict):
            raise ValueError(f"{STATE_HEALTH!r} is not an object")

        def statuses(key: str) -> dict[str, str]:
            table = doc.get(key) or {}
            if not isinstance(table, dict) or not all(
                isinstance(k, str) and isinstance(v, str) and v in HEALTH_STATUSES for k, v in table.items()
            ):
                raise ValueError(f"{STATE_HEALTH}.{key} is not an object of health statuses")
            return table

        levels = statuses("levels")
        if not all(k.isdigit() for k in levels):
            raise ValueError(f"{STATE_HEALTH}.levels: a level is not a number")
        probe = doc.get("probe")
        passed_latency: tuple[bool, float | None] | None = None
        if probe is not None:
            passed, latency = (probe.get("passed"), probe.get("latency_s")) if isinstance(probe, dict) else (0, 0)
            if not isinstance(passed, bool) or not (latency is None or _finite(latency)):
                raise ValueError(f"{STATE_HEALTH}.probe is not {{passed, latency_s}}")
            passed_latency = (passed, None if latency is None else float(latency))
        probes = doc.get("probes") or {}
        if not isinstance(probes, dict) or not all(_count(n) for n in probes.values()):
            raise ValueError(f"{STATE_HEALTH}.probes is not an object of counts")
        inforom = doc.get("inforom")
        if inforom is not None and (
            not isinstance(inforom, list) or len(inforom) != 4 or not all(isinstance(v, str) for v in inforom)
        ):
            raise ValueError(f"{STATE_HEALTH}.inforom is not a list of four versions")
        return cls(
            levels=tuple((int(k), v) for k, v in levels.items()),
            subsystems=tuple(statuses("subsystems").items()),
            checks=tuple(statuses("checks").items()),
            probe=passed_latency,
            probes=tuple((str(k), int(n)) for k, n in probes.items()),
            inforom=None if inforom is None else tuple(inforom),
        )


def _finite(v: object) -> bool:
    return not isinstance(v, bool) and isinstance(v, int | float) and math.isfinite(v)


def _count(v: object) -> bool:
    return not isinstance(v, bool) and isinstance(v, int) and v >= 0


# --------------------------------------------------------------------------------------------------
# The writer
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuStatus:
    """The mapper's status of a device's GPU, as the state message carries it after the values."""

    #: When the mapper's snapshot was taken (ms since the epoch): the time of the status samples.
    at_ms: int
    #: One of ``mapper.shared.model.DEVICE_STATES``.
    state: str
    #: The GPU's identity: its NVML index, PCI bus id and driver version.
    index: int
    pci_bus_id: str
    driver_version: str
    #: XID events seen on the GPU since the mapper started, by XID code.
    xid_errors: Mapping[int, int] = field(default_factory=dict)
    #: The power cap asked for (W); None when none is.
    power_limit_desired_w: float | None = None
    #: The GPU's health; None: not sent.
    health: GpuHealth | None = None
    #: What of the mapper runs degraded (``data dir full``); "" when nothing does (the key is left out).
    degraded: str = ""


def state_payload(device: str, sample: Sample, status: GpuStatus | None = None) -> bytes:
    """The retained state message of ``device``: its latest values as one JSON object, and the GPU's
    ``status`` after them when given (without it: the values alone)."""
    doc: dict[str, Any] = {"device": device, "uuid": sample.uuid, "ts_ms": sample.ts_ms, "values": dict(sample.values)}
    if status is not None:
        doc[STATE_AT_MS] = status.at_ms
        doc[STATE_STATE] = status.state
        doc[STATE_GPU] = {
            "index": status.index,
            "pci_bus_id": status.pci_bus_id,
            "driver_version": status.driver_version,
        }
        doc[STATE_XID_ERRORS] = {str(k): v for k, v in sorted(status.xid_errors.items())}
        if status.power_limit_desired_w is not None:
            doc[STATE_POWER_LIMIT_DESIRED_W] = status.power_limit_desired_w
        if status.health is not None:
            doc[STATE_HEALTH] = status.health.to_doc()
        if status.degraded:
            doc[STATE_DEGRADED] = status.degraded
    return json.dumps(doc, separators=(",", ":")).encode("utf-8")


# --------------------------------------------------------------------------------------------------
# The reader
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuIdentity:
    """What a GPU's series are labelled with beyond uuid, device and node (from its retained state message):
    ``gpu`` (the NVML index as text), and ``gpu_info``'s ``driver_version`` and ``pci_bus_id``. "" = not known,
    the label is left out."""

    gpu: str = ""
    pci_bus_id: str = ""
    driver_version: str = ""


#: The identity of a GPU whose state message names none (a mapper before it) or that has no state message.
NO_IDENTITY = GpuIdentity()


@dataclass(frozen=True)
class DeviceStatus:
    """A retained state message as the bridge reads it (``parse_state``). ``identity`` None, ``at_ms`` None:
    the message has none (a mapper before them sent only device, uuid, ts_ms and values)."""

    device: str
    uuid: str
    identity: GpuIdentity | None = None
    at_ms: int | None = None
    #: One of ``mapper.shared.model.DEVICE_STATES``, or "" when not given.
    state: str = ""
    #: (XID code as text, events seen) by code.
    xid_errors: tuple[tuple[str, int], ...] = ()
    power_limit_desired_w: float | None = None
    #: The GPU's health; None: the message has none (a mapper before it).
    health: GpuHealth | None = None
    #: What of the mapper runs degraded, "" when nothing does (or the message does not say).
    degraded: str = ""

    @property
    def has_samples(self) -> bool:
        """It carries a status to write (and the time to write it at)."""
        return self.at_ms is not None and bool(
            self.state or self.xid_errors or self.power_limit_desired_w is not None or self.health is not None
        )


def parse_state(payload: bytes) -> DeviceStatus:
    """A state message (``state_payload``); ValueError saying what is wrong when it is not one."""
    try:
        doc = json.loads(payload)
    except ValueError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    device, uuid = doc.get("device"), doc.get("uuid") or ""
    if not isinstance(device, str) or not device or not isinstance(uuid, str):
        raise ValueError("no device name (or a uuid that is not a string)")
    identity = None
    gpu = doc.get(STATE_GPU)
    if gpu is not None:
        if not isinstance(gpu, dict):
            raise ValueError(f"{STATE_GPU!r} is not an object")
        index = gpu.get("index")
        if index is not None and (isinstance(index, bool) or not isinstance(index, int) or index < 0):
            raise ValueError(f"{STATE_GPU}.index {index!r} is not a GPU index")
        pci, driver = gpu.get("pci_bus_id") or "", gpu.get("driver_version") or ""
        if not isinstance(pci, str) or not isinstance(driver, str):
            raise ValueError(f"{STATE_GPU}.pci_bus_id and .driver_version must be strings")
        identity = GpuIdentity("" if index is None else str(index), pci, driver)
    at_ms = doc.get(STATE_AT_MS)
    if at_ms is not None and (isinstance(at_ms, bool) or not isinstance(at_ms, int) or at_ms <= 0):
        raise ValueError(f"{STATE_AT_MS} {at_ms!r} is not a time in ms")
    state = doc.get(STATE_STATE) or ""
    if not isinstance(state, str) or (state and state not in DEVICE_STATES):
        raise ValueError(f"{STATE_STATE} {state!r} is not one of {', '.join(DEVICE_STATES)}")
    xids_doc = doc.get(STATE_XID_ERRORS) or {}
    if not isinstance(xids_doc, dict):
        raise ValueError(f"{STATE_XID_ERRORS!r} is not an object")
    xids = []
    for code, n in xids_doc.items():
        if not code.isdigit() or isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{STATE_XID_ERRORS}: {code!r}: {n!r} is not an XID code and a count")
        xids.append((str(int(code)), n))
    desired = doc.get(STATE_POWER_LIMIT_DESIRED_W)
    if desired is not None and (
        isinstance(desired, bool) or not isinstance(desired, int | float) or not math.isfinite(desired)
    ):
        raise ValueError(f"{STATE_POWER_LIMIT_DESIRED_W} {desired!r} is not a number of W")
    health_doc = doc.get(STATE_HEALTH)
    health = None if health_doc is None else GpuHealth.from_doc(health_doc)
    degraded = doc.get(STATE_DEGRADED) or ""
    if not isinstance(degraded, str):
        raise ValueError(f"{STATE_DEGRADED} {degraded!r} is not a string")
    return DeviceStatus(
        device,
        uuid,
        identity,
        at_ms,
        state,
        tuple(xids),
        None if desired is None else float(desired),
        health,
        degraded,
    )
