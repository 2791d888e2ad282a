"""dbMethod.redis against a real redis-server: the framework's key, member and score, read back by redis-cli; an
outage, a pipeline cut after Redis did it, refusals (password, db, a key of another type)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mapper.edge.push import redis as push_redis
from mapper.errors import PartlyRefusedError, PermanentError, TransientError
from mapper.shared.push import DbRedis, PushSample, PushSecrets, PushWriter
from tests.dbservers import CuttingProxy, RedisServer

T0_MS = 1_796_400_000_123
TIMEOUT_S = 3.0


def sample(prop: str, value: str, ts_ms: int, *, device: str = "edge-1-gpu0", kind: str = "int") -> PushSample:
    return PushSample(namespace="default", device=device, property=prop, value=value, ts_ms=ts_ms, kind=kind)


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def writer_for(
    server: RedisServer, *, db: int = 0, password: str | None = "redis-pw", port: int | None = None
) -> PushWriter:
    method = DbRedis(addr=f"127.0.0.1:{port or server.port}", db=db)
    return push_redis.make_writer(method, PushSecrets(password=password), timeout_s=TIMEOUT_S)


async def test_samples_are_members_of_the_device_set_with_their_own_time_as_score(redis: RedisServer) -> None:
    writer = writer_for(redis)
    samples = [
        sample("temperature", "41", T0_MS),
        sample("power_usage", "182.6", T0_MS + 1, kind="float"),
        sample("temperature", "42", T0_MS + 2000),
        sample("temperature", "40", T0_MS, device="edge-1-gpu1"),
    ]
    try:
        await writer.write(samples)
    finally:
        await writer.aclose()
    assert writer.key == f"redis 127.0.0.1:{redis.port}/0"
    # The framework's bytes, spelled out here: Go's field names and order, compact, TimeStamp in ms.
    assert redis.zrange("edge-1-gpu0") == [
        (
            '{"DeviceName":"edge-1-gpu0","PropertyName":"temperature","Namespace":"default","Value":"41",'
            f'"Type":"int","TimeStamp":{T0_MS}}}',
            T0_MS,
        ),
        (
            '{"DeviceName":"edge-1-gpu0","PropertyName":"power_usage","Namespace":"default","Value":"182.6",'
            f'"Type":"float","TimeStamp":{T0_MS + 1}}}',
            T0_MS + 1,
        ),
        (
            '{"DeviceName":"edge-1-gpu0","PropertyName":"temperature","Namespace":"default","Value":"42",'
            f'"Type":"int","TimeStamp":{T0_MS + 2000}}}',
            T0_MS + 2000,
        ),
    ]
    assert redis.zrange("edge-1-gpu1") == [
        (
            '{"DeviceName":"edge-1-gpu1","PropertyName":"temperature","Namespace":"default","Value":"40",'
            f'"Type":"int","TimeStamp":{T0_MS}}}',
            T0_MS,
        )
    ]
    # The key is the device's name alone: nothing under namespace/name.
    assert sorted(redis.cli("KEYS", "*").split("\n")) == ["edge-1-gpu0", "edge-1-gpu1"]


async def test_the_member_escapes_as_go_does(redis: RedisServer) -> None:
    writer = writer_for(redis)
    try:
        await writer.write([sample("name", 'a<b>&"c"\u2028é', T0_MS, kind="string")])
    finally:
        await writer.aclose()
    [(member, score)] = redis.zrange("edge-1-gpu0")
    assert member == (
        '{"DeviceName":"edge-1-gpu0","PropertyName":"name","Namespace":"default",'
        '"Value":"a\\u003cb\\u003e\\u0026\\"c\\"\\u2028é","Type":"string",'
        f'"TimeStamp":{T0_MS}}}'
    )
    assert score == T0_MS


async def test_db_is_selected(redis: RedisServer) -> None:
    writer = writer_for(redis, db=3)
    try:
        await writer.write([sample("temperature", "41", T0_MS)])
    finally:
        await writer.aclose()
    assert [score for _, score in redis.zrange("edge-1-gpu0", db=3)] == [T0_MS]
    assert redis.zrange("edge-1-gpu0", db=0) == []


async def test_server_down_is_transient_and_the_retry_writes_each_sample_once(redis: RedisServer) -> None:
    writer = writer_for(redis)
    first = [sample("temperature", str(40 + i), T0_MS + i * 1000) for i in range(3)]
    later = [sample("temperature", str(50 + i), T0_MS + (3 + i) * 1000) for i in range(3)]
    try:
        await writer.write(first)
        redis.stop()
        started = time.monotonic()
        with pytest.raises(TransientError) as caught:
            await writer.write(later)
        assert time.monotonic() - started < TIMEOUT_S + 1
        assert caught.value.reason == "unreachable"
        redis.start()  # same port, the append-only file brings back what was written
        await writer.write(later)
        await writer.write(later)  # a retry of what already landed changes nothing
    finally:
        await writer.aclose()
    got = redis.zrange("edge-1-gpu0")
    assert [score for _, score in got] == [T0_MS + i * 1000 for i in range(6)]
    assert [member.split('"Value":"')[1].split('"')[0] for member, _ in got] == ["40", "41", "42", "50", "51", "52"]


async def test_a_restart_between_writes_costs_no_error(redis: RedisServer) -> None:
    """The kept connection died with the old server: the next write goes on a new one, not into an error."""
    writer = writer_for(redis)
    try:
        await writer.write([sample("temperature", "41", T0_MS)])
        redis.stop()
        redis.start()
        await writer.write([sample("temperature", "42", T0_MS + 1000)])
    finally:
        await writer.aclose()
    assert [score for _, score in redis.zrange("edge-1-gpu0")] == [T0_MS, T0_MS + 1000]


async def test_a_pipeline_cut_after_redis_did_it_is_retried_without_duplicates(redis: RedisServer) -> None:
    proxy = CuttingProxy(redis.port)
    writer = writer_for(redis, port=proxy.port)
    samples = [sample("temperature", str(i), T0_MS + i) for i in range(50)]
    try:
        proxy.cut_after(b"ZADD")
        with pytest.raises(TransientError):
            await writer.write(samples)
        assert proxy.cuts == 1
        # Redis did the commands whose answers never came back: the retry sends them all again.
        landed = int(redis.cli("ZCARD", "edge-1-gpu0"))
        assert landed > 0
        await writer.write(samples)
    finally:
        await writer.aclose()
        proxy.close()
    assert [score for _, score in redis.zrange("edge-1-gpu0")] == [T0_MS + i for i in range(50)]


async def test_wrong_or_missing_password_is_permanent(redis: RedisServer) -> None:
    for password, words in (("not-it", "WRONGPASS"), (None, "NOAUTH")):
        writer = writer_for(redis, password=password)
        try:
            with pytest.raises(PermanentError) as caught:
                await writer.write([sample("temperature", "41", T0_MS)])
        finally:
            await writer.aclose()
        assert caught.value.reason == "auth"
        assert words in str(caught.value)
        assert "redis-pw" not in str(caught.value)
    assert redis.zrange("edge-1-gpu0") == []


async def test_a_password_for_a_server_without_one_is_not_fatal(tmp_path: Path) -> None:
    server = RedisServer(tmp_path, password=None)
    server.start()
    writer = writer_for(server, password="set-for-mysql")
    try:
        await writer.write([sample("temperature", "41", T0_MS)])
    finally:
        await writer.aclose()
        scores = [score for _, score in server.zrange("edge-1-gpu0")]
        server.stop()
    assert scores == [T0_MS]


async def test_a_key_of_another_type_refuses_its_samples_only(redis: RedisServer) -> None:
    redis.cli("SET", "edge-1-gpu1", "a string, not a sorted set")
    writer = writer_for(redis)
    samples = [
        sample("temperature", "41", T0_MS),
        sample("temperature", "40", T0_MS, device="edge-1-gpu1"),
        sample("temperature", "42", T0_MS + 1000),
    ]
    try:
        with pytest.raises(PermanentError) as caught:
            await writer.write(samples)
    finally:
        await writer.aclose()
    assert caught.value.reason == "redis-WRONGTYPE"
    assert "1 of 3" in str(caught.value) and "default/edge-1-gpu1/temperature" in str(caught.value)
    assert isinstance(caught.value, PartlyRefusedError) and caught.value.refused == (1,), "which was refused"
    assert [score for _, score in redis.zrange("edge-1-gpu0")] == [T0_MS, T0_MS + 1000]
    assert redis.cli("GET", "edge-1-gpu1") == "a string, not a sorted set"


async def test_a_db_the_server_lacks_is_permanent(redis: RedisServer) -> None:
    writer = writer_for(redis, db=99)
    try:
        with pytest.raises(PermanentError) as caught:
            await writer.write([sample("temperature", "41", T0_MS)])
    finally:
        await writer.aclose()
    assert caught.value.reason == "bad-db"
    assert "DB index is out of range" in str(caught.value)


@pytest.mark.parametrize("addr", ["", "host:", "host:99999", "host:port", "[::1", "a b:1", "user@host:1"])
def test_an_addr_no_connection_can_be_made_from_is_permanent(addr: str) -> None:
    with pytest.raises(PermanentError) as caught:
        push_redis.make_writer(DbRedis(addr=addr), PushSecrets(), timeout_s=1.0)
    assert caught.value.reason == "bad-addr"


async def test_a_server_that_never_answers_times_out() -> None:
    silent = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(silent.accept()[0]), daemon=True).start()
    method = DbRedis(addr=f"127.0.0.1:{silent.getsockname()[1]}")
    writer = push_redis.make_writer(method, PushSecrets(), timeout_s=0.5)
    started = time.monotonic()
    try:
        with pytest.raises(TransientError) as caught:
            await writer.write([sample("temperature", "41", T0_MS)])
    finally:
        await writer.aclose()
        silent.close()
        for sock in accepted:
            sock.close()
    assert caught.value.reason == "timeout"
    assert 0.4 < time.monotonic() - started < 2.0


async def test_writes_are_serialised_in_order(redis: RedisServer) -> None:
    """Two writes at once on one writer do not interleave their pipelines (each gets its own replies)."""
    writer = writer_for(redis)
    a = [sample("temperature", str(i), T0_MS + i) for i in range(200)]
    b = [sample("power_usage", str(i), T0_MS + i) for i in range(200)]
    try:
        await asyncio.gather(writer.write(a), writer.write(b))
    finally:
        await writer.aclose()
    assert int(redis.cli("ZCARD", "edge-1-gpu0")) == 400
