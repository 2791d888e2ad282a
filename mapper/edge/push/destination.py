"""One push destination's own loop: its samples from the push buffer to its writer, in order, whatever happens.

A ``Destination`` is one writer (``mapper.shared.push.PushWriter``) and its queue, the samples the push buffer
holds for it (``PushStore``, implemented by ``mapper.edge.storage.pushbuffer.PushBuffer``). Its task sends the
oldest first, up to the writer's ``max_batch`` at a time, and deletes them from the buffer once written:

* a ``TransientError`` (the destination is down, slow, or answered 429/5xx) keeps them; the same samples are sent
  again after a backoff (1 s doubling to ``retry_max_s``, never sooner than the error's ``retry_after_s``: an
  OTLP receiver's ``Retry-After``), so what waited goes out in order once the destination answers again;
* a ``PermanentError`` (a 4xx, an authentication refused) drops them by rule: counted (``refused``), logged once a
  minute, never retried; the next samples are tried as they come. A ``PartlyRefusedError`` (a DB writer refused
  some samples of the batch and wrote the rest) drops only those; the rest count as delivered;
* sending is paced to ``rate_per_s`` samples a second (a token bucket of one batch), so a long backlog is
  replayed at that rate, not in one burst.

Each destination runs apart (its own task, its own connection), so a slow or dead one delays no other and never
the collect loop, which only stores samples (``mapper.edge.push.router``). Pure loop logic over Protocols.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from mapper.clock import Clock, TokenBucket
from mapper.edge.push.wire import decode_sample
from mapper.errors import PartlyRefusedError, PermanentError, TransientError
from mapper.shared.push import PushSample, PushWriter

log = logging.getLogger(__name__)

#: How often a destination that stays down or keeps refusing is logged again.
LOG_EVERY_S = 60.0
#: Samples one write takes when the writer does not say (``max_batch``).
DEFAULT_BATCH = 100

#: A destination's states: nothing sent yet, the last write delivered, the last write failed (its samples wait),
#: the last write was refused (its samples dropped) or the writer cannot be made.
STATES = ("waiting", "ok", "down", "refused")


class PushStore(Protocol):
    """What the push loops need of ``mapper.edge.storage.pushbuffer.PushBuffer``."""

    def put_many(self, rows: Sequence[tuple[str, str, int, bytes]]) -> None: ...
    def pending(self, key: str, limit: int) -> Sequence[tuple[int, bytes]]: ...
    def ack(self, key: str, ids: Sequence[int]) -> None: ...
    def drop(self, key: str, ids: Sequence[int], reason: str) -> None: ...
    def backlog(self, key: str) -> tuple[int, int]: ...
    def keys(self) -> Mapping[str, str]: ...
    def drops(self) -> Mapping[tuple[str, str], int]: ...
    def forget(self, key: str) -> None: ...


Sleep = Callable[[float], Awaitable[None]]


@dataclass(frozen=True)
class DestinationStatus:
    """One destination as ``gpu-mapper status`` and ``/metrics`` show it."""

    key: str
    kind: str
    #: One of ``STATES``.
    state: str
    backlog_samples: int = 0
    backlog_bytes: int = 0
    delivered_samples: int = 0
    #: Writes that failed and were kept (each tried again later).
    failures: int = 0
    #: Samples dropped, by reason: ``refused`` (by the destination), ``size``, ``age`` (the buffer's bounds).
    dropped: Mapping[str, int] = field(default_factory=dict)
    last_error: str = ""
    #: Wall time (ms) of the last delivered write; None before the first.
    last_success_ms: int | None = None
    #: Device properties that send to it now (0: it only drains what it holds).
    properties: int = 0


class Destination:
    """One destination's queue and task (``run``). ``writer`` None: it cannot be made (``refusal`` says why);
    whatever the buffer holds for it is dropped as refused."""

    def __init__(
        self,
        key: str,
        kind: str,
        store: PushStore,
        writer: PushWriter | None,
        *,
        clock: Clock,
        refusal: str = "",
        refusal_reason: str = "unavailable",
        rate_per_s: float = 200.0,
        retry_max_s: float = 10.0,
        write_timeout_s: float = 30.0,
        sleep: Sleep | None = None,
    ) -> None:
        if writer is None and not refusal:
            raise ValueError(f"destination {key}: no writer and no reason why")
        self.key = key
        self.kind = kind
        self.store = store
        self.writer = writer
        self.clock = clock
        self.batch = max(1, int(getattr(writer, "max_batch", DEFAULT_BATCH))) if writer is not None else DEFAULT_BATCH
        self.retry_max_s = retry_max_s
        self.write_timeout_s = write_timeout_s
        self._sleep: Sleep = sleep or asyncio.sleep
        self._pace = TokenBucket(clock, rate_per_s=rate_per_s, burst=self.batch)
        self._wake = asyncio.Event()
        self.state = "refused" if writer is None else "waiting"
        self.last_error = refusal
        #: Why the writer cannot be made, short and twin-safe (the ``push_status`` twin shows it).
        self.refusal_reason = refusal_reason or "unavailable"
        self.last_success_ms: int | None = None
        self.delivered = 0
        self.failures = 0
        self.properties = 0
        self._backoff_s = 1.0
        self._logged_down_s: float | None = None
        self._logged_refused_s: float | None = None
        self._refused_since_log = 0

    def wake(self) -> None:
        """Samples were stored for it: look now (a backoff in progress is not cut short)."""
        self._wake.set()

    def status(self) -> DestinationStatus:
        samples, size = self.store.backlog(self.key)
        dropped = {reason: n for (key, reason), n in self.store.drops().items() if key == self.key}
        return DestinationStatus(
            key=self.key,
            kind=self.kind,
            state=self.state,
            backlog_samples=samples,
            backlog_bytes=size,
            delivered_samples=self.delivered,
            failures=self.failures,
            dropped=dropped,
            last_error=self.last_error,
            last_success_ms=self.last_success_ms,
            properties=self.properties,
        )

    async def run(self) -> None:
        """Send what the buffer holds for this destination, oldest first, until cancelled."""
        while True:
            rows = self.store.pending(self.key, self.batch)
            if not rows:
                self._wake.clear()
                if not self.store.pending(self.key, 1):  # (stored between the read and the clear)
                    await self._wake.wait()
                continue
            if self.writer is None:
                self.store.drop(self.key, [i for i, _ in rows], "refused")
                continue
            samples, ids = self._decode(rows)
            if not samples:
                continue
            wait_s = self._pace.wait_s(0.0)
            if wait_s > 0:
                await self._sleep(wait_s)
            self._pace.take_forced(len(samples))
            await self._write(samples, ids)

    def _decode(self, rows: Sequence[tuple[int, bytes]]) -> tuple[list[PushSample], list[int]]:
        samples: list[PushSample] = []
        ids: list[int] = []
        bad: list[int] = []
        for row_id, payload in rows:
            try:
                samples.append(decode_sample(payload))
            except ValueError as exc:
                log.error("push %s: a stored sample does not decode, dropped: %s", self.key, exc)
                bad.append(row_id)
                continue
            ids.append(row_id)
        if bad:
            self.store.drop(self.key, bad, "corrupt")
        return samples, ids

    async def _write(self, samples: list[PushSample], ids: list[int]) -> None:
        assert self.writer is not None
        try:
            async with asyncio.timeout(self.write_timeout_s):
                await self.writer.write(samples)
        except PartlyRefusedError as exc:
            refused = {ids[i] for i in exc.refused if 0 <= i < len(ids)}
            written = [i for i in ids if i not in refused]
            if written:
                self._delivered(written)
            self._refused([i for i in ids if i in refused], exc)
        except PermanentError as exc:
            self._refused(ids, exc)
        except (TransientError, TimeoutError) as exc:
            await self._failed(exc, getattr(exc, "retry_after_s", 0.0))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a writer's bug: kept and tried again, with its traceback in the log
            log.exception("push %s: the writer raised; its samples are kept and tried again", self.key)
            await self._failed(exc, 0.0)
        else:
            self._delivered(ids)

    def _delivered(self, ids: list[int]) -> None:
        self.store.ack(self.key, ids)
        self.delivered += len(ids)
        self.last_success_ms = self.clock.wall_ms()
        if self.state in ("down", "refused"):
            waiting = self.store.backlog(self.key)[0]
            log.info("push %s: delivering again (%d samples still waiting)", self.key, waiting)
        self.state = "ok"
        self._backoff_s = 1.0
        self._logged_down_s = None

    async def _failed(self, exc: BaseException, retry_after_s: float) -> None:
        self.failures += 1
        text = str(exc) or type(exc).__name__
        if isinstance(exc, TimeoutError) and not str(exc):
            text = f"no answer within {self.write_timeout_s:g} s"
        self.last_error = text
        self.state = "down"
        now = self.clock.monotonic()
        if self._logged_down_s is None or now - self._logged_down_s >= LOG_EVERY_S:
            self._logged_down_s = now
            waiting = self.store.backlog(self.key)[0]
            log.warning(
                "push %s: %s; its samples are kept (%d waiting) and sent again in order (logged once a minute)",
                self.key,
                text,
                waiting,
            )
        delay_s = max(self._backoff_s, retry_after_s)
        self._backoff_s = min(self._backoff_s * 2, self.retry_max_s)
        await self._sleep(delay_s)

    def _refused(self, ids: list[int], exc: PermanentError) -> None:
        self.store.drop(self.key, ids, "refused")
        self.state = "refused"
        self.last_error = str(exc)
        self._refused_since_log += len(ids)
        now = self.clock.monotonic()
        if self._logged_refused_s is None or now - self._logged_refused_s >= LOG_EVERY_S:
            self._logged_refused_s = now
            log.warning(
                "push %s refused %d samples, dropped by rule (not retried): %s (logged once a minute)",
                self.key,
                self._refused_since_log,
                exc,
            )
            self._refused_since_log = 0

    async def aclose(self) -> None:
        if self.writer is not None:
            try:
                await self.writer.aclose()
            except Exception as exc:  # closing must not stop the others' closing
                log.warning("push %s: closing its writer failed: %s", self.key, exc)
