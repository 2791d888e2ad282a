"""The per-GPU loop body: sample what is due, let the policies decide, reconcile the desired state.

One ``GpuWorker`` per GPU of the node (by UUID), whether or not a KubeEdge Device is bound to it (an unbound
GPU is still sampled for metrics and telemetry, as ``_unbound/<uuid>``, but has no twins and no desired state).
The ``Collector`` runs every GPU's step on each due time and whenever a desired value arrives (``wake``), and
hands what happened (``TickResult``) to the consumers it was built with: the telemetry stream, the publisher,
the bindings, the reporter. It sees only domain types and Protocols.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from mapper.clock import Clock, next_on_grid, sleep_or_wake
from mapper.edge.control.desired import DesiredState, DesiredValue
from mapper.edge.control.policy import Decision, PolicyContext, PolicyEngine
from mapper.edge.control.reconcile import Reconciler, ReconcileResult, with_config_error
from mapper.edge.health.checks import HEALTHY_REPORT, CheckResult, HealthReport, ProbeResult
from mapper.errors import GpuLostError, MapperError, TransientError
from mapper.shared.model import (
    BACKEND_PROPERTIES,
    PROPERTY_BY_NAME,
    Constraints,
    DeviceConfig,
    GpuBackend,
    GpuEvent,
    GpuInfo,
    Sample,
    Value,
)

log = logging.getLogger(__name__)

#: Properties due within this many seconds of a tick are sampled in that tick.
DUE_SLACK_S = 0.05
#: NVML's events (XID, ECC, GPU lost, driver reload) are polled this often, in the collector's NVML job.
EVENTS_POLL_S = 1.0


def unbound_device(info: GpuInfo) -> DeviceConfig:
    """The telemetry identity of a GPU no Device names: ``_unbound/<uuid>``."""
    return DeviceConfig(namespace="_unbound", name=info.uuid.lower(), model="", uuid=info.uuid)


@dataclass
class TickResult:
    sample: Sample | None = None
    decision: Decision | None = None
    reconcile: ReconcileResult | None = None
    state_changed: bool = False
    error: str = ""
    #: The step raised an exception it does not expect (a bug, not an NVML error): see ``GpuWorker.step_failed``.
    step_failed: bool = False


class TickStart(NamedTuple):
    """What ``GpuWorker.begin`` found due, handed to ``finish`` with the sample of ``names``. (A NamedTuple: one
    is made per GPU per cycle, and a frozen dataclass costs several times as much to build.)"""

    now_s: float
    groups: list[int]
    names: tuple[str, ...]
    #: The due-time list the groups index (a ``bind`` meanwhile replaces it: then nothing is rescheduled).
    due_at: list[float]
    #: The device state before the step (``TickResult.state_changed`` compares with it).
    state: str


@dataclass
class GpuWorker:
    """Everything the mapper knows about one GPU, and the step that moves it forward."""

    info: GpuInfo
    backend: GpuBackend
    reconciler: Reconciler
    policies: PolicyEngine
    clock: Clock
    #: Floor for any collect cycle (ms); a Device asking for faster collection is raised to it.
    min_collect_cycle_ms: int = 1000
    call_timeout_s: float = 10.0
    device: DeviceConfig | None = None
    desired: DesiredState = field(default_factory=DesiredState)
    values: dict[str, Value] = field(default_factory=dict)
    values_ts_ms: int = 0
    constraints: Constraints = field(default_factory=Constraints)
    #: ok | online | unhealthy | offline (mapper.shared.model.DEVICE_STATES)
    state: str = "online"
    #: The reconciler's ``desired_status`` twin (``desired_status`` adds the refused configuration to it).
    reconciled_status: str = ""
    #: Why the latest version of this GPU's Device was refused ("" when it was not): set by the bindings.
    config_error: str = ""
    policy_state: str = "normal"
    #: The ``push_status`` twin: each push and DB method of the bound Device and its state ("" when it names none;
    #: set by the push router, ``mapper.edge.push.router``).
    push_status: str = ""
    statuses: dict[str, str] = field(default_factory=dict)
    #: A step has finished with values since the last ``bind``: its twins are whole (``desired_status`` and
    #: ``policy_state`` set for this Device, not only the sample). The reporter waits for it; a step is read by
    #: it between its awaits.
    stepped: bool = False
    #: Properties this GPU cannot read: asked for and absent from the sample without an error (NVML answers
    #: NotSupported). One that is read again later (a driver upgrade; the backend asks again every few minutes)
    #: leaves the set.
    unsupported: set[str] = field(default_factory=set)
    pending_events: list[GpuEvent] = field(default_factory=list)
    lost: bool = False
    last_tick_s: float = 0.0
    collect_errors: int = 0
    #: Steps in a row that raised an unexpected exception (0 once one works again), and all of them.
    failing_steps: int = 0
    failed_steps: int = 0
    #: The backend's properties (its family's: ``GpuInfo.family``) grouped by collect cycle for the bound Device:
    #: (cycle s, names), built on first use, dropped by ``bind``. Properties sharing a cycle are sampled together,
    #: so a tick handles a few groups.
    _schedule: list[tuple[float, tuple[str, ...]]] | None = None
    #: Next due time (monotonic s) per schedule group; empty: everything is due now.
    _due_at: list[float] = field(default_factory=list)
    #: The property names of each combination of groups due together (one tuple object per combination).
    _names: dict[tuple[int, ...], tuple[str, ...]] = field(default_factory=dict)
    #: The reconciler holds the GPU's constraints (read once; again after a driver reload or a lost GPU).
    _constraints_known: bool = False
    #: Set by ``wake``, cleared by ``begin``: the next round runs this GPU's step even if nothing is due.
    _woken: bool = False
    #: Called by ``wake`` (the composition root's collector loop, which ticks every GPU in one task).
    notify: Callable[[], None] | None = None
    #: The policies' context of the last step without events, used again while its inputs are the same.
    _context: PolicyContext | None = None
    # --- health (levels 2 and 3 come from ``mapper.edge.control.healthloop``; the policies decide) ---
    #: A probe result / a run of the driver checks waiting for the next step.
    pending_probe: ProbeResult | None = None
    pending_checks: tuple[CheckResult, ...] | None = None
    #: The three levels after the last step (the ``health`` twin), and the last probe (``health_probe``).
    health: HealthReport = HEALTHY_REPORT
    last_probe: ProbeResult | None = None
    #: An XID or ECC event reached this GPU: the health loop probes it soon. ``on_fault`` wakes that loop.
    probe_requested: bool = False
    on_fault: Callable[[], None] | None = None

    @property
    def uuid(self) -> str:
        return self.info.uuid

    @property
    def desired_status(self) -> str:
        """The ``desired_status`` twin: the reconciler's, with ``config:refused-<reason>`` while the latest
        version of the Device's configuration stands refused (``mapper.edge.control.reconcile.with_config_error``)."""
        return with_config_error(self.reconciled_status, self.config_error)

    @property
    def device_key(self) -> str:
        """The bound Device's key, else the GPU's unbound identity (``_unbound/<uuid>``): where its acks, policy
        events and telemetry go."""
        return self.device.key if self.device is not None else unbound_device(self.info).key

    # --- schedule ----------------------------------------------------------------------------------
    def cycle_ms(self, name: str) -> int:
        spec = PROPERTY_BY_NAME[name]
        prop = self.device.property(name) if self.device is not None else None
        wanted = prop.collect_cycle_ms if prop is not None and prop.collect_cycle_ms > 0 else spec.collect_cycle_ms
        if prop is not None and prop.report_cycle_ms > 0 and (prop.push is not None or prop.db is not None):
            # A property pushed every report cycle (pushMethod http, otel, dbMethod) is read at least that often:
            # each push carries a sample of its own time, as the framework's fresh read per report does.
            wanted = min(wanted, prop.report_cycle_ms)
        return max(wanted, self.min_collect_cycle_ms)

    def _groups(self) -> list[tuple[float, tuple[str, ...]]]:
        if self._schedule is None:
            by_cycle: dict[float, list[str]] = {}
            for spec in BACKEND_PROPERTIES.get(self.info.family, BACKEND_PROPERTIES["nvml"]):
                by_cycle.setdefault(self.cycle_ms(spec.name) / 1000, []).append(spec.name)
            self._schedule = sorted((cycle_s, tuple(names)) for cycle_s, names in by_cycle.items())
            self._names = {}
            self._due_at = []
        if not self._due_at:
            self._due_at = [-1.0] * len(self._schedule)
        return self._schedule

    def driver_reloaded(self) -> None:
        """The driver was reloaded (or the GPU reset): settings are gone, re-read everything."""
        self.reconciler.invalidate()
        self._constraints_known = False
        self._due_at = []
        self.wake()

    def _due_groups(self, now_s: float) -> list[int]:
        # Timers may fire a hair early, and cycles drift apart: what falls due within DUE_SLACK_S is read now,
        # in the same NVML round, instead of waking the loop again a few milliseconds later.
        self._groups()
        horizon_s = now_s + DUE_SLACK_S
        return [i for i, at in enumerate(self._due_at) if at <= horizon_s]

    def due_properties(self, now_s: float) -> tuple[str, ...]:
        """The NVML properties to sample at ``now_s`` (the same tuple object while the same groups are due)."""
        return self._names_of(self._due_groups(now_s))

    def _names_of(self, groups: list[int]) -> tuple[str, ...]:
        schedule = self._groups()
        key = tuple(groups)
        names = self._names.get(key)
        if names is None:
            names = self._names[key] = tuple(name for i in groups for name in schedule[i][1])
        return names

    def _reschedule(self, groups: list[int], now_s: float, retry_s: float | None = None) -> None:
        """Due times on a grid of each cycle (multiples of it on the monotonic clock): every GPU's groups with
        the same cycle fall due at the same instant, so the loops wake together and their NVML reads go to the
        worker as one job. A late tick skips to the next grid point rather than catching up in a burst. After
        an error the retry comes after ``retry_s`` (at most a cycle), off the grid until it succeeds.

        The next due time is the first grid point beyond the slack: counted from ``now_s``, not from the last due
        time, so a read after a retry (or the first read) lands back on the grid, and a tick that ran within the
        slack of a grid point (it read that point's values) is not due again a few milliseconds later."""
        schedule = self._groups()
        for i in groups:
            cycle_s = schedule[i][0]
            if retry_s is not None:
                self._due_at[i] = now_s + min(retry_s, cycle_s)
                continue
            # (next_on_grid counts half a cycle of slack at most: a cycle shorter than the slack is not skipped.)
            self._due_at[i] = next_on_grid(now_s, cycle_s, DUE_SLACK_S)

    def next_due_s(self) -> float:
        if not self._due_at:
            return self.clock.monotonic()
        return min(self._due_at)

    def bind(self, device: DeviceConfig | None) -> None:
        """Attach (or detach) the Device. New cycles apply from now: everything is due at once."""
        self.device = device
        self._schedule = None
        self._due_at = []
        self.stepped = False  # the twins of a new binding wait for a whole step with it
        self.wake()

    def wake(self) -> None:
        self._woken = True
        if self.notify is not None:
            self.notify()

    def is_due(self, now_s: float) -> bool:
        """Whether a tick at ``now_s`` has work: a property group due (within the slack) or a ``wake``."""
        return self._woken or self.next_due_s() <= now_s + DUE_SLACK_S

    # --- the step ----------------------------------------------------------------------------------
    async def tick(self) -> TickResult:
        """One step: sample what is due, then ``finish``. (The app's collector runs ``begin``, one NVML job for
        every due GPU's sample, and ``finish`` per GPU: the same step, one task and one thread hop for all.)"""
        start = self.begin()
        outcome: Sample | MapperError | None = None
        if start.names:
            try:
                outcome = await self._call(self.backend.sample, self.uuid, start.names)
            except MapperError as exc:
                outcome = exc
        return await self.finish(start, outcome)

    def begin(self) -> TickStart:
        """The start of a step: what is due now (``names``: sample these, or nothing). Clears a ``wake``."""
        now_s = self.clock.monotonic()
        self.last_tick_s = now_s
        self._woken = False
        groups = self._due_groups(now_s)
        names = self._names_of(groups) if groups else ()
        return TickStart(now_s, groups, names, self._due_at, self.state)

    async def finish(self, start: TickStart, outcome: Sample | MapperError | None) -> TickResult:
        """The rest of a step, given the sample of ``start.names`` (or the error reading it; None when nothing
        was due): the GPU's values, the policies' decision, the reconciler's step. Awaits NVML only when the
        constraints are not known yet or the reconciler has something to set.

        Never raises (but for a cancellation): an exception the step does not expect is this GPU's alone. It is
        logged and counted, the GPU reports ``unhealthy`` and its due properties are tried again on the next grid
        point; the other GPUs' steps, and the process, go on."""
        try:
            result = await self._finish(start, outcome)
        except Exception as exc:
            self.step_failed("its step", exc)
            if self._due_at is start.due_at and start.groups:
                self._reschedule(start.groups, start.now_s)
            return TickResult(
                error=f"step failed: {exc!r}"[:200], step_failed=True, state_changed=self.state != start.state
            )
        if self.failing_steps:
            log.warning("GPU %s: its step works again after %d failed step(s)", self.uuid, self.failing_steps)
            self.failing_steps = 0
        return result

    def step_failed(self, what: str, exc: BaseException) -> None:
        """An unexpected exception in this GPU's step (``what`` failed): the traceback is logged for the first
        failure in a row and every 100th after it, the GPU is ``unhealthy`` until a step works again."""
        self.failing_steps += 1
        self.failed_steps += 1
        self.state = "unhealthy"
        if self.failing_steps % 100 == 1:
            log.error(
                "GPU %s: %s failed (%d in a row); the other GPUs go on",
                self.uuid,
                what,
                self.failing_steps,
                exc_info=exc,
            )

    async def _finish(self, start: TickStart, outcome: Sample | MapperError | None) -> TickResult:
        now_s, due_groups, due_at = start.now_s, start.groups, start.due_at
        result = TickResult()
        if isinstance(outcome, GpuLostError):
            self._lost(str(outcome))
            result.error = str(outcome)
            if self._due_at is due_at:
                self._reschedule(due_groups, now_s)
        elif isinstance(outcome, MapperError):
            self.collect_errors += 1
            result.error = str(outcome)
            log.warning("sampling GPU %s failed: %s", self.uuid, outcome)
            retry_s = outcome.retry_after_s if isinstance(outcome, TransientError) else 5.0
            if self._due_at is due_at:
                self._reschedule(due_groups, now_s, retry_s)
        elif outcome is not None:
            sample = outcome
            if self.lost:
                log.warning("GPU %s answers again", self.uuid)
                self._constraints_known = False
            self.lost = False
            self.values.update(sample.values)
            self.values_ts_ms = sample.ts_ms
            result.sample = sample
            if self.unsupported:
                self.unsupported.difference_update(sample.values)
            if len(sample.values) + len(sample.errors) < len(start.names):  # (the usual step skips this)
                self.unsupported.update(n for n in start.names if n not in sample.values and n not in sample.errors)
            # A ``bind`` or ``driver_reloaded`` while the sample was read made everything due (and ``bind``
            # may have made other groups, which ``due_groups`` does not index): keep it so.
            if self._due_at is due_at:
                self._reschedule(due_groups, now_s)
        if not self.lost and not self._constraints_known:
            # The reconciler caches them: one thread hop until they are known, none per cycle after that.
            try:
                self.constraints = await self._call(self.reconciler.constraints)
            except MapperError as exc:
                log.warning("reading the constraints of GPU %s failed: %s", self.uuid, exc)
            else:
                self._constraints_known = self.constraints != Constraints()
        # Not a copy: the reconciler copies what it keeps, and a step run on the NVML thread gets its own (below).
        observed = Sample(self.uuid, self.values_ts_ms or self.clock.wall_ms(), self.values)

        events = self.pending_events
        if events:
            self.pending_events = []
            if any(e.kind in ("xid", "ecc_single", "ecc_double") for e in events):
                self.probe_requested = True
                if self.on_fault is not None:
                    self.on_fault()
        probe, checks = self.pending_probe, self.pending_checks
        if probe is not None or checks is not None:
            self.pending_probe = self.pending_checks = None
            if probe is not None:
                self.last_probe = probe
        effective = self.desired.effective()
        desired_w = _power_limit_w(effective)
        desired_mhz = _clock_max_mhz(effective)
        ctx = self._context
        if (
            events
            or probe is not None
            or checks is not None
            or ctx is None
            or ctx.constraints is not self.constraints
            or ctx.desired_power_limit_w != desired_w
            or ctx.desired_clock_max_mhz != desired_mhz
            or ctx.gpu_lost != self.lost
        ):
            ctx = PolicyContext(
                constraints=self.constraints,
                desired_power_limit_w=desired_w,
                desired_clock_max_mhz=desired_mhz,
                events=tuple(events),
                gpu_lost=self.lost,
                uuid=self.uuid,
                probe=probe,
                checks=checks,
            )
            # Kept for the next step unless it carries events or health results (those are for this step only).
            self._context = None if events or probe is not None or checks is not None else ctx
        decision = self.policies.decide(self.uuid, self.values, ctx, now_s)
        result.decision = decision
        health = self.policies.health(self.uuid)
        if health is not self.health:
            self.health = health
            if health.status == "unhealthy" and self.on_fault is not None:
                self.on_fault()  # the health loop starts the recovery flow
        self.policy_state = decision.policy_state
        self.state = "offline" if self.lost else ("unhealthy" if decision.device_state == "unhealthy" else "online")

        if not self.lost and self.values:
            restore = self.desired.pending_restore()
            limits = decision.limits
            try:
                planned = self.reconciler.prepare(effective, observed, limits, restore=restore)
                if planned is None or planned.actions:
                    snapshot = Sample(observed.uuid, observed.ts_ms, dict(self.values))
                    rec: ReconcileResult = await self._call(
                        lambda: self.reconciler.step(effective, snapshot, limits, restore=restore, planned=planned)
                    )
                else:
                    # Nothing to set: the step only compares and keeps its books, no NVML call, no thread hop.
                    rec = self.reconciler.step(effective, observed, limits, restore=restore, planned=planned)
            except MapperError as exc:
                log.warning("reconciling GPU %s failed: %s", self.uuid, exc)
            else:
                result.reconcile = rec
                for prop in rec.restored:
                    self.desired.mark_restored(prop)
                self.statuses = {prop: status.text for prop, status in rec.statuses.items()} if rec.statuses else {}
                self.reconciled_status = rec.desired_status
                if rec.observed is not self.values:  # (an idle step hands back the values it was given)
                    self.values.update(rec.observed)
        result.state_changed = self.state != start.state
        if self.values:
            self.stepped = True
        return result

    def _lost(self, message: str) -> None:
        if not self.lost:
            log.error("GPU %s is lost: %s", self.uuid, message)
        self.lost = True

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await call_backend(self.backend, fn, *args, timeout_s=self.call_timeout_s, what=f"GPU {self.uuid}: ")


