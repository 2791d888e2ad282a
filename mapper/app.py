"""The composition root: builds everything from Settings, runs and supervises the tasks, shuts down in order.

Only this module (and the CLI) sees every concrete class. Nothing else asks "am I simulated?": the choice of
NVML module is made once, in ``build_backend``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import time
import uuid as uuidlib
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mapper import __version__
from mapper.buffer import Buffer
from mapper.clock import Clock, SystemClock, next_on_grid, sleep_or_wake
from mapper.collect import DUE_SLACK_S, GpuWorker, TickResult, call_backend
from mapper.config import Settings, read_file
from mapper.datadir import prepare_data_dir
from mapper.desired import Source
from mapper.devicefiles import FolderWatcher, load_folder
from mapper.errors import ConfigError, MapperError, PermanentError, TransientError
from mapper.eventbus import (
    DELTA_FILTER,
    membership_topic,
    parse_delta,
    parse_membership,
    state_update_payload,
    state_update_topic,
    twin_update_payload,
    twin_update_topic,
)
from mapper.gpu.nvml import NvmlBackend, SampleRound
from mapper.metrics import MetricsServer, fetch_status, read_status_file, write_status_file
from mapper.model import (
    PROPERTY_BY_NAME,
    DeviceConfig,
    DeviceModelConfig,
    GpuEvent,
    GpuInfo,
    Sample,
    Twin,
    format_value,
)
from mapper.mqtt import MqttSession, MqttSessions
from mapper.policy import PolicyEngine, parse_policies
from mapper.reconcile import Reconciler, ack_to_json
from mapper.registry import DeviceChange, PreconditionError, Registry
from mapper.shipper import TelemetryShipper
from mapper.stats import DurationHistogram, GpuSnapshot, LoopHeartbeat, MapperSnapshot, Readiness
from mapper.store import DesiredStore
from mapper.telemetry import BatchCodec, DeviceTelemetry, EncodedBatch, Route, state_payload

if TYPE_CHECKING:
    # Imported in ``start`` only when DMI is on: grpc, protobuf and the generated stubs add ~12 MB to the
    # process's RSS, which a standalone mapper (devices folder, no EdgeCore) would carry for nothing.
    from mapper.dmi.client import DmiClient, DmiReporter
    from mapper.dmi.server import DmiServer

log = logging.getLogger("mapper.app")

#: How long shutdown waits for the cancelled tasks.
SHUTDOWN_TASKS_TIMEOUT_S = 5.0
#: NVML's events (XID, ECC, GPU lost, driver reload) are polled this often, in the collector's NVML job.
EVENTS_POLL_S = 1.0

#: Twins the mapper computes itself; reported for every bound Device.
STATUS_TWINS = ("desired_status", "policy_state")


class StartInterrupted(Exception):
    """The stop event was set while start-up waited (NVML not ready): shut down without running."""


def build_backend(settings: Settings, clock: Clock | None = None) -> NvmlBackend:
    """The NVML backend over the real ``pynvml`` or, with ``--sim N``, over the simulated NVML."""
    if settings.sim:
        from mapper.gpu.simnvml import SimNvml

        nvml: Any = SimNvml(
            settings.sim,
            settings.sim_profile,
            seed=settings.sim_seed,
            scenario=settings.sim_scenario,
            clock=(clock or SystemClock()).monotonic,
            # As the NVIDIA driver does: only root may change GPU settings (reads work for anyone).
            as_root=os.geteuid() == 0,
        )
    else:
        import pynvml

        nvml = pynvml
    return NvmlBackend(nvml, clock=clock)


def read_status(url: str | None = None, data_dir: str | None = None) -> MapperSnapshot:
    """The snapshot of a running mapper (its HTTP /status), or the last one it wrote to its data directory."""
    if data_dir is not None and url is None:
        return read_status_file(data_dir)
    return fetch_status(url or "http://127.0.0.1:9410")


def _unbound_device(info: GpuInfo) -> DeviceConfig:
    """The telemetry identity of a GPU no Device names: ``_unbound/<uuid>``."""
    return DeviceConfig(namespace="_unbound", name=info.uuid.lower(), model="", uuid=info.uuid)


class MapperApp:
    """One mapper process: the GPUs of this node, their Devices, and every way in and out."""

    def __init__(self, settings: Settings, backend: NvmlBackend, *, clock: Clock | None = None) -> None:
        self.settings = settings
        self.backend = backend
        self.clock: Clock = clock or SystemClock()
        self.node = settings.node_name
        self.boot_id = uuidlib.uuid4().hex[:8]  # 8 hex digits: 4 bytes in every batch (docs/telemetry.md)
        self.data_dir = Path(settings.data_dir)
        self.policies = PolicyEngine(parse_policies(settings.policies))
        self.registry = Registry(node_gpus=lambda: self.workers.keys())
        self.registry.subscribe(self._on_device_change)
        self.workers: dict[str, GpuWorker] = {}
        self.telemetry: dict[str, DeviceTelemetry] = {}
        #: One zstd context (with its dictionary, ~2 MB) shared by every device's batches.
        self.codec = BatchCodec()
        self.gpus: list[GpuInfo] = []
        self.driver_version = ""
        self.nvml_ready = False
        self.buffer: Buffer | None = None
        self.store: DesiredStore | None = None
        self.shipper: TelemetryShipper | None = None
        self.sessions = MqttSessions(settings.mqtt.client_id or f"gpu-mapper-{settings.node_name}")
        self.session: MqttSession | None = None
        self.dmi_client: DmiClient | None = None
        self.reporter: DmiReporter | None = None
        self.dmi_server: DmiServer | None = None
        self.metrics: MetricsServer | None = None
        self.exit_code = 0
        self._stop: asyncio.Event | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._beats: dict[str, LoopHeartbeat] = {}
        self._collect_hist = DurationHistogram()
        self._collect_errors: dict[str, int] = {}
        #: The telemetry batches cut in the current collect round, stored together at its end (one transaction).
        self._round_batches: list[tuple[EncodedBatch, Route | None]] = []
        self._policy_events: dict[tuple[str, str], int] = {}
        self._xids: dict[str, dict[int, int]] = {}
        self._next_report_s: dict[str, float] = {}
        self._next_state_s: dict[str, float] = {}
        self._reported_state: dict[str, str] = {}
        self._config_mtime = 0.0
        self._background: set[asyncio.Task[Any]] = set()
        #: Set to report at once (a state changed, a device was bound, the broker came back).
        self._report_wake = asyncio.Event()
        #: Set by a GPU's ``wake`` (a desired value, a Device bound, an NVML event): the collector runs at once.
        self._collect_wake = asyncio.Event()
        #: How often the status file is written and the config file checked for changes. (Each round wakes the
        #: loop and a thread; the status file is the offline fallback of ``gpu-mapper status``, /status is live.)
        self.housekeeping_interval_s = 10.0

    # ==============================================================================================
    # start-up and shutdown
    # ==============================================================================================
    async def start(self) -> None:
        prepare_data_dir(self.data_dir, ("telemetry.db", "desired.db"))
        await self._init_nvml()
        self.buffer = Buffer(
            self.data_dir / "telemetry.db",
            max_bytes=self.settings.buffer_max_bytes,
            max_age_s=self.settings.buffer_max_age_s,
            clock=self.clock,
        )
        self.store = DesiredStore(self.data_dir / "desired.db", now_ms=self.clock.wall_ms)
        self._restore_desired()
        if self.settings.mqtt.url:
            self.session = self._make_session(self.settings.mqtt.url)
            self.sessions.add(self.session)
        self.shipper = TelemetryShipper(
            self.buffer,
            self._publish_default,
            node=self.node,
            clock=self.clock,
            rate_limit_bytes_per_s=self.settings.replay_rate_bytes_per_s,
            publish_to=self._publisher_for,
        )
        if self.session is not None:
            self.session.add_on_connect(self._on_mqtt_connect)
            if self.settings.eventbus_enabled:
                self.session.subscribe(DELTA_FILTER, self._on_delta)
                self.session.subscribe(membership_topic(self.node), self._on_membership)
            await self.session.start()
        if self.settings.dmi_enabled:
            from mapper.dmi.client import DmiClient, DmiReporter
            from mapper.dmi.server import DmiServer

            self.dmi_server = DmiServer(self.registry, self._twins_of_device, socket_path=self.settings.socket)
            await self.dmi_server.start()
            self.dmi_client = DmiClient(
                edgecore_socket=self.settings.edgecore_socket,
                mapper_socket=self.settings.socket,
                version=__version__,
                rate_per_s=self.settings.dmi_rate_per_s,
                burst=self.settings.dmi_burst,
                clock=self.clock,
                on_registered=self._on_registered,
            )
            self.reporter = DmiReporter(self.dmi_client, clock=self.clock)
        self.metrics = MetricsServer(
            self.settings.metrics_addr,
            snapshot=self.snapshot,
            heartbeats=lambda: list(self._beats.values()),
            readiness=self.readiness,
            loop=asyncio.get_running_loop(),
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
                notify=self._collect_wake.set,
            )
            self.telemetry[info.uuid] = self._new_telemetry(_unbound_device(info))
        log.info("NVML driver %s: %s", self.driver_version, ", ".join(f"{g.uuid} ({g.name})" for g in self.gpus))

    def _restore_desired(self) -> None:
        """Desired state persisted by an earlier run is enforced again, with or without EdgeCore."""
        assert self.store is not None
        for stored in self.store.load_all():
            worker = self.workers.get(stored.uuid)
            if worker is None:
                log.warning("persisted desired state of %s names GPU %s, not on this node", stored.device, stored.uuid)
                continue
            worker.desired = stored.state
            log.info(
                "restored desired state of %s (GPU %s): %s",
                stored.device,
                stored.uuid,
                ", ".join(f"{k}={v.raw}" for k, v in stored.state.effective().items()) or "defaults to restore",
            )

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
        self._spawn("collect", self._collect_loop())
        self._spawn("report", self._report_loop())
        if self.session is not None:
            # Without a broker the batches only accumulate in the buffer, bounded by its caps.
            self._spawn("shipper", self._run_shipper())
        self._spawn("housekeeping", self._housekeeping_loop())
        if self.dmi_client is not None and self.reporter is not None:
            self._spawn("dmi-client", self.dmi_client.run())
            self._spawn("dmi-reporter", self.reporter.run())
        if self.settings.devices_dir is not None:
            self._spawn("devices-dir", self._folder_loop(self.settings.devices_dir))
        if self.settings.print_interval_s > 0:
            self._spawn("console", self._console_loop(self.settings.print_interval_s))
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

    def _background_task(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def shutdown(self) -> None:
        log.info("shutting down")
        if self.reporter is not None:
            self.reporter.stop()
        if self.dmi_client is not None:
            self.dmi_client.stop()
        tasks = self._tasks + list(self._background)
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
        if self.shipper is not None:
            for telemetry in self.telemetry.values():
                self._round_batches.extend((batch, route) for route, batch in telemetry.flush())
            self._store_round_batches()
            with contextlib.suppress(Exception):
                await self.shipper.stop(timeout_s=2.0)
        if self.session is not None and self.session.connected:
            with contextlib.suppress(MapperError):
                await self.session.publish(self._status_topic(), b"offline", qos=1, retain=True, timeout_s=2.0)
        with contextlib.suppress(Exception):
            await self.sessions.close(timeout_s=3.0)
        if self.dmi_server is not None:
            await self.dmi_server.stop(grace_s=1.0)
        if self.dmi_client is not None:
            await self.dmi_client.close()
        if self.metrics is not None:
            with contextlib.suppress(Exception):
                write_status_file(self.settings.data_dir, self.snapshot())
            self.metrics.stop()
        if self.buffer is not None:
            self.buffer.close()
        if self.store is not None:
            self.store.close()
        with contextlib.suppress(MapperError):
            await asyncio.to_thread(self.backend.shutdown)

    # ==============================================================================================
    # devices: DMI, files, EventBus
    # ==============================================================================================
    def _desired_source(self) -> Source:
        return "cloud" if self.settings.dmi_enabled else "file"

    def _on_device_change(self, change: DeviceChange) -> None:
        """Registry listener: bookkeeping only (DMI handlers must answer fast); the GPU loop does the work."""
        device = change.device
        previous = change.previous
        moved = change.kind == "updated" and previous is not None and previous.uuid != device.uuid
        if moved and previous is not None:
            # The Device now names another GPU: the old GPU is released first, as if the Device had gone.
            self._on_device_change(DeviceChange("removed", previous, previous))
        worker = self.workers.get(device.uuid)
        if worker is None:
            return
        now_ms = self.clock.wall_ms()
        if change.kind == "removed":
            if worker.device is not None and worker.device.key == device.key:
                worker.desired.sync_source(self._desired_source(), {}, now_ms)
                worker.bind(None)
                self.policies.set_override(worker.uuid, None)
                self._rebind_telemetry(worker, _unbound_device(worker.info))
                self._next_report_s.pop(device.key, None)
                self._next_state_s.pop(device.key, None)
                if self.reporter is not None:
                    self.reporter.forget(device.namespace, device.name)
                self._save_desired(worker, device.key)
                log.info("device %s removed; GPU %s returns to its defaults", device.key, worker.uuid)
            return
        if change.desired_changed or moved:
            desired = {p.name: p.desired for p in device.properties if p.desired is not None}
            changes = worker.desired.sync_source(self._desired_source(), desired, now_ms)
            if changes:
                log.info(
                    "desired values of %s changed: %s",
                    device.key,
                    ", ".join(f"{c.prop}={c.after.raw if c.after else '(removed)'}" for c in changes),
                )
        if change.kind == "added" or change.cycles_changed:
            try:
                self.policies.set_override(worker.uuid, _policy_override(device))
            except ConfigError as exc:
                log.error("device %s: policy override refused, node policies apply: %s", device.key, exc)
            worker.bind(device)
            self._rebind_telemetry(worker, device)
            self._next_report_s[device.key] = 0.0
            self._next_state_s[device.key] = 0.0
            self._report_wake.set()
        self._save_desired(worker, device.key)
        worker.wake()

    def _save_desired(self, worker: GpuWorker, device_key: str) -> None:
        if self.store is None:
            return
        try:
            self.store.save(device_key, worker.desired, uuid=worker.uuid)
        except MapperError as exc:
            log.error("could not persist the desired state of %s: %s", device_key, exc)

    async def _on_registered(self, devices: list[DeviceConfig], models: list[DeviceModelConfig]) -> None:
        changes, errors = self.registry.sync(devices, models)
        for key, exc in errors:
            log.error("EdgeCore sent %s, refused: %s", key, exc)
            namespace, _, name = key.partition("/")
            if isinstance(exc, PreconditionError) and self.reporter is not None and name:
                # Its GPU is missing from this node (removed, or fell off the bus before we started).
                self.reporter.offer_state(namespace, name, "offline")
        log.info("EdgeCore registration: %d device(s) on this mapper, %d changed", len(devices), len(changes))

    async def _folder_loop(self, path: str) -> None:
        """Re-read the devices folder when it changed. inotify wakes the loop (an idle folder costs no wake-up;
        a 60 s safety poll remains); where the folder cannot be watched, it is polled every 2 s."""
        watcher = FolderWatcher(path)
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        reader_fd: int | None = None
        event_seen = False

        def on_readable() -> None:
            nonlocal event_seen, reader_fd
            # Read the events here: the descriptor stays readable (and the loop spins) until they are read.
            event_seen = watcher.drain() or event_seen
            if watcher.fileno() is None and reader_fd is not None:  # inotify failed: polling from now on
                loop.remove_reader(reader_fd)
                reader_fd = None
            wake.set()

        try:
            while True:
                if watcher.changed():
                    contents = await asyncio.to_thread(load_folder, path, self.node)
                    for file, reason in contents.errors:
                        log.error("devices folder: %s skipped: %s", file, reason)
                    changes, errors = self.registry.sync(contents.devices, contents.models)
                    for key, exc in errors:
                        log.error("devices folder: %s refused: %s", key, exc)
                    log.info(
                        "devices folder %s: %d device(s), %d model(s), %d change(s)",
                        path,
                        len(contents.devices),
                        len(contents.models),
                        len(changes),
                    )
                fd = watcher.fileno()  # an inotify instance created on a later look needs its reader
                if fd != reader_fd:
                    if reader_fd is not None:
                        loop.remove_reader(reader_fd)
                    if fd is not None:
                        loop.add_reader(fd, on_readable)
                    reader_fd = fd
                period_s = watcher.poll_interval_s
                # Beat with the real sleep, so a watched folder's 60 s safety poll never looks like a stall.
                self._beat("devices-dir", period_s)
                await sleep_or_wake(wake, period_s)
                if event_seen:
                    # Coalesce a burst (an editor's save, a ConfigMap update): look once it has settled. Events
                    # during the pause are read by on_readable and covered by the look that follows.
                    await asyncio.sleep(watcher.settle_s)
                    event_seen = False
                    wake.clear()
        finally:
            if reader_fd is not None:
                loop.remove_reader(reader_fd)
            watcher.close()

    def _on_delta(self, topic: str, payload: bytes) -> None:
        """An edge application set desired values through ``twin/update/delta``."""
        try:
            delta = parse_delta(topic, payload)
        except ValueError as exc:
            log.warning("EventBus delta refused: %s", exc)
            return
        try:
            device = self.registry.get_device(delta.namespace, delta.name)
        except MapperError:
            log.warning("EventBus delta for %s/%s: no such GPU device on this mapper", delta.namespace, delta.name)
            return
        worker = self.workers.get(device.uuid)
        if worker is None:
            return
        version = delta.timestamp_ms or self.clock.wall_ms()
        changed = []
        for prop, raw in delta.values.items():
            spec = PROPERTY_BY_NAME.get(prop)
            if spec is None or not spec.writable:
                log.warning("EventBus delta for %s: %s is not a writable GPU property; ignored", device.key, prop)
                continue
            if worker.desired.set(prop, raw, "edge", version) is not None:
                changed.append(prop)
        if changed:
            log.info("EventBus delta for %s: desired %s", device.key, ", ".join(changed))
            self._save_desired(worker, device.key)
            worker.wake()

    def _on_membership(self, topic: str, payload: bytes) -> None:
        try:
            update = parse_membership(payload)
        except ValueError as exc:
            log.warning("EventBus membership update refused: %s", exc)
            return
        log.info("EventBus membership of %s: added %s, removed %s", self.node, list(update.added), list(update.removed))

    # ==============================================================================================
    # the collector: every GPU's steps
    # ==============================================================================================
    async def _collect_loop(self) -> None:
        """Every GPU in one task: at each due time (the collect cycles lie on a shared grid, see
        ``GpuWorker._reschedule``) or ``wake``, the due GPUs' samples are read as one NVML job, then each GPU's
        step is finished and published in turn. NVML's events (XID, ECC, GPU lost, driver reload) are polled in
        the same job on the whole second. One task, one timer and one thread hop per round instead of one per GPU
        and one for the events: on a small edge node the wake-ups and task switches cost more CPU than the work."""
        workers = list(self.workers.values())
        next_poll_s = 0.0
        while True:
            now_s = self.clock.monotonic()
            due = [w for w in workers if w.is_due(now_s)]
            poll = next_poll_s <= now_s + DUE_SLACK_S
            if due or poll:
                started = time.perf_counter()
                results, events = await self._tick_all(due, poll)
                for worker, result in zip(due, results, strict=True):
                    try:
                        self._after_tick(worker, result)
                    except Exception as exc:  # one GPU's failing step must not stop the others (counted, logged)
                        worker.step_failed("publishing its step", exc)
                        self._collect_errors["step-failed"] = self._collect_errors.get("step-failed", 0) + 1
                self._store_round_batches()
                if due:
                    self._collect_hist = self._collect_hist.observe(time.perf_counter() - started)
                if poll:
                    next_poll_s = next_on_grid(now_s, EVENTS_POLL_S, DUE_SLACK_S)
                    self._route_events(events)
            next_s = min([next_poll_s, *(w.next_due_s() for w in workers)])
            delay_s = max(0.0, next_s - self.clock.monotonic())
            # The beat's period is this loop's own sleep, so long collect cycles never look like a stall.
            self._beat("collect", max(1.0, delay_s))
            await sleep_or_wake(self._collect_wake, delay_s)

    async def _tick_all(self, due: list[GpuWorker], poll: bool) -> tuple[list[TickResult], list[GpuEvent]]:
        """``GpuWorker.tick`` of each of ``due``, their samples (and, with ``poll``, NVML's events) read in one
        NVML job; the results and the events."""
        starts = [w.begin() for w in due]
        requests = [(w.uuid, start.names) for w, start in zip(due, starts, strict=True) if start.names]
        samples: dict[str, Sample | MapperError] = {}
        events: list[GpuEvent] = []
        if requests or poll:
            try:
                got: SampleRound = await call_backend(
                    self.backend, self.backend.sample_many, requests, poll, timeout_s=10.0
                )
            except MapperError as exc:  # the job as a whole (NVML hung or not initialised): each GPU gets it
                got = SampleRound([exc] * len(requests), [], exc)
            except Exception as exc:  # a bug in the round: logged with its traceback, each GPU retries later
                log.exception("the NVML sampling round failed")
                err = TransientError(f"the NVML sampling round failed: {exc!r}", retry_after_s=5.0)
                got = SampleRound([err] * len(requests), [], err)
            samples = {uuid: outcome for (uuid, _), outcome in zip(requests, got.samples, strict=True)}
            events = got.events
            if got.events_error is not None:
                log.debug("polling NVML events failed: %s", got.events_error)
        return [await w.finish(start, samples.get(w.uuid)) for w, start in zip(due, starts, strict=True)], events

    def _route_events(self, events: list[GpuEvent]) -> None:
        """XID / ECC / GPU-lost / driver-reload events to their GPU: counted, logged, handed to its next step."""
        for event in events:
            worker = self.workers.get(event.uuid)
            if worker is None:
                continue
            if event.kind == "xid":
                per_gpu = self._xids.setdefault(event.uuid, {})
                per_gpu[event.xid] = per_gpu.get(event.xid, 0) + 1
                log.error("GPU %s: XID %d %s", event.uuid, event.xid, event.detail)
            if event.kind == "driver_reload":
                log.warning("GPU %s: driver reload detected; every setting is re-applied", event.uuid)
                worker.driver_reloaded()
            worker.pending_events.append(event)
            worker.wake()

    def _after_tick(self, worker: GpuWorker, result: TickResult) -> None:
        if result.error:
            reason = "gpu-lost" if worker.lost else "step-failed" if result.step_failed else "error"
            self._collect_errors[reason] = self._collect_errors.get(reason, 0) + 1
        if result.sample is not None and self.shipper is not None:
            telemetry = self.telemetry[worker.uuid]
            telemetry.add(result.sample)
            for route, batch in telemetry.flush_due(self.clock.wall_ms()):
                self._round_batches.append((batch, route))
        acks = result.reconcile.acks if result.reconcile is not None else ()
        events = result.decision.events if result.decision is not None else ()
        if acks or events:  # (most steps publish neither: the device key is worked out only when one does)
            device_key = worker.device.key if worker.device is not None else _unbound_device(worker.info).key
            for ack in acks:
                text = ack_to_json(ack)
                log.info("desired %s on %s: %s", ack.property, device_key, text)
                self._publish_or_keep(
                    f"gpu-mapper/{self.node}/{device_key}/desired/ack", text.encode(), device_key, worker.uuid
                )
            if acks:
                self._save_desired(worker, device_key)
            for event in events:
                key = (event.policy, event.action)
                self._policy_events[key] = self._policy_events.get(key, 0) + 1
                payload = event.to_payload()
                payload.update(node=self.node, device=device_key, ts_ms=self.clock.wall_ms())
                log.warning(
                    "policy %s %s on %s (GPU %s): %s", event.policy, event.action, device_key, worker.uuid, event.reason
                )
                self._publish_or_keep(
                    f"gpu-mapper/{self.node}/{device_key}/events", json.dumps(payload).encode(), device_key, worker.uuid
                )
        if result.state_changed and worker.device is not None:
            self._next_state_s[worker.device.key] = 0.0
            self._report_wake.set()

    # ==============================================================================================
    # reporting: DMI twins and states, EventBus
    # ==============================================================================================
    def _twins(self, worker: GpuWorker) -> list[Twin]:
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

    def _twins_of_device(self, device: DeviceConfig) -> list[Twin]:
        worker = self.workers.get(device.uuid)
        return self._twins(worker) if worker is not None else []

    def _report_cycle_s(self, device: DeviceConfig) -> float:
        cycles = [p.report_cycle_ms for p in device.properties if p.report_to_cloud and p.report_cycle_ms > 0]
        return (min(cycles) if cycles else self.settings.report_cycle_ms) / 1000

    def _state_cycle_s(self, device: DeviceConfig) -> float:
        return (device.state_report_cycle_ms or self.settings.state_report_cycle_ms) / 1000

    async def _report_loop(self) -> None:
        """Twins and states when they are due, and a state change at once (``_report_wake``)."""
        while True:
            now = self.clock.monotonic()
            next_s = now + 5.0
            for worker in self.workers.values():
                device = worker.device
                if device is None:
                    continue
                # A change of state (unhealthy, offline, back online) is always reported; the periodic
                # refresh only when the Device asks for state reports (stateReport / status.reportToCloud).
                changed = self._reported_state.get(device.key) != worker.state
                due = now >= self._next_state_s.get(device.key, 0.0) and device.state_report_to_cloud
                if changed or due:
                    self._next_state_s[device.key] = now + self._state_cycle_s(device)
                    self._report_state(device, worker.state)
                # Twins wait for the first sample: a report with only the status twins helps nobody.
                if now >= self._next_report_s.get(device.key, 0.0) and worker.values:
                    self._next_report_s[device.key] = now + self._report_cycle_s(device)
                    twins = self._twins(worker)
                    if twins:
                        self._report_twins(device, twins)
                    if self.shipper is not None and worker.values:
                        sample = worker_sample(worker)
                        self.shipper.update_state(device.key, state_payload(device.key, sample))
                next_s = min(next_s, max(self._next_report_s.get(device.key, 0.0), now + 0.1))
                if device.state_report_to_cloud:
                    next_s = min(next_s, self._next_state_s.get(device.key, now))
            delay_s = max(0.05, next_s - self.clock.monotonic())
            self._beat("report", max(1.0, delay_s))
            await sleep_or_wake(self._report_wake, delay_s)

    def _report_state(self, device: DeviceConfig, state: str) -> None:
        self._reported_state[device.key] = state
        if self.reporter is not None:
            self.reporter.offer_state(device.namespace, device.name, state)
        if self.settings.eventbus_enabled:
            topic = state_update_topic(device.namespace, device.name)
            self._publish_soon(topic, state_update_payload(state, self.clock.wall_ms()))

    def _report_twins(self, device: DeviceConfig, twins: list[Twin]) -> None:
        if self.reporter is not None:
            self.reporter.offer_status(device.namespace, device.name, twins)
        if self.settings.eventbus_enabled:
            values = {t.name: t.reported for t in twins}
            payload = twin_update_payload(values, self.clock.wall_ms())
            self._publish_soon(twin_update_topic(device.namespace, device.name), payload)

    # ==============================================================================================
    # MQTT
    # ==============================================================================================
    def _status_topic(self) -> str:
        return f"gpu-mapper/{self.node}/status"

    def _make_session(self, url: str) -> MqttSession:
        """The default broker's session: the last will marks this mapper offline."""
        m = self.settings.mqtt
        return MqttSession(
            url,
            m.client_id or f"gpu-mapper-{self.node}",
            will_topic=self._status_topic(),
            will_payload=b"offline",
            username=m.username,
            password=m.password,
            ca_file=m.ca_file,
            cert_file=m.cert_file,
            key_file=m.key_file,
        )

    async def _publish_default(
        self, topic: str, payload: bytes, qos: int = 1, retain: bool = False, timeout_s: float = 10.0
    ) -> None:
        if self.session is None:
            raise TransientError("no MQTT broker configured (--mqtt): telemetry stays in the buffer")
        await self.session.publish(topic, payload, qos=qos, retain=retain, timeout_s=timeout_s)

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
        self._publish_soon(self._status_topic(), b"online", retain=True)
        # Current state first: every device's twins and state go out again on reconnect.
        for key in self._next_report_s:
            self._next_report_s[key] = 0.0
        for key in self._next_state_s:
            self._next_state_s[key] = 0.0
        self._report_wake.set()

    def _publish_or_keep(self, topic: str, payload: bytes, device: str, uuid: str) -> None:
        """Acks and policy events: published at once while the broker is up; while it is down (or when that
        publish fails) stored in the buffer and sent in order with the telemetry when it is back. They record
        what the mapper did on its own, which the cloud must learn even after hours offline. Never blocking."""
        session = self.session
        if session is None:
            return
        if not session.connected:
            self._keep(topic, payload, device, uuid)
            return

        async def send() -> None:
            try:
                await session.publish(topic, payload, qos=self.settings.mqtt.qos, timeout_s=5.0)
            except MapperError as exc:
                log.debug("publish to %s failed (%s): kept for replay", topic, exc)
                self._keep(topic, payload, device, uuid)
            except asyncio.CancelledError:  # shutting down before the PUBACK: keep it for the next start
                self._keep(topic, payload, device, uuid)
                raise

        self._background_task(send())

    def _store_round_batches(self) -> None:
        """The batches cut so far in this collect round into the buffer, in one transaction."""
        if self._round_batches and self.shipper is not None:
            pairs, self._round_batches = self._round_batches, []
            self.shipper.submit_many(pairs)

    def _keep(self, topic: str, payload: bytes, device: str, uuid: str) -> None:
        if self.shipper is None:
            return
        self._store_round_batches()  # a message kept during a round goes after the batches cut before it
        try:
            self.shipper.submit_message(
                device=device,
                uuid=uuid,
                topic=topic,
                payload=payload,
                ts_ms=self.clock.wall_ms(),
                qos=self.settings.mqtt.qos,
            )
        except MapperError as exc:  # the buffer is closed or broken: the message is logged, not kept
            log.warning("status message for %s on %s not kept: %s", device, topic, exc)

    def _publish_soon(self, topic: str, payload: bytes, *, retain: bool = False) -> None:
        """Fire-and-forget publish for EventBus twins and states and the status topic: never buffered (each
        is reported again, current, on reconnect; an old one replayed later would only mislead), never blocking."""
        session = self.session
        if session is None or not session.connected:
            return

        async def send() -> None:
            try:
                await session.publish(topic, payload, qos=self.settings.mqtt.qos, retain=retain, timeout_s=5.0)
            except MapperError as exc:
                log.debug("publish to %s failed: %s", topic, exc)

        self._background_task(send())

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
        gpus = []
        for worker in self.workers.values():
            state = worker.state if worker.state in ("online", "offline", "unhealthy") else "unknown"
            desired_pl = worker.desired.effective().get("power_limit")
            gpus.append(
                GpuSnapshot(
                    info=worker.info,
                    device=worker.device.key if worker.device is not None else "",
                    node=self.node,
                    sample=worker_sample(worker) if worker.values else None,
                    desired_status=worker.desired_status,
                    policy_state=worker.policy_state,
                    state=state,
                    xid_errors=dict(self._xids.get(worker.uuid, {})),
                    desired_power_limit_w=float(desired_pl.value)
                    if desired_pl is not None and desired_pl.valid and desired_pl.value is not None
                    else None,
                )
            )
        actions: dict[tuple[str, str], int] = {}
        drift: dict[str, int] = {}
        rejections: dict[str, int] = {}
        overrides: dict[str, int] = {}
        for worker in self.workers.values():
            counters = worker.reconciler.counters
            for k, v in counters.actions.items():
                actions[k] = actions.get(k, 0) + v
            for k2, v in counters.drift_reapplies.items():
                drift[k2] = drift.get(k2, 0) + v
            for k2, v in counters.rejections.items():
                rejections[k2] = rejections.get(k2, 0) + v
            for part in worker.policy_state.removeprefix("dry-run:").split(","):
                policy = part.split(":", 1)[0]
                if policy and policy != "normal":
                    overrides[policy] = overrides.get(policy, 0) + 1
        dmi_rpcs: dict[tuple[str, str], int] = {}
        for counts in (
            self.dmi_client.rpc_counts if self.dmi_client else {},
            self.dmi_server.rpc_counts if self.dmi_server else {},
        ):
            for method, results in counts.items():
                for result, n in results.items():
                    dmi_rpcs[(method, result)] = dmi_rpcs.get((method, result), 0) + n
        buf = self.buffer.stats() if self.buffer is not None else None
        ship = self.shipper.stats() if self.shipper is not None else None
        return MapperSnapshot(
            node=self.node,
            taken_at_ms=self.clock.wall_ms(),
            version=__version__,
            mode="dmi" if self.settings.dmi_enabled else "standalone",
            driver_version=self.driver_version,
            gpus=tuple(gpus),
            buffer_bytes=buf.bytes if buf else 0,
            buffer_batches=buf.batches if buf else 0,
            buffer_max_bytes=self.settings.buffer_max_bytes,
            buffer_oldest_age_s=buf.oldest_age_s if buf else None,
            buffer_drops=dict(buf.drops_by_reason) if buf else {},
            replay_remaining_batches=ship.replay_remaining_batches if ship else 0,
            telemetry_published_batches=ship.published_batches if ship else 0,
            telemetry_published_bytes=ship.published_bytes if ship else 0,
            mqtt_enabled=self.session is not None,
            mqtt_connected=self.session.connected if self.session is not None else False,
            mqtt_reconnects=self.session.reconnects if self.session is not None else 0,
            dmi_registered=self.dmi_client.registered if self.dmi_client is not None else False,
            dmi_rpcs=dmi_rpcs,
            reconcile_actions=actions,
            drift_reapplies=drift,
            desired_rejections=rejections,
            policy_overrides_active=overrides,
            policy_events=dict(self._policy_events),
            collect_duration=self._collect_hist,
            collect_errors=dict(self._collect_errors),
        )

    async def _housekeeping_loop(self) -> None:
        """The status file for ``gpu-mapper status --data-dir``, and config reloads (policies)."""
        while True:
            self._beat("housekeeping", self.housekeeping_interval_s)
            try:
                await asyncio.to_thread(write_status_file, self.settings.data_dir, self.snapshot())
            except (OSError, MapperError) as exc:
                log.warning("could not write the status file: %s", exc)
            self._maybe_reload_config()
            await asyncio.sleep(self.housekeeping_interval_s)

    def _maybe_reload_config(self) -> None:
        path = self.settings.config_file
        if not path:
            return
        try:
            mtime = os.stat(path).st_mtime
        except OSError:
            return
        if self._config_mtime == 0.0:
            self._config_mtime = mtime
            return
        if mtime == self._config_mtime:
            return
        self._config_mtime = mtime
        try:
            data = read_file(path)
            config = parse_policies(data.get("policies") or {})
            overrides = {w.uuid: _policy_override(w.device) for w in self.workers.values() if w.device is not None}
            self.policies.configure(config, {k: v for k, v in overrides.items() if v})
        except ConfigError as exc:
            log.error("config %s changed but was refused; the previous policies stay: %s", path, exc)
            return
        log.info("config %s reloaded: policies %s", path, json.dumps(config.to_mapping()))

    async def _console_loop(self, interval_s: float) -> None:
        while True:
            self._beat("console", interval_s)
            sys.stdout.write(console_table(self))
            sys.stdout.flush()
            await asyncio.sleep(interval_s)

    def _new_telemetry(self, device: DeviceConfig, start_seq: int = 0) -> DeviceTelemetry:
        return DeviceTelemetry(
            self.node,
            device,
            self.boot_id,
            window_s=self.settings.telemetry_window_s,
            fmt="json" if self.settings.telemetry_format == "json" else "binary",
            start_seq=start_seq,
            default_qos=self.settings.mqtt.qos,
            codec=self.codec,
        )

    def _rebind_telemetry(self, worker: GpuWorker, device: DeviceConfig) -> None:
        old = self.telemetry.get(worker.uuid)
        start_seq = 0
        if old is not None:
            if self.shipper is not None:
                for route, batch in old.flush():
                    self.shipper.submit(batch, route)
            if old.device.key == device.key:
                start_seq = old.next_seq
        try:
            self.telemetry[worker.uuid] = self._new_telemetry(device, start_seq)
        except ValueError as exc:
            log.error("device %s: pushMethod refused, default telemetry route used: %s", device.key, exc)
            self.telemetry[worker.uuid] = self._new_telemetry(replace(device, properties=()), start_seq)


def _policy_override(device: DeviceConfig | None) -> str | None:
    if device is None:
        return None
    value = device.protocol_config.get("policy")
    return str(value) if value not in (None, "") else None


def worker_sample(worker: GpuWorker) -> Sample:
    """The worker's latest values with the mapper's own status twins, as one Sample."""
    values = dict(worker.values)
    values["desired_status"] = worker.desired_status
    values["policy_state"] = worker.policy_state
    return Sample(worker.uuid, worker.values_ts_ms, {k: v for k, v in values.items() if v != ""})


def console_table(app: MapperApp) -> str:
    """The live table ``gpu-mapper run --sim N`` prints: one line per GPU."""
    lines = [
        time.strftime("%H:%M:%S")
        + f"  node {app.node}  buffer {app.buffer.stats().batches if app.buffer else 0} batches"
        + ("  mqtt off" if app.session is None else "  mqtt up" if app.session.connected else "  mqtt down"),
        f"{'device':<22} {'power W':>9} {'cap W':>6} {'temp C':>6} {'util %':>6} {'sm MHz':>6} {'mem MHz':>7}"
        f"  {'state':<9} policy / desired",
    ]

    def num(values: dict[str, Any], name: str, digits: int = 0) -> str:
        x = values.get(name)
        return "-" if x is None else f"{float(x):.{digits}f}"

    for worker in app.workers.values():
        v = worker.values
        name = worker.device.name if worker.device is not None else worker.uuid[:22]
        lines.append(
            f"{name:<22} {num(v, 'power_usage', 1):>9} {num(v, 'power_limit'):>6} {num(v, 'temperature'):>6} "
            f"{num(v, 'utilization_gpu'):>6} {num(v, 'clock_sm'):>6} {num(v, 'clock_memory'):>7}  {worker.state:<9} "
            f"{worker.policy_state} {worker.desired_status}".rstrip()
        )
    return "\n".join(lines) + "\n\n"


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
