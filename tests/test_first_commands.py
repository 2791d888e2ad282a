"""A new user's first commands, as written in the README: they run as written, and what they print is readable.

The README's commands name the virtual environment's ``gpu-mapper`` and parse with the real parser; the demo edits
a copy of the tracked example Devices; ``decode`` says plainly what a file is not; a command's flag given without
the command, and a bad flag of a command, are answered with that command; ``status`` fits 120 columns; durations
are rounded.
"""

from __future__ import annotations

import asyncio
import re
import shlex
import sqlite3
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from mapper.cli import build_parser
from mapper.clock import format_duration_s
from mapper.edge.gpu.simnvml import SimNvml
from mapper.edge.health.checks import HealthReport
from mapper.edge.status.metrics import write_status_file
from mapper.edge.status.stats import GpuSnapshot, MapperSnapshot
from mapper.edge.status.view import WIDTH, render_status
from mapper.edge.storage.buffer import Buffer
from mapper.net.http import LoopHeartbeat, check_liveness
from mapper.shared.model import GpuInfo, Sample
from mapper.wire.telemetry import encode_batch
from tests.apphelpers import fast_settings, running_app, wait_for
from tests.test_metrics import H100, T4, make_snapshot
from tests.test_processloop import workloads

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
SUBCOMMANDS = ("run", "discover", "model", "decode", "status", "buffer", "bridge")


def gpu_mapper(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mapper.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        input=None if stdin is None else stdin.decode("latin-1"),
    )


# --------------------------------------------------------------------------------------------------
# The README
# --------------------------------------------------------------------------------------------------


def _fenced_lines(text: str) -> list[str]:
    return [line for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S) for line in block.splitlines()]


def _code_spans(text: str) -> list[str]:
    without_blocks = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.findall(r"`([^`\n]+)`", without_blocks.replace("`\n", "` ").replace("\n", " "))


def test_the_readme_opens_with_the_two_commands_that_set_everything_up() -> None:
    first_block = _fenced_lines(README.read_text())[:2]
    assert [line.split("#")[0].strip() for line in first_block] == ["scripts/demo.sh", "scripts/test.sh"]
    for script in ("scripts/demo.sh", "scripts/test.sh", "scripts/bootstrap.sh", "scripts/demo-jetson.sh"):
        path = REPO / script
        assert path.is_file() and path.stat().st_mode & 0o111, f"{script} is not executable"
    # test.sh runs the suite (after the set-up), demo.sh the demo: what the README says they do.
    assert "exec python -m pytest" in (REPO / "scripts" / "test.sh").read_text()
    assert ".venv/bin/gpu-mapper run --sim 4" in (REPO / "scripts" / "demo.sh").read_text()


def test_every_command_the_readme_shows_runs_the_venvs_gpu_mapper() -> None:
    text = README.read_text()
    bad = []
    commands_table = False
    for line in text.splitlines():
        if line.startswith("## "):
            commands_table = line == "## Commands"
        for m in re.finditer(r"(\S*)gpu-mapper (" + "|".join(SUBCOMMANDS) + r")\b([^`|]*)", line):
            prefix, args = m.group(1), m.group(3).strip()
            named_only = not args or args.startswith((",", ")", "(", "writes"))
            if prefix.endswith(".venv/bin/") or named_only or commands_table:
                continue
            bad.append(line.strip())
    assert not bad, "commands without .venv/bin/:\n" + "\n".join(bad)
    # The commands table says how its names are run.
    table_note = text.split("## Commands", 1)[1].split("|", 1)[0]
    assert "`.venv/bin/gpu-mapper <command>`" in table_note
    assert "source .venv/bin/activate" in text


def _readme_commands() -> list[list[str]]:
    text = README.read_text()
    found = []
    for candidate in [*_fenced_lines(text), *_code_spans(text)]:
        candidate = candidate.strip()
        if not candidate.startswith(".venv/bin/gpu-mapper ") or "<" in candidate:
            continue
        words = shlex.split(candidate, comments=True)
        if ">" in words:
            words = words[: words.index(">")]
        found.append(words[1:])
    return found


def test_every_venv_command_in_the_readme_parses_with_the_real_parser() -> None:
    commands = _readme_commands()
    assert len(commands) >= 6, commands
    parser = build_parser()
    for argv in commands:
        if argv[-1] == "FILE":  # a placeholder
            argv = [*argv[:-1], "some-file"]
        try:
            parser.parse_args(argv)
        except SystemExit as exc:
            raise AssertionError(f"the README's command does not parse: gpu-mapper {' '.join(argv)}") from exc


def test_the_demo_edits_a_copy_and_the_readme_and_the_example_say_so() -> None:
    demo = (REPO / "scripts" / "demo.sh").read_text()
    assert "cp -R device-models/examples" in demo and '--devices "$data/devices"' in demo and "data=.demo-data" in demo
    readme = README.read_text()
    assert "`.demo-data/devices/demo-node.yaml`" in readme
    assert "Edit `device-models/examples" not in readme
    example = (REPO / "device-models" / "examples" / "demo-node.yaml").read_text()
    assert ".demo-data/devices/" in example.split("---")[0]
    jetson = (REPO / "scripts" / "demo-jetson.sh").read_text()
    assert "cp -R device-models/examples-jetson" in jetson and "data=.demo-jetson-data" in jetson
    assert "--metrics-addr 127.0.0.1:9420" in jetson and "--node-name demo-jetson" in jetson


