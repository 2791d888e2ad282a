"""The framework's formats (value text, time text, http body, mqtt text) and a sample's stored form."""

from __future__ import annotations

import datetime as dt
import os
import time
import urllib.parse
from collections.abc import Iterator

import pytest

from mapper.edge.push.wire import (
    decode_sample,
    encode_sample,
    http_body,
    mqtt_text,
    number_of,
    retry_after_s,
    time_text,
    value_text,
)
from mapper.shared.push import PushSample

#: 2026-12-04 17:58:03.250 UTC
TS_MS = 1_796_407_083_250


@pytest.fixture
def utc() -> Iterator[None]:
    """The process's zone set to UTC (as the mapper runs with TZ=UTC), then put back."""
    before = os.environ.get("TZ")
    os.environ["TZ"] = "UTC"
    time.tzset()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TZ", None)
        else:
            os.environ["TZ"] = before
        time.tzset()


def sample(value: str = "182.6", prop: str = "power_usage") -> PushSample:
    return PushSample("default", "gpu0", prop, value, TS_MS, number=182.6, unit="W", uuid="GPU-1", node="n1")


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (182.6, "182.6"),
        (182.0, "182"),
        (0.1 + 0.2, "0.30000000000000004"),
        (1e16, "10000000000000000"),
        (1.5e-7, "0.00000015"),
        (-3.25, "-3.25"),
        (42, "42"),
        (True, "true"),
        (False, "false"),
        ("MODE_30W", "MODE_30W"),
        (float("nan"), "NaN"),
    ],
)
def test_a_value_is_written_as_the_frameworks_shortest_decimal_text(value: object, text: str) -> None:
    assert value_text(value) == text  # type: ignore[arg-type]
    if isinstance(value, float) and value == value:
        assert float(text) == value, "the text reads back as the same float"


def test_numbers_of_values() -> None:
    assert number_of(3) == 3.0 and number_of(True) == 1.0 and number_of("x") is None


def test_the_time_is_whole_seconds_in_the_local_zone(utc: None) -> None:
    assert time_text(TS_MS) == "2026-12-04 17:58:03"
    os.environ["TZ"] = "Asia/Shanghai"
    time.tzset()
    expected = dt.datetime.fromtimestamp(TS_MS // 1000, dt.timezone(dt.timedelta(hours=8))).strftime(
        "%Y-%m-%d %H:%M:%S"
    )
    assert time_text(TS_MS) == expected == "2026-12-05 01:58:03"


def test_the_http_body_is_the_frameworks_form_and_a_form_parser_reads_it(utc: None) -> None:
    body = http_body(sample())
    assert body == b"power_usage=182.6&time=2026-12-04 17:58:03"
    assert urllib.parse.parse_qsl(body.decode()) == [("power_usage", "182.6"), ("time", "2026-12-04 17:58:03")]


def test_the_mqtt_text_names_the_topic_and_has_two_blanks_after_the_time(utc: None) -> None:
    assert mqtt_text(sample(), "gpu/power") == b"time is 2026-12-04 17:58:03  gpu/power: 182.6"


def test_a_sample_reads_back_from_its_stored_form_and_a_damaged_one_is_refused() -> None:
    s = PushSample("ns", "d", "energy_consumption", "12.5", TS_MS, "float", 12.5, "J", True, "GPU-1", "n")
    assert decode_sample(encode_sample(s)) == s
    text = PushSample("ns", "d", "product_name", "H100", TS_MS)
    assert decode_sample(encode_sample(text)) == text
    for bad in (b"", b"[1,2]", b"{}", b'["a","b","c","d","x","k",null,"u",false,"g","n"]', b"\xff"):
        with pytest.raises(ValueError):
            decode_sample(bad)


def test_retry_after_reads_seconds_and_http_dates() -> None:
    assert retry_after_s("7") == 7.0
    assert retry_after_s(None) is None and retry_after_s("soon") is None
    now = 1_800_000_000.0
    date = "Fri, 15 Jan 2027 08:00:10 GMT"
    when = dt.datetime(2027, 1, 15, 8, 0, 10, tzinfo=dt.UTC).timestamp()
    assert retry_after_s(date, now_s=when - 10) == pytest.approx(10.0)
    assert retry_after_s(date, now_s=now + 1e9) == 0.0
