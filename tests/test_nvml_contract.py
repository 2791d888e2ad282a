"""The contract of NvmlBackend (mapper.shared.model.GpuBackend), run over the simulated NVML.

The simulator is the only stand-in: the backend code is the one that runs over the real pynvml. Every test that
builds its backend with ``build`` runs three times (the ``backends`` fixture's layers): over ``SimNvml``
directly, and over the REAL binding's ctypes wrappers with the simulator below the C ABI
(``tests/nvml_standin.py``), for the installed nvidia-ml-py and for the oldest pyproject allows.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pynvml
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mapper.clock import FakeClock
from mapper.edge.gpu.nvml import NvmlBackend, _Memo
from mapper.edge.gpu.profiles import PROFILES, GpuProfile
from mapper.edge.gpu.simnvml import SimNvml
from mapper.errors import (
    GpuLostError,
    InvalidValueError,
    MapperError,
    NoPermissionError,
    NotFoundError,
    PermanentError,
    ReadBackMismatchError,
    TransientError,
    UnsupportedError,
)
from mapper.shared.model import (
    COMPUTE_MODES,
    NVML_PROPERTIES,
    PROPERTY_BY_NAME,
    TWIN_VALUE_RE,
    GpuBackend,
    Sample,
    clock_event_reasons_text,
    format_value,
)
from tests.nvml_standin import LAYERS, StandIn, binding_for, layer_id, standin_library

PYTHON_TYPES = {"INT": int, "FLOAT": float, "BOOLEAN": bool, "STRING": str}


class Backends(list[NvmlBackend]):
    """The backends a test built, and how they reach their simulator (``layer``)."""

    def __init__(self, layer: str) -> None:
        super().__init__()
        self.layer = layer
        self.standins: list[StandIn] = []

    def over(self, sim: SimNvml) -> Any:
        """What NvmlBackend gets for ``sim`` in this layer: the simulator, or a binding over the stand-in."""
        if self.layer == "sim":
            return sim
        standin = StandIn(sim, standin_library(), binding_for(self.layer))
        self.standins.append(standin)
        return standin.pynvml


@pytest.fixture(params=LAYERS, ids=layer_id)
def backends(request: pytest.FixtureRequest) -> Iterator[Backends]:
    made = Backends(request.param)
    yield made
    for backend in made:
        backend.shutdown()
    for standin in made.standins:
        standin.close()
        assert standin.failures == [], "a stand-in callback failed:\n" + "\n".join(standin.failures)


#: The backend's options for the contract: values of the moment they are asked for (the energy counter read at
#: every sample, PCIe throughput in the sample's own job). What the mapper does by default instead (the counter
#: derived between reads, the blocking reads on a thread of their own) has its own tests below ("Dear reads").
CONTRACT_OPTIONS = {"energy_read_s": 0.0, "blocking_thread": False}


def build(
    clock: FakeClock, backends: Backends, *profiles: str, **sim_args: object
) -> tuple[SimNvml, NvmlBackend, list[str]]:
    options = ("call_timeout_s", "init_timeout_s", "one_shot", "unsupported_retry_s", *CONTRACT_OPTIONS)
    backend_args = {**CONTRACT_OPTIONS, **{k: sim_args.pop(k) for k in list(sim_args) if k in options}}
    sim = SimNvml.from_profiles(profiles or ("H100",), seed=5, clock=clock.monotonic, **sim_args)  # type: ignore[arg-type]
    backend = NvmlBackend(backends.over(sim), clock=clock, **backend_args)  # type: ignore[arg-type]
    backends.append(backend)
    return sim, backend, [g.uuid for g in sim.gpus]


def expected_absent(prof: GpuProfile) -> set[str]:
    absent = set()
    if not prof.has_fan:
        absent.add("fan_speed")
    if not prof.hbm:
        absent.add("temperature_memory")
    if not prof.remapped_rows:
        absent |= {"remapped_rows_uncorrectable", "remapped_rows_pending"}
    if not prof.ecc:
        absent |= {"ecc_errors_corrected", "ecc_errors_uncorrected"}
    return absent


def test_the_backend_satisfies_the_gpu_backend_protocol(fake_clock: FakeClock, backends: Backends) -> None:
    _, backend, _ = build(fake_clock, backends)
    protocol: GpuBackend = backend
    assert callable(protocol.sample)


# --------------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", list(PROFILES))
def test_every_catalog_property_is_read_with_its_type_and_unit(
    key: str, fake_clock: FakeClock, backends: Backends
) -> None:
    sim, backend, (uuid,) = build(fake_clock, backends, key, scenario="training")
    prof = PROFILES[key]
    backend.sample(uuid)
    fake_clock.advance(60)
    sample = backend.sample(uuid)
    values = sample.values
    assert sample.uuid == uuid and sample.errors == {}
    assert sample.ts_ms == fake_clock.wall_ms()
    assert set(values) == {p.name for p in NVML_PROPERTIES} - expected_absent(prof)
    for name, value in values.items():
        spec = PROPERTY_BY_NAME[name]
        assert type(value) is PYTHON_TYPES[spec.ptype], f"{name}: {value!r} is not {spec.ptype}"
        assert TWIN_VALUE_RE.fullmatch(format_value(spec, value)), f"{name}: {value!r} does not fit a twin"
        if isinstance(value, float):
            assert math.isfinite(value)
    gpu = sim.gpu(uuid)
    assert values["uuid"] == uuid
    assert values["product_name"] == prof.name  # raw; format_value makes it twin-safe
    assert values["memory_total"] == prof.memory_total_bytes  # bytes
    assert 0 < values["memory_used"] < values["memory_total"]
    assert values["utilization_gpu"] >= 90  # percent
    assert values["power_usage"] == pytest.approx(gpu.reported_power_w, abs=0.001)  # W, from mW
    assert values["power_limit"] == values["power_limit_default"] == prof.power_limit_default_w  # W
    assert values["power_limit_min"] == prof.power_limit_min_w
    assert values["power_limit_max"] == prof.power_limit_max_w
    assert values["power_limit_enforced"] == prof.power_limit_default_w
    assert values["energy_consumption"] == pytest.approx(gpu.energy_j, abs=0.01)  # J, from mJ
    assert values["temperature"] == int(gpu.temperature_c)
    assert values["temperature_slowdown"] == prof.slowdown_c
    assert values["temperature_shutdown"] == prof.shutdown_c
    assert values["clock_sm_max"] == prof.sm_max_mhz  # MHz
    assert values["clock_sm"] == gpu.sm_clock_mhz
    assert values["clock_memory"] == prof.memory_clocks_mhz[0]
    assert values["clock_event_reasons_text"] == clock_event_reasons_text(int(values["clock_event_reasons"]))
    assert values["pstate"] == 0
    assert values["pcie_rx"] == gpu.pcie_rx_kbs * 1024  # bytes/s, from KB/s
    assert values["xid_last"] == 0
    assert values["persistence_mode"] is False
    assert values["compute_mode"] == "default"
    assert values["locked_gpu_clock_min"] == values["locked_gpu_clock_max"] == 0
    if prof.hbm:
        assert values["temperature_memory"] >= values["temperature"]
    if prof.has_fan:
        assert 30 <= values["fan_speed"] <= 100


def test_a_sample_can_ask_for_some_properties_only(fake_clock: FakeClock, backends: Backends) -> None:
    sim, backend, (uuid,) = build(fake_clock, backends)
    backend.sample(uuid, ["uuid"])
    before = sum(sim.calls.values())
    sample = backend.sample(uuid, ["temperature", "desired_status"])
    assert set(sample.values) == {"temperature"}  # desired_status is the mapper's, not NVML's
    assert sum(sim.calls.values()) - before == 1  # one NVML call per value
    with pytest.raises(InvalidValueError, match="'temprature'") as info:
        backend.sample(uuid, ["temprature"])
    assert info.value.reason == "unknown-property"


def test_not_supported_values_are_absent_and_asked_again_only_rarely(fake_clock: FakeClock, backends: Backends) -> None:
    sim, backend, (uuid,) = build(fake_clock, backends, "T4")
    for _ in range(10):
        sample = backend.sample(uuid)
        fake_clock.advance(1)
        assert "fan_speed" not in sample.values and "temperature_memory" not in sample.values
        assert "energy_consumption" in sample.values  # same NVML call as temperature_memory, its own status
    assert sim.calls["nvmlDeviceGetFanSpeed"] == 1
    assert sim.calls["nvmlDeviceGetRemappedRows"] == 1
    assert sim.calls["nvmlDeviceGetPowerUsage"] == 10
    fake_clock.advance(600)
    backend.sample(uuid)
    assert sim.calls["nvmlDeviceGetFanSpeed"] == 2


def test_list_gpus_enumerates_by_uuid_with_index_as_a_label(fake_clock: FakeClock, backends: Backends) -> None:
    _, backend, uuids = build(fake_clock, backends, "H100", "T4", "L4")
    gpus = backend.list_gpus()
    assert [g.uuid for g in gpus] == uuids
    assert [g.index for g in gpus] == [0, 1, 2]
    assert gpus[1].name == "Tesla T4" and gpus[1].architecture == "turing"
    assert gpus[0].pci_bus_id == "00000000:18:00.0" and gpus[0].serial.isdigit()
    assert backend.driver_version() == gpus[0].driver_version == "590.48.01"


def test_an_unknown_gpu_is_not_found(fake_clock: FakeClock, backends: Backends) -> None:
    _, backend, _ = build(fake_clock, backends)
    with pytest.raises(NotFoundError, match="GPU-00000000-0000-0000-0000-000000000000 is not on this node"):
        backend.sample("GPU-00000000-0000-0000-0000-000000000000")


def test_constraints_come_from_the_gpu(fake_clock: FakeClock, backends: Backends) -> None:
    _, backend, (h100, t4) = build(fake_clock, backends, "H100", "T4")
    c = backend.constraints(t4)
    assert (c.power_limit_min_w, c.power_limit_max_w, c.power_limit_default_w) == (60.0, 70.0, 70.0)
    assert c.memory_clocks_mhz == (5001, 405)
    assert c.graphics_clocks_mhz[0] == 1590 and c.graphics_clocks_mhz[-1] == 300
    assert list(c.graphics_clocks_mhz) == sorted(c.graphics_clocks_mhz, reverse=True)
    assert c.unsupported == frozenset()
    assert backend.constraints(h100).memory_clocks_mhz == (2619,)


def test_an_older_driver_falls_back_to_the_deprecated_temperature_call(
    fake_clock: FakeClock, backends: Backends
) -> None:
    sim, backend, (uuid,) = build(fake_clock, backends, driver_version="530.30.02")
    sample = backend.sample(uuid)
    assert sample.values["temperature"] > 0
    backend.sample(uuid)
    # (nvidia-ml-py 12.535 has no nvmlDeviceGetTemperatureV wrapper: the backend does not reach the driver for it)
    tried = 1 if hasattr(backend._nvml, "nvmlDeviceGetTemperatureV") else 0
    assert sim.calls["nvmlDeviceGetTemperatureV"] == tried and sim.calls["nvmlDeviceGetTemperature"] == 2


def test_a_pre_r535_driver_gives_clock_reasons_and_energy_through_the_older_calls(
    fake_clock: FakeClock, backends: Backends
) -> None:
    sim, backend, (h100, t4) = build(fake_clock, backends, "H100", "T4", driver_version="530.30.02")
    backend.sample(h100)
    fake_clock.advance(30)
    samples = [backend.sample(u) for u in (h100, t4)]
    for sample in samples:
        gpu = sim.gpu(sample.uuid)
        assert sample.errors == {}, sample.errors  # field 191 answers InvalidArgument: absent, not an error
        assert sample.values["clock_event_reasons"] == gpu.reasons == pynvml.nvmlClocksEventReasonGpuIdle
        assert sample.values["clock_event_reasons_text"] == clock_event_reasons_text(gpu.reasons)
        assert sample.values["energy_consumption"] == pytest.approx(gpu.energy_j, abs=0.001)  # from mJ
    assert samples[0].values["temperature_memory"] > 0  # field 82 is older than r535: still a field
    fake_clock.advance(10)
    for _ in range(3):
        later = backend.sample(h100)
        fake_clock.advance(1)
    assert later.values["energy_consumption"] > samples[0].values["energy_consumption"]
    # 5 samples of the H100, 1 of the T4: the missing function is tried once per backend, and the T4 (no HBM,
    # so no field 82 either) is not asked for fields again before their retry time
    assert sim.calls["nvmlDeviceGetCurrentClocksEventReasons"] == 1
    assert sim.calls["nvmlDeviceGetCurrentClocksThrottleReasons"] == 6
    assert sim.calls["nvmlDeviceGetTotalEnergyConsumption"] == 6
    # memory temperature in a call of its own each sample (6), energy's field 191 asked once per GPU (2)
    assert sim.calls["nvmlDeviceGetFieldValues"] == 6 + 2
    backend.sample(t4)
    assert sim.calls["nvmlDeviceGetFieldValues"] == 8 and sim.calls["nvmlDeviceGetTotalEnergyConsumption"] == 7
    backend.shutdown()  # a new NVML session (a reload may bring a newer driver): the r535 name is tried again
    assert backend.sample(h100).values["clock_event_reasons"] == pynvml.nvmlClocksEventReasonGpuIdle
    assert sim.calls["nvmlDeviceGetCurrentClocksEventReasons"] == 2


def test_fields_a_driver_lacked_are_asked_again_in_the_next_nvml_session(
    fake_clock: FakeClock, backends: Backends
) -> None:
    """A field answered InvalidArgument is remembered for the NVML session, not longer: a reload that brings an
    r535+ driver gives energy from field 191 at once, and one back to r530 the fallback at once."""
    sim, backend, (uuid,) = build(fake_clock, backends, driver_version="530.30.02")
    for _ in range(3):
        old = backend.sample(uuid, ["energy_consumption", "temperature_memory"])
        assert old.errors == {} and set(old.values) == {"energy_consumption", "temperature_memory"}
        fake_clock.advance(1)
    assert sim.calls["nvmlDeviceGetTotalEnergyConsumption"] == 3  # field 191 asked once, then left out
    assert sim.calls["nvmlDeviceGetFieldValues"] == 3 + 1  # field 82 in each sample, 191 in the first
    fake_clock.advance(5)  # (far before the retry time)
    sim.driver_reload(driver_version="590.48.01")
    new = backend.sample(uuid, ["energy_consumption", "temperature_memory"])
    assert new.errors == {}, new.errors
    assert new.values["energy_consumption"] == pytest.approx(sim.gpu(uuid).energy_j, abs=0.001)  # field 191, J
    assert sim.calls["nvmlDeviceGetTotalEnergyConsumption"] == 3  # not the fallback any more
    assert [e.kind for e in backend.poll_events()] == ["driver_reload"]
    fake_clock.advance(5)
    sim.driver_reload(driver_version="530.30.02")
    back = backend.sample(uuid, ["energy_consumption", "temperature_memory"])
    assert back.errors == {} and "energy_consumption" in back.values
    assert sim.calls["nvmlDeviceGetTotalEnergyConsumption"] == 4


def test_memory_comes_from_v2_with_the_reserved_part_apart_and_from_v1_before_r510(
    fake_clock: FakeClock, backends: Backends
) -> None:
    new_sim, new, (uuid,) = build(fake_clock, backends, "A100", scenario="training")
    old_sim, old, (old_uuid,) = build(fake_clock, backends, "A100", scenario="training", driver_version="470.223.02")
    fake_clock.advance(30)
    prof = PROFILES["A100"]
    v2 = new.sample(uuid, ["memory_used", "memory_reserved", "memory_total"]).values
    v1 = old.sample(old_uuid, ["memory_used", "memory_reserved", "memory_total"]).values
    assert v2["memory_total"] == v1["memory_total"] == prof.memory_total_bytes
    assert v2["memory_reserved"] == prof.memory_reserved_bytes > 100 * 2**20  # hundreds of MiB on an A100
    assert v2["memory_used"] == new_sim.gpu(uuid).memory_used_bytes
    # v1's used includes what the driver reserves (as real NVML's does); no reserved figure without v2
    assert v1["memory_used"] == old_sim.gpu(old_uuid).memory_used_bytes + prof.memory_reserved_bytes
    assert "memory_reserved" not in v1
    old.sample(old_uuid, ["memory_used"])
    assert old_sim.calls["nvmlDeviceGetMemoryInfo"] == 3  # one v2 try, then v1 for the session


# --------------------------------------------------------------------------------------------------
# Setting
# --------------------------------------------------------------------------------------------------


def test_power_limit_is_set_in_milliwatts_and_read_back(fake_clock: FakeClock, backends: Backends) -> None:
    sim, backend, (uuid,) = build(fake_clock, backends)
    assert backend.set_power_limit(uuid, 350.5) == 350.5
    assert sim.gpu(uuid).power_limit_mw == 350_500
    assert backend.sample(uuid, ["power_limit"]).values["power_limit"] == 350.5
    assert sim.calls["nvmlDeviceSetPowerManagementLimit"] == 1
    assert sim.calls["nvmlDeviceSetPowerManagementLimit_v2"] == 0


def test_out_of_range_power_limit_is_rejected_and_the_gpu_unchanged(fake_clock: FakeClock, backends: Backends) -> None:
    sim, backend, (uuid,) = build(fake_clock, backends)
    backend.set_power_limit(uuid, 400)
    with pytest.raises(InvalidValueError) as info:
        backend.set_power_limit(uuid, 800)
    assert info.value.reason == "out-of-range"
    message = str(info.value)
    assert uuid in message and "nvmlDeviceSetPowerManagementLimit" in message and "800000 mW" in message
    assert "200-700 W" in message
    assert sim.gpu(uuid).power_limit_mw == 400_000


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("300", "not-a-number"),
        (None, "wrong-type"),
        (True, "wrong-type"),
        (math.nan, "nan"),
        (math.inf, "infinite"),
        (-5, "negative"),
    ],
)
def test_non_numeric_power_limits_are_rejected_before_nvml(
    value: object, reason: str, fake_clock: FakeClock, backends: Backends
) -> None:
    sim, backend, (uuid,) = build(fake_clock, backends)
    with pytest.raises(InvalidValueError, match="power_limit") as info:
        backend.set_power_limit(uuid, value)  # type: ignore[arg-type]
    assert info.value.reason == reason
    assert sim.calls["nvmlDeviceSetPowerManagementLimit"] == 0
    assert sim.gpu(uuid).power_limit_mw == 700_000


def test_a_power_limit_that_does_not_read_back_is_an_error(fake_clock: FakeClock, backends: Backends) -> None:
    class SilentSim(SimNvml):
        """A driver that reports success and changes nothing (what the v2 binding bug looks like)."""

        def nvmlDeviceSetPowerManagementLimit(self, handle: object, limit: int) -> None:
            self.calls["nvmlDeviceSetPowerManagementLimit"] += 1

    sim = SilentSim(1, clock=fake_clock.monotonic)
    backend = NvmlBackend(sim, clock=fake_clock)
    backends.append(backend)
    with pytest.raises(ReadBackMismatchError, match="reads back as 700000 mW") as info:
        backend.set_power_limit(sim.gpus[0].uuid, 300)
    assert isinstance(info.value, PermanentError), "callers other than the reconciler see a PermanentError"
    assert info.value.reason == "read-back-mismatch"


def test_locked_gpu_clocks_are_set_reported_and_reset(fake_clock: FakeClock, backends: Backends) -> None:
    sim, backend, (uuid,) = build(fake_clock, backends)
    backend.set_locked_gpu_clocks(uuid, 1005, 1500)
    assert sim.gpu(uuid).locked_gpu_clocks == (1005, 1500)
    values = backend.sample(uuid).values
    assert (values["locked_gpu_clock_min"], values["locked_gpu_clock_max"]) == (1005, 1500)
    backend.reset_locked_gpu_clocks(uuid)
    assert sim.gpu(uuid).locked_gpu_clocks is None
    assert backend.sample(uuid).values["locked_gpu_clock_max"] == 0
    backend.set_locked_gpu_clocks(uuid, 1500, 1500)
    backend.set_locked_gpu_clocks(uuid, 0, 0)  # 0/0 unlocks
    assert sim.gpu(uuid).locked_gpu_clocks is None


def test_unsupported_clocks_are_rejected_and_the_gpu_unchanged(fake_clock: FakeClock, backends: Backends) -> None:
    sim, backend, (uuid,) = build(fake_clock, backends)
    backend.set_locked_gpu_clocks(uuid, 1500, 1500)
    with pytest.raises(InvalidValueError, match=r"1001 MHz, 1500 MHz") as info:
        backend.set_locked_gpu_clocks(uuid, 1001, 1500)
    assert info.value.reason == "not-supported-clock" and uuid in str(info.value)
    for lo, hi, reason in ((1500, 1005, "out-of-range"), (0, 1500, "unpaired"), (1000.5, 1500, "wrong-type")):
        with pytest.raises(InvalidValueError) as info:
            backend.set_locked_gpu_clocks(uuid, lo, hi)  # type: ignore[arg-type]
        assert info.value.reason == reason
    assert sim.gpu(uuid).locked_gpu_clocks == (1500, 1500)
    assert backend.sample(uuid).values["locked_gpu_clock_min"] == 1500


def test_locked_memory_clocks_where_supported_and_learnt_unsupported_elsewhere(
    fake_clock: FakeClock, backends: Backends
) -> None:
    sim, backend, (h100, t4) = build(fake_clock, backends, "H100", "T4")
    backend.set_locked_memory_clocks(h100, 2619, 2619)
    assert sim.gpu(h100).locked_memory_clocks == (2619, 2619)
    assert backend.sample(h100).values["locked_memory_clock_min"] == 2619
    backend.reset_locked_memory_clocks(h100)
    assert sim.gpu(h100).locked_memory_clocks is None
    assert backend.sample(t4).values["locked_memory_clock_min"] == 0
    with pytest.raises(UnsupportedError, match=f"GPU {t4}: nvmlDeviceSetMemoryLockedClocks"):
        backend.set_locked_memory_clocks(t4, 5001, 5001)
    assert backend.constraints(t4).unsupported == {"locked_memory_clock_min", "locked_memory_clock_max"}
    assert "locked_memory_clock_min" not in backend.sample(t4).values


def test_persistence_and_compute_mode_are_set_by_value_and_name(fake_clock: FakeClock, backends: Backends) -> None:
    sim, backend, (uuid,) = build(fake_clock, backends)
    backend.set_persistence_mode(uuid, True)
    for name in COMPUTE_MODES:
        backend.set_compute_mode(uuid, name)
        assert backend.sample(uuid).values["compute_mode"] == name
    assert backend.sample(uuid).values["persistence_mode"] is True
    assert sim.gpu(uuid).persistence_mode == 1
    with pytest.raises(InvalidValueError, match="exclusive_thread") as info:
        backend.set_compute_mode(uuid, "exclusive_thread")
    assert info.value.reason == "unknown-value"
    with pytest.raises(InvalidValueError) as info:
        backend.set_persistence_mode(uuid, "yes")  # type: ignore[arg-type]
    assert info.value.reason == "wrong-type"
    assert sim.gpu(uuid).compute_mode == COMPUTE_MODES["exclusive_process"]


def test_every_setter_reports_no_permission_when_not_root(fake_clock: FakeClock, backends: Backends) -> None:
    sim, backend, (uuid,) = build(fake_clock, backends, as_root=False)
    setters = [
        lambda: backend.set_power_limit(uuid, 300),
        lambda: backend.set_locked_gpu_clocks(uuid, 1500, 1500),
        lambda: backend.reset_locked_gpu_clocks(uuid),
        lambda: backend.set_locked_memory_clocks(uuid, 2619, 2619),
        lambda: backend.reset_locked_memory_clocks(uuid),
        lambda: backend.set_persistence_mode(uuid, True),
        lambda: backend.set_compute_mode(uuid, "prohibited"),
    ]
    for setter in setters:
        with pytest.raises(NoPermissionError, match=f"GPU {uuid}: nvmlDevice.*root") as info:
            setter()
        assert info.value.reason == "no-permission"
    values = backend.sample(uuid).values
    assert values["power_limit"] == 700.0 and values["compute_mode"] == "default"
    assert values["locked_gpu_clock_min"] == 0 and values["persistence_mode"] is False
    sim.set_as_root(True)
    assert backend.set_power_limit(uuid, 300) == 300.0


# --------------------------------------------------------------------------------------------------
# Faults
# --------------------------------------------------------------------------------------------------


def test_a_gpu_lost_in_the_middle_of_a_sample_raises_and_is_reported(fake_clock: FakeClock, backends: Backends) -> None:
    sim, backend, (lost, healthy) = build(fake_clock, backends, "H100", "H100")
    backend.sample(lost)
    sim.inject_errors("nvmlDeviceGetClockInfo", pynvml.NVML_ERROR_GPU_IS_LOST, 1, uuid=lost)
    with pytest.raises(GpuLostError, match=f"GPU {lost}: nvmlDeviceGetClockInfo"):
        backend.sample(lost)
    assert backend.is_lost(lost)
    assert [(e.uuid, e.kind) for e in backend.poll_events()] == [(lost, "gpu_lost")]
    calls = sum(sim.calls.values())
    with pytest.raises(GpuLostError, match="is lost"):
        backend.sample(lost)  # no NVML call while lost
    assert sum(sim.calls.values()) == calls
    assert backend.sample(healthy).values["uuid"] == healthy
    assert lost in {g.uuid for g in backend.list_gpus()}
    fake_clock.advance(61)  # the backend probes again; this GPU was not really gone
    assert backend.sample(lost).values["uuid"] == lost
    assert not backend.is_lost(lost)


def test_sample_many_reads_every_gpu_in_one_job_and_keeps_one_gpus_failure_to_itself(
    fake_clock: FakeClock, backends: Backends
) -> None:
    sim, backend, (a, lost, b) = build(fake_clock, backends, "H100", "H100", "A100")
    backend.poll_events()
    sim.inject_gpu_lost(lost)
    got = backend.sample_many([(a, ("power_usage", "temperature")), (lost, None), (b, ("temperature",))], True)
    assert [(e.uuid, e.kind) for e in got.events] == [(lost, "xid"), (lost, "gpu_lost")], "polled first"
    assert got.events_error is None
    assert len(got.samples) == 3
    first, second, third = got.samples
    assert isinstance(first, Sample) and first.uuid == a and set(first.values) == {"power_usage", "temperature"}
    assert isinstance(second, GpuLostError) and lost in str(second)
    assert isinstance(third, Sample) and third.uuid == b and set(third.values) == {"temperature"}
    sim.inject_xid(a, 13)
    quiet = backend.sample_many([])
    assert quiet.samples == [] and quiet.events == [], "no poll unless asked: the XID waits for the next one"
    assert [(e.uuid, e.xid) for e in backend.sample_many([], True).events] == [(a, 13)]
    with pytest.raises(InvalidValueError, match="no_such_property"):
        backend.sample_many([(a, ("no_such_property",))])

    async def via_the_loop() -> list[Sample | MapperError]:
        round_ = await backend.call_async(backend.sample_many, [(b, ("temperature",)), (a, ("temperature",))])
        return round_.samples

    on_loop = asyncio.run(via_the_loop())
    assert [type(x) for x in on_loop] == [Sample, Sample] and [x.uuid for x in on_loop] == [b, a]  # type: ignore[union-attr]


def test_events_polled_by_a_sample_many_job_that_timed_out_come_back_with_the_next_poll(
    backends: Backends,
) -> None:
    sim = SimNvml.from_profiles(("H100",), seed=5)
    backend = NvmlBackend(sim, call_timeout_s=0.3)
    backends.append(backend)
    (a,) = [g.uuid for g in sim.gpus]
    backend.poll_events()
    sim.inject_xid(a, 48)
    sim.set_call_delay_s(0.8, "nvmlDeviceGetPowerUsage")  # the read after the poll outlives the job's timeout

    async def round_() -> object:
        return await backend.call_async(backend.sample_many, [(a, ("power_usage",))], True)

    with pytest.raises(TransientError, match="no answer from NVML"):
        asyncio.run(round_())
    sim.set_call_delay_s(0, "nvmlDeviceGetPowerUsage")
    # Poll until the hung read has returned and its job handed the events back (refused while it hangs, then
    # NVML is initialised again); no head start: the deadline is the only time in it.
    deadline = time.monotonic() + 10
    seen: list[tuple[str, int]] = []
    while not seen and time.monotonic() < deadline:
        with contextlib.suppress(TransientError):  # still hung, or re-initialising after the hang
            seen = [(e.kind, e.xid) for e in backend.poll_events()]
        time.sleep(0.05)
    assert ("xid", 48) in seen, "the XID taken by the dropped job is reported by the next poll"


def test_a_failed_event_poll_in_sample_many_leaves_the_samples_alone(fake_clock: FakeClock, backends: Backends) -> None:
    sim, backend, (a,) = build(fake_clock, backends, "H100")
    backend.poll_events()
    sim.inject_errors("nvmlEventSetWait", pynvml.NVML_ERROR_NOT_SUPPORTED, 1)
    got = backend.sample_many([(a, ("temperature",))], True)
    assert got.events == [] and isinstance(got.events_error, MapperError)
    assert "nvmlEventSetWait" in str(got.events_error)
    assert isinstance(got.samples[0], Sample) and "temperature" in got.samples[0].values


def test_sample_many_keeps_the_reinit_backoff_when_every_read_in_it_failed(
    fake_clock: FakeClock, backends: Backends
) -> None:
    # The backoff of test_unknown_errors_reinitialise_nvml_with_capped_exponential_backoff, through sample_many: a
    # round whose every read failed is no success, so it must not reset the re-init backoff (nor re-init first).
    sim, backend, (uuid,) = build(fake_clock, backends)

    def power() -> Sample | MapperError:
        (got,) = backend.sample_many([(uuid, ("power_usage",))]).samples
        return got

    assert isinstance(power(), Sample)
    assert sim.calls["nvmlInitWithFlags"] == 1
    sim.inject_errors("nvmlDeviceGetPowerUsage", pynvml.NVML_ERROR_UNKNOWN, 3)
    failed = power()  # fails, re-inits, fails again
    assert isinstance(failed, TransientError) and "Unknown" in str(failed)
    assert sim.calls["nvmlInitWithFlags"] == 2
    backing_off = power()
    assert isinstance(backing_off, TransientError) and "backs off 1.0 s" in str(backing_off)
    assert sim.calls["nvmlInitWithFlags"] == 2, "no re-init before the backoff has passed"
    fake_clock.advance(1.0)
    again = power()
    assert isinstance(again, TransientError) and "Unknown" in str(again)
    assert sim.calls["nvmlInitWithFlags"] == 3
    fake_clock.advance(1.0)
    still = power()
    assert isinstance(still, TransientError) and "backs off 1.0 s" in str(still), "the second wait is 2 s"
    fake_clock.advance(1.0)
    ok = power()
    assert isinstance(ok, Sample) and "power_usage" in ok.values
    assert sim.calls["nvmlInitWithFlags"] == 4


def test_a_gpu_that_falls_off_the_bus_gives_xid_79_and_stays_lost(fake_clock: FakeClock, backends: Backends) -> None:
    sim, backend, (lost, healthy) = build(fake_clock, backends, "H100", "H100")
    backend.poll_events()  # registers for events
    sim.inject_gpu_lost(lost)
    events = backend.poll_events()
    assert [(e.uuid, e.kind, e.xid) for e in events] == [(lost, "xid", 79), (lost, "gpu_lost", 0)]
    with pytest.raises(GpuLostError):
        backend.sample(lost)
    fake_clock.advance(61)
    with pytest.raises(GpuLostError, match=lost):
        backend.sample(lost)
    assert backend.sample(healthy).values["xid_last"] == 0


def test_xid_and_ecc_events_are_polled_and_xid_last_is_sampled(fake_clock: FakeClock, backends: Backends) -> None:
    sim, backend, (uuid,) = build(fake_clock, backends)
    assert backend.poll_events() == []
    sim.inject_xid(uuid, 43)
    sim.inject_ecc(uuid, corrected=1, uncorrected=1)
    events = backend.poll_events()
    assert [(e.kind, e.xid) for e in events] == [("xid", 43), ("ecc_single", 0), ("ecc_double", 0)]
    assert all(e.uuid == uuid and e.ts_ms == fake_clock.wall_ms() for e in events)
    values = backend.sample(uuid).values
    assert values["xid_last"] == 43
    assert (values["ecc_errors_corrected"], values["ecc_errors_uncorrected"]) == (1, 1)


def test_a_driver_reload_wipes_settings_and_is_reported(fake_clock: FakeClock, backends: Backends) -> None:
    sim, backend, (a, b) = build(fake_clock, backends, "H100", "A100")
    backend.set_power_limit(a, 300)
    backend.set_locked_gpu_clocks(a, 1500, 1500)
    backend.set_locked_memory_clocks(a, 2619, 2619)
    backend.set_persistence_mode(a, True)
    backend.set_compute_mode(a, "prohibited")
    fake_clock.advance(100)
    energy_before = backend.sample(a).values["energy_consumption"]
    backend.sample(b)
    assert backend.poll_events() == []
    sim.driver_reload()
    fake_clock.advance(1)
    values = backend.sample(a).values  # re-initialises transparently
    assert values["power_limit"] == 700.0
    assert (values["locked_gpu_clock_min"], values["locked_gpu_clock_max"]) == (0, 0)
    assert (values["locked_memory_clock_min"], values["locked_memory_clock_max"]) == (0, 0)
    assert values["persistence_mode"] is False and values["compute_mode"] == "default"
    assert values["energy_consumption"] < energy_before
    assert {(e.uuid, e.kind) for e in backend.poll_events()} == {(a, "driver_reload"), (b, "driver_reload")}
    assert backend.poll_events() == []


def test_a_reload_between_sessions_is_seen_from_the_energy_counter(fake_clock: FakeClock, backends: Backends) -> None:
    sim, backend, (uuid,) = build(fake_clock, backends)
    backend.set_locked_gpu_clocks(uuid, 1500, 1500)
    fake_clock.advance(100)
    backend.sample(uuid)
    backend.shutdown()  # the backend lets go of NVML; the driver reloads meanwhile
    sim.driver_reload()
    fake_clock.advance(1)
    assert backend.sample(uuid).values["locked_gpu_clock_min"] == 0
    events = backend.poll_events()
    assert [(e.uuid, e.kind) for e in events] == [(uuid, "driver_reload")]
    assert "energy counter" in events[0].detail


def test_unknown_errors_reinitialise_nvml_with_capped_exponential_backoff(
    fake_clock: FakeClock, backends: Backends
) -> None:
    sim, backend, (uuid,) = build(fake_clock, backends)
    backend.sample(uuid)
    assert sim.calls["nvmlInitWithFlags"] == 1
    sim.inject_errors("nvmlDeviceGetPowerUsage", pynvml.NVML_ERROR_UNKNOWN, 1)
    assert "power_usage" in backend.sample(uuid).values  # one Unknown: re-init at once and retry
    assert sim.calls["nvmlInitWithFlags"] == 2
    sim.inject_errors("nvmlDeviceGetPowerUsage", pynvml.NVML_ERROR_UNKNOWN, 3)
    with pytest.raises(TransientError, match=r"nvmlDeviceGetPowerUsage.*Unknown"):
        backend.sample(uuid)  # fails, re-inits, fails again
    assert sim.calls["nvmlInitWithFlags"] == 3
    with pytest.raises(TransientError, match=r"backs off 1\.0 s"):
        backend.sample(uuid)
    assert sim.calls["nvmlInitWithFlags"] == 3
    fake_clock.advance(1.0)
    with pytest.raises(TransientError, match="Unknown"):
        backend.sample(uuid)
    assert sim.calls["nvmlInitWithFlags"] == 4
    fake_clock.advance(1.0)
    with pytest.raises(TransientError, match=r"backs off 1\.0 s"):
        backend.sample(uuid)  # the second wait is 2 s
    fake_clock.advance(1.0)
    assert "power_usage" in backend.sample(uuid).values
    assert sim.calls["nvmlInitWithFlags"] == 5


def test_the_backoff_is_capped(fake_clock: FakeClock, backends: Backends) -> None:
    sim, backend, (uuid,) = build(fake_clock, backends)
    backend.sample(uuid)
    sim.inject_errors("nvmlInitWithFlags", pynvml.NVML_ERROR_UNKNOWN, 100)
    sim.inject_errors("nvmlDeviceGetPowerUsage", pynvml.NVML_ERROR_UNKNOWN, 1)
    waits = []
    for _ in range(12):
        try:
            backend.sample(uuid)
        except TransientError as exc:
            waits.append(exc.retry_after_s)
        fake_clock.advance(max(waits[-1], 0.001))
    assert max(waits) == 60.0


def test_a_missing_nvml_library_is_a_clear_permanent_error(fake_clock: FakeClock, backends: Backends) -> None:
    sim, backend, _ = build(fake_clock, backends)
    sim.inject_errors("nvmlInitWithFlags", pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, 1)
    with pytest.raises(PermanentError, match=r"libnvidia-ml\.so\.1 not found") as info:
        backend.init()
    assert not isinstance(info.value, TransientError)


@pytest.mark.parametrize(
    ("code", "advice"),
    [
        (pynvml.NVML_ERROR_NO_PERMISSION, "cannot open the GPU device files"),
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "modprobe nvidia"),
        (pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, "reload the nvidia kernel modules"),
        (pynvml.NVML_ERROR_UNKNOWN, "dmesg"),
        (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "Install the NVIDIA driver"),
    ],
)
def test_a_one_shot_command_whose_nvml_cannot_start_gets_one_line_saying_what_to_do(
    code: int, advice: str, fake_clock: FakeClock, backends: Backends
) -> None:
    sim, backend, _ = build(fake_clock, backends, one_shot=True)
    sim.inject_errors("nvmlInitWithFlags", code, 1)
    with pytest.raises(PermanentError) as info:
        backend.list_gpus()
    text = str(info.value)
    assert advice in text and "\n" not in text
    assert "re-initialised" not in text and "next attempt" not in text and "setters need root" not in text
    fake_clock.advance(1.0)
    assert backend.list_gpus()  # (the fault was once)


def test_the_daemon_retries_an_nvml_that_cannot_start_and_says_when(fake_clock: FakeClock, backends: Backends) -> None:
    sim, backend, _ = build(fake_clock, backends)
    sim.inject_errors("nvmlInitWithFlags", pynvml.NVML_ERROR_DRIVER_NOT_LOADED, 1)
    with pytest.raises(TransientError, match=r"modprobe nvidia.*; next attempt in 1\.0 s$"):
        backend.list_gpus()
    sim.inject_errors("nvmlInitWithFlags", pynvml.NVML_ERROR_NO_PERMISSION, 1)
    fake_clock.advance(1.0)
    with pytest.raises(NoPermissionError, match="cannot open the GPU device files") as info:
        backend.list_gpus()  # not a setter's "needs root": nothing works until the device files open
    assert "setters need root" not in str(info.value)
    fake_clock.advance(2.0)
    assert backend.list_gpus()


def test_a_hung_call_times_out_and_nvml_is_reinitialised(fake_clock: FakeClock, backends: Backends) -> None:
    sim, backend, (uuid,) = build(fake_clock, backends, call_timeout_s=0.1, init_timeout_s=0.1)
    backend.sample(uuid)
    sim.set_call_delay_s(2.0, "nvmlDeviceGetPowerUsage")  # far past the timeout, even on a loaded machine
    started = time.monotonic()
    with pytest.raises(TransientError, match=r"no answer from NVML within 0\.1 s"):
        backend.sample(uuid)
    assert time.monotonic() - started < 1.5, "the call waited for the hung read instead of timing out"
    with pytest.raises(TransientError, match="not attempted: NVML has not answered"):
        backend.sample(uuid)  # fails fast while the call hangs
    sim.set_call_delay_s(0, "nvmlDeviceGetPowerUsage")
    deadline = time.monotonic() + 10
    while True:
        try:
            sample = backend.sample(uuid)
            break
        except TransientError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert "power_usage" in sample.values
    assert sim.calls["nvmlInitWithFlags"] == 2


def test_a_slow_first_call_after_a_reload_times_out_then_recovers(fake_clock: FakeClock, backends: Backends) -> None:
    sim, backend, (uuid,) = build(fake_clock, backends, call_timeout_s=0.1, init_timeout_s=0.1)
    backend.set_power_limit(uuid, 300)
    sim.driver_reload(first_call_delay_s=0.3)
    with pytest.raises(TransientError):
        backend.sample(uuid)
    deadline = time.monotonic() + 5
    while True:
        try:
            values = backend.sample(uuid).values
            break
        except TransientError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
            fake_clock.advance(1)
    assert values["power_limit"] == 700.0


def test_a_read_that_fails_for_another_reason_is_reported_and_the_rest_still_sampled(
    fake_clock: FakeClock, backends: Backends
) -> None:
    sim, backend, (uuid,) = build(fake_clock, backends)
    sim.inject_errors("nvmlDeviceGetPcieThroughput", pynvml.NVML_ERROR_NO_PERMISSION, 1)
    sample = backend.sample(uuid)
    assert "pcie_tx" not in sample.values and "pcie_rx" in sample.values
    assert sample.errors["pcie_tx"].startswith("no-permission:")
    assert "nvmlDeviceGetPcieThroughput" in sample.errors["pcie_tx"]
    again = backend.sample(uuid)  # not mistaken for NotSupported: asked again at once
    assert "pcie_tx" in again.values and again.errors == {}


def test_calls_from_several_threads_are_serialised_safely(fake_clock: FakeClock, backends: Backends) -> None:
    sim, backend, uuids = build(fake_clock, backends, "H100", "A100")
    limits = {uuids[0]: 350.0, uuids[1]: 250.0}
    failures: list[BaseException] = []

    def work(uuid: str) -> None:
        try:
            for _ in range(25):
                assert backend.sample(uuid).values["uuid"] == uuid
                assert backend.set_power_limit(uuid, limits[uuid]) == limits[uuid]
        except BaseException as exc:  # collected and re-raised in the test thread
            failures.append(exc)

    threads = [threading.Thread(target=work, args=(uuids[i % 2],)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert failures == []
    assert [sim.gpu(u).power_limit_w for u in uuids] == [350.0, 250.0]


# --------------------------------------------------------------------------------------------------
# Sampling plans: the names a caller passes and the readers for them are worked out once, not per sample
# --------------------------------------------------------------------------------------------------


def test_remembered_property_sets_give_each_input_its_own_properties(fake_clock: FakeClock, backends: Backends) -> None:
    _, backend, (uuid,) = build(fake_clock, backends)
    names = ["temperature", "power_usage"]
    assert set(backend.sample(uuid, names).values) == {"temperature", "power_usage"}
    names.append("memory_used")  # the same list object, other contents: other properties
    assert set(backend.sample(uuid, names).values) == {"temperature", "power_usage", "memory_used"}
    for asked in (
        ("temperature",),
        "temperature",
        {"temperature", "desired_status"},
        frozenset({"temperature"}),
        (name for name in ["temperature"]),
        ["temperature", "desired_status"],
    ):
        assert set(backend.sample(uuid, asked).values) == {"temperature"}, asked
    assert set(backend.sample(uuid, ("power_usage",)).values) == {"power_usage"}
    assert set(backend.sample(uuid).values) >= {"temperature", "power_usage", "memory_used", "pstate"}
    for _ in range(2):  # an unknown name is an error every time, never remembered as an empty set
        with pytest.raises(InvalidValueError, match="'temprature'"):
            backend.sample(uuid, ("temprature",))


def test_one_property_of_a_reading_group_comes_without_its_neighbours_or_their_errors(
    fake_clock: FakeClock, backends: Backends
) -> None:
    sim, backend, (uuid,) = build(fake_clock, backends)
    assert set(backend.sample(uuid, ["memory_used"]).values) == {"memory_used"}
    assert set(backend.sample(uuid, ["utilization_memory"]).values) == {"utilization_memory"}
    assert set(backend.sample(uuid, ["clock_event_reasons_text"]).values) == {"clock_event_reasons_text"}
    sim.inject_errors("nvmlDeviceGetMemoryInfo", pynvml.NVML_ERROR_NO_PERMISSION, 1)
    sample = backend.sample(uuid, ["memory_total", "temperature"])
    assert set(sample.values) == {"temperature"} and set(sample.errors) == {"memory_total"}


def test_errors_of_a_getter_name_the_gpu_and_the_call(fake_clock: FakeClock, backends: Backends) -> None:
    sim, backend, (uuid,) = build(fake_clock, backends)
    backend.sample(uuid)
    sim.inject_errors("nvmlDeviceGetUtilizationRates", pynvml.NVML_ERROR_UNKNOWN, 2)  # (one retry after re-init)
    with pytest.raises(TransientError, match=f"GPU {uuid}: nvmlDeviceGetUtilizationRates\\(\\) failed"):
        backend.sample(uuid)
    sim.inject_errors("nvmlDeviceGetClockInfo", pynvml.NVML_ERROR_INVALID_ARGUMENT, 1)
    fake_clock.advance(2)  # past the re-init backoff
    sample = backend.sample(uuid)
    assert sample.errors["clock_sm"].startswith("out-of-range: ")
    assert f"GPU {uuid}: nvmlDeviceGetClockInfo(" in sample.errors["clock_sm"]


class _Hiding:
    """An nvml module without some functions (an older binding), recording the field ids asked for."""

    def __init__(self, sim: SimNvml, *hidden: str) -> None:
        self._sim = sim
        self._hidden = hidden
        self.field_ids: list[list[int]] = []

    def __getattr__(self, name: str) -> Any:
        if name in self._hidden:
            raise AttributeError(name)
        if name == "nvmlDeviceGetFieldValues":

            def fields(handle: object, ids: list[int]) -> Any:
                self.field_ids.append(list(ids))
                return self._sim.nvmlDeviceGetFieldValues(handle, ids)

            return fields
        return getattr(self._sim, name)


def test_a_getter_missing_from_the_binding_is_absent_and_asked_again_only_rarely(fake_clock: FakeClock) -> None:
    sim = SimNvml.from_profiles(("H100",), seed=5, clock=fake_clock.monotonic)
    hiding = _Hiding(sim, "nvmlDeviceGetPowerUsage")
    backend = NvmlBackend(hiding, clock=fake_clock, unsupported_retry_s=100, **CONTRACT_OPTIONS)  # type: ignore[arg-type]
    uuid = sim.gpus[0].uuid
    try:
        for _ in range(3):
            sample = backend.sample(uuid)
            assert "power_usage" not in sample.values and "power_limit" in sample.values
            assert sample.errors == {}
            fake_clock.advance(1)
        assert backend._unsupported[uuid]["power_usage"] == pytest.approx(fake_clock.monotonic() - 3 + 100)
        hiding._hidden = ()  # (a binding cannot gain a function; this shows when it is asked again)
        fake_clock.advance(50)
        assert "power_usage" not in backend.sample(uuid).values  # not asked before its retry time
        fake_clock.advance(50)
        assert "power_usage" in backend.sample(uuid).values
    finally:
        backend.shutdown()


def test_a_field_nvml_does_not_support_is_left_out_of_the_request_until_its_retry(fake_clock: FakeClock) -> None:
    sim = SimNvml.from_profiles(("T4",), seed=5, clock=fake_clock.monotonic)  # no HBM: no memory temperature
    hiding = _Hiding(sim)
    backend = NvmlBackend(hiding, clock=fake_clock, unsupported_retry_s=100, **CONTRACT_OPTIONS)  # type: ignore[arg-type]
    uuid = sim.gpus[0].uuid
    try:
        for _ in range(3):
            assert "energy_consumption" in backend.sample(uuid).values
            fake_clock.advance(1)
        fake_clock.advance(100)
        backend.sample(uuid)
        # each field in a call of its own (energy's is dear): 82 asked in the first sample and after its retry
        assert hiding.field_ids == [[82], [191], [191], [191], [82], [191]]
    finally:
        backend.shutdown()


def test_memo_forgets_the_oldest_entry_when_full() -> None:
    memo: _Memo[str, int] = _Memo(2)
    assert memo.put("a", 1) == 1 and memo.put("b", 2) == 2
    assert memo.put("a", 3) == 3 and len(memo) == 2  # a known key is replaced, nothing forgotten
    memo.put("c", 4)
    assert (memo.get("a"), memo.get("b"), memo.get("c")) == (None, 2, 4)


# --------------------------------------------------------------------------------------------------
# The async entry (call_async): same work on the same worker, awaited without a default-executor thread
# --------------------------------------------------------------------------------------------------


class _NoThreads(ThreadPoolExecutor):
    """A default executor that fails any use: proves call_async needs none."""

    def submit(self, *args: object, **kwargs: object) -> Future[object]:  # type: ignore[override]
        raise AssertionError("call_async used the default executor")


async def test_call_async_gives_what_the_blocking_calls_give_without_the_default_executor(
    fake_clock: FakeClock, backends: Backends
) -> None:
    sim, backend, (h100, t4) = build(fake_clock, backends, "H100", "T4")
    asyncio.get_running_loop().set_default_executor(_NoThreads(max_workers=1))
    assert await backend.call_async(backend.list_gpus) == backend.list_gpus()
    assert await backend.call_async("constraints", t4) == backend.constraints(t4)
    assert await backend.call_async(backend.driver_version) == backend.driver_version()
    sample = await backend.call_async(backend.sample, h100, ["uuid", "power_limit", "temperature"])
    assert sample.uuid == h100 and set(sample.values) == {"uuid", "power_limit", "temperature"}
    assert sample.values["uuid"] == h100 and sample.values["power_limit"] == 700.0
    assert await backend.call_async(backend.set_power_limit, h100, 350.5) == 350.5
    assert sim.gpu(h100).power_limit_mw == 350_500
    await backend.call_async(backend.set_locked_gpu_clocks, t4, 300, 1590)
    assert await backend.call_async(backend.locked_clocks, t4) == backend.locked_clocks(t4)
    assert backend.locked_clocks(t4)["locked_gpu_clock_max"] == 1590
    assert backend.sample(h100, ["power_limit"]).values["power_limit"] == 350.5  # the blocking path still works


async def test_call_async_raises_the_errors_the_blocking_calls_raise(fake_clock: FakeClock, backends: Backends) -> None:
    sim, backend, (uuid,) = build(fake_clock, backends)
    missing = "GPU-00000000-0000-0000-0000-000000000000"
    with pytest.raises(NotFoundError) as sync_error:
        backend.sample(missing)
    with pytest.raises(NotFoundError) as async_error:
        await backend.call_async(backend.sample, missing)
    assert str(async_error.value) == str(sync_error.value) and missing in str(async_error.value)
    with pytest.raises(InvalidValueError, match="200-700 W") as out_of_range:
        await backend.call_async(backend.set_power_limit, uuid, 800)
    assert out_of_range.value.reason == "out-of-range"
    with pytest.raises(InvalidValueError) as not_a_number:
        await backend.call_async(backend.set_power_limit, uuid, "300")
    assert not_a_number.value.reason == "not-a-number"
    assert sim.calls["nvmlDeviceSetPowerManagementLimit"] == 1  # only the out-of-range one reached NVML
    assert sim.gpu(uuid).power_limit_mw == 700_000
    # a failed plan leaves no trace: the next blocking call runs normally
    assert backend.sample(uuid, ["uuid"]).values["uuid"] == uuid


async def test_call_async_refuses_what_is_not_a_public_method_of_this_backend(
    fake_clock: FakeClock, backends: Backends
) -> None:
    _, backend, (uuid,) = build(fake_clock, backends)
    _, other, _ = build(fake_clock, backends)
    with pytest.raises(TypeError, match="not a method of this NvmlBackend"):
        await backend.call_async(other.sample, uuid)
    with pytest.raises(TypeError, match="not a method of this NvmlBackend"):
        await backend.call_async(len, "x")
    for name in ("shutdown", "_sample", "no_such_method", "call_async"):
        with pytest.raises(TypeError, match=name):
            await backend.call_async(name, uuid)
    assert (await backend.call_async(backend.sample, uuid, ["uuid"])).values["uuid"] == uuid


async def test_a_hung_call_awaited_through_call_async_times_out_and_nvml_is_reinitialised(
    fake_clock: FakeClock, backends: Backends
) -> None:
    sim, backend, (uuid,) = build(fake_clock, backends, call_timeout_s=0.1, init_timeout_s=0.1)
    await backend.call_async(backend.sample, uuid)
    sim.set_call_delay_s(2.0, "nvmlDeviceGetPowerUsage")  # far past the timeout, even on a loaded machine
    ticks = 0

    async def heartbeat() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    beating = asyncio.create_task(heartbeat())
    started = time.monotonic()
    with pytest.raises(TransientError, match=r"no answer from NVML within 0\.1 s"):
        await backend.call_async(backend.sample, uuid)
    assert time.monotonic() - started < 1.5, "the call waited for the hung read instead of timing out"
    assert ticks >= 2  # the event loop kept running while the call hung (a blocked one: 1 at most)
    beating.cancel()
    with pytest.raises(TransientError, match="not attempted: NVML has not answered"):
        await backend.call_async(backend.sample, uuid)  # fails fast while the call hangs
    with pytest.raises(TransientError, match="not attempted"):
        backend.sample(uuid)  # the blocking path sees the same hung call
    sim.set_call_delay_s(0, "nvmlDeviceGetPowerUsage")
    deadline = time.monotonic() + 10
    while True:
        try:
            sample = await backend.call_async(backend.sample, uuid)
            break
        except TransientError:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
    assert "power_usage" in sample.values
    assert sim.calls["nvmlInitWithFlags"] == 2


async def test_a_cancelled_call_async_that_has_not_started_never_runs(
    fake_clock: FakeClock, backends: Backends
) -> None:
    sim, backend, (uuid,) = build(fake_clock, backends)
    await backend.call_async(backend.sample, uuid)
    sim.set_call_delay_s(1.0, "nvmlDeviceGetPowerUsage")  # long enough to cancel the second while it hangs
    first = asyncio.create_task(backend.call_async(backend.sample, uuid))
    second = asyncio.create_task(backend.call_async(backend.set_power_limit, uuid, 300))
    reads = sim.calls["nvmlDeviceGetPowerUsage"]
    deadline = time.monotonic() + 10
    while sim.calls["nvmlDeviceGetPowerUsage"] == reads:  # the first is inside NVML, the second queued behind it
        assert time.monotonic() < deadline, "the first call never reached NVML"
        await asyncio.sleep(0.005)
    second.cancel()
    sample = await first
    assert "power_usage" in sample.values
    with pytest.raises(asyncio.CancelledError):
        await second
    assert backend.sample(uuid, ["power_limit"]).values["power_limit"] == 700.0
    assert sim.calls["nvmlDeviceSetPowerManagementLimit"] == 0


async def test_calls_awaited_in_the_same_loop_iteration_run_as_one_worker_job_each_with_its_own_outcome(
    fake_clock: FakeClock, backends: Backends
) -> None:
    sim, backend, uuids = build(fake_clock, backends, *(["H100"] * 4), "T4")
    await backend.call_async(backend.init)
    worker = backend._worker
    assert worker is not None
    jobs = 0
    submit = worker.submit

    def counting_submit(*args: Any) -> Any:
        nonlocal jobs
        jobs += 1
        return submit(*args)

    worker.submit = counting_submit  # type: ignore[method-assign]
    lost = uuids[1]
    sim.inject_errors("nvmlDeviceGetClockInfo", pynvml.NVML_ERROR_GPU_IS_LOST, 1, uuid=lost)
    outcomes = await asyncio.gather(
        *(backend.call_async(backend.sample, uuid) for uuid in uuids),
        backend.call_async(backend.set_power_limit, uuids[4], 65),
        backend.call_async(backend.set_power_limit, uuids[0], 9000),
        return_exceptions=True,
    )
    assert jobs == 1
    for uuid, outcome in zip(uuids, outcomes, strict=False):
        if uuid == lost:
            assert isinstance(outcome, GpuLostError) and lost in str(outcome)
        else:
            assert isinstance(outcome, Sample) and outcome.values["uuid"] == uuid
    assert outcomes[5] == 65.0 and sim.gpu(uuids[4]).power_limit_mw == 65_000
    assert isinstance(outcomes[6], InvalidValueError) and outcomes[6].reason == "out-of-range"
    assert backend.is_lost(lost) and not any(backend.is_lost(u) for u in uuids if u != lost)


async def test_a_call_that_hangs_in_a_batch_fails_it_and_what_ran_before_it_keeps_its_result(
    fake_clock: FakeClock, backends: Backends
) -> None:
    sim, backend, (first, slow, last) = build(fake_clock, backends, "H100", "A100", "T4", call_timeout_s=0.1)
    await backend.call_async(backend.init)
    sim.set_call_delay_s(2.0, "nvmlDeviceGetPowerUsage")  # the first call asks for the uuid only: no delay
    outcomes = await asyncio.gather(
        backend.call_async(backend.sample, first, ["uuid"]),
        backend.call_async(backend.sample, slow),
        backend.call_async(backend.sample, last),
        return_exceptions=True,
    )
    assert isinstance(outcomes[0], Sample) and outcomes[0].values["uuid"] == first
    for uuid, outcome in zip((slow, last), outcomes[1:], strict=True):
        assert isinstance(outcome, TransientError)
        assert str(outcome).startswith(f"sample of GPU {uuid}: no answer from NVML within 0.1 s")
    with pytest.raises(TransientError, match=f"not attempted: NVML has not answered sample of GPU {slow}"):
        await backend.call_async(backend.sample, first)
    sim.set_call_delay_s(0, "nvmlDeviceGetPowerUsage")
    deadline = time.monotonic() + 10
    while True:
        try:
            sample = await backend.call_async(backend.sample, last)
            break
        except TransientError:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
    assert sample.values["uuid"] == last and sim.calls["nvmlInitWithFlags"] == 2


@settings(max_examples=60, deadline=None)
@given(watts=st.floats(min_value=0, max_value=2000, allow_nan=False))
def test_any_power_limit_is_either_applied_exactly_or_refused_with_the_gpu_unchanged(watts: float) -> None:
    clock = FakeClock()
    sim = SimNvml(1, "A100", clock=clock.monotonic)
    backend = NvmlBackend(sim, clock=clock)
    uuid = sim.gpus[0].uuid
    try:
        backend.set_power_limit(uuid, 250)
        limit_mw = round(watts * 1000)
        if 100_000 <= limit_mw <= 500_000:
            assert backend.set_power_limit(uuid, watts) == limit_mw / 1000
            assert sim.gpu(uuid).power_limit_mw == limit_mw
        else:
            with pytest.raises(InvalidValueError, match="100-500 W"):
                backend.set_power_limit(uuid, watts)
            assert sim.gpu(uuid).power_limit_mw == 250_000
    finally:
        backend.shutdown()


STATIC_CALLS = (
    "nvmlDeviceGetPowerManagementLimitConstraints",
    "nvmlDeviceGetPowerManagementDefaultLimit",
    "nvmlDeviceGetTemperatureThreshold",
    "nvmlDeviceGetMaxClockInfo",
)


def test_values_the_board_fixes_are_read_once_per_nvml_session_and_again_after_a_reload(
    fake_clock: FakeClock, backends: Backends
) -> None:
    sim, backend, (a, b) = build(fake_clock, backends, "H100", "A100")
    first = backend.sample(a).values
    before = {call: sim.calls[call] for call in STATIC_CALLS}
    for _ in range(5):
        fake_clock.advance(1)
        values = backend.sample(a).values
        for prop in ("power_limit_min", "power_limit_max", "power_limit_default", "temperature_slowdown"):
            assert values[prop] == first[prop]
        assert values["clock_sm_max"] == first["clock_sm_max"]
        assert list(values) == list(first), "the same order as read (the telemetry encoder keeps it)"
    assert {call: sim.calls[call] for call in STATIC_CALLS} == before, "served from the session's cache"
    assert sim.calls["nvmlDeviceGetPowerUsage"] >= 6, "what changes is still read every time"

    backend.sample(b)  # the other GPU reads its own
    assert sim.calls["nvmlDeviceGetMaxClockInfo"] == before["nvmlDeviceGetMaxClockInfo"] + 1
    assert backend.sample(b).values["power_limit_max"] != first["power_limit_max"]  # an A100 is not an H100

    sim.driver_reload()
    fake_clock.advance(1)
    backend.sample(a)
    assert (
        sim.calls["nvmlDeviceGetPowerManagementLimitConstraints"]
        > before["nvmlDeviceGetPowerManagementLimitConstraints"] + 1
    ), "read again in the new session"


def test_a_static_value_that_failed_is_not_cached_and_is_read_again(fake_clock: FakeClock, backends: Backends) -> None:
    sim, backend, (a,) = build(fake_clock, backends, "H100")
    sim.inject_errors("nvmlDeviceGetMaxClockInfo", pynvml.NVML_ERROR_NO_PERMISSION, count=1)
    sample = backend.sample(a)
    assert "clock_sm_max" not in sample.values and "clock_sm_max" in sample.errors
    fake_clock.advance(1)
    assert backend.sample(a).values["clock_sm_max"] > 0


# --------------------------------------------------------------------------------------------------
# Dear reads (issue 29): the energy counter on a read cycle of its own and derived in between, memory
# temperature in a call of its own, PCIe throughput on a thread of its own ahead of its ask
# --------------------------------------------------------------------------------------------------

ENERGY_NAMES = ["power_usage", "energy_consumption", "energy_consumption_age", "temperature_memory"]


def record(sim: SimNvml, name: str, clock: FakeClock) -> list[tuple[float, str, tuple[Any, ...], Any]]:
    """Every call of the simulator's device function ``name`` from now on: (fake time, thread name, (GPU uuid,
    the arguments after the handle...), result). Recorded below the binding, so the stand-in layers' calls are
    seen too."""
    calls: list[tuple[float, str, tuple[Any, ...], Any]] = []
    real = getattr(sim, name)

    def wrapper(handle: Any, *args: Any) -> Any:
        result = real(handle, *args)
        calls.append((clock.monotonic(), threading.current_thread().name, (handle.gpu.uuid, *args), result))
        return result

    setattr(sim, name, wrapper)
    return calls


def energy_reads(fields: list[tuple[float, str, tuple[Any, ...], Any]], start_s: float) -> list[int]:
    """The seconds (since ``start_s``) at which field 191 was read."""
    return [round(t - start_s) for t, _, (_, ids), _ in fields if list(ids) == [pynvml.NVML_FI_DEV_ENERGY]]


def test_the_energy_counter_is_read_every_read_cycle_and_derived_from_power_in_between(
    fake_clock: FakeClock, backends: Backends
) -> None:
    sim, backend, (uuid,) = build(fake_clock, backends, "H200", scenario="steady", energy_read_s=60.0)
    fake_clock.advance(30)  # the steady load's power settled (the simulator integrates lazily)
    fields = record(sim, "nvmlDeviceGetFieldValues", fake_clock)
    start = fake_clock.monotonic()
    seen: list[tuple[int, float, float, float]] = []
    for second in range(131):
        values = backend.sample(uuid, ENERGY_NAMES).values
        seen.append((second, values["energy_consumption"], values["energy_consumption_age"], sim.gpu(uuid).energy_j))
        fake_clock.advance(1)
    reads = energy_reads(fields, start)
    assert reads == [0, 60, 120]  # once a read cycle, not every second
    assert all(len(ids) == 1 for _, _, (_, ids), _ in fields)  # memory temperature never shares energy's call
    last_read_j = 0.0
    for second, value, age, true_j in seen:
        if second in reads:
            assert age == 0.0 and value == pytest.approx(true_j, abs=0.001)  # exact: the driver's counter
            last_read_j = true_j
        else:
            assert age == second - max(r for r in reads if r <= second)
            # power (a 1 s average, steady here) integrated: within 1 % of what the GPU used since the read
            assert value == pytest.approx(true_j, abs=0.01 * (true_j - last_read_j) + 0.01)
    assert [v for _, v, _, _ in seen] == sorted(v for _, v, _, _ in seen)  # a counter: never decreasing
    # the process cycle takes the same counter and never reads the driver's, even when a read is due (at 180 s
    # here): that is left to the next collect sample (on the grid, read after the other GPUs of its round)
    reads_before = len(energy_reads(fields, start)), sim.calls["nvmlDeviceGetTotalEnergyConsumption"]
    for _ in range(12):
        fake_clock.advance(5)
        assert backend.processes(uuid).energy_j == pytest.approx(sim.gpu(uuid).energy_j, rel=0.01)
    assert (len(energy_reads(fields, start)), sim.calls["nvmlDeviceGetTotalEnergyConsumption"]) == reads_before
    assert backend.sample(uuid, ENERGY_NAMES).values["energy_consumption_age"] == 0.0  # the collect sample reads it
    assert energy_reads(fields, start) == [0, 60, 120, 191]
    assert backend.energy_clamps == {}


def test_a_read_below_the_derived_value_holds_the_counter_there_and_is_counted(
    fake_clock: FakeClock, backends: Backends
) -> None:
    sim, backend, (uuid,) = build(fake_clock, backends, "H200", scenario="steady", energy_read_s=60.0)
    fake_clock.advance(30)
    real_power = sim.nvmlDeviceGetPowerUsage
    sim.nvmlDeviceGetPowerUsage = lambda h: 2 * real_power(h)  # type: ignore[method-assign]  # runs ahead
    values: list[float] = []
    true: list[float] = []
    for _ in range(131):
        sample = backend.sample(uuid, ENERGY_NAMES).values
        values.append(float(sample["energy_consumption"]))
        true.append(sim.gpu(uuid).energy_j)
        fake_clock.advance(1)
    assert values == sorted(values)  # never decreasing, though the reads at 60 s and 120 s came in lower
    assert backend.energy_clamps == {uuid: 2}
    assert values[60] > true[60] + 1000  # held: the derived value stays where it was
    power_w = (true[60] - true[0]) / 60
    held_s = round((values[60] - true[60]) / (2 * power_w))  # until the doubled power has caught up
    assert values[61 : 60 + held_s - 1] == [values[60]] * (held_s - 2)
    assert values[60 + held_s + 1] > values[60]


def test_each_gpus_energy_read_falls_in_a_round_of_its_own(fake_clock: FakeClock, backends: Backends) -> None:
    sim, backend, uuids = build(fake_clock, backends, *["H200"] * 8, scenario="steady", energy_read_s=60.0)
    fields = record(sim, "nvmlDeviceGetFieldValues", fake_clock)
    power = record(sim, "nvmlDeviceGetPowerUsage", fake_clock)  # (before the first sample binds the getter)
    start = fake_clock.monotonic()
    for _ in range(126):
        backend.sample_many([(u, ["power_usage", "energy_consumption"]) for u in uuids])
        fake_clock.advance(1)
    per_round = Counter(energy_reads(fields, start))
    assert per_round[0] == 8  # each GPU's first read, at start-up
    assert max(n for second, n in per_round.items() if second > 0) == 1  # then never two GPUs in one round
    assert sum(per_round.values()) >= 2 * 8  # and each read again within two read cycles
    # and in its round the GPU that reads the counter is read last: its dear read delays no other GPU's sample
    fields.clear()
    start = fake_clock.monotonic()
    for _ in range(60):
        backend.sample_many([(u, ["power_usage", "energy_consumption"]) for u in uuids])
        fake_clock.advance(1)
    reading = {round(t - start): uuid for t, _, (uuid, ids), _ in fields if list(ids) == [pynvml.NVML_FI_DEV_ENERGY]}
    assert len(reading) == 8  # each GPU once in the read cycle, each in a round of its own
    for second, uuid in reading.items():
        order = [u for t, _, (u,), _ in power if round(t - start) == second]
        assert sorted(order) == sorted(uuids) and order[-1] == uuid, (second, order, uuid)


def test_without_a_power_reading_the_energy_counter_is_read_every_sample(fake_clock: FakeClock) -> None:
    sim = SimNvml.from_profiles(("H200",), seed=5, clock=fake_clock.monotonic)
    backend = NvmlBackend(_Hiding(sim, "nvmlDeviceGetPowerUsage"), clock=fake_clock, energy_read_s=60.0)
    uuid = sim.gpus[0].uuid
    try:
        for _ in range(5):
            values = backend.sample(uuid, ["energy_consumption", "energy_consumption_age"]).values
            assert values["energy_consumption"] == pytest.approx(sim.gpu(uuid).energy_j, abs=0.001)
            assert values["energy_consumption_age"] == 0.0
            fake_clock.advance(1)
    finally:
        backend.shutdown()


def wait_blocking_idle(backend: NvmlBackend) -> None:
    """Until no blocking read runs (they run on their own thread, in real time)."""
    deadline = time.monotonic() + 5
    while any(state.running for state in list(backend._blocking_states.values())):
        assert time.monotonic() < deadline, "a blocking read did not finish"
        time.sleep(0.001)


def test_pcie_throughput_is_read_on_its_own_thread_ahead_of_its_ask(fake_clock: FakeClock, backends: Backends) -> None:
    sim, backend, uuids = build(fake_clock, backends, "H200", "H200", scenario="inference", blocking_thread=True)
    pcie = record(sim, "nvmlDeviceGetPcieThroughput", fake_clock)
    start = fake_clock.monotonic()
    delivered: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for second in range(31):
        names = ["temperature", "pcie_tx", "pcie_rx"] if second % 5 == 0 else ["temperature"]
        got = backend.sample_many([(u, names) for u in uuids])
        assert len(got.started_s) == 2 and got.started_s[0] <= got.started_s[1]
        for uuid, sample in zip(uuids, got.samples, strict=True):
            assert isinstance(sample, Sample)
            if second % 5:
                continue
            if second == 5:  # asked 5 s after the first ask, not 30 s (the catalog's cycle): nothing read ahead
                assert set(sample.errors) == {"pcie_tx", "pcie_rx"} and "pcie_tx" not in sample.values
                assert "read on a thread of its own" in sample.errors["pcie_tx"]
                continue
            assert sample.errors == {}
            for prop, counter in (
                ("pcie_tx", pynvml.NVML_PCIE_UTIL_TX_BYTES),
                ("pcie_rx", pynvml.NVML_PCIE_UTIL_RX_BYTES),
            ):
                delivered.setdefault((uuid, counter), []).append((second, int(sample.values[prop])))
        wait_blocking_idle(backend)
        fake_clock.advance(1)
    assert {thread for _, thread, _, _ in pcie} == {"nvml-blocking"}  # never in the job that samples the GPUs
    # the reads, per GPU and counter: the first ask's (waited for), then, once two asks showed the interval, one
    # started by the GPU's 1 s samples within 1.5 s of each next ask
    reads: dict[tuple[str, int], dict[int, int]] = {}
    for t, _, (uuid, counter), kbs in pcie:
        reads.setdefault((uuid, counter), {})[round(t - start)] = kbs
    assert set(reads) == set(delivered) and len(reads) == 4
    read_at = {0: 0, 10: 9, 15: 14, 20: 19, 25: 24, 30: 29}  # the ask -> the read whose value it carries
    for key, values in delivered.items():
        assert sorted(reads[key]) == sorted(read_at.values())
        assert values == [(ask, reads[key][read] * 1024) for ask, read in read_at.items()]  # bytes/s, from KB/s


def test_the_first_pcie_read_is_waited_for_and_a_fresh_value_served_again(
    fake_clock: FakeClock, backends: Backends
) -> None:
    """At the catalog's 30 s cycle the first read (waited for, once) and then one read ahead of each ask; a value
    read moments ago is served again to another ask (``gpu-mapper discover`` probes, then samples)."""
    sim, backend, (uuid,) = build(fake_clock, backends, "H200", scenario="inference", blocking_thread=True)
    pcie = record(sim, "nvmlDeviceGetPcieThroughput", fake_clock)
    start = fake_clock.monotonic()
    first = backend.sample(uuid, ["pcie_tx"])
    again = backend.sample(uuid, ["pcie_tx"])
    assert first.errors == {} and again.values == first.values
    for second in range(1, 91):
        fake_clock.advance(1)
        sample = backend.sample(uuid, ["temperature", "pcie_tx"] if second % 30 == 0 else ["temperature"])
        wait_blocking_idle(backend)
        if second % 30 == 0:
            assert sample.errors == {} and sample.values["pcie_tx"] == pcie[-1][3] * 1024
    assert [round(t - start) for t, *_ in pcie] == [0, 29, 59, 89]


def test_pcie_throughput_nvml_does_not_support_is_absent_and_asked_again_only_at_its_retry(
    fake_clock: FakeClock, backends: Backends
) -> None:
    sim, backend, (uuid,) = build(fake_clock, backends, "H200", blocking_thread=True, unsupported_retry_s=100.0)
    sim.inject_errors("nvmlDeviceGetPcieThroughput", pynvml.NVML_ERROR_NOT_SUPPORTED, 2)
    for _ in range(5):
        sample = backend.sample(uuid, ["temperature", "pcie_tx", "pcie_rx"])
        wait_blocking_idle(backend)
        assert sample.errors == {} and set(sample.values) == {"temperature"}  # absent: NotSupported
        fake_clock.advance(10)
    assert sim.calls["nvmlDeviceGetPcieThroughput"] == 2  # once per counter, then not before the retry
    fake_clock.advance(60)
    sample = backend.sample(uuid, ["temperature", "pcie_tx", "pcie_rx"])
    assert sample.errors == {} and {"pcie_tx", "pcie_rx"} <= set(sample.values)  # the retry's read, waited for
