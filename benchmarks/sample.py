"""CPU cost of one full GPU sample through NvmlBackend over the simulated NVML, and the simulator's share.

Four simulated H100s run the training scenario; each round advances a fake clock by 1 s and samples every GPU
(so the simulator integrates its physics as it would in the mapper). Figures, all in the same process:

* ``us_per_sample``: CPU microseconds (process time, all threads) per ``backend.sample(uuid)``, the public path
  with its worker-thread hop and timeout;
* ``async_us_per_sample``: per sample of a round awaited as the mapper's GPU loops do, every GPU's
  ``call_async(backend.sample, uuid, names)`` in one event-loop iteration (one worker job per round), ``names``
  the list of every NVML catalog property (a new list per call, as the loops pass their due properties);
* ``inline_us_per_sample``: the same sample without the worker thread (the backend's own Python work + NVML);
* ``sim_us_per_sample``: the very NVML calls one sample makes, replayed straight on the simulator (the baseline).

Ratios: ``sim_share`` = sim / full, ``thread_hop_share`` = (full - inline) / full; ``wrapper_us_per_sample`` =
inline - sim, the backend's own Python work per sample.

``--baseline FILE`` loads another copy of ``mapper/edge/gpu/nvml.py`` (e.g. ``git show REV:mapper/edge/gpu/nvml.py >
/tmp/nvml_old.py``), checks that it samples the very same values, and times it in the same process: the
``baseline`` object holds its figures and ``speedup`` = baseline us / our us. Passes are short and taken in turns
(ours, the simulator, the baseline); every figure is the best of ``--repeats`` passes, so a noisy neighbour hurts
all alike. Prints one JSON line last.
``--sim-cost h200``: the simulated calls charge what they cost on an H200 (CPU burnt, waits), for the sample's
whole cost on that driver; the default ``none`` shows the backend's own Python beside the bare simulator.
Run: ``.venv/bin/python benchmarks/sample.py [--samples N] [--repeats R] [--baseline FILE] [--sim-cost none|h200]``.
"""

from __future__ import annotations

import argparse
import asyncio
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
from mapper.edge.gpu import nvml
from mapper.edge.gpu.simnvml import SimNvml
from mapper.shared.model import NVML_PROPERTIES

GPUS = 4
NAMES = [p.name for p in NVML_PROPERTIES]


class Recorder:
    """Passes every call through to the simulator and writes down (function, args, keyword args)."""

    def __init__(self, sim: SimNvml) -> None:
        self._sim = sim
        self.recording: list[tuple[str, tuple[Any, ...], dict[str, Any]]] | None = None

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._sim, name)
        if not callable(target) or not name.startswith("nvml") or isinstance(target, type):
            return target

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.recording is not None:
                self.recording.append((name, args, kwargs))
            return target(*args, **kwargs)

        return call


