#!/usr/bin/env bash
# Shared set-up for scripts/demo.sh and scripts/test.sh: a virtual environment in .venv with the project
# installed (editable) and, with --test, everything the tests need (mosquitto, promtool, the push tests' database
# servers, Python test deps).
# Safe to run again: it skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

want_test=0
[ "${1:-}" = "--test" ] && want_test=1

need_apt=()
command -v python3 >/dev/null || need_apt+=(python3 python3-venv)
python3 -c 'import venv, ensurepip' 2>/dev/null || need_apt+=(python3-venv)
if [ "$want_test" = 1 ]; then
  command -v mosquitto >/dev/null || [ -x /usr/sbin/mosquitto ] || need_apt+=(mosquitto)
  # prometheus: promtool, and the real server the bridge tests write to (remote-write receiver)
  { command -v promtool >/dev/null && command -v prometheus >/dev/null; } || need_apt+=(prometheus)
  # headless Chromium: the dashboard preview page (deploy/grafana/preview.html) rendered and screenshotted
  command -v chromium-headless-shell >/dev/null || command -v chromium >/dev/null || need_apt+=(chromium-headless-shell)
  # gcc builds the stand-in libnvidia-ml.so.1 the NVML tests run the real pynvml over (tests/nvml_standin.py)
  command -v gcc >/dev/null || need_apt+=(gcc)
  [ -f /usr/include/stdlib.h ] || need_apt+=(libc6-dev)
  # The image build and its test (tests/test_image.py): Debian's root filesystem, podman to import and run it
  # (runc as well: crun refuses hosts with a hybrid cgroup hierarchy).
  command -v mmdebstrap >/dev/null || need_apt+=(mmdebstrap)
  command -v podman >/dev/null || need_apt+=(podman)
  command -v runc >/dev/null || need_apt+=(runc)
  # The push writers' real servers (tests/dbservers.py): Redis (and redis-cli), MariaDB, VictoriaMetrics (it
  # takes InfluxDB's /api/v2/write). Each test starts its own on a free port; the packages' services are not used.
  { command -v redis-server >/dev/null && command -v redis-cli >/dev/null; } || need_apt+=(redis-server redis-tools)
  { command -v mariadbd >/dev/null || [ -x /usr/sbin/mariadbd ]; } || need_apt+=(mariadb-server)
  command -v victoria-metrics >/dev/null || need_apt+=(victoria-metrics)
fi
if [ "${#need_apt[@]}" -gt 0 ]; then
  echo "installing Debian packages: ${need_apt[*]}" >&2
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
stamp_of() { echo ".venv/.installed-$( (cat pyproject.toml; echo "$1") | sha1sum | cut -c1-12)"; }
stamp=$(stamp_of "$want_test")
# An install with the test dependencies serves the demo too (scripts/demo.sh after scripts/test.sh installs nothing).
if [ ! -f "$stamp" ] && { [ "$want_test" = 1 ] || [ ! -f "$(stamp_of 1)" ]; }; then
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  if [ "$want_test" = 1 ]; then
    .venv/bin/python -m pip install -q -e '.[test]'
  else
    .venv/bin/python -m pip install -q -e .
  fi
  rm -f .venv/.installed-*
  touch "$stamp"
fi
nvml_floor=12.535.77
if [ "$want_test" = 1 ] && [ ! -d ".venv/nvml-floor/nvidia_ml_py-$nvml_floor.dist-info" ]; then
  # The oldest nvidia-ml-py pyproject allows (nvidia-ml-py>=12.535), beside the installed one: the NVML tests run
  # the backend over both (tests/nvml_standin.py FLOOR_VERSION; tests/test_nvml_surface.py checks the two agree).
  .venv/bin/python -m pip install -q --no-deps --upgrade --target .venv/nvml-floor "nvidia-ml-py==$nvml_floor"
fi
