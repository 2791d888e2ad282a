"""CPU cost of one full GPU sample through NvmlBackend over the simulated NVML, and the simulator's share.

Four simulated H100s run the training scenario; each round advances a fake clock by 1 s and samples every GPU
(so the simulator integrates its physics as it would in the mapper). Three figures, all in the same process:

* ``us_per_sample``: CPU microseconds (process time, all threads) per ``backend.sample(uuid)``, the public path
  with its worker-thread hop and timeout;
* ``inline_us_per_sample``: the same sample without the worker thread (the backend's own Python work + NVML);
* ``sim_us_per_sample``: the very NVML calls one sample makes, replayed straight on the simulator (the baseline).

Ratios: ``sim_share`` = sim / full, ``thread_hop_share`` = (full - inline) / full. Prints one JSON line last.
Run: ``.venv/bin/python benchmarks/sample.py [--samples N]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from typing import Any

from mapper.clock import FakeClock
from mapper.gpu.nvml import _ALL_NVML, NvmlBackend
from mapper.gpu.simnvml import SimNvml

GPUS = 4


class Recorder:
    """Passes every call through to the simulator and writes down (function, args)."""

    def __init__(self, sim: SimNvml) -> None:
        self._sim = sim
        self.recording: list[tuple[str, tuple[Any, ...]]] | None = None

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._sim, name)
        if not callable(target) or not name.startswith("nvml") or isinstance(target, type):
            return target

        def call(*args: Any) -> Any:
            if self.recording is not None:
                self.recording.append((name, args))
            return target(*args)

        return call


def measure(rounds: int, clock: FakeClock, uuids: list[str], work: Callable[[str], object]) -> tuple[float, float]:
    """(CPU us, wall us) per sample over ``rounds`` rounds of every GPU."""
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(rounds):
        clock.advance(1.0)
        for uuid in uuids:
            work(uuid)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    n = rounds * len(uuids)
    return cpu / n * 1e6, wall / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20_000, help="samples per figure (default 20000)")
    args = parser.parse_args()
    rounds = max(1, args.samples // GPUS)

    clock = FakeClock()
    sim = SimNvml(GPUS, "H100", seed=0, clock=clock.monotonic, scenario="training")
    recorder = Recorder(sim)
    backend = NvmlBackend(recorder, clock=clock)
    uuids = [g.uuid for g in backend.list_gpus()]
    for uuid in uuids:  # warm up: handles, NotSupported cache, event registration
        backend.sample(uuid)

    # the NVML calls of one full sample, to replay on the simulator alone
    recorder.recording = []
    backend.sample(uuids[0])
    calls = recorder.recording
    recorder.recording = None
    per_gpu = {u: [(name, (backend._handles[u], *a[1:]) if a else a) for name, a in calls] for u in uuids}
    bound = {u: [(getattr(sim, name), a) for name, a in per_gpu[u]] for u in uuids}

    def raw(uuid: str) -> None:
        for fn, a in bound[uuid]:
            fn(*a)

    backend_direct = NvmlBackend(sim, clock=clock)
    backend_direct.list_gpus()
    for uuid in uuids:
        backend_direct.sample(uuid)

    def inline(uuid: str) -> None:
        backend_direct._sample(uuid, _ALL_NVML)

    def full(uuid: str) -> None:
        backend_direct.sample(uuid)

    measure(max(1, rounds // 10), clock, uuids, full)  # warm-up
    full_cpu, full_wall = measure(rounds, clock, uuids, full)
    inline_cpu, _ = measure(rounds, clock, uuids, inline)
    sim_cpu, _ = measure(rounds, clock, uuids, raw)
    backend.shutdown()
    backend_direct.shutdown()

    result = {
        "benchmark": "sample",
        "gpus": GPUS,
        "samples": rounds * GPUS,
        "nvml_calls_per_sample": len(calls),
        "us_per_sample": round(full_cpu, 1),
        "wall_us_per_sample": round(full_wall, 1),
        "inline_us_per_sample": round(inline_cpu, 1),
        "sim_us_per_sample": round(sim_cpu, 1),
        "sim_share": round(sim_cpu / full_cpu, 3),
        "thread_hop_share": round(max(0.0, full_cpu - inline_cpu) / full_cpu, 3),
        "python": platform.python_version(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
