"""One long-lived MQTT session per broker (paho-mqtt 2.x); the only module that touches paho.

paho is driven from the asyncio event loop, with no network thread of its own: the loop watches the session's
socket (``add_reader``, and ``add_writer`` only while paho has bytes it could not write), a publish is written
in the caller's loop iteration, and paho's keepalive housekeeping runs on a timer on whole seconds. So a publish
or a PUBACK costs no thread hand-off and no extra wake-up. Only the blocking part of a (re)connect (TCP connect,
TLS handshake, each bounded by ``connect_timeout_s``) runs in a worker thread. A session never gives up: without
a broker, ``start()`` returns and the session keeps reconnecting with capped exponential backoff and jitter.
Nothing here raises on a broker error except ``publish``, which raises ``TransientError`` when the message
cannot be confirmed.

Logging: one warning when the link goes (the connection lost, or the first failed attempt), then the attempts
at debug level, except a new reason that points at a setting (a certificate, a password: ``_hint``), which is a
warning once; one line when it is back, at ``reconnect_log_level`` (the mapper's shipper logs the return itself,
with what waited and how long the replay took, so its sessions say it at debug level).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import logging
import os
import random
import re
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import urlsplit

import paho.mqtt.client as paho

from mapper.clock import format_duration_s, next_on_grid, sleep_or_wake
from mapper.errors import ConfigError, TransientError
from mapper.shared.settings import MqttSettings

log = logging.getLogger(__name__)

MessageCallback = Callable[[str, bytes], Any]
ConnectCallback = Callable[[], Any]

#: OpenSSL's source location in an error text: ``(_ssl.c:2580)``.
_SSL_WHERE_RE = re.compile(r"\s*\(_ssl\.c:\d+\)")


@dataclass(frozen=True)
class ReceivedMessage:
    """A message for a subscriber that acknowledges it itself (``subscribe_acked``): pass it to
    ``MqttSession.ack`` once it is safely handled. ``generation`` is the connection it came on (an ack belongs to
    that connection: after a reconnect the broker sends unacknowledged messages again)."""

    topic: str
    payload: bytes
    mid: int
    qos: int
    generation: int
    retain: bool = False
    dup: bool = False


AckedCallback = Callable[[ReceivedMessage], Any]

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


def _no_key_passphrase() -> str:
    """``load_cert_chain``'s password callback where none is configured: it is called only for an encrypted key."""
    raise ValueError("the client key is encrypted and no passphrase is configured (mqtt.keyPasswordFile)")


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
        key_password: str | None = None,
        tls_insecure: bool = False,
        keepalive_s: int = 30,
        reconnect_min_s: float = 0.5,
        reconnect_max_s: float = 30.0,
        connect_timeout_s: float = 10.0,
        max_inflight: int = 100,
        rng: random.Random | None = None,
        mqtt5: bool = False,
        session_expiry_s: int | None = None,
        receive_maximum: int | None = None,
        manual_ack: bool = False,
        reconnect_log_level: int = logging.INFO,
    ) -> None:
        """``mqtt5`` speaks MQTT 5; with ``session_expiry_s`` the session is persistent (clean start off: the
        broker keeps the subscriptions and the unacknowledged and queued messages while the client is away for
        up to that long). ``manual_ack``: QoS 1/2 messages are acknowledged only by ``ack`` (subscribers of
        ``subscribe_acked``) or right after the plain callbacks ran (``subscribe``). ``receive_maximum`` caps
        the unacknowledged messages the broker sends (MQTT 5). ``reconnect_log_level``: the level of the line that
        says the link is back after an outage (the first connection without one is always logged at INFO)."""
        self.address = parse_broker_url(url)
        if not client_id:
            raise ConfigError("MQTT client_id must not be empty")
        if not 0 < reconnect_min_s <= reconnect_max_s:
            raise ConfigError(
                f"MQTT reconnect delays need 0 < min <= max, got min={reconnect_min_s} max={reconnect_max_s}"
            )
        if keepalive_s < 5:
            raise ConfigError(f"MQTT keepalive_s must be >= 5, got {keepalive_s}")
        if connect_timeout_s <= 0:
            raise ConfigError(f"MQTT connect_timeout_s must be > 0, got {connect_timeout_s}")
        if (cert_file is None) != (key_file is None):
            raise ConfigError("MQTT client certificate needs both cert_file and key_file")
        if session_expiry_s is not None and (not mqtt5 or session_expiry_s < 0):
            raise ConfigError(f"MQTT session expiry needs MQTT 5 and >= 0 s, got {session_expiry_s}")
        if receive_maximum is not None and (not mqtt5 or not 0 < receive_maximum <= 65535):
            raise ConfigError(f"MQTT receive maximum needs MQTT 5 and 1..65535, got {receive_maximum}")
        if not self.address.tls and (ca_file or cert_file):
            raise ConfigError(f"MQTT {url}: CA or client certificate given for a plain (non-TLS) URL; use mqtts://")
        self.url = self.address.url
        self.client_id = client_id
        self.keepalive_s = keepalive_s
        self.reconnect_min_s = reconnect_min_s
        self.reconnect_max_s = reconnect_max_s
        self.connect_timeout_s = connect_timeout_s
        #: How often paho's housekeeping (keepalive PINGREQ, a missing PINGRESP) runs: on whole seconds, so
        #: it shares the wake-up of the mapper's 1 s collect grid.
        self.misc_interval_s = float(max(1, min(5, keepalive_s // 4)))
        self._rng = rng or random.Random()
        self._failures = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._connected = False
        self._started = False
        self._stopping = False
        self._ever_connected = False
        self.reconnect_log_level = reconnect_log_level
        #: When the current outage began (monotonic: the connection lost, or the first failed attempt), and the
        #: attempts that failed since; None while connected or before the first attempt.
        self.down_since: float | None = None
        self.outage_attempts = 0
        self._on_down: list[ConnectCallback] = []
        self.reconnects = 0
        self.connect_failures = 0
        #: Why the last connection attempt failed (None after a successful connect). The first failure of an
        #: outage is a warning; later ones are debug lines, but for a new reason that points at a setting (a broker
        #: refusing the client's certificate or password), a warning once per outage: named, not on every retry.
        self.last_failure: str | None = None
        self._warned: set[str] = set()
        self._last_socket_error: str | None = None
        self._acks: dict[int, asyncio.Future[None]] = {}
        #: SUBSCRIBE packets of this connection still waiting for their SUBACK (by message id).
        self._pending_subs: dict[int, str] = {}
        self._subscribed_event: asyncio.Event | None = None
        #: Subscriptions the broker refused in a SUBACK (an ACL), by topic filter.
        self.refused_subscriptions: set[str] = set()
        self._subs: dict[str, tuple[int, list[MessageCallback]]] = {}
        self._acked_subs: dict[str, tuple[int, list[AckedCallback]]] = {}
        self.mqtt5 = mqtt5
        self.manual_ack = manual_ack
        #: Successful connections so far; a ``ReceivedMessage`` can be acknowledged only on its own connection.
        self.generation = 0
        self._on_connect: list[ConnectCallback] = []
        self._connected_event: asyncio.Event | None = None
        self._stop_event: asyncio.Event | None = None
        self._tasks: set[asyncio.Future[Any]] = set()
        self._runner: asyncio.Task[None] | None = None
        #: The socket the event loop watches (its fd), whether it also waits to write, and the end of the
        #: current connection (resolved by a disconnect, a missing CONNACK or stop).
        self._fd: int | None = None
        self._writing = False
        self._conn_ended: asyncio.Future[str] | None = None
        #: A CONNACK with a failure code, until paho closes that connection.
        self._refused: str | None = None
        self._misc_handle: asyncio.TimerHandle | None = None

        if mqtt5:
            client = paho.Client(
                callback_api_version=paho.CallbackAPIVersion.VERSION2,
                client_id=client_id,
                protocol=paho.MQTTv5,
                manual_ack=manual_ack,
            )
        else:
            client = paho.Client(
                callback_api_version=paho.CallbackAPIVersion.VERSION2,
                client_id=client_id,
                clean_session=True,
                protocol=paho.MQTTv311,
                manual_ack=manual_ack,
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
                    # Without a passphrase, an encrypted key must fail rather than make OpenSSL prompt on a terminal.
                    keyfile_password=cast(str, key_password if key_password is not None else _no_key_passphrase),
                    cert_reqs=ssl.CERT_NONE if tls_insecure else ssl.CERT_REQUIRED,
                    tls_version=ssl.PROTOCOL_TLS_CLIENT,
                )
            except (OSError, ssl.SSLError, ValueError) as exc:
                raise ConfigError(f"MQTT {url}: TLS files unusable (ca={ca_file}, cert={cert_file}): {exc}") from None
            if tls_insecure:
                client.tls_insecure_set(True)
        if will_topic is not None:
            client.will_set(will_topic, will_payload, qos=1, retain=will_retain)
        if mqtt5:
            from paho.mqtt.packettypes import PacketTypes
            from paho.mqtt.properties import Properties

            props = Properties(PacketTypes.CONNECT)
            if session_expiry_s is not None:
                props.SessionExpiryInterval = session_expiry_s
            if receive_maximum is not None:
                props.ReceiveMaximum = receive_maximum
            client.connect_async(
                self.address.host,
                self.address.port,
                keepalive=keepalive_s,
                clean_start=session_expiry_s is None,
                properties=props,
            )
        else:
            client.connect_async(self.address.host, self.address.port, keepalive=keepalive_s)
        client.on_connect = self._paho_connect
        client.on_disconnect = self._paho_disconnect
        client.on_publish = self._paho_publish
        client.on_subscribe = self._paho_subscribe
        client.on_message = self._paho_message
        client.on_socket_open = _no_delay
        client.on_socket_close = self._paho_socket_close
        # paho's own log lines go to a sink that keeps its socket errors only (they carry the TLS alert a broker
        # sent when it refused us); an on_log callback would make paho format every line of every publish.
        client.enable_logger(_SocketErrorSink(self))  # type: ignore[arg-type]
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
        self._stop_event = asyncio.Event()
        self._started = True
        self._runner = self._loop.create_task(self._run(), name=f"mqtt {self.url}")
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
        """Disconnect cleanly (the broker does not publish the last will) and end the session."""
        if not self._started or self._stopping:
            return
        self._stopping = True
        if self._stop_event is not None:
            self._stop_event.set()
        with contextlib.suppress(Exception):
            self._client.disconnect()  # writes DISCONNECT now when it can; paho closes the socket after it
            self._sync_writer()
        runner = self._runner
        if runner is not None and not runner.done():
            done, _ = await asyncio.wait((runner,), timeout=timeout_s)
            if not done:
                log.warning("mqtt %s: the session did not end within %.1fs; closing its socket", self.url, timeout_s)
                runner.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await runner
        self._close_socket()  # still open if DISCONNECT could not be written: the broker sees the link drop
        self._connected = False
        self._fail_pending("session stopped")
        log.info("mqtt %s: session %s stopped", self.url, self.client_id)

    def add_on_connect(self, callback: ConnectCallback) -> None:
        """``callback()`` runs on the loop after every (re)connect; a coroutine result is scheduled as a task."""
        self._on_connect.append(callback)

    def add_on_down(self, callback: ConnectCallback) -> None:
        """``callback()`` runs on the loop when an outage begins: the connection was lost, or the first attempt of
        a session not connected yet failed (once per outage, not per attempt)."""
        self._on_down.append(callback)

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
        finally:
            self._sync_writer()
        if info.rc != paho.MQTT_ERR_SUCCESS:
            raise TransientError(
                f"mqtt {self.url}: publish to {topic} refused: {paho.error_string(info.rc)}", reason="mqtt-offline"
            )
        if qos == 0:
            return
        # paho reads PUBACKs on this loop, in a later iteration: registering the future now is in time.
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
        _, callbacks = self._subs.get(topic_filter, (qos, []))
        callbacks.append(callback)
        self._subs[topic_filter] = (qos, callbacks)
        if self._connected:
            self._send_subscribe(self._client, topic_filter, qos)
            self._sync_writer()

    @property
    def subscribed(self) -> bool:
        """Connected, and the broker has answered every subscription of this connection (SUBACK)."""
        return self._connected and not self._pending_subs

    async def wait_subscribed(self, timeout_s: float) -> bool:
        """Wait until ``subscribed`` (True) or ``timeout_s`` passed (False): a message published after this
        reaches this session's callbacks."""
        deadline = time.monotonic() + timeout_s
        while not self.subscribed:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self._subscribed_event is None:
                self._subscribed_event = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._subscribed_event.wait(), min(left, 0.5))
        return True

    def _send_subscribe(self, client: paho.Client, topic_filter: str, qos: int) -> None:
        _, mid = client.subscribe(topic_filter, qos)
        if mid is not None:
            self._pending_subs[mid] = topic_filter
            if self._subscribed_event is not None:
                self._subscribed_event.clear()

    def _paho_subscribe(self, client: paho.Client, userdata: Any, mid: int, reason_codes: Any, props: Any) -> None:
        topic_filter = self._pending_subs.pop(mid, None)
        if topic_filter is not None and any(getattr(rc, "is_failure", False) for rc in reason_codes or ()):
            if topic_filter not in self.refused_subscriptions:
                log.warning("mqtt %s: the broker refused the subscription to %s", self.url, topic_filter)
            self.refused_subscriptions.add(topic_filter)
        elif topic_filter is not None:
            self.refused_subscriptions.discard(topic_filter)
        if not self._pending_subs and self._subscribed_event is not None:
            self._subscribed_event.set()

    def subscribe_acked(self, topic_filter: str, callback: AckedCallback, qos: int = 1) -> None:
        """Like ``subscribe``, but ``callback(ReceivedMessage)`` owns the acknowledgement: with ``manual_ack``
        the broker gets the PUBACK only when ``ack(message)`` is called. ``topic_filter`` may be a shared
        subscription, ``$share/<group>/<filter>``."""
        if qos not in (0, 1, 2):
            raise ValueError(f"MQTT qos must be 0, 1 or 2, got {qos}")
        _, callbacks = self._acked_subs.get(topic_filter, (qos, []))
        callbacks.append(callback)
        self._acked_subs[topic_filter] = (qos, callbacks)
        if self._connected:
            self._send_subscribe(self._client, topic_filter, qos)
            self._sync_writer()

    def ack(self, message: ReceivedMessage) -> bool:
        """Acknowledge ``message`` to the broker; False (nothing sent) when its connection has ended, in which
        case the broker sends it again on the next one."""
        if not self.manual_ack or message.qos == 0:
            return True
        if message.generation != self.generation or not self._connected:
            return False
        rc = self._client.ack(message.mid, message.qos)
        self._sync_writer()
        return bool(rc == paho.MQTT_ERR_SUCCESS)

    # ------------------------------------------------------------------------------------------ connection

    async def _run(self) -> None:
        """Connect, serve the connection until it ends, wait a backoff, again; until ``stop``."""
        while not self._stopping:
            try:
                await self._serve_one_connection()
            except Exception:
                log.exception("mqtt %s: unexpected error in the session; reconnecting", self.url)
                self._drop_socket()
            if self._stopping:
                break
            delay = self._next_delay()
            log.debug("mqtt %s: next connection attempt in %.1fs", self.url, delay)
            assert self._stop_event is not None
            await sleep_or_wake(self._stop_event, delay)
            if self._stopping:
                break

    async def _serve_one_connection(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            # TCP connect, TLS handshake and CONNECT block (each bounded by connect_timeout_s): off the loop.
            rc = await asyncio.to_thread(self._client.reconnect)
        except (OSError, ssl.SSLError, ValueError) as exc:
            self._connect_failed(f"connect failed: {_describe_error(exc)}")
            return
        sock = self._client.socket()
        if self._stopping or sock is None or rc != paho.MQTT_ERR_SUCCESS:
            if rc != paho.MQTT_ERR_SUCCESS:
                self._connect_failed(f"sending CONNECT failed: {self._socket_error_or(paho.error_string(rc))}")
            self._close_socket()
            return
        ended: asyncio.Future[str] = loop.create_future()
        self._conn_ended = ended
        self._fd = sock.fileno()
        loop.add_reader(self._fd, self._on_readable)
        self._sync_writer()
        connack_deadline = loop.call_later(self.connect_timeout_s, self._no_connack)
        self._schedule_misc()
        try:
            why = await ended
        finally:
            connack_deadline.cancel()
            if self._misc_handle is not None:
                self._misc_handle.cancel()
                self._misc_handle = None
            self._conn_ended = None
        if why == "no CONNACK":
            self._connect_failed(f"no CONNACK within {self.connect_timeout_s:g}s")
        elif why == "closed before CONNACK":
            self._connect_failed(
                f"the broker closed the connection before CONNACK: {self._socket_error_or('no reason')}"
            )

    def _connect_failed(self, why: str) -> None:
        """Count a failed attempt: a warning when it begins an outage, or for a new reason that points at a
        setting; else a debug line."""
        self.connect_failures += 1
        self.outage_attempts += 1
        self._last_socket_error = None
        hint = _hint(why, tls=self.address.tls)
        text = f"{why}{hint}"
        first = self._begin_outage()
        level = logging.WARNING if first or (hint and text not in self._warned) else logging.DEBUG
        self._warned.add(text)
        self.last_failure = text
        log.log(level, "mqtt %s: %s; retrying (telemetry is kept in the buffer meanwhile)", self.url, text)

    def _begin_outage(self) -> bool:
        """Mark the start of an outage (True) unless one is going on (False); the down callbacks run soon."""
        if self.down_since is not None or self._stopping:
            return False
        self.down_since = time.monotonic()
        if self._loop is not None:
            for cb in self._on_down:
                self._loop.call_soon(self._run_callback, cb, "on-down")
        return True

    def _run_callback(self, cb: ConnectCallback, kind: str) -> None:
        try:
            result = cb()
            if asyncio.iscoroutine(result):
                self._keep(asyncio.ensure_future(result))
        except Exception:
            log.exception("mqtt %s: %s callback %r failed", self.url, kind, cb)

    def _socket_error_or(self, fallback: str) -> str:
        return self._last_socket_error or fallback

    def _no_connack(self) -> None:
        if self._connected or self._conn_ended is None:
            return
        self._end_connection("no CONNACK")
        with contextlib.suppress(Exception):
            self._client.disconnect()
        self._close_socket()

    def _end_connection(self, why: str) -> None:
        ended = self._conn_ended
        if ended is not None and not ended.done():
            ended.set_result(why)

    def _schedule_misc(self) -> None:
        loop = self._loop
        if loop is None:
            return
        at = next_on_grid(loop.time(), self.misc_interval_s)
        self._misc_handle = loop.call_at(at, self._misc)

    def _misc(self) -> None:
        """Keepalive: a PINGREQ when the link was quiet for ``keepalive_s``, a disconnect when no PINGRESP came."""
        self._misc_handle = None
        if self._fd is None:
            return
        self._client.loop_misc()
        self._sync_writer()
        if self._fd is not None:
            self._schedule_misc()

    def _on_readable(self) -> None:
        self._client.loop_read()
        self._sync_writer()

    def _on_writable(self) -> None:
        self._client.loop_write()
        self._sync_writer()

    def _sync_writer(self) -> None:
        """Watch the socket for writability exactly while paho has bytes it could not write yet."""
        loop, fd = self._loop, self._fd
        if loop is None or fd is None:
            return
        want = self._client.want_write()
        if want and not self._writing:
            loop.add_writer(fd, self._on_writable)
            self._writing = True
        elif not want and self._writing:
            loop.remove_writer(fd)
            self._writing = False

    def _drop_socket(self) -> None:
        """Stop watching the current socket (before paho closes it, or after a failed connection)."""
        loop, fd = self._loop, self._fd
        self._fd = None
        if loop is None or fd is None or loop.is_closed():
            return
        loop.remove_reader(fd)
        if self._writing:
            loop.remove_writer(fd)
            self._writing = False

    def _close_socket(self) -> None:
        """Stop watching paho's socket and close it (a connection given up on, or left over at stop)."""
        self._drop_socket()
        sock = self._client.socket()
        if sock is not None:
            with contextlib.suppress(OSError, AttributeError):
                sock.close()

    def _next_delay(self) -> float:
        cap = min(self.reconnect_max_s, self.reconnect_min_s * (2 ** min(self._failures, 30)))
        self._failures += 1
        return max(self.reconnect_min_s, cap / 2 + self._rng.uniform(0, cap / 2))

    # ------------------------------------------------------------------------------------------ paho callbacks
    # paho calls these on the event loop's thread, from loop_read / loop_write / loop_misc / disconnect, while
    # it holds its callback lock: they only change state and schedule the rest with call_soon.

    def _paho_socket_close(self, client: paho.Client, userdata: Any, sock: Any) -> None:
        if self._fd is not None and sock is not None and sock.fileno() == self._fd:
            self._drop_socket()

    def _paho_connect(self, client: paho.Client, userdata: Any, flags: Any, reason_code: Any, properties: Any) -> None:
        if reason_code.is_failure:
            self._refused = f"the broker refused the connection: {reason_code}"
            return  # paho closes the connection next: the session waits a backoff and tries again
        self._failures = 0
        self.last_failure = None
        self._warned.clear()
        self._pending_subs.clear()
        self.generation += 1
        for topic_filter, (qos, _) in (*self._subs.items(), *self._acked_subs.items()):
            self._send_subscribe(client, topic_filter, qos)
        self._connected = True
        if self._loop is not None:
            self._loop.call_soon(self._loop_connected)

    def _paho_disconnect(self, client: paho.Client, userdata: Any, flags: Any, reason_code: Any, props: Any) -> None:
        was = self._connected
        self._connected = False
        self._drop_socket()
        if was and not self._stopping:
            self._begin_outage()
            log.warning("mqtt %s: connection lost (%s); reconnecting", self.url, reason_code)
        self._fail_pending("connection lost")
        refused, self._refused = self._refused, None
        if refused is not None:
            self._connect_failed(refused)
            self._end_connection("refused")
        else:
            self._end_connection("disconnected" if was or self._stopping else "closed before CONNACK")

    def _paho_publish(self, client: paho.Client, userdata: Any, mid: int, reason_code: Any, props: Any) -> None:
        self._loop_ack(mid)

    def _paho_message(self, client: paho.Client, userdata: Any, message: paho.MQTTMessage) -> None:
        if self._loop is not None:
            if self._acked_subs or self.manual_ack:
                received = ReceivedMessage(
                    message.topic,
                    bytes(message.payload),
                    message.mid,
                    message.qos,
                    self.generation,
                    bool(message.retain),
                    bool(message.dup),
                )
                self._loop.call_soon(self._loop_received, received)
            else:
                self._loop.call_soon(self._loop_message, message.topic, bytes(message.payload))

    # ------------------------------------------------------------------------------------------ loop side

    def _loop_connected(self) -> None:
        if not self._connected:
            return
        if self._ever_connected:
            self.reconnects += 1
        self._ever_connected = True
        down_since, attempts = self.down_since, self.outage_attempts
        self.down_since, self.outage_attempts = None, 0
        if down_since is None:
            log.info("mqtt %s: connected as %s (reconnects so far: %d)", self.url, self.client_id, self.reconnects)
        else:
            log.log(
                self.reconnect_log_level,
                "mqtt %s: connected as %s after %s away (%d failed attempts; reconnects so far: %d)",
                self.url,
                self.client_id,
                format_duration_s(time.monotonic() - down_since),
                attempts,
                self.reconnects,
            )
        if self._connected_event is not None:
            self._connected_event.set()
        for cb in list(self._on_connect):
            self._run_callback(cb, "on-connect")

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
        matched = [cbs for f, (_, cbs) in self._subs.items() if topic_matches(f, topic)]
        for callbacks in matched:
            for cb in callbacks:
                try:
                    result = cb(topic, payload)
                    if asyncio.iscoroutine(result):
                        self._keep(asyncio.ensure_future(result))
                except Exception:
                    log.exception("mqtt %s: message callback for %s failed", self.url, topic)

    def _loop_received(self, message: ReceivedMessage) -> None:
        """A message in manual-ack mode (or for an acked subscriber): the acked subscribers own its PUBACK;
        one only plain subscribers want is acknowledged after their callbacks ran."""
        owners = [cbs for f, (_, cbs) in self._acked_subs.items() if topic_matches(_unshared(f), message.topic)]
        self._loop_message(message.topic, message.payload)
        if not owners:
            self.ack(message)
            return
        for callbacks in owners:
            for cb in callbacks:
                try:
                    result = cb(message)
                    if asyncio.iscoroutine(result):
                        self._keep(asyncio.ensure_future(result))
                except Exception:
                    log.exception("mqtt %s: message callback for %s failed", self.url, message.topic)


def _unshared(topic_filter: str) -> str:
    """The topic filter of a shared subscription (``$share/<group>/<filter>`` -> ``<filter>``)."""
    if topic_filter.startswith("$share/"):
        parts = topic_filter.split("/", 2)
        return parts[2] if len(parts) == 3 else ""
    return topic_filter


class _SocketErrorSink:
    """Stands in for the ``logging.Logger`` paho logs to: an ERROR about the socket is kept as the session's
    last socket error; everything else is dropped unformatted (it would only repeat what this module logs)."""

    def __init__(self, session: MqttSession) -> None:
        self._session = session

    def log(self, level: int, fmt: str, *args: Any) -> None:
        if level >= logging.ERROR and "socket" in fmt:
            text = fmt % args
            text = _SSL_WHERE_RE.sub("", text.replace("failed to receive on socket: ", ""))
            self._session._last_socket_error = text.strip()


def _describe_error(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"TLS: the broker's certificate is not trusted ({exc.verify_message})"
    if isinstance(exc, ssl.SSLError):
        return f"TLS: {exc.reason or exc}"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


def _hint(why: str, *, tls: bool) -> str:
    """What an operator should look at, for the failures whose cause is a setting."""
    text = why.lower()
    if "certificate required" in text or "bad certificate" in text or "unknown ca" in text:
        return " (the broker wants a client certificate it trusts: check mqtt.certFile / keyFile and its CA)"
    if "not trusted" in text:
        return " (check mqtt.caFile: it must hold the CA that signed the broker's certificate)"
    if "not authorized" in text or "bad user name or password" in text:
        return " (check mqtt.username and the password)"
    if tls and ("before connack" in text or "eof occurred" in text):
        return " (a TLS broker does this when it refuses the client certificate or the client has none)"
    return ""


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


#: Prefix of the abstract Unix socket names that hold the default client ids (``ClientIdClaim``).
_CLAIM_PREFIX = "gpu-mapper/mqtt-client-id/"


class ClientIdClaim:
    """The default MQTT client id of one process: ``base`` (``gpu-mapper-<node>``, ``<group>-<hostname>``) where
    no other process of this host holds it, else ``base-1``, ``base-2``, ... the first free one.

    A broker takes a session over when a second client connects with its id, so two processes on one host with
    the same config (two bridge replicas, two mappers during a rolling update) must not share one. Each id is
    held by binding a Linux abstract Unix socket named after it: the name is released by the kernel when the
    process ends, however it ends (SIGKILL too), and it is shared by the processes of one network namespace,
    which includes containers with the host's network, the ones that share its host name. So the id is unique
    among the live processes, and stable across restarts (a restarted process takes the lowest free one again,
    and a persistent session, the bridge's, resumes). No file is written. ``close`` gives the id back.
    ``max_slots`` ids are tried; where none is free (or abstract sockets are not there: not Linux), the id is
    ``base-<pid>`` and a warning says so."""

    def __init__(self, base: str, *, max_slots: int = 64) -> None:
        if not base:
            raise ConfigError("MQTT client id: the base of a default one must not be empty")
        self._socket: socket.socket | None = None
        self.client_id = ""
        for slot in range(max_slots):
            candidate = base if slot == 0 else f"{base}-{slot}"
            digest = hashlib.sha256(candidate.encode()).hexdigest()[:32]  # a name fits sun_path whatever the base
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            try:
                sock.bind(b"\0" + (_CLAIM_PREFIX + digest).encode())
            except OSError as exc:
                sock.close()
                if exc.errno == errno.EADDRINUSE:
                    continue
                log.warning("MQTT client id: cannot hold %s on this host (%s); using a per-process id", base, exc)
                break
            self._socket = sock
            self.client_id = candidate
            return
        else:
            log.warning("MQTT client id: %s and %d more are held by other processes here", base, max_slots - 1)
        self.client_id = f"{base}-{os.getpid()}"

    @property
    def held(self) -> bool:
        """Whether this claim holds its id on the host (False: the ``base-<pid>`` fallback)."""
        return self._socket is not None

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def session_from_settings(url: str, settings: MqttSettings, client_id: str, **session_kwargs: Any) -> MqttSession:
    """A session to ``url`` with the credentials and TLS files of ``settings`` (the ``mqtt:`` settings of the
    mapper or of the bridge); ``session_kwargs``: the rest of ``MqttSession``'s (last will, MQTT 5, ...)."""
    return MqttSession(
        url,
        client_id,
        username=settings.username,
        password=settings.password,
        ca_file=settings.ca_file,
        cert_file=settings.cert_file,
        key_file=settings.key_file,
        key_password=settings.key_password,
        **session_kwargs,
    )


#: The mapper's longest wait between two connection attempts: a broker that comes back is reached within it (plus
#: the connect itself). The delays double from ``reconnect_min_s`` to it, each drawn between half and all of it
#: (jitter), so a fleet of nodes does not reconnect in step.
MAPPER_RECONNECT_MAX_S = 4.0


def mapper_session(
    url: str,
    settings: MqttSettings,
    node: str,
    will_topic: str,
    will_payload: bytes,
    *,
    client_id: str = "",
) -> MqttSession:
    """The default broker's session of the mapper on ``node`` (``mqtt:`` settings: credentials, TLS, client id,
    else ``client_id``, the process's default (``ClientIdClaim``), else ``gpu-mapper-<node>``): its last will
    (``will_payload`` on ``will_topic``, both the wire's: the caller's) marks the mapper offline; it tries again at
    most ``MAPPER_RECONNECT_MAX_S`` apart, and says its return at debug level (the shipper logs it, with what
    waited and how long the replay took)."""
    return session_from_settings(
        url,
        settings,
        settings.client_id or client_id or f"gpu-mapper-{node}",
        will_topic=will_topic,
        will_payload=will_payload,
        reconnect_max_s=MAPPER_RECONNECT_MAX_S,
        reconnect_log_level=logging.DEBUG,
    )
