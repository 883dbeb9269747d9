#!/usr/bin/env bash
# Regenerate server/proto/jaxmoe_pb2.py, .pyi and jaxmoe_pb2_grpc.py from jaxmoe.proto.
# The folder installs as the package jaxmoe.server.proto (setup.py), so the proto is compiled from a
# temporary tree with that path: the generated code then imports jaxmoe.server.proto.jaxmoe_pb2.
# Needs grpcio-tools (pip install grpcio-tools). Run from anywhere.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
python="${PYTHON:-python}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/jaxmoe/server/proto"
cp "$here/jaxmoe.proto" "$tmp/jaxmoe/server/proto/"
(cd "$tmp" && "$python" -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. jaxmoe/server/proto/jaxmoe.proto)
cp "$tmp"/jaxmoe/server/proto/jaxmoe_pb2.py "$tmp"/jaxmoe/server/proto/jaxmoe_pb2.pyi "$tmp"/jaxmoe/server/proto/jaxmoe_pb2_grpc.py "$here/"
echo "generated server/proto/jaxmoe_pb2.py, jaxmoe_pb2.pyi, jaxmoe_pb2_grpc.py"
