"""Bytes per sample at rest in the offline buffer after H hours offline, against a Prometheus TSDB of the same
samples made in the same run.

Streams (``--stream``, or ``--input``):

* ``sim`` (default): 8 simulated H100s (SimNvml through NvmlBackend, mixed scenarios) x every property the
  backend reads x 1 Hz (``--cadence catalog``: each property at its catalog collect cycle). The encoder's
  dictionary was trained on this simulator: its figures are the tuned case.
* ``gen``: ``benchmarks/streamgen.py``, a stream the encoder was not tuned on (its own noise model, cadences,
  GPU count ``--gpus``, series names outside the catalog).
* ``--input FILE.csv`` (columns ``ts_ms,device,property,value``): the file is the stream, buffered as the mapper
  would while offline (e.g. ``benchmarks/csvstream.py`` writes one to the description in issue 14).

Offline: every 10 s batch (the default window) is stored in the SQLite buffer exactly as the mapper stores it
(Device names as the mapper makes them, an 8-hex-digit boot id) while the broker is down, and backlog compaction
(mapper/edge/outbox/compact.py, the mapper's defaults) runs on a clock that follows the stream: every simulated minute
it does what is due, and once more at the end. ``--no-compact`` stores the 10 s batches only (the figure before
compaction). A "sample" is one (timestamp, series, value) point, as Prometheus counts them.

* ``ours_bytes_per_sample``: the SQLite file after a WAL checkpoint (every byte: pages, free pages, overhead) /
  samples, with compaction done (what is due at the end of the offline time).
* ``prom_bytes_per_sample``: the same samples written as OpenMetrics and turned into TSDB blocks with
  ``promtool tsdb create-blocks-from openmetrics``; the blocks' size / samples. Strings become
  ``..._info{value="..."} 1`` series, booleans 0/1.
* ``ratio`` = ours / prom (targets on streams the encoder was not tuned on: <= 0.5 after 1 h, <= 0.35 after
  24 h).
* ``ingest_samples_per_s``: samples through encode + compress + SQLite commit per second of CPU-bound wall time
  (the stream's own time and compaction are not counted); ``compaction_cpu_s``: the compaction's time.
* ``breakdown`` (``--breakdown --no-compact``): where the bytes of a 10 s batch go: the SQLite file's fixed pages
  and row overhead (``dbstat``), the 3-byte batch header, and the body's parts (``mapper.wire.telemetry.body_parts``)
  raw and as the growth of the compressed size when each part is added; the raw bytes of every series (stderr).

``--legacy-uuid`` writes batches as format 2 did before the uuid became optional (uuid in every header,
dictionary 1). Run: ``.venv/bin/python benchmarks/buffer.py [--stream sim|gen] [--input FILE.csv] [--hours H]
[--gpus N] [--no-compact] [--window-s W] [--cadence 1hz|catalog] [--legacy-uuid] [--breakdown]``. Prints one
JSON line last.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from mapper.clock import FakeClock
from mapper.edge.outbox.compact import CompactionSettings, Compactor
from mapper.edge.outbox.records import StoredBatch
from mapper.edge.storage.buffer import Buffer
from mapper.shared.model import Sample, Value
from mapper.tools.discover import device_name
from mapper.wire import telemetry
from mapper.wire.telemetry import BatchCodec, BatchEncoder, EncodedBatch, body_parts, decode_batch
from mapper.wire.topics import telemetry_topic

GPUS = 8
WINDOW_S = 10.0
NODE = "edge-1"
BOOT_ID = "5c1f0e9a"  # what the mapper makes: 8 hex digits, new at every start
START_MS = 1_780_000_000_000 - 1_780_000_000_000 % 7_200_000  # on a 2 h boundary: one TSDB block
SCENARIOS = ("training", "inference", "steady", "oscillating", "heat", "idle", "training", "inference")


def simulated(hours: float, cadence: str = "1hz", gpus: int = GPUS) -> Iterator[tuple[str, Sample]]:
    from mapper.edge.gpu.nvml import NvmlBackend
    from mapper.edge.gpu.simnvml import SimNvml
    from mapper.shared.model import NVML_PROPERTIES

    clock = FakeClock(start_wall_ms=START_MS)
    sim = SimNvml(gpus, "H100", clock=clock.monotonic, seed=7)
    backend = NvmlBackend(sim, clock=clock)
    backend.init()
    gpus = backend.list_gpus()
    for g, scenario in zip(gpus, SCENARIOS, strict=False):
        sim.set_scenario(g.uuid, scenario)
    cycles_s = {p.name: max(1, p.collect_cycle_ms // 1000) for p in NVML_PROPERTIES}
    try:
        for second in range(round(hours * 3600)):
            clock.advance(1.0)
            due = None if cadence == "1hz" else [name for name, c in cycles_s.items() if second % c == 0]
            for g in gpus:
                yield f"default/{device_name(NODE, g.index)}", backend.sample(g.uuid, due)
    finally:
        backend.shutdown()


def _parse_value(text: str) -> Value:
    if text in ("true", "false"):
        return text == "true"
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    try:
        return float(text)
    except ValueError:
        return text


def from_csv(path: Path) -> Iterator[tuple[str, Sample]]:
    """Rows ``ts_ms,device,property,value`` grouped into one Sample per (device, ts_ms) run."""
    with path.open(newline="") as fh:
        reader = csv.DictReader(fh)
        missing = {"ts_ms", "device", "property", "value"} - set(reader.fieldnames or ())
        if missing:
            raise SystemExit(f"{path}: missing columns {sorted(missing)}")
        key: tuple[str, int] | None = None
        values: dict[str, Value] = {}
        for row in reader:
            k = (row["device"], int(row["ts_ms"]))
            if k != key and key is not None:
                yield key[0], Sample(key[0], key[1], values)
                values = {}
            key = k
            values[row["property"]] = _parse_value(row["value"])
        if key is not None:
            yield key[0], Sample(key[0], key[1], values)


def _prom_name(prop: str) -> str:
    return "gpu_" + re.sub(r"[^a-zA-Z0-9_]", "_", prop)


def _prom_value(v: Value) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    return repr(float(v)) if isinstance(v, float) else str(v)


def write_openmetrics(stream: list[tuple[str, int, str, Value]], path: Path) -> None:
    """Families contiguous, each series in time order (what create-blocks-from openmetrics wants)."""
    by_family: dict[str, list[tuple[str, int, Value]]] = {}
    for device, ts, prop, value in stream:
        by_family.setdefault(prop, []).append((device, ts, value))
    with path.open("w") as out:
        for prop, rows in by_family.items():
            is_str = any(isinstance(v, str) for _, _, v in rows)
            name = _prom_name(prop) + ("_info" if is_str else "")
            out.write(f"# TYPE {name} gauge\n")
            rows.sort(key=lambda r: (r[0], r[1]))
            for device, ts, value in rows:
                if is_str:
                    label = str(value).replace("\\", "\\\\").replace('"', '\\"')
                    out.write(f'{name}{{device="{device}",value="{label}"}} 1 {ts / 1000:.3f}\n')
                else:
                    out.write(f'{name}{{device="{device}"}} {_prom_value(value)} {ts / 1000:.3f}\n')
        out.write("# EOF\n")


def breakdown(db_path: Path, payloads: list[bytes], per_series: bool, codec: BatchCodec) -> dict[str, object]:
    """Where the bytes of the buffer file go, per batch (see the module docstring)."""
    n = len(payloads)
    conn = sqlite3.connect(db_path)
    pages = dict(conn.execute("SELECT name, SUM(pgsize) FROM dbstat GROUP BY name").fetchall())
    page_size = int(conn.execute("PRAGMA page_size").fetchone()[0])
    file_pages = int(conn.execute("PRAGMA page_count").fetchone()[0]) * page_size
    conn.close()
    batch_pages = int(pages.pop("batches", 0))
    payload_bytes = sum(len(p) for p in payloads)
    raw = Counter[str]()
    packed = Counter[str]()
    series = Counter[str]()
    for payload in payloads:
        b = decode_batch(payload, codec)
        parts = body_parts(b.samples, node=b.node, device=b.device, uuid=b.uuid, boot_id=b.boot_id, seq=b.seq)
        prefix = b""
        before = 0
        for name, part in parts.items():
            raw[name] += len(part)
            prefix += part
            now = len(codec.pack(prefix)) - telemetry.HEADER_BYTES
            packed[name] += now - before
            before = now
        if per_series:
            for name, size in _series_bytes(b.samples, b.uuid).items():
                series[name] += size
    out: dict[str, object] = {
        "sqlite_fixed_pages": round((file_pages - batch_pages) / n, 1),
        "sqlite_row_overhead_and_slack": round((batch_pages - payload_bytes) / n, 1),
        "batch_header": float(telemetry.HEADER_BYTES),
        "payload": round(payload_bytes / n, 1),
        "body_raw": {k: round(v / n, 1) for k, v in raw.items()},
        "body_compressed_growth": {k: round(v / n, 1) for k, v in packed.items()},
        "other_tables_pages": {k: int(v) for k, v in pages.items()},
    }
    if per_series:
        for name, size in series.most_common():
            print(f"  {name:28s} {size / n:7.2f} B/batch raw", file=sys.stderr)
    return out


def _series_bytes(samples: tuple[Sample, ...], uuid: str) -> dict[str, int]:
    """Raw bytes (meta + data + packed bits) of each series of a batch, each encoded on its own."""
    out: dict[str, int] = {}
    names = dict.fromkeys(k for s in samples for k in s.values)
    for name in names:
        rows = [i for i, s in enumerate(samples) if name in s.values]
        values = [samples[i].values[name] for i in rows]
        sec = telemetry._Sections()
        telemetry._encode_series(sec, name, rows, values, telemetry._type_of(values[0]), len(samples), uuid)
        out[name] = len(sec.meta) + len(sec.data) + (sec.bits.nbits + 7) // 8
    return out


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def generated(gpus: int, hours: float, seed: int) -> Iterator[tuple[str, Sample]]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import streamgen

    return streamgen.generate(gpus, hours, seed)


class Offline:
    """The buffer of a mapper whose broker is down: every batch stored as it is cut, the compactor run as the
    mapper runs it (every simulated minute it does what is due; in the mapper a task does it as it falls due,
    within its CPU budget), all on a fake clock that follows the stream's timestamps."""

    def __init__(self, path: Path, compact: bool, window_s: float, codec: BatchCodec, legacy_uuid: bool) -> None:
        self.path = path
        self.compact = compact
        self.slot_s: float | None = None
        self.clock = FakeClock(start_wall_ms=0)
        self._buf: Buffer | None = None
        self.compactor: Compactor | None = None
        self.encoders: dict[str, BatchEncoder] = {}
        self.window_s = window_s
        self.codec = codec
        self.legacy_uuid = legacy_uuid
        self.payloads: list[bytes] = []
        self.stored = 0
        self.busy_s = 0.0
        self.compact_s = 0.0
        self._next_compact_ms: int | None = None

    @property
    def buf(self) -> Buffer:
        assert self._buf is not None, "no sample yet"
        return self._buf

    def _at(self, ts_ms: int) -> None:
        if self._buf is None:  # the buffer file starts with the first sample, as the mapper's with the mapper
            self.clock.start_wall_ms = ts_ms
            self._buf = Buffer(self.path, max_bytes=10**12, max_age_s=10**9, clock=self.clock)
            settings = CompactionSettings(slot_s=self.slot_s) if self.slot_s else None
            self.compactor = Compactor(self._buf, self.clock, settings) if self.compact else None
        delta = ts_ms - self.clock.wall_ms()
        if delta > 0:
            self.clock.advance(delta / 1000)

    def _store(self, device: str, b: EncodedBatch) -> None:
        self.buf.put(
            StoredBatch(
                device=b.device,
                uuid=b.uuid,
                boot_id=b.boot_id,
                seq=b.seq,
                ts_first_ms=b.ts_first_ms,
                ts_last_ms=b.ts_last_ms,
                topic=telemetry_topic(NODE, device),
                payload=b.payload,
            )
        )
        self.stored += 1
        if self.compactor is None:
            self.payloads.append(b.payload)

    def add(self, device: str, sample: Sample) -> None:
        self._at(sample.ts_ms)
        t0 = time.perf_counter()
        enc = self.encoders.get(device)
        if enc is None:
            enc = self.encoders[device] = BatchEncoder(
                NODE, device, sample.uuid, BOOT_ID, self.window_s, codec=self.codec
            )
        if self.legacy_uuid:
            enc.announce_uuid()
        batch = enc.flush_due(sample.ts_ms)
        if batch is not None:
            self._store(device, batch)
        enc.add(sample)
        self.busy_s += time.perf_counter() - t0
        if self.compactor is not None:
            now = self.clock.wall_ms()
            if self._next_compact_ms is None:
                self._next_compact_ms = now + 60_000
            if now >= self._next_compact_ms:
                self._next_compact_ms = now + 60_000
                self._compact()

    def _compact(self) -> None:
        assert self.compactor is not None
        t0 = time.perf_counter()
        self.compactor.compact_all()
        self.compact_s += time.perf_counter() - t0

    def finish(self) -> None:
        """The end of the offline time: the encoders' last partial batches stored, then what compaction has due."""
        self._at(self.clock.wall_ms() + 1000)
        t0 = time.perf_counter()
        for device, enc in self.encoders.items():
            if self.legacy_uuid:
                enc.announce_uuid()
            batch = enc.flush()
            if batch is not None:
                self._store(device, batch)
        self.busy_s += time.perf_counter() - t0
        if self.compactor is not None:
            self._compact()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--stream", choices=("sim", "gen"), default="sim", help="the simulator's (default) or the generator's"
    )
    ap.add_argument("--hours", type=float, default=1.0, help="hours offline (default 1)")
    ap.add_argument("--gpus", type=int, default=GPUS, help=f"GPUs (default {GPUS})")
    ap.add_argument("--seed", type=int, default=11, help="the generator's seed (default 11)")
    ap.add_argument("--input", type=Path, help="CSV stream ts_ms,device,property,value instead of sim or gen")
    ap.add_argument("--window-s", type=float, default=WINDOW_S)
    ap.add_argument("--cadence", choices=("1hz", "catalog"), default="1hz", help="every property at 1 Hz (default)")
    ap.add_argument("--legacy-uuid", action="store_true", help="uuid in every header, dictionary 1 (before)")
    ap.add_argument("--no-compact", action="store_true", help="10 s batches only, as before compaction")
    ap.add_argument("--slot-s", type=float, help="compaction slot (default: the mapper's)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--breakdown", action="store_true", help="where the bytes go (with --no-compact); per series")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-buffer-"))
    if args.input:
        source = from_csv(args.input)
        stream = f"--input {args.input}"
    elif args.stream == "gen":
        source = generated(args.gpus, args.hours, args.seed)
        stream = f"benchmarks/streamgen.py, {args.gpus} GPUs, seed {args.seed}"
    else:
        source = simulated(args.hours, args.cadence, args.gpus)
        stream = f"simulator, {args.gpus} H100s, {args.cadence}"
    # One set of zstd contexts for every encoder, as the mapper shares it.
    codec = BatchCodec(dictionary_id=1) if args.legacy_uuid else BatchCodec()
    off = Offline(work / "buffer.db", not args.no_compact, args.window_s, codec, args.legacy_uuid)
    off.slot_s = args.slot_s
    flat: list[tuple[str, int, str, Value]] = []
    samples = 0
    ts_min = ts_max = None
    for device, sample in source:
        for prop, value in sample.values.items():
            flat.append((device, sample.ts_ms, prop, value))
        samples += len(sample.values)
        ts_min = sample.ts_ms if ts_min is None else min(ts_min, sample.ts_ms)
        ts_max = sample.ts_ms if ts_max is None else max(ts_max, sample.ts_ms)
        off.add(device, sample)
    off.finish()
    rows = off.buf.stats().batches
    merges = off.compactor.stats.merges if off.compactor is not None else 0
    off.buf.close()  # checkpoints the WAL into the file
    ours = off.buf.file_bytes()
    free_pages = _free_pages(off.buf.path)
    where = breakdown(off.buf.path, off.payloads, True, codec) if args.breakdown and off.payloads else None

    om = work / "samples.om"
    write_openmetrics(flat, om)
    del flat
    promtool = shutil.which("promtool")
    prom_bytes = None
    if promtool is None:
        print("promtool not found: Prometheus side skipped", file=sys.stderr)
    else:
        out_dir = work / "tsdb"
        subprocess.run(
            [promtool, "tsdb", "create-blocks-from", "openmetrics", str(om), str(out_dir)],
            check=True,
            capture_output=True,
        )
        prom_bytes = dir_bytes(out_dir)
    om_bytes = om.stat().st_size
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    ours_bps = ours / samples
    prom_bps = prom_bytes / samples if prom_bytes else None
    hours = ((ts_max or 0) - (ts_min or 0)) / 3_600_000
    print(
        f"{stream}: {hours:.2f} h offline, {samples} samples in {off.stored} batches -> {rows} rows ({merges} merges): "
        f"ours {ours} B ({ours_bps:.3f} B/sample), "
        f"prometheus {prom_bytes} B ({prom_bps if prom_bps is None else round(prom_bps, 3)} B/sample)",
        file=sys.stderr,
    )
    print(
        json.dumps(
            {
                "benchmark": "buffer",
                "sim_cost": "none",  # the simulator only makes the data; its calls' cost is not in any figure
                "stream": stream,
                "offline_hours": round(hours, 3),
                "cadence": None if args.input or args.stream == "gen" else args.cadence,
                "format": "v2, uuid in every header, dictionary 1" if args.legacy_uuid else "v2, uuid optional",
                "compaction": not args.no_compact,
                "window_s": args.window_s,
                "samples": samples,
                "batches": off.stored,
                "rows_after_compaction": rows,
                "merges": merges,
                "ours_file_bytes": ours,
                "sqlite_free_pages": free_pages,
                "ours_bytes_per_sample": round(ours_bps, 4),
                "ingest_samples_per_s": round(samples / off.busy_s),
                "compaction_cpu_s": round(off.compact_s, 2),
                "prom_block_bytes": prom_bytes,
                "prom_bytes_per_sample": None if prom_bps is None else round(prom_bps, 4),
                "ratio": None if prom_bps is None else round(ours_bps / prom_bps, 4),
                "openmetrics_text_bytes": om_bytes,
                "breakdown_bytes_per_batch": where,
                "python": platform.python_version(),
                "cpus": os.cpu_count(),
            }
        )
    )


def _free_pages(path: Path) -> int:
    conn = sqlite3.connect(path)
    try:
        return int(conn.execute("PRAGMA freelist_count").fetchone()[0])
    finally:
        conn.close()


if __name__ == "__main__":
    main()
