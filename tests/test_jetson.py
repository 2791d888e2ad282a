"""JetsonBackend over the documented sysfs layouts: Xavier (JetPack 5) and Orin (JetPack 6) trees built by the
simulated Jetson, and hand-made changes to them (a missing rail, an offline zone, a read-only max_freq, a failing
nvpmodel). The files are real files, the nvpmodel is a real subprocess."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from mapper.clock import FakeClock
from mapper.edge.gpu.jetson import JetsonBackend, board_uuid, parse_nvpmodel_conf, tegra_gpu_present
from mapper.edge.gpu.simjetson import PROFILES, SimJetson, build_tree, nvpmodel_command
from mapper.errors import InvalidValueError, NoPermissionError, NotFoundError, PermanentError, UnsupportedError
from mapper.shared.model import JETSON_PROPERTIES, TWIN_VALUE_RE, format_number, format_value


def board(tmp_path: Path, name: str, clock: FakeClock | None = None, **kwargs) -> tuple[SimJetson, JetsonBackend]:
    clock = clock or FakeClock()
    root = tmp_path / name
    sim = SimJetson.create(root, name, scenario="steady", clock=clock.monotonic, **kwargs)
    backend = JetsonBackend(root, nvpmodel=nvpmodel_command(root), clock=clock)
    return sim, backend


def one_uuid(backend: JetsonBackend) -> str:
    gpus = backend.list_gpus()
    assert len(gpus) == 1
    return gpus[0].uuid


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_each_board_is_one_gpu_of_the_jetson_family_named_by_a_stable_uuid_from_model_and_serial(tmp_path, name):
    _, backend = board(tmp_path, name)
    (gpu,) = backend.list_gpus()
    prof = PROFILES[name]
    assert gpu.family == "jetson" and gpu.index == 0 and gpu.name == prof.model
    assert gpu.uuid == board_uuid(prof.model, prof.serial) and gpu.uuid.startswith("GPU-")
    again = JetsonBackend(tmp_path / name)  # another process, another day: the same identity
    assert one_uuid(again) == gpu.uuid
    assert gpu.driver_version == ("R35.4.1" if prof.jetpack == 5 else "R36.3.0")


def test_two_boards_of_one_model_have_different_uuids() -> None:
    assert board_uuid("Jetson-AGX", "1422019000777") != board_uuid("Jetson-AGX", "1422019000778")


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_every_value_is_in_catalog_units_and_fits_a_twin(tmp_path, name):
    _, backend = board(tmp_path, name)
    sample = backend.sample(one_uuid(backend))
    assert sample.errors == {}
    absent = {p.name for p in JETSON_PROPERTIES} - set(sample.values)
    assert absent == ({"emc_freq"} if name == "orin-nano" else set())  # no debugfs EMC clock on that layout
    prof = PROFILES[name]
    assert sample.values["gpu_available_freqs"] == ",".join(format_number(f / 1e6) for f in prof.freqs_hz)
    assert prof.freqs_hz[0] / 1e6 <= sample.values["gpu_freq"] <= prof.freqs_hz[-1] / 1e6
    assert 0 <= sample.values["utilization_gpu"] <= 100
    assert 20 <= sample.values["temperature"] <= 110
    assert sample.values["shared_memory_used"] < sample.values["shared_memory_total"] == prof.mem_total_kb * 1024
    for spec in JETSON_PROPERTIES:
        if spec.name in sample.values:
            assert TWIN_VALUE_RE.fullmatch(format_value(spec, sample.values[spec.name])), spec.name


def test_xavier_jetpack5_reads_load_from_gpu0_its_gv11b_devfreq_and_sums_its_rails(tmp_path):
    _, backend = board(tmp_path, "xavier-agx")
    root = tmp_path / "xavier-agx"
    (root / "sys/devices/gpu.0/load").write_text("437\n")  # per mille
    values = backend.sample(one_uuid(backend)).values
    assert values["utilization_gpu"] == 44
    assert values["gpu_min_freq"] == 114.75 and values["gpu_max_freq"] == 675.75  # MODE_15W, the default
    hwmon = root / "sys/bus/i2c/devices/1-0040/hwmon/hwmon1"
    gpu_w = int((hwmon / "in1_input").read_text()) * int((hwmon / "curr1_input").read_text()) / 1e6
    assert values["power_gpu_rail"] == pytest.approx(gpu_w, abs=1e-3)
    rails = dict(part.split(":") for part in str(values["power_rails"]).split(","))
    assert list(rails) == ["GPU", "CPU", "SOC", "CV", "VDDRQ", "SYS5V"]  # "sum of shunt voltages" is no rail
    # AGX Xavier has no VDD_IN: the module's power is the sum of its rails (as jtop's total).
    assert values["power_usage"] == pytest.approx(sum(float(w) for w in rails.values()), abs=0.01)
    # PMIC-Die reads a constant 100 C on Xavier: Tj (no tj zone here) is the hottest CPU/GPU/SOC/CV/AUX zone.
    assert values["temperature_tj"] < 100
    assert values["temperature_slowdown"] == 96 and values["temperature_shutdown"] == 100  # 99.5 rounds to even


def test_orin_jetpack6_finds_the_gpu_by_its_of_node_name_and_skips_nc_channels(tmp_path):
    _, backend = board(tmp_path, "orin-agx")
    values = backend.sample(one_uuid(backend)).values
    rails = [part.split(":")[0] for part in str(values["power_rails"]).split(",")]
    assert rails == ["VDD_GPU_SOC", "VDD_CPU_CV", "VIN_SYS_5V0", "VDDQ_VDD2_1V8AO"]
    assert values["emc_freq"] == 3199.0
    assert values["power_mode"] == 2 and values["power_mode_name"] == "MODE_30W"
    assert values["gpu_max_freq"] == 816.0


def test_orin_nano_uses_vdd_in_as_module_power_and_ignores_its_offline_cv_zones(tmp_path):
    _, backend = board(tmp_path, "orin-nano")
    root = tmp_path / "orin-nano"
    values = backend.sample(one_uuid(backend)).values
    hwmon = root / "sys/bus/i2c/devices/1-0040/hwmon/hwmon1"
    vdd_in = int((hwmon / "in1_input").read_text()) * int((hwmon / "curr1_input").read_text()) / 1e6
    assert values["power_usage"] == pytest.approx(vdd_in, abs=1e-3)
    assert str(values["power_rails"]).startswith("VDD_IN:")
    tj = int((root / "sys/devices/virtual/thermal/thermal_zone8/temp").read_text())
    assert values["temperature_tj"] == round(tj / 1000)


def test_an_offline_gpu_zone_leaves_the_temperature_out_without_an_error(tmp_path):
    _, backend = board(tmp_path, "orin-agx")
    zone = tmp_path / "orin-agx/sys/devices/virtual/thermal/thermal_zone1"
    assert zone.joinpath("type").read_text().strip() == "gpu-thermal"
    zone.joinpath("temp").write_text("-256000\n")
    sample = backend.sample(one_uuid(backend), ["temperature", "temperature_cpu"])
    assert "temperature" not in sample.values and sample.errors == {}
    assert "temperature_cpu" in sample.values


def test_a_missing_rail_is_left_out_and_the_others_still_read(tmp_path):
    _, backend = board(tmp_path, "orin-agx")
    (tmp_path / "orin-agx/sys/bus/i2c/devices/1-0040/hwmon/hwmon1/curr1_input").unlink()  # VDD_GPU_SOC's current
    backend.init()
    sample = backend.sample(one_uuid(backend), ["power_gpu_rail", "power_rails", "power_usage"])
    assert sample.errors == {}
    assert "power_gpu_rail" not in sample.values
    assert not str(sample.values["power_rails"]).startswith("VDD_GPU_SOC")
    assert sample.values["power_usage"] > 0


def test_missing_files_are_not_supported_and_a_garbage_file_is_an_error_for_its_properties_only(tmp_path):
    _, backend = board(tmp_path, "xavier-agx")
    root = tmp_path / "xavier-agx"
    shutil.rmtree(root / "var/lib/nvpmodel")
    (root / "proc/meminfo").unlink()
    (root / "sys/devices/gpu.0/load").write_text("busy\n")
    sample = backend.sample(one_uuid(backend))
    for name in ("power_mode", "power_mode_name", "shared_memory_used", "shared_memory_total"):
        assert name not in sample.values and name not in sample.errors
    assert set(sample.errors) == {"utilization_gpu"} and "not a number" in sample.errors["utilization_gpu"]
    assert "temperature" in sample.values and "gpu_freq" in sample.values


def test_energy_is_integrated_from_the_rails_between_reads(tmp_path):
    clock = FakeClock()
    _, backend = board(tmp_path, "orin-nano", clock)
    uuid = one_uuid(backend)
    first = backend.sample(uuid, ["power_usage", "energy_consumption", "power_gpu_rail", "energy_gpu_rail"]).values
    assert first["energy_consumption"] == 0.0
    clock.advance(10.0)  # the files do not change (no sim step): the power stays the same
    second = backend.sample(uuid, ["power_usage", "energy_consumption", "power_gpu_rail", "energy_gpu_rail"]).values
    assert second["energy_consumption"] == pytest.approx(10.0 * first["power_usage"], abs=0.01)
    assert second["energy_gpu_rail"] == pytest.approx(10.0 * first["power_gpu_rail"], abs=0.01)


def test_a_jetpack4_iio_layout_reads_rail_power_in_milliwatts(tmp_path):
    build_tree(tmp_path, "xavier-agx")
    shutil.rmtree(tmp_path / "sys/bus/i2c/devices")
    iio = tmp_path / "sys/bus/i2c/devices/1-0040/iio:device0"
    iio.mkdir(parents=True)
    (iio.parent / "name").write_text("ina3221x\n")
    for n, (label, mw) in enumerate((("GPU", 4200), ("CPU", 1300), ("SOC", 900))):
        (iio / f"rail_name_{n}").write_text(label + "\n")
        (iio / f"in_power{n}_input").write_text(f"{mw}\n")
    backend = JetsonBackend(tmp_path)
    values = backend.sample(one_uuid(backend), ["power_gpu_rail", "power_usage"]).values
    assert values == {"power_gpu_rail": 4.2, "power_usage": 6.4}


def test_no_tegra_gpu_is_a_clear_not_found_error(tmp_path):
    assert not tegra_gpu_present(tmp_path)
    with pytest.raises(NotFoundError, match=r"no Tegra GPU under .*sys/class/devfreq"):
        JetsonBackend(tmp_path).init()
    build_tree(tmp_path / "b", "orin-agx")
    assert tegra_gpu_present(tmp_path / "b")


def test_unknown_property_names_are_refused_and_nvml_names_are_skipped(tmp_path):
    _, backend = board(tmp_path, "orin-agx")
    uuid = one_uuid(backend)
    with pytest.raises(InvalidValueError, match="unknown property 'bogus'"):
        backend.sample(uuid, ["bogus"])
    assert backend.sample(uuid, ["fan_speed", "power_limit"]).values == {}
    with pytest.raises(NotFoundError):
        backend.sample("GPU-00000000-0000-0000-0000-000000000000", ["temperature"])


# --- setting -------------------------------------------------------------------------------------


class RecordingBackend(JetsonBackend):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.writes: list[tuple[str, str]] = []

    def _write_sysfs(self, path: Path, text: str, uuid: str) -> None:
        self.writes.append((path.name, text))
        super()._write_sysfs(path, text, uuid)


def test_the_frequency_range_is_written_in_the_order_the_move_needs_and_read_back(tmp_path):
    build_tree(tmp_path, "orin-agx")  # 306..1300.5 MHz, MODE_30W: 306-816
    backend = RecordingBackend(tmp_path)
    uuid = one_uuid(backend)
    assert backend.set_gpu_freq_range(uuid, 918, 1224) == (918.0, 1224.0)  # up: max first
    assert backend.writes == [("max_freq", "1224000000"), ("min_freq", "918000000")]
    backend.writes.clear()
    assert backend.set_gpu_freq_range(uuid, 306, 510) == (306.0, 510.0)  # down: min first
    assert backend.writes == [("min_freq", "306000000"), ("max_freq", "510000000")]
    values = backend.sample(uuid, ["gpu_min_freq", "gpu_max_freq"]).values
    assert values == {"gpu_min_freq": 306.0, "gpu_max_freq": 510.0}


def test_a_frequency_the_gpu_does_not_offer_or_an_inverted_range_is_refused_before_any_write(tmp_path):
    build_tree(tmp_path, "xavier-agx")
    backend = RecordingBackend(tmp_path)
    uuid = one_uuid(backend)
    with pytest.raises(InvalidValueError, match="800 MHz is not one of") as exc:
        backend.set_gpu_freq_range(uuid, 114.75, 800)
    assert exc.value.reason == "not-supported-clock"
    with pytest.raises(InvalidValueError) as exc:
        backend.set_gpu_freq_range(uuid, 1377, 114.75)
    assert exc.value.reason == "out-of-range"
    assert backend.writes == []


def test_a_read_only_max_freq_not_root_is_no_permission(tmp_path):
    build_tree(tmp_path, "orin-agx", as_root=False)  # 0444, as sysfs is for everyone but root
    if os.geteuid() != 0:
        backend = JetsonBackend(tmp_path)
        with pytest.raises(NoPermissionError, match="need root"):
            backend.set_gpu_freq_range(one_uuid(backend), 306, 1300.5)
        return
    # Root ignores file modes: make the same call as nobody, in a forked child, for the kernel's own answer.
    backend = JetsonBackend(tmp_path)
    uuid = one_uuid(backend)

    def attempt() -> str:
        try:
            backend.set_gpu_freq_range(uuid, 306, 1300.5)
        except NoPermissionError as exc:
            return f"refused {exc.reason} {exc}"
        return "no error"

    got = as_nobody(tmp_path, attempt)
    assert got.startswith("refused no-permission") and "need root" in got, got
    assert (tmp_path / "sys/class/devfreq/17000000.gpu/max_freq").read_text().strip() == "816000000"


def as_nobody(tree: Path, fn: Callable[[], str]) -> str:
    """``fn()`` run as the user nobody in a forked child (for root, which file modes do not stop); its text, or
    the exception it raised."""
    for folder in (tree, *tree.parents):  # nobody must reach the tree (pytest's folders are 0700)
        if folder in (Path(tempfile.gettempdir()), Path("/")):
            break
        os.chmod(folder, os.stat(folder).st_mode | 0o005)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to nobody, run, report through the pipe, never return into pytest
        try:
            os.setgid(65534)
            os.setuid(65534)
            text = fn()
        except BaseException as exc:
            text = f"raised {exc!r}"
        os.write(write, text.encode()[:4000])
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        got = pipe.read()
    os.waitpid(pid, 0)
    return got


def test_power_modes_come_from_nvpmodel_conf_and_switch_through_nvpmodel(tmp_path):
    _, backend = board(tmp_path, "orin-agx")
    uuid = one_uuid(backend)
    assert backend.constraints(uuid).power_modes == ((0, "MAXN"), (1, "MODE_15W"), (2, "MODE_30W"), (3, "MODE_50W"))
    backend.set_power_mode(uuid, 3)
    values = backend.sample(uuid, ["power_mode", "power_mode_name", "gpu_max_freq"]).values
    assert values == {"power_mode": 3, "power_mode_name": "MODE_50W", "gpu_max_freq": 1020.0}
    with pytest.raises(InvalidValueError) as exc:
        backend.set_power_mode(uuid, 9)
    assert exc.value.reason == "unknown-value"


def test_a_mode_that_needs_a_reboot_is_refused_unless_allowed(tmp_path):
    _, backend = board(tmp_path, "orin-nano")
    uuid = one_uuid(backend)
    status = tmp_path / "orin-nano/var/lib/nvpmodel/status"
    with pytest.raises(PermanentError, match="needs a reboot") as exc:
        backend.set_power_mode(uuid, 1)
    assert exc.value.reason == "needs-reboot"
    assert status.read_text().startswith("pmode:0000")
    allowed = JetsonBackend(
        tmp_path / "orin-nano", nvpmodel=nvpmodel_command(tmp_path / "orin-nano"), allow_reboot=True
    )
    allowed.set_power_mode(uuid, 1)
    assert status.read_text().startswith("pmode:0001")
    assert (status.parent / "reboot-requested").read_text().strip() == "1"


def test_a_failing_or_missing_nvpmodel_is_a_clear_refusal(tmp_path):
    build_tree(tmp_path, "orin-agx")
    failing = JetsonBackend(tmp_path, nvpmodel=["sh", "-c", "echo 'NVPM ERROR: bad conf' >&2; exit 3", "nvpmodel"])
    uuid = one_uuid(failing)
    with pytest.raises(PermanentError, match="exited with 3: NVPM ERROR: bad conf") as exc:
        failing.set_power_mode(uuid, 0)
    assert exc.value.reason == "command-failed"
    missing = JetsonBackend(tmp_path, nvpmodel=[str(tmp_path / "no-such-nvpmodel")])
    with pytest.raises(UnsupportedError, match="not found"):
        missing.set_power_mode(uuid, 0)


def test_nvml_setters_are_not_supported_on_a_jetson(tmp_path):
    build_tree(tmp_path, "orin-agx")
    backend = JetsonBackend(tmp_path)
    uuid = one_uuid(backend)
    with pytest.raises(UnsupportedError):
        backend.set_power_limit(uuid, 30.0)
    cons = backend.constraints(uuid)
    assert {"power_limit", "locked_gpu_clocks"} <= cons.unsupported
    assert cons.gpu_freqs_mhz[0] == 306.0 and cons.gpu_freqs_mhz[-1] == 1300.5


def test_parse_nvpmodel_conf_reads_ids_names_and_the_default() -> None:
    text = (
        "< POWER_MODEL ID=0 NAME=MAXN >\nCPU_ONLINE CORE_0 1\n"
        "< POWER_MODEL ID=2 NAME=MODE_30W >\n< PM_CONFIG DEFAULT=2 >\n"
    )
    assert parse_nvpmodel_conf(text) == ({0: "MAXN", 2: "MODE_30W"}, 2)


# --- the simulated board's physics ------------------------------------------------------------------


def test_lowering_max_freq_lowers_the_clock_the_gpu_rail_power_and_in_time_the_temperature(tmp_path):
    clock = FakeClock()
    root = tmp_path / "x"
    sim = SimJetson.create(root, "xavier-agx", scenario="training", clock=clock.monotonic)
    backend = JetsonBackend(root, clock=clock)
    uuid = one_uuid(backend)
    backend.set_gpu_freq_range(uuid, 114.75, 1377)
    for _ in range(30):
        clock.advance(10)
        sim.step()
    hot = backend.sample(uuid, ["gpu_freq", "power_gpu_rail", "temperature"]).values
    backend.set_gpu_freq_range(uuid, 114.75, 522.75)
    for _ in range(30):
        clock.advance(10)
        sim.step()
    cool = backend.sample(uuid, ["gpu_freq", "power_gpu_rail", "temperature", "utilization_gpu"]).values
    assert hot["gpu_freq"] == 1377.0 and cool["gpu_freq"] == 522.75
    assert cool["power_gpu_rail"] < hot["power_gpu_rail"] / 2
    assert cool["temperature"] < hot["temperature"] - 5


def test_an_edited_nvpmodel_conf_is_read_again_and_the_trip_points_once_per_init(tmp_path):
    _, backend = board(tmp_path, "orin-agx")
    uuid = one_uuid(backend)
    conf = tmp_path / "orin-agx/etc/nvpmodel.conf"
    assert backend.sample(uuid, ["power_mode_name"]).values == {"power_mode_name": "MODE_30W"}
    conf.write_text(conf.read_text().replace("NAME=MODE_30W", "NAME=MODE_30W_CUSTOM"))
    assert backend.sample(uuid, ["power_mode_name"]).values == {"power_mode_name": "MODE_30W_CUSTOM"}
    trip = tmp_path / "orin-agx/sys/devices/virtual/thermal/thermal_zone1/trip_point_0_temp"
    assert backend.sample(uuid, ["temperature_slowdown"]).values == {"temperature_slowdown": 99}
    trip.write_text("95000\n")  # the board fixes them; a root edit shows after the next init
    assert backend.sample(uuid, ["temperature_slowdown"]).values == {"temperature_slowdown": 99}
    backend.shutdown()
    backend.init()
    assert backend.sample(uuid, ["temperature_slowdown"]).values == {"temperature_slowdown": 95}


def test_without_a_serial_number_the_machine_id_names_the_board_and_without_both_it_is_refused(tmp_path):
    build_tree(tmp_path, "orin-nano")
    (tmp_path / "proc/device-tree/serial-number").unlink()
    (tmp_path / "etc/machine-id").write_text("0123456789abcdef0123456789abcdef\n")
    uuid = one_uuid(JetsonBackend(tmp_path))
    assert uuid == board_uuid(PROFILES["orin-nano"].model, "0123456789abcdef0123456789abcdef")
    (tmp_path / "etc/machine-id").unlink()
    with pytest.raises(PermanentError, match="no serial number to build its identity from"):
        JetsonBackend(tmp_path).init()
