"""The mapper's own series (gpu_mapper_*): one list for /metrics and the node stream, spelled as telemetry series
names and read back by the bridge; the node stream's batches; a GPU's health in its state message."""

from __future__ import annotations

import json
import math
import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mapper.bridge.core import Converter, PendingRequest
from mapper.clock import FakeClock
from mapper.edge.health.checks import STATUSES, SUBSYSTEMS, CheckResult, HealthReport, ProbeResult
from mapper.edge.status.metrics import build_registry, render_metrics
from mapper.edge.status.nodestream import NodeStream, node_values
from mapper.edge.status.stats import DurationHistogram, GpuSnapshot, MapperSnapshot
from mapper.shared import naming
from mapper.shared.model import GpuInfo, Sample
from mapper.wire import topics
from mapper.wire.state import GpuHealth, parse_state
from mapper.wire.telemetry import EncodedBatch, Route, decode_batch, encode_batch

NODE = "edge-7"


def a_snapshot(ts_ms: int = 1_780_000_000_000, **fields: object) -> MapperSnapshot:
    base: dict[str, object] = {
        "node": NODE,
        "taken_at_ms": ts_ms,
        "version": "0.1.0",
        "mode": "standalone",
        "gpus": (GpuSnapshot(info=GpuInfo("GPU-a", 0, "H100")),),
        "buffer_bytes": 12_345,
        "buffer_max_bytes": 1 << 30,
        "buffer_oldest_age_s": 2.5,
        "buffer_drops": {"size": 3},
        "mqtt_enabled": True,
        "mqtt_connected": True,
        "mqtt_inbound_dropped": {'rate "limited"\\n': 1},  # a label value that needs escaping
        "dmi_rpcs": {("MapperRegister", "unavailable"): 2},
        "policy_events": {("thermal", "engage"): 4},
        "collect_duration": DurationHistogram().observe(0.004).observe(3.0),
        "process_errors": {"nvml": 1},
    }
    base.update(fields)
    return MapperSnapshot(**base)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------
# Names
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "labels",
    [(), (("reason", "size"),), (("method", 'a"b\\c\nd'), ("result", "ok")), (("le", "+Inf"),)],
)
def test_a_sample_key_reads_back_as_its_name_and_labels(labels: tuple[tuple[str, str], ...]) -> None:
    key = naming.sample_key("gpu_mapper_x_total", labels)
    assert naming.parse_sample_key(key) == ("gpu_mapper_x_total", labels)


def test_a_sample_key_is_spelled_as_the_text_format_spells_a_sample() -> None:
    key = naming.sample_key("gpu_mapper_dmi_rpcs_total", (("method", 'Get"x'), ("result", "ok")))
    assert key == 'gpu_mapper_dmi_rpcs_total{method="Get\\"x",result="ok"}'
    [family] = text_string_to_metric_families(f"{key} 1.0\n")
    assert family.samples[0].labels == {"method": 'Get"x', "result": "ok"}


@pytest.mark.parametrize("key", ["", '{a="1"}', 'x{a="1"', "x{a=1}", 'x{a="1",}x', "x{}", 'x{a="1" b="2"}'])
def test_a_text_that_is_no_sample_key_is_refused(key: str) -> None:
    with pytest.raises(ValueError):
        naming.parse_sample_key(key)


def test_node_sample_takes_only_the_families_of_the_mapper_itself_with_their_own_labels() -> None:
    got = naming.node_sample('gpu_mapper_dmi_rpcs_total{method="GetDevice",result="ok"}')
    assert got == (naming.DMI_RPCS, "gpu_mapper_dmi_rpcs_total", (("method", "GetDevice"), ("result", "ok")))
    assert naming.node_sample('gpu_mapper_collect_duration_seconds_bucket{le="0.5"}') is not None
    assert naming.node_sample("gpu_mapper_collect_duration_seconds_count") is not None
    for key in (
        "gpu_mapper_dmi_rpcs_total",  # labels missing
        'gpu_mapper_gpus{node="x"}',  # a label the family does not have (the node comes from the batch)
        'gpu_mapper_dmi_rpcs_total{result="ok",method="GetDevice"}',  # not in the family's order
        "gpu_power_usage_watts",  # a GPU series
        "gpu_mapper_gpus_total",
        'gpu_mapper_future_thing{a="1"}',  # a newer mapper's family: skipped
        "not a key",
    ):
        assert naming.node_sample(key) is None, key


