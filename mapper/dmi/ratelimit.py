"""Node-wide budget for calls to EdgeCore, and the coalescing queue of reports. Pure: time comes from a Clock.

EdgeCore keeps ONE token bucket (1 token per second, burst 100) shared by MapperRegister, ReportDeviceStatus,
ReportDeviceStates and every mapper on the node; over it a call fails with "too many request". We spend our
own, smaller budget (default 0.8/s, burst 10) so other mappers keep some room and a burst after an outage
cannot empty EdgeCore's bucket.

``ReportScheduler`` holds at most ONE pending twin report and ONE pending state per device: a newer offer
replaces the older value (twins are merged by name, newest wins), so nothing stale is ever queued and memory
is bounded by the number of devices. States go before twins (a state change is the more urgent news);
devices take turns in the order they first became pending (round-robin), so a chatty device cannot starve
the others.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from mapper.clock import Clock
from mapper.model import Twin


class TokenBucket:
    """``rate_per_s`` tokens a second up to ``burst``; starts full."""

    def __init__(self, clock: Clock, *, rate_per_s: float = 0.8, burst: int = 10) -> None:
        if rate_per_s <= 0:
            raise ValueError(f"rate_per_s must be > 0, got {rate_per_s}")
        if burst < 1:
            raise ValueError(f"burst must be >= 1, got {burst}")
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._clock = clock
        self._tokens = float(burst)
        self._at = clock.monotonic()

    def _refill(self) -> None:
        now = self._clock.monotonic()
        if now > self._at:
            self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.rate_per_s)
        self._at = max(self._at, now)

    @property
    def tokens(self) -> float:
        self._refill()
        return self._tokens

    def try_take(self) -> bool:
        """Take one token if there is one."""
        self._refill()
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False

    def take_forced(self) -> None:
        """Take one token even if that leaves the bucket in debt (MapperRegister must not wait behind reports);
        later reports wait until the debt is paid, so the average rate still holds."""
        self._refill()
        self._tokens -= 1.0

    def wait_s(self) -> float:
        """Seconds until a token is available (0 when one is)."""
        self._refill()
        if self._tokens >= 1.0:
            return 0.0
        return (1.0 - self._tokens) / self.rate_per_s


@dataclass(frozen=True)
class StatusReport:
    namespace: str
    name: str
    twins: tuple[Twin, ...]

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class StateReport:
    namespace: str
    name: str
    state: str

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


Report = StatusReport | StateReport


@dataclass
class SchedulerStats:
    offered_status: int = 0
    offered_state: int = 0
    #: Offers that replaced (or merged into) a pending value instead of adding one.
    coalesced: int = 0
    #: Pending reports dropped because their device was forgotten.
    dropped: int = 0
    popped: dict[str, int] = field(default_factory=lambda: {"status": 0, "state": 0})


class ReportScheduler:
    """Latest-value-per-device queue in front of a ``TokenBucket``."""

    def __init__(self, bucket: TokenBucket) -> None:
        self.bucket = bucket
        self._status: OrderedDict[str, StatusReport] = OrderedDict()
        self._state: OrderedDict[str, StateReport] = OrderedDict()
        self.stats = SchedulerStats()

    # --- offers ---------------------------------------------------------------------------------------
    def offer_status(self, namespace: str, name: str, twins: Iterable[Twin]) -> None:
        """Queue the twins of one device; merged by twin name into any pending report of that device."""
        new = tuple(twins)
        if not new:
            return
        key = f"{namespace}/{name}"
        self.stats.offered_status += 1
        pending = self._status.get(key)
        if pending is None:
            self._status[key] = StatusReport(namespace, name, new)
            return
        self.stats.coalesced += 1
        merged = {t.name: t for t in pending.twins}
        merged.update({t.name: t for t in new})
        # keep its place in the round-robin order
        self._status[key] = StatusReport(namespace, name, tuple(merged.values()))

    def offer_state(self, namespace: str, name: str, state: str) -> None:
        key = f"{namespace}/{name}"
        self.stats.offered_state += 1
        if key in self._state:
            self.stats.coalesced += 1
        self._state[key] = StateReport(namespace, name, state)

    def requeue(self, report: Report) -> None:
        """Put back a report whose send failed transiently, unless a newer value arrived meanwhile
        (for twins: the failed values fill in only the twins the newer offer lacks). It goes to the front."""
        if isinstance(report, StateReport):
            if report.key not in self._state:
                self._state[report.key] = report
                self._state.move_to_end(report.key, last=False)
            return
        pending = self._status.get(report.key)
        if pending is None:
            self._status[report.key] = report
            self._status.move_to_end(report.key, last=False)
            return
        merged = {t.name: t for t in report.twins}
        merged.update({t.name: t for t in pending.twins})
        self._status[report.key] = StatusReport(report.namespace, report.name, tuple(merged.values()))

    def forget(self, namespace: str, name: str) -> None:
        """Drop whatever is pending for a removed device."""
        key = f"{namespace}/{name}"
        for queue in (self._status, self._state):
            if queue.pop(key, None) is not None:
                self.stats.dropped += 1

    # --- taking ---------------------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        return len(self._status) + len(self._state)

    def peek_pending(self) -> list[Report]:
        return [*self._state.values(), *self._status.values()]

    def pop_ready(self) -> Report | None:
        """The next report to send if the budget allows one now (a token is taken), else None."""
        if not self._state and not self._status:
            return None
        if not self.bucket.try_take():
            return None
        if self._state:
            _, state = self._state.popitem(last=False)
            self.stats.popped["state"] += 1
            return state
        _, status = self._status.popitem(last=False)
        self.stats.popped["status"] += 1
        return status

    def wait_s(self) -> float | None:
        """Seconds until ``pop_ready`` can return something; None when nothing is pending."""
        if not self._state and not self._status:
            return None
        return self.bucket.wait_s()
