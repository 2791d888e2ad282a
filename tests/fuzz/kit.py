"""Shared pieces of the bad-input suite: hypothesis strategies for every door, the case counter the suite
prints, and ``Rig``, the desired-state path of one node (registry -> desired state -> SQLite store ->
reconciler -> simulated NVML) with the check that nothing invalid changed a GPU setting.

Each door has a list of *clear* errors: the exception types it raises on purpose for bad input, each with a
message that names what was wrong. Anything else that comes out of a door is a crash (the suite fails)."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from mapper.clock import FakeClock
from mapper.edge.control.desired import DesiredState
from mapper.edge.control.reconcile import Reconciler
from mapper.edge.gpu.nvml import NvmlBackend
from mapper.edge.gpu.simnvml import SimNvml
from mapper.edge.kubeedge.registry import DeviceChange, Registry
from mapper.edge.storage.store import DesiredStore
from mapper.errors import MapperError
from mapper.shared.model import NVML_PROPERTIES, PROPERTIES, DeviceConfig, Sample

#: Cases tried by the whole suite (every hypothesis example, every payload sent over a real socket), by door;
#: printed at the end of the pytest run (tests/conftest.py).
CASES: dict[str, int] = {}

#: Every example a CI run tries, per test, unless the test says otherwise; derandomized: the same cases each run.
FUZZ = settings(
    max_examples=600,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


def fuzz(max_examples: int) -> settings:
    """The suite's settings with this many examples (scaled by ``GPU_MAPPER_FUZZ_SCALE`` for long runs)."""
    scale = float(os.environ.get("GPU_MAPPER_FUZZ_SCALE", "1"))
    return settings(FUZZ, max_examples=max(1, int(max_examples * scale)))


def count(door: str, n: int = 1) -> None:
    CASES[door] = CASES.get(door, 0) + n


def check_clear(exc: BaseException, allowed: tuple[type[BaseException], ...], door: str) -> None:
    """``exc`` must be one of the door's clear errors, with a message that says something, and never echoes a
    huge input back into the log."""
    if not isinstance(exc, allowed):
        raise AssertionError(f"{door}: crashed with {type(exc).__name__}: {exc!r}"[:2000]) from exc
    text = str(exc)
    assert text.strip(), f"{door}: {type(exc).__name__} without a message"
    assert len(text) <= 4000, f"{door}: an error message of {len(text)} characters: {text[:200]}..."


# --- strategies ---------------------------------------------------------------------------------------------

CATALOG = [p.name for p in PROPERTIES]
WRITABLE = [p.name for p in PROPERTIES if p.writable]

#: Texts a desired value may be: numbers in every spelling, words, whitespace, huge and odd strings.
desired_texts = st.one_of(
    st.sampled_from(
        [
            "300",
            "250.5",
            " 300 ",
            "300W",
            "-1",
            "0",
            "1e400",
            "-1e400",
            "nan",
            "NaN",
            "inf",
            "-inf",
            "1e-400",
            "0x12c",
            "true",
            "false",
            "TRUE",
            "1",
            "yes",
            "on",
            "Default",
            "exclusive_process",
            "EXCLUSIVE-PROCESS",
            "prohibited",
            "",
            " ",
            "\t",
            "\u0000",
            "\uff13\uff10\uff10",
            "9" * 5000,
            "1" * 400 + ".5",
            "300,5",
            "3e2",
            "2147483648",
            "-2147483649",
            "18446744073709551616",
            "1410",
            "1980",
            "877",
            "1593",
        ]
    ),
    st.integers().map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(max_size=40),
    # Huge strings, built by repetition (drawing 20,000 characters one by one costs hypothesis ~20 ms a case).
    st.tuples(st.text(min_size=1, max_size=8), st.integers(100, 3000)).map(lambda t: t[0] * t[1]),
)

property_names = st.one_of(st.sampled_from(CATALOG), st.sampled_from(WRITABLE), st.text(max_size=30))

