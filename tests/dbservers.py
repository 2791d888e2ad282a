"""Real database servers for the push writers' tests (Debian packages; scripts/bootstrap.sh --test installs them):
redis-server, MariaDB (mariadbd), VictoriaMetrics (it takes InfluxDB's ``/api/v2/write``). Each runs on a free
loopback port in its own directory, is stopped by its PID and can be started again on the same port with what it
had stored. Beside them, two small stand-ins for what the servers cannot show or do: ``RecordingProxy`` (an HTTP
proxy in front of VictoriaMetrics that records each request, can answer with a status of its own, and checks the
token as InfluxDB would: VictoriaMetrics ignores it) and ``CuttingProxy`` (a TCP proxy that cuts a connection at a
chosen point: after the server has done a command whose answer then never reaches the client)."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pymysql

from tests.brokers import free_port


def binary(name: str, package: str) -> str:
    found = shutil.which(name) or next(
        (str(p) for p in (Path("/usr/sbin") / name, Path("/usr/bin") / name) if p.exists()), None
    )
    if found is None:
        raise RuntimeError(f"{name} is not installed: scripts/bootstrap.sh --test installs it (Debian {package})")
    return found


class _Process:
    """A server process: started with its log in a file, stopped by PID (SIGTERM, then SIGKILL)."""

    name = "server"

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = workdir / f"{self.name}-{self.port}.log"

    def command(self) -> list[str]:
        raise NotImplementedError

    def ready(self) -> bool:
        raise NotImplementedError

    def start(self, timeout_s: float = 30.0) -> None:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited: {self.log_path.read_text(errors='replace')[-3000:]}")
                with contextlib.suppress(OSError, pymysql.err.MySQLError, urllib.error.URLError):
                    if self.ready():
                        return
                time.sleep(0.05)
            raise RuntimeError(f"{self.name} not ready within {timeout_s}s: {self.log_path.read_text()[-3000:]}")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None


class RedisServer(_Process):
    """redis-server with a password and an append-only file (what was written survives a stop and start)."""

    name = "redis"

    def __init__(self, workdir: Path, password: str | None = "redis-pw") -> None:
        super().__init__(workdir)
        self.password = password
        self.dir = workdir / f"redis-{self.port}"
        self.dir.mkdir()

    def command(self) -> list[str]:
        cmd = [binary("redis-server", "redis-server"), "--port", str(self.port), "--bind", "127.0.0.1"]
        cmd += ["--dir", str(self.dir), "--save", "", "--appendonly", "yes"]
        if self.password:
            cmd += ["--requirepass", self.password]
        return cmd

    def ready(self) -> bool:
        with contextlib.suppress(subprocess.CalledProcessError):
            return self.cli("PING") == "PONG"
        return False

    def cli(self, *args: str, db: int = 0) -> str:
        """``redis-cli --raw`` (the real client, not ours), its output without the last line break."""
        cmd = [binary("redis-cli", "redis-tools"), "-p", str(self.port), "-n", str(db), "--raw"]
        if self.password:
            cmd += ["-a", self.password, "--no-auth-warning"]
        out = subprocess.run([*cmd, *args], capture_output=True, timeout=10, check=True, text=True)
        return out.stdout.removesuffix("\n")

    def zrange(self, key: str, db: int = 0) -> list[tuple[str, int]]:
        """A sorted set's (member, score) pairs in order."""
        lines = self.cli("ZRANGE", key, "0", "-1", "WITHSCORES", db=db).split("\n")
        if lines == [""]:
            return []
        return [(lines[i], int(lines[i + 1])) for i in range(0, len(lines), 2)]


