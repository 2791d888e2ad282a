"""The publish/replay loop: encoded batches -> buffer (committed) -> MQTT (PUBACK) -> buffer ack.

Pure loop logic over Protocols: it sees the buffer (``BufferLike``) and publishers (``PublishFn``), never paho
or SQLite. There is no separate "live" path: every batch is stored first and sent from the buffer in id order,
so a batch is removed only after the broker acknowledged it, whatever happens in between.

* Up to ``max_in_flight`` publishes wait for their PUBACK at once (throughput on slow links).
* A failed publish blocks its broker address: the rows of that broker are skipped (other brokers go on) until
  ``notify_connected(address)`` or ``retry_s`` later, then sending resumes from the oldest unacked row of it.
  A cut during replay can reorder up to ``max_in_flight`` batches; consumers restore order and drop
  duplicates with (device, boot_id, seq), which every batch carries.
* On (re)connect of a broker the latest state snapshot of every device goes first (retained), then the
  backlog oldest first. An optional ``rate_limit_bytes_per_s`` caps what is sent (payload + topic bytes).
* A replay starts when the link is up (the session says it connected, or a publish went through), never while
  the broker is still away. Its progress (percent, remaining, ETA) is logged every ``progress_log_s`` and kept
  in ``stats()``, remaining bytes included.
* The log of an outage: nothing when it begins (the MQTT session warns once), a count of what is buffered
  while it lasts, rate-limited (after ``outage_log_s``, then at doubling intervals up to ``outage_log_max_s``),
  and one line when the broker is back and the backlog has gone out: how long it was away, how much waited,
  how long the replay took.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from mapper.clock import Clock, TokenBucket, format_duration_s
from mapper.edge.outbox.records import StoredBatch
from mapper.errors import MapperError, PermanentError, TransientError
from mapper.wire.telemetry import EncodedBatch, Route
from mapper.wire.topics import state_topic, telemetry_topic

_T = TypeVar("_T")

log = logging.getLogger(__name__)

#: A broker first reached within this long of a publish that failed before it is a start-up race, not an outage.
STARTUP_RACE_S = 5.0


class BufferStatsLike(Protocol):
    @property
    def bytes(self) -> int: ...
    @property
    def batches(self) -> int: ...


class BufferLike(Protocol):
    """What the shipper needs from ``mapper.edge.storage.buffer.Buffer``."""

    def put(self, batch: StoredBatch) -> int: ...
    def put_many(self, items: Sequence[StoredBatch]) -> list[int]: ...
    def pending(self, limit: int = 100, after_id: int | None = None) -> Sequence[StoredBatch]: ...
    def ack(self, batch_id: int) -> None: ...
    def put_latest(self, device: str, payload: bytes, ts_ms: int | None = None) -> None: ...
    def latest(self) -> Mapping[str, bytes]: ...
    def stats(self) -> BufferStatsLike: ...


class PublishFn(Protocol):
    """``MqttSession.publish``: resolves on PUBACK, raises ``TransientError`` when it cannot."""

    def __call__(
        self, topic: str, payload: bytes, qos: int = 1, retain: bool = False, timeout_s: float = 10.0
    ) -> Awaitable[None]: ...


Sleep = Callable[[float], Awaitable[None]]
PublishTo = Callable[[str], Awaitable[PublishFn]]


@dataclass(frozen=True)
class ShipperStats:
    submitted_batches: int
    submitted_messages: int
    published_batches: int
    published_bytes: int
    publish_failures: int
    replayed_batches: int
    replayed_bytes: int
    replay_remaining_batches: int
    replay_remaining_bytes: int
    replay_active: bool
    states_published: int
    buffer_failures: int
    in_flight: int


@dataclass
class _Outage:
    """A broker found unreachable: since when (monotonic), and when the next "still unreachable" line is due."""

    since: float
    next_report: float
    report_every: float


@dataclass(frozen=True)
class _Return:
    """A broker back after an outage: how long it was away and what waited then, logged once the backlog is out."""

    address: str
    since: float
    up_at: float
    batches: int
    bytes: int


def format_bytes(n: int) -> str:
    """``512 B``, ``12.3 KiB``, ``4.0 MiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


