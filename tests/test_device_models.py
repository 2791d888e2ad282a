"""device-models/: the GPU DeviceModel matches the catalog, and every Device and DeviceModel YAML validates
against the KubeEdge v1beta1 CRD schemas (v1.22.0 and v1.23.1).

The schema helpers here are also used by tests/test_discover.py and tests/test_deploy.py.
"""

from __future__ import annotations

import functools
import re
import runpy
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
import yaml

from mapper.edge.kubeedge.devicefiles import load_folder
from mapper.shared.model import PROPERTY_BY_NAME, TWIN_KEY_RE, TWIN_VALUE_RE, family_properties, parse_value
from mapper.tools.discover import FAMILY_MODELS, model_doc, model_yaml
from tests.realparts import available

REPO = Path(__file__).resolve().parents[1]
SHARED = (REPO / ".." / "shared").resolve()
CRDS = SHARED / "kubeedge" / "crds"
KUBEEDGE_VERSIONS = ("v1.22.0", "v1.23.1")
#: Fields a version's schema does not know, which its API server prunes (and why that is harmless).
PRUNED_OK: Mapping[str, set[str]] = {
    # v1.22 has no spec.stateReport; it reads status.reportToCloud/reportCycle, which we set as well. Nor
    # pushMethod.anomalyDetection (v1.23): a v1.22 API server prunes it, and the mapper then carries nothing.
    "v1.22.0": {"spec.stateReport", "spec.properties[].pushMethod.anomalyDetection"},
    "v1.23.1": set(),
}
RFC1123 = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")

CRDS_MISSING = f"the KubeEdge CRD schemas are not at {CRDS} (the shared folder is absent)"
#: The tests that validate against the CRD schemas: skipped where they are absent, failed under CI (``CI=true``;
#: the ``kubeedge_crds`` fixture in conftest.py).
needs_crds = pytest.mark.usefixtures("kubeedge_crds")


def crds_available() -> bool:
    """For a test that also validates against the schemas where they are here (a failure under CI when not)."""
    return available(CRDS.is_dir(), CRDS_MISSING)


@functools.cache
def crd_schema(version: str, kind: str) -> dict[str, Any]:
    """``spec.versions[v1beta1].schema.openAPIV3Schema`` of the KubeEdge CRD for ``kind``."""
    file = CRDS / version / f"devices_v1beta1_{kind.lower()}.yaml"
    crd = yaml.safe_load(file.read_text())
    for v in crd["spec"]["versions"]:
        if v["name"] == "v1beta1":
            schema: dict[str, Any] = v["schema"]["openAPIV3Schema"]
            return schema
    raise AssertionError(f"{file}: no v1beta1 version")


def unknown_fields(doc: Any, schema: Mapping[str, Any], path: str = "") -> list[str]:
    """Paths in ``doc`` the structural schema does not declare (an API server silently prunes them)."""
    out: list[str] = []
    if isinstance(doc, dict) and schema.get("type") == "object":
        if schema.get("x-kubernetes-preserve-unknown-fields") or "additionalProperties" in schema:
            return out
        props = schema.get("properties")
        if props is None:
            return out
        for key, value in doc.items():
            sub = f"{path}.{key}" if path else key
            if key not in props:
                out.append(sub)
            else:
                out.extend(unknown_fields(value, props[key], sub))
    elif isinstance(doc, list) and "items" in schema:
        for i, item in enumerate(doc):
            out.extend(unknown_fields(item, schema["items"], f"{path}[{i}]"))
    return out


