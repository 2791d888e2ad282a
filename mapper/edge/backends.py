"""Choosing the GPU backend family (part of the composition root, next to ``mapper.edge.app.build_backend``), and
what hangs on the family: the health loop and its tools, and the process loop (NVML, or a Jetson whose NVML
serves them).

``settings.backend``: ``nvml``; ``jetson``; ``auto`` (the default): a Jetson where a Tegra GPU is found under
``jetson.root``, else NVML (whose start-up error says what is missing). NVML initialising does not make a board an
NVML GPU: JetPack 7's NVML initialises on every Jetson but serves only parts of it, so a Jetson is always the
``jetson`` family, and its ``TegraBackend`` takes each property from the source that answers for it (sysfs and
nvpmodel, and NVML where it serves: a Thor's load, memory and processes; docs/jetson.md). With ``--sim N`` the
simulator's profile decides: a Jetson profile (orin-agx, xavier-agx, orin-nano, orin-agx-jp7, thor) builds a
simulated sysfs tree (and, for a JetPack 7 board, a simulated NVML beside it) and runs the real backends over
them, any other profile is a simulated NVML.

A simulated NVML has a simulated host in ``<data dir>/sim-host`` (0700): the driver's traces for the health loop,
and its processes' ``proc/<pid>/cgroup`` and the kubelet's pod files, which the process loop reads there instead
of ``/proc`` and ``/`` unless ``processes.procRoot`` or ``processes.podFilesRoot`` is set (docs/processes.md).
What it offers is the ``SimulatedNode`` protocol, checked by type in one place (``simulated_node``); nothing
outside the composition root asks whether the GPUs are simulated.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from mapper.clock import Clock, SystemClock
from mapper.edge.config import Settings
from mapper.edge.control.collect import GpuWorker
from mapper.edge.control.healthloop import HealthMonitor
from mapper.edge.control.policy import PolicyEngine, PolicyEvent
from mapper.edge.gpu.jetson import JetsonBackend, tegra_gpu_present
from mapper.edge.gpu.nvml import NvmlBackend
from mapper.edge.gpu.simjetson import PROFILE_NAMES, SimJetson, is_jetson_profile, nvpmodel_command
from mapper.edge.gpu.tegra import TegraBackend, board_health_tools
from mapper.edge.health.checks import HealthTools
from mapper.edge.outbox.publish import Publisher
from mapper.edge.outbox.streams import TelemetryStreams
from mapper.edge.processes.loop import ProcessLoop, process_loop
from mapper.errors import ConfigError

if TYPE_CHECKING:
    from mapper.edge.gpu.simnvml import SimNvml

log = logging.getLogger(__name__)


@runtime_checkable
class SimulatedNode(Protocol):
    """What a simulated NVML offers the composition root in place of the node's own parts: the health loop's
    tools over a simulated host, and the processes' host tree (``/proc`` and the kubelet's pod files)."""

    def health_tools(self, host_root: Path) -> HealthTools:
        """The CUDA probe, the driver's traces written under ``host_root``, the NVIDIA tools."""
        ...

    def pod_tree(self, root: Path) -> Path:
        """Write the processes' host tree under ``root`` and keep it up to date; the root."""
        ...


if TYPE_CHECKING:

    def _simnvml_is_a_simulated_node(sim: SimNvml) -> SimulatedNode:
        return sim  # mypy: the simulator keeps to the protocol (a renamed method is a type error here)


def simulated_node(backend: NvmlBackend) -> SimulatedNode | None:
    """The simulated node under ``backend`` (its NVML binding is the simulator), else None (the real ``pynvml``)."""
    nvml = backend.nvml
    return nvml if isinstance(nvml, SimulatedNode) else None


def wants_jetson(settings: Settings) -> bool:
    """True when this mapper serves a Jetson (see the module docstring)."""
    if settings.sim:
        if settings.backend == "nvml" and is_jetson_profile(settings.sim_profile):
            raise ConfigError(f"sim.profile: {settings.sim_profile} is a Jetson profile, but backend is nvml")
        if settings.backend == "jetson" and not is_jetson_profile(settings.sim_profile):
            raise ConfigError(
                f"sim.profile: {settings.sim_profile} is an NVML profile, but backend is jetson "
                f"(Jetson profiles: {', '.join(PROFILE_NAMES)})"
            )
        return is_jetson_profile(settings.sim_profile)
    if settings.backend != "auto":
        return settings.backend == "jetson"
    if not tegra_gpu_present(settings.jetson_root):
        return False
    log.info(
        "a Tegra GPU is under %s: the Jetson backend, with NVML for what it serves on this board", settings.jetson_root
    )
    return True


