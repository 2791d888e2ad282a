"""The HTTP endpoints (/metrics, /healthz, /readyz, /status) over real sockets, the snapshot JSON, and the
``gpu-mapper status`` table."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mapper.bridge.core import BridgeStats
from mapper.bridge.metrics import BridgeMetricsServer
from mapper.edge.status.metrics import MetricsServer, fetch_status, read_status_file, write_status_file
from mapper.edge.status.stats import DurationHistogram, GpuSnapshot, MapperSnapshot, Readiness, SnapshotFormatError
from mapper.edge.status.view import render_status
from mapper.errors import ConfigError, NotFoundError, TransientError
from mapper.net.http import TEXT, Answer, HttpServer, LoopHeartbeat, check_liveness, parse_metrics_addr
from mapper.shared.model import GpuInfo, Sample
from tests.test_metrics import H100, T4, make_snapshot


def get(url: str, timeout_s: float = 5.0) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Content-Type", ""), exc.read().decode()


class Beats:
    """The app's heartbeat table, on a fake monotonic clock."""

    def __init__(self) -> None:
        self.now = 100.0
        self.beats = {"collect": LoopHeartbeat("collect", 100.0, 1.0), "report": LoopHeartbeat("report", 100.0, 10.0)}

    def __call__(self) -> list[LoopHeartbeat]:
        return list(self.beats.values())


@pytest.fixture
def beats() -> Beats:
    return Beats()


@pytest.fixture
def server(beats: Beats) -> Iterator[MetricsServer]:
    ready = {"value": Readiness(nvml_initialised=True, dmi_registered=True)}
    srv = MetricsServer(
        "127.0.0.1:0",
        snapshot=make_snapshot,
        heartbeats=beats,
        readiness=lambda: ready["value"],
        monotonic=lambda: beats.now,
        snapshot_timeout_s=2.0,
    )
    srv.ready = ready  # type: ignore[attr-defined]
    with srv:
        yield srv


# --------------------------------------------------------------------------------------------------
# Endpoints
# --------------------------------------------------------------------------------------------------


def test_the_server_binds_port_zero_and_exposes_the_chosen_port(server: MetricsServer) -> None:
    assert server.port > 0
    assert server.url == f"http://127.0.0.1:{server.port}"


def test_metrics_serves_the_prometheus_text_format(server: MetricsServer) -> None:
    status, ctype, body = get(server.url + "/metrics")
    assert status == 200
    assert ctype.startswith("text/plain")
    assert f'gpu_temperature_celsius{{device="edge1-gpu0",gpu="0",node="edge1",uuid="{H100}"}} 61.0' in body
    assert 'gpu_mapper_buffer_bytes{node="edge1"} 1.5e+06' in body


def test_healthz_is_ok_while_every_loop_beats(server: MetricsServer, beats: Beats) -> None:
    beats.now = 104.0  # 4 s since the last beats: within 10 s (the floor) for both loops
    status, _, body = get(server.url + "/healthz")
    assert status == 200
    assert body.startswith("ok")
    assert "collect: last beat 4.0 s ago" in body


def test_healthz_fails_naming_the_loop_that_stalled(server: MetricsServer, beats: Beats) -> None:
    beats.now = 160.0
    beats.beats["report"] = LoopHeartbeat("report", 159.0, 10.0)
    status, _, body = get(server.url + "/healthz")
    assert status == 503
    assert "stalled loop(s): collect" in body
    assert "report" not in body.splitlines()[0]


def test_readyz_needs_nvml_and_edgecore_registration(server: MetricsServer) -> None:
    ready = server.ready  # type: ignore[attr-defined]
    assert get(server.url + "/readyz")[:1] == (200,)
    ready["value"] = Readiness(nvml_initialised=True, dmi_registered=False)
    status, _, body = get(server.url + "/readyz")
    assert status == 503
    assert "not registered with EdgeCore" in body
    ready["value"] = Readiness(nvml_initialised=False, dmi_registered=True)
    status, _, body = get(server.url + "/readyz")
    assert status == 503
    assert "NVML is not initialised" in body


def test_readyz_accepts_standalone_mode_without_edgecore(server: MetricsServer) -> None:
    server.ready["value"] = Readiness(nvml_initialised=True, dmi_registered=False, standalone=True)  # type: ignore[attr-defined]
    status, _, body = get(server.url + "/readyz")
    assert status == 200
    assert "standalone" in body


def test_status_serves_the_snapshot_as_json_that_reads_back_equal(server: MetricsServer) -> None:
    status, ctype, body = get(server.url + "/status")
    assert status == 200
    assert ctype == "application/json"
    assert MapperSnapshot.from_json(body) == make_snapshot()


