"""Reporter on fake time: periodic twin and state reports per Device, at once on a state change, a new binding
or a reconnect; nothing for a removed Device. The DMI side is a recording StatusSink (the Reporter's own seam;
the DMI reporter behind it is tested in test_dmi_client.py and the whole path in test_app_dmi.py)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import pytest

from mapper.clock import FakeClock
from mapper.collect import GpuWorker
from mapper.gpu.nvml import NvmlBackend
from mapper.gpu.simnvml import SimNvml
from mapper.model import DeviceConfig, DeviceProperty, Twin
from mapper.policy import PolicyEngine
from mapper.reconcile import Reconciler
from mapper.report import Reporter, device_twins


@dataclass
class Sink:
    """Records what the reporter offers, with the fake time of each offer."""

    clock: FakeClock
    statuses: list[tuple[float, str, dict[str, tuple[str, str]]]] = field(default_factory=list)
    states: list[tuple[float, str, str]] = field(default_factory=list)
    forgotten: list[str] = field(default_factory=list)

    def offer_status(self, namespace: str, name: str, twins: Iterable[Twin]) -> None:
        values = {t.name: (t.observed_desired, t.reported) for t in twins}
        self.statuses.append((self.clock.monotonic(), f"{namespace}/{name}", values))

    def offer_state(self, namespace: str, name: str, state: str) -> None:
        self.states.append((self.clock.monotonic(), f"{namespace}/{name}", state))

    def forget(self, namespace: str, name: str) -> None:
        self.forgotten.append(f"{namespace}/{name}")


@dataclass
class Rig:
    clock: FakeClock
    sim: SimNvml
    workers: dict[str, GpuWorker]
    sink: Sink
    published: list[tuple[float, str, dict]]
    reporter: Reporter

    def run_for(self, seconds: float) -> None:
        """Run the report loop's passes on fake time for ``seconds``, sleeping as the loop would."""
        end = self.clock.monotonic() + seconds
        while True:
            delay = self.reporter.report_due()
            if self.clock.monotonic() + delay > end:
                self.clock.advance(max(0.0, end - self.clock.monotonic()))
                return
            self.clock.advance(delay)


def gpu_device(name: str, uuid: str, *, report_cycle_ms: int = 20_000, state_cycle_ms: int = 60_000) -> DeviceConfig:
    props = tuple(
        DeviceProperty(p, report_cycle_ms=report_cycle_ms, report_to_cloud=True)
        for p in ("temperature", "power_usage", "power_limit")
    )
    return DeviceConfig(
        "default",
        name,
        "nvidia-gpu",
        uuid,
        properties=props,
        state_report_to_cloud=True,
        state_report_cycle_ms=state_cycle_ms,
    )


@pytest.fixture
def rig() -> Iterator[Rig]:
    clock = FakeClock()
    sim = SimNvml(2, "H100", seed=0, scenario="steady", clock=clock.monotonic)
    backend = NvmlBackend(sim, clock=clock)
    backend.init()
    workers = {}
    for info in backend.list_gpus():
        workers[info.uuid] = GpuWorker(
            info=info,
            backend=backend,
            reconciler=Reconciler(backend, info.uuid, clock=clock),
            policies=PolicyEngine(),
            clock=clock,
        )
    sink = Sink(clock)
    published: list[tuple[float, str, dict]] = []

    def publish(topic: str, payload: bytes) -> None:
        published.append((clock.monotonic(), topic, json.loads(payload)))

    reporter = Reporter(workers, clock=clock, dmi=sink, eventbus=publish)
    yield Rig(clock, sim, workers, sink, published, reporter)
    backend.shutdown()


async def bind_and_sample(rig: Rig) -> list[DeviceConfig]:
    devices = []
    for i, worker in enumerate(rig.workers.values()):
        device = gpu_device(f"gpu{i}", worker.uuid)
        worker.bind(device)
        rig.reporter.bound(device)
        await worker.tick()
        devices.append(device)
    return devices


