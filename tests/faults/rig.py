"""Real processes for the fault suite: the mapper as a subprocess (``tests.faults.child``: the production CLI
over a simulated NVML the test can fault), a real mosquitto that keeps its clients' sessions across a restart,
and a persistent-session MQTT consumer that counts every telemetry batch by (device, boot id, seq). Every wait
has a deadline."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho

from mapper.edge.gpu.simnvml import SimNvml
from mapper.wire.telemetry import decode_batch
from tests.brokers import Mosquitto, free_port

#: The folder that holds the ``tests`` package (the repository; the child imports ``tests.faults.child``).
ROOT = Path(os.path.abspath(__file__)).parent.parent.parent
SEED = 7
DEVICE = """apiVersion: devices.kubeedge.io/v1beta1
kind: Device
metadata: {{name: {name}, namespace: default}}
spec:
  deviceModelRef: {{name: nvidia-gpu}}
  nodeName: edge-1
  protocol: {{protocolName: gpu, configData: {{uuid: {uuid}}}}}
  properties:
  - {{name: temperature, collectCycle: 1000, reportCycle: 1000, reportToCloud: true}}
  - {{name: power_usage, collectCycle: 1000, reportCycle: 1000, reportToCloud: true}}
  - {{name: power_limit, {desired}collectCycle: 1000, reportCycle: 1000, reportToCloud: true}}
"""


def wait(predicate: Callable[[], Any], timeout_s: float, what: str, every_s: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(every_s)


def uuids(n: int) -> list[str]:
    return [g.uuid for g in SimNvml(n, "H100", seed=SEED).gpus]


def device_folder(path: Path, n: int, power_limit_w: int | None = None) -> Path:
    """A standalone devices folder binding gpu0..gpu{n-1} to the simulated GPUs (optionally a desired limit)."""
    path.mkdir(parents=True, exist_ok=True)
    desired = f'desired: {{value: "{power_limit_w}"}}, ' if power_limit_w is not None else ""
    for i, uuid in enumerate(uuids(n)):
        (path / f"gpu{i}.yaml").write_text(DEVICE.format(name=f"gpu{i}", uuid=uuid, desired=desired))
    return path


class MapperProcess:
    """``gpu-mapper run`` in a subprocess over ``n`` simulated GPUs; stdin carries fault commands."""

    def __init__(
        self,
        tmp: Path,
        n: int,
        *args: str,
        not_ready: bool = False,
        name: str = "mapper",
        config: str = "telemetry: {window: 1s}\n",
    ) -> None:
        self.tmp = tmp
        self.data_dir = tmp / "data"
        self.port = free_port()
        self.log_path = tmp / f"{name}-{time.monotonic_ns()}.log"
        config_path = tmp / f"{name}-config.yaml"
        config_path.write_text(config)  # batches cut every second: a trial of a few seconds has some to lose
        args = ("--config", str(config_path), *args)
        own = [str(n), str(SEED)] + (["--not-ready"] if not_ready else [])
        argv = [
            sys.executable, "-m", "tests.faults.child", *own, "--",
            "run", "--node-name", "edge-1", "--data-dir", str(self.data_dir),
            "--metrics-addr", f"127.0.0.1:{self.port}", *args,
        ]  # fmt: skip
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.started_at = time.monotonic()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.decode())

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def control(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()

    def gpu_state(self, timeout_s: float = 10.0) -> list[dict[str, Any]]:
        self.control(op="state")
        return json.loads(self._lines.get(timeout=timeout_s))

    def status(self, timeout_s: float = 2.0) -> dict[str, Any] | None:
        """The mapper's /status, or None while it does not answer."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/status", timeout=timeout_s) as r:
                return json.loads(r.read())
        except (OSError, ValueError):
            return None

    def wait_started(self, timeout_s: float = 60.0) -> None:
        wait(lambda: self.proc.poll() is not None or self.status() is not None, timeout_s, "the mapper's /status")
        assert self.proc.poll() is None, f"the mapper exited with {self.proc.returncode}: {self.log()[-3000:]}"

    def wait_log(self, text: str, timeout_s: float = 60.0) -> None:
        wait(lambda: text in self.log() or self.proc.poll() is not None, timeout_s, f"{text!r} in the mapper's log")
        assert text in self.log(), f"the mapper exited ({self.proc.returncode}) before {text!r}: {self.log()[-3000:]}"

    def terminate(self, timeout_s: float = 30.0) -> tuple[int, float]:
        """SIGTERM; the exit code and how long the exit took."""
        started = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout_s)
        self._close()
        return code, time.monotonic() - started

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
        self._close()

    def _close(self) -> None:
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        self._log.close()


