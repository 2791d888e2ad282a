"""The Prometheus collector: every catalog property per GPU in base units, built at scrape time."""

from __future__ import annotations

import functools
import shutil
import subprocess
from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import generate_latest

from mapper.edge.status.metrics import (
    EXPORTED_PROPERTIES,
    GPU_LABELS,
    TextRenderer,
    build_registry,
    metric_names,
    render_metrics,
)
from mapper.edge.status.stats import LATENESS_BOUNDS_S, DurationHistogram, GpuSnapshot, MapperSnapshot
from mapper.shared.model import CLOCK_EVENT_REASONS, PROPERTIES, GpuInfo, Sample, Value

H100 = "GPU-11111111-2222-3333-4444-555555555555"
T4 = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"


def h100_values() -> dict[str, Value]:
    return {
        "uuid": H100,
        "product_name": "NVIDIA_H100_80GB_HBM3",
        "utilization_gpu": 87,
        "utilization_memory": 40,
        "memory_used": 30 * 2**30,
        "memory_total": 80 * 2**30,
        "memory_reserved": 530 * 2**20,
        "temperature": 61,
        "temperature_memory": 70,
        "temperature_slowdown": 89,
        "temperature_shutdown": 92,
        "power_usage": 612.5,
        "energy_consumption": 123456.75,
        "energy_consumption_age": 12.0,
        "power_limit_enforced": 650.0,
        "power_limit_min": 200.0,
        "power_limit_max": 700.0,
        "power_limit_default": 700.0,
        "clock_sm": 1755,
        "clock_memory": 2619,
        "clock_sm_max": 1980,
        "clock_event_reasons": 0x24,
        "clock_event_reasons_text": "sw_power_cap,sw_thermal_slowdown",
        "pstate": 0,
        "pcie_tx": 1_000_000,
        "pcie_rx": 2_000_000,
        "ecc_errors_corrected": 3,
        "ecc_errors_uncorrected": 0,
        "remapped_rows_uncorrectable": 0,
        "remapped_rows_pending": False,
        "xid_last": 0,
        "power_limit": 650.0,
        "locked_gpu_clock_min": 0,
        "locked_gpu_clock_max": 1755,
        "locked_memory_clock_min": 0,
        "locked_memory_clock_max": 0,
        "persistence_mode": True,
        "compute_mode": "exclusive_process",
        "desired_status": "power_limit:applied",
        "policy_state": "normal",
    }


def make_snapshot(*, with_t4: bool = True) -> MapperSnapshot:
    h100 = GpuSnapshot(
        info=GpuInfo(
            uuid=H100, index=0, name="NVIDIA H100 80GB HBM3", pci_bus_id="00000000:17:00.0", driver_version="550.54.15"
        ),
        device="default/edge1-gpu0",
        node="edge1",
        sample=Sample(uuid=H100, ts_ms=1_780_000_000_000, values=h100_values()),
        desired_status="power_limit:applied,locked_gpu_clocks:applied",
        policy_state="normal",
        state="ok",
        xid_errors={13: 2, 79: 1},
        desired_power_limit_w=650.0,
    )
    t4 = GpuSnapshot(
        info=GpuInfo(uuid=T4, index=1, name="Tesla T4", pci_bus_id="00000000:65:00.0"),
        device="",
        node="edge1",
        sample=Sample(
            uuid=T4,
            ts_ms=1_780_000_000_500,
            values={"utilization_gpu": 5, "temperature": 38, "power_usage": 14.25, "power_limit": 70.0},
        ),
        state="online",
    )
    return MapperSnapshot(
        node="edge1",
        taken_at_ms=1_780_000_001_000,
        version="0.1.0",
        mode="dmi",
        driver_version="550.54.15",
        gpus=(h100, t4) if with_t4 else (h100,),
        buffer_bytes=1_500_000,
        buffer_batches=12,
        buffer_max_bytes=256 * 2**20,
        buffer_oldest_age_s=42.5,
        buffer_drops={"max-age": 3, "max-bytes": 1},
        replay_remaining_batches=7,
        replay_remaining_bytes=70_000,
        telemetry_published_batches=100,
        telemetry_published_bytes=1_000_000,
        mqtt_enabled=True,
        mqtt_connected=True,
        mqtt_reconnects=2,
        dmi_registered=True,
        dmi_rpcs={("ReportDeviceStatus", "ok"): 40, ("MapperRegister", "unavailable"): 1},
        reconcile_actions={("power_limit", "applied"): 2, ("locked_gpu_clocks", "rejected"): 1},
        drift_reapplies={"power_limit": 1},
        desired_rejections={"out-of-range": 1},
        policy_overrides_active={"thermal": 1},
        policy_events={("thermal", "engage"): 1, ("thermal", "release"): 0},
        collect_duration=DurationHistogram().observe(0.0004).observe(0.003).observe(3.0),
        collect_lateness=DurationHistogram(LATENESS_BOUNDS_S).observe(0.0005).observe(0.012).observe(0.07),
        collect_behind=DurationHistogram(LATENESS_BOUNDS_S).observe(0.0).observe(0.0).observe(0.004),
        collect_errors={"transient": 2},
    )