def test_status_as_text_is_the_status_table(server: MetricsServer) -> None:
    status, _, body = get(server.url + "/status?format=text")
    assert status == 200
    assert body == render_status(make_snapshot())


def test_an_unknown_path_is_404(server: MetricsServer) -> None:
    status, _, body = get(server.url + "/nope")
    assert status == 404
    assert "/nope" in body


def test_the_root_lists_the_mappers_endpoints(server: MetricsServer) -> None:
    assert get(server.url + "/") == (200, TEXT, "gpu-mapper: /metrics /healthz /readyz /status\n")


class _Echo(HttpServer):
    """The core server with one route of its own, which reads through ``call``."""

    name = "probe"
    paths = ("/healthz", "/echo")

    def route(self, path: str, query: dict[str, list[str]]) -> Answer | None:
        if path == "/echo":
            return 200, TEXT, self.call(lambda: query.get("x", [""])[0]).encode()
        return None


def test_the_core_server_answers_liveness_its_subclasses_routes_and_nothing_else() -> None:
    beat = LoopHeartbeat("loop", 100.0, 1.0)
    with _Echo("127.0.0.1:0", heartbeats=lambda: [beat], monotonic=lambda: 100.5) as srv:
        assert get(srv.url + "/echo?x=hi") == (200, TEXT, "hi")
        assert get(srv.url + "/") == (200, TEXT, "probe: /healthz /echo\n")
        status, _, body = get(srv.url + "/healthz")
        assert status == 200 and body.startswith("ok\nloop: last beat 0.5 s ago")
        assert get(srv.url + "/metrics")[0] == 404
        assert get(srv.url + "/status")[0] == 404


def test_the_bridges_server_serves_its_counters_liveness_and_readiness_and_no_status() -> None:
    stats = BridgeStats(batches_received=3, mqtt_connected=False)
    problems = ["not connected to the broker mqtt://broker:1883"]
    beats = [LoopHeartbeat("write", 50.0, 1.0)]
    with BridgeMetricsServer(
        "127.0.0.1:0", stats=lambda: stats, heartbeats=lambda: beats, problems=lambda: problems, monotonic=lambda: 51.0
    ) as srv:
        status, ctype, body = get(srv.url + "/metrics")
        assert status == 200 and ctype.startswith("text/plain")
        assert "gpu_mapper_bridge_batches_received_total 3.0\n" in body
        assert "gpu_mapper_bridge_mqtt_connected 0.0\n" in body
        assert get(srv.url + "/readyz") == (503, TEXT, "not ready: not connected to the broker mqtt://broker:1883\n")
        problems.clear()
        assert get(srv.url + "/readyz") == (200, TEXT, "ready\n")
        assert get(srv.url + "/healthz")[0] == 200
        assert get(srv.url + "/") == (200, TEXT, "gpu-mapper bridge: /metrics /healthz /readyz\n")
        assert get(srv.url + "/status")[0] == 404


def test_fetch_status_reads_a_running_mapper(server: MetricsServer) -> None:
    assert fetch_status(server.url) == make_snapshot()
    assert fetch_status(server.url + "/status") == make_snapshot()


def test_fetch_status_names_the_url_when_nothing_listens() -> None:
    srv = MetricsServer("127.0.0.1:0", snapshot=make_snapshot)
    srv.start()
    url = srv.url
    srv.stop()
    with pytest.raises(TransientError, match="cannot reach the mapper"):
        fetch_status(url, timeout_s=2)
    with pytest.raises(ConfigError, match="expected http://HOST:PORT"):
        fetch_status("127.0.0.1:9100")


def test_a_snapshot_callable_that_hangs_gives_503_not_a_hung_scrape() -> None:
    release = threading.Event()

    def hang() -> MapperSnapshot:
        release.wait(10)
        return make_snapshot()

    with MetricsServer("127.0.0.1:0", snapshot=hang, snapshot_timeout_s=0.2) as srv:
        started = time.monotonic()
        status, _, body = get(srv.url + "/metrics")
        assert status == 503
        assert "did not answer within 0.2 s" in body
        assert time.monotonic() - started < 3
        status, _, _ = get(srv.url + "/healthz")  # liveness does not depend on the snapshot
        assert status == 200
        release.set()


def test_a_failing_snapshot_gives_500_and_the_server_stays_up() -> None:
    def broken() -> MapperSnapshot:
        raise RuntimeError("boom")

    with MetricsServer("127.0.0.1:0", snapshot=broken) as srv:
        assert get(srv.url + "/status")[0] == 500
        assert get(srv.url + "/healthz")[0] == 200


