"""Node-wide budget for calls to EdgeCore, and the coalescing queue of reports. Pure: time comes from a Clock,
the budget is a ``mapper.clock.TokenBucket``.

EdgeCore keeps ONE token bucket (1 token per second, burst 100) shared by MapperRegister, ReportDeviceStatus,
ReportDeviceStates and every mapper on the node; over it a call fails with "too many request". We spend our
own, smaller budget (default 0.8/s, burst 10) so other mappers keep some room and a burst after an outage
cannot empty EdgeCore's bucket.

``ReportScheduler`` holds at most ONE pending twin report and ONE pending state per device: a newer offer
replaces the older value (twins are merged by name, newest wins), so nothing stale is ever queued and memory
is bounded by the number of devices.

Prompt reports win where the budget is short. An offer is *prompt* (a change the cloud should see at once: a
desired value applied, a policy override, a state change) or *periodic* (a report cycle, the first report
after start-up). Periodic reports spend a token only while the bucket keeps ``reserve`` tokens after it: one
per GPU of the node, at most ``burst - 1`` (8 of 10 on a node with 8 GPUs), so that a change on every
device at once still goes out in the same second right after start-up, when the first reports of every device
would otherwise have emptied the bucket. Periodic reports are not fewer for it (the bucket refills at the same
rate); start-up's first reports spread over more seconds. A prompt offer for a device with a periodic report
pending merges with it and makes it prompt; a periodic report that has waited ``promote_after_s`` counts as
prompt (nothing starves under sustained changes).

Order: prompt states (the most urgent news), prompt twins, periodic twins (start-up's first twins before its
first states), periodic states. Within each, devices take turns in the order they first became pending
(round-robin), so a chatty device cannot starve the others.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from mapper.clock import TokenBucket
from mapper.shared.model import Twin

#: A periodic report pending this long counts as prompt (it no longer leaves the reserve alone).
PROMOTE_AFTER_S = 30.0


@dataclass(frozen=True)
class StatusReport:
    namespace: str
    name: str
    twins: tuple[Twin, ...]
    #: A change to show at once (see the module's docstring), not a periodic report.
    prompt: bool = False
    #: When it became pending (monotonic s): when a periodic report is promoted. (Not part of its value.)
    since_s: float = field(default=0.0, compare=False)

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class StateReport:
    namespace: str
    name: str
    state: str
    prompt: bool = False
    since_s: float = field(default=0.0, compare=False)

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
    #: Of those, the prompt ones (a periodic report promoted by its wait included).
    popped_prompt: int = 0


class ReportScheduler:
    """Latest-value-per-device queue in front of a ``TokenBucket``.

    ``reserve``: tokens periodic reports leave in the bucket; None (the default): one per device, at most
    ``burst - 1``, the devices being ``devices`` (how many may report promptly at once: one per GPU of the node)
    or, when that is None too, those offered for so far and not forgotten. ``promote_after_s``: a periodic
    report pending this long counts as prompt."""

    def __init__(
        self,
        bucket: TokenBucket,
        *,
        reserve: int | None = None,
        devices: int | None = None,
        promote_after_s: float = PROMOTE_AFTER_S,
    ) -> None:
        if reserve is not None and not 0 <= reserve < bucket.burst:
            raise ValueError(f"reserve must be in 0..{bucket.burst - 1} (burst - 1), got {reserve}")
        if devices is not None and devices < 0:
            raise ValueError(f"devices must be >= 0, got {devices}")
        if promote_after_s <= 0:
            raise ValueError(f"promote_after_s must be > 0, got {promote_after_s}")
        self.bucket = bucket
        self.reserve_tokens = reserve
        self.devices = devices
        self.promote_after_s = promote_after_s
        self._clock = bucket.clock
        self._status: OrderedDict[str, StatusReport] = OrderedDict()
        self._state: OrderedDict[str, StateReport] = OrderedDict()
        #: The devices offered for and not forgotten (the default reserve: one token each).
        self._devices: set[str] = set()
        self.stats = SchedulerStats()

    @property
    def reserve(self) -> int:
        """The tokens periodic reports leave in the bucket now."""
        if self.reserve_tokens is not None:
            return self.reserve_tokens
        devices = self.devices if self.devices is not None else len(self._devices)
        return min(devices, self.bucket.burst - 1)

    # --- offers ---------------------------------------------------------------------------------------
    def offer_status(self, namespace: str, name: str, twins: Iterable[Twin], *, prompt: bool = False) -> None:
        """Queue the twins of one device; merged by twin name into any pending report of that device (which
        becomes prompt when either is)."""
        new = tuple(twins)
        if not new:
            return
        key = f"{namespace}/{name}"
        self._devices.add(key)
        self.stats.offered_status += 1
        pending = self._status.get(key)
        if pending is None:
            self._status[key] = StatusReport(namespace, name, new, prompt, self._clock.monotonic())
            return
        self.stats.coalesced += 1
        merged = {t.name: t for t in pending.twins}
        merged.update({t.name: t for t in new})
        # keep its place in the round-robin order
        self._status[key] = StatusReport(
            namespace, name, tuple(merged.values()), pending.prompt or prompt, pending.since_s
        )

    def offer_state(self, namespace: str, name: str, state: str, *, prompt: bool = False) -> None:
        key = f"{namespace}/{name}"
        self._devices.add(key)
        self.stats.offered_state += 1
        pending = self._state.get(key)
        if pending is not None:
            self.stats.coalesced += 1
            self._state[key] = StateReport(namespace, name, state, pending.prompt or prompt, pending.since_s)
            return
        self._state[key] = StateReport(namespace, name, state, prompt, self._clock.monotonic())

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
        self._status[report.key] = StatusReport(
            report.namespace,
            report.name,
            tuple(merged.values()),
            report.prompt or pending.prompt,
            min(report.since_s, pending.since_s),
        )

    def forget(self, namespace: str, name: str) -> None:
        """Drop whatever is pending for a removed device."""
        key = f"{namespace}/{name}"
        self._devices.discard(key)
        for queue in (self._status, self._state):
            if queue.pop(key, None) is not None:
                self.stats.dropped += 1

    # --- taking ---------------------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        return len(self._status) + len(self._state)

    def peek_pending(self) -> list[Report]:
        return [*self._state.values(), *self._status.values()]

    def _is_prompt(self, report: Report, now: float) -> bool:
        return report.prompt or now - report.since_s >= self.promote_after_s

    def _next(self, now: float) -> tuple[Report, bool] | None:
        """The report whose turn it is, and whether it is prompt."""
        for queue in (self._state, self._status):
            for report in queue.values():
                if self._is_prompt(report, now):
                    return report, True
        for queue in (self._status, self._state):
            for report in queue.values():
                return report, False
        return None

    def pop_ready(self) -> Report | None:
        """The next report to send if the budget allows one now (a token is taken), else None."""
        now = self._clock.monotonic()
        turn = self._next(now)
        if turn is None:
            return None
        report, prompt = turn
        if not self.bucket.try_take(keep=0.0 if prompt else self.reserve):
            return None
        if isinstance(report, StateReport):
            del self._state[report.key]
            self.stats.popped["state"] += 1
        else:
            del self._status[report.key]
            self.stats.popped["status"] += 1
        self.stats.popped_prompt += prompt
        return report

    def wait_s(self) -> float | None:
        """Seconds until ``pop_ready`` can return something; None when nothing is pending."""
        now = self._clock.monotonic()
        turn = self._next(now)
        if turn is None:
            return None
        if turn[1]:
            return self.bucket.wait_s()
        # Periodic only: the reserve's wait, or sooner when the oldest is promoted (then a token will do).
        pending: list[Report] = [*self._state.values(), *self._status.values()]
        oldest_s = min(r.since_s for r in pending)
        promoted_in_s = oldest_s + self.promote_after_s - now
        return min(self.bucket.wait_s(keep=self.reserve), max(promoted_in_s, self.bucket.wait_s()))
