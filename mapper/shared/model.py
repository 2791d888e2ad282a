"""Pure domain types and the property catalog: the single source of truth for every GPU property.

Nothing here does I/O. The catalog (``PROPERTIES``) names each property exactly as it appears in the
DeviceModel, in twins, in telemetry and (through ``prom_name``) in Prometheus. Its names are public API.

Values in a ``Sample`` are in the catalog unit (W, J, MHz, bytes, percent, celsius), typed by ``ptype``:
INT -> int, FLOAT -> float, BOOLEAN -> bool, STRING -> str.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal, Protocol

from mapper.errors import InvalidValueError
from mapper.shared.push import DbMethod, PushMethod

PropertyType = Literal["INT", "FLOAT", "STRING", "BOOLEAN"]
AccessMode = Literal["ReadOnly", "ReadWrite"]
PromType = Literal["gauge", "counter"]
Value = int | float | str | bool

#: KubeEdge devicetwin validation (Go regexps anchored with ^...$; use fullmatch in Python).
TWIN_KEY_RE = re.compile(r"[a-zA-Z0-9\-_.,:/@#]{1,128}")
TWIN_VALUE_RE = re.compile(r"[a-zA-Z0-9\-_.,:/@#]{1,512}")
_TWIN_UNSAFE = re.compile(r"[^a-zA-Z0-9\-_.,:/@#]+")

#: Device states EdgeCore accepts (anything else is dropped silently by devicetwin).
DEVICE_STATES = ("ok", "online", "offline", "unknown", "unhealthy")

#: Compute modes by NVML code (EXCLUSIVE_THREAD=1 was removed from NVML).
COMPUTE_MODES: Mapping[str, int] = {"default": 0, "prohibited": 2, "exclusive_process": 3}
COMPUTE_MODE_NAMES: Mapping[int, str] = {v: k for k, v in COMPUTE_MODES.items()}

#: Reasons a desired value is rejected; each fits the twin charset and reads after ``rejected-``.
REJECT_REASONS = (
    "wrong-type",
    "not-a-number",
    "nan",
    "infinite",
    "negative",
    "empty",
    "too-long",
    "non-ascii",
    "out-of-range",
    "not-supported-clock",
    "unpaired",
    "unknown-value",
    "read-only",
    "unknown-property",
    "not-supported",
    "no-permission",
    "needs-reboot",
    "command-failed",
)

#: Longest raw desired value accepted before any parsing (twin values are at most 512 chars).
MAX_RAW_VALUE_LEN = 512

#: Clock-event-reason bits (nvmlClocksEventReason*), in bit order, with their twin-safe names.
CLOCK_EVENT_REASONS: tuple[tuple[int, str], ...] = (
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks_setting"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
)


@dataclass(frozen=True)
class PropertySpec:
    """One GPU property: how KubeEdge, Prometheus and NVML each see it."""

    name: str
    ptype: PropertyType
    unit: str
    access: AccessMode
    description: str
    #: The NVML call (or field id) that reads it; documentation for operators and the backend's checklist.
    nvml_read: str
    #: The NVML call that writes it (ReadWrite only).
    nvml_write: str = ""
    #: Prometheus metric name in base units, or "" when the property is exported another way (labels, info).
    prom_name: str = ""
    prom_type: PromType = "gauge"
    #: Multiply the catalog value by this to get the Prometheus base unit (percent -> ratio: 0.01, MHz -> Hz: 1e6).
    prom_scale: float = 1.0
    minimum: str = ""
    maximum: str = ""
    #: Default collect cycle for generated Devices, in milliseconds.
    collect_cycle_ms: int = 10_000
    #: How often the GPU is really asked for a value that is dear to read, in milliseconds, where that is rarer
    #: than the collect cycle; between two reads the backend derives the value (0: read at every collect).
    #: ``energy_consumption``: the counter costs ~4 ms of CPU per read on an H200 (``docs/benchmarks.md``).
    read_cycle_ms: int = 0
    #: "nvml": read by the NVML backend (some also by the Jetson backend: ``JETSON_SHARED``); "jetson": read by the
    #: Jetson backend only (sysfs, nvpmodel); "mapper": computed by the mapper itself (status twins).
    source: Literal["nvml", "jetson", "mapper"] = "nvml"

    @property
    def writable(self) -> bool:
        return self.access == "ReadWrite"


def _p(
    name: str,
    ptype: PropertyType,
    unit: str,
    description: str,
    nvml_read: str,
    *,
    prom_name: str = "",
    prom_type: PromType = "gauge",
    prom_scale: float = 1.0,
    minimum: str = "",
    maximum: str = "",
    collect_cycle_ms: int = 10_000,
    read_cycle_ms: int = 0,
    nvml_write: str = "",
    source: Literal["nvml", "jetson", "mapper"] = "nvml",
) -> PropertySpec:
    return PropertySpec(
        name=name,
        ptype=ptype,
        unit=unit,
        access="ReadWrite" if nvml_write else "ReadOnly",
        description=description,
        nvml_read=nvml_read,
        nvml_write=nvml_write,
        prom_name=prom_name,
        prom_type=prom_type,
        prom_scale=prom_scale,
        minimum=minimum,
        maximum=maximum,
        collect_cycle_ms=collect_cycle_ms,
        read_cycle_ms=read_cycle_ms,
        source=source,
    )


#: Properties only a Jetson has, read by ``mapper.edge.gpu.jetson.JetsonBackend`` from sysfs, /proc and nvpmodel
#: (``nvml_read`` / ``nvml_write`` name the file or command; docs/jetson.md). A Jetson also reads the NVML
#: family's ``JETSON_SHARED`` properties, with the same names, units and meaning.
_JETSON: tuple[PropertySpec, ...] = (
    _p(
        "gpu_freq",
        "FLOAT",
        "MHz",
        "current GPU frequency (devfreq)",
        "/sys/class/devfreq/<gpu>/cur_freq (Hz)",
        prom_name="gpu_frequency_hertz",
        prom_scale=1e6,
        minimum="0",
        collect_cycle_ms=1_000,
        source="jetson",
    ),
    _p(
        "gpu_min_freq",
        "FLOAT",
        "MHz",
        "lower end of the GPU's devfreq range; a desired value snaps up to the next available frequency",
        "/sys/class/devfreq/<gpu>/min_freq (Hz)",
        nvml_write="write /sys/class/devfreq/<gpu>/min_freq (Hz, root)",
        prom_name="gpu_frequency_min_hertz",
        prom_scale=1e6,
        minimum="0",
        collect_cycle_ms=5_000,
        source="jetson",
    ),
    _p(
        "gpu_max_freq",
        "FLOAT",
        "MHz",
        "upper end of the GPU's devfreq range; a desired value snaps down to the next available frequency",
        "/sys/class/devfreq/<gpu>/max_freq (Hz)",
        nvml_write="write /sys/class/devfreq/<gpu>/max_freq (Hz, root)",
        prom_name="gpu_frequency_max_hertz",
        prom_scale=1e6,
        minimum="0",
        collect_cycle_ms=5_000,
        source="jetson",
    ),
    _p(
        "gpu_available_freqs",
        "STRING",
        "MHz",
        "the GPU frequencies devfreq offers, lowest first, comma separated",
        "/sys/class/devfreq/<gpu>/available_frequencies (Hz)",
        collect_cycle_ms=60_000,
        source="jetson",
    ),
    _p(
        "gpu_governor",
        "STRING",
        "",
        "the GPU's devfreq governor: nvhost_podgov scales with the load, performance holds max_freq",
        "/sys/class/devfreq/<gpu>/governor",
        collect_cycle_ms=10_000,
        source="jetson",
    ),
    _p(
        "emc_freq",
        "FLOAT",
        "MHz",
        "external memory controller frequency (needs debugfs, root)",
        "/sys/kernel/debug/bpmp/debug/clk/emc/rate (Hz)",
        prom_name="gpu_emc_frequency_hertz",
        prom_scale=1e6,
        minimum="0",
        collect_cycle_ms=5_000,
        source="jetson",
    ),
    _p(
        "temperature_cpu",
        "INT",
        "celsius",
        "CPU cluster temperature (thermal zone cpu-thermal / CPU-therm)",
        "/sys/devices/virtual/thermal/thermal_zone*/temp (millidegrees)",
        prom_name="gpu_cpu_temperature_celsius",
        minimum="0",
        maximum="120",
        collect_cycle_ms=1_000,
        source="jetson",
    ),
    _p(
        "temperature_tj",
        "INT",
        "celsius",
        "junction temperature (tj-thermal; without that zone the hottest online zone)",
        "/sys/devices/virtual/thermal/thermal_zone*/temp (millidegrees)",
        prom_name="gpu_tj_temperature_celsius",
        minimum="0",
        maximum="120",
        collect_cycle_ms=1_000,
        source="jetson",
    ),
    _p(
        "power_gpu_rail",
        "FLOAT",
        "W",
        "power of the INA3221 rail that feeds the GPU (VDD_GPU_SOC, VDD_CPU_GPU_CV, VDD_GPU, GPU)",
        "/sys/bus/i2c/devices/*/hwmon/hwmon*/in<N>_input x curr<N>_input (mV x mA)",
        prom_name="gpu_rail_power_watts",
        minimum="0",
        collect_cycle_ms=1_000,
        source="jetson",
    ),
    _p(
        "energy_gpu_rail",
        "FLOAT",
        "J",
        "energy of the GPU rail since the mapper started, integrated from its samples",
        "integral of power_gpu_rail",
        prom_name="gpu_rail_energy_joules_total",
        prom_type="counter",
        minimum="0",
        collect_cycle_ms=1_000,
        source="jetson",
    ),
    _p(
        "power_rails",
        "STRING",
        "W",
        "every monitored rail's power, LABEL:watts comma separated",
        "/sys/bus/i2c/devices/*/hwmon/hwmon*/in<N>_label, in<N>_input, curr<N>_input",
        collect_cycle_ms=5_000,
        source="jetson",
    ),
    _p(
        "shared_memory_used",
        "INT",
        "bytes",
        "RAM in use, which the CPU and the GPU share (MemTotal - MemAvailable)",
        "/proc/meminfo",
        prom_name="gpu_shared_memory_used_bytes",
        minimum="0",
        collect_cycle_ms=1_000,
        source="jetson",
    ),
    _p(
        "shared_memory_total",
        "INT",
        "bytes",
        "RAM the CPU and the GPU share (MemTotal)",
        "/proc/meminfo",
        prom_name="gpu_shared_memory_total_bytes",
        minimum="0",
        collect_cycle_ms=60_000,
        source="jetson",
    ),
    _p(
        "power_mode",
        "INT",
        "",
        "nvpmodel power mode id (modes in /etc/nvpmodel.conf); one that needs a reboot is refused unless allowed",
        "/var/lib/nvpmodel/status (pmode:NNNN)",
        nvml_write="nvpmodel -m <id> (root)",
        prom_name="gpu_power_mode",
        minimum="0",
        collect_cycle_ms=10_000,
        source="jetson",
    ),
    _p(
        "power_mode_name",
        "STRING",
        "",
        "name of the nvpmodel power mode in force (MAXN, MODE_30W, ...)",
        "/etc/nvpmodel.conf (< POWER_MODEL ID=.. NAME=.. >)",
        collect_cycle_ms=10_000,
        source="jetson",
    ),
)

PROPERTIES: tuple[PropertySpec, ...] = (
    # --- identity -------------------------------------------------------------------------------
    _p("uuid", "STRING", "", "GPU UUID (GPU-...): the GPU's identity", "nvmlDeviceGetUUID", collect_cycle_ms=60_000),
    _p(
        "product_name",
        "STRING",
        "",
        "product name, made twin-safe (spaces become _)",
        "nvmlDeviceGetName",
        collect_cycle_ms=60_000,
    ),
    # --- load -----------------------------------------------------------------------------------
    _p(
        "utilization_gpu",
        "INT",
        "percent",
        "time a kernel ran over the driver's sample period",
        "nvmlDeviceGetUtilizationRates.gpu",
        prom_name="gpu_utilization_ratio",
        prom_scale=0.01,
        minimum="0",
        maximum="100",
        collect_cycle_ms=1_000,
    ),
    _p(
        "utilization_memory",
        "INT",
        "percent",
        "time device memory was read or written",
        "nvmlDeviceGetUtilizationRates.memory",
        prom_name="gpu_memory_utilization_ratio",
        prom_scale=0.01,
        minimum="0",
        maximum="100",
        collect_cycle_ms=1_000,
    ),
    _p(
        "memory_used",
        "INT",
        "bytes",
        "framebuffer memory allocations hold (v2; before driver r510 v1's figure, which includes reserved memory)",
        "nvmlDeviceGetMemoryInfo(version=nvmlMemory_v2).used",
        prom_name="gpu_memory_used_bytes",
        minimum="0",
        collect_cycle_ms=1_000,
    ),
    _p(
        "memory_total",
        "INT",
        "bytes",
        "framebuffer memory installed",
        "nvmlDeviceGetMemoryInfo.total",
        prom_name="gpu_memory_total_bytes",
        minimum="0",
        collect_cycle_ms=60_000,
    ),
    _p(
        "memory_reserved",
        "INT",
        "bytes",
        "framebuffer memory the driver reserves for itself (absent before driver r510)",
        "nvmlDeviceGetMemoryInfo(version=nvmlMemory_v2).reserved",
        prom_name="gpu_memory_reserved_bytes",
        minimum="0",
        collect_cycle_ms=60_000,
    ),
    # --- thermal --------------------------------------------------------------------------------
    _p(
        "temperature",
        "INT",
        "celsius",
        "GPU core temperature",
        "nvmlDeviceGetTemperatureV(NVML_TEMPERATURE_GPU)",
        prom_name="gpu_temperature_celsius",
        minimum="0",
        maximum="120",
        collect_cycle_ms=1_000,
    ),
    _p(
        "temperature_memory",
        "INT",
        "celsius",
        "HBM temperature (HBM parts only)",
        "nvmlDeviceGetFieldValues(NVML_FI_DEV_MEMORY_TEMP)",
        prom_name="gpu_memory_temperature_celsius",
        minimum="0",
        maximum="120",
        collect_cycle_ms=1_000,
    ),
    _p(
        "temperature_slowdown",
        "INT",
        "celsius",
        "hardware slowdown threshold",
        "nvmlDeviceGetTemperatureThreshold(NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)",
        prom_name="gpu_temperature_slowdown_threshold_celsius",
        collect_cycle_ms=60_000,
    ),
    _p(
        "temperature_shutdown",
        "INT",
        "celsius",
        "hardware shutdown threshold",
        "nvmlDeviceGetTemperatureThreshold(NVML_TEMPERATURE_THRESHOLD_SHUTDOWN)",
        prom_name="gpu_temperature_shutdown_threshold_celsius",
        collect_cycle_ms=60_000,
    ),
    _p(
        "fan_speed",
        "INT",
        "percent",
        "fan speed in percent of maximum (absent on passive cards)",
        "nvmlDeviceGetFanSpeed",
        prom_name="gpu_fan_speed_ratio",
        prom_scale=0.01,
        minimum="0",
        collect_cycle_ms=5_000,
    ),
    # --- power ----------------------------------------------------------------------------------
    _p(
        "power_usage",
        "FLOAT",
        "W",
        "board power draw",
        "nvmlDeviceGetPowerUsage (mW)",
        prom_name="gpu_power_usage_watts",
        minimum="0",
        collect_cycle_ms=1_000,
    ),
    _p(
        "energy_consumption",
        "FLOAT",
        "J",
        "energy since the driver was loaded (resets on reload)",
        "nvmlDeviceGetFieldValues(NVML_FI_DEV_ENERGY) (mJ) every read_cycle_ms (60 s); in between the last read plus "
        "power_usage integrated over time, never decreasing (energy_consumption_age: how long since the read)",
        prom_name="gpu_energy_consumption_joules_total",
        prom_type="counter",
        minimum="0",
        collect_cycle_ms=1_000,
        read_cycle_ms=60_000,
    ),
    _p(
        "energy_consumption_age",
        "FLOAT",
        "s",
        "seconds since energy_consumption was read from the GPU: 0 when it is the driver's own counter, above 0 "
        "when it is derived from power_usage since that read",
        "(computed by the backend: no NVML call)",
        prom_name="gpu_energy_consumption_age_seconds",
        minimum="0",
        collect_cycle_ms=1_000,
    ),
    _p(
        "power_limit_enforced",
        "FLOAT",
        "W",
        "power limit in force after every limiter",
        "nvmlDeviceGetEnforcedPowerLimit (mW)",
        prom_name="gpu_power_limit_enforced_watts",
        collect_cycle_ms=5_000,
    ),
    _p(
        "power_limit_min",
        "FLOAT",
        "W",
        "lowest power limit the GPU accepts",
        "nvmlDeviceGetPowerManagementLimitConstraints[0] (mW)",
        prom_name="gpu_power_limit_min_watts",
        collect_cycle_ms=60_000,
    ),
    _p(
        "power_limit_max",
        "FLOAT",
        "W",
        "highest power limit the GPU accepts",
        "nvmlDeviceGetPowerManagementLimitConstraints[1] (mW)",
        prom_name="gpu_power_limit_max_watts",
        collect_cycle_ms=60_000,
    ),
    _p(
        "power_limit_default",
        "FLOAT",
        "W",
        "power limit at boot",
        "nvmlDeviceGetPowerManagementDefaultLimit (mW)",
        prom_name="gpu_power_limit_default_watts",
        collect_cycle_ms=60_000,
    ),
    # --- clocks ---------------------------------------------------------------------------------
    _p(
        "clock_sm",
        "INT",
        "MHz",
        "current SM clock",
        "nvmlDeviceGetClockInfo(NVML_CLOCK_SM)",
        prom_name="gpu_clock_sm_hertz",
        prom_scale=1e6,
        minimum="0",
        collect_cycle_ms=1_000,
    ),
    _p(
        "clock_memory",
        "INT",
        "MHz",
        "current memory clock",
        "nvmlDeviceGetClockInfo(NVML_CLOCK_MEM)",
        prom_name="gpu_clock_memory_hertz",
        prom_scale=1e6,
        minimum="0",
        collect_cycle_ms=1_000,
    ),
    _p(
        "clock_sm_max",
        "INT",
        "MHz",
        "highest SM clock",
        "nvmlDeviceGetMaxClockInfo(NVML_CLOCK_SM)",
        prom_name="gpu_clock_sm_max_hertz",
        prom_scale=1e6,
        minimum="0",
        collect_cycle_ms=60_000,
    ),
    _p(
        "clock_event_reasons",
        "INT",
        "bitmask",
        "why clocks are held back (nvmlClocksEventReason* bits)",
        "nvmlDeviceGetCurrentClocksEventReasons",
        prom_name="gpu_clock_event_reasons",
        minimum="0",
        collect_cycle_ms=1_000,
    ),
    _p(
        "clock_event_reasons_text",
        "STRING",
        "",
        "the clock event reason bits by name, comma separated",
        "nvmlDeviceGetCurrentClocksEventReasons",
        collect_cycle_ms=1_000,
    ),
    _p(
        "pstate",
        "INT",
        "",
        "performance state, 0 (fastest) to 15; 32 = unknown",
        "nvmlDeviceGetPerformanceState",
        prom_name="gpu_pstate",
        minimum="0",
        maximum="32",
        collect_cycle_ms=5_000,
    ),
    # --- PCIe -----------------------------------------------------------------------------------
    _p(
        "pcie_tx",
        "INT",
        "bytes/s",
        "PCIe transmit throughput (20 ms window; read on a thread of its own, the call blocks ~20 ms)",
        "nvmlDeviceGetPcieThroughput(NVML_PCIE_UTIL_TX_BYTES) (KB/s)",
        prom_name="gpu_pcie_tx_bytes_per_second",
        minimum="0",
        collect_cycle_ms=30_000,
    ),
    _p(
        "pcie_rx",
        "INT",
        "bytes/s",
        "PCIe receive throughput (20 ms window; read on a thread of its own, the call blocks ~20 ms)",
        "nvmlDeviceGetPcieThroughput(NVML_PCIE_UTIL_RX_BYTES) (KB/s)",
        prom_name="gpu_pcie_rx_bytes_per_second",
        minimum="0",
        collect_cycle_ms=30_000,
    ),
    # --- health ---------------------------------------------------------------------------------
    _p(
        "ecc_errors_corrected",
        "INT",
        "",
        "corrected ECC errors since driver load (volatile)",
        "nvmlDeviceGetTotalEccErrors(CORRECTED, VOLATILE)",
        prom_name="gpu_ecc_errors_corrected_total",
        prom_type="counter",
        minimum="0",
        collect_cycle_ms=10_000,
    ),
    _p(
        "ecc_errors_uncorrected",
        "INT",
        "",
        "uncorrected ECC errors since driver load (volatile)",
        "nvmlDeviceGetTotalEccErrors(UNCORRECTED, VOLATILE)",
        prom_name="gpu_ecc_errors_uncorrected_total",
        prom_type="counter",
        minimum="0",
        collect_cycle_ms=10_000,
    ),
    _p(
        "remapped_rows_uncorrectable",
        "INT",
        "",
        "rows remapped after uncorrectable errors (Ampere+)",
        "nvmlDeviceGetRemappedRows[1]",
        prom_name="gpu_remapped_rows_uncorrectable",
        minimum="0",
        collect_cycle_ms=60_000,
    ),
    _p(
        "remapped_rows_pending",
        "BOOLEAN",
        "",
        "a row remap waits for a GPU reset (Ampere+)",
        "nvmlDeviceGetRemappedRows[2]",
        prom_name="gpu_remapped_rows_pending",
        collect_cycle_ms=60_000,
    ),
    _p(
        "xid_last",
        "INT",
        "",
        "the last XID event seen (0 = none since start)",
        "nvmlEventSetWait(nvmlEventTypeXidCriticalError).eventData",
        minimum="0",
        collect_cycle_ms=1_000,
    ),
    # --- writable -------------------------------------------------------------------------------
    _p(
        "power_limit",
        "FLOAT",
        "W",
        "board power cap (requested limit)",
        "nvmlDeviceGetPowerManagementLimit (mW)",
        nvml_write="nvmlDeviceSetPowerManagementLimit (mW)",
        prom_name="gpu_power_limit_watts",
        minimum="0",
        collect_cycle_ms=5_000,
    ),
    _p(
        "locked_gpu_clock_min",
        "INT",
        "MHz",
        "lower locked GPU clock, 0 = not locked",
        "the value this mapper set since the driver loaded (NVML has no getter)",
        nvml_write="nvmlDeviceSetGpuLockedClocks / nvmlDeviceResetGpuLockedClocks",
        prom_name="gpu_locked_clock_min_hertz",
        prom_scale=1e6,
        minimum="0",
        collect_cycle_ms=5_000,
    ),
    _p(
        "locked_gpu_clock_max",
        "INT",
        "MHz",
        "upper locked GPU clock, 0 = not locked",
        "the value this mapper set since the driver loaded (NVML has no getter)",
        nvml_write="nvmlDeviceSetGpuLockedClocks / nvmlDeviceResetGpuLockedClocks",
        prom_name="gpu_locked_clock_max_hertz",
        prom_scale=1e6,
        minimum="0",
        collect_cycle_ms=5_000,
    ),
    _p(
        "locked_memory_clock_min",
        "INT",
        "MHz",
        "lower locked memory clock, 0 = not locked (Ampere+)",
        "the value this mapper set since the driver loaded (NVML has no getter)",
        nvml_write="nvmlDeviceSetMemoryLockedClocks / nvmlDeviceResetMemoryLockedClocks",
        prom_name="gpu_locked_memory_clock_min_hertz",
        prom_scale=1e6,
        minimum="0",
        collect_cycle_ms=5_000,
    ),
    _p(
        "locked_memory_clock_max",
        "INT",
        "MHz",
        "upper locked memory clock, 0 = not locked (Ampere+)",
        "the value this mapper set since the driver loaded (NVML has no getter)",
        nvml_write="nvmlDeviceSetMemoryLockedClocks / nvmlDeviceResetMemoryLockedClocks",
        prom_name="gpu_locked_memory_clock_max_hertz",
        prom_scale=1e6,
        minimum="0",
        collect_cycle_ms=5_000,
    ),
    _p(
        "persistence_mode",
        "BOOLEAN",
        "",
        "keep the driver loaded with no client (Linux)",
        "nvmlDeviceGetPersistenceMode",
        nvml_write="nvmlDeviceSetPersistenceMode",
        prom_name="gpu_persistence_mode",
        collect_cycle_ms=10_000,
    ),
    _p(
        "compute_mode",
        "STRING",
        "",
        "default, exclusive_process or prohibited",
        "nvmlDeviceGetComputeMode",
        nvml_write="nvmlDeviceSetComputeMode",
        collect_cycle_ms=10_000,
    ),
    # --- computed by the mapper (status twins the cloud can read) --------------------------------------
    _p(
        "desired_status",
        "STRING",
        "",
        "per writable property: applied, pending, rejected-<reason> or overridden-<policy>",
        "computed by the reconciler",
        collect_cycle_ms=1_000,
        source="mapper",
    ),
    _p(
        "policy_state",
        "STRING",
        "",
        "what the local policies are doing now, e.g. normal or thermal:throttling-step2",
        "computed by the policy engine",
        collect_cycle_ms=1_000,
        source="mapper",
    ),
    _p(
        "processes",
        "STRING",
        "",
        "who uses the GPU: process count, the top container by power and by memory, pids suspected of leaking",
        "computed by the process cycle (docs/processes.md)",
        collect_cycle_ms=5_000,
        source="mapper",
    ),
    _p(
        "health",
        "STRING",
        "",
        "the GPU's health over three levels: healthy, or degraded/unhealthy:level<N>:<reason>",
        "computed by the health policy (node metrics, driver checks, CUDA probe)",
        collect_cycle_ms=1_000,
        source="mapper",
    ),
    _p(
        "health_probe",
        "STRING",
        "",
        "the last CUDA probe: pass, slow, fail, timeout or skipped, with its reason and latency",
        "a CUDA context, allocation and copy in a short-lived process",
        collect_cycle_ms=1_000,
        source="mapper",
    ),
    _p(
        "push_status",
        "STRING",
        "",
        "each property's push and DB methods (pushMethod): ok, waiting, down, refused, ignored or carried",
        "computed by the push destinations",
        collect_cycle_ms=1_000,
        source="mapper",
    ),
    *_JETSON,
)

PROPERTY_BY_NAME: Mapping[str, PropertySpec] = {p.name: p for p in PROPERTIES}
WRITABLE: tuple[str, ...] = tuple(p.name for p in PROPERTIES if p.writable)
#: Properties the NVML backend reads (everything but the mapper's own status twins and the Jetson-only ones).
NVML_PROPERTIES: tuple[PropertySpec, ...] = tuple(p for p in PROPERTIES if p.source == "nvml")
#: NVML-family properties a Jetson reads too (from sysfs), with the same name, unit and meaning: the board model
#: is ``product_name``, GPU load is ``utilization_gpu``, the module input rail (VDD_IN) is ``power_usage``.
JETSON_SHARED: tuple[str, ...] = (
    "uuid",
    "product_name",
    "utilization_gpu",
    "temperature",
    "temperature_slowdown",
    "temperature_shutdown",
    "power_usage",
    "energy_consumption",
)
#: Properties the Jetson backend reads, in catalog order.
JETSON_PROPERTIES: tuple[PropertySpec, ...] = tuple(
    p for p in PROPERTIES if p.source == "jetson" or p.name in JETSON_SHARED
)
#: NVML-family properties a Jetson has only where its NVML serves them (a Thor: the GPU's memory in use, as NVML
#: counts it); no sysfs file has them (docs/jetson.md).
JETSON_NVML_ONLY: tuple[str, ...] = ("memory_used", "memory_total")
#: Every property the backend of a Jetson reads (``mapper.edge.gpu.tegra.TegraBackend``: sysfs, nvpmodel and, where
#: it answers, NVML), in catalog order.
JETSON_FAMILY_PROPERTIES: tuple[PropertySpec, ...] = tuple(
    p for p in PROPERTIES if p.source == "jetson" or p.name in JETSON_SHARED or p.name in JETSON_NVML_ONLY
)
#: GPU families (``GpuInfo.family``) and the properties each one's backend reads.
BACKEND_PROPERTIES: Mapping[str, tuple[PropertySpec, ...]] = {
    "nvml": NVML_PROPERTIES,
    "jetson": JETSON_FAMILY_PROPERTIES,
}


def family_properties(family: str) -> tuple[PropertySpec, ...]:
    """Every catalog property a GPU of ``family`` has (what its backend reads and the mapper's status twins), in
    catalog order: what its DeviceModel lists. Raises ``ValueError`` for an unknown family."""
    read = BACKEND_PROPERTIES.get(family)
    if read is None:
        raise ValueError(f"unknown GPU family {family!r} (known: {', '.join(BACKEND_PROPERTIES)})")
    names = {p.name for p in read}
    computed = [
        p for p in PROPERTIES if p.source == "mapper" and family in MAPPER_PROPERTY_FAMILIES.get(p.name, (family,))
    ]
    names.update(p.name for p in computed)
    return tuple(p for p in PROPERTIES if p.name in names)


#: Mapper-computed properties that only some families have (any other serves every family): the process cycle
#: reads NVML's process lists, and the health loop NVML's checks and a CUDA probe by NVML's identity. A Jetson has
#: them where its NVML serves the GPU (a Thor); elsewhere (Xavier, Orin) ``gpu-mapper discover`` leaves them out of
#: its Device and says why (docs/jetson.md).
MAPPER_PROPERTY_FAMILIES: Mapping[str, tuple[str, ...]] = {
    "processes": ("nvml", "jetson"),
    "health": ("nvml", "jetson"),
    "health_probe": ("nvml", "jetson"),
}


#: Writable properties that NVML sets together, as (min, max) pairs.
CLOCK_PAIRS: Mapping[str, tuple[str, str]] = {
    "locked_gpu_clocks": ("locked_gpu_clock_min", "locked_gpu_clock_max"),
    "locked_memory_clocks": ("locked_memory_clock_min", "locked_memory_clock_max"),
}


# --------------------------------------------------------------------------------------------------
# Domain types shared by the loops and the adapters
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuInfo:
    """A GPU as enumerated on this node. ``uuid`` is the identity; ``index`` is only a label."""

    uuid: str
    index: int
    name: str
    pci_bus_id: str = ""
    serial: str = ""
    driver_version: str = ""
    architecture: str = ""
    #: Which backend family serves it (``BACKEND_PROPERTIES``): ``nvml`` or ``jetson``.
    family: str = "nvml"


@dataclass(frozen=True)
class Sample:
    """The values read from one GPU at ``ts_ms``. A property NVML cannot report is absent, never zero."""

    uuid: str
    ts_ms: int
    values: Mapping[str, Value]
    #: Errors met while sampling, by property (absent properties that are not simply unsupported).
    errors: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class PropertySource:
    """Where one property of a GPU comes from on this node, and why (a Jetson's: ``TegraBackend.property_sources``):
    ``source`` is ``sysfs`` (files under the board's root: sysfs, /proc, the device tree), ``nvpmodel``, ``nvml``,
    ``mapper`` (computed from what those serve) or "" (nothing on this board serves it: ``why`` says what is
    missing)."""

    source: str
    why: str = ""


@dataclass(frozen=True)
class Constraints:
    """What the GPU accepts, read at runtime."""

    power_limit_min_w: float | None = None
    power_limit_max_w: float | None = None
    power_limit_default_w: float | None = None
    #: Supported memory clocks (MHz), highest first; empty when unknown.
    memory_clocks_mhz: tuple[int, ...] = ()
    #: Supported graphics clocks (MHz) across all memory clocks, highest first; empty when unknown.
    graphics_clocks_mhz: tuple[int, ...] = ()
    #: Writable properties this GPU cannot set (learnt from NotSupported), by name.
    unsupported: frozenset[str] = frozenset()
    #: Jetson: the GPU frequencies devfreq offers (MHz), lowest first; empty elsewhere.
    gpu_freqs_mhz: tuple[float, ...] = ()
    #: Jetson: the nvpmodel power modes as (id, name), by id; empty elsewhere.
    power_modes: tuple[tuple[int, str], ...] = ()
    #: Jetson: the devfreq range (MHz) the power mode in force sets (what a removed desired range returns to).
    gpu_freq_default_mhz: tuple[float, float] | None = None
    #: Jetson: nvpmodel.conf's default power mode (what a removed desired mode returns to with restore_modes).
    power_mode_default: int | None = None


@dataclass(frozen=True)
class GpuEvent:
    """Something that happened on a GPU between samples (XID, ECC, GPU lost)."""

    uuid: str
    ts_ms: int
    kind: Literal["xid", "ecc_single", "ecc_double", "gpu_lost", "driver_reload"]
    xid: int = 0
    detail: str = ""


@dataclass(frozen=True)
class PolicyLimit:
    """A local policy's cap on one GPU. Policies may tighten, never loosen, what the cloud asked for:
    the reconciler applies ``min(cloud desired, every active limit)`` and reports ``overridden-<policy>``."""

    policy: str  # "thermal", "power-saving", "health"
    power_limit_w: float | None = None
    reason: str = ""
    #: The clocks actuator: an upper bound on the GPU (SM) clock in MHz, applied through the backend's locked GPU
    #: clocks (NVML ``nvmlDeviceSetGpuLockedClocks``; a Jetson backend: its devfreq ``max_freq``).
    clock_max_mhz: int | None = None


@dataclass(frozen=True)
class GpuProcess:
    """One process on one GPU as NVML reports it (host PID). None where NVML did not say."""

    pid: int
    #: ``compute``, ``graphics`` or ``compute+graphics``.
    kind: str = "compute"
    memory_used_bytes: int | None = None
    #: Shares of the GPU over NVML's samples since the previous process sample, 0..1.
    sm_ratio: float | None = None
    memory_ratio: float | None = None
    encoder_ratio: float | None = None
    decoder_ratio: float | None = None


@dataclass(frozen=True)
class ProcessSample:
    """The processes of one GPU at ``ts_ms``, with the GPU's energy counter read in the same job."""

    uuid: str
    ts_ms: int
    processes: tuple[GpuProcess, ...] = ()
    #: The GPU's energy counter (J since the driver loaded) and power (W), None where unsupported.
    energy_j: float | None = None
    power_w: float | None = None
    #: Which NVML call gave per-process utilisation: ``processes-utilization-info``, ``process-utilization``,
    #: or "" (none: unsupported, e.g. under MIG).
    utilization_source: str = ""
    #: What could not be read and why (``processes``, ``utilization``, ``energy``), twin-safe text.
    unsupported: Mapping[str, str] = field(default_factory=dict)


class ProcessSource(Protocol):
    """What the process cycle needs from a GPU library (``NvmlBackend.processes``); blocking, bounded, raises
    only ``mapper.errors`` types."""

    def processes(self, uuid: str) -> ProcessSample: ...


class GpuBackend(Protocol):
    """What the loops need from a GPU library. ``mapper.edge.gpu.nvml.NvmlBackend`` is the implementation.

    Every method is blocking (call it through ``asyncio.to_thread``), bounded by a timeout, and raises only
    ``mapper.errors`` types. GPUs are addressed by UUID.
    """

    def init(self) -> None: ...
    def shutdown(self) -> None: ...
    def driver_version(self) -> str: ...
    def list_gpus(self) -> list[GpuInfo]: ...
    def sample(self, uuid: str, properties: Iterable[str] | None = None) -> Sample: ...
    def constraints(self, uuid: str) -> Constraints: ...
    def set_power_limit(self, uuid: str, watts: float) -> float: ...
    def set_locked_gpu_clocks(self, uuid: str, min_mhz: int, max_mhz: int) -> None: ...
    def reset_locked_gpu_clocks(self, uuid: str) -> None: ...
    def set_locked_memory_clocks(self, uuid: str, min_mhz: int, max_mhz: int) -> None: ...
    def reset_locked_memory_clocks(self, uuid: str) -> None: ...
    def set_persistence_mode(self, uuid: str, enabled: bool) -> None: ...
    def set_compute_mode(self, uuid: str, mode: str) -> None: ...
    def poll_events(self) -> list[GpuEvent]: ...


class FrequencyActuator(Protocol):
    """What a backend offers where the GPU is governed by a devfreq range and power modes instead of a power cap
    (``mapper.edge.gpu.jetson.JetsonBackend``). Blocking, bounded, raises only ``mapper.errors`` types."""

    def set_gpu_freq_range(self, uuid: str, min_mhz: float, max_mhz: float) -> tuple[float, float]:
        """Set the GPU's devfreq range to two of ``Constraints.gpu_freqs_mhz``; the (min, max) read back."""
        ...

    def set_power_mode(self, uuid: str, mode_id: int) -> None:
        """Switch to nvpmodel mode ``mode_id``; ``PermanentError(reason="needs-reboot")`` where that needs a
        reboot the backend may not do."""
        ...


# --------------------------------------------------------------------------------------------------
# Devices and models as the mapper holds them (from DMI, from YAML files): plain, comparable values
# --------------------------------------------------------------------------------------------------

Scalar = str | float | int | bool


@dataclass(frozen=True)
class PushMqtt:
    """A property's ``pushMethod.mqtt`` from the Device spec."""

    address: str = ""
    topic: str = ""
    qos: int = 1
    retained: bool = False


@dataclass(frozen=True)
class PushNote:
    """A method a property names that the mapper does not honour, and why: ``refused`` (a bad value; ``message``
    starts with the field's path, e.g. ``spec.properties[0].pushMethod.http.port: ...``) or ignored (the framework
    honours one push method and one DB method per property: the first of each, docs/push.md). ``method`` is the
    method's name: http, mqtt, otel, anomalyDetection, influxdb2, redis, tdengine or mysql."""

    method: str
    message: str
    refused: bool = True
    #: The field that holds the bad value (``port``, ``tag.site``), for the ``push_status`` twin.
    field: str = ""


@dataclass(frozen=True)
class DeviceProperty:
    name: str
    #: ``spec.properties[].desired.value``; None when the Device sets no desired value.
    desired: str | None = None
    desired_metadata: Mapping[str, str] = field(default_factory=dict)
    #: Milliseconds; 0 = unset (the mapper's default applies).
    collect_cycle_ms: int = 0
    report_cycle_ms: int = 0
    report_to_cloud: bool = True
    push_mqtt: PushMqtt | None = None
    visitor_config: Mapping[str, Scalar] = field(default_factory=dict)
    #: ``pushMethod.http``, ``otel`` or ``anomalyDetection`` (the one push method honoured: the first of http,
    #: mqtt, otel, anomalyDetection; ``push_mqtt`` holds mqtt). None: none, or it was refused (``push_notes``).
    push: PushMethod | None = None
    #: ``pushMethod.dbMethod``: the one DB method honoured (the first of influxdb2, redis, tdengine, mysql).
    db: DbMethod | None = None
    #: Methods named but not honoured: refused (a bad value) or ignored (a second push or DB method).
    push_notes: tuple[PushNote, ...] = ()

    @property
    def pushes(self) -> bool:
        """Whether the property names any push or DB method (honoured or not)."""
        return self.push_mqtt is not None or self.push is not None or self.db is not None or bool(self.push_notes)


@dataclass(frozen=True)
class DeviceConfig:
    """One KubeEdge Device of protocol ``gpu``: a GPU of this node, addressed by its UUID."""

    namespace: str
    name: str
    model: str
    uuid: str
    properties: tuple[DeviceProperty, ...] = ()
    protocol_config: Mapping[str, Scalar] = field(default_factory=dict)
    #: Device-state reporting (v1.23 ``spec.stateReport``, <= v1.22 ``status.reportToCloud/reportCycle``).
    state_report_to_cloud: bool = True
    state_report_cycle_ms: int = 0

    @cached_property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @cached_property
    def _property_by_name(self) -> dict[str, DeviceProperty]:
        by_name: dict[str, DeviceProperty] = {}
        for p in self.properties:
            by_name.setdefault(p.name, p)  # the first of a name, as a scan finds it
        return by_name

    def property(self, name: str) -> DeviceProperty | None:
        return self._property_by_name.get(name)


@dataclass(frozen=True)
class ModelProperty:
    name: str
    ptype: str
    access_mode: str = "ReadOnly"
    unit: str = ""
    minimum: str = ""
    maximum: str = ""
    description: str = ""


@dataclass(frozen=True)
class DeviceModelConfig:
    namespace: str
    name: str
    properties: tuple[ModelProperty, ...] = ()

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


#: The reported value of a twin whose property this GPU cannot read (NVML answers NotSupported): the value
#: itself must say so, since EdgeCore's DMI server keeps only the values of a reported twin, not its metadata.
UNSUPPORTED_TWIN = "unsupported"


@dataclass(frozen=True)
class Twin:
    """One twin as reported to EdgeCore: both fields always present (EdgeCore crashes on a missing one)."""

    name: str
    observed_desired: str
    reported: str


# --------------------------------------------------------------------------------------------------
# Values <-> twin strings
# --------------------------------------------------------------------------------------------------


def twin_safe(text: str) -> str:
    """Make any text fit the twin value charset: runs of other characters become ``_``; at most 512 chars."""
    safe = _TWIN_UNSAFE.sub("_", text.strip())
    return safe[:512]


def format_number(value: float) -> str:
    """A float as a twin-safe decimal: no exponent, no ``+``, shortest form that round-trips to 3 decimals."""
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    text = f"{value:.3f}".rstrip("0").rstrip(".")
    return text if text not in ("-0", "") else "0"


def format_value(spec: PropertySpec, value: Value) -> str:
    """A sample value as a twin string (fits ``TWIN_VALUE_RE`` or is empty)."""
    if spec.ptype == "BOOLEAN":
        return "true" if value else "false"
    if spec.ptype == "INT":
        return str(int(value))
    if spec.ptype == "FLOAT":
        return format_number(float(value))
    return twin_safe(str(value))


_TRUE = frozenset({"true", "1", "on", "yes", "enabled"})
_FALSE = frozenset({"false", "0", "off", "no", "disabled"})


def parse_value(spec: PropertySpec, raw: Scalar) -> Value:
    """Parse a desired value (a twin string, or a number/bool from YAML or protobuf) by the property's type.

    Raises ``InvalidValueError`` whose ``reason`` is one of ``REJECT_REASONS``. Range checks against the GPU's
    own limits are the reconciler's job; this checks type and shape only.
    """
    name = spec.name
    if isinstance(raw, str):
        if raw == "" or raw.strip() == "":
            raise InvalidValueError(f"{name}: empty value", reason="empty")
        if len(raw) > MAX_RAW_VALUE_LEN:
            raise InvalidValueError(f"{name}: value of {len(raw)} chars exceeds {MAX_RAW_VALUE_LEN}", reason="too-long")
        if not raw.isascii():
            raise InvalidValueError(f"{name}: value {raw[:40]!r} is not ASCII", reason="non-ascii")
        text = raw.strip()
    else:
        text = ""
    if spec.ptype == "BOOLEAN":
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and text.lower() in _TRUE:
            return True
        if isinstance(raw, str) and text.lower() in _FALSE:
            return False
        raise InvalidValueError(f"{name}: {raw!r} is not a boolean (true/false)", reason="wrong-type")
    if spec.ptype == "STRING":
        if not isinstance(raw, str):
            raise InvalidValueError(f"{name}: {raw!r} is not a string", reason="wrong-type")
        return text
    # numbers
    if isinstance(raw, bool):
        raise InvalidValueError(f"{name}: {raw!r} is a boolean, not a number", reason="wrong-type")
    if isinstance(raw, str):
        try:
            number = float(text)
        except ValueError:
            raise InvalidValueError(f"{name}: {raw!r} is not a number", reason="not-a-number") from None
    else:
        number = float(raw)
    check_number(name, number)
    if spec.ptype == "INT":
        # FloatValue (float32) carries every CRD number: accept values that are integers after rounding.
        if number != int(number) and abs(number - round(number)) > 1e-3:
            raise InvalidValueError(f"{name}: {format_number(number)} is not an integer", reason="wrong-type")
        return round(number)
    return number


def check_number(name: str, number: float) -> float:
    """A finite, non-negative number, or ``InvalidValueError`` (reason nan, infinite or negative) naming it."""
    if math.isnan(number):
        raise InvalidValueError(f"{name}: NaN is not a value", reason="nan")
    if math.isinf(number):
        raise InvalidValueError(f"{name}: {number} is not finite", reason="infinite")
    if number < 0:
        raise InvalidValueError(f"{name}: {format_number(number)} is negative", reason="negative")
    return number


def clock_event_reasons_text(mask: int) -> str:
    """``0x24`` -> ``sw_power_cap,sw_thermal_slowdown``; ``0`` -> ``none``."""
    names = [n for bit, n in CLOCK_EVENT_REASONS if mask & bit]
    return ",".join(names) if names else "none"