def test_a_client_that_never_sends_its_request_is_cut_off_by_the_timeout() -> None:
    import socket

    with MetricsServer("127.0.0.1:0", snapshot=make_snapshot, request_timeout_s=0.3) as srv:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as sock:
            sock.sendall(b"GET /metr")  # never finishes the request line
            started = time.monotonic()
            assert sock.recv(100) == b""  # the server closed the connection
            assert time.monotonic() - started < 3
        assert get(srv.url + "/healthz")[0] == 200


async def test_with_an_event_loop_the_callables_run_on_that_loop() -> None:
    loop = asyncio.get_running_loop()
    seen: list[threading.Thread] = []

    def snapshot() -> MapperSnapshot:
        seen.append(threading.current_thread())
        return make_snapshot()

    with MetricsServer("127.0.0.1:0", snapshot=snapshot, loop=loop) as srv:
        status, _, body = await asyncio.to_thread(get, srv.url + "/status")
    assert status == 200
    assert MapperSnapshot.from_json(body) == make_snapshot()
    assert seen == [threading.current_thread()]


async def test_a_blocked_event_loop_fails_healthz() -> None:
    loop = asyncio.get_running_loop()
    with MetricsServer("127.0.0.1:0", snapshot=make_snapshot, loop=loop, snapshot_timeout_s=0.2) as srv:
        result: dict[str, tuple[int, str, str]] = {}
        t = threading.Thread(target=lambda: result.setdefault("r", get(srv.url + "/healthz")))
        t.start()
        # The test holds this event loop blocked until the probe has its answer (no fixed sleep: on a loaded
        # machine the probe's thread may need longer than any guess to send its request). The probe must answer
        # on its own, after ``snapshot_timeout_s``, instead of waiting for the loop.
        t.join(30)  # blocks this event loop on purpose
        assert not t.is_alive(), "/healthz waited for the blocked event loop"
    status, _, body = result["r"]
    assert status == 503
    assert "event loop did not answer" in body


def test_stop_releases_the_port() -> None:
    srv = MetricsServer("127.0.0.1:0", snapshot=make_snapshot)
    srv.start()
    port = srv.port
    srv.stop()
    again = MetricsServer(f"127.0.0.1:{port}", snapshot=make_snapshot)
    again.start()
    try:
        assert get(again.url + "/healthz")[0] == 200
    finally:
        again.stop()


def _context_switches(native_id: int) -> int:
    with open(f"/proc/self/task/{native_id}/status") as fh:
        return sum(int(line.split()[1]) for line in fh if "ctxt_switches" in line)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="per-thread counters need Linux /proc")
def test_an_idle_server_does_not_wake_up_between_scrapes_and_stops_at_once() -> None:
    srv = MetricsServer("127.0.0.1:0", snapshot=make_snapshot)
    srv.start()
    try:
        assert get(srv.url + "/healthz")[0] == 200
        thread = next(t for t in threading.enumerate() if t.name == "metrics-http")
        assert thread.native_id is not None
        # The request's own wake-ups are over once the thread's counter stands still for 0.2 s (a condition with a
        # deadline: a loaded machine may take longer than a fixed pause to finish the request).
        deadline = time.monotonic() + 10
        before = _context_switches(thread.native_id)
        while True:
            time.sleep(0.2)
            now = _context_switches(thread.native_id)
            if now == before:
                break
            assert time.monotonic() < deadline, "the server thread never went idle after a request"
            before = now
        # The idle second itself is what is measured (not a sleep-then-assert: nothing is expected to happen).
        time.sleep(1.0)
        assert _context_switches(thread.native_id) - before <= 1  # a polling server wakes every 0.2-0.5 s
        assert get(srv.url + "/healthz")[0] == 200  # still answers after the idle second
    finally:
        started = time.monotonic()
        srv.stop()
        assert time.monotonic() - started < 1.0
    assert not thread.is_alive()


def test_a_port_in_use_is_a_config_error_naming_the_address() -> None:
    with (
        MetricsServer("127.0.0.1:0", snapshot=make_snapshot) as srv,
        pytest.raises(ConfigError, match=f"127.0.0.1:{srv.port}: cannot listen"),
    ):
        MetricsServer(f"127.0.0.1:{srv.port}", snapshot=make_snapshot).start()


