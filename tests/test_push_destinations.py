"""Each destination against a real receiver (the test's own HTTP server, an OTLP receiver decoding with the official
opentelemetry-proto messages), through the real push buffer (SQLite): delivered in order, kept across an outage and
replayed in order, refusals dropped by rule, Retry-After honoured, one dead destination delays no other."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import trustme

from mapper.clock import FakeClock, SystemClock
from mapper.edge.push.destination import Destination
from mapper.edge.push.http import HttpWriter
from mapper.edge.push.otel import OtelWriter
from mapper.edge.push.spec import destination_key, method_to_json
from mapper.edge.push.wire import encode_sample
from mapper.edge.push.writers import WriterFactory
from mapper.edge.storage.pushbuffer import PushBuffer
from mapper.errors import ConfigError
from mapper.shared.push import DbRedis, PushHttp, PushOtel, PushSample, PushSecrets
from tests.apphelpers import wait_for
from tests.dbservers import RedisServer
from tests.pushhelpers import HttpReceiver, OtlpReceiver

#: The samples carry fixed times in the past: the buffer keeps them whatever the day the tests run.
KEEP_S = 100 * 365 * 86400.0
T0_MS = 1_796_407_083_000  # 2026-12-04 17:58:03 UTC


@pytest.fixture(autouse=True)
def utc() -> Iterator[None]:
    before = os.environ.get("TZ")
    os.environ["TZ"] = "UTC"
    time.tzset()
    yield
    if before is None:
        os.environ.pop("TZ", None)
    else:
        os.environ["TZ"] = before
    time.tzset()


@pytest.fixture
def buffer(tmp_path: Path) -> Iterator[PushBuffer]:
    buf = PushBuffer(tmp_path / "push.db", max_bytes=10**7, max_age_s=KEEP_S)
    yield buf
    buf.close()


def sample(i: int, prop: str = "temperature", device: str = "gpu0", *, counter: bool = False) -> PushSample:
    value = 40 + i
    return PushSample(
        "default", device, prop, str(value), T0_MS + 2000 * i, "", float(value), "celsius", counter, "GPU-1", "edge-1"
    )


def store(buf: PushBuffer, method: PushHttp | PushOtel | DbRedis, samples: list[PushSample]) -> None:
    key = destination_key(method)
    buf.put_many([(key, method_to_json(method), s.ts_ms, encode_sample(s)) for s in samples])


class Running:
    """A destination's task, cancelled and its writer closed at the end."""

    def __init__(self, dest: Destination) -> None:
        self.dest = dest
        self.task = asyncio.create_task(dest.run())

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        await self.dest.aclose()


@pytest.fixture
async def running() -> AsyncIterator[list[Running]]:
    made: list[Running] = []
    yield made
    for r in made:
        await r.close()


def start(made: list[Running], dest: Destination) -> Destination:
    made.append(Running(dest))
    return dest


def http_destination(buf: PushBuffer, method: PushHttp, **kw: object) -> Destination:
    writer = HttpWriter(method, timeout_s=2.0)
    return Destination(destination_key(method), "http", buf, writer, clock=SystemClock(), retry_max_s=1.0, **kw)  # type: ignore[arg-type]