class _SimulatedJetsonBackend(TegraBackend):
    """The Jetson backend over a simulated board (and its simulated NVML, if any); its shutdown also stops the
    board's physics (and removes a temporary tree)."""

    def __init__(self, sim: SimJetson, remove: bool, **kwargs: Any) -> None:
        super().__init__(sim.root, **kwargs)
        self._sim = sim
        self._remove = remove

    def shutdown(self) -> None:
        super().shutdown()
        self._sim.stop()
        if self._remove:
            shutil.rmtree(self._sim.root, ignore_errors=True)


def build_jetson_backend(
    settings: Settings,
    clock: Clock | None = None,
    *,
    one_shot: bool = False,
    nvml_layer: Callable[[Any], Any] | None = None,
) -> JetsonBackend:
    """The Jetson backend (``TegraBackend``: sysfs, nvpmodel and the node's NVML where it serves) over
    ``jetson.root`` or, with ``--sim``, over a simulated board whose tree lies in ``<data dir>/sim-jetson`` (a
    temporary directory for one-shot commands or when the data dir cannot be made), with a simulated NVML beside a
    JetPack 7 board's tree, driven by the board's load. ``nvml_layer``: what that simulated NVML is called through
    (tests: the real pynvml over the stand-in library), by default the simulator itself."""
    clock = clock or SystemClock()
    options: dict[str, Any] = {"allow_reboot": settings.jetson_allow_reboot, "clock": clock}
    if not settings.sim:
        import pynvml

        nvml = NvmlBackend(pynvml, clock=clock, one_shot=one_shot)
        return TegraBackend(settings.jetson_root, nvml=nvml, nvpmodel=settings.jetson_nvpmodel.split(), **options)
    if settings.sim != 1:
        raise ConfigError(f"sim.count: a Jetson has one GPU, got {settings.sim} with profile {settings.sim_profile}")
    root: Path | None = None
    if not one_shot:
        try:
            root = Path(settings.data_dir) / "sim-jetson"
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            log.warning("cannot use %s for the simulated Jetson (%s): a temporary directory instead", root, exc)
            root = None
    remove = root is None
    if root is None:
        root = Path(tempfile.mkdtemp(prefix="gpu-mapper-sim-jetson-"))
    sim = SimJetson.create(
        root,
        settings.sim_profile,
        scenario=settings.sim_scenario,
        seed=settings.sim_seed,
        clock=clock.monotonic,
        # As on a board: only root may write the devfreq limits and run nvpmodel (reads work for anyone).
        as_root=os.geteuid() == 0,
    )
    board_nvml: NvmlBackend | None = None
    if sim.prof.nvml_profile is not None:
        from mapper.edge.gpu.simnvml import SimNvml

        nvml_sim = SimNvml(
            1,
            sim.prof.nvml_profile,
            seed=settings.sim_seed,
            scenario=settings.sim_scenario,
            clock=clock.monotonic,
            as_root=os.geteuid() == 0,
            driver_version=sim.prof.nvml_driver,
        )
        sim.on_load = lambda load: nvml_sim.set_utilization(None, round(100.0 * load, 1))
        sim.step()
        board_nvml = NvmlBackend(nvml_layer(nvml_sim) if nvml_layer else nvml_sim, clock=clock, one_shot=one_shot)
    sim.start()
    return _SimulatedJetsonBackend(
        sim,
        remove,
        nvml=board_nvml,
        no_nvml=f"the simulated {sim.prof.name} has no NVML (JetPack {sim.prof.jetpack})",
        nvpmodel=nvpmodel_command(root),
        **options,
    )


def sim_host_dir(data_dir: Path) -> Path:
    """The simulated host's tree: in the data dir, so private like every file there (docs/security.md)."""
    return data_dir / "sim-host"


def make_sim_host(host: Path) -> None:
    """Create ``host`` (in an existing data dir) 0700, or tighten it to 0700; OSError when it cannot."""
    host.mkdir(mode=0o700, exist_ok=True)
    host.chmod(0o700)


