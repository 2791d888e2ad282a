"""The real mapper (``mapper.cli.main``) in this process, over a simulated NVML that the test faults through
this process's stdin. Run as ``python -m tests.faults.child SIM_COUNT SEED [--not-ready] -- <gpu-mapper args>``.

Only the NVML module is swapped (``mapper.edge.app.build_backend``: the one place that chooses it); the CLI, its
signal handling, the app and every adapter are the production code. Control lines on stdin are JSON:
``{"op": "lose", "gpu": 3}`` (XID 79, the GPU falls off the bus), ``{"op": "reload"}`` (driver reload: every
setting back to default; with ``"recover": true`` lost GPUs come back too, as after a reboot),
``{"op": "delay", "s": 3.0}`` (every NVML call takes that long; 0 ends it), ``{"op": "state"}`` (one JSON
line on stdout: each GPU's uuid, power limit and lost flag)."""

from __future__ import annotations

import json
import sys
import threading
from typing import Any

import mapper.edge.app
from mapper.cli import main
from mapper.edge.gpu.nvml import NvmlBackend
from mapper.edge.gpu.simnvml import SimNvml

_DRIVER_NOT_LOADED = 9


def _control(sim: SimNvml) -> None:
    for line in sys.stdin:
        cmd: dict[str, Any] = json.loads(line)
        op = cmd["op"]
        if op == "lose":
            sim.inject_gpu_lost(sim.gpus[int(cmd["gpu"])].uuid)
        elif op == "reload":
            sim.driver_reload(recover_lost=bool(cmd.get("recover", False)))
        elif op == "delay":
            sim.set_call_delay_s(float(cmd["s"]))
        elif op == "state":
            state = [{"uuid": g.uuid, "power_limit_w": g.power_limit_w, "lost": g.lost} for g in sim.gpus]
            sys.stdout.write(json.dumps(state) + "\n")
            sys.stdout.flush()


def run(argv: list[str]) -> int:
    split = argv.index("--")
    own, cli_args = argv[:split], argv[split + 1 :]
    count, seed = int(own[0]), int(own[1])
    sim = SimNvml(count, "H100", seed=seed, scenario="steady")
    sim.set_as_root(True)
    if "--not-ready" in own:
        sim.inject_errors("nvmlInitWithFlags", _DRIVER_NOT_LOADED, count=10**9)

    def build_backend(settings: Any, clock: Any = None) -> NvmlBackend:
        return NvmlBackend(sim, clock=clock)

    mapper.edge.app.build_backend = build_backend  # type: ignore[assignment]
    threading.Thread(target=_control, args=(sim,), name="fault-control", daemon=True).start()
    return main(cli_args)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
