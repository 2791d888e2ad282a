"""The bridge's pure parts: series named exactly as the mapper's /metrics, dedup by sequence ranges, settings."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from mapper.bridge.config import BRIDGE_ENV_KEYS, BRIDGE_KEYS, load_bridge_settings
from mapper.bridge.core import Converter, PendingRequest, SeqDedup, bridged_series_names
from mapper.clock import FakeClock
from mapper.edge.gpu.nvml import NvmlBackend
from mapper.edge.gpu.simnvml import SimNvml
from mapper.edge.status.metrics import snapshot_metrics
from mapper.edge.status.nodestream import node_values
from mapper.edge.status.stats import DurationHistogram, GpuSnapshot, MapperSnapshot
from mapper.errors import ConfigError
from mapper.shared import naming
from mapper.shared.model import DEVICE_STATES, GpuInfo, Sample
from mapper.wire.state import GpuIdentity, parse_state, state_payload
from mapper.wire.telemetry import decode_batch, encode_batch


def a_sample():  # type: ignore[no-untyped-def]
    clock = FakeClock()
    backend = NvmlBackend(SimNvml(1, "H100", clock=clock.monotonic, seed=5, scenario="training"), clock=clock)
    backend.init()
    try:
        info = backend.list_gpus()[0]
        clock.advance(1.0)
        sample = backend.sample(info.uuid, None)
    finally:
        backend.shutdown()
    values = dict(sample.values)
    values["policy_state"] = "thermal:throttling-step1"
    values["compute_mode"] = "exclusive_process"
    values["clock_event_reasons"] = 0x4 | 0x40
    return info, replace(sample, values=values)


def test_every_series_the_bridge_writes_is_one_the_mappers_metrics_show_with_the_same_labels_and_value() -> None:
    # The telemetry batch and the retained state message the mapper would send for one GPU, and its node stream's
    # sample, through the bridge's conversion, give exactly the series the mapper's own /metrics shows: names,
    # labels (gpu index, driver_version and pci_bus_id included; the node on the mapper's own), values; the bridge
    # adds job="gpu-mapper-bridge" to each.
    info, sample = a_sample()
    device = "default/edge-1-gpu0"
    product = str(sample.values["product_name"])
    gpu = GpuSnapshot(
        info=GpuInfo(info.uuid, 3, product, pci_bus_id="00000000:17:00.0"),
        device=device,
        sample=sample,
        policy_state=str(sample.values["policy_state"]),
        state="unhealthy",
        xid_errors={79: 2, 48: 1},
        desired_power_limit_w=450.0,
    )
    snap = MapperSnapshot(
        node="edge-1",
        taken_at_ms=sample.ts_ms + 900,
        version="0.1.0",
        driver_version="550.54.15",
        gpus=(gpu,),
        buffer_bytes=4096,
        buffer_drops={"size": 2},
        dmi_rpcs={("ReportDeviceStatus", "ok"): 5},
        collect_duration=DurationHistogram().observe(0.003).observe(0.2),
        process_errors={"nvml": 1},
    )
    mapper_side = {}
    for fam in snapshot_metrics(snap):
        for s in fam.samples:
            if s.name in bridged_series_names():
                labels = {k: v for k, v in s.labels.items() if v}  # remote write: an empty label is no label
                mapper_side[(s.name, tuple(sorted(labels.items())))] = s.value
    batch = decode_batch(
        encode_batch([sample], node="edge-1", device=device, uuid=info.uuid, boot_id="ab12cd34", seq=0).payload
    )
    node_batch = decode_batch(
        encode_batch(
            [Sample("", snap.taken_at_ms, node_values(snap))],
            node="edge-1",
            device=naming.NODE_DEVICE,
            uuid="",
            boot_id="ab12cd34",
            seq=0,
        ).payload
    )
    at_ms = sample.ts_ms + 700
    status = parse_state(gpu.state_message(device, driver_version="550.54.15", at_ms=at_ms))
    assert status.identity == GpuIdentity("3", "00000000:17:00.0", "550.54.15") and status.has_samples
    req = PendingRequest(0.0)
    conv = Converter()
    n = conv.add(req, batch, info.uuid, status.identity)
    n_status = conv.add_status(req, "edge-1", status, info.uuid, status.identity)
    n_node = conv.add(req, node_batch, "", status.identity)
    bridge_side = {}
    status_names = {naming.DEVICE_STATE.name, naming.XID_ERRORS.series_name, naming.DESIRED_POWER_LIMIT.name}
    status_names |= {naming.HEALTH_STATUS.name, naming.HEALTH_SUBSYSTEM.name}
    for buf in req.series():
        labels = dict(buf.labels)
        name = labels.pop("__name__")
        assert labels.pop("job") == "gpu-mapper-bridge", name
        [(ts, value)] = buf.samples()
        # (the node stream's series: the mapper's own, no GPU labels)
        at = at_ms if name in status_names else sample.ts_ms if "uuid" in labels else snap.taken_at_ms
        assert ts == at, name
        bridge_side[(name, tuple(sorted(labels.items())))] = value
    # the state message: every device state, two XID codes, the desired cap, and each of the four health levels
    # and nine subsystems as one series per status (the GPU has no driver check or probe yet)
    assert n > 30 and n_status == len(DEVICE_STATES) + 2 + 1 + (4 + 9) * 3
    # the node stream: 16 gauges and counters without labels (GPUs, 5 of the buffer, 2 of replay, 2 published,
    # 4 of MQTT, DMI registered, standalone), build info, one drop reason, one RPC, one process error, the collect
    # duration histogram's 12 buckets (11 bounds and +Inf), sum and count, and the two lateness histograms' 15
    # buckets (14 bounds and +Inf), sum and count each, and gpu_mapper_degraded's 0 (nothing runs degraded)
    assert n_node == 16 + 1 + 1 + 1 + 1 + (12 + 2) + 2 * (15 + 2) + 1
    assert n + n_status + n_node == len(bridge_side)
    assert bridge_side == mapper_side
    assert ("gpu_clock_event_reason_active", ()) not in bridge_side
    assert {k[0] for k in bridge_side} >= {
        "gpu_power_usage_watts",
        "gpu_energy_consumption_joules_total",
        "gpu_info",
        "gpu_clock_event_reason_active",
        "gpu_compute_mode",
        "gpu_mapper_policy_state",
        "gpu_mapper_device_state",
        "gpu_xid_errors_total",
        "gpu_power_limit_desired_watts",
    }
    [info_labels] = [dict(k[1]) for k in bridge_side if k[0] == "gpu_info"]
    assert info_labels["gpu"] == "3" and info_labels["driver_version"] == "550.54.15"
    assert info_labels["pci_bus_id"] == "00000000:17:00.0"


def test_a_jetsons_float_values_are_written_in_base_units_as_its_own_metrics_show_them(tmp_path: Path) -> None:
    # A Jetson's sysfs gives floats (MHz, W), an NVML GPU mostly ints: each is scaled to its base unit (Hz, W,
    # ratio) whatever its Python type. Expected values: the sample's own times the unit's factor, written out
    # here, and the mapper's /metrics for the same sample.
    from mapper.edge.gpu.jetson import JetsonBackend
    from mapper.edge.gpu.simjetson import SimJetson, nvpmodel_command

    clock = FakeClock()
    SimJetson.create(tmp_path / "orin", "orin-agx", scenario="steady", clock=clock.monotonic)
    backend = JetsonBackend(tmp_path / "orin", nvpmodel=nvpmodel_command(tmp_path / "orin"), clock=clock)
    backend.init()
    try:
        info = backend.list_gpus()[0]
        clock.advance(1.0)
        sample = backend.sample(info.uuid, None)
    finally:
        backend.shutdown()
    v = sample.values
    assert isinstance(v["gpu_freq"], float) and isinstance(v["power_gpu_rail"], float), "the case this test is for"
    device = "default/jetson-1-gpu0"
    batch = decode_batch(
        encode_batch([sample], node="jetson-1", device=device, uuid=info.uuid, boot_id="ab12cd34", seq=0).payload
    )
    req = PendingRequest(0.0)
    Converter().add(req, batch, info.uuid, GpuIdentity("0"))
    bridge_side = {}
    for buf in req.series():
        labels = dict(buf.labels)
        [(ts, value)] = buf.samples()
        assert ts == sample.ts_ms
        assert labels.pop("job") == naming.BRIDGE_JOB  # the bridge's mark; the mapper's own /metrics has none
        bridge_side[(labels.pop("__name__"), tuple(sorted(labels.items())))] = value
    by_name = {name: value for (name, _), value in bridge_side.items()}
    mhz, percent = 1_000_000, 0.01
    assert by_name["gpu_frequency_hertz"] == float(v["gpu_freq"]) * mhz == 816e6
    assert by_name["gpu_frequency_min_hertz"] == float(v["gpu_min_freq"]) * mhz
    assert by_name["gpu_frequency_max_hertz"] == float(v["gpu_max_freq"]) * mhz
    assert by_name["gpu_emc_frequency_hertz"] == float(v["emc_freq"]) * mhz
    assert by_name["gpu_rail_power_watts"] == float(v["power_gpu_rail"])
    assert by_name["gpu_power_usage_watts"] == float(v["power_usage"])
    assert by_name["gpu_utilization_ratio"] == pytest.approx(float(v["utilization_gpu"]) * percent)
    assert by_name["gpu_shared_memory_used_bytes"] == float(v["shared_memory_used"])
    assert by_name["gpu_tj_temperature_celsius"] == float(v["temperature_tj"])
    # and every series equals the mapper's own /metrics for this sample
    gpu = GpuSnapshot(info=replace(info, index=0), device=device, sample=sample, state="online")
    mapper_side = {}
    for fam in snapshot_metrics(MapperSnapshot(node="jetson-1", gpus=(gpu,))):
        for s in fam.samples:
            # (the GPU's series of this batch: the mapper's own, labelled with the node alone, come through its node
            # stream; the device state, gpu_info and the health families through the state message)
            from_state = s.name in {"gpu_mapper_device_state", "gpu_info"} or s.name.startswith("gpu_mapper_health")
            if "uuid" in s.labels and s.name in bridged_series_names() and not from_state:
                labels = {k: v for k, v in s.labels.items() if v}
                mapper_side[(s.name, tuple(sorted(labels.items())))] = s.value
    bridge_side = {k: x for k, x in bridge_side.items() if k[0] != "gpu_info"}
    assert bridge_side == mapper_side


def test_a_state_message_from_a_mapper_before_the_status_keys_reads_as_uuid_only() -> None:
    info, sample = a_sample()
    status = parse_state(state_payload("default/g", sample))
    assert (status.device, status.uuid, status.identity, status.at_ms) == ("default/g", info.uuid, None, None)
    assert not status.has_samples
    assert Converter().add_status(PendingRequest(0.0), "n", status, info.uuid) == 0


@pytest.mark.parametrize(
    ("payload", "error"),
    [
        (b"{", "not JSON"),
        (b"[]", "not a JSON object"),
        (b'{"uuid": "GPU-1"}', "no device name"),
        (b'{"device": "d/g", "gpu": 3}', "'gpu' is not an object"),
        (b'{"device": "d/g", "gpu": {"index": -1}}', "gpu.index -1 is not a GPU index"),
        (b'{"device": "d/g", "at_ms": "now"}', "at_ms 'now' is not a time in ms"),
        (b'{"device": "d/g", "state": "sleepy"}', "state 'sleepy' is not one of ok, online"),
        (b'{"device": "d/g", "xid_errors": {"x79": 1}}', "xid_errors: 'x79': 1 is not an XID code"),
        (b'{"device": "d/g", "xid_errors": {"79": -1}}', "xid_errors: '79': -1 is not an XID code"),
        (b'{"device": "d/g", "power_limit_desired_w": "300"}', "power_limit_desired_w '300' is not a number"),
    ],
)
def test_a_bad_state_message_is_refused_saying_what_is_wrong(payload: bytes, error: str) -> None:
    with pytest.raises(ValueError, match=re.escape(error)):
        parse_state(payload)


def test_a_state_without_a_desired_power_limit_or_xids_writes_the_state_alone() -> None:
    gpu = GpuSnapshot(info=GpuInfo("GPU-1", 0, "x"), device="default/g", state="online")
    status = parse_state(gpu.state_message("default/g", driver_version="", at_ms=5000))
    assert status.identity == GpuIdentity("0", "", "")
    req = PendingRequest(0.0)
    # the device state, and the health of the four levels and nine subsystems, one series per status
    assert Converter().add_status(req, "n", status, "GPU-1", status.identity) == len(DEVICE_STATES) + (4 + 9) * 3
    states = [b for b in req.series() if dict(b.labels)["__name__"] == "gpu_mapper_device_state"]
    got = {dict(b.labels)["state"]: b.samples() for b in states}
    assert got == {s: [(5000, 1.0 if s == "online" else 0.0)] for s in DEVICE_STATES}


def test_the_naming_table_is_the_only_place_names_come_from() -> None:
    # The mapper's metrics and the bridge read the table: no series name literal left in any of their modules.
    root = Path(__file__).resolve().parents[1] / "mapper"
    for path in (root / "edge" / "status" / "metrics.py", *sorted((root / "bridge").glob("*.py"))):
        module, text = path.relative_to(root), path.read_text()
        for ps in naming.PROPERTY_SERIES:
            assert f'"{ps.family.name}"' not in text, f"{module} spells {ps.family.name} itself"
        for fam in (
            naming.GPU_INFO,
            naming.CLOCK_EVENT_REASON,
            naming.COMPUTE_MODE,
            naming.POLICY_STATE,
            naming.DEVICE_STATE,
            naming.XID_ERRORS,
            naming.DESIRED_POWER_LIMIT,
        ):
            assert f'"{fam.name}"' not in text, f"{module} spells {fam.name} itself"


def test_non_finite_and_string_values_write_nothing() -> None:
    info, sample = a_sample()
    rows = [
        replace(sample, ts_ms=1000, values={"power_usage": float("nan"), "pstate": "P0", "temperature": 40}),
        replace(sample, ts_ms=2000, values={"power_usage": 100.0, "temperature": 41}),
    ]
    batch = decode_batch(encode_batch(rows, node="n", device="d/x", uuid=info.uuid, boot_id="ab12cd34", seq=3).payload)
    req = PendingRequest(0.0)
    assert Converter().add(req, batch, info.uuid) == 3
    got = {dict(b.labels)["__name__"]: b.samples() for b in req.series()}
    assert got["gpu_power_usage_watts"] == [(2000, 100.0)]
    assert got["gpu_temperature_celsius"] == [(1000, 40.0), (2000, 41.0)]


def test_a_request_counts_every_sample_added_to_it_over_several_batches() -> None:
    info, sample = a_sample()
    req = PendingRequest(0.0)
    conv = Converter()
    added = []
    for seq in range(3):
        rows = [
            replace(sample, ts_ms=1000 * (seq * 2 + i), values={"power_usage": 100.0 + i, "temperature": 40})
            for i in range(2)
        ]
        batch = decode_batch(
            encode_batch(rows, node="n", device="d/x", uuid=info.uuid, boot_id="ab12cd34", seq=seq).payload
        )
        added.append(conv.add(req, batch, info.uuid))
    assert added == [4, 4, 4], "two values in each of two rows"
    assert req.samples == 12 == sum(len(b.samples()) for b in req.series())


def test_a_product_name_or_policy_state_that_is_no_text_writes_no_info_series() -> None:
    info, sample = a_sample()
    rows = [replace(sample, ts_ms=1000, values={"product_name": 7, "policy_state": 1, "temperature": 40})]
    batch = decode_batch(encode_batch(rows, node="n", device="d/x", uuid=info.uuid, boot_id="ab12cd34", seq=0).payload)
    req = PendingRequest(0.0)
    assert Converter().add(req, batch, info.uuid) == 1
    assert [dict(b.labels)["__name__"] for b in req.series()] == ["gpu_temperature_celsius"]


# --------------------------------------------------------------------------------------------------
# Dedup
# --------------------------------------------------------------------------------------------------

K = ("edge-1", "default/x", "ab12cd34", "gpu-mapper/edge-1/default/x/telemetry")


def test_a_batch_seen_again_is_covered_and_a_merged_batch_overlaps_only_what_was_written() -> None:
    d = SeqDedup()
    assert d.check(K, 0, 0) == (False, [])
    for seq in (0, 1, 2, 5):
        d.record(K, seq, seq, seq * 10_000, seq * 10_000 + 9_000)
    assert d.check(K, 1, 1)[0] is True
    assert d.check(K, 0, 2)[0] is True, "adjacent ranges merge"
    covered, overlap = d.check(K, 0, 6)  # a merged batch of 0..6: 3, 4 and 6 are new
    assert covered is False
    assert sorted(overlap) == [(0, 29_000), (50_000, 59_000)]
    assert d.check(K, 3, 4) == (False, [])
    assert d.check((*K[:2], "other-boot", K[3]), 1, 1) == (False, [])
    d.record(K, 0, 6, 0, 69_000)
    assert d.check(K, 3, 4)[0] is True
    assert d.check(K, 6, 7) == (False, [(0, 69_000)])


def test_ranges_one_sequence_apart_stay_apart_whichever_arrives_first() -> None:
    """5..7 written, then 1..3: 4 was never written and must not read as a duplicate."""
    d = SeqDedup()
    d.record(K, 5, 7, 50_000, 79_000)
    d.record(K, 1, 3, 10_000, 39_000)
    assert d.check(K, 4, 4) == (False, [])
    assert d.check(K, 3, 5) == (False, [(50_000, 79_000), (10_000, 39_000)])
    d.record(K, 4, 4, 40_000, 49_000)
    assert d.check(K, 1, 7) == (True, [(10_000, 79_000)]), "adjacent now: one range"


def test_dedup_memory_is_bounded_and_forgetting_only_lets_duplicates_through() -> None:
    d = SeqDedup(max_streams=3, max_ranges=4)
    for seq in range(0, 20, 2):  # ten disjoint ranges
        d.record(K, seq, seq, seq, seq)
    assert d.forgotten_ranges == 6
    assert d.check(K, 0, 0) == (False, []), "the oldest ranges are forgotten"
    assert d.check(K, 18, 18)[0] is True
    for i in range(5):
        d.record(("n", f"d{i}", "b", "t"), 0, 0, 0, 0)
    assert len(d) == 3 and d.forgotten_streams == 3


def test_a_sequence_number_used_again_for_other_data_is_no_duplicate_and_goes_backwards_once() -> None:
    """What identifies a batch is its number AND its samples' time range: a mapper that started a stream's numbering
    again under the same boot id sends seq 0.. again with newer samples; those are written (never dropped as
    duplicates), the first one counted as the sequence going backwards; a true copy of either is a duplicate."""
    d = SeqDedup()
    # The first numbering: seqs 0..9, ten seconds each, from t = 0.
    for seq in range(10):
        assert not d.seen(K, seq, seq * 10_000, seq * 10_000 + 9_000)
        anomaly, _, epoch = d.observe(K, seq, seq * 10_000, seq * 10_000 + 9_000)
        assert anomaly is None
        d.record(K, seq, seq, seq * 10_000, seq * 10_000 + 9_000, epoch)
    assert d.seen(K, 4, 40_000, 49_000), "a copy of batch 4"
    # The numbering starts again at t = 200 s: the same numbers, newer samples.
    later = 200_000
    assert not d.seen(K, 0, later, later + 9_000), "seq 0 again with other data is not a duplicate"
    anomaly, before, epoch = d.observe(K, 0, later, later + 9_000)
    assert (anomaly, before) == ("backwards", 9)
    d.record(K, 0, 0, later, later + 9_000, epoch)
    for seq in range(1, 12):
        ts = later + seq * 10_000
        assert not d.seen(K, seq, ts, ts + 9_000), f"seq {seq} of the new numbering taken for the old one's"
        anomaly, _, epoch = d.observe(K, seq, ts, ts + 9_000)
        assert anomaly is None, (seq, anomaly)
        d.record(K, seq, seq, ts, ts + 9_000, epoch)
    # Copies of either numbering are still duplicates.
    assert d.seen(K, 3, 30_000, 39_000) and d.seen(K, 3, later + 30_000, later + 39_000)
    assert not d.seen(K, 12, later + 120_000, later + 129_000), "never written"


def test_a_jump_past_the_tolerance_is_a_gap_and_a_reorder_within_it_is_not() -> None:
    d = SeqDedup(gap_tolerance=20)
    for seq in (0, 1, 3, 2):  # a replay reordered 2 and 3
        anomaly, _, epoch = d.observe(K, seq, seq * 10, seq * 10 + 9)
        assert anomaly is None
        d.record(K, seq, seq, seq * 10, seq * 10 + 9, epoch)
    assert d.observe(K, 24, 240, 249)[0] is None, "20 numbers missing: within the tolerance"
    anomaly, before, _ = d.observe(K, 100, 1000, 1009)
    assert (anomaly, before) == ("gap", 24)
    assert d.observe(K, 50, 500, 509)[0] is None, "an older one filling the hole is not backwards"


# --------------------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------------------


def test_settings_come_from_the_file_then_the_environment_then_flags(tmp_path: Path) -> None:
    cfg = tmp_path / "bridge.yaml"
    cfg.write_text(
        "bridge:\n  mqtt: {url: 'mqtt://broker:1883', sessionExpiry: 2h}\n"
        "  remoteWrite: {url: 'http://prom:9090/api/v1/write', version: 2}\n"
        "  group: g1\n  batch: {maxSamples: 500, maxDelay: 250ms}\n  spoolDir: /spool\n"
    )
    s = load_bridge_settings(str(cfg), env={}, flags={})
    assert (s.mqtt.url, s.mqtt_session_expiry_s, s.remote_write_version, s.group) == (
        "mqtt://broker:1883",
        7200,
        2,
        "g1",
    )
    assert (s.batch_max_samples, s.batch_max_delay_s, s.spool_dir) == (500, 0.25, "/spool")
    assert s.shared_filter == "$share/g1/gpu-mapper/+/+/+/telemetry"
    assert s.state_filter == "gpu-mapper/+/+/+/state"
    s = load_bridge_settings(str(cfg), env={"GPU_MAPPER_BRIDGE_GROUP": "g2"}, flags={})
    assert s.group == "g2"
    s = load_bridge_settings(str(cfg), env={"GPU_MAPPER_BRIDGE_GROUP": "g2"}, flags={"group": "g3"})
    assert s.group == "g3"


def test_every_key_has_an_env_variable_and_bad_settings_are_named(tmp_path: Path) -> None:
    assert set(BRIDGE_ENV_KEYS) == set(BRIDGE_KEYS)
    assert all(v.startswith("GPU_MAPPER_BRIDGE_") for v in BRIDGE_ENV_KEYS.values())
    ok = {"mqtt_url": "mqtt://b:1883", "remote_write": "http://p:9090/api/v1/write"}
    with pytest.raises(ConfigError, match=r"remoteWrite\.version"):
        load_bridge_settings(None, env={}, flags={**ok, "remote_write_version": 3})
    with pytest.raises(ConfigError, match=r"bridge\.mqtt\.url"):
        load_bridge_settings(None, env={}, flags={"remote_write": ok["remote_write"]})
    with pytest.raises(ConfigError, match="GPU_MAPPER_BRIDGE_BATCH_MAX_SAMPLES"):
        load_bridge_settings(None, env={"GPU_MAPPER_BRIDGE_BATCH_MAX_SAMPLES": "lots"}, flags=ok)
    with pytest.raises(ConfigError, match="group"):
        load_bridge_settings(None, env={}, flags={**ok, "group": "a/b"})
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("bridge:\n  remoteWrite: {urll: x}\n")
    with pytest.raises(ConfigError, match=r"bridge\.remoteWrite\.urll"):
        load_bridge_settings(str(cfg), env={}, flags=ok)


def test_export_names_a_missing_spool_dir_and_writes_just_eof_for_an_empty_one(tmp_path: Path) -> None:
    import io

    from mapper.bridge.app import export_openmetrics

    with pytest.raises(ConfigError, match="no such directory"):
        export_openmetrics(tmp_path / "nowhere", io.StringIO())
    out = io.StringIO()
    assert export_openmetrics(tmp_path, out) == 0
    assert out.getvalue() == "# EOF\n"


def test_the_mqtt_session_options_of_the_bridge_are_checked() -> None:
    from mapper.net.mqtt import MqttSession, _unshared

    with pytest.raises(ConfigError, match="session expiry needs MQTT 5"):
        MqttSession("mqtt://b:1883", "c", session_expiry_s=60)
    with pytest.raises(ConfigError, match="receive maximum"):
        MqttSession("mqtt://b:1883", "c", mqtt5=True, receive_maximum=0)
    s = MqttSession("mqtt://b:1883", "c", mqtt5=True, session_expiry_s=60, receive_maximum=10, manual_ack=True)
    assert s.generation == 0 and s.manual_ack
    assert _unshared("$share/g/gpu-mapper/+/+/+/telemetry") == "gpu-mapper/+/+/+/telemetry"
    assert _unshared("gpu-mapper/#") == "gpu-mapper/#"


def test_the_workload_series_of_the_telemetry_stream_are_bridged_as_the_mappers_metrics_show_them() -> None:
    from mapper.edge.processes.loop import telemetry_values
    from mapper.edge.processes.monitor import GpuWorkloads, PodUse, ProcessRow

    uuid, device = "GPU-7d6c5b4a-0000-4000-8000-000000000001", "default/edge-1-gpu0"
    report = GpuWorkloads(
        uuid,
        ts_ms=5000,
        process_count=3,
        pods=(
            PodUse("ml", "trainer-0", "pytorch", 1234.5, 212.25, 30 << 30, 1, 0.42),
            PodUse("vision", "detector-7f", "triton", 99.0, 17.5, 8 << 30, 2, None),
            PodUse("", "", "", 3.0, 1.0, 1 << 29, 1, 0.01),  # host processes
            PodUse("", "other", "", 7.0, 0.0, 0, 0, None),
        ),
        idle_joules_total=4000.0,
        unattributed_joules_total=12.0,
        idle_power_w=61.5,
        processes=(ProcessRow(31, "ml", "trainer-0", "pytorch", 2 << 30, 0.2),),
        leaking_pids=(31, 77),  # 77: a process outside the top rows, owner not known
    )
    snap = MapperSnapshot(
        node="edge-1", gpus=(GpuSnapshot(info=GpuInfo(uuid, 0, "x"), device=device),), workloads=(report,)
    )
    families = {*(f.series_name for f in naming.POD_TELEMETRY_FIELDS.values())}
    families |= {f.series_name for f in naming.PROCESS_GPU_SERIES.values()}
    families.add(naming.LEAK_SUSPECTED.series_name)
    assert families <= bridged_series_names()
    mapper_side = {}
    for fam in snapshot_metrics(snap):
        for s in fam.samples:
            if s.name in families:
                labels = {k: v for k, v in s.labels.items() if k != "gpu" and v}
                mapper_side[(s.name, tuple(sorted(labels.items())))] = s.value
    row = replace(a_sample()[1], uuid=uuid, ts_ms=report.ts_ms, values=telemetry_values(report))
    encoded = encode_batch([row], node="edge-1", device=device, uuid=uuid, boot_id="ab12cd34", seq=0)
    batch = decode_batch(encoded.payload)
    req = PendingRequest(0.0)
    Converter().add(req, batch, uuid)
    bridge_side = {}
    for buf in req.series():
        labels = dict(buf.labels)
        name = labels.pop("__name__")
        assert labels.pop("job") == "gpu-mapper-bridge"
        [(ts, value)] = buf.samples()
        assert ts == report.ts_ms
        bridge_side[(name, tuple(sorted(labels.items())))] = value
    assert bridge_side == mapper_side
    trainer = ("namespace", "ml"), ("node", "edge-1"), ("pod", "trainer-0"), ("uuid", uuid)
    key = tuple(sorted((("container", "pytorch"), ("device", "edge-1-gpu0"), *trainer)))
    assert bridge_side[("gpu_pod_energy_joules_total", key)] == 1234.5
    assert bridge_side[("gpu_pod_memory_used_bytes", key)] == 30 << 30
    leaks = sorted(dict(k[1])["pid"] for k in bridge_side if k[0] == "gpu_process_memory_leak_suspected")
    assert leaks == ["31", "77"]
    assert len({k[0] for k in bridge_side}) == 9
