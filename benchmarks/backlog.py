"""A day offline, in the cloud within minutes: the backlog a node stores in ``--hours`` (default 24) offline,
replayed through a 1 Mbit/s link by the real mapper into a real Prometheus through ``gpu-mapper bridge``.

1. **The backlog.** The node's GPUs (``--gpus``, default 8) are the simulated H200s ``gpu-mapper run --sim N``
   enumerates (the simulated NVML charging what each call costs on an H200, ``--sim-cost h200``; same seed: same
   uuids, indexes and Device names); their Devices are those ``gpu-mapper discover``
   writes (every property the GPU reads, at the catalog's default collect cycles). The values come from
   ``benchmarks/streamgen.py``'s noise model (a stream the encoder and its dictionary were not tuned on), each
   property at its Device's collect cycle with streamgen's timestamp jitter, in catalog units; what streamgen
   does not model (limits, thresholds, locked clocks, modes) is constant per GPU, as on a real board. The
   samples go through the mapper's own encoder (10 s windows) into the mapper's own SQLite buffer, with the
   mapper's backlog compaction run as the offline time passes and done at its end (``benchmarks/buffer.py``'s
   ``Offline``), in the data directory the mapper then runs on. The backlog ends when the benchmark starts.
2. **The cloud side**: a real mosquitto on a free port, a real Prometheus 2.x (remote-write receiver, an
   out-of-order window of ``--hours`` + 1 h, ``tests/promserver.py``) and ``gpu-mapper bridge`` (a subprocess,
   persistent session) from the broker into it.
3. **The link**: an asyncio TCP forwarder in this process between the mapper and the broker, a token bucket of
   ``--link-kbit`` (1000 kbit/s) each way with a burst of ``LINK_BURST_BYTES``, counting the bytes. While the link
   is down it closes every connection it accepts.
4. **The node**: ``gpu-mapper run --sim N`` on the data directory, MQTT through the forwarder (EventBus off: its
   twins stay on the node), its GPUs sampled as usual (live telemetry). It starts with the link down; once it is
   ready (and ``LINK_DOWN_S`` later) the link comes back: that instant is t0.

Reported: ``reconnect_s`` (t0 to the mapper's first connection through the link); ``all_queryable_s`` (t0 to every
sample of the backlog queryable in Prometheus; target 300 s), polled every ``--poll-s``: one series until it is
complete (``probe_series_queryable_s``), then every series, a pass that takes seconds over a day of samples, so
the figure is an upper bound (``all_queryable_pass_started_s``: when that pass began); the bytes through the
link each way until then; the backlog's samples expected, found, ``lost`` and ``duplicated`` (both must be 0);
and live telemetry meanwhile (below).

Counting: the backlog's samples of every property written as a series of its own
(``mapper.shared.naming.PROPERTY_SERIES``: one Prometheus sample per property value; the properties written as
derived families, ``gpu_info``, the clock-event flags and the compute mode, are not counted) are counted per
series name and Device in the stream as it is generated, and in Prometheus with ``count_over_time`` over exactly
the backlog's time range (the live samples are later). A Device's count below the expected one is samples lost,
above it samples written twice (e.g. under two label sets): Prometheus keeps a sample written twice with the
same labels only once, so the bridge's own counters are reported beside (``bridge``: samples written, duplicate
batches it dropped, refused samples). Live telemetry, polled with the counts: ``live_lag_s`` (max, median, at
the end): how old the newest live sample queryable is (while none is, how long the mapper has been sampling);
``live_after_link_s``: from t0 until a sample the mapper took after t0 is queryable. Also the replay's own
figures from the mapper's log, and the CPU seconds of the mapper, the bridge, Prometheus and mosquitto from t0
until every sample was counted (what dominates).

Run: ``.venv/bin/python benchmarks/backlog.py [--hours 24] [--gpus 8] [--link-kbit 1000] [--smoke] [--keep]``.
``--smoke``: 1 GPU, 6 minutes of backlog (the benchmark smoke test). Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import streamgen  # noqa: E402
from buffer import Offline  # noqa: E402

from mapper.shared import naming  # noqa: E402
from mapper.shared.model import NVML_PROPERTIES, GpuInfo, Sample, Value  # noqa: E402
from mapper.tools.discover import device_name  # noqa: E402
from mapper.wire.telemetry import BatchCodec  # noqa: E402

NODE = "edge-1"  # benchmarks/buffer.py's Offline stores under this node's topics
PROFILE = "H200"
SIM_SEED = 29
STREAM_SEED = 11
TARGET_S = 300.0
#: The link's bucket: about ten full-size TCP segments.
LINK_BURST_BYTES = 16 * 1024
#: How long the link stays down once the mapper is ready (its MQTT session backs off meanwhile, as on a node).
LINK_DOWN_S = 5.0
#: The series counted while waiting (every second in the catalog): once it is complete, every series is counted.
PROBE_SERIES = "gpu_power_usage_watts"
#: Properties written as derived families instead of a series of their own (flags per reason, info, modes).
DERIVED = frozenset(
    (
        naming.CLOCK_EVENT_REASONS_PROPERTY,
        naming.COMPUTE_MODE_PROPERTY,
        naming.PRODUCT_NAME_PROPERTY,
        naming.POLICY_STATE_PROPERTY,
    )
)
SERIES_OF = {s.spec.name: s.family.series_name for s in naming.PROPERTY_SERIES if s.spec.name not in DERIVED}
NVML_NAMES = frozenset(p.name for p in NVML_PROPERTIES)
#: How long since the energy counter was read from the driver (the backend's, no NVML call) and its read cycle.
ENERGY_AGE = "energy_consumption_age"
ENERGY_READ_S = next(p.read_cycle_ms for p in NVML_PROPERTIES if p.name == "energy_consumption") // 1000
#: The live mapper's simulated NVML charges what each call costs on an H200 (``mapper.edge.gpu.profiles``).
SIM_COST = "h200"


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} backlog: {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- the node


def sim_gpus(gpus: int) -> tuple[list[GpuInfo], dict[str, dict[str, str]]]:
    """The GPUs ``gpu-mapper run --sim`` will enumerate and what each cannot read (discover's probe)."""
    from mapper.edge.gpu.nvml import NvmlBackend
    from mapper.edge.gpu.simnvml import SimNvml
    from mapper.tools.discover import probe_all

    backend = NvmlBackend(SimNvml(gpus, PROFILE, seed=SIM_SEED))
    backend.init()
    try:
        infos = backend.list_gpus()
        lacking = probe_all(backend, infos)
    finally:
        backend.shutdown()
    return infos, lacking


def write_devices(folder: Path, infos: list[GpuInfo], lacking: dict[str, dict[str, str]]) -> dict[str, dict[str, int]]:
    """Discover's Devices and model in ``folder``; each Device's properties and collect cycles (s), by key."""
    import yaml

    from mapper.tools.discover import device_yaml, model_yaml

    text = device_yaml(infos, NODE, unsupported=lacking)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "devices.yaml").write_text(text)
    (folder / "model.yaml").write_text(model_yaml())
    out = {}
    for doc in yaml.safe_load_all(text):
        if doc:
            key = f"{doc['metadata']['namespace']}/{doc['metadata']['name']}"
            # What the GPU is sampled for (the telemetry batches carry these; the status twins are the mapper's).
            props = [p for p in doc["spec"]["properties"] if p["name"] in NVML_NAMES]
            out[key] = {p["name"]: max(1, p["collectCycle"] // 1000) for p in props}
    return out


# ---------------------------------------------------------------------------------------------- the backlog


_REASON_TEXT = {0: "none", 1: "gpu_idle", 4: "sw_power_cap", 0x20: "sw_thermal_slowdown"}


def _catalog_values(g: Any, names: list[str], uuid: str) -> dict[str, Value]:
    """streamgen's model of GPU ``g`` for the catalog properties ``names``, in catalog types and units."""
    modelled = [n for n in names if n in _MODELLED]
    values = streamgen._values(g, tuple(modelled))
    out: dict[str, Value] = {}
    for name in names:
        if name in values:
            v = values[name]
            if name == "uuid":
                v = uuid  # the live GPU's: the bridge labels both with it
            elif name == "pstate":
                v = 0 if v == "P0" else 8
            elif name in ("pcie_tx", "pcie_rx"):
                v = int(v) * 1024  # streamgen's rates are KiB/s
            out[name] = v
        elif name == "clock_event_reasons_text":
            mask = int(streamgen._values(g, ("clock_event_reasons",))["clock_event_reasons"])
            out[name] = ",".join(t for bit, t in _REASON_TEXT.items() if bit and mask & bit) or "none"
        else:
            out[name] = _constant(g, name)
    return out


_MODELLED = frozenset(n for _, names in streamgen.CADENCES for n in names) - streamgen.OUTSIDE_CATALOG


def _constant(g: Any, name: str) -> Value:
    """What streamgen does not model: the board's fixed values."""
    limit = float(g.limit_w)
    table: dict[str, Value] = {
        "memory_reserved": 512 * 1048576,
        "temperature_slowdown": 87,
        "temperature_shutdown": 92,
        "power_limit_min": round(limit / 3),
        "power_limit_max": limit,
        "power_limit_default": limit,
        "power_limit": limit,
        "clock_sm_max": 1980,
        "ecc_errors_uncorrected": 0,
        "remapped_rows_uncorrectable": 0,
        "remapped_rows_pending": False,
        "locked_gpu_clock_min": 0,
        "locked_gpu_clock_max": 0,
        "locked_memory_clock_min": 0,
        "locked_memory_clock_max": 0,
        "persistence_mode": True,
        "compute_mode": "default",
    }
    if name not in table:
        raise SystemExit(f"backlog: no value for catalog property {name!r}: add it to _constant")
    return table[name]


def backlog_stream(
    infos: list[GpuInfo], props: dict[str, dict[str, int]], start_ms: int, seconds: int
) -> Iterator[tuple[str, Sample]]:
    """(Device key, Sample) per GPU and second with the properties due then, in time order."""
    fleet = [streamgen._new_gpu(i, STREAM_SEED) for i in range(len(infos))]
    keys = [f"default/{device_name(NODE, g.index)}" for g in infos]
    cycles = [props[k] for k in keys]
    jitter_rng = random.Random(STREAM_SEED)
    for second in range(seconds):
        for i, g in enumerate(fleet):
            streamgen._step(g)
            due = [n for n, c in cycles[i].items() if second % c == 0]
            jitter = jitter_rng.randint(0, 4) if jitter_rng.random() < 0.97 else jitter_rng.randint(5, 60)
            ts = start_ms + second * 1000 + jitter
            values = _catalog_values(g, [n for n in due if n != ENERGY_AGE], infos[i].uuid)
            if ENERGY_AGE in due:
                # The mapper's own sawtooth: the driver's counter read every read cycle, each GPU at its own offset.
                values[ENERGY_AGE] = float((second + i * ENERGY_READ_S // len(fleet)) % ENERGY_READ_S)
            yield keys[i], Sample(infos[i].uuid, ts, values)


def build_backlog(
    data_dir: Path, infos: list[GpuInfo], props: dict[str, dict[str, int]], hours: float, end_ms: int
) -> dict[str, Any]:
    """Store the backlog in ``data_dir/telemetry.db`` as the mapper does offline; its figures and the expected
    Prometheus samples by (series name, Device key)."""
    seconds = round(hours * 3600)
    start_ms = end_ms - seconds * 1000 - 100  # (the last round's jitter stays before the end)
    data_dir.mkdir(parents=True, exist_ok=True)
    off = Offline(data_dir / "telemetry.db", True, 10.0, BatchCodec(), False)
    expected: dict[tuple[str, str], int] = {}
    samples = 0
    first_ms = last_ms = None
    t0 = time.perf_counter()
    for key, sample in backlog_stream(infos, props, start_ms, seconds):
        off.add(key, sample)
        samples += len(sample.values)
        first_ms = sample.ts_ms if first_ms is None else min(first_ms, sample.ts_ms)
        last_ms = sample.ts_ms if last_ms is None else max(last_ms, sample.ts_ms)
        for name, v in sample.values.items():
            series = SERIES_OF.get(name)
            if series is not None and not (isinstance(v, float) and not math.isfinite(v)):
                expected[(series, key)] = expected.get((series, key), 0) + 1
    off.finish()
    rows = off.buf.stats()
    merges = off.compactor.stats.merges if off.compactor is not None else 0
    off.buf.close()
    assert first_ms is not None and last_ms is not None
    return {
        "samples": samples,
        "batches_cut": off.stored,
        "rows": rows.batches,
        "payload_bytes": rows.bytes,
        "file_bytes": off.buf.file_bytes(),
        "merges": merges,
        "first_ms": first_ms,
        "last_ms": last_ms,
        "build_s": round(time.perf_counter() - t0, 1),
        "expected": expected,
    }


# ---------------------------------------------------------------------------------------------- the link


class Bucket:
    """A token bucket of ``rate`` bytes/s holding at most ``burst`` bytes (one per direction of the link)."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = rate, burst
        self.tokens = burst
        self.at = time.monotonic()
        self.lock = asyncio.Lock()

    async def take(self, n: int) -> None:
        async with self.lock:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
            self.at = now
            self.tokens -= n
            if self.tokens < 0:
                await asyncio.sleep(-self.tokens / self.rate)


class Forwarder:
    """A TCP forwarder capped at ``kbit`` kbit/s each way, on its own event loop in a thread."""

    def __init__(self, target_port: int, kbit: float) -> None:
        self.target_port = target_port
        self.rate = kbit * 1000 / 8
        self.up = False
        self.bytes = {"up": 0, "down": 0}
        self.connections = 0
        self.first_connection_at: float | None = None
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="link", daemon=True)
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _start(self) -> asyncio.AbstractServer:
        self.buckets = {d: Bucket(self.rate, LINK_BURST_BYTES) for d in ("up", "down")}
        return await asyncio.start_server(self._client, "127.0.0.1", 0)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.up:
            writer.close()
            return
        try:
            up_r, up_w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", self.target_port), 10)
        except (OSError, TimeoutError):
            writer.close()
            return
        self.connections += 1
        if self.first_connection_at is None:
            self.first_connection_at = time.monotonic()
        await asyncio.gather(self._pump(reader, up_w, "up"), self._pump(up_r, writer, "down"))

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: str) -> None:
        bucket = self.buckets[direction]
        try:
            while data := await reader.read(4096):
                await bucket.take(len(data))
                writer.write(data)
                await writer.drain()
                self.bytes[direction] += len(data)
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            with contextlib.suppress(OSError):
                writer.close()

    def close(self) -> None:
        self.server.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


# ---------------------------------------------------------------------------------------------- the cloud side


def cpu_s(pid: int) -> float:
    """utime + stime of a process so far (s)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def metric(url: str, name: str) -> float | None:
    """A sample of a /metrics page, summed over its labels (0 when absent); None when the page is unreachable."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_metric(url: str, name: str, value: float, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while metric(url, name) != value:
        if time.monotonic() > deadline:
            raise SystemExit(f"backlog: {what} did not happen within {timeout_s:.0f} s")
        time.sleep(0.1)


def counts_by_device(prom: Any, series: str, first_ms: int, last_ms: int) -> dict[str, int]:
    """Samples of ``series`` per Device with timestamps in [first_ms, last_ms] (the backlog's range)."""
    window_ms = last_ms - first_ms + 1
    expr = f'sum by (device) (count_over_time({series}{{node="{NODE}"}}[{window_ms}ms]))'
    return {r["metric"].get("device", ""): int(float(r["value"][1])) for r in prom.query(expr, last_ms / 1000)}


def newest_live_s(prom: Any, since_s: float) -> float | None:
    """The newest sample time of the probe series, when it is a live one (after ``since_s``, the backlog's end)."""
    rows = prom.query(f'max(timestamp({PROBE_SERIES}{{node="{NODE}"}}))', time.time())
    if not rows:
        return None
    newest = float(rows[0]["value"][1])
    return newest if newest > since_s else None


# ---------------------------------------------------------------------------------------------- the run


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tests.brokers import Mosquitto, free_port
    from tests.promserver import Prometheus

    tmp = Path(tempfile.mkdtemp(prefix="bench-backlog-"))
    procs: list[subprocess.Popen[bytes]] = []
    broker = prom = link = None
    try:
        infos, lacking = sim_gpus(args.gpus)
        props = write_devices(tmp / "devices", infos, lacking)
        end_ms = int(time.time() * 1000)
        log(f"building {args.hours} h of backlog for {args.gpus} GPUs")
        built = build_backlog(tmp / "data", infos, props, args.hours, end_ms)
        expected: dict[tuple[str, str], int] = built.pop("expected")
        log(
            f"backlog: {built['samples']} samples in {built['rows']} rows, {built['payload_bytes']} payload bytes, "
            f"built in {built['build_s']} s"
        )
        want = {(s, naming.device_label(k)): n for (s, k), n in expected.items()}
        want_total = sum(want.values())
        want_probe = {d: n for (s, d), n in want.items() if s == PROBE_SERIES}

        broker = Mosquitto(tmp)
        broker.start()
        prom = Prometheus(tmp, ooo_window=f"{math.ceil(args.hours) + 1}h")
        prom.start()
        bridge_port = free_port()
        bridge_url = f"http://127.0.0.1:{bridge_port}"
        bridge_log = (tmp / "bridge.log").open("ab")
        bridge = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mapper.cli",
                "bridge",
                "--mqtt",
                broker.url,
                "--remote-write",
                prom.write_url,
                "--mqtt-client-id",
                "bench-backlog-bridge",
                "--metrics-addr",
                f"127.0.0.1:{bridge_port}",
                "--spool-dir",
                str(tmp / "spool"),
                "--log-level",
                "INFO",
            ],
            stdout=bridge_log,
            stderr=bridge_log,
            cwd=ROOT,
        )
        procs.append(bridge)
        wait_metric(bridge_url, "gpu_mapper_bridge_mqtt_connected", 1.0, 60, "the bridge's connection")

        link = Forwarder(broker.port, args.link_kbit)
        metrics_port = free_port()
        mapper_url = f"http://127.0.0.1:{metrics_port}"
        exe = shutil.which("gpu-mapper", path=str(Path(sys.executable).parent)) or "gpu-mapper"
        mapper_log = (tmp / "mapper.log").open("ab")
        mapper = subprocess.Popen(
            [
                exe,
                "run",
                "--sim",
                str(args.gpus),
                "--sim-profile",
                PROFILE,
                "--sim-seed",
                str(SIM_SEED),
                "--sim-scenario",
                "training",
                "--sim-cost",
                SIM_COST,
                "--node-name",
                NODE,
                "--devices",
                str(tmp / "devices"),
                "--mqtt",
                f"mqtt://127.0.0.1:{link.port}",
                "--mqtt-eventbus",
                "false",
                "--data-dir",
                str(tmp / "data"),
                "--metrics-addr",
                f"127.0.0.1:{metrics_port}",
                "--log-level",
                "INFO",
            ],
            stdout=mapper_log,
            stderr=mapper_log,
            cwd=ROOT,
        )
        procs.append(mapper)
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(mapper_url + "/readyz", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if mapper.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"backlog: the mapper did not get ready; see {tmp / 'mapper.log'}")
            time.sleep(0.2)
        mapper_started_s = time.time()
        time.sleep(LINK_DOWN_S)

        backlog_end_s = built["last_ms"] / 1000
        pids = {"mapper": mapper.pid, "bridge": bridge.pid, "prometheus": prom.proc.pid, "mosquitto": broker.proc.pid}
        cpu0 = {k: cpu_s(p) for k, p in pids.items()}
        link.up = True
        t0 = time.monotonic()
        t0_wall = time.time()
        log("the link is up")
        timeout_s = args.timeout_s
        probe_done_s = all_done_s = verify_started_s = live_after_link_s = None
        live_lags: list[float] = []
        found: dict[tuple[str, str], int] = {}
        next_poll = t0
        while time.monotonic() - t0 < timeout_s:
            time.sleep(max(0.0, next_poll - time.monotonic()))
            next_poll = max(next_poll + args.poll_s, time.monotonic())
            if mapper.poll() is not None or bridge.poll() is not None:
                raise SystemExit(f"backlog: the mapper or the bridge exited; logs in {tmp}")
            # Live telemetry: how old the newest live sample in Prometheus is (none yet: everything the mapper
            # sampled since it started waits), and when a sample taken after t0 is queryable.
            newest = newest_live_s(prom, backlog_end_s)
            live_lags.append(time.time() - (newest if newest is not None else mapper_started_s))
            if live_after_link_s is None and newest is not None and newest > t0_wall:
                live_after_link_s = time.monotonic() - t0
            if probe_done_s is None:
                got = counts_by_device(prom, PROBE_SERIES, built["first_ms"], built["last_ms"])
                if all(got.get(d, 0) >= n for d, n in want_probe.items()):
                    probe_done_s = time.monotonic() - t0
            if probe_done_s is not None and all_done_s is None:
                # Every series counted: the time is the end of the pass that found all of them (an upper bound:
                # the pass itself takes seconds over a day of samples).
                started = time.monotonic() - t0
                found = {}
                for series in sorted({s for s, _ in want}):
                    for d, n in counts_by_device(prom, series, built["first_ms"], built["last_ms"]).items():
                        found[(series, d)] = n
                if all(found.get(k, 0) >= n for k, n in want.items()):
                    all_done_s, verify_started_s = time.monotonic() - t0, started
                    cpu1 = {k: cpu_s(p) for k, p in pids.items()}
            if all_done_s is not None and live_after_link_s is not None:
                break
        link_bytes = dict(link.bytes)
        reconnect_s = None if link.first_connection_at is None else link.first_connection_at - t0
        if all_done_s is None:
            cpu1 = {k: cpu_s(p) for k, p in pids.items()}
        newest = newest_live_s(prom, backlog_end_s)
        live_lag_end = None if newest is None else time.time() - newest
        live_samples = prom.query(
            f'sum(count_over_time({PROBE_SERIES}{{node="{NODE}"}}[{math.ceil(time.time() - backlog_end_s)}s]))',
            time.time(),
        )
        bridge_counters = {
            name: metric(bridge_url, f"gpu_mapper_bridge_{name}_total")
            for name in (
                "samples_written",
                "batches_written",
                "duplicate_batches",
                "duplicate_samples",
                "identity_unknown_batches",
                "refused_samples",
            )
        }
        if not found:
            for series in sorted({s for s, _ in want}):
                for d, n in counts_by_device(prom, series, built["first_ms"], built["last_ms"]).items():
                    found[(series, d)] = n
        mapper.send_signal(signal.SIGTERM)
        mapper_rc = mapper.wait(30)
        replay = re.search(r"replay done: (\d+) batches \((\d+) bytes\) in ([\d.]+)s", (tmp / "mapper.log").read_text())
    except BaseException:
        args.keep = True
        log(f"failed; logs kept in {tmp}")
        raise
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)
        if link is not None:
            link.close()
        if prom is not None:
            prom.stop()
        if broker is not None:
            broker.stop()
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)

    found_total = sum(found.values())
    lost = sum(max(0, n - found.get(k, 0)) for k, n in want.items())
    duplicated = sum(max(0, found.get(k, 0) - n) for k, n in want.items()) + sum(
        n for k, n in found.items() if k not in want
    )
    result: dict[str, Any] = {
        "benchmark": "backlog",
        "sim_cost": SIM_COST,
        "measured_on": f"simulator ({PROFILE}, cost profile {SIM_COST}), streamgen's values, real mosquitto, bridge, "
        "Prometheus",
        "gpus": args.gpus,
        "offline_hours": args.hours,
        "link_kbit_per_s": args.link_kbit,
        "backlog": {k: v for k, v in built.items() if k not in ("first_ms", "last_ms")},
        "samples_expected": want_total,
        "samples_found": found_total,
        "lost": lost,
        "duplicated": duplicated,
        "off_by_series": {
            f"{series} {d}": found.get((series, d), 0) - n
            for (series, d), n in sorted(want.items())
            if found.get((series, d), 0) != n
        },
        "reconnect_s": None if reconnect_s is None else round(reconnect_s, 2),
        "replay": None
        if replay is None
        else {"batches": int(replay[1]), "bytes": int(replay[2]), "s": float(replay[3]), "as_the_mapper_logs_it": True},
        "probe_series_queryable_s": None if probe_done_s is None else round(probe_done_s, 1),
        "all_queryable_s": None if all_done_s is None else round(all_done_s, 1),
        "all_queryable_pass_started_s": None if verify_started_s is None else round(verify_started_s, 1),
        "cpu_s_until_queryable": {k: round(cpu1[k] - cpu0[k], 1) for k in cpu0},
        "link_bytes_until_queryable": link_bytes,
        "link_kbit_per_s_used": None
        if not all_done_s
        else round((link_bytes["up"] + link_bytes["down"]) * 8 / 1000 / all_done_s, 1),
        "live_after_link_s": None if live_after_link_s is None else round(live_after_link_s, 1),
        "live_lag_s_max": round(max(live_lags), 1) if live_lags else None,
        "live_lag_s_median": round(sorted(live_lags)[len(live_lags) // 2], 1) if live_lags else None,
        "live_lag_s_end": None if live_lag_end is None else round(live_lag_end, 1),
        "live_probe_samples": int(float(live_samples[0]["value"][1])) if live_samples else 0,
        "bridge": bridge_counters,
        "mapper_exit": mapper_rc,
        "target_s": TARGET_S,
        "target_met": all_done_s is not None and all_done_s <= TARGET_S and lost == 0 and duplicated == 0,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, python {platform.python_version()}",
    }
    if args.keep:
        result["kept"] = str(tmp)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hours", type=float, default=24.0, help="hours offline (default 24)")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--link-kbit", type=float, default=1000.0, help="the link's rate each way (default 1000)")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="give up this long after the link is up")
    ap.add_argument("--poll-s", type=float, default=2.0, help="how often Prometheus is asked")
    ap.add_argument("--smoke", action="store_true", help="1 GPU, 6 minutes of backlog")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs, data dir)")
    args = ap.parse_args()
    if args.smoke:
        args.gpus, args.hours, args.timeout_s, args.poll_s = 1, 0.1, 120.0, 0.5
    print(json.dumps(run(args)))


if __name__ == "__main__":
    main()
