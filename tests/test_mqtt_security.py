"""MQTT TLS with client certificates, passwords and the shipped ACL, against a real mosquitto.

Certificates are made here with ``trustme`` (no ``openssl`` binary needed): a CA the broker trusts, the broker's
certificate, the mapper's client certificate, and one from another CA. Nothing here skips.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trustme

from mapper.edge.config import load_settings
from mapper.edge.gpu.simnvml import SimNvml
from mapper.errors import ConfigError
from mapper.net.mqtt import MqttSession, mapper_session
from mapper.shared.settings import MqttSettings
from tests.apphelpers import fast_settings, running_app, wait_for
from tests.brokers import Mosquitto, password_file

REPO = Path(__file__).resolve().parent.parent
ACL = REPO / "deploy" / "mosquitto" / "gpu-mapper.acl"
EXAMPLE_CONF = REPO / "deploy" / "mosquitto" / "mosquitto.conf"
# mosquitto started as root drops to the "mosquitto" user, which cannot read pytest's private tmp dirs.
KEEP_USER = "user root\n" if os.geteuid() == 0 else ""


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    #: A client certificate signed by a CA the broker does not trust.
    stranger_cert: Path
    stranger_key: Path


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    ca, other = trustme.CA(), trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("gpu-mapper")
    stranger = other.issue_cert("gpu-mapper")
    d = tmp_path / "pki"
    d.mkdir()
    files = {
        "ca": ca.cert_pem,
        "server_cert": server.cert_chain_pems[0],
        "server_key": server.private_key_pem,
        "client_cert": client.cert_chain_pems[0],
        "client_key": client.private_key_pem,
        "stranger_cert": stranger.cert_chain_pems[0],
        "stranger_key": stranger.private_key_pem,
    }
    paths = {}
    for name, blob in files.items():
        path = d / f"{name}.pem"
        blob.write_to_path(str(path))
        paths[name] = path
    return Pki(**paths)


def _tls_config(pki: Pki, *, require_certificate: bool = True) -> str:
    return (
        f"{KEEP_USER}cafile {pki.ca}\ncertfile {pki.server_cert}\nkeyfile {pki.server_key}\n"
        f"require_certificate {'true' if require_certificate else 'false'}\n"
    )


def _session(url: str, client_id: str, **kw: object) -> MqttSession:
    opts: dict[str, object] = {"reconnect_min_s": 0.05, "reconnect_max_s": 0.2, "connect_timeout_s": 2}
    opts.update(kw)
    return MqttSession(url, client_id, **opts)  # type: ignore[arg-type]


@pytest.fixture
def tls_broker(tmp_path: Path, pki: Pki) -> Iterator[Mosquitto]:
    broker = Mosquitto(tmp_path, extra_config=_tls_config(pki))
    broker.start()
    yield broker
    broker.stop()


async def _deliver(pub: MqttSession, topic: str, payload: bytes, got: list[tuple[str, bytes]]) -> None:
    """Publish until a subscriber's list holds the message: a message sent before the broker has registered
    the other client's subscription reaches nobody, and no MQTT message says when that has happened."""
    deadline = asyncio.get_running_loop().time() + 10
    while (topic, payload) not in got:
        assert asyncio.get_running_loop().time() < deadline, f"{topic} never reached the subscriber"
        await pub.publish(topic, payload, timeout_s=5)
        for _ in range(10):
            if (topic, payload) in got:
                break
            await asyncio.sleep(0.02)


def _url(broker: Mosquitto) -> str:
    return f"mqtts://127.0.0.1:{broker.port}"


