"""A simulated NVML with the pynvml surface the backend uses.

``SimNvml`` instances look like the ``pynvml`` module: the same function names and argument orders, the same
units (mW, mJ, MHz, KB/s, bytes), struct-like results with the same attribute names, the same module constants
(copied from the real binding) and the REAL ``pynvml.NVMLError`` subclasses. So ``NvmlBackend(SimNvml(...))``
runs exactly the code it runs over ``pynvml`` on a real GPU.

Everything is deterministic from ``seed`` and the injected ``clock`` (a callable returning seconds). Physics is
integrated lazily on each read from the clock delta (steps of at most 0.5 s):

* utilisation comes from a workload scenario (``SCENARIOS``) or a fixed value (``set_utilization``);
* power ``P = P_idle + (P_load - P_idle) * u * (f / f_max)^3`` is held under the enforced limit by lowering the
  SM clock (``SwPowerCap``); Ampere and newer (except GA100) report a 1 s average, older parts the instant value;
* first-order thermal model ``tau * dT/dt = ambient + P * R - T``;
* throttle ladder: ``SwThermalSlowdown`` at max-operating temperature (power held so the GPU settles there),
  ``HwThermalSlowdown + HwSlowdown`` at slowdown (clock halved), GPU lost + XID 79 at shutdown;
* ``GpuIdle`` at idle (idle clock, idle P-state), an energy counter in mJ since the (simulated) driver loaded;
* processes: each scenario runs its own (none at idle, one trainer, two inference servers), sharing the GPU's
  utilisation by weight and its memory; ``start_process`` adds more (growing or sawing memory). ``pod_tree``
  writes them, each in a pod of its own, as a host's ``/proc`` and the kubelet's files show them (``SimPods``).

The control surface for tests and demos (not pynvml names) is at the end of the class: ``gpus``, ``gpu(uuid)``,
``set_scenario``, ``set_utilization``, ``set_ambient_c``, ``set_cooling``, ``set_external_power_limit_w``,
``start_process``, ``stop_process``, ``set_scenario_processes``, ``pod_tree``, ``driver_reload``, ``inject_gpu_lost``,
``inject_xid``, ``inject_ecc``, ``inject_errors``, ``set_call_delay_s``, ``set_cost``, ``set_as_root`` and the ``calls``
counter (calls per pynvml function name).
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import threading
import time
import uuid as uuidlib
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pynvml

from mapper.edge.gpu.profiles import FREE, CallCost, CostProfile, GpuProfile, cost_profile
from mapper.edge.gpu.profiles import profile as lookup_profile
from mapper.edge.health.checks import HealthTools, ProbeResult, SelfCheckResult
from mapper.errors import PermanentError
from mapper.shared.model import format_number

#: Workload scenarios that drive utilisation. "heat" is a full load with poor cooling: under the default power
#: limit it heats the GPU up to its max-operating temperature (H100: 87 C), so a thermal policy has something
#: to fight; a lower power limit brings it down. "oscillating" swings the load (and the temperature) on a 120 s
#: period around the middle of that range.
SCENARIOS = ("idle", "steady", "inference", "training", "heat", "oscillating")

# Bits and codes used internally (the same numbers as pynvml's constants).
_IDLE = pynvml.nvmlClocksEventReasonGpuIdle
_SW_POWER_CAP = pynvml.nvmlClocksEventReasonSwPowerCap
_HW_SLOWDOWN = pynvml.nvmlClocksEventReasonHwSlowdown
_SW_THERMAL = pynvml.nvmlClocksEventReasonSwThermalSlowdown
_HW_THERMAL = pynvml.nvmlClocksEventReasonHwThermalSlowdown
_REASONS_SUPPORTED = 0x1FF
_EV_SBE = pynvml.nvmlEventTypeSingleBitEccError
_EV_DBE = pynvml.nvmlEventTypeDoubleBitEccError
_EV_PSTATE = pynvml.nvmlEventTypePState
_EV_XID = pynvml.nvmlEventTypeXidCriticalError
_EV_CLOCK = pynvml.nvmlEventTypeClock
_CLOCK_TDP = pynvml.NVML_CLOCK_LIMIT_ID_TDP
_CLOCK_UNLIMITED = pynvml.NVML_CLOCK_LIMIT_ID_UNLIMITED
_SYMBOLIC = (_CLOCK_TDP, _CLOCK_UNLIMITED)
_NO_INSTANCE = 0xFFFFFFFF
# Numbers the oldest binding we allow (nvidia-ml-py 12.535.77) lacks; the values are NVML's (nvml.h).
_ERROR_GPU_NOT_FOUND = getattr(pynvml, "NVML_ERROR_GPU_NOT_FOUND", 28)
_TEMPERATURE_V1 = getattr(pynvml, "nvmlTemperature_v1", 0x100000C)
_MEMORY_V2 = pynvml.nvmlMemory_v2
_POWER_VALUE_V2 = pynvml.nvmlPowerValue_v2

_STEP_S = 0.5
_MAX_STEPS = 2000
_MIN_ADVANCE_S = 0.001

#: Oldest driver branch that has each function; a simulated older driver raises FunctionNotFound. The
#: ClocksEventReasons names (and energy field 191, below) came with r535, as nvidia-ml-py 12.535 did; the others
#: are assumed. ``nvmlDeviceGetMemoryInfo_v2`` is the C function ``nvmlDeviceGetMemoryInfo(h, version=...)`` calls.
_MIN_DRIVER_MAJOR: Mapping[str, int] = MappingProxyType(
    {
        "nvmlDeviceGetTemperatureV": 565,
        "nvmlDeviceGetCurrentClocksEventReasons": 535,
        "nvmlDeviceGetSupportedClocksEventReasons": 535,
        "nvmlDeviceGetMemoryInfo_v2": 510,
        "nvmlDeviceSetMemoryLockedClocks": 460,
        "nvmlDeviceResetMemoryLockedClocks": 460,
        "nvmlDeviceGetRemappedRows": 450,
        "nvmlDeviceGetProcessesUtilizationInfo": 550,
        "nvmlDeviceGetComputeRunningProcesses_v3": 510,
        "nvmlDeviceGetGraphicsRunningProcesses_v3": 510,
    }
)

#: Oldest driver branch that knows each field id: an older one answers the field with InvalidArgument (its
#: field table ends before the id). Power and energy fields 185-192 from r535; temperature limits 193-196 from
#: r550 (assumed).
_FIELD_MIN_DRIVER_MAJOR: Mapping[int, int] = MappingProxyType(
    {
        **{field_id: 535 for field_id in range(185, 193)},
        **{field_id: 550 for field_id in range(193, 197)},
    }
)


def _copy_binding_constants() -> dict[str, Any]:
    """The binding's constants and exception classes, so ``sim.NVML_CLOCK_SM`` equals ``pynvml.NVML_CLOCK_SM``."""
    out: dict[str, Any] = {}
    for name in dir(pynvml):
        value = getattr(pynvml, name)
        if (name.startswith(("NVML_", "nvml")) and isinstance(value, int) and not isinstance(value, bool)) or (
            name.startswith("NVMLError") and isinstance(value, type) and issubclass(value, Exception)
        ):
            out[name] = value
    return out