def load_module(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("nvml_baseline", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


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


def measure_async(rounds: int, clock: FakeClock, uuids: list[str], backend: Any) -> float:
    """CPU us per sample over ``rounds`` rounds, each round every GPU's sample awaited in one loop iteration."""

    async def run() -> None:
        for _ in range(rounds):
            clock.advance(1.0)
            await asyncio.gather(*(backend.call_async(backend.sample, uuid, list(NAMES)) for uuid in uuids))

    cpu0 = time.process_time()
    asyncio.run(run())
    return (time.process_time() - cpu0) / (rounds * len(uuids)) * 1e6


class Subject:
    """One nvml module's backend over the shared simulator, warmed up."""

    def __init__(self, module: ModuleType, sim: SimNvml, clock: FakeClock, uuids: list[str]) -> None:
        self.backend = module.NvmlBackend(sim, clock=clock)
        self.backend.list_gpus()
        for uuid in uuids:
            self.backend.sample(uuid)
        self.all_nvml = module._ALL_NVML
        self.best: dict[str, float] = {}

    def run(self, rounds: int, clock: FakeClock, uuids: list[str]) -> None:
        backend, all_nvml = self.backend, self.all_nvml
        full_cpu, full_wall = measure(rounds, clock, uuids, backend.sample)
        inline_cpu, _ = measure(rounds, clock, uuids, lambda uuid: backend._sample(uuid, all_nvml))
        async_cpu = measure_async(rounds, clock, uuids, backend)
        got = {"full": full_cpu, "wall": full_wall, "inline": inline_cpu, "async": async_cpu}
        self.best = {k: min(v, self.best.get(k, v)) for k, v in got.items()}

    def figures(self, sim_cpu: float) -> dict[str, float]:
        b = self.best
        return {
            "us_per_sample": round(b["full"], 1),
            "wall_us_per_sample": round(b["wall"], 1),
            "async_us_per_sample": round(b["async"], 1),
            "inline_us_per_sample": round(b["inline"], 1),
            "wrapper_us_per_sample": round(b["inline"] - sim_cpu, 1),
            "sim_share": round(sim_cpu / b["full"], 3),
            "thread_hop_share": round(max(0.0, b["full"] - b["inline"]) / b["full"], 3),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2_000, help="samples per figure and pass (default 2000)")
    parser.add_argument("--repeats", type=int, default=5, help="timed passes, the best counts (default 5)")
    parser.add_argument("--baseline", type=Path, help="another mapper/edge/gpu/nvml.py to compare against")
    parser.add_argument(
        "--sim-cost",
        choices=["none", "h200"],
        default="none",
        help="the simulated NVML's cost profile (none: the backend's own Python beside the bare simulator)",
    )
    args = parser.parse_args()
    rounds = max(1, args.samples // GPUS)

    clock = FakeClock()
    sim = SimNvml(GPUS, "H100", seed=0, clock=clock.monotonic, scenario="training", cost=args.sim_cost)
    recorder = Recorder(sim)
    backend = nvml.NvmlBackend(recorder, clock=clock)
    uuids = [g.uuid for g in backend.list_gpus()]
    for uuid in uuids:  # warm up: handles, NotSupported cache, event registration
        backend.sample(uuid)

    # the NVML calls of one full sample, to replay on the simulator alone
    recorder.recording = []
    backend.sample(uuids[0])
    calls = recorder.recording
    recorder.recording = None
    per_gpu = {u: [(name, (backend._handles[u], *a[1:]) if a else a, kw) for name, a, kw in calls] for u in uuids}
    bound = {u: [(getattr(sim, name), a, kw) for name, a, kw in per_gpu[u]] for u in uuids}

    def raw(uuid: str) -> None:
        for fn, a, kw in bound[uuid]:
            fn(*a, **kw)

    ours = Subject(nvml, sim, clock, uuids)
    theirs = Subject(load_module(args.baseline), sim, clock, uuids) if args.baseline else None
    same_values = None
    if theirs is not None:  # same simulator, same instant: the same values
        same_values = all(ours.backend.sample(u).values == theirs.backend.sample(u).values for u in uuids)
    measure(max(1, rounds // 10), clock, uuids, ours.backend.sample)  # warm-up
    sim_cpu = float("inf")
    for _ in range(args.repeats):  # short passes, taken in turns: a noisy neighbour hurts all alike
        ours.run(rounds, clock, uuids)
        sim_cpu = min(sim_cpu, measure(rounds, clock, uuids, raw)[0])
        if theirs is not None:
            theirs.run(rounds, clock, uuids)
    ours.backend.shutdown()
    backend.shutdown()

    result: dict[str, Any] = {
        "benchmark": "sample",
        "sim_cost": args.sim_cost,
        "gpus": GPUS,
        "samples": rounds * GPUS,
        "repeats": args.repeats,
        "nvml_calls_per_sample": len(calls),
        "sim_us_per_sample": round(sim_cpu, 1),
    }
    result.update(ours.figures(sim_cpu))
    if theirs is not None:
        theirs.backend.shutdown()
        base = theirs.figures(sim_cpu)
        result["same_values"] = same_values
        result["baseline"] = base
        result["speedup"] = {
            k: round(base[k] / result[k], 2)
            for k in ("us_per_sample", "async_us_per_sample", "inline_us_per_sample", "wrapper_us_per_sample")
        }
    result["python"] = platform.python_version()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