# --------------------------------------------------------------------------------------------------
# decode
# --------------------------------------------------------------------------------------------------


def test_decode_points_from_the_buffer_file_to_buffer_export(tmp_path: Path) -> None:
    buf = Buffer(tmp_path / "telemetry.db", max_bytes=10_000_000, max_age_s=10**9)
    buf.close()
    with sqlite3.connect(tmp_path / "telemetry.db") as conn:  # an SQLite file: the buffer's
        assert conn.execute("SELECT name FROM sqlite_master WHERE name = 'batches'").fetchone()
    out = gpu_mapper("decode", str(tmp_path / "telemetry.db"))
    assert out.returncode == 1 and out.stdout == ""
    assert "not a telemetry batch" in out.stderr and "gpu-mapper buffer export" in out.stderr
    assert "claims" not in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("empty", b""),
        ("passwd", b"root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n"),
        ("json", b'{"hello": "world"}\n'),
        ("zeros", bytes(64)),
    ],
)
def test_decode_says_plainly_what_is_not_a_telemetry_batch_and_fails(tmp_path: Path, name: str, content: bytes) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    out = gpu_mapper("decode", str(path))
    assert out.returncode == 1, out
    assert out.stdout == ""
    assert f"decode: {path}:" in out.stderr and "not a telemetry batch" in out.stderr, out.stderr
    assert "claims" not in out.stderr and "Traceback" not in out.stderr
    piped = gpu_mapper("decode", "-", stdin=content)
    assert piped.returncode == 1 and "not a telemetry batch" in piped.stderr


def test_decode_still_reads_a_batch() -> None:
    sample = Sample(H100, 1_780_000_000_000, {"temperature": 61})
    batch = encode_batch([sample], node="n", device="d/g", uuid=H100, boot_id="0a1b2c3d", seq=1)
    out = gpu_mapper("decode", "-", stdin=batch.payload)
    assert out.returncode == 0 and '"value":61' in out.stdout, out


# --------------------------------------------------------------------------------------------------
# Flags in the wrong place
# --------------------------------------------------------------------------------------------------


def test_a_commands_flag_without_the_command_suggests_it() -> None:
    out = gpu_mapper("--sim", "2")
    assert out.returncode == 2
    assert "did you mean 'gpu-mapper run --sim 2'?" in out.stderr, out.stderr
    assert "invalid choice" not in out.stderr
    assert "did you mean 'gpu-mapper run --node-name x'?" in gpu_mapper("--node-name", "x").stderr
    # Not a flag of any command: the top-level error as before.
    assert "unrecognized arguments" in gpu_mapper("run", "--sim", "1", "--nope").stderr


@pytest.mark.parametrize(
    ("argv", "usage"),
    [
        (["run", "--bogus"], "usage: gpu-mapper run "),
        (["status", "--bogus"], "usage: gpu-mapper status "),
        (["decode", "--bogus"], "usage: gpu-mapper decode "),
        (["discover", "--bogus"], "usage: gpu-mapper discover "),
        (["bridge", "--bogus"], "usage: gpu-mapper bridge "),
        (["buffer", "export", "--bogus"], "usage: gpu-mapper buffer export "),
    ],
)
def test_a_bad_flag_of_a_command_prints_that_commands_usage(argv: list[str], usage: str) -> None:
    out = gpu_mapper(*argv)
    assert out.returncode == 2
    assert out.stderr.startswith(usage), out.stderr
    assert "unrecognized arguments: --bogus" in out.stderr
    assert "{run,discover" not in out.stderr, "not the top-level usage"


# --------------------------------------------------------------------------------------------------
# status in 120 columns
# --------------------------------------------------------------------------------------------------


def _worst_snapshot() -> MapperSnapshot:
    """Long names, every cell at its longest: an unhealthy GPU, rejected values, an asked cap, no sample yet."""
    snap = make_snapshot()
    long_device = "gpu-workloads-production/" + "edge-node-with-a-long-name-0123456789-gpu0"
    sick = HealthReport(
        status="unhealthy",
        level=3,
        reason="probe-fail-cuCtxCreate-CUDA_ERROR_UNKNOWN",
        levels=((1, "healthy", "ok"), (2, "degraded", "persistenced-not-running"), (3, "unhealthy", "probe-fail")),
    )
    h100 = replace(
        snap.gpus[0],
        device=long_device,
        desired_status="power_limit:rejected-out-of-range,locked_gpu_clocks:rejected-not-supported-clock,"
        "locked_memory_clocks:pending,persistence_mode:applied,compute_mode:rejected-unknown-value",
        policy_state="thermal-throttle:power_limit=300",
        desired_power_limit_w=500.0,
        health=sick,
        state="unhealthy",
    )
    t4 = replace(snap.gpus[1], sample=None, state="unknown")
    pods = replace(workloads(H100), reason="pod 1234 not found in the kubelet's or edged's files; " * 3)
    return replace(
        snap,
        gpus=(h100, t4),
        workloads=(pods,),
        buffer_drops={f"reason-{i}": i for i in range(20)},
        desired_rejections={f"rejected-reason-{i}": 1 for i in range(15)},
    )


