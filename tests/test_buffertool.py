"""``gpu-mapper buffer stats|export|compact|vacuum`` on real SQLite files: a copy, and the live file of a running
writer; ``export --format openmetrics`` into a real promtool block."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from mapper.cli import main
from mapper.clock import FakeClock
from mapper.edge.outbox.compact import CompactionSettings, Compactor
from mapper.edge.outbox.records import StoredBatch
from mapper.edge.status.stats import GpuSnapshot
from mapper.edge.storage.buffer import Buffer
from mapper.shared.model import GpuInfo, Sample, Value
from mapper.tools import buffer as buffertool
from mapper.wire.telemetry import BatchEncoder
from mapper.wire.topics import telemetry_topic
from tests.realparts import require

REPO = Path(__file__).resolve().parent.parent
NODE = "edge-1"
ALIGNED = 1_780_000_200_000
UUID = "GPU-12345678-1234-1234-1234-123456789abc"


def _values(i: int, g: int) -> dict[str, Value]:
    v: dict[str, Value] = {"power_usage": 100.0 + (i * 37 + g) % 11 / 4, "temperature": 60 + i // 60}
    if i % 5 == 0:
        v["pstate"] = "P0" if i % 10 else "P2"
        v["persistence_mode"] = i % 20 == 0
    if i % 7 == 0:
        v["x.custom ünicode"] = 2**40 + i
    return v


def _fill(path: Path, seconds: int = 1500, gpus: int = 2) -> list[tuple[int, str, str, Value]]:
    """A buffer of two GPUs' 10 s batches (part of it compacted) and a status message; the values stored."""
    clock = FakeClock(start_wall_ms=ALIGNED)
    buf = Buffer(path, max_bytes=10**9, max_age_s=10**9, clock=clock)
    encoders = [BatchEncoder(NODE, f"default/gpu{g}", UUID, "0badf00d", 10.0) for g in range(gpus)]
    stored: list[tuple[int, str, str, Value]] = []
    for i in range(seconds):
        ts = clock.wall_ms()
        for g, enc in enumerate(encoders):
            b = enc.flush_due(ts)
            if b is not None:
                buf.put(StoredBatch(**_row(b)))
            values = _values(i, g)
            enc.add(Sample(UUID, ts, values))
            stored += [(ts, enc.device, k, v) for k, v in values.items()]
        clock.advance(1.0)
    for enc in encoders:
        b = enc.flush()
        assert b is not None
        buf.put(StoredBatch(**_row(b)))
    buf.put(
        StoredBatch(
            device="default/gpu0",
            uuid=UUID,
            boot_id="",
            seq=-1,
            ts_first_ms=clock.wall_ms(),
            ts_last_ms=clock.wall_ms(),
            topic="gpu-mapper/edge-1/default/gpu0/events",
            payload=b'{"event":"cap"}',
        )
    )
    clock.advance(700)
    Compactor(buf, clock, CompactionSettings(cold_slot_s=600)).compact_all(max_merges=3)  # some merged, some not
    buf.close()
    return stored


def _row(b: object) -> dict[str, object]:
    return {
        "device": b.device,  # type: ignore[attr-defined]
        "uuid": b.uuid,  # type: ignore[attr-defined]
        "boot_id": b.boot_id,  # type: ignore[attr-defined]
        "seq": b.seq,  # type: ignore[attr-defined]
        "ts_first_ms": b.ts_first_ms,  # type: ignore[attr-defined]
        "ts_last_ms": b.ts_last_ms,  # type: ignore[attr-defined]
        "topic": telemetry_topic(NODE, b.device),  # type: ignore[attr-defined]
        "payload": b.payload,  # type: ignore[attr-defined]
    }


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    args = __import__("mapper.cli", fromlist=["build_parser"]).build_parser().parse_args(["buffer", *argv])
    code = buffertool.main(args, out, err)
    return code, out.getvalue(), err.getvalue()


