"""Replay of a 24 h backlog of 8 GPUs to a real mosquitto at QoS 1, against what a user would otherwise run: the
same backlog as the mapper's own JSON batches, and one message per sample row.

Everything runs in this process against one mosquitto started on a free port (loopback, no link cap); a
``mosquitto_sub -q 1 -C N`` subscriber counts deliveries, so "delivered" means a subscriber received it. A
"sample" is one value at one time, as Prometheus counts them.

* Backlog: 8 GPUs x 36 properties x 1 Hz x ``--hours`` (default 24), batched every 10 s (the mapper's binary
  batches, ``telemetry.format: binary``, the default), built in the SQLite buffer through
  ``TelemetryShipper.submit`` while the broker is unreachable, then replayed by the shipper. Values come from a
  cheap synthetic generator (random walks in NVML units: mW/1000, mJ/1000, KB/s x 1024) so that building a day
  takes seconds; the simulator is too slow for 25 M values here. ``ours_samples_per_s``: samples delivered per
  second of the replay. ``compacted_*``: the same backlog built again and merged as the mapper's backlog
  compaction (on by default) leaves it after a long outage (its defaults, every slot cold), then replayed.
* Baseline 1, the mapper's JSON batches (``telemetry.format: json``): the same path (encoder, buffer, shipper,
  subscriber) with JSON batches, on ``--json-hours`` (default 1 h: the rate is per sample). ``speedup_vs_json_batches``.
* Baseline 2, one JSON message per sample row (one GPU's 36 values at one time, ``{"ts_ms","uuid","values"}``, as an
  exporter publishing each reading would), QoS 1, 20 publishes in flight, ``--row-samples`` rows (default 2000).
  ``speedup_vs_row_messages``.
* ``peak_rss_mb``: the process' peak RSS (ru_maxrss) over building and replaying the binary backlog;
  ``rss_quarter_mb`` / ``rss_full_mb``: RSS after a quarter and after all of it was buffered (flat = the backlog is
  streamed from SQLite in pages, never held in memory). Target < 60 MB.

Run: ``.venv/bin/python benchmarks/replay.py [--hours H] [--json-hours H] [--row-samples N] [--smoke]``. Prints one
JSON line last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mapper.clock import FakeClock, SystemClock
from mapper.edge.outbox.compact import CompactionSettings, Compactor
from mapper.edge.outbox.shipper import TelemetryShipper
from mapper.edge.storage.buffer import Buffer
from mapper.net.mqtt import MqttSession
from mapper.shared.model import Sample, Value
from mapper.wire.telemetry import BatchEncoder, Format
from tests.brokers import Mosquitto

GPUS = 8
NODE = "edge-1"
T0 = 1_780_000_000_000


def rss_mb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def gpu_uuid(gpu: int) -> str:
    return f"GPU-{gpu:08x}-0000-4000-8000-{gpu:012x}"


def synthetic(gpu: int, seconds: int) -> Iterator[Sample]:
    rng = random.Random(gpu)
    uuid = gpu_uuid(gpu)
    power_mw, energy_mj, temp, util = 300_000, 123_456_789_000, 60, 50
    mem_used = 40 * 2**30
    for s in range(seconds):
        util = min(100, max(0, util + rng.randint(-5, 5)))
        power_mw = min(700_000, max(60_000, power_mw + rng.randint(-8000, 8000)))
        energy_mj += power_mw
        temp = min(90, max(30, temp + rng.choice((-1, 0, 0, 0, 1))))
        mem_used = max(0, mem_used + rng.randint(-4, 4) * 2**20)
        values: dict[str, Value] = {
            "uuid": uuid,
            "product_name": "NVIDIA H100 80GB HBM3",
            "utilization_gpu": util,
            "utilization_memory": util // 2,
            "memory_used": mem_used,
            "memory_total": 85_520_809_984,
            "temperature": temp,
            "temperature_memory": temp + 6,
            "temperature_slowdown": 89,
            "temperature_shutdown": 92,
            "power_usage": power_mw / 1000,
            "energy_consumption": energy_mj / 1000,
            "power_limit_enforced": 700.0,
            "power_limit_min": 200.0,
            "power_limit_max": 700.0,
            "power_limit_default": 700.0,
            "power_limit": 700.0,
            "clock_sm": 1980 if util > 10 else 345,
            "clock_memory": 2619,
            "clock_sm_max": 1980,
            "clock_event_reasons": 0 if util > 10 else 1,
            "clock_event_reasons_text": "none" if util > 10 else "gpu_idle",
            "pstate": 0,
            "pcie_tx": rng.randint(0, 800_000) * 1024,
            "pcie_rx": rng.randint(0, 2_500_000) * 1024,
            "ecc_errors_corrected": 0,
            "ecc_errors_uncorrected": 0,
            "remapped_rows_uncorrectable": 0,
            "remapped_rows_pending": False,
            "xid_last": 0,
            "locked_gpu_clock_min": 0,
            "locked_gpu_clock_max": 0,
            "locked_memory_clock_min": 0,
            "locked_memory_clock_max": 0,
            "persistence_mode": True,
            "compute_mode": "default",
        }
        yield Sample(uuid, T0 + s * 1000, values)


def subscriber(broker: Mosquitto, topic: str, count: int) -> subprocess.Popen[bytes]:
    exe = shutil.which("mosquitto_sub") or "/usr/bin/mosquitto_sub"
    argv = [exe, "-h", broker.host, "-p", str(broker.port), "-t", topic, "-q", "1", "-C", str(count), "-i", topic]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    time.sleep(0.3)  # let it subscribe
    return proc


async def wait_exit(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None:
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("subscriber did not receive every message in time")
        await asyncio.sleep(0.01)


async def per_row(broker: Mosquitto, rows: int) -> float:
    """Samples/s for one JSON message per sample row (a GPU's values at one time, as a per-GPU exporter publishes
    them), QoS 1, 20 in flight: the baseline a user without the mapper's batches would run."""
    session = MqttSession(broker.url, "per-row")
    await session.start()
    assert await session.wait_connected(10)
    source = synthetic(0, rows)
    values = 0

    def records() -> Iterator[tuple[str, bytes]]:
        nonlocal values
        for sample in source:
            values += len(sample.values)
            payload = {"ts_ms": sample.ts_ms, "uuid": sample.uuid, "values": dict(sample.values)}
            yield f"per-row/{NODE}/default/gpu0", json.dumps(payload, separators=(",", ":")).encode()

    sub = subscriber(broker, "per-row/#", rows)
    start = time.perf_counter()
    pending = records()

    async def worker() -> None:  # 20 workers = 20 publishes in flight, no per-message task
        for topic, payload in pending:
            await session.publish(topic, payload, qos=1, timeout_s=30)

    await asyncio.gather(*(worker() for _ in range(20)))
    await wait_exit(sub, 120)
    elapsed = time.perf_counter() - start
    await session.stop(5)
    return values / elapsed


