"""The mutation check (``scripts/mutation.sh``): small realistic bugs put into the critical modules one at a time by
mutmut, the module's covering tests run against each; a bug no test notices is a survivor.

The working tree (tracked files and untracked ones git does not ignore, so uncommitted edits are checked too) is
copied once under ``--workdir``; then for each module of ``MODULES`` (or those named with ``--module``), in a copy
of that copy:

1. mutmut generates every mutant of the module (mutmut's operators: comparison and arithmetic operators, and/or,
   numbers off by one, strings, a call's arguments dropped or set to None, ``x = ...`` to ``x = None``, break and
   continue swapped, ...). Lines that only word a message (a ``raise`` statement, a ``log.<level>(`` call) are not
   mutated: the tests check which error is raised and what it names, not the wording;
2. ``--sample`` of them are drawn, deterministically from ``--seed`` and the module's name (the same sample every
   run while the module's mutants stay the same);
3. mutmut runs, for each sampled mutant, the covering tests that reach the mutated function (its stats run of the
   covering tests tells which), in forked children, ``--max-children`` at a time;
4. the score: killed (a test failed, or the run hung past mutmut's limit) over sampled, less the mutants that only
   write a line's SQL keywords in lower case (equivalent: listed, not counted). Every survivor is printed with its
   diff; ``mutmut show <name>`` in the module's folder under ``--workdir`` shows one again.

Needs ``mutmut`` 3.8.1 in the virtualenv (``.venv/bin/pip install -e '.[mutation]'``); it uses a few of mutmut's
own functions to list the mutants before running a sample of them, hence the exact version.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MUTMUT_VERSION = "3.8.1"

#: module -> the test files that cover it (fast ones: the slow end-to-end files, such as the bridge against a real
#: Prometheus, stay out; what they alone would kill is not counted).
MODULES: dict[str, tuple[str, ...]] = {
    "mapper/edge/control/reconcile.py": (
        "tests/test_reconcile.py",
        "tests/test_jetson_reconcile.py",
        "tests/test_clocks_actuator.py",
    ),
    "mapper/edge/control/desired.py": ("tests/test_desired.py", "tests/test_reconcile.py", "tests/test_store.py"),
    "mapper/edge/storage/buffer.py": (
        "tests/test_buffer.py",
        "tests/test_compact.py",
        "tests/test_shipper.py",
        "tests/test_streams.py",
    ),
    "mapper/edge/outbox/shipper.py": ("tests/test_shipper.py", "tests/test_compact.py", "tests/test_compact_replay.py"),
    "mapper/edge/outbox/compact.py": ("tests/test_compact.py", "tests/test_compact_replay.py"),
    "mapper/wire/telemetry.py": ("tests/test_telemetry.py", "tests/test_telemetry_merge.py"),
    "mapper/bridge/core.py": ("tests/test_bridgecore.py",),
    "mapper/bridge/remotewrite.py": ("tests/test_remotewrite.py", "tests/test_bridgecore.py"),
    "mapper/edge/processes/attribution.py": ("tests/test_attribution.py", "tests/test_processes.py"),
    "mapper/wire/eventbus.py": ("tests/test_eventbus.py",),
    "mapper/edge/kubeedge/dmi/convert.py": ("tests/test_dmi_convert.py",),
}

#: Covering tests left out: they check no logic of the module (the telemetry one compares the committed zstd
#: dictionaries with what their generator script builds).
DESELECT: dict[str, tuple[str, ...]] = {
    "mapper/wire/telemetry.py": (
        "tests/test_telemetry.py::test_the_committed_dictionary_is_what_the_generator_builds",
    ),
}

#: What the tests read beside the package and tests/ (mutmut copies only those into its ``mutants`` folder): the
#: protobuf sources (remote write, DMI) and the device models.
ALSO_COPY = ("proto/", "device-models/", "deploy/", "scripts/")

#: Lines whose expressions are not mutated (regular expressions over the source line; see the module doc).
DO_NOT_MUTATE = (r"^\s*raise\b", r"\blog(ger)?\.(debug|info|warning|error|exception|critical)\(")

#: mutmut 3.8.1's exit codes of a mutant's test run, as its ``mutmut.stats.status_by_exit_code`` reads them.
STATUS_BY_EXIT_CODE: dict[int | None, str] = {
    **{code: "killed" for code in (1, 3)},
    **{code: "timeout" for code in (24, -24, 36, 152, 255)},
    **{code: "segfault" for code in (-9, -11)},
    0: "survived",
    5: "no tests",
    33: "no tests",
    34: "skipped",
    None: "not run",
}

#: A mutant that only writes the SQL keywords of a line in lower case (``SELECT`` to ``select``): SQL keywords are
#: case-insensitive, so no test can notice it. Counted apart, and left out of the score.
SQL_WORDS = re.compile(r"\b(SELECT|INSERT|UPDATE|DELETE|FROM|WHERE|AND|OR|ORDER|LIMIT|SET|BEGIN|COMMIT|VALUES)\b")
UPPER_WORD = re.compile(r"\b[A-Z]{2,}\b")


def only_sql_case(diff: str) -> bool:
    """True for a diff of one line whose mutant is the original with its upper-case words (SQL keywords) in lower
    case and nothing else changed (a quoted value in another case would be no keyword: not equivalent)."""
    minus = [line[1:] for line in diff.splitlines() if line.startswith("-")]
    plus = [line[1:] for line in diff.splitlines() if line.startswith("+")]
    if len(minus) != 1 or len(plus) != 1 or minus[0] == plus[0] or not SQL_WORDS.search(minus[0]):
        return False
    return UPPER_WORD.sub(lambda m: m.group(0).lower(), minus[0]) == plus[0]


#: The statuses that mean the tests noticed the mutant. A timeout (the mutant made the tests hang or run far past
#: their usual time) counts, and the report lists each one.
NOTICED = {"killed", "timeout", "segfault"}
EQUIVALENT = "equivalent (SQL letter case)"


@dataclass
class Result:
    module: str
    total: int
    sampled: list[str]
    status: dict[str, str] = field(default_factory=dict)
    diffs: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def killed(self) -> int:
        return sum(1 for s in self.status.values() if s in NOTICED)

    @property
    def equivalent(self) -> list[str]:
        return [m for m in self.sampled if self.status.get(m) == EQUIVALENT]

    @property
    def survivors(self) -> list[str]:
        return [m for m in self.sampled if self.status.get(m) not in NOTICED | {EQUIVALENT}]

    @property
    def counted(self) -> int:
        return len(self.sampled) - len(self.equivalent)

    @property
    def timeouts(self) -> list[str]:
        return [m for m in self.sampled if self.status.get(m) in NOTICED - {"killed"}]

    @property
    def score(self) -> float:
        return 100.0 * self.killed / self.counted if self.counted else 100.0


def slug(module: str) -> str:
    return module.removesuffix(".py").replace("/", ".")


def check_mutmut(python: str) -> None:
    out = subprocess.run(
        [python, "-c", "import importlib.metadata as m; print(m.version('mutmut'))"], capture_output=True, text=True
    )
    version = out.stdout.strip()
    if out.returncode != 0 or version != MUTMUT_VERSION:
        raise SystemExit(
            f"mutation: needs mutmut {MUTMUT_VERSION} in {python} (found {version or 'none'}): "
            ".venv/bin/pip install -e '.[mutation]'"
        )


def snapshot(dest: Path) -> str:
    """The working tree as git sees it (tracked, and untracked but not ignored) into ``dest``, once per run, so that
    editing the tree while the run goes on changes nothing of it; returns the commit and whether the tree differed."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for raw in listed:
        if not raw:
            continue
        rel = Path(os.fsdecode(raw))
        src = REPO / rel
        if not src.is_file():  # deleted in the working tree
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True)
    return head.strip() + (" with uncommitted changes" if dirty.stdout.strip() else "")


