from pathlib import Path

import pytest

from mapper.edge.kubeedge.devicefiles import FolderWatcher, load_folder

MODEL = """
apiVersion: devices.kubeedge.io/v1beta1
kind: DeviceModel
metadata: {name: nvidia-gpu, namespace: default}
spec:
  protocol: gpu
  protocolConfigData: {library: libnvidia-ml.so.1, pciBusId: "0000"}
  properties:
  - {name: power_limit, type: FLOAT, accessMode: ReadWrite, unit: W}
  - name: clock_event_reasons
    type: INT
    accessMode: ReadOnly
    visitors: {protocolName: gpu, configData: {format: hex}}
"""

DEVICE = """
apiVersion: devices.kubeedge.io/v1beta1
kind: Device
metadata: {name: gpu0-edge1, namespace: default}
spec:
  deviceModelRef: {name: nvidia-gpu}
  nodeName: edge1
  protocol:
    protocolName: gpu
    configData: {uuid: GPU-7a1c2e44-0b1d-4c55-9e0f-12ab34cd56ef, pciBusId: "00000000:17:00.0"}
  stateReport: {reportToCloud: true, reportCycle: 30000}
  properties:
  - name: power_limit
    desired: {value: "450"}
    collectCycle: 10000
    reportCycle: 10000
    reportToCloud: true
    pushMethod: {mqtt: {address: "tcp://127.0.0.1:1883", topic: "gpu/power", qos: 0, retained: true}}
  - {name: clock_event_reasons, collectCycle: 5000}
---
apiVersion: devices.kubeedge.io/v1beta1
kind: Device
metadata: {name: other-node-gpu, namespace: default}
spec:
  deviceModelRef: {name: nvidia-gpu}
  nodeName: edge2
  protocol: {protocolName: gpu, configData: {uuid: GPU-1}}
---
apiVersion: devices.kubeedge.io/v1beta1
kind: Device
metadata: {name: modbus-thing}
spec:
  protocol: {protocolName: modbus}
"""


def test_devices_merge_their_model_defaults_and_the_device_wins(tmp_path: Path):
    (tmp_path / "model.yaml").write_text(MODEL)
    (tmp_path / "devices.yml").write_text(DEVICE)
    got = load_folder(tmp_path, node_name="edge1")
    assert got.errors == []
    assert [m.name for m in got.models] == ["nvidia-gpu"]
    (dev,) = got.devices
    assert dev.key == "default/gpu0-edge1"
    assert dev.uuid == "GPU-7a1c2e44-0b1d-4c55-9e0f-12ab34cd56ef"
    assert dev.protocol_config["pciBusId"] == "00000000:17:00.0"
    assert dev.protocol_config["library"] == "libnvidia-ml.so.1"
    power = dev.property("power_limit")
    assert power is not None and power.desired == "450" and power.collect_cycle_ms == 10000
    assert power.push_mqtt is not None and power.push_mqtt.topic == "gpu/power" and power.push_mqtt.qos == 0
    reasons = dev.property("clock_event_reasons")
    assert reasons is not None and reasons.visitor_config == {"format": "hex"}
    assert dev.state_report_cycle_ms == 30000


def test_a_broken_file_is_reported_and_the_others_still_load(tmp_path: Path):
    (tmp_path / "model.yaml").write_text(MODEL)
    (tmp_path / "broken.yaml").write_text("kind: Device\n  - : [")
    (tmp_path / "nested.yaml").write_text(DEVICE.replace('pciBusId: "00000000:17:00.0"', "nested: {a: 1}"))
    got = load_folder(tmp_path, node_name="edge1")
    reasons = dict(got.errors)
    assert str(tmp_path / "broken.yaml") in reasons
    assert "nested" in reasons[str(tmp_path / "nested.yaml")]
    assert got.devices == [] and len(got.models) == 1


def test_the_watcher_notices_added_and_changed_files(tmp_path: Path):
    watcher = FolderWatcher(tmp_path)
    assert watcher.changed()
    assert not watcher.changed()
    (tmp_path / "a.yaml").write_text(MODEL)
    assert watcher.changed()
    (tmp_path / "a.yaml").write_text(MODEL + "\n# edited\n")
    assert watcher.changed()


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        # Found by the bad-input suite (tests/fuzz): each raised AttributeError out of load_folder, which ended
        # the devices-folder task and with it the mapper.
        ("spec: [1]", "Device spec: must be a mapping, got list"),
        ("spec: {protocol: gpu}", "spec.protocol: must be a mapping, got str"),
        ("metadata: [x]\nspec: {protocol: {protocolName: gpu}}", "Device metadata: must be a mapping"),
        ("spec: {protocol: {protocolName: gpu}, properties: 5}", "spec.properties: must be a list"),
        (
            "spec: {protocol: {protocolName: gpu}, properties: [{name: power_limit, pushMethod: [1]}]}",
            "pushMethod: must be a mapping",
        ),
        ("spec: {protocol: {protocolName: gpu}, properties: [{name: p, collectCycle: .inf}]}", "collectCycle"),
    ],
)
def test_malformed_device_documents_are_skipped_with_a_reason(tmp_path, spec, needle):
    (tmp_path / "bad.yaml").write_text(f"apiVersion: devices.kubeedge.io/v1beta1\nkind: Device\n{spec}\n")
    contents = load_folder(tmp_path)
    assert contents.devices == []
    assert [(Path(f).name, needle in reason) for f, reason in contents.errors] == [("bad.yaml", True)], contents.errors
