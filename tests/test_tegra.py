"""JetPack 7 boards: a Thor's sysfs layout (gpu-gpc-N devfreq without of_node name or load file, INA238, bwmgr)
read by JetsonBackend, and TegraBackend taking each property from the source that answers: the real pynvml over
the stand-in libnvidia-ml over the simulated NVML of the board (an Orin with JetPack 7.2 whose NVML answers
NotSupported; a Thor whose NVML serves load, memory and processes), beside the simulated sysfs tree."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from mapper.clock import FakeClock
from mapper.edge.backends import build_jetson_backend, wants_jetson
from mapper.edge.config import Settings
from mapper.edge.gpu.jetson import JetsonBackend, board_uuid, tegra_gpu_present
from mapper.edge.gpu.nvml import NvmlBackend
from mapper.edge.gpu.simjetson import PROFILES, SimJetson, build_tree, nvpmodel_command
from mapper.edge.gpu.simnvml import SimNvml, scenario_pid, sim_health_tools
from mapper.edge.gpu.tegra import TegraBackend, board_health_tools
from mapper.errors import PermanentError, UnsupportedError
from mapper.shared.model import PROPERTY_BY_NAME, TWIN_VALUE_RE, family_properties, format_value
from mapper.tools.discover import device_yaml, probe_all
from tests.nvml_standin import StandIn, installed_binding, standin_library
from tests.test_device_models import assert_valid_kubeedge, needs_crds

Layer = Callable[[SimNvml], Any]


@pytest.fixture
def layer() -> Iterator[Layer]:
    """What a board's NvmlBackend calls: the installed pynvml over a stand-in library over the simulator."""
    made: list[StandIn] = []

    def over(sim: SimNvml) -> Any:
        standin = StandIn(sim, standin_library(), installed_binding())
        made.append(standin)
        return standin.pynvml

    yield over
    for standin in made:
        standin.close()
        assert standin.failures == [], "a stand-in callback failed:\n" + "\n".join(standin.failures)


class Board:
    """A simulated board: its tree and physics, its simulated NVML (None before JetPack 7), the backend."""

    def __init__(self, tmp_path: Path, name: str, layer: Layer, clock: FakeClock, scenario: str = "steady") -> None:
        self.root = tmp_path / name
        self.clock = clock
        self.sim = SimJetson.create(self.root, name, scenario=scenario, clock=clock.monotonic)
        self.nvml_sim: SimNvml | None = None
        nvml = None
        if self.sim.prof.nvml_profile is not None:
            nvml_sim = self.nvml_sim = SimNvml(
                1,
                self.sim.prof.nvml_profile,
                seed=0,
                scenario=scenario,
                clock=clock.monotonic,
                driver_version=self.sim.prof.nvml_driver,
            )
            self.sim.on_load = lambda load: nvml_sim.set_utilization(None, round(100 * load, 1))
            nvml = NvmlBackend(layer(nvml_sim), clock=clock)
        self.backend = TegraBackend(
            self.root, nvml=nvml, no_nvml="no NVML (JetPack 6)", nvpmodel=nvpmodel_command(self.root), clock=clock
        )
        self.uuid = board_uuid(self.sim.prof.model, self.sim.prof.serial)

    def close(self) -> None:
        self.backend.shutdown()


@pytest.fixture
def boards(tmp_path: Path, layer: Layer) -> Iterator[Callable[..., Board]]:
    made: list[Board] = []

    def make(name: str, scenario: str = "steady") -> Board:
        made.append(Board(tmp_path, name, layer, FakeClock(), scenario))
        return made[-1]

    yield make
    for board in made:
        board.close()


def hwmon_watts(hwmon: Path, n: int) -> float:
    return int((hwmon / f"in{n}_input").read_text()) * int((hwmon / f"curr{n}_input").read_text()) / 1e6


# --- a Thor's sysfs, read by JetsonBackend ---------------------------------------------------------------------


