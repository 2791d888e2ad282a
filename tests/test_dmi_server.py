"""DmiServer: DeviceMapperService on a real Unix socket, called the way EdgeCore calls it."""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio
import pytest
from google.protobuf import any_pb2, struct_pb2

from mapper.edge.kubeedge.dmi.client import DmiClient
from mapper.edge.kubeedge.dmi.pb import dmi_pb2 as pb
from mapper.edge.kubeedge.dmi.server import DmiServer
from mapper.edge.kubeedge.registry import DeviceChange, Registry
from mapper.errors import ConfigError
from mapper.shared.model import DeviceConfig, Twin
from tests.fake_edgecore import FakeEdgeCore, pb_device, pb_model, sock_dir

__all__ = ["sock_dir"]

GPU_A = "GPU-aaaaaaaa-0000-0000-0000-000000000001"
GPU_B = "GPU-bbbbbbbb-0000-0000-0000-000000000002"
ELSEWHERE = "GPU-ffffffff-0000-0000-0000-00000000000f"


def write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def exists(path: str) -> bool:
    return os.path.exists(path)


class Harness:
    def __init__(self, sock_dir: str) -> None:
        self.registry = Registry(node_gpus=lambda: {GPU_A, GPU_B})
        self.changes: list[DeviceChange] = []
        self.registry.subscribe(self.changes.append)
        self.twins: dict[str, list[Twin]] = {}
        self.path = os.path.join(sock_dir, "run", "gpu.sock")
        self.server = DmiServer(self.registry, self._twins_of, socket_path=self.path)
        self.edge = FakeEdgeCore(os.path.join(sock_dir, "dmi.sock"))

    def _twins_of(self, device: DeviceConfig) -> list[Twin]:
        return self.twins.get(device.key, [])

    def snapshot(self) -> tuple[object, ...]:
        return (tuple(self.registry.devices()), tuple(self.registry.models()), len(self.changes))

    async def call(self, method: str, request: Any) -> Any:
        """One EdgeCore call: a new connection and a 10 s deadline."""
        async with self.edge.mapper(self.path.encode()) as stub:
            return await getattr(stub, method)(request, timeout=10)


@pytest.fixture
async def h(sock_dir: str) -> AsyncIterator[Harness]:
    harness = Harness(sock_dir)
    await harness.server.start()
    try:
        yield harness
    finally:
        await harness.server.stop(0)


