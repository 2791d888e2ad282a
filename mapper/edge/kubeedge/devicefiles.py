"""Standalone mode: Device and DeviceModel YAML files in a folder stand in for EdgeCore.

``load_folder(path)`` reads every ``*.yaml``/``*.yml`` file (multi-document files allowed) and returns the
GPU Devices (``spec.protocol.protocolName: gpu``) and DeviceModels it finds, converted as EdgeCore would: the
model's ``protocolConfigData`` and property visitors are the base, the Device's own values win. A file that
cannot be read or parsed is reported (path and reason) and skipped, and so is a Device that does not convert; the
others still load. What was refused is named (``failed_files``, ``refused``) so that the caller keeps the Devices
it defined as they were: a file that fails to parse is not an operator removing its Devices.
``FolderWatcher`` tells when the folder changed: Linux inotify says when to look (no wake-up while the folder is
idle), a fingerprint of the files' names, sizes, inodes and modification times says whether anything changed.
Where inotify cannot watch the folder (no inotify in the C library, the watch limit reached, the folder missing, a
filesystem that refuses it) the caller polls, and every look tries to watch again. ``watch_folder`` is the
mapper's loop over both: it reads the folder when it changed and hands the contents to the registry.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import hashlib
import logging
import os
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from mapper.clock import sleep_or_wake
from mapper.edge.push.spec import parse_push_method
from mapper.errors import InvalidValueError
from mapper.shared.model import DeviceConfig, DeviceModelConfig, DeviceProperty, ModelProperty, Scalar

PROTOCOL = "gpu"

log = logging.getLogger(__name__)


@dataclass
class FolderContents:
    devices: list[DeviceConfig] = field(default_factory=list)
    models: list[DeviceModelConfig] = field(default_factory=list)
    #: (file, reason) for every document that was skipped.
    errors: list[tuple[str, str]] = field(default_factory=list)
    #: Every file that was read and parsed -> the GPU Devices (``namespace/name``) it defines, converted or not.
    file_devices: dict[str, list[str]] = field(default_factory=dict)
    #: Every file that could not be read or parsed -> why.
    failed_files: dict[str, str] = field(default_factory=dict)
    #: Devices (``namespace/name``) defined in a file that parsed but refused on conversion -> (file, why).
    refused: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: Why the folder itself could not be listed ("" when it could, or when it does not exist: no files).
    folder_error: str = ""


def _device_key(doc: Mapping[str, Any]) -> str | None:
    """``namespace/name`` of a Device document, None when its metadata does not say."""
    meta = doc.get("metadata")
    if not isinstance(meta, Mapping) or not meta.get("name"):
        return None
    return f"{meta.get('namespace', 'default')}/{meta.get('name')}"  # as device_from_doc names it


def _flat(mapping: Any, where: str) -> dict[str, Scalar]:
    if mapping is None:
        return {}
    if not isinstance(mapping, Mapping):
        raise InvalidValueError(f"{where}: must be a mapping", reason="wrong-type")
    out: dict[str, Scalar] = {}
    for key, value in mapping.items():
        if isinstance(value, dict | list):
            # EdgeCore cannot convert nested values either: the device is never sent to a mapper.
            raise InvalidValueError(f"{where}.{key}: nested values are not supported", reason="wrong-type")
        if value is None:
            continue
        out[str(key)] = value
    return out


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    """``value`` as a mapping (absent or null: empty); anything else is refused, naming ``where``."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidValueError(f"{where}: must be a mapping, got {type(value).__name__}", reason="wrong-type")
    return value


