"""Twin and state reporting, for both paths: DMI (``ReportDeviceStatus`` / ``ReportDeviceStates`` through the
DMI reporter's rate-limited, coalescing queue) and EventBus (``twin/update`` / ``state/update``).

``Reporter`` decides what each bound Device reports and when:

* **periodic**: a Device's twins every report cycle (the shortest ``reportCycle`` of its reported properties,
  else ``defaults.reportCycle``), its state every state report cycle when it asks for state reports. The first
  report after a binding goes out at once; the second comes between half a cycle and one and a half cycles
  later, at a phase of its own (the golden-ratio sequence over the bound Devices; twins and states alike), so
  Devices bound together (every GPU at start-up) do not report in one burst every cycle and the node-wide
  budget stays free for the prompt reports below. Nothing moves a Device's phase afterwards. A cycle shorter than
  ``GRID_BELOW_S`` (5 s) is not spread: such Devices report together on the clock's grid of their cycle (the
  grid the GPU loops sample on), one wake-up for all.
* **full and changed-only**: a periodic report is *full* (every twin of the Device) when the Device's cycle is at
  least ``defaults.reportCycle`` (20 s unless configured; discover writes the same), and for a shorter cycle
  once every ``defaults.reportCycle`` (the first report after a binding included); in between, each path gets
  only the twins whose value differs from what that path was last sent (nothing at all when none changed).
  EdgeCore applies each twin of a ``ReportDeviceStatus`` or an EventBus ``twin/update`` on its own and keeps
  the others, so a changed-only report is an ordinary partial update; the full one puts right whatever a path
  lost (a DMI report EdgeCore refused for good, an EventBus publish lost while the session still looked up).
  A broker reconnect sends the full twins again on EventBus at once (below). The Device's retained state
  message goes with the full reports and when its state changed, not with every changed-only one.
* **prompt**: when a step changes what a Device's twins say about control (a desired value applied, rejected
  or restored: its property's twin and ``desired_status``; a policy starting or ending an override:
  ``policy_state`` and the capped property), or publishes an ack or a policy event, the affected twins go out
  at once over EventBus, and over DMI at the next moment the budget allows but at most once a second per
  Device: the changes of the same second are coalesced into one report. A prompt report leaves the periodic
  schedule as it was. A change of state (unhealthy, offline, online again) goes out at once on both paths.
* **unsupported**: a reported property the GPU cannot read (``GpuWorker.unsupported``) is reported with the
  value ``unsupported`` (``mapper.shared.model.UNSUPPORTED_TWIN``; over EventBus its twin metadata says so too), with
  one log line per Device and property; when the GPU reads it again the twin carries its value again.

The node-wide rate budget itself (a token bucket of 0.8 RPC/s, burst 10, under EdgeCore's 1/s, burst 100) is
spent by the DMI reporter (``mapper.edge.kubeedge.dmi.client.DmiReporter``), which keeps one pending report per Device
and merges what is offered meanwhile: this module decides what is offered and when, and marks the prompt offers
(``prompt=True``: the prompt twins above, and a state that changed after the Device's first report). The DMI
reporter sends those first and lets periodic ones (start-up's first reports included) spend only what leaves
a token per Device in the bucket, so a change right after start-up does not wait behind start-up's reports
(``mapper.edge.kubeedge.dmi.ratelimit``).

It sees domain types and Protocols only: the DMI reporter is a ``StatusSink``, the EventBus a publish callable.
``report_due`` is one pass on the injected clock (tests run it on fake time); ``run`` is the loop around it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from mapper.clock import Clock, next_on_grid, sleep_or_wake
from mapper.edge.control.collect import GpuWorker, TickResult, worker_sample
from mapper.shared.model import PROPERTY_BY_NAME, UNSUPPORTED_TWIN, DeviceConfig, Twin, format_value
from mapper.wire.eventbus import state_update_payload, twin_update_payload
from mapper.wire.state import state_payload
from mapper.wire.topics import state_update_topic, twin_update_topic

log = logging.getLogger("mapper.edge.kubeedge.report")

#: Twins the mapper computes itself; reported for every bound Device.
STATUS_TWINS = ("desired_status", "policy_state", "health", "health_probe")
#: The twin of each push and DB method's state (``mapper.edge.push.router``): reported for a Device that lists it
#: or names any method.
PUSH_STATUS = "push_status"
#: The longest the report loop sleeps with nothing due (a wake makes it look sooner).
IDLE_WAIT_S = 5.0
#: The least time between two prompt DMI reports of one Device: the changes of one second go in one report.
PROMPT_INTERVAL_S = 1.0
#: Stands for "the GPU cannot read it" in the values a changed-only report compares (its value is None then).
_UNREADABLE = object()
#: Spreads the phases of the periodic reports: the k-th bound Device reports at (k * this) mod 1 of its cycle.
_GOLDEN = 0.6180339887498949
#: Report cycles shorter than this are not spread: a Device reporting every few seconds offers more than the DMI
#: budget carries whatever its phase (the DMI reporter coalesces), and on a small VM each wake-up of the report
#: loop costs more CPU than the report it makes, so such Devices all report in one wake-up on the clock's grid.
GRID_BELOW_S = 5.0


class StatusSink(Protocol):
    """What the reporter needs from ``mapper.edge.kubeedge.dmi.client.DmiReporter`` (never blocking, never failing)."""

    def offer_status(self, namespace: str, name: str, twins: Iterable[Twin], *, prompt: bool = False) -> None: ...
    def offer_state(self, namespace: str, name: str, state: str, *, prompt: bool = False) -> None: ...
    def forget(self, namespace: str, name: str) -> None: ...


#: Fire-and-forget publish of (topic, payload) on the EventBus broker.
Publish = Callable[[str, bytes], None]


def device_twins(worker: GpuWorker, names: Iterable[str] | None = None) -> list[Twin]:
    """The twins the bound Device reports (its reported properties, then the status twins; only ``names`` when
    given), current values. A property with no value yet and nothing desired is left out (an empty twin helps
    nobody); one the GPU cannot read says ``unsupported``."""
    device = worker.device
    if device is None:
        return []
    twins: list[Twin] = []
    if names is None:
        names = [p.name for p in device.properties if p.report_to_cloud]
        names += [n for n in STATUS_TWINS if n not in names]
        if worker.push_status and PUSH_STATUS not in names:
            names.append(PUSH_STATUS)  # a Device that names a push or DB method sees how each one fares
    for name in names:
        spec = PROPERTY_BY_NAME.get(name)
        if spec is None:
            continue
        observed = worker.desired.observed_desired_value(name) if spec.writable else ""
        if name == "desired_status":
            reported = worker.desired_status
        elif name == "policy_state":
            reported = worker.policy_state
        elif name == "health":
            reported = worker.health.twin_text()
        elif name == PUSH_STATUS:
            reported = worker.push_status or "none"
        elif name == "health_probe":
            if worker.last_probe is None:
                continue
            reported = worker.last_probe.twin_text()
        else:
            value = worker.values.get(name)
            if value is None:
                if name in worker.unsupported:
                    reported = UNSUPPORTED_TWIN
                elif not observed:
                    continue
                else:
                    reported = ""
            else:
                prop = device.property(name)
                hex_format = prop is not None and prop.visitor_config.get("format") == "hex"
                as_hex = hex_format and spec.ptype == "INT"
                reported = hex(int(value)) if as_hex else format_value(spec, value)
        twins.append(Twin(name=name, observed_desired=observed, reported=reported))
    return twins


def twins_of(workers: Mapping[str, GpuWorker]) -> Callable[[DeviceConfig], list[Twin]]:
    """The current twins of a Device, by its GPU among ``workers`` (the DMI server's GetDevice): those of
    ``device_twins``, none for a GPU not on this node."""

    def twins(device: DeviceConfig) -> list[Twin]:
        worker = workers.get(device.uuid)
        return device_twins(worker) if worker is not None else []

    return twins


def control_twins(device: DeviceConfig) -> tuple[str, ...]:
    """The twins whose change is reported promptly: the Device's reported writable properties and the status
    twins (a read-only value changes every sample and waits for its cycle)."""
    names = [p.name for p in device.properties if p.report_to_cloud and _writable(p.name)]
    return (*names, *STATUS_TWINS)


def _writable(name: str) -> bool:
    spec = PROPERTY_BY_NAME.get(name)
    return spec is not None and spec.writable


class Reporter:
    """When each bound Device's twins and state go out, on which path.

    ``workers``: every GPU's worker by UUID (the reporter reads them, never changes them). ``dmi``: the DMI
    reporter, or None without DMI. ``eventbus``: the EventBus publish, or None when EventBus reporting is off.
    ``device_state``: called with (device key, state JSON) on every periodic twin report (the shipper's
    retained state snapshot), or None; ``state_snapshot(device key, worker)`` makes that JSON when given (the app's
    adds the GPU's status: ``mapper.edge.status.source.StatusSource.state_message``), else it holds the values
    alone (both written by ``mapper.wire.state.state_payload``).
    ``beat``: the loop's heartbeat (name, period s)."""

    def __init__(
        self,
        workers: Mapping[str, GpuWorker],
        *,
        clock: Clock,
        report_cycle_ms: int = 20_000,
        state_report_cycle_ms: int = 60_000,
        dmi: StatusSink | None = None,
        eventbus: Publish | None = None,
        device_state: Callable[[str, bytes], None] | None = None,
        state_snapshot: Callable[[str, GpuWorker], bytes] | None = None,
        beat: Callable[[str, float], None] | None = None,
    ) -> None:
        self.workers = workers
        self.clock = clock
        self.report_cycle_ms = report_cycle_ms
        self.state_report_cycle_ms = state_report_cycle_ms
        self.dmi = dmi
        self.eventbus = eventbus
        self.device_state = device_state
        self.state_snapshot = state_snapshot
        self.beat = beat
        #: Next periodic twin report per Device (monotonic s); 0: at once (just bound).
        self._next_report_s: dict[str, float] = {}
        self._next_state_s: dict[str, float] = {}
        self._reported_state: dict[str, str] = {}
        #: Each Device's phase in its report cycle (0..1), given when it is first bound.
        self._phase: dict[str, float] = {}
        self._bindings = 0
        #: The control twins as last reported, per Device: name -> (observedDesired, reported).
        self._last_control: dict[str, dict[str, tuple[str, str]]] = {}
        #: Prompt twins waiting to go out, per Device and path.
        self._prompt_dmi: dict[str, set[str]] = {}
        self._prompt_eventbus: dict[str, set[str]] = {}
        #: When each Device's last prompt DMI report was offered (monotonic s).
        self._last_prompt_s: dict[str, float] = {}
        #: Devices whose twins go out again at once on EventBus (the broker reconnected), off their cycle.
        self._resend: set[str] = set()
        self._resend_state: set[str] = set()
        #: Per Device: its reported writable properties, and what the last step left of them and the status twins.
        self._writable_names: dict[str, tuple[str, ...]] = {}
        #: Per Device: its reported properties, and those with the status twins whose change is reported promptly.
        self._reported_names: dict[str, tuple[str, ...]] = {}
        self._control_sets: dict[str, frozenset[str]] = {}
        self._signature: dict[str, tuple[object, ...]] = {}
        #: The unsupported twins already logged, per Device.
        self._unsupported_logged: dict[str, set[str]] = {}
        #: Per Device and path: each twin as that path was last sent it, name -> (observedDesired, reported).
        self._sent_dmi: dict[str, dict[str, tuple[str, str]]] = {}
        self._sent_eventbus: dict[str, dict[str, tuple[str, str]]] = {}
        #: Per Device: the raw values its last periodic report was made from (a changed-only report formats only
        #: the reported read-only properties whose value differs), and periodic reports left until the next full.
        self._basis: dict[str, dict[str, object]] = {}
        self._until_full: dict[str, int] = {}
        #: Per Device: the state its last retained state message carried.
        self._snapshot_state: dict[str, str] = {}
        #: Reports offered, by kind: periodic, prompt (DMI), prompt_eventbus, state.
        self.counts: dict[str, int] = {"periodic": 0, "prompt": 0, "prompt_eventbus": 0, "state": 0}
        #: Set to look at once (a change, a device was bound, the broker came back).
        self.wake = asyncio.Event()

    # --- what the rest of the mapper tells it ------------------------------------------------------------
    def bound(self, device: DeviceConfig) -> None:
        """A Device was bound to its GPU (or its cycles changed): its twins and state go out at once."""
        key = device.key
        if key not in self._phase:
            self._phase[key] = (self._bindings * _GOLDEN) % 1.0
            self._bindings += 1
        self._next_report_s[key] = 0.0
        self._next_state_s[key] = 0.0
        self._last_control.pop(key, None)
        self._writable_names.pop(key, None)
        self._signature.pop(key, None)
        self._forget_sent(key)
        self.wake.set()

    def removed(self, device: DeviceConfig) -> None:
        """A Device went away: nothing more is reported for it, and nothing pending is sent."""
        key = device.key
        for book in (self._next_report_s, self._next_state_s, self._reported_state, self._last_control):
            book.pop(key, None)
        for pending in (self._prompt_dmi, self._prompt_eventbus, self._unsupported_logged):
            pending.pop(key, None)
        self._writable_names.pop(key, None)
        self._signature.pop(key, None)
        self._forget_sent(key)
        self._snapshot_state.pop(key, None)
        self._resend.discard(key)
        self._resend_state.discard(key)
        if self.dmi is not None:
            self.dmi.forget(device.namespace, device.name)

    def resend_all(self) -> None:
        """The broker reconnected: every Device's twins and state go out again at once on EventBus (they are
        not kept while it is down). DMI is not concerned, and no cycle moves."""
        if self.eventbus is None:
            return
        self._resend.update(self._next_report_s)
        self._resend_state.update(self._next_state_s)
        self.wake.set()

    def state_changed(self, device: DeviceConfig) -> None:
        """A device's state changed in a step: reported at once (its state cycle stays as it was)."""
        self.wake.set()

    def after_step(self, worker: GpuWorker, result: TickResult) -> None:
        """A GPU's step is done (a ``Collector`` consumer): a change of state, or of what its control twins say,
        or an ack or a policy event, is reported promptly (see the module's docstring)."""
        device = worker.device
        if device is None:
            return
        if result.state_changed:
            self.state_changed(device)
        key = device.key
        last = self._last_control.get(key)
        if last is None or not worker.stepped:  # nothing reported yet: the first report is on its way
            if worker.stepped:
                self.wake.set()  # (the report loop skipped the Device until this step: its first twins are due)
            return
        acks = result.reconcile.acks if result.reconcile is not None else ()
        events = result.decision.events if result.decision is not None else ()
        # The usual step changes nothing of this: compare raw values first, format twins only on a change.
        values = worker.values
        signature = (worker.desired_status, worker.policy_state, *[values.get(n) for n in self._writable(device)])
        if not acks and not events and self._signature.get(key) == signature:
            return
        self._signature[key] = signature
        names = set()
        for twin in device_twins(worker, control_twins(device)):
            before = last.get(twin.name)
            # (A twin reported empty had no value yet, e.g. desired_status before the first reconcile: its
            # first value is no change of control and goes out with the next periodic report.)
            if before is not None and before != ("", "") and before != (twin.observed_desired, twin.reported):
                names.add(twin.name)
        if not names and not acks and not events:
            return
        names.update(STATUS_TWINS)
        reported = {p.name for p in device.properties if p.report_to_cloud}
        names.update(a.property for a in acks if a.property in reported)
        if self.dmi is not None:
            self._prompt_dmi.setdefault(key, set()).update(names)
        if self.eventbus is not None:
            self._prompt_eventbus.setdefault(key, set()).update(names)
        self.wake.set()

    def _writable(self, device: DeviceConfig) -> tuple[str, ...]:
        names = self._writable_names.get(device.key)
        if names is None:
            names = self._writable_names[device.key] = control_twins(device)[: -len(STATUS_TWINS)]
        return names

    def offer_state(self, namespace: str, name: str, state: str) -> None:
        """The state of a Device no GPU serves (its GPU is missing: ``offline``), over DMI."""
        if self.dmi is not None:
            self.dmi.offer_state(namespace, name, state)

    # --- cycles -----------------------------------------------------------------------------------------------
    def report_cycle_s(self, device: DeviceConfig) -> float:
        cycles = [p.report_cycle_ms for p in device.properties if p.report_to_cloud and p.report_cycle_ms > 0]
        return (min(cycles) if cycles else self.report_cycle_ms) / 1000

    def state_cycle_s(self, device: DeviceConfig) -> float:
        return (device.state_report_cycle_ms or self.state_report_cycle_ms) / 1000

    # --- the loop -----------------------------------------------------------------------------------------------
    def report_due(self) -> float:
        """One pass: report what is due now; the seconds until the next pass."""
        now = self.clock.monotonic()
        next_s = now + IDLE_WAIT_S
        for worker in self.workers.values():
            device = worker.device
            if device is None:
                continue
            key = device.key
            # A change of state (unhealthy, offline, back online) is always reported; the periodic
            # refresh only when the Device asks for state reports (stateReport / status.reportToCloud).
            changed = self._reported_state.get(key) != worker.state
            due = now >= self._next_state_s.get(key, 0.0) and device.state_report_to_cloud
            if changed or due:
                if due or key not in self._next_state_s:
                    self._next_state_s[key] = self._next_periodic(
                        key, self._next_state_s.get(key, 0.0), now, self.state_cycle_s(device)
                    )
                self._resend_state.discard(key)
                # A change after the first report is news (unhealthy, back online): prompt over DMI.
                self._report_state(device, worker.state, prompt=changed and key in self._reported_state)
            elif key in self._resend_state:
                self._resend_state.discard(key)
                if self.eventbus is not None:
                    self.eventbus(state_update_topic(device.namespace, device.name), self._state_payload(worker))
            if not worker.stepped:  # twins wait for the first whole step: a bare sample has no desired_status yet
                continue
            at = self._next_report_s.get(key, 0.0)
            if now >= at:
                cycle_s = self.report_cycle_s(device)
                self._next_report_s[key] = self._next_periodic(key, at, now, cycle_s)
                full = self._report_periodic(device, worker, cycle_s)
                self.counts["periodic"] += 1
                if self.device_state is not None and (full or self._snapshot_state.get(key) != worker.state):
                    self._snapshot_state[key] = worker.state
                    make = self.state_snapshot
                    payload = make(key, worker) if make is not None else state_payload(key, worker_sample(worker))
                    self.device_state(key, payload)
            elif key in self._resend:
                self._resend.discard(key)
                if self.eventbus is not None:
                    self._publish_twins(device, worker, device_twins(worker))
            next_s = min(next_s, max(self._next_report_s[key], now + 0.1))
            if device.state_report_to_cloud:
                next_s = min(next_s, self._next_state_s.get(key, now))
            next_s = min(next_s, self._report_prompt(device, worker, now))
        return max(0.01, next_s - self.clock.monotonic())

    def _report_periodic(self, device: DeviceConfig, worker: GpuWorker, cycle_s: float) -> bool:
        """A periodic report: full, or each path's changed twins (see the module's docstring). Whether it was
        full."""
        key = device.key
        left = self._until_full.get(key, 0)
        names = self._report_names(device)
        values, unsupported = worker.values, worker.unsupported
        basis = {n: _UNREADABLE if (v := values.get(n)) is None and n in unsupported else v for n in names}
        if left <= 0 or key not in self._basis:
            # Every twin once per default report cycle (``report_cycle_ms``), the changed ones in between.
            self._until_full[key] = max(1, round(self.report_cycle_ms / 1000 / cycle_s)) - 1
            self._basis[key] = basis
            self._resend.discard(key)
            self._report_twins(device, worker, device_twins(worker), periodic=True)
            self.counts["periodic_full"] = self.counts.get("periodic_full", 0) + 1
            return True
        self._until_full[key] = left - 1
        before = self._basis[key]
        self._basis[key] = basis
        # A read-only value formats to the same twin when its raw value is the same: only the others are made.
        control = self._control_names(device)
        wanted = [n for n in names if n in control or basis[n] != before.get(n, _UNREADABLE)]
        wanted += [n for n in STATUS_TWINS if n not in names]
        twins = device_twins(worker, wanted)
        # A path sent nothing yet (attached after the first report), or the broker came back since: every twin.
        if self.eventbus is not None:
            sent = self._sent_eventbus.get(key)
            if key in self._resend or sent is None:
                self._publish_twins(device, worker, device_twins(worker))
            else:
                self._publish_twins(
                    device, worker, [t for t in twins if sent.get(t.name) != (t.observed_desired, t.reported)]
                )
        self._resend.discard(key)
        if self.dmi is not None:
            sent = self._sent_dmi.get(key)
            changed = (
                device_twins(worker)
                if sent is None
                else [t for t in twins if sent.get(t.name) != (t.observed_desired, t.reported)]
            )
            if changed:
                self._note(device, worker, changed)
                self._mark_sent(self._sent_dmi, key, changed)
                self.dmi.offer_status(device.namespace, device.name, changed)
        return False

    def _report_names(self, device: DeviceConfig) -> tuple[str, ...]:
        """The Device's reported properties in report order (``device_twins``' order, status twins left out)."""
        names = self._reported_names.get(device.key)
        if names is None:
            names = self._reported_names[device.key] = tuple(p.name for p in device.properties if p.report_to_cloud)
        return names

    def _control_names(self, device: DeviceConfig) -> frozenset[str]:
        names = self._control_sets.get(device.key)
        if names is None:
            names = self._control_sets[device.key] = frozenset(control_twins(device))
        return names

    def _forget_sent(self, key: str) -> None:
        for book in (self._sent_dmi, self._sent_eventbus, self._basis, self._until_full):
            book.pop(key, None)
        self._reported_names.pop(key, None)
        self._control_sets.pop(key, None)

    @staticmethod
    def _mark_sent(book: dict[str, dict[str, tuple[str, str]]], key: str, twins: Iterable[Twin]) -> None:
        sent = book.setdefault(key, {})
        for twin in twins:
            sent[twin.name] = (twin.observed_desired, twin.reported)

    def _next_periodic(self, key: str, at: float, now: float, cycle_s: float) -> float:
        """The next periodic report after the one due ``at`` (0: the first after a binding, which fixes the
        Device's phase in its cycle; later ones keep it). A cycle shorter than ``GRID_BELOW_S`` lies on the
        clock's grid of that cycle instead (the GPU loops' grid): every such Device in the same wake-up."""
        if cycle_s < GRID_BELOW_S:
            return next_on_grid(now, cycle_s, cycle_s / 2 if at == 0.0 else 0.0)
        if at == 0.0:
            return now + cycle_s * (0.5 + self._phase.get(key, 0.0))
        return max(at + cycle_s, now + 0.1)

    def _report_prompt(self, device: DeviceConfig, worker: GpuWorker, now: float) -> float:
        """The Device's pending prompt twins that may go now; when the next may (inf: nothing pending)."""
        key = device.key
        names = self._prompt_eventbus.pop(key, None)
        if names and self.eventbus is not None:
            self._publish_twins(device, worker, device_twins(worker, sorted(names)))
            self.counts["prompt_eventbus"] += 1
        names = self._prompt_dmi.get(key)
        if not names:
            return float("inf")
        allowed_s = self._last_prompt_s.get(key, -PROMPT_INTERVAL_S) + PROMPT_INTERVAL_S
        if now < allowed_s:
            return allowed_s
        del self._prompt_dmi[key]
        self._last_prompt_s[key] = now
        if self.dmi is not None:
            twins = device_twins(worker, sorted(names))
            self._note(device, worker, twins)
            self._mark_sent(self._sent_dmi, key, twins)
            self.dmi.offer_status(device.namespace, device.name, twins, prompt=True)
            self.counts["prompt"] += 1
        return float("inf")

    async def run(self) -> None:
        """Twins and states when they are due, and at once when woken."""
        while True:
            delay_s = self.report_due()
            if self.beat is not None:
                self.beat("report", max(1.0, delay_s))
            await sleep_or_wake(self.wake, delay_s)

    def _report_state(self, device: DeviceConfig, state: str, *, prompt: bool = False) -> None:
        self._reported_state[device.key] = state
        self.counts["state"] += 1
        if self.dmi is not None:
            self.dmi.offer_state(device.namespace, device.name, state, prompt=prompt)
        if self.eventbus is not None:
            topic = state_update_topic(device.namespace, device.name)
            self.eventbus(topic, state_update_payload(state, self.clock.wall_ms()))

    def _state_payload(self, worker: GpuWorker) -> bytes:
        return state_update_payload(worker.state, self.clock.wall_ms())

    def _report_twins(self, device: DeviceConfig, worker: GpuWorker, twins: list[Twin], *, periodic: bool) -> None:
        if not twins:
            return
        self._note(device, worker, twins)
        if self.dmi is not None:
            self._mark_sent(self._sent_dmi, device.key, twins)
            self.dmi.offer_status(device.namespace, device.name, twins)
        if self.eventbus is not None:
            self._publish_twins(device, worker, twins)

    def _publish_twins(self, device: DeviceConfig, worker: GpuWorker, twins: list[Twin]) -> None:
        assert self.eventbus is not None
        if not twins:
            return
        self._note(device, worker, twins)
        self._mark_sent(self._sent_eventbus, device.key, twins)
        values = {t.name: t.reported for t in twins}
        unsupported = [t.name for t in twins if t.reported == UNSUPPORTED_TWIN and t.name in worker.unsupported]
        payload = twin_update_payload(values, self.clock.wall_ms(), unsupported=unsupported)
        self.eventbus(twin_update_topic(device.namespace, device.name), payload)

    def _note(self, device: DeviceConfig, worker: GpuWorker, twins: list[Twin]) -> None:
        """Remember the control twins as reported (the prompt reports compare with them), and log each
        property this GPU cannot read once, and again when it can."""
        key = device.key
        control = self._last_control.setdefault(key, {})
        writable = set(control_twins(device))
        for twin in twins:
            if twin.name in writable:
                control[twin.name] = (twin.observed_desired, twin.reported)
        logged = self._unsupported_logged.setdefault(key, set())
        for twin in twins:
            if twin.reported == UNSUPPORTED_TWIN and twin.name not in logged and twin.name in worker.unsupported:
                logged.add(twin.name)
                log.warning(
                    "device %s lists %s, which its GPU %s cannot read (NVML answers NotSupported): the twin "
                    "reports %r until the GPU reads it",
                    key,
                    twin.name,
                    worker.uuid,
                    UNSUPPORTED_TWIN,
                )
            elif twin.name in logged and twin.reported != UNSUPPORTED_TWIN:
                logged.discard(twin.name)
                log.info("device %s: GPU %s reads %s again; its twin reports the value", key, worker.uuid, twin.name)
