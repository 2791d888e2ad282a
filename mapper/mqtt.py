"""One long-lived MQTT session per broker (paho-mqtt 2.x); the only module that touches paho or ssl.

paho runs its own network thread (``loop_start``); every event it sees (CONNACK, PUBACK, a message, a lost
connection) is handed to the asyncio loop with ``call_soon_threadsafe``, so all session state that callers see
is changed on the loop. A session never gives up: without a broker, ``start()`` returns and the network thread
keeps reconnecting with capped exponential backoff and jitter. Nothing here raises on a broker error except
``publish``, which raises ``TransientError`` when the message cannot be confirmed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import random
import socket
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import paho.mqtt.client as paho

from mapper.errors import ConfigError, TransientError

log = logging.getLogger(__name__)

MessageCallback = Callable[[str, bytes], Any]
ConnectCallback = Callable[[], Any]

_PLAIN = {"mqtt": False, "tcp": False, "mqtts": True, "ssl": True}
_DEFAULT_PORT = {False: 1883, True: 8883}


@dataclass(frozen=True)
class BrokerAddress:
    host: str
    port: int
    tls: bool

    @property
    def url(self) -> str:
        """The canonical form: ``mqtt://host:port`` or ``mqtts://host:port``."""
        return f"{'mqtts' if self.tls else 'mqtt'}://{self.host}:{self.port}"


