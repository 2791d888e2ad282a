"""The lifecycle harness's world: real processes, each with a deadline on every wait.

* the mapper: ``gpu-mapper run --sim N`` (``tests.lifecycle.child``: the production CLI and ``--sim`` path, with a
  control channel to the simulator) on a data dir that is a size-limited tmpfs of its own;
* a real mosquitto that keeps its sessions across a clean restart (``tests.faults.rig.PersistentBroker``);
* the test EdgeCore over real DMI sockets (``tests.fake_edgecore``), or a devices folder;
* one or two ``gpu-mapper bridge`` processes in one group, writing to a real Prometheus (shared by every sequence:
  each sequence has its own node name);
* the sniffer: a persistent-session QoS 1 subscriber of every telemetry batch and every EventBus twin update,
  the harness's record of what the mapper published.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho

from mapper.wire.telemetry import decode_batch

ROOT = Path(os.path.abspath(__file__)).parent.parent.parent
PY = sys.executable


def wait(predicate: Callable[[], Any], timeout_s: float, every_s: float = 0.05) -> Any:
    """The predicate's first truthy value, or None once ``timeout_s`` passed (the caller says what that means)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            return None
        time.sleep(every_s)


def http_get(url: str, timeout_s: float = 2.0) -> tuple[int, bytes] | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, exc.read()
        except (OSError, http.client.HTTPException):
            return exc.code, b""
    except (OSError, ValueError, http.client.HTTPException):
        return None


