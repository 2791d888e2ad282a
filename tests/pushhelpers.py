"""Receivers for the push tests: an HTTP receiver of the framework's form posts and an OTLP/HTTP metrics receiver
that decodes with the official ``opentelemetry-proto`` messages. Each runs on a loopback port of its own in threads
of its own, records what arrives BEFORE answering (so arrival order is the sender's order), can answer a chosen
status for a while, and stops and starts again on the same port (an outage)."""

from __future__ import annotations

import gzip
import http.server
import itertools
import socket
import ssl
import threading
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)

from tests.brokers import free_port


@dataclass(frozen=True)
class Post:
    path: str
    headers: dict[str, str]
    body: bytes
    #: The body as a form (``parse_qsl``), for the http receiver.
    form: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Point:
    """One OTLP data point with what names it."""

    resource: dict[str, str]
    scope: str
    metric: str
    unit: str
    kind: str  # gauge | sum
    monotonic: bool
    time_ms: int
    value: float


class Receiver:
    """A ThreadingHTTPServer (HTTP/1.1, keep-alive) on ``port``; ``answer`` (status, extra headers, body) is what a
    POST gets; ``stop`` closes it and every open connection (the destination is down), ``start`` brings it back."""

    def __init__(self, port: int | None = None, tls: ssl.SSLContext | None = None) -> None:
        """``tls``: serve https with this server context (its certificate in it)."""
        self.port = port or free_port()
        self.tls = tls
        self.lock = threading.Lock()
        self.status = 200
        self.extra_headers: dict[str, str] = {}
        self.delay_s = 0.0
        self.answers: list[int] = []
        self._server: http.server.ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._connections: set[socket.socket] = set()

    def record(self, path: str, headers: dict[str, str], body: bytes) -> None:
        raise NotImplementedError

    def reply_body(self) -> tuple[bytes, str]:
        return b"", "text/plain"

    def start(self) -> None:
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def setup(self) -> None:
                super().setup()
                with owner.lock:
                    owner._connections.add(self.connection)

            def finish(self) -> None:
                with owner.lock:
                    owner._connections.discard(self.connection)
                super().finish()

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                headers = {k.lower(): v for k, v in self.headers.items()}
                with owner.lock:
                    status, extra, delay = owner.status, dict(owner.extra_headers), owner.delay_s
                    if status == 200:
                        owner.record(self.path, headers, body)
                    owner.answers.append(status)
                if delay:
                    threading.Event().wait(delay)
                text, ctype = owner.reply_body() if status == 200 else (b"refused by the test\n", "text/plain")
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(text)))
                for k, v in extra.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(text)

        server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        server.daemon_threads = True
        if self.tls is not None:
            server.socket = self.tls.wrap_socket(server.socket, server_side=True)
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        with self.lock:
            conns = list(self._connections)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(10)

    def __enter__(self) -> Receiver:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class HttpReceiver(Receiver):
    """Records each form POST (``posts``)."""

    def __init__(self, port: int | None = None, tls: ssl.SSLContext | None = None) -> None:
        super().__init__(port, tls)
        self.posts: list[Post] = []

    def url(self, path: str = "") -> tuple[str, int, str]:
        """(hostName, port, requestPath) of this receiver as a Device names it."""
        return ("https://localhost" if self.tls else "http://127.0.0.1"), self.port, path

    def record(self, path: str, headers: dict[str, str], body: bytes) -> None:
        form = dict(urllib.parse.parse_qsl(body.decode("utf-8")))
        self.posts.append(Post(path, headers, body, form))

    def snapshot(self) -> list[Post]:
        with self.lock:
            return list(self.posts)


class OtlpReceiver(Receiver):
    """Decodes each ``ExportMetricsServiceRequest`` into ``points``, answers an empty response."""

    def __init__(self, port: int | None = None, tls: ssl.SSLContext | None = None) -> None:
        super().__init__(port, tls)
        self.points: list[Point] = []
        self.requests = 0
        self.content_types: list[str] = []

    @property
    def endpoint(self) -> str:
        origin = "https://localhost" if self.tls else "http://127.0.0.1"
        return f"{origin}:{self.port}/v1/metrics"

    def record(self, path: str, headers: dict[str, str], body: bytes) -> None:
        assert path == "/v1/metrics", path
        self.content_types.append(headers.get("content-type", ""))
        request = ExportMetricsServiceRequest()
        request.ParseFromString(body)
        self.requests += 1
        for rm in request.resource_metrics:
            resource = {a.key: a.value.string_value for a in rm.resource.attributes}
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    kind = m.WhichOneof("data")
                    points = m.gauge.data_points if kind == "gauge" else m.sum.data_points
                    for p in points:
                        self.points.append(
                            Point(
                                resource,
                                sm.scope.name,
                                m.name,
                                m.unit,
                                str(kind),
                                bool(m.sum.is_monotonic) if kind == "sum" else False,
                                p.time_unix_nano // 1_000_000,
                                p.as_double,
                            )
                        )

    def reply_body(self) -> tuple[bytes, str]:
        return ExportMetricsServiceResponse().SerializeToString(), "application/x-protobuf"

    def snapshot(self) -> list[Point]:
        with self.lock:
            return list(self.points)


def gaps_ms(times: list[int]) -> list[int]:
    return [b - a for a, b in itertools.pairwise(times)]
