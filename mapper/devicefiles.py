"""Standalone mode: Device and DeviceModel YAML files in a folder stand in for EdgeCore.

``load_folder(path)`` reads every ``*.yaml``/``*.yml`` file (multi-document files allowed) and returns the
GPU Devices (``spec.protocol.protocolName: gpu``) and DeviceModels it finds, converted as EdgeCore would: the
model's ``protocolConfigData`` and property visitors are the base, the Device's own values win. A file that
cannot be read or parsed is reported (path and reason) and skipped; the others still load.
``FolderWatcher`` notices changes by polling file names, sizes and modification times.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mapper.errors import InvalidValueError
from mapper.model import DeviceConfig, DeviceModelConfig, DeviceProperty, ModelProperty, PushMqtt, Scalar

PROTOCOL = "gpu"


@dataclass
class FolderContents:
    devices: list[DeviceConfig] = field(default_factory=list)
    models: list[DeviceModelConfig] = field(default_factory=list)
    #: (file, reason) for every document that was skipped.
    errors: list[tuple[str, str]] = field(default_factory=list)


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


def _int(value: Any, where: str) -> int:
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise InvalidValueError(f"{where}: expected milliseconds as a number, got {value!r}", reason="wrong-type")
    try:
        number = int(float(value))
    except ValueError:
        raise InvalidValueError(
            f"{where}: expected milliseconds as a number, got {value!r}", reason="wrong-type"
        ) from None
    if number < 0:
        raise InvalidValueError(f"{where}: must not be negative", reason="negative")
    return number


def model_from_doc(doc: Mapping[str, Any]) -> DeviceModelConfig:
    meta = doc.get("metadata") or {}
    spec = doc.get("spec") or {}
    props = []
    for i, p in enumerate(spec.get("properties") or []):
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
    meta = doc.get("metadata") or {}
    spec = doc.get("spec") or {}
    name = str(meta.get("name", ""))
    namespace = str(meta.get("namespace", "default"))
    where = f"Device {namespace}/{name}"
    model_spec = (model_doc or {}).get("spec") or {}
    protocol = spec.get("protocol") or {}
    config = _flat(model_spec.get("protocolConfigData"), f"{where}: model protocolConfigData")
    config.update(_flat(protocol.get("configData"), f"{where}: spec.protocol.configData"))
    model_visitors = {
        str(p.get("name")): _flat((p.get("visitors") or {}).get("configData"), f"{where}: model visitors")
        for p in (model_spec.get("properties") or [])
        if isinstance(p, Mapping)
    }
    props = []
    for i, p in enumerate(spec.get("properties") or []):
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
            desired_meta = {str(k): str(v) for k, v in (desired.get("metadata") or {}).items()}
        visitor = dict(model_visitors.get(pname, {}))
        visitor.update(_flat((p.get("visitors") or {}).get("configData"), f"{pw}.visitors.configData"))
        mqtt = ((p.get("pushMethod") or {}).get("mqtt")) or None
        push = None
        if mqtt:
            push = PushMqtt(
                address=str(mqtt.get("address", "")),
                topic=str(mqtt.get("topic", "")),
                qos=_int(mqtt.get("qos", 1), f"{pw}.pushMethod.mqtt.qos"),
                retained=bool(mqtt.get("retained", False)),
            )
        props.append(
            DeviceProperty(
                name=pname,
                desired=desired_value,
                desired_metadata=desired_meta,
                collect_cycle_ms=_int(p.get("collectCycle"), f"{pw}.collectCycle"),
                report_cycle_ms=_int(p.get("reportCycle"), f"{pw}.reportCycle"),
                report_to_cloud=bool(p.get("reportToCloud", True)),
                push_mqtt=push,
                visitor_config=visitor,
            )
        )
    state_report = spec.get("stateReport") or (doc.get("status") or {})
    uuid = config.get("uuid", "")
    if not isinstance(uuid, str):
        raise InvalidValueError(f"{where}: configData.uuid must be a string, got {uuid!r}", reason="wrong-type")
    return DeviceConfig(
        namespace=namespace,
        name=name,
        model=str((spec.get("deviceModelRef") or {}).get("name", "")),
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
    for file in sorted(Path(path).glob("*.y*ml")):
        try:
            docs = list(yaml.safe_load_all(file.read_text()))
        except (OSError, yaml.YAMLError) as exc:
            out.errors.append((str(file), f"cannot read or parse: {exc}"))
            continue
        for doc in docs:
            if not isinstance(doc, Mapping):
                continue
            kind = doc.get("kind")
            if kind == "DeviceModel":
                if (doc.get("spec") or {}).get("protocol", PROTOCOL) != PROTOCOL:
                    continue
                meta = doc.get("metadata") or {}
                model_docs[f"{meta.get('namespace', 'default')}/{meta.get('name', '')}"] = doc
                try:
                    out.models.append(model_from_doc(doc))
                except InvalidValueError as exc:
                    out.errors.append((str(file), str(exc)))
            elif kind == "Device":
                spec = doc.get("spec") or {}
                if (spec.get("protocol") or {}).get("protocolName") != PROTOCOL:
                    continue
                if node_name and spec.get("nodeName") not in (None, "", node_name):
                    continue
                device_docs.append((str(file), doc))
    for file_name, doc in device_docs:
        meta = doc.get("metadata") or {}
        model_ref = ((doc.get("spec") or {}).get("deviceModelRef") or {}).get("name", "")
        model_key = f"{meta.get('namespace', 'default')}/{model_ref}"
        try:
            out.devices.append(device_from_doc(doc, model_docs.get(model_key)))
        except InvalidValueError as exc:
            out.errors.append((file_name, str(exc)))
    return out


class FolderWatcher:
    """Tells whether the YAML files of a folder changed since the last look (names, sizes, mtimes)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._last = ""

    def fingerprint(self) -> str:
        h = hashlib.sha1()
        for file in sorted(self.path.glob("*.y*ml")):
            try:
                st = file.stat()
            except OSError:
                continue
            h.update(f"{file.name}:{st.st_size}:{st.st_mtime_ns};".encode())
        return h.hexdigest()

    def changed(self) -> bool:
        current = self.fingerprint()
        if current != self._last:
            self._last = current
            return True
        return False
