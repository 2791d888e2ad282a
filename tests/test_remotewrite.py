"""The hand-made remote-write bytes against protoc's parser of proto/remote.proto; snappy; OpenMetrics."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import cramjam
import pytest

from mapper.bridge import remotewrite
from mapper.bridge.remotewrite import SeriesBuf, decode_v1, encode_v1, encode_v2, render_openmetrics, sorted_labels

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pb(tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    out = tmp_path_factory.mktemp("remote_pb")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"--proto_path={REPO / 'proto'}",
            f"--python_out={out}",
            "remote.proto",
        ],
        check=True,
        timeout=60,
    )
    spec = importlib.util.spec_from_file_location("remote_pb2", out / "remote_pb2.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def two_series() -> list[SeriesBuf]:
    a = SeriesBuf(sorted_labels("gpu_power_usage_watts", {"uuid": "GPU-1", "node": "n", "device": "default/x"}))
    b = SeriesBuf(
        sorted_labels("gpu_energy_consumption_joules_total", {"uuid": "GPU-1", "node": "n", "gpu": ""}),
        mtype="counter",
        help="energy",
    )
    for ts, v in ((1_780_000_000_000, 101.5), (1_780_000_001_000, -0.0), (1_780_000_002_000, 1e300)):
        a.add(ts, v)
    for ts, v in ((1_780_000_002_000, 3.0), (1_780_000_000_000, 1.0), (1_780_000_001_000, 2.0), (1_780_000_000_000, 9)):
        b.add(ts, v)  # out of order, and a repeated timestamp
    return [a, b]


def test_a_v1_request_parses_with_protoc_into_sorted_labels_and_ordered_samples(pb: ModuleType) -> None:
    req = pb.WriteRequest()
    req.ParseFromString(encode_v1(two_series()))
    assert len(req.timeseries) == 2
    first, second = req.timeseries
    assert [(lb.name, lb.value) for lb in first.labels] == [
        ("__name__", "gpu_power_usage_watts"),
        ("device", "default/x"),
        ("node", "n"),
        ("uuid", "GPU-1"),
    ]
    assert [(s.timestamp, s.value) for s in first.samples] == [
        (1_780_000_000_000, 101.5),
        (1_780_000_001_000, -0.0),
        (1_780_000_002_000, 1e300),
    ]
    assert math.copysign(1, first.samples[1].value) == -1
    # the empty "gpu" label is left out; samples sorted, the first of a repeated timestamp kept
    assert [lb.name for lb in second.labels] == ["__name__", "node", "uuid"]
    assert [(s.timestamp, s.value) for s in second.samples] == [
        (1_780_000_000_000, 1.0),
        (1_780_000_001_000, 2.0),
        (1_780_000_002_000, 3.0),
    ]
    assert decode_v1(req.SerializeToString()) == [
        (dict((lb.name, lb.value) for lb in ts.labels), [(s.timestamp, s.value) for s in ts.samples])
        for ts in req.timeseries
    ]


def test_a_v2_request_parses_with_protoc_with_symbols_refs_and_metadata(pb: ModuleType) -> None:
    req = pb.RequestV2()
    req.ParseFromString(encode_v2(two_series()))
    assert req.symbols[0] == ""
    assert len(set(req.symbols)) == len(req.symbols), "symbols deduplicated"
    first, second = req.timeseries
    pairs = [req.symbols[i] for i in first.labels_refs]
    assert pairs == ["__name__", "gpu_power_usage_watts", "device", "default/x", "node", "n", "uuid", "GPU-1"]
    assert first.metadata.type == pb.MetricMetadata.GAUGE
    assert second.metadata.type == pb.MetricMetadata.COUNTER
    assert req.symbols[second.metadata.help_ref] == "energy"
    assert [s.value for s in second.samples] == [1.0, 2.0, 3.0]


def test_the_body_is_snappy_block_format_and_round_trips() -> None:
    body = encode_v1(two_series())
    packed = remotewrite.compress(body)
    assert bytes(cramjam.snappy.decompress_raw(packed)) == body
    assert remotewrite.decompress(packed) == body
    with pytest.raises(remotewrite.RemoteWriteFormatError):
        remotewrite.decompress(b"\xff\xff\xff\xff\xff not snappy")


def test_negative_timestamps_and_truncated_bodies() -> None:
    s = SeriesBuf(sorted_labels("x", {}))
    s.add(-5, 1.0)
    assert decode_v1(encode_v1([s])) == [({"__name__": "x"}, [(-5, 1.0)])]
    with pytest.raises(remotewrite.RemoteWriteFormatError, match="truncated"):
        decode_v1(encode_v1([s])[:-3])


def test_duplicate_label_names_are_refused() -> None:
    with pytest.raises(ValueError, match="given twice"):
        sorted_labels("x", {"__name__": "y"})


def test_openmetrics_groups_families_orders_series_and_ends_in_eof() -> None:
    series = [
        ({"__name__": "gpu_energy_consumption_joules_total", "uuid": 'G"1'}, [(2000, 2.0), (1000, 1.0)]),
        ({"__name__": "gpu_power_usage_watts", "uuid": "G1"}, [(1500, float("nan"))]),
        ({"__name__": "gpu_energy_consumption_joules_total", "uuid": 'G"1'}, [(1000, 7.0), (3000, 3.0)]),
    ]
    text = "".join(
        render_openmetrics(series, {"gpu_energy_consumption_joules_total": "counter", "gpu_power_usage_watts": "gauge"})
    )
    assert text == (
        "# TYPE gpu_energy_consumption_joules counter\n"
        'gpu_energy_consumption_joules_total{uuid="G\\"1"} 1.0 1.000\n'
        'gpu_energy_consumption_joules_total{uuid="G\\"1"} 2.0 2.000\n'
        'gpu_energy_consumption_joules_total{uuid="G\\"1"} 3.0 3.000\n'
        "# TYPE gpu_power_usage_watts gauge\n"
        'gpu_power_usage_watts{uuid="G1"} NaN 1.500\n'
        "# EOF\n"
    )


def test_varints_are_protobufs_base_128_groups_low_first() -> None:
    # protobuf encoding docs: 1 -> 01, 127 -> 7f, 128 -> 80 01, 150 -> 96 01, 300 -> ac 02
    assert [remotewrite.uvarint(n) for n in (1, 127, 128, 150, 300)] == [
        b"\x01",
        b"\x7f",
        b"\x80\x01",
        b"\x96\x01",
        b"\xac\x02",
    ]


def test_a_request_with_other_fields_before_its_series_decodes_every_series(pb: ModuleType) -> None:
    """A WriteRequest may carry metadata (field 3) and fields this decoder does not know (here a fixed32, wire
    type 5) before and between its time series: they are skipped, never the series after them."""
    req = pb.WriteRequest()
    req.ParseFromString(encode_v1(two_series()))
    expected = [
        (dict((lb.name, lb.value) for lb in ts.labels), [(s.timestamp, s.value) for s in ts.samples])
        for ts in req.timeseries
    ]
    meta = pb.WriteRequest()
    md = meta.metadata.add()
    md.metric_family_name, md.help = "gpu_power_usage_watts", "power"
    fixed32 = bytes([(9 << 3) | 5]) + b"\x01\x02\x03\x04"  # field 9, four bytes
    series = [b"\x0a" + remotewrite.uvarint(len(t.SerializeToString())) + t.SerializeToString() for t in req.timeseries]
    body = meta.SerializeToString() + fixed32 + series[0] + fixed32 + series[1]
    assert decode_v1(body) == expected


def test_a_v2_series_without_help_has_no_help_ref(pb: ModuleType) -> None:
    s = SeriesBuf(sorted_labels("gpu_power_usage_watts", {"uuid": "GPU-1"}))
    s.add(1_780_000_000_000, 1.0)
    req = pb.RequestV2()
    req.ParseFromString(encode_v2([s]))
    (ts,) = req.timeseries
    assert ts.metadata.type == pb.MetricMetadata.GAUGE and ts.metadata.help_ref == 0
    expected = pb.MetricMetadata()
    expected.type = pb.MetricMetadata.GAUGE
    assert ts.metadata.SerializeToString() == expected.SerializeToString(), "the type alone, nothing after it"


def test_openmetrics_spells_infinities_and_types_a_counter_only_by_its_total_name() -> None:
    series = [
        ({"__name__": "a_total"}, [(1000, float("inf"))]),  # a gauge whose name ends in _total
        ({"__name__": "b"}, [(1000, float("-inf"))]),  # a counter without _total
    ]
    text = "".join(render_openmetrics(series, {"a_total": "gauge", "b": "counter"}))
    assert text == "# TYPE a_total gauge\na_total +Inf 1.000\n# TYPE b unknown\nb -Inf 1.000\n# EOF\n"