async def test_twins_go_out_once_per_report_cycle_and_states_once_per_state_cycle(rig: Rig) -> None:
    await bind_and_sample(rig)
    start = rig.clock.monotonic()
    rig.run_for(65.0)
    for key in ("default/gpu0", "default/gpu1"):
        times = [t - start for t, k, _ in rig.sink.statuses if k == key]
        assert times == pytest.approx([0.0, 20.0, 40.0, 60.0], abs=0.01), times
        state_times = [t - start for t, k, _ in rig.sink.states if k == key]
        assert state_times == pytest.approx([0.0, 60.0], abs=0.01), state_times
    # The EventBus gets the same reports: twin/update and state/update per device, every twin a string.
    twin_updates = [d for _, topic, d in rig.published if topic == "$hw/events/device/default/gpu0/twin/update"]
    assert len(twin_updates) == 4
    assert twin_updates[0]["twin"]["power_limit"]["actual"]["value"] == "700"
    assert {t["metadata"]["type"] for t in twin_updates[0]["twin"].values()} == {"string"}
    _, _, twins = rig.sink.statuses[0]
    assert set(twins) == {"temperature", "power_usage", "power_limit", "desired_status", "policy_state"}


async def test_nothing_is_reported_before_the_first_sample(rig: Rig) -> None:
    worker = next(iter(rig.workers.values()))
    device = gpu_device("gpu0", worker.uuid)
    worker.bind(device)
    rig.reporter.bound(device)
    rig.run_for(3.0)
    assert rig.sink.statuses == [], "twins wait for the first sample"
    assert [s for _, _, s in rig.sink.states] == ["online"], "the state goes out at once"
    await worker.tick()
    rig.run_for(0.2)
    assert len(rig.sink.statuses) == 1


async def test_a_state_change_is_reported_at_once_and_a_removed_device_reports_nothing(rig: Rig) -> None:
    devices = await bind_and_sample(rig)
    rig.run_for(5.0)
    worker = rig.workers[devices[0].uuid]
    rig.sim.inject_gpu_lost(worker.uuid)
    result = await worker.tick()
    assert result.state_changed and worker.state == "offline"
    rig.reporter.state_changed(devices[0])
    changed_at = rig.clock.monotonic()
    rig.run_for(0.5)
    offline = [t for t, k, s in rig.sink.states if k == "default/gpu0" and s == "offline"]
    assert offline and offline[0] - changed_at < 0.2

    rig.reporter.removed(devices[1])
    worker1 = rig.workers[devices[1].uuid]
    worker1.bind(None)
    assert rig.sink.forgotten == ["default/gpu1"]
    before = len([1 for _, k, _ in rig.sink.statuses if k == "default/gpu1"])
    rig.run_for(45.0)
    assert len([1 for _, k, _ in rig.sink.statuses if k == "default/gpu1"]) == before


async def test_a_reconnect_sends_every_device_again_at_once_without_moving_the_cycle(rig: Rig) -> None:
    await bind_and_sample(rig)
    start = rig.clock.monotonic()
    rig.run_for(7.0)
    rig.reporter.resend_all()
    rig.run_for(0.5)
    times = [round(t - start, 1) for t, k, _ in rig.sink.statuses if k == "default/gpu0"]
    assert times == [0.0, 7.0]
    rig.run_for(30.0)
    times = [round(t - start, 1) for t, k, _ in rig.sink.statuses if k == "default/gpu0"]
    assert times == [0.0, 7.0, 27.0]


async def test_device_twins_carry_observed_desired_for_writable_properties_and_hex_where_asked(rig: Rig) -> None:
    worker = next(iter(rig.workers.values()))
    props = (
        DeviceProperty("power_limit", report_to_cloud=True),
        DeviceProperty("clock_event_reasons", report_to_cloud=True, visitor_config={"format": "hex"}),
        DeviceProperty("temperature", report_to_cloud=False),
    )
    worker.bind(DeviceConfig("default", "gpu0", "nvidia-gpu", worker.uuid, properties=props))
    worker.desired.set("power_limit", "400", "cloud", 1)
    await worker.tick()
    twins = {t.name: t for t in device_twins(worker)}
    assert set(twins) == {"power_limit", "clock_event_reasons", "desired_status", "policy_state"}
    assert twins["power_limit"].observed_desired == "400" and twins["power_limit"].reported == "400"
    assert twins["clock_event_reasons"].reported.startswith("0x")
    assert twins["clock_event_reasons"].observed_desired == ""