def write_config(work: Path, module: str, tests: tuple[str, ...]) -> None:
    deselect = [f"--deselect={t}" for t in DESELECT.get(module, ())]

    def block(items: tuple[str, ...] | list[str]) -> str:
        return "".join(f"\n    {x}" for x in items)

    (work / "setup.cfg").write_text(
        "[mutmut]\n"
        "source_paths = mapper/\n"
        f"only_mutate = {module}\n"
        f"pytest_add_cli_args_test_selection ={block(tests)}\n"
        f"pytest_add_cli_args ={block(['-p', 'no:cacheprovider', *deselect])}\n"
        f"do_not_mutate_patterns ={block(DO_NOT_MUTATE)}\n"
        f"also_copy ={block(ALSO_COPY)}\n"
    )


#: Generates the mutants (what ``mutmut run`` does first) and prints the names of the module's mutants.
_LIST = """
import json, os, sys
from pathlib import Path
import mutmut.__main__ as mm
from mutmut.mutation.trampoline import set_mutant_under_test
set_mutant_under_test("mutant_generation")
os.makedirs("mutants", exist_ok=True)
mm.copy_src_dir(); mm.copy_also_copy_files(); mm.setup_source_paths(); mm.store_lines_covered_by_tests()
mm.create_mutants(int(sys.argv[2]))
meta = Path("mutants") / (sys.argv[1] + ".meta")
print(json.dumps(sorted(json.loads(meta.read_text())["exit_code_by_key"])))
"""


