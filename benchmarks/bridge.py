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
* baselines in the same run: ``decode_only_samples_per_s`` (decode alone, the floor of any bridge) and
  ``protobuf_lib_encode_samples_per_s`` (the same requests built with the protobuf library from
  ``proto/remote.proto``, compiled with grpc_tools' protoc, instead of the hand encoder).
* ``e2e_samples_per_s``: the batches are queued on mosquitto for the bridge's persistent session while it is
  stopped, then ``gpu-mapper bridge`` (a subprocess) drains them into Prometheus 2.x
  (``--web.enable-remote-write-receiver``); wall time from its start until its ``/metrics`` count every sample
  written. ``e2e_bridge_cpu_s_per_million_samples`` and ``e2e_bridge_peak_rss_mib`` from /proc of the bridge.

Run: ``.venv/bin/python benchmarks/bridge.py [--minutes M] [--repeat R] [--no-e2e]``. Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mapper.bridge.core import Converter, PendingRequest, bridged_series_names  # noqa: E402
from mapper.bridge.remotewrite import compress, encode_v1  # noqa: E402
from mapper.clock import FakeClock  # noqa: E402
from mapper.edge.gpu.nvml import NvmlBackend  # noqa: E402
from mapper.edge.gpu.simnvml import SimNvml  # noqa: E402
from mapper.edge.status.stats import GpuSnapshot  # noqa: E402
from mapper.tools.discover import device_name  # noqa: E402
from mapper.wire.state import GpuIdentity, parse_state  # noqa: E402
from mapper.wire.telemetry import BatchCodec, BatchEncoder, decode_batch  # noqa: E402
from mapper.wire.topics import state_topic, telemetry_topic  # noqa: E402

GPUS = 8
NODE = "bench-node"
BOOT_ID = "9e1b2c3d"
SCENARIOS = ("inference", "training", "oscillating", "steady", "heat", "idle", "training", "inference")
REQUEST_SAMPLES = 10_000


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


def protobuf_lib_pass(payloads: list[bytes], pb: object, idents: dict[str, GpuIdentity]) -> tuple[int, float]:
    """The baseline encoder: the protobuf library's messages (decode and convert as in ``codec_pass``)."""
    codec = BatchCodec(dictionary_id=0)
    conv = Converter()
    uuids: dict[str, str] = {}
    t0 = time.process_time()
    total = 0

    def flush(req: PendingRequest) -> None:
        wr = pb.WriteRequest()  # type: ignore[attr-defined]
        for s in req.series():
            ts = wr.timeseries.add()
            for name, value in s.labels:
                lab = ts.labels.add()
                lab.name, lab.value = name, value
            for t, v in s.samples():
                smp = ts.samples.add()
                smp.timestamp, smp.value = t, v
        compress(wr.SerializeToString())

    req = PendingRequest(0.0)
    for p in payloads:
        b = decode_batch(p, codec)
        uuid = b.uuid or uuids.get(b.device, "")
        if b.uuid:
            uuids[b.device] = b.uuid
        conv.add(req, b, uuid, idents[b.device])
        if req.samples >= REQUEST_SAMPLES:
            flush(req)
            total += req.samples
            req = PendingRequest(0.0)
    if req.samples:
        flush(req)
        total += req.samples
    return total, time.process_time() - t0


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
    args = ap.parse_args()
    messages, states = workload(args.minutes)
    payloads = [p for _, p in messages]
    idents = identities(states)
    runs = [codec_pass(payloads, idents) for _ in range(args.repeat)]
    samples = runs[0][0]
    cpu = min(r[1] for r in runs)
    decode_cpu = min(decode_pass(payloads)[1] for _ in range(args.repeat))
    out: dict[str, object] = {
        "workload": f"{GPUS} x H100 sim, 1 Hz, every property, {args.minutes:g} min, 10 s batches",
        "batches": len(payloads),
        "samples": samples,
        "codec_samples_per_s": round(samples / cpu),
        "codec_cpu_s_per_million_samples": round(cpu / samples * 1e6, 3),
        "decode_only_samples_per_s": round(samples / decode_cpu),
        "target_codec_samples_per_s": 200_000,
    }
    with tempfile.TemporaryDirectory(prefix="bench-bridge-") as d:
        pb = compiled_proto(Path(d))
        if pb is not None:
            lib_cpu = min(protobuf_lib_pass(payloads, pb, idents)[1] for _ in range(args.repeat))
            out["protobuf_lib_encode_samples_per_s"] = round(samples / lib_cpu)
        if not args.no_e2e:
            out.update(end_to_end(messages, states, samples + status_samples(states), Path(d)))
    out["machine"] = f"{platform.machine()} {os.cpu_count()} cpus, python {platform.python_version()}"
    print(json.dumps(out))


if __name__ == "__main__":
    main()
