"""The whole mapper against a test EdgeCore over real Unix sockets (DMI v1beta1), on simulated GPUs."""

from __future__ import annotations

import os

import pytest

from mapper.edge.gpu.simnvml import SimNvml
from mapper.edge.kubeedge.dmi.pb import dmi_pb2 as pb
from tests.apphelpers import fast_settings, running_app, wait_for
from tests.fake_edgecore import FakeEdgeCore, pb_device, pb_model

PROPS = {"temperature": None, "power_usage": None, "power_limit": "300", "desired_status": None}


def twins_of(request) -> dict[str, tuple[str, str]]:
    return {t.propertyName: (t.observedDesired.value, t.reported.value) for t in request.reportedDevice.twins}


def power_limit_w(sim: SimNvml, uuid: str) -> float:
    return sim.gpu(uuid).power_limit_w


@pytest.mark.timeout(60)
async def test_edgecore_drives_the_mapper_register_report_update_and_restart(sock_dir, tmp_path):
    sim = SimNvml(2, "H100", seed=0, scenario="steady")
    uuid0 = sim.gpus[0].uuid
    edge = FakeEdgeCore(f"{sock_dir}/dmi.sock")
    missing = "GPU-deadbeef-0000-4000-8000-000000000000"
    edge.devices = [
        pb_device("gpu0", uuid0, properties=PROPS, cycle_ms=200),
        pb_device("gone", missing, properties={"temperature": None}, cycle_ms=200),
    ]
    edge.models = [
        pb_model(
            props={"temperature": "INT", "power_usage": "FLOAT", "power_limit": "FLOAT", "desired_status": "STRING"}
        )
    ]
    await edge.start()
    settings = fast_settings(str(tmp_path), edgecore_socket=edge.socket_path, socket=f"{sock_dir}/gpu.sock")
    async with running_app(settings, sim) as app:
        # Registration: withData, protocol gpu, our raw socket path as bytes.
        await wait_for(lambda: edge.rec.registers, what="MapperRegister")
        reg = edge.rec.registers[0]
        assert reg.withData is True
        assert reg.mapper.protocol == "gpu"
        assert reg.mapper.address == f"{sock_dir}/gpu.sock".encode()
        assert oct(os.stat(f"{sock_dir}/gpu.sock").st_mode & 0o777) == "0o660"

        # The desired power limit from the register reply reaches the GPU and comes back as reported.
        await wait_for(lambda: power_limit_w(sim, uuid0) == 300, what="power limit 300 W on the GPU")

        def reported(prop: str, value: str) -> bool:
            return any(twins_of(r).get(prop, ("", ""))[1] == value for r in edge.rec.statuses)

        await wait_for(lambda: reported("power_limit", "300"), what="power_limit reported 300")

        def full_report_with_300() -> object:
            # A periodic report carries every twin (a prompt one only the affected: power_limit and the status)
            for r in reversed(edge.rec.statuses):
                if "temperature" in twins_of(r) and twins_of(r).get("power_limit", ("", ""))[1] == "300":
                    return r
            return None

        last = await wait_for(full_report_with_300, what="a periodic report with power_limit 300")
        assert last.deviceNamespace == "default" and last.deviceName == "gpu0"
        for twin in last.reportedDevice.twins:
            assert twin.HasField("observedDesired") and twin.HasField("reported"), twin.propertyName
        twins = twins_of(last)
        assert twins["power_limit"][0] == "300", "observedDesired carries what was received"
        assert twins["temperature"][0] == "" and twins["temperature"][1].isdigit()
        assert "power_limit:applied" in twins["desired_status"][1]
        assert edge.rec.violations == [] and edge.rec.twin_rejections == []
        await wait_for(lambda: any(s.state == "online" for s in edge.rec.states), what="state online")
        # A Device whose GPU is not on this node is reported offline; the others carry on.
        await wait_for(
            lambda: any(s.deviceName == "gone" and s.state == "offline" for s in edge.rec.states),
            what="the device with a missing GPU reported offline",
        )
        assert not any(s.deviceName == "gone" and s.state == "online" for s in edge.rec.states)

        # UpdateDevice with a new desired value: applied and reported.
        props = dict(PROPS, power_limit="250")
        async with edge.mapper(reg.mapper.address) as stub:
            await stub.UpdateDevice(
                pb.UpdateDeviceRequest(device=pb_device("gpu0", uuid0, properties=props, cycle_ms=200)), timeout=10
            )
        await wait_for(lambda: power_limit_w(sim, uuid0) == 250, what="power limit 250 W")
        await wait_for(lambda: reported("power_limit", "250"), what="power_limit reported 250")

        # A spurious UpdateDevice (same spec, as EdgeCore <= 1.22 sends on every status change) touches nothing.
        sets_before = sim.calls["nvmlDeviceSetPowerManagementLimit"]
        worker = app.workers[uuid0]
        bound = worker.device
        async with edge.mapper(reg.mapper.address) as stub:
            for _ in range(3):
                await stub.UpdateDevice(
                    pb.UpdateDeviceRequest(device=pb_device("gpu0", uuid0, properties=props, cycle_ms=200)), timeout=10
                )
        assert worker.device is bound
        assert sim.calls["nvmlDeviceSetPowerManagementLimit"] == sets_before

        # A device whose GPU is not on this node is refused with FAILED_PRECONDITION; nothing else disturbed.
        import grpc

        async with edge.mapper(reg.mapper.address) as stub:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.RegisterDevice(
                    pb.RegisterDeviceRequest(device=pb_device("ghost", "GPU-00000000-0000-0000-0000-000000000000")),
                    timeout=10,
                )
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "not on this node" in err.value.details()
        assert [d.key for d in app.registry.devices()] == ["default/gpu0"]

        # The Device is pointed at the other GPU: the first returns to its default, the second gets the cap.
        uuid1 = sim.gpus[1].uuid
        async with edge.mapper(reg.mapper.address) as stub:
            await stub.UpdateDevice(
                pb.UpdateDeviceRequest(device=pb_device("gpu0", uuid1, properties=props, cycle_ms=200)), timeout=10
            )
        await wait_for(lambda: power_limit_w(sim, uuid1) == 250, what="250 W on the GPU the Device now names")
        await wait_for(lambda: power_limit_w(sim, uuid0) == 700, what="the first GPU back at its default 700 W")
        assert app.workers[uuid0].device is None and app.workers[uuid1].device is not None

        # EdgeCore restarts (new socket inode): the mapper registers again within 5 s and keeps reporting.
        registers = len(edge.rec.registers)
        await edge.restart()
        await wait_for(lambda: len(edge.rec.registers) > registers, timeout_s=5.0, what="re-registration")
        statuses = len(edge.rec.statuses)
        await wait_for(lambda: len(edge.rec.statuses) > statuses, what="reports after the restart")
        assert not [r for r in edge.rec.refused if r[1] == "rate"], "the mapper stayed inside EdgeCore's limit"
    await edge.stop()


