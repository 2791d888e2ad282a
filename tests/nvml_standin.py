"""A stand-in ``libnvidia-ml.so.1`` for tests: the REAL pynvml (nvidia-ml-py) above it, a ``SimNvml`` below it.

``build_library(folder)`` writes a small C library with gcc: every NVML C function the backend reaches through
pynvml (``NVML_SIGNATURES``: the names the wrappers resolve, with nvml.h's argument types) is exported and
forwards through a function pointer that Python registers with ``standin_register``. ``nvmlErrorString`` is C
(NVML's texts). Until a pointer is registered a function answers Uninitialized; ``nvmlInitWithFlags`` answers
the code in ``$NVML_STANDIN_INIT_RESULT`` (default 9, DriverNotLoaded): a process that loads the library by its
name (``LD_LIBRARY_PATH``) sees a machine whose NVML cannot start.

``StandIn(sim, library, binding)`` is one NVML process over one simulator: a private copy of the library (its
own function pointers) and a private copy of the binding module (its own library handle, function-pointer
cache and init count), so that every argument crosses ctypes and the C ABI as with a real driver: the
binding's own marshalling, struct layouts, versioned structs, str/bytes conversion and error classes. The
callbacks write results into the caller's memory with nvml.h's layouts (``C_STRUCTS``, written from the header,
not taken from the binding), and turn the simulator's ``NVMLError`` into the return code. A callback that
raises anything else records it in ``failures`` (the fixtures fail the test on one) and returns Unknown.

``Binding`` is one nvidia-ml-py release's ``pynvml.py``: the installed one, or the oldest pyproject allows,
installed by ``scripts/bootstrap.sh --test`` under ``.venv/nvml-floor`` (``floor_binding`` installs it there when
missing; PyPI must be reachable then).
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import importlib.util
import itertools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from mapper.edge.gpu.simnvml import SimNvml

REPO = Path(__file__).resolve().parents[1]
#: The oldest nvidia-ml-py that pyproject allows (``nvidia-ml-py>=12.535``), and where bootstrap installs it.
FLOOR_VERSION = "12.535.77"
FLOOR_DIR = REPO / ".venv" / "nvml-floor"

_SUCCESS = 0
_ERROR_UNINITIALIZED = 1
_ERROR_INVALID_ARGUMENT = 2
_ERROR_INSUFFICIENT_SIZE = 7
_ERROR_UNKNOWN = 999
_ERROR_ARGUMENT_VERSION_MISMATCH = 25
_NOT_AVAILABLE_U64 = 0xFFFFFFFFFFFFFFFF
#: nvml.h: NVML_STRUCT_VERSION(ProcessesUtilizationInfo, 1) = sizeof(nvmlProcessesUtilizationInfo_v1_t) | 1 << 24.
_PROCESSES_UTILIZATION_INFO_V1 = 24 | 1 << 24

# --------------------------------------------------------------------------------------------------
# The C side
# --------------------------------------------------------------------------------------------------

#: Argument kinds: C type in the library, ctypes type of the callback's parameter.
_KINDS: dict[str, tuple[str, Any]] = {
    "dev": ("void *", ctypes.c_void_p),  # nvmlDevice_t, nvmlEventSet_t (pointers to opaque structs)
    "ptr": ("void *", ctypes.c_void_p),  # out-parameters and struct pointers
    "str": ("const char *", ctypes.c_void_p),
    "u32": ("unsigned int", ctypes.c_uint),  # also nvml.h's enums (int-sized)
    "i32": ("int", ctypes.c_int),
    "u64": ("unsigned long long", ctypes.c_ulonglong),
}

#: The C functions (as nvidia-ml-py 12.535.77 and 13.x resolve them) and their argument kinds, from nvml.h.
NVML_SIGNATURES: dict[str, tuple[str, ...]] = {
    "nvmlInitWithFlags": ("u32",),
    "nvmlShutdown": (),
    "nvmlSystemGetDriverVersion": ("ptr", "u32"),
    "nvmlDeviceGetCount_v2": ("ptr",),
    "nvmlDeviceGetHandleByIndex_v2": ("u32", "ptr"),
    "nvmlDeviceGetHandleByUUID": ("str", "ptr"),
    "nvmlDeviceGetName": ("dev", "ptr", "u32"),
    "nvmlDeviceGetUUID": ("dev", "ptr", "u32"),
    "nvmlDeviceGetSerial": ("dev", "ptr", "u32"),
    "nvmlDeviceGetPciInfo_v3": ("dev", "ptr"),
    "nvmlDeviceGetArchitecture": ("dev", "ptr"),
    "nvmlDeviceGetUtilizationRates": ("dev", "ptr"),
    "nvmlDeviceGetMemoryInfo": ("dev", "ptr"),
    "nvmlDeviceGetMemoryInfo_v2": ("dev", "ptr"),
    "nvmlDeviceGetTemperature": ("dev", "u32", "ptr"),
    "nvmlDeviceGetTemperatureV": ("dev", "ptr"),
    "nvmlDeviceGetTemperatureThreshold": ("dev", "u32", "ptr"),
    "nvmlDeviceGetFanSpeed": ("dev", "ptr"),
    "nvmlDeviceGetPowerUsage": ("dev", "ptr"),
    "nvmlDeviceGetEnforcedPowerLimit": ("dev", "ptr"),
    "nvmlDeviceGetPowerManagementLimit": ("dev", "ptr"),
    "nvmlDeviceGetPowerManagementDefaultLimit": ("dev", "ptr"),
    "nvmlDeviceGetPowerManagementLimitConstraints": ("dev", "ptr", "ptr"),
    "nvmlDeviceGetTotalEnergyConsumption": ("dev", "ptr"),
    "nvmlDeviceGetClockInfo": ("dev", "u32", "ptr"),
    "nvmlDeviceGetMaxClockInfo": ("dev", "u32", "ptr"),
    "nvmlDeviceGetSupportedMemoryClocks": ("dev", "ptr", "ptr"),
    "nvmlDeviceGetSupportedGraphicsClocks": ("dev", "u32", "ptr", "ptr"),
    "nvmlDeviceGetCurrentClocksEventReasons": ("dev", "ptr"),
    "nvmlDeviceGetCurrentClocksThrottleReasons": ("dev", "ptr"),
    "nvmlDeviceGetPerformanceState": ("dev", "ptr"),
    "nvmlDeviceGetPcieThroughput": ("dev", "u32", "ptr"),
    "nvmlDeviceGetTotalEccErrors": ("dev", "u32", "u32", "ptr"),
    "nvmlDeviceGetRemappedRows": ("dev", "ptr", "ptr", "ptr", "ptr"),
    "nvmlDeviceGetPersistenceMode": ("dev", "ptr"),
    "nvmlDeviceGetComputeMode": ("dev", "ptr"),
    "nvmlDeviceValidateInforom": ("dev",),
    "nvmlDeviceGetInforomImageVersion": ("dev", "ptr", "u32"),
    "nvmlDeviceGetInforomVersion": ("dev", "u32", "ptr", "u32"),
    "nvmlDeviceGetFieldValues": ("dev", "i32", "ptr"),
    "nvmlDeviceGetComputeRunningProcesses_v3": ("dev", "ptr", "ptr"),
    "nvmlDeviceGetComputeRunningProcesses_v2": ("dev", "ptr", "ptr"),
    "nvmlDeviceGetGraphicsRunningProcesses_v3": ("dev", "ptr", "ptr"),
    "nvmlDeviceGetGraphicsRunningProcesses_v2": ("dev", "ptr", "ptr"),
    "nvmlDeviceGetProcessUtilization": ("dev", "ptr", "ptr", "u64"),
    "nvmlDeviceGetProcessesUtilizationInfo": ("dev", "ptr"),
    "nvmlDeviceSetPowerManagementLimit": ("dev", "u32"),
    "nvmlDeviceSetGpuLockedClocks": ("dev", "u32", "u32"),
    "nvmlDeviceResetGpuLockedClocks": ("dev",),
    "nvmlDeviceSetMemoryLockedClocks": ("dev", "u32", "u32"),
    "nvmlDeviceResetMemoryLockedClocks": ("dev",),
    "nvmlDeviceSetPersistenceMode": ("dev", "u32"),
    "nvmlDeviceSetComputeMode": ("dev", "u32"),
    "nvmlEventSetCreate": ("ptr",),
    "nvmlDeviceGetSupportedEventTypes": ("dev", "ptr"),
    "nvmlDeviceRegisterEvents": ("dev", "u64", "dev"),
    "nvmlEventSetWait_v2": ("dev", "ptr", "u32"),
    "nvmlEventSetFree": ("dev",),
}

#: nvmlErrorString's texts (NVML's own wording).
_ERROR_STRINGS = {
    0: "Success",
    1: "Uninitialized",
    2: "Invalid Argument",
    3: "Not Supported",
    4: "Insufficient Permissions",
    5: "Already Initialized",
    6: "Not Found",
    7: "Insufficient Size",
    8: "Insufficient External Power",
    9: "Driver Not Loaded",
    10: "Timeout",
    11: "Interrupt request issue",
    12: "NVML Shared Library Not Found",
    13: "Function Not Found",
    14: "Corrupted infoROM",
    15: "GPU is lost",
    16: "GPU requires restart",
    17: "The operating system has blocked the request.",
    18: "RM has detected an NVML/RM version mismatch.",
    19: "In use by another client",
    20: "Insufficient Memory",
    21: "No data",
    22: "Requested vgpu operation is not available on target device, because ECC is enabled",
    23: "Ran out of critical resources, other than memory",
    24: "Frequency not supported",
    25: "Argument version mismatch",
    26: "Deprecated",
    27: "Not Ready",
    28: "GPU not found",
    29: "Invalid state",
    999: "Unknown Error",
}


def c_source() -> str:
    """The stand-in library's C source."""
    out = [
        "/* Generated by tests/nvml_standin.py: a stand-in libnvidia-ml.so.1 forwarding to Python callbacks. */",
        "#include <stdlib.h>",
        "#include <string.h>",
        "typedef int nvmlReturn_t;",
        '#define EXPORT __attribute__((visibility("default")))',
        "",
        "const char *nvmlErrorString(nvmlReturn_t result) EXPORT;",
        "const char *nvmlErrorString(nvmlReturn_t result) {",
        "    switch (result) {",
    ]
    for code, text in _ERROR_STRINGS.items():
        out.append(f'    case {code}: return "{text}";')
    out += ['    default: return "Unknown Error";', "    }", "}", ""]
    slots = []
    for name, kinds in NVML_SIGNATURES.items():
        params = ", ".join(f"{_KINDS[k][0]} a{i}" for i, k in enumerate(kinds)) or "void"
        args = ", ".join(f"a{i}" for i in range(len(kinds)))
        ptype = ", ".join(_KINDS[k][0] for k in kinds) or "void"
        unset = (
            '{ const char *e = getenv("NVML_STANDIN_INIT_RESULT"); return e ? atoi(e) : 9; }'
            if name == "nvmlInitWithFlags"
            else f"return {_ERROR_UNINITIALIZED};"
        )
        out += [
            f"static nvmlReturn_t (*cb_{name})({ptype});",
            f"nvmlReturn_t {name}({params}) EXPORT;",
            f"nvmlReturn_t {name}({params}) {{",
            f"    if (!cb_{name}) {unset}",
            f"    return cb_{name}({args});",
            "}",
            "",
        ]
        slots.append(f'    {{"{name}", (void **)&cb_{name}}},')
    out += [
        "static struct { const char *name; void **slot; } slots[] = {",
        *slots,
        "};",
        "int standin_register(const char *name, void *fn) EXPORT;",
        "int standin_register(const char *name, void *fn) {",
        "    for (size_t i = 0; i < sizeof slots / sizeof slots[0]; i++)",
        "        if (strcmp(slots[i].name, name) == 0) { *slots[i].slot = fn; return 0; }",
        "    return -1;",
        "}",
    ]
    return "\n".join(out) + "\n"


