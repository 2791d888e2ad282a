"""The topics and the small messages on the wire, byte for byte: what other programs subscribe to and parse.

Edge applications, the bridge and mappers of other versions read these: a change of one byte is a change of
protocol. The expected values are written out here, not computed by the code under test.
"""

from __future__ import annotations

import json

import pytest

from mapper.edge.control.policy import PolicyEvent
from mapper.edge.status.stats import GpuSnapshot
from mapper.shared.model import GpuInfo, Sample
from mapper.wire import topics
from mapper.wire.payloads import STATUS_OFFLINE, STATUS_ONLINE, event_payload, live_payload
from mapper.wire.state import GpuIdentity, GpuStatus, parse_state, state_payload

UUID = "GPU-12345678-1234-1234-1234-123456789abc"
T0 = 1_780_000_000_123


# --------------------------------------------------------------------------------------------------
# Topics
# --------------------------------------------------------------------------------------------------


def test_the_mappers_own_topics_are_spelled_under_gpu_mapper_node_namespace_name() -> None:
    assert topics.telemetry_topic("edge-1", "default/gpu0") == "gpu-mapper/edge-1/default/gpu0/telemetry"
    assert topics.state_topic("edge-1", "default/gpu0") == "gpu-mapper/edge-1/default/gpu0/state"
    assert topics.live_topic("edge-1", "default/gpu0") == "gpu-mapper/edge-1/default/gpu0/live"
    assert topics.ack_topic("edge-1", "default/gpu0") == "gpu-mapper/edge-1/default/gpu0/desired/ack"
    assert topics.events_topic("edge-1", "default/gpu0") == "gpu-mapper/edge-1/default/gpu0/events"
    assert topics.status_topic("edge-1") == "gpu-mapper/edge-1/status"


def test_the_bridge_subscribes_to_every_nodes_telemetry_shared_and_to_the_state_beside_it() -> None:
    assert topics.TELEMETRY_FILTER == "gpu-mapper/+/+/+/telemetry"
    assert topics.shared_subscription("g1", topics.TELEMETRY_FILTER) == "$share/g1/gpu-mapper/+/+/+/telemetry"
    assert topics.state_filter_beside("gpu-mapper/+/+/+/telemetry") == "gpu-mapper/+/+/+/state"
    assert topics.state_filter_beside("site/power") == ""
    assert topics.node_of("gpu-mapper/edge-1/default/gpu0/state") == "edge-1"
    with pytest.raises(ValueError, match="names no node"):
        topics.node_of("a/b/c")


def test_the_kubeedge_eventbus_topics_are_kubeedges() -> None:
    assert topics.twin_update_topic("default", "gpu0") == "$hw/events/device/default/gpu0/twin/update"
    assert topics.state_update_topic("default", "gpu0") == "$hw/events/device/default/gpu0/state/update"
    assert topics.membership_topic("edge-1") == "$hw/events/node/edge-1/membership/updated"
    assert topics.DELTA_FILTER == "$hw/events/device/+/+/twin/update/delta"
    assert topics.TWIN_RESULT_FILTER == "$hw/events/device/+/+/twin/update/result"
    assert topics.device_of_delta_topic("$hw/events/device/ns1/gpu-0/twin/update/delta") == ("ns1", "gpu-0")
    with pytest.raises(ValueError, match="twin/update/delta"):
        topics.device_of_delta_topic("$hw/events/device/ns1/gpu-0/twin/update")


# --------------------------------------------------------------------------------------------------
# The retained state message
# --------------------------------------------------------------------------------------------------


def test_the_state_snapshot_is_one_json_object_of_the_latest_values() -> None:
    doc = json.loads(state_payload("default/gpu0", Sample(UUID, T0, {"temperature": 61})))
    assert doc == {"device": "default/gpu0", "uuid": UUID, "ts_ms": T0, "values": {"temperature": 61}}


def test_a_state_message_of_values_alone_is_these_bytes() -> None:
    payload = state_payload("default/g", Sample("GPU-1", 1000, {"temperature": 61}))
    assert payload == b'{"device":"default/g","uuid":"GPU-1","ts_ms":1000,"values":{"temperature":61}}'


