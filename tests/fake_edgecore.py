"""A test EdgeCore: DeviceManagerService on a temporary Unix socket, plus a DeviceMapperService client.

It behaves like EdgeCore's devicetwin where the mapper can notice:

* one token bucket (1 token/s, burst 100, on an injected clock) taken first by MapperRegister,
  ReportDeviceStatus and ReportDeviceStates; over it the call fails with "... too many request ...";
* MapperRegister refuses an empty protocol, answers ``withData`` with the devices of that protocol and their
  model once PER DEVICE (so duplicates occur, as in EdgeCore);
* ReportDeviceStatus needs a namespace and at least one twin; a twin without ``observedDesired`` or
  ``reported`` is what crashes a real EdgeCore: here it is recorded in ``violations`` and answered INTERNAL;
  keys and values are checked with devicetwin's regexes (a bad one is recorded in ``twin_rejections``: the
  real one accepts the RPC and rejects the update asynchronously);
* ReportDeviceStates drops a state outside ok/online/offline/unknown/unhealthy silently (``dropped_states``).

``restart()`` stops the server, deletes the socket and serves again on the same path (a new inode), as a
restarted EdgeCore does. ``mapper(address)`` opens a DeviceMapperService client to the mapper's socket, one
connection per call like EdgeCore.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio
import pytest

from mapper.edge.kubeedge.dmi.pb import dmi_pb2 as pb
from mapper.edge.kubeedge.dmi.pb import dmi_pb2_grpc as pb_grpc
from mapper.shared.model import WRITABLE

KEY_RE = re.compile(r"[a-zA-Z0-9\-_.,:/@#]{1,128}")
VALUE_RE = re.compile(r"[a-zA-Z0-9\-_.,:/@#]{1,512}")
STATES = ("online", "offline", "ok", "unknown", "unhealthy")


@pytest.fixture
def sock_dir() -> Iterator[str]:
    """A short temporary directory for Unix sockets (pytest's tmp_path can exceed the 107-byte limit)."""
    path = tempfile.mkdtemp(prefix="dmi-", dir="/tmp")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


class EdgeBucket:
    """EdgeCore's limiter: 1 token per ``period_s``, ``burst`` tokens, on the given monotonic clock."""

    def __init__(self, now: Callable[[], float], *, period_s: float = 1.0, burst: int = 100) -> None:
        self._now = now
        self.period_s = period_s
        self.burst = burst
        self.tokens = float(burst)
        self._at = now()

    def take(self) -> bool:
        t = self._now()
        self.tokens = min(float(self.burst), self.tokens + max(0.0, t - self._at) / self.period_s)
        self._at = max(self._at, t)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


@dataclass
class Recorded:
    registers: list[Any] = field(default_factory=list)
    statuses: list[Any] = field(default_factory=list)
    #: When each of ``statuses`` was accepted (``now()``; time.monotonic by default, CLOCK_MONOTONIC on Linux).
    status_times: list[float] = field(default_factory=list)
    states: list[Any] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    twin_rejections: list[str] = field(default_factory=list)
    dropped_states: list[str] = field(default_factory=list)
    #: Monotonic time of every accepted call that took a token, in order.
    call_times: list[float] = field(default_factory=list)


class _Manager(pb_grpc.DeviceManagerServiceServicer):
    def __init__(self, edge: FakeEdgeCore) -> None:
        self.edge = edge

    async def _limit(self, method: str, context: Any) -> None:
        if self.edge.bucket is not None and not self.edge.bucket.take():
            self.edge.rec.refused.append((method, "rate"))
            await context.abort(
                grpc.StatusCode.UNKNOWN, f"fail to {method} because of too many request: limiter has no token"
            )
        self.edge.rec.call_times.append(self.edge.now())

    async def MapperRegister(self, request: Any, context: Any) -> Any:
        await self._limit("MapperRegister", context)
        self.edge.rec.registers.append(request)
        if self.edge.register_gate is not None:
            await self.edge.register_gate.wait()
        if not request.HasField("mapper") or not request.mapper.protocol:
            self.edge.rec.refused.append(("MapperRegister", "protocol"))
            await context.abort(grpc.StatusCode.UNKNOWN, "mapper protocol is empty")
        if not request.withData:
            return pb.MapperRegisterResponse()
        devices = [d for d in self.edge.devices if d.spec.protocol.protocolName == request.mapper.protocol]
        models = []
        for device in devices:
            for model in self.edge.models:
                if model.name == device.spec.deviceModelReference and model.namespace == device.namespace:
                    models.append(model)
        return pb.MapperRegisterResponse(deviceList=devices, modelList=models)

    async def ReportDeviceStatus(self, request: Any, context: Any) -> Any:
        await self._limit("ReportDeviceStatus", context)
        if not request.HasField("reportedDevice") or len(request.reportedDevice.twins) == 0:
            self.edge.rec.refused.append(("ReportDeviceStatus", "no twins"))
            await context.abort(grpc.StatusCode.UNKNOWN, f"device {request.deviceName} does not have twin data")
        for twin in request.reportedDevice.twins:
            if not twin.HasField("observedDesired") or not twin.HasField("reported"):
                self.edge.rec.violations.append(f"{request.deviceName}/{twin.propertyName}: a twin field is nil")
                await context.abort(grpc.StatusCode.INTERNAL, "nil pointer dereference")
            if not KEY_RE.fullmatch(twin.propertyName):
                self.edge.rec.twin_rejections.append(f"key {twin.propertyName!r}")
            for value in (twin.observedDesired.value, twin.reported.value):
                if value and not VALUE_RE.fullmatch(value):
                    self.edge.rec.twin_rejections.append(f"{twin.propertyName} value {value!r}")
        if not request.deviceNamespace:
            self.edge.rec.twin_rejections.append(f"{request.deviceName}: empty namespace misses the device")
        self.edge.rec.statuses.append(request)
        self.edge.rec.status_times.append(self.edge.now())
        return pb.ReportDeviceStatusResponse()

    async def ReportDeviceStates(self, request: Any, context: Any) -> Any:
        await self._limit("ReportDeviceStates", context)
        if not request.deviceName or not request.state:
            self.edge.rec.refused.append(("ReportDeviceStates", "empty"))
            await context.abort(grpc.StatusCode.UNKNOWN, "device name and state are required")
        if request.state.lower() not in STATES:
            self.edge.rec.dropped_states.append(request.state)
        self.edge.rec.states.append(request)
        return pb.ReportDeviceStatesResponse()


class FakeEdgeCore:
    """``FakeEdgeCore(socket_path, now=clock.monotonic)``; ``await start()`` / ``stop()`` / ``restart()``."""

    def __init__(
        self,
        socket_path: str,
        *,
        now: Callable[[], float] | None = None,
        enforce_rate: bool = True,
        burst: int = 100,
    ) -> None:
        import time

        self.socket_path = socket_path
        self.now: Callable[[], float] = now or time.monotonic
        self.bucket: EdgeBucket | None = EdgeBucket(self.now, burst=burst) if enforce_rate else None
        self.devices: list[Any] = []
        self.models: list[Any] = []
        self.rec = Recorded()
        #: When set, MapperRegister waits for this event after recording the call (a slow EdgeCore).
        self.register_gate: asyncio.Event | None = None
        self._server: grpc.aio.Server | None = None

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)  # EdgeCore deletes its stale socket file when it starts
        server = grpc.aio.server()
        pb_grpc.add_DeviceManagerServiceServicer_to_server(_Manager(self), server)
        server.add_insecure_port(f"unix://{self.socket_path}")
        await server.start()
        self._server = server

    async def stop(self, *, remove_socket: bool = True) -> None:
        server, self._server = self._server, None
        if server is not None:
            await server.stop(0)
        if remove_socket:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)

    async def restart(self) -> None:
        await self.stop()
        await self.start()

    def identity(self) -> tuple[int, int]:
        """(inode, ctime): a restart creates a new socket file (the inode NUMBER may be reused)."""
        st = os.stat(self.socket_path)
        return (st.st_ino, st.st_ctime_ns)

    @contextlib.asynccontextmanager
    async def mapper(self, address: bytes | str) -> AsyncIterator[Any]:
        """A DeviceMapperService stub to the mapper at ``address`` (MapperInfo.address: a raw path)."""
        path = os.fsdecode(address)
        async with grpc.aio.insecure_channel(f"unix://{path}") as channel:
            yield pb_grpc.DeviceMapperServiceStub(channel)