@pytest.mark.timeout(60)
async def test_without_edgecore_the_mapper_keeps_collecting_and_enforces_the_persisted_desired_state(
    sock_dir,
    tmp_path,
):
    sim = SimNvml(1, "A100", seed=3, scenario="steady")
    uuid0 = sim.gpus[0].uuid
    edge = FakeEdgeCore(f"{sock_dir}/dmi.sock")
    edge.devices = [pb_device("gpu0", uuid0, properties={"temperature": None, "power_limit": "333"}, cycle_ms=200)]
    edge.models = [pb_model()]
    await edge.start()
    settings = fast_settings(str(tmp_path), edgecore_socket=edge.socket_path, socket=f"{sock_dir}/gpu.sock")
    async with running_app(settings, sim):
        await wait_for(lambda: sim.gpu(uuid0).power_limit_w == 333, what="333 W applied")
    await edge.stop()

    # A reboot wipes the setting; the mapper comes back with no EdgeCore at all and enforces the stored value.
    sim.driver_reload()
    assert sim.gpu(uuid0).power_limit_w != 333
    async with running_app(settings, sim) as app:
        await wait_for(lambda: sim.gpu(uuid0).power_limit_w == 333, what="333 W re-applied from the store")
        assert app.dmi_client is not None and not app.dmi_client.registered
        await wait_for(lambda: app.workers[uuid0].values.get("temperature") is not None, what="samples")