async def test_http_posts_the_frameworks_form_in_order_and_an_outage_loses_nothing(
    buffer: PushBuffer, running: list[Running]
) -> None:
    receiver = HttpReceiver()
    receiver.start()
    try:
        host, port, _ = receiver.url()
        method = PushHttp(host, port, "/gpu/temp")
        dest = start(running, http_destination(buffer, method))
        store(buffer, method, [sample(i) for i in range(5)])
        dest.wake()
        await wait_for(lambda: len(receiver.snapshot()) == 5, what="the first five posts")
        first = receiver.snapshot()[0]
        assert first.path == "/gpu/temp"
        assert first.body == b"temperature=40&time=2026-12-04 17:58:03"
        assert first.headers["content-type"] == "application/x-www-form-urlencoded"
        # (The receiver records a post before it answers: the destination sees the answer a moment later.)
        await wait_for(lambda: dest.delivered == 5 and dest.state == "ok", what="the answers seen")

        receiver.stop()
        store(buffer, method, [sample(i) for i in range(5, 12)])
        dest.wake()
        await wait_for(lambda: dest.state == "down" and dest.failures >= 2, what="the destination seen down")
        assert buffer.backlog(dest.key)[0] == 7, "nothing is lost while it is down"
        assert "127.0.0.1" in dest.last_error

        receiver.start()
        await wait_for(lambda: len(receiver.snapshot()) == 12, timeout_s=15, what="the backlog replayed")
        forms = [p.form for p in receiver.snapshot()]
        assert [f["temperature"] for f in forms] == [str(40 + i) for i in range(12)], "every sample, in order"
        times = [f["time"] for f in forms]
        expected = [time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(T0_MS / 1000 + 2 * i)) for i in range(12)]
        assert times == expected, "each post carries its sample's own time"
        await wait_for(lambda: dest.delivered == 12, what="the last answer seen")
        assert buffer.backlog(dest.key) == (0, 0) and dest.state == "ok"
    finally:
        receiver.stop()


async def test_a_refusal_is_dropped_by_rule_counted_and_the_next_samples_go_on(
    buffer: PushBuffer, running: list[Running]
) -> None:
    with HttpReceiver() as receiver:
        host, port, _ = receiver.url()
        method = PushHttp(host, port, "/t")
        receiver.status = 400
        dest = start(running, http_destination(buffer, method))
        store(buffer, method, [sample(0), sample(1)])
        dest.wake()
        await wait_for(lambda: buffer.backlog(dest.key)[0] == 0, what="both refused")
        assert dest.state == "refused" and "400" in dest.last_error
        assert dest.status().dropped == {"refused": 2}
        receiver.status = 200
        store(buffer, method, [sample(2)])
        dest.wake()
        await wait_for(lambda: len(receiver.snapshot()) == 1, what="the next sample")
        assert receiver.snapshot()[0].form["temperature"] == "42"
        assert receiver.answers == [400, 400, 200], "a refused sample is never sent again"
        await wait_for(lambda: dest.state == "ok", what="the answer seen")


async def test_a_5xx_keeps_the_samples_and_they_go_out_when_it_answers_again(
    buffer: PushBuffer, running: list[Running]
) -> None:
    with HttpReceiver() as receiver:
        host, port, _ = receiver.url()
        method = PushHttp(host, port, "/t")
        receiver.status = 503
        dest = start(running, http_destination(buffer, method))
        store(buffer, method, [sample(0), sample(1)])
        dest.wake()
        await wait_for(lambda: dest.failures >= 2, what="retries")
        assert buffer.backlog(dest.key)[0] == 2 and dest.state == "down"
        receiver.status = 200
        await wait_for(lambda: len(receiver.snapshot()) == 2, what="the kept samples")
        assert [p.form["temperature"] for p in receiver.snapshot()] == ["40", "41"]


async def test_otel_sends_one_request_of_gauges_and_sums_with_the_device_and_sample_times(
    buffer: PushBuffer, running: list[Running]
) -> None:
    with OtlpReceiver() as receiver:
        method = PushOtel(receiver.endpoint)
        writer = OtelWriter(method, timeout_s=2.0, service_version="9.9")
        dest = start(running, Destination(destination_key(method), "otel", buffer, writer, clock=SystemClock()))
        samples = [
            sample(0),
            sample(0, "energy_consumption", counter=True),
            sample(0, "temperature", "gpu1"),
            sample(1),
        ]
        store(buffer, method, samples)
        dest.wake()
        await wait_for(lambda: len(receiver.snapshot()) == 4, what="four data points")
        assert receiver.requests == 1, "one request for the batch"
        assert receiver.content_types == ["application/x-protobuf"]
        points = receiver.snapshot()
        gpu0 = [p for p in points if p.resource["device.id"] == "default/gpu0"]
        assert {p.resource["k8s.node.name"] for p in points} == {"edge-1"}
        assert {p.resource["gpu.uuid"] for p in points} == {"GPU-1"}
        assert gpu0[0].resource["service.name"] == "gpu-mapper"
        temps = [p for p in gpu0 if p.metric == "temperature"]
        assert [(p.time_ms, p.value) for p in temps] == [(T0_MS, 40.0), (T0_MS + 2000, 41.0)]
        assert {(p.kind, p.unit, p.monotonic) for p in temps} == {("gauge", "Cel", False)}
        energy = [p for p in gpu0 if p.metric == "energy_consumption"]
        assert [(p.kind, p.monotonic, p.time_ms) for p in energy] == [("sum", True, T0_MS)]
        assert [p.resource["device.id"] for p in points if p.metric == "temperature"].count("default/gpu1") == 1


