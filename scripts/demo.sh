#!/usr/bin/env bash
# Runs the mapper on 4 simulated GPUs with the example Devices: no GPU, no EdgeCore and no broker needed.
# Telemetry goes to the MQTT broker on 127.0.0.1:1883 when there is one; until one appears it is buffered in
# SQLite (.demo-data/) and replayed when it does. The example Devices (device-models/examples/, generated and
# tracked) are copied once into .demo-data/devices/: edit that copy while it runs (delete it to start over).
# /metrics, /healthz, /readyz and /status on 127.0.0.1:9410. Extra arguments go to `gpu-mapper run` and win over
# these (e.g. scripts/demo.sh --mqtt mqtt://broker:1883).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
data=.demo-data
if [ ! -d "$data/devices" ]; then
  mkdir -p "$data"
  cp -R device-models/examples "$data/devices"
fi
echo "demo: 4 simulated GPUs; the Devices are $data/devices/demo-node.yaml: edit it while this runs" \
  "(the mapper picks a change up within 2 s); http://127.0.0.1:9410/status; Ctrl-C stops it" >&2
exec .venv/bin/gpu-mapper run --sim 4 --node-name demo-node --devices "$data/devices" \
  --data-dir "$data" --metrics-addr 127.0.0.1:9410 --print-interval 2 --mqtt mqtt://127.0.0.1:1883 "$@"
