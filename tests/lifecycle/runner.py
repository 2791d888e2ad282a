"""Many lifecycle sequences, a few at a time, and the shortest step list that still shows each violation.

``run_many`` runs the seeds on ``workers`` threads (each sequence its own world; one Prometheus for all), and for
each kind of violation found (the first sequence that shows it) cuts its steps down with delta debugging
(``shrink``: drop chunks of steps, keep a cut that still ends in a violation of the same invariant), within a
time budget. ``Summary.report()`` says what ran and prints, per violation, the seed, the world and the shortest
sequence, so a failure can be run again: ``GPU_MAPPER_LIFECYCLE_SEEDS=<seed>``.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import math
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.lifecycle.harness import BAD_INPUT_STEPS, Outcome, Run
from tests.lifecycle.plan import SeqConfig, Step, config_for, generate
from tests.lifecycle.world import rmtree
from tests.promserver import Prometheus

_tags = itertools.count()
_tag_lock = threading.Lock()


def _tag() -> str:
    with _tag_lock:
        return str(next(_tags))


def run_steps(cfg: SeqConfig, steps: list[Step], prom: Prometheus, base: Path, keep: bool = False) -> Outcome:
    out = Run(cfg, steps, prom, base, _tag()).execute()
    if out.violation is None and not keep:
        rmtree(out.workdir)
    return out


@dataclass
class Shrunk:
    outcome: Outcome
    steps: list[Step]
    runs: int
    complete: bool


def shrink(first: Outcome, prom: Prometheus, base: Path, budget_s: float) -> Shrunk:
    """Delta debugging over the steps up to the failing one: the shortest list found within ``budget_s`` that
    still ends in a violation of the same invariant."""
    assert first.violation is not None
    invariant = first.violation.invariant
    current = first.steps[: first.violation.step + 1]
    best = first
    deadline = time.monotonic() + budget_s
    runs = 0
    n = 2
    while len(current) >= 2:
        if time.monotonic() > deadline:
            return Shrunk(best, current, runs, False)
        size = math.ceil(len(current) / n)
        reduced = False
        for i in range(n):
            candidate = current[: i * size] + current[(i + 1) * size :]
            if not candidate or time.monotonic() > deadline:
                continue
            out = run_steps(first.cfg, candidate, prom, base, keep=False)
            runs += 1
            if out.violation is not None and out.violation.invariant == invariant:
                current = candidate[: out.violation.step + 1] if out.violation.step < len(candidate) else candidate
                best = out
                n = max(n - 1, 2)
                reduced = True
                break
            if out.violation is not None:
                rmtree(out.workdir)
        if not reduced:
            if n >= len(current):
                break
            n = min(len(current), n * 2)
    if len(current) == 1 and best.steps != current:
        pass
    return Shrunk(best, current, runs, time.monotonic() <= deadline)


#: Faults the harness found that are open (docs/reliability.md, "Found and NOT fixed"), each told apart from any
#: other violation of its invariant by what the violation itself shows. A run reports them with their seeds and does
#: not fail on them; any other violation fails it. Each entry goes once its fault is fixed.
_BROKER_RESTART = re.compile(
    r"^(\d+) of \d+ published samples not in Prometheus after .*? \((\d+) of them published within [\d.]+ s after a "
    r"broker restart\)"
)
_TWICE_BY_IDENTITY = re.compile(r"samples twice in Prometheus, .* in series that differ in gpu: ")


def known_open_fault(o: Outcome) -> str:
    """The open fault ``o``'s violation is an instance of ("" when it is none of them)."""
    v = o.violation
    if v is None:
        return ""
    if v.invariant == "delivery":
        m = _BROKER_RESTART.match(v.message)
        if m is not None and m.group(1) == m.group(2):
            # every missing sample went out just after a broker restart: mosquitto 2.0.11 restores no shared
            # subscription from its persistence file, so it reached no bridge
            return "broker-restart-shared-subscription"
        if _TWICE_BY_IDENTITY.search(v.message):
            # a batch written before the bridge knew its GPU's identity, delivered again and written with it
            return "written-again-with-identity"
    if v.invariant == "gpu-setting" and v.message.startswith("desired value not in force"):
        # the restore race: a Device removed (or renamed) after a refused value of it, the GPU left at the earlier
        # valid value instead of its default (never "bad input changed a GPU setting": that is no open fault)
        typo_devices: set[str] = set()
        for step in o.steps[: v.step + 1]:
            named = str(step.args[0]) if step.args else ""
            if step.kind in BAD_INPUT_STEPS and named:
                typo_devices.add(named)
                continue
            gone = step.kind == "remove_all" or (step.kind in ("rename", "remove") and named in typo_devices)
            if gone and typo_devices:
                return "restore-race-after-refused-value"
    return ""


