"""Rate limits at the doors: a token bucket per key (a device, for deltas from the broker), pure (time from a
``Clock``, the buckets ``mapper.clock.TokenBucket``, timers from the ``schedule`` it is handed).

Whoever may publish on the node's broker may send deltas, and each delta may change a GPU setting and costs a
store write, an NVML call and an ack: ``InboundLimiter`` lets each device have ``rate_per_s`` messages per second
with bursts of ``burst``. What happens to a message over that rate depends on what it carries:

* a desired value (``gate_latest``, the deltas) is never lost to the limit: the message is read (at most
  ``inboundMaxBytes``) and its values **wait** for the device's next token, merged with the others waiting for
  that device, the newest per property (by version) winning; when the token comes they are applied together, as
  one message. A value replaced while it waited is ``superseded``: the one kind of drop a desired value can
  suffer, counted. ``on_deferred`` is told each property that starts to wait (the mapper acks it ``pending``,
  reason ``deferred``), so a flood costs at most a bucket's rate of applications and a bounded set of waiting
  values (the writable properties of the devices this mapper serves);
* anything else (``gate``: membership updates, which are only logged) is dropped unread.

Drops are counted by reason and logged once per ``log_interval_s`` (the first drop at once, then one summary line
per interval naming the keys and counts), so a flood cannot flood the log either. At most ``max_keys`` buckets are
kept (a flood over made-up device names cannot grow memory): beyond that the oldest idle bucket is forgotten.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from mapper.clock import Clock, TokenBucket
from mapper.wire.topics import DEVICE_PREFIX, device_of_topic

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Versioned:
    """One desired value of a message and its version (the delta's timestamp, else the time it was received)."""

    value: str
    version_ms: int


#: What a message read at the door carries: property -> its value and version.
Values = Mapping[str, Versioned]


class Timer(Protocol):
    def cancel(self) -> None: ...


#: ``schedule(delay_s, callback)``: run ``callback`` after ``delay_s`` seconds (``loop.call_later``).
Schedule = Callable[[float, Callable[[], None]], Timer]


class InboundLimiter:
    """Per-key token buckets plus drop counting and rate-limited logging for one kind of inbound message; the
    values waiting for a token (``gate_latest``)."""

    def __init__(
        self,
        what: str,
        rate_per_s: float,
        burst: int,
        *,
        clock: Clock,
        log_interval_s: float = 60.0,
        max_keys: int = 4096,
    ) -> None:
        if rate_per_s <= 0:
            raise ValueError(f"{what}: rate_per_s must be > 0, got {rate_per_s}")
        if burst < 1:
            raise ValueError(f"{what}: burst must be >= 1, got {burst}")
        self.what = what
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.log_interval_s = log_interval_s
        self.max_keys = max_keys
        self._clock = clock
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()
        #: Messages dropped since start, by reason (``rate-limited``, ``too-large``, ``malformed``, ...).
        self.dropped: dict[str, int] = {}
        #: Desired values that waited for their device's token (``gate_latest``), applied later or superseded.
        self.deferred = 0
        self._pending: dict[tuple[str, str], int] = {}
        self._last_log_s: float | None = None
        #: Values waiting for a token, by key, and each key's timer.
        self._waiting: dict[str, dict[str, Versioned]] = {}
        self._timers: dict[str, Timer] = {}
        #: ``gate_latest``'s ``apply`` (one handler of desired values per limiter: its keys share the buckets).
        self._apply: Callable[[str, Values], Any] | None = None

    def gate(self, handler: Callable[[str, bytes], Any], max_bytes: int) -> Callable[[str, bytes], Any]:
        """``handler`` for MQTT messages behind the door: a payload over ``max_bytes`` is dropped unread
        (``too-large``, its token not spent), then the message's device (or, for a node topic, the topic) must
        have a token."""

        def on_message(topic: str, payload: bytes) -> Any:
            key = message_key(topic)
            if len(payload) > max_bytes:
                self.drop(key, "too-large")
                return None
            if not self.allow(key):
                return None
            return handler(topic, payload)

        return on_message

    def gate_latest(
        self,
        read: Callable[[str, bytes], Values],
        apply: Callable[[str, Values], Any],
        max_bytes: int,
        *,
        schedule: Schedule,
        on_deferred: Callable[[str, Values], Any] | None = None,
        message: str = "message",
    ) -> Callable[[str, bytes], Any]:
        """``handler`` for messages that carry desired values: a payload over ``max_bytes`` is dropped unread
        (``too-large``); then ``read(topic, payload)`` gives its values (a ValueError naming what is wrong is
        logged as ``<message> refused: ...`` within the rate, counted as ``refused`` over it). They are
        ``apply``-ed at once (``apply(key, values)``) when the key has a token and nothing waiting, else they wait
        (see the module): ``on_deferred(key, values)`` is told the properties that start to wait, and
        ``schedule`` wakes the key when its next token is there. One such handler per limiter."""
        if self._apply is not None:
            raise ValueError(f"{self.what}: one handler of desired values per limiter")
        self._apply = apply

        def on_message(topic: str, payload: bytes) -> Any:
            key = message_key(topic)
            if len(payload) > max_bytes:
                self.drop(key, "too-large")
                return None
            if key not in self._waiting and self._bucket(key).try_take():
                try:
                    values = read(topic, payload)
                except ValueError as exc:
                    log.warning("%s refused: %s", message, exc)
                    return None
                return apply(key, values) if values else None
            try:
                values = read(topic, payload)
            except ValueError:
                self.drop(key, "refused")
                return None
            started = self._wait(key, values, schedule)
            if started and on_deferred is not None:
                on_deferred(key, started)
            return None

        return on_message

    def waiting(self, key: str) -> Values:
        """The values waiting for ``key``'s token."""
        return dict(self._waiting.get(key, {}))

    def flush(self) -> None:
        """Apply every value still waiting now, whatever the tokens (at shutdown: the desired store keeps them
        and the next start enforces them)."""
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        waiting, self._waiting = self._waiting, {}
        if self._apply is not None:
            for key, values in waiting.items():
                self._apply(key, values)

    def _wait(self, key: str, values: Values, schedule: Schedule) -> dict[str, Versioned]:
        """Merge ``values`` into ``key``'s waiting ones (the newer version per property wins; the other is
        superseded); the properties that start to wait."""
        waiting = self._waiting.setdefault(key, {})
        started: dict[str, Versioned] = {}
        for prop, value in values.items():
            held = waiting.get(prop)
            if held is None:
                waiting[prop] = started[prop] = value
                self.deferred += 1
                continue
            self.drop(key, "superseded")  # one of the two is: the older version, or the one held on a tie
            if value.version_ms >= held.version_ms:
                waiting[prop] = value
        if not waiting:
            del self._waiting[key]
        elif key not in self._timers:
            self._timers[key] = schedule(self._bucket(key).wait_s(), lambda: self._release(key, schedule))
        return started

    def _release(self, key: str, schedule: Schedule) -> None:
        """``key``'s timer: its waiting values applied as one message once it has a token, else wait on."""
        self._timers.pop(key, None)
        values = self._waiting.get(key)
        if not values:
            return
        bucket = self._bucket(key)
        if not bucket.try_take():
            self._timers[key] = schedule(bucket.wait_s(), lambda: self._release(key, schedule))
            return
        del self._waiting[key]
        if self._apply is not None:
            self._apply(key, values)

    def _bucket(self, key: str) -> TokenBucket:
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= self.max_keys:
                # The oldest idle bucket; one whose values wait is kept (they are bounded by the devices served).
                idle = next((k for k in self._buckets if k not in self._waiting), None)
                if idle is not None:
                    del self._buckets[idle]
            bucket = self._buckets[key] = TokenBucket(self._clock, rate_per_s=self.rate_per_s, burst=self.burst)
        else:
            self._buckets.move_to_end(key)
        return bucket

    def allow(self, key: str) -> bool:
        """Take a token from ``key``'s bucket; False (and the drop counted) when it is empty."""
        if self._bucket(key).try_take():
            return True
        self.drop(key, "rate-limited")
        return False

    def drop(self, key: str, reason: str) -> None:
        """Count a message dropped for ``reason`` and log, at most once per interval, what was dropped."""
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        self._pending[(key, reason)] = self._pending.get((key, reason), 0) + 1
        now = self._clock.monotonic()
        if self._last_log_s is not None and now - self._last_log_s < self.log_interval_s:
            return
        first = self._last_log_s is None
        self._last_log_s = now
        pending, self._pending = self._pending, {}
        parts = ", ".join(f"{k} {r} x{n}" for (k, r), n in sorted(pending.items()))
        limit = f"limit {self.rate_per_s:g}/s per device, burst {self.burst}"
        if first:
            every = self.log_interval_s
            log.warning(
                "%s dropped: %s (%s); further drops are logged at most once per %gs", self.what, parts, limit, every
            )
        else:
            log.warning("%s dropped since the last report: %s (%s)", self.what, parts, limit)


def message_key(topic: str) -> str:
    """The bucket of a message: ``namespace/name`` for a KubeEdge device topic, else the topic itself."""
    if topic.startswith(DEVICE_PREFIX + "/"):
        try:
            return "/".join(device_of_topic(topic))
        except ValueError:
            return "(bad device topic)"
    return topic