class MariaDb(_Process):
    """mariadbd over its own data directory (made once by mariadb-install-db); root without a password over
    127.0.0.1 for the test's own reads and set-up."""

    name = "mariadb"

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        # The socket's path must stay under 108 bytes: a short directory of its own.
        self.short = Path(tempfile.mkdtemp(prefix="mdb-", dir="/tmp"))
        self.datadir = workdir / f"mariadb-{self.port}"
        subprocess.run(
            [
                binary("mariadb-install-db", "mariadb-server"),
                "--no-defaults",
                f"--datadir={self.datadir}",
                "--user=root",
                "--auth-root-authentication-method=normal",
                "--skip-test-db",
                "--innodb-log-file-size=8M",
                f"--tmpdir={self.short}",
            ],
            capture_output=True,
            timeout=120,
            check=True,
        )

    def command(self) -> list[str]:
        return [
            binary("mariadbd", "mariadb-server"),
            "--no-defaults",
            f"--datadir={self.datadir}",
            "--user=root",
            f"--port={self.port}",
            "--bind-address=127.0.0.1",
            f"--socket={self.short}/s",
            f"--pid-file={self.short}/pid",
            "--skip-log-bin",
            "--innodb-buffer-pool-size=16M",
            "--innodb-log-file-size=8M",
            f"--tmpdir={self.short}",
        ]

    def ready(self) -> bool:
        self.sql("SELECT 1")
        return True

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.short, ignore_errors=True)

    def sql(self, statement: str, args: Any = None, *, database: str | None = None) -> list[tuple[Any, ...]]:
        """One statement as root (UTC session time zone), committed; its rows."""
        conn = pymysql.connect(
            host="127.0.0.1", port=self.port, user="root", password="", database=database, connect_timeout=5,
            read_timeout=30, write_timeout=30, init_command="SET time_zone = '+00:00'", autocommit=True,
        )  # fmt: skip
        try:
            with conn.cursor() as cursor:
                cursor.execute(statement, args)
                return list(cursor.fetchall())
        finally:
            conn.close()

    def make_database(self, database: str, user: str, password: str) -> None:
        self.sql(f"CREATE DATABASE `{database}`")
        for host in ("%", "localhost"):
            self.sql("CREATE USER IF NOT EXISTS %s@%s IDENTIFIED BY %s", (user, host, password))
            self.sql(f"GRANT ALL ON `{database}`.* TO %s@%s", (user, host))


class VictoriaMetrics(_Process):
    """victoria-metrics: InfluxDB line protocol in on ``/api/v2/write``, raw samples out on ``/api/v1/export``."""

    name = "victoria-metrics"

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)
        self.data = workdir / f"vm-{self.port}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [
            binary("victoria-metrics", "victoria-metrics"),
            f"-httpListenAddr=127.0.0.1:{self.port}",
            f"-storageDataPath={self.data}",
            "-retentionPeriod=100y",
            "-search.latencyOffset=0s",
            "-search.disableCache",
            "-loggerLevel=ERROR",
        ]

    def ready(self) -> bool:
        with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
            return bool(resp.read().strip() == b"OK")

    def export(self, selector: str) -> list[dict[str, Any]]:
        """The raw samples of the series matching ``selector``: each ``{"metric", "values", "timestamps"}``."""
        with urllib.request.urlopen(self.url + "/internal/force_flush", timeout=10):
            pass
        query = urllib.parse.urlencode({"match[]": selector, "start": "0", "end": str(int(time.time()) + 86400)})
        with urllib.request.urlopen(f"{self.url}/api/v1/export?{query}", timeout=10) as resp:
            return [json.loads(line) for line in resp.read().decode().splitlines() if line.strip()]

    def wait_samples(self, selector: str, count: int, timeout_s: float = 30.0) -> list[dict[str, Any]]:
        """``export(selector)`` once it holds at least ``count`` samples in all (VictoriaMetrics shows a write a
        moment later); what it holds at ``timeout_s`` otherwise."""
        deadline = time.monotonic() + timeout_s
        while True:
            series = self.export(selector)
            if sum(len(s["values"]) for s in series) >= count or time.monotonic() > deadline:
                return series
            time.sleep(0.1)


@dataclass
class Recorded:
    path: str
    headers: dict[str, str]
    body: bytes
    status: int