def assert_valid_kubeedge(doc: Mapping[str, Any], where: str = "") -> None:
    """Validate a Device or DeviceModel against both KubeEdge versions' schemas, plus what the schema does
    not say: RFC 1123 names, twin-safe property names and desired values, positive cycles."""
    kind = doc.get("kind")
    assert kind in ("Device", "DeviceModel"), f"{where}: kind {kind!r}"
    assert doc.get("apiVersion") == "devices.kubeedge.io/v1beta1", f"{where}: apiVersion"
    name = doc["metadata"]["name"]
    assert RFC1123.fullmatch(name) and len(name) <= 253, f"{where}: metadata.name {name!r} is not RFC 1123"
    for version in KUBEEDGE_VERSIONS:
        schema = crd_schema(version, kind)
        errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(doc), key=lambda e: list(e.path))
        assert not errors, f"{where} ({version}): " + "; ".join(
            f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors
        )
        extra = {re.sub(r"\[\d+\]", "[]", path) for path in unknown_fields(doc, schema)} - PRUNED_OK[version]
        assert not extra, f"{where} ({version}): fields the schema does not know (would be pruned): {sorted(extra)}"
    spec = doc["spec"]
    if kind == "DeviceModel":
        assert spec["protocol"] == "gpu"
    else:
        assert spec["protocol"]["protocolName"] == "gpu"
        assert spec["deviceModelRef"]["name"]
        uuid = spec["protocol"]["configData"]["uuid"]
        assert isinstance(uuid, str) and uuid.startswith("GPU-"), f"{where}: configData.uuid {uuid!r}"
        assert spec["nodeName"], f"{where}: nodeName"
    for p in spec.get("properties", []):
        assert TWIN_KEY_RE.fullmatch(p["name"]), f"{where}: property name {p['name']!r} is not twin-safe"
        if kind == "Device":
            for cycle in ("collectCycle", "reportCycle"):
                if cycle in p:
                    assert isinstance(p[cycle], int) and p[cycle] > 0, f"{where}: {p['name']}.{cycle} in ms"
            if "desired" in p:
                value = p["desired"]["value"]
                assert TWIN_VALUE_RE.fullmatch(value), f"{where}: desired {p['name']}={value!r} is not twin-safe"
                spec_p = PROPERTY_BY_NAME[p["name"]]
                assert spec_p.writable, f"{where}: desired value for ReadOnly {p['name']}"
                parse_value(spec_p, value)


def yaml_docs(path: Path) -> Iterator[dict[str, Any]]:
    for doc in yaml.safe_load_all(path.read_text()):
        if doc is not None:
            yield doc


def generator() -> dict[str, Any]:
    return runpy.run_path(str(REPO / "device-models" / "generate.py"))


# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", sorted(FAMILY_MODELS.values()))
def test_the_committed_device_model_is_what_the_catalog_generates(model: str) -> None:
    committed = (REPO / "device-models" / f"{model}.yaml").read_text()
    assert committed == model_yaml(name=model), (
        f"device-models/{model}.yaml and mapper/shared/model.py PROPERTIES disagree: "
        "run .venv/bin/python device-models/generate.py"
    )


def test_every_generated_file_under_device_models_is_up_to_date() -> None:
    for path, text in generator()["outputs"]().items():
        assert path.read_text() == text, f"{path} is stale: run .venv/bin/python device-models/generate.py"


@pytest.mark.parametrize(("family", "model"), sorted(FAMILY_MODELS.items()))
def test_the_model_lists_every_catalog_property_with_its_type_access_unit_and_range(family: str, model: str) -> None:
    doc = next(yaml_docs(REPO / "device-models" / f"{model}.yaml"))
    by_name = {p["name"]: p for p in doc["spec"]["properties"]}
    assert list(by_name) == [p.name for p in family_properties(family)]
    for spec in family_properties(family):
        p = by_name[spec.name]
        assert p["type"] == spec.ptype
        assert p["accessMode"] == spec.access
        assert p.get("unit", "") == spec.unit
        assert p.get("minimum", "") == spec.minimum
        assert p.get("maximum", "") == spec.maximum
        assert p["description"] == spec.description
        for bound in ("minimum", "maximum"):
            if bound in p:
                assert isinstance(p[bound], str), f"{spec.name}.{bound} must be a quoted string"


def test_the_model_names_the_required_read_write_properties() -> None:
    doc = model_doc()
    rw = {p["name"] for p in doc["spec"]["properties"] if p["accessMode"] == "ReadWrite"}
    assert rw == {
        "power_limit",
        "locked_gpu_clock_min",
        "locked_gpu_clock_max",
        "locked_memory_clock_min",
        "locked_memory_clock_max",
        "persistence_mode",
        "compute_mode",
    }


