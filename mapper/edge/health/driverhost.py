"""Level-2 checks that read the host, not NVML: device nodes, the kernel module's version, nvidia-persistenced.

Reads files under a root handed in (``/`` in production; the simulator's ``SimHost`` tree under ``--sim``), so it is
tested on real files. Each check is a ``mapper.edge.health.checks.CheckResult`` with a twin-safe reason:

* ``device-nodes``: ``dev/nvidiactl`` and ``dev/nvidia-uvm`` (CUDA needs both) exist, and at least as many
  ``dev/nvidia<N>`` as NVML lists GPUs. Missing: ``unhealthy`` (no process can open the GPU).
* ``driver-version``: the loaded kernel module's version (``proc/driver/nvidia/version``) is NVML's
  (``nvmlSystemGetDriverVersion``). A mismatch is what a driver upgraded without a reload leaves: ``unhealthy``
  (new CUDA contexts fail with "driver/library version mismatch"). Unreadable: ``degraded``.
* ``persistenced``: where persistence is wanted (``health.checks.persistence``), ``nvidia-persistenced`` runs:
  its socket ``var/run/nvidia-persistenced/socket`` exists, or the pid in its pid file is alive under
  ``proc``. Not running: ``degraded`` (the GPU works, but its state is torn down when the last client exits).
"""

from __future__ import annotations

import re
from pathlib import Path

from mapper.edge.health.checks import CheckResult

__all__ = ["host_checks", "kernel_module_version"]

_MODULE_VERSION_RE = re.compile(r"Kernel Module(?: for [\w-]+)?\s+(\d+\.\d+(?:\.\d+)?)")
_GPU_NODE_RE = re.compile(r"nvidia\d+")


def kernel_module_version(root: Path) -> str | None:
    """The NVIDIA kernel module's version from ``proc/driver/nvidia/version`` under ``root``; None when unreadable."""
    try:
        text = (root / "proc" / "driver" / "nvidia" / "version").read_text(errors="replace")
    except OSError:
        return None
    m = _MODULE_VERSION_RE.search(text)
    return m.group(1) if m else None


def host_checks(root: Path, *, nvml_driver_version: str, gpu_count: int, persistence: bool) -> tuple[CheckResult, ...]:
    """The node's host-side level-2 checks (the same for every GPU of the node)."""
    return (
        _device_nodes(root, gpu_count),
        _driver_version(root, nvml_driver_version),
        _persistenced(root, persistence),
    )


def _device_nodes(root: Path, gpu_count: int) -> CheckResult:
    dev = root / "dev"
    missing = [name for name in ("nvidiactl", "nvidia-uvm") if not (dev / name).exists()]
    try:
        gpu_nodes = sorted(p.name for p in dev.iterdir() if _GPU_NODE_RE.fullmatch(p.name))
    except OSError:
        gpu_nodes = []
    detail = (("gpu_nodes", str(len(gpu_nodes))),)
    if missing:
        return CheckResult("device-nodes", "unhealthy", f"missing-{missing[0]}", "driver", detail)
    if len(gpu_nodes) < gpu_count:
        return CheckResult("device-nodes", "unhealthy", f"{len(gpu_nodes)}-of-{gpu_count}-gpu-nodes", "driver", detail)
    return CheckResult("device-nodes", "healthy", "ok", "driver", detail)


def _driver_version(root: Path, nvml_version: str) -> CheckResult:
    module = kernel_module_version(root)
    detail = (("kernel_module", module or "unknown"), ("nvml", nvml_version or "unknown"))
    if module is None:
        return CheckResult("driver-version", "degraded", "kernel-module-version-unreadable", "driver", detail)
    if nvml_version and module != nvml_version:
        return CheckResult("driver-version", "unhealthy", f"kernel-{module}-nvml-{nvml_version}", "driver", detail)
    return CheckResult("driver-version", "healthy", "ok", "driver", detail)


def _persistenced(root: Path, wanted: bool) -> CheckResult:
    if not wanted:
        return CheckResult("persistenced", "healthy", "not-wanted", "driver")
    folder = root / "var" / "run" / "nvidia-persistenced"
    if (folder / "socket").exists():
        return CheckResult("persistenced", "healthy", "ok", "driver", (("found", "socket"),))
    try:
        pid = int((folder / "nvidia-persistenced.pid").read_text().strip())
    except (OSError, ValueError):
        pid = 0
    if pid > 0 and (root / "proc" / str(pid)).exists():
        return CheckResult("persistenced", "healthy", "ok", "driver", (("pid", str(pid)),))
    return CheckResult("persistenced", "degraded", "persistenced-not-running", "driver")