@pytest.mark.parametrize("status", [429, 503])
async def test_otel_waits_as_long_as_retry_after_says_then_delivers_in_order(
    buffer: PushBuffer, running: list[Running], status: int
) -> None:
    with OtlpReceiver() as receiver:
        method = PushOtel(receiver.endpoint)
        receiver.status = status
        receiver.extra_headers = {"Retry-After": "2"}
        writer = OtelWriter(method, timeout_s=2.0)
        dest = start(running, Destination(destination_key(method), "otel", buffer, writer, clock=SystemClock()))
        store(buffer, method, [sample(i) for i in range(3)])
        dest.wake()
        await wait_for(lambda: receiver.answers == [status], what="the first answer")
        refused_at = time.monotonic()
        receiver.status = 200
        receiver.extra_headers = {}
        await wait_for(lambda: len(receiver.snapshot()) == 3, timeout_s=10, what="the retry")
        assert time.monotonic() - refused_at >= 1.9, "not before Retry-After"
        assert [p.value for p in receiver.snapshot()] == [40.0, 41.0, 42.0]
        assert receiver.answers == [status, 200]


async def test_otel_refuses_by_rule_a_400_and_drops_the_batch(buffer: PushBuffer, running: list[Running]) -> None:
    with OtlpReceiver() as receiver:
        method = PushOtel(receiver.endpoint)
        receiver.status = 400
        writer = OtelWriter(method, timeout_s=2.0)
        dest = start(running, Destination(destination_key(method), "otel", buffer, writer, clock=SystemClock()))
        store(buffer, method, [sample(0), sample(1)])
        dest.wake()
        await wait_for(lambda: dest.state == "refused", what="the refusal")
        assert buffer.backlog(dest.key)[0] == 0 and dest.status().dropped == {"refused": 2}


async def test_a_destination_that_never_answers_delays_no_other(buffer: PushBuffer, running: list[Running]) -> None:
    # A listening socket nobody accepts from: connections are made, no answer ever comes.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(100)
    try:
        dead = PushHttp("http://127.0.0.1", silent.getsockname()[1], "/dead", timeout_ms=5000)
        with HttpReceiver() as receiver:
            host, port, _ = receiver.url()
            live = PushHttp(host, port, "/live")
            d_dead = start(running, http_destination(buffer, dead))
            d_live = start(running, http_destination(buffer, live))
            store(buffer, dead, [sample(i) for i in range(3)])
            for i in range(3):
                store(buffer, live, [sample(i)])
                d_dead.wake()
                d_live.wake()
                await wait_for(lambda n=i + 1: len(receiver.snapshot()) == n, what="the live destination")  # type: ignore[misc]
            # Every live sample went out while the dead one still waits on its first request (its 5 s bound).
            assert d_dead.failures == 0 and d_dead.delivered == 0, "the live one did not wait for the dead one"
            await wait_for(lambda: d_dead.failures >= 1, timeout_s=20, what="the dead one timing out")
            assert "no answer within 5 s" in d_dead.last_error and buffer.backlog(d_dead.key)[0] == 3
    finally:
        silent.close()


async def test_a_backlog_is_replayed_no_faster_than_the_rate_cap(buffer: PushBuffer, running: list[Running]) -> None:
    with HttpReceiver() as receiver:
        host, port, _ = receiver.url()
        method = PushHttp(host, port, "/t")
        store(buffer, method, [sample(i) for i in range(30)])
        started = time.monotonic()
        start(running, http_destination(buffer, method, rate_per_s=20.0))
        await wait_for(lambda: len(receiver.snapshot()) == 30, what="the replay")
        # One token at start (a batch of one), then 20 a second: 29 more take at least 1.45 s.
        assert time.monotonic() - started >= 1.4
        assert [p.form["temperature"] for p in receiver.snapshot()] == [str(40 + i) for i in range(30)]


