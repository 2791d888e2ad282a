"""dbMethod.influxdb2 against a real VictoriaMetrics (it takes ``/api/v2/write``), through a recording proxy that
shows what VictoriaMetrics does not (the query, the token, the string field) and stands in for InfluxDB's answers
VictoriaMetrics never gives (401 for a wrong token, 400, 429, 503)."""

from __future__ import annotations

import socket
import ssl
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme

from mapper.edge.push import influxdb2 as push_influxdb2
from mapper.errors import PartlyRefusedError, PermanentError, TransientError
from mapper.shared.push import DbInfluxdb2, PushSample, PushSecrets, PushWriter
from tests.dbservers import RecordingProxy, VictoriaMetrics

TOKEN = "influx-token"
TIMEOUT_S = 3.0


def sample(value: str, ts_ms: int, number: float | None = None) -> PushSample:
    return PushSample(
        namespace="default", device="edge-1-gpu0", property="temperature", value=value, ts_ms=ts_ms, number=number
    )


def now_ms() -> int:
    """Recent times: VictoriaMetrics keeps what falls in its retention (100 years here), not what is far ahead."""
    return (time.time_ns() // 1_000_000) - 60_000


@pytest.fixture(scope="module")
def vm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VictoriaMetrics]:
    server = VictoriaMetrics(tmp_path_factory.mktemp("vm"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def proxy(vm: VictoriaMetrics) -> Iterator[RecordingProxy]:
    recorder = RecordingProxy(vm.url)
    recorder.start()
    try:
        yield recorder
    finally:
        recorder.stop()


@pytest.fixture
def measurement() -> str:
    """A measurement of the test's own (one VictoriaMetrics serves the module)."""
    return f"gpu{uuid.uuid4().hex[:8]}"


def method_for(url: str, measurement: str, **tags: str) -> DbInfluxdb2:
    return DbInfluxdb2(
        url=url, org="kubeedge", bucket="gpu", measurement=measurement, field_key="temperature", tags=tags
    )


def writer_for(url: str, measurement: str, *, token: str | None = TOKEN, **kwargs: object) -> PushWriter:
    method = method_for(url, measurement, node="edge-1", uuid="GPU-1")
    return push_influxdb2.make_writer(method, PushSecrets(token=token), timeout_s=TIMEOUT_S, **kwargs)  # type: ignore[arg-type]


def stored(vm: VictoriaMetrics, measurement: str, count: int) -> list[tuple[int, float]]:
    """The (ms, value) pairs of ``<measurement>_temperature`` (its one series, labels checked)."""
    series = vm.wait_samples(f'{{__name__="{measurement}_temperature"}}', count)
    if not series:
        return []
    [one] = series
    assert one["metric"] == {"__name__": f"{measurement}_temperature", "node": "edge-1", "uuid": "GPU-1"}
    return list(zip(one["timestamps"], one["values"], strict=True))


async def test_samples_go_in_one_request_as_string_fields_with_their_own_times(
    vm: VictoriaMetrics, proxy: RecordingProxy, measurement: str
) -> None:
    t0 = now_ms()
    values = ["41", "42.5", "40", "182.6"]
    writer = writer_for(proxy.url, measurement)
    try:
        await writer.write([sample(v, t0 + i * 1000) for i, v in enumerate(values)])
    finally:
        await writer.aclose()
    [request] = proxy.requests
    assert request.path == "/api/v2/write?org=kubeedge&bucket=gpu&precision=ns"
    assert request.headers["Authorization"] == f"Token {TOKEN}"
    assert request.body.decode() == "\n".join(
        f'{measurement},node=edge-1,uuid=GPU-1 temperature="{v}" {(t0 + i * 1000) * 1_000_000}'
        for i, v in enumerate(values)
    )
    assert stored(vm, measurement, 4) == [(t0 + i * 1000, float(v)) for i, v in enumerate(values)]


async def test_numeric_writes_numbers_as_floats_and_text_as_strings(
    vm: VictoriaMetrics, proxy: RecordingProxy, measurement: str
) -> None:
    t0 = now_ms()
    writer = writer_for(proxy.url, measurement, numeric=True)
    try:
        await writer.write([sample("41", t0, 41), sample("0.25", t0 + 1000, 0.25), sample("n/a", t0 + 2000)])
    finally:
        await writer.aclose()
    [request] = proxy.requests
    assert request.body.decode().split("\n") == [
        f"{measurement},node=edge-1,uuid=GPU-1 temperature=41.0 {t0 * 1_000_000}",
        f"{measurement},node=edge-1,uuid=GPU-1 temperature=0.25 {(t0 + 1000) * 1_000_000}",
        f'{measurement},node=edge-1,uuid=GPU-1 temperature="n/a" {(t0 + 2000) * 1_000_000}',
    ]
    # VictoriaMetrics stores a non-numeric string as 0
    assert stored(vm, measurement, 3) == [(t0, 41.0), (t0 + 1000, 0.25), (t0 + 2000, 0.0)]


async def test_names_and_values_are_escaped(vm: VictoriaMetrics, proxy: RecordingProxy, measurement: str) -> None:
    t0 = now_ms()
    method = DbInfluxdb2(
        url=proxy.url + "/",
        org="kube edge",
        bucket="gpu&x",
        measurement=measurement,
        field_key="temp c",
        tags={"zone": "rack 1,row=2", "empty": ""},
    )
    writer = push_influxdb2.make_writer(method, PushSecrets(), timeout_s=TIMEOUT_S)
    try:
        await writer.write([PushSample("default", "edge-1-gpu0", "name", 'say "hi" \\ 5', t0)])
    finally:
        await writer.aclose()
    [request] = proxy.requests
    assert request.path == "/api/v2/write?org=kube+edge&bucket=gpu%26x&precision=ns"
    assert "Authorization" not in request.headers  # no token: no header, as the framework's client
    assert request.body.decode() == (
        f'{measurement},zone=rack\\ 1\\,row\\=2 temp\\ c="say \\"hi\\" \\\\ 5" {t0 * 1_000_000}'
    )
    [series] = vm.wait_samples(f'{{__name__="{measurement}_temp c"}}', 1)
    assert series["metric"] == {"__name__": f"{measurement}_temp c", "zone": "rack 1,row=2"}


async def test_server_down_is_transient_and_the_retry_writes_each_sample_once(tmp_path: Path, measurement: str) -> None:
    server = VictoriaMetrics(tmp_path)
    server.start()
    try:
        writer = writer_for(server.url, measurement)
        t0 = now_ms()
        first = [sample(str(40 + i), t0 + i * 1000) for i in range(3)]
        later = [sample(str(50 + i), t0 + (3 + i) * 1000) for i in range(3)]
        try:
            await writer.write(first)
            server.stop()
            started = time.monotonic()
            with pytest.raises(TransientError) as caught:
                await writer.write(later)
            assert time.monotonic() - started < TIMEOUT_S + 1
            assert caught.value.reason == "unreachable"
            server.start()  # same port and data
            await writer.write(later)
        finally:
            await writer.aclose()
        got = stored(server, measurement, 6)
    finally:
        server.stop()
    assert got == [(t0 + i * 1000, float(v)) for i, v in enumerate([40, 41, 42, 50, 51, 52])]


async def test_a_restart_between_writes_costs_no_error(tmp_path: Path, measurement: str) -> None:
    """The kept-alive connection died with the old server: the next write goes on a new one, not into an error."""
    server = VictoriaMetrics(tmp_path)
    server.start()
    try:
        writer = writer_for(server.url, measurement)
        t0 = now_ms()
        try:
            await writer.write([sample("41", t0)])
            server.stop()
            server.start()
            await writer.write([sample("42", t0 + 1000)])
        finally:
            await writer.aclose()
        got = stored(server, measurement, 2)
    finally:
        server.stop()
    assert got == [(t0, 41.0), (t0 + 1000, 42.0)]


async def test_a_write_that_failed_part_way_is_retried_without_what_landed(
    vm: VictoriaMetrics, proxy: RecordingProxy, measurement: str
) -> None:
    t0 = now_ms()
    samples = [sample(str(40 + i), t0 + i * 1000) for i in range(5)]
    writer = writer_for(proxy.url, measurement, batch_lines=2)
    proxy.answers = [None, (503, {"Retry-After": "7"}, b"overloaded")]
    try:
        with pytest.raises(TransientError) as caught:
            await writer.write(samples)
        await writer.write(samples)  # the framework retries the whole batch
    finally:
        await writer.aclose()
    assert caught.value.retry_after_s == 7.0
    assert caught.value.reason == "http-503"
    sent = [[line.split(" ")[-1] for line in r.body.decode().split("\n")] for r in proxy.requests]
    ns = [str(s.ts_ms * 1_000_000) for s in samples]
    assert sent == [ns[0:2], ns[2:4], ns[2:4], ns[4:5]]
    assert [r.status for r in proxy.requests] == [204, 503, 204, 204]
    # VictoriaMetrics keeps duplicates: each sample is there once
    assert stored(vm, measurement, 5) == [(s.ts_ms, float(s.value)) for s in samples]


@pytest.mark.parametrize(
    ("status", "headers", "body", "retry_after_s"),
    [
        (429, {"Retry-After": "3"}, b'{"code":"too many requests","message":"slow down"}', 3.0),
        (503, {}, b"", 1.0),
        (500, {"Retry-After": "Fri, 01 Jan 1999 00:00:00 GMT"}, b"", 0.0),  # a date in the past: now
        (408, {}, b"", 1.0),
    ],
)
async def test_busy_or_failing_servers_are_transient(
    proxy: RecordingProxy,
    measurement: str,
    status: int,
    headers: dict[str, str],
    body: bytes,
    retry_after_s: float,
) -> None:
    proxy.answers = [(status, headers, body)]
    writer = writer_for(proxy.url, measurement)
    try:
        with pytest.raises(TransientError) as caught:
            await writer.write([sample("41", now_ms())])
    finally:
        await writer.aclose()
    assert caught.value.reason == f"http-{status}"
    assert caught.value.retry_after_s == retry_after_s


@pytest.mark.parametrize(
    ("status", "body", "words"),
    [
        (400, b'{"code":"invalid","message":"unable to parse \'x\': missing fields"}', "missing fields"),
        (404, b'{"code":"not found","message":"bucket \\"gpu\\" not found"}', 'bucket "gpu" not found'),
        (413, b"too large", "too large"),
        (422, b'{"code":"unprocessable entity","message":"failure writing points: field type conflict"}', "conflict"),
        (501, b"no", "HTTP 501"),
    ],
)
async def test_refusals_are_permanent_and_name_the_servers_message(
    proxy: RecordingProxy, measurement: str, status: int, body: bytes, words: str
) -> None:
    proxy.answers = [(status, {"Content-Type": "application/json"}, body)]
    writer = writer_for(proxy.url, measurement)
    try:
        with pytest.raises(PermanentError) as caught:
            await writer.write([sample("41", now_ms())])
    finally:
        await writer.aclose()
    assert caught.value.reason == f"http-{status}"
    assert words in str(caught.value)


async def test_a_wrong_token_is_permanent_and_never_printed(
    vm: VictoriaMetrics, proxy: RecordingProxy, measurement: str
) -> None:
    proxy.token = TOKEN
    writer = writer_for(proxy.url, measurement, token="wrong-token")
    try:
        with pytest.raises(PermanentError) as caught:
            await writer.write([sample("41", now_ms())])
    finally:
        await writer.aclose()
    assert caught.value.reason == "http-401"
    assert "unauthorized access" in str(caught.value)
    assert "wrong-token" not in str(caught.value) and "wrong-token" not in repr(writer)
    assert vm.export(f'{{__name__="{measurement}_temperature"}}') == []


async def test_a_sample_no_line_can_carry_is_refused_alone(
    vm: VictoriaMetrics, proxy: RecordingProxy, measurement: str
) -> None:
    t0 = now_ms()
    writer = writer_for(proxy.url, measurement, numeric=True)
    samples = [
        sample("41", t0, 41),
        sample("nan", t0 + 1000, float("nan")),
        sample("two\nlines", t0 + 2000),
        sample("43", t0 + 3000, 43),
    ]
    try:
        with pytest.raises(PermanentError) as caught:
            await writer.write(samples)
    finally:
        await writer.aclose()
    assert caught.value.reason == "bad-value"
    assert "2 of 4 samples refused" in str(caught.value) and "not a finite number" in str(caught.value)
    assert isinstance(caught.value, PartlyRefusedError) and caught.value.refused == (1, 2), "which were refused"
    assert stored(vm, measurement, 2) == [(t0, 41.0), (t0 + 3000, 43.0)]


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"url": "ftp://host:8086"}, "bad-url"),
        ({"url": "http://:8086"}, "bad-url"),
        ({"url": "http://host:http"}, "bad-url"),
        ({"url": "http://host:8086/?x=1"}, "bad-url"),
        ({"url": "http://user:pw@host:8086"}, "bad-url"),
        ({"bucket": ""}, "bad-config"),
        ({"measurement": ""}, "bad-config"),
        ({"measurement": "#comment"}, "bad-config"),
        ({"measurement": "a\\b"}, "bad-config"),
        ({"field_key": ""}, "bad-config"),
        ({"field_key": "line\nbreak"}, "bad-config"),
        ({"tags": {"": "x"}}, "bad-config"),
        ({"tags": {"k": "trailing\\"}}, "bad-config"),
    ],
)
def test_a_config_no_request_can_be_made_from_is_permanent(change: dict[str, object], reason: str) -> None:
    fields: dict[str, object] = {
        "url": "http://127.0.0.1:8086",
        "org": "o",
        "bucket": "b",
        "measurement": "m",
        "field_key": "f",
        "tags": {},
    }
    fields.update(change)
    with pytest.raises(PermanentError) as caught:
        push_influxdb2.make_writer(DbInfluxdb2(**fields), PushSecrets(), timeout_s=1.0)  # type: ignore[arg-type]
    assert caught.value.reason == reason


