"""Cost of one ``PolicyEngine.decide`` call, this checkout's ``mapper/edge/control/policy.py`` against a baseline
revision of the same file, in the same process on the same inputs.

Set-up: 8 simulated H100s (``mapper.edge.gpu.simnvml``, seed 0) on a fake clock; every catalog value sampled through
``NvmlBackend.sample`` once per simulated second for ``--seconds`` seconds, the samples recorded first. Then each
engine (default ``PolicyConfig``) replays them as the mapper's ``GpuWorker.tick`` does: one ``decide`` per GPU per
second with a ``PolicyContext`` of the GPU's constraints, no events, the cloud's desired limit unset and the UUID
set. The engines run alternately, ``--repeats`` times each, on fresh state; the figure per engine is the fastest
repeat's mean per call (the machine is shared: the minimum is the least disturbed).

Scenarios: ``inference`` (the usual, boring call: cool, no event, no action, which the overhead benchmark runs)
and ``heat`` (the GPUs cross maxTemp; the recorded samples never see the caps, so the policy keeps stepping down
once per interval: the full decision every call after the crossing, to show it does not get slower). Every
decision of the two engines is compared (by ``repr``, as their classes differ); any mismatch is counted and
reported.

The baseline is the policy module of ``--baseline`` (a revision, default the commit before the fast path, or a
file), loaded with importlib under another module name; a revision from before the package layout change has it
in ``mapper/policy.py``, its imports pointed at where those modules are now. ``--smoke``: 20 s, one repeat, this
checkout's own file as the baseline (no history needed).

Run: ``.venv/bin/python benchmarks/policy_decide.py [--seconds 300] [--repeats 5] [--baseline REV|FILE] [--smoke]``
(about 10 s). Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mapper.clock import FakeClock  # noqa: E402
from mapper.edge.control import policy as current  # noqa: E402
from mapper.edge.gpu.nvml import NvmlBackend  # noqa: E402
from mapper.edge.gpu.simnvml import SimNvml  # noqa: E402
from mapper.shared.model import Value  # noqa: E402

GPUS = 8
#: The last commit before the steady fast path in ``decide``.
BASELINE_REV = "2969cf9"

Ticks = list[tuple[float, list[tuple[str, dict[str, Value], Any]]]]


#: Where the modules the policy imports were before the package layout changed (issue 26).
_OLD_MODULES = {"mapper.config": "mapper.edge.config", "mapper.model": "mapper.shared.model"}


def baseline_text(rev: str) -> str:
    """The policy module of ``rev``, or of the file ``rev`` names. A revision from before the layout change keeps
    it in ``mapper/policy.py``; its imports are pointed at where those modules are now."""
    if Path(rev).is_file():
        return Path(rev).read_text()
    for path in ("mapper/edge/control/policy.py", "mapper/policy.py"):
        shown = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True)
        if shown.returncode == 0:
            text = shown.stdout
            for old, new in _OLD_MODULES.items():
                text = text.replace(f"from {old} import", f"from {new} import")
            return text
    raise SystemExit(f"no policy module at {rev!r} (neither a file nor a revision this clone holds)")


def load_baseline(rev: str, folder: Path) -> ModuleType:
    path = folder / "policy_baseline.py"
    path.write_text(baseline_text(rev))
    spec = importlib.util.spec_from_file_location("policy_baseline", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def record(scenario: str, seconds: int) -> tuple[list[tuple[float, list[tuple[str, dict[str, Value]]]]], dict]:
    """The samples of every GPU each second, and each GPU's constraints."""
    clock = FakeClock()
    sim = SimNvml(GPUS, "H100", clock=clock.monotonic, scenario=scenario, seed=0)
    backend = NvmlBackend(sim, clock=clock)
    backend.init()
    try:
        uuids = [g.uuid for g in backend.list_gpus()]
        constraints = {u: backend.constraints(u) for u in uuids}
        ticks = []
        for _ in range(seconds):
            clock.advance(1.0)
            ticks.append((clock.monotonic(), [(u, dict(backend.sample(u).values)) for u in uuids]))
    finally:
        backend.shutdown()
    return ticks, constraints


def contexts(module: ModuleType, ticks: list, constraints: dict) -> Ticks:
    """The ticks with one ``PolicyContext`` of ``module`` per GPU (built beforehand: the mapper builds its own)."""
    ctx = {u: module.PolicyContext(constraints=c, uuid=u) for u, c in constraints.items()}
    return [(now_s, [(u, values, ctx[u]) for u, values in gpus]) for now_s, gpus in ticks]


def replay(module: ModuleType, ticks: Ticks) -> tuple[float, list[Any]]:
    """Seconds per call, and every decision."""
    engine = module.PolicyEngine()
    decide = engine.decide
    decisions = []
    calls = 0
    start = time.perf_counter()
    for now_s, gpus in ticks:
        for uuid, values, ctx in gpus:
            decisions.append(decide(uuid, values, ctx, now_s))
        calls += len(gpus)
    return (time.perf_counter() - start) / calls, decisions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--baseline", default=BASELINE_REV, help="a revision or a file (default %(default)s)")
    ap.add_argument("--smoke", action="store_true", help="20 s, one repeat, against this checkout's own file")
    args = ap.parse_args()
    if args.smoke:
        args.seconds, args.repeats, args.baseline = 20, 1, str(ROOT / "mapper/edge/control/policy.py")
    with tempfile.TemporaryDirectory() as tmp:
        baseline = load_baseline(args.baseline, Path(tmp))
        result: dict[str, Any] = {"baseline": args.baseline, "gpus": GPUS, "seconds": args.seconds, "sim_cost": "none"}
        for scenario in ("inference", "heat"):
            ticks, constraints = record(scenario, args.seconds)
            inputs = {
                "baseline": contexts(baseline, ticks, constraints),
                "current": contexts(current, ticks, constraints),
            }
            best = {"baseline": float("inf"), "current": float("inf")}
            decisions: dict[str, list[Any]] = {}
            for _ in range(args.repeats):
                for name, module in (("baseline", baseline), ("current", current)):
                    per_call_s, decisions[name] = replay(module, inputs[name])
                    best[name] = min(best[name], per_call_s)
            mismatches = sum(
                repr(a) != repr(b) for a, b in zip(decisions["baseline"], decisions["current"], strict=True)
            )
            states = sorted({d.policy_state for d in decisions["current"]})
            b_us, c_us = best["baseline"] * 1e6, best["current"] * 1e6
            print(
                f"{scenario:9s} baseline {b_us:6.2f} us/call  current {c_us:6.2f} us/call  "
                f"speedup x{b_us / c_us:.1f}  mismatches {mismatches}  policy states {states}"
            )
            result[scenario] = {
                "baseline_us_per_call": round(b_us, 3),
                "current_us_per_call": round(c_us, 3),
                "speedup": round(b_us / c_us, 2),
                "calls": len(decisions["current"]),
                "mismatches": mismatches,
                "policy_states": states,
            }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
