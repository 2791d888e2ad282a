"""``dbMethod.influxdb2``: samples as InfluxDB line protocol, ``POST <url>/api/v2/write``.

What KubeEdge's framework writes, point for point (docs/push.md): ``<measurement>,<spec tags, sorted>
<fieldKey>="<value>" <ns>``, the value a quoted string field, to ``<url>/api/v2/write?org=&bucket=&precision=ns``
with ``Authorization: Token <TOKEN>`` (none when there is no token). Differences, on purpose: the timestamp is
the sample's own time, not the write time (a replay lands where it belongs); many samples go in one request (at
most ``BATCH_LINES`` lines); ``numeric=True`` writes a sample that has a number as a float field instead.

Answers: 2xx delivered; 429, 408 and 5xx (but 501 and 505), a timeout or a connection that fails are a
``TransientError`` (``Retry-After`` honoured); any other answer is a ``PermanentError`` naming the status and
the server's message. A sample no line can carry (a value with a line break; with ``numeric``, a number that is
not finite) is refused by itself: the others are written, then a ``PartlyRefusedError`` names what was refused.

Idempotence: InfluxDB keeps one value per series, field and timestamp, so writing a point again overwrites it
with itself. Still, when a long write fails part way (a later request of it), the lines already answered 2xx
are remembered and not sent again by the retry, so a store that keeps duplicates (VictoriaMetrics) stays clean.

The requests run in the writer's own thread (stdlib ``http.client``, one kept-alive connection), every socket
wait bounded by ``timeout_s``; the event loop and the default executor never wait on the network.
"""

from __future__ import annotations

import email.utils
import http.client
import json
import math
import ssl
import time
import urllib.parse
from collections.abc import Sequence

from mapper.edge.push.ownthread import OwnThread
from mapper.errors import PartlyRefusedError, PermanentError, TransientError, short_repr
from mapper.shared.push import DbInfluxdb2, PushSample, PushSecrets, PushWriter

#: Lines per request (InfluxDB advises batches of about 5000 lines).
BATCH_LINES = 5000
#: The most of an answer's body read (an error's JSON); a longer one is cut and its connection not reused.
MAX_ANSWER_BYTES = 64 * 1024
#: The longest ``Retry-After`` honoured, in seconds.
MAX_RETRY_AFTER_S = 3600.0
#: Lines remembered as delivered by a write that then failed part way; beyond this the memory is dropped.
MAX_REMEMBERED_LINES = 100_000


def make_writer(
    method: DbInfluxdb2,
    secrets: PushSecrets,
    *,
    timeout_s: float,
    numeric: bool = False,
    ssl_context: ssl.SSLContext | None = None,
    batch_lines: int = BATCH_LINES,
) -> PushWriter:
    """The writer for one ``influxdb2`` data config. ``numeric``: a sample with a number is written as a float
    field (the framework, and the default here, writes every value as a string field). ``ssl_context`` for an
    ``https`` url (default: the system's CAs). A config no request can be made from is a ``PermanentError``."""
    return Influxdb2Writer(
        method,
        secrets.token,
        timeout_s=timeout_s,
        numeric=numeric,
        ssl_context=ssl_context,
        batch_lines=batch_lines,
    )


def _check_name(what: str, text: str) -> None:
    """Line protocol has no escape for a line break, and a backslash before a separator changes its meaning:
    refuse both (and other control characters, and lone surrogates) in names and tag values."""
    if any(ch == "\\" or ord(ch) < 0x20 or ch == "\x7f" or 0xD800 <= ord(ch) < 0xE000 for ch in text):
        raise PermanentError(
            f"influxdb2 {what} {short_repr(text)}: a backslash or control character cannot be written",
            reason="bad-config",
        )


def _escape_measurement(text: str) -> str:
    return text.replace(",", "\\,").replace(" ", "\\ ")


def _escape_key(text: str) -> str:
    """A tag key, a tag value or a field key."""
    return text.replace(",", "\\,").replace("=", "\\=").replace(" ", "\\ ")


