"""The C-level stand-in itself (tests/nvml_standin.py), and what a one-shot command prints when NVML cannot
start: ``gpu-mapper discover`` in a subprocess whose pynvml loads the stand-in library by name."""

from __future__ import annotations

import ctypes
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mapper.edge.gpu.profiles import COST_PROFILES
from mapper.edge.gpu.simnvml import SimNvml
from tests.nvml_standin import (
    NVML_SIGNATURES,
    StandIn,
    backend_names,
    floor_binding,
    installed_binding,
    standin_env,
    standin_library,
)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(params=["installed", "floor"])
def standin(request: pytest.FixtureRequest) -> Iterator[StandIn]:
    binding = installed_binding() if request.param == "installed" else floor_binding()
    made = StandIn(SimNvml.from_profiles(["H100", "T4"], seed=2), standin_library(), binding)
    yield made
    made.close()
    assert made.failures == []


def resolved_c_functions(source: str, wrappers: set[str]) -> set[str]:
    """The C functions the binding's ``wrappers`` resolve (``_nvmlGetFunctionPointer("...")``), following calls
    from one wrapper to another (nvmlInit -> nvmlInitWithFlags, nvmlEventSetWait -> nvmlEventSetWait_v2)."""
    starts = [(m.group(1), m.start()) for m in re.finditer(r"^def (\w+)\(", source, re.M)]
    bodies = {
        name: source[start : starts[i + 1][1] if i + 1 < len(starts) else len(source)]
        for i, (name, start) in enumerate(starts)
    }
    found: set[str] = set()
    todo, seen = [w for w in wrappers if w in bodies], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        body = bodies[name]
        found.update(re.findall(r'_nvmlGetFunctionPointer\("(\w+)"\)', body))
        todo.extend(c for c in re.findall(r"\b(nvml\w+)\(", body) if c in bodies and c != name)
    return found


def test_the_library_exports_every_c_function_the_backends_wrappers_resolve(standin: StandIn) -> None:
    source = Path(standin.binding.path).read_text()
    wrappers = {n for n in backend_names() if n.startswith("nvml")} | {"nvmlErrorString"}
    needed = resolved_c_functions(source, wrappers)
    assert {"nvmlDeviceGetCount_v2", "nvmlEventSetWait_v2", "nvmlDeviceGetMemoryInfo_v2"} <= needed
    assert needed - {"nvmlErrorString"} <= set(NVML_SIGNATURES), f"{standin.binding} also needs these"
    for name in [*NVML_SIGNATURES, "nvmlErrorString"]:
        assert hasattr(standin.library, name), name
    if standin.binding.version == installed_binding().version:
        assert set(NVML_SIGNATURES) <= needed  # the stand-in serves nothing the backend does not use


def test_the_binding_marshals_strings_handles_and_errors_itself(standin: StandIn) -> None:
    nv = standin.pynvml
    nv.nvmlInit()
    try:
        handle = nv.nvmlDeviceGetHandleByIndex(1)
        assert isinstance(handle, nv.c_nvmlDevice_t)  # a real pointer, minted by the stand-in
        assert nv.nvmlDeviceGetName(handle) == "Tesla T4"  # bytes from C, str from the binding
        uuid = nv.nvmlDeviceGetUUID(handle)
        same = nv.nvmlDeviceGetHandleByUUID(uuid)  # str in, bytes across the C ABI
        assert ctypes.cast(same, ctypes.c_void_p).value == ctypes.cast(handle, ctypes.c_void_p).value
        assert nv.nvmlDeviceGetPciInfo(handle).busId == standin.sim.gpus[1].pci.busId
        assert nv.nvmlDeviceGetSupportedMemoryClocks(handle) == [5001, 405]  # the binding's two-call protocol
        with pytest.raises(nv.NVMLError_NotSupported) as info:
            nv.nvmlDeviceGetFanSpeed(nv.nvmlDeviceGetHandleByIndex(0))  # passive H100
        assert str(info.value) == "Not Supported"  # nvmlErrorString, from the C library
        assert not isinstance(info.value, standin.sim.NVMLError)  # this binding's own classes
        standin.sim.inject_errors("nvmlDeviceGetPowerUsage", 999, 1)
        with pytest.raises(nv.NVMLError_Unknown):
            nv.nvmlDeviceGetPowerUsage(handle)
    finally:
        nv.nvmlShutdown()
    with pytest.raises(nv.NVMLError_Uninitialized):
        nv.nvmlDeviceGetCount()


