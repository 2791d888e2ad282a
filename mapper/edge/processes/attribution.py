"""GPU energy split between the processes that used it, summed per container and pod. Pure: no I/O.

The model (Kepler's, for GPUs):

* Each interval the GPU's own energy counter advances by ``E`` joules over ``dt`` seconds.
* The **idle part** is ``min(E, P_idle * dt)``: what the GPU would have drawn with nothing running. It is
  reported apart, per GPU, and given to no workload. ``P_idle`` is configured, else the lowest mean power seen
  over an interval with no process on the GPU, else the lowest seen at all (``IdlePower``).
* The **active part** ``E - idle`` is split between the interval's processes by their SM-utilisation share
  (``sm_i / sum(sm)``). When no process has an SM figure above zero (NVML returned none, or every process was
  idle in its sample), it is split evenly between the processes present: they keep the GPU out of idle. With no
  process at all it is ``unattributed``.
* ``idle + unattributed + sum(per process) == E`` exactly, up to float rounding.

Limits (also in docs/processes.md): under MIG NVML has no per-process utilisation and no per-instance energy,
so a MIG GPU's active energy is split evenly between its processes; MPS clients share one server context whose
utilisation NVML may report against the server's pid; a process on several GPUs gets a share on each GPU
separately; SM share is a time share, not a power share (a tensor-core-heavy kernel draws more per busy SM
than a memory-bound one).

``EnergyLedger`` keeps the per-workload counters monotonic and their number bounded: at most ``max_keys`` per
GPU get a series of their own; later ones are summed into that GPU's ``other`` key for good, so no counter
ever goes backwards; a key unseen for ``retention_s`` is forgotten.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = [
    "OTHER",
    "EnergyLedger",
    "EnergySplit",
    "IdlePower",
    "LedgerEntry",
    "ProcessUse",
    "WorkloadKey",
    "split_energy",
    "top_processes",
]

K = TypeVar("K")


@dataclass(frozen=True, order=True)
class WorkloadKey:
    """What energy is summed by: a pod's container (``namespace``/``pod``/``container``). Host processes and
    containers outside Kubernetes have ``namespace == pod == ""``; ``OTHER`` gathers what is over the bound."""

    namespace: str = ""
    pod: str = ""
    container: str = ""

    @property
    def pod_key(self) -> WorkloadKey:
        return WorkloadKey(self.namespace, self.pod, "")


OTHER = WorkloadKey("", "other", "")


@dataclass(frozen=True)
class ProcessUse:
    """One process's use of one GPU in one interval (None where NVML did not say)."""

    pid: int
    memory_used_bytes: int | None = None
    #: SM utilisation share of the GPU in the interval, 0..1.
    sm_ratio: float | None = None
    memory_ratio: float | None = None
    encoder_ratio: float | None = None
    decoder_ratio: float | None = None


@dataclass(frozen=True)
class EnergySplit(Generic[K]):
    energy_j: float
    duration_s: float
    idle_j: float
    unattributed_j: float
    by_key: Mapping[K, float]

    @property
    def attributed_j(self) -> float:
        return math.fsum(self.by_key.values())


def split_energy(
    energy_j: float, duration_s: float, idle_power_w: float, shares: Mapping[K, float | None]
) -> EnergySplit[K]:
    """Split one interval's GPU energy: idle part apart, the rest by SM share (see the module doc).

    ``shares`` maps each process (or any key) present in the interval to its SM ratio, None if unknown.
    Raises ValueError for a negative or non-finite energy or a non-positive duration (a counter reset is the
    caller's to detect: it skips that interval).
    """
    if not math.isfinite(energy_j) or energy_j < 0:
        raise ValueError(f"energy_j must be finite and >= 0, got {energy_j!r}")
    if not math.isfinite(duration_s) or duration_s <= 0:
        raise ValueError(f"duration_s must be finite and > 0, got {duration_s!r}")
    idle_w = idle_power_w if math.isfinite(idle_power_w) and idle_power_w > 0 else 0.0
    idle_j = min(energy_j, idle_w * duration_s)
    active_j = energy_j - idle_j
    if not shares:
        return EnergySplit(energy_j, duration_s, idle_j, active_j, {})
    weights = {k: (v if v is not None and math.isfinite(v) and v > 0 else 0.0) for k, v in shares.items()}
    total = math.fsum(weights.values())
    if total <= 0:
        each = active_j / len(weights)
        by_key = dict.fromkeys(weights, each)
    else:
        by_key = {k: active_j * w / total for k, w in weights.items()}
    return EnergySplit(energy_j, duration_s, idle_j, 0.0, by_key)


@dataclass
class IdlePower:
    """A GPU's idle power: configured, else the lowest interval mean seen with no process, else the lowest
    seen at all (an upper bound that tightens). None until an interval was seen."""

    configured_w: float | None = None
    _idle_min_w: float | None = None
    _any_min_w: float | None = None

    def observe(self, mean_power_w: float, process_count: int) -> None:
        if not math.isfinite(mean_power_w) or mean_power_w < 0:
            return
        if process_count == 0:
            self._idle_min_w = mean_power_w if self._idle_min_w is None else min(self._idle_min_w, mean_power_w)
        self._any_min_w = mean_power_w if self._any_min_w is None else min(self._any_min_w, mean_power_w)

    @property
    def watts(self) -> float | None:
        if self.configured_w is not None:
            return self.configured_w
        return self._idle_min_w if self._idle_min_w is not None else self._any_min_w

    @property
    def source(self) -> str:
        if self.configured_w is not None:
            return "configured"
        if self._idle_min_w is not None:
            return "observed-idle"
        return "observed-minimum" if self._any_min_w is not None else "unknown"