def _list(value: Any, where: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidValueError(f"{where}: must be a list, got {type(value).__name__}", reason="wrong-type")
    return value


def _int(value: Any, where: str) -> int:
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise InvalidValueError(f"{where}: expected milliseconds as a number, got {value!r}", reason="wrong-type")
    try:
        number = int(float(value))
    except (ValueError, OverflowError):
        raise InvalidValueError(
            f"{where}: expected milliseconds as a number, got {value!r}", reason="wrong-type"
        ) from None
    if number < 0:
        raise InvalidValueError(f"{where}: must not be negative", reason="negative")
    return number


def model_from_doc(doc: Mapping[str, Any]) -> DeviceModelConfig:
    meta = _mapping(doc.get("metadata"), "DeviceModel metadata")
    spec = _mapping(doc.get("spec"), "DeviceModel spec")
    props = []
    for i, p in enumerate(_list(spec.get("properties"), "DeviceModel spec.properties")):
        if not isinstance(p, Mapping) or not p.get("name"):
            raise InvalidValueError(f"spec.properties[{i}]: a property needs a name", reason="empty")
        props.append(
            ModelProperty(
                name=str(p["name"]),
                ptype=str(p.get("type", "")),
                access_mode=str(p.get("accessMode", "ReadOnly")),
                unit=str(p.get("unit", "")),
                minimum=str(p.get("minimum", "")),
                maximum=str(p.get("maximum", "")),
                description=str(p.get("description", "")),
            )
        )
    return DeviceModelConfig(
        namespace=str(meta.get("namespace", "default")), name=str(meta.get("name", "")), properties=tuple(props)
    )


def device_from_doc(doc: Mapping[str, Any], model_doc: Mapping[str, Any] | None) -> DeviceConfig:
    """Convert a Device manifest, merging its model's defaults the way EdgeCore v1.22+ does."""
    meta = _mapping(doc.get("metadata"), "Device metadata")
    spec = _mapping(doc.get("spec"), "Device spec")
    name = str(meta.get("name", ""))
    namespace = str(meta.get("namespace", "default"))
    where = f"Device {namespace}/{name}"
    model_spec = _mapping(_mapping(model_doc, f"{where}: model").get("spec"), f"{where}: model spec")
    protocol = _mapping(spec.get("protocol"), f"{where}: spec.protocol")
    config = _flat(model_spec.get("protocolConfigData"), f"{where}: model protocolConfigData")
    config.update(_flat(protocol.get("configData"), f"{where}: spec.protocol.configData"))
    model_visitors = {
        str(p.get("name")): _flat(
            _mapping(p.get("visitors"), f"{where}: model visitors").get("configData"), f"{where}: model visitors"
        )
        for p in _list(model_spec.get("properties"), f"{where}: model spec.properties")
        if isinstance(p, Mapping)
    }
    props = []
    for i, p in enumerate(_list(spec.get("properties"), f"{where}: spec.properties")):
        pw = f"{where}: spec.properties[{i}]"
        if not isinstance(p, Mapping) or not p.get("name"):
            raise InvalidValueError(f"{pw}: a property needs a name", reason="empty")
        pname = str(p["name"])
        desired = p.get("desired")
        desired_value: str | None = None
        desired_meta: dict[str, str] = {}
        if desired is not None:
            if not isinstance(desired, Mapping) or "value" not in desired:
                raise InvalidValueError(f"{pw}.desired: value is required", reason="empty")
            desired_value = str(desired["value"])
            desired_meta = {
                str(k): str(v) for k, v in _mapping(desired.get("metadata"), f"{pw}.desired.metadata").items()
            }
        visitor = dict(model_visitors.get(pname, {}))
        visitor.update(
            _flat(_mapping(p.get("visitors"), f"{pw}.visitors").get("configData"), f"{pw}.visitors.configData")
        )
        # A pushMethod that is not a mapping is a malformed document; a bad value in a method is refused in a note
        # (the property, its other method and the Device stay).
        methods = _mapping(p.get("pushMethod"), f"{pw}.pushMethod") if "pushMethod" in p else None
        push = parse_push_method(methods, f"{pw}.pushMethod", table=f"{namespace}/{name}/{pname}")
        props.append(
            DeviceProperty(
                name=pname,
                desired=desired_value,
                desired_metadata=desired_meta,
                collect_cycle_ms=_int(p.get("collectCycle"), f"{pw}.collectCycle"),
                report_cycle_ms=_int(p.get("reportCycle"), f"{pw}.reportCycle"),
                report_to_cloud=bool(p.get("reportToCloud", True)),
                push_mqtt=push.mqtt,
                visitor_config=visitor,
                push=push.push,
                db=push.db,
                push_notes=push.notes,
            )
        )
    state_report = _mapping(spec.get("stateReport") or doc.get("status"), f"{where}: spec.stateReport")
    uuid = config.get("uuid", "")
    if not isinstance(uuid, str):
        raise InvalidValueError(f"{where}: configData.uuid must be a string, got {uuid!r}", reason="wrong-type")
    return DeviceConfig(
        namespace=namespace,
        name=name,
        model=str(_mapping(spec.get("deviceModelRef"), f"{where}: spec.deviceModelRef").get("name", "")),
        uuid=uuid,
        properties=tuple(props),
        protocol_config=config,
        state_report_to_cloud=bool(state_report.get("reportToCloud", True)),
        state_report_cycle_ms=_int(state_report.get("reportCycle"), f"{where}: stateReport.reportCycle"),
    )


def load_folder(path: str | Path, node_name: str | None = None) -> FolderContents:
    """Read every YAML file in ``path``. Devices bound to another node (``spec.nodeName``) are skipped."""
    out = FolderContents()
    device_docs: list[tuple[str, Mapping[str, Any]]] = []
    model_docs: dict[str, Mapping[str, Any]] = {}
    try:
        os.listdir(path)
    except FileNotFoundError:
        pass  # no folder: no files (its Devices were removed with it)
    except OSError as exc:
        out.folder_error = f"cannot list {path}: {exc.strerror or exc}"
        return out
    for file in sorted(Path(path).glob("*.y*ml")):
        try:
            docs = list(yaml.safe_load_all(file.read_text()))
        except (OSError, yaml.YAMLError, ValueError) as exc:
            reason = f"cannot read or parse: {exc}"
            out.errors.append((str(file), reason))
            out.failed_files[str(file)] = reason
            continue
        defined = out.file_devices.setdefault(str(file), [])
        for doc in docs:
            if not isinstance(doc, Mapping):
                continue
            kind = doc.get("kind")
            try:
                if kind == "DeviceModel":
                    if _mapping(doc.get("spec"), "DeviceModel spec").get("protocol", PROTOCOL) != PROTOCOL:
                        continue
                    meta = _mapping(doc.get("metadata"), "DeviceModel metadata")
                    model_docs[f"{meta.get('namespace', 'default')}/{meta.get('name', '')}"] = doc
                    out.models.append(model_from_doc(doc))
                elif kind == "Device":
                    spec = _mapping(doc.get("spec"), "Device spec")
                    if _mapping(spec.get("protocol"), "Device spec.protocol").get("protocolName") != PROTOCOL:
                        continue
                    if node_name and spec.get("nodeName") not in (None, "", node_name):
                        continue
                    key = _device_key(doc)
                    if key is not None:
                        defined.append(key)
                    device_docs.append((str(file), doc))
            except InvalidValueError as exc:
                out.errors.append((str(file), str(exc)))
                key = _device_key(doc) if kind == "Device" else None
                if key is not None:
                    defined.append(key)
                    out.refused[key] = (str(file), str(exc))
    for file_name, doc in device_docs:
        try:
            meta = _mapping(doc.get("metadata"), "Device metadata")
            model_ref = _mapping(_mapping(doc.get("spec"), "Device spec").get("deviceModelRef"), "deviceModelRef")
            model_key = f"{meta.get('namespace', 'default')}/{model_ref.get('name', '')}"
            out.devices.append(device_from_doc(doc, model_docs.get(model_key)))
        except InvalidValueError as exc:
            out.errors.append((file_name, str(exc)))
            key = _device_key(doc)
            if key is not None:
                out.refused[key] = (file_name, str(exc))
    return out


# inotify(7) constants, from <sys/inotify.h>.
IN_MODIFY = 0x00000002
IN_ATTRIB = 0x00000004
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_UNMOUNT = 0x00002000
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
#: What the folder's watch asks for. A Kubernetes ConfigMap volume is updated by renaming a new ``..data``
#: symlink over the old one (IN_MOVED_TO); editors write in place (IN_MODIFY, IN_CLOSE_WRITE) or rename a
#: temporary file over the old one; the folder itself may go away (IN_DELETE_SELF, IN_MOVE_SELF).
WATCH_MASK = (
    IN_CREATE
    | IN_DELETE
    | IN_MODIFY
    | IN_CLOSE_WRITE
    | IN_MOVED_TO
    | IN_MOVED_FROM
    | IN_ATTRIB
    | IN_DELETE_SELF
    | IN_MOVE_SELF
    | IN_ONLYDIR
)
#: Events after which the watch is gone (or follows a folder that is no longer at the watched path).
_WATCH_LOST = IN_IGNORED | IN_DELETE_SELF | IN_MOVE_SELF | IN_UNMOUNT
#: struct inotify_event: int wd; uint32_t mask, cookie, len; char name[len].
_EVENT_HEADER = struct.Struct("iIII")
#: Larger than one event can be (header + NAME_MAX + 1), so a read never fails with EINVAL.
_READ_BYTES = 64 * 1024


def _check(result: int, call: str) -> int:
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{call} failed: {os.strerror(code)}")
    return result


class Inotify:
    """The three inotify calls of the C library, through ctypes; each failure raises ``OSError`` with errno."""

    def __init__(self, libc: Any) -> None:
        """``libc`` is a ``ctypes.CDLL`` loaded with ``use_errno=True``. AttributeError where it has no inotify."""
        self._init1 = libc.inotify_init1
        self._add_watch = libc.inotify_add_watch
        self._rm_watch = libc.inotify_rm_watch
        self._init1.argtypes = [ctypes.c_int]
        self._init1.restype = ctypes.c_int
        self._add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        self._add_watch.restype = ctypes.c_int
        self._rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
        self._rm_watch.restype = ctypes.c_int

    def init(self) -> int:
        """A new non-blocking, close-on-exec inotify instance: its file descriptor."""
        return _check(self._init1(os.O_NONBLOCK | os.O_CLOEXEC), "inotify_init1")

    def add_watch(self, fd: int, path: Path, mask: int) -> int:
        return _check(self._add_watch(fd, os.fsencode(path), mask), "inotify_add_watch")

    def rm_watch(self, fd: int, wd: int) -> None:
        _check(self._rm_watch(fd, wd), "inotify_rm_watch")


def load_inotify(libc: Any = None) -> Inotify | None:
    """inotify from ``libc`` (default: the C library this process runs on), or None where it has none."""
    try:
        return Inotify(libc if libc is not None else ctypes.CDLL(None, use_errno=True))
    except (OSError, AttributeError):
        return None


class FolderWatcher:
    """Tells whether the YAML files of a folder changed since the last look (names, sizes, inodes, mtimes).

    With inotify, ``fileno()`` is a descriptor that turns readable when something in the folder changed: wait on
    it, ``drain()`` it, then ask ``changed()``; ``poll_interval_s`` is then a long safety poll (a file changed
    through a symlink into another folder, or on a network filesystem that reports nothing, is seen then). An
    event only says "look again": the fingerprint decides. Without a watch, ``poll_interval_s`` is the short poll,
    and every ``changed()`` tries to watch the folder again (a folder created after start, or re-created, is
    watched again). ``close()`` releases the inotify descriptor.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        inotify: Inotify | Literal["auto"] | None = "auto",
        safety_poll_s: float = 60.0,
        fallback_poll_s: float = 2.0,
        settle_s: float = 0.2,
    ) -> None:
        """``inotify``: "auto" loads it from the C library; None polls only. ``settle_s`` is how long a caller
        waits after the first event of a burst (an editor's save, a ConfigMap swap) before looking."""
        self.path = Path(path)
        self.safety_poll_s = safety_poll_s
        self.fallback_poll_s = fallback_poll_s
        self.settle_s = settle_s
        self._last = ""
        self._inotify = load_inotify() if inotify == "auto" else inotify
        self._fd: int | None = None
        self._wd: int | None = None
        #: Reading the descriptor failed: stay on polling (the descriptor stays open until ``close()``).
        self._broken = False
        self._closed = False
        #: Why the folder is polled (logged once per reason), None while watched.
        self._poll_reason: str | None = None
        if self._inotify is None:
            why = "inotify is turned off" if inotify is None else "the C library has no inotify"
            self._polling(why)
        self._watch()

    @property
    def watching(self) -> bool:
        """True while inotify watches the folder."""
        return self._wd is not None

    @property
    def poll_interval_s(self) -> float:
        """How long a caller may wait for an event before it looks anyway."""
        return self.safety_poll_s if self.watching else self.fallback_poll_s

    def fileno(self) -> int | None:
        """The inotify descriptor to wait on (readable when events are pending), or None where there is none."""
        return None if self._broken else self._fd

    def _polling(self, reason: str) -> None:
        if reason != self._poll_reason:
            log.warning("devices folder %s: %s; polling every %g s", self.path, reason, self.fallback_poll_s)
        self._poll_reason = reason

    def _watch(self) -> None:
        if self._wd is not None or self._inotify is None or self._broken or self._closed:
            return
        try:
            if self._fd is None:
                self._fd = self._inotify.init()
            self._wd = self._inotify.add_watch(self._fd, self.path, WATCH_MASK)
        except OSError as exc:
            hint = " (raise the sysctl fs.inotify.max_user_watches)" if exc.errno == errno.ENOSPC else ""
            hint = " (raise the sysctl fs.inotify.max_user_instances)" if exc.errno == errno.EMFILE else hint
            self._polling(f"cannot watch with inotify: {exc.strerror}{hint}")
            return
        if self._poll_reason is not None:
            log.info("devices folder %s: watched with inotify", self.path)
        self._poll_reason = None

    def drain(self) -> bool:
        """Read every pending event without blocking. True when there was any (a queue overflow, IN_Q_OVERFLOW,
        included): look again (``changed()``)."""
        if self._fd is None or self._broken:
            return False
        seen = False
        while True:
            try:
                data = os.read(self._fd, _READ_BYTES)
            except BlockingIOError:
                return seen
            except OSError as exc:
                self._broken = True
                self._wd = None
                self._polling(f"reading inotify events failed: {exc}")
                return True
            if not data:
                return seen
            seen = True
            self._read_events(data)

    def _read_events(self, data: bytes) -> None:
        offset = 0
        while offset + _EVENT_HEADER.size <= len(data):
            wd, mask, _cookie, name_len = _EVENT_HEADER.unpack_from(data, offset)
            offset += _EVENT_HEADER.size + name_len
            if wd != self._wd or not mask & _WATCH_LOST:
                continue
            # Deleted, unmounted, or moved away (the watch would follow the folder to its new name): drop it;
            # the next look watches whatever is at the path then.
            if self._fd is not None and self._inotify is not None and not mask & IN_IGNORED:
                try:
                    self._inotify.rm_watch(self._fd, wd)
                except OSError:
                    pass  # the kernel removed it already
            self._wd = None
            self._polling("the folder was deleted, moved or unmounted")

    def fingerprint(self) -> str:
        h = hashlib.sha1()
        for file in sorted(self.path.glob("*.y*ml")):
            try:
                st = file.stat()
            except OSError:
                continue
            # The inode catches a symlink swapped to a file of the same size and mtime (a ConfigMap update).
            h.update(f"{file.name}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino};".encode())
        return h.hexdigest()

    def changed(self) -> bool:
        """Whether the files changed since the last call (True on the first). Watches the folder again if needed
        (before looking, so a change right after the look still wakes the caller)."""
        self._watch()
        current = self.fingerprint()
        if current != self._last:
            self._last = current
            return True
        return False

    def close(self) -> None:
        """Release the inotify descriptor (its watch goes with it). The watcher polls from then on."""
        self._closed = True
        self._wd = None
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


async def watch_folder(
    path: str,
    node_name: str,
    apply: Callable[[FolderContents], None],
    beat: Callable[[str, float], None] | None = None,
) -> None:
    """Read the devices folder whenever it changed and hand what it holds to ``apply`` (the registry's sync),
    until cancelled. inotify wakes the loop (an idle folder costs no wake-up; a 60 s safety poll remains); where
    the folder cannot be watched it is polled every 2 s. A burst of writes (an editor's save, a ConfigMap update)
    is read once it has settled. ``beat`` is the heartbeat, with the loop's real sleep as its period."""
    watcher = FolderWatcher(path)
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()
    reader_fd: int | None = None
    event_seen = False

    def on_readable() -> None:
        nonlocal event_seen, reader_fd
        # Read the events here: the descriptor stays readable (and the loop spins) until they are read.
        event_seen = watcher.drain() or event_seen
        if watcher.fileno() is None and reader_fd is not None:  # inotify failed: polling from now on
            loop.remove_reader(reader_fd)
            reader_fd = None
        wake.set()

    try:
        while True:
            if watcher.changed():
                apply(await asyncio.to_thread(load_folder, path, node_name))
            fd = watcher.fileno()  # an inotify instance created on a later look needs its reader
            if fd != reader_fd:
                if reader_fd is not None:
                    loop.remove_reader(reader_fd)
                if fd is not None:
                    loop.add_reader(fd, on_readable)
                reader_fd = fd
            period_s = watcher.poll_interval_s
            # Beat with the real sleep, so a watched folder's 60 s safety poll never looks like a stall.
            if beat is not None:
                beat("devices-dir", period_s)
            await sleep_or_wake(wake, period_s)
            if event_seen:
                # Events during the pause are read by on_readable and covered by the look that follows.
                await asyncio.sleep(watcher.settle_s)
                event_seen = False
                wake.clear()
    finally:
        if reader_fd is not None:
            loop.remove_reader(reader_fd)
        watcher.close()