class Replayed:
    """One backlog built offline through the mapper's encoder, buffer and shipper, then replayed."""

    samples = 0
    batches = 0
    backlog_bytes = 0
    build_s = 0.0
    replay_s = 0.0
    rss_quarter = 0.0
    rss_full = 0.0


async def backlog(work: Path, broker: Mosquitto, seconds: int, fmt: Format, *, compact: bool = False) -> Replayed:
    """Build ``seconds`` of 8 GPUs' backlog in ``fmt`` batches while the broker is down (``compact``: then merged
    as the mapper's compaction does by the end of a long outage), replay it to the broker and wait until a
    subscriber has every batch."""
    out = Replayed()
    broker.stop()  # offline: the backlog builds up
    buf = Buffer(work / f"buffer-{fmt}-{compact}.db", max_bytes=10**11, max_age_s=10**9)
    session = MqttSession(broker.url, f"mapper-{NODE}-{fmt}", reconnect_min_s=0.2, reconnect_max_s=1.0)
    await session.start()
    shipper = TelemetryShipper(buf, session.publish, node=NODE, clock=SystemClock(), retry_s=1.0)
    session.add_on_connect(shipper.notify_connected)
    encoders = [BatchEncoder(NODE, f"default/gpu{g}", gpu_uuid(g), "boot-bench", 10.0, fmt=fmt) for g in range(GPUS)]
    gens = [synthetic(g, seconds) for g in range(GPUS)]
    build_start = time.perf_counter()
    for s in range(seconds):
        for g in range(GPUS):
            sample = next(gens[g])
            enc = encoders[g]
            batch = enc.flush_due(sample.ts_ms)
            if batch is not None:
                shipper.submit(batch)
            enc.add(sample)
            out.samples += len(sample.values)
        if s == seconds // 4:
            out.rss_quarter = rss_mb()
    for enc in encoders:
        batch = enc.flush()
        if batch is not None:
            shipper.submit(batch)
    if compact:  # the mapper's defaults, on a clock an hour past the backlog: every slot cold, merged
        clock = FakeClock(start_wall_ms=T0 + seconds * 1000 + 3_600_000)
        Compactor(buf, clock, CompactionSettings()).compact_all()
    out.build_s = time.perf_counter() - build_start
    out.rss_full = rss_mb()
    stats = buf.stats()
    out.batches, out.backlog_bytes = stats.batches, stats.bytes

    broker.start()
    sub = subscriber(broker, "gpu-mapper/#", out.batches)
    task = asyncio.create_task(shipper.run())
    start = time.perf_counter()
    await wait_exit(sub, 600)
    out.replay_s = time.perf_counter() - start
    for _ in range(600):  # the last PUBACKs trail the deliveries
        if not buf.stats().batches:
            break
        await asyncio.sleep(0.05)
    await shipper.stop(5)
    task.cancel()
    await session.stop(5)
    buf.close()
    return out