int64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
uint64 = st.integers(min_value=0, max_value=2**64 - 1)


@functools.cache
def any_values() -> st.SearchStrategy[Any]:
    """A ``google.protobuf.Any`` of every kind: each scalar wrapper at its edges, nested messages, unknown type
    URLs and payloads that do not decode."""
    from google.protobuf import any_pb2, struct_pb2, wrappers_pb2

    def packed(msg: Any) -> Any:
        a = any_pb2.Any()
        a.Pack(msg)
        return a

    def raw(type_url: str, payload: bytes) -> Any:
        return any_pb2.Any(type_url=type_url, value=payload)

    return st.one_of(
        st.text(max_size=60).map(lambda v: packed(wrappers_pb2.StringValue(value=v))),
        st.tuples(st.text(min_size=1, max_size=8), st.integers(600, 3000)).map(
            lambda t: packed(wrappers_pb2.StringValue(value=t[0] * t[1]))
        ),
        st.booleans().map(lambda v: packed(wrappers_pb2.BoolValue(value=v))),
        st.floats(width=32).map(lambda v: packed(wrappers_pb2.FloatValue(value=v))),
        st.floats().map(lambda v: packed(wrappers_pb2.DoubleValue(value=v))),
        st.integers(-(2**31), 2**31 - 1).map(lambda v: packed(wrappers_pb2.Int32Value(value=v))),
        int64.map(lambda v: packed(wrappers_pb2.Int64Value(value=v))),
        st.integers(0, 2**32 - 1).map(lambda v: packed(wrappers_pb2.UInt32Value(value=v))),
        uint64.map(lambda v: packed(wrappers_pb2.UInt64Value(value=v))),
        st.binary(max_size=40).map(lambda v: packed(wrappers_pb2.BytesValue(value=v))),
        st.just(packed(struct_pb2.Struct())),
        st.just(packed(struct_pb2.ListValue())),
        st.tuples(
            st.sampled_from(
                [
                    "type.googleapis.com/google.protobuf.StringValue",
                    "type.googleapis.com/google.protobuf.FloatValue",
                    "type.googleapis.com/google.protobuf.Int64Value",
                    "type.googleapis.com/google.protobuf.BoolValue",
                    "",
                    "nonsense",
                    "type.googleapis.com/",
                    "x/" * 50,
                ]
            ),
            st.binary(max_size=30),
        ).map(lambda t: raw(*t)),
    )