@pytest.mark.parametrize(
    ("addr", "expected"),
    [
        ("0.0.0.0:9100", ("0.0.0.0", 9100)),
        (":9100", ("0.0.0.0", 9100)),
        ("127.0.0.1:0", ("127.0.0.1", 0)),
        ("[::1]:9100", ("::1", 9100)),
        ("localhost:8080", ("localhost", 8080)),
    ],
)
def test_metrics_addr_parses_host_and_port(addr: str, expected: tuple[str, int]) -> None:
    assert parse_metrics_addr(addr) == expected


@pytest.mark.parametrize(
    ("addr", "message"),
    [
        ("9100", "expected HOST:PORT"),
        ("host:", "port '' is not a number"),
        ("host:http", "port 'http' is not a number"),
        ("host:70000", "port '70000' is not a number"),
        ("::1:9100", "IPv6 host in brackets"),
        ("[::1]9100", r"expected \[IPV6\]:PORT"),
    ],
)
def test_a_bad_metrics_addr_is_rejected_with_what_is_wrong(addr: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_metrics_addr(addr)


# --------------------------------------------------------------------------------------------------
# Liveness and readiness rules
# --------------------------------------------------------------------------------------------------


def test_a_loop_is_stalled_after_n_periods_but_never_before_the_floor() -> None:
    beats = [LoopHeartbeat("collect", 0.0, 1.0), LoopHeartbeat("report", 0.0, 10.0)]
    assert check_liveness(beats, 9.9).ok
    live = check_liveness(beats, 10.1)
    assert not live.ok
    assert live.stalled == ("collect",)
    live = check_liveness(beats, 50.1)
    assert live.stalled == ("collect", "report")
    assert check_liveness(beats, 20.0, stall_periods=30, min_stall_s=0).ok


def test_no_loops_registered_yet_is_alive() -> None:
    assert check_liveness([], 1e9).ok


def test_readiness_lists_every_problem() -> None:
    assert Readiness(nvml_initialised=False, dmi_registered=False).problems() == [
        "NVML is not initialised",
        "not registered with EdgeCore (DMI) and not in standalone mode",
    ]
    assert Readiness(nvml_initialised=True, dmi_registered=True).ready


# --------------------------------------------------------------------------------------------------
# Snapshot JSON and the status file
# --------------------------------------------------------------------------------------------------


def test_the_snapshot_survives_a_json_round_trip() -> None:
    snap = make_snapshot()
    assert MapperSnapshot.from_json(snap.to_json()) == snap


def test_the_status_file_is_written_atomically_and_reads_back(tmp_path: Path) -> None:
    path = write_status_file(tmp_path / "data", make_snapshot())
    assert path.name == "status.json"
    assert [p.name for p in path.parent.iterdir()] == ["status.json"]
    assert read_status_file(tmp_path / "data") == make_snapshot()


def test_a_missing_status_file_says_where_it_looked(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError, match=r"status.json: no status file"):
        read_status_file(tmp_path)


def test_a_corrupt_status_file_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "status.json").write_text("{not json")
    with pytest.raises(SnapshotFormatError, match=r"status.json: status: not JSON"):
        read_status_file(tmp_path)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.pop("node"), r"status\.node: missing"),
        (lambda d: d.update(format=99), r"status\.format: version 99"),
        (lambda d: d["buffer"].update(bytes=-1), r"status\.buffer\.bytes: expected a non-negative integer"),
        (lambda d: d["mqtt"].update(connected="yes"), r"status\.mqtt\.connected: expected true or false"),
        (lambda d: d["gpus"][0].update(state="broken"), r"status\.gpus\[0\]\.state: 'broken' is not one of"),
        (lambda d: d["gpus"][1]["sample"]["values"].update(x=[1]), r"status\.gpus\[1\]\.sample\.values\.x"),
        (lambda d: d["dmi"]["rpcs"].append(["a", 1]), r"status\.dmi\.rpcs\[2\]: expected \[label, label, count\]"),
        (lambda d: d["gpus"][0]["xid_errors"].update(abc=1), r"xid_errors: key 'abc' is not an XID number"),
        (lambda d: d["collect"]["duration"].update(counts=[1]), r"status\.collect\.duration: histogram needs"),
        (lambda d: d.update(gpus={}), r"status\.gpus: expected a list"),
    ],
)
def test_a_bad_status_document_is_rejected_naming_the_field(mutate: object, message: str) -> None:
    doc = json.loads(make_snapshot().to_json())
    mutate(doc)  # type: ignore[operator]
    with pytest.raises(SnapshotFormatError, match=message):
        MapperSnapshot.from_dict(doc)


_values = st.dictionaries(
    st.sampled_from(["temperature", "power_usage", "product_name", "persistence_mode", "clock_sm"]),
    st.one_of(
        st.integers(min_value=0, max_value=2**53),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=20),
        st.booleans(),
    ),
)


