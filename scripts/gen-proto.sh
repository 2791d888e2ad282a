#!/usr/bin/env bash
# Regenerate the Python stubs of DMI v1beta1 (mapper/edge/kubeedge/dmi/pb/) from proto/dmi.proto with grpcio-tools.
# The stubs are committed, so only run this after changing the .proto; tests/test_dmi_proto.py fails when the
# committed stubs and the .proto disagree. Needs grpcio-tools (in the project's [test] extra).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3
out=mapper/edge/kubeedge/dmi/pb

"$PYTHON" -m grpc_tools.protoc \
  --proto_path=proto \
  --python_out="$out" \
  --pyi_out="$out" \
  --grpc_python_out="$out" \
  proto/dmi.proto

# protoc writes a top-level `import dmi_pb2`; make it an absolute import of our package.
sed -i 's/^import dmi_pb2 as dmi__pb2$/from mapper.edge.kubeedge.dmi.pb import dmi_pb2 as dmi__pb2/' "$out/dmi_pb2_grpc.py"
grep -q '^from mapper.edge.kubeedge.dmi.pb import dmi_pb2 as dmi__pb2$' "$out/dmi_pb2_grpc.py" || {
  echo "gen-proto: could not fix the dmi_pb2 import in $out/dmi_pb2_grpc.py" >&2
  exit 1
}

[ -f "$out/__init__.py" ] || printf '"""Generated DMI v1beta1 stubs (scripts/gen-proto.sh); do not edit by hand."""\n' >"$out/__init__.py"
echo "gen-proto: regenerated $out from proto/dmi.proto with $("$PYTHON" -m grpc_tools.protoc --version)"