@st.composite
def pb_devices(draw: Callable[..., Any], uuids: list[str]) -> Any:
    """A DMI ``Device`` with anything in it: names, configData of every Any type, known and unknown
    properties, desired values of every shape, cycles at the int64 edges, push methods."""
    from mapper.edge.kubeedge.dmi.pb import dmi_pb2 as pb

    uuid_any = draw(
        st.one_of(
            st.sampled_from(uuids).map(lambda u: ("s", u)),
            st.text(max_size=40).map(lambda u: ("s", u)),
            st.sampled_from(uuids).map(lambda u: ("s", f"  {u.lower()} ")),
            any_values().map(lambda a: ("a", a)),
            st.none(),
        )
    )
    from google.protobuf import any_pb2, wrappers_pb2

    config = pb.ProtocolConfig(protocolName=draw(st.sampled_from(["gpu", "", "modbus"])))
    if uuid_any is not None:
        kind, value = uuid_any
        if kind == "s":
            a = any_pb2.Any()
            a.Pack(wrappers_pb2.StringValue(value=value))
            config.configData.data["uuid"].CopyFrom(a)
        else:
            config.configData.data["uuid"].CopyFrom(value)
    for key in draw(st.lists(st.sampled_from(["policy", "x", "", "a" * 300, "ünï"]), max_size=3)):
        config.configData.data[key].CopyFrom(draw(any_values()))
    props = []
    for _ in range(draw(st.integers(0, 6))):
        prop = pb.DeviceProperty(
            name=draw(property_names),
            collectCycle=draw(st.one_of(st.integers(-5, 100_000), int64)),
            reportCycle=draw(st.one_of(st.integers(-5, 100_000), int64)),
            reportToCloud=draw(st.booleans()),
        )
        if draw(st.booleans()):
            prop.desired.CopyFrom(pb.TwinProperty(value=draw(desired_texts)))
            for k, v in draw(st.dictionaries(st.text(max_size=10), st.text(max_size=10), max_size=2)).items():
                prop.desired.metadata[k] = v
        if draw(st.integers(0, 4)) == 0:
            prop.visitors.configData.data[draw(st.text(max_size=10))].CopyFrom(draw(any_values()))
        if draw(st.integers(0, 4)) == 0:
            prop.pushMethod.mqtt.address = draw(st.text(max_size=40))
            prop.pushMethod.mqtt.topic = draw(st.text(max_size=40))
            prop.pushMethod.mqtt.qos = draw(st.integers(-(2**31), 2**31 - 1))
        props.append(prop)
    return pb.Device(
        name=draw(st.one_of(st.sampled_from(["gpu0", "gpu1"]), st.text(max_size=300))),
        namespace=draw(st.sampled_from(["", "default", "other", "UPPER", "a/b"])),
        spec=pb.DeviceSpec(
            deviceModelReference=draw(st.sampled_from(["nvidia-gpu", "", "other"])), protocol=config, properties=props
        ),
        status=pb.DeviceStatus(reportToCloud=draw(st.booleans()), reportCycle=draw(int64)),
    )


@st.composite
def pb_models(draw: Callable[..., Any]) -> Any:
    from mapper.edge.kubeedge.dmi.pb import dmi_pb2 as pb

    props = [
        pb.ModelProperty(
            name=draw(property_names),
            type=draw(st.sampled_from(["INT", "FLOAT", "DOUBLE", "STRING", "BOOLEAN", "", "int", "BYTES", "x"])),
            accessMode=draw(st.sampled_from(["ReadWrite", "ReadOnly", "", "WriteOnly"])),
            minimum=draw(st.text(max_size=8)),
            maximum=draw(st.text(max_size=8)),
            unit=draw(st.text(max_size=8)),
        )
        for _ in range(draw(st.integers(0, 5)))
    ]
    return pb.DeviceModel(
        name=draw(st.one_of(st.just("nvidia-gpu"), st.text(max_size=40))),
        namespace=draw(st.sampled_from(["", "default", "x"])),
        spec=pb.DeviceModelSpec(properties=props),
    )


#: JSON values of any shape, some deeply nested.
json_values = st.recursive(
    st.one_of(
        st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20)
    ),
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=20,
)


def nested(depth: int, opener: bytes = b"[", closer: bytes = b"]") -> bytes:
    return opener * depth + closer * depth


# --- the desired-state path of one node ---------------------------------------------------------------------

#: GPU settings a desired value can change, by the properties that target them.
SETTINGS: dict[str, tuple[str, ...]] = {
    "power_limit_mw": ("power_limit",),
    "locked_gpu_clocks": ("locked_gpu_clock_min", "locked_gpu_clock_max"),
    "locked_memory_clocks": ("locked_memory_clock_min", "locked_memory_clock_max"),
    "persistence_mode": ("persistence_mode",),
    "compute_mode": ("compute_mode",),
}


