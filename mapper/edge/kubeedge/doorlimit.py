"""Rate limits at the doors: a token bucket per key (a device, for deltas from the broker), pure (time from a
``Clock``, the buckets ``mapper.clock.TokenBucket``).

Whoever may publish on the node's broker may send deltas, and each delta may change a GPU setting and costs a
parse, a store write and an NVML call: ``InboundLimiter`` lets each device have ``rate_per_s`` messages per
second with bursts of ``burst``; the excess is dropped, counted by reason, and logged once per
``log_interval_s`` (the first drop at once, then one summary line per interval naming the keys and counts), so a
flood cannot flood the log either. At most ``max_keys`` buckets are kept (a flood over made-up device names
cannot grow memory): beyond that the oldest idle bucket is forgotten.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from mapper.clock import Clock, TokenBucket
from mapper.wire.topics import DEVICE_PREFIX, device_of_topic

log = logging.getLogger(__name__)


class InboundLimiter:
    """Per-key token buckets plus drop counting and rate-limited logging for one kind of inbound message."""

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
        self._pending: dict[tuple[str, str], int] = {}
        self._last_log_s: float | None = None

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

    def allow(self, key: str) -> bool:
        """Take a token from ``key``'s bucket; False (and the drop counted) when it is empty."""
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= self.max_keys:
                self._buckets.popitem(last=False)
            bucket = self._buckets[key] = TokenBucket(self._clock, rate_per_s=self.rate_per_s, burst=self.burst)
        else:
            self._buckets.move_to_end(key)
        if bucket.try_take():
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