def parse_metrics(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text format -> {(name, sorted labels): value}."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, brace, rest = head.partition("{")
        labels: list[tuple[str, str]] = []
        if brace:
            body = rest.rsplit("}", 1)[0]
            i = 0
            while i < len(body):
                eq = body.index("=", i)
                key = body[i:eq].strip().lstrip(",").strip()
                j = eq + 2  # past ="
                val = []
                while body[j] != '"':
                    if body[j] == "\\":
                        j += 1
                        val.append({"n": "\n"}.get(body[j], body[j]))
                    else:
                        val.append(body[j])
                    j += 1
                labels.append((key, "".join(val)))
                i = j + 1
        try:
            out[(name, tuple(sorted(labels)))] = float(value)
        except ValueError:
            continue
    return out


# --- the tmpfs data dir ------------------------------------------------------------------------------------------


class TmpfsDir:
    """A size-limited tmpfs mounted at ``path`` (the harness runs as root); ``fill()`` takes every free byte,
    ``free()`` gives them back; ``close()`` unmounts (always called: the world's ``close`` is in a finally)."""

    def __init__(self, path: Path, size_kib: int) -> None:
        self.path = path
        self.size_kib = size_kib
        self.mounted = False
        self.filler = path / ".lifecycle-filler"

    def mount(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={self.size_kib}k,mode=0700", "tmpfs", str(self.path)],
            check=True,
            capture_output=True,
            timeout=30,
        )
        self.mounted = True

    def fill(self) -> int:
        """Write until the file system is full; the bytes written."""
        n = 0
        chunk = b"\0" * 65536
        with open(self.filler, "ab", buffering=0) as f:
            for size in (65536, 4096, 512, 1):
                while True:
                    try:
                        written = f.write(chunk[:size])
                    except OSError:
                        break
                    n += written or 0
                    if not written:
                        break
        return n

    def free(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.filler.unlink()

    @property
    def full(self) -> bool:
        return self.filler.exists()

    def close(self) -> None:
        if not self.mounted:
            return
        for _ in range(50):
            done = subprocess.run(["umount", str(self.path)], capture_output=True, timeout=30)
            if done.returncode == 0:
                self.mounted = False
                return
            time.sleep(0.1)
        subprocess.run(["umount", "-l", str(self.path)], capture_output=True, timeout=30)
        self.mounted = False


# --- the mapper ----------------------------------------------------------------------------------------------------


class MapperProc:
    """``gpu-mapper run`` (``tests.lifecycle.child``); stderr appended to ``log_path``."""

    def __init__(self, args: list[str], state_file: Path, log_path: Path, metrics_port: int) -> None:
        self.port = metrics_port
        self.log_path = log_path
        self._log = log_path.open("ab")
        self._log.write(f"\n===== start {time.strftime('%H:%M:%S')} {' '.join(args)}\n".encode())
        self._log.flush()
        self._log_offset = log_path.stat().st_size
        argv = [PY, "-m", "tests.lifecycle.child", str(state_file), "--", *args]
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)},
        )
        self._lines: queue.Queue[str] = queue.Queue()
        self._control_lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()
        #: Set when the harness stopped it (a signal it sent); an exit without it is the mapper's own.
        self.stopped_by_harness = False

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            text = line.decode(errors="replace")
            if text.startswith("{") or text.startswith("["):
                self._lines.put(text)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        """This process's part of the log."""
        try:
            with self.log_path.open("rb") as f:
                f.seek(self._log_offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def control(self, timeout_s: float = 10.0, **cmd: Any) -> Any:
        with self._control_lock:
            if not self.alive or self.proc.stdin is None:
                return None
            try:
                self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
                self.proc.stdin.flush()
            except OSError:
                return None
            try:
                return json.loads(self._lines.get(timeout=timeout_s))
            except queue.Empty:
                return None

    def status(self, timeout_s: float = 3.0) -> dict[str, Any] | None:
        got = http_get(f"http://127.0.0.1:{self.port}/status", timeout_s)
        if got is None or got[0] != 200:
            return None
        try:
            doc: dict[str, Any] = json.loads(got[1])
        except ValueError:
            return None
        return doc

    def metrics(self, timeout_s: float = 3.0) -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
        got = http_get(f"http://127.0.0.1:{self.port}/metrics", timeout_s)
        if got is None or got[0] != 200:
            return None
        return parse_metrics(got[1].decode(errors="replace"))

    def wait_ready(self, timeout_s: float = 60.0, gpus: int = 1) -> bool:
        """Until ``/status`` lists at least ``gpus`` GPUs (0: until it answers: every GPU lost), or the process
        exited; True when it runs."""

        def ready() -> bool:
            if not self.alive:
                return True
            st = self.status()
            return st is not None and len(st.get("gpus") or []) >= gpus

        return bool(wait(ready, timeout_s, 0.05)) and self.alive

    def terminate(self, timeout_s: float = 30.0) -> int | None:
        self.stopped_by_harness = True
        if self.alive:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            code = None
        self._close()
        return code

    def kill(self) -> None:
        self.stopped_by_harness = True
        if self.alive:
            self.proc.kill()
        self.proc.wait(10)
        self._close()

    def _close(self) -> None:
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        with contextlib.suppress(OSError):
            if self.proc.stdout is not None:
                self.proc.stdout.close()
        self._log.close()


# --- the bridge ------------------------------------------------------------------------------------------------------


class BridgeProc:
    def __init__(self, args: list[str], log_path: Path, port: int) -> None:
        self.port = port
        self.log_path = log_path
        log = log_path.open("ab")
        log.write(f"\n===== start {time.strftime('%H:%M:%S')}\n".encode())
        log.flush()
        self.proc = subprocess.Popen([PY, "-m", "mapper.cli", "bridge", *args], stdout=log, stderr=log, cwd=ROOT)
        log.close()
        self.stopped_by_harness = False

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
        got = http_get(f"http://127.0.0.1:{self.port}/metrics")
        if got is None or got[0] != 200:
            return None
        return parse_metrics(got[1].decode(errors="replace"))

    def ready(self) -> bool:
        got = http_get(f"http://127.0.0.1:{self.port}/readyz", 1.0)
        return got is not None and got[0] == 200

    def stop(self, how: str) -> int | None:
        self.stopped_by_harness = True
        if self.alive:
            self.proc.send_signal(signal.SIGTERM if how == "term" else signal.SIGKILL)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)


# --- the sniffer ------------------------------------------------------------------------------------------------------


@dataclass
class Part:
    """One batch (a part of a merged one) as published: its identity and its samples."""

    device: str
    boot_id: str
    seq: int
    samples: tuple[tuple[int, tuple[tuple[str, Any], ...]], ...]
    arrived_s: float


@dataclass
class Sniffed:
    parts: dict[tuple[str, str, int], Part] = field(default_factory=dict)
    #: (device, boot id, seq) published again with other samples: a stream's identity went backwards.
    conflicts: list[tuple[tuple[str, str, int], Part, Part]] = field(default_factory=list)
    messages: int = 0
    #: EventBus twin updates: device name -> property -> (value, arrival monotonic time).
    twins: dict[str, dict[str, tuple[str, float]]] = field(default_factory=dict)


