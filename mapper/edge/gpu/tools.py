"""NVIDIA's command-line tools for the recovery flow: the self-check (``nvidia-smi -q``, ``dcgmi diag -r 1``)
and the GPU reset (``nvidia-smi -r``). Each runs as a child process with a timeout; a tool that is not installed
is left out of the self-check (``shutil.which``)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

from mapper.edge.gpu.cudaprobe import CudaProbe
from mapper.edge.health.checks import HealthTools, SelfCheckResult
from mapper.errors import PermanentError, TransientError

__all__ = ["NvidiaTools", "host_health_tools"]

Runner = Callable[[Sequence[str], float], "subprocess.CompletedProcess[str]"]


def _run(argv: Sequence[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, check=False)


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else ""


class NvidiaTools:
    """``nvidia-smi`` and ``dcgmi`` as found on ``PATH`` (``which``), run through ``runner``."""

    def __init__(self, *, which: Callable[[str], str | None] = shutil.which, runner: Runner = _run) -> None:
        self._which = which
        self._run = runner

    def self_check(self, uuid: str, timeout_s: float) -> list[SelfCheckResult]:
        out: list[SelfCheckResult] = []
        smi = self._which("nvidia-smi")
        if smi is not None:
            out.append(self._tool("nvidia-smi-q", [smi, "-q", "-i", uuid], timeout_s))
        dcgmi = self._which("dcgmi")
        if dcgmi is not None:
            out.append(self._tool("dcgmi-diag-r1", [dcgmi, "diag", "-r", "1"], timeout_s))
        return out

    def _tool(self, name: str, argv: list[str], timeout_s: float) -> SelfCheckResult:
        try:
            done = self._run(argv, timeout_s)
        except subprocess.TimeoutExpired:
            return SelfCheckResult(name, False, f"timeout-after-{timeout_s:g}s")
        except OSError as exc:
            return SelfCheckResult(name, False, f"not-started-{type(exc).__name__}")
        if done.returncode != 0:
            return SelfCheckResult(name, False, f"exit-{done.returncode}")
        if "fail" in done.stdout.lower() and name.startswith("dcgmi"):
            return SelfCheckResult(name, False, "a-test-failed")
        return SelfCheckResult(name, True)

    def reset(self, uuid: str, timeout_s: float) -> None:
        smi = self._which("nvidia-smi")
        if smi is None:
            raise PermanentError(f"GPU {uuid}: cannot reset: nvidia-smi is not on PATH")
        try:
            done = self._run([smi, "-r", "-i", uuid], timeout_s)
        except subprocess.TimeoutExpired:
            raise TransientError(f"GPU {uuid}: nvidia-smi -r took longer than {timeout_s:g}s") from None
        if done.returncode != 0:
            why = _last_line(done.stderr) or _last_line(done.stdout) or f"exit status {done.returncode}"
            raise PermanentError(f"GPU {uuid}: nvidia-smi -r failed: {why}")


def host_health_tools(library: str = "libcuda.so.1") -> HealthTools:
    """The real node: the CUDA probe over ``library``, the host's own root, NVIDIA's tools."""
    return HealthTools(probe=CudaProbe(library), host_root=Path("/"), tools=NvidiaTools())