@dataclass
class RecordingProxy:
    """An HTTP proxy in front of ``upstream``: each POST recorded (path, headers, body, the status answered) in
    arrival order, then forwarded, unless ``token`` is set and the request does not carry it (401 as InfluxDB
    answers) or ``answers`` holds a status to give instead (``(status, headers, body)``, taken in order; an
    answer of None forwards)."""

    upstream: str
    token: str | None = None
    answers: list[tuple[int, dict[str, str], bytes] | None] = field(default_factory=list)
    requests: list[Recorded] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None
    #: Serve https with this context (the server's certificate in it) instead of http.
    tls: ssl.SSLContext | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        scheme = "https" if self.tls else "http"
        return f"{scheme}://localhost:{self.server.server_address[1]}"

    def start(self) -> None:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                status, headers, answer = proxy.answer(self.path, dict(self.headers.items()), body)
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if self.tls is not None:
            self.server.socket = self.tls.wrap_socket(self.server.socket, server_side=True)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, path: str, headers: dict[str, str], body: bytes) -> tuple[int, dict[str, str], bytes]:
        planned = self.answers.pop(0) if self.answers else None
        if self.token is not None and headers.get("Authorization") != f"Token {self.token}":
            refusal = b'{"code":"unauthorized","message":"unauthorized access"}'
            planned = (401, {"Content-Type": "application/json"}, refusal)
        if planned is None:
            request = urllib.request.Request(self.upstream + path, data=body, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=10) as resp:
                    planned = (resp.status, {}, resp.read())
            except urllib.error.HTTPError as exc:
                planned = (exc.code, {}, exc.read())
            except OSError:
                planned = (502, {}, b"upstream unreachable")
        self.requests.append(Recorded(path, headers, body, planned[0]))
        return planned

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


class CuttingProxy:
    """A TCP proxy to ``127.0.0.1:upstream_port``. Once armed with ``cut_after(marker)``: the next client chunk
    holding ``marker`` is forwarded, the server's answer to it is read but kept from the client, and then both
    sides of that connection are closed, so the server has done the command and the client never hears so.
    ``cut_before(marker)``: that chunk is not forwarded at all and the connection closed."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._marker: bytes | None = None
        self._forward_marker = True
        self.cuts = 0
        self._lock = threading.Lock()
        self._closing = False
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def cut_after(self, marker: bytes) -> None:
        with self._lock:
            self._marker, self._forward_marker = marker, True

    def cut_before(self, marker: bytes) -> None:
        with self._lock:
            self._marker, self._forward_marker = marker, False

    def _take(self, chunk: bytes) -> bool | None:
        """None: no cut; True: forward this chunk, then cut; False: cut without it."""
        with self._lock:
            if self._marker is None or self._marker not in chunk:
                return None
            self._marker = None
            self.cuts += 1
            return self._forward_marker

    def _accept(self) -> None:
        while not self._closing:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            self._sockets += [client, server]
            answered = threading.Event()
            holding = threading.Event()
            threading.Thread(target=self._to_server, args=(client, server, holding, answered), daemon=True).start()
            threading.Thread(target=self._to_client, args=(server, client, holding, answered), daemon=True).start()

    def _to_server(
        self, client: socket.socket, server: socket.socket, holding: threading.Event, answered: threading.Event
    ) -> None:
        try:
            while chunk := client.recv(65536):
                cut = self._take(chunk)
                if cut is False:
                    break
                if cut:
                    holding.set()
                    server.sendall(chunk)
                    answered.wait(10)
                    break
                server.sendall(chunk)
        except OSError:
            pass
        for sock in (client, server):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _to_client(
        self, server: socket.socket, client: socket.socket, holding: threading.Event, answered: threading.Event
    ) -> None:
        try:
            while chunk := server.recv(65536):
                if holding.is_set():
                    answered.set()
                    return
                client.sendall(chunk)
        except OSError:
            pass
        answered.set()

    def close(self) -> None:
        self._closing = True
        self.listener.close()
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.close()