@settings(max_examples=50, deadline=None)
@given(values=_values, ts=st.integers(min_value=0, max_value=2**53), age=st.none() | st.floats(0, 1e6))
def test_any_sample_values_survive_the_json_round_trip(values: dict[str, object], ts: int, age: float | None) -> None:
    gpu = GpuSnapshot(info=GpuInfo(uuid=H100, index=0, name="n"), sample=Sample(H100, ts, values))  # type: ignore[arg-type]
    snap = MapperSnapshot(node="n", gpus=(gpu,), buffer_oldest_age_s=age)
    assert MapperSnapshot.from_json(snap.to_json()) == snap


def test_histogram_observe_returns_a_new_histogram_and_keeps_the_old() -> None:
    h = DurationHistogram(bounds_s=(0.1, 1.0))
    h2 = h.observe(0.1).observe(0.5).observe(7)
    assert h.count == 0
    assert h2.counts == (1, 1, 1)
    assert h2.cumulative()[-1][1] == 3
    assert h2.sum_s == pytest.approx(7.6)
    assert h2 == DurationHistogram(bounds_s=(0.1, 1.0), counts=(1, 1, 1), sum_s=h2.sum_s)
    with pytest.raises(ValueError, match="strictly increasing"):
        DurationHistogram(bounds_s=(1.0, 0.5))


def test_a_gpu_snapshot_refuses_a_state_edgecore_would_drop() -> None:
    with pytest.raises(ValueError, match="'disconnected' is not one of ok, online"):
        GpuSnapshot(info=GpuInfo(uuid=H100, index=0, name="n"), state="disconnected")


# --------------------------------------------------------------------------------------------------
# gpu-mapper status
# --------------------------------------------------------------------------------------------------


def test_the_status_table_shows_each_gpu_with_power_vs_cap_and_the_backlog() -> None:
    text = render_status(make_snapshot(), wide=True)
    lines = text.splitlines()
    assert lines[0].startswith("gpu-mapper 0.1.0 on node edge1 (dmi), NVIDIA driver 550.54.15, as of 2026-")
    header = lines[2]
    for col in ("DEVICE", "UUID", "POWER / CAP", "TEMP", "UTIL", "STATE", "DESIRED", "POLICY"):
        assert col in header
    h100 = next(line for line in lines if H100 in line)
    assert "default/edge1-gpu0" in h100
    assert "612.5 / 650 W" in h100
    assert "61 C" in h100
    assert "87 %" in h100
    assert "power_limit:applied,locked_gpu_clocks:applied" in h100
    assert "normal" in h100
    t4 = next(line for line in lines if T4 in line)
    assert "(no Device)" in t4
    assert "14.2 / 70 W" in t4
    assert "buffer: 12 batches, 1.4 MiB of 256.0 MiB (1% full), oldest unsent 42 s old" in text
    assert "dropped: 4 batches (max-age 3, max-bytes 1)" in text
    assert "mqtt: connected, 2 reconnects" in text
    assert "edgecore: registered" in text
    assert "desired values rejected: 1 (out-of-range 1)" in text


def test_the_status_table_columns_line_up() -> None:
    lines = render_status(make_snapshot(), wide=True).splitlines()
    header, rows = lines[2], [line for line in lines if line.startswith("default/") or line.startswith("(no")]
    assert len(rows) == 2
    col = header.index("UUID")
    assert all(r[col:].startswith("GPU-") for r in rows)


def test_the_status_table_shows_a_cap_that_differs_from_what_was_asked() -> None:
    snap = make_snapshot(with_t4=False)
    gpu = replace(snap.gpus[0], desired_power_limit_w=500.0)
    assert "612.5 / 650 W (asked 500)" in render_status(replace(snap, gpus=(gpu,)))


def test_the_status_table_of_an_empty_disconnected_node_says_so() -> None:
    text = render_status(MapperSnapshot(node="edge1", mqtt_enabled=True))
    assert "no GPUs" in text
    assert "mqtt: DISCONNECTED" in text
    assert "edgecore: NOT REGISTERED" in text


def test_a_gpu_without_a_sample_yet_shows_dashes() -> None:
    gpu = GpuSnapshot(info=GpuInfo(uuid=H100, index=0, name="n"))
    text = render_status(MapperSnapshot(node="edge1", mode="standalone", gpus=(gpu,)), wide=True)
    row = next(line for line in text.splitlines() if H100 in line)
    assert "- / - W" in row
    assert "unknown (no sample yet)" in row
    assert "edgecore: standalone mode" in text
