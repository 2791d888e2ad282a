"""The mapper's side of DeviceManagerService: register with EdgeCore and report twins and device states.

``DmiClient`` owns ONE long-lived grpc.aio channel to EdgeCore's Unix socket (default
``/etc/kubeedge/dmi.sock``), recreated only when EdgeCore's socket was replaced (EdgeCore restarted). Every
RPC has a timeout; gRPC errors become ``mapper.errors`` types:

* ``UNAVAILABLE`` / ``DEADLINE_EXCEEDED`` / ``CANCELLED`` (the channel was replaced under the call) ->
  ``TransientError`` (retry after ~1 s),
* EdgeCore's rate limiter ("...too many request...") -> ``TransientError(reason="rate-limited")`` with a longer
  ``retry_after_s``,
* anything else -> ``PermanentError`` (the message carries EdgeCore's text).

``DmiClient.run()`` is the supervision loop: it registers (``withData=true``, protocol ``gpu``, our socket path
as raw bytes), hands the reply to ``on_registered(devices, models)``, then watches EdgeCore's socket file every
``poll_interval_s``. EdgeCore <= 1.22 never re-creates its client to a mapper after it restarts, so when the
socket disappears, changes inode, or an RPC fails with UNAVAILABLE, the client re-registers as soon as
EdgeCore answers again (within ~1-2 s of it coming back), and anyway every ``reregister_interval_s``.

``DmiReporter`` sits in front of the report RPCs: callers ``offer_status`` / ``offer_state`` whenever they
like, ``prompt=True`` for a change to show at once; it keeps only the latest value per device and sends within
the node-wide token bucket (see ``mapper.edge.kubeedge.dmi.ratelimit``): prompt reports first, periodic ones only while
the bucket keeps a reserve of tokens for prompt ones, devices round-robin.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio

from mapper.clock import Clock, SystemClock, TokenBucket, format_duration_s, sleep_or_wake
from mapper.edge.kubeedge.dmi import convert
from mapper.edge.kubeedge.dmi.pb import dmi_pb2 as pb
from mapper.edge.kubeedge.dmi.pb import dmi_pb2_grpc as pb_grpc
from mapper.edge.kubeedge.dmi.ratelimit import ReportScheduler, StateReport, StatusReport
from mapper.errors import InvalidValueError, MapperError, PermanentError, TransientError
from mapper.shared.model import DEVICE_STATES, DeviceConfig, DeviceModelConfig, Twin

log = logging.getLogger(__name__)

DEFAULT_EDGECORE_SOCKET = "/etc/kubeedge/dmi.sock"
DEFAULT_MAPPER_SOCKET = "/etc/kubeedge/gpu.sock"
PROTOCOL = "gpu"
API_VERSION = "v1beta1"

#: Seconds to wait after EdgeCore said "too many request" (its bucket refills 1 token a second).
RATE_LIMITED_RETRY_S = 5.0

#: EdgeCore's registration reply: (devices, models, rejected: (namespace/name, why) of those that did not convert).
OnRegistered = Callable[[list[DeviceConfig], list[DeviceModelConfig], list[tuple[str, str]]], Awaitable[None] | None]
Sleep = Callable[[float], Awaitable[Any]]


@dataclass(frozen=True)
class RegisterReply:
    """What MapperRegister returned, converted. ``rejected`` lists (namespace/name, why) that did not convert."""

    devices: tuple[DeviceConfig, ...]
    models: tuple[DeviceModelConfig, ...]
    rejected: tuple[tuple[str, str], ...] = ()


def _result_label(code: grpc.StatusCode, details: str) -> str:
    if "too many request" in details:
        return "rate_limited"
    return str(code.name).lower()


def translate_rpc_error(method: str, target: str, exc: grpc.aio.AioRpcError) -> MapperError:
    """A gRPC failure as a ``mapper.errors`` type whose message names the method and the socket."""
    code = exc.code()
    details = exc.details() or ""
    message = f"DMI {method} to {target}: {code.name}: {details}"
    if "too many request" in details:
        return TransientError(message, retry_after_s=RATE_LIMITED_RETRY_S, reason="rate-limited")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        return TransientError(message, retry_after_s=1.0, reason="unavailable")
    return PermanentError(message, reason="rpc-failed")


class DmiClient:
    """EdgeCore's DeviceManagerService, seen from the mapper.

    ``edgecore_socket``: EdgeCore's DMI socket path (dialled as ``unix://<path>``). ``mapper_socket``: the
    path of OUR DeviceMapperService socket, sent as ``MapperInfo.address`` (raw bytes, no scheme).
    ``bucket``: the node-wide budget shared with ``DmiReporter``; built from ``rate_per_s``/``burst`` when
    not given. ``clock`` and ``sleep`` are injected so the loop runs on fake time in tests.
    """

    def __init__(
        self,
        *,
        edgecore_socket: str = DEFAULT_EDGECORE_SOCKET,
        mapper_socket: str = DEFAULT_MAPPER_SOCKET,
        name: str = "gpu-mapper",
        version: str = "0.1.0",
        api_version: str = API_VERSION,
        protocol: str = PROTOCOL,
        timeout_s: float = 5.0,
        clock: Clock | None = None,
        sleep: Sleep = asyncio.sleep,
        poll_interval_s: float = 1.0,
        reregister_interval_s: float = 300.0,
        bucket: TokenBucket | None = None,
        rate_per_s: float = 0.8,
        burst: int = 10,
        on_registered: OnRegistered | None = None,
        missing_warn_s: float = 10.0,
        missing_warn_max_s: float = 300.0,
    ) -> None:
        """``missing_warn_s``: while EdgeCore's socket is not there, a warning at once, then after this long,
        the interval doubling up to ``missing_warn_max_s``."""
        if not protocol:
            raise ValueError("protocol must be non-empty: EdgeCore routes devices to mappers by it")
        if timeout_s <= 0 or poll_interval_s <= 0 or reregister_interval_s <= 0:
            raise ValueError("timeout_s, poll_interval_s and reregister_interval_s must be > 0")
        self.edgecore_socket = edgecore_socket
        self.mapper_socket = mapper_socket
        self.name = name
        self.version = version
        self.api_version = api_version
        self.protocol = protocol
        self.timeout_s = timeout_s
        self.poll_interval_s = poll_interval_s
        self.reregister_interval_s = reregister_interval_s
        self.on_registered = on_registered
        self._clock: Clock = clock or SystemClock()
        self._sleep = sleep
        self.bucket = bucket or TokenBucket(self._clock, rate_per_s=rate_per_s, burst=burst)

        self._channel: grpc.aio.Channel | None = None
        self._stub: Any = None
        self._stopping = False

        #: True while EdgeCore knows us (the last MapperRegister succeeded and EdgeCore has not gone since).
        self.registered = False
        #: The last error met, as text ("" when none yet).
        self.last_error = ""
        #: RPCs by method and result: ``{"MapperRegister": {"ok": 2, "unavailable": 1}, ...}``.
        self.rpc_counts: dict[str, dict[str, int]] = {}
        self.registrations = 0
        self.channels_opened = 0

        self._needs_register = True
        self._registered_socket: tuple[int, int, int] | None = None
        self._next_register_at = 0.0
        self._retry_at = 0.0
        self._failures = 0
        self.missing_warn_s = missing_warn_s
        self.missing_warn_max_s = max(missing_warn_max_s, missing_warn_s)
        #: Since when EdgeCore's socket has been missing (monotonic; None while it is there), the next warning
        #: about it and the interval after that one.
        self._missing_since: float | None = None
        self._missing_next_warn = 0.0
        self._missing_warn_every = missing_warn_s

    # --- channel ------------------------------------------------------------------------------------
    @property
    def target(self) -> str:
        return f"unix://{self.edgecore_socket}"

    def _ensure_stub(self) -> Any:
        if self._stub is None:
            self._channel = grpc.aio.insecure_channel(
                self.target,
                options=[
                    # a fresh channel must really dial again, not inherit a shared subchannel in backoff
                    ("grpc.use_local_subchannel_pool", 1),
                    ("grpc.initial_reconnect_backoff_ms", 200),
                    ("grpc.min_reconnect_backoff_ms", 200),
                    ("grpc.max_reconnect_backoff_ms", 1000),
                ],
            )
            self._stub = pb_grpc.DeviceManagerServiceStub(self._channel)
            self.channels_opened += 1
        return self._stub

    async def _reset_channel(self) -> None:
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            with contextlib.suppress(Exception):
                await channel.close(grace=None)

    async def close(self) -> None:
        """Stop ``run()`` and close the channel."""
        self._stopping = True
        await self._reset_channel()

    def stop(self) -> None:
        """Ask ``run()`` to return after its current step."""
        self._stopping = True

    def _count(self, method: str, result: str) -> None:
        per_method = self.rpc_counts.setdefault(method, {})
        per_method[result] = per_method.get(result, 0) + 1

    async def _call(self, method: str, request: Any) -> Any:
        stub = self._ensure_stub()
        try:
            response = await getattr(stub, method)(request, timeout=self.timeout_s)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # our task is being cancelled: let it go
            # the channel was closed under the call (close(), or a reset after EdgeCore went away)
            self._count(method, "cancelled")
            closed = TransientError(
                f"DMI {method} to {self.edgecore_socket}: the channel was closed", retry_after_s=1.0
            )
            self.last_error = str(closed)
            raise closed from None
        except grpc.aio.AioRpcError as exc:
            self._count(method, _result_label(exc.code(), exc.details() or ""))
            err = translate_rpc_error(method, self.edgecore_socket, exc)
            self.last_error = str(err)
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                # EdgeCore went away: when it comes back it may not know us any more (<= 1.22 never redials).
                # The channel is broken too: a fresh one dials at once instead of waiting out its backoff.
                self.registered = False
                self._needs_register = True
                await self._reset_channel()
            raise err from None
        self._count(method, "ok")
        return response

    # --- the three RPCs ---------------------------------------------------------------------------
    def mapper_info(self) -> pb.MapperInfo:
        return pb.MapperInfo(
            name=self.name,
            version=self.version,
            api_version=self.api_version,
            protocol=self.protocol,
            address=os.fsencode(self.mapper_socket),
            state="ok",
        )

    async def register(self) -> RegisterReply:
        """MapperRegister with data. Devices that do not convert are listed in ``rejected``, not raised.

        Takes a token from the node-wide bucket even when it is empty (registration must not wait behind
        reports); the reports that follow wait until the debt is repaid.
        """
        self.bucket.take_forced()
        request = pb.MapperRegisterRequest(withData=True, mapper=self.mapper_info())
        response = await self._call("MapperRegister", request)
        models: list[DeviceModelConfig] = []
        devices: list[DeviceConfig] = []
        rejected: list[tuple[str, str]] = []
        for model in convert.dedupe_models(response.modelList):
            try:
                models.append(convert.model_from_pb(model))
            except InvalidValueError as exc:
                rejected.append((f"{model.namespace or 'default'}/{model.name}", str(exc)))
        for device in response.deviceList:
            try:
                devices.append(convert.device_from_pb(device))
            except InvalidValueError as exc:
                rejected.append((f"{device.namespace or 'default'}/{device.name}", str(exc)))
        for key, why in rejected:
            log.warning("MapperRegister reply: skipped %s: %s", key, why)
        return RegisterReply(tuple(devices), tuple(models), tuple(rejected))

    async def report_status(self, namespace: str, name: str, twins: Iterable[Twin]) -> None:
        """ReportDeviceStatus with every given twin of one device (refused locally when empty or invalid)."""
        request = convert.status_request(namespace, name, twins)
        await self._call("ReportDeviceStatus", request)

    async def report_state(self, namespace: str, name: str, state: str) -> None:
        """ReportDeviceStates; ``state`` must be one of ok/online/offline/unknown/unhealthy (else ValueError)."""
        request = convert.state_request(namespace, name, state)
        await self._call("ReportDeviceStates", request)

    # --- supervision ----------------------------------------------------------------------------------
    def _socket_identity(self) -> tuple[int, int, int] | None:
        """Which socket file is there now: (device, inode, ctime). A freed inode number is often reused at once
        by the next file, so the change time tells a re-created socket apart."""
        try:
            st = os.stat(self.edgecore_socket)
        except OSError:
            return None
        return (st.st_dev, st.st_ino, st.st_ctime_ns)

    def request_reregister(self) -> None:
        """Make ``run()`` register again at its next step (e.g. after a device RPC failed mysteriously)."""
        self._needs_register = True
        self._retry_at = 0.0

    async def _register_and_notify(self, identity: tuple[int, int, int]) -> None:
        reply = await self.register()
        self.registered = True
        self.registrations += 1
        self._needs_register = False
        self._registered_socket = identity
        self._failures = 0
        self._next_register_at = self._clock.monotonic() + self.reregister_interval_s
        log.info(
            "registered with EdgeCore at %s: %d devices, %d models",
            self.edgecore_socket,
            len(reply.devices),
            len(reply.models),
        )
        if self.on_registered is not None:
            try:
                result = self.on_registered(list(reply.devices), list(reply.models), list(reply.rejected))
                if inspect.isawaitable(result):
                    await result
            except Exception as exc:  # the callback is ours; never let it stop the link
                log.exception("on_registered failed")
                self.last_error = f"on_registered failed: {exc}"

    async def step(self) -> None:
        """One round of supervision: notice EdgeCore leaving or coming back, register when due."""
        now = self._clock.monotonic()
        identity = self._socket_identity()
        if identity is None:
            self.last_error = f"EdgeCore socket {self.edgecore_socket} is missing"
            if self.registered:
                log.warning("EdgeCore socket %s vanished; will re-register when it is back", self.edgecore_socket)
                await self._reset_channel()
                self._missing_since, self._missing_warn_every = now, self.missing_warn_s
                self._missing_next_warn = now + self.missing_warn_s
            else:
                self._warn_missing(now)
            self.registered = False
            self._needs_register = True
            self._registered_socket = None
            self._retry_at = 0.0  # register at once when it is back
            self._failures = 0
            return
        self._missing_since = None
        if self._registered_socket is not None and identity != self._registered_socket:
            log.warning("EdgeCore socket %s was replaced (EdgeCore restarted); re-registering", self.edgecore_socket)
            self.registered = False
            self._needs_register = True
            self._registered_socket = None
            self._retry_at = 0.0
            self._failures = 0
            await self._reset_channel()
        due = self._needs_register or not self.registered or now >= self._next_register_at
        if not due or now < self._retry_at:
            return
        try:
            await self._register_and_notify(identity)
        except TransientError as exc:
            self._failures += 1
            backoff_s = exc.retry_after_s if exc.reason == "rate-limited" else min(2.0 ** (self._failures - 1), 4.0)
            self._retry_at = now + backoff_s
            self.last_error = str(exc)
            log.warning("MapperRegister failed (retry in %.0f s): %s", backoff_s, exc)
        except PermanentError as exc:
            self._failures += 1
            self._retry_at = now + 30.0
            self.last_error = str(exc)
            log.error("MapperRegister refused (retry in 30 s): %s", exc)

    def _warn_missing(self, now: float) -> None:
        """EdgeCore's socket is not there and never was since the last registration: a warning at once, then
        again at doubling intervals (up to ``missing_warn_max_s``), saying what to check."""
        if self._missing_since is None:
            self._missing_since, self._missing_next_warn = now, now
            self._missing_warn_every = self.missing_warn_s
        if now < self._missing_next_warn:
            return
        waited = now - self._missing_since
        log.warning(
            "EdgeCore's DMI socket %s is not there%s: is EdgeCore running with DMI on that path "
            "(modules.deviceTwin.dmiSockPath), and is its folder mounted here? The mapper registers as soon as "
            "it appears (next warning in %s)",
            self.edgecore_socket,
            f" (for {format_duration_s(waited)})" if waited > 0 else "",
            format_duration_s(self._missing_warn_every),
        )
        self._missing_next_warn = now + self._missing_warn_every
        self._missing_warn_every = min(self._missing_warn_every * 2, self.missing_warn_max_s)

    async def run(self) -> None:
        """Keep registered with EdgeCore until ``stop()``/``close()`` or cancellation; never raises on RPC errors."""
        self._stopping = False
        while not self._stopping:
            await self.step()
            if self._stopping:
                break
            await self._sleep(self.poll_interval_s)


class DmiReporter:
    """Coalescing, rate-limited sender of twin and state reports through a ``DmiClient``.

    ``offer_*`` never block and never fail on the network; ``run()`` (or ``send_ready()``, one pass) sends.
    Reports wait while the client is not registered, so an EdgeCore outage leaves one pending value per
    device, the latest. After a transient failure the report is put back (unless something newer arrived)
    and sending pauses for the error's ``retry_after_s``.
    """

    def __init__(
        self,
        client: DmiClient,
        *,
        clock: Clock | None = None,
        idle_poll_s: float = 0.25,
        idle_wait_s: float = 5.0,
        reserve: int | None = None,
        devices: int | None = None,
    ) -> None:
        self.client = client
        #: ``reserve``: tokens the periodic reports leave for prompt ones; None: one per device, ``devices`` of
        #: them (one per GPU of the node) or those offered for so far (see ``mapper.edge.kubeedge.dmi.ratelimit``).
        self.scheduler = ReportScheduler(client.bucket, reserve=reserve, devices=devices)
        self._clock: Clock = clock or client._clock
        #: How often ``run`` looks again while not registered (reports wait for the registration).
        self.idle_poll_s = idle_poll_s
        #: The longest ``run`` sleeps with nothing to send: a new report wakes it at once.
        self.idle_wait_s = idle_wait_s
        self._wake = asyncio.Event()
        self._paused_until = 0.0
        self._stopping = False
        self.sent: dict[str, int] = {"status": 0, "state": 0}
        self.failed: dict[str, int] = {"status": 0, "state": 0}
        #: Reports dropped because they could never succeed (no valid twin, a permanent EdgeCore refusal).
        self.dropped = 0
        #: Single twins left out of a report because devicetwin would reject them (bad key or value).
        self.dropped_twins = 0
        self.last_error = ""

    def offer_status(self, namespace: str, name: str, twins: Iterable[Twin], *, prompt: bool = False) -> None:
        self.scheduler.offer_status(namespace, name, twins, prompt=prompt)
        self._wake.set()

    def offer_state(self, namespace: str, name: str, state: str, *, prompt: bool = False) -> None:
        """Raises ValueError at once for a state EdgeCore would drop."""
        if state not in DEVICE_STATES:
            raise ValueError(f"device {namespace}/{name}: state {state!r} is not one of {', '.join(DEVICE_STATES)}")
        self.scheduler.offer_state(namespace, name, state, prompt=prompt)
        self._wake.set()

    def forget(self, namespace: str, name: str) -> None:
        self.scheduler.forget(namespace, name)

    def _valid_twins(self, report: StatusReport) -> list[Twin]:
        """One bad twin must not cost the device its whole report: leave it out, count it, log it."""
        valid = []
        for twin in report.twins:
            try:
                convert.check_twin(twin, f"device {report.key}")
            except InvalidValueError as exc:
                self.dropped_twins += 1
                self.last_error = str(exc)
                log.warning("left a twin out of the report: %s", exc)
                continue
            valid.append(twin)
        return valid

    async def send_ready(self) -> int:
        """Send what the budget allows right now; returns the number of RPCs that succeeded."""
        sent = 0
        while self.client.registered and self._clock.monotonic() >= self._paused_until:
            report = self.scheduler.pop_ready()
            if report is None:
                break
            kind = "state" if isinstance(report, StateReport) else "status"
            try:
                if isinstance(report, StatusReport):
                    twins = self._valid_twins(report)
                    if not twins:
                        raise InvalidValueError(f"device {report.key}: no twin left that devicetwin would accept")
                    await self.client.report_status(report.namespace, report.name, twins)
                else:
                    await self.client.report_state(report.namespace, report.name, report.state)
            except TransientError as exc:
                self.failed[kind] += 1
                self.last_error = str(exc)
                self.scheduler.requeue(report)
                self._paused_until = self._clock.monotonic() + exc.retry_after_s
                break
            except (PermanentError, ValueError) as exc:
                self.failed[kind] += 1
                self.dropped += 1
                self.last_error = str(exc)
                log.warning("dropped a %s report of %s: %s", kind, report.key, exc)
                continue
            self.sent[kind] += 1
            sent += 1
        return sent

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    def next_wait_s(self) -> float:
        """How long ``run`` may sleep now: until the budget or a pause allows the next pending report; with
        nothing pending, ``idle_wait_s`` (an offer wakes it sooner); while not registered, ``idle_poll_s``."""
        if not self.client.registered:
            return self.idle_poll_s
        wait = self.scheduler.wait_s()
        if wait is None:
            return self.idle_wait_s
        pause = self._paused_until - self._clock.monotonic()
        return min(self.idle_wait_s, max(wait, pause, 0.01))

    async def run(self) -> None:
        """Send pending reports as the budget allows until ``stop()`` or cancellation. Event-driven: it sleeps
        until a report is offered or the rate limit lets the next one go, not on a fixed poll."""
        self._stopping = False
        while not self._stopping:
            self._wake.clear()
            await self.send_ready()
            if self._stopping:
                break
            await sleep_or_wake(self._wake, self.next_wait_s())