def test_stats_counts_rows_batches_values_and_the_time_range_per_stream(tmp_path: Path) -> None:
    db = tmp_path / "telemetry.db"
    stored = _fill(db)
    code, out, err = _cli("stats", str(db), "--json")
    assert code == 0 and err == ""
    doc = json.loads(out)
    streams = {(s["device"], s["topic"].rsplit("/", 1)[-1]): s for s in doc["streams"]}
    gpu0 = streams[("default/gpu0", "telemetry")]
    assert gpu0["batches"] == 150 and gpu0["rows"] < 150 and gpu0["compaction_ratio"] > 1
    assert gpu0["values"] == sum(1 for _, d, _, _ in stored if d == "default/gpu0")
    assert (gpu0["oldest_ms"], gpu0["newest_ms"]) == (
        min(t for t, d, _, _ in stored if d == "default/gpu0"),
        max(t for t, d, _, _ in stored if d == "default/gpu0"),
    )
    assert streams[("default/gpu0", "events")]["rows"] == 1
    assert doc["file_bytes"] == db.stat().st_size
    code, text, _ = _cli("stats", str(db))
    assert code == 0 and "default/gpu1" in text and "(messages)" in text


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_export_gives_back_every_value_exactly_in_stream_order(tmp_path: Path, fmt: str) -> None:
    db = tmp_path / "telemetry.db"
    stored = _fill(db)
    target = tmp_path / f"out.{fmt}"
    code, _, _ = _cli("export", str(db), "--format", fmt, "-o", str(target))
    assert code == 0
    if fmt == "jsonl":
        got = [tuple(json.loads(line).values()) for line in target.read_text().splitlines()]
    else:
        rows = list(csv.DictReader(target.open()))
        got = [(int(r["ts_ms"]), r["device"], r["property"], _parse(r["value"])) for r in rows]
    assert sorted(got, key=repr) == sorted(stored, key=repr)
    for device in ("default/gpu0", "default/gpu1"):
        times = [t for t, d, _, _ in got if d == device]
        assert times == sorted(times), "each device's samples in time order"


def _parse(text: str) -> Value:
    if text in ("true", "false"):
        return text == "true"
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    try:
        return float(text)
    except ValueError:
        return text


#: What the OpenMetrics export (the bridge's and /metrics' names) calls the properties of ``_values`` and the factor
#: from the catalog's unit to the series' base unit, written out here by hand (docs/metrics.md); the string pstate
#: and the custom property have no series.
_PROM = {
    "power_usage": ("gpu_power_usage_watts", 1.0),
    "temperature": ("gpu_temperature_celsius", 1.0),
    "persistence_mode": ("gpu_persistence_mode", 1.0),
}
_NO_SERIES = ("pstate", "x.custom ünicode")


def _dump(blocks: Path) -> list[tuple[str, dict[str, str], int, float]]:
    """Every sample of a promtool block directory: (name, labels, ts_ms, value)."""
    (blocks / "wal").mkdir(exist_ok=True)  # promtool 2.42's dump opens the directory as a TSDB, WAL and all
    dump = subprocess.run(
        ["promtool", "tsdb", "dump", str(blocks)], check=True, capture_output=True, text=True, timeout=120
    ).stdout
    out = []
    for line in dump.splitlines():
        labels, value, ts = line.rsplit(" ", 2)
        fields = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', labels))
        out.append((fields.pop("__name__"), fields, int(ts), float(value)))
    return out


