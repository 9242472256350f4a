#!/usr/bin/env bash
# Offline throughput with an engine setting at each of its values, paired runs on one GPU (FLAG=--setting,
# VALUES="v1 v2"; RUNS pairs, default "a b": the values in order for run a, reversed for run b, so neither value
# always goes first): bench/gpu_run.sh's offline steps (STEPS, default the Qwen3-0.6B workload with the bf16 and the
# FP8 cache).
#
#   FLAG=--split-mixed-decodes VALUES="0 32" OUT=DIR SHARDSERVE_COMMIT=<hash> bash bench/offline_ab.sh
# Outputs: log.txt (one line a run: out tok/s and decode-only seconds per step) and results.tgz (each run's
# gpu_run.sh outputs: results.jsonl, log.txt, summary.txt). Few files: the device machine returns only so many.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
: "${FLAG:?FLAG=--setting names the engine flag}"; : "${VALUES:?VALUES names its values}"; RUNS=${RUNS:-"a b"}
STEPS=${STEPS:-"offline_qwen3 offline_qwen3_fp8"}
WORK=$(mktemp -d)
say() { echo "[offline_ab $SECONDS s] $*" | tee -a "$OUT/log.txt"; }
reversed() { local out=; for v in $1; do out="$v $out"; done; echo $out; }
i=0
for run in $RUNS; do
  order=$VALUES; (( i++ % 2 )) && order=$(reversed "$VALUES")
  for v in $order; do
    name=${FLAG#--}-${v}-$run
    EXTRA_FLAGS="$FLAG $v" ONLY="$STEPS" BUDGET_S=${STEP_BUDGET_S:-200} OUT="$WORK/$name" bash bench/gpu_run.sh > /dev/null 2>&1
    python3 - "$WORK/$name/results.jsonl" "$name" <<'PY' 2>&1 | tee -a "$OUT/log.txt"
import json, sys
try:
    lines = open(sys.argv[1]).read().splitlines()
except OSError as exc:
    print(f"{sys.argv[2]}: no records ({exc})")
    lines = []
for line in lines:
    r = json.loads(line)
    p = r["notes"].get("phases", {})
    by = {k: round(v["ms_per_step"], 2) for k, v in p.get("decode_by_batch", {}).items()}
    print(f"{sys.argv[2]} {r['step']}: {r['output_tokens_per_s']:.0f} out tok/s, decode-only {p.get('decode_s', 0):.3f} s,"
          f" prefill steps {p.get('prefill_s', 0):.3f} s, ms a step by batch {by}")
PY
  done
done
tar -C "$WORK" -czf "$OUT/results.tgz" . && say "results.tgz written"