async def run(args: argparse.Namespace) -> dict[str, object]:
    work = Path(tempfile.mkdtemp(prefix="bench-replay-"))
    broker = Mosquitto(work)
    broker.start()
    try:
        row_rate = await per_row(broker, args.row_samples)
        rss_base = rss_mb()
        ours = await backlog(work, broker, round(args.hours * 3600), "binary")
        peak = peak_rss_mb()  # (before the other runs: the figure is of the one above)
        compacted = await backlog(work, broker, round(args.hours * 3600), "binary", compact=True)
        as_json = await backlog(work, broker, round(args.json_hours * 3600), "json")
        ours_rate = ours.samples / ours.replay_s
        json_rate = as_json.samples / as_json.replay_s
        return {
            "benchmark": "replay",
            "measured_on": "synthetic values, real mosquitto on loopback (no link cap), one process",
            "hours": args.hours,
            "gpus": GPUS,
            "samples": ours.samples,
            "batches": ours.batches,
            "backlog_bytes": ours.backlog_bytes,
            "bytes_per_sample": round(ours.backlog_bytes / ours.samples, 3),
            "build_s": round(ours.build_s, 1),
            "replay_s": round(ours.replay_s, 2),
            "ours_samples_per_s": round(ours_rate),
            "ours_batches_per_s": round(ours.batches / ours.replay_s),
            "compacted_rows": compacted.batches,
            "compacted_bytes_per_sample": round(compacted.backlog_bytes / compacted.samples, 3),
            "compacted_replay_s": round(compacted.replay_s, 2),
            "compacted_samples_per_s": round(compacted.samples / compacted.replay_s),
            "json_batches_hours": args.json_hours,
            "json_batches_samples_per_s": round(json_rate),
            "json_batches_bytes_per_sample": round(as_json.backlog_bytes / as_json.samples, 3),
            "speedup_vs_json_batches": round(ours_rate / json_rate, 2),
            "row_messages": args.row_samples,
            "row_messages_samples_per_s": round(row_rate),
            "speedup_vs_row_messages": round(ours_rate / row_rate, 1),
            "rss_base_mb": round(rss_base, 1),
            "rss_quarter_mb": round(ours.rss_quarter, 1),
            "rss_full_mb": round(ours.rss_full, 1),
            "peak_rss_mb": round(peak, 1),
            # The guard: the backlog is streamed from SQLite, never held in memory (docs/benchmarks.md).
            "target_peak_rss_mb": TARGET_PEAK_RSS_MB,
            "target_met": peak < TARGET_PEAK_RSS_MB,
            "cpus": os.cpu_count(),
        }
    finally:
        broker.stop()
        shutil.rmtree(work, ignore_errors=True)


#: Peak RSS while buffering and replaying the day (MB).
TARGET_PEAK_RSS_MB = 60.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hours", type=float, default=24.0, help="backlog replayed (default 24 h)")
    ap.add_argument("--json-hours", type=float, default=1.0, help="backlog of JSON batches replayed (default 1 h)")
    ap.add_argument("--row-samples", type=int, default=2_000, help="sample rows sent one per message (default 2000)")
    ap.add_argument("--smoke", action="store_true", help="a few minutes of each, for the benchmark smoke test")
    args = ap.parse_args()
    if args.smoke:
        args.hours, args.json_hours, args.row_samples = 0.05, 0.05, 100
    print(json.dumps(asyncio.run(run(args))))


if __name__ == "__main__":
    main()