def test_an_openmetrics_export_makes_a_promtool_block_with_the_names_labels_and_units_of_the_bridge(
    tmp_path: Path,
) -> None:
    require(shutil.which("promtool") is not None, "promtool is not installed (scripts/bootstrap.sh --test installs it)")
    db = tmp_path / "telemetry.db"
    stored = _fill(db, seconds=900)
    # gpu0's state snapshot as the mapper keeps it: its identity (NVML index 0, driver, PCI bus id) and status
    at_ms = max(ts for ts, *_ in stored)
    info = GpuInfo(UUID, 0, "H100", pci_bus_id="00000000:17:00.0", driver_version="580.65.06")
    snap = GpuSnapshot(info=info, device="default/gpu0", state="online")
    buf = Buffer(db, max_bytes=10**9, max_age_s=10**9, clock=FakeClock(start_wall_ms=at_ms))
    buf.put_latest("default/gpu0", snap.state_message("default/gpu0", driver_version="", at_ms=at_ms))
    buf.close()
    om = tmp_path / "backlog.om"
    code, _, err = _cli("export", str(db), "--format", "openmetrics", "-o", str(om), "--progress")
    assert code == 0 and "100.0%" in err, "the progress bar reached its end"
    left_out = sum(1 for _, _, prop, _ in stored if prop in _NO_SERIES)
    assert f"note: {left_out} values of properties that have no Prometheus series" in err
    blocks = tmp_path / "tsdb"
    subprocess.run(
        ["promtool", "tsdb", "create-blocks-from", "openmetrics", str(om), str(blocks)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    samples = _dump(blocks)
    got = set()
    for name, labels, ts, value in samples:
        if name.startswith("gpu_mapper_"):
            continue  # the status of the snapshot, below
        got.add((ts, name, tuple(sorted(labels.items())), value))
    want = set()
    for ts, device, prop, value in stored:
        if prop in _NO_SERIES:
            continue
        name, scale = _PROM[prop]
        gpu = device.removeprefix("default/")
        labels = {"device": gpu, "node": NODE, "uuid": UUID, "job": "gpu-mapper-bridge"}
        if gpu == "gpu0":
            labels["gpu"] = "0"  # from its state snapshot; gpu1 has none
        want.add((ts, name, tuple(sorted(labels.items())), float(value) * scale))
    assert got == want
    # the state snapshot's status at the time it was taken, labelled as gpu0's series
    state = {s[1]["state"]: s[3] for s in samples if s[0] == "gpu_mapper_device_state" and s[2] == at_ms}
    assert state["online"] == 1.0 and sum(state.values()) == 1.0
    assert {s[1]["gpu"] for s in samples if s[0] == "gpu_mapper_device_state"} == {"0"}


#: A writer that keeps the buffer file open and stores a batch every few ms, printing how many it stored.
WRITER = textwrap.dedent(
    """
    import sys, time
    from mapper.edge.outbox.records import StoredBatch
    from mapper.edge.storage.buffer import Buffer
    from mapper.shared.model import Sample
    from mapper.wire.telemetry import encode_batch

    buf = Buffer(sys.argv[1], max_bytes=10**9, max_age_s=10**12)
    print("open", flush=True)
    seq = 10**6
    while True:
        b = encode_batch([Sample("", 1_790_000_000_000 + seq, {"temperature": 60})], node="n", device="default/gpu9",
                         uuid="", boot_id="feedf00d", seq=seq)
        buf.put(StoredBatch(device=b.device, uuid="", boot_id=b.boot_id, seq=seq, ts_first_ms=b.ts_first_ms,
                ts_last_ms=b.ts_last_ms, topic="t", payload=b.payload))
        seq += 1
        print(seq, flush=True)
        time.sleep(0.002)
    """
)


def test_on_the_live_file_stats_and_export_say_so_and_do_not_block_it_while_compact_and_vacuum_refuse(
    tmp_path: Path,
) -> None:
    db = tmp_path / "telemetry.db"
    _fill(db, seconds=300)
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(db)], cwd=REPO, stdout=subprocess.PIPE)
    try:
        assert writer.stdout is not None
        assert writer.stdout.readline().strip() == b"open"
        assert buffertool.in_use_by(db) == writer.pid
        code, out, err = _cli("export", str(db), "--format", "jsonl")
        assert code == 0 and f"in use by process {writer.pid}" in err and out.count("\n") > 1000
        before = int(writer.stdout.readline())
        code, _, err = _cli("stats", str(db))
        assert code == 0 and "in use" in err
        # The writer went on storing while the tool read (a WAL reader blocks no writer).
        assert int(writer.stdout.readline()) > before
        for command in ("compact", "vacuum"):
            with pytest.raises(buffertool.BufferToolError, match=f"in use by process {writer.pid}"):
                _cli(command, str(db))
    finally:
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait(10)
    assert buffertool.in_use_by(db) is None


def test_compact_and_vacuum_on_a_copy_shrink_it_and_keep_every_value(tmp_path: Path) -> None:
    db = tmp_path / "telemetry.db"
    stored = _fill(db)
    size = db.stat().st_size
    code, out, _ = _cli("compact", str(db))
    assert code == 0 and "merges" in out
    code, out, _ = _cli("vacuum", str(db))
    assert code == 0 and db.stat().st_size < size
    target = tmp_path / "all.jsonl"
    assert _cli("export", str(db), "-o", str(target))[0] == 0
    got = [tuple(json.loads(line).values()) for line in target.read_text().splitlines()]
    assert sorted(got, key=repr) == sorted(stored, key=repr)


def test_the_cli_runs_the_buffer_commands_and_names_a_bad_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "telemetry.db"
    _fill(db, seconds=100)
    assert main(["buffer", "stats", "--data-dir", str(tmp_path)]) == 0
    assert "default/gpu0" in capsys.readouterr().out
    assert main(["buffer", "stats", str(tmp_path / "missing.db")]) == 1
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "other.db").write_bytes(b"not sqlite at all, just bytes" * 100)
    assert main(["buffer", "export", str(tmp_path / "other.db")]) == 1
    assert "not a readable SQLite file" in capsys.readouterr().err