def _hash01(*parts: int) -> float:
    """A deterministic number in [0, 1) from integers (splitmix-style mixing; no RNG objects on the hot path)."""
    h = 0x9E3779B97F4A7C15
    for part in parts:
        h ^= part & 0xFFFFFFFFFFFFFFFF
        h = (h * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
        h = (h * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 29
    return (h & 0xFFFFFFFF) / 4294967296.0


def _error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


#: What ``burn_cpu`` hashes while much is left to burn (the hash runs in C without the GIL).
_BURN_CHUNK = os.urandom(8192)
#: Below this much left ``burn_cpu`` spins in Python instead (a chunk's hash takes ~10-30 us).
_BURN_SPIN_S = 100e-6
#: Burns shorter than this spin on ``perf_counter`` (a vDSO read): ``thread_time`` is a system call of about
#: 1.5 us, which would make a 1 us call cost 4.
_BURN_SHORT_S = 20e-6


def burn_cpu(seconds: float) -> None:
    """Burn ``seconds`` of CPU on the calling thread (its ``time.thread_time`` advances by that much, however
    often the thread is preempted meanwhile). While more than ~0.1 ms is left it hashes in C with the GIL
    released, as a driver call through ctypes runs, so other Python threads go on; the rest is a short spin.
    A burn under 20 us spins on the wall clock (as long as the thread is not preempted, the same)."""
    if seconds < _BURN_SHORT_S:
        wall = time.perf_counter
        until = wall() + seconds
        while wall() < until:
            pass
        return
    now = time.thread_time
    end = now() + seconds
    sha = hashlib.sha256
    while end - now() > _BURN_SPIN_S:
        sha(_BURN_CHUNK)
    while now() < end:
        pass


# --------------------------------------------------------------------------------------------------
# Struct-like results (the attribute names of the pynvml structs)
# --------------------------------------------------------------------------------------------------


class SimUtilization:
    __slots__ = ("gpu", "memory")

    def __init__(self, gpu: int, memory: int) -> None:
        self.gpu = gpu
        self.memory = memory


class SimMemory:
    """``c_nvmlMemory_t``'s fields (v1)."""

    __slots__ = ("free", "total", "used")

    def __init__(self, total: int, free: int, used: int) -> None:
        self.total = total
        self.free = free
        self.used = used


class SimMemoryV2:
    """``c_nvmlMemory_v2_t``'s fields."""

    __slots__ = ("free", "reserved", "total", "used", "version")

    def __init__(self, version: int, total: int, reserved: int, free: int, used: int) -> None:
        self.version = version
        self.total = total
        self.reserved = reserved
        self.free = free
        self.used = used


class SimProcessInfo:
    """``c_nvmlProcessInfo_t``'s fields (v2/v3), as the binding's friendly object: ``usedGpuMemory`` None where
    NVML reports it not available."""

    __slots__ = ("computeInstanceId", "gpuInstanceId", "pid", "usedGpuMemory")

    def __init__(self, pid: int, used: int | None) -> None:
        self.pid = pid
        self.usedGpuMemory = used
        self.gpuInstanceId = _NO_INSTANCE
        self.computeInstanceId = _NO_INSTANCE


class SimProcessUtilization:
    """``c_nvmlProcessUtilizationSample_t`` / ``c_nvmlProcessUtilizationInfo_v1_t``'s fields (percent; the
    timestamp in microseconds of CPU time)."""

    __slots__ = ("decUtil", "encUtil", "jpgUtil", "memUtil", "ofaUtil", "pid", "smUtil", "timeStamp")

    def __init__(self, pid: int, stamp_us: int, sm: int, mem: int, enc: int, dec: int) -> None:
        self.pid = pid
        self.timeStamp = stamp_us
        self.smUtil = sm
        self.memUtil = mem
        self.encUtil = enc
        self.decUtil = dec
        self.jpgUtil = 0
        self.ofaUtil = 0


class SimProcess:
    """A simulated GPU process: its share of the GPU's utilisation (``weight``) and its memory, which may grow
    (``growth_bytes_per_s``, a leak) or climb and fall back every ``sawtooth_period_s`` (a caching allocator).
    ``pod`` is ``(namespace, pod, container)``, the pod ``SimPods`` writes for it (None: a host process)."""

    def __init__(
        self,
        pid: int,
        *,
        memory_bytes: int,
        weight: float = 1.0,
        kind: str = "compute",
        growth_bytes_per_s: float = 0.0,
        sawtooth_bytes: int = 0,
        sawtooth_period_s: float = 0.0,
        started_s: float = 0.0,
        name: str = "python3",
        pod: tuple[str, str, str] | None = None,
    ) -> None:
        if pid <= 0:
            raise ValueError(f"pid must be > 0, got {pid}")
        if memory_bytes < 0 or weight < 0 or growth_bytes_per_s < 0 or sawtooth_bytes < 0 or sawtooth_period_s < 0:
            raise ValueError("memory_bytes, weight, growth_bytes_per_s and the sawtooth must be >= 0")
        if kind not in ("compute", "graphics", "compute+graphics"):
            raise ValueError(f"kind must be compute, graphics or compute+graphics, got {kind!r}")
        self.pid = pid
        self.memory_bytes = memory_bytes
        self.weight = weight
        self.kind = kind
        self.growth_bytes_per_s = growth_bytes_per_s
        self.sawtooth_bytes = sawtooth_bytes
        self.sawtooth_period_s = sawtooth_period_s
        self.started_s = started_s
        self.name = name
        self.pod = pod

    def memory_at(self, t: float) -> int:
        age = max(0.0, t - self.started_s)
        used = self.memory_bytes + self.growth_bytes_per_s * age
        if self.sawtooth_period_s > 0 and self.sawtooth_bytes:
            used += self.sawtooth_bytes * ((age % self.sawtooth_period_s) / self.sawtooth_period_s)
        return int(used) // 4096 * 4096


#: The processes a scenario runs on its own (weights; pids ``scenario_pid``: 1000 + 100 * GPU index + slot + 1):
#: none at idle, one trainer, two inference servers sharing the GPU 3:2.
_SCENARIO_PROCESSES: Mapping[str, tuple[float, ...]] = MappingProxyType(
    {"idle": (), "steady": (1.0,), "training": (1.0,), "heat": (1.0,), "oscillating": (1.0,), "inference": (3.0, 2.0)}
)
#: The most processes a scenario runs on one GPU (the slots ``SimPods`` writes a pod for).
_SCENARIO_SLOTS = max(len(w) for w in _SCENARIO_PROCESSES.values())
#: The namespace and container of the scenario processes' pods (``scenario_pod``).
SIM_POD_NAMESPACE = "demo"
SIM_POD_CONTAINER = "main"


def scenario_pid(index: int, slot: int) -> int:
    """The pid of the scenario process in ``slot`` on the GPU of ``index``."""
    return 1000 + 100 * index + slot + 1


def scenario_pod(index: int, slot: int) -> tuple[str, str, str]:
    """``(namespace, pod, container)`` of the scenario process in ``slot`` on the GPU of ``index``: a pod of its
    own, ``demo/job-<index>-<slot>``, container ``main``, whatever the scenario (as its pid is)."""
    return SIM_POD_NAMESPACE, f"job-{index}-{slot}", SIM_POD_CONTAINER


class SimPciInfo:
    __slots__ = ("bus", "busId", "busIdLegacy", "device", "domain", "pciDeviceId", "pciSubSystemId")

    def __init__(self, bus: int, device_id: int) -> None:
        self.domain = 0
        self.bus = bus
        self.device = 0
        self.busId = f"00000000:{bus:02X}:00.0"
        self.busIdLegacy = f"0000:{bus:02X}:00.0"
        self.pciDeviceId = device_id
        self.pciSubSystemId = 0


class SimEventData:
    """``c_nvmlEventData_t``'s fields (it has no time stamp)."""

    __slots__ = ("computeInstanceId", "device", "eventData", "eventType", "gpuInstanceId")

    def __init__(self, device: SimHandle, event_type: int, event_data: int) -> None:
        self.device = device
        self.eventType = event_type
        self.eventData = event_data
        self.gpuInstanceId = _NO_INSTANCE
        self.computeInstanceId = _NO_INSTANCE


class SimHandle:
    """A device handle: valid for the driver generation it was made in."""

    __slots__ = ("generation", "gpu")

    def __init__(self, gpu: SimGpu, generation: int) -> None:
        self.gpu = gpu
        self.generation = generation

    def __repr__(self) -> str:
        return f"<SimHandle {self.gpu.uuid} gen {self.generation}>"


class SimEventSet:
    __slots__ = ("freed", "generation", "queue", "registrations")

    def __init__(self, generation: int) -> None:
        self.generation = generation
        self.registrations: dict[str, int] = {}
        self.queue: deque[SimEventData] = deque()
        self.freed = False


# --------------------------------------------------------------------------------------------------
# One simulated GPU: settings, physics and counters
# --------------------------------------------------------------------------------------------------


#: The probe faults ``SimNvml.inject_probe_fault`` knows.
PROBE_FAULTS = ("hang", "context", "alloc", "copy", "slow")


class SimGpu:
    """One simulated GPU. Read its attributes in tests; change it through ``SimNvml``'s control methods."""

    def __init__(self, prof: GpuProfile, index: int, seed: int, now_s: float) -> None:
        self.profile = prof
        self.index = index
        self.seed = seed
        self.uuid = "GPU-" + str(uuidlib.UUID(int=int(_hash01(seed, index, 1) * 2**32) << 96 | _bits(seed, index)))
        self.serial = str(1320000000000 + int(_hash01(seed, index, 2) * 9_999_999_999))
        self.pci = SimPciInfo(bus=(0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)[index % 8] + index // 8, device_id=0)
        self.graphics_clocks_mhz = prof.graphics_clocks_mhz()
        self._graphics_set = frozenset(self.graphics_clocks_mhz)
        self.t0 = now_s
        # workload and environment
        self.scenario = "idle"
        self.utilization_override: float | None = None
        self.ambient_override_c: float | None = None
        self.cooling_override: float | None = None
        self.external_limit_w: float | None = None
        #: Processes started through ``SimNvml.start_process`` (beside the scenario's own), by pid.
        self.extra_processes: dict[int, SimProcess] = {}
        #: Whether the scenario runs its own processes (``_SCENARIO_PROCESSES``).
        self.scenario_processes = True
        # health
        self.lost = False
        self.ecc_corrected = 0
        self.ecc_uncorrected = 0
        self.ecc_aggregate_corrected = 0
        self.ecc_aggregate_uncorrected = 0
        self.remapped_rows = (0, 0, 0, 0)
        #: The InfoROM: its image version, object versions (OEM, ECC, power; assumed values) and whether its
        #: checksum validates (``SimNvml.inject_inforom_corrupt``).
        self.inforom_image = "G520.0200.00.05"
        self.inforom_objects = {0: "2.1", 1: "7.16", 2: "N/A"}
        self.inforom_corrupt = False
        #: Injected probe faults (``SimNvml.inject_probe_fault``): [kind, remaining, until_reset, seconds].
        self.probe_faults: list[list[Any]] = []
        self.resets = 0
        self.reset_settings()
        self.energy_mj = 0.0
        self._reset_physics(now_s)

    # --- settings lost on a driver reload ---------------------------------------------------------
    def reset_settings(self) -> None:
        self.power_limit_mw = round(self.profile.power_limit_default_w * 1000)
        self.locked_gpu_clocks: tuple[int, int] | None = None
        self.locked_memory_clocks: tuple[int, int] | None = None
        self.persistence_mode = 0
        self.compute_mode = pynvml.NVML_COMPUTEMODE_DEFAULT

    def _reset_physics(self, now_s: float) -> None:
        prof = self.profile
        self.t_last = now_s
        self.utilization = 0.0
        self.power_w = prof.idle_power_w
        self.power_avg_w = prof.idle_power_w
        self.temperature_c = self.ambient_c + prof.idle_power_w * self.thermal_r
        self.sm_clock_mhz = prof.idle_sm_mhz
        self.memory_clock_mhz = prof.memory_clocks_mhz[-1] if prof.idle_pstate else prof.memory_clocks_mhz[0]
        self.pstate = prof.idle_pstate
        self.reasons = _IDLE
        self.memory_used_bytes = self._memory_used(0.0, now_s - self.t0)
        self.utilization_memory = 0.0
        self.pcie_tx_kbs = 0
        self.pcie_rx_kbs = 0

    # --- derived figures --------------------------------------------------------------------------
    @property
    def ambient_c(self) -> float:
        return self.ambient_override_c if self.ambient_override_c is not None else self.profile.ambient_c

    @property
    def cooling_factor(self) -> float:
        """Multiplies the thermal resistance: 1 = nominal cooling, 2 = half as good."""
        if self.cooling_override is not None:
            return self.cooling_override
        if self.scenario in ("heat", "oscillating"):
            prof = self.profile
            full_w = min(prof.load_power_w, prof.power_limit_default_w)
            # steady state at full load under the default limit: 6 C above max-operating (so SwThermal holds it)
            wanted_r = (prof.max_operating_c + 6 - self.ambient_c) / full_w
            return max(1.0, wanted_r / prof.thermal_r_c_per_w)
        return 1.0

    @property
    def thermal_r(self) -> float:
        return self.profile.thermal_r_c_per_w * self.cooling_factor

    @property
    def power_limit_w(self) -> float:
        return self.power_limit_mw / 1000.0

    @property
    def enforced_limit_mw(self) -> int:
        if self.external_limit_w is None:
            return self.power_limit_mw
        return min(self.power_limit_mw, round(self.external_limit_w * 1000))

    @property
    def energy_j(self) -> float:
        return self.energy_mj / 1000.0

    @property
    def reported_power_w(self) -> float:
        return self.power_avg_w if self.profile.power_averaged else self.power_w

    @property
    def fan_speed_pct(self) -> int:
        return int(min(100.0, max(30.0, 30.0 + (self.temperature_c - 40.0) * 1.5)))

    @property
    def memory_temperature_c(self) -> float:
        return self.temperature_c + 3.0 + 5.0 * self.utilization_memory

    # --- workload ---------------------------------------------------------------------------------
    def utilization_at(self, t: float) -> float:
        if self.utilization_override is not None:
            return self.utilization_override
        scenario = self.scenario
        if scenario == "idle":
            return 0.0
        if scenario == "steady":
            return 0.7
        if scenario == "heat":
            return 1.0
        if scenario == "oscillating":
            return 0.55 + 0.45 * math.sin(2.0 * math.pi * t / 120.0)
        if scenario == "inference":
            slot = int(t / 0.5)
            if _hash01(self.seed, self.index, slot, 11) < 0.4:
                return 0.75 + 0.25 * _hash01(self.seed, self.index, slot, 12)
            return 0.0
        # training: 285 s of near-full load, then a 15 s checkpoint at low load
        phase = t % 300.0
        if phase >= 285.0:
            return 0.05
        return 0.93 + 0.07 * _hash01(self.seed, self.index, int(t), 13)

    def processes_at(self, t: float) -> list[tuple[SimProcess, int]]:
        """The processes running at ``t`` (simulator time since the GPU's start) with their memory."""
        out: list[tuple[SimProcess, int]] = []
        weights = _SCENARIO_PROCESSES.get(self.scenario, ()) if self.scenario_processes else ()
        if weights:
            base = int(self.profile.memory_total_bytes * 0.006)
            scenario_mem = max(0, self._scenario_memory(self.utilization) - base)
            total_w = sum(weights)
            for slot, weight in enumerate(weights):
                pid = scenario_pid(self.index, slot)
                memory = int(scenario_mem * weight / total_w)
                proc = SimProcess(pid, memory_bytes=memory, weight=weight, pod=scenario_pod(self.index, slot))
                out.append((proc, proc.memory_bytes // 4096 * 4096))
        for proc in self.extra_processes.values():
            out.append((proc, proc.memory_at(t)))
        return out

    def _memory_used(self, u: float, t: float) -> int:
        """The scenario's memory (its processes' and the driver's base) plus the started processes'; without
        the scenario's processes, the base alone plus the started ones."""
        extra = sum(p.memory_at(t) for p in self.extra_processes.values())
        own = self._scenario_memory(u) if self.scenario_processes else self._scenario_memory(0.0, "idle")
        return min(self.profile.memory_total_bytes, own + extra)

    def _scenario_memory(self, u: float, scenario: str = "") -> int:
        total = self.profile.memory_total_bytes
        base = 0.006
        scenario = scenario or (self.scenario if self.utilization_override is None else "steady")
        share = {
            "idle": base,
            "inference": 0.4,
            "training": self.profile.memory_busy_fraction,
            "heat": 0.5,
            "oscillating": 0.5,
        }.get(scenario, base + 0.5 * u)
        return int(total * share) // 4096 * 4096

    # --- physics ----------------------------------------------------------------------------------
    def advance(self, now_s: float) -> bool:
        """Integrate up to ``now_s``. Returns True when the GPU crossed its shutdown temperature."""
        dt = now_s - self.t_last
        if dt < _MIN_ADVANCE_S or self.lost:
            return False
        steps = min(_MAX_STEPS, max(1, math.ceil(dt / _STEP_S)))
        h = dt / steps
        t = self.t_last - self.t0
        for _ in range(steps):
            self._step(t, h)
            t += h
            if self.temperature_c >= self.profile.shutdown_c:
                self.t_last = now_s
                return True
        self.t_last = now_s
        return False

    def _step(self, t: float, h: float) -> None:
        prof = self.profile
        u = self.utilization_at(t)
        idle_w = prof.idle_power_w
        f_max = float(prof.sm_max_mhz)
        floor = prof.idle_sm_mhz
        idle = u < 0.01
        freq = float(floor if idle else prof.sm_max_mhz)
        locked = self.locked_gpu_clocks
        if locked is not None:
            freq = min(max(freq, locked[0]), locked[1])
        dyn_w = (prof.load_power_w - idle_w) * u
        power = idle_w + dyn_w * (freq / f_max) ** 3
        reasons = _IDLE if idle else 0
        cap_w = self.enforced_limit_mw / 1000.0
        if power > cap_w and dyn_w > 0:
            reasons |= _SW_POWER_CAP
            power = max(cap_w, idle_w)
            freq = min(freq, f_max * ((power - idle_w) / dyn_w) ** (1.0 / 3.0))
        r = self.thermal_r
        ambient = self.ambient_c
        hold_w = (prof.max_operating_c - ambient) / r
        if self.temperature_c >= prof.max_operating_c and power > hold_w and dyn_w > 0:
            reasons |= _SW_THERMAL
            power = max(hold_w, idle_w)
            freq = min(freq, f_max * ((power - idle_w) / dyn_w) ** (1.0 / 3.0))
        if self.temperature_c >= prof.slowdown_c:
            reasons |= _HW_THERMAL | _HW_SLOWDOWN
            freq /= 2.0
            power = idle_w + (power - idle_w) / 8.0
        snapped = prof.sm_max_mhz - 15 * round((f_max - freq) / 15.0)
        self.sm_clock_mhz = max(floor, min(prof.sm_max_mhz, snapped))
        self.reasons = reasons
        self.utilization = u
        self.pstate = prof.idle_pstate if idle else 0
        mem_clocks = prof.memory_clocks_mhz
        mem = mem_clocks[-1] if (idle and prof.idle_pstate) else mem_clocks[0]
        if self.locked_memory_clocks is not None:
            mem = min(max(mem, self.locked_memory_clocks[0]), self.locked_memory_clocks[1])
        self.memory_clock_mhz = mem
        # thermal (exact solution of the first-order model over the step) and energy
        steady_c = ambient + power * r
        self.temperature_c = steady_c + (self.temperature_c - steady_c) * math.exp(-h / prof.thermal_tau_s)
        self.energy_mj += power * h * 1000.0
        self.power_w = power
        self.power_avg_w += (power - self.power_avg_w) * (1.0 - math.exp(-h))
        # load-dependent counters
        mem_ratio = 0.6 if self.scenario == "training" else 0.4
        self.utilization_memory = u * mem_ratio
        self.memory_used_bytes = self._memory_used(u, t + h)
        noise = 0.8 + 0.4 * _hash01(self.seed, self.index, int(t * 10), 21)
        rx_share = 0.35 if self.scenario == "inference" else 0.05
        self.pcie_rx_kbs = int(prof.pcie_max_kbs * rx_share * u * noise)
        self.pcie_tx_kbs = int(prof.pcie_max_kbs * rx_share * 0.3 * u * noise)


def _bits(seed: int, index: int) -> int:
    out = 0
    for i in range(3):
        out = (out << 32) | int(_hash01(seed, index, 100 + i) * 2**32)
    # RFC 4122 variant/version bits keep the UUID looking like a real one
    out &= ~(0xF << 76)
    out |= 0x4 << 76
    out &= ~(0x3 << 62)
    out |= 0x2 << 62
    return out


# --------------------------------------------------------------------------------------------------
# The simulated library
# --------------------------------------------------------------------------------------------------


class SimNvml:
    """A simulated NVML. Build it with ``SimNvml(count, profile, ...)`` or ``SimNvml.from_profiles([...])``.

    ``clock`` returns seconds (``FakeClock().monotonic`` in tests); ``sleep`` is used only for injected delays
    (``set_call_delay_s``, a slow first call after ``driver_reload``), which are real waits so that the
    backend's timeouts see them. ``as_root=False`` makes every setter raise NoPermission. A ``driver_version``
    whose branch is older than a function (see ``_MIN_DRIVER_MAJOR``) makes that function raise FunctionNotFound.

    ``cost`` (a ``mapper.edge.gpu.profiles.COST_PROFILES`` name or a ``CostProfile``) is what each call costs the
    thread that makes it, as a real driver's does: ``none`` (the default: tests stay fast) or ``h200`` (the
    table measured on an H200). The CPU part is really burnt on the calling thread (``time.thread_time``
    advances by it, so a CPU benchmark sees it; most of it in C with the GIL released, as a ctypes call into the
    driver is), the blocking part is a wait through ``sleep`` that burns none. ``nvmlDeviceGetFieldValues``
    costs what its dearest field costs. ``charged_cpu_s`` / ``charged_block_s`` add up what was charged.
    """

    NVMLError = pynvml.NVMLError
    nvmlExceptionClass = staticmethod(pynvml.nvmlExceptionClass)

    def __init__(
        self,
        count: int = 1,
        profile: str = "H100",
        *,
        seed: int = 0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        as_root: bool = True,
        driver_version: str = "590.48.01",
        scenario: str = "idle",
        profiles: Sequence[str] | None = None,
        cost: str | CostProfile = "none",
    ) -> None:
        keys = list(profiles) if profiles is not None else [profile] * count
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        if scenario not in SCENARIOS:
            raise ValueError(f"unknown scenario {scenario!r}; known: {', '.join(SCENARIOS)}")
        self._clock = clock
        self._sleep = sleep
        self._cost: CostProfile | None = None
        self.set_cost(cost)
        #: CPU and waiting time charged by the cost profile, in seconds (every thread together).
        self.charged_cpu_s = 0.0
        self.charged_block_s = 0.0
        self._lock = threading.RLock()
        self._as_root = as_root
        self._set_driver_version(driver_version)
        now = clock()
        self._gpus = [SimGpu(lookup_profile(k), i, seed, now) for i, k in enumerate(keys)]
        self._by_uuid = {g.uuid: g for g in self._gpus}
        for g in self._gpus:
            g.scenario = scenario
        self._generation = 1
        self._handles = {g.uuid: SimHandle(g, 1) for g in self._gpus}
        self._init_count = 0
        self._event_sets: list[SimEventSet] = []
        self._faults: dict[str, list[list[Any]]] = {}
        self._delays: dict[str, float] = {}
        self._first_call_delay_s = 0.0
        #: Calls per pynvml function name (tests assert how often NVML was asked).
        self.calls: Counter[str] = Counter()
        #: The processes' host tree, once ``pod_tree`` wrote one (kept up to date by start/stop_process).
        self._pods: SimPods | None = None

    @classmethod
    def from_profiles(cls, profiles: Iterable[str], **kwargs: Any) -> SimNvml:
        """``SimNvml.from_profiles(["H100", "T4"], seed=0, clock=clock.monotonic)``."""
        return cls(profiles=list(profiles), **kwargs)

    # ----------------------------------------------------------------------------------------------
    # Call prologue: counting, injected delays and faults, init state, handle validity, capability
    # ----------------------------------------------------------------------------------------------
    def _prologue(self, fname: str) -> None:
        self.calls[fname] += 1
        if self._cost is not None and fname != "nvmlDeviceGetFieldValues":  # (that one by its fields)
            self._charge(self._cost.call(fname))
        if self._first_call_delay_s:
            delay, self._first_call_delay_s = self._first_call_delay_s, 0.0
            self._sleep(delay)
        if self._delays:
            delay = self._delays.get(fname, self._delays.get("*", 0.0))
            if delay:
                self._sleep(delay)
        if fname in self._missing:
            raise _error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    def _fault(self, fname: str, uuid: str | None) -> None:
        for key in (fname, "*"):
            for fault in self._faults.get(key, ()):
                code, remaining, target = fault
                if remaining > 0 and (target is None or target == uuid):
                    fault[1] = remaining - 1
                    raise _error(code)

    def _system(self, fname: str, *, needs_init: bool = True) -> None:
        self._prologue(fname)
        if self._faults:
            self._fault(fname, None)
        if needs_init and self._init_count <= 0:
            raise _error(pynvml.NVML_ERROR_UNINITIALIZED)

    def _device(self, handle: SimHandle, fname: str) -> SimGpu:
        self._prologue(fname)
        if self._init_count <= 0 or not isinstance(handle, SimHandle) or handle.generation != self._generation:
            if not isinstance(handle, SimHandle):
                raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
            raise _error(pynvml.NVML_ERROR_UNINITIALIZED)
        gpu = handle.gpu
        if self._faults:
            self._fault(fname, gpu.uuid)
        if gpu.lost:
            raise _error(pynvml.NVML_ERROR_GPU_IS_LOST)
        if fname in gpu.profile.not_supported:  # a Jetson board's NVML (profiles.TEGRA_PROFILES)
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        now = self._clock()
        if now - gpu.t_last >= _MIN_ADVANCE_S:
            with self._lock:  # one integration at a time (the control surface may run on another thread)
                if gpu.advance(now):
                    self._fall_off(gpu)
                    raise _error(pynvml.NVML_ERROR_GPU_IS_LOST)
        return gpu

    def _setter(self, handle: SimHandle, fname: str) -> SimGpu:
        gpu = self._device(handle, fname)
        if not self._as_root:
            raise _error(pynvml.NVML_ERROR_NO_PERMISSION)
        return gpu

    def _fall_off(self, gpu: SimGpu) -> None:
        gpu.lost = True
        self._emit(gpu, _EV_XID, 79)

    def _emit(self, gpu: SimGpu, event_type: int, data: int) -> None:
        handle = self._handles[gpu.uuid]
        for es in self._event_sets:
            if not es.freed and es.generation == self._generation and es.registrations.get(gpu.uuid, 0) & event_type:
                es.queue.append(SimEventData(handle, event_type, data))

    # ----------------------------------------------------------------------------------------------
    # pynvml surface: system
    # ----------------------------------------------------------------------------------------------
    def nvmlInitWithFlags(self, flags: int) -> None:
        self._init("nvmlInitWithFlags", flags)

    def nvmlInit(self) -> None:
        self._init("nvmlInit", 0)

    def _init(self, fname: str, flags: int) -> None:
        self._system(fname, needs_init=False)
        if not self._gpus and not flags & pynvml.NVML_INIT_FLAG_NO_GPUS:
            raise _error(_ERROR_GPU_NOT_FOUND)
        with self._lock:
            self._init_count += 1

    def nvmlShutdown(self) -> None:
        self._system("nvmlShutdown")
        with self._lock:
            self._init_count -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._system("nvmlSystemGetDriverVersion")
        return self._driver_version

    def nvmlSystemGetNVMLVersion(self) -> str:
        self._system("nvmlSystemGetNVMLVersion")
        return "13." + self._driver_version

    def nvmlDeviceGetCount(self) -> int:
        self._system("nvmlDeviceGetCount")
        return len(self._gpus)

    def _handle_of(self, gpu: SimGpu) -> SimHandle:
        if gpu.lost:
            raise _error(pynvml.NVML_ERROR_GPU_IS_LOST)
        return self._handles[gpu.uuid]

    def nvmlDeviceGetHandleByIndex(self, index: int) -> SimHandle:
        self._system("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self._gpus):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._handle_of(self._gpus[index])

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> SimHandle:
        self._system("nvmlDeviceGetHandleByUUID")
        gpu = self._by_uuid.get(uuid)
        if gpu is None:
            raise _error(pynvml.NVML_ERROR_NOT_FOUND)
        return self._handle_of(gpu)

    def nvmlDeviceGetHandleByPciBusId(self, bus_id: str) -> SimHandle:
        self._system("nvmlDeviceGetHandleByPciBusId")
        for gpu in self._gpus:
            if bus_id.upper() in (gpu.pci.busId.upper(), gpu.pci.busIdLegacy.upper()):
                return self._handle_of(gpu)
        raise _error(pynvml.NVML_ERROR_NOT_FOUND)

    # ----------------------------------------------------------------------------------------------
    # pynvml surface: identity
    # ----------------------------------------------------------------------------------------------
    def nvmlDeviceGetName(self, handle: SimHandle) -> str:
        return self._device(handle, "nvmlDeviceGetName").profile.name

    def nvmlDeviceGetUUID(self, handle: SimHandle) -> str:
        return self._device(handle, "nvmlDeviceGetUUID").uuid

    def nvmlDeviceGetSerial(self, handle: SimHandle) -> str:
        return self._device(handle, "nvmlDeviceGetSerial").serial

    def nvmlDeviceGetIndex(self, handle: SimHandle) -> int:
        return self._device(handle, "nvmlDeviceGetIndex").index

    def nvmlDeviceGetPciInfo(self, handle: SimHandle) -> SimPciInfo:
        return self._device(handle, "nvmlDeviceGetPciInfo").pci

    def nvmlDeviceGetArchitecture(self, handle: SimHandle) -> int:
        return self._device(handle, "nvmlDeviceGetArchitecture").profile.architecture

    # ----------------------------------------------------------------------------------------------
    # pynvml surface: readings
    # ----------------------------------------------------------------------------------------------
    def nvmlDeviceGetUtilizationRates(self, handle: SimHandle) -> SimUtilization:
        gpu = self._device(handle, "nvmlDeviceGetUtilizationRates")
        return SimUtilization(round(gpu.utilization * 100), round(gpu.utilization_memory * 100))

    def nvmlDeviceGetMemoryInfo(self, handle: SimHandle, version: int | None = None) -> SimMemory | SimMemoryV2:
        """v1 (no ``version``): ``used`` includes what the driver reserves, as real NVML's v1 does. v2
        (``version=nvmlMemory_v2``, r510+): ``reserved`` apart, ``used`` what allocations hold; total is the same."""
        gpu = self._device(handle, "nvmlDeviceGetMemoryInfo")
        total = gpu.profile.memory_total_bytes
        reserved = gpu.profile.memory_reserved_bytes
        used = gpu.memory_used_bytes
        if version:
            if "nvmlDeviceGetMemoryInfo_v2" in self._missing:
                raise _error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
            if version != _MEMORY_V2:
                raise _error(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
            return SimMemoryV2(version, total, reserved, total - reserved - used, used)
        return SimMemory(total, total - reserved - used, reserved + used)

    def nvmlDeviceGetTemperatureV(self, handle: SimHandle, sensor: int, version: int = _TEMPERATURE_V1) -> int:
        gpu = self._device(handle, "nvmlDeviceGetTemperatureV")
        if version != _TEMPERATURE_V1:
            raise _error(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return int(gpu.temperature_c)

    def nvmlDeviceGetTemperature(self, handle: SimHandle, sensor: int) -> int:
        gpu = self._device(handle, "nvmlDeviceGetTemperature")
        if sensor != pynvml.NVML_TEMPERATURE_GPU:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return int(gpu.temperature_c)

    def _threshold(self, gpu: SimGpu, kind: int) -> int:
        prof = gpu.profile
        if kind == pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN:
            return prof.shutdown_c
        if kind == pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN:
            return prof.slowdown_c
        if kind == pynvml.NVML_TEMPERATURE_THRESHOLD_GPU_MAX:
            return prof.max_operating_c
        if kind == pynvml.NVML_TEMPERATURE_THRESHOLD_MEM_MAX and prof.memory_max_c is not None:
            return prof.memory_max_c
        raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def nvmlDeviceGetTemperatureThreshold(self, handle: SimHandle, threshold: int) -> int:
        return self._threshold(self._device(handle, "nvmlDeviceGetTemperatureThreshold"), threshold)

    def nvmlDeviceGetPowerUsage(self, handle: SimHandle) -> int:
        return round(self._device(handle, "nvmlDeviceGetPowerUsage").reported_power_w * 1000)

    def nvmlDeviceGetPowerManagementLimit(self, handle: SimHandle) -> int:
        return self._device(handle, "nvmlDeviceGetPowerManagementLimit").power_limit_mw

    def nvmlDeviceGetPowerManagementLimitConstraints(self, handle: SimHandle) -> list[int]:
        prof = self._device(handle, "nvmlDeviceGetPowerManagementLimitConstraints").profile
        return [round(prof.power_limit_min_w * 1000), round(prof.power_limit_max_w * 1000)]

    def nvmlDeviceGetPowerManagementDefaultLimit(self, handle: SimHandle) -> int:
        prof = self._device(handle, "nvmlDeviceGetPowerManagementDefaultLimit").profile
        return round(prof.power_limit_default_w * 1000)

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: SimHandle) -> int:
        return self._device(handle, "nvmlDeviceGetEnforcedPowerLimit").enforced_limit_mw

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: SimHandle) -> int:
        return int(self._device(handle, "nvmlDeviceGetTotalEnergyConsumption").energy_mj)

    def _clock_of(self, gpu: SimGpu, clock_type: int, maximum: bool) -> int:
        if clock_type in (pynvml.NVML_CLOCK_SM, pynvml.NVML_CLOCK_GRAPHICS):
            return gpu.profile.sm_max_mhz if maximum else gpu.sm_clock_mhz
        if clock_type == pynvml.NVML_CLOCK_MEM:
            return gpu.profile.memory_clocks_mhz[0] if maximum else gpu.memory_clock_mhz
        if clock_type == pynvml.NVML_CLOCK_VIDEO:
            return int((gpu.profile.sm_max_mhz if maximum else gpu.sm_clock_mhz) * 0.9)
        raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceGetClockInfo(self, handle: SimHandle, type: int) -> int:
        return self._clock_of(self._device(handle, "nvmlDeviceGetClockInfo"), type, False)

    def nvmlDeviceGetMaxClockInfo(self, handle: SimHandle, type: int) -> int:
        return self._clock_of(self._device(handle, "nvmlDeviceGetMaxClockInfo"), type, True)

    def nvmlDeviceGetSupportedMemoryClocks(self, handle: SimHandle) -> list[int]:
        return list(self._device(handle, "nvmlDeviceGetSupportedMemoryClocks").profile.memory_clocks_mhz)

    def nvmlDeviceGetSupportedGraphicsClocks(self, handle: SimHandle, memoryClockMHz: int) -> list[int]:
        gpu = self._device(handle, "nvmlDeviceGetSupportedGraphicsClocks")
        if memoryClockMHz not in gpu.profile.memory_clocks_mhz:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return list(gpu.graphics_clocks_mhz)

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: SimHandle) -> int:
        return self._device(handle, "nvmlDeviceGetCurrentClocksEventReasons").reasons

    def nvmlDeviceGetSupportedClocksEventReasons(self, handle: SimHandle) -> int:
        self._device(handle, "nvmlDeviceGetSupportedClocksEventReasons")
        return _REASONS_SUPPORTED

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: SimHandle) -> int:
        return self._device(handle, "nvmlDeviceGetCurrentClocksThrottleReasons").reasons

    def nvmlDeviceGetPerformanceState(self, handle: SimHandle) -> int:
        return self._device(handle, "nvmlDeviceGetPerformanceState").pstate

    def nvmlDeviceGetFanSpeed(self, handle: SimHandle) -> int:
        gpu = self._device(handle, "nvmlDeviceGetFanSpeed")
        if not gpu.profile.has_fan:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu.fan_speed_pct

    def nvmlDeviceGetPcieThroughput(self, device: SimHandle, counter: int) -> int:
        gpu = self._device(device, "nvmlDeviceGetPcieThroughput")
        if counter == pynvml.NVML_PCIE_UTIL_TX_BYTES:
            return gpu.pcie_tx_kbs
        if counter == pynvml.NVML_PCIE_UTIL_RX_BYTES:
            return gpu.pcie_rx_kbs
        raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceGetTotalEccErrors(self, handle: SimHandle, errorType: int, counterType: int) -> int:
        gpu = self._device(handle, "nvmlDeviceGetTotalEccErrors")
        if not gpu.profile.ecc:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        corrected = errorType == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
        if errorType not in (pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        volatile = gpu.ecc_corrected if corrected else gpu.ecc_uncorrected
        if counterType == pynvml.NVML_VOLATILE_ECC:
            return volatile
        if counterType == pynvml.NVML_AGGREGATE_ECC:
            return volatile + (gpu.ecc_aggregate_corrected if corrected else gpu.ecc_aggregate_uncorrected)
        raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceGetRemappedRows(self, device: SimHandle) -> tuple[int, int, int, int]:
        gpu = self._device(device, "nvmlDeviceGetRemappedRows")
        if not gpu.profile.remapped_rows:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu.remapped_rows

    def nvmlDeviceGetPersistenceMode(self, handle: SimHandle) -> int:
        return self._device(handle, "nvmlDeviceGetPersistenceMode").persistence_mode

    def nvmlDeviceGetComputeMode(self, handle: SimHandle) -> int:
        return self._device(handle, "nvmlDeviceGetComputeMode").compute_mode

    # --- InfoROM ---------------------------------------------------------------------------------
    def nvmlDeviceValidateInforom(self, handle: SimHandle) -> None:
        gpu = self._device(handle, "nvmlDeviceValidateInforom")
        if gpu.inforom_corrupt:
            raise _error(pynvml.NVML_ERROR_CORRUPTED_INFOROM)

    def nvmlDeviceGetInforomImageVersion(self, handle: SimHandle) -> str:
        return self._device(handle, "nvmlDeviceGetInforomImageVersion").inforom_image

    def nvmlDeviceGetInforomVersion(self, handle: SimHandle, infoRomObject: int) -> str:
        gpu = self._device(handle, "nvmlDeviceGetInforomVersion")
        if infoRomObject not in gpu.inforom_objects:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        version = gpu.inforom_objects[infoRomObject]
        if version == "N/A":
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return version

    # --- processes -------------------------------------------------------------------------------
    def _process_list(self, handle: SimHandle, fname: str, kind: str) -> list[SimProcessInfo]:
        gpu = self._device(handle, fname)
        t = gpu.t_last - gpu.t0
        return [SimProcessInfo(proc.pid, used) for proc, used in gpu.processes_at(t) if kind in proc.kind]

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle: SimHandle) -> list[SimProcessInfo]:
        return self._process_list(handle, "nvmlDeviceGetComputeRunningProcesses_v3", "compute")

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: SimHandle) -> list[SimProcessInfo]:
        return self._process_list(handle, "nvmlDeviceGetComputeRunningProcesses_v2", "compute")

    def nvmlDeviceGetComputeRunningProcesses(self, handle: SimHandle) -> list[SimProcessInfo]:
        """The binding's unversioned name calls the v3 C function."""
        return self._process_list(handle, "nvmlDeviceGetComputeRunningProcesses_v3", "compute")

    def nvmlDeviceGetGraphicsRunningProcesses_v3(self, handle: SimHandle) -> list[SimProcessInfo]:
        return self._process_list(handle, "nvmlDeviceGetGraphicsRunningProcesses_v3", "graphics")

    def nvmlDeviceGetGraphicsRunningProcesses_v2(self, handle: SimHandle) -> list[SimProcessInfo]:
        return self._process_list(handle, "nvmlDeviceGetGraphicsRunningProcesses_v2", "graphics")

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: SimHandle) -> list[SimProcessInfo]:
        return self._process_list(handle, "nvmlDeviceGetGraphicsRunningProcesses_v3", "graphics")

    def _utilization_samples(self, gpu: SimGpu, since_us: int) -> list[SimProcessUtilization]:
        """One sample per running process, its weight's share of the GPU's utilisation now. NotFound when there
        is none newer than ``since_us`` (NVML's answer to "no samples")."""
        now_us = int(self._clock() * 1_000_000)
        procs = gpu.processes_at(gpu.t_last - gpu.t0)
        if not procs or now_us <= since_us:
            raise _error(pynvml.NVML_ERROR_NOT_FOUND)
        total_w = sum(p.weight for p, _ in procs) or 1.0
        out = []
        for proc, _used in procs:
            share = proc.weight / total_w
            sm = round(100.0 * gpu.utilization * share)
            mem = round(100.0 * gpu.utilization_memory * share)
            out.append(SimProcessUtilization(proc.pid, now_us, sm, mem, 0, 0))
        return out

    def nvmlDeviceGetProcessUtilization(self, handle: SimHandle, timeStamp: int) -> list[SimProcessUtilization]:
        gpu = self._device(handle, "nvmlDeviceGetProcessUtilization")
        return self._utilization_samples(gpu, int(timeStamp))

    def nvmlDeviceGetProcessesUtilizationInfo(self, handle: SimHandle, timeStamp: int) -> list[SimProcessUtilization]:
        gpu = self._device(handle, "nvmlDeviceGetProcessesUtilizationInfo")
        return self._utilization_samples(gpu, int(timeStamp))

    def nvmlDeviceGetFieldValues(self, handle: SimHandle, fieldIds: Sequence[int]) -> Any:
        """Real ``c_nvmlFieldValue_t`` items, each with its own ``nvmlReturn`` (NotSupported per field)."""
        gpu = self._device(handle, "nvmlDeviceGetFieldValues")
        if self._cost is not None:
            self._charge(self._cost.field_batch([int(f) for f in fieldIds]))
        values = (pynvml.c_nvmlFieldValue_t * len(fieldIds))()
        ts_us = int(self._clock() * 1e6)
        for item, field_id in zip(values, fieldIds, strict=True):
            item.fieldId = field_id
            item.timestamp = ts_us
            if field_id in self._unknown_fields:
                item.nvmlReturn = pynvml.NVML_ERROR_INVALID_ARGUMENT
                continue
            value_type, value = self._field(gpu, field_id)
            if value_type < 0:
                item.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
                continue
            item.valueType = value_type
            if value_type == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT:
                item.value.uiVal = value
            elif value_type == pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG:
                item.value.ullVal = value
            else:
                item.value.siVal = value
        return values

    def _field(self, gpu: SimGpu, field_id: int) -> tuple[int, int]:
        uint = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
        prof = gpu.profile
        if field_id == pynvml.NVML_FI_DEV_ENERGY:
            return pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, int(gpu.energy_mj)
        if field_id == pynvml.NVML_FI_DEV_MEMORY_TEMP:
            return (uint, int(gpu.memory_temperature_c)) if prof.hbm else (-1, 0)
        if field_id == pynvml.NVML_FI_DEV_POWER_AVERAGE:
            return uint, round(gpu.power_avg_w * 1000)
        if field_id == pynvml.NVML_FI_DEV_POWER_INSTANT:
            return uint, round(gpu.power_w * 1000)
        limits = {
            pynvml.NVML_FI_DEV_POWER_MIN_LIMIT: round(prof.power_limit_min_w * 1000),
            pynvml.NVML_FI_DEV_POWER_MAX_LIMIT: round(prof.power_limit_max_w * 1000),
            pynvml.NVML_FI_DEV_POWER_DEFAULT_LIMIT: round(prof.power_limit_default_w * 1000),
            pynvml.NVML_FI_DEV_POWER_CURRENT_LIMIT: gpu.enforced_limit_mw,
            pynvml.NVML_FI_DEV_POWER_REQUESTED_LIMIT: gpu.power_limit_mw,
        }
        if field_id in limits:
            return uint, limits[field_id]
        tlimits = {
            pynvml.NVML_FI_DEV_TEMPERATURE_SHUTDOWN_TLIMIT: prof.shutdown_c,
            pynvml.NVML_FI_DEV_TEMPERATURE_SLOWDOWN_TLIMIT: prof.slowdown_c,
            pynvml.NVML_FI_DEV_TEMPERATURE_GPU_MAX_TLIMIT: prof.max_operating_c,
        }
        if field_id in tlimits:
            return pynvml.NVML_VALUE_TYPE_SIGNED_INT, tlimits[field_id]
        return -1, 0

    # ----------------------------------------------------------------------------------------------
    # pynvml surface: setters (root only)
    # ----------------------------------------------------------------------------------------------
    @staticmethod
    def _c_uint(value: Any) -> int:
        # ctypes.c_uint(x) refuses anything but an int, with a TypeError; do the same.
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"int expected instead of {type(value).__name__}")
        return value

    def nvmlDeviceSetPowerManagementLimit(self, handle: SimHandle, limit: int) -> None:
        gpu = self._setter(handle, "nvmlDeviceSetPowerManagementLimit")
        self._set_power_limit(gpu, self._c_uint(limit))

    def _set_power_limit(self, gpu: SimGpu, limit_mw: int) -> None:
        prof = gpu.profile
        if not round(prof.power_limit_min_w * 1000) <= limit_mw <= round(prof.power_limit_max_w * 1000):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        with self._lock:
            gpu.power_limit_mw = limit_mw

    def nvmlDeviceSetPowerManagementLimit_v2(
        self,
        device: SimHandle,
        powerScope: int,
        powerLimit: int,
        version: int = _POWER_VALUE_V2,
    ) -> int:
        """Reproduces the nvidia-ml-py 13.615.71 bug: the driver's error is ignored, the call always "succeeds"."""
        try:
            gpu = self._setter(device, "nvmlDeviceSetPowerManagementLimit_v2")
            self._set_power_limit(gpu, self._c_uint(powerLimit))
        except pynvml.NVMLError:
            pass
        return pynvml.NVML_SUCCESS

    def nvmlDeviceSetGpuLockedClocks(self, handle: SimHandle, minGpuClockMHz: int, maxGpuClockMHz: int) -> None:
        gpu = self._setter(handle, "nvmlDeviceSetGpuLockedClocks")
        lo, hi = self._c_uint(minGpuClockMHz), self._c_uint(maxGpuClockMHz)
        symbolic = (lo in _SYMBOLIC, hi in _SYMBOLIC)
        if symbolic == (True, True):
            tdp = gpu.profile.sm_max_mhz - 15 * round(gpu.profile.sm_max_mhz * 0.2 / 15)  # base clock (assumed)
            resolved = (
                gpu.profile.idle_sm_mhz if lo == _CLOCK_UNLIMITED else tdp,
                gpu.profile.sm_max_mhz if hi == _CLOCK_UNLIMITED else tdp,
            )
            with self._lock:
                gpu.locked_gpu_clocks = (
                    None if resolved == (gpu.profile.idle_sm_mhz, gpu.profile.sm_max_mhz) else resolved
                )
            return
        if any(symbolic) or lo > hi or lo not in gpu._graphics_set or hi not in gpu._graphics_set:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        with self._lock:
            gpu.locked_gpu_clocks = (lo, hi)

    def nvmlDeviceResetGpuLockedClocks(self, handle: SimHandle) -> None:
        gpu = self._setter(handle, "nvmlDeviceResetGpuLockedClocks")
        with self._lock:
            gpu.locked_gpu_clocks = None

    def nvmlDeviceSetMemoryLockedClocks(self, handle: SimHandle, minMemClockMHz: int, maxMemClockMHz: int) -> None:
        gpu = self._device(handle, "nvmlDeviceSetMemoryLockedClocks")
        if not gpu.profile.memory_locked_clocks:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not self._as_root:
            raise _error(pynvml.NVML_ERROR_NO_PERMISSION)
        lo, hi = self._c_uint(minMemClockMHz), self._c_uint(maxMemClockMHz)
        clocks = gpu.profile.memory_clocks_mhz
        if lo > hi or lo not in clocks or hi not in clocks:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        with self._lock:
            gpu.locked_memory_clocks = (lo, hi)

    def nvmlDeviceResetMemoryLockedClocks(self, handle: SimHandle) -> None:
        gpu = self._device(handle, "nvmlDeviceResetMemoryLockedClocks")
        if not gpu.profile.memory_locked_clocks:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not self._as_root:
            raise _error(pynvml.NVML_ERROR_NO_PERMISSION)
        with self._lock:
            gpu.locked_memory_clocks = None

    def nvmlDeviceSetPersistenceMode(self, handle: SimHandle, mode: int) -> None:
        gpu = self._setter(handle, "nvmlDeviceSetPersistenceMode")
        if self._c_uint(mode) not in (pynvml.NVML_FEATURE_DISABLED, pynvml.NVML_FEATURE_ENABLED):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        with self._lock:
            gpu.persistence_mode = mode

    def nvmlDeviceSetComputeMode(self, handle: SimHandle, mode: int) -> None:
        gpu = self._setter(handle, "nvmlDeviceSetComputeMode")
        valid = (
            pynvml.NVML_COMPUTEMODE_DEFAULT,
            pynvml.NVML_COMPUTEMODE_PROHIBITED,
            pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS,
        )
        if self._c_uint(mode) not in valid:
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        with self._lock:
            gpu.compute_mode = mode

    # ----------------------------------------------------------------------------------------------
    # pynvml surface: events
    # ----------------------------------------------------------------------------------------------
    def nvmlEventSetCreate(self) -> SimEventSet:
        self._system("nvmlEventSetCreate")
        es = SimEventSet(self._generation)
        with self._lock:
            self._event_sets.append(es)
        return es

    def nvmlDeviceGetSupportedEventTypes(self, handle: SimHandle) -> int:
        gpu = self._device(handle, "nvmlDeviceGetSupportedEventTypes")
        return _EV_XID | _EV_PSTATE | _EV_CLOCK | ((_EV_SBE | _EV_DBE) if gpu.profile.ecc else 0)

    def nvmlDeviceRegisterEvents(self, handle: SimHandle, eventTypes: int, eventSet: SimEventSet) -> None:
        gpu = self._device(handle, "nvmlDeviceRegisterEvents")
        supported = _EV_XID | _EV_PSTATE | _EV_CLOCK | ((_EV_SBE | _EV_DBE) if gpu.profile.ecc else 0)
        if eventSet.freed or eventSet.generation != self._generation:
            raise _error(pynvml.NVML_ERROR_UNINITIALIZED)
        if eventTypes & ~supported:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        with self._lock:
            eventSet.registrations[gpu.uuid] = eventSet.registrations.get(gpu.uuid, 0) | eventTypes

    def nvmlEventSetWait(self, eventSet: SimEventSet, timeoutms: int) -> SimEventData:
        """Returns the oldest queued event; raises Timeout at once when none is queued (no real wait)."""
        self._system("nvmlEventSetWait")
        if eventSet.freed or eventSet.generation != self._generation:
            raise _error(pynvml.NVML_ERROR_UNINITIALIZED)
        with self._lock:
            for gpu in self._gpus:
                if gpu.advance(self._clock()):
                    self._fall_off(gpu)
        with self._lock:
            if eventSet.queue:
                return eventSet.queue.popleft()
        raise _error(pynvml.NVML_ERROR_TIMEOUT)

    def nvmlEventSetFree(self, eventSet: SimEventSet) -> None:
        self._system("nvmlEventSetFree", needs_init=False)
        with self._lock:
            eventSet.freed = True
            if eventSet in self._event_sets:
                self._event_sets.remove(eventSet)

    # ==============================================================================================
    # Control surface for tests and demos (not pynvml names)
    # ==============================================================================================
    @property
    def gpus(self) -> list[SimGpu]:
        """The simulated GPUs in index order (``.uuid``, ``.profile``, ``.temperature_c``, ``.power_w`` ...)."""
        return list(self._gpus)

    def gpu(self, uuid: str) -> SimGpu:
        """A simulated GPU by UUID, brought up to the clock's time."""
        gpu = self._by_uuid.get(uuid)
        if gpu is None:
            raise KeyError(f"no simulated GPU {uuid}; GPUs: {', '.join(self._by_uuid)}")
        with self._lock:
            if gpu.advance(self._clock()):
                self._fall_off(gpu)
        return gpu

    def _targets(self, uuid: str | None) -> list[SimGpu]:
        # bring the GPUs up to now first, so a change applies from now on, not from their last read
        if uuid is None:
            return [self.gpu(g.uuid) for g in self._gpus]
        return [self.gpu(uuid)]

    def set_scenario(self, uuid: str | None, name: str) -> None:
        """Drive utilisation from a scenario (``SCENARIOS``); ``uuid=None`` means every GPU. Clears set_utilization."""
        if name not in SCENARIOS:
            raise ValueError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")
        for gpu in self._targets(uuid):
            gpu.scenario = name
            gpu.utilization_override = None

    def set_utilization(self, uuid: str | None, percent: float | None) -> None:
        """Hold utilisation at ``percent`` (0..100); ``None`` gives control back to the scenario."""
        if percent is not None and not 0 <= percent <= 100:
            raise ValueError(f"utilization must be within 0..100 percent, got {percent}")
        for gpu in self._targets(uuid):
            gpu.utilization_override = None if percent is None else percent / 100.0

    def start_process(
        self,
        uuid: str,
        pid: int,
        memory_bytes: int,
        *,
        weight: float = 1.0,
        kind: str = "compute",
        growth_bytes_per_s: float = 0.0,
        sawtooth_bytes: int = 0,
        sawtooth_period_s: float = 0.0,
        name: str = "python3",
        pod: tuple[str, str, str] | None = None,
    ) -> SimProcess:
        """Start a process on GPU ``uuid`` from now on (beside the scenario's own processes): its memory (which
        may grow or saw), its weight in the GPU's utilisation. Raises ValueError for a pid already running."""
        (gpu,) = self._targets(uuid)
        with self._lock:
            if pid in gpu.extra_processes or any(p.pid == pid for p, _ in gpu.processes_at(gpu.t_last - gpu.t0)):
                raise ValueError(f"pid {pid} already runs on GPU {uuid}")
            proc = SimProcess(
                pid,
                memory_bytes=memory_bytes,
                weight=weight,
                kind=kind,
                growth_bytes_per_s=growth_bytes_per_s,
                sawtooth_bytes=sawtooth_bytes,
                sawtooth_period_s=sawtooth_period_s,
                started_s=gpu.t_last - gpu.t0,
                name=name,
                pod=pod,
            )
            gpu.extra_processes[pid] = proc
            if self._pods is not None:
                self._pods.write(proc)
            return proc

    def stop_process(self, uuid: str, pid: int) -> None:
        """End a process started with ``start_process``; KeyError if it is not running."""
        (gpu,) = self._targets(uuid)
        with self._lock:
            if pid not in gpu.extra_processes:
                raise KeyError(f"pid {pid} is not a started process of GPU {uuid}")
            del gpu.extra_processes[pid]
            if self._pods is not None:
                self._pods.remove(pid)

    def set_scenario_processes(self, uuid: str | None, enabled: bool) -> None:
        """Whether the scenario runs its own processes (one trainer, two inference servers ...); off leaves only
        the processes of ``start_process``."""
        for gpu in self._targets(uuid):
            gpu.scenario_processes = enabled

    def set_ambient_c(self, uuid: str | None, celsius: float | None) -> None:
        """The temperature the GPU settles at with no power; ``None`` restores the profile's value."""
        for gpu in self._targets(uuid):
            gpu.ambient_override_c = celsius

    def set_cooling(self, uuid: str | None, factor: float | None) -> None:
        """Multiply the thermal resistance (2.0 = half as good cooling); ``None`` restores the scenario's."""
        if factor is not None and factor <= 0:
            raise ValueError(f"cooling factor must be > 0, got {factor}")
        for gpu in self._targets(uuid):
            gpu.cooling_override = factor

    def set_external_power_limit_w(self, uuid: str, watts: float | None) -> None:
        """An out-of-band limiter (enforced limit = min(requested, this)); ``None`` removes it."""
        self.gpu(uuid).external_limit_w = watts

    def driver_reload(
        self, *, first_call_delay_s: float = 0.0, recover_lost: bool = False, driver_version: str | None = None
    ) -> None:
        """Simulate a driver reload: every setting back to default, energy counters to 0, NVML uninitialised
        (old handles and event sets raise Uninitialized), volatile ECC counters cleared. With
        ``first_call_delay_s`` the first call afterwards (normally nvmlInit) takes that long, as without
        persistence mode. Lost GPUs stay lost unless ``recover_lost`` (a reboot). With ``driver_version`` the
        reload brings that driver (an upgrade or a downgrade): its functions and field ids from then on (a
        ``SimHost``'s kernel module version is the test's to change, ``set_kernel_module_version``)."""
        now = self._clock()
        with self._lock:
            if driver_version is not None:
                self._set_driver_version(driver_version)
            for gpu in self._gpus:
                gpu.advance(now)
                gpu.reset_settings()
                gpu.energy_mj = 0.0
                gpu.ecc_aggregate_corrected += gpu.ecc_corrected
                gpu.ecc_aggregate_uncorrected += gpu.ecc_uncorrected
                gpu.ecc_corrected = gpu.ecc_uncorrected = 0
                gpu.probe_faults = [f for f in gpu.probe_faults if not f[2]]
                if recover_lost and gpu.lost:
                    gpu.lost = False
                    gpu._reset_physics(now)
            self._generation += 1
            self._handles = {g.uuid: SimHandle(g, self._generation) for g in self._gpus}
            self._init_count = 0
            for es in self._event_sets:
                es.freed = True
            self._event_sets.clear()
            self._first_call_delay_s = first_call_delay_s

    def _set_driver_version(self, driver_version: str) -> None:
        """The simulated driver's version, and what it lacks by its branch (``_MIN_DRIVER_MAJOR``, fields)."""
        major = int(driver_version.split(".", 1)[0])
        self._driver_version = driver_version
        self._missing = frozenset(f for f, m in _MIN_DRIVER_MAJOR.items() if major < m)
        self._unknown_fields = frozenset(f for f, m in _FIELD_MIN_DRIVER_MAJOR.items() if major < m)

    def inject_gpu_lost(self, uuid: str) -> None:
        """The GPU falls off the bus: every call on it raises GpuIsLost; an XID 79 event is queued."""
        gpu = self.gpu(uuid)
        with self._lock:
            self._fall_off(gpu)

    def reset_gpu(self, uuid: str) -> None:
        """A GPU reset (``nvidia-smi -r``) of one GPU: its settings back to default, its energy and volatile ECC
        counters to 0, probe faults injected ``until_reset`` cleared, a driver-reload-like restart of its state.
        NVML stays initialised (other GPUs are untouched). A GPU that fell off the bus stays lost (XID 79 needs a
        reboot: ``driver_reload(recover_lost=True)``)."""
        gpu = self.gpu(uuid)
        with self._lock:
            if gpu.lost:
                raise _error(pynvml.NVML_ERROR_GPU_IS_LOST)
            gpu.reset_settings()
            gpu.energy_mj = 0.0
            gpu.ecc_aggregate_corrected += gpu.ecc_corrected
            gpu.ecc_aggregate_uncorrected += gpu.ecc_uncorrected
            gpu.ecc_corrected = gpu.ecc_uncorrected = 0
            gpu.probe_faults = [f for f in gpu.probe_faults if not f[2]]
            gpu.resets += 1

    def inject_inforom_corrupt(self, uuid: str, corrupt: bool = True) -> None:
        """``nvmlDeviceValidateInforom`` raises CorruptedInforom on this GPU (False: validates again)."""
        self.gpu(uuid).inforom_corrupt = corrupt

    def inject_probe_fault(
        self, uuid: str, kind: str, *, count: int | None = None, until_reset: bool = False, seconds: float = 0.0
    ) -> None:
        """The next ``count`` probes (None: every one) of ``SimCudaProbe`` on this GPU fail as ``kind``: ``hang``
        (the probe never answers; its runner kills it at the timeout), ``context`` (cuCtxCreate fails), ``alloc``
        (cuMemAlloc fails), ``copy`` (the copy reads back wrong bytes) or ``slow`` (it passes after ``seconds``).
        ``until_reset``: the fault lasts until ``reset_gpu`` or a driver reload."""
        if kind not in PROBE_FAULTS:
            raise ValueError(f"unknown probe fault {kind!r}; known: {', '.join(PROBE_FAULTS)}")
        if count is not None and count < 1:
            raise ValueError(f"count must be >= 1 or None, got {count}")
        with self._lock:
            self.gpu(uuid).probe_faults.append([kind, count, until_reset, seconds])

    def take_probe_fault(self, uuid: str) -> tuple[str, float] | None:
        """The probe fault the next probe of ``uuid`` meets (kind, seconds), counted down; None for none."""
        gpu = self.gpu(uuid)
        with self._lock:
            for fault in gpu.probe_faults:
                kind, remaining, _, seconds = fault
                if remaining is None or remaining > 0:
                    if remaining is not None:
                        fault[1] = remaining - 1
                    return kind, seconds
        return None

    def inject_xid(self, uuid: str, xid: int) -> None:
        """Queue an XID critical-error event for the GPU (seen by event sets registered for XIDs)."""
        with self._lock:
            self._emit(self.gpu(uuid), _EV_XID, xid)

    def inject_ecc(self, uuid: str, *, corrected: int = 0, uncorrected: int = 0) -> None:
        """Add ECC errors to the volatile counters and queue single/double-bit ECC events."""
        gpu = self.gpu(uuid)
        with self._lock:
            gpu.ecc_corrected += corrected
            gpu.ecc_uncorrected += uncorrected
            for _ in range(corrected):
                self._emit(gpu, _EV_SBE, 0)
            for _ in range(uncorrected):
                self._emit(gpu, _EV_DBE, 0)

    def inject_errors(self, function_name: str, code: int, count: int = 1, *, uuid: str | None = None) -> None:
        """The next ``count`` calls of ``function_name`` (a pynvml name, or ``*`` for any) raise NVMLError(code);
        with ``uuid`` only calls on that GPU do."""
        if function_name not in ("*", "reset_gpu") and not hasattr(self, function_name):
            raise ValueError(f"{function_name!r} is not a function of the simulated NVML")
        pynvml.nvmlExceptionClass(code)  # a clear KeyError for an unknown code, now rather than later
        with self._lock:
            self._faults.setdefault(function_name, []).append([code, count, uuid])

    def set_call_delay_s(self, seconds: float, function_name: str | None = None) -> None:
        """Every call (or every call of ``function_name``) takes ``seconds`` longer (a real sleep); 0 clears."""
        key = function_name or "*"
        with self._lock:
            if seconds > 0:
                self._delays[key] = seconds
            else:
                self._delays.pop(key, None)

    def set_cost(self, cost: str | CostProfile) -> None:
        """What calls cost from now on: a ``COST_PROFILES`` name (``none``, ``h200``) or a ``CostProfile``."""
        prof = cost_profile(cost)
        self._cost = None if prof.free else prof

    @property
    def cost_profile(self) -> str:
        """The name of the cost profile in force (``none`` when calls are free)."""
        return self._cost.name if self._cost is not None else "none"

    def _charge(self, cost: CallCost) -> None:
        if cost is FREE:
            return
        if cost.cpu_s > 0:
            burn_cpu(cost.cpu_s)
            self.charged_cpu_s += cost.cpu_s
        if cost.block_s > 0:
            self._sleep(cost.block_s)
            self.charged_block_s += cost.block_s

    def set_as_root(self, as_root: bool) -> None:
        """False: every setter raises NoPermission, as for a non-root process."""
        self._as_root = as_root

    @property
    def initialized(self) -> bool:
        return self._init_count > 0

    def pod_tree(self, root: Path) -> Path:
        """Write the processes' host tree under ``root`` (``SimPods``: ``<root>/proc`` and the kubelet's files
        below ``root``) and keep it up to date as processes start and stop; the root."""
        pods = SimPods(self, root)
        with self._lock:
            pods.populate()
            self._pods = pods
        return root

    def health_tools(self, host_root: Path) -> HealthTools:
        """The simulated node's health parts (``sim_health_tools``): the composition root takes them from here, as
        it does ``pod_tree`` (both: ``mapper.edge.backends.SimulatedNode``)."""
        return sim_health_tools(self, host_root)


class SimCudaProbe:
    """The level-3 probe over simulated GPUs: the interface of ``mapper.edge.gpu.cudaprobe.CudaProbe`` (``probe(uuid,
    pci_bus_id, timeout_s)``), answered by the simulator with its injected faults. A ``hang`` waits out the
    timeout (a real wait through the simulator's ``sleep``, as the real probe's runner waits before it kills the
    process); a lost GPU fails at ``cuInit`` as libcuda does (CUDA_ERROR_NO_DEVICE)."""

    #: What a pass takes (s); the real probe's process start and context creation take far longer (assumed).
    PASS_LATENCY_S = 0.08

    def __init__(self, sim: SimNvml) -> None:
        self._sim = sim
        #: Probes run, by UUID.
        self.runs: Counter[str] = Counter()

    def probe(self, uuid: str, pci_bus_id: str, timeout_s: float) -> ProbeResult:
        sim = self._sim
        self.runs[uuid] += 1
        try:
            gpu = sim.gpu(uuid)
        except KeyError:
            return ProbeResult("fail", "cuDeviceGetByPCIBusId-CUDA_ERROR_INVALID_DEVICE", 0.0)
        if pci_bus_id and pci_bus_id.upper() not in (gpu.pci.busId.upper(), gpu.pci.busIdLegacy.upper()):
            return ProbeResult("fail", "cuDeviceGetByPCIBusId-CUDA_ERROR_INVALID_DEVICE", 0.0)
        if gpu.lost:
            return ProbeResult("fail", "cuInit-CUDA_ERROR_NO_DEVICE", 0.01)
        fault = sim.take_probe_fault(uuid)
        if fault is None:
            return ProbeResult("pass", "", self.PASS_LATENCY_S)
        kind, seconds = fault
        if kind == "hang":
            sim._sleep(timeout_s)
            return ProbeResult("timeout", f"after-{format_number(timeout_s)}s", timeout_s)
        if kind == "slow":
            if seconds >= timeout_s:
                sim._sleep(timeout_s)
                return ProbeResult("timeout", f"after-{format_number(timeout_s)}s", timeout_s)
            sim._sleep(seconds)
            return ProbeResult("pass", "", seconds)
        reason = {
            "context": "cuCtxCreate-CUDA_ERROR_UNKNOWN",
            "alloc": "cuMemAlloc-CUDA_ERROR_OUT_OF_MEMORY",
            "copy": "cuMemcpyDtoH-data-mismatch",
        }[kind]
        return ProbeResult("fail", reason, 0.05)


class SimHost:
    """The driver's traces on a simulated host, as files under ``root``: the device nodes (``dev/nvidiactl``,
    ``dev/nvidia-uvm``, ``dev/nvidia<N>``), the kernel module's version (``proc/driver/nvidia/version``, the
    driver's own format) and ``nvidia-persistenced``'s socket. ``mapper.edge.health.driverhost`` reads them as it reads
    ``/``. The fault methods change the files."""

    def __init__(self, sim: SimNvml, root: Path) -> None:
        self.sim = sim
        self.root = root

    def populate(self, *, persistenced: bool = True) -> Path:
        """Write the tree (again); the root."""
        dev = self.root / "dev"
        dev.mkdir(parents=True, exist_ok=True)
        for name in ("nvidiactl", "nvidia-uvm", *(f"nvidia{g.index}" for g in self.sim.gpus)):
            (dev / name).touch()
        self.set_kernel_module_version(self.sim._driver_version)
        if persistenced:
            self.start_persistenced()
        return self.root

    def set_kernel_module_version(self, version: str) -> None:
        """The loaded kernel module's version (a driver upgraded without a reload leaves NVML's library newer)."""
        folder = self.root / "proc" / "driver" / "nvidia"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "version").write_text(
            f"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {version}  Release Build  "
            "(dvs-builder@U22-I3-AF03-09-1)  Sun Nov 30 00:00:00 UTC 2025\n"
            "GCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1~22.04)\n"
        )

    def remove_device_node(self, name: str) -> None:
        (self.root / "dev" / name).unlink(missing_ok=True)

    def start_persistenced(self) -> None:
        folder = self.root / "var" / "run" / "nvidia-persistenced"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "socket").touch()

    def stop_persistenced(self) -> None:
        (self.root / "var" / "run" / "nvidia-persistenced" / "socket").unlink(missing_ok=True)


