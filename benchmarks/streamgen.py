"""A telemetry stream the encoder and its dictionary were NOT tuned on, for benchmarks/buffer.py.

Nothing here comes from the simulator (mapper/edge/gpu/simnvml.py) or the catalog's cadences. The noise model is
its own, written before any figure was measured on it and not changed after:

* Each GPU runs a two-state Markov workload (idle / busy, mean dwell 20 min / 40 min per GPU, drawn per GPU);
  busy phases have bursts (a Poisson process, ~1 a minute) where utilisation drops for a few seconds.
* Power in watts with milliwatt resolution (3 decimals): a level set by utilisation, plus an AR(1) jitter
  (sigma 2.5 W, phi 0.6) and a rare spike. Energy in joules (3 decimals), the integral of power.
* Temperatures: first-order lags (tau 90 s / 150 s) towards a power-dependent target, read as integers with
  a dither, so they flicker between neighbours.
* PCIe: log-normal byte rates in KiB/s, heavy-tailed, independent per sample; NVLink byte counters growing by
  noisy increments (names outside the catalog).
* Clocks in 15 MHz bins that boost or throttle with temperature; memory used stepping at job boundaries in
  MiB multiples, with small allocation noise; a few counters that rarely increment (ECC, XID).
* Ratios from a profiling source (``sm_active``, ``dram_active``, ``tensor_active``: outside the catalog) as a
  text exporter prints them: 6 significant digits.
* A health string and a throttle flag (outside the catalog), the product name and limits (static).
* Timestamps: every collect round is stamped with the wall clock of the round, which jitters by a few
  milliseconds (the mapper stamps its samples when it reads them; the simulator's are exact).
* Cadences (not the catalog's): 1 s, 2 s, 5 s, 15 s and 60 s groups; GPU count and seed are parameters.

Values with 53 random mantissa bits (a raw double ratio) are left out on purpose: they are incompressible for
any lossless store, ours and Prometheus' alike (about 8 bytes a sample for both).

``generate(gpus, hours, seed)`` yields ``(device, Sample)`` in time order, one Sample per device and round with
the properties due in that round. ``python benchmarks/streamgen.py --gpus G --hours H --out FILE.csv`` writes
it as the CSV that ``benchmarks/buffer.py --input`` reads (``ts_ms,device,property,value``) and prints one JSON
line last (what it wrote).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from mapper.shared.model import Sample, Value

#: A Monday at 00:00 UTC, on a 2 h boundary (one TSDB block per 2 h).
START_MS = 1_781_395_200_000
NODE = "site-7"

#: (cadence in s, properties). Names marked * are outside the catalog (no one-byte code).
CADENCES: tuple[tuple[int, tuple[str, ...]], ...] = (
    (1, ("power_usage", "utilization_gpu", "utilization_memory", "clock_sm", "pcie_tx", "pcie_rx")),
    (2, ("sm_active", "dram_active", "tensor_active", "energy_consumption", "nvlink_tx_bytes", "nvlink_rx_bytes")),
    (5, ("temperature", "temperature_memory", "fan_speed", "memory_used", "clock_memory", "throttle_thermal")),
    (15, ("ecc_errors_corrected", "xid_last", "gpu_health", "clock_event_reasons", "pstate")),
    (60, ("product_name", "memory_total", "power_limit_enforced", "uuid")),
)
OUTSIDE_CATALOG = frozenset(
    {"sm_active", "dram_active", "tensor_active", "nvlink_tx_bytes", "nvlink_rx_bytes"}
    | {"throttle_thermal", "gpu_health"}
)
PRODUCTS = ("NVIDIA A40", "NVIDIA RTX A6000", "NVIDIA L40", "NVIDIA A30")


@dataclass
class _Gpu:
    index: int
    rng: random.Random
    uuid: str
    product: str
    limit_w: float
    idle_w: float
    mem_total_mib: int
    busy: bool = False
    dwell_idle_s: float = 1200.0
    dwell_busy_s: float = 2400.0
    burst_left_s: int = 0
    util: float = 0.0
    jitter_w: float = 0.0
    power_w: float = 0.0
    energy_mj: int = 0
    temp_c: float = 34.0
    temp_mem_c: float = 38.0
    clock_mhz: int = 210
    mem_used_mib: int = 400
    nvlink_tx: int = 0
    nvlink_rx: int = 0
    ecc: int = 0
    xid: int = 0
    extra: dict[str, float] = field(default_factory=dict)


def _uuid(rng: random.Random) -> str:
    h = f"{rng.getrandbits(128):032x}"
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _sig6(x: float) -> float:
    """x as a text exporter prints a ratio: 6 significant digits."""
    return float(f"{x:.6g}")


def _new_gpu(i: int, seed: int) -> _Gpu:
    rng = random.Random(seed * 1000 + i)
    product = PRODUCTS[i % len(PRODUCTS)]
    limit = {"NVIDIA A40": 300.0, "NVIDIA RTX A6000": 300.0, "NVIDIA L40": 300.0, "NVIDIA A30": 165.0}[product]
    return _Gpu(
        index=i,
        rng=rng,
        uuid=_uuid(rng),
        product=product,
        limit_w=limit,
        idle_w=rng.uniform(18.0, 32.0),
        mem_total_mib=49140 if product != "NVIDIA A30" else 24576,
        busy=rng.random() < 0.5,
        dwell_idle_s=rng.uniform(600.0, 1800.0),
        dwell_busy_s=rng.uniform(1200.0, 3600.0),
        nvlink_tx=rng.getrandbits(40),
        nvlink_rx=rng.getrandbits(40),
        energy_mj=rng.getrandbits(36),
    )


def _step(g: _Gpu) -> None:
    """One second of the GPU's state."""
    rng = g.rng
    if rng.random() < 1.0 / (g.dwell_busy_s if g.busy else g.dwell_idle_s):
        g.busy = not g.busy
        g.mem_used_mib = (
            rng.randrange(g.mem_total_mib // 4, g.mem_total_mib - 512) // 2 * 2 if g.busy else rng.randrange(300, 700)
        )
    if g.busy:
        if g.burst_left_s == 0 and rng.random() < 1 / 60:
            g.burst_left_s = rng.randint(2, 9)
        if g.burst_left_s > 0:
            g.burst_left_s -= 1
            target = rng.uniform(5.0, 40.0)
        else:
            target = rng.gauss(93.0, 4.0)
    else:
        target = rng.expovariate(1.0) if rng.random() < 0.3 else 0.0
    g.util = min(100.0, max(0.0, 0.5 * g.util + 0.5 * target))
    g.jitter_w = 0.6 * g.jitter_w + rng.gauss(0.0, 2.5)
    spike = rng.uniform(10.0, 40.0) if rng.random() < 0.002 else 0.0
    level = g.idle_w + (g.limit_w * 0.95 - g.idle_w) * (g.util / 100.0) ** 1.3
    g.power_w = max(5.0, min(g.limit_w * 1.02, level + g.jitter_w + spike))
    g.energy_mj += round(g.power_w * 1000)
    t_target = 30.0 + 0.17 * g.power_w
    g.temp_c += (t_target - g.temp_c) / 90.0
    g.temp_mem_c += (t_target + 6.0 - g.temp_mem_c) / 150.0
    boost = 1980 if g.temp_c < 70 else 1740
    want = 210 if g.util < 1 else boost - int(max(0.0, g.temp_c - 60.0) * 6)
    g.clock_mhz = max(210, min(boost, g.clock_mhz + max(-150, min(150, want - g.clock_mhz)))) // 15 * 15
    if g.busy:
        g.mem_used_mib = max(300, min(g.mem_total_mib - 2, g.mem_used_mib + rng.choice((-2, 0, 0, 0, 2))))
    g.nvlink_tx += int(rng.lognormvariate(17.0 if g.busy else 9.0, 1.2))
    g.nvlink_rx += int(rng.lognormvariate(16.5 if g.busy else 9.0, 1.2))
    if rng.random() < 1 / 7200:
        g.ecc += 1
    if rng.random() < 1 / 40000:
        g.xid = rng.choice((13, 31, 43, 48, 79))


def _values(g: _Gpu, names: tuple[str, ...]) -> dict[str, Value]:
    rng = g.rng
    util = g.util
    out: dict[str, Value] = {}
    for name in names:
        v: Value
        if name == "power_usage":
            v = round(g.power_w, 3)
        elif name == "utilization_gpu":
            v = round(util)
        elif name == "utilization_memory":
            v = max(0, min(100, round(util * 0.55 + rng.gauss(0.0, 3.0)))) if util > 1 else 0
        elif name == "clock_sm":
            v = g.clock_mhz
        elif name in ("pcie_tx", "pcie_rx"):
            mu = 11.0 if g.busy else 4.0
            v = int(rng.lognormvariate(mu - (0.7 if name == "pcie_rx" else 0.0), 1.0))
        elif name in ("sm_active", "dram_active", "tensor_active"):
            scale = {"sm_active": 0.98, "dram_active": 0.45, "tensor_active": 0.62}[name]
            x = min(1.0, max(0.0, util / 100.0 * scale + rng.gauss(0.0, 0.015))) if util > 0.5 else 0.0
            v = _sig6(x)
        elif name == "energy_consumption":
            v = g.energy_mj / 1000
        elif name == "nvlink_tx_bytes":
            v = g.nvlink_tx
        elif name == "nvlink_rx_bytes":
            v = g.nvlink_rx
        elif name == "temperature":
            v = math.floor(g.temp_c + rng.random())
        elif name == "temperature_memory":
            v = math.floor(g.temp_mem_c + rng.random())
        elif name == "fan_speed":
            v = max(30, min(100, round(30 + (g.temp_c - 40.0) * 2.2)))
        elif name == "memory_used":
            v = g.mem_used_mib * 1048576
        elif name == "clock_memory":
            v = 7251 if g.busy or util > 1 else 405
        elif name == "throttle_thermal":
            v = g.temp_c > 78.0
        elif name == "ecc_errors_corrected":
            v = g.ecc
        elif name == "xid_last":
            v = g.xid
        elif name == "gpu_health":
            v = "ok" if g.xid == 0 else "degraded"
        elif name == "clock_event_reasons":
            v = (1 if util < 1 else 0) | (0x20 if g.temp_c > 78.0 else 0) | (0x4 if g.power_w > g.limit_w * 0.97 else 0)
        elif name == "pstate":
            v = "P0" if util > 1 else "P8"
        elif name == "product_name":
            v = g.product
        elif name == "memory_total":
            v = g.mem_total_mib * 1048576
        elif name == "power_limit_enforced":
            v = g.limit_w
        elif name == "uuid":
            v = g.uuid
        else:  # pragma: no cover - a name in CADENCES without a value
            raise AssertionError(name)
        out[name] = v
    return out


def device_key(i: int) -> str:
    return f"ml/{NODE}-gpu-{i}"


def generate(gpus: int = 8, hours: float = 1.0, seed: int = 11) -> Iterator[tuple[str, Sample]]:
    """(device, Sample) for every collect round of every GPU, in time order (see the module docstring)."""
    fleet = [_new_gpu(i, seed) for i in range(gpus)]
    clock_rng = random.Random(seed)
    for second in range(round(hours * 3600)):
        due = tuple(name for cadence, names in CADENCES if second % cadence == 0 for name in names)
        for g in fleet:
            _step(g)
            # The round's wall clock: a few ms of scheduling jitter, now and then tens of ms.
            jitter = clock_rng.randint(0, 4) if clock_rng.random() < 0.97 else clock_rng.randint(5, 60)
            ts = START_MS + second * 1000 + jitter
            yield device_key(g.index), Sample(g.uuid, ts, _values(g, due))


def write_csv(rows: Iterator[tuple[str, Sample]], path: Path) -> int:
    """The stream as ``ts_ms,device,property,value`` (booleans as true/false); the number of samples."""
    n = 0
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(("ts_ms", "device", "property", "value"))
        for device, sample in rows:
            for prop, value in sample.values.items():
                text = ("true" if value else "false") if isinstance(value, bool) else repr(value)
                w.writerow((sample.ts_ms, device, prop, value if isinstance(value, str) else text))
                n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--hours", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--out", type=Path, required=True, help="CSV file to write")
    args = ap.parse_args()
    n = write_csv(generate(args.gpus, args.hours, args.seed), args.out)
    print(f"{n} samples written to {args.out}", file=sys.stderr)
    summary = {"benchmark": "streamgen", "gpus": args.gpus, "hours": args.hours, "samples": n, "out": str(args.out)}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