def scrape(snapshot: MapperSnapshot) -> CollectorRegistry:
    return build_registry(lambda: snapshot)


def gpu_labels(uuid: str = H100, index: str = "0", device: str = "edge1-gpu0") -> dict[str, str]:
    return {"uuid": uuid, "gpu": index, "device": device, "node": "edge1"}


def test_every_catalog_property_with_a_prometheus_name_is_exported_per_gpu_in_base_units() -> None:
    reg = scrape(make_snapshot())
    values = h100_values()
    assert EXPORTED_PROPERTIES, "the catalog names Prometheus metrics"
    nvml_exported = {p.name for p in EXPORTED_PROPERTIES if p.source != "jetson"}  # (a Jetson's are not an H100's)
    assert nvml_exported - set(values) == {"fan_speed"}  # H100s are passive
    for spec in EXPORTED_PROPERTIES:
        if spec.name not in values:
            assert reg.get_sample_value(spec.prom_name, gpu_labels()) is None
            continue
        raw = values[spec.name]
        expected = (1.0 if raw else 0.0) if isinstance(raw, bool) else float(raw) * spec.prom_scale
        got = reg.get_sample_value(spec.prom_name, gpu_labels())
        assert got == pytest.approx(expected), spec.name


def test_units_are_converted_to_prometheus_base_units() -> None:
    reg = scrape(make_snapshot())
    assert reg.get_sample_value("gpu_utilization_ratio", gpu_labels()) == pytest.approx(0.87)
    assert reg.get_sample_value("gpu_clock_sm_hertz", gpu_labels()) == pytest.approx(1755e6)
    assert reg.get_sample_value("gpu_power_usage_watts", gpu_labels()) == pytest.approx(612.5)
    assert reg.get_sample_value("gpu_memory_used_bytes", gpu_labels()) == 30 * 2**30
    assert reg.get_sample_value("gpu_energy_consumption_joules_total", gpu_labels()) == pytest.approx(123456.75)


def test_a_property_absent_from_the_sample_has_no_series_rather_than_zero() -> None:
    reg = scrape(make_snapshot())
    t4 = gpu_labels(T4, "1", "")
    assert reg.get_sample_value("gpu_temperature_celsius", t4) == 38
    assert reg.get_sample_value("gpu_fan_speed_ratio", t4) is None
    assert reg.get_sample_value("gpu_energy_consumption_joules_total", t4) is None


def test_gpu_info_carries_product_name_driver_and_pci_bus_id() -> None:
    reg = scrape(make_snapshot())
    labels = {
        **gpu_labels(),
        "product_name": "NVIDIA H100 80GB HBM3",
        "driver_version": "550.54.15",
        "pci_bus_id": "00000000:17:00.0",
    }
    assert reg.get_sample_value("gpu_info", labels) == 1
    # A GPU without its own driver version takes the node's.
    t4 = {**gpu_labels(T4, "1", ""), "product_name": "Tesla T4", "driver_version": "550.54.15"}
    assert reg.get_sample_value("gpu_info", {**t4, "pci_bus_id": "00000000:65:00.0"}) == 1


def test_clock_event_reasons_become_one_zero_or_one_series_per_bit() -> None:
    reg = scrape(make_snapshot())
    active = {
        name: reg.get_sample_value("gpu_clock_event_reason_active", {**gpu_labels(), "reason": name})
        for _, name in CLOCK_EVENT_REASONS
    }
    assert active["sw_power_cap"] == 1
    assert active["sw_thermal_slowdown"] == 1
    assert sum(v for v in active.values() if v is not None) == 2
    assert all(v is not None for v in active.values())


