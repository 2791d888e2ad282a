"""Every script in benchmarks/ runs, with tiny arguments, as a subprocess: it must exit 0 and print its JSON line
last, whose fields are checked for presence and sense (a benchmark nobody runs rots). A new script without an
entry in ``SMOKE`` fails ``test_every_benchmark_has_a_smoke_entry``. The figures are not judged: the smoke runs
are too short for that (docs/benchmarks.md holds the measured ones)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"

Check = Callable[[dict[str, Any], Path], None]


def _backlog(out: dict[str, Any], tmp: Path) -> None:
    assert out["samples_expected"] > 0 and out["samples_found"] == out["samples_expected"]
    assert out["lost"] == 0 and out["duplicated"] == 0, out["off_by_series"]
    assert out["all_queryable_s"] is not None and out["live_after_link_s"] is not None
    assert out["link_bytes_until_queryable"]["up"] >= out["backlog"]["payload_bytes"], "the backlog crossed the link"
    assert out["bridge"]["samples_written"] >= out["samples_expected"] and out["mapper_exit"] == 0
    assert out["sim_cost"] == "h200" and isinstance(out["target_met"], bool)


def _bridge(out: dict[str, Any], tmp: Path) -> None:
    assert out["samples"] > 0 and out["codec_samples_per_s"] > 0
    assert out["protobuf_lib_same_requests"] is True and out["protobuf_lib_samples"] == out["samples"]
    assert out["e2e_samples_in_prometheus"] >= out["samples"]
    assert isinstance(out["target_met"], bool) and out["target_codec_samples_per_s"] == 200_000


def _buffer(out: dict[str, Any], tmp: Path) -> None:
    assert out["samples"] > 0 and 0 < out["rows_after_compaction"] <= out["batches"]
    assert out["ours_file_bytes"] > 0 and out["ratio"] is not None and out["ratio"] > 0


def _csv(name: str) -> Check:
    def check(out: dict[str, Any], tmp: Path) -> None:
        assert out["benchmark"] == name and out["samples"] > 0
        rows = (tmp / f"{name}.csv").read_text().splitlines()
        assert len(rows) == out["samples"] + 1, "a header and one row per sample"

    return check


def _desired(out: dict[str, Any], tmp: Path) -> None:
    for path in ("eventbus", "dmi", "dmi_new_channel"):
        assert out[path]["changes"] == 3 and out[path]["timeouts"] == 0 and out[path]["p50_ms"] > 0, path
    assert out["reload"]["reloads"] == 1 and out["dmi_startup"]["changes"] == 8
    assert out["live"]["messages"] > 0


def _dmi_report(out: dict[str, Any], tmp: Path) -> None:
    assert out["rpcs"] > 0 and out["rpcs_per_s"] <= 1.0 and out["edgecore_refusals"] == 0


def _encode(out: dict[str, Any], tmp: Path) -> None:
    assert out["batches"] > 0 and out["values_per_batch"] > 0 and out["us_per_batch"] > 0


def _health(out: dict[str, Any], tmp: Path) -> None:
    results = out["results"]
    assert set(results) == {"xid79", "ecc_storm", "ecc_storm_no_reset", "probe_fail"}
    assert all(r["twin"].startswith("unhealthy") for r in results.values())
    assert results["ecc_storm_no_reset"]["recovered_s"] is None, "without a reset the GPU stays unhealthy"
    assert results["ecc_storm"]["recovered_s"] is not None


def _jetson(out: dict[str, Any], tmp: Path) -> None:
    assert out["properties"] > 0 and out["us_per_sample"] > 0 and out["raw_read_us_per_sample"] > 0


def _overhead(out: dict[str, Any], tmp: Path) -> None:
    assert out["report_cycle_ms"] == 1000, "the heavy configuration"
    assert out["mapper_cpu_pct_of_core"] > 0 and out["naive_cpu_pct_of_core"] > 0
    assert 0 < out["mapper_peak_rss_mb"] < 500 and "heavy_cpu_under_0.8_of_naive" in out["targets"]
    assert out["cadence"] == "heavy" and out["sim_cost"] == "h200" and out["naive"]["sim_cost"] == "h200"
    assert "heavy_cpu_under_0.8_of_naive" in out["target_keys"] and isinstance(out["target_met"], bool)


def _naive(out: dict[str, Any], tmp: Path) -> None:
    assert out["sent"] > 0 and out["seconds"] > 0


def _policy(out: dict[str, Any], tmp: Path) -> None:
    assert out["simulated_s"] == 60
    assert {"none", "naive", "policy", "policy_clocks"} <= set(out["results"])


def _policy_decide(out: dict[str, Any], tmp: Path) -> None:
    for scenario in ("inference", "heat"):
        # The smoke run's baseline is this checkout's own file: every decision the same.
        assert out[scenario]["calls"] > 0 and out[scenario]["mismatches"] == 0


def _processes(out: dict[str, Any], tmp: Path) -> None:
    assert out["cycle_ms_per_gpu"] > 0 and out["baseline_collect_sample_ms"] > 0


def _replay(out: dict[str, Any], tmp: Path) -> None:
    assert out["samples"] > 0 and out["batches"] > 0
    assert out["ours_samples_per_s"] > 0 and out["json_batches_samples_per_s"] > 0
    assert out["row_messages_samples_per_s"] > 0
    assert out["bytes_per_sample"] < out["json_batches_bytes_per_sample"]
    assert 0 < out["compacted_rows"] < out["batches"] and out["compacted_samples_per_s"] > 0
    assert isinstance(out["target_met"], bool) and out["target_peak_rss_mb"] == 60


def _sample(out: dict[str, Any], tmp: Path) -> None:
    assert out["nvml_calls_per_sample"] > 0 and out["us_per_sample"] > 0 and out["sim_us_per_sample"] > 0
    assert out["sim_cost"] == "none"


def _soak(out: dict[str, Any], tmp: Path) -> None:
    assert out["batches_lost"] == 0 and out["exit_code"] == 0 and out["batches_produced"] > 0
    assert sum(out["faults"].values()) > 0 and out["desired_limits_on_gpus_at_end"] is True


slow = pytest.mark.slow
#: script -> (arguments, check, marks); ``{tmp}`` and ``{port}`` (a mosquitto of the test's own) are filled in.
SMOKE: dict[str, tuple[list[str], Check, tuple[pytest.MarkDecorator, ...]]] = {
    "backlog.py": (["--smoke"], _backlog, (slow,)),
    "bridge.py": (["--smoke"], _bridge, (slow,)),
    "buffer.py": (["--hours", "0.02", "--gpus", "1", "--stream", "gen"], _buffer, ()),
    "csvstream.py": (["--gpus", "1", "--hours", "0.01", "--out", "{tmp}/csvstream.csv"], _csv("csvstream"), ()),
    "desired_latency.py": (["--smoke"], _desired, (slow,)),
    "dmi_report.py": (["--quick"], _dmi_report, ()),
    "encode.py": (["--batches-per-gpu", "1", "--repeats", "1"], _encode, ()),
    "health.py": (["--smoke"], _health, (slow,)),
    "jetson_sample.py": (["--samples", "10", "--repeats", "1"], _jetson, ()),
    "overhead.py": (["--heavy", "--seconds", "3", "--warmup-s", "3"], _overhead, (slow,)),
    "overhead_naive.py": (["--port", "{port}", "--gpus", "1", "--seconds", "1.5"], _naive, ()),
    "policy.py": (["--seconds", "60"], _policy, ()),
    "policy_decide.py": (["--smoke"], _policy_decide, ()),
    "processes.py": (["--gpus", "1", "--processes", "3", "--cycles", "5"], _processes, ()),
    "replay.py": (["--smoke"], _replay, ()),
    "sample.py": (["--samples", "40", "--repeats", "1"], _sample, ()),
    "soak.py": (["--smoke"], _soak, (slow,)),
    "streamgen.py": (["--gpus", "1", "--hours", "0.01", "--out", "{tmp}/streamgen.csv"], _csv("streamgen"), ()),
}


def test_every_benchmark_has_a_smoke_entry() -> None:
    scripts = sorted(p.name for p in BENCHMARKS.glob("*.py"))
    assert scripts, "no benchmarks found"
    missing = [s for s in scripts if s not in SMOKE]
    assert not missing, f"benchmarks without a smoke entry in tests/test_benchmarks.py: {missing}"
    assert not set(SMOKE) - set(scripts), "entries for scripts that are gone"


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "script", [pytest.param(name, marks=marks, id=name.removesuffix(".py")) for name, (_, _, marks) in SMOKE.items()]
)
def test_benchmark_runs_and_prints_its_json_line_last(script: str, tmp_path: Path, request: Any) -> None:
    args, check, _ = SMOKE[script]
    fill = {"tmp": str(tmp_path)}
    if any("{port}" in a for a in args):
        fill["port"] = str(request.getfixturevalue("mosquitto").port)
    argv = [sys.executable, str(BENCHMARKS / script), *(a.format(**fill) for a in args)]
    # This checkout's package first, whichever environment's interpreter runs the test (and so the scripts).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))))
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert lines, f"{script} printed nothing on stdout:\n{proc.stderr[-2000:]}"
    out = json.loads(lines[-1])
    assert isinstance(out, dict) and out, f"{script}'s last line is not a JSON object: {lines[-1][:200]}"
    check(out, tmp_path)
