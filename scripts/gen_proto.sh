#!/usr/bin/env bash
# Regenerate the Python stubs for api/runtime/v1/api.proto.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
"$PYTHON" -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. api/runtime/v1/api.proto
