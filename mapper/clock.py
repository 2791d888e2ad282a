"""Time, injected. Loops take a ``Clock`` so tests run on fake time instead of real sleeps; ``TokenBucket``, the one
rate limit over it (EdgeCore's call budget, the per-device door on inbound messages, the replay's byte-rate cap)."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float: ...
    def wall_ms(self) -> int: ...


class SystemClock:
    """The real clock."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall_ms(self) -> int:
        return time.time_ns() // 1_000_000


@dataclass
class FakeClock:
    """A clock that moves only when told to (``advance``). Wall time starts at ``start_wall_ms``."""

    now_s: float = 1000.0
    start_wall_ms: int = 1_780_000_000_000
    _start_s: float = field(init=False)

    def __post_init__(self) -> None:
        self._start_s = self.now_s

    def monotonic(self) -> float:
        return self.now_s

    def wall_ms(self) -> int:
        return self.start_wall_ms + round((self.now_s - self._start_s) * 1000)

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("time does not run backwards")
        self.now_s += seconds


class TokenBucket:
    """``rate_per_s`` tokens a second, holding at most ``burst`` (>= 1); starts full; time from ``clock``.

    ``try_take(n, keep)`` takes ``n`` tokens when that leaves at least ``keep``. ``take_forced(n)`` takes them
    even into debt: later takes wait until it is repaid, so the average rate holds (a call that must not wait,
    or a message of ``n`` bytes against a byte rate). ``wait_s(n, keep)``: seconds until ``try_take(n, keep)``
    would succeed. A bucket of ``burst`` 1 that is taken from with ``take_forced(nbytes)`` after ``wait_s()``
    paces evenly: each message waits until the one before it is paid for, and idle time saves up nothing."""

    __slots__ = ("_at", "_clock", "_tokens", "burst", "rate_per_s")

    def __init__(self, clock: Clock, *, rate_per_s: float, burst: int) -> None:
        if not rate_per_s > 0:
            raise ValueError(f"rate_per_s must be > 0, got {rate_per_s}")
        if not burst >= 1:
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
            self._at = now

    @property
    def tokens(self) -> float:
        """The tokens now (negative while in debt)."""
        self._refill()
        return self._tokens

    @property
    def clock(self) -> Clock:
        return self._clock

    def try_take(self, n: float = 1.0, keep: float = 0.0) -> bool:
        """Take ``n`` tokens if that leaves ``keep`` tokens in the bucket; whether it did."""
        self._refill()
        if self._tokens >= n + keep:
            self._tokens -= n
            return True
        return False

    def take_forced(self, n: float = 1.0) -> None:
        """Take ``n`` tokens even if that leaves the bucket in debt."""
        self._refill()
        self._tokens -= n

    def wait_s(self, n: float = 1.0, keep: float = 0.0) -> float:
        """Seconds until ``n`` tokens are there that leave ``keep`` (0 when they are now)."""
        self._refill()
        if self._tokens >= n + keep:
            return 0.0
        return (n + keep - self._tokens) / self.rate_per_s


async def sleep_or_wake(event: asyncio.Event, timeout_s: float) -> None:
    """Sleep ``timeout_s`` or until ``event`` is set, then clear it.

    A timer sets the event instead of ``asyncio.wait_for``: on Python 3.11 ``wait_for`` swallows a cancellation
    that arrives in the same loop iteration as the wake-up, and the loop then never stops (a hung shutdown); it
    also costs a task per wait."""
    if timeout_s > 0 and not event.is_set():
        handle = asyncio.get_running_loop().call_later(timeout_s, event.set)
        try:
            await event.wait()
        finally:
            handle.cancel()
    event.clear()


def next_on_grid(now_s: float, period_s: float, slack_s: float = 0.0) -> float:
    """The first multiple of ``period_s`` (on the monotonic clock) after ``now_s + slack_s``.

    The GPUs' due times and the NVML event poll lie on this grid, so work with the same (or a whole multiple of the)
    period wake at the same instant: one wake-up serves them all, and on a small VM a wake-up costs more CPU than
    the work it wakes for. ``slack_s`` (at most half a period counts) keeps a loop that ran a hair before a grid
    point from being due again at that point."""
    return (math.floor((now_s + min(slack_s, period_s / 2)) / period_s) + 1) * period_s


def format_duration_s(seconds: float) -> str:
    """A duration for people, rounded to what matters: ``0.25 s``, ``2.9 s``, ``60 s``, ``299 s``, ``47 min``,
    ``3.5 h`` (no ``59.8892 s``)."""
    if not math.isfinite(seconds):
        return f"{seconds} s"
    x = max(0.0, seconds)
    if x < 1:
        return f"{x:.2g} s"
    if x < 10:
        return f"{round(x, 1):g} s"
    if x < 600:
        return f"{x:.0f} s"
    if x < 7200:
        return f"{x / 60:.0f} min"
    return f"{x / 3600:.1f} h"