def test_a_thor_is_found_by_its_gpc_domain_without_of_node_name_or_load_file(tmp_path: Path) -> None:
    clock = FakeClock()
    root = tmp_path / "thor"
    SimJetson.create(root, "thor", scenario="steady", clock=clock.monotonic)
    assert not (root / "sys/class/devfreq/gpu-gpc-0/device/of_node").exists()
    assert tegra_gpu_present(root)
    backend = JetsonBackend(root, clock=clock)
    (gpu,) = backend.list_gpus()
    assert gpu.family == "jetson" and gpu.architecture == ""  # a GPC domain names no architecture
    sample = backend.sample(gpu.uuid)
    assert sample.errors == {}
    assert "utilization_gpu" not in sample.values  # no load file on a Thor: its NVML serves the load
    devfreq = root / "sys/class/devfreq/gpu-gpc-0"
    assert sample.values["gpu_freq"] == int((devfreq / "cur_freq").read_text()) / 1e6
    assert sample.values["gpu_max_freq"] == 1377.0  # mode 1 (120W), the default
    assert sample.values["gpu_governor"] == "nvhost_podgov"
    assert sample.values["emc_freq"] == int((root / "sys/class/devfreq/bwmgr/cur_freq").read_text()) / 1e6
    ina3221 = root / "sys/bus/i2c/devices/1-0040/hwmon/hwmon1"
    vin = root / "sys/bus/i2c/devices/2-0044/hwmon/hwmon2"
    vin_w = int((vin / "power1_input").read_text()) / 1e6  # the INA238's power, in uW
    assert sample.values["power_usage"] == pytest.approx(vin_w, abs=1e-3)  # the board input, not a sum
    assert sample.values["power_gpu_rail"] == pytest.approx(hwmon_watts(ina3221, 1), abs=1e-3)  # VDD_GPU
    rails = [part.split(":")[0] for part in str(sample.values["power_rails"]).split(",")]
    assert rails == ["VDD_GPU", "VDD_CPU_SOC_MSS", "VIN_SYS_5V0", "VIN"]


def test_the_video_decoder_and_the_emc_devfreq_are_not_a_gpu(tmp_path: Path) -> None:
    build_tree(tmp_path, "thor")
    shutil.rmtree(tmp_path / "sys/class/devfreq/gpu-gpc-0")
    assert sorted(p.name for p in (tmp_path / "sys/class/devfreq").iterdir()) == ["bwmgr", "gpu-nvd-0"]
    assert not tegra_gpu_present(tmp_path)


def test_a_range_is_set_on_every_gpc_domain_and_nvpmodel_sets_them_all(tmp_path: Path) -> None:
    build_tree(tmp_path, "thor")
    base = tmp_path / "sys/class/devfreq"
    shutil.copytree(base / "gpu-gpc-0", base / "gpu-gpc-1", symlinks=True)  # a second GPC domain
    backend = JetsonBackend(tmp_path, nvpmodel=nvpmodel_command(tmp_path))
    (gpu,) = backend.list_gpus()
    assert backend.set_gpu_freq_range(gpu.uuid, 459, 918) == (459.0, 918.0)
    for domain in ("gpu-gpc-0", "gpu-gpc-1"):
        assert (base / domain / "min_freq").read_text().strip() == "459000000"
        assert (base / domain / "max_freq").read_text().strip() == "918000000"
    assert (base / "gpu-nvd-0/max_freq").read_text().strip() == "115200000"  # the decoder's untouched
    backend.set_power_mode(gpu.uuid, 2)  # 90W: GPU up to 1071 MHz
    for domain in ("gpu-gpc-0", "gpu-gpc-1"):
        assert (base / domain / "max_freq").read_text().strip() == "1071000000"
    assert (base / "bwmgr/max_freq").read_text().strip() == "4266000000"


def test_an_ina238_reads_its_label_and_bus_voltage_times_current_without_a_power_file(tmp_path: Path) -> None:
    build_tree(tmp_path, "thor")
    hwmon = tmp_path / "sys/bus/i2c/devices/2-0044/hwmon/hwmon2"
    (hwmon / "power1_input").unlink()
    (hwmon / "label").write_text("VIN_CARRIER\n")
    (hwmon / "in1_input").write_text("19500\n")  # mV
    (hwmon / "curr1_input").write_text("2000\n")  # mA
    backend = JetsonBackend(tmp_path)
    (gpu,) = backend.list_gpus()
    values = backend.sample(gpu.uuid, ["power_rails", "power_usage"]).values
    assert str(values["power_rails"]).endswith(",VIN_CARRIER:39")
    # No VDD_IN or VIN rail any more: the module power is the sum of the rails, as on an AGX Orin.
    rails = [float(part.split(":")[1]) for part in str(values["power_rails"]).split(",")]
    assert values["power_usage"] == pytest.approx(sum(rails), abs=0.01)