def string_field(value: str) -> str:
    """A string field value: quoted, with ``\\`` and ``"`` escaped."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def retry_after_s(header: str | None, *, now_s: float, default_s: float = 1.0) -> float:
    """A ``Retry-After`` header (delay seconds or an HTTP date) as seconds from now, within
    [0, ``MAX_RETRY_AFTER_S``]; ``default_s`` when absent or unreadable."""
    if not header:
        return default_s
    text = header.strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            seconds = email.utils.parsedate_to_datetime(text).timestamp() - now_s
        except (TypeError, ValueError, IndexError, OverflowError):
            return default_s
    if not math.isfinite(seconds):
        return default_s
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)


def _server_message(body: bytes) -> str:
    """InfluxDB's error answer is JSON ``{"code": ..., "message": ...}``; otherwise the text itself."""
    text = body.decode("utf-8", errors="replace").strip()
    try:
        doc = json.loads(text)
    except ValueError:
        return short_repr(text, 200)
    if isinstance(doc, dict) and isinstance(doc.get("message"), str):
        return short_repr(doc["message"], 200)
    return short_repr(text, 200)


class Influxdb2Writer:
    """One influxdb2 data config's writer (see the module docstring); build it with ``make_writer``."""

    key: str

    def __init__(
        self,
        method: DbInfluxdb2,
        token: str | None,
        *,
        timeout_s: float,
        numeric: bool,
        ssl_context: ssl.SSLContext | None,
        batch_lines: int,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if batch_lines < 1:
            raise ValueError(f"batch_lines must be >= 1, got {batch_lines}")
        parts = urllib.parse.urlsplit(method.url.strip())
        try:
            port = parts.port
        except ValueError:
            port = -1
        if (
            parts.scheme not in ("http", "https")
            or not parts.hostname
            or port == -1
            or parts.query
            or parts.fragment
            or parts.username is not None
        ):
            raise PermanentError(
                f"influxdb2 url {short_repr(method.url)}: want http(s)://host[:port][/path]", reason="bad-url"
            )
        if not method.bucket:
            raise PermanentError("influxdb2: the bucket is empty", reason="bad-config")
        if not method.measurement or method.measurement.startswith("#"):
            raise PermanentError(
                f"influxdb2 measurement {short_repr(method.measurement)}: empty or a comment", reason="bad-config"
            )
        if not method.field_key:
            raise PermanentError("influxdb2: the fieldKey is empty", reason="bad-config")
        _check_name("measurement", method.measurement)
        _check_name("fieldKey", method.field_key)
        tags = []
        for name, value in sorted(method.tags.items()):
            if not name:
                raise PermanentError("influxdb2: a tag with an empty name", reason="bad-config")
            _check_name("tag", name)
            _check_name(f"tag {name!r} value", value)
            if value:  # InfluxDB has no empty tag value: an empty one is the tag's absence
                tags.append(f"{_escape_key(name)}={_escape_key(value)}")
        self._prefix = ",".join([_escape_measurement(method.measurement), *tags])
        self._field = _escape_key(method.field_key)
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = port
        self._ssl_context = ssl_context
        query = urllib.parse.urlencode([("org", method.org), ("bucket", method.bucket), ("precision", "ns")])
        self._path = f"{parts.path.rstrip('/')}/api/v2/write?{query}"
        self._headers = {"Content-Type": "text/plain; charset=utf-8", "User-Agent": "gpu-mapper"}
        if token:
            self._headers["Authorization"] = f"Token {token}"
        base = urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/"), "", ""))
        self.key = f"influxdb2 {base} {method.org}/{method.bucket} {self._prefix} {self._field}"
        self._timeout_s = timeout_s
        self._numeric = numeric
        self._batch_lines = batch_lines
        self._conn: http.client.HTTPConnection | None = None
        self._landed: set[str] = set()
        self._thread = OwnThread("push-influxdb2")

    def __repr__(self) -> str:
        return f"Influxdb2Writer({self.key!r})"

    def line(self, sample: PushSample) -> str:
        """The sample's line; ``ValueError`` naming why when no line can carry it."""
        if self._numeric and sample.number is not None:
            number = float(sample.number)
            if not math.isfinite(number):
                raise ValueError(f"{number!r} is not a finite number")
            value = repr(number)
        else:
            if "\n" in sample.value or "\r" in sample.value:
                raise ValueError("a line break in the value")
            sample.value.encode("utf-8")  # a lone surrogate: UnicodeEncodeError, a ValueError
            value = string_field(sample.value)
        return f"{self._prefix} {self._field}={value} {sample.ts_ms * 1_000_000}"

    async def write(self, samples: Sequence[PushSample]) -> None:
        lines: list[str] = []
        refused: list[str] = []
        positions: list[int] = []
        for i, sample in enumerate(samples):
            try:
                lines.append(self.line(sample))
            except ValueError as exc:
                refused.append(f"{sample.namespace}/{sample.device}/{sample.property}@{sample.ts_ms}: {exc}")
                positions.append(i)
        if lines:
            await self._thread.run(self._deliver, lines)
        if refused:
            raise PartlyRefusedError(
                f"{self.key}: {len(refused)} of {len(samples)} samples refused (the rest written): {refused[0]}",
                refused=positions,
                reason="bad-value",
            )

    async def aclose(self) -> None:
        await self._thread.close(self._drop_connection)

    # -- in the writer's thread --

    def _deliver(self, lines: list[str]) -> None:
        pending = [line for line in lines if line not in self._landed]
        sent: list[str] = []
        try:
            for start in range(0, len(pending), self._batch_lines):
                chunk = pending[start : start + self._batch_lines]
                self._post("\n".join(chunk).encode("utf-8"))
                sent.extend(chunk)
        except TransientError:
            if len(self._landed) + len(sent) > MAX_REMEMBERED_LINES:
                self._landed.clear()
            self._landed.update(sent)
            raise
        self._landed.difference_update(lines)

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            if self._https:
                context = self._ssl_context or ssl.create_default_context()
                self._conn = http.client.HTTPSConnection(
                    self._host, self._port, timeout=self._timeout_s, context=context
                )
            else:
                self._conn = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout_s)
        return self._conn

    def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def _exchange(self, body: bytes) -> tuple[http.client.HTTPResponse, bytes]:
        """One request and its answer (at most ``MAX_ANSWER_BYTES`` of it). A kept-alive connection the server
        has closed meanwhile (idle, or restarted) fails on its first use: once, the request goes again on a new
        one (a write is idempotent: the same point overwrites itself)."""
        while True:
            conn = self._connection()
            reused = conn.sock is not None
            try:
                conn.request("POST", self._path, body=body, headers=self._headers)
                resp = conn.getresponse()
                answer = resp.read(MAX_ANSWER_BYTES)
            except (ConnectionResetError, BrokenPipeError, http.client.RemoteDisconnected):
                self._drop_connection()
                if reused:
                    continue
                raise
            except BaseException:
                self._drop_connection()
                raise
            if not resp.isclosed() or resp.will_close:
                self._drop_connection()
            return resp, answer

    def _post(self, body: bytes) -> None:
        try:
            resp, answer = self._exchange(body)
        except ssl.SSLCertVerificationError as exc:
            self._drop_connection()
            raise PermanentError(f"{self.key}: the server's certificate: {exc.verify_message}", reason="tls") from None
        except TimeoutError:
            self._drop_connection()
            raise TransientError(f"{self.key}: no answer within {self._timeout_s}s", reason="timeout") from None
        except (OSError, http.client.HTTPException) as exc:
            self._drop_connection()
            raise TransientError(f"{self.key}: {type(exc).__name__}: {exc}", reason="unreachable") from None
        status = resp.status
        if 200 <= status < 300:
            return
        message = f"{self.key}: HTTP {status}: {_server_message(answer)}"
        if status in (408, 429) or (status >= 500 and status not in (501, 505)):
            wait_s = retry_after_s(resp.getheader("Retry-After"), now_s=time.time())
            raise TransientError(message, retry_after_s=wait_s, reason=f"http-{status}")
        raise PermanentError(message, reason=f"http-{status}")
