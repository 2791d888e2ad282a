#!/usr/bin/env bash
# Runs the mapper on 4 simulated GPUs with the example Devices: no GPU, no EdgeCore and no broker needed.
# Telemetry goes to the MQTT broker on 127.0.0.1:1883 when there is one; until one appears it is buffered in
# SQLite (.demo-data/) and replayed when it does. Extra arguments go to `gpu-mapper run` and win over these
# (e.g. scripts/demo.sh --mqtt mqtt://broker:1883).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
exec .venv/bin/gpu-mapper run --sim 4 --node-name demo-node --devices device-models/examples \
  --data-dir .demo-data --metrics-addr 127.0.0.1:9410 --print-interval 2 --mqtt mqtt://127.0.0.1:1883 "$@"
