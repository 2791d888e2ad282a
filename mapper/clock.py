"""Time, injected. Loops take a ``Clock`` so tests run on fake time instead of real sleeps."""

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