async def test_require_certificate_accepts_the_mappers_client_certificate(tls_broker: Mosquitto, pki: Pki) -> None:
    got: list[tuple[str, bytes]] = []
    sub = _session(
        _url(tls_broker), "watch", ca_file=str(pki.ca), cert_file=str(pki.client_cert), key_file=str(pki.client_key)
    )
    sub.subscribe("secure/#", lambda t, p: got.append((t, p)))
    pub = _session(
        _url(tls_broker), "mapper", ca_file=str(pki.ca), cert_file=str(pki.client_cert), key_file=str(pki.client_key)
    )
    try:
        await sub.start()
        await pub.start()
        assert await sub.wait_connected(5) and await pub.wait_connected(5)
        await _deliver(pub, "secure/x", b"hello", got)
        assert pub.last_failure is None and pub.connect_failures == 0
    finally:
        await pub.stop(2)
        await sub.stop(2)


@pytest.mark.parametrize("which", ["missing", "untrusted"])
async def test_require_certificate_refuses_a_missing_or_untrusted_client_certificate_and_says_why(
    tls_broker: Mosquitto, pki: Pki, which: str, caplog: pytest.LogCaptureFixture
) -> None:
    kw: dict[str, object] = {"ca_file": str(pki.ca)}
    if which == "untrusted":
        kw.update(cert_file=str(pki.stranger_cert), key_file=str(pki.stranger_key))
    sess = _session(_url(tls_broker), f"no-cert-{which}", **kw)
    caplog.set_level(logging.WARNING, logger="mapper.net.mqtt")
    try:
        await sess.start()
        await wait_for(lambda: sess.connect_failures >= 3, what="three refused attempts")
        assert not sess.connected
        assert sess.last_failure is not None
        # The broker's TLS alert is named, with what to check.
        alert = "certificate required" if which == "missing" else "unknown ca"
        await wait_for(lambda: any(alert in r.getMessage().lower() for r in caplog.records), what=f"'{alert}'")
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("client certificate" in w for w in warnings), warnings
        # Said once per distinct reason, not on every retry.
        assert len(warnings) == len(set(warnings))
        assert len(warnings) < sess.connect_failures
    finally:
        await sess.stop(2)


async def test_a_broker_certificate_from_an_unknown_ca_is_refused_by_the_mapper(
    tls_broker: Mosquitto, pki: Pki, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    other_ca = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(other_ca))
    sess = _session(
        _url(tls_broker),
        "wrong-ca",
        ca_file=str(other_ca),
        cert_file=str(pki.client_cert),
        key_file=str(pki.client_key),
    )
    caplog.set_level(logging.WARNING, logger="mapper.net.mqtt")
    try:
        await sess.start()
        await wait_for(lambda: sess.connect_failures >= 2, what="two refused attempts")
        assert not sess.connected
        assert sess.last_failure is not None and "not trusted" in sess.last_failure
        assert any("mqtt.caFile" in r.getMessage() for r in caplog.records)
    finally:
        await sess.stop(2)


async def test_a_wrong_password_is_refused_and_the_mapper_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pwfile = password_file(tmp_path, {"gpu-mapper": "s3cret-pw"})
    broker = Mosquitto(tmp_path, extra_config=f"{KEEP_USER}allow_anonymous false\npassword_file {pwfile}\n")
    broker.start()
    good = _session(broker.url, "good", username="gpu-mapper", password="s3cret-pw")
    bad = _session(broker.url, "bad", username="gpu-mapper", password="bad-pw-8812")
    anonymous = _session(broker.url, "anon")
    caplog.set_level(logging.DEBUG, logger="mapper.net.mqtt")
    try:
        for s in (good, bad, anonymous):
            await s.start()
        assert await good.wait_connected(5)
        await good.publish("t", b"x", timeout_s=5)
        await wait_for(lambda: bad.connect_failures >= 2 and anonymous.connect_failures >= 2, what="refusals")
        assert not bad.connected and not anonymous.connected
        assert bad.last_failure is not None and "refused the connection" in bad.last_failure
        assert "check mqtt.username" in bad.last_failure
        # Neither password appears in anything the session logged, at any level.
        text = "\n".join(r.getMessage() for r in caplog.records)
        assert "s3cret-pw" not in text and "bad-pw-8812" not in text
    finally:
        for s in (good, bad, anonymous):
            await s.stop(2)
        broker.stop()