class Sniffer:
    """Persistent-session QoS 1 subscriber of the node's telemetry and EventBus twin updates."""

    TELEMETRY = "gpu-mapper/{node}/+/+/telemetry"
    TWINS = "$hw/events/device/+/+/twin/update"

    def __init__(self, port: int, node: str, client_id: str) -> None:
        self.lock = threading.Lock()
        self.data = Sniffed()
        self.node = node
        self.client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=False)
        self.client.on_message = self._on
        self.client.reconnect_delay_set(0.05, 0.5)
        subacks: queue.Queue[int] = queue.Queue()
        self.client.on_subscribe = lambda c, u, mid, codes, props: subacks.put(mid)
        topics = [(self.TELEMETRY.format(node=node), 1), (self.TWINS, 1)]
        self.client.on_connect = lambda c, u, flags, rc, props: c.subscribe(topics)
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        subacks.get(timeout=10)

    def _on(self, client: Any, userdata: Any, message: Any) -> None:
        now = time.monotonic()
        topic: str = message.topic
        payload = bytes(message.payload)
        if topic.startswith("$hw/"):
            try:
                doc = json.loads(payload)
            except ValueError:
                return
            name = topic.split("/")[4]
            with self.lock:
                twins = self.data.twins.setdefault(name, {})
                for prop, body in (doc.get("twin") or {}).items():
                    value = ((body or {}).get("actual") or {}).get("value")
                    if value is not None:
                        twins[prop] = (str(value), now)
            return
        try:
            batch = decode_batch(payload)
        except Exception:  # a bad payload is itself a finding, kept as a conflict-free record of nothing
            return
        with self.lock:
            self.data.messages += 1
            for part in batch.split() if batch.merged else (batch,):
                samples = tuple((s.ts_ms, tuple(sorted((k, v) for k, v in s.values.items()))) for s in part.samples)
                key = (part.device, part.boot_id, part.seq)
                new = Part(part.device, part.boot_id, part.seq, samples, now)
                old = self.data.parts.get(key)
                if old is None:
                    self.data.parts[key] = new
                elif old.samples != samples and all(
                    c[2].samples != samples for c in self.data.conflicts if c[0] == key
                ):
                    self.data.conflicts.append((key, old, new))

    def snapshot(self) -> tuple[dict[tuple[str, str, int], Part], list[Any], int]:
        with self.lock:
            return dict(self.data.parts), list(self.data.conflicts), self.data.messages

    def twins(self) -> dict[str, dict[str, tuple[str, float]]]:
        with self.lock:
            return {k: dict(v) for k, v in self.data.twins.items()}

    def close(self) -> None:
        self.client.loop_stop()
        with contextlib.suppress(Exception):
            self.client.disconnect()


# --- the test EdgeCore on a loop of its own ---------------------------------------------------------------------


class EdgeCoreHost:
    """``FakeEdgeCore`` served from an asyncio loop in a thread; its calls to the mapper's DMI server are made from
    the harness's thread through ``call``."""

    def __init__(self, socket_path: str) -> None:
        from tests.fake_edgecore import FakeEdgeCore

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="edgecore", daemon=True)
        self.thread.start()
        self.edge = FakeEdgeCore(socket_path)
        self.run(self.edge.start())

    def run(self, coro: Any, timeout_s: float = 20.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def call(self, mapper_socket: str, method: str, request: Any, timeout_s: float = 10.0) -> tuple[bool, str]:
        """One DeviceMapperService call to the mapper: (ok, the error's code and text)."""
        import grpc

        async def go() -> tuple[bool, str]:
            async with self.edge.mapper(mapper_socket) as stub:
                try:
                    await getattr(stub, method)(request, timeout=timeout_s)
                except grpc.aio.AioRpcError as exc:
                    return False, f"{exc.code().name}: {exc.details()}"
            return True, ""

        return self.run(go(), timeout_s + 5)

    def latest_twins(self) -> dict[str, dict[str, tuple[str, str, float]]]:
        """device name -> property -> (reported, observedDesired, when) from the last ReportDeviceStatus calls."""
        out: dict[str, dict[str, tuple[str, str, float]]] = {}
        rec = self.edge.rec
        for req, at in zip(list(rec.statuses), list(rec.status_times), strict=False):
            twins = out.setdefault(req.deviceName, {})
            for t in req.reportedDevice.twins:
                twins[t.propertyName] = (t.reported.value, t.observedDesired.value, at)
        return out

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.run(self.edge.stop(), 10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        with contextlib.suppress(Exception):
            self.loop.close()


def short_socket_dir() -> str:
    return tempfile.mkdtemp(prefix="lc-", dir="/tmp")


def rmtree(path: Path | str) -> None:
    shutil.rmtree(path, ignore_errors=True)
