"""The command line, as a user runs it: subprocesses of the installed ``gpu-mapper`` entry point."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from mapper.edge.status.stats import MapperSnapshot
from tests.test_device_models import assert_valid_kubeedge, crds_available, needs_crds

REPO = Path(__file__).resolve().parents[1]


def gpu_mapper(*args: str, **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mapper.cli", *args], capture_output=True, text=True, timeout=60, cwd=REPO, **kwargs
    )


@needs_crds
def test_discover_prints_one_valid_device_per_simulated_gpu():
    out = gpu_mapper("discover", "--sim", "2", "--node-name", "edge-7")
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert [d["metadata"]["name"] for d in docs] == ["edge-7-gpu0", "edge-7-gpu1"]
    uuids = {d["spec"]["protocol"]["configData"]["uuid"] for d in docs}
    assert len(uuids) == 2 and all(u.startswith("GPU-") for u in uuids)
    for doc in docs:
        assert doc["spec"]["nodeName"] == "edge-7"
        assert doc["spec"]["protocol"]["protocolName"] == "gpu"
        assert_valid_kubeedge(doc, "discover")
        # The simulated H100 has no fan: probed, left out, and the comment above the Device says so.
        assert "fan_speed" not in [p["name"] for p in doc["spec"]["properties"]]
    assert out.stdout.count("#   fan_speed: NVML answers NotSupported") == 2


@needs_crds
@pytest.mark.parametrize("profile", ["orin-agx", "xavier-agx", "orin-nano"])
def test_discover_on_a_simulated_jetson_prints_its_one_valid_device_of_the_jetson_model(profile):
    out = gpu_mapper("discover", "--sim", "1", "--sim-profile", profile, "--node-name", "jetson-1")
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert [d["metadata"]["name"] for d in docs] == ["jetson-1-gpu0"]
    doc = docs[0]
    assert_valid_kubeedge(doc, "discover")
    assert doc["spec"]["deviceModelRef"]["name"] == "nvidia-jetson"
    assert doc["spec"]["protocol"]["configData"]["uuid"].startswith("GPU-")
    names = [p["name"] for p in doc["spec"]["properties"]]
    assert {"gpu_max_freq", "gpu_min_freq", "power_mode", "temperature", "utilization_gpu"} <= set(names)
    assert "power_limit" not in names
    if profile == "orin-nano":  # no debugfs EMC clock on this layout: probed, left out, said so
        assert "emc_freq" not in names and "#   emc_freq: the board has no such file" in out.stdout
    else:
        assert "emc_freq" in names


@needs_crds
@pytest.mark.parametrize("profile", ["orin-agx-jp7", "thor"])
def test_discover_on_a_simulated_jetpack7_board_says_where_each_property_comes_from(profile):
    out = gpu_mapper("discover", "--sim", "1", "--sim-profile", profile, "--node-name", "jetson-1")
    assert out.returncode == 0, out.stderr
    (doc,) = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert_valid_kubeedge(doc, "discover")
    names = [p["name"] for p in doc["spec"]["properties"]]
    assert "# jetson-1-gpu0 (" in out.stdout and "where its properties come from" in out.stdout
    assert "#   nvpmodel: power_mode, power_mode_name" in out.stdout
    if profile == "thor":  # NVML serves what sysfs lacks: every property of the model is listed
        assert "#   nvml: utilization_gpu (no load file for this GPU in sysfs)" in out.stdout
        assert {"utilization_gpu", "memory_used", "processes", "health", "gpu_governor"} <= set(names)
        assert "left out" not in out.stdout
    else:  # NVML initialises and answers NotSupported: sysfs serves, what needs NVML is left out, and why
        assert "#   nvml:" not in out.stdout and "utilization_gpu" in names
        assert "#   processes: NVML answers NotSupported for its process lists" in out.stdout
        assert "processes" not in names and "memory_used" not in names


def test_discover_with_the_jetson_backend_reads_the_board_under_its_root_or_says_none_is_there(tmp_path):
    from mapper.edge.gpu.jetson import board_uuid
    from mapper.edge.gpu.simjetson import build_tree

    prof = build_tree(tmp_path / "board", "xavier-agx")
    out = gpu_mapper("discover", "--backend", "jetson", "--jetson-root", str(tmp_path / "board"), "--node-name", "x1")
    assert out.returncode == 0, out.stderr
    (doc,) = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert doc["spec"]["protocol"]["configData"]["uuid"] == board_uuid(prof.model, prof.serial)
    out = gpu_mapper("discover", "--backend", "jetson", "--jetson-root", str(tmp_path / "empty"), "--node-name", "x1")
    assert out.returncode == 1 and "no Tegra GPU under" in out.stderr and "Traceback" not in out.stderr
    out = gpu_mapper("discover", "--node-name", "x1", env={**os.environ, "GPU_MAPPER_BACKEND": "tegra"})
    assert out.returncode == 2 and "backend: must be auto, nvml or jetson" in out.stderr


def test_bad_configuration_is_a_clear_error_not_a_traceback(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("policies:\n  thermalThrottling: {maxTemp: 85, releaseTemp: 90}\n")
    out = gpu_mapper("run", "--sim", "1", "--config", str(cfg), "--node-name", "n1", "--data-dir", str(tmp_path))
    assert out.returncode == 2
    assert "releaseTemp" in out.stderr and "Traceback" not in out.stderr
    out = gpu_mapper("run", "--sim", "1", "--mqtt", "http://x", "--node-name", "n1")
    assert out.returncode == 2 and "mqtt" in out.stderr


def test_run_on_simulated_gpus_prints_a_live_table_and_stops_cleanly_on_ctrl_c(tmp_path):
    data = tmp_path / "data"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mapper.cli",
            "run",
            "--sim",
            "2",
            "--node-name",
            "demo-node",
            "--devices",
            str(REPO / "device-models" / "examples"),
            "--data-dir",
            str(data),
            "--metrics-addr",
            "127.0.0.1:0",
            "--print-interval",
            "0.5",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    # The table is read as it is printed, until it shows the example desired values applied (or 30 s pass).
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout or ()], daemon=True)
    reader.start()
    printed: list[str] = []
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not ("applied" in "".join(printed) and (data / "status.json").exists()):
            with contextlib.suppress(queue.Empty):
                printed.append(lines.get(timeout=0.2))
    finally:
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
        reader.join(5)
    while not lines.empty():
        printed.append(lines.get_nowait())
    stdout = "".join(printed)
    assert proc.returncode == 0, stderr[-3000:]
    assert "power W" in stdout and "demo-node-gpu0" in stdout
    assert "applied" in stdout, "the example desired values are applied and shown"
    assert "Traceback" not in stderr
    assert "start-up objects frozen" in stderr, "the start-up heap is frozen once everything has started"

    status = gpu_mapper("status", "--data-dir", str(data))
    assert status.returncode == 0, status.stderr
    assert "demo-node-gpu0" in status.stdout
    snap = MapperSnapshot.from_json((data / "status.json").read_text())
    assert snap.node == "demo-node" and len(snap.gpus) == 2 and snap.mode == "standalone"


def test_the_model_command_prints_every_committed_device_model():
    out = gpu_mapper("model")
    assert out.returncode == 0
    models = REPO / "device-models"
    assert out.stdout == (models / "nvidia-gpu.yaml").read_text() + (models / "nvidia-jetson.yaml").read_text()
    if crds_available():
        docs = list(yaml.safe_load_all(out.stdout))
        assert [d["metadata"]["name"] for d in docs] == ["nvidia-gpu", "nvidia-jetson"]
        for i, doc in enumerate(docs):
            assert_valid_kubeedge(doc, f"model[{i}]")


def test_decode_turns_a_batch_file_or_stdin_into_json_lines_and_survives_a_closed_pipe(tmp_path):
    import json

    from mapper.shared.model import Sample
    from mapper.wire.telemetry import encode_batch

    samples = [
        Sample(
            "GPU-89618e00-d3ce-45f0-9f33-cc961c3f41af",
            1_780_000_000_000 + i * 1000,
            {"temperature": 40 + i, "power_usage": 72.531 + i, "compute_mode": "default"},
        )
        for i in range(300)
    ]
    batch = encode_batch(samples, node="n1", device="default/gpu0", uuid=samples[0].uuid, boot_id="0a1b2c3d", seq=7)
    path = tmp_path / "batch.bin"
    path.write_bytes(batch.payload)
    out = gpu_mapper("decode", str(path))
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(rows) == 900
    assert rows[0] == {"ts_ms": 1_780_000_000_000, "device": "default/gpu0", "property": "temperature", "value": 40}
    assert {"ts_ms": 1_780_000_001_000, "device": "default/gpu0", "property": "power_usage", "value": 73.531} in rows
    from_stdin = gpu_mapper("decode", "-", input=None, stdin=path.open("rb"))
    assert from_stdin.stdout == out.stdout
    head = subprocess.run(
        f"{sys.executable} -m mapper.cli decode {path} | head -1",
        shell=True,
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert head.stdout.count("\n") == 1 and "Traceback" not in head.stderr


def test_freezing_the_start_up_heap_moves_live_objects_out_of_the_collectors_way():
    import gc

    from mapper.cli import freeze_startup_heap

    gc.unfreeze()
    try:
        young = [[i] for i in range(1000)]  # containers the collector tracks
        frozen = freeze_startup_heap()
        assert frozen == gc.get_freeze_count() and frozen >= len(young)
        assert gc.get_count()[0] < 100, "generation 0 is emptied by the collect before the freeze"
        later = [[i] for i in range(10)]
        assert gc.get_freeze_count() == frozen, "objects made afterwards stay with the collector"
        del later
    finally:
        gc.unfreeze()


def test_every_variable_the_help_names_is_one_the_settings_read():
    """The parser spells the variables itself (building it must not import either process's settings): each
    one a flag's help names is a variable ``mapper.edge.config`` or ``mapper.bridge.config`` reads."""
    import argparse
    import re

    from mapper.bridge.config import BRIDGE_ENV_KEYS, CONFIG_ENV
    from mapper.cli import build_parser
    from mapper.edge.config import ENV_KEYS

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    for command, known in (
        ("run", {*ENV_KEYS.values(), "GPU_MAPPER_CONFIG"}),
        ("bridge", {*BRIDGE_ENV_KEYS.values(), CONFIG_ENV}),
    ):
        named = {
            name
            for action in commands[command]._actions
            for name in re.findall(r"\b(GPU_MAPPER_[A-Z_]+)", action.help or "")
        }
        assert len(named) > 10, f"{command}: the help names only {sorted(named)}"
        assert named <= known, f"{command}: the help names {sorted(named - known)}, which no setting reads"
