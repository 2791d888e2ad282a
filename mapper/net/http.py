"""The bounded HTTP server both processes serve their endpoints from, with the liveness probe (stdlib only).

``HttpServer`` serves, from a daemon thread (``http.server``), ``/healthz`` (200 while every registered loop
beats, 503 naming the stalled loop: ``check_liveness``), ``/`` (the paths it serves) and whatever its subclass
answers in ``route``: the mapper's ``MetricsServer`` (``mapper.edge.status.metrics``: ``/metrics``, ``/readyz``,
``/status``) and the bridge's ``BridgeMetricsServer`` (``mapper.bridge.metrics``: ``/metrics``, ``/readyz``).

Every request is bounded: the socket has a timeout, and the callables a route reads the process's state through
are run by ``call``: on the process's event loop (when one is given, so that they read its state from its own
thread) or on a worker thread, and waited for at most ``call_timeout_s``; one that does not answer in time
gives 503, never a hung scrape (and a blocked event loop fails ``/healthz``). The accept loop sleeps on the
socket and a wake pipe: an idle server costs no wake-ups between scrapes. TLS, client certificates and basic
auth come from an exporter-toolkit web config file (``mapper.net.webconfig``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self, TypeVar
from urllib.parse import parse_qs, urlsplit

from mapper.clock import format_duration_s
from mapper.errors import ConfigError, TransientError
from mapper.net.webconfig import WebAuth, WebConfig, client_allowed

log = logging.getLogger(__name__)

#: One answer: (HTTP status, content type, body).
Answer = tuple[int, str, bytes]

TEXT = "text/plain; charset=utf-8"
#: The accept loop's longest wait (s): it wakes for a connection or for ``stop``, and at least this often.
_IDLE_WAIT_S = 60.0

_R = TypeVar("_R")


# --------------------------------------------------------------------------------------------------
# Liveness (a pure rule)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoopHeartbeat:
    """A long-lived loop's last sign of life: ``last_beat_s`` on the monotonic clock, expected every
    ``period_s`` seconds."""

    name: str
    last_beat_s: float
    period_s: float


@dataclass(frozen=True)
class Liveness:
    ok: bool
    #: Human-readable lines, one per loop: ``collect: last beat 0.4 s ago (period 1 s)``.
    lines: tuple[str, ...] = ()
    #: Names of the stalled loops.
    stalled: tuple[str, ...] = ()


def check_liveness(
    beats: Iterable[LoopHeartbeat],
    now_s: float,
    *,
    stall_periods: float = 5.0,
    min_stall_s: float = 10.0,
) -> Liveness:
    """A loop is stalled when its last beat is older than ``max(stall_periods * period_s, min_stall_s)``.

    No loops at all is alive (the process answered); a process registers its loops as it starts them.
    """
    lines: list[str] = []
    stalled: list[str] = []
    for b in sorted(beats, key=lambda b: b.name):
        age = now_s - b.last_beat_s
        limit = max(stall_periods * b.period_s, min_stall_s)
        line = (
            f"{b.name}: last beat {age:.1f} s ago (period {format_duration_s(b.period_s)}, "
            f"stalled after {format_duration_s(limit)})"
        )
        if age > limit:
            stalled.append(b.name)
            line = "STALLED " + line
        lines.append(line)
    return Liveness(ok=not stalled, lines=tuple(lines), stalled=tuple(stalled))


# --------------------------------------------------------------------------------------------------
# Address parsing
# --------------------------------------------------------------------------------------------------


def parse_metrics_addr(addr: str) -> tuple[str, int]:
    """``HOST:PORT`` -> (host, port). ``:9100`` binds every interface; ``[::1]:9100`` is IPv6; port 0 lets
    the OS choose (tests). Raises ``ConfigError`` naming the bad part."""
    text = addr.strip()
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ConfigError(f"metrics addr {addr!r}: expected [IPV6]:PORT")
        port_text = rest[1:]
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise ConfigError(f"metrics addr {addr!r}: expected HOST:PORT (e.g. 0.0.0.0:9100 or :9100)")
        if ":" in host:
            raise ConfigError(f"metrics addr {addr!r}: write an IPv6 host in brackets, e.g. [::1]:9100")
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ConfigError(f"metrics addr {addr!r}: port {port_text!r} is not a number from 0 to 65535")
    return (host or "0.0.0.0", int(port_text))


# --------------------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------------------


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    #: ``handle_request`` waits at most this long for the connection it was woken for.
    timeout = 1.0
    owner: HttpServer

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that fails the TLS handshake or hangs up mid-request: not the process's error (the default
        # prints a traceback to stderr).
        log.debug("http %s: connection failed", client_address[0] if client_address else "?", exc_info=True)


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    web_config: WebConfig | None = None
    protocol_version = "HTTP/1.1"
    server_version = "gpu-mapper"

    def setup(self) -> None:
        # Every read and write on the connection is bounded (a stuck client cannot hold a thread forever).
        self.request.settimeout(self.server.owner.request_timeout_s)
        web = self.server.owner.web
        self.web_config = web.config if web is not None else None
        if self.web_config is not None and self.web_config.context is not None:
            # The handshake runs here, on this connection's thread (bounded by the timeout above), not on the
            # accept loop.
            self.request = self.web_config.context.wrap_socket(self.request, server_side=True)
            if not client_allowed(self.web_config, self.request.getpeercert()):
                log.info("http %s: client certificate not in client_allowed_sans; closed", self.client_address[0])
                self.request.close()
                raise ConnectionAbortedError("client certificate not allowed")
        super().setup()

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            # The server closes the plain socket it accepted, which the TLS one has taken over (detached).
            if isinstance(self.request, ssl.SSLSocket):
                self.request.close()

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("http %s " + format, self.client_address[0], *args)

    def do_GET(self) -> None:
        owner = self.server.owner
        url = urlsplit(self.path)
        web = self.web_config
        if (
            web is not None
            and owner.web is not None
            and not owner.web.authorized(web, self.headers.get("Authorization"))
        ):
            body = b"unauthorized\n"
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Basic realm="gpu-mapper"')
            self.send_header("Content-Type", TEXT)
            self.send_header("Content-Length", str(len(body)))
            self._extra_headers()
            self.end_headers()
            self.wfile.write(body)
            return
        try:
            status, ctype, body = owner.handle(url.path, parse_qs(url.query))
        except Exception:
            log.exception("http %s failed", url.path)
            status, ctype, body = 500, TEXT, b"internal error\n"
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self._extra_headers()
        self.end_headers()
        self.wfile.write(body)

    def _extra_headers(self) -> None:
        if self.web_config is not None:
            for name, value in self.web_config.headers.items():
                self.send_header(name, value)


class HttpServer:
    """``/healthz``, ``/`` and the paths of ``route`` on ``addr`` (``HOST:PORT``), in a daemon thread.

    ``heartbeats`` lists the process's loops' last beats (monotonic seconds, compared with ``monotonic()``).
    With ``loop`` given, the callables run by ``call`` run on that asyncio loop (an event loop that does not
    answer within ``call_timeout_s`` fails ``/healthz``). A subclass answers its own paths in ``route`` and
    names them, with itself, in ``name`` and ``paths`` (what ``/`` answers and the start-up log line says).
    """

    #: Who serves: the head of ``/``'s answer.
    name = "gpu-mapper"
    #: The paths served, ``/healthz`` among them.
    paths: tuple[str, ...] = ("/healthz",)
    #: What ``call`` says did not answer when it runs its callables on a worker thread (no event loop).
    callable_name = "the callable"

    def __init__(
        self,
        addr: str,
        *,
        heartbeats: Callable[[], Iterable[LoopHeartbeat]] = lambda: (),
        loop: asyncio.AbstractEventLoop | None = None,
        monotonic: Callable[[], float] | None = None,
        request_timeout_s: float = 10.0,
        call_timeout_s: float = 5.0,
        stall_periods: float = 5.0,
        min_stall_s: float = 10.0,
        web_config_file: str | None = None,
    ) -> None:
        self.host, self._port = parse_metrics_addr(addr)
        #: TLS and basic auth from an exporter-toolkit web config file (``mapper.net.webconfig``); None: plain HTTP.
        self.web = WebAuth(web_config_file) if web_config_file else None
        self._heartbeats = heartbeats
        self._loop = loop
        self._monotonic = monotonic or _monotonic
        self.request_timeout_s = request_timeout_s
        self.call_timeout_s = call_timeout_s
        self.stall_periods = stall_periods
        self.min_stall_s = min_stall_s
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="metrics-call")
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None

    # --- lifecycle ---

    def start(self) -> None:
        if self._httpd is not None:
            return
        cls = _Server6 if ":" in self.host else _Server
        try:
            httpd = cls((self.host, self._port), _Handler, bind_and_activate=False)
            httpd.owner = self
            httpd.allow_reuse_address = True
            httpd.server_bind()
            httpd.server_activate()
        except OSError as exc:
            raise ConfigError(f"metrics addr {self.host}:{self._port}: cannot listen ({exc.strerror or exc})") from None
        self._httpd = httpd
        self._port = httpd.server_address[1]
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread = threading.Thread(
            target=self._serve, args=(httpd, self._wake_r), name="metrics-http", daemon=True
        )
        self._thread.start()
        web = self.web.config if self.web is not None else None
        log.info(
            "metrics: serving %s on %s%s",
            " ".join(self.paths),
            self.url,
            ""
            if web is None
            else f" (web config {self.web.path if self.web else ''}: "
            f"{len(web.users)} basic-auth user(s), client certificates "
            f"{web.tls.client_auth_type if web.tls else 'n/a'})",
        )

    def _serve(self, httpd: _Server, wake: socket.socket) -> None:
        """Accept connections until ``stop`` writes to ``wake``. Unlike ``serve_forever`` it does not poll: an
        idle server costs no wake-ups between scrapes (one a minute, the bound on the wait)."""
        with selectors.DefaultSelector() as selector:
            selector.register(httpd, selectors.EVENT_READ)
            selector.register(wake, selectors.EVENT_READ)
            while True:
                ready = selector.select(timeout=_IDLE_WAIT_S)
                if any(key.fileobj is wake for key, _ in ready):
                    return
                if ready:
                    httpd.handle_request()  # readable: accepts at once (httpd.timeout bounds a vanished client)

    def stop(self, timeout_s: float = 5.0) -> None:
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread is not None:
            self._thread.join(timeout_s)
        httpd.server_close()
        self._wake_r.close()
        self._wake_w.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        """The bound port (the OS's choice when started with port 0)."""
        return self._port

    @property
    def url(self) -> str:
        host = self.host
        if host in ("0.0.0.0", ""):
            host = "127.0.0.1"
        elif host == "::":
            host = "::1"
        if ":" in host:
            host = f"[{host}]"
        tls = self.web is not None and self.web.config.tls is not None
        return f"{'https' if tls else 'http'}://{host}:{self._port}"

    # --- requests (run on the server's threads) ---

    def call(self, fn: Callable[[], _R]) -> _R:
        """Run ``fn`` on the process's event loop (or a worker thread) and wait at most ``call_timeout_s``;
        ``TransientError`` when it does not answer in time or the loop is closed."""
        fut: concurrent.futures.Future[_R]
        if self._loop is not None:
            fut = concurrent.futures.Future()

            def run() -> None:
                if not fut.set_running_or_notify_cancel():
                    return
                try:
                    fut.set_result(fn())
                except BaseException as exc:
                    fut.set_exception(exc)

            try:
                self._loop.call_soon_threadsafe(run)
            except RuntimeError as exc:  # loop closed
                raise TransientError(f"the event loop is not running ({exc})") from None
        else:
            fut = self._pool.submit(fn)
        try:
            return fut.result(timeout=self.call_timeout_s)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            where = "the event loop" if self._loop is not None else self.callable_name
            raise TransientError(f"{where} did not answer within {self.call_timeout_s:g} s") from None

    def handle(self, path: str, query: dict[str, list[str]]) -> Answer:
        """Answer one GET: ``/healthz``, a path of ``route``, ``/``, else 404."""
        if path == "/healthz":
            return self._healthz()
        answer = self.route(path, query)
        if answer is not None:
            return answer
        if path == "/":
            return 200, TEXT, f"{self.name}: {' '.join(self.paths)}\n".encode()
        return int(HTTPStatus.NOT_FOUND), TEXT, f"not found: {path}\n".encode()

    def route(self, path: str, query: dict[str, list[str]]) -> Answer | None:
        """The subclass's answer to ``path`` (``query``: its parameters), or None for a path it does not serve."""
        return None

    def _healthz(self) -> Answer:
        try:
            beats = list(self.call(self._heartbeats))
        except TransientError as exc:
            return 503, TEXT, f"unhealthy: {exc}\n".encode()
        live = check_liveness(beats, self._monotonic(), stall_periods=self.stall_periods, min_stall_s=self.min_stall_s)
        head = "ok" if live.ok else "unhealthy: stalled loop(s): " + ", ".join(live.stalled)
        body = "\n".join((head, *live.lines)) + "\n"
        return (200 if live.ok else 503), TEXT, body.encode()


def _monotonic() -> float:
    return time.monotonic()
