"""``gpu-mapper status``: this node's GPUs and the mapper's backlog as a readable table. Pure text.

The snapshot comes from the running mapper's ``/status`` (``mapper.edge.status.metrics.fetch_status``) or from the
status file in its data directory (``mapper.edge.status.metrics.read_status_file``); this module only renders it.
``console_table`` is the live per-GPU table ``gpu-mapper run --sim N`` prints (from the workers themselves).
"""

from __future__ import annotations

import datetime as _dt
import time
from collections.abc import Iterable, Mapping, Sequence

from mapper.edge.control.collect import GpuWorker
from mapper.edge.status.stats import GpuSnapshot, MapperSnapshot
from mapper.shared.model import Value

_COLUMNS = (
    "DEVICE",
    "UUID",
    "POWER / CAP",
    "TEMP",
    "UTIL",
    "MEM",
    "SM CLOCK",
    "STATE",
    "HEALTH L1/L2/L3",
    "DESIRED",
    "POLICY",
)
_POD_COLUMNS = ("POD (namespace/pod/container)", "GPU", "POWER", "ENERGY", "GPU MEM", "SM", "PROCS")
#: Pods ``gpu-mapper status`` lists, the top ones by power over the node.
TOP_PODS = 10


def render_status(snapshot: MapperSnapshot) -> str:
    """A table of the node's GPUs (device, uuid, power vs cap, temperature, utilisation, desired status,
    policy state) followed by the buffer backlog and the links (MQTT, EdgeCore)."""
    s = snapshot
    lines: list[str] = []
    head = f"gpu-mapper {s.version or '?'} on node {s.node or '?'} ({s.mode})"
    if s.driver_version:
        head += f", NVIDIA driver {s.driver_version}"
    if s.taken_at_ms:
        head += f", as of {_utc(s.taken_at_ms)}"
    lines.append(head)
    lines.append("")
    if s.gpus:
        rows = [_gpu_row(g) for g in sorted(s.gpus, key=lambda g: (g.info.index, g.info.uuid))]
        lines.extend(_table(_COLUMNS, rows))
    else:
        lines.append("no GPUs")
    lines.append("")
    pods = _pods(s)
    if pods:
        lines.extend(pods)
        lines.append("")
    lines.extend(_backlog(s))
    return "\n".join(lines) + "\n"


def _gpu_row(g: GpuSnapshot) -> list[str]:
    device = g.device or "(no Device)"
    power = _num(g.value("power_usage"), 1)
    cap_value = g.value("power_limit_enforced")
    if cap_value is None:
        cap_value = g.value("power_limit")
    cap = _num(cap_value, 0)
    power_cap = f"{power} / {cap} W"
    desired = g.desired_power_limit_w
    if desired is not None and isinstance(cap_value, int | float) and abs(desired - float(cap_value)) >= 0.5:
        power_cap += f" (asked {_num(g.desired_power_limit_w, 0)})"
    temp = _unit(g.value("temperature"), " C")
    util = _unit(g.value("utilization_gpu"), " %")
    used, total = g.value("memory_used"), g.value("memory_total")
    mem = "-"
    if isinstance(used, int | float) and isinstance(total, int | float) and total:
        mem = f"{used / 2**30:.1f}/{total / 2**30:.0f} GiB"
    sm = _unit(g.value("clock_sm") if g.value("clock_sm") is not None else g.value("gpu_freq"), " MHz")  # Jetson
    state = g.state + " (no sample yet)" if g.sample is None else g.state
    return [
        device,
        g.info.uuid,
        power_cap,
        temp,
        util,
        mem,
        sm,
        state,
        _health(g),
        g.desired_status or "-",
        g.policy_state or "-",
    ]


def _pods(s: MapperSnapshot) -> list[str]:
    """The top pods (containers) by GPU power over the node, then each GPU's idle part and leaks."""
    if not s.workloads:
        return []
    names = {g.info.uuid: g.device_name or g.info.uuid for g in s.gpus}
    uses = [(w.uuid, p) for w in s.workloads for p in w.pods if p.processes or p.power_w > 0]
    uses.sort(key=lambda up: (-up[1].power_w, -up[1].memory_used_bytes, up[1].namespace, up[1].pod))
    out: list[str] = []
    if uses:
        rows = [
            [
                "/".join(x for x in (p.namespace, p.pod, p.container) if x) or "(host processes)",
                names.get(uuid, uuid),
                f"{p.power_w:.1f} W",
                _energy(p.energy_joules_total),
                f"{p.memory_used_bytes / 2**30:.1f} GiB",
                "-" if p.sm_ratio is None else f"{100 * p.sm_ratio:.0f} %",
                str(p.processes),
            ]
            for uuid, p in uses[:TOP_PODS]
        ]
        out.extend(_table(_POD_COLUMNS, rows))
        if len(uses) > TOP_PODS:
            out.append(f"... and {len(uses) - TOP_PODS} more")
    for w in s.workloads:
        line = (
            f"{names.get(w.uuid, w.uuid)}: {w.process_count} processes, idle {w.idle_power_w:.1f} W"
            f" ({w.idle_source}), idle energy {_energy(w.idle_joules_total)}"
        )
        if w.leaking_pids:
            line += ", LEAK SUSPECTED: pid " + ", ".join(str(pid) for pid in w.leaking_pids)
        if w.reason:
            line += f"; {w.reason}"
        out.append(line)
    return out