def test_every_family_of_the_mapper_itself_is_labelled_node_and_named_gpu_mapper() -> None:
    for f in naming.NODE_FAMILIES:
        assert f.name.startswith("gpu_mapper_") and f.all_labels[0] == "node" and not f.per_gpu, f.name
    assert len({f.name for f in naming.NODE_FAMILIES}) == len(naming.NODE_FAMILIES)


def test_the_health_statuses_of_the_naming_table_are_the_health_checks_own() -> None:
    assert naming.HEALTH_STATUSES == STATUSES


# --------------------------------------------------------------------------------------------------
# One list: /metrics shows what the node stream carries
# --------------------------------------------------------------------------------------------------


def test_the_node_stream_carries_exactly_the_mappers_own_series_that_metrics_shows() -> None:
    snap = a_snapshot()
    text = render_metrics(build_registry(lambda: snap)).decode()
    shown = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("gpu_mapper_") and "uuid" not in s.labels:
                assert s.labels.pop("node") == NODE, s
                shown[naming.sample_key(s.name, tuple(sorted(s.labels.items())))] = s.value
    carried = {}
    for key, v in node_values(snap).items():
        name, labels = naming.parse_sample_key(key)
        carried[naming.sample_key(name, tuple(sorted(labels)))] = float(v)
    assert carried == shown
    # expected figures, from the snapshot above
    assert shown["gpu_mapper_buffer_bytes"] == 12_345
    assert shown['gpu_mapper_buffer_dropped_batches_total{reason="size"}'] == 3
    assert shown['gpu_mapper_collect_duration_seconds_bucket{le="0.005"}'] == 1
    assert shown['gpu_mapper_collect_duration_seconds_bucket{le="+Inf"}'] == 2
    assert shown["gpu_mapper_collect_duration_seconds_sum"] == pytest.approx(3.004)
    assert shown['gpu_mapper_build_info{mode="standalone",version="0.1.0"}'] == 1
    assert shown["gpu_mapper_standalone"] == 1 and shown["gpu_mapper_gpus"] == 1
    assert shown['gpu_mapper_process_errors_total{reason="nvml"}'] == 1


def test_counts_go_as_ints_and_fractions_as_floats() -> None:
    values = node_values(a_snapshot())
    assert values["gpu_mapper_buffer_bytes"] == 12_345 and isinstance(values["gpu_mapper_buffer_bytes"], int)
    age = values["gpu_mapper_buffer_oldest_unsent_age_seconds"]
    assert age == 2.5 and isinstance(age, float)


# --------------------------------------------------------------------------------------------------
# The node stream's batches
# --------------------------------------------------------------------------------------------------


def test_the_node_stream_sends_its_first_sample_at_once_then_a_batch_per_window_on_its_topic() -> None:
    clock = FakeClock(start_wall_ms=1_780_000_000_000)
    made: list[tuple[EncodedBatch, Route | None]] = []
    drops = {"n": 0}
    ns = NodeStream(
        NODE,
        "0badcafe",
        lambda: a_snapshot(clock.wall_ms(), buffer_drops={"size": drops["n"]}),
        lambda b, r: made.append((b, r)),
        clock=clock,
        cycle_s=20.0,
        window_s=60.0,
    )
    ns.sample()
    assert len(made) == 1, "the first sample goes out alone, at once"
    for _ in range(5):  # 20, 40, 60 s: one window; 80, 100 s: the next one, not over yet
        clock.advance(20.0)
        drops["n"] += 1
        ns.sample()
    assert len(made) == 2
    ns.flush()
    assert len(made) == 3
    batches = [decode_batch(b.payload) for b, _ in made]
    assert [len(b.samples) for b in batches] == [1, 3, 2]
    assert [b.seq for b in batches] == [0, 1, 2]
    for (_, route), b in zip(made, batches, strict=True):
        assert route == Route("", topics.node_metrics_topic(NODE), 1, False)
        assert (b.node, b.device, b.uuid, b.boot_id) == (NODE, naming.NODE_DEVICE, "", "0badcafe")
    stamps = [s.ts_ms for b in batches for s in b.samples]
    assert stamps == [1_780_000_000_000 + 20_000 * i for i in range(6)]
    drops_seen = [
        s.values['gpu_mapper_buffer_dropped_batches_total{reason="size"}'] for b in batches for s in b.samples
    ]
    assert drops_seen == [0, 1, 2, 3, 4, 5]


