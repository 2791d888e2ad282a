"""Standalone mode never loads gRPC, and ``gpu-mapper run`` bounds the default executor.

``import grpc`` with the generated DMI stubs adds ~12 MB to the mapper's RSS: a standalone mapper (devices
folder, no EdgeCore) must not pay it. Each check runs in a fresh interpreter, since this test process has long
imported grpc for the DMI tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from tests.brokers import free_port

REPO = Path(__file__).resolve().parents[1]

#: Written to a file and run by a fresh interpreter: a whole MapperApp on 2 simulated GPUs, started, run until
#: it has written its status file (and, standalone, bound the folder's Devices), stopped; then what it imported.
#: argv: mode (standalone|dmi), tmp dir, broker port.
APP_CHILD = textwrap.dedent(
    """
    import asyncio, json, sys
    from dataclasses import replace
    from pathlib import Path

    import mapper.edge.app, mapper.cli
    from mapper.shared.settings import MqttSettings
    from mapper.tools.discover import device_yaml, model_yaml
    from mapper.edge.gpu.nvml import NvmlBackend
    from mapper.edge.gpu.simnvml import SimNvml
    from tests.apphelpers import fast_settings, wait_for

    mode, tmp, port = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    sim = SimNvml(2, "H100", seed=0)
    settings = fast_settings(str(tmp / "data"), mqtt=MqttSettings(url=f"mqtt://127.0.0.1:{port}"))
    if mode == "standalone":
        backend = NvmlBackend(SimNvml(2, "H100", seed=0))
        backend.init()
        gpus = backend.list_gpus()
        backend.shutdown()
        (tmp / "devices").mkdir()
        (tmp / "devices" / "devices.yaml").write_text(device_yaml(gpus, "edge-1"))
        (tmp / "devices" / "model.yaml").write_text(model_yaml())
        settings = replace(settings, devices_dir=str(tmp / "devices"))
    before = "grpc" in sys.modules

    async def main():
        app = mapper.edge.app.MapperApp(settings, NvmlBackend(sim), housekeeping_interval_s=0.2)
        stop = asyncio.Event()
        task = asyncio.create_task(app.run(stop))
        def bound():
            return sum(1 for w in app.workers.values() if w.device is not None)

        want = 2 if mode == "standalone" else 0
        await wait_for(
            lambda: task.done() or (tmp / "data" / "status.json").exists() and bound() == want,
            what="the status file and the Devices bound",
        )
        stop.set()
        return await asyncio.wait_for(task, 15), bound(), app.settings.dmi_enabled

    code, bound, dmi = asyncio.run(main())
    print(json.dumps({
        "exit_code": code,
        "bound": bound,
        "dmi_enabled": dmi,
        "grpc_before_start": before,
        "heavy": sorted(
            m for m in sys.modules
            if m.split(".")[0] in ("grpc", "google") or m.startswith("mapper.edge.kubeedge.dmi")
        ),
    }))
    """
)


def run_app_child(mode: str, tmp_path: Path) -> dict[str, object]:
    # The broker port is free and nothing listens on it: the session keeps retrying, which is all start() needs.
    return run_child(APP_CHILD, [mode, str(tmp_path), str(free_port())], tmp_path)


def run_child(code: str, args: list[str], tmp_path: Path) -> dict[str, Any]:
    """Run ``code`` as a script in a fresh interpreter; its last stdout line is JSON with ``exit_code`` 0."""
    script = tmp_path / "child.py"
    script.write_text(code)
    out = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["exit_code"] == 0, out.stderr[-3000:]
    return result


def test_standalone_mapper_starts_runs_and_stops_without_grpc(tmp_path: Path) -> None:
    result = run_app_child("standalone", tmp_path)
    assert result["dmi_enabled"] is False
    assert result["bound"] == 2, "the Devices of the folder were not bound: the run did not exercise standalone mode"
    assert result["heavy"] == [], f"standalone mode imported {result['heavy']}"


def test_dmi_mapper_loads_grpc_when_it_starts(tmp_path: Path) -> None:
    """The other side of the test above: grpc comes in with DMI, at start, not at import."""
    result = run_app_child("dmi", tmp_path)
    assert result["dmi_enabled"] is True
    assert result["grpc_before_start"] is False
    heavy = result["heavy"]
    assert isinstance(heavy, list)
    assert {
        "grpc",
        "mapper.edge.kubeedge.dmi.client",
        "mapper.edge.kubeedge.dmi.server",
        "mapper.edge.kubeedge.dmi.pb.dmi_pb2",
    } <= set(heavy)


#: ``gpu-mapper run`` (``mapper.cli.main``) in a fresh interpreter, standalone; a thread records the threads once
#: the mapper has written its status file and run three more collect rounds (read from its /status), then sends
#: SIGTERM. argv: tmp dir, metrics port, broker port.
CLI_CHILD = textwrap.dedent(
    """
    import json, os, signal, sys, threading, time, urllib.request
    from pathlib import Path

    from mapper.cli import main

    tmp, metrics_port, broker_port = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    (tmp / "devices").mkdir()
    seen = {}

    def rounds():
        url = "http://127.0.0.1:" + metrics_port + "/status"
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                return sum(json.load(resp)["collect"]["duration"]["counts"])
        except OSError:
            return -1

    def watch():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (tmp / "data" / "status.json").exists():
            time.sleep(0.05)
        # Running, not just started: three more collect rounds (each a worker job) before the threads are listed.
        first, ran = -1, False
        while not ran and time.monotonic() < deadline:
            now = rounds()
            first = now if first < 0 else first
            ran = first >= 0 and now >= first + 3
            time.sleep(0.05)
        seen["ran"] = ran
        seen["threads"] = sorted(t.name for t in threading.enumerate())
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="test-watch", daemon=True).start()
    code = main([
        "run", "--sim", "2", "--node-name", "edge-1", "--devices", str(tmp / "devices"),
        "--data-dir", str(tmp / "data"), "--metrics-addr", "127.0.0.1:" + metrics_port,
        "--mqtt", "mqtt://127.0.0.1:" + broker_port, "--log-level", "DEBUG",
    ])
    after = sorted(t.name for t in threading.enumerate() if t.name != "test-watch")
    print(json.dumps({"exit_code": code, "threads": seen.get("threads"), "ran": seen.get("ran"), "after": after,
                      "grpc": "grpc" in sys.modules}))
    """
)


def test_gpu_mapper_run_uses_a_small_named_default_executor_and_shuts_it_down(tmp_path: Path) -> None:
    result = run_child(CLI_CHILD, [str(tmp_path), str(free_port()), str(free_port())], tmp_path)
    threads = result["threads"]
    assert threads is not None, "the mapper never wrote its status file"
    assert result["ran"], "the mapper did not run three collect rounds within 30 s"
    assert not [t for t in threads if t.startswith("asyncio_")], f"the default executor was not replaced: {threads}"
    io_threads = [t for t in threads if t.startswith("mapper-io")]
    # Start-up (NVML init) and the status file went through it, so it has at least one thread; never more than 2.
    assert 1 <= len(io_threads) <= 2, threads
    assert result["after"] == ["MainThread"], f"threads left after gpu-mapper run returned: {result['after']}"
    assert result["grpc"] is False
