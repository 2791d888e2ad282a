"""NvmlBackend.processes over the simulator, directly and through the REAL pynvml over the C stand-in (the
installed nvidia-ml-py and the oldest allowed), for drivers with and without each process call."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mapper.clock import FakeClock
from mapper.edge.gpu.simnvml import SimNvml
from mapper.shared.model import ProcessSource
from tests.nvml_standin import LAYERS, layer_id
from tests.test_nvml_contract import Backends, build


@pytest.fixture(params=LAYERS, ids=layer_id)
def backends(request: pytest.FixtureRequest) -> Iterator[Backends]:
    """The contract suite's layers: the simulator, and the two bindings over the stand-in."""
    made = Backends(request.param)
    yield made
    for backend in made:
        backend.shutdown()
    for standin in made.standins:
        standin.close()
        assert standin.failures == [], "a stand-in callback failed:\n" + "\n".join(standin.failures)


GIB = 1 << 30


def _driver(backends: Backends) -> str:
    """A driver whose process struct the layer's binding reads: nvidia-ml-py 12.535 was built for r535's
    32-byte entries (see the last test)."""
    return "535.104.05" if backends.layer == "floor" else "590.48.01"


def _new_util_source(backends: Backends) -> str:
    return "process-utilization" if backends.layer == "floor" else "processes-utilization-info"


def _warm(clock: FakeClock, sim: SimNvml, seconds: float = 10.0) -> None:
    clock.advance(seconds)
    for gpu in sim.gpus:
        sim.gpu(gpu.uuid)


def test_scenario_processes_with_memory_and_utilization_shares(fake_clock: FakeClock, backends: Backends) -> None:
    sim, backend, (uuid,) = build(fake_clock, backends, "H100", scenario="steady", driver_version=_driver(backends))
    source: ProcessSource = backend
    source.processes(uuid)  # the first call sees NVML's whole buffer; shares are compared on the next
    _warm(fake_clock, sim)
    sample = source.processes(uuid)
    assert [p.pid for p in sample.processes] == [1001]
    (proc,) = sample.processes
    assert proc.kind == "compute"
    assert proc.memory_used_bytes is not None and proc.memory_used_bytes > GIB
    # the one process has the whole GPU: its SM share is the GPU's utilisation (70 % in "steady")
    assert proc.sm_ratio == pytest.approx(0.70, abs=0.011)
    assert sample.energy_j is not None and sample.energy_j > 0
    assert sample.power_w is not None and sample.power_w > sim.gpus[0].profile.idle_power_w
    assert sample.utilization_source == _new_util_source(backends)  # r550+ has the newer call
    assert dict(sample.unsupported) == {}


def test_started_processes_share_by_weight_and_their_memory_adds_to_the_gpus(
    fake_clock: FakeClock, backends: Backends
) -> None:
    sim, backend, (uuid,) = build(fake_clock, backends, "A100", scenario="steady", driver_version=_driver(backends))
    sim.set_scenario_processes(uuid, False)
    base = sim.gpu(uuid).memory_used_bytes  # the driver's own, with no process
    assert base < GIB
    sim.start_process(uuid, 4242, 3 * GIB, weight=3.0)
    sim.start_process(uuid, 4343, 1 * GIB, weight=1.0, kind="compute+graphics")
    backend.processes(uuid)
    _warm(fake_clock, sim)
    sample = backend.processes(uuid)
    by_pid = {p.pid: p for p in sample.processes}
    assert set(by_pid) == {4242, 4343}
    assert by_pid[4242].memory_used_bytes == 3 * GIB and by_pid[4343].memory_used_bytes == GIB
    assert by_pid[4343].kind == "compute+graphics"  # in both lists, its memory counted once
    assert by_pid[4242].sm_ratio == pytest.approx(0.70 * 0.75, abs=0.011)
    assert by_pid[4343].sm_ratio == pytest.approx(0.70 * 0.25, abs=0.011)
    assert sim.gpu(uuid).memory_used_bytes == base + 4 * GIB
    sim.stop_process(uuid, 4343)
    _warm(fake_clock, sim)
    assert [p.pid for p in backend.processes(uuid).processes] == [4242]


def test_a_growing_process_grows_in_nvmls_list(fake_clock: FakeClock, backends: Backends) -> None:
    sim, backend, (uuid,) = build(fake_clock, backends, "H100", scenario="idle", driver_version=_driver(backends))
    sim.start_process(uuid, 77, GIB, growth_bytes_per_s=1 << 20)
    first = backend.processes(uuid).processes[0].memory_used_bytes
    _warm(fake_clock, sim, 100.0)
    later = backend.processes(uuid).processes[0].memory_used_bytes
    assert first is not None and later is not None and later - first == pytest.approx(100 << 20, rel=0.01)


