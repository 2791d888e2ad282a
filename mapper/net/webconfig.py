"""``--web-config-file``: TLS and basic auth for the HTTP endpoints, in the format of Prometheus'
exporter-toolkit (the file dcgm-exporter, node_exporter and the other exporters read)::

    tls_server_config:
      cert_file: /etc/gpu-mapper-web/tls.crt
      key_file: /etc/gpu-mapper-web/tls.key
      client_auth_type: RequireAndVerifyClientCert   # NoClientCert (default), VerifyClientCertIfGiven
      client_ca_file: /etc/gpu-mapper-web/ca.crt
      client_allowed_sans: [prometheus]
      min_version: TLS12                             # TLS10 .. TLS13
      max_version: TLS13
    http_server_config:
      headers: {X-Frame-Options: deny}
    basic_auth_users:
      prometheus: $2y$10$...                         # bcrypt hash (htpasswd -nBC 10 "" | tr -d ':\\n')

Every key is checked (an unknown or unsupported one is an error naming it, as the toolkit refuses unknown keys);
``cipher_suites`` and ``curve_preferences`` are Go names with no OpenSSL equivalent here, and the client auth
types that take an unverified certificate (``RequestClientCert``, ``RequireAnyClientCert``) cannot be had
through Python's ssl: they are refused rather than ignored.

As in the toolkit, the file and the files it names are read again when they change (checked on every connection
by their size and modification time), so renewed certificates and new users apply without a restart; a change
that does not load is logged and the last good configuration stays in force.

A bcrypt check costs tens of milliseconds of CPU by design: a successful (user, password) pair is remembered
(as a SHA-256 of the password, at most ``AUTH_CACHE_SIZE`` pairs), so a scrape every 15 s costs one check, not
one per scrape. An unknown user is checked against a dummy hash, so the answer takes as long as for a known one.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import os
import ssl
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mapper.errors import ConfigError

log = logging.getLogger(__name__)

#: Remembered successful logins (user, SHA-256 of the password).
AUTH_CACHE_SIZE = 64

_CLIENT_AUTH = {
    "NoClientCert": (ssl.CERT_NONE, False),
    "VerifyClientCertIfGiven": (ssl.CERT_OPTIONAL, True),
    "RequireAndVerifyClientCert": (ssl.CERT_REQUIRED, True),
}
#: The toolkit's two modes that take a client certificate without checking who signed it: OpenSSL (through
#: Python's ssl) cannot ask for a certificate and accept any, and accepting unverified ones defends nothing.
_UNVERIFIED_CLIENT_AUTH = ("RequestClientCert", "RequireAnyClientCert")
_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
_TLS_KEYS = {
    "cert_file",
    "key_file",
    "client_auth_type",
    "client_ca_file",
    "client_allowed_sans",
    "min_version",
    "max_version",
    "prefer_server_cipher_suites",
}
_UNSUPPORTED_TLS_KEYS = {"cipher_suites", "curve_preferences", "cert", "key"}
_HTTP_KEYS = {"http2", "headers"}
_TOP_KEYS = {"tls_server_config", "http_server_config", "basic_auth_users"}


@dataclass(frozen=True)
class TlsServerConfig:
    cert_file: str
    key_file: str
    client_auth_type: str = "NoClientCert"
    client_ca_file: str | None = None
    client_allowed_sans: tuple[str, ...] = ()
    min_version: str = "TLS12"
    max_version: str | None = None


@dataclass(frozen=True)
class WebConfig:
    """A parsed web config file. ``users``: user name -> bcrypt hash."""

    tls: TlsServerConfig | None = None
    users: Mapping[str, bytes] = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)
    #: The TLS context built from ``tls`` (None without TLS).
    context: ssl.SSLContext | None = field(default=None, compare=False, repr=False)

    @property
    def files(self) -> tuple[str, ...]:
        if self.tls is None:
            return ()
        return tuple(f for f in (self.tls.cert_file, self.tls.key_file, self.tls.client_ca_file) if f)


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: expected a non-empty string, got {value!r}")
    return value


def parse_web_config(text: str, path: str = "web config", base_dir: str | None = None) -> WebConfig:
    """Parse the file's text; relative file names are relative to ``base_dir`` (the file's folder), as in the
    toolkit. Raises ``ConfigError`` naming the key; builds the TLS context (so an unusable certificate or key is
    an error here, not at the first connection)."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    doc = _mapping(doc, path)
    unknown = sorted(set(doc) - _TOP_KEYS)
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(_TOP_KEYS))})")

    def resolve(name: str) -> str:
        return name if os.path.isabs(name) or base_dir is None else os.path.join(base_dir, name)

    tls = None
    raw_tls = _mapping(doc.get("tls_server_config"), f"{path}: tls_server_config")
    if raw_tls:
        bad = sorted(set(raw_tls) & _UNSUPPORTED_TLS_KEYS)
        if bad:
            raise ConfigError(
                f"{path}: tls_server_config.{bad[0]} is not supported by gpu-mapper (Go's TLS names have no "
                "OpenSSL equivalent here); remove it"
            )
        unknown = sorted(set(raw_tls) - _TLS_KEYS)
        if unknown:
            raise ConfigError(f"{path}: unknown key(s) tls_server_config.{', '.join(unknown)}")
        for key in ("cert_file", "key_file"):
            if not raw_tls.get(key):
                raise ConfigError(f"{path}: tls_server_config.{key} is required when tls_server_config is set")
        auth = raw_tls.get("client_auth_type", "NoClientCert") or "NoClientCert"
        if auth in _UNVERIFIED_CLIENT_AUTH:
            raise ConfigError(
                f"{path}: tls_server_config.client_auth_type {auth} (a client certificate nobody checks) is not "
                "supported; use VerifyClientCertIfGiven or RequireAndVerifyClientCert with client_ca_file"
            )
        if auth not in _CLIENT_AUTH:
            raise ConfigError(
                f"{path}: tls_server_config.client_auth_type {auth!r} is not one of {', '.join(_CLIENT_AUTH)}"
            )
        ca = raw_tls.get("client_ca_file")
        if _CLIENT_AUTH[auth][1] and not ca:
            raise ConfigError(f"{path}: tls_server_config.client_auth_type {auth} needs client_ca_file")
        sans = raw_tls.get("client_allowed_sans") or []
        if not isinstance(sans, list) or not all(isinstance(s, str) for s in sans):
            raise ConfigError(f"{path}: tls_server_config.client_allowed_sans: expected a list of names")
        if sans and not _CLIENT_AUTH[auth][1]:
            raise ConfigError(f"{path}: tls_server_config.client_allowed_sans needs a verified client certificate")
        versions = {}
        for key, default in (("min_version", "TLS12"), ("max_version", None)):
            value = raw_tls.get(key, default)
            if value is not None and value not in _VERSIONS:
                raise ConfigError(f"{path}: tls_server_config.{key} {value!r} is not one of {', '.join(_VERSIONS)}")
            versions[key] = value
        tls = TlsServerConfig(
            cert_file=resolve(_string(raw_tls["cert_file"], f"{path}: tls_server_config.cert_file")),
            key_file=resolve(_string(raw_tls["key_file"], f"{path}: tls_server_config.key_file")),
            client_auth_type=auth,
            client_ca_file=resolve(_string(ca, f"{path}: tls_server_config.client_ca_file")) if ca else None,
            client_allowed_sans=tuple(sans),
            min_version=versions["min_version"] or "TLS12",
            max_version=versions["max_version"],
        )

    http = _mapping(doc.get("http_server_config"), f"{path}: http_server_config")
    unknown = sorted(set(http) - _HTTP_KEYS)
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) http_server_config.{', '.join(unknown)}")
    headers = {}
    for name, value in _mapping(http.get("headers"), f"{path}: http_server_config.headers").items():
        if not isinstance(name, str) or not isinstance(value, str) or "\n" in name + value or "\r" in name + value:
            raise ConfigError(f"{path}: http_server_config.headers: {name!r} must map to a one-line string")
        headers[name] = value

    users = {}
    for user, hashed in _mapping(doc.get("basic_auth_users"), f"{path}: basic_auth_users").items():
        if not isinstance(user, str) or not user or ":" in user:
            raise ConfigError(f"{path}: basic_auth_users: {user!r} is not a valid user name")
        if not isinstance(hashed, str) or not hashed.startswith(("$2a$", "$2b$", "$2y$")):
            # The value is not shown: it may be a password written where its hash belongs.
            raise ConfigError(f"{path}: basic_auth_users.{user}: expected a bcrypt hash ($2y$..., $2b$...)")
        users[user] = hashed.encode()

    config = WebConfig(tls=tls, users=users, headers=headers)
    if tls is not None:
        config = WebConfig(tls=tls, users=users, headers=headers, context=_context(tls, path))
    return config


