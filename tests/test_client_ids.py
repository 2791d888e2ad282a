"""MQTT client ids are unique per process by default: two bridges (or two mappers) on one host with the same config
never share one (a broker lets the second take the first's session over), a restarted process gets its own back,
and a configured id is used as it is. Real processes against a real mosquitto."""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest

from mapper.net.mqtt import ClientIdClaim
from mapper.shared.settings import MqttSettings
from tests.apphelpers import running_app, wait_for
from tests.bridgehelpers import bridge_settings, running_bridge
from tests.brokers import Mosquitto, free_port
from tests.test_app_eventbus import standalone

REPO = Path(__file__).resolve().parent.parent
#: How long two processes are watched for a takeover once both are connected: a broker that let the second take
#: the first's session over would show it within a reconnect backoff (0.5 s at first).
WATCH_S = 4.0
TAKEOVER = "already connected, closing old connection"


def test_a_claimed_id_is_the_base_then_the_next_free_one_and_is_given_back_on_close() -> None:
    base = f"claim-test-{time.monotonic_ns()}"
    first, second, third = ClientIdClaim(base), ClientIdClaim(base), ClientIdClaim(base)
    try:
        assert [c.client_id for c in (first, second, third)] == [base, f"{base}-1", f"{base}-2"]
        assert all(c.held for c in (first, second, third))
        first.close()
        again = ClientIdClaim(base)  # the lowest free one: what a restarted process gets back
        assert again.client_id == base
        again.close()
    finally:
        for claim in (first, second, third):
            claim.close()
    # A base of any length (a long host name) is held all the same.
    long_base = "x" * 300 + str(time.monotonic_ns())
    a, b = ClientIdClaim(long_base), ClientIdClaim(long_base)
    assert (a.client_id, b.client_id, a.held, b.held) == (long_base, f"{long_base}-1", True, True)
    a.close()
    b.close()


