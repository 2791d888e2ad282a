"""The read path of NvmlBackend against the real pynvml: on a machine with an NVIDIA GPU, and everywhere over
the C-level stand-in (``tests/nvml_standin.py``).

Each test runs three times (the ``real_nvml`` fixture): the real pynvml over the stand-in library with the
installed nvidia-ml-py and a current driver; the oldest allowed nvidia-ml-py (12.535.77) with a pre-r535 driver
(its fallbacks: ThrottleReasons for clock event reasons, TotalEnergyConsumption for energy); and the
real pynvml over the real driver, which is skipped (with the reason NVML gave) where nvmlInit fails. It never
calls a setter: the backend gets pynvml wrapped in ``ReadOnlyNvml``, which fails the test on any access to a
function that changes GPU state.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pynvml
import pytest

from mapper.edge.gpu.nvml import NvmlBackend
from mapper.edge.gpu.simnvml import SimNvml
from mapper.shared.model import NVML_PROPERTIES, PROPERTY_BY_NAME, TWIN_VALUE_RE, format_value
from tests.nvml_standin import StandIn, floor_binding, installed_binding, standin_library

#: Prefixes of pynvml functions that change GPU, driver or system state.
WRITE_PREFIXES = (
    "nvmlDeviceSet",
    "nvmlDeviceReset",
    "nvmlDeviceClear",
    "nvmlDeviceModify",
    "nvmlDeviceRemove",
    "nvmlDeviceCreate",
    "nvmlDeviceDiscover",
    "nvmlSystemSet",
    "nvmlGpuInstanceCreate",
    "nvmlGpuInstanceDestroy",
    "nvmlComputeInstanceDestroy",
    "nvmlUnitSet",
    "nvmlVgpuInstanceSet",
    "nvmlVgpuInstanceClear",
)

PYTHON_TYPES = {"INT": int, "FLOAT": float, "BOOLEAN": bool, "STRING": str}

#: The catalog's core properties: every NVIDIA datacenter GPU since Volta answers them (energy through the
#: field or, before r535, nvmlDeviceGetTotalEnergyConsumption). A real sample must have them, without errors.
CORE = (
    "uuid",
    "product_name",
    "utilization_gpu",
    "memory_used",
    "memory_total",
    "temperature",
    "power_usage",
    "energy_consumption",
    "power_limit",
    "clock_sm",
    "clock_memory",
    "clock_event_reasons",
    "pstate",
)
#: The stand-in's machines: (nvidia-ml-py, simulated driver, GPU profiles).
STANDINS = {
    "standin-installed": ("installed", "590.48.01", ("H100", "A10", "RTX4080S")),
    "standin-floor-r530": ("floor", "530.30.02", ("A100", "T4")),
}


class SetterCalled(AssertionError):
    pass


class ReadOnlyNvml:
    """The real pynvml, minus every function that writes: touching one fails the test."""

    def __init__(self, module: Any) -> None:
        self._module = module
        self.refused: list[str] = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith(WRITE_PREFIXES):
            self.refused.append(name)
            raise SetterCalled(f"the real-GPU test must never call {name}")
        return getattr(self._module, name)


def test_the_read_only_wrapper_refuses_every_setter() -> None:
    guard = ReadOnlyNvml(pynvml)
    setters = [n for n in dir(pynvml) if n.startswith(WRITE_PREFIXES) and callable(getattr(pynvml, n))]
    assert "nvmlDeviceSetPowerManagementLimit" in setters and "nvmlDeviceResetGpuLockedClocks" in setters
    for name in setters:
        with pytest.raises(SetterCalled):
            getattr(guard, name)
    assert guard.refused == setters
    assert guard.nvmlDeviceGetPowerUsage is pynvml.nvmlDeviceGetPowerUsage
    assert guard.NVMLError is pynvml.NVMLError


@pytest.fixture(scope="module", params=[*STANDINS, "real"])
def real_nvml(request: pytest.FixtureRequest) -> Iterator[ReadOnlyNvml]:
    if request.param in STANDINS:
        which, driver, gpus = STANDINS[request.param]
        sim = SimNvml.from_profiles(gpus, seed=3, driver_version=driver, scenario="steady")
        standin = StandIn(sim, standin_library(), installed_binding() if which == "installed" else floor_binding())
        guard = ReadOnlyNvml(standin.pynvml)
        yield guard
        standin.close()
        assert standin.failures == [], standin.failures
        assert guard.refused == [], f"a setter was reached: {guard.refused}"
        return
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        pytest.skip(f"no usable NVIDIA GPU here: nvmlInit failed with {exc!r}")
    try:
        if pynvml.nvmlDeviceGetCount() == 0:
            pytest.skip("NVML initialised but reports no GPU")
        guard = ReadOnlyNvml(pynvml)
        yield guard
        assert guard.refused == [], f"a setter was reached: {guard.refused}"
    finally:
        pynvml.nvmlShutdown()


@pytest.fixture
def backend(real_nvml: ReadOnlyNvml) -> Iterator[NvmlBackend]:
    backend = NvmlBackend(real_nvml, call_timeout_s=30.0)
    yield backend
    backend.shutdown()


@pytest.mark.gpu
def test_real_gpus_are_listed_by_uuid(backend: NvmlBackend) -> None:
    gpus = backend.list_gpus()
    assert gpus
    for gpu in gpus:
        assert gpu.uuid.startswith(("GPU-", "MIG-"))
        assert gpu.name and gpu.driver_version
    assert backend.driver_version() == gpus[0].driver_version


@pytest.mark.gpu
def test_every_real_value_has_its_catalog_type_and_fits_a_twin(backend: NvmlBackend) -> None:
    for gpu in backend.list_gpus():
        sample = backend.sample(gpu.uuid)
        values = sample.values
        for name, value in values.items():
            spec = PROPERTY_BY_NAME[name]
            assert type(value) is PYTHON_TYPES[spec.ptype], f"{name}: {value!r} is not {spec.ptype}"
            assert TWIN_VALUE_RE.fullmatch(format_value(spec, value)), f"{name}: {value!r}"
            if isinstance(value, float):
                assert math.isfinite(value) and value >= 0
        assert set(values) <= {p.name for p in NVML_PROPERTIES}
        assert {p: e for p, e in sample.errors.items() if p in CORE} == {}, gpu.name
        for core in CORE:
            assert core in values, f"{gpu.name}: {core} missing; errors: {sample.errors}"
        assert values["uuid"] == gpu.uuid
        assert 0 < values["temperature"] < 120  # celsius
        assert values["memory_used"] <= values["memory_total"]  # bytes
        if "memory_reserved" in values:
            assert values["memory_used"] + values["memory_reserved"] <= values["memory_total"]
        assert 0 <= values["utilization_gpu"] <= 100  # percent
        if "power_usage" in values and "power_limit_max" in values:
            assert 0 < float(values["power_usage"]) < 1.5 * float(values["power_limit_max"])  # W, not mW
        if "clock_sm_max" in values:
            assert 100 < int(values["clock_sm_max"]) < 5000  # MHz


@pytest.mark.gpu
def test_real_energy_counter_does_not_go_backwards(backend: NvmlBackend) -> None:
    uuid = backend.list_gpus()[0].uuid
    first = backend.sample(uuid, ["energy_consumption"])
    assert "energy_consumption" in first.values, f"no energy counter; errors: {first.errors}"
    second = backend.sample(uuid, ["energy_consumption"]).values["energy_consumption"]
    assert float(second) >= float(first.values["energy_consumption"]) >= 0  # J since the driver loaded
    assert not [e for e in backend.poll_events() if e.kind == "driver_reload"]


@pytest.mark.gpu
def test_real_constraints_are_consistent(backend: NvmlBackend) -> None:
    uuid = backend.list_gpus()[0].uuid
    c = backend.constraints(uuid)  # (what a GPU does not support is left empty, not raised)
    if c.power_limit_min_w is not None and c.power_limit_max_w is not None:
        assert 0 < c.power_limit_min_w <= c.power_limit_max_w
        if c.power_limit_default_w is not None:
            assert c.power_limit_min_w <= c.power_limit_default_w <= c.power_limit_max_w
    assert list(c.memory_clocks_mhz) == sorted(c.memory_clocks_mhz, reverse=True)
    assert list(c.graphics_clocks_mhz) == sorted(c.graphics_clocks_mhz, reverse=True)


@pytest.mark.gpu
def test_polling_real_events_returns_without_blocking(backend: NvmlBackend) -> None:
    events = backend.poll_events()
    assert isinstance(events, list)
    assert all(e.kind in ("xid", "ecc_single", "ecc_double", "gpu_lost", "driver_reload") for e in events)


@pytest.mark.gpu
def test_the_driver_checks_answer_with_nvmls_version_and_the_inforom_versions(backend: NvmlBackend) -> None:
    driver = backend.driver_version()
    for gpu in backend.list_gpus():
        checks = {c.name: c for c in backend.driver_checks(gpu.uuid, 5.0)}
        assert set(checks) == {"nvml-responsive", "inforom"}
        assert checks["nvml-responsive"].status in ("healthy", "degraded"), checks["nvml-responsive"]
        assert dict(checks["nvml-responsive"].detail)["driver_version"] == driver
        inforom = checks["inforom"]
        assert inforom.status == "healthy", inforom
        versions = dict(inforom.detail)
        assert set(versions) == {"image_version", "oem_version", "ecc_version", "power_version"}
        assert all(v and TWIN_VALUE_RE.fullmatch(v.replace(" ", "_")) for v in versions.values()), versions


@pytest.mark.gpu
def test_the_cuda_probe_passes_on_each_real_gpu() -> None:
    import ctypes

    from mapper.edge.gpu.cudaprobe import CudaProbe

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        pytest.skip(f"no libcuda here: {exc}")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        pytest.skip(f"no usable NVIDIA GPU here: nvmlInit failed with {exc!r}")
    backend = NvmlBackend(ReadOnlyNvml(pynvml), call_timeout_s=30.0)
    try:
        gpus = backend.list_gpus()
    finally:
        backend.shutdown()
        pynvml.nvmlShutdown()
    for gpu in gpus:
        result = CudaProbe().probe(gpu.uuid, gpu.pci_bus_id, 60.0)
        assert result.outcome == "pass", (gpu.uuid, result)
        assert result.latency_s is not None and 0 < result.latency_s < 60
