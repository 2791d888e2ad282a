"""Telemetry batches: the wire and at-rest format of GPU samples (pure; zstandard is the only library used).

Every window (default 10 s) the samples of one device become ONE batch. The bytes a ``BatchEncoder`` produces
are stored in the buffer and published unchanged, on first send and on replay. ``decode_batch`` turns either
format back into samples; ``batch_json_lines`` turns a decoded batch into JSON lines; ``decode_command`` is the
body of ``gpu-mapper decode [FILE|-]``. The format is specified in docs/telemetry.md.

Binary format, version 1 (all integers are unsigned LEB128 varints unless said otherwise; ``zz`` = zigzag)::

    magic "GMT" | version 0x01 | flags (bit 0: body is one zstd frame) | body
    body   = str node | str device | uuid | str boot_id | seq | ts_first_ms | span_ms | n_rows
             | ts_kind (0: regular, step_ms follows; 1: n_rows-1 zz deltas follow) | n_series | series*
    series = name (k>0: KNOWN_SERIES_V1[k-1]; k=0: str follows) | kind byte | [presence bitmap] | [scale]
             | values
    kind   = type (low 3 bits: 1 int, 2 decimal float, 3 xor float, 4 string, 5 bool)
             | 0x08 present in every row (no bitmap) | 0x10 constant (one value stored)
             | 0x20 int deltas divided by their gcd | 0x40 int delta-of-delta
    uuid   = 0 + 16 bytes for a canonical "GPU-<uuid>", else (length + 1) + UTF-8
    string dictionary entry = 0 (the batch's uuid) or (length + 1) + UTF-8

A property whose values change type between rows (never the case for the NVML backend) becomes one series per
type; the decoder merges them back by row.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import struct
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, Literal

import zstandard

from mapper.model import DeviceConfig, Sample, Value

Format = Literal["binary", "json"]

MAGIC = b"GMT"
FORMAT_VERSION = 1
JSON_FORMAT_NAME = "gpu-mapper-telemetry"
_FLAG_ZSTD = 0x01

_T_INT, _T_DEC, _T_XOR, _T_STR, _T_BOOL = 1, 2, 3, 4, 5
_K_DENSE = 0x08
_K_CONST = 0x10
#: int columns: deltas are stored divided by their gcd (uvarint gcd follows the kind/scale)
_K_GCD = 0x20
#: int columns: delta-of-delta (the first delta follows the first value, then second differences)
_K_DOD = 0x40
_MAX_DECIMALS = 9
_DEC_LIMIT = 1 << 62

#: Series names with a one-byte code in format version 1. Append-only: codes never change meaning.
KNOWN_SERIES_V1: tuple[str, ...] = (
    "uuid",
    "product_name",
    "utilization_gpu",
    "utilization_memory",
    "memory_used",
    "memory_total",
    "temperature",
    "temperature_memory",
    "temperature_slowdown",
    "temperature_shutdown",
    "fan_speed",
    "power_usage",
    "energy_consumption",
    "power_limit_enforced",
    "power_limit_min",
    "power_limit_max",
    "power_limit_default",
    "clock_sm",
    "clock_memory",
    "clock_sm_max",
    "clock_event_reasons",
    "clock_event_reasons_text",
    "pstate",
    "pcie_tx",
    "pcie_rx",
    "ecc_errors_corrected",
    "ecc_errors_uncorrected",
    "remapped_rows_uncorrectable",
    "remapped_rows_pending",
    "xid_last",
    "power_limit",
    "locked_gpu_clock_min",
    "locked_gpu_clock_max",
    "locked_memory_clock_min",
    "locked_memory_clock_max",
    "persistence_mode",
    "compute_mode",
    "desired_status",
    "policy_state",
)
_KNOWN_CODE = {name: i + 1 for i, name in enumerate(KNOWN_SERIES_V1)}


class BatchFormatError(ValueError):
    """The bytes are not a telemetry batch this version can read; the message says what was wrong."""


# --------------------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EncodedBatch:
    """One encoded batch and what the buffer and the shipper need to know about it without decoding."""

    device: str
    uuid: str
    boot_id: str
    seq: int
    ts_first_ms: int
    ts_last_ms: int
    payload: bytes
    fmt: Format = "binary"
    samples: int = 0
    values: int = 0


@dataclass(frozen=True)
class DecodedBatch:
    version: int
    fmt: Format
    node: str
    device: str
    uuid: str
    boot_id: str
    seq: int
    ts_first_ms: int
    ts_last_ms: int
    samples: tuple[Sample, ...] = field(default_factory=tuple)


# --------------------------------------------------------------------------------------------------
# Varints
# --------------------------------------------------------------------------------------------------


def _put_uvarint(out: bytearray, n: int) -> None:
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


def _zz(n: int) -> int:
    return n * 2 if n >= 0 else -n * 2 - 1


def _unzz(n: int) -> int:
    return n >> 1 if not n & 1 else -((n + 1) >> 1)


def _put_str(out: bytearray, text: str) -> None:
    raw = text.encode("utf-8")
    _put_uvarint(out, len(raw))
    out += raw


_GPU_UUID_RE = re.compile(r"GPU-([0-9a-f]{8})-([0-9a-f]{4})-([0-9a-f]{4})-([0-9a-f]{4})-([0-9a-f]{12})")


def _put_uuid(out: bytearray, uuid: str) -> None:
    """A canonical ``GPU-xxxxxxxx-xxxx-...`` uuid as 0 + 16 bytes; anything else as (len + 1) + UTF-8."""
    m = _GPU_UUID_RE.fullmatch(uuid)
    if m:
        out.append(0)
        out += bytes.fromhex("".join(m.groups()))
        return
    raw = uuid.encode("utf-8")
    _put_uvarint(out, len(raw) + 1)
    out += raw


def _read_uuid(r: _Reader) -> str:
    size = r.uvarint()
    if size == 0:
        h = r.take(16).hex()
        return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
    try:
        return r.take(size - 1).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BatchFormatError(f"batch uuid is not UTF-8: {exc}") from None


class _Reader:
    __slots__ = ("data", "pos")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def uvarint(self) -> int:
        data, pos = self.data, self.pos
        result = shift = 0
        while True:
            if pos >= len(data):
                raise BatchFormatError("batch truncated inside a varint")
            b = data[pos]
            pos += 1
            result |= (b & 0x7F) << shift
            if b < 0x80:
                self.pos = pos
                return result
            shift += 7

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise BatchFormatError("batch truncated")
        b = self.data[self.pos]
        self.pos += 1
        return b

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise BatchFormatError(f"batch truncated: wanted {n} bytes at offset {self.pos}")
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def text(self) -> str:
        try:
            return self.take(self.uvarint()).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BatchFormatError(f"batch holds a string that is not UTF-8: {exc}") from None


_DOUBLE = struct.Struct("<d")
_QWORD = struct.Struct("<Q")


def _bits(v: float) -> int:
    return int(_QWORD.unpack(_DOUBLE.pack(v))[0])


def _from_bits(n: int) -> float:
    return float(_DOUBLE.unpack(_QWORD.pack(n))[0])


# --------------------------------------------------------------------------------------------------
# Column encoders
# --------------------------------------------------------------------------------------------------


def _type_of(value: Value) -> int:
    if isinstance(value, bool):
        return _T_BOOL
    if isinstance(value, int):
        return _T_INT
    if isinstance(value, float):
        return _T_DEC
    if isinstance(value, str):
        return _T_STR
    raise TypeError(f"telemetry value {value!r} has type {type(value).__name__}; expected int, float, str or bool")


def _decimal_scale(values: Sequence[float]) -> int | None:
    """The fewest decimals d such that every value equals round(v * 10**d) / 10**d exactly, or None."""
    for v in values:
        if not math.isfinite(v) or abs(v) >= _DEC_LIMIT or (v == 0.0 and math.copysign(1.0, v) < 0):
            return None
    for d in range(_MAX_DECIMALS + 1):
        scale = 10**d
        if all(abs(round(v * scale)) < _DEC_LIMIT and round(v * scale) / scale == v for v in values):
            return d
    return None


def _uvarint_len(n: int) -> int:
    return max(1, (n.bit_length() + 6) // 7)


def _int_plan(ints: Sequence[int]) -> tuple[int, int, list[int]]:
    """Choose the cheapest int column coding: (flags, gcd, numbers to write after the first value)."""
    deltas = [b - a for a, b in itertools.pairwise(ints)]
    g = 0
    for d in deltas:
        g = math.gcd(g, d)
    g = max(g, 1)
    scaled = [d // g for d in deltas] if g > 1 else deltas
    dod = [scaled[0]] + [b - a for a, b in itertools.pairwise(scaled)] if scaled else []
    cost_delta = sum(_uvarint_len(_zz(d)) for d in scaled)
    cost_dod = sum(_uvarint_len(_zz(d)) for d in dod)
    flags = _K_GCD if g > 1 else 0
    if cost_dod < cost_delta:
        return flags | _K_DOD, g, dod
    return flags, g, scaled


def _put_ints(out: bytearray, ints: Sequence[int], const: bool, plan: tuple[int, int, list[int]] | None) -> None:
    _put_uvarint(out, _zz(ints[0]))
    if const or plan is None:
        return
    flags, g, numbers = plan
    if flags & _K_GCD:
        _put_uvarint(out, g)
    for d in numbers:
        _put_uvarint(out, d * 2 if d >= 0 else -d * 2 - 1)


def _read_ints(r: _Reader, n: int, kind: int) -> list[int]:
    first = _unzz(r.uvarint())
    if kind & _K_CONST:
        return [first] * n
    g = r.uvarint() if kind & _K_GCD else 1
    out = [first]
    acc = first
    step = 0
    dod = bool(kind & _K_DOD)
    for _ in range(n - 1):
        d = _unzz(r.uvarint())
        if dod:
            step += d
        else:
            step = d
        acc += step * g
        out.append(acc)
    return out


def _encode_series(
    out: bytearray, name: str, rows: list[int], values: list[Value], vtype: int, n_rows: int, header_uuid: str
) -> None:
    code = _KNOWN_CODE.get(name, 0)
    _put_uvarint(out, code)
    if code == 0:
        _put_str(out, name)
    const = all(v == values[0] and type(v) is type(values[0]) for v in values)
    kind = vtype
    scale: int | None = None
    if vtype == _T_DEC:
        floats = [float(v) for v in values]
        scale = _decimal_scale(floats)
        if scale is None:
            kind = _T_XOR
            const = all(_bits(v) == _bits(floats[0]) for v in floats)
    dense = len(rows) == n_rows
    ints: list[int] = []
    plan = None
    if kind == _T_INT:
        ints = [int(v) for v in values]
    elif kind == _T_DEC:
        assert scale is not None
        factor = 10**scale
        ints = [round(float(v) * factor) for v in values]
    if ints and not const:
        plan = _int_plan(ints)
    flags = plan[0] if plan else 0
    out.append(kind | (_K_DENSE if dense else 0) | (_K_CONST if const else 0) | flags)
    if not dense:
        bitmap = bytearray((n_rows + 7) // 8)
        for r in rows:
            bitmap[r >> 3] |= 1 << (r & 7)
        out += bitmap
    if kind == _T_INT:
        _put_ints(out, ints, const, plan)
    elif kind == _T_DEC:
        assert scale is not None
        _put_uvarint(out, scale)
        _put_ints(out, ints, const, plan)
    elif kind == _T_XOR:
        prev = 0
        for v in values[:1] if const else values:
            b = _bits(float(v))
            _put_uvarint(out, b ^ prev)
            prev = b
    elif kind == _T_STR:
        index: dict[str, int] = {}
        for v in values:
            index.setdefault(str(v), len(index))
        _put_uvarint(out, len(index))
        for text in index:
            if text == header_uuid:
                _put_uvarint(out, 0)  # "the batch's uuid"
            else:
                raw = text.encode("utf-8")
                _put_uvarint(out, len(raw) + 1)
                out += raw
        if not const:
            for v in values:
                _put_uvarint(out, index[str(v)])
    else:  # bool
        if const:
            out.append(1 if values[0] else 0)
        else:
            packed = bytearray((len(values) + 7) // 8)
            for i, v in enumerate(values):
                if v:
                    packed[i >> 3] |= 1 << (i & 7)
            out += packed


def _decode_series(r: _Reader, n_rows: int, header_uuid: str) -> tuple[str, dict[int, Value]]:
    code = r.uvarint()
    if code == 0:
        name = r.text()
    elif code <= len(KNOWN_SERIES_V1):
        name = KNOWN_SERIES_V1[code - 1]
    else:
        raise BatchFormatError(f"unknown series code {code} (this reader knows {len(KNOWN_SERIES_V1)})")
    kind = r.byte()
    vtype, dense, const = kind & 0x07, bool(kind & _K_DENSE), bool(kind & _K_CONST)
    if dense:
        rows = list(range(n_rows))
    else:
        bitmap = r.take((n_rows + 7) // 8)
        rows = [i for i in range(n_rows) if bitmap[i >> 3] >> (i & 7) & 1]
    n = len(rows)
    values: list[Value]
    if vtype in (_T_INT, _T_DEC):
        scale = r.uvarint() if vtype == _T_DEC else 0
        ints = _read_ints(r, n, kind) if n else []
        if vtype == _T_INT:
            values = list(ints)
        else:
            factor = 10**scale
            values = [i / factor for i in ints]
    elif vtype == _T_XOR:
        if const:
            values = [_from_bits(r.uvarint())] * n
        else:
            values = []
            prev = 0
            for _ in range(n):
                prev ^= r.uvarint()
                values.append(_from_bits(prev))
    elif vtype == _T_STR:
        words = []
        for _ in range(r.uvarint()):
            size = r.uvarint()
            if size == 0:
                words.append(header_uuid)
                continue
            try:
                words.append(r.take(size - 1).decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise BatchFormatError(f"series {name!r} holds a string that is not UTF-8: {exc}") from None
        if const:
            if not words:
                raise BatchFormatError(f"series {name!r}: empty string dictionary")
            values = [words[0]] * n
        else:
            values = []
            for _ in range(n):
                i = r.uvarint()
                if i >= len(words):
                    raise BatchFormatError(f"series {name!r}: string index {i} outside its dictionary")
                values.append(words[i])
    elif vtype == _T_BOOL:
        if const:
            values = [bool(r.byte())] * n
        else:
            packed = r.take((n + 7) // 8)
            values = [bool(packed[i >> 3] >> (i & 7) & 1) for i in range(n)]
    else:
        raise BatchFormatError(f"series {name!r}: unknown value type {vtype}")
    return name, dict(zip(rows, values, strict=True))


# --------------------------------------------------------------------------------------------------
# Whole batches
# --------------------------------------------------------------------------------------------------


def encode_batch(
    samples: Sequence[Sample],
    *,
    node: str,
    device: str,
    uuid: str,
    boot_id: str,
    seq: int,
    fmt: Format = "binary",
    compressor: zstandard.ZstdCompressor | None = None,
) -> EncodedBatch:
    """Encode the samples (at least one, in time order) of one device as one batch."""
    if not samples:
        raise ValueError("a batch needs at least one sample")
    if seq < 0:
        raise ValueError(f"seq must be >= 0, got {seq}")
    ts = [s.ts_ms for s in samples]
    if any(t < 0 for t in ts):
        raise ValueError("sample timestamps must be >= 0 ms")
    ts_first, ts_last = min(ts), max(ts)
    n_values = sum(len(s.values) for s in samples)
    if fmt == "json":
        doc = {
            "format": JSON_FORMAT_NAME,
            "version": FORMAT_VERSION,
            "node": node,
            "device": device,
            "uuid": uuid,
            "boot_id": boot_id,
            "seq": seq,
            "ts_first_ms": ts_first,
            "ts_last_ms": ts_last,
            "samples": [{"ts_ms": s.ts_ms, "values": dict(s.values)} for s in samples],
        }
        payload = json.dumps(doc, separators=(",", ":")).encode("utf-8")
    elif fmt == "binary":
        payload = _encode_binary(samples, ts, node, device, uuid, boot_id, seq, ts_first, ts_last, compressor)
    else:
        raise ValueError(f"telemetry format must be 'binary' or 'json', got {fmt!r}")
    return EncodedBatch(device, uuid, boot_id, seq, ts_first, ts_last, payload, fmt, len(samples), n_values)


def _encode_binary(
    samples: Sequence[Sample],
    ts: list[int],
    node: str,
    device: str,
    uuid: str,
    boot_id: str,
    seq: int,
    ts_first: int,
    ts_last: int,
    compressor: zstandard.ZstdCompressor | None,
) -> bytes:
    body = bytearray()
    _put_str(body, node)
    _put_str(body, device)
    _put_uuid(body, uuid)
    _put_str(body, boot_id)
    _put_uvarint(body, seq)
    _put_uvarint(body, ts_first)
    _put_uvarint(body, ts_last - ts_first)
    n_rows = len(samples)
    _put_uvarint(body, n_rows)
    deltas = [b - a for a, b in itertools.pairwise(ts)]
    if ts[0] == ts_first and (not deltas or (deltas[0] >= 0 and all(d == deltas[0] for d in deltas))):
        body.append(0)
        _put_uvarint(body, deltas[0] if deltas else 0)
    else:
        body.append(1)
        _put_uvarint(body, _zz(ts[0] - ts_first))
        for d in deltas:
            _put_uvarint(body, _zz(d))
    # Columns: one per (property, value type), in first-seen order.
    columns: dict[tuple[str, int], tuple[list[int], list[Value]]] = {}
    for row, s in enumerate(samples):
        for name, value in s.values.items():
            col = columns.get((name, _type_of(value)))
            if col is None:
                col = columns[(name, _type_of(value))] = ([], [])
            col[0].append(row)
            col[1].append(value)
    _put_uvarint(body, len(columns))
    for (name, vtype), (rows, values) in columns.items():
        _encode_series(body, name, rows, values, vtype, n_rows, uuid)
    raw = bytes(body)
    packed = (compressor or zstandard.ZstdCompressor(level=9)).compress(raw)
    if len(packed) < len(raw):
        return MAGIC + bytes((FORMAT_VERSION, _FLAG_ZSTD)) + packed
    return MAGIC + bytes((FORMAT_VERSION, 0)) + raw


def decode_batch(data: bytes) -> DecodedBatch:
    """Decode one batch, binary or JSON. Raises ``BatchFormatError`` naming what was wrong."""
    if data[:3] == MAGIC:
        return _decode_binary(data)
    if data[:1] == b"{":
        return _decode_json(data)
    raise BatchFormatError(f"not a telemetry batch: starts with {data[:8]!r}, expected {MAGIC!r} or '{{'")


_MAX_BODY_BYTES = 256 * 1024 * 1024


def _decode_binary(data: bytes) -> DecodedBatch:
    if len(data) < 5:
        raise BatchFormatError("batch truncated inside its header")
    version, flags = data[3], data[4]
    if version != FORMAT_VERSION:
        raise BatchFormatError(f"batch format version {version} is not supported (this reader reads {FORMAT_VERSION})")
    body = data[5:]
    if flags & _FLAG_ZSTD:
        try:
            body = zstandard.ZstdDecompressor().decompress(body, max_output_size=_MAX_BODY_BYTES)
        except zstandard.ZstdError as exc:
            raise BatchFormatError(f"batch body does not decompress: {exc}") from None
    r = _Reader(body)
    node, device = r.text(), r.text()
    uuid = _read_uuid(r)
    boot_id = r.text()
    seq = r.uvarint()
    ts_first = r.uvarint()
    ts_last = ts_first + r.uvarint()
    n_rows = r.uvarint()
    if n_rows > len(body) * 8 + 8:
        raise BatchFormatError(f"batch claims {n_rows} rows in {len(body)} bytes")
    ts_kind = r.byte()
    if ts_kind == 0:
        step = r.uvarint()
        ts = [ts_first + i * step for i in range(n_rows)]
    elif ts_kind == 1:
        ts = []
        acc = ts_first
        for i in range(n_rows):
            acc += _unzz(r.uvarint())
            ts.append(acc)
            if i == 0 and acc < 0:
                raise BatchFormatError("negative timestamp")
    else:
        raise BatchFormatError(f"unknown timestamp encoding {ts_kind}")
    rows: list[dict[str, Value]] = [{} for _ in range(n_rows)]
    for _ in range(r.uvarint()):
        name, column = _decode_series(r, n_rows, uuid)
        for row, value in column.items():
            rows[row][name] = value
    if r.pos != len(body):
        raise BatchFormatError(f"{len(body) - r.pos} stray bytes after the last series")
    samples = tuple(Sample(uuid=uuid, ts_ms=t, values=v) for t, v in zip(ts, rows, strict=True))
    return DecodedBatch(FORMAT_VERSION, "binary", node, device, uuid, boot_id, seq, ts_first, ts_last, samples)


def _decode_json(data: bytes) -> DecodedBatch:
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BatchFormatError(f"JSON batch does not parse: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != JSON_FORMAT_NAME:
        raise BatchFormatError(f"JSON document is not a {JSON_FORMAT_NAME} batch (missing or wrong 'format')")
    if doc.get("version") != FORMAT_VERSION:
        raise BatchFormatError(f"JSON batch version {doc.get('version')!r} is not supported")
    try:
        uuid = str(doc["uuid"])
        samples = tuple(Sample(uuid=uuid, ts_ms=int(s["ts_ms"]), values=dict(s["values"])) for s in doc["samples"])
        return DecodedBatch(
            FORMAT_VERSION,
            "json",
            str(doc["node"]),
            str(doc["device"]),
            uuid,
            str(doc["boot_id"]),
            int(doc["seq"]),
            int(doc["ts_first_ms"]),
            int(doc["ts_last_ms"]),
            samples,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise BatchFormatError(f"JSON batch lacks or mistypes field {exc}") from None


def batch_records(batch: DecodedBatch) -> Iterator[dict[str, Any]]:
    """One record per value: ``{"ts_ms", "device", "property", "value"}``, in row order then series order."""
    for s in batch.samples:
        for name, value in s.values.items():
            yield {"ts_ms": s.ts_ms, "device": batch.device, "property": name, "value": value}


def batch_json_lines(batch: DecodedBatch) -> Iterator[str]:
    """The batch as JSON lines (no trailing newline on each). Floats print in Python's shortest round-trip form,
    so ``json.loads`` of a line gives back exactly the value the backend produced."""
    for rec in batch_records(batch):
        yield json.dumps(rec, separators=(",", ":"))


# --------------------------------------------------------------------------------------------------
# The encoder the collect loop feeds
# --------------------------------------------------------------------------------------------------


class BatchEncoder:
    """Collects one device's samples and cuts a batch every ``window_s``.

    The window opens at the first sample's timestamp; ``flush_due(now_ms)`` returns the batch once
    ``now_ms - window_start >= window_s``. Sequence numbers start at ``start_seq`` and grow by one per batch;
    ``next_seq`` may be set between batches (e.g. to share one counter between several encoders of a device).
    """

    def __init__(
        self,
        node: str,
        device: str,
        uuid: str,
        boot_id: str,
        window_s: float = 10.0,
        start_seq: int = 0,
        fmt: Format = "binary",
        *,
        zstd_level: int = 9,
    ) -> None:
        if not window_s > 0 or not math.isfinite(window_s):
            raise ValueError(f"telemetry window_s must be a positive number of seconds, got {window_s!r}")
        if start_seq < 0:
            raise ValueError(f"start_seq must be >= 0, got {start_seq}")
        if fmt not in ("binary", "json"):
            raise ValueError(f"telemetry format must be 'binary' or 'json', got {fmt!r}")
        self.node, self.device, self.uuid, self.boot_id = node, device, uuid, boot_id
        self.window_ms = round(window_s * 1000)
        self.fmt: Format = fmt
        self.next_seq = start_seq
        self._samples: list[Sample] = []
        self._window_start_ms: int | None = None
        self._compressor = zstandard.ZstdCompressor(level=zstd_level)

    @property
    def pending_samples(self) -> int:
        return len(self._samples)

    def add(self, sample: Sample) -> None:
        if self._window_start_ms is None:
            self._window_start_ms = sample.ts_ms
        self._samples.append(sample)

    def flush_due(self, now_ms: int) -> EncodedBatch | None:
        """The batch of the window ``[start, start + window_s)`` once ``now_ms`` reached its end; samples
        stamped later stay for the next window."""
        if self._window_start_ms is None or now_ms - self._window_start_ms < self.window_ms:
            return None
        end = self._window_start_ms + self.window_ms
        inside = [s for s in self._samples if s.ts_ms < end]
        later = [s for s in self._samples if s.ts_ms >= end]
        batch = self._cut(inside)
        self._samples = later
        self._window_start_ms = min(s.ts_ms for s in later) if later else None
        return batch

    def flush(self) -> EncodedBatch | None:
        """Everything pending as one batch (at shutdown), or None."""
        batch = self._cut(self._samples)
        self._samples = []
        self._window_start_ms = None
        return batch

    def _cut(self, samples: list[Sample]) -> EncodedBatch | None:
        if not samples:
            return None
        samples = sorted(samples, key=lambda s: s.ts_ms)
        batch = encode_batch(
            samples,
            node=self.node,
            device=self.device,
            uuid=self.uuid,
            boot_id=self.boot_id,
            seq=self.next_seq,
            fmt=self.fmt,
            compressor=self._compressor,
        )
        self.next_seq += 1
        return batch


# --------------------------------------------------------------------------------------------------
# Per-property pushMethod -> per-device batches
# --------------------------------------------------------------------------------------------------


def default_topic(node: str, device: str) -> str:
    """``gpu-mapper/{node}/{namespace}/{name}/telemetry`` (the device key keeps its slash)."""
    return f"gpu-mapper/{node}/{device}/telemetry"


def state_topic(node: str, device: str) -> str:
    """Where the latest values of a device are published, retained, first on every reconnect."""
    return f"gpu-mapper/{node}/{device}/state"


def status_topic(node: str) -> str:
    """The mapper's online/offline topic (the MQTT last will)."""
    return f"gpu-mapper/{node}/status"