# --- builders for EdgeCore-shaped messages ------------------------------------------------------------


def any_of(value: Any) -> Any:
    """Pack a CRD JSON value as EdgeCore does: every number a FloatValue, strings and booleans as such."""
    from google.protobuf import any_pb2, wrappers_pb2

    packed = any_pb2.Any()
    if isinstance(value, bool):
        packed.Pack(wrappers_pb2.BoolValue(value=value))
    elif isinstance(value, int | float):
        packed.Pack(wrappers_pb2.FloatValue(value=float(value)))
    elif isinstance(value, str):
        packed.Pack(wrappers_pb2.StringValue(value=value))
    else:
        packed.CopyFrom(value)  # already an Any (tests of odd wrappers)
    return packed


def pb_device(
    name: str,
    uuid: str | None,
    *,
    namespace: str = "default",
    model: str = "nvidia-gpu",
    properties: dict[str, str | None] | None = None,
    config: dict[str, Any] | None = None,
    protocol: str = "gpu",
    cycle_ms: int = 10_000,
) -> Any:
    """A Device as EdgeCore sends it; ``properties`` maps name -> desired value (None = no desired)."""
    data = dict(config or {})
    if uuid is not None:
        data["uuid"] = uuid
    props = []
    for prop_name, desired in (properties or {"temperature": None, "power_limit": "300"}).items():
        prop = pb.DeviceProperty(name=prop_name, collectCycle=cycle_ms, reportCycle=cycle_ms, reportToCloud=True)
        if desired is not None:
            prop.desired.CopyFrom(pb.TwinProperty(value=desired))
        props.append(prop)
    protocol_config = pb.ProtocolConfig(protocolName=protocol)
    for key, value in data.items():
        protocol_config.configData.data[key].CopyFrom(any_of(value))
    return pb.Device(
        name=name,
        namespace=namespace,
        spec=pb.DeviceSpec(deviceModelReference=model, protocol=protocol_config, properties=props),
        status=pb.DeviceStatus(reportToCloud=True, reportCycle=30_000),
    )


