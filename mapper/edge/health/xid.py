"""The XID catalog: what each known XID means for the GPU, what to do about it, and how the GPU comes back. Pure.

An XID is the NVIDIA driver's error report (``NVRM: Xid (PCI:...): <n>, ...`` in the kernel log, an
``nvmlEventTypeXidCriticalError`` event with the number in ``eventData``). NVIDIA's XID catalog gives each one a
recommended action; the entries below follow it (and ``nvml-facts.md`` section 6). Four severities:

* ``application``: the fault belongs to the program that ran (a bad kernel, a page fault, a killed context):
  XIDs 13, 31, 43, 45, 68, 109 (NVIDIA's device plugin skips these too). The GPU stays healthy.
* ``informational``: worth a counter and a log line, no change of health (63: a page retired or a row remapped).
* ``warning``: the GPU keeps working but something is off: health ``degraded``.
* ``fatal``: the GPU cannot be trusted until its ``recovery`` happened: health ``unhealthy``.

``recovery`` is the way back from a fatal XID: ``reset`` (a GPU reset or driver reload clears it), ``reboot``
(only a node reboot does: 79, fallen off the bus), or ``probes`` (N passing level-3 probes in a row).

``XidPolicy`` lays the operator's lists over the catalog: ``ignore`` (never acted upon, counted only) and
``fatal`` (always unhealthy, whatever the catalog says). An XID the catalog does not know is a ``warning``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "CATALOG",
    "DEFAULT_FATAL_XIDS",
    "RECOVERIES",
    "Recovery",
    "Severity",
    "XidClass",
    "XidInfo",
    "XidPolicy",
]

Severity = Literal["application", "informational", "warning", "fatal"]
#: ``none``: nothing to recover from; ``reset``: a GPU reset (or driver reload); ``reboot``: a node reboot;
#: ``probes``: N passing level-3 probes in a row.
Recovery = Literal["none", "reset", "reboot", "probes"]
RECOVERIES: tuple[str, ...] = ("none", "reset", "reboot", "probes")


@dataclass(frozen=True)
class XidInfo:
    xid: int
    #: NVIDIA's short name for it.
    name: str
    severity: Severity
    #: NVIDIA's recommended action, twin-safe: ``restart-application``, ``reset-gpu``, ``reboot``, ...
    action: str
    recovery: Recovery
    #: The subsystem it points at (``memory``, ``nvlink``, ``pcie``, ``firmware``, ``engine``, ``driver``).
    subsystem: str = "engine"


def _x(xid: int, name: str, severity: Severity, action: str, recovery: Recovery, subsystem: str) -> XidInfo:
    return XidInfo(xid, name, severity, action, recovery, subsystem)


#: The known XIDs (NVIDIA's XID catalog; the subset a compute node sees).
CATALOG: Mapping[int, XidInfo] = {
    x.xid: x
    for x in (
        _x(8, "GPU stopped processing", "warning", "restart-application", "probes", "engine"),
        _x(13, "Graphics engine exception", "application", "restart-application", "none", "engine"),
        _x(31, "GPU memory page fault", "application", "restart-application", "none", "memory"),
        _x(32, "Invalid or corrupted push buffer stream", "warning", "restart-application", "probes", "pcie"),
        _x(38, "Driver firmware error", "fatal", "reset-gpu", "reset", "firmware"),
        _x(43, "GPU stopped processing (channel reset)", "application", "restart-application", "none", "engine"),
        _x(45, "Preemptive cleanup, due to previous errors", "application", "none", "none", "engine"),
        _x(48, "Double bit ECC error", "fatal", "reset-gpu", "reset", "memory"),
        _x(56, "Display engine error", "warning", "none", "probes", "engine"),
        _x(57, "Error programming video memory interface", "fatal", "reset-gpu", "reset", "memory"),
        _x(61, "Internal micro-controller breakpoint/warning", "warning", "reset-gpu", "probes", "firmware"),
        _x(62, "Internal micro-controller halt", "fatal", "reset-gpu", "reset", "firmware"),
        _x(63, "ECC page retirement or row remapping recording event", "informational", "none", "none", "memory"),
        _x(64, "ECC page retirement or row remapper recording failure", "fatal", "reset-gpu", "reset", "memory"),
        _x(68, "Video processor exception", "application", "restart-application", "none", "engine"),
        _x(69, "Graphics engine class error", "warning", "restart-application", "probes", "engine"),
        _x(74, "NVLink error", "fatal", "reset-gpu", "reset", "nvlink"),
        _x(79, "GPU has fallen off the bus", "fatal", "reboot", "reboot", "pcie"),
        _x(92, "High single-bit ECC error rate", "warning", "none", "probes", "memory"),
        _x(94, "Contained ECC error", "application", "restart-application", "none", "memory"),
        _x(95, "Uncontained ECC error", "fatal", "reset-gpu", "reset", "memory"),
        _x(109, "Context switch timeout", "application", "restart-application", "none", "engine"),
        _x(119, "GSP RPC timeout", "fatal", "reset-gpu", "reset", "firmware"),
        _x(120, "GSP error", "fatal", "reset-gpu", "reset", "firmware"),
        _x(121, "C2C link corrected error", "informational", "none", "none", "nvlink"),
        _x(140, "Unrecovered ECC error", "fatal", "reset-gpu", "reset", "memory"),
        _x(154, "GPU recovery action changed", "warning", "check-recovery-action", "probes", "driver"),
    )
}

#: The XIDs the catalog calls fatal: the default ``fatal`` list.
DEFAULT_FATAL_XIDS: frozenset[int] = frozenset(x for x, info in CATALOG.items() if info.severity == "fatal")


@dataclass(frozen=True)
class XidClass:
    """What one XID means on this node after the operator's lists: ``ignored`` or the catalog's severity."""

    xid: int
    severity: Severity | Literal["ignored"]
    action: str
    recovery: Recovery
    subsystem: str
    known: bool

    @property
    def reason(self) -> str:
        """Twin-safe: ``xid79-fatal``, ``xid13-application``, ``xid999-warning``."""
        return f"xid{self.xid}-{self.severity}"


@dataclass(frozen=True)
class XidPolicy:
    """The catalog with the operator's lists: ``ignore`` (counted, never acted upon) and ``fatal`` (the XIDs that
    make the GPU unhealthy; by default the catalog's fatal ones). A catalog-fatal XID left off the ``fatal`` list
    counts as a ``warning``; an XID on the list the catalog does not call fatal comes back by
    ``fatal_recovery``. (The config parser refuses an XID on both lists.)"""

    ignore: frozenset[int] = frozenset()
    fatal: frozenset[int] = DEFAULT_FATAL_XIDS
    fatal_recovery: Recovery = "reset"

    def classify(self, xid: int) -> XidClass:
        info = CATALOG.get(xid)
        known = info is not None
        subsystem = info.subsystem if info is not None else "engine"
        if xid in self.ignore:
            return XidClass(xid, "ignored", "none", "none", subsystem, known)
        if xid in self.fatal:
            if info is not None and info.severity == "fatal":
                return XidClass(xid, "fatal", info.action, info.recovery, subsystem, True)
            return XidClass(xid, "fatal", "reset-gpu", self.fatal_recovery, subsystem, known)
        if info is None:
            return XidClass(xid, "warning", "check-kernel-log", "probes", subsystem, False)
        if info.severity == "fatal":  # the operator took it off the fatal list
            return XidClass(xid, "warning", info.action, "probes", subsystem, True)
        return XidClass(xid, info.severity, info.action, info.recovery, subsystem, True)

    def classify_all(self, xids: Iterable[int]) -> list[XidClass]:
        return [self.classify(x) for x in xids]