def run_module(module: str, tests: tuple[str, ...], args: argparse.Namespace) -> Result:
    started = time.monotonic()
    work = Path(args.workdir) / slug(module)
    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(Path(args.workdir) / "tree", work, symlinks=True)
    write_config(work, module, tests)
    python = args.python
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("CI", None)  # a copy has no ../shared: the schema tests are not among the covering tests anyway
    listed = subprocess.run(
        [python, "-c", _LIST, module, str(args.max_children)], cwd=work, capture_output=True, text=True, env=env
    )
    if listed.returncode != 0:
        raise SystemExit(f"mutation: listing the mutants of {module} failed:\n{listed.stderr[-3000:]}")
    names: list[str] = json.loads(listed.stdout.strip().splitlines()[-1])
    rng = random.Random(f"{args.seed}:{module}")
    sample = sorted(rng.sample(names, min(args.sample, len(names))))
    result = Result(module, len(names), sample)
    print(f"== {module}: {len(names)} mutants, running {len(sample)} (seed {args.seed}) with {' '.join(tests)}")
    sys.stdout.flush()
    run = subprocess.run(
        [python, "-m", "mutmut", "run", "--max-children", str(args.max_children), *sample],
        cwd=work,
        capture_output=True,
        text=True,
        env=env,
    )
    meta = json.loads((work / "mutants" / (module + ".meta")).read_text())["exit_code_by_key"]
    if run.returncode != 0 and all(meta.get(m) is None for m in sample):
        raise SystemExit(f"mutation: mutmut run for {module} failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    for name in sample:
        result.status[name] = STATUS_BY_EXIT_CODE.get(meta.get(name), "suspicious")
    for name in result.survivors:  # (no mutant is EQUIVALENT yet: every one not noticed is shown)
        shown = subprocess.run(
            [python, "-m", "mutmut", "show", name], cwd=work, capture_output=True, text=True, env=env
        ).stdout
        result.diffs[name] = "\n".join(
            line for line in shown.splitlines() if line.startswith(("+", "-")) and not line.startswith(("+++", "---"))
        )
        if only_sql_case(result.diffs[name]):
            result.status[name] = EQUIVALENT
    result.seconds = time.monotonic() - started
    return result


def report(results: list[Result], out: Path | None) -> None:
    lines = []
    for r in results:
        lines.append(f"\n-- {r.module}: {r.killed}/{r.counted} killed ({r.score:.0f} %), {r.seconds:.0f} s")
        for name in r.timeouts:
            lines.append(f"   counted killed, {r.status[name]}: {name}")
        for name in r.equivalent:
            lines.append(f"   not counted, {r.status[name]}: {name}")
        for name in r.survivors:
            lines.append(f"   {r.status[name]}: {name}")
            lines += [f"      {d}" for d in r.diffs.get(name, "").splitlines()]
    lines.append("\nmodule | mutants | sampled | equivalent | killed | score")
    lines.append("---|---|---|---|---|---")
    for r in results:
        lines.append(
            f"`{r.module}` | {r.total} | {len(r.sampled)} | {len(r.equivalent)} | {r.killed} | {r.score:.0f} %"
        )
    text = "\n".join(lines)
    print(text)
    if out is not None:
        doc = [
            {
                "module": r.module,
                "mutants": r.total,
                "sampled": len(r.sampled),
                "equivalent": r.equivalent,
                "killed": r.killed,
                "score": round(r.score, 1),
                "seconds": round(r.seconds),
                "survivors": {
                    m: {"status": r.status[m], "diff": r.diffs.get(m, "")} for m in r.survivors + r.equivalent
                },
            }
            for r in results
        ]
        out.write_text(json.dumps(doc, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--module", action="append", choices=sorted(MODULES), help="only these (default: all)")
    parser.add_argument("--sample", type=int, default=30, help="mutants per module (default 30)")
    parser.add_argument("--seed", type=int, default=28, help="the sample's seed (default 28)")
    parser.add_argument("--max-children", type=int, default=2, help="mutants tested at once (default 2)")
    parser.add_argument("--workdir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "gpu-mapper-mutation"))
    parser.add_argument("--python", default=str(REPO / ".venv" / "bin" / "python"))
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--min-score", type=float, default=90.0, help="exit 1 when a module scores below (90)")
    args = parser.parse_args(argv)
    check_mutmut(args.python)
    tree = snapshot(Path(args.workdir) / "tree")
    print(f"mutation: tree {tree}, seed {args.seed}, {args.sample} mutants per module, {args.max_children} at once")
    results = []
    failed: list[str] = []
    for module in args.module or list(MODULES):
        try:
            results.append(run_module(module, MODULES[module], args))
        except SystemExit as exc:  # mutmut could not run this module's tests: say so, go on with the others
            print(exc, file=sys.stderr)
            failed.append(module)
            continue
        report(results[-1:], None)
    print("\n== all modules")
    report(results, args.json)
    if failed:
        print(f"\nmutation: not run (see above): {', '.join(failed)}")
    return 0 if not failed and all(r.score >= args.min_score for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
