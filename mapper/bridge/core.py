"""The bridge's logic without I/O (pure): telemetry batches -> remote-write series, dedup by sequence ranges,
the bridge's counters.

* ``Converter`` turns a decoded batch into samples of ``PendingRequest`` series, named and labelled by
  ``mapper.shared.naming`` (the table the mapper's own ``/metrics`` uses): catalog properties with a Prometheus name as
  ``value * prom_scale``; ``clock_event_reasons`` as ``gpu_clock_event_reason_active{reason}`` 0/1 per bit;
  ``compute_mode`` as ``gpu_compute_mode{mode}``; ``product_name`` as ``gpu_info{product_name}`` 1;
  ``policy_state`` as ``gpu_mapper_policy_state{state}`` 1. Labels ``uuid``, ``device`` (the Device name
  without its namespace, as ``/metrics``), ``node``, and from the GPU's ``GpuIdentity`` (the retained state
  message, ``mapper.wire.state.parse_state``) ``gpu`` (the NVML index) and ``gpu_info``'s ``driver_version`` and
  ``pci_bus_id``; a label the identity does not give is left out. Non-finite values are skipped (as ``/metrics``
  does).
* ``Converter.add_status`` turns the status a state message carries (``DeviceStatus``) into samples at the time
  the snapshot was taken: ``gpu_mapper_device_state{state}`` 0/1 for every state, ``gpu_xid_errors_total{xid}``,
  ``gpu_power_limit_desired_watts`` and the health families (``naming.health_samples``).
* A batch of a node stream (device ``naming.NODE_DEVICE``: the mapper's own series, each telemetry series name a
  ``naming.sample_key``) becomes the ``gpu_mapper_*`` series of ``naming.NODE_FAMILIES``, labelled ``node`` and
  the family's labels; a name that is no sample of those families (a newer mapper's) is skipped.
* Every series is labelled ``job="gpu-mapper-bridge"`` (``naming.BRIDGE_JOB``): a store that also scrapes the
  mapper tells the two copies apart by it.
* ``SeqDedup`` remembers, per (node, device, boot id, topic), the sequence ranges already written (with their
  time ranges), so that a batch seen again is dropped; the bridge checks a merged batch part by part (each part
  is a batch it replaced, ``DecodedBatch.split``), so it contributes only the batches not written yet. A batch is
  a duplicate only when its sequence number was written AND its samples lie in the time range written under it
  (``seen``): a sequence number used again for other data (a mapper that restarted a stream's numbering under the
  same boot id) is written, never dropped. ``observe`` says when a stream's sequence goes backwards (a number at
  or below the highest seen, with newer samples: a new epoch of the stream, whose ranges are kept apart from the
  old ones) or jumps (more than ``gap_tolerance`` past the highest seen). Memory is bounded: at most
  ``max_ranges`` ranges per epoch (the oldest forgotten first), ``max_epochs`` epochs per stream and
  ``max_streams`` streams (least recently used forgotten first); forgetting can only let a duplicate through,
  which a receiver takes as a no-op (same timestamp, same value).
"""

from __future__ import annotations

import bisect
import math
import struct
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from mapper.bridge.remotewrite import MetricType, SeriesBuf, label_bytes, sample_affixes, sorted_labels
from mapper.shared import naming
from mapper.shared.model import DEVICE_STATES
from mapper.wire.state import NO_IDENTITY, DeviceStatus, GpuIdentity
from mapper.wire.telemetry import DecodedBatch

_PACK_DOUBLE = struct.Struct("<d").pack

# Handler kinds of the conversion table.
_PLAIN, _REASONS, _MODE, _INFO, _POLICY, _STATE, _XID, _DESIRED = range(8)
# Table keys of the status series (no property has a name like these).
_STATE_KEY, _XID_KEY, _DESIRED_KEY = "@device_state", "@xid_errors", "@power_limit_desired"
# Series ids of the health series (with the family name and label values) and of the node stream's (its name).
_HEALTH_KEY, _NODE_KEY = "@health", "@node"


