"""Bad input over the real doors: DMI calls over gRPC on a Unix socket to a running mapper, and EventBus
payloads through a real mosquitto to it. A smaller share of the suite's cases (the parsing layers take most of
them in ``test_doors.py``); here every refusal must come back as the door's clear answer (a gRPC status that
says what was wrong, never INTERNAL or UNKNOWN; a warning line for a bus message), the mapper must keep
running, and since every case is invalid no GPU setter may be called at all."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from mapper.edge.gpu.simnvml import SimNvml
from mapper.edge.kubeedge.dmi.pb import dmi_pb2 as pb
from tests.apphelpers import fast_settings, running_app, wait_for
from tests.fake_edgecore import FakeEdgeCore, pb_device, pb_model
from tests.fuzz.kit import FUZZ, any_values, count, json_values, nested, pb_devices, pb_models, property_names
from tests.test_app_eventbus import Listener, standalone

#: Desired values that no GPU may take: refused by parsing, or by the GPU's limits in the reconciler.
INVALID_DESIRED = [
    "nan",
    "inf",
    "-inf",
    "-1",
    "-300",
    "1e400",
    "300W",
    "abc",
    "9" * 5000,
    "yes please",
    "\u0000",
    "\uff13\uff10\uff10",
    "0x12c",
    "1,5",
    "99999999999",
    "-0.5",
    "true false",
    "exclusive",
    "1e309",
]
SETTERS = (
    "nvmlDeviceSetPowerManagementLimit",
    "nvmlDeviceSetGpuLockedClocks",
    "nvmlDeviceResetGpuLockedClocks",
    "nvmlDeviceSetMemoryLockedClocks",
    "nvmlDeviceResetMemoryLockedClocks",
    "nvmlDeviceSetPersistenceMode",
    "nvmlDeviceSetComputeMode",
)
CLEAR_CODES = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.NOT_FOUND,
}


def generate(strategy: st.SearchStrategy[Any], n: int) -> list[Any]:
    """``n`` examples of ``strategy``, seeded (hypothesis as a generator: the sending is done by the caller)."""
    out: list[Any] = []

    @settings(FUZZ, max_examples=n, phases=[Phase.generate])
    @given(strategy)
    def collect(x: Any) -> None:
        out.append(x)

    collect()
    return out


def setter_calls(sim: SimNvml) -> dict[str, int]:
    return {name: sim.calls[name] for name in SETTERS if sim.calls[name]}


def _invalidate(device: Any) -> Any:
    """The device with every desired value replaced by one no GPU may take."""
    for i, prop in enumerate(device.spec.properties):
        if prop.HasField("desired"):
            prop.desired.value = INVALID_DESIRED[(i + len(prop.name)) % len(INVALID_DESIRED)]
    return device


@pytest.mark.timeout(120)
async def test_bad_dmi_calls_over_grpc_are_refused_with_a_clear_status_and_set_nothing(sock_dir, tmp_path: Path):
    sim = SimNvml(2, "H100", seed=3, scenario="steady")
    uuids = [g.uuid for g in sim.gpus]
    edge = FakeEdgeCore(f"{sock_dir}/dmi.sock")
    edge.devices = [pb_device("gpu0", uuids[0], properties={"temperature": None, "power_limit": None})]
    edge.models = [pb_model()]
    await edge.start()
    devices = [_invalidate(d) for d in generate(pb_devices(uuids), 250)]
    models = generate(pb_models(), 60)
    blobs = generate(st.one_of(st.binary(max_size=200), any_values().map(lambda a: a.SerializeToString())), 80)
    settings_ = fast_settings(str(tmp_path), edgecore_socket=edge.socket_path, socket=f"{sock_dir}/gpu.sock")
    try:
        async with running_app(settings_, sim) as app:
            await wait_for(lambda: app.dmi_client is not None and app.dmi_client.registered, what="registered")
            codes: dict[str, int] = {}

            async def call(method: Any, request: Any) -> None:
                try:
                    await method(request, timeout=10)
                    code = grpc.StatusCode.OK
                except grpc.aio.AioRpcError as exc:
                    code = exc.code()
                    assert code in CLEAR_CODES, f"{code}: {exc.details()}"
                    assert exc.details() and len(exc.details()) < 4000
                codes[code.name] = codes.get(code.name, 0) + 1

            async with edge.mapper(settings_.socket) as stub:
                for i, device in enumerate(devices):
                    method = stub.RegisterDevice if i % 2 else stub.UpdateDevice
                    request = pb.RegisterDeviceRequest if i % 2 else pb.UpdateDeviceRequest
                    await call(method, request(device=device))
                    count("wire: dmi device")
                for model in models:
                    await call(stub.CreateDeviceModel, pb.CreateDeviceModelRequest(model=model))
                    await call(stub.UpdateDeviceModel, pb.UpdateDeviceModelRequest(model=model))
                    count("wire: dmi model", 2)
                for device in devices[:40]:
                    await call(
                        stub.RemoveDevice,
                        pb.RemoveDeviceRequest(deviceName=device.name, deviceNamespace=device.namespace),
                    )
                    await call(stub.GetDevice, pb.GetDeviceRequest(deviceName=device.name))
                    count("wire: dmi remove/get", 2)
            # Bytes that are not a request at all, straight onto the wire.
            async with grpc.aio.insecure_channel(f"unix://{settings_.socket}") as channel:
                raw = channel.unary_unary("/v1beta1.DeviceMapperService/RegisterDevice")
                for blob in blobs:
                    try:
                        await raw(blob, timeout=10)
                    except grpc.aio.AioRpcError as exc:
                        # Bytes that are no request never reach the mapper's code: grpc answers UNKNOWN itself
                        # ("Error parsing message ...: Wire format was corrupt").
                        code = exc.code()
                        assert code in CLEAR_CODES or (
                            code == grpc.StatusCode.UNKNOWN and "parsing message" in (exc.details() or "")
                        ), (code, exc.details())
                    count("wire: dmi raw bytes")
            # The mapper is still up and sampling; nothing invalid reached a GPU.
            stamps = {w.uuid: w.values_ts_ms for w in app.workers.values()}
            await wait_for(
                lambda: all(w.values_ts_ms > stamps[w.uuid] for w in app.workers.values()),
                what="the mapper sampling after the bad calls",
            )
            assert app.exit_code == 0
            assert setter_calls(sim) == {}, setter_calls(sim)
            assert codes.get("INVALID_ARGUMENT", 0) + codes.get("FAILED_PRECONDITION", 0) > 0
    finally:
        await edge.stop()


@pytest.mark.timeout(120)
async def test_bad_eventbus_payloads_through_a_real_broker_change_nothing_and_stop_nothing(mosquitto, tmp_path: Path):
    sim, uuid0, _, settings_ = standalone(tmp_path, mosquitto.url)
    # Parsing is under test here, not the door's rate limit (tests/test_doorlimit.py): every message must reach
    # the parser, and the good delta after 450 bad ones must not find the device's bucket empty.
    settings_ = replace(settings_, inbound_rate_per_s=1e6, inbound_burst=10**6)
    delta_topic = "$hw/events/device/default/gpu0/twin/update/delta"
    docs = generate(
        st.fixed_dictionaries(
            {"timestamp": st.one_of(st.integers(), st.just(2**70), st.floats(), st.text(max_size=4))},
            optional={
                "delta": st.one_of(
                    st.dictionaries(property_names, st.sampled_from(INVALID_DESIRED) | json_values, max_size=3),
                    json_values,
                )
            },
        ),
        150,
    )
    junk = generate(
        st.one_of(
            st.binary(max_size=300),
            json_values.map(lambda v: json.dumps(v).encode()),
            st.integers(1, 200_000).map(nested),
            st.integers(60_000, 100_000).map(lambda n: b"{" + b" " * n + b"}"),
        ),
        150,
    )
    listener = Listener(mosquitto.port)
    try:
        async with running_app(settings_, sim) as app:
            await wait_for(lambda: app.session is not None and app.session.connected, what="MQTT connected")
            await wait_for(lambda: app.workers[uuid0].device is not None, what="the Device bound")
            for doc in docs:
                listener.publish(delta_topic, json.dumps(doc).encode())
                count("wire: eventbus delta")
            for payload in junk:
                listener.publish(delta_topic, payload)
                listener.publish("$hw/events/node/edge-1/membership/updated", payload)
                count("wire: eventbus junk", 2)
            # The broker delivers one publisher's messages on a topic in order: once a good delta is applied,
            # every bad one before it was handled. None of them may have called a setter.
            listener.publish(
                delta_topic,
                json.dumps({"timestamp": int(time.time() * 1000), "delta": {"power_limit": "275"}}).encode(),
            )
            await wait_for(lambda: sim.gpu(uuid0).power_limit_w == 275, timeout_s=30, what="the good delta applied")
            assert setter_calls(sim) == {"nvmlDeviceSetPowerManagementLimit": 1}, setter_calls(sim)
            assert app.exit_code == 0
    finally:
        listener.close()