def test_the_jetson_model_names_its_frequency_range_and_power_mode_as_read_write_and_no_nvml_setter() -> None:
    doc = model_doc(name="nvidia-jetson")
    names = [p["name"] for p in doc["spec"]["properties"]]
    rw = {p["name"] for p in doc["spec"]["properties"] if p["accessMode"] == "ReadWrite"}
    assert rw == {"gpu_min_freq", "gpu_max_freq", "power_mode"}
    assert {"utilization_gpu", "temperature", "power_usage", "desired_status", "policy_state"} <= set(names)
    assert "power_limit" not in names and "fan_speed" not in names


@needs_crds
@pytest.mark.parametrize(
    "path",
    sorted((REPO / "device-models").rglob("*.yaml")),
    ids=lambda p: str(p.relative_to(REPO)),
)
def test_every_device_models_yaml_validates_against_the_kubeedge_schemas(path: Path) -> None:
    docs = list(yaml_docs(path))
    assert docs, f"{path} is empty"
    for i, doc in enumerate(docs):
        assert_valid_kubeedge(doc, f"{path.name}[{i}]")


def test_the_example_devices_use_the_simulators_uuids_for_the_demo() -> None:
    gen = generator()
    gpus = gen["demo_gpus"]()
    docs = list(yaml_docs(REPO / "device-models" / "examples" / "demo-node.yaml"))
    assert [d["metadata"]["name"] for d in docs] == [f"demo-node-gpu{i}" for i in range(4)]
    assert [d["spec"]["protocol"]["configData"]["uuid"] for d in docs] == [g.uuid for g in gpus]
    assert all(d["spec"]["nodeName"] == "demo-node" for d in docs)


def test_the_example_desired_values_are_in_range_for_the_simulated_gpu() -> None:
    from mapper.edge.gpu.simnvml import SimNvml

    docs = list(yaml_docs(REPO / "device-models" / "examples" / "demo-node.yaml"))
    desired = {p["name"]: p["desired"]["value"] for p in docs[0]["spec"]["properties"] if "desired" in p}
    assert desired == {"power_limit": "450", "locked_gpu_clock_min": "1005", "locked_gpu_clock_max": "1755"}
    nvml = SimNvml(4, seed=0, clock=lambda: 0.0)
    nvml.nvmlInit()
    h = nvml.nvmlDeviceGetHandleByIndex(0)
    low_mw, high_mw = nvml.nvmlDeviceGetPowerManagementLimitConstraints(h)
    assert low_mw <= 450_000 <= high_mw
    mem = nvml.nvmlDeviceGetSupportedMemoryClocks(h)[0]
    clocks = nvml.nvmlDeviceGetSupportedGraphicsClocks(h, mem)
    assert 1005 in clocks and 1755 in clocks


def test_the_examples_folder_loads_in_standalone_mode_without_errors() -> None:
    contents = load_folder(REPO / "device-models" / "examples", "demo-node")
    assert contents.errors == []
    assert sorted(d.name for d in contents.devices) == [f"demo-node-gpu{i}" for i in range(4)]
    assert [m.name for m in contents.models] == ["nvidia-gpu"]
    gpu0 = next(d for d in contents.devices if d.name == "demo-node-gpu0")
    power = gpu0.property("power_limit")
    assert power is not None and power.desired == "450"


@needs_crds
def test_the_schema_check_catches_a_wrong_type_and_an_unknown_field() -> None:
    doc = model_doc()
    doc["spec"]["properties"][0]["type"] = "NUMBER"
    with pytest.raises(AssertionError, match="is not one of"):
        assert_valid_kubeedge(doc, "bad-type")
    doc = model_doc()
    doc["spec"]["properties"][0]["minmum"] = "0"
    with pytest.raises(AssertionError, match="would be pruned"):
        assert_valid_kubeedge(doc, "typo")
