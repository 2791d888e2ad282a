"""Prometheus remote write on the wire (pure): protobuf by hand, snappy block format, OpenMetrics text.

The messages are those of ``proto/remote.proto`` (written from the specifications' field numbers): 1.0's
``prometheus.WriteRequest`` and, for the experimental ``--remote-write-version 2``, 2.0's
``io.prometheus.write.v2.Request``. They are encoded by hand because the bridge's hot path is "append one sample
to one series": a sample is the same 18 bytes in both versions (``Sample`` is field 2 of either ``TimeSeries``),
built once from the row's timestamp bytes and the value, and a request is a join of those. tests/test_remotewrite.py
checks the bytes against protoc's parser of ``proto/remote.proto``, and the bridge's tests against a real
Prometheus.

``SeriesBuf`` holds one series' samples of a request; ``encode_v1`` / ``encode_v2`` make the request body (sorted
per series by timestamp, one sample per timestamp), ``compress`` the snappy block (cramjam). ``decode_v1`` reads a
1.0 body back (the spool), and ``render_openmetrics`` turns decoded series into the OpenMetrics text that
``promtool tsdb create-blocks-from openmetrics`` takes.
"""

from __future__ import annotations

import itertools
import math
import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Literal

import cramjam

#: Request headers of each version (User-Agent is added by the sender).
V1_HEADERS = {
    "Content-Encoding": "snappy",
    "Content-Type": "application/x-protobuf",
    "X-Prometheus-Remote-Write-Version": "0.1.0",
}
V2_HEADERS = {
    "Content-Encoding": "snappy",
    "Content-Type": "application/x-protobuf;proto=io.prometheus.write.v2.Request",
    "X-Prometheus-Remote-Write-Version": "2.0.0",
}
#: What a 2.0 receiver answers with; its absence on a 2xx means the receiver only read the body as 1.0.
SAMPLES_WRITTEN_HEADER = "X-Prometheus-Remote-Write-Samples-Written"

MetricType = Literal["gauge", "counter", "unknown"]
_TYPE_CODE = {"unknown": 0, "counter": 1, "gauge": 2}

_PACK_DOUBLE = struct.Struct("<d").pack
_UNPACK_DOUBLE = struct.Struct("<d").unpack_from


class RemoteWriteFormatError(ValueError):
    """Bytes that are not a remote-write 1.0 request; the message says what was wrong."""


def uvarint(n: int) -> bytes:
    """Protobuf base-128 varint; a negative int64 as its 64-bit two's complement (10 bytes)."""
    if n < 0:
        n += 1 << 64
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field_bytes(tag: int, payload: bytes) -> bytes:
    return bytes((tag,)) + uvarint(len(payload)) + payload


def sample_affixes(ts_ms: int) -> tuple[bytes, bytes]:
    """(head, tail) of an encoded ``Sample`` at ``ts_ms``: ``head + pack('<d', value) + tail`` is the whole
    ``samples`` field (tag, length, value, timestamp), the same in 1.0 and 2.0. One pair serves a whole row."""
    ts = uvarint(ts_ms)
    return b"\x12" + bytes((10 + len(ts),)) + b"\x09", b"\x10" + ts


def sample_bytes(ts_ms: int, value: float) -> bytes:
    head, tail = sample_affixes(ts_ms)
    return head + _PACK_DOUBLE(value) + tail


def label_bytes(labels: Sequence[tuple[str, str]]) -> bytes:
    """The 1.0 ``labels`` fields of a series (``labels`` sorted by name, no empty value)."""
    out = []
    for name, value in labels:
        inner = _field_bytes(0x0A, name.encode()) + _field_bytes(0x12, value.encode())
        out.append(_field_bytes(0x0A, inner))
    return b"".join(out)