class SimPods:
    """The simulated processes as a host with ``hostPID`` shows them to the mapper, as files under ``root``:

    * ``proc/<pid>/cgroup``, the cgroup v2 line of a container that containerd runs under the kubelet's systemd
      driver, ``0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid_>.slice/cri-containerd-
      <id>.scope``, and ``proc/<pid>/comm``;
    * the kubelet's files that name the pods: ``var/log/containers/<pod>_<namespace>_<container>-<id>.log`` and
      ``var/log/pods/<namespace>_<pod>_<uid>/<container>/0.log`` (empty).

    ``mapper.edge.processes.workloads.PodResolver`` reads them with ``proc_root=<root>/proc`` and
    ``PodDirs.under(root)``. Pod UIDs and container ids are derived from the names (the same on every run). Every pid a
    scenario can run has its entry (``scenario_pod``), whether it runs now or not, so a change of scenario needs no
    rewrite; a process of ``start_process`` gets its own: in its ``pod`` where it has one, else a host process
    (``0::/system.slice/<name>.service``). ``stop_process`` removes it.
    """

    def __init__(self, sim: SimNvml, root: Path) -> None:
        self.sim = sim
        self.root = root

    @property
    def proc_root(self) -> Path:
        return self.root / "proc"

    @staticmethod
    def pod_uid(namespace: str, pod: str) -> str:
        return str(uuidlib.uuid5(uuidlib.NAMESPACE_URL, f"gpu-mapper-sim:{namespace}/{pod}"))

    @staticmethod
    def container_id(namespace: str, pod: str, container: str) -> str:
        return hashlib.sha256(f"gpu-mapper-sim:{namespace}/{pod}/{container}".encode()).hexdigest()

    def populate(self) -> Path:
        """Write the tree (again): every scenario pid of every GPU and every started process; the root."""
        for gpu in self.sim.gpus:
            for slot in range(_SCENARIO_SLOTS):
                self._write(scenario_pid(gpu.index, slot), "python3", scenario_pod(gpu.index, slot))
            for proc in gpu.extra_processes.values():
                self.write(proc)
        return self.root

    def write(self, proc: SimProcess) -> None:
        """The entry of one process (and its pod's files)."""
        self._write(proc.pid, proc.name, proc.pod)

    def remove(self, pid: int) -> None:
        """A process ended: its ``proc/<pid>`` goes (a scenario pid gets its scenario entry back)."""
        shutil.rmtree(self.proc_root / str(pid), ignore_errors=True)
        for gpu in self.sim.gpus:
            for slot in range(_SCENARIO_SLOTS):
                if scenario_pid(gpu.index, slot) == pid:
                    self._write(pid, "python3", scenario_pod(gpu.index, slot))

    def _write(self, pid: int, name: str, pod: tuple[str, str, str] | None) -> None:
        folder = self.proc_root / str(pid)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "comm").write_text(name + "\n")
        if pod is None:
            (folder / "cgroup").write_text(f"0::/system.slice/{name}.service\n")
            return
        namespace, pod_name, container = pod
        uid = self.pod_uid(namespace, pod_name)
        cid = self.container_id(namespace, pod_name, container)
        slice_uid = uid.replace("-", "_")
        (folder / "cgroup").write_text(
            f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{slice_uid}.slice/"
            f"cri-containerd-{cid}.scope\n"
        )
        logs = self.root / "var" / "log"
        pod_logs = logs / "pods" / f"{namespace}_{pod_name}_{uid}" / container
        pod_logs.mkdir(parents=True, exist_ok=True)
        (pod_logs / "0.log").touch()
        links = logs / "containers"
        links.mkdir(parents=True, exist_ok=True)
        (links / f"{pod_name}_{namespace}_{container}-{cid}.log").touch()


