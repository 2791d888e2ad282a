"""``gpu-mapper status``: this node's GPUs and the mapper's backlog as a readable table. Pure text.

By default it fits ``WIDTH`` (120) columns: no UUID column, the health and desired-state cells in short, and
what they leave out (a health reason, which desired value is not applied, a cell cut to fit) on a line of its own
under the table; long lines are wrapped. ``wide``: every column in full, at any width.

The snapshot comes from the running mapper's ``/status`` (``mapper.edge.status.metrics.fetch_status``) or from the
status file in its data directory (``mapper.edge.status.metrics.read_status_file``); this module only renders it.
``console_table`` is the live per-GPU table ``gpu-mapper run --sim N`` prints (from the workers themselves).
"""

from __future__ import annotations

import datetime as _dt
import textwrap
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
#: The default (narrow) table's columns: no UUID, the cells of the last ones short.
_NARROW_COLUMNS = (
    "DEVICE",
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
#: Narrow columns whose cells may be cut to fit (with a note under the table giving them in full), in the order
#: they are cut: the first ones down to their heading before the next.
_FLEXIBLE = (("DESIRED", "POLICY", "HEALTH L1/L2/L3", "POD (namespace/pod/container)"), ("STATE",), ("DEVICE",))
_POD_COLUMNS = ("POD (namespace/pod/container)", "GPU", "POWER", "ENERGY", "GPU MEM", "SM", "PROCS")
#: The width the default view fits.
WIDTH = 120
#: Pods ``gpu-mapper status`` lists, the top ones by power over the node.
TOP_PODS = 10


def render_status(snapshot: MapperSnapshot, *, wide: bool = False) -> str:
    """A table of the node's GPUs (device, power vs cap, temperature, utilisation, memory, SM clock, state,
    health, desired status, policy state; ``wide``: the uuid too, and every cell in full) followed by the top
    pods, the buffer backlog and the links (MQTT, EdgeCore). Without ``wide`` no line is longer than ``WIDTH``."""
    s = snapshot
    width = None if wide else WIDTH
    lines: list[str] = []
    head = f"gpu-mapper {s.version or '?'} on node {s.node or '?'} ({s.mode})"
    if s.driver_version:
        head += f", NVIDIA driver {s.driver_version}"
    if s.taken_at_ms:
        head += f", as of {_utc(s.taken_at_ms)}"
    lines.extend(_wrap(head, width))
    lines.append("")
    if s.gpus:
        gpus = sorted(s.gpus, key=lambda g: (g.info.index, g.info.uuid))
        if wide:
            lines.extend(_table(_COLUMNS, [_gpu_row(g) for g in gpus]))
        else:
            notes: list[str] = []
            rows = [_narrow_gpu_row(g, notes) for g in gpus]
            lines.extend(_fitted_table(_NARROW_COLUMNS, rows, WIDTH, notes))
            for note in notes:
                lines.extend(_wrap(note, WIDTH))
    else:
        lines.append("no GPUs")
    lines.append("")
    pods = _pods(s, width)
    if pods:
        lines.extend(pods)
        lines.append("")
    for line in _backlog(s):
        lines.extend(_wrap(line, width))
    return "\n".join(lines) + "\n"


def _narrow_gpu_row(g: GpuSnapshot, notes: list[str]) -> list[str]:
    """A GPU's row of the narrow table: health without its reason, desired status as counts; what is left out
    goes to ``notes``."""
    row = _gpu_row(g)
    _device, _uuid, power_cap, temp, util, mem, sm, state, _health_text, desired, policy = row
    name = g.device or f"(no Device) {g.info.uuid[:12]}"
    h = g.health
    short = {"healthy": "ok", "degraded": "degraded", "unhealthy": "unhealthy"}
    health = f"{h.status} " + "/".join(short[h.level_status(level)] for level in (1, 2, 3))
    if h.status != "healthy":
        notes.append(f"{name}: health {_health(g)}")
    summary = _desired_summary(desired)
    if summary != desired and any(not part.endswith(":applied") for part in desired.split(",")):
        notes.append(f"{name}: desired " + desired.replace(",", ", "))
    if g.sample is None:
        state = "no sample yet" if g.state == "unknown" else f"{g.state}, no sample"
    return [name, power_cap, temp, util, mem, sm, state, health, summary, policy]


def _desired_summary(desired: str) -> str:
    """``power_limit:applied,locked_gpu_clocks:rejected-out-of-range`` as ``1 applied, 1 rejected``; a single
    group's status as it is."""
    parts = [p for p in desired.split(",") if ":" in p]
    if len(parts) <= 1:
        return desired
    counts: dict[str, int] = {}
    for part in parts:
        result = part.split(":", 1)[1].split("-", 1)[0]
        counts[result] = counts.get(result, 0) + 1
    order = ("rejected", "pending", "overridden", "applied")
    ranked = sorted(counts.items(), key=lambda kv: (order.index(kv[0]) if kv[0] in order else -1, kv[0]))
    return ", ".join(f"{n} {result}" for result, n in ranked)


def _fitted_table(
    columns: Sequence[str], rows: Sequence[Sequence[str]], width: int, notes: list[str], key: int = 0
) -> list[str]:
    """``_table``, its flexible columns cut (widest first, to no less than their heading) until every line fits
    ``width``; each cell cut is given in full in ``notes`` (named by the row's cell ``key``)."""
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]

    def total() -> int:
        return sum(widths) + 2 * (len(widths) - 1)

    for group in _FLEXIBLE:
        flexible = [i for i, c in enumerate(columns) if c in group]
        while total() > width:
            candidates = [i for i in flexible if widths[i] > max(len(columns[i]), 4)]
            if not candidates:
                break
            widest = max(candidates, key=lambda i: widths[i])
            widths[widest] -= 1
    cut_rows: list[list[str]] = []
    for r in rows:
        cells = list(r)
        for i, cell in enumerate(cells):
            if len(cell) > widths[i]:
                label = columns[i].split()[0].lower()
                notes.append(f"{label}: {cell}" if i == key else f"{r[key]}: {label} {cell}")
                cells[i] = cell[: widths[i] - 1] + "…"
        cut_rows.append(cells)
    return _table(columns, cut_rows, widths)


def _wrap(line: str, width: int | None) -> list[str]:
    if width is None or len(line) <= width:
        return [line]
    return textwrap.wrap(line, width, subsequent_indent="  ", break_on_hyphens=False) or [line]


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


def _pods(s: MapperSnapshot, width: int | None = None) -> list[str]:
    """The top pods (containers) by GPU power over the node, then each GPU's idle part and leaks; fitted to
    ``width`` when given."""
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
        if width is None:
            out.extend(_table(_POD_COLUMNS, rows))
        else:
            notes: list[str] = []
            out.extend(_fitted_table(_POD_COLUMNS, rows, width, notes))
            for note in notes:
                out.extend(_wrap(note, width))
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
        out.extend(_wrap(line, width))
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


def _table(columns: Sequence[str], rows: Sequence[Sequence[str]], widths: Sequence[int] | None = None) -> list[str]:
    if widths is None:
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
