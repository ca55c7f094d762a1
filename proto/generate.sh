#!/usr/bin/env bash
# Regenerates the Python stubs for meshca's wire contracts. Run from anywhere:
#   proto/generate.sh [OUT_DIR]
# OUT_DIR defaults to proto/ itself; tests call it with a temporary directory and compare, so
# committed stubs that drift from the .proto files fail CI.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:-$here}"
python="${PYTHON:-python3}"
"$python" -m grpc_tools.protoc -I "$here" \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  "$here/meshca_proto/ca.proto" "$here/meshca_proto/report.proto" \
  "$here/meshca_proto/jwt_svid.proto"
# The SPIFFE Workload API: messages only. Its service is registered by hand under the
# specification's unpackaged name (see the header of workload.proto and agent/workload/api.py).
"$python" -m grpc_tools.protoc -I "$here" \
  --python_out="$out" --pyi_out="$out" \
  "$here/meshca_proto/workload.proto"
