"""A small HTTP/1.1 client for the push destinations: one keep-alive connection per origin, asyncio all through.

``HttpClient(base_url)`` POSTs to one origin (``http://host:port`` or ``https://host:port``: TLS with the CA
bundle it is given, the system's otherwise) and answers ``HttpResponse`` (status, headers, body) whatever the
status; only the way there fails: ``TransientError`` when the connection cannot be made, breaks, or the whole
request takes longer than ``timeout_s`` (connect, send and answer together). The connection is kept for the next
request unless the server closes it; a kept connection the server had closed meanwhile is noticed and the request
is sent once more on a fresh one. Responses with a ``Content-Length``, chunked ones and ones that end with the
connection are read; a body larger than ``max_body_bytes`` is refused. Not a general-purpose client: no
redirects, no proxies, no cookies.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from mapper.errors import ConfigError, TransientError

#: The most bytes of a response body read (a push receiver answers a few bytes).
MAX_BODY_BYTES = 4 * 1024 * 1024
_MAX_HEADER_LINES = 200


@dataclass(frozen=True)
class HttpResponse:
    status: int
    #: Header names in lower case; the last of a repeated header.
    headers: Mapping[str, str] = field(default_factory=dict)
    body: bytes = b""


class _Stale(Exception):
    """A kept connection turned out to be closed before anything of the answer arrived."""


def tls_context(ca_file: str | None) -> ssl.SSLContext:
    """A client TLS context: the CA bundle ``ca_file`` (a Kubernetes Secret or ConfigMap mounted), else the
    system's; hostnames checked. ``ConfigError`` naming the file when it cannot be read."""
    try:
        return ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"push.caFile: cannot load {ca_file}: {exc}") from None


class HttpClient:
    """POSTs to one origin over one kept connection (see the module docstring). One request at a time: the caller
    (a destination's own task) awaits each before the next."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float,
        tls: ssl.SSLContext | None = None,
        user_agent: str = "gpu-mapper",
        max_body_bytes: int = MAX_BODY_BYTES,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http:// or https:// URL: {base_url!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.host = parts.hostname
        self.https = parts.scheme == "https"
        self.port = parts.port or (443 if self.https else 80)
        default_port = (self.https and self.port == 443) or (not self.https and self.port == 80)
        shown_host = f"[{self.host}]" if ":" in self.host else self.host
        self.host_header = shown_host if default_port else f"{shown_host}:{self.port}"
        self.origin = f"{parts.scheme}://{self.host_header}"
        self.timeout_s = timeout_s
        self.tls = (tls or ssl.create_default_context()) if self.https else None
        self.user_agent = user_agent
        self.max_body_bytes = max_body_bytes
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def post(self, target: str, body: bytes, headers: Mapping[str, str] | None = None) -> HttpResponse:
        """POST ``body`` to ``target`` (a path with its query, e.g. ``/v1/metrics``); the answer, any status."""
        request = self._request(target or "/", body, headers or {})
        try:
            async with asyncio.timeout(self.timeout_s):
                if self._writer is not None:
                    try:
                        return await self._exchange(request, reused=True)
                    except _Stale:
                        await self._drop()
                await self._connect()
                try:
                    return await self._exchange(request, reused=False)
                except _Stale as exc:
                    raise TransientError(f"{self.origin} closed the connection without an answer") from exc
        except TimeoutError:
            await self._drop()
            raise TransientError(f"{self.origin}: no answer within {self.timeout_s:g} s", reason="timeout") from None
        except (OSError, asyncio.IncompleteReadError, ssl.SSLError, ValueError, asyncio.LimitOverrunError) as exc:
            await self._drop()
            raise TransientError(f"{self.origin}: {type(exc).__name__}: {exc}", reason="unreachable") from None
        except BaseException:
            await self._drop()
            raise

    def _request(self, target: str, body: bytes, headers: Mapping[str, str]) -> bytes:
        lines = [
            f"POST {target} HTTP/1.1",
            f"Host: {self.host_header}",
            f"User-Agent: {self.user_agent}",
            f"Content-Length: {len(body)}",
        ]
        for name, value in headers.items():
            if any(c in name + value for c in "\r\n"):
                raise ValueError(f"header {name!r} holds a line break")
            lines.append(f"{name}: {value}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body

    async def _connect(self) -> None:
        self._reader, self._writer = await asyncio.open_connection(
            self.host, self.port, ssl=self.tls, server_hostname=self.host if self.tls is not None else None
        )

    async def _exchange(self, request: bytes, *, reused: bool) -> HttpResponse:
        reader, writer = self._reader, self._writer
        assert reader is not None and writer is not None
        try:
            writer.write(request)
            await writer.drain()
            status_line = await reader.readline()
        except (ConnectionError, OSError):
            if reused:
                raise _Stale() from None
            raise
        if not status_line:
            if reused:
                raise _Stale()
            raise OSError("the server closed the connection without an answer")
        parts = status_line.decode("latin-1").split(None, 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise ValueError(f"not an HTTP answer: {status_line[:80]!r}")
        version, status = parts[0], int(parts[1])
        headers: dict[str, str] = {}
        for _ in range(_MAX_HEADER_LINES):
            line = await reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        else:
            raise ValueError("too many header lines")
        body = await self._body(reader, headers, status)
        connection = headers.get("connection", "").lower()
        if connection == "close" or (version == "HTTP/1.0" and connection != "keep-alive"):
            await self._drop()
        return HttpResponse(status, headers, body)

    async def _body(self, reader: asyncio.StreamReader, headers: Mapping[str, str], status: int) -> bytes:
        if status in (204, 304) or 100 <= status < 200:
            return b""
        if "chunked" in headers.get("transfer-encoding", "").lower():
            chunks: list[bytes] = []
            total = 0
            while True:
                size_line = await reader.readline()
                size = int(size_line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(chunks)
                total += size
                if total > self.max_body_bytes:
                    raise ValueError(f"answer larger than {self.max_body_bytes} bytes")
                chunks.append(await reader.readexactly(size))
                await reader.readexactly(2)
        length = headers.get("content-length")
        if length is not None:
            n = int(length)
            if n > self.max_body_bytes:
                raise ValueError(f"answer of {n} bytes, more than {self.max_body_bytes}")
            return await reader.readexactly(n)
        # Neither: the body ends with the connection.
        parts: list[bytes] = []
        total = 0
        while chunk := await reader.read(65536):
            total += len(chunk)
            if total > self.max_body_bytes:
                raise ValueError(f"answer larger than {self.max_body_bytes} bytes")
            parts.append(chunk)
        await self._drop()
        return b"".join(parts)

    async def _drop(self) -> None:
        writer, self._writer, self._reader = self._writer, None, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await writer.wait_closed()

    async def aclose(self) -> None:
        await self._drop()