def test_compute_mode_is_a_labelled_gauge_with_one_mode_set() -> None:
    reg = scrape(make_snapshot())
    got = {
        m: reg.get_sample_value("gpu_compute_mode", {**gpu_labels(), "mode": m})
        for m in ("default", "exclusive_process", "prohibited")
    }
    assert got == {"default": 0, "exclusive_process": 1, "prohibited": 0}


def test_xid_errors_are_counted_per_gpu_and_code() -> None:
    reg = scrape(make_snapshot())
    assert reg.get_sample_value("gpu_xid_errors_total", {**gpu_labels(), "xid": "13"}) == 2
    assert reg.get_sample_value("gpu_xid_errors_total", {**gpu_labels(), "xid": "79"}) == 1


def test_device_state_and_policy_state_are_exported_per_gpu() -> None:
    reg = scrape(make_snapshot())
    assert reg.get_sample_value("gpu_mapper_device_state", {**gpu_labels(), "state": "ok"}) == 1
    assert reg.get_sample_value("gpu_mapper_device_state", {**gpu_labels(), "state": "unhealthy"}) == 0
    assert reg.get_sample_value("gpu_mapper_policy_state", {**gpu_labels(), "state": "normal"}) == 1
    assert reg.get_sample_value("gpu_power_limit_desired_watts", gpu_labels()) == 650


def node_value(reg: CollectorRegistry, name: str, labels: dict[str, str] | None = None) -> float | None:
    """A sample of the mapper's own series: every one is labelled with the node."""
    return reg.get_sample_value(name, {"node": "edge1", **(labels or {})})


def test_mapper_self_metrics_cover_buffer_links_desired_state_policies_and_collection() -> None:
    reg = scrape(make_snapshot())
    g = functools.partial(node_value, reg)
    assert g("gpu_mapper_buffer_bytes") == 1_500_000
    assert g("gpu_mapper_buffer_batches") == 12
    assert g("gpu_mapper_buffer_max_bytes") == 256 * 2**20
    assert g("gpu_mapper_buffer_oldest_unsent_age_seconds") == 42.5
    assert g("gpu_mapper_buffer_dropped_batches_total", {"reason": "max-age"}) == 3
    assert g("gpu_mapper_replay_remaining_batches") == 7
    assert g("gpu_mapper_telemetry_published_batches_total") == 100
    assert g("gpu_mapper_mqtt_connected") == 1
    assert g("gpu_mapper_mqtt_reconnects_total") == 2
    assert g("gpu_mapper_dmi_registered") == 1
    assert g("gpu_mapper_dmi_rpcs_total", {"method": "MapperRegister", "result": "unavailable"}) == 1
    assert g("gpu_mapper_reconcile_actions_total", {"property": "power_limit", "result": "applied"}) == 2
    assert g("gpu_mapper_drift_reapplies_total", {"property": "power_limit"}) == 1
    assert g("gpu_mapper_desired_rejections_total", {"reason": "out-of-range"}) == 1
    assert g("gpu_mapper_policy_overrides_active", {"policy": "thermal"}) == 1
    assert g("gpu_mapper_policy_events_total", {"policy": "thermal", "action": "engage"}) == 1
    assert g("gpu_mapper_collect_errors_total", {"reason": "transient"}) == 2
    assert g("gpu_mapper_build_info", {"version": "0.1.0", "mode": "dmi", "node": "edge1"}) == 1
    assert g("gpu_mapper_gpus") == 2


def test_collect_duration_is_a_histogram_with_cumulative_buckets() -> None:
    reg = scrape(make_snapshot())
    g = functools.partial(node_value, reg)
    assert g("gpu_mapper_collect_duration_seconds_count") == 3
    assert g("gpu_mapper_collect_duration_seconds_sum") == pytest.approx(3.0034)
    assert g("gpu_mapper_collect_duration_seconds_bucket", {"le": "0.001"}) == 1
    assert g("gpu_mapper_collect_duration_seconds_bucket", {"le": "0.005"}) == 2
    assert g("gpu_mapper_collect_duration_seconds_bucket", {"le": "2.5"}) == 2
    assert g("gpu_mapper_collect_duration_seconds_bucket", {"le": "+Inf"}) == 3


