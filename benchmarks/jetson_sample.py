"""CPU cost of one full sample of a Jetson through JetsonBackend over a simulated board's sysfs tree.

The tree of ``--profile`` (default orin-agx) is built in a temporary directory (``--dir`` to choose, e.g. a tmpfs)
and stepped once per round by the simulated board's physics on a fake clock, outside the timed part. Figures, all
in the same process, each the best of ``--repeats`` passes taken in turns:

* ``us_per_sample``: CPU microseconds (process time) per ``backend.sample(uuid)`` of every Jetson property;
* ``files_per_sample``: how many files one such sample reads (after the first, which also reads the trip points
  and nvpmodel.conf once);
* ``raw_read_us_per_sample`` (the baseline): the very same files read with ``os.open`` / ``os.read`` /
  ``os.close`` and nothing else, i.e. what the system calls alone cost; ``parse_share`` = (us - raw) / us is
  the backend's own Python work;
* ``nvml_sim_us_per_sample``: for scale, one full sample of a simulated H100 through NvmlBackend (inline, no
  worker thread: ``_sample``), in the same process.

Prints one JSON line last. Run: ``.venv/bin/python benchmarks/jetson_sample.py [--samples N] [--repeats R]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import mapper.edge.gpu.jetson as jetson
from mapper.clock import FakeClock
from mapper.edge.gpu.nvml import NvmlBackend, _wanted
from mapper.edge.gpu.simjetson import SimJetson
from mapper.edge.gpu.simnvml import SimNvml


def files_of_one_sample(backend: jetson.JetsonBackend, uuid: str) -> list[Path]:
    seen: list[Path] = []
    original = jetson._read_text

    def recording(path: Path) -> str | None:
        seen.append(path)
        return original(path)

    jetson._read_text = recording  # type: ignore[assignment]
    try:
        backend.sample(uuid)
    finally:
        jetson._read_text = original  # type: ignore[assignment]
    return seen


def timed(fn, n: int) -> float:  # type: ignore[no-untyped-def]
    start = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - start) / n * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="orin-agx")
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", help="where to build the tree (default: a temporary directory)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        clock = FakeClock()
        sim = SimJetson.create(Path(tmp) / "board", args.profile, scenario="steady", clock=clock.monotonic)
        backend = jetson.JetsonBackend(Path(tmp) / "board", clock=clock)
        uuid = backend.list_gpus()[0].uuid
        backend.sample(uuid)  # the first sample also reads what is read once (trip points, nvpmodel.conf)
        files = files_of_one_sample(backend, uuid)

        def ours() -> None:
            backend.sample(uuid)

        def raw() -> None:
            for path in files:
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError:
                    continue
                os.read(fd, 65536)
                os.close(fd)

        nclock = FakeClock()
        nvml = NvmlBackend(SimNvml(1, "H100", seed=0, clock=nclock.monotonic), clock=nclock)
        nvml_uuid = nvml.list_gpus()[0].uuid
        wanted = _wanted(None)

        def nvml_sample() -> None:
            nvml._sample(nvml_uuid, wanted)

        best = {"ours": float("inf"), "raw": float("inf"), "nvml": float("inf")}
        for _ in range(args.repeats):
            clock.advance(1.0)
            sim.step()
            best["ours"] = min(best["ours"], timed(ours, args.samples))
            best["raw"] = min(best["raw"], timed(raw, args.samples))
            best["nvml"] = min(best["nvml"], timed(nvml_sample, args.samples))
        nvml.shutdown()

    result = {
        "benchmark": "jetson_sample",
        "profile": args.profile,
        "properties": len(jetson._FAMILY_PROPS),
        "files_per_sample": len(files),
        "us_per_sample": round(best["ours"], 1),
        "raw_read_us_per_sample": round(best["raw"], 1),
        "parse_share": round((best["ours"] - best["raw"]) / best["ours"], 3),
        "nvml_sim_us_per_sample": round(best["nvml"], 1),
        "nvml_sim_cost": "none",  # the simulator's own sample, its calls free (the H200's: benchmarks/overhead.py)
        "samples": args.samples,
        "repeats": args.repeats,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
