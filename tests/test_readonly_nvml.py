"""The read-only pynvml (``tests/readonly_nvml.py``) that a run on a lent, real GPU uses: the REAL pynvml over
the C stand-in library (``tests/nvml_standin.py``) over a simulator, so that a setter that got through would
change the simulated GPU where the test can see it. Also ``benchmarks/overhead.py --real`` on a machine whose
NVML cannot start: a clear message and a non-zero exit, not a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pynvml
import pytest

from mapper.edge.gpu.nvml import NvmlBackend
from mapper.edge.gpu.simnvml import SimNvml
from tests.nvml_standin import NVML_SIGNATURES, StandIn, installed_binding, standin_env, standin_library
from tests.readonly_nvml import (
    SetterRefused,
    guarded_pids,
    make_read_only,
    nvidia_smi_shim,
    refused_names,
    write_functions,
)
from tests.test_nvml_real_gpu import WRITE_PREFIXES

ROOT = Path(__file__).resolve().parent.parent
#: The brief's examples (issue 29's read-only pass): each must be among the refused.
NAMED = (
    "nvmlDeviceSetPersistenceMode",
    "nvmlDeviceSetApplicationsClocks",
    "nvmlDeviceSetPowerManagementLimit",
    "nvmlDeviceSetGpuLockedClocks",
    "nvmlDeviceResetGpuLockedClocks",
    "nvmlDeviceClearEccErrorCounts",
)


@pytest.fixture
def standin() -> Iterator[StandIn]:
    sim = SimNvml.from_profiles(("H100", "A10"), seed=5, scenario="steady")
    s = StandIn(sim, standin_library(), installed_binding())
    yield s
    s.close()
    assert s.failures == [], s.failures


def limits_mw(module: object) -> list[int]:
    n: object = module
    handles = [n.nvmlDeviceGetHandleByIndex(i) for i in range(n.nvmlDeviceGetCount())]  # type: ignore[attr-defined]
    return [n.nvmlDeviceGetPowerManagementLimit(h) for h in handles]  # type: ignore[attr-defined]


def test_a_setter_reaches_the_simulated_gpu_without_the_guard(standin: StandIn) -> None:
    """The set-up can see a setter: unguarded, the same call the guarded test makes changes the limit."""
    n = standin.pynvml
    n.nvmlInit()
    before = limits_mw(n)
    n.nvmlDeviceSetPowerManagementLimit(n.nvmlDeviceGetHandleByIndex(0), before[0] - 10_000)
    assert limits_mw(n) == [before[0] - 10_000, *before[1:]]
    n.nvmlShutdown()


def test_every_setter_pynvml_exports_is_refused_and_reads_go_through(standin: StandIn, tmp_path: Path) -> None:
    n = standin.pynvml
    # The writes, from the binding's own names by prefix (the real-GPU test's list, not the guard's verbs).
    setters = sorted(x for x in dir(n) if x.startswith(WRITE_PREFIXES) and callable(getattr(n, x)))
    report = tmp_path / "refused.txt"
    guard = make_read_only(n, str(report))
    assert len(setters) > 40 and set(NAMED) <= set(setters)
    assert set(setters) <= set(guard.replaced), set(setters) - set(guard.replaced)

    n.nvmlInit()
    before = limits_mw(n)
    handle = n.nvmlDeviceGetHandleByIndex(0)
    for name in setters:
        with pytest.raises(SetterRefused, match=name):
            getattr(n, name)(handle, 1, 1)  # never reaches a binding's argument checks, let alone the library
    # Below the wrappers: the C functions themselves, through pynvml's lookup, its cache and the library.
    c_setters = [x for x in NVML_SIGNATURES if x.startswith(WRITE_PREFIXES)]
    assert "nvmlDeviceSetPowerManagementLimit" in c_setters
    for name in c_setters:
        with pytest.raises(SetterRefused):
            n._nvmlGetFunctionPointer(name)
        with pytest.raises(SetterRefused):
            getattr(n.nvmlLib, name)
        with pytest.raises(SetterRefused):
            n.nvmlLib[name]
        assert name not in n._nvmlGetFunctionPointer_cache
    assert limits_mw(n) == before, "a setter reached the simulated GPU"
    assert standin.sim.calls.get("nvmlDeviceSetPowerManagementLimit", 0) == 0
    assert refused_names(str(report)) == guard.refused and guarded_pids(str(report)) == [os.getpid()]
    assert guard.refused[: len(setters)] == setters

    # Reads go through: the backend lists and samples every GPU over the guarded binding.
    guard.refused.clear()
    backend = NvmlBackend(n, call_timeout_s=30.0)
    try:
        gpus = backend.list_gpus()
        assert [g.uuid for g in gpus] == [n.nvmlDeviceGetUUID(n.nvmlDeviceGetHandleByIndex(i)) for i in range(2)]
        for gpu in gpus:
            sample = backend.sample(gpu.uuid)
            assert sample.values["uuid"] == gpu.uuid and "power_usage" in sample.values, sample.errors
        assert backend.driver_version() == n.nvmlSystemGetDriverVersion()
    finally:
        backend.shutdown()
    assert guard.refused == [], f"a read was refused: {guard.refused}"


def test_the_guard_covers_the_library_loaded_after_it(tmp_path: Path) -> None:
    """Guarding before ``nvmlInit`` loads the library (as the launcher does) still wraps it once loaded."""
    code = (
        "import pynvml, sys\n"
        "from tests.readonly_nvml import make_read_only, SetterRefused\n"
        "guard = make_read_only(pynvml)\n"
        "assert pynvml.nvmlLib is None\n"
        "try:\n"
        "    pynvml.nvmlInit()\n"
        "except pynvml.NVMLError as exc:\n"
        "    print('init', exc)\n"
        "try:\n"
        "    pynvml.nvmlLib.nvmlDeviceSetPersistenceMode\n"
        "except SetterRefused:\n"
        "    print('refused')\n"
        "print(type(pynvml.nvmlLib).__name__)\n"
    )
    env = standin_env(standin_library(), init_result=9)  # the stand-in loads; nvmlInit answers DriverNotLoaded
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["init Driver Not Loaded", "refused", "_ReadOnlyLibrary"]


def test_write_functions_keep_what_the_mapper_reads() -> None:
    """Every pynvml function the backend calls that is not one of its setters stays callable."""
    from tests.nvml_standin import backend_names

    refused = set(write_functions(pynvml))
    used = {x for x in backend_names() if x.startswith("nvml") and callable(getattr(pynvml, x, None))}
    assert used - refused, "the backend reads something"
    assert {x for x in used & refused if not x.startswith(WRITE_PREFIXES)} == set()


def test_the_nvidia_smi_shim_lets_queries_through_and_refuses_the_rest(tmp_path: Path) -> None:
    ran = tmp_path / "ran.txt"
    real = tmp_path / "real-nvidia-smi"  # stands for the real tool: records what reached it
    real.write_text(f'#!/bin/sh\necho "$*" >> {ran}\n')
    real.chmod(0o755)
    report = tmp_path / "refused.txt"
    shim = nvidia_smi_shim(tmp_path / "bin", str(real), str(report))
    reads = [["-q", "-i", "GPU-1"], ["-L"], ["--query", "--id=GPU-1", "-d", "POWER"], ["-q", "-x"]]
    writes = [["-r", "-i", "GPU-1"], ["-i", "GPU-1", "-pl", "300"], ["-q", "-pm", "1"], ["mig", "-cgi", "9"],
              ["-lgc", "900,900"], ["-rgc"], ["--gpu-reset"], []]  # fmt: skip
    for argv in reads + writes:
        subprocess.run([str(shim), *argv], capture_output=True, timeout=10)
    assert ran.read_text().splitlines() == [" ".join(a) for a in reads]
    assert refused_names(str(report)) == [" ".join(["nvidia-smi", *a]) for a in writes]


def test_overhead_real_without_a_gpu_says_so_and_exits_non_zero() -> None:
    env = standin_env(standin_library(), init_result=9)  # a machine whose NVML driver is not loaded
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), env.get("PYTHONPATH"))))
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "overhead.py"), "--real", "--quick"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert "--real needs a usable NVIDIA GPU" in out.stderr and "Driver Not Loaded" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_overhead_real_rehearsed_over_the_standin_runs_end_to_end_read_only() -> None:
    """The whole ``--real`` path (the machine read, the guarded mapper launcher, the naive loop, the projection)
    with each process's pynvml the real binding over the stand-in library over 2 simulated H100s."""
    sim = SimNvml(2, "H100", seed=0, scenario="steady")  # what each process of the rehearsal simulates
    sim.nvmlInit()
    handles = [sim.nvmlDeviceGetHandleByIndex(i) for i in range(2)]
    expected_uuids = [sim.nvmlDeviceGetUUID(h) for h in handles]
    expected_names = [sim.nvmlDeviceGetName(h) for h in handles]
    expected_driver = sim.nvmlSystemGetDriverVersion()
    env = dict(os.environ, GPU_MAPPER_READONLY_STANDIN="2")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), env.get("PYTHONPATH"))))
    argv = [sys.executable, str(ROOT / "benchmarks" / "overhead.py"), "--real", "--seconds", "3", "--warmup-s", "3"]
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["hardware"] == "real" and out["gpus"] == 2 and out["sim_cost"] is None
    assert out["gpu_uuids"] == expected_uuids and out["gpu_names"] == expected_names
    assert out["driver_version"] == expected_driver
    assert out["setters_refused"] == [] and out["read_only"]["policies_dry_run"] is True
    assert out["read_only"]["mapper_and_naive_guarded"] is True, "both processes made their pynvml read-only"
    assert out["naive"]["hardware"] == "real" and out["naive"]["sent"] > 0
    assert out["mapper_cpu_pct_of_core"] > 0 and out["mapper_peak_rss_mb"] > 0
    projected = out["projected"]
    assert projected["hardware"] == "simulator" and projected["gpus"] == 2 and projected["sim_cost"] == "h200"
    assert projected["gpu_profile"] == "H100" and projected["mapper_cpu_pct_of_core"] > 0
    assert out["measured_over_projected_cpu"] == pytest.approx(
        out["mapper_cpu_pct_of_core"] / projected["mapper_cpu_pct_of_core"], abs=0.01
    )
