"""GPU health in three levels, per subsystem: the domain types and the pure rules. No I/O.

* **Level 1, the node**: the GPU's own metrics and events (XIDs through ``mapper.edge.health.xid``, uncorrected ECC
  errors, a GPU fallen off the bus). Decided in ``mapper.edge.control.policy`` (the ``health`` policy), which keeps
  the state.
* **Level 2, the driver and its processes**: NVML answers within a deadline, the device nodes exist,
  ``nvidia-persistenced`` runs where persistence is wanted, the kernel module's version is NVML's, the InfoROM
  validates. Each a ``CheckResult`` with a reason (``mapper.edge.gpu.nvml.NvmlBackend.driver_checks`` and
  ``mapper.edge.health.driverhost``).
* **Level 3, the application**: a CUDA context, a tiny allocation and a copy in a short-lived process
  (``mapper.edge.gpu.cudaprobe``; the simulator's ``SimCudaProbe``): a ``ProbeResult``.

``HealthReport`` is the whole picture for one GPU: its status (``healthy``, ``degraded``, ``unhealthy``), the level
and reason of the worst finding, each level's status and each subsystem's. Its ``twin_text`` is the ``health``
twin, ``ProbeResult.twin_text`` the ``health_probe`` twin.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from mapper.shared.model import format_number, twin_safe

__all__ = [
    "HEALTHY_REPORT",
    "LEVELS",
    "STATUSES",
    "SUBSYSTEMS",
    "CheckResult",
    "GpuProbe",
    "GpuTools",
    "HealthReport",
    "HealthStatus",
    "HealthTools",
    "ProbeResult",
    "SelfCheckResult",
    "worst",
]

HealthStatus = Literal["healthy", "degraded", "unhealthy"]
STATUSES: tuple[HealthStatus, ...] = ("healthy", "degraded", "unhealthy")
_RANK: Mapping[str, int] = {"healthy": 0, "degraded": 1, "unhealthy": 2}
#: 1: node metrics and events; 2: driver and its processes; 3: the application (a CUDA context).
LEVELS: tuple[int, ...] = (1, 2, 3)
#: The subsystems a finding is filed under (as dcgm-exporter's health watches, plus ``cuda`` for the probe).
SUBSYSTEMS: tuple[str, ...] = ("pcie", "nvlink", "memory", "thermal", "power", "driver", "inforom", "engine", "cuda")


def worst(statuses: Iterable[str]) -> HealthStatus:
    """The worst of ``statuses`` (``healthy`` for none)."""
    out: HealthStatus = "healthy"
    for s in statuses:
        if _RANK[s] > _RANK[out]:
            out = s  # type: ignore[assignment]
    return out


@dataclass(frozen=True)
class CheckResult:
    """One level-2 check: its ``name`` (``nvml-responsive``, ``device-nodes``, ``persistenced``,
    ``driver-version``, ``inforom``), the verdict and its twin-safe reason; ``detail``: facts found on the way
    (versions), as (key, value) text pairs."""

    name: str
    status: HealthStatus
    reason: str = "ok"
    subsystem: str = "driver"
    detail: tuple[tuple[str, str], ...] = ()
    level: int = 2

    def __post_init__(self) -> None:
        if self.status not in _RANK:
            raise ValueError(f"check {self.name}: status {self.status!r} is not one of {', '.join(STATUSES)}")


ProbeOutcome = Literal["pass", "fail", "timeout", "slow", "skipped"]


@dataclass(frozen=True)
class ProbeResult:
    """One level-3 probe. ``pass``; ``slow`` (passed, but above the slow threshold: degraded); ``fail`` (a CUDA
    call failed: ``reason`` names it, e.g. ``cuCtxCreate-CUDA_ERROR_UNKNOWN``); ``timeout`` (the probe process was
    killed after the timeout); ``skipped`` (not run: ``reason`` says why, e.g. ``busy-87pct``)."""

    outcome: ProbeOutcome
    reason: str = ""
    latency_s: float | None = None
    #: Monotonic seconds when it finished.
    ts_s: float = 0.0

    @property
    def passed(self) -> bool:
        return self.outcome in ("pass", "slow")

    @property
    def status(self) -> HealthStatus | None:
        """The level-3 verdict, or None for a skipped probe (no news)."""
        if self.outcome == "pass":
            return "healthy"
        if self.outcome == "slow":
            return "degraded"
        if self.outcome == "skipped":
            return None
        return "unhealthy"

    def twin_text(self) -> str:
        """``pass:latency-0.084s``, ``timeout:latency-30s``, ``fail:cuCtxCreate-CUDA_ERROR_UNKNOWN:latency-0.2s``,
        ``skipped:busy-87pct``."""
        parts: list[str] = [self.outcome]
        if self.reason and self.outcome != "pass":
            parts.append(self.reason)
        if self.latency_s is not None and self.outcome != "skipped":
            parts.append(f"latency-{format_number(round(self.latency_s, 3))}s")
        return twin_safe(":".join(parts))[:512]


@dataclass(frozen=True)
class HealthReport:
    """One GPU's health now. ``level`` and ``reason``: the worst finding's (0 and ``ok`` when healthy)."""

    status: HealthStatus = "healthy"
    level: int = 0
    reason: str = "ok"
    #: (level, status, reason) for levels 1, 2 and 3.
    levels: tuple[tuple[int, HealthStatus, str], ...] = (
        (1, "healthy", "ok"),
        (2, "healthy", "ok"),
        (3, "healthy", "ok"),
    )
    #: (subsystem, status, reason) of the subsystems with a finding (the others are healthy).
    subsystems: tuple[tuple[str, HealthStatus, str], ...] = ()
    #: The latest level-2 checks, each with its verdict (for the metrics).
    checks: tuple[CheckResult, ...] = ()

    def twin_text(self) -> str:
        """The ``health`` twin: ``healthy``, ``degraded:level2:persistenced-not-running``,
        ``unhealthy:level3:probe-timeout``; another failing level adds ``,N-more``."""
        if self.status == "healthy":
            return "healthy"
        text = f"{self.status}:level{self.level}:{self.reason}"
        others = sum(1 for _, s, _ in self.levels if s != "healthy") - 1
        if others > 0:
            text += f",{others}-more"
        return twin_safe(text)[:512]

    def level_status(self, level: int) -> HealthStatus:
        return next((s for lv, s, _ in self.levels if lv == level), "healthy")

    def subsystem_status(self, subsystem: str) -> HealthStatus:
        return next((s for name, s, _ in self.subsystems if name == subsystem), "healthy")


HEALTHY_REPORT = HealthReport()


def build_report(
    level1: tuple[HealthStatus, str, str],
    checks: tuple[CheckResult, ...],
    level3: tuple[HealthStatus, str],
) -> HealthReport:
    """The report from each level's verdict: ``level1`` (status, reason, subsystem), the level-2 ``checks``,
    ``level3`` (status, reason). The worst level wins; on a tie the lower level (closer to the hardware)."""
    l1_status, l1_reason, l1_subsystem = level1
    failing = [c for c in checks if c.status != "healthy"]
    l2_status = worst(c.status for c in failing)
    l2_first = next((c for c in failing if c.status == l2_status), None)
    l2_reason = l2_first.reason if l2_first is not None else "ok"
    l3_status, l3_reason = level3
    levels: tuple[tuple[int, HealthStatus, str], ...] = (
        (1, l1_status, l1_reason if l1_status != "healthy" else "ok"),
        (2, l2_status, l2_reason),
        (3, l3_status, l3_reason if l3_status != "healthy" else "ok"),
    )
    status = worst(s for _, s, _ in levels)
    level, reason = 0, "ok"
    if status != "healthy":
        level, _, reason = next(lv for lv in levels if lv[1] == status)
    subsystems: dict[str, tuple[HealthStatus, str]] = {}

    def note(subsystem: str, s: HealthStatus, why: str) -> None:
        if s == "healthy":
            return
        old = subsystems.get(subsystem)
        if old is None or _RANK[s] > _RANK[old[0]]:
            subsystems[subsystem] = (s, why)

    note(l1_subsystem, l1_status, l1_reason)
    for c in failing:
        note(c.subsystem, c.status, c.reason)
    note("cuda", l3_status, l3_reason)
    return HealthReport(
        status=status,
        level=level,
        reason=reason,
        levels=levels,
        subsystems=tuple((name, s, why) for name, (s, why) in sorted(subsystems.items())),
        checks=checks,
    )


# --------------------------------------------------------------------------------------------------
# The parts that touch the GPU or the host (adapters implement them; ``mapper.edge.gpu``)
# --------------------------------------------------------------------------------------------------


class GpuProbe(Protocol):
    """The level-3 probe (``mapper.edge.gpu.cudaprobe.CudaProbe``, ``mapper.edge.gpu.simnvml.SimCudaProbe``): blocking,
    at most ``timeout_s`` (plus the kill of the probe process); never raises for a GPU problem."""

    def probe(self, uuid: str, pci_bus_id: str, timeout_s: float) -> ProbeResult: ...


@dataclass(frozen=True)
class SelfCheckResult:
    """One diagnostic tool's verdict in the recovery's self-check (``nvidia-smi -q``, ``dcgmi diag -r 1``)."""

    tool: str
    passed: bool
    reason: str = "ok"


class GpuTools(Protocol):
    """NVIDIA's command-line tools for the recovery flow (``mapper.edge.gpu.tools.NvidiaTools``; the simulator's
    ``SimTools``). Blocking and bounded by ``timeout_s``; ``reset`` raises ``mapper.errors.MapperError``."""

    def self_check(self, uuid: str, timeout_s: float) -> list[SelfCheckResult]: ...
    def reset(self, uuid: str, timeout_s: float) -> None: ...


@dataclass(frozen=True)
class HealthTools:
    """What the health loop and the recovery flow use: the probe, the host root the driver checks read
    (``mapper.edge.health.driverhost``), and the tools."""

    probe: GpuProbe
    host_root: Path
    tools: GpuTools
