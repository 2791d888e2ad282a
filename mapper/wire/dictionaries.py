"""Static zstd dictionaries for telemetry batches (format version 2), by the id a batch carries in its flags.

Each dictionary is a package data file, ``mapper/wire/dicts/<id>.zdict`` (written by
scripts/make_telemetry_dict.py), read when a codec first needs it and checked against its SHA-256 below: a batch
compressed with a dictionary decodes only with exactly those bytes, so a changed or missing file is an error that
names it, never a silently different dictionary. Append-only: an id never changes meaning, its file and hash
never change.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from importlib import resources
from importlib.resources.abc import Traversable
from types import MappingProxyType

from mapper.errors import PermanentError

#: The dictionary new batches are compressed with (0: none).
CURRENT_DICTIONARY_ID = 2

#: Every dictionary by id: the SHA-256 of its file's bytes.
#: 1: format 2 with the GPU uuid in every batch header (2026-11), kept for reading.
#: 2: format 2 with the uuid in an encoder's first batch only.
DICTIONARY_SHA256: Mapping[int, str] = MappingProxyType(
    {
        1: "6ae25b9485d38ca355c7bc3d4913645fb605bbb4c1b331735fb9e2351bc1c2e7",
        2: "7133493bddeee708a0dee3b5bb2edd14238929bb946254bfde7e542db147ccc7",
    }
)

#: The folder of the files, inside the package ``mapper.wire``.
DICTIONARY_DIR = "dicts"

_BAD = "bad-dictionary"


def dictionary_file_name(dict_id: int) -> str:
    """The file of dictionary ``dict_id`` in ``DICTIONARY_DIR``: ``<id>.zdict``."""
    return f"{dict_id}.zdict"


def load_dictionary(dict_id: int, *, package: Traversable | None = None) -> bytes:
    """The bytes of dictionary ``dict_id``, read from the package data (``package``: the folder holding
    ``DICTIONARY_DIR``; by default the installed ``mapper.wire``) and checked against ``DICTIONARY_SHA256``.

    ``KeyError`` for an id that is not in ``DICTIONARY_SHA256``; ``PermanentError`` (reason ``bad-dictionary``),
    naming the file, when the file is missing, unreadable or holds other bytes (a broken installation)."""
    digest = DICTIONARY_SHA256[dict_id]
    root = package if package is not None else resources.files("mapper.wire")
    path = root / DICTIONARY_DIR / dictionary_file_name(dict_id)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise PermanentError(f"telemetry dictionary {dict_id}: cannot read {path}: {exc}", reason=_BAD) from None
    got = hashlib.sha256(data).hexdigest()
    if got != digest:
        raise PermanentError(
            f"telemetry dictionary {dict_id}: {path} has SHA-256 {got}, not {digest}: the file was changed or "
            "damaged (batches compressed with it need its exact bytes); reinstall the package",
            reason=_BAD,
        )
    return data