@dataclass(frozen=True)
class Route:
    """Where one group of a device's properties goes. ``address`` "" = the mapper's default broker;
    ``properties`` None = every property not claimed by another route."""

    address: str
    topic: str
    qos: int
    retain: bool
    properties: frozenset[str] | None = None


def routes_for(device: DeviceConfig, node: str, *, default_qos: int = 1) -> list[Route]:
    """Group a Device's properties by their ``pushMethod.mqtt`` (address, topic, qos, retained).

    Properties without a pushMethod (or with an empty topic) share the default route, which comes first.
    Each group becomes its own batch stream; all streams of a device share one sequence counter.
    """
    groups: dict[tuple[str, str, int, bool], set[str]] = {}
    for p in device.properties:
        push = p.push_mqtt
        if push is None or not push.topic:
            continue
        if push.qos not in (0, 1, 2):
            raise ValueError(f"device {device.key} property {p.name}: pushMethod.mqtt.qos must be 0, 1 or 2")
        groups.setdefault((push.address, push.topic, push.qos, push.retained), set()).add(p.name)
    routes = [Route("", default_topic(node, device.key), default_qos, False, None)]
    routes += [Route(a, t, q, r, frozenset(names)) for (a, t, q, r), names in groups.items()]
    return routes


class DeviceTelemetry:
    """All batch streams of one device: splits each sample's values by ``Route`` and cuts batches together."""

    def __init__(
        self,
        node: str,
        device: DeviceConfig,
        boot_id: str,
        *,
        window_s: float = 10.0,
        fmt: Format = "binary",
        start_seq: int = 0,
        default_qos: int = 1,
    ) -> None:
        self.device = device
        self.routes = routes_for(device, node, default_qos=default_qos)
        self._claimed: dict[str, int] = {}
        for i, route in enumerate(self.routes):
            for name in route.properties or ():
                self._claimed[name] = i
        self._encoders = [
            BatchEncoder(node, device.key, device.uuid, boot_id, window_s, start_seq, fmt) for _ in self.routes
        ]
        self.next_seq = start_seq

    def add(self, sample: Sample) -> None:
        parts: list[dict[str, Value]] = [{} for _ in self.routes]
        for name, value in sample.values.items():
            parts[self._claimed.get(name, 0)][name] = value
        for i, values in enumerate(parts):
            if values or i == 0:
                self._encoders[i].add(Sample(sample.uuid, sample.ts_ms, values))

    def flush_due(self, now_ms: int) -> list[tuple[Route, EncodedBatch]]:
        return self._cut(lambda e: e.flush_due(now_ms))

    def flush(self) -> list[tuple[Route, EncodedBatch]]:
        return self._cut(lambda e: e.flush())

    def _cut(self, how: Any) -> list[tuple[Route, EncodedBatch]]:
        out: list[tuple[Route, EncodedBatch]] = []
        for route, enc in zip(self.routes, self._encoders, strict=True):
            enc.next_seq = self.next_seq
            batch = how(enc)
            if batch is not None:
                self.next_seq = enc.next_seq
                out.append((route, batch))
        return out


