"""The committed stubs match proto/dmi.proto, and the .proto matches KubeEdge's wire facts."""

from __future__ import annotations

import importlib.resources
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import FieldDescriptor

from mapper.edge.kubeedge.dmi.pb import dmi_pb2, dmi_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
PROTO = ROOT / "proto" / "dmi.proto"


def compile_descriptor(proto_file: Path, tmp_path: Path) -> descriptor_pb2.FileDescriptorProto:
    """Compile ``proto_file`` with grpc_tools.protoc into a descriptor set and return its file descriptor."""
    include = importlib.resources.files("grpc_tools") / "_proto"
    out = tmp_path / "dmi.pb"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"--proto_path={proto_file.parent}",
            f"--proto_path={include}",
            f"--descriptor_set_out={out}",
            str(proto_file),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    (fd,) = [f for f in fds.file if f.name == proto_file.name]
    return fd


def committed_descriptor() -> descriptor_pb2.FileDescriptorProto:
    return descriptor_pb2.FileDescriptorProto.FromString(dmi_pb2.DESCRIPTOR.serialized_pb)


def normalized(fd: descriptor_pb2.FileDescriptorProto) -> descriptor_pb2.FileDescriptorProto:
    """Drop what protoc derives rather than reads (``json_name``, computed from the field name; generated code
    omits it, descriptor sets carry it) so two compilations of the same .proto compare equal."""
    out = descriptor_pb2.FileDescriptorProto()
    out.CopyFrom(fd)
    out.ClearField("source_code_info")

    def strip(messages: list[descriptor_pb2.DescriptorProto]) -> None:
        for message in messages:
            for f in message.field:
                f.ClearField("json_name")
            strip(list(message.nested_type))

    strip(list(out.message_type))
    return out


def test_committed_stubs_are_generated_from_the_current_proto(tmp_path: Path) -> None:
    fresh = normalized(compile_descriptor(PROTO, tmp_path))
    committed = normalized(committed_descriptor())
    assert fresh == committed, (
        "mapper/edge/kubeedge/dmi/pb is out of date with proto/dmi.proto: run scripts/gen-proto.sh, commit the result"
    )


def test_the_drift_check_notices_a_changed_field_number(tmp_path: Path) -> None:
    edited = tmp_path / "src" / "dmi.proto"
    edited.parent.mkdir()
    text = PROTO.read_text()
    assert "  bytes address = 5;" in text
    edited.write_text(text.replace("  bytes address = 5;", "  bytes address = 7;"))
    assert normalized(compile_descriptor(edited, tmp_path)) != normalized(committed_descriptor())


def _field(message: str, name: str) -> FieldDescriptor:
    return dmi_pb2.DESCRIPTOR.message_types_by_name[message].fields_by_name[name]


@pytest.mark.parametrize(
    ("message", "field", "number", "type_", "repeated"),
    [
        ("MapperInfo", "address", 5, FieldDescriptor.TYPE_BYTES, False),
        ("MapperInfo", "api_version", 3, FieldDescriptor.TYPE_STRING, False),
        ("MapperRegisterRequest", "withData", 1, FieldDescriptor.TYPE_BOOL, False),
        ("MapperRegisterResponse", "modelList", 1, FieldDescriptor.TYPE_MESSAGE, True),
        ("Twin", "observedDesired", 2, FieldDescriptor.TYPE_MESSAGE, False),
        ("Twin", "reported", 3, FieldDescriptor.TYPE_MESSAGE, False),
        ("PushMethod", "anomalyDetection", 5, FieldDescriptor.TYPE_MESSAGE, False),
        ("DeviceStatus", "reportCycle", 3, FieldDescriptor.TYPE_INT64, False),
        ("DeviceProperty", "collectCycle", 5, FieldDescriptor.TYPE_INT64, False),
        ("ReportDeviceStatusRequest", "deviceNamespace", 3, FieldDescriptor.TYPE_STRING, False),
        ("ReportDeviceStatesRequest", "state", 3, FieldDescriptor.TYPE_STRING, False),
        ("PushMethodMQTT", "qos", 3, FieldDescriptor.TYPE_INT32, False),
        ("DeviceCommand", "status_code", 4, FieldDescriptor.TYPE_STRING, True),
    ],
)
def test_fields_have_kubeedge_numbers_and_types(
    message: str, field: str, number: int, type_: int, repeated: bool
) -> None:
    fd = _field(message, field)
    assert fd.number == number
    assert fd.type == type_
    assert fd.is_repeated is repeated


def test_config_data_is_a_map_of_any() -> None:
    fd = _field("CustomizedValue", "data")
    entry = fd.message_type
    assert entry is not None
    assert entry.GetOptions().map_entry
    assert entry.fields_by_name["key"].type == FieldDescriptor.TYPE_STRING
    value_type = entry.fields_by_name["value"].message_type
    assert value_type is not None and value_type.full_name == "google.protobuf.Any"


def test_package_and_method_paths_are_those_edgecore_calls() -> None:
    assert dmi_pb2.DESCRIPTOR.package == "v1beta1"
    manager = dmi_pb2.DESCRIPTOR.services_by_name["DeviceManagerService"]
    mapper = dmi_pb2.DESCRIPTOR.services_by_name["DeviceMapperService"]
    assert sorted(m.name for m in manager.methods) == ["MapperRegister", "ReportDeviceStates", "ReportDeviceStatus"]
    assert sorted(m.name for m in mapper.methods) == [
        "CreateDeviceModel",
        "GetDevice",
        "RegisterDevice",
        "RemoveDevice",
        "RemoveDeviceModel",
        "UpdateDevice",
        "UpdateDeviceModel",
    ]
    assert f"/{manager.full_name}/MapperRegister" == "/v1beta1.DeviceManagerService/MapperRegister"


def test_proto_has_no_enums_oneofs_or_optional_fields() -> None:
    fd = committed_descriptor()
    assert not fd.enum_type
    for message in fd.message_type:
        assert not message.enum_type, message.name
        assert not message.oneof_decl, message.name
        assert not any(f.proto3_optional for f in message.field), message.name


def test_grpc_stub_module_imports_the_message_module_by_package_path() -> None:
    source = Path(dmi_pb2_grpc.__file__).read_text()
    assert "from mapper.edge.kubeedge.dmi.pb import dmi_pb2 as dmi__pb2" in source
    assert "\nimport dmi_pb2" not in source


def test_installed_protobuf_runtime_accepts_the_generated_code() -> None:
    # Importing dmi_pb2 ran ValidateProtobufRuntimeVersion; a fresh interpreter proves it from scratch.
    result = subprocess.run(
        [sys.executable, "-c", "import mapper.edge.kubeedge.dmi.pb.dmi_pb2_grpc as g; print(g.GRPC_GENERATED_VERSION)"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    message = dmi_pb2.MapperInfo(address=b"/etc/kubeedge/gpu.sock")
    assert dmi_pb2.MapperInfo.FromString(message.SerializeToString()).address == b"/etc/kubeedge/gpu.sock"
