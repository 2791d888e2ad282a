"""Build the static zstd dictionary of telemetry batches and write mapper/wire/dictionaries.py.

Deterministic: every simulated GPU profile, every workload scenario, a fixed seed and a fake clock feed the
real encoder (``mapper.wire.telemetry.batch_body``); the uncompressed bodies train a zstd dictionary with fixed
parameters on one thread. The same inputs give the same bytes; tests/test_telemetry.py checks that the
committed dictionary is what this script builds.

Run: ``.venv/bin/python scripts/make_telemetry_dict.py [--check]`` after a change to the batch format, with a
NEW dictionary id when batches compressed with the old one may exist (ids are append-only). The dictionaries of
earlier ids cannot be rebuilt (the encoder that made their training bodies is gone): they are carried over
verbatim from the committed module, each checked against its SHA-256 in ``RETIRED_SHA256``, so that batches
compressed with them still decode.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import random
import sys
import textwrap
from pathlib import Path

import zstandard

from mapper.clock import FakeClock
from mapper.edge.gpu.nvml import NvmlBackend
from mapper.edge.gpu.profiles import PROFILES
from mapper.edge.gpu.simnvml import SCENARIOS, SimNvml
from mapper.shared.model import NVML_PROPERTIES, Sample
from mapper.tools.discover import device_name
from mapper.wire.telemetry import batch_body

DICTIONARY_ID = 2
#: Dictionaries of earlier ids, kept for reading: id -> SHA-256 of its bytes.
#: 1: format 2 with the GPU uuid in every batch header (2026-11).
RETIRED_SHA256 = {1: "6ae25b9485d38ca355c7bc3d4913645fb605bbb4c1b331735fb9e2351bc1c2e7"}
DICT_SIZE = 65536
SEED = 20_250_101
NODES = ("node-1", "edge-a")
PHASE_S = 480
WINDOW_S = 10
#: One GPU in CATALOG_EVERY (taking turns by phase) is sampled at the catalog cadences, the others at 1 Hz.
CATALOG_EVERY = 4
TARGET = Path(__file__).resolve().parent.parent / "mapper" / "telemetry_dict.py"
#: Catalog properties added after the current dictionary was trained, left out of its training samples so that
#: the same inputs still give the same bytes (a new dictionary id may take them in). Batches holding them encode
#: and decode as any other; only their compression does not profit from the dictionary.
NEWER_THAN_DICTIONARY = frozenset({"memory_reserved"})


def training_bodies() -> list[bytes]:
    """Uncompressed batch bodies: each profile through every scenario in 10 s windows; one GPU in
    ``CATALOG_EVERY`` (taking turns by phase) sampled as the mapper samples a generated Device (each property at
    its catalog collect cycle: 1, 5, 10 or 60 s), the others every property every second; the uuid in the
    header of each GPU's first batch only (and where a batch holds the uuid), as a ``BatchEncoder`` writes it."""
    cycles_s = {
        p.name: max(1, p.collect_cycle_ms // 1000) for p in NVML_PROPERTIES if p.name not in NEWER_THAN_DICTIONARY
    }
    every = list(cycles_s)
    rng = random.Random(SEED)
    clock = FakeClock(start_wall_ms=1_700_000_000_000)
    profiles = sorted(PROFILES)
    sim = SimNvml.from_profiles(profiles, seed=SEED % 1000, clock=clock.monotonic)
    backend = NvmlBackend(sim, clock=clock)
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
                    pending[g.uuid].append(backend.sample(g.uuid, due if catalog else every))
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


def retired() -> dict[int, bytes]:
    """The committed dictionaries of earlier ids, checked against ``RETIRED_SHA256``."""
    from mapper.wire.dictionaries import DICTIONARIES

    out: dict[int, bytes] = {}
    for dict_id, digest in sorted(RETIRED_SHA256.items()):
        data = DICTIONARIES.get(dict_id)
        if data is None or hashlib.sha256(data).hexdigest() != digest:
            raise SystemExit(f"retired telemetry dictionary {dict_id} is missing or altered in {TARGET}")
        out[dict_id] = data
    return out


def _literal(name: str, data: bytes) -> str:
    encoded = "\n".join(f'    "{line}"' for line in textwrap.wrap(base64.b64encode(data).decode("ascii"), 100))
    return f"{name} = base64.b64decode(\n{encoded}\n)\n\n"


def module_text(data: bytes) -> str:
    """The module: the retired dictionaries, then ``data`` as the current one."""
    dicts = {**retired(), DICTIONARY_ID: data}
    literals = "".join(_literal(f"_DICT_{i}", d) for i, d in sorted(dicts.items()))
    entries = ", ".join(f"{i}: _DICT_{i}" for i in sorted(dicts))
    return (
        '"""Static zstd dictionaries for telemetry batches (format version 2), by the id a batch carries in its '
        "flags.\n\nGENERATED by scripts/make_telemetry_dict.py; do not edit by hand. Append-only: an id never "
        'changes meaning.\n"""\n\n'
        "from __future__ import annotations\n\n"
        "import base64\n"
        "from collections.abc import Mapping\n"
        "from types import MappingProxyType\n\n"
        "#: The dictionary new batches are compressed with (0: none).\n"
        f"CURRENT_DICTIONARY_ID = {DICTIONARY_ID}\n\n"
        f"{literals}"
        f"DICTIONARIES: Mapping[int, bytes] = MappingProxyType({{{entries}}})\n"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--check", action="store_true", help="exit 1 when the committed module differs")
    args = ap.parse_args()
    text = module_text(build())
    if args.check:
        same = TARGET.read_text() == text
        print("telemetry dictionary is up to date" if same else "telemetry dictionary differs; regenerate it")
        return 0 if same else 1
    TARGET.write_text(text)
    print(f"wrote {TARGET}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
