"""CPU cost of encoding one telemetry batch, against the cost of compressing it, in the same process.

Workload: 8 simulated H100s (SimNvml through ``NvmlBackend.sample``, scenario "inference") sampled once a
second on a fake clock; each device's 10 samples of a 10 s window make one batch, as the mapper cuts them.
Figures, all CPU microseconds (process time) and the best of ``--repeats`` timed passes over every batch:

* ``us_per_batch``: ``encode_batch(..., fmt="binary", codec=...)``, the whole path (body + zstd);
* ``body_us_per_batch``: ``batch_body`` alone (the encoder's own Python work);
* ``pack_us_per_batch``: ``BatchCodec.pack`` of the prepared bodies alone (the zstd baseline);
* ``us_per_add``: ``DeviceTelemetry.add`` of one sample (a Device with every sampled property, one route).

Ratios: ``encode_pack_ratio`` = us_per_batch / pack, ``body_pack_ratio`` = body / pack.

``--baseline FILE`` loads another copy of ``mapper/telemetry.py`` (e.g. ``git show REV:mapper/telemetry.py >
/tmp/telemetry_old.py``), checks that it writes the very same bytes, and times it in the same process:
the ``baseline`` object holds its figures and ``speedup`` = baseline us / our us. Prints one JSON line last.
Run: ``.venv/bin/python benchmarks/encode.py [--batches-per-gpu N] [--repeats R] [--baseline FILE]``.
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

from mapper import telemetry
from mapper.clock import FakeClock
from mapper.gpu.nvml import NvmlBackend
from mapper.gpu.simnvml import SimNvml
from mapper.model import DeviceConfig, DeviceProperty, Sample

GPUS = 8
SAMPLES_PER_BATCH = 10
NODE = "edge-node-1"
BOOT_ID = "0f3a9c21"


def simulated_batches(batches_per_gpu: int) -> list[tuple[str, str, list[Sample]]]:
    """(device, uuid, samples) per batch: every GPU sampled once a second, 10 samples per batch."""
    clock = FakeClock()
    sim = SimNvml(GPUS, "H100", seed=0, clock=clock.monotonic, scenario="inference")
    backend = NvmlBackend(sim, clock=clock)
    try:
        gpus = backend.list_gpus()
        out: list[tuple[str, str, list[Sample]]] = []
        for _ in range(batches_per_gpu):
            window: dict[str, list[Sample]] = {g.uuid: [] for g in gpus}
            for _ in range(SAMPLES_PER_BATCH):
                clock.advance(1.0)
                for g in gpus:
                    window[g.uuid].append(backend.sample(g.uuid))
            out += [(f"default/{NODE}-gpu{g.index}", g.uuid, window[g.uuid]) for g in gpus]
        return out
    finally:
        backend.shutdown()


def best_us(repeats: int, items: int, work: Callable[[], object]) -> float:
    """The lowest CPU microseconds per item over ``repeats`` runs of ``work`` (which handles ``items`` items)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        work()
        best = min(best, time.process_time() - t0)
    return best / items * 1e6


def load_module(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("telemetry_baseline", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def measure(mod: Any, batches: list[tuple[str, str, list[Sample]]], repeats: int) -> tuple[dict[str, float], bytes]:
    """The figures of one telemetry module, and every payload it wrote (to compare modules byte for byte)."""
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
        DeviceConfig("default", device.split("/")[1], "gpu", uuid, tuple(DeviceProperty(n) for n in samples[0].values))
        for device, uuid, samples in batches[:GPUS]
    ]
    samples_flat = [(i % GPUS, s) for i, (_, _, samples) in enumerate(batches) for s in samples]

    def add_all() -> None:
        streams = [mod.DeviceTelemetry(NODE, d, BOOT_ID, codec=codec) for d in devices]
        for gpu, s in samples_flat:
            streams[gpu].add(s)

    n = len(batches)
    figures = {
        "us_per_batch": best_us(repeats, n, encode_all),
        "body_us_per_batch": best_us(repeats, n, bodies_all),
        "pack_us_per_batch": best_us(repeats, n, pack_all),
        "us_per_add": best_us(repeats, len(samples_flat), add_all),
    }
    return figures, b"".join(payloads)


def rounded(figures: dict[str, float]) -> dict[str, float]:
    """The figures to 0.1 us, with the encode/pack and body/pack ratios."""
    out = {k: round(v, 1) for k, v in figures.items()}
    out["encode_pack_ratio"] = round(figures["us_per_batch"] / figures["pack_us_per_batch"], 3)
    out["body_pack_ratio"] = round(figures["body_us_per_batch"] / figures["pack_us_per_batch"], 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches-per-gpu", type=int, default=6, help="10 s windows per GPU (default 6)")
    parser.add_argument("--repeats", type=int, default=5, help="timed passes, the best counts (default 5)")
    parser.add_argument("--baseline", type=Path, help="another mapper/telemetry.py to compare against")
    args = parser.parse_args()

    batches = simulated_batches(args.batches_per_gpu)
    baseline = load_module(args.baseline) if args.baseline else None
    result: dict[str, Any] = {
        "benchmark": "encode",
        "gpus": GPUS,
        "batches": len(batches),
        "samples_per_batch": SAMPLES_PER_BATCH,
        "values_per_batch": round(sum(len(s.values) for _, _, ss in batches for s in ss) / len(batches), 1),
    }
    # Ours, the baseline, ours again (the best of both counts): a noisy neighbour hurts both alike.
    ours, our_bytes = measure(telemetry, batches, args.repeats)
    if baseline is not None:
        theirs, their_bytes = measure(baseline, batches, args.repeats)
        ours_again, _ = measure(telemetry, batches, args.repeats)
        ours = {k: min(v, ours_again[k]) for k, v in ours.items()}
        result["same_bytes"] = their_bytes == our_bytes
        result["baseline"] = rounded(theirs)
        result["speedup"] = {
            k: round(theirs[k] / ours[k], 2) for k in ("us_per_batch", "body_us_per_batch", "us_per_add")
        }
    result["payload_bytes_per_batch"] = round(len(our_bytes) / len(batches), 1)
    result.update(rounded(ours))
    result["python"] = platform.python_version()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