def test_a_buffer_too_small_is_insufficient_size_and_a_bad_handle_an_invalid_argument(standin: StandIn) -> None:
    standin.pynvml.nvmlInit()
    try:
        handle = standin.pynvml.nvmlDeviceGetHandleByIndex(0)
        small = ctypes.create_string_buffer(8)
        assert standin.library.nvmlDeviceGetUUID(handle, small, ctypes.c_uint(8)) == 7  # INSUFFICIENT_SIZE
        bogus = ctypes.c_void_p(0x1234)
        assert standin.library.nvmlDeviceGetName(bogus, small, ctypes.c_uint(8)) == 2  # INVALID_ARGUMENT
    finally:
        standin.pynvml.nvmlShutdown()


def test_calls_through_the_standin_cost_what_the_simulators_profile_charges(standin: StandIn) -> None:
    """The stand-in forwards each C call to the simulator on the calling thread, so a cost profile charges the
    binding's caller as the driver would: CPU burnt on that thread, blocking calls waiting."""
    nv = standin.pynvml
    nv.nvmlInit()
    try:
        handle = nv.nvmlDeviceGetHandleByIndex(0)
        cost = COST_PROFILES["h200"]
        energy_s = cost.call("nvmlDeviceGetTotalEnergyConsumption").cpu_s
        field_s = cost.fields[nv.NVML_FI_DEV_ENERGY].cpu_s
        start = time.thread_time()
        for _ in range(3):
            nv.nvmlDeviceGetTotalEnergyConsumption(handle)
        free_s = time.thread_time() - start
        assert free_s < energy_s  # the fixture's simulator: the none profile
        standin.sim.set_cost("h200")
        start = time.thread_time()
        for _ in range(3):
            nv.nvmlDeviceGetTotalEnergyConsumption(handle)
            nv.nvmlDeviceGetFieldValues(handle, [nv.NVML_FI_DEV_ENERGY, nv.NVML_FI_DEV_MEMORY_TEMP])
        spent_s = time.thread_time() - start
        expected_s = 3 * (energy_s + field_s)
        assert expected_s <= spent_s < 1.5 * expected_s + 0.005
        pcie = cost.call("nvmlDeviceGetPcieThroughput")
        wall = time.perf_counter()
        nv.nvmlDeviceGetPcieThroughput(handle, nv.NVML_PCIE_UTIL_TX_BYTES)
        assert time.perf_counter() - wall >= pcie.wall_s
    finally:
        standin.sim.set_cost("none")
        nv.nvmlShutdown()


def test_the_standin_does_not_answer_for_the_real_driver(standin: StandIn) -> None:
    """Loaded by path and without a soname: a dlopen of libnvidia-ml.so.1 by name (the real pynvml's) still finds
    the driver's library, or nothing."""
    try:
        by_name = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return  # no driver here, and the stand-in did not pose as one
    assert not hasattr(by_name, "standin_register")


def discover(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mapper.cli", "discover", "--node-name", "edge-1"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env=env,
    )


@pytest.mark.parametrize(
    ("code", "advice"),
    [
        (4, "cannot open the GPU device files (/dev/nvidiactl, /dev/nvidia0 ...)"),
        (9, "The NVIDIA kernel driver is not loaded: load it (modprobe nvidia)"),
        (18, "reload the nvidia kernel modules or reboot the node"),
    ],
)
def test_discover_whose_nvml_cannot_start_prints_one_line_saying_what_to_do(code: int, advice: str) -> None:
    out = discover(standin_env(standin_library(), init_result=code))
    assert out.returncode == 1
    assert out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("gpu-mapper: NVML could not start: nvmlInit failed: ")
    assert advice in lines[0] and f"(NVML error {code})" in lines[0]
    assert "next attempt" not in lines[0] and "re-initialised" not in lines[0] and "root" not in lines[0]


def test_discover_without_an_nvml_library_says_to_install_the_driver_in_one_line() -> None:
    """LibraryNotFound (what the binding raises where no libnvidia-ml.so.1 loads; here the stand-in's answer)."""
    out = discover(standin_env(standin_library(), init_result=12))
    assert out.returncode == 1 and out.stdout == ""
    (line,) = out.stderr.splitlines()
    assert line.startswith("gpu-mapper: NVML library libnvidia-ml.so.1 not found: nvmlInit failed")
    assert "Install the NVIDIA driver" in line and "--sim" in line
    assert "next attempt" not in line and "re-initialised" not in line