async def call_backend(backend: object, fn: Callable[..., Any], *args: Any, timeout_s: float, what: str = "") -> Any:
    """``fn(*args)`` off the event loop. A backend with its own worker thread (``NvmlBackend.call_async``) runs
    its own methods there directly: one thread wake-up per call instead of two (default executor, then that
    worker), and its own timeouts apply. Anything else runs in the default executor, bounded by ``timeout_s``
    (``TransientError`` after it)."""
    call_async = getattr(backend, "call_async", None)
    if call_async is not None and getattr(fn, "__self__", None) is backend:
        return await call_async(fn, *args)
    try:
        return await call_in_thread(fn, *args, timeout_s=timeout_s)
    except TimeoutError:
        raise TransientError(f"{what}{getattr(fn, '__name__', 'call')} took longer than {timeout_s}s") from None


def _power_limit_w(desired: Mapping[str, DesiredValue]) -> float | None:
    """The valid desired power limit in W, or None."""
    d = desired.get("power_limit")
    if d is None or not d.valid or d.value is None:
        return None
    return float(d.value)


def _clock_max_mhz(desired: Mapping[str, DesiredValue]) -> float | None:
    """The valid desired upper locked GPU clock (a Jetson: ``gpu_max_freq``) in MHz (0: unlocked), or None."""
    d = desired.get("gpu_max_freq")
    if d is None:
        d = desired.get("locked_gpu_clock_max")
    if d is None or not d.valid or d.value is None or isinstance(d.value, str | bool):
        return None
    return float(d.value) or None


