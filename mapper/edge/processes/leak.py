"""GPU memory leak detector: a signal, never an action. Pure: no I/O; time is handed in.

For each process on a GPU (by GPU UUID and pid) the detector keeps the memory samples of the last
``window_s``. Once the samples cover the whole window it splits it into ``segments`` equal parts and takes the
lowest value of each (its floor). A process is **suspected of leaking** when every floor is higher than the one
before and the last floor is at least ``threshold_bytes`` above the first: memory that keeps growing and is
never given back. A plateau (floors stop rising) clears the suspicion, and so does a sawtooth whose drops
reach back down within each segment (a framework's caching allocator filling and freeing). A sawtooth slower
than a segment is indistinguishable from a leak over that window: choose ``window_s`` several times the
workload's own cycle.

``observe(uuid, memory_by_pid, now_s)`` returns the events of this observation: ``leak-suspected`` when a process
starts to look like a leak, ``leak-cleared`` when it stops (or exits while suspected).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

__all__ = ["LeakConfig", "LeakDetector", "LeakEvent"]


@dataclass(frozen=True)
class LeakConfig:
    enabled: bool = True
    window_s: float = 1800.0
    threshold_bytes: int = 1 << 30
    segments: int = 4

    def __post_init__(self) -> None:
        if not math.isfinite(self.window_s) or self.window_s <= 0:
            raise ValueError(f"leak window_s must be > 0, got {self.window_s!r}")
        if self.threshold_bytes <= 0:
            raise ValueError(f"leak threshold_bytes must be > 0, got {self.threshold_bytes!r}")
        if not 2 <= self.segments <= 64:
            raise ValueError(f"leak segments must be within 2..64, got {self.segments!r}")


@dataclass(frozen=True)
class LeakEvent:
    uuid: str
    pid: int
    #: ``leak-suspected`` or ``leak-cleared``.
    action: str
    ts_s: float
    growth_bytes: int
    window_s: float
    memory_used_bytes: int
    reason: str


@dataclass
class _Series:
    """One process's samples of the window: times and used bytes in two lists (the floors are ``min`` over
    slices of ``used``, found by bisecting ``ts``: C speed over a window of hundreds of samples)."""

    ts: list[float] = field(default_factory=list)
    used: list[int] = field(default_factory=list)
    suspected: bool = False


@dataclass
class LeakDetector:
    config: LeakConfig = field(default_factory=LeakConfig)
    _series: dict[tuple[str, int], _Series] = field(default_factory=dict)

    def suspected(self, uuid: str) -> list[int]:
        """The pids on GPU ``uuid`` suspected of leaking now."""
        return sorted(pid for (u, pid), s in self._series.items() if u == uuid and s.suspected)

    def observe(self, uuid: str, memory_by_pid: Mapping[int, int | None], now_s: float) -> list[LeakEvent]:
        """One process sample of one GPU: ``{pid: used bytes}`` (None: unknown, skipped). Processes absent
        from it have exited; their history is dropped."""
        if not self.config.enabled:
            return []
        events: list[LeakEvent] = []
        window = self.config.window_s
        for key in [k for k in self._series if k[0] == uuid and k[1] not in memory_by_pid]:
            series = self._series.pop(key)
            if series.suspected:
                last = series.used[-1] if series.used else 0
                events.append(LeakEvent(uuid, key[1], "leak-cleared", now_s, 0, window, last, "process exited"))
        for pid, used in memory_by_pid.items():
            if used is None:
                continue
            series = self._series.setdefault((uuid, pid), _Series())
            series.ts.append(now_s)
            series.used.append(int(used))
            ts = series.ts
            drop = 0
            while len(ts) - drop > 1 and now_s - ts[drop + 1] >= window:
                drop += 1
            if drop:
                del ts[:drop]
                del series.used[:drop]
            growth = self._growth(series, now_s)
            leaking = growth is not None and growth >= self.config.threshold_bytes
            if leaking and not series.suspected:
                series.suspected = True
                rise = int(growth or 0)
                why = f"GPU memory grew {_fmt_bytes(rise)} over {_fmt_s(window)} without being freed"
                events.append(LeakEvent(uuid, pid, "leak-suspected", now_s, rise, window, int(used), why))
            elif not leaking and series.suspected and growth is not None:
                series.suspected = False
                events.append(
                    LeakEvent(
                        uuid, pid, "leak-cleared", now_s, int(growth), window, int(used), "memory stopped growing"
                    )
                )
        return events

    def forget(self, uuids: Iterable[str]) -> None:
        gone = set(uuids)
        for key in [k for k in self._series if k[0] in gone]:
            del self._series[key]

    def _growth(self, series: _Series, now_s: float) -> int | None:
        """The rise from the first segment's floor to the last's if every floor rose, 0 if not, None while the
        samples do not cover the window yet."""
        window = self.config.window_s
        start = now_s - window
        ts, used = series.ts, series.used
        if not ts or ts[0] > start + 1e-9:
            return None
        n = self.config.segments

        def segment(t: float) -> int:
            return min(n - 1, max(0, int((t - start) / window * n)))

        # Times only grow, so each segment is one run of samples: its bounds by bisection on the segment index.
        bounds = [0, *(bisect.bisect_left(ts, k, key=segment) for k in range(1, n)), len(ts)]
        known = [min(used[a:b]) for a, b in itertools.pairwise(bounds) if b > a]
        if len(known) < n:
            return None
        if all(b > a for a, b in itertools.pairwise(known)):
            return known[-1] - known[0]
        return 0


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _fmt_s(seconds: float) -> str:
    if seconds >= 60 and seconds % 60 == 0:
        return f"{int(seconds // 60)} min"
    return f"{seconds:g} s"
