"""CPU cost of encoding one telemetry batch, against the cost of compressing it, in the same process.

Workload: 8 simulated H100s (SimNvml through ``NvmlBackend.sample``, scenario "inference") sampled once a
second on a fake clock; each device's 10 samples of a 10 s window make one batch, as the mapper cuts them.
Figures, all CPU microseconds (process time) and the best of ``--repeats`` timed passes over every batch:

* ``us_per_batch``: ``encode_batch(..., fmt="binary", codec=...)``, the whole path (body + zstd);
* ``body_us_per_batch``: ``batch_body`` alone (the encoder's own Python work);
* ``pack_us_per_batch``: ``BatchCodec.pack`` of the prepared bodies alone (the zstd baseline);
* ``us_per_add``: ``DeviceTelemetry.add`` of one sample (a Device with every sampled property, one route).

``--processes``: the process cycle's rows too (``mapper.edge.processes.loop.telemetry_values`` of each GPU every 5 s,
half a second after a collect sample, as its own timer stamps them): 10 collect rows and 2 process rows a batch.

Ratios: ``encode_pack_ratio`` = us_per_batch / pack, ``body_pack_ratio`` = body / pack.

``--baseline FILE`` loads another copy of ``mapper/wire/telemetry.py`` (e.g. ``git show REV:mapper/wire/telemetry.py >
/tmp/telemetry_old.py``), checks that it writes the very same bytes, and times it in the same process:
the ``baseline`` object holds its figures and ``speedup`` = baseline us / our us (the two take turns at
each timed pass). Prints one JSON line last.
Run: ``.venv/bin/python benchmarks/encode.py [--batches-per-gpu N] [--repeats R] [--baseline FILE] [--processes]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from mapper.clock import FakeClock
from mapper.edge.gpu.nvml import NvmlBackend
from mapper.edge.gpu.simnvml import SimNvml
from mapper.shared.model import DeviceConfig, DeviceProperty, Sample
from mapper.wire import telemetry

GPUS = 8
SAMPLES_PER_BATCH = 10
NODE = "edge-node-1"
BOOT_ID = "0f3a9c21"


def simulated_batches(batches_per_gpu: int, processes: bool = False) -> list[tuple[str, str, list[Sample]]]:
    """(device, uuid, samples) per batch: every GPU sampled once a second, 10 samples per batch; with
    ``processes``, each GPU's process cycle row every 5 s as well."""
    from mapper.edge.processes.loop import telemetry_values
    from mapper.edge.processes.monitor import ProcessMonitor

    clock = FakeClock()
    sim = SimNvml(GPUS, "H100", seed=0, clock=clock.monotonic, scenario="inference")
    backend = NvmlBackend(sim, clock=clock)
    monitor = ProcessMonitor()
    try:
        gpus = backend.list_gpus()
        out: list[tuple[str, str, list[Sample]]] = []
        for _ in range(batches_per_gpu):
            window: dict[str, list[Sample]] = {g.uuid: [] for g in gpus}
            for second in range(SAMPLES_PER_BATCH):
                clock.advance(0.5)
                if processes and second % 5 == 0:
                    for g in gpus:
                        report, _ = monitor.observe(backend.processes(g.uuid), {}, clock.monotonic())
                        window[g.uuid].append(Sample(g.uuid, clock.wall_ms(), telemetry_values(report)))
                clock.advance(0.5)
                for g in gpus:
                    window[g.uuid].append(backend.sample(g.uuid))
            out += [(f"default/{NODE}-gpu{g.index}", g.uuid, window[g.uuid]) for g in gpus]
        return out
    finally:
        backend.shutdown()


def cpu_s(work: Callable[[], object]) -> float:
    t0 = time.process_time()
    work()
    return time.process_time() - t0