def test_collect_lateness_is_a_histogram_with_buckets_down_to_a_millisecond() -> None:
    reg = scrape(make_snapshot())
    g = functools.partial(node_value, reg)
    assert g("gpu_mapper_collect_lateness_seconds_count") == 3
    assert g("gpu_mapper_collect_lateness_seconds_sum") == pytest.approx(0.0825)
    assert g("gpu_mapper_collect_lateness_seconds_bucket", {"le": "0.001"}) == 1
    assert g("gpu_mapper_collect_lateness_seconds_bucket", {"le": "0.015"}) == 2
    assert g("gpu_mapper_collect_lateness_seconds_bucket", {"le": "0.05"}) == 2
    assert g("gpu_mapper_collect_lateness_seconds_bucket", {"le": "0.075"}) == 3
    assert g("gpu_mapper_collect_behind_other_gpus_seconds_count") == 3
    assert g("gpu_mapper_collect_behind_other_gpus_seconds_bucket", {"le": "0.001"}) == 2
    assert g("gpu_mapper_collect_behind_other_gpus_seconds_bucket", {"le": "0.005"}) == 3
    snapshot = make_snapshot()
    back = MapperSnapshot.from_json(snapshot.to_json())
    assert (back.collect_lateness, back.collect_behind) == (snapshot.collect_lateness, snapshot.collect_behind)


def test_a_gpu_that_leaves_the_snapshot_leaves_no_stale_series() -> None:
    current = {"snap": make_snapshot()}
    reg = build_registry(lambda: current["snap"])
    t4 = gpu_labels(T4, "1", "")
    assert reg.get_sample_value("gpu_temperature_celsius", t4) == 38
    current["snap"] = make_snapshot(with_t4=False)
    text = render_metrics(reg).decode()
    assert T4 not in text
    assert H100 in text


def test_each_scrape_takes_exactly_one_snapshot_and_nothing_at_registration() -> None:
    calls = []

    def snapshot() -> MapperSnapshot:
        calls.append(1)
        return make_snapshot()

    reg = build_registry(snapshot)
    assert calls == []
    render_metrics(reg)
    render_metrics(reg)
    assert len(calls) == 2


def test_new_values_show_up_on_the_next_scrape() -> None:
    snap = make_snapshot(with_t4=False)
    current = {"snap": snap}
    reg = build_registry(lambda: current["snap"])
    assert reg.get_sample_value("gpu_temperature_celsius", gpu_labels()) == 61
    gpu = snap.gpus[0]
    assert gpu.sample is not None
    hotter = replace(gpu, sample=replace(gpu.sample, values={**gpu.sample.values, "temperature": 84}))
    current["snap"] = replace(snap, gpus=(hotter,))
    assert reg.get_sample_value("gpu_temperature_celsius", gpu_labels()) == 84


def test_every_per_gpu_series_has_the_uuid_gpu_device_and_node_labels() -> None:
    reg = scrape(make_snapshot())
    checked = 0
    for fam in reg.collect():
        for s in fam.samples:
            if (s.name.startswith("gpu_") and not s.name.startswith("gpu_mapper_")) or "uuid" in s.labels:
                assert set(GPU_LABELS) <= set(s.labels), s
                checked += 1
    assert checked > 50


def test_the_metric_names_list_matches_the_catalog_and_the_collector() -> None:
    names = metric_names()
    for spec in PROPERTIES:
        if spec.prom_name:
            assert spec.prom_name in names
    for expected in (
        "gpu_info",
        "gpu_clock_event_reason_active",
        "gpu_xid_errors_total",
        "gpu_mapper_collect_duration_seconds_bucket",
        "gpu_mapper_buffer_dropped_batches_total",
    ):
        assert expected in names
    text = render_metrics(scrape(make_snapshot())).decode()
    emitted = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    assert emitted <= names


def test_an_empty_node_still_renders_self_metrics() -> None:
    reg = scrape(MapperSnapshot(node="edge1"))
    assert node_value(reg, "gpu_mapper_gpus") == 0
    assert reg.get_sample_value("gpu_temperature_celsius", gpu_labels()) is None


def test_promtool_check_metrics_accepts_the_output() -> None:
    assert shutil.which("promtool"), "promtool is needed (Debian package prometheus; scripts/test.sh installs it)"
    text = render_metrics(scrape(make_snapshot()))
    proc = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, timeout=30)
    assert proc.returncode == 0, proc.stdout.decode() + proc.stderr.decode()
    assert proc.stdout.strip() == b"" and proc.stderr.strip() == b"", "promtool has lint remarks"


