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
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from mapper import __version__
from mapper.clock import Clock, SystemClock
from mapper.edge.backends import build_process_loop, health_monitor
from mapper.edge.config import Settings
from mapper.edge.control.collect import CollectCounts, Collector, GpuWorker, unbound_device
from mapper.edge.control.healthloop import HealthMonitor
from mapper.edge.control.policy import PolicyEngine, parse_policies
from mapper.edge.control.reconcile import Reconciler
from mapper.edge.gpu.jetson import JetsonBackend
from mapper.edge.gpu.nvml import NvmlBackend
from mapper.edge.kubeedge.binding import Bindings
from mapper.edge.kubeedge.devicefiles import watch_folder
from mapper.edge.kubeedge.doorlimit import InboundLimiter, Versioned
from mapper.edge.kubeedge.registry import Registry
from mapper.edge.kubeedge.report import Reporter, twins_of
from mapper.edge.outbox.compact import Compactor, compaction_settings
from mapper.edge.outbox.publish import Publisher, telemetry_publish
from mapper.edge.outbox.shipper import TelemetryShipper
from mapper.edge.outbox.streams import TelemetryStreams
from mapper.edge.processes.loop import ProcessLoop
from mapper.edge.push.mqtttext import PublishFn
from mapper.edge.push.router import PushRouter
from mapper.edge.push.writers import WriterFactory
from mapper.edge.status.housekeeping import DEFAULT_INTERVAL_S as HOUSEKEEPING_INTERVAL_S
from mapper.edge.status.housekeeping import Housekeeping
from mapper.edge.status.metrics import MetricsServer, write_status_file
from mapper.edge.status.nodestream import SAMPLES_PER_BATCH, NodeStream
from mapper.edge.status.source import StatusSource, run_console
from mapper.edge.status.stats import MapperSnapshot, Readiness
from mapper.edge.storage.buffer import Buffer
from mapper.edge.storage.datadir import require_data_dir
from mapper.edge.storage.pushbuffer import PushBuffer
from mapper.edge.storage.store import DesiredStore
from mapper.errors import ConfigError, MapperError, PermanentError, TransientError
from mapper.net.http import LoopHeartbeat
from mapper.net.mqtt import MAPPER_RECONNECT_MAX_S, ClientIdClaim, MqttSession, MqttSessions, mapper_session
from mapper.shared.model import DeviceConfig, DeviceModelConfig, GpuInfo
from mapper.wire.payloads import STATUS_OFFLINE, STATUS_ONLINE
from mapper.wire.topics import DELTA_FILTER, membership_topic, status_topic