def test_no_process_and_no_new_sample_is_an_empty_list_not_an_error(fake_clock: FakeClock, backends: Backends) -> None:
    _sim, backend, (uuid,) = build(fake_clock, backends, "T4", scenario="idle", driver_version=_driver(backends))
    sample = backend.processes(uuid)
    assert sample.processes == () and dict(sample.unsupported) == {}
    assert sample.utilization_source == _new_util_source(backends)


@pytest.mark.parametrize(
    ("driver", "source"),
    [("545.29.06", "process-utilization"), ("470.256.02", "process-utilization")],
    ids=["r545", "r470"],
)
def test_older_drivers_fall_back(fake_clock: FakeClock, backends: Backends, driver: str, source: str) -> None:
    """Before r550 there is no ProcessesUtilizationInfo; before r510 no v3 process lists (v2 where the binding
    has it; nvidia-ml-py 12.535 has no v2 wrapper, so its process list is unsupported on such a driver)."""
    if backends.layer == "floor":
        driver = "535.104.05" if driver.startswith("545") else driver  # the floor binding's own struct size
    sim, backend, (uuid,) = build(fake_clock, backends, "H100", scenario="steady", driver_version=driver)
    backend.processes(uuid)
    _warm(fake_clock, sim)
    sample = backend.processes(uuid)
    assert sample.utilization_source == source
    assert [p.pid for p in sample.processes] == [1001]
    assert sample.processes[0].sm_ratio == pytest.approx(0.70, abs=0.011)
    no_v2 = backends.layer == "floor"
    if driver.startswith("470") and no_v2:
        assert sample.processes[0].memory_used_bytes is None
        assert sample.unsupported["processes"] == "not-supported"
    else:
        assert sample.processes[0].memory_used_bytes is not None
        assert "processes" not in sample.unsupported


def test_unsupported_process_calls_are_remembered_not_asked_every_cycle(
    fake_clock: FakeClock, backends: Backends
) -> None:
    sim, backend, (uuid,) = build(fake_clock, backends, "H100", scenario="steady", driver_version=_driver(backends))
    sim.inject_errors("nvmlDeviceGetComputeRunningProcesses_v3", 3, count=100)  # NotSupported
    sim.inject_errors("nvmlDeviceGetProcessesUtilizationInfo", 3, count=100)
    sim.inject_errors("nvmlDeviceGetProcessUtilization", 3, count=100)
    for _ in range(5):
        sample = backend.processes(uuid)
        _warm(fake_clock, sim, 5.0)
    assert sample.unsupported["processes:compute"] == "not-supported"
    assert sample.unsupported["utilization"] == "not-supported"
    assert sim.calls["nvmlDeviceGetComputeRunningProcesses_v3"] == 1
    assert sim.calls["nvmlDeviceGetProcessUtilization"] == 1


def test_a_binding_built_for_another_process_struct_size_says_so(fake_clock: FakeClock, backends: Backends) -> None:
    """r535 drivers write 32-byte process entries, the others 24: a binding of the other size would read every
    process after the first as garbage, so the backend refuses the list with a reason instead."""
    for driver in ("590.48.01", "535.104.05"):
        _sim, backend, (uuid,) = build(fake_clock, backends, "H100", scenario="inference", driver_version=driver)
        sample = backend.processes(uuid)
        pids = sorted(p.pid for p in sample.processes)
        if backends.layer == "sim":  # no C struct in between: always read right
            fits = True
        else:
            wide = backends.standins[-1].pynvml.c_nvmlProcessInfo_t._fields_[-1][0] == "usedGpuCcProtectedMemory"
            fits = wide == driver.startswith("535")
        if fits:
            assert pids == [1001, 1002] and all(p.memory_used_bytes for p in sample.processes)
            assert "processes:compute" not in sample.unsupported
        else:
            assert sample.unsupported["processes:compute"] == "binding-mismatch"
            assert all(p.memory_used_bytes is None for p in sample.processes)  # pids from utilisation only
            assert set(pids) <= {1001, 1002}


def test_the_simulators_process_controls_refuse_bad_input_by_name() -> None:
    sim = SimNvml(1, "H100", scenario="steady", clock=lambda: 50.0)
    uuid = sim.gpus[0].uuid
    with pytest.raises(ValueError, match="already runs"):
        sim.start_process(uuid, 1001, GIB)  # the scenario's own trainer
    with pytest.raises(ValueError, match="pid must be > 0"):
        sim.start_process(uuid, 0, GIB)
    with pytest.raises(ValueError, match="kind must be"):
        sim.start_process(uuid, 5, GIB, kind="video")
    with pytest.raises(KeyError, match="not a started process"):
        sim.stop_process(uuid, 1001)