async def test_a_backlog_stored_before_a_restart_is_delivered_by_a_new_destination(
    tmp_path: Path, running: list[Running]
) -> None:
    with HttpReceiver() as receiver:
        host, port, _ = receiver.url()
        method = PushHttp(host, port, "/t")
        first = PushBuffer(tmp_path / "push.db", max_bytes=10**6, max_age_s=KEEP_S)
        store(first, method, [sample(i) for i in range(4)])
        first.close()
        again = PushBuffer(tmp_path / "push.db", max_bytes=10**6, max_age_s=KEEP_S)
        try:
            assert again.keys() == {destination_key(method): method_to_json(method)}
            start(running, http_destination(again, method))
            await wait_for(lambda: len(receiver.snapshot()) == 4, what="the old backlog")
            assert [p.form["temperature"] for p in receiver.snapshot()] == ["40", "41", "42", "43"]
        finally:
            for r in running:
                await r.close()
            running.clear()
            again.close()


async def test_https_is_checked_against_the_ca_of_the_mappers_config(
    tmp_path: Path, buffer: PushBuffer, running: list[Running]
) -> None:
    ca = trustme.CA()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(server_context)
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    with HttpReceiver(tls=server_context) as receiver:
        host, port, _ = receiver.url()
        assert host == "https://localhost"
        trusted, untrusted = PushHttp(host, port, "/trusted"), PushHttp(host, port, "/untrusted")
        good = start(running, _destination(buffer, trusted, WriterFactory(timeout_s=2.0, ca_file=str(ca_file))))
        bad = start(running, _destination(buffer, untrusted, WriterFactory(timeout_s=2.0)))
        store(buffer, trusted, [sample(0)])
        store(buffer, untrusted, [sample(0)])
        good.wake()
        bad.wake()
        await wait_for(lambda: len(receiver.snapshot()) == 1, what="the post over https")
        assert receiver.snapshot()[0].path == "/trusted"
        await wait_for(lambda: bad.failures >= 1, what="the untrusted one failing")
        assert "CERTIFICATE_VERIFY_FAILED" in bad.last_error and buffer.backlog(bad.key)[0] == 1, "kept, not lost"
    with OtlpReceiver(tls=server_context) as otlp:
        method = PushOtel(otlp.endpoint)
        assert method.endpoint_url.startswith("https://localhost:")
        factory = WriterFactory(timeout_s=2.0, ca_file=str(ca_file))
        writer = factory(method)
        dest = start(running, Destination(destination_key(method), "otel", buffer, writer, clock=SystemClock()))
        store(buffer, method, [sample(0)])
        dest.wake()
        await wait_for(lambda: len(otlp.snapshot()) == 1, what="the OTLP export over https")
        assert otlp.snapshot()[0].value == 40.0
    with pytest.raises(ConfigError, match=r"push\.caFile"):
        WriterFactory(timeout_s=2.0, ca_file=str(tmp_path / "missing.pem"))


def _destination(buf: PushBuffer, method: PushHttp, factory: WriterFactory) -> Destination:
    return Destination(destination_key(method), "http", buf, factory(method), clock=SystemClock(), retry_max_s=1.0)


async def test_an_otel_receiver_that_never_answers_times_out_and_its_samples_wait(
    buffer: PushBuffer, running: list[Running]
) -> None:
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(10)
    try:
        method = PushOtel(f"http://127.0.0.1:{silent.getsockname()[1]}/v1/metrics")
        writer = OtelWriter(method, timeout_s=1.0)
        dest = start(running, Destination(destination_key(method), "otel", buffer, writer, clock=SystemClock()))
        store(buffer, method, [sample(0), sample(1)])
        dest.wake()
        await wait_for(lambda: dest.failures >= 1, what="the request timing out")
        assert dest.state == "down" and "no answer within 1 s" in dest.last_error
        assert buffer.backlog(dest.key)[0] == 2, "kept for later, not dropped"
    finally:
        silent.close()


