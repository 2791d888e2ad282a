"""The image's run lines as docs/operations.md ("Running the image") shows them: parsed, so that
``tests/test_image.py`` runs the image with the documented podman flags and a test keeps the lines in step."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OPERATIONS = REPO / "docs" / "operations.md"
SECTION = "### Running the image"


@dataclass(frozen=True)
class RunLine:
    """One documented ``<runtime> run`` line: the runtime's flags (before the image), the image, and the words
    after it."""

    runtime: str
    flags: tuple[str, ...]
    image: str
    args: tuple[str, ...]


def documented_commands(text: str | None = None) -> list[list[str]]:
    """Every command of the section's ``sh`` block, continuation lines joined, split as the shell would."""
    text = OPERATIONS.read_text() if text is None else text
    start = text.index(SECTION)
    block = re.search(r"```sh\n(.*?)```", text[start:], re.S)
    assert block is not None, f"no sh block under {SECTION!r} in {OPERATIONS}"
    joined = block.group(1).replace("\\\n", " ")
    return [shlex.split(line) for line in joined.splitlines() if line.strip()]


def documented_runs(text: str | None = None) -> dict[str, RunLine]:
    """The ``run`` line of each runtime (podman, docker, nerdctl, ctr), by runtime."""
    out: dict[str, RunLine] = {}
    for words in documented_commands(text):
        if words[0] == "sudo":
            words = words[1:]
        runtime = words[0]
        rest = words[1:]
        if runtime == "ctr":
            while rest and rest[0] != "run":  # ctr's own flags: -n k8s.io
                rest = rest[1:]
        if not rest or rest[0] != "run":
            continue
        rest = rest[1:]
        image_at = next(i for i, w in enumerate(rest) if not w.startswith("-"))
        out[runtime] = RunLine(runtime, tuple(rest[:image_at]), rest[image_at], tuple(rest[image_at + 1 :]))
    return out


def podman_line() -> RunLine:
    return documented_runs()["podman"]


def documented_limits() -> list[str]:
    """The documented podman line's ``--ulimit=...`` flags."""
    return [f for f in podman_line().flags if f.startswith("--ulimit")]


def documented_container_flags() -> list[str]:
    """The documented podman line's other flags but the volume: ``--rm``, ``--network=host``, ..."""
    return [f for f in podman_line().flags if not f.startswith(("--ulimit", "--volume"))]


def documented_data_mount() -> tuple[str, str]:
    """The documented podman line's data volume: (host folder, folder in the container)."""
    (volume,) = [f for f in podman_line().flags if f.startswith("--volume=")]
    src, dst = volume.removeprefix("--volume=").split(":", 1)
    return src, dst
