#!/usr/bin/env bash
# Regenerate server/proto/jaxmoe_pb2.py and jaxmoe_pb2_grpc.py from jaxmoe.proto.
# Needs grpcio-tools (pip install grpcio-tools). Run from anywhere.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
python="${PYTHON:-python}"
"$python" -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. server/proto/jaxmoe.proto
echo "generated server/proto/jaxmoe_pb2.py, jaxmoe_pb2.pyi, jaxmoe_pb2_grpc.py"
