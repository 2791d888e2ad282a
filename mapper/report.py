"""Twin and state reporting, for both paths: DMI (``ReportDeviceStatus`` / ``ReportDeviceStates`` through the
DMI reporter's rate-limited, coalescing queue) and EventBus (``twin/update`` / ``state/update``).

``Reporter`` decides what each bound Device reports and when:

* **periodic**: a Device's twins every report cycle (the shortest ``reportCycle`` of its reported properties,
  else ``defaults.reportCycle``), its state every state report cycle when it asks for state reports;
* **at once**: a change of state (unhealthy, offline, online again), a Device just bound, and everything again
  after the broker reconnected.

It sees domain types and Protocols only: the DMI reporter is a ``StatusSink``, the EventBus a publish callable.
``report_due`` is one pass on the injected clock (tests run it on fake time); ``run`` is the loop around it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from mapper.clock import Clock, sleep_or_wake
from mapper.collect import GpuWorker, worker_sample
from mapper.eventbus import state_update_payload, state_update_topic, twin_update_payload, twin_update_topic
from mapper.model import PROPERTY_BY_NAME, DeviceConfig, Twin, format_value
from mapper.telemetry import state_payload

log = logging.getLogger("mapper.report")

#: Twins the mapper computes itself; reported for every bound Device.
STATUS_TWINS = ("desired_status", "policy_state")
#: The longest the report loop sleeps with nothing due (a wake makes it look sooner).
IDLE_WAIT_S = 5.0


class StatusSink(Protocol):
    """What the reporter needs from ``mapper.dmi.client.DmiReporter`` (never blocking, never failing)."""

    def offer_status(self, namespace: str, name: str, twins: Iterable[Twin]) -> None: ...
    def offer_state(self, namespace: str, name: str, state: str) -> None: ...
    def forget(self, namespace: str, name: str) -> None: ...


#: Fire-and-forget publish of (topic, payload) on the EventBus broker.
Publish = Callable[[str, bytes], None]


def device_twins(worker: GpuWorker) -> list[Twin]:
    """Every twin the bound Device reports (its reported properties, then the status twins), current values.
    A property with no value yet and nothing desired is left out (an empty twin helps nobody)."""
    device = worker.device
    if device is None:
        return []
    twins: list[Twin] = []
    names = [p.name for p in device.properties if p.report_to_cloud]
    names += [n for n in STATUS_TWINS if n not in names]
    for name in names:
        spec = PROPERTY_BY_NAME.get(name)
        if spec is None:
            continue
        observed = worker.desired.observed_desired_value(name) if spec.writable else ""
        if name == "desired_status":
            reported = worker.desired_status
        elif name == "policy_state":
            reported = worker.policy_state
        else:
            value = worker.values.get(name)
            if value is None:
                if not observed:
                    continue
                reported = ""
            else:
                prop = device.property(name)
                hex_format = prop is not None and prop.visitor_config.get("format") == "hex"
                as_hex = hex_format and spec.ptype == "INT"
                reported = hex(int(value)) if as_hex else format_value(spec, value)
        twins.append(Twin(name=name, observed_desired=observed, reported=reported))
    return twins


class Reporter:
    """When each bound Device's twins and state go out, on which path.

    ``workers``: every GPU's worker by UUID (the reporter reads them, never changes them). ``dmi``: the DMI
    reporter, or None without DMI. ``eventbus``: the EventBus publish, or None when EventBus reporting is off.
    ``device_state``: called with (device key, state JSON) on every twin report (the shipper's retained state
    snapshot), or None. ``beat``: the loop's heartbeat (name, period s)."""

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
        beat: Callable[[str, float], None] | None = None,
    ) -> None:
        self.workers = workers
        self.clock = clock
        self.report_cycle_ms = report_cycle_ms
        self.state_report_cycle_ms = state_report_cycle_ms
        self.dmi = dmi
        self.eventbus = eventbus
        self.device_state = device_state
        self.beat = beat
        self._next_report_s: dict[str, float] = {}
        self._next_state_s: dict[str, float] = {}
        self._reported_state: dict[str, str] = {}
        #: Set to look at once (a state changed, a device was bound, the broker came back).
        self.wake = asyncio.Event()

    # --- what the rest of the mapper tells it ------------------------------------------------------------
    def bound(self, device: DeviceConfig) -> None:
        """A Device was bound to its GPU (or its cycles changed): its twins and state go out at once."""
        self._next_report_s[device.key] = 0.0
        self._next_state_s[device.key] = 0.0
        self.wake.set()

    def removed(self, device: DeviceConfig) -> None:
        """A Device went away: nothing more is reported for it, and nothing pending is sent."""
        self._next_report_s.pop(device.key, None)
        self._next_state_s.pop(device.key, None)
        self._reported_state.pop(device.key, None)
        if self.dmi is not None:
            self.dmi.forget(device.namespace, device.name)

    def resend_all(self) -> None:
        """Everything again at once (the broker reconnected: EventBus twins and states are not kept meanwhile)."""
        for key in self._next_report_s:
            self._next_report_s[key] = 0.0
        for key in self._next_state_s:
            self._next_state_s[key] = 0.0
        self.wake.set()

    def state_changed(self, device: DeviceConfig) -> None:
        """A device's state changed in a step: reported at once."""
        self._next_state_s[device.key] = 0.0
        self.wake.set()

    def offer_state(self, namespace: str, name: str, state: str) -> None:
        """The state of a Device no GPU serves (its GPU is missing: ``offline``), over DMI."""
        if self.dmi is not None:
            self.dmi.offer_state(namespace, name, state)

    def twins_of_device(self, device: DeviceConfig) -> list[Twin]:
        """The current twins of ``device`` (the DMI server's GetDevice)."""
        worker = self.workers.get(device.uuid)
        return device_twins(worker) if worker is not None else []

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
            # A change of state (unhealthy, offline, back online) is always reported; the periodic
            # refresh only when the Device asks for state reports (stateReport / status.reportToCloud).
            changed = self._reported_state.get(device.key) != worker.state
            due = now >= self._next_state_s.get(device.key, 0.0) and device.state_report_to_cloud
            if changed or due:
                self._next_state_s[device.key] = now + self.state_cycle_s(device)
                self._report_state(device, worker.state)
            # Twins wait for the first sample: a report with only the status twins helps nobody.
            if now >= self._next_report_s.get(device.key, 0.0) and worker.values:
                self._next_report_s[device.key] = now + self.report_cycle_s(device)
                twins = device_twins(worker)
                if twins:
                    self._report_twins(device, twins)
                if self.device_state is not None:
                    self.device_state(device.key, state_payload(device.key, worker_sample(worker)))
            next_s = min(next_s, max(self._next_report_s.get(device.key, 0.0), now + 0.1))
            if device.state_report_to_cloud:
                next_s = min(next_s, self._next_state_s.get(device.key, now))
        return max(0.05, next_s - self.clock.monotonic())

    async def run(self) -> None:
        """Twins and states when they are due, and at once when woken."""
        while True:
            delay_s = self.report_due()
            if self.beat is not None:
                self.beat("report", max(1.0, delay_s))
            await sleep_or_wake(self.wake, delay_s)

    def _report_state(self, device: DeviceConfig, state: str) -> None:
        self._reported_state[device.key] = state
        if self.dmi is not None:
            self.dmi.offer_state(device.namespace, device.name, state)
        if self.eventbus is not None:
            topic = state_update_topic(device.namespace, device.name)
            self.eventbus(topic, state_update_payload(state, self.clock.wall_ms()))

    def _report_twins(self, device: DeviceConfig, twins: list[Twin]) -> None:
        if self.dmi is not None:
            self.dmi.offer_status(device.namespace, device.name, twins)
        if self.eventbus is not None:
            values = {t.name: t.reported for t in twins}
            payload = twin_update_payload(values, self.clock.wall_ms())
            self.eventbus(twin_update_topic(device.namespace, device.name), payload)
