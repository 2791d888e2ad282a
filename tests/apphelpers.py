"""Run a whole MapperApp in-process on simulated GPUs, on real time with short cycles."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from mapper.edge.app import MapperApp
from mapper.edge.config import Settings
from mapper.edge.gpu.nvml import NvmlBackend
from mapper.edge.gpu.simnvml import SimNvml


def fast_settings(data_dir: str, **overrides: Any) -> Settings:
    base = Settings(
        node_name="edge-1",
        data_dir=data_dir,
        metrics_addr="127.0.0.1:0",
        collect_cycle_ms=100,
        report_cycle_ms=300,
        state_report_cycle_ms=1000,
        telemetry_window_s=0.5,
        edgecore_socket=f"{data_dir}/none.sock",
        socket=f"{data_dir}/gpu.sock",
    )
    return replace(base, **overrides)


@contextlib.asynccontextmanager
async def running_app(
    settings: Settings, sim: SimNvml, *, housekeeping_interval_s: float = 5.0, energy_read_s: float | None = None
) -> AsyncIterator[MapperApp]:
    """The mapper over ``sim`` until the block ends. ``energy_read_s``: the backend's read cycle of the energy
    counter (None: the catalog's; 0: at every sample)."""
    backend = NvmlBackend(sim, energy_read_s=energy_read_s)
    app = MapperApp(settings, backend, housekeeping_interval_s=housekeeping_interval_s)
    stop = asyncio.Event()
    task = asyncio.create_task(app.run(stop))
    try:
        await wait_for(lambda: app.metrics is not None or task.done(), what="the mapper to start")
        assert not task.done(), f"the mapper exited early with {task.result()}"
        yield app
    finally:
        stop.set()
        code = await asyncio.wait_for(task, 15)
        assert code == 0, f"the mapper exited with {code}"


async def wait_for(predicate: Callable[[], Any], *, timeout_s: float = 10.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def setpriv_as(uid: int) -> list[str]:
    """The command prefix that runs a program as ``uid`` (from root). Where that user cannot reach this checkout
    or its interpreter (a clone under root's 0700 home), it keeps only CAP_DAC_READ_SEARCH, to read them: not
    root for the mapper (its euid decides, as NVML's does), and no right to write or chmod what is not its own."""
    base = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    probe = [*base, sys.executable, "-c", "import mapper.cli"]
    if (
        subprocess.run(probe, cwd=Path(__file__).resolve().parent.parent, capture_output=True, timeout=60).returncode
        == 0
    ):
        return base
    return [*base, "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]
