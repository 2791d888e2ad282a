"""The README's demos as a new user runs them: ``scripts/demo.sh`` and ``scripts/demo-jetson.sh`` at the same time.

Each runs in a copy of the checkout's layout (its scripts, the generated ``device-models/`` and the virtual
environment's ``gpu-mapper``), so what it writes stays in the test's folder. The set-up script is left out
(``scripts/bootstrap.sh``, which installs what is missing: here everything is). Both start with their own port and
data directory, none of them under ``/var/lib/gpu-mapper``; the demo's Devices are a copy, and editing that copy
changes the desired state while the tracked example stays as it is. Where this test runs as root, the two run in
a network namespace of their own, so the fixed ports of the demos (9410, 9420, 1883) meet nothing else on the
machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
VAR_LIB = Path("/var/lib/gpu-mapper")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

_GET = """
import sys, urllib.request, urllib.error
try:
    with urllib.request.urlopen(sys.argv[1], timeout=5) as r:
        sys.stdout.write(r.read().decode())
except urllib.error.HTTPError as e:
    sys.stdout.write(e.read().decode()); sys.exit(3)
except OSError as e:
    sys.stdout.write(str(e)); sys.exit(4)
"""


class Network:
    """Where the demos run: a network namespace of their own (as root, with unshare and nsenter), else the host's."""

    def __init__(self) -> None:
        self.holder: subprocess.Popen[bytes] | None = None
        can = os.geteuid() == 0 and all(shutil.which(t) for t in ("unshare", "nsenter", "ip"))
        if can:
            holder = subprocess.Popen(["unshare", "--net", "sleep", "600"])
            try:
                self._wait_for_namespace(holder.pid)
                subprocess.run([*self._enter(holder.pid), "ip", "link", "set", "lo", "up"], check=True, timeout=10)
                self.holder = holder
            except (subprocess.SubprocessError, OSError, AssertionError):
                holder.kill()
                holder.wait(10)

    @staticmethod
    def _enter(pid: int) -> list[str]:
        return ["nsenter", f"--net=/proc/{pid}/ns/net"]

    @staticmethod
    def _wait_for_namespace(pid: int) -> None:
        own = os.readlink("/proc/self/ns/net")
        deadline = time.monotonic() + 10
        while os.readlink(f"/proc/{pid}/ns/net") == own:
            assert time.monotonic() < deadline, "unshare did not make a network namespace"
            time.sleep(0.02)

    @property
    def prefix(self) -> list[str]:
        return [] if self.holder is None else self._enter(self.holder.pid)

    def get(self, url: str) -> tuple[int, str]:
        out = subprocess.run(
            [*self.prefix, sys.executable, "-c", _GET, url], capture_output=True, text=True, timeout=30
        )
        return out.returncode, out.stdout

    def close(self) -> None:
        if self.holder is not None:
            self.holder.kill()
            self.holder.wait(10)


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """The layout the scripts expect, in a folder of the test's own."""
    gpu_mapper = REPO / ".venv" / "bin" / "gpu-mapper"
    assert gpu_mapper.exists(), "scripts/bootstrap.sh makes .venv/bin/gpu-mapper (scripts/test.sh runs it first)"
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    for script in ("demo.sh", "demo-jetson.sh"):
        shutil.copy2(REPO / "scripts" / script, root / "scripts" / script)
    (root / "scripts" / "bootstrap.sh").write_text("#!/bin/sh\n# everything is installed already\nexit 0\n")
    (root / "scripts" / "bootstrap.sh").chmod(0o755)
    (root / "device-models").symlink_to(REPO / "device-models")
    (root / ".venv").symlink_to(REPO / ".venv")
    return root


@contextlib.contextmanager
def demo(net: Network, checkout: Path, script: str) -> Iterator[subprocess.Popen[bytes]]:
    log = (checkout / f"{script}.log").open("wb")
    proc = subprocess.Popen(
        [*net.prefix, str(checkout / "scripts" / script)],
        cwd=checkout,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        log.close()


def _var_lib_state() -> object:
    if not VAR_LIB.exists():
        return None
    return sorted((str(p), p.stat().st_mtime_ns) for p in VAR_LIB.rglob("*"))


def _wait_json(net: Network, url: str, ok: object, what: str, procs: list[subprocess.Popen[bytes]]) -> dict:  # type: ignore[type-arg]
    deadline = time.monotonic() + 90
    last = ""
    while time.monotonic() < deadline:
        for proc in procs:
            assert proc.poll() is None, f"a demo exited ({proc.args}): {what}"
        code, body = net.get(url)
        last = body
        if code == 0:
            doc = json.loads(body)
            if ok(doc):  # type: ignore[operator]
                return doc  # type: ignore[no-any-return]
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}; last answer: {last[-500:]}")


def test_the_demo_and_the_jetson_demo_run_side_by_side_on_copies_of_the_examples(checkout: Path) -> None:
    before = _var_lib_state()
    tracked = (REPO / "device-models" / "examples" / "demo-node.yaml").read_text()
    net = Network()
    try:
        with demo(net, checkout, "demo.sh") as gpus, demo(net, checkout, "demo-jetson.sh") as jetson:
            procs = [gpus, jetson]
            status = _wait_json(
                net,
                "http://127.0.0.1:9410/status",
                lambda d: len(d["gpus"]) == 4 and "applied" in d["gpus"][0].get("desired_status", ""),
                "the demo's 4 GPUs with their desired values applied",
                procs,
            )
            assert status["node"] == "demo-node" and status["mode"] == "standalone"
            board = _wait_json(
                net,
                "http://127.0.0.1:9420/status",
                lambda d: len(d["gpus"]) == 1 and "applied" in d["gpus"][0].get("desired_status", ""),
                "the Jetson demo's board with its desired values applied",
                procs,
            )
            assert board["node"] == "demo-jetson"
            assert board["gpus"][0]["device"] == "default/demo-jetson-gpu0"

            # Each has its own data directory, in the checkout; its Devices are a copy of the examples.
            for data, examples in ((".demo-data", "examples"), (".demo-jetson-data", "examples-jetson")):
                assert (checkout / data / "telemetry.db").exists()
                copied = sorted(p.name for p in (checkout / data / "devices").iterdir())
                assert copied == sorted(p.name for p in (REPO / "device-models" / examples).iterdir())

            # Editing the copy changes the desired state; the tracked example is untouched.
            copy = checkout / ".demo-data" / "devices" / "demo-node.yaml"
            assert copy.read_text() == tracked
            copy.write_text(tracked.replace("value: '450'", "value: '400'", 1))
            _wait_json(
                net,
                "http://127.0.0.1:9410/status",
                lambda d: (
                    d["gpus"][0].get("desired_power_limit_w") == 400.0
                    and "power_limit:applied" in d["gpus"][0].get("desired_status", "")
                ),
                "the edited power limit (400 W) applied",
                procs,
            )
            assert (REPO / "device-models" / "examples" / "demo-node.yaml").read_text() == tracked
    finally:
        net.close()
    logs = {name: (checkout / f"{name}.log").read_text(errors="replace") for name in ("demo.sh", "demo-jetson.sh")}
    for name, text in logs.items():
        assert "Traceback" not in text and "cannot listen" not in text, (name, text[-2000:])
    assert ".demo-data/devices/demo-node.yaml: edit it while this runs" in logs["demo.sh"]
    assert ".demo-jetson-data/devices/demo-jetson.yaml: edit it while this runs" in logs["demo-jetson.sh"]
    assert gpus.returncode == 0 and jetson.returncode == 0, logs
    assert _var_lib_state() == before, "a demo wrote under /var/lib/gpu-mapper"