def build_health_tools(node: SimulatedNode | None, data_dir: Path) -> HealthTools:
    """The CUDA probe, host root and NVIDIA tools of the health loop: the simulated node's own (its host tree in
    ``<data dir>/sim-host``) over a simulated NVML, else the node's."""
    if node is not None:
        host = sim_host_dir(data_dir)
        try:
            make_sim_host(host)
        except OSError as exc:  # (start-up then says what is wrong with the data dir itself)
            log.warning("cannot use %s for the simulated host (%s): a temporary directory instead", host, exc)
            host = Path(tempfile.mkdtemp(prefix="gpu-mapper-sim-host-"))
        return node.health_tools(host)
    from mapper.edge.gpu.tools import host_health_tools

    return host_health_tools()


def health_monitor(
    backend: object,
    workers: Mapping[str, GpuWorker],
    policies: PolicyEngine,
    data_dir: Path,
    clock: Clock,
    emit: Callable[[GpuWorker, Sequence[PolicyEvent]], None],
    beat: Callable[[str, float], None] | None = None,
) -> HealthMonitor | None:
    """The health loop over an NVML backend (``emit``: its policy events; ``beat``: its heartbeat), or over a
    Jetson whose NVML serves its driver checks (a Thor: the probe and the tools by NVML's identity of the GPU, no
    reset); None on another Jetson, which has no NVML checks, XIDs or CUDA probe by NVML identity
    (docs/jetson.md)."""
    source: NvmlBackend | TegraBackend
    if isinstance(backend, TegraBackend):
        nvml = backend.nvml_serving("health")
        if nvml is None:
            return None
        source, tools = backend, board_health_tools(build_health_tools(simulated_node(nvml), data_dir), backend)
    elif isinstance(backend, NvmlBackend):
        source, tools = backend, build_health_tools(simulated_node(backend), data_dir)
    else:
        return None
    count = lambda uuid: len(source.processes(uuid).processes)  # noqa: E731
    return HealthMonitor(workers, policies, source, tools, clock=clock, emit=emit, beat=beat, processes=count)


def build_process_loop(
    settings: Settings,
    backend: object,
    workers: Mapping[str, GpuWorker],
    publisher: Publisher,
    streams: TelemetryStreams,
    *,
    data_dir: Path,
    clock: Clock,
    beat: Callable[[str, float], None] | None = None,
) -> ProcessLoop | None:
    """The process loop (``processes.loop.process_loop``; ``beat``: its heartbeat) over an NVML backend, or over a
    Jetson whose NVML lists its processes (a Thor); None on another Jetson (its per-process use is not read:
    docs/jetson.md) and when ``processes.interval`` is 0. Over a simulated NVML (a ``SimulatedNode``) it reads the
    simulator's host tree in ``<data dir>/sim-host``, written before the first cycle, where the settings keep the
    host's defaults (``sim_process_roots``)."""
    source: NvmlBackend | TegraBackend
    if isinstance(backend, TegraBackend):
        nvml = backend.nvml_serving("processes")
        if nvml is None:
            return None
        source = backend
    elif isinstance(backend, NvmlBackend):
        source = nvml = backend
    else:
        return None
    settings, prepare = sim_process_roots(settings, simulated_node(nvml), data_dir)
    return process_loop(settings, source, workers, publisher, streams, clock=clock, beat=beat, prepare=prepare)


def sim_process_roots(
    settings: Settings, node: SimulatedNode | None, data_dir: Path
) -> tuple[Settings, Callable[[], None] | None]:
    """``settings`` with ``processes.procRoot`` and ``processes.podFilesRoot`` in the simulated host's tree, and
    what writes the tree, over a simulated node (``node``, else None) where neither setting was given (in the file,
    the environment or a flag, or in code to a value of its own); else ``settings`` as they are and None. The
    simulated processes then have a pod each (``SimPods``); on real GPUs the host's ``/proc`` and ``/`` stay."""
    defaults = Settings()
    own = [
        name
        for name in ("proc_root", "pod_files_root")
        if name in settings.given or getattr(settings, name) != getattr(defaults, name)
    ]
    if node is None or own:
        return settings, None
    host = sim_host_dir(data_dir)
    write = node.pod_tree

    def prepare() -> None:
        try:
            make_sim_host(host)
            write(host)
        except OSError as exc:
            log.warning("cannot write the simulated processes' tree in %s (%s): their pods are not named", host, exc)

    return replace(settings, proc_root=str(host / "proc"), pod_files_root=str(host)), prepare
