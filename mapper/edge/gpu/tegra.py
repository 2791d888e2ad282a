"""TegraBackend: a Jetson board's GPU from every source that serves it, as one GPU of the ``jetson`` family.

JetPack 7 ships an NVML that initialises on every Jetson but serves each board differently (shared/docs/nvml-facts.md
section 9): on an AGX Orin with JetPack 7.2 it answers NotSupported for load, clocks, memory and processes; on a Thor
it serves the load (which has no sysfs file there), memory and the process table, while frequencies, power modes,
rails and thermal zones stay in sysfs and nvpmodel. So the source of each property is chosen by what answers, not
by what initialises:

* ``TegraBackend`` is the sysfs and nvpmodel backend (``JetsonBackend``, which it extends) that also holds the
  board's ``NvmlBackend`` (None where there is no NVML). At ``init`` it reads the board's files, then asks NVML
  once what it serves (``probe_nvml``: one sample of the candidate properties, one process listing, one run of the
  driver checks) and routes each property (``property_sources``):
  - ``utilization_gpu`` and ``temperature`` (``NVML_FALLBACKS``): sysfs where the board has the file, else NVML
    where it answers (a Thor's load);
  - ``memory_used`` and ``memory_total`` (``JETSON_NVML_ONLY``): NVML where it answers, else nothing;
  - the process cycle (``processes``: NVML's process lists; the energy split uses the GPU rail where NVML has no
    energy counter) and the health loop (``health``, ``health_probe``: NVML's driver checks and the CUDA probe by
    NVML's identity of the GPU) where NVML manages the GPU (it serves its memory or its processes) and answers;
  - everything else: sysfs, and nvpmodel for ``power_mode`` and ``power_mode_name``, as ``JetsonBackend`` reads
    them. Setters are the Jetson's (devfreq, nvpmodel).
  Where NVML serves nothing it is shut down again; the board is then exactly a ``JetsonBackend``. The start-up log
  says which source serves which property and why, as ``gpu-mapper discover`` does above the Device.
* The GPU keeps the board's identity (``board_uuid``: the Device stays the same whichever source serves what);
  NVML's own UUID of it is used only towards NVML (``nvml_uuid``), and its PCI bus id is the GPU's ``pci_bus_id``.
* ``board_health_tools`` gives the health loop the node's probe and tools addressed by NVML's identity; a GPU
  reset is refused (a Jetson's GPU is not reset apart from its board).

This module is the seam between the two GPU families: it imports both backends, neither of them imports it.
"""

from __future__ import annotations

import logging
import os
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from mapper.clock import Clock
from mapper.edge.gpu.jetson import JetsonBackend, JetsonRound
from mapper.edge.gpu.nvml import NvmlBackend
from mapper.edge.health.checks import CheckResult, GpuProbe, GpuTools, HealthTools, ProbeResult, SelfCheckResult
from mapper.errors import MapperError, PermanentError, UnsupportedError
from mapper.shared.model import (
    JETSON_FAMILY_PROPERTIES,
    JETSON_NVML_ONLY,
    PROPERTY_BY_NAME,
    GpuEvent,
    GpuInfo,
    ProcessSample,
    PropertySource,
    Sample,
)

__all__ = [
    "NVML_COMPUTED",
    "NVML_FALLBACKS",
    "NvmlService",
    "TegraBackend",
    "board_health_tools",
    "describe_sources",
    "probe_nvml",
]

log = logging.getLogger(__name__)

#: Jetson properties NVML serves where the board has no file for them (the same meaning from either source).
NVML_FALLBACKS: tuple[str, ...] = ("utilization_gpu", "temperature")
#: The mapper's own properties that need NVML: the process cycle and the health loop (levels 2 and 3).
NVML_COMPUTED: tuple[str, ...] = ("processes", "health", "health_probe")
#: Properties nvpmodel keeps (its status file and nvpmodel.conf); the rest of a Jetson's are sysfs files.
NVPMODEL_PROPERTIES: tuple[str, ...] = ("power_mode", "power_mode_name")
#: What the board has no file for, by property (else: "the board has no such file").
_NO_FILE: Mapping[str, str] = {
    "utilization_gpu": "no load file for this GPU in sysfs",
    "temperature": "no GPU thermal zone",
}
_NVML_PROBED: tuple[str, ...] = (*NVML_FALLBACKS, *JETSON_NVML_ONLY)
_SYSFS = PropertySource("sysfs")
_WHY_LEN = 200