def state_payload(device: str, sample: Sample) -> bytes:
    """The retained 'current state' message of a device: its latest values as one JSON object."""
    doc = {"device": device, "uuid": sample.uuid, "ts_ms": sample.ts_ms, "values": dict(sample.values)}
    return json.dumps(doc, separators=(",", ":")).encode("utf-8")


# --------------------------------------------------------------------------------------------------
# Files of several batches, and the decode command
# --------------------------------------------------------------------------------------------------


def frame(payload: bytes) -> bytes:
    """One record of a batch file: a 4-byte big-endian length, then the batch."""
    return len(payload).to_bytes(4, "big") + payload


def iter_batches(data: bytes) -> Iterator[bytes]:
    """The batches of a file: one bare batch (starts with "GMT" or "{"), or length-prefixed records."""
    if data[:3] == MAGIC or data[:1] == b"{":
        yield data
        return
    pos = 0
    while pos < len(data):
        if pos + 4 > len(data):
            raise BatchFormatError(f"record header truncated at offset {pos}")
        n = int.from_bytes(data[pos : pos + 4], "big")
        if pos + 4 + n > len(data):
            raise BatchFormatError(f"record at offset {pos} claims {n} bytes, only {len(data) - pos - 4} remain")
        yield data[pos + 4 : pos + 4 + n]
        pos += 4 + n