def test_the_performance_governor_holds_the_maximum_frequency(tmp_path: Path) -> None:
    clock = FakeClock()
    sim = SimJetson.create(tmp_path, "orin-agx-jp7", scenario="idle", clock=clock.monotonic)
    devfreq = tmp_path / "sys/class/devfreq/17000000.gpu"
    assert "performance" in (devfreq / "available_governors").read_text().split()
    clock.advance(1)
    sim.step()
    assert int((devfreq / "cur_freq").read_text()) < int((devfreq / "max_freq").read_text()) == 816000000  # idle
    (devfreq / "governor").write_text("performance\n")
    clock.advance(1)
    sim.step()
    assert (devfreq / "cur_freq").read_text() == (devfreq / "max_freq").read_text()
    backend = JetsonBackend(tmp_path)
    (gpu,) = backend.list_gpus()
    assert backend.sample(gpu.uuid, ["gpu_governor"]).values == {"gpu_governor": "performance"}


# --- TegraBackend: each property from the source that answers ----------------------------------------------


def test_on_jetpack7_orin_nvml_initialises_but_serves_nothing_so_sysfs_serves_what_jetpack6_has(boards) -> None:
    jp7 = boards("orin-agx-jp7")
    jp6 = boards("orin-agx")
    assert jp7.nvml_sim is not None
    jp7_values = jp7.backend.sample(jp7.uuid).values
    jp6_values = jp6.backend.sample(jp6.uuid).values
    assert set(jp7_values) == set(jp6_values)
    assert {"utilization_gpu", "gpu_freq", "gpu_max_freq", "power_mode", "power_rails"} <= set(jp7_values)
    assert jp7.nvml_sim.calls["nvmlDeviceGetUtilizationRates"] >= 1  # NVML was asked, and answered NotSupported
    load = int((jp7.root / "sys/devices/platform/17000000.gpu/load").read_text())
    assert jp7.backend.sample(jp7.uuid, ["utilization_gpu"]).values == {"utilization_gpu": round(load / 10)}
    sources = jp7.backend.property_sources(jp7.uuid)
    assert not [n for n, s in sources.items() if s.source == "nvml"]
    assert sources["memory_used"].source == "" and "NotSupported" in sources["memory_used"].why
    assert sources["processes"].source == "" and sources["health"].source == ""
    assert jp7.backend.nvml_serving("processes") is None and jp7.backend.nvml_serving("health") is None
    assert not jp7.nvml_sim.initialized  # serving nothing, NVML was shut down again
    assert jp7.backend.list_gpus()[0].pci_bus_id == ""


def test_on_a_thor_nvml_serves_load_memory_and_processes_and_sysfs_and_nvpmodel_the_rest(boards) -> None:
    thor = boards("thor")
    nvml_sim = thor.nvml_sim
    assert nvml_sim is not None
    (gpu,) = thor.backend.list_gpus()
    nvml_uuid = nvml_sim.gpus[0].uuid
    assert gpu.uuid == thor.uuid != nvml_uuid  # the board's identity, whichever source serves what
    assert gpu.pci_bus_id == nvml_sim.gpus[0].pci.busId and gpu.architecture == "blackwell"
    nvml_sim.set_utilization(None, 37)
    thor.clock.advance(1.0)  # NVML's utilisation is over its sample period: the next one has the new load
    values = thor.backend.sample(thor.uuid).values
    assert values["utilization_gpu"] == 37
    handle = nvml_sim.nvmlDeviceGetHandleByUUID(nvml_uuid)
    nvml_sim.nvmlInit()
    memory = nvml_sim.nvmlDeviceGetMemoryInfo(handle, version=nvml_sim.nvmlMemory_v2)
    assert values["memory_used"] == memory.used and values["memory_total"] == memory.total
    assert values["gpu_max_freq"] == 1377.0 and values["power_mode_name"] == "120W"
    assert values["gpu_governor"] == "nvhost_podgov" and str(values["power_rails"]).endswith(
        ",VIN:" + str(values["power_usage"]).removesuffix(".0")
    )
    sources = thor.backend.property_sources(thor.uuid)
    nvml = sorted(n for n, s in sources.items() if s.source == "nvml")
    assert nvml == ["health", "health_probe", "memory_total", "memory_used", "processes", "utilization_gpu"]
    assert sources["utilization_gpu"].why == "no load file for this GPU in sysfs"
    assert sources["gpu_freq"].source == "sysfs" and sources["power_mode"].source == "nvpmodel"
    assert sources["temperature"].source == "sysfs"  # the GPU's thermal zone first
    for name, value in values.items():
        assert TWIN_VALUE_RE.fullmatch(format_value(PROPERTY_BY_NAME[name], value)), name
    assert set(values) == {p.name for p in family_properties("jetson") if p.source != "mapper"}


