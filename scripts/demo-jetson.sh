#!/usr/bin/env bash
# The Jetson demo: a simulated AGX Orin (the real Jetson backend over a simulated sysfs tree and nvpmodel) with
# its example Device. It runs beside scripts/demo.sh: its own data directory (.demo-jetson-data/) and port
# (127.0.0.1:9420), and the same broker address (127.0.0.1:1883; telemetry is buffered until one answers). The
# example Device (device-models/examples-jetson/, generated and tracked) is copied once into
# .demo-jetson-data/devices/: edit that copy while it runs. Extra arguments go to `gpu-mapper run` and win over
# these (e.g. scripts/demo-jetson.sh --sim-profile thor).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
data=.demo-jetson-data
if [ ! -d "$data/devices" ]; then
  mkdir -p "$data"
  cp -R device-models/examples-jetson "$data/devices"
fi
echo "demo-jetson: a simulated AGX Orin; its Device is $data/devices/demo-jetson.yaml: edit it while this runs;" \
  "http://127.0.0.1:9420/status; Ctrl-C stops it" >&2
exec .venv/bin/gpu-mapper run --sim 1 --sim-profile orin-agx --node-name demo-jetson --devices "$data/devices" \
  --data-dir "$data" --metrics-addr 127.0.0.1:9420 --print-interval 2 --mqtt mqtt://127.0.0.1:1883 "$@"
