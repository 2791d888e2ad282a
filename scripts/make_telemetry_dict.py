"""Build the static zstd dictionary of telemetry batches and write it to mapper/wire/dicts/<id>.zdict.

Deterministic: every simulated GPU profile, every workload scenario, a fixed seed and a fake clock feed the
real encoder (``mapper.wire.telemetry.batch_body``); the uncompressed bodies train a zstd dictionary with fixed
parameters on one thread. The same inputs give the same bytes; tests/test_telemetry.py checks that the
committed file is what this script builds.

Run: ``.venv/bin/python scripts/make_telemetry_dict.py [--check]`` after a change to the batch format, with a
NEW dictionary id when batches compressed with the old one may exist (ids are append-only). It writes the file
and prints its SHA-256: put that in ``DICTIONARY_SHA256`` (and the id in ``CURRENT_DICTIONARY_ID``) in
mapper/wire/dictionaries.py, which refuses a file whose bytes are not the ones hashed there. The dictionaries of
earlier ids cannot be rebuilt (the encoder that made their training bodies is gone): their committed files stay
as they are, each checked against its SHA-256 here, so that batches compressed with them still decode.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
from pathlib import Path

import zstandard

from mapper.clock import FakeClock
from mapper.edge.gpu.nvml import NvmlBackend
from mapper.edge.gpu.profiles import PROFILES
from mapper.edge.gpu.simnvml import SCENARIOS, SimNvml
from mapper.shared.model import NVML_PROPERTIES, Sample
from mapper.tools.discover import device_name
from mapper.wire.dictionaries import (
    CURRENT_DICTIONARY_ID,
    DICTIONARY_DIR,
    DICTIONARY_SHA256,
    dictionary_file_name,
    load_dictionary,
)
from mapper.wire.telemetry import batch_body

DICTIONARY_ID = 2
DICT_SIZE = 65536
SEED = 20_250_101
NODES = ("node-1", "edge-a")
PHASE_S = 480
WINDOW_S = 10
#: One GPU in CATALOG_EVERY (taking turns by phase) is sampled at the catalog cadences, the others at 1 Hz.
CATALOG_EVERY = 4
#: The folder of the dictionary files (the package data of ``mapper.wire``).
TARGET_DIR = Path(__file__).resolve().parent.parent / "mapper" / "wire" / DICTIONARY_DIR
#: Catalog properties added after the current dictionary was trained, left out of its training samples so that
#: the same inputs still give the same bytes (a new dictionary id may take them in). Batches holding them encode
#: and decode as any other; only their compression does not profit from the dictionary.
NEWER_THAN_DICTIONARY = frozenset({"memory_reserved", "energy_consumption_age"})
#: Catalog cycles changed after the current dictionary was trained, at the cycles it was trained with (PCIe
#: throughput went from 5 s to 30 s when its ~20 ms blocking read moved off the shared round).
TRAINED_CYCLES_S = {"pcie_tx": 5, "pcie_rx": 5}
#: The order the backend gave a sample's values in when the dictionary was trained (the encoder writes columns
#: in the order they first appear): the energy counter, now derived from the power reading, comes after it today.
TRAINED_ORDER = (
    "uuid",
    "product_name",
    "utilization_gpu",
    "utilization_memory",
    "memory_used",
    "memory_total",
    "temperature",
    "temperature_memory",
    "energy_consumption",
    "temperature_slowdown",
    "temperature_shutdown",
    "fan_speed",
    "power_usage",
    "power_limit_enforced",
    "power_limit_min",
    "power_limit_max",
    "power_limit_default",
    "power_limit",
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
    "locked_gpu_clock_min",
    "locked_gpu_clock_max",
    "locked_memory_clock_min",
    "locked_memory_clock_max",
    "persistence_mode",
    "compute_mode",
)


def trained_order(sample: Sample) -> Sample:
    """``sample`` with its values in ``TRAINED_ORDER`` (a name it does not list after those it does)."""
    rank = {name: i for i, name in enumerate(TRAINED_ORDER)}
    names = sorted(sample.values, key=lambda n: rank.get(n, len(rank)))
    return Sample(sample.uuid, sample.ts_ms, {n: sample.values[n] for n in names})


def training_bodies() -> list[bytes]:
    """Uncompressed batch bodies: each profile through every scenario in 10 s windows; one GPU in
    ``CATALOG_EVERY`` (taking turns by phase) sampled as the mapper samples a generated Device (each property at
    its catalog collect cycle: 1, 5, 10 or 60 s), the others every property every second; the uuid in the
    header of each GPU's first batch only (and where a batch holds the uuid), as a ``BatchEncoder`` writes it."""
    cycles_s = {
        p.name: TRAINED_CYCLES_S.get(p.name, max(1, p.collect_cycle_ms // 1000))
        for p in NVML_PROPERTIES
        if p.name not in NEWER_THAN_DICTIONARY
    }
    every = list(cycles_s)
    rng = random.Random(SEED)
    clock = FakeClock(start_wall_ms=1_700_000_000_000)
    profiles = sorted(PROFILES)
    sim = SimNvml.from_profiles(profiles, seed=SEED % 1000, clock=clock.monotonic)
    # (the energy counter and PCIe throughput read at every sample they are due in, as the backend did when the
    # dictionary was trained; the mapper now reads the counter every 60 s, deriving it from power in between, and
    # PCIe on a thread of its own ahead of its ask)
    backend = NvmlBackend(sim, clock=clock, energy_read_s=0, blocking_thread=False)
    backend.init()
    bodies: list[bytes] = []
    try:
        gpus = backend.list_gpus()
        boots = {g.uuid: f"{rng.getrandbits(64):016x}" for g in gpus}
        seqs = dict.fromkeys(boots, 0)
        for phase in range(len(SCENARIOS)):
            for i, g in enumerate(gpus):
                sim.set_scenario(g.uuid, SCENARIOS[(phase + i) % len(SCENARIOS)])
            pending: dict[str, list[Sample]] = {g.uuid: [] for g in gpus}
            for second in range(PHASE_S):
                clock.advance(1.0)
                due = [name for name, c in cycles_s.items() if second % c == 0]
                for i, g in enumerate(gpus):
                    catalog = (phase + i) % CATALOG_EVERY == 1
                    pending[g.uuid].append(trained_order(backend.sample(g.uuid, due if catalog else every)))
                if (second + 1) % WINDOW_S:
                    continue
                for i, g in enumerate(gpus):
                    node = NODES[(phase + i) % len(NODES)]
                    bodies.append(
                        batch_body(
                            pending[g.uuid],
                            node=node,
                            device=f"default/{device_name(node, g.index)}",
                            uuid=g.uuid,
                            boot_id=boots[g.uuid],
                            seq=seqs[g.uuid],
                            uuid_in_header=seqs[g.uuid] == 0,
                        )
                    )
                    seqs[g.uuid] += 1
                    pending[g.uuid] = []
    finally:
        backend.shutdown()
    return bodies


def build() -> bytes:
    bodies: list[bytes | bytearray | memoryview] = list(training_bodies())
    trained = zstandard.train_dictionary(DICT_SIZE, bodies, k=1024, d=8, threads=1, level=19, dict_id=DICTIONARY_ID)
    return trained.as_bytes()


def target(dict_id: int = DICTIONARY_ID) -> Path:
    """The file of dictionary ``dict_id`` in the source tree."""
    return TARGET_DIR / dictionary_file_name(dict_id)


def check_retired() -> None:
    """The committed files of earlier ids are there and hold their bytes (``DICTIONARY_SHA256``)."""
    for dict_id in sorted(i for i in DICTIONARY_SHA256 if i != DICTIONARY_ID):
        load_dictionary(dict_id)  # PermanentError naming the file when it is missing or altered


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--check", action="store_true", help="exit 1 when the committed file differs")
    args = ap.parse_args()
    check_retired()
    data = build()
    digest = hashlib.sha256(data).hexdigest()
    path = target()
    if args.check:
        same = path.is_file() and path.read_bytes() == data and DICTIONARY_SHA256.get(DICTIONARY_ID) == digest
        print("telemetry dictionary is up to date" if same else "telemetry dictionary differs; regenerate it")
        return 0 if same else 1
    committed = DICTIONARY_SHA256.get(DICTIONARY_ID)
    print(f"sha256 {digest}")
    if committed is not None and committed != digest:
        print(
            f"dictionary {DICTIONARY_ID} is committed with SHA-256 {committed}, and an id never changes meaning: "
            f"{path} is left as it is; give the new dictionary a new DICTIONARY_ID"
        )
        return 1
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(data)
    print(f"wrote {path} ({len(data)} bytes)")
    if committed is None or CURRENT_DICTIONARY_ID != DICTIONARY_ID:
        print(
            f"now set DICTIONARY_SHA256[{DICTIONARY_ID}] = {digest!r} and CURRENT_DICTIONARY_ID = {DICTIONARY_ID} "
            "in mapper/wire/dictionaries.py"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
