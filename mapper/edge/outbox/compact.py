"""Backlog compaction: batches waiting in the buffer are merged, per stream and in order, into larger batches.

Pure loop logic over a Protocol (``CompactableBuffer``, which ``mapper.edge.storage.buffer.Buffer`` implements): it
never sees SQLite. Live telemetry is not touched: a batch becomes a candidate only once its last sample is
``min_age_s`` old, which it never is while the broker is up (it is published within a second). Then:

* A stream's candidates are grouped by **slot**: the ``slot_s``-long interval (10 minutes by default, aligned
  to the epoch) that holds a batch's last sample, and only consecutive rows of the stream (in id order) form a
  group. A group is merged once its slot is over (with ``min_age_s`` more, so every batch of it is a
  candidate), or earlier when it holds ``partial_after`` batches that were not merged yet (a merged batch may
  be merged again with the batches after it). So a 10-minute slot costs about ten merges, whatever the backlog.
* Once the **cold slot** (``cold_slot_s``, an hour by default) that holds a row's last sample is over, the rows
  of its slots form one group again and merge into one batch: a day offline ends as 24 rows per stream.
* A merge decodes the group, makes one merged batch (``mapper.wire.telemetry.merge_batches``: the concatenation of
  the originals, keeping each one's seq as a part; format version 3 while the slot is open, since a later merge
  replaces it, and format 4, the cold form, planned column by column at several times the CPU, once the slot
  is over; a lone format 3 row of a slot that is over is re-encoded so) and hands it to
  ``CompactableBuffer.replace``: ONE transaction in which the last row takes the merged payload and the others
  are deleted, refused when any of them changed meanwhile (acked, dropped). A merge that would not save bytes
  is not stored, so compaction never grows the buffer.
* Rows the shipper may still publish and ack from a copy it holds (its current page, those in flight) are
  left alone (``busy``): an ack of a stale copy would delete the merged row.
* ``run`` works in the background within ``cpu_fraction`` of one core: the decoding and encoding of a merge
  runs in a worker thread, and after each merge the loop sleeps long enough that the merge's CPU time is at
  most that fraction of the time passed. ``compact_all`` does every merge due now at once (the
  ``gpu-mapper buffer compact`` command, benchmarks, tests).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from mapper.clock import Clock
from mapper.edge.outbox.records import CompactionRow
from mapper.errors import ConfigError, MapperError
from mapper.wire.telemetry import (
    MERGED_FORMAT_VERSION,
    MERGED_FORMAT_VERSION_3,
    BatchCodec,
    BatchFormatError,
    decode_batch,
    merge_batches,
)

log = logging.getLogger(__name__)


class CompactableBuffer(Protocol):
    """What compaction needs from ``mapper.edge.storage.buffer.Buffer``."""

    def compaction_rows(self, *, before_ms: int, after_id: int = 0, limit: int = 20000) -> Sequence[CompactionRow]: ...
    def payloads(self, ids: Sequence[int]) -> Mapping[int, bytes]: ...
    def replace(self, originals: Mapping[int, bytes], payload: bytes, ts_last_ms: int) -> bool: ...


@dataclass(frozen=True)
class CompactionSettings:
    #: A batch is a candidate once its last sample is this old.
    min_age_s: float = 30.0
    #: The slot of a merged batch while its slot is open: what a merge of waiting batches spans at most.
    slot_s: float = 600.0
    #: The cold slot: once it is over, the merged batches of its slots are merged again into one (format 4), so
    #: a merged batch spans at most this long (at least ``slot_s``). Fewer, longer rows: less of the SQLite file
    #: goes to row overhead and part-filled pages, and the columns' plans span more rows.
    cold_slot_s: float = 3600.0
    #: Merge a slot before it is over once it holds this many batches not merged yet.
    partial_after: int = 6
    #: At most this fraction of one core, averaged over each merge and the pause after it (``run``).
    cpu_fraction: float = 0.05
    #: How often ``run`` looks for work when there was none.
    interval_s: float = 30.0

    @property
    def cold_slot_ms(self) -> float:
        """The cold slot in ms: ``cold_slot_s``, or ``slot_s`` when that is longer."""
        return max(self.cold_slot_s, self.slot_s) * 1000

    def __post_init__(self) -> None:
        if not self.min_age_s >= 0:
            raise ValueError(f"compaction min_age_s must be >= 0, got {self.min_age_s}")
        if not self.slot_s > 0:
            raise ValueError(f"compaction slot_s must be > 0, got {self.slot_s}")
        if not self.cold_slot_s > 0:
            raise ValueError(f"compaction cold_slot_s must be > 0, got {self.cold_slot_s}")
        if self.partial_after < 2:
            raise ValueError(f"compaction partial_after must be >= 2, got {self.partial_after}")
        if not 0 < self.cpu_fraction <= 1:
            raise ValueError(f"compaction cpu_fraction must be in (0, 1], got {self.cpu_fraction}")
        if not self.interval_s > 0:
            raise ValueError(f"compaction interval_s must be > 0, got {self.interval_s}")


@dataclass
class CompactionStats:
    merges: int = 0
    #: Rows the merges removed (a merge of n rows removes n - 1).
    rows_removed: int = 0
    bytes_saved: int = 0
    #: Merges not stored: a row changed meanwhile, or the merged batch was not smaller.
    merges_skipped: int = 0
    #: Groups that could not be decoded or merged (logged; their rows are left as they are).
    failures: int = 0
    cpu_s: float = 0.0
    last_error: str = ""


@dataclass(frozen=True)
class _Merged:
    originals: dict[int, bytes]
    payload: bytes | None
    ts_last_ms: int
    cpu_s: float
    error: str = ""
    #: The rows to leave out of every later group (those that do not decode; the whole group if they do not merge).
    failed: frozenset[int] = frozenset()


def compaction_settings(min_age_s: float, slot_s: float, cold_slot_s: float) -> CompactionSettings | None:
    """The ``buffer.compact*`` settings as ``CompactionSettings``; None when compaction is off (``min_age_s`` 0).
    A value it refuses is a ``ConfigError`` naming it."""
    if min_age_s <= 0:
        return None
    try:
        return CompactionSettings(min_age_s=min_age_s, slot_s=slot_s, cold_slot_s=cold_slot_s)
    except ValueError as exc:
        raise ConfigError(f"buffer: {exc}") from None


class Compactor:
    """Merges waiting batches of a ``CompactableBuffer`` (see the module docstring)."""

    def __init__(
        self,
        buffer: CompactableBuffer,
        clock: Clock,
        settings: CompactionSettings | None = None,
        *,
        busy: Callable[[], Collection[int]] | None = None,
        on_compacted: Callable[[int], None] | None = None,
        codec: BatchCodec | None = None,
        sleep: Callable[[float], Awaitable[None]] | None = None,
    ) -> None:
        self.buffer = buffer
        self.clock = clock
        self.settings = settings or CompactionSettings()
        self._busy = busy or (lambda: ())
        self._on_compacted = on_compacted
        self._codec = codec or BatchCodec()
        self._sleep = sleep or asyncio.sleep
        self._stopping = False
        #: Rows at or below this id need no more merging (their slots are over and hold one row each).
        self._done_through = 0
        #: Rows whose merge failed (they do not decode, or do not merge): never grouped again.
        self._failed: set[int] = set()
        #: Groups whose merge was not smaller (e.g. the slots of a cold slot whose decimal columns need more
        #: decimals together than apart): not merged again while they stay the same rows.
        self._no_gain: set[frozenset[int]] = set()
        self.stats = CompactionStats()

    # ------------------------------------------------------------------------------------------ planning

    def _slot_of(self, ts_last_ms: int, now_ms: int) -> tuple[int, int]:
        """The slot a row's last sample puts it in: (1, its cold slot) once that cold slot is over (with
        ``min_age_s`` more), else (0, its slot)."""
        st = self.settings
        min_age_ms = round(st.min_age_s * 1000)
        cold_ms = max(1, round(st.cold_slot_ms))
        if (ts_last_ms // cold_ms + 1) * cold_ms + min_age_ms <= now_ms:
            return 1, ts_last_ms // cold_ms
        return 0, ts_last_ms // max(1, round(st.slot_s * 1000))

    def closed(self, group: Sequence[CompactionRow]) -> bool:
        """Whether nothing more will join the group before its merge: its slot (or its cold slot) is over and every
        batch of it is a candidate."""
        st = self.settings
        now = self.clock.wall_ms()
        level, slot = self._slot_of(group[0].ts_last_ms, now)
        if level:
            return True
        slot_ms = max(1, round(st.slot_s * 1000))
        return (slot + 1) * slot_ms + round(st.min_age_s * 1000) <= now

    def due_groups(self) -> list[list[CompactionRow]]:
        """The groups to merge now, oldest first (each at least two consecutive rows of one stream and slot, or one
        merged row of an open slot's form (format 3) whose slot is over, to be put in its cold form)."""
        st = self.settings
        now = self.clock.wall_ms()
        min_age_ms = round(st.min_age_s * 1000)
        rows = self.buffer.compaction_rows(before_ms=now - min_age_ms, after_id=self._done_through)
        runs: dict[int, list[tuple[tuple[int, int], list[CompactionRow]]]] = {}
        for row in rows:
            stream_runs = runs.setdefault(row.stream, [])
            if row.id in self._failed:  # a row that did not merge: left as it is, and it parts its neighbours
                stream_runs.append(((-1, 0), []))
                continue
            slot = self._slot_of(row.ts_last_ms, now)
            if stream_runs and stream_runs[-1][1] and stream_runs[-1][0] == slot:
                stream_runs[-1][1].append(row)
            else:
                stream_runs.append((slot, [row]))
        busy = set(self._busy())
        due: list[list[CompactionRow]] = []
        unfinished: list[int] = []
        for stream_runs in runs.values():
            for (level, _), group in stream_runs:
                if not group:
                    continue
                closed = self.closed(group)
                if frozenset(r.id for r in group) in self._no_gain:
                    if not closed:
                        unfinished.append(group[0].id)
                    continue
                # One row of a slot that is over is done with, unless it is an open slot's merge (format 3): that is
                # put in its cold form (one row re-encoded). A cold row of a cold slot not over yet waits for the
                # other slots of its cold slot.
                recode = closed and len(group) == 1 and group[0].merged and not group[0].cold
                if closed and len(group) == 1 and not recode:
                    if not level and st.cold_slot_ms > st.slot_s * 1000:
                        unfinished.append(group[0].id)
                    continue
                unfinished.append(group[0].id)
                if (len(group) < 2 and not recode) or any(r.id in busy for r in group):
                    continue
                if closed or sum(1 for r in group if not r.merged) >= st.partial_after:
                    due.append(group)
        # Rows before the first unfinished group are done: every later batch of their slots was a candidate.
        # (A batch stamped before older ones, after a clock step back, may so stay unmerged; nothing is lost.)
        if rows:
            self._done_through = max(self._done_through, min(unfinished) - 1 if unfinished else rows[-1].id)
        due.sort(key=lambda g: g[0].id)
        return due

    # ------------------------------------------------------------------------------------------ merging

    def _merge(self, originals: dict[int, bytes], final: bool = True) -> _Merged:
        """Decode and merge (pure CPU; runs in a worker thread from ``run``). ``final``: the group's slot is over,
        so the merged batch is the slot's cold form: format 4, its columns planned in segments (several times the
        CPU of format 3); an open slot's merge, which a later one replaces, is format 3."""
        t0 = time.thread_time()
        decoded = []
        bad: dict[int, str] = {}
        for i in sorted(originals):
            try:
                decoded.append(decode_batch(originals[i], self._codec))
            except BatchFormatError as exc:
                bad[i] = f"row {i}: {exc}"
        if bad:
            return _Merged(originals, None, 0, time.thread_time() - t0, "; ".join(bad.values()), frozenset(bad))
        try:
            merged = merge_batches(
                decoded, self._codec, version=MERGED_FORMAT_VERSION if final else MERGED_FORMAT_VERSION_3
            )
        except ValueError as exc:
            return _Merged(originals, None, 0, time.thread_time() - t0, str(exc), frozenset(originals))
        return _Merged(originals, merged.payload, merged.ts_last_ms, time.thread_time() - t0)

    def _originals(self, group: Sequence[CompactionRow]) -> dict[int, bytes]:
        ids = [r.id for r in group]
        found = self.buffer.payloads(ids)
        return dict(found) if len(found) == len(ids) else {}

    def _store(self, m: _Merged) -> bool:
        """Hand a merge to the buffer (on the caller's thread: the buffer's). True when it was stored."""
        st = self.stats
        st.cpu_s += m.cpu_s
        if m.payload is None:
            st.failures += 1
            st.last_error = m.error
            # Not tried again (each row stays as it was; the shipper sends it as it is).
            self._failed.update(m.failed)
            log.warning(
                "compaction: rows %s not merged (%s left as they are): %s",
                sorted(m.originals),
                sorted(m.failed),
                m.error,
            )
            return False
        before = sum(len(p) for p in m.originals.values())
        if len(m.payload) >= before:
            st.merges_skipped += 1
            self._no_gain.add(frozenset(m.originals))  # the rows stay as they are, and are not tried again so
            return False
        if not self.buffer.replace(m.originals, m.payload, m.ts_last_ms):
            st.merges_skipped += 1
            return False
        removed = len(m.originals) - 1
        st.merges += 1
        st.rows_removed += removed
        st.bytes_saved += before - len(m.payload)
        if self._on_compacted is not None:
            self._on_compacted(removed)
        return True

    def compact_all(self, max_merges: int | None = None) -> CompactionStats:
        """Every merge due now, one after the other, on this thread (no CPU budget); the running totals."""
        done = 0
        while max_merges is None or done < max_merges:
            groups = self.due_groups()
            if not groups:
                break
            progressed = False
            for group in groups:
                if max_merges is not None and done >= max_merges:
                    break
                originals = self._originals(group)
                if originals and self._store(self._merge(originals, self.closed(group))):
                    progressed = True
                done += 1
            if not progressed:
                break
        return self.stats

    async def run(self) -> None:
        """Merge in the background until ``stop``: CPU work in a worker thread, within ``cpu_fraction``."""
        st = self.settings
        while not self._stopping:
            try:
                groups = self.due_groups()
            except MapperError as exc:
                log.warning("compaction: cannot read the buffer: %s", exc)
                groups = []
            for group in groups:
                if self._stopping:
                    break
                if any(r.id in set(self._busy()) for r in group):
                    continue
                try:
                    originals = self._originals(group)
                    if not originals:
                        continue
                    started = time.monotonic()
                    merged = await asyncio.to_thread(self._merge, originals, self.closed(group))
                    if any(i in set(self._busy()) for i in originals):
                        self.stats.merges_skipped += 1
                        continue
                    self._store(merged)
                except MapperError as exc:
                    log.warning("compaction: merge not stored: %s", exc)
                    self.stats.failures += 1
                    self.stats.last_error = str(exc)
                    continue
                # Within the budget: this merge's CPU time over the time since it started and the pause after.
                elapsed = time.monotonic() - started
                pause = merged.cpu_s / st.cpu_fraction - elapsed
                if pause > 0:
                    await self._sleep(pause)
            if not groups and not self._stopping:
                await self._sleep(st.interval_s)

    def stop(self) -> None:
        self._stopping = True
