"""Health: time from a fault to the unhealthy state in the GPU's twins, and from there to healthy again.

Setup: one simulated H100 (``mapper.edge.gpu.simnvml``) on the wall clock, the mapper's own collector
(``mapper.edge.control.collect.Collector``: samples on 1 s cycles, NVML events polled every second) and health loop
(``mapper.edge.control.healthloop.HealthMonitor``: probe every 10 min, checks every 60 s, recovery flow) in one asyncio
loop, as ``gpu-mapper run`` wires them. "In the twins" means the ``health`` twin text of the bound Device
(``mapper.edge.kubeedge.report.device_twins``) has changed: what the next report carries.

Scenarios:

* ``xid79``: the GPU falls off the bus (``inject_gpu_lost``: GpuIsLost on every call, an XID 79 event). Its way
  back is a reboot: 2 s later the node "reboots" (``driver_reload(recover_lost=True)``); recovery is timed from
  the reboot (the backend probes a lost GPU again every ``lost_retry_s``, 2 s here).
* ``ecc_storm``: 20 uncorrected ECC errors at once (the volatile counter and 20 double-bit events). Way back: a
  reset; with ``recovery.allowReset`` the recovery flow resets the GPU (no process runs) and probes again.
* ``ecc_storm_no_reset`` (the baseline, as peers behave): the same storm without permission to reset: the GPU
  stays unhealthy (``recovered_s`` null after the 10 s window).
* ``probe_fail``: the CUDA probe starts failing (cuCtxCreate) until a reset; the probe is run at once (as after an
  XID): unhealthy within that one probe; the recovery flow resets the GPU and the probe passes again.

``unhealthy_s``: from the fault to the step that made the twin unhealthy; ``recovered_s``: from that step (for XID
79: from the reboot) to a healthy twin seen (polled every 5 ms). The last line printed is one JSON object with
every figure. Run: ``.venv/bin/python benchmarks/health.py [--window-s 10] [--smoke]`` (``--smoke``: 3 s windows).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mapper.clock import SystemClock
from mapper.edge.control.collect import Collector, GpuWorker
from mapper.edge.control.healthloop import HealthMonitor
from mapper.edge.control.policy import PolicyEngine, parse_policies
from mapper.edge.control.reconcile import Reconciler
from mapper.edge.gpu.nvml import NvmlBackend
from mapper.edge.gpu.simnvml import SimNvml, sim_health_tools
from mapper.edge.kubeedge.report import device_twins
from mapper.shared.model import DeviceConfig, DeviceProperty

WINDOW_S = 10.0
#: The simulated NVML's cost profile: what each call costs on an H200 (``mapper.edge.gpu.profiles``).
SIM_COST = "h200"


def health_twin(worker: GpuWorker) -> str:
    return next((t.reported for t in device_twins(worker, ["health"])), "")


async def wait_for(predicate: Callable[[], bool], timeout_s: float) -> float | None:
    started = time.perf_counter()
    while time.perf_counter() - started < timeout_s:
        if predicate():
            return time.perf_counter() - started
        await asyncio.sleep(0.005)
    return None


async def scenario(name: str, folder: Path, window_s: float = WINDOW_S) -> dict[str, Any]:
    clock = SystemClock()
    sim = SimNvml(1, "H100", seed=0, clock=clock.monotonic, cost=SIM_COST)
    backend = NvmlBackend(sim, clock=clock, lost_retry_s=2.0)
    info = backend.list_gpus()[0]
    allow = name != "ecc_storm_no_reset"
    policies = PolicyEngine(parse_policies({"health": {"recovery": {"allowReset": allow}}}))
    worker = GpuWorker(info, backend, Reconciler(backend, info.uuid, clock=clock), policies, clock)
    worker.bind(DeviceConfig("default", "gpu-0", "gpu-model", info.uuid, properties=(DeviceProperty("temperature"),)))
    collector = Collector({info.uuid: worker}, backend, clock=clock)
    worker.notify = collector.wake.set
    monitor = HealthMonitor(
        {info.uuid: worker},
        policies,
        backend,
        sim_health_tools(sim, folder / name),
        clock=clock,
        processes=lambda uuid: len(backend.processes(uuid).processes),
    )
    tasks = [asyncio.create_task(collector.run()), asyncio.create_task(monitor.run())]
    try:
        ready = await wait_for(lambda: worker.stepped and worker.last_probe is not None, 10.0)
        assert ready is not None, "the mapper did not settle"
        assert health_twin(worker) == "healthy", health_twin(worker)
        sim.set_scenario_processes(None, False)  # no process on the GPU: a reset is allowed
        # The moment a step makes the twin unhealthy (a recovery may clear it again before a poll would see it).
        first_unhealthy: list[tuple[float, str]] = []
        wake = monitor.wake.set

        def on_fault() -> None:
            twin = health_twin(worker)
            if not first_unhealthy and twin != "healthy":
                first_unhealthy.append((time.perf_counter(), twin))
            wake()

        worker.on_fault = on_fault
        started = time.perf_counter()
        if name == "xid79":
            sim.inject_gpu_lost(info.uuid)
        elif name.startswith("ecc_storm"):
            sim.inject_ecc(info.uuid, uncorrected=20)
        else:
            sim.inject_probe_fault(info.uuid, "context", until_reset=True)
            monitor._gpu(info.uuid).next_probe_s = 0.0  # the probe runs now (as soon after an XID)
            monitor.wake.set()
        polled = await wait_for(lambda: bool(first_unhealthy) or health_twin(worker) != "healthy", window_s)
        seen = first_unhealthy[0][1] if first_unhealthy else health_twin(worker)
        unhealthy_s = first_unhealthy[0][0] - started if first_unhealthy else polled
        # Recovery is timed from the moment the twin went unhealthy (for XID 79: from the reboot).
        recovered_from = first_unhealthy[0][0] if first_unhealthy else time.perf_counter()
        if name == "xid79":
            await asyncio.sleep(2.0)
            recovered_from = time.perf_counter()
            sim.driver_reload(recover_lost=True)
        back = await wait_for(lambda: health_twin(worker) == "healthy", window_s)
        recovered_s = None if back is None else time.perf_counter() - recovered_from
        return {
            "unhealthy_s": None if unhealthy_s is None else round(unhealthy_s, 3),
            "twin": seen,
            "recovered_s": None if recovered_s is None else round(recovered_s, 3),
            "resets": sim.gpu(info.uuid).resets,
            "since_fault_s": round(time.perf_counter() - started, 3),
        }
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        backend.shutdown()


async def main_async(window_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="health-bench-") as tmp:
        folder = Path(tmp)
        names = ("xid79", "ecc_storm", "ecc_storm_no_reset", "probe_fail")
        return {name: await scenario(name, folder, window_s) for name in names}


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--window-s", type=float, default=WINDOW_S, help="how long each wait lasts at most (10)")
    parser.add_argument("--smoke", action="store_true", help="3 s windows (the benchmark smoke test)")
    args = parser.parse_args()
    if args.smoke:
        args.window_s = 3.0
    started = time.perf_counter()
    results = asyncio.run(main_async(args.window_s))
    for name, figures in results.items():
        print(f"{name:>18}: " + ", ".join(f"{k}={v}" for k, v in figures.items()), file=sys.stderr)
    print(
        json.dumps(
            {
                "benchmark": "health",
                "gpu": "H100",
                "sim_cost": SIM_COST,
                "window_s": args.window_s,
                "results": results,
                "wall_s": round(time.perf_counter() - started, 2),
            },
            sort_keys=True,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
