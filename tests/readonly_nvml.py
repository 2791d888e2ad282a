"""A read-only ``pynvml``: for a run on a lent, real GPU that must leave the card as it found it.

``make_read_only(module)`` changes one loaded pynvml module in place so that no function that changes GPU,
driver or system state can reach the driver, at three levels:

1. every such Python wrapper the module exports (found from the module's own names, ``write_functions``: not a
   hand list) is replaced by one that raises ``SetterRefused``;
2. ``_nvmlGetFunctionPointer`` (which every wrapper goes through to find its C function) refuses such a C name,
   and the cache of C functions already resolved loses them;
3. the loaded library (``nvmlLib``, also once ``nvmlInit`` loads it later) is wrapped so that looking such a C
   function up on it directly raises too.

A name is a write when one of its CamelCase words is a verb that changes something (``WRITE_VERBS``: Set,
Reset, Clear, Create, ...; ``EventSet`` is the noun of the process-local event sets), unless it is one of the
few decided by name (``READ_NAMES``). A name that is neither a write nor a read (a ``Get``/``Query`` word) is
refused as well: a new verb in a later
nvidia-ml-py is refused until someone decides it is a read. Every refusal is recorded (``refused``), logged at
ERROR and, where ``GPU_MAPPER_READONLY_REPORT`` names a file, appended to it (one name a line; each guarded
process first writes a ``# guarded pid N`` line), so that the process that started guarded ones can say that
they were guarded and whether anything tried.

``nvidia_smi_shim`` writes a ``nvidia-smi`` for the front of such a process's PATH that runs the real one only
for queries (``-q``, ``-L``) and refuses (and reports) anything else, such as ``-r`` or ``-pl``.

``python -m tests.readonly_nvml ARGS``: ``gpu-mapper ARGS`` with the real ``pynvml`` made read-only before the
mapper imports it (``benchmarks/overhead.py --real`` starts the mapper so). ``real_pynvml`` is how each process of
that benchmark gets its pynvml. A rehearsal for tests: with ``GPU_MAPPER_READONLY_STANDIN=N`` in the
environment, ``real_pynvml`` makes ``pynvml`` in that process the real binding over the C stand-in library over N
simulated H100s (same seed in every process, so the same UUIDs), so that the ``--real`` path runs end to end on a
machine without a GPU; unset (as on a lent GPU), it is the installed pynvml over the real driver.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)

#: CamelCase words of a function name that change GPU, driver or system state.
WRITE_VERBS = frozenset(
    {"Set", "Reset", "Clear", "Create", "Destroy", "Modify", "Remove", "Discover", "Freeze", "Activate", "Update",
     "Force", "Write", "Unload"}
)  # fmt: skip
#: Words that make a name a read (when no write verb is in it).
READ_VERBS = frozenset({"Get", "Query", "Read", "Is", "Validate"})
#: Names decided one by one (before the verbs): NVML's session, error texts, a question about two handles, the
#: event sets and GPM samples (process-local objects: created, waited on, freed; registering for events changes
#: no GPU), and pynvml's own Python helpers (no C call). ``_v<N>`` suffixes are stripped before the lookup.
READ_NAMES = frozenset(
    {"nvmlInit", "nvmlInitWithFlags", "nvmlShutdown", "nvmlErrorString", "nvmlDeviceOnSameBoard",
     "nvmlEventSetCreate", "nvmlEventSetFree", "nvmlEventSetWait", "nvmlDeviceRegisterEvents",
     "nvmlSystemEventSetCreate", "nvmlSystemEventSetFree", "nvmlSystemEventSetWait", "nvmlSystemRegisterEvents",
     "nvmlEventSetRegisterGpuOperationalEvents", "nvmlGpmSampleAlloc", "nvmlGpmSampleFree",
     "nvmlExceptionClass", "nvmlFriendlyObjectToStruct", "nvmlStructToFriendlyObject"}
)  # fmt: skip
#: Set in the environment of a guarded process: the file each refused name is appended to.
REPORT_ENV = "GPU_MAPPER_READONLY_REPORT"
#: Tests only: ``real_pynvml`` over the stand-in library over this many simulated GPUs (see the docstring).
STANDIN_ENV = "GPU_MAPPER_READONLY_STANDIN"
STANDIN_PROFILE = "H100"
STANDIN_SEED = 0

_SUFFIX = re.compile(r"_v\d+$")


class SetterRefused(RuntimeError):
    """A function that changes GPU state was called (or looked up) in a read-only NVML process."""


def _words(name: str) -> list[str]:
    base = _SUFFIX.sub("", name[len("nvml") :]).replace("EventSet", "Eventset")  # the noun, not the verb
    return re.findall(r"[A-Z][a-z0-9]*", base)


def is_read(name: str) -> bool:
    """True when the NVML function ``name`` (a pynvml wrapper or a C function) only reads."""
    if not name.startswith("nvml"):
        return False
    if _SUFFIX.sub("", name) in READ_NAMES:
        return True
    words = _words(name)
    return not WRITE_VERBS.intersection(words) and bool(READ_VERBS.intersection(words))


def nvml_functions(module: ModuleType) -> list[str]:
    """The NVML functions a pynvml module exports (its plain functions named ``nvml...``; not its structs)."""
    return sorted(n for n in dir(module) if n.startswith("nvml") and callable(getattr(module, n)) and not
                  isinstance(getattr(module, n), type))  # fmt: skip


def write_functions(module: ModuleType) -> list[str]:
    """Every function of ``module`` the guard refuses: the writes, and anything not known to be a read."""
    return [n for n in nvml_functions(module) if not is_read(n)]


class _ReadOnlyLibrary:
    """The loaded libnvidia-ml, minus its writes: attribute or item lookup of one raises."""

    def __init__(self, library: Any, refuse: Callable[[str], None]) -> None:
        object.__setattr__(self, "_library", library)
        object.__setattr__(self, "_refuse", refuse)

    def __getattr__(self, name: str) -> Any:
        if not is_read(name) and name.startswith("nvml"):
            self._refuse(name)
        return getattr(self._library, name)

    def __getitem__(self, name: str) -> Any:
        if not is_read(name) and name.startswith("nvml"):
            self._refuse(name)
        return self._library[name]


class Guard:
    """What ``make_read_only`` did to one module: the names it refused so far (``refused``)."""

    def __init__(self, module: ModuleType, report: str | None) -> None:
        self.module = module
        self.refused: list[str] = []
        self.replaced = write_functions(module)
        self._report = report
        self._lock = threading.Lock()

    def refuse(self, name: str) -> None:
        with self._lock:
            self.refused.append(name)
            if self._report:
                with open(self._report, "a") as fh:
                    fh.write(name + "\n")
        log.error("read-only NVML: %s refused (this process must not change a GPU)", name)
        raise SetterRefused(f"read-only NVML: {name} changes GPU state and is refused in this process")


def make_read_only(module: ModuleType, report: str | None = None) -> Guard:
    """Make the loaded pynvml ``module`` read-only in place (see the module docstring); idempotent per module."""
    existing = getattr(module, "_gpu_mapper_readonly_guard", None)
    if isinstance(existing, Guard):
        return existing
    guard = Guard(module, report)

    def refusing(name: str) -> Callable[..., Any]:
        def refused(*args: Any, **kwargs: Any) -> Any:
            guard.refuse(name)

        refused.__name__ = name
        return refused

    for name in guard.replaced:
        setattr(module, name, refusing(name))

    lookup = module._nvmlGetFunctionPointer
    cache: dict[str, Any] = module._nvmlGetFunctionPointer_cache

    def get_function_pointer(name: str) -> Any:
        if not is_read(name):
            guard.refuse(name)
        return lookup(name)

    for name in [n for n in cache if not is_read(n)]:
        del cache[name]
    module._nvmlGetFunctionPointer = get_function_pointer

    def wrap_library() -> None:
        library = module.nvmlLib
        if library is not None and not isinstance(library, _ReadOnlyLibrary):
            module.nvmlLib = _ReadOnlyLibrary(library, guard.refuse)

    load = module._LoadNvmlLibrary

    def load_library() -> None:
        load()
        wrap_library()

    module._LoadNvmlLibrary = load_library
    wrap_library()
    module._gpu_mapper_readonly_guard = guard
    if report:
        with open(report, "a") as fh:
            fh.write(f"# guarded pid {os.getpid()}: {len(guard.replaced)} functions refused\n")
    return guard


def _report_lines(report: str) -> list[str]:
    try:
        with open(report) as fh:
            return [line.strip() for line in fh if line.strip()]
    except FileNotFoundError:
        return []


def refused_names(report: str) -> list[str]:
    """The names guarded processes refused, from their report file (none when the file is absent)."""
    return [line for line in _report_lines(report) if not line.startswith("#")]


def guarded_pids(report: str) -> list[int]:
    """The processes that made their pynvml read-only with this report file (each writes a line when it does)."""
    return [int(line.split()[3].rstrip(":")) for line in _report_lines(report) if line.startswith("# guarded pid ")]


def standin_pynvml(count: int) -> ModuleType:
    """The real binding over the stand-in library over ``count`` simulated GPUs (the rehearsal's pynvml)."""
    from mapper.edge.gpu.simnvml import SimNvml
    from tests.nvml_standin import StandIn, installed_binding, standin_library

    sim = SimNvml(count, STANDIN_PROFILE, seed=STANDIN_SEED, scenario="steady")
    standin = StandIn(sim, standin_library(), installed_binding())
    module = standin.pynvml
    module.standin = standin  # kept alive: its ctypes callbacks are what the library calls
    return module


def real_pynvml(report: str | None = None) -> tuple[ModuleType, Guard]:
    """This process's ``pynvml`` made read-only, and its guard: the installed binding over the real driver, or,
    with ``GPU_MAPPER_READONLY_STANDIN=N`` (tests), the rehearsal's, put in ``sys.modules`` for ``import pynvml``."""
    count = os.environ.get(STANDIN_ENV)
    if count:
        module = standin_pynvml(int(count))
        sys.modules["pynvml"] = module
    else:
        import pynvml as module
    return module, make_read_only(module, report)


#: ``nvidia-smi`` options that only read (the recovery's self-check runs ``nvidia-smi -q -i UUID``).
SMI_READ_OPTIONS = ("-q", "--query", "-L", "--list-gpus", "-i", "--id", "-d", "--display", "-x", "--xml-format")


def nvidia_smi_shim(folder: Path, real: str, report: str) -> Path:
    """A ``nvidia-smi`` in ``folder`` (to be first on the guarded process's PATH) that runs the ``real`` one only
    for reads: the first argument must be a query (``-q``, ``-L``; no subcommand) and every option one of
    ``SMI_READ_OPTIONS`` (``--id=X`` and ``--display=X`` too; a value such as a UUID does not start with ``-``).
    Anything else (``-r``, ``-pl``, ``-pm``, ``-lgc``, ...) is refused before the real tool runs: appended to
    ``report`` as ``nvidia-smi ARGS``, exit 1."""
    allowed = " | ".join([*SMI_READ_OPTIONS, "--id=*", "--display=*"])
    folder.mkdir(parents=True, exist_ok=True)
    shim = folder / "nvidia-smi"
    shim.write_text(
        "#!/bin/sh\n"
        "# tests/readonly_nvml.py: nvidia-smi for reads only; anything else is refused before the real tool runs.\n"
        'case "$1" in -q | --query | -L | --list-gpus) ;; *) echo "nvidia-smi $*" >>' + shlex.quote(report) + "\n"
        '  echo "read-only run: nvidia-smi $* refused" >&2; exit 1 ;; esac\n'
        'for a in "$@"; do\n'
        '  case "$a" in\n'
        f"    {allowed}) ;;\n"
        '    -*) echo "nvidia-smi $*" >>' + shlex.quote(report) + "\n"
        '        echo "read-only run: nvidia-smi $* refused" >&2; exit 1 ;;\n'
        "  esac\n"
        "done\n"
        f'exec {shlex.quote(real)} "$@"\n'
    )
    shim.chmod(0o755)
    return shim


def main(argv: Iterable[str] | None = None) -> int:
    """``gpu-mapper ARGS`` over the real pynvml made read-only."""
    real_pynvml(os.environ.get(REPORT_ENV))
    from mapper.cli import main as cli_main

    return cli_main(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
