from __future__ import annotations

import hashlib
import importlib.util
import io
import itertools
import json
import math
import struct
from pathlib import Path
from typing import Any

import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from mapper.shared.model import DeviceConfig, DeviceProperty, PushMqtt, Sample, Value
from mapper.wire import telemetry
from mapper.wire.dictionaries import CURRENT_DICTIONARY_ID, DICTIONARY_SHA256, load_dictionary
from mapper.wire.telemetry import (
    FORMAT_VERSION,
    BatchCodec,
    BatchEncoder,
    BatchFormatError,
    DeviceTelemetry,
    Format,
    batch_body,
    batch_json_lines,
    body_parts,
    decode_batch,
    decode_command,
    encode_batch,
    encode_file,
    records_equal,
)

T0 = 1_780_000_000_000
UUID = "GPU-12345678-1234-1234-1234-123456789abc"


def _encode(samples: list[Sample], fmt: Format = "binary", seq: int = 7, uuid_in_header: bool = True) -> bytes:
    return encode_batch(
        samples,
        node="edge-1",
        device="default/gpu0",
        uuid=UUID,
        boot_id="boot-a",
        seq=seq,
        fmt=fmt,
        uuid_in_header=uuid_in_header,
    ).payload


def _assert_same(samples: list[Sample], payload: bytes) -> None:
    decoded = decode_batch(payload)
    assert len(decoded.samples) == len(samples)
    for want, got in zip(samples, decoded.samples, strict=True):
        assert got.ts_ms == want.ts_ms
        assert records_equal(want.values, got.values), (want.values, got.values)


# Values as the NVML backend produces them: ints (big ones too), W = mW/1000, J = mJ/1000, strings, bools.
nvml_floats = st.one_of(
    st.integers(0, 2_000_000).map(lambda mw: mw / 1000),
    st.integers(0, 10**15).map(lambda mj: mj / 1000),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([72.531, 0.1, -0.0, 1e-300, 5e-324, 1.7976931348623157e308]),
)
values = st.one_of(
    st.integers(-(2**70), 2**70),
    nvml_floats,
    st.text(max_size=12),
    st.just(UUID),
    st.booleans(),
)
names = st.sampled_from(["power_usage", "temperature", "memory_used", "compute_mode", "x.custom", "ünicode"])


@st.composite
def sample_lists(draw: st.DrawFn) -> list[Sample]:
    n = draw(st.integers(1, 25))
    regular = draw(st.booleans())
    ts = T0
    out = []
    for _ in range(n):
        ts += 1000 if regular else draw(st.integers(0, 5000))
        out.append(Sample(UUID, ts, draw(st.dictionaries(names, values, max_size=6))))
    return out


@settings(max_examples=150, deadline=None)
@given(sample_lists(), st.booleans())
def test_decoding_an_encoded_batch_gives_back_every_value_exactly(samples: list[Sample], with_uuid: bool) -> None:
    payload = _encode(samples, uuid_in_header=with_uuid)
    _assert_same(samples, payload)
    holds_uuid = any(v == UUID for s in samples for v in s.values.values())
    assert decode_batch(payload).uuid == (UUID if with_uuid or holds_uuid else "")


@settings(max_examples=60, deadline=None)
@given(sample_lists())
def test_the_json_format_is_lossless_too(samples: list[Sample]) -> None:
    _assert_same(samples, _encode(samples, fmt="json"))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(nvml_floats, st.just(float("nan")), st.just(float("inf"))), min_size=1, max_size=30))
def test_float_columns_keep_their_exact_bits(floats: list[float]) -> None:
    samples = [Sample(UUID, T0 + i * 1000, {"power_usage": v}) for i, v in enumerate(floats)]
    decoded = decode_batch(_encode(samples))
    for want, got in zip(floats, decoded.samples, strict=True):
        g = got.values["power_usage"]
        assert isinstance(g, float)
        assert math.copysign(1.0, g) == math.copysign(1.0, want)
        assert (math.isnan(g) and math.isnan(want)) or g == want


@st.composite
def dense_sample_lists(draw: st.DrawFn) -> list[Sample]:
    """Batches as the NVML backend makes them: every sample holds the same properties, each of one type, mostly
    constant or changing a little (the encoder's short path), with the awkward values mixed in."""
    n = draw(st.integers(1, 12))
    props = draw(st.lists(st.sampled_from([*telemetry.KNOWN_SERIES[:20], "x.custom"]), unique=True, max_size=10))
    columns: dict[str, list[Value]] = {}
    for name in props:
        kind = draw(st.sampled_from(["int", "slow int", "float", "str", "bool"]))
        if kind == "slow int":
            start, step, bend = draw(st.integers(-(2**40), 2**40)), draw(st.integers(-9, 9)), draw(st.integers(-2, 2))
            noise = draw(st.lists(st.sampled_from([0, 0, 1, 1024]), min_size=n, max_size=n))
            columns[name] = [start + step * i + bend * i * i + noise[i] for i in range(n)]
            continue
        elements: st.SearchStrategy[Any] = {
            "int": st.one_of(st.integers(-3, 3), st.integers(-(2**70), 2**70), st.sampled_from([63, 64, -64, -65])),
            "float": st.one_of(nvml_floats, st.sampled_from([0.0, -0.0, 700.0, float("nan"), float("inf")])),
            "str": st.sampled_from(["default", "ωμέγα", UUID, ""]),
            "bool": st.booleans(),
        }[kind]
        if draw(st.booleans()):  # constant: the very same object in every row (a NaN too)
            columns[name] = [draw(elements)] * n
        else:
            columns[name] = draw(st.lists(elements, min_size=n, max_size=n))
    return [Sample(UUID, T0 + i * 1000, {name: col[i] for name, col in columns.items()}) for i in range(n)]