def build_library(folder: Path) -> Path:
    """Compile the stand-in into ``folder/libnvidia-ml.so.1`` (gcc, warnings as errors); its path. It has NO
    soname: with ``libnvidia-ml.so.1`` as its soname, a later ``dlopen("libnvidia-ml.so.1")`` in the same process
    (the real pynvml, on a machine with a GPU) would be given the loaded stand-in instead of the driver's."""
    folder.mkdir(parents=True, exist_ok=True)
    source = folder / "nvml_standin.c"
    source.write_text(c_source())
    target = folder / "libnvidia-ml.so.1"
    gcc = shutil.which("gcc")
    if gcc is None:
        raise RuntimeError("gcc is needed to build the stand-in libnvidia-ml.so.1: run scripts/bootstrap.sh --test")
    subprocess.run(
        [gcc, "-shared", "-fPIC", "-O1", "-Wall", "-Wextra", "-Werror", "-fvisibility=hidden",
         "-o", str(target), str(source)],
        check=True,
        capture_output=True,
        timeout=60,
    )  # fmt: skip
    return target


# --------------------------------------------------------------------------------------------------
# nvml.h's structs (written from the header)
# --------------------------------------------------------------------------------------------------


class PciInfo(ctypes.Structure):
    _fields_ = [
        ("busIdLegacy", ctypes.c_char * 16),
        ("domain", ctypes.c_uint),
        ("bus", ctypes.c_uint),
        ("device", ctypes.c_uint),
        ("pciDeviceId", ctypes.c_uint),
        ("pciSubSystemId", ctypes.c_uint),
        ("busId", ctypes.c_char * 32),
    ]


