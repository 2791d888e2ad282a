"""A second external stream for ``benchmarks/buffer.py --input``, written to the description in issue 14 and
independently of benchmarks/streamgen.py (no code or noise model shared): 24 series per GPU, every one at
1 Hz; power in mW with watt-level uniform jitter, noisy PCIe rates, bursty on/off utilisation, slow
temperatures, constant identity and limits. ``--foreign-names`` renames every series to a name outside the
catalog (``dcgm_*``), which costs each batch its names.

No real fleet recording was at hand: this file is the stand-in for "a stream we did not make", and is named as
such wherever a figure measured on it is quoted.

``python benchmarks/csvstream.py --gpus 8 --hours 1 [--foreign-names] --out FILE.csv`` (prints one JSON line last:
what it wrote)
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import sys
from pathlib import Path

START_MS = 1_782_000_000_000 - 1_782_000_000_000 % 7_200_000


def write(path: Path, gpus: int, hours: float, seed: int, foreign: bool) -> int:
    rng = random.Random(seed)
    state = []
    for _ in range(gpus):
        state.append(
            {
                "on": rng.random() < 0.5,
                "temp": rng.uniform(35, 45),
                "temp_mem": rng.uniform(38, 48),
                "energy_mj": rng.randrange(10**9, 10**10),
                "mem_used": rng.randrange(1, 20) * 1024**3,
                "uuid": f"GPU-{rng.getrandbits(32):08x}-{rng.getrandbits(16):04x}-{rng.getrandbits(16):04x}-"
                f"{rng.getrandbits(16):04x}-{rng.getrandbits(48):012x}",
            }
        )
    n = 0
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(("ts_ms", "device", "property", "value"))
        for second in range(round(hours * 3600)):
            ts = START_MS + second * 1000
            for g, st in enumerate(state):
                if rng.random() < 0.05:  # bursty: on/off phases of ~20 s
                    st["on"] = not st["on"]
                    if st["on"]:
                        st["mem_used"] = rng.randrange(4, 70) * 1024**3
                util = rng.randint(70, 100) if st["on"] else 0
                power_mw = (65_000 + util * 5_800) + rng.randint(-1000, 1000)
                st["energy_mj"] += power_mw
                target = 38 + util * 0.42
                st["temp"] += (target - st["temp"]) * 0.01 + rng.uniform(-0.05, 0.05)
                st["temp_mem"] += (target + 5 - st["temp_mem"]) * 0.006 + rng.uniform(-0.05, 0.05)
                base_pcie = 900_000 if st["on"] else 2_000
                values: dict[str, object] = {
                    "power_usage": power_mw,
                    "energy_consumption": st["energy_mj"],
                    "utilization_gpu": util,
                    "utilization_memory": max(0, min(100, int(util * 0.4 + rng.gauss(0, 2)))),
                    "temperature": int(st["temp"]),
                    "temperature_memory": int(st["temp_mem"]),
                    "pcie_tx": max(0, int(base_pcie * rng.uniform(0.8, 1.2))),
                    "pcie_rx": max(0, int(base_pcie * 1.3 * rng.uniform(0.8, 1.2))),
                    "clock_sm": (1980 - 15 * rng.randint(0, 2)) if util else 345,
                    "clock_memory": 2619,
                    "memory_used": st["mem_used"],
                    "memory_total": 85_899_345_920,
                    "fan_speed": max(30, min(100, int(st["temp"] * 1.2))),
                    "power_limit": 700_000,
                    "product_name": "NVIDIA H100 80GB HBM3",
                    "uuid": st["uuid"],
                    "pstate": "P0" if util else "P8",
                    "persistence_mode": "true",
                    "compute_mode": "default",
                    "ecc_errors_corrected": 0,
                    "ecc_errors_uncorrected": 0,
                    "xid_last": 0,
                    "remapped_rows_pending": "false",
                    "clock_event_reasons": 0 if util else 1,
                }
                device = f"default/node-b-gpu{g}"
                for prop, value in values.items():
                    w.writerow((ts, device, f"dcgm_{prop}" if foreign else prop, value))
                    n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--hours", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--foreign-names", action="store_true", help="series names outside the catalog")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    n = write(args.out, args.gpus, args.hours, args.seed, args.foreign_names)
    print(f"{n} samples written to {args.out}", file=sys.stderr)
    summary = {"benchmark": "csvstream", "gpus": args.gpus, "hours": args.hours, "samples": n, "out": str(args.out)}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