def _metric_type(t: naming.FamilyType) -> MetricType:
    """The remote-write type of a family's samples (a histogram's buckets, sum and count go as ``unknown``)."""
    return "unknown" if t == "histogram" else t


@dataclass(frozen=True)
class _Template:
    """What a series of one stream keeps between requests: its labels, their 1.0 bytes, type and help."""

    labels: tuple[tuple[str, str], ...]
    labels_v1: bytes
    mtype: MetricType
    help: str


_Base = tuple[str, str, str, GpuIdentity]  # node, device, uuid, identity: what labels every series of a GPU


class PendingRequest:
    """The series of one remote-write request being built, and the messages whose samples are in it."""

    def __init__(self, created_s: float) -> None:
        self.created_s = created_s
        #: (node, device, uuid, identity) -> series id -> SeriesBuf
        self.streams: dict[_Base, dict[Any, SeriesBuf]] = {}
        self.samples = 0
        self.messages: list[Any] = []
        #: Copies of messages already in this request, acknowledged when it is written.
        self.riders: list[Any] = []

    def series(self) -> list[SeriesBuf]:
        return [buf for bufs in self.streams.values() for buf in bufs.values()]


def _table() -> dict[str, tuple[int, Any, str, MetricType, str]]:
    """property name -> (kind, series id seed, series name, type, help), from the naming table."""
    out: dict[str, tuple[int, Any, str, MetricType, str]] = {}
    for ps in naming.PROPERTY_SERIES:
        f = ps.family
        out[ps.spec.name] = (_PLAIN, ps.scale, f.series_name, _metric_type(f.type), f.doc)
    r, m, i, p = naming.CLOCK_EVENT_REASON, naming.COMPUTE_MODE, naming.GPU_INFO, naming.POLICY_STATE
    t = _metric_type
    out[naming.CLOCK_EVENT_REASONS_PROPERTY] = (_REASONS, None, r.series_name, t(r.type), r.doc)
    out[naming.COMPUTE_MODE_PROPERTY] = (_MODE, None, m.series_name, t(m.type), m.doc)
    out[naming.PRODUCT_NAME_PROPERTY] = (_INFO, None, i.series_name, t(i.type), i.doc)
    out[naming.POLICY_STATE_PROPERTY] = (_POLICY, None, p.series_name, t(p.type), p.doc)
    s, x, d = naming.DEVICE_STATE, naming.XID_ERRORS, naming.DESIRED_POWER_LIMIT
    out[_STATE_KEY] = (_STATE, None, s.series_name, t(s.type), s.doc)
    out[_XID_KEY] = (_XID, None, x.series_name, t(x.type), x.doc)
    out[_DESIRED_KEY] = (_DESIRED, None, d.series_name, t(d.type), d.doc)
    for series, f in naming.PROCESS_GPU_SERIES.items():
        out[series] = (_PLAIN, 1.0, f.series_name, t(f.type), f.doc)
    return out


#: The health families a state message gives (``naming.health_samples``).
_HEALTH_FAMILIES = (
    naming.HEALTH_STATUS,
    naming.HEALTH_SUBSYSTEM,
    naming.HEALTH_CHECK,
    naming.HEALTH_PROBE_LATENCY,
    naming.HEALTH_PROBE_SUCCESS,
    naming.HEALTH_PROBES,
    naming.INFOROM_INFO,
)


def series_types() -> dict[str, MetricType]:
    """Every series name the bridge can write -> its type (for the OpenMetrics export)."""
    types = {name: mtype for _, _, name, mtype, _ in _table().values()}
    families = (*naming.POD_TELEMETRY_FIELDS.values(), naming.LEAK_SUSPECTED, *_HEALTH_FAMILIES)
    types.update({f.series_name: _metric_type(f.type) for f in families})
    types.update({name: _metric_type(f.type) for name, f in naming.node_sample_families().items()})
    return types


def bridged_series_names() -> frozenset[str]:
    """Every series name the bridge writes (the GPU series a bridged store holds)."""
    return frozenset(series_types())