# --------------------------------------------------------------------------------------------------
# The shipped ACL (deploy/mosquitto/gpu-mapper.acl)
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def acl_broker(tmp_path: Path, pki: Pki) -> Iterator[Mosquitto]:
    """The example config's defences: TLS with client certificates, passwords, and the shipped ACL plus two
    users the tests need (a watcher that reads everything, an edge application that may send deltas)."""
    pwfile = password_file(tmp_path, {"gpu-mapper": "mapper-pw", "watcher": "watcher-pw", "app": "app-pw"})
    acl = tmp_path / "acl"
    acl.write_text(
        ACL.read_text()
        + "\nuser watcher\ntopic read #\ntopic read $hw/#\n"
        + "\nuser app\ntopic write $hw/events/device/+/+/twin/update/delta\ntopic write secret/#\n"
    )
    broker = Mosquitto(
        tmp_path,
        extra_config=_tls_config(pki) + f"allow_anonymous false\npassword_file {pwfile}\nacl_file {acl}\n",
    )
    broker.start()
    yield broker
    broker.stop()


def _acl_session(broker: Mosquitto, pki: Pki, user: str, password: str) -> MqttSession:
    return _session(
        _url(broker),
        user,
        username=user,
        password=password,
        ca_file=str(pki.ca),
        cert_file=str(pki.client_cert),
        key_file=str(pki.client_key),
    )


async def test_the_acl_lets_the_mapper_publish_only_on_its_own_topics(acl_broker: Mosquitto, pki: Pki) -> None:
    seen: list[tuple[str, bytes]] = []
    watcher = _acl_session(acl_broker, pki, "watcher", "watcher-pw")
    watcher.subscribe("#", lambda t, p: seen.append((t, p)))
    watcher.subscribe("$hw/#", lambda t, p: seen.append((t, p)))
    mapper = _acl_session(acl_broker, pki, "gpu-mapper", "mapper-pw")
    try:
        await watcher.start()
        await mapper.start()
        assert await watcher.wait_connected(5) and await mapper.wait_connected(5)
        await _deliver(mapper, "gpu-mapper/edge-1/status", b"ready", seen)

        allowed = [
            ("gpu-mapper/edge-1/default/gpu0/telemetry", b"batch"),
            ("$hw/events/device/default/gpu0/twin/update", b"{}"),
            ("$hw/events/device/default/gpu0/state/update", b"{}"),
        ]
        refused = [
            ("other/topic", b"no"),
            ("$hw/events/device/default/gpu0/twin/update/delta", b"no"),  # desired values are not the mapper's
            ("$hw/events/node/edge-1/membership/updated", b"no"),
            ("gpu-mapperx/edge-1", b"no"),
        ]
        # mosquitto acknowledges a refused publish (MQTT 3.1.1 has no way to say no) but delivers it to nobody.
        # Messages of one connection are delivered in order: once the marker sent after them has arrived, a
        # refused message that got through would have arrived before it.
        for topic, payload in refused + allowed:
            await mapper.publish(topic, payload, timeout_s=5)
        await mapper.publish("gpu-mapper/edge-1/marker", b"end", timeout_s=5)
        await wait_for(lambda: ("gpu-mapper/edge-1/marker", b"end") in seen, what="the marker")
        for message in allowed:
            assert message in seen, message
        for message in refused:
            assert message not in seen, message
    finally:
        await mapper.stop(2)
        await watcher.stop(2)


