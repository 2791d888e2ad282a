from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import trustme

from mapper.errors import ConfigError, TransientError
from mapper.net.mqtt import MqttSession, MqttSessions, parse_broker_url
from mapper.wire import topics
from mapper.wire.payloads import STATUS_OFFLINE
from tests.brokers import Mosquitto

REPO = Path(__file__).resolve().parent.parent
# mosquitto started as root drops to the "mosquitto" user, which cannot read pytest's private tmp dirs.
KEEP_USER = "user root\n" if os.geteuid() == 0 else ""


async def _until(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


def _spawn(script: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE)


def _run(argv: list[str]) -> None:
    subprocess.run(argv, check=True, capture_output=True)


def _session(url: str, client_id: str, **kw: object) -> MqttSession:
    opts: dict[str, object] = {"reconnect_min_s": 0.05, "reconnect_max_s": 0.2, "connect_timeout_s": 2}
    opts.update(kw)
    return MqttSession(url, client_id, **opts)  # type: ignore[arg-type]


@pytest.fixture
async def listener(mosquitto: Mosquitto) -> AsyncIterator[tuple[MqttSession, list[tuple[str, bytes]]]]:
    got: list[tuple[str, bytes]] = []
    sub = _session(mosquitto.url, "listener")
    sub.subscribe("#", lambda t, p: got.append((t, p)))
    await sub.start()
    assert await sub.wait_subscribed(5), "the listener's SUBACK"
    yield sub, got
    await sub.stop(2)


@pytest.mark.parametrize(
    ("url", "canonical"),
    [
        ("mqtt://broker:1883", "mqtt://broker:1883"),
        ("tcp://127.0.0.1:1883", "mqtt://127.0.0.1:1883"),
        ("ssl://broker", "mqtts://broker:8883"),
        ("mqtts://broker:9000/", "mqtts://broker:9000"),
    ],
)
def test_broker_urls_accept_mqtt_tcp_mqtts_and_ssl(url: str, canonical: str) -> None:
    assert parse_broker_url(url).url == canonical


@pytest.mark.parametrize(
    ("url", "message"),
    [("http://b:1", "scheme"), ("mqtt://", "no host"), ("mqtt://b:1/x", "path"), ("mqtt://b:x", "(?i)port")],
)
def test_bad_broker_urls_are_refused_with_the_url_in_the_message(url: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        parse_broker_url(url)
    assert url in str(err.value)


async def test_a_publish_resolves_after_the_broker_acked_and_reaches_a_subscriber(
    mosquitto: Mosquitto, listener: tuple[MqttSession, list[tuple[str, bytes]]]
) -> None:
    _, got = listener
    pub = _session(mosquitto.url, "pub")
    await pub.start()
    assert await pub.wait_connected(5)
    for i in range(50):
        await pub.publish("t/a", f"m{i}".encode(), qos=1, timeout_s=5)
    await pub.publish("t/b", "text", qos=0)
    await _until(lambda: len(got) == 51)
    assert got[0] == ("t/a", b"m0") and got[49] == ("t/a", b"m49") and got[50] == ("t/b", b"text")
    await pub.stop(2)


async def test_start_returns_without_a_broker_and_publish_fails_fast_until_it_is_up(tmp_path: Path) -> None:
    broker = Mosquitto(tmp_path)
    pub = _session(broker.url, "early")
    await pub.start()
    assert not pub.connected
    with pytest.raises(TransientError, match="not connected"):
        await pub.publish("t", b"x")
    await _until(lambda: pub.connect_failures >= 2)  # failed attempts in the background; nothing raises
    broker.start()
    try:
        assert await pub.wait_connected(5)
        await pub.publish("t", b"x", timeout_s=5)
        assert pub.connect_failures >= 1
    finally:
        await pub.stop(2)
        broker.stop()


async def test_subscriptions_and_on_connect_callbacks_come_back_after_the_broker_restarts(
    mosquitto: Mosquitto,
) -> None:
    got: list[bytes] = []
    connects: list[int] = []
    sess = _session(mosquitto.url, "resub")
    sess.subscribe("cmd/#", lambda t, p: got.append(p))
    sess.add_on_connect(lambda: connects.append(1))
    await sess.start()
    assert await sess.wait_connected(5)
    mosquitto.stop()
    await _until(lambda: not sess.connected)
    with pytest.raises(TransientError):
        await sess.publish("cmd/x", b"lost")
    mosquitto.start()
    await _until(lambda: len(connects) == 2)
    assert sess.reconnects == 1
    assert await sess.wait_subscribed(5), "the re-subscription's SUBACK"
    await sess.publish("cmd/x", b"after", timeout_s=5)
    await _until(lambda: got == [b"after"])
    await sess.stop(2)


async def test_the_last_will_marks_the_mapper_offline_when_its_process_dies_uncleanly(
    mosquitto: Mosquitto, listener: tuple[MqttSession, list[tuple[str, bytes]]]
) -> None:
    _, got = listener
    script = textwrap.dedent(
        f"""
        import asyncio, sys
        from mapper.net.mqtt import MqttSession
        async def main():
            s = MqttSession({mosquitto.url!r}, "dying", will_topic="gpu-mapper/n1/status", will_payload="offline")
            await s.start()
            assert await s.wait_connected(5)
            await s.publish("gpu-mapper/n1/status", b"online", retain=True)
            print("up", flush=True)
            await asyncio.sleep(60)
        asyncio.run(main())
        """
    )
    proc = _spawn(script)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == b"up"
        await _until(lambda: ("gpu-mapper/n1/status", b"online") in got)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(10)
    await _until(lambda: got[-1] == ("gpu-mapper/n1/status", b"offline"))
    # retained: a newcomer sees offline too
    late: list[bytes] = []
    newcomer = _session(mosquitto.url, "late")
    newcomer.subscribe("gpu-mapper/n1/status", lambda t, p: late.append(p))
    await newcomer.start()
    await _until(lambda: late == [b"offline"])
    await newcomer.stop(2)


async def test_the_mappers_session_leaves_the_status_topics_offline_as_its_last_will(
    mosquitto: Mosquitto, listener: tuple[MqttSession, list[tuple[str, bytes]]]
) -> None:
    """``mapper_session`` with the wire's ``offline`` as its will (what the root hands it): killed, it leaves the
    status topic ``offline``."""
    _, got = listener
    status = topics.status_topic("n2")
    script = textwrap.dedent(
        f"""
        import asyncio
        from mapper.net.mqtt import mapper_session
        from mapper.shared.settings import MqttSettings
        from mapper.wire.payloads import STATUS_OFFLINE
        async def main():
            s = mapper_session({mosquitto.url!r}, MqttSettings(url={mosquitto.url!r}), "n2", {status!r}, STATUS_OFFLINE)
            await s.start()
            assert await s.wait_connected(5)
            print("up", flush=True)
            await asyncio.sleep(60)
        asyncio.run(main())
        """
    )
    proc = _spawn(script)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == b"up"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(10)
    await _until(lambda: (status, STATUS_OFFLINE) in got)


async def test_a_clean_stop_does_not_fire_the_last_will(
    mosquitto: Mosquitto, listener: tuple[MqttSession, list[tuple[str, bytes]]]
) -> None:
    _, got = listener
    sess = _session(mosquitto.url, "clean", will_topic="will/clean", will_payload="offline")
    await sess.start()
    assert await sess.wait_connected(5)
    await sess.stop(2)
    await sess.stop(2)  # idempotent
    marker = _session(mosquitto.url, "marker")
    await marker.start()
    assert await marker.wait_connected(5)
    await marker.publish("marker", b"1", timeout_s=5)
    await _until(lambda: ("marker", b"1") in got)
    assert all(t != "will/clean" for t, _ in got)
    await marker.stop(2)


async def test_the_pool_keeps_one_session_per_broker_and_closes_them_together(mosquitto: Mosquitto) -> None:
    pool = MqttSessions("mapper-n1", reconnect_min_s=0.05, reconnect_max_s=0.2)
    a = await pool.get(mosquitto.url)
    b = await pool.get(mosquitto.url.replace("mqtt://", "tcp://"))
    assert a is b
    assert mosquitto.url in pool
    assert await a.wait_connected(5)
    await pool.close(2)
    assert not a.connected
    assert pool.sessions == {}


async def test_username_and_password_are_sent_to_the_broker(tmp_path: Path) -> None:
    passwd = "mosquitto_passwd"  # in Debian's mosquitto package, which the tests need anyway
    pwfile = tmp_path / "passwd"
    _run([passwd, "-c", "-b", str(pwfile), "mapper", "s3cret"])
    pwfile.chmod(0o600)
    broker = Mosquitto(tmp_path, extra_config=f"{KEEP_USER}password_file {pwfile}\n")
    broker.start()
    good = _session(broker.url, "good", username="mapper", password="s3cret")
    bad = _session(broker.url, "bad", username="mapper", password="wrong")
    try:
        await good.start()
        await bad.start()
        assert await good.wait_connected(5)
        await good.publish("t", b"x", timeout_s=5)
        assert not await bad.wait_connected(0.5)
        assert bad.connect_failures >= 1
    finally:
        await good.stop(2)
        await bad.stop(2)
        broker.stop()


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, signed by a fresh CA whose certificate is returned first
    (made with trustme: no openssl binary needed)."""
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1")
    ca_path, chain = tmp_path / "ca.pem", tmp_path / "server.pem"
    ca.cert_pem.write_to_path(str(ca_path))
    server.private_key_and_cert_chain_pem.write_to_path(str(chain))
    return ca_path, chain


async def test_tls_with_a_trusted_ca_connects_and_an_untrusted_one_does_not(tmp_path: Path) -> None:
    ca, chain = _self_signed(tmp_path)
    broker = Mosquitto(tmp_path, extra_config=f"{KEEP_USER}certfile {chain}\nkeyfile {chain}\n")
    broker.start()
    url = f"mqtts://127.0.0.1:{broker.port}"
    good = _session(url, "tls-good", ca_file=str(ca))
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    other_ca, _ = _self_signed(other_dir)
    bad = _session(url, "tls-bad", ca_file=str(other_ca))
    try:
        await good.start()
        await bad.start()
        assert await good.wait_connected(5)
        await good.publish("secure", b"x", timeout_s=5)
        assert not await bad.wait_connected(0.5)
    finally:
        await good.stop(2)
        await bad.stop(2)
        broker.stop()


def test_tls_options_on_a_plain_url_are_a_configuration_error() -> None:
    with pytest.raises(ConfigError, match="mqtts"):
        MqttSession("mqtt://b:1883", "x", ca_file="/nope.pem")
    with pytest.raises(ConfigError, match="cert_file and key_file"):
        MqttSession("mqtts://b:8883", "x", cert_file="/c.pem")


async def test_the_session_socket_sends_small_messages_at_once_tcp_nodelay(mosquitto: Mosquitto) -> None:
    import socket

    session = _session(mosquitto.url, "nodelay")
    await session.start()
    assert await session.wait_connected(5)
    sock = session._client.socket()
    assert sock is not None
    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    await session.stop(2)


async def test_the_session_has_no_network_thread_and_publishes_from_the_event_loop(
    mosquitto: Mosquitto, listener: tuple[MqttSession, list[tuple[str, bytes]]]
) -> None:
    import threading

    _, got = listener
    before = {t.ident for t in threading.enumerate()}
    pub = _session(mosquitto.url, "nothread")
    await pub.start()
    assert await pub.wait_connected(5)
    await pub.publish("t/x", b"hello", timeout_s=5)
    # The connect ran in a short-lived worker thread; nothing of paho's keeps running beside the loop.
    assert not [t.name for t in threading.enumerate() if t.ident not in before and t.name.startswith("paho")]
    await _until(lambda: ("t/x", b"hello") in got)
    await pub.stop(2)


async def test_a_payload_larger_than_the_socket_buffer_arrives_whole(
    mosquitto: Mosquitto, listener: tuple[MqttSession, list[tuple[str, bytes]]]
) -> None:
    _, got = listener
    pub = _session(mosquitto.url, "big")
    await pub.start()
    assert await pub.wait_connected(5)
    # 24 MiB: more than the socket buffers on both ends hold, so paho cannot write it in one send
    payload = bytes(range(256)) * (24 * 4096)
    writable_calls: list[int] = []
    on_writable = pub._on_writable

    def counting() -> None:
        writable_calls.append(1)
        on_writable()

    pub._on_writable = counting  # type: ignore[method-assign]
    # The broker is paused while the publish starts, so the first write surely stops short (a broker that reads
    # as fast as we write would otherwise take it all in one go, and the writability path would go untested).
    assert mosquitto.proc is not None
    mosquitto.proc.send_signal(signal.SIGSTOP)
    try:
        sending = asyncio.gather(
            pub.publish("t/big", payload, timeout_s=10),
            *[pub.publish("t/small", f"s{i}".encode(), timeout_s=10) for i in range(3)],
        )
        await _until(lambda: pub._writing, timeout_s=5)
    finally:
        mosquitto.proc.send_signal(signal.SIGCONT)
    await sending
    # Each publish resolved on its PUBACK; the subscriber's copies may still be on their way: wait for all four.
    await _until(lambda: any(t == "t/big" for t, _ in got) and sum(t == "t/small" for t, _ in got) >= 3, timeout_s=10)
    big = [p for t, p in got if t == "t/big"]
    assert big == [payload]
    assert sorted(p for t, p in got if t == "t/small") == [b"s0", b"s1", b"s2"]
    assert writable_calls  # the rest was written when the socket became writable again
    assert not pub._writing  # nothing left to write: the loop stopped watching for writability
    await pub.stop(2)


async def test_an_idle_session_keeps_its_connection_alive_with_pings(tmp_path: Path) -> None:
    # mosquitto drops a client that sends nothing for 1.5 keepalive periods; the session's timer sends PINGREQ.
    broker = Mosquitto(tmp_path, extra_config=f"{KEEP_USER}log_type all\nlog_dest stderr")
    broker.start()
    sess = _session(broker.url, "idle-keepalive", keepalive_s=5)
    try:
        await sess.start()
        assert await sess.wait_connected(5)
        # mosquitto drops a client silent for 1.5 keepalives (7.5 s): the second PINGREQ, about 10 s in, is past that.
        await _until(lambda: broker.log_path.read_text().count("PINGREQ from idle-keepalive") >= 2, timeout_s=20)
        assert sess.connected
        assert sess.reconnects == 0
        assert "PINGREQ from idle-keepalive" in broker.log_path.read_text()
    finally:
        await sess.stop(2)
        broker.stop()


async def test_a_server_that_never_sends_connack_counts_as_a_failed_connect_and_is_retried() -> None:
    import socket

    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    port = server.getsockname()[1]
    sess = _session(f"mqtt://127.0.0.1:{port}", "no-connack", connect_timeout_s=0.3)
    try:
        await sess.start()
        await _until(lambda: sess.connect_failures >= 2, timeout_s=5)
        assert not sess.connected
        with pytest.raises(TransientError, match="not connected"):
            await sess.publish("t", b"x")
    finally:
        await sess.stop(2)
        server.close()