class Utilization(ctypes.Structure):
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


class Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class MemoryV2(ctypes.Structure):
    _fields_ = [
        ("version", ctypes.c_uint),
        ("total", ctypes.c_ulonglong),
        ("reserved", ctypes.c_ulonglong),
        ("free", ctypes.c_ulonglong),
        ("used", ctypes.c_ulonglong),
    ]


class TemperatureV1(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint), ("sensorType", ctypes.c_int), ("temperature", ctypes.c_int)]


class Value(ctypes.Union):
    _fields_ = [
        ("dVal", ctypes.c_double),
        ("uiVal", ctypes.c_uint),
        ("ulVal", ctypes.c_ulong),
        ("ullVal", ctypes.c_ulonglong),
        ("sllVal", ctypes.c_longlong),
        ("siVal", ctypes.c_int),
        ("usVal", ctypes.c_ushort),
    ]


class FieldValue(ctypes.Structure):
    _fields_ = [
        ("fieldId", ctypes.c_uint),
        ("scopeId", ctypes.c_uint),
        ("timestamp", ctypes.c_longlong),
        ("latencyUsec", ctypes.c_longlong),
        ("valueType", ctypes.c_int),
        ("nvmlReturn", ctypes.c_int),
        ("value", Value),
    ]


class EventData(ctypes.Structure):
    _fields_ = [
        ("device", ctypes.c_void_p),
        ("eventType", ctypes.c_ulonglong),
        ("eventData", ctypes.c_ulonglong),
        ("gpuInstanceId", ctypes.c_uint),
        ("computeInstanceId", ctypes.c_uint),
    ]


class ProcessInfo(ctypes.Structure):
    """``nvmlProcessInfo_t`` (= ``nvmlProcessInfo_v2_t``) as nvml.h has it outside r535."""

    _fields_ = [
        ("pid", ctypes.c_uint),
        ("usedGpuMemory", ctypes.c_ulonglong),
        ("gpuInstanceId", ctypes.c_uint),
        ("computeInstanceId", ctypes.c_uint),
    ]