async def test_the_acl_lets_the_mapper_read_deltas_but_nothing_else(acl_broker: Mosquitto, pki: Pki) -> None:
    got: list[tuple[str, bytes]] = []
    mapper = _acl_session(acl_broker, pki, "gpu-mapper", "mapper-pw")
    mapper.subscribe("$hw/events/device/+/+/twin/update/delta", lambda t, p: got.append((t, p)))
    mapper.subscribe("secret/#", lambda t, p: got.append((t, p)))
    app = _acl_session(acl_broker, pki, "app", "app-pw")
    delta = "$hw/events/device/default/gpu0/twin/update/delta"
    try:
        await mapper.start()
        await app.start()
        assert await mapper.wait_connected(5) and await app.wait_connected(5)
        await _deliver(app, delta, b"probe", got)
        got.clear()
        await app.publish("secret/x", b"not for the mapper", timeout_s=5)
        await app.publish(delta, b"after", timeout_s=5)
        await wait_for(lambda: (delta, b"after") in got, what="the delta after the secret")
        assert all(t != "secret/x" for t, _ in got)
    finally:
        await app.stop(2)
        await mapper.stop(2)


def test_the_example_mosquitto_conf_starts_a_broker_with_its_defences(tmp_path: Path, pki: Pki) -> None:
    pwfile = password_file(tmp_path, {"gpu-mapper": "pw"})
    text = EXAMPLE_CONF.read_text()
    for src, dst in {
        "/etc/mosquitto/passwd": str(pwfile),
        "/etc/mosquitto/gpu-mapper.acl": str(ACL),
        "/etc/mosquitto/tls/ca.crt": str(pki.ca),
        "/etc/mosquitto/tls/server.crt": str(pki.server_cert),
        "/etc/mosquitto/tls/server.key": str(pki.server_key),
    }.items():
        assert src in text, src
        text = text.replace(src, dst)
    broker = _ConfBroker(tmp_path, KEEP_USER + text)
    broker.start()
    try:

        async def check() -> None:
            ok = _session(
                f"mqtts://127.0.0.1:{broker.port}",
                "gpu-mapper",
                username="gpu-mapper",
                password="pw",
                ca_file=str(pki.ca),
                cert_file=str(pki.client_cert),
                key_file=str(pki.client_key),
            )
            no_cert = _session(
                f"mqtts://127.0.0.1:{broker.port}", "x", username="gpu-mapper", password="pw", ca_file=str(pki.ca)
            )
            try:
                await ok.start()
                await no_cert.start()
                assert await ok.wait_connected(5)
                await ok.publish("gpu-mapper/edge-1/status", b"online", timeout_s=5)
                await wait_for(lambda: no_cert.connect_failures >= 2, what="the certificate-less client refused")
                assert not no_cert.connected
            finally:
                await ok.stop(2)
                await no_cert.stop(2)

        asyncio.run(check())
    finally:
        broker.stop()


class _ConfBroker(Mosquitto):
    """A mosquitto with a whole config of our own; its one listener moved to a free port."""

    def __init__(self, workdir: Path, config: str) -> None:
        super().__init__(workdir)
        self._config = config.replace("listener 8883 127.0.0.1", f"listener {self.port} 127.0.0.1")

    def config_text(self) -> str:
        return self._config


