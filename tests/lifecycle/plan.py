"""What a lifecycle sequence is: its world (``SeqConfig``, drawn from the seed) and its steps (``Step``, drawn by
``generate`` from the seed and a shadow of the world's state, so that most steps make sense where they fall).

A step names everything it acts on (a Device by name, a GPU by index, a value as the operator typed it), so a
step list can be cut down (shrinking) and still run: a step whose precondition no longer holds is skipped.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

NAMES = ("gpu-a", "gpu-b", "infer", "train", "spare")


@dataclass(frozen=True)
class SeqConfig:
    seed: int
    #: "nvml": two simulated H100s; "jetson": one simulated AGX Orin (``--sim 1 --sim-profile orin-agx``).
    kind: str
    #: "edgecore": the test EdgeCore over DMI sockets; "folder": a devices folder (standalone mode, EventBus twins).
    source: str
    bridges: int
    #: Folder layout: every Device in one file (True) or a file per Device.
    one_file: bool

    @property
    def gpus(self) -> int:
        return 1 if self.kind == "jetson" else 2

    def __str__(self) -> str:
        layout = (", one file" if self.one_file else ", a file per Device") if self.source == "folder" else ""
        return f"seed {self.seed}: {self.kind}, {self.source}{layout}, {self.bridges} bridge(s)"


def config_for(seed: int) -> SeqConfig:
    rng = random.Random(f"config-{seed}")
    kind = "jetson" if rng.random() < 1 / 6 else "nvml"
    source = rng.choice(("edgecore", "folder"))
    return SeqConfig(
        seed=seed,
        kind=kind,
        source=source,
        bridges=rng.choice((1, 2)),
        one_file=source == "folder" and rng.random() < 0.4,
    )


@dataclass(frozen=True)
class Step:
    kind: str
    args: tuple[Any, ...] = ()

    def __str__(self) -> str:
        return f"{self.kind}({', '.join(repr(a) for a in self.args)})"


#: Values an operator means (valid for the knob) and typos (each refused by the mapper's validation), by GPU kind.
VALID = {
    "nvml": ("250", "300", "350", "400", "450", "500", "600"),
    "jetson": ("408", "510", "612", "714", "816", "1020"),
}
TYPOS = {
    "nvml": ("abc", "9999", "-5", "nan", "3OO"),
    "jetson": ("abc", "1", "-5", "nan", "3OO"),
}


class _Shadow:
    """What the generator believes about the world (enough to draw sensible steps)."""

    def __init__(self, cfg: SeqConfig) -> None:
        self.cfg = cfg
        self.devices: dict[str, int] = {}
        self.broken: set[str] = set()
        self.broker_up = True
        self.disk_full = False
        self.lost: set[int] = set()

    def free_gpus(self) -> list[int]:
        return [g for g in range(self.cfg.gpus) if g not in self.devices.values()]

    def free_names(self) -> list[str]:
        return [n for n in NAMES if n not in self.devices]


def generate(cfg: SeqConfig, n: int) -> list[Step]:
    """``n`` steps for ``cfg``, drawn from its seed."""
    rng = random.Random(f"steps-{cfg.seed}")
    sh = _Shadow(cfg)
    steps: list[Step] = []
    nvml = cfg.kind == "nvml"
    valid, typos = VALID[cfg.kind], TYPOS[cfg.kind]
    while len(steps) < n:
        names = sorted(sh.devices)
        weights: dict[str, float] = {}
        if sh.free_gpus() and sh.free_names():
            weights["add"] = 8.0 if not sh.devices else 3.0
        if names:
            weights.update(remove=2.0, readd=2.0, set=4.0, unset=1.0, typo_value=2.0, typo_file=2.0, remove_all=0.4)
            if sh.free_names():
                weights["rename"] = 1.5
        if sh.broken:
            weights["fix_file"] = 2.0
        weights["broker_stop" if sh.broker_up else "broker_start"] = 1.0 if sh.broker_up else 3.0
        weights.update(bridge_restart=1.0, bridge_kill=1.0, mapper_term=1.0, mapper_kill=1.0, driver_reload=0.7)
        alive = [g for g in range(cfg.gpus) if g not in sh.lost]
        if nvml and alive:
            weights["gpu_lose"] = 0.7
        if nvml and sh.lost:
            weights["gpu_found"] = 2.0
        weights["disk_free" if sh.disk_full else "disk_fill"] = 2.0 if sh.disk_full else 0.7
        weights.update(wait=1.5, bad_data_dir=0.3, foreign_file=0.3)
        kind = rng.choices(list(weights), weights=list(weights.values()))[0]
        args: tuple[Any, ...] = ()
        if kind == "add":
            args = (rng.choice(sh.free_names()), rng.choice(sh.free_gpus()), rng.choice((*valid, None)))
        elif kind in ("remove", "readd", "unset", "typo_file"):
            args = (rng.choice(names),)
        elif kind == "rename":
            args = (rng.choice(names), rng.choice(sh.free_names()))
        elif kind == "set":
            args = (rng.choice(names), rng.choice(valid))
        elif kind == "typo_value":
            args = (rng.choice(names), rng.choice(typos))
        elif kind == "fix_file":
            args = (rng.choice(sorted(sh.broken)),)
        elif kind in ("bridge_restart", "bridge_kill"):
            args = (rng.randrange(cfg.bridges),)
        elif kind == "gpu_lose":
            args = (rng.choice(alive),)
        elif kind == "wait":
            args = (rng.choice((0.5, 1.0, 2.0, 3.0)),)
        step = Step(kind, args)
        steps.append(step)
        _advance(sh, step)
    return steps


def _advance(sh: _Shadow, step: Step) -> None:
    k, a = step.kind, step.args
    if k == "add":
        sh.devices[a[0]] = a[1]
        sh.broken.discard(a[0])
    elif k == "remove":
        sh.devices.pop(a[0], None)
        sh.broken.discard(a[0])
    elif k == "rename":
        if a[0] in sh.devices:
            sh.devices[a[1]] = sh.devices.pop(a[0])
            sh.broken.discard(a[0])
    elif k in ("set", "unset", "typo_value", "fix_file", "readd"):
        sh.broken.discard(a[0])
        if sh.cfg.one_file and k != "readd":
            sh.broken.clear()
    elif k == "typo_file":
        sh.broken.update(sh.devices if sh.cfg.one_file else (a[0],))
    elif k == "remove_all":
        sh.devices.clear()
        sh.broken.clear()
    elif k == "broker_stop":
        sh.broker_up = False
    elif k == "broker_start":
        sh.broker_up = True
    elif k == "disk_fill":
        sh.disk_full = True
    elif k == "disk_free":
        sh.disk_full = False
    elif k == "gpu_lose":
        sh.lost.add(a[0])
    elif k == "gpu_found":
        sh.lost.clear()
