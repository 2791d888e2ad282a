"""NVIDIA's tools for the recovery flow (``mapper.edge.gpu.tools.NvidiaTools``), run as real child processes: stand-in
``nvidia-smi`` and ``dcgmi`` scripts that answer as the tools do (exit status, messages), hang or fail."""

from __future__ import annotations

import re
import stat
from pathlib import Path

import pytest

from mapper.edge.gpu.tools import NvidiaTools
from mapper.errors import PermanentError, TransientError

UUID = "GPU-0123abcd-0000-4000-8000-00000000beef"


def tool(folder: Path, name: str, body: str) -> Path:
    path = folder / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def tools(folder: Path, **scripts: str) -> NvidiaTools:
    found = {name.replace("_", "-"): tool(folder, name.replace("_", "-"), body) for name, body in scripts.items()}
    return NvidiaTools(which=lambda name: str(found[name]) if name in found else None)


SMI_OK = """
case "$1" in
  -q) echo "==============NVSMI LOG=============="; echo "GPU 00000000:3B:00.0"; exit 0 ;;
  -r) echo "GPU 00000000:3B:00.0 was successfully reset."; exit 0 ;;
esac
exit 2
"""
SMI_BUSY = """
case "$1" in
  -q) exit 0 ;;
  -r) echo "The following GPUs could not be reset:" >&2
      echo "  GPU 00000000:3B:00.0: In use by another client" >&2; exit 255 ;;
esac
"""
DCGMI_FAIL = """
echo "| Deployment            | Fail - All                                     |"
exit 0
"""
DCGMI_PASS = """
echo "| Deployment            | Pass                                           |"
exit 0
"""


def test_the_self_check_runs_the_tools_found_and_reads_their_verdicts(tmp_path: Path) -> None:
    results = tools(tmp_path, nvidia_smi=SMI_OK, dcgmi=DCGMI_FAIL).self_check(UUID, 10.0)
    assert [(r.tool, r.passed, r.reason) for r in results] == [
        ("nvidia-smi-q", True, "ok"),
        ("dcgmi-diag-r1", False, "a-test-failed"),
    ]
    results = tools(tmp_path, nvidia_smi=SMI_OK, dcgmi=DCGMI_PASS).self_check(UUID, 10.0)
    assert all(r.passed for r in results)


def test_a_tool_that_is_not_installed_is_left_out(tmp_path: Path) -> None:
    assert tools(tmp_path).self_check(UUID, 10.0) == []
    results = tools(tmp_path, nvidia_smi="exit 9\n").self_check(UUID, 10.0)
    assert [(r.tool, r.passed, r.reason) for r in results] == [("nvidia-smi-q", False, "exit-9")]


def test_a_hanging_tool_is_a_failed_check_after_its_timeout(tmp_path: Path) -> None:
    results = tools(tmp_path, nvidia_smi="exec sleep 30\n").self_check(UUID, 0.5)
    assert [(r.tool, r.passed, r.reason) for r in results] == [("nvidia-smi-q", False, "timeout-after-0.5s")]


def test_the_reset_runs_nvidia_smi_r_on_that_gpu_and_says_why_it_failed(tmp_path: Path) -> None:
    log = tmp_path / "args"
    ok = tools(tmp_path, nvidia_smi=f'echo "$@" > {log}\n' + SMI_OK)
    ok.reset(UUID, 10.0)
    assert log.read_text().split() == ["-r", "-i", UUID]
    busy = tools(tmp_path, nvidia_smi=SMI_BUSY)
    refused = re.escape("nvidia-smi -r failed: GPU 00000000:3B:00.0: In use by another client")
    with pytest.raises(PermanentError, match=refused):
        busy.reset(UUID, 10.0)
    with pytest.raises(PermanentError, match="nvidia-smi is not on PATH"):
        tools(tmp_path).reset(UUID, 10.0)
    with pytest.raises(TransientError, match=re.escape("nvidia-smi -r took longer than 0.5s")):
        tools(tmp_path, nvidia_smi="exec sleep 30\n").reset(UUID, 0.5)
