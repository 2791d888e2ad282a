"""GPU profiles for the simulated NVML: the figures of shared/docs/nvml-facts.md section 12.

Measured values come from real ``nvidia-smi`` captures; values marked ``(assumed)`` in a comment have no
measurement behind them. Thermal constants are fitted so that idle and load temperatures match the captures
(first-order model ``T = ambient + P * R`` at steady state).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

# NVML architecture codes (pynvml.NVML_DEVICE_ARCH_*), repeated here so profiles stay plain data.
ARCH_TURING = 6
ARCH_AMPERE = 7
ARCH_ADA = 8
ARCH_HOPPER = 9
#: nvml.h's code (newer than the oldest binding we allow, so not in ``ARCH_NAMES``).
ARCH_BLACKWELL = 10

ARCH_NAMES: Mapping[int, str] = MappingProxyType(
    {ARCH_TURING: "turing", ARCH_AMPERE: "ampere", ARCH_ADA: "ada", ARCH_HOPPER: "hopper"}
)

_MIB = 1024 * 1024


@dataclass(frozen=True)
class GpuProfile:
    """One GPU product as the simulator plays it."""

    key: str
    name: str
    architecture: int
    memory_total_bytes: int
    idle_power_w: float
    #: Board power at 100 % utilisation and the highest SM clock, before any cap.
    load_power_w: float
    idle_pstate: int
    idle_sm_mhz: int
    sm_max_mhz: int
    #: Supported memory clocks, highest first (HBM parts have one).
    memory_clocks_mhz: tuple[int, ...]
    power_limit_min_w: float
    power_limit_default_w: float
    power_limit_max_w: float
    shutdown_c: int
    slowdown_c: int
    max_operating_c: int
    #: HBM maximum temperature; ``None`` means no memory temperature sensor (GDDR parts).
    memory_max_c: int | None
    idle_temp_c: float
    #: Thermal resistance to the air, in degrees Celsius per watt.
    thermal_r_c_per_w: float
    #: First-order thermal time constant (die plus heatsink).
    thermal_tau_s: float
    #: Ampere and newer (except GA100) report a 1 s averaged power; older parts an instantaneous one.
    power_averaged: bool
    has_fan: bool = False
    memory_locked_clocks: bool = True
    remapped_rows: bool = True
    ecc: bool = True
    #: PCIe throughput at full transfer load, KB/s (one direction).
    pcie_max_kbs: int = 25_000_000
    #: Share of the framebuffer a full training workload occupies.
    memory_busy_fraction: float = 0.85
    #: pynvml functions that answer NotSupported on this GPU whatever the arguments (the NVML of a Jetson board,
    #: ``TEGRA_PROFILES``); empty for the datacenter and workstation cards.
    not_supported: frozenset[str] = frozenset()

    @property
    def memory_reserved_bytes(self) -> int:
        """Framebuffer the driver keeps for itself (v2 ``reserved``; v1 counts it in ``used``): about 0.65 % of
        the total, i.e. a few hundred MiB on a 40-80 GB part (assumed)."""
        return int(self.memory_total_bytes * 0.0065) // _MIB * _MIB

    @property
    def hbm(self) -> bool:
        return self.memory_max_c is not None

    @property
    def ambient_c(self) -> float:
        """The temperature the GPU would settle at with no power: idle temperature minus idle heating."""
        return self.idle_temp_c - self.idle_power_w * self.thermal_r_c_per_w

    def graphics_clocks_mhz(self) -> tuple[int, ...]:
        """Supported graphics clocks, highest first: 15 MHz steps from the maximum down to the idle floor."""
        clocks = list(range(self.sm_max_mhz, self.idle_sm_mhz, -15))
        clocks.append(self.idle_sm_mhz)
        return tuple(clocks)


def _thermal(idle_temp_c: float, idle_w: float, load_temp_c: float, load_w: float) -> float:
    return (load_temp_c - idle_temp_c) / (load_w - idle_w)


PROFILES: Mapping[str, GpuProfile] = MappingProxyType(
    {
        p.key: p
        for p in (
            GpuProfile(
                key="H100",
                name="NVIDIA H100 80GB HBM3",
                architecture=ARCH_HOPPER,
                memory_total_bytes=81_559 * _MIB,
                idle_power_w=72.0,
                load_power_w=690.0,
                idle_pstate=0,
                idle_sm_mhz=345,
                sm_max_mhz=1980,
                memory_clocks_mhz=(2619,),
                power_limit_min_w=200.0,
                power_limit_default_w=700.0,
                power_limit_max_w=700.0,
                shutdown_c=92,
                slowdown_c=89,
                max_operating_c=87,
                memory_max_c=95,
                idle_temp_c=41.0,
                thermal_r_c_per_w=_thermal(41, 72, 59, 632),
                thermal_tau_s=30.0,
                power_averaged=True,
                pcie_max_kbs=50_000_000,
            ),
            GpuProfile(
                key="H200",
                name="NVIDIA H200",
                architecture=ARCH_HOPPER,
                memory_total_bytes=143_771 * _MIB,
                idle_power_w=78.0,
                load_power_w=690.0,
                idle_pstate=0,
                idle_sm_mhz=345,
                sm_max_mhz=1980,
                memory_clocks_mhz=(3201,),
                power_limit_min_w=200.0,
                power_limit_default_w=700.0,
                power_limit_max_w=700.0,
                shutdown_c=92,  # (assumed: H100 values)
                slowdown_c=89,
                max_operating_c=87,
                memory_max_c=95,  # (assumed)
                idle_temp_c=28.0,
                thermal_r_c_per_w=_thermal(28, 78, 52, 627),
                thermal_tau_s=30.0,
                power_averaged=True,
                pcie_max_kbs=50_000_000,
            ),
            GpuProfile(
                key="A100",
                name="NVIDIA A100-SXM4-80GB",
                architecture=ARCH_AMPERE,
                memory_total_bytes=81_920 * _MIB,
                idle_power_w=59.0,
                load_power_w=480.0,
                idle_pstate=0,
                idle_sm_mhz=210,
                sm_max_mhz=1410,
                memory_clocks_mhz=(1593,),
                power_limit_min_w=100.0,
                power_limit_default_w=500.0,
                power_limit_max_w=500.0,
                shutdown_c=92,
                slowdown_c=89,
                max_operating_c=85,
                memory_max_c=95,
                idle_temp_c=24.0,
                thermal_r_c_per_w=0.05,  # (assumed) load near 45 C in an SXM chassis
                thermal_tau_s=30.0,
                power_averaged=False,  # GA100: instantaneous
            ),
            GpuProfile(
                key="A100-PCIE",
                name="NVIDIA A100 80GB PCIe",
                architecture=ARCH_AMPERE,
                memory_total_bytes=81_920 * _MIB,
                idle_power_w=45.0,  # (assumed; 65 W was measured at 1410 MHz)
                load_power_w=295.0,
                idle_pstate=0,
                idle_sm_mhz=210,
                sm_max_mhz=1410,
                memory_clocks_mhz=(1512,),
                power_limit_min_w=150.0,
                power_limit_default_w=300.0,
                power_limit_max_w=300.0,
                shutdown_c=92,
                slowdown_c=89,
                max_operating_c=85,
                memory_max_c=95,
                idle_temp_c=30.0,  # (assumed)
                thermal_r_c_per_w=_thermal(30, 45, 72, 295),  # passive card: full load near 72 C (assumed)
                thermal_tau_s=60.0,
                power_averaged=False,
            ),
            GpuProfile(
                key="A10",
                name="NVIDIA A10",
                architecture=ARCH_AMPERE,
                memory_total_bytes=23_028 * _MIB,
                idle_power_w=21.0,
                load_power_w=160.0,
                idle_pstate=8,
                idle_sm_mhz=210,
                sm_max_mhz=1695,
                memory_clocks_mhz=(6251, 405),
                power_limit_min_w=100.0,
                power_limit_default_w=150.0,
                power_limit_max_w=150.0,
                shutdown_c=101,
                slowdown_c=98,
                max_operating_c=91,
                memory_max_c=None,
                idle_temp_c=32.0,
                thermal_r_c_per_w=_thermal(32, 21, 75, 150),  # (assumed) passive: full load near 75 C
                thermal_tau_s=60.0,
                power_averaged=True,
                pcie_max_kbs=25_000_000,
                memory_busy_fraction=0.7,
            ),
            GpuProfile(
                key="L4",
                name="NVIDIA L4",
                architecture=ARCH_ADA,
                memory_total_bytes=23_034 * _MIB,
                idle_power_w=16.5,
                load_power_w=75.0,
                idle_pstate=8,
                idle_sm_mhz=210,
                sm_max_mhz=2040,
                memory_clocks_mhz=(6251, 405),
                power_limit_min_w=40.0,
                power_limit_default_w=72.0,
                power_limit_max_w=72.0,
                shutdown_c=101,  # (assumed: A10 values)
                slowdown_c=98,
                max_operating_c=91,
                memory_max_c=None,
                idle_temp_c=33.0,
                thermal_r_c_per_w=_thermal(33, 16.5, 75, 72),  # (assumed)
                thermal_tau_s=60.0,
                power_averaged=True,
                pcie_max_kbs=25_000_000,
                memory_busy_fraction=0.6,
            ),
            GpuProfile(
                key="T4",
                name="Tesla T4",
                architecture=ARCH_TURING,
                memory_total_bytes=15_360 * _MIB,
                idle_power_w=14.0,
                load_power_w=75.0,
                idle_pstate=8,
                idle_sm_mhz=300,
                sm_max_mhz=1590,
                memory_clocks_mhz=(5001, 405),
                power_limit_min_w=60.0,
                power_limit_default_w=70.0,
                power_limit_max_w=70.0,
                shutdown_c=96,
                slowdown_c=93,
                max_operating_c=85,
                memory_max_c=None,
                idle_temp_c=38.0,
                thermal_r_c_per_w=_thermal(38, 14, 75, 70),  # (assumed)
                thermal_tau_s=60.0,
                power_averaged=False,  # Turing: instantaneous
                memory_locked_clocks=False,  # Ampere+ only
                remapped_rows=False,  # Ampere+ only
                pcie_max_kbs=12_000_000,
                memory_busy_fraction=0.6,
            ),
            GpuProfile(
                key="L40S",
                name="NVIDIA L40S",
                architecture=ARCH_ADA,
                memory_total_bytes=46_068 * _MIB,
                idle_power_w=35.0,  # (assumed)
                load_power_w=340.0,
                idle_pstate=8,
                idle_sm_mhz=210,
                sm_max_mhz=2520,
                memory_clocks_mhz=(9001, 405),
                power_limit_min_w=100.0,
                power_limit_default_w=350.0,
                power_limit_max_w=350.0,
                shutdown_c=101,  # (assumed: A10 values)
                slowdown_c=98,
                max_operating_c=91,
                memory_max_c=None,
                idle_temp_c=30.0,  # (assumed)
                thermal_r_c_per_w=_thermal(30, 35, 75, 350),  # (assumed)
                thermal_tau_s=60.0,
                power_averaged=True,
                pcie_max_kbs=25_000_000,
            ),
            GpuProfile(
                # A workstation card with a fan and no ECC, so the simulator also covers fan_speed (assumed figures
                # apart from the 150-400 W limit range captured on a real card).
                key="RTX4080S",
                name="NVIDIA GeForce RTX 4080 SUPER",
                architecture=ARCH_ADA,
                memory_total_bytes=16_376 * _MIB,
                idle_power_w=15.0,
                load_power_w=310.0,
                idle_pstate=8,
                idle_sm_mhz=210,
                sm_max_mhz=2610,
                memory_clocks_mhz=(11501, 810, 405),
                power_limit_min_w=150.0,
                power_limit_default_w=320.0,
                power_limit_max_w=400.0,
                shutdown_c=100,
                slowdown_c=97,
                max_operating_c=90,
                memory_max_c=None,
                idle_temp_c=35.0,
                thermal_r_c_per_w=_thermal(35, 15, 68, 310),
                thermal_tau_s=20.0,
                power_averaged=True,
                has_fan=True,
                remapped_rows=False,
                ecc=False,
                pcie_max_kbs=25_000_000,
                memory_busy_fraction=0.8,
            ),
        )
    }
)


#: What the NVML of JetPack 7.2 on an AGX Orin answers NotSupported for: load, clocks, memory and processes
#: (jetson-stats 7.x and its issues, shared/docs/nvml-facts.md section 9), and (assumed) every other reading but
#: the identity: temperatures, power, energy, limits, clock reasons, P-state, ECC, PCIe, InfoROM, modes.
_JETSON_NVML_CLOCKS = frozenset(
    {
        "nvmlDeviceGetClockInfo",
        "nvmlDeviceGetMaxClockInfo",
        "nvmlDeviceGetSupportedMemoryClocks",
        "nvmlDeviceGetSupportedGraphicsClocks",
        "nvmlDeviceGetCurrentClocksEventReasons",
        "nvmlDeviceGetSupportedClocksEventReasons",
        "nvmlDeviceGetCurrentClocksThrottleReasons",
        "nvmlDeviceGetPerformanceState",
    }
)
_JETSON_NVML_POWER = frozenset(
    {
        "nvmlDeviceGetPowerUsage",
        "nvmlDeviceGetTotalEnergyConsumption",
        "nvmlDeviceGetFieldValues",
        "nvmlDeviceGetPowerManagementLimit",
        "nvmlDeviceGetPowerManagementLimitConstraints",
        "nvmlDeviceGetPowerManagementDefaultLimit",
        "nvmlDeviceGetEnforcedPowerLimit",
        "nvmlDeviceSetPowerManagementLimit",
        "nvmlDeviceSetGpuLockedClocks",
        "nvmlDeviceResetGpuLockedClocks",
        "nvmlDeviceSetMemoryLockedClocks",
        "nvmlDeviceResetMemoryLockedClocks",
    }
)
_JETSON_NVML_OTHER = frozenset(
    {
        "nvmlDeviceGetTemperature",
        "nvmlDeviceGetTemperatureV",
        "nvmlDeviceGetTemperatureThreshold",
        "nvmlDeviceGetPcieThroughput",
        "nvmlDeviceGetTotalEccErrors",
        "nvmlDeviceGetRemappedRows",
        "nvmlDeviceGetInforomImageVersion",
        "nvmlDeviceGetInforomVersion",
        "nvmlDeviceValidateInforom",
        "nvmlDeviceGetPersistenceMode",
        "nvmlDeviceGetComputeMode",
        "nvmlDeviceSetPersistenceMode",
        "nvmlDeviceSetComputeMode",
    }
)
_JETSON_NVML_SERVED_BY_THOR = frozenset(
    {
        "nvmlDeviceGetUtilizationRates",
        "nvmlDeviceGetMemoryInfo",
        "nvmlDeviceGetComputeRunningProcesses_v3",
        "nvmlDeviceGetComputeRunningProcesses_v2",
        "nvmlDeviceGetGraphicsRunningProcesses_v3",
        "nvmlDeviceGetGraphicsRunningProcesses_v2",
        "nvmlDeviceGetProcessUtilization",
        "nvmlDeviceGetProcessesUtilizationInfo",
    }
)

#: The NVML of a Jetson board (JetPack 7), which the simulated Jetson runs beside its sysfs tree
#: (``mapper.edge.gpu.simjetson.JetsonProfile.nvml_profile``): kept apart from ``PROFILES``, whose every card
#: serves the whole catalog. Memory is the board's unified RAM; the power and thermal figures only keep the
#: physics going (nothing reads them: NotSupported) and are assumed.
TEGRA_PROFILES: Mapping[str, GpuProfile] = MappingProxyType(
    {
        p.key: p
        for p in (
            GpuProfile(
                # JetPack 7.2 on an AGX Orin 64GB: the nvgpu stack; NVML initialises and serves no reading.
                key="ORIN-JP7",
                name="Orin (nvgpu)",
                architecture=ARCH_AMPERE,
                memory_total_bytes=62_827 * _MIB,
                idle_power_w=3.0,
                load_power_w=30.0,
                idle_pstate=0,
                idle_sm_mhz=306,
                sm_max_mhz=1300,
                memory_clocks_mhz=(3199,),
                power_limit_min_w=15.0,
                power_limit_default_w=30.0,
                power_limit_max_w=60.0,
                shutdown_c=104,
                slowdown_c=99,
                max_operating_c=97,
                memory_max_c=None,
                idle_temp_c=35.0,
                thermal_r_c_per_w=1.3,
                thermal_tau_s=40.0,
                power_averaged=False,
                memory_locked_clocks=False,
                remapped_rows=False,
                ecc=False,
                not_supported=_JETSON_NVML_SERVED_BY_THOR
                | _JETSON_NVML_CLOCKS
                | _JETSON_NVML_POWER
                | _JETSON_NVML_OTHER,
            ),
            GpuProfile(
                # A Jetson AGX Thor (Blackwell, the nvidia.ko stack): NVML serves load, memory and processes
                # (jetson-stats reads them through pynvml there); clocks, power and temperatures come from sysfs
                # (assumed NotSupported in NVML).
                key="THOR",
                name="NVIDIA Thor",
                architecture=ARCH_BLACKWELL,
                memory_total_bytes=128_567 * _MIB,
                idle_power_w=6.0,
                load_power_w=60.0,
                idle_pstate=0,
                idle_sm_mhz=306,
                sm_max_mhz=1575,
                memory_clocks_mhz=(4266,),
                power_limit_min_w=40.0,
                power_limit_default_w=120.0,
                power_limit_max_w=130.0,
                shutdown_c=104,
                slowdown_c=99,
                max_operating_c=97,
                memory_max_c=None,
                idle_temp_c=35.0,
                thermal_r_c_per_w=0.55,
                thermal_tau_s=40.0,
                power_averaged=False,
                memory_locked_clocks=False,
                remapped_rows=False,
                ecc=False,
                memory_busy_fraction=0.3,
                not_supported=_JETSON_NVML_CLOCKS | _JETSON_NVML_POWER | _JETSON_NVML_OTHER,
            ),
        )
    }
)


def profile(key: str) -> GpuProfile:
    """A profile by key (``H100``, ``A100``, ``T4``, ... or a Jetson board's NVML, ``TEGRA_PROFILES``),
    case-insensitive; a clear error for an unknown one."""
    for name, prof in (*PROFILES.items(), *TEGRA_PROFILES.items()):
        if name.lower() == key.lower():
            return prof
    raise ValueError(f"unknown GPU profile {key!r}; known profiles: {', '.join(PROFILES)}")


# --------------------------------------------------------------------------------------------------
# What NVML calls cost (cost profiles of the simulated NVML)
# --------------------------------------------------------------------------------------------------

_US = 1e-6


@dataclass(frozen=True)
class CallCost:
    """What one NVML call costs the thread that makes it: ``cpu_s`` of CPU burnt in the driver, and ``block_s``
    of waiting that burns none (``nvmlDeviceGetPcieThroughput`` samples the link for ~20 ms)."""

    cpu_s: float = 0.0
    block_s: float = 0.0

    @property
    def wall_s(self) -> float:
        return self.cpu_s + self.block_s


FREE = CallCost()


@dataclass(frozen=True)
class CostProfile:
    """Per NVML function (the C name the simulator counts in ``SimNvml.calls``) what a call costs;
    ``nvmlDeviceGetFieldValues`` costs what its dearest field costs (``fields``, by field id). A function or
    field not listed costs ``default_call`` / ``default_field``."""

    name: str
    calls: Mapping[str, CallCost]
    fields: Mapping[int, CallCost]
    default_call: CallCost = FREE
    default_field: CallCost = FREE

    @property
    def free(self) -> bool:
        return (
            self.default_call == FREE
            and self.default_field == FREE
            and not any(c != FREE for c in (*self.calls.values(), *self.fields.values()))
        )

    def call(self, function: str) -> CallCost:
        return self.calls.get(function, self.default_call)

    def field_batch(self, field_ids: tuple[int, ...] | list[int]) -> CallCost:
        """One ``nvmlDeviceGetFieldValues`` call for ``field_ids``: the dearest field's CPU and wait."""
        costs = [self.fields.get(f, self.default_field) for f in field_ids]
        if not costs:
            return self.default_field
        return CallCost(max(c.cpu_s for c in costs), max(c.block_s for c in costs))


def _h200() -> CostProfile:
    """The per-call cost measured on an NVIDIA H200 (driver 580.159.04, nvidia-ml-py 13.615, persistence mode on;
    ``shared/docs/nvml-facts.md``, "Measured on a real GPU"): CPU of the calling thread per call through pynvml,
    50 calls each. Where the table gives a range its middle is used; ``(assumed)`` marks a function the pass did
    not time (it then costs what the common getters cost)."""
    getter = CallCost(1.1 * _US)  # GetTemperature(V), GetPowerUsage, GetUtilizationRates, ... : 0.9-1.2 us
    counters = CallCost(1.65 * _US)  # GetTotalEccErrors, GetRemappedRows, GetInforomImageVersion: 1.6-1.7 us
    lists = CallCost(6.0 * _US)  # GetMemoryInfo (v1 and v2), GetComputeRunningProcesses: 5.5-6.5 us
    calls = {
        "nvmlDeviceGetTotalEnergyConsumption": CallCost(4300 * _US),
        "nvmlDeviceGetPcieThroughput": CallCost(790 * _US, (20900 - 790) * _US),
        "nvmlDeviceGetSamples": CallCost(302 * _US),
        "nvmlDeviceGetPowerManagementLimit": CallCost(149 * _US),
        "nvmlDeviceGetEnforcedPowerLimit": CallCost(0.9 * _US),
        "nvmlDeviceGetMemoryInfo": lists,
        "nvmlDeviceGetComputeRunningProcesses_v3": lists,
        "nvmlDeviceGetComputeRunningProcesses_v2": lists,
        "nvmlDeviceGetGraphicsRunningProcesses_v3": lists,  # (assumed: as the compute list)
        "nvmlDeviceGetGraphicsRunningProcesses_v2": lists,  # (assumed)
        "nvmlDeviceGetProcessUtilization": lists,  # (assumed: NotFound with no process on the GPU)
        "nvmlDeviceGetProcessesUtilizationInfo": lists,  # (assumed)
        "nvmlDeviceGetTotalEccErrors": counters,
        "nvmlDeviceGetRemappedRows": counters,
        "nvmlDeviceGetInforomImageVersion": counters,
    }
    for name in (
        "nvmlDeviceGetTemperatureV",
        "nvmlDeviceGetTemperature",
        "nvmlDeviceGetPowerUsage",
        "nvmlDeviceGetUtilizationRates",
        "nvmlDeviceGetClockInfo",
        "nvmlDeviceGetPerformanceState",
        "nvmlDeviceGetCurrentClocksEventReasons",
        "nvmlDeviceGetPowerManagementLimitConstraints",
    ):
        calls[name] = getter
    fields = {
        191: CallCost(4190 * _US),  # NVML_FI_DEV_ENERGY: the same cost as nvmlDeviceGetTotalEnergyConsumption
        82: CallCost(4.7 * _US),  # NVML_FI_DEV_MEMORY_TEMP alone
    }
    return CostProfile(
        "h200",
        MappingProxyType(calls),
        MappingProxyType(fields),
        default_call=getter,  # (assumed)
        default_field=CallCost(4.7 * _US),  # (assumed: as field 82)
    )


#: The cost profiles ``SimNvml(cost=...)`` knows: ``none`` (every call free: unit tests stay fast, the simulator
#: is a functional stand-in) and ``h200`` (the measured table: what benchmarks project a real driver with).
COST_PROFILES: Mapping[str, CostProfile] = MappingProxyType(
    {
        "none": CostProfile("none", MappingProxyType({}), MappingProxyType({})),
        "h200": _h200(),
    }
)


def cost_profile(key: str | CostProfile) -> CostProfile:
    """A cost profile by name (case-insensitive), or the profile itself; a clear error for an unknown name."""
    if isinstance(key, CostProfile):
        return key
    found = COST_PROFILES.get(key.lower())
    if found is None:
        raise ValueError(f"unknown NVML cost profile {key!r}; known: {', '.join(COST_PROFILES)}")
    return found
