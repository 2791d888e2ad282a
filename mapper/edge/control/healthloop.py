"""The health loop: level-2 driver checks and level-3 probes on their schedules, and the recovery flow.

One task for every GPU. For each GPU (its own ``health`` config, overrides included):

* **checks** every ``health.checks.interval``: ``driver_checks`` through the backend (NVML: responsive within
  ``nvmlDeadline``, InfoROM) and ``mapper.edge.health.driverhost.host_checks`` (device nodes, kernel module version,
  nvidia-persistenced where ``persistence`` is wanted);
* **the probe** every ``health.probe.interval`` (every ``retryInterval`` while the GPU is not healthy), and soon
  after an XID or ECC event (``GpuWorker.probe_requested``); skipped while the GPU's utilisation is above
  ``skipAboveUtilization``; a pass slower than ``slowAbove`` is ``slow``.

Results go to the GPU's next step (``GpuWorker.pending_checks`` / ``pending_probe``, then ``wake``): the health
policy decides there, so a failed probe makes the GPU unhealthy in its state and twins within that one step.

**Recovery** (``health.recovery``): when a GPU turns unhealthy with a fault a reset can clear (level 1 with way
back ``reset``, or a failed probe), the flow runs once per episode: ``start``; ``self-check`` (a probe, the driver
checks, ``nvidia-smi -q`` / ``dcgmi diag -r 1`` where present); then, only if the self-check did not pass, the
config has ``allowReset`` and no process runs on the GPU, ``reset`` (``nvidia-smi -r``), ``reapply`` (every
desired setting again) and ``verify`` (probe again); ``done`` with the outcome. A fault that needs a reboot ends at
``reboot-required``. Every step is a ``PolicyEvent`` of policy ``recovery`` (published on MQTT, logged); in dry
run the flow says ``would-reset`` instead of resetting.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from mapper.clock import Clock, sleep_or_wake
from mapper.edge.control.collect import GpuWorker, call_backend, call_in_thread
from mapper.edge.control.policy import PolicyConfig, PolicyEngine, PolicyEvent
from mapper.edge.health.checks import CheckResult, HealthTools, ProbeResult
from mapper.edge.health.driverhost import host_checks
from mapper.errors import GpuLostError, MapperError
from mapper.shared.model import GpuEvent, format_number, twin_safe

__all__ = ["RECOVERY", "DriverCheckSource", "HealthMonitor"]

log = logging.getLogger("mapper.edge.health.checks")

RECOVERY = "recovery"
#: Failing level-2 checks a GPU reset cannot mend, and what does: a kernel module that is not NVML's, or missing
#: device nodes, need the driver reloaded (or a reboot); a corrupted InfoROM needs NVIDIA's support (an RMA).
NOT_MENDED_BY_RESET = {"driver-version": "driver-reload", "device-nodes": "driver-reload", "inforom": "support"}
#: After an XID/ECC event, the probe runs at most this soon after the previous one (an ECC storm is one probe).
REQUEST_DEBOUNCE_S = 5.0
#: Extra wait beyond the probe's timeout before the loop gives up on the probe thread.
PROBE_MARGIN_S = 5.0
TOOLS_TIMEOUT_S = 120.0
RESET_TIMEOUT_S = 60.0


class DriverCheckSource(Protocol):
    """What the loop needs from the GPU backend (``NvmlBackend``)."""

    def driver_checks(self, uuid: str, deadline_s: float) -> tuple[CheckResult, ...]: ...
    def driver_version(self) -> str: ...
    def gpu_reset(self, uuid: str) -> None: ...


@dataclass
class _GpuHealth:
    next_check_s: float = 0.0
    next_probe_s: float = 0.0
    last_probe_s: float | None = None
    #: A requested probe (after an XID/ECC event) that could not run (busy, lost) waits until then.
    request_after_s: float = 0.0
    #: The fault the recovery flow last ran for ("" when none, or since the GPU was healthy again).
    recovered_for: str = ""
    probes: dict[str, int] = field(default_factory=dict)


class HealthMonitor:
    """``run()`` forever. ``emit(worker, events)`` publishes the recovery's events (MQTT and counters)."""

    def __init__(
        self,
        workers: Mapping[str, GpuWorker],
        policies: PolicyEngine,
        backend: DriverCheckSource,
        tools: HealthTools,
        *,
        clock: Clock,
        emit: Callable[[GpuWorker, Sequence[PolicyEvent]], None] | None = None,
        beat: Callable[[str, float], None] | None = None,
        processes: Callable[[str], int] | None = None,
    ) -> None:
        self.workers = workers
        self.policies = policies
        self.backend = backend
        self.tools = tools
        self.clock = clock
        self.emit = emit
        self.beat = beat
        #: Running processes of a GPU (blocking; the recovery's "no process runs" test). None: not known.
        self.processes = processes
        self.wake = asyncio.Event()
        self._gpus: dict[str, _GpuHealth] = {}
        self._driver_version = ""
        #: Recoveries running now, by UUID.
        self._recovering: dict[str, asyncio.Task[None]] = {}

    def attach(self) -> None:
        """Let each worker wake this loop on an XID or ECC event."""
        for worker in self.workers.values():
            worker.on_fault = self.wake.set

    def probe_counts(self, uuid: str) -> dict[str, int]:
        gpu = self._gpus.get(uuid)
        return dict(gpu.probes) if gpu is not None else {}

    def _gpu(self, uuid: str) -> _GpuHealth:
        gpu = self._gpus.get(uuid)
        if gpu is None:
            gpu = self._gpus[uuid] = _GpuHealth()
        return gpu

    async def run(self) -> None:
        self.attach()
        while True:
            self.wake.clear()
            await self.run_once()
            delay_s = max(0.0, self.next_due_s() - self.clock.monotonic())
            if self.beat is not None:
                self.beat("health", max(1.0, delay_s))
            await sleep_or_wake(self.wake, delay_s)

    def next_due_s(self) -> float:
        now = self.clock.monotonic()
        due = [now + 3600.0]
        for uuid, worker in self.workers.items():
            cfg = self.policies.config_for(uuid).health
            if not cfg.enabled:
                continue
            gpu = self._gpu(uuid)
            if cfg.checks.enabled:
                due.append(gpu.next_check_s)
            if cfg.probe.enabled:
                due.append(gpu.next_probe_s if not worker.probe_requested else self._requested_at(gpu))
        return min(due)

    @staticmethod
    def _requested_at(gpu: _GpuHealth) -> float:
        debounced = gpu.last_probe_s + REQUEST_DEBOUNCE_S if gpu.last_probe_s is not None else 0.0
        return max(debounced, gpu.request_after_s)

    async def run_once(self) -> None:
        """Everything due now: checks, probes (concurrently across GPUs), recoveries to start."""
        now = self.clock.monotonic()
        jobs = []
        for uuid, worker in self.workers.items():
            config = self.policies.config_for(uuid)
            cfg = config.health
            if not cfg.enabled:
                continue
            gpu = self._gpu(uuid)
            if cfg.checks.enabled and gpu.next_check_s <= now:
                gpu.next_check_s = now + cfg.checks.interval_s
                jobs.append(self._check(worker, config))
            requested = worker.probe_requested and self._requested_at(gpu) <= now
            if cfg.probe.enabled and (gpu.next_probe_s <= now or requested) and uuid not in self._recovering:
                jobs.append(self._scheduled_probe(worker, config))
        if jobs:
            await asyncio.gather(*jobs)
        for worker in self.workers.values():
            self._maybe_recover(worker)

    # --- level 2 -----------------------------------------------------------------------------------
    async def _check(self, worker: GpuWorker, config: PolicyConfig) -> None:
        checks = await self.run_checks(worker, config)
        if checks is not None:
            worker.pending_checks = checks
            worker.wake()

    async def run_checks(self, worker: GpuWorker, config: PolicyConfig) -> tuple[CheckResult, ...] | None:
        """The level-2 checks of one GPU now; None when the GPU is lost (level 1 says so already)."""
        cfg = config.health.checks
        if worker.lost:
            return None
        try:
            nvml = await call_backend(
                self.backend,
                self.backend.driver_checks,
                worker.uuid,
                cfg.nvml_deadline_s,
                timeout_s=max(10.0, 5 * cfg.nvml_deadline_s),
            )
        except GpuLostError:
            return None
        except MapperError as exc:
            reason = "nvml-timeout" if "longer than" in str(exc) or "timed out" in str(exc) else "nvml-error"
            log.warning("GPU %s: level-2 NVML checks failed: %s", worker.uuid, exc)
            nvml = (CheckResult("nvml-responsive", "unhealthy", reason, "driver", (("error", twin_safe(str(exc))),)),)
        driver = next((v for c in nvml for k, v in c.detail if k == "driver_version"), "") or self._driver_version
        if driver:
            self._driver_version = driver
        host = await call_in_thread(
            functools.partial(
                host_checks,
                Path(self.tools.host_root),
                nvml_driver_version=driver,
                gpu_count=len(self.workers),
                persistence=cfg.persistence,
            ),
            timeout_s=10.0,
        )
        return (*nvml, *host)

    # --- level 3 -----------------------------------------------------------------------------------
    async def _scheduled_probe(self, worker: GpuWorker, config: PolicyConfig) -> None:
        cfg = config.health.probe
        gpu = self._gpu(worker.uuid)
        now = self.clock.monotonic()
        util = worker.values.get("utilization_gpu")
        if worker.lost:
            gpu.next_probe_s = gpu.request_after_s = now + cfg.retry_interval_s
            return
        if isinstance(util, int | float) and not isinstance(util, bool) and util > cfg.skip_above_pct:
            result = ProbeResult("skipped", f"busy-{format_number(round(float(util)))}pct", None, now)
            self._count(gpu, result)
            gpu.next_probe_s = gpu.request_after_s = now + cfg.retry_interval_s
            worker.pending_probe = result
            worker.wake()
            return
        worker.probe_requested = False
        result = await self.run_probe(worker, config)
        worker.pending_probe = result
        worker.wake()

    async def run_probe(self, worker: GpuWorker, config: PolicyConfig) -> ProbeResult:
        """One probe of ``worker``'s GPU now (busy or not), classified (``slow``), counted, rescheduled."""
        cfg = config.health.probe
        gpu = self._gpu(worker.uuid)
        try:
            raw: ProbeResult = await call_in_thread(
                self.tools.probe.probe,
                worker.uuid,
                worker.info.pci_bus_id,
                cfg.timeout_s,
                timeout_s=cfg.timeout_s + PROBE_MARGIN_S,
            )
        except TimeoutError:
            raw = ProbeResult("timeout", f"after-{format_number(cfg.timeout_s)}s", cfg.timeout_s)
        now = self.clock.monotonic()
        result = ProbeResult(raw.outcome, raw.reason, raw.latency_s, now)
        if raw.outcome == "pass" and raw.latency_s is not None and raw.latency_s > cfg.slow_above_s:
            result = ProbeResult("slow", f"above-{format_number(cfg.slow_above_s)}s", raw.latency_s, now)
        if not result.passed:
            log.warning("GPU %s: the CUDA probe failed: %s", worker.uuid, result.twin_text())
        self._count(gpu, result)
        gpu.last_probe_s = now
        # (a skipped probe, e.g. no libcuda in the container, waits a whole interval: no verdict either way)
        healthy = result.outcome in ("pass", "skipped") and worker.health.status == "healthy"
        gpu.next_probe_s = now + (cfg.interval_s if healthy else cfg.retry_interval_s)
        return result

    @staticmethod
    def _count(gpu: _GpuHealth, result: ProbeResult) -> None:
        gpu.probes[result.outcome] = gpu.probes.get(result.outcome, 0) + 1

    # --- recovery ----------------------------------------------------------------------------------
    def _maybe_recover(self, worker: GpuWorker) -> None:
        config = self.policies.config_for(worker.uuid)
        gpu = self._gpu(worker.uuid)
        report = worker.health
        if report.status != "unhealthy":
            gpu.recovered_for = ""
            return
        fault = f"level{report.level}-{report.reason}"
        if (
            not config.health.recovery.enabled
            or worker.lost
            or gpu.recovered_for == fault
            or worker.uuid in self._recovering
        ):
            return
        gpu.recovered_for = fault
        task = asyncio.get_running_loop().create_task(self.recover(worker))
        self._recovering[worker.uuid] = task
        uuid = worker.uuid

        def finished(_task: asyncio.Task[None]) -> None:
            self._recovering.pop(uuid, None)

        task.add_done_callback(finished)

    def recovering(self, uuid: str) -> asyncio.Task[None] | None:
        return self._recovering.get(uuid)

    async def recover(self, worker: GpuWorker) -> None:
        """The recovery flow for one unhealthy GPU (the module's docstring). Never raises but for cancellation."""
        try:
            await self._recover(worker)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the flow's own bug: logged with its traceback, the GPU stays as it is
            log.exception("GPU %s: the recovery flow failed", worker.uuid)
            self._event(worker, "failed", f"error-{type(exc).__name__}")

    async def _process_count(self, worker: GpuWorker) -> int | None:
        if self.processes is None:
            return None
        try:
            count: int = await call_in_thread(self.processes, worker.uuid, timeout_s=15.0)
        except (MapperError, TimeoutError) as exc:
            log.warning("GPU %s: listing its processes before a reset failed: %s", worker.uuid, exc)
            return None
        return count

    def _event(self, worker: GpuWorker, action: str, reason: str) -> None:
        config = self.policies.config_for(worker.uuid)
        event = PolicyEvent(
            policy=RECOVERY,
            action=action,
            reason=twin_safe(reason)[:200],
            uuid=worker.uuid,
            ts_s=self.clock.monotonic(),
            dry_run=config.dry_run,
        )
        if self.emit is not None:
            self.emit(worker, (event,))  # published and logged there
            return
        dry = " (dry run)" if event.dry_run else ""
        log.warning("GPU %s: recovery %s: %s%s", worker.uuid, action, event.reason, dry)

    async def _recover(self, worker: GpuWorker) -> None:
        config = self.policies.config_for(worker.uuid)
        report = worker.health
        state = self.policies.state(worker.uuid).health
        self._event(worker, "start", f"level{report.level}-{report.reason}")
        # The self-check: a probe now, the driver checks, the tools.
        probe = await self.run_probe(worker, config)
        worker.pending_probe = probe
        checks = await self.run_checks(worker, config)
        if checks is not None:
            worker.pending_checks = checks
        worker.wake()
        tools = []
        if config.health.recovery.self_check_tools:
            tools = await call_in_thread(
                self.tools.tools.self_check, worker.uuid, TOOLS_TIMEOUT_S, timeout_s=TOOLS_TIMEOUT_S + 5
            )
        failed_checks = [c for c in checks or () if c.status == "unhealthy"]
        failed_tools = [t for t in tools if not t.passed]
        parts = [f"probe-{probe.outcome}"]
        parts += [f"{c.name}-{c.reason}" for c in failed_checks]
        parts += [f"{t.tool}-{'ok' if t.passed else t.reason}" for t in tools]
        self._event(worker, "self-check", ",".join(parts))
        if state.status == "unhealthy" and state.recovery == "reboot":
            self._event(worker, "reboot-required", state.cause)
            return
        mendable = [c for c in failed_checks if c.name not in NOT_MENDED_BY_RESET]
        needs_reset = (
            probe.status == "unhealthy"
            or bool(mendable)
            or bool(failed_tools)
            or (state.status == "unhealthy" and state.recovery == "reset")
        )
        unmendable = [c for c in failed_checks if c.name in NOT_MENDED_BY_RESET]
        if unmendable and not needs_reset:
            c = unmendable[0]
            self._event(worker, "done", f"{c.name}-{c.reason}-needs-{NOT_MENDED_BY_RESET[c.name]}")
            return
        if not needs_reset:
            self._event(worker, "done", "self-check-passed-no-reset-needed")
            return
        if not config.health.recovery.allow_reset:
            self._event(worker, "done", "reset-needed-not-allowed")
            return
        running = await self._process_count(worker)
        if running is None:
            self._event(worker, "done", "reset-needed-processes-unknown")
            return
        if running:
            self._event(worker, "done", f"reset-needed-{running}-processes-running")
            return
        if config.dry_run:
            self._event(worker, "would-reset", "nvidia-smi-r")
            return
        try:
            await call_in_thread(self.tools.tools.reset, worker.uuid, RESET_TIMEOUT_S, timeout_s=RESET_TIMEOUT_S + 5)
        except (MapperError, TimeoutError) as exc:
            self._event(worker, "done", f"reset-failed-{exc}")
            return
        self._event(worker, "reset", "nvidia-smi-r")
        try:
            await call_backend(self.backend, self.backend.gpu_reset, worker.uuid, timeout_s=10.0)
        except MapperError as exc:  # the backend then finds the reset itself (the energy counter went back)
            log.warning("GPU %s: telling the NVML backend about the reset failed: %s", worker.uuid, exc)
        # The reset took every setting: the next step re-applies the desired state, and the policy sees a reset.
        worker.pending_events.append(GpuEvent(worker.uuid, self.clock.wall_ms(), "driver_reload", detail="gpu-reset"))
        worker.driver_reloaded()
        self._event(worker, "reapply", "desired-state")
        verify = await self.run_probe(worker, config)
        worker.pending_probe = verify
        worker.wake()
        self._event(worker, "verify", f"probe-{verify.outcome}")
        if verify.status is None:
            outcome = f"reset-done-probe-skipped-{verify.reason}"
        else:
            outcome = "still-failing-after-reset" if verify.status == "unhealthy" else "recovered"
        self._event(worker, "done", outcome)