class Converter:
    """Decoded batches -> samples in a ``PendingRequest``. Keeps the label bytes of every series it has made
    (at most ``max_series``; then it starts afresh)."""

    def __init__(self, max_series: int = 200_000) -> None:
        self.max_series = max_series
        self._table = _table()
        self._templates: dict[tuple[_Base, Any], _Template] = {}
        #: Workload series (``naming.pod_series`` names) -> their handler and extra labels; at most
        #: ``max_series`` (then it starts afresh).
        self._pods: dict[str, tuple[int, Any, str, MetricType, str, dict[str, str]]] = {}
        #: Node stream series names -> (series name, type, help, labels after node), None for one that is no
        #: sample of the mapper's own families; at most ``max_series`` (then it starts afresh).
        self._nodes: dict[str, tuple[str, MetricType, str, dict[str, str]] | None] = {}
        self._extra_label = {
            _REASONS: naming.CLOCK_EVENT_REASON.labels[0],
            _MODE: naming.COMPUTE_MODE.labels[0],
            _INFO: naming.GPU_INFO.labels[0],
            _POLICY: naming.POLICY_STATE.labels[0],
            _STATE: naming.DEVICE_STATE.labels[0],
            _XID: naming.XID_ERRORS.labels[0],
        }
        # gpu_info's labels after product_name, as the identity gives them.
        self._info_labels = naming.GPU_INFO.labels[1:]
        assert self._info_labels == ("driver_version", "pci_bus_id"), "GpuIdentity fills these two"

    @staticmethod
    def _base_labels(base: _Base) -> dict[str, str]:
        """The labels every series of ``base`` carries: a GPU's, or the node alone for a node stream."""
        node, device, uuid, ident = base
        if device == naming.NODE_DEVICE:
            return {naming.NODE_LABEL: node, "job": naming.BRIDGE_JOB}
        return {
            "device": naming.device_label(device),
            "node": node,
            "uuid": uuid,
            "gpu": ident.gpu,
            "job": naming.BRIDGE_JOB,
        }

    def _template(
        self, key: tuple[_Base, Any], name: str, labels: dict[str, str], mtype: MetricType, doc: str
    ) -> _Template:
        if len(self._templates) >= self.max_series:
            self._templates = {}
        pairs = sorted_labels(name, labels)
        t = self._templates[key] = _Template(pairs, label_bytes(pairs), mtype, doc)
        return t

    @staticmethod
    def _new_buf(t: _Template, sid: Any, bufs: dict[Any, SeriesBuf]) -> SeriesBuf:
        buf = SeriesBuf.__new__(SeriesBuf)
        buf.labels, buf.labels_v1, buf.mtype, buf.help = t.labels, t.labels_v1, t.mtype, t.help
        buf.stamps, buf.parts, buf.last_ts, buf.unsorted = [], [], -(1 << 63), False
        bufs[sid] = buf
        return buf

    def _named_buf(
        self,
        base: _Base,
        sid: Any,
        bufs: dict[Any, SeriesBuf],
        name: str,
        mtype: MetricType,
        doc: str,
        extra: dict[str, str],
    ) -> SeriesBuf:
        """The buffer of a series named outside the conversion table (health, the node stream's)."""
        key = (base, sid)
        t = self._templates.get(key)
        if t is None:
            t = self._template(key, name, {**self._base_labels(base), **extra}, mtype, doc)
        return self._new_buf(t, sid, bufs)

    def _buf(self, base: _Base, sid: Any, bufs: dict[Any, SeriesBuf]) -> SeriesBuf:
        key = (base, sid)
        t = self._templates.get(key)
        if t is None:
            _, _, _, ident = base
            prop, extra = (sid, None) if isinstance(sid, str) else sid
            entry = self._table.get(prop)
            labels = self._base_labels(base)
            if entry is None:  # a workload series (``_pod``)
                kind, _, name, mtype, doc, who = self._pods[prop]
                labels.update(who)
            else:
                kind, _, name, mtype, doc = entry
            if extra is not None:
                labels[self._extra_label[kind]] = extra
            if kind == _INFO:
                labels.update(zip(self._info_labels, (ident.driver_version, ident.pci_bus_id), strict=True))
            t = self._template(key, name, labels, mtype, doc)
        return self._new_buf(t, sid, bufs)

    def add(
        self,
        req: PendingRequest,
        batch: DecodedBatch,
        uuid: str,
        ident: GpuIdentity = NO_IDENTITY,
    ) -> int:
        """Add the batch's samples (labelled with ``uuid`` and ``ident``); the number of samples added."""
        base = (batch.node, batch.device, uuid, ident)
        bufs = req.streams.get(base)
        if bufs is None:
            bufs = req.streams[base] = {}
        if batch.device == naming.NODE_DEVICE:
            return self._add_node(req, batch, base, bufs)
        table = self._table
        pack = _PACK_DOUBLE
        isfinite = math.isfinite
        added = 0
        for row in batch.samples:
            ts = row.ts_ms
            head, tail = sample_affixes(ts)
            for name, v in row.values.items():
                h: tuple[Any, ...] | None = table.get(name)
                if h is None:
                    h = self._pod(name)
                    if h is None:
                        continue
                kind = h[0]
                if kind == _PLAIN:
                    cls = v.__class__
                    if cls is float:
                        if not isfinite(v):  # type: ignore[arg-type]
                            continue
                        x = v * h[1]
                    elif cls is int:
                        x = v * h[1]
                    elif cls is bool:
                        x = h[1] if v else 0.0
                    else:
                        continue
                    buf = bufs.get(name)
                    if buf is None:
                        buf = self._buf(base, name, bufs)
                    if ts <= buf.last_ts:
                        buf.unsorted = True
                    else:
                        buf.last_ts = ts
                    buf.stamps.append(ts)
                    buf.parts.append(head + pack(x) + tail)
                    added += 1
                    continue
                for extra, x in self._derived(kind, v):
                    self._append(base, (name, extra), bufs, ts, head + pack(x) + tail)
                    added += 1
        req.samples += added
        return added

    def add_status(
        self, req: PendingRequest, node: str, status: DeviceStatus, uuid: str, ident: GpuIdentity = NO_IDENTITY
    ) -> int:
        """Add the status of a state message at the time it was taken (nothing without ``at_ms``); the number of
        samples added."""
        if status.at_ms is None:
            return 0
        base = (node, status.device, uuid, ident)
        bufs = req.streams.get(base)
        if bufs is None:
            bufs = req.streams[base] = {}
        values: list[tuple[Any, float]] = []
        if status.state:
            values += [((_STATE_KEY, s), 1.0 if s == status.state else 0.0) for s in DEVICE_STATES]
        values += [((_XID_KEY, code), float(n)) for code, n in status.xid_errors]
        if status.power_limit_desired_w is not None:
            values.append((_DESIRED_KEY, status.power_limit_desired_w))
        ts = status.at_ms
        head, tail = sample_affixes(ts)
        for sid, x in values:
            self._append(base, sid, bufs, ts, head + _PACK_DOUBLE(x) + tail)
        added = len(values)
        h = status.health
        if h is not None:
            for family, extra, x in naming.health_samples(
                h.levels, h.subsystems, h.checks, h.probe, h.probes, h.inforom
            ):
                sid = (_HEALTH_KEY, family.name, extra)
                buf = bufs.get(sid)
                if buf is None:
                    labels = dict(zip(family.labels, extra, strict=True))
                    name, mtype = family.series_name, _metric_type(family.type)
                    buf = self._named_buf(base, sid, bufs, name, mtype, family.doc, labels)
                self._push(buf, ts, head + _PACK_DOUBLE(x) + tail)
                added += 1
        req.samples += added
        return added

    def _add_node(self, req: PendingRequest, batch: DecodedBatch, base: _Base, bufs: dict[Any, SeriesBuf]) -> int:
        """A node stream's batch: its samples of the mapper's own families; the number added."""
        nodes = self._nodes
        added = 0
        for row in batch.samples:
            ts = row.ts_ms
            head, tail = sample_affixes(ts)
            for key, v in row.values.items():
                x = naming.number(v)
                if x is None:
                    continue
                sid = (_NODE_KEY, key)
                buf = bufs.get(sid)
                if buf is None:
                    if key not in nodes:
                        if len(nodes) >= self.max_series:
                            nodes.clear()
                        found = naming.node_sample(key)
                        nodes[key] = (
                            None
                            if found is None
                            else (found[1], _metric_type(found[0].type), found[0].doc, dict(found[2]))
                        )
                    h = nodes[key]
                    if h is None:
                        continue
                    buf = self._named_buf(base, sid, bufs, h[0], h[1], h[2], h[3])
                self._push(buf, ts, head + _PACK_DOUBLE(x) + tail)
                added += 1
        req.samples += added
        return added

    @staticmethod
    def _push(buf: SeriesBuf, ts: int, part: bytes) -> None:
        if ts <= buf.last_ts:
            buf.unsorted = True
        else:
            buf.last_ts = ts
        buf.stamps.append(ts)
        buf.parts.append(part)

    def _append(self, base: _Base, sid: Any, bufs: dict[Any, SeriesBuf], ts: int, part: bytes) -> None:
        """One encoded sample at ``ts`` onto series ``sid``'s buffer (made on first use). ``add``'s plain values
        do the same inline: that loop runs once per sample."""
        buf = bufs.get(sid)
        if buf is None:
            buf = self._buf(base, sid, bufs)
        if ts <= buf.last_ts:
            buf.unsorted = True
        else:
            buf.last_ts = ts
        buf.stamps.append(ts)
        buf.parts.append(part)

    def _pod(self, name: str) -> tuple[int, Any, str, MetricType, str, dict[str, str]] | None:
        """The handler of a workload series (``naming.pod_series``: ``gpu_pod_*{namespace,pod,container}``; or
        ``naming.leak_series``: ``gpu_process_memory_leak_suspected{pid,namespace,pod,container}``), None for any
        other name the table does not know."""
        h = self._pods.get(name)
        if h is None:
            parsed = naming.parse_pod_series(name)
            if parsed is not None:
                f, namespace, pod, container = parsed
                who = dict(zip(naming.POD_LABELS, (namespace, pod, container), strict=True))
            else:
                leak = naming.parse_leak_series(name)
                if leak is None:
                    return None
                f, who = naming.LEAK_SUSPECTED, dict(zip(naming.PROCESS_LABELS, leak, strict=True))
            if len(self._pods) >= self.max_series:
                self._pods = {}
            h = self._pods[name] = (_PLAIN, 1.0, f.series_name, _metric_type(f.type), f.doc, who)
        return h

    @staticmethod
    def _derived(kind: int, v: object) -> list[tuple[str, float]]:
        if kind == _REASONS:
            mask = naming.number(v)
            if mask is None:
                return []
            return [(reason, float(flag)) for reason, flag in naming.clock_event_reason_flags(int(mask))]
        if kind == _MODE:
            return [(m, float(flag)) for m, flag in naming.compute_mode_flags(v)] if isinstance(v, str) else []
        if isinstance(v, str) and v:  # _INFO (product name), _POLICY (policy state)
            return [(v, 1.0)]
        return []