class ProcessInfoR535(ctypes.Structure):
    """r535's ``nvmlProcessInfo_t``: the v3 functions wrote this larger struct there without a version bump."""

    _fields_ = [*ProcessInfo._fields_, ("usedGpuCcProtectedMemory", ctypes.c_ulonglong)]


class ProcessUtilizationSample(ctypes.Structure):
    _fields_ = [
        ("pid", ctypes.c_uint),
        ("timeStamp", ctypes.c_ulonglong),
        ("smUtil", ctypes.c_uint),
        ("memUtil", ctypes.c_uint),
        ("encUtil", ctypes.c_uint),
        ("decUtil", ctypes.c_uint),
    ]


class ProcessUtilizationInfoV1(ctypes.Structure):
    _fields_ = [
        ("timeStamp", ctypes.c_ulonglong),
        ("pid", ctypes.c_uint),
        ("smUtil", ctypes.c_uint),
        ("memUtil", ctypes.c_uint),
        ("encUtil", ctypes.c_uint),
        ("decUtil", ctypes.c_uint),
        ("jpgUtil", ctypes.c_uint),
        ("ofaUtil", ctypes.c_uint),
    ]


class ProcessesUtilizationInfoV1(ctypes.Structure):
    _fields_ = [
        ("version", ctypes.c_uint),
        ("processSamplesCount", ctypes.c_uint),
        ("lastSeenTimeStamp", ctypes.c_ulonglong),
        ("procUtilArray", ctypes.c_void_p),
    ]


#: The binding's struct class name -> the header's layout it must match.
C_STRUCTS: dict[str, type[ctypes.Structure] | type[ctypes.Union]] = {
    "nvmlPciInfo_t": PciInfo,
    "c_nvmlUtilization_t": Utilization,
    "c_nvmlMemory_t": Memory,
    "c_nvmlMemory_v2_t": MemoryV2,
    "c_nvmlTemperature_v1_t": TemperatureV1,
    "c_nvmlValue_t": Value,
    "c_nvmlFieldValue_t": FieldValue,
    "c_nvmlEventData_t": EventData,
    "c_nvmlProcessUtilizationSample_t": ProcessUtilizationSample,
    "c_nvmlProcessUtilizationInfo_v1_t": ProcessUtilizationInfoV1,
    "c_nvmlProcessesUtilizationInfo_v1_t": ProcessesUtilizationInfoV1,
}


# --------------------------------------------------------------------------------------------------
# The binding
# --------------------------------------------------------------------------------------------------

_module_ids = itertools.count()


