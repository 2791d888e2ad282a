"""``gpu-mapper buffer stats|export|compact|vacuum``: the operator's tool for the telemetry buffer file.

Built on sqlite-utils (the design card's choice for operator-side SQLite work). The running mapper never
imports this module: its hot path keeps the stdlib ``sqlite3`` (``mapper.edge.storage.buffer``). The CLI's
parser imports it for ``add_parser``, for every command (``gpu-mapper bridge`` too): the mapper's buffer and
compaction are imported by the commands that use them, not here.

* ``stats`` and ``export`` read the file in ONE read transaction (a consistent snapshot) through SQLite's WAL:
  on the live file of a running mapper they block none of its writes. They say when the file is in use.
* ``compact`` and ``vacuum`` write: they refuse a file another process has open (the running mapper compacts
  its own file; rewriting rows under its shipper could delete a merged row with a stale ack, and VACUUM would
  stop its writes). Run them on a copy, or with the mapper stopped.
* ``export`` writes JSON lines, CSV (``ts_ms,device,property,value``, what ``benchmarks/buffer.py --input``
  reads) or OpenMetrics text that ``promtool tsdb create-blocks-from openmetrics`` accepts (the way to backfill
  a Prometheus with a backlog older than its out-of-order window): the series exactly as ``gpu-mapper bridge``
  writes them (its own conversion, named by ``mapper.shared.naming`` as ``/metrics`` is), so that a backfill
  lines up with the dashboard and the alert rules. A progress bar goes to stderr when it is a
  terminal (or with ``--progress``).

"In use" is read from SQLite's own locks: every connection to a WAL database holds a shared lock on byte 128 of
its ``-shm`` file while it is open; ``fcntl(F_GETLK)`` asks who holds it without taking it.
"""

from __future__ import annotations

import argparse
import csv
import fcntl
import json
import os
import sqlite3
import struct
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from mapper.clock import SystemClock
from mapper.errors import MapperError
from mapper.wire.telemetry import BatchCodec, BatchFormatError, DecodedBatch, decode_batch

if TYPE_CHECKING:
    import sqlite_utils

#: The byte of the ``-shm`` file every open connection of a WAL database holds a shared lock on (SQLite's unix
#: VFS: the "dead man switch", after the 8 WAL-index locks that start at byte 120).
_SHM_DMS_BYTE = 128
FORMATS = ("jsonl", "csv", "openmetrics")


class BufferToolError(MapperError):
    """A bad file or option; the message says which."""


def in_use_by(path: Path) -> int | None:
    """The pid of another process that has the SQLite file open (WAL mode), or None. 0 when one has it open but
    its pid is not known."""
    shm = Path(str(path) + "-shm")
    try:
        fd = os.open(shm, os.O_RDONLY)
    except OSError:
        return None  # no -shm: nobody has it open in WAL mode
    try:
        query = struct.pack("hhqqi", fcntl.F_WRLCK, os.SEEK_SET, _SHM_DMS_BYTE, 1, 0)
        answer = fcntl.fcntl(fd, fcntl.F_GETLK, query + b"\0" * 4)
        l_type, _, _, _, pid = struct.unpack("hhqqi", answer[: struct.calcsize("hhqqi")])
    except OSError:
        return 0
    finally:
        os.close(fd)
    if l_type == fcntl.F_UNLCK:
        return None
    return pid


def _open_ro(path: Path) -> sqlite_utils.Database:
    import sqlite_utils  # the CLI's parser imports this module; sqlite-utils only when a command runs

    if not path.exists():
        raise BufferToolError(f"buffer file {path} does not exist")
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5.0)
    db = sqlite_utils.Database(conn)
    try:
        tables = set(db.table_names())
    except sqlite3.DatabaseError as exc:
        conn.close()
        raise BufferToolError(f"{path} is not a readable SQLite file: {exc}") from None
    # A mapper that has just created the file has not made its tables yet: the file is empty, or holds only the
    # meta table it makes first (the others come in one transaction, with the schema version).
    if not tables or (tables == {"meta"} and not _has_schema_version(db)):
        conn.close()
        raise BufferToolError(f"{path}: not initialised yet (no tables: the mapper that opened it is creating them)")
    if not {"batches", "streams", "meta"} <= tables:
        conn.close()
        raise BufferToolError(f"{path} is not a gpu-mapper telemetry buffer (tables: {sorted(tables)})")
    version = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    if version is None or int(version[0]) != 3:
        conn.close()
        raise BufferToolError(f"{path}: buffer schema {version and version[0]} is not 3 (open it with the mapper once)")
    return db