class TelemetryShipper:
    def __init__(
        self,
        buffer: BufferLike,
        publish: PublishFn,
        *,
        node: str,
        clock: Clock,
        rate_limit_bytes_per_s: float | None = None,
        max_in_flight: int = 20,
        page_size: int = 200,
        publish_timeout_s: float = 10.0,
        retry_s: float = 5.0,
        progress_log_s: float = 10.0,
        outage_log_s: float = 60.0,
        outage_log_max_s: float = 3600.0,
        publish_to: PublishTo | None = None,
        sleep: Sleep | None = None,
    ) -> None:
        if rate_limit_bytes_per_s is not None and not rate_limit_bytes_per_s > 0:
            raise ValueError(f"rate_limit_bytes_per_s must be > 0 or None, got {rate_limit_bytes_per_s}")
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.buffer = buffer
        self.node = node
        self.clock = clock
        self.rate_limit_bytes_per_s = rate_limit_bytes_per_s
        self.max_in_flight = max_in_flight
        self.page_size = page_size
        self.publish_timeout_s = publish_timeout_s
        self.retry_s = retry_s
        self.progress_log_s = progress_log_s
        self.outage_log_s = outage_log_s
        self.outage_log_max_s = max(outage_log_max_s, outage_log_s)
        self._publishers: dict[str, PublishFn] = {"": publish}
        self._publish_to = publish_to
        self._sleep: Sleep = sleep or asyncio.sleep
        self._wake = asyncio.Event()
        self._slots = asyncio.Semaphore(max_in_flight)
        self._in_flight: dict[int, asyncio.Task[None]] = {}
        #: Broker address -> the smallest row id that failed there (sending to it is paused).
        self._blocked: dict[str, int | None] = {}
        self._blocked_since: dict[str, float] = {}
        self._states_due: set[str] = {""}
        self._dirty_states: set[str] = set()
        self._cursor: int | None = None
        #: How often ``_unblock`` moved the cursor back: a page read before that stops there.
        self._rewinds = 0
        self._page: set[int] = set()
        self._closing = False
        #: The byte-rate cap: burst 1, taken from in debt by each message, so each waits until the one before it
        #: is paid for (even pacing; idle time saves up nothing).
        self._pace = (
            None if rate_limit_bytes_per_s is None else TokenBucket(clock, rate_per_s=rate_limit_bytes_per_s, burst=1)
        )
        # counters
        self.submitted_batches = 0
        #: Status messages (acks, policy events) stored to go out with the telemetry.
        self.submitted_messages = 0
        self.published_batches = 0
        self.published_bytes = 0
        self.publish_failures = 0
        self.replayed_batches = 0
        self.replayed_bytes = 0
        self.states_published = 0
        self.buffer_failures = 0
        #: The buffer's last error while it fails ("" while it works): logged once.
        self._buffer_error = ""
        # replay progress
        self._replay_active = False
        self._replay_total = 0
        self._replay_started = 0.0
        self._replay_last_log = 0.0
        self._replay_first_batches = 0
        self._replay_first_bytes = 0
        # outages: brokers found unreachable, those back whose backlog is still going out, links known up
        self._outages: dict[str, _Outage] = {}
        self._returns: dict[str, _Return] = {}
        self._link_up: set[str] = set()
        #: Brokers whose link has been up since start.
        self._ever_up: set[str] = set()

    # ------------------------------------------------------------------------------------------ inputs

    def submit(self, batch: EncodedBatch, route: Route | None = None) -> int | None:
        """Store a batch (committed before this returns) for publishing; returns its buffer id.

        ``route`` None = the device's default topic on the default broker, QoS 1, not retained. Returns None
        when the buffer could not store it (counted in ``buffer_failures``).
        """
        return self.submit_many(((batch, route),))[0]

    def submit_many(self, pairs: Sequence[tuple[EncodedBatch, Route | None]]) -> list[int | None]:
        """Store several batches in one buffer transaction (committed before this returns); their buffer ids.

        Each (batch, route) as ``submit`` takes it, e.g. the batches every GPU cut in one collect round: one
        commit for all, and the loop is woken once. When the buffer cannot store them, none is stored: every
        id is None and every batch is counted in ``buffer_failures``. A batch the buffer refuses (ValueError)
        stores none of them either, and the error propagates, as from ``submit``.
        """
        if not pairs:
            return []
        node = self.node
        items = [
            StoredBatch(
                batch.device,
                batch.uuid,
                batch.boot_id,
                batch.seq,
                batch.ts_first_ms,
                batch.ts_last_ms,
                telemetry_topic(node, batch.device) if route is None else route.topic,
                batch.payload,
                1 if route is None else route.qos,
                False if route is None else route.retain,
                "" if route is None else route.address,
            )
            for batch, route in pairs
        ]
        listed = ", ".join(f"{it.device} seq {it.seq}" for it in items)
        what = f"telemetry: batch {listed}" if len(items) == 1 else f"telemetry: batches {listed}"
        ids = self._store(what, lambda: self.buffer.put_many(items), len(items))
        if ids is None:
            return [None] * len(items)
        self.submitted_batches += len(ids)
        return list(ids)

    def submit_message(
        self, *, device: str, uuid: str, topic: str, payload: bytes, ts_ms: int, qos: int = 1
    ) -> int | None:
        """Store one status message (a desired-state ack, a policy event) to go out in order with the telemetry,
        on the default broker: what the mapper did while the broker was away reaches it when it is back. Not a
        batch (its row has no sequence number); returns its buffer id, or None when it could not be stored."""
        message_id = self._store(
            f"status message for {device} on {topic}",
            lambda: self.buffer.put(
                StoredBatch(
                    device=device,
                    uuid=uuid,
                    boot_id="",
                    seq=-1,
                    ts_first_ms=ts_ms,
                    ts_last_ms=ts_ms,
                    topic=topic,
                    payload=payload,
                    qos=qos,
                )
            ),
        )
        if message_id is not None:
            self.submitted_messages += 1
        return message_id

    def _store(self, what: str, put: Callable[[], _T], count: int = 1) -> _T | None:
        """Run ``put`` (one buffer write of ``count`` rows) and wake the loop; a buffer that cannot store them is
        counted (``count`` failures) and logged, and None returned."""
        try:
            stored = put()
        except TransientError as exc:
            self.buffer_failures += count
            log.error("%s not stored: %s", what, exc)
            return None
        self._wake.set()
        return stored

    def update_state(self, device: str, payload: bytes) -> None:
        """Keep a device's latest state snapshot (published retained first on every reconnect, and soon now). A
        buffer that cannot keep it is logged (once until it can again); the next snapshot tries again."""
        try:
            self.buffer.put_latest(device, payload)
        except MapperError as exc:
            self.buffer_failures += 1
            self._log_buffer_error(f"telemetry: state snapshot of {device} not kept: {exc}")
            return
        self._buffer_error = ""
        self._dirty_states.add(device)
        self._wake.set()

    def _log_buffer_error(self, text: str) -> None:
        """An error of the buffer, logged once until the buffer works again."""
        if not self._buffer_error:
            log.error("%s (logged once until the buffer works again)", text)
        self._buffer_error = text

    def busy_ids(self) -> set[int]:
        """Buffer rows this shipper holds a copy of and may still publish and ack: those in flight and those of
        the page it is going through. Compaction must not rewrite them (an ack would delete the merged row)."""
        return self._page | self._in_flight.keys()

    def note_compacted(self, rows_removed: int) -> None:
        """Compaction merged rows (``rows_removed`` fewer now): a replay's progress counts them as not sent
        rather than done, so its percentage and ETA stay true."""
        if self._replay_active and rows_removed > 0:
            self._replay_total = max(self._replay_total - rows_removed, 0)
        self._wake.set()

    def notify_connected(self, address: str = "") -> None:
        """A broker (re)connected: send it the state snapshots, then resume its backlog (a replay, when it is
        long). Wire it to ``MqttSession.add_on_connect``."""
        self._unblock(address)
        if address == "":
            self._states_due.add("")
        self._link_came_up(address)
        self._wake.set()

    def notify_down(self, address: str = "") -> None:
        """A broker's link went (``MqttSession.add_on_down``): the outage starts now, not at the next failed
        publish."""
        self._begin_outage(address)

    # ------------------------------------------------------------------------------------------ the loop

    async def run(self) -> None:
        """Send forever (until ``stop``). Supervise it as a long-lived task."""
        while not self._closing:
            self._retry_blocked()
            self._report_outages()
            if "" in self._states_due and "" not in self._blocked:
                self._states_due.discard("")
                await self._send_states(all_devices=True)
                continue
            if self._dirty_states and "" not in self._blocked:
                await self._send_states(all_devices=False)
            try:
                rows = self.buffer.pending(self.page_size, self._cursor)
            except MapperError as exc:  # a file that cannot be read now: try again later, never stop
                self._log_buffer_error(f"telemetry: cannot read the buffer: {exc}")
                await self._sleep(self.retry_s)
                continue
            self._buffer_error = ""
            # Rows read but not handled yet: the shipper holds their payloads, so compaction leaves them alone.
            self._page = {row.id for row in rows}
            sent_any = False
            rewinds = self._rewinds
            for row in rows:
                if self._rewinds != rewinds:
                    # A broker came back while this page waited (the rate cap, a free slot) and the cursor went
                    # back to its oldest failed row: read again from there instead of moving the cursor past it
                    # (and sending newer rows before it).
                    break
                self._cursor = row.id
                if self._closing:
                    break
                if row.id in self._in_flight:
                    self._page.discard(row.id)
                    continue
                if row.address in self._blocked:
                    self._block(row.address, row.id)
                    self._page.discard(row.id)
                    continue
                await self._throttle(len(row.payload) + len(row.topic))
                await self._slots.acquire()
                if self._rewinds != rewinds:
                    # Rewound while this row waited: the older rows go first (it is read again after them).
                    self._slots.release()
                    self._page.discard(row.id)
                    break
                if row.address in self._blocked or self._closing:
                    self._slots.release()
                    if row.address in self._blocked:
                        self._block(row.address, row.id)
                    self._page.discard(row.id)
                    continue
                task = asyncio.ensure_future(self._send(row))
                self._in_flight[row.id] = task
                self._page.discard(row.id)
                sent_any = True
                self._log_progress()
            self._page = set()
            idle = not rows or (not sent_any and len(rows) < self.page_size)
            if idle:
                self._log_progress(idle=True)
            if idle and not self._closing:
                self._wake.clear()
                await self._wait_for_work()
        await self._drain()

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Stop taking rows; wait up to ``timeout_s`` for in-flight publishes (unacked rows stay stored)."""
        self._closing = True
        self._wake.set()
        tasks = list(self._in_flight.values())
        if tasks:
            _done, pending = await asyncio.wait(tasks, timeout=timeout_s)
            for t in pending:
                t.cancel()

    async def _wait_for_work(self) -> None:
        """Until a submit/connect wakes us, or ``retry_s`` passes while some broker is blocked."""
        if not self._blocked:
            await self._wake.wait()
            return
        waiter = asyncio.ensure_future(self._wake.wait())
        sleeper = asyncio.ensure_future(self._sleep(self.retry_s))
        try:
            await asyncio.wait({waiter, sleeper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            sleeper.cancel()

    async def _drain(self) -> None:
        tasks = list(self._in_flight.values())
        if tasks:
            await asyncio.wait(tasks)

    async def _publisher(self, address: str) -> PublishFn:
        pub = self._publishers.get(address)
        if pub is None:
            if self._publish_to is None:
                raise PermanentError(f"no publisher for broker {address!r}: the shipper was built without publish_to")
            pub = await self._publish_to(address)
            self._publishers[address] = pub
        return pub

    async def _send(self, row: StoredBatch) -> None:
        try:
            publish = await self._publisher(row.address)
            await publish(row.topic, row.payload, row.qos, row.retain, self.publish_timeout_s)
            if row.address not in self._link_up:
                self._link_came_up(row.address)
        except MapperError as exc:
            self.publish_failures += 1
            self._block(row.address, row.id)
            log.debug("telemetry: publish of %s seq %d failed: %s", row.device, row.seq, exc)
        except Exception:
            self.publish_failures += 1
            self._block(row.address, row.id)
            log.exception("telemetry: publish of %s seq %d raised", row.device, row.seq)
        else:
            try:
                self.buffer.ack(row.id)
            except MapperError as exc:
                log.error("telemetry: ack of buffer row %d failed (it will be sent again): %s", row.id, exc)
            size = len(row.payload)
            self.published_batches += 1
            self.published_bytes += size
            if self._replay_active:
                self.replayed_batches += 1
                self.replayed_bytes += size
        finally:
            self._in_flight.pop(row.id, None)
            self._slots.release()
            self._wake.set()

    async def _send_states(self, *, all_devices: bool) -> None:
        try:
            snapshots = self.buffer.latest()
        except MapperError as exc:
            log.error("telemetry: cannot read state snapshots: %s", exc)
            return
        devices = sorted(snapshots) if all_devices else sorted(self._dirty_states & snapshots.keys())
        self._dirty_states.difference_update(devices)
        if not devices:
            return
        publish = self._publishers[""]
        for device in devices:
            payload = snapshots[device]
            await self._throttle(len(payload))
            try:
                await publish(state_topic(self.node, device), payload, 1, True, self.publish_timeout_s)
            except MapperError as exc:
                self.publish_failures += 1
                self._dirty_states.update(devices)
                self._block("", None)
                log.debug("telemetry: state of %s not published: %s", device, exc)
                return
            self.states_published += 1

    # ------------------------------------------------------------------------------------------ blocking

    def _block(self, address: str, row_id: int | None) -> None:
        """Pause a broker; remember the oldest row that failed or was skipped there (resent on unblock)."""
        if address not in self._blocked:
            self._blocked[address] = row_id
            self._blocked_since[address] = self.clock.monotonic()
            self._begin_outage(address)
        else:
            first = self._blocked[address]
            if row_id is not None and (first is None or row_id < first):
                self._blocked[address] = row_id
        if address == "":
            self._states_due.add("")

    def _unblock(self, address: str) -> None:
        if address not in self._blocked:
            return
        first = self._blocked.pop(address)
        self._blocked_since.pop(address, None)
        if first is not None and (self._cursor is None or first - 1 < self._cursor):
            # Resume from the oldest row of that broker that was not acked.
            self._cursor = first - 1
            self._rewinds += 1

    def _retry_blocked(self) -> None:
        now = self.clock.monotonic()
        for address, since in list(self._blocked_since.items()):
            if now - since >= self.retry_s:
                self._unblock(address)

    # ------------------------------------------------------------------------------------------ outages

    def _begin_outage(self, address: str) -> None:
        """A broker is away (its link went, or a publish to it failed): from now, until it is back. A broker
        lost again before its backlog went out is one outage, from its first start."""
        self._link_up.discard(address)
        if not self._link_up:
            self._replay_active = False  # starts again, with what waits then, when a link is back
        if address in self._outages:
            return
        now = self.clock.monotonic()
        back = self._returns.pop(address, None)
        since = back.since if back is not None else now
        self._outages[address] = _Outage(since, since + self.outage_log_s, self.outage_log_s)
        log.debug("telemetry: broker %r unreachable; buffering its batches", address or "default")

    def _link_came_up(self, address: str) -> None:
        """A broker's link is up (it connected, or a publish went through): what waited goes out now, as a
        replay when it is long; the return is logged once it has gone out."""
        first = address not in self._ever_up
        self._ever_up.add(address)
        self._link_up.add(address)
        outage = self._outages.pop(address, None)
        now = self.clock.monotonic()
        # A broker's first connection a moment after a publish that raced it (the node stream's first sample goes
        # out at start) is no return from an outage: no "back after 0.01 s" line at every start.
        if outage is not None and not (first and now - outage.since < STARTUP_RACE_S):
            batches, nbytes = self._backlog_and_bytes()
            self._returns[address] = _Return(address, outage.since, now, batches, nbytes)
        self._start_replay()

    def _report_outages(self) -> None:
        """While a broker is away: what is buffered, rate-limited (the interval doubles up to its cap)."""
        if not self._outages:
            return
        now = self.clock.monotonic()
        for address, outage in self._outages.items():
            if now < outage.next_report:
                continue
            outage.report_every = min(outage.report_every * 2, self.outage_log_max_s)
            outage.next_report = now + outage.report_every
            batches, nbytes = self._backlog_and_bytes()
            log.info(
                "telemetry: broker %r unreachable for %s: %d batches (%s) buffered; next report in %s",
                address or "default",
                format_duration_s(now - outage.since),
                batches,
                format_bytes(nbytes),
                format_duration_s(outage.report_every),
            )

    def _log_returns(self, now: float) -> None:
        """The brokers back whose backlog has gone out: one line each."""
        for back in self._returns.values():
            log.info(
                "telemetry: broker %r back after %s away; replay done: %d batches (%s) had waited, sent in %s",
                back.address or "default",
                format_duration_s(back.up_at - back.since),
                back.batches,
                format_bytes(back.bytes),
                format_duration_s(now - back.up_at),
            )
        self._returns.clear()

    # ------------------------------------------------------------------------------------------ pacing, progress

    async def _throttle(self, nbytes: int) -> None:
        if self._pace is None:
            return
        wait_s = self._pace.wait_s()
        if wait_s > 0:
            await self._sleep(wait_s)
        self._pace.take_forced(nbytes)

    def _backlog(self) -> int:
        return self._backlog_and_bytes()[0]

    def _backlog_and_bytes(self) -> tuple[int, int]:
        """The buffer's rows waiting and their bytes (``gpu_mapper_buffer_batches`` / ``_bytes``)."""
        try:
            stats = self.buffer.stats()
        except MapperError:
            return 0, 0
        return int(stats.batches), int(stats.bytes)

    def _start_replay(self) -> None:
        """A replay of the backlog, when it is longer than what goes out at once; only while a link is up."""
        if self._replay_active or not self._link_up:
            return
        backlog, nbytes = self._backlog_and_bytes()
        if backlog <= self.max_in_flight:
            return
        self._replay_active = True
        self._replay_total = backlog
        self._replay_started = self.clock.monotonic()
        self._replay_last_log = self._replay_started
        self._replay_first_batches = self.replayed_batches
        self._replay_first_bytes = self.replayed_bytes
        log.debug("telemetry: replay of %d buffered batches (%s) starts", backlog, format_bytes(nbytes))

    @property
    def replay_remaining_batches(self) -> int:
        return self._backlog() if self._replay_active else 0

    @property
    def replay_remaining_bytes(self) -> int:
        """The bytes still to send while a replay goes on (the buffer's, as ``gpu_mapper_buffer_bytes``)."""
        return self._backlog_and_bytes()[1] if self._replay_active else 0

    def _log_progress(self, *, idle: bool = False) -> None:
        """Log replay progress every ``progress_log_s``; notice the end of a replay (and the returns) when idle."""
        if not self._replay_active:
            if idle and self._returns:
                self._log_returns(self.clock.monotonic())
            return
        now = self.clock.monotonic()
        if not idle and now - self._replay_last_log < self.progress_log_s:
            return
        remaining = self._backlog()
        if remaining <= self.max_in_flight:
            if idle or remaining == 0:
                self._replay_active = False
                if self._returns:
                    self._log_returns(now)
                else:
                    log.info(
                        "telemetry: replay done: %d batches (%s) from the buffer sent in %s",
                        self.replayed_batches - self._replay_first_batches,
                        format_bytes(self.replayed_bytes - self._replay_first_bytes),
                        format_duration_s(now - self._replay_started),
                    )
            return
        if now - self._replay_last_log < self.progress_log_s:
            return
        self._replay_last_log = now
        total = max(self._replay_total, remaining)
        done = total - remaining
        elapsed = max(now - self._replay_started, 1e-9)
        rate = done / elapsed
        eta = f"{remaining / rate:.0f}s" if rate > 0 else "unknown"
        log.info(
            "telemetry: replay %.0f%% (%d of %d batches remaining, %.0f batches/s, ETA %s)",
            100.0 * done / total,
            remaining,
            total,
            rate,
            eta,
        )

    def stats(self) -> ShipperStats:
        return ShipperStats(
            submitted_batches=self.submitted_batches,
            submitted_messages=self.submitted_messages,
            published_batches=self.published_batches,
            published_bytes=self.published_bytes,
            publish_failures=self.publish_failures,
            replayed_batches=self.replayed_batches,
            replayed_bytes=self.replayed_bytes,
            replay_remaining_batches=self.replay_remaining_batches,
            replay_remaining_bytes=self.replay_remaining_bytes,
            replay_active=self._replay_active,
            states_published=self.states_published,
            buffer_failures=self.buffer_failures,
            in_flight=len(self._in_flight),
        )
