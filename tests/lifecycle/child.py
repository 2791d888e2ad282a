"""``gpu-mapper run --sim N ...`` in this process, with a control channel to the simulator that the production
``--sim`` path built. Run as ``python -m tests.lifecycle.child STATE_FILE -- run --sim N ...``.

Nothing of the mapper is replaced: ``mapper.edge.app.build_backend`` is wrapped only to keep a reference to the
backend it returns (and, for a simulated Jetson, to carry its settings across restarts, below). The CLI, its signal
handling, the app and every adapter are the production code.

The simulated GPUs live in this process, so a mapper restart would also be a GPU reboot. A real GPU keeps its
settings when the mapper restarts, and the harness checks that bad input never changes one, across restarts too.
So the simulated GPUs' settings (power limit, locked clocks, the two modes, lost) are written to ``STATE_FILE``
after every setter call and every injected fault, and read back into the new simulator at start; a simulated
Jetson's settings are its sysfs files (kept outside the data dir: ``<data dir>/sim-jetson`` is a link the
harness makes), read before the tree is built again and written back after.

Control lines on stdin are JSON: ``{"op": "lose", "gpu": 1}`` (XID 79: the GPU falls off the bus),
``{"op": "reload", "recover": true}`` (driver reload: every setting back to default; ``recover`` brings lost
GPUs back), ``{"op": "state"}`` (one JSON line on stdout: the settings of every GPU)."""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

import mapper.edge.app
from mapper.cli import main

_SETTERS = (
    "nvmlDeviceSetPowerManagementLimit",
    "nvmlDeviceSetPowerManagementLimit_v2",
    "nvmlDeviceSetGpuLockedClocks",
    "nvmlDeviceResetGpuLockedClocks",
    "nvmlDeviceSetMemoryLockedClocks",
    "nvmlDeviceResetMemoryLockedClocks",
    "nvmlDeviceSetPersistenceMode",
    "nvmlDeviceSetComputeMode",
)


def nvml_state(sim: Any) -> list[dict[str, Any]]:
    return [
        {
            "uuid": g.uuid,
            "power_limit_mw": g.power_limit_mw,
            "locked_gpu_clocks": list(g.locked_gpu_clocks) if g.locked_gpu_clocks else None,
            "persistence_mode": g.persistence_mode,
            "compute_mode": g.compute_mode,
            "lost": g.lost,
        }
        for g in sim.gpus
    ]


class NvmlKeeper:
    """Keeps a simulated NVML's settings in a file across processes."""

    def __init__(self, sim: Any, path: Path) -> None:
        self.sim = sim
        self.path = path
        self.lock = threading.Lock()

    def restore(self) -> None:
        try:
            saved = {g["uuid"]: g for g in json.loads(self.path.read_text())}
        except (OSError, ValueError):
            return
        for gpu in self.sim.gpus:
            s = saved.get(gpu.uuid)
            if s is None:
                continue
            gpu.power_limit_mw = int(s["power_limit_mw"])
            gpu.locked_gpu_clocks = tuple(s["locked_gpu_clocks"]) if s["locked_gpu_clocks"] else None
            gpu.persistence_mode = int(s["persistence_mode"])
            gpu.compute_mode = int(s["compute_mode"])
            if s["lost"]:
                self.sim.inject_gpu_lost(gpu.uuid)

    def save(self) -> None:
        with self.lock:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(nvml_state(self.sim)))
            os.replace(tmp, self.path)

    def wrap_setters(self) -> None:
        for name in _SETTERS:
            original = getattr(self.sim, name, None)
            if original is None:
                continue

            def wrapper(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                try:
                    return _original(*args, **kwargs)
                finally:
                    self.save()

            setattr(self.sim, name, wrapper)


def _jetson_files(tree: Path) -> list[Path]:
    devfreq = [d for d in sorted((tree / "sys/class/devfreq").glob("*")) if (d / "available_frequencies").exists()]
    out = [tree / "var/lib/nvpmodel/status"]
    for d in devfreq:
        out += [d / "min_freq", d / "max_freq"]
    return out


def run(argv: list[str]) -> int:
    split = argv.index("--")
    own, cli_args = argv[:split], argv[split + 1 :]
    state_path = Path(own[0])
    original = mapper.edge.app.build_backend
    kept: dict[str, Any] = {}

    def build_backend(settings: Any, clock: Any = None, *, one_shot: bool = False) -> Any:
        tree = Path(settings.data_dir) / "sim-jetson"
        saved: dict[Path, str] = {}
        if tree.exists():
            for f in _jetson_files(tree):
                try:
                    saved[f] = f.read_text()
                except OSError:
                    pass
        backend = original(settings, clock, one_shot=one_shot)
        sim = getattr(backend, "nvml", None)
        if sim is not None and hasattr(sim, "inject_gpu_lost"):
            keeper = NvmlKeeper(sim, state_path)
            keeper.restore()
            keeper.wrap_setters()
            keeper.save()
            kept["keeper"] = keeper
        for f, text in saved.items():  # a Jetson's settings as the last run left them
            try:
                f.write_text(text)
            except OSError:
                pass
        kept["backend"] = backend
        return backend

    mapper.edge.app.build_backend = build_backend  # type: ignore[assignment]
    threading.Thread(target=_control, args=(kept,), name="lifecycle-control", daemon=True).start()
    return main(cli_args)


def _control(kept: dict[str, Any]) -> None:
    for line in sys.stdin:
        cmd: dict[str, Any] = json.loads(line)
        keeper: NvmlKeeper | None = kept.get("keeper")
        op = cmd["op"]
        if keeper is None:
            out: Any = {"error": "no simulated NVML"}
        elif op == "lose":
            keeper.sim.inject_gpu_lost(keeper.sim.gpus[int(cmd["gpu"])].uuid)
            keeper.save()
            out = {"ok": True}
        elif op == "reload":
            keeper.sim.driver_reload(recover_lost=bool(cmd.get("recover", False)))
            keeper.save()
            out = {"ok": True}
        elif op == "state":
            out = nvml_state(keeper.sim)
        else:
            out = {"error": f"unknown op {op}"}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