# --------------------------------------------------------------------------------------------------
# The whole mapper against a broker that refuses it
# --------------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
async def test_a_mapper_the_broker_refuses_keeps_buffering_and_says_why(
    tls_broker: Mosquitto, pki: Pki, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sim = SimNvml(1, "H100", seed=0, scenario="steady")
    settings = fast_settings(
        str(tmp_path / "data"),
        devices_dir=str(tmp_path / "devices"),
        mqtt=MqttSettings(url=_url(tls_broker), ca_file=str(pki.ca)),  # no client certificate
    )
    (tmp_path / "devices").mkdir()
    caplog.set_level(logging.INFO)
    async with running_app(settings, sim) as app:
        assert app.buffer is not None and app.session is not None
        await wait_for(
            lambda: app.buffer is not None and app.buffer.stats().batches >= 3,
            timeout_s=20,
            what="three batches kept in the buffer",
        )
        assert not app.session.connected
        failure = app.session.last_failure
        assert failure is not None and "client certificate" in failure
    # Logged as a warning with the hint; the broker's alert itself ("certificate required") or only the closed
    # connection, whichever the TLS race gave.
    warned = [r.getMessage() for r in caplog.records if r.name == "mapper.net.mqtt" and r.levelno == logging.WARNING]
    assert any("client certificate" in w for w in warned), warned


# --------------------------------------------------------------------------------------------------
# An encrypted client key, its passphrase from a file
# --------------------------------------------------------------------------------------------------


def _encrypted_key(pki: Pki, passphrase: str) -> Path:
    """The mapper's client key as an encrypted PEM (as ``openssl pkey -aes256`` writes it)."""
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(pki.client_key.read_bytes(), password=None)
    path = pki.client_key.with_name("client_key.encrypted.pem")
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(passphrase.encode()),
        )
    )
    assert b"ENCRYPTED PRIVATE KEY" in path.read_bytes()
    return path


async def test_an_encrypted_client_key_is_unlocked_by_the_passphrase_from_its_file(
    tls_broker: Mosquitto, pki: Pki, tmp_path: Path
) -> None:
    passphrase = "key-pass-5e2d17"
    key = _encrypted_key(pki, passphrase)
    pass_file = tmp_path / "key-password"
    pass_file.write_text(passphrase + "\n")
    env = {
        "GPU_MAPPER_NODE_NAME": "edge-1",
        "GPU_MAPPER_MQTT_URL": _url(tls_broker),
        "GPU_MAPPER_MQTT_CA_FILE": str(pki.ca),
        "GPU_MAPPER_MQTT_CERT_FILE": str(pki.client_cert),
        "GPU_MAPPER_MQTT_KEY_FILE": str(key),
        "GPU_MAPPER_MQTT_KEY_PASSWORD_FILE": str(pass_file),
    }
    settings = load_settings(env=env)
    assert settings.mqtt.key_password == passphrase and passphrase not in repr(settings)
    assert settings.mqtt.url is not None
    sess = mapper_session(settings.mqtt.url, settings.mqtt, "edge-1", "gpu-mapper/edge-1/status", b"offline")
    try:
        await sess.start()
        # require_certificate: the broker let the session in, so the unlocked key signed the handshake.
        assert await sess.wait_connected(5), sess.last_failure
        await sess.publish("gpu-mapper/edge-1/x", b"1", timeout_s=5)
    finally:
        await sess.stop(2)


def test_an_encrypted_key_without_its_passphrase_or_with_a_wrong_one_is_refused_by_name(
    tls_broker: Mosquitto, pki: Pki, tmp_path: Path
) -> None:
    key = _encrypted_key(pki, "right-pass-91c3")
    tls = {"ca_file": str(pki.ca), "cert_file": str(pki.client_cert), "key_file": str(key)}
    # No passphrase configured: an error naming the key to set, not OpenSSL prompting on a terminal.
    with pytest.raises(ConfigError, match=r"encrypted and no passphrase is configured \(mqtt.keyPasswordFile\)"):
        _session(_url(tls_broker), "no-pass", **tls)
    with pytest.raises(ConfigError, match="TLS files unusable") as err:
        _session(_url(tls_broker), "wrong-pass", key_password="wrong-pass-0a7b", **tls)
    assert "wrong-pass-0a7b" not in str(err.value) and "right-pass-91c3" not in str(err.value)
    # A passphrase file with no key to unlock is a mistake, said at once.
    pass_file = tmp_path / "key-password"
    pass_file.write_text("x")
    with pytest.raises(ConfigError, match=r"mqtt\.keyPasswordFile: set, but there is no mqtt\.keyFile"):
        load_settings(env={"GPU_MAPPER_NODE_NAME": "e", "GPU_MAPPER_MQTT_KEY_PASSWORD_FILE": str(pass_file)})
