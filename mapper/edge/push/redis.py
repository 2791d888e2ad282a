"""``dbMethod.redis``: each sample a member of the device's sorted set, as KubeEdge's framework writes it.

Per sample ``ZADD <device name> <time in ms> <member>``, the member the compact JSON of the framework's data
model with Go's field names in Go's order: ``{"DeviceName","PropertyName","Namespace","Value","Type",
"TimeStamp"}`` (Value a string, TimeStamp the sample's ms; ``<``, ``>``, ``&``, U+2028 and U+2029 escaped as Go's
encoding/json does, so the bytes are the framework's). The key is the device's name alone (not its namespace):
every property of a device shares one sorted set. ``AUTH <PASSWORD>`` when a password is set, ``SELECT db`` when
``db`` is not 0. ``poolsize`` and ``minIdleConns`` are not used: one connection per writer, its commands
pipelined.

The client is our own, RESP2 over asyncio streams (the four commands we send need no library), every wait
bounded by ``timeout_s``: the connect, each flush, each reply. A connection that fails or times out is dropped
and a ``TransientError`` raised; so is a reply Redis gives while it cannot write for now (LOADING, BUSY, OOM,
MISCONF, READONLY, MASTERDOWN, TRYAGAIN, ...). A wrong password, a password the server needs and we lack
(NOAUTH), a db it does not have, or a key holding another type is a ``PermanentError`` with Redis's message
(WRONGTYPE refuses that key's samples only: the others are written, and a ``PartlyRefusedError`` says which).

Idempotence: a retry sends every ZADD of the batch again; a member already in the set with the same score is
left as it is (the same sample is the same bytes), so a batch that partly landed is written once.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass

from mapper.edge.push.address import host_port
from mapper.errors import PartlyRefusedError, PermanentError, TransientError, short_repr
from mapper.shared.push import DbRedis, PushSample, PushSecrets, PushWriter

DEFAULT_PORT = 6379
#: Commands per pipeline round (flush, then read their replies).
PIPELINE_COMMANDS = 1000
#: The longest reply line read (a reply to our commands is a few bytes).
MAX_LINE_BYTES = 64 * 1024
#: Replies that mean "not now": the same command can succeed later.
TRANSIENT_CODES = frozenset(
    {"LOADING", "BUSY", "OOM", "MISCONF", "READONLY", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN", "NOREPLICAS"}
)
#: AUTH refused because the server has no password: it takes our commands anyway (go-redis would stop here).
_NO_PASSWORD_SET = ("without any password configured", "no password is set")

_GO_JSON_ESCAPES = str.maketrans(
    {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}
)


def make_writer(method: DbRedis, secrets: PushSecrets, *, timeout_s: float) -> PushWriter:
    """The writer for one redis client config; the password is ``secrets.password``. A config no connection can
    be made from is a ``PermanentError``."""
    return RedisWriter(method, secrets.password, timeout_s=timeout_s)


def member_json(sample: PushSample) -> str:
    """The framework's member for ``sample``: its data model as Go's ``json.Marshal`` writes it."""
    model = {
        "DeviceName": sample.device,
        "PropertyName": sample.property,
        "Namespace": sample.namespace,
        "Value": sample.value,
        "Type": sample.kind,
        "TimeStamp": sample.ts_ms,
    }
    return json.dumps(model, ensure_ascii=False, separators=(",", ":")).translate(_GO_JSON_ESCAPES)


@dataclass(frozen=True)
class ReplyError:
    """A Redis error reply (``-CODE message``)."""

    message: str

    @property
    def code(self) -> str:
        return self.message.split(" ", 1)[0]


Reply = str | int | bytes | None | ReplyError | list["Reply"]


class ProtocolError(Exception):
    """The peer does not speak RESP."""


def encode_command(args: Sequence[bytes]) -> bytes:
    """One command as a RESP array of bulk strings."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        out.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    return b"".join(out)


async def read_reply(reader: asyncio.StreamReader) -> Reply:
    """One RESP2 reply. ``asyncio.IncompleteReadError`` when the connection ends in it; ``ProtocolError`` for
    bytes that are no reply."""
    line = await reader.readuntil(b"\r\n")
    kind, rest = line[:1], line[1:-2]
    try:
        if kind == b"+":
            return rest.decode("utf-8", errors="replace")
        if kind == b"-":
            return ReplyError(rest.decode("utf-8", errors="replace"))
        if kind == b":":
            return int(rest)
        if kind == b"$":
            size = int(rest)
            if size < 0:
                return None
            return (await reader.readexactly(size + 2))[:-2]
        if kind == b"*":
            count = int(rest)
            if count < 0:
                return None
            return [await read_reply(reader) for _ in range(count)]
    except ValueError:
        pass
    raise ProtocolError(f"not a RESP reply: {short_repr(line)}")