@dataclass
class Rig:
    """Registry -> DesiredState -> DesiredStore (a real SQLite file) -> Reconciler -> simulated NVML, wired the
    way the mapper wires them (``MapperApp._on_device_change``, ``_on_delta``), on fake time, no threads."""

    tmp: Path
    n_gpus: int = 2
    sim: SimNvml = field(init=False)
    clock: FakeClock = field(default_factory=FakeClock)

    def __post_init__(self) -> None:
        self.sim = SimNvml(self.n_gpus, "H100", seed=3, scenario="steady", clock=self.clock.monotonic)
        self.backend = NvmlBackend(self.sim)
        self.backend.init()
        self.uuids = [g.uuid for g in self.sim.gpus]
        self.registry = Registry(node_gpus=lambda: self.uuids)
        self.registry.subscribe(self._on_change)
        self.desired = {u: DesiredState() for u in self.uuids}
        self.bound: dict[str, DeviceConfig | None] = dict.fromkeys(self.uuids)
        self.reconcilers = {u: Reconciler(self.backend, u, clock=self.clock) for u in self.uuids}
        self.store = DesiredStore(self.tmp / "desired.db", now_ms=self.clock.wall_ms)
        #: Properties that ever had a valid desired value, per GPU (only those may change a setting, or restore it).
        self.ever_valid: dict[str, set[str]] = {u: set() for u in self.uuids}
        #: The settings after the last ``settle`` (anything that changed them since is checked by the next one).
        self._last_settings = self.gpu_settings()

    def close(self) -> None:
        self.store.close()
        self.backend.shutdown()

    def _on_change(self, change: DeviceChange) -> None:
        device = change.device
        if change.kind == "updated" and change.previous is not None and change.previous.uuid != device.uuid:
            self._on_change(DeviceChange("removed", change.previous, change.previous))
        uuid = device.uuid
        if uuid not in self.desired:
            return
        now_ms = self.clock.wall_ms()
        if change.kind == "removed":
            self.desired[uuid].sync_source("cloud", {}, now_ms)
            self.bound[uuid] = None
        else:
            wanted = {p.name: p.desired for p in device.properties if p.desired is not None}
            self.desired[uuid].sync_source("cloud", wanted, now_ms)
            self.bound[uuid] = device
        self.store.save(device.key, self.desired[uuid], uuid=uuid)

    def set_edge(self, namespace: str, name: str, values: dict[str, str], version_ms: int) -> None:
        """An EventBus delta, as ``MapperApp._on_delta`` takes it (after ``parse_delta``)."""
        device = self.registry.get_device(namespace, name)
        state = self.desired[device.uuid]
        for prop, raw in values.items():
            state.set(prop, raw, "edge", version_ms or self.clock.wall_ms())
        self.store.save(device.key, state, uuid=device.uuid)

    def gpu_settings(self) -> dict[str, dict[str, Any]]:
        return {g.uuid: {s: getattr(g, s) for s in SETTINGS} for g in self.sim.gpus}

    def settle(self) -> None:
        """One reconcile step per GPU (as the collector runs it), then the check: a GPU setting that changed is
        one a *valid* desired value asks for now or asked for before (its removal restores the default)."""
        before = self._last_settings
        self.clock.advance(2.0)
        for uuid in self.uuids:
            state = self.desired[uuid]
            effective = state.effective()
            sample = self.backend.sample(uuid, tuple(p.name for p in NVML_PROPERTIES))
            rec = self.reconcilers[uuid].step(
                effective, Sample(uuid, sample.ts_ms, dict(sample.values)), restore=state.pending_restore()
            )
            for prop in rec.restored:
                state.mark_restored(prop)
        after = self._last_settings = self.gpu_settings()
        for uuid in self.uuids:
            effective = self.desired[uuid].effective()
            self.ever_valid[uuid] |= {p for p, d in effective.items() if d.valid}
            allowed = self.ever_valid[uuid]
            for setting, props in SETTINGS.items():
                if before[uuid][setting] != after[uuid][setting]:
                    assert set(props) & allowed, (
                        f"GPU {uuid}: {setting} changed {before[uuid][setting]!r} -> {after[uuid][setting]!r} "
                        f"though no valid desired value asks for it: "
                        f"{ {p: (d.raw, d.reason) for p, d in effective.items()} }"
                    )


def finite(x: float) -> bool:
    return math.isfinite(x)


__all__ = ["CASES", "FUZZ", "MapperError", "Rig", "check_clear", "count"]