def pb_model(name: str = "nvidia-gpu", *, namespace: str = "default", props: dict[str, str] | None = None) -> Any:
    """A DeviceModel; ``props`` maps property name -> type (ReadWrite for the catalog's writable ones)."""
    props = props or {"temperature": "INT", "power_limit": "FLOAT", "power_usage": "FLOAT"}
    return pb.DeviceModel(
        name=name,
        namespace=namespace,
        spec=pb.DeviceModelSpec(
            properties=[
                pb.ModelProperty(name=n, type=t, accessMode="ReadWrite" if n in WRITABLE else "ReadOnly")
                for n, t in props.items()
            ]
        ),
    )


def pb_from_doc(doc: dict[str, Any]) -> Any:
    """A Device as EdgeCore sends it, from a Device document as ``gpu-mapper discover`` writes it (its
    properties with their own collect and report cycles, its state report settings, its configData)."""
    spec = doc["spec"]
    protocol_config = pb.ProtocolConfig(protocolName=spec["protocol"]["protocolName"])
    for key, value in spec["protocol"].get("configData", {}).items():
        protocol_config.configData.data[key].CopyFrom(any_of(value))
    props = []
    for p in spec["properties"]:
        prop = pb.DeviceProperty(
            name=p["name"],
            collectCycle=p.get("collectCycle", 0),
            reportCycle=p.get("reportCycle", 0),
            reportToCloud=p.get("reportToCloud", False),
        )
        if "desired" in p:
            prop.desired.CopyFrom(pb.TwinProperty(value=str(p["desired"]["value"])))
        props.append(prop)
    state = spec.get("stateReport") or doc.get("status") or {}
    return pb.Device(
        name=doc["metadata"]["name"],
        namespace=doc["metadata"].get("namespace", "default"),
        spec=pb.DeviceSpec(
            deviceModelReference=spec["deviceModelRef"]["name"], protocol=protocol_config, properties=props
        ),
        status=pb.DeviceStatus(
            reportToCloud=state.get("reportToCloud", False), reportCycle=state.get("reportCycle", 0)
        ),
    )


def pb_model_from_doc(doc: dict[str, Any]) -> Any:
    """The DeviceModel as EdgeCore sends it, from ``mapper.tools.discover.model_doc``."""
    return pb.DeviceModel(
        name=doc["metadata"]["name"],
        namespace=doc["metadata"].get("namespace", "default"),
        spec=pb.DeviceModelSpec(
            properties=[
                pb.ModelProperty(name=p["name"], type=p["type"], accessMode=p["accessMode"], unit=p.get("unit", ""))
                for p in doc["spec"]["properties"]
            ]
        ),
    )
