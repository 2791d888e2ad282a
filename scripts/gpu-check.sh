#!/usr/bin/env bash
# One go on a machine lent with a real NVIDIA GPU, READ-ONLY (no setter reaches the driver, no nvidia-smi flag
# that changes state): the gpu-marked tests over the real driver, then the overhead benchmark in its real-hardware
# mode (measured beside the projection over the simulator with the h200 cost profile, same GPU count).
# Budget: at most 20 + 240 + 300 s = 9 min 20 s, under the 10 minutes a device command may run.
# Results: the pytest summary and the benchmark's JSON line on stdout, and in $OUT (when set) as
# gpu-tests.txt, overhead-real.json and overhead-real.stderr.txt.
# Needs: the checkout's .venv (or PYTHON=...), mosquitto on PATH or in /usr/sbin, gcc (the stand-in library the
# tests import is built on first use). Usage: scripts/gpu-check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
OUT_DIR="${OUT:-$(mktemp -d)}"
export PATH="$PWD/.venv/bin:/usr/sbin:$PATH"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0

echo "== the GPUs (nvidia-smi -L, read-only)"
timeout 20 nvidia-smi -L || echo "nvidia-smi -L failed or is absent (NVML may still answer)"
command -v mosquitto >/dev/null || [ -x /usr/sbin/mosquitto ] || {
  echo "gpu-check: mosquitto is needed by the benchmark and is not installed" >&2
  status=1
}

echo "== gpu-marked tests over the real driver (the stand-in parameters left out: the floor binding needs PyPI)"
timeout 240 "$PY" -m pytest -q -p no:cacheprovider -m gpu -k "real and not standin" tests/test_nvml_real_gpu.py \
  2>&1 | tee "$OUT_DIR/gpu-tests.txt"
rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] || { echo "gpu-check: the gpu tests exited $rc" >&2; status=1; }
grep -q " passed" "$OUT_DIR/gpu-tests.txt" || { echo "gpu-check: no gpu test passed (all skipped: no usable GPU?)" >&2; status=1; }

echo "== benchmarks/overhead.py --real --quick (read-only; then the projection over the simulator)"
timeout 300 "$PY" benchmarks/overhead.py --real --quick >"$OUT_DIR/overhead-real.json" \
  2>"$OUT_DIR/overhead-real.stderr.txt"
rc=$?
tail -n 20 "$OUT_DIR/overhead-real.stderr.txt" >&2
tail -n 1 "$OUT_DIR/overhead-real.json"
[ "$rc" -eq 0 ] || { echo "gpu-check: overhead.py --real exited $rc" >&2; status=1; }
exit "$status"