def test_an_id_held_by_a_process_that_is_killed_is_free_again() -> None:
    base = f"claim-kill-{time.monotonic_ns()}"
    script = (
        "import sys, time\n"
        "from mapper.net.mqtt import ClientIdClaim\n"
        f"c = ClientIdClaim({base!r})\n"
        "print(c.client_id, flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == base
        mine = ClientIdClaim(base)
        assert mine.client_id == f"{base}-1"  # the other process holds the base
        mine.close()
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        mine = ClientIdClaim(base)
        assert mine.client_id == base
        mine.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


# --------------------------------------------------------------------------------------------------
# Two bridge processes, one config
# --------------------------------------------------------------------------------------------------


def _bridge(config: Path, port: int, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    out = log.open("ab")
    cmd = [sys.executable, "-m", "mapper.cli", "bridge", "--config", str(config), "--metrics-addr", f"127.0.0.1:{port}"]
    return subprocess.Popen([*cmd, *extra], stdout=out, stderr=out, cwd=REPO)


def _connected(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            text = resp.read().decode()
    except OSError:
        return False
    return "gpu_mapper_bridge_mqtt_connected 1.0" in text


def _connects(log: Path) -> list[str]:
    """The client ids a bridge's log says it connected as, in order."""
    return re.findall(r"connected as (\S+) \(reconnects so far", log.read_text())


def _text(path: Path) -> str:
    return path.read_text()


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(20) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


async def _watch_for_takeover(broker_log: Path, logs: list[Path]) -> None:
    """Fail as soon as the broker closes a session for another client with its id, or a process connects
    again, within ``WATCH_S``."""
    end = time.monotonic() + WATCH_S
    while time.monotonic() < end:
        text = _text(broker_log)
        assert TAKEOVER not in text, [line for line in text.splitlines() if TAKEOVER in line]
        for log in logs:
            assert len(_connects(log)) == 1, (log.name, _connects(log), log.read_text()[-2000:])
        await asyncio.sleep(0.1)


@pytest.mark.timeout(120)
async def test_two_bridge_processes_with_one_config_keep_their_own_sessions(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    config = tmp_path / "config.yaml"
    # Nothing is published, so the remote-write URL is never called: this test is about the broker sessions.
    config.write_text(
        "bridge:\n"
        f"  mqtt: {{url: '{mosquitto.url}', reconnectMaxBackoff: 1s}}\n"
        f"  remoteWrite: {{url: 'http://127.0.0.1:{free_port()}/api/v1/write'}}\n"
        f"  spoolDir: {tmp_path / 'spool'}\n"
    )
    ports = [free_port(), free_port()]
    logs = [tmp_path / "bridge-a.log", tmp_path / "bridge-b.log"]
    procs = [_bridge(config, ports[0], logs[0])]
    try:
        await wait_for(lambda: _connected(ports[0]), timeout_s=30, what="bridge A connected")
        procs.append(_bridge(config, ports[1], logs[1]))
        await wait_for(lambda: _connected(ports[1]), timeout_s=30, what="bridge B connected")
        await _watch_for_takeover(mosquitto.log_path, logs)
        assert _connected(ports[0]) and _connected(ports[1])
        (id_a,), (id_b,) = _connects(logs[0]), _connects(logs[1])
        assert id_a != id_b
        # The group's default, <group>-<hostname>, or the next free <group>-<hostname>-<n> (the base may be held
        # by another process on this machine: the ids are host-wide).
        base = f"gpu-mapper-bridge-{socket.gethostname()}"
        assert all(re.fullmatch(re.escape(base) + r"(-\d+)?", i) for i in (id_a, id_b)), (id_a, id_b)
        # The broker saw each id connect once.
        broker = mosquitto.log_path.read_text()
        assert broker.count(f" as {id_a} ") == 1 and broker.count(f" as {id_b} ") == 1, broker[-3000:]

        # A restarted replica takes its own id back (its persistent session resumes), and still no takeover.
        _stop(procs[0])
        logs[0] = tmp_path / "bridge-a2.log"
        procs[0] = _bridge(config, ports[0], logs[0])
        await wait_for(lambda: _connected(ports[0]), timeout_s=30, what="bridge A connected again")
        await _watch_for_takeover(mosquitto.log_path, logs)
        assert _connects(logs[0]) == [id_a]
    finally:
        for proc in procs:
            _stop(proc)


@pytest.mark.timeout(60)
async def test_a_configured_client_id_is_used_as_it_is(tmp_path: Path, mosquitto: Mosquitto) -> None:
    settings = bridge_settings(mosquitto.url, f"http://127.0.0.1:{free_port()}/api/v1/write", tmp_path, "explicit-c")
    async with running_bridge(settings) as bridge:
        assert bridge.client_id == "explicit-c" and bridge.client_id_claim is None
        await wait_for(lambda: " as explicit-c " in mosquitto.log_path.read_text(), what="the broker to see it")


# --------------------------------------------------------------------------------------------------
# Two mappers, one config
# --------------------------------------------------------------------------------------------------


@pytest.mark.timeout(90)
async def test_two_mappers_with_one_config_on_one_host_keep_their_own_sessions(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    sim_a, _, _, settings_a = standalone(tmp_path / "a", mosquitto.url)
    sim_b, _, _, settings_b = standalone(tmp_path / "b", mosquitto.url)
    assert settings_a.mqtt.client_id == "" and settings_a.node_name == settings_b.node_name
    async with running_app(settings_a, sim_a) as a, running_app(settings_b, sim_b) as b:
        assert a.session is not None and b.session is not None
        await wait_for(lambda: a.session.connected and b.session.connected, what="both connected")
        base = f"gpu-mapper-{settings_a.node_name}"
        assert a.client_id != b.client_id
        assert all(re.fullmatch(re.escape(base) + r"(-\d+)?", i) for i in (a.client_id, b.client_id))
        end = time.monotonic() + WATCH_S
        while time.monotonic() < end:
            assert TAKEOVER not in mosquitto.log_path.read_text()
            assert a.session.connected and b.session.connected
            assert (a.session.reconnects, b.session.reconnects) == (0, 0)
            await asyncio.sleep(0.1)
    # A configured id is used as it is.
    explicit = replace(settings_a, mqtt=replace(settings_a.mqtt, client_id="mapper-explicit"))
    assert isinstance(explicit.mqtt, MqttSettings)
    async with running_app(explicit, sim_a) as app:
        assert app.client_id == "mapper-explicit" and app.client_id_claim is None
        await wait_for(lambda: " as mapper-explicit " in mosquitto.log_path.read_text(), what="the broker to see it")
