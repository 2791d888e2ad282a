"""Replay of a 24 h backlog of 8 GPUs to a real mosquitto at QoS 1, against a naive one-message-per-sample publisher.

Both sides run in this process against one mosquitto started on a free port; a ``mosquitto_sub -q 1 -C N``
subscriber counts deliveries, so "delivered" means a subscriber received it.

* Backlog: 8 GPUs x 36 properties x 1 Hz x ``--hours`` (default 24), batched every 10 s, built in the SQLite
  buffer through ``TelemetryShipper.submit`` while the broker is unreachable. Values come from a cheap synthetic
  generator (random walks in NVML units: mW/1000, mJ/1000, KB/s x 1024) so that building a day takes seconds;
  the simulator is too slow for 25 M values here.
* ``ours_samples_per_s``: samples delivered per second while the shipper replays the backlog.
* ``naive_samples_per_s``: one JSON message per sample, QoS 1, 20 publishes in flight, on the first
  ``--naive-samples`` samples (the rate is extrapolated). ``speedup`` = ours / naive (target >= 30).
* ``peak_rss_mb``: the process' peak RSS (ru_maxrss) over building and replaying; ``rss_quarter_mb`` /
  ``rss_full_mb``: RSS after a quarter and after all of the backlog was buffered (flat = the backlog is
  streamed from SQLite in pages, never held in memory). Target < 60 MB.

Run: ``.venv/bin/python benchmarks/replay.py [--hours H]``. Prints one JSON line last.
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

from mapper.clock import SystemClock
from mapper.edge.outbox.shipper import TelemetryShipper
from mapper.edge.storage.buffer import Buffer
from mapper.net.mqtt import MqttSession
from mapper.shared.model import Sample, Value
from mapper.wire.telemetry import BatchEncoder
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


async def naive(broker: Mosquitto, n_samples: int) -> float:
    """Samples/s for one JSON message per sample, QoS 1, 20 in flight."""
    session = MqttSession(broker.url, "naive")
    await session.start()
    assert await session.wait_connected(10)

    def records() -> Iterator[tuple[str, bytes]]:
        n = 0
        for sample in synthetic(0, n_samples // 36 + 1):
            for prop, value in sample.values.items():
                if n == n_samples:
                    return
                n += 1
                topic = f"naive/{NODE}/default/gpu0/{prop}"
                yield topic, json.dumps({"ts_ms": sample.ts_ms, "value": value}).encode()

    sub = subscriber(broker, "naive/#", n_samples)
    start = time.perf_counter()
    source = records()

    async def worker() -> None:  # 20 workers = 20 publishes in flight, no per-message task
        for topic, payload in source:
            await session.publish(topic, payload, qos=1, timeout_s=30)

    await asyncio.gather(*(worker() for _ in range(20)))
    await wait_exit(sub, 120)
    elapsed = time.perf_counter() - start
    await session.stop(5)
    return n_samples / elapsed


async def run(args: argparse.Namespace) -> dict[str, object]:
    work = Path(tempfile.mkdtemp(prefix="bench-replay-"))
    broker = Mosquitto(work)
    broker.start()
    try:
        naive_rate = await naive(broker, args.naive_samples)
        broker.stop()  # offline: the backlog builds up
        rss_base = rss_mb()
        buf = Buffer(work / "buffer.db", max_bytes=10**11, max_age_s=10**9)
        session = MqttSession(broker.url, f"mapper-{NODE}", reconnect_min_s=0.2, reconnect_max_s=1.0)
        await session.start()
        shipper = TelemetryShipper(buf, session.publish, node=NODE, clock=SystemClock(), retry_s=1.0)
        session.add_on_connect(shipper.notify_connected)
        seconds = round(args.hours * 3600)
        encoders = [BatchEncoder(NODE, f"default/gpu{g}", gpu_uuid(g), "boot-bench", 10.0) for g in range(GPUS)]
        gens = [synthetic(g, seconds) for g in range(GPUS)]
        samples = 0
        build_start = time.perf_counter()
        rss_quarter = 0.0
        for s in range(seconds):
            for g in range(GPUS):
                sample = next(gens[g])
                enc = encoders[g]
                batch = enc.flush_due(sample.ts_ms)
                if batch is not None:
                    shipper.submit(batch)
                enc.add(sample)
                samples += len(sample.values)
            if s == seconds // 4:
                rss_quarter = rss_mb()
        for enc in encoders:
            batch = enc.flush()
            if batch is not None:
                shipper.submit(batch)
        build_s = time.perf_counter() - build_start
        rss_full = rss_mb()
        stats = buf.stats()
        backlog_batches, backlog_bytes = stats.batches, stats.bytes

        broker.start()
        sub = subscriber(broker, "gpu-mapper/#", backlog_batches)
        task = asyncio.create_task(shipper.run())
        start = time.perf_counter()
        await wait_exit(sub, 600)
        replay_s = time.perf_counter() - start
        for _ in range(600):  # the last PUBACKs trail the deliveries
            if not buf.stats().batches:
                break
            await asyncio.sleep(0.05)
        await shipper.stop(5)
        task.cancel()
        await session.stop(5)
        buf.close()
        ours_rate = samples / replay_s
        return {
            "benchmark": "replay",
            "hours": args.hours,
            "gpus": GPUS,
            "samples": samples,
            "batches": backlog_batches,
            "backlog_bytes": backlog_bytes,
            "build_s": round(build_s, 1),
            "replay_s": round(replay_s, 2),
            "ours_samples_per_s": round(ours_rate),
            "ours_batches_per_s": round(backlog_batches / replay_s),
            "naive_samples": args.naive_samples,
            "naive_samples_per_s": round(naive_rate),
            "speedup": round(ours_rate / naive_rate, 1),
            "rss_base_mb": round(rss_base, 1),
            "rss_quarter_mb": round(rss_quarter, 1),
            "rss_full_mb": round(rss_full, 1),
            "peak_rss_mb": round(peak_rss_mb(), 1),
            "cpus": os.cpu_count(),
        }
    finally:
        broker.stop()
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hours", type=float, default=24.0)
    ap.add_argument("--naive-samples", type=int, default=20_000)
    args = ap.parse_args()
    print(json.dumps(asyncio.run(run(args))))


if __name__ == "__main__":
    main()
