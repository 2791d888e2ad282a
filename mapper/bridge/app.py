"""``gpu-mapper bridge``: the MQTT telemetry stream into a Prometheus-compatible store by remote write.

Intake: one MQTT 5 session (``mapper.net.mqtt.MqttSession``) with a persistent session (clean start off, a session
expiry) and a shared subscription ``$share/<group>/<topic>``, so that N replicas in one group split the stream and
a restarted replica gets what arrived meanwhile. Every telemetry message is acknowledged (PUBACK, paho's manual
ack) only after its samples were written (2xx) or kept in the spool (a refusal): a crash or an outage of the
receiver loses nothing, the broker sends the unacknowledged messages again. The node streams (the mappers' own
series, ``gpu_mapper_*``, on ``gpu-mapper/{node}/metrics``) come the same way, through a second shared
subscription, and are written at once (no GPU uuid to wait for). The retained ``state`` messages
(a plain subscription: shared ones get no retained messages) give the GPU uuid of batches whose header omits it,
the GPU's identity labels (``gpu``, ``driver_version``, ``pci_bus_id``: a device's batches wait up to
``uuid_wait_s`` for it) and the status series (``gpu_mapper_device_state``, ``gpu_xid_errors_total``,
``gpu_power_limit_desired_watts``), written at the time of the snapshot and acknowledged after, like a batch.

Output: ``mapper.bridge.core.Converter`` names the series (``mapper.shared.naming``); requests are cut at
``batch_max_samples`` or ``batch_max_delay_s`` after their first message, one in flight at a time, so a series'
samples reach the receiver in order. 5xx, 429 and network errors are retried with capped exponential backoff and
jitter (``Retry-After`` honoured), forever: the messages stay unacknowledged meanwhile. Any other 4xx is not
retried: a request of several batches is split into one request per batch, and each batch still refused is
counted by reason, logged once per reason and written to the spool directory (``gpu-mapper bridge export`` turns
the spool into OpenMetrics for ``promtool tsdb create-blocks-from openmetrics``). With remote write version 2 the
bridge falls back to 1.0 for good on a 415, or on a 2xx without ``X-Prometheus-Remote-Write-Samples-Written``
(a 1.0 receiver that read nothing from a 2.0 body).

Its own ``/metrics`` (``gpu_mapper_bridge_*``), ``/healthz`` (the write loop beats) and ``/readyz`` (broker
connected, writes not failing for long) come from ``mapper.bridge.metrics.BridgeMetricsServer``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import http.client
import json
import logging
import os
import random
import socket
import ssl
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

from mapper import __version__
from mapper.bridge import remotewrite
from mapper.bridge.config import BridgeSettings
from mapper.bridge.core import BridgeStats, Converter, PendingRequest, SeqDedup, StreamKey, series_types
from mapper.bridge.metrics import BridgeMetricsServer
from mapper.errors import ConfigError, TransientError
from mapper.net.http import LoopHeartbeat
from mapper.net.mqtt import ClientIdClaim, ReceivedMessage, session_from_settings
from mapper.shared.naming import NODE_DEVICE
from mapper.wire import topics
from mapper.wire.state import NO_IDENTITY, DeviceStatus, GpuIdentity, parse_state
from mapper.wire.telemetry import BatchCodec, BatchFormatError, DecodedBatch, decode_batch

log = logging.getLogger(__name__)

#: Readiness fails when every write has failed for this long.
WRITE_FAILING_NOT_READY_S = 60.0
#: uuids remembered per (node, device).
MAX_UUIDS = 100_000
#: A stream's sequence anomaly of one kind is logged at most once in this many seconds.
ANOMALY_LOG_INTERVAL_S = 60.0


# --------------------------------------------------------------------------------------------------
# HTTP
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]
    body: str


class RemoteWriteClient:
    """POSTs to the remote-write URL over one kept-alive connection (call from one thread at a time)."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 30.0,
        username: str | None = None,
        password: str | None = None,
        bearer_token_file: str | None = None,
        ca_file: str | None = None,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"remote write URL {url!r}: expected http(s)://host[:port]/path")
        self.url = url
        self.https = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.https else 80)
        self.path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.timeout_s = timeout_s
        self._auth: str | None = None
        if username is not None:
            import base64

            token = base64.b64encode(f"{username}:{password or ''}".encode()).decode()
            self._auth = f"Basic {token}"
        self._token_file = bearer_token_file
        self._ctx: ssl.SSLContext | None = None
        if self.https:
            try:
                self._ctx = ssl.create_default_context(cafile=ca_file)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(f"remote write CA file {ca_file}: {exc}") from None
        self._conn: http.client.HTTPConnection | None = None

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            if self.https:
                self._conn = http.client.HTTPSConnection(
                    self.host, self.port, timeout=self.timeout_s, context=self._ctx
                )
            else:
                self._conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def post(self, body: bytes, headers: dict[str, str]) -> Answer:
        """One POST; ``TransientError`` when no answer came (connect, timeout, reset)."""
        hdrs = dict(headers)
        hdrs["User-Agent"] = f"gpu-mapper-bridge/{__version__}"
        if self._auth:
            hdrs["Authorization"] = self._auth
        elif self._token_file:
            try:
                hdrs["Authorization"] = "Bearer " + Path(self._token_file).read_text().strip()
            except OSError as exc:
                raise TransientError(f"remote write bearer token file {self._token_file}: {exc}") from None
        for attempt in (1, 2):
            conn = self._connection()
            try:
                conn.request("POST", self.path, body=body, headers=hdrs)
                resp = conn.getresponse()
                text = resp.read(64 * 1024).decode("utf-8", "replace")
                answer = Answer(resp.status, {k.lower(): v for k, v in resp.getheaders()}, text)
                if resp.getheader("Connection", "").lower() == "close":
                    self.close()
                return answer
            except (OSError, http.client.HTTPException) as exc:
                self.close()
                # A kept-alive connection the server closed meanwhile fails at once: try a fresh one once.
                if attempt == 2 or not isinstance(exc, http.client.RemoteDisconnected | ConnectionResetError):
                    raise TransientError(f"remote write {self.url}: {exc or type(exc).__name__}") from None
        raise AssertionError("unreachable")


