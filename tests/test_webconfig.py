"""``--web-config-file``: the endpoints behind TLS, client certificates and basic auth (exporter-toolkit format),
checked with real clients: Python's HTTPS client and a real Prometheus server scraping /metrics."""

from __future__ import annotations

import base64
import json
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import bcrypt
import pytest
import trustme

from mapper.edge.status.metrics import MetricsServer
from mapper.edge.status.stats import Readiness
from mapper.errors import ConfigError
from mapper.net.webconfig import load_web_config, parse_web_config
from tests.brokers import free_port
from tests.test_metrics import make_snapshot

PASSWORD = "scrape-pw-51c2"


def _hash(password: str) -> str:
    # exporter-toolkit's documentation makes hashes with htpasswd -B ($2y$); bcrypt reads both spellings.
    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(4)).decode().replace("$2b$", "$2y$", 1)


class Certs:
    def __init__(self, d: Path) -> None:
        self.ca = trustme.CA()
        server = self.ca.issue_cert("127.0.0.1", "localhost")
        client = self.ca.issue_cert("prometheus")
        other_client = self.ca.issue_cert("someone-else")
        self.dir = d
        self.ca_file = d / "ca.pem"
        self.ca.cert_pem.write_to_path(str(self.ca_file))
        self.server_cert, self.server_key = d / "tls.crt", d / "tls.key"
        server.cert_chain_pems[0].write_to_path(str(self.server_cert))
        server.private_key_pem.write_to_path(str(self.server_key))
        self.client = d / "client.pem"
        client.private_key_and_cert_chain_pem.write_to_path(str(self.client))
        self.client_cert, self.client_key = d / "client.crt", d / "client.key"
        client.cert_chain_pems[0].write_to_path(str(self.client_cert))
        client.private_key_pem.write_to_path(str(self.client_key))
        self.other_client = d / "other.pem"
        other_client.private_key_and_cert_chain_pem.write_to_path(str(self.other_client))


@pytest.fixture
def certs(tmp_path: Path) -> Certs:
    d = tmp_path / "certs"
    d.mkdir()
    return Certs(d)


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _server(web_config: Path | None) -> MetricsServer:
    snap = make_snapshot()
    return MetricsServer(
        "127.0.0.1:0",
        snapshot=lambda: snap,
        readiness=lambda: Readiness(nvml_initialised=True, dmi_registered=False, standalone=True),
        web_config_file=str(web_config) if web_config else None,
    )


@pytest.fixture
def tls_auth(tmp_path: Path, certs: Certs) -> Iterator[tuple[MetricsServer, Certs, Path]]:
    cfg = _write(
        tmp_path / "web.yml",
        "tls_server_config:\n  cert_file: certs/tls.crt\n  key_file: certs/tls.key\n"
        f"http_server_config:\n  headers:\n    X-Content-Type-Options: nosniff\n"
        f"basic_auth_users:\n  prometheus: {_hash(PASSWORD)}\n",
    )
    server = _server(cfg)
    server.start()
    yield server, certs, cfg
    server.stop()


