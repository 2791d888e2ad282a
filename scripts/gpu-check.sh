#!/usr/bin/env bash
# One go on a machine lent with a real NVIDIA GPU, READ-ONLY (no setter reaches the driver, no nvidia-smi flag
# that changes state): the gpu-marked tests over the real driver, then the overhead benchmark in its real-hardware
# mode (measured beside the projection over the simulator with the h200 cost profile, same GPU count).
# Budget: at most 20 + 240 + 300 s = 9 min 20 s of timeouts, under the 10 minutes a device command may run.
# Results: the pytest summary and the benchmark's JSON line on stdout, and in $OUT (when set) as
# gpu-tests.txt, overhead-real.json and overhead-real.stderr.txt.
#
# Python: $PYTHON, else the checkout's .venv, else python3. A lent device machine has no .venv (too big to carry)
# and no network: its python3 has nvidia-ml-py, grpcio, protobuf, prometheus-client, PyYAML, pytest and
# pytest-timeout; carry the rest as wheels in .whl/ (paho-mqtt, zstandard, bcrypt, pytest-asyncio, and whatever
# `pip check` there says; docs of the device tool: `pip download --platform manylinux... -d .whl`): they are
# installed into /tmp/site first. mosquitto is not in that image either: carry its .deb files (mosquitto and the
# libraries it needs, `apt-get download`) in .deb/; they are unpacked under /tmp/debroot, never into /.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
[ -n "$PY" ] || { [ -x .venv/bin/python ] && PY=.venv/bin/python; } || PY=python3
OUT_DIR="${OUT:-$(mktemp -d)}"
export PATH="$PWD/.venv/bin:/usr/sbin:$PATH"
if compgen -G ".whl/*.whl" >/dev/null; then
  echo "== installing the carried wheels into /tmp/site"
  timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || echo "gpu-check: installing .whl/ failed" >&2
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
if compgen -G ".deb/*.deb" >/dev/null; then
  for f in .deb/*.deb; do dpkg -x "$f" /tmp/debroot; done
  export PATH="/tmp/debroot/usr/sbin:/tmp/debroot/usr/bin:$PATH"
  export LD_LIBRARY_PATH="/tmp/debroot/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
status=0
echo "== python: $PY ($("$PY" --version 2>&1))"

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
