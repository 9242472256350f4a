#!/usr/bin/env bash
# The wheels the HTTP gateway (and `bench serve --plot`) need on a GPU host without a package index (Python 3.12,
# x86_64), downloaded here into DIR (default .whl/, where bench/gpu_run.sh and bench/gpu_serve.sh install from):
#   bash bench/gateway_wheels.sh [DIR] [--plot]
# fastapi + uvicorn (+ httptools and uvloop, which uvicorn uses when present) pull starlette, pydantic, pydantic-core (the one binary wheel), anyio, idna, h11, click,
# typing-extensions, typing-inspection, annotated-types, annotated-doc, opentelemetry-api (~8 MiB in all).
# --plot adds matplotlib and its dependencies (contourpy, cycler, fonttools, kiwisolver, packaging, pillow, pyparsing,
# python-dateutil, tzdata: ~24 MiB more; numpy is on the host already and is left out).
set -euo pipefail
DIR=${1:-.whl}
PY=${PY:-python3}
mkdir -p "$DIR"
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64)
"$PY" -m pip download -q "${TARGET[@]}" -d "$DIR" fastapi uvicorn httptools uvloop
if [ "${2:-}" = --plot ]; then
  "$PY" -m pip download -q "${TARGET[@]}" -d "$DIR" matplotlib
  rm -f "$DIR"/numpy-*.whl  # the host's numpy stays
fi
ls -1 "$DIR"
