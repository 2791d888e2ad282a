"""The simulated Jetson: a fake sysfs tree with a board's documented layout, a physics model that keeps its files
moving, and a fake ``nvpmodel`` command, so the real ``JetsonBackend`` runs over files in tests, CI, the demo and
the benchmarks.

``build_tree(root, profile)`` writes the layout of one board under ``root`` (docs/jetson.md lists what each
profile has): ``xavier-agx`` (JetPack 5: gv11b, load in ``sys/devices/gpu.0/load``, hwmon INA3221 channels GPU,
CPU, SOC / CV, VDDRQ, SYS5V, no VDD_IN, the PMIC-Die zone's constant 100 C), ``orin-agx`` (JetPack 6: the GPU as
``platform/17000000.gpu``, VDD_GPU_SOC, VDD_CPU_CV, VIN_SYS_5V0, NC channels), ``orin-nano`` (JetPack 6, VDD_IN,
VDD_CPU_GPU_CV, VDD_SOC, offline CV zones at -256000, no debugfs EMC, a 7 W mode that needs a reboot). The
JetPack 7 boards (``JETPACK7_PROFILES``) ship an NVML, which the composition root simulates beside the tree
(``JetsonProfile.nvml_profile``, a key of the simulated NVML's profiles): ``orin-agx-jp7`` (JetPack 7.2 on an AGX
Orin: the JetPack 6 layout, a devfreq governor list instead of ``enable_3d_scaling``; its NVML answers
NotSupported for every reading) and ``thor`` (a Jetson AGX Thor: the GPU as the GPC domain ``gpu-gpc-0`` beside
the video decoder's ``gpu-nvd-0``, no ``of_node`` name, no load file, INA3221 rails VDD_GPU, VDD_CPU_SOC_MSS,
VIN_SYS_5V0 and the carrier's INA238 VIN, the EMC clock in devfreq ``bwmgr``; its NVML serves load, memory and
processes). ``on_load`` hands each step's GPU load to that NVML.

``SimJetson`` owns such a tree: ``step(now_s)`` advances the physics (a workload scenario drives the load; the
governor picks a frequency inside the devfreq range the files say, so a lowered ``max_freq`` lowers the clock,
the GPU rail's power and, first order, the temperatures); ``start`` runs it on a thread. As on a board, only
root may write ``min_freq`` / ``max_freq`` (``as_root=False`` makes them 0444) and run nvpmodel.

``python -m mapper.edge.gpu.simjetson nvpmodel --root ROOT [-q | -m ID]`` is the fake nvpmodel: ``-m`` writes the
status file and the mode's GPU range into devfreq; a mode that needs a reboot prints nvpmodel's prompt and is
applied only when answered ``YES`` (the simulated node "reboots": the mode is in force, ``reboot-requested`` is
written next to the status file).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

#: The simulator's profiles, by ``--sim-profile`` name.
PROFILE_NAMES = ("orin-agx", "xavier-agx", "orin-nano", "orin-agx-jp7", "thor")
SCENARIOS = ("idle", "steady", "inference", "training", "heat", "oscillating")
OFFLINE_MILLI_C = -256000


@dataclass(frozen=True)
class Mode:
    id: int
    name: str
    #: GPU max frequency of the mode (Hz); 0 = the hardware maximum.
    gpu_max_hz: int = 0
    needs_reboot: bool = False


@dataclass(frozen=True)
class ZoneSpec:
    type: str
    #: Offset from the GPU temperature (C); None: a zone that reads a constant (``fixed_milli_c``).
    offset_c: float | None = 0.0
    fixed_milli_c: int = 0
    trips: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class JetsonProfile:
    name: str
    jetpack: int
    model: str
    serial: str
    release: str
    #: The GPU device's ``of_node/name``; None: the device has none (a Thor).
    of_name: str | None
    devfreq_name: str
    #: The GPU device's directory under ``sys/devices`` (the devfreq ``device`` link points there).
    device_dir: str
    #: Where ``load`` is, relative to the root; None: there is no load file (a Thor).
    load_path: str | None
    freqs_hz: tuple[int, ...]
    emc_hz: int | None
    zones: tuple[ZoneSpec, ...]
    #: INA3221 devices: (i2c device name, channel labels in1..in3); channel 7 is "sum of shunt voltages".
    ina: tuple[tuple[str, tuple[str, ...]], ...]
    #: Which rail feeds the GPU, which the CPU, and the module input (None where the board has no such rail).
    gpu_rail: str
    cpu_rail: str
    input_rail: str | None
    modes: tuple[Mode, ...]
    default_mode: int
    mem_total_kb: int
    #: Physics: GPU rail at full load and the hardware maximum (W); the rest of the module at idle (W).
    gpu_max_w: float
    base_w: float
    ambient_c: float = 30.0
    #: Kelvin per watt of module power, and the thermal time constant (s).
    thermal_k_per_w: float = 1.6
    tau_s: float = 40.0
    #: JetPack 7: the devfreq governors the GPU offers (``available_governors``), the first in force; () writes no
    #: such file (JetPack 5 and 6 trees have ``governor`` only).
    governors: tuple[str, ...] = ()
    #: Other devfreq devices that are not the GPU (a Thor's video decoder ``gpu-nvd-0``, the EMC's ``bwmgr``).
    other_devfreq: tuple[str, ...] = ()
    #: Where the EMC clock is (Hz): debugfs (JetPack 5 and 6, root only) or, on a Thor, devfreq ``bwmgr``.
    emc_devfreq: bool = False
    #: INA238 monitors: (i2c device name, the rail they measure); no ``label`` file is written.
    ina238: tuple[tuple[str, str], ...] = ()
    #: The simulated NVML's profile key beside this board (None: no NVML, JetPack 5 and 6) and its driver version.
    nvml_profile: str | None = None
    nvml_driver: str = ""


def _orin_trips() -> tuple[tuple[str, int], ...]:
    return (("passive", 99000), ("critical", 104500))


_ORIN_AGX = JetsonProfile(
    name="orin-agx",
    jetpack=6,
    model="NVIDIA Jetson AGX Orin Developer Kit",
    serial="1421122012345",
    release="# R36 (release), REVISION: 3.0, GCID: 36923193, BOARD: generic, EABI: aarch64, DATE: Fri Jul 19 2024",
    of_name="gpu",
    devfreq_name="17000000.gpu",
    device_dir="platform/17000000.gpu",
    load_path="sys/devices/platform/17000000.gpu/load",
    freqs_hz=(
        306000000,
        408000000,
        510000000,
        612000000,
        714000000,
        816000000,
        918000000,
        1020000000,
        1122000000,
        1224000000,
        1300500000,
    ),
    emc_hz=3199000000,
    zones=(
        ZoneSpec("cpu-thermal", -2.0, trips=_orin_trips()),
        ZoneSpec("gpu-thermal", 0.0, trips=_orin_trips()),
        ZoneSpec("cv0-thermal", -4.0),
        ZoneSpec("cv1-thermal", -4.5),
        ZoneSpec("cv2-thermal", -4.0),
        ZoneSpec("soc0-thermal", -3.0),
        ZoneSpec("soc1-thermal", -3.5),
        ZoneSpec("soc2-thermal", -3.0),
        ZoneSpec("tj-thermal", 1.0, trips=_orin_trips()),
    ),
    ina=(
        ("1-0040", ("VDD_GPU_SOC", "VDD_CPU_CV", "VIN_SYS_5V0")),
        ("1-0041", ("NC", "VDDQ_VDD2_1V8AO", "NC")),
    ),
    gpu_rail="VDD_GPU_SOC",
    cpu_rail="VDD_CPU_CV",
    input_rail=None,
    modes=(
        Mode(0, "MAXN"),
        Mode(1, "MODE_15W", 408000000),
        Mode(2, "MODE_30W", 816000000),
        Mode(3, "MODE_50W", 1020000000),
    ),
    default_mode=2,
    mem_total_kb=64_335_244,
    gpu_max_w=30.0,
    base_w=7.0,
    thermal_k_per_w=1.3,
)

_XAVIER_AGX = JetsonProfile(
    name="xavier-agx",
    jetpack=5,
    model="Jetson-AGX",
    serial="1422019000777",
    release="# R35 (release), REVISION: 4.1, GCID: 33958178, BOARD: t186ref, EABI: aarch64, DATE: Tue Aug 1 2023",
    of_name="gv11b",
    devfreq_name="17000000.gv11b",
    device_dir="17000000.gv11b",
    load_path="sys/devices/gpu.0/load",
    freqs_hz=(
        114750000,
        216750000,
        318750000,
        420750000,
        522750000,
        624750000,
        675750000,
        828750000,
        905250000,
        1032750000,
        1198500000,
        1236750000,
        1338750000,
        1377000000,
    ),
    emc_hz=2133000000,
    zones=(
        ZoneSpec("AO-therm", -6.0),
        ZoneSpec("CPU-therm", -1.5, trips=(("passive", 96000), ("critical", 99500))),
        ZoneSpec("GPU-therm", 0.0, trips=(("passive", 96000), ("critical", 99500))),
        ZoneSpec("PLL-therm", -3.0),
        ZoneSpec("AUX-therm", -2.5),
        ZoneSpec("PMIC-Die", None, fixed_milli_c=100000),
        ZoneSpec("Tboard_tegra", -8.0),
        ZoneSpec("Tdiode_tegra", -1.0),
        ZoneSpec("thermal-fan-est", -2.0),
    ),
    ina=(
        ("1-0040", ("GPU", "CPU", "SOC")),
        ("1-0041", ("CV", "VDDRQ", "SYS5V")),
    ),
    gpu_rail="GPU",
    cpu_rail="CPU",
    input_rail=None,
    modes=(
        Mode(0, "MAXN"),
        Mode(1, "MODE_10W", 522750000),
        Mode(2, "MODE_15W", 675750000),
        Mode(3, "MODE_30W_ALL", 1377000000),
        Mode(4, "MODE_30W_6CORE", 1377000000),
        Mode(5, "MODE_30W_4CORE", 1377000000),
        Mode(6, "MODE_30W_2CORE", 1377000000),
        Mode(7, "MODE_15W_DESKTOP", 675750000),
    ),
    default_mode=2,
    mem_total_kb=31_919_696,
    gpu_max_w=20.0,
    base_w=6.0,
    thermal_k_per_w=1.8,
)

_ORIN_NANO = JetsonProfile(
    name="orin-nano",
    jetpack=6,
    model="NVIDIA Jetson Orin Nano Developer Kit",
    serial="1423723055501",
    release="# R36 (release), REVISION: 3.0, GCID: 36923193, BOARD: generic, EABI: aarch64, DATE: Fri Jul 19 2024",
    of_name="gpu",
    devfreq_name="17000000.gpu",
    device_dir="platform/17000000.gpu",
    load_path="sys/devices/platform/17000000.gpu/load",
    freqs_hz=(306000000, 408000000, 510000000, 612000000, 624750000),
    emc_hz=None,
    zones=(
        ZoneSpec("cpu-thermal", -2.0, trips=_orin_trips()),
        ZoneSpec("gpu-thermal", 0.0, trips=_orin_trips()),
        ZoneSpec("cv0-thermal", None, fixed_milli_c=OFFLINE_MILLI_C),
        ZoneSpec("cv1-thermal", None, fixed_milli_c=OFFLINE_MILLI_C),
        ZoneSpec("cv2-thermal", None, fixed_milli_c=OFFLINE_MILLI_C),
        ZoneSpec("soc0-thermal", -3.0),
        ZoneSpec("soc1-thermal", -3.5),
        ZoneSpec("soc2-thermal", -3.0),
        ZoneSpec("tj-thermal", 1.0, trips=_orin_trips()),
    ),
    ina=(("1-0040", ("VDD_IN", "VDD_CPU_GPU_CV", "VDD_SOC")),),
    gpu_rail="VDD_CPU_GPU_CV",
    cpu_rail="VDD_CPU_GPU_CV",
    input_rail="VDD_IN",
    modes=(Mode(0, "15W"), Mode(1, "7W", 408000000, needs_reboot=True)),
    default_mode=0,
    mem_total_kb=7_620_016,
    gpu_max_w=7.0,
    base_w=3.0,
    thermal_k_per_w=4.0,
)

#: JetPack 7.2 (L4T R39.2, kernel 6.8) on an AGX Orin: the nvgpu stack and JetPack 6's sysfs layout (the GPU as
#: ``17000000.gpu``); ``enable_3d_scaling`` is gone, the devfreq governor list replaces it. Its NVML initialises
#: and answers NotSupported (jetson-stats 7.x, shared/docs/nvml-facts.md section 9).
_ORIN_AGX_JP7 = replace(
    _ORIN_AGX,
    name="orin-agx-jp7",
    jetpack=7,
    serial="1421122012346",
    release="# R39 (release), REVISION: 2.0, GCID: 43300000, BOARD: generic, EABI: aarch64, DATE: Thu Jun 4 2026",
    governors=("nvhost_podgov", "performance", "userspace", "simple_ondemand"),
    nvml_profile="ORIN-JP7",
    nvml_driver="595.78",
)

#: A Jetson AGX Thor with JetPack 7.2: the GPU behind the nvidia.ko stack as a PCI device (0000:01:00.0) whose GPC
#: domain is devfreq ``gpu-gpc-0`` (no ``of_node`` name, no load file), the video decoder ``gpu-nvd-0`` beside it
#: (jetson-stats #885, #820). The frequencies, rails' powers, modes' GPU maxima, trip points and physics are
#: modelled, not measured.
_THOR = JetsonProfile(
    name="thor",
    jetpack=7,
    model="NVIDIA Jetson AGX Thor Developer Kit",
    serial="1425025000123",
    release="# R39 (release), REVISION: 2.0, GCID: 43300000, BOARD: generic, EABI: aarch64, DATE: Thu Jun 4 2026",
    of_name=None,
    devfreq_name="gpu-gpc-0",
    device_dir="pci0000:00/0000:00:00.0/0000:01:00.0",
    load_path=None,
    freqs_hz=(
        306000000,
        459000000,
        612000000,
        765000000,
        918000000,
        1071000000,
        1224000000,
        1377000000,
        1530000000,
        1575000000,
    ),
    emc_hz=4266000000,
    zones=(
        ZoneSpec("cpu-thermal", -2.0, trips=_orin_trips()),
        ZoneSpec("gpu-thermal", 0.0, trips=_orin_trips()),
        ZoneSpec("soc0-thermal", -3.0),
        ZoneSpec("soc1-thermal", -3.5),
        ZoneSpec("tj-thermal", 1.0, trips=_orin_trips()),
    ),
    ina=(("1-0040", ("VDD_GPU", "VDD_CPU_SOC_MSS", "VIN_SYS_5V0")),),
    gpu_rail="VDD_GPU",
    cpu_rail="VDD_CPU_SOC_MSS",
    input_rail="VIN",
    modes=(
        Mode(0, "MAXN"),
        Mode(1, "120W", 1377000000),
        Mode(2, "90W", 1071000000),
        Mode(3, "70W", 918000000),
    ),
    default_mode=1,
    mem_total_kb=131_652_608,
    gpu_max_w=60.0,
    base_w=20.0,
    thermal_k_per_w=0.55,
    governors=("nvhost_podgov", "performance", "userspace", "simple_ondemand"),
    other_devfreq=("gpu-nvd-0", "bwmgr"),
    emc_devfreq=True,
    ina238=(("2-0044", "VIN"),),
    nvml_profile="THOR",
    nvml_driver="595.78",
)

#: The JetPack 5 and 6 boards: the Jetson backend alone serves them (no NVML on those JetPacks).
PROFILES: dict[str, JetsonProfile] = {p.name: p for p in (_ORIN_AGX, _XAVIER_AGX, _ORIN_NANO)}
#: The JetPack 7 boards: a simulated NVML beside the tree (``nvml_profile``).
JETPACK7_PROFILES: dict[str, JetsonProfile] = {p.name: p for p in (_ORIN_AGX_JP7, _THOR)}
#: Every profile, by ``--sim-profile`` name.
ALL_PROFILES: dict[str, JetsonProfile] = {**PROFILES, **JETPACK7_PROFILES}


def profile(name: str) -> JetsonProfile:
    try:
        return ALL_PROFILES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown Jetson profile {name!r} (known: {', '.join(PROFILE_NAMES)})") from None


def is_jetson_profile(name: str) -> bool:
    return name.lower() in ALL_PROFILES


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    """Write a file whole, atomically (a reader never sees half a value)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _link(path: Path, target: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink() or path.exists():
        path.unlink()
    os.symlink(target, path)


def nvpmodel_conf(p: JetsonProfile) -> str:
    """An ``nvpmodel.conf`` in nvpmodel's syntax with the profile's modes (GPU range lines only)."""
    lines = [f"# nvpmodel.conf of the simulated {p.name} ({p.model})"]
    for m in p.modes:
        lines += [
            f"< POWER_MODEL ID={m.id} NAME={m.name} >",
            "GPU_POWER_CONTROL_ENABLE GPU_PWR_CNTL_EN on",
            "GPU MIN_FREQ 0",
            f"GPU MAX_FREQ {m.gpu_max_hz or -1}",
            "GPU_POWER_CONTROL_DISABLE GPU_PWR_CNTL_DIS auto",
        ]
        if m.needs_reboot:
            lines.append("# changing to or from this mode needs a reboot")
    lines.append(f"< PM_CONFIG DEFAULT={p.default_mode} >")
    return "\n".join(lines) + "\n"


def build_tree(root: str | os.PathLike[str], prof: JetsonProfile | str, *, as_root: bool = True) -> JetsonProfile:
    """Write a board's layout under ``root`` (created if needed) at rest: idle load, the default power mode."""
    p = profile(prof) if isinstance(prof, str) else prof
    r = Path(root)
    r.mkdir(parents=True, exist_ok=True)
    _write(r / "proc/device-tree/model", p.model + "\x00")
    _write(r / "proc/device-tree/serial-number", p.serial + "\x00")
    _write(r / "etc/nv_tegra_release", p.release + "\n")
    dev = r / "sys/devices" / p.device_dir
    dev.mkdir(parents=True, exist_ok=True)
    if p.of_name is not None:
        _write(dev / "of_node/name", p.of_name + "\x00")
    devfreq = r / "sys/class/devfreq" / p.devfreq_name
    devfreq.mkdir(parents=True, exist_ok=True)
    depth = "../../../devices/" + p.device_dir
    _link(devfreq / "device", depth)
    lo, hi = p.freqs_hz[0], p.freqs_hz[-1]
    _write(devfreq / "available_frequencies", " ".join(str(f) for f in p.freqs_hz) + "\n", 0o444)
    _write(devfreq / "cur_freq", f"{lo}\n", 0o444)
    _write(devfreq / "governor", (p.governors[0] if p.governors else "nvhost_podgov") + "\n")
    if p.governors:
        _write(devfreq / "available_governors", " ".join(p.governors) + "\n", 0o444)
    limits_mode = 0o644 if as_root else 0o444
    mode = next(m for m in p.modes if m.id == p.default_mode)
    _write(devfreq / "min_freq", f"{lo}\n", limits_mode)
    _write(devfreq / "max_freq", f"{mode.gpu_max_hz or hi}\n", limits_mode)
    for other in p.other_devfreq:  # not the GPU: a reader must not take them for it
        rate = p.emc_hz if other == "bwmgr" and p.emc_hz is not None else 115200000
        for name in ("cur_freq", "min_freq", "max_freq"):
            _write(r / "sys/class/devfreq" / other / name, f"{rate}\n", 0o444)
        _write(r / "sys/class/devfreq" / other / "governor", "performance\n")
    if p.load_path is not None:
        _write(r / p.load_path, "0\n", 0o444)
    if p.emc_hz is not None and not p.emc_devfreq:
        _write(r / "sys/kernel/debug/bpmp/debug/clk/emc/rate", f"{p.emc_hz}\n", 0o400)
    for i, z in enumerate(p.zones):
        zone = r / f"sys/devices/virtual/thermal/thermal_zone{i}"
        _write(zone / "type", z.type + "\n", 0o444)
        milli = z.fixed_milli_c if z.offset_c is None else round((p.ambient_c + z.offset_c) * 1000)
        _write(zone / "temp", f"{milli}\n", 0o444)
        for j, (kind, temp) in enumerate(z.trips):
            _write(zone / f"trip_point_{j}_type", kind + "\n", 0o444)
            _write(zone / f"trip_point_{j}_temp", f"{temp}\n", 0o644 if as_root else 0o444)
    for k, (name, labels) in enumerate(p.ina):
        i2c = r / "sys/bus/i2c/devices" / name
        _write(i2c / "name", "ina3221\n", 0o444)
        hwmon = i2c / f"hwmon/hwmon{k + 1}"
        for n, label in enumerate(labels, start=1):
            _write(hwmon / f"in{n}_label", label + "\n", 0o444)
            _write(hwmon / f"in{n}_input", "0\n", 0o444)
            _write(hwmon / f"curr{n}_input", "0\n", 0o444)
            _write(hwmon / f"curr{n}_crit", "32760\n", 0o644)
            _write(hwmon / f"curr{n}_max", "32760\n", 0o644)
        _write(hwmon / "in7_label", "sum of shunt voltages\n", 0o444)
        _write(hwmon / "in7_input", "0\n", 0o444)
    for k, (name, _label) in enumerate(p.ina238, start=len(p.ina)):
        i2c = r / "sys/bus/i2c/devices" / name
        _write(i2c / "name", "ina238\n", 0o444)
        hwmon = i2c / f"hwmon/hwmon{k + 1}"
        _write(hwmon / "name", "ina238\n", 0o444)
        for fname in ("in0_input", "in1_input", "curr1_input", "power1_input"):
            _write(hwmon / fname, "0\n", 0o444)
    _write(r / "etc/nvpmodel.conf", nvpmodel_conf(p))
    _write(r / "var/lib/nvpmodel/status", f"pmode:{p.default_mode:04d} fmode:quiet\n")
    _write(r / "proc/meminfo", _meminfo(p.mem_total_kb, p.mem_total_kb // 8))
    return p


def _meminfo(total_kb: int, used_kb: int) -> str:
    free = max(0, total_kb - used_kb)
    return f"MemTotal:       {total_kb} kB\nMemFree:        {free // 2} kB\nMemAvailable:   {free} kB\n"


def _utilization(scenario: str, t: float, rng: random.Random) -> float:
    if scenario == "idle":
        u = 0.02
    elif scenario == "steady":
        u = 0.6
    elif scenario == "inference":
        u = 0.45 + 0.3 * math.sin(t / 15.0)
    elif scenario in ("training", "heat"):
        u = 0.97
    elif scenario == "oscillating":
        u = 0.9 if int(t // 60) % 2 == 0 else 0.1
    else:
        raise ValueError(f"unknown scenario {scenario!r} (known: {', '.join(SCENARIOS)})")
    return min(1.0, max(0.0, u + rng.uniform(-0.03, 0.03)))


@dataclass
class SimJetson:
    """One simulated board over a tree built by ``build_tree`` (built here when ``build`` is true)."""

    root: Path
    prof: JetsonProfile
    scenario: str = "inference"
    seed: int = 0
    clock: Callable[[], float] = field(default=lambda: 0.0)
    temp_c: float = 0.0
    #: Called with each step's GPU load (0..1): the composition root hands it to the board's simulated NVML.
    on_load: Callable[[float], None] | None = None
    _last_s: float | None = None
    _thread: threading.Thread | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _rng: random.Random = field(default_factory=random.Random)

    @classmethod
    def create(
        cls,
        root: str | os.PathLike[str],
        prof: JetsonProfile | str,
        *,
        scenario: str = "inference",
        seed: int = 0,
        clock: Callable[[], float],
        as_root: bool = True,
    ) -> SimJetson:
        if scenario not in SCENARIOS:
            raise ValueError(f"unknown scenario {scenario!r} (known: {', '.join(SCENARIOS)})")
        p = build_tree(root, prof, as_root=as_root)
        sim = cls(Path(root), p, scenario=scenario, seed=seed, clock=clock, temp_c=p.ambient_c)
        sim._rng = random.Random(seed)
        sim.step()
        return sim

    @property
    def devfreq(self) -> Path:
        return self.root / "sys/class/devfreq" / self.prof.devfreq_name

    def _limit(self, name: str, default: int) -> int:
        try:
            return int((self.devfreq / name).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return default

    def step(self, now_s: float | None = None) -> None:
        """Advance the physics to ``now_s`` (the clock's time by default) and rewrite the moving files."""
        p = self.prof
        now = self.clock() if now_s is None else now_s
        dt = 0.0 if self._last_s is None else max(0.0, now - self._last_s)
        self._last_s = now
        u = _utilization(self.scenario, now, self._rng)
        hw_lo, hw_hi = p.freqs_hz[0], p.freqs_hz[-1]
        lo = self._limit("min_freq", hw_lo)
        hi = self._limit("max_freq", hw_hi)
        # The governor: load-proportional, snapped up to a step, kept inside [min_freq, max_freq]; "performance"
        # holds the maximum.
        want = hw_lo + u * (hw_hi - hw_lo)
        freq = next((f for f in p.freqs_hz if f >= want), hw_hi)
        allowed = [f for f in p.freqs_hz if lo <= f <= hi] or [min(max(lo, hw_lo), hw_hi)]
        freq = min(max(freq, allowed[0]), allowed[-1])
        if self._governor() == "performance":
            freq = allowed[-1]
        ratio = freq / hw_hi
        # At a capped clock the same work keeps the GPU busier (load rises as the clock drops).
        load = min(1.0, u * max(1.0, (want / freq) if freq else 1.0))
        gpu_w = 0.06 * p.gpu_max_w + p.gpu_max_w * load * ratio**2
        cpu_w = 0.4 * p.base_w + 1.5 * u
        total_w = p.base_w + gpu_w + 1.5 * u
        k = p.thermal_k_per_w * (1.4 if self.scenario == "heat" else 1.0)
        target = p.ambient_c + k * total_w
        self.temp_c += (target - self.temp_c) * min(1.0, dt / p.tau_s)
        _write(self.devfreq / "cur_freq", f"{freq}\n", 0o444)
        if p.load_path is not None:
            _write(self.root / p.load_path, f"{round(load * 1000)}\n", 0o444)
        for i, z in enumerate(p.zones):
            if z.offset_c is None:
                continue
            milli = round((self.temp_c + z.offset_c + self._rng.uniform(-0.2, 0.2)) * 1000)
            _write(self.root / f"sys/devices/virtual/thermal/thermal_zone{i}/temp", f"{milli}\n", 0o444)
        rails = {p.gpu_rail: gpu_w}
        rails[p.cpu_rail] = rails.get(p.cpu_rail, 0.0) + cpu_w
        if p.input_rail is not None:
            rails[p.input_rail] = total_w
        for k_dev, (name, labels) in enumerate(p.ina):
            hwmon = self.root / "sys/bus/i2c/devices" / name / f"hwmon/hwmon{k_dev + 1}"
            for n, label in enumerate(labels, start=1):
                if label == "NC":
                    continue
                watts = rails.get(label, 0.05 * p.base_w + 0.2 * u)
                mv = 19_000 if label == p.input_rail else 5_000
                ma = round(watts * 1e6 / mv)
                for fname, value in ((f"in{n}_input", mv), (f"curr{n}_input", ma)):
                    path = hwmon / fname
                    if path.exists():  # a test may have taken a rail's file away: it stays away
                        _write(path, f"{value}\n", 0o444)
        for k_dev, (name, label) in enumerate(p.ina238, start=len(p.ina)):
            hwmon = self.root / "sys/bus/i2c/devices" / name / f"hwmon/hwmon{k_dev + 1}"
            watts = rails.get(label, 0.0)
            mv = 20_000
            ma = round(watts * 1e6 / mv)
            values = {"in0_input": round(ma * 0.002), "in1_input": mv, "curr1_input": ma, "power1_input": mv * ma}
            for fname, value in values.items():
                path = hwmon / fname
                if path.exists():
                    _write(path, f"{value}\n", 0o444)
        used = round(p.mem_total_kb * (0.15 + 0.35 * u))
        _write(self.root / "proc/meminfo", _meminfo(p.mem_total_kb, used))
        if self.on_load is not None:
            self.on_load(load)

    def _governor(self) -> str:
        try:
            return (self.devfreq / "governor").read_text().strip()
        except OSError:
            return ""

    def start(self, interval_s: float = 0.5) -> None:
        """Run ``step`` every ``interval_s`` on a daemon thread until ``stop``."""
        if self._thread is not None:
            return
        self._stop.clear()

        def loop() -> None:
            while not self._stop.wait(interval_s):
                try:
                    self.step()
                except OSError:  # the tree was removed under a running simulator (a test's tmp dir): stop
                    return

        self._thread = threading.Thread(target=loop, name=f"simjetson-{self.prof.name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None


def nvpmodel_command(root: str | os.PathLike[str]) -> list[str]:
    """The argv of the fake nvpmodel for the tree at ``root``."""
    return [sys.executable, "-m", "mapper.edge.gpu.simjetson", "nvpmodel", "--root", str(root)]


def _nvpmodel_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="nvpmodel (simulated)")
    parser.add_argument("--root", required=True)
    parser.add_argument("-q", action="store_true", help="print the mode in force")
    parser.add_argument("-m", type=int, metavar="ID", help="switch to mode ID")
    args = parser.parse_args(argv)
    root = Path(args.root)
    conf = (root / "etc/nvpmodel.conf").read_text()
    modes: dict[int, tuple[str, int, bool]] = {}
    mode_id: int | None = None
    for line in conf.splitlines():
        line = line.strip()
        if line.startswith("< POWER_MODEL"):
            fields = dict(part.split("=", 1) for part in line.strip("<> ").split()[1:])
            mode_id = int(fields["ID"])
            modes[mode_id] = (fields["NAME"], -1, False)
        elif mode_id is not None and line.startswith("GPU MAX_FREQ"):
            name, _, reboot = modes[mode_id]
            modes[mode_id] = (name, int(line.split()[2]), reboot)
        elif mode_id is not None and "needs a reboot" in line:
            name, gpu_max, _ = modes[mode_id]
            modes[mode_id] = (name, gpu_max, True)
    status = root / "var/lib/nvpmodel/status"
    now = int(status.read_text().split("pmode:")[1].split()[0])
    if args.q or args.m is None:
        print(f"NV Power Mode: {modes[now][0]}\n{now}")
        return 0
    if os.geteuid() != 0:
        print("NVPM ERROR: nvpmodel must be run as root", file=sys.stderr)
        return 1
    if args.m not in modes:
        print(f"NVPM ERROR: Invalid power mode ID {args.m}", file=sys.stderr)
        return 1
    name, gpu_max, needs_reboot = modes[args.m]
    if needs_reboot or modes[now][2]:
        print(f"NVPM WARN: Reboot required for changing to this power mode: {args.m}")
        print("NVPM WARN: DO YOU WANT TO REBOOT NOW? enter YES/yes to confirm:")
        answer = sys.stdin.readline().strip()
        if answer not in ("YES", "yes"):
            print("NVPM WARN: user did not confirm the reboot: the power mode is unchanged")
            return 0
        _write(status.with_name("reboot-requested"), f"{args.m}\n")
    for devfreq in _gpu_devfreqs(root):
        freqs = sorted(int(f) for f in (devfreq / "available_frequencies").read_text().split())
        _write(devfreq / "min_freq", f"{freqs[0]}\n")  # whole files at once: a reader never sees half a value
        _write(devfreq / "max_freq", f"{gpu_max if gpu_max > 0 else freqs[-1]}\n")
    _write(status, f"pmode:{args.m:04d} fmode:quiet\n")
    print(f"NVPM: power mode {args.m} ({name}) applied")
    return 0


def _gpu_devfreqs(root: Path) -> list[Path]:
    """The GPU's devfreq devices the fake nvpmodel sets: a Thor's GPC domains, else the one with an ``of_node``
    name (the others, a video decoder or the EMC, keep theirs)."""
    entries = sorted((root / "sys/class/devfreq").iterdir())
    gpcs = [e for e in entries if e.name.startswith("gpu-gpc-")]
    return gpcs or [e for e in entries if (e / "device/of_node/name").exists()][:1] or entries[:1]


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] != "nvpmodel":
        print("usage: python -m mapper.edge.gpu.simjetson nvpmodel --root ROOT [-q | -m ID]", file=sys.stderr)
        return 2
    return _nvpmodel_main(args[1:])


if __name__ == "__main__":
    sys.exit(main())