@pytest.mark.parametrize("which", ["example", "worst"])
def test_status_fits_120_columns_and_wide_gives_everything(which: str) -> None:
    snap = make_snapshot() if which == "example" else _worst_snapshot()
    narrow = render_status(snap)
    assert WIDTH == 120
    too_long = [line for line in narrow.splitlines() if len(line) > 120]
    assert not too_long, too_long
    wide = render_status(snap, wide=True)
    assert max(len(line) for line in wide.splitlines()) > 120
    for gpu in snap.gpus:
        assert gpu.info.uuid in wide
        if gpu.device:
            assert gpu.device in narrow  # named in full, in the table or in a note under it
    if which == "worst":
        # What the short cells leave out is under the table, in full (wrapped at the same width).
        joined = " ".join(narrow.split())
        assert "probe-fail-cuCtxCreate-CUDA_ERROR_UNKNOWN" in joined
        assert snap.gpus[0].desired_status.replace(",", ", ") in joined
        assert "thermal-throttle:power_limit=300" in joined
        assert "(no Device) GPU-11111111" not in narrow and "(no Device) GPU-aaaaaaaa" in narrow


@pytest.mark.timeout(90)
async def test_the_demos_status_fits_120_columns_and_its_healthz_durations_are_rounded(tmp_path: Path) -> None:
    """The demo's own node (4 simulated GPUs, the example Devices): the table the issue measured 220 wide."""
    import urllib.error
    import urllib.request

    sim = SimNvml(4, "H100", seed=0, scenario="inference")
    data = tmp_path / "data"
    settings = fast_settings(
        str(data), devices_dir=str(REPO / "device-models" / "examples"), node_name="demo-node", sim=4
    )
    async with running_app(settings, sim) as app:
        assert app.metrics is not None
        await wait_for(
            lambda: sum("applied" in w.desired_status for w in app.workers.values()) == 2, what="desired applied"
        )
        snap = app.status.snapshot()
        url = app.metrics.url + "/healthz"

        def get_healthz() -> str:
            try:
                with urllib.request.urlopen(url, timeout=5) as resp:
                    return str(resp.read().decode())
            except urllib.error.HTTPError as exc:
                raise AssertionError(exc.read().decode()) from None

        healthz = await asyncio.to_thread(get_healthz)  # the server asks this event loop: not from it
    write_status_file(data, snap)
    narrow = gpu_mapper("status", "--data-dir", str(data))
    wide = gpu_mapper("status", "--data-dir", str(data), "--wide")
    assert narrow.returncode == 0 and wide.returncode == 0, (narrow.stderr, wide.stderr)
    assert max(len(line) for line in narrow.stdout.splitlines()) <= 120, narrow.stdout
    assert "demo-node-gpu3" in narrow.stdout and "2 applied" in narrow.stdout
    assert all(g.info.uuid in wide.stdout for g in snap.gpus)
    assert "power_limit:applied,locked_gpu_clocks:applied" in wide.stdout
    # /healthz: every period and stall limit in whole seconds or one decimal, none like 59.8892.
    assert "period" in healthz and not re.search(r"\d\.\d\d", healthz), healthz


def test_liveness_lines_round_periods_and_limits() -> None:
    beats = [LoopHeartbeat("devices-dir", 100.0, 59.8892), LoopHeartbeat("collect", 100.0, 0.1)]
    live = check_liveness(beats, 130.0)
    assert "devices-dir: last beat 30.0 s ago (period 60 s, stalled after 299 s)" in live.lines
    assert "collect: last beat 30.0 s ago (period 0.1 s, stalled after 10 s)" in live.lines[0].replace("STALLED ", "")


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.04, "0.04 s"),
        (0.25, "0.25 s"),
        (1.0, "1 s"),
        (2.94, "2.9 s"),
        (59.8892, "60 s"),
        (299.446, "299 s"),
        (2820.0, "47 min"),
        (3.5 * 3600, "3.5 h"),
    ],
)
def test_durations_are_rounded_for_people(seconds: float, text: str) -> None:
    assert format_duration_s(seconds) == text


def test_a_gpu_without_a_device_is_named_by_its_uuid_in_the_narrow_table() -> None:
    gpu = GpuSnapshot(info=GpuInfo(uuid=T4, index=0, name="n"))
    text = render_status(MapperSnapshot(node="edge1", mode="standalone", gpus=(gpu,)))
    row = next(line for line in text.splitlines() if line.startswith("(no Device)"))
    assert row.startswith("(no Device) GPU-aaaaaaaa") and "no sample yet" in row and "…" not in row