def test_a_thors_load_follows_the_board_through_nvml(boards) -> None:
    thor = boards("thor", scenario="idle")
    thor.clock.advance(5)
    thor.sim.step()
    thor.clock.advance(0.5)  # (NVML's utilisation is over its sample period, after the board's step)
    idle = thor.backend.sample(thor.uuid, ["utilization_gpu", "gpu_freq"]).values
    thor.sim.scenario = "training"
    thor.clock.advance(5)
    thor.sim.step()
    thor.clock.advance(0.5)
    busy = thor.backend.sample(thor.uuid, ["utilization_gpu", "gpu_freq"]).values
    assert idle["utilization_gpu"] <= 5 and busy["utilization_gpu"] >= 90
    assert busy["gpu_freq"] > idle["gpu_freq"]


def test_a_thors_processes_come_from_nvml_under_the_board_identity_with_the_gpu_rails_energy(boards) -> None:
    thor = boards("thor", scenario="steady")
    thor.clock.advance(1.0)  # the trainer has allocated its memory
    first = thor.backend.processes(thor.uuid)
    assert first.uuid == thor.uuid
    assert [p.pid for p in first.processes] == [scenario_pid(0, 0)]  # steady: one trainer
    assert first.processes[0].memory_used_bytes and first.processes[0].memory_used_bytes > 0
    assert "energy" not in first.unsupported and "power" not in first.unsupported
    hwmon = thor.root / "sys/bus/i2c/devices/1-0040/hwmon/hwmon1"
    assert first.power_w == pytest.approx(hwmon_watts(hwmon, 1), abs=1e-3)  # VDD_GPU: NVML has no power here
    thor.clock.advance(10.0)  # the rails' files stay the same: 10 s at that power
    second = thor.backend.processes(thor.uuid)
    assert second.energy_j is not None and first.energy_j is not None
    assert second.energy_j - first.energy_j == pytest.approx(10.0 * hwmon_watts(hwmon, 1), abs=0.01)


def test_a_thors_level2_checks_and_probe_address_the_gpu_by_nvmls_identity_and_a_reset_is_refused(
    boards, tmp_path: Path
) -> None:
    thor = boards("thor")
    assert thor.nvml_sim is not None
    checks = thor.backend.driver_checks(thor.uuid, 2.0)
    assert [c.name for c in checks] == ["nvml-responsive", "inforom"]
    assert checks[0].status == "healthy" and ("driver_version", "595.78") in checks[0].detail
    tools = board_health_tools(sim_health_tools(thor.nvml_sim, tmp_path / "host"), thor.backend)
    (gpu,) = thor.backend.list_gpus()
    assert tools.probe.probe(thor.uuid, gpu.pci_bus_id, 5.0).outcome == "pass"
    assert [r.passed for r in tools.tools.self_check(thor.uuid, 5.0)] == [True]
    with pytest.raises(PermanentError, match="not reset apart from its board"):
        tools.tools.reset(thor.uuid, 5.0)
    orin = boards("orin-agx-jp7")
    with pytest.raises(UnsupportedError, match="NVML does not manage this GPU"):
        orin.backend.driver_checks(orin.uuid, 2.0)
    with pytest.raises(UnsupportedError, match="process lists"):
        orin.backend.processes(orin.uuid)


def test_a_lost_nvml_leaves_the_sysfs_values_and_errors_only_what_nvml_serves(boards) -> None:
    thor = boards("thor")
    assert thor.nvml_sim is not None
    assert "utilization_gpu" in thor.backend.sample(thor.uuid, ["utilization_gpu"]).values
    thor.nvml_sim.inject_gpu_lost(thor.nvml_sim.gpus[0].uuid)
    sample = thor.backend.sample(thor.uuid, ["utilization_gpu", "memory_used", "gpu_freq", "power_usage"])
    assert set(sample.values) == {"gpu_freq", "power_usage"}
    assert set(sample.errors) == {"utilization_gpu", "memory_used"}
    assert all(e.startswith("nvml: ") and "lost" in e.lower() for e in sample.errors.values())


