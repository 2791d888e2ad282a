"""Cost of the process cycle per GPU per second: process sampling (NvmlBackend.processes over the simulated NVML),
process -> container -> pod over a proc tree and pod files on disk (PodResolver.owners), and energy attribution
with the leak detector (ProcessMonitor.observe), with ``--processes`` (default 50) processes per GPU, each in
its own pod.

The baseline in the same run is one ordinary collect sample of the same GPU (``NvmlBackend.sample`` of every
catalog property), the work the mapper already does each second. The process cycle runs every 5 s by default,
so its cost per GPU per second is the cycle's cost / 5.

Run: ``.venv/bin/python benchmarks/processes.py [--gpus N] [--processes P] [--cycles C] [--interval-s S]``.
Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import tempfile
import time
from pathlib import Path

from mapper.clock import FakeClock
from mapper.edge.gpu.nvml import NvmlBackend
from mapper.edge.gpu.simnvml import SimNvml
from mapper.edge.processes.leak import LeakConfig
from mapper.edge.processes.monitor import ProcessMonitor
from mapper.edge.processes.workloads import PodDirs, PodResolver

GIB = 1 << 30


def _tree(root: Path, sim: SimNvml, per_gpu: int) -> tuple[Path, PodDirs]:
    proc = root / "proc"
    dirs = PodDirs.under(str(root / "host"))
    links = Path(dirs.log_containers)
    links.mkdir(parents=True)
    n = 0
    for gpu in sim.gpus:
        sim.set_scenario_processes(gpu.uuid, False)
        for slot in range(per_gpu):
            n += 1
            pid = 10_000 + n
            uid = f"{n:08x}-0000-4000-8000-{n:012x}"
            cid = f"{n:064x}"
            sim.start_process(gpu.uuid, pid, (1 + slot % 4) * GIB // 4, weight=1.0 + slot % 3)
            d = proc / str(pid)
            d.mkdir(parents=True)
            (d / "cgroup").write_text(
                f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid.replace('-', '_')}.slice/"
                f"cri-containerd-{cid}.scope\n"
            )
            (d / "comm").write_text("python3\n")
            (links / f"job-{n}_bench_main-{cid}.log").write_text("")
    return proc, dirs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--processes", type=int, default=50)
    ap.add_argument("--cycles", type=int, default=200)
    ap.add_argument("--interval-s", type=float, default=5.0)
    ap.add_argument(
        "--sim-cost", choices=["h200", "none"], default="h200", help="the simulated NVML's cost profile (h200)"
    )
    ap.add_argument(
        "--warm-cycles",
        type=int,
        default=None,
        help="untimed cycles first (default: enough to fill the leak detector's window, its steady state)",
    )
    args = ap.parse_args()
    warm_cycles = args.warm_cycles
    if warm_cycles is None:
        warm_cycles = math.ceil(LeakConfig().window_s / args.interval_s) + 1
    clock = FakeClock()
    sim = SimNvml(args.gpus, "H100", clock=clock.monotonic, scenario="steady", cost=args.sim_cost)
    backend = NvmlBackend(sim, clock=clock)
    with tempfile.TemporaryDirectory() as tmp:
        proc, dirs = _tree(Path(tmp), sim, args.processes)
        resolver = PodResolver(dirs)
        monitor = ProcessMonitor()
        uuids = [g.uuid for g in sim.gpus]
        for uuid in uuids:  # warm: handles, the resolver's first scan
            backend.sample(uuid)
        for _ in range(warm_cycles):  # and the leak detector's window filled (its cost grows until it is)
            clock.advance(args.interval_s)
            for uuid in uuids:
                s = backend.processes(uuid)
                monitor.observe(s, resolver.owners(str(proc), [p.pid for p in s.processes], uuid), clock.monotonic())
        t_sample = t_owners = t_observe = t_base = 0.0
        for _ in range(args.cycles):
            clock.advance(args.interval_s)
            for uuid in uuids:
                t0 = time.process_time()
                s = backend.processes(uuid)
                t1 = time.process_time()
                owners = resolver.owners(str(proc), [p.pid for p in s.processes], uuid)
                t2 = time.process_time()
                monitor.observe(s, owners, clock.monotonic())
                t3 = time.process_time()
                backend.sample(uuid)
                t4 = time.process_time()
                t_sample += t1 - t0
                t_owners += t2 - t1
                t_observe += t3 - t2
                t_base += t4 - t3
        backend.shutdown()
    per = args.cycles * len(uuids)
    cycle_ms = (t_sample + t_owners + t_observe) / per * 1000
    result = {
        "benchmark": "processes",
        "sim_cost": args.sim_cost,
        "gpus": args.gpus,
        "processes_per_gpu": args.processes,
        "cycles": args.cycles,
        "warm_cycles": warm_cycles,
        "interval_s": args.interval_s,
        "cycle_ms_per_gpu": round(cycle_ms, 3),
        "sample_ms": round(t_sample / per * 1000, 3),
        "owners_ms": round(t_owners / per * 1000, 3),
        "attribution_ms": round(t_observe / per * 1000, 3),
        "cpu_ms_per_gpu_per_s": round(cycle_ms / args.interval_s, 3),
        "baseline_collect_sample_ms": round(t_base / per * 1000, 3),
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, Python {platform.python_version()}",
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