@dataclass
class LedgerEntry:
    joules_total: float = 0.0
    #: The mean power of the last interval this key was in (0 in an interval it was absent from).
    power_w: float = 0.0
    last_seen_s: float = 0.0


@dataclass
class EnergyLedger:
    """Monotonic per-workload energy counters for one GPU, at most ``max_keys`` of them plus ``OTHER``."""

    max_keys: int = 32
    retention_s: float = 600.0
    idle_joules_total: float = 0.0
    unattributed_joules_total: float = 0.0
    idle_power_w: float = 0.0
    entries: dict[WorkloadKey, LedgerEntry] = field(default_factory=dict)
    _overflow: set[WorkloadKey] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.max_keys < 1:
            raise ValueError(f"max_keys must be >= 1, got {self.max_keys}")

    def add(self, split: EnergySplit[WorkloadKey], now_s: float) -> None:
        """Add one interval's split (keyed by workload; several processes of one key summed by the caller or
        here, whichever: values of equal keys must already be summed in ``split.by_key``)."""
        self.idle_joules_total += split.idle_j
        self.unattributed_joules_total += split.unattributed_j
        self.idle_power_w = split.idle_j / split.duration_s
        for entry in self.entries.values():
            entry.power_w = 0.0
        other_j = 0.0
        for key in sorted(split.by_key):
            joules = split.by_key[key]
            target = self._slot(key)
            if target == OTHER:
                other_j += joules
                continue
            entry = self.entries[target]
            entry.joules_total += joules
            entry.power_w = joules / split.duration_s
            entry.last_seen_s = now_s
        if other_j > 0 or OTHER in self.entries:
            entry = self.entries.setdefault(OTHER, LedgerEntry())
            entry.joules_total += other_j
            entry.power_w = other_j / split.duration_s
            if other_j > 0:
                entry.last_seen_s = now_s
        self._expire(now_s)

    def slot(self, key: WorkloadKey) -> WorkloadKey:
        """Where ``key``'s energy goes (itself, or ``OTHER`` once over the bound), without changing anything."""
        if key == OTHER or key in self._overflow:
            return OTHER
        if key in self.entries or sum(1 for k in self.entries if k != OTHER) < self.max_keys:
            return key
        return OTHER

    def _slot(self, key: WorkloadKey) -> WorkloadKey:
        if key in self.entries and key != OTHER:
            return key
        if key in self._overflow or key == OTHER:
            return OTHER
        if sum(1 for k in self.entries if k != OTHER) >= self.max_keys:
            self._overflow.add(key)
            return OTHER
        self.entries[key] = LedgerEntry()
        return key

    def _expire(self, now_s: float) -> None:
        for key in [k for k, e in self.entries.items() if k != OTHER and now_s - e.last_seen_s > self.retention_s]:
            del self.entries[key]
        # An overflowed key long gone may be forgotten too (its energy stays in OTHER).
        if len(self._overflow) > 4 * self.max_keys:
            self._overflow.clear()

    @property
    def total_j(self) -> float:
        return math.fsum(
            [self.idle_joules_total, self.unattributed_joules_total, *(e.joules_total for e in self.entries.values())]
        )


def top_processes(uses: Sequence[ProcessUse], n: int) -> tuple[list[ProcessUse], ProcessUse | None]:
    """The processes that get series of their own (the top ``n`` by SM share and the top ``n`` by memory,
    at most ``2n``), and one ``ProcessUse`` (pid 0) summing the rest, None when there is no rest."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    by_sm = sorted(uses, key=lambda u: (-(u.sm_ratio or 0.0), -(u.memory_used_bytes or 0), u.pid))[:n]
    by_mem = sorted(uses, key=lambda u: (-(u.memory_used_bytes or 0), -(u.sm_ratio or 0.0), u.pid))[:n]
    chosen = {u.pid: u for u in (*by_sm, *by_mem)}
    kept = sorted(chosen.values(), key=lambda u: u.pid)
    rest = [u for u in uses if u.pid not in chosen]
    if not rest:
        return kept, None
    return kept, _sum_uses(rest)


def _sum_uses(uses: Iterable[ProcessUse]) -> ProcessUse:
    items = list(uses)

    def total(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return math.fsum(known) if known else None

    mem = [u.memory_used_bytes for u in items if u.memory_used_bytes is not None]
    return ProcessUse(
        pid=0,
        memory_used_bytes=sum(mem) if mem else None,
        sm_ratio=total([u.sm_ratio for u in items]),
        memory_ratio=total([u.memory_ratio for u in items]),
        encoder_ratio=total([u.encoder_ratio for u in items]),
        decoder_ratio=total([u.decoder_ratio for u in items]),
    )
