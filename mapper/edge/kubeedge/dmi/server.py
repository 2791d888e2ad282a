"""DeviceMapperService: what EdgeCore calls on the mapper, served on our own Unix socket.

EdgeCore dials a fresh connection for each call with a 10 s deadline, so every handler here only converts the
message, updates the ``Registry`` and returns: the registry notifies its listeners synchronously and the
listeners only schedule work (no GPU call ever runs inside a handler).

Behaviour, per the KubeEdge facts:

* Idempotent: RegisterDevice of a known device is an upsert; RemoveDevice / RemoveDeviceModel of something
  unknown succeeds; UpdateDevice of an unknown device adds it.
* UpdateDevice with an unchanged spec (EdgeCore <= 1.22 sends one on every status change) is answered OK and
  notifies nobody (``Registry.upsert_device`` returns ``unchanged``).
* A device whose model is not known yet is ACCEPTED: EdgeCore does not guarantee model-before-device order and
  never replays a failed call, so refusing it would lose the device until the next MapperRegister. Its
  properties are checked against the GPU catalog now, and against the model once the model is known.
* Bad input is refused with a status code and a message that says what is wrong, and the registry is left as
  it was: INVALID_ARGUMENT (missing uuid, unknown property, a configData value of the wrong type, a model
  property not in the catalog), FAILED_PRECONDITION (a GPU uuid that is not on this node, or one that belongs
  to another device), NOT_FOUND (GetDevice of an unknown device).
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from mapper.edge.kubeedge.dmi import convert
from mapper.edge.kubeedge.dmi.pb import dmi_pb2 as pb
from mapper.edge.kubeedge.dmi.pb import dmi_pb2_grpc as pb_grpc
from mapper.edge.kubeedge.registry import PreconditionError, Registry
from mapper.errors import ConfigError, InvalidValueError, MapperError, NotFoundError, PermanentError
from mapper.shared.model import DeviceConfig, Twin

log = logging.getLogger(__name__)

DEFAULT_SOCKET = "/etc/kubeedge/gpu.sock"
#: sun_path holds 108 bytes including the terminating NUL.
MAX_SOCKET_PATH_BYTES = 107

TwinsOf = Callable[[DeviceConfig], Iterable[Twin]]


def _status_for(exc: Exception) -> grpc.StatusCode:
    if isinstance(exc, PreconditionError):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, NotFoundError):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, InvalidValueError | ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, PermanentError):
        return grpc.StatusCode.FAILED_PRECONDITION
    return grpc.StatusCode.INTERNAL


class _Servicer(pb_grpc.DeviceMapperServiceServicer):
    def __init__(self, owner: DmiServer) -> None:
        self._owner = owner

    async def _guard(self, method: str, context: grpc.aio.ServicerContext[Any, Any], body: Callable[[], Any]) -> Any:
        try:
            response = body()
        except (MapperError, ValueError) as exc:
            code = _status_for(exc)
            self._owner._count(method, code.name.lower())
            log.warning("DMI %s refused (%s): %s", method, code.name, exc)
            await context.abort(code, str(exc))
        except Exception as exc:
            self._owner._count(method, "internal")
            log.exception("DMI %s failed", method)
            await context.abort(grpc.StatusCode.INTERNAL, f"{method} failed inside the mapper: {exc}")
        self._owner._count(method, "ok")
        return response

    # --- devices ----------------------------------------------------------------------------------
    async def RegisterDevice(self, request: Any, context: Any) -> Any:
        return await self._guard("RegisterDevice", context, lambda: self._owner._upsert(request, "RegisterDevice"))

    async def UpdateDevice(self, request: Any, context: Any) -> Any:
        def body() -> Any:
            self._owner._upsert(request, "UpdateDevice")
            return pb.UpdateDeviceResponse()

        return await self._guard("UpdateDevice", context, body)

    async def RemoveDevice(self, request: Any, context: Any) -> Any:
        def body() -> Any:
            namespace = request.deviceNamespace or convert.DEFAULT_NAMESPACE
            if not request.deviceName:
                raise InvalidValueError("RemoveDevice: deviceName is empty", reason="empty")
            removed = self._owner.registry.remove_device(namespace, request.deviceName)
            self._owner.registry.accepted("dmi", f"{namespace}/{request.deviceName}")
            if removed is None:
                log.info("RemoveDevice %s/%s: not known here (already removed)", namespace, request.deviceName)
            return pb.RemoveDeviceResponse()

        return await self._guard("RemoveDevice", context, body)

    async def GetDevice(self, request: Any, context: Any) -> Any:
        def body() -> Any:
            namespace = request.deviceNamespace or convert.DEFAULT_NAMESPACE
            device = self._owner.registry.get_device(namespace, request.deviceName)
            twins = list(self._owner.twins_of(device))
            return pb.GetDeviceResponse(device=convert.device_to_pb(device, twins, protocol=self._owner.protocol))

        return await self._guard("GetDevice", context, body)

    # --- models -----------------------------------------------------------------------------------
    async def CreateDeviceModel(self, request: Any, context: Any) -> Any:
        def body() -> Any:
            model = self._owner._model(request, "CreateDeviceModel")
            self._owner.registry.upsert_model(model)
            return pb.CreateDeviceModelResponse(deviceModelName=model.name, deviceModelNamespace=model.namespace)

        return await self._guard("CreateDeviceModel", context, body)

    async def UpdateDeviceModel(self, request: Any, context: Any) -> Any:
        def body() -> Any:
            self._owner.registry.upsert_model(self._owner._model(request, "UpdateDeviceModel"))
            return pb.UpdateDeviceModelResponse()

        return await self._guard("UpdateDeviceModel", context, body)

    async def RemoveDeviceModel(self, request: Any, context: Any) -> Any:
        def body() -> Any:
            if not request.modelName:
                raise InvalidValueError("RemoveDeviceModel: modelName is empty", reason="empty")
            namespace = request.modelNamespace or convert.DEFAULT_NAMESPACE
            self._owner.registry.remove_model(namespace, request.modelName)
            return pb.RemoveDeviceModelResponse()

        return await self._guard("RemoveDeviceModel", context, body)


class DmiServer:
    """Serves DeviceMapperService on ``socket_path`` for EdgeCore.

    ``registry``: where devices and models go (its listeners react). ``twins_of(device)``: the device's current
    twins, for GetDevice (may return nothing). ``protocol``: the name written into GetDevice replies.
    """

    def __init__(
        self,
        registry: Registry,
        twins_of: TwinsOf,
        *,
        socket_path: str = DEFAULT_SOCKET,
        socket_mode: int = 0o660,
        protocol: str = "gpu",
        max_message_bytes: int = 4 * 1024**2,
    ) -> None:
        self.registry = registry
        self.twins_of = twins_of
        self.socket_path = socket_path
        self.socket_mode = socket_mode
        self.protocol = protocol
        #: Largest message received or sent; a bigger request is refused with RESOURCE_EXHAUSTED before it
        #: is parsed (gRPC's default receive limit is the same 4 MiB, its send limit none).
        self.max_message_bytes = max_message_bytes
        #: RPCs served, by method and result: ``{"UpdateDevice": {"ok": 3, "invalid_argument": 1}}``.
        self.rpc_counts: dict[str, dict[str, int]] = {}
        self._server: grpc.aio.Server | None = None

    def _count(self, method: str, result: str) -> None:
        per_method = self.rpc_counts.setdefault(method, {})
        per_method[result] = per_method.get(result, 0) + 1

    # --- helpers the servicer uses --------------------------------------------------------------------
    def _upsert(self, request: Any, method: str) -> pb.RegisterDeviceResponse:
        if not request.HasField("device"):
            raise InvalidValueError(f"{method}: the request carries no device", reason="empty")
        key = f"{request.device.namespace or convert.DEFAULT_NAMESPACE}/{request.device.name}"
        try:
            device = convert.device_from_pb(request.device)
            change = self.registry.upsert_device(device)
        except (MapperError, ValueError) as exc:
            # Refused: the Device keeps the version it had (``desired_status`` says so), nothing else changes.
            self.registry.refuse("dmi", method, key, exc)
            raise
        self.registry.accepted("dmi", device.key)
        if self.registry.model_of(device) is None and change.kind == "added":
            log.info("%s %s: model %r is not known yet; accepted anyway", method, device.key, device.model)
        log.debug("%s %s: %s", method, device.key, change.kind)
        return pb.RegisterDeviceResponse(deviceName=device.name, deviceNamespace=device.namespace)

    def _model(self, request: Any, method: str) -> Any:
        if not request.HasField("model"):
            raise InvalidValueError(f"{method}: the request carries no model", reason="empty")
        return convert.model_from_pb(request.model)

    # --- lifecycle --------------------------------------------------------------------------------
    def _prepare_socket(self) -> None:
        path = Path(self.socket_path)
        if len(os.fsencode(self.socket_path)) > MAX_SOCKET_PATH_BYTES:
            raise ConfigError(
                f"DMI socket path {self.socket_path!r} is longer than {MAX_SOCKET_PATH_BYTES} bytes (Unix socket limit)"
            )
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"cannot create the directory of the DMI socket {self.socket_path}: {exc}") from exc
        try:
            st = path.lstat()
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise ConfigError(f"DMI socket path {self.socket_path} exists and is not a socket; refusing to remove it")
        log.info("removing stale socket %s", self.socket_path)
        path.unlink()

    async def start(self) -> None:
        """Remove a stale socket, bind, start serving, then set the socket's mode (0660)."""
        if self._server is not None:
            return
        self._prepare_socket()
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", self.max_message_bytes),
                ("grpc.max_send_message_length", self.max_message_bytes),
            ]
        )
        pb_grpc.add_DeviceMapperServiceServicer_to_server(_Servicer(self), server)
        try:
            port = server.add_insecure_port(f"unix://{self.socket_path}")
        except RuntimeError as exc:
            raise ConfigError(f"cannot listen on DMI socket {self.socket_path}: {exc}") from exc
        if port == 0:
            raise ConfigError(f"cannot listen on DMI socket {self.socket_path}")
        await server.start()
        self._server = server
        os.chmod(self.socket_path, self.socket_mode)
        log.info("DeviceMapperService listening on %s", self.socket_path)

    async def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving (in-flight calls get ``grace_s``) and remove our socket file."""
        server, self._server = self._server, None
        if server is None:
            return
        await server.stop(grace_s)
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("could not remove socket %s: %s", self.socket_path, exc)

    @property
    def serving(self) -> bool:
        return self._server is not None