def sorted_labels(name: str, labels: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """``__name__`` plus ``labels``, sorted by name, empty values left out (remote write: empty = absent)."""
    pairs = [("__name__", name), *((k, v) for k, v in labels.items() if v != "")]
    pairs.sort()
    for (a, _), (b, _) in itertools.pairwise(pairs):
        if a == b:
            raise ValueError(f"label {a!r} given twice")
    return tuple(pairs)


class SeriesBuf:
    """One series of a request: its labels (sorted), its samples as encoded bytes, their timestamps."""

    __slots__ = ("help", "labels", "labels_v1", "last_ts", "mtype", "parts", "stamps", "unsorted")

    def __init__(self, labels: tuple[tuple[str, str], ...], mtype: MetricType = "gauge", help: str = "") -> None:
        self.labels = labels
        self.labels_v1 = label_bytes(labels)
        self.mtype: MetricType = mtype
        self.help = help
        self.stamps: list[int] = []
        self.parts: list[bytes] = []
        self.last_ts = -(1 << 63)
        self.unsorted = False

    def add(self, ts_ms: int, value: float) -> None:
        """One sample (the bridge's hot path appends to ``stamps``/``parts`` itself, with the row's affixes)."""
        if ts_ms <= self.last_ts:
            self.unsorted = True
        else:
            self.last_ts = ts_ms
        self.stamps.append(ts_ms)
        self.parts.append(sample_bytes(ts_ms, value))

    def __len__(self) -> int:
        return len(self.parts)

    def ordered_parts(self) -> list[bytes]:
        """The samples in timestamp order, one per timestamp (the first one added wins a tie)."""
        if not self.unsorted:
            return self.parts
        seen: set[int] = set()
        out = []
        for i in sorted(range(len(self.stamps)), key=self.stamps.__getitem__):
            ts = self.stamps[i]
            if ts not in seen:
                seen.add(ts)
                out.append(self.parts[i])
        return out

    def samples(self) -> list[tuple[int, float]]:
        """(ts_ms, value) in the order ``ordered_parts`` gives (for tests and the spool)."""
        out = []
        for part in self.ordered_parts():
            value = _UNPACK_DOUBLE(part, 3)[0]
            ts, _ = _read_uvarint(part, 12)
            out.append((ts, value))
        return out


def encode_v1(series: Iterable[SeriesBuf]) -> bytes:
    """A 1.0 ``WriteRequest`` body (not compressed)."""
    out = []
    for s in series:
        if not s.parts:
            continue
        body = s.labels_v1 + b"".join(s.ordered_parts())
        out.append(b"\x0a" + uvarint(len(body)) + body)
    return b"".join(out)


def encode_v2(series: Iterable[SeriesBuf]) -> bytes:
    """A 2.0 ``Request`` body (not compressed): one symbol table, label references, the type and help."""
    symbols: dict[str, int] = {"": 0}

    def ref(text: str) -> int:
        n = symbols.get(text)
        if n is None:
            n = symbols[text] = len(symbols)
        return n

    out = []
    for s in series:
        if not s.parts:
            continue
        refs = b"".join(uvarint(ref(t)) for pair in s.labels for t in pair)
        meta = b"\x08" + uvarint(_TYPE_CODE[s.mtype]) + (b"\x18" + uvarint(ref(s.help)) if s.help else b"")
        body = _field_bytes(0x0A, refs) + b"".join(s.ordered_parts()) + _field_bytes(0x2A, meta)
        out.append(b"\x2a" + uvarint(len(body)) + body)
    head = b"".join(_field_bytes(0x22, sym.encode()) for sym in symbols)
    return head + b"".join(out)


def compress(body: bytes) -> bytes:
    """Snappy block format (not framed), as remote write wants."""
    return bytes(cramjam.snappy.compress_raw(body))


def decompress(data: bytes) -> bytes:
    try:
        return bytes(cramjam.snappy.decompress_raw(data))
    except Exception as exc:  # cramjam raises its own DecompressionError
        raise RemoteWriteFormatError(f"not a snappy block: {exc}") from None


# --------------------------------------------------------------------------------------------------
# Reading a 1.0 request back (the spool)
# --------------------------------------------------------------------------------------------------


def _read_uvarint(data: bytes, pos: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        if pos >= len(data):
            raise RemoteWriteFormatError("truncated varint")
        b = data[pos]
        pos += 1
        n |= (b & 0x7F) << shift
        if b < 0x80:
            return n, pos
        shift += 7
        if shift > 63:
            raise RemoteWriteFormatError("varint longer than 10 bytes")


def _fields(data: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """(field number, wire type, value) of one message: varints as ints, fixed64 and length-delimited as bytes."""
    pos = 0
    while pos < len(data):
        key, pos = _read_uvarint(data, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _read_uvarint(data, pos)
            yield field, wire, value
        elif wire == 1:
            if pos + 8 > len(data):
                raise RemoteWriteFormatError("truncated fixed64")
            yield field, wire, data[pos : pos + 8]
            pos += 8
        elif wire == 2:
            length, pos = _read_uvarint(data, pos)
            if pos + length > len(data):
                raise RemoteWriteFormatError("truncated length-delimited field")
            yield field, wire, data[pos : pos + length]
            pos += length
        elif wire == 5:
            pos += 4
        else:
            raise RemoteWriteFormatError(f"unsupported wire type {wire} of field {field}")


DecodedSeries = tuple[dict[str, str], list[tuple[int, float]]]


def decode_v1(body: bytes) -> list[DecodedSeries]:
    """A 1.0 ``WriteRequest`` body -> [(labels, [(ts_ms, value)])]."""
    out: list[DecodedSeries] = []
    for field, wire, ts in _fields(body):
        if field != 1 or wire != 2:
            continue
        assert isinstance(ts, bytes)
        labels: dict[str, str] = {}
        samples: list[tuple[int, float]] = []
        for f, w, v in _fields(ts):
            if w != 2:
                continue
            assert isinstance(v, bytes)
            if f == 1:
                name = value = ""
                for lf, _, lv in _fields(v):
                    if isinstance(lv, bytes):
                        if lf == 1:
                            name = lv.decode()
                        elif lf == 2:
                            value = lv.decode()
                labels[name] = value
            elif f == 2:
                sv, st = 0.0, 0
                for sf, _, x in _fields(v):
                    if sf == 1 and isinstance(x, bytes):
                        sv = _UNPACK_DOUBLE(x)[0]
                    elif sf == 2 and isinstance(x, int):
                        st = x - (1 << 64) if x >= 1 << 63 else x
                samples.append((st, sv))
        out.append((labels, samples))
    return out


# --------------------------------------------------------------------------------------------------
# OpenMetrics text (for promtool tsdb create-blocks-from openmetrics)
# --------------------------------------------------------------------------------------------------


def _om_escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _om_value(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(v)


def _om_ts(ts_ms: int) -> str:
    sign = "-" if ts_ms < 0 else ""
    ms = abs(ts_ms)
    return f"{sign}{ms // 1000}.{ms % 1000:03d}"


def render_openmetrics(
    series: Iterable[DecodedSeries], types: Mapping[str, MetricType], *, eof: bool = True
) -> Iterator[str]:
    """OpenMetrics text, ending in ``# EOF`` (unless ``eof`` is False: a part of a longer text): every family
    contiguous, every series in timestamp order with one sample per timestamp (series met more than once are
    merged). ``types`` maps a series name to its type; a counter's family is named without ``_total``; a name not
    in ``types`` is ``unknown``."""
    merged: dict[tuple[tuple[str, str], ...], dict[int, float]] = {}
    for labels, samples in series:
        key = tuple(sorted(labels.items()))
        points = merged.setdefault(key, {})
        for ts, v in samples:
            points.setdefault(ts, v)
    by_name: dict[str, list[tuple[tuple[tuple[str, str], ...], dict[int, float]]]] = {}
    for key, points in merged.items():
        name = dict(key).get("__name__", "")
        if not name:
            raise RemoteWriteFormatError("a series without __name__")
        by_name.setdefault(name, []).append((key, points))
    for name in sorted(by_name):
        mtype = types.get(name, "unknown")
        family = name[: -len("_total")] if mtype == "counter" and name.endswith("_total") else name
        if mtype == "counter" and family == name:
            mtype = "unknown"
        yield f"# TYPE {family} {mtype}\n"
        for key, points in sorted(by_name[name]):
            text = ",".join(f'{k}="{_om_escape(v)}"' for k, v in key if k != "__name__")
            head = f"{name}{{{text}}} " if text else f"{name} "
            for ts in sorted(points):
                yield f"{head}{_om_value(points[ts])} {_om_ts(ts)}\n"
    if eof:
        yield "# EOF\n"
