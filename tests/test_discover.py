"""``gpu-mapper discover``: GPUs -> Device YAML that KubeEdge accepts."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from mapper.edge.gpu.nvml import NvmlBackend
from mapper.edge.gpu.simnvml import SimNvml
from mapper.shared.model import NVML_PROPERTIES, GpuInfo, family_properties
from mapper.tools.discover import (
    DEFAULT_REPORT_CYCLE_MS,
    DEFAULT_STATE_REPORT_CYCLE_MS,
    device_name,
    device_yaml,
    probe_all,
)
from tests.test_device_models import assert_valid_kubeedge, needs_crds

PROPERTIES = family_properties("nvml")  # what an NVML GPU's Device lists


def sim_gpus(count: int, profile: str = "H100") -> list[GpuInfo]:
    nvml = SimNvml(count, profile, seed=0, clock=lambda: 0.0)
    nvml.nvmlInit()
    out = []
    for i in range(nvml.nvmlDeviceGetCount()):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        out.append(
            GpuInfo(
                uuid=nvml.nvmlDeviceGetUUID(h),
                index=i,
                name=nvml.nvmlDeviceGetName(h),
                pci_bus_id=str(nvml.nvmlDeviceGetPciInfo(h).busId),
            )
        )
    return out


def docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d is not None]


@needs_crds
def test_discover_for_two_simulated_gpus_prints_two_valid_devices() -> None:
    gpus = sim_gpus(2)
    out = docs(device_yaml(gpus, "edge1"))
    assert len(out) == 2
    for i, d in enumerate(out):
        assert_valid_kubeedge(d, f"discover[{i}]")
        assert d["metadata"]["name"] == f"edge1-gpu{i}"
        assert d["spec"]["protocol"]["configData"] == {"uuid": gpus[i].uuid, "pciBusId": gpus[i].pci_bus_id}
        assert d["spec"]["deviceModelRef"] == {"name": "nvidia-gpu"}
        assert d["spec"]["nodeName"] == "edge1"


def test_every_catalog_property_is_listed_with_the_catalogs_collect_cycle() -> None:
    d = docs(device_yaml(sim_gpus(1), "edge1"))[0]
    props = d["spec"]["properties"]
    assert [p["name"] for p in props] == [p.name for p in PROPERTIES]
    for p, spec in zip(props, PROPERTIES, strict=True):
        assert p["collectCycle"] == spec.collect_cycle_ms
        assert p["reportCycle"] == DEFAULT_REPORT_CYCLE_MS
        assert p["reportToCloud"] is True
        assert "desired" not in p


def test_state_reporting_is_set_for_both_old_and_new_kubeedge() -> None:
    d = docs(device_yaml(sim_gpus(1), "edge1"))[0]
    assert d["spec"]["stateReport"] == {"reportToCloud": True, "reportCycle": DEFAULT_STATE_REPORT_CYCLE_MS}
    assert d["status"] == {"reportToCloud": True, "reportCycle": DEFAULT_STATE_REPORT_CYCLE_MS}


def test_eight_gpus_stay_well_inside_edgecores_one_rpc_per_second() -> None:
    out = docs(device_yaml(sim_gpus(8), "edge1"))
    # One ReportDeviceStatus per device per report cycle (all twins in one call) + one state report per cycle.
    rpc_per_s = 0.0
    for d in out:
        cycles = {p["reportCycle"] for p in d["spec"]["properties"]}
        assert len(cycles) == 1, "one report cycle per device, so all its twins go in one RPC"
        rpc_per_s += 1000 / cycles.pop() + 1000 / d["spec"]["stateReport"]["reportCycle"]
    assert rpc_per_s <= 0.6


def test_desired_values_go_only_to_the_gpu_they_name() -> None:
    gpus = sim_gpus(2)
    out = docs(device_yaml(gpus, "edge1", desired={gpus[1].uuid: {"power_limit": "300"}}))
    assert all("desired" not in p for p in out[0]["spec"]["properties"])
    power = next(p for p in out[1]["spec"]["properties"] if p["name"] == "power_limit")
    assert power["desired"] == {"value": "300"}


@needs_crds
def test_a_device_with_desired_values_still_validates() -> None:
    gpus = sim_gpus(1)
    text = device_yaml(
        gpus, "edge1", desired={gpus[0].uuid: {"power_limit": "450", "compute_mode": "exclusive_process"}}
    )
    assert_valid_kubeedge(docs(text)[0], "desired")


def test_namespace_model_and_cycles_can_be_chosen() -> None:
    d = docs(
        device_yaml(
            sim_gpus(1), "edge1", namespace="gpus", model="my-gpu", report_cycle_ms=30_000, state_report_cycle_ms=90_000
        )
    )[0]
    assert d["metadata"]["namespace"] == "gpus"
    assert d["spec"]["deviceModelRef"]["name"] == "my-gpu"
    assert {p["reportCycle"] for p in d["spec"]["properties"]} == {30_000}
    assert d["spec"]["stateReport"]["reportCycle"] == 90_000


def test_the_output_is_ordered_by_gpu_index_whatever_the_input_order() -> None:
    gpus = sim_gpus(3)
    out = docs(device_yaml(list(reversed(gpus)), "edge1"))
    assert [d["metadata"]["name"] for d in out] == ["edge1-gpu0", "edge1-gpu1", "edge1-gpu2"]


@pytest.mark.parametrize(
    ("node", "index", "expected"),
    [
        ("edge1", 0, "edge1-gpu0"),
        ("Edge_Node.Factory", 3, "edge-node.factory-gpu3"),
        ("--weird--", 1, "weird-gpu1"),
        ("a" * 300, 7, "a" * 248 + "-gpu7"),
    ],
)
def test_device_names_are_lowercase_rfc1123(node: str, index: int, expected: str) -> None:
    assert device_name(node, index) == expected


def test_a_node_name_without_letters_or_digits_is_refused() -> None:
    with pytest.raises(ValueError, match="node name '__' has no letters or digits"):
        device_name("__", 0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"namespace": "Bad_NS"}, "namespace 'Bad_NS' is not a valid Kubernetes namespace"),
        ({"report_cycle_ms": 0}, "report cycles must be positive"),
        ({"desired": {"GPU-nope": {"power_limit": "1"}}}, "desired values for GPU\\(s\\) not listed: GPU-nope"),
    ],
)
def test_bad_arguments_are_refused_with_what_is_wrong(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        device_yaml(sim_gpus(1), "edge1", **kwargs)


def test_desired_values_for_a_read_only_or_unknown_property_are_refused() -> None:
    gpus = sim_gpus(1)
    with pytest.raises(ValueError, match="desired 'temperature': the property is ReadOnly"):
        device_yaml(gpus, "edge1", desired={gpus[0].uuid: {"temperature": "50"}})
    with pytest.raises(ValueError, match="desired 'turbo': not a property of the catalog"):
        device_yaml(gpus, "edge1", desired={gpus[0].uuid: {"turbo": "1"}})


def test_gpus_that_would_collide_or_lack_a_uuid_are_refused() -> None:
    a = GpuInfo(uuid="GPU-a", index=0, name="x")
    with pytest.raises(ValueError, match="GPU uuid GPU-a appears twice"):
        device_yaml([a, a], "edge1")
    with pytest.raises(ValueError, match="indexes repeat"):
        device_yaml([a, GpuInfo(uuid="GPU-b", index=0, name="x")], "edge1")
    with pytest.raises(ValueError, match="uuid '0' does not look like an NVML UUID"):
        device_yaml([GpuInfo(uuid="0", index=0, name="x")], "edge1")


def test_no_gpus_gives_only_the_header() -> None:
    text = device_yaml([], "edge1")
    assert docs(text) == []
    assert text.startswith("# GPU Devices of node edge1")


# --- what a GPU lacks -----------------------------------------------------------------------------------------


def probed(profile: str, count: int = 1) -> tuple[list[GpuInfo], dict[str, dict[str, str]], NvmlBackend]:
    backend = NvmlBackend(SimNvml(count, profile, seed=0))
    backend.init()
    gpus = backend.list_gpus()
    return gpus, probe_all(backend, gpus), backend


def test_discover_on_a_gpu_without_a_fan_leaves_fan_speed_out_and_says_why_above_the_device() -> None:
    gpus, unsupported, backend = probed("H100", 2)
    try:
        assert unsupported[gpus[0].uuid] == {
            "fan_speed": "NVML answers NotSupported: no fan of its own (a passively cooled board)"
        }
        text = device_yaml(gpus, "edge1", unsupported=unsupported)
        out = docs(text)
        for d in out:
            names = [p["name"] for p in d["spec"]["properties"]]
            assert "fan_speed" not in names
            assert names == [p.name for p in PROPERTIES if p.name != "fan_speed"]
        # The comment sits above each Device, after its document marker, naming the device, property and why.
        blocks = text.split("\n---\n")[1:]
        assert len(blocks) == 2
        for i, block in enumerate(blocks):
            head = block.split("apiVersion:")[0]
            assert head.startswith(f"# edge1-gpu{i} (NVIDIA H100 80GB HBM3): left out, this GPU cannot read them")
            assert "#   fan_speed: NVML answers NotSupported: no fan of its own" in head
        # Every property the discovered Device lists is one the GPU reads (so every twin gets a value).
        listed_nvml = {p["name"] for p in out[0]["spec"]["properties"]} & {p.name for p in NVML_PROPERTIES}
        sample = backend.sample(gpus[0].uuid, sorted(listed_nvml))
        assert set(sample.values) == listed_nvml
    finally:
        backend.shutdown()


@needs_crds
def test_a_gddr_card_without_ecc_loses_its_ecc_and_row_remapping_counters_and_still_validates() -> None:
    gpus, unsupported, backend = probed("RTX4080S")
    backend.shutdown()
    lacking = unsupported[gpus[0].uuid]
    assert {"ecc_errors_corrected", "ecc_errors_uncorrected", "remapped_rows_pending"} <= set(lacking)
    assert "fan_speed" not in lacking, "a workstation card with a fan keeps fan_speed"
    d = docs(device_yaml(gpus, "edge1", unsupported=unsupported))[0]
    assert not {p["name"] for p in d["spec"]["properties"]} & set(lacking)
    assert_valid_kubeedge(d, "discover RTX4080S")


def test_a_gpu_that_cannot_be_probed_keeps_every_property_and_says_so() -> None:
    sim = SimNvml(2, "H100", seed=0)
    backend = NvmlBackend(sim)
    backend.init()
    try:
        gpus = backend.list_gpus()
        sim.inject_gpu_lost(gpus[1].uuid)
        unsupported = probe_all(backend, gpus)
    finally:
        backend.shutdown()
    assert "lost" in unsupported[""][gpus[1].uuid].lower()
    text = device_yaml(gpus, "edge1", unsupported=unsupported)
    out = docs(text)
    assert "fan_speed" not in {p["name"] for p in out[0]["spec"]["properties"]}
    assert [p["name"] for p in out[1]["spec"]["properties"]] == [p.name for p in PROPERTIES]
    assert "# edge1-gpu1: not probed, every property listed:" in text
