"""Telemetry batches: the wire and at-rest format of GPU samples (pure; zstandard is the only library used).

Every window (default 10 s) the samples of one device become ONE batch. The bytes a ``BatchEncoder`` produces
are stored in the buffer and published unchanged, on first send and on replay. ``decode_batch`` turns either
format back into samples; ``batch_json_lines`` turns a decoded batch into JSON lines; ``decode_command`` is the
body of ``gpu-mapper decode [FILE|-]``. The format is specified in docs/telemetry.md.

Binary format, version 2 (integers are unsigned LEB128 varints unless said otherwise; ``zz`` = zigzag)::

    batch  = magic "G" | version 0x02 | flags | body, or one magicless zstd frame of the body
    flags  = bit 0: zstd frame | bits 4-7: static dictionary id (0: none; see mapper.wire.dictionaries)
    body   = n_rows | span_ms | ts_kind | str node | str device | n_series | meta*      (stable part)
             | ids | seq | ts_first_ms | [timestamps] | data* | one bit stream          (per batch)
    ids    = one byte: bit 0 uuid as 16 bytes, bit 1 boot id as 8 bytes, bit 2 no uuid, bit 3 boot id as 4 bytes
             | [uuid] | boot id

The GPU uuid is optional in the header: a ``BatchEncoder`` writes it in the first batch it cuts (and after
``announce_uuid()``), and any batch that holds the uuid as a string value (the ``uuid`` series) carries it so
that the value refers to it. Other batches decode with ``uuid == ""``: the device name identifies the stream.
The full layout, with the series meta and data, is in docs/telemetry.md.

Version 3 is a merged batch (backlog compaction, ``merge_batches``): a version 2 body over the rows of several
batches of one stream, with a parts table (each part's seq, rows, whether its header carried the uuid) after the
first timestamp. Version 4 is a merged batch in its cold form (a slot that is over): version 3 with int columns
that may come in segments, each segment's fields one mixed-radix number (``_Sections.segment_plan``).
``decode_batch`` reads all three; ``DecodedBatch.split`` gives back the batches a merged one holds.

A batch decodes on its own: the only outside data is the static, versioned dictionary shipped in the package.
A property whose values change type between rows (never the case for the NVML backend) becomes one series per
type; the decoder merges them back by row.
"""

from __future__ import annotations

import itertools
import json
import math
import operator
import re
import struct
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, Literal, NamedTuple, cast

import zstandard

from mapper.shared.model import DeviceConfig, Sample, Value
from mapper.wire.dictionaries import CURRENT_DICTIONARY_ID, DICTIONARY_SHA256, load_dictionary
from mapper.wire.topics import telemetry_topic

Format = Literal["binary", "json"]

#: The first byte of a binary batch (a JSON batch starts with "{").
MAGIC = b"G"
#: Magic, format version, flags.
HEADER_BYTES = 3
#: The version of the batches the live path writes (one per window).
FORMAT_VERSION = 2
#: The version of a merged batch as ``merge_batches`` writes it: version 3 with segmented int columns.
MERGED_FORMAT_VERSION = 4
#: The first version of a merged batch: a version 2 body over every row (int columns may come in blocks of
#: ``BLOCK_FIELDS``), then its parts; ``merge_batches(..., version=3)`` still writes it.
MERGED_FORMAT_VERSION_3 = 3
#: The versions of merged batches (each has a parts table).
MERGED_VERSIONS = (3, 4)
#: The binary versions ``decode_batch`` reads.
READABLE_VERSIONS = (2, 3, 4)
#: The JSON format did not change with binary version 2; its documents say version 1.
JSON_FORMAT_VERSION = 1
JSON_FORMAT_NAME = "gpu-mapper-telemetry"
DEFAULT_ZSTD_LEVEL = 19
_FLAG_ZSTD = 0x01
_DICT_SHIFT = 4

_T_INT, _T_DEC, _T_XOR, _T_STR, _T_BOOL = 1, 2, 3, 4, 5
_K_DENSE = 0x08
_K_CONST = 0x10
_K_ORDER_SHIFT = 5
_K_GCD = 0x80
_MAX_DECIMALS = 9
_DEC_LIMIT = 1 << 62
_MAX_WIDTH = 4096
_TS_EVEN = 0
_TS_LIST = 1