def load_module(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("telemetry_baseline", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


Workload = dict[str, tuple[Callable[[], object], int]]


def workload(mod: Any, batches: list[tuple[str, str, list[Sample]]]) -> tuple[Workload, bytes]:
    """What is timed with one telemetry module, by figure: (the work, items it handles); and every payload it
    wrote (to compare modules byte for byte)."""
    codec = mod.BatchCodec()

    def kwargs(i: int, device: str, uuid: str) -> dict[str, Any]:
        return {"node": NODE, "device": device, "uuid": uuid, "boot_id": BOOT_ID, "seq": i, "uuid_in_header": i < GPUS}

    def encode_all() -> list[bytes]:
        return [
            mod.encode_batch(samples, fmt="binary", codec=codec, **kwargs(i, device, uuid)).payload
            for i, (device, uuid, samples) in enumerate(batches)
        ]

    def bodies_all() -> list[bytes]:
        return [mod.batch_body(samples, **kwargs(i, d, u)) for i, (d, u, samples) in enumerate(batches)]

    payloads = encode_all()  # warm-up: the zstd context and dictionary load
    bodies = bodies_all()

    def pack_all() -> None:
        for body in bodies:
            codec.pack(body)

    devices = [
        DeviceConfig(
            "default",
            device.split("/")[1],
            "gpu",
            uuid,
            tuple(DeviceProperty(n) for n in max(samples, key=lambda s: len(s.values)).values),
        )
        for device, uuid, samples in batches[:GPUS]
    ]
    samples_flat = [(i % GPUS, s) for i, (_, _, samples) in enumerate(batches) for s in samples]

    def add_all() -> None:
        streams = [mod.DeviceTelemetry(NODE, d, BOOT_ID, codec=codec) for d in devices]
        for gpu, s in samples_flat:
            streams[gpu].add(s)

    n = len(batches)
    work: Workload = {
        "us_per_batch": (encode_all, n),
        "body_us_per_batch": (bodies_all, n),
        "pack_us_per_batch": (pack_all, n),
        "us_per_add": (add_all, len(samples_flat)),
    }
    return work, b"".join(payloads)


def measure(workloads: list[Workload], repeats: int) -> list[dict[str, float]]:
    """The best CPU microseconds per item of every figure of every workload; the workloads take turns at
    each pass, so that a busy neighbour slows them alike."""
    best = [dict.fromkeys(w, float("inf")) for w in workloads]
    for figure in workloads[0]:
        for _ in range(repeats):
            for w, b in zip(workloads, best, strict=True):
                work, items = w[figure]
                b[figure] = min(b[figure], cpu_s(work) / items * 1e6)
    return best


def rounded(figures: dict[str, float]) -> dict[str, float]:
    """The figures to 0.1 us, with the encode/pack and body/pack ratios."""
    out = {k: round(v, 1) for k, v in figures.items()}
    out["encode_pack_ratio"] = round(figures["us_per_batch"] / figures["pack_us_per_batch"], 3)
    out["body_pack_ratio"] = round(figures["body_us_per_batch"] / figures["pack_us_per_batch"], 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches-per-gpu", type=int, default=6, help="10 s windows per GPU (default 6)")
    parser.add_argument("--repeats", type=int, default=9, help="timed passes, the best counts (default 9)")
    parser.add_argument("--baseline", type=Path, help="another mapper/wire/telemetry.py to compare against")
    parser.add_argument("--processes", action="store_true", help="the process cycle's rows too (every 5 s)")
    args = parser.parse_args()

    batches = simulated_batches(args.batches_per_gpu, args.processes)
    baseline = load_module(args.baseline) if args.baseline else None
    result: dict[str, Any] = {
        "benchmark": "encode",
        "sim_cost": "none",  # the simulator only makes the data; its calls' cost is not in any figure
        "gpus": GPUS,
        "batches": len(batches),
        "samples_per_batch": round(sum(len(ss) for _, _, ss in batches) / len(batches), 1),
        "processes": args.processes,
        "values_per_batch": round(sum(len(s.values) for _, _, ss in batches for s in ss) / len(batches), 1),
    }
    ours, our_bytes = workload(telemetry, batches)
    if baseline is None:
        (our_figures,) = measure([ours], args.repeats)
    else:
        theirs, their_bytes = workload(baseline, batches)
        our_figures, their_figures = measure([ours, theirs], args.repeats)
        result["same_bytes"] = their_bytes == our_bytes
        result["baseline"] = rounded(their_figures)
        result["speedup"] = {
            k: round(their_figures[k] / our_figures[k], 2) for k in ("us_per_batch", "body_us_per_batch", "us_per_add")
        }
    result["payload_bytes_per_batch"] = round(len(our_bytes) / len(batches), 1)
    result.update(rounded(our_figures))
    result["python"] = platform.python_version()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
