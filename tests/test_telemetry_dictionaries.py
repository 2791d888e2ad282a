"""The zstd dictionaries of format-2 batches as package data files (mapper/wire/dicts/<id>.zdict): each holds the
bytes its SHA-256 in ``mapper.wire.dictionaries`` stands for, a wheel built from the tree ships them, an installed
(non-editable) copy finds them with importlib.resources, and a changed or missing file is refused, named."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

from mapper.errors import PermanentError
from mapper.wire.dictionaries import CURRENT_DICTIONARY_ID, DICTIONARY_SHA256, load_dictionary
from mapper.wire.telemetry import BatchCodec

REPO = Path(__file__).resolve().parent.parent
DICTS = REPO / "mapper" / "wire" / "dicts"
#: The zstd dictionary magic number, little-endian (RFC 8878, section 5).
ZSTD_DICT_MAGIC = b"\x37\xa4\x30\xec"


def tampered_copy(tmp_path: Path, dict_id: int) -> Path:
    """A copy of the dictionary folder under ``tmp_path`` with one byte of ``dict_id``'s file flipped; the copy's
    package folder (the one holding ``dicts``)."""
    shutil.copytree(DICTS, tmp_path / "dicts")
    path = tmp_path / "dicts" / f"{dict_id}.zdict"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    return tmp_path


def test_each_file_is_a_zstd_dictionary_of_its_id_with_the_hash_in_the_code() -> None:
    assert sorted(p.name for p in DICTS.iterdir()) == [f"{i}.zdict" for i in sorted(DICTIONARY_SHA256)]
    assert CURRENT_DICTIONARY_ID in DICTIONARY_SHA256
    for dict_id, digest in DICTIONARY_SHA256.items():
        data = (DICTS / f"{dict_id}.zdict").read_bytes()
        assert hashlib.sha256(data).hexdigest() == digest
        assert len(data) == 65536
        # The dictionary header: magic, then the id a trained dictionary carries (little-endian).
        assert data[:4] == ZSTD_DICT_MAGIC and int.from_bytes(data[4:8], "little") == dict_id
        assert load_dictionary(dict_id) == data


def test_a_changed_dictionary_file_is_refused_naming_it(tmp_path: Path) -> None:
    package = tampered_copy(tmp_path, 2)
    with pytest.raises(PermanentError, match=r"dicts/2\.zdict has SHA-256 [0-9a-f]{64}, not 7133493b") as info:
        load_dictionary(2, package=package)
    assert info.value.reason == "bad-dictionary"
    assert load_dictionary(1, package=package) == (DICTS / "1.zdict").read_bytes(), "the other one is intact"


def test_a_missing_dictionary_file_is_refused_naming_it(tmp_path: Path) -> None:
    shutil.copytree(DICTS, tmp_path / "dicts")
    (tmp_path / "dicts" / "1.zdict").unlink()
    with pytest.raises(PermanentError, match=r"telemetry dictionary 1: cannot read .*dicts/1\.zdict") as info:
        load_dictionary(1, package=tmp_path)
    assert info.value.reason == "bad-dictionary"


def test_an_id_without_a_hash_is_not_a_dictionary() -> None:
    with pytest.raises(KeyError):
        load_dictionary(15)


# --------------------------------------------------------------------------------------------------
# A wheel built from the tree, installed as a plain (non-editable) copy
# --------------------------------------------------------------------------------------------------

#: Run by a fresh interpreter without site (so without this checkout's editable install): argv[1] the installed
#: copy, argv[2] the folder of the third-party packages. A batch through the codec (the current dictionary to
#: compress, every dictionary to decompress), then where the package and its dictionaries were found.
INSTALLED_CHILD = textwrap.dedent(
    """
    import json, sys
    sys.path[:0] = [sys.argv[1], sys.argv[2]]
    import mapper.wire.dictionaries as d
    from mapper.wire.telemetry import BatchCodec
    from importlib import resources

    codec = BatchCodec()
    body = b"gpu-mapper telemetry " * 64
    packed = codec.pack(body)  # magic, version, flags, then the zstd frame
    flags = packed[2]
    got = BatchCodec().unpack(flags, packed[3:])
    print(json.dumps({
        "module": d.__file__,
        "found": [str(p) for p in sorted((resources.files("mapper.wire") / "dicts").iterdir(), key=str)],
        "flags": flags,
        "round_trip": got == body,
        "loaded": {i: len(d.load_dictionary(i)) for i in d.DICTIONARY_SHA256},
    }))
    """
)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's wheel, built from a copy of what the Containerfile copies (pyproject.toml, README.md,
    mapper/), by pip with this environment's setuptools, offline."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    shutil.copytree(REPO / "mapper", src / "mapper", ignore=shutil.ignore_patterns("__pycache__"))
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q"]
    done = subprocess.run([*cmd, "-w", str(tmp / "out"), str(src)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    (built,) = (tmp / "out").glob("*.whl")
    return built


def test_the_wheel_ships_every_dictionary_file_with_its_bytes(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        shipped = {n: zf.read(n) for n in zf.namelist() if n.startswith("mapper/wire/dicts/")}
    assert sorted(shipped) == [f"mapper/wire/dicts/{i}.zdict" for i in sorted(DICTIONARY_SHA256)]
    for dict_id, digest in DICTIONARY_SHA256.items():
        assert hashlib.sha256(shipped[f"mapper/wire/dicts/{dict_id}.zdict"]).hexdigest() == digest


def run_installed(site: Path) -> subprocess.CompletedProcess[str]:
    purelib = sysconfig.get_paths()["purelib"]  # zstandard and the other dependencies
    return subprocess.run(
        [sys.executable, "-I", "-S", "-c", INSTALLED_CHILD, str(site), purelib],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=site,
    )


def test_an_installed_copy_finds_its_dictionaries_and_refuses_a_changed_one(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)  # a wheel is the installed tree, as pip lays it out
    done = run_installed(site)
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(done.stdout)
    assert Path(got["module"]).is_relative_to(site), "the installed copy, not this checkout"
    assert got["found"] == [str(site / "mapper/wire/dicts" / f"{i}.zdict") for i in sorted(DICTIONARY_SHA256)]
    assert got["flags"] == 0x01 | CURRENT_DICTIONARY_ID << 4, "compressed with the current dictionary"
    assert got["round_trip"] is True
    assert got["loaded"] == {str(i): 65536 for i in DICTIONARY_SHA256}

    installed = site / "mapper/wire/dicts" / f"{CURRENT_DICTIONARY_ID}.zdict"
    data = bytearray(installed.read_bytes())
    data[100] ^= 0xFF
    installed.write_bytes(bytes(data))
    broken = run_installed(site)
    assert broken.returncode != 0
    assert f"PermanentError: telemetry dictionary {CURRENT_DICTIONARY_ID}: {installed} has SHA-256" in broken.stderr


def test_a_codec_over_an_unknown_id_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"dictionary id 9 is unknown \(known: 0, \[1, 2\]\)"):
        BatchCodec(dictionary_id=9)
