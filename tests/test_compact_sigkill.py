"""SIGKILL while batches are stored and compacted: a real process on a real SQLite file, killed at 24 seeded
random points. After every kill each stored batch is there exactly once (as itself or as a part of a merged
batch), with exactly its samples, in order."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mapper.edge.storage.buffer import Buffer
from mapper.wire.telemetry import decode_batch, records_equal

REPO = Path(__file__).resolve().parent.parent
TRIALS = 24

#: The child: stores batch after batch (seq, then its samples are a function of seq) and merges after every
#: few, printing each seq once its put committed. Batches are stamped long ago, so every one is a candidate and
#: every 60 s slot (6 batches) is over at once.
CHILD = textwrap.dedent(
    """
    import sys
    from mapper.edge.outbox.records import StoredBatch
    from mapper.edge.storage.buffer import Buffer
    from mapper.clock import SystemClock
    from mapper.edge.outbox.compact import CompactionSettings, Compactor
    from mapper.wire.telemetry import decode_batch, encode_batch
    from tests.test_compact_sigkill import samples_of

    buf = Buffer(sys.argv[1], max_bytes=10**9, max_age_s=10**12)
    start = 0
    for row in buf.pending(10**6):
        start = max(start, decode_batch(row.payload).seq_last + 1)
    comp = Compactor(buf, SystemClock(), CompactionSettings(min_age_s=0, slot_s=60, partial_after=4))
    print("ready", start, flush=True)
    for seq in range(start, start + 100000):
        b = encode_batch(samples_of(seq), node="n1", device="default/gpu0", uuid="", boot_id="0badf00d", seq=seq)
        buf.put(StoredBatch(device=b.device, uuid="", boot_id=b.boot_id, seq=seq, ts_first_ms=b.ts_first_ms,
                ts_last_ms=b.ts_last_ms, topic="gpu-mapper/n1/default/gpu0/telemetry", payload=b.payload))
        print("put", seq, flush=True)
        if seq % 3 == 2:
            comp.compact_all(max_merges=2)
    """
)


def samples_of(seq: int) -> list:  # type: ignore[type-arg]
    from mapper.shared.model import Sample

    return [
        Sample(
            "",
            1_700_000_000_000 + seq * 10_000 + i * 1000,
            {"power_usage": 100.0 + (seq * 7 + i) % 13 / 8, "temperature": 50 + (seq + i) % 5},
        )
        for i in range(10)
    ]


@pytest.mark.slow
def test_a_sigkill_at_any_point_of_storing_or_compacting_loses_nothing_and_duplicates_nothing(tmp_path: Path) -> None:
    db = tmp_path / "buffer.db"
    rng = random.Random(20261201)
    reported: set[int] = set()
    merged_rows_seen = 0
    cold_rows_seen = 0  # merged rows in the cold form (format 4: a slot, or a cold slot, that is over)
    for trial in range(TRIALS):
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(db)], cwd=REPO, stdout=subprocess.PIPE, env={**os.environ}
        )
        try:
            assert proc.stdout is not None
            first = proc.stdout.readline().split()
            assert first[0] == b"ready", first
            time.sleep(rng.uniform(0.02, 0.5))  # the kill point: a seeded random moment of the run
            os.kill(proc.pid, signal.SIGKILL)
            out = proc.stdout.read()
        finally:
            proc.wait(10)
        assert proc.returncode == -signal.SIGKILL
        # Only whole lines: the kill can land in the middle of the child writing one ("put 12" of "put 123").
        whole = out.split(b"\n")[:-1]
        reported |= {int(line.split()[1]) for line in whole if line.startswith(b"put ")}

        buf = Buffer(db, max_bytes=10**9, max_age_s=10**12)
        try:
            seqs: list[int] = []
            for row in buf.pending(10**6):
                batch = decode_batch(row.payload)
                merged_rows_seen += batch.merged
                cold_rows_seen += batch.version == 4
                for part in batch.split():
                    seqs.append(part.seq)
                    want = samples_of(part.seq)
                    assert [s.ts_ms for s in part.samples] == [s.ts_ms for s in want], (trial, part.seq)
                    assert all(records_equal(g.values, w.values) for g, w in zip(part.samples, want, strict=True))
            assert seqs == sorted(set(seqs)), f"trial {trial}: a batch twice or out of order"
            present = set(seqs)
            assert reported <= present, f"trial {trial}: committed batches lost: {sorted(reported - present)[:5]}"
            # At most the one batch whose put committed just before the kill, not yet reported.
            assert len(present - reported) <= 1 and all(s == max(reported, default=-1) + 1 for s in present - reported)
            reported |= present
            assert buf.stats().batches == len(buf.pending(10**6))
        finally:
            buf.close()
    assert len(reported) > 50 and merged_rows_seen > 0 and cold_rows_seen > 0, (
        len(reported),
        merged_rows_seen,
        cold_rows_seen,
    )
