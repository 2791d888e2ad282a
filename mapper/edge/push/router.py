"""Which samples go to which push destination, and the destinations' tasks (docs/push.md).

``PushRouter`` is a consumer of the collector's steps (``after_step``): for each GPU bound to a Device that names
push or DB methods it picks, per property, one sample per report cycle (the property's ``reportCycle``, else the
mapper's default; the sample's own time, on a grid of the cycle) and queues it for each destination the property
names: its push method (http, otel, or mqtt as the framework's text when ``push.mqttFormat`` is ``text``) and its
DB method. ``store_round`` (called once per collect round) stores the round's samples in the push buffer in one
transaction and wakes their destinations; nothing here waits on a destination.

``run`` starts and supervises one task per destination (``mapper.edge.push.destination.Destination``): a
destination a Device names is made when first named (its writer through ``make_writer``, which may refuse it with
a ``PermanentError``: tdengine), one that holds samples from before a restart is made from its stored spec, and one
no Device names any more is closed once it has delivered (or dropped) everything it held. Changing a property's
method mid-run sends from then on to the new destination while the old one still delivers what it holds.

Each bound GPU's ``push_status`` twin (``GpuWorker.push_status``) says, per property and method, how it fares:
``ok``, ``waiting``, ``down``, ``refused@<reason>``, ``ignored`` (a second push or DB method), ``carried``
(anomalyDetection: kept and shown, nothing is sent; the framework's hook is empty too).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from mapper.clock import Clock, sleep_or_wake
from mapper.edge.control.collect import GpuWorker, TickResult
from mapper.edge.push.destination import Destination, DestinationStatus, PushStore
from mapper.edge.push.spec import Method, destination_key, method_from_json, method_kind, method_to_json
from mapper.edge.push.wire import encode_sample, number_of, value_text
from mapper.errors import MapperError, PermanentError
from mapper.shared.model import PROPERTY_BY_NAME, DeviceConfig, DeviceProperty, PropertySpec, twin_safe
from mapper.shared.push import AnomalyDetection, PushHttp, PushSample, PushWriter

log = logging.getLogger(__name__)

#: Makes the writer of a destination; ``PermanentError`` when it cannot be made (the reason is shown).
MakeWriter = Callable[[Method], PushWriter]
#: The order of a property's entries in the ``push_status`` twin (the framework's order, push then DB).
ENTRY_ORDER = (
    "http",
    "mqtt",
    "otel",
    "anomalyDetection",
    "pushMethod",
    "influxdb2",
    "redis",
    "tdengine",
    "mysql",
    "dbMethod",
)
#: How often ``run`` looks for destinations to start or to close when nothing wakes it.
SUPERVISE_S = 5.0
#: A sample within this part of a report cycle before its due time counts as due (timers jitter).
DUE_SLACK_RATIO = 0.1
DUE_SLACK_MAX_MS = 250


@dataclass(frozen=True)
class Route:
    """One property of a bound Device and where its samples go."""

    prop: DeviceProperty
    spec: PropertySpec
    cycle_ms: int
    #: (destination key, the method's spec as JSON) of each destination.
    destinations: tuple[tuple[str, str], ...]


@dataclass
class Plan:
    """What a bound Device pushes: its routes and its twin's entries (property, method, and a fixed state, or the
    key of the destination whose state it shows)."""

    device: DeviceConfig | None
    routes: list[Route] = field(default_factory=list)
    entries: list[tuple[str, str, str]] = field(default_factory=list)


class PushRouter:
    """Samples to destinations (see the module docstring). ``store``: the push buffer; ``make_writer``: a
    destination's writer; ``default_report_cycle_ms``: a property's report cycle when its own is 0;
    ``mqtt_text``: ``pushMethod.mqtt`` as the framework's text messages (else it feeds the telemetry batches)."""

    def __init__(
        self,
        node: str,
        store: PushStore,
        make_writer: MakeWriter,
        *,
        clock: Clock,
        default_report_cycle_ms: int,
        mqtt_text: bool = False,
        rate_per_s: float = 200.0,
        retry_max_s: float = 10.0,
        write_timeout_s: float = 10.0,
    ) -> None:
        """``write_timeout_s``: a request's bound where the Device sets none (``push.timeout``)."""
        self.node = node
        self.store = store
        self.make_writer = make_writer
        self.clock = clock
        self.default_report_cycle_ms = default_report_cycle_ms
        self.mqtt_text = mqtt_text
        self.rate_per_s = rate_per_s
        self.retry_max_s = retry_max_s
        self.write_timeout_s = write_timeout_s
        self.destinations: dict[str, Destination] = {}
        self._plans: dict[str, Plan] = {}
        #: (uuid, property) -> the wall time (ms) from which its next sample is due.
        self._due_ms: dict[tuple[str, str], int] = {}
        self._round: list[tuple[str, str, int, bytes]] = []
        self._touched: set[str] = set()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._changed = asyncio.Event()
        #: Samples that could not be stored (the push buffer failed), by destination.
        self.store_failures: dict[str, int] = {}

    # ------------------------------------------------------------------------------------------ plans

    def _plan(self, worker: GpuWorker) -> Plan:
        plan = self._plans.get(worker.uuid)
        if plan is not None and plan.device is worker.device:
            return plan
        plan = self._build_plan(worker.device)
        self._plans[worker.uuid] = plan
        self._refresh_counts()
        self._changed.set()
        return plan

    def _build_plan(self, device: DeviceConfig | None) -> Plan:
        plan = Plan(device)
        if device is None:
            return plan
        for p in device.properties:
            if not p.pushes:
                continue
            spec = PROPERTY_BY_NAME.get(p.name)
            for note in p.push_notes:
                if note.refused:
                    log.warning("device %s: %s (refused; the rest of the Device is kept)", device.key, note.message)
                    plan.entries.append((p.name, note.method, "refused@" + (note.field or "value")))
                else:
                    log.info("device %s: %s", device.key, note.message)
                    plan.entries.append((p.name, note.method, "ignored"))
            methods: list[Method] = []
            if p.push_mqtt is not None and self.mqtt_text:
                if p.push_mqtt.topic:
                    methods.append(p.push_mqtt)
                else:
                    plan.entries.append((p.name, "mqtt", "refused@topic"))
                    log.warning(
                        "device %s property %s: pushMethod.mqtt has no topic for the text format", device.key, p.name
                    )
            if isinstance(p.push, AnomalyDetection):
                plan.entries.append((p.name, "anomalyDetection", "carried"))
            elif p.push is not None:
                methods.append(p.push)
            if p.db is not None:
                methods.append(p.db)
            if spec is None:
                continue  # the registry refuses an unknown property; nothing to sample
            targets: list[tuple[str, str]] = []
            for method in methods:
                kind = method_kind(method)
                if kind == "otel" and spec.ptype == "STRING":
                    plan.entries.append((p.name, kind, "refused@not-a-number"))
                    log.warning("device %s property %s: pushMethod.otel needs a number, it is text", device.key, p.name)
                    continue
                key = destination_key(method)
                self._destination(key, method)
                plan.entries.append((p.name, kind, "@" + key))
                targets.append((key, method_to_json(method)))
            if targets:
                cycle = p.report_cycle_ms or self.default_report_cycle_ms
                plan.routes.append(Route(p, spec, cycle, tuple(targets)))
        # Each property's entries in the framework's order of its methods (push, then DB).
        order = {name: i for i, name in enumerate(ENTRY_ORDER)}
        names = {p.name: i for i, p in enumerate(device.properties)}
        plan.entries.sort(key=lambda e: (names.get(e[0], 0), order.get(e[1], len(order))))
        return plan

    def _destination(self, key: str, method: Method) -> Destination:
        dest = self.destinations.get(key)
        if dest is not None:
            return dest
        writer: PushWriter | None = None
        refusal = reason = ""
        try:
            writer = self.make_writer(method)
        except (PermanentError, ValueError) as exc:
            refusal = str(exc)
            reason = getattr(exc, "reason", "") if getattr(exc, "reason", "") not in ("", "failed") else "unavailable"
            log.error("push %s: refused: %s", key, refusal)
        dest = Destination(
            key,
            method_kind(method),
            self.store,
            writer,
            clock=self.clock,
            refusal=refusal,
            refusal_reason=reason,
            rate_per_s=self.rate_per_s,
            retry_max_s=self.retry_max_s,
            write_timeout_s=self._write_guard_s(method),
        )
        self.destinations[key] = dest
        self._changed.set()
        return dest

    def _write_guard_s(self, method: Method) -> float:
        """The most one write may take before it counts as failed: a few of its requests' own bounds (each writer
        bounds its every request; this only catches one that does not)."""
        request_s = self.write_timeout_s
        if isinstance(method, PushHttp) and method.timeout_ms > 0:
            request_s = method.timeout_ms / 1000
        return 3 * request_s + 5.0

    def _refresh_counts(self) -> None:
        counts: dict[str, int] = {}
        for plan in self._plans.values():
            for route in plan.routes:
                for key, _ in route.destinations:
                    counts[key] = counts.get(key, 0) + 1
        for key, dest in self.destinations.items():
            dest.properties = counts.get(key, 0)

    def twin_text(self, plan: Plan) -> str:
        """The ``push_status`` twin of a plan: ``<property>:<method>:<state>`` entries, comma separated."""
        parts = []
        for prop, method, state in plan.entries:
            if state.startswith("@"):
                dest = self.destinations.get(state[1:])
                if dest is None:
                    state = "waiting"
                elif dest.writer is None:
                    state = "refused@" + dest.refusal_reason
                else:
                    state = dest.state
            parts.append(f"{prop}:{method}:{state}")
        return twin_safe(",".join(parts))

    # ------------------------------------------------------------------------------------------ samples

    def after_step(self, worker: GpuWorker, result: TickResult) -> None:
        """A GPU's step (a ``Collector`` consumer): its due samples queued for their destinations."""
        plan = self._plan(worker)
        if not plan.entries:
            if worker.push_status:
                worker.push_status = ""
            return
        worker.push_status = self.twin_text(plan)
        sample = result.sample
        device = plan.device
        if sample is None or device is None:
            return
        for route in plan.routes:
            name = route.prop.name
            value = sample.values.get(name)
            if value is None:
                continue
            due_key = (worker.uuid, name)
            cycle = route.cycle_ms
            slack = min(int(cycle * DUE_SLACK_RATIO), DUE_SLACK_MAX_MS)
            if sample.ts_ms + slack < self._due_ms.get(due_key, 0):
                continue
            self._due_ms[due_key] = ((sample.ts_ms + slack) // cycle + 1) * cycle
            p = route.prop
            push = PushSample(
                namespace=device.namespace,
                device=device.name,
                property=name,
                value=value_text(value),
                ts_ms=sample.ts_ms,
                kind=p.desired_metadata.get("type", "") if p.desired is not None else "",
                number=number_of(value),
                unit=route.spec.unit,
                counter=route.spec.prom_type == "counter",
                uuid=worker.uuid,
                node=self.node,
            )
            payload = encode_sample(push)
            for key, spec_json in route.destinations:
                if self.destinations[key].writer is None:
                    continue  # refused when it was made: nothing is kept for it
                self._round.append((key, spec_json, sample.ts_ms, payload))
                self._touched.add(key)

    def store_round(self) -> None:
        """The samples queued in this collect round into the push buffer (one transaction); their destinations
        woken. A buffer that cannot store them is counted per destination and logged."""
        if not self._round:
            return
        rows, self._round = self._round, []
        touched, self._touched = self._touched, set()
        try:
            self.store.put_many(rows)
        except MapperError as exc:
            for key, *_ in rows:
                self.store_failures[key] = self.store_failures.get(key, 0) + 1
            log.error("push: %d samples not stored: %s", len(rows), exc)
            return
        for key in touched:
            dest = self.destinations.get(key)
            if dest is not None:
                dest.wake()

    # ------------------------------------------------------------------------------------------ tasks

    def restore(self) -> None:
        """Destinations that hold samples from before a restart, made from their stored specs (before any Device
        names them again), so their backlog is delivered."""
        for key, spec_json in sorted(self.store.keys().items()):
            if key in self.destinations:
                continue
            try:
                method = method_from_json(spec_json)
            except ValueError as exc:
                log.error("push %s: its stored spec does not read (%s); its samples stay until buffer.maxAge", key, exc)
                continue
            self._destination(key, method)
            log.info("push %s: %d samples from before the restart to deliver", key, self.store.backlog(key)[0])

    async def run(self) -> None:
        """Start, supervise and close the destinations' tasks until cancelled (then every task is stopped and
        every writer closed)."""
        self.restore()
        try:
            while True:
                self._start_tasks()
                await self._retire()
                await sleep_or_wake(self._changed, SUPERVISE_S)
        finally:
            await self.close()

    def _start_tasks(self) -> None:
        for key, dest in self.destinations.items():
            task = self._tasks.get(key)
            if task is None or task.done():
                self._tasks[key] = asyncio.create_task(self._guarded(dest), name=f"push {key}")

    async def _guarded(self, dest: Destination) -> None:
        """A destination's task: a crash (a bug) is logged with its traceback, and it starts again a bit later."""
        while True:
            try:
                await dest.run()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("push %s: its loop crashed; starting it again in 5 s", dest.key)
                dest.state = "down"
                await asyncio.sleep(5.0)

    def _referenced(self) -> set[str]:
        return {key for plan in self._plans.values() for route in plan.routes for key, _ in route.destinations}

    async def _retire(self) -> None:
        """Close the destinations no Device names any more once they hold nothing."""
        referenced = self._referenced()
        for key in [k for k in self.destinations if k not in referenced]:
            if self.store.backlog(key)[0] > 0 and self.destinations[key].writer is not None:
                continue
            dest = self.destinations.pop(key)
            task = self._tasks.pop(key, None)
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            await dest.aclose()
            try:
                self.store.forget(key)
            except MapperError as exc:
                log.warning("push %s: cannot forget it: %s", key, exc)
            log.info("push %s: no Device names it any more; closed", key)

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)
        for dest in list(self.destinations.values()):
            await dest.aclose()

    def statuses(self) -> tuple[DestinationStatus, ...]:
        """Every destination's status, by key."""
        return tuple(self.destinations[key].status() for key in sorted(self.destinations))

    def tasks(self) -> Iterable[asyncio.Task[None]]:
        return self._tasks.values()