@pytest.mark.timeout(90)
async def test_a_device_edgecore_sends_that_does_not_convert_or_validate_changes_no_gpu(sock_dir, tmp_path):
    """Bad input from EdgeCore never changes a GPU: an UpdateDevice that does not validate and a registration
    reply whose Device does not convert leave the Device (and its power cap) as it was; the refusal is in the
    Device's desired_status twin and /status; the next valid version applies."""
    import grpc

    sim = SimNvml(1, "H100", seed=0, scenario="steady")
    uuid0 = sim.gpus[0].uuid
    edge = FakeEdgeCore(f"{sock_dir}/dmi.sock")
    edge.devices = [pb_device("gpu0", uuid0, properties=PROPS, cycle_ms=200)]
    await edge.start()
    settings = fast_settings(str(tmp_path), edgecore_socket=edge.socket_path, socket=f"{sock_dir}/gpu.sock")
    async with running_app(settings, sim) as app:
        await wait_for(lambda: edge.rec.registers, what="MapperRegister")
        address = edge.rec.registers[0].mapper.address
        await wait_for(lambda: power_limit_w(sim, uuid0) == 300, what="power limit 300 W on the GPU")

        def reported_status() -> str:
            for r in reversed(edge.rec.statuses):
                if "desired_status" in twins_of(r):
                    return twins_of(r)["desired_status"][1]
            return ""

        # An UpdateDevice naming a property the catalog does not have: refused, nothing changes.
        bad = dict(PROPS, power_limit="250", power_limitt="1")
        async with edge.mapper(address) as stub:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.UpdateDevice(
                    pb.UpdateDeviceRequest(device=pb_device("gpu0", uuid0, properties=bad, cycle_ms=200)), timeout=10
                )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        await wait_for(
            lambda: reported_status().endswith("config:refused-unknown-property"),
            what="desired_status reporting the refused version",
        )
        assert power_limit_w(sim, uuid0) == 300
        [problem] = app.registry.config_errors.current
        assert (problem.source, problem.where, problem.devices) == ("dmi", "UpdateDevice", ("default/gpu0",))

        # EdgeCore restarts and its registration reply holds a gpu0 that does not convert: gpu0 stays as it was.
        edge.devices = [pb_device("gpu0", None, properties=dict(PROPS, power_limit="200"), config={"uuid": 5})]
        registers = len(edge.rec.registers)
        await edge.restart()
        await wait_for(lambda: len(edge.rec.registers) > registers, what="re-registration")
        await wait_for(
            lambda: any(p.where == "MapperRegister" for p in app.registry.config_errors.current),
            what="the reply's refusal recorded",
        )
        rounds = app.status.collect_duration.count
        await wait_for(lambda: app.status.collect_duration.count >= rounds + 20, timeout_s=90, what="20 rounds")
        assert power_limit_w(sim, uuid0) == 300, "a Device that did not convert changed the GPU"
        assert [d.key for d in app.registry.devices()] == ["default/gpu0"]
        assert app.workers[uuid0].desired_status == "power_limit:applied,config:refused-invalid"

        # The next valid version applies, and the refusals go.
        edge.devices = [pb_device("gpu0", uuid0, properties=dict(PROPS, power_limit="250"), cycle_ms=200)]
        registers = len(edge.rec.registers)
        await edge.restart()
        await wait_for(lambda: len(edge.rec.registers) > registers, what="re-registration")
        await wait_for(lambda: power_limit_w(sim, uuid0) == 250, what="250 W from the valid version")
        await wait_for(lambda: "config:" not in app.workers[uuid0].desired_status, what="the refusal cleared")
        assert app.registry.config_errors.current == ()
        assert app.status.snapshot().config_errors == {"dmi": 2}
    await edge.stop()


@pytest.mark.timeout(90)
async def test_a_device_deleted_while_the_mapper_was_down_gives_its_gpu_back_its_default(sock_dir, tmp_path):
    """Found by the lifecycle harness (tests/lifecycle, seed 34): a Device removed while its GPU was absent from
    the mapper (or the mapper down) is missing from the next registration reply, but the cap restored from the
    store stayed enforced on a GPU no Device names. A reply with nothing refused releases it."""
    sim = SimNvml(2, "A100", seed=3, scenario="steady")
    uuid0, uuid1 = sim.gpus[0].uuid, sim.gpus[1].uuid
    default0 = sim.gpu(uuid0).power_limit_w
    edge = FakeEdgeCore(f"{sock_dir}/dmi.sock")
    edge.devices = [
        pb_device("gpu0", uuid0, properties={"temperature": None, "power_limit": "333"}, cycle_ms=200),
        pb_device("gpu1", uuid1, properties={"temperature": None, "power_limit": "250"}, cycle_ms=200),
    ]
    edge.models = [pb_model()]
    await edge.start()
    try:
        settings = fast_settings(str(tmp_path), edgecore_socket=edge.socket_path, socket=f"{sock_dir}/gpu.sock")
        async with running_app(settings, sim):
            await wait_for(
                lambda: (sim.gpu(uuid0).power_limit_w, sim.gpu(uuid1).power_limit_w) == (333, 250),
                what="both caps applied",
            )
        edge.devices = edge.devices[1:]  # gpu0 deleted in the cloud while the mapper was down
        async with running_app(settings, sim) as app:
            await wait_for(lambda: app.dmi_client is not None and app.dmi_client.registered, what="registered")
            await wait_for(lambda: sim.gpu(uuid0).power_limit_w == default0, what="gpu0's default restored")
            rounds = app.status.collect_duration.count
            await wait_for(lambda: app.status.collect_duration.count >= rounds + 5, what="5 collect rounds")
            assert sim.gpu(uuid1).power_limit_w == 250, "the Device still listed keeps its cap"
    finally:
        await edge.stop()
