"""The mapper as a process (``gpu-mapper run --sim 1 --devices <folder>``, TZ=UTC) pushing to real receivers:
http and otel deliver every sample with its own time; both receivers down for a while and back: nothing lost,
in order; a destination that never answers delays neither the others nor the collect loop; ``/status`` and
``/metrics`` show each destination; a Device update changes a method mid-run; a bad value refuses only its method."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from mapper.edge.gpu.nvml import NvmlBackend
from mapper.edge.gpu.simnvml import SimNvml
from mapper.tools.discover import model_yaml
from tests.brokers import free_port
from tests.pushhelpers import HttpReceiver, OtlpReceiver, gaps_ms

REPO = Path(__file__).resolve().parents[1]
CYCLE_MS = 2000
#: What a gap between two pushed samples may exceed the report cycle by (the collect grid's jitter, a whole second
#: of the framework's text time).
SLACK_MS = 1100
#: The same for methods that carry milliseconds: half a cycle. A sample lost leaves a gap of about two cycles, far
#: above it; a loaded host delays a read by a few hundred ms (seen: 540 ms at a load of 7 on 2 cores).
MS_SLACK_MS = CYCLE_MS // 2


def sim_uuid() -> str:
    backend = NvmlBackend(SimNvml(1, "H100", seed=0))
    backend.init()
    try:
        return backend.list_gpus()[0].uuid
    finally:
        backend.shutdown()


def device_doc(
    uuid: str, http: HttpReceiver, otel: OtlpReceiver, temperature_path: str, silent_port: int
) -> dict[str, Any]:
    def prop(name: str, push: dict[str, Any]) -> dict[str, Any]:
        return {"name": name, "reportCycle": CYCLE_MS, "collectCycle": 1000, "reportToCloud": True, "pushMethod": push}

    host = "http://127.0.0.1"
    return {
        "apiVersion": "devices.kubeedge.io/v1beta1",
        "kind": "Device",
        "metadata": {"name": "gpu0", "namespace": "default"},
        "spec": {
            "deviceModelRef": {"name": "nvidia-gpu"},
            "nodeName": "edge-1",
            "protocol": {"protocolName": "gpu", "configData": {"uuid": uuid}},
            "properties": [
                prop("temperature", {"http": {"hostName": host, "port": http.port, "requestPath": temperature_path}}),
                prop("temperature_memory", {"http": {"hostName": host, "port": http.port, "requestPath": "/memory"}}),
                prop("power_usage", {"otel": {"endpointURL": otel.endpoint}}),
                prop("energy_consumption", {"otel": {"endpointURL": otel.endpoint}}),
                prop("utilization_gpu", {"anomalyDetection": {"algorithm": "zscore", "threshold": 3, "on": True}}),
                prop("power_limit", {"http": {"hostName": host, "port": 0}}),
                prop("clock_sm", {"http": {"hostName": host, "port": silent_port, "requestPath": "/silent"}}),
            ],
        },
    }


class Mapper:
    def __init__(self, tmp: Path, devices: Path, metrics_port: int, env: dict[str, str] | None = None) -> None:
        self.log = tmp / "mapper.log"
        self.metrics = f"http://127.0.0.1:{metrics_port}"
        argv = [
            sys.executable,
            "-m",
            "mapper.cli",
            "run",
            "--sim",
            "1",
            "--node-name",
            "edge-1",
            "--devices",
            str(devices),
            "--data-dir",
            str(tmp / "data"),
            "--metrics-addr",
            f"127.0.0.1:{metrics_port}",
            "--print-interval",
            "0",
        ]
        env = {
            **os.environ,
            "TZ": "UTC",
            "GPU_MAPPER_PUSH_TIMEOUT_S": "2s",
            "GPU_MAPPER_PUSH_RETRY_MAX_S": "2s",
            **(env or {}),
        }
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)

    def get(self, path: str) -> bytes:
        with urllib.request.urlopen(self.metrics + path, timeout=5) as answer:
            return bytes(answer.read())

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def wait_until(predicate: Any, mapper: Mapper, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        assert mapper.proc.poll() is None, f"the mapper exited: {mapper.text()[-3000:]}"
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; log:\n{mapper.text()[-3000:]}")


@pytest.fixture
def receivers() -> Iterator[tuple[HttpReceiver, OtlpReceiver]]:
    http, otel = HttpReceiver(), OtlpReceiver()
    http.start()
    otel.start()
    yield http, otel
    http.stop()
    otel.stop()


def http_times(http: HttpReceiver, path: str) -> list[int]:
    """The ``time`` of each post to ``path`` in arrival order, as Unix ms (the text is whole seconds, UTC)."""
    import calendar

    return [
        calendar.timegm(time.strptime(p.form["time"], "%Y-%m-%d %H:%M:%S")) * 1000
        for p in http.snapshot()
        if p.path == path
    ]


def otel_times(otel: OtlpReceiver, metric: str) -> list[int]:
    return [p.time_ms for p in otel.snapshot() if p.metric == metric]


def check_complete_and_in_order(times: list[int], what: str, *, slack_ms: int = SLACK_MS) -> None:
    assert times == sorted(times), f"{what}: out of order: {times}"
    gaps = gaps_ms(times)
    assert max(gaps) <= CYCLE_MS + slack_ms, f"{what}: a gap of {max(gaps)} ms: {gaps}"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_mapper_pushes_to_http_and_otel_through_an_outage_with_nothing_lost(
    tmp_path: Path, receivers: tuple[HttpReceiver, OtlpReceiver]
) -> None:
    http, otel = receivers
    # A destination that accepts connections and never answers (each request waits out its 2 s bound): it must
    # delay neither the other destinations nor the collect loop (the gaps checked below).
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(200)
    silent_port = silent.getsockname()[1]
    silent_key = f"http http://127.0.0.1:{silent_port}/silent"
    uuid = sim_uuid()
    devices = tmp_path / "devices"
    devices.mkdir()
    (devices / "model.yaml").write_text(model_yaml())
    (devices / "gpu0.yaml").write_text(yaml.safe_dump(device_doc(uuid, http, otel, "/temperature", silent_port)))
    mapper = Mapper(tmp_path, devices, free_port())
    try:
        # Every method delivers, in the framework's formats.
        wait_until(lambda: len(http_times(http, "/temperature")) >= 3, mapper, 60, "http posts")
        wait_until(lambda: len(otel_times(otel, "energy_consumption")) >= 3, mapper, 30, "otel points")
        first = next(p for p in http.snapshot() if p.path == "/temperature")
        assert set(first.form) == {"temperature", "time"} and first.form["temperature"].isdigit()
        assert first.headers["content-type"] == "application/x-www-form-urlencoded"
        power = next(p for p in otel.snapshot() if p.metric == "power_usage")
        assert power.resource["device.id"] == "default/gpu0" and power.resource["gpu.uuid"] == uuid
        assert (power.kind, power.unit) == ("gauge", "W")
        energy = next(p for p in otel.snapshot() if p.metric == "energy_consumption")
        assert (energy.kind, energy.monotonic, energy.unit) == ("sum", True, "J")
        now_ms = time.time() * 1000
        assert abs(power.time_ms - now_ms) < 30_000, "the sample's own time, a recent one"
        assert not [p for p in http.snapshot() if p.path not in ("/temperature", "/memory")], "power_limit refused"

        # Both receivers down for a while, then back on the same ports.
        http.stop()
        otel.stop()
        down_at_ms = time.time() * 1000
        time.sleep(7)
        status = json.loads(mapper.get("/status"))
        states = {d["key"]: d["state"] for d in status["push"]["destinations"]}
        assert states.pop(silent_key) == "down", status["push"]
        assert len(states) == 3 and set(states.values()) == {"down"}, status["push"]
        waiting = {d["key"]: d["backlog_samples"] for d in status["push"]["destinations"]}
        assert all(n >= 2 for n in waiting.values()), waiting
        http.start()
        otel.start()
        up_at_ms = time.time() * 1000
        wait_until(
            lambda: (
                min(http_times(http, "/temperature")[-1:] or [0]) > up_at_ms + CYCLE_MS
                and min(otel_times(otel, "power_usage")[-1:] or [0]) > up_at_ms + CYCLE_MS
            ),
            mapper,
            30,
            "the backlog and new samples after the outage",
        )
        for path in ("/temperature", "/memory"):
            times = http_times(http, path)
            check_complete_and_in_order(times, f"http {path}")
            assert any(down_at_ms < t < up_at_ms - CYCLE_MS for t in times), f"{path}: the outage's samples came"
        for metric in ("power_usage", "energy_consumption"):
            times = otel_times(otel, metric)
            check_complete_and_in_order(times, f"otel {metric}", slack_ms=MS_SLACK_MS)
            assert any(down_at_ms < t < up_at_ms - CYCLE_MS for t in times), f"{metric}: the outage's samples came"

        # /status and /metrics show each destination, its state and backlog.
        status = json.loads(mapper.get("/status"))
        by_key = {d["key"]: d for d in status["push"]["destinations"]}
        temperature = by_key[f"http http://127.0.0.1:{http.port}/temperature"]
        assert temperature["state"] == "ok" and temperature["failures"] >= 1
        assert by_key[f"otel {otel.endpoint}"]["delivered_samples"] >= 8
        hanging = by_key[silent_key]
        assert hanging["state"] == "down" and "no answer within 2 s" in hanging["last_error"], hanging
        assert hanging["delivered_samples"] == 0 and hanging["backlog_samples"] >= 5, hanging
        assert not [p for p in http.snapshot() if p.path == "/silent"]
        # ``gpu-mapper status --wide`` against the running mapper says the same, one line per destination.
        shown = subprocess.run(
            [sys.executable, "-m", "mapper.cli", "status", "--wide", "--url", mapper.metrics],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert shown.returncode == 0, shown.stderr
        lines = shown.stdout.splitlines()
        silent_line = next(line for line in lines if f"127.0.0.1:{silent_port}/silent" in line)
        assert "DOWN" in silent_line and "last error:" in silent_line and "no answer within 2 s" in silent_line
        waiting = re.search(r"(\d+) waiting", silent_line)
        assert waiting is not None and int(waiting.group(1)) >= 5, silent_line
        otel_line = next(line for line in lines if f"otel {otel.endpoint}" in line)
        assert ": ok, 0 waiting" in otel_line or ": ok, 1 waiting" in otel_line, otel_line
        metrics = mapper.get("/metrics").decode()
        otel_key = f"otel {otel.endpoint}"
        assert f'gpu_mapper_push_state{{destination="{otel_key}",method="otel",state="ok"}} 1.0' in metrics
        assert f'gpu_mapper_push_backlog_samples{{destination="{otel_key}",method="otel"}}' in metrics
        assert "gpu_mapper_push_failures_total" in metrics
        log = mapper.text()
        assert "spec.properties[5].pushMethod.http.port: must be 1..65535, got 0" in log

        # A Device update that changes a property's method mid-run: its samples go to the new one from then on.
        (devices / "gpu0.yaml").write_text(yaml.safe_dump(device_doc(uuid, http, otel, "/temperature2", silent_port)))
        wait_until(lambda: len(http_times(http, "/temperature2")) >= 2, mapper, 30, "posts to the new path")
        old, new = http_times(http, "/temperature"), http_times(http, "/temperature2")
        assert old[-1] < new[0], "the old method got nothing after the new one took over"
        check_complete_and_in_order(old + new, "temperature across the change")
    finally:
        code = mapper.stop()
        silent.close()
    assert code == 0, mapper.text()[-3000:]


# --------------------------------------------------------------------------------------------------
# Every method at once, the DB methods against their real servers (redis-server, MariaDB, VictoriaMetrics)
# --------------------------------------------------------------------------------------------------

PASSWORD = "push-pw"
TOKEN = "push-token"


def every_method_doc(uuid: str, http: HttpReceiver, otel: OtlpReceiver, redis: Any, vm: Any, mysql: Any) -> dict:
    """As a Device of the framework's users names them: one push and one DB method per property."""
    host = "http://127.0.0.1"
    mysql_method = {"mysqlClientConfig": {"addr": f"127.0.0.1:{mysql.port}", "database": "gpu", "userName": "mapper"}}

    def prop(name: str, push: dict[str, Any]) -> dict[str, Any]:
        return {"name": name, "reportCycle": CYCLE_MS, "reportToCloud": True, "pushMethod": push}

    return {
        "apiVersion": "devices.kubeedge.io/v1beta1",
        "kind": "Device",
        "metadata": {"name": "gpu0", "namespace": "default"},
        "spec": {
            "deviceModelRef": {"name": "nvidia-gpu"},
            "protocol": {"protocolName": "gpu", "configData": {"uuid": uuid}},
            "properties": [
                prop(
                    "temperature",
                    {
                        "http": {"hostName": host, "port": http.port, "requestPath": "/temperature"},
                        "dbMethod": {"redis": {"redisClientConfig": {"addr": f"127.0.0.1:{redis.port}", "db": 0}}},
                    },
                ),
                prop(
                    "power_usage",
                    {
                        "otel": {"endpointURL": otel.endpoint},
                        "dbMethod": {
                            "influxdb2": {
                                "influxdb2ClientConfig": {"url": vm.url, "org": "kubeedge", "bucket": "gpu"},
                                "influxdb2DataConfig": {
                                    "measurement": "gpu",
                                    "tag": {"node": "edge-1"},
                                    "fieldKey": "power",
                                },
                            }
                        },
                    },
                ),
                prop(
                    "temperature_memory",
                    {
                        "http": {"hostName": host, "port": http.port, "requestPath": "/memory"},
                        "dbMethod": {"mysql": mysql_method},
                    },
                ),
                prop(
                    "energy_consumption", {"otel": {"endpointURL": otel.endpoint}, "dbMethod": {"mysql": mysql_method}}
                ),
                prop("utilization_gpu", {"anomalyDetection": {"algorithm": "zscore", "threshold": 3, "enabled": True}}),
            ],
        },
    }


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_method_reaches_its_real_receiver_and_outages_lose_nothing(
    tmp_path: Path, receivers: tuple[HttpReceiver, OtlpReceiver]
) -> None:
    from tests.dbservers import MariaDb, RedisServer, VictoriaMetrics

    http, otel = receivers
    redis, vm, mysql = RedisServer(tmp_path, password=PASSWORD), VictoriaMetrics(tmp_path), MariaDb(tmp_path)
    servers = [redis, vm, mysql]
    mapper: Mapper | None = None
    try:
        for server in servers:
            server.start()
        mysql.make_database("gpu", "mapper", PASSWORD)
        uuid = sim_uuid()
        devices = tmp_path / "devices"
        devices.mkdir()
        (devices / "model.yaml").write_text(model_yaml())
        (devices / "gpu0.yaml").write_text(yaml.safe_dump(every_method_doc(uuid, http, otel, redis, vm, mysql)))
        mapper = Mapper(tmp_path, devices, free_port(), env={"PASSWORD": PASSWORD, "TOKEN": TOKEN})

        def redis_times() -> list[int]:
            return [score for member, score in redis.zrange("gpu0") if '"PropertyName":"temperature"' in member]

        def mysql_times(prop: str) -> list[int]:
            try:
                got = mysql.sql(f"SELECT UNIX_TIMESTAMP(ts) FROM `default/gpu0/{prop}` ORDER BY id", database="gpu")
            except Exception:
                return []
            return [int(r[0]) * 1000 for r in got]

        def vm_times() -> list[int]:
            series = vm.export('{__name__="gpu_power"}')
            return sorted(t for s in series for t in s["timestamps"])

        wait_until(
            lambda: (
                len(redis_times()) >= 2
                and len(mysql_times("temperature_memory")) >= 2
                and len(mysql_times("energy_consumption")) >= 2
                and len(vm_times()) >= 2
                and len(http_times(http, "/temperature")) >= 2
                and len(otel_times(otel, "power_usage")) >= 2
            ),
            mapper,
            60,
            "every receiver to hold values",
        )
        member = next(m for m, _ in redis.zrange("gpu0") if '"PropertyName":"temperature"' in m)
        assert json.loads(member)["DeviceName"] == "gpu0" and json.loads(member)["Namespace"] == "default"

        # redis down alone: the others go on meanwhile.
        redis.stop()
        others_before = len(http_times(http, "/temperature")), len(otel_times(otel, "power_usage"))
        time.sleep(8)
        assert len(http_times(http, "/temperature")) > others_before[0] + 2, "http went on while redis was down"
        assert len(otel_times(otel, "power_usage")) > others_before[1] + 2, "otel went on while redis was down"
        redis.start()
        # Then http, otel, VictoriaMetrics and MariaDB down together; redis goes on.
        redis_count = len(redis_times())
        http.stop()
        otel.stop()
        vm.stop()
        mysql.stop()
        down_ms = time.time() * 1000
        time.sleep(8)
        assert len(redis_times()) >= redis_count + 3, "redis went on while the others were down"
        vm.start()
        mysql.start()
        http.start()
        otel.start()
        up_ms = time.time() * 1000

        def caught_up(times: list[int]) -> bool:
            return bool(times) and times[-1] > up_ms + CYCLE_MS

        wait_until(
            lambda: (
                caught_up(redis_times())
                and caught_up(http_times(http, "/temperature"))
                and caught_up(http_times(http, "/memory"))
                and caught_up(otel_times(otel, "power_usage"))
                and caught_up(mysql_times("temperature_memory"))
                and caught_up(mysql_times("energy_consumption"))
                and caught_up(vm_times())
            ),
            mapper,
            60,
            "every receiver to catch up",
        )
        check_complete_and_in_order(redis_times(), "redis", slack_ms=MS_SLACK_MS)
        check_complete_and_in_order(vm_times(), "influxdb2 (VictoriaMetrics)", slack_ms=MS_SLACK_MS)
        for path in ("/temperature", "/memory"):
            check_complete_and_in_order(http_times(http, path), f"http {path}")
        for metric in ("power_usage", "energy_consumption"):
            check_complete_and_in_order(otel_times(otel, metric), f"otel {metric}", slack_ms=MS_SLACK_MS)
        for prop in ("temperature_memory", "energy_consumption"):
            check_complete_and_in_order(mysql_times(prop), f"mysql {prop}")
            assert any(down_ms < t < up_ms - CYCLE_MS for t in mysql_times(prop)), f"mysql {prop}: the outage's rows"
        assert any(down_ms < t < up_ms - CYCLE_MS for t in vm_times()), "influxdb2: the outage's points, at their time"
        status = json.loads(mapper.get("/status"))
        assert {d["kind"]: d["state"] for d in status["push"]["destinations"]} == {
            "http": "ok",
            "otel": "ok",
            "redis": "ok",
            "influxdb2": "ok",
            "mysql": "ok",
        }
    finally:
        code = mapper.stop() if mapper is not None else 0
        for server in servers:
            server.stop()
        mysql.cleanup()
    assert code == 0, mapper.text()[-3000:] if mapper is not None else ""
