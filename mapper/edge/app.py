"""The composition root: builds everything from Settings, runs and supervises the tasks, shuts down in order.

Only this module (and the CLI) sees every concrete class. Nothing else asks "am I simulated?": the choice of
NVML module is made once, in ``build_backend``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import uuid as uuidlib
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mapper import __version__
from mapper.clock import Clock, SystemClock
from mapper.edge.backends import build_process_loop, health_monitor
from mapper.edge.config import Settings
from mapper.edge.control.collect import Collector, GpuWorker, TickResult
from mapper.edge.control.healthloop import HealthMonitor
from mapper.edge.control.policy import PolicyEngine, parse_policies
from mapper.edge.control.reconcile import Reconciler
from mapper.edge.gpu.jetson import JetsonBackend
from mapper.edge.gpu.nvml import NvmlBackend
from mapper.edge.kubeedge.binding import Bindings, unbound_device
from mapper.edge.kubeedge.devicefiles import watch_folder
from mapper.edge.kubeedge.doorlimit import InboundLimiter
from mapper.edge.kubeedge.registry import Registry
from mapper.edge.kubeedge.report import Reporter
from mapper.edge.outbox.compact import Compactor, compaction_settings
from mapper.edge.outbox.publish import Publisher
from mapper.edge.outbox.shipper import TelemetryShipper
from mapper.edge.outbox.streams import TelemetryStreams
from mapper.edge.status.housekeeping import Housekeeping
from mapper.edge.status.metrics import MetricsServer, write_status_file
from mapper.edge.status.source import StatusSource, run_console
from mapper.edge.status.stats import LoopHeartbeat, MapperSnapshot, Readiness
from mapper.edge.storage.buffer import Buffer
from mapper.edge.storage.datadir import require_data_dir
from mapper.edge.storage.store import DesiredStore
from mapper.errors import ConfigError, MapperError, PermanentError, TransientError
from mapper.net.mqtt import MqttSession, MqttSessions, mapper_session
from mapper.shared.model import GpuInfo, Sample
from mapper.wire.eventbus import DELTA_FILTER, membership_topic

if TYPE_CHECKING:
    # Imported in ``start`` only when DMI is on: grpc, protobuf and the generated stubs add ~12 MB to the
    # process's RSS, which a standalone mapper (devices folder, no EdgeCore) would carry for nothing.
    from mapper.edge.kubeedge.dmi.client import DmiClient, DmiReporter
    from mapper.edge.kubeedge.dmi.server import DmiServer

log = logging.getLogger("mapper.edge.app")

#: How long shutdown waits for the cancelled tasks.
SHUTDOWN_TASKS_TIMEOUT_S = 5.0


class StartInterrupted(Exception):
    """The stop event was set while start-up waited (NVML not ready): shut down without running."""


def build_backend(
    settings: Settings, clock: Clock | None = None, *, one_shot: bool = False
) -> NvmlBackend | JetsonBackend:
    """The NVML backend over the real ``pynvml`` or, with ``--sim N``, over the simulated NVML; a Jetson's
    backend where ``mapper.edge.backends.wants_jetson`` says so. ``one_shot``: for a command that exits after its
    calls (errors without the daemon's retry wording)."""
    from mapper.edge.backends import build_jetson_backend, wants_jetson

    if wants_jetson(settings):
        return build_jetson_backend(settings, clock, one_shot=one_shot)
    if settings.sim:
        from mapper.edge.gpu.simnvml import SimNvml

        nvml: Any = SimNvml(
            settings.sim,
            settings.sim_profile,
            seed=settings.sim_seed,
            scenario=settings.sim_scenario,
            cost=settings.sim_cost,
            clock=(clock or SystemClock()).monotonic,
            # As the NVIDIA driver does: only root may change GPU settings (reads work for anyone).
            as_root=os.geteuid() == 0,
        )
    else:
        import pynvml

        nvml = pynvml
    return NvmlBackend(nvml, clock=clock, one_shot=one_shot)


class MapperApp:
    """One mapper process: the GPUs of this node, their Devices, and every way in and out."""

    def __init__(self, settings: Settings, backend: NvmlBackend | JetsonBackend, *, clock: Clock | None = None) -> None:
        self.settings = settings
        self.backend = backend
        self.clock: Clock = clock or SystemClock()
        self.node = settings.node_name
        self.boot_id = uuidlib.uuid4().hex[:8]  # 8 hex digits: 4 bytes in every batch (docs/telemetry.md)
        self.data_dir = Path(settings.data_dir)
        self.policies = PolicyEngine(parse_policies(settings.policies))
        self.registry = Registry(node_gpus=lambda: self.workers.keys())
        self.workers: dict[str, GpuWorker] = {}
        self.streams = TelemetryStreams(
            self.node,
            self.boot_id,
            window_s=settings.telemetry_window_s,
            fmt="json" if settings.telemetry_format == "json" else "binary",
            qos=settings.mqtt.qos,
        )
        self.gpus: list[GpuInfo] = []
        self.driver_version = ""
        self.nvml_ready = False
        self.buffer: Buffer | None = None
        self.store: DesiredStore | None = None
        self.shipper: TelemetryShipper | None = None
        self.compactor: Compactor | None = None
        self.sessions = MqttSessions(settings.mqtt.client_id or f"gpu-mapper-{settings.node_name}")
        self.session: MqttSession | None = None
        self.dmi_client: DmiClient | None = None
        self.dmi_reporter: DmiReporter | None = None
        self.dmi_server: DmiServer | None = None
        self.metrics: MetricsServer | None = None
        self.health: HealthMonitor | None = None
        self.exit_code = 0
        self._stop: asyncio.Event | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._beats: dict[str, LoopHeartbeat] = {}
        self.collector = Collector(
            self.workers,
            backend,
            clock=self.clock,
            on_step=self._after_tick,
            on_round=self.streams.store_round,
            beat=self._beat,
            observe=lambda duration_s: self.status.observe_round(duration_s),
            observe_lateness=lambda late_s, behind_s: self.status.observe_lateness(late_s, behind_s),
            on_sample=self._live if settings.telemetry_live else None,
        )
        self.publisher = Publisher(
            self.node, None, clock=self.clock, qos=settings.mqtt.qos, before_keep=self.streams.store_round
        )
        self.reporter = Reporter(
            self.workers,
            clock=self.clock,
            report_cycle_ms=settings.report_cycle_ms,
            state_report_cycle_ms=settings.state_report_cycle_ms,
            beat=self._beat,
        )
        self.bindings = Bindings(
            self.workers,
            self.registry,
            self.policies,
            self.reporter,
            clock=self.clock,
            source="cloud" if settings.dmi_enabled else "file",
            node=self.node,
            rebind=lambda worker, device: self.streams.bind(worker.uuid, device),
        )
        self.registry.subscribe(self.bindings.on_device_change)
        #: Who uses each GPU (docs/processes.md); None when ``processes.interval`` is 0, and on a Jetson (its
        #: per-process use is not read: docs/jetson.md).
        self.processes = build_process_loop(
            settings, backend, self.workers, self.publisher, self.streams, data_dir=self.data_dir, clock=self.clock
        )
        self.bindings.max_delta_bytes = settings.inbound_max_bytes
        #: Deltas and membership updates from the broker: per-device token buckets (docs/security.md).
        self.inbound = InboundLimiter(
            "EventBus messages", settings.inbound_rate_per_s, settings.inbound_burst, clock=self.clock.monotonic
        )
        parts = (self.workers, self.collector, self.publisher, self.inbound, self.clock)
        self.status = StatusSource(settings, __version__, *parts, processes=self.processes)
        #: The status file and config reloads (its ``interval_s``: how often).
        write_status = functools.partial(write_status_file, settings.data_dir)
        overrides = self.bindings.policy_overrides
        self.housekeeping = Housekeeping(
            self.snapshot, write_status, settings.config_file, self.policies, overrides, self._beat
        )

    # ==============================================================================================
    # start-up and shutdown
    # ==============================================================================================
    async def start(self) -> None:
        require_data_dir(self.data_dir, ("telemetry.db", "desired.db"))
        await self._init_nvml()
        self.buffer = Buffer(
            self.data_dir / "telemetry.db",
            max_bytes=self.settings.buffer_max_bytes,
            max_age_s=self.settings.buffer_max_age_s,
            clock=self.clock,
        )
        self.store = DesiredStore(self.data_dir / "desired.db", now_ms=self.clock.wall_ms)
        self.bindings.store = self.store
        self.bindings.restore_desired()
        if self.settings.mqtt.url:
            self.session = mapper_session(
                self.settings.mqtt.url, self.settings.mqtt, self.node, self.publisher.status_topic
            )
            self.sessions.add(self.session)
            self.publisher.session = self.session
            if self.settings.eventbus_enabled:
                self.reporter.eventbus = self.publisher.publish_soon
        self.shipper = TelemetryShipper(
            self.buffer,
            self.publisher.publish_telemetry,
            node=self.node,
            clock=self.clock,
            rate_limit_bytes_per_s=self.settings.replay_rate_bytes_per_s,
            publish_to=self._publisher_for,
        )
        self.publisher.shipper = self.shipper
        self.streams.shipper = self.shipper
        self.reporter.device_state = self.shipper.update_state
        self.reporter.state_snapshot = self.status.state_message
        s = self.settings
        compaction = compaction_settings(
            s.buffer_compact_after_s, s.buffer_compact_slot_s, s.buffer_compact_cold_slot_s
        )
        if compaction is not None:
            busy, compacted = self.shipper.busy_ids, self.shipper.note_compacted
            self.compactor = Compactor(self.buffer, self.clock, compaction, busy=busy, on_compacted=compacted)
        if self.session is not None:
            self.session.add_on_connect(self._on_mqtt_connect)
            if self.settings.eventbus_enabled:
                # Behind the door's limits: size, then a token of the message's device (docs/security.md).
                limit = self.settings.inbound_max_bytes
                self.session.subscribe(DELTA_FILTER, self.inbound.gate(self.bindings.on_delta, limit))
                self.session.subscribe(
                    membership_topic(self.node), self.inbound.gate(self.bindings.on_membership, limit)
                )
            await self.session.start()
        if self.settings.dmi_enabled:
            from mapper.edge.kubeedge.dmi.parts import start_dmi

            twins, registered = self.reporter.twins_of_device, self.bindings.on_registered
            n = len(self.workers)
            dmi = await start_dmi(self.settings, __version__, self.registry, twins, registered, self.clock, devices=n)
            self.dmi_server, self.dmi_client, self.dmi_reporter = dmi
            self.reporter.dmi = self.dmi_reporter
        made = (self.buffer, self.shipper, self.session, self.dmi_client, self.dmi_server)
        self.status.attach(self.driver_version, *made)
        self.metrics = MetricsServer(
            self.settings.metrics_addr,
            snapshot=self.snapshot,
            heartbeats=lambda: list(self._beats.values()),
            readiness=self.readiness,
            loop=asyncio.get_running_loop(),
            web_config_file=self.settings.web_config_file,
        )
        self.metrics.start()
        log.info(
            "gpu-mapper %s on node %s: %d GPU(s), %s, metrics on %s",
            __version__,
            self.node,
            len(self.workers),
            "DMI via " + self.settings.edgecore_socket if self.settings.dmi_enabled else "standalone",
            self.metrics.url,
        )

    async def _init_nvml(self) -> None:
        """NVML initialised and the GPUs listed, retried with backoff while NVML is not ready; a stop meanwhile
        (SIGTERM) ends the wait at once with ``StartInterrupted``."""
        delay_s = 1.0
        while True:
            try:
                await self._unless_stopped(asyncio.to_thread(self.backend.init), "NVML init")
                self.gpus = await self._unless_stopped(asyncio.to_thread(self.backend.list_gpus), "listing GPUs")
                self.driver_version = await asyncio.to_thread(self.backend.driver_version)
                break
            except PermanentError:
                raise
            except TransientError as exc:
                log.warning("NVML is not ready (retry in %.0f s): %s", delay_s, exc)
                await self._unless_stopped(asyncio.sleep(delay_s), "the wait for NVML")
                delay_s = min(delay_s * 2, 30.0)
        self.nvml_ready = True
        for info in self.gpus:
            reconciler = Reconciler(
                self.backend,
                info.uuid,
                clock=self.clock,
                clamp=self.settings.clamp,
                restore_modes=self.settings.restore_modes,
            )
            self.workers[info.uuid] = GpuWorker(
                info=info,
                backend=self.backend,
                reconciler=reconciler,
                policies=self.policies,
                clock=self.clock,
                min_collect_cycle_ms=self.settings.collect_cycle_ms,
                notify=self.collector.wake.set,
            )
            self.streams.bind(info.uuid, unbound_device(info))
        emit = lambda w, events: self.publisher.publish_step(self._device_key(w), w.uuid, (), events)  # noqa: E731
        self.health = health_monitor(self.backend, self.workers, self.policies, self.data_dir, self.clock, emit)
        self.status.health = self.health
        if self.health is not None:
            self.health.beat = self._beat
        log.info("NVML driver %s: %s", self.driver_version, ", ".join(f"{g.uuid} ({g.name})" for g in self.gpus))

    async def run(self, stop: asyncio.Event, on_started: Callable[[], None] | None = None) -> int:
        """Start, run every loop until ``stop`` is set, shut down; the exit code. ``on_started`` is called once
        everything has started (the CLI freezes the start-up heap for the garbage collector there)."""
        self._stop = stop
        try:
            await self.start()
        except (ConfigError, PermanentError) as exc:
            log.error("cannot start: %s", exc)
            await self.shutdown()
            return 2 if isinstance(exc, ConfigError) else 1
        except StartInterrupted as exc:
            log.info("%s", exc)
            await self.shutdown()
            return self.exit_code
        self._spawn("collect", self.collector.run())
        if self.health is not None:
            self._spawn("health", self.health.run())
        self._spawn("report", self.reporter.run())
        if self.session is not None:
            # Without a broker the batches only accumulate in the buffer, bounded by its caps.
            self._spawn("shipper", self._run_shipper())
        if self.compactor is not None:
            self._spawn("compactor", self.compactor.run())
        self._spawn("housekeeping", self.housekeeping.run())
        if self.processes is not None:
            self.processes.beat = self._beat
            self._spawn("processes", self.processes.run())
        if self.dmi_client is not None and self.dmi_reporter is not None:
            self._spawn("dmi-client", self.dmi_client.run())
            self._spawn("dmi-reporter", self.dmi_reporter.run())
        if self.settings.devices_dir is not None:
            self._spawn(
                "devices-dir",
                watch_folder(self.settings.devices_dir, self.node, self.bindings.apply_folder, self._beat),
            )
        if self.settings.print_interval_s > 0:
            self._spawn("console", run_console(self.status, self.settings.print_interval_s, self._beat))
        if on_started is not None:
            on_started()
        await stop.wait()
        await self.shutdown()
        return self.exit_code

    def _spawn(self, name: str, coro: Coroutine[Any, Any, None]) -> None:
        async def guarded() -> None:
            try:
                await coro
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("task %s crashed; stopping the mapper so that it is restarted", name)
                self.exit_code = 1
                if self._stop is not None:
                    self._stop.set()

        self._tasks.append(asyncio.create_task(guarded(), name=name))

    async def _unless_stopped(self, work: Awaitable[Any], what: str) -> Any:
        """``work``'s result, or ``StartInterrupted`` as soon as the stop event is set (a blocking call in a
        thread runs on, and its result is dropped)."""
        if self._stop is None:
            return await work
        job = asyncio.ensure_future(work)
        stopped = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait((job, stopped), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
        if not job.done():
            job.cancel()
            raise StartInterrupted(f"stopped during {what}")
        return job.result()

    async def shutdown(self) -> None:
        log.info("shutting down")
        if self.compactor is not None:
            self.compactor.stop()
        if self.dmi_reporter is not None:
            self.dmi_reporter.stop()
        if self.dmi_client is not None:
            self.dmi_client.stop()
        tasks = self._tasks + self.publisher.tasks()
        for task in tasks:
            task.cancel()
        if tasks:
            # Bounded: a task that does not stop must not keep the pod from terminating.
            _, stragglers = await asyncio.wait(tasks, timeout=SHUTDOWN_TASKS_TIMEOUT_S)
            for task in stragglers:
                log.error("task %s did not stop within %.0f s; leaving it", task.get_name(), SHUTDOWN_TASKS_TIMEOUT_S)
        self._tasks.clear()
        # Whatever was sampled but not yet cut into a batch is stored now, after what a round cut and had not
        # stored yet (a collector that crashed in the middle of publishing its round).
        self.streams.flush_all()
        if self.shipper is not None:
            with contextlib.suppress(Exception):
                await self.shipper.stop(timeout_s=2.0)
        await self.publisher.publish_offline(timeout_s=2.0)
        with contextlib.suppress(Exception):
            await self.sessions.close(timeout_s=3.0)
        if self.dmi_server is not None:
            await self.dmi_server.stop(grace_s=1.0)
        if self.dmi_client is not None:
            await self.dmi_client.close()
        if self.metrics is not None:
            with contextlib.suppress(Exception):
                self.housekeeping.write_status(self.snapshot())
            self.metrics.stop()
        if self.buffer is not None:
            self.buffer.close()
        if self.store is not None:
            self.store.close()
        with contextlib.suppress(MapperError):
            await asyncio.to_thread(self.backend.shutdown)

    # ==============================================================================================
    # the collector's steps: telemetry, acks and events, reports
    # ==============================================================================================
    def _live(self, worker: GpuWorker, sample: Sample) -> None:
        if worker.device is not None:
            self.publisher.publish_live(worker.device.key, sample)

    @staticmethod
    def _device_key(worker: GpuWorker) -> str:
        return worker.device.key if worker.device is not None else unbound_device(worker.info).key

    def _after_tick(self, worker: GpuWorker, result: TickResult) -> None:
        if result.sample is not None:
            self.streams.add(worker.uuid, result.sample, self.clock.wall_ms())
        acks = result.reconcile.acks if result.reconcile is not None else ()
        events = result.decision.events if result.decision is not None else ()
        if acks or events:  # (most steps publish neither: the device key is worked out only when one does)
            device_key = self._device_key(worker)
            self.publisher.publish_step(device_key, worker.uuid, acks, events)
            if acks:
                self.bindings.save_desired(worker, device_key)
        self.reporter.after_step(worker, result)

    # ==============================================================================================
    # MQTT
    # ==============================================================================================
    async def _publisher_for(self, address: str) -> Callable[..., Awaitable[None]]:
        """A property's ``pushMethod.mqtt.address``: its own long-lived session, made once."""
        new = address not in self.sessions
        session = await self.sessions.get(address)
        if new:
            session.add_on_connect(lambda: self.shipper.notify_connected(address) if self.shipper else None)
        return session.publish

    def _on_mqtt_connect(self) -> None:
        if self.shipper is not None:
            self.shipper.notify_connected("")
        self.publisher.publish_soon(self.publisher.status_topic, b"online", retain=True)
        # Current state first: every device's twins and state go out again on reconnect.
        self.reporter.resend_all()

    async def _run_shipper(self) -> None:
        assert self.shipper is not None
        await self.shipper.run()

    # ==============================================================================================
    # health, metrics, status, housekeeping
    # ==============================================================================================
    def _beat(self, name: str, period_s: float) -> None:
        self._beats[name] = LoopHeartbeat(name, self.clock.monotonic(), period_s)

    def readiness(self) -> Readiness:
        registered = self.dmi_client.registered if self.dmi_client is not None else False
        return Readiness(
            nvml_initialised=self.nvml_ready, dmi_registered=registered, standalone=not self.settings.dmi_enabled
        )

    def snapshot(self) -> MapperSnapshot:
        return self.status.snapshot()


async def run(settings: Settings, stop: asyncio.Event, on_started: Callable[[], None] | None = None) -> int:
    """Entry point of ``gpu-mapper run`` (``on_started``: see ``MapperApp.run``)."""
    clock = SystemClock()
    try:
        backend = build_backend(settings, clock)
    except ImportError as exc:
        log.error("cannot load NVML: %s", exc)
        return 1
    app = MapperApp(settings, backend, clock=clock)
    return await app.run(stop, on_started)