def _context(tls: TlsServerConfig, path: str) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = _VERSIONS[tls.min_version]
    if tls.max_version is not None:
        ctx.maximum_version = _VERSIONS[tls.max_version]
    try:
        ctx.load_cert_chain(tls.cert_file, tls.key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"{path}: tls_server_config: cannot load cert_file {tls.cert_file} / key_file {tls.key_file}: "
            f"{getattr(exc, 'strerror', None) or exc}"
        ) from None
    verify_mode, _ = _CLIENT_AUTH[tls.client_auth_type]
    ctx.verify_mode = verify_mode
    if tls.client_ca_file:
        try:
            ctx.load_verify_locations(cafile=tls.client_ca_file)
        except (OSError, ssl.SSLError) as exc:
            why = getattr(exc, "strerror", None) or exc
            raise ConfigError(f"{path}: tls_server_config.client_ca_file {tls.client_ca_file}: {why}") from None
    ctx.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    return ctx


def load_web_config(path: str) -> WebConfig:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"web config file {path}: cannot read it: {exc.strerror or exc}") from None
    return parse_web_config(text, f"web config file {path}", base_dir=os.path.dirname(os.path.abspath(path)))


def client_allowed(config: WebConfig, peer_cert: Mapping[str, Any] | None) -> bool:
    """True when ``client_allowed_sans`` is empty or the verified client certificate names one of them (a DNS
    name, IP address, e-mail or URI in its subjectAltName)."""
    if config.tls is None or not config.tls.client_allowed_sans:
        return True
    if not peer_cert:
        return False
    names = {value for _, value in peer_cert.get("subjectAltName", ())}
    return any(san in names for san in config.tls.client_allowed_sans)