#: Bodies of a 5xx that will never be accepted, however often sent: Prometheus 2.x (2.42 measured) answers 500
#: ``too old sample`` for a sample older than its out-of-order window (a 400 in the spec's terms). Treated as a
#: refusal: counted, logged once, spooled, not retried.
PERMANENT_5XX_BODIES = ("too old sample",)


def permanent_5xx(answer: Answer) -> bool:
    text = answer.body.lower()
    return any(phrase in text for phrase in PERMANENT_5XX_BODIES)


def refusal_reason(status: int, body: str) -> str:
    """A short, stable reason for a refused request (a metric label)."""
    text = body.lower()
    for phrase, reason in (
        ("out of bounds", "out_of_bounds"),
        ("too old", "too_old"),
        ("out of order", "out_of_order"),
        ("duplicate sample", "duplicate_timestamp"),
    ):
        if phrase in text:
            return reason
    return f"http_{status}"


# --------------------------------------------------------------------------------------------------
# The spool
# --------------------------------------------------------------------------------------------------


class Spool:
    """Refused requests, one pair of files each: ``<ms>-<n>.rw1`` (the request as remote write 1.0, snappy) and
    ``<ms>-<n>.json`` (status, reason, the receiver's answer, the batches in it)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)
        self._n = 0

    def put(self, body_v1: bytes, meta: dict[str, Any]) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._n += 1
        stem = f"{int(time.time() * 1000)}-{os.getpid()}-{self._n}"
        data = self.dir / f"{stem}.rw1"
        for path, content in ((data, remotewrite.compress(body_v1)), (self.dir / f"{stem}.json", None)):
            tmp = path.with_suffix(path.suffix + ".tmp")
            with open(tmp, "wb") as f:
                f.write(content if content is not None else json.dumps(meta, indent=1).encode())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        return data

    def files(self) -> list[Path]:
        return sorted(self.dir.glob("*.rw1")) if self.dir.is_dir() else []

    def __len__(self) -> int:
        return len(self.files())

    def series(self) -> Iterator[remotewrite.DecodedSeries]:
        for path in self.files():
            try:
                body = remotewrite.decompress(path.read_bytes())
                yield from remotewrite.decode_v1(body)
            except remotewrite.RemoteWriteFormatError as exc:
                raise remotewrite.RemoteWriteFormatError(f"{path}: {exc}") from None


def export_openmetrics(spool_dir: str | os.PathLike[str], out: IO[str]) -> int:
    """Write the spool as OpenMetrics text; the number of spool files read."""
    if not Path(spool_dir).is_dir():
        raise ConfigError(f"spool dir {spool_dir}: no such directory")
    spool = Spool(spool_dir)
    files = spool.files()
    for chunk in remotewrite.render_openmetrics(spool.series(), series_types()):
        out.write(chunk)
    return len(files)


# --------------------------------------------------------------------------------------------------
# The bridge
# --------------------------------------------------------------------------------------------------


@dataclass
class _Accepted:
    """One message whose samples are in a request, with what is needed to ack it, dedup it and redo it alone:
    ``parts`` are the batches it holds that were not written yet (a merged batch holds several)."""

    message: ReceivedMessage
    batch: DecodedBatch
    uuid: str
    key: StreamKey
    parts: list[DecodedBatch]
    samples: int
    #: The dedup epoch each part is recorded in once written (``SeqDedup.observe``'s), in ``parts``' order.
    epochs: list[object] = field(default_factory=list)

    @property
    def seqs(self) -> list[int]:
        return [p.seq for p in self.parts]

    def add_to(self, converter: Converter, req: PendingRequest, idents: Callable[[str], GpuIdentity]) -> int:
        total = 0
        for part in self.parts:
            uuid = part.uuid or self.uuid
            total += converter.add(req, part, uuid, idents(uuid))
        return total

    def describe(self) -> dict[str, Any]:
        return {"node": self.key[0], "device": self.key[1], "boot_id": self.key[2], "seqs": self.seqs}


@dataclass
class _AcceptedState:
    """One state message whose status samples are in a request (acknowledged when it is written or spooled)."""

    message: ReceivedMessage
    node: str
    status: DeviceStatus
    uuid: str
    samples: int

    def add_to(self, converter: Converter, req: PendingRequest, idents: Callable[[str], GpuIdentity]) -> int:
        return converter.add_status(req, self.node, self.status, self.uuid, idents(self.uuid))

    def describe(self) -> dict[str, Any]:
        return {"node": self.node, "device": self.status.device, "state_at_ms": self.status.at_ms}


class Bridge:
    """The service: run it with ``await Bridge(settings).run(stop)``."""

    def __init__(
        self,
        settings: BridgeSettings,
        *,
        client: RemoteWriteClient | None = None,
        rng: random.Random | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.stats = BridgeStats(remote_write_version=settings.remote_write_version)
        self.version = settings.remote_write_version
        assert settings.remote_write is not None and settings.mqtt.url is not None
        self.client = client or RemoteWriteClient(
            settings.remote_write,
            timeout_s=settings.remote_write_timeout_s,
            username=settings.remote_write_username,
            password=settings.remote_write_password,
            bearer_token_file=settings.remote_write_bearer_token_file,
            ca_file=settings.remote_write_ca_file,
        )
        self.converter = Converter()
        self.dedup = SeqDedup(max_streams=settings.dedup_max_streams, gap_tolerance=settings.dedup_gap_tolerance)
        #: (stream, anomaly kind) -> when it was last logged (monotonic s): once per stream and minute.
        self._anomaly_logged: OrderedDict[tuple[StreamKey, str], float] = OrderedDict()
        self.spool = Spool(settings.spool_dir)
        self.codec = BatchCodec(dictionary_id=0)
        self._rng = rng or random.Random()
        self._now = monotonic
        # The configured client id, else ``<group>-<hostname>`` or, where another process of this host holds
        # that, ``<group>-<hostname>-<n>``: held until the bridge stops, so two replicas on one host never take
        # each other's session over, and a restarted one resumes its own (the lowest free id).
        self.client_id_claim = (
            None if settings.mqtt.client_id else ClientIdClaim(f"{settings.group}-{socket.gethostname()}")
        )
        client_id = settings.mqtt.client_id or (self.client_id_claim.client_id if self.client_id_claim else "")
        self.client_id = client_id
        self.session = session_from_settings(
            settings.mqtt.url,
            settings.mqtt,
            client_id,
            mqtt5=True,
            session_expiry_s=round(settings.mqtt_session_expiry_s),
            receive_maximum=settings.mqtt_receive_maximum,
            manual_ack=True,
            reconnect_max_s=settings.mqtt_reconnect_max_s,
        )
        self._uuids: OrderedDict[tuple[str, str], str] = OrderedDict()
        #: (node, uuid) -> the GPU's identity, from its state messages.
        self._idents: OrderedDict[tuple[str, str], GpuIdentity] = OrderedDict()
        #: (node, device): no identity came within uuid_wait_s; its batches no longer wait for one.
        self._no_ident: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._waiting: deque[tuple[float, ReceivedMessage, DecodedBatch]] = deque()
        self._pending: PendingRequest | None = None
        #: Batches in requests not yet written, per stream: (seq, first and last sample time, the request).
        self._claims: dict[StreamKey, list[tuple[int, int, int, PendingRequest]]] = {}
        self._sealed: deque[PendingRequest] = deque()
        self._in_flight: PendingRequest | None = None
        self._wake = asyncio.Event()
        self._stop: asyncio.Event | None = None
        self._logged_reasons: set[str] = set()
        self._last_beat = self._now()
        self._failing_since: float | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="remote-write")
        self.metrics: BridgeMetricsServer | None = None

    # ------------------------------------------------------------------------------------------ run

    async def run(self, stop: asyncio.Event, *, on_started: Callable[[], Any] | None = None) -> int:
        self._stop = stop
        loop = asyncio.get_running_loop()
        self.metrics = BridgeMetricsServer(
            self.settings.metrics_addr,
            stats=self.snapshot,
            heartbeats=lambda: [LoopHeartbeat("write", self._last_beat, 1.0)],
            problems=self.problems,
            loop=loop,
        )
        self.metrics.start()
        self.session.subscribe_acked(self.settings.shared_filter, self._on_batch, qos=1)
        if self.settings.node_filter:
            # The mappers' own series: batches too (a shared subscription, deduplicated like a GPU's).
            node_shared = topics.shared_subscription(self.settings.group, self.settings.node_filter)
            self.session.subscribe_acked(node_shared, self._on_batch, qos=1)
        if self.settings.state_filter:
            self.session.subscribe_acked(self.settings.state_filter, self._on_state, qos=1)
        await self.session.start()
        log.info(
            "bridge: %s (group %s) -> %s (remote write %d)",
            self.settings.topic,
            self.settings.group,
            self.settings.remote_write,
            self.version,
        )
        if on_started is not None:
            on_started()
        try:
            await self._write_loop(stop)
        finally:
            await self.session.stop()
            if self.client_id_claim is not None:
                self.client_id_claim.close()
            self.metrics.stop()
            self._pool.shutdown(wait=False, cancel_futures=True)
            await asyncio.to_thread(self.client.close)
        return 0

    def snapshot(self) -> BridgeStats:
        s = self.stats
        reqs = [r for r in (*self._sealed, self._pending, self._in_flight) if r is not None]
        s.pending_batches = sum(len(r.messages) for r in reqs) + len(self._waiting)
        s.pending_samples = sum(r.samples for r in reqs)
        s.mqtt_connected = self.session.connected
        s.remote_write_version = self.version
        s.dedup_streams = len(self.dedup)
        return s

    @property
    def idle(self) -> bool:
        """Nothing received is waiting to be written or refused."""
        return not (self._pending or self._sealed or self._in_flight or self._waiting or self._claims)

    def problems(self) -> list[str]:
        out = []
        if not self.session.connected:
            out.append(f"not connected to the broker {self.session.url}")
        if self._failing_since is not None and self._now() - self._failing_since > WRITE_FAILING_NOT_READY_S:
            out.append(f"remote write failing for {self._now() - self._failing_since:.0f} s")
        return out

    # ------------------------------------------------------------------------------------------ intake

    def _on_state(self, message: ReceivedMessage) -> None:
        """A (retained) state message: remember the device's GPU uuid and identity; its status samples are
        written like a batch's (and the message acknowledged after)."""
        self.stats.state_messages += 1
        try:
            node = topics.node_of(message.topic)
            status = parse_state(message.payload)
        except ValueError as exc:
            self.stats.bad_state_messages += 1
            self._log_once("bad-state", f"bridge: a message on {message.topic} is not a state message: {exc}")
            self.session.ack(message)
            return
        if status.uuid:
            # A state message names the GPU's identity, or none (a mapper before it: its series have no gpu label).
            self._learn(node, status.device, status.uuid, status.identity or NO_IDENTITY)
        uuid = status.uuid or self._uuids.get((node, status.device), "")
        if not status.has_samples:
            self.session.ack(message)
            return
        req = self._pending
        if req is None:
            req = self._pending = PendingRequest(self._now())
        acc = _AcceptedState(message, node, status, uuid, 0)
        acc.samples = acc.add_to(self.converter, req, functools.partial(self._ident, node))
        req.messages.append(acc)
        self._seal_if_full(req)

    def _ident(self, node: str, uuid: str) -> GpuIdentity:
        return self._idents.get((node, uuid), NO_IDENTITY)

    def _learn(self, node: str, device: str, uuid: str, ident: GpuIdentity | None = None) -> None:
        key = (node, device)
        if self._uuids.get(key) != uuid:
            self._uuids[key] = uuid
            if len(self._uuids) > MAX_UUIDS:
                self._uuids.popitem(last=False)
        self._uuids.move_to_end(key)
        if ident is not None:
            gpu = (node, uuid)
            if self._idents.get(gpu) != ident:
                self._idents[gpu] = ident
                if len(self._idents) > MAX_UUIDS:
                    self._idents.popitem(last=False)
            self._idents.move_to_end(gpu)
            self._no_ident.pop(key, None)
        if self._waiting and self._ready(node, device, uuid):
            self._release_waiting(lambda b: (b.node, b.device) == key)

    def _ready(self, node: str, device: str, uuid: str) -> bool:
        """A batch of ``device`` can be written now: its GPU uuid is known, and its identity too (or there is no
        state subscription to give one, or none came in time)."""
        if not uuid:
            return False
        return not self.settings.state_filter or (node, uuid) in self._idents or (node, device) in self._no_ident

    def _on_batch(self, message: ReceivedMessage) -> None:
        self.stats.batches_received += 1
        try:
            batch = decode_batch(message.payload, self.codec)
        except BatchFormatError as exc:
            self.stats.decode_errors += 1
            self._log_once("undecodable", f"bridge: a message on {message.topic} is not a telemetry batch: {exc}")
            self._keep_undecodable(message, str(exc))
            self.session.ack(message)
            return
        self.stats.samples_received += sum(len(s.values) for s in batch.samples)
        if batch.device == NODE_DEVICE:  # a node stream: the mapper's own series, no GPU to wait for
            self._accept(message, batch, "")
            return
        if batch.uuid:
            self._learn(batch.node, batch.device, batch.uuid)
        uuid = batch.uuid or self._uuids.get((batch.node, batch.device), "")
        if not self._ready(batch.node, batch.device, uuid) and self.settings.uuid_wait_s > 0:
            self._waiting.append((self._now(), message, batch))
            return
        self._accept(message, batch, uuid)

    def _release_waiting(self, which: Callable[[DecodedBatch], bool]) -> None:
        keep: deque[tuple[float, ReceivedMessage, DecodedBatch]] = deque()
        for item in self._waiting:
            _, message, batch = item
            if which(batch):
                uuid = batch.uuid or self._uuids.get((batch.node, batch.device), "")
                if not uuid:
                    self.stats.uuid_unknown_batches += 1
                    self._log_once(
                        "uuid", f"bridge: no GPU uuid known for {batch.node}/{batch.device}: written without uuid"
                    )
                elif self.settings.state_filter and (batch.node, uuid) not in self._idents:
                    self.stats.identity_unknown_batches += 1
                    self._no_ident[(batch.node, batch.device)] = None
                    if len(self._no_ident) > MAX_UUIDS:
                        self._no_ident.popitem(last=False)
                    self._log_once(
                        "identity",
                        f"bridge: no state message from {batch.node}/{batch.device} within the uuid wait: written "
                        "without the gpu, driver_version and pci_bus_id labels",
                    )
                self._accept(message, batch, uuid)
            else:
                keep.append(item)
        self._waiting = keep

    def _expire_waiting(self) -> None:
        # (runs every pass of the write loop: the oldest waits at the front, so a pass with none expired is O(1))
        if self._waiting and self._waiting[0][0] <= self._now() - self.settings.uuid_wait_s:
            deadline = self._now() - self.settings.uuid_wait_s
            expired = {id(b) for t, _, b in self._waiting if t <= deadline}
            if expired:
                # Everything of those devices goes, in arrival order.
                devices = {(b.node, b.device) for _, _, b in self._waiting if id(b) in expired}
                self._release_waiting(lambda b: (b.node, b.device) in devices)

    def _accept(self, message: ReceivedMessage, batch: DecodedBatch, uuid: str) -> None:
        """Dedup by (node, device, boot id, topic), sequence number and sample times, part by part: a merged batch
        holds the batches it replaced (``DecodedBatch.split``), and only those not written yet are written. A part
        is a duplicate only when its number AND its time range were written (or wait to be, in an earlier
        request); one whose number goes backwards or jumps is written and counted (``_anomaly``)."""
        key: StreamKey = (batch.node, batch.device, batch.boot_id, message.topic)
        claims = self._claims.get(key, ())
        new: list[DecodedBatch] = []
        holder: PendingRequest | None = None
        parts = batch.split() if batch.merged else (batch,)
        for part in parts:
            if self.dedup.seen(key, part.seq, part.ts_first_ms, part.ts_last_ms):
                continue  # written
            claimed = [
                c
                for seq, ts_first, ts_last, c in claims
                if seq == part.seq and ts_first == part.ts_first_ms and ts_last == part.ts_last_ms
            ]
            if claimed:
                holder = claimed[-1]  # waits to be written in an earlier request
                continue
            new.append(part)
        dropped = [p for p in parts if all(p is not q for q in new)]
        if dropped:
            self.stats.duplicate_batches += len(dropped)
            self.stats.duplicate_samples += sum(len(s.values) for p in dropped for s in p.samples)
        if not new:
            if holder is None:
                self.session.ack(message)
            else:
                # Sent again while its first copy waits to be written (a redelivery after a reconnect): it is
                # acknowledged with that copy.
                holder.riders.append(message)
            return
        epochs: list[object] = []
        for part in new:
            anomaly, before, epoch = self.dedup.observe(key, part.seq, part.ts_first_ms, part.ts_last_ms)
            epochs.append(epoch)
            if anomaly is not None:
                self._anomaly(key, anomaly, part, before)
        req = self._pending
        if req is None:
            req = self._pending = PendingRequest(self._now())
        acc = _Accepted(message, batch, uuid, key, new, 0, epochs)
        acc.samples = acc.add_to(self.converter, req, functools.partial(self._ident, batch.node))
        req.messages.append(acc)
        claim_list = self._claims.setdefault(key, [])
        claim_list.extend((part.seq, part.ts_first_ms, part.ts_last_ms, req) for part in new)
        self._seal_if_full(req)

    def _anomaly(self, key: StreamKey, kind: str, part: DecodedBatch, before: int) -> None:
        """A batch whose sequence number went backwards or jumped: counted, and logged once per stream, kind and
        minute. It is written all the same."""
        self.stats.sequence_anomalies[kind] = self.stats.sequence_anomalies.get(kind, 0) + 1
        now = self._now()
        last = self._anomaly_logged.get((key, kind))
        if last is not None and now - last < ANOMALY_LOG_INTERVAL_S:
            return
        self._anomaly_logged[(key, kind)] = now
        self._anomaly_logged.move_to_end((key, kind))
        while len(self._anomaly_logged) > MAX_UUIDS:
            self._anomaly_logged.popitem(last=False)
        node, device, boot_id, topic = key
        what = (
            "went backwards (its samples are newer: the stream's numbering started again)"
            if kind == "backwards"
            else f"jumped by {part.seq - before - 1} (batches missing, or dropped before they were sent)"
        )
        log.warning(
            "bridge: stream %s/%s (boot %s, %s): sequence %s, seq %d after %d; written "
            "(logged once per stream and minute)",
            node,
            device,
            boot_id,
            topic,
            what,
            part.seq,
            before,
        )

    def _seal_if_full(self, req: PendingRequest) -> None:
        if req.samples >= self.settings.batch_max_samples:
            self._sealed.append(req)
            self._pending = None
            self._wake.set()

    def _keep_undecodable(self, message: ReceivedMessage, why: str) -> None:
        try:
            d = Path(self.settings.spool_dir) / "undecodable"
            d.mkdir(parents=True, exist_ok=True)
            stem = f"{int(time.time() * 1000)}-{os.getpid()}-{self.stats.decode_errors}"
            (d / f"{stem}.bin").write_bytes(message.payload)
            (d / f"{stem}.json").write_text(json.dumps({"topic": message.topic, "error": why}))
        except OSError as exc:
            self.stats.spool_failures += 1
            log.error("bridge: cannot keep an undecodable message in %s: %s", self.settings.spool_dir, exc)

    def _log_once(self, reason: str, text: str) -> None:
        if reason not in self._logged_reasons:
            self._logged_reasons.add(reason)
            log.warning("%s (logged once per reason)", text)

    # ------------------------------------------------------------------------------------------ output

    def _next_due(self) -> tuple[PendingRequest | None, float]:
        """The next request to write, or None and how long to wait for one."""
        if self._sealed:
            return self._sealed.popleft(), 0.0
        req = self._pending
        if req is None:
            return None, 1.0
        age = self._now() - req.created_s
        if age >= self.settings.batch_max_delay_s:
            self._pending = None
            return req, 0.0
        return None, min(1.0, self.settings.batch_max_delay_s - age)

    async def _write_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self._last_beat = self._now()
            self._expire_waiting()
            req, wait_s = self._next_due()
            if req is None:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), wait_s)
                continue
            self._in_flight = req
            log.debug("bridge: writing %d batches, %d samples", len(req.messages), req.samples)
            try:
                await self._write(req)
            finally:
                self._in_flight = None

    def _encode(self, req: PendingRequest, version: int) -> tuple[bytes, dict[str, str]]:
        series = req.series()
        if version == 2:
            return remotewrite.compress(remotewrite.encode_v2(series)), remotewrite.V2_HEADERS
        return remotewrite.compress(remotewrite.encode_v1(series)), remotewrite.V1_HEADERS

    async def _post(self, body: bytes, headers: dict[str, str]) -> Answer | None:
        """One POST off the loop; None on a network error (logged, counted by the caller)."""
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        try:
            return await loop.run_in_executor(self._pool, self.client.post, body, headers)
        except TransientError as exc:
            log.debug("bridge: %s", exc)
            return None
        finally:
            self.stats.write_duration.observe(time.perf_counter() - t0)

    async def _write(self, req: PendingRequest) -> bool:
        """Write ``req`` until it is written or refused; False when stopped first (nothing acked)."""
        attempt = 0
        while True:
            version = self.version
            body, headers = self._encode(req, version)
            answer = await self._post(body, headers)
            log.debug("bridge: POST answered %s", answer and (answer.status, answer.body[:100]))
            if answer is not None and 200 <= answer.status < 300:
                if version == 2 and remotewrite.SAMPLES_WRITTEN_HEADER.lower() not in answer.headers:
                    self._fall_back(f"HTTP {answer.status} without {remotewrite.SAMPLES_WRITTEN_HEADER}")
                    continue
                self._failing_since = None
                self._written(req)
                return True
            if answer is not None and answer.status == 415 and version == 2:
                self._fall_back("HTTP 415")
                continue
            if answer is None or (answer.status >= 500 and not permanent_5xx(answer)) or answer.status == 429:
                reason = "network" if answer is None else f"http_{answer.status}"
                self.stats.retries[reason] = self.stats.retries.get(reason, 0) + 1
                if self._failing_since is None:
                    self._failing_since = self._now()
                delay = self._backoff(attempt, answer)
                attempt += 1
                if attempt == 1 or attempt % 10 == 0:
                    log.warning("bridge: remote write failed (%s); retry %d in %.1f s", reason, attempt, delay)
                assert self._stop is not None
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), delay)
                if self._stop.is_set():
                    return False
                continue
            self._failing_since = None
            await self._refused(req, answer)
            return True

    def _fall_back(self, why: str) -> None:
        self.version = 1
        self.stats.version_fallbacks += 1
        log.warning("bridge: the receiver does not take remote write 2.0 (%s): falling back to 1.0", why)

    def _backoff(self, attempt: int, answer: Answer | None) -> float:
        s = self.settings
        if answer is not None and answer.status == 429:
            retry_after = answer.headers.get("retry-after", "")
            if retry_after.isdigit():
                return min(float(retry_after), s.retry_max_s)
        cap = min(s.retry_max_s, s.retry_min_s * 2 ** min(attempt, 30))
        return max(s.retry_min_s, cap / 2 + self._rng.uniform(0, cap / 2))

    def _release(self, req: PendingRequest) -> None:
        """``req`` is written or spooled: its claims go, its riders are acknowledged."""
        for acc in req.messages:
            if isinstance(acc, _AcceptedState):
                continue
            claims = self._claims.get(acc.key)
            if claims is not None:
                claims[:] = [c for c in claims if c[3] is not req]
                if not claims:
                    del self._claims[acc.key]
        for message in req.riders:
            self.session.ack(message)
        req.riders.clear()

    def _written(self, req: PendingRequest) -> None:
        now_wall = time.time()
        self.stats.requests_written += 1
        self.stats.samples_written += sum(len(s.ordered_parts()) for s in req.series())
        self._release(req)
        for acc in req.messages:
            if isinstance(acc, _AcceptedState):
                self.session.ack(acc.message)
                self.stats.state_messages_written += 1
                continue
            self._record(acc)
            self.session.ack(acc.message)
            self.stats.batches_written += len(acc.parts)
            lag = max(0.0, now_wall - acc.parts[-1].ts_last_ms / 1000.0)
            self.stats.lag.observe(lag)
            self.stats.last_write_lag_s = lag

    def _record(self, acc: _Accepted | _AcceptedState) -> None:
        if isinstance(acc, _AcceptedState):
            return
        for i, part in enumerate(acc.parts):
            epoch = acc.epochs[i] if i < len(acc.epochs) else None
            self.dedup.record(acc.key, part.seq, part.seq, part.ts_first_ms, part.ts_last_ms, epoch)

    async def _refused(self, req: PendingRequest, answer: Answer) -> None:
        if len(req.messages) > 1:
            # One batch's samples refuse the whole request: find which, one request per batch.
            for acc in req.messages:
                alone = PendingRequest(self._now())
                node = acc.node if isinstance(acc, _AcceptedState) else acc.key[0]
                acc.add_to(self.converter, alone, functools.partial(self._ident, node))
                alone.messages.append(acc)
                if not await self._write(alone):
                    return
            self._release(req)
            return
        reason = refusal_reason(answer.status, answer.body)
        self.stats.refused_requests[reason] = self.stats.refused_requests.get(reason, 0) + 1
        self.stats.refused_samples[reason] = self.stats.refused_samples.get(reason, 0) + req.samples
        self._log_once(
            reason,
            f"bridge: the receiver refused a request with HTTP {answer.status} ({reason}): {answer.body[:300]!r}; "
            f"kept in {self.settings.spool_dir} (gpu-mapper bridge export turns it into OpenMetrics)",
        )
        meta = {
            "status": answer.status,
            "reason": reason,
            "answer": answer.body[:2000],
            "samples": req.samples,
            "batches": [a.describe() for a in req.messages if isinstance(a, _Accepted)],
            "states": [a.describe() for a in req.messages if isinstance(a, _AcceptedState)],
        }
        try:
            await asyncio.to_thread(self.spool.put, remotewrite.encode_v1(req.series()), meta)
            self.stats.spooled_requests += 1
        except OSError as exc:
            self.stats.spool_failures += 1
            log.error("bridge: a refused request (%d samples) could not be spooled: %s; dropped", req.samples, exc)
        for acc in req.messages:
            self._record(acc)
            self.session.ack(acc.message)