@settings(max_examples=300, deadline=None)
@given(dense_sample_lists(), st.sampled_from(["", UUID]))
def test_the_usual_batch_takes_a_short_path_that_writes_what_the_general_path_writes(
    samples: list[Sample], header_uuid: str
) -> None:
    dense = telemetry._dense_columns(samples)
    assert dense is not None
    short = telemetry._Sections()
    telemetry._encode_dense_columns(short, *dense, header_uuid)
    general = telemetry._Sections()
    for name, vtype, rows, values in telemetry._columns(samples):
        telemetry._encode_series(general, name, rows, values, vtype, len(samples), header_uuid)
    assert (short.meta, short.data, short.bits.bytes()) == (general.meta, general.data, general.bits.bytes())
    _assert_same(samples, _encode(samples, uuid_in_header=bool(header_uuid)))


@st.composite
def grouped_sample_lists(draw: st.DrawFn) -> list[Sample]:
    """Batches of two or three kinds of rows, each kind dense on properties of its own (the collect cycle's rows
    every second and the process cycle's every few), the kinds interleaved in time."""
    kinds = draw(st.integers(2, 3))
    pool = [*telemetry.KNOWN_SERIES[:24], "pod:energy:ns/pod/c", "processes_count", "x.custom"]
    props = draw(st.lists(st.sampled_from(pool), unique=True, min_size=kinds, max_size=12))
    cut = sorted(draw(st.lists(st.integers(1, len(props) - 1), min_size=kinds - 1, max_size=kinds - 1, unique=True)))
    if len(cut) < kinds - 1:
        cut = list(range(1, kinds))
    parts = [props[a:b] for a, b in zip([0, *cut], [*cut, len(props)], strict=True)]
    rows: list[Sample] = []
    for k, names_k in enumerate(parts):
        n = draw(st.integers(1, 8))
        group = draw(dense_sample_lists_of(names_k, n))
        rows += [Sample(UUID, T0 + k * 137 + i * 1000, values) for i, values in enumerate(group)]
    return sorted(rows, key=lambda s: s.ts_ms)


def dense_sample_lists_of(props: list[str], n: int) -> st.SearchStrategy[list[dict[str, Value]]]:
    @st.composite
    def make(draw: st.DrawFn) -> list[dict[str, Value]]:
        columns: dict[str, list[Value]] = {}
        for name in props:
            elements: st.SearchStrategy[Any] = draw(
                st.sampled_from(
                    [
                        st.one_of(st.integers(-3, 3), st.integers(-(2**70), 2**70)),
                        st.one_of(nvml_floats, st.sampled_from([0.0, -0.0, 700.0, float("nan")])),
                        st.sampled_from(["default", "ωμέγα", UUID, ""]),
                        st.booleans(),
                    ]
                )
            )
            if draw(st.booleans()):
                columns[name] = [draw(elements)] * n
            else:
                columns[name] = draw(st.lists(elements, min_size=n, max_size=n))
        return [{name: col[i] for name, col in columns.items()} for i in range(n)]

    return make()


@settings(max_examples=300, deadline=None)
@given(grouped_sample_lists(), st.sampled_from(["", UUID]))
def test_a_batch_of_collect_and_process_rows_takes_a_short_path_that_writes_what_the_general_path_writes(
    samples: list[Sample], header_uuid: str
) -> None:
    assert telemetry._dense_columns(samples) is None
    grouped = telemetry._grouped_columns(samples)
    assert grouped is not None
    short = telemetry._Sections()
    telemetry._encode_dense_columns(short, *grouped[:3], header_uuid, grouped[3], len(samples))
    general = telemetry._Sections()
    for name, vtype, rows, values in telemetry._columns(samples):
        telemetry._encode_series(general, name, rows, values, vtype, len(samples), header_uuid)
    assert (short.meta, short.data, short.bits.bytes()) == (general.meta, general.data, general.bits.bytes())
    _assert_same(samples, _encode(samples, uuid_in_header=bool(header_uuid)))


def test_rows_of_kinds_that_share_a_property_or_change_its_type_take_the_general_path_and_come_back() -> None:
    shared = [Sample(UUID, T0, {"temperature": 60}), Sample(UUID, T0 + 1, {"temperature": 61, "processes_count": 2})]
    retyped = [
        Sample(UUID, T0, {"temperature": 60}),
        Sample(UUID, T0 + 1, {"processes_count": 2}),
        Sample(UUID, T0 + 2, {"temperature": 60.5}),
    ]
    many = [Sample(UUID, T0 + i, {f"x.p{i}": i}) for i in range(5)]
    for samples in (shared, retyped, many):
        assert telemetry._grouped_columns(samples) is None
        _assert_same(samples, _encode(samples))