# --------------------------------------------------------------------------------------------------
# Dedup by sequence ranges
# --------------------------------------------------------------------------------------------------

StreamKey = tuple[str, str, str, str]  # node, device, boot id, topic
#: What ``SeqDedup.observe`` reports of a batch whose sequence number does not follow on.
SEQUENCE_ANOMALIES = ("backwards", "gap")
#: A jump of more sequence numbers than this past the highest seen is a gap. The mapper publishes up to 20
#: batches at once and a replay after a cut may reorder them; replicas of one group each see only their share.
DEFAULT_GAP_TOLERANCE = 64


class _Epoch:
    """One numbering of a stream: its written ranges, sorted, disjoint, non-adjacent ``[seq_lo, seq_hi, ts_lo,
    ts_hi]``, and the highest sequence number seen in it with its last sample time."""

    __slots__ = ("ranges", "top_seq", "top_ts")

    def __init__(self, top_seq: int = -1, top_ts: int = -(1 << 62)) -> None:
        self.ranges: list[list[int]] = []
        self.top_seq = top_seq
        self.top_ts = top_ts


class SeqDedup:
    """Sequence ranges already written, per stream and epoch, each with the time range of its samples."""

    def __init__(
        self,
        max_streams: int = 100_000,
        max_ranges: int = 64,
        *,
        max_epochs: int = 4,
        gap_tolerance: int = DEFAULT_GAP_TOLERANCE,
    ) -> None:
        if max_streams < 1 or max_ranges < 1 or max_epochs < 1 or gap_tolerance < 0:
            raise ValueError("SeqDedup needs max_streams, max_ranges, max_epochs >= 1 and gap_tolerance >= 0")
        self.max_streams = max_streams
        self.max_ranges = max_ranges
        self.max_epochs = max_epochs
        self.gap_tolerance = gap_tolerance
        #: key -> the stream's epochs, oldest first (the last is the current one)
        self._streams: OrderedDict[StreamKey, list[_Epoch]] = OrderedDict()
        self.forgotten_ranges = 0
        self.forgotten_streams = 0
        self.forgotten_epochs = 0

    def __len__(self) -> int:
        return len(self._streams)

    def _epochs(self, key: StreamKey) -> list[_Epoch]:
        epochs = self._streams.get(key)
        if epochs is None:
            epochs = self._streams[key] = [_Epoch()]
            if len(self._streams) > self.max_streams:
                self._streams.popitem(last=False)
                self.forgotten_streams += 1
        else:
            self._streams.move_to_end(key)
        return epochs

    def check(self, key: StreamKey, lo: int, hi: int) -> tuple[bool, list[tuple[int, int]]]:
        """(every sequence of lo..hi already written in the current epoch, the time ranges of the written ranges
        that overlap it). By number alone: ``seen`` is the duplicate test."""
        epochs = self._streams.get(key)
        if not epochs or not epochs[-1].ranges:
            return False, []
        self._streams.move_to_end(key)
        ranges = epochs[-1].ranges
        i = bisect.bisect_right(ranges, [hi, math.inf])
        overlap: list[tuple[int, int]] = []
        covered = False
        for r in reversed(ranges[:i]):
            if r[1] < lo:
                break
            if r[0] <= lo and r[1] >= hi:
                covered = True
            overlap.append((r[2], r[3]))
        return covered, overlap

    def seen(self, key: StreamKey, seq: int, ts_first: int, ts_last: int) -> bool:
        """Whether the batch ``seq`` with samples from ``ts_first`` to ``ts_last`` was written: its number is in a
        written range of some epoch AND its samples lie in that range's time range. The same number with other
        data is not a duplicate."""
        epochs = self._streams.get(key)
        if not epochs:
            return False
        self._streams.move_to_end(key)
        for epoch in reversed(epochs):
            ranges = epoch.ranges
            i = bisect.bisect_right(ranges, [seq, math.inf])
            if i and ranges[i - 1][1] >= seq:
                r = ranges[i - 1]
                if r[2] <= ts_first and ts_last <= r[3]:
                    return True
        return False

    def observe(self, key: StreamKey, seq: int, ts_first: int, ts_last: int) -> tuple[str | None, int, object]:
        """A batch that is not a duplicate (``seen`` said so) is accepted: (its anomaly, the highest sequence seen
        before it, the epoch to ``record`` it in). ``backwards``: its number is at or below the highest seen and
        its samples are newer than that batch's, or its number was written with other samples: the stream's
        numbering started again, and a new epoch begins (the old ranges are kept apart, so neither numbering's
        batches are taken for the other's). ``gap``: more than ``gap_tolerance`` numbers past the highest seen.
        Otherwise None (the next number, or one within the window a replay may reorder)."""
        epochs = self._epochs(key)
        cur = epochs[-1]
        before = cur.top_seq
        if cur.top_seq >= 0 and seq <= cur.top_seq and (ts_first > cur.top_ts or self._written(cur, seq)):
            cur = _Epoch(seq, ts_last)
            epochs.append(cur)
            if len(epochs) > self.max_epochs:
                epochs.pop(0)
                self.forgotten_epochs += 1
            return "backwards", before, cur
        anomaly = "gap" if cur.top_seq >= 0 and seq > cur.top_seq + 1 + self.gap_tolerance else None
        if seq > cur.top_seq:
            cur.top_seq, cur.top_ts = seq, ts_last
        return anomaly, before, cur

    @staticmethod
    def _written(epoch: _Epoch, seq: int) -> bool:
        i = bisect.bisect_right(epoch.ranges, [seq, math.inf])
        return bool(i) and epoch.ranges[i - 1][1] >= seq

    def record(self, key: StreamKey, lo: int, hi: int, ts_lo: int, ts_hi: int, epoch: object = None) -> None:
        """lo..hi (samples from ts_lo to ts_hi) is written, in ``epoch`` (``observe``'s; default: the current
        one)."""
        epochs = self._epochs(key)
        target = epoch if isinstance(epoch, _Epoch) and any(e is epoch for e in epochs) else epochs[-1]
        if lo > target.top_seq:
            target.top_seq, target.top_ts = hi, ts_hi
        new = [lo, hi, ts_lo, ts_hi]
        keep: list[list[int]] = []
        for r in target.ranges:
            if r[1] + 1 < new[0] or r[0] > new[1] + 1:
                keep.append(r)
            else:  # overlapping or adjacent: merge
                new = [min(r[0], new[0]), max(r[1], new[1]), min(r[2], new[2]), max(r[3], new[3])]
        bisect.insort(keep, new)
        while len(keep) > self.max_ranges:
            keep.pop(0)
            self.forgotten_ranges += 1
        target.ranges = keep