def _has_schema_version(db: sqlite_utils.Database) -> bool:
    return db.execute("SELECT 1 FROM meta WHERE key = 'schema_version'").fetchone() is not None


def _say_in_use(path: Path, err: IO[str], *, writing: bool) -> None:
    pid = in_use_by(path)
    if pid is None:
        return
    who = f"process {pid}" if pid else "another process"
    if writing:
        raise BufferToolError(
            f"{path} is in use by {who} (a running mapper?): compact and vacuum need it to themselves; stop the "
            "mapper or work on a copy (a running mapper compacts its own buffer)"
        )
    err.write(f"note: {path} is in use by {who}; reading a consistent snapshot through the WAL (not blocking it)\n")


@dataclass
class _StreamStats:
    device: str
    boot_id: str
    topic: str
    rows: int = 0
    batches: int = 0
    samples: int = 0
    values: int = 0
    bytes: int = 0
    oldest_ms: int | None = None
    newest_ms: int | None = None
    undecodable: int = 0


def stats(path: Path, out: IO[str], err: IO[str], *, as_json: bool = False) -> int:
    """Per stream: rows, batches held (a merged row holds several), samples, values, bytes, oldest and newest
    sample, and the compaction ratio (batches per row)."""
    from mapper.edge.storage.buffer import ROW_OVERHEAD_BYTES, read_batches

    _say_in_use(path, err, writing=False)
    db = _open_ro(path)
    codec = BatchCodec()
    per: dict[tuple[object, ...], _StreamStats] = {}
    try:
        db.execute("BEGIN")
        for row in read_batches(db.conn):
            key = (row.device, row.uuid, row.boot_id, row.topic, row.qos, row.retain, row.address)  # its stream
            st = per.get(key)
            if st is None:
                st = per[key] = _StreamStats(row.device, row.boot_id, row.topic)
            st.rows += 1
            st.bytes += len(row.payload) + ROW_OVERHEAD_BYTES
            if not row.boot_id:  # a status message
                st.batches += 1
                continue
            try:
                b = decode_batch(row.payload, codec)
            except BatchFormatError:
                st.undecodable += 1
                continue
            st.batches += len(b.parts) or 1
            st.samples += len(b.samples)
            st.values += sum(len(s.values) for s in b.samples)
            st.oldest_ms = b.ts_first_ms if st.oldest_ms is None else min(st.oldest_ms, b.ts_first_ms)
            st.newest_ms = b.ts_last_ms if st.newest_ms is None else max(st.newest_ms, b.ts_last_ms)
        db.execute("COMMIT")
    finally:
        db.conn.close()
    file_bytes = sum(p.stat().st_size for p in (path, Path(f"{path}-wal")) if p.exists())
    docs: list[dict[str, Any]] = [
        {
            "device": s.device,
            "boot_id": s.boot_id,
            "topic": s.topic,
            "rows": s.rows,
            "batches": s.batches,
            "samples": s.samples,
            "values": s.values,
            "bytes": s.bytes,
            "bytes_per_value": round(s.bytes / s.values, 3) if s.values else None,
            "oldest_ms": s.oldest_ms,
            "newest_ms": s.newest_ms,
            "compaction_ratio": round(s.batches / s.rows, 2) if s.rows else None,
            "undecodable": s.undecodable,
        }
        for s in per.values()
    ]
    if as_json:
        out.write(json.dumps({"file": str(path), "file_bytes": file_bytes, "streams": docs}) + "\n")
        return 0
    out.write(f"{path}: {file_bytes} bytes on disk, {sum(s.rows for s in per.values())} rows\n")
    head = ("device", "boot id", "topic", "rows", "batches", "ratio", "values", "B/value", "oldest", "newest")
    lines: list[tuple[str, ...]] = [head]
    for d in docs:
        lines.append(
            (
                str(d["device"]),
                str(d["boot_id"] or "(messages)"),
                str(d["topic"]),
                str(d["rows"]),
                str(d["batches"]),
                f"{d['compaction_ratio']}x",
                str(d["values"]),
                str(d["bytes_per_value"]),
                _iso(d["oldest_ms"]),
                _iso(d["newest_ms"]),
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    for line in lines:
        out.write("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() + "\n")
    return 0


def _iso(ms: int | None) -> str:
    if ms is None:
        return "-"
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms / 1000)) + f".{ms % 1000:03d}Z"


class _Progress:
    """A one-line progress bar on stderr (redrawn at most 5 times a second)."""

    def __init__(self, err: IO[str], total: int, enabled: bool) -> None:
        self.err, self.total, self.enabled = err, max(total, 1), enabled
        self.done = 0
        self._last = 0.0

    def step(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self._last >= 0.2 or self.done >= self.total):
            self._last = now
            frac = min(1.0, self.done / self.total)
            bar = "#" * round(frac * 30)
            self.err.write(f"\rexport [{bar:<30}] {frac * 100:5.1f}% {self.done}/{self.total} rows")
            self.err.flush()

    def close(self) -> None:
        if self.enabled:
            self.err.write("\n")


def export(
    path: Path,
    fmt: str,
    out: IO[str],
    err: IO[str],
    *,
    device: str | None = None,
    progress: bool | None = None,
) -> int:
    """Every value of every batch (merged ones split back), in stream order: JSON lines, CSV or OpenMetrics."""
    if fmt not in FORMATS:
        raise BufferToolError(f"export format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    _say_in_use(path, err, writing=False)
    db = _open_ro(path)
    codec = BatchCodec()
    try:
        db.execute("BEGIN")  # one snapshot for the whole export
        total = int(db.execute("SELECT COUNT(*) FROM batches").fetchone()[0])
        bar = _Progress(err, total, err.isatty() if progress is None else progress)
        batches = _decoded(db, codec, device, bar, err)
        if fmt == "jsonl":
            for b in batches:
                for s in b.samples:
                    for name, value in s.values.items():
                        rec = {"ts_ms": s.ts_ms, "device": b.device, "property": name, "value": value}
                        out.write(json.dumps(rec, separators=(",", ":")) + "\n")
        elif fmt == "csv":
            w = csv.writer(out, lineterminator="\n")
            w.writerow(("ts_ms", "device", "property", "value"))
            for b in batches:
                for s in b.samples:
                    for name, value in s.values.items():
                        text = ("true" if value else "false") if isinstance(value, bool) else value
                        w.writerow((s.ts_ms, b.device, name, text))
        else:
            skipped = _openmetrics(db, batches, out, err)
            if skipped:
                err.write(
                    f"note: {skipped} values of properties that have no Prometheus series (strings, custom "
                    "properties) are not in the OpenMetrics export; --format jsonl or csv has every value\n"
                )
        db.execute("COMMIT")
        bar.close()
    finally:
        db.conn.close()
    return 0


def _decoded(
    db: sqlite_utils.Database, codec: BatchCodec, device: str | None, bar: _Progress, err: IO[str]
) -> Iterator[DecodedBatch]:
    from mapper.edge.storage.buffer import read_batches

    for row in read_batches(db.conn):
        bar.step()
        if not row.boot_id or (device is not None and row.device != device):
            continue
        try:
            yield decode_batch(row.payload, codec)
        except BatchFormatError as exc:
            err.write(f"\nwarning: row {row.id} ({row.device}) does not decode, skipped: {exc}\n")


#: The OpenMetrics export converts this many samples at a time before spooling them to disk.
_SPILL_SAMPLES = 200_000


def _openmetrics(db: sqlite_utils.Database, batches: Iterator[DecodedBatch], out: IO[str], err: IO[str]) -> int:
    """The batches as ``gpu-mapper bridge`` writes them, in OpenMetrics text: every value goes through the
    bridge's own conversion (``mapper.bridge.core.Converter``, named by ``mapper.shared.naming`` as ``/metrics``
    is), labelled with the GPU's uuid and identity from the device's state snapshot (the buffer's ``latest``
    table, which also gives the status series at the time it was taken) and ``job="gpu-mapper-bridge"``; the node
    stream's batches are the mapper's own ``gpu_mapper_*`` series. Families contiguous, each series in time order
    with one sample per timestamp (what ``promtool tsdb create-blocks-from openmetrics`` wants): samples are
    spooled to a temporary file per series name, then sorted one name at a time. Returns the number of values
    left out (no Prometheus series: strings, custom properties, non-finite numbers)."""
    from mapper.bridge.core import Converter, PendingRequest, series_types
    from mapper.bridge.remotewrite import render_openmetrics
    from mapper.wire.state import NO_IDENTITY, DeviceStatus, parse_state

    statuses: dict[str, DeviceStatus] = {}
    for device, payload in db.execute("SELECT device, payload FROM latest ORDER BY device").fetchall():
        try:
            statuses[str(device)] = parse_state(bytes(payload))
        except ValueError as exc:
            err.write(f"\nwarning: the state snapshot of {device} does not read, its GPU's labels left out: {exc}\n")
    conv = Converter()
    nodes: dict[str, str] = {}
    uuids: dict[str, str] = {}
    values = added = 0
    with tempfile.TemporaryDirectory(prefix="gpu-mapper-export-") as tmp:
        spools: dict[str, IO[str]] = {}

        def spill(req: PendingRequest) -> None:
            for buf in req.series():
                labels = dict(buf.labels)
                name = labels["__name__"]
                fh = spools.get(name)
                if fh is None:
                    fh = spools[name] = open(Path(tmp) / f"{len(spools)}.txt", "w+")  # noqa: SIM115
                key = json.dumps(sorted(labels.items()), separators=(",", ":"))
                fh.writelines(f"{key}\t{ts}\t{v!r}\n" for ts, v in buf.samples())

        try:
            req = PendingRequest(0.0)
            for b in batches:
                nodes.setdefault(b.device, b.node)
                st = statuses.get(b.device)
                if b.uuid:  # a stream's first batch names its GPU; the bridge remembers it for the next ones
                    uuids[b.device] = b.uuid
                uuid = b.uuid or uuids.get(b.device) or (st.uuid if st is not None else "")
                ident = st.identity if st is not None and st.identity is not None else NO_IDENTITY
                values += sum(len(s.values) for s in b.samples)
                added += conv.add(req, b, uuid, ident)
                if req.samples >= _SPILL_SAMPLES:
                    spill(req)
                    req = PendingRequest(0.0)
            only_node = next(iter(set(nodes.values()))) if len(set(nodes.values())) == 1 else ""
            for device, st in statuses.items():
                node = nodes.get(device, only_node)
                ident = st.identity if st.identity is not None else NO_IDENTITY
                conv.add_status(req, node, st, st.uuid, ident)
            spill(req)
            types = series_types()
            for name in sorted(spools):
                fh = spools[name]
                fh.seek(0)
                series: dict[str, dict[int, float]] = {}
                for line in fh:
                    key, ts_text, v_text = line.rstrip("\n").split("\t")
                    series.setdefault(key, {}).setdefault(int(ts_text), float(v_text))
                decoded = [(dict(json.loads(k)), sorted(points.items())) for k, points in series.items()]
                out.writelines(render_openmetrics(decoded, types, eof=False))
        finally:
            for fh in spools.values():
                fh.close()
    out.write("# EOF\n")
    return values - added


def compact(
    path: Path, out: IO[str], err: IO[str], *, min_age_s: float, slot_s: float, cold_slot_s: float = 3600.0
) -> int:
    """Merge every batch due (as the mapper's compaction would, now) and report what it did."""
    from mapper.edge.outbox.compact import CompactionSettings, Compactor
    from mapper.edge.storage.buffer import Buffer

    _say_in_use(path, err, writing=True)
    if not path.exists():
        raise BufferToolError(f"buffer file {path} does not exist")
    _open_ro(path).conn.close()  # a clear error for a file that is not a buffer
    buf = Buffer(path, max_bytes=2**62, max_age_s=1e15, check_on_open=True)
    try:
        before = buf.stats()
        settings = CompactionSettings(min_age_s=min_age_s, slot_s=slot_s, cold_slot_s=cold_slot_s)
        st = Compactor(buf, SystemClock(), settings).compact_all()
        after = buf.stats()
    finally:
        buf.close()
    out.write(
        f"{path}: {st.merges} merges, {before.batches} -> {after.batches} rows, "
        f"{before.bytes} -> {after.bytes} bytes counted ({st.merges_skipped} skipped, {st.failures} failed)\n"
    )
    return 1 if st.failures else 0


def vacuum(path: Path, out: IO[str], err: IO[str]) -> int:
    """Checkpoint the WAL and VACUUM: the file shrinks to what it holds (freed pages are otherwise reused)."""
    _say_in_use(path, err, writing=True)
    _open_ro(path).conn.close()
    import sqlite_utils

    size_before = sum(p.stat().st_size for p in (path, Path(f"{path}-wal")) if p.exists())
    db = sqlite_utils.Database(path)
    try:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        db.vacuum()
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        db.conn.close()
    size_after = sum(p.stat().st_size for p in (path, Path(f"{path}-wal")) if p.exists())
    out.write(f"{path}: {size_before} -> {size_after} bytes\n")
    return 0


def add_parser(sub: Any) -> None:
    """``gpu-mapper buffer ...`` on the CLI's subparsers."""
    p = sub.add_parser("buffer", help="inspect, export, compact or vacuum the telemetry buffer file")
    actions = p.add_subparsers(dest="buffer_command", required=True)
    for name, text in (
        ("stats", "per stream: rows, batches, samples, bytes, oldest and newest sample, compaction ratio"),
        ("export", "every value as JSON lines, CSV or OpenMetrics (for promtool tsdb create-blocks-from openmetrics)"),
        ("compact", "merge the waiting batches now (not on a file a running mapper has open)"),
        ("vacuum", "checkpoint and VACUUM the file (not on a file a running mapper has open)"),
    ):
        a = actions.add_parser(name, help=text, description=text)
        a.add_argument("file", nargs="?", help="the buffer file (default: DATA_DIR/telemetry.db)")
        a.add_argument("--data-dir", default="/var/lib/gpu-mapper", help="default /var/lib/gpu-mapper")
        if name == "stats":
            a.add_argument("--json", action="store_true", help="one JSON document")
        if name == "export":
            a.add_argument("--format", choices=FORMATS, default="jsonl")
            a.add_argument("--device", help="only this device (namespace/name)")
            a.add_argument("--output", "-o", help="write here instead of standard output")
            a.add_argument("--progress", action="store_true", default=None, help="a progress bar even when not a tty")
        if name == "compact":
            a.add_argument("--min-age", type=float, default=30.0, help="merge batches this many seconds old")
            a.add_argument("--slot", type=float, default=600.0, help="the slot of a merged batch, seconds")
            a.add_argument(
                "--cold-slot", type=float, default=3600.0, help="the cold slot: its slots merged into one, seconds"
            )


def main(args: argparse.Namespace, out: IO[str] | None = None, err: IO[str] | None = None) -> int:
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    path = Path(args.file) if args.file else Path(args.data_dir) / "telemetry.db"
    cmd = args.buffer_command
    if cmd == "stats":
        return stats(path, out, err, as_json=args.json)
    if cmd == "export":
        if args.output:
            with open(args.output, "w", newline="") as fh:
                return export(path, args.format, fh, err, device=args.device, progress=args.progress)
        return export(path, args.format, out, err, device=args.device, progress=args.progress)
    if cmd == "compact":
        return compact(path, out, err, min_age_s=args.min_age, slot_s=args.slot, cold_slot_s=args.cold_slot)
    if cmd == "vacuum":
        return vacuum(path, out, err)
    raise BufferToolError(f"unknown buffer command {cmd!r}")