if TYPE_CHECKING:
    # Imported in ``_build`` only when DMI is on: grpc, protobuf and the generated stubs add ~12 MB to the
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
    """One mapper process: the GPUs of this node, their Devices, and every way in and out.

    ``__init__`` keeps what needs no file, no broker and no GPU. ``start`` checks the data directory, waits for
    NVML, builds every other part (``_build``: each is given what it needs when it is made, so the order there
    is what needs what), then opens the ways in and out (``_open``). ``run`` supervises the loops, ``shutdown``
    stops them in order."""

    # Made by ``_build`` (they exist once ``start`` has built them):
    shipper: TelemetryShipper
    streams: TelemetryStreams
    publisher: Publisher
    status: StatusSource
    reporter: Reporter
    bindings: Bindings
    collector: Collector
    housekeeping: Housekeeping
    push: PushRouter

    def __init__(
        self,
        settings: Settings,
        backend: NvmlBackend | JetsonBackend,
        *,
        clock: Clock | None = None,
        housekeeping_interval_s: float = HOUSEKEEPING_INTERVAL_S,
    ) -> None:
        self.settings = settings
        self.backend = backend
        self.clock: Clock = clock or SystemClock()
        self.node = settings.node_name
        self.boot_id = uuidlib.uuid4().hex[:8]  # 8 hex digits: 4 bytes in every batch (docs/telemetry.md)
        self.data_dir = Path(settings.data_dir)
        #: How often the status file is written and the config file looked at.
        self.housekeeping_interval_s = housekeeping_interval_s
        self.policies = PolicyEngine(parse_policies(settings.policies))
        #: Every GPU's worker by UUID, shared by the parts that read them; filled by ``_build``.
        self.workers: dict[str, GpuWorker] = {}
        self.registry = Registry(node_gpus=self.workers.keys)
        #: The MQTT client id: the configured one, else ``gpu-mapper-<node>`` or, where another process of this
        #: host holds that, ``gpu-mapper-<node>-<n>`` (held until shutdown; a broker would let two processes with
        #: one id take each other's session over). Other brokers' sessions add a suffix of their own.
        self.client_id_claim = None if settings.mqtt.client_id else ClientIdClaim(f"gpu-mapper-{settings.node_name}")
        self.client_id = settings.mqtt.client_id or (self.client_id_claim.client_id if self.client_id_claim else "")
        self.sessions = MqttSessions(
            self.client_id,
            reconnect_max_s=MAPPER_RECONNECT_MAX_S,
            reconnect_log_level=logging.DEBUG,  # the shipper logs a broker's return (what waited, the replay)
        )
        #: Deltas and membership updates from the broker: per-device token buckets (docs/security.md).
        self.inbound = InboundLimiter(
            "EventBus messages", settings.inbound_rate_per_s, settings.inbound_burst, clock=self.clock
        )
        self.gpus: list[GpuInfo] = []
        self.driver_version = ""
        self.nvml_ready = False
        # Made by ``_build`` too; None until then, or for good where not configured (no broker, no DMI, no
        # compaction, no health loop or process loop on a Jetson) or not made (the metrics server, by ``_open``).
        self.buffer: Buffer | None = None
        self.push_buffer: PushBuffer | None = None
        self.store: DesiredStore | None = None
        self.session: MqttSession | None = None
        self.compactor: Compactor | None = None
        self.health: HealthMonitor | None = None
        self.processes: ProcessLoop | None = None
        self.node_stream: NodeStream | None = None
        self.dmi_server: DmiServer | None = None
        self.dmi_client: DmiClient | None = None
        self.dmi_reporter: DmiReporter | None = None
        self.metrics: MetricsServer | None = None
        self.exit_code = 0
        self._built = False
        self._stop: asyncio.Event | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._beats: dict[str, LoopHeartbeat] = {}

    # ==============================================================================================
    # start-up: NVML, the parts, the ways in and out
    # ==============================================================================================
    async def start(self) -> None:
        require_data_dir(self.data_dir, ("telemetry.db", "desired.db", "push.db"))
        await self._init_nvml()
        self._build()
        self.bindings.restore_desired()
        await self._open()

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
        log.info("NVML driver %s: %s", self.driver_version, ", ".join(f"{g.uuid} ({g.name})" for g in self.gpus))

    def _build(self) -> None:
        """Every part, each given what it needs when it is made: read top to bottom, this is what needs what."""
        s, clock, node, workers = self.settings, self.clock, self.node, self.workers

        # The files: the telemetry buffer, the push buffer (what the push and DB destinations a Device names have
        # not taken yet; both within one byte cap, buffer.maxBytes) and the desired store.
        self.buffer = Buffer(
            self.data_dir / "telemetry.db",
            max_bytes=s.buffer_max_bytes,
            max_age_s=s.buffer_max_age_s,
            clock=clock,
            shared_bytes=lambda: self.push_buffer.stored_bytes if self.push_buffer is not None else 0,
            memory_max_bytes=s.buffer_memory_max_bytes,
            reserve_bytes=s.buffer_reserve_bytes,
        )
        telemetry = self.buffer
        self.push_buffer = PushBuffer(
            self.data_dir / "push.db",
            max_bytes=s.buffer_max_bytes,
            max_age_s=s.buffer_max_age_s,
            clock=clock,
            shared_bytes=lambda: telemetry.stored_bytes,
        )
        self.store = DesiredStore(self.data_dir / "desired.db", now_ms=clock.wall_ms)

        # The way out. The default broker's session (its last will on the status topic; None: no broker), the
        # shipper (buffer -> MQTT, in id order), the streams (samples -> batches -> shipper: the one way into the
        # buffer, so an ack or event kept there goes after the batches cut before it), the publisher (acks and
        # policy events, kept through the streams while the broker is down; fire-and-forget messages).
        if s.mqtt.url:
            self.session = mapper_session(
                s.mqtt.url, s.mqtt, node, status_topic(node), STATUS_OFFLINE, client_id=self.client_id
            )
            self.sessions.add(self.session)
        self.shipper = TelemetryShipper(
            self.buffer,
            telemetry_publish(self.session),
            node=node,
            clock=clock,
            rate_limit_bytes_per_s=s.replay_rate_bytes_per_s,
            publish_to=self._publisher_for,
        )
        fmt: Literal["binary", "json"] = "json" if s.telemetry_format == "json" else "binary"
        mqtt_text = s.push_mqtt_format == "text"
        self.streams = TelemetryStreams(
            node,
            self.boot_id,
            self.shipper,
            clock=clock,
            window_s=s.telemetry_window_s,
            fmt=fmt,
            qos=s.mqtt.qos,
            mqtt_text=mqtt_text,
        )
        self.publisher = Publisher(node, self.session, clock=clock, qos=s.mqtt.qos, outbox=self.streams)
        compaction = compaction_settings(
            s.buffer_compact_after_s, s.buffer_compact_slot_s, s.buffer_compact_cold_slot_s
        )
        if compaction is not None:
            busy, compacted = self.shipper.busy_ids, self.shipper.note_compacted
            self.compactor = Compactor(self.buffer, clock, compaction, busy=busy, on_compacted=compacted)

        # The push and DB destinations the Devices name (docs/push.md): each sample a property pushes goes into the
        # push buffer in the collect round, and each destination's own task takes it from there.
        writers = WriterFactory(
            timeout_s=s.push_timeout_s,
            ca_file=s.push_ca_file,
            secrets=s.push_secrets,
            publisher_for=self._push_publisher,
            service_version=__version__,
            influxdb2_numbers=s.push_influxdb2_numbers,
        )
        self.push = PushRouter(
            node,
            self.push_buffer,
            writers,
            clock=clock,
            default_report_cycle_ms=s.report_cycle_ms,
            mqtt_text=mqtt_text,
            rate_per_s=s.push_replay_rate_per_s,
            retry_max_s=s.push_retry_max_s,
            write_timeout_s=s.push_timeout_s,
        )

        # The GPUs' other loops: health (its recovery's policy events through the publisher) and who uses each
        # GPU (docs/processes.md; leak events through the publisher, a telemetry row per GPU into the streams).
        # Neither runs on a Jetson; the process loop not when ``processes.interval`` is 0.
        events = self.publisher.publish_events
        self.health = health_monitor(self.backend, workers, self.policies, self.data_dir, clock, events, self._beat)
        self.processes = build_process_loop(
            s, self.backend, workers, self.publisher, self.streams, data_dir=self.data_dir, clock=clock, beat=self._beat
        )

        # DMI, when on: the mapper's server (GetDevice answers with the workers' twins), the client that registers
        # with EdgeCore, the rate-limited reporter over it. grpc and the stubs are imported only here: ~12 MB of
        # RSS a standalone mapper does not carry.
        if s.dmi_enabled:
            from mapper.edge.kubeedge.dmi.parts import build_dmi

            self.dmi_server, self.dmi_client, self.dmi_reporter = build_dmi(
                s, __version__, self.registry, twins_of(workers), self._on_registered, clock, devices=len(self.gpus)
            )

        # The snapshot (/metrics, /status, the status file, the state messages), from the parts that hold each
        # figure; the collector's counts are made here, before the collector, which comes last.
        counts = CollectCounts()
        self.status = StatusSource(
            s,
            __version__,
            workers,
            counts,
            self.publisher,
            self.inbound,
            clock,
            self.processes,
            health=self.health,
            driver_version=self.driver_version,
            buffer=self.buffer,
            shipper=self.shipper,
            session=self.session,
            dmi_client=self.dmi_client,
            dmi_server=self.dmi_server,
            config_errors=self.registry.config_errors,
            push=self.push,
        )

        # The mapper's own series into the telemetry stream (the node stream: the cloud's view of the mapper's
        # health where it cannot scrape the node), one sample every report cycle; only with a broker to carry it.
        if self.session is not None:
            cycle_s = s.report_cycle_ms / 1000
            self.node_stream = NodeStream(
                node,
                self.boot_id,
                self.status.snapshot,
                self.shipper.submit,
                clock=clock,
                cycle_s=cycle_s,
                window_s=max(s.telemetry_window_s, SAMPLES_PER_BATCH * cycle_s),
                fmt=fmt,
                qos=s.mqtt.qos,
                codec=self.streams.codec,
            )

        # Reporting: each bound Device's twins and state over DMI and/or EventBus; with each periodic twin report
        # its retained state message (the snapshot's) to the shipper.
        eventbus = self.publisher.publish_soon if self.session is not None and s.eventbus_enabled else None
        self.reporter = Reporter(
            workers,
            clock=clock,
            report_cycle_ms=s.report_cycle_ms,
            state_report_cycle_ms=s.state_report_cycle_ms,
            dmi=self.dmi_reporter,
            eventbus=eventbus,
            device_state=self.shipper.update_state,
            state_snapshot=self.status.state_message,
            beat=self._beat,
        )

        # Devices on their GPUs and the desired values that reach them (saved in the store); a GPU's new Device
        # takes over its telemetry stream.
        streams = self.streams
        self.bindings = Bindings(
            workers,
            self.registry,
            self.policies,
            self.reporter,
            clock=clock,
            source="cloud" if s.dmi_enabled else "file",
            node=node,
            rebind=lambda worker, device: streams.bind(worker.uuid, device),
            store=self.store,
            max_delta_bytes=s.inbound_max_bytes,
        )
        self.registry.subscribe(self.bindings.on_device_change)

        # The collector: each GPU's finished step goes to its consumers, in this order: its sample into its
        # stream, its acks and policy events out (or kept), the desired state it acked saved, its pushed samples
        # queued (and its push_status twin set), its twins reported. The round's batches and pushed samples are
        # stored once it is done.
        push = self.push

        def store_round() -> None:
            streams.store_round()
            push.store_round()

        self.collector = Collector(
            workers,
            self.backend,
            clock=clock,
            consumers=(self.streams, self.publisher, self.bindings, self.push, self.reporter),
            on_round=store_round,
            beat=self._beat,
            observe=self.status.observe_round,
            observe_lateness=self.status.observe_lateness,
            on_sample=self.publisher.live_sample if s.telemetry_live else None,
            counts=counts,
        )
        # One worker per GPU, its wake running the collector; it streams as ``_unbound/<uuid>`` until a Device
        # names it.
        for info in self.gpus:
            reconciler = Reconciler(self.backend, info.uuid, clock=clock, clamp=s.clamp, restore_modes=s.restore_modes)
            workers[info.uuid] = GpuWorker(
                info=info,
                backend=self.backend,
                reconciler=reconciler,
                policies=self.policies,
                clock=clock,
                min_collect_cycle_ms=s.collect_cycle_ms,
                notify=self.collector.wake.set,
            )
            self.streams.bind(info.uuid, unbound_device(info))

        # The status file and config reloads (policies; each bound GPU's own policy set stays).
        write_status = functools.partial(write_status_file, s.data_dir)
        self.housekeeping = Housekeeping(
            self.status.snapshot,
            write_status,
            s.config_file,
            self.policies,
            self.bindings.policy_overrides,
            self._beat,
            self.housekeeping_interval_s,
            config_errors=self.registry.config_errors,
            retry_saves=self.bindings.save_unsaved,
        )
        self._built = True

    async def _open(self) -> None:
        """The ways in and out: the default broker (its subscriptions behind the door's limits, then the
        session), the DMI server listening, the metrics endpoint."""
        s = self.settings
        if self.session is not None:
            self.session.add_on_connect(self._on_mqtt_connect)
            self.session.add_on_down(self.shipper.notify_down)
            if s.eventbus_enabled:
                # Behind the door's limits: size, then a token of the message's device (docs/security.md).
                limit = s.inbound_max_bytes
                # Desired values over a device's rate wait for its next token (the newest per property wins)
                # and are acked pending/deferred meanwhile.
                delta_door = self.inbound.gate_latest(
                    self.bindings.read_delta,
                    self.bindings.apply_delta,
                    limit,
                    schedule=lambda delay_s, callback: asyncio.get_running_loop().call_later(delay_s, callback),
                    on_deferred=self._deferred,
                    message="EventBus delta",
                )
                self.session.subscribe(DELTA_FILTER, delta_door)
                self.session.subscribe(
                    membership_topic(self.node), self.inbound.gate(self.bindings.on_membership, limit)
                )
            await self.session.start()
        if self.dmi_server is not None:
            await self.dmi_server.start()
        self.metrics = metrics = MetricsServer(
            s.metrics_addr,
            snapshot=self.status.snapshot,
            heartbeats=lambda: list(self._beats.values()),
            readiness=self.readiness,
            loop=asyncio.get_running_loop(),
            web_config_file=s.web_config_file,
        )
        metrics.start()
        log.info(
            "gpu-mapper %s on node %s: %d GPU(s), %s, metrics on %s",
            __version__,
            self.node,
            len(self.workers),
            "DMI via " + s.edgecore_socket if s.dmi_enabled else "standalone",
            metrics.url,
        )

    # ==============================================================================================
    # running, supervision and shutdown
    # ==============================================================================================
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
            self._spawn("shipper", self.shipper.run())
        if self.compactor is not None:
            self._spawn("compactor", self.compactor.run())
        if self.node_stream is not None:
            self._spawn("node-stream", self.node_stream.run(self._beat))
        self._spawn("housekeeping", self.housekeeping.run())
        self._spawn("push", self.push.run())
        if self.processes is not None:
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
        """Everything stopped in order; what start made, whether or not it got that far."""
        log.info("shutting down")
        if self.compactor is not None:
            self.compactor.stop()
        if self.dmi_reporter is not None:
            self.dmi_reporter.stop()
        if self.dmi_client is not None:
            self.dmi_client.stop()
        tasks = self._tasks + (self.publisher.tasks() if self._built else [])
        for task in tasks:
            task.cancel()
        if tasks:
            # Bounded: a task that does not stop must not keep the pod from terminating.
            _, stragglers = await asyncio.wait(tasks, timeout=SHUTDOWN_TASKS_TIMEOUT_S)
            for task in stragglers:
                log.error("task %s did not stop within %.0f s; leaving it", task.get_name(), SHUTDOWN_TASKS_TIMEOUT_S)
        self._tasks.clear()
        if self._built:
            # Whatever was sampled but not yet cut into a batch is stored now, after what a round cut and had not
            # stored yet (a collector that crashed in the middle of publishing its round).
            for what, flush in (
                ("the last samples", self.streams.flush_all),
                ("the push samples of the last round", self.push.store_round),
                ("the node stream's last samples", self.node_stream.flush if self.node_stream is not None else None),
            ):
                if flush is None:
                    continue
                try:
                    flush()
                except Exception:  # a bug: what it could store is stored; the rest of the shutdown goes on
                    log.exception("storing %s at shutdown failed", what)
            with contextlib.suppress(Exception):
                await self.shipper.stop(timeout_s=2.0)
            await self.publisher.publish_offline(timeout_s=2.0)
        with contextlib.suppress(Exception):
            await self.sessions.close(timeout_s=3.0)
        if self.client_id_claim is not None:
            self.client_id_claim.close()
        if self._built:
            # Desired values still waiting at the door for their device's rate: into the desired store, which the
            # next start enforces (no message comes in any more).
            self.inbound.flush()
        if self.dmi_server is not None:
            await self.dmi_server.stop(grace_s=1.0)
        if self.dmi_client is not None:
            await self.dmi_client.close()
        if self.metrics is not None:
            with contextlib.suppress(Exception):
                self.housekeeping.write_status(self.snapshot())
            self.metrics.stop()
        if self.buffer is not None:
            try:
                self.buffer.close()
            except Exception:
                log.exception("closing the buffer failed")
        if self.push_buffer is not None:
            try:
                self.push_buffer.close()
            except Exception:
                log.exception("closing the push buffer failed")
        if self.store is not None:
            if self._built:
                try:  # desired states a full data dir kept from being saved: saved now if it takes them
                    self.bindings.save_unsaved()
                except Exception:
                    log.exception("saving the desired state at shutdown failed")
            try:
                self.store.close()
            except Exception:
                log.exception("closing the desired store failed")
        with contextlib.suppress(MapperError):
            await asyncio.to_thread(self.backend.shutdown)

    # ==============================================================================================
    # callbacks the parts were handed when they were made
    # ==============================================================================================
    def _deferred(self, device_key: str, values: Mapping[str, Versioned]) -> None:
        """Desired values that started to wait at the door: their ``pending``/``deferred`` acks out (or kept)."""
        uuid, acks = self.bindings.deferred_acks(device_key, values)
        if acks:
            self.publisher.publish_step(device_key, uuid, acks, ())

    async def _on_registered(
        self, devices: list[DeviceConfig], models: list[DeviceModelConfig], rejected: list[tuple[str, str]]
    ) -> None:
        """EdgeCore's registration reply (the DMI client's callback), to the bindings. The one part reached
        through the root: the bindings report through the reporter, which sends through the DMI client, so the
        client is made before the bindings; it first registers once it runs, after ``start``."""
        await self.bindings.on_registered(devices, models, rejected)

    async def _publisher_for(self, address: str) -> Callable[..., Awaitable[None]]:
        """A property's ``pushMethod.mqtt.address`` (the shipper's ``publish_to``): its own long-lived session,
        made once; the shipper resumes that broker's backlog whenever it (re)connects."""
        new = address not in self.sessions
        session = await self.sessions.get(address)
        if new:
            session.add_on_connect(lambda: self.shipper.notify_connected(address))
            session.add_on_down(lambda: self.shipper.notify_down(address))
        return session.publish

    async def _push_publisher(self, address: str) -> PublishFn:
        """The publish of a broker for ``pushMethod.mqtt`` as the framework's text: "" the mapper's own broker."""
        if address == "":
            if self.session is None:
                raise PermanentError(
                    "pushMethod.mqtt names no address and the mapper has no broker", reason="no-broker"
                )
            return self.session.publish
        publish: PublishFn = await self._publisher_for(address)
        return publish

    def _on_mqtt_connect(self) -> None:
        """The default broker (re)connected: the shipper's state messages and backlog, the online status, and
        every Device's twins and state again (current state first)."""
        self.shipper.notify_connected("")
        self.publisher.publish_soon(self.publisher.status_topic, STATUS_ONLINE, retain=True)
        self.reporter.resend_all()

    def _beat(self, name: str, period_s: float) -> None:
        self._beats[name] = LoopHeartbeat(name, self.clock.monotonic(), period_s)

    # ==============================================================================================
    # what the endpoints read
    # ==============================================================================================
    def readiness(self) -> Readiness:
        registered = self.dmi_client.registered if self.dmi_client is not None else False
        return Readiness(
            nvml_initialised=self.nvml_ready,
            dmi_registered=registered,
            standalone=not self.settings.dmi_enabled,
            degraded=self.status.degraded() if self._built else (),
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