class StepClock(FakeClock):
    """A fake clock the destination's own sleeps move forward (its backoff and pacing take no real time)."""

    async def sleep(self, seconds: float) -> None:
        self.advance(seconds)
        await asyncio.sleep(0)


def warnings_of(caplog: pytest.LogCaptureFixture, words: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and words in r.getMessage()]


async def test_a_refusal_and_an_outage_are_logged_once_a_minute(
    buffer: PushBuffer, running: list[Running], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="mapper.edge.push.destination")
    clock = StepClock()
    with HttpReceiver() as receiver:
        host, port, _ = receiver.url()
        method = PushHttp(host, port, "/t")
        writer = HttpWriter(method, timeout_s=2.0)
        dest = start(
            running,
            Destination(
                destination_key(method), "http", buffer, writer, clock=clock, retry_max_s=4.0, sleep=clock.sleep
            ),
        )
        # Refused (401): each sample dropped by rule; five within a minute make one line, counting the first.
        receiver.status = 401
        for i in range(5):
            store(buffer, method, [sample(i)])
            dest.wake()
            await wait_for(lambda n=i + 1: dest.status().dropped.get("refused") == n, what=f"refusal {i + 1}")  # type: ignore[misc]
        assert len(warnings_of(caplog, "dropped by rule")) == 1
        assert "refused 1 samples" in warnings_of(caplog, "dropped by rule")[0] and "401" in dest.last_error
        # A minute later the next refusal is logged again, with what was refused meanwhile.
        clock.advance(61)
        store(buffer, method, [sample(5)])
        dest.wake()
        await wait_for(lambda: dest.status().dropped.get("refused") == 6, what="the sixth refusal")
        refused_lines = warnings_of(caplog, "dropped by rule")
        assert len(refused_lines) == 2 and "refused 5 samples" in refused_lines[1]
        assert receiver.answers == [401] * 6, "a refused sample is never sent again"

    # Down (nothing listens): retried with a backoff up to 4 s; logged at the first failure and once a minute after.
    store(buffer, method, [sample(6)])
    dest.wake()
    await wait_for(lambda: dest.failures >= 40, what="forty failed tries")
    assert clock.monotonic() - 1000.0 >= 61 + 60, "the fake minute went by"
    down_lines = warnings_of(caplog, "kept")
    # 40 tries: 1 + 2 + 4 s and then 4 s each, about 160 s of the fake clock: logged at the first and each minute.
    elapsed_s = clock.monotonic() - 1000.0 - 61
    assert 2 <= len(down_lines) <= 1 + elapsed_s // 60 + 1, (len(down_lines), elapsed_s)
    assert buffer.backlog(dest.key)[0] == 1, "kept while down"


async def test_a_batch_a_db_refused_in_part_drops_only_the_refused_and_counts_the_rest_delivered(
    tmp_path: Path, buffer: PushBuffer, running: list[Running]
) -> None:
    redis = RedisServer(tmp_path, password="pw")
    redis.start()
    try:
        redis.cli("SET", "gpu1", "a string, not a sorted set")  # gpu1's samples: WRONGTYPE, refused
        method = DbRedis(addr=f"127.0.0.1:{redis.port}")
        writer = WriterFactory(timeout_s=2.0, secrets=PushSecrets(password="pw"))(method)
        dest = start(running, Destination(destination_key(method), "redis", buffer, writer, clock=SystemClock()))
        samples = [sample(i, device="gpu1" if i % 3 == 1 else "gpu0") for i in range(6)]
        store(buffer, method, samples)
        dest.wake()
        await wait_for(lambda: buffer.backlog(dest.key)[0] == 0, what="the batch written or refused")
        written = [s for s in samples if s.device == "gpu0"]
        assert [score for _, score in redis.zrange("gpu0")] == [s.ts_ms for s in written]
        assert dest.delivered == len(written) == 4
        assert dest.status().dropped == {"refused": 2}
        assert dest.state == "refused" and "WRONGTYPE" in dest.last_error
    finally:
        redis.stop()