def test_the_bridge_writes_a_node_batch_as_the_mappers_own_series_labelled_with_the_node() -> None:
    clock = FakeClock(start_wall_ms=1_780_000_000_000)
    made: list[EncodedBatch] = []
    ns = NodeStream(NODE, "0badcafe", lambda: a_snapshot(clock.wall_ms()), lambda b, r: made.append(b), clock=clock,
                    cycle_s=1.0, window_s=1.0)  # fmt: skip
    ns.sample()
    [batch] = [decode_batch(b.payload) for b in made]
    req = PendingRequest(0.0)
    n = Converter().add(req, batch, "")
    written = {}
    for buf in req.series():
        labels = dict(buf.labels)
        assert (labels.pop("node"), labels.pop("job")) == (NODE, naming.BRIDGE_JOB)
        assert "uuid" not in labels and "device" not in labels and "gpu" not in labels
        [(ts, v)] = buf.samples()
        assert ts == 1_780_000_000_000
        written[naming.sample_key(labels.pop("__name__"), tuple(sorted(labels.items())))] = v
    assert n == len(written) == len(node_values(a_snapshot()))
    assert written['gpu_mapper_mqtt_inbound_dropped_total{reason="rate \\"limited\\"\\\\n"}'] == 1


def test_a_node_batch_with_a_series_the_bridge_does_not_know_writes_the_others() -> None:
    values = {"gpu_mapper_gpus": 2, 'gpu_mapper_future_thing{a="1"}': 5, "gpu_mapper_buffer_bytes": math.nan}
    rows = [Sample("", 1000, values)]
    payload = encode_batch(rows, node=NODE, device=naming.NODE_DEVICE, uuid="", boot_id="0badcafe", seq=0).payload
    req = PendingRequest(0.0)
    assert Converter().add(req, decode_batch(payload), "") == 1
    [buf] = req.series()
    assert dict(buf.labels)["__name__"] == "gpu_mapper_gpus" and buf.samples() == [(1000, 2.0)]


def test_the_node_streams_topic_is_outside_the_telemetry_filter_and_the_bridge_subscribes_beside_it() -> None:
    topic = topics.node_metrics_topic(NODE)
    assert topic == "gpu-mapper/edge-7/metrics"
    old_filter = re.compile("^" + topics.TELEMETRY_FILTER.replace("+", "[^/]+") + "$")
    assert not old_filter.match(topic), "a bridge that predates the node stream never receives it"
    assert topics.node_filter_beside(topics.TELEMETRY_FILTER) == "gpu-mapper/+/metrics"
    assert topics.node_filter_beside("gpu-mapper/edge-7/default/+/telemetry") == "gpu-mapper/edge-7/metrics"
    assert topics.node_filter_beside("site/power") == ""
    assert topics.node_filter_beside("a/b/telemetry") == ""


# --------------------------------------------------------------------------------------------------
# A GPU's health in its state message
# --------------------------------------------------------------------------------------------------


def a_sick_gpu() -> GpuSnapshot:
    report = HealthReport(
        status="degraded",
        level=2,
        reason="persistenced-not-running",
        levels=((1, "healthy", "ok"), (2, "degraded", "persistenced-not-running"), (3, "healthy", "ok")),
        subsystems=(("driver", "degraded", "persistenced-not-running"),),
        checks=(
            CheckResult("persistenced", "degraded", "not-running"),
            CheckResult("inforom", "healthy", "ok", "inforom", (("image_version", "G520.0200.00.05"),)),
        ),
    )
    return GpuSnapshot(
        info=GpuInfo("GPU-b", 1, "H100"),
        device="default/edge-7-gpu1",
        health=report,
        health_probe=ProbeResult("slow", "", 1.25),
        probes={"pass": 7, "slow": 1},
    )


