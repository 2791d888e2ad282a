"""JetsonBackend: the GpuBackend over a Jetson's sysfs, /proc and nvpmodel (what NVML does not serve on a Jetson; a
Thor's NVML serves the rest: ``mapper.edge.gpu.tegra``).

Everything is read from files under a filesystem root handed in (``/`` on a board, a directory in tests and in
the simulator, ``mapper.edge.gpu.simjetson``), and power modes are switched with an nvpmodel command handed in, so
nothing here knows whether the board is real. The layouts (NVIDIA L4T documentation, jetson-stats 7.x):

* The GPU: the devfreq device whose ``device/of_node/name`` is gv11b (Xavier), gp10b, ga10b (Orin), gb10b or
  gpu, under ``sys/class/devfreq/*``; on a Thor (JetPack 7), which has no ``of_node`` name, the GPC domain
  ``gpu-gpc-0`` (with ``gpu-gpc-1`` ... where there are several, set together; ``gpu-nvd-0`` is the video
  decoder, not the GPU). Its ``cur_freq``, ``min_freq``, ``max_freq`` and ``available_frequencies`` in Hz, and
  its ``governor`` (``nvhost_podgov`` scales with the load, ``performance`` holds the maximum; it replaces
  JetPack 7's removed ``enable_3d_scaling``). Load (per mille) in ``device/load``, else ``sys/devices/gpu.0/load``
  or ``sys/devices/platform/gpu.0/load`` (Xavier); a Thor has no load file (its NVML serves the load:
  ``mapper.edge.gpu.tegra``).
* Temperatures: ``sys/devices/virtual/thermal/thermal_zone*/{type,temp}`` in millidegrees; -256000 (or -256)
  is an offline zone, left out. GPU: a zone typed gpu-thermal / GPU-therm; CPU: cpu-thermal / CPU-therm; Tj:
  tj-thermal, else (Xavier) the hottest online CPU, GPU, SOC, CV or AUX zone. The GPU zone's lowest ``passive``
  or ``hot`` trip point is ``temperature_slowdown``, its lowest ``critical`` one ``temperature_shutdown``.
* Power: the INA3221 monitors (``sys/bus/i2c/devices/*/name`` = ``ina3221``): JetPack 5+ hwmon channels
  ``in<N>_label``, ``in<N>_input`` (mV), ``curr<N>_input`` (mA), power = V x I; JetPack 4 iio
  ``rail_name_<N>`` and ``in_power<N>_input`` (mW). A channel labelled "sum of shunt voltages" or with an NC
  token in its label is not a rail. The INA238 monitors (``name`` = ``ina238``; a Thor carrier board's input):
  one rail per hwmon device, named by its ``label`` file, else ``VIN``; ``power1_input`` (uW), else
  ``in1_input`` (bus mV) x ``curr1_input`` (mA). ``power_usage`` is the module or board input (VDD_IN, VIN) or,
  on boards without such a rail (AGX Xavier, AGX Orin), the sum of the monitored rails, as jtop's total;
  ``power_gpu_rail`` is the first rail with a GPU token in its label (VDD_GPU_SOC, VDD_CPU_GPU_CV, VDD_GPU, GPU).
  Both are integrated into energy counters (trapezoids between this backend's own reads, from zero at ``init``).
* Shared memory: ``proc/meminfo`` (MemTotal - MemAvailable). EMC: ``sys/kernel/debug/bpmp/debug/clk/emc/rate``
  (debugfs, root only), else ``sys/kernel/debug/clk/emc/clk_rate``, else (a Thor) devfreq ``bwmgr``'s
  ``cur_freq``.
* Power modes: ``etc/nvpmodel.conf`` (``< POWER_MODEL ID=2 NAME=MODE_30W >``), the one in force in
  ``var/lib/nvpmodel/status`` (``pmode:0002``), switched with ``<nvpmodel> -m <id>``.
* Identity: there is no GPU UUID. The board's ``proc/device-tree/model`` and ``serial-number`` (else
  ``etc/machine-id``) give a UUID-shaped ``GPU-<uuid5>``: stable across reboots, re-flashing and mapper versions,
  different for every board (``board_uuid``).

A file that is missing (or that this user may not read) makes its properties absent from the sample, as NVML's
NotSupported does; a file that reads garbage or fails otherwise is an error for those properties only.

Setters: ``set_gpu_freq_range`` writes ``max_freq`` and ``min_freq`` in the order the move needs (going up: max
first; else min first, so the range never inverts) and reads both back; ``set_power_mode`` runs nvpmodel and
reads the status back. A mode that needs a reboot (nvpmodel says so) is refused with reason ``needs-reboot``
unless ``allow_reboot``: then nvpmodel is told yes, the node reboots, and the mapper, started again, finds the
mode in force. The power-cap, locked-clock and mode setters of the NVML family raise ``UnsupportedError``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import subprocess
import threading
import uuid as uuidlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from mapper.clock import Clock, SystemClock
from mapper.errors import (
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
    JETSON_PROPERTIES,
    PROPERTY_BY_NAME,
    Constraints,
    GpuEvent,
    GpuInfo,
    Sample,
    Value,
    format_number,
)

#: ``device/of_node/name`` of a Tegra GPU's devfreq device (Pascal, Volta, Ampere, Blackwell; newer kernels "gpu").
GPU_OF_NAMES = ("gv11b", "gp10b", "ga10b", "gb10b", "gpu")
#: A Thor's GPU: its GPC domains' devfreq devices (no ``of_node`` name), ``gpu-gpc-0`` first.
GPC_DEVFREQ_RE = re.compile(r"gpu-gpc-(\d+)")
#: hwmon ``name`` of the INA238 family (one rail each; a Thor carrier board's input), and the label of one without
#: a ``label`` file (jetson-stats reads a Thor's INA238 as the VIN rail).
INA238_NAMES = ("ina238", "ina237")
INA238_DEFAULT_LABEL = "VIN"
#: Where the EMC clock is (Hz), first found: debugfs (root only), older debugfs, a Thor's devfreq ``bwmgr``.
EMC_RATE_FILES = (
    "sys/kernel/debug/bpmp/debug/clk/emc/rate",
    "sys/kernel/debug/clk/emc/clk_rate",
    "sys/class/devfreq/bwmgr/cur_freq",
)
#: Rails that are the whole module's or board's input: ``power_usage`` where present.
INPUT_RAILS = ("VDD_IN", "VIN")
#: Namespace of the board UUIDs (uuid5 over model and serial number); fixed forever: changing it renames GPUs.
BOARD_UUID_NAMESPACE = uuidlib.UUID("6b0f2c1e-9d4a-5c3e-8f1b-2a7d4e6c9b10")
#: Readings of an offline thermal zone.
OFFLINE_TEMPS = (-256000, -256)
#: Devfreq values are in Hz; two frequencies within this many Hz are the same step.
FREQ_TOLERANCE_HZ = 1000

_FAMILY_PROPS = frozenset(p.name for p in JETSON_PROPERTIES)
_POWER_MODEL_RE = re.compile(r"<\s*POWER_MODEL\s+ID\s*=\s*(\d+)\s+NAME\s*=\s*([^\s>]+)[^>]*>")
_PMODE_RE = re.compile(r"pmode\s*:\s*(\d+)")
_NC_TOKEN = re.compile(r"(^|[_\s])NC($|[_\s])")
_REBOOT_WORDS = re.compile(r"reboot", re.IGNORECASE)
_RELEASE_RE = re.compile(r"#\s*R(\d+)\s*\(release\),\s*REVISION:\s*([0-9.]+)")

_GROUP_PROPS: Mapping[str, frozenset[str]] = {
    "identity": frozenset({"uuid", "product_name"}),
    "load": frozenset({"utilization_gpu"}),
    "devfreq": frozenset({"gpu_freq", "gpu_min_freq", "gpu_max_freq"}),
    "available": frozenset({"gpu_available_freqs"}),
    "governor": frozenset({"gpu_governor"}),
    "emc": frozenset({"emc_freq"}),
    "thermal": frozenset({"temperature", "temperature_cpu", "temperature_tj"}),
    "trips": frozenset({"temperature_slowdown", "temperature_shutdown"}),
    "rails": frozenset({"power_usage", "energy_consumption", "power_gpu_rail", "energy_gpu_rail", "power_rails"}),
    "memory": frozenset({"shared_memory_used", "shared_memory_total"}),
    "power_mode": frozenset({"power_mode", "power_mode_name"}),
}


class JetsonRound(NamedTuple):
    """What ``JetsonBackend.sample_many`` read (the shape of ``mapper.edge.control.collect.RoundLike``)."""

    samples: list[Sample | MapperError]
    events: list[GpuEvent]
    events_error: MapperError | None = None


@dataclass(frozen=True)
class Rail:
    """One INA3221 channel that is a rail: its label and where its readings are."""

    label: str
    #: hwmon (JetPack 5+): voltage (mV) and current (mA) files; iio (JetPack 4): the power file (mW); INA238: its
    #: power file (uW).
    voltage: Path | None = None
    current: Path | None = None
    power: Path | None = None
    power_uw: Path | None = None
    #: A GPU token in the label (VDD_GPU_SOC, VDD_CPU_GPU_CV, GPU): the GPU's rail.
    gpu: bool = False


@dataclass(frozen=True)
class Zone:
    type: str
    path: Path
    #: ``path / "temp"``, made once.
    temp: Path


def board_uuid(model: str, serial: str) -> str:
    """The GPU identity of a Jetson: ``GPU-`` and the uuid5 of model and serial number (``BOARD_UUID_NAMESPACE``)."""
    return "GPU-" + str(uuidlib.uuid5(BOARD_UUID_NAMESPACE, f"{model.strip()}\n{serial.strip()}"))


def _read_text(path: Path) -> str | None:
    """A sysfs / device-tree file's text without NULs and surrounding blanks; None when it is missing or this user
    may not read it. Other errors (EIO from a driver) propagate."""
    try:
        fd = os.open(path, os.O_RDONLY)  # one open and one read: sysfs values are small (no buffered file object)
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return None
    try:
        data = os.read(fd, 65536)
    finally:
        os.close(fd)
    return data.replace(b"\x00", b"").decode("ascii", "replace").strip()


def _read_int(path: Path) -> int | None:
    text = _read_text(path)
    if text is None:
        return None
    try:
        return int(text.split()[0])
    except (ValueError, IndexError):
        raise ValueError(f"{path}: {text[:40]!r} is not a number") from None


def find_gpu_devfreq(root: Path) -> Path | None:
    """The devfreq directory of the Tegra GPU under ``root`` (``sys/class/devfreq/<dev>``), or None: the device
    whose ``of_node`` name is a GPU's, else one whose name ends with it, else a Thor's first GPC domain."""
    base = root / "sys/class/devfreq"
    try:
        entries = sorted(base.iterdir())
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return None
    for entry in entries:
        name = _read_text(entry / "device/of_node/name")
        if name is not None and name in GPU_OF_NAMES:
            return entry
    for entry in entries:  # no of_node link: the device's name ends with the GPU's (17000000.gv11b)
        if entry.name.rsplit(".", 1)[-1] in GPU_OF_NAMES:
            return entry
    gpcs = gpc_domains(entries)
    return gpcs[0] if gpcs else None


def gpc_domains(entries: Iterable[Path]) -> list[Path]:
    """The GPC domains among devfreq devices (a Thor's ``gpu-gpc-<N>``), by N."""
    found = [(int(m.group(1)), e) for e in entries if (m := GPC_DEVFREQ_RE.fullmatch(e.name))]
    return [e for _, e in sorted(found)]


def tegra_gpu_present(root: str | os.PathLike[str] = "/") -> bool:
    """True when ``root`` has a Tegra GPU's devfreq device: ``--backend auto`` then serves it as a Jetson."""
    return find_gpu_devfreq(Path(root)) is not None


def parse_nvpmodel_conf(text: str) -> tuple[dict[int, str], int | None]:
    """The power modes of an ``nvpmodel.conf`` by id, and its default mode (``< PM_CONFIG DEFAULT=N >``)."""
    modes = {int(m.group(1)): m.group(2) for m in _POWER_MODEL_RE.finditer(text)}
    default = re.search(r"<\s*PM_CONFIG\s+DEFAULT\s*=\s*(\d+)", text)
    return modes, int(default.group(1)) if default else None


def parse_gpu_ranges(text: str) -> dict[int, tuple[int, int]]:
    """Each power mode's ``GPU MIN_FREQ`` / ``GPU MAX_FREQ`` lines (Hz; 0 or -1 where the mode leaves that end to
    the hardware), by mode id."""
    ranges: dict[int, tuple[int, int]] = {}
    mode: int | None = None
    for line in text.splitlines():
        header = _POWER_MODEL_RE.search(line)
        if header:
            mode = int(header.group(1))
            ranges[mode] = (0, -1)
            continue
        parts = line.split()
        if mode is not None and len(parts) == 3 and parts[0] == "GPU" and parts[1] in ("MIN_FREQ", "MAX_FREQ"):
            try:
                hz = int(parts[2])
            except ValueError:
                continue
            lo, hi = ranges[mode]
            ranges[mode] = (hz, hi) if parts[1] == "MIN_FREQ" else (lo, hz)
    return ranges


def _mhz(hz: int | float) -> float:
    return round(float(hz) / 1e6, 6)


class JetsonBackend:
    """The ``mapper.shared.model.GpuBackend`` (and ``FrequencyActuator``) of one Jetson board.

    ``root``: the filesystem root the layout above is read under. ``nvpmodel``: the command (argv) that switches
    power modes; ``-m <id>`` is appended. ``allow_reboot``: a mode that needs a reboot may reboot the node.
    ``command_timeout_s`` bounds nvpmodel (below the GPU loop's 10 s bound on a backend call). Calls are serialised
    by a lock (they are blocking file reads).
    """

    def __init__(
        self,
        root: str | os.PathLike[str] = "/",
        *,
        nvpmodel: Sequence[str] = ("nvpmodel",),
        allow_reboot: bool = False,
        clock: Clock | None = None,
        command_timeout_s: float = 8.0,
    ) -> None:
        if not nvpmodel:
            raise ValueError("JetsonBackend: the nvpmodel command is empty")
        self.root = Path(root)
        self.nvpmodel = tuple(nvpmodel)
        self.allow_reboot = allow_reboot
        self.command_timeout_s = command_timeout_s
        self._clock: Clock = clock or SystemClock()
        self._lock = threading.RLock()
        self._ready = False
        self._uuid = ""
        self._model = ""
        self._serial = ""
        self._arch = ""
        self._release = ""
        self._devfreq: Path | None = None
        #: Every devfreq device the GPU's range is set on: the GPU's, or a Thor's GPC domains (the first is read).
        self._domains: tuple[Path, ...] = ()
        self._load: Path | None = None
        self._zones: list[Zone] = []
        self._rails: list[Rail] = []
        self._freqs_hz: tuple[int, ...] = ()
        #: Energy integration: the last (monotonic s, module W, GPU rail W) and the counters (J).
        self._last_power: tuple[float, float | None, float | None] | None = None
        self._energy_j = 0.0
        self._energy_gpu_j = 0.0
        #: Modes nvpmodel said need a reboot (refused without ``allow_reboot``).
        self._reboot_modes: set[int] = set()
        #: nvpmodel.conf's modes, kept while the file's (mtime, size) stays the same.
        self._modes_cache: tuple[tuple[int, int], dict[int, str]] | None = None
        #: The GPU zone's trip points (slowdown, shutdown; millidegrees), read once per ``init``.
        self._trips: tuple[int | None, int | None] | None = None

    # --- lifecycle -------------------------------------------------------------------------------
    def init(self) -> None:
        with self._lock:
            if self._ready:
                return
            devfreq = find_gpu_devfreq(self.root)
            if devfreq is None:
                raise NotFoundError(
                    f"no Tegra GPU under {self.root}: no devfreq device in {self.root / 'sys/class/devfreq'} whose "
                    f"of_node name is one of {', '.join(GPU_OF_NAMES)} and no GPC domain gpu-gpc-<N> "
                    "(is this a Jetson, and is /sys mounted?)"
                )
            self._devfreq = devfreq
            gpc = GPC_DEVFREQ_RE.fullmatch(devfreq.name) is not None
            self._domains = tuple(gpc_domains(devfreq.parent.iterdir())) if gpc else (devfreq,)
            # (a GPC domain names no architecture: a Thor's comes from its NVML, mapper.edge.gpu.tegra)
            self._arch = _read_text(devfreq / "device/of_node/name") or ("" if gpc else devfreq.name.rsplit(".", 1)[-1])
            model = _read_text(self.root / "proc/device-tree/model") or ""
            serial = _read_text(self.root / "proc/device-tree/serial-number") or ""
            if not serial:
                serial = _read_text(self.root / "etc/machine-id") or ""
            if not serial:  # the model alone would give every board of a kind the same UUID
                raise PermanentError(
                    f"Jetson GPU {devfreq.name}: no serial number to build its identity from: neither "
                    f"{self.root / 'proc/device-tree/serial-number'} nor {self.root / 'etc/machine-id'} can be read"
                )
            self._model = model or "Jetson"
            self._serial = serial
            self._uuid = board_uuid(self._model, serial)
            self._release = self._read_release()
            self._load = next(
                (
                    p
                    for p in (
                        devfreq / "device/load",
                        self.root / "sys/devices/gpu.0/load",
                        self.root / "sys/devices/platform/gpu.0/load",
                    )
                    if p.exists()
                ),
                None,
            )
            self._zones = self._find_zones()
            self._rails = self._find_rails()
            self._freqs_hz = self._read_freqs()
            self._trips = None
            self._modes_cache = None
            self._last_power = None
            self._ready = True

    def shutdown(self) -> None:
        with self._lock:
            self._ready = False

    def driver_version(self) -> str:
        """The L4T release (``R35.4.1`` from ``etc/nv_tegra_release``), or "" where the file is absent."""
        self._ensure()
        return self._release

    def list_gpus(self) -> list[GpuInfo]:
        self._ensure()
        return [
            GpuInfo(
                uuid=self._uuid,
                index=0,
                name=self._model,
                serial=self._serial,
                driver_version=self._release,
                architecture=self._arch,
                family="jetson",
            )
        ]

    # --- reading ---------------------------------------------------------------------------------
    def sample(self, uuid: str, properties: Iterable[str] | None = None) -> Sample:
        with self._lock:
            self._ensure()
            self._check(uuid)
            return self._sample(_wanted(properties))

    def sample_many(self, requests: Sequence[tuple[str, Iterable[str] | None]], events: bool = False) -> JetsonRound:
        """Every request's sample (or its error) in one call; a Jetson has no event queue (``events`` is []),"""
        out: list[Sample | MapperError] = []
        for uuid, names in requests:
            try:
                out.append(self.sample(uuid, names))
            except MapperError as exc:
                out.append(exc)
        return JetsonRound(out, [])

    def constraints(self, uuid: str) -> Constraints:
        """The devfreq steps and the power modes; every NVML-family setter is unsupported here."""
        with self._lock:
            self._ensure()
            self._check(uuid)
            modes = self._modes()
            text = _read_text(self.root / "etc/nvpmodel.conf") or ""
            default_mode = parse_nvpmodel_conf(text)[1] if text else None
            return Constraints(
                unsupported=frozenset(
                    {"power_limit", "locked_gpu_clocks", "locked_memory_clocks", "persistence_mode", "compute_mode"}
                ),
                gpu_freqs_mhz=tuple(_mhz(f) for f in self._freqs_hz),
                power_modes=tuple(sorted(modes.items())),
                gpu_freq_default_mhz=self._default_range(parse_gpu_ranges(text)),
                power_mode_default=default_mode if default_mode in modes else None,
            )

    def poll_events(self) -> list[GpuEvent]:
        return []

    # --- setting ---------------------------------------------------------------------------------
    def set_gpu_freq_range(self, uuid: str, min_mhz: float, max_mhz: float) -> tuple[float, float]:
        """Set devfreq ``min_freq`` / ``max_freq`` to two available frequencies (MHz), in the order the move
        needs, on every devfreq device of the GPU (a Thor's GPC domains, the first's frequencies); the range read
        back (MHz). ``InvalidValueError`` for a frequency the GPU does not offer or min above max,
        ``NoPermissionError`` when this user may not write them (not root)."""
        with self._lock:
            self._ensure()
            self._check(uuid)
            assert self._domains
            lo_hz, hi_hz = self._step_hz("gpu_min_freq", min_mhz), self._step_hz("gpu_max_freq", max_mhz)
            if lo_hz > hi_hz:
                raise InvalidValueError(
                    f"GPU {uuid}: gpu_min_freq {format_number(min_mhz)} MHz is above gpu_max_freq "
                    f"{format_number(max_mhz)} MHz",
                    reason="out-of-range",
                )
            for devfreq in self._domains:
                cur_max = self._read_required(devfreq / "max_freq", "gpu_max_freq")
                # Going up: max first; else min first: min <= max holds after each write.
                order = (
                    [("max_freq", hi_hz), ("min_freq", lo_hz)]
                    if hi_hz > cur_max
                    else [("min_freq", lo_hz), ("max_freq", hi_hz)]
                )
                for name, hz in order:
                    self._write_sysfs(devfreq / name, str(hz), uuid)
            got: list[tuple[int, int]] = []
            for devfreq in self._domains:
                got_lo = self._read_required(devfreq / "min_freq", "gpu_min_freq")
                got_hi = self._read_required(devfreq / "max_freq", "gpu_max_freq")
                if abs(got_lo - lo_hz) > FREQ_TOLERANCE_HZ or abs(got_hi - hi_hz) > FREQ_TOLERANCE_HZ:
                    raise ReadBackMismatchError(
                        f"GPU {uuid}: devfreq range set to {_mhz(lo_hz)}-{_mhz(hi_hz)} MHz reads "
                        f"{_mhz(got_lo)}-{_mhz(got_hi)} MHz" + (f" on {devfreq.name}" if len(self._domains) > 1 else "")
                    )
                got.append((got_lo, got_hi))
            return _mhz(got[0][0]), _mhz(got[0][1])

    def set_power_mode(self, uuid: str, mode_id: int) -> None:
        """``<nvpmodel> -m <mode_id>``, then the status file read back. Refusals: an id not in nvpmodel.conf
        (``unknown-value``), a mode that needs a reboot without ``allow_reboot`` (``needs-reboot``), nvpmodel
        missing (``not-supported``), failing (``command-failed``, or ``no-permission`` when not root)."""
        with self._lock:
            self._ensure()
            self._check(uuid)
            modes = self._modes()
            if not modes:
                raise UnsupportedError(f"GPU {uuid}: no power modes in {self.root / 'etc/nvpmodel.conf'}")
            if mode_id not in modes:
                raise InvalidValueError(
                    f"GPU {uuid}: power mode {mode_id} is not one of {sorted(modes)} (etc/nvpmodel.conf)",
                    reason="unknown-value",
                )
            if self._current_mode() == mode_id:
                return
            if mode_id in self._reboot_modes and not self.allow_reboot:
                raise PermanentError(
                    f"GPU {uuid}: power mode {mode_id} ({modes[mode_id]}) needs a reboot, which is not allowed "
                    "(jetson.allowReboot)",
                    reason="needs-reboot",
                )
            answer = "YES\n" if self.allow_reboot else "no\n"
            output = self._nvpmodel(uuid, ["-m", str(mode_id)], answer)
            now = self._current_mode()
            if now == mode_id:
                return
            if _REBOOT_WORDS.search(output):
                if self.allow_reboot:
                    raise TransientError(
                        f"GPU {uuid}: power mode {mode_id} ({modes[mode_id]}) takes effect after the reboot "
                        "nvpmodel started",
                        retry_after_s=60.0,
                        reason="rebooting",
                    )
                self._reboot_modes.add(mode_id)
                raise PermanentError(
                    f"GPU {uuid}: power mode {mode_id} ({modes[mode_id]}) needs a reboot, which is not allowed "
                    "(jetson.allowReboot)",
                    reason="needs-reboot",
                )
            raise ReadBackMismatchError(f"GPU {uuid}: nvpmodel -m {mode_id} succeeded but the status reads mode {now}")

    def set_power_limit(self, uuid: str, watts: float) -> float:
        raise UnsupportedError(f"GPU {uuid}: a Jetson has no power cap (use gpu_max_freq or power_mode)")

    def set_locked_gpu_clocks(self, uuid: str, min_mhz: int, max_mhz: int) -> None:
        raise UnsupportedError(f"GPU {uuid}: a Jetson has no locked clocks (use gpu_min_freq / gpu_max_freq)")

    def reset_locked_gpu_clocks(self, uuid: str) -> None:
        raise UnsupportedError(f"GPU {uuid}: a Jetson has no locked clocks")

    def set_locked_memory_clocks(self, uuid: str, min_mhz: int, max_mhz: int) -> None:
        raise UnsupportedError(f"GPU {uuid}: a Jetson has no locked memory clocks")

    def reset_locked_memory_clocks(self, uuid: str) -> None:
        raise UnsupportedError(f"GPU {uuid}: a Jetson has no locked memory clocks")

    def set_persistence_mode(self, uuid: str, enabled: bool) -> None:
        raise UnsupportedError(f"GPU {uuid}: a Jetson has no persistence mode")

    def set_compute_mode(self, uuid: str, mode: str) -> None:
        raise UnsupportedError(f"GPU {uuid}: a Jetson has no compute mode")

    # --- internals -------------------------------------------------------------------------------
    def _ensure(self) -> None:
        if not self._ready:
            self.init()

    def _check(self, uuid: str) -> None:
        if uuid != self._uuid:
            raise NotFoundError(f"GPU {uuid}: not this Jetson (its GPU is {self._uuid})")

    def _read_release(self) -> str:
        text = _read_text(self.root / "etc/nv_tegra_release")
        match = _RELEASE_RE.search(text or "")
        return f"R{match.group(1)}.{match.group(2)}" if match else ""

    def _find_zones(self) -> list[Zone]:
        base = self.root / "sys/devices/virtual/thermal"
        zones: list[Zone] = []
        with contextlib.suppress(FileNotFoundError, NotADirectoryError, PermissionError):
            for entry in sorted(base.glob("thermal_zone*"), key=lambda p: _zone_number(p.name)):
                zone_type = _read_text(entry / "type")
                if zone_type:
                    zones.append(Zone(zone_type, entry, entry / "temp"))
        return zones

    def _find_rails(self) -> list[Rail]:
        rails: list[Rail] = []
        base = self.root / "sys/bus/i2c/devices"
        with contextlib.suppress(FileNotFoundError, NotADirectoryError, PermissionError):
            for dev in sorted(base.iterdir()):
                if _read_text(dev / "name") not in ("ina3221", "ina3221x"):
                    continue
                for hwmon in sorted(dev.glob("hwmon/hwmon*")):
                    for label_file in sorted(hwmon.glob("in*_label"), key=lambda p: _channel(p.name)):
                        label = _read_text(label_file) or ""
                        n = _channel(label_file.name)
                        if _is_rail(label):
                            rails.append(
                                Rail(
                                    label,
                                    voltage=hwmon / f"in{n}_input",
                                    current=hwmon / f"curr{n}_input",
                                    gpu=_is_gpu_rail(label),
                                )
                            )
                for iio in sorted(dev.glob("iio:device*")):
                    for name_file in sorted(iio.glob("rail_name_*"), key=lambda p: _channel(p.name)):
                        label = _read_text(name_file) or ""
                        if _is_rail(label):
                            power = iio / f"in_power{_channel(name_file.name)}_input"
                            rails.append(Rail(label, power=power, gpu=_is_gpu_rail(label)))
        with contextlib.suppress(FileNotFoundError, NotADirectoryError, PermissionError):
            for dev in sorted(base.iterdir()):
                if _read_text(dev / "name") not in INA238_NAMES:
                    continue
                for hwmon in sorted(dev.glob("hwmon/hwmon*")):
                    label = _read_text(hwmon / "label") or INA238_DEFAULT_LABEL
                    if (hwmon / "power1_input").exists():
                        rails.append(Rail(label, power_uw=hwmon / "power1_input", gpu=_is_gpu_rail(label)))
                    else:
                        voltage, current = hwmon / "in1_input", hwmon / "curr1_input"  # in0 is the shunt's
                        rails.append(Rail(label, voltage=voltage, current=current, gpu=_is_gpu_rail(label)))
        return rails

    def _read_freqs(self) -> tuple[int, ...]:
        assert self._devfreq is not None
        text = _read_text(self._devfreq / "available_frequencies")
        if not text:
            return ()
        try:
            return tuple(sorted({int(t) for t in text.split()}))
        except ValueError:
            return ()

    def _modes(self) -> dict[int, str]:
        path = self.root / "etc/nvpmodel.conf"
        try:
            st = os.stat(path)
        except OSError:
            return {}
        key = (st.st_mtime_ns, st.st_size)
        if self._modes_cache is not None and self._modes_cache[0] == key:
            return self._modes_cache[1]
        text = _read_text(path)
        modes = parse_nvpmodel_conf(text)[0] if text else {}
        self._modes_cache = (key, modes)
        return modes

    def _default_range(self, ranges: Mapping[int, tuple[int, int]]) -> tuple[float, float] | None:
        """The devfreq range (MHz) the power mode in force sets: its GPU MIN/MAX_FREQ, the hardware's where it
        leaves an end open or there is no mode; None without available frequencies."""
        if not self._freqs_hz:
            return None
        lo_hz, hi_hz = self._freqs_hz[0], self._freqs_hz[-1]
        mode = self._current_mode()
        mode_lo, mode_hi = ranges.get(mode, (0, -1)) if mode is not None else (0, -1)
        if mode_lo > 0:
            lo_hz = min((f for f in self._freqs_hz if f >= mode_lo - FREQ_TOLERANCE_HZ), default=hi_hz)
        if mode_hi > 0:
            hi_hz = max((f for f in self._freqs_hz if f <= mode_hi + FREQ_TOLERANCE_HZ), default=lo_hz)
        return _mhz(lo_hz), _mhz(max(lo_hz, hi_hz))

    def _current_mode(self) -> int | None:
        text = _read_text(self.root / "var/lib/nvpmodel/status")
        match = _PMODE_RE.search(text or "")
        return int(match.group(1)) if match else None

    def _step_hz(self, prop: str, mhz: float) -> int:
        hz = round(float(mhz) * 1e6)
        for step in self._freqs_hz:
            if abs(step - hz) <= FREQ_TOLERANCE_HZ:
                return step
        if not self._freqs_hz:
            raise UnsupportedError(f"{prop}: the GPU's devfreq lists no available_frequencies")
        raise InvalidValueError(
            f"{prop}: {format_number(mhz)} MHz is not one of the GPU's frequencies "
            f"({', '.join(format_number(_mhz(f)) for f in self._freqs_hz)} MHz)",
            reason="not-supported-clock",
        )

    def _read_required(self, path: Path, prop: str) -> int:
        try:
            value = _read_int(path)
        except (OSError, ValueError) as exc:
            raise PermanentError(f"{prop}: reading {path} failed: {exc}", reason="read-failed") from None
        if value is None:
            raise UnsupportedError(f"{prop}: {path} is missing")
        return value

    def _write_sysfs(self, path: Path, text: str, uuid: str) -> None:
        """Write one sysfs value (the one place this backend writes a file)."""
        try:
            with open(path, "w", encoding="ascii") as f:
                f.write(text)
        except PermissionError:
            raise NoPermissionError(
                f"GPU {uuid}: writing {path} is not permitted (devfreq limits need root)", reason="no-permission"
            ) from None
        except FileNotFoundError:
            raise UnsupportedError(f"GPU {uuid}: {path} is missing") from None
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                raise InvalidValueError(f"GPU {uuid}: {path} refused {text}: {exc}", reason="out-of-range") from None
            raise TransientError(f"GPU {uuid}: writing {path} failed: {exc}", retry_after_s=5.0) from None

    def _nvpmodel(self, uuid: str, args: list[str], answer: str) -> str:
        argv = [*self.nvpmodel, *args]
        try:
            done = subprocess.run(
                argv,
                input=answer,
                capture_output=True,
                text=True,
                timeout=self.command_timeout_s,
                check=False,
            )
        except FileNotFoundError:
            raise UnsupportedError(f"GPU {uuid}: {argv[0]} not found: power modes cannot be switched") from None
        except PermissionError:
            raise NoPermissionError(f"GPU {uuid}: {argv[0]} may not be run by this user") from None
        except subprocess.TimeoutExpired:
            raise TransientError(
                f"GPU {uuid}: {' '.join(argv)} took longer than {self.command_timeout_s}s", retry_after_s=30.0
            ) from None
        output = (done.stdout or "") + (done.stderr or "")
        if done.returncode != 0:
            tail = " ".join(output.split())[-200:]
            if re.search(r"root|permission|not permitted", output, re.IGNORECASE):
                raise NoPermissionError(f"GPU {uuid}: {' '.join(argv)} failed (not root?): {tail}")
            raise PermanentError(
                f"GPU {uuid}: {' '.join(argv)} exited with {done.returncode}: {tail}", reason="command-failed"
            )
        return output

    def _sample(self, wanted: frozenset[str]) -> Sample:
        values: dict[str, Value] = {}
        errors: dict[str, str] = {}
        for group, props in _GROUP_PROPS.items():
            if wanted.isdisjoint(props):
                continue
            try:
                getattr(self, "_r_" + group)(values)
            except (OSError, ValueError) as exc:
                for prop in props & wanted:
                    errors[prop] = f"read-failed: {exc}"
        values = {k: v for k, v in values.items() if k in wanted}
        return Sample(uuid=self._uuid, ts_ms=self._clock.wall_ms(), values=values, errors=errors)

    def _r_identity(self, out: dict[str, Value]) -> None:
        out["uuid"] = self._uuid
        out["product_name"] = self._model

    def _r_load(self, out: dict[str, Value]) -> None:
        if self._load is None:
            return
        permille = _read_int(self._load)
        if permille is not None:
            out["utilization_gpu"] = max(0, min(100, round(permille / 10)))

    def _r_devfreq(self, out: dict[str, Value]) -> None:
        assert self._devfreq is not None
        for prop, name in (("gpu_freq", "cur_freq"), ("gpu_min_freq", "min_freq"), ("gpu_max_freq", "max_freq")):
            hz = _read_int(self._devfreq / name)
            if hz is not None:
                out[prop] = _mhz(hz)

    def _r_available(self, out: dict[str, Value]) -> None:
        if self._freqs_hz:
            out["gpu_available_freqs"] = ",".join(format_number(_mhz(f)) for f in self._freqs_hz)

    def _r_governor(self, out: dict[str, Value]) -> None:
        assert self._devfreq is not None
        governor = _read_text(self._devfreq / "governor")
        if governor:
            out["gpu_governor"] = governor

    def _r_emc(self, out: dict[str, Value]) -> None:
        for rel in EMC_RATE_FILES:
            hz = _read_int(self.root / rel)
            if hz is not None:
                out["emc_freq"] = _mhz(hz)
                return

    def _zone_temps(self) -> list[tuple[str, int]]:
        temps: list[tuple[str, int]] = []
        for zone in self._zones:
            milli = _read_int(zone.temp)
            if milli is None or milli in OFFLINE_TEMPS:
                continue
            temps.append((zone.type.lower(), milli))
        return temps

    def _r_thermal(self, out: dict[str, Value]) -> None:
        temps = self._zone_temps()
        for prop, prefix in (("temperature", "gpu"), ("temperature_cpu", "cpu"), ("temperature_tj", "tj")):
            milli = next((m for t, m in temps if t.startswith(prefix)), None)
            if milli is not None:
                out[prop] = round(milli / 1000)
        if "temperature_tj" not in out:
            soc = [m for t, m in temps if t.startswith(("cpu", "gpu", "soc", "cv", "aux"))]
            if soc:
                out["temperature_tj"] = round(max(soc) / 1000)

    def _r_trips(self, out: dict[str, Value]) -> None:
        if self._trips is None:
            self._trips = self._read_trips()
        slowdown, shutdown = self._trips
        if slowdown is not None:
            out["temperature_slowdown"] = round(slowdown / 1000)
        if shutdown is not None:
            out["temperature_shutdown"] = round(shutdown / 1000)

    def _read_trips(self) -> tuple[int | None, int | None]:
        """The GPU zone's lowest passive/hot and lowest critical trip point (millidegrees): the board fixes them,
        so they are read once per ``init``."""
        zone = next((z for z in self._zones if z.type.lower().startswith("gpu")), None)
        if zone is None:
            return None, None
        slowdown: list[int] = []
        shutdown: list[int] = []
        for type_file in zone.path.glob("trip_point_*_type"):
            kind = (_read_text(type_file) or "").lower()
            temp = _read_int(type_file.with_name(type_file.name.removesuffix("_type") + "_temp"))
            if temp is None:
                continue
            if kind in ("passive", "hot"):
                slowdown.append(temp)
            elif kind == "critical":
                shutdown.append(temp)
        return min(slowdown, default=None), min(shutdown, default=None)

    def _r_rails(self, out: dict[str, Value]) -> None:
        watts: list[tuple[str, float]] = []
        gpu: float | None = None
        for rail in self._rails:
            if rail.power_uw is not None:
                uw = _read_int(rail.power_uw)
                w = None if uw is None else uw / 1e6
            elif rail.power is not None:
                mw = _read_int(rail.power)
                w = None if mw is None else mw / 1000
            else:
                assert rail.voltage is not None and rail.current is not None
                mv, ma = _read_int(rail.voltage), _read_int(rail.current)
                w = None if mv is None or ma is None else mv * ma / 1e6
            if w is not None:
                watts.append((rail.label, w))
                if rail.gpu and gpu is None:
                    gpu = w
        if not watts:
            return
        module = next((w for label, w in watts if label.upper() in INPUT_RAILS), None)
        if module is None:
            module = sum(w for _, w in watts)
        now = self._clock.monotonic()
        if self._last_power is not None:
            then, module_then, gpu_then = self._last_power
            dt = max(0.0, now - then)
            if module_then is not None:
                self._energy_j += (module_then + module) / 2 * dt
            if gpu is not None and gpu_then is not None:
                self._energy_gpu_j += (gpu_then + gpu) / 2 * dt
        self._last_power = (now, module, gpu)
        out["power_usage"] = round(module, 3)
        out["energy_consumption"] = round(self._energy_j, 3)
        if gpu is not None:
            out["power_gpu_rail"] = round(gpu, 3)
            out["energy_gpu_rail"] = round(self._energy_gpu_j, 3)
        out["power_rails"] = ",".join(f"{label}:{format_number(w)}" for label, w in watts)

    def _r_memory(self, out: dict[str, Value]) -> None:
        text = _read_text(self.root / "proc/meminfo")
        if text is None:
            return
        fields: dict[str, int] = {}
        for line in text.splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                fields[key.strip()] = int(parts[0]) * 1024  # kB
        total, available = fields.get("MemTotal"), fields.get("MemAvailable")
        if total is not None:
            out["shared_memory_total"] = total
            if available is not None:
                out["shared_memory_used"] = max(0, total - available)

    def _r_power_mode(self, out: dict[str, Value]) -> None:
        mode = self._current_mode()
        if mode is None:
            return
        out["power_mode"] = mode
        name = self._modes().get(mode)
        if name:
            out["power_mode_name"] = name


def _wanted(properties: Iterable[str] | None) -> frozenset[str]:
    """The Jetson properties to read; other catalog names (the NVML family's, the mapper's) are skipped, as NVML
    skips names it has no reader for; unknown names are an error."""
    if properties is None:
        return _FAMILY_PROPS
    if isinstance(properties, str):
        properties = (properties,)
    names = set()
    for name in properties:
        if name not in PROPERTY_BY_NAME:
            raise InvalidValueError(
                f"sample: unknown property {name!r} (not in the GPU catalog)", reason="unknown-property"
            )
        if name in _FAMILY_PROPS:
            names.add(name)
    return frozenset(names)


def _is_rail(label: str) -> bool:
    return bool(label) and "sum of shunt" not in label.lower() and not _NC_TOKEN.search(label.upper())


def _is_gpu_rail(label: str) -> bool:
    return "GPU" in re.split(r"[_\s]+", label.upper())


def _channel(name: str) -> int:
    match = re.search(r"(\d+)", name)
    return int(match.group(1)) if match else 0


def _zone_number(name: str) -> int:
    return _channel(name)