async def call_in_thread(fn: Callable[..., Any], *args: Any, timeout_s: float) -> Any:
    """``fn(*args)`` in the default executor; ``TimeoutError`` after ``timeout_s`` (the call runs on).

    Unlike ``asyncio.wait_for`` on Python 3.11 it never swallows a cancellation that arrives together with the
    result, so a loop cancelled at shutdown stops; and it needs no task per call."""
    future = asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args))
    try:
        done, _ = await asyncio.wait((future,), timeout=timeout_s)
    except asyncio.CancelledError:
        future.cancel()
        raise
    if not done:
        future.cancel()
        raise TimeoutError(f"{getattr(fn, '__name__', 'call')} took longer than {timeout_s}s")
    return future.result()


def worker_sample(worker: GpuWorker) -> Sample:
    """The worker's latest values with the mapper's own status twins, as one Sample."""
    values = dict(worker.values)
    values["desired_status"] = worker.desired_status
    values["policy_state"] = worker.policy_state
    values["health"] = worker.health.twin_text()
    if worker.last_probe is not None:
        values["health_probe"] = worker.last_probe.twin_text()
    return Sample(worker.uuid, worker.values_ts_ms, {k: v for k, v in values.items() if v != ""})


class RoundLike(Protocol):
    """What ``RoundBackend.sample_many`` returns (``mapper.edge.gpu.nvml.SampleRound``)."""

    @property
    def samples(self) -> Sequence[Sample | MapperError]: ...
    @property
    def events(self) -> Sequence[GpuEvent]: ...
    @property
    def events_error(self) -> MapperError | None: ...

    # (``NvmlBackend``'s rounds also carry ``started_s``: per request, when its read began; see ``tick_all``)