async def test_a_server_that_never_answers_times_out(measurement: str) -> None:
    silent = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(silent.accept()[0]), daemon=True).start()
    method = method_for(f"http://127.0.0.1:{silent.getsockname()[1]}", measurement)
    writer = push_influxdb2.make_writer(method, PushSecrets(), timeout_s=0.5)
    started = time.monotonic()
    try:
        with pytest.raises(TransientError) as caught:
            await writer.write([sample("41", now_ms())])
    finally:
        await writer.aclose()
        silent.close()
        for sock in accepted:
            sock.close()
    assert caught.value.reason == "timeout"
    assert 0.4 < time.monotonic() - started < 2.0


async def test_https_with_the_ca_given_and_refused_without_it(vm: VictoriaMetrics, measurement: str) -> None:
    ca = trustme.CA()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(server_context)
    proxy = RecordingProxy(vm.url, tls=server_context)
    proxy.start()
    client_context = ssl.create_default_context()
    ca.configure_trust(client_context)
    t0 = now_ms()
    try:
        assert proxy.url.startswith("https://localhost:")
        writer = writer_for(proxy.url, measurement, ssl_context=client_context)
        stranger = writer_for(proxy.url, measurement)  # the system's CAs: they do not know ours
        try:
            await writer.write([sample("41", t0)])
            with pytest.raises(PermanentError) as caught:
                await stranger.write([sample("42", t0 + 1000)])
        finally:
            await writer.aclose()
            await stranger.aclose()
    finally:
        proxy.stop()
    assert caught.value.reason == "tls"
    assert [r.headers["Authorization"] for r in proxy.requests] == [f"Token {TOKEN}"]
    assert stored(vm, measurement, 1) == [(t0, 41.0)]


def test_retry_after_reads_seconds_and_dates() -> None:
    now_s = 1_000_000_000.0  # 2001-09-09 01:46:40 UTC
    assert push_influxdb2.retry_after_s("12", now_s=now_s) == 12.0
    assert push_influxdb2.retry_after_s("Sun, 09 Sep 2001 01:47:00 GMT", now_s=now_s) == 20.0
    assert push_influxdb2.retry_after_s(None, now_s=now_s, default_s=2.0) == 2.0
    assert push_influxdb2.retry_after_s("soon", now_s=now_s, default_s=2.0) == 2.0
    assert push_influxdb2.retry_after_s("-5", now_s=now_s) == 0.0
    assert push_influxdb2.retry_after_s("999999", now_s=now_s) == push_influxdb2.MAX_RETRY_AFTER_S