def test_a_gpus_health_travels_in_its_state_message_and_the_bridge_writes_what_metrics_shows() -> None:
    gpu = a_sick_gpu()
    payload = gpu.state_message("default/edge-7-gpu1", driver_version="550", at_ms=9000)
    doc = json.loads(payload)["health"]
    assert doc["levels"] == {"0": "degraded", "1": "healthy", "2": "degraded", "3": "healthy"}
    assert doc["subsystems"]["driver"] == "degraded" and len(doc["subsystems"]) == len(SUBSYSTEMS)
    assert doc["checks"] == {"persistenced": "degraded", "inforom": "healthy"}
    assert doc["probe"] == {"passed": True, "latency_s": 1.25} and doc["probes"] == {"pass": 7, "slow": 1}
    assert doc["inforom"] == ["G520.0200.00.05", "N/A", "N/A", "N/A"]
    status = parse_state(payload)
    assert status.health == gpu.health_status()
    req = PendingRequest(0.0)
    Converter().add_status(req, NODE, status, "GPU-b", status.identity)
    health_names = {f.series_name for f in (naming.HEALTH_STATUS, naming.HEALTH_SUBSYSTEM, naming.HEALTH_CHECK,
                    naming.HEALTH_PROBE_LATENCY, naming.HEALTH_PROBE_SUCCESS, naming.HEALTH_PROBES,
                    naming.INFOROM_INFO)}  # fmt: skip
    bridged = {}
    for buf in req.series():
        labels = dict(buf.labels)
        name = labels.pop("__name__")
        if name in health_names:
            labels.pop("job")
            [(ts, v)] = buf.samples()
            assert ts == 9000
            bridged[(name, tuple(sorted(labels.items())))] = v
    snap = MapperSnapshot(node=NODE, gpus=(gpu,))
    shown = {}
    for fam in text_string_to_metric_families(render_metrics(build_registry(lambda: snap)).decode()):
        for s in fam.samples:
            if s.name in health_names:
                shown[(s.name, tuple(sorted(s.labels.items())))] = s.value
    assert bridged == shown
    # expected figures: 4 levels, 9 subsystems and 2 checks, 3 statuses each; the probe's two; 2 outcomes; InfoROM
    assert len(shown) == (4 + 9 + 2) * 3 + 2 + 2 + 1
    key = (
        ("device", "edge-7-gpu1"),
        ("gpu", "1"),
        ("level", "2"),
        ("node", NODE),
        ("status", "degraded"),
        ("uuid", "GPU-b"),
    )
    assert shown[("gpu_mapper_health_status", key)] == 1
    probe_key = (("device", "edge-7-gpu1"), ("gpu", "1"), ("node", NODE), ("uuid", "GPU-b"))
    assert shown[("gpu_mapper_health_probe_latency_seconds", probe_key)] == 1.25


def test_a_skipped_probe_sends_no_probe_and_no_inforom_check_no_versions() -> None:
    gpu = GpuSnapshot(info=GpuInfo("GPU-c", 0, "T4"), health_probe=ProbeResult("skipped", "busy-87pct"))
    health = gpu.health_status()
    assert health.probe is None and health.inforom is None
    assert "probe" not in json.loads(gpu.state_message("d/x", driver_version="", at_ms=1))["health"]


@pytest.mark.parametrize(
    ("health", "error"),
    [
        ("ok", "'health' is not an object"),
        ({"levels": {"0": "fine"}}, "health.levels is not an object of health statuses"),
        ({"levels": {"x": "healthy"}}, "a level is not a number"),
        ({"checks": ["inforom"]}, "health.checks is not an object"),
        ({"probe": {"passed": "yes"}}, "health.probe is not"),
        ({"probe": {"passed": True, "latency_s": "fast"}}, "health.probe is not"),
        ({"probes": {"pass": -1}}, "health.probes is not an object of counts"),
        ({"inforom": ["a", "b"]}, "health.inforom is not a list of four versions"),
    ],
)
def test_a_bad_health_in_a_state_message_is_refused_saying_what_is_wrong(health: object, error: str) -> None:
    payload = json.dumps({"device": "d/g", "at_ms": 5, "health": health}).encode()
    with pytest.raises(ValueError, match=re.escape(error)):
        parse_state(payload)


def test_a_state_message_of_a_mapper_before_the_health_key_has_none() -> None:
    payload = b'{"device":"d/g","uuid":"GPU-1","ts_ms":1,"values":{},"at_ms":5,"state":"online"}'
    status = parse_state(payload)
    assert status.health is None and status.has_samples
    assert GpuHealth.from_doc({}) == GpuHealth()