class Binding:
    """One nvidia-ml-py release: its ``pynvml.py``, loaded afresh (own globals) for each stand-in process."""

    def __init__(self, path: Path, version: str) -> None:
        self.path = path
        self.version = version

    def __repr__(self) -> str:
        return f"nvidia-ml-py {self.version}"

    def fresh_module(self) -> ModuleType:
        name = f"_pynvml_{self.version.replace('.', '_')}_{next(_module_ids)}"
        spec = importlib.util.spec_from_file_location(name, self.path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # pynvml looks itself up there while it defines its error classes
        try:
            spec.loader.exec_module(module)
        finally:
            del sys.modules[name]
        return module


def installed_binding() -> Binding:
    from importlib.metadata import version

    import pynvml

    return Binding(Path(pynvml.__file__), version("nvidia-ml-py"))


_floor_lock = threading.Lock()


def floor_binding() -> Binding:
    """nvidia-ml-py ``FLOOR_VERSION`` from ``FLOOR_DIR`` (pip-installed there first when absent, or when what is
    there is another release: a floor raised since the folder was filled)."""
    path = FLOOR_DIR / "pynvml.py"
    with _floor_lock:
        if not (path.is_file() and floor_dist_info().is_dir()):
            subprocess.run(
                [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--upgrade", "--target", str(FLOOR_DIR),
                 f"nvidia-ml-py=={FLOOR_VERSION}"],
                check=True,
                timeout=300,
            )  # fmt: skip
    return Binding(path, FLOOR_VERSION)


def floor_dist_info() -> Path:
    """The metadata folder pip writes beside ``FLOOR_DIR/pynvml.py`` for ``FLOOR_VERSION``."""
    return FLOOR_DIR / f"nvidia_ml_py-{FLOOR_VERSION}.dist-info"


# --------------------------------------------------------------------------------------------------
# One NVML process over one simulator
# --------------------------------------------------------------------------------------------------


class _Status(Exception):
    """A return code the callback decides itself (InsufficientSize), not the simulator."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def _u32(addr: int, value: int) -> None:
    ctypes.c_uint.from_address(addr).value = value


def _u64(addr: int, value: int) -> None:
    ctypes.c_ulonglong.from_address(addr).value = value


def _text(buf: int, length: int, text: str) -> None:
    data = text.encode() + b"\0"
    if len(data) > length:
        raise _Status(_ERROR_INSUFFICIENT_SIZE)
    ctypes.memmove(buf, data, len(data))


class StandIn:
    """The binding over the stand-in library over ``sim``: ``.pynvml`` is what ``NvmlBackend`` gets."""

    def __init__(self, sim: SimNvml, library: Path, binding: Binding) -> None:
        self.sim = sim
        self.binding = binding
        self.failures: list[str] = []
        self._folder = Path(tempfile.mkdtemp(prefix="nvml-standin-"))
        copy = self._folder / "libnvidia-ml.so.1"
        shutil.copyfile(library, copy)  # another file: dlopen gives it its own function pointers
        self.library = ctypes.CDLL(str(copy))
        register = self.library.standin_register
        register.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
        register.restype = ctypes.c_int
        self._objects: dict[int, Any] = {}  # address handed out -> simulator object (handle, event set)
        self._addresses: dict[int, int] = {}  # id(simulator object) -> address
        self._cells: list[Any] = []  # keeps the memory behind each address (and each object) alive
        self._lock = threading.Lock()
        self._callbacks: list[Any] = []
        for name, kinds in NVML_SIGNATURES.items():
            impl = getattr(self, "_" + name)
            prototype = ctypes.CFUNCTYPE(ctypes.c_int, *(_KINDS[k][1] for k in kinds))
            callback = prototype(self._guard(name, impl))
            self._callbacks.append(callback)
            if register(name.encode(), ctypes.cast(callback, ctypes.c_void_p)) != 0:
                raise RuntimeError(f"the stand-in library has no slot for {name}")
        self.pynvml = binding.fresh_module()
        self.pynvml.nvmlLib = self.library  # what its _LoadNvmlLibrary would have opened

    def close(self) -> None:
        shutil.rmtree(self._folder, ignore_errors=True)  # the loaded copy stays mapped (Python never unloads)

    def _guard(self, name: str, impl: Callable[..., None]) -> Callable[..., int]:
        nvml_error = self.sim.NVMLError

        def call(*args: Any) -> int:
            try:
                impl(*args)
            except nvml_error as exc:
                return int(exc.value)
            except _Status as status:
                return status.code
            except BaseException:
                self.failures.append(f"{name}{args}: {traceback.format_exc()}")
                return _ERROR_UNKNOWN
            return _SUCCESS

        return call

    # --- handles ----------------------------------------------------------------------------------
    def _address(self, obj: Any) -> int:
        with self._lock:
            addr = self._addresses.get(id(obj))
            if addr is None:
                cell = ctypes.create_string_buffer(16)
                addr = ctypes.addressof(cell)
                self._cells.append((cell, obj))
                self._addresses[id(obj)] = addr
                self._objects[addr] = obj
            return addr

    def _object(self, addr: int | None) -> Any:
        obj = self._objects.get(addr or 0)
        if obj is None:
            raise _Status(_ERROR_INVALID_ARGUMENT)
        return obj

    def _put_handle(self, out: int, obj: Any) -> None:
        ctypes.c_void_p.from_address(out).value = self._address(obj)

    # --- system -----------------------------------------------------------------------------------
    def _nvmlInitWithFlags(self, flags: int) -> None:
        self.sim.nvmlInitWithFlags(flags)

    def _nvmlShutdown(self) -> None:
        self.sim.nvmlShutdown()

    def _nvmlSystemGetDriverVersion(self, buf: int, length: int) -> None:
        _text(buf, length, self.sim.nvmlSystemGetDriverVersion())

    def _nvmlDeviceGetCount_v2(self, out: int) -> None:
        _u32(out, self.sim.nvmlDeviceGetCount())

    def _nvmlDeviceGetHandleByIndex_v2(self, index: int, out: int) -> None:
        self._put_handle(out, self.sim.nvmlDeviceGetHandleByIndex(index))

    def _nvmlDeviceGetHandleByUUID(self, uuid: int, out: int) -> None:
        self._put_handle(out, self.sim.nvmlDeviceGetHandleByUUID(ctypes.string_at(uuid).decode()))

    # --- identity ---------------------------------------------------------------------------------
    def _nvmlDeviceGetName(self, dev: int, buf: int, length: int) -> None:
        _text(buf, length, self.sim.nvmlDeviceGetName(self._object(dev)))

    def _nvmlDeviceGetUUID(self, dev: int, buf: int, length: int) -> None:
        _text(buf, length, self.sim.nvmlDeviceGetUUID(self._object(dev)))

    def _nvmlDeviceGetSerial(self, dev: int, buf: int, length: int) -> None:
        _text(buf, length, self.sim.nvmlDeviceGetSerial(self._object(dev)))

    def _nvmlDeviceGetPciInfo_v3(self, dev: int, out: int) -> None:
        pci = self.sim.nvmlDeviceGetPciInfo(self._object(dev))
        target = PciInfo.from_address(out)
        target.busIdLegacy = pci.busIdLegacy.encode()
        target.busId = pci.busId.encode()
        for name in ("domain", "bus", "device", "pciDeviceId", "pciSubSystemId"):
            setattr(target, name, getattr(pci, name))

    def _nvmlDeviceGetArchitecture(self, dev: int, out: int) -> None:
        _u32(out, self.sim.nvmlDeviceGetArchitecture(self._object(dev)))

    # --- readings ---------------------------------------------------------------------------------
    def _nvmlDeviceGetUtilizationRates(self, dev: int, out: int) -> None:
        rates = self.sim.nvmlDeviceGetUtilizationRates(self._object(dev))
        target = Utilization.from_address(out)
        target.gpu, target.memory = rates.gpu, rates.memory

    def _nvmlDeviceGetMemoryInfo(self, dev: int, out: int) -> None:
        mem = self.sim.nvmlDeviceGetMemoryInfo(self._object(dev))
        target = Memory.from_address(out)
        target.total, target.free, target.used = mem.total, mem.free, mem.used

    def _nvmlDeviceGetMemoryInfo_v2(self, dev: int, out: int) -> None:
        target = MemoryV2.from_address(out)
        mem = self.sim.nvmlDeviceGetMemoryInfo(self._object(dev), version=target.version)
        target.total, target.reserved, target.free, target.used = mem.total, mem.reserved, mem.free, mem.used

    def _nvmlDeviceGetTemperature(self, dev: int, sensor: int, out: int) -> None:
        _u32(out, self.sim.nvmlDeviceGetTemperature(self._object(dev), sensor))

    def _nvmlDeviceGetTemperatureV(self, dev: int, out: int) -> None:
        target = TemperatureV1.from_address(out)
        target.temperature = self.sim.nvmlDeviceGetTemperatureV(self._object(dev), target.sensorType, target.version)

    def _nvmlDeviceGetTemperatureThreshold(self, dev: int, kind: int, out: int) -> None:
        _u32(out, self.sim.nvmlDeviceGetTemperatureThreshold(self._object(dev), kind))

    def _nvmlDeviceGetFanSpeed(self, dev: int, out: int) -> None:
        _u32(out, self.sim.nvmlDeviceGetFanSpeed(self._object(dev)))

    def _nvmlDeviceGetPowerUsage(self, dev: int, out: int) -> None:
        _u32(out, self.sim.nvmlDeviceGetPowerUsage(self._object(dev)))

    def _nvmlDeviceGetEnforcedPowerLimit(self, dev: int, out: int) -> None:
        _u32(out, self.sim.nvmlDeviceGetEnforcedPowerLimit(self._object(dev)))

    def _nvmlDeviceGetPowerManagementLimit(self, dev: int, out: int) -> None:
        _u32(out, self.sim.nvmlDeviceGetPowerManagementLimit(self._object(dev)))

    def _nvmlDeviceGetPowerManagementDefaultLimit(self, dev: int, out: int) -> None:
        _u32(out, self.sim.nvmlDeviceGetPowerManagementDefaultLimit(self._object(dev)))

    def _nvmlDeviceGetPowerManagementLimitConstraints(self, dev: int, lo: int, hi: int) -> None:
        low, high = self.sim.nvmlDeviceGetPowerManagementLimitConstraints(self._object(dev))
        _u32(lo, low)
        _u32(hi, high)

    def _nvmlDeviceGetTotalEnergyConsumption(self, dev: int, out: int) -> None:
        _u64(out, self.sim.nvmlDeviceGetTotalEnergyConsumption(self._object(dev)))

    def _nvmlDeviceGetClockInfo(self, dev: int, kind: int, out: int) -> None:
        _u32(out, self.sim.nvmlDeviceGetClockInfo(self._object(dev), kind))

    def _nvmlDeviceGetMaxClockInfo(self, dev: int, kind: int, out: int) -> None:
        _u32(out, self.sim.nvmlDeviceGetMaxClockInfo(self._object(dev), kind))

    @staticmethod
    def _list(count: int, out: int | None, values: list[int]) -> None:
        room = ctypes.c_uint.from_address(count)
        if out is None or room.value < len(values):
            room.value = len(values)
            raise _Status(_ERROR_INSUFFICIENT_SIZE)
        room.value = len(values)
        (ctypes.c_uint * len(values)).from_address(out)[:] = values

    def _nvmlDeviceGetSupportedMemoryClocks(self, dev: int, count: int, out: int | None) -> None:
        self._list(count, out, self.sim.nvmlDeviceGetSupportedMemoryClocks(self._object(dev)))

    def _nvmlDeviceGetSupportedGraphicsClocks(self, dev: int, mem_mhz: int, count: int, out: int | None) -> None:
        self._list(count, out, self.sim.nvmlDeviceGetSupportedGraphicsClocks(self._object(dev), mem_mhz))

    def _nvmlDeviceGetCurrentClocksEventReasons(self, dev: int, out: int) -> None:
        _u64(out, self.sim.nvmlDeviceGetCurrentClocksEventReasons(self._object(dev)))

    def _nvmlDeviceGetCurrentClocksThrottleReasons(self, dev: int, out: int) -> None:
        _u64(out, self.sim.nvmlDeviceGetCurrentClocksThrottleReasons(self._object(dev)))

    def _nvmlDeviceGetPerformanceState(self, dev: int, out: int) -> None:
        _u32(out, self.sim.nvmlDeviceGetPerformanceState(self._object(dev)))

    def _nvmlDeviceGetPcieThroughput(self, dev: int, counter: int, out: int) -> None:
        _u32(out, self.sim.nvmlDeviceGetPcieThroughput(self._object(dev), counter))

    def _nvmlDeviceGetTotalEccErrors(self, dev: int, error_type: int, counter_type: int, out: int) -> None:
        _u64(out, self.sim.nvmlDeviceGetTotalEccErrors(self._object(dev), error_type, counter_type))

    def _nvmlDeviceGetRemappedRows(self, dev: int, corr: int, unc: int, pending: int, failure: int) -> None:
        values = self.sim.nvmlDeviceGetRemappedRows(self._object(dev))
        for addr, value in zip((corr, unc, pending, failure), values, strict=True):
            _u32(addr, value)

    def _nvmlDeviceGetPersistenceMode(self, dev: int, out: int) -> None:
        _u32(out, self.sim.nvmlDeviceGetPersistenceMode(self._object(dev)))

    def _nvmlDeviceGetComputeMode(self, dev: int, out: int) -> None:
        _u32(out, self.sim.nvmlDeviceGetComputeMode(self._object(dev)))

    def _nvmlDeviceValidateInforom(self, dev: int) -> None:
        self.sim.nvmlDeviceValidateInforom(self._object(dev))

    def _nvmlDeviceGetInforomImageVersion(self, dev: int, buf: int, length: int) -> None:
        _text(buf, length, self.sim.nvmlDeviceGetInforomImageVersion(self._object(dev)))

    def _nvmlDeviceGetInforomVersion(self, dev: int, obj: int, buf: int, length: int) -> None:
        _text(buf, length, self.sim.nvmlDeviceGetInforomVersion(self._object(dev), obj))

    def _nvmlDeviceGetFieldValues(self, dev: int, count: int, out: int) -> None:
        targets = (FieldValue * count).from_address(out)
        items = self.sim.nvmlDeviceGetFieldValues(self._object(dev), [t.fieldId for t in targets])
        for target, item in zip(targets, items, strict=True):
            for name in ("fieldId", "scopeId", "timestamp", "latencyUsec", "valueType", "nvmlReturn"):
                setattr(target, name, getattr(item, name))
            ctypes.memmove(ctypes.addressof(target.value), ctypes.addressof(item.value), ctypes.sizeof(Value))

    # --- processes -------------------------------------------------------------------------------
    def _process_layout(self) -> type[ctypes.Structure]:
        major = int(self.sim.nvmlSystemGetDriverVersion().split(".", 1)[0])
        return ProcessInfoR535 if major == 535 else ProcessInfo

    def _processes(self, fname: str, dev: int, count: int, out: int | None) -> None:
        procs = getattr(self.sim, fname)(self._object(dev))
        room = ctypes.c_uint.from_address(count)
        if not procs:
            room.value = 0
            return
        if out is None or room.value < len(procs):
            room.value = len(procs)
            raise _Status(_ERROR_INSUFFICIENT_SIZE)
        room.value = len(procs)
        targets = (self._process_layout() * len(procs)).from_address(out)
        for target, proc in zip(targets, procs, strict=True):
            target.pid = proc.pid
            target.usedGpuMemory = _NOT_AVAILABLE_U64 if proc.usedGpuMemory is None else proc.usedGpuMemory
            target.gpuInstanceId, target.computeInstanceId = proc.gpuInstanceId, proc.computeInstanceId

    def _nvmlDeviceGetComputeRunningProcesses_v3(self, dev: int, count: int, out: int | None) -> None:
        self._processes("nvmlDeviceGetComputeRunningProcesses_v3", dev, count, out)

    def _nvmlDeviceGetComputeRunningProcesses_v2(self, dev: int, count: int, out: int | None) -> None:
        self._processes("nvmlDeviceGetComputeRunningProcesses_v2", dev, count, out)

    def _nvmlDeviceGetGraphicsRunningProcesses_v3(self, dev: int, count: int, out: int | None) -> None:
        self._processes("nvmlDeviceGetGraphicsRunningProcesses_v3", dev, count, out)

    def _nvmlDeviceGetGraphicsRunningProcesses_v2(self, dev: int, count: int, out: int | None) -> None:
        self._processes("nvmlDeviceGetGraphicsRunningProcesses_v2", dev, count, out)

    def _nvmlDeviceGetProcessUtilization(self, dev: int, out: int | None, count: int, since_us: int) -> None:
        samples = self.sim.nvmlDeviceGetProcessUtilization(self._object(dev), since_us)
        room = ctypes.c_uint.from_address(count)
        if out is None or room.value < len(samples):
            room.value = len(samples)
            raise _Status(_ERROR_INSUFFICIENT_SIZE)
        room.value = len(samples)
        targets = (ProcessUtilizationSample * len(samples)).from_address(out)
        for target, item in zip(targets, samples, strict=True):
            for name in ("pid", "timeStamp", "smUtil", "memUtil", "encUtil", "decUtil"):
                setattr(target, name, getattr(item, name))

    def _nvmlDeviceGetProcessesUtilizationInfo(self, dev: int, info: int) -> None:
        head = ProcessesUtilizationInfoV1.from_address(info)
        if head.version != _PROCESSES_UTILIZATION_INFO_V1:
            raise _Status(_ERROR_ARGUMENT_VERSION_MISMATCH)
        samples = self.sim.nvmlDeviceGetProcessesUtilizationInfo(self._object(dev), head.lastSeenTimeStamp)
        if not head.procUtilArray or head.processSamplesCount < len(samples):
            head.processSamplesCount = len(samples)
            raise _Status(_ERROR_INSUFFICIENT_SIZE)
        head.processSamplesCount = len(samples)
        targets = (ProcessUtilizationInfoV1 * len(samples)).from_address(head.procUtilArray)
        for target, item in zip(targets, samples, strict=True):
            for name in ("timeStamp", "pid", "smUtil", "memUtil", "encUtil", "decUtil", "jpgUtil", "ofaUtil"):
                setattr(target, name, getattr(item, name))
        head.lastSeenTimeStamp = max((item.timeStamp for item in samples), default=head.lastSeenTimeStamp)

    # --- setters ----------------------------------------------------------------------------------
    def _nvmlDeviceSetPowerManagementLimit(self, dev: int, limit_mw: int) -> None:
        self.sim.nvmlDeviceSetPowerManagementLimit(self._object(dev), limit_mw)

    def _nvmlDeviceSetGpuLockedClocks(self, dev: int, lo: int, hi: int) -> None:
        self.sim.nvmlDeviceSetGpuLockedClocks(self._object(dev), lo, hi)

    def _nvmlDeviceResetGpuLockedClocks(self, dev: int) -> None:
        self.sim.nvmlDeviceResetGpuLockedClocks(self._object(dev))

    def _nvmlDeviceSetMemoryLockedClocks(self, dev: int, lo: int, hi: int) -> None:
        self.sim.nvmlDeviceSetMemoryLockedClocks(self._object(dev), lo, hi)

    def _nvmlDeviceResetMemoryLockedClocks(self, dev: int) -> None:
        self.sim.nvmlDeviceResetMemoryLockedClocks(self._object(dev))

    def _nvmlDeviceSetPersistenceMode(self, dev: int, mode: int) -> None:
        self.sim.nvmlDeviceSetPersistenceMode(self._object(dev), mode)

    def _nvmlDeviceSetComputeMode(self, dev: int, mode: int) -> None:
        self.sim.nvmlDeviceSetComputeMode(self._object(dev), mode)

    # --- events -----------------------------------------------------------------------------------
    def _nvmlEventSetCreate(self, out: int) -> None:
        self._put_handle(out, self.sim.nvmlEventSetCreate())

    def _nvmlDeviceGetSupportedEventTypes(self, dev: int, out: int) -> None:
        _u64(out, self.sim.nvmlDeviceGetSupportedEventTypes(self._object(dev)))

    def _nvmlDeviceRegisterEvents(self, dev: int, types: int, event_set: int) -> None:
        self.sim.nvmlDeviceRegisterEvents(self._object(dev), types, self._object(event_set))

    def _nvmlEventSetWait_v2(self, event_set: int, out: int, timeout_ms: int) -> None:
        data = self.sim.nvmlEventSetWait(self._object(event_set), timeout_ms)
        target = EventData.from_address(out)
        target.device = self._address(data.device)
        target.eventType, target.eventData = data.eventType, data.eventData
        target.gpuInstanceId, target.computeInstanceId = data.gpuInstanceId, data.computeInstanceId

    def _nvmlEventSetFree(self, event_set: int) -> None:
        self.sim.nvmlEventSetFree(self._object(event_set))


def backend_names() -> set[str]:
    """Every nvml function and constant name ``mapper/edge/gpu/nvml.py`` spells out (calls, getattr names,
    constants)."""
    source = (REPO / "mapper" / "edge" / "gpu" / "nvml.py").read_text()
    return set(re.findall(r"\"((?:nvml|NVML_)\w+)\"", source)) | set(
        re.findall(r"(?:self\._nvml|\bnvml)\.((?:nvml|NVML_)\w+)", source)
    )


def library_digest() -> str:
    """A short hash of the C source (names a build folder that is still valid)."""
    return hashlib.sha256(c_source().encode()).hexdigest()[:12]


def standin_env(library: Path, init_result: int | None = None) -> dict[str, str]:
    """Environment for a subprocess whose ``pynvml`` loads the stand-in by name (no callbacks registered)."""
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = f"{library.parent}:{env.get('LD_LIBRARY_PATH', '')}".rstrip(":")
    if init_result is not None:
        env["NVML_STANDIN_INIT_RESULT"] = str(init_result)
    return env


_library_lock = threading.Lock()
_library: list[Path] = []


def standin_library() -> Path:
    """The stand-in library, built once per test process into a temporary folder."""
    with _library_lock:
        if not _library:
            folder = Path(tempfile.mkdtemp(prefix=f"nvml-standin-{library_digest()}-"))
            atexit.register(shutil.rmtree, folder, True)  # (the loaded library stays mapped until then)
            _library.append(build_library(folder))
        return _library[0]


#: How the contract suite gives the simulator to NvmlBackend: directly, or through a binding over the stand-in.
#: ``GPU_MAPPER_NVML_LAYERS=sim`` narrows it (the run under the floor binding as ``pynvml`` uses that).
LAYERS: tuple[str, ...] = tuple(
    layer
    for layer in os.environ.get("GPU_MAPPER_NVML_LAYERS", "sim,installed,floor").split(",")
    if layer in ("sim", "installed", "floor")
)


def binding_for(layer: str) -> Binding:
    return installed_binding() if layer == "installed" else floor_binding()


def layer_id(layer: str) -> str:
    if layer == "sim":
        return "sim"
    version = installed_binding().version if layer == "installed" else FLOOR_VERSION
    return f"pynvml-{version}"