def _get(url: str, *, ca: Path | None = None, client: Path | None = None, auth: tuple[str, str] | None = None):  # type: ignore[no-untyped-def]
    ctx = None
    if url.startswith("https"):
        ctx = ssl.create_default_context(cafile=str(ca) if ca else None)
        if client is not None:
            ctx.load_cert_chain(str(client))
    req = urllib.request.Request(url)
    if auth is not None:
        req.add_header("Authorization", "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=10, context=ctx) as resp:
            return resp.status, dict(resp.headers), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read().decode()


# --------------------------------------------------------------------------------------------------
# Real clients
# --------------------------------------------------------------------------------------------------


def test_off_by_default_the_endpoints_are_plain_http_without_auth() -> None:
    server = _server(None)
    server.start()
    try:
        assert server.url.startswith("http://")
        status, _, body = _get(server.url + "/metrics")
        assert status == 200 and "gpu_mapper_gpus" in body
    finally:
        server.stop()


@pytest.mark.parametrize("path", ["/metrics", "/healthz", "/readyz", "/status", "/"])
def test_every_endpoint_wants_tls_and_the_password(tls_auth: tuple[MetricsServer, Certs, Path], path: str) -> None:
    server, certs, _ = tls_auth
    assert server.url.startswith("https://")
    status, headers, body = _get(server.url + path, ca=certs.ca_file, auth=("prometheus", PASSWORD))
    assert status == 200, body
    assert headers["X-Content-Type-Options"] == "nosniff"
    for auth in (None, ("prometheus", "wrong"), ("nobody", PASSWORD)):
        status, headers, body = _get(server.url + path, ca=certs.ca_file, auth=auth)
        assert status == 401 and headers["WWW-Authenticate"].startswith("Basic"), (auth, status)
        assert "gpu_mapper" not in body and "uuid" not in body


def test_plain_http_to_the_tls_port_gets_nothing(tls_auth: tuple[MetricsServer, Certs, Path]) -> None:
    server, _, _ = tls_auth
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        _get(server.url.replace("https://", "http://") + "/metrics", auth=("prometheus", PASSWORD))
    # The server survives the bad client.
    status, _, _ = _get(server.url + "/healthz", ca=tls_auth[1].ca_file, auth=("prometheus", PASSWORD))
    assert status == 200


def test_a_client_that_does_not_trust_the_certificate_is_refused_by_its_own_tls(
    tls_auth: tuple[MetricsServer, Certs, Path], tmp_path: Path
) -> None:
    server, _, _ = tls_auth
    other = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(other))
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        _get(server.url + "/metrics", ca=other, auth=("prometheus", PASSWORD))


def test_client_certificates_are_required_and_checked_against_the_ca_and_the_allowed_names(
    tmp_path: Path, certs: Certs
) -> None:
    cfg = _write(
        tmp_path / "web.yml",
        f"tls_server_config:\n  cert_file: {certs.server_cert}\n  key_file: {certs.server_key}\n"
        f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {certs.ca_file}\n"
        "  client_allowed_sans: [prometheus]\n  min_version: TLS12\n",
    )
    stranger = trustme.CA().issue_cert("prometheus")
    stranger_pem = tmp_path / "stranger.pem"
    stranger.private_key_and_cert_chain_pem.write_to_path(str(stranger_pem))
    server = _server(cfg)
    server.start()
    try:
        status, _, body = _get(server.url + "/metrics", ca=certs.ca_file, client=certs.client)
        assert status == 200 and "gpu_mapper_gpus" in body
        for client in (None, stranger_pem, certs.other_client):  # none, another CA's, a name not allowed
            with pytest.raises((urllib.error.URLError, ConnectionError, ssl.SSLError, OSError)):
                _get(server.url + "/metrics", ca=certs.ca_file, client=client)
        status, _, _ = _get(server.url + "/metrics", ca=certs.ca_file, client=certs.client)
        assert status == 200
    finally:
        server.stop()


def test_a_changed_file_applies_to_the_next_connection_and_a_broken_change_keeps_the_last_good_one(
    tls_auth: tuple[MetricsServer, Certs, Path],
) -> None:
    server, certs, cfg = tls_auth
    url = server.url + "/metrics"
    assert _get(url, ca=certs.ca_file, auth=("grafana", "second-pw"))[0] == 401
    text = cfg.read_text() + f"  grafana: {_hash('second-pw')}\n"
    cfg.write_text(text)
    assert _get(url, ca=certs.ca_file, auth=("grafana", "second-pw"))[0] == 200
    cfg.write_text(text + "surprise: 1\n")  # does not load: the last good config stays
    assert _get(url, ca=certs.ca_file, auth=("grafana", "second-pw"))[0] == 200
    assert _get(url, ca=certs.ca_file)[0] == 401