class SimTools:
    """``nvidia-smi -q`` / ``-r`` over the simulator: the self-check fails for a lost GPU, the reset is
    ``SimNvml.reset_gpu`` (an injected NVML error on ``reset_gpu`` refuses it, as a busy GPU does)."""

    def __init__(self, sim: SimNvml) -> None:
        self._sim = sim
        self.resets: list[str] = []

    def self_check(self, uuid: str, timeout_s: float) -> list[SelfCheckResult]:
        try:
            gpu = self._sim.gpu(uuid)
        except KeyError:
            return [SelfCheckResult("nvidia-smi-q", False, "no-such-gpu")]
        if gpu.lost:
            return [SelfCheckResult("nvidia-smi-q", False, "gpu-is-lost")]
        return [SelfCheckResult("nvidia-smi-q", True)]

    def reset(self, uuid: str, timeout_s: float) -> None:
        try:
            self._sim._fault("reset_gpu", uuid)
            self._sim.reset_gpu(uuid)
        except pynvml.NVMLError as exc:
            raise PermanentError(f"GPU {uuid}: nvidia-smi -r failed: {exc}") from None
        self.resets.append(uuid)


def sim_health_tools(sim: SimNvml, host_root: Path) -> HealthTools:
    """The simulated node's health parts: ``SimCudaProbe``, a ``SimHost`` tree written under ``host_root``,
    ``SimTools``."""
    return HealthTools(probe=SimCudaProbe(sim), host_root=SimHost(sim, host_root).populate(), tools=SimTools(sim))


class _NotInBinding:
    """A simulated function the installed binding does not have (nvmlDeviceGetTemperatureV before
    nvidia-ml-py 12.550): reading it raises AttributeError, as ``pynvml.<name>`` would, so ``getattr(sim, name,
    None)`` and ``hasattr`` answer as they do for the binding."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: object, owner: type | None = None) -> Any:
        raise AttributeError(f"{self.name}: not in this nvidia-ml-py (pynvml {_binding_version()})")


def _binding_version() -> str:
    try:
        from importlib.metadata import version

        return version("nvidia-ml-py")
    except Exception:  # not installed as a distribution (a copy on sys.path)
        return "of unknown version"


def _hide(name: str) -> None:
    hidden = _NotInBinding()
    setattr(SimNvml, name, hidden)
    hidden.__set_name__(SimNvml, name)


for _name, _value in _copy_binding_constants().items():
    if not hasattr(SimNvml, _name):
        setattr(SimNvml, _name, _value)
for _name in [n for n in vars(SimNvml) if n.startswith("nvml") and callable(vars(SimNvml)[n])]:
    if not hasattr(pynvml, _name):
        _hide(_name)
del _name, _value