class PersistentBroker(Mosquitto):
    """A mosquitto that saves its clients' sessions and queued messages when stopped with SIGTERM, so a
    persistent-session consumer misses nothing across the restart."""

    def config_text(self) -> str:
        store = self.workdir / "mosquitto-store"
        store.mkdir(exist_ok=True)
        return (
            # user root: started as root, mosquitto would otherwise drop to its own user, which cannot write
            # the store inside pytest's 0700 tmp_path (and every session would be lost on the restart).
            f"user root\nlistener {self.port} 127.0.0.1\nallow_anonymous true\npersistence true\n"
            f"persistence_location {store}/\nautosave_interval 0\nmax_inflight_messages 100\n"
            "max_queued_messages 1000000\nmax_queued_bytes 0\n"
        )

    def terminate(self) -> None:
        """A clean stop (the broker saves its sessions)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


class Consumer:
    """A persistent-session (clean_session=False), QoS 1 subscriber of every device's telemetry: the broker keeps
    what it could not deliver while this consumer was away, the way a cloud consumer runs."""

    def __init__(self, port: int, client_id: str = "fault-consumer") -> None:
        self.lock = threading.Lock()
        self.arrivals: dict[str, list[tuple[str, int]]] = {}  # device -> [(boot id, seq)] in arrival order
        self.messages = 0
        self.client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=False)
        self.client.on_message = self._on
        self.client.reconnect_delay_set(0.05, 0.5)
        subacks: queue.Queue[int] = queue.Queue()
        self.client.on_subscribe = lambda c, u, mid, codes, props: subacks.put(mid)
        # Subscribed again on every connect, as a real consumer does (the broker keeps the session, but a
        # consumer cannot know it kept it).
        self.client.on_connect = lambda c, u, flags, rc, props: c.subscribe(self.TOPIC, qos=1)
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        deadline = time.monotonic() + 10
        subacks.get(timeout=max(0.01, deadline - time.monotonic()))

    TOPIC = "gpu-mapper/+/+/+/telemetry"

    def _on(self, client: Any, userdata: Any, message: Any) -> None:
        batch = decode_batch(bytes(message.payload))
        with self.lock:
            self.messages += 1
            for part in batch.split() if batch.merged else (batch,):
                self.arrivals.setdefault(part.device, []).append((part.boot_id, part.seq))

    def seen(self) -> dict[str, set[tuple[str, int]]]:
        with self.lock:
            return {device: set(keys) for device, keys in self.arrivals.items()}

    def count(self) -> int:
        with self.lock:
            return sum(len(v) for v in self.arrivals.values())

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def buffered(data_dir: Path) -> dict[str, set[tuple[str, int]]]:
    """The telemetry batches still in a stopped mapper's buffer, by device, as (boot id, seq)."""
    path = data_dir / "telemetry.db"
    out: dict[str, set[tuple[str, int]]] = {}
    if not path.exists():
        return out
    with contextlib.closing(sqlite3.connect(path)) as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        for (payload,) in db.execute("SELECT payload FROM batches"):
            try:
                batch = decode_batch(payload)
            except ValueError:
                continue  # an ack or an event kept for replay (JSON, not a batch)
            for part in batch.split() if batch.merged else (batch,):
                out.setdefault(part.device, set()).add((part.boot_id, part.seq))
    return out


def merged_rows(data_dir: Path) -> int:
    """Rows of a stopped mapper's buffer that hold more than one batch (the compactor merged them)."""
    path = data_dir / "telemetry.db"
    if not path.exists():
        return 0
    n = 0
    with contextlib.closing(sqlite3.connect(path)) as db:
        for (payload,) in db.execute("SELECT payload FROM batches"):
            with contextlib.suppress(ValueError):
                n += decode_batch(payload).merged
    return n