@dataclass(frozen=True)
class NvmlService:
    """What a board's NVML answered when ``probe_nvml`` asked it once."""

    #: NVML's identity of the board's GPU, and the GPU as NVML lists it ("" and None: NVML serves nothing).
    uuid: str = ""
    info: GpuInfo | None = None
    #: The candidate properties (``NVML_FALLBACKS``, ``JETSON_NVML_ONLY``) NVML answered; the others NotSupported.
    reads: frozenset[str] = frozenset()
    #: NVML lists the GPU's processes; its level-2 driver checks answered.
    processes: bool = False
    checks: bool = False
    #: Why NVML serves nothing here ("" where it initialised and listed the one GPU).
    why_not: str = ""

    @property
    def manages_gpu(self) -> bool:
        """NVML manages this GPU (the nvidia.ko stack of a Thor): it serves its memory or its processes. NVML on
        an Orin's nvgpu stack answers only for identity: its driver checks would say nothing about the GPU."""
        return "memory_used" in self.reads or self.processes


def _short(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= _WHY_LEN else text[: _WHY_LEN - 3] + "..."


def probe_nvml(nvml: NvmlBackend, deadline_s: float = 2.0) -> NvmlService:
    """Ask ``nvml`` once what it serves on this board: initialise, list the GPU (a Jetson has one), sample the
    candidate properties, list the processes, run the driver checks. Never raises ``MapperError``: what fails is
    what NVML does not serve."""
    try:
        nvml.init()
        gpus = nvml.list_gpus()
    except MapperError as exc:
        return NvmlService(why_not=_short(f"NVML does not initialise: {exc}"))
    if len(gpus) != 1:
        return NvmlService(why_not=f"NVML lists {len(gpus)} GPUs, not the board's one")
    info = gpus[0]
    try:
        sample = nvml.sample(info.uuid, _NVML_PROBED)
    except MapperError as exc:
        return NvmlService(why_not=_short(f"NVML cannot read its GPU {info.uuid}: {exc}"))
    processes = False
    try:
        processes = "processes" not in nvml.processes(info.uuid).unsupported
    except MapperError as exc:
        log.debug("GPU %s: NVML's process lists: %s", info.uuid, exc)
    checks = False
    try:
        nvml.driver_checks(info.uuid, deadline_s)
        checks = True
    except MapperError as exc:
        log.debug("GPU %s: NVML's driver checks: %s", info.uuid, exc)
    reads = frozenset(name for name in _NVML_PROBED if name in sample.values)
    return NvmlService(uuid=info.uuid, info=info, reads=reads, processes=processes, checks=checks)


def describe_sources(sources: Mapping[str, PropertySource], width: int = 116) -> list[str]:
    """``sources`` as lines of text, one group per source (``nvml: utilization_gpu (why), memory_used``), then
    what nothing serves, each with why; wrapped at ``width``."""
    groups: dict[str, list[str]] = {}
    for name, src in sources.items():
        key = src.source or "not served"
        groups.setdefault(key, []).append(f"{name} ({src.why})" if src.why else name)
    lines: list[str] = []
    for key in ("nvml", "sysfs", "nvpmodel", "mapper", "not served"):
        if key in groups:
            text = f"{key}: " + ", ".join(groups[key])
            lines += textwrap.wrap(text, width, subsequent_indent="  ", break_on_hyphens=False)
    return lines


class TegraBackend(JetsonBackend):
    """The ``GpuBackend`` (and ``FrequencyActuator``, ``ProcessSource``, the health loop's ``DriverCheckSource``)
    of one Jetson board: ``JetsonBackend`` over ``root`` and, where it serves, ``nvml`` (the module docstring).

    ``nvml``: the board's NVML backend, or None where there is none; ``no_nvml``: why not (for the log and
    ``discover``). ``checks_deadline_s``: the driver checks' deadline when NVML is probed. Other arguments are
    ``JetsonBackend``'s. NVML is called with this backend's lock released: its calls have their own timeouts.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] = "/",
        *,
        nvml: NvmlBackend | None = None,
        no_nvml: str = "no NVML on this board",
        checks_deadline_s: float = 2.0,
        nvpmodel: Sequence[str] = ("nvpmodel",),
        allow_reboot: bool = False,
        clock: Clock | None = None,
        command_timeout_s: float = 8.0,
    ) -> None:
        super().__init__(
            root, nvpmodel=nvpmodel, allow_reboot=allow_reboot, clock=clock, command_timeout_s=command_timeout_s
        )
        self._board_nvml = nvml
        self._no_nvml = no_nvml
        self._checks_deadline_s = checks_deadline_s
        #: The NVML backend while it serves a property (None: it serves nothing, or there is none).
        self._nvml: NvmlBackend | None = None
        self._service = NvmlService(why_not=no_nvml)
        #: Where the properties NVML might serve come from (``NVML_FALLBACKS``, ``JETSON_NVML_ONLY``,
        #: ``NVML_COMPUTED``), decided at ``init``.
        self._routes: dict[str, PropertySource] = {}
        self._via_nvml: frozenset[str] = frozenset()
        #: The routes are decided (``init`` finished): until then a caller waits for the lock ``init`` holds.
        self._planned = False

    # --- lifecycle -------------------------------------------------------------------------------
    def init(self) -> None:
        with self._lock:
            if self._ready:
                return
            super().init()
            self._plan()

    def shutdown(self) -> None:
        with self._lock:
            super().shutdown()
            self._planned = False
            nvml, self._nvml = self._nvml, None
        if nvml is not None:
            nvml.shutdown()

    def _plan(self) -> None:
        """Ask NVML what it serves and route each property it might serve (the module docstring); log it."""
        nvml = self._board_nvml
        service = probe_nvml(nvml, self._checks_deadline_s) if nvml is not None else NvmlService(why_not=self._no_nvml)
        self._service = service
        board = JetsonBackend.sample(self, self._uuid, NVML_FALLBACKS)
        routes: dict[str, PropertySource] = {}
        for name in NVML_FALLBACKS:
            if name in board.values or name in board.errors:
                routes[name] = _SYSFS
            elif name in service.reads:
                routes[name] = PropertySource("nvml", _NO_FILE[name])
            else:
                routes[name] = PropertySource("", f"{_NO_FILE[name]}; {self._nvml_lacks(name)}")
        for name in JETSON_NVML_ONLY:
            routes[name] = (
                PropertySource("nvml") if name in service.reads else PropertySource("", self._nvml_lacks(name))
            )
        if service.processes:
            routes["processes"] = PropertySource("nvml", "its process lists")
        else:
            routes["processes"] = PropertySource("", self._nvml_lacks("processes"))
        for name, how in (
            ("health", "its driver checks"),
            ("health_probe", "the CUDA probe by its identity of the GPU"),
        ):
            if service.checks and service.manages_gpu:
                routes[name] = PropertySource("nvml", how)
            else:
                routes[name] = PropertySource("", self._nvml_lacks(name))
        self._routes = routes
        self._via_nvml = frozenset(n for n, s in routes.items() if s.source == "nvml")
        self._planned = True
        if self._via_nvml:
            self._nvml = nvml
        else:
            self._nvml = None
            if nvml is not None:
                nvml.shutdown()
        where = self._devfreq.name if self._devfreq is not None else "?"
        lines = describe_sources({n: routes[n] for n in (*_NVML_PROBED, *NVML_COMPUTED)}, width=10_000)
        log.info(
            "Jetson GPU %s (devfreq %s): %s; sysfs and nvpmodel serve every other property",
            self._uuid,
            where,
            "; ".join(lines).replace("nvml:", f"NVML (its GPU {service.uuid}) serves", 1),
        )

    def _ensure(self) -> None:
        if not (self._ready and self._planned):
            with self._lock:  # (another thread's init holds it until the routes are decided)
                if not self._ready:
                    self.init()

    def _nvml_lacks(self, name: str) -> str:
        """Why NVML does not serve ``name`` here."""
        service = self._service
        if service.why_not:
            return service.why_not
        if name == "processes":
            return "NVML answers NotSupported for its process lists"
        if name in ("health", "health_probe"):
            if not service.manages_gpu:
                return "NVML does not manage this GPU (no memory or processes): no driver checks or probe"
            return "NVML's driver checks do not answer"
        call = PROPERTY_BY_NAME[name].nvml_read.split("(")[0].split(".")[0]
        return f"NVML answers NotSupported ({call})"

    # --- identity --------------------------------------------------------------------------------
    @property
    def nvml_uuid(self) -> str:
        """NVML's identity of the board's GPU ("" where NVML serves nothing)."""
        return self._service.uuid if self._nvml is not None else ""

    def nvml_serving(self, name: str) -> NvmlBackend | None:
        """The NVML backend where it serves ``name`` (``processes``, ``health``, a property), else None."""
        self._ensure()
        return self._nvml if name in self._via_nvml else None

    def property_sources(self, uuid: str) -> dict[str, PropertySource]:
        """Where every property of the Jetson family comes from on this board, and the mapper's own that need
        NVML (``NVML_COMPUTED``): the board's files read once now (a property whose file is absent: ``""``)."""
        self._ensure()
        self._check(uuid)
        others = [p.name for p in JETSON_FAMILY_PROPERTIES if p.name not in self._routes]
        sample = JetsonBackend.sample(self, uuid, others)
        out: dict[str, PropertySource] = {}
        for spec in JETSON_FAMILY_PROPERTIES:
            name = spec.name
            if name in self._routes:
                out[name] = self._routes[name]
            elif name in sample.values or name in sample.errors:
                out[name] = PropertySource("nvpmodel") if name in NVPMODEL_PROPERTIES else _SYSFS
            else:
                out[name] = PropertySource("", "the board has no such file")
        for name in NVML_COMPUTED:
            out[name] = self._routes[name]
        return out

    def list_gpus(self) -> list[GpuInfo]:
        """The board's GPU; where NVML serves it, with NVML's PCI bus id (the CUDA probe finds the GPU by it) and
        architecture."""
        infos = super().list_gpus()
        nv = self._service.info
        if self._nvml is None or nv is None:
            return infos
        return [replace(i, pci_bus_id=nv.pci_bus_id, architecture=i.architecture or nv.architecture) for i in infos]

    # --- reading ---------------------------------------------------------------------------------
    def sample(self, uuid: str, properties: Iterable[str] | None = None) -> Sample:
        self._ensure()
        nvml = self._nvml
        if nvml is None:
            return super().sample(uuid, properties)
        if properties is None:
            names: Sequence[str] = [p.name for p in JETSON_FAMILY_PROPERTIES]
        elif isinstance(properties, str):
            names = [properties]
        else:
            names = list(properties)
        via = [n for n in names if n in self._via_nvml]
        if not via:
            return super().sample(uuid, names)
        board = super().sample(uuid, [n for n in names if n not in self._via_nvml])
        values = dict(board.values)
        errors = dict(board.errors)
        try:
            read = nvml.sample(self._service.uuid, via)
        except MapperError as exc:
            for name in via:
                errors[name] = f"nvml: {_short(str(exc))}"
        else:
            values.update(read.values)
            errors.update(read.errors)
        return Sample(uuid=board.uuid, ts_ms=board.ts_ms, values=values, errors=errors)

    def sample_many(self, requests: Sequence[tuple[str, Iterable[str] | None]], events: bool = False) -> JetsonRound:
        """Every request's sample (or its error); with ``events``, NVML's events (``poll_events``) too."""
        done = super().sample_many(requests)
        if not events:
            return done
        try:
            return JetsonRound(done.samples, self.poll_events())
        except MapperError as exc:
            return JetsonRound(done.samples, [], exc)

    def poll_events(self) -> list[GpuEvent]:
        """NVML's events of the GPU (XID, GPU lost, driver reload) under the board's identity; none without NVML."""
        nvml = self._nvml
        if nvml is None:
            return []
        theirs = self._service.uuid
        return [replace(e, uuid=self._uuid) if e.uuid == theirs else e for e in nvml.poll_events()]

    # --- the process cycle and the health loop ---------------------------------------------------
    def processes(self, uuid: str) -> ProcessSample:
        """NVML's processes of the GPU (``NvmlBackend.processes``) under the board's identity. Where NVML has no
        energy counter or power reading (a Thor), the GPU rail's (``energy_gpu_rail``, ``power_gpu_rail``)."""
        self._ensure()
        self._check(uuid)
        nvml = self.nvml_serving("processes")
        if nvml is None:
            raise UnsupportedError(f"GPU {uuid}: no process lists: {self._routes['processes'].why}")
        sample = nvml.processes(self._service.uuid)
        energy_j, power_w = sample.energy_j, sample.power_w
        unsupported = dict(sample.unsupported)
        if energy_j is None or power_w is None:
            rail = JetsonBackend.sample(self, uuid, ("energy_gpu_rail", "power_gpu_rail")).values
            if energy_j is None and isinstance(rail.get("energy_gpu_rail"), float):
                energy_j = float(rail["energy_gpu_rail"])
                unsupported.pop("energy", None)
            if power_w is None and isinstance(rail.get("power_gpu_rail"), float):
                power_w = float(rail["power_gpu_rail"])
                unsupported.pop("power", None)
        return replace(sample, uuid=uuid, energy_j=energy_j, power_w=power_w, unsupported=unsupported)

    def driver_checks(self, uuid: str, deadline_s: float) -> tuple[CheckResult, ...]:
        """NVML's level-2 checks of the GPU (``NvmlBackend.driver_checks``)."""
        self._ensure()
        self._check(uuid)
        nvml = self.nvml_serving("health")
        if nvml is None:
            raise UnsupportedError(f"GPU {uuid}: no driver checks: {self._routes['health'].why}")
        return nvml.driver_checks(self._service.uuid, deadline_s)

    def gpu_reset(self, uuid: str) -> None:
        """The GPU was reset outside NVML: NVML forgets what it knew of it (``NvmlBackend.gpu_reset``)."""
        nvml = self._nvml
        if nvml is not None and uuid == self._uuid:
            nvml.gpu_reset(self._service.uuid)

    def nvml_identity(self, uuid: str) -> str:
        """NVML's UUID of the GPU the board's ``uuid`` names (``uuid`` itself for another)."""
        return self._service.uuid if uuid == self._uuid and self._service.uuid else uuid


class _BoardProbe:
    """The level-3 probe of a Jetson's GPU by NVML's identity of it (the CUDA probe checks that identity)."""

    def __init__(self, inner: GpuProbe, backend: TegraBackend) -> None:
        self._inner = inner
        self._backend = backend

    def probe(self, uuid: str, pci_bus_id: str, timeout_s: float) -> ProbeResult:
        return self._inner.probe(self._backend.nvml_identity(uuid), pci_bus_id, timeout_s)


class _BoardTools:
    """NVIDIA's tools for a Jetson's GPU: the self-check by NVML's identity; no reset (a Jetson's GPU is reset with
    its board)."""

    def __init__(self, inner: GpuTools, backend: TegraBackend) -> None:
        self._inner = inner
        self._backend = backend

    def self_check(self, uuid: str, timeout_s: float) -> list[SelfCheckResult]:
        return self._inner.self_check(self._backend.nvml_identity(uuid), timeout_s)

    def reset(self, uuid: str, timeout_s: float) -> None:
        raise PermanentError(f"GPU {uuid}: a Jetson's GPU is not reset apart from its board: reboot the board")


def board_health_tools(tools: HealthTools, backend: TegraBackend) -> HealthTools:
    """``tools`` (the node's or the simulator's) for the health loop over ``backend``: the probe and the
    self-check address the GPU by NVML's identity of it; the reset is refused."""
    return HealthTools(
        probe=_BoardProbe(tools.probe, backend), host_root=tools.host_root, tools=_BoardTools(tools.tools, backend)
    )
