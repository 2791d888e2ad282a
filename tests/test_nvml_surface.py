"""The NVML surface, checked against the binding itself: the installed nvidia-ml-py and the oldest pyproject
allows (12.535.77), each loaded afresh from its ``pynvml.py``.

* every pynvml name the backend uses exists in the binding (or the backend has a fallback for its absence);
* the simulator's functions take the binding's parameters, with the binding's defaults;
* the simulator's result structs have the binding's field names; the stand-in library's structs (written from
  nvml.h) have the binding's field names, offsets and sizes;
* the numbers the backend and the simulator write themselves (error codes, field ids, event bits, value types,
  architectures, compute modes) equal the binding's constants.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import inspect
import os
import re
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path
from types import ModuleType

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from mapper.edge.gpu import nvml as backend_module
from mapper.edge.gpu import profiles, simnvml
from mapper.edge.gpu.nvml import _field_number
from mapper.edge.gpu.simnvml import (
    SimEventData,
    SimMemory,
    SimMemoryV2,
    SimNvml,
    SimPciInfo,
    SimProcessInfo,
    SimProcessUtilization,
    SimUtilization,
)
from mapper.shared.model import COMPUTE_MODES
from tests.nvml_standin import (
    C_STRUCTS,
    FLOOR_DIR,
    FLOOR_VERSION,
    Binding,
    backend_names,
    floor_binding,
    floor_dist_info,
    installed_binding,
)

REPO = Path(__file__).resolve().parents[1]

#: Names the backend uses that a binding may lack, and what the backend does then.
OPTIONAL = {
    "nvmlDeviceGetTemperatureV": "falls back to nvmlDeviceGetTemperature (nvidia-ml-py before 12.550 has no V)",
    "nvmlDeviceGetProcessesUtilizationInfo": "falls back to nvmlDeviceGetProcessUtilization (not in 12.535)",
    "nvmlDeviceGetComputeRunningProcesses_v2": "the fallback of _v3 for drivers before r510 (not in 12.535)",
    "nvmlDeviceGetGraphicsRunningProcesses_v2": "the fallback of _v3 for drivers before r510 (not in 12.535)",
}
#: Constants the oldest binding lacks, with their nvml.h values (the code uses these numbers where it needs them).
FLOOR_MISSING_CONSTANTS = {"NVML_ERROR_GPU_NOT_FOUND": 28, "NVML_VALUE_TYPE_UNSIGNED_SHORT": 6}


@pytest.fixture(scope="module", params=["installed", "floor"], ids=lambda p: p)
def binding(request: pytest.FixtureRequest) -> ModuleType:
    chosen: Binding = installed_binding() if request.param == "installed" else floor_binding()
    return chosen.fresh_module()


def constant(binding: ModuleType, name: str) -> int:
    if hasattr(binding, name):
        value: int = getattr(binding, name)
        return value
    assert name in FLOOR_MISSING_CONSTANTS, f"{name} is not in this binding"
    return FLOOR_MISSING_CONSTANTS[name]


# --------------------------------------------------------------------------------------------------
# The two ends of the range
# --------------------------------------------------------------------------------------------------


def nvml_requirement() -> Requirement:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (requirement,) = [r for r in map(Requirement, deps) if r.name == "nvidia-ml-py"]
    return requirement


def test_the_floor_binding_is_the_oldest_release_pyproject_allows_and_bootstrap_installs_it() -> None:
    """If the floor in pyproject is raised, FLOOR_VERSION and bootstrap follow, or this fails."""
    requirement = nvml_requirement()
    (lower,) = [s for s in requirement.specifier if s.operator == ">="]
    assert requirement.specifier.contains(FLOOR_VERSION)
    # the first release of the branch the floor names (12.535: 12.535.77 was its first release on PyPI)
    assert Version(FLOOR_VERSION).release[:2] == Version(lower.version).release[:2]
    assert f"nvml_floor={FLOOR_VERSION}\n" in (REPO / "scripts" / "bootstrap.sh").read_text()
    assert floor_binding().path == FLOOR_DIR / "pynvml.py" and floor_dist_info().is_dir()


def test_the_installed_binding_is_allowed_and_newer_than_the_floor() -> None:
    """The other end: what pip chose for pyproject's range (the newest release on a fresh install), so the two
    runs of every NVML test are two different bindings. (Read from the venv's site-packages: in the run below with
    the floor first on sys.path, ``pynvml`` is the floor.)"""
    (dist,) = importlib.metadata.distributions(name="nvidia-ml-py", path=[sysconfig.get_paths()["purelib"]])
    installed = dist.version
    assert nvml_requirement().specifier.contains(installed)
    assert Version(installed) > Version(FLOOR_VERSION)


# --------------------------------------------------------------------------------------------------
# Names
# --------------------------------------------------------------------------------------------------


def test_the_backend_names_are_found_in_its_source() -> None:
    names = backend_names()
    assert {
        "nvmlDeviceGetFieldValues",
        "NVML_CLOCK_SM",
        "nvmlInitWithFlags",
        "nvmlMemory_v2",
        "nvmlEventSetWait",
    } <= names
    assert len(names) > 40


def test_every_name_the_backend_uses_is_in_the_binding(binding: ModuleType) -> None:
    missing = sorted(n for n in backend_names() if not hasattr(binding, n) and n not in OPTIONAL)
    assert missing == [], f"nvidia-ml-py lacks {missing}"
    assert hasattr(binding, "NVMLError") and hasattr(binding, "nvmlDeviceGetCurrentClocksThrottleReasons")


# --------------------------------------------------------------------------------------------------
# Simulator functions: parameters and defaults
# --------------------------------------------------------------------------------------------------


def simulated_functions() -> list[str]:
    return sorted(n for n in vars(SimNvml) if n.startswith("nvml") and inspect.isfunction(vars(SimNvml)[n]))


def test_the_simulator_takes_the_bindings_parameters_with_its_defaults(binding: ModuleType) -> None:
    compared = 0
    for name in simulated_functions():
        theirs = getattr(binding, name, None)
        if theirs is None:
            continue  # the installed binding lacks it too: SimNvml hides it (see the floor run below)
        ours = inspect.signature(vars(SimNvml)[name])
        params = [p for p in ours.parameters.values() if p.name != "self"]
        their_params = list(inspect.signature(theirs).parameters.values())
        assert len(params) == len(their_params), f"{name}{ours} vs pynvml.{name}{inspect.signature(theirs)}"
        for mine, their in zip(params, their_params, strict=True):
            assert mine.kind == their.kind, name
            assert mine.default == their.default, f"{name}({mine.name}): {mine.default!r} != {their.default!r}"
            if their.default is not inspect.Parameter.empty:
                assert mine.name == their.name, f"{name}: a defaulted parameter must have the binding's name"
        compared += 1
    assert compared >= 45


def test_the_versioned_defaults_are_the_bindings_structs(binding: ModuleType) -> None:
    sig = inspect.signature(SimNvml.nvmlDeviceSetPowerManagementLimit_v2)
    assert sig.parameters["version"].default == binding.nvmlPowerValue_v2
    if hasattr(binding, "nvmlTemperature_v1"):
        assert inspect.signature(SimNvml.nvmlDeviceGetTemperatureV).parameters["version"].default == (
            binding.nvmlTemperature_v1
        )
    assert inspect.signature(SimNvml.nvmlDeviceGetMemoryInfo).parameters["version"].default is None
    assert binding.nvmlMemory_v2 == simnvml._MEMORY_V2


# --------------------------------------------------------------------------------------------------
# Structs
# --------------------------------------------------------------------------------------------------


def field_names(struct: type) -> list[str]:
    return [f[0] for f in struct._fields_]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("sim_class", "struct"),
    [
        (SimUtilization, "c_nvmlUtilization_t"),
        (SimMemory, "c_nvmlMemory_t"),
        (SimMemoryV2, "c_nvmlMemory_v2_t"),
        (SimPciInfo, "nvmlPciInfo_t"),
        (SimEventData, "c_nvmlEventData_t"),
    ],
)
def test_the_simulators_results_have_the_bindings_field_names(
    sim_class: type, struct: str, binding: ModuleType
) -> None:
    assert sorted(sim_class.__slots__) == sorted(field_names(getattr(binding, struct)))  # type: ignore[attr-defined]


def test_the_simulators_process_results_have_the_bindings_field_names(binding: ModuleType) -> None:
    info = set(field_names(binding.c_nvmlProcessInfo_t))
    # nvidia-ml-py 12.535's struct is r535's wider one; the backend only looks the extra field up by name
    assert set(SimProcessInfo.__slots__) == info - {"usedGpuCcProtectedMemory"}
    assert set(field_names(binding.c_nvmlProcessUtilizationSample_t)) <= set(SimProcessUtilization.__slots__)
    if hasattr(binding, "c_nvmlProcessUtilizationInfo_v1_t"):  # (not in 12.535, nor its wrapper)
        assert set(SimProcessUtilization.__slots__) == set(field_names(binding.c_nvmlProcessUtilizationInfo_v1_t))


def test_field_values_are_the_bindings_own_struct(binding: ModuleType) -> None:
    sim = SimNvml(1, "H100", clock=lambda: 100.0)
    sim.nvmlInit()
    items = sim.nvmlDeviceGetFieldValues(sim.nvmlDeviceGetHandleByIndex(0), [191])
    import pynvml  # the simulator builds the installed binding's array

    assert type(items[0]) is pynvml.c_nvmlFieldValue_t
    assert field_names(type(items[0])) == field_names(binding.c_nvmlFieldValue_t)
    gap = {"usVal"} if not hasattr(binding.c_nvmlValue_t, "usVal") else set()
    assert set(field_names(binding.c_nvmlValue_t)) == set(field_names(pynvml.c_nvmlValue_t)) - gap


@pytest.mark.parametrize("struct", sorted(C_STRUCTS))
def test_the_standin_structs_have_the_bindings_layout(struct: str, binding: ModuleType) -> None:
    ours, theirs = C_STRUCTS[struct], getattr(binding, struct, None)
    if theirs is None:
        wrapper = {
            "c_nvmlTemperature_v1_t": "nvmlDeviceGetTemperatureV",
            "c_nvmlProcessUtilizationInfo_v1_t": "nvmlDeviceGetProcessesUtilizationInfo",
            "c_nvmlProcessesUtilizationInfo_v1_t": "nvmlDeviceGetProcessesUtilizationInfo",
        }.get(struct)
        assert wrapper is not None and not hasattr(binding, wrapper)
        return  # nvidia-ml-py 12.535: neither the struct nor the wrapper that passes it
    our_fields = {name: getattr(ours, name) for name in field_names(ours)}
    their_fields = {name: getattr(theirs, name) for name in field_names(theirs)}
    missing = set(our_fields) - set(their_fields)
    if struct == "c_nvmlValue_t" and not hasattr(theirs, "usVal"):
        assert missing == {"usVal"}  # nvidia-ml-py 12.535: the union is the same size without it
    else:
        assert missing == set()
    assert set(their_fields) <= set(our_fields)
    assert ctypes.sizeof(ours) == ctypes.sizeof(theirs)
    for name, field in their_fields.items():
        assert (field.offset, field.size) == (our_fields[name].offset, our_fields[name].size), f"{struct}.{name}"


def test_an_unsigned_short_field_is_read_without_usval(binding: ModuleType) -> None:
    item = binding.c_nvmlFieldValue_t()
    item.fieldId, item.valueType, item.nvmlReturn = 82, 6, 0
    ctypes.c_ushort.from_address(ctypes.addressof(item.value)).value = 0xBEEF
    item.value.uiVal |= 0x12340000  # bytes above the short: not part of the value
    assert _field_number(item) == 0xBEEF


# --------------------------------------------------------------------------------------------------
# Numbers
# --------------------------------------------------------------------------------------------------


def test_the_error_codes_the_backend_writes_are_the_bindings(binding: ModuleType) -> None:
    ours = {
        name: value
        for name, value in vars(backend_module).items()
        if (re.fullmatch(r"_[A-Z_]+", name) and isinstance(value, int) and f"NVML_ERROR{name}" in dir(binding))
        or name in ("_GPU_NOT_FOUND",)
    }
    assert len(ours) >= 15, sorted(ours)
    for name, value in ours.items():
        assert value == constant(binding, f"NVML_ERROR{name}"), name
    assert backend_module._UNKNOWN == binding.NVML_ERROR_UNKNOWN == 999


def test_field_ids_event_bits_and_value_types_are_the_bindings(binding: ModuleType) -> None:
    assert backend_module._FI_MEMORY_TEMP == binding.NVML_FI_DEV_MEMORY_TEMP
    assert backend_module._FI_ENERGY == binding.NVML_FI_DEV_ENERGY
    assert binding.nvmlEventTypeSingleBitEccError == backend_module._EV_SBE
    assert binding.nvmlEventTypeDoubleBitEccError == backend_module._EV_DBE
    assert binding.nvmlEventTypeXidCriticalError == backend_module._EV_XID
    types = {
        "DOUBLE": "dVal",
        "UNSIGNED_INT": "uiVal",
        "UNSIGNED_LONG": "ulVal",
        "UNSIGNED_LONG_LONG": "ullVal",
        "SIGNED_LONG_LONG": "sllVal",
        "SIGNED_INT": "siVal",
        "UNSIGNED_SHORT": "usVal",
    }
    members = backend_module._FIELD_VALUE_MEMBERS
    assert {constant(binding, f"NVML_VALUE_TYPE_{t}"): m for t, m in types.items()} == {
        code: member for code, (member, _) in members.items()
    }


def test_architectures_and_compute_modes_are_the_bindings(binding: ModuleType) -> None:
    for code, name in backend_module.ARCHITECTURES.items():
        if not hasattr(binding, f"NVML_DEVICE_ARCH_{name.upper()}"):
            assert name == "blackwell", name  # newer than nvidia-ml-py 12.535; its code is nvml.h's
            continue
        assert getattr(binding, f"NVML_DEVICE_ARCH_{name.upper()}") == code
    for code, name in profiles.ARCH_NAMES.items():
        assert getattr(binding, f"NVML_DEVICE_ARCH_{name.upper()}") == code
    for name, code in COMPUTE_MODES.items():
        assert getattr(binding, f"NVML_COMPUTEMODE_{name.upper()}") == code


def test_the_simulators_numbers_are_the_bindings(binding: ModuleType) -> None:
    assert constant(binding, "NVML_ERROR_GPU_NOT_FOUND") == simnvml._ERROR_GPU_NOT_FOUND
    assert getattr(binding, "nvmlTemperature_v1", simnvml._TEMPERATURE_V1) == simnvml._TEMPERATURE_V1
    assert binding.nvmlPowerValue_v2 == simnvml._POWER_VALUE_V2
    for bit in ("GpuIdle", "SwPowerCap", "HwSlowdown", "SwThermalSlowdown", "HwThermalSlowdown"):
        assert getattr(SimNvml, f"nvmlClocksEventReason{bit}") == getattr(binding, f"nvmlClocksEventReason{bit}")
        assert getattr(binding, f"nvmlClocksThrottleReason{bit}") == getattr(binding, f"nvmlClocksEventReason{bit}")


# --------------------------------------------------------------------------------------------------
# The simulator and the backend with the oldest binding as ``pynvml``
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_simulator_and_the_backend_run_with_the_oldest_binding_as_pynvml() -> None:
    """With nvidia-ml-py 12.535.77 first on sys.path, the simulator's own tests, the surface checks and the
    contract suite over the simulator pass (the runs over the stand-in use both bindings in every run)."""
    floor_binding()  # installed under .venv/nvml-floor when missing
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(FLOOR_DIR), str(REPO)]), GPU_MAPPER_NVML_LAYERS="sim")
    check = "import pynvml, importlib.metadata as m; print(pynvml.__file__)"
    where = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=60)
    assert where.stdout.strip() == str(FLOOR_DIR / "pynvml.py"), where.stderr
    tests = ["tests/test_simnvml.py", "tests/test_nvml_contract.py", "tests/test_nvml_surface.py"]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "not slow", *tests],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert re.search(r"\d+ passed", run.stdout) and " skipped" not in run.stdout.splitlines()[-1]
    assert FLOOR_VERSION in (FLOOR_DIR / f"nvidia_ml_py-{FLOOR_VERSION}.dist-info" / "METADATA").read_text()
