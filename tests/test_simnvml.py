"""The simulated NVML on its own: the pynvml surface, NVML's rules, and the physics (on fake time)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import pynvml
import pytest

from mapper.clock import FakeClock
from mapper.edge.config import SIM_COST_PROFILES
from mapper.edge.gpu.profiles import COST_PROFILES, PROFILES, profile
from mapper.edge.gpu.simnvml import SCENARIOS, SimNvml, burn_cpu

SW_POWER_CAP = pynvml.nvmlClocksEventReasonSwPowerCap
SW_THERMAL = pynvml.nvmlClocksEventReasonSwThermalSlowdown
HW_THERMAL = pynvml.nvmlClocksEventReasonHwThermalSlowdown
HW_SLOWDOWN = pynvml.nvmlClocksEventReasonHwSlowdown
GPU_IDLE = pynvml.nvmlClocksEventReasonGpuIdle


def make(clock: FakeClock, *profiles: str, **kwargs: object) -> SimNvml:
    sim = SimNvml.from_profiles(profiles or ("H100",), seed=kwargs.pop("seed", 7), clock=clock.monotonic, **kwargs)  # type: ignore[arg-type]
    sim.nvmlInit()
    return sim


def handle(sim: SimNvml, index: int = 0) -> object:
    return sim.nvmlDeviceGetHandleByIndex(index)


# --------------------------------------------------------------------------------------------------
# Surface
# --------------------------------------------------------------------------------------------------


def test_constants_and_error_classes_are_the_real_bindings(fake_clock: FakeClock) -> None:
    sim = make(fake_clock)
    assert sim.NVML_CLOCK_SM == pynvml.NVML_CLOCK_SM
    assert sim.NVML_FI_DEV_ENERGY == pynvml.NVML_FI_DEV_ENERGY
    assert sim.nvmlClocksEventReasonSwPowerCap == pynvml.nvmlClocksEventReasonSwPowerCap
    assert sim.NVMLError is pynvml.NVMLError
    assert sim.NVMLError_NotSupported is pynvml.NVMLError_NotSupported
    with pytest.raises(pynvml.NVMLError_NotSupported) as info:
        sim.nvmlDeviceGetFanSpeed(handle(sim))
    assert info.value.value == pynvml.NVML_ERROR_NOT_SUPPORTED


def test_uuids_look_real_and_follow_the_seed(fake_clock: FakeClock) -> None:
    a = SimNvml(4, "H100", seed=1, clock=fake_clock.monotonic)
    b = SimNvml(4, "H100", seed=1, clock=fake_clock.monotonic)
    c = SimNvml(4, "H100", seed=2, clock=fake_clock.monotonic)
    pattern = re.compile(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
    uuids = [g.uuid for g in a.gpus]
    assert all(pattern.fullmatch(u) for u in uuids)
    assert len(set(uuids)) == 4
    assert uuids == [g.uuid for g in b.gpus]
    assert set(uuids).isdisjoint(g.uuid for g in c.gpus)


def test_handles_are_found_by_index_uuid_and_pci_bus_id(fake_clock: FakeClock) -> None:
    sim = make(fake_clock, "H100", "T4")
    gpu = sim.gpus[1]
    by_index = sim.nvmlDeviceGetHandleByIndex(1)
    assert sim.nvmlDeviceGetHandleByUUID(gpu.uuid) is by_index
    assert sim.nvmlDeviceGetHandleByPciBusId(gpu.pci.busId) is by_index
    assert sim.nvmlDeviceGetName(by_index) == "Tesla T4"
    assert sim.nvmlDeviceGetArchitecture(by_index) == pynvml.NVML_DEVICE_ARCH_TURING
    with pytest.raises(pynvml.NVMLError_NotFound):
        sim.nvmlDeviceGetHandleByUUID("GPU-00000000-0000-0000-0000-000000000000")


def test_calls_before_init_raise_uninitialized(fake_clock: FakeClock) -> None:
    sim = SimNvml(1, clock=fake_clock.monotonic)
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        sim.nvmlDeviceGetCount()
    sim.nvmlInit()
    assert sim.nvmlDeviceGetCount() == 1
    sim.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        sim.nvmlDeviceGetCount()


def test_field_values_carry_a_status_per_field(fake_clock: FakeClock) -> None:
    sim = make(fake_clock, "H100", "T4")
    fake_clock.advance(10)
    h100 = sim.nvmlDeviceGetFieldValues(handle(sim, 0), [pynvml.NVML_FI_DEV_MEMORY_TEMP, pynvml.NVML_FI_DEV_ENERGY])
    t4 = sim.nvmlDeviceGetFieldValues(handle(sim, 1), [pynvml.NVML_FI_DEV_MEMORY_TEMP, pynvml.NVML_FI_DEV_ENERGY])
    assert [f.nvmlReturn for f in h100] == [pynvml.NVML_SUCCESS, pynvml.NVML_SUCCESS]
    assert h100[0].valueType == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT and h100[0].value.uiVal > 20
    assert h100[1].valueType == pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
    assert h100[1].value.ullVal == pytest.approx(72 * 10 * 1000, rel=0.02)  # 72 W idle for 10 s, in mJ
    assert t4[0].nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED  # no HBM, no memory temperature
    assert t4[1].nvmlReturn == pynvml.NVML_SUCCESS


def test_capability_matrix_follows_the_profiles(fake_clock: FakeClock) -> None:
    sim = make(fake_clock, "H100", "T4", "RTX4080S")
    h100, t4, rtx = (handle(sim, i) for i in range(3))
    with pytest.raises(pynvml.NVMLError_NotSupported):
        sim.nvmlDeviceGetFanSpeed(h100)  # passive datacenter card
    assert 0 <= sim.nvmlDeviceGetFanSpeed(rtx) <= 100
    with pytest.raises(pynvml.NVMLError_NotSupported):
        sim.nvmlDeviceSetMemoryLockedClocks(t4, 5001, 5001)  # Ampere+ only
    with pytest.raises(pynvml.NVMLError_NotSupported):
        sim.nvmlDeviceGetRemappedRows(t4)
    assert sim.nvmlDeviceGetRemappedRows(h100) == (0, 0, 0, 0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        sim.nvmlDeviceGetTotalEccErrors(rtx, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_VOLATILE_ECC)


def test_an_older_driver_lacks_newer_functions(fake_clock: FakeClock) -> None:
    sim = make(fake_clock, driver_version="530.30.02")
    if hasattr(pynvml, "nvmlDeviceGetTemperatureV"):  # (nvidia-ml-py 12.535 has no such wrapper, nor the sim)
        with pytest.raises(pynvml.NVMLError_FunctionNotFound):
            sim.nvmlDeviceGetTemperatureV(handle(sim), pynvml.NVML_TEMPERATURE_GPU)
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        sim.nvmlDeviceGetCurrentClocksEventReasons(handle(sim))
    assert sim.nvmlDeviceGetTemperature(handle(sim), pynvml.NVML_TEMPERATURE_GPU) > 0
    assert sim.nvmlDeviceGetCurrentClocksThrottleReasons(handle(sim)) == GPU_IDLE  # the name before r535


@pytest.mark.parametrize(("driver", "energy_status"), [("530.30.02", 2), ("535.104.05", 0), ("590.48.01", 0)])
def test_the_energy_field_is_an_invalid_argument_before_r535(
    driver: str, energy_status: int, fake_clock: FakeClock
) -> None:
    sim = make(fake_clock, driver_version=driver)
    fake_clock.advance(10)
    memory_temp, energy = sim.nvmlDeviceGetFieldValues(
        handle(sim), [pynvml.NVML_FI_DEV_MEMORY_TEMP, pynvml.NVML_FI_DEV_ENERGY]
    )
    assert energy.nvmlReturn == energy_status  # 2: NVML_ERROR_INVALID_ARGUMENT, the id is past the driver's table
    assert memory_temp.nvmlReturn == pynvml.NVML_SUCCESS
    assert sim.nvmlDeviceGetTotalEnergyConsumption(handle(sim)) == pytest.approx(72 * 10 * 1000, rel=0.02)  # mJ


def test_a_reload_can_bring_another_driver_with_its_functions_and_fields(fake_clock: FakeClock) -> None:
    sim = make(fake_clock, driver_version="530.30.02")
    sim.driver_reload(driver_version="590.48.01")
    sim.nvmlInit()
    assert sim.nvmlSystemGetDriverVersion() == "590.48.01"
    assert sim.nvmlDeviceGetCurrentClocksEventReasons(handle(sim)) == GPU_IDLE
    (energy,) = sim.nvmlDeviceGetFieldValues(handle(sim), [pynvml.NVML_FI_DEV_ENERGY])
    assert energy.nvmlReturn == pynvml.NVML_SUCCESS
    sim.driver_reload(driver_version="470.223.02")
    sim.nvmlInit()
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        sim.nvmlDeviceGetCurrentClocksEventReasons(handle(sim))
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        sim.nvmlDeviceGetMemoryInfo(handle(sim), version=pynvml.nvmlMemory_v2)
    (energy,) = sim.nvmlDeviceGetFieldValues(handle(sim), [pynvml.NVML_FI_DEV_ENERGY])
    assert energy.nvmlReturn == pynvml.NVML_ERROR_INVALID_ARGUMENT
    sim.driver_reload()  # the same driver again
    sim.nvmlInit()
    assert sim.nvmlSystemGetDriverVersion() == "470.223.02"


def test_memory_v1_counts_reserved_memory_as_used_and_v2_keeps_it_apart(fake_clock: FakeClock) -> None:
    sim = make(fake_clock, "A100", scenario="training")
    fake_clock.advance(30)
    prof = profile("A100")
    reserved = prof.memory_reserved_bytes
    assert 100 * 2**20 < reserved < 2**30  # hundreds of MiB
    v1 = sim.nvmlDeviceGetMemoryInfo(handle(sim))
    v2 = sim.nvmlDeviceGetMemoryInfo(handle(sim), version=pynvml.nvmlMemory_v2)
    assert v1.total == v2.total == prof.memory_total_bytes
    assert v1.used == v2.used + v2.reserved and v2.reserved == reserved
    assert v1.free == v2.free == v1.total - v1.used
    assert v2.version == pynvml.nvmlMemory_v2
    assert not hasattr(v1, "reserved")  # c_nvmlMemory_t has none
    with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
        sim.nvmlDeviceGetMemoryInfo(handle(sim), version=0x01000020)
    old = make(fake_clock, "A100", driver_version="470.223.02")
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        old.nvmlDeviceGetMemoryInfo(handle(old), version=pynvml.nvmlMemory_v2)
    assert old.nvmlDeviceGetMemoryInfo(handle(old)).used >= reserved


def test_versioned_calls_default_to_the_bindings_version_and_refuse_others(fake_clock: FakeClock) -> None:
    sim = make(fake_clock)
    h = handle(sim)
    if hasattr(pynvml, "nvmlDeviceGetTemperatureV"):
        assert sim.nvmlDeviceGetTemperatureV(h, pynvml.NVML_TEMPERATURE_GPU) > 0  # version=nvmlTemperature_v1
        with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
            sim.nvmlDeviceGetTemperatureV(h, pynvml.NVML_TEMPERATURE_GPU, 0)
    else:
        assert not hasattr(sim, "nvmlDeviceGetTemperatureV")  # the installed binding has no such function
    assert sim.nvmlDeviceSetPowerManagementLimit_v2(h, 0, 300_000) == pynvml.NVML_SUCCESS
    assert sim.nvmlDeviceGetPowerManagementLimit(h) == 300_000


def test_no_gpus_is_gpu_not_found_at_init_even_with_a_binding_that_lacks_the_name(fake_clock: FakeClock) -> None:
    sim = SimNvml(0, clock=fake_clock.monotonic)
    with pytest.raises(pynvml.NVMLError) as info:
        sim.nvmlInit()
    assert info.value.value == 28  # NVML_ERROR_GPU_NOT_FOUND (nvidia-ml-py 12.535 has no constant for it)
    sim.nvmlInitWithFlags(pynvml.NVML_INIT_FLAG_NO_GPUS)
    assert sim.nvmlDeviceGetCount() == 0


def test_unknown_profile_and_scenario_are_named_in_the_error(fake_clock: FakeClock) -> None:
    with pytest.raises(ValueError, match=r"unknown GPU profile 'B300'.*H100"):
        SimNvml(1, "B300", clock=fake_clock.monotonic)
    sim = make(fake_clock)
    with pytest.raises(ValueError, match=r"unknown scenario 'gaming'.*training"):
        sim.set_scenario(None, "gaming")


# --------------------------------------------------------------------------------------------------
# NVML's rules for setters
# --------------------------------------------------------------------------------------------------


def test_power_limit_outside_the_constraints_is_an_invalid_argument(fake_clock: FakeClock) -> None:
    sim = make(fake_clock)
    h = handle(sim)
    sim.nvmlDeviceSetPowerManagementLimit(h, 350_000)
    assert sim.nvmlDeviceGetPowerManagementLimit(h) == 350_000
    for bad in (199_999, 700_001):
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            sim.nvmlDeviceSetPowerManagementLimit(h, bad)
    assert sim.nvmlDeviceGetPowerManagementLimit(h) == 350_000
    with pytest.raises(TypeError):
        sim.nvmlDeviceSetPowerManagementLimit(h, 350.5)  # ctypes.c_uint refuses floats


def test_the_v2_power_setter_always_succeeds_like_the_buggy_binding(fake_clock: FakeClock) -> None:
    sim = make(fake_clock)
    h = handle(sim)
    assert sim.nvmlDeviceSetPowerManagementLimit_v2(h, 0, 900_000) == pynvml.NVML_SUCCESS
    assert sim.nvmlDeviceGetPowerManagementLimit(h) == 700_000  # silently not applied
    sim.set_as_root(False)
    assert sim.nvmlDeviceSetPowerManagementLimit_v2(h, 0, 300_000) == pynvml.NVML_SUCCESS
    assert sim.nvmlDeviceGetPowerManagementLimit(h) == 700_000


def test_setters_need_root(fake_clock: FakeClock) -> None:
    sim = make(fake_clock, as_root=False)
    h = handle(sim)
    calls = [
        lambda: sim.nvmlDeviceSetPowerManagementLimit(h, 300_000),
        lambda: sim.nvmlDeviceSetGpuLockedClocks(h, 1980, 1980),
        lambda: sim.nvmlDeviceResetGpuLockedClocks(h),
        lambda: sim.nvmlDeviceSetMemoryLockedClocks(h, 2619, 2619),
        lambda: sim.nvmlDeviceResetMemoryLockedClocks(h),
        lambda: sim.nvmlDeviceSetPersistenceMode(h, 1),
        lambda: sim.nvmlDeviceSetComputeMode(h, pynvml.NVML_COMPUTEMODE_PROHIBITED),
    ]
    for call in calls:
        with pytest.raises(pynvml.NVMLError_NoPermission):
            call()
    assert sim.gpus[0].power_limit_mw == 700_000


def test_locked_clocks_must_be_supported_and_not_mix_numeric_with_symbolic(fake_clock: FakeClock) -> None:
    sim = make(fake_clock)
    h = handle(sim)
    supported = sim.nvmlDeviceGetSupportedGraphicsClocks(h, 2619)
    assert supported[0] == 1980 and supported[-1] == 345 and 1500 in supported
    sim.nvmlDeviceSetGpuLockedClocks(h, 1500, 1500)
    assert sim.gpus[0].locked_gpu_clocks == (1500, 1500)
    for lo, hi in ((1000, 1500), (1500, 1005), (pynvml.NVML_CLOCK_LIMIT_ID_TDP, 1500)):
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            sim.nvmlDeviceSetGpuLockedClocks(h, lo, hi)
    assert sim.gpus[0].locked_gpu_clocks == (1500, 1500)
    unlimited = pynvml.NVML_CLOCK_LIMIT_ID_UNLIMITED
    sim.nvmlDeviceSetGpuLockedClocks(h, unlimited, unlimited)
    assert sim.gpus[0].locked_gpu_clocks is None
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        sim.nvmlDeviceSetMemoryLockedClocks(h, 1593, 1593)  # not an H100 memory clock


def test_compute_and_persistence_modes_accept_only_nvml_values(fake_clock: FakeClock) -> None:
    sim = make(fake_clock)
    h = handle(sim)
    sim.nvmlDeviceSetComputeMode(h, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        sim.nvmlDeviceSetComputeMode(h, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_THREAD)  # removed from NVML
    assert sim.nvmlDeviceGetComputeMode(h) == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    sim.nvmlDeviceSetPersistenceMode(h, 1)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        sim.nvmlDeviceSetPersistenceMode(h, 2)
    assert sim.nvmlDeviceGetPersistenceMode(h) == 1


# --------------------------------------------------------------------------------------------------
# Physics
# --------------------------------------------------------------------------------------------------


def test_a_lower_power_cap_lowers_power_and_sm_clock(fake_clock: FakeClock) -> None:
    sim = make(fake_clock, "H100", "H100", scenario="heat")
    sim.set_scenario(None, "steady")
    sim.set_utilization(None, 100)
    capped, free = handle(sim, 0), handle(sim, 1)
    sim.nvmlDeviceSetPowerManagementLimit(capped, 300_000)
    fake_clock.advance(30)
    assert sim.nvmlDeviceGetPowerUsage(capped) == pytest.approx(300_000, rel=0.01)
    assert sim.nvmlDeviceGetPowerUsage(free) > 600_000
    assert sim.nvmlDeviceGetCurrentClocksEventReasons(capped) & SW_POWER_CAP
    assert not sim.nvmlDeviceGetCurrentClocksEventReasons(free) & SW_POWER_CAP
    sm = pynvml.NVML_CLOCK_SM
    assert sim.nvmlDeviceGetClockInfo(capped, sm) < sim.nvmlDeviceGetClockInfo(free, sm) == 1980


def test_temperature_converges_to_the_first_order_steady_state(fake_clock: FakeClock) -> None:
    sim = make(fake_clock)
    sim.set_utilization(None, 80)
    h = handle(sim)
    gpu = sim.gpus[0]
    start = sim.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)
    fake_clock.advance(600)
    settled = sim.gpu(gpu.uuid).temperature_c
    steady = gpu.ambient_c + gpu.power_w * gpu.thermal_r
    assert settled == pytest.approx(steady, abs=0.5)
    assert settled > start + 10
    fake_clock.advance(600)
    assert sim.gpu(gpu.uuid).temperature_c == pytest.approx(settled, abs=0.2)


def test_heat_scenario_crosses_85c_under_the_default_cap_and_a_lower_cap_cools_it(fake_clock: FakeClock) -> None:
    sim = make(fake_clock, "H100", "H100", scenario="heat")
    hot, capped = handle(sim, 0), handle(sim, 1)
    sim.nvmlDeviceSetPowerManagementLimit(capped, 450_000)
    fake_clock.advance(300)
    temp = pynvml.NVML_TEMPERATURE_GPU
    assert sim.nvmlDeviceGetTemperature(hot, temp) > 85
    assert sim.nvmlDeviceGetCurrentClocksEventReasons(hot) & SW_THERMAL
    assert sim.nvmlDeviceGetTemperature(capped, temp) < 80


def test_hw_slowdown_halves_the_clock_and_shutdown_loses_the_gpu(fake_clock: FakeClock) -> None:
    sim = make(fake_clock, scenario="steady")
    sim.set_utilization(None, 100)
    h = handle(sim)
    event_set = sim.nvmlEventSetCreate()
    sim.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, event_set)
    sim.set_ambient_c(None, 88)  # broken cooling: a hot inlet
    fake_clock.advance(300)
    reasons = sim.nvmlDeviceGetCurrentClocksEventReasons(h)
    assert reasons & HW_THERMAL and reasons & HW_SLOWDOWN
    assert sim.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM) <= 1980 // 2 + 15
    sim.set_ambient_c(None, 95)
    fake_clock.advance(120)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        sim.nvmlDeviceGetPowerUsage(h)
    event = sim.nvmlEventSetWait(event_set, 0)
    assert (event.eventType, event.eventData) == (pynvml.nvmlEventTypeXidCriticalError, 79)


def test_energy_counter_grows_with_power(fake_clock: FakeClock) -> None:
    sim = make(fake_clock, "H100", "H100")
    sim.set_utilization(sim.gpus[1].uuid, 100)
    fake_clock.advance(100)
    idle = sim.nvmlDeviceGetTotalEnergyConsumption(handle(sim, 0))
    busy = sim.nvmlDeviceGetTotalEnergyConsumption(handle(sim, 1))
    assert idle == pytest.approx(72 * 100 * 1000, rel=0.01)  # mJ
    assert busy > 8 * idle
    fake_clock.advance(10)
    assert sim.nvmlDeviceGetTotalEnergyConsumption(handle(sim, 1)) > busy


def test_gpu_idle_bit_at_idle_and_no_bits_under_full_unthrottled_load(fake_clock: FakeClock) -> None:
    sim = make(fake_clock, "H100", "T4")
    fake_clock.advance(5)
    assert sim.nvmlDeviceGetCurrentClocksEventReasons(handle(sim)) == GPU_IDLE
    assert sim.nvmlDeviceGetPerformanceState(handle(sim, 1)) == 8  # inference cards idle in P8
    assert sim.nvmlDeviceGetClockInfo(handle(sim), pynvml.NVML_CLOCK_SM) == 345
    sim.set_utilization(None, 90)
    fake_clock.advance(5)
    assert sim.nvmlDeviceGetCurrentClocksEventReasons(handle(sim)) == 0
    assert sim.nvmlDeviceGetPerformanceState(handle(sim, 1)) == 0


def test_power_is_averaged_over_1s_on_hopper_but_instantaneous_on_ga100(fake_clock: FakeClock) -> None:
    sim = make(fake_clock, "H100", "A100")
    fake_clock.advance(5)
    sim.set_utilization(None, 100)
    fake_clock.advance(0.2)
    h100 = sim.nvmlDeviceGetPowerUsage(handle(sim, 0)) / 1000
    a100 = sim.nvmlDeviceGetPowerUsage(handle(sim, 1)) / 1000
    assert h100 < 0.5 * profile("H100").load_power_w  # still catching up
    assert a100 == pytest.approx(profile("A100").load_power_w, rel=0.01)


def test_scenarios_are_deterministic_from_the_seed(fake_clock: FakeClock) -> None:
    def trace(seed: int) -> list[tuple[int, int]]:
        clock = FakeClock()
        sim = make(clock, "L4", seed=seed, scenario="inference")
        h = handle(sim)
        out = []
        for _ in range(40):
            clock.advance(0.5)
            out.append((sim.nvmlDeviceGetUtilizationRates(h).gpu, sim.nvmlDeviceGetPowerUsage(h)))
        return out

    first = trace(3)
    assert first == trace(3)
    assert first != trace(4)
    utils = [u for u, _ in first]
    assert min(utils) == 0 and max(utils) > 70  # bursty


def test_oscillating_load_swings_the_temperature(fake_clock: FakeClock) -> None:
    sim = make(fake_clock, scenario="oscillating")
    h = handle(sim)
    temps = []
    for _ in range(48):
        fake_clock.advance(5)
        temps.append(sim.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU))
    assert max(temps[24:]) - min(temps[24:]) > 10


def test_every_profile_and_scenario_runs_an_hour_without_nan(fake_clock: FakeClock) -> None:
    sim = make(fake_clock, *PROFILES)
    for scenario in SCENARIOS:
        sim.set_scenario(None, scenario)
        fake_clock.advance(600)
        for gpu in sim.gpus:
            g = sim.gpu(gpu.uuid)
            assert g.profile.idle_power_w * 0.99 <= g.power_w <= g.profile.power_limit_max_w
            assert g.ambient_c - 1 <= g.temperature_c < g.profile.shutdown_c
            assert not g.lost


# --------------------------------------------------------------------------------------------------
# Faults and the control surface
# --------------------------------------------------------------------------------------------------


def test_driver_reload_loses_settings_resets_energy_and_invalidates_handles(fake_clock: FakeClock) -> None:
    sim = make(fake_clock)
    h = handle(sim)
    sim.nvmlDeviceSetPowerManagementLimit(h, 300_000)
    sim.nvmlDeviceSetGpuLockedClocks(h, 1500, 1500)
    sim.nvmlDeviceSetMemoryLockedClocks(h, 2619, 2619)
    sim.nvmlDeviceSetPersistenceMode(h, 1)
    sim.nvmlDeviceSetComputeMode(h, pynvml.NVML_COMPUTEMODE_PROHIBITED)
    fake_clock.advance(100)
    assert sim.nvmlDeviceGetTotalEnergyConsumption(h) > 1000
    sim.driver_reload()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        sim.nvmlDeviceGetPowerUsage(h)
    sim.nvmlInit()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        sim.nvmlDeviceGetPowerUsage(h)  # old handle
    fresh = handle(sim)
    assert sim.nvmlDeviceGetPowerManagementLimit(fresh) == 700_000
    assert sim.nvmlDeviceGetPersistenceMode(fresh) == 0
    assert sim.nvmlDeviceGetComputeMode(fresh) == pynvml.NVML_COMPUTEMODE_DEFAULT
    assert sim.gpus[0].locked_gpu_clocks is None and sim.gpus[0].locked_memory_clocks is None
    assert sim.nvmlDeviceGetTotalEnergyConsumption(fresh) == 0


def test_injected_errors_hit_the_named_function_the_given_number_of_times(fake_clock: FakeClock) -> None:
    sim = make(fake_clock, "H100", "H100")
    target = sim.gpus[1].uuid
    sim.inject_errors("nvmlDeviceGetPowerUsage", pynvml.NVML_ERROR_UNKNOWN, 2, uuid=target)
    assert sim.nvmlDeviceGetPowerUsage(handle(sim, 0)) > 0  # the other GPU is unaffected
    for _ in range(2):
        with pytest.raises(pynvml.NVMLError_Unknown):
            sim.nvmlDeviceGetPowerUsage(handle(sim, 1))
    assert sim.nvmlDeviceGetPowerUsage(handle(sim, 1)) > 0
    with pytest.raises(ValueError, match="nvmlDeviceGetPowerUse"):
        sim.inject_errors("nvmlDeviceGetPowerUse", pynvml.NVML_ERROR_UNKNOWN)


def test_events_reach_only_sets_registered_for_them(fake_clock: FakeClock) -> None:
    sim = make(fake_clock)
    h = handle(sim)
    uuid = sim.gpus[0].uuid
    sim.inject_xid(uuid, 13)  # before registration: not recorded
    event_set = sim.nvmlEventSetCreate()
    sim.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, event_set)
    with pytest.raises(pynvml.NVMLError_Timeout):
        sim.nvmlEventSetWait(event_set, 100)
    sim.inject_xid(uuid, 43)
    sim.inject_ecc(uuid, corrected=1)  # not registered for ECC
    data = sim.nvmlEventSetWait(event_set, 0)
    assert (data.eventType, data.eventData, data.device) == (pynvml.nvmlEventTypeXidCriticalError, 43, h)
    with pytest.raises(pynvml.NVMLError_Timeout):
        sim.nvmlEventSetWait(event_set, 0)
    sim.nvmlEventSetFree(event_set)


def test_gpu_lost_makes_every_call_on_that_gpu_fail(fake_clock: FakeClock) -> None:
    sim = make(fake_clock, "H100", "H100")
    lost = handle(sim, 0)
    sim.inject_gpu_lost(sim.gpus[0].uuid)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        sim.nvmlDeviceGetTemperature(lost, pynvml.NVML_TEMPERATURE_GPU)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        sim.nvmlDeviceGetHandleByUUID(sim.gpus[0].uuid)
    assert sim.nvmlDeviceGetPowerUsage(handle(sim, 1)) > 0


# --------------------------------------------------------------------------------------------------
# What calls cost (cost profiles)
# --------------------------------------------------------------------------------------------------

H200_COST = COST_PROFILES["h200"]
ENERGY_FIELD = pynvml.NVML_FI_DEV_ENERGY
MEMORY_TEMP_FIELD = pynvml.NVML_FI_DEV_MEMORY_TEMP


def thread_cpu_s(call: Callable[[], object], times: int) -> float:
    """CPU time of this thread for ``times`` calls (what a CPU benchmark of the caller sees)."""
    start = time.thread_time()
    for _ in range(times):
        call()
    return time.thread_time() - start


def test_the_h200_profile_burns_each_calls_cpu_on_the_calling_thread(fake_clock: FakeClock) -> None:
    sim = make(fake_clock, "H200", cost="h200")
    h = handle(sim)
    energy_s = H200_COST.call("nvmlDeviceGetTotalEnergyConsumption").cpu_s
    limit_s = H200_COST.call("nvmlDeviceGetPowerManagementLimit").cpu_s
    calls: list[tuple[Callable[[], object], float]] = [
        (lambda: sim.nvmlDeviceGetTotalEnergyConsumption(h), energy_s),
        (lambda: sim.nvmlDeviceGetPowerManagementLimit(h), limit_s),
        (lambda: sim.nvmlDeviceGetFieldValues(h, [ENERGY_FIELD]), H200_COST.fields[ENERGY_FIELD].cpu_s),
    ]
    charged_before_s = sim.charged_cpu_s  # (init and the handle cost a getter's microsecond each)
    for call, cost_s in calls:
        expected_s = 5 * cost_s
        spent_s = thread_cpu_s(call, 5)
        # at least what the profile says (the burn counts this thread's CPU), not wildly more (the simulator's own
        # work is a few microseconds a call)
        assert expected_s <= spent_s < 1.5 * expected_s + 0.005, (spent_s, expected_s)
    assert sim.charged_cpu_s - charged_before_s == pytest.approx(sum(5 * c for _, c in calls))
    assert sim.cost_profile == "h200"


def test_a_field_batch_costs_what_its_dearest_field_costs_and_memory_temperature_alone_is_cheap(
    fake_clock: FakeClock,
) -> None:
    sim = make(fake_clock, "H200", cost="h200")
    h = handle(sim)
    energy_s = H200_COST.fields[ENERGY_FIELD].cpu_s
    batch_s = thread_cpu_s(lambda: sim.nvmlDeviceGetFieldValues(h, [MEMORY_TEMP_FIELD, ENERGY_FIELD]), 5)
    assert 5 * energy_s <= batch_s < 5 * energy_s * 1.5 + 0.005  # the dearest field's cost, not the sum of both
    twice_s = thread_cpu_s(lambda: sim.nvmlDeviceGetFieldValues(h, [ENERGY_FIELD, ENERGY_FIELD]), 5)
    assert 5 * energy_s <= twice_s < 5 * energy_s * 1.5 + 0.005  # the same field twice: still one field's cost
    alone_s = thread_cpu_s(lambda: sim.nvmlDeviceGetFieldValues(h, [MEMORY_TEMP_FIELD]), 20)
    assert alone_s < 20 * (H200_COST.fields[MEMORY_TEMP_FIELD].cpu_s + 200e-6)  # far below one energy read
    assert alone_s < energy_s


def test_a_blocking_call_waits_without_burning_cpu(fake_clock: FakeClock) -> None:
    sim = make(fake_clock, "H200", cost="h200")
    h = handle(sim)
    cost = H200_COST.call("nvmlDeviceGetPcieThroughput")
    assert cost.block_s > 10 * cost.cpu_s  # the table's: ~20 ms wall, 0.79 ms CPU
    blocked_before_s = sim.charged_block_s
    wall = time.perf_counter()
    spent_s = thread_cpu_s(lambda: sim.nvmlDeviceGetPcieThroughput(h, pynvml.NVML_PCIE_UTIL_TX_BYTES), 3)
    wall_s = time.perf_counter() - wall
    assert wall_s >= 3 * cost.wall_s
    assert 3 * cost.cpu_s <= spent_s < 3 * (cost.cpu_s + cost.block_s / 4)
    assert sim.charged_block_s - blocked_before_s == pytest.approx(3 * cost.block_s)


def test_the_none_profile_charges_nothing_measurable(fake_clock: FakeClock) -> None:
    sim = make(fake_clock, "H200")  # the default
    h = handle(sim)
    assert sim.cost_profile == "none"
    energy_s = H200_COST.call("nvmlDeviceGetTotalEnergyConsumption").cpu_s
    spent_s = thread_cpu_s(lambda: sim.nvmlDeviceGetTotalEnergyConsumption(h), 50)
    assert spent_s < 50 * energy_s / 20  # the simulator's own work only: a few microseconds a call
    wall = time.perf_counter()
    for _ in range(5):
        sim.nvmlDeviceGetPcieThroughput(h, pynvml.NVML_PCIE_UTIL_RX_BYTES)
    assert time.perf_counter() - wall < H200_COST.call("nvmlDeviceGetPcieThroughput").block_s
    assert sim.charged_cpu_s == sim.charged_block_s == 0.0
    sim.set_cost("h200")
    assert thread_cpu_s(lambda: sim.nvmlDeviceGetTotalEnergyConsumption(h), 2) >= 2 * energy_s
    with pytest.raises(ValueError, match=r"unknown NVML cost profile 'h100'.*none, h200"):
        sim.set_cost("h100")


def test_the_config_knows_the_same_cost_profiles_as_the_simulator() -> None:
    assert tuple(COST_PROFILES) == SIM_COST_PROFILES
    assert COST_PROFILES["none"].free and not COST_PROFILES["h200"].free


def test_burn_cpu_burns_about_what_it_is_asked_on_this_thread() -> None:
    for seconds in (2e-6, 50e-6, 2e-3):
        spent_s = thread_cpu_s(lambda s=seconds: burn_cpu(s), 20)  # type: ignore[misc]
        assert 20 * seconds * 0.5 <= spent_s < 20 * (seconds * 1.5 + 20e-6), (seconds, spent_s)