# --------------------------------------------------------------------------------------------------
# Counters
# --------------------------------------------------------------------------------------------------

#: Write latency buckets (s) and lag buckets (s: a second to a week).
WRITE_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
LAG_BUCKETS_S = (1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0, 6 * 3600.0, 86400.0, 7 * 86400.0)


@dataclass
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, x: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, x)] += 1
        self.sum += x

    def cumulative(self) -> list[tuple[float, int]]:
        out, running = [], 0
        for bound, c in zip((*self.bounds, math.inf), self.counts, strict=True):
            running += c
            out.append((bound, running))
        return out


@dataclass
class BridgeStats:
    """Everything ``/metrics`` shows about the bridge (counters since start, gauges now)."""

    batches_received: int = 0
    samples_received: int = 0
    batches_written: int = 0
    samples_written: int = 0
    requests_written: int = 0
    duplicate_batches: int = 0
    duplicate_samples: int = 0
    #: Batches whose sequence number went backwards or jumped (``SEQUENCE_ANOMALIES``), by kind; written all the
    #: same.
    sequence_anomalies: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SEQUENCE_ANOMALIES, 0))
    decode_errors: int = 0
    uuid_unknown_batches: int = 0
    identity_unknown_batches: int = 0
    state_messages: int = 0
    state_messages_written: int = 0
    bad_state_messages: int = 0
    refused_requests: dict[str, int] = field(default_factory=dict)
    refused_samples: dict[str, int] = field(default_factory=dict)
    retries: dict[str, int] = field(default_factory=dict)
    spooled_requests: int = 0
    spool_failures: int = 0
    version_fallbacks: int = 0
    write_duration: Histogram = field(default_factory=lambda: Histogram(WRITE_BUCKETS_S))
    lag: Histogram = field(default_factory=lambda: Histogram(LAG_BUCKETS_S))
    # gauges
    pending_batches: int = 0
    pending_samples: int = 0
    mqtt_connected: bool = False
    remote_write_version: int = 1
    dedup_streams: int = 0
    last_write_lag_s: float = 0.0