@pytest.mark.parametrize("made", ["nothing", "the meta table"])
def test_a_buffer_file_whose_tables_are_not_made_yet_is_not_initialised_yet(tmp_path: Path, made: str) -> None:
    # What a reader can find while a mapper opens a new buffer: the file created (empty), then the meta table,
    # then the rest with the schema version in one transaction.
    db = tmp_path / "telemetry.db"
    db.touch(mode=0o600)
    if made == "the meta table":
        with contextlib.closing(sqlite3.connect(db)) as conn:
            conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID")
            conn.commit()
    for command in ("stats", "export", "compact", "vacuum"):
        with pytest.raises(buffertool.BufferToolError, match="not initialised yet") as err:
            _cli(command, str(db))
        assert "not a gpu-mapper telemetry buffer" not in str(err.value)
    assert main(["buffer", "stats", str(db)]) == 1
    # once a mapper has opened it: an empty buffer
    Buffer(db, max_bytes=10**6, max_age_s=3600, clock=FakeClock()).close()
    code, out, _ = _cli("stats", str(db), "--json")
    assert code == 0 and json.loads(out)["streams"] == []


def test_a_sqlite_file_of_another_program_is_not_a_buffer(tmp_path: Path) -> None:
    db = tmp_path / "other.db"
    for tables in (("notes",), ("meta", "notes")):
        db.unlink(missing_ok=True)
        with contextlib.closing(sqlite3.connect(db)) as conn:
            for table in tables:
                conn.execute(f"CREATE TABLE {table} (key TEXT, value TEXT)")
            conn.execute("INSERT INTO meta VALUES ('schema_version', '3')" if "meta" in tables else "SELECT 1")
            conn.commit()
        with pytest.raises(buffertool.BufferToolError, match="not a gpu-mapper telemetry buffer"):
            _cli("stats", str(db))


def test_the_running_mapper_does_not_import_sqlite_utils() -> None:
    code = (
        "import sys, mapper.edge.app, mapper.cli, mapper.tools.buffer; mapper.cli.build_parser(); "
        "print('sqlite_utils' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_a_running_mappers_buffer_file_is_read_while_it_runs_and_compacted_once_it_stopped(tmp_path: Path) -> None:
    from tests.brokers import free_port

    (tmp_path / "devices").mkdir()
    data = tmp_path / "data"
    cfg = tmp_path / "config.yaml"
    cfg.write_text("telemetry: {window: 1s}\nbuffer: {compactAfter: 0s}\n")  # 1 s batches; this file is ours
    metrics_port = free_port()

    def buffered_rows() -> int:
        """The rows in the mapper's buffer, as its /status says (0 until it answers)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/status", timeout=2) as resp:
                return int(json.loads(resp.read())["buffer"]["batches"])
        except OSError:
            return 0

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mapper.cli",
            "run",
            "--sim",
            "2",
            "--node-name",
            "edge-1",
            "--config",
            str(cfg),
            "--devices",
            str(tmp_path / "devices"),
            "--data-dir",
            str(data),
            "--metrics-addr",
            f"127.0.0.1:{metrics_port}",
            "--mqtt",
            f"mqtt://127.0.0.1:{free_port()}",
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        # The broker is away: the batches stay in the buffer. The mapper says how many rows it holds (its tables
        # exist by then); 16 rows are 16 batches at least (a row holds one or, merged, several).
        deadline = time.monotonic() + 60
        while buffered_rows() < 16:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:] if proc.stderr else ""
            assert time.monotonic() < deadline, "no batches in the buffer"
            time.sleep(0.2)
        code, out, err = _cli("stats", "--data-dir", str(data), "--json")
        assert code == 0, err
        assert sum(s["batches"] for s in json.loads(out)["streams"]) >= 16
        assert f"in use by process {proc.pid}" in err
        code, out, err = _cli("export", "--data-dir", str(data), "--format", "csv")
        assert code == 0 and out.startswith("ts_ms,device,property,value\n") and out.count("\n") > 50
        with pytest.raises(buffertool.BufferToolError, match="in use"):
            _cli("compact", "--data-dir", str(data))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert proc.returncode == 0
    code, out, err = _cli("compact", "--data-dir", str(data), "--min-age", "0")
    assert code == 0 and err == "" and "merges" in out
    code, out, _ = _cli("stats", "--data-dir", str(data), "--json")
    streams = json.loads(out)["streams"]
    assert any(s["compaction_ratio"] > 1 for s in streams)
