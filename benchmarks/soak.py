"""Soak: the mapper on 8 simulated GPUs for N minutes under random faults, counting every telemetry batch.

The mapper runs as a subprocess through its own CLI (``tests/faults/child.py``: the simulated NVML is the one
part swapped, and the benchmark faults it), in DMI mode against the test EdgeCore (real Unix sockets), with its
telemetry on a real mosquitto that keeps its clients' sessions across a restart, read by a persistent-session
QoS 1 consumer. Every 15-45 s (seeded) one fault, at random:

* the broker stopped (SIGTERM) for 2-8 s, then started again;
* EdgeCore stopped for 1-5 s (its socket gone), then started again;
* a driver reload (every GPU setting back to default: the mapper must apply the desired ones again);
* a GPU lost (XID 79), then found 5-15 s later (a reload that recovers it, as a reboot would).

At the end the mapper is stopped with SIGTERM; the batches still in its buffer count as kept, not lost. Per
(device, boot id) every seq from 0 to the last one the mapper cut is either delivered or still buffered; one
that is neither is lost. Prints batches and samples produced / delivered / lost, duplicate deliveries (the same
(device, boot id, seq) more than once: allowed, a consumer drops them), whether the desired power limit is on
every GPU at the end, and the mapper's RSS and open file descriptors after a 30 s warm-up (the baseline) and at
the end (RSS also about ten times along the way).

Run: ``.venv/bin/python benchmarks/soak.py [--minutes 10] [--seed 1] [--gpus 8] [--smoke]``. ``--smoke`` (the
benchmark smoke test): 2 GPUs for 15 s after a 2 s warm-up, the same faults seconds apart. Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sqlite3
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mapper.wire.telemetry import decode_batch
from tests.fake_edgecore import FakeEdgeCore, pb_device, pb_model
from tests.faults.rig import Consumer, MapperProcess, PersistentBroker, buffered, uuids, wait

GPUS = 8
DESIRED_W = 320


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)


def proc_usage(pid: int) -> dict[str, int]:
    rss_kb = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss_kb = int(line.split()[1])
    return {"rss_kb": rss_kb, "open_fds": len(os.listdir(f"/proc/{pid}/fd"))}


#: The pace of the faults: (first fault and the gap between two, s), (broker down, s), (EdgeCore down, s),
#: (a lost GPU found again after, s), no fault this close to the end (s), the warm-up before the baseline (s).
PACE = {"gap": (15.0, 45.0), "broker": (2.0, 8.0), "edgecore": (1.0, 5.0), "lost": (5.0, 15.0)}
PACE_TAIL_S, PACE_WARMUP_S = 20.0, 30.0
#: ``--smoke``: the same faults, seconds apart.
SMOKE_PACE = {"gap": (2.0, 4.0), "broker": (1.0, 2.0), "edgecore": (0.5, 1.0), "lost": (1.0, 2.0)}


class EdgeThread:
    """The test EdgeCore on its own event loop in a thread (the benchmark's main thread is synchronous)."""

    def __init__(self, socket_path: str, gpus: int = GPUS) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.edge = FakeEdgeCore(socket_path)
        ids = uuids(gpus)
        props = {"temperature": None, "power_limit": str(DESIRED_W)}
        self.edge.devices = [pb_device(f"gpu{i}", ids[i], properties=props, cycle_ms=1000) for i in range(gpus)]
        self.edge.models = [pb_model()]

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def registers(self) -> int:
        return len(self.edge.rec.registers)


class CountingConsumer(Consumer):
    """The fault suite's consumer, also counting the samples of each distinct batch and every delivery."""

    def __init__(self, port: int) -> None:
        self.samples: dict[tuple[str, str, int], int] = {}
        self.deliveries = 0
        super().__init__(port, client_id="soak-consumer")

    def _on(self, client: Any, userdata: Any, message: Any) -> None:
        batch = decode_batch(bytes(message.payload))
        with self.lock:
            for part in batch.split() if batch.merged else (batch,):
                self.deliveries += 1
                self.samples[(part.device, part.boot_id, part.seq)] = len(part.samples)
                self.arrivals.setdefault(part.device, []).append((part.boot_id, part.seq))


def buffered_samples(data_dir: Path) -> dict[tuple[str, str, int], int]:
    """The samples of each telemetry batch still in a stopped mapper's buffer, by (device, boot id, seq)."""
    path = data_dir / "telemetry.db"
    out: dict[tuple[str, str, int], int] = {}
    if not path.exists():
        return out
    with contextlib.closing(sqlite3.connect(path)) as db:
        for (payload,) in db.execute("SELECT payload FROM batches"):
            try:
                batch = decode_batch(payload)
            except ValueError:
                continue  # an ack or an event kept for replay (JSON, not a batch)
            for part in batch.split() if batch.merged else (batch,):
                out[(part.device, part.boot_id, part.seq)] = len(part.samples)
    return out


def unaccounted(consumer: CountingConsumer, left: dict[str, set[tuple[str, int]]]) -> int:
    """Batches neither delivered nor still buffered: per (device, boot id), the seqs missing from 0 to the last."""
    with consumer.lock:
        delivered = set(consumer.samples)
    have: dict[tuple[str, str], set[int]] = {}
    for device, boot, seq in delivered:
        have.setdefault((device, boot), set()).add(seq)
    for device, keys in left.items():
        for boot, seq in keys:
            have.setdefault((device, boot), set()).add(seq)
    return sum(len(set(range(max(seqs) + 1)) - seqs) for seqs in have.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--gpus", type=int, default=GPUS)
    parser.add_argument(
        "--smoke", action="store_true", help="2 GPUs, 15 s, a fault every 2-4 s, 2 s of warm-up (the smoke test)"
    )
    args = parser.parse_args()
    pace, tail_s, warmup_s = PACE, PACE_TAIL_S, PACE_WARMUP_S
    if args.smoke:
        args.gpus, args.minutes, pace, tail_s, warmup_s = 2, 0.25, SMOKE_PACE, 4.0, 2.0
    gpus = args.gpus
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="soak-", dir="/tmp"))
    broker = PersistentBroker(tmp)
    broker.start()
    consumer = CountingConsumer(broker.port)
    edge = EdgeThread(str(tmp / "dmi.sock"), gpus)
    edge.call(edge.edge.start())
    mapper = MapperProcess(
        tmp,
        gpus,
        *("--edgecore-socket", str(tmp / "dmi.sock"), "--socket", str(tmp / "gpu.sock"), "--mqtt", broker.url),
        config="telemetry: {window: 10s}\n",
    )
    faults = {"broker_restart": 0, "edgecore_restart": 0, "driver_reload": 0, "gpu_lost_found": 0}
    lost_gpu: tuple[int, float] | None = None
    try:
        mapper.wait_started()
        wait(lambda: all(g["power_limit_w"] == DESIRED_W for g in mapper.gpu_state()), 60, "desired limits", 0.5)
        time.sleep(warmup_s)  # warm-up: imports, first batches, the buffer's first pages
        start_usage = proc_usage(mapper.proc.pid)
        log(f"warm; mapper {start_usage}")
        end_at = time.monotonic() + args.minutes * 60
        next_fault = time.monotonic() + rng.uniform(*pace["gap"])
        # RSS along the way too (about ten readings), so that a bound being approached shows apart from a leak.
        rss_every_s = max(30.0, args.minutes * 6)
        rss_along = [start_usage["rss_kb"]]
        next_rss = time.monotonic() + rss_every_s
        while time.monotonic() < end_at:
            time.sleep(0.5)
            if time.monotonic() >= next_rss:
                rss_along.append(proc_usage(mapper.proc.pid)["rss_kb"])
                next_rss += rss_every_s
            if lost_gpu is not None and time.monotonic() >= lost_gpu[1]:
                mapper.control(op="reload", recover=True)
                log(f"gpu{lost_gpu[0]} found again")
                lost_gpu = None
            if time.monotonic() < next_fault or time.monotonic() > end_at - tail_s:
                continue
            next_fault = time.monotonic() + rng.uniform(*pace["gap"])
            kind = rng.choice(sorted(faults))
            if kind == "gpu_lost_found" and lost_gpu is not None:
                kind = "driver_reload"
            faults[kind] += 1
            if kind == "broker_restart":
                broker.terminate()
                down_s = rng.uniform(*pace["broker"])
                log(f"broker down for {down_s:.1f} s")
                time.sleep(down_s)
                broker.start()
            elif kind == "edgecore_restart":
                edge.call(edge.edge.stop())
                down_s = rng.uniform(*pace["edgecore"])
                log(f"EdgeCore down for {down_s:.1f} s")
                time.sleep(down_s)
                edge.call(edge.edge.start())
            elif kind == "driver_reload":
                log("driver reload")
                mapper.control(op="reload")
            else:
                gpu = rng.randrange(gpus)
                lost_gpu = (gpu, time.monotonic() + rng.uniform(*pace["lost"]))
                log(f"gpu{gpu} lost")
                mapper.control(op="lose", gpu=gpu)
        if lost_gpu is not None:
            mapper.control(op="reload", recover=True)
        try:
            wait(lambda: all(g["power_limit_w"] == DESIRED_W for g in mapper.gpu_state()), 30, "limits", 0.5)
            limits_ok = True
        except AssertionError:
            limits_ok = False
        end_usage = proc_usage(mapper.proc.pid)
        code, exit_s = mapper.terminate()
    finally:
        if mapper.proc.poll() is None:
            mapper.kill()
    left = buffered(mapper.data_dir)
    try:
        wait(lambda: unaccounted(consumer, left) == 0, 30, "the consumer's last deliveries")
    except AssertionError:
        pass
    lost = unaccounted(consumer, left)
    consumer.close()
    broker.stop()
    edge.call(edge.edge.stop())
    with consumer.lock:
        delivered = dict(consumer.samples)
        duplicates = consumer.deliveries - len(delivered)
    # A batch can be both at the consumer and still in the buffer (published, its PUBACK not yet handled when
    # the mapper stopped): it counts once as produced.
    in_buffer = buffered_samples(mapper.data_dir)
    produced = {**in_buffer, **delivered}
    print(
        json.dumps(
            {
                "benchmark": "soak",
                "sim_cost": "none",  # the faults' child runs the simulator cost-free: its figures are counts
                "minutes": args.minutes,
                "seed": args.seed,
                "gpus": gpus,
                "faults": faults,
                "batches_produced": len(produced) + lost,
                "batches_delivered": len(delivered),
                "batches_left_in_buffer": len(in_buffer),
                "batches_delivered_and_left_in_buffer": len(in_buffer.keys() & delivered.keys()),
                "batches_lost": lost,
                # A lost batch's samples were never seen: with batches_lost 0, samples_lost is 0; else unknown.
                "samples_produced": sum(produced.values()) if lost == 0 else None,
                "samples_delivered": sum(delivered.values()),
                "samples_left_in_buffer": sum(n for key, n in in_buffer.items() if key not in delivered),
                "samples_lost": 0 if lost == 0 else None,
                "duplicate_deliveries": duplicates,
                "desired_limits_on_gpus_at_end": limits_ok,
                "edgecore_registrations": edge.registers(),
                "exit_code": code,
                "exit_s": round(exit_s, 2),
                "rss_kb_start": start_usage["rss_kb"],
                "rss_kb_end": end_usage["rss_kb"],
                "rss_kb_along": rss_along,
                "rss_every_s": rss_every_s,
                "open_fds_start": start_usage["open_fds"],
                "open_fds_end": end_usage["open_fds"],
            }
        )
    )


if __name__ == "__main__":
    main()
