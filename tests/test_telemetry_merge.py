"""Merged batches (format version 3): exact concatenation, their parts and dedup identity, golden bytes of every
version the decoder reads."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mapper.shared.model import Sample, Value
from mapper.wire.telemetry import (
    FORMAT_VERSION,
    MERGED_FORMAT_VERSION,
    BatchCodec,
    BatchFormatError,
    BatchPart,
    DecodedBatch,
    batch_json_lines,
    decode_batch,
    encode_batch,
    merge_batches,
    records_equal,
)

T0 = 1_780_000_000_000
UUID = "GPU-12345678-1234-1234-1234-123456789abc"
COMMON = {"node": "edge-1", "device": "default/gpu0", "uuid": UUID, "boot_id": "0badf00d"}

values = st.one_of(
    st.integers(-(2**70), 2**70),
    st.integers(0, 2_000_000).map(lambda mw: mw / 1000),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.just(UUID),
    st.booleans(),
)
names = st.sampled_from(["power_usage", "temperature", "uuid", "pstate", "x.custom", "ünicode"])


@st.composite
def streams(draw: st.DrawFn) -> list[tuple[int, bool, list[Sample]]]:
    """Consecutive batches of one stream: (seq, uuid in header, samples), seqs increasing with gaps."""
    out = []
    seq = draw(st.integers(0, 2**40))
    ts = T0
    for _ in range(draw(st.integers(1, 8))):
        rows = []
        for _ in range(draw(st.integers(1, 12))):
            ts += draw(st.sampled_from([1000, 1000, 1000, 0, 7, 5000]))
            rows.append(Sample(UUID, ts, draw(st.dictionaries(names, values, max_size=5))))
        out.append((seq, draw(st.booleans()), rows))
        seq += draw(st.integers(1, 3))
    return out


def _originals(stream: list[tuple[int, bool, list[Sample]]]) -> list[DecodedBatch]:
    codec = BatchCodec()
    return [
        decode_batch(encode_batch(rows, seq=seq, uuid_in_header=carry, codec=codec, **COMMON).payload, codec)
        for seq, carry, rows in stream
    ]


def _same_samples(got: tuple[Sample, ...], want: list[Sample]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert (g.uuid, g.ts_ms) == (w.uuid, w.ts_ms)
        assert records_equal(g.values, w.values), (g.values, w.values)


@settings(max_examples=120, deadline=None)
@given(streams(), st.data())
def test_a_merged_batch_decodes_to_exactly_the_concatenation_of_its_originals(
    stream: list[tuple[int, bool, list[Sample]]], data: st.DataObject
) -> None:
    originals = _originals(stream)
    # Merge in one go, or in two steps (a merged batch merged again with the next ones), as compaction does.
    cut = data.draw(st.integers(0, len(originals)))
    if 0 < cut < len(originals):
        head = decode_batch(merge_batches(originals[:cut]).payload)
        merged = merge_batches([head, *originals[cut:]])
    else:
        merged = merge_batches(originals)
    decoded = decode_batch(merged.payload)
    assert decoded.version == MERGED_FORMAT_VERSION and merged.payload[1] == MERGED_FORMAT_VERSION
    _same_samples(decoded.samples, [s for o in originals for s in o.samples])
    assert decoded.seqs == tuple(o.seq for o in originals)
    assert (decoded.seq, decoded.seq_last) == (originals[0].seq, originals[-1].seq)
    assert (decoded.ts_first_ms, decoded.ts_last_ms) == (
        min(o.ts_first_ms for o in originals),
        max(o.ts_last_ms for o in originals),
    )
    assert decoded.boot_id == "0badf00d" and decoded.device == "default/gpu0"
    # Each part comes back as the batch it was: the consumer's dedup identity (device, boot_id, seq) per part.
    for part, original in zip(decoded.split(), originals, strict=True):
        assert (part.version, part.seq, part.uuid, part.ts_first_ms, part.ts_last_ms) == (
            FORMAT_VERSION,
            original.seq,
            original.uuid,
            original.ts_first_ms,
            original.ts_last_ms,
        )
        _same_samples(part.samples, list(original.samples))
    # The same lines (within one row the order of the properties is the order of the series, not kept).
    assert sorted(batch_json_lines(decoded)) == sorted(line for o in originals for line in batch_json_lines(o))


def test_a_batch_that_was_not_merged_is_its_own_single_part() -> None:
    samples = [Sample(UUID, T0 + i * 1000, {"temperature": 60 + i}) for i in range(3)]
    decoded = decode_batch(encode_batch(samples, seq=5, **COMMON).payload)
    assert decoded.parts == (BatchPart(5, 3, UUID),)
    assert (decoded.seq_last, decoded.seqs, decoded.merged, decoded.split()) == (5, (5,), False, (decoded,))
    as_json = decode_batch(encode_batch(samples, seq=6, fmt="json", **COMMON).payload)
    assert as_json.parts == (BatchPart(6, 3, UUID),)


def test_merging_refuses_batches_of_other_streams_a_seq_going_back_and_json() -> None:
    a = decode_batch(encode_batch([Sample(UUID, T0, {"t": 1})], seq=3, **COMMON).payload)
    other_boot = {**COMMON, "boot_id": "ffff0000"}
    b = decode_batch(encode_batch([Sample(UUID, T0 + 1000, {"t": 2})], seq=4, **other_boot).payload)
    with pytest.raises(ValueError, match="different streams"):
        merge_batches([a, b])
    with pytest.raises(ValueError, match="seqs must increase"):
        merge_batches([a, a])
    j = decode_batch(encode_batch([Sample(UUID, T0, {"t": 1})], seq=9, fmt="json", **COMMON).payload)
    with pytest.raises(ValueError, match="only binary"):
        merge_batches([a, j])
    other_gpu = decode_batch(
        encode_batch([Sample(UUID, T0 + 1000, {"t": 2})], seq=4, **{**COMMON, "uuid": UUID[:-1] + "d"}).payload
    )
    with pytest.raises(ValueError, match="different GPUs"):
        merge_batches([a, other_gpu])
    with pytest.raises(ValueError, match="at least one"):
        merge_batches([])


def _merged_golden() -> tuple[list[DecodedBatch], bytes]:
    """Three batches of one stream (seqs 10, 12, 13; only the first carries the uuid), merged uncompressed."""
    rows: list[list[Sample]] = []
    for k in range(3):
        part = []
        for i in range(4):
            t = k * 4 + i
            v: dict[str, Value] = {"temperature": 60 + t % 3, "power_usage": 100.25 + t, "pstate": "P0"}
            if t == 0:
                v["uuid"] = UUID
            part.append(Sample(UUID if k == 0 else "", T0 + 1000 * t, v))
        rows.append(part)
    originals = [
        decode_batch(encode_batch(r, seq=seq, uuid_in_header=k == 0, **COMMON).payload)
        for k, (seq, r) in enumerate(zip((10, 12, 13), rows, strict=True))
    ]
    return originals, merge_batches(originals, BatchCodec(dictionary_id=0), version=3).payload


#: Format 3 as it was first written (2026-12): the merged batch of ``_merged_golden``, kept raw (flags 0: zstd
#: made it no smaller), so these bytes depend on no zstd version.
GOLDEN_MERGED = bytes.fromhex(
    "4703000cf8550006656467652d310c64656661756c742f677075300407090c0a02171c01035030011401000912345678123412341234"
    "123456789abc0badf00d0a80909282e733030901080008087801d29c01c8010100244992"
)
#: Format 2 as the live path writes it (2026-12, dictionary 2): 4 rows, no uuid in the header, seq 4.
GOLDEN_V2_DICT2 = bytes.fromhex(
    "47022100006d0100040204b817310c0207090c8a0264190c0badf00d0480909282e733087808c80124e403cc1a8603006eec0cdc03"
)


def test_a_merged_batch_of_format_3_is_frozen_and_decodes() -> None:
    originals, payload = _merged_golden()
    assert payload == GOLDEN_MERGED, "the encoder still writes format 3 as it was defined"
    decoded = decode_batch(GOLDEN_MERGED)
    assert (decoded.version, decoded.seqs, decoded.uuid) == (3, (10, 12, 13), UUID)
    assert [(p.seq, p.rows, p.uuid) for p in decoded.parts] == [(10, 4, UUID), (12, 4, ""), (13, 4, "")]
    _same_samples(decoded.samples, [s for o in originals for s in o.samples])


def test_every_binary_version_the_decoder_reads_has_a_golden_batch_that_decodes() -> None:
    # Version 2 with dictionary 1 has its own golden batch in test_telemetry.py; here dictionary 2 and version 3.
    v2 = decode_batch(GOLDEN_V2_DICT2)
    assert (v2.version, v2.seq, v2.uuid, v2.boot_id, v2.parts) == (2, 4, "", "0badf00d", (BatchPart(4, 4, ""),))
    want = [{"temperature": 60 + i % 3, "power_usage": 100.25 + i} for i in range(4)]
    assert [dict(s.values) for s in v2.samples] == want
    assert GOLDEN_V2_DICT2[2] >> 4 == 2
    assert decode_batch(GOLDEN_MERGED).version == 3
    assert decode_batch(GOLDEN_MERGED_V4).version == 4
    with pytest.raises(BatchFormatError, match="version 5 is not supported"):
        decode_batch(b"G\x05\x00" + GOLDEN_MERGED[3:])


def _golden_v4_rows() -> list[list[Sample]]:
    """Four batches of 12 rows: a level that steps (a quiet stretch, a busy one, a quiet one), a slow counter, a
    temperature that steps twice, a rare value: what format 4 cuts into segments or codes sparsely."""
    rows: list[list[Sample]] = []
    for k in range(4):
        part = []
        for i in range(12):
            t = k * 12 + i
            level = 65_000 + (t * 7919) % 2001 if 12 <= t < 30 else 600_000 + (t * 104_729) % 175_001
            v: dict[str, Value] = {"power_usage": level, "temperature": 60 + t // 20, "memory_used": 2**30 * (t // 30)}
            v["xid_last"] = 4_000_000_000 + t if t in (5, 17, 40) else 0
            part.append(Sample("", T0 + 1000 * t, v))
        rows.append(part)
    return rows


def _golden_v4_body() -> bytes:
    from mapper.wire import telemetry

    samples = [s for part in _golden_v4_rows() for s in part]
    parts = [BatchPart(20 + k, 12, "") for k in range(4)]
    meta, _, _, out = telemetry._body(samples, "edge-1", "default/gpu0", "", "0badf00d", 20, False, parts, 4)
    return bytes(meta) + bytes(out.data) + out.bits.bytes()


#: Format 4 as it was first written (2026-12): the segmented body of ``_golden_v4_rows`` (seqs 20-23), kept raw.
GOLDEN_MERGED_V4 = b"G\x04\x00" + bytes.fromhex(
    "3098ef020006656467652d310c64656661756c742f67707530040c09070905898080808004001e090c0badf00d1480909282e7330418"
    "00180018001813030c1212e6017fe30192018f8201880105780004001b000314010a18018aa0d9e61dc0c7548a850c5b1e5169c68e9d"
    "279c757bdb3d5fd4898c80a9a5f5661e4fb8184114b42a4001195345600f79cc002ce00c4d6e85336e2e692b8ca76c23a7756daa678e"
    "d6102c9c04e0908588fa8ea30ed4257793ae0a79a77004000004004000000000f0ff3f30116046"
)


def test_a_merged_batch_of_format_4_is_frozen_and_decodes_and_is_smaller_than_format_3() -> None:
    assert _golden_v4_body() == GOLDEN_MERGED_V4[3:], "the encoder still writes format 4 as it was defined"
    decoded = decode_batch(GOLDEN_MERGED_V4)
    assert (decoded.version, decoded.seqs, decoded.uuid) == (4, (20, 21, 22, 23), "")
    _same_samples(decoded.samples, [s for part in _golden_v4_rows() for s in part])
    originals = [
        decode_batch(encode_batch(r, seq=20 + k, uuid_in_header=False, **{**COMMON, "uuid": ""}).payload)
        for k, r in enumerate(_golden_v4_rows())
    ]
    plain = BatchCodec(dictionary_id=0)
    v3, v4 = (decode_batch(merge_batches(originals, plain, version=v).payload) for v in (3, 4))
    _same_samples(v4.samples, list(decoded.samples))
    _same_samples(v3.samples, list(decoded.samples))
    from mapper.wire import telemetry

    samples = [s for part in _golden_v4_rows() for s in part]
    parts = [BatchPart(20 + k, 12, "") for k in range(4)]
    meta3, _, _, out3 = telemetry._body(samples, "edge-1", "default/gpu0", "", "0badf00d", 20, False, parts, 3)
    assert len(GOLDEN_MERGED_V4) - 3 < len(meta3) + len(out3.data) + len(out3.bits.bytes())


@pytest.mark.parametrize(
    ("tail", "message"),
    [
        (b"\x00", "claims 0 parts"),
        (b"\x02\x18\x00\x02", "hold 13 rows, the batch 12"),
        (b"\x02\x00", "has no rows"),
    ],
)
def test_a_broken_parts_table_gets_an_error_that_says_what_is_wrong(tail: bytes, message: str) -> None:
    # A version 2 body of 12 rows without the uuid in its header, made a version 3 batch with a broken table (the
    # table goes after the first timestamp, which ends the meta part).
    from mapper.wire import telemetry

    samples = [Sample("", T0 + 1000 * i, {"temperature": 60 + i % 3}) for i in range(12)]
    meta, _, _, out = telemetry._body(samples, "edge-1", "default/gpu0", "", "0badf00d", 1, False)
    body = bytes(meta) + tail + bytes(out.data) + out.bits.bytes()
    with pytest.raises(BatchFormatError, match=message):
        decode_batch(b"G\x03\x00" + body)
    assert len(decode_batch(b"G\x03\x00" + bytes(meta) + b"\x01\x18" + body[len(meta) + len(tail) :]).samples) == 12


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.one_of(st.integers(-(2**66), 2**66), st.integers(-3, 3), st.integers(1000, 1010)), min_size=64, max_size=300
    ),
    st.integers(1, 40),
)
def test_long_int_columns_of_a_merged_batch_come_back_exactly_whatever_plan_codes_them(
    ints: list[int], per_batch: int
) -> None:
    samples = [Sample("", T0 + 1000 * i, {"pcie_tx": v, "power_usage": v / 1000}) for i, v in enumerate(ints)]
    chunks = [samples[i : i + per_batch] for i in range(0, len(samples), per_batch)]
    originals = [
        decode_batch(encode_batch(c, seq=k, uuid_in_header=False, **{**COMMON, "uuid": ""}).payload)
        for k, c in enumerate(chunks)
    ]
    decoded = decode_batch(merge_batches(originals).payload)
    _same_samples(decoded.samples, [s for o in originals for s in o.samples])


def test_a_long_column_that_is_quiet_then_busy_is_coded_in_blocks_and_is_smaller_for_it() -> None:
    from mapper.wire import telemetry

    quiet_then_busy = [0] * 200 + [(i * 7919) % 60000 for i in range(64)] + [1] * 200
    flat = telemetry._int_plan(quiet_then_busy)
    blocked = telemetry._blocked_plan(quiet_then_busy)
    assert isinstance(blocked, telemetry._BlockedPlan) and blocked.cost < flat.cost / 3
    samples = [Sample("", T0 + 1000 * i, {"pcie_rx": v}) for i, v in enumerate(quiet_then_busy)]
    originals = [
        decode_batch(encode_batch(samples[i : i + 10], seq=i, uuid_in_header=False, **COMMON).payload)
        for i in range(0, len(samples), 10)
    ]
    decoded = decode_batch(merge_batches(originals).payload)
    assert [s.values["pcie_rx"] for s in decoded.samples] == quiet_then_busy


@st.composite
def runs(draw: st.DrawFn) -> list[int]:
    """A column of runs: each a level (small, huge or negative) held, stepping, or with noise about it."""
    out: list[int] = []
    for _ in range(draw(st.integers(1, 12))):
        level = draw(st.one_of(st.integers(-5, 5), st.integers(-(2**66), 2**66), st.integers(60_000, 700_000)))
        length = draw(st.integers(1, 80))
        kind = draw(st.sampled_from(["held", "noise", "ramp", "spikes"]))
        noise = draw(st.integers(1, 2**20))
        rnd = draw(st.randoms(use_true_random=False))
        for i in range(length):
            if kind == "held":
                out.append(level)
            elif kind == "noise":
                out.append(level + rnd.randrange(noise))
            elif kind == "ramp":
                out.append(level + i * (noise % 7))
            else:
                out.append(level + (noise if rnd.random() < 0.05 else 0))
    return out


@settings(max_examples=80, deadline=None)
@given(runs(), st.integers(5, 60))
def test_columns_of_runs_noise_and_rare_steps_come_back_exactly_from_format_4(ints: list[int], per_batch: int) -> None:
    samples = [Sample("", T0 + 1000 * i, {"memory_used": v, "power_usage": v / 1000}) for i, v in enumerate(ints)]
    originals = [
        decode_batch(encode_batch(samples[i : i + per_batch], seq=i, uuid_in_header=False, **COMMON).payload)
        for i in range(0, len(samples), per_batch)
    ]
    merged = merge_batches(originals)
    decoded = decode_batch(merged.payload)
    assert decoded.version == 4
    _same_samples(decoded.samples, [s for o in originals for s in o.samples])


def test_the_cold_form_plans_a_switching_noisy_column_in_segments_and_a_rare_step_sparsely() -> None:
    from mapper.wire import telemetry

    rnd = __import__("random").Random(5)
    switching = [
        (600_000 if (i // 25) % 2 else 64_000) + rnd.randrange(2001 if (i // 25) % 2 == 0 else 175_001)
        for i in range(600)
    ]
    counter = [10**9 + 1000 * (i // 40) + (3 if i % 97 == 0 else 0) for i in range(600)]
    seg, sparse = telemetry._merged_plan(switching), telemetry._merged_plan(counter)
    assert type(seg) is telemetry._SegPlan and seg.cost < telemetry._blocked_plan(switching).cost * 0.9
    assert type(sparse) is telemetry._SparsePlan and sparse.cost < telemetry._blocked_plan(counter).cost * 0.5
    samples = [
        Sample("", T0 + 1000 * i, {"pcie_tx": a, "energy_consumption": b})
        for i, (a, b) in enumerate(zip(switching, counter, strict=True))
    ]
    originals = [
        decode_batch(encode_batch(samples[i : i + 10], seq=i, uuid_in_header=False, **COMMON).payload)
        for i in range(0, 600, 10)
    ]
    v3, v4 = (merge_batches(originals, version=v) for v in (3, 4))
    assert len(v4.payload) < len(v3.payload)
    decoded = decode_batch(v4.payload)
    assert [s.values["pcie_tx"] for s in decoded.samples] == switching
    assert [s.values["energy_consumption"] for s in decoded.samples] == counter


def _raw_v4_batches() -> list[bytes]:
    """Merged batches of format 4 with their bodies left uncompressed, so that damage reaches the parser."""
    from mapper.wire import telemetry

    rnd = __import__("random").Random(9)
    rows = [
        Sample(
            "",
            T0 + 1000 * i + (rnd.randrange(5) if i % 7 == 0 else 0),
            {
                "pcie_tx": (900_000 if (i // 30) % 2 else 2_000) + rnd.randrange(50_000),
                "memory_used": 2**30 * (i // 90),
                "xid_last": 79 if i in (17, 120) else 0,
                "temperature": 40 + i // 25,
                "power_usage": (65_000 + rnd.randrange(2001)) / 1000,
            },
        )
        for i in range(200)
    ]
    parts = [BatchPart(k, 20, "") for k in range(10)]
    meta, _, _, out = telemetry._body(rows, "edge-1", "default/gpu0", "", "0badf00d", 0, False, parts, 4)
    return [GOLDEN_MERGED_V4, b"G\x04\x00" + bytes(meta) + bytes(out.data) + out.bits.bytes()]


RAW_V4 = _raw_v4_batches()


def test_the_raw_format_4_batches_of_the_damage_test_decode() -> None:
    for raw in RAW_V4:
        assert decode_batch(raw).version == 4


@settings(max_examples=600, deadline=None)
@given(st.sampled_from(RAW_V4), st.sampled_from(["flip", "truncate", "insert"]), st.data())
def test_a_damaged_batch_of_format_4_decodes_or_is_refused_with_a_batch_format_error(
    raw: bytes, how: str, data: st.DataObject
) -> None:
    damaged = bytearray(raw)
    if how == "flip":
        for _ in range(data.draw(st.integers(1, 4))):
            i = data.draw(st.integers(3, len(damaged) - 1))
            damaged[i] ^= 1 << data.draw(st.integers(0, 7))
    elif how == "truncate":
        damaged = damaged[: data.draw(st.integers(3, len(damaged) - 1))]
    else:
        i = data.draw(st.integers(3, len(damaged)))
        damaged[i:i] = data.draw(st.binary(min_size=1, max_size=12))
    try:
        decode_batch(bytes(damaged))
    except BatchFormatError:
        pass
