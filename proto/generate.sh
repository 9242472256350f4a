#!/usr/bin/env bash
# Regenerates the committed Python stubs of proto/*.proto (run by `make proto`).
#
# Usage: proto/generate.sh [OUT_DIR]   (default: proto/ itself; the staleness test passes a temp dir)
#
# The stubs must import each other as `shardserve.proto.x_pb2`, the installed package name, while the .proto
# files live in proto/. So protoc sees them through a temp folder where shardserve/proto is a symlink to proto/:
# with `-I <temp>` their import path, and therefore the generated imports, read shardserve/proto/x.proto.
#
# Use grpcio-tools==1.84.0 (PYTHON defaults to the repo's .venv): the stubs pin their runtime to at least the
# versions that generated them, and the GPU hosts have grpcio 1.84.0 and protobuf 7.36.2.
set -euo pipefail

proto_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo_dir="$(dirname "$proto_dir")"
out_dir="$(mkdir -p "${1:-$proto_dir}" && cd "${1:-$proto_dir}" && pwd)"
python="${PYTHON:-$repo_dir/.venv/bin/python}"
[[ -x "$python" ]] || python="$(command -v python3)"

tools_version="$("$python" -c 'from importlib.metadata import version; print(version("grpcio-tools"))')"
if [[ "$tools_version" != "1.84.0" ]]; then
  echo "generate.sh: need grpcio-tools==1.84.0 (found $tools_version in $python)" >&2
  exit 1
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/include/shardserve" "$work/out"
ln -s "$proto_dir" "$work/include/shardserve/proto"

cd "$work/include"
"$python" -m grpc_tools.protoc -I . \
  --python_out="$work/out" --pyi_out="$work/out" --grpc_python_out="$work/out" \
  shardserve/proto/*.proto

cp "$work/out/shardserve/proto/"*_pb2*.py* "$out_dir/"