class WebAuth:
    """The current web config (reloaded when its files change) and the basic-auth check, for the HTTP threads."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._config = load_web_config(path)
        self._stamp = self._stamps(self._config)
        self._ok: dict[tuple[str, bytes], bytes] = {}
        self._dummy: bytes | None = None
        self._failed_stamp: tuple[tuple[str, float, int], ...] | None = None

    @property
    def config(self) -> WebConfig:
        """The configuration in force, after loading the file again if it or a file it names changed."""
        stamp = self._stamps(self._config)
        if stamp == self._stamp or stamp == self._failed_stamp:
            return self._config
        with self._lock:
            if stamp != self._stamp:
                try:
                    config = load_web_config(self.path)
                except ConfigError as exc:
                    self._failed_stamp = stamp
                    log.error("%s; the previous web config stays in force", exc)
                    return self._config
                self._config, self._stamp, self._ok = config, self._stamps(config), {}
                tls = "on" if config.tls else "off"
                log.info("web config %s reloaded (tls %s, %d basic-auth user(s))", self.path, tls, len(config.users))
        return self._config

    def _stamps(self, config: WebConfig) -> tuple[tuple[str, float, int], ...]:
        out = []
        for name in (self.path, *config.files):
            try:
                st = os.stat(name)
                out.append((name, st.st_mtime, st.st_size))
            except OSError:
                out.append((name, 0.0, -1))
        return tuple(out)

    def authorized(self, config: WebConfig, header: str | None) -> bool:
        """Whether an ``Authorization`` header value passes ``config``'s basic auth (always, without users)."""
        if not config.users:
            return True
        if not header or not header.startswith("Basic "):
            return False
        try:
            user, sep, password = base64.b64decode(header[6:].strip(), validate=True).decode("utf-8").partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return False
        if not sep:
            return False
        digest = hashlib.sha256(password.encode()).digest()
        hashed = config.users.get(user)
        remembered = self._ok.get((user, digest))
        if hashed is not None and remembered is not None and hmac.compare_digest(remembered, hashed):
            return True
        import bcrypt  # only a mapper with basic-auth users loads it

        if hashed is None:
            if self._dummy is None:
                self._dummy = bcrypt.hashpw(b"dummy", bcrypt.gensalt(10))
            bcrypt.checkpw(password.encode(), self._dummy)  # as long as for a known user
            return False
        try:
            good = bcrypt.checkpw(password.encode(), hashed)
        except ValueError:
            log.error("web config %s: the bcrypt hash of user %s is malformed", self.path, user)
            return False
        if good:
            with self._lock:
                if len(self._ok) >= AUTH_CACHE_SIZE:
                    self._ok.clear()
                self._ok[(user, digest)] = hashed
        return good