@dataclass
class Summary:
    outcomes: list[Outcome] = field(default_factory=list)
    shrunk: dict[str, Shrunk] = field(default_factory=dict)
    wall_s: float = 0.0
    #: How many sequences were asked for (more than ran when the run stopped at its time budget).
    requested: int = 0

    @property
    def sequences(self) -> int:
        return len(self.outcomes)

    @property
    def steps(self) -> int:
        return sum(o.executed for o in self.outcomes)

    @property
    def violations(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.violation is not None]

    @property
    def unknown_violations(self) -> list[Outcome]:
        """The violations that are no instance of an open fault (``known_open_fault``): what fails a run."""
        return [o for o in self.violations if not known_open_fault(o)]

    def line(self) -> str:
        known = len(self.violations) - len(self.unknown_violations)
        return f"lifecycle: {self.sequences} sequences, {self.steps} steps, {len(self.violations)} violations" + (
            f" ({known} of them open faults, docs/reliability.md)" if known else ""
        )

    def report(self) -> str:
        head = self.line() + f" ({self.wall_s:.0f} s)"
        if self.requested > self.sequences:
            head += f"; {self.requested} requested, the rest not started: the run reached its time budget"
        lines = [head]
        by_invariant: dict[str, list[Outcome]] = {}
        for o in self.violations:
            assert o.violation is not None
            by_invariant.setdefault(o.violation.invariant, []).append(o)
        for invariant, outs in sorted(by_invariant.items()):
            lines.append(f"\n== {invariant}: {len(outs)} sequence(s): seeds {', '.join(str(o.cfg.seed) for o in outs)}")
            for o in outs:  # one line each, so that different causes of one invariant show
                assert o.violation is not None
                known = known_open_fault(o)
                tag = f" [open fault: {known}]" if known else ""
                lines.append(f"   seed {o.cfg.seed} step {o.violation.step}{tag}: {o.violation.message[:200]!r}")
            first = outs[0]
            assert first.violation is not None
            lines.append(f"   first: {first.cfg}, after step {first.violation.step}: {first.violation.message[:1500]}")
            lines.append(f"   its steps: {', '.join(str(s) for s in first.steps[: first.violation.step + 1])}")
            lines.append(f"   logs: {first.workdir}")
            s = self.shrunk.get(invariant)
            if s is not None:
                done = "shortest found" if s.complete else "shrinking stopped at its time budget"
                lines.append(
                    f"   shrunk ({done}, {s.runs} runs) to {len(s.steps)} step(s): {', '.join(str(x) for x in s.steps)}"
                )
                if s.outcome.violation is not None:
                    lines.append(f"   which shows: {s.outcome.violation.message[:1500]}")
        return "\n".join(lines)


def run_many(
    seeds: list[int],
    n_steps: int,
    prom: Prometheus,
    base: Path,
    *,
    workers: int = 2,
    shrink_budget_s: float = 120.0,
    progress: bool = True,
    until: float | None = None,
    log: str | None = None,
) -> Summary:
    """``until`` (a ``time.time()``): no sequence starts after it (the long form's time budget)."""
    summary = Summary(requested=len(seeds))
    started = time.monotonic()

    def one(seed: int) -> Outcome | None:
        if until is not None and time.time() >= until:
            return None
        cfg = config_for(seed)
        out = run_steps(cfg, generate(cfg, n_steps), prom, base)
        what = f"VIOLATION {out.violation}"[:300] if out.violation else "ok"
        line = f"[lifecycle] {cfg} : {out.executed} steps ({out.skipped} skipped) in {out.wall_s:.1f} s: {what}"
        if progress:
            print(line, flush=True)
        if log:
            with _tag_lock, open(log, "a") as f:
                f.write(line.replace("\n", " | ") + "\n")
        return out

    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        summary.outcomes = [o for o in pool.map(one, seeds) if o is not None]
    deadline = time.monotonic() + shrink_budget_s
    for o in summary.unknown_violations:  # (an open fault's instances are not shrunk again)
        assert o.violation is not None
        invariant = o.violation.invariant
        left = deadline - time.monotonic()
        if invariant in summary.shrunk or left <= 5:
            continue
        summary.shrunk[invariant] = shrink(o, prom, base, left)
    summary.wall_s = time.monotonic() - started
    return summary