# --- the text renderer: generate_latest's bytes, cheaper -----------------------------------------------------------


class _Families:
    """A collector of fixed families, for ``generate_latest``."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def awkward_snapshot() -> MapperSnapshot:
    """Label values that need escaping, values that need Go's float format, a GPU without a sample."""
    snap = make_snapshot()
    h100, t4 = snap.gpus
    assert h100.sample is not None
    odd_info = replace(h100.info, name='NVIDIA "H100"\\ line\nbreak', driver_version="550.54.15 \u00e9")
    big = {**h100.sample.values, "energy_consumption": 12_345_678.5, "pcie_tx": 1e21, "power_usage": -0.0}
    odd = replace(h100, info=odd_info, sample=replace(h100.sample, values=big), policy_state='thermal "hold"')
    bare = replace(t4, sample=None)
    return replace(snap, gpus=(odd, bare))


@pytest.mark.parametrize("make", [make_snapshot, awkward_snapshot, lambda: MapperSnapshot(node="edge1")])
def test_the_renderer_writes_exactly_what_generate_latest_writes(make: object) -> None:
    snap = make()  # type: ignore[operator]
    reg = scrape(snap)
    expected = generate_latest(reg)
    renderer = TextRenderer()
    assert render_metrics(reg, renderer) == expected
    assert render_metrics(reg, renderer) == expected, "the second scrape (label texts from the cache) differs"
    assert render_metrics(reg) == expected


def test_the_renderer_handles_created_timestamps_histograms_and_other_types_like_generate_latest() -> None:
    counter = CounterMetricFamily("jobs", "jobs done\nby kind \\ source", labels=("kind",))
    counter.add_metric(["a"], 3, created=1_700_000_000.25)
    counter.add_metric(['b"\\'], 4.5, timestamp=1_700_000_001.5)
    gauge = GaugeMetricFamily("temp_celsius", "temperature", labels=("z", "a", "m"))
    for value in (float("inf"), float("-inf"), float("nan"), 1e6, 999_999.5, 2.5e-7, -3e20, 0, 7):
        gauge.add_metric(["z1", f"a{value}", "m"], value)
    hist = HistogramMetricFamily("wait_seconds", "waits", labels=("where",))
    hist.add_metric(["here"], [("0.1", 1.0), ("1e+06", 2.0), ("+Inf", 3.0)], sum_value=4.25)
    plain = Metric("raw_thing", "no type", "unknown")
    plain.add_sample("raw_thing", {}, 1.0)
    info = Metric("build", "build info", "info")
    info.add_sample("build_info", {"version": "1"}, 1.0)
    families = [counter, gauge, hist, plain, info]
    assert TextRenderer().render(families) == generate_latest(_Families(families))


def test_label_texts_kept_between_scrapes_follow_changed_labels_and_the_cache_bound() -> None:
    renderer = TextRenderer(max_label_sets=3)
    first = make_snapshot()
    assert renderer.render(scrape(first).collect()) == generate_latest(scrape(first))
    h100 = replace(first.gpus[0], policy_state="thermal-throttle", device="default/renamed")
    second = replace(first, gpus=(h100,))
    text = renderer.render(scrape(second).collect())
    assert text == generate_latest(scrape(second))
    assert b'device="renamed"' in text and b"edge1-gpu0" not in text
    assert b'state="thermal-throttle"' in text
    # Past its bound the cache started afresh: it holds the second scrape's label sets only.
    label_sets = {tuple(s.labels.items()) for fam in scrape(second).collect() for s in fam.samples if s.labels}
    assert len(renderer._label_texts) == len(label_sets)


def test_docs_metrics_md_lists_every_series_of_metrics_and_of_the_bridge() -> None:
    """docs/metrics.md stays true: every series name /metrics can show and the bridge can write is on it (a
    histogram's parts by the histogram's name), and it names no gpu_ series that neither writes."""
    import re
    from pathlib import Path

    from mapper.bridge.core import series_types
    from mapper.edge.status.metrics import metric_names

    text = (Path(__file__).resolve().parents[1] / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"`(gpu_[a-z0-9_]+)`", text))
    written = set(metric_names()) | set(series_types())

    def family(name: str) -> str:
        base = re.sub(r"_(bucket|sum|count)$", "", name)
        return base if base + "_bucket" in written else name

    assert {family(n) for n in written} - documented == set()
    assert documented - {family(n) for n in written} == set()