async def test_server_creates_the_directory_removes_a_stale_socket_and_sets_mode_0660(sock_dir: str) -> None:
    path = os.path.join(sock_dir, "run", "kubeedge", "gpu.sock")
    os.makedirs(os.path.dirname(path))
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()
    stale_ino = os.stat(path).st_ino
    stale_ctime = os.stat(path).st_ctime_ns
    server = DmiServer(Registry(node_gpus=lambda: ()), lambda d: [], socket_path=path)
    await server.start()
    try:
        st = os.stat(path)
        assert stat.S_ISSOCK(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o660
        assert (st.st_ino, st.st_ctime_ns) != (stale_ino, stale_ctime)
        async with FakeEdgeCore(os.path.join(sock_dir, "x.sock")).mapper(path) as stub:
            await stub.RemoveDevice(pb.RemoveDeviceRequest(deviceName="nothing"), timeout=10)
    finally:
        await server.stop(0)
    assert not exists(path)


async def test_server_refuses_to_delete_a_regular_file_in_its_socket_path(sock_dir: str) -> None:
    path = os.path.join(sock_dir, "gpu.sock")
    write(path, "keep me")
    server = DmiServer(Registry(node_gpus=lambda: ()), lambda d: [], socket_path=path)
    with pytest.raises(ConfigError, match="exists and is not a socket"):
        await server.start()
    assert read(path) == "keep me"


async def test_server_refuses_a_socket_path_longer_than_unix_allows(sock_dir: str) -> None:
    server = DmiServer(Registry(node_gpus=lambda: ()), lambda d: [], socket_path=os.path.join(sock_dir, "x" * 120))
    with pytest.raises(ConfigError, match="longer than 107 bytes"):
        await server.start()


async def test_register_device_adds_it_and_notifies_once_even_when_sent_twice(h: Harness) -> None:
    await h.call("CreateDeviceModel", pb.CreateDeviceModelRequest(model=pb_model()))
    device = pb_device("gpu0", GPU_A, properties={"power_limit": "300", "temperature": None})
    reply = await h.call("RegisterDevice", pb.RegisterDeviceRequest(device=device))
    assert (reply.deviceName, reply.deviceNamespace) == ("gpu0", "default")
    await h.call("RegisterDevice", pb.RegisterDeviceRequest(device=device))
    assert [c.kind for c in h.changes] == ["added"]
    stored = h.registry.get_device("default", "gpu0")
    assert stored.uuid == GPU_A
    power = stored.property("power_limit")
    assert power is not None and power.desired == "300"
    assert h.server.rpc_counts["RegisterDevice"] == {"ok": 2}


async def test_update_device_that_changes_desired_power_limit_reaches_the_listener_once(h: Harness) -> None:
    await h.call("RegisterDevice", pb.RegisterDeviceRequest(device=pb_device("gpu0", GPU_A)))
    changed = pb_device("gpu0", GPU_A, properties={"temperature": None, "power_limit": "250"})
    await h.call("UpdateDevice", pb.UpdateDeviceRequest(device=changed))
    assert [c.kind for c in h.changes] == ["added", "updated"]
    update = h.changes[1]
    assert update.desired_changed and not update.cycles_changed
    power = update.device.property("power_limit")
    assert power is not None and power.desired == "250"


async def test_a_spurious_update_with_an_unchanged_spec_notifies_nobody(h: Harness) -> None:
    device = pb_device("gpu0", GPU_A)
    await h.call("RegisterDevice", pb.RegisterDeviceRequest(device=device))
    h.changes.clear()
    device.status.twins.add(propertyName="temperature")  # EdgeCore <= 1.22: a status-only change
    for _ in range(3):
        await h.call("UpdateDevice", pb.UpdateDeviceRequest(device=device))
    assert h.changes == []
    assert h.server.rpc_counts["UpdateDevice"] == {"ok": 3}


async def test_update_of_an_unknown_device_adds_it(h: Harness) -> None:
    await h.call("UpdateDevice", pb.UpdateDeviceRequest(device=pb_device("gpu1", GPU_B)))
    assert [c.kind for c in h.changes] == ["added"]


async def test_a_device_whose_model_is_not_known_yet_is_accepted(h: Harness) -> None:
    await h.call("RegisterDevice", pb.RegisterDeviceRequest(device=pb_device("gpu0", GPU_A, model="later")))
    assert h.registry.get_device("default", "gpu0").model == "later"
    await h.call("CreateDeviceModel", pb.CreateDeviceModelRequest(model=pb_model("later")))
    assert [m.name for m in h.registry.models()] == ["later"]


def _packed_struct() -> any_pb2.Any:
    out = any_pb2.Any()
    out.Pack(struct_pb2.Struct())
    return out


@pytest.mark.parametrize(
    ("device", "code", "message"),
    [
        (pb_device("gpu0", None), grpc.StatusCode.INVALID_ARGUMENT, "protocol.configData.uuid is missing"),
        (pb_device("gpu0", "not-a-gpu"), grpc.StatusCode.INVALID_ARGUMENT, "is not a GPU UUID"),
        (
            pb_device("gpu0", GPU_A, properties={"warp_drive": "9"}),
            grpc.StatusCode.INVALID_ARGUMENT,
            "unknown property 'warp_drive'",
        ),
        (
            pb_device("gpu0", None, config={"uuid": 3}),
            grpc.StatusCode.INVALID_ARGUMENT,
            "protocol.configData.uuid must be a string",
        ),
        (
            pb_device("gpu0", GPU_A, config={"limits": _packed_struct()}),
            grpc.StatusCode.INVALID_ARGUMENT,
            "protocol.configData.limits: unsupported value type type.googleapis.com/google.protobuf.Struct",
        ),
        (pb_device("gpu0", ELSEWHERE), grpc.StatusCode.FAILED_PRECONDITION, f"GPU {ELSEWHERE} is not on this node"),
        (pb_device("", GPU_A), grpc.StatusCode.INVALID_ARGUMENT, "name is empty"),
    ],
)
async def test_a_bad_device_gets_the_right_code_and_message_and_changes_nothing(
    h: Harness, device: Any, code: grpc.StatusCode, message: str
) -> None:
    await h.call("RegisterDevice", pb.RegisterDeviceRequest(device=pb_device("gpu1", GPU_B)))
    before = h.snapshot()
    for method, request in (
        ("RegisterDevice", pb.RegisterDeviceRequest(device=device)),
        ("UpdateDevice", pb.UpdateDeviceRequest(device=device)),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.call(method, request)
        assert info.value.code() == code
        assert message in (info.value.details() or "")
    assert h.snapshot() == before


async def test_a_gpu_already_owned_by_another_device_is_a_failed_precondition(h: Harness) -> None:
    await h.call("RegisterDevice", pb.RegisterDeviceRequest(device=pb_device("gpu0", GPU_A)))
    before = h.snapshot()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await h.call("RegisterDevice", pb.RegisterDeviceRequest(device=pb_device("other", GPU_A)))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "already belongs to device default/gpu0" in (info.value.details() or "")
    assert h.snapshot() == before


async def test_a_request_without_a_device_is_an_invalid_argument(h: Harness) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await h.call("RegisterDevice", pb.RegisterDeviceRequest())
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "carries no device" in (info.value.details() or "")
    assert h.server.rpc_counts["RegisterDevice"] == {"invalid_argument": 1}


async def test_a_device_property_missing_from_its_known_model_is_refused(h: Harness) -> None:
    await h.call("CreateDeviceModel", pb.CreateDeviceModelRequest(model=pb_model(props={"temperature": "INT"})))
    before = h.snapshot()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await h.call("RegisterDevice", pb.RegisterDeviceRequest(device=pb_device("gpu0", GPU_A)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "is not in model default/nvidia-gpu" in (info.value.details() or "")
    assert h.snapshot() == before


@pytest.mark.parametrize(
    ("props", "message"),
    [
        ({"warp_drive": "INT"}, "unknown property 'warp_drive' (not in the GPU catalog)"),
        ({"temperature": "STRING"}, "has type STRING, the catalog says INT"),
        ({"bad key": "INT"}, "is not a valid twin key"),
    ],
)
async def test_a_model_the_catalog_does_not_allow_is_an_invalid_argument(
    h: Harness, props: dict[str, str], message: str
) -> None:
    before = h.snapshot()
    for method, request in (
        ("CreateDeviceModel", pb.CreateDeviceModelRequest(model=pb_model(props=props))),
        ("UpdateDeviceModel", pb.UpdateDeviceModelRequest(model=pb_model(props=props))),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.call(method, request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in (info.value.details() or "")
    assert h.snapshot() == before


async def test_a_read_only_property_declared_read_write_is_refused(h: Harness) -> None:
    model = pb_model(props={"temperature": "INT"})
    model.spec.properties[0].accessMode = "ReadWrite"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await h.call("CreateDeviceModel", pb.CreateDeviceModelRequest(model=model))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "read-only on a GPU" in (info.value.details() or "")


async def test_models_are_created_updated_and_removed_idempotently(h: Harness) -> None:
    reply = await h.call("CreateDeviceModel", pb.CreateDeviceModelRequest(model=pb_model(namespace="edge")))
    assert (reply.deviceModelName, reply.deviceModelNamespace) == ("nvidia-gpu", "edge")
    await h.call("CreateDeviceModel", pb.CreateDeviceModelRequest(model=pb_model(namespace="edge")))
    await h.call(
        "UpdateDeviceModel", pb.UpdateDeviceModelRequest(model=pb_model(namespace="edge", props={"temperature": "INT"}))
    )
    (model,) = h.registry.models()
    assert [p.name for p in model.properties] == ["temperature"]
    await h.call("RemoveDeviceModel", pb.RemoveDeviceModelRequest(modelName="nvidia-gpu", modelNamespace="edge"))
    await h.call("RemoveDeviceModel", pb.RemoveDeviceModelRequest(modelName="nvidia-gpu", modelNamespace="edge"))
    assert h.registry.models() == []


async def test_remove_device_notifies_once_and_removing_an_unknown_device_is_fine(h: Harness) -> None:
    await h.call("RegisterDevice", pb.RegisterDeviceRequest(device=pb_device("gpu0", GPU_A)))
    await h.call("RemoveDevice", pb.RemoveDeviceRequest(deviceName="gpu0", deviceNamespace="default"))
    await h.call("RemoveDevice", pb.RemoveDeviceRequest(deviceName="gpu0", deviceNamespace="default"))
    await h.call("RemoveDevice", pb.RemoveDeviceRequest(deviceName="never-was"))
    assert [c.kind for c in h.changes] == ["added", "removed"]
    assert h.registry.devices() == []
    assert h.server.rpc_counts["RemoveDevice"] == {"ok": 3}


async def test_get_device_returns_the_spec_and_current_twins(h: Harness) -> None:
    await h.call("RegisterDevice", pb.RegisterDeviceRequest(device=pb_device("gpu0", GPU_A)))
    h.twins["default/gpu0"] = [Twin("temperature", "", "64"), Twin("power_limit", "300", "300")]
    reply = await h.call("GetDevice", pb.GetDeviceRequest(deviceName="gpu0", deviceNamespace="default"))
    assert reply.device.name == "gpu0"
    assert reply.device.spec.protocol.protocolName == "gpu"
    assert reply.device.spec.protocol.configData.data["uuid"].type_url.endswith("StringValue")
    got = [(t.propertyName, t.observedDesired.value, t.reported.value) for t in reply.device.status.twins]
    assert got == [("temperature", "", "64"), ("power_limit", "300", "300")]


async def test_get_device_of_an_unknown_device_is_not_found(h: Harness) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await h.call("GetDevice", pb.GetDeviceRequest(deviceName="ghost", deviceNamespace="default"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "device default/ghost is not known" in (info.value.details() or "")
    assert h.server.rpc_counts["GetDevice"] == {"not_found": 1}


async def test_a_listener_that_raises_gives_internal_and_the_server_keeps_serving(h: Harness) -> None:
    def broken(change: DeviceChange) -> None:
        raise RuntimeError("listener bug")

    h.registry.subscribe(broken)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await h.call("RegisterDevice", pb.RegisterDeviceRequest(device=pb_device("gpu0", GPU_A)))
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert "listener bug" in (info.value.details() or "")
    reply = await h.call("GetDevice", pb.GetDeviceRequest(deviceName="gpu0", deviceNamespace="default"))
    assert reply.device.name == "gpu0"
    assert h.server.rpc_counts["RegisterDevice"] == {"internal": 1}


async def test_edgecore_reaches_the_server_at_the_address_the_client_registered(h: Harness) -> None:
    """The whole DMI loop: register with MapperInfo.address, then EdgeCore dials that raw path back."""
    await h.edge.start()
    client = DmiClient(edgecore_socket=h.edge.socket_path, mapper_socket=h.server.socket_path, timeout_s=2)
    try:
        await client.register()
    finally:
        await client.close()
    address = h.edge.rec.registers[0].mapper.address
    try:
        async with h.edge.mapper(address) as stub:
            await stub.RegisterDevice(pb.RegisterDeviceRequest(device=pb_device("gpu0", GPU_A)), timeout=10)
    finally:
        await h.edge.stop()
    assert [d.key for d in h.registry.devices()] == ["default/gpu0"]