def parse_broker_url(url: str) -> BrokerAddress:
    """``mqtt://``, ``tcp://`` (plain) or ``mqtts://``, ``ssl://`` (TLS) ``host[:port]``; ConfigError otherwise."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"MQTT broker URL {url!r}: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme not in _PLAIN:
        raise ConfigError(f"MQTT broker URL {url!r}: scheme must be mqtt, mqtts, tcp or ssl, got {scheme!r}")
    if not parts.hostname:
        raise ConfigError(f"MQTT broker URL {url!r} has no host")
    if parts.path not in ("", "/") or parts.query:
        raise ConfigError(f"MQTT broker URL {url!r}: a path or query is not allowed")
    tls = _PLAIN[scheme]
    return BrokerAddress(parts.hostname, port or _DEFAULT_PORT[tls], tls)


def topic_matches(topic_filter: str, topic: str) -> bool:
    return bool(paho.topic_matches_sub(topic_filter, topic))


class MqttSession:
    """A long-lived connection to one broker, with reconnect, re-subscribe, PUBACK-confirmed publish and LWT."""

    def __init__(
        self,
        url: str,
        client_id: str,
        *,
        will_topic: str | None = None,
        will_payload: bytes | str | None = None,
        will_retain: bool = True,
        username: str | None = None,
        password: str | None = None,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        tls_insecure: bool = False,
        keepalive_s: int = 30,
        reconnect_min_s: float = 0.5,
        reconnect_max_s: float = 30.0,
        connect_timeout_s: float = 10.0,
        max_inflight: int = 100,
        rng: random.Random | None = None,
    ) -> None:
        self.address = parse_broker_url(url)
        if not client_id:
            raise ConfigError("MQTT client_id must not be empty")
        if not 0 < reconnect_min_s <= reconnect_max_s:
            raise ConfigError(
                f"MQTT reconnect delays need 0 < min <= max, got min={reconnect_min_s} max={reconnect_max_s}"
            )
        if keepalive_s < 5:
            raise ConfigError(f"MQTT keepalive_s must be >= 5, got {keepalive_s}")
        if (cert_file is None) != (key_file is None):
            raise ConfigError("MQTT client certificate needs both cert_file and key_file")
        if not self.address.tls and (ca_file or cert_file):
            raise ConfigError(f"MQTT {url}: CA or client certificate given for a plain (non-TLS) URL; use mqtts://")
        self.url = self.address.url
        self.client_id = client_id
        self.keepalive_s = keepalive_s
        self.reconnect_min_s = reconnect_min_s
        self.reconnect_max_s = reconnect_max_s
        self.connect_timeout_s = connect_timeout_s
        self._rng = rng or random.Random()
        self._failures = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._connected = False
        self._started = False
        self._stopping = False
        self._ever_connected = False
        self.reconnects = 0
        self.connect_failures = 0
        self._acks: dict[int, asyncio.Future[None]] = {}
        self._subs: dict[str, tuple[int, list[MessageCallback]]] = {}
        self._subs_lock = threading.Lock()
        self._on_connect: list[ConnectCallback] = []
        self._connected_event: asyncio.Event | None = None
        self._tasks: set[asyncio.Future[Any]] = set()

        client = paho.Client(
            callback_api_version=paho.CallbackAPIVersion.VERSION2,
            client_id=client_id,
            clean_session=True,
            protocol=paho.MQTTv311,
        )
        client.connect_timeout = connect_timeout_s
        client.max_inflight_messages_set(max_inflight)
        client.max_queued_messages_set(0)
        if username is not None:
            client.username_pw_set(username, password)
        if self.address.tls:
            try:
                client.tls_set(
                    ca_certs=ca_file,
                    certfile=cert_file,
                    keyfile=key_file,
                    cert_reqs=ssl.CERT_NONE if tls_insecure else ssl.CERT_REQUIRED,
                    tls_version=ssl.PROTOCOL_TLS_CLIENT,
                )
            except (OSError, ssl.SSLError, ValueError) as exc:
                raise ConfigError(f"MQTT {url}: TLS files unusable (ca={ca_file}, cert={cert_file}): {exc}") from None
            if tls_insecure:
                client.tls_insecure_set(True)
        if will_topic is not None:
            client.will_set(will_topic, will_payload, qos=1, retain=will_retain)
        client.reconnect_delay_set(reconnect_min_s, reconnect_min_s)  # type: ignore[arg-type]
        client.on_connect = self._paho_connect
        client.on_disconnect = self._paho_disconnect
        client.on_connect_fail = self._paho_connect_fail
        client.on_publish = self._paho_publish
        client.on_message = self._paho_message
        client.on_socket_open = _no_delay
        self._client = client

    # ------------------------------------------------------------------------------------------ lifecycle

    @property
    def connected(self) -> bool:
        return self._connected

    async def start(self) -> None:
        """Start connecting in the background; returns at once, broker or not."""
        if self._started:
            return
        self._loop = asyncio.get_running_loop()
        self._connected_event = asyncio.Event()
        self._started = True
        self._client.connect_async(self.address.host, self.address.port, keepalive=self.keepalive_s)
        self._client.loop_start()
        log.info("mqtt %s: session %s started", self.url, self.client_id)

    async def wait_connected(self, timeout_s: float) -> bool:
        """Wait until connected (True) or ``timeout_s`` passed (False)."""
        if self._connected:
            return True
        if self._connected_event is None:
            return False
        try:
            await asyncio.wait_for(self._connected_event.wait(), timeout_s)
        except TimeoutError:
            return self._connected
        return True

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Disconnect cleanly (the broker does not publish the last will) and end the network thread."""
        if not self._started or self._stopping:
            return
        self._stopping = True
        with contextlib.suppress(Exception):
            self._client.disconnect()
        try:
            await asyncio.wait_for(asyncio.to_thread(self._client.loop_stop), timeout_s)
        except TimeoutError:
            log.warning("mqtt %s: network thread did not stop within %.1fs", self.url, timeout_s)
        self._connected = False
        self._fail_pending("session stopped")
        log.info("mqtt %s: session %s stopped", self.url, self.client_id)

    def add_on_connect(self, callback: ConnectCallback) -> None:
        """``callback()`` runs on the loop after every (re)connect; a coroutine result is scheduled as a task."""
        self._on_connect.append(callback)

    # ------------------------------------------------------------------------------------------ publish / subscribe

    async def publish(
        self,
        topic: str,
        payload: bytes | str,
        qos: int = 1,
        retain: bool = False,
        timeout_s: float = 10.0,
    ) -> None:
        """Publish and wait for the broker's PUBACK (QoS 1/2) or the hand-off to paho (QoS 0).

        Raises ``TransientError`` when not connected, when paho refuses, or when no PUBACK came in ``timeout_s``.
        """
        if qos not in (0, 1, 2):
            raise ValueError(f"MQTT qos must be 0, 1 or 2, got {qos}")
        if not self._connected or self._loop is None:
            raise TransientError(f"mqtt {self.url}: not connected", reason="mqtt-offline")
        try:
            info = self._client.publish(topic, payload, qos=qos, retain=retain)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"mqtt publish to {topic!r}: {exc}") from None
        if info.rc != paho.MQTT_ERR_SUCCESS:
            raise TransientError(
                f"mqtt {self.url}: publish to {topic} refused: {paho.error_string(info.rc)}", reason="mqtt-offline"
            )
        if qos == 0:
            return
        # The PUBACK is handed to the loop with call_soon_threadsafe, so it runs after this registration.
        fut: asyncio.Future[None] = self._loop.create_future()
        self._acks[info.mid] = fut
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout_s)
        except TimeoutError:
            raise TransientError(
                f"mqtt {self.url}: no PUBACK for {topic} within {timeout_s}s", reason="mqtt-timeout"
            ) from None
        finally:
            self._acks.pop(info.mid, None)

    def subscribe(self, topic_filter: str, callback: MessageCallback, qos: int = 1) -> None:
        """Subscribe now (if connected) and after every reconnect; ``callback(topic, payload)`` runs on the loop."""
        if qos not in (0, 1, 2):
            raise ValueError(f"MQTT qos must be 0, 1 or 2, got {qos}")
        with self._subs_lock:
            _, callbacks = self._subs.get(topic_filter, (qos, []))
            callbacks.append(callback)
            self._subs[topic_filter] = (qos, callbacks)
        if self._connected:
            self._client.subscribe(topic_filter, qos)

    # ------------------------------------------------------------------------------------------ paho thread side

    def _to_loop(self, fn: Callable[..., Any], *args: Any) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(fn, *args)

    def _next_delay(self) -> float:
        cap = min(self.reconnect_max_s, self.reconnect_min_s * (2 ** min(self._failures, 30)))
        self._failures += 1
        return max(self.reconnect_min_s, cap / 2 + self._rng.uniform(0, cap / 2))

    def _paho_connect(self, client: paho.Client, userdata: Any, flags: Any, reason_code: Any, properties: Any) -> None:
        if reason_code.is_failure:
            self.connect_failures += 1
            delay = self._next_delay()
            client.reconnect_delay_set(delay, delay)  # type: ignore[arg-type]
            log.warning("mqtt %s: broker refused the connection (%s); retry in %.1fs", self.url, reason_code, delay)
            return
        self._failures = 0
        with self._subs_lock:
            subs = [(f, q) for f, (q, _) in self._subs.items()]
        for topic_filter, qos in subs:
            client.subscribe(topic_filter, qos)
        self._connected = True
        self._to_loop(self._loop_connected)

    def _paho_disconnect(self, client: paho.Client, userdata: Any, flags: Any, reason_code: Any, props: Any) -> None:
        was = self._connected
        self._connected = False
        delay = self._next_delay()
        client.reconnect_delay_set(delay, delay)  # type: ignore[arg-type]
        if was and not self._stopping:
            log.warning("mqtt %s: connection lost (%s); reconnecting in %.1fs", self.url, reason_code, delay)
        self._to_loop(self._fail_pending, "connection lost")

    def _paho_connect_fail(self, client: paho.Client, userdata: Any) -> None:
        self.connect_failures += 1
        delay = self._next_delay()
        client.reconnect_delay_set(delay, delay)  # type: ignore[arg-type]
        log.debug("mqtt %s: connect failed; retry in %.1fs", self.url, delay)

    def _paho_publish(self, client: paho.Client, userdata: Any, mid: int, reason_code: Any, props: Any) -> None:
        self._to_loop(self._loop_ack, mid)

    def _paho_message(self, client: paho.Client, userdata: Any, message: paho.MQTTMessage) -> None:
        self._to_loop(self._loop_message, message.topic, bytes(message.payload))

    # ------------------------------------------------------------------------------------------ loop side

    def _loop_connected(self) -> None:
        if not self._connected:
            return
        if self._ever_connected:
            self.reconnects += 1
        self._ever_connected = True
        log.info("mqtt %s: connected as %s (reconnects so far: %d)", self.url, self.client_id, self.reconnects)
        if self._connected_event is not None:
            self._connected_event.set()
        for cb in list(self._on_connect):
            try:
                result = cb()
                if asyncio.iscoroutine(result):
                    self._keep(asyncio.ensure_future(result))
            except Exception:
                log.exception("mqtt %s: on-connect callback %r failed", self.url, cb)

    def _keep(self, task: asyncio.Future[Any]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Future[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("mqtt %s: callback task failed", self.url, exc_info=task.exception())

    def _loop_ack(self, mid: int) -> None:
        fut = self._acks.pop(mid, None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _fail_pending(self, why: str) -> None:
        if self._connected_event is not None and not self._connected:
            self._connected_event.clear()
        acks, self._acks = self._acks, {}
        for fut in acks.values():
            if not fut.done():
                fut.set_exception(TransientError(f"mqtt {self.url}: {why} before PUBACK", reason="mqtt-offline"))
                fut.exception()  # mark retrieved: the publisher may already have timed out

    def _loop_message(self, topic: str, payload: bytes) -> None:
        with self._subs_lock:
            matched = [cbs for f, (_, cbs) in self._subs.items() if topic_matches(f, topic)]
        for callbacks in matched:
            for cb in callbacks:
                try:
                    result = cb(topic, payload)
                    if asyncio.iscoroutine(result):
                        self._keep(asyncio.ensure_future(result))
                except Exception:
                    log.exception("mqtt %s: message callback for %s failed", self.url, topic)


def _no_delay(client: Any, userdata: Any, sock: Any) -> None:
    """TCP_NODELAY on every (re)connect: without it a publish written right after a PUBACK waits for the
    broker's delayed ACK (about 40 ms on Linux, Nagle's algorithm), which is most of an ack's latency."""
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class MqttSessions:
    """One session per broker URL (``tcp://h:1`` and ``mqtt://h:1`` are the same broker), closed together.

    ``add`` registers a session built by the caller (the main one, with the last will); ``get`` returns the
    session of a URL, creating and starting one with ``session_kwargs`` when there is none yet.
    """

    def __init__(self, client_id: str, **session_kwargs: Any) -> None:
        self.client_id = client_id
        self.session_kwargs = session_kwargs
        self._sessions: dict[str, MqttSession] = {}

    def add(self, session: MqttSession) -> None:
        if session.url in self._sessions and self._sessions[session.url] is not session:
            raise ConfigError(f"MQTT: a session for {session.url} is already open")
        self._sessions[session.url] = session

    async def get(self, url: str) -> MqttSession:
        key = parse_broker_url(url).url
        session = self._sessions.get(key)
        if session is None:
            suffix = hashlib.sha1(key.encode(), usedforsecurity=False).hexdigest()[:8]
            session = MqttSession(key, f"{self.client_id}-{suffix}", **self.session_kwargs)
            self._sessions[key] = session
            await session.start()
        return session

    def __contains__(self, url: str) -> bool:
        return parse_broker_url(url).url in self._sessions

    @property
    def sessions(self) -> dict[str, MqttSession]:
        return dict(self._sessions)

    async def close(self, timeout_s: float = 5.0) -> None:
        sessions, self._sessions = list(self._sessions.values()), {}
        await asyncio.gather(*(s.stop(timeout_s) for s in sessions), return_exceptions=True)