PROMETHEUS_CONFIG = """
global: {{scrape_interval: 1s, scrape_timeout: 1s, evaluation_interval: 1s}}
scrape_configs:
  - job_name: gpu-mapper
    scheme: https
    basic_auth: {{username: prometheus, password_file: {password_file}}}
    tls_config: {{ca_file: {ca}, cert_file: {cert}, key_file: {key}}}
    static_configs: [{{targets: ["127.0.0.1:{port}"]}}]
  - job_name: gpu-mapper-no-password
    scheme: https
    tls_config: {{ca_file: {ca}, cert_file: {cert}, key_file: {key}}}
    static_configs: [{{targets: ["127.0.0.1:{port}"]}}]
"""


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_real_prometheus_scrapes_over_tls_with_a_client_certificate_and_basic_auth(
    tmp_path: Path, certs: Certs
) -> None:
    binary = shutil.which("prometheus") or "/usr/bin/prometheus"
    cfg = _write(
        tmp_path / "web.yml",
        f"tls_server_config:\n  cert_file: {certs.server_cert}\n  key_file: {certs.server_key}\n"
        f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {certs.ca_file}\n"
        f"basic_auth_users:\n  prometheus: {_hash(PASSWORD)}\n",
    )
    server = _server(cfg)
    server.start()
    password_file = _write(tmp_path / "scrape-password", PASSWORD)
    prom_cfg = _write(
        tmp_path / "prometheus.yml",
        PROMETHEUS_CONFIG.format(
            password_file=password_file,
            ca=certs.ca_file,
            cert=certs.client_cert,
            key=certs.client_key,
            port=server.port,
        ),
    )
    prom_port = free_port()
    log = (tmp_path / "prometheus.log").open("wb")
    prom = subprocess.Popen(
        [binary, f"--config.file={prom_cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=log, stderr=log,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        health: dict[str, str] = {}
        while time.monotonic() < deadline:
            assert prom.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{prom_port}/api/v1/targets", timeout=2) as resp:
                    targets = json.load(resp)["data"]["activeTargets"]
                health = {t["labels"]["job"]: t["health"] for t in targets}
                if health.get("gpu-mapper") == "up" and health.get("gpu-mapper-no-password") == "down":
                    break
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.2)
        assert health == {"gpu-mapper": "up", "gpu-mapper-no-password": "down"}, health
        query = f"http://127.0.0.1:{prom_port}/api/v1/query?query=gpu_mapper_gpus"
        with urllib.request.urlopen(query, timeout=5) as resp:
            result = json.load(resp)["data"]["result"]
        assert result and result[0]["metric"]["job"] == "gpu-mapper"
    finally:
        prom.terminate()
        try:
            prom.wait(20)
        except subprocess.TimeoutExpired:
            prom.kill()
            prom.wait(10)
        log.close()
        server.stop()


# --------------------------------------------------------------------------------------------------
# The file's format
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nope: 1\n", "unknown key"),
        ("tls_server_config:\n  cert_file: a\n", "key_file is required"),
        ("tls_server_config:\n  cert_file: a\n  key_file: b\n  cipher_suites: [X]\n", "cipher_suites is not supported"),
        ("tls_server_config:\n  cert_file: a\n  key_file: b\n  client_auth_type: RequireAnyClientCert\n",
         "not supported"),
        ("tls_server_config:\n  cert_file: a\n  key_file: b\n  client_auth_type: RequireAndVerifyClientCert\n",
         "needs client_ca_file"),
        ("tls_server_config:\n  cert_file: a\n  key_file: b\n  min_version: TLS9\n", "min_version"),
        ("tls_server_config:\n  cert_file: /nope.crt\n  key_file: /nope.key\n", "cannot load cert_file /nope.crt"),
        ("basic_auth_users:\n  admin: plaintext-pw-99\n", "expected a bcrypt hash"),
        ("http_server_config:\n  http3: true\n", "http_server_config.http3"),
    ],
)  # fmt: skip
def test_a_bad_web_config_is_refused_naming_the_key(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        parse_web_config(text, "web.yml")
    assert "plaintext-pw-99" not in str(err.value)


def test_the_mapper_refuses_to_start_its_endpoints_with_an_unreadable_web_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_web_config(str(tmp_path / "missing.yml"))
    with pytest.raises(ConfigError, match="unknown key"):
        _server(_write(tmp_path / "bad.yml", "basic_auth: {}\n"))


def test_basic_auth_alone_works_over_plain_http(tmp_path: Path) -> None:
    server = _server(_write(tmp_path / "web.yml", f"basic_auth_users:\n  prometheus: {_hash(PASSWORD)}\n"))
    server.start()
    try:
        assert server.url.startswith("http://")
        assert _get(server.url + "/metrics", auth=("prometheus", PASSWORD))[0] == 200
        assert _get(server.url + "/metrics")[0] == 401
    finally:
        server.stop()