#: Series names with a one-byte code (code = position + 1). Append-only: a code never changes meaning.
KNOWN_SERIES: tuple[str, ...] = (
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
#: The name it had in format version 1 (same codes).
KNOWN_SERIES_V1 = KNOWN_SERIES
_KNOWN_CODE = {name: i + 1 for i, name in enumerate(KNOWN_SERIES)}


class BatchFormatError(ValueError):
    """The bytes are not a telemetry batch this version can read; the message says what was wrong."""


class BatchPart(NamedTuple):
    """One of the batches a batch holds: a batch holds itself; a merged batch (version 3) holds each batch it
    replaced, in order. ``(device, boot_id, seq)`` of a part is the identity that batch had when it was cut."""

    seq: int
    #: How many rows (samples) of the batch are this part's, counted from the end of the previous part.
    rows: int
    #: The GPU uuid the part's header carried ("" when it carried none).
    uuid: str


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
    """A batch as read back. ``uuid`` is "" for a binary batch whose header carries no GPU uuid (see
    ``encode_batch``); the device name identifies the stream."""

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
    #: The batches this one holds, in order (see ``BatchPart``); one part for a batch that was not merged.
    #: Empty only for a ``DecodedBatch`` built by hand: it then stands for itself.
    parts: tuple[BatchPart, ...] = ()

    @property
    def seq_last(self) -> int:
        """The sequence number of the last batch this one holds (``seq`` unless merged)."""
        return self.parts[-1].seq if self.parts else self.seq

    @property
    def seqs(self) -> tuple[int, ...]:
        """The sequence numbers of every batch this one holds, increasing (not always consecutive: the streams
        of a device share one counter, and batches acked before a merge leave gaps)."""
        return tuple(p.seq for p in self.parts) if self.parts else (self.seq,)

    @property
    def merged(self) -> bool:
        return len(self.parts) > 1

    def split(self) -> tuple[DecodedBatch, ...]:
        """The batches this one holds, each as it decoded before it was merged (version 2, its own seq, uuid,
        samples and time range). A consumer that drops duplicates by ``(device, boot_id, seq)`` does it per part:
        a merged batch may repeat batches it already has, or be repeated by them."""
        if not self.parts or (len(self.parts) == 1 and (self.fmt != "binary" or self.version not in MERGED_VERSIONS)):
            return (self,)
        out = []
        start = 0
        for part in self.parts:
            rows = self.samples[start : start + part.rows]
            start += part.rows
            ts = [s.ts_ms for s in rows]
            out.append(
                DecodedBatch(
                    FORMAT_VERSION,
                    self.fmt,
                    self.node,
                    self.device,
                    part.uuid,
                    self.boot_id,
                    part.seq,
                    min(ts),
                    max(ts),
                    rows,
                    (BatchPart(part.seq, part.rows, part.uuid),),
                )
            )
        return tuple(out)


# --------------------------------------------------------------------------------------------------
# zstd with the static dictionary
# --------------------------------------------------------------------------------------------------


class BatchCodec:
    """The zstd contexts of one encoder or decode loop, with the static dictionaries loaded once each, when first
    needed (``mapper.wire.dictionaries.load_dictionary``: the package data file, checked against its SHA-256).

    ``dictionary_id`` selects the dictionary new batches are compressed with (0: none); decoding reads the id
    from each batch's flags and accepts every dictionary in ``mapper.wire.dictionaries.DICTIONARY_SHA256``.
    """

    def __init__(self, level: int = DEFAULT_ZSTD_LEVEL, dictionary_id: int | None = None) -> None:
        dict_id = CURRENT_DICTIONARY_ID if dictionary_id is None else dictionary_id
        if dict_id != 0 and dict_id not in DICTIONARY_SHA256:
            raise ValueError(f"telemetry dictionary id {dict_id} is unknown (known: 0, {sorted(DICTIONARY_SHA256)})")
        self.level = level
        self.dictionary_id = dict_id
        self._compressor: zstandard.ZstdCompressor | None = None
        self._plain_compressor: zstandard.ZstdCompressor | None = None
        self._decompressors: dict[int, zstandard.ZstdDecompressor] = {}

    @staticmethod
    def _dict(dict_id: int) -> zstandard.ZstdCompressionDict | None:
        if dict_id == 0:
            return None
        return zstandard.ZstdCompressionDict(load_dictionary(dict_id), dict_type=zstandard.DICT_TYPE_AUTO)

    def _new_compressor(self, dict_id: int) -> zstandard.ZstdCompressor:
        params = zstandard.ZstdCompressionParameters.from_level(
            self.level,
            format=zstandard.FORMAT_ZSTD1_MAGICLESS,
            write_content_size=False,
            write_checksum=False,
            write_dict_id=False,
        )
        return zstandard.ZstdCompressor(compression_params=params, dict_data=self._dict(dict_id))

    def pack(self, body: bytes, version: int = FORMAT_VERSION, *, try_plain: bool = False) -> bytes:
        """The whole batch: magic, version, flags, then the body as a zstd frame when that is smaller.

        ``try_plain``: also compress without the dictionary and keep the smaller frame (a dictionary trained on
        one shape of batch can cost bytes on another, e.g. on a merged batch; twice the compression CPU)."""
        if self._compressor is None:
            self._compressor = self._new_compressor(self.dictionary_id)
        packed = self._compressor.compress(body)
        dict_id = self.dictionary_id
        if try_plain and dict_id != 0:
            if self._plain_compressor is None:
                self._plain_compressor = self._new_compressor(0)
            plain = self._plain_compressor.compress(body)
            if len(plain) < len(packed):
                packed, dict_id = plain, 0
        if len(packed) < len(body):
            return MAGIC + bytes((version, _FLAG_ZSTD | dict_id << _DICT_SHIFT)) + packed
        return MAGIC + bytes((version, 0)) + body

    def unpack(self, flags: int, data: bytes) -> bytes:
        if not flags & _FLAG_ZSTD:
            return data
        dict_id = flags >> _DICT_SHIFT
        dctx = self._decompressors.get(dict_id)
        if dctx is None:
            if dict_id != 0 and dict_id not in DICTIONARY_SHA256:
                raise BatchFormatError(f"batch needs telemetry dictionary {dict_id}, which this reader lacks")
            dctx = zstandard.ZstdDecompressor(dict_data=self._dict(dict_id), format=zstandard.FORMAT_ZSTD1_MAGICLESS)
            self._decompressors[dict_id] = dctx
        try:
            # A damaged header may claim any size, and decompress() allocates what the frame claims up front
            # (MemoryError for 2^61 bytes): the claim is checked first.
            claimed = zstandard.get_frame_parameters(data, format=zstandard.FORMAT_ZSTD1_MAGICLESS).content_size
            if claimed != zstandard.CONTENTSIZE_UNKNOWN and claimed > _MAX_BODY_BYTES:
                raise BatchFormatError(f"batch body claims {claimed} bytes, more than {_MAX_BODY_BYTES}")
            return dctx.decompress(data, max_output_size=_MAX_BODY_BYTES)
        except zstandard.ZstdError as exc:
            raise BatchFormatError(f"batch body does not decompress: {exc}") from None
        except MemoryError:
            raise BatchFormatError("batch body does not fit in memory when decompressed") from None


# --------------------------------------------------------------------------------------------------
# Varints and bit packing
# --------------------------------------------------------------------------------------------------


def _put_uvarint(out: bytearray, n: int) -> None:
    if n < 0x80:  # the usual case: one byte
        out.append(n)
        return
    if n < 0x4000:  # the next most usual: two
        out.append(n & 0x7F | 0x80)
        out.append(n >> 7)
        return
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


def _put_word(meta: bytearray, text: str, header_uuid: str) -> None:
    """One entry of a string dictionary: 0 for "the batch's uuid", else its UTF-8 length + 1 and the bytes."""
    if header_uuid and text == header_uuid:
        meta.append(0)
    else:
        raw = text.encode("utf-8")
        if len(raw) < 0x7F:
            meta.append(len(raw) + 1)
        else:
            _put_uvarint(meta, len(raw) + 1)
        meta += raw


def _pack_bits(out: bytearray, numbers: Sequence[int], width: int) -> None:
    """``numbers`` (each < 2**width) as consecutive ``width``-bit fields, least significant bit first."""
    if width == 0:
        return
    acc = 0
    shift = 0
    for n in numbers:
        acc |= n << shift
        shift += width
    out += acc.to_bytes((shift + 7) // 8, "little")


_GPU_UUID_RE = re.compile(r"GPU-([0-9a-f]{8})-([0-9a-f]{4})-([0-9a-f]{4})-([0-9a-f]{4})-([0-9a-f]{12})")
_BOOT_ID_RE = re.compile(r"[0-9a-f]{16}")
_BOOT_ID4_RE = re.compile(r"[0-9a-f]{8}")


_IDS_UUID_PACKED = 0x01
_IDS_BOOT_PACKED = 0x02
_IDS_NO_UUID = 0x04
_IDS_BOOT_PACKED4 = 0x08


def _put_ids(out: bytearray, uuid: str, boot_id: str) -> None:
    """One byte saying how the ids are written (bit 0: the uuid as 16 bytes, bit 1: the boot id as 8 bytes,
    bit 2: no uuid, for ``uuid == ""``, bit 3: the boot id as 4 bytes), then the uuid (packed or a
    length-prefixed string) unless absent, then the boot id (packed or a length-prefixed string)."""
    mu = _GPU_UUID_RE.fullmatch(uuid)
    mb = len(boot_id) == 16 and _BOOT_ID_RE.fullmatch(boot_id)
    mb4 = len(boot_id) == 8 and _BOOT_ID4_RE.fullmatch(boot_id)
    uuid_bits = _IDS_NO_UUID if not uuid else _IDS_UUID_PACKED if mu else 0
    out.append(uuid_bits | (_IDS_BOOT_PACKED if mb else _IDS_BOOT_PACKED4 if mb4 else 0))
    if mu:
        out += bytes.fromhex(uuid[4:].replace("-", ""))  # the hex digits the match found
    elif uuid:
        _put_str(out, uuid)
    if mb or mb4:
        out += bytes.fromhex(boot_id)
    else:
        _put_str(out, boot_id)


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

    def bits(self, count: int, width: int) -> list[int]:
        if width > _MAX_WIDTH:
            raise BatchFormatError(f"bit width {width} is beyond {_MAX_WIDTH}")
        if width == 0:
            return [0] * count
        acc = int.from_bytes(self.take((count * width + 7) // 8), "little")
        mask = (1 << width) - 1
        out = []
        for _ in range(count):
            out.append(acc & mask)
            acc >>= width
        return out

    def ids(self) -> tuple[str, str]:
        """The uuid ("" when the batch carries none) and the boot id (see ``_put_ids``)."""
        packed = self.byte()
        if (
            packed > 15
            or packed & (_IDS_NO_UUID | _IDS_UUID_PACKED) == _IDS_NO_UUID | _IDS_UUID_PACKED
            or packed & (_IDS_BOOT_PACKED | _IDS_BOOT_PACKED4) == _IDS_BOOT_PACKED | _IDS_BOOT_PACKED4
        ):
            raise BatchFormatError(f"unknown id packing {packed}")
        if packed & _IDS_NO_UUID:
            uuid = ""
        else:
            uuid = _uuid_text(self.take(16).hex()) if packed & _IDS_UUID_PACKED else self.text()
        if packed & _IDS_BOOT_PACKED:
            boot_id = self.take(8).hex()
        elif packed & _IDS_BOOT_PACKED4:
            boot_id = self.take(4).hex()
        else:
            boot_id = self.text()
        return uuid, boot_id


def _uuid_text(h: str) -> str:
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


_DOUBLE = struct.Struct("<d")
_QWORD = struct.Struct("<Q")


def _bits(v: float) -> int:
    return int(_QWORD.unpack(_DOUBLE.pack(v))[0])


def _from_bits(n: int) -> float:
    return float(_DOUBLE.unpack(_QWORD.pack(n))[0])


# --------------------------------------------------------------------------------------------------
# Integer columns: the cheapest of values / deltas / delta-of-deltas, frame of reference, gcd, bit packing
# --------------------------------------------------------------------------------------------------


class _IntPlan(NamedTuple):
    order: int
    seeds: list[int]
    base: int
    gcd: int
    width: int
    #: The values (order 0) or differences (order 1, 2) coded as base + gcd * field.
    seq: Sequence[int]
    cost: int


def _int_plan(ints: Sequence[int]) -> _IntPlan:
    """The smallest coding of a non-constant int column (at least two values): values, deltas or
    delta-of-deltas, each as base + gcd * field with fields bit-packed at the smallest width."""
    return _IntPlan(*_plan_fields(ints))


#: Fields per block of a blocked plan (format 3).
BLOCK_FIELDS = 32
_BLOCKED = 3


class _BlockedPlan(NamedTuple):
    """Format 3 only: as ``_IntPlan``, but the fields come in blocks of ``BLOCK_FIELDS``, each at its own width
    (a long column of a merged batch is narrow in its quiet stretches and wide only where it is busy)."""

    order: int
    seeds: list[int]
    base: int
    gcd: int
    widths: list[int]
    seq: Sequence[int]
    cost: int


def _blocked_plan(ints: Sequence[int]) -> _IntPlan | _BlockedPlan:
    """The smaller of ``_int_plan`` and the cheapest blocked plan of the three orders (format 3's planner)."""
    flat = _int_plan(ints)
    n = len(ints)
    if n < 2 * BLOCK_FIELDS:
        return flat
    best: _IntPlan | _BlockedPlan = flat
    seq: list[int] = list(ints)
    seeds: list[int] = []
    for order in range(3):
        if order:
            seeds.append(seq[0])
            seq = list(map(operator.sub, seq[1:], seq))
        if len(seq) < 2 * BLOCK_FIELDS:
            break
        g = math.gcd(*(x - seq[0] for x in seq)) or 1
        base = min(seq)
        widths = [((max(seq[i : i + BLOCK_FIELDS]) - base) // g).bit_length() for i in range(0, len(seq), BLOCK_FIELDS)]
        nbits = sum(w * len(seq[i * BLOCK_FIELDS : (i + 1) * BLOCK_FIELDS]) for i, w in enumerate(widths))
        cost = sum(_zz_len(x) for x in seeds) + _order_cost(base, g, 0, 0) + len(widths) + (nbits + 7) // 8
        if cost < best.cost:
            best = _BlockedPlan(order, list(seeds), base, g, widths, seq, cost)
    return best


def _zz_len(x: int) -> int:
    return ((~x if x < 0 else x).bit_length() + 7) // 7


_PlanFields = tuple[int, list[int], int, int, int, Sequence[int], int]


def _order_cost(base: int, g: int, width: int, count: int) -> int:
    """The bytes of one order's coding but its seeds: the base (div gcd), the gcd and base mod gcd when the gcd is
    above 1, the width and the ``count`` fields of ``width`` bits. (The zigzag varint length is written out: a plan
    calls this for each order whose gcd is above 1 or whose width needs two bytes.)"""
    q = base // g
    cost = 1 if -64 <= q < 64 else ((q << 1 if q >= 0 else (-q << 1) - 1).bit_length() + 6) // 7
    if g > 1:
        cost += (((base % g).bit_length() + 6) // 7 or 1) + (g.bit_length() + 6) // 7
    return cost + (1 if width < 32 else ((width << 2).bit_length() + 6) // 7) + (count * width + 7) // 8


def _plan_fields(values: Sequence[int]) -> _PlanFields:
    """``_int_plan`` as a plain tuple, the three orders written out (this runs for every changing int or decimal
    column of every batch). On a tie the lower order wins. The gcd of every x - base is the gcd of the
    differences: each is a sum of consecutive differences.

    Each order costs a handful of C calls (one ``sorted`` gives both ends of a column, cheaper than ``min`` and
    ``max``); the usual head (no gcd, a width below 32) is costed inline, ``_order_cost`` does the rest. The bytes of
    x as a zigzag varint are ``((~x if x < 0 else x).bit_length() + 7) // 7``: zigzag doubles x >= 0 (one bit more)
    and maps x < 0 to 2 * ~x + 1."""
    sub, gcd, order_cost = operator.sub, math.gcd, _order_cost
    n = len(values)
    d1 = list(map(sub, values[1:], values))
    ends = sorted(values)
    base = ends[0]
    g = gcd(*d1) or 1
    width = ((ends[-1] - base) // g).bit_length()
    if g == 1 and width < 32:  # the usual head: the base as a zigzag varint, the width in one byte
        cost = ((~base if base < 0 else base).bit_length() + 7) // 7 + 1 + (n * width + 7) // 8
    else:
        cost = order_cost(base, g, width, n)
    best: _PlanFields = (0, [], base, g, width, values, cost)
    # Width 0 (a constant sequence): each further order costs one byte more (a seed repeats the base, and the new
    # base is 0), so it cannot win; nor is there a further order below 3 values.
    if n < 3 or width == 0:
        return best
    s0 = values[0]
    seeds_cost = ((~s0 if s0 < 0 else s0).bit_length() + 7) // 7
    d2 = list(map(sub, d1[1:], d1))
    ends = sorted(d1)
    base = ends[0]
    g = gcd(*d2) or 1
    width = ((ends[-1] - base) // g).bit_length()
    if g == 1 and width < 32:
        cost = seeds_cost + ((~base if base < 0 else base).bit_length() + 7) // 7 + 1 + ((n - 1) * width + 7) // 8
    else:
        cost = seeds_cost + order_cost(base, g, width, n - 1)
    if cost < best[6]:
        best = (1, [s0], base, g, width, d1, cost)
    if n < 4 or width == 0:
        return best
    s1 = d1[0]
    seeds_cost += ((~s1 if s1 < 0 else s1).bit_length() + 7) // 7
    ends = sorted(d2)
    base = ends[0]
    span = ends[-1] - base
    # The gcd of the third differences divides the first of them and d2's range (a sum of some of them), so the
    # gcd of those two is a multiple of it: when 1, it is the gcd; else it bounds the width from below, and the
    # third differences are worked out only when that bound does not rule the order out already.
    g = gcd(d2[1] - d2[0], span) or 1
    if g > 1:
        if seeds_cost + 2 + ((n - 2) * (span // g).bit_length() + 7) // 8 >= best[6]:
            return best
        g = gcd(*map(sub, d2[1:], d2))
    width = (span // g).bit_length()
    if g == 1 and width < 32:
        cost = seeds_cost + ((~base if base < 0 else base).bit_length() + 7) // 7 + 1 + ((n - 2) * width + 7) // 8
    else:
        cost = seeds_cost + order_cost(base, g, width, n - 2)
    if cost < best[6]:
        best = (2, [s0, s1], base, g, width, d2, cost)
    return best


class _BitWriter:
    """One bit stream for every packed field of a batch, least significant bit first."""

    __slots__ = ("acc", "nbits")

    def __init__(self) -> None:
        self.acc = 0
        self.nbits = 0

    def put(self, numbers: Sequence[int], width: int) -> None:
        if width:
            # The fields side by side as one int, summed in C (the fields do not overlap, so + is |); the stream's
            # own int is shifted and copied once per call.
            shift = len(numbers) * width
            self.acc |= sum(map(operator.lshift, numbers, range(0, shift, width))) << self.nbits
            self.nbits += shift

    def put_offsets(self, seq: Sequence[int], base: int, g: int, width: int) -> None:
        """``put`` of ``(x - base) // g`` for each x of ``seq`` (each a multiple of g above base), without making
        the fields one by one: the sum of ``x << shift`` less ``base`` times the sum of ``1 << shift`` (a repunit in
        base 2**width) is the sum of ``(x - base) << shift``, which is g times the packed fields."""
        if width:
            shift = len(seq) * width
            chunk = sum(map(operator.lshift, seq, range(0, shift, width)))
            if base:
                chunk -= base * (((1 << shift) - 1) // ((1 << width) - 1))
            self.acc |= (chunk // g if g > 1 else chunk) << self.nbits
            self.nbits += shift

    def bytes(self) -> bytes:
        return self.acc.to_bytes((self.nbits + 7) // 8, "little")


class _BitReader:
    __slots__ = ("acc", "left")

    def __init__(self, data: bytes) -> None:
        self.acc = int.from_bytes(data, "little")
        self.left = len(data) * 8

    def take(self, count: int, width: int) -> list[int]:
        if width == 0:
            return [0] * count
        if count * width > self.left:
            raise BatchFormatError("batch truncated inside its bit stream")
        acc, mask = self.acc, (1 << width) - 1
        out = []
        for _ in range(count):
            out.append(acc & mask)
            acc >>= width
        self.acc = acc
        self.left -= count * width
        return out


#: Format 4 only: the rows a segment boundary may fall on in a busy column (every changing column's segments start
#: at a multiple of this, or where its value changes when it changes rarely), and how many such steps one segment
#: may span at most while planning.
SEGMENT_STEP = 8
SEGMENT_REACH = 32
_SEGMENTED = 4
_SPARSE = 6
#: A radix code below this is the radix less one (exact, lower bound unrounded); from it on, ``_radix_of``.
_RADIX_EXACT = 32
_MAX_RADIX_EXP = 4096


class _SegPlan(NamedTuple):
    """Format 4 only: the values (order 0) or differences (order 1, 2) as ``residue + gcd * y``, the ys cut into
    segments, each coded as ``lo + f`` with every f below the segment's radix R, the fields of a segment written
    as ONE number in base R (mixed radix: ``log2(R)`` bits a field, not a whole bit more). A quiet stretch costs
    nothing (R = 1), a busy one what its own range needs; where the segments fall is planned per column."""

    order: int
    seeds: list[int]
    gcd: int
    residue: int
    #: (rows, radix code, lo) per segment.
    segments: list[tuple[int, int, int]]
    ys: Sequence[int]
    cost: int


def _radix_of(code: int) -> tuple[int, int]:
    """The radix R of a radix code and the exponent e of its lower bound's unit (the lower bound is a multiple of
    2**e): codes below 32 are R = code + 1, e = 0; then R = (16 + m) << e, code = 32 + 16 * (e - 1) + m."""
    if code < _RADIX_EXACT:
        return code + 1, 0
    e, m = divmod(code - _RADIX_EXACT, 16)
    return (16 + m) << (e + 1), e + 1


def _radix_code(lo: int, hi: int) -> tuple[int, int, int, int]:
    """The smallest radix code whose (rounded) range covers ``lo .. hi``: (code, R, lo rounded down to 2**e, e)."""
    span = hi - lo + 1
    if span <= _RADIX_EXACT:
        return span - 1, span, lo, 0
    e = max(1, (span - 1).bit_length() - 5)
    while True:
        low = lo >> e << e
        k = -(-(hi - low + 1) >> e)  # units of 2**e needed
        if k <= 31:
            m = max(0, k - 16)
            return _RADIX_EXACT + 16 * (e - 1) + m, (16 + m) << e, low, e
        e += 1


def _uv_len(n: int) -> int:
    return (n.bit_length() + 6) // 7 or 1


def _segments(ys: Sequence[int]) -> tuple[list[tuple[int, int, int]], float]:
    """The cheapest cut of ``ys`` into segments (dynamic programming over the candidate boundaries) and its cost
    in bits: per segment its rows, radix code and lower bound (each a varint) and ``rows * log2(R)`` bits."""
    n = len(ys)
    changes = [i for i in range(1, n) if ys[i] != ys[i - 1]]
    if len(changes) * SEGMENT_STEP < n:  # a quiet column: boundaries where it changes
        cands = [0, *changes, n]
    else:  # a busy one: every SEGMENT_STEP rows, and where it jumps most (a step up or down of its level)
        jumps = sorted(range(1, n), key=lambda i: abs(ys[i] - ys[i - 1]), reverse=True)[: n // SEGMENT_STEP]
        cands = sorted({*range(0, n, 2 * SEGMENT_STEP), *jumps, n})
    m = len(cands)
    pieces = [ys[cands[k] : cands[k + 1]] for k in range(m - 1)]
    pmin = [min(p) for p in pieces]
    pmax = [max(p) for p in pieces]
    inf = float("inf")
    best = [inf] * m
    best[0] = 0.0
    back = [0] * m
    seg_at: list[tuple[int, int, int]] = [(0, 0, 0)] * m
    log2 = math.log2
    for a in range(m - 1):
        here = best[a]
        prev_lo = seg_at[a][2]
        start = cands[a]
        lo, hi = pmin[a], pmax[a]
        for b in range(a + 1, min(m, a + 1 + SEGMENT_REACH)):
            if pmin[b - 1] < lo:
                lo = pmin[b - 1]
            if pmax[b - 1] > hi:
                hi = pmax[b - 1]
            rows = cands[b] - start
            span = hi - lo + 1
            if span <= _RADIX_EXACT:
                code, radix, low, e = span - 1, span, lo, 0
            else:
                code, radix, low, e = _radix_code(lo, hi)
            d = (low >> e) - (prev_lo >> e)
            d = d << 1 if d >= 0 else (-d << 1) - 1
            # The three varints' bytes (written out for the usual one-byte case: this is the planner's inner loop).
            head = (1 if rows < 0x80 else _uv_len(rows)) + (1 if code < 0x80 else _uv_len(code))
            head += 1 if d < 0x80 else _uv_len(d)
            cost = here + 8 * head + (rows * log2(radix) if radix > 1 else 0.0)
            if cost < best[b]:
                best[b] = cost
                back[b] = a
                seg_at[b] = (rows, code, low)
    out = []
    b = m - 1
    while b:
        out.append(seg_at[b])
        b = back[b]
    out.reverse()
    return out, best[m - 1]


def _segment_plan(ints: Sequence[int], flat: _IntPlan | _BlockedPlan) -> _SegPlan | None:
    """The cheaper segmented plan of orders 0 and 1 (None for a column too short to be worth planning). Order 1
    is planned only when the flat plan (``flat``) found differences cheaper than values: a column whose values are
    cheaper whole is noise about a level, which differencing only widens."""
    if len(ints) < 2 * SEGMENT_STEP:
        return None
    best: _SegPlan | None = None
    seq: Sequence[int] = ints
    seeds: list[int] = []
    for order in range(2 if flat.order else 1):
        if order:
            seeds = [seq[0]]
            seq = list(map(operator.sub, seq[1:], seq))
        s0 = seq[0]
        g = math.gcd(*(x - s0 for x in seq)) or 1
        residue = s0 % g
        ys = [(x - residue) // g for x in seq] if g > 1 else seq
        segments, bits = _segments(ys)
        cost = (
            sum(_zz_len(x) for x in seeds)
            + (_uv_len(g) + _uv_len(residue) if g > 1 else 0)
            + 1
            + _uv_len(len(segments))
            + math.ceil(bits / 8)
        )
        if best is None or cost < best.cost:
            best = _SegPlan(order, list(seeds), g, residue, segments, ys, cost)
    return best


class _SparsePlan(NamedTuple):
    """Format 4 only: the values (order 0) or differences (order 1) are one value, the mode, but at a few
    positions (a counter that rarely steps, a level that rarely moves): the mode, then the exceptions as two
    small int columns of their own, the gaps between them and their values (each a flat plan)."""

    order: int
    seeds: list[int]
    mode: int
    n_exceptions: int
    gaps: _PlanFields
    values: _PlanFields
    cost: int
    #: No gcd in the meta part (the values' plan has its own).
    gcd: int = 1


def _sparse_plan(ints: Sequence[int], flat: _IntPlan | _BlockedPlan) -> _SparsePlan | None:
    """The cheaper sparse plan of orders 0 and 1 (order 1 only when ``flat`` found differences cheaper), or None
    when no order has at least two exceptions and at most one field in four an exception."""
    best: _SparsePlan | None = None
    seq: Sequence[int] = ints
    seeds: list[int] = []
    for order in range(2 if flat.order else 1):
        if order:
            seeds = [seq[0]]
            seq = list(map(operator.sub, seq[1:], seq))
        mode, count = Counter(seq).most_common(1)[0]
        n_exc = len(seq) - count
        if n_exc < 2 or n_exc * 4 > len(seq):
            continue
        where = [i for i, x in enumerate(seq) if x != mode]
        gaps = _plan_fields([b - a - 1 for a, b in zip([-1, *where], where, strict=False)])
        values = _plan_fields([seq[i] for i in where])
        cost = (
            sum(_zz_len(x) for x in seeds) + 1 + _zz_len(mode) + _uv_len(n_exc) + _flat_cost(gaps) + _flat_cost(values)
        )
        if best is None or cost < best.cost:
            best = _SparsePlan(order, list(seeds), mode, n_exc, gaps, values, cost)
    return best


def _flat_cost(plan: _PlanFields) -> int:
    """The bytes of a flat plan written whole into the data part (``_put_flat``): its cost, with the gcd and the
    base's residue as varints of their own."""
    g = plan[3]
    return plan[6] + (_uv_len(g) + _uv_len(plan[2] % g) if g > 1 else 1)


def _merged_plan(ints: Sequence[int]) -> _IntPlan | _BlockedPlan | _SegPlan | _SparsePlan:
    """Format 4's planner: the smallest of ``_blocked_plan``, the segmented and the sparse plans."""
    flat = _blocked_plan(ints)
    best: _IntPlan | _BlockedPlan | _SegPlan | _SparsePlan = flat
    for other in (_segment_plan(ints, flat), _sparse_plan(ints, flat)):
        if other is not None and other.cost < best.cost:
            best = other
    return best


def _put_mixed_radix(bits: _BitWriter, fields: Sequence[int], radix: int) -> None:
    """``fields`` (each below ``radix``) as one number in base ``radix``, first field least significant, in
    ``(radix ** len(fields) - 1).bit_length()`` bits; a power of two is plain bit packing (the same bits)."""
    if radix == 1:
        return
    if radix & (radix - 1) == 0:
        bits.put(fields, radix.bit_length() - 1)
        return
    number = 0
    for f in reversed(fields):
        number = number * radix + f
    bits.put((number,), (radix ** len(fields) - 1).bit_length())


def _take_mixed_radix(bits: _BitReader, count: int, radix: int) -> list[int]:
    if radix == 1:
        return [0] * count
    if radix & (radix - 1) == 0:
        return bits.take(count, radix.bit_length() - 1)
    if count * (radix.bit_length() - 1) > bits.left:
        raise BatchFormatError("batch truncated inside its bit stream")
    number = bits.take(1, (radix**count - 1).bit_length())[0]
    out = []
    for _ in range(count):
        number, f = divmod(number, radix)
        out.append(f)
    if number:
        raise BatchFormatError(f"a segment of {count} fields in base {radix} holds a larger number")
    return out


class _Sections:
    """A body is written in three parts: ``meta`` (what stays the same from batch to batch: names, kinds,
    constants, string dictionaries), ``data`` (per-batch varints: seeds, bases, widths, bitmaps) and one bit
    stream of packed fields. Keeping the stable part together lets the static dictionary match it whole."""

    __slots__ = ("bits", "data", "meta")

    def __init__(self) -> None:
        self.meta = bytearray()
        self.data = bytearray()
        self.bits = _BitWriter()

    def blocked_plan(self, plan: _BlockedPlan) -> None:
        """Format 3: meta: [gcd, base mod gcd]; data: order << 2 | 3, seeds, base (div gcd), one width per block;
        bits: each block's fields at its width."""
        order, seeds, base, g, widths, seq, _ = plan
        if g > 1:
            _put_uvarint(self.meta, g)
            _put_uvarint(self.meta, base % g)
        data = self.data
        data.append(order << 2 | _BLOCKED)
        for x in seeds:
            _put_uvarint(data, _zz(x))
        _put_uvarint(data, _zz(base // g))
        for i, width in enumerate(widths):
            _put_uvarint(data, width)
            self.bits.put_offsets(seq[i * BLOCK_FIELDS : (i + 1) * BLOCK_FIELDS], base, g, width)

    def segment_plan(self, plan: _SegPlan) -> None:
        """Format 4: meta: [gcd, residue]; data: (4 + order) << 2 | 3, seeds, the number of segments, then per
        segment its rows, radix code and lower bound (zigzag, in units of its 2**e, less the previous segment's
        lower bound in those units); bits: each segment's fields as one mixed-radix number."""
        order, seeds, g, residue, segments, ys, _ = plan
        if g > 1:
            _put_uvarint(self.meta, g)
            _put_uvarint(self.meta, residue)
        data = self.data
        _put_uvarint(data, (_SEGMENTED + order) << 2 | _BLOCKED)
        for x in seeds:
            _put_uvarint(data, _zz(x))
        _put_uvarint(data, len(segments))
        # Each list on its own (the rows of every segment, then the codes, then the bounds): columns that change
        # level together have the same rows, which zstd then finds as one repeat.
        for rows, _, _ in segments:
            _put_uvarint(data, rows)
        for _, code, _ in segments:
            _put_uvarint(data, code)
        prev_lo = 0
        pos = 0
        for rows, code, lo in segments:
            radix, e = _radix_of(code)
            _put_uvarint(data, _zz((lo >> e) - (prev_lo >> e)))
            _put_mixed_radix(self.bits, [y - lo for y in ys[pos : pos + rows]], radix)
            prev_lo = lo
            pos += rows

    def sparse_plan(self, plan: _SparsePlan) -> None:
        """Format 4: data: (6 + order) << 2 | 3, seeds, zz(mode), the number of exceptions, then the gaps and
        the values of the exceptions, each a flat plan written whole here (``_put_flat``)."""
        order, seeds, mode, count, gaps, values, _, _ = plan
        data = self.data
        _put_uvarint(data, (_SPARSE + order) << 2 | _BLOCKED)
        for x in seeds:
            _put_uvarint(data, _zz(x))
        _put_uvarint(data, _zz(mode))
        _put_uvarint(data, count)
        self._put_flat(gaps)
        self._put_flat(values)

    def _put_flat(self, plan: _PlanFields) -> None:
        """A flat plan in the data part only: width << 2 | order, seeds, gcd (1: none), residue when the gcd is
        above 1, zz(base div gcd); its fields in the bit stream."""
        order, seeds, base, g, width, seq, _ = plan
        data = self.data
        _put_uvarint(data, width << 2 | order)
        for x in seeds:
            _put_uvarint(data, _zz(x))
        _put_uvarint(data, g)
        if g > 1:
            _put_uvarint(data, base % g)
        _put_uvarint(data, _zz(base // g))
        self.bits.put_offsets(seq, base, g, width)

    def plan(self, plan: _IntPlan | _PlanFields | _BlockedPlan | _SegPlan | _SparsePlan) -> None:
        """Meta: [gcd, base mod gcd]; data: width << 2 | order, seeds, base (div gcd); bits: fields. (Zigzag is
        written out here: this runs for every changing column of every batch.)"""
        if type(plan) is _BlockedPlan:
            self.blocked_plan(plan)
            return
        if type(plan) is _SegPlan:
            self.segment_plan(plan)
            return
        if type(plan) is _SparsePlan:
            self.sparse_plan(plan)
            return
        order, seeds, base, g, width, seq, _ = cast("_PlanFields", plan)
        data = self.data
        if g > 1:
            _put_uvarint(self.meta, g)
            _put_uvarint(self.meta, base % g)
            q = base // g
        else:
            q = base
        head = width << 2 | order
        if head < 0x80:
            data.append(head)
        else:
            _put_uvarint(data, head)
        for s in seeds:
            _put_uvarint(data, s << 1 if s >= 0 else (-s << 1) - 1)
        q = q << 1 if q >= 0 else (-q << 1) - 1
        if q < 0x80:
            data.append(q)
        else:
            _put_uvarint(data, q)
        self.bits.put_offsets(seq, base, g, width)


# --------------------------------------------------------------------------------------------------
# Series
# --------------------------------------------------------------------------------------------------


#: The type code of each value type (``_type_of`` also takes subclasses of int, float and str).
_TYPE_CODES: dict[type, int] = {bool: _T_BOOL, int: _T_INT, float: _T_DEC, str: _T_STR}


def _type_of(value: Value) -> int:
    code = _TYPE_CODES.get(type(value))
    if code is not None:
        return code
    if isinstance(value, bool):
        return _T_BOOL
    if isinstance(value, int):
        return _T_INT
    if isinstance(value, float):
        return _T_DEC
    if isinstance(value, str):
        return _T_STR
    raise TypeError(f"telemetry value {value!r} has type {type(value).__name__}; expected int, float, str or bool")


_POWERS_OF_TEN = tuple(10**d for d in range(_MAX_DECIMALS + 1))


def _decimals(values: Sequence[float]) -> tuple[int, list[int]] | None:
    """The fewest decimals d such that every value equals round(v * 10**d) / 10**d exactly, with the values
    times 10**d; None when no d up to ``_MAX_DECIMALS`` does, or a value is not finite, too big or -0.0.

    The checks a value at a time are only the round trip (usually failing at the first value, for the d too
    small): -0.0 is looked for only when a zero is there, a NaN or an infinity makes ``round`` raise, and a value
    beyond the limit makes its int fail the limit test, which is made on the whole column at once."""
    if 0.0 in values and any(v == 0.0 and math.copysign(1.0, v) < 0 for v in values):
        return None  # -0.0 equals 0.0 but has other bits
    float_round = float.__round__  # round() of a float without the builtin's look-up of __round__
    try:
        for d, scale in enumerate(_POWERS_OF_TEN):
            ints = []
            for v in values:
                i = float_round(v * scale)
                if i / scale != v:
                    break  # usually at the first value: try the next d
                ints.append(i)
            else:
                if max(ints) < _DEC_LIMIT and min(ints) > -_DEC_LIMIT:
                    return d, ints
    except (ValueError, OverflowError):  # round() of a NaN or an infinity (or of a value too big for 10**d)
        return None
    return None


def _decimal(value: float) -> tuple[int, int] | None:
    """``_decimals`` of a single value (a constant column): its decimals d and the value times 10**d."""
    if not abs(value) < _DEC_LIMIT or (value == 0.0 and math.copysign(1.0, value) < 0):  # NaN compares false too
        return None
    for d, scale in enumerate(_POWERS_OF_TEN):
        i = float.__round__(value * scale)
        if i / scale == value and abs(i) < _DEC_LIMIT:
            return d, i
    return None


def _encode_series(
    out: _Sections,
    name: str,
    rows: Sequence[int],
    values: Sequence[Value],
    vtype: int,
    n_rows: int,
    header_uuid: str,
    planner: Callable[[Sequence[int]], _IntPlan | _BlockedPlan | _SegPlan | _SparsePlan] = _int_plan,
) -> None:
    meta, data = out.meta, out.data
    code = _KNOWN_CODE.get(name, 0)
    _put_uvarint(meta, code)
    if code == 0:
        _put_str(meta, name)
    types = set(map(type, values))
    # Every value of one type and equal to the first (a NaN equals itself here: see the XOR case).
    const = len(types) == 1 and values.count(values[0]) == len(values)
    kind = vtype
    scale: int | None = None
    ints: Sequence[int] = ()
    if vtype == _T_DEC:
        floats = cast("Sequence[float]", values) if types == {float} else [float(v) for v in values]
        decimals = _decimals(floats)
        if decimals is None:
            kind = _T_XOR
            const = all(_bits(v) == _bits(floats[0]) for v in floats)
        else:
            scale, ints = decimals
    elif vtype == _T_INT:
        ints = cast("Sequence[int]", values) if types == {int} else [int(v) for v in values]
    dense = len(rows) == n_rows
    plan = planner(ints) if ints and not const else None
    gcd_flag = _K_GCD if plan is not None and plan.gcd > 1 else 0
    meta.append(kind | (_K_DENSE if dense else 0) | (_K_CONST if const else 0) | gcd_flag)
    if not dense:
        data += _row_bitmap(rows, n_rows)
    if kind in (_T_INT, _T_DEC):
        if kind == _T_DEC:
            assert scale is not None
            _put_uvarint(meta, scale)
        if plan is None:
            _put_uvarint(meta, _zz(ints[0]))
        else:
            out.plan(plan)
    elif kind == _T_XOR:
        if const:
            _put_uvarint(meta, _bits(float(values[0])))
        else:
            prev = 0
            for v in values:
                b = _bits(float(v))
                _put_uvarint(data, b ^ prev)
                prev = b
    elif kind == _T_STR:
        texts = cast("Sequence[str]", values) if types == {str} else [str(v) for v in values]
        index = {text: i for i, text in enumerate(dict.fromkeys(texts))}
        _put_uvarint(meta, len(index))
        for text in index:
            _put_word(meta, text, header_uuid)
        if not const:
            out.bits.put([index[text] for text in texts], (len(index) - 1).bit_length())
    elif const:  # bool
        meta.append(1 if values[0] else 0)
    else:
        out.bits.put([1 if v else 0 for v in values], 1)


def _row_bitmap(rows: Iterable[int], n_rows: int) -> bytearray:
    """Which of a batch's ``n_rows`` rows a series has a value in: bit ``r & 7`` of byte ``r >> 3`` for row r."""
    bitmap = bytearray((n_rows + 7) // 8)
    for r in rows:
        bitmap[r >> 3] |= 1 << (r & 7)
    return bitmap


def _uvarint_bytes(n: int) -> bytes:
    out = bytearray()
    _put_uvarint(out, n)
    return bytes(out)


#: The meta bytes that open a known series: its code as a varint.
_SERIES_CODE_BYTES: dict[str, bytes] = {name: _uvarint_bytes(code) for name, code in _KNOWN_CODE.items()}


def _encode_dense_columns(
    out: _Sections,
    names: Sequence[str],
    codes: Sequence[int],
    cols: Sequence[Sequence[Any]],
    header_uuid: str,
    col_rows: Sequence[Sequence[int] | None] | None = None,
    n_rows: int = 0,
) -> None:
    """``_encode_series`` of every column of a ``_dense_columns`` batch: the very same bytes, with the usual series
    (a known name, a constant, an int, decimal or string column) written here without the general case's tests.
    ``col_rows`` (a ``_grouped_columns`` batch of ``n_rows`` rows): each column's rows, None where it has a value
    in every row; a column with fewer rows is written as ``_encode_series`` writes it, its kind without the dense
    flag and its row bitmap first in the data part.

    This runs for each of the ~36 columns of every batch, so the loop body is kept short: the kind bytes are
    precomputed (``_KIND_*``) and zigzag is written out rather than called."""
    meta, data = out.meta, out.data
    put_uvarint = _put_uvarint
    code_bytes = _SERIES_CODE_BYTES
    bitmap_rows: Sequence[int] | None = None
    bitmap = b""
    for i, (name, vtype, values) in enumerate(zip(names, codes, cols, strict=True)):
        n = len(values)
        rows = col_rows[i] if col_rows is not None else None
        if rows is None:
            rows, undense, n_all = range(n), 0, n
        else:  # the kind bytes below carry the dense flag: XOR takes it off again
            undense, n_all = _K_DENSE, n_rows
            if rows is not bitmap_rows:  # the columns of one kind of row share their rows and bitmap
                bitmap_rows, bitmap = rows, bytes(_row_bitmap(rows, n_rows))
        prefix = code_bytes.get(name)
        if prefix is None:
            # A name of no code (a pod's series, say): code 0, then the name, as _encode_series writes it.
            named = bytearray(b"\x00")
            _put_str(named, name)
            prefix = bytes(named)
        v0 = values[0]
        # Same test as ``_encode_series``: equal to the first value, or the very same object (a NaN).
        if values.count(v0) == n:
            if vtype == _T_INT:
                meta += prefix
                meta.append(_KIND_CONST_INT ^ undense)
                if undense:
                    data += bitmap
                if 0 <= v0 < 0x40:
                    meta.append(v0 << 1)
                else:
                    put_uvarint(meta, v0 << 1 if v0 >= 0 else (-v0 << 1) - 1)
            elif vtype == _T_DEC:
                if v0 == 0.0:  # 0.0 and -0.0 are equal but differ in bits and coding: the general case
                    _encode_series(out, name, rows, values, vtype, n_all, header_uuid)
                    continue
                # Values equal to a float other than zero, or the same NaN object, have its very bits.
                dec = _decimal(v0)
                meta += prefix
                if undense:
                    data += bitmap
                if dec is None:
                    meta.append(_KIND_CONST_XOR ^ undense)
                    put_uvarint(meta, _bits(v0))
                else:
                    scale, d = dec
                    meta.append(_KIND_CONST_DEC ^ undense)
                    meta.append(scale)  # at most _MAX_DECIMALS: one byte
                    put_uvarint(meta, d << 1 if d >= 0 else (-d << 1) - 1)
            elif vtype == _T_STR:
                meta += prefix
                meta.append(_KIND_CONST_STR ^ undense)
                if undense:
                    data += bitmap
                meta.append(1)  # a dictionary of one string
                _put_word(meta, v0, header_uuid)
            else:  # bool
                meta += prefix
                meta.append(_KIND_CONST_BOOL ^ undense)
                if undense:
                    data += bitmap
                meta.append(1 if v0 else 0)
        elif vtype == _T_INT:
            plan = _plan_fields(values)
            meta += prefix
            meta.append((_KIND_INT_GCD if plan[3] > 1 else _KIND_INT) ^ undense)
            if undense:
                data += bitmap
            out.plan(plan)
        elif vtype == _T_DEC and (decimals := _decimals(values)) is not None:
            plan = _plan_fields(decimals[1])
            meta += prefix
            meta.append((_KIND_DEC_GCD if plan[3] > 1 else _KIND_DEC) ^ undense)
            if undense:
                data += bitmap
            meta.append(decimals[0])
            out.plan(plan)
        elif vtype == _T_STR:
            words = dict.fromkeys(values, 0)  # each string once, in first-seen order; then its index
            meta += prefix
            meta.append(_KIND_STR ^ undense)
            if undense:
                data += bitmap
            put_uvarint(meta, len(words))
            for w, text in enumerate(words):
                _put_word(meta, text, header_uuid)
                words[text] = w
            out.bits.put(list(map(words.__getitem__, values)), (len(words) - 1).bit_length())
        else:  # XOR floats, changing bools
            _encode_series(out, name, rows, values, vtype, n_all, header_uuid)


#: The kind bytes of the dense series ``_encode_dense_columns`` writes itself (module constants: Python does not
#: fold ``_T_INT | _K_DENSE | _K_CONST`` at compile time).
_KIND_CONST_INT = _T_INT | _K_DENSE | _K_CONST
_KIND_CONST_DEC = _T_DEC | _K_DENSE | _K_CONST
_KIND_CONST_XOR = _T_XOR | _K_DENSE | _K_CONST
_KIND_CONST_STR = _T_STR | _K_DENSE | _K_CONST
_KIND_CONST_BOOL = _T_BOOL | _K_DENSE | _K_CONST
_KIND_INT = _T_INT | _K_DENSE
_KIND_INT_GCD = _T_INT | _K_DENSE | _K_GCD
_KIND_DEC = _T_DEC | _K_DENSE
_KIND_DEC_GCD = _T_DEC | _K_DENSE | _K_GCD
_KIND_STR = _T_STR | _K_DENSE


#: Placeholder for "the batch's uuid" in a string dictionary until the uuid is read (compared by identity).
_HEADER_UUID = "\x00uuid"


class _Column:
    """A series as read from the meta part; ``finish`` completes it from the data part and the bit stream."""

    __slots__ = ("const_value", "gcd", "kind", "name", "residue", "scale", "words")

    def __init__(self, r: _Reader) -> None:
        code = r.uvarint()
        if code == 0:
            self.name = r.text()
        elif code <= len(KNOWN_SERIES):
            self.name = KNOWN_SERIES[code - 1]
        else:
            raise BatchFormatError(f"unknown series code {code} (this reader knows {len(KNOWN_SERIES)})")
        self.kind = kind = r.byte()
        vtype, const = kind & 0x07, bool(kind & _K_CONST)
        self.scale = 0
        self.gcd = 1
        self.residue = 0
        self.words: list[str] = []
        self.const_value: Value | None = None
        if vtype in (_T_INT, _T_DEC):
            if vtype == _T_DEC:
                self.scale = r.uvarint()
                if self.scale > _MAX_DECIMALS:
                    raise BatchFormatError(f"series {self.name!r}: {self.scale} decimals is beyond {_MAX_DECIMALS}")
            if kind & _K_GCD:
                self.gcd = r.uvarint()
                if self.gcd < 2:
                    raise BatchFormatError(f"series {self.name!r}: gcd {self.gcd} is below 2")
                self.residue = r.uvarint()
            if const:
                self.const_value = self._num(_unzz(r.uvarint()))
        elif vtype == _T_XOR:
            if const:
                self.const_value = self._float_bits(r.uvarint())
        elif vtype == _T_STR:
            for _ in range(r.uvarint()):
                size = r.uvarint()
                if size == 0:
                    self.words.append(_HEADER_UUID)
                    continue
                try:
                    self.words.append(r.take(size - 1).decode("utf-8"))
                except UnicodeDecodeError as exc:
                    raise BatchFormatError(f"series {self.name!r} holds a string that is not UTF-8: {exc}") from None
            if not self.words:
                raise BatchFormatError(f"series {self.name!r}: empty string dictionary")
        elif vtype == _T_BOOL:
            if const:
                self.const_value = bool(r.byte())
        else:
            raise BatchFormatError(f"series {self.name!r} has unknown value type {vtype}")

    def resolve_uuid(self, uuid: str) -> None:
        """String dictionaries may say "the batch's uuid", which comes after the series' meta."""
        if self.words:
            if not uuid and any(w is _HEADER_UUID for w in self.words):
                raise BatchFormatError(f"series {self.name!r} refers to the batch's uuid, which the batch lacks")
            self.words = [uuid if w is _HEADER_UUID else w for w in self.words]
            if self.kind & _K_CONST:
                self.const_value = self.words[0]

    def _num(self, i: int) -> Value:
        return i if self.kind & 0x07 == _T_INT else i / 10**self.scale

    def _float_bits(self, n: int) -> float:
        if n >= 1 << 64:
            raise BatchFormatError(f"series {self.name!r}: float bits beyond 64")
        return _from_bits(n)

    def read_data(
        self, r: _Reader, n_rows: int, version: int = FORMAT_VERSION
    ) -> tuple[list[int], Callable[[_BitReader], list[Value]]]:
        """The rows this series has and a function that takes its values from the bit stream (format 3 on: int
        plans may come in blocks, format 4 on: in segments)."""
        if self.kind & _K_DENSE:
            rows = list(range(n_rows))
        else:
            bitmap = r.take((n_rows + 7) // 8)
            rows = [i for i in range(n_rows) if bitmap[i >> 3] >> (i & 7) & 1]
        n = len(rows)
        vtype = self.kind & 0x07
        if self.kind & _K_CONST or n == 0:
            value = self.const_value
            if value is None:
                raise BatchFormatError(f"series {self.name!r}: no values")
            return rows, lambda _bits: [value] * n
        if vtype in (_T_INT, _T_DEC):
            ints = _read_plan_data(r, n, self.gcd, self.residue, version)
            return rows, lambda bits: [self._num(i) for i in ints(bits)]
        if vtype == _T_XOR:
            values: list[Value] = []
            prev = 0
            for _ in range(n):
                prev ^= r.uvarint()
                values.append(self._float_bits(prev))
            return rows, lambda _bits: values
        if vtype == _T_STR:
            words = self.words

            def strings(bits: _BitReader) -> list[Value]:
                out: list[Value] = []
                for i in bits.take(n, (len(words) - 1).bit_length()):
                    if i >= len(words):
                        raise BatchFormatError(f"series {self.name!r}: string index {i} outside its dictionary")
                    out.append(words[i])
                return out

            return rows, strings
        return rows, lambda bits: [bool(b) for b in bits.take(n, 1)]


def _read_plan_data(r: _Reader, n: int, g: int, residue: int, version: int) -> Callable[[_BitReader], list[int]]:
    """An int column's data (format 3 on: plans may come in blocks; format 4 on: in segments) and the function that
    takes its fields from the bit stream."""
    head = r.uvarint()
    width, order = head >> 2, head & 3
    blocked = version >= MERGED_FORMAT_VERSION_3
    if order == _BLOCKED and version >= MERGED_FORMAT_VERSION and width >= _SPARSE:
        return _read_sparse_data(r, n, g, residue, width - _SPARSE)
    if order == _BLOCKED and version >= MERGED_FORMAT_VERSION and width >= _SEGMENTED:
        return _read_segment_data(r, n, g, residue, width - _SEGMENTED)
    widths: list[int] | None = None
    if order == _BLOCKED and blocked:
        order, width = width, 0
        if order > 2 or order >= n:
            raise BatchFormatError(f"blocked int column of {n} values cannot have difference order {order}")
    if order > 2 or order >= n:
        raise BatchFormatError(f"int column of {n} values cannot have difference order {order}")
    if width > _MAX_WIDTH:
        raise BatchFormatError(f"bit width {width} is beyond {_MAX_WIDTH}")
    seeds = [_unzz(r.uvarint()) for _ in range(order)]
    base = _unzz(r.uvarint()) * g + residue
    if head & 3 == _BLOCKED and blocked:
        widths = [r.uvarint() for _ in range(-(-(n - order) // BLOCK_FIELDS))]
        if max(widths) > _MAX_WIDTH:
            raise BatchFormatError(f"bit width {max(widths)} is beyond {_MAX_WIDTH}")

    def fields(bits: _BitReader) -> list[int]:
        if widths is None:
            return bits.take(n - order, width)
        out: list[int] = []
        left = n - order
        for w in widths:
            out += bits.take(min(left, BLOCK_FIELDS), w)
            left -= BLOCK_FIELDS
        return out

    def ints(bits: _BitReader) -> list[int]:
        seq = [base + g * f for f in fields(bits)]
        for seed in reversed(seeds):
            acc = seed
            out = [acc]
            for d in seq:
                acc += d
                out.append(acc)
            seq = out
        return seq

    return ints


def _integrate(seq: list[int], seeds: Sequence[int]) -> list[int]:
    """Undo ``len(seeds)`` orders of differencing: the last seed first."""
    for seed in reversed(seeds):
        acc = seed
        out = [acc]
        for d in seq:
            acc += d
            out.append(acc)
        seq = out
    return seq


def _read_flat(r: _Reader, n: int) -> Callable[[_BitReader], list[int]]:
    """A flat plan of ``n`` values written whole into the data part (``_Sections._put_flat``)."""
    head = r.uvarint()
    width, order = head >> 2, head & 3
    if order > 2 or (order >= n and n):
        raise BatchFormatError(f"int column of {n} values cannot have difference order {order}")
    if width > _MAX_WIDTH:
        raise BatchFormatError(f"bit width {width} is beyond {_MAX_WIDTH}")
    seeds = [_unzz(r.uvarint()) for _ in range(order)]
    g = r.uvarint()
    if g == 0:
        raise BatchFormatError("an int column has gcd 0")
    residue = r.uvarint() if g > 1 else 0
    base = _unzz(r.uvarint()) * g + residue

    def ints(bits: _BitReader) -> list[int]:
        return _integrate([base + g * f for f in bits.take(n - order, width)], seeds)

    return ints


def _read_sparse_data(r: _Reader, n: int, g: int, residue: int, order: int) -> Callable[[_BitReader], list[int]]:
    """A sparse int column's data (format 4, see ``_Sections.sparse_plan``) and the function that takes its
    fields from the bit stream."""
    if order > 1 or order >= n:
        raise BatchFormatError(f"sparse int column of {n} values cannot have difference order {order}")
    seeds = [_unzz(r.uvarint()) for _ in range(order)]
    mode = _unzz(r.uvarint())
    count = r.uvarint()
    if count < 2 or count > n - order:
        raise BatchFormatError(f"int column of {n - order} fields claims {count} exceptions")
    gaps = _read_flat(r, count)
    values = _read_flat(r, count)

    def ints(bits: _BitReader) -> list[int]:
        seq = [mode] * (n - order)
        pos = -1
        for gap, value in zip(gaps(bits), values(bits), strict=True):
            pos += gap + 1
            if gap < 0 or pos >= len(seq):
                raise BatchFormatError(f"an exception of an int column falls outside its {n - order} fields")
            seq[pos] = value
        if g > 1:
            seq = [residue + g * y for y in seq]
        return _integrate(seq, seeds)

    return ints


def _read_segment_data(r: _Reader, n: int, g: int, residue: int, order: int) -> Callable[[_BitReader], list[int]]:
    """A segmented int column's data (format 4, see ``_Sections.segment_plan``) and the function that takes its
    fields from the bit stream."""
    if order > 1 or order >= n:
        raise BatchFormatError(f"segmented int column of {n} values cannot have difference order {order}")
    seeds = [_unzz(r.uvarint()) for _ in range(order)]
    n_segments = r.uvarint()
    if n_segments == 0 or n_segments > n - order:
        raise BatchFormatError(f"int column of {n - order} fields claims {n_segments} segments")
    sizes = [r.uvarint() for _ in range(n_segments)]
    codes = [r.uvarint() for _ in range(n_segments)]
    if min(sizes) == 0:
        raise BatchFormatError("a segment of an int column has no rows")
    if max(codes) >= _RADIX_EXACT + 16 * _MAX_RADIX_EXP:
        raise BatchFormatError(f"radix code {max(codes)} is beyond 2**{_MAX_RADIX_EXP}")
    segments = []
    prev_lo = 0
    for rows, code in zip(sizes, codes, strict=True):
        radix, e = _radix_of(code)
        lo = ((prev_lo >> e) + _unzz(r.uvarint())) << e
        segments.append((rows, radix, lo))
        prev_lo = lo
    total = sum(sizes)
    if total != n - order:
        raise BatchFormatError(f"the segments of an int column hold {total} fields, the column {n - order}")

    def ints(bits: _BitReader) -> list[int]:
        seq: list[int] = []
        for rows, radix, lo in segments:
            seq += [lo + f for f in _take_mixed_radix(bits, rows, radix)]
        if g > 1:
            seq = [residue + g * y for y in seq]
        for seed in seeds:
            acc = seed
            out = [acc]
            for d in seq:
                acc += d
                out.append(acc)
            seq = out
        return seq

    return ints


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
    codec: BatchCodec | None = None,
    uuid_in_header: bool = True,
) -> EncodedBatch:
    """Encode the samples (at least one, in time order) of one device as one batch.

    ``uuid`` is the device's GPU uuid (``EncodedBatch.uuid``, the buffer's stream key). A binary batch's header
    carries it when ``uuid_in_header`` is true or when a value of the batch is that string (the ``uuid``
    series); otherwise the batch decodes with ``uuid == ""``. The JSON format always carries it."""
    if not samples:
        raise ValueError("a batch needs at least one sample")
    if seq < 0:
        raise ValueError(f"seq must be >= 0, got {seq}")
    ts = [s.ts_ms for s in samples]
    ts_first, ts_last = min(ts), max(ts)
    if ts_first < 0:
        raise ValueError("sample timestamps must be >= 0 ms")
    n_values = sum([len(s.values) for s in samples])
    if fmt == "json":
        doc = {
            "format": JSON_FORMAT_NAME,
            "version": JSON_FORMAT_VERSION,
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
        meta, _, _, out = _body(samples, node, device, uuid, boot_id, seq, uuid_in_header)
        payload = (codec or BatchCodec()).pack(b"".join((meta, out.data, out.bits.bytes())))
    else:
        raise ValueError(f"telemetry format must be 'binary' or 'json', got {fmt!r}")
    return EncodedBatch(device, uuid, boot_id, seq, ts_first, ts_last, payload, fmt, len(samples), n_values)


def batch_body(
    samples: Sequence[Sample],
    *,
    node: str,
    device: str,
    uuid: str,
    boot_id: str,
    seq: int,
    uuid_in_header: bool = True,
) -> bytes:
    """The uncompressed body of a binary batch (what the zstd frame holds; the dictionary is built from these)."""
    meta, _, _, out = _body(samples, node, device, uuid, boot_id, seq, uuid_in_header)
    return b"".join((meta, out.data, out.bits.bytes()))


def body_parts(
    samples: Sequence[Sample],
    *,
    node: str,
    device: str,
    uuid: str,
    boot_id: str,
    seq: int,
    uuid_in_header: bool = True,
) -> dict[str, bytes]:
    """The body in its parts, in body order: ``head`` (rows, span, timestamp kind, node, device), ``series``
    (each series' name, kind and constants), ``ids`` (uuid if carried, boot id, seq, first timestamp), ``data``
    (per-batch varints) and ``bits`` (the packed fields). For measuring where the bytes go; ``batch_body`` joins
    them. The uuid is carried when ``uuid_in_header`` or when a string value of the batch equals it."""
    meta, head_end, series_end, out = _body(samples, node, device, uuid, boot_id, seq, uuid_in_header)
    return {
        "head": bytes(meta[:head_end]),
        "series": bytes(meta[head_end:series_end]),
        "ids": bytes(meta[series_end:]),
        "data": bytes(out.data),
        "bits": out.bits.bytes(),
    }


def _body(
    samples: Sequence[Sample],
    node: str,
    device: str,
    uuid: str,
    boot_id: str,
    seq: int,
    uuid_in_header: bool,
    parts: Sequence[BatchPart] | None = None,
    version: int = FORMAT_VERSION,
) -> tuple[bytearray, int, int, _Sections]:
    """The body's sections: the meta part (head, series and ids one after the other) with where the head and the
    series end in it, the data part and the bit stream. ``parts`` (a merged batch, version 3): the parts table
    follows the first timestamp."""
    ts = [s.ts_ms for s in samples]
    ts_first, ts_last = min(ts), max(ts)
    n_rows = len(samples)
    span = ts_last - ts_first
    out = _Sections()
    meta = out.meta
    _put_uvarint(meta, n_rows)
    _put_uvarint(meta, span)
    planner: Callable[[Sequence[int]], _IntPlan | _BlockedPlan | _SegPlan | _SparsePlan] = (
        _int_plan if parts is None else _merged_plan if version >= MERGED_FORMAT_VERSION else _blocked_plan
    )
    if ts[0] == ts_first and (n_rows == 1 or (span % (n_rows - 1) == 0 and _evenly(ts, span // (n_rows - 1)))):
        meta.append(_TS_EVEN)
    else:
        plan = planner([t - ts_first for t in ts])
        meta.append(_TS_LIST | (_K_GCD if plan.gcd > 1 else 0))
        out.plan(plan)
    _put_str(meta, node)
    _put_str(meta, device)
    head_end = len(meta)
    dense = _dense_columns(samples) if parts is None else None
    if dense is not None:  # the usual batch
        names, codes, cols = dense
        if uuid and not uuid_in_header:
            # A string value equal to the uuid refers to the header's copy (packed, 16 bytes): carry it then.
            uuid_in_header = any(uuid in col for code, col in zip(codes, cols, strict=True) if code == _T_STR)
        carried = uuid if uuid_in_header else ""
        _put_uvarint(meta, len(names))
        _encode_dense_columns(out, names, codes, cols, carried)
    elif parts is None and (grouped := _grouped_columns(samples)) is not None:  # collect and process rows
        g_names, g_codes, g_cols, g_rows = grouped
        if uuid and not uuid_in_header:
            uuid_in_header = any(uuid in col for code, col in zip(g_codes, g_cols, strict=True) if code == _T_STR)
        carried = uuid if uuid_in_header else ""
        _put_uvarint(meta, len(g_names))
        _encode_dense_columns(out, g_names, g_codes, g_cols, carried, g_rows, n_rows)
    else:
        columns = _columns(samples)
        if uuid and not uuid_in_header:
            uuid_in_header = any(vtype == _T_STR and uuid in values for _, vtype, _, values in columns)
        carried = uuid if uuid_in_header else ""
        _put_uvarint(meta, len(columns))
        for name, vtype, rows, values in columns:
            _encode_series(out, name, rows, values, vtype, n_rows, carried, planner)
    series_end = len(meta)
    if parts is not None and not carried and any(p.uuid for p in parts):
        raise ValueError("a part carries the uuid but the merged batch's header does not")
    _put_ids(meta, carried, boot_id)
    _put_uvarint(meta, seq)
    _put_uvarint(meta, ts_first)
    if parts is not None:
        _put_parts(meta, parts, n_rows)
    return meta, head_end, series_end, out


def _put_parts(out: bytearray, parts: Sequence[BatchPart], n_rows: int) -> None:
    """The parts table of a merged batch: n_parts, then per part (rows << 1 | uuid carried), and from the second
    part on, first (seq - previous seq - 1). The first part's seq is the batch's ``seq``."""
    if not parts or sum(p.rows for p in parts) != n_rows or min(p.rows for p in parts) < 1:
        raise ValueError(f"the parts of a merged batch must cover its {n_rows} rows, each at least one")
    _put_uvarint(out, len(parts))
    prev: int | None = None
    for p in parts:
        if prev is not None:
            if p.seq <= prev:
                raise ValueError(f"the parts of a merged batch must have increasing seqs: {p.seq} after {prev}")
            _put_uvarint(out, p.seq - prev - 1)
        _put_uvarint(out, p.rows << 1 | (1 if p.uuid else 0))
        prev = p.seq


def merge_batches(
    batches: Sequence[DecodedBatch], codec: BatchCodec | None = None, *, version: int = MERGED_FORMAT_VERSION
) -> EncodedBatch:
    """One merged batch holding ``batches`` (decoded binary batches of one stream, merged ones among them), in
    order: its samples are their samples one after the other, exactly, and its parts are their parts
    (``DecodedBatch.split`` gives each back). The node, device and boot id must be the same and the seqs increase;
    the GPU uuid (when any part carried it) too. ``version`` 4 (the default, the cold form) plans each int column
    in segments (``_merged_plan``), several times the CPU of version 3, which codes it flat or in blocks. The body
    is compressed with and without the dictionary, the smaller kept. ``EncodedBatch.seq`` is the first part's."""
    if not batches:
        raise ValueError("merge_batches needs at least one batch")
    if version not in MERGED_VERSIONS:
        raise ValueError(f"merged batches are written in format {MERGED_VERSIONS}, not {version}")
    first = batches[0]
    parts: list[BatchPart] = []
    samples: list[Sample] = []
    for b in batches:
        if b.fmt != "binary":
            raise ValueError(f"only binary batches merge; {b.device} seq {b.seq} is {b.fmt}")
        if (b.node, b.device, b.boot_id) != (first.node, first.device, first.boot_id):
            raise ValueError(
                f"batches of different streams do not merge: {(b.node, b.device, b.boot_id)} after "
                f"{(first.node, first.device, first.boot_id)}"
            )
        own = b.parts or (BatchPart(b.seq, len(b.samples), b.uuid),)
        if sum(p.rows for p in own) != len(b.samples):
            raise ValueError(f"batch {b.device} seq {b.seq}: its parts do not cover its {len(b.samples)} rows")
        if parts and own[0].seq <= parts[-1].seq:
            raise ValueError(f"batch {b.device} seq {own[0].seq} comes after seq {parts[-1].seq}: seqs must increase")
        parts.extend(own)
        samples.extend(b.samples)
    uuids = {p.uuid for p in parts if p.uuid}
    if len(uuids) > 1:
        raise ValueError(f"batches of different GPUs do not merge: {sorted(uuids)}")
    uuid = uuids.pop() if uuids else ""
    meta, _, _, out = _body(
        samples, first.node, first.device, uuid, first.boot_id, parts[0].seq, bool(uuid), parts, version
    )
    payload = (codec or BatchCodec()).pack(b"".join((meta, out.data, out.bits.bytes())), version, try_plain=True)
    ts = [s.ts_ms for s in samples]
    n_values = sum(len(s.values) for s in samples)
    return EncodedBatch(
        first.device, uuid, first.boot_id, parts[0].seq, min(ts), max(ts), payload, "binary", len(samples), n_values
    )


_ColumnValues = tuple[str, int, Sequence[int], Sequence[Value]]


def _dense_columns(samples: Sequence[Sample]) -> tuple[tuple[str, ...], list[int], list[tuple[Value, ...]]] | None:
    """The usual batch's series, a property at a time: (names, type codes, values) when every sample holds the
    same properties in the same order, each of exactly one of the types int, float, str or bool throughout (what
    ``_columns`` gives with every row); None for any other batch.

    Every value's type is taken in one ``map`` over all the rows and compared with the first row's types repeated
    (no tuple per row); the rows' value views are iterated again only by the transposing ``zip``."""
    first = samples[0].values
    names = tuple(first)
    if [tuple(s.values) for s in samples].count(names) != len(samples):
        return None
    types = list(map(type, first.values()))
    rows = [s.values.values() for s in samples]
    # Every column holds one type if and only if every row holds the first row's types.
    if list(map(type, itertools.chain.from_iterable(rows))) != types * len(rows):
        return None
    codes = list(map(_TYPE_CODES.get, types))
    if None in codes:
        return None
    return names, cast("list[int]", codes), list(zip(*rows, strict=True))


def _grouped_columns(
    samples: Sequence[Sample],
) -> tuple[list[str], list[int], list[tuple[Value, ...]], list[Sequence[int] | None]] | None:
    """A batch of a few kinds of rows, each kind the same properties in the same order and types (the collect
    cycle's rows and, every few of them, the process cycle's): (names, type codes, values, rows) as ``_columns``
    gives them, each column's rows None where it is in every row; None for a batch of a single kind (see
    ``_dense_columns``), more than 4, a property in more than one kind, or a column of mixed types."""
    groups: dict[tuple[str, ...], list[int]] = {}
    for row, s in enumerate(samples):
        key = tuple(s.values)
        rows = groups.get(key)
        if rows is None:
            if len(groups) == 4:
                return None
            rows = groups[key] = []
        rows.append(row)
    if len(groups) < 2 or sum(map(len, groups)) != len(set().union(*groups)):
        return None
    names: list[str] = []
    codes: list[int] = []
    cols: list[tuple[Value, ...]] = []
    col_rows: list[Sequence[int] | None] = []
    for key, rows in groups.items():  # in the order of each kind's first row: the order _columns gives
        if not key:
            continue
        values = [samples[r].values.values() for r in rows]
        types = list(map(type, samples[rows[0]].values.values()))
        if list(map(type, itertools.chain.from_iterable(values))) != types * len(rows):
            return None
        kinds = list(map(_TYPE_CODES.get, types))
        if None in kinds:
            return None
        names += key
        codes += cast("list[int]", kinds)
        cols += zip(*values, strict=True)
        col_rows += [rows] * len(key)
    return names, codes, cols, col_rows


def _columns(samples: Sequence[Sample]) -> list[_ColumnValues]:
    """The series of a batch: one per (property, value type), in first-seen order, as (name, type code, rows,
    values). Gathered a property at a time; ``_columns_by_value`` does it when a property's values are not all
    of one plain type (int, float, str or bool): a property that changes type, a subclass, a wrong type."""
    names = tuple(samples[0].values)
    by_name: Mapping[str, tuple[Sequence[int], Sequence[Value]]]
    if all(tuple(s.values) == names for s in samples):  # the usual batch: the same properties in every sample
        every_row = range(len(samples))
        transposed = zip(*(s.values.values() for s in samples), strict=True)
        by_name = {name: (every_row, col) for name, col in zip(names, transposed, strict=True)}
    else:
        gathered: dict[str, tuple[list[int], list[Value]]] = {}
        for row, s in enumerate(samples):
            for name, value in s.values.items():
                col = gathered.get(name)
                if col is None:
                    col = gathered[name] = ([], [])
                col[0].append(row)
                col[1].append(value)
        by_name = gathered
    columns: list[_ColumnValues] = []
    for name, (rows, values) in by_name.items():
        types = set(map(type, values))
        vtype = _TYPE_CODES.get(types.pop()) if len(types) == 1 else None
        if vtype is None:
            return _columns_by_value(samples)
        columns.append((name, vtype, rows, values))
    return columns


def _columns_by_value(samples: Sequence[Sample]) -> list[_ColumnValues]:
    """``_columns`` the long way, a value at a time: a (property, type) series is where its first value is."""
    columns: dict[tuple[str, int], tuple[list[int], list[Value]]] = {}
    for row, s in enumerate(samples):
        for name, value in s.values.items():
            key = (name, _type_of(value))
            col = columns.get(key)
            if col is None:
                col = columns[key] = ([], [])
            col[0].append(row)
            col[1].append(value)
    return [(name, vtype, rows, values) for (name, vtype), (rows, values) in columns.items()]


def _evenly(ts: list[int], step: int) -> bool:
    first = ts[0]
    if step > 0:
        return ts == list(range(first, first + step * len(ts), step))
    return ts.count(first) == len(ts)


def decode_batch(data: bytes, codec: BatchCodec | None = None) -> DecodedBatch:
    """Decode one batch, binary or JSON. Raises ``BatchFormatError`` naming what was wrong.

    ``codec`` (optional) keeps the zstd contexts between calls when decoding many batches."""
    if data[:1] == MAGIC:
        return _decode_binary(data, codec or BatchCodec(dictionary_id=0))
    if data[:1] == b"{":
        return _decode_json(data)
    raise BatchFormatError(f"not a telemetry batch: starts with {data[:8]!r}, expected {MAGIC!r} or '{{'")


_MAX_BODY_BYTES = 256 * 1024 * 1024


def batch_rows(data: bytes, codec: BatchCodec | None = None) -> int:
    """How many samples (rows: one GPU's readings at one instant) a batch holds, without decoding its columns: the
    first number of its body (a merged batch: of all its parts). 0 for what is not a batch this reader reads (a
    status message)."""
    try:
        if data[:1] == MAGIC:
            if len(data) < HEADER_BYTES or data[1] not in READABLE_VERSIONS:
                return 0
            body = (codec or BatchCodec(dictionary_id=0)).unpack(data[2], data[HEADER_BYTES:])
            return _Reader(body).uvarint()
        if data[:1] == b"{":
            return len(_decode_json(data).samples)
    except (BatchFormatError, ValueError, IndexError):
        return 0
    return 0


def _decode_binary(data: bytes, codec: BatchCodec) -> DecodedBatch:
    if len(data) < HEADER_BYTES:
        raise BatchFormatError("batch truncated inside its header")
    version, flags = data[1], data[2]
    if version not in READABLE_VERSIONS:
        readable = ", ".join(map(str, READABLE_VERSIONS))
        raise BatchFormatError(f"batch format version {version} is not supported (this reader reads {readable})")
    body = codec.unpack(flags, data[HEADER_BYTES:])
    r = _Reader(body)
    n_rows = r.uvarint()
    if n_rows == 0 or n_rows > len(body) * 8 + 8:
        raise BatchFormatError(f"batch claims {n_rows} rows in {len(body)} bytes")
    span = r.uvarint()
    ts_byte = r.byte()
    ts_kind = ts_byte & ~_K_GCD
    if ts_kind not in (_TS_EVEN, _TS_LIST) or (ts_kind == _TS_LIST and n_rows < 2):
        raise BatchFormatError(f"unknown timestamp encoding {ts_byte}")
    ts_gcd, ts_residue = (r.uvarint(), r.uvarint()) if ts_byte & _K_GCD else (1, 0)
    if ts_kind == _TS_EVEN and n_rows > 1 and span % (n_rows - 1):
        raise BatchFormatError(f"evenly spaced rows: span {span} ms does not divide into {n_rows - 1} steps")
    node, device = r.text(), r.text()
    columns = [_Column(r) for _ in range(r.uvarint())]
    uuid, boot_id = r.ids()
    for c in columns:
        c.resolve_uuid(uuid)
    seq = r.uvarint()
    ts_first = r.uvarint()
    parts = _read_parts(r, seq, uuid, n_rows) if version in MERGED_VERSIONS else (BatchPart(seq, n_rows, uuid),)
    ts_offsets = _read_plan_data(r, n_rows, ts_gcd, ts_residue, version) if ts_kind == _TS_LIST else None
    readers = [(c.name, *c.read_data(r, n_rows, version)) for c in columns]
    bits = _BitReader(body[r.pos :])
    if ts_offsets is not None:
        ts = [ts_first + off for off in ts_offsets(bits)]
        if min(ts) != ts_first or max(ts) != ts_first + span:
            raise BatchFormatError("row timestamps disagree with the header's time range")
    else:
        step = span // (n_rows - 1) if n_rows > 1 else 0
        ts = [ts_first + i * step for i in range(n_rows)]
    rows: list[dict[str, Value]] = [{} for _ in range(n_rows)]
    for name, col_rows, take in readers:
        for row, value in zip(col_rows, take(bits), strict=True):
            rows[row][name] = value
    if bits.left >= 8 or bits.acc:
        raise BatchFormatError(f"{bits.left // 8} stray bytes after the last series")
    if len(parts) == 1:
        samples = tuple(Sample(uuid=uuid, ts_ms=t, values=v) for t, v in zip(ts, rows, strict=True))
    else:
        row_uuids = itertools.chain.from_iterable(itertools.repeat(p.uuid, p.rows) for p in parts)
        samples = tuple(Sample(u, t, v) for u, t, v in zip(row_uuids, ts, rows, strict=True))
    return DecodedBatch(version, "binary", node, device, uuid, boot_id, seq, ts_first, ts_first + span, samples, parts)


def _read_parts(r: _Reader, seq: int, uuid: str, n_rows: int) -> tuple[BatchPart, ...]:
    n_parts = r.uvarint()
    if n_parts == 0 or n_parts > n_rows:
        raise BatchFormatError(f"merged batch claims {n_parts} parts for {n_rows} rows")
    parts = []
    total = 0
    for i in range(n_parts):
        if i:
            seq += r.uvarint() + 1
        field_ = r.uvarint()
        rows = field_ >> 1
        if field_ & 1 and not uuid:
            raise BatchFormatError(f"part seq {seq} carried the uuid, which the merged batch lacks")
        if rows == 0:
            raise BatchFormatError(f"part seq {seq} of a merged batch has no rows")
        total += rows
        parts.append(BatchPart(seq, rows, uuid if field_ & 1 else ""))
    if total != n_rows:
        raise BatchFormatError(f"the parts of a merged batch hold {total} rows, the batch {n_rows}")
    return tuple(parts)


def _decode_json(data: bytes) -> DecodedBatch:
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BatchFormatError(f"JSON batch does not parse: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != JSON_FORMAT_NAME:
        raise BatchFormatError(f"JSON document is not a {JSON_FORMAT_NAME} batch (missing or wrong 'format')")
    if doc.get("version") != JSON_FORMAT_VERSION:
        raise BatchFormatError(f"JSON batch version {doc.get('version')!r} is not supported")
    try:
        uuid = str(doc["uuid"])
        samples = tuple(Sample(uuid=uuid, ts_ms=int(s["ts_ms"]), values=dict(s["values"])) for s in doc["samples"])
        seq = int(doc["seq"])
        return DecodedBatch(
            JSON_FORMAT_VERSION,
            "json",
            str(doc["node"]),
            str(doc["device"]),
            uuid,
            str(doc["boot_id"]),
            seq,
            int(doc["ts_first_ms"]),
            int(doc["ts_last_ms"]),
            samples,
            (BatchPart(seq, len(samples), uuid),),
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

    The GPU uuid goes in the header of the first batch this encoder cuts and of the next batch after
    ``announce_uuid()``; other batches carry it only when they hold the ``uuid`` series (see ``encode_batch``).
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
        zstd_level: int = DEFAULT_ZSTD_LEVEL,
        codec: BatchCodec | None = None,
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
        #: Whether the next batch's header carries the uuid (true for the first batch; see ``announce_uuid``).
        self.uuid_in_next_batch = True
        # A codec holds ~2 MB of zstd state with the dictionary: share one between encoders (``codec=``).
        self._codec = codec if codec is not None else BatchCodec(level=zstd_level)

    @property
    def pending_samples(self) -> int:
        return len(self._samples)

    def announce_uuid(self) -> None:
        """Carry the uuid in the header of the next batch (e.g. for a consumer that starts listening now)."""
        self.uuid_in_next_batch = True

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
            codec=self._codec,
            uuid_in_header=self.uuid_in_next_batch,
        )
        self.next_seq += 1
        self.uuid_in_next_batch = False
        return batch


# --------------------------------------------------------------------------------------------------
# Per-property pushMethod -> per-device batches
# --------------------------------------------------------------------------------------------------


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
    routes = [Route("", telemetry_topic(node, device.key), default_qos, False, None)]
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
        codec: BatchCodec | None = None,
    ) -> None:
        self.device = device
        self.routes = routes_for(device, node, default_qos=default_qos)
        self._claimed: dict[str, int] = {}
        for i, route in enumerate(self.routes):
            for name in route.properties or ():
                self._claimed[name] = i
        shared = codec if codec is not None else BatchCodec()
        self._encoders = [
            BatchEncoder(node, device.key, device.uuid, boot_id, window_s, start_seq, fmt, codec=shared)
            for _ in self.routes
        ]
        self.next_seq = start_seq

    def add(self, sample: Sample) -> None:
        if self._claimed.keys().isdisjoint(sample.values):  # the usual sample: every value takes the default route
            self._encoders[0].add(Sample(sample.uuid, sample.ts_ms, dict(sample.values)))
            return
        parts: list[dict[str, Value]] = [{} for _ in self.routes]
        for name, value in sample.values.items():
            parts[self._claimed.get(name, 0)][name] = value
        for i, values in enumerate(parts):
            if values or i == 0:
                self._encoders[i].add(Sample(sample.uuid, sample.ts_ms, values))

    def announce_uuid(self) -> None:
        """The next batch of every route carries the GPU uuid in its header (each route's first batch does)."""
        for enc in self._encoders:
            enc.announce_uuid()

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


# --------------------------------------------------------------------------------------------------
# Files of several batches, and the decode command
# --------------------------------------------------------------------------------------------------


def frame(payload: bytes) -> bytes:
    """One record of a batch file: a 4-byte big-endian length, then the batch."""
    return len(payload).to_bytes(4, "big") + payload


def iter_batches(data: bytes) -> Iterator[bytes]:
    """The batches of a file: one bare batch (starts with "GMT" or "{"), or length-prefixed records."""
    if data[:1] in (MAGIC, b"{"):
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


#: The first bytes of every SQLite database file: the mapper's buffer (``telemetry.db``) is one.
SQLITE_MAGIC = b"SQLite format 3\x00"


def decode_command(
    argv_or_path: Sequence[str] | str,
    stdin: IO[bytes],
    stdout: IO[str],
    stderr: IO[str] | None = None,
) -> int:
    """``gpu-mapper decode [FILE|-]``: print every value of every batch as one JSON line. Returns an exit code:
    0, 1 for what is not a telemetry batch (an empty file, the buffer's SQLite file, anything else), 2 for a
    file that cannot be read."""
    err = stderr if stderr is not None else sys.stderr
    args = [argv_or_path] if isinstance(argv_or_path, str) else list(argv_or_path)
    if len(args) > 1:
        err.write(f"decode: expected one FILE or '-', got {len(args)} arguments\n")
        return 2
    source = args[0] if args else "-"
    name = "standard input" if source == "-" else source
    try:
        if source == "-":
            data = stdin.read()
        else:
            with open(source, "rb") as fh:
                data = fh.read()
    except OSError as exc:
        err.write(f"decode: cannot read {source}: {exc.strerror or exc}\n")
        return 2
    why_not = _not_batches(data)
    if why_not:
        err.write(f"decode: {name}: {why_not}\n")
        return 1
    try:
        for i, raw in enumerate(iter_batches(data)):
            try:
                batch = decode_batch(raw)
            except BatchFormatError as exc:
                if i == 0:
                    raise BatchFormatError(f"not a telemetry batch ({exc})") from None
                raise BatchFormatError(f"batch #{i + 1}: {exc}") from None
            for line in batch_json_lines(batch):
                stdout.write(line + "\n")
    except BatchFormatError as exc:
        err.write(f"decode: {name}: {exc}\n")
        return 1
    return 0


def _not_batches(data: bytes) -> str:
    """Why ``data`` is plainly not a batch or a file of them ("" when it may be): empty, an SQLite file (the
    buffer, read by ``gpu-mapper buffer export``), or a first record that is not a batch."""
    if not data:
        return "empty: not a telemetry batch"
    if data.startswith(SQLITE_MAGIC):
        return (
            "an SQLite database, not a telemetry batch: the mapper's buffer (telemetry.db) is read with "
            "'gpu-mapper buffer export FILE' (or 'gpu-mapper buffer stats FILE')"
        )
    if data[:1] in (MAGIC, b"{"):
        return ""
    # Length-prefixed records: the first must fit in the file and hold a batch.
    n = int.from_bytes(data[:4], "big") if len(data) >= 4 else -1
    if n <= 0 or 4 + n > len(data) or data[4:5] not in (MAGIC, b"{"):
        return (
            f"not a telemetry batch (nor a file of them): it starts with {data[:16]!r}; a batch starts with "
            f"{MAGIC!r} (binary) or '{{' (JSON), a file of them with each one's 4-byte length"
        )
    return ""


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