def test_a_desired_range_and_power_mode_on_a_thor_go_through_devfreq_and_nvpmodel(boards) -> None:
    thor = boards("thor")
    assert thor.backend.set_gpu_freq_range(thor.uuid, 459, 918) == (459.0, 918.0)
    assert (thor.root / "sys/class/devfreq/gpu-gpc-0/max_freq").read_text().strip() == "918000000"
    thor.backend.set_power_mode(thor.uuid, 3)
    values = thor.backend.sample(thor.uuid, ["power_mode", "power_mode_name", "gpu_max_freq"]).values
    assert values == {"power_mode": 3, "power_mode_name": "70W", "gpu_max_freq": 918.0}
    assert thor.backend.constraints(thor.uuid).power_modes == ((0, "MAXN"), (1, "120W"), (2, "90W"), (3, "70W"))


def test_auto_serves_a_thor_tree_as_a_jetson(tmp_path: Path) -> None:
    build_tree(tmp_path, "thor")
    assert wants_jetson(Settings(node_name="n1", data_dir=str(tmp_path), jetson_root=str(tmp_path)))


# --- discover over every profile ----------------------------------------------------------------------------


def discovered(tmp_path: Path, profile: str, layer: Layer) -> tuple[str, dict[str, Any]]:
    """``gpu-mapper discover --sim 1 --sim-profile <profile>`` in-process (the simulated NVML behind the stand-in)."""
    settings = Settings(node_name="jetson-1", data_dir=str(tmp_path / profile), sim=1, sim_profile=profile)
    backend = build_jetson_backend(settings, one_shot=True, nvml_layer=layer)
    try:
        assert isinstance(backend, TegraBackend)
        gpus = backend.list_gpus()
        sources = {g.uuid: backend.property_sources(g.uuid) for g in gpus}
        text = device_yaml(gpus, "jetson-1", unsupported=probe_all(backend, gpus, sources), sources=sources)
    finally:
        backend.shutdown()
    (doc,) = [d for d in yaml.safe_load_all(text) if d]
    return text, doc


@needs_crds
@pytest.mark.parametrize("profile", [*sorted(PROFILES), "orin-agx-jp7", "thor"])
def test_discover_gives_a_valid_device_for_every_profile(tmp_path: Path, layer: Layer, profile: str) -> None:
    text, doc = discovered(tmp_path, profile, layer)
    assert_valid_kubeedge(doc, f"discover {profile}")
    assert doc["spec"]["deviceModelRef"]["name"] == "nvidia-jetson"
    assert "# jetson-1-gpu0 (" in text and "where its properties come from" in text


def test_discover_on_jetpack7_orin_lists_what_jetpack6_orin_lists_and_on_a_thor_what_nvml_serves(
    tmp_path: Path, layer: Layer
) -> None:
    _, jp6 = discovered(tmp_path, "orin-agx", layer)
    jp7_text, jp7 = discovered(tmp_path, "orin-agx-jp7", layer)
    thor_text, thor = discovered(tmp_path, "thor", layer)
    names = {key: [p["name"] for p in doc["spec"]["properties"]] for key, doc in (("6", jp6), ("7", jp7), ("t", thor))}
    assert names["7"] == names["6"]
    assert "memory_used" not in names["7"] and "processes" not in names["7"]
    assert "#   memory_used: NVML answers NotSupported (nvmlDeviceGetMemoryInfo)" in jp7_text
    assert set(names["t"]) - set(names["6"]) == {
        "memory_used",
        "memory_total",
        "processes",
        "health",
        "health_probe",
    }
    assert "#   nvml: utilization_gpu (no load file for this GPU in sysfs), memory_used, memory_total," in thor_text
    assert "left out" not in thor_text  # a Thor serves every property of the model
    assert thor["spec"]["protocol"]["configData"]["pciBusId"]


def test_the_sim_backend_choice_refuses_nvml_for_a_jetpack7_board(tmp_path: Path) -> None:
    base = Settings(node_name="n1", data_dir=str(tmp_path), sim=1, sim_profile="thor")
    assert wants_jetson(base)
    with pytest.raises(Exception, match="is a Jetson profile, but backend is nvml"):
        wants_jetson(replace(base, backend="nvml"))