def _energy(joules: float) -> str:
    if joules >= 3.6e6:
        return f"{joules / 3.6e6:.2f} kWh"
    if joules >= 1000:
        return f"{joules / 1000:.1f} kJ"
    return f"{joules:.0f} J"


def _health(g: GpuSnapshot) -> str:
    """``healthy ok/ok/ok``, ``unhealthy ok/ok/unhealthy (probe-timeout-after-30s)``: the overall status, each
    level's, the worst finding's reason."""
    h = g.health
    short = {"healthy": "ok", "degraded": "degraded", "unhealthy": "unhealthy"}
    levels = "/".join(short[h.level_status(level)] for level in (1, 2, 3))
    text = f"{h.status} {levels}"
    return text if h.status == "healthy" else f"{text} ({h.reason})"


def _backlog(s: MapperSnapshot) -> list[str]:
    out: list[str] = []
    buf = f"buffer: {s.buffer_batches} batches, {_bytes(s.buffer_bytes)}"
    if s.buffer_max_bytes:
        buf += f" of {_bytes(s.buffer_max_bytes)} ({100.0 * s.buffer_bytes / s.buffer_max_bytes:.0f}% full)"
    if s.buffer_oldest_age_s is not None:
        buf += f", oldest unsent {_duration(s.buffer_oldest_age_s)} old"
    out.append(buf)
    drops = sum(s.buffer_drops.values())
    if drops:
        detail = ", ".join(f"{k} {v}" for k, v in sorted(s.buffer_drops.items()))
        out.append(f"dropped: {drops} batches ({detail})")
    if s.replay_remaining_batches:
        out.append(f"replay: {s.replay_remaining_batches} batches ({_bytes(s.replay_remaining_bytes)}) to send")
    if s.mqtt_enabled:
        mqtt = "connected" if s.mqtt_connected else "DISCONNECTED"
        out.append(f"mqtt: {mqtt}, {s.mqtt_reconnects} reconnects, {s.telemetry_published_batches} batches published")
    else:
        out.append("mqtt: off (no broker configured)")
    if s.mode == "standalone":
        out.append("edgecore: standalone mode (Devices from files)")
    else:
        out.append("edgecore: " + ("registered" if s.dmi_registered else "NOT REGISTERED"))
    rejected = sum(s.desired_rejections.values())
    if rejected:
        detail = ", ".join(f"{k} {v}" for k, v in sorted(s.desired_rejections.items()))
        out.append(f"desired values rejected: {rejected} ({detail})")
    out.extend(_push(s))
    return out


def _push(s: MapperSnapshot) -> list[str]:
    """One line per push or DB destination: its state, backlog, deliveries, drops and last error."""
    if not s.push_destinations:
        return []
    out = ["push destinations:"]
    for d in s.push_destinations:
        line = f"  {d.key}: {d.state.upper() if d.state in ('down', 'refused') else d.state}"
        line += f", {d.backlog_samples} waiting ({_bytes(d.backlog_bytes)}), {d.delivered_samples} delivered"
        drops = ", ".join(f"{reason} {n}" for reason, n in sorted(d.dropped.items()) if n)
        if drops:
            line += f", dropped: {drops}"
        if d.failures:
            line += f", {d.failures} failed tries"
        if not d.properties:
            line += ", no Device names it (delivering what it holds)"
        if d.last_error and d.state != "ok":
            line += f"; last error: {d.last_error[:160]}"
        out.append(line)
    return out


def _table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(cell.ljust(w) for cell, w in zip(cells, widths, strict=True)).rstrip()

    return [line(columns), *(line(r) for r in rows)]


def _num(v: Value | float | None, decimals: int) -> str:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return "-"
    return f"{float(v):.{decimals}f}"


def _unit(v: Value | None, unit: str) -> str:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return "-"
    return f"{v:g}{unit}" if isinstance(v, float) else f"{v}{unit}"


def _bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _utc(ms: int) -> str:
    return _dt.datetime.fromtimestamp(ms / 1000, tz=_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def console_table(node: str, workers: Iterable[GpuWorker], *, buffer_batches: int, mqtt: str) -> str:
    """The live table ``gpu-mapper run --sim N`` prints: one line per GPU. ``mqtt``: off, up or down."""
    lines = [
        time.strftime("%H:%M:%S") + f"  node {node}  buffer {buffer_batches} batches  mqtt {mqtt}",
        f"{'device':<22} {'power W':>9} {'cap W':>6} {'temp C':>6} {'util %':>6} {'sm MHz':>6} {'mem MHz':>7}"
        f"  {'state':<9} policy / desired",
    ]

    def num(values: Mapping[str, Value], name: str, digits: int = 0) -> str:
        x = values.get(name)
        return "-" if x is None else f"{float(x):.{digits}f}"

    for worker in workers:
        v = worker.values
        name = worker.device.name if worker.device is not None else worker.uuid[:22]
        lines.append(
            f"{name:<22} {num(v, 'power_usage', 1):>9} {num(v, 'power_limit'):>6} {num(v, 'temperature'):>6} "
            f"{num(v, 'utilization_gpu'):>6} {num(v, 'clock_sm' if 'clock_sm' in v else 'gpu_freq'):>6} "
            f"{num(v, 'clock_memory' if 'clock_memory' in v else 'emc_freq'):>7}  {worker.state:<9} "
            f"{worker.policy_state} {worker.desired_status}".rstrip()
        )
    return "\n".join(lines) + "\n\n"