def decode_command(
    argv_or_path: Sequence[str] | str,
    stdin: IO[bytes],
    stdout: IO[str],
    stderr: IO[str] | None = None,
) -> int:
    """``gpu-mapper decode [FILE|-]``: print every value of every batch as one JSON line. Returns an exit code."""
    err = stderr if stderr is not None else sys.stderr
    args = [argv_or_path] if isinstance(argv_or_path, str) else list(argv_or_path)
    if len(args) > 1:
        err.write(f"decode: expected one FILE or '-', got {len(args)} arguments\n")
        return 2
    source = args[0] if args else "-"
    try:
        if source == "-":
            data = stdin.read()
        else:
            with open(source, "rb") as fh:
                data = fh.read()
    except OSError as exc:
        err.write(f"decode: cannot read {source}: {exc.strerror or exc}\n")
        return 2
    try:
        for i, raw in enumerate(iter_batches(data)):
            try:
                batch = decode_batch(raw)
            except BatchFormatError as exc:
                raise BatchFormatError(f"batch #{i + 1}: {exc}") from None
            for line in batch_json_lines(batch):
                stdout.write(line + "\n")
    except BatchFormatError as exc:
        err.write(f"decode: {source}: {exc}\n")
        return 1
    return 0


def encode_file(batches: Iterable[bytes]) -> bytes:
    """Several batches as one file (the framing ``decode_command`` reads)."""
    return b"".join(frame(b) for b in batches)


def records_equal(a: Mapping[str, Value], b: Mapping[str, Value]) -> bool:
    """Exact equality of two value maps: same keys, same types, same values (float bits compared)."""
    if a.keys() != b.keys():
        return False
    for k, va in a.items():
        vb = b[k]
        if type(va) is not type(vb):
            return False
        if isinstance(va, float) and isinstance(vb, float):
            if _bits(va) != _bits(vb) and not (math.isnan(va) and math.isnan(vb)):
                return False
        elif va != vb:
            return False
    return True