class RoundBackend(Protocol):
    """The one backend call the collector makes per round (``NvmlBackend.sample_many``)."""

    def sample_many(self, requests: Sequence[tuple[str, Sequence[str]]], events: bool = False) -> RoundLike: ...


class StepConsumer(Protocol):
    """One of the parts a ``Collector`` hands each GPU's finished step to (the telemetry stream, the publisher,
    the bindings, the reporter). Never blocking; an exception is that GPU's failed step, not the round's."""

    def after_step(self, worker: GpuWorker, result: TickResult) -> None: ...


@dataclass
class CollectCounts:
    """What the collector counts, read by the snapshot (``mapper.edge.status.source``): failed steps by reason
    (``gpu-lost``, ``step-failed``, ``error``) and the XIDs seen per GPU (uuid -> {xid: count}). Made apart from
    the collector so that the snapshot can be built before it (the reporter it hands steps to reads the
    snapshot's state messages)."""

    errors: dict[str, int] = field(default_factory=dict)
    xids: dict[str, dict[int, int]] = field(default_factory=dict)


class _FailedRound(NamedTuple):
    samples: list[Sample | MapperError]
    events: list[GpuEvent]
    events_error: MapperError | None
    started_s: tuple[float, ...] = ()


class Collector:
    """Every GPU in one task: at each due time (the collect cycles lie on a shared grid, see
    ``GpuWorker._reschedule``) or ``wake``, the due GPUs' samples are read as one NVML job, then each GPU's step
    is finished and handed to each of ``consumers`` in their order (``StepConsumer.after_step``), GPU by GPU,
    and ``on_round`` is called once the round is done. NVML's events (XID, ECC, GPU lost, driver reload) are
    polled in the same job on the whole second and routed to their GPU's next step. One task, one timer and one
    thread hop per round instead of one per GPU and one for the events: on a small edge node the wake-ups and
    task switches cost more CPU than the work. ``counts``: where failed steps and XIDs are counted."""

    def __init__(
        self,
        workers: Mapping[str, GpuWorker],
        backend: RoundBackend,
        *,
        clock: Clock,
        consumers: Sequence[StepConsumer] = (),
        on_round: Callable[[], None] | None = None,
        beat: Callable[[str, float], None] | None = None,
        observe: Callable[[float], None] | None = None,
        on_sample: Callable[[GpuWorker, Sample], None] | None = None,
        counts: CollectCounts | None = None,
        observe_lateness: Callable[[float, float], None] | None = None,
    ) -> None:
        self.workers = workers
        self.backend = backend
        self.clock = clock
        self.consumers = tuple(consumers)
        self.on_round = on_round
        self.beat = beat
        #: Called with the wall duration (s) of each round that sampled a GPU.
        self.observe = observe
        #: Called with each GPU sample's lateness (s): how long after its due time its NVML read began (the
        #: round's other GPUs read before it, a job still running on the NVML worker, the event loop's own delay,
        #: the host's scheduling), and the part of it spent behind the other GPUs' reads in the same round.
        self.observe_lateness = observe_lateness
        #: Called with each GPU's sample right after the round's NVML read, before the steps (the live topic).
        self.on_sample = on_sample
        #: Set by a GPU's ``wake`` (wire it to ``GpuWorker.notify``): the collector runs at once.
        self.wake = asyncio.Event()
        self.counts = counts if counts is not None else CollectCounts()
        #: Failed steps by reason (``gpu-lost``, ``step-failed``, ``error``).
        self.errors = self.counts.errors
        #: XIDs seen per GPU: uuid -> {xid: count}.
        self.xids = self.counts.xids

    async def run(self) -> None:
        workers = list(self.workers.values())
        next_poll_s = 0.0
        while True:
            now_s = self.clock.monotonic()
            due = [w for w in workers if w.is_due(now_s)]
            poll = next_poll_s <= now_s + DUE_SLACK_S
            if due or poll:
                started = time.perf_counter()
                results, events = await self.tick_all(due, poll)
                for worker, result in zip(due, results, strict=True):
                    if result.error:
                        reason = "gpu-lost" if worker.lost else "step-failed" if result.step_failed else "error"
                        self.errors[reason] = self.errors.get(reason, 0) + 1
                    try:
                        for consumer in self.consumers:
                            consumer.after_step(worker, result)
                    except Exception as exc:  # one GPU's failing step must not stop the others (counted, logged)
                        worker.step_failed("publishing its step", exc)
                        self.errors["step-failed"] = self.errors.get("step-failed", 0) + 1
                if self.on_round is not None:
                    self.on_round()
                if due and self.observe is not None:
                    self.observe(time.perf_counter() - started)
                if poll:
                    next_poll_s = next_on_grid(now_s, EVENTS_POLL_S, DUE_SLACK_S)
                    self.route_events(events)
            next_s = min([next_poll_s, *(w.next_due_s() for w in workers)])
            delay_s = max(0.0, next_s - self.clock.monotonic())
            # The beat's period is this loop's own sleep, so long collect cycles never look like a stall.
            if self.beat is not None:
                self.beat("collect", max(1.0, delay_s))
            await sleep_or_wake(self.wake, delay_s)

    async def tick_all(self, due: list[GpuWorker], poll: bool) -> tuple[list[TickResult], Sequence[GpuEvent]]:
        """``GpuWorker.tick`` of each of ``due``, their samples (and, with ``poll``, NVML's events) read in one
        NVML job; the results and the events."""
        starts = [w.begin() for w in due]
        requests = [(w.uuid, start.names) for w, start in zip(due, starts, strict=True) if start.names]
        # each sampled GPU's due time (its earliest due group; -1: due at once after a start or a bind, not timed)
        due_s = [min(start.due_at[i] for i in start.groups) for start in starts if start.names]
        samples: dict[str, Sample | MapperError] = {}
        events: Sequence[GpuEvent] = []
        if requests or poll:
            try:
                got: RoundLike = await call_backend(
                    self.backend, self.backend.sample_many, requests, poll, timeout_s=10.0
                )
            except MapperError as exc:  # the job as a whole (NVML hung or not initialised): each GPU gets it
                got = _FailedRound([exc] * len(requests), [], exc)
            except Exception as exc:  # a bug in the round: logged with its traceback, each GPU retries later
                log.exception("the NVML sampling round failed")
                err = TransientError(f"the NVML sampling round failed: {exc!r}", retry_after_s=5.0)
                got = _FailedRound([err] * len(requests), [], err)
            samples = {uuid: outcome for (uuid, _), outcome in zip(requests, got.samples, strict=True)}
            started_s: Sequence[float] = getattr(got, "started_s", ())
            if self.observe_lateness is not None and started_s and len(started_s) == len(due_s):
                first_s = started_s[0]
                for read_s, at_s in zip(started_s, due_s, strict=True):
                    if at_s >= 0:
                        self.observe_lateness(max(0.0, read_s - at_s), max(0.0, read_s - first_s))
            if self.on_sample is not None:
                for worker in due:
                    outcome = samples.get(worker.uuid)
                    if isinstance(outcome, Sample):
                        try:
                            self.on_sample(worker, outcome)
                        except Exception:  # a bug in publishing a live value must not cost the round
                            log.exception("handing the sample of GPU %s on failed", worker.uuid)
            events = got.events
            if got.events_error is not None:
                log.debug("polling NVML events failed: %s", got.events_error)
        return [await w.finish(start, samples.get(w.uuid)) for w, start in zip(due, starts, strict=True)], events

    def route_events(self, events: Sequence[GpuEvent]) -> None:
        """XID / ECC / GPU-lost / driver-reload events to their GPU: counted, logged, handed to its next step."""
        for event in events:
            worker = self.workers.get(event.uuid)
            if worker is None:
                continue
            if event.kind == "xid":
                per_gpu = self.xids.setdefault(event.uuid, {})
                per_gpu[event.xid] = per_gpu.get(event.xid, 0) + 1
                log.error("GPU %s: XID %d %s", event.uuid, event.xid, event.detail)
            if event.kind == "driver_reload":
                log.warning("GPU %s: driver reload detected; every setting is re-applied", event.uuid)
                worker.driver_reloaded()
            worker.pending_events.append(event)
            worker.wake()
