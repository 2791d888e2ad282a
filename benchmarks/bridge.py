"""Throughput of ``gpu-mapper bridge``: decode + encode alone on one core, and end to end from a real mosquitto into
a real Prometheus; the bridge's CPU seconds per million samples and its peak RSS.

Workload: 8 simulated H100s (SimNvml through NvmlBackend, mixed scenarios, seed 41: not a seed the tests use)
sampled every second, every property, for ``--minutes`` (default 30), cut into 10 s batches per device as the
mapper cuts them. A "sample" is one (series, timestamp, value) the bridge writes (``Converter.add`` counts them),
as Prometheus counts samples. Each device's retained state message (``GpuSnapshot.state_message``)
gives its GPU's identity: every series carries the ``gpu`` label as the bridge writes it; end to end, the bridge also
writes the status series of those messages (a few samples per device, counted in ``want``).

* ``codec_samples_per_s``: decode (``mapper.wire.telemetry.decode_batch``) + conversion (``bridgecore.Converter``) +
  remote-write 1.0 encoding and snappy (``mapper.bridge.remotewrite``), requests of 10 000 samples, CPU time of this one
  process (one core), best of ``--repeat``.
* the baseline in the same run, ``protobuf_lib_samples_per_s``: a bridge written with the protobuf library
  (``PbBridge``: messages from ``proto/remote.proto`` compiled with grpc_tools' protoc): the same decode, then
  each batch's values straight into ``TimeSeries`` messages (named and labelled from the naming table by its own
  code), ``SerializeToString`` and snappy, requests cut at the same batches. It never decodes the bridge's output
  (the earlier baseline rebuilt its messages from the bridge's own encoded samples, paying both). Outside the
  timing, ``protobuf_lib_same_requests`` checks that the bridge's requests, parsed by the protobuf library, hold
  exactly the baseline's series and samples. ``speedup_vs_protobuf_lib`` = baseline CPU / bridge CPU per sample.
  ``decode_only_samples_per_s`` (decode alone) is the floor of both, not a baseline.
* ``e2e_samples_per_s``: the batches are queued on mosquitto for the bridge's persistent session while it is
  stopped, then ``gpu-mapper bridge`` (a subprocess) drains them into Prometheus 2.x
  (``--web.enable-remote-write-receiver``); wall time from its start until its ``/metrics`` count every sample
  written. ``e2e_bridge_cpu_s_per_million_samples`` and ``e2e_bridge_peak_rss_mib`` from /proc of the bridge.

Run: ``.venv/bin/python benchmarks/bridge.py [--minutes M] [--repeat R] [--no-e2e] [--smoke]``. Prints one JSON line
last.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mapper.bridge.core import Converter, PendingRequest, bridged_series_names  # noqa: E402
from mapper.bridge.remotewrite import compress, encode_v1  # noqa: E402
from mapper.clock import FakeClock  # noqa: E402
from mapper.edge.gpu.nvml import NvmlBackend  # noqa: E402
from mapper.edge.gpu.simnvml import SimNvml  # noqa: E402
from mapper.edge.status.stats import GpuSnapshot  # noqa: E402
from mapper.shared import naming  # noqa: E402
from mapper.tools.discover import device_name  # noqa: E402
from mapper.wire.state import GpuIdentity, parse_state  # noqa: E402
from mapper.wire.telemetry import BatchCodec, BatchEncoder, DecodedBatch, decode_batch  # noqa: E402
from mapper.wire.topics import state_topic, telemetry_topic  # noqa: E402

GPUS = 8
NODE = "bench-node"
BOOT_ID = "9e1b2c3d"
SCENARIOS = ("inference", "training", "oscillating", "steady", "heat", "idle", "training", "inference")
REQUEST_SAMPLES = 10_000
#: decode + convert + encode + snappy on one core (docs/benchmarks.md).
TARGET_CODEC_SAMPLES_PER_S = 200_000


def workload(minutes: float) -> tuple[list[tuple[str, bytes]], list[tuple[str, bytes]]]:
    """(telemetry (topic, payload) in publish order, retained state messages: the mapper's, with each GPU's
    identity and status)."""
    start = int(time.time() * 1000) - int(minutes * 60_000) - 10_000
    clock = FakeClock(start_wall_ms=start)
    sim = SimNvml(GPUS, "H100", clock=clock.monotonic, seed=41)
    backend = NvmlBackend(sim, clock=clock)
    backend.init()
    out: list[tuple[str, bytes]] = []
    last = {}
    try:
        gpus = backend.list_gpus()
        driver = backend.driver_version()
        info = {f"default/{device_name(NODE, g.index)}": g for g in gpus}
        for g, scenario in zip(gpus, SCENARIOS, strict=False):
            sim.set_scenario(g.uuid, scenario)
        encoders = {
            g.uuid: BatchEncoder(NODE, f"default/{device_name(NODE, g.index)}", g.uuid, BOOT_ID, window_s=10.0)
            for g in gpus
        }
        for _ in range(round(minutes * 60)):
            clock.advance(1.0)
            for g in gpus:
                enc = encoders[g.uuid]
                sample = backend.sample(g.uuid, None)
                last[enc.device] = sample
                enc.add(sample)
                b = enc.flush_due(sample.ts_ms)
                if b is not None:
                    out.append((telemetry_topic(NODE, enc.device), b.payload))
        for enc in encoders.values():
            b = enc.flush()
            if b is not None:
                out.append((telemetry_topic(NODE, enc.device), b.payload))
    finally:
        backend.shutdown()
    states = []
    for dev, s in last.items():
        snap = GpuSnapshot(info=info[dev], device=dev, sample=s, state="online")
        states.append((state_topic(NODE, dev), snap.state_message(dev, driver_version=driver, at_ms=s.ts_ms)))
    return out, states


def identities(states: list[tuple[str, bytes]]) -> dict[str, GpuIdentity]:
    """device -> the GPU identity its state message gives (the labels the bridge puts on its series)."""
    out = {}
    for _, payload in states:
        status = parse_state(payload)
        assert status.identity is not None
        out[status.device] = status.identity
    return out


def status_samples(states: list[tuple[str, bytes]]) -> int:
    """The samples the bridge writes for the state messages (the status series)."""
    conv, req = Converter(), PendingRequest(0.0)
    return sum(conv.add_status(req, NODE, parse_state(p), "") for _, p in states)


def codec_pass(payloads: list[bytes], idents: dict[str, GpuIdentity]) -> tuple[int, float]:
    """(samples, CPU s) for decode + convert + encode + snappy of every payload (series labelled as the bridge
    labels them, the GPU's identity included)."""
    codec = BatchCodec(dictionary_id=0)
    conv = Converter()
    uuids: dict[str, str] = {}
    t0 = time.process_time()
    total = 0
    req = PendingRequest(0.0)
    for p in payloads:
        b = decode_batch(p, codec)
        uuid = b.uuid or uuids.get(b.device, "")
        if b.uuid:
            uuids[b.device] = b.uuid
        conv.add(req, b, uuid, idents[b.device])
        if req.samples >= REQUEST_SAMPLES:
            compress(encode_v1(req.series()))
            total += req.samples
            req = PendingRequest(0.0)
    if req.samples:
        compress(encode_v1(req.series()))
        total += req.samples
    return total, time.process_time() - t0


def decode_pass(payloads: list[bytes]) -> tuple[int, float]:
    codec = BatchCodec(dictionary_id=0)
    t0 = time.process_time()
    for p in payloads:
        decode_batch(p, codec)
    return 0, time.process_time() - t0


class PbBridge:
    """The baseline: a bridge written with the protobuf library (messages from ``proto/remote.proto``). It
    converts each decoded batch straight into ``TimeSeries`` messages, named and labelled from the naming table as
    the bridge does (its own code: none of ``Converter``'s), so that it writes the very requests the bridge writes
    (``same_requests`` checks that, outside the timing)."""

    def __init__(self, pb: Any) -> None:
        self.pb = pb
        derived = {
            naming.CLOCK_EVENT_REASONS_PROPERTY: naming.CLOCK_EVENT_REASON,
            naming.COMPUTE_MODE_PROPERTY: naming.COMPUTE_MODE,
            naming.PRODUCT_NAME_PROPERTY: naming.GPU_INFO,
            naming.POLICY_STATE_PROPERTY: naming.POLICY_STATE,
        }
        self.derived = {prop: (f.series_name, f.labels[0]) for prop, f in derived.items()}
        self.plain = {
            ps.spec.name: (ps.family.series_name, ps.scale)
            for ps in naming.PROPERTY_SERIES
            if ps.spec.name not in derived
        }

    def request(self, batches: list[tuple[DecodedBatch, str, GpuIdentity]]) -> Any:
        """One ``WriteRequest`` of these batches' samples."""
        wr = self.pb.WriteRequest()
        series: dict[tuple[Any, ...], Any] = {}
        for b, uuid, ident in batches:
            base = {
                "device": naming.device_label(b.device),
                "node": b.node,
                "uuid": uuid,
                "gpu": ident.gpu,
                "job": naming.BRIDGE_JOB,
            }
            for row in b.samples:
                for name, v in row.values.items():
                    for sname, extra, x in self._values(name, v, ident):
                        key = (b.node, b.device, uuid, ident, sname, extra)
                        ts = series.get(key)
                        if ts is None:
                            ts = series[key] = wr.timeseries.add()
                            labels = dict(base, __name__=sname, **dict(extra))
                            for k in sorted(labels):
                                if labels[k] != "":
                                    ts.labels.add(name=k, value=labels[k])
                        ts.samples.add(value=x, timestamp=row.ts_ms)
        return wr

    def _values(self, name: str, v: Any, ident: GpuIdentity) -> list[tuple[str, tuple[tuple[str, str], ...], float]]:
        plain = self.plain.get(name)
        if plain is not None:
            if isinstance(v, bool):
                return [(plain[0], (), plain[1] if v else 0.0)]
            if isinstance(v, int | float) and math.isfinite(v):
                return [(plain[0], (), v * plain[1])]
            return []
        derived = self.derived.get(name)
        if derived is None:
            return []
        sname, label = derived
        if name == naming.CLOCK_EVENT_REASONS_PROPERTY:
            mask = naming.number(v)
            flags = [] if mask is None else list(naming.clock_event_reason_flags(int(mask)))
            return [(sname, ((label, r),), float(f)) for r, f in flags]
        if name == naming.COMPUTE_MODE_PROPERTY:
            return (
                [(sname, ((label, m),), float(f)) for m, f in naming.compute_mode_flags(v)]
                if isinstance(v, str)
                else []
            )
        if not isinstance(v, str) or not v:
            return []
        if name == naming.PRODUCT_NAME_PROPERTY:
            return [
                (sname, ((label, v), ("driver_version", ident.driver_version), ("pci_bus_id", ident.pci_bus_id)), 1.0)
            ]
        return [(sname, ((label, v),), 1.0)]


def protobuf_lib_pass(payloads: list[bytes], bridge: PbBridge, idents: dict[str, GpuIdentity]) -> tuple[int, float]:
    """The baseline's decode + convert + serialize + snappy, requests cut where ``codec_pass`` cuts them."""
    codec = BatchCodec(dictionary_id=0)
    uuids: dict[str, str] = {}
    t0 = time.process_time()
    total = 0
    pending: list[tuple[DecodedBatch, str, GpuIdentity]] = []
    count = 0
    for p in payloads:
        b = decode_batch(p, codec)
        uuid = b.uuid or uuids.get(b.device, "")
        if b.uuid:
            uuids[b.device] = b.uuid
        pending.append((b, uuid, idents[b.device]))
        count += sum(len(r.values) for r in b.samples)
        if count >= REQUEST_SAMPLES:
            wr = bridge.request(pending)
            compress(wr.SerializeToString())
            total += sum(len(ts.samples) for ts in wr.timeseries)
            pending, count = [], 0
    if pending:
        wr = bridge.request(pending)
        compress(wr.SerializeToString())
        total += sum(len(ts.samples) for ts in wr.timeseries)
    return total, time.process_time() - t0


def same_requests(payloads: list[bytes], bridge: PbBridge, idents: dict[str, GpuIdentity]) -> bool:
    """Whether the bridge's requests, parsed by the protobuf library, hold the baseline's series and samples
    (series compared as sets: the order of series in a request means nothing to a receiver)."""
    codec = BatchCodec(dictionary_id=0)
    conv = Converter()
    uuids: dict[str, str] = {}
    req = PendingRequest(0.0)
    pending: list[tuple[DecodedBatch, str, GpuIdentity]] = []

    def as_set(wr: Any) -> dict[tuple[tuple[str, str], ...], list[tuple[int, float]]]:
        return {
            tuple((lab.name, lab.value) for lab in ts.labels): [(smp.timestamp, smp.value) for smp in ts.samples]
            for ts in wr.timeseries
        }

    def compare() -> bool:
        ours = bridge.pb.WriteRequest.FromString(encode_v1(req.series()))
        return as_set(ours) == as_set(bridge.request(pending))

    for p in payloads:
        b = decode_batch(p, codec)
        uuid = b.uuid or uuids.get(b.device, "")
        if b.uuid:
            uuids[b.device] = b.uuid
        conv.add(req, b, uuid, idents[b.device])
        pending.append((b, uuid, idents[b.device]))
        if req.samples >= REQUEST_SAMPLES:
            if not compare():
                return False
            req, pending = PendingRequest(0.0), []
    return not pending or compare()


def compiled_proto(tmp: Path) -> object | None:
    try:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "grpc_tools.protoc",
                f"--proto_path={REPO / 'proto'}",
                f"--python_out={tmp}",
                "remote.proto",
            ],
            check=True,
            timeout=60,
            capture_output=True,
        )
    except (subprocess.CalledProcessError, FileNotFoundError, subprocess.TimeoutExpired):
        return None
    spec = importlib.util.spec_from_file_location("remote_pb2", tmp / "remote_pb2.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _proc_hwm_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _metric(url: str, name: str) -> float:
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
    except OSError:
        return -1.0
    return 0.0


def end_to_end(messages: list[tuple[str, bytes]], states: list[tuple[str, bytes]], want: int, tmp: Path) -> dict:
    from tests.bridgehelpers import Publisher
    from tests.brokers import Mosquitto, free_port
    from tests.promserver import Prometheus

    broker = Mosquitto(tmp, extra_config="max_inflight_messages 1000\nmax_queued_messages 1000000")
    prom = Prometheus(tmp, ooo_window="2h")
    broker.start()
    prom.start()
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "mapper.cli",
        "bridge",
        "--mqtt",
        broker.url,
        "--remote-write",
        prom.write_url,
        "--mqtt-client-id",
        "bench-bridge",
        "--metrics-addr",
        f"127.0.0.1:{port}",
        "--spool-dir",
        str(tmp / "spool"),
        "--log-level",
        "WARNING",
    ]
    url = f"http://127.0.0.1:{port}"
    log = (tmp / "bridge.log").open("ab")
    try:
        # 1. the bridge's persistent session subscribes once, then the bridge stops: the broker queues for it
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, cwd=REPO)
        deadline = time.monotonic() + 30
        while _metric(url, "gpu_mapper_bridge_mqtt_connected") != 1.0:
            if time.monotonic() > deadline:
                raise SystemExit("the bridge did not connect")
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        pub = Publisher(broker.url, "bench-publisher")
        pub.publish([(t, p, True) for t, p in states])
        pub.publish([(t, p, False) for t, p in messages], timeout_s=300)
        pub.close()
        # 2. measured: the bridge drains the queue into Prometheus
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=log, stderr=log, cwd=REPO)
        deadline = t0 + 600
        while _metric(url, "gpu_mapper_bridge_samples_written_total") < want:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit(f"the bridge did not write {want} samples in time; see {tmp / 'bridge.log'}")
            time.sleep(0.05)
        wall = time.monotonic() - t0
        cpu = _proc_cpu_s(proc.pid)
        rss = _proc_hwm_mib(proc.pid)
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        stored = 0.0
        for name in sorted(bridged_series_names()):  # per name: count_over_time drops the name
            q = urllib.parse.quote(f"sum(count_over_time({name}[3h]))")
            with urllib.request.urlopen(f"{prom.url}/api/v1/query?query={q}", timeout=60) as resp:
                stored += sum(float(r["value"][1]) for r in json.loads(resp.read())["data"]["result"])
        return {
            "e2e_samples_per_s": round(want / wall),
            "e2e_wall_s": round(wall, 2),
            "e2e_bridge_cpu_s": round(cpu, 2),
            "e2e_bridge_cpu_s_per_million_samples": round(cpu / want * 1e6, 2),
            "e2e_bridge_peak_rss_mib": round(rss, 1),
            "e2e_samples_in_prometheus": int(stored),
        }
    finally:
        if "proc" in locals() and proc.poll() is None:
            proc.kill()
        prom.stop()
        broker.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-e2e", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="half a minute of workload, one pass (the smoke test)")
    args = ap.parse_args()
    if args.smoke:
        args.minutes, args.repeat = 0.5, 1
    messages, states = workload(args.minutes)
    payloads = [p for _, p in messages]
    idents = identities(states)
    runs = [codec_pass(payloads, idents) for _ in range(args.repeat)]
    samples = runs[0][0]
    cpu = min(r[1] for r in runs)
    decode_cpu = min(decode_pass(payloads)[1] for _ in range(args.repeat))
    out: dict[str, object] = {
        "workload": f"{GPUS} x H100 sim, 1 Hz, every property, {args.minutes:g} min, 10 s batches",
        "sim_cost": "none",  # the simulator only makes the data; no figure is a cost of NVML calls
        "batches": len(payloads),
        "samples": samples,
        "codec_samples_per_s": round(samples / cpu),
        "codec_cpu_s_per_million_samples": round(cpu / samples * 1e6, 3),
        "decode_only_samples_per_s": round(samples / decode_cpu),
        "target_codec_samples_per_s": TARGET_CODEC_SAMPLES_PER_S,
        "target_met": samples / cpu >= TARGET_CODEC_SAMPLES_PER_S,
    }
    with tempfile.TemporaryDirectory(prefix="bench-bridge-") as d:
        pb = compiled_proto(Path(d))
        if pb is not None:
            baseline = PbBridge(pb)
            lib_runs = [protobuf_lib_pass(payloads, baseline, idents) for _ in range(args.repeat)]
            lib_cpu = min(r[1] for r in lib_runs)
            out["protobuf_lib_samples_per_s"] = round(lib_runs[0][0] / lib_cpu)
            out["protobuf_lib_samples"] = lib_runs[0][0]
            out["protobuf_lib_same_requests"] = same_requests(payloads, baseline, idents)
            out["speedup_vs_protobuf_lib"] = round(lib_cpu / cpu * samples / lib_runs[0][0], 2)
        if not args.no_e2e:
            out.update(end_to_end(messages, states, samples + status_samples(states), Path(d)))
    out["machine"] = f"{platform.machine()} {os.cpu_count()} cpus, python {platform.python_version()}"
    print(json.dumps(out))


if __name__ == "__main__":
    main()