def test_a_batch_whose_properties_change_order_or_type_takes_the_general_path_and_comes_back() -> None:
    reordered = [
        Sample(UUID, T0, {"temperature": 60, "power_usage": 1.5}),
        Sample(UUID, T0 + 1, {"power_usage": 2.5, "temperature": 61}),
    ]
    retyped = [Sample(UUID, T0, {"temperature": 60}), Sample(UUID, T0 + 1, {"temperature": True})]
    for samples in (reordered, retyped):
        assert telemetry._dense_columns(samples) is None
        _assert_same(samples, _encode(samples))


def _varint_len(n: int) -> int:
    return max(1, (n.bit_length() + 6) // 7)


def _zigzag(n: int) -> int:
    return n * 2 if n >= 0 else -n * 2 - 1


def _plan_by_its_definition(ints: list[int]) -> tuple[int, list[int], int, int, int, list[int], int]:
    """The cheapest coding of every order whose sequence has two values or more (the lower order on a tie), each
    as (order, seeds, base, gcd, width, sequence, bytes)."""
    plans: list[tuple[int, list[int], int, int, int, list[int], int]] = []
    seq, seeds = list(ints), list[int]()
    for order in range(3):
        if len(seq) < 2:
            break
        base = min(seq)
        g = math.gcd(*(x - base for x in seq)) or 1
        width = ((max(seq) - base) // g).bit_length()
        cost = sum(_varint_len(_zigzag(s)) for s in seeds) + _varint_len(_zigzag(base // g)) + _varint_len(width << 2)
        cost += (_varint_len(g) + _varint_len(base % g) if g > 1 else 0) + (len(seq) * width + 7) // 8
        plans.append((order, list(seeds), base, g, width, list(seq), cost))
        seeds.append(seq[0])
        seq = [b - a for a, b in itertools.pairwise(seq)]
    return min(plans, key=lambda p: (p[6], p[0]))


int_columns = st.one_of(
    st.lists(st.integers(-(2**70), 2**70), min_size=2, max_size=25),
    st.lists(st.integers(-70, 70), min_size=2, max_size=25),
    st.builds(
        lambda start, step, bend, k, n: [k * (start + step * i + bend * i * i) for i in range(n)],
        st.integers(-(2**40), 2**40),
        st.integers(-1000, 1000),
        st.integers(-3, 3),
        st.sampled_from([1, 2, 6, 1024]),
        st.integers(2, 25),
    ),
    # A bend with a little noise, all times k: the second differences are nearly even and share k, so the
    # delta-of-deltas order competes with a gcd above 1 (the planner's bound on their width, and past it).
    st.builds(
        lambda start, bend, k, noise: [k * (start + bend * i * i + e) for i, e in enumerate(noise)],
        st.integers(-(2**40), 2**40),
        st.integers(-500, 500),
        st.sampled_from([1, 3, 6, 1024]),
        st.lists(st.sampled_from([0, 0, 0, 1, -1, 2]), min_size=4, max_size=25),
    ),
)


@settings(max_examples=400, deadline=None)
@given(int_columns)
def test_an_int_column_is_coded_by_the_cheapest_order_as_the_format_defines_it(ints: list[int]) -> None:
    if len(set(ints)) == 1:
        ints = [*ints, ints[0] + 1]  # a constant column is written as a constant, not planned
    plan = telemetry._int_plan(tuple(ints))
    assert (*plan[:5], list(plan.seq), plan.cost) == _plan_by_its_definition(ints)


def test_a_property_absent_in_some_samples_stays_absent_after_decoding() -> None:
    samples = [
        Sample(UUID, T0, {"temperature": 61, "fan_speed": 30}),
        Sample(UUID, T0 + 1000, {"temperature": 62}),
        Sample(UUID, T0 + 2000, {}),
        Sample(UUID, T0 + 3000, {"fan_speed": 31, "remapped_rows_pending": True}),
    ]
    decoded = decode_batch(_encode(samples))
    assert [dict(s.values) for s in decoded.samples] == [dict(s.values) for s in samples]
    assert "fan_speed" not in decoded.samples[1].values


def test_a_property_that_changes_type_keeps_each_value_type() -> None:
    samples = [Sample(UUID, T0, {"p": 1}), Sample(UUID, T0 + 1, {"p": 1.5}), Sample(UUID, T0 + 2, {"p": True})]
    got = [s.values["p"] for s in decode_batch(_encode(samples)).samples]
    assert [type(v) for v in got] == [int, float, bool]
    assert got == [1, 1.5, True]


def test_the_header_carries_node_device_uuid_boot_id_sequence_and_time_range() -> None:
    samples = [Sample(UUID, T0 + 500, {"temperature": 50}), Sample(UUID, T0 + 9500, {"temperature": 51})]
    batch = decode_batch(_encode(samples, seq=42))
    assert (batch.version, batch.node, batch.device, batch.uuid, batch.boot_id, batch.seq) == (
        FORMAT_VERSION,
        "edge-1",
        "default/gpu0",
        UUID,
        "boot-a",
        42,
    )
    assert (batch.ts_first_ms, batch.ts_last_ms) == (T0 + 500, T0 + 9500)


def test_a_ten_second_window_of_a_realistic_gpu_packs_into_a_few_bytes_per_value() -> None:
    samples = []
    energy_mj = 123_456_789_012
    for i in range(10):
        power_mw = 300_000 + (i * 7919) % 4000
        energy_mj += power_mw
        samples.append(
            Sample(
                UUID,
                T0 + i * 1000,
                {
                    "power_usage": power_mw / 1000,
                    "energy_consumption": energy_mj / 1000,
                    "temperature": 70 + i % 3,
                    "memory_total": 85_899_345_920,
                    "memory_used": 40_000_000_000 + i * 1_048_576,
                    "clock_sm": 1980,
                    "compute_mode": "default",
                    "persistence_mode": True,
                    "power_limit": 700.0,
                    "product_name": "NVIDIA_H100_80GB_HBM3",
                },
            )
        )
    payload = _encode(samples)
    assert len(payload) / 100 < 3.0  # 100 values, header of ~80 bytes included
    _assert_same(samples, payload)


def test_json_lines_name_ts_device_property_and_the_exact_value() -> None:
    samples = [Sample(UUID, T0, {"power_usage": 72.531, "memory_used": 2**40 + 3, "compute_mode": "default"})]
    lines = [json.loads(line) for line in batch_json_lines(decode_batch(_encode(samples)))]
    assert lines == [
        {"ts_ms": T0, "device": "default/gpu0", "property": "power_usage", "value": 72.531},
        {"ts_ms": T0, "device": "default/gpu0", "property": "memory_used", "value": 2**40 + 3},
        {"ts_ms": T0, "device": "default/gpu0", "property": "compute_mode", "value": "default"},
    ]


def test_decode_command_reads_several_framed_batches_from_stdin() -> None:
    a = _encode([Sample(UUID, T0, {"temperature": 61})], seq=1)
    b = _encode([Sample(UUID, T0 + 10_000, {"temperature": 62})], fmt="json", seq=2)
    out = io.StringIO()
    rc = decode_command(["-"], io.BytesIO(encode_file([a, b])), out, io.StringIO())
    assert rc == 0
    assert [json.loads(line)["value"] for line in out.getvalue().splitlines()] == [61, 62]


def test_decode_command_reads_a_single_bare_batch_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "one.gmt"
    path.write_bytes(_encode([Sample(UUID, T0, {"persistence_mode": False})]))
    out = io.StringIO()
    assert decode_command(str(path), io.BytesIO(), out, io.StringIO()) == 0
    assert json.loads(out.getvalue()) == {
        "ts_ms": T0,
        "device": "default/gpu0",
        "property": "persistence_mode",
        "value": False,
    }


def test_decode_command_names_the_broken_batch_and_fails(tmp_path: Path) -> None:
    good = _encode([Sample(UUID, T0, {"temperature": 61})])
    err = io.StringIO()
    rc = decode_command(["-"], io.BytesIO(encode_file([good, b"G\x01\x01garbage"])), io.StringIO(), err)
    assert rc == 1
    assert "batch #2" in err.getvalue()
    missing = tmp_path / "nope"
    err = io.StringIO()
    assert decode_command([str(missing)], io.BytesIO(), io.StringIO(), err) == 2
    assert "cannot read" in err.getvalue()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"hello", "not a telemetry batch"),
        (b"G\x09\x00", "version 9 is not supported"),
        (b"G\x02\x00\x0a\x80", "truncated"),
        (b'{"format": "other"}', "not a gpu-mapper-telemetry batch"),
        (b"{not json", "does not parse"),
    ],
)
def test_bad_input_gets_an_error_that_says_what_is_wrong(data: bytes, message: str) -> None:
    with pytest.raises(BatchFormatError, match=message):
        decode_batch(data)


def test_the_encoder_cuts_one_batch_per_window_with_growing_sequence_numbers() -> None:
    enc = BatchEncoder("edge-1", "default/gpu0", UUID, "boot-a", window_s=10, start_seq=5)
    batches = []
    for i in range(35):
        enc.add(Sample(UUID, T0 + i * 1000, {"temperature": 60 + i % 5}))
        batch = enc.flush_due(T0 + i * 1000 + 1)
        if batch:
            batches.append(batch)
    last = enc.flush()
    assert last is not None
    batches.append(last)
    assert [b.seq for b in batches] == [5, 6, 7, 8]
    assert [b.samples for b in batches] == [10, 10, 10, 5]
    assert enc.flush() is None
    decoded = [decode_batch(b.payload) for b in batches]
    assert [s.ts_ms for d in decoded for s in d.samples] == [T0 + i * 1000 for i in range(35)]


def test_the_encoder_refuses_a_bad_window_or_format() -> None:
    with pytest.raises(ValueError, match="window_s"):
        BatchEncoder("n", "d", UUID, "b", window_s=0)
    with pytest.raises(ValueError, match="format"):
        BatchEncoder("n", "d", UUID, "b", fmt="xml")  # type: ignore[arg-type]


def test_properties_with_their_own_push_method_get_their_own_batches_and_topic() -> None:
    device = DeviceConfig(
        namespace="default",
        name="gpu0",
        model="nvidia-gpu",
        uuid=UUID,
        properties=(
            DeviceProperty("temperature"),
            DeviceProperty("power_usage", push_mqtt=PushMqtt("tcp://10.0.0.9:1883", "site/power", 0, True)),
        ),
    )
    tel = DeviceTelemetry("edge-1", device, "boot-a", window_s=10)
    tel.add(Sample(UUID, T0, {"temperature": 60, "power_usage": 100.5, "clock_sm": 1980}))
    out = tel.flush()
    assert [(r.address, r.topic, r.qos, r.retain) for r, _ in out] == [
        ("", "gpu-mapper/edge-1/default/gpu0/telemetry", 1, False),
        ("tcp://10.0.0.9:1883", "site/power", 0, True),
    ]
    assert [b.seq for _, b in out] == [0, 1]
    assert dict(decode_batch(out[0][1].payload).samples[0].values) == {"temperature": 60, "clock_sm": 1980}
    assert dict(decode_batch(out[1][1].payload).samples[0].values) == {"power_usage": 100.5}


def test_a_hex_boot_id_and_a_canonical_gpu_uuid_travel_packed_and_come_back_exactly() -> None:
    samples = [Sample(UUID, T0 + i * 1000, {"temperature": 60 + i, "uuid": UUID}) for i in range(3)]
    packed = encode_batch(samples, node="n", device="d", uuid=UUID, boot_id="0123456789abcdef", seq=1).payload
    texty = encode_batch(samples, node="n", device="d", uuid="MIG-7", boot_id="boot-a", seq=1).payload
    decoded = decode_batch(packed)
    assert (decoded.uuid, decoded.boot_id) == (UUID, "0123456789abcdef")
    assert [s.values["uuid"] for s in decoded.samples] == [UUID] * 3
    other = decode_batch(texty)
    assert (other.uuid, other.boot_id) == ("MIG-7", "boot-a")
    assert [s.values["uuid"] for s in other.samples] == [UUID] * 3


def test_an_8_digit_boot_id_as_the_mapper_makes_it_travels_in_4_bytes_and_comes_back_exactly() -> None:
    samples = [Sample(UUID, T0 + i * 1000, {"temperature": 60 + i}) for i in range(3)]
    short = body_parts(samples, node="n", device="d", uuid=UUID, boot_id="0badf00d", seq=1)["ids"]
    long = body_parts(samples, node="n", device="d", uuid=UUID, boot_id="0123456789abcdef", seq=1)["ids"]
    assert short[0] == 0x09, "uuid packed, boot id packed in 4 bytes"
    assert len(long) - len(short) == 4
    payload = encode_batch(samples, node="n", device="d", uuid=UUID, boot_id="0badf00d", seq=1).payload
    assert decode_batch(payload).boot_id == "0badf00d"
    parts = body_parts(samples, node="n", device="d", uuid=UUID, boot_id="0badf00d", seq=1)
    both = {**parts, "ids": bytes([0x0B]) + short[1:]}
    with pytest.raises(BatchFormatError, match="unknown id packing 11"):
        decode_batch(b"G\x02\x00" + b"".join(both.values()))


def test_a_batch_compressed_with_an_unknown_dictionary_names_the_dictionary() -> None:
    payload = _encode([Sample(UUID, T0, {"temperature": 61})])
    assert payload[2] & 0x01, "the body of a real batch is a zstd frame"
    foreign = payload[:2] + bytes([0x01 | 0x0F << 4]) + payload[3:]
    with pytest.raises(BatchFormatError, match="dictionary 15"):
        decode_batch(foreign)


def test_a_batch_without_the_dictionary_still_decodes() -> None:
    samples = [
        Sample(UUID, T0 + i * 1000, {"power_usage": 100.25 + i, "product_name": "NVIDIA H100"}) for i in range(5)
    ]
    plain = encode_batch(
        samples, node="n", device="d", uuid=UUID, boot_id="b", seq=0, codec=BatchCodec(dictionary_id=0)
    ).payload
    assert plain[2] >> 4 == 0
    _assert_same(samples, plain)
    with pytest.raises(ValueError, match="dictionary id 14 is unknown"):
        BatchCodec(dictionary_id=14)


def test_the_committed_dictionary_is_what_the_generator_builds() -> None:
    script = Path(__file__).resolve().parent.parent / "scripts" / "make_telemetry_dict.py"
    spec = importlib.util.spec_from_file_location("make_telemetry_dict", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    built = module.build()
    assert module.DICTIONARY_ID == CURRENT_DICTIONARY_ID
    assert built == module.target().read_bytes() == load_dictionary(CURRENT_DICTIONARY_ID)
    assert hashlib.sha256(built).hexdigest() == DICTIONARY_SHA256[CURRENT_DICTIONARY_ID]
    assert load_dictionary(CURRENT_DICTIONARY_ID)[:4] == b"\x37\xa4\x30\xec"  # a trained zstd dictionary


def test_encoders_sharing_one_codec_make_the_same_bytes_as_encoders_with_their_own() -> None:
    shared = BatchCodec()
    samples = [Sample(UUID, T0 + i * 1000, {"power_usage": 300 + i / 8, "temperature": 60}) for i in range(10)]
    payloads = []
    for codec in (shared, shared, None):
        enc = BatchEncoder("edge-1", "default/gpu0", UUID, "0123456789abcdef", codec=codec)
        for s in samples:
            enc.add(s)
        batch = enc.flush()
        assert batch is not None
        payloads.append(batch.payload)
    assert payloads[0] == payloads[1] == payloads[2]
    _assert_same(samples, payloads[0])


def test_only_the_first_batch_of_an_encoder_and_batches_holding_the_uuid_carry_it_in_the_header() -> None:
    enc = BatchEncoder("edge-1", "default/gpu0", UUID, "0123456789abcdef", window_s=10)
    uuids = []
    for window in range(4):
        if window == 3:
            enc.announce_uuid()
        for i in range(10):
            values: dict[str, int | str] = {"temperature": 60 + i}
            if window == 2 and i == 4:
                values["uuid"] = UUID  # the uuid series, sampled once a minute
            enc.add(Sample(UUID, T0 + window * 10_000 + i * 1000, values))
        batch = enc.flush()
        assert batch is not None and batch.uuid == UUID
        decoded = decode_batch(batch.payload)
        uuids.append(decoded.uuid)
        assert {s.uuid for s in decoded.samples} == {decoded.uuid}
        if window == 2:
            assert decoded.samples[4].values["uuid"] == UUID
    assert uuids == [UUID, "", UUID, UUID]
    assert enc.uuid_in_next_batch is False


def test_every_route_of_a_device_carries_the_uuid_in_its_first_batch_only() -> None:
    device = DeviceConfig(
        namespace="default",
        name="gpu0",
        model="nvidia-gpu",
        uuid=UUID,
        properties=(DeviceProperty("power_usage", push_mqtt=PushMqtt("", "site/power", 1, False)),),
    )
    tel = DeviceTelemetry("edge-1", device, "boot-a", window_s=10)
    seen = []
    for window in range(2):
        tel.add(Sample(UUID, T0 + window * 10_000, {"temperature": 60, "power_usage": 100.5}))
        seen.append([(b.seq, decode_batch(b.payload).uuid) for _, b in tel.flush()])
    assert seen == [[(0, UUID), (1, UUID)], [(2, ""), (3, "")]]
    tel.announce_uuid()
    tel.add(Sample(UUID, T0 + 20_000, {"temperature": 60, "power_usage": 100.5}))
    assert [decode_batch(b.payload).uuid for _, b in tel.flush()] == [UUID, UUID]


def test_a_header_without_the_uuid_is_sixteen_bytes_shorter() -> None:
    samples = [Sample(UUID, T0 + i * 1000, {"temperature": 60 + i}) for i in range(10)]
    sizes = [
        len(batch_body(samples, node="n", device="d", uuid=UUID, boot_id="b", seq=3, uuid_in_header=carry))
        for carry in (True, False)
    ]
    assert sizes[0] - sizes[1] == 16


def test_a_string_that_refers_to_a_uuid_the_batch_lacks_is_refused() -> None:
    samples = [Sample(UUID, T0, {"uuid": UUID, "temperature": 60})]
    parts = body_parts(samples, node="n", device="d", uuid=UUID, boot_id="0123456789abcdef", seq=1)
    ids = parts["ids"]
    assert ids[0] == 0x03, "uuid and boot id packed"
    without_uuid = {**parts, "ids": bytes([0x06]) + ids[17:]}
    with pytest.raises(BatchFormatError, match="refers to the batch's uuid"):
        decode_batch(b"G\x02\x00" + b"".join(without_uuid.values()))
    both = {**parts, "ids": bytes([0x07]) + ids[1:]}
    with pytest.raises(BatchFormatError, match="unknown id packing 7"):
        decode_batch(b"G\x02\x00" + b"".join(both.values()))


def test_a_batch_written_with_the_first_dictionary_and_the_uuid_in_every_header_still_decodes() -> None:
    # Made by the encoder of 2026-11 (format 2, dictionary 1): 3 rows, the uuid series in the first.
    old = bytes.fromhex(
        "4702110000450200140303d00f310c0407090c8a02641901140100031234567812349abc0123456789abcdef0380909282e733"
        "087808c80101240907fc450364f28cb06ca39c5795ad0e80a9bcb93e0d"
    )
    assert old[2] >> 4 == 1 and CURRENT_DICTIONARY_ID != 1
    decoded = decode_batch(old)
    assert (decoded.uuid, decoded.boot_id, decoded.seq, decoded.device) == (
        UUID,
        "0123456789abcdef",
        3,
        "default/gpu0",
    )
    assert [dict(s.values) for s in decoded.samples] == [
        {
            "temperature": 60 + i,
            "power_usage": 100.25 + i,
            "product_name": "NVIDIA H100",
            **({"uuid": UUID} if i == 0 else {}),
        }
        for i in range(3)
    ]


# --------------------------------------------------------------------------------------------------
# The format is frozen: these inputs must encode to these very bytes
# --------------------------------------------------------------------------------------------------


def _golden_batches() -> dict[str, tuple[list[Sample], dict[str, Any]]]:
    """Deterministic batches covering every coding the encoder picks: int columns as values, deltas and
    delta-of-deltas (with and without a gcd, negative and beyond 64 bits), decimals of 0-3 places, XOR floats
    (NaN, infinities, -0.0, subnormals), strings (the uuid, a dictionary wider than one bit, non-ASCII), bools,
    constant and sparse columns, a custom series name, a property that changes type, uneven timestamps."""
    energy_mj = 123_456_789_012
    gpu = []
    for i in range(10):
        power_mw = 300_000 + (i * 7919) % 4000
        energy_mj += power_mw
        values: dict[str, Value] = {
            "uuid": UUID,
            "product_name": "NVIDIA H100 80GB HBM3",
            "temperature": 70 + i % 3,
            "memory_total": 85_899_345_920,
            "memory_used": 40_000_000_000 + i * 1_048_576,
            "energy_consumption": energy_mj / 1000,
            "power_usage": power_mw / 1000,
            "power_limit": 700.0,
            "utilization_gpu": (i * 37) % 101,
            "clock_sm": 1980 - 15 * (i // 4),
            "pcie_tx": i * i * 1024 + 7 + i % 3,
            "fan_speed": -3 + i if i % 2 else 0,
            "ecc_errors_corrected": 2**70 + i,
            "pstate": ("P0", "P2", "P8", "P0")[i % 4],
            "compute_mode": "default",
            "persistence_mode": True,
            "remapped_rows_pending": i % 3 == 0,
            "temperature_memory": (0.1 * i) + 1 / 3,
            "x.custom ünicode": "ωμέγα" if i % 2 else "alpha",
        }
        if i in (3, 7):
            values["xid_last"] = 79 if i == 3 else 48
        if i >= 5:
            values["clock_event_reasons_text"] = "sw_power_cap"
        gpu.append(Sample(UUID, T0 + i * 1000, values))
    odd_floats = [float("nan"), float("inf"), -0.0, 5e-324, -1.7976931348623157e308, 1e-300, 2.5]
    uneven = [
        Sample(UUID, T0 + t, {"temperature_slowdown": v, "p": kind})
        for t, v, kind in zip(
            [0, 7, 7, 1500, 1503, 9000, 9999], odd_floats, [1, 2, "three", 4.25, True, 5, "six"], strict=True
        )
    ]
    quadratic_ts = [Sample(UUID, T0 + 250 * i * i, {"temperature": 50 + i, "power_usage": 99.5}) for i in range(8)]
    gcd_ts = [Sample(UUID, T0 + 5000 * i + (2000 if i > 2 else 0), {"pstate": "P0"}) for i in range(6)]
    common = {"node": "edge-1", "device": "default/gpu0", "uuid": UUID, "boot_id": "0badf00d"}
    return {
        "window": (gpu, {**common, "seq": 7}),
        "window_no_uuid_in_header": (gpu, {**common, "seq": 8, "uuid_in_header": False}),
        "uneven": (uneven, {**common, "seq": 9, "uuid_in_header": False, "boot_id": "0123456789abcdef"}),
        "quadratic_timestamps": (quadratic_ts, {**common, "seq": 2**40, "uuid_in_header": False}),
        "timestamps_with_gcd": (gcd_ts, {**common, "seq": 0, "uuid": "MIG-7", "boot_id": "boot-a"}),
        "one_row": (gpu[:1], {**common, "seq": 1, "uuid": ""}),
    }


#: Body length and sha256 (first 16 hex digits) per batch: format 2 as the encoder wrote it before its speed-up.
GOLDEN_BODIES = {
    "window": (378, "ec1df53a89643cfa"),
    "window_no_uuid_in_header": (378, "0a44ea73a7a8827e"),
    "uneven": (161, "370f29efd3727d60"),
    "quadratic_timestamps": (58, "8e057026c9f6aa0c"),
    "timestamps_with_gcd": (61, "d47e111c5d59dd68"),
    "one_row": (231, "526e70d4a9b3e4e6"),
}
#: sha256 (first 16 hex digits) of the payloads as one file: header + zstd frame with the current dictionary (a
#: new dictionary or another zstd changes these bytes, not the format).
GOLDEN_PAYLOADS = "618028a8b60d17ac"
GOLDEN_ZSTD_VERSION = (1, 5, 7)


def test_the_binary_format_is_frozen_byte_for_byte() -> None:
    got = {}
    for name, (samples, kwargs) in _golden_batches().items():
        body = batch_body(samples, **kwargs)
        got[name] = (len(body), hashlib.sha256(body).hexdigest()[:16])
        _assert_same(samples, b"G\x02\x00" + body)
    assert got == GOLDEN_BODIES


@pytest.mark.skipif(zstandard.ZSTD_VERSION != GOLDEN_ZSTD_VERSION, reason="another zstd may compress differently")
def test_the_compressed_payloads_are_frozen_byte_for_byte_with_this_zstd() -> None:
    codec = BatchCodec()
    payloads = [encode_batch(samples, codec=codec, **kwargs).payload for samples, kwargs in _golden_batches().values()]
    zstd_flags = 0x01 | CURRENT_DICTIONARY_ID << 4
    assert [p[2] for p in payloads] == [zstd_flags] * 4 + [0] + [zstd_flags], "one body is too small to compress"
    assert hashlib.sha256(encode_file(payloads)).hexdigest()[:16] == GOLDEN_PAYLOADS


def test_a_damaged_body_claiming_a_huge_size_is_refused_before_anything_is_allocated():
    # Found by the bad-input suite (tests/fuzz): zstd allocated the size a flipped header claimed (MemoryError).
    damaged = (
        b"G\x03!\xc0\x00\xdd\x01\x00\x84\x02\x01\x001\x0c\x03\x07\x19P\x0c\x1a\x01\xda\x0f\x02\x1c\x01\x05\x01\x124Vx"
        b"\x124\x9a\xbc\x06boot-a\x01\x80\x90\x92\x82\xe73\x06\xcc-C\x8e\xce\xadr\x86!R\xe0\xb7\xf8\x12d\x04"
    )
    with pytest.raises(BatchFormatError, match="claims 3530823218174624221 bytes"):
        decode_batch(damaged)


def _uvarint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def test_a_float_whose_stored_bits_claim_more_than_64_bits_is_refused_naming_its_series() -> None:
    """A column of one float that is no short decimal (pi) keeps its IEEE 754 bits as one unsigned varint; damage
    that makes them 2**64 more is a format error naming the series, not a crash of the decoder."""
    samples = [Sample(UUID, T0 + i * 1000, {"power_usage": math.pi}) for i in range(3)]
    payload = encode_batch(samples, node="n1", device="default/gpu0", uuid=UUID, boot_id="b", seq=0).payload
    assert payload[2] == 0, "a batch this small is stored uncompressed"
    bits = _uvarint(struct.unpack("<Q", struct.pack("<d", math.pi))[0])
    at = payload.find(bits)
    assert at > 0 and payload.count(bits) == 1
    damaged = (
        payload[:at] + _uvarint(struct.unpack("<Q", struct.pack("<d", math.pi))[0] + 2**64) + payload[at + len(bits) :]
    )
    with pytest.raises(BatchFormatError, match="series 'power_usage': float bits beyond 64"):
        decode_batch(damaged)


def test_an_int_column_damaged_to_a_difference_order_as_long_as_itself_is_refused_naming_it() -> None:
    """Two values can have a difference order of 0 or 1 (one seed, one difference), never 2: among all the
    one-byte damages of a two-sample batch, one claims order 2 for a column of 2 values, and it is refused."""
    samples = [Sample(UUID, T0, {"temperature": 61}), Sample(UUID, T0 + 1000, {"temperature": 67})]
    payload = encode_batch(samples, node="n1", device="default/gpu0", uuid=UUID, boot_id="b", seq=0).payload
    errors = set()
    for at in range(3, len(payload)):
        for flip in (1, 2, 3):
            try:
                decode_batch(payload[:at] + bytes([payload[at] ^ flip]) + payload[at + 1 :])
            except BatchFormatError as exc:
                errors.add(str(exc))
    assert "int column of 2 values cannot have difference order 2" in errors


def test_a_sparse_column_damaged_to_a_difference_order_as_long_as_its_exceptions_is_refused_naming_it() -> None:
    """A merged batch in its cold form (format 4) keeps a column that is one value but for two exceptions as that
    value, the gaps between the exceptions and their values: two numbers each, so a difference order of at most 1.
    Among all the one-byte damages of such a batch (uncompressed: it is small), one claims order 2 for them, and
    it is refused rather than decoded to wrong values."""
    parts = []
    for seq in range(3):
        temps = [60] * 40
        if seq == 1:
            temps[10], temps[30] = 70, 75
        rows = [Sample("GPU-1", T0 + (seq * 40 + i) * 1000, {"temperature": v}) for i, v in enumerate(temps)]
        parts.append(
            decode_batch(
                encode_batch(rows, node="n1", device="default/gpu0", uuid="GPU-1", boot_id="b", seq=seq).payload
            )
        )
    payload = telemetry.merge_batches(parts, BatchCodec(), version=telemetry.MERGED_FORMAT_VERSION).payload
    assert payload[1:3] == bytes([telemetry.MERGED_FORMAT_VERSION, 0]), "format 4, uncompressed"
    errors = set()
    for at in range(3, len(payload)):
        for flip in (1, 2, 3):
            try:
                decode_batch(payload[:at] + bytes([payload[at] ^ flip]) + payload[at + 1 :])
            except BatchFormatError as exc:
                errors.add(str(exc))
    assert "int column of 2 values cannot have difference order 2" in errors