def test_a_state_message_with_the_gpus_status_is_these_bytes() -> None:
    gpu = GpuSnapshot(
        info=GpuInfo(uuid="GPU-1", index=3, name="H100", pci_bus_id="00000000:17:00.0", driver_version=""),
        device="default/g",
        sample=Sample("GPU-1", 1000, {"temperature": 61, "power_usage": 312.5, "product_name": "NVIDIA H100"}),
        state="online",
        xid_errors={79: 2, 13: 1},
        desired_power_limit_w=500.0,
    )
    assert gpu.state_message("default/g", driver_version="550.54.15", at_ms=2000) == (
        b'{"device":"default/g","uuid":"GPU-1","ts_ms":1000,'
        b'"values":{"temperature":61,"power_usage":312.5,"product_name":"NVIDIA H100"},'
        b'"at_ms":2000,"state":"online",'
        b'"gpu":{"index":3,"pci_bus_id":"00000000:17:00.0","driver_version":"550.54.15"},'
        b'"xid_errors":{"13":1,"79":2},"power_limit_desired_w":500.0'
        b',"health":{"levels":{"0":"healthy","1":"healthy","2":"healthy","3":"healthy"},'
        b'"subsystems":{"pcie":"healthy","nvlink":"healthy","memory":"healthy","thermal":"healthy",'
        b'"power":"healthy","driver":"healthy","inforom":"healthy","engine":"healthy","cuda":"healthy"},'
        b'"checks":{},"probes":{}}}'
    )


def test_a_gpu_without_a_sample_or_a_desired_power_limit_still_says_its_status() -> None:
    gpu = GpuSnapshot(info=GpuInfo(uuid="GPU-2", index=0, name="T4", pci_bus_id="p", driver_version="535.1"))
    assert gpu.state_message("default/h", driver_version="550", at_ms=5000) == (
        b'{"device":"default/h","uuid":"GPU-2","ts_ms":0,"values":{},"at_ms":5000,"state":"unknown",'
        b'"gpu":{"index":0,"pci_bus_id":"p","driver_version":"535.1"},"xid_errors":{}'
        b',"health":{"levels":{"0":"healthy","1":"healthy","2":"healthy","3":"healthy"},'
        b'"subsystems":{"pcie":"healthy","nvlink":"healthy","memory":"healthy","thermal":"healthy",'
        b'"power":"healthy","driver":"healthy","inforom":"healthy","engine":"healthy","cuda":"healthy"},'
        b'"checks":{},"probes":{}}}'
    )


def test_the_reader_reads_what_the_writer_writes() -> None:
    status = GpuStatus(at_ms=2000, state="unhealthy", index=1, pci_bus_id="b", driver_version="d", xid_errors={48: 3})
    read = parse_state(state_payload("ns/x", Sample("GPU-9", 1000, {"temperature": 50}), status))
    assert (read.device, read.uuid, read.at_ms, read.state) == ("ns/x", "GPU-9", 2000, "unhealthy")
    assert read.identity == GpuIdentity("1", "b", "d")
    assert read.xid_errors == (("48", 3),) and read.power_limit_desired_w is None and read.has_samples


# --------------------------------------------------------------------------------------------------
# Live samples, policy events, the status topic
# --------------------------------------------------------------------------------------------------


def test_a_live_sample_is_these_bytes() -> None:
    payload = live_payload(Sample("GPU-1", 1000, {"temperature": 61, "clocks_event": True}))
    assert payload == b'{"ts_ms":1000,"uuid":"GPU-1","values":{"temperature":61,"clocks_event":true}}'


def test_a_policy_event_is_these_bytes() -> None:
    event = PolicyEvent(
        policy="thermal",
        action="engage",
        reason="95 C >= 90 C",
        uuid="GPU-1",
        temperature_c=95.0,
        old_cap_w=700.0,
        new_cap_w=600.0,
    )
    payload = event_payload(event.to_payload(), node="edge1", device="default/gpu0", ts_ms=T0)
    assert payload == (
        b'{"policy": "thermal", "action": "engage", "reason": "95 C >= 90 C", "uuid": "GPU-1", "dryRun": false, '
        b'"temperature": 95.0, "oldPowerLimit": 700.0, "newPowerLimit": 600.0, '
        b'"node": "edge1", "device": "default/gpu0", "ts_ms": 1780000000123}'
    )


def test_the_status_topic_says_online_or_offline() -> None:
    assert (STATUS_ONLINE, STATUS_OFFLINE) == (b"online", b"offline")