class RedisWriter:
    """One redis client config's writer (see the module docstring); build it with ``make_writer``."""

    key: str

    def __init__(self, method: DbRedis, password: str | None, *, timeout_s: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self._host, self._port = host_port(method.addr, default_port=DEFAULT_PORT, what="redis")
        if method.db < 0:
            raise PermanentError(f"redis db {method.db}: not a database number", reason="bad-config")
        self.key = f"redis {method.addr.strip()}/{method.db}"
        self._db = method.db
        self._password = password
        self._timeout_s = timeout_s
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._lock = asyncio.Lock()
        self._closed = False

    def __repr__(self) -> str:
        return f"RedisWriter({self.key!r})"

    async def write(self, samples: Sequence[PushSample]) -> None:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")
        commands: list[list[bytes]] = []
        owners: list[PushSample] = []
        refused: list[str] = []
        positions: list[int] = []
        for i, sample in enumerate(samples):
            try:
                member = member_json(sample).encode("utf-8")
                commands.append([b"ZADD", sample.device.encode("utf-8"), b"%d" % sample.ts_ms, member])
                owners.append(sample)
            except UnicodeEncodeError as exc:
                refused.append(f"{_name(sample)}: {exc.reason}")
                positions.append(i)
        async with self._lock:
            replies: list[Reply] = []
            for start in range(0, len(commands), PIPELINE_COMMANDS):
                replies += await self._pipeline(commands[start : start + PIPELINE_COMMANDS])
        failed = [
            (sample, reply) for sample, reply in zip(owners, replies, strict=True) if isinstance(reply, ReplyError)
        ]
        for _sample, reply in failed:
            if reply.code in TRANSIENT_CODES:
                raise TransientError(f"{self.key}: {short_repr(reply.message, 200)}", reason=f"redis-{reply.code}")
        for _sample, reply in failed:
            if reply.code in ("NOAUTH", "WRONGPASS"):
                await self._drop()
                raise PermanentError(f"{self.key}: {short_repr(reply.message, 200)}", reason="auth")
        refused += [f"{_name(sample)}: {short_repr(reply.message, 200)}" for sample, reply in failed]
        failed_ids = {id(sample) for sample, _ in failed}
        positions += [i for i, sample in enumerate(samples) if id(sample) in failed_ids]
        if refused:
            code = failed[0][1].code if failed else ""
            raise PartlyRefusedError(
                f"{self.key}: {len(refused)} of {len(samples)} samples refused (the rest written): {refused[0]}",
                refused=positions,
                reason=(f"redis-{code}" if code.isascii() and code.isalnum() else "refused") if failed else "bad-value",
            )

    async def aclose(self) -> None:
        self._closed = True
        await self._drop()

    async def _drop(self) -> None:
        streams, self._streams = self._streams, None
        if streams is not None:
            streams[1].close()
            try:
                async with asyncio.timeout(self._timeout_s):
                    await streams[1].wait_closed()
            except (OSError, TimeoutError):
                pass

    async def _pipeline(self, commands: list[list[bytes]]) -> list[Reply]:
        """Send ``commands`` and read their replies; the connection dropped on anything that breaks off. A kept
        connection the server has closed meanwhile (a restart) fails on its first use: once, the commands go
        again on a new one (ZADD of the same member and score changes nothing)."""
        reused = self._streams is not None
        try:
            try:
                return await self._send(commands)
            except (asyncio.IncompleteReadError, ConnectionResetError, BrokenPipeError):
                if not reused:
                    raise
                await self._drop()
                return await self._send(commands)
        except TimeoutError:
            await self._drop()
            raise TransientError(f"{self.key}: no answer within {self._timeout_s}s", reason="timeout") from None
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            await self._drop()
            raise TransientError(f"{self.key}: {type(exc).__name__}: {exc}", reason="unreachable") from None
        except ProtocolError as exc:
            await self._drop()
            raise PermanentError(f"{self.key}: {exc}", reason="not-redis") from None
        except BaseException:
            await self._drop()
            raise

    async def _send(self, commands: list[list[bytes]]) -> list[Reply]:
        if self._streams is None:
            self._streams = await self._connect()
        reader, writer = self._streams
        return await self._exchange(reader, writer, commands)

    async def _exchange(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, commands: list[list[bytes]]
    ) -> list[Reply]:
        writer.write(b"".join(encode_command(command) for command in commands))
        async with asyncio.timeout(self._timeout_s):
            await writer.drain()
        replies: list[Reply] = []
        for _ in commands:
            async with asyncio.timeout(self._timeout_s):
                replies.append(await read_reply(reader))
        return replies

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        async with asyncio.timeout(self._timeout_s):
            reader, writer = await asyncio.open_connection(self._host, self._port, limit=MAX_LINE_BYTES)
        try:
            setup: list[list[bytes]] = []
            if self._password:
                setup.append([b"AUTH", self._password.encode("utf-8")])
            if self._db:
                setup.append([b"SELECT", b"%d" % self._db])
            replies = await self._exchange(reader, writer, setup) if setup else []
        except BaseException:
            writer.close()
            raise
        for command, reply in zip(setup, replies, strict=True):
            if not isinstance(reply, ReplyError):
                continue
            if command[0] == b"AUTH" and any(text in reply.message for text in _NO_PASSWORD_SET):
                continue
            writer.close()
            message = f"{self.key}: {command[0].decode()}: {short_repr(reply.message, 200)}"
            if reply.code in TRANSIENT_CODES:
                raise TransientError(message, reason=f"redis-{reply.code}")
            raise PermanentError(message, reason="auth" if command[0] == b"AUTH" else "bad-db")
        return reader, writer


def _name(sample: PushSample) -> str:
    return f"{sample.namespace}/{sample.device}/{sample.property}@{sample.ts_ms}"
